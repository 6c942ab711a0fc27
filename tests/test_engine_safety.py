"""Engine-safety regression tests, items 1 to 4 (5 to 7 are in ``test_engine_safety_api.py``,
8 in ``test_engine_safety_compile.py``), each named ``test_itemN_...``; they need a GPU (item 3
two), as the behaviour exists only there.

1. CPU offsets are copied during the call: the caller may refill its (pinned) tensor at once.
2. Nothing that cannot be captured is captured: CPU offsets, scatter ``"loop"`` with device
   offsets and ``validate=True`` are a ``ValueError`` during CUDA-graph capture.
3. Launches follow the tensors' device (and its current stream); mixed devices are refused.
4. ``ForwardStepGuard.plan_step`` never waits on the GPU for host lengths, refuses them under
   capture, and checks device lengths with ``num_tokens`` without a sync.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import warnings

import pytest
import torch
from _helpers import (
    QUEUED_HOST_S,
    random_plan_lens,
    rejected,
    scatter_with,
    seconds_behind_queued_work,
)
from conftest import DEVICE, gpu, two_gpus

import kvcanary_dispatch as kd
from kvcanary_dispatch import (
    PLAN_STRATEGIES,
    SCATTER_STRATEGIES,
    CanaryCapacities,
    ForwardStepGuard,
    plan_offsets,
    scatter_req_token_ids,
)
from kvcanary_dispatch.scatter_shapes import capped_shape
from kvcanary_dispatch.testing.cases import (
    PLAN_OUT_NAMES,
    PlanCase,
    assert_bytes_equal,
    check_plan,
    check_scatter,
    make_plan_case,
    make_scatter_case,
)
from kvcanary_dispatch.testing.engine_steps import (
    expect_plan,
    expect_scatter,
    poison_,
    rolled_offsets,
)
from kvcanary_dispatch.testing.properties import record_launches

CAPTURE = "capturing a CUDA graph"
EMPTY_GRAPH = "The CUDA Graph is empty"  # torch's warning at the end of a capture of nothing
I32_MAX, I64_MAX = 2**31 - 1, 2**63 - 1


def scatter_case(bs: int = 3000, device=DEVICE, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(0, 30, (bs,), generator=g)
    return make_scatter_case(lens, width=16, spare_rows=3, seed=seed, device=device)


def plan_case(bs: int = 3000, device=DEVICE, seed: int = 2, **kw) -> PlanCase:
    args = dict(
        **random_plan_lens(seed, bs, prefix_hi=40, extend=(-1, 6), pad_p=0.2),
        max_seq_len=48,
        lut_len=64,
        swa_window_size=5,
        seed=seed,
        device=device,
    )
    return make_plan_case(**{**args, **kw})


# ---------------------------------------------------------------- 1. host offsets


@gpu
@pytest.mark.parametrize("pinned", [True, False])
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("strategy", SCATTER_STRATEGIES)
def test_item1_host_offsets_refilled_right_after_the_call(strategy, dtype, pinned):
    # 100 000 requests: 800 KB of offsets. The driver copies a small pinned upload (under
    # ~64 KB) at enqueue time, which would hide an upload that reads the caller's tensor late.
    case = scatter_case(100_000)
    host = case.offsets.cpu().to(dtype)
    host = host.pin_memory() if pinned else host
    pool = case.fresh_pool()
    torch.cuda._sleep(100_000_000)  # ~50 ms of queued work: any upload still waits behind it
    scatter_with(case, pool, offsets=host, strategy=strategy)
    host.copy_(rolled_offsets(case.offsets.cpu()).to(dtype))  # the engine's next step
    expect_scatter(case, pool, f"{strategy}, {dtype}, pinned={pinned}")


# ---------------------------------------------------------------- 2. capture


def refused_in_capture(fn, outputs: list[torch.Tensor], exc: type[Exception] = ValueError) -> str:
    """``fn`` under capture raises ``exc`` naming the capture, before any launch, the capture
    ends cleanly with nothing recorded (torch warns that the graph is empty: no Triton launch
    and no torch op either, which a capture records without running), and ``outputs`` are
    untouched. Returns the message."""
    before = [t.clone() for t in outputs]
    # Garbage of earlier tests (a pinned tensor held by a traceback cycle) freed by the garbage
    # collector inside the capture would invalidate it: collect now, not during the capture.
    gc.collect()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    gc.disable()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with record_launches() as launches, pytest.raises(exc) as info:
                with torch.cuda.graph(graph):
                    fn()
    finally:
        gc.enable()
    torch.cuda.synchronize()
    message = str(info.value)
    info.value.__traceback__ = None  # no cycle holding this test's tensors past its end
    assert CAPTURE in message, message
    assert not launches, launches
    warned = [str(w.message) for w in caught]
    assert any(EMPTY_GRAPH in m for m in warned), f"the refused call recorded work: {warned}"
    for t, b in zip(outputs, before, strict=True):
        assert_bytes_equal(t, b, "output after the refused capture")
    return message


def scatter_refused_in_capture(offsets_dtype: torch.dtype = torch.int64, **kw) -> None:
    """A scatter of 600 requests with device offsets of ``offsets_dtype`` (int32 ones the call
    widens) and ``kw`` is refused under capture."""
    case = scatter_case(600)
    pool = case.fresh_pool()
    offsets = case.offsets.to(offsets_dtype)
    refused_in_capture(lambda: scatter_with(case, pool, offsets=offsets, **kw), [pool])


@gpu
@pytest.mark.parametrize("variant", ["pinned", "pageable", "pinned_int32", "pageable_int32"])
@pytest.mark.parametrize("strategy", SCATTER_STRATEGIES)
def test_item2_host_offsets_refused_during_capture(strategy, variant):
    case = scatter_case(600)
    host = case.offsets.cpu().to(torch.int32 if variant.endswith("int32") else torch.int64)
    host = host.pin_memory() if variant.startswith("pinned") else host
    pool = case.fresh_pool()
    message = refused_in_capture(
        lambda: scatter_with(case, pool, offsets=host, strategy=strategy), [pool]
    )
    assert "offsets" in message and str(pool.device) in message, message  # the fix: device offsets
    check_scatter(lambda **kw: scatter_req_token_ids(**kw, strategy=strategy), case)  # still fine


@gpu
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_item2_loop_with_device_offsets_refused_during_capture(dtype):
    scatter_refused_in_capture(dtype, strategy="loop")


@gpu
@pytest.mark.parametrize("lens", [[], [0, 0, 0]], ids=["bs0", "no_tokens"])
def test_item2_loop_with_nothing_to_copy_is_captured(lens):
    """A ``loop`` call with no request or no token launches nothing and reads nothing back:
    captured, not refused, it records nothing (torch warns the graph is empty), and the pool
    stays as it was."""
    case = make_scatter_case(lens, width=8, spare_rows=2, device=DEVICE)
    pool = case.fresh_pool()
    before = pool.clone()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with record_launches() as launches, torch.cuda.graph(graph):
            scatter_req_token_ids(**case.kwargs(pool), strategy="loop")
    assert not launches, launches
    assert any(EMPTY_GRAPH in str(w.message) for w in caught), [str(w.message) for w in caught]
    graph.replay()
    torch.cuda.synchronize()
    assert_bytes_equal(pool, before, "pool after the empty loop's replay")


@gpu
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("strategy", SCATTER_STRATEGIES)
def test_item2_scatter_validate_refused_during_capture(strategy, dtype):
    scatter_refused_in_capture(dtype, strategy=strategy, validate=True)


@gpu
@pytest.mark.parametrize("strategy", PLAN_STRATEGIES)
def test_item2_plan_validate_refused_during_capture(strategy):
    case = plan_case(600)
    outs = case.fresh_outputs()
    call = lambda: plan_offsets(**case.inputs(), **outs, strategy=strategy, validate=True)  # noqa: E731
    refused_in_capture(call, list(outs.values()))


# ---------------------------------------------------------------- 3. devices


@contextlib.contextmanager
def cuda0_untouched():
    """``cuda:0`` stays current and gets no allocation inside the block."""
    torch.cuda.set_device(0)
    torch.cuda.synchronize(0)
    torch.cuda.reset_peak_memory_stats(0)
    base = torch.cuda.memory_allocated(0)
    yield
    assert torch.cuda.current_device() == 0
    assert torch.cuda.max_memory_allocated(0) == base, "allocated on cuda:0"


@two_gpus
@pytest.mark.parametrize("offsets", ["device", "host"])
@pytest.mark.parametrize("strategy", SCATTER_STRATEGIES)
def test_item3_scatter_on_the_second_gpu(strategy, offsets):
    case = scatter_case(device="cuda:1")

    def impl(**kw):
        kw["offsets"] = kw["offsets"].cpu() if offsets == "host" else kw["offsets"]
        scatter_req_token_ids(**kw, strategy=strategy)

    with cuda0_untouched():
        check_scatter(impl, case)
        check_scatter(kd.launch_scatter_req_token_ids_kernel, case)


@two_gpus
@pytest.mark.parametrize("width", [8192, 16384])
def test_item3_capped_long_runs_on_the_second_gpu(width):
    """``capped``'s shape for means past 512 on ``cuda:1`` with ``cuda:0`` current: one request
    a head tile, 8 steps without tail programs (a pool 8 192 wide) or 4 steps with the tail
    programs first (16 384)."""
    lens = torch.tensor([9000, 0, 600, 13000, 4097, 100, 5000])
    case = make_scatter_case(lens, width=width, spare_rows=2, seed=4, device="cuda:1")
    assert dict(capped_shape(case.bs, case.total, width))["tails_first"] == (width > 8192)
    with cuda0_untouched():
        check_scatter(scatter_req_token_ids, case, strategy="capped")


@two_gpus
@pytest.mark.parametrize("strategy", PLAN_STRATEGIES)
def test_item3_plan_on_the_second_gpu(strategy):
    case = plan_case(device="cuda:1")
    with cuda0_untouched():
        check_plan(plan_offsets, case, strategy=strategy)
        check_plan(
            kd.launch_plan_offsets_kernel, case, out_verify_name="out_verify_offsets_scratch"
        )


@two_gpus
@pytest.mark.parametrize("lengths", ["host", "device"])
def test_item3_guard_on_the_second_gpu(lengths):
    case = plan_case(700, device="cuda:1", lut_len=None, swa_window_size=0)
    dev = case.device if lengths == "device" else "cpu"
    rpi, prefix, extend = (
        t.to(dev) for t in (case.req_pool_indices, case.prefix_lens, case.extend_seq_lens)
    )
    caps = CanaryCapacities(256, 4096, case.verify_capacity)
    with cuda0_untouched():
        guard = ForwardStepGuard(caps, device="cuda:1")
        n = 0
        for sub, buffers in guard.plan_step(
            req_pool_indices=rpi,
            prefix_lens=prefix,
            extend_seq_lens=extend,
            req_to_token=case.req_to_token,
        ):
            assert buffers.device == torch.device("cuda:1") == sub.req_pool_indices.device
            assert sub.first_done == 0  # no request is cut: the step's own rows
            part = slice(sub.req_start, sub.req_stop)
            sub_case = PlanCase(
                case.req_pool_indices[part],
                case.prefix_lens[part],
                case.extend_seq_lens[part],
                case.req_to_token,
                None,
                0,
                case.verify_capacity,
                256,
                257,
            )
            expect_plan(sub_case, buffers.tensors(), f"sub-step {n}")
            poison_(*buffers.tensors().values())
            n += 1
    assert n == 3  # 700 requests in sub-steps of 256


@two_gpus
@pytest.mark.parametrize("keep_cuda0_current", [False, True])
def test_item3_side_stream_of_the_second_gpu(keep_cuda0_current):
    """Launches go to device 1's current stream: a side stream that sleeps, then poisons the
    outputs; a launch anywhere else lands before the poison and leaves it showing."""
    torch.cuda.set_device(0)
    s_case, p_case = scatter_case(device="cuda:1"), plan_case(device="cuda:1")
    pool, outs = s_case.fresh_pool(), p_case.fresh_outputs()
    side = torch.cuda.Stream(device=1)
    side.wait_stream(torch.cuda.current_stream(1))
    # Every strategy of both functions; the shorter list wraps round.
    for strategy, plan_strategy in zip(SCATTER_STRATEGIES, itertools.cycle(PLAN_STRATEGIES)):
        with torch.cuda.stream(side):
            if keep_cuda0_current:
                torch.cuda.set_device(0)
            with torch.cuda.device(1):
                torch.cuda._sleep(50_000_000)
            poison_(pool, *outs.values())
            scatter_with(s_case, pool, strategy=strategy)
            plan_offsets(**p_case.inputs(), **outs, strategy=plan_strategy)
        side.synchronize()
        expect_scatter(s_case, pool, f"{strategy} on a side stream of cuda:1")
        expect_plan(p_case, outs, f"{plan_strategy} on a side stream of cuda:1")


def _refused_across_devices(call, outputs: list[torch.Tensor]) -> None:
    message = rejected(ValueError, call, outputs)
    assert "must be on" in message, message
    assert "cuda:0" in message and "cuda:1" in message and "device" in message, message


@two_gpus
@pytest.mark.parametrize("moved", ["flat_in", "offsets", "req_pool_indices", "pool_out"])
@pytest.mark.parametrize("strategy", SCATTER_STRATEGIES)
def test_item3_scatter_mixed_devices_refused(strategy, moved):
    case = scatter_case(600, device="cuda:1")
    kw = case.kwargs(case.fresh_pool())
    kw[moved] = kw[moved].to("cuda:0")
    call = lambda: scatter_req_token_ids(**kw, strategy=strategy)  # noqa: E731
    _refused_across_devices(call, [kw["pool_out"]])


@two_gpus
@pytest.mark.parametrize(
    "moved", ["req_pool_indices", "req_to_token", "full_to_swa_index_mapping", *PLAN_OUT_NAMES]
)
@pytest.mark.parametrize("strategy", PLAN_STRATEGIES)
def test_item3_plan_mixed_devices_refused(strategy, moved):
    case = plan_case(600, device="cuda:1")
    kw = {**case.inputs(), **case.fresh_outputs()}
    kw[moved] = kw[moved].to("cuda:0")
    call = lambda: plan_offsets(**kw, strategy=strategy)  # noqa: E731
    _refused_across_devices(call, [kw[k] for k in PLAN_OUT_NAMES])


# ---------------------------------------------------------------- 4. the guard's host waits


def guard_inputs(bs: int, device) -> tuple[dict, int, torch.Tensor]:
    case = plan_case(bs, device=DEVICE, lut_len=None, swa_window_size=0)
    lengths = dict(
        req_pool_indices=case.req_pool_indices.to(device),
        prefix_lens=case.prefix_lens.to(device),
        extend_seq_lens=case.extend_seq_lens.to(device),
    )
    return lengths, int(case.extend_seq_lens.clamp(min=0).sum()), case.req_to_token


@gpu
@pytest.mark.parametrize("num_tokens", [True, False])
@pytest.mark.parametrize("bs", [40, 150])  # fits; split in three
def test_item4_guard_host_lengths_do_not_wait_for_the_gpu(bs, num_tokens):
    """``plan_step`` on host lengths, with and without ``num_tokens``: its first (sub-)step
    returns behind queued GPU work, under torch's sync debug mode and with every
    ``synchronize`` refused, and plans that sub-step's requests."""
    lengths, n, r2t = guard_inputs(bs, "cpu")
    guard = ForwardStepGuard(CanaryCapacities(64, 4096, 10**6), device=DEVICE)
    kw = dict(**lengths, req_to_token=r2t, num_tokens=n if num_tokens else None)
    for _ in guard.plan_step(**kw):  # compile outside the timing
        pass
    poison_(*guard.buffers.tensors().values())
    first = []  # the first (sub-)step, planned in the timing
    host_s, total_s = seconds_behind_queued_work(
        lambda: first.append(next(iter(guard.plan_step(**kw))))
    )
    assert host_s < QUEUED_HOST_S < total_s, (host_s, total_s)
    ((sub, buffers),) = first
    part = slice(sub.req_start, sub.req_stop)
    want = PlanCase(*(lengths[k][part].to(DEVICE) for k in lengths), r2t, None, 0, 10**6, 64, 65)
    expect_plan(want, buffers.tensors(), "first sub-step")


