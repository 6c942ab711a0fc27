"""Engine-safety regression tests, items 5 to 7 (items 1 to 4 are in ``test_engine_safety.py``,
item 8 in ``test_engine_safety_compile.py``); all run on the CPU.

5. Totals are exact up to ``2**63 - 1``; a ``verify_capacity`` past int32 is refused (clamped by
   ``CanaryCapacities.from_args``).
6. ``policy="grow"`` keeps every tensor whose size does not change.
7. The plan drop-in accepts ``swa_window_size > 0`` without a LUT, as upstream's launcher does.
"""

from __future__ import annotations

import re
from itertools import accumulate

import pytest
import torch
from _helpers import as_kernel_kwargs, rejected
from conftest import DEVICE
from test_engine_safety import plan_case

import kvcanary_dispatch as kd
from kvcanary_dispatch import (
    PLAN_STRATEGIES,
    CanaryCapacities,
    ForwardStepGuard,
    plan_offsets,
)
from kvcanary_dispatch.testing.cases import (
    PLAN_OUT_NAMES,
    PlanCase,
    check_plan,
    make_plan_case,
)
from kvcanary_dispatch.testing.engine_steps import (
    expect_plan,
    poison_,
)

I32_MAX, I64_MAX = 2**31 - 1, 2**63 - 1


# ---------------------------------------------------------------- 5. integer range


