"""Fixed-block plan of the verify and write CSR offsets for one forward step.

A single program holds the whole batch in one ``BS_BLOCK``-lane register block and prefix-sums
it with ``tl.cumsum``, hence the cap ``bs <= BS_BLOCK``. An optional ``carry`` (int64 ``[3]``:
verify total, write total and requests before this launch) lets consecutive launches over
consecutive slices of one batch produce the whole batch's offsets and scalars. Every plan
kernel seeds through ``_plan_slice``, which reads a seed only inside the token table (its rows
and width are arguments), whatever the data.
"""

from __future__ import annotations

import inspect

import torch
import triton
import triton.language as tl

from ._checks import name_a_non_tensor, require_block
from ._launch import BoundKernel, Head, binder
from .args import (
    SCRATCH_NAME,
    PlanInputs,
    PlanOutputs,
    bundle_plan_args,
    name_a_non_plan_tensor,
    plan_kernel_head,
    plan_kernel_scalars,
    plan_signature,
)
from .plan_checks import PLAN_BATCH_BLOCK, check_plan_args


@triton.jit
def _plan_lens(pool_idx, prefix, extend, swa_window_size):
    """Per-request verify and write lengths ([B] int64 each); padding rows (pool index 0) get 0."""
    active = pool_idx != 0
    # prefix - max(prefix - W, 0), at least 0, is min(prefix, W) (W > 0) or prefix, at least 0:
    # no subtraction that wraps for a negative prefix and a window near 2**63.
    windowed = tl.where(swa_window_size > 0, tl.minimum(prefix, swa_window_size), prefix)
    verify_len = tl.where(active, tl.maximum(windowed, 0), 0)
    write_len = tl.where(active, tl.maximum(extend, 0), 0)
    return verify_len, write_len


@triton.jit
def _plan_slice(
    r,  # [B] int64, global request indices of this slice
    in_slice,  # [B] bool
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
    verify_base,  # int64 scalar: verify total of the requests before this slice
    write_base,  # int64 scalar: write total of the requests before this slice
    HAS_LUT: tl.constexpr,
):
    """Plan one slice: offsets at ``r + 1`` (carrying the bases), seeds at ``r``. Returns the
    slice's verify and write sums."""
    pool_idx = tl.load(req_pool_indices_ptr + r, mask=in_slice, other=0)  # [B] int64
    prefix = tl.load(prefix_lens_ptr + r, mask=in_slice, other=0)  # [B] int64
    extend = tl.load(extend_seq_lens_ptr + r, mask=in_slice, other=0)  # [B] int64
    verify_len, write_len = _plan_lens(pool_idx, prefix, extend, swa_window_size)

    tl.store(verify_offsets_ptr + 1 + r, tl.cumsum(verify_len, axis=0) + verify_base, mask=in_slice)
    tl.store(write_offsets_ptr + 1 + r, tl.cumsum(write_len, axis=0) + write_base, mask=in_slice)

    # A seed is read only inside the table, [1, rows) x [1, width] for (row, prefix), whatever
    # the data: a row or prefix outside it (unchecked without validate=True) gives -1.
    in_table = (pool_idx > 0) & (pool_idx < req_to_token_rows) & (prefix <= req_to_token_width)
    has_seed = in_table & (prefix > 0) & (write_len > 0)
    slot = tl.load(
        req_to_token_ptr + pool_idx * req_to_token_stride0 + prefix - 1, mask=has_seed, other=0
    ).to(tl.int64)  # [B] int64
    if HAS_LUT:
        lut_idx = tl.minimum(slot, lut_len - 1)
        mapped = tl.load(lut_ptr + lut_idx, mask=has_seed & (slot >= 0), other=0)
        slot = tl.where(slot < 0, slot, mapped)
    tl.store(seed_ptr + r, tl.where(has_seed, slot, -1), mask=in_slice)
    return tl.sum(verify_len, axis=0), tl.sum(write_len, axis=0)


@triton.jit
def _plan_store_scalars(
    verify_num_valid_ptr,
    verify_enable_ptr,
    write_num_valid_reqs_ptr,
    verify_total,
    reqs_total,
    verify_capacity,
):
    tl.store(verify_num_valid_ptr, tl.minimum(verify_total, verify_capacity).to(tl.int32))
    tl.store(verify_enable_ptr, (verify_total <= verify_capacity).to(tl.int32))
    tl.store(write_num_valid_reqs_ptr, reqs_total.to(tl.int32))


