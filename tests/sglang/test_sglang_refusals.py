"""``apply()`` refuses an sglang it does not recognise, before it patches anything: each
difference is named in the ``IncompatibleSglangError`` (or the ``ImportError``), and every
binding still holds what it held."""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
import warnings

import pytest
import torch
from _sglang_loader import snapshot_bindings

import kvcanary_dispatch
from kvcanary_dispatch.integrations import _sglang_inspect
from kvcanary_dispatch.integrations import sglang as integration
from kvcanary_dispatch.integrations._sglang_inspect import METHODS, SGLANG_VERSION

pytest_plugins = ["_sglang_fixtures"]  # the kv fixture, and a clean patch state per test

API = "sglang.kernels.ops.kv_canary.plan.api"
MANAGER = "sglang.srt.kv_canary.single_forward_manager.manager.SingleForwardManager"


def _refusal(kv, changed: tuple[str, str] | None = None) -> str:
    """``apply()``'s refusal text; asserts nothing was patched (all but ``changed`` as before)."""
    before = snapshot_bindings(kv)
    with pytest.raises(integration.IncompatibleSglangError) as err:
        integration.apply()
    assert not integration.is_applied()
    after = snapshot_bindings(kv)
    assert all(after[k] is v for k, v in before.items() if k != changed)
    message = str(err.value)
    assert message.startswith("kvcanary-dispatch"), message
    assert "nothing was patched" in message and kv.version in message
    return message


@pytest.mark.parametrize(
    "module, name",
    [
        ("api", "launch_plan_entries_kernel"),
        ("scatter", "launch_scatter_req_token_ids_kernel"),
        ("manager", "_SingleForwardPhase"),
        ("api", "use_torch_reference"),
    ],
)
def test_unrecognised_sglang_is_refused_and_nothing_is_patched(kv, monkeypatch, module, name):
    """A missing function is named; on the version this integration was built for, the
    refusal suspects a double or tracer rather than another sglang."""
    monkeypatch.delattr(getattr(kv, module), name)
    message = _refusal(kv)
    assert f"built against sglang {SGLANG_VERSION}" in message and name in message
    built_for = kv.version == SGLANG_VERSION
    assert ("something else (a test double, a tracer)" in message) == built_for, message


def _elsewhere(**_):
    raise AssertionError("never called")


@pytest.mark.parametrize(
    "binder, name, defining",
    [
        ("plan_pkg", "launch_canary_plan_kernels", "api"),
        ("kernel_launcher", "launch_canary_plan_kernels", "api"),
        ("expected_mgr", "launch_scatter_req_token_ids_kernel", "scatter"),
        ("api", "launch_plan_offsets_kernel", "offsets"),
    ],
)
def test_a_by_name_import_that_is_not_sglangs_function_is_refused(
    kv, monkeypatch, binder, name, defining
):
    """A module that imported a replaced launcher by name must hold sglang's own function:
    patching the defining module would not reach another object."""
    monkeypatch.setattr(getattr(kv, binder), name, _elsewhere)
    message = _refusal(kv, changed=(binder, name))
    owner, home = getattr(kv, binder).__name__, getattr(kv, defining).__name__
    assert f"{owner}.{name} is {_elsewhere!r}, not {home}.{name}" in message, message


def test_a_manager_without_weak_references_is_refused(kv, monkeypatch):
    """Policy ``"grow"`` keeps each grown manager's capacities from before its growth by weak
    reference (for ``revert()``): a ``SingleForwardManager`` whose ``__slots__`` leave out
    ``__weakref__``, its methods and state otherwise sglang's, is refused and nothing is
    patched."""
    cls = kv.manager.SingleForwardManager
    namespace = {k: v for k, v in vars(cls).items() if k not in ("__dict__", "__weakref__")}
    namespace["__slots__"] = ()
    slotted = type(cls.__name__, (), namespace)
    monkeypatch.setattr(kv.manager, "SingleForwardManager", slotted)
    message = _refusal(kv)
    assert "SingleForwardManager instances take no weak references" in message, message


