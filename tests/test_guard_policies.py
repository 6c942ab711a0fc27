"""``ForwardStepGuard``'s policies at and one past their capacities, on empty and padded steps,
and after refusals, abandoned splits, failed grows and grows that keep every tensor: each plan
byte for byte against the reference, with buffers poisoned, and a refused step changing
nothing."""

from __future__ import annotations

import logging
import re
from functools import partial

import pytest
import torch
from _helpers import assert_guard_untouched, poisoned_guard, random_step
from conftest import DEVICE

from kvcanary_dispatch.capacities import CanaryCapacities
from kvcanary_dispatch.forward_step import POLICIES, ForwardStepGuard
from kvcanary_dispatch.testing.cases import PlanCase
from kvcanary_dispatch.testing.engine_steps import expect_plan, poison_

make_step = partial(random_step, device=DEVICE)


def _case(sub, step, buf) -> PlanCase:
    caps = buf.capacities
    t = (sub.req_pool_indices, sub.prefix_lens, sub.extend_seq_lens)
    return PlanCase(
        *(x.to(buf.device) for x in t),
        step.req_to_token,
        None,
        0,
        caps.verify_capacity,
        caps.write_req_capacity,
        caps.write_req_capacity + 1,
    )


def test_a_padded_step_yields_tokens_up_to_num_tokens_unless_split():
    """A step that fits yields once with ``tokens`` up to ``num_tokens``, padding included;
    under "split", one over the token capacity by its padding alone (4 owned tokens,
    num_tokens=6, capacity 5) yields one sub-step with its requests' own 4 tokens."""
    step = make_step([(3, 3, False), (1, 1, False)])
    kw = dict(**step.lengths(), req_to_token=step.req_to_token, num_tokens=6)
    for tokens, policy, got in ((6, "split", [6]), (5, "split", [4]), (5, "grow", [6])):
        guard = ForwardStepGuard(CanaryCapacities(8, tokens, 99), policy, device=DEVICE)
        assert [sub.tokens for sub, _ in guard.plan_step(**kw)] == [slice(0, n) for n in got]


@pytest.mark.parametrize("policy", POLICIES)
def test_num_tokens_past_int64_is_named_and_changes_nothing(policy):
    """A ``num_tokens`` past int64 is refused as itself, with the fix, under every policy
    (not as a capacity it would grow or need), and the guard is untouched."""
    step = make_step([(1, 3, False), (2, 2, False)])
    guard, before = poisoned_guard(DEVICE, CanaryCapacities(4, 8, 100), policy)
    text = f"kv-canary: num_tokens={2**63} is past int64; pass this step's own count"
    with pytest.raises(ValueError, match=re.escape(text)):
        guard.plan_step(**step.lengths(), req_to_token=step.req_to_token, num_tokens=2**63)
    assert_guard_untouched(guard, before)
    assert guard.grow_count == 0 and guard.capacities == CanaryCapacities(4, 8, 100)


def test_a_fitting_step_yields_the_given_tensors_or_their_int64_copies():
    """A step that fits yields the given lengths where they are int64 on the guard's device,
    and int64 copies of other host lengths (int32, lists), with the same values."""
    step = make_step([(1, 2, False), (4, 1, False)])
    guard = ForwardStepGuard(CanaryCapacities(4, 8, 99), "split", device=DEVICE)
    lengths = _lengths_on_device(step)
    ((sub, _),) = guard.plan_step(**lengths, req_to_token=step.req_to_token)
    assert all(getattr(sub, name) is tensor for name, tensor in lengths.items())
    given = {k: v.cpu().int() for k, v in step.lengths().items()}
    ((sub, _),) = guard.plan_step(**given, req_to_token=step.req_to_token)
    for name, tensor in given.items():
        copy = getattr(sub, name)
        assert copy.dtype == torch.int64 and copy.device == guard.buffers.device, name
        assert copy.tolist() == tensor.tolist(), name


def _lengths_on_device(step) -> dict[str, torch.Tensor]:
    """The step's lengths (host tensors) on the suite's device, which the guard yields as
    given."""
    return {name: tensor.to(DEVICE) for name, tensor in step.lengths().items()}


