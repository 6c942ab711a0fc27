"""The buffers a ``ForwardStepGuard`` allocates (when built, and at a grow over the request
capacity) are zero-filled on a stream of their own before the call returns: ready for a step
planned at once on any stream, or a graph captured later; the host waits for that fill's
stream alone; another thread's graph capture stays whole; building during capture is refused.
GPU-only: the CPU has no streams."""

from __future__ import annotations

import pytest
import torch
from _capture import beside_a_capture
from conftest import DEVICE, gpu
from test_engine_safety import EMPTY_GRAPH
from test_guard_streams import SLEEP_CYCLES, _held_back, make_step

from kvcanary_dispatch import placement
from kvcanary_dispatch.capacities import CanaryCapacities
from kvcanary_dispatch.forward_step import ForwardStepGuard


@gpu
@pytest.mark.parametrize("then", ["eager", "graph"])
@pytest.mark.parametrize("made", ["built", "grown"])
def test_guard_buffers_are_filled_before_the_call_returns(made, then):
    """A guard built, or grown by a step it never iterates, on a stream held back behind a
    sleep returns before that stream's work has run, with its buffers zero-filled already
    (on the guard's own stream, whose cached memory the reference guard built here first):
    the next step, planned at once on another stream that waits for nothing (eagerly, or
    captured there and replayed before the sleep ends), equals the same history on one
    stream, every buffer byte for byte (the zeros past the batch too). A fill queued on the
    held-back stream would land on that plan."""
    small, big = make_step([(1, 2, False)] * 3), make_step([(3, 40, False)] * 9, seed=1)
    kw = dict(**{k: v.to(DEVICE) for k, v in small.lengths().items()}, num_tokens=6)
    kw["req_to_token"] = small.req_to_token
    caps = CanaryCapacities(4, 10, 60)

    def make(guard=None):  # the guard and its history up to the small step
        if guard is None:
            return ForwardStepGuard(caps, "grow", device=DEVICE)
        guard.plan_step(**big.lengths(), req_to_token=big.req_to_token)  # grows, not iterated
        return guard

    want = make() if made == "built" else make(make())
    if then == "graph":  # the kernels compiled and run under capture once, outside the test
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            list(want.plan_step(**kw))
    ((_, ref),) = want.plan_step(**kw)
    torch.cuda.synchronize()
    guard = None if made == "built" else make()
    # Out of any pool: the guard's allocations come from memory cached for its stream (one
    # new from the device may wait for the whole device); a fill queued on the held-back
    # stream would take memory cached for that one.
    with _held_back(None, 2**17) as held:
        guard = make(guard)
    assert not held.query()  # the call did not wait for the sleep
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        if then == "eager":
            ((_, buf),) = guard.plan_step(**kw)
        else:
            graph = torch.cuda.CUDAGraph()
            graph.capture_begin()
            try:
                ((_, buf),) = guard.plan_step(**kw)
            finally:
                graph.capture_end()
            graph.replay()
    assert not held.query()
    torch.cuda.synchronize()
    assert guard.grow_count == want.grow_count == (made == "grown")
    for name, t in buf.tensors().items():
        assert torch.equal(t, ref.tensors()[name]), (name, t, ref.tensors()[name])


