"""Engine-safety regression tests of host data and capture, on a GPU: what an engine does
between two steps without synchronising.

- Back-to-back calls with CPU offsets, no sync between them, each refilling one pinned buffer:
  every call keeps the offsets it was given (its private staging is not reused before its
  upload has run).
- A call with CPU offsets does not wait for queued GPU work, and makes no synchronising call.
- CPU offsets of a dtype other than int64 or int32 are a ``TypeError`` before any upload or
  launch.
- CPU offsets for a GPU pool are staged and uploaded only once nothing refuses the call: a
  call refused by a later check queues nothing.
- ``ForwardStepGuard`` under capture: GPU lengths without ``num_tokens``, a split of a step
  (whose lengths are on the GPU, the host, or both), and a growth are refused, naming the
  capture, with nothing recorded or written; the sglang capacity policy sees a real capture.
"""

from __future__ import annotations

import sys
import warnings

import pytest
import torch
from _helpers import (
    QUEUED_HOST_S,
    OpLog,
    random_plan_case,
    rejected,
    scatter_with,
    seconds_behind_queued_work,
)
from conftest import DEVICE, gpu
from test_engine_safety import EMPTY_GRAPH, guard_inputs, refused_in_capture

from kvcanary_dispatch import SCATTER_STRATEGIES, CanaryCapacities, ForwardStepGuard, plan_offsets
from kvcanary_dispatch.testing.cases import (
    make_scatter_case,
)
from kvcanary_dispatch.testing.engine_steps import (
    expect_scatter,
)

BS = 100_000  # 800 KB of int64 offsets: far past what the driver copies at enqueue time


def permuted_cases(n: int, bs: int = BS) -> list:
    """``n`` scatter cases of ``bs`` requests with the same lengths in different orders (so the
    same token count: another case's offsets never read past ``flat_in``) and different
    tokens and pool rows."""
    g = torch.Generator().manual_seed(7)
    lens = torch.randint(0, 30, (bs,), generator=g)
    return [
        make_scatter_case(
            lens[torch.randperm(bs, generator=g)],
            width=16,
            spare_rows=3,
            seed=11 + k,
            device=DEVICE,
        )
        for k in range(n)
    ]


@gpu
@pytest.mark.parametrize("pinned", [True, False])
@pytest.mark.parametrize("strategy", SCATTER_STRATEGIES)
def test_back_to_back_host_offsets_calls_each_keep_their_offsets(strategy, pinned):
    """The engine's loop: one host buffer refilled before every call, calls queued behind
    ~50 ms of GPU work with no sync between them; checked once, after one sync."""
    cases = permuted_cases(4)
    pools = [case.fresh_pool() for case in cases]
    steps = [case.offsets.cpu() for case in cases]  # what the engine's host side computes
    host = torch.empty(BS + 1, dtype=torch.int64, pin_memory=pinned)
    scatter_with(cases[0], cases[0].fresh_pool(), offsets=steps[0], strategy=strategy)  # compile
    torch.cuda.synchronize()
    torch.cuda._sleep(100_000_000)  # every upload below is still queued when the next call runs
    for case, pool, offsets in zip(cases, pools, steps, strict=True):
        host.copy_(offsets)
        scatter_with(case, pool, offsets=host, strategy=strategy)
    host.zero_()
    torch.cuda.synchronize()
    for k, (case, pool) in enumerate(zip(cases, pools, strict=True)):
        expect_scatter(case, pool, f"{strategy}, pinned={pinned}, call {k} of 4")


@gpu
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("strategy", SCATTER_STRATEGIES)
def test_host_offsets_call_does_not_wait_for_the_gpu(strategy, dtype):
    """Behind ~1 s of queued GPU work the call returns at once, with no blocking copy or stream
    sync (torch's sync debug mode) and no explicit synchronize of the device, a stream or an
    event."""
    (case,) = permuted_cases(1)
    host = case.offsets.cpu().to(dtype)
    scatter_with(case, case.fresh_pool(), offsets=host, strategy=strategy)  # compile first
    pool = case.fresh_pool()
    host_s, total_s = seconds_behind_queued_work(
        lambda: scatter_with(case, pool, offsets=host, strategy=strategy)
    )
    assert host_s < QUEUED_HOST_S < total_s, (host_s, total_s)
    expect_scatter(case, pool, f"{strategy}, {dtype}")


