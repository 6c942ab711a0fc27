"""Triton's CPU interpreter without its repeated patching of ``triton.language`` (test speed
only; nothing a kernel computes changes).

The interpreter runs a kernel by replacing the builtins of ``triton.language`` (and the modules
it names) with interpreted versions for the length of the launch, then restoring them. Each
call of a ``@triton.jit`` helper inside the kernel patches again: it walks every member of
those modules with ``inspect.getmembers`` and re-sets the tensor and type hooks, and the
result is thrown away (the builtins are already replaced; nothing is restored). Kernels that
call helpers in loops (``capped``'s tail search calls one a probe) spent much of their
interpreted time in that walk; ``tests/cpu_runs.md`` has the suite's times before and after.

``skip_repeated_patching`` wraps the interpreter's patch function so that a helper's call whose
language modules the running launch has already patched does nothing; any other call (a
launch, or a helper naming a module the launch had not patched yet, such as ``tl.sum``, whose
module names ``triton.language.core``) patches as before. Where the
installed Triton has no such function (its interpreter patches differently), nothing is
wrapped.
"""

from __future__ import annotations

import importlib

_ACTIVE: list[set[int]] = []  # the language modules (ids) the running launch has patched


def skip_repeated_patching() -> bool:
    """Wrap the interpreter's ``_patch_lang`` (once); ``True`` when it is wrapped."""
    interp = importlib.import_module("triton.runtime.interpreter")
    patch = getattr(interp, "_patch_lang", None)
    if patch is None or not hasattr(interp, "_LangPatchScope"):
        return False
    if getattr(patch, "_kvcanary_wrapped", False):
        return True
    tl = importlib.import_module("triton.language")
    langs = (id(tl), id(tl.core))

    def patch_once(fn):
        mine = {id(v) for v in fn.__globals__.values() if id(v) in langs}
        if _ACTIVE and mine <= _ACTIVE[-1]:
            return interp._LangPatchScope()  # a helper's call: already patched, nothing to undo
        scope = patch(fn)
        if _ACTIVE:  # a helper naming a module the launch had not patched: its patch is never
            _ACTIVE[-1] |= mine  # undone (the interpreter drops the scope), so it holds
            return scope
        _ACTIVE.append(mine)
        restore = scope.restore

        def restore_and_close() -> None:
            _ACTIVE.pop()
            restore()

        scope.restore = restore_and_close
        return scope

    patch_once._kvcanary_wrapped = True
    interp._patch_lang = patch_once
    return True
