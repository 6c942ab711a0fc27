"""The timer and CUDA-graph capture: which calls the harness captures (never one it knows the
capture refuses or cannot hold), and, for one that fails inside all the same, that the device
is left as it was found (current stream, random ops), so the calls timed after it run as they
would alone, and the allocator is left with no capture underway."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from conftest import DEVICE

from kvcanary_dispatch.cli import harness
from kvcanary_dispatch.cli.calls import refused_under_capture
from kvcanary_dispatch.cli.command import main
from kvcanary_dispatch.cli.timing import graph_time_us


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
