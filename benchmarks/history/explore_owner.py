"""Step 64 of benchmarks/NOTES.md: an owner map for ``capped``'s tail tiles, measured.

Steps 25 and 63 estimated, and did not build, a tail tile that learns its owner from a map
instead of a guess and three search rounds (decodes with prefill pieces: about ten dependent
loads a tail). Step 63's form is two kernels: ``_owner_map_kernel`` first (one program per
``REQS`` requests: each request writes its index into the map entry of every tail tile whose
first token ``CAP + i*TAIL`` lies in its run, one offsets read then stores), then the library
kernel with its tail code swapped (``_tail_mapped``): a tile reads its map entry ``e``, then
``offsets[e]``, ``offsets[e + 1]`` and the row of ``e`` together, and keeps ``e`` where
``offsets[e] <= a < offsets[e + 1]`` (with non-decreasing offsets that is the owner the
library's search finds, whatever the map held before: a stale entry is either that owner or
fails the test). ``FALLBACK = 1``: a tile whose entry fails searches as the library does
(``_narrow`` from ``[0, bs)``); ``FALLBACK = 0``: it copies nothing, so a byte-exact result on
a map poisoned before the call shows the map alone placed every tile. The chain of a busy
tail is then four loads (map, owner's offsets and row, tokens) and a store.

What the estimate left unmeasured is the second kernel's start in a graph: timed here as
graphs of one empty kernel, two, and two with programmatic dependent launch (PDL, sm_90:
the second kernel launched with ``launch_pdl=True`` may start once every program of the
first has called ``gdc_launch_dependents``; its ``gdc_wait`` waits for the first kernel's
completion and memory). ``map pdl``: the map kernel triggers at its start, the mapped
kernel's heads never wait (they do not read the map) and its tails wait just before the map
read.

Each variant is checked byte for byte against the reference on a poisoned pool, eagerly and
as a graph's replay (pool and map poisoned between capture and replay), then graph-replay
timed side by side with the empty launch and the library (``graph_times_interleaved_us``,
6 rounds). Host time: the library's ``auto`` with and without one more bound launch of the
map kernel, beside a bare ``kernel[grid](...)`` launch of the library kernel.
``python -m benchmarks.history.explore_owner [--dists ...]``; on the CPU
(``TRITON_INTERPRET=1``) the quick batches are checked without PDL and nothing is timed.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from functools import partial

import torch
import triton
import triton.language as tl

from benchmarks.distributions import WIDTH, _dist
from kvcanary_dispatch import scatter_req_token_ids
from kvcanary_dispatch.cli.timing import (
    copy_bandwidth_gbs,
    empty_launch,
    floor_us,
    graph_times_interleaved_us,
    host_overhead_interleaved_us,
    scatter_sector_bytes,
)
from kvcanary_dispatch.scatter_shapes import capped_shape
from kvcanary_dispatch.testing.cases import POISON_I32, ScatterCase, make_scatter_case
from kvcanary_kernels import scatter_req_token_ids_ref
from kvcanary_kernels._launch import BoundKernel
from kvcanary_kernels.scatter_capped import (
    CAPPED_PROBES,
    _copy_columns,
    _head,
    _narrow,
    _role,
    _scatter_capped_kernel,
    capped_grid,
)

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
MAP_REQS = 128  # requests a map program reads
MAP_STEP = 32  # map entries a request writes a step


@triton.jit
def _owner_map_kernel(
    offsets_ptr,  # [bs + 1] int64
    map_ptr,  # [n_tiles] int32
    num_tokens,
    bs,
    n_tiles,
    CAP: tl.constexpr,
    TAIL: tl.constexpr,
    REQS: tl.constexpr,
    STEP: tl.constexpr,
    PDL: tl.constexpr,
):
    """Each request ``r`` writes ``r`` into the entries of the tiles whose first token
    ``CAP + i*TAIL`` lies in its run ``[offsets[r], offsets[r + 1])`` (cut to ``num_tokens``);
    ``STEP`` entries a step."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()  # the mapped kernel may start now
    r = tl.program_id(0).to(tl.int64) * REQS + tl.arange(0, REQS)  # [R] int64
    in_batch = r < bs
    end = tl.minimum(tl.load(offsets_ptr + r + 1, mask=in_batch, other=0), num_tokens)
    start = tl.minimum(tl.load(offsets_ptr + r, mask=in_batch, other=0), end)  # [R] int64
    # Tiles [i0, i1): the first i with CAP + i*TAIL >= start, the first with it >= end.
    i0 = (tl.maximum(start - CAP, 0) + TAIL - 1) // TAIL  # [R] int64
    i1 = tl.minimum((tl.maximum(end - CAP, 0) + TAIL - 1) // TAIL, n_tiles)
    i1 = tl.where(in_batch, tl.maximum(i1, i0), i0)
    k = tl.arange(0, STEP)  # [S] int32
    stop = tl.max(i1 - i0, axis=0)
    k0 = stop * 0
    while k0 < stop:
        i = i0[:, None] + k0 + k[None, :]  # [R, S] int64
        owner = r[:, None].to(tl.int32) + k[None, :] * 0  # [R, S] int32
        tl.store(map_ptr + i, owner, mask=i < i1[:, None])
        k0 += STEP


@triton.jit
def _tail_mapped(
    q, map_ptr, flat_in_ptr, offsets_ptr, req_pool_indices_ptr, pool_out_ptr, num_tokens,
    bs, pool_stride0, max_context_len, CAP: tl.constexpr, TILES: tl.constexpr,
    TAIL: tl.constexpr, TAIL_COLS: tl.constexpr, PROBES: tl.constexpr, PEEL: tl.constexpr,
    PDL: tl.constexpr, FALLBACK: tl.constexpr,
):  # fmt: skip
    """The library's ``_tail`` with each tile's owner read from the map (see the module)."""
    tile = q * TILES + tl.arange(0, TILES)  # [N] int64
    a = CAP + tile * TAIL  # [N] int64, each tile's first token
    live = a < num_tokens
    if PDL:
        tl.extra.cuda.gdc_wait()  # the map kernel's writes are visible past this
    e = tl.load(map_ptr + tile, mask=live, other=0).to(tl.int64)  # [N] int64
    e = tl.minimum(tl.maximum(e, 0), bs - 1)
    start = tl.load(offsets_ptr + e, mask=live, other=0)  # [N] int64
    end = tl.load(offsets_ptr + e + 1, mask=live, other=0)  # [N] int64
    row = tl.load(req_pool_indices_ptr + e, mask=live, other=0)  # [N] int64
    found = live & (start <= a) & (a < end)
    idle = ~found
    if FALLBACK:
        lost = live & ~found
        if tl.max(lost.to(tl.int32), axis=0) > 0:
            lo = tl.where(lost, 0, e)
            hi = tl.where(lost, bs, e + 1)
            while tl.max(hi - lo, axis=0) > 1:
                lo, hi = _narrow(lo, hi, a, offsets_ptr, PROBES)
            start = tl.where(lost, tl.load(offsets_ptr + lo, mask=lost, other=0), start)
            end = tl.where(lost, tl.load(offsets_ptr + lo + 1, mask=lost, other=0), end)
            row = tl.where(lost, tl.load(req_pool_indices_ptr + lo, mask=lost, other=0), row)
        idle = ~live
    # As the library: tokens [t0, t1) of each tile, its owner's at columns [CAP, width).
    t0 = tl.maximum(a, start + CAP)
    t1 = tl.minimum(tl.minimum(a + TAIL, end), tl.minimum(num_tokens, start + max_context_len))
    busy = (t1 > t0) & ~idle  # [N]
    src = flat_in_ptr + a
    dst = pool_out_ptr + row * pool_stride0 + (a - start)
    lo_c = tl.where(busy, t0 - a, 0).to(tl.int32)  # [N] int32
    hi_c = tl.where(busy, t1 - a, 0).to(tl.int32)
    _copy_columns(src, dst, lo_c, hi_c, TAIL_COLS, PEEL)


@triton.jit(do_not_specialize=["num_tokens", "bs", "pool_stride0", "max_context_len"])
def _mapped_kernel(
    map_ptr, flat_in_ptr, offsets_ptr, req_pool_indices_ptr, pool_out_ptr, num_tokens, bs,
    pool_stride0, max_context_len, REQS: tl.constexpr, COLS: tl.constexpr,
    STEPS: tl.constexpr, TILES: tl.constexpr, TAIL: tl.constexpr, TAIL_COLS: tl.constexpr,
    PROBES: tl.constexpr, PEEL: tl.constexpr, TAILS_FIRST: tl.constexpr, PDL: tl.constexpr,
    FALLBACK: tl.constexpr,
):  # fmt: skip
    """The library kernel with ``_tail_mapped`` for its tails (heads unchanged)."""
    is_head, head_id, tail_id = _role(bs, REQS, TAILS_FIRST)
    if is_head:
        _head(
            head_id, flat_in_ptr, offsets_ptr, req_pool_indices_ptr, pool_out_ptr,
            num_tokens, bs, pool_stride0, max_context_len, REQS, COLS, STEPS * COLS, PEEL,
        )  # fmt: skip
    else:
        _tail_mapped(
            tail_id, map_ptr, flat_in_ptr, offsets_ptr, req_pool_indices_ptr, pool_out_ptr,
            num_tokens, bs, pool_stride0, max_context_len, STEPS * COLS, TILES, TAIL,
            TAIL_COLS, PROBES, PEEL, PDL, FALLBACK,
        )  # fmt: skip


@triton.jit
def _empty(x_ptr, TRIGGER: tl.constexpr, WAIT: tl.constexpr):
    """An empty kernel, with PDL's trigger and wait where asked."""
    if TRIGGER:
        tl.extra.cuda.gdc_launch_dependents()
    if WAIT:
        tl.extra.cuda.gdc_wait()


def _library(p, flat_in, offsets, req_pool_indices, pool_out) -> None:
    bs, n, width = req_pool_indices.numel(), flat_in.numel(), pool_out.shape[1]
    _scatter_capped_kernel[capped_grid(bs, n, width, p)](
        flat_in, offsets, req_pool_indices, pool_out, n, bs, pool_out.stride(0), width,
        REQS=p["reqs"], COLS=p["cols"], STEPS=p["steps"], TILES=p["tiles"], TAIL=p["tail"],
        TAIL_COLS=p["tail_cols"], PROBES=CAPPED_PROBES, GUESS=p["guess"],
        GUESS_STRIDE=p["guess_stride"], PEEL=p["peel"], TAILS_FIRST=p["tails_first"],
        num_warps=p["num_warps"],
    )  # fmt: skip


def _map_meta(p: dict, pdl: bool) -> dict:
    cap = p["steps"] * p["cols"]
    return dict(CAP=cap, TAIL=p["tail"], REQS=MAP_REQS, STEP=MAP_STEP, PDL=pdl, num_warps=4)


def _map_args(owner_map, flat_in, offsets, req_pool_indices) -> tuple:
    bs = req_pool_indices.numel()
    return (offsets, owner_map, flat_in.numel(), bs, owner_map.numel())


def _mapped(p, owner_map, pdl, fallback, flat_in, offsets, req_pool_indices, pool_out,
            write_map=True) -> None:  # fmt: skip
    bs, n, width = req_pool_indices.numel(), flat_in.numel(), pool_out.shape[1]
    if write_map:
        _owner_map_kernel[(triton.cdiv(bs, MAP_REQS),)](
            *_map_args(owner_map, flat_in, offsets, req_pool_indices), **_map_meta(p, pdl)
        )
    extra = {"launch_pdl": True} if pdl else {}
    _mapped_kernel[capped_grid(bs, n, width, p)](
        owner_map, flat_in, offsets, req_pool_indices, pool_out, n, bs, pool_out.stride(0),
        width, REQS=p["reqs"], COLS=p["cols"], STEPS=p["steps"], TILES=p["tiles"],
        TAIL=p["tail"], TAIL_COLS=p["tail_cols"], PROBES=CAPPED_PROBES, PEEL=p["peel"],
        TAILS_FIRST=p["tails_first"], PDL=pdl, FALLBACK=fallback, num_warps=p["num_warps"],
        **extra,
    )  # fmt: skip


def _check(label, case, run, owner_map, want, dev) -> None:
    """``run`` byte for byte against the reference on a poisoned pool and map, eagerly and
    (on CUDA) as a graph's replay poisoned again between capture and replay."""
    pool = case.fresh_pool()
    for graphed in (False, True) if dev.type == "cuda" else (False,):
        pool.fill_(POISON_I32)
        owner_map.fill_(-1)
        if graphed:
            graph = torch.cuda.CUDAGraph()
            side = torch.cuda.Stream(dev)
            side.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(side):
                run(**case.kwargs(pool))  # compile outside the capture
            torch.cuda.current_stream(dev).wait_stream(side)
            with torch.cuda.graph(graph, stream=side):
                run(**case.kwargs(pool))
            pool.fill_(POISON_I32)
            owner_map.fill_(-1)
            graph.replay()
            torch.cuda.synchronize(dev)
        else:
            run(**case.kwargs(pool))
        if not torch.equal(pool, want):
            diff = (pool != want).nonzero()
            raise AssertionError(
                f"{label} ({'graph' if graphed else 'eager'}): {diff.shape[0]} elements differ,"
                f" first at {diff[0].tolist()}"
            )
    print(f"  checked {label}: eager{' and graph replay' if dev.type == 'cuda' else ''}")


def _check_stale(case, p, owner_map, want) -> None:
    """The mapped kernel alone (no map written) on a map whose every entry is a wrong
    neighbour of its tile's owner (one request before or after it, alternately): the owner
    test must reject each, and the fallback search find the owners."""
    cap, tail = p["steps"] * p["cols"], p["tail"]
    a = cap + torch.arange(owner_map.numel(), dtype=torch.int64) * tail
    owner = torch.searchsorted(case.offsets.cpu(), a, right=True) - 1
    shift = torch.where(torch.arange(a.numel()) % 2 == 0, -1, 1)
    stale = (owner + shift).clamp(0, case.bs - 1)
    pool = case.fresh_pool()
    pool.fill_(POISON_I32)
    owner_map.copy_(stale.to(torch.int32))
    _mapped(p, owner_map, False, True, **case.kwargs(pool), write_map=False)
    if not torch.equal(pool, want):
        raise AssertionError(f"stale map: {int((pool != want).sum())} elements differ")
    print(f"  checked the owner test and fallback on a stale map ({a.numel()} tiles)")


def _med(xs: list[float]) -> float:
    return float(torch.tensor(xs).median())


def launch_gaps(dev: torch.device) -> None:
    """Graphs of one empty kernel, two, and two with PDL, side by side."""
    x = torch.zeros(1, device=dev)

    def two(pdl: bool) -> None:
        _empty[(1,)](x, TRIGGER=pdl, WAIT=False)
        _empty[(1,)](x, TRIGGER=False, WAIT=pdl, **({"launch_pdl": True} if pdl else {}))

    fns = {"one empty": empty_launch(dev), "two empty": partial(two, False),
           "two empty, PDL": partial(two, True)}  # fmt: skip
    times = graph_times_interleaved_us(list(fns.values()), dev, rounds=6)
    for label, t in zip(fns, times, strict=True):
        print(f"  {label:16s} median {_med(t):5.2f} us  rounds {' '.join(f'{v:.2f}' for v in t)}")


def batch_case(name: str, dev: torch.device, quick: bool) -> tuple[ScatterCase, int, dict]:
    """The batch ``name`` (``mix_cpu``: the interpreter's batch with busy tail tiles), its
    pool width and ``capped``'s shape for it."""
    g = torch.Generator().manual_seed(len(name))
    if name == "mix_cpu":  # decodes, 5 long runs
        lens = torch.ones(700, dtype=torch.int64)
        lens[torch.randperm(700, generator=g)[:5]] = torch.randint(40, 400, (5,), generator=g)
        lens[:3] = 0  # empty runs too
    else:
        lens = _dist(name, quick, g)
    unit = 16 if quick else 1024
    width = max(WIDTH // (64 if quick else 1), -(-int(lens.max()) // unit) * unit)
    case = make_scatter_case(lens, width=width, seed=1, device=dev)
    return case, width, dict(capped_shape(case.bs, case.total, width))


def owner_map_and_reference(
    name: str, case: ScatterCase, width: int, p: dict, dev: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """A map of one entry a tail tile, at -1, and the reference pool; prints the batch."""
    grid = capped_grid(case.bs, case.total, width, p)[0]
    heads = triton.cdiv(case.bs, p["reqs"])
    owner_map = torch.full((max((grid - heads) * p["tiles"], 1),), -1, dtype=torch.int32,
                           device=dev)  # fmt: skip
    print(f"== {name} bs={case.bs} tokens={case.total} width={width} shape={p} "
          f"programs={grid} heads={heads} map entries={owner_map.numel()}", flush=True)  # fmt: skip
    want = case.fresh_pool()
    scatter_req_token_ids_ref(**case.kwargs(want))
    return owner_map, want


def timed_side_by_side(
    labels: list[str], fns: list[Callable[[], None]], floor: float, dev: torch.device, pad: int
) -> tuple[dict[str, list[float]], float]:
    """``fns`` (the first the empty launch "L0", one "library") replayed side by side, six
    rounds; prints each one's median, its ratio to floor + L0 and to the library, round by
    round. Returns the times by label and the bar, 1.5 x (floor + L0)."""
    times = dict(zip(labels, graph_times_interleaved_us(fns, dev, rounds=6), strict=True))
    torch.cuda.synchronize(dev)
    for label in labels:
        t = times[label]
        ratio = [v / (floor + l0) for v, l0 in zip(t, times["L0"], strict=True)]
        vs_lib = [v / lib for v, lib in zip(t, times["library"], strict=True)]
        print(f"  {label:{pad}s} median {_med(t):6.2f} us  / (floor + L0) {_med(ratio):.3f}x "
              f"({min(ratio):.2f}-{max(ratio):.2f})  / library {_med(vs_lib):.3f}x  "
              f"rounds {' '.join(f'{v:.2f}' for v in t)}", flush=True)  # fmt: skip
    return times, 1.5 * (floor + _med(times["L0"]))


def run_batch(name: str, dev: torch.device, quick: bool, gbs: float | None) -> None:
    case, width, p = batch_case(name, dev, quick)
    owner_map, want = owner_map_and_reference(name, case, width, p, dev)
    runs = {"library": partial(_library, p)}
    for pdl in (False, True) if dev.type == "cuda" else (False,):
        tag = "map pdl" if pdl else "map 2k"
        runs[tag] = partial(_mapped, p, owner_map, pdl, True)
        runs[f"{tag} only"] = partial(_mapped, p, owner_map, pdl, False)
    for label, run in runs.items():
        _check(label, case, run, owner_map, want, dev)
    _check_stale(case, p, owner_map, want)
    if dev.type != "cuda":
        return
    pool = case.fresh_pool()
    floor = floor_us(scatter_sector_bytes(case, pool), gbs)
    labels = ["L0", *runs]
    fns = [empty_launch(dev), *(partial(r, **case.kwargs(pool)) for r in runs.values())]
    _, bar = timed_side_by_side(labels, fns, floor, dev, 14)
    print(f"  floor {floor:.2f} us; bar 1.5 x (floor + L0) = {bar:.2f} us")
    if name != "decode_prefill_8192":
        return
    bound = BoundKernel(_owner_map_kernel, _map_meta(p, True))
    map_grid = (triton.cdiv(case.bs, MAP_REQS),)
    kw = case.kwargs(pool)
    margs = _map_args(owner_map, kw["flat_in"], kw["offsets"], kw["req_pool_indices"])

    def auto_and_map() -> None:
        scatter_req_token_ids(**kw)
        bound(map_grid, margs)

    host = {"bare library launch": partial(_library, p, **kw),
            "auto": partial(scatter_req_token_ids, **kw),
            "auto + bound map launch": auto_and_map}  # fmt: skip
    for f in host.values():
        f()
    us = host_overhead_interleaved_us(list(host.values()), dev, rounds=7)
    for label, v in zip(host, us, strict=True):
        print(f"  host {label:26s} {v:6.2f} us  ({v / us[0]:.3f}x the bare launch)")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dists", nargs="+", default=["decode_prefill_8192", "spec_16384",
                    "ones_32768", "ones_262144", "u128_32768", "giant_4096",
                    "lognormal1_16384"])  # fmt: skip
    args = ap.parse_args()
    if INTERPRETED:
        args.dists = ["mix_cpu", *args.dists]
    dev = torch.device("cpu" if INTERPRETED else "cuda")
    gbs = None
    if dev.type == "cuda":
        print(f"{torch.cuda.get_device_name(dev)}; torch {torch.__version__}, "
              f"Triton {triton.__version__}")  # fmt: skip
        gbs = copy_bandwidth_gbs(dev)
        print(f"copy bandwidth {gbs:.0f} GB/s")
        launch_gaps(dev)
    for name in args.dists:
        run_batch(name, dev, INTERPRETED, gbs)


if __name__ == "__main__":
    main()
