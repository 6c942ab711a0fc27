"""What ``apply()`` checks before it patches: the installed sglang's kv-canary modules, the
functions and methods it replaces (present, with sglang 0.5.23's parameters, their names and
kinds, and not already patched) and the by-name imports that must hold sglang's own objects;
and the refusal's text.
Nothing of sglang is imported until ``import_sglang`` or ``inspect_sglang`` is called."""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import sys
from types import ModuleType

from kvcanary_dispatch import launch_plan_offsets_kernel, launch_scatter_req_token_ids_kernel
from kvcanary_kernels.args import SCRATCH_NAME, plan_signature

SGLANG_VERSION = "0.5.23"

_KV = "sglang.kernels.ops.kv_canary"
SCATTER_MOD = f"{_KV}.scatter_req_token_ids"
OFFSETS_MOD = f"{_KV}.plan.offsets_kernel"
API_MOD = f"{_KV}.plan.api"
MANAGER_MOD = "sglang.srt.kv_canary.single_forward_manager.manager"
# sglang's kernel registry: get_kernel(op) keeps, per op, what it first read from the op's
# module attribute (``_resolve``, an lru_cache), so it must forget those reads at each swap.
SELECTOR_MOD = "sglang.kernels.selector"
# Modules that bind a patched function by name (checked to hold sglang's own object).
_EXPECTED_MOD = "sglang.srt.kv_canary.req_to_expected_token_ids_manager"
_BINDERS = {
    "launch_scatter_req_token_ids_kernel": (_EXPECTED_MOD,),
    "launch_plan_offsets_kernel": (API_MOD,),
    "launch_canary_plan_kernels": (f"{_KV}.plan", "sglang.srt.kv_canary.runner.kernel_launcher"),
}


def _keywords(*names: str) -> str:
    """The parameters of a function that takes ``names`` as keywords only, as ``_params``
    writes them."""
    return f"(*, {', '.join(names)})"