@pytest.mark.parametrize("missing", ["dependency", "module", "package"])
def test_a_kv_canary_module_that_cannot_be_imported(kv, monkeypatch, missing):
    """A kv-canary module whose import needs a package that is not installed (sglang installed
    without its dependencies) is an ``ImportError`` naming the module, the package and the
    fix; a kv-canary module this sglang does not have, or whose sglang package it lacks, is a
    difference of version. Either way nothing is patched."""
    name = "sglang.srt.kv_canary.single_forward_manager.manager"
    real_import = _sglang_inspect.importlib.import_module
    absent = {"dependency": "tvm_ffi", "module": name, "package": name.rsplit(".", 1)[0]}[missing]

    def import_module(module, *args):
        if module == name:
            raise ModuleNotFoundError(f"No module named {absent!r}", name=absent)
        return real_import(module, *args)

    monkeypatch.setattr(_sglang_inspect.importlib, "import_module", import_module)
    before = snapshot_bindings(kv)
    if missing != "dependency":
        message = _refusal(kv)
        assert f"module {name} cannot be imported (ModuleNotFoundError" in message, message
        return
    with pytest.raises(ImportError) as err:
        integration.apply()
    assert not isinstance(err.value, integration.IncompatibleSglangError)
    assert not integration.is_applied()
    after = snapshot_bindings(kv)
    assert all(after[k] is v for k, v in before.items())
    message = str(err.value)
    assert f"sglang's module {name} cannot be imported: it needs 'tvm_ffi'" in message, message
    assert "nothing was patched" in message and "pip install tvm_ffi" in message, message


def test_a_manager_init_that_sets_no_capacities_is_refused(kv, monkeypatch):
    """The capacity policies read and raise ``_write_req_capacity`` / ``_write_entry_capacity``:
    a manager whose ``__init__`` does not set them is refused, naming the two."""

    def __init__(self, *args, **kwargs):
        self._device = self._phase_checker = self._output_buffer = None

    monkeypatch.setattr(kv.manager.SingleForwardManager, "__init__", __init__)
    message = _refusal(kv)
    assert f"{MANAGER}.__init__ does not set ['_write_req_capacity', '_write_entry_capacity']" in (
        message
    )


def test_changed_signature_is_refused(kv, monkeypatch):
    def launch_plan_entries_kernel(*, req_pool_indices, prefix_lens):  # a different sglang
        raise AssertionError("never called")

    monkeypatch.setattr(kv.api, "launch_plan_entries_kernel", launch_plan_entries_kernel)
    message = _refusal(kv, changed=("api", "launch_plan_entries_kernel"))
    assert f"{API}.launch_plan_entries_kernel has parameters" in message


def _other_kinds(fn):
    """A stand-in for ``fn`` with its parameter names, each of another kind: keyword-only
    ones become positional-or-keyword, and the others after ``self`` keyword-only."""
    sig = inspect.signature(fn)
    params = [
        p.replace(kind=p.POSITIONAL_OR_KEYWORD if p.kind is p.KEYWORD_ONLY else p.KEYWORD_ONLY)
        if p.name != "self"
        else p
        for p in sig.parameters.values()
    ]

    def stand_in(*args, **kwargs):
        raise AssertionError("never called")

    stand_in.__signature__ = sig.replace(parameters=params)
    return stand_in


