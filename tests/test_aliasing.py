"""Outputs sharing memory with an input or another output: refused before any launch, with
nothing written, for every strategy; tensors carved side by side from one workspace (and an
input in the gap between a pool window's rows) are accepted and exact. On a GPU the calls
take the one-pass paths first (``_launched``), which leave such calls to the ordered checks.
"""

from __future__ import annotations

import pytest
import torch
from _helpers import (
    PLAN_SHARED,
    inputs_between_rows,
    plan_call,
    pool_sharing_an_input,
    random_step,
    rejected,
    share_plan_memory,
)
from conftest import DEVICE
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kvcanary_dispatch import (
    PLAN_STRATEGIES,
    SCATTER_STRATEGIES,
    launch_plan_offsets_kernel,
    plan_offsets,
    scatter_req_token_ids,
)
from kvcanary_dispatch.aliasing import Span, _first_in_range, meet, runs_disjoint, span_of
from kvcanary_dispatch.capacities import CanaryCapacities
from kvcanary_dispatch.forward_step import ForwardStepGuard
from kvcanary_dispatch.scatter import _pool_shares_memory
from kvcanary_dispatch.testing.cases import (
    POISON_I32,
    POISON_I64,
    assert_bytes_equal,
    make_scatter_case,
)
from kvcanary_dispatch.testing.engine_steps import poison_
from kvcanary_kernels.args import SCRATCH_NAME, bundle_plan_args
from kvcanary_kernels.plan_checks import checked_plan_head, plan_head_sizes
from kvcanary_kernels.references import plan_offsets_ref, scatter_req_token_ids_ref


def _bytes(s: Span) -> set[int]:
    return {s.start + r * s.pitch + k for r in range(s.rows) for k in range(s.width)}


@st.composite
def spans(draw: st.DrawFn, rows: int) -> Span:
    width = draw(st.integers(0, 6))  # rows may overlap (pitch < width) or coincide (pitch 0)
    return Span(draw(st.integers(0, 60)), rows, draw(st.integers(0, 12)), width)


@settings(max_examples=2000)  # pure arithmetic: a few ms
@given(a=st.integers(1, 6).flatmap(spans), b=st.integers(1, 6).flatmap(spans), swap=st.booleans())
@example(a=Span(10, 1, 0, 4), b=Span(6, 1, 0, 4), swap=False)  # adjacent runs share nothing
@example(a=Span(0, 2, 8, 4), b=Span(4, 1, 0, 2), swap=True)  # a run in the gap between rows
@example(a=Span(0, 3, 8, 4), b=Span(4, 3, 8, 4), swap=False)  # rows interleaved, none shared
@example(a=Span(0, 3, 8, 4), b=Span(5, 4, 6, 1), swap=False)  # b's row 2 in a's row 2
@example(a=Span(0, 5, 12, 3), b=Span(4, 5, 8, 2), swap=True)  # a's row 2 holds b's row 4
def test_meet_is_whether_two_spans_share_a_byte(a: Span, b: Span, swap: bool) -> None:
    """``meet`` against the two sets of bytes, rows against rows, either way round."""
    assert meet(*((b, a) if swap else (a, b))) == bool(_bytes(a) & _bytes(b))


@settings(max_examples=2000)
@given(
    m=st.integers(1, 300),
    step=st.integers(0, 299),
    start=st.integers(0, 299),
    lo=st.integers(0, 299),
    length=st.integers(0, 299),
)
def test_first_in_range_is_the_least_step_that_lands_in_range(m, step, start, lo, length):
    """``_first_in_range`` against a walk over a whole period (``m`` steps)."""
    step, start, lo = step % m, start % m, lo % m
    hi = min(lo + length, m - 1)
    walk = [k for k in range(m) if lo <= (start + k * step) % m <= hi]
    assert _first_in_range(step, start, m, lo, hi) == (walk[0] if walk else None)


def test_meet_decides_many_rows_in_few_steps():
    """Spans of 2**40 rows: answered without a walk over rows, and exactly. One-byte rows at
    multiples of 1000 against rows at 1 + 7 j: they first meet at j = 857 (6 000, a's row 6)."""
    a = Span(0, 2**40, 1000, 1)
    assert meet(a, Span(1, 858, 7, 1)) and meet(Span(1, 2**40, 7, 1), a)
    assert not meet(a, Span(1, 857, 7, 1))
    assert not meet(Span(0, 2**40, 12, 4), Span(5, 2**40, 24, 2))  # 5 and 6 mod 12, a 0 to 3
    assert meet(Span(0, 2**40, 12, 4), Span(5, 2**40, 20, 2))  # b's row 1 in a's row 2


