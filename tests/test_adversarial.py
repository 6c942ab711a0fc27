"""Adversarial inputs: each is rejected with its documented error before any launch,
outputs untouched, or (where the contract allows it) handled without error."""

from __future__ import annotations

import re

import pytest
import torch
from _helpers import plan_kwargs, plan_outputs, rejected, scatter_with
from conftest import DEVICE

from kvcanary_dispatch import (
    PLAN_STRATEGIES,
    SCATTER_STRATEGIES,
    CapacityError,
    plan_offsets,
)
from kvcanary_dispatch.testing.cases import check_plan, make_plan_case, make_scatter_case

I32_MAX = 2**31 - 1


def _plan(prefix_lens: list[int], extend_seq_lens: list[int], **kw):
    return make_plan_case(
        prefix_lens=prefix_lens, extend_seq_lens=extend_seq_lens, device=DEVICE, **kw
    )


@pytest.mark.parametrize("strategy", SCATTER_STRATEGIES)
def test_int32_offsets_near_2_31_rejected_by_validate(strategy):
    """int32 offsets near 2**31 widen exactly; their end then fails the CSR check."""
    case = make_scatter_case([1, 1], width=4, device=DEVICE)
    offsets = torch.tensor([0, I32_MAX - 5, I32_MAX], dtype=torch.int32, device=DEVICE)
    pool = case.fresh_pool()
    before = pool.clone()
    text = (
        f"kv-canary: scatter_req_token_ids offsets[2]={I32_MAX} must equal len(flat_in)=2; "
        "flat_in holds the runs' tokens back to back, no more"
    )
    with pytest.raises(ValueError, match=f"^{re.escape(text)}$"):
        scatter_with(case, pool, offsets=offsets, strategy=strategy, validate=True)
    assert torch.equal(pool, before)


@pytest.mark.parametrize("strategy", PLAN_STRATEGIES)
def test_zero_write_capacity(strategy):
    """Capacity 0 plans an empty step and rejects any request, naming the remedy."""
    empty = _plan([], [], max_seq_len=4, spare_capacity=0)
    check_plan(plan_offsets, empty, strategy=strategy)
    case = _plan([2], [1], max_seq_len=4)
    out = case.fresh_outputs()
    out["out_write_offsets"] = out["out_write_offsets"][:1].clone()
    out["out_write_seed_slot_indices"] = out["out_write_seed_slot_indices"][:0].clone()
    before = {k: v.clone() for k, v in out.items()}
    with pytest.raises(CapacityError, match=r"^kv-canary: bs=1 exceeds write_req_capacity=0; size"):
        plan_offsets(**case.inputs(), **out, strategy=strategy)
    assert issubclass(CapacityError, ValueError)
    for k, v in out.items():
        assert torch.equal(v, before[k]), k


@pytest.mark.parametrize("strategy", PLAN_STRATEGIES)
def test_zero_verify_capacity_turns_verify_off(strategy):
    case = _plan([5, 0, 7], [1, 2, 0], max_seq_len=8, verify_capacity=0)
    got = check_plan(plan_offsets, case, strategy=strategy, chunk_size=2)
    assert int(got["out_verify_enable"]) == 0 and int(got["out_verify_num_valid"]) == 0


@pytest.mark.parametrize("strategy", PLAN_STRATEGIES)
def test_lut_indices_far_past_its_end_are_clamped(strategy):
    """Slots far past the LUT's end read its last entry (never out of bounds)."""
    case = _plan([3, 6, 2], [1, 1, 1], max_seq_len=8, lut_len=2, swa_window_size=2)
    case.req_to_token.fill_(I32_MAX)
    got = check_plan(plan_offsets, case, strategy=strategy, chunk_size=1)
    assert torch.all(got["out_write_seed_slot_indices"][:3] == case.lut[-1])


@pytest.mark.parametrize("strategy", PLAN_STRATEGIES)
def test_validate_plan_negative_pool_index(strategy):
    case = _plan([3, 4], [1, 1], max_seq_len=8)
    case.req_pool_indices[1] = -3
    out = case.fresh_outputs()
    before = {k: v.clone() for k, v in out.items()}
    with pytest.raises(ValueError, match=r"req_pool_indices\[1\]=-3 is outside \[0, 4\)"):
        plan_offsets(**case.inputs(), **out, strategy=strategy, validate=True)
    for k, v in out.items():
        assert torch.equal(v, before[k]), k


@pytest.mark.parametrize("strategy", PLAN_STRATEGIES)
def test_full_batch_with_short_verify_offsets_is_a_length_error(strategy):
    """A batch of exactly the write capacity fits the write pair: verify offsets one short of
    ``bs + 1`` are the length error naming them and the length to pass, not a
    ``CapacityError`` (which would say that ``bs`` exceeds the capacity it equals). Nothing is
    written."""
    case = make_plan_case(
        prefix_lens=[3, 0, 5, 2],
        extend_seq_lens=[2, 1, 0, 3],
        padding=[False, True, False, False],
        max_seq_len=8,
        seed=3,
        device=DEVICE,
    )
    outs = case.fresh_outputs()
    bs = case.bs
    kw = plan_kwargs(
        case,
        out_verify_offsets=outs["out_verify_offsets"][:bs],  # one short
        out_write_offsets=outs["out_write_offsets"][: bs + 1],  # capacity bs exactly
        out_write_seed_slot_indices=outs["out_write_seed_slot_indices"][:bs],
        strategy=strategy,
    )
    msg = rejected(ValueError, lambda: plan_offsets(**kw), plan_outputs(kw))
    assert msg == f"kv-canary: out_verify_offsets length must be >= {bs + 1}, got {bs}", msg
    with pytest.raises(ValueError) as info:
        plan_offsets(**kw)
    assert not isinstance(info.value, CapacityError)
