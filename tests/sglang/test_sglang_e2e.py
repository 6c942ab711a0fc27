"""The whole canary (plan -> write -> verify) through sglang's real ``SingleForwardManager``,
its endpoints and its write/verify torch references, at batch sizes above every cap and steps
above the pre-allocated capacities: clean runs report nothing, injected corruption is reported
at the right request and position, and each capacity policy does what docs/sglang.md says."""

from __future__ import annotations

import contextlib
import importlib
import logging
import types

import pytest
import torch
from _sglang_engine import toy_engine

from kvcanary_dispatch.integrations import sglang as integration

pytest_plugins = ["_sglang_fixtures"]  # kv, engine_env, and a clean patch state per test


def _bits(kv, name: str) -> int:
    return int(getattr(kv.consts.FailReason, name))


def _inside_outgrows_outside(kv, policy: str):
    """Under ``policy``, a manager of 8 requests' capacity whose outside hook ran on a batch of
    4 (fits); returns it and the step's accurate batch of 12 for the inside hook."""
    eng = toy_engine(kv, 12, req_cap=8, entry_cap=64)
    integration.apply(policy=policy)
    small = eng.batch(list(range(1, 5)), 1, False)
    big = eng.batch(list(range(5, 13)) + list(range(1, 5)), 1, False)
    eng.manager.pre_ops_outside_graph(maybe_inaccurate_forward_batch=small)
    return eng, big


def test_beyond_every_cap_clean_then_corruptions_reported_where_injected(engine_env):
    kv = engine_env
    n = 4100  # scatter cap 511, plan cap 4096, capacities 512 requests / 1024 tokens
    eng = toy_engine(kv, n, req_cap=512, entry_cap=1024, context=6)
    rows = list(range(1, n + 1))
    with pytest.raises(
        RuntimeError, match="batch_size=4100 exceeds pre-allocated write_req_capacity=512"
    ):
        eng.manager.pre_ops_outside_graph(maybe_inaccurate_forward_batch=eng.batch(rows, 2, False))
    eng = toy_engine(kv, n, req_cap=512, entry_cap=1024, context=6)
    integration.apply(policy="grow")
    eng.step(rows, extend=2, decode=False)
    eng.step(rows, extend=1)
    assert eng.violations() == [] and eng.kernel_runs() == 8
    snap = integration.coverage().snapshot()
    assert snap["grown_steps"] == 1 and snap["skipped_steps"] == 0
    assert eng.manager._write_req_capacity == n and eng.manager._write_entry_capacity == 2 * n

    # Corrupt one KV byte of request row 3001 at position 1, and the expected token that the
    # next step's snapshot carries for row 4099 at position 2.
    kv_row, kv_pos, tok_row, tok_pos = 3001, 1, 4099, 2
    eng.real_kv[eng.slot(kv_row, kv_pos), 5] ^= 0x40
    batch = eng.batch(rows, 1, True)
    index = rows.index(tok_row) * 4 + tok_pos  # every snapshot holds 4 tokens now
    assert int(batch.req_all_ids_flat[index]) == eng.tokens[tok_row][tok_pos]
    batch.req_all_ids_flat[index] += 1
    eng.run(batch)
    found = eng.violations()
    kv_hits = [v for v in found if v["bits"] & _bits(kv, "VERIFY_REAL_KV_HASH_MISMATCH")]
    tok_hits = [v for v in found if v["bits"] & _bits(kv, "VERIFY_TOKEN_MISMATCH")]
    assert len(kv_hits) + len(tok_hits) == len(found) >= 3, found
    assert {(v["slot"], v["position"]) for v in kv_hits} == {(eng.slot(kv_row, kv_pos), kv_pos)}
    assert {(v["slot"], v["position"]) for v in tok_hits} == {(eng.slot(tok_row, tok_pos), tok_pos)}
    assert {v["expected_token"] for v in tok_hits} == {eng.tokens[tok_row][tok_pos] + 1}
    assert len(tok_hits) == 2, "head and tail verify both see the bad expected token"


def test_many_steps_growing_mid_run_stay_clean(engine_env, caplog):
    kv = engine_env
    eng = toy_engine(kv, 700, req_cap=256, entry_cap=600, context=16)
    integration.apply(policy="grow")
    schedule = [(range(1, 201), 3, False), (range(1, 201), 1, True), (range(201, 701), 2, False)]
    schedule += [(range(1, 701), 1, True)] * 6 + [(range(1, 301), 1, True)]
    with caplog.at_level(logging.WARNING, logger="kvcanary_dispatch.integrations.sglang"):
        for rows, extend, decode in schedule:
            eng.step(list(rows), extend, decode)
    assert eng.violations() == []
    assert eng.kernel_runs() == 4 * len(schedule)
    snap = integration.coverage().snapshot()
    assert snap["grown_steps"] == 2 and snap["write_req_capacity"] == 1024  # doubled twice
    assert [r.message.count("outgrew") for r in caplog.records] == [1, 1]
    assert "write_req_capacity 256 -> 512" in caplog.records[0].message


