"""The forward-step guard's three policies ("raise", "grow", "split"): the exact remedy texts,
growth outside CUDA-graph capture, refusals that leave the buffers untouched; and the
dispatcher's own refusal of outputs smaller than the batch. What "split" refuses and what its
pieces verify: ``test_guard_split.py``."""

from __future__ import annotations

import itertools
import logging
import re
from functools import partial

import pytest
import torch
from _helpers import OpLog, assert_guard_untouched, poisoned_guard, random_step
from conftest import DEVICE
from test_engine_safety import EMPTY_GRAPH

from kvcanary_dispatch import CapacityError, forward_step, plan_offsets
from kvcanary_dispatch.capacities import CanaryCapacities, PlanBuffers
from kvcanary_dispatch.forward_step import ForwardStepGuard
from kvcanary_dispatch.plan import launch_plan_offsets_kernel_any_bs
from kvcanary_dispatch.testing.cases import PlanCase
from kvcanary_dispatch.testing.engine_steps import expect_plan, poison_
from kvcanary_dispatch.testing.launches import record_launches

make_step = partial(random_step, device=DEVICE)


# ---------------------------------------------------------------- the guard


BIG = make_step([(1, 2, False)] * 6000)
GUARD_RAISES = {
    "batch_size": (
        BIG,
        CanaryCapacities(4096, 10**6, 10),
        "kv-canary: forward_batch.batch_size=6000 exceeds pre-allocated write_req_capacity=4096; "
        "raise --cuda-graph-max-bs or check CanaryLaunchCapacities.from_args; "
        "--cuda-graph-max-bs-decode >= 6000 (--cuda-graph-max-bs in older sglang) would fit "
        "this batch",
    ),
    "both": (
        BIG,
        CanaryCapacities(4096, 8000, 10),
        "kv-canary: forward_batch.batch_size=6000 exceeds pre-allocated write_req_capacity=4096; "
        "raise --cuda-graph-max-bs or check CanaryLaunchCapacities.from_args; "
        "--cuda-graph-max-bs-decode >= 6000 (--cuda-graph-max-bs in older sglang) would fit "
        "this batch (its token count=12000 also exceeds write_entry_capacity=8000: "
        "--max-prefill-tokens >= 12000 with --chunked-prefill-size >= 12000 (or unset) would "
        "fit it)",
    ),
    "requests, tokens exactly at capacity": (  # the token count fits: no "also exceeds"
        BIG,
        CanaryCapacities(4096, 12000, 10),
        "kv-canary: forward_batch.batch_size=6000 exceeds pre-allocated write_req_capacity=4096; "
        "raise --cuda-graph-max-bs or check CanaryLaunchCapacities.from_args; "
        "--cuda-graph-max-bs-decode >= 6000 (--cuda-graph-max-bs in older sglang) would fit "
        "this batch",
    ),
    "tokens": (
        make_step([(0, 9000, False), (3, 1, False)]),
        CanaryCapacities(8, 8192, 10),
        "kv-canary: forward_batch token count=9001 exceeds pre-allocated "
        "write_entry_capacity=8192; raise --chunked-prefill-size / --max-prefill-tokens or check "
        "CanaryLaunchCapacities.from_args; --max-prefill-tokens >= 9001 with "
        "--chunked-prefill-size >= 9001 (or unset) would fit this batch",
    ),
}


@pytest.mark.parametrize("name", GUARD_RAISES)
def test_guard_raise(name):
    """Over capacity with policy "raise": the exact remedy text, buffers untouched."""
    step, caps, text = GUARD_RAISES[name]
    guard, before = poisoned_guard(DEVICE, caps, "raise")
    with pytest.raises(RuntimeError, match=f"^{re.escape(text)}$"):
        guard.plan_step(**step.lengths(), req_to_token=step.req_to_token)
    assert_guard_untouched(guard, before)


