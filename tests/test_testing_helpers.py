"""The public checks of ``kvcanary_dispatch.testing`` fail on what they promise to catch: a call
that changes its inputs (valid or refused), and a write into a wider pool's columns past the
window it was given."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import DEVICE
from hypothesis import Phase, find, settings
from hypothesis import strategies as st

from kvcanary_dispatch import plan as plan_module
from kvcanary_dispatch import plan_offsets, scatter_req_token_ids
from kvcanary_dispatch import scatter as scatter_module
from kvcanary_dispatch.testing.cases import (
    check_plan,
    check_scatter,
    make_plan_case,
    make_scatter_case,
)
from kvcanary_dispatch.testing.engine_steps import (
    expect_plan,
    expect_scatter,
)
from kvcanary_dispatch.testing.launches import check_plan_slices_seen, record_launches
from kvcanary_dispatch.testing.properties import (
    check_plan_property,
    check_plan_rejected,
    check_scatter_property,
    check_scatter_rejected,
)
from kvcanary_dispatch.testing.strategies import plan_cases_for, scatter_cases_for, sizes_for


def _scatter_case(pitch: int = 0):
    lens = [3, 0, 5, 9, 1, 4]
    case = make_scatter_case(lens, width=6, spare_rows=2, seed=11, device=DEVICE)
    return dataclasses.replace(case, pool_pitch=pitch)


def _plan_case():
    return make_plan_case(
        prefix_lens=[3, 0, 7, 2, 5], extend_seq_lens=[2, 1, 0, 4, 3], max_seq_len=8, seed=4,
        device=DEVICE,
    )  # fmt: skip


def test_plan_case_refill_from_copies_every_input_into_the_same_tensors():
    """What a graph replay test relies on: after ``refill_from``, the case's own tensors (the
    ones a capture addressed) hold the other case's inputs, every one of them."""
    shape = dict(max_seq_len=8, lut_len=40, swa_window_size=3, device=DEVICE)
    case = make_plan_case(prefix_lens=[3, 0, 7], extend_seq_lens=[2, 1, 0], seed=4, **shape)
    new = make_plan_case(prefix_lens=[1, 6, 2], extend_seq_lens=[4, 0, 5], seed=9, **shape)
    held = case.inputs()
    kept = {k: v.clone() for k, v in held.items() if isinstance(v, torch.Tensor)}
    case.refill_from(new)
    for name, tensor in case.inputs().items():
        assert tensor is held[name], f"{name} replaced, not refilled"
        want = new.inputs()[name]
        if isinstance(tensor, torch.Tensor):
            assert torch.equal(tensor, want) and not torch.equal(want, kept[name]), name
        else:
            assert tensor == want, name


def test_check_scatter_passes_the_dispatcher_on_a_window_of_a_wider_pool():
    """The premise of the failures below: the dispatcher passes, plain and windowed."""
    for pitch in (0, 9):
        case = _scatter_case(pitch)
        pool = check_scatter(scatter_req_token_ids, case)
        assert pool.stride(0) == max(pitch, case.width)
        check_scatter_property(case, None, "auto")


@pytest.mark.parametrize("pitch", [0, 1, 5])
def test_check_scatter_takes_a_pool_zero_columns_wide(pitch):
    """A pool of no columns, alone or a window of a wider one: the dispatcher writes nothing,
    and the check (which reads the columns past the window) says so."""
    case = dataclasses.replace(
        make_scatter_case([3, 1, 0], width=0, device=DEVICE), pool_pitch=pitch
    )
    for strategy in ("auto", "capped", "flat", "segments", "rows", "sliced", "loop"):
        check_scatter(scatter_req_token_ids, case, strategy=strategy)


@pytest.mark.parametrize("name", ["flat_in", "offsets", "req_pool_indices"])
def test_check_scatter_catches_an_input_changed_by_the_call(name):
    def changes_input(**kw):
        scatter_req_token_ids(**kw)
        kw[name][-1] += 1

    with pytest.raises(AssertionError, match=f"scatter: {name} changed by the call"):
        check_scatter(changes_input, _scatter_case())


