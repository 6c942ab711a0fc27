"""Scatter for any batch size in one launch over groups of requests, each copied run by run.

Program ``p`` owns requests ``[p*REQS, (p+1)*REQS)`` (a ``[REQS, COLS]`` tile) and copies each
one's run of tokens to its row, ``COLS`` columns a step, until its longest run is done: no
owner search, one offsets read per request. Suited to long segments; a program's time grows
with the longest run it owns. Reads and writes stay inside ``flat_in`` and the addressed rows'
first ``max_context_len`` columns whatever the offsets. No host sync.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._launch import BoundKernel, binder
from .args import ScatterArgs


@triton.jit
def _run_columns(start, end, num_tokens, bound):
    """Columns ``[lo, hi)`` of each row that its run writes (``start``, ``end``: ``[R]`` int64
    offsets), cut to ``flat_in`` and to ``bound`` columns: ``[R]`` int64 each, in
    ``[0, bound]``, whatever the offsets. ``start`` is clamped before it is negated (``-start``
    wraps at the least int64) and ``end`` into ``[0, num_tokens]`` before ``start`` is taken
    from it (``end - start`` wraps past 2**63 - 1: now only below 0, where nothing is
    written)."""
    lo = tl.maximum(-tl.maximum(start, -bound), 0)
    end = tl.maximum(tl.minimum(end, num_tokens), 0)
    return lo, tl.maximum(tl.minimum(end - start, bound), 0)


@triton.jit(do_not_specialize=["num_tokens", "bs", "pool_stride0", "max_context_len"])
def _scatter_segments_kernel(
    flat_in_ptr,  # [num_tokens] int64
    offsets_ptr,  # [bs + 1] int64
    req_pool_indices_ptr,  # [bs] int64
    pool_out_ptr,  # [rows, max_context_len] int32
    num_tokens,
    bs,
    pool_stride0,
    max_context_len,
    REQS: tl.constexpr,
    COLS: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64) * REQS + tl.arange(0, REQS)  # [R] int64
    in_batch = r < bs
    start = tl.load(offsets_ptr + r, mask=in_batch, other=0)  # [R] int64
    end = tl.load(offsets_ptr + r + 1, mask=in_batch, other=0)
    # Columns [lo, hi) of each row are written: the run, cut to the pool width and to flat_in.
    # Both lie in [0, max_context_len], so they take its width: int32 unless the pool is 2**31
    # columns wide or more (Triton passes an integer that fits as int32), when they are int64.
    cols_ty = max_context_len.dtype
    lo, hi = _run_columns(start, end, num_tokens, max_context_len)
    lo, hi = lo.to(cols_ty), hi.to(cols_ty)  # [R] each
    row = tl.load(req_pool_indices_ptr + r, mask=in_batch & (hi > lo), other=0)  # [R] int64
    src = flat_in_ptr + start  # [R] pointers to column 0 of each run
    dst = pool_out_ptr + row * pool_stride0  # [R] pointers to column 0 of each row
    col = tl.arange(0, COLS)  # [C] int32
    stop = tl.max(hi, axis=0)
    c0 = tl.zeros([], tl.int64)  # int64: the last c0 += COLS may reach 2**31
    while c0 < stop:  # (a while: Triton 3.6's interpreter cannot range over tensors)
        # [C] in cols_ty: c0, a multiple of COLS below stop, is at most 2**31 - COLS in int32
        c = tl.multiple_of(c0.to(cols_ty), COLS) + col
        m = (c[None, :] >= lo[:, None]) & (c[None, :] < hi[:, None])  # [R, C]
        v = tl.load(src[:, None] + c[None, :], mask=m, other=0)  # [R, C] int64
        tl.store(dst[:, None] + c[None, :], v.to(tl.int32), mask=m)
        c0 += COLS


def bind_scatter_segments(*, reqs: int, cols: int, num_warps: int = 4) -> BoundKernel:
    """The kernel bound to these block keywords (powers of two): called with a grid and
    ``ScatterArgs.kernel_args()``, it is ``launch_scatter_segments``' launch."""
    return _bound(reqs, cols, num_warps)


def launch_scatter_segments(
    t: ScatterArgs, *, grid: tuple[int], reqs: int, cols: int, num_warps: int = 4
) -> None:
    """One launch over ``grid = (cdiv(bs, reqs),)`` programs (``reqs``, ``cols``: powers of
    two). Needs ``bs >= 1``; arguments are checked by the caller."""
    bind_scatter_segments(reqs=reqs, cols=cols, num_warps=num_warps)(grid, t.kernel_args())


_bound = binder(_scatter_segments_kernel, "REQS", "COLS", "num_warps")
