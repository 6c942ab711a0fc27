"""The launch plans on their own: pure host arithmetic, cached by size."""

from __future__ import annotations

import pytest
import triton

from kvcanary_dispatch.launch_plan import (
    AUTO_PLAN_CHUNK,
    AUTO_PLAN_LARGE_BS,
    AUTO_PLAN_LARGE_CHUNK,
    AUTO_PLAN_LOOKBACK_MAX_BS,
    AUTO_PLAN_LOOKBACK_SLICES,
    AUTO_PLAN_RECOUNT_MAX_BS,
    HOST_OFFSETS_UNDER_CAPTURE,
    LOOP_SYNC_UNDER_CAPTURE,
    PLAN_MAX_TILE,
    PLAN_STRATEGIES,
    ROWS_COLS,
    SCATTER_STRATEGIES,
    plan_offsets_launch_plan,
    resolve_plan_chunk,
    resolve_scatter_strategy,
    scatter_launch_plan,
)
from kvcanary_dispatch.scatter_shapes import (
    ROWS_MAX_BS,
    ROWS_MAX_PROGRAMS,
    ROWS_MAX_STEPS,
    ROWS_TARGET_PROGRAMS,
    capped_shape,
    flat_token_block,
    segments_shape,
)
from kvcanary_dispatch.slicing import SliceBounds, slice_bounds
from kvcanary_kernels._launch import MAX_GRID_Y


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
    assert bool(plan.host_syncs) == (plan.strategy == "loop" and bool(plan.launches))


@pytest.mark.parametrize("strategy", PLAN_STRATEGIES)
@pytest.mark.parametrize("bs", [0, 1, 256, 257, 4097, 100_000])
def test_plan_plans_cover_the_batch(strategy, bs):
    plan = plan_offsets_launch_plan(bs, None, strategy)
    assert plan.launches and not plan.host_syncs
    if plan.strategy in ("scan", "lookback", "recount"):
        assert plan.launches[0].grid == (len(plan.slices),)
        assert plan.slices[-1][1] == bs


def test_auto_rows_only_for_small_grids():
    assert resolve_scatter_strategy("auto", ROWS_MAX_BS, 100, None, 1024) == "rows"
    assert resolve_scatter_strategy("auto", ROWS_MAX_BS + 1, 100, None, 1024) != "rows"
    # 8 requests: 2 048 tiles in 512 programs a request (4 096), 4 096 tiles need 1 024
    assert resolve_scatter_strategy("auto", 8, 10**9, None, 1 << 21) == "rows"
    assert resolve_scatter_strategy("auto", 8, 10**9, None, 1 << 22) != "rows"
    assert resolve_scatter_strategy("auto", 8, 100, None, 1 << 22) == "rows"  # 8 x 1 tile
    assert resolve_scatter_strategy("auto", 8, 100, None, None) != "rows"  # width unknown
    # step 31's sweep: bs 256 up to 64 tiles (16 programs a request), bs 512 up to 32 (8)
    assert resolve_scatter_strategy("auto", 256, 10**9, None, 1 << 16) == "rows"
    assert resolve_scatter_strategy("auto", 256, 10**9, None, 1 << 17) != "rows"
    assert resolve_scatter_strategy("auto", 512, 10**9, None, 1 << 15) == "rows"
    assert resolve_scatter_strategy("auto", 512, 10**9, None, 1 << 16) != "rows"
    assert resolve_scatter_strategy("auto", 1024, 1024, None, 1024) != "rows"


@pytest.mark.parametrize("bs,width", [(10, 8), (ROWS_MAX_BS, 1024), (5000, None)])
def test_auto_takes_sliced_for_an_explicit_chunk_size(bs, width):
    """An explicit ``chunk_size`` under ``auto`` selects ``sliced`` (its slices are what the
    caller asked for), on batches that would otherwise take ``rows`` or ``capped``."""
    assert resolve_scatter_strategy("auto", bs, 40, None, width) != "sliced"
    assert resolve_scatter_strategy("auto", bs, 40, 64, width) == "sliced"
    plan = scatter_launch_plan(bs, 40, 64, "auto", "device", width)
    assert plan.strategy == "sliced" and plan.chunk == 64


@pytest.mark.parametrize(
    "bs,tokens",
    [
        (ROWS_MAX_BS + 1, ROWS_MAX_BS + 1),
        (ROWS_MAX_BS + 72, 60_000),
        (4096, 2_155_709),
        (1000, 10**9),
    ],
)
def test_auto_takes_capped_past_rows(bs, tokens):
    for width in (None, 64, 8192, 1 << 20):
        assert resolve_scatter_strategy("auto", bs, tokens, None, width) == "capped"