@given(st.lists(st.tuples(st.integers(0, 40), st.integers(0, 6)), max_size=6))
def test_runs_disjoint_is_whether_no_two_runs_share_a_byte(runs: list[tuple[int, int]]) -> None:
    """``runs_disjoint`` against the runs' bytes, empty runs included."""
    sets = [set(range(s, s + n)) for s, n in runs]
    shared = any(a & b for k, a in enumerate(sets) for b in sets[k + 1 :])
    assert runs_disjoint([s for s, _ in runs], [s + n for s, n in runs]) == (not shared)


@given(
    rows=st.integers(1, 4),
    cols=st.integers(1, 4),
    row_stride=st.integers(0, 9),
    col_stride=st.integers(0, 9),
    offset=st.integers(0, 3),
    other=st.integers(1, 4).flatmap(spans),
)
@example(rows=2, cols=2, row_stride=0, col_stride=1, offset=0, other=Span(40, 1, 0, 4))  # pitch 0
@example(rows=3, cols=1, row_stride=4, col_stride=2, offset=0, other=Span(44, 1, 0, 4))  # a gap
@example(rows=2, cols=2, row_stride=2, col_stride=1, offset=0, other=Span(48, 1, 0, 4))  # abut
@example(rows=1, cols=4, row_stride=0, col_stride=2, offset=0, other=Span(44, 4, 8, 4))  # stride
@example(rows=3, cols=2, row_stride=1, col_stride=4, offset=0, other=Span(48, 2, 16, 8))  # .T
@example(rows=3, cols=2, row_stride=2, col_stride=0, offset=0, other=Span(44, 3, 8, 4))  # expand
def test_span_of_holds_exactly_the_bytes_of_a_vector_or_of_rows(
    rows, cols, row_stride, col_stride, offset, other
):
    """``span_of`` covers every byte of a strided 2-D view (overlapping, expanded, transposed
    and one-row or one-column views included), and exactly its bytes for a vector of any stride
    and for rows of contiguous or expanded elements; so ``meet`` with another span is never
    false where they share a byte, and exact for those."""
    base = torch.zeros(64, dtype=torch.int32)
    t = base.as_strided((rows, cols), (row_stride, col_stride), offset)
    size = t.element_size()
    own = {
        t.data_ptr() + (r * row_stride + c * col_stride) * size + k
        for r in range(rows)
        for c in range(cols)
        for k in range(size)
    }
    span = span_of(t)
    assert own <= _bytes(span)
    other = other._replace(start=other.start + t.data_ptr() - 40)  # before, in or after t
    shared = bool(own & _bytes(other))
    assert meet(span, other) >= shared
    if rows == 1 or cols == 1 or min(row_stride, col_stride) <= 1:
        assert _bytes(span) == own
        assert meet(span, other) == shared


@pytest.mark.parametrize("strategy", PLAN_STRATEGIES)
@pytest.mark.parametrize("bs", [5, 300])
@pytest.mark.parametrize(("out", "other"), PLAN_SHARED, ids=[f"{o}-{t}" for o, t in PLAN_SHARED])
def test_plan_refuses_outputs_sharing_memory(strategy, bs, out, other):
    inputs, outputs = plan_call(bs, lut=True, device=DEVICE)
    share_plan_memory(inputs, outputs, out, other)
    tensors = [t for t in (*inputs.values(), *outputs.values()) if isinstance(t, torch.Tensor)]
    call = lambda: plan_offsets(**inputs, **outputs, strategy=strategy)  # noqa: E731
    message = rejected(ValueError, call, tensors)
    assert f"plan_offsets {out} shares memory with {other}; pass outputs that" in message


