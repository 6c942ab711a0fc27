"""Baseline for the benchmarks: the per-request x column-tile scatter (one program per request
and tile, no batch cap), measured against the dispatcher's strategies.

Grid ``(bs, cdiv(max_context_len, 1024))``: program ``(r, c)`` copies columns
``[c*1024, (c+1)*1024)`` of request ``r``. It is the ``rows`` kernel
(``kvcanary_kernels.scatter_rows``) launched directly over that grid, with no dispatcher in
front of it.
"""

from __future__ import annotations

import torch
import triton

from kvcanary_kernels.args import ScatterArgs
from kvcanary_kernels.scatter_rows import ROWS_COLS, launch_scatter_rows


def scatter_per_request_grid(
    *,
    flat_in: torch.Tensor,
    offsets: torch.Tensor,
    req_pool_indices: torch.Tensor,
    pool_out: torch.Tensor,
) -> None:
    """Same contract as the scatter kernel; one launch, no batch cap."""
    t = ScatterArgs(flat_in, offsets, req_pool_indices, pool_out)
    if t.bs == 0 or t.num_tokens == 0:
        return
    launch_scatter_rows(t, grid=(t.bs, triton.cdiv(int(pool_out.shape[1]), ROWS_COLS)))
