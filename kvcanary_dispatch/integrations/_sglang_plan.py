"""The any-bs ``launch_canary_plan_kernels`` and ``launch_plan_offsets_kernel`` for sglang.

sglang 0.5.23's ``plan/api.py`` runs, on a CUDA device: the Triton offsets kernel (capped at
``bs <= 4096``) into a verify-offsets scratch it allocates with ``torch.empty(4097)`` on every
call, then its CUDA-JIT entries kernel, which reads that scratch. Off CUDA it runs its torch
reference instead (no cap). The replacement built here keeps that routing (it asks sglang's own
``use_torch_reference`` and hands the torch-reference case to sglang's original function), and
on the kernel path runs ``kvcanary_dispatch.plan_offsets`` (any bs) into a scratch of ``bs + 1``
elements, then sglang's own entries step (``launch_plan_entries_kernel``, looked up in sglang's
module at call time). Like sglang's, the scratch is allocated per call from torch's caching
allocator on the current stream: calls on different streams or threads never share one, and
a call captured in a CUDA graph takes it from the graph's memory pool. Nothing of sglang is
imported here: the sglang module is handed in by the integration.

Both replacements read the two scalars as sglang's launchers read them, where
``plan_offsets`` alone is stricter (``sglang_window``, ``sglang_capacity``): the window as
``int(swa_window_size)``, below 0 as full attention (0); a ``verify_capacity`` counted up to
``2**31 - 1`` (``INT32_MAX``), the most the int32 ``verify_num_valid`` holds, an integer as
its int and a float as sglang's kernel takes it (rounded to float32).
"""

from __future__ import annotations

import functools
import math
import operator
import re
import struct
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch

from kvcanary_dispatch.plan import launch_plan_offsets_kernel_any_bs, plan_bundled
from kvcanary_kernels._checks import (
    PREFIX,
    CapacityError,
    require_contiguous,
    require_dim,
    require_dtype,
    require_len,
    require_same_device,
    require_tensor,
)
from kvcanary_kernels.args import PlanInputs, PlanOutputs
from kvcanary_kernels.plan_checks import INT32_MAX

# plan_offsets' output names, and the fields of sglang's plans that the patch passes as them
SGLANG_OUTPUT_NAMES = {
    "out_write_offsets": "write_plan_out.write_offsets",
    "out_write_seed_slot_indices": "write_plan_out.write_seed_slot_indices",
    "out_write_num_valid_reqs": "write_plan_out.write_num_valid_reqs",
    "out_verify_num_valid": "verify_plan_out.verify_num_valid",
    "out_verify_enable": "verify_plan_out.enable",
}
SCRATCH = "verify_plan_out.verify_slot_indices"  # the scratch is made on its device
SGLANG_CAPACITY_REMEDY = (
    "allocate write_plan_out for at least bs requests "
    "(WritePlan.allocate(write_req_capacity=...)); in a server, "
    'kvcanary_dispatch.integrations.sglang.apply(policy="grow" or "skip") grows or skips the '
    "eager steps that outgrow it (not the steps captured in a CUDA graph)"
)
_PLAN_WORDS = re.compile(
    rf"(?<=^{re.escape(PREFIX)})plan_offsets\b|\b(?:{'|'.join(SGLANG_OUTPUT_NAMES)})\b"
)


def to_sglang_words(err: Exception) -> None:
    """Rewrite the message of ``err`` (a refusal of ``plan_offsets``) in place, in the terms of
    ``launch_canary_plan_kernels``' caller: the plans' fields for ``plan_offsets``' outputs,
    the function for ``plan_offsets``, and for a ``CapacityError`` the write plan's allocation
    as the remedy. Only ``err.args`` changes: its type, traceback and notes stay. An error
    whose ``args`` are not one message is left as it is."""
    if len(err.args) != 1 or not isinstance(err.args[0], str):
        return
    text = err.args[0]
    if isinstance(err, CapacityError):  # "<what exceeds what>; <plan_offsets' remedy>"
        text = f"{text.split('; ', 1)[0]}; {SGLANG_CAPACITY_REMEDY}"
    err.args = (
        _PLAN_WORDS.sub(
            lambda m: SGLANG_OUTPUT_NAMES.get(m[0], "launch_canary_plan_kernels"), text
        ),
    )


def sglang_window(window: Any) -> Any:
    """``swa_window_size`` as sglang's launcher reads it, ``int(swa_window_size)`` (whatever
    ``int`` takes), with a window below 0, which sglang's kernels read as full attention, as
    0. What ``int`` refuses (``None``, NaN, an infinity) is returned as it is, for
    ``plan_offsets`` to refuse in its order of checks, naming ``swa_window_size``."""
    try:
        return max(int(window), 0)
    except (TypeError, ValueError, OverflowError):
        return window