@pytest.mark.parametrize("policy", POLICIES)
def test_every_policy_at_and_one_past_the_capacities(policy):
    """At the capacities (3 requests, 6 tokens) every policy plans the step whole, grows
    nothing, writes nothing past index bs. One request past / one token past: "raise" names
    the value and writes nothing, "grow" grows only that capacity (doubled), "split" cuts
    at the exact budget."""
    caps = CanaryCapacities(3, 6, 99)
    at = make_step([(1, 2, False)] * 3)
    guard, before = poisoned_guard(DEVICE, caps, policy)
    lengths = _lengths_on_device(at)
    ((sub, buf),) = guard.plan_step(**lengths, req_to_token=at.req_to_token)
    assert sub.req_pool_indices is lengths["req_pool_indices"] and sub.tokens == slice(0, 6)
    assert guard.capacities == caps and guard.grow_count == 0
    expect_plan(_case(sub, at, buf), buf.tensors(), f"{policy} at capacity")

    past = {
        "requests": (make_step([(1, 2, False)] * 3 + [(2, 0, False)]), "batch_size=4", (6, 6)),
        "tokens": (make_step([(1, 2, False)] * 2 + [(1, 3, False)]), "token count=7", (3, 12)),
    }
    for what, (step, text, grown) in past.items():
        guard, before = poisoned_guard(DEVICE, caps, policy)
        kw = dict(**step.lengths(), req_to_token=step.req_to_token)
        if policy == "raise":
            with pytest.raises(RuntimeError, match=re.escape(text)):
                guard.plan_step(**kw)
            assert_guard_untouched(guard, before)
            continue
        it = guard.plan_step(**kw)
        subs = []
        while True:
            poison_(*guard.buffers.tensors().values())
            try:
                sub, buf = next(it)
            except StopIteration:
                break
            expect_plan(_case(sub, step, buf), buf.tensors(), f"{policy} past {what}")
            subs.append((sub.req_start, sub.req_stop, sub.tokens))
        if policy == "grow":
            c = guard.capacities
            assert (c.write_req_capacity, c.write_entry_capacity) == grown, (what, c)
            assert subs == [(0, int(step.req_pool_indices.shape[0]), subs[0][2])]
            # the step once: the caller's own tensors where they are on the buffers' device
            # (on the CPU), else copies of them there (host lengths of a GPU guard)
            for name, given in step.lengths().items():
                got = getattr(sub, name)
                assert got.device == buf.device, (what, name)
                assert (got is given) == (given.device == buf.device), (what, name)
                assert torch.equal(got.cpu(), given), (what, name)
        elif what == "requests":
            assert subs == [(0, 3, slice(0, 6)), (3, 4, slice(6, 6))]
        else:
            assert subs == [(0, 2, slice(0, 4)), (2, 3, slice(4, 7))]


@pytest.mark.parametrize("policy", POLICIES)
def test_an_empty_batch_with_padding_tokens(policy):
    """bs=0 with a padded ``num_tokens`` (9) over the token budget (8): "split" yields one
    empty sub-step whose plan writes offsets[0], seeds nothing, write_num_valid_reqs=0 and
    nothing past index 0; "grow" grows the token capacity alone (every tensor kept); "raise"
    names the count and writes nothing."""
    r2t = make_step([(1, 1, False)]).req_to_token
    guard, before = poisoned_guard(DEVICE, CanaryCapacities(4, 8, 100), policy)
    first = guard.buffers
    kw = dict(req_pool_indices=[], prefix_lens=[], extend_seq_lens=[], req_to_token=r2t)
    if policy == "raise":
        with pytest.raises(RuntimeError, match=re.escape("token count=9 exceeds")):
            guard.plan_step(**kw, num_tokens=9)
        assert_guard_untouched(guard, before)
        return
    ((sub, buf),) = guard.plan_step(**kw, num_tokens=9)
    assert sub.batch_size == 0
    assert int(buf.write_num_valid_reqs) == 0 and int(buf.write_offsets[0]) == 0
    assert int(buf.verify_offsets[0]) == 0 and int(buf.verify_enable) == 1
    assert buf.write_offsets[1:].tolist() == [-5] * 4
    assert buf.write_seed_slot_indices.tolist() == [-5] * 4
    if policy == "grow":
        assert guard.capacities == CanaryCapacities(4, 16, 100) and guard.grow_count == 1
        kept = zip(buf.tensors().values(), first.tensors().values(), strict=True)
        assert all(a is b for a, b in kept)
    else:
        assert guard.capacities == CanaryCapacities(4, 8, 100)


@pytest.mark.parametrize(
    "breakage", ["req_to_token int64", "req_to_token strided", "lut int32", "window -1"]
)
def test_split_step_its_plan_refuses_writes_nothing(breakage):
    """A step that must be split and that its plan refuses is refused before any piece is
    planned: every buffer still poison, the guard unchanged; the same step, unbroken, then
    plans every piece."""
    step = make_step([(1, 4, False)] * 3 + [(0, 2, True)])  # 4 requests, 14 tokens
    kw = dict(**step.lengths(), req_to_token=step.req_to_token)
    bad = dict(kw)
    if breakage == "req_to_token int64":
        bad["req_to_token"] = kw["req_to_token"].long()
    elif breakage == "req_to_token strided":
        bad["req_to_token"] = kw["req_to_token"].t().contiguous().t()
    elif breakage == "lut int32":
        bad["full_to_swa_index_mapping"] = torch.zeros(4, dtype=torch.int32, device=DEVICE)
    else:
        bad["swa_window_size"] = -1
    guard, before = poisoned_guard(DEVICE, CanaryCapacities(2, 4, 100), "split")
    buffers = guard.buffers
    with pytest.raises((ValueError, TypeError), match=r"^kv-canary: "):
        for _ in guard.plan_step(**bad):
            pass
    assert guard.buffers is buffers and guard.grow_count == 0
    assert_guard_untouched(guard, before)
    n = 0
    poison_(*guard.buffers.tensors().values())
    for sub, buf in guard.plan_step(**kw):
        expect_plan(_case(sub, step, buf), buf.tensors(), f"piece {n}")
        poison_(*buf.tensors().values())
        n += 1
    assert n >= 4


