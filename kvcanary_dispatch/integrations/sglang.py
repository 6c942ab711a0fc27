"""Lift every kv-canary batch-size cap of a real sglang install, in one call.

```python
from kvcanary_dispatch.integrations import sglang as kvc_sglang
kvc_sglang.apply()          # before sglang's server starts its forward passes
```

Built against sglang 0.5.23's kv-canary code (``SGLANG_VERSION``). ``apply()`` patches:

1. ``launch_scatter_req_token_ids_kernel`` (capped at ``bs + 1 <= 512``) at every binding: its
   module and every ``sglang.*`` module that imported it by name -> the drop-in
   ``kvcanary_dispatch.launch_scatter_req_token_ids_kernel``;
2. ``launch_plan_offsets_kernel`` (capped at ``bs <= 4096``) likewise -> the drop-in
   ``kvcanary_dispatch.launch_plan_offsets_kernel``;
3. ``launch_canary_plan_kernels`` (its own ``bs <= 4096`` check and a 4 097-element scratch
   allocated per call) at every binding -> our plan offsets into a per-device scratch of
   ``>= bs + 1`` elements, then sglang's own CUDA entries kernel; off CUDA, sglang's torch
   reference as before (``_sglang_plan``);
4. ``SingleForwardManager``'s step methods: the two capacity ``RuntimeError``s become a policy
   (``"grow"``, the default; ``"skip"``; ``"raise"``: sglang's behaviour), see
   ``_sglang_steps`` and ``coverage()``.

``apply`` is idempotent (a second call only changes the policy), checks every feature before it
patches anything, and refuses a sglang whose kv-canary code differs (``IncompatibleSglangError``,
naming what is missing and the version this was built against). ``revert()`` puts back every
patched attribute, the exact original objects; ``applied(...)`` does both around a block.
sglang is imported only inside ``apply()``. Modules outside ``sglang.*`` that bound a launcher
by name before ``apply()`` keep what they bound.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import inspect
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from types import ModuleType

import torch

from kvcanary_dispatch import launch_plan_offsets_kernel, launch_scatter_req_token_ids_kernel
from kvcanary_kernels.args import SCRATCH_NAME, plan_signature

from ._sglang_plan import SCRATCH, make_launch_canary_plan_kernels
from ._sglang_steps import COVERAGE, POLICIES, CanaryCoverage, SkippedForward, make_manager_methods

SGLANG_VERSION = "0.5.23"
DEFAULT_POLICY = "grow"

_KV = "sglang.kernels.ops.kv_canary"
_SCATTER_MOD = f"{_KV}.scatter_req_token_ids"
_OFFSETS_MOD = f"{_KV}.plan.offsets_kernel"
_API_MOD = f"{_KV}.plan.api"
_MANAGER_MOD = "sglang.srt.kv_canary.single_forward_manager.manager"
# Modules that bind a patched function by name (checked to hold sglang's own object).
_EXPECTED_MOD = "sglang.srt.kv_canary.req_to_expected_token_ids_manager"
_BINDERS = {
    "launch_scatter_req_token_ids_kernel": (_EXPECTED_MOD,),
    "launch_plan_offsets_kernel": (_API_MOD,),
    "launch_canary_plan_kernels": (f"{_KV}.plan", "sglang.srt.kv_canary.runner.kernel_launcher"),
}

_SCATTER_KW = ("flat_in", "offsets", "req_pool_indices", "pool_out")
_PLAN_IN = ("req_pool_indices", "prefix_lens", "extend_seq_lens", "req_to_token")
_OFFSETS_KW = tuple(plan_signature(SCRATCH_NAME).parameters)  # upstream's launcher keywords
_API_KW = (
    "verify_plan_out",
    "write_plan_out",
    *_PLAN_IN,
    "swa_window_size",
    "full_to_swa_index_mapping",
    "verify_capacity",
    "req_to_verify_expected_tokens",
    "req_to_verify_expected_tokens_valid_lens",
    "kv_token_id_vs_position_offset",
)
_ENTRIES_KW = (
    "req_pool_indices",
    "prefix_lens",
    "req_to_token",
    "full_to_swa_index_mapping",
    "verify_offsets_scratch",
    "verify_enable",
    "req_to_verify_expected_tokens",
    "req_to_verify_expected_tokens_valid_lens",
    "out_verify_slot_indices",
    "out_verify_expected_tokens",
    "out_verify_expected_positions",
    "out_verify_prev_slot_indices",
    "kv_token_id_vs_position_offset",
    "swa_window_size",
)
_METHODS = {
    "pre_ops_outside_graph": ("self", "maybe_inaccurate_forward_batch"),
    "pre_ops_maybe_inside_graph": ("self", "forward_batch"),
    "post_ops_maybe_inside_graph": ("self", "forward_batch", "pre_ops_output"),
}
_INIT_ATTRS = (
    "_device",
    "_write_req_capacity",
    "_write_entry_capacity",
    "_phase_checker",
    "_output_buffer",
)
_PHASES = ("AFTER_PRE_OUT", "AFTER_PRE_MAYBE_IN", "AFTER_POST_MAYBE_IN")


class IncompatibleSglangError(RuntimeError):
    """The installed sglang's kv-canary code is not the code this integration was built for."""


