"""Outputs that share memory with an input or with another output, refused before any launch.

A call's programs read its inputs while other programs write its outputs, in no fixed order
(and a split call's later slices read memory earlier ones wrote), so an output that shares a
byte with an input or another output gives a result that depends on that order. Such a call
is a ``ValueError`` naming the two tensors. Tensors on different devices, and empty ones,
share nothing. A tensor's bytes are a ``Span``: ``rows`` runs of ``width`` bytes, ``pitch``
bytes apart, from ``start`` (``span_of``): exactly its bytes for a vector of any stride and
for a 2-D tensor whose rows, along either stride, are contiguous or expanded (rows may
overlap); one run from its first element to its last for anything else. Whether two spans
share a byte is decided exactly (``meet``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from kvcanary_kernels._checks import PREFIX
from kvcanary_kernels._launch import Head
from kvcanary_kernels.args import PlanInputs, PlanOutputs
from kvcanary_kernels.plan_checks import plan_head_sizes


class Span(NamedTuple):
    """The bytes ``[start + r * pitch, start + r * pitch + width)`` for ``r`` in ``[0, rows)``
    (``rows``, ``pitch`` and ``width`` at least 0)."""

    start: int
    rows: int
    pitch: int
    width: int


def run(start: int, nbytes: int) -> Span:
    """One run of ``nbytes`` bytes from address ``start``."""
    return Span(start, 1, 0, nbytes)


def span_of(t: torch.Tensor) -> Span:
    """``t``'s bytes: exactly its bytes for a vector (any stride) and for a 2-D tensor whose
    rows (along its larger stride) are contiguous or expanded (rows may overlap); else one run
    from its first element to its last (the gaps included). Dimensions of one element count
    for nothing."""
    size = t.element_size()
    if t.numel() == 0:
        return Span(t.data_ptr(), 0, 0, 0)
    if t.is_contiguous():
        return run(t.data_ptr(), t.numel() * size)
    dims = sorted(((s, n) for n, s in zip(t.shape, t.stride(), strict=True) if n > 1), reverse=True)
    if len(dims) == 1 and dims[0][0] > 1:  # a strided vector: one element a row
        return Span(t.data_ptr(), dims[0][1], dims[0][0] * size, size)
    if len(dims) == 2 and dims[1][0] <= 1:  # rows of contiguous (or expanded) elements
        (pitch, rows), (step, cols) = dims
        return Span(t.data_ptr(), rows, pitch * size, (cols if step else 1) * size)
    last = sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True))
    return run(t.data_ptr(), (last + 1) * size)


def meet(a: Span, b: Span) -> bool:
    """Whether ``a`` and ``b`` share a byte, exactly, for any two spans (rows may overlap). Rows
    ``i`` of ``a`` and ``j`` of ``b`` share one where ``i * a.pitch - j * b.pitch`` lies in
    ``[lo, hi]`` below; this asks for the first ``j`` whose interval holds a multiple of
    ``a.pitch`` that is a row of ``a``: a few divisions, whatever the rows."""
    if not (a.rows and a.width and b.rows and b.width):
        return False
    d = b.start - a.start
    lo, hi = d - a.width + 1, d + b.width - 1  # i*pa - j*pb in [lo, hi]: rows i, j meet
    pa, pb, top = a.pitch, b.pitch, (a.rows - 1) * a.pitch  # a's last row starts at top
    if lo > top or hi + (b.rows - 1) * pb < 0:  # b wholly after a's rows, or wholly before
        return False
    # The rows j of b whose interval [lo + j*pb, hi + j*pb] reaches [0, top], a's rows' starts.
    first = 0 if hi >= 0 else -(hi // pb)  # pb > 0 here
    last = b.rows - 1 if not pb else min(b.rows - 1, (top - lo) // pb)
    if first > last:
        return False
    if not top:  # a's rows all start at 0 (one row, or pitch 0), which first's interval holds
        return True
    # Each interval from first to last reaches [0, top]; one sticking out of it holds 0 or top,
    # a's first or last row's start. So row j meets a row of a exactly where its interval holds
    # a multiple of pa: (hi + j*pb) mod pa <= hi - lo, the interval's length less one.
    k = _first_in_range(pb % pa, (hi + first * pb) % pa, pa, 0, min(hi - lo, pa - 1))
    return k is not None and k <= last - first


def _first_in_range(step: int, start: int, m: int, lo: int, hi: int) -> int | None:
    """The least ``k >= 0`` with ``(start + k * step) % m`` in ``[lo, hi]`` (``0 <= lo <= hi <
    m``, ``0 <= step, start < m``), ``None`` where there is none."""
    if lo <= start <= hi:
        return 0
    return _first_multiple_in((lo - start) % m, (hi - start) % m, step, m)


def _first_multiple_in(lo: int, hi: int, step: int, m: int) -> int | None:
    """The least ``k >= 0`` with ``(k * step) % m`` in ``[lo, hi]`` (``0 < lo <= hi < m``,
    ``0 <= step < m``), ``None`` where there is none. Euclid's recursion: where no ``k * step``
    falls in ``[lo, hi]`` before the first wrap, the wraps ``y`` (``k * step = y * m + r``)
    solve the same problem with ``m % step`` for the step and ``step`` for the modulus."""
    if step == 0:
        return None
    k = -(-lo // step)  # the first k with k * step >= lo
    if k * step <= hi:
        return k
    # [lo, hi] lies between two multiples of step: y * m + lo <= k * step <= y * m + hi for
    # the least y with (y * m) % step in [(-hi) % step, (-lo) % step], both in (0, step).
    y = _first_in_range(m % step, 0, step, (-hi) % step, (-lo) % step)
    return None if y is None else -(-(y * m + lo) // step)


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
