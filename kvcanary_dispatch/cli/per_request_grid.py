"""Baseline for the benchmarks: the per-request x column-tile scatter (upstream's later,
uncapped design), written here from the contract to be measured against, not shipped.

Grid ``(bs, cdiv(max_context_len, COL_BLOCK))``: program ``(r, c)`` copies columns
``[c*COL_BLOCK, (c+1)*COL_BLOCK)`` of request ``r``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_COL_BLOCK = 1024


@triton.jit(do_not_specialize=["pool_stride0", "max_context_len"])
def _per_request_grid_kernel(
    flat_in_ptr,  # [total] int64
    offsets_ptr,  # [bs + 1] int64
    req_pool_indices_ptr,  # [bs] int64
    pool_out_ptr,  # [rows, max_context_len] int32
    pool_stride0,
    max_context_len,
    COL_BLOCK: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1).to(tl.int64) * COL_BLOCK + tl.arange(0, COL_BLOCK)  # [C] int64
    start = tl.load(offsets_ptr + r)
    n = tl.minimum(tl.load(offsets_ptr + r + 1) - start, max_context_len)
    mask = cols < n
    row = tl.load(req_pool_indices_ptr + r)
    val = tl.load(flat_in_ptr + start + cols, mask=mask, other=0)  # [C] int64
    tl.store(pool_out_ptr + row * pool_stride0 + cols, val.to(tl.int32), mask=mask)


def scatter_per_request_grid(
    *,
    flat_in: torch.Tensor,
    offsets: torch.Tensor,
    req_pool_indices: torch.Tensor,
    pool_out: torch.Tensor,
) -> None:
    """Same contract as the scatter kernel; one launch, no batch cap."""
    bs = int(req_pool_indices.shape[0])
    if bs == 0 or flat_in.numel() == 0:
        return
    grid = (bs, triton.cdiv(int(pool_out.shape[1]), _COL_BLOCK))
    _per_request_grid_kernel[grid](
        flat_in,
        offsets,
        req_pool_indices,
        pool_out,
        pool_out.stride(0),
        pool_out.shape[1],
        COL_BLOCK=_COL_BLOCK,
    )
