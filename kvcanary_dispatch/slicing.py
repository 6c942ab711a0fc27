"""How a batch is cut into slices that fit a fixed block: pure host arithmetic, no tensors."""

from __future__ import annotations

import operator

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
            f"pass chunk_size=None for the largest slice ({maximum})"
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


def slice_bounds(bs: int, chunk_size: int) -> list[tuple[int, int]]:
    """Consecutive half-open request ranges ``[s, e)`` of at most ``chunk_size`` covering
    ``[0, bs)``; empty for ``bs == 0``."""
    return [(s, min(s + chunk_size, bs)) for s in range(0, bs, chunk_size)]


def block_for(n: int) -> int:
    """The smallest power of two >= ``n`` (``n >= 1``): launch blocks come from this small set,
    so Triton compiles each kernel at most a dozen times."""
    return 1 << max(n - 1, 0).bit_length()