@pytest.mark.parametrize(
    "short, name",
    [
        ("scatter", "launch_scatter_req_token_ids_kernel"),
        ("offsets", "launch_plan_offsets_kernel"),
        ("api", "launch_canary_plan_kernels"),
        *(("manager", m) for m in METHODS),
    ],
)
def test_a_replaced_function_whose_parameters_changed_kind_is_refused(kv, monkeypatch, short, name):
    """The names alone are not the parameters: a replaced launcher or step method with sglang's
    names whose keyword-only parameters became positional (or the reverse) is refused, naming
    both signatures; a caller of one would fail inside the replacement, which keeps sglang's
    kinds."""
    owner = kv.manager.SingleForwardManager if short == "manager" else getattr(kv, short)
    original = vars(owner)[name]
    monkeypatch.setattr(owner, name, _other_kinds(original))
    message = _refusal(kv, changed=(short, name))
    params = inspect.signature(original).parameters.values()
    head = ["self"] if short == "manager" else []
    rest = [p.name for p in params if p.name != "self"]
    keyword_only = all(p.kind is p.KEYWORD_ONLY for p in params if p.name != "self")
    got, expected = head + rest, head + ["*"] + rest
    if not keyword_only:
        got, expected = expected, got
    where = MANAGER if short == "manager" else owner.__name__
    text = f"{where}.{name} has parameters ({', '.join(got)}), expected ({', '.join(expected)})"
    assert text in message, message
    assert short != "manager" or METHODS[name] == f"({', '.join(expected)})"


@pytest.mark.parametrize(
    "short, name",
    [("scatter", "launch_scatter_req_token_ids_kernel"), ("offsets", "launch_plan_offsets_kernel")],
)
def test_a_drop_in_installed_by_hand_is_refused_as_already_patched(kv, monkeypatch, short, name):
    """A caller who put ``kvcanary_dispatch``'s drop-in at sglang's launcher by hand: the drop-in
    is known by identity, so ``apply()`` refuses as over a patch already in place, naming the
    binding, instead of taking the drop-in for sglang's function (which ``revert()`` would then
    put back)."""
    monkeypatch.setattr(getattr(kv, short), name, getattr(kvcanary_dispatch, name))
    message = _refusal(kv, changed=(short, name))
    where = f"{getattr(kv, short).__name__}.{name} is already kvcanary-dispatch's replacement"
    assert where in message, message


def test_a_missing_step_method_is_refused(kv, monkeypatch):
    """A ``SingleForwardManager`` without one of the step methods the policy replaces (one
    inherited from a base class does not count: ``apply()`` patches the class's own)."""
    monkeypatch.delattr(kv.manager.SingleForwardManager, "post_ops_maybe_inside_graph")
    message = _refusal(kv)
    assert f"{MANAGER}.post_ops_maybe_inside_graph is missing" in message, message


def test_an_outside_hook_that_no_longer_checks_the_capacities_is_refused(kv, monkeypatch):
    """``"grow"`` raises the two capacities that sglang's outside hook checks: a hook with
    sglang's parameters that no longer reads them is refused, nothing patched."""

    def pre_ops_outside_graph(self, *, maybe_inaccurate_forward_batch):
        raise AssertionError(self._phase_checker)

    cls = kv.manager.SingleForwardManager
    monkeypatch.setattr(cls, "pre_ops_outside_graph", pre_ops_outside_graph)
    message = _refusal(kv, changed=("manager", "pre_ops_outside_graph"))
    assert "pre_ops_outside_graph no longer checks the write capacities" in message, message


def test_a_manager_that_no_longer_sizes_its_buffers_from_the_capacities_is_refused(kv, monkeypatch):
    """``"grow"`` raises the manager's two capacities: an sglang whose inside hook (same
    signature) sizes the step's buffers from something else is refused, nothing patched."""
    cls = kv.manager.SingleForwardManager

    def pre_ops_maybe_inside_graph(self, forward_batch):  # sized from another field
        raise AssertionError(self._plan_bs_capacity)

    monkeypatch.setattr(cls, "pre_ops_maybe_inside_graph", pre_ops_maybe_inside_graph)
    message = _refusal(kv, changed=("manager", "pre_ops_maybe_inside_graph"))
    assert "pre_ops_maybe_inside_graph no longer sizes its buffers from the write capacities" in (
        message
    )


