"""The grow policy of ``ForwardStepGuard`` across CUDA streams and graphs: the buffers a grow
drops outlive the work queued on the stream that dropped them, and a growing step's host
lengths, uploaded by ``plan_step``, are read only after that upload, on whichever stream the
step is iterated, and never recorded into a graph. GPU-only: the CPU has no streams."""

from __future__ import annotations

from functools import partial

import pytest
import torch
from _helpers import random_step
from conftest import DEVICE, gpu
from test_engine_safety import EMPTY_GRAPH

from kvcanary_dispatch.capacities import CanaryCapacities
from kvcanary_dispatch.forward_step import ForwardStepGuard

make_step = partial(random_step, device=DEVICE)
SLEEP_CYCLES = 200_000_000  # ~0.1 s of one GPU thread: the upload queued after it waits that long
POISON = -5


def _marking_record_stream(monkeypatch) -> list[tuple[torch.Tensor, torch.cuda.Stream]]:
    """Every ``record_stream`` call from now on, in order (the calls still run)."""
    marked = []
    record = torch.Tensor.record_stream
    monkeypatch.setattr(
        torch.Tensor, "record_stream", lambda t, s: (marked.append((t, s)), record(t, s))[1]
    )
    return marked


def _poison(buffers) -> None:
    for t in buffers.tensors().values():
        t.fill_(POISON)


@gpu
def test_guard_grow_keeps_dropped_buffers_until_the_streams_work_is_done(monkeypatch):
    """A grow on a side stream drops the buffers the guard allocated on the default stream
    (the offsets and seeds; the scalars are kept): each dropped one is marked as used by that
    side stream (``record_stream``), so the allocator cannot hand its memory out before the
    work queued there has run; no kept one is marked, nor the uploaded lengths of a step
    iterated on the stream that uploaded them."""
    marked = _marking_record_stream(monkeypatch)
    guard = ForwardStepGuard(CanaryCapacities(4, 10, 9), "grow", device=DEVICE)
    first = guard.buffers
    side = torch.cuda.Stream()
    step = make_step([(1, 2, False)] * 5)
    with torch.cuda.stream(side):
        ((_, buf),) = guard.plan_step(**step.lengths(), req_to_token=step.req_to_token)
    side.synchronize()
    dropped = [first.verify_offsets, first.write_offsets, first.write_seed_slot_indices]
    assert [id(t) for t, _ in marked] == [id(t) for t in dropped]
    assert all(s == side for _, s in marked)
    assert buf.verify_num_valid is first.verify_num_valid


@gpu
def test_guard_grow_keeps_dropped_buffers_for_every_stream_it_planned_on(monkeypatch):
    """Steps planned on two side streams, then a grow on a third: each dropped buffer is
    marked as used by all three, once each, so no stream's queued work can find its memory
    reused; the next grow marks only the streams used since."""
    guard = ForwardStepGuard(CanaryCapacities(4, 10, 9), "grow", device=DEVICE)
    first = guard.buffers
    a, b, c = (torch.cuda.Stream() for _ in range(3))
    small = make_step([(1, 2, False)] * 3)
    for stream in (a, b, a):
        with torch.cuda.stream(stream):
            list(guard.plan_step(**small.lengths(), req_to_token=small.req_to_token))
    marked = _marking_record_stream(monkeypatch)
    grow = make_step([(1, 2, False)] * 5)
    with torch.cuda.stream(c):
        list(guard.plan_step(**grow.lengths(), req_to_token=grow.req_to_token))
    dropped = [first.verify_offsets, first.write_offsets, first.write_seed_slot_indices]
    pairs = [(id(t), s.cuda_stream) for t, s in marked]
    assert sorted(pairs) == sorted((id(t), s.cuda_stream) for t in dropped for s in (a, b, c))
    second = guard.buffers
    marked.clear()
    bigger = make_step([(1, 2, False)] * 9)
    list(guard.plan_step(**bigger.lengths(), req_to_token=bigger.req_to_token))
    torch.cuda.synchronize()
    default = torch.cuda.current_stream()
    dropped = [second.verify_offsets, second.write_offsets, second.write_seed_slot_indices]
    pairs = [(id(t), s.cuda_stream) for t, s in marked]
    assert sorted(pairs) == sorted((id(t), s.cuda_stream) for t in dropped for s in (c, default))


@gpu
def test_guard_grow_iterated_on_another_stream_waits_for_the_upload(monkeypatch):
    """``plan_step`` grows and uploads the host lengths on one stream, held back behind a
    sleep; the step is iterated on another. Its plan waits for the upload on the device (the
    memory the upload takes was zeroed first, so a plan that read early would see padding
    only) and equals the same step planned on one stream, every buffer byte for byte; the
    uploaded tensors are marked as used by the iterating stream."""
    step = make_step([(3, 40, False)] * 9 + [(0, 7, True), (2, 1, False)])
    want = ForwardStepGuard(CanaryCapacities(4, 10, 60), "grow", device=DEVICE, on_grow=_poison)
    ((_, ref),) = want.plan_step(**step.lengths(), req_to_token=step.req_to_token)
    torch.cuda.synchronize()

    upload, side = torch.cuda.Stream(), torch.cuda.Stream()
    guard = ForwardStepGuard(CanaryCapacities(4, 10, 60), "grow", device=DEVICE, on_grow=_poison)
    with torch.cuda.stream(upload):
        # The grow's buffers and the upload are the next blocks of this fresh stream's pool:
        # zero them, then hold the stream back.
        torch.zeros(2**17, dtype=torch.int64)
        upload.synchronize()
        torch.cuda._sleep(SLEEP_CYCLES)
        steps = guard.plan_step(**step.lengths(), req_to_token=step.req_to_token)
    marked = _marking_record_stream(monkeypatch)
    with torch.cuda.stream(side):
        ((sub, buf),) = steps
    torch.cuda.synchronize()
    assert guard.grow_count == 1
    for name, t in buf.tensors().items():
        assert torch.equal(t, ref.tensors()[name]), name
    lens = step.extend_seq_lens.clamp(min=0) * (step.req_pool_indices != 0)
    assert buf.write_offsets[1 : len(lens) + 1].tolist() == torch.cumsum(lens, 0).tolist()
    uploaded = [sub.req_pool_indices, sub.prefix_lens, sub.extend_seq_lens]
    assert [id(t) for t, s in marked if s == side] == [id(t) for t in uploaded]


@gpu
def test_guard_grow_iterated_during_capture_is_refused():
    """A growing step planned outside capture and iterated inside one would record a plan that
    reads the upload of capture time on every replay: refused, before anything is recorded
    (torch warns that the graph is empty), the grown buffers unwritten."""
    step = make_step([(1, 2, False)] * 5)
    guard = ForwardStepGuard(CanaryCapacities(4, 10, 9), "grow", device=DEVICE, on_grow=_poison)
    steps = guard.plan_step(**step.lengths(), req_to_token=step.req_to_token)
    graph = torch.cuda.CUDAGraph()
    with pytest.warns(UserWarning, match=EMPTY_GRAPH):
        with pytest.raises(
            ValueError, match=r"^kv-canary: a growing step.* capturing a CUDA graph.*outside"
        ):
            with torch.cuda.graph(graph):
                next(iter(steps))
    torch.cuda.synchronize()
    for name, t in guard.buffers.tensors().items():
        assert (t == POISON).all(), name