def test_skip_counts_logs_runs_no_kernel_and_costs_what_the_docs_say(engine_env, caplog):
    kv = engine_env
    eng = toy_engine(kv, 12, req_cap=8, entry_cap=64)
    integration.apply(policy="skip")
    eng.step(list(range(1, 9)), extend=2, decode=False)  # fits
    runs = eng.kernel_runs()
    with caplog.at_level(logging.WARNING, logger="kvcanary_dispatch.integrations.sglang"):
        out = eng.step(list(range(1, 13)), extend=1)  # 12 requests > 8: skipped
    assert isinstance(out, integration.SkippedForward)
    assert eng.kernel_runs() == runs, "a skipped step launches no canary kernel"
    assert int(eng.manager._output_buffer.verify_plan_enable[0]) == 1
    assert integration.coverage().snapshot() == dict(
        grown_steps=0,
        write_req_capacity=0,
        write_entry_capacity=0,
        skipped_steps=1,
        skipped_requests=12,
        skipped_tokens=12,
    )
    assert eng.manager._write_req_capacity == 8, "skip never grows"
    assert len(caplog.records) == 1 and "can report violations" in caplog.records[0].message
    # The expected-token scatter of the skipped step still ran (outside the graph).
    assert int(eng.state.req_to_verify_expected_tokens[12, 0]) == eng.tokens[12][0]
    assert eng.violations() == []
    eng.step(list(range(1, 9)), extend=1)  # fits again: verifies the skipped positions
    # Position 2 of rows 1..8 was written in the skipped step: no canary there, so verify
    # flags it, and the write of position 3 (chained on it) fails its position check.
    skipped = {eng.slot(r, 2) for r in range(1, 9)}
    chained = {eng.slot(r, 3) for r in range(1, 9)}
    flagged = {v["slot"] for v in eng.violations()}
    assert skipped <= flagged <= skipped | chained, eng.violations()


def test_a_skipped_step_leaves_the_manager_as_a_run_one_would(engine_env):
    """A skipped step still advances sglang's phase checker through the inside and post hooks,
    sets ``verify_plan_enable`` (no verify ran, so none overflowed), and counts its requests
    and tokens apart."""
    kv = engine_env
    eng = toy_engine(kv, 12, req_cap=8, entry_cap=64)
    integration.apply(policy="skip")
    eng.manager._output_buffer.verify_plan_enable.fill_(0)
    out = eng.step(list(range(1, 13)), extend=2, decode=False)
    assert isinstance(out, integration.SkippedForward)
    assert int(eng.manager._output_buffer.verify_plan_enable[0]) == 1
    after_post = kv.manager._SingleForwardPhase.AFTER_POST_MAYBE_IN
    assert eng.manager._phase_checker._phase == after_post
    snap = integration.coverage().snapshot()
    assert (snap["skipped_steps"], snap["skipped_requests"], snap["skipped_tokens"]) == (1, 12, 24)


def test_coverage_reports_the_largest_capacities_grown_to(engine_env):
    """Across managers, ``coverage()`` keeps the largest capacities any growth reached, not the
    last one's."""
    kv = engine_env
    integration.apply(policy="grow")
    toy_engine(kv, 12, req_cap=8, entry_cap=16).step(list(range(1, 13)), extend=1, decode=False)
    toy_engine(kv, 12, req_cap=2, entry_cap=4).step(list(range(1, 4)), extend=2, decode=False)
    cov = integration.coverage()  # grown to (16, 16), then a second manager to (4, 8)
    assert (cov.grown_steps, cov.write_req_capacity, cov.write_entry_capacity) == (2, 16, 16)


def test_a_token_only_growth_reports_the_request_capacity_it_kept(engine_env):
    """A step that outgrows the tokens only grows the entry capacity (at least doubled); the
    request capacity stays as it was, and ``coverage()`` reports the two the manager then
    holds."""
    kv = engine_env
    integration.apply(policy="grow")
    eng = toy_engine(kv, 12, req_cap=8, entry_cap=16)
    eng.step([1, 2, 3, 4], extend=5, decode=False)  # 4 requests, 20 tokens
    assert (eng.manager._write_req_capacity, eng.manager._write_entry_capacity) == (8, 32)
    cov = integration.coverage()
    assert (cov.grown_steps, cov.write_req_capacity, cov.write_entry_capacity) == (1, 8, 32)


