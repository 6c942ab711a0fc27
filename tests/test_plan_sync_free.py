"""The eager plan waits for nothing on the GPU (a GPU test): behind ~1 s of queued GPU work every
plan strategy returns at once, with no synchronising copy (torch's sync debug mode) and no
``synchronize`` of the device, a stream or an event (``ForwardStepGuard``'s plan, at 150 and
6 000 requests: ``test_engine_safety.py``'s item 4). The look-back's resident state (its
flags and carries, kept per stream between eager calls) is in use on the timed call: the call
before it, which compiled the kernels, made it. Each result equals the reference on poisoned
outputs."""

from __future__ import annotations

import pytest
from _helpers import QUEUED_HOST_S, seconds_behind_queued_work
from conftest import gpu
from test_engine_safety import plan_case

from kvcanary_dispatch import plan_offsets
from kvcanary_dispatch.testing.engine_steps import expect_plan


@gpu
@pytest.mark.parametrize(
    "strategy,bs,chunk",
    [("auto", 20_000, None), ("lookback", 20_000, None), ("lookback", 3000, 512),
     ("scan", 3000, 512), ("recount", 3000, 512), ("loop", 3000, 512)],
)  # fmt: skip
def test_eager_plan_does_not_wait_for_the_gpu(strategy, bs, chunk):
    case = plan_case(bs)

    def call(outs: dict) -> None:
        plan_offsets(**case.inputs(), **outs, strategy=strategy, chunk_size=chunk)

    call(case.fresh_outputs())  # compiles; the look-back's resident state made
    outs = case.fresh_outputs()
    host_s, total_s = seconds_behind_queued_work(lambda: call(outs))
    assert host_s < QUEUED_HOST_S < total_s, (host_s, total_s)
    expect_plan(case, outs, f"{strategy}, bs {bs}")
