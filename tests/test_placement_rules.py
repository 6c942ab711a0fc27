"""``kvcanary_dispatch.placement``'s rules on any machine: what ``upload_rows`` hands back, and
the CUDA branches of ``on_device``, ``made_apart``, ``_fill_stream`` and
``StreamFence.order_reads`` driven through stand-ins for ``torch.cuda`` (the GPU tests run
them for real: ``tests/test_guard_fill.py``, ``tests/test_guard_streams.py``)."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
import torch
from conftest import DEVICE, GPU

from kvcanary_dispatch import placement
from kvcanary_dispatch.placement import StreamFence, upload_rows

CUDA0, CUDA1 = torch.device("cuda", 0), torch.device("cuda", 1)


def test_upload_rows_gives_int64_rows_that_outlive_the_callers_tensors(monkeypatch):
    """Rows of any integer dtype come back as int64 rows of one tensor on the device, every
    value exact (one past int32 included), read from the caller's tensors during the call
    only: refilling them after it changes nothing."""
    if not GPU:  # a CPU-only torch has no pinned memory: plain host staging stands in
        empty = torch.empty
        monkeypatch.setattr(torch, "empty", lambda *a, pin_memory=False, **k: empty(*a, **k))
    rows = [
        torch.tensor([2**31 + 5, -(2**40), 7], dtype=torch.int64),
        torch.tensor([-1, 2**31 - 1, 0], dtype=torch.int32),
    ]
    want = [row.tolist() for row in rows]
    got = upload_rows(rows, torch.device(DEVICE))
    for row in rows:
        row.fill_(-9)
    assert [(g.dtype, g.device.type) for g in got] == [(torch.int64, DEVICE)] * 2
    assert [g.tolist() for g in got] == want
    assert got[0].untyped_storage().data_ptr() == got[1].untyped_storage().data_ptr()


def test_on_device_switches_only_to_another_indexed_cuda_device(monkeypatch):
    """``on_device`` enters ``torch.cuda.device`` only for a CUDA device with an index other
    than the current one; the current device, an unindexed one (the current) and the CPU
    cost nothing."""
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(torch.cuda, "device", lambda d: ("switch to", d))
    for same in (CUDA1, torch.device("cuda"), torch.device("cpu")):
        assert placement.on_device(same) is placement._SAME_DEVICE, same
    assert placement.on_device(CUDA0) == ("switch to", CUDA0)


def test_made_apart_refuses_a_capturing_stream_before_making_anything(monkeypatch):
    """While the device's current stream captures a graph, ``made_apart`` raises naming what
    it was asked for, and ``make`` never runs (its memory would be the graph's)."""
    monkeypatch.setattr(placement, "on_device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(placement, "capturing", lambda device: True)
    made = []
    with pytest.raises(RuntimeError) as err:
        placement.made_apart(lambda: made.append(1), CUDA0, lambda m: (), "a grow")
    assert str(err.value).startswith(
        "kv-canary: a grow allocates and zero-fills its buffers, which cannot be done while "
        "the stream is capturing a CUDA graph"
    ), str(err.value)
    assert str(err.value).endswith("; do it before capturing") and made == []


class _Stream:
    """A stand-in CUDA stream: its device and priority, whether it captures a graph, and the
    events it was made to wait for."""

    def __init__(self, index: int = 0, priority: int = 0, capturing: bool = False):
        self.index, self.priority, self.capturing, self.waited = index, priority, capturing, []

    def wait_event(self, event: object) -> None:
        self.waited.append(event)


def _fake_streams(monkeypatch) -> tuple[list[_Stream], dict[str, bool]]:
    """``torch.cuda.Stream``, ``torch.cuda.stream`` and ``is_current_stream_capturing`` stood
    in for, and no fill stream kept: the streams made, in order, and a switch that makes every
    new stream a capturing one."""
    made, current, new_ones = [], [None], {"capturing": False}

    def new(index, priority=0):
        made.append(_Stream(index, priority, new_ones["capturing"]))
        return made[-1]

    @contextlib.contextmanager
    def on(stream):
        current[0], before = stream, current[0]
        yield
        current[0] = before

    monkeypatch.setattr(torch.cuda, "Stream", new)
    monkeypatch.setattr(torch.cuda, "stream", on)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: current[0].capturing)
    monkeypatch.setattr(placement, "_FILL_STREAMS", {})
    return made, new_ones


def test_the_fill_stream_is_kept_and_replaced_only_while_it_captures(monkeypatch):
    """A high-priority stream per device, made once and kept; one that is capturing (another
    thread's graph on that pooled stream) is replaced; when every one of the pool's streams
    captures, a ``RuntimeError`` names the device and the fix."""
    made, new_ones = _fake_streams(monkeypatch)
    first = placement._fill_stream(1)
    assert [(s.index, s.priority) for s in made] == [(1, -1)]
    assert placement._fill_stream(1) is first and placement._fill_stream(0) is not first
    first.capturing = True
    second = placement._fill_stream(1)
    assert second is not first and second.index == 1 and placement._fill_stream(1) is second
    second.capturing = new_ones["capturing"] = True
    before = len(made)
    with pytest.raises(RuntimeError) as err:
        placement._fill_stream(1)
    assert len(made) - before == placement._POOL_STREAMS
    assert str(err.value) == (
        "kv-canary: every high-priority pooled stream of cuda:1 is capturing a CUDA graph, so "
        "none can fill a guard's buffers; build or grow the guard outside those captures"
    )


def test_order_reads_waits_on_the_device_only_from_another_stream(monkeypatch):
    """A fence read on its own stream orders nothing; read on another stream, that stream
    waits for the fence's event (on the device) and its tensors are marked as used there."""
    marks = []
    tensor = SimpleNamespace(record_stream=marks.append)
    own, other = _Stream(), _Stream()
    fence = StreamFence((tensor,), own, "done")
    current = [own]
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current[0])
    fence.order_reads(CUDA0)
    assert own.waited == [] and marks == []
    current[0] = other
    fence.order_reads(CUDA0)
    assert other.waited == ["done"] and own.waited == [] and marks == [other]
