"""The launch plans on their own: pure host arithmetic, cached by size."""

from __future__ import annotations

import pytest

from kvcanary_dispatch.launch_plan import (
    PLAN_STRATEGIES,
    ROWS_LONG_MAX_BS,
    ROWS_LONG_MIN_MEAN,
    ROWS_MAX_BS,
    SCATTER_STRATEGIES,
    SEGMENTS_MAX_STEPS,
    plan_offsets_launch_plan,
    resolve_scatter_strategy,
    scatter_launch_plan,
    segments_shape,
)


@pytest.mark.parametrize("bad", [True, False, 1.0, "1"])
def test_cache_does_not_conflate_chunk_sizes(bad):
    """A cached plan for chunk_size=1 (or 0) must not answer for True, 1.0 or "1": those stay
    a TypeError on every call, not only on the first."""
    for _ in range(2):
        scatter_launch_plan(10, 40, 1, "sliced")
        plan_offsets_launch_plan(10, 1, "scan")
        with pytest.raises(TypeError):
            scatter_launch_plan(10, 40, bad, "sliced")
        with pytest.raises(TypeError):
            plan_offsets_launch_plan(10, bad, "scan")


@pytest.mark.parametrize("strategy", SCATTER_STRATEGIES)
@pytest.mark.parametrize("bs,tokens,width", [(1, 5, 8), (513, 7000, 64), (5000, 10, 4), (8, 0, 4)])
def test_scatter_plans_cover_the_batch(strategy, bs, tokens, width):
    plan = scatter_launch_plan(bs, tokens, None, strategy, "device", width)
    if plan.slices:
        assert plan.slices[0][0] == 0 and plan.slices[-1][1] == bs
        assert all(a[1] == b[0] for a, b in zip(plan.slices, plan.slices[1:], strict=False))
    assert (plan.launches == ()) == (tokens == 0)
    assert bool(plan.host_syncs) == (plan.strategy == "loop")


@pytest.mark.parametrize("strategy", PLAN_STRATEGIES)
@pytest.mark.parametrize("bs", [0, 1, 256, 257, 4097, 100_000])
def test_plan_plans_cover_the_batch(strategy, bs):
    plan = plan_offsets_launch_plan(bs, None, strategy)
    assert plan.launches and not plan.host_syncs
    if plan.strategy in ("scan", "lookback"):
        assert plan.launches[0].grid == (len(plan.slices),)
        assert plan.slices[-1][1] == bs


def test_auto_rows_only_for_small_grids():
    assert resolve_scatter_strategy("auto", ROWS_MAX_BS, 100, None, 1024) == "rows"
    assert resolve_scatter_strategy("auto", ROWS_MAX_BS + 1, 100, None, 1024) != "rows"
    assert resolve_scatter_strategy("auto", 8, 100, None, 1 << 20) != "rows"  # 8 x 1024 tiles
    assert resolve_scatter_strategy("auto", 8, 100, None, None) != "rows"  # width unknown


def test_auto_segments_bounded_by_the_longest_run_the_pool_allows():
    bs, tokens = 1000, 1000 * 600  # mean 600: 1 024 columns a step
    cols = segments_shape(bs, tokens)[1]
    widest = SEGMENTS_MAX_STEPS * cols
    assert resolve_scatter_strategy("auto", bs, tokens, None, widest) == "segments"
    assert resolve_scatter_strategy("auto", bs, tokens, None, widest + 1) == "flat"
    assert resolve_scatter_strategy("auto", bs, tokens, None, None) == "flat"  # tokens bound it
    few = SEGMENTS_MAX_STEPS * segments_shape(64, 64 * 300)[1]  # 64 x 300: 512 columns
    assert resolve_scatter_strategy("auto", 64, 64 * 300, None, few) == "segments"
    assert resolve_scatter_strategy("auto", 64, 64 * 300, None, few + 1) == "flat"


@pytest.mark.parametrize("bs", [ROWS_MAX_BS + 1, ROWS_LONG_MAX_BS])
def test_auto_rows_for_few_long_prefills(bs):
    long_ = ROWS_LONG_MIN_MEAN * bs
    assert resolve_scatter_strategy("auto", bs, long_, None, 32768) == "rows"
    assert resolve_scatter_strategy("auto", bs, long_ - 1, None, 32768) != "rows"
    assert resolve_scatter_strategy("auto", bs, long_, None, 1 << 20) != "rows"  # grid too big
    assert resolve_scatter_strategy("auto", ROWS_LONG_MAX_BS + 1, 10**9, None, 8192) != "rows"
