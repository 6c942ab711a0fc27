"""Plan offsets for any batch size in one launch: a slice scan with decoupled look-back.

Program ``k`` (in the order programs start, from a ticket counter) plans slice ``k`` (requests
``[k*chunk, (k+1)*chunk)``, one ``BS_BLOCK``-lane block). It sums its slice, publishes the
sums, adds up its predecessors' published sums walking back from ``k - 1`` until it meets a
slice that has published its inclusive prefix, publishes its own inclusive prefix, and plans its
slice exactly as the fixed-block kernel does; the last slice writes the batch's scalars.

Each slice publishes its two sums (verify, write) twice, first its own sums (the aggregate),
then its inclusive prefix, each value split into 32-bit halves stored as one int64 word
``half << 1 | 1``: every word goes from 0 (nothing yet) to its value exactly once, so a reader
needs no ordering between words, only to see all four words of a group set. Totals are exact
over the whole int64 range. Tickets make a program wait only on programs that started before
it, so every slice waited on is running or done. No host sync.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .plan_offsets import _plan_lens, _plan_numbered_slice

_LOOK_BACK_WINDOW = 32  # predecessor slices read per look-back step
_WORDS = 8  # state words per slice: aggregate (v_lo, v_hi, w_lo, w_hi), then prefix likewise
_PREFIX_AT: tl.constexpr = tl.constexpr(4)  # first prefix word of a slice's group


@triton.jit
def _publish(words_ptr, verify, write):
    """Store the int64 values ``verify`` and ``write`` (>= 0) as four self-flagged words."""
    verify_hi = verify >> 32
    write_hi = write >> 32
    tl.atomic_xchg(words_ptr + 0, ((verify - (verify_hi << 32)) << 1) | 1)
    tl.atomic_xchg(words_ptr + 1, (verify_hi << 1) | 1)
    tl.atomic_xchg(words_ptr + 2, ((write - (write_hi << 32)) << 1) | 1)
    tl.atomic_xchg(words_ptr + 3, (write_hi << 1) | 1)


@triton.jit
def _read_group(words_ptr, mask):
    """A [W] group of published pairs: (ready, verify, write); lanes off ``mask`` read as a
    ready zero (slices before 0)."""
    v_lo = tl.load(words_ptr + 0, mask=mask, other=1, volatile=True)  # [W] int64
    v_hi = tl.load(words_ptr + 1, mask=mask, other=1, volatile=True)
    w_lo = tl.load(words_ptr + 2, mask=mask, other=1, volatile=True)
    w_hi = tl.load(words_ptr + 3, mask=mask, other=1, volatile=True)
    ready = (v_lo & v_hi & w_lo & w_hi & 1) != 0
    verify = ((v_hi >> 1) << 32) | (v_lo >> 1)
    write = ((w_hi >> 1) << 32) | (w_lo >> 1)
    return ready, verify, write


@triton.jit
def _look_back(state_ptr, k, WINDOW: tl.constexpr, WORDS: tl.constexpr):
    """Verify and write totals of slices ``[0, k)`` from their published words; spins while
    one it needs has published nothing yet."""
    w = tl.arange(0, WINDOW)
    verify_base = k * 0  # int64 scalar
    write_base = k * 0
    hi = k  # slices [0, hi) still to add
    while hi > 0:
        j = hi - 1 - w  # [W] int64, nearest predecessor first
        group = state_ptr + j * WORDS
        has_prefix, prefix_v, prefix_w = _read_group(group + _PREFIX_AT, j >= 0)
        has_sum, sum_v, sum_w = _read_group(group, j >= 0)
        stop = tl.min(tl.where(has_prefix, w, WINDOW), axis=0)  # nearest prefix, or W
        need = w <= stop
        if tl.min(tl.where(need, (has_prefix | has_sum).to(tl.int32), 1), axis=0) != 0:
            verify_base += tl.sum(tl.where(need, tl.where(has_prefix, prefix_v, sum_v), 0), 0)
            write_base += tl.sum(tl.where(need, tl.where(has_prefix, prefix_w, sum_w), 0), 0)
            hi = tl.where(stop < WINDOW, 0, hi - WINDOW)
    return verify_base, write_base


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
    state_ptr,  # [1 + WORDS * n_slices] int64, zero on entry: ticket, then each slice's words
    bs,
    chunk,
    swa_window_size,
    verify_capacity,
    HAS_LUT: tl.constexpr,
    BS_BLOCK: tl.constexpr,
    WINDOW: tl.constexpr,
    WORDS: tl.constexpr,
):
    n_slices = tl.num_programs(0)
    k = tl.atomic_add(state_ptr, 1).to(tl.int64)  # this program's slice: its start ticket
    words = state_ptr + 1 + k * WORDS  # this slice's group of WORDS state words

    lane = tl.arange(0, BS_BLOCK)
    r = k * chunk + lane  # [B] int64
    in_slice = (lane < chunk) & (r < bs)
    pool_idx = tl.load(req_pool_indices_ptr + r, mask=in_slice, other=0)  # [B] int64
    prefix = tl.load(prefix_lens_ptr + r, mask=in_slice, other=0)
    extend = tl.load(extend_seq_lens_ptr + r, mask=in_slice, other=0)
    verify_len, write_len = _plan_lens(pool_idx, prefix, extend, swa_window_size)
    verify_sum = tl.sum(verify_len, axis=0)
    write_sum = tl.sum(write_len, axis=0)
    _publish(words, verify_sum, write_sum)
    verify_base, write_base = _look_back(state_ptr + 1, k, WINDOW, WORDS)
    _publish(words + _PREFIX_AT, verify_base + verify_sum, write_base + write_sum)

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
    of two), plus a zeroed ``1 + 8 * n_slices`` int64 state buffer. Arguments are checked by
    the caller (``check_plan_args``)."""
    bs = int(req_pool_indices.shape[0])
    n_slices = triton.cdiv(bs, chunk)
    state = torch.zeros(1 + _WORDS * n_slices, dtype=torch.int64, device=req_pool_indices.device)
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
        WORDS=_WORDS,
        num_warps=num_warps,
    )