def test_check_scatter_catches_a_write_past_the_window():
    """A write into the columns of a wider pool's row past the window it was given."""

    def writes_past(**kw):
        scatter_req_token_ids(**kw)
        pool = kw["pool_out"]
        pool.as_strided((1,), (1,), pool.storage_offset() + pool.shape[1]).fill_(7)

    with pytest.raises(AssertionError, match="pool_out: 1 elements differ"):
        check_scatter(writes_past, _scatter_case(pitch=9))


@pytest.mark.parametrize("pitch", [0, 9])
def test_check_scatter_catches_a_write_past_the_pools_last_row(pitch):
    """A write just past the pool's last row (the next row's first element, as a kernel that
    overran the pool would make it) lands in the guard row ``fresh_pool`` leaves there, and
    ``check_scatter`` names it, on a pool of whole rows and on a window of a wider one."""

    def writes_past(**kw):
        scatter_req_token_ids(**kw)
        pool = kw["pool_out"]
        after = pool.storage_offset() + pool.shape[0] * pool.stride(0)
        pool.as_strided((1,), (1,), after).fill_(7)

    with pytest.raises(AssertionError, match="scatter wrote past the pool's last row"):
        check_scatter(writes_past, _scatter_case(pitch=pitch))


@pytest.mark.parametrize("name", ["prefix_lens", "extend_seq_lens", "req_to_token"])
def test_check_plan_catches_an_input_changed_by_the_call(name):
    def changes_input(**kw):
        plan_offsets(**kw)
        kw[name].view(-1)[0] += 1

    with pytest.raises(AssertionError, match=f"plan: {name} changed by the call"):
        check_plan(changes_input, _plan_case())


def test_rejection_checks_catch_a_refused_call_that_changes_an_input(monkeypatch):
    """A refused call that changes an input before refusing (here ``flat_in``, ``prefix_lens``)
    fails the rejection checks, not only one that writes an output."""
    scatter = scatter_module.scatter_req_token_ids
    plan = plan_module.plan_offsets

    def scatter_changing(**kw):
        kw["flat_in"][0] += 1
        return scatter(**kw)

    def plan_changing(**kw):
        kw["prefix_lens"][0] += 1
        return plan(**kw)

    assert check_scatter_rejected(_scatter_case(), "offsets_start")
    assert check_plan_rejected(_plan_case(), "rows_too_big")
    monkeypatch.setattr(scatter_module, "scatter_req_token_ids", scatter_changing)
    monkeypatch.setattr(plan_module, "plan_offsets", plan_changing)
    with pytest.raises(AssertionError, match="flat_in changed by the call"):
        check_scatter_rejected(_scatter_case(), "offsets_start")
    with pytest.raises(AssertionError, match="prefix_lens changed by the call"):
        check_plan_rejected(_plan_case(), "rows_too_big")


@pytest.mark.parametrize("chunked", [False, True], ids=["default_chunk", "chunked"])
def test_chunk_and_bs_shrinks_a_failure_any_bs_shows_to_the_smallest_bs(chunked):
    """A failure seen at every batch size shrinks to bs = 1, not to a block edge (255) or a
    multiple of the chunk: the fuzzer's printed reproduction is the smallest batch."""
    from hypothesis import find, settings

    from kvcanary_dispatch.testing.sizes import chunk_and_bs

    def fails(pair):
        return (pair[0] is not None) == chunked and pair[1] >= 1

    chunk, bs = find(chunk_and_bs(512, 4097, 48), fails, settings=settings(database=None))
    assert bs == 1, (chunk, bs)
    assert chunk is None if not chunked else chunk == 1


