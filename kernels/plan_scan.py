"""Plan offsets for any batch size in two launches: per-slice sums, then a carried scan.

Launch 1 (``_plan_slice_sums_kernel``): program ``k`` sums the verify and write lengths of
slice ``k`` (requests ``[k*chunk, (k+1)*chunk)``) into ``sums[k]``. Launch 2
(``_plan_scan_kernel``): program ``k`` adds up ``sums[:k]`` for its bases and plans its slice
exactly as the fixed-block kernel does; the last program writes the whole batch's scalars.
Both walk a slice in ``BS_BLOCK``-request tiles. No host synchronisation.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._launch import Head, binder
from .args import PlanInputs, PlanOutputs, plan_kernel_head, plan_kernel_scalars
from .plan_slices import _plan_numbered_slice, _plan_slice_sums

SUMS_BLOCK = 1024  # slice sums folded per step when a program adds up the slices before it


@triton.jit(do_not_specialize=["bs", "chunk", "swa_window_size"])
def _plan_slice_sums_kernel(
    req_pool_indices_ptr,  # [bs] int64
    prefix_lens_ptr,  # [bs] int64
    extend_seq_lens_ptr,  # [bs] int64
    sums_ptr,  # [n_slices, 2] int64 out: (verify, write) per slice
    bs,
    chunk,
    swa_window_size,
    BS_BLOCK: tl.constexpr,
):
    k = tl.program_id(0).to(tl.int64)
    verify_sum, write_sum = _plan_slice_sums(
        k,
        chunk,
        bs,
        req_pool_indices_ptr,
        prefix_lens_ptr,
        extend_seq_lens_ptr,
        swa_window_size,
        BS_BLOCK,
        False,  # a slice holds at most 4 096 requests
    )
    tl.store(sums_ptr + 2 * k, verify_sum)
    tl.store(sums_ptr + 2 * k + 1, write_sum)


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
def _plan_scan_kernel(
    req_pool_indices_ptr,
    prefix_lens_ptr,
    extend_seq_lens_ptr,
    req_to_token_ptr,
    lut_ptr,
    verify_offsets_ptr,
    write_offsets_ptr,
    seed_ptr,
    verify_num_valid_ptr,
    verify_enable_ptr,
    write_num_valid_reqs_ptr,
    sums_ptr,  # [n_slices, 2] int64 from launch 1
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
    SUMS_BLOCK: tl.constexpr,
):
    k = tl.program_id(0).to(tl.int64)
    n_slices = tl.num_programs(0)
    # Bases: the sums of every slice before this one, SUMS_BLOCK slices at a time.
    verify_base = tl.zeros([SUMS_BLOCK], dtype=tl.int64)  # [S] int64 partial bases
    write_base = tl.zeros([SUMS_BLOCK], dtype=tl.int64)
    j0 = tl.zeros([], k.dtype)
    while j0 < k:  # (a while: Triton 3.6's interpreter cannot range over tensors)
        j = tl.multiple_of(j0, SUMS_BLOCK) + tl.arange(0, SUMS_BLOCK)
        before = j < k
        verify_base += tl.load(sums_ptr + 2 * j, mask=before, other=0)
        write_base += tl.load(sums_ptr + 2 * j + 1, mask=before, other=0)
        j0 += SUMS_BLOCK
    verify_base = tl.sum(verify_base, axis=0)
    write_base = tl.sum(write_base, axis=0)

    _plan_numbered_slice(
        k,
        n_slices,
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


def launch_plan_scan(
    i: PlanInputs,
    o: PlanOutputs,
    *,
    grid: tuple[int],
    chunk: int,
    bs_block: int,
    num_warps: int = 4,
    head: Head | None = None,
) -> None:
    """Two launches over ``grid = (cdiv(bs, chunk),)`` slices (``1 <= bs``,
    ``1 <= chunk``) walked in tiles of ``bs_block`` requests (a power of two), and an
    ``[n_slices, 2]`` int64 buffer of slice sums. Arguments are checked by the caller
    (``check_plan_args``); ``head``: their ``checked_plan_head``, if the caller has it."""
    swa = int(i.swa_window_size)
    sums = o.out_verify_offsets.new_empty((grid[0], 2))  # int64, on the outputs' device
    _sums(bs_block, num_warps)(
        grid, (i.req_pool_indices, i.prefix_lens, i.extend_seq_lens, sums, i.bs, chunk, swa)
    )
    _scan(i.full_to_swa_index_mapping is not None, bs_block, SUMS_BLOCK, num_warps).with_head(
        grid,
        head or plan_kernel_head(i, o, spare=sums),
        (sums,),
        (*plan_kernel_scalars(i), i.bs, chunk, swa, int(i.verify_capacity)),
    )


_sums = binder(_plan_slice_sums_kernel, "BS_BLOCK", "num_warps")
_scan = binder(_plan_scan_kernel, "HAS_LUT", "BS_BLOCK", "SUMS_BLOCK", "num_warps")