def test_raise_keeps_sglangs_error_when_the_inside_batch_outgrows_the_outside_one(engine_env):
    """Under ``"raise"`` the inside hook checks the step's accurate batch as sglang does, even
    when the outside hook's batch fitted: sglang's error, nothing counted."""
    kv = engine_env
    eng, big = _inside_outgrows_outside(kv, "raise")
    with pytest.raises(RuntimeError, match="batch size 12 exceeds static capacity 8"):
        eng.manager.pre_ops_maybe_inside_graph(big)
    assert not any(integration.coverage().snapshot().values())


@pytest.mark.parametrize("policy", [None, "raise"])
def test_raise_and_unpatched_keep_sglangs_errors(engine_env, policy):
    kv = engine_env
    if policy is not None:
        integration.apply(policy=policy)
    eng = toy_engine(kv, 12, req_cap=8, entry_cap=10)
    with pytest.raises(
        RuntimeError, match="batch_size=9 exceeds pre-allocated write_req_capacity=8"
    ):
        eng.step(list(range(1, 10)), extend=1, decode=False)
    eng = toy_engine(kv, 12, req_cap=8, entry_cap=10)
    with pytest.raises(
        RuntimeError, match="token count=12 exceeds pre-allocated write_entry_capacity=10"
    ):
        eng.step(list(range(1, 5)), extend=3, decode=False)


def test_reload_keeps_the_patch_record_policy_and_growth(engine_env):
    """``importlib.reload`` of the integration and of its step module (a notebook's
    autoreload): still applied under the policy chosen, an oversized step raises under
    ``"raise"``, the coverage counters are the same object, and ``revert()`` puts back every
    original and the capacities grown before the reload; ``apply()`` then patches again."""
    from kvcanary_dispatch.integrations import _sglang_steps

    kv = engine_env
    integration.apply(policy="grow")
    grown = toy_engine(kv, 12, req_cap=8, entry_cap=64)
    grown.step(list(range(1, 13)), extend=1)
    assert grown.manager._write_req_capacity == 16
    patched = integration.patched_attributes()
    integration.apply(policy="raise")
    importlib.reload(_sglang_steps)
    importlib.reload(integration)
    assert integration.is_applied() and integration.current_policy() == "raise"
    assert integration.patched_attributes() == patched
    assert integration.coverage() is _sglang_steps.COVERAGE
    assert integration.coverage().grown_steps == 1
    eng = toy_engine(kv, 12, req_cap=8, entry_cap=64)
    with pytest.raises(
        RuntimeError, match="batch_size=9 exceeds pre-allocated write_req_capacity=8"
    ):
        eng.step(list(range(1, 10)), extend=1, decode=False)
    assert eng.manager._write_req_capacity == 8
    integration.revert()
    for owner, name, original, _ in patched:
        held = vars(owner) if isinstance(owner, types.ModuleType) else owner.__dict__
        assert held[name] is original, name
    assert grown.manager._write_req_capacity == 8
    integration.apply(policy="grow")
    assert integration.is_applied()


def test_a_step_method_left_at_revert_runs_sglangs_own(engine_env):
    """A tracer that wrapped a patched step method after ``apply("grow")`` is left in place by
    ``revert()`` (with a warning saying what that means); the integration's method inside it
    then acts as sglang's own: an oversized step raises and nothing grows."""
    kv = engine_env
    cls = kv.manager.SingleForwardManager
    original = cls.__dict__["pre_ops_outside_graph"]
    integration.apply(policy="grow")
    inner = cls.__dict__["pre_ops_outside_graph"]

    def traced(self, **kw):
        return inner(self, **kw)

    cls.pre_ops_outside_graph = traced
    try:
        with pytest.warns(RuntimeWarning, match="runs sglang's own") as caught:
            integration.revert()
        assert "SingleForwardManager.pre_ops_outside_graph (now" in str(caught[0].message)
        eng = toy_engine(kv, 12, req_cap=8, entry_cap=64)
        batch = eng.batch(list(range(1, 10)), 1, False)
        with pytest.raises(
            RuntimeError, match="batch_size=9 exceeds pre-allocated write_req_capacity=8"
        ):
            eng.manager.pre_ops_outside_graph(maybe_inaccurate_forward_batch=batch)
        assert eng.manager._write_req_capacity == 8
        assert integration.coverage().grown_steps == 0
    finally:
        cls.pre_ops_outside_graph = original


def test_grow_uses_the_accurate_batch_inside(engine_env):
    """The outside hook sees a "maybe inaccurate" batch; the inside one sizes the buffers."""
    kv = engine_env
    eng, big = _inside_outgrows_outside(kv, "grow")
    out = eng.manager.pre_ops_maybe_inside_graph(big)
    eng.manager.post_ops_maybe_inside_graph(big, out)
    assert eng.manager._write_req_capacity == 16 and integration.coverage().grown_steps == 1