@gpu
@pytest.mark.parametrize("dtype", [torch.float64, torch.bool, torch.int16, torch.uint8])
@pytest.mark.parametrize("strategy", SCATTER_STRATEGIES)
def test_host_offsets_of_a_wrong_dtype_refused(strategy, dtype):
    (case,) = permuted_cases(1, bs=600)
    pool = case.fresh_pool()
    host = case.offsets.cpu().to(dtype)
    msg = rejected(TypeError, lambda: scatter_with(case, pool, offsets=host, strategy=strategy),
                   [pool])  # fmt: skip
    assert f"offsets must be int64, got {dtype}; int32 is also taken" in msg, msg


@gpu
@pytest.mark.parametrize(
    "case,exc,text",
    [
        ("device lengths, no num_tokens", ValueError, "without num_tokens reads extend_seq_lens"),
        ("device lengths, split", ValueError, "splitting an oversized step reads"),
        ("host lengths, split", ValueError, "splitting an oversized step (batch_size=150, "),
        ("mixed lengths, split", ValueError, "splitting an oversized step (batch_size=150, "),
        ("grow", RuntimeError, "policy='grow') cannot reallocate the plan buffers"),
    ],
)
def test_guard_refusals_during_capture(case, exc, text):
    oversized = case != "device lengths, no num_tokens"
    lengths, n, r2t = guard_inputs(150, DEVICE)
    if case.startswith("host"):
        lengths = {k: v.cpu() for k, v in lengths.items()}
    elif case.startswith("mixed"):  # a split would copy the GPU prefix_lens of cut requests
        lengths["extend_seq_lens"] = lengths["extend_seq_lens"].cpu()
    policy = "grow" if case == "grow" else "split"
    grown = []
    guard = ForwardStepGuard(CanaryCapacities(100 if oversized else 256, 4096, 10**6),
                             policy=policy, device=DEVICE, on_grow=grown.append)  # fmt: skip
    outputs = list(guard.buffers.tensors().values())
    for t in outputs:  # poisoned: a write that ran shows
        t.fill_(-7)
    kw = dict(**lengths, req_to_token=r2t, num_tokens=None if case.startswith("device lengths, no")
              else n)  # fmt: skip

    def plan() -> None:
        for _ in guard.plan_step(**kw):
            pass

    message = refused_in_capture(plan, outputs, exc)
    assert text in message, message
    assert "capture only steps that fit the capacities" in message, message
    assert guard.capacities == CanaryCapacities(100 if oversized else 256, 4096, 10**6)
    assert all(a is b for a, b in zip(guard.buffers.tensors().values(), outputs, strict=True))
    assert guard.grow_count == 0 and grown == [], (guard.grow_count, grown)


@gpu
def test_sglang_policy_sees_a_real_capture():
    """The sglang capacity policy's capture test (which keeps it from growing or skipping
    inside a graph) reads the real capture state: true on the capturing stream's device,
    false outside the capture."""
    from kvcanary_dispatch.integrations._sglang_steps import _capturing

    graph = torch.cuda.CUDAGraph()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", EMPTY_GRAPH)
        with torch.cuda.graph(graph):
            inside = (_capturing(DEVICE), _capturing(torch.device(DEVICE)))
    assert inside == (True, True), inside
    assert not _capturing(DEVICE)
    assert not _capturing("cpu")


def _refused_before_any_op(monkeypatch, call, outputs: list, match: str, empty=()) -> None:
    """``call()``, the stream read as capturing, raises a ``ValueError`` matching ``match``
    before any torch op (but allocations, where ``empty`` names them) and leaves ``outputs``
    as they were."""
    import kvcanary_dispatch.placement as placement

    before = [t.clone() for t in outputs]
    monkeypatch.setattr(placement, "capturing", lambda device: True)
    # CPU tensors standing for a GPU's (no kernel runs): taken where the kernels are compiled
    monkeypatch.setattr(placement, "INTERPRETED", True)
    with OpLog() as log, pytest.raises(ValueError, match=match):
        call()
    assert [op for op in log.ops if op not in empty] == [], log.ops
    for t, was in zip(outputs, before, strict=True):
        assert torch.equal(t, was)


