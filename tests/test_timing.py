"""The timer and CUDA-graph capture: which calls the harness captures (never one it knows the
capture refuses or cannot hold), and, for one that fails inside all the same, that the device
is left as it was found (current stream, random ops), so the calls timed after it run as they
would alone, and the allocator is left with no capture underway."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from conftest import DEVICE, gpu

from kvcanary_dispatch import plan_offsets, scatter_req_token_ids
from kvcanary_dispatch.cli import harness, timing
from kvcanary_dispatch.cli.calls import refused_under_capture
from kvcanary_dispatch.cli.command import main
from kvcanary_dispatch.cli.results import Meta
from kvcanary_dispatch.cli.timing import graph_time_us
from kvcanary_dispatch.testing.cases import (
    check_plan,
    check_scatter,
    make_plan_case,
    make_scatter_case,
)


def _scatter_inputs(offsets_on: str, bs: int) -> dict:
    """A scatter's offsets and pool, placed as ``offsets_on`` says ("meta" stands in for a GPU:
    neither is on the CPU)."""
    offsets_device = "cpu" if offsets_on in ("host", "cpu") else "meta"
    pool_device = "cpu" if offsets_on == "cpu" else "meta"
    return {
        "offsets": torch.zeros(bs + 1, dtype=torch.int64, device=offsets_device),
        "pool_out": torch.empty(4, 1024, dtype=torch.int32, device=pool_device),
    }


@pytest.mark.parametrize(
    "function, strategy, bs, tokens, chunk, offsets_on, refused",
    [
        ("scatter", "torch_ref", 8, 80, None, "device", True),  # sizes read back
        ("plan", "torch_ref", 8, 8, None, None, True),
        ("scatter", "loop", 8, 80, 4, "device", True),  # slice offsets read back
        ("scatter", "loop", 8, 0, 4, "device", False),  # nothing to copy: nothing read back
        ("scatter", "loop", 8, 80, 4, "cpu", False),  # read on the CPU: no sync
        ("scatter", "auto", 600, 6000, None, "device", False),
        ("scatter", "auto", 600, 6000, None, "host", True),  # CPU offsets to upload
        ("scatter", "sliced", 600, 6000, 64, "device", False),
        ("scatter", "per_request_grid", 8, 80, None, "device", False),
        ("plan", "loop", 5000, 5000, 1000, None, False),
        ("plan", "auto", 2**20, 2**20, None, None, False),  # scan under capture
        ("plan", "fixed_block", 8, 8, None, None, False),
    ],
)
def test_refused_under_capture_reads_the_launch_plan(function, strategy, bs, tokens, chunk,
                                                     offsets_on, refused):  # fmt: skip
    inputs = _scatter_inputs(offsets_on, bs) if function == "scatter" else {}
    assert refused_under_capture(function, strategy, chunk, bs, tokens, inputs) is refused


def test_the_sweep_captures_only_what_capture_can_hold(tmp_path, monkeypatch):
    """Every measured call goes to the timer with ``graph`` set from the launch plan: the
    references and, on a GPU, a scatter ``loop`` with tokens to copy are not captured, the
    rest are."""
    seen: dict[tuple[str, str], bool] = {}
    current: list[tuple[str, str]] = []
    real_check, real_time = harness._check_and_time, harness.time_call

    def check(device, case, row, *args):
        current.append((case.function, row.strategy))
        return real_check(device, case, row, *args)

    def time_call(fn, device, **kw):
        seen[current[-1]] = kw["graph"]
        return real_time(fn, device, **kw)

    monkeypatch.setattr(harness, "_check_and_time", check)
    monkeypatch.setattr(harness, "time_call", time_call)
    argv = ["sweep", "--device", DEVICE, "--out", str(tmp_path / "s"), "--op", "both", "--bs",
            "8", "--mixes", "ones", "--width", "16", "--chunk-sizes", "4", "--strategies",
            "loop", "auto", "per_request_grid", "torch_ref", "--quiet"]  # fmt: skip
    assert main(argv) == 0
    assert seen == {
        ("scatter", "loop"): DEVICE == "cpu",  # on the CPU its offsets are read without a sync
        ("scatter", "auto"): True,
        ("scatter", "per_request_grid"): True,
        ("scatter", "torch_ref"): False,
        ("plan", "loop"): True,
        ("plan", "auto"): True,
        ("plan", "torch_ref"): False,
    }


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs")
def test_a_call_that_cannot_be_captured_leaves_the_device_as_it_was():
    device = torch.device(DEVICE)
    x = torch.ones(1, device=device)
    stream = torch.cuda.current_stream(device)
    assert graph_time_us(lambda: x.item(), device) is None  # a host sync inside the capture
    assert torch.cuda.current_stream(device) == stream
    torch.cuda.manual_seed(1)
    first = torch.rand(4, device=device)  # needs the generator out of capture
    torch.cuda.manual_seed(1)
    assert torch.equal(torch.rand(4, device=device), first)
    assert graph_time_us(lambda: x.add_(1), device) is not None
    torch.cuda.synchronize(device)
    assert int(x.item()) > 3  # the graph replayed (the two warm-up calls bring x to 3)


# A child process: with a capture left underway, torch's allocator aborts the process (an
# internal assert) at the next empty_cache or memory-pool release.
_FAILED_CAPTURE_THEN_RELEASE = """
import torch
from kvcanary_dispatch.cli.timing import graph_time_us
device = torch.device("cuda")
x = torch.ones(1, device=device)
torch.cuda.empty_cache()
before = torch.cuda.memory_reserved(device)
assert graph_time_us(lambda: x.item(), device) is None
torch.cuda.empty_cache()
pool = torch.cuda.MemPool()
with torch.cuda.use_mem_pool(pool):
    torch.zeros(4096, device=device)