@pytest.mark.parametrize("out", ["out_write_seed_slot_indices", "out_verify_num_valid"])
@pytest.mark.parametrize(
    "other",
    [
        *("req_pool_indices", "prefix_lens", "extend_seq_lens"),
        *("req_to_token", "full_to_swa_index_mapping"),
    ],
)
def test_plan_refuses_an_output_on_an_inputs_last_element(other, out):
    """An output whose first element lies on the last element of an input (a request vector,
    the int32 table, the LUT; an int32 scalar output: on its last int32 word only) shares
    memory with it: refused, nothing written. (``PLAN_SHARED`` puts an output on an input's
    first element.)"""
    inputs, outputs = plan_call(5, lut=True, device=DEVICE)
    o, t = outputs[out], inputs[other]
    if o.dtype == torch.int32:
        o = t.view(-1).view(torch.int32)[-1:]
    else:
        n = t.numel() * t.element_size() // 8  # the input in int64 words
        assert n * 8 == t.numel() * t.element_size(), other
        ws = torch.empty(n + o.numel() - 1, dtype=torch.int64, device=DEVICE)
        ws[n - 1 :], ws[:n] = o, t.view(-1).view(torch.int64)  # the input's values kept
        inputs[other], o = ws[:n].view(t.dtype).view(t.shape), ws[n - 1 :]
    outputs[out] = o
    tensors = [t for t in (*inputs.values(), *outputs.values()) if isinstance(t, torch.Tensor)]
    call = lambda: plan_offsets(**inputs, **outputs)  # noqa: E731
    message = rejected(ValueError, call, tensors)
    assert f"plan_offsets {out} shares memory with {other}; pass outputs that" in message


@pytest.mark.parametrize("strategy", PLAN_STRATEGIES)
def test_plan_accepts_tensors_side_by_side_in_one_workspace(strategy):
    """Every int64 vector, inputs and outputs, back to back in one buffer, the int32 scalars in
    another: no byte shared, so the call runs and equals the reference."""
    inputs, outputs = plan_call(300, lut=True, device=DEVICE)
    names = ["req_pool_indices", "prefix_lens", "extend_seq_lens", "full_to_swa_index_mapping"]
    wide = {n: outputs[n] for n in list(outputs)[:3]}
    carved = {**{n: inputs[n] for n in names}, **wide}
    ws = torch.empty(sum(t.numel() for t in carved.values()), dtype=torch.int64, device=DEVICE)
    small = torch.full((3,), POISON_I32, dtype=torch.int32, device=DEVICE)
    at = 0
    for name, t in carved.items():
        ws[at : at + t.numel()] = t
        (inputs if name in inputs else outputs)[name] = ws[at : at + t.numel()]
        at += t.numel()
    for k, name in enumerate(list(outputs)[3:]):
        outputs[name] = small[k : k + 1]
    want = {n: t.clone() for n, t in outputs.items()}
    plan_offsets_ref(**inputs, **want)
    plan_offsets(**inputs, **outputs, strategy=strategy)
    for name, t in outputs.items():
        assert_bytes_equal(t, want[name], name)


@pytest.mark.parametrize("strategy", PLAN_STRATEGIES)
def test_plan_accepts_inputs_sharing_memory_with_each_other(strategy):
    """Inputs are only read: the same tensor as both lengths, and the LUT a view of the
    request indices, are a valid call that equals the reference."""
    inputs, outputs = plan_call(300, lut=True, device=DEVICE)
    inputs["extend_seq_lens"] = inputs["prefix_lens"]
    inputs["full_to_swa_index_mapping"] = inputs["req_pool_indices"][1:]
    inputs["verify_capacity"] = 10**6
    want = {n: t.clone() for n, t in outputs.items()}
    plan_offsets_ref(**inputs, **want)
    for _ in range(2):  # the second call was seen before: its outputs poisoned again
        poison_(*outputs.values())
        plan_offsets(**inputs, **outputs, strategy=strategy)
        for name, t in outputs.items():
            assert_bytes_equal(t, want[name], name)