@pytest.mark.parametrize("kw", [{"strategy": "loop"}, {"validate": True}], ids=["loop", "validate"])
def test_int32_device_offsets_refused_before_any_op(monkeypatch, kw):
    """int32 offsets on the outputs' device are widened by the call, but only once nothing
    refuses it: during capture, ``loop`` and ``validate=True`` are refused before any torch op
    (a capture would record it) but the allocation of the widened copy (which it does not).
    Driven on the CPU: every tensor reads as off the CPU and the stream as capturing."""
    case = make_scatter_case([3, 1, 4], width=8, device="cpu")
    pool = case.fresh_pool()
    offsets = case.offsets.to(torch.int32)
    monkeypatch.setattr(torch.Tensor, "is_cpu", property(lambda self: False))
    call = lambda: scatter_with(case, pool, offsets=offsets, **kw)  # noqa: E731
    match, empty = "while the stream is capturing", ("aten.empty.memory_format",)
    _refused_before_any_op(monkeypatch, call, [pool], match, empty)


def test_host_offsets_refused_before_any_op(monkeypatch):
    """CPU offsets for a pool on a GPU while the stream captures: refused before any torch op
    (a replay would upload the capture-time offsets), the pool left as it was. Driven on the
    CPU through the call's body: the pool reads as on a GPU and the stream as capturing."""
    import kvcanary_dispatch.scatter as scatter

    case = make_scatter_case([3, 1, 4], width=8, device="cpu")
    pool = case.fresh_pool()
    monkeypatch.setattr(scatter, "device_of", lambda t: torch.device("cuda", 0))
    args = (case.flat_in, case.offsets, case.req_pool_indices, pool, None, "auto", False)
    call = lambda: scatter._scatter(*args)  # noqa: E731
    _refused_before_any_op(monkeypatch, call, [pool], "got offsets on the CPU while the stream")


def _host_offsets_call(monkeypatch, case, **kw):
    """``scatter._scatter`` on ``case`` (made on ``DEVICE``) with its offsets as int32 on the
    CPU, each upload recorded. On a GPU the upload is the library's; on the CPU the pool reads
    as on a GPU (so CPU offsets take the staged upload) and the upload is a plain copy."""
    import kvcanary_dispatch.scatter as scatter

    uploads, upload = [], scatter.upload_into

    def upload_into(device_copy, host):
        uploads.append((device_copy.dtype, host.clone()))
        if device_copy.is_cuda:
            upload(device_copy, host)
        else:
            device_copy.copy_(host)

    if not torch.cuda.is_available():
        monkeypatch.setattr(scatter, "device_of", lambda t: torch.device("cuda", 0))
    monkeypatch.setattr(scatter, "upload_into", upload_into)
    args = {"flat_in": case.flat_in, "offsets": case.offsets.cpu().to(torch.int32),
            "req_pool_indices": case.req_pool_indices, "pool_out": case.fresh_pool(),
            "chunk_size": None, "strategy": "auto", "validate": False, **kw}  # fmt: skip
    return (lambda: scatter._scatter(**args)), args["pool_out"], uploads


@pytest.mark.parametrize(
    "bad, exc, text",
    [
        ("req_pool_indices", TypeError, "req_pool_indices must be int64"),
        ("flat_in in the pool", ValueError, "pool_out shares memory with flat_in"),
    ],
)
def test_host_offsets_are_staged_only_once_nothing_refuses_the_call(monkeypatch, bad, exc, text):
    """CPU offsets for a GPU pool, the call refused by a check after the offsets' own: nothing
    staged or uploaded and no torch op but the allocation of their device copy (a refused call
    puts nothing on the stream), the pool left as it was (``_host_offsets_call``: on the CPU,
    the pool read as on a GPU)."""
    case = make_scatter_case([3, 1, 4], width=8, device=DEVICE)
    if bad == "req_pool_indices":
        rpi = case.req_pool_indices.to(torch.int32)
        call, pool, uploads = _host_offsets_call(monkeypatch, case, req_pool_indices=rpi)
    else:
        pool = case.fresh_pool()
        # the tokens read from the pool's first rows
        flat_in = torch.empty(0, dtype=torch.int64, device=DEVICE)
        flat_in.set_(pool.untyped_storage(), 0, (8,))
        call, pool, uploads = _host_offsets_call(monkeypatch, case, flat_in=flat_in, pool_out=pool)
    before = pool.clone()
    with OpLog() as log, pytest.raises(exc, match=text):
        call()
    assert uploads == []
    assert [op for op in log.ops if op != "aten.empty.memory_format"] == [], log.ops
    assert torch.equal(pool, before)


