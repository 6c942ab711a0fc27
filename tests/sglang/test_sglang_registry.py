"""sglang's kernel registry (``sglang.kernels.selector.get_kernel``) under apply / revert:
it keeps what it first read from an op's module attribute, so the patch must make it read
again, on apply, on revert and after a binding left inside another patch is restored."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import pytest

import kvcanary_dispatch
from kvcanary_dispatch.integrations import sglang as integration

pytest_plugins = ["_sglang_fixtures"]  # the kv fixture, and a clean patch state per test


def _registry() -> Callable:
    """sglang's ``get_kernel`` with the kv-canary ops registered: the loader's shell of the
    package skips its ``__init__``, which registers them (running it again is harmless)."""
    pkg = sys.modules["sglang.kernels.ops.kv_canary"]
    init = Path(pkg.__path__[0]) / "__init__.py"
    exec(compile(init.read_text(), str(init), "exec"), vars(pkg))
    from sglang.kernels.selector import get_kernel

    return get_kernel


def test_sglangs_kernel_registry_looks_the_launchers_up_again_after_apply_and_revert(kv):
    """sglang's ``get_kernel(op)`` keeps what it first read from the op's module attribute:
    after ``apply()`` it returns the replacement, after ``revert()`` sglang's own again."""
    get_kernel = _registry()

    ops = {
        "kv_canary.launch_scatter_req_token_ids_kernel": kv.scatter,
        "kv_canary.launch_canary_plan_kernels": kv.api,
    }
    name = lambda op: op.split(".", 1)[1]  # noqa: E731
    before = {op: get_kernel(op) for op in ops}
    for op, mod in ops.items():
        assert before[op] is vars(mod)[name(op)], f"{op}: the premise, sglang's own"
    integration.apply()
    for op, mod in ops.items():
        got = get_kernel(op)
        assert got is vars(mod)[name(op)] and got is not before[op], f"{op} while applied"
    scatter = get_kernel("kv_canary.launch_scatter_req_token_ids_kernel")
    assert scatter.__wrapped__ is kvcanary_dispatch.launch_scatter_req_token_ids_kernel
    integration.revert()
    for op in ops:
        assert get_kernel(op) is before[op], f"{op} after revert"


def test_registry_reads_sglangs_own_after_revert_restores_a_binding_left_in_a_tracer(kv):
    """A tracer over the patched plan API is left by ``revert()`` (warning) and the registry
    then returns the tracer; once the tracer unhooks, the next ``revert()`` puts sglang's
    original back and sglang's ``get_kernel`` must forget the tracer it kept."""
    get_kernel = _registry()

    op = "kv_canary.launch_canary_plan_kernels"
    own = get_kernel(op)
    assert own is vars(kv.api)["launch_canary_plan_kernels"]
    integration.apply()
    replacement = kv.api.launch_canary_plan_kernels

    def tracer(**kw):
        raise AssertionError("not called")

    kv.api.launch_canary_plan_kernels = tracer
    try:
        with pytest.warns(RuntimeWarning, match="Undo that patch"):
            integration.revert()
        assert get_kernel(op) is tracer
        kv.api.launch_canary_plan_kernels = replacement  # the tracer unhooks
        integration.revert()
        assert kv.api.launch_canary_plan_kernels is own
        assert get_kernel(op) is own, "the registry still returns the tracer"
    finally:
        kv.api.launch_canary_plan_kernels = own