@pytest.mark.parametrize("bs,num_tokens,match", [(9, 3, "batch_size=9"), (2, 50, "count=50")])
def test_guard_check_reads_no_data(bs, num_tokens, match):
    """The check needs only host-known sizes: meta tensors (unreadable) suffice."""
    meta = torch.empty(bs, dtype=torch.int64, device="meta")
    guard = ForwardStepGuard(CanaryCapacities(8, 40, 0), "raise", device=DEVICE)
    with pytest.raises(RuntimeError, match=match):
        guard.plan_step(
            req_pool_indices=meta,
            prefix_lens=meta,
            extend_seq_lens=meta,
            req_to_token=torch.empty(1, 1, dtype=torch.int32, device="meta"),
            num_tokens=num_tokens,
        )


def test_guard_fitting_step_yields_once_with_its_tensors():
    step = make_step([(1, 2, False), (4, 1, False), (0, 3, True)])
    rpi, prefix, extend = (t.to(DEVICE) for t in step.lengths().values())
    guard = ForwardStepGuard(CanaryCapacities(3, 6, 9), "raise", device=DEVICE)
    poison_(*guard.buffers.tensors().values())
    (sub, buf), *rest = guard.plan_step(
        req_pool_indices=rpi,
        prefix_lens=prefix,
        extend_seq_lens=extend,
        req_to_token=step.req_to_token,
        num_tokens=6,
    )
    assert not rest and sub.req_pool_indices is rpi and sub.extend_seq_lens is extend
    assert buf.write_offsets[:4].tolist() == [0, 2, 3, 3]
    case = PlanCase(rpi, prefix, extend, step.req_to_token, None, 0, 9, 3, 4)
    expect_plan(case, buf.tensors(), "the fitting step")  # every byte, poison past bs


def test_guard_grow_refused_during_capture(monkeypatch):
    monkeypatch.setattr(forward_step, "capturing", lambda device: True)
    step = make_step([(1, 2, False)] * 5)
    guard, before = poisoned_guard(DEVICE, CanaryCapacities(4, 100, 9), "grow")
    buffers = guard.buffers
    with pytest.raises(RuntimeError) as err:
        guard.plan_step(**step.lengths(), req_to_token=step.req_to_token)
    assert str(err.value) == (
        "kv-canary: ForwardStepGuard(policy='grow') cannot reallocate the plan buffers while "
        "the stream is capturing a CUDA graph (batch_size=5, token count=10, capacities "
        "write_req_capacity=4, write_entry_capacity=100); capture only steps that fit the "
        "capacities (size them with CanaryCapacities.from_args): no policy can grow or split a "
        "step inside a graph"
    )
    assert guard.buffers is buffers and guard.grow_count == 0
    assert_guard_untouched(guard, before)
    # a step that fits is planned during capture
    small = make_step([(1, 2, False)] * 4)
    assert len(list(guard.plan_step(**small.lengths(), req_to_token=small.req_to_token))) == 1


@pytest.mark.skipif(DEVICE != "cuda", reason="needs CUDA-graph capture")
def test_guard_grow_refused_during_real_capture():
    """Refused before anything is recorded: torch warns that the graph is empty (a torch op
    the guard recorded would not run, so the untouched check alone could not see it)."""
    step = make_step([(1, 2, False)] * 5)
    guard, before = poisoned_guard(DEVICE, CanaryCapacities(4, 100, 9), "grow")
    graph = torch.cuda.CUDAGraph()
    with pytest.warns(UserWarning, match=EMPTY_GRAPH):
        with pytest.raises(
            RuntimeError, match=r"^kv-canary: .*policy='grow'.* capturing a CUDA graph"
        ):
            with torch.cuda.graph(graph):
                guard.plan_step(**step.lengths(), req_to_token=step.req_to_token, num_tokens=10)
    assert guard.grow_count == 0
    assert_guard_untouched(guard, before)


def test_not_capturing_here():
    device = torch.device(DEVICE)
    assert forward_step.capturing(device) is (
        device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    )


