"""Lift every kv-canary batch-size cap of a real sglang install, in one call.

```python
from kvcanary_dispatch.integrations import sglang as kvc_sglang
kvc_sglang.apply()          # before sglang's server starts its forward passes
```

Built against sglang 0.5.23's kv-canary code (``SGLANG_VERSION``). ``apply()`` patches:

1. ``launch_scatter_req_token_ids_kernel`` (capped at ``bs + 1 <= 512``) at every binding: its
   module and every ``sglang.*`` module that imported it by name -> the drop-in
   ``kvcanary_dispatch.launch_scatter_req_token_ids_kernel``, through a function of each
   patch's own (``__wrapped__``: the drop-in);
2. ``launch_plan_offsets_kernel`` (capped at ``bs <= 4096``) likewise -> the drop-in
   ``kvcanary_dispatch.launch_plan_offsets_kernel``, its ``swa_window_size`` and
   ``verify_capacity`` read as sglang's launcher reads them (``_sglang_plan``);
3. ``launch_canary_plan_kernels`` (its own ``bs <= 4096`` check) at every binding -> our plan
   offsets into a scratch of ``bs + 1`` elements allocated per call (as sglang allocates its
   4 097), then sglang's own CUDA entries kernel; off CUDA, sglang's torch reference as before
   (``_sglang_plan``);
4. ``SingleForwardManager``'s step methods: the two capacity ``RuntimeError``s become a policy
   (``"grow"``, the default; ``"skip"``; ``"raise"``: sglang's behaviour), see
   ``_sglang_steps`` and ``coverage()``.

``apply`` is idempotent (a second call only changes the policy), checks every feature before it
patches anything, and refuses a sglang whose kv-canary functions, by-name imports or manager
state differ from 0.5.23's (names, and parameters' names and kinds: not what the functions
compute), that another copy of this integration has already patched, or whose functions
something else changed (their parameters, or another object bound under one of their names;
a wrapper keeping the parameters is taken as sglang's function) (``IncompatibleSglangError``,
naming what differs and the version this was built against). Another version that passes
these checks is patched with a ``UserWarning`` naming both versions.
``revert()`` puts back every patched attribute that still holds this integration's
replacement, the exact original objects (an attribute patched again since is left, with a
warning, until a later ``revert()`` or ``apply()`` finds that patch undone; a step method
left inside such a patch then acts as sglang's own), and gives managers grown under
``"grow"`` their capacities back; call it between forward steps. ``applied(...)`` does both
around a block; overlapping blocks (other threads) keep a patch one of them put until the
last of them ends, the newest open block's policy in force. The policy is process-wide; an
``importlib.reload`` of this module keeps the patch's record and policy. sglang is imported
only inside ``apply()``. Modules outside ``sglang.*`` that bound a launcher by name before
``apply()`` keep what they bound (those that bound it while applied get sglang's back at
``revert()``), as does a caller of sglang's ``get_kernel(op)`` that keeps
the callable it returned; ``get_kernel`` itself looks the launchers up again after
``apply()`` and ``revert()``.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import threading
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import ModuleType

import torch

from kvcanary_dispatch import launch_scatter_req_token_ids_kernel

from ._sglang_inspect import (
    API_MOD,
    MANAGER_MOD,
    METHODS,
    OFFSETS_MOD,
    REPLACEMENT_TAG,
    SCATTER_MOD,
    SELECTOR_MOD,
    SGLANG_VERSION,
    import_sglang,
    inspect_sglang,
    is_replacement,
    other_version_warning,
    refusal,
)
from ._sglang_plan import make_launch_canary_plan_kernels, make_launch_plan_offsets_kernel
from ._sglang_steps import (
    COVERAGE,
    POLICIES,
    CanaryCoverage,
    SkippedForward,
    make_manager_methods,
    restore_capacities,
)

DEFAULT_POLICY = "grow"


class IncompatibleSglangError(RuntimeError):
    """The installed sglang's kv-canary code is not the code this integration was built for."""


@dataclass
class _Binding:
    owner: object  # a module, or the manager class
    name: str
    original: object
    replacement: object


