"""Kernel launches that skip Triton's per-call re-specialisation once a shape has run.

``kernel[grid](*args, **meta)`` re-derives on every call what a repeated call already knows:
each argument's specialisation, the options, the cache key, the compiled kernel. ``launch``
keys the compiled kernel by the same facts Triton specialises on (the current device; per
tensor its dtype and whether its address is 16-byte aligned; per integer its width class
(int32, int64, uint64), whether it equals 1 and whether 16 divides it; the constexprs and
options in ``meta``) and launches it through the compiled kernel's own launcher on the
current stream. The first call of a key goes through ``kernel[grid]`` (which compiles if
needed), as does every call under the interpreter (``TRITON_INTERPRET=1``).

Launch hooks (profilers) still run: the compiled kernel's launcher calls them. Not re-read
once a key is cached: Triton's guard that the kernel's global constants have not changed (the
kernels here read module constants only as ``tl.constexpr`` values fixed at import), its
``pre_run_hooks`` (none are registered here), and the debug and instrumentation knobs
(``TRITON_DEBUG``, instrumentation modes): set those before the first launch of a process.
"""

from __future__ import annotations

from typing import Any

import torch
from triton.runtime import driver
from triton.runtime.jit import JITFunction

_INT32 = (-(2**31), 2**31 - 1)
_UINT64_FROM = 2**63
# (id(kernel), device index, meta items, argument specialisation) -> (compiled kernel,
# trailing constexpr values in signature order)
_COMPILED: dict[tuple, tuple[Any, tuple]] = {}


def specialization_key(kernel: object, device: int, args: tuple, meta: dict) -> tuple:
    """The cache key of one launch: equal keys mean Triton would run the same binary. Per
    tensor (dtype, 16-byte aligned); per int (int32, uint64, equals 1, 16 divides it); ``None``
    and bools as themselves; anything else by type and value. Inline: it runs on every call."""
    spec = [
        (a.dtype, not a.data_ptr() & 15)
        if isinstance(a, torch.Tensor)
        else (_INT32[0] <= a <= _INT32[1], a >= _UINT64_FROM, a == 1, not a & 15)
        if a.__class__ is int
        else a
        if a is None or a.__class__ is bool
        else (type(a), a)
        for a in args
    ]
    # Constexprs by type and value: Triton compiles True, 1 and 1.0 apart, which == does not.
    constexprs = tuple((k, v.__class__, v) for k, v in meta.items())
    return (id(kernel), device, constexprs, tuple(spec))


def launch(kernel: JITFunction, grid: tuple[int, ...], args: tuple, **meta: Any) -> None:
    """``kernel[grid](*args, **meta)`` on the current device and stream (``args``: the
    non-constexpr arguments in signature order; ``meta``: the constexprs and launch options
    such as ``num_warps``). Results are those of ``kernel[grid]``; later calls of the same
    key skip its per-call bookkeeping."""
    if not isinstance(kernel, JITFunction):  # the interpreter: nothing compiled to reuse
        kernel[grid](*args, **meta)
        return
    device = torch.cuda.current_device()
    key = specialization_key(kernel, device, args, meta)
    hit = _COMPILED.get(key)
    if hit is None:
        compiled = kernel[grid](*args, **meta)
        # Cached only when ``args`` are exactly the runtime arguments and every constexpr is
        # in ``meta`` (keyed by value): a constexpr among ``args`` would be keyed by class.
        names = kernel.arg_names[len(args) :]
        runtime_args = not any(p.is_constexpr for p in kernel.params[: len(args)])
        if compiled is not None and runtime_args and all(name in meta for name in names):
            _COMPILED[key] = (compiled, tuple(meta[name] for name in names))
        return
    compiled, constexprs = hit
    stream = driver.active.get_current_stream(device)
    compiled[(*grid, 1, 1)[:3]](*args, *constexprs, stream=stream)
