"""The plan look-back's state buffer, kept per device and stream between calls: each launch
leaves it as it found it, streams never share one, and a call captured in a CUDA graph takes
a fresh one, so eager calls, side streams and graph replays in any order stay exact."""

from __future__ import annotations

import contextlib
import threading
from types import SimpleNamespace

import pytest
import torch
from _helpers import lookback_states, plan_case_at_total
from conftest import DEVICE, GPU, capture_graph

import kvcanary_dispatch.plan as kplan
import kvcanary_dispatch.resident as resident
import kvcanary_kernels._launch as fast
from kvcanary_dispatch import plan_offsets
from kvcanary_dispatch.resident import buffers, cuda_stream_buffer, release, stream_buffer
from kvcanary_dispatch.testing.cases import assert_bytes_equal
from kvcanary_dispatch.testing.engine_steps import poison_
from kvcanary_dispatch.testing.launches import record_launches
from kvcanary_kernels import plan_offsets_ref
from kvcanary_kernels.args import bundle_plan_args, plan_keywords
from kvcanary_kernels.plan_lookback import UNSET, lookback_state_words, new_lookback_state

WIDTH = 16
CHUNK = 64


def _case(bs: int, seed: int):
    shape = dict(width=WIDTH, lut_len=2 * WIDTH, swa_window_size=5, spare=(3, 2))
    return plan_case_at_total(bs, seed, extend=(-1, 6), pad_p=0.2, device=DEVICE, **shape)


def _poisoned(case) -> dict:
    outs = case.fresh_outputs()
    poison_(*outs.values())
    return outs


def _check(case, outs: dict, what: str) -> None:
    want = case.fresh_outputs()
    plan_offsets_ref(**case.inputs(), **want)
    for name, t in want.items():
        assert_bytes_equal(outs[name], t, f"{name}, {what}")


def _lookback(case, outs: dict) -> None:
    plan_offsets(**case.inputs(), **outs, chunk_size=CHUNK, strategy="lookback")


