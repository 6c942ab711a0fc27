"""Steps 65-66 of benchmarks/NOTES.md: step 64's owner map in one launch, the tails polling it.

Step 64's map cost a second kernel (1.0-1.3 µs of replay for the launch alone). Here the
library kernel's head programs write the map themselves (``_head_publish``: a head reads its
requests' offsets and rows, writes each request's index into the entries of the tail tiles
whose first token lies in its run, then copies as the library's head does), and each tail
program polls its tiles' entries (``_tail_polled``: volatile loads of the entries still unset,
at most ``POLLS`` rounds), sets each entry it read back to -1, then takes the owner as step
64's ``_tail_mapped`` does. An entry is checked against the offsets before use
(``offsets[e] <= a < offsets[e + 1]``: the library's owner, whatever the map held), and a tile
whose entry never came, or fails the check, searches as the library does. So no wait is
unbounded and no order of programs is needed for correctness: heads take the lower program
ids, which the GPUs measured start first (steps 20 and 22), and a tail that polls in vain
only loses time. The map starts at -1 and the tails leave it so (checked after each run:
an entry left set means a tail gave up before its head wrote it).

Checked byte for byte against the reference on a poisoned pool, eagerly and as a graph's
replay; the map is then checked to be all -1. Timed side by side with the empty launch and
the library (``graph_times_interleaved_us``, 6 rounds), on the short-run batches (their tail
programs follow their heads in program order).
Two polls (``--forms``):
- 65 (step 65, labelled ``polled``): a ``[TILES]`` volatile load. Where a tile has fewer
  elements than the program has threads, each entry is held, and read, by several threads,
  whose copies can disagree while heads write; it faulted on an H100 and an H200.
- 66 (step 66, labelled ``once``, the default): a ``[TILES, COPIES]`` load with exactly one
  element a thread, only column 0 reading, then a max over the columns. Every thread holding
  an entry then holds the reduction's one result, so no copy can disagree with another;
  it ran on an H200 without a fault (step 66), and slower than the library.
``python -m benchmarks.history.explore_poll [--dists ...] [--polls N ...] [--forms 65 66]``;
on the CPU (``TRITON_INTERPRET=1``) the checks only.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from functools import partial

import torch
import triton
import triton.language as tl

from benchmarks.history.explore_owner import (
    INTERPRETED,
    _library,
    _med,
    batch_case,
    owner_map_and_reference,
    timed_side_by_side,
)
from benchmarks.history.explore_owner import _check as check_against_reference
from kvcanary_dispatch.cli.timing import (
    copy_bandwidth_gbs,
    empty_launch,
    floor_us,
    scatter_sector_bytes,
)
from kvcanary_kernels.scatter_capped import (
    CAPPED_PROBES,
    _copy_columns,
    _narrow,
    _role,
    capped_grid,
)
from kvcanary_kernels.scatter_segments import _run_columns

DIAG = os.environ.get("DIAG") == "1"
STEP = tl.constexpr(32)  # map entries a request writes a step


@triton.jit
def _head_publish(
    g, map_ptr, flat_in_ptr, offsets_ptr, req_pool_indices_ptr, pool_out_ptr, num_tokens, bs,
    pool_stride0, max_context_len, n_tiles, REQS: tl.constexpr, COLS: tl.constexpr,
    CAP: tl.constexpr, TAIL: tl.constexpr, PEEL: tl.constexpr,
):  # fmt: skip
    """The library's ``_head``, writing the map entries of its requests' tiles first."""
    r = g * REQS + tl.arange(0, REQS)  # [R] int64
    in_batch = r < bs
    row = tl.load(req_pool_indices_ptr + r, mask=in_batch, other=0)  # [R] int64
    start = tl.load(offsets_ptr + r, mask=in_batch, other=0)  # [R] int64
    end = tl.load(offsets_ptr + r + 1, mask=in_batch, other=0)  # [R] int64
    # Tiles [i0, i1) whose first token CAP + i*TAIL lies in the run cut to num_tokens.
    cut = tl.minimum(end, num_tokens)
    i0 = (tl.maximum(tl.minimum(start, cut) - CAP, 0) + TAIL - 1) // TAIL  # [R] int64
    i1 = tl.minimum((tl.maximum(cut - CAP, 0) + TAIL - 1) // TAIL, n_tiles)
    i1 = tl.where(in_batch, tl.maximum(i1, i0), i0)
    k = tl.arange(0, STEP)  # [S] int32
    stop = tl.max(i1 - i0, axis=0)
    k0 = stop * 0
    while k0 < stop:
        i = i0[:, None] + k0 + k[None, :]  # [R, S] int64
        tl.store(map_ptr + i, r[:, None].to(tl.int32) + k[None, :] * 0, mask=i < i1[:, None])
        k0 += STEP
    lo, hi = _run_columns(start, end, num_tokens, tl.minimum(max_context_len, CAP))
    src = flat_in_ptr + start
    dst = pool_out_ptr + row * pool_stride0
    _copy_columns(src, dst, lo.to(tl.int32), hi.to(tl.int32), COLS, PEEL)


@triton.jit
def _tail_polled(
    q, map_ptr, flat_in_ptr, offsets_ptr, req_pool_indices_ptr, pool_out_ptr, num_tokens, bs,
    pool_stride0, max_context_len, CAP: tl.constexpr, TILES: tl.constexpr,
    TAIL: tl.constexpr, TAIL_COLS: tl.constexpr, PROBES: tl.constexpr, PEEL: tl.constexpr,
    POLLS: tl.constexpr, COPIES: tl.constexpr,
):  # fmt: skip
    """Each tile's owner from its map entry, polled (see the module), else searched."""
    tile = q * TILES + tl.arange(0, TILES)  # [N] int64
    a = CAP + tile * TAIL  # [N] int64, each tile's first token
    live = a < num_tokens
    e = tl.full([TILES], -1, tl.int32)  # [N] int32, the entries read
    seen = ~live
    polls = tl.zeros([], tl.int32)
    while (tl.min(seen.to(tl.int32), axis=0) == 0) & (polls < POLLS):
        if COPIES == 0:  # step 65: a [N] load, each entry read by every thread holding it
            v = tl.load(map_ptr + tile, mask=~seen, other=-1, volatile=True)  # [N] int32
        else:  # step 66: one read an entry, in a [N, C] tile with one element a thread
            c = tl.arange(0, COPIES)  # [C] int32
            want = (~seen)[:, None] & (c[None, :] == 0)  # [N, C], column 0 reads
            v = tl.max(
                tl.load(
                    map_ptr + tile[:, None] + c[None, :] * 0, mask=want, other=-1, volatile=True
                ),
                axis=1,
            )  # [N] int32, the same in every copy: a reduction's result
        e = tl.where(seen, e, v)
        seen = seen | (v >= 0)
        polls += 1
    tl.store(map_ptr + tile, tl.full([TILES], -1, tl.int32), mask=live & (e >= 0))  # re-arm
    o = tl.minimum(tl.maximum(e.to(tl.int64), 0), bs - 1)  # [N] int64
    start = tl.load(offsets_ptr + o, mask=live, other=0)  # [N] int64
    end = tl.load(offsets_ptr + o + 1, mask=live, other=0)  # [N] int64
    row = tl.load(req_pool_indices_ptr + o, mask=live, other=0)  # [N] int64
    lost = live & ~((start <= a) & (a < end))
    if tl.max(lost.to(tl.int32), axis=0) > 0:  # no entry, or one that fails: search
        lo = tl.where(lost, 0, o)
        hi = tl.where(lost, bs, o + 1)
        while tl.max(hi - lo, axis=0) > 1:
            lo, hi = _narrow(lo, hi, a, offsets_ptr, PROBES)
        start = tl.where(lost, tl.load(offsets_ptr + lo, mask=lost, other=0), start)
        end = tl.where(lost, tl.load(offsets_ptr + lo + 1, mask=lost, other=0), end)
        row = tl.where(lost, tl.load(req_pool_indices_ptr + lo, mask=lost, other=0), row)
    # As the library: tokens [t0, t1) of each tile, its owner's at columns [CAP, width).
    t0 = tl.maximum(a, start + CAP)
    t1 = tl.minimum(tl.minimum(a + TAIL, end), tl.minimum(num_tokens, start + max_context_len))
    busy = (t1 > t0) & live  # [N]
    src = flat_in_ptr + a
    dst = pool_out_ptr + row * pool_stride0 + (a - start)
    lo_c = tl.where(busy, t0 - a, 0).to(tl.int32)  # [N] int32
    hi_c = tl.where(busy, t1 - a, 0).to(tl.int32)
    _copy_columns(src, dst, lo_c, hi_c, TAIL_COLS, PEEL)


