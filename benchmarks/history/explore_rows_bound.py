"""Step 29's open question in benchmarks/NOTES.md: where ``rows`` beats ``capped`` once its idle
programs stop early.

``auto`` takes ``rows`` while its grid has at most 4 096 programs. Step 29 measured ``rows``
winning at 8 192 programs when 1 300 of them are full copies (64 long prefills) and losing at
8 192 when 64 are (128 x U(0,1024)): idle programs seem to hide behind long busy ones. This
sweeps batch size, run lengths and pool width, times ``rows`` and ``capped`` as graph replays
alternately (medians of ``--rounds``, each call checked byte for byte on a poisoned pool
first), and prints what ``auto`` picks today and what each candidate bound
``programs <= 4096 + k * cdiv(tokens, 1024)`` would pick:

    python -m benchmarks.history.explore_rows_bound [--rounds N]

Its log (``explore_30_rows_bound_1.log``) ran at 73adbf1, before step 30 bounded the ``rows``
grid: ``rows`` was one program a tile, and the ``auto`` column is the rule of then. Run
now, ``rows`` times the bounded grid while ``programs`` and the k bounds count one a tile.
"""

from __future__ import annotations

import argparse
import statistics
from functools import partial

import torch
import triton

from benchmarks.history.explore_rows import checked_replays
from kvcanary_dispatch import scatter_req_token_ids
from kvcanary_dispatch.launch_plan import ROWS_MAX_PROGRAMS, resolve_scatter_strategy
from kvcanary_dispatch.testing.cases import make_scatter_case
from kvcanary_kernels.scatter_rows import ROWS_COLS, rows_tiles

BS = (16, 64, 128)
WIDTHS = (8192, 32768, 131072)
KS = (4, 8, 16)


def patterns(bs: int, g: torch.Generator) -> dict[str, torch.Tensor]:
    """Run lengths by name: decodes, U(0,1024), equal long runs, one long run among short
    ones, half the requests empty and half long."""
    one_long = torch.full((bs,), 130, dtype=torch.int64)
    one_long[0] = 16384
    half = torch.zeros(bs, dtype=torch.int64)
    half[: bs // 2] = 8192
    return {
        "ones": torch.ones(bs, dtype=torch.int64),
        "u1024": torch.randint(0, 1025, (bs,), generator=g),
        "runs4096": torch.full((bs,), 4096, dtype=torch.int64),
        "runs16384": torch.full((bs,), 16384, dtype=torch.int64),
        "one_long": one_long,
        "half_8192": half,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=4)
    args = ap.parse_args()
    dev = torch.device("cuda")
    print(f"torch {torch.__version__}, Triton {triton.__version__}")
    print("bs,pattern,width,tokens,programs,token_tiles,rows_us,capped_us,rows/capped,"
          + ",".join(["auto", *(f"k{k}" for k in KS)]))  # fmt: skip
    calls = [partial(scatter_req_token_ids, strategy=s) for s in ("rows", "capped")]
    for bs in BS:
        for name, lens in patterns(bs, torch.Generator().manual_seed(bs)).items():
            for width in WIDTHS:
                if int(lens.max()) > width:
                    continue
                work = make_scatter_case(lens, width=width, seed=1, device=dev)
                _, times = checked_replays(work, calls, dev, args.rounds)
                rows_us, capped_us = (statistics.median(t) for t in times)
                programs = bs * rows_tiles(work.total, width)  # one program a tile
                tiles = triton.cdiv(work.total, ROWS_COLS)
                auto = resolve_scatter_strategy("auto", bs, work.total, None, width)
                picks = [auto] + ["rows" if programs <= ROWS_MAX_PROGRAMS + k * tiles
                                  else "capped" for k in KS]  # fmt: skip
                print(f"{bs},{name},{width},{work.total},{programs},{tiles},{rows_us:.2f},"
                      f"{capped_us:.2f},{rows_us / capped_us:.2f}," + ",".join(picks))  # fmt: skip


if __name__ == "__main__":
    main()
