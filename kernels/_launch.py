"""Kernel launches that skip Triton's per-call re-specialisation once a shape has run.

``kernel[grid](*args, **meta)`` re-derives on every call what a repeated call already knows:
each argument's specialisation, the options, the cache key, the compiled kernel. A
``BoundKernel`` (a kernel with its constexprs and launch options fixed, built once per block
parameters by each launcher through ``binder``) keys the compiled kernel by the remaining facts
Triton specialises on (the current device; per tensor its dtype and whether its address is
16-byte aligned; per integer its width class (int32, int64, uint64), whether it equals 1 and
whether 16 divides it; an integer Triton does not specialise (``do_not_specialize``) by its
width class alone, as Triton does, when the launcher says so through ``BoundKernel.with_head``
or, for arguments a caller has checked in one pass, ``BoundKernel.checked``) and, once a key has
run, calls the compiled kernel's launcher directly on the current stream.
It hands the launcher each CUDA tensor's address (read once, for the key and the launch) rather
than the tensor, which spares the launcher a ``data_ptr()`` call and a driver query per tensor.
The first call of a key goes through ``kernel[grid]`` (which compiles if needed), as does every
call under the interpreter (``TRITON_INTERPRET=1``).

The launcher is called as the compiled kernel's own runner calls it (Triton 3.6 to 3.9):
grid, stream, function handle, packed metadata, launch metadata and the two launch hooks,
then the arguments. With no launch hook registered (each ``None`` or an empty hook chain) it
is handed ``None`` for the launch metadata and both hooks, which it then skips; while a hook
is registered (a profiler) every launch goes through the runner with the tensors themselves,
so the hook sees what it would see from ``kernel[grid]``. A tensor that is not on the
current CUDA device (a CPU tensor, another GPU's) is handed over as is: the launcher then
checks it as Triton does (and refuses memory the current device cannot reach).

Not re-read once a key is cached: Triton's guard that the kernel's global constants have not
changed (the kernels here read module constants only as ``tl.constexpr`` values fixed at
import), its ``pre_run_hooks`` (none are registered here), and the debug and instrumentation
knobs (``TRITON_DEBUG``, instrumentation modes): set those before the first launch of a
process.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from triton import knobs
from triton.runtime import driver
from triton.runtime.jit import JITFunction

from ._checks import PREFIX

MAX_GRID_Y = 65535  # CUDA's limit on a grid's second (and third) size
_INT32 = (-(2**31), 2**31 - 1)
_UINT64_FROM = 2**63
_INT_ONE = 16  # an integer's key entry when it equals 1; the other classes are 8 to 15
# (BoundKernel, device index, argument specialisation) -> (compiled kernel, its launcher,
# function handle, packed metadata, trailing constexpr values in signature order)
_COMPILED: dict[tuple, tuple] = {}


def specialise(args: tuple, device: int) -> tuple[tuple, list]:
    """Per argument, its part of the key and what the launcher is handed. Per tensor two
    entries (dtype, 16-byte aligned) and its address when it is on CUDA device ``device``, else
    the tensor; per int one entry, 8 to 15 (bits: int32, uint64, 16 divides it) or
    ``_INT_ONE``, never equal to a bool; ``None`` and bools as themselves; anything else by
    type and value. Inline: it runs on every call."""
    spec: list = []
    handed: list = []
    key, hand = spec.append, handed.append
    lo, hi = _INT32
    for a in args:
        if a.__class__ is int:
            key(
                _INT_ONE
                if a == 1
                else 8 + (lo <= a <= hi) + 2 * (a >= _UINT64_FROM) + 4 * (not a & 15)
            )
            hand(a)
        elif isinstance(a, torch.Tensor):
            ptr = a.data_ptr()
            key(a.dtype)
            key(not ptr & 15)
            hand(ptr if a.get_device() == device else a)  # -1 off CUDA
        else:
            key(a if a is None or a.__class__ is bool else (type(a), a))
            hand(a)
    return tuple(spec), handed


def specialization_key(kernel: object, device: int, args: tuple, meta: dict) -> tuple:
    """What a launch is keyed by: equal keys mean Triton would run the same binary. (A
    ``BoundKernel`` stands for the kernel and ``meta``; its cache entries add the rest.)"""
    # Constexprs by type and value: Triton compiles True, 1 and 1.0 apart, which == does not.
    constexprs = tuple([(k, v.__class__, v) for k, v in meta.items()])
    return (id(kernel), constexprs, device, specialise(args, device)[0])


def _widths(ints: tuple[int, ...], device: int) -> tuple | bool:
    """How ``do_not_specialize`` integers key a launch: by width alone, as Triton keys them
    (``True`` when all fit int32, else ``specialise``'s entries)."""
    lo, hi = _INT32
    return lo <= min(ints) and max(ints) <= hi or specialise(ints, device)[0]


def _hooks_idle(runtime: Any) -> bool:
    """Whether no launch hook is registered: each is ``None`` or an empty hook chain (Triton
    3.6 to 3.9 hold hook chains; a plain callable counts as registered)."""
    enter, leave = runtime.launch_enter_hook, runtime.launch_exit_hook
    return (enter is None or getattr(enter, "calls", None) == []) and (
        leave is None or getattr(leave, "calls", None) == []
    )


class Head(NamedTuple):
    """The leading tensor arguments of a launch, specialised once by a caller that has checked
    them: each is on device ``device`` (a CUDA index; -1 off CUDA, whose launches go through
    ``BoundKernel.__call__``) and has the same dtype at its position in every head built for
    the kernel (as argument checks that fix each dtype ensure). ``handed``:
    their ``data_ptr()``s; ``key``: what else Triton specialises them on (their addresses
    modulo 16); ``sizes``: element counts its builder read while checking them, for a
    caller's checks keyed on them with ``handed`` (empty where none were kept). Built by
    ``make_head``."""

    args: tuple
    handed: tuple
    key: tuple | int
    device: int
    sizes: tuple[int, ...] = ()


def _residues(addresses: tuple[int, ...]) -> tuple[int, ...] | int:
    """How checked tensors' addresses key a launch: 0 when all are 16-byte aligned (the usual
    case), else each address's residue modulo 16."""
    low = 0
    for a in addresses:  # inline: a reduce call costs more per launch
        low |= a
    return tuple([a & 15 for a in addresses]) if low & 15 else 0


def make_head(
    args: tuple, handed: tuple[int, ...], device: int, sizes: tuple[int, ...] = ()
) -> Head:
    """The ``Head`` of checked tensors ``args`` on device ``device`` (see ``Head``), their
    addresses ``handed``, keyed by ``_residues``; ``sizes`` as ``Head`` says."""
    return Head(args, handed, _residues(handed), device, sizes)


class BoundKernel:
    """``kernel`` with its constexprs and launch options (``meta``) fixed: calling it with a
    grid and the non-constexpr arguments in signature order is ``kernel[grid](*args, **meta)``
    on the current device and stream, through the cached launcher once the key has run."""

    __slots__ = ("kernel", "meta", "_compiles")

    def __init__(self, kernel: JITFunction, meta: dict[str, Any]) -> None:
        self.kernel = kernel
        self.meta = meta
        self._compiles = isinstance(kernel, JITFunction)  # False under the interpreter

    def __call__(self, grid: tuple[int, ...], args: tuple) -> None:
        if not self._compiles:  # the interpreter: nothing compiled to reuse
            self.kernel[grid](*args, **self.meta)
            return
        device = torch.cuda.current_device()
        spec, handed = specialise(args, device)
        self._launch((self, device, spec), device, grid, args, handed)

    def with_head(
        self, grid: tuple[int, ...], head: Head, tensors: tuple, ints: tuple[int, ...]
    ) -> None:
        """``self(grid, (*head.args, *tensors, *ints))`` for a kernel whose arguments are a head
        the caller has checked (see ``Head``), more tensors, then integers (Python ``int``s,
        never bools, which Triton compiles apart) that the kernel declares
        ``do_not_specialize`` (a ``TypeError`` on a key's first compiled launch says when one
        is not; the interpreter does not check). Triton keys those integers by width alone,
        so the cache does too: one entry when all fit int32, else the finer key of
        ``specialise``. A head on another device than the current one goes through
        ``__call__``."""
        args = (*head.args, *tensors, *ints)
        if not self._compiles or head.device != (device := torch.cuda.current_device()):
            self(grid, args)  # the interpreter, or a head off the current device
            return
        spec, handed = specialise(tensors, device)
        key = (self, device, head.key, spec, _widths(ints, device))
        self._launch(key, device, grid, args, (*head.handed, *handed, *ints), len(ints))

    def checked(
        self,
        grid: tuple[int, ...],
        device: int,
        tensors: tuple,
        addresses: tuple[int, ...],
        ints: tuple[int, ...],
        stream: int | None = None,
    ) -> None:
        """``self(grid, (*tensors, *ints))`` for arguments a caller has checked in one pass:
        ``tensors`` are on CUDA device ``device``, the current one, with the same dtype at
        each position in every call for this kernel (``addresses``: their ``data_ptr()``s),
        and ``ints`` are keyed by width as in ``with_head`` (the same conditions). Keyed apart
        from ``__call__`` and ``with_head``; no ``Head`` is built. ``stream``: the handle of
        ``device``'s current stream, if the caller has read it (the launch goes there)."""
        args = (*tensors, *ints)
        if not self._compiles:  # the interpreter
            self(grid, args)
            return
        key = (self, device, "checked", _residues(addresses), _widths(ints, device))
        self._launch(key, device, grid, args, (*addresses, *ints), len(ints), stream)

    def _launch(
        self,
        key: tuple,
        device: int,
        grid: tuple[int, ...],
        args: tuple,
        handed: tuple,
        free: int = 0,
        stream: int | None = None,
    ) -> None:
        """Launch ``args`` (``handed``: as the launcher takes them) on ``device``'s current
        stream (``stream``: its handle, if the caller has it): through the launcher cached
        under ``key``, else through ``_first`` (``free``: how many trailing ``args`` ``key``
        holds by width alone)."""
        hit = _COMPILED.get(key)
        if hit is None:
            self._first(key, grid, args, free)
            return
        compiled, run, function, packed, constexprs = hit
        if stream is None:
            stream = driver.active.get_current_stream(device)
        gx, gy, gz = (*grid, 1, 1)[:3]
        if _hooks_idle(knobs.runtime):
            run(gx, gy, gz, stream, function, packed, None, None, None, *handed, *constexprs)
        else:  # a profiler's hook: the runner builds the launch metadata it reads
            compiled[(gx, gy, gz)](*args, *constexprs, stream=stream)

    def _first(self, key: tuple, grid: tuple[int, ...], args: tuple, free: int = 0) -> None:
        """A key's first launch, through ``kernel[grid]`` (which compiles if needed); cached
        when ``args`` are exactly the runtime arguments and every constexpr is in ``meta``.
        The last ``free`` arguments must be ``do_not_specialize`` parameters."""
        kernel, meta = self.kernel, self.meta
        bound = kernel.params[len(args) - free : len(args)]
        if not all(p.do_not_specialize and not p.is_constexpr for p in bound):
            names = [p.name for p in bound if not p.do_not_specialize or p.is_constexpr]
            raise TypeError(
                f"{PREFIX}{kernel.__name__}: with_head keys its integers by width, but "
                f"{', '.join(names)} is not a do_not_specialize parameter; declare it so, or "
                f"launch through BoundKernel.__call__"
            )
        compiled = kernel[grid](*args, **meta)
        names = kernel.arg_names[len(args) :]
        runtime_args = not any(p.is_constexpr for p in kernel.params[: len(args)])
        if compiled is not None and runtime_args and all(name in meta for name in names):
            constexprs = tuple(meta[name] for name in names)
            handles = (compiled.function, compiled.packed_metadata)
            _COMPILED[key] = (compiled, compiled.run, *handles, constexprs)  # run: the launcher


def binder(kernel: JITFunction, *names: str) -> Callable[..., BoundKernel]:
    """A cached factory of ``kernel``'s bound forms: ``binder(k, "A", "num_warps")(8, 4)`` is
    ``k`` bound to ``A=8, num_warps=4``, built once per distinct values (told apart by type,
    as Triton compiles ``True`` and ``1`` apart). For launchers whose block parameters come as
    arguments: a look-up costs less than keying the keywords on every call."""

    @functools.lru_cache(maxsize=None, typed=True)
    def bound(*values: Any) -> BoundKernel:
        return BoundKernel(kernel, dict(zip(names, values, strict=True)))

    return bound
