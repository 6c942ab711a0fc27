"""Plan offsets for any batch size in one launch: a slice scan with decoupled look-back.

Program ``k`` (in the order programs start, from a ticket counter) plans slice ``k`` (requests
``[k*chunk, (k+1)*chunk)``, walked in ``BS_BLOCK``-request tiles). It sums its slice, publishes the
sums, adds up its predecessors' published sums walking back from ``k - 1`` until it meets a
slice that has published its inclusive prefix, publishes its own inclusive prefix, and plans its
slice exactly as the fixed-block kernel does; the last slice writes the batch's scalars.

Each slice publishes its two sums (verify, write) twice, first its own sums (the aggregate),
then its inclusive prefix, in four int64 words that start as ``UNSET`` (``INT64_MIN``, which
no sum of non-negative lengths takes; a sum that wraps onto it is published as
``INT64_MIN + 1``, so inputs past the int64 precondition give wrong totals, never a hang). Each
word is written once, by one relaxed atomic exchange, so a reader needs no ordering between
words, only to see the ones it needs set. Totals are exact up to ``2**63 - 1``. Tickets make a
program wait only on programs that started before it, so every slice waited on is running or
done. No host sync.

The launch leaves its state as it found it: after publishing its prefix each program counts
itself done (a second counter, also from ``UNSET``), and the last one, which every other
program's reads precede, sets the words it used back to ``UNSET``. So a state buffer filled
once serves every later launch ordered after it (the same stream), with no fill per launch;
launches that may overlap (other streams, CUDA graphs replayed anywhere) need buffers of
their own.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._launch import binder
from .args import PlanInputs, PlanOutputs, plan_kernel_head, plan_kernel_scalars
from .plan_slices import _plan_numbered_slice, _plan_slice_sums

# Predecessor slices read per look-back step (128 beat 32 from bs 32 768 on an H200).
LOOK_BACK_WINDOW = 128
RESET_BLOCK = 1024  # state words the last program re-arms per step
_WORDS = 4  # state words per slice: verify sum, write sum, verify prefix, write prefix
HEADER = 2  # state words before the slices': start tickets, programs done
UNSET = -(2**63)  # a state word not yet published
_HEADER: tl.constexpr = tl.constexpr(HEADER)
_UNSET: tl.constexpr = tl.constexpr(UNSET)


@triton.jit
def _publish(word_ptr, value):
    """Publish ``value`` (int64 scalar) into a word that holds ``UNSET`` until then."""
    tl.atomic_xchg(word_ptr, tl.where(value == _UNSET, _UNSET + 1, value), sem="relaxed")


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
        words = state_ptr + j * WORDS
        on = j >= 0  # slices before 0 read as a published prefix of 0
        sum_v = tl.load(words + 0, mask=on, other=0, volatile=True)  # [W] int64
        sum_w = tl.load(words + 1, mask=on, other=0, volatile=True)
        pre_v = tl.load(words + 2, mask=on, other=0, volatile=True)
        pre_w = tl.load(words + 3, mask=on, other=0, volatile=True)
        has_prefix = (pre_v != _UNSET) & (pre_w != _UNSET)
        has_sum = (sum_v != _UNSET) & (sum_w != _UNSET)
        stop = tl.min(tl.where(has_prefix, w, WINDOW), axis=0)  # nearest prefix, or W
        need = w <= stop
        if tl.min(tl.where(need, (has_prefix | has_sum).to(tl.int32), 1), axis=0) != 0:
            verify_base += tl.sum(tl.where(need, tl.where(has_prefix, pre_v, sum_v), 0), 0)
            write_base += tl.sum(tl.where(need, tl.where(has_prefix, pre_w, sum_w), 0), 0)
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
    lut_ptr,  # [lut_len] int64 (unused without HAS_LUT)
    verify_offsets_ptr,  # [>= bs + 1] int64
    write_offsets_ptr,  # [>= bs + 1] int64
    seed_ptr,  # [>= bs] int64
    verify_num_valid_ptr,  # [1] int32
    verify_enable_ptr,  # [1] int32
    write_num_valid_reqs_ptr,  # [1] int32
    req_to_token_stride0,
    lut_len,
    state_ptr,  # [>= HEADER + WORDS * n_slices] int64, UNSET on entry and exit (module doc)
    bs,
    chunk,
    swa_window_size,
    verify_capacity,
    HAS_LUT: tl.constexpr,
    BS_BLOCK: tl.constexpr,
    WINDOW: tl.constexpr,
    WORDS: tl.constexpr,
    RESET_BLOCK: tl.constexpr,
):
    n_slices = tl.num_programs(0)
    # The ticket counter starts at UNSET too: this program's slice is its start ticket.
    k = (tl.atomic_add(state_ptr, 1) - _UNSET).to(tl.int64)
    words = state_ptr + _HEADER + k * WORDS  # this slice's WORDS state words

    verify_sum, write_sum = _plan_slice_sums(
        k,
        chunk,
        bs,
        req_pool_indices_ptr,
        prefix_lens_ptr,
        extend_seq_lens_ptr,
        swa_window_size,
        BS_BLOCK,
    )
    _publish(words + 0, verify_sum)
    _publish(words + 1, write_sum)
    verify_base, write_base = _look_back(state_ptr + _HEADER, k, WINDOW, WORDS)
    _publish(words + 2, verify_base + verify_sum)
    _publish(words + 3, write_base + write_sum)
    # Done with the state (acq_rel: after this program's reads and publishes). The last
    # program done re-arms every word the launch used.
    if tl.atomic_add(state_ptr + 1, 1) - _UNSET == n_slices - 1:
        used = _HEADER + WORDS * n_slices.to(tl.int64)  # int64: may pass 2**31
        for w0 in range(0, used, RESET_BLOCK):
            w = w0 + tl.arange(0, RESET_BLOCK)  # [R] int64 state word indices
            tl.store(state_ptr + w, tl.full([RESET_BLOCK], _UNSET, tl.int64), mask=w < used)

    _plan_numbered_slice(
        k,
        n_slices,
        chunk,
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
        BS_BLOCK,
    )


def lookback_state_words(n_slices: int) -> int:
    """The state words a launch over ``n_slices`` slices uses."""
    return HEADER + _WORDS * n_slices


def new_lookback_state(like: torch.Tensor, words: int) -> torch.Tensor:
    """A state buffer of ``words`` int64 words on ``like``'s device, ready for a launch (one
    fill)."""
    return like.new_full((words,), UNSET, dtype=torch.int64)


def launch_plan_lookback(
    i: PlanInputs,
    o: PlanOutputs,
    *,
    grid: tuple[int],
    chunk: int,
    bs_block: int,
    num_warps: int = 4,
    window: int = LOOK_BACK_WINDOW,
    state: torch.Tensor | None = None,
) -> None:
    """One launch over ``grid = (cdiv(bs, chunk),)`` slices (``1 <= bs``, ``1 <= chunk``)
    walked in tiles of ``bs_block`` requests (a power of two); ``window``: predecessor slices
    read per look-back step (a power of two). ``state``: at least
    ``lookback_state_words(n_slices)`` contiguous int64 words on the outputs' device, all
    ``UNSET`` (``new_lookback_state``), used by no launch that may overlap this one; the
    launch leaves them ``UNSET``. ``None``: a fresh one (one fill). Arguments are checked by
    the caller (``check_plan_args``)."""
    if state is None:
        state = new_lookback_state(o.out_verify_offsets, lookback_state_words(grid[0]))
    bound = _bound(
        i.full_to_swa_index_mapping is not None, bs_block, window, _WORDS, RESET_BLOCK, num_warps
    )
    bound.with_head(
        grid,
        plan_kernel_head(i, o, spare=state),
        (
            *plan_kernel_scalars(i),
            state,
            i.bs,
            chunk,
            int(i.swa_window_size),
            int(i.verify_capacity),
        ),
    )


_bound = binder(
    _plan_lookback_kernel, "HAS_LUT", "BS_BLOCK", "WINDOW", "WORDS", "RESET_BLOCK", "num_warps"
)
