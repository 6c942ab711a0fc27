"""Step 11 of benchmarks/NOTES.md: the ``capped`` scatter's shapes across the length
distributions, next to the current strategies, and what a decode batch costs at the least.

- per distribution (those of ``benchmarks.distributions``): the per-request grid, ``flat``,
  ``segments``, ``auto`` and ``capped`` at shapes derived from the mean run length
  (columns = the mean rounded up to a power of two, times ``scale``; ``steps`` head steps;
  tail programs of ``per_tail`` tokens), each checked byte for byte, then graph-replay timed;
- decode floors: on the decode batches, a kernel that reads each request's two offsets, its
  row and its one token and writes it (no loop), and one that only writes a row per request,
  at the benchmark's pool width and on a narrow pool (the same rows, 16 columns).

``python -m benchmarks.history.explore_capped [--floors] [--dists ...] [--budget-s S]
[--reqs-sweep]``; ``--reqs-sweep``: head groups of fewer requests and fewer warps (step 12);
``--ncu-target``: only the decode write pattern, for ``ncu`` to profile.
"""

from __future__ import annotations

import argparse
import time
from functools import partial

import torch
import triton
import triton.language as tl

from benchmarks.distributions import DISTRIBUTIONS, WIDTH, _check_pool, _dist
from kvcanary_dispatch import scatter_req_token_ids
from kvcanary_dispatch.cli.per_request_grid import scatter_per_request_grid
from kvcanary_dispatch.cli.results import Meta
from kvcanary_dispatch.cli.timing import floor_us, graph_time_us, scatter_sector_bytes
from kvcanary_dispatch.testing.cases import make_scatter_case
from kvcanary_kernels import scatter_req_token_ids_ref
from kvcanary_kernels.args import ScatterArgs
from kvcanary_kernels.scatter_capped import capped_grid, launch_scatter_capped

# (scale, steps, cap_min, per_tail, probes, warps, reqs_max, tail_div, guess): the shape of
# the second run first (``auto``'s two classes), then tail tiles narrower than the cap with
# the guessed-owner probe (``guess`` offsets), and heads-only (``per_tail`` 0: timing only).
VARIANTS = [
    (1, 4, 32, 512, 32, 4, 128, 1, 0), (1, 8, 64, 4096, 32, 2, 256, 1, 0),
    (1, 4, 32, 512, 32, 4, 128, 2, 16), (1, 4, 32, 512, 32, 4, 128, 2, 64),
    (1, 4, 32, 512, 32, 4, 128, 4, 64), (1, 4, 64, 1024, 32, 4, 128, 2, 64),
    (1, 4, 64, 1024, 32, 4, 128, 4, 64), (1, 4, 32, 512, 32, 4, 128, 1, 16),
    (1, 8, 64, 4096, 32, 2, 256, 2, 64), (1, 8, 64, 4096, 32, 4, 256, 2, 64),
    (1, 4, 32, 0, 32, 4, 128, 1, 0), (1, 8, 64, 0, 32, 2, 256, 1, 0),
]  # fmt: skip
# --reqs-sweep: the short class with fewer requests a head program (more programs for the same
# batch) and fewer warps, next to auto's own short shape (first).
REQS_SWEEP = [
    (1, 4, 32, 512, 32, 4, 128, 1, 16), (1, 4, 32, 512, 32, 4, 64, 1, 16),
    (1, 4, 32, 512, 32, 2, 64, 1, 16), (1, 4, 32, 512, 32, 4, 32, 1, 16),
    (1, 4, 32, 512, 32, 2, 32, 1, 16), (1, 4, 32, 512, 32, 1, 32, 1, 16),
    (1, 4, 32, 512, 32, 2, 16, 1, 16), (1, 4, 32, 512, 32, 1, 16, 1, 16),
    (1, 8, 64, 4096, 32, 2, 256, 1, 0), (1, 8, 64, 4096, 32, 2, 64, 1, 0),
    (1, 8, 64, 4096, 32, 4, 64, 1, 0), (1, 8, 64, 4096, 32, 1, 16, 1, 0),
]  # fmt: skip


ORDER = ["ones_262144", "ones_32768", "u128_32768", "spec_16384", "decode_prefill_8192",
         "giant_4096", "lognormal2_16384", "lognormal1_16384", "segments_worst_128",
         "prefills_64", "u1024_32768", "tiny_8", "tiny_16_u1024"]  # fmt: skip
assert sorted(ORDER) == sorted(DISTRIBUTIONS)


