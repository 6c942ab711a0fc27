"""``torch.compile(mode="reduce-overhead")``: inductor records a step that scatters and plans
into its own CUDA graphs (cudagraph trees) and replays them, with new data each step, the way
an engine that compiles its forward pass with CUDA graphs calls the library. Two ways to hold
the outputs: passed in as arguments (inductor leaves a graph with mutated inputs uncaptured and
runs it eagerly), and as a module's registered buffers (static addresses, which inductor
captures with their mutations: the test checks that it did). Each step's outputs are poisoned
whole first and compared whole with the references; a failure's message carries inductor's
counters (the graphs it declined to capture among them). GPU only: the mode records CUDA
graphs."""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICE, engine_steps, gpu

from kvcanary_dispatch import CanaryCapacities, PlanBuffers, plan_offsets, scatter_req_token_ids
from kvcanary_dispatch.testing.cases import PlanCase, random_lut
from kvcanary_dispatch.testing.engine_steps import engine_step, expect_plan, expect_scatter, poison_

BS, TOTAL, WIDTH = 600, 14_400, 512  # the capped strategy's shapes, with long runs


class _Step(torch.nn.Module):
    """A step whose pool and plan outputs are this module's buffers (``held``) or its
    arguments."""

    def __init__(self, held: bool, lut: torch.Tensor) -> None:
        super().__init__()
        self.held, self.lut = held, lut
        pool = torch.empty(BS + 4, WIDTH, dtype=torch.int32, device=DEVICE)
        outs = PlanBuffers.allocate(CanaryCapacities(BS, 0, 0), DEVICE).tensors()
        self.names = tuple(outs)
        if held:
            self.register_buffer("pool", pool)
            for name, t in outs.items():
                self.register_buffer(name, t)
        else:
            self.pool, self.outs = pool, outs

    def outputs(self) -> dict[str, torch.Tensor]:
        return {n: getattr(self, n) for n in self.names} if self.held else self.outs

    def forward(self, flat_in, offsets, rpi, plan_rpi, prefix, extend, pool=None, outs=None):
        pool = self.pool if pool is None else pool
        outs = self.outputs() if outs is None else outs
        scatter_req_token_ids(flat_in=flat_in, offsets=offsets, req_pool_indices=rpi, pool_out=pool)
        plan_offsets(
            req_pool_indices=plan_rpi,
            prefix_lens=prefix,
            extend_seq_lens=extend,
            req_to_token=pool,
            full_to_swa_index_mapping=self.lut,
            swa_window_size=5,
            verify_capacity=4 * BS,
            **outs,
        )


@gpu
@pytest.mark.parametrize("held", [False, True], ids=["outputs as arguments", "module buffers"])
def test_reduce_overhead_step_loop(held):
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    lut = random_lut(3 * WIDTH, torch.Generator().manual_seed(7), "cpu").to(DEVICE)
    module = _Step(held, lut)
    compiled = torch.compile(module, mode="reduce-overhead", fullgraph=True)
    for k in range(max(engine_steps(2) // 10, 3)):  # recorded, then replayed
        step = engine_step(
            k, bs=BS, mean_run=0, pool=module.pool, lut=lut, swa_window_size=5, total=TOTAL
        )
        s, p = step.scatter, step.plan
        outs = module.outputs()
        poison_(module.pool, *outs.values())
        args = (s.flat_in, s.offsets, s.req_pool_indices, p.req_pool_indices)
        extra = {} if held else {"pool": module.pool, "outs": outs}
        compiled(*args, p.prefix_lens, p.extend_seq_lens, **extra)
        what = (
            f"reduce-overhead step {k} (inductor: {dict(torch._dynamo.utils.counters['inductor'])})"
        )
        expect_scatter(s, module.pool, what)
        expect_plan(PlanCase(**{**vars(p), "verify_capacity": 4 * BS}), outs, what)
    if held:  # the buffers' step was captured (torch 2.11: recorded, no skip), not run eagerly
        assert not torch._dynamo.utils.counters["inductor"]["cudagraph_skips"], what