@gpu
def test_item4_guard_host_lengths_refused_during_capture():
    lengths, n, r2t = guard_inputs(40, "cpu")
    guard = ForwardStepGuard(CanaryCapacities(64, 4096, 10**6), device=DEVICE)
    outputs = list(guard.buffers.tensors().values())

    def plan() -> None:
        for _ in guard.plan_step(**lengths, req_to_token=r2t, num_tokens=n):
            pass

    message = refused_in_capture(plan, outputs)
    assert "Cannot copy between CPU and CUDA" not in message


@gpu
@pytest.mark.parametrize("bs,reqs,entries", [(150, 256, 4096), (6000, 8192, 10**6), (150, 256, 64)])
def test_item4_guard_device_lengths_fit_check_is_sync_free(bs, reqs, entries):
    """``plan_step`` on GPU lengths with ``num_tokens``, a step that fits: its check and its
    plan return behind queued GPU work with no sync, at 150 requests (one fixed-block launch)
    and at 6 000 (past the fixed block: the look-back, with its resident state). A
    ``num_tokens`` below the GPU lengths' sum (64) is taken as given, never checked against
    them: the step fits that count and is planned whole, its tokens that many."""
    lengths, n, r2t = guard_inputs(bs, DEVICE)
    n_given = min(n, entries)
    assert (n_given < n) == (entries == 64), n  # the (150, 256, 64) case understates it
    guard = ForwardStepGuard(CanaryCapacities(reqs, entries, 10**6), device=DEVICE)
    kw = dict(**lengths, req_to_token=r2t, num_tokens=n_given)
    for _ in guard.plan_step(**kw):  # compile outside the check
        pass
    poison_(*guard.buffers.tensors().values())
    planned = []
    host_s, total_s = seconds_behind_queued_work(lambda: planned.extend(guard.plan_step(**kw)))
    assert host_s < QUEUED_HOST_S < total_s, (host_s, total_s)
    ((sub, buffers),) = planned
    assert sub.req_pool_indices is lengths["req_pool_indices"]
    assert sub.tokens == slice(0, n_given)
    want = PlanCase(*lengths.values(), r2t, None, 0, 10**6, reqs, reqs + 1)
    expect_plan(want, buffers.tensors(), f"device lengths, bs {bs}")
