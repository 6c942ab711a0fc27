"""How a call is split: the one place that decides, from host-known sizes only.

``scatter_launch_plan`` and ``plan_offsets_launch_plan`` turn a call's sizes (``bs``, the token
count, ``chunk_size``, ``strategy``, where the offsets live) into a ``LaunchPlan``: the strategy
that runs, its request slices, and per launch the launcher, the Triton kernels it runs, its
grid and block parameters, plus the call's temporaries and host syncs. ``scatter_req_token_ids``
and ``plan_offsets`` build one and run it; ``kvcanary-dispatch explain`` renders it; the
property checks compare it with the launches actually made; the sweep counts its launches.
Plans depend on sizes alone, and a plan's on whether the stream captures a CUDA graph (asked
only when ``LaunchPlan.by_capture``), so they are cached: a steady engine step costs a
dictionary look-up. The scatter strategies' block shapes and grids come from
``scatter_shapes``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import triton

from kvcanary_kernels import PLAN_BATCH_BLOCK, SCATTER_BATCH_BLOCK
from kvcanary_kernels._checks import PREFIX
from kvcanary_kernels.plan_lookback import lookback_state_words
from kvcanary_kernels.scatter_capped import capped_grid
from kvcanary_kernels.scatter_rows import ROWS_COLS
from kvcanary_kernels.scatter_sliced import sliced_grid

from .scatter_shapes import (
    ROWS_MAX_BS,
    ROWS_MAX_PROGRAMS,
    capped_shape,
    flat_token_block,
    rows_grid,
    segments_shape,
)
from .slicing import SliceBounds, block_for, resolve_chunk_size, slice_bounds

SCATTER_STRATEGIES = ("auto", "loop", "sliced", "capped", "flat", "segments", "rows")
PLAN_STRATEGIES = ("auto", "loop", "scan", "lookback", "recount")
SCATTER_MAX_CHUNK = SCATTER_BATCH_BLOCK - 1
PLAN_MAX_CHUNK = PLAN_BATCH_BLOCK
# Plan slices auto takes with chunk_size=None (but for its eager look-back, below):
# AUTO_PLAN_CHUNK requests (one 256-lane tile on SCAN_WARPS warps) below AUTO_PLAN_LARGE_BS,
# else AUTO_PLAN_LARGE_CHUNK walked in 256-request tiles on 4 warps. For "scan", on an H200,
# graph replay (benchmarks/NOTES.md, steps 12 and 13): 256-request slices are faster up to
# 786 432 requests (36.4 against 41.3 us at 524 288, 48.1 against 49.7 at 786 432), the two
# tie at 917 504 (54.3, 53.9) and the larger ones win at 1 048 576 (58.7 against 61.3; 55.8
# against 64.1 in an earlier run).
AUTO_PLAN_CHUNK = 256
# From AUTO_PLAN_CHUNK + 1 to AUTO_PLAN_RECOUNT_MAX_BS requests auto takes "recount" (one
# launch, no temporary) on slices of at least AUTO_PLAN_CHUNK requests (smaller ones multiply
# its re-reads; unmeasured): on an H200 its graph replay beats or ties
# "scan"'s two launches there (8.5-10.3 against 9.4-10.1 us at 512 to 4 096) and its host time
# per call is about 60 % of "scan"'s; from 8 192 requests each program's re-read of its
# predecessors costs more (12.8 against 10.4 us; benchmarks/NOTES.md, step 16).
AUTO_PLAN_RECOUNT_MAX_BS = 4096
# Past it, eager calls up to AUTO_PLAN_LOOKBACK_MAX_BS requests take "lookback" on the stream's
# resident state (one launch and no other device op), in at most AUTO_PLAN_LOOKBACK_SLICES
# slices (of AUTO_PLAN_CHUNK requests or the next power of two that keeps to that count, walked
# in AUTO_PLAN_LARGE_TILE-request tiles): each program reads every earlier slice's sums, so
# more slices cost more. On an H200 (graph replay, benchmarks/NOTES.md, step 18) its device
# time is 18.0 against "scan"'s 16.0 us at 131 072 requests, 36.9 against 35.7 at 524 288 and
# 58.8 against 58.3 at 1 048 576, and its host time per call 30-32 us against "scan"'s 41-42
# (1.4-1.6x a bare launch against 2.2x; step 17). It scans under capture, where host time is
# spent once, and past 1 048 576 requests (not measured there).
AUTO_PLAN_LOOKBACK_MAX_BS = 1 << 20
AUTO_PLAN_LOOKBACK_SLICES = 512
AUTO_PLAN_LARGE_BS = 1 << 20
AUTO_PLAN_LARGE_CHUNK = 1024
AUTO_PLAN_LARGE_TILE = 256
AUTO_PLAN_LARGE_WARPS = 4
PLAN_MAX_TILE = 1024  # requests any other multi-slice plan program holds at once

SCAN_WARPS = 8
LOOKBACK_WARPS = 8  # 4 warps: 20-25 % slower at 131 072-1 048 576 requests (step 18)
RECOUNT_WARPS = 8
_SLICE_WARPS = {"scan": SCAN_WARPS, "lookback": LOOKBACK_WARPS, "recount": RECOUNT_WARPS}

# What a scatter cannot record in a CUDA graph, and the fix: (what, fix) for refuse_capture.
LOOP_SYNC_UNDER_CAPTURE = (
    "scatter_req_token_ids strategy='loop' reads the slice-boundary offsets back",
    "use a single-launch strategy ('auto', 'capped', 'rows', 'segments', 'flat' or 'sliced')",
)
HOST_OFFSETS_UNDER_CAPTURE = (
    "scatter_req_token_ids got offsets on the CPU",
    "pass offsets on {device} (e.g. uploaded before capture into a static buffer)",
)
STAGED_UPLOAD = "stage the CPU offsets in private pinned memory, upload them asynchronously"
# A device loop's read-back of its slice-boundary offsets: the slice starts' index uploaded,
# the offsets gathered at it, the gathered values copied to the host (run_scatter_plan).
LOOP_READ_BACK = "the slice starts uploaded, their offsets gathered and copied to the host"
LOOP_READ_BACK_OPS = 3
STAGED_SYNC = (
    "none: the CPU offsets are copied on the host into private pinned staging during the call, "
    "then uploaded asynchronously (no wait on queued work); refused during CUDA-graph capture"
)


@dataclass(frozen=True)
class Launch:
    """One launcher call: ``launcher`` names it (``scatter_flat``, ``plan_scan``, ...),
    ``kernels`` the Triton kernels it runs in order, ``grid`` their grid (``None`` when it
    depends on data: a ``loop`` slice's token count), ``params`` its block keywords, and
    ``requests`` the request range ``[s, e)`` of a ``loop`` slice (``None``: the whole batch)."""

    launcher: str
    kernels: tuple[str, ...]
    grid: tuple[int, ...] | None
    params: tuple[tuple[str, int], ...] = ()
    requests: tuple[int, int] | None = None

    @functools.cached_property  # built once (plans are cached); callers unpack, never mutate
    def kwargs(self) -> dict[str, int]:
        return dict(self.params)


@dataclass(frozen=True)
class LaunchPlan:
    """Everything a call does on the device, decided before its first launch."""

    function: str  # "scatter_req_token_ids" or "plan_offsets"
    requested: str  # the strategy asked for
    strategy: str  # what runs: a strategy name, or "fixed" (one fixed-block plan launch)
    bs: int
    tokens: int | None  # flat tokens (scatter); None for the plan
    chunk: int | None  # requests per slice; None when the strategy has no slices
    # (start, stop) a slice: a tuple where each slice is a launch ("loop"), else a SliceBounds
    slices: Sequence[tuple[int, int]]
    launches: tuple[Launch, ...]
    temporaries: tuple[str, ...]  # device allocations and small torch ops before or between
    host_syncs: tuple[str, ...]  # empty: the call never waits on the device
    torch_ops: int = 0  # device operations the temporaries cost (fills, copies, rebases)
    capturing: bool = False  # planned for a stream capturing a CUDA graph
    # Whether the plan differs while capturing (then ask again with capturing=True).
    by_capture: bool = False

    @property
    def triton_launches(self) -> int:
        """Triton kernel launches the call makes; for ``loop``, at most that many: a slice
        whose requests hold no token makes none, which the sizes alone do not show."""
        return sum(len(la.kernels) for la in self.launches)

    @property
    def device_ops(self) -> int:
        """Everything the call puts on the stream: Triton launches and torch device ops."""
        return self.triton_launches + self.torch_ops

    @property
    def capture_refusal(self) -> tuple[str, str] | None:
        """What this call cannot record in a CUDA graph, as ``refuse_capture``'s (what, fix),
        the fix's ``{device}`` to fill with the pool's: CPU offsets to stage and upload, else a
        read-back of slice offsets; ``None`` when nothing here stops a capture."""
        if STAGED_UPLOAD in self.temporaries:
            return HOST_OFFSETS_UNDER_CAPTURE
        return LOOP_SYNC_UNDER_CAPTURE if self.host_syncs else None


def resolve_scatter_strategy(
    strategy: str, bs: int, num_tokens: int, chunk_size: int | None, width: int | None = None
) -> str:
    """The strategy ``scatter_req_token_ids`` runs on ``bs`` requests, ``num_tokens`` flat
    tokens and a pool ``width`` columns wide (``None``: unknown, ``"rows"`` not considered);
    a ``ValueError`` for an unknown one."""
    if strategy not in SCATTER_STRATEGIES:
        raise ValueError(
            f"{PREFIX}scatter_req_token_ids strategy={strategy!r} is not one of "
            f"{', '.join(SCATTER_STRATEGIES)}"
        )
    if strategy != "auto":
        return strategy
    if chunk_size is not None:
        return "sliced"
    if width is not None and bs <= ROWS_MAX_BS:
        if math.prod(rows_grid(bs, num_tokens, width)) <= ROWS_MAX_PROGRAMS:
            return "rows"
    return "capped"


def _cached(plan: Callable[..., LaunchPlan]) -> Callable[..., LaunchPlan]:
    """``plan`` behind an LRU cache keyed by its arguments, told apart by type (``True`` and
    ``1.0`` are not ``chunk_size=1``). An argument the cache cannot hash (a list) skips it, so
    that ``plan``'s own checks name the value rather than the cache."""
    cached = functools.lru_cache(maxsize=4096, typed=True)(plan)

    @functools.wraps(plan)
    def checked(*args: Any, **kwargs: Any) -> LaunchPlan:
        try:
            return cached(*args, **kwargs)
        except TypeError:  # unhashable, or plan's own TypeError, which this raises again
            return plan(*args, **kwargs)

    return checked


@_cached
def scatter_launch_plan(
    bs: int,
    tokens: int,
    chunk_size: int | None = None,
    strategy: str = "auto",
    offsets_on: str = "device",
    width: int | None = None,
) -> LaunchPlan:
    """The plan of ``scatter_req_token_ids`` on ``bs`` requests, ``tokens`` flat tokens and a
    pool ``width`` columns wide (``None``: unknown; ``"rows"`` then needs it, and ``"capped"``
    plans tail programs as for the widest pool). ``offsets_on``: ``"device"`` (with the other
    tensors), ``"host"`` (CPU offsets, the rest on a GPU: staged and uploaded) or ``"cpu"``
    (every tensor on the CPU). Raises the call's own errors for an unknown ``strategy`` or a
    bad ``chunk_size``."""
    chunk = resolve_chunk_size(chunk_size, SCATTER_MAX_CHUNK, "scatter_req_token_ids")
    resolved = resolve_scatter_strategy(strategy, bs, tokens, chunk_size, width)
    slices: Sequence[tuple[int, int]] = ()
    if resolved == "loop":  # a launch a slice: the slices are listed
        slices = tuple(slice_bounds(bs, chunk))
    elif resolved == "sliced":  # one launch over them: counted, not listed
        slices = SliceBounds(bs, chunk)
    launches: tuple[Launch, ...] = ()
    syncs: tuple[str, ...] = ()
    if resolved == "loop" and offsets_on == "device" and bs and tokens:  # else no launch
        syncs = (f"one device-to-host copy of the {len(slices) + 1} slice-boundary offsets",)
    temps = (STAGED_UPLOAD,) if offsets_on == "host" else (LOOP_READ_BACK,) if syncs else ()
    if bs and tokens:
        if resolved == "flat":
            block = flat_token_block(bs, tokens)
            grid = (triton.cdiv(tokens, block),)
            params = (("token_block", block),)
            launches = (Launch("scatter_flat", ("_scatter_flat_kernel",), grid, params),)
        elif resolved == "capped":
            params = capped_shape(bs, tokens, width)
            grid = capped_grid(bs, tokens, tokens if width is None else width, dict(params))
            launches = (Launch("scatter_capped", ("_scatter_capped_kernel",), grid, params),)
        elif resolved == "segments":
            reqs, cols = segments_shape(bs, tokens)
            grid = (triton.cdiv(bs, reqs),)
            params = (("reqs", reqs), ("cols", cols))
            launches = (Launch("scatter_segments", ("_scatter_segments_kernel",), grid, params),)
        elif resolved == "rows":
            if width is None:
                raise ValueError(
                    f"{PREFIX}scatter_launch_plan strategy='rows' needs the pool width: pass "
                    "width=pool_out.shape[1] (--width on the command line)"
                )
            grid = rows_grid(bs, tokens, width)
            params = (("cols", ROWS_COLS),)
            launches = (Launch("scatter_rows", ("_scatter_rows_kernel",), grid, params),)
        elif resolved == "sliced":
            block = block_for(chunk + 1)
            grid = sliced_grid(bs, tokens, chunk, block)
            params = (("chunk", chunk), ("batch_block", block))
            launches = (Launch("scatter_sliced", ("_scatter_sliced_kernel",), grid, params),)
        else:
            block = block_for(chunk + 1)
            launches = tuple(
                Launch(
                    "scatter_fixed",
                    ("_scatter_req_token_ids_kernel",),
                    None,
                    (("batch_block", block),),
                    (s, e),
                )  # fmt: skip
                for s, e in slices
            )
            temps += ("rebased offsets per slice: offsets[s:e+1] - offsets[s], one torch op",)
    ops = (offsets_on == "host") + (len(launches) if resolved == "loop" else 0)
    ops += LOOP_READ_BACK_OPS if syncs else 0
    return LaunchPlan(
        "scatter_req_token_ids", strategy, resolved, bs, tokens,
        chunk if slices else None, slices, launches, temps, syncs, ops,
    )  # fmt: skip


def resolve_plan_chunk(
    chunk_size: int | None, strategy: str, bs: int = 0, capturing: bool = False
) -> int:
    """Requests per slice: ``chunk_size`` checked (``None`` = ``PLAN_MAX_CHUNK``), except
    that ``"auto"`` with ``None`` takes ``AUTO_PLAN_CHUNK``, or ``AUTO_PLAN_LARGE_CHUNK``
    from ``bs = AUTO_PLAN_LARGE_BS``, or, where ``resolve_plan_strategy`` then runs
    ``"lookback"``, the smallest power of two from ``AUTO_PLAN_CHUNK`` that splits ``bs`` into
    at most ``AUTO_PLAN_LOOKBACK_SLICES`` slices."""
    chunk = resolve_chunk_size(chunk_size, PLAN_MAX_CHUNK, "plan_offsets")
    if strategy != "auto" or chunk_size is not None:
        return chunk
    look_back = max(AUTO_PLAN_CHUNK, block_for(-(-bs // AUTO_PLAN_LOOKBACK_SLICES)))
    if resolve_plan_strategy("auto", bs, look_back, capturing) == "lookback":
        return look_back
    return AUTO_PLAN_LARGE_CHUNK if bs >= AUTO_PLAN_LARGE_BS else AUTO_PLAN_CHUNK


def _plan_tile_warps(bs: int, chunk: int, resolved: str, auto_slices: bool) -> tuple[int, int]:
    """(requests a program holds at once, warps) of a ``scan``, ``lookback`` or ``recount``
    slice: ``auto``'s slices past ``AUTO_PLAN_CHUNK`` requests (``auto_slices``: ``"auto"``
    with ``chunk_size=None``) take ``AUTO_PLAN_LARGE_TILE``-request tiles, on
    ``AUTO_PLAN_LARGE_WARPS`` warps (``LOOKBACK_WARPS`` for a look-back); any other slice the
    smallest power-of-two tile that holds it (or the whole batch, if smaller), at most
    ``PLAN_MAX_TILE``, on the strategy's warps."""
    if auto_slices and chunk > AUTO_PLAN_CHUNK:
        warps = LOOKBACK_WARPS if resolved == "lookback" else AUTO_PLAN_LARGE_WARPS
        return AUTO_PLAN_LARGE_TILE, warps
    return min(block_for(min(chunk, bs)), PLAN_MAX_TILE), _SLICE_WARPS[resolved]


def resolve_plan_strategy(strategy: str, bs: int, chunk: int, capturing: bool = False) -> str:
    """What ``plan_offsets`` runs: ``"loop"``, ``"fixed"`` (one fixed-block launch for the
    whole batch), ``"scan"``, ``"lookback"`` or ``"recount"``; ``"auto"`` takes ``"fixed"``
    for ``bs <= chunk``, ``"recount"`` up to ``AUTO_PLAN_RECOUNT_MAX_BS`` on slices of at least
    ``AUTO_PLAN_CHUNK``, else ``"lookback"`` up to ``AUTO_PLAN_LOOKBACK_MAX_BS`` in at most
    ``AUTO_PLAN_LOOKBACK_SLICES`` slices (each of its programs reads every earlier slice's
    sums), and ``"scan"`` otherwise or while the stream is ``capturing`` a CUDA graph. A
    ``ValueError`` for an unknown strategy."""
    if strategy not in PLAN_STRATEGIES:
        raise ValueError(
            f"{PREFIX}plan_offsets strategy={strategy!r} is not one of {', '.join(PLAN_STRATEGIES)}"
        )
    if strategy == "loop":
        return "loop"
    if bs == 0 or (strategy == "auto" and bs <= chunk):
        return "fixed"
    if strategy == "auto":
        if bs <= AUTO_PLAN_RECOUNT_MAX_BS and chunk >= AUTO_PLAN_CHUNK:
            return "recount"
        few = -(-bs // chunk) <= AUTO_PLAN_LOOKBACK_SLICES
        eager = not capturing and bs <= AUTO_PLAN_LOOKBACK_MAX_BS
        return "lookback" if few and eager else "scan"
    return strategy


@_cached
def plan_offsets_launch_plan(
    bs: int, chunk_size: int | None = None, strategy: str = "auto", capturing: bool = False
) -> LaunchPlan:
    """The plan of ``plan_offsets`` on ``bs`` requests, eager or (``capturing``) on a stream
    capturing a CUDA graph. Raises the call's own errors for an unknown ``strategy`` or a bad
    ``chunk_size``."""
    chunk = resolve_plan_chunk(chunk_size, strategy, bs, capturing)
    resolved = resolve_plan_strategy(strategy, bs, chunk, capturing)
    slices: Sequence[tuple[int, int]] = ()
    temps: tuple[str, ...] = ()
    fixed = ("_plan_offsets_kernel",)
    if resolved == "fixed":
        launches = (Launch("plan_fixed", fixed, (1,), (("bs_block", block_for(max(bs, 1))),)),)
    elif resolved == "loop":
        slices = tuple(slice_bounds(bs, chunk)) or ((0, 0),)
        block = (("bs_block", block_for(chunk)),)
        launches = tuple(Launch("plan_fixed", fixed, (1,), block, se) for se in slices)
        temps = ("carry: 3 int64 zeros (verify total, write total, requests so far)",)
    else:  # one launch over the slices: counted, not listed
        slices = SliceBounds(bs, chunk)
        grid = (len(slices),)
        if resolved == "scan":
            kernels = ("_plan_slice_sums_kernel", "_plan_scan_kernel")
            temps = (f"sums: [{len(slices)}, 2] int64, uninitialised",)
        elif resolved == "lookback":
            kernels = ("_plan_lookback_kernel",)
            words = lookback_state_words(len(slices))
            temps = (
                f"state: {words} int64 filled with INT64_MIN, one torch op"
                if capturing
                else f"state: {words} int64 words of the stream's resident buffer, which the "
                "launch leaves as it found it (filled only when made or grown)",
            )
        else:
            kernels = ("_plan_recount_kernel",)
        auto_slices = strategy == "auto" and chunk_size is None
        tile, warps = _plan_tile_warps(bs, chunk, resolved, auto_slices)
        params = (("chunk", chunk), ("bs_block", tile), ("num_warps", warps))
        launches = (Launch(f"plan_{resolved}", kernels, grid, params),)
    # The carry's zero fill; a captured look-back's state fill.
    ops = int(resolved == "loop" or (resolved == "lookback" and capturing))
    other = resolve_plan_strategy(
        strategy, bs, resolve_plan_chunk(chunk_size, strategy, bs, not capturing), not capturing
    )
    return LaunchPlan(
        "plan_offsets", strategy, resolved, bs, None,
        chunk if slices else None, slices, launches, temps, (), ops,
        capturing, other != resolved or resolved == "lookback",
    )  # fmt: skip
