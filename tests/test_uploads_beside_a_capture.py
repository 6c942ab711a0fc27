"""Host data uploaded while another thread captures a CUDA graph, on a GPU.

An engine may run a step on one thread while another captures a graph. The calls that take host
data for a GPU (a scatter with CPU offsets, a guard step with CPU lengths) allocate pinned
staging and a device copy. In torch's default (global) capture mode CUDA refuses such
allocations from another thread (new device memory, pinned memory new or reused) and the
capture breaks, for these calls as for any torch op that allocates so (``docs/contract.md``);
with ``capture_error_mode="thread_local"`` or
``"relaxed"``, the modes for capturing beside other threads' work, each call here must give the
reference's bytes and the other thread's graph must be captured whole and replay right,
whether the pinned memory is new (the host cache emptied first) or reused.
"""

from __future__ import annotations

import pytest
import torch
from _capture import beside_a_capture, call_beside_a_capture
from _helpers import scatter_with
from conftest import DEVICE, gpu
from test_engine_safety import guard_inputs

from kvcanary_dispatch import CanaryCapacities, ForwardStepGuard
from kvcanary_dispatch.testing.cases import PlanCase, make_scatter_case
from kvcanary_dispatch.testing.engine_steps import expect_plan, expect_scatter, poison_


def _empty_host_cache() -> None:
    """The pinned memory torch caches, given back: the next staging allocates anew."""
    torch.cuda.synchronize()
    empty = getattr(torch._C, "_host_emptyCache", None)
    if empty is None:
        pytest.skip("this torch cannot empty its pinned-memory cache")
    empty()


MODES = ["thread_local", "relaxed"]


@gpu
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("fresh", [True, False], ids=["new pinned memory", "reused"])
def test_scatter_with_host_offsets_beside_a_capture(fresh, mode):
    lens = torch.randint(0, 30, (5_000,), generator=torch.Generator().manual_seed(3))
    case = make_scatter_case(lens, width=32, spare_rows=2, seed=5, device=DEVICE)
    host = case.offsets.cpu()
    scatter_with(case, case.fresh_pool(), offsets=host)  # compiled, pinned memory cached
    if fresh:
        _empty_host_cache()
    pool = case.fresh_pool()
    beside_a_capture(lambda: scatter_with(case, pool, offsets=host), mode)
    torch.cuda.synchronize()
    expect_scatter(case, pool, f"host offsets beside a {mode} capture, {fresh=}")


@gpu
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("fresh", [True, False], ids=["new pinned memory", "reused"])
def test_guard_step_with_host_lengths_beside_a_capture(fresh, mode):
    lengths, n, r2t = guard_inputs(40, "cpu")
    guard = ForwardStepGuard(CanaryCapacities(64, 4096, 10**6), device=DEVICE)
    kw = dict(**lengths, req_to_token=r2t, num_tokens=n)
    for _ in guard.plan_step(**kw):  # compiled, pinned memory cached
        pass
    if fresh:
        _empty_host_cache()
    poison_(*guard.buffers.tensors().values())
    torch.cuda.synchronize()

    def step() -> None:
        for _ in guard.plan_step(**kw):
            pass

    beside_a_capture(step, mode)
    torch.cuda.synchronize()
    want = PlanCase(*(v.to(DEVICE) for v in lengths.values()), r2t, None, 0, 10**6, 64, 65)
    expect_plan(want, guard.buffers.tensors(), f"guard step beside a {mode} capture, {fresh=}")


@gpu
def test_the_capture_check_sees_a_refused_allocation():
    """The check above can fail: beside a global-mode capture, new device memory on this thread
    is refused and the capture broken, and ``beside_a_capture`` raises for it."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    seen = call_beside_a_capture(lambda: torch.empty(1 << 24, device=DEVICE).fill_(1), "global")
    assert "not permitted when stream is capturing" in str(seen.call_error), seen
    assert seen.capture_errors and seen.replay_right is None, seen
    with pytest.raises(Exception, match="not permitted when stream is capturing"):
        beside_a_capture(lambda: torch.empty(1 << 24, device=DEVICE).fill_(1), "global")
    ok = call_beside_a_capture(lambda: torch.cuda.Event().query(), "global")
    assert ok.call_error is None and not ok.capture_errors and ok.replay_right is True, ok
