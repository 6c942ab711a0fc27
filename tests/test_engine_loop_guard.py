"""The engine-loop tier, part two: ``ForwardStepGuard`` planning many steps with host
and device lengths through steps that fit, split and grow; then, on a machine with two GPUs,
every public function with its tensors on ``cuda:1`` while ``cuda:0`` is current.

As in ``test_engine_loop.py``: outputs poisoned whole before every (sub-)step and compared whole
with the references; ``KVCANARY_ENGINE_STEPS`` steps on a GPU (default 1000), a few without.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from _helpers import Step, as_kernel_kwargs, expect_step, scatter_with
from conftest import DEVICE, GPU, engine_steps, two_gpus
from test_step_split import check_cover

import kvcanary_dispatch as kd
from kvcanary_dispatch import (
    PLAN_STRATEGIES,
    SCATTER_STRATEGIES,
    CanaryCapacities,
    ForwardStepGuard,
    PlanBuffers,
    SubStep,
    split_forward_step,
)
from kvcanary_dispatch.testing.cases import (
    PlanCase,
    random_lut,
)
from kvcanary_dispatch.testing.engine_steps import (
    OffsetsStaging,
    engine_step,
    expect_plan,
    poison_,
)

SLEEP = 200_000  # GPU cycles (~0.1 ms) queued before a call

# write_req_capacity, write_entry_capacity of a fresh guard; req_to_token's width.
REQ_CAP, TOKEN_CAP = (256, 2048) if GPU else (12, 48)
R2T_WIDTH = 3 * TOKEN_CAP + 64
VERIFY_CAP = 10 * REQ_CAP
SCALARS = ("verify_num_valid", "verify_enable", "write_num_valid_reqs")
RESIZED = ("verify_offsets", "write_offsets", "write_seed_slot_indices")


def guard_step(k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Host ``(req_pool_indices, prefix_lens, extend_seq_lens)`` of step ``k``, against a fresh
    guard's capacities: fits, too many requests, too many tokens, one request past the token
    budget, in turn. Rows ``1..`` distinct, 15 % padding (row 0)."""
    g = torch.Generator().manual_seed(100 + k)

    def draw(lo: int, hi: int, n: int = 1) -> torch.Tensor:
        return torch.randint(lo, hi + 1, (n,), generator=g)

    kind = k % 4
    bs = int(draw(*((0, REQ_CAP), (REQ_CAP + 1, 3 * REQ_CAP), (1, REQ_CAP), (1, REQ_CAP))[kind]))
    per_req = TOKEN_CAP // REQ_CAP
    extend = draw(-1, per_req, bs) if kind < 2 else draw(0, 3 * TOKEN_CAP // bs, bs)
    if kind == 3:
        extend[int(draw(0, bs - 1))] = int(draw(TOKEN_CAP + 1, 3 * TOKEN_CAP))
    prefix = draw(0, 64, bs)
    rpi = torch.randperm(3 * REQ_CAP + 1, generator=g)[:bs] + 1
    rpi[torch.rand(bs, generator=g) < 0.15] = 0
    return rpi, prefix, extend


def sub_case(sub: SubStep, r2t, lut, swa: int, device) -> PlanCase:
    bs = sub.batch_size
    t = (sub.req_pool_indices, sub.prefix_lens, sub.extend_seq_lens)
    return PlanCase(*(x.to(device) for x in t), r2t, lut, swa, VERIFY_CAP, bs, bs + 1)


def check_grow(before: kd.PlanBuffers, after: kd.PlanBuffers, bs: int) -> None:
    """Grow: only the tensors whose size must change are new objects."""
    over_requests = bs > before.capacities.write_req_capacity
    for name in SCALARS:
        assert getattr(after, name) is getattr(before, name), f"{name} reallocated"
    for name in RESIZED:
        same = getattr(after, name) is getattr(before, name)
        assert same != over_requests, f"{name}: kept={same}, step over requests={over_requests}"
    assert after.write_offsets.shape[0] >= bs + 1


def run_guard_loop(policy: str, lengths: str, device, n_steps: int) -> int:
    """``n_steps`` steps through a guard (a fresh one every 4 steps); returns the sub-steps
    planned. Host lengths live in one staging tensor per field (pinned on a GPU), refilled as
    soon as the iteration is over; the last sub-step is compared after that refill."""
    device = torch.device(device)
    cuda = device.type == "cuda"
    g = torch.Generator().manual_seed(5)
    r2t = torch.randint(1, 2**30, (3 * REQ_CAP + 2, R2T_WIDTH), generator=g, dtype=torch.int32)
    r2t = r2t.to(device)
    lut = random_lut(2**20, g, "cpu").to(device)
    staging = torch.empty(3, 3 * REQ_CAP, dtype=torch.int64, pin_memory=cuda)
    subs_seen = 0
    guard = None
    for k in range(n_steps):
        if k % 4 == 0:
            caps = CanaryCapacities(REQ_CAP, TOKEN_CAP, VERIFY_CAP)
            strategy = PLAN_STRATEGIES[(k // 4) % len(PLAN_STRATEGIES)]  # a new one each guard
            guard = ForwardStepGuard(caps, policy, device=device, strategy=strategy)
        host = guard_step(k)
        bs = int(host[0].shape[0])
        n = int(host[2].clamp(min=0).sum())
        if lengths == "host":
            for row, t in zip(staging, host, strict=True):
                row[:bs].copy_(t)
            given = [row[:bs] for row in staging]
        else:
            given = [t.to(device) for t in host]
        with_lut = k % 2 == 1
        swa = 7 if k % 3 else 0
        before = guard.buffers
        if guard.capacities.fits(bs, n) or policy == "grow":
            expected = [SubStep(*host, 0, bs, 0, 0, n)]
        else:
            expected = split_forward_step(
                req_pool_indices=host[0],
                prefix_lens=host[1],
                extend_seq_lens=host[2],
                capacities=guard.capacities,
            )
            # the split the guard must follow, itself checked against the step (not by the
            # library's own split): every token once, in order, each piece's prefix advanced
            check_cover(Step(*host, r2t), guard.capacities, expected)
        if cuda:
            with torch.cuda.device(device):
                torch.cuda._sleep(SLEEP)
        planned = guard.plan_step(
            req_pool_indices=given[0],
            prefix_lens=given[1],
            extend_seq_lens=given[2],
            req_to_token=r2t,
            full_to_swa_index_mapping=lut if with_lut else None,
            swa_window_size=swa,
            num_tokens=n if k % 3 != 2 else None,
        )
        if policy == "grow":
            check_grow(before, guard.buffers, bs)
        poison_(*guard.buffers.tensors().values())  # the iterator plans; a grow happened above
        meta = ("req_start", "req_stop", "first_done", "token_start", "token_stop")
        count, last = 0, None
        for sub, buffers in planned:
            want = expected[count]
            got_meta = tuple(getattr(sub, m) for m in meta)
            assert got_meta == tuple(getattr(want, m) for m in meta), (k, count)
            assert buffers is guard.buffers
            case = sub_case(want, r2t, lut if with_lut else None, swa, device)
            what = f"step {k} ({policy}, {lengths}, bs={bs}, tokens={n}) sub-step {count}"
            count += 1
            if count < len(expected):  # the next sub-step overwrites the buffers
                expect_plan(case, buffers.tensors(), what)
                poison_(*buffers.tensors().values())
            else:
                last = (case, buffers.tensors(), what)
        assert count == len(expected) and last is not None, (k, count, len(expected))
        subs_seen += count
        if lengths == "host":
            staging.fill_(3)  # the engine's next step, before the GPU reached this one
        expect_plan(*last)
    return subs_seen


@pytest.mark.parametrize("lengths", ["host", "device"])
@pytest.mark.parametrize("policy", ["split", "grow"])
def test_guard_loop(policy, lengths):
    n_steps = engine_steps(24)
    subs = run_guard_loop(policy, lengths, DEVICE, n_steps)
    if policy == "split":
        assert subs > n_steps  # the loop did split
    else:
        assert subs == n_steps


# ---------------------------------------------------------------- a second GPU


def _on_cuda1_side(use_side: bool, side):
    """Device 1's current stream is ``side`` (when ``use_side``) while device 0 is current."""
    stack = contextlib.ExitStack()
    if use_side:
        stack.enter_context(torch.cuda.stream(side))
        torch.cuda.set_device(0)
    return stack


@two_gpus
def test_second_gpu_loop():
    """Every public function with its tensors on ``cuda:1`` while ``cuda:0`` is current, every
    third step with device 1's current stream a side stream that sleeps first: results equal
    the references and nothing is allocated on ``cuda:0``."""
    dev = torch.device("cuda:1")
    torch.cuda.set_device(0)
    rows, width = 60_200, 64
    pool = torch.empty(rows, width, dtype=torch.int32, device=dev)
    buffers = PlanBuffers.allocate(CanaryCapacities(rows, 0, 0), dev)
    staging = OffsetsStaging(rows + 1, pinned=True)
    lut = random_lut(3 * width, torch.Generator().manual_seed(5), "cpu").to(dev)
    side = torch.cuda.Stream(device=1)
    torch.cuda.synchronize(0)
    torch.cuda.reset_peak_memory_stats(0)
    base = torch.cuda.memory_allocated(0)
    variants = ("staged", "device", "host_int32", "staged_int32")
    for k in range(engine_steps(0)):
        bs = (0, 1, 511, 512, 513, 4095, 4096, 4097, 60_000, 70)[k % 10]  # 60 000: 480 KB
        mean = 300 if k % 10 == 9 else k % 9
        step = engine_step(
            k,
            bs=bs,
            mean_run=mean,
            pool=pool,
            lut=lut if k % 2 else None,
            swa_window_size=5 * (k % 2),
            capacity_mode=("at", "below")[k % 2],
        )
        offsets, refill = staging.offsets(step.scatter.offsets, variants[k % len(variants)])
        kept = step.kept()
        strategy = SCATTER_STRATEGIES[k % len(SCATTER_STRATEGIES)]
        plan_strategy = PLAN_STRATEGIES[(k // 10) % len(PLAN_STRATEGIES)]  # each meets every bs
        use_side = k % 3 == 2
        side.wait_stream(torch.cuda.current_stream(dev))
        with _on_cuda1_side(use_side, side):
            assert torch.cuda.current_device() == 0
            with torch.cuda.device(1):
                torch.cuda._sleep(SLEEP)
            poison_(pool, *buffers.tensors().values())
            if k % 4 == 3:  # the drop-in
                scatter_with(
                    step.scatter, pool, kd.launch_scatter_req_token_ids_kernel, offsets=offsets
                )
            else:
                scatter_with(step.scatter, pool, offsets=offsets, strategy=strategy)
            if refill is not None:
                refill()
            assert torch.cuda.current_device() == 0
            p = step.plan
            if k % 4 == 1:
                out = as_kernel_kwargs(buffers.tensors())
                kd.launch_plan_offsets_kernel(**p.inputs(), **out)
            else:
                kd.plan_offsets(**p.inputs(), **buffers.tensors(), strategy=plan_strategy)
            assert torch.cuda.current_device() == 0
        if use_side:
            side.synchronize()
        what = f"step {k} on cuda:1 (bs={bs}, {strategy}, {plan_strategy}, side={use_side})"
        expect_step(step, pool, buffers.tensors(), what, kept)
        if k % 10 == 0:  # the guard on cuda:1, host and device lengths, split and grow
            for policy in ("split", "grow"):
                for lengths in ("host", "device"):
                    run_guard_loop(policy, lengths, dev, 4)
        assert torch.cuda.current_device() == 0
    assert torch.cuda.max_memory_allocated(0) == base, "allocated on cuda:0"
