"""Load an installed sglang's kv-canary modules without its serving stack (test side only).

``sglang/__init__.py`` imports the whole server (and the packages it needs). This creates
empty package modules for ``sglang`` and the parents of its kv-canary code, with ``__path__``
pointing into the installed tree, so ``sglang.kernels.ops.kv_canary.*``, ``sglang.srt.kv_canary.*``
and ``sglang.test.kernels.kv_canary.*`` import as shipped without any parent ``__init__`` running.
``stub_jit=True`` also puts a stub ``sglang.kernels.jit.utils`` in place (``cache_once``,
``load_jit``, ``make_cpp_args``, ``is_arch_support_pdl``) for machines without CUDA JIT; with
``stub_jit=False`` the real JIT utilities load (the GPU script uses them to build sglang's CUDA
kernels). Nothing of sglang is copied: every module is sglang's own file; the stubs are ours.
"""

from __future__ import annotations

import functools
import importlib
import importlib.machinery
import sys
import types
from pathlib import Path

KV_CANARY_PROBE = Path("kernels/ops/kv_canary/plan/api.py")
_SHELLS = (
    "sglang",
    "sglang.kernels",
    "sglang.kernels.ops",
    "sglang.kernels.ops.kv_canary",
    "sglang.kernels.jit",
    "sglang.srt",
    "sglang.test",
    "sglang.test.kernels",
)
_SHELL_FLAG = "__kvcanary_test_shell__"
# The modules the tests and the GPU script use, by short name.
MODULES = {
    "consts": "sglang.kernels.ops.kv_canary.consts",
    "scatter": "sglang.kernels.ops.kv_canary.scatter_req_token_ids",
    "offsets": "sglang.kernels.ops.kv_canary.plan.offsets_kernel",
    "api": "sglang.kernels.ops.kv_canary.plan.api",
    "plan_pkg": "sglang.kernels.ops.kv_canary.plan",
    "plan_ref": "sglang.kernels.ops.kv_canary.plan_ref",
    "verify": "sglang.kernels.ops.kv_canary.verify",
    "verify_ref": "sglang.kernels.ops.kv_canary.verify_ref",
    "write": "sglang.kernels.ops.kv_canary.write",
    "write_ref": "sglang.kernels.ops.kv_canary.write_ref",
    "scatter_ref": "sglang.test.kernels.kv_canary.scatter_req_token_ids_reference",
    "differential": "sglang.test.kernels.kv_canary._differential",
    "fuzz_driver": "sglang.test.kernels.kv_canary._fuzz_driver",
    "invariants": "sglang.test.kernels.kv_canary._invariants",
    "helpers": "sglang.test.kernels.kv_canary._canary_helpers",
}
SRT_MODULES = {
    "expected_mgr": "sglang.srt.kv_canary.req_to_expected_token_ids_manager",
    "kernel_launcher": "sglang.srt.kv_canary.runner.kernel_launcher",
    "manager": "sglang.srt.kv_canary.single_forward_manager.manager",
    "config": "sglang.srt.kv_canary.config",
    "state": "sglang.srt.kv_canary.state",
    "buffer_group": "sglang.srt.kv_canary.buffer_group",
    "endpoint": "sglang.srt.kv_canary.endpoint",
}


class SglangMissing(RuntimeError):
    """No installed sglang with kv-canary code was found on ``sys.path``."""


def find_sglang_root() -> Path:
    """The installed ``sglang`` package directory (a regular package holding kv-canary code)."""
    for entry in sys.path:
        root = Path(entry or ".") / "sglang"
        if (root / "__init__.py").is_file() and (root / KV_CANARY_PROBE).is_file():
            return root.resolve()
    raise SglangMissing(
        "sglang is not installed (no sglang/kernels/ops/kv_canary on sys.path); install it "
        'with its test extra: pip install -e ".[sglang-test]" && '
        "pip install --no-deps sglang==0.5.23"
    )


def _stub_jit_utils() -> types.ModuleType:
    stub = types.ModuleType("sglang.kernels.jit.utils")

    def cache_once(fn):
        return functools.cache(fn)

    def load_jit(*args, **kwargs):
        raise RuntimeError("sglang's CUDA JIT is stubbed out on this machine (no CUDA)")

    def make_cpp_args(*args):
        return ", ".join(str(a).lower() if isinstance(a, bool) else str(a) for a in args)

    def is_arch_support_pdl(*args, **kwargs):
        return False

    stub.cache_once = cache_once
    stub.load_jit = load_jit
    stub.make_cpp_args = make_cpp_args
    stub.is_arch_support_pdl = is_arch_support_pdl
    setattr(stub, _SHELL_FLAG, True)
    return stub


