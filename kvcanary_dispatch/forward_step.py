"""A forward step against the pre-allocated plan buffers: split, grow or raise.

Upstream checks every step against the capacities and raises, which kills the server, when a
legal batch outgrows them. ``split_forward_step`` cuts such a step
into sub-steps that fit; ``ForwardStepGuard`` applies a policy and plans each (sub-)step into
one set of ``PlanBuffers``.

Sizes used throughout: a step's batch size is ``len(req_pool_indices)`` (padding rows
included); its token count is ``sum(max(extend_seq_lens, 0))`` over all rows, padding rows
included: the length of the step's flat new-token arrays (``positions``, ``out_cache_loc``,
...), request ``r`` owning ``max(extend_seq_lens[r], 0)`` consecutive entries.
"""

from __future__ import annotations

import logging
from bisect import bisect_right
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from itertools import accumulate

import torch

from kvcanary_kernels._checks import PREFIX

from .capacities import CanaryCapacities, PlanBuffers, _require_count
from .placement import CAPTURE_ERROR, capturing, on_device, refuse_capture, upload_rows
from .plan import plan_offsets

logger = logging.getLogger("kvcanary_dispatch")

POLICIES = ("split", "grow", "raise")

Lengths = torch.Tensor | Sequence[int]


@dataclass(frozen=True)
class SubStep:
    """Requests ``[req_start, req_stop)`` of a step, or pieces of them, and the range
    ``[token_start, token_stop)`` of the step's flat new-token arrays they own.

    ``req_pool_indices``, ``prefix_lens`` and ``extend_seq_lens`` describe the sub-step as a
    step of its own: its flat arrays are ``flat[token_start:token_stop]``, laid out by its own
    ``extend_seq_lens`` (rebased CSR). A request cut into pieces appears in consecutive
    sub-steps; a later piece has ``prefix_lens`` advanced by the tokens of the pieces before it
    and ``extend_seq_lens`` = its own tokens. ``first_done`` is the number of tokens of request
    ``req_start`` that earlier sub-steps cover (0 unless the sub-step continues a cut request).
    """

    req_pool_indices: torch.Tensor
    prefix_lens: torch.Tensor
    extend_seq_lens: torch.Tensor
    req_start: int
    req_stop: int
    first_done: int
    token_start: int
    token_stop: int

    @property
    def batch_size(self) -> int:
        return self.req_stop - self.req_start

    @property
    def num_tokens(self) -> int:
        return self.token_stop - self.token_start

    @property
    def tokens(self) -> slice:
        """The sub-step's slice of the step's flat new-token arrays."""
        return slice(self.token_start, self.token_stop)

    def to(self, device: str | torch.device) -> SubStep:
        """The same sub-step with its tensors on ``device`` (itself when already there). CPU
        tensors bound for a GPU are copied now into private pinned staging and uploaded
        asynchronously (``kvcanary_dispatch.placement``): the host does not wait on queued
        work, and a ``ValueError`` is raised while ``device``'s stream captures a CUDA graph."""
        device = torch.device(device)
        names = ("req_pool_indices", "prefix_lens", "extend_seq_lens")
        moved = [n for n in names if getattr(self, n).device != device]
        if not moved:
            return self
        host = [n for n in moved if getattr(self, n).device.type == "cpu"]
        if device.type == "cuda" and host:
            with on_device(device):
                refuse_capture(
                    device,
                    f"a forward step's {', '.join(host)} are on the CPU",
                    f"pass them on {device} (and num_tokens) for steps planned inside a graph",
                )
                rows = upload_rows([getattr(self, n) for n in host], device)
            uploaded = dict(zip(host, rows, strict=True))
        else:
            uploaded = {}
        for n in moved:
            if n not in uploaded:
                uploaded[n] = getattr(self, n).to(device)
        return replace(self, **uploaded)


def _as_lengths(values: Lengths, name: str) -> torch.Tensor:
    if isinstance(values, torch.Tensor):
        if values.dim() != 1:
            raise ValueError(f"{PREFIX}{name} must be 1-D, got shape {tuple(values.shape)}")
        return values
    return torch.as_tensor(list(values), dtype=torch.int64)


