"""A forward step cut into sub-steps that fit the plan buffers' capacities.

Sizes used throughout: a step's batch size is ``len(req_pool_indices)`` (padding rows
included); its token count is ``sum(max(extend_seq_lens, 0))`` over all rows, padding rows
included: the length of the step's flat new-token arrays (``positions``, ``out_cache_loc``,
...), request ``r`` owning ``max(extend_seq_lens[r], 0)`` consecutive entries.
"""

from __future__ import annotations

import operator
from bisect import bisect_right
from collections.abc import Callable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, replace
from itertools import accumulate

import torch

from kvcanary_kernels._checks import PREFIX
from kvcanary_kernels.args import PLAN_OUTPUT_NAMES, PlanOutputs
from kvcanary_kernels.plan_checks import INT64_MAX

from .aliasing import refuse_shared_memory
from .capacities import CanaryCapacities
from .placement import on_device, refuse_capture, upload_rows

Lengths = torch.Tensor | Sequence[int]


LENGTH_NAMES = ("req_pool_indices", "prefix_lens", "extend_seq_lens")  # SubStep's tensors


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
        device = device if isinstance(device, torch.device) else torch.device(device)
        rpi, prefix, extend = self.req_pool_indices, self.prefix_lens, self.extend_seq_lens
        if rpi.device == device and prefix.device == device and extend.device == device:
            return self
        return self._moved(device, _uploaded, lambda t: t.to(device, torch.int64))

    def stand_in(self, device: torch.device) -> SubStep:
        """The sub-step as ``to(device)`` gives it, but each tensor it would copy replaced by an
        unfilled one of the copy's dtype, shape, strides and device: nothing copied, nothing
        launched. What the plan's argument checks see of the copy, for checking before it."""
        unfilled = lambda t: torch.empty_like(t, device=device, dtype=torch.int64)  # noqa: E731
        return self._moved(device, _unfilled_rows, unfilled)

    def _moved(
        self,
        device: torch.device,
        rows_of: Callable[[list[str], list[torch.Tensor], torch.device], Sequence[torch.Tensor]],
        copy_of: Callable[[torch.Tensor], torch.Tensor],
    ) -> SubStep:
        """The sub-step with each tensor off ``device`` replaced: CPU tensors bound for a GPU by
        ``rows_of(names, tensors, device)`` (int64 rows of one device tensor), any other by
        ``copy_of`` (an int64 tensor on ``device``). ``to`` and ``stand_in`` differ only in
        these two."""
        moved = [n for n in LENGTH_NAMES if getattr(self, n).device != device]
        host = [n for n in moved if getattr(self, n).device.type == "cpu"]
        new: dict[str, torch.Tensor] = {}
        if device.type == "cuda" and host:
            rows = rows_of(host, [getattr(self, n) for n in host], device)
            new = dict(zip(host, rows, strict=True))
        for n in moved:
            if n not in new:
                new[n] = copy_of(getattr(self, n))
        return replace(self, **new)


def _uploaded(
    names: list[str], rows: list[torch.Tensor], device: torch.device
) -> list[torch.Tensor]:
    """CPU lengths uploaded to CUDA ``device`` (``upload_rows``), refused during capture."""
    with on_device(device):
        refuse_capture(
            device,
            f"a forward step's {', '.join(names)} are on the CPU",
            f"pass them on {device} (and num_tokens) for steps planned inside a graph",
        )
        return upload_rows(rows, device)


def _unfilled_rows(
    names: list[str], rows: list[torch.Tensor], device: torch.device
) -> tuple[torch.Tensor, ...]:
    """``upload_rows``' layout for ``rows``, unfilled: int64 rows of one ``device`` tensor."""
    shape = (len(rows), int(rows[0].shape[0]))
    return torch.empty(shape, dtype=torch.int64, device=device).unbind(0)


def _item_shape(v: object) -> tuple[int, ...] | None:
    """The shape of an item of a length sequence that is not one value (``None`` for one that
    is): a tensor of other than one element, an array of one or more dimensions, a sequence."""
    if isinstance(v, torch.Tensor):
        return None if v.numel() == 1 else tuple(v.shape)
    if isinstance(v, Sequence) and not isinstance(v, str | bytes):
        return (len(v),)
    ndim = getattr(v, "ndim", 0)
    return tuple(v.shape) if isinstance(ndim, int) and ndim >= 1 else None


