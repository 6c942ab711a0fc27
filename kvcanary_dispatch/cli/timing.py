"""The measurement core of ``kvcanary-dispatch sweep`` and every benchmark in ``benchmarks/``.

- eager time: ``triton.testing.do_bench`` median on CUDA (events, L2 flushed between runs);
  wall-clock median on the CPU (interpreter timings say nothing about a GPU).
- graph time: one call captured in a CUDA graph, replays timed with ``do_bench``; for a ratio
  of two calls, both captured and their replays timed alternately, round by round;
  ``replayed`` gives a call's replay for a check against the reference.
- host time: wall clock over ``n`` back-to-back calls followed by one synchronisation, the
  loops of a case's calls interleaved round by round.
- the floors: bytes a call must move at the measured device copy bandwidth, and the empty
  launch (an empty Triton kernel's CUDA-graph replay, L0).

``time_call`` and ``add_host_times`` are what the harnesses call; the rest are their parts.
"""

from __future__ import annotations

import functools
import statistics
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import triton

from ..testing.cases import PlanCase, ScatterCase
from ..testing.engine_steps import poison_
from .workloads import written_tokens

BYTES_PER_TOKEN = 12  # one int64 read, one int32 written
SECTOR = 32  # bytes of one DRAM write sector


@dataclass
class Timing:
    """One call's measurements, microseconds (``None``: not measured or not measurable here)."""

    eager_us: float | None = None
    graph_us: float | None = None
    host_us: float | None = None
    launches: int | None = None


def time_call(
    fn: Callable[[], None],
    device: torch.device,
    *,
    rep_ms: int = 100,
    launches: bool = False,
    graph: bool = True,
) -> Timing:
    """Eager and CUDA-graph time of one call (and its device-operation count when ``launches``);
    the host time comes from ``add_host_times`` over the case's calls together. ``graph=False``
    for a call known not to be capturable: no capture is tried (``graph_us`` stays ``None``),
    and none has to be undone (``_after_failed_capture``)."""
    t = Timing(eager_us=kernel_time_us(fn, device, rep_ms))
    with warnings.catch_warnings():
        # A call that syncs cannot be captured (graph_us = None): torch warns about the empty
        # graph; the profiler warns about its cycles. Neither says anything here.
        warnings.simplefilter("ignore", UserWarning)
        t.graph_us = graph_time_us(fn, device) if graph else None
        if launches:
            t.launches = count_launches(fn, device)
    return t


def add_host_times(
    timings: Sequence[Timing],  # or anything with a ``host_us`` (a results row)
    fns: Sequence[Callable[[], None]],
    device: torch.device,
    *,
    n: int = 100,
    rounds: int = 5,
) -> None:
    """Fill each timing's ``host_us``: its call's host loops, interleaved with the others'."""
    if not fns:
        return
    for t, us in zip(timings, host_overhead_interleaved_us(fns, device, n, rounds), strict=True):
        t.host_us = us


@functools.cache
def _empty_kernel():
    @triton.jit
    def empty_kernel(x_ptr):
        pass  # the launch floor: one program that does nothing

    return empty_kernel


def empty_launch(device: torch.device) -> Callable[[], None]:
    """One launch of an empty Triton kernel (one program) on ``device``: L0's call."""
    x = torch.zeros(1, device=device)
    kernel = _empty_kernel()
    return lambda: kernel[(1,)](x)


def empty_launch_us(device: torch.device) -> float | None:
    """L0: an empty Triton kernel's CUDA-graph replay, microseconds; ``None`` off CUDA."""
    if device.type != "cuda":
        return None
    return graph_time_us(empty_launch(device), device)


def floor_us(nbytes: int, copy_gbs: float | None) -> float | None:
    """Microseconds to move ``nbytes`` at ``copy_gbs`` (``None`` when it was not measured)."""
    return nbytes / (copy_gbs * 1e3) if copy_gbs else None


def scatter_token_bytes(case: ScatterCase) -> int:
    """The scatter's plain floor: 12 bytes per written token (segments clamped to the width)."""
    return BYTES_PER_TOKEN * written_tokens(case)