def _stub_srt_utils(root: Path) -> tuple[types.ModuleType, types.ModuleType]:
    """``sglang.srt.utils`` without its ``__init__`` (which imports the serving stack): its
    submodules (``phase_checker``) load from sglang's files, and ``sglang.srt.utils.common`` is a
    stub with the four names the kv-canary and JIT code import from it."""
    pkg = types.ModuleType("sglang.srt.utils")
    common = types.ModuleType("sglang.srt.utils.common")

    def is_cuda() -> bool:
        import torch

        return torch.cuda.is_available() and torch.version.cuda is not None

    def get_cuda_version() -> tuple[int, ...]:
        import torch

        return tuple(map(int, torch.version.cuda.split("."))) if torch.version.cuda else (0, 0)

    def is_device_stream_capturing(device) -> bool:
        import torch

        device = torch.device(device)
        if device.type != "cuda":
            return False
        with torch.cuda.device(device):
            return torch.cuda.is_current_stream_capturing()

    def flatten_arrays_to_int64_tensor(*args, **kwargs):
        raise NotImplementedError("stubbed sglang.srt.utils.common (kvcanary-dispatch tests)")

    names = (is_cuda, get_cuda_version, is_device_stream_capturing, flatten_arrays_to_int64_tensor)
    for module in (pkg, common):
        for fn in names:
            setattr(module, fn.__name__, fn)
        setattr(module, _SHELL_FLAG, True)
    path = str(root / "srt" / "utils")
    spec = importlib.machinery.ModuleSpec(pkg.__name__, None, is_package=True)
    spec.submodule_search_locations = [path]
    pkg.__spec__, pkg.__path__, pkg.__package__ = spec, [path], pkg.__name__
    pkg.common = common
    return pkg, common


def install_shells(*, stub_jit: bool, stub_srt_utils: bool = False) -> Path:
    """Create the empty parent packages (idempotent) and return the sglang root."""
    current = sys.modules.get("sglang")
    if current is not None and not getattr(current, _SHELL_FLAG, False):
        return Path(current.__path__[0])  # a real, fully imported sglang: use it as it is
    root = find_sglang_root()
    for name in _SHELLS:
        if name in sys.modules:
            continue
        path = root.joinpath(*name.split(".")[1:])
        # origin names the package's __init__.py (not executed): sglang's JIT finds its sources
        # through importlib.util.find_spec("sglang.kernels.jit").origin.
        init = str(path / "__init__.py")
        spec = importlib.machinery.ModuleSpec(name, None, origin=init, is_package=True)
        spec.submodule_search_locations = [str(path)]
        module = types.ModuleType(name)
        module.__spec__ = spec
        module.__file__ = init
        module.__path__ = [str(path)]
        module.__package__ = name
        setattr(module, _SHELL_FLAG, True)
        sys.modules[name] = module
        if "." in name:
            parent, _, child = name.rpartition(".")
            setattr(sys.modules[parent], child, module)
    if stub_srt_utils and "sglang.srt.utils" not in sys.modules:
        pkg, common = _stub_srt_utils(root)
        sys.modules["sglang.srt.utils"], sys.modules["sglang.srt.utils.common"] = pkg, common
        sys.modules["sglang.srt"].utils = pkg
    if stub_jit and "sglang.kernels.jit.utils" not in sys.modules:
        sys.modules["sglang.kernels.jit.utils"] = _stub_jit_utils()
        sys.modules["sglang.kernels.jit"].utils = sys.modules["sglang.kernels.jit.utils"]
    return root


def load_kv_canary(
    *, stub_jit: bool, srt: bool = True, stub_srt_utils: bool = False
) -> types.SimpleNamespace:
    """Import sglang's kv-canary modules (``MODULES``, plus ``SRT_MODULES`` when ``srt``) and
    return them by short name, with ``root`` and ``version``. ``SglangMissing`` if absent.
    ``stub_srt_utils`` loads ``sglang.srt.utils`` without its ``__init__`` and stubs its
    ``common`` module (``_stub_srt_utils``), sparing the packages the real ones import (the GPU
    script uses this: that machine lacks them)."""
    root = install_shells(stub_jit=stub_jit, stub_srt_utils=stub_srt_utils)
    names = dict(MODULES, **(SRT_MODULES if srt else {}))
    mods = {short: importlib.import_module(full) for short, full in names.items()}
    try:
        from importlib.metadata import version

        ver = version("sglang")
    except Exception:
        ver = "unknown"
    return types.SimpleNamespace(root=root, version=ver, **mods)


# Every binding the integration patches: function name -> the kv short names that hold it.
BINDINGS = {
    "launch_scatter_req_token_ids_kernel": ("scatter", "expected_mgr"),
    "launch_plan_offsets_kernel": ("offsets", "api"),
    "launch_canary_plan_kernels": ("api", "plan_pkg", "kernel_launcher", "differential"),
}
METHODS = ("pre_ops_outside_graph", "pre_ops_maybe_inside_graph", "post_ops_maybe_inside_graph")


def snapshot_bindings(kv) -> dict:
    """The objects every patched binding and step method holds now, by (owner, name)."""
    snap = {
        (short, name): vars(getattr(kv, short)).get(name)
        for name, shorts in BINDINGS.items()
        for short in shorts
    }
    cls = kv.manager.SingleForwardManager
    snap.update({("manager", m): cls.__dict__.get(m) for m in METHODS})
    return snap