def test_plan_looks_again_when_a_size_grows_into_an_output():
    """A call whose tensors passed is not looked at again only at the same addresses and sizes:
    the same request vectors, longer, now reaching the seed slots, are refused."""
    inputs, outputs = plan_call(300, lut=False, device=DEVICE)
    seeds = outputs["out_write_seed_slot_indices"]
    ws = torch.full((200 + seeds.numel(),), POISON_I64, dtype=torch.int64, device=DEVICE)
    ws[200:] = seeds
    outputs["out_write_seed_slot_indices"] = ws[200:]
    ws[:200] = inputs["req_pool_indices"][:200]
    short = {**inputs, "req_pool_indices": ws[:200]}
    short |= {n: inputs[n][:200] for n in ("prefix_lens", "extend_seq_lens")}
    short["verify_capacity"] = int(short["prefix_lens"].clamp(min=0).sum())
    for _ in range(2):
        plan_offsets(**short, **outputs)
    inputs["req_pool_indices"] = ws[:300]
    tensors = [ws, *outputs.values()]
    call = lambda: plan_offsets(**inputs, **outputs)  # noqa: E731
    message = rejected(ValueError, call, tensors)
    assert "out_write_seed_slot_indices shares memory with req_pool_indices" in message


@pytest.mark.parametrize("strategy", SCATTER_STRATEGIES)
@pytest.mark.parametrize("other", ["flat_in", "offsets", "req_pool_indices"])
@pytest.mark.parametrize("end", ["first", "last"])
def test_scatter_refuses_a_pool_sharing_memory(strategy, other, end):
    """``pool_out`` (int32) a view of the int64 memory an input reads, sharing one half of the
    input's first or last element only: refused, nothing written (on a GPU, the one pass's
    prefilter must see it too)."""
    case = make_scatter_case([3, 5, 0, 4], width=8, device=DEVICE)
    inputs, pool, ws = pool_sharing_an_input(case, other, end)
    call = lambda: scatter_req_token_ids(**inputs, pool_out=pool, strategy=strategy)  # noqa: E731
    message = rejected(ValueError, call, [ws])
    assert f"scatter_req_token_ids pool_out shares memory with {other}; pass" in message


def _scatter_with_inputs_between_rows(case, ws, pool, first: int, strategy: str) -> None:
    """The scatter into ``pool`` (a view of ``ws``) with its three inputs kept in row ``r`` of
    ``ws`` from int32 column ``first`` on (one input a row): see ``_scatter_beside_inputs``."""
    _scatter_beside_inputs(case, ws, pool, inputs_between_rows(case, ws, first), strategy)


def _scatter_beside_inputs(case, ws, pool, inputs: dict, strategy: str) -> None:
    """The scatter of ``inputs`` (``case``'s, kept in ``ws`` past the pool's columns) into
    ``pool`` (a view of ``ws``'s first columns): equal to the reference, and the columns past
    the pool's own left as they were."""
    cols = pool.shape[1]
    kept = ws[:, cols:].clone()
    want = case.fresh_pool()
    scatter_req_token_ids_ref(**case.inputs(), pool_out=want)
    scatter_req_token_ids(**inputs, pool_out=pool, strategy=strategy)
    assert_bytes_equal(pool, want, "pool_out")
    assert_bytes_equal(ws[:, cols:], kept, "the columns past the pool's")


@pytest.mark.parametrize("strategy", SCATTER_STRATEGIES)
def test_scatter_accepts_inputs_between_a_pool_windows_rows(strategy):
    """Inputs kept in the columns past a pool window's width, between its rows: no byte shared,
    so the call runs, equals the reference, and leaves those columns as they were."""
    case = make_scatter_case([3, 5, 0, 4], width=8, device=DEVICE)
    rows, width = case.pool_rows, case.width
    spare = 2 * max(t.numel() for t in case.inputs().values())  # int32 columns past the window
    ws = torch.full((rows, width + spare), POISON_I32, dtype=torch.int32, device=DEVICE)
    _scatter_with_inputs_between_rows(case, ws, ws[:, :width], width, strategy)


@given(bs=st.integers(1, 40), spare=st.integers(0, 5), room=st.integers(0, 5), lut=st.booleans())
def test_the_one_pass_head_carries_the_sizes_the_check_reads(bs, spare, room, lut):
    """``checked_plan_head``'s one pass keeps the element counts ``plan_head_sizes`` reads (the
    key of the shared-memory check's cache), whatever room the outputs have past the batch."""
    inputs, outputs = plan_call(bs, lut, device=DEVICE)
    grow = lambda t, n: torch.zeros(t.numel() + n, dtype=t.dtype, device=t.device)  # noqa: E731
    outputs["out_verify_offsets"] = grow(outputs["out_verify_offsets"], spare)
    outputs["out_write_offsets"] = grow(outputs["out_write_offsets"], room)
    outputs["out_write_seed_slot_indices"] = grow(outputs["out_write_seed_slot_indices"], room)
    i, o = bundle_plan_args({**inputs, **outputs}, "out_verify_offsets")
    head = checked_plan_head(i, o)
    assert head.sizes == plan_head_sizes(i, o)
    assert head.sizes == (
        bs,
        outputs["out_write_seed_slot_indices"].numel(),
        outputs["out_verify_offsets"].numel(),
        inputs["req_to_token"].numel(),
        inputs["full_to_swa_index_mapping"].numel() if lut else 0,
    )


