"""Step 28 of benchmarks/NOTES.md: the ``rows`` grid with wider column tiles.

``auto`` sends batches of at most 128 requests to ``rows`` (one program per request and
1 024-column tile). On one 16 384-token run among 127 of 130 tokens (a 16 384-wide pool) that
is 2 048 programs, most of which exit at once, and it replays in about the per-request grid's
7.1 µs against a 6.3 µs bar; step 25 measured a grid of ~4 600 programs doing nothing at 3.1
µs over an empty launch. Fewer, wider programs keep the chain (offsets and row, then tokens,
then the store) and shrink the grid. Each variant is the library kernel at other ``COLS`` and
``num_warps``, checked byte for byte against the reference on a poisoned pool, then
graph-replay timed beside the library's ``auto`` and the per-request grid, alternating
(``graph_times_interleaved_us``), in one run. ``--widths``: the same batches on wider pools
too (their rows further apart), with the library's ``rows`` only:

    python -m benchmarks.history.explore_rows [--rounds N] [--dists ...] [--widths 0 W ...]
"""

from __future__ import annotations

import argparse
import statistics
from functools import partial

import torch
import triton

from benchmarks.distributions import WIDTH, _check_pool, distribution_case
from kvcanary_dispatch import scatter_req_token_ids
from kvcanary_dispatch.cli.per_request_grid import scatter_per_request_grid
from kvcanary_dispatch.cli.timing import (
    copy_bandwidth_gbs,
    empty_launch_us,
    floor_us,
    graph_times_interleaved_us,
    scatter_sector_bytes,
)
from kvcanary_kernels import scatter_req_token_ids_ref
from kvcanary_kernels.args import ScatterArgs
from kvcanary_kernels.scatter_rows import _scatter_rows_kernel

DISTS = ("segments_worst_128", "tiny_8", "tiny_16_u1024", "prefills_64")
VARIANTS = ((1024, 4), (2048, 4), (2048, 8), (4096, 4), (4096, 8), (8192, 8), (8192, 16))


def rows(cols: int, warps: int, **kw) -> None:
    t = ScatterArgs(**kw)
    grid = (t.bs, triton.cdiv(t.pool_out.shape[1], cols))
    _scatter_rows_kernel[grid](*t.kernel_args(), COLS=cols, num_warps=warps)


def checked_replays(work, calls, dev, rounds: int) -> tuple[torch.Tensor, list[list[float]]]:
    """Each call checked byte for byte against the reference on a poisoned pool, then their
    graph replays on one pool timed alternately: the pool and each call's µs by round."""
    pool, want = work.fresh_pool(), work.fresh_pool()
    scatter_req_token_ids_ref(**work.kwargs(want))
    for impl in calls:
        _check_pool(work, pool, want, impl)
    kw = work.kwargs(pool)
    return pool, graph_times_interleaved_us([partial(f, **kw) for f in calls], dev, rounds)


def timing_basis(dev: torch.device) -> tuple[float, float]:
    """This run's empty-launch replay (µs) and copy bandwidth (GB/s), printed with the
    versions."""
    l0, gbs = empty_launch_us(dev), copy_bandwidth_gbs(dev)
    print(f"torch {torch.__version__}, Triton {triton.__version__}, L0 {l0:.2f} us, copy {gbs:.0f}")
    return l0, gbs


def report(title: str, work, calls: dict, dev, rounds: int, l0: float, gbs: float) -> None:
    """``checked_replays`` of the named ``calls`` on ``work``, printed under ``title`` with the
    batch's floor + L0 and 1.5x that (the bar): each call's median replay (µs), its ratio to
    floor + L0, and its least and greatest."""
    pool, times = checked_replays(work, calls.values(), dev, rounds)
    base = floor_us(scatter_sector_bytes(work, pool), gbs) + l0
    print(f"== {title}, floor + L0 {base:.2f} us, bar {1.5 * base:.2f}")
    for label, t in zip(calls, times, strict=True):
        med = statistics.median(t)
        print(f"   {label:14s} median {med:6.2f} (x{med / base:.2f})  "
              f"[{min(t):.2f}-{max(t):.2f}]")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--dists", nargs="*", default=DISTS)
    ap.add_argument(
        "--widths",
        nargs="*",
        type=int,
        default=[0],
        help="pool widths to run each batch on as well (0: the benchmark's)",
    )
    args = ap.parse_args()
    dev = torch.device("cuda")
    l0, gbs = timing_basis(dev)
    for name, wide in [(n, w) for n in args.dists for w in args.widths]:
        work = distribution_case(name, dev, width_floor=max(wide, WIDTH))
        width, variants = work.width, VARIANTS if wide == 0 else VARIANTS[:1]
        calls = {
            "auto": scatter_req_token_ids,
            "grid": scatter_per_request_grid,
            **{f"rows c{c} w{w}": partial(rows, c, w) for c, w in variants},
        }
        mib = work.pool_rows * width * 4 / 2**20
        title = f"{name}: bs {work.bs}, tokens {work.total}, width {width} (pool {mib:.1f} MiB)"
        report(title, work, calls, dev, args.rounds, l0, gbs)


if __name__ == "__main__":
    main()