def test_a_split_abandoned_mid_step_leaves_the_guard_ready():
    """An engine whose write kernel raises after the first sub-step drops the iterator: the
    next step plans normally, every byte (past bs still poison): no state of the guard
    outlives an iteration."""
    big = make_step([(2, 3, False)] * 5)  # 15 tokens, budget 6
    guard = ForwardStepGuard(CanaryCapacities(2, 6, 99), "split", device=DEVICE)
    it = guard.plan_step(**big.lengths(), req_to_token=big.req_to_token)
    next(it)
    del it  # the engine's exception unwound the loop
    small = make_step([(1, 2, False), (0, 1, True)], seed=3)
    poison_(*guard.buffers.tensors().values())
    ((sub, buf),) = guard.plan_step(**small.lengths(), req_to_token=small.req_to_token)
    expect_plan(_case(sub, small, buf), buf.tensors(), "the step after an abandoned split")


def test_stale_iterator_refused_after_a_token_only_grow():
    """A token-only grow keeps every tensor but is still a grow: an iterator made before it is
    refused, nothing planned (the buffers stay poison)."""
    guard, before = poisoned_guard(DEVICE, CanaryCapacities(4, 4, 9), "grow")
    first = guard.buffers
    small = make_step([(1, 2, False)] * 2)  # 4 tokens: fits
    wide = make_step([(1, 3, False)] * 2)  # 6 tokens: token-only grow
    stale = guard.plan_step(**small.lengths(), req_to_token=small.req_to_token)
    guard.plan_step(**wide.lengths(), req_to_token=wide.req_to_token)
    assert guard.buffers.write_offsets is first.write_offsets
    with pytest.raises(RuntimeError, match="a later plan_step grew the plan buffers"):
        next(stale)
    assert_guard_untouched(guard, before)


def test_the_grow_warning_is_logged_once_per_guard(caplog):
    """The grow warning is logged once per guard: two guards, each growing twice, log two
    warnings, one each."""
    caplog.set_level(logging.INFO, logger="kvcanary_dispatch")
    for _ in range(2):
        guard = ForwardStepGuard(CanaryCapacities(1, 2, 9), "grow", device=DEVICE)
        for reqs in ([(1, 1, False)] * 2, [(1, 1, False)] * 5):
            step = make_step(reqs)
            for _ in guard.plan_step(**step.lengths(), req_to_token=step.req_to_token):
                pass
        assert guard.grow_count == 2
    records = [r for r in caplog.records if r.name == "kvcanary_dispatch"]
    assert len(records) == 2 and all(r.levelno == logging.WARNING for r in records)


@pytest.mark.parametrize("fault", ["int32", "strided"])
def test_a_grow_refuses_gpu_lengths_its_plan_would_refuse_before_growing(fault):
    """GPU lengths on the guard's device are planned as given after a grow: an int32 or a
    strided one, which the plan refuses, is refused by ``plan_step`` before the buffers grow
    (capacities, grow count and every buffer as they were, nothing planned); made int64 and
    contiguous, the same step grows once and plans every byte."""
    if DEVICE == "cpu":  # a CPU guard copies such host lengths to contiguous int64
        pytest.skip("only lengths on a GPU guard's device are planned as given")
    step = make_step([(1, 4, False)] * 3 + [(0, 2, True)])  # 4 requests, 14 tokens
    block = torch.stack(list(step.lengths().values()), dim=1).to(DEVICE)  # [bs, 3] int64
    lengths = dict(zip(step.lengths(), block.unbind(1), strict=True))  # each of stride (3,)
    if fault == "int32":
        lengths = {k: v.contiguous() for k, v in lengths.items()}
        lengths["extend_seq_lens"] = lengths["extend_seq_lens"].int()
        text = "extend_seq_lens must have dtype torch.int64, got torch.int32"
    else:
        text = "req_pool_indices must be contiguous; pass req_pool_indices.contiguous()"
    caps = CanaryCapacities(2, 4, 100)
    guard, before = poisoned_guard(DEVICE, caps, "grow")
    buffers = guard.buffers
    with pytest.raises(ValueError, match=re.escape(text)) as err:
        guard.plan_step(**lengths, req_to_token=step.req_to_token, num_tokens=14)
    assert str(err.value).startswith("kv-canary: "), err.value
    assert guard.buffers is buffers and guard.capacities == caps and guard.grow_count == 0
    assert_guard_untouched(guard, before)
    fixed = {k: v.contiguous().long() for k, v in lengths.items()}
    ((sub, buf),) = guard.plan_step(**fixed, req_to_token=step.req_to_token, num_tokens=14)
    assert guard.grow_count == 1 and buf is guard.buffers
    expect_plan(_case(sub, step, buf), buf.tensors(), "the fixed step, grown")
