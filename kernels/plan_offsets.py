"""Fixed-block plan of the verify and write CSR offsets for one forward step.

A single program holds the whole batch in one ``BS_BLOCK``-lane register block and prefix-sums
it with ``tl.cumsum``, hence the cap ``bs <= BS_BLOCK``. An optional ``carry`` (int64 ``[3]``:
verify total, write total and requests before this launch) lets consecutive launches over
consecutive slices of one batch produce the whole batch's offsets and scalars.
"""

from __future__ import annotations

import inspect
from operator import attrgetter

import torch
import triton
import triton.language as tl

from ._checks import (
    PREFIX,
    CapacityError,
    require_block,
    require_contiguous,
    require_dim,
    require_dtype,
    require_len,
    require_min_len,
    require_same_device,
    tensor_refusal,
)
from ._launch import BoundKernel, Head, binder, make_head
from .args import (
    PLAN_INPUT_NAMES,
    PLAN_OUTPUT_NAMES,
    SCRATCH_NAME,
    PlanInputs,
    PlanOutputs,
    bundle_plan_args,
    name_a_non_plan_tensor,
    plan_kernel_head,
    plan_kernel_scalars,
    plan_signature,
)

PLAN_BATCH_BLOCK = 4096
INT32_MAX = 2**31 - 1  # the int32 scalar outputs count at most this far
INT64_MAX = 2**63 - 1  # the kernels take their integers as int64 at most


def check_verify_capacity(verify_capacity: int, fix: str = "") -> None:
    """``0 <= verify_capacity <= INT32_MAX`` (the int32 ``out_verify_num_valid`` counts no
    further), else a ``ValueError`` naming the value and the fix (``fix`` adds to it)."""
    if not verify_capacity >= 0:  # also NaN
        raise ValueError(f"{PREFIX}verify_capacity must be non-negative, got {verify_capacity}")
    if verify_capacity > INT32_MAX:
        raise ValueError(
            f"{PREFIX}verify_capacity={verify_capacity} exceeds {INT32_MAX}: the int32 "
            f"out_verify_num_valid cannot count past it; pass verify_capacity="
            f"min(verify_capacity, {INT32_MAX}) (a step with more verify entries turns its "
            f"verify off){fix}"
        )


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

    has_seed = (pool_idx != 0) & (prefix > 0) & (write_len > 0)
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
    req_to_token_ptr,  # [rows, max_seq_len] int32
    lut_ptr,  # [lut_len] int64 (unused without HAS_LUT)
    verify_offsets_ptr,  # [>= bs + 1] int64
    write_offsets_ptr,  # [>= bs + 1] int64
    seed_ptr,  # [>= bs] int64
    verify_num_valid_ptr,  # [1] int32
    verify_enable_ptr,  # [1] int32
    write_num_valid_reqs_ptr,  # [1] int32
    carry_ptr,  # [3] int64 in/out (unused without HAS_CARRY)
    req_to_token_stride0,
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


# The plan kernels' 11 tensors, in their signature's order (plan_kernel_head's, and upstream's
# keywords'): the dtype and the rank of each.
_L, _I = torch.int64, torch.int32
_HEAD_DTYPES = (_L, _L, _L, _I, _L, _L, _L, _L, _I, _I, _I)
_HEAD_RANKS = (1, 1, 1, 2, 1, 1, 1, 1, 1, 1, 1)


