"""The engine-loop tier: many forward steps through the public API, driven the way a
serving engine drives it, every output byte compared with the torch references after every step.

Each loop keeps its outputs from step to step (an engine's persistent pool and plan buffers),
poisons them whole before each step and compares them whole with the reference run on poisoned
copies, so an unwritten element, or one written that should not be, shows. Loops: eager calls
through every strategy and offsets placement (one host staging buffer refilled right after each
call); a CUDA graph captured once and replayed with new data; calls on a side stream;
``torch.compile(fullgraph=True)`` around a step. ``test_engine_loop_guard.py`` holds the
guard's loops and the second-GPU loop. Without a GPU the loops that can run do so for a few
steps (Triton's interpreter); on a GPU each runs ``KVCANARY_ENGINE_STEPS`` steps (default
1000), e.g. ``KVCANARY_ENGINE_STEPS=5000 python -m pytest tests/test_engine_loop*.py``.
"""

from __future__ import annotations

import pytest
import torch
from _helpers import expect_step, plan_step_kwargs, scatter_with
from conftest import DEVICE, GPU, capture_graph, engine_steps, gpu

from kvcanary_dispatch import (
    PLAN_STRATEGIES,
    SCATTER_STRATEGIES,
    CanaryCapacities,
    ForwardStepGuard,
    PlanBuffers,
    plan_offsets,
    scatter_req_token_ids,
)
from kvcanary_dispatch.launch_plan import resolve_scatter_strategy
from kvcanary_dispatch.scatter_shapes import rows_grid
from kvcanary_dispatch.testing.cases import (
    PlanCase,
    ScatterCase,
    assert_bytes_equal,
    make_scatter_case,
    random_lut,
)
from kvcanary_dispatch.testing.engine_steps import (
    OffsetsStaging,
    engine_step,
    expect_plan,
    expect_scatter,
    poison_,
)
from kvcanary_kernels.scatter_rows import ROWS_COLS

# Pool rows and width (max_context_len); the largest step; the longest mean run. On a GPU,
# steps reach 40 000 requests: offsets past ~64 KB, which the driver no longer copies at
# enqueue time, so an upload that read the staging buffer late would show.
ROWS, WIDTH, MAX_BS, MAX_RUN = (40_200, 512, 40_000, 1024) if GPU else (600, 16, 520, 300)
# Long-run steps have 64..LONG_BS requests (auto: "rows" up to 512, then "capped").
LONG_BS = 2000 if GPU else 72
EDGE_BS = (0, 1, 63, 64, 255, 256, 257, 511, 512, 513, 4095, 4096, 4097)
SLEEP = 200_000  # GPU cycles (~0.1 ms) queued before a call: an engine's forward pass
OFFSETS = ("device", "staged", "host_int32", "device_int32", "staged_int32", "host")


