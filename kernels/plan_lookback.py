"""Plan offsets for any batch size in one launch: slice sums published, then read back by
every later slice.

Program ``k`` (in the order programs start, from a ticket counter) plans slice ``k`` (requests
``[k*chunk, (k+1)*chunk)``, walked in ``BS_BLOCK``-request tiles). It sums its slice, publishes
the two sums (verify, write), adds up the sums every slice before it has published,
``SUMS_BLOCK`` slices a step, waiting on a step until all of it is published, and plans its
slice exactly as the fixed-block kernel does; the last slice writes the batch's scalars. This
is ``scan``'s two launches in one: programs wait only on programs that took an earlier ticket,
which are running or done, so every wait ends. No host sync.

State: ``[tickets, done, verify sums [n_slices], write sums [n_slices]]`` int64 words, each
``UNSET`` (``INT64_MIN``) until written. No sum of non-negative lengths is ``UNSET``; a sum that
wraps onto it is published as ``INT64_MIN + 1``, so inputs past the int64 precondition give
wrong totals, never a hang. Each sum is written once, by one relaxed atomic exchange, and a
reader needs no ordering between words, only to see the ones it adds up set. Totals are exact
up to ``2**63 - 1``.

The launch leaves its state as it found it: after its last read of the state each program
counts itself done (acq_rel), and the last one, which every other program's reads precede,
sets the words the launch used back to ``UNSET``. So a state buffer filled once serves every
later launch ordered after it (the same stream), with no fill per launch; launches that may
overlap (other streams, CUDA graphs replayed anywhere) need buffers of their own.

Each published sum that a step reads must be held by one thread. A ``[SUMS_BLOCK]`` tile
spread over more threads than it has elements gives each element several copies, and each
copy is read and waited on separately. The copies may see a publish at different times and
then disagree: in ``benchmarks/NOTES.md``, step 65, an experiment whose polled copies could
disagree faulted. So ``SUMS_BLOCK`` must be at least the launch's threads, and
``bind_plan_lookback`` refuses less.

Published sums sit in two arrays rather than in (verify, write) pairs, so that a step's reads
of each are contiguous: on an H200 that cut the launch from 20.6 to 18.0 us at 131 072 requests
(benchmarks/NOTES.md, step 18).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._checks import PREFIX
from ._launch import BoundKernel, Head, binder
from .args import PlanInputs, PlanOutputs, plan_kernel_head, plan_kernel_scalars
from .plan_slices import _plan_numbered_slice, _plan_slice_sums

LOOKBACK_SUMS_BLOCK = 256  # predecessor slices' sums read per step (256 beat 512 and 1 024)
WARP_THREADS = 32  # threads a warp holds: SUMS_BLOCK is at least WARP_THREADS * num_warps
RESET_BLOCK = 1024  # state words the last program re-arms per step
HEADER = 2  # state words before the sums: start tickets, programs done
UNSET = -(2**63)  # a state word not yet written
_HEADER: tl.constexpr = tl.constexpr(HEADER)
_UNSET: tl.constexpr = tl.constexpr(UNSET)


@triton.jit
def _publish(word_ptr, value):
    """Publish ``value`` (int64 scalar) into a word that holds ``UNSET`` until then."""
    tl.atomic_xchg(word_ptr, tl.where(value == _UNSET, _UNSET + 1, value), sem="relaxed")


@triton.jit
def _unset_in(v, w):
    """Whether any of ``v``, ``w`` (``[S]`` int64 published sums) is still ``UNSET``."""
    return tl.max(((v == _UNSET) | (w == _UNSET)).to(tl.int32), axis=0) != 0


@triton.jit
def _sums_before(verify_sums_ptr, write_sums_ptr, k, SUMS_BLOCK: tl.constexpr):
    """Verify and write totals (int64 scalars) of slices ``[0, k)`` from their published sums;
    waits on each step until all of its slices have published."""
    j0 = tl.zeros([], k.dtype)
    verify_acc = tl.zeros([SUMS_BLOCK], dtype=tl.int64)  # [S] int64 partial totals
    write_acc = tl.zeros([SUMS_BLOCK], dtype=tl.int64)
    while j0 < k:  # (while loops: Triton 3.6's interpreter cannot range over tensors)
        j = tl.multiple_of(j0, SUMS_BLOCK) + tl.arange(0, SUMS_BLOCK)  # [S] int64 slice numbers
        before = j < k
        # Volatile: each read goes to memory, so a wait sees a later publish.
        v = tl.load(verify_sums_ptr + j, mask=before, other=0, volatile=True)  # [S] int64
        w = tl.load(write_sums_ptr + j, mask=before, other=0, volatile=True)
        waiting = _unset_in(v, w)
        while waiting:
            v = tl.load(verify_sums_ptr + j, mask=before, other=0, volatile=True)
            w = tl.load(write_sums_ptr + j, mask=before, other=0, volatile=True)
            waiting = _unset_in(v, w)
        verify_acc += v
        write_acc += w
        j0 += SUMS_BLOCK
    return tl.sum(verify_acc, axis=0), tl.sum(write_acc, axis=0)


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
    state_ptr,  # [>= HEADER + 2 * n_slices] int64, UNSET on entry and exit (module doc)
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
    RESET_BLOCK: tl.constexpr,
):
    n_slices = tl.num_programs(0)
    # The ticket counter starts at UNSET too: this program's slice is its start ticket (no
    # ordering needed: the sums it waits on are read volatile).
    k = (tl.atomic_add(state_ptr, 1, sem="relaxed") - _UNSET).to(tl.int64)
    verify_sums_ptr = state_ptr + _HEADER  # [n_slices] int64 published verify sums
    write_sums_ptr = verify_sums_ptr + n_slices  # [n_slices] int64 published write sums

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
    _publish(verify_sums_ptr + k, verify_sum)
    _publish(write_sums_ptr + k, write_sum)
    verify_base, write_base = _sums_before(verify_sums_ptr, write_sums_ptr, k, SUMS_BLOCK)
    # Done with the state (acq_rel: after this program's reads and publishes). The last
    # program done re-arms every word the launch used.
    if tl.atomic_add(state_ptr + 1, 1) - _UNSET == n_slices - 1:
        used = _HEADER + 2 * n_slices.to(tl.int64)  # int64: may pass 2**31
        w0 = tl.zeros([], used.dtype)
        while w0 < used:
            w = tl.multiple_of(w0, RESET_BLOCK) + tl.arange(0, RESET_BLOCK)  # [R] int64 words
            tl.store(state_ptr + w, tl.full([RESET_BLOCK], _UNSET, tl.int64), mask=w < used)
            w0 += RESET_BLOCK

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


def lookback_state_words(n_slices: int) -> int:
    """The state words a launch over ``n_slices`` slices uses."""
    return HEADER + 2 * n_slices


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
    num_warps: int = 8,
    sums_block: int = LOOKBACK_SUMS_BLOCK,
    state: torch.Tensor | None = None,
    head: Head | None = None,
) -> None:
    """One launch over ``grid = (cdiv(bs, chunk),)`` slices (``1 <= bs``, ``1 <= chunk``)
    walked in tiles of ``bs_block`` requests (a power of two); ``sums_block``: predecessor
    slices' sums read per step (a power of two). ``state``: at least
    ``lookback_state_words(n_slices)`` contiguous int64 words on the outputs' device, all
    ``UNSET`` (``new_lookback_state``), used by no launch that may overlap this one; the
    launch leaves them ``UNSET``. ``None``: a fresh one (one fill). Arguments are checked by
    the caller (``check_plan_args``); ``head``: their ``checked_plan_head``, if the caller
    has it."""
    has_lut = i.full_to_swa_index_mapping is not None
    bound = bind_plan_lookback(
        has_lut=has_lut, bs_block=bs_block, num_warps=num_warps, sums_block=sums_block
    )
    if state is None:
        state = new_lookback_state(o.out_verify_offsets, lookback_state_words(grid[0]))
    bound.with_head(
        grid,
        head or plan_kernel_head(i, o, spare=state),
        (state,),
        (*plan_kernel_scalars(i), i.bs, chunk, int(i.swa_window_size), int(i.verify_capacity)),
    )


def bind_plan_lookback(
    *, has_lut: bool, bs_block: int, num_warps: int = 8, sums_block: int = LOOKBACK_SUMS_BLOCK
) -> BoundKernel:
    """The look-back kernel bound to these block parameters: called with its grid and its
    arguments after a launch ``Head`` (the state; the table's row stride, rows and width,
    the LUT length, ``bs``, ``chunk``, the window and the capacity), it is
    ``launch_plan_lookback``'s launch. ``sums_block`` must be at least
    ``WARP_THREADS * num_warps`` (the module says why), else a ``ValueError``."""
    threads = WARP_THREADS * num_warps
    if sums_block < threads:
        fewer = f" or num_warps <= {sums_block // WARP_THREADS}" * (sums_block >= WARP_THREADS)
        raise ValueError(
            f"{PREFIX}plan look-back sums_block={sums_block} is less than the {threads} threads "
            f"of num_warps={num_warps}; pass sums_block >= {threads}{fewer} (each published "
            "sum a wait reads must be held by one thread)"
        )
    return _bound(has_lut, bs_block, sums_block, RESET_BLOCK, num_warps)


_bound = binder(
    _plan_lookback_kernel, "HAS_LUT", "BS_BLOCK", "SUMS_BLOCK", "RESET_BLOCK", "num_warps"
)
