"""A forward step against the pre-allocated plan buffers: split, grow or raise.

Upstream checks every step against the capacities and raises, which kills the server, when a
legal batch outgrows them. ``split_forward_step`` (``kvcanary_dispatch.step_split``, which
also defines a step's batch size and token count) cuts such a step into sub-steps that fit;
``ForwardStepGuard`` applies a policy and plans each (sub-)step into one set of
``PlanBuffers``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator

import torch

from kvcanary_kernels._checks import PREFIX
from kvcanary_kernels.args import PlanInputs
from kvcanary_kernels.plan_checks import INT64_MAX

from .capacities import CanaryCapacities, PlanBuffers, _require_count
from .placement import CAPTURE_ERROR, StreamFence, capturing, made_apart, on_device, refuse_capture
from .plan import check_plan_bundled, check_plan_settings, plan_bundled
from .resident import current_stream_handle
from .step_split import (
    LENGTH_NAMES,
    Lengths,
    SubStep,
    _step_tensors,
    _token_count,
    refuse_split_views,
    split_copies,
    split_forward_step,
)

__all__ = ["POLICIES", "ForwardStepGuard", "Lengths", "SubStep", "split_forward_step"]

logger = logging.getLogger("kvcanary_dispatch")

POLICIES = ("split", "grow", "raise")


def _refuse_read_back(extend: torch.Tensor, what: str) -> None:
    """Reading GPU lengths back to the host is a sync, and impossible during capture."""
    if extend.device.type == "cuda":
        with on_device(extend.device):
            refuse_capture(
                extend.device,
                f"{what} reads extend_seq_lens back from {extend.device}",
                "pass num_tokens and capture only steps that fit the capacities",
            )


class ForwardStepGuard:
    """Plans every forward step into one set of ``PlanBuffers``, whatever its size.

    ``strategy`` and ``chunk_size`` are ``plan_offsets``' for every plan the guard launches
    (checked when built and when set, with its errors).
    ``policy`` decides what happens to a step that outgrows the capacities:

    - ``"split"`` (default): ``split_forward_step`` cuts it; each sub-step is planned in turn
      into the same buffers. Costs more launches per step, and a cut request's prefix is
      verified once per piece, each later piece's prefix advanced by the tokens before it: a
      sub-step's verify total can so pass ``verify_capacity`` where the whole step's did not,
      and its plan then turns its verify off (``out_verify_enable = 0``), the requests it
      shares with that piece included, as for any step over the capacity.
    - ``"grow"``: the capacities grow to fit it (at least doubled, up to int64's largest), and
      a warning is logged once per guard; a step its plan would refuse grows nothing. Only
      tensors whose size changes are reallocated: a step over the token capacity alone keeps
      every buffer; one over the request capacity, only the offsets and seeds.
      Graphs that captured a reallocated tensor must be recaptured; ``on_grow`` is called with
      the buffers after every grow (compare tensors with ``is`` to see which changed); if it
      raises, the grow is undone (the guard keeps its buffers and count) and the error
      propagates. Refused with a ``RuntimeError`` during capture. The memory of a dropped
      buffer is not handed out again before the work queued so far on each stream the guard
      has planned or grown on has run; work of yours on another stream that reads the
      buffers must mark them itself (``Tensor.record_stream``).
    - ``"raise"``: upstream's ``RuntimeError`` texts, followed by the values that would fit.

    Buffers the guard allocates (built, or grown) are zero-filled on a stream kept for that
    before the call returns: ready for any stream, and any graph captured later. The host
    waits for that stream alone (and, if the allocation needs new device memory, for what that
    waits for). Building a guard while the stream captures a graph is a ``RuntimeError``, as
    is building one for a CUDA device where torch sees none.

    The fit check uses host-known sizes only: ``len(req_pool_indices)`` and the token count
    (``num_tokens``, or the sum of host ``extend_seq_lens``); it never waits on the GPU, so a
    ``num_tokens`` below the sum of GPU ``extend_seq_lens`` is taken as given. Host
    lengths are copied into private staging when a (sub-)step is planned and uploaded
    asynchronously. What does wait: ``extend_seq_lens`` on a GPU without ``num_tokens``, a
    split of a step whose lengths live on a GPU (one read-back each), a grow over the request
    capacity (its fill, above). During CUDA-graph capture the first two, and host lengths, are
    a ``ValueError`` (a grow a ``RuntimeError``). A refused step writes nothing.
    """

    def __init__(
        self,
        capacities: CanaryCapacities,
        policy: str = "split",
        *,
        device: str | torch.device | None = None,
        strategy: str = "auto",
        chunk_size: int | None = None,
        on_grow: Callable[[PlanBuffers], None] | None = None,
    ) -> None:
        # Each checked by its setter: here rather than at the first step mid-run.
        self.policy, self.strategy, self.chunk_size = policy, strategy, chunk_size
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.on_grow = on_grow
        self.grow_count = 0
        device = torch.device(device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise RuntimeError(
                f"{PREFIX}ForwardStepGuard(device={device}) needs a CUDA device, but torch sees "
                "none (torch.cuda.is_available() is False); run where a GPU is visible, or pass "
                "device='cpu' in a process whose kernels run in Triton's interpreter "
                "(TRITON_INTERPRET=1 before kvcanary_dispatch is first imported)"
            )
        self._hold(made_apart(
            lambda: PlanBuffers.allocate(capacities, device), device,
            lambda b: b.tensors().values(), f"ForwardStepGuard(device={device})"))  # fmt: skip
        self._planned_on: dict[int, torch.cuda.Stream] = {}  # the buffers' streams, by handle

    @property
    def policy(self) -> str:
        """``"split"``, ``"grow"`` or ``"raise"``: may be set between steps; checked when set."""
        return self._policy

    @policy.setter
    def policy(self, policy: str) -> None:
        if policy not in POLICIES:
            raise ValueError(
                f"{PREFIX}ForwardStepGuard policy={policy!r} is not one of {', '.join(POLICIES)}"
            )
        self._policy = policy

    @property
    def strategy(self) -> str:
        """``plan_offsets``' ``strategy``: may be set between steps; checked when set."""
        return self._strategy

    @strategy.setter
    def strategy(self, strategy: str) -> None:
        check_plan_settings(None, strategy)  # a strategy's check needs no chunk size
        self._strategy = strategy

    @property
    def chunk_size(self) -> int | None:
        """``plan_offsets``' ``chunk_size``: may be set between steps; checked when set."""
        return self._chunk_size

    @chunk_size.setter
    def chunk_size(self, chunk_size: int | None) -> None:
        check_plan_settings(chunk_size, self._strategy)
        self._chunk_size = chunk_size

    @property
    def buffers(self) -> PlanBuffers:
        """The current buffers (new ones after each grow)."""
        return self._buffers

    @property
    def capacities(self) -> CanaryCapacities:
        return self._buffers.capacities

    def plan_step(
        self,
        *,
        req_pool_indices: Lengths,
        prefix_lens: Lengths,
        extend_seq_lens: Lengths,
        req_to_token: torch.Tensor,
        full_to_swa_index_mapping: torch.Tensor | None = None,
        swa_window_size: int = 0,
        num_tokens: int | None = None,
    ) -> Iterator[tuple[SubStep, PlanBuffers]]:
        """Check the step now (raise, grow or split per the policy), then return an iterator
        that plans each (sub-)step into the buffers and yields ``(sub_step, buffers)``: run the
        write and verify kernels of a sub-step before advancing, as the next one overwrites the
        buffers. A step that fits (or any step under ``"grow"``) yields once, with the given
        tensors where they are on the buffers' device (host lengths on a CPU guard: where they
        are contiguous int64 tensors), else their int64 copies there. Yielded sub-steps hold
        their tensors on the buffers' device.

        ``num_tokens``: the step's token count (e.g. ``positions.shape[0]``); when given, a
        step that fits needs no read of GPU ``extend_seq_lens``. A count below what host
        ``extend_seq_lens`` hold, or one past int64, is a ``ValueError`` (a larger one, padding,
        is taken: a step that fits, or grows, yields once with ``tokens`` up to
        ``num_tokens``, padding included, while the sub-steps of a split step cover only the
        tokens its requests own, so the padding tokens past them are in none of their
        ``tokens``: under ``"split"``, a step over the token capacity by its padding alone
        yields one sub-step, without them).
        Splitting reads the lengths on the host (one sync if they live on a GPU). Host
        lengths are read when the iterator plans each (sub-)step, or, for a step that grows
        the buffers of a guard on a GPU, by this call (which uploads them): keep them
        unchanged until the iteration has passed it. A
        step that grows the buffers queues ``on_grow``'s work and its lengths' upload on the
        current stream of the buffers' device at this call, and a split that cuts a request
        whose lengths live on that GPU queues the cut pieces' copies; iterated on another
        stream, each plan waits for them on the device (the host does not wait); iterated
        during CUDA-graph capture, it is a ``ValueError`` (call ``plan_step`` again for a
        grown step: it now fits the buffers). Splitting during capture is a ``ValueError``
        at this call, as are lengths on the buffers' device that are not int64, not
        contiguous or share memory with the buffers when the step must be split. An iterator
        whose buffers a later call grew is a ``RuntimeError`` (nothing planned): call
        ``plan_step`` again for that step.
        """
        rpi, prefix, extend = _step_tensors(req_pool_indices, prefix_lens, extend_seq_lens)
        bs = int(rpi.shape[0])
        if num_tokens is None:
            _refuse_read_back(extend, "ForwardStepGuard.plan_step without num_tokens")
            n = _token_count(extend)
        else:
            n = _require_count(num_tokens, "num_tokens")
            if n > INT64_MAX:  # else named as a capacity it would grow or need
                raise ValueError(
                    f"{PREFIX}num_tokens={n} is past int64; pass this step's own count (e.g. "
                    "positions.shape[0]) or leave num_tokens out"
                )
            if extend.device.type == "cpu" and n < (host := _token_count(extend)):
                raise ValueError(
                    f"{PREFIX}num_tokens={n} is less than the {host} new tokens the host "
                    "extend_seq_lens hold (negative lengths count 0); pass this step's own "
                    "count (e.g. positions.shape[0]) or leave num_tokens out"
                )
        caps = self.capacities
        whole = [SubStep(rpi, prefix, extend, 0, bs, 0, 0, n)]
        fence = None
        if caps.fits(bs, n):
            subs = whole
        elif self.policy == "raise":
            raise RuntimeError(caps.overflow_message(bs, n))
        elif self.policy == "grow":

            def check(grown: PlanBuffers) -> None:  # the lengths' copies stood in for
                sub = whole[0].stand_in(grown.device)
                inputs = _plan_inputs(
                    sub, req_to_token, full_to_swa_index_mapping, swa_window_size, grown
                )
                check_plan_bundled(inputs, grown.outputs(), self._chunk_size, self._strategy)

            # Checked before the buffers are filled or the lengths copied: a refused step
            # launches nothing and leaves the guard (buffers, capacities, count) as it was.
            buffers = self._grown_buffers(bs, n, check)
            subs = [whole[0].to(buffers.device)]
            self._adopt(buffers, bs, n)
            # After on_grow: the iteration is ordered after all this call queued.
            fence = _grow_fence(whole[0], subs[0], buffers.device)
            if fence is not None:
                fence = (fence, _unordered_in_capture(
                    f"the step that grew the plan buffers at plan_step (batch_size={bs}, token "
                    f"count={n})", "the grow's work (on_grow's work, its lengths copied)",
                    "call plan_step again for this step, which now fits "
                    f"(write_req_capacity={buffers.capacities.write_req_capacity}, "
                    f"write_entry_capacity={buffers.capacities.write_entry_capacity}), or "
                    "iterate it before capturing",
                ))  # fmt: skip
        else:
            subs, fence = self._split(rpi, prefix, extend, bs, n)
        return self._plan_each(
            subs, self._buffers, req_to_token, full_to_swa_index_mapping, swa_window_size, fence
        )

    def _split(
        self, rpi: torch.Tensor, prefix: torch.Tensor, extend: torch.Tensor, bs: int, n: int
    ) -> tuple[list[SubStep], tuple[StreamFence, str] | None]:
        """The sub-steps of an oversized step (``bs`` requests, ``n`` tokens), and on a CUDA
        guard the fence over the copies the split queued (a cut request's GPU lengths) with
        the refusal of an iteration under capture. Every refusal (capture; lengths on the
        buffers' device that the plan would refuse as pieces) comes before anything is
        queued."""
        device = self._buffers.device
        _refuse_read_back(extend, "ForwardStepGuard.plan_step splitting an oversized step")
        if device.type == "cuda":
            with on_device(device):
                refuse_capture(
                    device, "ForwardStepGuard.plan_step splitting an oversized step (batch_size="
                    f"{bs}, token count={n})", "capture only steps that fit the capacities "
                    "(size them with CanaryCapacities.from_args)",
                )  # fmt: skip
        refuse_split_views((rpi, prefix, extend), self._outputs)
        subs = split_forward_step(
            req_pool_indices=rpi, prefix_lens=prefix, extend_seq_lens=extend,
            capacities=self.capacities,
        )  # fmt: skip
        copies = split_copies((rpi, prefix, extend), subs, device)
        if not copies:
            return subs, None
        with on_device(device):
            fence = StreamFence.now(copies, device)
        return subs, (fence, _unordered_in_capture(
            f"a piece of the step split at plan_step (batch_size={bs}, token count={n})",
            "the copies plan_step made of its cut requests' lengths",
            "iterate the step before capturing, and capture only steps that fit the capacities",
        ))  # fmt: skip

    def _grown_buffers(self, bs: int, n: int, check: Callable[[PlanBuffers], None]) -> PlanBuffers:
        """Buffers grown to fit ``bs`` requests and ``n`` tokens (refused during capture), which
        ``check`` is given before its new tensors are zero-filled; the guard does not hold
        them yet."""
        caps, old = self.capacities, self._buffers
        device = old.device
        with on_device(device):
            capturing_now = capturing(device)
        if capturing_now:
            raise RuntimeError(
                f"{PREFIX}ForwardStepGuard(policy='grow') cannot reallocate the plan buffers "
                f"while the stream is {CAPTURE_ERROR} (batch_size={bs}, token count={n}, "
                f"capacities write_req_capacity={caps.write_req_capacity}, "
                f"write_entry_capacity={caps.write_entry_capacity}); capture only steps that "
                "fit the capacities (size them with CanaryCapacities.from_args): no policy can "
                "grow or split a step inside a graph"
            )
        grown = caps.grown_for(bs, n)
        if grown.write_req_capacity == caps.write_req_capacity:
            check(kept := old.resized(grown))  # every tensor kept: nothing to fill
            return kept

        def make() -> PlanBuffers:
            check(new := old.resized(grown, zeroed=False))
            for t in new.not_in(old):
                t.zero_()
            return new

        return made_apart(make, device, lambda new: new.not_in(old), "a grow")

    def _adopt(self, buffers: PlanBuffers, bs: int, n: int) -> None:
        """Hold the grown ``buffers`` (for a step of ``bs`` requests and ``n`` tokens), count
        the grow and tell ``on_grow``; if ``on_grow`` raises, the guard goes back to the
        buffers and count it had (so the next such step grows, and calls it, again), and the
        error propagates. The first grow that holds is logged."""
        caps, grown = self.capacities, buffers.capacities
        previous = self._buffers
        self._hold(buffers)
        self.grow_count += 1
        if self.on_grow is not None:
            try:
                self.on_grow(buffers)
            except BaseException:
                self._hold(previous)
                self.grow_count -= 1
                raise
        if buffers.device.type == "cuda":
            current = self._note_stream(buffers.device)
            if previous.record_dropped(buffers, self._planned_on.values()):
                # The offsets and seeds, dropped together, are all the guard reallocates: the
                # new ones have been used on this stream only (their fill stream was waited for).
                self._planned_on = {current.cuda_stream: current}
        if self.grow_count == 1:
            logger.warning(
                "kv-canary: a forward step (batch_size=%d, token count=%d) outgrew the plan "
                "buffers (write_req_capacity=%d, write_entry_capacity=%d); reallocated them for "
                "write_req_capacity=%d, write_entry_capacity=%d. Size them with "
                "CanaryCapacities.from_args to avoid reallocations (logged once).",
                bs, n, caps.write_req_capacity, caps.write_entry_capacity,
                grown.write_req_capacity, grown.write_entry_capacity,
            )  # fmt: skip

    def _plan_each(
        self,
        subs: list[SubStep],
        buffers: PlanBuffers,
        req_to_token: torch.Tensor,
        lut: torch.Tensor | None,
        swa_window_size: int,
        fence: tuple[StreamFence, str] | None,
    ) -> Iterator[tuple[SubStep, PlanBuffers]]:
        device = buffers.device
        on_cuda = device.type == "cuda"
        for sub in subs:
            if self._buffers is not buffers:
                raise RuntimeError(
                    f"{PREFIX}ForwardStepGuard: a later plan_step grew the plan buffers "
                    f"(write_req_capacity={self.capacities.write_req_capacity}, "
                    f"write_entry_capacity={self.capacities.write_entry_capacity}) before this "
                    f"step (batch_size={sub.batch_size}, token count={sub.num_tokens}) was "
                    "planned; call plan_step again for this step, and iterate each step "
                    "before planning the next"
                )
            if on_cuda:
                self._note_stream(device)
                if fence is not None:  # each piece: the stream may change between them
                    self._follow(*fence)
            sub = sub.to(device)
            inputs = _plan_inputs(sub, req_to_token, lut, swa_window_size, buffers)
            plan_bundled(inputs, self._outputs, self._chunk_size, self._strategy)
            yield sub, buffers

    def _follow(self, fence: StreamFence, refusal: str) -> None:
        """Order the plan of the (sub-)step being iterated after the work ``plan_step`` queued
        for it (``fence``) on the current stream; ``refusal`` (a ``ValueError``) while that
        stream captures a graph."""
        device = self._buffers.device
        with on_device(device):
            if capturing(device):
                raise ValueError(refusal)
            fence.order_reads(device)

    def _note_stream(self, device: torch.device) -> torch.cuda.Stream:
        """Remember CUDA ``device``'s current stream (returned) among those the buffers were
        used on: one query of its handle, a ``Stream`` object only for a handle not seen yet.
        ``device`` names its index (the buffers' device does)."""
        handle = current_stream_handle(device.index)
        stream = self._planned_on.get(handle)
        if stream is None:
            stream = self._planned_on[handle] = torch.cuda.current_stream(device)
        return stream

    def _hold(self, buffers: PlanBuffers) -> None:
        """Make ``buffers`` the guard's, with their plan outputs bundled once."""
        self._buffers = buffers
        self._outputs = buffers.outputs()


def _plan_inputs(
    sub: SubStep,
    req_to_token: torch.Tensor,
    lut: torch.Tensor | None,
    swa_window_size: int,
    buffers: PlanBuffers,
) -> PlanInputs:
    """The plan's inputs for ``sub`` (on the buffers' device), planned into ``buffers``."""
    return PlanInputs(
        sub.req_pool_indices,
        sub.prefix_lens,
        sub.extend_seq_lens,
        req_to_token,
        lut,
        swa_window_size,
        buffers.capacities.verify_capacity,
    )


def _unordered_in_capture(what: str, work: str, fix: str) -> str:
    """The refusal of ``what``, iterated while the stream captures a graph that would not be
    ordered after ``work``, queued by ``plan_step``."""
    return (
        f"{PREFIX}ForwardStepGuard: {what} is iterated while the stream is {CAPTURE_ERROR}: the "
        f"graph would not be ordered after {work}; {fix}"
    )


def _grow_fence(host: SubStep, sub: SubStep, device: torch.device) -> StreamFence | None:
    """On a CUDA ``device``, a fence past all its current stream holds now (a grow's work),
    covering the tensors of ``sub`` that ``host``'s were copied into; ``None`` elsewhere."""
    if device.type != "cuda":
        return None
    moved = tuple(getattr(sub, n) for n in LENGTH_NAMES if getattr(sub, n) is not getattr(host, n))
    with on_device(device):
        return StreamFence.now(moved, device)