def test_grown_steps_counts_each_growth_of_one_step(engine_env):
    """``grown_steps`` counts growths: a step whose outside hook grows the capacity (10 > 8)
    and whose accurate inside batch then outgrows that too (24 > 16) counts two."""
    kv = engine_env
    eng = toy_engine(kv, 24, req_cap=8, entry_cap=64)
    integration.apply(policy="grow")
    outside = eng.batch(list(range(1, 11)), 1, False)
    inside = eng.batch(list(range(1, 25)), 1, False)
    eng.manager.pre_ops_outside_graph(maybe_inaccurate_forward_batch=outside)
    out = eng.manager.pre_ops_maybe_inside_graph(inside)
    eng.manager.post_ops_maybe_inside_graph(inside, out)
    assert eng.manager._write_req_capacity == 32  # 8 -> 16, then 24 doubled to 32
    assert integration.coverage().grown_steps == 2


def test_skips_are_logged_at_once_then_at_most_once_a_minute(engine_env, caplog, monkeypatch):
    """The first skip is logged in full at once; later ones within 60 s of the last log are
    counted, not logged; the next log gives the totals so far; ``coverage().reset()`` makes the
    next skip log in full again (the clock is the module's ``time.monotonic``, faked here)."""
    from kvcanary_dispatch.integrations import _sglang_steps

    now = [1000.0]
    monkeypatch.setattr(_sglang_steps, "time", types.SimpleNamespace(monotonic=lambda: now[0]))
    kv = engine_env
    eng = toy_engine(kv, 12, req_cap=8, entry_cap=64)
    integration.apply(policy="skip")
    messages = []
    for t in (0.0, 1.0, 59.9, 60.0, 61.0, 200.0):
        now[0] = 1000.0 + t
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="kvcanary_dispatch.integrations.sglang"):
            out = eng.step(list(range(1, 13)), extend=1)  # 12 requests > 8: skipped
        assert isinstance(out, integration.SkippedForward)
        messages.append([r.getMessage() for r in caplog.records])
    logged = [bool(m) for m in messages]
    assert logged == [True, False, False, True, False, True], messages
    assert "can report violations" in messages[0][0]
    assert "1 steps, 12 requests, 12 tokens skipped so far" in messages[0][0]
    assert "4 steps, 48 requests, 48 tokens skipped so far" in messages[3][0]
    assert "can report violations" not in messages[3][0] + messages[5][0]
    assert integration.coverage().skipped_steps == 6
    integration.coverage().reset()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kvcanary_dispatch.integrations.sglang"):
        eng.step(list(range(1, 13)), extend=1)  # same instant as the last log, counted anew
    (record,) = caplog.records
    assert "1 steps, 12 requests, 12 tokens skipped so far" in record.getMessage()
    assert "can report violations" in record.getMessage()


@pytest.mark.parametrize("policy", ["grow", "skip"])
def test_no_grow_or_skip_while_capturing(engine_env, policy, monkeypatch, caplog):
    """Under capture an oversized batch is neither grown nor skipped (either would be baked
    into the graph): sglang's own error stands, capacities, counters and log untouched.
    (Capture is faked: the inside hook's capture test answers True.)"""
    from kvcanary_dispatch.integrations import _sglang_steps

    kv = engine_env
    eng, big = _inside_outgrows_outside(kv, policy)
    monkeypatch.setattr(_sglang_steps, "_capturing", lambda device: True)
    with caplog.at_level(logging.WARNING, logger="kvcanary_dispatch.integrations.sglang"):
        with pytest.raises(RuntimeError, match="batch size 12 exceeds static capacity 8"):
            eng.manager.pre_ops_maybe_inside_graph(big)
    assert not caplog.records
    assert (eng.manager._write_req_capacity, eng.manager._write_entry_capacity) == (8, 64)
    assert not any(integration.coverage().snapshot().values())


def test_the_capture_test_asks_about_the_managers_device_not_the_current_one(monkeypatch):
    """On a host of several GPUs the manager's device need not be the current one: the
    capture test reads the capture state of the manager's device (torch's CUDA device
    context and capture query faked here: device 1 captures, device 0 is current)."""
    from kvcanary_dispatch.integrations import _sglang_steps

    current = [torch.device("cuda", 0)]

    @contextlib.contextmanager
    def device(d):
        was, current[0] = current[0], torch.device(d)
        try:
            yield
        finally:
            current[0] = was

    monkeypatch.setattr(torch.cuda, "device", device)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: current[0].index == 1)
    assert _sglang_steps._capturing("cuda:1") is True
    assert _sglang_steps._capturing(torch.device("cuda", 0)) is False
    assert _sglang_steps._capturing("cpu") is False
