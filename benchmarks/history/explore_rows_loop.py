"""Step 30 of benchmarks/NOTES.md: ``rows`` with a bounded grid whose programs loop over tiles.

(The library's ``rows`` kernel became this experiment's kernel in step 30: the variants launch
it over their own grids, and the ``rows`` column now times the library's bounded grid. The
committed logs ran before that, ``rows`` being one program a tile; the first log's variants
had no peeled first tile.)

``explore_rows_bound`` (step 30) found ``rows`` paying about 0.5 ns a program once its grid
passes ~1 000 programs, idle or not: 128 x U(0,1024) on a 32 768-wide pool replays in 7.4 µs
against ``capped``'s 6.1, and on a 131 072-wide pool (8 320 programs) 10.0 against 6.1; yet
``rows`` wins wherever runs are long (one 16 384-token run among 127 short ones on a 131 072
pool: 7.6 against 10.0). Here each request gets ``C = min(tiles, max(1, P // bs))`` programs
and program ``(r, c)`` copies tiles ``c, c + C, ...`` of its run, so the grid never passes
``max(P, bs)`` programs and a long run is copied in ``cdiv(tiles, C)`` steps. Variants: the
program budget ``P`` and the tile width; beside them the library's ``rows`` (one program per
tile) and ``capped``, each checked byte for byte against the reference on a poisoned pool,
then graph replays timed alternately (medians of ``--rounds``):

    python -m benchmarks.history.explore_rows_loop [--rounds N]
"""

from __future__ import annotations

import argparse
import statistics
from functools import partial

import torch
import triton

from benchmarks.history.explore_rows import checked_replays
from benchmarks.history.explore_rows_bound import patterns as bound_patterns
from kvcanary_dispatch import scatter_req_token_ids
from kvcanary_dispatch.launch_plan import resolve_scatter_strategy
from kvcanary_dispatch.testing.cases import make_scatter_case
from kvcanary_kernels.args import ScatterArgs
from kvcanary_kernels.scatter_rows import _scatter_rows_kernel, rows_tiles

# (program budget P, columns a step, warps); the first: rows' own grid, for the loop's cost
VARIANTS = (
    (1 << 30, 1024, 4),
    (2048, 1024, 4),
    (4096, 1024, 4),
    (2048, 2048, 4),
    (2048, 2048, 8),
    (4096, 2048, 8),
)
BS = (16, 64, 128, 256, 512)
WIDTHS = (8192, 32768, 131072)


def loop_grid(bs: int, num_tokens: int, width: int, budget: int, cols: int) -> tuple[int, int]:
    """``bs`` requests by at most ``budget // bs`` (at least 1) of ``rows_tiles``' tiles."""
    return (bs, min(rows_tiles(num_tokens, width, cols), max(1, budget // bs)))


def rows_loop(budget: int, cols: int, warps: int, **kw) -> None:
    t = ScatterArgs(**kw)
    grid = loop_grid(t.bs, t.num_tokens, t.pool_out.shape[1], budget, cols)
    _scatter_rows_kernel[grid](*t.kernel_args(), COLS=cols, num_warps=warps)


def patterns(bs: int, width: int, g: torch.Generator) -> dict[str, torch.Tensor]:
    """``explore_rows_bound``'s run lengths, and one run as wide as the pool among runs of
    130 ("one_full")."""
    full = torch.full((bs,), 130, dtype=torch.int64)
    full[0] = width
    return {**bound_patterns(bs, g), "one_full": full}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=4)
    args = ap.parse_args()
    dev = torch.device("cuda")
    labels = ["rows", "capped", *(f"loop{p}_{c}" for p, c, _ in VARIANTS)]
    calls = [partial(scatter_req_token_ids, strategy=s) for s in ("rows", "capped")]
    calls += [partial(rows_loop, *v) for v in VARIANTS]
    print(f"torch {torch.__version__}, Triton {triton.__version__}")
    print("bs,pattern,width,tokens,rows_programs,auto," + ",".join(labels))
    for bs in BS:
        for width in WIDTHS:
            g = torch.Generator().manual_seed(bs)
            for name, lens in patterns(bs, width, g).items():
                if int(lens.max()) > width or int(lens.sum()) > 1 << 22:
                    continue
                work = make_scatter_case(lens, width=width, seed=1, device=dev)
                _, times = checked_replays(work, calls, dev, args.rounds)
                meds = [statistics.median(t) for t in times]
                programs = bs * rows_tiles(work.total, width)
                auto = resolve_scatter_strategy("auto", bs, work.total, None, width)
                print(f"{bs},{name},{width},{work.total},{programs},{auto},"
                      + ",".join(f"{m:.2f}" for m in meds), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