def _apply_in_a_subprocess(prelude: str, extra_path: str) -> str:
    """Run ``apply()`` in a fresh interpreter after ``prelude``; its ImportError, printed."""
    code = (
        "import kvcanary_dispatch.integrations.sglang as s\n"
        f"{prelude}\n"
        "try:\n    s.apply()\nexcept ImportError as e:\n    print(type(e).__name__, e)\n"
        "assert not s.is_applied()\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([extra_path, *sys.path])}
    if not torch.cuda.is_available():
        env["TRITON_INTERPRET"] = "1"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


def test_an_sglang_that_fails_to_import_is_an_import_error_naming_why(tmp_path):
    """An installed sglang whose package ``__init__`` fails (a dependency missing, as after
    ``pip install --no-deps``) is an ``ImportError`` naming the failure and the fix, not what
    importing its submodules after it raises."""
    pkg = tmp_path / "sglang"
    (pkg / "srt").mkdir(parents=True)
    (pkg / "srt" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("from . import srt\nimport kvcanary_missing_dependency\n")
    out = _apply_in_a_subprocess("", str(tmp_path))
    assert out.startswith(
        "ImportError kvcanary-dispatch: sglang is installed but `import sglang` fails "
        "(ModuleNotFoundError: No module named 'kvcanary_missing_dependency'); nothing was "
        "patched. Install sglang with its dependencies (pip install sglang==0.5.23)"
    ), out


def test_a_folder_named_sglang_without_sglang_installed_is_not_an_install(tmp_path):
    """A stray ``sglang/`` folder (no ``__init__.py``: a namespace package) on the path, with
    no sglang installed, is "not installed", and nothing under it is imported."""
    (tmp_path / "sglang" / "srt").mkdir(parents=True)
    (tmp_path / "sglang" / "srt" / "__init__.py").write_text("raise SystemExit('imported')\n")
    # Take any installed sglang off the path (torch and the integration are imported first).
    hide = (
        "import importlib, importlib.util, os, sys\n"
        "spec = importlib.util.find_spec('sglang')\n"
        "if spec is not None and spec.origin is not None:\n"
        "    root = os.path.dirname(os.path.dirname(spec.origin))\n"
        "    sys.path[:] = [p for p in sys.path if os.path.abspath(p or '.') != root]\n"
        "importlib.invalidate_caches()\n"
        "assert importlib.util.find_spec('sglang').origin is None\n"
    )
    out = _apply_in_a_subprocess(hide, str(tmp_path))
    assert out == "ImportError kvcanary-dispatch: sglang is not installed; nothing to patch\n", out


def test_another_version_that_passes_the_checks_is_patched_with_a_warning(kv, monkeypatch):
    """The checks read names, parameters and state, not what sglang computes: another version
    that passes them is patched with a ``UserWarning`` at ``apply()``'s caller naming both
    versions; with warnings as errors that warning is a refusal that patches nothing; the
    version built for patches without one."""
    monkeypatch.setattr(_sglang_inspect, "sglang_version", lambda: "0.9.1")
    before = snapshot_bindings(kv)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(UserWarning, match=r"^kvcanary-dispatch: patching sglang 0\.9\.1,"):
            integration.apply()
    assert not integration.is_applied()
    assert all(snapshot_bindings(kv)[k] is v for k, v in before.items())
    with pytest.warns(UserWarning) as caught:
        integration.apply()
    assert integration.is_applied()
    text = str(caught[0].message)
    assert text.startswith(f"kvcanary-dispatch: patching sglang 0.9.1, not {SGLANG_VERSION}, ")
    assert text.endswith(f"pin sglang=={SGLANG_VERSION}") and caught[0].filename == __file__
    assert "run tests/sglang against sglang 0.9.1, or pin" in text, text
    integration.revert()
    monkeypatch.setattr(_sglang_inspect, "sglang_version", lambda: SGLANG_VERSION)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        integration.apply()
    assert integration.is_applied()