@pytest.mark.parametrize("form", ["int32", "host_int32", "int32_strided"])
def test_check_scatter_property_catches_a_change_to_the_offsets_as_passed(monkeypatch, form):
    """The offsets the call sees (an int32 or host copy of the case's) are checked unchanged,
    not only the case's int64 original: a call that clears an engine's int32 staging buffer
    after reading it is caught."""
    from kvcanary_dispatch.testing.equality import check_scatter_property

    real = scatter_module.scatter_req_token_ids

    def then_clear(**kw):  # a call that leaves the caller's int32 offsets cleared
        real(**kw)
        kw["offsets"].zero_()

    monkeypatch.setattr(scatter_module, "scatter_req_token_ids", then_clear)
    with pytest.raises(AssertionError, match=rf"as passed \({form}\): offsets changed by the call"):
        check_scatter_property(_scatter_case(), None, "auto", offsets=form)
    monkeypatch.setattr(scatter_module, "scatter_req_token_ids", real)
    check_scatter_property(_scatter_case(), None, "auto", offsets=form)


def test_expect_scatter_catches_a_changed_input_and_a_write_past_the_window():
    """``expect_scatter`` (the engine loops' check): an input the call changed, given the
    copy taken before it, and a write into a wider pool's columns past the window."""
    case = _scatter_case(pitch=9)
    kept = case.kept()
    pool = case.fresh_pool()
    scatter_req_token_ids(**case.kwargs(pool))
    expect_scatter(case, pool, "plain", kept)
    case.flat_in[0] += 1
    with pytest.raises(AssertionError, match="changed: flat_in changed by the call"):
        expect_scatter(case, pool, "changed", kept)
    case.flat_in[0] -= 1
    pool.as_strided((1,), (1,), pool.storage_offset() + pool.shape[1]).fill_(7)
    with pytest.raises(AssertionError, match="past: pool_out: 1 elements differ"):
        expect_scatter(case, pool, "past")


def test_expect_plan_catches_a_changed_input():
    case = _plan_case()
    kept = case.kept(req_to_token=False)
    assert "req_to_token" not in kept
    outputs = case.fresh_outputs()
    plan_offsets(**case.inputs(), **outputs)
    expect_plan(case, outputs, "plain", kept)
    case.extend_seq_lens[0] += 1
    with pytest.raises(AssertionError, match="changed: extend_seq_lens changed by the call"):
        expect_plan(case, outputs, "changed", kept)


_FIND = settings(database=None, max_examples=400)


def test_plan_cases_draw_luts_and_windows_of_every_magnitude():
    """The plan generator reaches LUT values past 2**62 and below 0 (seeds kept whole, all
    64 bits) and windows past twice the table width up to int64's range."""
    cases = plan_cases_for(sizes_for("ci"))
    lut = lambda c, f: c.lut is not None and bool(f(c.lut).any())  # noqa: E731
    find(cases, lambda c: lut(c, lambda t: t.abs() >= 2**62), settings=_FIND)
    find(cases, lambda c: lut(c, lambda t: t < 0), settings=_FIND)
    find(cases, lambda c: c.swa_window_size > 2**40, settings=_FIND)


def test_scatter_cases_draw_zero_tokens_and_shared_rows():
    """The scatter generator reaches written tokens whose low 32 bits are 0 (what a masked or
    zero-filled load gives) and requests with empty runs on another request's row."""

    def zero_written(case) -> bool:
        runs = zip(case.offsets[:-1].tolist(), case.written_lens.tolist(), strict=True)
        return any(bool((case.flat_in[s : s + n] & 0xFFFFFFFF == 0).any()) for s, n in runs)

    def shared(case) -> bool:
        return case.req_pool_indices.unique().numel() < case.bs

    cases = scatter_cases_for(sizes_for("ci"))
    find(cases, zero_written, settings=_FIND)
    find(cases, shared, settings=_FIND)


def test_gpu_size_scatter_cases_rarely_empty_every_request():
    """At GPU sizes (what a GPU fuzz draws) a batch of requests whose runs are all empty, which
    launches nothing, is an edge case drawn now and then (13 of these 150), not nearly one
    batch in two as a zero fraction of 1.0 or a zero target gave (66 of 150); it is still
    drawn."""
    from hypothesis import HealthCheck, given

    seen = []

    @settings(database=None, derandomize=True, max_examples=150, deadline=None,
              suppress_health_check=list(HealthCheck))  # fmt: skip
    @given(case=scatter_cases_for(sizes_for("gpu"), bs=st.integers(1, 4096)))
    def draw(case):
        seen.append(case.total == 0)

    draw()
    assert len(seen) >= 100 and 0 < sum(seen) <= len(seen) // 10, (sum(seen), len(seen))