def test_host_offsets_are_uploaded_once_widened_after_the_checks(monkeypatch):
    """The accepted call's counterpart: int32 CPU offsets are staged once, into an int64 copy,
    and the pool is written as the reference writes it."""
    case = make_scatter_case([3, 0, 4, 1], width=8, device=DEVICE)
    call, pool, uploads = _host_offsets_call(monkeypatch, case)
    call()
    assert len(uploads) == 1 and uploads[0][0] is torch.int64
    assert torch.equal(uploads[0][1], case.offsets.cpu().to(torch.int32))
    expect_scatter(case, pool, "host offsets, staged")


@pytest.mark.parametrize("strategy", ["auto", "loop"])
def test_plan_validate_refused_before_any_op(monkeypatch, strategy):
    """``plan_offsets(validate=True)`` while the stream captures: refused before any torch op
    (validating reads the inputs back; a capture would record the reads), every output left as
    it was. Driven on the CPU, the stream read as capturing."""
    case = random_plan_case(600, 3, device="cpu")
    outputs = case.fresh_outputs()
    call = lambda: plan_offsets(**case.inputs(), **outputs, strategy=strategy, validate=True)  # noqa: E731
    match = "validate=True reads the inputs back"
    _refused_before_any_op(monkeypatch, call, list(outputs.values()), match)


@pytest.mark.parametrize("fails", [False, True], ids=["exchanged", "driver refuses"])
def test_relaxed_capture_mode_sets_and_gives_back_the_threads_mode(monkeypatch, fails):
    """The guard's fill and its host wait run with the thread's capture mode exchanged for the
    relaxed one (2), and the mode found (here thread-local, 1) is given back after, even when
    the block raises: two exchanges. Where the driver refuses the exchange (or is absent, as
    on a CPU machine), the mode is left alone: one attempt, nothing given back."""
    import kvcanary_dispatch.placement as placement

    mode, calls = [1], []

    def exchange(ref) -> int:
        calls.append(ref._obj.value)
        if fails:
            return 1
        ref._obj.value, mode[0] = mode[0], ref._obj.value
        return 0

    monkeypatch.setattr(placement, "_capture_mode_exchange", lambda: exchange)
    with pytest.raises(KeyError), placement._relaxed_capture_mode():
        assert mode[0] == (1 if fails else 2)
        raise KeyError
    assert mode[0] == 1
    assert calls == ([2] if fails else [2, 1])
    monkeypatch.undo()
    with placement._relaxed_capture_mode():  # the real driver, or none (a CPU machine)
        pass


@pytest.mark.parametrize("hip", [None, "6.2"], ids=["cuda", "rocm"])
@pytest.mark.parametrize("found", [True, False], ids=["found", "absent"])
def test_capture_mode_exchange_is_the_runtimes_own(monkeypatch, hip, found):
    """The mode exchange is looked up in the library torch runs on: the CUDA driver's
    ``cuThreadExchangeStreamCaptureMode``, or HIP's ``hipThreadExchangeStreamCaptureMode`` on a
    ROCm build (its runtime found by name, then by its plain file name); ``None`` when no
    such library loads."""
    import ctypes

    import kvcanary_dispatch.placement as placement

    opened = []

    class Library:
        def __init__(self, name: str) -> None:
            opened.append(name)
            if not found:
                raise OSError(name)
            self.name = name

        def __getattr__(self, symbol: str):
            opened.append(symbol)
            return ctypes.CFUNCTYPE(ctypes.c_int)(lambda: 0)

    monkeypatch.setattr(torch.version, "hip", hip)
    monkeypatch.setattr(placement.ctypes, "CDLL", Library)
    monkeypatch.setattr(placement.ctypes.util, "find_library", lambda name: f"lib{name}.so.6")
    placement._capture_mode_exchange.cache_clear()
    try:
        exchange = placement._capture_mode_exchange()
    finally:
        placement._capture_mode_exchange.cache_clear()
    if hip:
        symbol = "hipThreadExchangeStreamCaptureMode"
        tried = ["libamdhip64.so.6", symbol] if found else ["libamdhip64.so.6", "libamdhip64.so"]
    else:
        symbol = "cuThreadExchangeStreamCaptureMode"
        tried = ["nvcuda.dll" if sys.platform == "win32" else "libcuda.so.1"]
        tried += [symbol] if found else []
    assert opened == tried
    assert (exchange is not None) == found


