"""Plan offsets for any batch size in one launch: a slice scan with decoupled look-back.

Program ``k`` (in the order programs start, from a ticket counter) plans slice ``k`` (requests
``[k*chunk, (k+1)*chunk)``, one ``BS_BLOCK``-lane block). It sums its slice, publishes the
sums, adds up its predecessors' published sums walking back from ``k - 1`` until it meets a
slice that has published its inclusive prefix, publishes its own inclusive prefix, and plans its
slice exactly as the fixed-block kernel does; the last slice writes the batch's scalars.

Each published state is one int64 word, ``value << 2 | flag`` (flag 1: the slice's sum, flag 2:
the inclusive prefix), so a reader sees a value and its flag together. Values are totals of
non-negative lengths and must stay below 2**61. Tickets make a program wait only on programs
that started before it, so every slice waited on is running or done. No host sync.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .plan_offsets import _plan_lens, _plan_numbered_slice

_LOOK_BACK_WINDOW = 32  # predecessor states read per look-back step
_SUM: tl.constexpr = tl.constexpr(1)  # flag: the word holds the slice's own sum
_PREFIX: tl.constexpr = tl.constexpr(2)  # flag: the word holds the inclusive prefix


@triton.jit
def _look_back(state_ptr, k, WINDOW: tl.constexpr):
    """Total of slices ``[0, k)`` from their published states; spins while one it needs has
    published nothing yet."""
    w = tl.arange(0, WINDOW)
    base = k * 0  # int64 scalar
    hi = k  # states [0, hi) still to add
    while hi > 0:
        j = hi - 1 - w  # [W] int64, nearest predecessor first
        # Slices before 0 read as an inclusive prefix of 0.
        word = tl.load(state_ptr + j, mask=j >= 0, other=_PREFIX, volatile=True)  # [W] int64
        flag = word & 3
        stop = tl.min(tl.where(flag == _PREFIX, w, WINDOW), axis=0)  # nearest prefix, or W
        need = w <= stop
        if tl.min(tl.where(need, flag, _PREFIX), axis=0) != 0:  # all needed states published
            base += tl.sum(tl.where(need, word >> 2, 0), axis=0)
            hi = tl.where(stop < WINDOW, 0, hi - WINDOW)
    return base


@triton.jit(
    do_not_specialize=[
        "req_to_token_stride0",
        "lut_len",
        "bs",
        "chunk",
        "swa_window_size",
        "verify_capacity",
    ]
)
def _plan_lookback_kernel(
    req_pool_indices_ptr,  # [bs] int64, 0 = padding
    prefix_lens_ptr,  # [bs] int64
    extend_seq_lens_ptr,  # [bs] int64
    req_to_token_ptr,  # [rows, max_seq_len] int32
    req_to_token_stride0,
    lut_ptr,  # [lut_len] int64 (unused without HAS_LUT)
    lut_len,
    verify_offsets_ptr,  # [>= bs + 1] int64
    write_offsets_ptr,  # [>= bs + 1] int64
    seed_ptr,  # [>= bs] int64
    verify_num_valid_ptr,  # [1] int32
    verify_enable_ptr,  # [1] int32
    write_num_valid_reqs_ptr,  # [1] int32
    state_ptr,  # [1 + 2 * n_slices] int64, zero on entry: ticket, verify states, write states
    bs,
    chunk,
    swa_window_size,
    verify_capacity,
    HAS_LUT: tl.constexpr,
    BS_BLOCK: tl.constexpr,
    WINDOW: tl.constexpr,
):
    n_slices = tl.num_programs(0)
    k = tl.atomic_add(state_ptr, 1).to(tl.int64)  # this program's slice: its start ticket
    verify_state = state_ptr + 1
    write_state = state_ptr + 1 + n_slices

    lane = tl.arange(0, BS_BLOCK)
    r = k * chunk + lane  # [B] int64
    in_slice = (lane < chunk) & (r < bs)
    pool_idx = tl.load(req_pool_indices_ptr + r, mask=in_slice, other=0)  # [B] int64
    prefix = tl.load(prefix_lens_ptr + r, mask=in_slice, other=0)
    extend = tl.load(extend_seq_lens_ptr + r, mask=in_slice, other=0)
    verify_len, write_len = _plan_lens(pool_idx, prefix, extend, swa_window_size)
    verify_sum = tl.sum(verify_len, axis=0)
    write_sum = tl.sum(write_len, axis=0)
    tl.atomic_xchg(verify_state + k, (verify_sum << 2) | _SUM)
    tl.atomic_xchg(write_state + k, (write_sum << 2) | _SUM)
    verify_base = _look_back(verify_state, k, WINDOW)
    write_base = _look_back(write_state, k, WINDOW)
    tl.atomic_xchg(verify_state + k, ((verify_base + verify_sum) << 2) | _PREFIX)
    tl.atomic_xchg(write_state + k, ((write_base + write_sum) << 2) | _PREFIX)

    _plan_numbered_slice(
        k,
        n_slices,
        r,
        in_slice,
        req_pool_indices_ptr,
        prefix_lens_ptr,
        extend_seq_lens_ptr,
        req_to_token_ptr,
        req_to_token_stride0,
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
    )


def launch_plan_lookback(
    *,
    req_pool_indices: torch.Tensor,
    prefix_lens: torch.Tensor,
    extend_seq_lens: torch.Tensor,
    req_to_token: torch.Tensor,
    full_to_swa_index_mapping: torch.Tensor | None,
    out_verify_offsets: torch.Tensor,
    out_write_offsets: torch.Tensor,
    out_write_seed_slot_indices: torch.Tensor,
    out_verify_num_valid: torch.Tensor,
    out_verify_enable: torch.Tensor,
    out_write_num_valid_reqs: torch.Tensor,
    swa_window_size: int,
    verify_capacity: int,
    chunk: int,
    bs_block: int,
    num_warps: int = 4,
) -> None:
    """One launch over ``cdiv(bs, chunk)`` slices (``1 <= bs``, ``chunk <= bs_block``, a power
    of two), plus a zeroed ``1 + 2 * n_slices`` int64 state buffer. Arguments are checked by
    the caller (``check_plan_args``)."""
    bs = int(req_pool_indices.shape[0])
    n_slices = triton.cdiv(bs, chunk)
    state = torch.zeros(1 + 2 * n_slices, dtype=torch.int64, device=req_pool_indices.device)
    lut = full_to_swa_index_mapping
    _plan_lookback_kernel[(n_slices,)](
        req_pool_indices,
        prefix_lens,
        extend_seq_lens,
        req_to_token,
        req_to_token.stride(0),
        lut if lut is not None else state,
        int(lut.shape[0]) if lut is not None else 0,
        out_verify_offsets,
        out_write_offsets,
        out_write_seed_slot_indices,
        out_verify_num_valid,
        out_verify_enable,
        out_write_num_valid_reqs,
        state,
        bs,
        chunk,
        int(swa_window_size),
        int(verify_capacity),
        HAS_LUT=lut is not None,
        BS_BLOCK=bs_block,
        WINDOW=_LOOK_BACK_WINDOW,
        num_warps=num_warps,
    )