def test_plan_property_catches_seeds_cut_to_62_bits(monkeypatch):
    """A plan that keeps a seed's low 62 bits (sign-extended) fails the plan property on a
    drawn case."""
    real = plan_module.plan_offsets

    def cut(**kw):
        real(**kw)
        seeds = kw["out_write_seed_slot_indices"][: kw["req_pool_indices"].shape[0]]
        seeds.copy_((seeds << 2) >> 2)  # the poison past bs left as it is

    monkeypatch.setattr(plan_module, "plan_offsets", cut)

    def fails(case) -> bool:
        try:
            check_plan_property(case, None, "auto", check_slices=False)
        except AssertionError:
            return True
        return False

    cases = plan_cases_for(sizes_for("ci"), DEVICE, bs=st.integers(0, 24))
    # Found is enough: no shrinking, each step of which would plan a case again
    find(cases, fails, settings=settings(database=None, max_examples=100, phases=[Phase.generate]))


@pytest.mark.parametrize(
    "name,element",
    [
        ("out_verify_offsets", 1),
        ("out_verify_offsets", 2),  # the slice's total: the slices after it shift too
        ("out_write_offsets", 0),
        ("out_write_seed_slot_indices", 1),
    ],
)
def test_plan_property_names_the_slice_that_differs(monkeypatch, name, element):
    """A dispatcher wrong only when it plans the second of three slices on its own fails the
    slice-by-slice check, which names that slice and the request."""
    case = _plan_case()
    second = case.req_pool_indices[2:].data_ptr()
    real = plan_module.plan_offsets

    def off_by_one(**kw):
        real(**kw)
        rows = kw["req_pool_indices"]
        if rows.data_ptr() == second and rows.shape[0] < case.bs:
            kw[name][element] += 1

    monkeypatch.setattr(plan_module, "plan_offsets", off_by_one)
    end = 4 if name == "out_write_seed_slot_indices" else 5
    with pytest.raises(AssertionError, match=rf"{name}\[2:{end}\], slices one by one: \d+ "):
        check_plan_property(case, 2, "auto")
    with pytest.raises(AssertionError, match=rf"differ \(.*\), first at {2 + element}: "):
        check_plan_property(case, 2, "auto")


@pytest.mark.parametrize("tamper", ["swap", "drop", "shift", "cut elsewhere"])
def test_plan_slices_seen_names_the_launch_that_differs(tamper):
    """The check that carried fixed-block launches cover the batch in order fails on launches
    out of order, one missing, or one holding the wrong requests, naming the launch."""
    case = _plan_case()
    with record_launches() as launches:
        check_plan(plan_offsets, case, chunk_size=2, strategy="loop")
    check_plan_slices_seen(case, launches)  # the premise: the real launches pass
    fixed = [la for la in launches if la.kind == "plan_fixed" and la.args.get("carry") is not None]
    assert len(fixed) == 3, launches
    if tamper == "swap":
        fixed[0], fixed[1] = fixed[1], fixed[0]
        message = r"slice 0: req_pool_indices"
    elif tamper == "drop":
        del fixed[2]
        message = r"carried slices cover 4 of 5 requests"
    elif tamper == "cut elsewhere":  # prefix_lens cut at other boundaries: the same concatenation
        for k, (s, e) in enumerate(((0, 3), (3, 4))):
            bundle = fixed[k].bundle
            cut = bundle._replace(prefix_lens=case.prefix_lens[s:e])
            fixed[k] = dataclasses.replace(fixed[k], args={**fixed[k].args, "i": cut})
        message = r"slice 0: prefix_lens"
    else:
        bundle = fixed[1].bundle  # the launch's PlanInputs, its first argument
        shifted = bundle._replace(prefix_lens=bundle.prefix_lens + 1)
        fixed[1] = dataclasses.replace(fixed[1], args={**fixed[1].args, "i": shifted})
        message = r"slice 1: prefix_lens"
    with pytest.raises(AssertionError, match=message):
        check_plan_slices_seen(case, fixed)