@triton.jit(do_not_specialize=["num_tokens", "bs", "pool_stride0", "max_context_len", "n_tiles"])
def _polled_kernel(
    map_ptr, flat_in_ptr, offsets_ptr, req_pool_indices_ptr, pool_out_ptr, num_tokens, bs,
    pool_stride0, max_context_len, n_tiles, REQS: tl.constexpr, COLS: tl.constexpr,
    STEPS: tl.constexpr, TILES: tl.constexpr, TAIL: tl.constexpr, TAIL_COLS: tl.constexpr,
    PROBES: tl.constexpr, PEEL: tl.constexpr, POLLS: tl.constexpr, COPIES: tl.constexpr,
):  # fmt: skip
    """Heads first (``_head_publish``), then tails (``_tail_polled``)."""
    is_head, head_id, tail_id = _role(bs, REQS, False)
    if is_head:
        _head_publish(
            head_id, map_ptr, flat_in_ptr, offsets_ptr, req_pool_indices_ptr, pool_out_ptr,
            num_tokens, bs, pool_stride0, max_context_len, n_tiles, REQS, COLS, STEPS * COLS,
            TAIL, PEEL,
        )  # fmt: skip
    else:
        _tail_polled(
            tail_id, map_ptr, flat_in_ptr, offsets_ptr, req_pool_indices_ptr, pool_out_ptr,
            num_tokens, bs, pool_stride0, max_context_len, STEPS * COLS, TILES, TAIL,
            TAIL_COLS, PROBES, PEEL, POLLS, COPIES,
        )  # fmt: skip


