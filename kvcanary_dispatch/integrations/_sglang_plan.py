"""The any-bs ``launch_canary_plan_kernels`` for sglang, and its capture-safe scratch.

sglang 0.5.23's ``plan/api.py`` runs, on a CUDA device: the Triton offsets kernel (capped at
``bs <= 4096``) into a verify-offsets scratch it allocates with ``torch.empty(4097)`` on every
call, then its CUDA-JIT entries kernel, which reads that scratch. Off CUDA it runs its torch
reference instead (no cap). The replacement built here keeps that routing (it asks sglang's own
``use_torch_reference`` and hands the torch-reference case to sglang's original function), and
on the kernel path runs ``kvcanary_dispatch.plan_offsets`` (any bs) into a scratch of at least
``bs + 1`` elements, then sglang's own entries step (``launch_plan_entries_kernel``, looked up
in sglang's module at call time). Nothing of sglang is imported here: the sglang module is
handed in by the integration.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch

from kvcanary_dispatch.plan import plan_bundled
from kvcanary_kernels.args import PlanInputs, PlanOutputs

# sglang 0.5.23 allocates its scratch with its _PLAN_BS_BLOCK_SIZE + 1 = 4097 elements: the first
# scratch on a device is at least that large, so every capture sglang itself supports fits.
MIN_SCRATCH_ELEMENTS = 4097


def _normalize(device: torch.device | str | int) -> torch.device:
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def _capturing(device: torch.device) -> bool:
    if device.type != "cuda":
        return False
    with torch.cuda.device(device):
        return torch.cuda.is_current_stream_capturing()


class VerifyOffsetsScratch:
    """One int64 verify-offsets scratch per device, shared by every plan call on it.

    Contract: ``get(device, n)`` returns a contiguous int64 tensor of at least ``n`` elements
    whose address stays valid for the life of the process. It is grown (to at least twice its
    size) only outside CUDA-graph capture; growing during capture is a ``RuntimeError`` that
    names ``reserve_verify_offsets_scratch``. A grown-out scratch is retired, never freed, so a
    graph that captured its address keeps writing to memory it owns. Calls on one device share
    the scratch, so they must be ordered (one stream, as sglang's forward is); the plan kernels
    of one call finish with it before the next call's start on that stream.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._current: dict[torch.device, torch.Tensor] = {}
        self._retired: list[torch.Tensor] = []

    def get(self, device: torch.device | str | int, elements: int) -> torch.Tensor:
        """A scratch of ``>= elements`` int64 elements on ``device`` (see the class)."""
        device = _normalize(device)
        with self._lock:
            current = self._current.get(device)
            if current is not None and current.numel() >= elements:
                return current
            if current is not None and _capturing(device):
                raise RuntimeError(
                    f"kvcanary-dispatch: launch_canary_plan_kernels needs a verify-offsets "
                    f"scratch of {elements} elements on {device} while a CUDA graph is being "
                    f"captured, but the cached one holds {current.numel()}; growing it now "
                    "would give the graph a buffer that eager calls no longer use. Call "
                    "kvcanary_dispatch.integrations.sglang.reserve_verify_offsets_scratch("
                    f"{str(device)!r}, max_bs={elements - 1}) before capturing"
                )
            size = max(elements, MIN_SCRATCH_ELEMENTS)
            if current is not None:
                size = max(size, 2 * current.numel())
                self._retired.append(current)
            # The first scratch of a device may be allocated during a capture (from the graph's
            # pool); it is never freed, so the graph's baked address stays owned.
            fresh = torch.empty(size, dtype=torch.int64, device=device)
            self._current[device] = fresh
            return fresh

    def reserve(self, device: torch.device | str | int, max_bs: int) -> torch.Tensor:
        """Grow ``device``'s scratch now (outside capture) so plan calls up to ``max_bs``
        requests need no growth later, e.g. before capturing CUDA graphs."""
        if max_bs < 0:
            raise ValueError(f"kvcanary-dispatch: max_bs must be >= 0, got {max_bs}")
        return self.get(device, max_bs + 1)

    def elements(self, device: torch.device | str | int) -> int:
        """Elements of ``device``'s current scratch (0 before the first call)."""
        current = self._current.get(_normalize(device))
        return 0 if current is None else current.numel()

    def retired_count(self) -> int:
        """How many grown-out scratches are kept alive (never freed) for captured graphs."""
        return len(self._retired)


SCRATCH = VerifyOffsetsScratch()


def make_launch_canary_plan_kernels(api: ModuleType, original: Callable[..., None]) -> Callable:
    """sglang's ``launch_canary_plan_kernels`` without its batch-size cap.

    ``api`` is sglang's ``sglang.kernels.ops.kv_canary.plan.api`` module; ``original`` its
    ``launch_canary_plan_kernels``. The returned function takes the same keywords. Contract:
    where sglang's own ``use_torch_reference`` picks the torch reference (any non-CUDA device),
    ``original`` runs unchanged. Otherwise it checks what sglang checks (the SWA LUT, the
    verify capacity against the plan), zeroes ``write_plan_out.write_offsets`` as sglang does,
    plans the offsets with ``kvcanary_dispatch.plan_offsets`` into the device's shared scratch
    (``SCRATCH``, >= bs + 1 elements) and calls ``api.launch_plan_entries_kernel`` with it: the
    outputs equal sglang's for every bs sglang accepts, and sglang's torch reference for larger
    ones. No host sync, no per-call allocation; CUDA-graph capturable.
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
        if swa_window_size > 0 and full_to_swa_index_mapping is None:
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
        bs = int(req_pool_indices.shape[0])
        scratch = SCRATCH.get(device, bs + 1)
        write_plan_out.write_offsets.zero_()
        inputs = PlanInputs(
            req_pool_indices,
            prefix_lens,
            extend_seq_lens,
            req_to_token,
            full_to_swa_index_mapping,
            int(swa_window_size),
            verify_capacity,
        )
        outputs = PlanOutputs(
            scratch,
            write_plan_out.write_offsets,
            write_plan_out.write_seed_slot_indices,
            verify_plan_out.verify_num_valid,
            verify_plan_out.enable,
            write_plan_out.write_num_valid_reqs,
        )
        plan_bundled(inputs, outputs)
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
            kv_token_id_vs_position_offset=int(kv_token_id_vs_position_offset),
            swa_window_size=int(swa_window_size),
        )

    launch_canary_plan_kernels.__doc__ = (
        "kvcanary-dispatch's any-bs replacement for sglang's launch_canary_plan_kernels "
        "(see kvcanary_dispatch.integrations.sglang).\n\n" + (original.__doc__ or "")
    )
    return launch_canary_plan_kernels