def check_plan_args(
    i: PlanInputs,
    o: PlanOutputs,
    *,
    bs_block: int | None,
    carry: torch.Tensor | None = None,
    verify_offsets_name: str = SCRATCH_NAME,
) -> int:
    """The launcher's checks; returns ``bs``. ``bs_block=None`` skips the block cap (for
    callers that split the batch themselves); ``verify_offsets_name`` is the name messages
    give ``o.out_verify_offsets``."""
    lut = i.full_to_swa_index_mapping
    names = (*PLAN_INPUT_NAMES, verify_offsets_name, *PLAN_OUTPUT_NAMES[1:])
    tensors = (  # (tensor, name, dtype, rank): the 11 kernel tensors (the LUT may be None)
        *zip((*i[:5], *o), names, _HEAD_DTYPES, _HEAD_RANKS, strict=True),
        (carry, "carry", torch.int64, 1),
    )
    # sglang's launcher's order, so that a call with several faults is refused for the one it
    # names first: contiguity, dtypes, the sizes and scalars, then each tensor's rank and length.
    require_contiguous((t, name) for t, name, _, _ in tensors)
    for t, name, dtype, _ in tensors:
        require_dtype(t, name, dtype)
    for t, name, _, rank in tensors:  # (sizes are read first: a 0-d tensor has none)
        if t is not None and t.dim() == 0:
            require_dim(t, name, rank)

    bs = i.bs
    if bs_block is not None and not 0 <= bs <= bs_block:  # (the block checked by the launcher)
        raise ValueError(f"{PREFIX}offsets kernel bs must be in [0, {bs_block}], got {bs}")
    write_offsets_len = int(o.out_write_offsets.shape[0])
    write_req_capacity = int(o.out_write_seed_slot_indices.shape[0])
    if write_offsets_len <= 0:
        raise ValueError(f"{PREFIX}write_offsets_len must be positive, got {write_offsets_len}")
    for value, name in (
        (i.verify_capacity, "verify_capacity"),
        (i.swa_window_size, "swa_window_size"),
    ):
        if isinstance(value, torch.Tensor):  # its value would be read back: a sync
            raise tensor_refusal(f"{PREFIX}{name} must be a Python number", name)
        if isinstance(value, bool) or not hasattr(type(value), "__index__"):  # None, floats
            raise TypeError(
                f"{PREFIX}{name} must be an int, got {value!r} ({type(value).__name__}); pass "
                f"a non-negative int{' (0 for no window)' if name == 'swa_window_size' else ''}"
            )
    check_verify_capacity(i.verify_capacity)
    if i.swa_window_size < 0:
        raise ValueError(f"{PREFIX}swa_window_size must be non-negative, got {i.swa_window_size}")
    if i.swa_window_size > INT64_MAX:
        raise ValueError(
            f"{PREFIX}swa_window_size={i.swa_window_size} exceeds {INT64_MAX}: the kernels take "
            f"it as int64; pass a window of at most {INT64_MAX} (any window at least as long "
            f"as the longest prefix plans the same)"
        )

    if lut is not None and lut.shape[0] == 0:
        require_min_len(lut, "full_to_swa_index_mapping", 1)

    lengths = {"prefix_lens": bs, "extend_seq_lens": bs, "carry": 3}  # and 1 a scalar output
    lengths.update(dict.fromkeys(PLAN_OUTPUT_NAMES[3:], 1))
    for t, name, _, rank in tensors:  # each tensor's rank, then its length, in turn
        require_dim(t, name, rank)
        if name == verify_offsets_name:
            if verify_offsets_name != SCRATCH_NAME and _outgrown(t, o, bs):
                raise _capacity_error(bs, write_req_capacity)
            require_min_len(t, name, bs + 1)
        elif t is not None and name in lengths:
            require_len(t, name, lengths[name])
    if write_offsets_len != write_req_capacity + 1:
        raise ValueError(
            f"{PREFIX}write_offsets_len must equal write_req_capacity + 1, got "
            f"{write_offsets_len} and {write_req_capacity}"
        )
    if bs > write_req_capacity:
        raise _capacity_error(bs, write_req_capacity)
    require_same_device(
        o.out_verify_offsets, verify_offsets_name, ((t, name) for t, name, _, _ in tensors)
    )
    return bs


def _capacity_error(bs: int, write_req_capacity: int) -> CapacityError:
    return CapacityError(f"{PREFIX}bs={bs} exceeds write_req_capacity={write_req_capacity}")


def _outgrown(verify_offsets: torch.Tensor, o: PlanOutputs, bs: int) -> bool:
    """Whether ``bs`` outgrows a whole output set sized for fewer requests (``PlanBuffers``):
    the verify offsets too short for it and a well-formed write pair (1-D, one offset more
    than seeds) too, so that the call is the ``CapacityError`` it is, not a length error."""
    writes, seeds = o.out_write_offsets, o.out_write_seed_slot_indices
    return (
        verify_offsets.shape[0] < bs + 1
        and writes.dim() == 1
        and seeds.dim() == 1
        and writes.shape[0] == seeds.shape[0] + 1
        and bs > seeds.shape[0]
    )


_DEVICE, _DTYPE = attrgetter("device"), attrgetter("dtype")
_STRIDE, _ADDRESS = torch.Tensor.stride, torch.Tensor.data_ptr
_UNIT_STRIDE = {(1,)}
_PLAIN = {torch.Tensor}


