"""Plan data that breaks the preconditions (``validate=False``, ``BROKEN_PLAN_DATA``): a pool
row outside ``req_to_token`` (its last row plus one, far past it, negative, int64's minimum)
or a prefix past its width, through every plan strategy (one slice, and slices of 2
requests) and the fixed-block launcher, with and without a LUT and a window. Such a request
reads no seed: its seed is -1, as the reference gives, and every other byte equals the
reference's; on the CPU the interpreter's bounds checks fail any read outside the launch's
tensors (a seed read at a row or column outside the table was one, before the kernels
bounded it). The same refilled in place under a replayed CUDA graph and through a compiled
step, the ways an engine calls the plan."""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICE, capture_graph, gpu
from test_engine_safety_compile import BACKEND
from torch._dynamo.testing import CompileCounterWithBackend

from kvcanary_dispatch import plan_offsets
from kvcanary_dispatch.testing.cases import assert_bytes_equal
from kvcanary_dispatch.testing.engine_steps import poison_
from kvcanary_dispatch.testing.plan_inputs import (
    BROKEN_PLAN_DATA,
    broken_plan_case,
    check_broken_plan,
)
from kvcanary_kernels import plan_offsets_ref


@pytest.mark.parametrize("window", [0, 3])
@pytest.mark.parametrize("lut", [False, True])
@pytest.mark.parametrize("name", list(BROKEN_PLAN_DATA))
def test_a_seed_outside_the_table_is_not_read(name, lut, window):
    case, r = broken_plan_case(name, lut=lut, window=window, device=DEVICE)
    check_broken_plan(case, r, chunks=(None, 2))


def _broken_cases() -> dict:
    """Every ``BROKEN_PLAN_DATA`` case (a LUT, a window of 3): same shapes, so that one case's
    tensors can be refilled with another's."""
    return {n: broken_plan_case(n, lut=True, window=3, device=DEVICE) for n in BROKEN_PLAN_DATA}


def _refill_and_check(cases: dict, outs: dict, run) -> None:
    """For each of ``cases`` (``_broken_cases()``): the first case's inputs, which ``run()``
    reads, refilled with its data in place, ``outs`` poisoned, ``run()``, then ``outs``
    equal to the reference byte for byte and the broken request's seed -1."""
    case, _ = next(iter(cases.values()))
    for name, (new, r) in cases.items():
        case.refill_from(new)
        poison_(*outs.values())
        run()
        if case.device.type == "cuda":
            torch.cuda.synchronize(case.device)
        want = case.fresh_outputs()
        plan_offsets_ref(**case.inputs(), **want)
        for out, t in want.items():
            assert_bytes_equal(outs[out], t, f"{out} on {name}")
        assert int(outs["out_write_seed_slot_indices"][r]) == -1, name


@gpu
@pytest.mark.parametrize("strategy", ["auto", "scan", "lookback", "recount", "loop"])
def test_broken_plan_data_refilled_under_a_captured_graph(strategy):
    """Captured once (on the first broken case), replayed on each refilled in place: the
    kernels bound the seed read by the table's shape, fixed at capture, whatever the data."""
    cases = _broken_cases()
    case, _ = next(iter(cases.values()))
    outs = case.fresh_outputs()
    call = lambda: plan_offsets(**case.inputs(), **outs, strategy=strategy, chunk_size=2)  # noqa: E731
    _refill_and_check(cases, outs, capture_graph(call).replay)


@pytest.mark.parametrize("strategy", ["auto", "lookback"])
def test_broken_plan_data_through_a_compiled_step(strategy):
    """One compiled plan step (``fullgraph``; ``aot_eager`` on the CPU, inductor on a GPU),
    called on each broken case refilled in place, compiled once."""
    torch._dynamo.reset()
    cases = _broken_cases()
    case, _ = next(iter(cases.values()))
    outs = case.fresh_outputs()
    counter = CompileCounterWithBackend(BACKEND)
    step = torch.compile(
        lambda **k: plan_offsets(**k, strategy=strategy, chunk_size=2),
        fullgraph=True,
        backend=counter,
    )
    _refill_and_check(cases, outs, lambda: step(**case.inputs(), **outs))
    assert counter.frame_count == 1, counter.frame_count