def extreme_plan_case(bs: int, verify_total: int, write_total: int, seed: int) -> PlanCase:
    """Small random lengths, then huge verify lengths on three requests in different slices
    (no extend: no seed read) and huge write lengths on two others (prefix 0: no seed), so
    that the totals are exactly ``verify_total`` and ``write_total``. No window, no padding."""
    g = torch.Generator().manual_seed(seed)
    prefix = torch.randint(0, 12, (bs,), generator=g)
    extend = torch.randint(-1, 4, (bs,), generator=g)
    big_v, big_w = [0, bs // 2, bs - 1], [1, bs // 2 + 1]
    prefix[big_v + big_w] = 0
    extend[big_v + big_w] = 0
    for idx, t, total in ((big_v, prefix, verify_total), (big_w, extend, write_total)):
        rest = total - int(t.clamp(min=0).sum())
        for i, j in enumerate(idx):
            t[j] = rest // len(idx) + (rest % len(idx) if i == 0 else 0)
    return make_plan_case(
        prefix_lens=prefix,
        extend_seq_lens=extend,
        max_seq_len=16,
        verify_capacity=I32_MAX,
        seed=seed,
        device=DEVICE,
    )


TOTALS = [2**61 - 1, 2**61, 2**62, 2**62 + 12_345, I64_MAX - 2**40, I64_MAX]


@pytest.mark.parametrize("total", TOTALS)
@pytest.mark.parametrize(
    "strategy,chunk",
    [
        ("auto", None),
        ("lookback", 7),  # 86 slices
        ("lookback", 64),
        ("scan", 64),
        ("loop", 128),
        ("auto", 100),
    ],
)
def test_item5_totals_exact_up_to_int64_max(strategy, chunk, total):
    bs = 600  # > 256: auto takes recount, in slices of 256
    case = extreme_plan_case(bs, total, I64_MAX - total + 2**60, seed=total % 1000)
    got = check_plan(plan_offsets, case, strategy=strategy, chunk_size=chunk)
    assert int(got["out_verify_offsets"][bs]) == total
    assert int(got["out_verify_enable"][0]) == 0 and int(got["out_verify_num_valid"][0]) == I32_MAX


@pytest.mark.parametrize("kind", ["verify", "write", "verify in the window"])
def test_item5_validate_refuses_totals_past_int64(kind):
    """``validate=True`` enforces the totals' precondition: a total that passes ``2**63 - 1``
    is refused naming the request where it does (and its length), before any launch; one at
    ``2**63 - 1`` exactly, or one that only the window brings under it, plans."""
    bs = 600
    case = extreme_plan_case(bs, I64_MAX, I64_MAX, seed=5)
    check_plan(plan_offsets, case, validate=True)  # both totals at the limit: accepted
    name = "extend_seq_lens" if kind == "write" else "prefix_lens"
    lens = getattr(case, name).clone()
    lens[bs // 2 + 1 if kind == "write" else bs - 1] += 1  # the last huge length, one more
    # A window of 2**61 cuts the three huge verify runs (about 2**63 / 3 each) to 2**61.
    window = 2**61 if kind == "verify in the window" else 0
    over = make_plan_case(
        **{**_lengths(case), name: lens},
        max_seq_len=16,
        seed=5,
        verify_capacity=I32_MAX,
        swa_window_size=window,
        device=DEVICE,
    )
    if window:
        check_plan(plan_offsets, over, validate=True)
        return
    outs = over.fresh_outputs()
    msg = rejected(ValueError, lambda: plan_offsets(**over.inputs(), **outs, validate=True),
                   list(outs.values()))  # fmt: skip
    what = "write" if kind == "write" else "verify"
    running = list(accumulate(lens.clamp(min=0).tolist()))  # exact (no padding here)
    last = next(r for r, total in enumerate(running) if total > I64_MAX)
    want = f"the {what} total passes {I64_MAX} at request {last} ({name}[{last}]={int(lens[last])})"
    assert want in msg and "plan fewer or shorter requests" in msg, msg


def _lengths(case: PlanCase) -> dict:
    return {"prefix_lens": case.prefix_lens, "extend_seq_lens": case.extend_seq_lens}


@pytest.mark.parametrize("capacity", [2**31, 2**31 + 1, 2**32, I64_MAX])
@pytest.mark.parametrize("call", [*PLAN_STRATEGIES, "drop-in"])
def test_item5_verify_capacity_past_int32_refused(call, capacity):
    case = plan_case(300)
    kw = {**case.inputs(), **case.fresh_outputs(), "verify_capacity": capacity}
    outs = [kw[k] for k in PLAN_OUT_NAMES]
    if call == "drop-in":
        kw = as_kernel_kwargs(kw)
        message = rejected(ValueError, lambda: kd.launch_plan_offsets_kernel(**kw), outs)
    else:
        message = rejected(ValueError, lambda: plan_offsets(**kw, strategy=call), outs)
    assert "verify_capacity" in message, message


@pytest.mark.parametrize("capacity", [I32_MAX, I32_MAX - 1])
@pytest.mark.parametrize("strategy", PLAN_STRATEGIES)
def test_item5_verify_capacity_at_int32_max_accepted(strategy, capacity):
    for total in (capacity - 1, capacity, capacity + 1, 2**40):
        case = extreme_plan_case(300, total, 7 * total, seed=total % 97)
        case.verify_capacity = capacity
        got = check_plan(plan_offsets, case, strategy=strategy)
        assert int(got["out_verify_enable"][0]) == int(total <= capacity)
        assert int(got["out_verify_num_valid"][0]) == min(total, capacity)


@pytest.mark.parametrize(
    "slots,want",
    [(715_827_882, 2_147_483_646), (715_827_883, I32_MAX), (10**12, I32_MAX), (5, 15)],
)
def test_item5_from_args_clamps_verify_capacity(slots, want):
    caps = CanaryCapacities.from_args(
        cuda_graph_max_bs=8,
        req_to_token_pool_size=4,
        max_prefill_tokens=100,
        pool_slot_count=slots,
    )
    assert caps.verify_capacity == want


def test_item5_capacities_refuse_verify_capacity_past_int32():
    text = (
        "kv-canary: verify_capacity=2147483648 exceeds 2147483647: the int32 out_verify_num_valid "
        "cannot count past it; pass verify_capacity=min(verify_capacity, 2147483647) (a step "
        "with more verify entries turns its verify off); CanaryCapacities.from_args clamps it"
    )
    with pytest.raises(ValueError, match=f"^{re.escape(text)}$"):
        CanaryCapacities(write_req_capacity=1, write_entry_capacity=1, verify_capacity=2**31)
    assert CanaryCapacities(1, 1, I32_MAX).verify_capacity == I32_MAX


# ---------------------------------------------------------------- 6. grow


def _grow_step(bs: int, tokens_each: int) -> PlanCase:
    case = plan_case(bs, lut_len=None, swa_window_size=0)
    case.extend_seq_lens.fill_(tokens_each)
    return case


@pytest.mark.parametrize(
    "bs,tokens_each,kept", [(3, 9, PLAN_OUT_NAMES), (6, 1, PLAN_OUT_NAMES[3:])]
)
def test_item6_grow_keeps_the_tensors_whose_size_holds(bs, tokens_each, kept):
    """Over the token capacity alone: every tensor kept; over the request capacity: the
    offsets and seeds grow, the three int32 scalars are kept."""
    guard = ForwardStepGuard(CanaryCapacities(4, 10, 50), "grow", device=DEVICE)
    old = guard.buffers.tensors()
    case = _grow_step(bs, tokens_each)
    steps = guard.plan_step(
        req_pool_indices=case.req_pool_indices,
        prefix_lens=case.prefix_lens,
        extend_seq_lens=case.extend_seq_lens,
        req_to_token=case.req_to_token,
    )  # grown here, planned as the iteration goes
    poison_(*guard.buffers.tensors().values())  # kept and new (zero-filled) alike
    ((sub, buffers),) = steps
    new = buffers.tensors()
    assert guard.grow_count == 1 and guard.capacities.fits(bs, bs * tokens_each)
    for name in PLAN_OUT_NAMES:
        assert (new[name] is old[name]) == (name in kept), name
    case.verify_capacity = 50
    expect_plan(case, new, "the grown guard's step")  # every byte, poison past bs


# ---------------------------------------------------------------- 7. drop-in parity


@pytest.mark.parametrize("bs", [0, 9, 300, 4097])
def test_item7_plan_drop_in_window_without_lut(bs):
    case = plan_case(bs, seed=bs, lut_len=None, swa_window_size=5)
    got = check_plan(
        kd.launch_plan_offsets_kernel, case, out_verify_name="out_verify_offsets_scratch"
    )
    # The reference itself, checked independently: the window applies, no seed is translated.
    active = case.req_pool_indices != 0
    window = torch.where(active, case.prefix_lens.clamp(min=0, max=5), 0)
    assert int(got["out_verify_offsets"][bs]) == int(window.sum())
    seeded = active & (case.prefix_lens > 0) & (case.extend_seq_lens > 0)
    rows, cols = case.req_pool_indices[seeded], case.prefix_lens[seeded] - 1
    raw = case.req_to_token[rows, cols].to(torch.int64)
    assert torch.equal(got["out_write_seed_slot_indices"][:bs][seeded], raw)