def scatter_sector_bytes(case: ScatterCase, pool: torch.Tensor) -> int:
    """The scatter's floor in sectors. Reads: each written token of ``flat_in``, the offsets
    and the indices, at their element sizes. Writes: each request's run as whole 32-byte
    sectors of its pool row, at the row's address in ``pool``."""
    lens = case.written_lens.cpu()
    rows = case.req_pool_indices.cpu()
    start = pool.data_ptr() + rows * pool.stride(0) * pool.element_size()
    end = start + lens * pool.element_size()  # one past the last byte written
    sectors = torch.where(lens > 0, (end - 1) // SECTOR - start // SECTOR + 1, 0)
    reads = case.flat_in.element_size() * lens.sum() + case.offsets.element_size() * (case.bs + 1)
    return int(reads + rows.element_size() * case.bs + SECTOR * sectors.sum())


def plan_floor_bytes(case: PlanCase) -> int:
    """The plan's floor: each request's three inputs (at their element sizes) and three int64
    outputs, one 32-byte sector per seed read from ``req_to_token``, and with a LUT each
    distinct 32-byte sector of it that the seeds' translations read (a seed below 0 is not
    translated)."""
    rpi, prefix = case.req_pool_indices, case.prefix_lens
    seeds = (rpi != 0) & (prefix > 0) & (case.extend_seq_lens > 0)
    inputs = sum(t.element_size() for t in (rpi, prefix, case.extend_seq_lens))
    nbytes = (inputs + 24) * case.bs + SECTOR * int(seeds.sum())
    lut = case.lut
    if lut is not None and lut.numel():
        slots = case.req_to_token[rpi[seeds], prefix[seeds] - 1].to(torch.int64)
        slots = slots[slots >= 0].clamp(max=lut.numel() - 1)
        addresses = lut.data_ptr() + slots * lut.element_size()
        nbytes += SECTOR * int(torch.unique(addresses // SECTOR).numel())
    return nbytes


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
    graph = _captured(fn, device) if device.type == "cuda" else None
    return None if graph is None else _replay_us(graph)


def replayed(impl: Callable[..., None], device: torch.device) -> Callable[..., None]:
    """``impl`` as a CUDA graph's replay, for a check to compare with the reference: each call
    ``replayed(impl, device)(**kw)`` captures ``impl(**kw)`` (``_captured``: its warm-up calls
    write the outputs eagerly), poisons every output again (``pool_out`` and the ``out_*``
    tensors, whole, as the checks poison them: ``POISON_I64`` if int64, else ``POISON_I32``;
    no copy, since a benchmark's pool may fill half the device), replays the graph once and
    waits for it. So what the check then reads was written by the captured launches alone (a
    call captured under another plan than its eager one, as the plan's ``auto`` is, is
    checked on that plan). A call that cannot be captured leaves its warm-up's eager results
    (its graph time is ``None`` too)."""

    def call(**kw) -> None:
        graph = _captured(functools.partial(impl, **kw), device)
        if graph is None:
            return
        poison_(*(t for name, t in kw.items() if name == "pool_out" or name.startswith("out_")))
        graph.replay()
        torch.cuda.synchronize(device)

    return call


def graph_times_interleaved_us(
    fns: Sequence[Callable[[], None]], device: torch.device, rounds: int = 5
) -> list[list[float]] | None:
    """Each call captured once in a CUDA graph, then the graphs' replays timed in turn,
    ``rounds`` times (a ``do_bench`` median each; round ``k`` starts at call ``k % len(fns)``
    and goes on in order, wrapping, so that each call goes first in turn; for two calls, every
    other round is reversed): per call, its µs round by round, for ratios measured side by
    side. ``None`` off CUDA or when a call cannot be captured."""
    if device.type != "cuda":
        return None
    graphs = [_captured(fn, device) for fn in fns]
    if any(g is None for g in graphs):
        return None
    times: list[list[float]] = [[] for _ in graphs]
    for k in range(rounds):
        for i in round_order(len(graphs), k):
            times[i].append(_replay_us(graphs[i]))
    return times


def round_order(n: int, k: int) -> list[int]:
    """The order of ``n`` calls in round ``k`` of ``graph_times_interleaved_us``: from call
    ``k % n`` on, wrapping."""
    first = k % n
    return [*range(first, n), *range(first)]


def _captured(fn: Callable[[], None], device: torch.device) -> torch.cuda.CUDAGraph | None:
    """``fn`` captured in a CUDA graph on ``device`` after two warm-up calls (compile,
    allocate) on a side stream, which the capture uses too; ``None`` when it cannot be
    captured (a host sync). The caller's current device and stream are left as they were."""
    with torch.cuda.device(device):
        caller = torch.cuda.current_stream(device)
        side = torch.cuda.Stream(device)
        side.wait_stream(caller)
        with torch.cuda.stream(side):
            for _ in range(2):
                fn()
        caller.wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        pool = torch.cuda.graph_pool_handle()  # named here: a failed capture cannot tell it
        try:
            with torch.cuda.graph(graph, stream=side, pool=pool):
                fn()
        except Exception:  # a host sync inside the call makes it uncapturable
            _after_failed_capture(caller, side, pool)
            return None
    return graph


def _after_failed_capture(
    caller: torch.cuda.Stream, side: torch.cuda.Stream, pool: tuple[int, int]
) -> None:
    """Undo what a capture that failed inside leaves, on the current device:
    - torch keeps the capture's stream current: the caller's is made current again;
    - a capture the call invalidated (a host sync) ends without ending the allocator's
      allocation to ``pool``; the allocator then aborts the process at its next
      ``empty_cache`` or memory-pool release. The allocation is ended and the pool released
      here. (A capture the call merely raised out of ended both itself: ending it again
      raises, and nothing is released twice.);
    - torch ends its CUDA generator's capture only when a capture succeeds (until then every
      random op on the device raises ``Offset increment outside graph capture``): one empty
      capture ends it."""
    torch.cuda.set_stream(caller)
    torch.cuda.synchronize()
    index = torch.cuda.current_device()
    try:
        torch._C._cuda_endAllocateToPool(index, pool)
    except RuntimeError:  # the capture ended: its graph owns the pool
        pass
    else:
        torch._C._cuda_releasePool(index, pool)
    with warnings.catch_warnings():  # torch warns that the graph is empty
        warnings.simplefilter("ignore")
        with torch.cuda.graph(torch.cuda.CUDAGraph(), stream=side):
            pass


def _replay_us(graph: torch.cuda.CUDAGraph) -> float:
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
    src = torch.full((nbytes // 2,), 7, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=25, rep=200, return_mode="median")
    return 2 * src.numel() / (ms * 1e-3) / 1e9
