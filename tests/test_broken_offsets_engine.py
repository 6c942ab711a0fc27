"""Offsets that break the CSR rules (``BROKEN_OFFSETS``) reaching a scatter the ways an engine
calls it: refilled in place under a CUDA graph captured on sound offsets, on a side stream, in
a pinned host tensor, on the second GPU with the first current, and through a compiled step
(``aot_eager`` on the CPU, inductor on a GPU). Each way the promise of
``test_broken_offsets.py`` holds on a poisoned pool between guard rows: only the addressed
rows' first ``width`` columns change, each to ``flat_in[offsets[r] + c]`` for the request
``r`` naming the row (``check_broken_offsets_writes``), and sound offsets refilled afterwards
give the reference's bytes again."""

from __future__ import annotations

import pytest
import torch
from conftest import capture_graph, gpu, two_gpus
from test_broken_offsets import RPI, WIDTH, broken_call
from test_engine_safety import cuda0_untouched
from test_engine_safety_compile import BACKEND
from torch._dynamo.testing import CompileCounterWithBackend

from kvcanary_dispatch import SCATTER_STRATEGIES, scatter_req_token_ids
from kvcanary_dispatch.testing.cases import POISON_I32
from kvcanary_dispatch.testing.scatter_inputs import BROKEN_OFFSETS, check_broken_offsets_writes
from kvcanary_kernels import scatter_req_token_ids_ref

SOUND = [0, 6, 6, 12]  # a CSR of 3 runs over the 12 tokens, each run within the width of 6
# loop with device offsets reads them back: refused under capture (test_engine_safety item 2)
CAPTURABLE = [s for s in SCATTER_STRATEGIES if s != "loop"]


def _chunk(strategy: str) -> int | None:
    return 2 if strategy in ("loop", "sliced") else None  # slices of 2 requests


def _refill_and_check(kw: dict, big: torch.Tensor, run) -> None:
    """For every ``BROKEN_OFFSETS`` list, then ``SOUND``: the list copied into ``kw``'s
    offsets in place, ``big`` poisoned, ``run()``, and the promise checked; on ``SOUND``,
    ``big`` also equal to the reference's on a poisoned copy, byte for byte."""
    for offsets in [*BROKEN_OFFSETS.values(), SOUND]:
        kw["offsets"].copy_(torch.tensor(offsets, dtype=torch.int64))
        big.fill_(POISON_I32)
        run()
        if big.is_cuda:
            torch.cuda.synchronize(big.device)
        check_broken_offsets_writes(big, RPI, offsets, kw["flat_in"], width=WIDTH)
    want = torch.full_like(big, POISON_I32)
    on_device = kw["offsets"].to(kw["flat_in"].device)  # the reference wants one device
    scatter_req_token_ids_ref(**{**kw, "offsets": on_device, "pool_out": want[1:-1, :WIDTH]})
    assert torch.equal(big, want), (big.tolist(), want.tolist())


@gpu
@pytest.mark.parametrize("strategy", CAPTURABLE)
def test_broken_offsets_refilled_under_a_captured_graph(strategy):
    """Captured once on ``SOUND``, replayed on each broken list refilled in place: the kernels
    bound themselves on the offsets they read at replay, with nothing decided on the host."""
    kw, big = broken_call(SOUND, 12)
    call = lambda: scatter_req_token_ids(**kw, strategy=strategy, chunk_size=_chunk(strategy))  # noqa: E731
    graph = capture_graph(call)
    _refill_and_check(kw, big, graph.replay)


@gpu
@pytest.mark.parametrize("strategy", SCATTER_STRATEGIES)
def test_broken_offsets_on_a_side_stream(strategy):
    """Called on a side stream that waited for the refill, checked after it finishes."""
    kw, big = broken_call(SOUND, 12)
    side = torch.cuda.Stream()

    def on_the_side() -> None:
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            scatter_req_token_ids(**kw, strategy=strategy, chunk_size=_chunk(strategy))
        side.synchronize()

    _refill_and_check(kw, big, on_the_side)


@gpu
@pytest.mark.parametrize("strategy", SCATTER_STRATEGIES)
def test_broken_offsets_from_a_pinned_host_tensor_refilled(strategy):
    """Offsets staged in one pinned host tensor that the engine refills before each call (the
    call copies them; ``loop`` also splits its slices on them on the host)."""
    kw, big = broken_call(SOUND, 12)
    kw["offsets"] = kw["offsets"].cpu().pin_memory()
    call = lambda: scatter_req_token_ids(**kw, strategy=strategy, chunk_size=_chunk(strategy))  # noqa: E731
    _refill_and_check(kw, big, call)


@two_gpus
@pytest.mark.parametrize("strategy", SCATTER_STRATEGIES)
def test_broken_offsets_on_the_second_gpu(strategy):
    """Every tensor on ``cuda:1`` while ``cuda:0`` stays current and gets no allocation."""
    kw, big = broken_call(SOUND, 12, device="cuda:1")
    with cuda0_untouched():
        call = lambda: scatter_req_token_ids(**kw, strategy=strategy, chunk_size=_chunk(strategy))  # noqa: E731
        _refill_and_check(kw, big, call)


@pytest.mark.parametrize("strategy", SCATTER_STRATEGIES)
def test_broken_offsets_through_a_compiled_step(strategy):
    """One compiled step (``fullgraph``), called on each list: the same shapes, so no
    recompile, and the values reach the kernels as they are."""
    torch._dynamo.reset()
    kw, big = broken_call(SOUND, 12)
    counter = CompileCounterWithBackend(BACKEND)
    step = torch.compile(
        lambda **k: scatter_req_token_ids(**k, strategy=strategy, chunk_size=_chunk(strategy)),
        fullgraph=True,
        backend=counter,
    )
    _refill_and_check(kw, big, lambda: step(**kw))
    assert counter.frame_count == 1, counter.frame_count
