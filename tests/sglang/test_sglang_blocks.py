"""``applied()`` blocks and ``revert()`` as an engine meets them: a block refused on entry
opens nothing, a block whose body raises still reverts, a binding that something else has
already given back sglang's own object is not reported as left, and every message about the
integration's own state starts with ``kvcanary-dispatch``. Each test checks the patch's
state (open blocks, bindings left) itself, where the fixture would only reset it after."""

from __future__ import annotations

import warnings

import pytest
import torch
from _sglang_loader import snapshot_bindings

from kvcanary_dispatch.integrations import _sglang_inspect
from kvcanary_dispatch.integrations import sglang as integration

pytest_plugins = ["_sglang_fixtures"]  # the kv fixture, and a clean patch state per test


def _no_block_open_and_nothing_left() -> None:
    assert integration._State.blocks == [] and integration._State.left == []


@pytest.mark.parametrize("why", ["missing function", "other version, warnings as errors"])
def test_a_block_refused_on_entry_opens_nothing(kv, monkeypatch, why):
    """A refused ``applied()`` (an sglang it does not recognise, or another version's warning
    raised as an error) patches nothing and leaves no block open: a later block that puts the
    patch still takes it away at its end."""
    before = snapshot_bindings(kv)
    with warnings.catch_warnings():
        if why == "missing function":
            monkeypatch.delattr(kv.api, "use_torch_reference")
            refused = integration.IncompatibleSglangError
        else:
            monkeypatch.setattr(_sglang_inspect, "sglang_version", lambda: "0.9.1")
            warnings.simplefilter("error")
            refused = UserWarning
        with pytest.raises(refused, match="^kvcanary-dispatch"):
            with integration.applied("skip"):
                raise AssertionError("the block must not run")
    monkeypatch.undo()
    assert not integration.is_applied() and snapshot_bindings(kv) == before
    _no_block_open_and_nothing_left()
    with integration.applied("skip"):
        assert integration.is_applied() and integration.current_policy() == "skip"
    assert not integration.is_applied() and snapshot_bindings(kv) == before
    _no_block_open_and_nothing_left()


def test_a_block_whose_body_raises_reverts(kv):
    """An exception out of the block (a failed forward step) propagates, and the block still
    reverts the patch it put; over ``apply()``'s patch, ``apply()``'s policy is back."""
    before = snapshot_bindings(kv)
    with pytest.raises(KeyError, match="step failed"):
        with integration.applied("skip"):
            assert integration.is_applied()
            raise KeyError("step failed")
    assert not integration.is_applied() and snapshot_bindings(kv) == before
    _no_block_open_and_nothing_left()
    integration.apply("raise")
    with pytest.raises(KeyError):
        with integration.applied("skip"):
            raise KeyError("step failed")
    assert integration.is_applied() and integration.current_policy() == "raise"
    _no_block_open_and_nothing_left()


@pytest.mark.parametrize("short", ["kernel_launcher", "scatter", "manager"])
def test_revert_takes_a_binding_already_holding_sglangs_own_as_reverted(kv, short):
    """Something put sglang's own object back at a patched binding while applied (a
    ``mock.patch`` entered before ``apply()`` and exited since): ``revert()`` has nothing to
    undo there, so it neither warns nor keeps the binding as left, and the other bindings get
    sglang's objects back as usual."""
    before = snapshot_bindings(kv)
    name = next(n for (s, n) in before if s == short)
    owner = kv.manager.SingleForwardManager if short == "manager" else getattr(kv, short)
    integration.apply()
    setattr(owner, name, before[short, name])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        integration.revert()
    assert not integration.is_applied() and snapshot_bindings(kv) == before
    _no_block_open_and_nothing_left()
    integration.apply()  # not refused: nothing of this integration is left behind
    assert all(snapshot_bindings(kv)[k] is not v for k, v in before.items())


def test_messages_about_the_integrations_own_state_start_with_its_name(kv):
    """The policy refusal (``apply`` and ``applied``), ``revert()``'s warning about a binding
    it left, and the deprecation warning, each start with ``kvcanary-dispatch``."""
    refused = r"^kvcanary-dispatch: sglang policy='split' is not one of"
    with pytest.raises(ValueError, match=refused):
        integration.apply("split")
    with pytest.raises(ValueError, match=refused):
        with integration.applied("split"):
            raise AssertionError("the block must not run")
    assert not integration.is_applied()
    with pytest.warns(DeprecationWarning, match="^kvcanary-dispatch: reserve_verify_"):
        integration.reserve_verify_offsets_scratch(torch.device("cpu"), 8)
    before = snapshot_bindings(kv)
    integration.apply()

    def tracer(**kw):
        raise AssertionError("not called")

    kv.kernel_launcher.launch_canary_plan_kernels = tracer
    try:
        with pytest.warns(RuntimeWarning, match=r"^kvcanary-dispatch: revert\(\) left sglang\."):
            integration.revert()
    finally:
        kv.kernel_launcher.launch_canary_plan_kernels = before[
            "kernel_launcher", "launch_canary_plan_kernels"
        ]
    integration.revert()
    assert snapshot_bindings(kv) == before
    _no_block_open_and_nothing_left()