def sglang_capacity(capacity: Any) -> Any:
    """``verify_capacity`` as sglang's offsets kernel compares the verify total with it and
    stores its count, at most ``INT32_MAX`` (the most its int32 count holds): an integer (a
    bool, a numpy integer) as its int; a float rounded to float32, as sglang's kernel takes
    it, then the integer at or below it (the kernel stores the count truncated). sglang's
    kernel rounds the verify total to float32 too, so a float capacity gives sglang's plan
    whenever that total is below ``2**24``. A negative float, NaN, a tensor (whose read would
    be a sync) and anything else as it is: ``plan_offsets`` refuses them among its scalars,
    after the tensors' contiguity and dtypes (a negative number with sglang's ``ValueError``
    and text, where sglang checks it)."""
    if isinstance(capacity, float) and capacity >= 0:  # (NaN and negatives as they are)
        if capacity >= INT32_MAX:
            return INT32_MAX
        (as_float32,) = struct.unpack("f", struct.pack("f", capacity))
        return min(math.floor(as_float32), INT32_MAX)
    if hasattr(type(capacity), "__index__") and not isinstance(capacity, torch.Tensor):
        return min(operator.index(capacity), INT32_MAX)
    return capacity


def make_launch_plan_offsets_kernel() -> Callable[..., None]:
    """sglang's ``launch_plan_offsets_kernel`` without its ``bs <= 4096`` cap:
    ``kvcanary_dispatch.launch_plan_offsets_kernel`` (same keywords), its window and capacity
    read as sglang reads them (``sglang_window``, ``sglang_capacity``). sglang's own
    ``launch_canary_plan_kernels``, where a module outside sglang kept it from before
    ``apply()``, calls this one with the arguments its caller passed."""

    @functools.wraps(launch_plan_offsets_kernel_any_bs)  # its keywords, which apply() checks
    def launch(*, swa_window_size: Any, verify_capacity: Any, **keywords: Any) -> None:
        launch_plan_offsets_kernel_any_bs(
            swa_window_size=sglang_window(swa_window_size),
            verify_capacity=sglang_capacity(verify_capacity),
            **keywords,
        )

    launch.__name__ = launch.__qualname__ = "launch_plan_offsets_kernel"
    launch.__doc__ = (
        "kvcanary-dispatch's any-bs replacement for sglang's launch_plan_offsets_kernel, its "
        "window and capacity read as sglang reads them (see "
        "kvcanary_dispatch.integrations.sglang).\n\n" + (launch.__doc__ or "")
    )
    return launch


_ENTRY_VECTORS = (  # the verify plan's fields that sglang's entries step writes
    "verify_slot_indices",
    "verify_expected_tokens",
    "verify_expected_positions",
    "verify_prev_slot_indices",
)
_FN = "launch_canary_plan_kernels"
_PLANS = {  # keyword: (sglang's class, its allocate()'s capacity keyword, the fields read)
    "verify_plan_out": (
        "VerifyPlan",
        "verify_capacity",
        (*_ENTRY_VECTORS, "verify_num_valid", "enable"),
    ),
    "write_plan_out": (
        "WritePlan",
        "write_req_capacity",
        ("write_offsets", "write_seed_slot_indices", "write_num_valid_reqs"),
    ),
}


def check_plan(plan: Any, name: str) -> None:
    """A ``TypeError`` naming ``name`` (a key of ``_PLANS``) unless ``plan`` has every field of
    sglang's plan class that the patch reads (a ``None`` plan has none), and for the verify
    plan unless its ``verify_slot_indices``, whose device routes the call, is a tensor."""
    cls, capacity, fields = _PLANS[name]
    missing = next((f for f in fields if not hasattr(plan, f)), None)
    if missing is not None:
        raise TypeError(
            f"{PREFIX}{_FN} {name} must be sglang's {cls}, got {type(plan).__name__} "
            f"(no {missing}); pass a {cls}.allocate({capacity}=..., device=...)"
        )
    if name == "verify_plan_out":
        require_tensor(plan.verify_slot_indices, _FN, SCRATCH)


