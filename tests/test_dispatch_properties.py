"""Property tests of the dispatcher: byte-identical to the torch reference for any batch size,
chunk size and strategy; every launch within its block; slices compose to the whole; rejected
calls write nothing. Sizes come from kvcanary_dispatch.testing.strategies.SIZES by
HYPOTHESIS_PROFILE.
``test_generators_reached_every_path`` then checks that the examples reached every strategy
``auto`` resolves to, the block-edge batch sizes, int64-extreme totals and int32-end
capacities."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from conftest import DEVICE
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from kvcanary_dispatch import (
    PLAN_MAX_CHUNK,
    PLAN_STRATEGIES,
    SCATTER_MAX_CHUNK,
    SCATTER_STRATEGIES,
)
from kvcanary_dispatch.plan import (
    AUTO_PLAN_CHUNK,
    AUTO_PLAN_RECOUNT_MAX_BS,
    resolve_plan_chunk,
    resolve_plan_strategy,
)
from kvcanary_dispatch.scatter import resolve_scatter_strategy
from kvcanary_dispatch.scatter_shapes import CAPPED_SHORT_MEAN, capped_shape
from kvcanary_dispatch.testing.properties import (
    OFFSETS_FORMS,
    PLAN_REJECTIONS,
    SCATTER_REJECTIONS,
    check_plan_property,
    check_plan_rejected,
    check_scatter_property,
    check_scatter_rejected,
)
from kvcanary_dispatch.testing.strategies import (
    BLOCK_EDGE_BS,
    build_plan_case,
    build_scatter_case,
    chunk_and_bs,
    plan_cases_for,
    scatter_cases_for,
    sizes_for,
)

SIZES = sizes_for()
# The core properties get more examples than the profile's default where sizes are small.
PROPERTY = settings(max_examples=max(settings.default.max_examples, SIZES.min_examples))
# What the property tests reached, checked by test_generators_reached_every_path (run last).
REACHED: Counter = Counter()


@st.composite
def scatter_calls(draw: st.DrawFn, max_chunk: int = SCATTER_MAX_CHUNK):
    chunk, bs = draw(chunk_and_bs(max_chunk, SIZES.max_bs, SIZES.max_slices))
    return draw(scatter_cases_for(SIZES, DEVICE, bs=bs)), chunk


@st.composite
def plan_calls(draw: st.DrawFn, max_chunk: int = PLAN_MAX_CHUNK):
    chunk, bs = draw(chunk_and_bs(max_chunk, SIZES.max_bs, SIZES.max_slices))
    return draw(plan_cases_for(SIZES, DEVICE, bs=bs)), chunk


# ---------------------------------------------------------------- scatter


@pytest.mark.parametrize("strategy", SCATTER_STRATEGIES)
@PROPERTY
@given(
    call=scatter_calls(),
    offsets=st.sampled_from(OFFSETS_FORMS),
    validate=st.booleans(),
)
def test_scatter_matches_reference(strategy, call, offsets, validate):
    case, chunk = call
    launches = check_scatter_property(case, chunk, strategy, offsets=offsets, validate=validate)
    REACHED[f"ran scatter {strategy}"] += 1
    # What auto takes for this case (every strategy's cases count toward the generator's reach);
    # the auto runs check that it launched exactly that.
    auto = resolve_scatter_strategy("auto", case.bs, case.total, chunk, case.width)
    if case.bs and case.total:
        REACHED[f"scatter auto: {auto}"] += 1
        if strategy == "auto":
            assert {la.kind for la in launches} == {f"scatter_{auto}"}, launches
        if auto == "capped":
            _reach_capped(case)
    if case.bs in BLOCK_EDGE_BS:
        REACHED[f"bs {case.bs}"] += 1
    if case.bs and case.total and case.pool_pitch > case.width:
        REACHED["scatter into a column window of a wider pool"] += 1


def _reach_capped(case) -> None:
    """Which of ``capped``'s shape classes the case takes, and whether a run reaches past
    its cap into a pool wide enough to hold it (work for the tail programs)."""
    p = dict(capped_shape(case.bs, case.total, case.width))
    short = -(-case.total // case.bs) <= CAPPED_SHORT_MEAN
    REACHED["capped short" if short else "capped long"] += 1
    longest = int((case.offsets[1:] - case.offsets[:-1]).max())
    if min(longest, case.width) > p["steps"] * p["cols"]:
        REACHED["capped tail work"] += 1


def _lens(bs: int, seed: int, width: int) -> torch.Tensor:
    """Mostly short, a third empty, one in eight longer than the pool."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(0, width + 1, (bs,), generator=g)
    lens[torch.rand(bs, generator=g) < 0.33] = 0
    long = torch.rand(bs, generator=g) < 0.125
    lens[long] = width + 1 + torch.randint(0, 2 * width, (bs,), generator=g)[long]
    return lens


