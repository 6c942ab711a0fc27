"""The forward-step guard's "split" policy: a refusal writes nothing, lengths it would split
into views of themselves are refused before any piece is planned (with the fix), and each
later piece of a cut request verifies its advanced prefix."""

from __future__ import annotations

import re
from functools import partial

import pytest
import torch
from _helpers import assert_guard_untouched, poisoned_guard, random_step
from conftest import DEVICE

from kvcanary_dispatch.capacities import CanaryCapacities, PlanBuffers
from kvcanary_dispatch.forward_step import ForwardStepGuard
from kvcanary_dispatch.step_split import refuse_split_views

make_step = partial(random_step, device=DEVICE)


def test_guard_split_refusal_writes_nothing():
    step = make_step([(1, 2, False), (0, 1, False)])
    guard, before = poisoned_guard(DEVICE, CanaryCapacities(0, 9, 0), "split")
    with pytest.raises(ValueError, match="write_req_capacity=0"):
        guard.plan_step(**step.lengths(), req_to_token=step.req_to_token)
    assert_guard_untouched(guard, before)


@pytest.mark.parametrize("fault", ["strided", "int32"])
def test_split_views_refused_before_the_split(fault):
    """The refusal a GPU guard makes of GPU lengths it would split into views (the guard's
    own test below needs them on the guard's device as given, which strided or int32 CPU
    lengths never are: the guard copies them): a strided or int32 length on the outputs'
    device is refused with the fix."""
    outs = PlanBuffers.allocate(CanaryCapacities(2, 4, 100), torch.device("cpu")).outputs()
    good = torch.zeros(4, dtype=torch.int64)
    bad = torch.zeros(8, dtype=torch.int64)[::2] if fault == "strided" else good.int()
    text = "must be contiguous, got stride (2,)" if fault == "strided" else "must have dtype"
    fix = "prefix_lens.contiguous()" if fault == "strided" else "prefix_lens.long()"
    with pytest.raises(ValueError, match=re.escape(f"kv-canary: prefix_lens {text}")) as err:
        refuse_split_views((good, bad, good), outs)
    assert f"the step is split on cpu into views of it; pass {fix}" in str(err.value)


def test_split_views_sharing_memory_with_the_outputs_refused_before_the_split():
    """Lengths that share memory with the plan outputs, which the plan refuses of each piece,
    are refused before the split, with the plan's text: no piece is refused after earlier
    ones were planned."""
    outs = PlanBuffers.allocate(CanaryCapacities(4, 4, 100), torch.device("cpu")).outputs()
    good = torch.zeros(4, dtype=torch.int64)
    text = "kv-canary: plan_offsets out_write_offsets shares memory with prefix_lens; pass"
    with pytest.raises(ValueError, match=re.escape(text)):
        refuse_split_views((good, outs.out_write_offsets[:4], good), outs)


def test_guard_split_refuses_lengths_sharing_memory_with_its_buffers_before_any_piece():
    """Lengths on the guard's device that are views of its own buffers (an engine staging its
    lengths in a free tail of them): ``plan_step`` refuses the step to split with the plan's
    text, before any piece is planned, rather than at a later piece after earlier ones wrote
    the buffers."""
    step = make_step([(0, 9, False), (0, 2, False), (0, 2, False), (0, 2, False)])
    guard, before = poisoned_guard(DEVICE, CanaryCapacities(8, 4, 100), "split")
    kw = dict(**step.lengths(), req_to_token=step.req_to_token)
    kw["prefix_lens"] = guard.buffers.verify_offsets[4:8]  # poison: past the pieces' plans
    text = "kv-canary: plan_offsets out_verify_offsets shares memory with prefix_lens"
    with pytest.raises(ValueError, match=re.escape(text)):
        guard.plan_step(**kw)  # at the call, not while iterating
    assert_guard_untouched(guard, before)


