"""Device helpers of the multi-slice plans (``plan_scan``, ``plan_lookback``, ``plan_recount``).

A slice ``k`` is requests ``[k * chunk, (k + 1) * chunk)``, walked in ``BS_BLOCK``-request
tiles. A slice is planned in two passes: the first sums its verify and write lengths (the part
the other slices wait for), the second, once the slice's bases are known, writes its offsets
and seeds. (Writing the seeds in the first pass, so that their gather overlaps the wait for the
bases, measured slower at 1 048 576 requests on an H200 and mixed at smaller sizes:
benchmarks/NOTES.md, step 12.)
"""

from __future__ import annotations

import triton
import triton.language as tl

from .plan_offsets import _plan_lens, _plan_slice, _plan_store_scalars


@triton.jit
def _slice_len(k, chunk, bs, WIDE: tl.constexpr):
    """Requests in slice ``k`` (``chunk`` but for the last slice, cut by ``bs``), so that a
    slice walks only the tiles that hold its requests: an int32 scalar, or with ``WIDE`` an
    int64 one (a "slice" that may hold 2**31 requests or more)."""
    n = tl.minimum(chunk, bs - k * chunk)  # int64
    if not WIDE:
        n = n.to(tl.int32)
    return n


@triton.jit
def _tile_requests(k, t, chunk, bs, BS_BLOCK: tl.constexpr):
    """Requests of the tile at ``t`` in slice ``k``: ``[B]`` int64 indices and the bool mask of
    those inside the slice and the batch."""
    lane = tl.arange(0, BS_BLOCK)
    r = k * chunk + t + lane  # [B] int64
    return r, (t + lane < chunk) & (r < bs)


@triton.jit
def _plan_tile_lens(
    k,  # int64 scalar: the slice's number
    t,  # first request of the tile within the slice
    chunk,
    bs,
    req_pool_indices_ptr,
    prefix_lens_ptr,
    extend_seq_lens_ptr,
    swa_window_size,
    BS_BLOCK: tl.constexpr,
):
    """One tile's verify and write lengths (``[B]`` int64 each, 0 outside the slice)."""
    r, in_slice = _tile_requests(k, t, chunk, bs, BS_BLOCK)
    pool_idx = tl.load(req_pool_indices_ptr + r, mask=in_slice, other=0)  # [B] int64
    prefix = tl.load(prefix_lens_ptr + r, mask=in_slice, other=0)
    extend = tl.load(extend_seq_lens_ptr + r, mask=in_slice, other=0)
    return _plan_lens(pool_idx, prefix, extend, swa_window_size)


@triton.jit
def _plan_slice_sums(
    k,  # int64 scalar: this slice's number
    chunk,  # requests per slice
    bs,
    req_pool_indices_ptr,
    prefix_lens_ptr,
    extend_seq_lens_ptr,
    swa_window_size,
    BS_BLOCK: tl.constexpr,
    WIDE: tl.constexpr,
):
    """First pass over slice ``k``: its verify and write sums (int64 scalars). ``WIDE``: the
    slice may hold 2**31 requests or more (its tile counter is then int64: in int32 its last
    step would wrap below the bound and the loop not end)."""
    n = _slice_len(k, chunk, bs, WIDE)
    t = tl.zeros([], n.dtype)
    verify_acc = tl.zeros([BS_BLOCK], dtype=tl.int64)  # [B] int64 per-lane partial sums
    write_acc = tl.zeros([BS_BLOCK], dtype=tl.int64)
    while t < n:  # (while loops: Triton 3.6's interpreter cannot range over tensors)
        verify_len, write_len = _plan_tile_lens(
            k,
            tl.multiple_of(t, BS_BLOCK),
            chunk,
            bs,
            req_pool_indices_ptr,
            prefix_lens_ptr,
            extend_seq_lens_ptr,
            swa_window_size,
            BS_BLOCK,
        )
        verify_acc += verify_len
        write_acc += write_len
        t += BS_BLOCK
    return tl.sum(verify_acc, axis=0), tl.sum(write_acc, axis=0)


@triton.jit
def _plan_numbered_slice(
    k,  # int64 scalar: this slice's number
    n_slices,
    chunk,  # requests per slice
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
    verify_base,  # int64 scalar: verify total of the slices before k
    write_base,  # int64 scalar: write total of the slices before k
    HAS_LUT: tl.constexpr,
    BS_BLOCK: tl.constexpr,
):
    """Second pass over slice ``k``: its offsets at ``r + 1`` (carrying the bases from tile to
    tile) and its seeds at ``r``; both offsets' index 0 from the first slice
    and the whole batch's scalars from the last."""
    if k == 0:
        tl.store(verify_offsets_ptr, 0)
        tl.store(write_offsets_ptr, 0)
    n = _slice_len(k, chunk, bs, False)
    t = tl.zeros([], n.dtype)
    while t < n:
        r, in_slice = _tile_requests(k, tl.multiple_of(t, BS_BLOCK), chunk, bs, BS_BLOCK)
        verify_sum, write_sum = _plan_slice(  # the fixed-block kernel's plan of one block
            r,
            in_slice,
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
            swa_window_size,
            verify_base,
            write_base,
            HAS_LUT,
        )
        verify_base += verify_sum
        write_base += write_sum
        t += BS_BLOCK
    if k == n_slices - 1:
        _plan_store_scalars(
            verify_num_valid_ptr,
            verify_enable_ptr,
            write_num_valid_reqs_ptr,
            verify_base,
            k * 0 + bs,
            verify_capacity,
        )