@pytest.mark.parametrize("strategy", SCATTER_STRATEGIES)
def test_scatter_refuses_a_pool_sharing_the_callers_int32_offsets(strategy):
    """int32 ``offsets`` are widened into an int64 copy; a pool sharing memory with the
    caller's own int32 offsets is still refused, the offsets and the pool left as they were."""
    case = make_scatter_case([3, 5, 0, 4], width=8, device=DEVICE)
    inputs = case.inputs()
    pool = case.fresh_pool()
    n = inputs["offsets"].numel()
    offsets = pool.view(-1)[-n:]
    offsets.copy_(inputs["offsets"])
    inputs["offsets"] = offsets
    call = lambda: scatter_req_token_ids(**inputs, pool_out=pool, strategy=strategy)  # noqa: E731
    message = rejected(ValueError, call, [pool])
    assert "scatter_req_token_ids pool_out shares memory with offsets; pass" in message


@pytest.mark.parametrize("column", ["between the rows", "in the last pool column"])
@pytest.mark.parametrize("strategy", SCATTER_STRATEGIES)
def test_scatter_sees_strided_offsets_between_or_in_the_pools_rows(strategy, column):
    """int32 ``offsets`` (which may have any stride) kept down one column of the pool's
    workspace, a row apart: between the pool's rows they share no byte with it, so the call
    runs, equals the reference and leaves them as they were; in the pool's last column they
    share its bytes, and the call is refused with nothing written."""
    case = make_scatter_case([3, 5, 0, 4, 2, 1], width=4, device=DEVICE)
    n, width = case.bs + 1, case.width
    ws = torch.full((max(case.pool_rows, n), width + 1), POISON_I32, dtype=torch.int32)
    ws = ws.to(DEVICE)
    pool = ws[: case.pool_rows, :width]
    offsets = ws[:n, width if column == "between the rows" else width - 1]  # stride width + 1
    offsets.copy_(case.offsets)
    inputs = dict(case.inputs(), offsets=offsets)
    if column == "between the rows":
        _scatter_beside_inputs(case, ws, pool, inputs, strategy)
        return
    call = lambda: scatter_req_token_ids(**inputs, pool_out=pool, strategy=strategy)  # noqa: E731
    message = rejected(ValueError, call, [ws])
    assert "scatter_req_token_ids pool_out shares memory with offsets; pass" in message


@pytest.mark.parametrize("strategy", SCATTER_STRATEGIES)
def test_scatter_accepts_inputs_between_a_one_column_pools_rows(strategy):
    """A one-column pool whose column stride is not 1 (any stride is legal for one column)
    holds only its own elements: inputs kept between its rows are accepted, and the call
    equals the reference and leaves them as they were."""
    case = make_scatter_case([1, 0, 1, 1], width=1, device=DEVICE)
    pitch = 16  # int32 elements a row of the workspace; the pool's element first
    ws = torch.full((case.pool_rows, pitch), POISON_I32, dtype=torch.int32, device=DEVICE)
    pool = ws.as_strided((case.pool_rows, 1), (pitch, 2))
    _scatter_with_inputs_between_rows(case, ws, pool, 2, strategy)  # column 2: int64-aligned


@pytest.mark.parametrize(
    "lens,width,spare", [([0, 0, 0], 0, 1), ([], 4, 0)], ids=["no columns", "no rows"]
)
@pytest.mark.parametrize("strategy", SCATTER_STRATEGIES)
def test_scatter_accepts_an_empty_pool_beside_empty_inputs(strategy, lens, width, spare):
    """Empty tensors share no byte, though torch gives each of them the address 0: an empty
    pool (no columns, or no rows for no request) beside an empty ``flat_in`` (and no request
    indices) is a valid call, which runs and writes nothing."""
    case = make_scatter_case(lens, width=width, spare_rows=spare, device=DEVICE)
    pool = case.fresh_pool()
    assert pool.numel() == case.flat_in.numel() == 0
    scatter_req_token_ids(**case.inputs(), pool_out=pool, strategy=strategy)
    assert pool.shape == (case.pool_rows, width)


