"""Scatter for small batches in one launch: one program per (request, column tile).

Program ``(r, c)`` copies columns ``[c*COLS, (c+1)*COLS)`` of request ``r``'s run: two offsets
and one pool index read in parallel, then one contiguous load and store. The grid is
``rows_grid``: ``(bs, cdiv(min(max_context_len, num_tokens), COLS))`` whatever the lengths (no
request of a CSR over ``flat_in`` writes more columns), so a long run is split over many
programs and a program past its run's end stops after reading its offsets and row; suited to
batches whose grid is small (every program costs those reads, idle or not). Reads stay inside
``flat_in`` and writes inside the addressed rows' first ``max_context_len`` columns whatever the
offsets. No host sync.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._launch import binder
from .args import ScatterArgs

ROWS_COLS = 1024  # columns a program copies


@triton.jit(do_not_specialize=["num_tokens", "bs", "pool_stride0", "max_context_len"])
def _scatter_rows_kernel(
    flat_in_ptr,  # [num_tokens] int64
    offsets_ptr,  # [bs + 1] int64
    req_pool_indices_ptr,  # [bs] int64
    pool_out_ptr,  # [rows, max_context_len] int32
    num_tokens,
    bs,
    pool_stride0,
    max_context_len,
    COLS: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64)
    col0 = tl.program_id(1).to(tl.int64) * COLS
    start = tl.load(offsets_ptr + r)
    n = tl.minimum(tl.load(offsets_ptr + r + 1) - start, max_context_len)
    row = tl.load(req_pool_indices_ptr + r)
    # A program past its run's end stops here: its tile's masks, loads and stores would all
    # be off, and in a grid sized by the tokens most programs are such.
    if col0 < n:
        cols = col0 + tl.arange(0, COLS)  # [C] int64
        src = start + cols  # [C] int64
        mask = cols < n
        # Reads stay inside flat_in whatever the offsets (validate=False with broken offsets).
        val = tl.load(flat_in_ptr + src, mask=mask & (src >= 0) & (src < num_tokens), other=0)
        tl.store(pool_out_ptr + row * pool_stride0 + cols, val.to(tl.int32), mask=mask)


def rows_grid(bs: int, num_tokens: int, width: int, cols: int = ROWS_COLS) -> tuple[int, int]:
    """The grid that covers every run of a valid CSR: ``bs`` requests by the column tiles of
    the longest run possible, ``min(width, num_tokens)`` columns (at least one tile)."""
    return (bs, max(1, triton.cdiv(min(width, num_tokens), cols)))


def launch_scatter_rows(t: ScatterArgs, *, grid: tuple[int, int], cols: int = ROWS_COLS) -> None:
    """One launch over ``grid`` programs: ``rows_grid(bs, num_tokens, max_context_len, cols)``,
    or more column tiles (``cols`` a power of two). Needs ``bs >= 1``; arguments are checked by
    the caller."""
    _bound(cols)(grid, t.kernel_args())


_bound = binder(_scatter_rows_kernel, "COLS")
