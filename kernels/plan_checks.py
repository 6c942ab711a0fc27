"""The plan kernels' argument checks, shared by their launchers and the dispatcher: the
ordered checks of upstream's launcher (``check_plan_args``, which raise the error naming what
is wrong) and the one pass that checks a valid call and builds its launch ``Head``
(``checked_plan_head``)."""

from __future__ import annotations

from operator import attrgetter

import torch

from ._checks import (
    PREFIX,
    CapacityError,
    require_contiguous,
    require_dim,
    require_dtype,
    require_len,
    require_min_len,
    require_same_device,
    tensor_refusal,
)
from ._launch import Head, make_head
from .args import (
    PLAN_INPUT_NAMES,
    PLAN_OUTPUT_NAMES,
    SCRATCH_NAME,
    PlanInputs,
    PlanOutputs,
    plan_kernel_head,
)

PLAN_BATCH_BLOCK = 4096  # the fixed-block plan launcher's largest block (kernels/plan_offsets.py)
INT32_MAX = 2**31 - 1  # the int32 scalar outputs count at most this far
INT64_MAX = 2**63 - 1  # the kernels take their integers as int64 at most


# The fixes the refusals below name
_WRITE_LEN_FIX = "size out_write_offsets to len(out_write_seed_slot_indices) + 1"


def _non_negative_fix(name: str) -> str:
    """The fix named where ``verify_capacity`` or ``swa_window_size`` is not a non-negative
    int."""
    return "pass a non-negative int" + (" (0 for no window)" if name == "swa_window_size" else "")


def require_non_negative(value: float, name: str) -> None:
    """A ``ValueError`` naming ``name``'s value and the fix unless ``value >= 0`` (NaN too)."""
    if not value >= 0:
        raise ValueError(
            f"{PREFIX}{name} must be non-negative, got {value}; {_non_negative_fix(name)}"
        )


def check_verify_capacity(verify_capacity: int, fix: str = "") -> None:
    """``0 <= verify_capacity <= INT32_MAX`` (the int32 ``out_verify_num_valid`` counts no
    further), else a ``ValueError`` naming the value and the fix (``fix`` adds to the upper
    bound's)."""
    require_non_negative(verify_capacity, "verify_capacity")
    if verify_capacity > INT32_MAX:
        raise ValueError(
            f"{PREFIX}verify_capacity={verify_capacity} exceeds {INT32_MAX}: the int32 "
            f"out_verify_num_valid cannot count past it; pass verify_capacity="
            f"min(verify_capacity, {INT32_MAX}) (a step with more verify entries turns its "
            f"verify off){fix}"
        )


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
        raise ValueError(
            f"{PREFIX}offsets kernel bs must be in [0, {bs_block}], got {bs}; this fixed-block "
            f"launcher takes bs <= bs_block <= {PLAN_BATCH_BLOCK}: call "
            "kvcanary_dispatch.plan_offsets, which takes any batch size"
        )
    write_offsets_len = int(o.out_write_offsets.shape[0])
    write_req_capacity = int(o.out_write_seed_slot_indices.shape[0])
    if write_offsets_len <= 0:
        raise ValueError(
            f"{PREFIX}write_offsets_len must be positive, got {write_offsets_len}; "
            f"{_WRITE_LEN_FIX} elements"
        )
    for value, name in (
        (i.verify_capacity, "verify_capacity"),
        (i.swa_window_size, "swa_window_size"),
    ):
        if isinstance(value, torch.Tensor):  # its value would be read back: a sync
            raise tensor_refusal(f"{PREFIX}{name} must be a Python number", name)
        if isinstance(value, int | float) and not isinstance(value, bool) and value < 0:
            require_non_negative(value, name)  # a negative float too, as sglang refuses it
        if isinstance(value, bool) or not hasattr(type(value), "__index__"):  # None, floats
            raise TypeError(
                f"{PREFIX}{name} must be an int, got {value!r} ({type(value).__name__}); "
                f"{_non_negative_fix(name)}"
            )
    check_verify_capacity(i.verify_capacity)
    require_non_negative(i.swa_window_size, "swa_window_size")
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
            f"{write_offsets_len} and {write_req_capacity}; {_WRITE_LEN_FIX} = "
            f"{write_req_capacity + 1} elements"
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