def capped_params(
    bs, tokens, scale, steps, cap_min, per_tail, probes, warps, reqs_max, tail_div=1, guess=0
) -> dict:
    mean = max(1, -(-tokens // bs))
    cols = int(min(1024, max(1, (1 << (mean - 1).bit_length()) * scale)))
    reqs = min(reqs_max, max(1, 1024 // cols))
    steps = max(steps, cap_min // cols)
    cap = steps * cols
    tail = max(1, min(cap // tail_div, max(per_tail, 1)))
    tiles = max(1, min(64, per_tail // tail))
    tail_cols = min(tail, max(1, 1024 // tiles))
    return dict(reqs=reqs, cols=cols, steps=steps, tiles=tiles, tail=tail, tail_cols=tail_cols,
                probes=probes, num_warps=warps, guess=guess, heads_only=per_tail == 0)  # fmt: skip


def run_capped(p: dict, **kw) -> None:
    t = ScatterArgs(**kw)
    p = dict(p)
    width = 0 if p.pop("heads_only") else t.pool_out.shape[1]  # 0: no tail programs
    grid = capped_grid(t.bs, t.num_tokens, width, p)
    launch_scatter_capped(t, grid=grid, **p)


@triton.jit
def _decode_min(flat_ptr, offsets_ptr, rpi_ptr, pool_ptr, bs, stride, BLOCK: tl.constexpr):
    r = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = r < bs
    s = tl.load(offsets_ptr + r, mask=m, other=0)
    e = tl.load(offsets_ptr + r + 1, mask=m, other=0)
    row = tl.load(rpi_ptr + r, mask=m, other=0)
    m = m & (e > s)
    v = tl.load(flat_ptr + s, mask=m, other=0)
    tl.store(pool_ptr + row * stride, v.to(tl.int32), mask=m)


@triton.jit
def _write_only(rpi_ptr, pool_ptr, bs, stride, BLOCK: tl.constexpr):
    r = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = r < bs
    row = tl.load(rpi_ptr + r, mask=m, other=0)
    tl.store(pool_ptr + row * stride, r.to(tl.int32), mask=m)


def decode_floors(name: str, dev: torch.device) -> None:
    lens = _dist(name, False, torch.Generator().manual_seed(len(name)))
    for width in (WIDTH, 16):
        case = make_scatter_case(lens, width=width, seed=1, device=dev)
        pool = case.fresh_pool()
        kw = case.kwargs(pool)
        bs = case.bs
        for block in (128, 256, 1024):
            g = (triton.cdiv(bs, block),)
            f1 = partial(_decode_min[g], kw["flat_in"], kw["offsets"], kw["req_pool_indices"],
                         pool, bs, pool.stride(0), BLOCK=block)  # fmt: skip
            f2 = partial(_write_only[g], kw["req_pool_indices"], pool, bs, pool.stride(0),
                         BLOCK=block)  # fmt: skip
            print(f"  floor {name} width={width} block={block}: decode_min "
                  f"{graph_time_us(f1, dev):.1f} write_only {graph_time_us(f2, dev):.1f} us",
                  flush=True)  # fmt: skip
        for v in VARIANTS[:2]:
            p = capped_params(case.bs, case.total, *v)
            us = graph_time_us(partial(run_capped, p, **kw), dev)
            print(f"  floor {name} width={width} capped {v}: {us:.1f} us", flush=True)
        del pool


def ncu_target() -> None:
    """One ``_write_only`` launch per pool width on the 262 144 decodes, for ``ncu``."""
    dev = torch.device("cuda")
    lens = _dist("ones_262144", False, torch.Generator().manual_seed(11))
    for width in (WIDTH, 16):
        case = make_scatter_case(lens, width=width, seed=1, device=dev)
        pool = case.fresh_pool()
        rpi = case.req_pool_indices
        _write_only[(triton.cdiv(case.bs, 128),)](rpi, pool, case.bs, pool.stride(0), BLOCK=128)
        torch.cuda.synchronize()
        del pool


def time_variants(names, dev, meta, deadline, build, timing_only) -> None:
    """Per named distribution, every implementation ``build(case)`` gives (label -> callable
    on the scatter keywords), checked byte for byte (unless ``timing_only(label)``), then
    graph-replay timed against floor + L0."""
    for name in names:
        if time.monotonic() > deadline:
            print(f"-- budget spent before {name}", flush=True)
            break
        lens = _dist(name, False, torch.Generator().manual_seed(len(name)))
        width = max(WIDTH, -(-int(lens.max()) // 1024) * 1024)
        case = make_scatter_case(lens, width=width, seed=1, device=dev)
        pool, want = case.fresh_pool(), case.fresh_pool()
        scatter_req_token_ids_ref(**case.kwargs(want))
        floor = floor_us(scatter_sector_bytes(case, pool), meta.copy_gbs)
        bound = floor + meta.empty_launch_us
        print(f"== {name} bs={case.bs} tokens={case.total} width={width} floor+L0={bound:.1f}",
              flush=True)  # fmt: skip
        for label, impl in build(case).items():
            try:
                if not timing_only(label):  # wrong where a run passes the cap
                    _check_pool(case, pool, want, impl)
                us = graph_time_us(partial(impl, **case.kwargs(pool)), dev)
                print(f"  {us:7.1f} us {us / bound:5.2f}x  {label}", flush=True)
            except Exception as e:  # noqa: BLE001 - an exploration records and goes on
                print(f"  FAILED {label}: {type(e).__name__}: {str(e)[:300]}", flush=True)
        del pool, want


def named_explore(variant, run_variant):
    """The ``explore`` of a kernel copy with named variants: per batch the per-request grid,
    the library's ``auto``, then each name's launch keywords ``variant(bs, tokens, width,
    name)`` run by ``run_variant(keywords, **scatter keywords)`` (a name that changes nothing
    on the batch is skipped). Each is checked byte for byte before it is timed, except the
    timing-only variants (keywords with ``only`` set: one kind of program returns at once)."""

    def explore(names, dev, meta, deadline, variants) -> None:
        timing_only: set[str] = set()

        def build(case) -> dict:
            impls = {"grid": scatter_per_request_grid, "lib auto": scatter_req_token_ids}
            seen = set()
            for v in variants:
                p = variant(case.bs, case.total, case.width, v)
                key = tuple(sorted(p.items()))
                if key not in seen:
                    seen.add(key)
                    label = f"{v} {p}"
                    impls[label] = partial(run_variant, p)
                    if p.get("only", 0):
                        timing_only.add(label)
            return impls

        time_variants(names, dev, meta, deadline, build, timing_only.__contains__)

    return explore


def drive(explore_fn, variants: list[str]) -> None:
    """The command line of an exploration with named variants: ``--dists``, ``--variants``
    (default ``variants``), ``--budget-s`` and ``--width`` (the pool width; default the
    benchmark's), then ``explore_fn(dists, device, meta, deadline, variants)`` on CUDA."""
    global WIDTH
    ap = argparse.ArgumentParser()
    ap.add_argument("--dists", nargs="+", default=ORDER)
    ap.add_argument("--variants", nargs="+", default=variants)
    ap.add_argument("--budget-s", type=float, default=400)
    ap.add_argument("--width", type=int, help="pool width (default: the benchmark's)")
    args = ap.parse_args()
    WIDTH = args.width or WIDTH
    dev = torch.device("cuda")
    start = time.monotonic()
    meta = Meta.collect(dev)
    print(f"# {meta}", flush=True)
    explore_fn(args.dists, dev, meta, start + args.budget_s, args.variants)
    print(f"# done in {time.monotonic() - start:.0f}s", flush=True)


def explore(names, dev, meta, deadline, variants=VARIANTS) -> None:
    def build(case) -> dict:
        impls = {"grid": scatter_per_request_grid}
        for s in ("flat", "segments", "auto"):
            impls[s] = partial(scatter_req_token_ids, strategy=s)
        for v in variants:
            p = capped_params(case.bs, case.total, *v)
            impls[f"capped {v} {p}"] = partial(run_capped, p)
        return impls

    time_variants(names, dev, meta, deadline, build, lambda label: "heads_only': True" in label)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--dists", nargs="+", default=ORDER)
    p.add_argument("--budget-s", type=float, default=400)
    p.add_argument("--floors", action="store_true", help="time the decode floors first")
    p.add_argument("--ncu-target", action="store_true", help="only the launches ncu profiles")
    p.add_argument("--reqs-sweep", action="store_true", help="REQS_SWEEP in place of VARIANTS")
    args = p.parse_args()
    if args.ncu_target:
        ncu_target()
        return
    dev = torch.device("cuda")
    start = time.monotonic()
    meta = Meta.collect(dev)
    print(f"# {meta}", flush=True)
    if args.floors:
        for name in ("ones_262144", "ones_32768"):
            decode_floors(name, dev)
    variants = REQS_SWEEP if args.reqs_sweep else VARIANTS
    explore(args.dists, dev, meta, start + args.budget_s, variants)
    print(f"# done in {time.monotonic() - start:.0f}s", flush=True)


if __name__ == "__main__":
    main()
