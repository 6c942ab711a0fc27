"""The forward-step guard's token count: ``num_tokens`` below what host ``extend_seq_lens``
hold, or given as a tensor, refused before anything is written; the host count exact at every
step size (negative lengths count 0; sums past int64 do not wrap)."""

from __future__ import annotations

import re
from functools import partial

import pytest
import torch
from _helpers import assert_guard_untouched, poisoned_guard, random_step
from conftest import DEVICE

from kvcanary_dispatch.capacities import CanaryCapacities

make_step = partial(random_step, device=DEVICE)


@pytest.mark.parametrize("count,capacity", [(3, 32), (89, 89)])
@pytest.mark.parametrize("policy", ["split", "grow", "raise"])
def test_guard_refuses_num_tokens_below_the_host_lengths(policy, count, capacity):
    """A ``num_tokens`` smaller than what host ``extend_seq_lens`` hold (by any amount: one
    short, at a budget it would just fit) would plan 90 tokens into a smaller budget: refused,
    naming both; a larger count (padding) is taken."""
    step = make_step([(1, 30, False), (2, 30, False), (0, 30, False)])
    kw = dict(**step.lengths(), req_to_token=step.req_to_token)
    guard, before = poisoned_guard(DEVICE, CanaryCapacities(8, capacity, 9), policy)
    text = f"kv-canary: num_tokens={count} is less than the 90 new tokens the host extend_seq_lens"
    with pytest.raises(ValueError, match=re.escape(text)):
        guard.plan_step(**kw, num_tokens=count)
    assert_guard_untouched(guard, before)
    fits = make_step([(1, 3, False), (2, 1, False)])
    ((sub, _),) = guard.plan_step(**fits.lengths(), req_to_token=fits.req_to_token, num_tokens=6)
    assert sub.tokens == slice(0, 6)


@pytest.mark.parametrize("count", [torch.tensor(6), torch.tensor(True), torch.tensor([6])])
def test_guard_refuses_a_num_tokens_tensor(count):
    """A tensor ``num_tokens`` is refused before anything is read or written (its value would
    be a read-back, a sync on a GPU): the fit check takes host integers only."""
    step = make_step([(1, 3, False), (2, 1, False)])
    guard, before = poisoned_guard(DEVICE, CanaryCapacities(8, 32, 9), "raise")
    text = "kv-canary: num_tokens must be a non-negative integer, got a tensor; pass int(num_"
    with pytest.raises(ValueError, match=re.escape(text)):
        guard.plan_step(**step.lengths(), req_to_token=step.req_to_token, num_tokens=count)
    assert_guard_untouched(guard, before)


def test_guard_counts_host_tokens_past_int64_exactly():
    """Host lengths whose sum passes int64 are counted exactly (an int64 sum would wrap negative
    and call the step fitting)."""
    guard, before = poisoned_guard(DEVICE, CanaryCapacities(8, 32, 9), "raise")
    step = make_step([(1, 2, False)] * 3)
    with pytest.raises(RuntimeError, match=f"token count={3 * 2**62} exceeds"):
        guard.plan_step(
            **{**step.lengths(), "extend_seq_lens": [2**62] * 3}, req_to_token=step.req_to_token
        )
    assert_guard_untouched(guard, before)


@pytest.mark.parametrize("bs", [3, 128, 129, 600])
@pytest.mark.parametrize("huge", [False, True])
def test_guard_counts_host_tokens_exactly_at_every_size(bs, huge):
    """The host token count, summed in Python for short steps and by torch for longer ones:
    negative lengths count 0, and lengths whose int64 sum would wrap are counted exactly."""
    extend = torch.tensor([1, -7, 4] * (bs // 3) + [2] * (bs % 3), dtype=torch.int64)
    if huge:
        extend[:3] = 2**62
    want = sum(max(int(v), 0) for v in extend)
    step = make_step([(1, 2, False)] * bs)
    guard, before = poisoned_guard(DEVICE, CanaryCapacities(bs, 3, 9), "raise")
    with pytest.raises(RuntimeError, match=f"token count={want} exceeds"):
        guard.plan_step(
            **{**step.lengths(), "extend_seq_lens": extend}, req_to_token=step.req_to_token
        )
    assert_guard_untouched(guard, before)
