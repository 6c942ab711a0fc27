"""Argument checks shared by the kernel launchers; every message starts with ``kv-canary: ``."""

from __future__ import annotations

import operator
from collections.abc import Iterable

import torch

PREFIX = "kv-canary: "


class CapacityError(ValueError):
    """A plan's batch does not fit its pre-allocated write buffers (``bs`` above
    ``write_req_capacity = len(out_write_seed_slot_indices)``). A ``ValueError``, as upstream
    raises; exported as ``kvcanary_dispatch.CapacityError``."""


def name_a_non_tensor(
    err: Exception, fn: str, named: Iterable[tuple[object, str]], optional: Iterable[str] = ()
) -> None:
    """After ``err`` from a call of ``fn``: unless ``err`` is one of these checks' own errors
    (their texts start with ``PREFIX``), a ``TypeError`` naming the first of ``named`` (value,
    name) that is not a tensor (``None`` allowed for the names in ``optional``). Returns when
    there is none; the caller then re-raises ``err``."""
    if str(err).startswith(PREFIX):
        return
    for value, name in named:
        if not (value is None and name in optional):
            require_tensor(value, fn, name)


def require_tensor(value: object, fn: str, name: str) -> None:
    """A ``TypeError`` naming ``fn``'s argument ``name`` unless ``value`` is a tensor."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(
            f"{PREFIX}{fn} {name} must be a torch.Tensor, got {type(value).__name__}"
        ) from None


def require_contiguous(tensors: Iterable[tuple[torch.Tensor | None, str]]) -> None:
    for t, name in tensors:
        if t is not None and not t.is_contiguous():
            raise ValueError(f"{PREFIX}{name} must be contiguous; pass {name}.contiguous()")


def require_dtype(t: torch.Tensor | None, name: str, dtype: torch.dtype) -> None:
    if t is not None and t.dtype != dtype:
        raise ValueError(
            f"{PREFIX}{name} must have dtype {dtype}, got {t.dtype}; pass {name}.to({dtype})"
        )


def require_dim(t: torch.Tensor | None, name: str, dim: int) -> None:
    if t is not None and t.dim() != dim:
        raise ValueError(f"{PREFIX}{name} must be {dim}-D, got shape {tuple(t.shape)}")


def require_len(t: torch.Tensor, name: str, n: int) -> None:
    if int(t.shape[0]) != n:
        raise ValueError(f"{PREFIX}{name} length must be {n}, got {int(t.shape[0])}")


def require_min_len(t: torch.Tensor, name: str, n: int) -> None:
    if int(t.shape[0]) < n:
        raise ValueError(f"{PREFIX}{name} length must be >= {n}, got {int(t.shape[0])}")


def require_same_device(
    ref: torch.Tensor, ref_name: str, others: Iterable[tuple[torch.Tensor | None, str]]
) -> None:
    for t, name in others:
        if t is not None and t.device != ref.device:
            raise ValueError(
                f"{PREFIX}{name} must be on {ref_name}'s device {ref.device}, got {t.device}; "
                f"pass {name}.to({ref_name}.device)"
            )


def tensor_refusal(must: str, name: str, kind: type[Exception] = TypeError) -> Exception:
    """The error for a tensor given where a Python number belongs: ``must``, then the fix. Its
    value is not read (a read-back would be a host sync, and an error inside a CUDA graph
    capture)."""
    return kind(f"{must}, got a tensor; pass int({name}), read once outside any CUDA graph")


def as_integer(value: object) -> int | None:
    """``value`` as an int when it is an integer (anything with ``__index__``, numpy integers
    among them) but a bool or a tensor (whose value only a read-back would give), else
    ``None``."""
    if isinstance(value, bool | torch.Tensor):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def require_block(block: object, name: str, maximum: int) -> int:
    """A launch block, as an ``int``: a power of two no larger than the module's block, given
    as an integer (``as_integer``); else a ``ValueError`` naming it."""
    n = as_integer(block)
    if n is None or n < 1 or n > maximum or n & (n - 1):
        raise ValueError(f"{PREFIX}{name}={block!r} must be a power of two in [1, {maximum}]")
    return n
