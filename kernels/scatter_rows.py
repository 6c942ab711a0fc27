"""Scatter for small batches in one launch: programs by (request, column tile).

The grid is ``(bs, C)``. Program ``(r, c)`` copies column tiles ``c, c + C, c + 2C, ...`` of
request ``r``'s run, ``COLS`` columns each: two offsets and one pool index read in parallel,
then per tile one contiguous load and store. With ``C`` at least ``rows_tiles`` (the tiles of
the longest run a CSR over ``flat_in`` can hold) a program copies at most one tile; fewer
programs a request bound the grid and copy a long run in several steps. A program whose first
tile starts past its run's end stops after reading its offsets and row. Whatever the offsets,
only tokens inside ``flat_in`` are read, each written only to its addressed row's first
``max_context_len`` columns (a run past ``len(flat_in)`` is copied up to it, as by the
fixed-block kernel). No host sync.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._launch import BoundKernel, binder
from .args import ScatterArgs

ROWS_COLS = 1024  # columns a program copies a step


@triton.jit
def _copy_tile(flat_in_ptr, out_ptr, start, col0, n, num_tokens, COLS: tl.constexpr):
    """Columns ``[col0, col0 + COLS)`` of a run of ``n`` tokens, ``flat_in[start:]``, to
    ``out_ptr[0:n]`` (``col0`` a multiple of ``COLS``)."""
    cols = tl.multiple_of(col0, COLS) + tl.arange(0, COLS)  # [C] int64
    src = start + cols  # [C] int64
    # Only tokens inside flat_in are read and written, whatever the offsets (validate=False):
    # a run past len(flat_in) is copied up to it, as by the fixed-block kernel.
    mask = (cols < n) & (src >= 0) & (src < num_tokens)  # [C]
    val = tl.load(flat_in_ptr + src, mask=mask)  # [C] int64
    tl.store(out_ptr + cols, val.to(tl.int32), mask=mask)  # [C] int32


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
    end = tl.load(offsets_ptr + r + 1)
    # n = min(end - start, width) without its wrap (validate=False with broken offsets): an end
    # before the start is an empty run, and one past it by 2**63 or more wraps the difference
    # negative, a run wider than any pool.
    d = end - start
    n = tl.where(end < start, 0, tl.where(d < 0, max_context_len, tl.minimum(d, max_context_len)))
    row = tl.load(req_pool_indices_ptr + r)
    # A program past its run's end stops here: in a grid sized by the tokens most programs are
    # such. The first tile is copied outside the loop: there the row's load is in flight
    # beside the tokens' (before a loop the compiled code waits for it: one more round trip).
    if col0 < n:
        out = pool_out_ptr + row * pool_stride0
        _copy_tile(flat_in_ptr, out, start, col0, n, num_tokens, COLS)
        step = tl.num_programs(1).to(tl.int64) * COLS
        col = col0 + step
        while col < n:  # (a while: Triton 3.6's interpreter cannot range over loaded bounds)
            _copy_tile(flat_in_ptr, out, start, col, n, num_tokens, COLS)
            col += step


def rows_tiles(num_tokens: int, width: int, cols: int = ROWS_COLS) -> int:
    """The column tiles of the longest run a valid CSR can hold: ``min(width, num_tokens)``
    columns (at least one tile)."""
    return max(1, triton.cdiv(min(width, num_tokens), cols))


def bind_scatter_rows(*, cols: int = ROWS_COLS) -> BoundKernel:
    """The kernel bound to ``cols`` (a power of two): called with a grid and
    ``ScatterArgs.kernel_args()``, it is ``launch_scatter_rows``' launch."""
    return _bound(cols)


def launch_scatter_rows(t: ScatterArgs, *, grid: tuple[int, int], cols: int = ROWS_COLS) -> None:
    """One launch over ``grid = (bs, C)`` programs, any ``C >= 1`` (``cols`` a power of two).
    Needs ``bs >= 1``; arguments are checked by the caller."""
    bind_scatter_rows(cols=cols)(grid, t.kernel_args())


_bound = binder(_scatter_rows_kernel, "COLS")