def test_guard_iterator_whose_buffers_a_later_call_grew_is_refused():
    """An iterator advanced after a later ``plan_step`` grew the buffers would plan into
    buffers the guard no longer holds: refused, nothing planned into the old buffers or the
    new; the later step's own iterator plans as usual."""
    guard, before = poisoned_guard(DEVICE, CanaryCapacities(4, 10, 9), "grow")
    first = guard.buffers
    small, wide = make_step([(1, 2, False)] * 3), make_step([(1, 2, False)] * 5)
    stale = guard.plan_step(**small.lengths(), req_to_token=small.req_to_token)
    poisoned = []
    guard.on_grow = lambda b: poisoned.append(
        {k: v.fill_(-5).clone() for k, v in b.tensors().items()}
    )
    fresh = guard.plan_step(**wide.lengths(), req_to_token=wide.req_to_token)
    with pytest.raises(
        RuntimeError,
        match=r"^kv-canary: ForwardStepGuard: a later plan_step grew the plan buffers "
        r"\(write_req_capacity=8, write_entry_capacity=10\).*call plan_step again",
    ):
        next(iter(stale))
    for k, v in first.tensors().items():
        assert torch.equal(v, before[k]), k
    for k, v in guard.buffers.tensors().items():
        assert torch.equal(v, poisoned[0][k]), k
    ((sub, buf),) = fresh
    assert sub.batch_size == 5 and buf.write_offsets[:6].tolist() == [0, 2, 4, 6, 8, 10]


def test_guard_grow(caplog):
    grown = []
    guard = ForwardStepGuard(
        CanaryCapacities(4, 10, 9), "grow", device=DEVICE, on_grow=grown.append
    )
    first = guard.buffers
    caplog.set_level(logging.INFO, logger="kvcanary_dispatch")
    for reqs, want_caps in [
        ([(1, 2, False)] * 5, (8, 10)),  # requests: doubled
        ([(0, 40, False)], (8, 40)),  # tokens: to the need when more than double
        ([(1, 1, False)] * 7, (8, 40)),  # fits
        ([(0, 3, False)] * 30, (30, 90)),
    ]:
        step = make_step(reqs)
        ((sub, buf),) = guard.plan_step(**step.lengths(), req_to_token=step.req_to_token)
        caps = guard.capacities
        assert (caps.write_req_capacity, caps.write_entry_capacity) == want_caps
        assert buf is guard.buffers and caps.verify_capacity == 9
        assert sub.batch_size == len(reqs)
        n = len(reqs)
        lens = step.extend_seq_lens.clamp(min=0) * (step.req_pool_indices != 0)
        assert buf.write_offsets[1 : n + 1].tolist() == torch.cumsum(lens, 0).tolist()
    assert guard.grow_count == 3 and len(grown) == 3 and grown[-1] is guard.buffers
    assert first is not guard.buffers
    records = [r for r in caplog.records if r.name == "kvcanary_dispatch"]
    assert len(records) == 1 and records[0].levelno == logging.WARNING
    assert "reallocated" in records[0].getMessage()


