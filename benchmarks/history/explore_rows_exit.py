"""Step 29 of benchmarks/NOTES.md: ``rows`` programs that stop past their run's end.

ncu on ``auto``'s ``rows`` launch for one 16 384-token run among 127 of 130 tokens (2 048
programs, 1 905 of them past their run's end) counted ~178 instructions a warp: every program
built its whole masked tile. The library kernel now stops such a program after its offsets and
row. This runs it beside the step-28 body (no early stop, kept here), ``capped``, ``auto`` and
the per-request grid, each checked byte for byte against the reference on a poisoned pool,
then graph replays timed alternately (medians of ``--rounds``), on the benchmark's batches and
on batches of 128-512 requests (decodes, U(0,1024), runs of 4 096), at the benchmark's pool
width and at an engine's (131 072 columns), where all but the decodes' grids pass ``auto``'s
4 096-program bound:

    python -m benchmarks.history.explore_rows_exit [--rounds N] [--widths 0 131072]

Since step 30 the library's ``rows`` ("rows stop") runs over its bounded grid, its programs
copying long runs in steps; the no-stop body still runs over one program a tile.
"""

from __future__ import annotations

import argparse
import math
from functools import partial

import torch
import triton
import triton.language as tl

from benchmarks.distributions import WIDTH, distribution_case
from benchmarks.history.explore_rows import report, timing_basis
from kvcanary_dispatch import scatter_req_token_ids
from kvcanary_dispatch.cli.per_request_grid import scatter_per_request_grid
from kvcanary_dispatch.scatter import resolve_scatter_strategy
from kvcanary_dispatch.testing.cases import make_scatter_case
from kvcanary_kernels.args import ScatterArgs
from kvcanary_kernels.scatter_rows import ROWS_COLS, rows_tiles

NAMED = ("segments_worst_128", "tiny_8", "tiny_16_u1024", "prefills_64")
# (name, bs, lengths drawn from U(lo, hi)); all but the decodes pass 4 096 programs at 131 072
SYNTHETIC = (
    ("decodes_128", 128, 1, 1),
    ("u1024_128", 128, 0, 1024),
    ("runs4096_128", 128, 4096, 4096),
    ("decodes_512", 512, 1, 1),
    ("u1024_512", 512, 0, 1024),
)


@triton.jit(do_not_specialize=["num_tokens", "bs", "pool_stride0", "max_context_len"])
def _rows_no_stop(flat_in_ptr, offsets_ptr, req_pool_indices_ptr, pool_out_ptr, num_tokens, bs,
                  pool_stride0, max_context_len, COLS: tl.constexpr):  # fmt: skip
    """The step-28 body: every program builds its masked tile, past its run's end or not."""
    r = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1).to(tl.int64) * COLS + tl.arange(0, COLS)  # [C] int64
    start = tl.load(offsets_ptr + r)
    n = tl.minimum(tl.load(offsets_ptr + r + 1) - start, max_context_len)
    row = tl.load(req_pool_indices_ptr + r)
    src = start + cols
    mask = cols < n
    val = tl.load(flat_in_ptr + src, mask=mask & (src >= 0) & (src < num_tokens), other=0)
    tl.store(pool_out_ptr + row * pool_stride0 + cols, val.to(tl.int32), mask=mask)


def _grid(bs: int, num_tokens: int, width: int) -> tuple[int, int]:
    """One program a column tile (the library's grid until step 30 bounded it)."""
    return (bs, rows_tiles(num_tokens, width))


def rows_no_stop(**kw) -> None:
    t = ScatterArgs(**kw)
    _rows_no_stop[_grid(t.bs, t.num_tokens, t.pool_out.shape[1])](
        *t.kernel_args(), COLS=ROWS_COLS, num_warps=4
    )


def cases(widths, dev):
    for wide in widths:
        for name in NAMED:
            yield name, distribution_case(name, dev, width_floor=max(wide, WIDTH))
        for name, bs, lo, hi in SYNTHETIC:
            g = torch.Generator().manual_seed(bs + hi)
            lens = torch.randint(lo, hi + 1, (bs,), generator=g)
            yield name, make_scatter_case(lens, width=max(wide, WIDTH), seed=1, device=dev)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--widths", nargs="*", type=int, default=[0, 131072])
    args = ap.parse_args()
    dev = torch.device("cuda")
    l0, gbs = timing_basis(dev)
    calls = {
        "auto": scatter_req_token_ids,
        "grid": scatter_per_request_grid,
        "capped": partial(scatter_req_token_ids, strategy="capped"),
        "rows stop": partial(scatter_req_token_ids, strategy="rows"),  # the library kernel
        "rows no stop": rows_no_stop,
    }
    for name, work in cases(args.widths, dev):
        programs = math.prod(_grid(work.bs, work.total, work.width))
        auto = resolve_scatter_strategy("auto", work.bs, work.total, None, work.width)
        title = (f"{name}: bs {work.bs}, tokens {work.total}, width {work.width}, rows grid "
                 f"{programs} programs, auto = {auto}")  # fmt: skip
        report(title, work, calls, dev, args.rounds, l0, gbs)


if __name__ == "__main__":
    main()
