"""Capacities of the pre-allocated plan outputs and the outputs themselves.

A serving engine sizes the plan outputs once, from its server arguments, so that CUDA graphs can
capture them; every step then refills the same tensors. ``CanaryCapacities`` holds the three
sizes, ``PlanBuffers`` the tensors ``plan_offsets`` writes.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace

import torch

from kvcanary_kernels._checks import PREFIX, as_integer, tensor_refusal
from kvcanary_kernels.args import PLAN_OUTPUT_NAMES, PlanOutputs
from kvcanary_kernels.plan_checks import INT32_MAX, INT64_MAX, check_verify_capacity

# Upstream's refusals of a step that outgrows the capacities (sglang's forward-step manager).
_REQ_OVERFLOW = (
    "kv-canary: forward_batch.batch_size={bs} exceeds pre-allocated "
    "write_req_capacity={cap}; raise --cuda-graph-max-bs or check "
    "CanaryLaunchCapacities.from_args"
)
_TOKEN_OVERFLOW = (
    "kv-canary: forward_batch token count={n} exceeds pre-allocated "
    "write_entry_capacity={cap}; raise --chunked-prefill-size / --max-prefill-tokens or check "
    "CanaryLaunchCapacities.from_args"
)
# PlanBuffers' fields by plan_offsets keyword: the keyword less its "out_".
_OUTPUT_FIELDS = tuple((name, name.removeprefix("out_")) for name in PLAN_OUTPUT_NAMES)


def grown_capacity(capacity: int, needed: int) -> int:
    """``capacity`` when it holds ``needed``, else at least doubled (few reallocations as load
    creeps up), to ``needed`` where that is more; the doubling stops at ``2**63 - 1``, the
    most a capacity may be."""
    return capacity if needed <= capacity else max(needed, min(2 * capacity, INT64_MAX))


def _integer(value: object, name: str, must: str) -> int:
    """``value`` as an int (anything with ``__index__`` but a bool or a tensor), else a
    ``ValueError`` that says ``must`` of ``name``."""
    if isinstance(value, torch.Tensor):
        raise tensor_refusal(must, name, ValueError)
    n = as_integer(value)
    if n is None:
        raise ValueError(f"{must}, got {value!r}")
    return n


def _require_count(value: object, name: str, *, allow_none: bool = False) -> int | None:
    """``value`` as a non-negative int, else a ``ValueError`` naming ``name``."""
    if type(value) is int and value >= 0:  # the usual call (a step's num_tokens), at once
        return value
    if value is None and allow_none:
        return None
    must = f"{PREFIX}{name} must be a non-negative integer"
    n = _integer(value, name, must)
    if n < 0:
        raise ValueError(f"{must}, got {n}")
    return n


def _chunk_limit(value: object) -> int | None:
    """``chunked_prefill_size`` as an int, or ``None`` when unset or negative (unbounded)."""
    if value is None:
        return None
    must = f"{PREFIX}chunked_prefill_size must be an integer (None or negative = unbounded)"
    n = _integer(value, "chunked_prefill_size", must)
    return None if n < 0 else n


@dataclass(frozen=True)
class CanaryCapacities:
    """Sizes of one engine's pre-allocated kv-canary buffers, all non-negative ints of at most
    ``2**63 - 1`` (a step's totals are int64).

    - ``write_req_capacity``: requests one planned step may hold (plan offsets and seeds).
    - ``write_entry_capacity``: new tokens one step may write (the write kernel's entries).
    - ``verify_capacity``: verify entries per step; more turns the verify off for the step
      (``out_verify_enable = 0``), it is never an error. At most ``2**31 - 1``: the plan
      counts verify entries in an int32 (``out_verify_num_valid``).
    """

    write_req_capacity: int
    write_entry_capacity: int
    verify_capacity: int

    def __post_init__(self) -> None:
        for name in ("write_req_capacity", "write_entry_capacity", "verify_capacity"):
            n = _require_count(getattr(self, name), name)
            # A step's totals are int64: a larger capacity would fit wrapped ones (the verify
            # capacity's own bound, int32's, is checked below).
            if n > INT64_MAX and name != "verify_capacity":
                raise ValueError(
                    f"{PREFIX}{name}={n} is past int64; pass a capacity of at most {INT64_MAX} "
                    "(the plan counts a step's requests and tokens in int64)"
                )
            object.__setattr__(self, name, n)
        check_verify_capacity(self.verify_capacity, "; CanaryCapacities.from_args clamps it")

    @classmethod
    def from_args(
        cls,
        *,
        cuda_graph_max_bs: int | None,
        req_to_token_pool_size: int,
        speculative_num_draft_tokens: int | None = None,
        max_prefill_tokens: int,
        chunked_prefill_size: int | None = None,
        pool_slot_count: int,
    ) -> CanaryCapacities:
        """Upstream's sizing from server arguments:

        - ``write_req_capacity = max(cuda_graph_max_bs, req_to_token_pool_size)``; a
          ``cuda_graph_max_bs`` of ``None`` (CUDA graphs off) counts as 0
        - ``write_entry_capacity = max(write_req_capacity * max(1, speculative_num_draft_tokens),
          min(max_prefill_tokens, chunked_prefill_size))``; a ``chunked_prefill_size`` that is
          ``None`` or negative is unbounded, and ``None`` draft tokens count as 1
        - ``verify_capacity = 3 * pool_slot_count``, clamped to ``2**31 - 1`` (pools over
          ~716 M slots): the int32 ``out_verify_num_valid`` counts no further, so a step with
          more verify entries than that turns its verify off rather than wrapping

        Every argument must be a non-negative integer (``chunked_prefill_size`` may also be
        negative, and it, ``cuda_graph_max_bs`` and ``speculative_num_draft_tokens`` ``None``);
        anything else is a ``ValueError`` naming the argument.
        """
        max_bs = _require_count(cuda_graph_max_bs, "cuda_graph_max_bs", allow_none=True) or 0
        pool_rows = _require_count(req_to_token_pool_size, "req_to_token_pool_size")
        drafts = _require_count(
            speculative_num_draft_tokens, "speculative_num_draft_tokens", allow_none=True
        )
        prefill = _require_count(max_prefill_tokens, "max_prefill_tokens")
        slots = _require_count(pool_slot_count, "pool_slot_count")
        chunk = _chunk_limit(chunked_prefill_size)
        prefill_budget = prefill if chunk is None else min(prefill, chunk)
        write_req = max(max_bs, pool_rows)
        write_entry = max(write_req * max(1, drafts or 0), prefill_budget)
        if write_entry > INT64_MAX:  # write_req is at most write_entry
            raise ValueError(
                f"{PREFIX}CanaryCapacities.from_args(cuda_graph_max_bs={cuda_graph_max_bs}, "
                f"req_to_token_pool_size={pool_rows}, speculative_num_draft_tokens={drafts}, "
                f"max_prefill_tokens={prefill}, chunked_prefill_size={chunked_prefill_size}) "
                f"sizes write_req_capacity={write_req} and write_entry_capacity={write_entry}, "
                f"past int64; pass server arguments whose capacities are at most {INT64_MAX}"
            )
        return cls(
            write_req_capacity=write_req,
            write_entry_capacity=write_entry,
            verify_capacity=min(3 * slots, INT32_MAX),
        )

    def fits(self, batch_size: int, num_tokens: int) -> bool:
        """Whether a step of ``batch_size`` requests and ``num_tokens`` new tokens fits."""
        return batch_size <= self.write_req_capacity and num_tokens <= self.write_entry_capacity

    def grown_for(self, batch_size: int, num_tokens: int) -> CanaryCapacities:
        """These capacities with each one a step exceeds grown (``grown_capacity``)."""
        return replace(
            self,
            write_req_capacity=grown_capacity(self.write_req_capacity, batch_size),
            write_entry_capacity=grown_capacity(self.write_entry_capacity, num_tokens),
        )

    def overflow_message(self, batch_size: int, num_tokens: int) -> str:
        """Upstream's text for the first capacity a step exceeds, then the values that would
        fit."""
        tokens_fit = (
            f"--max-prefill-tokens >= {num_tokens} with --chunked-prefill-size >= {num_tokens} "
            "(or unset)"
        )
        if batch_size > self.write_req_capacity:
            text = _REQ_OVERFLOW.format(bs=batch_size, cap=self.write_req_capacity)
            text += (
                f"; --cuda-graph-max-bs-decode >= {batch_size} (--cuda-graph-max-bs in older "
                "sglang) would fit this batch"
            )
            if num_tokens > self.write_entry_capacity:
                text += (
                    f" (its token count={num_tokens} also exceeds write_entry_capacity="
                    f"{self.write_entry_capacity}: {tokens_fit} would fit it)"
                )
            return text
        text = _TOKEN_OVERFLOW.format(n=num_tokens, cap=self.write_entry_capacity)
        return f"{text}; {tokens_fit} would fit this batch"


@dataclass(frozen=True)
class PlanBuffers:
    """The pre-allocated outputs of ``plan_offsets`` for steps within ``capacities``.

    Shapes (``C = capacities.write_req_capacity``): ``verify_offsets`` and ``write_offsets``
    int64 ``[C + 1]``, ``write_seed_slot_indices`` int64 ``[C]``, the three scalars int32
    ``[1]``. Planning a step of ``bs <= C`` requests writes offsets ``[0, bs]`` and seeds
    ``[0, bs)`` in place, so the tensors keep their addresses from step to step (what a captured
    CUDA graph needs).
    """

    capacities: CanaryCapacities
    verify_offsets: torch.Tensor
    write_offsets: torch.Tensor
    write_seed_slot_indices: torch.Tensor
    verify_num_valid: torch.Tensor
    verify_enable: torch.Tensor
    write_num_valid_reqs: torch.Tensor

    @classmethod
    def allocate(
        cls, capacities: CanaryCapacities, device: str | torch.device, *, zeroed: bool = True
    ) -> PlanBuffers:
        """Buffers for ``capacities`` on ``device``: zero-filled, or left unfilled (nothing
        launched) with ``zeroed=False``."""
        n = capacities.write_req_capacity
        new = torch.zeros if zeroed else torch.empty
        i64 = dict(dtype=torch.int64, device=device)
        i32 = dict(dtype=torch.int32, device=device)
        return cls(
            capacities=capacities,
            verify_offsets=new(n + 1, **i64),
            write_offsets=new(n + 1, **i64),
            write_seed_slot_indices=new(n, **i64),
            verify_num_valid=new(1, **i32),
            verify_enable=new(1, **i32),
            write_num_valid_reqs=new(1, **i32),
        )

    def resized(self, capacities: CanaryCapacities, *, zeroed: bool = True) -> PlanBuffers:
        """Buffers for ``capacities`` that keep every tensor whose shape does not change (the
        three scalars always; the offsets and seeds unless ``write_req_capacity`` changes), so
        graphs that captured a kept tensor still address it. New tensors are zero-filled, or
        left unfilled with ``zeroed=False`` (``not_in(self)`` lists them)."""
        if capacities.write_req_capacity == self.capacities.write_req_capacity:
            return replace(self, capacities=capacities)
        fresh = PlanBuffers.allocate(capacities, self.device, zeroed=zeroed)
        return replace(
            fresh,
            verify_num_valid=self.verify_num_valid,
            verify_enable=self.verify_enable,
            write_num_valid_reqs=self.write_num_valid_reqs,
        )

    @property
    def device(self) -> torch.device:
        return self.write_offsets.device

    def tensors(self) -> dict[str, torch.Tensor]:
        """The buffers under ``plan_offsets``'s keyword names, in upstream's order: each field's
        name with ``out_`` in front (``out_verify_offsets``, ...)."""
        return {name: getattr(self, field) for name, field in _OUTPUT_FIELDS}

    def not_in(self, other: PlanBuffers) -> list[torch.Tensor]:
        """The tensors of these buffers that ``other`` does not hold."""
        held = {id(t) for t in other.tensors().values()}
        return [t for t in self.tensors().values() if id(t) not in held]

    def record_dropped(self, kept: PlanBuffers, streams: Iterable[torch.cuda.Stream]) -> bool:
        """Mark the CUDA tensors of these buffers that ``kept`` does not hold as used by each
        of ``streams`` (``record_stream``): once nothing else holds them, the caching allocator
        does not hand their memory out again before the work queued there so far (the earlier
        steps' plans and what read their outputs) has run, whichever stream allocated them.
        Returns whether any was dropped."""
        dropped = [t for t in self.not_in(kept) if t.is_cuda]
        for t in dropped:
            for stream in streams:
                t.record_stream(stream)
        return bool(dropped)

    def outputs(self) -> PlanOutputs:
        """The buffers bundled as the plan's outputs (``plan_bundled``'s ``o``)."""
        return PlanOutputs(**self.tensors())