@pytest.mark.parametrize("length", ["prefix_lens", "extend_seq_lens"])
def test_guard_split_refuses_lengths_in_its_buffers_before_any_piece(length):
    """A split step whose first pieces are copies (a cut request) and whose later piece views
    the given lengths: lengths that live in the guard's own seed buffer are refused by
    ``plan_step`` itself, before any piece is planned (the pieces' own checks would refuse only
    the last one, after the copies' plans had written the buffers); nothing is written."""
    step = random_step([(1, 9, False), (1, 4, False)], device=DEVICE)
    guard = ForwardStepGuard(CanaryCapacities(2, 4, 100), "split", device=DEVICE)
    poison_(*guard.buffers.tensors().values())
    lengths = {k: v.to(DEVICE) for k, v in step.lengths().items()}
    seeds = guard.buffers.write_seed_slot_indices  # int64 [2], the capacity
    seeds.copy_(lengths[length])
    lengths[length] = seeds
    before = {k: v.clone() for k, v in guard.buffers.tensors().items()}
    with pytest.raises(ValueError) as err:
        guard.plan_step(**lengths, req_to_token=step.req_to_token, num_tokens=13)
    assert f"out_write_seed_slot_indices shares memory with {length}; pass outputs" in str(
        err.value
    )
    for k, v in guard.buffers.tensors().items():
        assert torch.equal(v, before[k]), k
    # The same lengths elsewhere: four pieces, the last a view of the given lengths.
    lengths[length] = seeds.clone()
    pieces = [
        buf.write_offsets[: sub.batch_size + 1].tolist()
        for sub, buf in guard.plan_step(**lengths, req_to_token=step.req_to_token)
    ]
    assert pieces == [[0, 4], [0, 4], [0, 1], [0, 4]], pieces


# The one pass's shared-memory prefilter (only a scatter on the current CUDA device takes the one
# pass, but the test itself is host arithmetic on addresses: checked here on any machine).


def _pool_shares(flat: int, offsets: int, indices: int, *, bs: int = 3, tokens: int = 4) -> bool:
    pool, rows, pitch, width = 1 << 20, 4, 8, 8  # int32 rows of 8 at 8: bytes [pool, pool+128)
    return _pool_shares_memory((flat, offsets, indices, pool), rows, pitch, width, tokens, bs)


def test_one_pass_sees_a_pool_sharing_only_the_last_offset():
    """``offsets`` has ``bs + 1`` elements: a pool that begins at its last one shares memory
    with it (the one pass must then leave the call to the full path, which refuses it); one
    that begins just past it does not."""
    pool, far = 1 << 20, 1 << 30
    bs = 3
    last_at_pool = pool - bs * 8  # offsets[bs] is the 8 bytes at ``pool``
    assert _pool_shares(far, last_at_pool, far + 4096, bs=bs)
    assert not _pool_shares(far, last_at_pool - 8, far + 4096, bs=bs)
    assert _pool_shares(far, far + 4096, pool - bs * 8 + 4, bs=bs)  # indices' last half-word
    assert not _pool_shares(far, far + 4096, pool - bs * 8, bs=bs)  # indices end at the pool


def test_plan_drop_in_names_its_scratch_sharing_memory():
    """The drop-in's verify offsets output sharing memory with an input is refused naming it by
    the drop-in's keyword, ``out_verify_offsets_scratch``, as its other refusals do."""
    inputs, outputs = plan_call(5, lut=True, device=DEVICE)
    share_plan_memory(inputs, outputs, "out_verify_offsets", "prefix_lens")
    outputs[SCRATCH_NAME] = outputs.pop("out_verify_offsets")
    tensors = [t for t in (*inputs.values(), *outputs.values()) if isinstance(t, torch.Tensor)]
    call = lambda: launch_plan_offsets_kernel(**inputs, **outputs)  # noqa: E731
    message = rejected(ValueError, call, tensors)
    assert f"plan_offsets {SCRATCH_NAME} shares memory with prefix_lens; pass" in message, message
