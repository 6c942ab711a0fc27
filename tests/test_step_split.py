"""A forward step split into sub-steps that fit the capacities: they cover the step exactly
once, in order, within both capacities, and their plans chain into the whole step's write
entries; the lengths a split takes (any integer width, sequences, int64's ends) and refuses.
Capacities and plan buffers: ``test_capacities.py``; the guard's policies:
``test_capacities_guard.py`` and ``test_guard_split.py``; where a step is cut (greedily) and
which sub-steps are views: ``test_step_split_cut.py``."""

from __future__ import annotations

import re
from functools import partial

import pytest
import torch
from _helpers import Step, random_step
from conftest import DEVICE
from hypothesis import example, given
from hypothesis import strategies as st

from kvcanary_dispatch.capacities import CanaryCapacities
from kvcanary_dispatch.forward_step import ForwardStepGuard, split_forward_step
from kvcanary_dispatch.step_split import SubStep, _token_count
from kvcanary_dispatch.testing.cases import POISON_I32, POISON_I64
from kvcanary_kernels import plan_offsets_ref

make_step = partial(random_step, device=DEVICE)


# ---------------------------------------------------------------- steps


def requests(max_extend: int = 60):
    padding = st.integers(0, 9).map(lambda v: v < 2)
    extend = st.one_of(st.just(0), st.integers(-2, 6), st.integers(7, max_extend))
    return st.tuples(st.integers(0, 12), extend, padding)