def check_entries_args(verify_plan_out: Any, bs: int, pool: Any, valid_lens: Any,
                       scalars: dict[str, Any]) -> list[int]:  # fmt: skip
    """What sglang's entries step checks and the plan does not, so that a call it would refuse
    is refused before the plan writes anything: the verify plan's four entry vectors (int64,
    1-D, one length), the expected-token ``pool`` (int32, 2-D) with its ``valid_lens`` (int64,
    ``[bs]``, required with it), all contiguous and on the entry vectors' device, and
    ``scalars`` (name -> value) as the int32 each is passed as. Returns their ints, in order."""
    # (tensor, name, dtype, rank): the four entry vectors, then the pool and its lengths
    plan = verify_plan_out
    checked = [(getattr(plan, n), f"verify_plan_out.{n}", torch.int64, 1) for n in _ENTRY_VECTORS]
    if pool is not None:
        if valid_lens is None:  # sglang's text
            raise ValueError(
                f"{PREFIX}launch_plan_entries_kernel requires req_to_verify_expected_tokens_"
                "valid_lens when req_to_verify_expected_tokens is set"
            )
        checked += [
            (pool, "req_to_verify_expected_tokens", torch.int32, 2),
            (valid_lens, "req_to_verify_expected_tokens_valid_lens", torch.int64, 1),
        ]
    for t, name, dtype, rank in checked:
        require_tensor(t, _FN, name)
        require_contiguous([(t, name)])
        require_dtype(t, name, dtype)
        require_dim(t, name, rank)
    first = checked[0][0]
    for t, name, _, _ in checked[1:4]:
        require_len(t, name, int(first.shape[0]))
    if pool is not None:
        require_len(valid_lens, checked[5][1], bs)
    require_same_device(first, checked[0][1], ((t, name) for t, name, _, _ in checked[1:]))
    ints = []
    for name, value in scalars.items():
        try:  # as sglang reads it, int()'s refusal kept, naming the argument
            ints.append(int(value))
        except (TypeError, ValueError) as err:
            raise type(err)(f"{PREFIX}{_FN} {name}={value!r}: {err}") from None
        if not -INT32_MAX - 1 <= ints[-1] <= INT32_MAX:
            raise ValueError(
                f"{PREFIX}{_FN} {name}={ints[-1]} does not fit the int32 sglang's entries kernel "
                f"takes; pass a value in [{-INT32_MAX - 1}, {INT32_MAX}]"
            )
    return ints


def _compares_above_zero(window: Any) -> bool:
    """``window > 0``, as sglang tests it first; ``False`` where that comparison raises (a
    ``None`` window), which ``check_entries_args`` then refuses naming it."""
    try:
        return bool(window > 0)
    except TypeError:
        return False


