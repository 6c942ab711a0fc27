"""``tests/_interpreter.py``: the interpreter's helper calls skip re-patching ``triton.language``,
and each launch still patches and restores it as Triton does (CPU interpreter only)."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import triton
import triton.language as tl

pytestmark = [
    pytest.mark.skipif(
        os.environ.get("TRITON_INTERPRET") != "1", reason="Triton's CPU interpreter only"
    ),
    pytest.mark.skipif(
        not hasattr(importlib.import_module("triton.runtime.interpreter"), "_LangPatchScope"),
        reason="this Triton's interpreter patches otherwise: tests/_interpreter.py wraps nothing",
    ),
]


@triton.jit
def _twice(x):
    return x * 2


@triton.jit
def _helpers_kernel(out_ptr, CALLS: tl.constexpr, FAIL: tl.constexpr):
    # out_ptr: int32[8]; each element ends as 2**CALLS times its index, then the sum of all.
    offs = tl.arange(0, 8)
    x = offs
    for _ in tl.static_range(CALLS):
        x = _twice(x)
    if FAIL:
        x = _twice(x, x)  # a helper called with too many arguments: the launch raises
    tl.store(out_ptr + offs, x + tl.sum(x, axis=0) - tl.sum(x, axis=0))


def _launch(calls: int, fail: bool = False) -> torch.Tensor:
    out = torch.full((8,), -1, dtype=torch.int32)
    _helpers_kernel[(1,)](out, CALLS=calls, FAIL=fail)
    return out


def _builtin_patches(monkeypatch, calls: int) -> int:
    """How many times the interpreter walks a module to patch its builtins in one launch."""
    import triton.runtime.interpreter as interp

    walks = [0]
    walk = interp._patch_builtin

    def counted(*args, **kwargs):
        walks[0] += 1
        return walk(*args, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(interp, "_patch_builtin", counted)
        out = _launch(calls)
    assert torch.equal(out, torch.arange(8, dtype=torch.int32) * 2**calls)
    return walks[0]


def test_conftest_installed_the_wrapper_once():
    import triton.runtime.interpreter as interp
    from _interpreter import skip_repeated_patching

    wrapped, launch = interp._patch_lang, interp.GridExecutor.__call__
    assert getattr(wrapped, "_kvcanary_wrapped", False)
    assert getattr(launch, "_kvcanary_wrapped", False)
    assert skip_repeated_patching()
    assert interp._patch_lang is wrapped and interp.GridExecutor.__call__ is launch  # once


def test_helper_calls_add_no_patching(monkeypatch):
    """A launch calling a helper 12 times walks the modules as often as one calling it once
    (the launch's own patch, and once for the modules ``tl.sum`` names); Triton alone walks
    them again at every call."""
    _launch(1)  # the first launch in a process: the modules a helper's globals name settle
    once, many = _builtin_patches(monkeypatch, 1), _builtin_patches(monkeypatch, 12)
    assert once > 0
    assert many == once


@pytest.mark.parametrize("fail", [False, True])
def test_each_launch_restores_the_language(fail):
    """After a launch, one that raises inside a helper included, ``triton.language``'s
    builtins are Triton's own again and no launch is counted as running."""
    from _interpreter import _ACTIVE

    load = tl.load
    if fail:
        with pytest.raises(Exception):  # noqa: B017 (the interpreter's own error type)
            _launch(3, fail=True)
    else:
        assert torch.equal(_launch(3), torch.arange(8, dtype=torch.int32) * 8)
    assert tl.load is load and tl.core.is_builtin(tl.load)
    assert _ACTIVE == []
    assert torch.equal(_launch(2), torch.arange(8, dtype=torch.int32) * 4)  # and runs again


_FRESH_KERNEL = """
import triton
import triton.language as tl


@triton.jit
def kernel(out_ptr):
    offs = tl.arange(0, 8)
    tl.store(out_ptr + offs, tl.zeros((8,), dtype=tl.int32) + offs * 3)
"""

_FRESH_RUN = """
import os, sys
os.environ["TRITON_INTERPRET"] = "1"
sys.path[:0] = [{tests!r}, {here!r}]
from _interpreter import skip_repeated_patching
assert skip_repeated_patching()
import torch
from fresh_kernel import kernel
out = torch.full((8,), -1, dtype=torch.int32)
kernel[(1,)](out)
print(out.tolist())
"""


def test_a_fresh_process_patches_what_a_library_helper_needs(tmp_path):
    """In a process where no launch has run yet, ``tl.zeros`` (a ``@triton.jit`` helper of
    ``triton.language``, whose module names ``triton.language.core``) still gets its module
    patched: skipped, the first launch would fail (later launches would pass on the patches an
    earlier one left behind, so the check needs a process of its own)."""
    (tmp_path / "fresh_kernel.py").write_text(textwrap.dedent(_FRESH_KERNEL))
    script = _FRESH_RUN.format(tests=str(Path(__file__).parent), here=str(tmp_path))
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == str([3 * i for i in range(8)])
