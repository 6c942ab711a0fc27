"""Step 30 of benchmarks/NOTES.md: ``rows`` with a bounded grid whose programs loop over tiles.

``explore_rows_bound`` found ``rows`` (then one program a tile) paying about 0.5 ns a program
once its grid passes ~1 000 programs, idle or not: 128 x U(0,1024) on a 32 768-wide pool
replays in 7.4 µs against ``capped``'s 6.1, and on a 131 072-wide pool (8 320 programs) 10.0
against 6.1; yet ``rows`` wins wherever runs are long (one 16 384-token run among 127 short
ones on a 131 072 pool: 7.6 against 10.0). Here each request gets
``C = min(tiles, max(1, P // bs))`` programs and program ``(r, c)`` copies tiles
``c, c + C, ...`` of its run (the library's ``rows`` kernel over these grids), so the grid
never passes ``max(P, bs)`` programs and a long run is copied in ``cdiv(tiles, C)`` steps.
Variants: the program budget ``P``, the tile width and warps; beside them the library's
``rows`` (over ``launch_plan.rows_grid``) and ``capped``, each checked byte for byte against
the reference on a poisoned pool, then graph replays timed alternately (medians of
``--rounds``). Columns: ``tile_programs``, one program a tile; ``rule_programs``, the
library's grid; ``auto``, what ``auto`` picks.

    python -m benchmarks.history.explore_rows_loop [--rounds N] [--bs ...] [--widths ...]
    python -m benchmarks.history.explore_rows_loop --bs 256 512 1024 --no-variants

The committed logs ran before the library took this kernel: their ``rows`` was one program a
tile and they have no ``rule_programs``; the first log's variants had no peeled first tile and
were P = 1 024, 2 048, 4 096 at 1 024 columns and 2 048 at 2 048 columns on 8 warps, bs 8-256.
"""

from __future__ import annotations

import argparse
import math
import statistics
from functools import partial

import torch
import triton

from benchmarks.history.explore_rows import checked_replays
from benchmarks.history.explore_rows_bound import patterns as bound_patterns
from kvcanary_dispatch import scatter_req_token_ids
from kvcanary_dispatch.launch_plan import resolve_scatter_strategy, rows_grid
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
    ap.add_argument("--bs", nargs="*", type=int, default=list(BS))
    ap.add_argument("--widths", nargs="*", type=int, default=list(WIDTHS))
    ap.add_argument("--no-variants", action="store_true", help="time rows and capped only")
    args = ap.parse_args()
    dev = torch.device("cuda")
    variants = () if args.no_variants else VARIANTS
    labels = ["rows", "capped", *(f"loop{p}_{c}_w{w}" for p, c, w in variants)]
    calls = [partial(scatter_req_token_ids, strategy=s) for s in ("rows", "capped")]
    calls += [partial(rows_loop, *v) for v in variants]
    print(f"torch {torch.__version__}, Triton {triton.__version__}")
    print("bs,pattern,width,tokens,tile_programs,rule_programs,auto," + ",".join(labels))
    for bs in args.bs:
        for width in args.widths:
            g = torch.Generator().manual_seed(bs)
            for name, lens in patterns(bs, width, g).items():
                if int(lens.max()) > width or int(lens.sum()) > 1 << 22:
                    continue
                work = make_scatter_case(lens, width=width, seed=1, device=dev)
                _, times = checked_replays(work, calls, dev, args.rounds)
                meds = [statistics.median(t) for t in times]
                tile_programs = bs * rows_tiles(work.total, width)
                rule_programs = math.prod(rows_grid(bs, work.total, width))
                auto = resolve_scatter_strategy("auto", bs, work.total, None, width)
                print(f"{bs},{name},{width},{work.total},{tile_programs},{rule_programs},{auto},"
                      + ",".join(f"{m:.2f}" for m in meds), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
