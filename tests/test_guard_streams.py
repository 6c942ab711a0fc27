"""The grow and split policies of ``ForwardStepGuard`` across CUDA streams and graphs: the
buffers a grow drops outlive the work queued on every stream the guard used; a growing step,
whose ``on_grow`` work and uploaded lengths ``plan_step`` queued on one stream, and a split
step, whose cut requests' GPU lengths ``plan_step`` copied there, are planned after that work
on whichever stream they are iterated, and never recorded into a graph (the new buffers'
fill: ``tests/test_guard_fill.py``). GPU-only: the CPU has no streams."""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from functools import partial

import pytest
import torch
from _helpers import random_step
from conftest import DEVICE, TWO_GPUS, gpu
from test_engine_safety import EMPTY_GRAPH

from kvcanary_dispatch.capacities import CanaryCapacities
from kvcanary_dispatch.forward_step import ForwardStepGuard

make_step = partial(random_step, device=DEVICE)
SLEEP_CYCLES = 200_000_000  # ~0.1 s of one GPU thread: the upload queued after it waits that long
POISON = -5
# Lengths on the guard's GPU, on the host, or on a second GPU (copied by the grow).
LENGTHS_ON = [
    "cpu",
    "cuda",
    pytest.param("cuda:1", marks=pytest.mark.skipif(not TWO_GPUS, reason="needs two CUDA devices")),
]


def _marking_record_stream(monkeypatch) -> list[tuple[torch.Tensor, torch.cuda.Stream]]:
    """Every ``record_stream`` call from now on, in order (the calls still run)."""
    marked = []
    record = torch.Tensor.record_stream
    monkeypatch.setattr(
        torch.Tensor, "record_stream", lambda t, s: (marked.append((t, s)), record(t, s))[1]
    )
    return marked


def _reallocated(buffers) -> list[torch.Tensor]:
    """The tensors of ``buffers`` a grow over the request capacity replaces (the offsets and
    seeds; the three scalars are kept)."""
    return [buffers.verify_offsets, buffers.write_offsets, buffers.write_seed_slot_indices]


def _refused_in_capture(fn, match: str) -> None:
    """``fn()`` during a capture is a ``ValueError`` matching ``match``, raised before anything
    is recorded (torch warns that the graph is empty)."""
    graph = torch.cuda.CUDAGraph()
    with pytest.warns(UserWarning, match=EMPTY_GRAPH), pytest.raises(ValueError, match=match):
        with torch.cuda.graph(graph):
            fn()


def _poison(buffers) -> None:
    for t in buffers.tensors().values():
        t.fill_(POISON)


@gpu
def test_guard_grow_keeps_dropped_buffers_until_the_streams_work_is_done(monkeypatch):
    """A grow on a side stream drops the buffers the guard built on the default stream (the
    offsets and seeds; the scalars are kept): each dropped one is marked as used by that side
    stream (``record_stream``), so the allocator cannot hand its memory out before the work
    queued there has run. The new ones, filled on a stream of the guard's own, are marked as
    used by the side stream too (as the guard's first buffers were by the default stream); no
    kept one is marked, nor the uploaded lengths of a step iterated on the stream that
    uploaded them."""
    marked = _marking_record_stream(monkeypatch)
    guard = ForwardStepGuard(CanaryCapacities(4, 10, 9), "grow", device=DEVICE)
    first = guard.buffers
    assert [(id(t), s) for t, s in marked] == [
        (id(t), torch.cuda.current_stream()) for t in first.tensors().values()
    ]
    marked.clear()
    side = torch.cuda.Stream()
    step = make_step([(1, 2, False)] * 5)
    with torch.cuda.stream(side):
        ((_, buf),) = guard.plan_step(**step.lengths(), req_to_token=step.req_to_token)
    side.synchronize()
    dropped = _reallocated(first)
    assert [id(t) for t, _ in marked] == [id(t) for t in _reallocated(buf) + dropped]
    assert all(s == side for _, s in marked)
    assert buf.verify_num_valid is first.verify_num_valid