class _PatchState:
    lock = threading.RLock()
    bindings: list[_Binding] | None = None
    base: str = DEFAULT_POLICY  # what apply() set: in force while no applied() block is open
    blocks: list[tuple[object, str]] = []  # open applied() blocks (token, policy), oldest first
    owned: bool = False  # an applied() block put the patch, and no apply() came since
    left: list[_Binding] = []  # bindings revert() left inside another patch


# importlib.reload runs this module again in its own namespace: the patch's record is kept,
# so that revert() still undoes it and the wrappers keep the policy applied.
_State = globals().get("_State", _PatchState)
# A state kept from an earlier version of this module lacks the fields added since.
if not isinstance(getattr(_State, "blocks", None), list):
    _State.blocks = []  # an earlier version counted open blocks instead
if not hasattr(_State, "left"):
    _State.left = []
if not hasattr(_State, "base"):
    _State.base = getattr(_State, "policy", DEFAULT_POLICY)  # an earlier version's one field


def _applied_policy() -> str:
    """The policy while applied: the newest open ``applied`` block's, else ``apply()``'s."""
    blocks = _State.blocks  # read once: another thread's block may end between two reads
    return blocks[-1][1] if blocks else _State.base


def _policy_in_force() -> str:
    """What the step wrappers do: the applied policy, or sglang's own behaviour (``"raise"``)
    once reverted (a wrapper that ``revert()`` had to leave in place, inside another patch)."""
    return _applied_policy() if _State.bindings is not None else "raise"


def _sglang_modules() -> list[ModuleType]:
    """The loaded modules of the ``sglang`` package, in name order."""
    return [
        mod
        for name, mod in sorted(sys.modules.items())
        if (name == "sglang" or name.startswith("sglang.")) and isinstance(mod, ModuleType)
    ]


def _plan_bindings(mods: dict[str, ModuleType]) -> list[_Binding]:
    api = mods[API_MOD]
    manager_mod = mods[MANAGER_MOD]
    cls = manager_mod.SingleForwardManager
    plan_original = api.launch_canary_plan_kernels
    functions = {
        "launch_scatter_req_token_ids_kernel": (
            mods[SCATTER_MOD].launch_scatter_req_token_ids_kernel,
            _make_launch_scatter(),
        ),
        "launch_plan_offsets_kernel": (
            mods[OFFSETS_MOD].launch_plan_offsets_kernel,
            make_launch_plan_offsets_kernel(),
        ),
        "launch_canary_plan_kernels": (
            plan_original,
            make_launch_canary_plan_kernels(api, plan_original),
        ),
    }
    bindings: list[_Binding] = []
    for name, (original, replacement) in functions.items():
        # Every sglang module that holds sglang's own object under this name, the defining
        # module and the by-name importers alike (sglang.test helpers included).
        for mod in _sglang_modules():
            if vars(mod).get(name) is original:
                bindings.append(_Binding(mod, name, original, replacement))
    originals = {name: cls.__dict__[name] for name in METHODS}
    methods = make_manager_methods(manager_mod, originals, _policy_in_force)
    for name, fn in methods.items():
        bindings.append(_Binding(cls, name, originals[name], fn))
    for b in bindings:
        if not is_replacement(b.replacement):
            setattr(b.replacement, REPLACEMENT_TAG, b.replacement.__code__)
    return bindings


def _make_launch_scatter() -> Callable[..., None]:
    """``kvcanary_dispatch.launch_scatter_req_token_ids_kernel`` (same keywords) as a function
    of its own, one a patch: a binding ``revert()`` left inside another patch then never holds
    a later patch's replacement, which ``_restore_left`` would take for that patch undone."""

    @functools.wraps(launch_scatter_req_token_ids_kernel)  # its keywords, which apply() checks
    def launch(
        *,
        flat_in: torch.Tensor,
        offsets: torch.Tensor,
        req_pool_indices: torch.Tensor,
        pool_out: torch.Tensor,
    ) -> None:
        launch_scatter_req_token_ids_kernel(
            flat_in=flat_in, offsets=offsets, req_pool_indices=req_pool_indices, pool_out=pool_out
        )

    return launch


def _check_policy(policy: str) -> None:
    if policy not in POLICIES:
        raise ValueError(
            f"kvcanary-dispatch: sglang policy={policy!r} is not one of {', '.join(POLICIES)}"
        )