def _pow2(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


@pytest.mark.parametrize("mean", [1, 2, 3, 15, 16, 17, 64, 100, 511, 513, 1024, 5000, 10**6])
def test_capped_shapes_stay_in_their_blocks(mean):
    """Every block a power of two (the guessed-owner read may also be off, 0, and its offsets
    any positive number of requests apart; the first copy step peeled, 1, exactly for tiles
    one column or one request wide, else 0); a head tile of
    at most 1024 elements and fewer than 512 requests; tail tiles no wider than the cap (the
    kernel's correctness needs it) and a tail copy tile of at most 1024 elements."""
    for bs in (1, 7, 1000):
        p = dict(capped_shape(bs, bs * mean, None))
        odd = ("guess", "guess_stride", "peel", "tails_first")
        assert all(_pow2(v) for k, v in p.items() if k not in odd), p
        assert p["guess"] == 0 or _pow2(p["guess"]), p
        assert p["guess_stride"] >= 1, p
        assert p["peel"] == int(p["reqs"] == 1 or p["cols"] == 1), p
        assert p["tails_first"] == int(p["reqs"] == 1 and bs * mean > 8 * 1024), p
        assert p["reqs"] * p["cols"] <= 1024 and p["reqs"] < 512, p
        assert p["tail"] <= p["steps"] * p["cols"] and p["tail_cols"] <= p["tail"], p
        assert p["tiles"] * p["tail_cols"] <= 1024 and p["tiles"] * p["tail"] <= 4096, p
        assert p["cols"] >= min(mean, 1024) and p["steps"] * p["cols"] >= 32, p
        assert p["cols"] < 2 * mean, p  # the mean rounded up to a power of two (or 1024)
        short = mean <= 16  # <= 128 requests on 4 warps; longer, <= 256 on 2
        assert p["reqs"] == min(128 if short else 256, 1024 // p["cols"]), p
        assert p["num_warps"] == (4 if short else 2), p


@pytest.mark.parametrize("width", [None, 4096, 8192, 8193, 65536])
def test_capped_wide_heads_take_fewer_steps_only_where_tails_run(width):
    """Head tiles one request wide take 4 steps and the tail programs first only when a run can
    write past 8 steps (a pool wider than 8 192 columns, or of unknown width, and more tokens
    than that); else 8 steps, and then no tail program runs."""
    for tokens in (8192, 8193, 10**6):
        p = dict(capped_shape(4, tokens, width))
        assert p["reqs"] == 1, p
        wide = min(tokens, width or tokens) > 8192
        assert (p["steps"], p["tails_first"]) == ((4, 1) if wide else (8, 0)), (width, tokens)
        plan = scatter_launch_plan(4, tokens, None, "capped", "device", width)
        assert dict(plan.launches[0].params) == p
        (grid,) = plan.launches[0].grid
        assert (grid > 4) == wide, (width, tokens, grid)  # tail programs past the 4 heads


@pytest.mark.parametrize("bs,tokens", [(100, 20), (100, 100), (100, 3000), (3000, 2_000_000)])
def test_capped_tails_cover_every_token_past_the_cap(bs, tokens):
    """Tail programs from token ``cap`` on to the end when the pool is wider than the cap (or
    of unknown width); none when no column past the cap can be written (a pool no wider than
    the cap, or no more tokens than it). The cap is the shape's at each width."""
    first = dict(capped_shape(bs, tokens, None))
    first_cap = first["steps"] * first["cols"]
    for width in (first_cap - 1, first_cap, first_cap + 1, 8192, 8193, None):
        p = dict(capped_shape(bs, tokens, width))
        cap, heads = p["steps"] * p["cols"], -(-bs // p["reqs"])
        per_tail = p["tiles"] * p["tail"]
        (grid,) = scatter_launch_plan(bs, tokens, None, "capped", "device", width).launches[0].grid
        tails = grid - heads
        if min(tokens if width is None else width, tokens) <= cap:
            assert tails == 0, (width, grid)
        else:
            assert tails * per_tail >= tokens - cap > (tails - 1) * per_tail, (width, grid)


@pytest.mark.parametrize("bs", [1, 33, ROWS_MAX_BS])
def test_auto_rows_whatever_the_lengths_while_the_grid_is_small(bs):
    """Rows while ``ROWS_MAX_STEPS`` tiles a program, ``ROWS_MAX_PROGRAMS`` programs in all,
    cover ``min(width, tokens)`` columns: no run of a CSR over the tokens is wider than
    either."""
    fits = ROWS_MAX_STEPS * (ROWS_MAX_PROGRAMS // bs) * ROWS_COLS
    for tokens in (0, bs, fits, fits + 1, 4096 * bs, 10**9):
        assert resolve_scatter_strategy("auto", bs, tokens, None, fits) == "rows"
        rows = resolve_scatter_strategy("auto", bs, tokens, None, fits + 1) == "rows"
        assert rows == (tokens <= fits), tokens
    assert resolve_scatter_strategy("auto", ROWS_MAX_BS + 1, 10**9, None, 1024) != "rows"


@pytest.mark.parametrize(
    "bs,tokens,width,c", [(1, 1, 8, 1), (1, 1, 1 << 20, 1), (3, 1024, 1 << 17, 1),
                          (3, 1025, 1 << 17, 2), (8, 5000, 2048, 2), (128, 33_000, 65_536, 16),
                          (128, 10**6, 1 << 17, 32), (64, 10**6, 1 << 17, 32),
                          (16, 10**7, 1 << 22, 1024), (200, 10**6, 1 << 20, 245),
                          (4096, 10**6, 1 << 20, 245)]
)  # fmt: skip
def test_rows_grid_covers_the_longest_possible_run(bs, tokens, width, c):
    """The "rows" grid, whatever decided the strategy: ``bs`` requests by ``C`` column
    programs (the ``c`` given), never more than the tiles of ``min(width, tokens)`` columns
    (at least one), enough for any run to take at most ``ROWS_MAX_STEPS`` tiles a program, and
    one program a tile while that keeps the grid within ``ROWS_TARGET_PROGRAMS``."""
    (launch,) = scatter_launch_plan(bs, tokens, None, "rows", "device", width).launches
    assert launch.grid == (bs, c)
    tiles = max(1, triton.cdiv(min(width, tokens), ROWS_COLS))
    assert 1 <= c <= tiles
    assert c * ROWS_MAX_STEPS * ROWS_COLS >= min(width, tokens)
    if bs * tiles <= ROWS_TARGET_PROGRAMS:
        assert c == tiles
    else:
        assert bs * c <= max(ROWS_TARGET_PROGRAMS, bs * triton.cdiv(tiles, ROWS_MAX_STEPS))


def test_rows_grid_within_cuda_limits():
    """An explicit "rows" on a pool of 2**30 columns: no more than ``MAX_GRID_Y`` column
    programs a request (a launch past it fails), so its longest run takes more steps."""
    assert scatter_launch_plan(1, 10**12, None, "rows", "device", 1 << 30).launches[0].grid == (
        1,
        MAX_GRID_Y,
    )


_RECOUNT = ("recount", AUTO_PLAN_CHUNK, 256, 8)
_SCAN = ("scan", AUTO_PLAN_CHUNK, 256, 8)
_LARGE_SCAN = ("scan", AUTO_PLAN_LARGE_CHUNK, 256, 4)


def _look_back(chunk: int) -> tuple[str, int, int, int]:
    return ("lookback", chunk, 256, 8)


@pytest.mark.parametrize(
    "bs,eager,captured",  # (strategy, chunk, tile, warps) each
    [
        (AUTO_PLAN_CHUNK + 1, _RECOUNT, _RECOUNT),
        (AUTO_PLAN_RECOUNT_MAX_BS, _RECOUNT, _RECOUNT),
        (AUTO_PLAN_RECOUNT_MAX_BS + 1, _look_back(AUTO_PLAN_CHUNK), _SCAN),
        (AUTO_PLAN_CHUNK * AUTO_PLAN_LOOKBACK_SLICES, _look_back(AUTO_PLAN_CHUNK), _SCAN),
        (AUTO_PLAN_CHUNK * AUTO_PLAN_LOOKBACK_SLICES + 1, _look_back(2 * AUTO_PLAN_CHUNK), _SCAN),
        (AUTO_PLAN_LARGE_BS - 1, _look_back(2048), _SCAN),
        (AUTO_PLAN_LOOKBACK_MAX_BS, _look_back(2048), _LARGE_SCAN),
        (AUTO_PLAN_LOOKBACK_MAX_BS + 1, _LARGE_SCAN, _LARGE_SCAN),
        (3 * AUTO_PLAN_LARGE_BS + 5, _LARGE_SCAN, _LARGE_SCAN),
    ],
)
def test_auto_plan_slices_by_bs(bs, eager, captured):
    """plan auto's default slices: 256 requests in one tile on 8 warps, recounted up to
    AUTO_PLAN_RECOUNT_MAX_BS requests; past it, up to AUTO_PLAN_LOOKBACK_MAX_BS, one look-back
    launch on the stream's resident state (8 warps) in at most AUTO_PLAN_LOOKBACK_SLICES
    slices walked in 256-request tiles, or, while capturing a CUDA graph, the two scan
    launches (8 warps); then scanned, from AUTO_PLAN_LARGE_BS in 1 024-request slices walked in
    256-request tiles on 4 warps."""
    assert AUTO_PLAN_LOOKBACK_MAX_BS == AUTO_PLAN_LARGE_BS  # the rows above assume it
    for capturing, (resolved, chunk, tile, warps) in ((False, eager), (True, captured)):
        plan = plan_offsets_launch_plan(bs, None, "auto", capturing)
        assert plan.strategy == resolved and plan.chunk == chunk, (capturing, plan)
        assert resolve_plan_chunk(None, "auto", bs, capturing) == chunk
        assert plan.slices[-1] == ((len(plan.slices) - 1) * chunk, bs)
        if resolved == "lookback":
            assert len(plan.slices) <= AUTO_PLAN_LOOKBACK_SLICES
        (launch,) = plan.launches
        assert dict(launch.params) == {"chunk": chunk, "bs_block": tile, "num_warps": warps}
        assert plan.by_capture == (AUTO_PLAN_RECOUNT_MAX_BS < bs <= AUTO_PLAN_LOOKBACK_MAX_BS)
        assert plan.capturing == capturing
        assert plan.torch_ops == 0 and plan.triton_launches == (2 if resolved == "scan" else 1)


def test_a_captured_look_back_fills_a_fresh_state():
    """Explicit lookback: eager, the stream's resident state (no device op); captured, a
    fresh one filled (one torch op). Strategies that do not change never ask again."""
    eager = plan_offsets_launch_plan(5000, 256, "lookback")
    captured = plan_offsets_launch_plan(5000, 256, "lookback", capturing=True)
    assert eager.by_capture and captured.by_capture
    assert (eager.torch_ops, captured.torch_ops) == (0, 1)
    assert eager.launches == captured.launches
    for strategy in ("scan", "recount", "loop"):
        assert not plan_offsets_launch_plan(5000, 256, strategy).by_capture
    assert not plan_offsets_launch_plan(300, None, "auto").by_capture


@pytest.mark.parametrize(
    "bs,chunk,resolved",
    [(1000, 128, "lookback"), (1000, AUTO_PLAN_CHUNK, "recount"), (3000, 1024, "recount"),
     (AUTO_PLAN_RECOUNT_MAX_BS + 1, 1024, "lookback"), (1000, 1000, "fixed")],
)  # fmt: skip
def test_auto_recounts_only_small_batches_in_large_slices(bs, chunk, resolved):
    """An explicit chunk_size under auto: recount needs bs <= AUTO_PLAN_RECOUNT_MAX_BS and
    slices of at least AUTO_PLAN_CHUNK requests (smaller slices multiply its re-reads)."""
    assert plan_offsets_launch_plan(bs, chunk, "auto").strategy == resolved


@pytest.mark.parametrize(
    "bs,chunk,resolved",
    [(262144, 512, "lookback"), (262144, 256, "scan"), (262145, 512, "scan"),
     (AUTO_PLAN_LOOKBACK_MAX_BS, 1, "scan"), (5000, 1, "scan"), (5000, 9, "scan"),
     (5000, 10, "lookback"), (AUTO_PLAN_LOOKBACK_MAX_BS + 1, 4096, "scan")],
)  # fmt: skip
def test_auto_looks_back_over_few_slices_only(bs, chunk, resolved):
    """An explicit chunk_size under eager auto: the look-back only in at most
    AUTO_PLAN_LOOKBACK_SLICES slices (each program reads every earlier slice's sums, so its
    cost grows with the square of their count), else the scan."""
    assert plan_offsets_launch_plan(bs, chunk, "auto").strategy == resolved
    assert plan_offsets_launch_plan(bs, chunk, "auto", capturing=True).strategy == "scan"
    few = -(-bs // chunk) <= AUTO_PLAN_LOOKBACK_SLICES
    assert (resolved == "lookback") == (few and bs <= AUTO_PLAN_LOOKBACK_MAX_BS)


@pytest.mark.parametrize("strategy", ["auto", "scan", "lookback", "recount"])
@pytest.mark.parametrize(
    "bs,chunk,tile",
    [(5000, 1024, 1024), (1 << 20, 1024, 1024), (3, 4096, 4), (8192, 4096, PLAN_MAX_TILE)],
)
def test_explicit_plan_slices_keep_one_tile(strategy, bs, chunk, tile):
    """An explicit chunk_size (even auto's large 1 024) is one tile per slice on the strategy's
    warps, and no tile is wider than the batch or than ``PLAN_MAX_TILE`` (a slice of 4 096
    requests is walked in tiles of that): only auto's own slices past 256 requests take
    256-request tiles."""
    plan = plan_offsets_launch_plan(bs, chunk, strategy)
    if plan.strategy == "fixed":
        return
    (launch,) = plan.launches
    params = dict(launch.params)
    assert params["bs_block"] == tile
    assert params["num_warps"] == {"scan": 8, "lookback": 8, "recount": 8}[plan.strategy]


@pytest.mark.parametrize(
    "strategy,offsets_on,tokens,refused",
    [
        ("loop", "device", 40, LOOP_SYNC_UNDER_CAPTURE),
        ("loop", "device", 0, None),  # nothing launched, nothing read back
        ("loop", "host", 40, HOST_OFFSETS_UNDER_CAPTURE),  # the upload, before any read-back
        ("auto", "host", 0, HOST_OFFSETS_UNDER_CAPTURE),
        ("auto", "device", 40, None),
        ("sliced", "device", 40, None),
        ("loop", "cpu", 40, None),  # no GPU: nothing to capture
    ],
)
def test_scatter_capture_refusal_is_the_plans(strategy, offsets_on, tokens, refused):
    """What a scatter cannot record in a CUDA graph is read from its plan, by the dispatcher
    and by explain alike."""
    plan = scatter_launch_plan(600, tokens, None, strategy, offsets_on, 64)
    assert plan.capture_refusal == refused


@pytest.mark.parametrize("bs", [0, 1, 5, 511, 512, 513, 4097])
@pytest.mark.parametrize("chunk", [1, 3, 256, 512, 10**6])
def test_slice_bounds_on_demand_are_the_listed_slices(bs, chunk):
    """``SliceBounds`` gives ``slice_bounds``' ranges: length, order, every index from either
    end, slices of it, and out-of-range indices refused; two over the same ranges are equal
    and hash alike (a chunk of ``bs`` or more gives the one range however large it is)."""
    listed = slice_bounds(bs, chunk)
    lazy = SliceBounds(bs, chunk)
    assert len(lazy) == len(listed) and list(lazy) == listed and bool(lazy) == bool(listed)
    step = max(1, len(listed) // 50)
    for k in [*range(0, len(listed), step), len(listed) - 1] if listed else []:
        assert lazy[k] == listed[k] and lazy[k - len(listed)] == listed[k]
    assert lazy[1:4] == tuple(listed[1:4]) and lazy[::-3] == tuple(listed[::-3])
    with pytest.raises(IndexError):
        lazy[len(listed)]
    with pytest.raises(IndexError):
        lazy[-len(listed) - 1]
    same = SliceBounds(bs, chunk + 7 if chunk >= bs else chunk)  # another chunk past bs
    assert lazy == same and hash(lazy) == hash(same)
    if bs > 1 and chunk < bs:
        assert lazy != SliceBounds(bs, chunk + 1)


def test_one_launch_plans_count_their_slices_without_listing_them():
    """A plan of one launch over 10**7 one-request slices holds them on demand (building the
    list took 17 s and 1.3 GB); a ``loop`` plan, a launch a slice, lists them."""
    plan = plan_offsets_launch_plan(10**7, 1, "scan")
    assert isinstance(plan.slices, SliceBounds) and len(plan.slices) == 10**7
    assert plan.launches[0].grid == (10**7,) and plan.slices[-1] == (10**7 - 1, 10**7)
    sliced = scatter_launch_plan(10**7, 4 * 10**7, 1, "sliced")
    assert isinstance(sliced.slices, SliceBounds) and len(sliced.slices) == 10**7
    assert isinstance(plan_offsets_launch_plan(9, 4, "loop").slices, tuple)


@pytest.mark.parametrize("offsets_on,read_back", [("device", 3), ("cpu", 0)])
def test_loop_plans_count_a_rebase_per_slice(offsets_on, read_back):
    """A scatter ``loop`` rebases each slice's offsets with one torch op before its launch: the
    plan counts them (``torch_ops``, ``device_ops``), and on a device the three ops of its
    read-back of the slice boundaries (the starts' upload, the gather, the copy to the host)."""
    plan = scatter_launch_plan(10, 40, 3, "loop", offsets_on)
    assert len(plan.slices) == len(plan.launches) == 4
    assert (plan.torch_ops, plan.triton_launches) == (4 + read_back, 4)
    assert plan.device_ops == 8 + read_back
    host = scatter_launch_plan(10, 40, 3, "loop", "host")
    assert (host.torch_ops, host.device_ops) == (5, 9)  # the upload, then the four rebases


@pytest.mark.parametrize("bs", [1, 3, 5, 9, 17, 256])
@pytest.mark.parametrize("chunk", [1, 2, 3, 4, 5, 8, 9, 255])
def test_slice_blocks_hold_their_slices(bs, chunk):
    """Every fixed-block launch's block holds its whole slice: ``plan_fixed`` its requests (the
    whole batch when ``fixed``), ``scatter_fixed`` and ``scatter_sliced`` a slice's requests
    and its end offset. A block one short drops the last request of a slice. A plan's block
    is the smallest power of two that holds its chunk (the batch when ``fixed``), the same for
    every slice: one compiled kernel, no register block larger than that."""
    plans = [plan_offsets_launch_plan(bs, chunk, s) for s in ("auto", "loop")]
    plans += [scatter_launch_plan(bs, 4 * bs, chunk, s) for s in ("loop", "sliced")]
    for plan in plans:
        for launch in plan.launches:
            p = dict(launch.params)
            if launch.launcher == "plan_fixed":
                s, e = launch.requests or (0, bs)
                assert p["bs_block"] >= e - s, (plan.strategy, launch)
                held = chunk if launch.requests else bs
                assert p["bs_block"] == 1 << (held - 1).bit_length(), (plan.strategy, launch)
            elif launch.launcher in ("scatter_fixed", "scatter_sliced"):
                assert p["batch_block"] >= min(chunk, bs) + 1, (plan.strategy, launch)


@pytest.mark.parametrize("bs,tokens,short", [(1000, 16_000, True), (3, 48, True),
                                              (1000, 17_000, False), (3, 49, False)])  # fmt: skip
def test_capped_short_class_ends_at_a_mean_of_16_rounded_up(bs, tokens, short):
    """``capped`` takes its short-request shapes (guessed head offsets) up to a mean of 16
    tokens a request, the mean rounded up: 49 tokens on 3 requests is long."""
    assert (dict(capped_shape(bs, tokens, None))["guess"] > 0) == short


def test_segments_and_flat_blocks_at_their_crossovers():
    """``segments``: columns the mean rounded up to a power of two, at least 4; ``flat``: small
    token blocks for fewer than 8 tokens a request on average, large ones from 8."""
    assert segments_shape(100, 100) == segments_shape(100, 400) == (256, 4)
    assert segments_shape(100, 401) == (128, 8)
    assert segments_shape(10, 10_000) == (1, 1024)
    assert flat_token_block(100, 799) == 128
    assert flat_token_block(100, 800) == flat_token_block(100, 10**6) > 128


def test_plans_list_their_temporaries():
    """What ``explain`` prints as temporaries, strategy by strategy: the scan's slice sums
    (one row a slice), the plan loop's carry, the scatter loop's rebased offsets after any CPU
    offsets' staging; none for a fixed launch or a recount."""
    assert plan_offsets_launch_plan(5000, 256, "scan").temporaries == (
        "sums: [20, 2] int64, uninitialised",
    )
    assert plan_offsets_launch_plan(9, 4, "loop").temporaries == (
        "carry: 3 int64 zeros (verify total, write total, requests so far)",
    )
    assert plan_offsets_launch_plan(5000, 256, "recount").temporaries == ()
    assert plan_offsets_launch_plan(3, None, "auto").temporaries == ()
    rebase = "rebased offsets per slice: offsets[s:e+1] - offsets[s], one torch op"
    assert scatter_launch_plan(10, 40, 3, "loop", "cpu").temporaries == (rebase,)
    staged = scatter_launch_plan(10, 40, 3, "loop", "host").temporaries
    assert staged[1:] == (rebase,) and "pinned" in staged[0]
    assert scatter_launch_plan(10, 40, 3, "sliced", "device").temporaries == ()