@gpu
def test_guard_grow_keeps_dropped_buffers_for_every_stream_it_planned_on(monkeypatch):
    """Steps planned on two side streams, a grow over the token capacity alone on a third
    (it drops nothing: nothing is marked), then a grow over the request capacity on a fourth:
    each dropped buffer is marked as used by all four, once each, so no stream's queued work
    can find its memory reused, and each new one by the fourth; the next grow marks the new
    buffers' streams only."""
    guard = ForwardStepGuard(CanaryCapacities(4, 10, 9), "grow", device=DEVICE)
    first = guard.buffers
    a, b, c, d = (torch.cuda.Stream() for _ in range(4))
    small = make_step([(1, 2, False)] * 3)
    for stream in (a, b, a):
        with torch.cuda.stream(stream):
            list(guard.plan_step(**small.lengths(), req_to_token=small.req_to_token))
    marked = _marking_record_stream(monkeypatch)
    long = make_step([(1, 20, False)] * 3)
    with torch.cuda.stream(c):
        list(guard.plan_step(**long.lengths(), req_to_token=long.req_to_token))
    assert guard.grow_count == 1 and not marked
    assert all(t is first.tensors()[k] for k, t in guard.buffers.tensors().items())
    wide = make_step([(1, 2, False)] * 5)
    with torch.cuda.stream(d):
        list(guard.plan_step(**wide.lengths(), req_to_token=wide.req_to_token))
    torch.cuda.synchronize()
    dropped = _reallocated(first)
    pairs = [(id(t), s.cuda_stream) for t, s in marked]
    want = [(id(t), s.cuda_stream) for t in dropped for s in (a, b, c, d)]
    assert sorted(pairs) == sorted(
        want + [(id(t), d.cuda_stream) for t in _reallocated(guard.buffers)]
    )
    # What a grow allocates has been used on its own stream only: the next grow marks the
    # streams used since (b here, and its own), not those the dropped buffers had seen.
    second = guard.buffers
    with torch.cuda.stream(b):
        list(guard.plan_step(**small.lengths(), req_to_token=small.req_to_token))
    marked.clear()
    wider = make_step([(1, 2, False)] * 9)
    list(guard.plan_step(**wider.lengths(), req_to_token=wider.req_to_token))
    torch.cuda.synchronize()
    default = torch.cuda.current_stream()
    dropped = _reallocated(second)
    pairs = [(id(t), s.cuda_stream) for t, s in marked]
    want = [(id(t), s.cuda_stream) for t in dropped for s in (b, d, default)]
    new = [(id(t), default.cuda_stream) for t in _reallocated(guard.buffers)]
    assert sorted(pairs) == sorted(want + new)


@contextmanager
def _held_back(pool: torch.cuda.MemPool | None, zeroed: int):
    """Work queued inside runs on a new stream (yielded) held back by a sleep, its allocations
    from ``pool`` (if any) after ``zeroed`` int64 of it were zeroed and freed: what
    ``plan_step`` allocates there takes that zeroed memory, so a plan that read it before the
    queued work ran would see zeros, and work queued there lands after such a plan."""
    held = torch.cuda.Stream()
    in_pool = nullcontext() if pool is None else torch.cuda.use_mem_pool(pool)
    with in_pool, torch.cuda.stream(held):
        torch.zeros(zeroed, dtype=torch.int64, device=DEVICE)  # freed at once, zeroed
        held.synchronize()
        torch.cuda._sleep(SLEEP_CYCLES)
        yield held


def _grown_on_a_held_back_stream(step, lengths: dict, on_grow, pool):
    """A guard that grows for ``step`` on a held-back stream (1 MB of ``pool`` zeroed): the
    uploaded lengths take that memory, and ``on_grow``'s work lands after a plan that read the
    buffers early. Returns the guard, the iterator (not yet advanced) and the held-back stream."""
    guard = ForwardStepGuard(CanaryCapacities(4, 10, 60), "grow", device=DEVICE, on_grow=on_grow)
    with _held_back(pool, 2**17) as held:
        # num_tokens given: GPU lengths are not read back, which would wait for the sleep.
        steps = guard.plan_step(
            **lengths, req_to_token=step.req_to_token, num_tokens=sum(step.tokens)
        )
    return guard, steps, held