del pool
torch.cuda.empty_cache()
print(before, torch.cuda.memory_reserved(device))
"""


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs")
def test_a_call_that_cannot_be_captured_leaves_the_allocator_as_it_was():
    """The host sync invalidates the capture, and torch's capture end then leaves the
    allocator allocating to the capture's private pool; the harness ends that and releases
    the pool: ``empty_cache`` and a memory pool's release after it run, and the memory
    reserved afterwards is what it was before (the failed capture's pool not kept)."""
    done = subprocess.run(
        [sys.executable, "-c", _FAILED_CAPTURE_THEN_RELEASE],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    before, after = map(int, done.stdout.split())
    assert after == before


class _FakeGraph:
    """A capture stand-in on the CPU: its replay runs the captured call with ``REPLAYING``."""

    def __init__(self, fn) -> None:
        self.fn = fn

    def replay(self) -> None:
        REPLAYING[0] = True
        try:
            self.fn()
        finally:
            REPLAYING[0] = False


REPLAYING = [False]


def _fake_capture(fn, device):
    fn(), fn()  # the warm-up calls, eager
    return _FakeGraph(fn)


def _lazy(call):
    """``call``, but its replay writes nothing."""
    return lambda **kw: None if REPLAYING[0] else call(**kw)


def _off_by_one(call, name):
    """``call``, but its replay then adds 1 to the first element of ``name``."""

    def wrong(**kw):
        call(**kw)
        if REPLAYING[0]:
            kw[name].view(-1)[0] += 1

    return wrong


@pytest.mark.parametrize("flaw", [None, "writes nothing", "writes a wrong value"])
@pytest.mark.parametrize("op", ["scatter", "plan"])
def test_replayed_checks_what_the_replay_alone_writes(op, flaw, monkeypatch):
    """``timing.replayed``: the check reads what the graph's replay wrote, the outputs poisoned
    again after the warm-up calls (the capture faked, on any device: its replay runs the call
    once more, flagged), so a replay that writes nothing, or a wrong value, is caught while its
    eager warm-ups were right."""
    monkeypatch.setattr(timing, "_captured", _fake_capture)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    if op == "scatter":
        case, call, check, out = make_scatter_case([3, 0, 7], width=8, device=DEVICE), \
            scatter_req_token_ids, check_scatter, "pool_out"  # fmt: skip
    else:
        case = make_plan_case(prefix_lens=[2, 0, 5], extend_seq_lens=[1, 3, 0], max_seq_len=8,
                              device=DEVICE)  # fmt: skip
        call, check, out = plan_offsets, check_plan, "out_write_offsets"
    impl = {None: call, "writes nothing": _lazy(call)}.get(flaw) or _off_by_one(call, out)
    device = torch.device(DEVICE)
    if flaw is None:
        check(timing.replayed(impl, device), case)
    else:
        with pytest.raises(AssertionError):
            check(timing.replayed(impl, device), case)
    check(impl, case)  # eagerly every flawed call is right


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs")
def test_the_harness_checks_a_call_as_captured_before_timing_its_graph():
    """A call right eagerly but wrong under capture is a ``CheckError`` before it is timed."""
    device = torch.device(DEVICE)
    case = make_scatter_case([3, 0, 7], width=8, device=DEVICE)

    def wrong_when_captured(**kw):
        scatter_req_token_ids(**kw)
        if torch.cuda.is_current_stream_capturing():
            kw["pool_out"].view(-1)[0].add_(1)

    inputs = {**case.inputs(), "pool_out": case.fresh_pool()}
    work = harness.Case("scatter", "three", 3, 10, None, inputs,
                        lambda impl, **kw: check_scatter(impl, case, **kw))  # fmt: skip
    meta = Meta.collect(device)
    with pytest.raises(harness.CheckError, match="reference: as a CUDA graph's replay: "):
        harness.time_case(meta, device, work, [("wrong_when_captured", None, wrong_when_captured)])


class _Clock:
    """A stand-in for ``time.perf_counter``: each call of ``call`` advances it by the next of
    ``durations`` seconds."""

    def __init__(self, durations) -> None:
        self.now, self.durations = 0.0, iter(durations)

    def perf_counter(self) -> float:
        return self.now

    def call(self) -> None:
        self.now += next(self.durations)


def test_cpu_kernel_time_is_the_median_call_in_microseconds(monkeypatch):
    """On the CPU: one warm-up call, then the median of three timed calls (1, 5 and 2 ms:
    2 000 us)."""
    clock = _Clock([0.5, 0.001, 0.005, 0.002])
    monkeypatch.setattr(timing, "time", clock)
    assert timing.kernel_time_us(clock.call, torch.device("cpu")) == pytest.approx(2000.0)


def test_host_time_is_the_median_per_call_in_microseconds(monkeypatch):
    """A first call of 20 ms sets loops of 3 calls (the least); loops of 1, 4 and 2 ms a call
    give the median, 2 000 us a call."""
    clock = _Clock([0.02] + [0.001] * 3 + [0.004] * 3 + [0.002] * 3)
    monkeypatch.setattr(timing, "time", clock)
    us = timing.host_overhead_us(clock.call, torch.device("cpu"), n=100, rounds=3)
    assert us == pytest.approx(2000.0)


@gpu
def test_copy_bandwidth_counts_the_bytes_read_and_written(monkeypatch):
    """The copy bandwidth is the bytes read plus the bytes written over the median copy time:
    a 2 MiB budget copies 1 MiB, so 1 ms reads as 2 * 2**20 bytes a millisecond."""
    copies = []

    def bench(fn, **kwargs):
        fn()
        copies.append(kwargs.get("return_mode"))
        return 1.0

    monkeypatch.setattr(timing.triton.testing, "do_bench", bench)
    gbs = timing.copy_bandwidth_gbs(torch.device(DEVICE), nbytes=2 << 20)
    assert copies == ["median"]
    assert gbs == pytest.approx(2 * 2**20 / 1e-3 / 1e9)
    assert timing.copy_bandwidth_gbs(torch.device("cpu")) is None