_SCATTER_KW = _keywords("flat_in", "offsets", "req_pool_indices", "pool_out")
_PLAN_IN = ("req_pool_indices", "prefix_lens", "extend_seq_lens", "req_to_token")
_OFFSETS_KW = _keywords(*plan_signature(SCRATCH_NAME).parameters)  # upstream's launcher's
_API_KW = _keywords(
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
_ENTRIES_KW = _keywords(
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
# The step methods apply() replaces, and their parameters (names and kinds).
METHODS = {
    "pre_ops_outside_graph": "(self, *, maybe_inaccurate_forward_batch)",
    "pre_ops_maybe_inside_graph": "(self, forward_batch)",
    "post_ops_maybe_inside_graph": "(self, forward_batch, pre_ops_output)",
}
_INIT_ATTRS = (
    "_device",
    "_write_req_capacity",
    "_write_entry_capacity",
    "_phase_checker",
    "_output_buffer",
)
_PHASES = ("AFTER_PRE_OUT", "AFTER_PRE_MAYBE_IN", "AFTER_POST_MAYBE_IN")
# Set on every replacement this integration makes, to the replacement's own code object (the
# drop-ins are known by identity), so that a later apply() of any copy of this module
# recognises a patch already in place, and a wrapper made with functools.wraps, which copies
# the tag with the rest of the wrapped function's __dict__, is not taken for one.
REPLACEMENT_TAG = "_kvcanary_dispatch_replacement"
_DROP_INS = (launch_scatter_req_token_ids_kernel, launch_plan_offsets_kernel)


_ALREADY = "is already kvcanary-dispatch's replacement"


def is_replacement(obj: object) -> bool:
    if any(obj is d for d in _DROP_INS):
        return True
    tag = getattr(obj, REPLACEMENT_TAG, None)
    return tag is not None and tag is getattr(obj, "__code__", None)


def sglang_version() -> str:
    try:
        from importlib.metadata import version

        return version("sglang")
    except Exception:  # metadata may be absent from a vendored tree
        return str(getattr(sys.modules.get("sglang"), "__version__", "unknown"))


def _params(fn: object) -> str | None:
    """``fn``'s parameters, their names and kinds (``/``, ``*``, ``*args``, ``**kwargs``), as
    its signature writes them without annotations or defaults: ``(self, *, batch)``. A
    wrapper made with ``functools.wraps`` has the parameters of the function it wraps."""
    try:
        sig = inspect.signature(fn)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None
    bare = [p.replace(default=p.empty, annotation=p.empty) for p in sig.parameters.values()]
    return str(sig.replace(parameters=bare, return_annotation=sig.empty))


def _check_fn(problems: list[str], where: str, fn: object, params: str) -> None:
    if fn is None or not callable(fn):
        problems.append(f"{where} is missing")
    elif is_replacement(fn):
        problems.append(f"{where} {_ALREADY}")
    elif _params(fn) != params:
        problems.append(f"{where} has parameters {_params(fn)}, expected {params}")


def _import(problems: list[str], name: str) -> ModuleType | None:
    """sglang's module ``name``; ``None``, with the problem named, where this sglang has no
    such module or importing it fails inside sglang. A module it imports that is missing (a
    dependency of sglang, as after ``pip install --no-deps``) is an ``ImportError`` naming
    it: an incomplete install, not another sglang."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as err:
        missing = err.name or ""
        if missing and not (missing == name or name.startswith(missing + ".")):
            raise ImportError(
                f"kvcanary-dispatch: sglang's module {name} cannot be imported: it needs "
                f"{missing!r}, which is not installed ({err}); nothing was patched. Install "
                f"sglang with its dependencies (pip install sglang=={SGLANG_VERSION}, or pip "
                f"install {missing.split('.')[0]}), then call apply() again"
            ) from err
        problems.append(f"module {name} cannot be imported ({type(err).__name__}: {err})")
    except Exception as err:  # what a module of another sglang, or a half-imported one, raises
        problems.append(f"module {name} cannot be imported ({type(err).__name__}: {err})")
    return None


def import_sglang() -> None:
    """Import the ``sglang`` package itself first: an error there is an ``ImportError`` that
    names it (importing a submodule after a failed package import raises unrelated errors)."""
    if "sglang" in sys.modules:
        return
    spec = importlib.util.find_spec("sglang")
    if spec is None or spec.origin is None:  # absent, or a stray namespace folder
        raise ImportError("kvcanary-dispatch: sglang is not installed; nothing to patch")
    try:
        importlib.import_module("sglang")
    except Exception as err:
        raise ImportError(
            f"kvcanary-dispatch: sglang is installed but `import sglang` fails "
            f"({type(err).__name__}: {err}); nothing was patched. Install sglang with its "
            f"dependencies (pip install sglang=={SGLANG_VERSION}), then call apply() again"
        ) from err


def inspect_sglang() -> tuple[dict[str, ModuleType], list[str]]:
    """Import the kv-canary modules and check every feature the patches rely on."""
    problems: list[str] = []
    names = {SCATTER_MOD, OFFSETS_MOD, API_MOD, MANAGER_MOD}
    names.update(m for mods in _BINDERS.values() for m in mods)
    mods = {n: m for n in sorted(names) if (m := _import(problems, n)) is not None}
    defining = {
        "launch_scatter_req_token_ids_kernel": (SCATTER_MOD, _SCATTER_KW),
        "launch_plan_offsets_kernel": (OFFSETS_MOD, _OFFSETS_KW),
        "launch_canary_plan_kernels": (API_MOD, _API_KW),
    }
    for fname, (mod_name, params) in defining.items():
        if mod_name not in mods:
            continue
        fn = getattr(mods[mod_name], fname, None)
        _check_fn(problems, f"{mod_name}.{fname}", fn, params)
        for binder in _BINDERS[fname]:
            bound = getattr(mods[binder], fname, None) if binder in mods else fn
            if bound is not fn:
                problems.append(f"{binder}.{fname} is {bound!r}, not {mod_name}.{fname}")
    if API_MOD in mods:
        api = mods[API_MOD]
        torch_ref = getattr(api, "use_torch_reference", None)
        _check_fn(problems, f"{API_MOD}.use_torch_reference", torch_ref, "(device)")
        entries = getattr(api, "launch_plan_entries_kernel", None)
        _check_fn(problems, f"{API_MOD}.launch_plan_entries_kernel", entries, _ENTRIES_KW)
    if MANAGER_MOD in mods:
        _inspect_manager(problems, mods[MANAGER_MOD])
    return mods, problems


def _inspect_manager(problems: list[str], mod: ModuleType) -> None:
    cls = getattr(mod, "SingleForwardManager", None)
    where = f"{MANAGER_MOD}.SingleForwardManager"
    if not isinstance(cls, type):
        problems.append(f"{where} is missing")
        return
    for name, params in METHODS.items():
        _check_fn(problems, f"{where}.{name}", cls.__dict__.get(name), params)
    init_names = set(getattr(getattr(cls.__init__, "__code__", None), "co_names", ()))
    missing = [a for a in _INIT_ATTRS if a not in init_names]
    if missing:
        problems.append(f"{where}.__init__ does not set {missing}")
    # "grow" raises the two capacities: the outside hook must check them and the inside hook
    # size the step's buffers from them.
    for hook, does in (
        ("pre_ops_outside_graph", "checks"),
        ("pre_ops_maybe_inside_graph", "sizes its buffers from"),
    ):
        # Read through a wrapper that keeps the parameters (functools.wraps), as _check_fn does.
        method = cls.__dict__.get(hook)
        method = inspect.unwrap(method) if callable(method) else method
        names = set(getattr(getattr(method, "__code__", None), "co_names", ()))
        if not {"_write_req_capacity", "_write_entry_capacity"} <= names:
            problems.append(f"{where}.{hook} no longer {does} the write capacities")
    if not getattr(cls, "__weakrefoffset__", 1):  # __slots__ without __weakref__
        problems.append(
            f"{where} instances take no weak references (policy 'grow' keeps each grown "
            "manager's capacities from before its growth by one, for revert())"
        )
    phases = getattr(mod, "_SingleForwardPhase", None)
    if phases is None or any(not hasattr(phases, p) for p in _PHASES):
        problems.append(f"{MANAGER_MOD}._SingleForwardPhase lacks {_PHASES}")


def other_version_warning() -> str | None:
    """The warning ``apply()`` gives before it patches an sglang of another version than
    ``SGLANG_VERSION`` that passed every check (``None`` on that version): the checks read
    names, parameters and the manager's state, not what the functions compute."""
    version = sglang_version()
    if version == SGLANG_VERSION:
        return None
    return (
        f"kvcanary-dispatch: patching sglang {version}, not {SGLANG_VERSION}, the version this "
        "integration was built and tested against: its kv-canary functions have the names, "
        "parameters and manager state the patch relies on, but what they compute was not "
        f"checked; run tests/sglang against sglang {version}, or pin "
        f"sglang=={SGLANG_VERSION}"
    )


def refusal(problems: list[str]) -> str:
    """The ``IncompatibleSglangError`` text for ``inspect_sglang``'s ``problems``."""
    version = sglang_version()
    if any(_ALREADY in p for p in problems):
        return (
            f"kvcanary-dispatch: nothing was patched: sglang {version}'s kv-canary code already "
            "holds kvcanary-dispatch's patch, applied by another copy of this module (one loaded "
            "under another name or from another path) or put back by a patch that wrapped it: "
            "call revert() on the copy that applied it. Found: " + "; ".join(problems)
        )
    text = (
        f"kvcanary-dispatch's sglang integration was built against sglang {SGLANG_VERSION}'s "
        f"kv-canary code and does not recognise this sglang ({version}); nothing was patched. "
        "Differences: " + "; ".join(problems)
    )
    if version == SGLANG_VERSION:
        text += (
            f". This is sglang {SGLANG_VERSION}, the version this integration was built for: "
            "something else (a test double, a tracer) has probably replaced these functions; "
            "undo that patch, or apply kvcanary-dispatch before it"
        )
    return text