@dataclass
class _Binding:
    owner: object  # a module, or the manager class
    name: str
    original: object
    replacement: object


class _State:
    lock = threading.RLock()
    bindings: list[_Binding] | None = None
    policy: str = DEFAULT_POLICY


def _sglang_version() -> str:
    try:
        from importlib.metadata import version

        return version("sglang")
    except Exception:  # metadata may be absent from a vendored tree
        return str(getattr(sys.modules.get("sglang"), "__version__", "unknown"))


def _params(fn: object) -> tuple[str, ...] | None:
    try:
        return tuple(inspect.signature(fn).parameters)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None


def _check_fn(problems: list[str], where: str, fn: object, params: tuple[str, ...]) -> None:
    if fn is None or not callable(fn):
        problems.append(f"{where} is missing")
    elif _params(fn) != params:
        problems.append(f"{where} has parameters {_params(fn)}, expected {params}")


def _import(problems: list[str], name: str) -> ModuleType | None:
    try:
        return importlib.import_module(name)
    except ImportError as err:
        problems.append(f"module {name} cannot be imported ({err})")
        return None


def _inspect_sglang() -> tuple[dict[str, ModuleType], list[str]]:
    """Import the kv-canary modules and check every feature the patches rely on."""
    problems: list[str] = []
    names = {_SCATTER_MOD, _OFFSETS_MOD, _API_MOD, _MANAGER_MOD}
    names.update(m for mods in _BINDERS.values() for m in mods)
    mods = {n: m for n in sorted(names) if (m := _import(problems, n)) is not None}
    defining = {
        "launch_scatter_req_token_ids_kernel": (_SCATTER_MOD, _SCATTER_KW),
        "launch_plan_offsets_kernel": (_OFFSETS_MOD, _OFFSETS_KW),
        "launch_canary_plan_kernels": (_API_MOD, _API_KW),
    }
    for fname, (mod_name, params) in defining.items():
        if mod_name not in mods:
            continue
        fn = getattr(mods[mod_name], fname, None)
        _check_fn(problems, f"{mod_name}.{fname}", fn, params)
        for binder in _BINDERS[fname]:
            if binder in mods and getattr(mods[binder], fname, None) is not fn:
                problems.append(f"{binder}.{fname} is not {mod_name}.{fname}")
    if _API_MOD in mods:
        api = mods[_API_MOD]
        torch_ref = getattr(api, "use_torch_reference", None)
        _check_fn(problems, f"{_API_MOD}.use_torch_reference", torch_ref, ("device",))
        entries = getattr(api, "launch_plan_entries_kernel", None)
        _check_fn(problems, f"{_API_MOD}.launch_plan_entries_kernel", entries, _ENTRIES_KW)
    if _MANAGER_MOD in mods:
        _inspect_manager(problems, mods[_MANAGER_MOD])
    return mods, problems


def _inspect_manager(problems: list[str], mod: ModuleType) -> None:
    cls = getattr(mod, "SingleForwardManager", None)
    where = f"{_MANAGER_MOD}.SingleForwardManager"
    if not isinstance(cls, type):
        problems.append(f"{where} is missing")
        return
    for name, params in _METHODS.items():
        _check_fn(problems, f"{where}.{name}", cls.__dict__.get(name), params)
    init_names = set(getattr(getattr(cls.__init__, "__code__", None), "co_names", ()))
    missing = [a for a in _INIT_ATTRS if a not in init_names]
    if missing:
        problems.append(f"{where}.__init__ does not set {missing}")
    pre_out = cls.__dict__.get("pre_ops_outside_graph")
    checked = set(getattr(getattr(pre_out, "__code__", None), "co_names", ()))
    if not {"_write_req_capacity", "_write_entry_capacity"} <= checked:
        problems.append(f"{where}.pre_ops_outside_graph no longer checks the write capacities")
    phases = getattr(mod, "_SingleForwardPhase", None)
    if phases is None or any(not hasattr(phases, p) for p in _PHASES):
        problems.append(f"{_MANAGER_MOD}._SingleForwardPhase lacks {_PHASES}")


def _sglang_modules() -> list[ModuleType]:
    """The loaded modules of the ``sglang`` package, in name order."""
    return [
        mod
        for name, mod in sorted(sys.modules.items())
        if (name == "sglang" or name.startswith("sglang.")) and isinstance(mod, ModuleType)
    ]