def apply(policy: str = DEFAULT_POLICY) -> None:
    """Patch the installed sglang (see the module docstring); ``policy`` decides what an
    oversized step does (``"grow"``, ``"skip"`` or ``"raise"``).

    Idempotent: when already applied, only the policy changes, at once and for good: the
    ``applied`` blocks open now leave it in force when they end, and the patch stays when
    they end even if one of them put it. Every feature is checked first;
    on any mismatch an ``IncompatibleSglangError`` lists them and nothing is patched. An
    ``ImportError`` when sglang itself is not importable.
    """
    _check_policy(policy)
    with _State.lock:
        bindings = _bindings_to_patch()
        # In force at once, and as each applied() block open now ends.
        _State.base = policy
        _State.blocks = [(token, policy) for token, _ in _State.blocks]
        _State.owned = False  # apply()'s patch now: no block's end reverts it
        _patch(bindings)


def _bindings_to_patch() -> list[_Binding] | None:
    """What ``apply`` patches, every check passed (``None`` when already applied); raises
    before anything is patched or recorded. Call under the lock."""
    if _State.bindings is not None:
        return None
    _restore_left()
    import_sglang()
    mods, problems = inspect_sglang()
    if problems:
        raise IncompatibleSglangError(refusal(problems))
    bindings = _plan_bindings(mods)
    other = other_version_warning()
    if other is not None:
        warnings.warn(other, stacklevel=3)  # at apply()'s caller
    return bindings


def _patch(bindings: list[_Binding] | None) -> None:
    """Put ``_bindings_to_patch()``'s replacements in place (nothing for ``None``), once the
    policy they will find is recorded. Call under the lock."""
    if bindings is None:
        return
    _State.bindings = bindings  # first: a step that finds a wrapper finds the policy too
    for b in bindings:
        setattr(b.owner, b.name, b.replacement)
    _forget_registry_lookups()


def _forget_registry_lookups() -> None:
    """sglang's ``get_kernel(op)`` returns what it read from the op's module attribute the
    first time, kept in an lru_cache: emptied here after every swap, so the next lookup
    reads the attribute now in place (a callable already looked up stays what it was, as a
    by-name import does). Nothing when the registry is not loaded or has no such cache."""
    resolve = getattr(sys.modules.get(SELECTOR_MOD), "_resolve", None)
    if callable(getattr(resolve, "cache_clear", None)):
        resolve.cache_clear()


def _holds(owner: object, name: str) -> object:
    return (vars(owner) if isinstance(owner, ModuleType) else owner.__dict__).get(name)


_NONE_RESTORED = object()


def _restore_left() -> dict[tuple[int, str], object]:
    """Put sglang's original back at every binding an earlier ``revert()`` left inside another
    patch that has since been undone (it holds this integration's replacement again); forget
    those that hold the original again. Returns the originals put back, by owner and name."""
    still, restored = [], {}
    for b in _State.left:
        held = _holds(b.owner, b.name)
        if held is b.replacement:
            setattr(b.owner, b.name, b.original)
            restored[id(b.owner), b.name] = b.original
        elif held is not b.original:
            still.append(b)
    _State.left = still
    if restored:
        _forget_registry_lookups()
    return restored