@pytest.mark.parametrize("fault", ["strided", "int32"])
def test_guard_split_refuses_lengths_its_pieces_would_not_plan(fault):
    """Lengths on the guard's device are split into views of themselves: a strided one (whose
    one-request pieces the plan would take, and whose first longer piece it would refuse) or a
    GPU int32 one is refused by ``plan_step``, before any piece is planned, naming the fix;
    nothing is written. Made contiguous (or int64), the same step is split and planned."""
    if DEVICE == "cpu":  # test_split_views_refused_before_the_split runs the refusal itself
        pytest.skip("CPU lengths are copied to contiguous int64: only GPU ones are split as given")
    step = make_step([(0, 8, False), (0, 1, False), (0, 1, False), (0, 2, False)])
    block = torch.stack(list(step.lengths().values()), dim=1).to(DEVICE)  # [bs, 3]
    lengths = dict(zip(step.lengths(), block.unbind(1), strict=True))  # each of stride (3,)
    if fault == "int32":
        lengths = {k: v.contiguous() for k, v in lengths.items()}
        lengths["extend_seq_lens"] = lengths["extend_seq_lens"].int()
        text = "extend_seq_lens must have dtype torch.int64, got torch.int32"
        fix = "pass extend_seq_lens.long()"
    else:
        text, fix = "req_pool_indices must be contiguous, got stride (3,)", "contiguous()"
    guard, before = poisoned_guard(DEVICE, CanaryCapacities(2, 4, 100), "split")
    with pytest.raises(ValueError, match=re.escape(f"kv-canary: {text}")) as err:
        guard.plan_step(**lengths, req_to_token=step.req_to_token, num_tokens=12)
    assert f"the step is split on {torch.device(DEVICE)}" in str(err.value) and fix in str(
        err.value
    )
    assert_guard_untouched(guard, before)
    fixed = {k: v.contiguous().long() for k, v in lengths.items()}
    pieces = [
        buf.write_offsets[: sub.batch_size + 1].tolist()
        for sub, buf in guard.plan_step(**fixed, req_to_token=step.req_to_token, num_tokens=12)
    ]
    assert pieces == [[0, 4], [0, 4], [0, 1, 2], [0, 2]], pieces


def test_split_pieces_verify_their_advanced_prefix():
    """The documented cost of a cut: each later piece of a cut request verifies its advanced
    prefix, so the last sub-step's verify total (34 + 20) passes a capacity of 50 that the
    whole step (10 + 20) fits, and that sub-step's plan turns its verify off, request 2's
    prefix included."""
    step = make_step([(10, 30, False), (20, 2, False)])
    guard = ForwardStepGuard(CanaryCapacities(4, 8, 50), "split", device=DEVICE)
    seen = [
        (sub.prefix_lens.tolist(), int(buf.verify_num_valid), int(buf.verify_enable))
        for sub, buf in guard.plan_step(**step.lengths(), req_to_token=step.req_to_token)
    ]
    assert seen == [([10], 10, 1), ([18], 18, 1), ([26], 26, 1), ([34, 20], 50, 0)]
    whole = ForwardStepGuard(CanaryCapacities(4, 32, 50), "split", device=DEVICE)
    ((_, buf),) = whole.plan_step(**step.lengths(), req_to_token=step.req_to_token)
    assert (int(buf.verify_num_valid), int(buf.verify_enable)) == (30, 1)


def test_padding_tokens_of_a_split_step_are_in_no_sub_step():
    """A padded ``num_tokens`` (6 for 4 owned tokens): a step that fits yields it whole, its
    ``tokens`` up to 6, padding included; one split for it (capacity 5, or 3) yields sub-steps
    whose ``tokens`` cover the 4 owned tokens in order and none of the padding."""
    step = make_step([(3, 3, False), (1, 1, False)])
    kw = dict(**step.lengths(), req_to_token=step.req_to_token, num_tokens=6)
    fits = ForwardStepGuard(CanaryCapacities(8, 6, 99), "split", device=DEVICE)
    assert [sub.tokens for sub, _ in fits.plan_step(**kw)] == [slice(0, 6)]
    for capacity, want in [(5, [slice(0, 4)]), (3, [slice(0, 3), slice(3, 4)])]:
        guard = ForwardStepGuard(CanaryCapacities(8, capacity, 99), "split", device=DEVICE)
        got = [(sub.tokens, sub.num_tokens) for sub, _ in guard.plan_step(**kw)]
        assert got == [(t, t.stop - t.start) for t in want], (capacity, got)
