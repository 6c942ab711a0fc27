"""A call made while another thread captures a CUDA graph: what it raised, whether the capture
ended whole and whether its graph replays right (shared by the GPU tests and
``tests/gpu/capture_modes_probe.py``; torch only)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from threading import Event, Thread

import torch


@dataclass
class BesideACapture:
    """What happened when ``call()`` ran while another thread captured a graph: the error
    ``call()`` raised (``None`` if none), the capturing thread's errors, and whether the graph
    replayed right (``None`` when the capture failed, so nothing was replayed)."""

    call_error: BaseException | None
    capture_errors: list[BaseException]
    replay_right: bool | None


def call_beside_a_capture(
    call: Callable[[], object], mode: str = "global", stream: torch.cuda.Stream | None = None
) -> BesideACapture:
    """``call()`` on a stream of its own (an engine thread's) while another thread captures a
    CUDA graph (``x += 1`` then ``x *= 3`` on 8 zeros) in capture mode ``mode`` on ``stream``
    (a new one by default); the capture ended, and replayed if it ended whole."""
    x = torch.zeros(8, device="cuda")
    graph, capturing, done, errors = torch.cuda.CUDAGraph(), Event(), Event(), []
    stream = torch.cuda.Stream() if stream is None else stream

    def capture() -> None:
        try:
            with torch.cuda.graph(graph, stream=stream, capture_error_mode=mode):
                x.add_(1)
                capturing.set()
                if not done.wait(timeout=60):
                    raise TimeoutError("the call beside the capture took over 60 s")
                x.mul_(3)
        except BaseException as err:  # noqa: BLE001 (reported to the calling thread)
            errors.append(err)
        capturing.set()

    thread = Thread(target=capture)
    thread.start()
    call_error = None
    try:
        if not capturing.wait(timeout=60):
            raise TimeoutError("the capture did not start within 60 s")
        with torch.cuda.stream(torch.cuda.Stream()):
            call()
    except BaseException as err:  # noqa: BLE001 (returned)
        call_error = err
    finally:
        done.set()
        thread.join(timeout=60)
    if errors:
        return BesideACapture(call_error, errors, None)
    graph.replay()
    torch.cuda.synchronize()
    return BesideACapture(call_error, errors, x.tolist() == [3.0] * 8)


def beside_a_capture(
    call: Callable[[], object], mode: str = "global", stream: torch.cuda.Stream | None = None
) -> None:
    """``call_beside_a_capture``, asserted: ``call()`` raised nothing, the capture ended
    without an error, and its graph replays right."""
    seen = call_beside_a_capture(call, mode, stream)
    if seen.call_error is not None:
        raise seen.call_error
    assert not seen.capture_errors, seen.capture_errors
    assert seen.replay_right, "the graph captured beside the call replayed wrong values"