def _as_lengths(values: Lengths, name: str) -> torch.Tensor:
    """``values`` as a 1-D tensor of integers, no value changed: a float or bool tensor, or a
    sequence holding a value that is not an integer (a float; a bool, unless among integers, as
    Python counts it), is refused, as are ``None``, scalars, 2-D forms (a sequence holding
    sequences, arrays of one or more dimensions, or tensors of other than one element;
    one-element tensors are taken as their value, as ``torch.as_tensor`` takes them) and values
    past int64;
    a CPU integer tensor or a sequence is widened to contiguous int64 (copied where it is of
    another width or layout); a GPU tensor is taken as it is (the
    plan checks its dtype: nothing is launched here)."""
    if isinstance(values, torch.Tensor):
        # The usual call first, taken as it is with no dispatch: 1-D int64, contiguous on the
        # CPU (a GPU tensor is taken in any layout: the plan checks it)
        if values.dtype is torch.int64 and values.dim() == 1:
            if not values.is_cpu or values.is_contiguous():
                return values
        if values.dim() != 1:
            raise ValueError(f"{PREFIX}{name} must be 1-D, got shape {tuple(values.shape)}")
        dtype = values.dtype
        if dtype.is_floating_point or dtype.is_complex or dtype == torch.bool:
            raise TypeError(f"{PREFIX}{name} must hold integers, got {dtype}; pass int64 lengths")
        if not values.is_cpu:
            return values
        if dtype == torch.uint64 and values.numel():
            signed = values.view(torch.int64)  # the values past int64 read negative
            past = (signed < 0).nonzero()
            if past.numel():
                i = int(past[0])
                raise ValueError(
                    f"{PREFIX}{name}[{i}]={int(signed[i]) + 2**64} is past int64; pass "
                    "lengths and indices that fit int64"
                )
        return values.to(torch.int64).contiguous()
    if values is None or isinstance(values, str | bytes) or not hasattr(values, "__iter__"):
        raise TypeError(
            f"{PREFIX}{name} must be a 1-D integer tensor or a sequence of int, got "
            f"{type(values).__name__}"
        )
    if isinstance(values, AbstractSet | Mapping):  # no order to keep
        raise TypeError(
            f"{PREFIX}{name} must be a 1-D integer tensor or a sequence of int, got "
            f"{type(values).__name__}, which has no order; pass a list or a tensor"
        )
    if getattr(values, "ndim", 1) != 1:  # a numpy array
        raise ValueError(f"{PREFIX}{name} must be 1-D, got shape {tuple(values.shape)}")
    items = list(values)
    try:
        t = torch.as_tensor(items) if items else torch.zeros(0, dtype=torch.int64)
    except (TypeError, ValueError, RuntimeError, OverflowError):
        pass  # numpy uint64 scalars, mixed objects: value by value below
    else:
        if t.dim() != 1:
            raise ValueError(f"{PREFIX}{name} must be 1-D, got shape {tuple(t.shape)}")
        if not (t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool):
            return t.to(torch.int64)
    for i, v in enumerate(items):
        if (shape := _item_shape(v)) is not None:
            raise ValueError(
                f"{PREFIX}{name} must be 1-D, got an item of shape {shape} at [{i}]; pass one "
                "integer a request"
            )
        if isinstance(v, torch.Tensor):  # by its value: a bool or a uint64 past int64 is one
            v = items[i] = v.item()
        try:
            if isinstance(v, bool):  # alone (a float among them, or bools only)
                raise TypeError
            operator.index(v)
        except TypeError:
            raise TypeError(
                f"{PREFIX}{name} must hold integers, got {v!r} ({type(v).__name__}); pass "
                "whole numbers (a sequence of int or an int64 tensor)"
            ) from None
    values = [operator.index(v) for v in items]
    for i, v in enumerate(values):
        if not -INT64_MAX - 1 <= v <= INT64_MAX:
            raise ValueError(
                f"{PREFIX}{name}[{i}]={v} is past int64; pass lengths and indices that fit int64"
            )
    return torch.as_tensor(values, dtype=torch.int64)


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