def _polled(
    p, owner_map, polls, flat_in, offsets, req_pool_indices, pool_out, one_read=False
) -> None:
    """The polled kernel; ``one_read``: step 66's poll (one read an entry), else step 65's."""
    threads = 32 * p["num_warps"]
    bs, n, width = req_pool_indices.numel(), flat_in.numel(), pool_out.shape[1]
    grid = capped_grid(bs, n, width, p)
    n_tiles = (grid[0] - triton.cdiv(bs, p["reqs"])) * p["tiles"]  # the tail programs' tiles
    _polled_kernel[grid](
        owner_map, flat_in, offsets, req_pool_indices, pool_out, n, bs, pool_out.stride(0),
        width, n_tiles, REQS=p["reqs"], COLS=p["cols"], STEPS=p["steps"],
        TILES=p["tiles"], TAIL=p["tail"], TAIL_COLS=p["tail_cols"], PROBES=CAPPED_PROBES,
        PEEL=p["peel"], POLLS=polls, COPIES=max(threads // p["tiles"], 1) if one_read else 0,
        num_warps=p["num_warps"],
    )  # fmt: skip


def _left_set(owner_map: torch.Tensor) -> int:
    """Map entries not at -1 (a tail gave up before its head wrote, or nothing re-armed)."""
    return int((owner_map != -1).sum())


def _check(label, case, run, owner_map, want, dev) -> None:
    """Step 64's check (``run`` byte for byte against the reference on a poisoned pool and a
    map at -1, eagerly and, on CUDA, as a graph's replay), then the map entries left set."""
    check_against_reference(label, case, run, owner_map, want, dev)
    print(f"  map entries left set after {label}'s last run: {_left_set(owner_map)}")


def warm_replays_us(
    calls: dict[str, Callable[[], None]], dev: torch.device, rounds: int = 6, reps: int = 500
) -> tuple[dict[str, torch.cuda.CUDAGraph], dict[str, list[float]]]:
    """Each call captured in a CUDA graph (after one eager call), then the graphs' replays
    timed by events with the L2 warm: ``rounds`` rounds of the graphs in turn, each ``reps``
    replays after 50 untimed. Returns the graphs and, per call, its µs a replay round by
    round."""
    graphs = {}
    for label, fn in calls.items():
        fn()
        torch.cuda.synchronize(dev)
        graphs[label] = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graphs[label]):
            fn()
    warm: dict[str, list[float]] = {label: [] for label in graphs}
    for _ in range(rounds):
        for label, graph in graphs.items():
            for _ in range(50):
                graph.replay()
            begin = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            begin.record()
            for _ in range(reps):
                graph.replay()
            end.record()
            torch.cuda.synchronize(dev)
            warm[label].append(begin.elapsed_time(end) * 1e3 / reps)
    return graphs, warm


