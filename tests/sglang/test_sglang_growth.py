"""``policy="grow"`` through sglang's real ``SingleForwardManager``: a growth is recorded
before it is made, given back when sglang then refuses the step, and undone by ``revert()``,
which gives each manager its capacities from before its first growth that held; a policy
switched to ``"raise"`` keeps them until then, and ``"skip"`` inflates them only around
sglang's outside hook."""

from __future__ import annotations

import pytest
from _sglang_engine import toy_engine

from kvcanary_dispatch.integrations import sglang as integration

pytest_plugins = ["_sglang_fixtures"]  # kv, engine_env, and a clean patch state per test


def _capacities(eng) -> tuple[int, int]:
    """The toy engine's manager's request and token capacities."""
    return eng.manager._write_req_capacity, eng.manager._write_entry_capacity


def _grown_once(kv, n: int):
    """A toy engine of ``n`` requests whose manager (4 requests, 8 tokens) ``"grow"`` has
    grown once, for a step of 6 requests, to 8 requests."""
    eng = toy_engine(kv, n, req_cap=4, entry_cap=8)
    integration.apply(policy="grow")
    eng.step(list(range(1, 7)), extend=1, decode=False)
    assert _capacities(eng)[0] == 8
    return eng


def test_revert_gives_grown_managers_sglangs_capacities_back(engine_env):
    """After a growth, ``revert()`` puts back each manager's capacities from before it, so a
    step above them raises as unpatched sglang does."""
    kv = engine_env
    eng = toy_engine(kv, 12, req_cap=4, entry_cap=8)
    integration.apply(policy="grow")
    eng.step(list(range(1, 6)), extend=1, decode=False)
    eng.step(list(range(1, 11)), extend=1, decode=False)
    assert _capacities(eng) == (16, 16)
    integration.revert()
    assert _capacities(eng) == (4, 8)
    with pytest.raises(
        RuntimeError, match="batch_size=6 exceeds pre-allocated write_req_capacity=4"
    ):
        eng.step(list(range(1, 7)), extend=1, decode=False)


def test_a_growth_that_cannot_be_recorded_changes_nothing(engine_env, monkeypatch):
    """The capacities from before a manager's first growth are recorded before the growth:
    where that record fails, the step fails with the manager and the counters as they were."""
    from kvcanary_dispatch.integrations import _sglang_steps

    class Unrecordable(dict):
        def __setitem__(self, key, value):
            raise TypeError("cannot create weak reference")

    kv = engine_env
    eng = toy_engine(kv, 12, req_cap=4, entry_cap=8)
    integration.apply(policy="grow")
    monkeypatch.setattr(_sglang_steps, "_BEFORE_GROWTH", Unrecordable())
    counters = integration.coverage().snapshot()
    with pytest.raises(TypeError, match="cannot create weak reference"):
        eng.step(list(range(1, 7)), extend=1, decode=False)
    assert _capacities(eng) == (4, 8)
    assert integration.coverage().snapshot() == counters


def _refuse_a_grown_step(eng, bs: int = 6) -> None:
    """``bs`` requests (past the request capacity, so ``"grow"`` grows first) whose snapshot
    lengths disagree with the batch's size: sglang's outside hook raises, past its capacity
    check (which a step not grown would fail first)."""
    bad = eng.batch(list(range(1, bs + 1)), 1, False)
    bad.req_all_ids_lens = bad.req_all_ids_lens[:-1]
    with pytest.raises(RuntimeError, match=f"req_all_ids_lens length {bs - 1} != batch_size {bs}"):
        eng.manager.pre_ops_outside_graph(maybe_inaccurate_forward_batch=bad)


def test_a_grown_step_that_sglang_then_refuses_gives_the_growth_back(engine_env):
    """``"grow"`` raises the capacities, then runs sglang's hook; when the hook raises (here a
    batch whose snapshot lengths disagree with its size), the manager and the counters are as
    they were, and the same step, mended, grows then."""
    kv = engine_env
    eng = toy_engine(kv, 12, req_cap=4, entry_cap=8)
    integration.apply(policy="grow")
    counters = integration.coverage().snapshot()
    _refuse_a_grown_step(eng)
    assert _capacities(eng) == (4, 8)
    assert integration.coverage().snapshot() == counters  # the capacities a growth set too
    assert counters["grown_steps"] == 0
    eng.step(list(range(1, 7)), extend=1, decode=False)
    assert eng.manager._write_req_capacity == 8 and integration.coverage().grown_steps == 1


def test_revert_leaves_a_manager_whose_only_growth_was_given_back(engine_env):
    """A growth given back (sglang refused the step) is no growth for ``revert()``: capacities
    the engine sets afterwards stay, rather than going back to those from before the step."""
    kv = engine_env
    eng = toy_engine(kv, 12, req_cap=4, entry_cap=8)
    integration.apply(policy="grow")
    _refuse_a_grown_step(eng)
    eng.manager._write_req_capacity, eng.manager._write_entry_capacity = 32, 64
    integration.revert()
    assert _capacities(eng) == (32, 64)


def test_a_growth_given_back_after_one_that_held_leaves_revert_the_first_capacities(engine_env):
    """A manager grown once (kept), then grown again for a step sglang refuses (given back):
    it keeps the first growth, and ``revert()`` still gives it the capacities from before that
    first growth."""
    eng = _grown_once(engine_env, 24)
    grown = _capacities(eng)
    _refuse_a_grown_step(eng, bs=20)
    assert _capacities(eng) == grown
    integration.revert()
    assert _capacities(eng) == (4, 8)


def test_skip_gives_the_capacities_back_when_sglang_refuses_the_step(engine_env):
    """Under ``"skip"`` the outside hook runs sglang's with the capacity check satisfied, then
    restores the capacities, also when sglang's hook raises: no capacity stays inflated (it
    would have no growth record for ``revert()``), and nothing is counted."""
    kv = engine_env
    eng = toy_engine(kv, 12, req_cap=4, entry_cap=8)
    integration.apply(policy="skip")
    _refuse_a_grown_step(eng)
    assert _capacities(eng) == (4, 8)
    assert all(v == 0 for v in integration.coverage().snapshot().values())


def test_a_grown_manager_keeps_its_capacities_under_raise_until_revert(engine_env):
    """Switching the policy to ``"raise"`` keeps what ``"grow"`` gave a manager: a step within
    the grown capacities runs, one above them raises sglang's error naming them, and only
    ``revert()`` gives back the capacities from before the growth."""
    eng = _grown_once(engine_env, 12)
    grown = _capacities(eng)
    integration.apply(policy="raise")
    assert _capacities(eng) == grown
    eng.step(list(range(1, 8)), extend=1, decode=False)
    with pytest.raises(
        RuntimeError, match="batch_size=9 exceeds pre-allocated write_req_capacity=8"
    ):
        eng.step(list(range(1, 10)), extend=1, decode=False)
    assert integration.coverage().grown_steps == 1
    integration.revert()
    assert _capacities(eng) == (4, 8)