def revert() -> None:
    """Undo ``apply()``: every patched attribute that still holds this integration's
    replacement gets back sglang's original object, including bindings that modules (sglang's
    or others) imported by name after ``apply()``; one that something else has patched since
    is left as it is, with a ``RuntimeWarning`` naming it (a step method of this integration
    reached through such a patch then runs sglang's own, as under ``"raise"``). Managers grown
    under ``"grow"`` get back their capacities from before their first growth. When not
    applied, it only puts sglang's originals back at the bindings an earlier ``revert()`` left
    inside a patch undone since. Call it between forward steps: a step skipped under
    ``"skip"`` needs the patched post hook."""
    with _State.lock:
        restored = _restore_left()
        bindings = _State.bindings
        if bindings is None:
            return
        left = []
        for b in reversed(bindings):
            held = _holds(b.owner, b.name)
            if held is b.replacement:
                setattr(b.owner, b.name, b.original)
            elif held is b.original:
                pass  # something has put back what apply() found: nothing is left to undo
            elif held is not restored.get((id(b.owner), b.name), _NONE_RESTORED):
                # (Unless this apply() patched over a patch an earlier revert() left, which,
                # undone since, put the earlier replacement back: sglang's own is back now.)
                owner = getattr(b.owner, "__name__", repr(b.owner))
                left.append(f"{owner}.{b.name} (now {held!r})")
                _State.left.append(b)
        restore = {id(b.replacement): b for b in bindings}
        # Every loaded module, not only sglang's: one outside it that bound a replacement by
        # name while applied (a plugin importing the launcher) gets sglang's back too.
        for mod in [m for m in list(sys.modules.values()) if isinstance(m, ModuleType)]:
            for name, value in list(vars(mod).items()):
                b = restore.get(id(value))
                if b is not None and value is b.replacement:
                    setattr(mod, name, restored.get((id(b.owner), b.name), b.original))
        _forget_registry_lookups()
        restore_capacities()
        _State.bindings = None
        _State.base = DEFAULT_POLICY
        _State.owned = False
    if left:
        warnings.warn(
            "kvcanary-dispatch: revert() left " + "; ".join(left) + " as they are: something "
            "patched them after apply(); a step method of this integration still reached "
            "through them runs sglang's own (oversized steps raise). Undo that patch, then "
            "call revert() again (or apply()) to get sglang's originals back",
            RuntimeWarning,
            stacklevel=2,
        )


@contextlib.contextmanager
def applied(policy: str = DEFAULT_POLICY) -> Iterator[None]:
    """``apply(policy)`` for the block. On exit: ``revert()`` once no ``applied`` block is
    open, if one of them applied the patch and ``apply()`` was not called since; else the
    policy of the newest block still open is in force, or, with none open, the one ``apply()``
    last set. The policy is process-wide: blocks open in other threads share it."""
    _check_policy(policy)
    token = object()
    with _State.lock:
        bindings = _bindings_to_patch()
        _State.blocks.append((token, policy))
        if bindings is not None:
            _State.owned = True
        _patch(bindings)
    try:
        yield
    finally:
        with _State.lock:
            _State.blocks = [b for b in _State.blocks if b[0] is not token]
            if _State.owned and not _State.blocks:
                revert()


def is_applied() -> bool:
    """Whether sglang is patched now."""
    return _State.bindings is not None


def current_policy() -> str:
    """The policy that ``apply()`` or the newest open ``applied`` block set, in force while
    applied; ``DEFAULT_POLICY`` when not applied (sglang's own code runs then, and a step
    method that ``revert()`` left inside another patch acts as under ``"raise"``)."""
    return _applied_policy() if _State.bindings is not None else DEFAULT_POLICY


def patched_attributes() -> list[tuple[object, str, object, object]]:
    """``(owner, name, original, replacement)`` for every attribute ``apply()`` replaced
    (empty when not applied)."""
    return [(b.owner, b.name, b.original, b.replacement) for b in _State.bindings or []]


def coverage() -> CanaryCoverage:
    """The live counters of the capacity policy (grown and skipped steps)."""
    return COVERAGE


def reserve_verify_offsets_scratch(device: torch.device | str | int, max_bs: int) -> None:
    """Deprecated; does nothing. Each plan call allocates its own verify-offsets scratch (as
    sglang does), so nothing needs reserving before capturing CUDA graphs. Kept so that
    existing calls keep working; it warns with a ``DeprecationWarning``."""
    warnings.warn(
        "kvcanary-dispatch: reserve_verify_offsets_scratch() is no longer needed and does "
        "nothing: each plan call allocates its own scratch; remove the call",
        DeprecationWarning,
        stacklevel=2,
    )


__all__ = [
    "DEFAULT_POLICY",
    "POLICIES",
    "SGLANG_VERSION",
    "CanaryCoverage",
    "IncompatibleSglangError",
    "SkippedForward",
    "applied",
    "apply",
    "coverage",
    "is_applied",
    "patched_attributes",
    "current_policy",
    "reserve_verify_offsets_scratch",
    "revert",
]