def test_each_launch_re_arms_the_buffer_it_reuses():
    """Calls of growing and shrinking batches on one stream reuse one buffer (replaced only
    when too small) and leave every word of it unset."""
    release()
    previous, replaced = None, []
    for k, bs in enumerate((200, 700, 130, 700, 1500, 65)):
        case = _case(bs, k)
        outs = _poisoned(case)
        _lookback(case, outs)
        _check(case, outs, f"call {k}, bs {bs}")
        (buffer,) = lookback_states()
        words = lookback_state_words(-(-bs // CHUNK))
        assert buffer.shape[0] >= words
        if previous is not None and previous.shape[0] >= words:
            assert buffer is previous, f"call {k} replaced a buffer large enough for it"
        elif previous is not None:
            replaced.append(k)
        previous = buffer
        assert bool((buffer == UNSET).all()), f"state not re-armed after call {k}"
    assert replaced, "no call outgrew the buffer: the sizes no longer test a replacement"


@pytest.mark.parametrize("slices", [1, 3, 7, 15])
def test_the_look_back_writes_inside_its_state(slices, monkeypatch):
    """A state exactly as long as a launch uses (``2 + 2 * slices`` words, a power of two, so
    the kept buffer has no spare word) is followed in memory by guard words that the launch
    leaves alone: its re-arm stops at the last word it used."""
    release()
    assert lookback_state_words(slices) & (lookback_state_words(slices) - 1) == 0  # premise
    made = []

    def carved(like: torch.Tensor):
        def make(words: int) -> torch.Tensor:
            whole = new_lookback_state(like, words + 4)
            whole[words:] = 12345  # the guard: not UNSET, which a stray re-arm would write
            made.append((whole, words))
            return whole[:words]

        return make

    monkeypatch.setattr(kplan, "_state_maker", carved)
    case = _case(slices * CHUNK, slices)
    outs = _poisoned(case)
    _lookback(case, outs)
    _check(case, outs, f"{slices} slices")
    ((whole, words),) = made
    assert words == lookback_state_words(slices)
    assert whole[words:].tolist() == [12345] * 4, "the look-back wrote past its state"
    assert bool((whole[:words] == UNSET).all())
    release()


def test_inference_mode_and_back_share_the_buffer():
    """Steps alternating between ``torch.inference_mode``, plain calls and ``torch.no_grad``
    (an engine warmed up under one and serving under another) reuse the state the first made
    under inference mode, and each result is exact."""
    release()
    modes = (torch.inference_mode, contextlib.nullcontext, torch.no_grad, torch.inference_mode)
    first = None
    for k, mode in enumerate((*modes, contextlib.nullcontext)):
        case = _case(700, k)
        with mode():
            outs = _poisoned(case)
            _lookback(case, outs)
        _check(case, outs, f"call {k} under {mode.__name__}")
        (buffer,) = lookback_states()
        first = buffer if first is None else first
        assert buffer is first and buffer.is_inference()  # made under inference mode, kept
        assert bool((buffer == UNSET).all()), f"state not re-armed after call {k}"


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="batches of up to a million requests: GPU only")
def test_eager_auto_looks_back_at_every_size_on_one_buffer():
    """plan_offsets auto, eagerly, one call after another on the current stream at batch sizes
    that take each of its look-back slice sizes (256 to 2 048 requests), growing and shrinking
    the slice count: every call exact, one look-back launch each, the buffer re-armed after
    each."""
    release()
    for k, bs in enumerate((131073, 1048576, 262145, 524288, 131072, 5000, 1048575, 300000)):
        case = _case(bs, 90 + k)
        outs = _poisoned(case)
        with record_launches() as launches:
            plan_offsets(**case.inputs(), **outs)
        assert [la.kind for la in launches] == ["plan_lookback"], (bs, launches)
        torch.cuda.synchronize()
        _check(case, outs, f"auto call {k}, bs {bs}")
        (buffer,) = lookback_states()
        assert bool((buffer == UNSET).all()), f"state not re-armed after auto call {k}"


@pytest.mark.skipif(not GPU, reason="streams and graphs need a GPU")
def test_streams_keep_buffers_of_their_own():
    """Two streams plan at once, many calls each, never synchronised with each other: each
    has its own buffer and every call is exact."""
    release()
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    cases = [[_case(3000 + 17 * k + s, 10 * k + s) for k in range(12)] for s in range(2)]
    outs = [[_poisoned(c) for c in row] for row in cases]
    torch.cuda.synchronize()
    for k in range(12):
        for s, stream in enumerate(streams):
            with torch.cuda.stream(stream):
                _lookback(cases[s][k], outs[s][k])
    torch.cuda.synchronize()
    for s in range(2):
        for k in range(12):
            _check(cases[s][k], outs[s][k], f"stream {s}, call {k}")
    buffers = lookback_states()
    assert len(buffers) == 2 and buffers[0].data_ptr() != buffers[1].data_ptr()
    assert all(bool((b == UNSET).all()) for b in buffers)


@pytest.mark.skipif(not GPU, reason="streams and graphs need a GPU")
@pytest.mark.parametrize("strategy,chunk", [("lookback", CHUNK), ("auto", None)])
def test_a_captured_call_takes_a_fresh_buffer(strategy, chunk, monkeypatch):
    """A call captured in a CUDA graph adds no resident buffer (explicit lookback fills a
    fresh state; auto scans); the graph's replays, on a side stream, interleave with eager
    look-backs on the current stream, all exact."""
    release()
    bs = 2500 if chunk else 6000  # auto: past AUTO_PLAN_RECOUNT_MAX_BS
    case = _case(bs, 0)
    outs = _poisoned(case)

    def step():
        plan_offsets(**case.inputs(), **outs, chunk_size=chunk, strategy=strategy)

    seen = []  # per buffer lookup (either path): whether the current stream was capturing

    def spy(lookup):
        def looked_up(*args, **kwargs):
            seen.append(torch.cuda.is_current_stream_capturing())
            return lookup(*args, **kwargs)

        return looked_up

    monkeypatch.setattr(kplan, "stream_buffer", spy(stream_buffer))
    monkeypatch.setattr(kplan, "cuda_stream_buffer", spy(cuda_stream_buffer))
    graph = capture_graph(step)  # an eager warm-up call on a side stream, then the capture
    assert len(buffers()) == 1  # the warm-up's; the capture added none
    assert seen and not any(seen), "a resident buffer was asked for while capturing"
    side = torch.cuda.Stream()
    for seed in (1, 2, 3):
        new = _case(bs, seed)
        case.refill_from(new)
        poison_(*outs.values())
        eager = [_case(bs + 100 + seed, 50 + seed) for _ in range(2)]
        eager_outs = [_poisoned(c) for c in eager]
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            graph.replay()
        _lookback(eager[0], eager_outs[0])  # the current stream, while the replay may run
        _lookback(eager[1], eager_outs[1])
        torch.cuda.synchronize()
        _check(case, outs, f"replay {seed}")
        for c, o in zip(eager, eager_outs, strict=True):
            _check(c, o, f"eager call beside replay {seed}")
    assert all(bool((b == UNSET).all()) for b in lookback_states())


@pytest.mark.skipif(not GPU, reason="Triton's CPU interpreter is not thread-safe")
def test_threads_keep_buffers_of_their_own():
    """Host threads planning at once on the current stream each get a buffer of their own
    (one stream handle may stand for a stream per thread), and every call is exact."""
    release()
    cases = [[_case(300 + 7 * k + t, 20 * k + t) for k in range(3)] for t in range(2)]
    outs = [[_poisoned(c) for c in row] for row in cases]
    errors: list[BaseException] = []
    kept: list[torch.Tensor] = []  # each thread's state, held past the thread's end
    both_planned = threading.Barrier(2, timeout=60)

    def work(t: int) -> None:
        try:
            for case, out in zip(cases[t], outs[t], strict=True):
                _lookback(case, out)
            kept.extend(lookback_states())
            both_planned.wait()  # both threads hold their buffers at once
        except BaseException as err:  # re-raised in the main thread
            errors.append(err)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors
    torch.cuda.synchronize()
    for t in range(2):
        for k in range(3):
            _check(cases[t][k], outs[t][k], f"thread {t}, call {k}")
    assert len(kept) == 2 and kept[0].data_ptr() != kept[1].data_ptr() and lookback_states() == []


def test_stream_buffer_is_the_calling_threads():
    """The buffers are the calling thread's: a thread asking for the same name, device and
    size gets a buffer of its own, and the other threads never see it."""
    release()
    mine = stream_buffer("probe", torch.device(DEVICE), 4, lambda n: torch.zeros(n))
    theirs: list = []
    thread = threading.Thread(
        target=lambda: theirs.extend(
            [stream_buffer("probe", torch.device(DEVICE), 4, lambda n: torch.ones(n)), buffers()]
        )
    )
    thread.start()
    thread.join()
    assert theirs[0] is not mine and list(theirs[1].values()) == [theirs[0]]
    assert list(buffers().values()) == [mine]
    release()


def test_stream_buffer_keys_and_growth():
    """A device named without an index is the current one; a buffer is reused while large
    enough and replaced, by the next power of two, when a call needs more."""
    release()
    made = []

    def make(n: int) -> torch.Tensor:
        made.append(n)
        return torch.zeros(n, device=DEVICE)

    plain = torch.device(DEVICE)  # "cuda": the current device
    indexed = torch.device(DEVICE, torch.cuda.current_device()) if GPU else plain
    first = stream_buffer("probe", plain, 5, make)
    assert stream_buffer("probe", indexed, 8, make) is first and made == [8]
    grown = stream_buffer("probe", plain, 9, make)
    assert grown is not first and made == [8, 16] and grown.shape[0] == 16
    assert stream_buffer("other", plain, 1, make) is not grown and len(buffers()) == 2


def test_cuda_stream_buffer_is_the_streams_buffer(monkeypatch):
    """The one pass's lookup (a CUDA index and the stream read once) finds the buffer
    ``stream_buffer`` keeps for that device and stream, hands back that stream's handle, and
    keeps a buffer per stream."""
    release()
    current = [7]  # device 0's current stream; device d's is current[0] + 100 * d
    monkeypatch.setattr(resident, "current_stream_handle", lambda index: current[0] + 100 * index)
    made = []

    def make(n: int) -> torch.Tensor:
        made.append(n)
        return torch.zeros(n)

    cuda0 = torch.device("cuda", 0)
    state, stream = cuda_stream_buffer("probe", 0, 5, make)
    assert stream == 7 and made == [8] and stream_buffer("probe", cuda0, 8, make) is state
    assert cuda_stream_buffer("probe", 0, 3, make) == (state, 7) and made == [8]
    on_1, stream = cuda_stream_buffer("probe", 1, 3, make)  # another device: its own stream
    assert on_1 is not state and stream == 107 and buffers()[("probe", 1, 107)] is on_1
    assert stream_buffer("probe", torch.device("cuda", 1), 3, make) is on_1
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert stream_buffer("probe", torch.device("cuda"), 3, make) is on_1  # unindexed: current
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    current[0] = 9
    other, stream = cuda_stream_buffer("probe", 0, 5, make)
    assert stream == 9 and other is not state and stream_buffer("probe", cuda0, 1, make) is other
    grown, _ = cuda_stream_buffer("probe", 0, 9, make)
    assert grown is not other and grown.shape[0] == 16 and len(buffers()) == 3
    release()


def test_current_stream_handle_is_the_given_devices(monkeypatch):
    """The handle of device ``index``'s current stream, as torch gives it (on a GPU, on the
    default stream and on a side stream), read from the device asked for, not the current."""
    if GPU:
        index = torch.cuda.current_device()
        side = torch.cuda.Stream()
        for stream in (torch.cuda.current_stream(), side):
            with torch.cuda.stream(stream):
                handle = resident.current_stream_handle(index)
                assert handle == torch.cuda.current_stream(index).cuda_stream == stream.cuda_stream
    active = SimpleNamespace(get_current_stream=lambda index: 1000 + index)
    monkeypatch.setattr(resident, "driver", SimpleNamespace(active=active))
    assert [resident.current_stream_handle(i) for i in (0, 3)] == [1000, 1003]


def test_a_call_planned_as_captured_keeps_no_buffer(monkeypatch):
    """While the stream captures, auto scans and an explicit look-back fills a fresh state:
    no resident buffer is made or used."""
    release()
    monkeypatch.setattr(kplan, "capturing", lambda device: True)
    for strategy, chunk, kind in (("auto", None, "plan_scan"), ("lookback", CHUNK, None)):
        case = _case(4500, 3)
        outs = _poisoned(case)
        with record_launches() as launches:
            plan_offsets(**case.inputs(), **outs, chunk_size=chunk, strategy=strategy)
        assert [la.kind for la in launches] == [kind or "plan_lookback"]
        _check(case, outs, f"{strategy} planned as captured")
        assert buffers() == {}


def test_the_compile_op_keeps_no_buffer():
    """The torch.compile op (a CUDA-graph tree's warm-up runs it eagerly, its allocations in
    the graph's pool) plans as a captured call."""
    release()
    case = _case(4500, 4)
    outs = _poisoned(case)
    i, o = bundle_plan_args({**case.inputs(), **outs})
    args = plan_keywords(i, o).values()
    torch.ops.kvcanary_dispatch.plan_offsets(*args, CHUNK, "lookback", False)
    _check(case, outs, "lookback through the custom op")
    outs = _poisoned(case)  # auto's own outputs, so that what it leaves unwritten shows
    i, o = bundle_plan_args({**case.inputs(), **outs})
    torch.ops.kvcanary_dispatch.plan_offsets(*plan_keywords(i, o).values(), None, "auto", False)
    _check(case, outs, "auto through the custom op")
    assert buffers() == {}


@pytest.mark.parametrize(
    "path",
    [
        "full",
        pytest.param(
            "one pass",
            marks=[pytest.mark.gpu, pytest.mark.skipif(not GPU, reason="needs a CUDA device")],
        ),
    ],
)
def test_a_failed_launch_drops_its_buffer(monkeypatch, path):
    """A launch that stops part-way (the CPU interpreter interrupted) may leave its state
    dirty: the call drops it, and the next call starts from a clean one. On both paths: the
    full path's launcher and the one pass's launch (eager calls on a GPU take the one pass)."""
    release()
    case = _case(900, 5)
    _lookback(case, _poisoned(case))
    (first,) = lookback_states()

    def stops_part_way(state: torch.Tensor):
        state[:5] = 7
        raise KeyboardInterrupt

    with monkeypatch.context() as m:
        if path == "full":
            m.setattr(kplan, "_launched", lambda *args: False)
            m.setitem(
                kplan._LAUNCHERS,
                "plan_lookback",
                lambda *args, state, **kw: stops_part_way(state),
            )
        else:
            m.setattr(fast.BoundKernel, "checked", lambda self, *a: stops_part_way(a[2][-1]))
        with pytest.raises(KeyboardInterrupt):
            _lookback(case, _poisoned(case))
    assert lookback_states() == []
    outs = _poisoned(case)
    _lookback(case, outs)
    _check(case, outs, "the call after a failed one")
    (second,) = lookback_states()
    assert second is not first and bool((second == UNSET).all())