@pytest.mark.parametrize("lengths_on", ["device", "host"])
@pytest.mark.parametrize("outgrows", ["requests", "tokens"])
@pytest.mark.parametrize(
    "breakage",
    ["req_to_token int64", "req_to_token 1-D", "req_to_token strided", "lut int32", "window -1"],
)
def test_guard_grow_refusal_changes_nothing(caplog, breakage, outgrows, lengths_on):
    """A step that needs growing but that its plan refuses leaves the guard as it was: the same
    buffers (unwritten) and capacities, no grow counted, logged or told to ``on_grow``. It is
    refused before any op but allocations: no zero fill of grown buffers, no copy of the
    step's lengths (on a GPU, host lengths are uploaded only once the step passes)."""
    step = make_step([(1, 2, False)] * 4 + [(0, 3, True)])
    lengths = step.lengths()
    if lengths_on == "host":
        lengths = {name: t.cpu() for name, t in lengths.items()}
    kw = dict(**lengths, req_to_token=step.req_to_token)
    fit = dict(kw)
    if breakage == "req_to_token int64":
        kw["req_to_token"] = kw["req_to_token"].to(torch.int64)
    elif breakage == "req_to_token 1-D":
        kw["req_to_token"] = kw["req_to_token"].flatten()
    elif breakage == "req_to_token strided":
        kw["req_to_token"] = kw["req_to_token"].t().contiguous().t()
    elif breakage == "lut int32":
        kw["full_to_swa_index_mapping"] = torch.zeros(4, dtype=torch.int32, device=DEVICE)
    else:
        kw["swa_window_size"] = -1
    grown = []
    # 5 requests and 11 tokens: past 2 requests (offsets and seeds reallocated), or past 4
    # tokens alone (every tensor kept)
    caps = CanaryCapacities(2, 4, 100) if outgrows == "requests" else CanaryCapacities(8, 4, 100)
    guard, before = poisoned_guard(DEVICE, caps, "grow", on_grow=grown.append)
    buffers = guard.buffers
    caplog.set_level(logging.INFO, logger="kvcanary_dispatch")
    with OpLog() as log, pytest.raises((ValueError, TypeError), match=r"^kv-canary: "):
        for _ in guard.plan_step(**kw):
            pass
    allocations = {"aten.empty.memory_format", "aten.empty_like.default", "aten.unbind.int"}
    assert set(log.ops) <= allocations, log.ops  # (unbind: views of an allocation's rows)
    assert guard.buffers is buffers and guard.capacities == caps
    assert guard.grow_count == 0 and grown == []
    assert not [r for r in caplog.records if r.name == "kvcanary_dispatch"]
    assert_guard_untouched(guard, before)
    for _ in guard.plan_step(**fit):  # the same step, unbroken, grows once
        pass
    assert guard.grow_count == 1 and grown == [guard.buffers]
    kept = guard.buffers.write_offsets is buffers.write_offsets
    assert kept == (outgrows == "tokens")


# What outgrows the capacities: (capacities, the step's requests, the capacities it grows to).
# A grow over the token capacity alone keeps every tensor.
GROWS = {
    "requests": (CanaryCapacities(2, 40, 9), [(1, 2, False)] * 3, CanaryCapacities(4, 40, 9)),
    "tokens": (CanaryCapacities(4, 4, 9), [(1, 3, False)] * 2, CanaryCapacities(4, 8, 9)),
}


@pytest.mark.parametrize("outgrows", GROWS)
@pytest.mark.parametrize("error", [MemoryError, KeyboardInterrupt])
def test_guard_grow_undone_when_on_grow_raises(caplog, error, outgrows):
    """``on_grow`` failing (an engine's recapture running out of memory, or interrupted: not an
    ``Exception``) leaves the guard with the buffers, capacities and count it had, whether the
    grow made new tensors or kept them, so the next such step grows and calls it again; the
    first grow that holds is the one logged."""
    calls = []

    def on_grow(buffers):
        calls.append(buffers)
        if len(calls) == 1:
            raise error("recapture failed")

    caps, lens, grown = GROWS[outgrows]
    guard, before = poisoned_guard(DEVICE, caps, "grow", on_grow=on_grow)
    buffers = guard.buffers
    step = make_step(lens)
    caplog.set_level(logging.INFO, logger="kvcanary_dispatch")
    with pytest.raises(error, match="recapture failed"):
        guard.plan_step(**step.lengths(), req_to_token=step.req_to_token)
    assert guard.buffers is buffers and guard.capacities == caps and guard.grow_count == 0
    assert not [r for r in caplog.records if r.name == "kvcanary_dispatch"]
    assert_guard_untouched(guard, before)
    # A step that fits is planned into the buffers the guard went back to, not the dropped ones.
    fits = make_step([(1, 1, False)] * 2)
    ((_, held),) = guard.plan_step(**fits.lengths(), req_to_token=fits.req_to_token)
    assert held is buffers and buffers.write_offsets[:3].tolist() == [0, 1, 2]
    if outgrows == "requests":
        assert calls[0].write_offsets.tolist() == [0] * 5  # the dropped buffers, as allocated
    ((sub, buf),) = guard.plan_step(**step.lengths(), req_to_token=step.req_to_token)
    assert len(calls) == 2 and calls[1] is buf is guard.buffers and guard.grow_count == 1
    assert guard.capacities == grown
    assert (buf.write_offsets is buffers.write_offsets) == (outgrows == "tokens")
    ends = list(itertools.accumulate((extend for _, extend, _ in lens), initial=0))
    assert buf.write_offsets[: len(ends)].tolist() == ends
    assert len([r for r in caplog.records if r.name == "kvcanary_dispatch"]) == 1