@gpu
@pytest.mark.parametrize("on_grow", [None, _poison], ids=["no on_grow", "on_grow poisons"])
@pytest.mark.parametrize("lengths_on", LENGTHS_ON)
def test_guard_grow_iterated_on_another_stream_waits_for_the_grow(monkeypatch, lengths_on, on_grow):
    """``plan_step`` grows on a stream held back behind a sleep (``on_grow``'s work and, for
    lengths on the host or a second GPU, their copy to the guard's GPU queue there); the step
    is iterated on another stream. Its plan waits for all of it on the device and equals the
    same step planned on one stream, every buffer byte for byte; the copied lengths (none for
    lengths on the guard's GPU) are marked as used by the iterating stream."""
    step = make_step([(3, 40, False)] * 9 + [(0, 7, True), (2, 1, False)])
    lengths = {k: v.to(lengths_on) for k, v in step.lengths().items()}
    want = ForwardStepGuard(CanaryCapacities(4, 10, 60), "grow", device=DEVICE, on_grow=_poison)
    ((_, ref),) = want.plan_step(**lengths, req_to_token=step.req_to_token)
    torch.cuda.synchronize()
    pool = torch.cuda.MemPool()
    guard, steps, held = _grown_on_a_held_back_stream(step, lengths, on_grow, pool)
    marked = _marking_record_stream(monkeypatch)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        ((sub, buf),) = steps
    assert not held.query(), "the host waited for the grow's stream"  # the device waits
    torch.cuda.synchronize()
    assert guard.grow_count == 1
    for name, t in buf.tensors().items():
        assert torch.equal(t, ref.tensors()[name]), name
    lens = step.extend_seq_lens.clamp(min=0) * (step.req_pool_indices != 0)
    assert buf.write_offsets[1 : len(lens) + 1].tolist() == torch.cumsum(lens, 0).tolist()
    uploaded = [sub.req_pool_indices, sub.prefix_lens, sub.extend_seq_lens]
    want_marked = [] if lengths_on == "cuda" else [id(t) for t in uploaded]
    assert [id(t) for t, s in marked if s == side] == want_marked
    assert len(marked) == len(want_marked)


@gpu
@pytest.mark.parametrize("lengths_on", LENGTHS_ON)
def test_guard_grow_iterated_during_capture_is_refused(lengths_on):
    """A step that grew the buffers at ``plan_step`` (outside capture) and is iterated inside
    one would record a plan not ordered after the grow's work (and, for CPU lengths, reading
    the upload of capture time on every replay): refused before anything is recorded (torch
    warns that the graph is empty), with the values and the fix; the fix works."""
    step = make_step([(1, 2, False)] * 5)
    lengths = {k: v.to(lengths_on) for k, v in step.lengths().items()}
    guard = ForwardStepGuard(CanaryCapacities(4, 10, 9), "grow", device=DEVICE)
    steps = guard.plan_step(**lengths, req_to_token=step.req_to_token)
    _refused_in_capture(
        lambda: next(iter(steps)),
        r"^kv-canary: ForwardStepGuard: the step that grew the plan buffers at plan_step "
        r"\(batch_size=5, token count=10\) .* capturing a CUDA graph.* call plan_step again for "
        r"this step, which now fits \(write_req_capacity=8, write_entry_capacity=10\)",
    )
    assert guard.grow_count == 1
    # As the message says: planned again, the step fits and is planned.
    ((_, buf),) = guard.plan_step(**lengths, req_to_token=step.req_to_token)
    assert guard.grow_count == 1
    assert buf.write_offsets[:6].tolist() == [0, 2, 4, 6, 8, 10]


# Request 0's 40 tokens are cut into pieces of the 10-token budget: their lengths are copies.
SPLIT_STEP = [(3, 40, False), (2, 1, False), (0, 7, True), (5, 3, False)]


def _split_pieces(steps) -> list[dict]:
    """Each piece's outputs, cloned as it is planned (the next piece overwrites them)."""
    return [{k: v.clone() for k, v in buf.tensors().items()} for _, buf in steps]