@triton.jit(
    do_not_specialize=[
        "req_to_token_stride0",
        "req_to_token_rows",
        "req_to_token_width",
        "lut_len",
        "bs",
        "swa_window_size",
        "verify_capacity",
    ]
)
def _plan_offsets_kernel(
    req_pool_indices_ptr,  # [bs] int64, 0 = padding
    prefix_lens_ptr,  # [bs] int64
    extend_seq_lens_ptr,  # [bs] int64
    req_to_token_ptr,  # [rows, max_seq_len] int32: req_to_token_rows x req_to_token_width
    lut_ptr,  # [lut_len] int64 (unused without HAS_LUT)
    verify_offsets_ptr,  # [>= bs + 1] int64
    write_offsets_ptr,  # [>= bs + 1] int64
    seed_ptr,  # [>= bs] int64
    verify_num_valid_ptr,  # [1] int32
    verify_enable_ptr,  # [1] int32
    write_num_valid_reqs_ptr,  # [1] int32
    carry_ptr,  # [3] int64 in/out (unused without HAS_CARRY)
    req_to_token_stride0,
    req_to_token_rows,
    req_to_token_width,
    lut_len,
    bs,
    swa_window_size,
    verify_capacity,
    HAS_LUT: tl.constexpr,
    HAS_CARRY: tl.constexpr,
    BS_BLOCK: tl.constexpr,
):
    r = tl.arange(0, BS_BLOCK).to(tl.int64)  # [B] int64
    if HAS_CARRY:
        verify_base = tl.load(carry_ptr + 0)
        write_base = tl.load(carry_ptr + 1)
        reqs_base = tl.load(carry_ptr + 2)
    else:
        verify_base = 0
        write_base = 0
        reqs_base = 0
    tl.store(verify_offsets_ptr, verify_base)
    tl.store(write_offsets_ptr, write_base)
    verify_sum, write_sum = _plan_slice(
        r,
        r < bs,
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
    verify_total = verify_base + verify_sum
    reqs_total = reqs_base + bs
    _plan_store_scalars(
        verify_num_valid_ptr,
        verify_enable_ptr,
        write_num_valid_reqs_ptr,
        verify_total,
        reqs_total,
        verify_capacity,
    )
    if HAS_CARRY:
        tl.store(carry_ptr + 0, verify_total)
        tl.store(carry_ptr + 1, write_base + write_sum)
        tl.store(carry_ptr + 2, reqs_total)


def enqueue_plan_offsets(
    i: PlanInputs,
    o: PlanOutputs,
    *,
    bs_block: int = PLAN_BATCH_BLOCK,
    carry: torch.Tensor | None = None,
    head: Head | None = None,
) -> None:
    """The launch alone, for callers that already ran ``check_plan_args`` on these arguments
    (and ``bs <= bs_block``); ``head``: their ``checked_plan_head``, if the caller has it."""
    has_lut = i.full_to_swa_index_mapping is not None
    bound = bind_plan_offsets(has_lut=has_lut, bs_block=bs_block, has_carry=carry is not None)
    bound.with_head(
        (1,),
        head or plan_kernel_head(i, o, spare=o.out_verify_offsets),
        (carry if carry is not None else o.out_verify_offsets,),
        (*plan_kernel_scalars(i), i.bs, int(i.swa_window_size), int(i.verify_capacity)),
    )


def bind_plan_offsets(*, has_lut: bool, bs_block: int, has_carry: bool = False) -> BoundKernel:
    """The fixed-block kernel bound to these block parameters (``bs_block`` a power of two):
    called with a grid of one program and its arguments after a launch ``Head`` (the carry,
    or the verify offsets standing in; the table's row stride, rows and width, the LUT
    length, ``bs``, the window and the capacity), it is ``enqueue_plan_offsets``' launch."""
    return _bound(has_lut, has_carry, bs_block)


_bound = binder(_plan_offsets_kernel, "HAS_LUT", "HAS_CARRY", "BS_BLOCK")


def launch_plan_offsets_kernel(
    *, bs_block: int = PLAN_BATCH_BLOCK, carry: torch.Tensor | None = None, **keywords
) -> None:
    """Upstream's fixed-block launcher, same keywords (``req_pool_indices``, ``prefix_lens``,
    ``extend_seq_lens``, ``req_to_token``, ``full_to_swa_index_mapping``,
    ``out_verify_offsets_scratch``, ``out_write_offsets``, ``out_write_seed_slot_indices``,
    ``out_verify_num_valid``, ``out_verify_enable``, ``out_write_num_valid_reqs``,
    ``swa_window_size``, ``verify_capacity``): plan verify/write offsets, seed slots and the
    three scalars of one batch.

    ``write_req_capacity`` is ``len(out_write_seed_slot_indices)``; ``out_write_offsets`` must
    hold ``write_req_capacity + 1`` elements and ``out_verify_offsets_scratch`` at least
    ``bs + 1``. Elements past index ``bs`` are not written. ``bs_block`` is the register block
    launched (a power of two, at most ``PLAN_BATCH_BLOCK``); the call needs
    ``bs <= bs_block``. Precondition: ``prefix_lens[r] <= req_to_token.shape[1]`` wherever a
    seed is read. ``verify_capacity`` is at most ``INT32_MAX``; ``swa_window_size > 0``
    without a LUT applies the window and translates no seed. ``carry``: see the module
    docstring; ``None`` plans a whole batch.
    """
    # First, and here only: None, which check_plan_args reads as the dispatcher's call, is
    # refused too.
    bs_block = require_block(bs_block, "bs_block", PLAN_BATCH_BLOCK)
    i, o = bundle_plan_args(keywords, SCRATCH_NAME)
    try:  # (a non-tensor fails before the launch: at a check, or reading its address)
        check_plan_args(i, o, bs_block=bs_block, carry=carry)
        enqueue_plan_offsets(i, o, bs_block=bs_block, carry=carry)
    except (AttributeError, TypeError) as err:
        name_a_non_plan_tensor(err, i, o, SCRATCH_NAME)
        name_a_non_tensor(err, "plan_offsets", [(carry, "carry")], optional=("carry",))
        raise


launch_plan_offsets_kernel.__signature__ = plan_signature(
    SCRATCH_NAME,
    inspect.Parameter("bs_block", inspect.Parameter.KEYWORD_ONLY, default=PLAN_BATCH_BLOCK),
    inspect.Parameter("carry", inspect.Parameter.KEYWORD_ONLY, default=None),
)