def test_on_grow_is_told_once_the_guard_holds_the_grown_buffers():
    """``on_grow`` runs after the guard holds the grown buffers and has counted the grow: an
    engine recapturing its graphs there reads the guard's buffers, capacities and count as they
    now are (the buffers it is told of)."""
    guard = ForwardStepGuard(CanaryCapacities(2, 40, 9), "grow", device=DEVICE)
    seen = []
    guard.on_grow = lambda b: seen.append((guard.buffers is b, guard.capacities, guard.grow_count))
    step = make_step([(1, 2, False)] * 3)
    ((_, buf),) = guard.plan_step(**step.lengths(), req_to_token=step.req_to_token)
    assert seen == [(True, CanaryCapacities(4, 40, 9), 1)]
    assert buf is guard.buffers and buf.write_offsets[:4].tolist() == [0, 2, 4, 6]


def test_guard_rejects_policy_when_built_and_when_set():
    """An unknown policy is refused by the constructor and by assignment between steps (which
    keeps the policy in force), rather than taken as ``"split"`` at the next step."""
    with pytest.raises(ValueError) as err:
        ForwardStepGuard(CanaryCapacities(1, 1, 1), "shrink")
    assert str(err.value) == (
        "kv-canary: ForwardStepGuard policy='shrink' is not one of split, grow, raise"
    )
    guard = ForwardStepGuard(CanaryCapacities(1, 1, 1), "grow", device=DEVICE)
    with pytest.raises(ValueError, match=r"^kv-canary: ForwardStepGuard policy='rasie' is not"):
        guard.policy = "rasie"
    assert guard.policy == "grow"
    guard.policy = "raise"
    step = make_step([(1, 2, False)] * 2)
    with pytest.raises(RuntimeError, match="exceeds pre-allocated write_req_capacity=1"):
        guard.plan_step(**step.lengths(), req_to_token=step.req_to_token)


@pytest.mark.parametrize(
    "keywords,error,text",
    [
        ({"strategy": "lookbak"}, ValueError, "plan_offsets strategy='lookbak' is not one of"),
        ({"chunk_size": 0}, ValueError, "plan_offsets chunk_size=0 is outside [1, "),
        ({"chunk_size": 1.5}, TypeError, "plan_offsets chunk_size must be an int or None"),
    ],
)
def test_guard_checks_its_plan_settings_when_built_and_when_set(keywords, error, text):
    """A strategy or chunk size ``plan_offsets`` would refuse is refused by the constructor
    and by assignment between steps, with its text, not at the first (oversized or not) step
    mid-run; a refused assignment keeps the setting in force, which the next step's launches
    show, as they show a setting assigned."""
    match = "^kv-canary: " + re.escape(text)
    with pytest.raises(error, match=match):
        ForwardStepGuard(CanaryCapacities(1, 1, 1), "grow", device=DEVICE, **keywords)
    guard = ForwardStepGuard(
        CanaryCapacities(4, 9, 9), "grow", device=DEVICE, strategy="scan", chunk_size=2
    )
    ((name, value),) = keywords.items()
    with pytest.raises(error, match=match):
        setattr(guard, name, value)
    assert (guard.strategy, guard.chunk_size) == ("scan", 2)
    step = make_step([(1, 2, False)] * 3)

    def launched() -> list[tuple[str, int]]:
        with record_launches() as launches:
            ((_, buf),) = guard.plan_step(**step.lengths(), req_to_token=step.req_to_token)
        assert buf.write_offsets[:4].tolist() == [0, 2, 4, 6]
        return [(la.kind, la.bs) for la in launches]

    assert launched() == [("plan_scan", 3)]  # one scan of 2-request slices
    guard.strategy, guard.chunk_size = "loop", 1
    assert launched() == [("plan_fixed", 1)] * 3  # a fixed launch per 1-request slice