def _step_tensors(
    req_pool_indices: Lengths, prefix_lens: Lengths, extend_seq_lens: Lengths
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    rpi = _as_lengths(req_pool_indices, "req_pool_indices")
    prefix = _as_lengths(prefix_lens, "prefix_lens")
    extend = _as_lengths(extend_seq_lens, "extend_seq_lens")
    bs = int(rpi.shape[0])
    for t, name in ((prefix, "prefix_lens"), (extend, "extend_seq_lens")):
        if int(t.shape[0]) != bs:
            raise ValueError(f"{PREFIX}{name} length must be {bs}, got {int(t.shape[0])}")
    return rpi, prefix, extend


def _token_bounds(extend: torch.Tensor) -> list[int]:
    """Host CSR offsets of the flat new-token arrays (reads ``extend`` back: a sync on a GPU)."""
    return list(accumulate(extend.clamp(min=0).tolist(), initial=0))


def _cut(bounds: list[int], req_cap: int, token_cap: int) -> list[tuple[int, int, int, int, int]]:
    """Greedy cut of a step with flat-token offsets ``bounds`` into ``(req_start, req_stop,
    first_done, token_start, token_stop)`` tuples within ``req_cap`` requests and ``token_cap``
    tokens. A request of at most ``token_cap`` tokens is never cut: it opens the next sub-step
    when it does not fit the current one. A longer request fills the rest of the current
    sub-step, then whole sub-steps, and its last piece shares a sub-step with what follows."""
    bs = len(bounds) - 1
    out = []
    r, done = 0, 0
    while r < bs:
        start, first_done = r, done
        t0 = bounds[r] + done
        limit = t0 + token_cap
        count = 0
        if done:  # continue a cut request
            if bounds[r + 1] - t0 > token_cap:
                done += token_cap
                out.append((start, r + 1, first_done, t0, limit))
                continue
            r, done, count = r + 1, 0, 1
        end = min(bisect_right(bounds, limit, lo=r) - 1, r + req_cap - count)
        count += end - r
        r = end
        if (
            r < bs
            and count < req_cap
            and bounds[r + 1] - bounds[r] > token_cap
            and bounds[r] < limit
        ):
            done = limit - bounds[r]
            out.append((start, r + 1, first_done, t0, limit))
        else:
            out.append((start, r, first_done, t0, bounds[r]))
    return out


def _sub_step(
    rpi: torch.Tensor,
    prefix: torch.Tensor,
    extend: torch.Tensor,
    bounds: list[int],
    cut: tuple[int, int, int, int, int],
) -> SubStep:
    s, e, first_done, t0, t1 = cut
    p, x = prefix[s:e], extend[s:e]
    first_len = min(bounds[s + 1], t1) - t0
    last_len = t1 - max(bounds[e - 1], t0)
    first_cut = first_done > 0 or first_len < bounds[s + 1] - bounds[s]
    last_cut = last_len < bounds[e] - bounds[e - 1]
    if first_cut or last_cut:
        p, x = p.clone(), x.clone()
        if first_cut:
            p[0] += first_done
            x[0] = first_len
        if last_cut:
            x[-1] = last_len
    return SubStep(rpi[s:e], p, x, s, e, first_done, t0, t1)


def split_forward_step(
    *,
    req_pool_indices: Lengths,
    prefix_lens: Lengths,
    extend_seq_lens: Lengths,
    capacities: CanaryCapacities,
) -> list[SubStep]:
    """The sub-steps that cover a step in order, each within ``capacities.write_req_capacity``
    requests and ``capacities.write_entry_capacity`` tokens (token count as in the module
    docstring).

    Every (request, new token) is covered exactly once, in order; requests keep their order.
    Sub-steps are filled greedily. A request whose tokens fit the token budget is never cut;
    a longer one is cut into consecutive pieces, each later piece's prefix advanced by the
    pieces before it, so its seed (``req_to_token[row, prefix - 1]``) is the slot of the last
    token the previous piece wrote: ``req_to_token`` must already hold the step's new slots, as
    it does when the engine plans. Padding rows are cut like any row (they write nothing).

    A step that fits returns ``[SubStep]`` holding the given tensors themselves (sequences are
    converted to int64 CPU tensors). Otherwise sub-steps hold views where no request is cut and
    small copies where one is. The lengths are read on the host: pass CPU tensors or
    sequences (a GPU ``extend_seq_lens`` costs one sync). A budget of 0 that cannot hold the
    step's requests or tokens is a ``ValueError``.
    """
    rpi, prefix, extend = _step_tensors(req_pool_indices, prefix_lens, extend_seq_lens)
    bs = int(rpi.shape[0])
    bounds = _token_bounds(extend)
    total = bounds[-1]
    if capacities.fits(bs, total):
        return [SubStep(rpi, prefix, extend, 0, bs, 0, 0, total)]
    if capacities.write_req_capacity == 0:
        raise ValueError(
            f"{PREFIX}write_req_capacity=0 cannot hold any of the step's {bs} requests; "
            "size the capacities with CanaryCapacities.from_args"
        )
    if capacities.write_entry_capacity == 0:
        raise ValueError(
            f"{PREFIX}write_entry_capacity=0 cannot hold any of the step's {total} new tokens; "
            "size the capacities with CanaryCapacities.from_args"
        )
    cuts = _cut(bounds, capacities.write_req_capacity, capacities.write_entry_capacity)
    return [_sub_step(rpi, prefix, extend, bounds, c) for c in cuts]


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


def _token_fit(n: int) -> str:
    return f"--max-prefill-tokens >= {n} with --chunked-prefill-size >= {n} (or unset)"


def overflow_message(capacities: CanaryCapacities, batch_size: int, num_tokens: int) -> str:
    """Upstream's text for the first capacity a step exceeds, then the values that would fit."""
    caps = capacities
    if batch_size > caps.write_req_capacity:
        text = _REQ_OVERFLOW.format(bs=batch_size, cap=caps.write_req_capacity)
        text += f"; --cuda-graph-max-bs >= {batch_size} would fit this batch"
        if num_tokens > caps.write_entry_capacity:
            text += (
                f" (its token count={num_tokens} also exceeds write_entry_capacity="
                f"{caps.write_entry_capacity}: {_token_fit(num_tokens)} would fit it)"
            )
        return text
    text = _TOKEN_OVERFLOW.format(n=num_tokens, cap=caps.write_entry_capacity)
    return text + f"; {_token_fit(num_tokens)} would fit this batch"


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

    ``policy`` decides what happens to a step that outgrows the capacities:

    - ``"split"`` (default): ``split_forward_step`` cuts it; each sub-step is planned in turn
      into the same buffers. Costs more launches per step, and a cut request's prefix is
      verified once per piece.
    - ``"grow"``: the capacities grow (at least doubled) to fit it, and a warning is logged
      once per guard. Only tensors whose size changes are reallocated: a step over the token
      capacity alone keeps every buffer; one over the request capacity reallocates the offsets
      and seeds (the three scalars stay). Graphs that captured a reallocated tensor must be
      recaptured; ``on_grow`` is called with the buffers after every grow (compare tensors
      with ``is`` to see which changed). Refused with a ``RuntimeError`` during capture.
    - ``"raise"``: upstream's ``RuntimeError`` texts, followed by the values that would fit.

    The fit check uses host-known sizes only: ``len(req_pool_indices)`` and the token count
    (``num_tokens``, or the sum of host ``extend_seq_lens``); it never waits on the GPU. Host
    lengths are copied into private staging when a (sub-)step is planned and uploaded
    asynchronously. What does wait: ``extend_seq_lens`` on a GPU without ``num_tokens``, or a
    split of a step whose lengths live on a GPU (one read-back each). During CUDA-graph capture
    both, and host lengths, are a ``ValueError``. A refused step writes nothing.
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
        if policy not in POLICIES:
            raise ValueError(
                f"{PREFIX}ForwardStepGuard policy={policy!r} is not one of {', '.join(POLICIES)}"
            )
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.policy = policy
        self.strategy = strategy
        self.chunk_size = chunk_size
        self.on_grow = on_grow
        self.grow_count = 0
        self._buffers = PlanBuffers.allocate(capacities, device)

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
        tensors. Yielded sub-steps hold their tensors on the buffers' device.

        ``num_tokens``: the step's token count (e.g. ``positions.shape[0]``); when given, a
        step that fits needs no read of ``extend_seq_lens``. Splitting reads the lengths on
        the host (one sync if they live on a GPU). Host lengths are read when the iterator
        plans each (sub-)step: keep them unchanged until the iteration has passed it.
        """
        rpi, prefix, extend = _step_tensors(req_pool_indices, prefix_lens, extend_seq_lens)
        bs = int(rpi.shape[0])
        if num_tokens is None:
            _refuse_read_back(extend, "ForwardStepGuard.plan_step without num_tokens")
            n = int(extend.clamp(min=0).sum()) if bs else 0
        else:
            n = _require_count(num_tokens, "num_tokens")
        caps = self.capacities
        whole = [SubStep(rpi, prefix, extend, 0, bs, 0, 0, n)]
        if caps.fits(bs, n):
            subs = whole
        elif self.policy == "raise":
            raise RuntimeError(overflow_message(caps, bs, n))
        elif self.policy == "grow":
            self._grow(bs, n)
            subs = whole
        else:
            _refuse_read_back(extend, "ForwardStepGuard.plan_step splitting an oversized step")
            subs = split_forward_step(
                req_pool_indices=rpi, prefix_lens=prefix, extend_seq_lens=extend, capacities=caps
            )
        return self._plan_each(subs, req_to_token, full_to_swa_index_mapping, swa_window_size)

    def _grow(self, bs: int, n: int) -> None:
        caps = self.capacities
        device = self._buffers.device
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
        grown = replace(
            caps,
            write_req_capacity=_grown(caps.write_req_capacity, bs),
            write_entry_capacity=_grown(caps.write_entry_capacity, n),
        )
        self._buffers = self._buffers.resized(grown)
        self.grow_count += 1
        if self.grow_count == 1:
            logger.warning(
                "kv-canary: a forward step (batch_size=%d, token count=%d) outgrew the plan "
                "buffers (write_req_capacity=%d, write_entry_capacity=%d); reallocated them for "
                "write_req_capacity=%d, write_entry_capacity=%d. Size them with "
                "CanaryCapacities.from_args to avoid reallocations (logged once).",
                bs,
                n,
                caps.write_req_capacity,
                caps.write_entry_capacity,
                grown.write_req_capacity,
                grown.write_entry_capacity,
            )
        if self.on_grow is not None:
            self.on_grow(self._buffers)

    def _plan_each(
        self,
        subs: list[SubStep],
        req_to_token: torch.Tensor,
        lut: torch.Tensor | None,
        swa_window_size: int,
    ) -> Iterator[tuple[SubStep, PlanBuffers]]:
        buffers = self._buffers
        for sub in subs:
            sub = sub.to(buffers.device)
            plan_offsets(
                req_pool_indices=sub.req_pool_indices,
                prefix_lens=sub.prefix_lens,
                extend_seq_lens=sub.extend_seq_lens,
                req_to_token=req_to_token,
                full_to_swa_index_mapping=lut,
                swa_window_size=swa_window_size,
                verify_capacity=buffers.capacities.verify_capacity,
                chunk_size=self.chunk_size,
                strategy=self.strategy,
                **buffers.tensors(),
            )
            yield sub, buffers


def _grown(capacity: int, needed: int) -> int:
    """``capacity`` when it suffices, else at least double it (few reallocations as load
    creeps up)."""
    return capacity if needed <= capacity else max(needed, 2 * capacity)