@gpu
@pytest.mark.parametrize(
    "layout",
    [
        "host",
        "device",
        "device int32 strided",
        "mixed",
        "extend on host",
        "device int32 strided, to CPU",
    ],
)
def test_a_sub_steps_stand_in_is_its_copy_unfilled(layout):
    """``SubStep.stand_in`` (what a growing guard checks before it copies a step's lengths) has
    the dtype, shape, strides, device and storage sharing of ``SubStep.to``'s copy, in new
    memory, unfilled: the plan's checks cannot tell them apart."""
    from kvcanary_dispatch.step_split import LENGTH_NAMES, SubStep

    values = [torch.tensor([3, 0, 5, 1]), torch.tensor([2, 2, 0, 7]), torch.tensor([1, 4, 0, 2])]
    if layout == "device":
        values = [v.to(DEVICE) for v in values]
    elif layout.startswith("device int32 strided"):  # not dense: a copy is made contiguous
        values = [v.repeat_interleave(2).to(DEVICE, torch.int32)[::2] for v in values]
    elif layout == "mixed":
        values[1] = values[1].to(DEVICE)
    elif layout == "extend on host":  # the last length alone to copy
        values[:2] = [v.to(DEVICE) for v in values[:2]]
    sub = SubStep(*values, 0, 4, 0, 0, 9)
    # With its index, as a guard's buffers have; or the CPU, where a guard's lengths on a GPU
    # are copied tensor by tensor
    device = torch.empty(0, device="cpu" if layout.endswith("CPU") else DEVICE).device
    copy, stand_in = sub.to(device), sub.stand_in(device)
    storage = lambda t: t.untyped_storage().data_ptr()  # noqa: E731
    for name, given in zip(LENGTH_NAMES, values, strict=True):
        c, s = getattr(copy, name), getattr(stand_in, name)
        assert (s.dtype, s.shape, s.stride(), s.device) == (c.dtype, c.shape, c.stride(), c.device)
        assert s.storage_offset() == c.storage_offset()
        assert (s is given) == (c is given), name
        if s is not given:
            assert storage(s) not in {storage(t) for t in values}
            assert c.dtype == torch.int64, (name, c.dtype)  # plan_step's "int64 copies"
    shared = lambda step: [storage(getattr(step, n)) for n in LENGTH_NAMES]  # noqa: E731
    pattern = lambda ptrs: [ptrs.index(p) for p in ptrs]  # noqa: E731
    assert pattern(shared(stand_in)) == pattern(shared(copy))


def test_a_sub_steps_copies_to_another_device_are_int64():
    """int32 lengths copied to a device they are not on (``meta``, which the CPU has: the
    path of a GPU's lengths copied to another GPU or to the CPU) come back as int64 copies
    from ``SubStep.to`` and ``stand_in`` alike, as ``ForwardStepGuard.plan_step`` promises;
    the plan would refuse int32 ones."""
    from kvcanary_dispatch.step_split import LENGTH_NAMES, SubStep

    values = [torch.tensor(v, dtype=torch.int32) for v in ([3, 0, 5], [2, 2, 0], [1, 4, 0])]
    sub = SubStep(*values, 0, 3, 0, 0, 5)
    meta = torch.device("meta")
    for moved in (sub.to(meta), sub.stand_in(meta)):
        for name in LENGTH_NAMES:
            t = getattr(moved, name)
            assert (t.dtype, t.device, t.shape) == (torch.int64, meta, (3,)), (name, t)
