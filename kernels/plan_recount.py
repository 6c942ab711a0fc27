"""Plan offsets for a mid-size batch in one launch and no temporary: each slice recounts its
predecessors.

Program ``k`` plans slice ``k`` (requests ``[k*chunk, (k+1)*chunk)``, walked in
``BS_BLOCK``-request tiles). Its bases, the verify and write totals of every request before
the slice, it computes itself by reading those requests' inputs again, ``SUM_BLOCK`` at a time.
Programs share nothing, so the launch needs no state buffer, no fill and no ordering between
programs; the price is that program ``k`` reads ``24 * k * chunk`` bytes of inputs, so the last
program's time grows with ``bs`` (``scan`` and ``lookback`` take over for large batches). Then
it plans its slice exactly as the fixed-block kernel does; the last slice writes the batch's
scalars. No host synchronisation.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._launch import BoundKernel, Head, binder
from .args import PlanInputs, PlanOutputs, plan_kernel_head, plan_kernel_scalars
from .plan_slices import _plan_numbered_slice, _plan_slice_sums

# Predecessor requests a program sums per step (2 048 on 8 warps tied or beat 1 024 at bs
# 2 048 to 4 096 on an H200: benchmarks/NOTES.md, step 16).
RECOUNT_SUM_BLOCK = 2048


@triton.jit(
    do_not_specialize=[
        "req_to_token_stride0",
        "req_to_token_rows",
        "req_to_token_width",
        "lut_len",
        "bs",
        "chunk",
        "swa_window_size",
        "verify_capacity",
    ]
)
def _plan_recount_kernel(
    req_pool_indices_ptr,  # [bs] int64, 0 = padding
    prefix_lens_ptr,  # [bs] int64
    extend_seq_lens_ptr,  # [bs] int64
    req_to_token_ptr,  # [rows, max_seq_len] int32
    lut_ptr,  # [lut_len] int64 (unused without HAS_LUT)
    verify_offsets_ptr,  # [>= bs + 1] int64
    write_offsets_ptr,  # [>= bs + 1] int64
    seed_ptr,  # [>= bs] int64
    verify_num_valid_ptr,  # [1] int32
    verify_enable_ptr,  # [1] int32
    write_num_valid_reqs_ptr,  # [1] int32
    req_to_token_stride0,
    req_to_token_rows,
    req_to_token_width,
    lut_len,
    bs,
    chunk,
    swa_window_size,
    verify_capacity,
    HAS_LUT: tl.constexpr,
    BS_BLOCK: tl.constexpr,
    SUM_BLOCK: tl.constexpr,
):
    k = tl.program_id(0).to(tl.int64)
    # Bases: the requests [0, k * chunk) before this slice, summed as one slice numbered 0.
    verify_base, write_base = _plan_slice_sums(
        k * 0,
        k * chunk,
        bs,
        req_pool_indices_ptr,
        prefix_lens_ptr,
        extend_seq_lens_ptr,
        swa_window_size,
        SUM_BLOCK,
        True,  # the requests before slice k: 2**31 or more in a batch that large
    )
    _plan_numbered_slice(
        k,
        tl.num_programs(0),
        chunk,
        req_pool_indices_ptr,
        prefix_lens_ptr,
        extend_seq_lens_ptr,
        req_to_token_ptr,
        req_to_token_stride0,
        req_to_token_rows,
        req_to_token_width,
        lut_ptr,
        lut_len,
        verify_offsets_ptr,
        write_offsets_ptr,
        seed_ptr,
        verify_num_valid_ptr,
        verify_enable_ptr,
        write_num_valid_reqs_ptr,
        bs,
        swa_window_size,
        verify_capacity,
        verify_base,
        write_base,
        HAS_LUT,
        BS_BLOCK,
    )


def launch_plan_recount(
    i: PlanInputs,
    o: PlanOutputs,
    *,
    grid: tuple[int],
    chunk: int,
    bs_block: int,
    num_warps: int = 4,
    sum_block: int = RECOUNT_SUM_BLOCK,
    head: Head | None = None,
) -> None:
    """One launch over ``grid = (cdiv(bs, chunk),)`` slices (``1 <= bs``, ``1 <= chunk``)
    walked in tiles of ``bs_block`` requests, predecessors summed ``sum_block`` at a time (both
    powers of two); no temporary. Arguments are checked by the caller (``check_plan_args``);
    ``head``: their ``checked_plan_head``, if the caller has it."""
    has_lut = i.full_to_swa_index_mapping is not None
    bound = bind_plan_recount(
        has_lut=has_lut, bs_block=bs_block, num_warps=num_warps, sum_block=sum_block
    )
    bound.with_head(
        grid,
        head or plan_kernel_head(i, o, spare=o.out_verify_offsets),
        (),
        (*plan_kernel_scalars(i), i.bs, chunk, int(i.swa_window_size), int(i.verify_capacity)),
    )


def bind_plan_recount(
    *, has_lut: bool, bs_block: int, num_warps: int = 4, sum_block: int = RECOUNT_SUM_BLOCK
) -> BoundKernel:
    """The recount kernel bound to these block parameters: called with its grid and its
    arguments after a launch ``Head`` (the table's row stride, rows and width, the LUT length,
    ``bs``, ``chunk``, the window and the capacity), it is ``launch_plan_recount``'s launch."""
    return _bound(has_lut, bs_block, sum_block, num_warps)


_bound = binder(_plan_recount_kernel, "HAS_LUT", "BS_BLOCK", "SUM_BLOCK", "num_warps")
