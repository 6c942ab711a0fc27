"""Bounds checks for Triton's CPU interpreter: every element a kernel loads, stores or updates
atomically must lie inside one of the tensors it was launched with.

On a GPU a read past a tensor faults or returns whatever lies there (compute-sanitizer's
memcheck names it); the interpreter reads host memory instead, and a value the kernel then
discards leaves no trace in its outputs. ``check_bounds`` makes such an access an error on
the CPU: each launch records the bytes of every tensor argument (a view's own bytes, not its
whole storage: ``kvcanary_dispatch.aliasing.span_of``, exact for vectors of any stride and for
2-D tensors with contiguous rows, so the gaps between a column window's rows or a strided
vector's elements are outside it; from the first element to the last for other layouts), and
each masked load, masked store and atomic checks the addresses its mask lets through against
those bytes. A miss raises ``OutOfBoundsAccess`` inside the launch (the interpreter reports it as an
``InterpreterError``), naming the kernel, the program, the operation and the nearest argument.

Only elements the mask lets through are checked: a masked-off lane never touches memory on a
GPU either. The check knows addresses, not which pointer an address came from: an access that
runs off one argument into another argument's span passes. Launches from several threads each
check against their own arguments.
"""

from __future__ import annotations

import importlib
import threading

import numpy as np

from kvcanary_dispatch.aliasing import span_of

# .launch: (kernel name, [(argument, (start, rows, pitch, width))]) of this thread's latest
# launch, set as the launch copies its arguments (every memory operation runs inside a launch)
_LOCAL = threading.local()
_NP_DTYPE = []  # the interpreter's element type -> numpy dtype, set by check_bounds


class OutOfBoundsAccess(RuntimeError):
    """A kernel touched memory outside every tensor it was launched with."""


def _tensors(name: str, value: object):
    if isinstance(value, (tuple, list)):
        for i, item in enumerate(value):
            yield from _tensors(f"{name}[{i}]", item)
    elif hasattr(value, "data_ptr") and hasattr(value, "stride"):
        yield name, value


def _rows(tensor) -> tuple[int, int, int, int]:
    """``(start, rows, pitch, width)``: a view's bytes are ``rows`` runs of ``width`` bytes,
    ``pitch`` apart, from ``start``; overlapping rows are one run."""
    start, rows, pitch, width = span_of(tensor)
    if rows > 1 and pitch <= width:  # rows that touch or overlap: one run
        return start, 1, 0, (rows - 1) * pitch + width
    return start, rows, pitch, width


def _inside(addresses: np.ndarray, width: int, span: tuple[int, int, int, int]) -> np.ndarray:
    start, rows, pitch, row_width = span
    rel = addresses - start
    if rows <= 1:
        return (rel >= 0) & (rel + width <= row_width)
    row, col = np.divmod(rel, pitch)
    return (rel >= 0) & (row < rows) & (col + width <= row_width)


def _check(builder, op: str, ptrs, mask) -> None:
    launch = getattr(_LOCAL, "launch", None)
    if launch is None:
        return
    kernel, spans = launch
    addresses = np.asarray(ptrs.data, dtype=np.uint64)
    if mask is not None:
        addresses = addresses[np.broadcast_to(np.asarray(mask.data, dtype=bool), addresses.shape)]
    addresses = addresses.reshape(-1).astype(np.int64)
    if addresses.size == 0:
        return
    width = np.dtype(_NP_DTYPE[0](ptrs.get_element_ty())).itemsize
    inside = np.zeros(addresses.shape, dtype=bool)
    for _, span in spans:
        inside |= _inside(addresses, width, span)
    if inside.all():
        return
    bad = int(addresses[~inside][0])

    def distance(named) -> int:  # bytes from the view's first to its last byte, 0 inside
        start, rows, pitch, row_width = named[1]
        return max(start - bad, bad + width - start - (rows - 1) * pitch - row_width, 0)

    near, (start, rows, pitch, row_width) = min(spans, key=distance, default=("?", (bad, 1, 0, 0)))
    where = f"byte {bad - start} of {near!r}, whose view spans "
    where += f"{(rows - 1) * pitch + row_width} bytes"
    if rows > 1:
        where += f" in {rows} rows of {row_width} bytes, {pitch} apart"
    program = tuple(int(i) for i in builder.grid_idx)
    raise OutOfBoundsAccess(
        f"{kernel}, program {program}: {op} of {width}-byte elements at "
        f"{int((~inside).sum())} address(es) outside every tensor argument; the first, "
        f"{bad:#x}, is {where}"
    )


def check_bounds() -> bool:
    """Wrap the interpreter's argument set-up and memory operations (once); ``True`` when
    wrapped, ``False`` where the installed Triton's interpreter lacks them."""
    interp = importlib.import_module("triton.runtime.interpreter")
    executor = getattr(interp, "GridExecutor", None)
    builder = getattr(interp, "InterpreterBuilder", None)
    needed = ("create_masked_load", "create_masked_store", "create_atomic_rmw", "create_atomic_cas")
    if executor is None or builder is None or not all(hasattr(builder, n) for n in needed):
        return False
    if getattr(executor._init_args_hst, "_kvcanary_bounds", False):
        return True
    init = executor._init_args_hst
    _NP_DTYPE[:] = [interp._get_np_dtype]

    def init_args(self, args_dev, kwargs):
        args_hst, kwargs_hst = init(self, args_dev, kwargs)
        # the positional arguments name a prefix of arg_names; the rest came by keyword
        named = [*zip(self.arg_names, args_hst, strict=False), *kwargs_hst.items()]
        spans = [(n, _rows(t)) for name, v in named for n, t in _tensors(name, v)]
        _LOCAL.launch = (getattr(self.fn, "__name__", "kernel"), spans)
        return args_hst, kwargs_hst

    load, store = builder.create_masked_load, builder.create_masked_store
    rmw, cas = builder.create_atomic_rmw, builder.create_atomic_cas

    def masked_load(self, ptrs, mask, other, cache_policy, is_volatile):
        _check(self, "load", ptrs, mask)
        return load(self, ptrs, mask, other, cache_policy, is_volatile)

    def masked_store(self, ptrs, value, mask, cache_policy):
        _check(self, "store", ptrs, mask)
        return store(self, ptrs, value, mask, cache_policy)

    def atomic_rmw(self, rmw_op, ptr, val, mask, sem, scope):
        _check(self, "atomic update", ptr, mask)
        return rmw(self, rmw_op, ptr, val, mask, sem, scope)

    def atomic_cas(self, ptr, cmp, val, sem, scope):
        _check(self, "atomic compare-and-swap", ptr, None)
        return cas(self, ptr, cmp, val, sem, scope)

    init_args._kvcanary_bounds = True
    executor._init_args_hst = init_args
    builder.create_masked_load, builder.create_masked_store = masked_load, masked_store
    builder.create_atomic_rmw, builder.create_atomic_cas = atomic_rmw, atomic_cas
    return True
