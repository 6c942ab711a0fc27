"""Step 41 of benchmarks/NOTES.md: a wider idle window for the short class's tail tiles.

A ``capped`` tail tile ``[a, a + TAIL)`` is idle (no column past the cap) when its guessed
offsets show a run boundary in ``(a + TAIL - 1 - CAP, a]``. The short class takes
``TAIL = CAP``, so that window is one token wide: decodes hit it (every token starts a run),
drafts of 4-8 tokens rarely do, so their tail tiles search a round and read their owner's
offsets before finding nothing to copy (step 23: the drafts' tails end at 2.2-2.3 µs, the
heads at 1.2-1.3). Here the cap grows (``cap<k>``: ``k`` times the head steps) while the tail
tiles keep their size, so the window is ``(k - 1) * TAIL + 1`` tokens wide and the guessed
offsets (``GUESS_STRIDE`` requests apart) land in it; the heads' work grows only for runs
past the old cap. These variants change only launch keywords: they run the library kernel.
``fits`` runs ``explore_timeline``'s copy of the kernel (unstamped) with its ``FITS`` idle test
at the library's shape: a tile whose two guessed offsets around its first token are at most
the cap apart is idle, the cap unchanged; ``copy`` is that copy without the test.

Each variant is checked byte for byte against the reference, then the graphs of the library's
``auto`` and of every variant are replayed alternately, ``--rounds`` rounds (median per
variant, and its median per-round ratio to ``auto``).

``python -m benchmarks.history.explore_window [--rounds R]``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from functools import partial

import torch

from benchmarks.distributions import WIDTH, _check_pool, distribution_case
from benchmarks.history.explore_timeline import launch_stamped
from kvcanary_dispatch import scatter_req_token_ids
from kvcanary_dispatch.cli.results import Meta
from kvcanary_dispatch.cli.timing import (
    floor_us,
    graph_times_interleaved_us,
    scatter_sector_bytes,
)
from kvcanary_dispatch.launch_plan import capped_shape
from kvcanary_dispatch.testing.cases import make_scatter_case
from kvcanary_kernels import scatter_req_token_ids_ref
from kvcanary_kernels.args import ScatterArgs
from kvcanary_kernels.scatter_capped import capped_grid, launch_scatter_capped

VARIANTS = ["shape", "cap2", "cap4", "cap2+gs8", "cap2+k8"]
COPIES = {"copy": 0, "fits": 1}  # explore_timeline's kernel: name -> FITS


def _lengths(name: str) -> torch.Tensor:
    """Drafts of other lengths and sizes than the benchmark's:
    ``drafts_<lo>_<hi>_<bs>`` (uniform), ``draftslong_<bs>`` (drafts of 4-8 tokens with four
    4 096-token runs among them)."""
    g = torch.Generator().manual_seed(len(name))
    if name.startswith("drafts_"):
        lo, hi, bs = (int(x) for x in name.split("_")[1:])
        return torch.randint(lo, hi + 1, (bs,), generator=g, dtype=torch.int64)
    if name.startswith("draftslong_"):
        lens = torch.randint(4, 9, (int(name.split("_")[1]),), generator=g, dtype=torch.int64)
        lens[torch.randperm(lens.numel(), generator=g)[:4]] = 4096
        return lens
    raise ValueError(name)


def variant(bs: int, tokens: int, width: int, name: str) -> dict:
    """The launch keywords of one named variant: ``shape`` (the library's own), ``cap<k>``
    (``k`` times the head steps, tail tiles kept), ``gs<n>`` (guessed offsets ``n`` requests
    apart), ``k<n>`` (``n`` tiles a tail program)."""
    p = dict(capped_shape(bs, tokens, width))
    for part in name.split("+"):
        if part == "shape":
            continue
        if part.startswith("cap"):
            p["steps"] *= int(part[3:])
        elif part.startswith("gs"):
            p["guess_stride"] = int(part[2:])
        elif part.startswith("k"):
            p["tiles"] = int(part[1:])
        else:
            raise ValueError(part)
    return p


def run_copy(p: dict, fits: int, **kw) -> None:
    """``explore_timeline``'s kernel, unstamped (its stamp buffer is never touched)."""
    t = ScatterArgs(**kw)
    unused = t.offsets[:1]
    launch_stamped(p, unused, t.flat_in, t.offsets, t.req_pool_indices, t.pool_out, stamp=0,
                   fits=fits)  # fmt: skip


def run_variant(p: dict, **kw) -> None:
    t = ScatterArgs(**kw)
    bs, n, width = t.req_pool_indices.numel(), t.flat_in.numel(), t.pool_out.shape[1]
    launch_scatter_capped(t, grid=capped_grid(bs, n, width, p), **p)


DISTS = [
    "spec_16384", "decode_prefill_8192", "ones_32768", "ones_262144", "drafts_2_4_16384",
    "drafts_8_16_16384", "drafts_4_8_65536", "drafts_4_8_2048", "draftslong_16384",
    "drafts_2_4_65536", "drafts_8_16_65536", "draftslong_65536",
]  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dists", nargs="+", default=DISTS)
    ap.add_argument("--variants", nargs="+", default=VARIANTS)
    ap.add_argument("--rounds", type=int, default=8)
    args = ap.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    start = time.monotonic()
    meta = Meta.collect(dev)
    print(f"# {meta}", flush=True)
    for name in args.dists:
        if name.startswith("drafts"):
            lens = _lengths(name)
            width = max(WIDTH, -(-int(lens.max()) // 1024) * 1024)
            case = make_scatter_case(lens, width=width, seed=1, device=dev)
        else:
            case = distribution_case(name, dev)
            width = case.width
        pool, want = case.fresh_pool(), case.fresh_pool()
        scatter_req_token_ids_ref(**case.kwargs(want))
        floor = floor_us(scatter_sector_bytes(case, pool), meta.copy_gbs)
        bound = (floor or 0.0) + (meta.empty_launch_us or 0.0)
        print(f"== {name} bs={case.bs} tokens={case.total} width={width} floor+L0={bound:.2f}")
        impls = {"lib auto": scatter_req_token_ids}
        for v in args.variants:
            if v in COPIES:
                p = dict(capped_shape(case.bs, case.total, width))
                impls[v] = partial(run_copy, p, COPIES[v])
                continue
            p = variant(case.bs, case.total, width, v)
            if any(p == q for q in impls.values() if isinstance(q, dict)):
                continue
            impls[v] = p
        labels, fns = [], []
        for label, impl in impls.items():
            fn = impl if callable(impl) else partial(run_variant, impl)
            _check_pool(case, pool, want, fn)  # byte for byte, on a poisoned pool
            labels.append(label if callable(impl) else f"{label} {impl}")
            fns.append(partial(fn, **case.kwargs(pool)))
        times = graph_times_interleaved_us(fns, dev, rounds=args.rounds)
        if times is None:  # off CUDA: the checks only
            print("  checked: " + ", ".join(labels), flush=True)
            continue
        base = times[0]
        for label, t in zip(labels, times, strict=True):
            ratio = statistics.median(x / b for x, b in zip(t, base, strict=True))
            med = statistics.median(t)
            print(f"  {med:6.2f} us {med / bound:5.2f}x  vs auto {ratio:5.3f} "
                  f"[{min(t):.2f}-{max(t):.2f}]  {label}", flush=True)  # fmt: skip
        del pool, want
    print(f"# done in {time.monotonic() - start:.0f}s", flush=True)


if __name__ == "__main__":
    main()