def capacities_for(bs: int, total: int, max_subs: int):
    """Capacities down to 1 that keep the sub-step count near ``max_subs``."""

    def cap(need: int):
        low = max(1, -(-need // max_subs))
        return st.integers(low, low + 3) | st.integers(low, max(need + 2, 2))

    return st.builds(CanaryCapacities, cap(bs), cap(total), st.integers(0, 400))


def check_cover(step: Step, caps: CanaryCapacities, subs) -> None:
    """Every (request, new token) exactly once and in order; every request in order; each
    sub-step within both capacities and consistent with its token range."""
    tokens = step.tokens
    bounds = [0]
    for n in tokens:
        bounds.append(bounds[-1] + n)
    seen_tokens, seen_reqs = [], []
    flat = 0
    for sub in subs:
        assert 0 < sub.batch_size <= caps.write_req_capacity or len(tokens) == 0 == len(subs) - 1
        assert sub.num_tokens <= caps.write_entry_capacity
        assert sub.token_start == flat
        assert sub.req_pool_indices.shape[0] == sub.batch_size
        sub_tokens = sub.extend_seq_lens.clamp(min=0).tolist()
        assert sum(sub_tokens) == sub.num_tokens
        for i, r in enumerate(range(sub.req_start, sub.req_stop)):
            assert int(sub.req_pool_indices[i]) == int(step.req_pool_indices[r])
            done = int(sub.prefix_lens[i] - step.prefix_lens[r])
            assert done == (sub.first_done if i == 0 else 0)
            if sub_tokens[i] < tokens[r]:  # a piece: only requests over the budget are cut
                assert tokens[r] > caps.write_entry_capacity
                assert sub_tokens[i] > 0, f"request {r} cut to an empty piece"
            else:
                assert int(sub.extend_seq_lens[i]) == int(step.extend_seq_lens[r])
            seen_tokens += [(r, done + j) for j in range(sub_tokens[i])]
            if not seen_reqs or seen_reqs[-1] != r:
                seen_reqs.append(r)
        flat = sub.token_stop
    assert flat == bounds[-1]
    assert seen_reqs == list(range(len(tokens)))
    assert seen_tokens == [(r, j) for r, n in enumerate(tokens) for j in range(n)]


@given(
    st.lists(requests(), max_size=60).flatmap(
        lambda reqs: st.tuples(
            st.just(reqs),
            capacities_for(len(reqs), sum(max(x, 0) for _, x, _ in reqs), max_subs=10**6),
        )
    )
)
def test_split_covers_step(drawn):
    reqs, caps = drawn
    step = make_step(reqs)
    check_cover(step, caps, split_forward_step(**step.lengths(), capacities=caps))


def _write_entries(sub_rpi, sub_prefix, write_offsets, bs) -> list[tuple[int, int]]:
    """(pool row, position) of every write entry, in write-offset order."""
    wo = write_offsets[: bs + 1].tolist()
    out = []
    for i in range(bs):
        assert wo[i] == len(out)
        out += [(int(sub_rpi[i]), int(sub_prefix[i]) + j) for j in range(wo[i + 1] - wo[i])]
    assert wo[bs] == len(out)
    return out


def check_plans(step: Step, caps: CanaryCapacities, **guard_kwargs) -> int:
    """Plan every sub-step through the guard (policy "split") and compare with one unbounded
    plan of the whole step. Returns the number of sub-steps."""
    bs = int(step.req_pool_indices.shape[0])
    dev = step.req_to_token.device
    i64 = lambda n: torch.full((n,), POISON_I64, dtype=torch.int64, device=dev)  # noqa: E731
    i32 = lambda: torch.full((1,), POISON_I32, dtype=torch.int32, device=dev)  # noqa: E731
    want = dict(
        out_verify_offsets=i64(bs + 1),
        out_write_offsets=i64(bs + 1),
        out_write_seed_slot_indices=i64(bs),
        out_verify_num_valid=i32(),
        out_verify_enable=i32(),
        out_write_num_valid_reqs=i32(),
    )
    host = {k: v.to(dev) for k, v in step.lengths().items()}
    plan_offsets_ref(
        **host,
        req_to_token=step.req_to_token,
        full_to_swa_index_mapping=None,
        swa_window_size=0,
        verify_capacity=caps.verify_capacity,
        **want,
    )
    whole = _write_entries(
        step.req_pool_indices, step.prefix_lens, want["out_write_offsets"].cpu(), bs
    )
    want_seeds = want["out_write_seed_slot_indices"].tolist()
    r2t = step.req_to_token.cpu()

    guard = ForwardStepGuard(caps, "split", device=DEVICE, **guard_kwargs)
    for buf in guard.buffers.tensors().values():
        buf.fill_(-7)
    ptrs = {k: v.data_ptr() for k, v in guard.buffers.tensors().items()}
    expected_subs = split_forward_step(**step.lengths(), capacities=caps)
    got, n_subs = [], 0
    for sub, buffers in guard.plan_step(**step.lengths(), req_to_token=step.req_to_token):
        assert buffers is guard.buffers
        assert {k: v.data_ptr() for k, v in buffers.tensors().items()} == ptrs
        assert sub.req_pool_indices.device == buffers.device
        ref = expected_subs[n_subs]
        assert (sub.req_start, sub.req_stop, sub.first_done, sub.tokens) == (
            ref.req_start,
            ref.req_stop,
            ref.first_done,
            ref.tokens,
        )
        n = sub.batch_size
        assert int(buffers.write_num_valid_reqs) == n
        rpi, prefix = sub.req_pool_indices.cpu(), sub.prefix_lens.cpu()
        entries = _write_entries(rpi, prefix, buffers.write_offsets.cpu(), n)
        seeds = buffers.write_seed_slot_indices[:n].tolist()
        wo = buffers.write_offsets[: n + 1].tolist()
        for i in range(n):
            if wo[i + 1] == wo[i]:
                assert seeds[i] == -1
            elif i == 0 and sub.first_done > 0:  # a continuation piece
                row, done = int(rpi[0]), sub.first_done
                orig = int(step.prefix_lens[sub.req_start])
                assert seeds[0] == int(r2t[row, orig + done - 1])
            else:
                assert seeds[i] == want_seeds[sub.req_start + i]
        got += entries
        n_subs += 1
    assert n_subs == len(expected_subs)
    assert got == whole
    return n_subs


@given(
    st.lists(requests(max_extend=30), max_size=16).flatmap(
        lambda reqs: st.tuples(
            st.just(reqs),
            capacities_for(len(reqs), sum(max(x, 0) for _, x, _ in reqs), max_subs=8),
            st.integers(0, 2**16),
        )
    )
)
@example(([(3, 5, False)] * 3, CanaryCapacities(1, 1, 0), 0))
def test_split_plans_chain(drawn):
    reqs, caps, seed = drawn
    step = make_step(reqs, seed)
    check_plans(step, caps)


EDGES = {
    "capacity_1": ([(2, 3, False), (0, 0, False), (5, 1, True), (1, 2, False)], (1, 100)),
    "budget_1": ([(2, 3, False), (0, 2, False), (4, 0, False)], (100, 1)),
    "one_huge": ([(7, 97, False)], (4, 10)),
    "huge_among_small": ([(1, 1, False), (3, 40, False), (2, 2, False)], (2, 16)),
    "many_empty": ([(i % 4, 0, False) for i in range(30)] + [(1, 5, False)], (4, 2)),
    "padding_rows": ([(3, 4, True), (2, 9, False), (0, 6, True), (1, 1, False)], (2, 4)),
    "negative_extend": ([(3, -1, False), (2, 9, False), (4, -2, False)], (2, 4)),
    "all_padding_huge": ([(0, 20, True), (5, 20, True)], (1, 7)),
    "empty_step": ([], (0, 0)),
    "huge_after_a_full_sub_step": ([(0, 4, False), (0, 10, False)], (2, 4)),
}


@pytest.mark.parametrize("name", EDGES)
def test_split_edges(name):
    reqs, (req_cap, tok_cap) = EDGES[name]
    caps = CanaryCapacities(req_cap, tok_cap, 50)
    step = make_step(reqs, seed=len(name))
    subs = split_forward_step(**step.lengths(), capacities=caps)
    check_cover(step, caps, subs)
    check_plans(step, caps, strategy="loop", chunk_size=2)


def test_split_one_huge_request_pieces():
    step = make_step([(7, 25, False)])
    subs = split_forward_step(**step.lengths(), capacities=CanaryCapacities(4, 10, 0))
    assert [(s.first_done, s.tokens) for s in subs] == [
        (0, slice(0, 10)),
        (10, slice(10, 20)),
        (20, slice(20, 25)),
    ]
    assert [int(s.prefix_lens[0]) for s in subs] == [7, 17, 27]
    assert [int(s.extend_seq_lens[0]) for s in subs] == [10, 10, 5]


def test_split_fitting_step_is_itself():
    step = make_step([(1, 2, False), (0, 3, True)])
    (sub,) = split_forward_step(**step.lengths(), capacities=CanaryCapacities(2, 5, 0))
    assert sub.req_pool_indices is step.req_pool_indices
    assert sub.prefix_lens is step.prefix_lens
    assert sub.extend_seq_lens is step.extend_seq_lens
    assert (sub.req_start, sub.req_stop, sub.first_done, sub.tokens) == (0, 2, 0, slice(0, 5))


def test_split_accepts_sequences():
    subs = split_forward_step(
        req_pool_indices=[1, 2],
        prefix_lens=[0, 4],
        extend_seq_lens=[3, 3],
        capacities=CanaryCapacities(1, 8, 0),
    )
    assert [s.extend_seq_lens.tolist() for s in subs] == [[3], [3]]
    assert all(s.prefix_lens.dtype == torch.int64 for s in subs)


def test_split_advances_a_negative_prefix_as_given():
    """A cut request's later pieces get the prefix plus the tokens before them, a negative
    prefix too (the documented rule: the plan reads a prefix <= 0 as none, so only the last
    piece here, at prefix 3, would verify and seed)."""
    subs = split_forward_step(
        req_pool_indices=[1],
        prefix_lens=[-5],
        extend_seq_lens=[9],
        capacities=CanaryCapacities(1, 4, 0),
    )
    assert [(s.prefix_lens.tolist(), s.extend_seq_lens.tolist()) for s in subs] == [
        ([-5], [4]),
        ([-1], [4]),
        ([3], [1]),
    ]


@pytest.mark.parametrize(
    "caps,text",
    [
        ((0, 9), "kv-canary: write_req_capacity=0 cannot hold any of the step's 2 requests"),
        ((3, 0), "kv-canary: write_entry_capacity=0 cannot hold any of the step's 3 new tokens"),
    ],
)
def test_split_zero_capacity(caps, text):
    step = make_step([(1, 2, False), (0, 1, False)])
    with pytest.raises(ValueError, match=f"^{re.escape(text)}"):
        split_forward_step(**step.lengths(), capacities=CanaryCapacities(*caps, 0))


def test_split_zero_token_budget_takes_a_step_of_no_tokens():
    """A token budget of 0 holds a step whose requests bring no new tokens (negative lengths
    count 0): only the requests are cut."""
    subs = split_forward_step(
        req_pool_indices=[1, 2, 3, 4, 5],
        prefix_lens=[3, 0, 7, 1, 2],
        extend_seq_lens=[0, -2, 0, 0, 0],
        capacities=CanaryCapacities(2, 0, 0),
    )
    assert [(s.req_start, s.req_stop, s.num_tokens) for s in subs] == [
        (0, 2, 0),
        (2, 4, 0),
        (4, 5, 0),
    ]
    assert [s.extend_seq_lens.tolist() for s in subs] == [[0, -2], [0, 0], [0]]


def test_split_length_mismatch():
    with pytest.raises(ValueError, match=r"^kv-canary: extend_seq_lens length must be 2, got 1$"):
        split_forward_step(
            req_pool_indices=[1, 2],
            prefix_lens=[0, 0],
            extend_seq_lens=[1],
            capacities=CanaryCapacities(1, 1, 0),
        )


def test_upload_rows_refuses_rows_of_other_lengths():
    """Rows of one upload must be 1-D and of one length: a one-element row is refused, not
    broadcast over the others, before anything is staged."""
    from kvcanary_dispatch.placement import upload_rows

    for rows in ([torch.arange(3), torch.arange(1)], [torch.arange(2), torch.zeros(2, 1)]):
        shapes = [tuple(r.shape) for r in rows]
        with pytest.raises(ValueError, match=re.escape(f"got shapes {shapes}")):
            upload_rows(rows, torch.device(DEVICE))


@pytest.mark.skipif(DEVICE != "cuda", reason="uploads CPU lengths to a GPU")
def test_a_hand_built_sub_step_of_mixed_lengths_is_refused_on_upload():
    """``SubStep`` is public: one built with a one-element ``prefix_lens`` among three-element
    tensors is a ``ValueError`` when moved to the GPU, not a silently broadcast prefix."""
    from kvcanary_dispatch import SubStep

    sub = SubStep(torch.arange(1, 4), torch.tensor([5]), torch.ones(3, dtype=torch.int64),
                  0, 3, 0, 0, 3)  # fmt: skip
    with pytest.raises(ValueError, match=r"got shapes \[\(3,\), \(1,\), \(3,\)\]"):
        sub.to(DEVICE)


class _Index:
    """An integer-like object (``__index__``), as an engine's own length type may be."""

    def __init__(self, value: int) -> None:
        self.value = value

    def __index__(self) -> int:
        return self.value


@pytest.mark.parametrize("values", ["0-d uint64 tensors", "__index__ objects"])
def test_lengths_at_int64s_ends_read_value_by_value_are_taken(values):
    """Lengths torch cannot make int64 at once are read value by value: int64's two ends are
    taken as they are (one past either end is refused: ``test_capacities_guard.py``)."""
    top, bottom = 2**63 - 1, -(2**63)
    if values == "0-d uint64 tensors":
        prefix = [torch.tensor(5, dtype=torch.uint64), torch.tensor(top, dtype=torch.uint64)]
        want = [5, top]
    else:
        prefix, want = [_Index(bottom), _Index(top)], [bottom, top]
    (sub,) = split_forward_step(
        req_pool_indices=[0, 1], prefix_lens=prefix, extend_seq_lens=[1, 1],
        capacities=CanaryCapacities(4, 10, 0),
    )  # fmt: skip
    assert sub.prefix_lens.dtype == torch.int64 and sub.prefix_lens.tolist() == want


def test_uint64_lengths_are_read_as_their_values():
    """CPU uint64 lengths are taken value for value (zeros and int64's top end included, as
    int64); of several past int64, the first is the one named."""
    u64 = lambda values: torch.tensor(values, dtype=torch.uint64)  # noqa: E731
    top = 2**63 - 1
    kw = dict(req_pool_indices=u64([0, 1]), extend_seq_lens=u64([0, 1]),
              capacities=CanaryCapacities(4, 10, 0))  # fmt: skip
    (sub,) = split_forward_step(prefix_lens=u64([0, top]), **kw)
    assert [t.dtype for t in (sub.req_pool_indices, sub.prefix_lens, sub.extend_seq_lens)] == [
        torch.int64
    ] * 3
    assert sub.req_pool_indices.tolist() == [0, 1] and sub.prefix_lens.tolist() == [0, top]
    assert sub.extend_seq_lens.tolist() == [0, 1] and sub.tokens == slice(0, 1)
    past = torch.tensor([3, -1, -2]).view(torch.uint64)  # 2**64 - 1, then 2**64 - 2
    kw = dict(kw, req_pool_indices=u64([0, 1, 2]), extend_seq_lens=u64([0, 1, 1]))
    text = "kv-canary: prefix_lens[1]=18446744073709551615 is past int64; pass"
    with pytest.raises(ValueError, match=f"^{re.escape(text)}"):
        split_forward_step(prefix_lens=past, **kw)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_split_refuses_a_2d_length_tensor(dtype):
    """A 2-D length tensor (``[bs, 1]``: its first dimension matches the batch) is refused by
    name when given, not cut row by row into 2-D pieces."""
    text = "kv-canary: prefix_lens must be 1-D, got shape (2, 1)"
    with pytest.raises(ValueError, match=f"^{re.escape(text)}$"):
        split_forward_step(
            req_pool_indices=[1, 2],
            prefix_lens=torch.tensor([[1], [2]], dtype=dtype),
            extend_seq_lens=[2, 1],
            capacities=CanaryCapacities(1, 8, 0),
        )


def test_token_count_is_exact_where_an_int64_sum_would_wrap():
    """More lengths than the Python sum takes (129), each 2**62: their int64 sum wraps, so the
    count is taken exactly from Python ints; negative lengths count 0."""
    extend = torch.full((129,), 2**62, dtype=torch.int64)
    extend[0] = -5
    assert _token_count(extend) == 128 * 2**62


def test_sub_step_to_moves_every_tensor():
    """``SubStep.to`` returns a sub-step with all three length tensors on the device, even when
    one of them is there already (``meta``: no data moved)."""
    cpu = torch.zeros(2, dtype=torch.int64)
    sub = SubStep(cpu.to("meta"), cpu, cpu.clone(), 0, 2, 0, 0, 0)
    moved = sub.to(torch.device("meta"))
    assert [t.device.type for t in (moved.req_pool_indices, moved.prefix_lens,
                                    moved.extend_seq_lens)] == ["meta"] * 3  # fmt: skip
    assert sub.to(torch.device("meta")).req_pool_indices is sub.req_pool_indices