@gpu
def test_guard_build_and_grow_wait_for_their_fill(monkeypatch):
    """The guard's fill stream held back by a sleep: building the guard, and a grow over the
    request capacity, return only once that stream's work (the sleep, then the fill) has run,
    while a stream asleep four times as long beside it is still asleep: the host waits for
    the fill's stream alone. A grow over the token capacity alone fills nothing and waits for
    nothing."""
    fill, other = torch.cuda.Stream(), torch.cuda.Stream()
    monkeypatch.setitem(placement._FILL_STREAMS, torch.cuda.current_device(), fill)
    # Kept: the fill stream's first memory and the fill's kernel (a first launch may load it,
    # which can wait for the whole device) are had before any stream sleeps.
    warm = ForwardStepGuard(CanaryCapacities(8, 10, 60), "grow", device=DEVICE)
    torch.cuda.synchronize()

    def asleep() -> None:
        for stream, cycles in ((fill, SLEEP_CYCLES), (other, 4 * SLEEP_CYCLES)):
            with torch.cuda.stream(stream):
                torch.cuda._sleep(cycles)

    asleep()
    guard = ForwardStepGuard(CanaryCapacities(4, 10, 60), "grow", device=DEVICE)
    assert fill.query() and not other.query()
    # Lengths on the GPU, copied before anything sleeps (a first copy from pageable memory
    # may wait for the whole device).
    steps = [make_step(reqs) for reqs in ([(1, 30, False)] * 2, [(1, 2, False)] * 5)]
    kws = [{k: v.to(DEVICE) for k, v in step.lengths().items()} for step in steps]
    torch.cuda.synchronize()
    for step, kw, waits in zip(steps, kws, (False, True), strict=True):
        other.synchronize()
        asleep()
        guard.plan_step(**kw, req_to_token=step.req_to_token, num_tokens=sum(step.tokens))
        assert fill.query() == waits and not other.query(), step.tokens
    assert guard.grow_count == 2 and warm.grow_count == 0
    torch.cuda.synchronize()


@gpu
@pytest.mark.parametrize("on_fill_stream", [False, True], ids=["own stream", "fill stream"])
def test_guard_build_and_grow_leave_another_threads_capture_whole(monkeypatch, on_fill_stream):
    """Another thread captures a graph in torch's default (global) mode across this thread's
    build of a guard and its grow: neither call fails (the fill's allocation and host wait
    run in relaxed capture mode), the buffers are zero-filled, and the other thread's graph
    is captured whole and replays right. Captured on the stream the guard fills on (pooled
    streams are shared), the guard fills on another one instead, with memory new to it."""
    # Kept: the fill stream's memory segment stays (torch.cuda.graph empties the cache), so
    # that with the capture on its own stream the calls below need no new device memory.
    warm = ForwardStepGuard(CanaryCapacities(4, 10, 60), "grow", device=DEVICE)
    index = torch.cuda.current_device()
    stream = torch.cuda.Stream()
    if on_fill_stream:
        monkeypatch.setitem(placement._FILL_STREAMS, index, stream)
    fill = placement._FILL_STREAMS[index]
    step = make_step([(1, 2, False)] * 5)
    kw = {k: v.to(DEVICE) for k, v in step.lengths().items()}
    guards = []

    def build_and_grow() -> None:
        guard = ForwardStepGuard(CanaryCapacities(4, 10, 60), "grow", device=DEVICE)
        guard.plan_step(**kw, req_to_token=step.req_to_token, num_tokens=10)  # grows
        guards.append(guard)

    beside_a_capture(build_and_grow, "global", stream)
    (guard,) = guards
    assert guard.grow_count == 1
    assert (placement._FILL_STREAMS[index] == fill) != on_fill_stream
    assert all(not t.any() for t in guard.buffers.tensors().values())
    assert warm.grow_count == 0


@gpu
def test_guard_built_during_capture_is_refused():
    """Building a guard while the stream captures would allocate its buffers from the graph's
    memory and record their fill into it: a ``RuntimeError`` naming the fix, before anything
    is allocated (torch warns that the graph is empty)."""
    graph = torch.cuda.CUDAGraph()
    with pytest.warns(UserWarning, match=EMPTY_GRAPH), pytest.raises(RuntimeError) as err:
        with torch.cuda.graph(graph):
            ForwardStepGuard(CanaryCapacities(4, 10, 60), "grow", device=DEVICE)
    assert str(err.value) == (
        f"kv-canary: ForwardStepGuard(device={torch.device(DEVICE)}) allocates and zero-fills "
        "its buffers, which cannot be done while the stream is capturing a CUDA graph (they "
        "would be the graph's memory, filled only on replay); do it before capturing"
    )