@gpu
def test_guard_split_iterated_on_another_stream_waits_for_the_cut_copies(monkeypatch):
    """``plan_step`` splits a step whose ``prefix_lens`` are on the GPU (``extend_seq_lens`` on
    the host, as an engine keeps them: no read-back) on a stream held back behind a sleep, in
    memory zeroed just before: the copies of the cut request's prefixes queue there. Its
    pieces iterated on two other streams in turn (each ordered after the other's last piece,
    as the shared buffers require), every piece waits for them on the device and equals the
    same split planned on one stream, byte for byte; the copies are marked as used by both
    streams."""
    step = make_step(SPLIT_STEP)
    lengths = {k: v.to(DEVICE) for k, v in step.lengths().items()}
    lengths["extend_seq_lens"] = step.extend_seq_lens.cpu()
    kw = dict(**lengths, req_to_token=step.req_to_token, num_tokens=sum(step.tokens))
    caps = CanaryCapacities(4, 10, 60)
    want = ForwardStepGuard(caps, "split", device=DEVICE)
    ref = _split_pieces(want.plan_step(**kw))
    torch.cuda.synchronize()
    guard = ForwardStepGuard(caps, "split", device=DEVICE)
    pool = torch.cuda.MemPool()
    with _held_back(pool, 2**16) as held:  # 512 KB, a small-block segment's start: the copies
        steps = guard.plan_step(**kw)  # take it
    marked = _marking_record_stream(monkeypatch)
    sides = (torch.cuda.Stream(), torch.cuda.Stream())  # the pieces alternate between them
    pieces, got = iter(steps), []
    for i in range(len(ref)):
        with torch.cuda.stream(sides[i % 2]):
            # The engine's own order: a piece overwrites the buffers the last one's kernels
            # (here the clone) read, on the other stream.
            sides[i % 2].wait_stream(sides[(i + 1) % 2])
            got += _split_pieces([next(pieces)])
    assert next(pieces, None) is None
    assert not held.query(), "the host waited for the copies' stream"  # the device waits
    torch.cuda.synchronize()
    assert len(got) == len(ref) == 6, len(got)
    for i, (g, r) in enumerate(zip(got, ref, strict=True)):
        for name in r:
            assert torch.equal(g[name], r[name]), (i, name, g[name], r[name])
    # Each piece orders itself (the first piece's wait covers the rest only through the
    # engine's own order): the cut request's four prefix copies are marked as used by both
    # streams, so their memory outlives both streams' reads; the host lengths are uploaded
    # on the iterating stream itself.
    for side in sides:
        assert len({id(t) for t, s in marked if s == side}) == 4, (side, marked)
    assert all(s in sides for _, s in marked), marked


@gpu
def test_guard_split_iterated_during_capture_is_refused():
    """A split whose cut request's GPU lengths ``plan_step`` copied outside capture, iterated
    inside one, would record plans not ordered after the copies (which are freed after the
    iteration): refused before anything is recorded, naming the fix; the fix works. A split
    during capture is refused by ``plan_step`` itself, before any copy."""
    step = make_step(SPLIT_STEP)
    lengths = {k: v.to(DEVICE) for k, v in step.lengths().items()}
    kw = dict(**lengths, req_to_token=step.req_to_token, num_tokens=sum(step.tokens))
    guard = ForwardStepGuard(CanaryCapacities(4, 10, 60), "split", device=DEVICE)
    steps = guard.plan_step(**kw)
    _refused_in_capture(
        lambda: next(iter(steps)),
        r"^kv-canary: ForwardStepGuard: a piece of the step split at plan_step \(batch_size=4, "
        r"token count=51\) is iterated while the stream is capturing a CUDA graph: .*; iterate "
        r"the step before capturing",
    )
    host_extend = {**kw, "extend_seq_lens": lengths["extend_seq_lens"].cpu()}
    _refused_in_capture(
        lambda: guard.plan_step(**host_extend), r"splitting an oversized step \(batch_size=4, "
    )
    assert len(_split_pieces(guard.plan_step(**kw))) == 6
