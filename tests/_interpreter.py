"""Triton's CPU interpreter without its repeated patching of ``triton.language`` (test speed
only; nothing a kernel computes changes).

The interpreter runs a kernel by replacing the builtins of ``triton.language`` (and the modules
it names) with interpreted versions for the length of the launch, then restoring them. Each
call of a ``@triton.jit`` helper inside the kernel patches again: it walks every member of
those modules with ``inspect.getmembers`` and re-sets the tensor and type hooks, and the
result is thrown away (the builtins are already replaced; nothing is restored). Kernels that
call helpers in loops (``capped``'s tail search calls one a probe) spent much of their
interpreted time in that walk; ``tests/cpu_runs.md`` has the suite's times before and after.

``skip_repeated_patching`` wraps the interpreter's launches, to know which modules the running
launch has patched, and its patch function, so that a helper's call inside a launch whose
language modules that launch has already patched does nothing; any other call (a launch's
own, a helper naming a module the launch had not patched yet, such as ``tl.sum``, whose module
names ``triton.language.core``, a helper naming none, or a call outside any launch) patches as
before. Where the installed Triton has no such functions (its interpreter patches
differently), nothing is wrapped.
"""

from __future__ import annotations

import importlib

_ACTIVE: list[set[int]] = []  # each running launch: the language modules (ids) it has patched


def skip_repeated_patching() -> bool:
    """Wrap the interpreter's ``_patch_lang`` and its launches (once); ``True`` when wrapped."""
    interp = importlib.import_module("triton.runtime.interpreter")
    patch = getattr(interp, "_patch_lang", None)
    executor = getattr(interp, "GridExecutor", None)
    if patch is None or executor is None or not hasattr(interp, "_LangPatchScope"):
        return False
    if getattr(patch, "_kvcanary_wrapped", False):
        return True
    tl = importlib.import_module("triton.language")
    langs = (id(tl), id(tl.core))
    run = executor.__call__

    def launch(self, *args, **kwargs):
        _ACTIVE.append(set())  # filled by the launch's own patch, then by its helpers'
        try:
            return run(self, *args, **kwargs)
        finally:
            _ACTIVE.pop()

    def patch_once(fn):
        mine = {id(v) for v in fn.__globals__.values() if id(v) in langs}
        if _ACTIVE and mine and mine <= _ACTIVE[-1]:
            return interp._LangPatchScope()  # a helper's call: already patched, nothing to undo
        # A launch's own patch (undone as it ends), a helper naming a module the launch had not
        # patched (never undone: the interpreter drops that scope), or a call outside a launch.
        scope = patch(fn)
        if _ACTIVE:
            _ACTIVE[-1] |= mine
        return scope

    launch._kvcanary_wrapped = patch_once._kvcanary_wrapped = True
    executor.__call__ = launch
    interp._patch_lang = patch_once
    return True