def make_launch_canary_plan_kernels(api: ModuleType, original: Callable[..., None]) -> Callable:
    """sglang's ``launch_canary_plan_kernels`` without its batch-size cap.

    ``api`` is sglang's ``sglang.kernels.ops.kv_canary.plan.api`` module; ``original`` its
    ``launch_canary_plan_kernels``. The returned function takes the same keywords. Contract:
    where sglang's own ``use_torch_reference`` picks the torch reference (any non-CUDA device),
    ``original`` runs unchanged (a verify plan without a tensor ``verify_slot_indices``, whose
    device decides that, is refused first: ``check_plan``). Otherwise it checks what sglang
    checks (the SWA LUT, the verify capacity against the plan), then the write plan as the
    verify plan and ``req_pool_indices`` (a tensor with a length), and what sglang's entries
    step would check after the offsets (``check_entries_args``), plans the offsets with
    ``kvcanary_dispatch.plan_offsets`` (a ``swa_window_size`` below 0 as 0: sglang reads both as
    full attention) into a fresh scratch of ``bs + 1`` elements (as sglang allocates its own,
    per call), which writes ``write_plan_out.write_offsets[0:bs+1]``, then zeroes the rest of
    ``write_offsets`` (sglang zeroes them all first; here a refused call changes nothing) and
    calls ``api.launch_plan_entries_kernel`` with the scratch: the outputs equal sglang's for
    every bs sglang accepts, and sglang's torch reference for larger ones, for every step of at
    most ``2**31 - 1`` verify entries. A verify plan may be longer (sglang allocates three
    entries a pool slot: more than ``2**31 - 1`` for a pool of more than 715 827 882 slots); the
    plan then counts up to ``2**31 - 1`` only, so a step with more verify entries turns its
    verify off, where sglang's int32 ``verify_num_valid`` would wrap and leave it on. No host
    sync; CUDA-graph capturable. The plan's refusals (``TypeError``, ``ValueError``) name the
    plans' fields the caller passed (``write_plan_out.write_offsets``,
    ``verify_plan_out.enable``, ...) where ``plan_offsets`` names its own parameters, and a
    batch past the write plan's capacity (``CapacityError``) names its allocation as the fix.
    """

    def launch_canary_plan_kernels(
        *,
        verify_plan_out: Any,
        write_plan_out: Any,
        req_pool_indices: torch.Tensor,
        prefix_lens: torch.Tensor,
        extend_seq_lens: torch.Tensor,
        req_to_token: torch.Tensor,
        swa_window_size: int,
        full_to_swa_index_mapping: torch.Tensor | None,
        verify_capacity: int,
        req_to_verify_expected_tokens: torch.Tensor | None,
        req_to_verify_expected_tokens_valid_lens: torch.Tensor | None,
        kv_token_id_vs_position_offset: int,
    ) -> None:
        check_plan(verify_plan_out, "verify_plan_out")
        device = verify_plan_out.verify_slot_indices.device
        if api.use_torch_reference(device):
            original(
                verify_plan_out=verify_plan_out,
                write_plan_out=write_plan_out,
                req_pool_indices=req_pool_indices,
                prefix_lens=prefix_lens,
                extend_seq_lens=extend_seq_lens,
                req_to_token=req_to_token,
                swa_window_size=swa_window_size,
                full_to_swa_index_mapping=full_to_swa_index_mapping,
                verify_capacity=verify_capacity,
                req_to_verify_expected_tokens=req_to_verify_expected_tokens,
                req_to_verify_expected_tokens_valid_lens=req_to_verify_expected_tokens_valid_lens,
                kv_token_id_vs_position_offset=kv_token_id_vs_position_offset,
            )
            return
        if _compares_above_zero(swa_window_size) and full_to_swa_index_mapping is None:
            raise ValueError(
                "kv-canary: launch_canary_plan_kernels requires full_to_swa_index_mapping "
                "when swa_window_size > 0"
            )
        plan_capacity = int(verify_plan_out.verify_slot_indices.shape[0])
        if verify_capacity != plan_capacity:
            raise ValueError(
                f"kv-canary: launch_canary_plan_kernels verify_capacity={verify_capacity} does "
                f"not match verify_plan_out.verify_slot_indices.shape[0]={plan_capacity}"
            )
        check_plan(write_plan_out, "write_plan_out")  # (after sglang's own two checks)
        require_tensor(req_pool_indices, _FN, "req_pool_indices")
        if req_pool_indices.dim() == 0:  # (it has no length: bs)
            require_dim(req_pool_indices, "req_pool_indices", 1)
        bs = int(req_pool_indices.shape[0])
        offset, window = check_entries_args(
            verify_plan_out,
            bs,
            req_to_verify_expected_tokens,
            req_to_verify_expected_tokens_valid_lens,
            {
                "kv_token_id_vs_position_offset": kv_token_id_vs_position_offset,
                "swa_window_size": swa_window_size,
            },
        )
        scratch = torch.empty(bs + 1, dtype=torch.int64, device=device)
        inputs = PlanInputs(
            req_pool_indices,
            prefix_lens,
            extend_seq_lens,
            req_to_token,
            full_to_swa_index_mapping,
            sglang_window(swa_window_size),
            # == verify_capacity (which sglang also takes as a float or a bool), at most what
            # the int32 verify_num_valid counts (sglang allocates 3 entries a pool slot)
            sglang_capacity(plan_capacity),
        )
        outputs = PlanOutputs(
            scratch,
            write_plan_out.write_offsets,
            write_plan_out.write_seed_slot_indices,
            verify_plan_out.verify_num_valid,
            verify_plan_out.enable,
            write_plan_out.write_num_valid_reqs,
        )
        try:  # writes write_offsets[0:bs+1], once every check passed
            plan_bundled(inputs, outputs, verify_offsets_name=SCRATCH)
        except (TypeError, ValueError) as err:
            to_sglang_words(err)
            raise
        write_plan_out.write_offsets[bs + 1 :].zero_()  # as sglang's zeroing of them all first
        api.launch_plan_entries_kernel(
            req_pool_indices=req_pool_indices,
            prefix_lens=prefix_lens,
            req_to_token=req_to_token,
            full_to_swa_index_mapping=full_to_swa_index_mapping,
            verify_offsets_scratch=scratch,
            verify_enable=verify_plan_out.enable,
            req_to_verify_expected_tokens=req_to_verify_expected_tokens,
            req_to_verify_expected_tokens_valid_lens=req_to_verify_expected_tokens_valid_lens,
            out_verify_slot_indices=verify_plan_out.verify_slot_indices,
            out_verify_expected_tokens=verify_plan_out.verify_expected_tokens,
            out_verify_expected_positions=verify_plan_out.verify_expected_positions,
            out_verify_prev_slot_indices=verify_plan_out.verify_prev_slot_indices,
            kv_token_id_vs_position_offset=offset,
            swa_window_size=window,
        )

    launch_canary_plan_kernels.__doc__ = (
        "kvcanary-dispatch's any-bs replacement for sglang's launch_canary_plan_kernels "
        "(see kvcanary_dispatch.integrations.sglang).\n\n" + (original.__doc__ or "")
    )
    return launch_canary_plan_kernels
