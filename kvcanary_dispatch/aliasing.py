"""Outputs that share memory with an input or with another output, refused before any launch.

A call's programs read its inputs while other programs write its outputs, in no fixed order
(and a split call's later slices read memory earlier ones wrote), so an output that shares a
byte with an input or another output gives a result that depends on that order. Such a call
is a ``ValueError`` naming the two tensors. Tensors on different devices, and empty ones,
share nothing. A tensor's bytes are a ``Span``: ``rows`` runs of ``width`` bytes, ``pitch``
bytes apart, from ``start`` (a pool with contiguous rows; one run for anything else, from its
first element to its last).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from kvcanary_kernels._checks import PREFIX
from kvcanary_kernels._launch import Head
from kvcanary_kernels.args import PlanInputs, PlanOutputs
from kvcanary_kernels.plan_offsets import plan_head_sizes


class Span(NamedTuple):
    """The bytes ``[start + r * pitch, start + r * pitch + width)`` for ``r`` in ``[0, rows)``."""

    start: int
    rows: int
    pitch: int
    width: int


def run(start: int, nbytes: int) -> Span:
    """One run of ``nbytes`` bytes from address ``start``."""
    return Span(start, 1, 0, nbytes)


def span_of(t: torch.Tensor) -> Span:
    """``t``'s bytes: its rows for a 2-D tensor with contiguous rows that do not overlap (one
    column counts as contiguous, whatever its column stride), else one run from its first
    element to its last (gaps of a strided vector included)."""
    size = t.element_size()
    if t.numel() == 0:
        return Span(t.data_ptr(), 0, 0, 0)
    rows_apart = t.dim() == 2 and t.shape[0] > 1 and t.shape[1] <= t.stride(0)
    if rows_apart and (t.stride(1) == 1 or t.shape[1] == 1):
        return Span(t.data_ptr(), t.shape[0], t.stride(0) * size, t.shape[1] * size)
    last = sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True))
    return run(t.data_ptr(), (last + 1) * size)


def meet(a: Span, b: Span) -> bool:
    """Whether ``a`` and ``b`` share a byte. Rows are disjoint (``pitch >= width``); where both
    have several rows, ``b`` counts as one run from its first byte to its last."""
    if not (a.rows and a.width and b.rows and b.width):
        return False
    if b.rows > 1:
        a, b = b, a
    if b.rows > 1:
        b = run(b.start, (b.rows - 1) * b.pitch + b.width)
    lo, hi = b.start - a.start, b.start + b.width - a.start  # b's bytes from a's first row
    if hi <= 0 or lo >= (a.rows - 1) * a.pitch + a.width:
        return False
    if a.rows == 1:
        return True
    r = max(lo, 0) // a.pitch  # the row lo falls in, or in the gap after
    return lo < r * a.pitch + a.width or hi > (r + 1) * a.pitch  # or reaches the next row


def first_shared(spans: Sequence[Span], writes: int) -> tuple[int, int] | None:
    """The indices of the first two ``spans`` that share a byte, one of them among the first
    ``writes`` (the outputs); ``None`` when no output shares a byte with anything."""
    for i in range(writes):
        for j in range(i + 1, len(spans)):
            if meet(spans[i], spans[j]):
                return i, j
    return None


def runs_disjoint(starts: Sequence[int], ends: Sequence[int]) -> bool:
    """Whether no two of the runs ``[starts[k], ends[k])`` share a byte (empty runs share
    nothing): the k-th smallest end is at most the next smallest start, for every k. (Were two
    runs to share byte ``x``, more runs would start at or before ``x`` than end there, by two.)"""
    s, e = sorted(starts), sorted(ends)
    return all(map(int.__le__, e[:-1], s[1:]))


def refuse_shared_memory(
    what: str,
    outputs: Sequence[tuple[torch.Tensor, str]],
    inputs: Sequence[tuple[torch.Tensor | None, str]],
) -> None:
    """A ``ValueError`` naming the first output of ``what`` that shares memory with an input or
    another output (see the module docstring); ``None`` inputs are skipped. The tensors are
    checked ones (no meta tensor)."""
    named = [(t, name) for t, name in (*outputs, *inputs) if t is not None]
    spans = [span_of(t) for t, _ in named]
    for i in range(len(outputs)):
        for j in range(i + 1, len(named)):
            if named[i][0].device == named[j][0].device and meet(spans[i], spans[j]):
                raise ValueError(
                    f"{PREFIX}{what} {named[i][1]} shares memory with {named[j][1]}; pass "
                    "outputs that share no memory with the inputs or with each other (the "
                    "call's programs read the inputs while others write the outputs, in no "
                    "fixed order)"
                )


_DISJOINT: set[tuple] = set()  # (addresses, sizes) of calls whose outputs share no memory
_DISJOINT_MAX = 1024  # entries kept before the set starts over


def plan_outputs_share_memory(i: PlanInputs, o: PlanOutputs, head: Head) -> bool:
    """Whether an output of a checked plan call (contiguous tensors on one device) shares a
    byte with an input or another output, from its ``head``'s addresses and sizes
    (``plan_head_sizes``, read where the head does not carry them); a call whose addresses
    and sizes passed before is not looked at again."""
    key = (head.handed, head.sizes or plan_head_sizes(i, o))
    if key in _DISJOINT:
        return False
    a, (bs, cap, ref_len, table_len, lut_len) = key
    n = bs * 8  # the inputs (the LUT's place may hold the verify offsets), then the outputs:
    ends = (  # where each one's bytes end
        a[0] + n, a[1] + n, a[2] + n, a[3] + table_len * 4, a[4] + lut_len * 8,
        a[5] + ref_len * 8, a[6] + (cap + 1) * 8, a[7] + cap * 8, a[8] + 4, a[9] + 4,
        a[10] + 4,
    )  # fmt: skip
    if not runs_disjoint(a, ends):  # inputs may share memory with each other: look closer
        spans = [run(s, e - s) for s, e in zip(a, ends, strict=True)]
        if first_shared((*spans[5:], *spans[:5]), len(o)) is not None:
            return True
    if len(_DISJOINT) >= _DISJOINT_MAX:
        _DISJOINT.clear()
    _DISJOINT.add(key)
    return False