def refuse_split_views(lengths: tuple[torch.Tensor, ...], outputs: PlanOutputs) -> None:
    """Lengths already on the device of ``outputs`` (the plan buffers every piece is planned
    into) are split into views of themselves, which the plan reads as they are: each must be
    int64 and contiguous, and share no memory with ``outputs``, as the plan requires. Refused
    before the split, with the plan's words and the fix (a ``ValueError``), so that no piece
    is refused after earlier ones were planned (a cut request's pieces are copies, which the
    plan would take). Lengths elsewhere are copied to that device piece by piece."""
    device = outputs.out_verify_offsets.device
    here = [(t, n) for t, n in zip(lengths, LENGTH_NAMES, strict=True) if t.device == device]
    for t, name in here:
        if t.dtype != torch.int64:
            fault, fix = f"must have dtype torch.int64, got {t.dtype}", f"{name}.long()"
        elif not t.is_contiguous():
            fault, fix = f"must be contiguous, got stride {t.stride()}", f"{name}.contiguous()"
        else:
            continue
        raise ValueError(
            f"{PREFIX}{name} {fault}: the step is split on {device} into views of it; pass {fix}"
        )
    refuse_shared_memory("plan_offsets", tuple(zip(outputs, PLAN_OUTPUT_NAMES, strict=True)), here)


def split_copies(
    given: tuple[torch.Tensor, ...], subs: list[SubStep], device: torch.device
) -> tuple[torch.Tensor, ...]:
    """The tensors of ``subs`` on CUDA ``device`` that the split made (a cut request's
    lengths, copied), rather than views of the ``given`` lengths; none off CUDA. (Copies on
    another device are copied to ``device`` when each piece is planned.)"""
    if device.type != "cuda":
        return ()
    storages = {t.untyped_storage().data_ptr() for t in given}
    return tuple(
        t
        for sub in subs
        for t in (sub.prefix_lens, sub.extend_seq_lens)
        if t.device == device and t.untyped_storage().data_ptr() not in storages
    )


def _token_bounds(extend: torch.Tensor) -> list[int]:
    """Host CSR offsets of the flat new-token arrays (reads ``extend`` back: a sync on a GPU)."""
    return list(accumulate(extend.clamp(min=0).tolist(), initial=0))


# Up to this many host lengths are summed in Python: faster than torch's five dispatches there
# (7 us against 0.7-2.5 us at 8-64 lengths on a 2-core CPU; even at about 200).
_PYTHON_SUM_MAX = 128


def _token_count(extend: torch.Tensor) -> int:
    """``sum(max(extend, 0))`` exactly (one read-back when ``extend`` is on a GPU, unless its
    int64 sum could wrap)."""
    bs = int(extend.shape[0])
    if not bs:
        return 0
    if bs <= _PYTHON_SUM_MAX and extend.is_cpu:  # Python ints: exact, and no torch dispatch
        return sum(v for v in extend.tolist() if v > 0)
    positive = extend.clamp(min=0)
    largest, total = torch.stack((positive.max(), positive.sum())).tolist()
    if largest <= INT64_MAX // bs:  # the int64 sum cannot wrap
        return total
    return sum(positive.tolist())


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
    it does when the engine plans. Padding rows are cut like any row (they write nothing). A
    negative prefix is advanced as given: the plan reads a prefix <= 0 as none, so a later
    piece of such a request may verify and seed where the whole request would not.

    A step that fits returns ``[SubStep]`` holding the given tensors themselves (sequences, and
    CPU tensors of another integer width or not contiguous, are converted to contiguous int64
    CPU tensors). Otherwise sub-steps hold views where no request is cut and small copies
    where one is. The lengths are read on the host: pass CPU tensors or sequences (a GPU
    ``extend_seq_lens`` costs one sync). A budget of 0 that cannot hold the step's requests
    or tokens is a ``ValueError``.
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
    if capacities.write_entry_capacity == 0 and total:
        raise ValueError(
            f"{PREFIX}write_entry_capacity=0 cannot hold any of the step's {total} new tokens; "
            "size the capacities with CanaryCapacities.from_args"
        )
    cuts = _cut(bounds, capacities.write_req_capacity, capacities.write_entry_capacity)
    return [_sub_step(rpi, prefix, extend, bounds, c) for c in cuts]