@pytest.mark.parametrize(
    "policy,bs,extend", [("grow", 5, 2), ("grow", 5, 20), ("grow", 12, 2), ("split", 12, 2)]
)
def test_guard_plans_with_its_strategy_and_chunk_size(policy, bs, extend):
    """The constructor's ``strategy`` and ``chunk_size`` reach every plan the guard launches: a
    step that fits, one grown past the token capacity alone (its request buffers kept), one
    grown past the request capacity and one split into sub-steps (every
    strategy writes the same bytes, so only the launches show a setting dropped)."""
    step = make_step([(1, extend, False)] * bs)
    guard = ForwardStepGuard(
        CanaryCapacities(8, 64, 99), policy, device=DEVICE, strategy="scan", chunk_size=2
    )
    with record_launches() as launches:
        subs = sum(1 for _ in guard.plan_step(**step.lengths(), req_to_token=step.req_to_token))
    assert subs == (2 if (policy, bs) == ("split", 12) else 1)
    assert [la.kind for la in launches] == ["plan_scan"] * subs, launches
    assert [la.args["chunk"] for la in launches] == [2] * subs


def test_outputs_smaller_than_bs_are_a_capacity_error():
    """A batch larger than ``PlanBuffers``' capacity (its verify offsets too short as well) is
    the ``CapacityError`` naming the remedy in ``plan_offsets``; a malformed write pair keeps
    the length error, and the drop-in launcher keeps sglang's order (the scratch's length
    first). No refused call writes anything."""
    step = make_step([(1, 2, False)] * 3)
    buf = PlanBuffers.allocate(CanaryCapacities(2, 100, 10), DEVICE)
    for t in buf.tensors().values():
        t.fill_(-5)
    before = {k: v.clone() for k, v in buf.tensors().items()}
    host = {k: v.to(DEVICE) for k, v in step.lengths().items()}
    kw = dict(**host, req_to_token=step.req_to_token, verify_capacity=10)
    capacity = r"^kv-canary: bs=3 exceeds write_req_capacity=2; size out_verify_offsets and "
    long_verify = torch.full((8,), -5, dtype=torch.int64, device=DEVICE)
    for outs in (buf.tensors(), {**buf.tensors(), "out_verify_offsets": long_verify}):
        with pytest.raises(CapacityError, match=capacity):
            plan_offsets(**kw, **outs)
    one_too_many = torch.full((4,), -5, dtype=torch.int64, device=DEVICE)  # 2 seeds, 4 offsets
    with pytest.raises(ValueError, match=r"^kv-canary: out_verify_offsets length must be >= 4, "):
        plan_offsets(**kw, **{**buf.tensors(), "out_write_offsets": one_too_many})
    scratch = {"out_verify_offsets_scratch": buf.tensors()["out_verify_offsets"]}
    drop_in = {k: v for k, v in buf.tensors().items() if k != "out_verify_offsets"}
    drop_in.update(scratch, full_to_swa_index_mapping=None, swa_window_size=0)
    text = "kv-canary: out_verify_offsets_scratch length must be >= 4, got 3"
    with pytest.raises(ValueError, match=f"^{re.escape(text)}$"):
        launch_plan_offsets_kernel_any_bs(**kw, **drop_in)
    # a scratch long enough: the capacity error, its remedy naming the drop-in's own keyword
    drop_in["out_verify_offsets_scratch"] = long_verify
    scratch_capacity = capacity.replace("out_verify_offsets", "out_verify_offsets_scratch")
    with pytest.raises(CapacityError, match=scratch_capacity):
        launch_plan_offsets_kernel_any_bs(**kw, **drop_in)
    for k, v in buf.tensors().items():
        assert torch.equal(v, before[k]), k
    for t in (long_verify, one_too_many):  # the outputs put in place of the buffers' too
        assert (t == -5).all(), t