def _near_multiples(chunks: tuple[int, ...], ks: tuple[int, ...]) -> list[tuple[int, int]]:
    return [(c, k * c + d) for c in chunks for k in ks for d in (-1, 0, 1) if k * c + d >= 0]


@pytest.mark.parametrize("strategy", SCATTER_STRATEGIES)
@pytest.mark.parametrize(
    "chunk,bs", _near_multiples((1, 5), (1, 3)) + _near_multiples((SCATTER_MAX_CHUNK,), (1, 2))
)
def test_scatter_bs_around_chunk_multiples(strategy, chunk, bs):
    case = build_scatter_case(_lens(bs, bs, 4), width=4, spare_rows=2, seed=bs, device=DEVICE)
    launches = check_scatter_property(case, chunk, strategy, check_slices=False)
    if strategy == "loop" and case.total:
        assert len(launches) == -(-bs // chunk)


# ---------------------------------------------------------------- plan


@pytest.mark.parametrize("strategy", PLAN_STRATEGIES)
@PROPERTY
@given(call=plan_calls(), validate=st.booleans())
def test_plan_matches_reference(strategy, call, validate):
    case, chunk = call
    launches = check_plan_property(case, chunk, strategy, validate=validate)
    REACHED[f"ran plan {strategy}"] += 1
    auto_chunk = resolve_plan_chunk(chunk, "auto", case.bs)
    auto = resolve_plan_strategy("auto", case.bs, auto_chunk)
    default = " (default slices)" if chunk is None and auto != "fixed" else ""
    REACHED[f"plan auto: {auto}{default}"] += 1
    if strategy == "auto":
        assert [la.kind for la in launches] == [f"plan_{auto}"], launches
        assert all(la.args.get("chunk", auto_chunk) == auto_chunk for la in launches), launches
    if case.bs in BLOCK_EDGE_BS:
        REACHED[f"bs {case.bs}"] += 1
    if _plan_slices(launches) > 1 and _verify_total(case) >= 2**61:
        REACHED["plan over several slices, verify total >= 2**61"] += 1
    if case.verify_capacity >= 2**31 - 3:
        REACHED["plan verify_capacity at int32's end"] += 1


def _plan_slices(launches) -> int:
    """Slices the plan launches covered: a scan's or look-back's grid, or the loop's launches."""
    fixed = sum(la.kind == "plan_fixed" for la in launches)
    sliced = [-(-la.bs // la.args["chunk"]) for la in launches if "chunk" in la.args]
    return max([fixed, *sliced])


def _verify_total(case) -> int:
    prefix, window = case.prefix_lens, case.swa_window_size
    start = (prefix - window).clamp(min=0) if window > 0 else torch.zeros_like(prefix)
    lens = torch.where(case.req_pool_indices != 0, (prefix - start).clamp(min=0), 0)
    return int(lens.sum())


def _plan_case(bs: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return build_plan_case(
        prefix_lens=torch.randint(0, 20, (bs,), generator=g),
        extend_seq_lens=torch.randint(-1, 4, (bs,), generator=g),
        padding=torch.rand(bs, generator=g) < 0.25,
        max_seq_len=12,
        lut_len=7,
        swa_window_size=5,
        capacity_mode=("below", "at", "above")[seed % 3],
        capacity_delta=seed % 4,
        spare_capacity=1,
        spare_verify=0,
        seed=seed,
        device=DEVICE,
    )


@pytest.mark.parametrize("strategy", PLAN_STRATEGIES)
@pytest.mark.parametrize(
    "chunk,bs", _near_multiples((1, 6), (1, 3)) + _near_multiples((PLAN_MAX_CHUNK,), (1, 2))
)
def test_plan_bs_around_chunk_multiples(strategy, chunk, bs):
    case = _plan_case(bs, seed=bs + chunk)
    launches = check_plan_property(case, chunk, strategy, check_slices=False)
    n_slices = -(-bs // chunk)
    if strategy == "loop":
        assert len(launches) == max(n_slices, 1)
    if strategy == "scan":
        assert len(launches) == 1


# ---------------------------------------------------------------- rejected calls


def test_generators_reached_every_path():
    """The generators reach every path they are meant to, over the examples the property
    tests above ran: cases for each strategy scatter and eager plan ``auto`` can pick at the
    generated sizes (plan ``auto`` with its default slices too; the ``auto`` runs check that
    they launched it), a scatter into a column window of a wider pool, bs at every block
    edge, plan totals past ``2**61`` over several slices, and verify capacities at int32's
    end."""
    ran = [f"ran scatter {s}" for s in SCATTER_STRATEGIES]
    ran += [f"ran plan {s}" for s in PLAN_STRATEGIES]
    if not all(REACHED[key] for key in ran):
        pytest.skip("needs every property test above to run first (in this session)")
    # Eager auto past the recount range (the generators' largest batches); auto's scan, under
    # capture and past AUTO_PLAN_LOOKBACK_MAX_BS, is covered by the graph and stress tests.
    sliced = resolve_plan_strategy("auto", AUTO_PLAN_RECOUNT_MAX_BS + 1, AUTO_PLAN_CHUNK)
    wanted = [f"scatter auto: {s}" for s in ("capped", "sliced", "rows")]
    wanted += ["capped short", "capped long", "capped tail work"]
    wanted += ["scatter into a column window of a wider pool"]
    mid = resolve_plan_strategy("auto", AUTO_PLAN_RECOUNT_MAX_BS, resolve_plan_chunk(None, "auto"))
    wanted += ["plan auto: fixed"]
    wanted += [f"plan auto: {s}{d}" for s in (mid, sliced) for d in ("", " (default slices)")]
    wanted += [f"bs {n}" for n in BLOCK_EDGE_BS]
    wanted += ["plan over several slices, verify total >= 2**61"]
    wanted += ["plan verify_capacity at int32's end"]
    missing = [key for key in wanted if not REACHED[key]]
    assert not missing, f"never reached: {missing}; reached: {dict(REACHED)}"


def given_rejected_calls(cases_for, rejections, strategies):
    """``@given`` a case of up to 40 requests, a named breakage, a position for it, a strategy
    and whether the call is recorded or made as an engine makes it (``one_pass``)."""
    return given(
        case=cases_for(SIZES, DEVICE, bs=st.integers(0, 40)),
        name=st.sampled_from(sorted(rejections)),
        index=st.integers(0, 2**16),
        strategy=st.sampled_from(strategies),
        one_pass=st.booleans(),
    )


@given_rejected_calls(scatter_cases_for, SCATTER_REJECTIONS, SCATTER_STRATEGIES)
def test_rejected_scatter_writes_nothing(case, name, index, strategy, one_pass):
    assume(check_scatter_rejected(case, name, index, strategy, one_pass))


@given_rejected_calls(plan_cases_for, PLAN_REJECTIONS, PLAN_STRATEGIES)
def test_rejected_plan_writes_nothing(case, name, index, strategy, one_pass):
    assume(check_plan_rejected(case, name, index, strategy, one_pass))


@pytest.mark.parametrize("one_pass", [False, True], ids=["recorded", "one pass"])
@pytest.mark.parametrize("name", sorted(SCATTER_REJECTIONS))
def test_every_scatter_rejection(name, one_pass):
    """Each named breakage at least once, whatever hypothesis draws."""
    case = build_scatter_case(_lens(9, 1, 4), width=4, spare_rows=1, seed=1, device=DEVICE)
    assert check_scatter_rejected(case, name, index=5, one_pass=one_pass)


@pytest.mark.parametrize("one_pass", [False, True], ids=["recorded", "one pass"])
@pytest.mark.parametrize("name", sorted(PLAN_REJECTIONS))
def test_every_plan_rejection(name, one_pass):
    assert check_plan_rejected(_plan_case(9, seed=3), name, index=5, one_pass=one_pass)