def checked_plan_head(
    i: PlanInputs, o: PlanOutputs, verify_offsets_name: str = SCRATCH_NAME
) -> Head:
    """``check_plan_args`` with no block cap and no carry, then the plan kernels' launch
    ``Head`` (``plan_kernel_head``, the LUT slot standing in with ``o.out_verify_offsets``).
    A valid call of plain tensors and ``int`` scalars costs one pass over its tensors
    (``_fit_head``); any other goes through the ordered checks, which raise the error naming
    what is wrong."""
    head = _fit_head(i, o)
    if head is None:
        check_plan_args(i, o, bs_block=None, verify_offsets_name=verify_offsets_name)
        head = plan_kernel_head(i, o, spare=o.out_verify_offsets)
    return head


def _fit_head(i: PlanInputs, o: PlanOutputs) -> Head | None:
    """The launch ``Head`` of a call that ``check_plan_args`` (no block cap, no carry) passes,
    checked and built from one read of each tensor's type, dtype, stride, device and address,
    the element counts read kept as its ``sizes`` (``plan_head_sizes``);
    ``None`` for any other call (also when an argument is not a plain ``torch.Tensor``: a
    subclass may answer ``is_contiguous``, ``dim`` and ``shape`` apart from ``stride`` and
    ``numel``; nothing here raises), which then goes through the ordered checks. A vector
    passes only with stride ``(1,)``: rank and contiguity in one read (a one-element vector
    of another stride, contiguous too, takes the ordered checks). Lengths are read only once
    every rank is known to be right."""
    rpi, prefix, extend, table, lut, window, capacity = i
    ref, write, seeds, num_valid, enable, num_reqs = o
    # The 11 kernel tensors in signature order, the verify offsets standing in for no LUT.
    args = (rpi, prefix, extend, table, ref if lut is None else lut, *o)
    try:
        if not (
            set(map(type, args)) == _PLAIN
            and tuple(map(_DTYPE, args)) == _HEAD_DTYPES
            and set(map(_STRIDE, (*args[:3], *args[4:]))) == _UNIT_STRIDE
            and len(set(map(_DEVICE, args))) == 1
            and table.dim() == 2
            and table.is_contiguous()
        ):
            return None
    except (AttributeError, TypeError, RuntimeError):  # a non-tensor, a nested tensor
        return None
    bs, cap, ref_len = rpi.numel(), seeds.numel(), ref.numel()  # every vector is 1-D here
    lut_len = 0 if lut is None else lut.numel()
    if not (
        capacity.__class__ is int
        and 0 <= capacity <= INT32_MAX
        and window.__class__ is int
        and 0 <= window <= INT64_MAX
        and write.numel() == cap + 1
        and bs <= cap
        and prefix.numel() == extend.numel() == bs < ref_len
        and (lut is None or lut_len >= 1)
        and num_valid.numel() == enable.numel() == num_reqs.numel() == 1
    ):
        return None
    sizes = (bs, cap, ref_len, table.numel(), lut_len)  # as plan_head_sizes
    return make_head(args, tuple(map(_ADDRESS, args)), ref.get_device(), sizes)


def plan_head_sizes(i: PlanInputs, o: PlanOutputs) -> tuple[int, int, int, int, int]:
    """The element counts that fix where a checked plan call's tensors end: ``bs`` (the three
    input vectors), the write capacity (the seed slots; the write offsets hold one more), the
    verify offsets', the token table's and the LUT's (0 without one). A plan ``Head`` built by
    ``checked_plan_head``'s one pass carries them as its ``sizes``."""
    lut = i.full_to_swa_index_mapping
    return (
        i.bs,
        o.out_write_seed_slot_indices.numel(),
        o.out_verify_offsets.numel(),
        i.req_to_token.numel(),
        0 if lut is None else lut.numel(),
    )


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
    or the verify offsets standing in; the table's row stride, the LUT length, ``bs``, the
    window and the capacity), it is ``enqueue_plan_offsets``' launch."""
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
        raise


launch_plan_offsets_kernel.__signature__ = plan_signature(
    SCRATCH_NAME,
    inspect.Parameter("bs_block", inspect.Parameter.KEYWORD_ONLY, default=PLAN_BATCH_BLOCK),
    inspect.Parameter("carry", inspect.Parameter.KEYWORD_ONLY, default=None),
)