def run_batch(
    name: str, dev: torch.device, polls: list[int], forms: list[int], gbs: float | None
) -> None:
    case, width, p = batch_case(name, dev, INTERPRETED)
    if p["tails_first"]:
        print(f"== {name}: its tail programs come first; not run")
        return
    owner_map, want = owner_map_and_reference(name, case, width, p, dev)
    runs = {"library": partial(_library, p)}
    for form in forms:  # step 65's poll ("polled"), step 66's one read an entry ("once")
        label = "polled" if form == 65 else "once"
        runs.update({
            f"{label} {k}": partial(_polled, p, owner_map, k, one_read=form == 66) for k in polls
        })  # fmt: skip
    for label, run in runs.items():
        _check(label, case, run, owner_map, want, dev)
    if dev.type != "cuda":
        return
    pool = case.fresh_pool()
    floor = floor_us(scatter_sector_bytes(case, pool), gbs)
    labels = ["L0", *runs]
    fns = [empty_launch(dev), *(partial(r, **case.kwargs(pool)) for r in runs.values())]
    owner_map.fill_(-1)
    if DIAG:  # warm-L2 replays timed with events, rounds alternating; then stop
        _, warm = warm_replays_us(dict(zip(labels, fns, strict=True)), dev)
        for label in labels:
            t = warm[label]
            print(f"  warm {label:10s} median {_med(t):6.2f} us  / library "
                  f"{_med([v / w for v, w in zip(t, warm['library'], strict=True)]):.3f}x  rounds "
                  f"{' '.join(f'{v:.2f}' for v in t)}; map entries left set {_left_set(owner_map)}",
                  flush=True)  # fmt: skip
        return
    _, bar = timed_side_by_side(labels, fns, floor, dev, 10)
    print(f"  floor {floor:.2f} us; bar 1.5 x (floor + L0) = {bar:.2f} us; map entries left "
          f"set after every timed replay: {_left_set(owner_map)}")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dists", nargs="+", default=["decode_prefill_8192", "spec_16384",
                    "ones_32768", "ones_262144", "u128_32768", "lognormal1_16384"])  # fmt: skip
    ap.add_argument("--polls", nargs="+", type=int, default=[4, 32])
    ap.add_argument("--forms", nargs="+", type=int, choices=[65, 66], default=[66],
                    help="the polls (the module's docstring): 65, 66 or both")  # fmt: skip
    args = ap.parse_args()
    dev = torch.device("cpu" if INTERPRETED else "cuda")
    gbs = None
    if INTERPRETED:
        args.dists = ["mix_cpu", *args.dists]
    else:
        print(f"{torch.cuda.get_device_name(dev)}; torch {torch.__version__}, "
              f"Triton {triton.__version__}")  # fmt: skip
        gbs = copy_bandwidth_gbs(dev)
        print(f"copy bandwidth {gbs:.0f} GB/s")
    for name in args.dists:
        run_batch(name, dev, args.polls, args.forms, gbs)


if __name__ == "__main__":
    main()