def schedule(k: int, max_bs: int = MAX_BS) -> tuple[int, int]:
    """``(bs, mean run)`` of step ``k``: block edges, long runs, short runs, in turn."""
    g = torch.Generator().manual_seed(k)

    def draw(lo: int, hi: int) -> int:
        return int(torch.randint(lo, hi + 1, (1,), generator=g))

    if k % 3 == 0:
        edges = [e for e in EDGE_BS if e <= max_bs]
        return edges[(k // 3) % len(edges)], draw(0, 8)
    if k % 3 == 1:
        return draw(64, min(LONG_BS, max_bs)), draw(256, MAX_RUN)
    return draw(0, max_bs), draw(0, 40)


def make_lut(device) -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    return random_lut(3 * WIDTH, g, "cpu").to(device)


def make_step(k: int, pool: torch.Tensor, max_bs: int = MAX_BS, **kw):
    bs, mean = schedule(k, max_bs)
    lut = make_lut(pool.device) if k % 2 else None
    return engine_step(
        k,
        bs=bs,
        mean_run=mean,
        pool=pool,
        lut=lut,
        swa_window_size=(0, 5, 3 * WIDTH)[k % 3],
        capacity_mode=("at", "below", "above")[k % 3],
        **kw,
    )


def call_scatter(step, pool, offsets, strategy: str, chunk: int | None) -> None:
    scatter_with(step.scatter, pool, offsets=offsets, chunk_size=chunk, strategy=strategy)


def call_plan(plan: PlanCase, buffers: PlanBuffers, strategy: str, chunk: int | None) -> None:
    plan_offsets(**plan.inputs(), **buffers.tensors(), strategy=strategy, chunk_size=chunk)


def engine_state(device, rows: int = ROWS, max_bs: int = MAX_BS):
    pool = torch.empty(rows, WIDTH, dtype=torch.int32, device=device)
    return pool, PlanBuffers.allocate(CanaryCapacities(max_bs, 0, 0), device)


# ---------------------------------------------------------------- eager, staged offsets


def test_eager_loop_every_strategy_and_offsets_placement():
    """Every strategy of both functions, chunk sizes, offsets on the device, in a fresh host
    tensor, or in one staging buffer refilled (with another valid CSR) right after each call,
    behind queued GPU work on a GPU."""
    pool, buffers = engine_state(DEVICE)
    staging = OffsetsStaging(MAX_BS + 1, pinned=GPU)
    for k in range(engine_steps(30)):
        step = make_step(k, pool)
        variant = OFFSETS[(k // 5) % len(OFFSETS)]
        strategy = SCATTER_STRATEGIES[k % len(SCATTER_STRATEGIES)]
        chunk = (None, 100, None, 7)[(k // 2) % 4]
        what = f"step {k} (bs={step.scatter.bs}, {strategy}, chunk={chunk}, {variant})"
        poison_(pool)
        kept = step.kept()
        offsets, refill = staging.offsets(step.scatter.offsets, variant)
        if GPU:
            torch.cuda._sleep(SLEEP)
        call_scatter(step, pool, offsets, strategy, chunk)
        if refill is not None:
            refill()  # the engine's next use of its buffer, before the GPU got to this step
        expect_scatter(step.scatter, pool, what, kept[0])

        plan_strategy = PLAN_STRATEGIES[k % len(PLAN_STRATEGIES)]
        plan_chunk = (None, 100, 1000)[(k // 4) % 3]
        poison_(*buffers.tensors().values())
        table = pool.clone()  # the plan's req_to_token: read, never written
        call_plan(step.plan, buffers, plan_strategy, plan_chunk)
        what = f"step {k} ({plan_strategy}, {plan_chunk})"
        expect_plan(step.plan, buffers.tensors(), what, kept[1])
        assert_bytes_equal(pool, table, f"{what}: req_to_token")


# ---------------------------------------------------------------- CUDA graph


@gpu
@pytest.mark.parametrize("bs,total", [(3000, 36_000), (600, 14_400)])  # capped: short, long
def test_graph_loop_replayed_with_new_data(bs, total):
    """One graph holds the step's scatter (device offsets) and the guard's plan (device
    lengths, ``num_tokens`` given); each replay follows new data copied into its inputs."""
    assert resolve_scatter_strategy("auto", bs, total, None, WIDTH) == "capped"
    pool = torch.empty(bs + 8, WIDTH, dtype=torch.int32, device=DEVICE)
    lut = make_lut(DEVICE)
    caps = CanaryCapacities(bs, 8 * bs, 9 * bs // 2)
    guard = ForwardStepGuard(caps, "split", device=DEVICE)
    live = engine_step(0, bs=bs, mean_run=0, pool=pool, lut=lut, swa_window_size=5, total=total)
    plan = PlanCase(**{**vars(live.plan), "verify_capacity": caps.verify_capacity})

    def step() -> None:
        call_scatter(live, pool, live.scatter.offsets, "auto", None)
        for _ in guard.plan_step(**plan_step_kwargs(plan, req_to_token=pool, num_tokens=8 * bs)):
            pass

    graph = capture_graph(step)
    for k in range(1, engine_steps(0) + 1):
        new = engine_step(k, bs=bs, mean_run=0, pool=pool, lut=lut, swa_window_size=5, total=total)
        for name in ("flat_in", "offsets", "req_pool_indices"):
            getattr(live.scatter, name).copy_(getattr(new.scatter, name))
        for name in ("req_pool_indices", "prefix_lens", "extend_seq_lens"):
            getattr(plan, name).copy_(getattr(new.plan, name))
        poison_(pool, *guard.buffers.tensors().values())
        kept = live.scatter.kept(), plan.kept(req_to_token=False)
        graph.replay()
        expect_scatter(live.scatter, pool, f"replay {k}", kept[0])
        expect_plan(plan, guard.buffers.tensors(), f"replay {k}", kept[1])


@gpu
@pytest.mark.parametrize("bs,total", [(64, 5000), (128, 40_000)])
def test_graph_rows_on_wide_pool_replayed_with_new_runs(bs, total):
    """``auto`` takes ``"rows"`` on a 65 536-column pool; its grid, fixed at capture, covers
    ``min(width, tokens)`` columns: one program a tile for 64 requests of 5 000 tokens, 16 a
    request for 128 of 40 000 (a run of 40 000 then copied in 3 steps). Replays move the tokens
    between requests: all in one (past the grid's first tile), a few long runs, a random
    partition; every byte of the wide pool checked after each."""
    width = 65_536
    assert resolve_scatter_strategy("auto", bs, total, None, width) == "rows"
    columns = rows_grid(bs, total, width)[1] * ROWS_COLS  # a program's first tiles
    assert (columns >= total) == (bs == 64)
    pool = torch.empty(bs + 8, width, dtype=torch.int32, device=DEVICE)
    g = torch.Generator().manual_seed(11)

    def case(k: int) -> ScatterCase:
        if k % 3 == 0:  # every token in one request
            lens = torch.zeros(bs, dtype=torch.int64)
            lens[int(torch.randint(0, bs, (1,), generator=g))] = total
        else:  # a random partition (k % 3 == 1) or a few long runs among empty ones
            live = bs if k % 3 == 1 else 3
            cuts = torch.randint(0, total + 1, (live - 1,), generator=g).sort().values
            parts = torch.cat([torch.tensor([0]), cuts, torch.tensor([total])]).diff()
            lens = torch.zeros(bs, dtype=torch.int64)
            lens[torch.randperm(bs, generator=g)[:live]] = parts
        return make_scatter_case(lens, width=width, spare_rows=8, seed=k, device=DEVICE)

    live = case(1)
    graph = capture_graph(lambda: scatter_with(live, pool, strategy="auto"))
    for k in range(engine_steps(0) + 1):
        new = case(k)
        for name in ("flat_in", "offsets", "req_pool_indices"):
            getattr(live, name).copy_(getattr(new, name))
        poison_(pool)
        graph.replay()
        longest = int(live.offsets.diff().max())
        expect_scatter(live, pool, f"replay {k} (longest run {longest})")


# ---------------------------------------------------------------- side stream


@gpu
def test_side_stream_loop():
    """Every call on a side stream that first sleeps then poisons the outputs, with no sync but
    the side stream's at the end of the step: a launch on another stream would land before the
    poison and leave it showing."""
    pool, buffers = engine_state(DEVICE)
    staging = OffsetsStaging(MAX_BS + 1, pinned=GPU)
    guard = ForwardStepGuard(CanaryCapacities(MAX_BS, 10 * MAX_BS, 2**31 - 1), device=DEVICE)
    side = torch.cuda.Stream()
    for k in range(engine_steps(0)):
        step = make_step(k, pool)
        variant = OFFSETS[k % len(OFFSETS)]
        strategy = SCATTER_STRATEGIES[k % len(SCATTER_STRATEGIES)]
        plan_strategy = PLAN_STRATEGIES[(k // 5) % len(PLAN_STRATEGIES)]
        offsets, refill = staging.offsets(step.scatter.offsets, variant)
        kept = step.kept()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            torch.cuda._sleep(SLEEP)
            poison_(pool, *buffers.tensors().values(), *guard.buffers.tensors().values())
            call_scatter(step, pool, offsets, strategy, None)
            if refill is not None:
                refill()
            call_plan(step.plan, buffers, plan_strategy, None)
            p = step.plan
            num_tokens = int(p.extend_seq_lens.shape[0]) * 8
            ((_, planned),) = guard.plan_step(
                **plan_step_kwargs(p, req_to_token=pool, num_tokens=num_tokens)
            )
        side.synchronize()
        what = f"step {k} (bs={step.scatter.bs}, {strategy}, {variant}, {plan_strategy})"
        expect_step(step, pool, buffers.tensors(), what, kept)
        guard_case = PlanCase(**{**vars(p), "verify_capacity": 2**31 - 1})
        expect_plan(guard_case, planned.tensors(), f"{what}, guard")


# ---------------------------------------------------------------- torch.compile


@pytest.mark.parametrize("bs,total", [(600, 2_400), (600, 14_400)])  # capped: short; long
def test_compiled_step_loop(bs, total):
    """``torch.compile(fullgraph=True)`` around a step that scatters and plans (``aot_eager``
    without a GPU, inductor with one); new data each step, the shapes of an engine's padded
    batch."""
    assert resolve_scatter_strategy("auto", bs, total, None, WIDTH) == "capped"
    torch._dynamo.reset()
    pool = torch.empty(bs + 4, WIDTH, dtype=torch.int32, device=DEVICE)
    buffers = PlanBuffers.allocate(CanaryCapacities(bs, 0, 0), DEVICE)
    lut = make_lut(DEVICE)

    def step_fn(flat_in, offsets, rpi, pool_out, plan_rpi, prefix, extend, outs):
        scatter_req_token_ids(
            flat_in=flat_in, offsets=offsets, req_pool_indices=rpi, pool_out=pool_out
        )
        plan_offsets(
            req_pool_indices=plan_rpi,
            prefix_lens=prefix,
            extend_seq_lens=extend,
            req_to_token=pool_out,
            full_to_swa_index_mapping=lut,
            swa_window_size=5,
            verify_capacity=4 * bs,
            **outs,
        )

    compiled = torch.compile(step_fn, fullgraph=True, backend="inductor" if GPU else "aot_eager")
    for k in range(engine_steps(2)):
        step = engine_step(k, bs=bs, mean_run=0, pool=pool, lut=lut, swa_window_size=5, total=total)
        s, p = step.scatter, step.plan
        poison_(pool, *buffers.tensors().values())
        compiled(
            s.flat_in,
            s.offsets,
            s.req_pool_indices,
            pool,
            p.req_pool_indices,
            p.prefix_lens,
            p.extend_seq_lens,
            buffers.tensors(),
        )
        expect_scatter(s, pool, f"compiled step {k}")
        plan = PlanCase(**{**vars(p), "verify_capacity": 4 * bs})
        expect_plan(plan, buffers.tensors(), f"compiled step {k}")
