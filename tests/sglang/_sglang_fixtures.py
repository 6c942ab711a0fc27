"""Fixtures of the sglang integration tests (``kv``, ``forced``, ``engine_env``, and a clean
patch state per test): load the installed sglang's kv-canary modules once (without its
serving stack, see ``_sglang_loader``) and undo every patch after each test. Each test module
here loads this plugin (``pytest_plugins = ["_sglang_fixtures"]``): a
``tests/sglang/conftest.py`` would be imported under the module name ``conftest`` and replace
tests/conftest.py for the tests that ``from conftest import ...``.

They drive sglang's code on CPU tensors through Triton's interpreter (``TRITON_INTERPRET=1``,
which tests/conftest.py sets on machines without a GPU). Every test here skips, with the
reason, when sglang is not installed, or on a GPU machine without ``TRITON_INTERPRET=1`` (there
tests/gpu/sglang_cuda.py runs sglang's CUDA kernels instead). CI installs sglang: the
``sglang-test`` extra plus ``pip install --no-deps sglang==0.5.23``.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import torch
from _sglang_cases import ENTRIES_SCRATCH, use_kernel_path
from _sglang_engine import NoPinTorch
from _sglang_loader import SglangMissing, load_kv_canary

# What sglang's real sglang.srt.utils imports (the sglang-test extra); without them (a GPU
# machine carrying only sglang's wheel) its common module is stubbed instead.
SRT_UTILS_DEPS = ("orjson", "psutil", "pybase64", "requests", "starlette", "msgspec", "zmq")

KV = None
if os.environ.get("TRITON_INTERPRET") != "1":
    SKIP = (
        "tests/sglang drive sglang's code on CPU tensors through Triton's interpreter; set "
        "TRITON_INTERPRET=1 to run them here (on a GPU, tests/gpu/sglang_cuda.py runs sglang's "
        "CUDA kernels)"
    )
else:
    try:
        real_utils = all(importlib.util.find_spec(m) is not None for m in SRT_UTILS_DEPS)
        KV = load_kv_canary(stub_jit=True, stub_srt_utils=not real_utils)
        SKIP = ""
    except SglangMissing as err:
        SKIP = str(err)


@pytest.fixture
def kv():
    """sglang's kv-canary modules by short name (skips when they cannot run here)."""
    if KV is None:
        pytest.skip(SKIP)
    return KV


HERE = Path(__file__).resolve().parent


@pytest.fixture
def forced(kv, monkeypatch):
    """sglang's modules, with its plan API on its kernel path: sglang's Triton offsets kernel
    (or ours, patched) under Triton's interpreter, ``entries_standin`` for sglang's CUDA-JIT
    entries kernel (``_sglang_cases.use_kernel_path``)."""
    use_kernel_path(monkeypatch, kv)
    ENTRIES_SCRATCH.clear()
    return kv


@pytest.fixture
def engine_env(kv, monkeypatch):
    """sglang's plan API on its kernel path and its expected-token scatter without pinned
    memory, on a CPU-only machine: what ``_sglang_engine.ToyEngine`` runs on."""
    use_kernel_path(monkeypatch, kv)
    if not torch.cuda.is_available():
        monkeypatch.setattr(kv.expected_mgr, "torch", NoPinTorch())
    return kv


@pytest.fixture(autouse=True)
def fresh_integration(request):
    """Each test of tests/sglang starts and ends unpatched, with zeroed coverage counters."""
    if KV is None or HERE not in Path(str(request.node.path)).resolve().parents:
        yield
        return
    from kvcanary_dispatch.integrations import sglang as integration

    integration.revert()
    integration.coverage().reset()
    yield
    leaked = list(integration._State.blocks)
    integration.revert()
    integration.coverage().reset()
    # Blocks a test left open, and bindings revert() left: none reach the next test. A block
    # left open is an error of the test that left it (each test closes its own blocks).
    integration._State.blocks = []
    integration._State.left = []
    assert not leaked, f"{len(leaked)} applied() block(s) left open: {leaked}"
