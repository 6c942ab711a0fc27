"""The public checks of ``kvcanary_dispatch.testing`` fail on what they promise to catch: a call
that changes its inputs (valid or refused), and a write into a wider pool's columns past the
window it was given."""

from __future__ import annotations

import dataclasses

import pytest
from conftest import DEVICE

from kvcanary_dispatch import plan as plan_module
from kvcanary_dispatch import plan_offsets, scatter_req_token_ids
from kvcanary_dispatch import scatter as scatter_module
from kvcanary_dispatch.testing.cases import (
    check_plan,
    check_scatter,
    make_plan_case,
    make_scatter_case,
)
from kvcanary_dispatch.testing.properties import (
    check_plan_rejected,
    check_scatter_property,
    check_scatter_rejected,
)


def _scatter_case(pitch: int = 0):
    lens = [3, 0, 5, 9, 1, 4]
    case = make_scatter_case(lens, width=6, spare_rows=2, seed=11, device=DEVICE)
    return dataclasses.replace(case, pool_pitch=pitch)


def _plan_case():
    return make_plan_case(
        prefix_lens=[3, 0, 7, 2, 5], extend_seq_lens=[2, 1, 0, 4, 3], max_seq_len=8, seed=4,
        device=DEVICE,
    )  # fmt: skip


def test_check_scatter_passes_the_dispatcher_on_a_window_of_a_wider_pool():
    """The premise of the failures below: the dispatcher passes, plain and windowed."""
    for pitch in (0, 9):
        case = _scatter_case(pitch)
        pool = check_scatter(scatter_req_token_ids, case)
        assert pool.stride(0) == max(pitch, case.width)
        check_scatter_property(case, None, "auto")


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


@pytest.mark.parametrize("form", ["int32", "host_int32"])
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
    with pytest.raises(AssertionError, match=rf"offsets \(an input\), as passed \({form}\)"):
        check_scatter_property(_scatter_case(), None, "auto", offsets=form)
    monkeypatch.setattr(scatter_module, "scatter_req_token_ids", real)
    check_scatter_property(_scatter_case(), None, "auto", offsets=form)
