"""How a batch is cut into slices that fit a fixed block: pure host arithmetic, no tensors."""

from __future__ import annotations

import operator
from collections.abc import Iterator, Sequence

import torch

from kvcanary_kernels._checks import PREFIX, tensor_refusal


def resolve_chunk_size(chunk_size: int | None, maximum: int, what: str) -> int:
    """``None`` -> ``maximum``; an int in ``[1, maximum]`` is honoured; another int is a
    ``ValueError`` naming the maximum, a non-int a ``TypeError``."""
    if chunk_size is None:
        return maximum
    if isinstance(chunk_size, torch.Tensor):  # its value would be read back: a sync
        raise tensor_refusal(f"{PREFIX}{what} chunk_size must be an int or None", "chunk_size")
    try:
        if isinstance(chunk_size, bool):
            raise TypeError
        if not isinstance(chunk_size, int):  # (an int, or a size torch.compile traces, kept)
            chunk_size = operator.index(chunk_size)  # numpy ints; not floats
    except TypeError:
        raise TypeError(
            f"{PREFIX}{what} chunk_size must be an int or None, got {chunk_size!r}"
        ) from None
    if chunk_size < 1 or chunk_size > maximum:
        raise ValueError(
            f"{PREFIX}{what} chunk_size={chunk_size} is outside [1, {maximum}]; "
            "pass a size in that range, or chunk_size=None for the strategy's default (its "
            f"largest slice, {maximum}; under strategy='auto', auto's own choice)"
        )
    return chunk_size


def refuse_traced_numpy(settings: tuple[tuple[str, object], ...], what: str = "") -> None:
    """While ``torch.compile`` traces a call: a ``TypeError`` for the first of ``settings``
    (``(name, value)`` pairs, ``what`` prefixed to the name) that is a numpy value. Dynamo
    traces a numpy scalar as an array, which the op's ``SymInt`` arguments and the integer
    checks cannot take; eagerly a numpy integer is an int. Every other value is left to the
    call's own checks."""
    for name, value in settings:
        if type(value).__module__ == "numpy":
            raise TypeError(
                f"{PREFIX}{what}{name} is a numpy value, which torch.compile traces as an array, "
                f"not an int; pass int({name}) to the compiled call (eagerly numpy integers "
                "are taken as ints)"
            )


class SliceBounds(Sequence):
    """``slice_bounds(bs, chunk_size)`` as a sequence of ``(start, stop)`` tuples computed on
    demand: a launch plan of one launch over millions of slices holds two integers, not a
    tuple a slice (17 s and 1.3 GB for 10**7 one-request slices). Equal to another
    ``SliceBounds`` over the same ranges; indexing by a ``slice`` gives a tuple."""

    __slots__ = ("bs", "chunk")

    def __init__(self, bs: int, chunk_size: int) -> None:
        self.bs, self.chunk = bs, chunk_size

    def __len__(self) -> int:
        return -(-self.bs // self.chunk) if self.bs > 0 else 0

    def __getitem__(self, index):
        n = len(self)
        if isinstance(index, slice):
            return tuple(self[k] for k in range(*index.indices(n)))
        k = operator.index(index)
        k += n if k < 0 else 0
        if not 0 <= k < n:
            raise IndexError(f"slice index {index} out of range for {n} slices")
        start = k * self.chunk
        return (start, min(start + self.chunk, self.bs))

    def __iter__(self) -> Iterator[tuple[int, int]]:
        chunk, bs = self.chunk, self.bs
        return ((s, min(s + chunk, bs)) for s in range(0, bs, chunk))

    def _key(self) -> tuple[int, int]:
        """The ranges' identity: a chunk of ``bs`` or more gives the one range ``(0, bs)``."""
        return (self.bs, min(self.chunk, self.bs)) if self.bs > 0 else (0, 0)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, SliceBounds):
            return NotImplemented
        return self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:
        return f"SliceBounds(bs={self.bs}, chunk_size={self.chunk})"


def slice_bounds(bs: int, chunk_size: int) -> list[tuple[int, int]]:
    """Consecutive half-open request ranges ``[s, e)`` of at most ``chunk_size`` covering
    ``[0, bs)``; empty for ``bs == 0``."""
    return [(s, min(s + chunk_size, bs)) for s in range(0, bs, chunk_size)]


def block_for(n: int) -> int:
    """The smallest power of two >= ``n`` (``n >= 1``): launch blocks come from this small set,
    so Triton compiles each kernel at most a dozen times."""
    return 1 << max(n - 1, 0).bit_length()