def _plan_bindings(mods: dict[str, ModuleType]) -> list[_Binding]:
    api = mods[_API_MOD]
    manager_mod = mods[_MANAGER_MOD]
    cls = manager_mod.SingleForwardManager
    plan_original = api.launch_canary_plan_kernels
    functions = {
        "launch_scatter_req_token_ids_kernel": (
            mods[_SCATTER_MOD].launch_scatter_req_token_ids_kernel,
            launch_scatter_req_token_ids_kernel,
        ),
        "launch_plan_offsets_kernel": (
            mods[_OFFSETS_MOD].launch_plan_offsets_kernel,
            launch_plan_offsets_kernel,
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
    originals = {name: cls.__dict__[name] for name in _METHODS}
    methods = make_manager_methods(manager_mod, originals, lambda: _State.policy)
    for name, fn in methods.items():
        bindings.append(_Binding(cls, name, originals[name], fn))
    return bindings


def _check_policy(policy: str) -> None:
    if policy not in POLICIES:
        raise ValueError(
            f"kvcanary-dispatch: sglang policy={policy!r} is not one of {', '.join(POLICIES)}"
        )


def apply(policy: str = DEFAULT_POLICY) -> None:
    """Patch the installed sglang (see the module docstring); ``policy`` decides what an
    oversized step does (``"grow"``, ``"skip"`` or ``"raise"``).

    Idempotent: when already applied, only the policy changes. Every feature is checked first;
    on any mismatch an ``IncompatibleSglangError`` lists them and nothing is patched. An
    ``ImportError`` when sglang itself is not importable.
    """
    _check_policy(policy)
    with _State.lock:
        if _State.bindings is not None:
            _State.policy = policy
            return
        if "sglang" not in sys.modules:
            spec = importlib.util.find_spec("sglang")
            if spec is None or spec.origin is None:  # absent, or a stray namespace folder
                raise ImportError("kvcanary-dispatch: sglang is not installed; nothing to patch")
        mods, problems = _inspect_sglang()
        if problems:
            raise IncompatibleSglangError(
                f"kvcanary-dispatch's sglang integration was built against sglang "
                f"{SGLANG_VERSION}'s kv-canary code and does not recognise this sglang "
                f"({_sglang_version()}); nothing was patched. Differences: " + "; ".join(problems)
            )
        bindings = _plan_bindings(mods)
        _State.policy = policy
        for b in bindings:
            setattr(b.owner, b.name, b.replacement)
        _State.bindings = bindings


def revert() -> None:
    """Undo ``apply()``: every patched attribute gets back sglang's original object, including
    bindings that sglang modules imported after ``apply()``. A no-op when not applied. The
    verify-offsets scratch stays allocated (captured graphs may still use it)."""
    with _State.lock:
        bindings = _State.bindings
        if bindings is None:
            return
        for b in reversed(bindings):
            setattr(b.owner, b.name, b.original)
        restore = {id(b.replacement): b for b in bindings}
        for mod in _sglang_modules():
            for name, value in list(vars(mod).items()):
                b = restore.get(id(value))
                if b is not None and value is b.replacement:
                    setattr(mod, name, b.original)
        _State.bindings = None
        _State.policy = DEFAULT_POLICY


@contextlib.contextmanager
def applied(policy: str = DEFAULT_POLICY) -> Iterator[None]:
    """``apply(policy)`` for the block. On exit: ``revert()`` if this block applied the patch,
    else the policy in force before the block is restored."""
    with _State.lock:
        was_applied = _State.bindings is not None
        previous = _State.policy
        apply(policy)
    try:
        yield
    finally:
        with _State.lock:
            if was_applied:
                _State.policy = previous
            else:
                revert()


def is_applied() -> bool:
    """Whether sglang is patched now."""
    return _State.bindings is not None


def current_policy() -> str:
    """The policy in force (``DEFAULT_POLICY`` when not applied)."""
    return _State.policy


def patched_attributes() -> list[tuple[object, str, object, object]]:
    """``(owner, name, original, replacement)`` for every attribute ``apply()`` replaced
    (empty when not applied)."""
    return [(b.owner, b.name, b.original, b.replacement) for b in _State.bindings or []]


def coverage() -> CanaryCoverage:
    """The live counters of the capacity policy (grown and skipped steps)."""
    return COVERAGE


def reserve_verify_offsets_scratch(device: torch.device | str | int, max_bs: int) -> torch.Tensor:
    """Size ``device``'s verify-offsets scratch for plan calls of up to ``max_bs`` requests now,
    outside capture: call it before capturing CUDA graphs at more than 4 096 requests."""
    return SCRATCH.reserve(device, max_bs)


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
