"""Timing primitives shared by the benchmark suite and ``kvcanary-dispatch sweep``.

- kernel time: ``triton.testing.do_bench`` median on CUDA (events, L2 flushed between runs);
  wall-clock median on the CPU (interpreter timings say nothing about a GPU).
- graph time: one call captured in a CUDA graph, replays timed with ``do_bench``.
- host overhead: wall clock over ``n`` back-to-back calls followed by one synchronisation.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

import torch
import triton


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def kernel_time_us(fn: Callable[[], None], device: torch.device, rep_ms: int = 100) -> float:
    """Median time of one call in microseconds."""
    if device.type == "cuda":
        return 1e3 * triton.testing.do_bench(fn, warmup=25, rep=rep_ms, return_mode="median")
    fn()  # warm-up (compilation, allocator)
    samples = []
    for _ in range(3):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return 1e6 * statistics.median(samples)


def graph_time_us(fn: Callable[[], None], device: torch.device) -> float | None:
    """Median replay time of one call captured in a CUDA graph; ``None`` off CUDA or when the
    call cannot be captured (it synchronises with the host)."""
    if device.type != "cuda":
        return None
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()  # warm up outside the graph: compile, allocate
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            fn()
    except Exception:  # a host sync inside the call makes it uncapturable
        torch.cuda.synchronize(device)
        return None
    return 1e3 * triton.testing.do_bench(graph.replay, warmup=25, rep=100, return_mode="median")


def host_overhead_us(
    fn: Callable[[], None], device: torch.device, n: int = 100, rounds: int = 5
) -> float:
    """Wall-clock microseconds per call over back-to-back calls closed by one sync; the median
    of ``rounds`` such loops of up to ``n`` calls (fewer for slow calls: ~50 ms a loop).
    Launch-bound calls measure host cost, device-bound ones device time."""
    return host_overhead_interleaved_us([fn], device, n=n, rounds=rounds)[0]


def host_overhead_interleaved_us(
    fns: Sequence[Callable[[], None]], device: torch.device, n: int = 100, rounds: int = 5
) -> list[float]:
    """``host_overhead_us`` of several calls, their loops interleaved round by round, so that
    drift in the machine's state (clocks, caches, other processes) falls on all of them alike
    and their ratios compare like with like."""
    counts = []
    for fn in fns:
        t0 = time.perf_counter()
        fn()
        _sync(device)
        counts.append(max(3, min(n, int(0.05 / max(time.perf_counter() - t0, 1e-6)))))
    samples: list[list[float]] = [[] for _ in fns]
    for _ in range(rounds):
        for fn, calls, out in zip(fns, counts, samples, strict=True):
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            _sync(device)
            out.append((time.perf_counter() - t0) / calls)
    return [1e6 * statistics.median(out) for out in samples]


def count_launches(fn: Callable[[], None], device: torch.device) -> int | None:
    """Device operations (kernels, memsets, copies) one call runs, from the torch profiler;
    ``None`` off CUDA."""
    if device.type != "cuda":
        return None
    fn()
    _sync(device)
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        _sync(device)
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def copy_bandwidth_gbs(device: torch.device, nbytes: int = 2 << 30) -> float | None:
    """Device-to-device copy bandwidth in GB/s (bytes read + bytes written), ``None`` off CUDA."""
    if device.type != "cuda":
        return None
    src = torch.empty(nbytes // 2, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=25, rep=200, return_mode="median")
    return 2 * src.numel() / (ms * 1e-3) / 1e9
