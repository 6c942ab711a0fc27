"""What one thread may do while another captures a CUDA graph, in each of torch's capture modes
(run on a GPU: ``python3 tests/gpu/capture_modes_probe.py``).

Each probe starts a capture on a second thread (``torch.cuda.graph(..., capture_error_mode=
mode)``), runs one operation on this thread's own stream meanwhile, then ends the capture and
replays it. One line a probe: whether this thread's operation raised, whether the capture
ended whole, and whether its replay gave the right values. ``docs/contract.md`` and
``tests/test_uploads_beside_a_capture.py`` rest on what it prints: in global mode CUDA refuses
another thread's allocation of new device memory and of pinned memory, new or reused from
torch's cache, and the capture is broken (an event query goes through); in ``thread_local``
and ``relaxed`` modes all go through.
"""

from __future__ import annotations

from collections.abc import Callable
from threading import Event, Thread

import torch

MODES = ("global", "thread_local", "relaxed")


def probe(name: str, op: Callable[[], object], mode: str, prep: Callable[[], object]) -> None:
    x = torch.zeros(8, device="cuda")
    graph, capturing, done, errors = torch.cuda.CUDAGraph(), Event(), Event(), []
    stream = torch.cuda.Stream()
    prep()

    def capture() -> None:
        try:
            with torch.cuda.graph(graph, stream=stream, capture_error_mode=mode):
                x.add_(1)
                capturing.set()
                done.wait(60)
                x.mul_(3)
        except BaseException as err:  # noqa: BLE001 (printed below)
            errors.append(repr(err)[:120])
        capturing.set()

    thread = Thread(target=capture)
    thread.start()
    capturing.wait(60)
    mine = "ok"
    try:
        with torch.cuda.stream(torch.cuda.Stream()):
            op()
    except BaseException as err:  # noqa: BLE001 (printed below)
        mine = repr(err)[:120]
    done.set()
    thread.join(60)
    replay = "-"
    if not errors:
        graph.replay()
        torch.cuda.synchronize()
        replay = str(x.tolist() == [3.0] * 8)
    print(f"[{mode}] {name}: this thread: {mine} | capture: {errors or 'whole'} | "
          f"replay right: {replay}", flush=True)  # fmt: skip


def warm_pinned() -> None:
    """A pinned block cached, its upload's event recorded: the next staging reuses it."""
    host = torch.empty(4096, dtype=torch.int64, pin_memory=True).fill_(1)
    torch.empty(4096, dtype=torch.int64, device="cuda").copy_(host, non_blocking=True)
    torch.cuda.synchronize()


def empty_host_cache() -> None:
    torch.cuda.synchronize()
    torch._C._host_emptyCache()


def main() -> None:
    print(torch.cuda.get_device_name(), "torch", torch.__version__, flush=True)
    for mode in MODES:
        probe(
            "device allocation, new memory",
            lambda: torch.empty(1 << 24, device="cuda").fill_(1),
            mode,
            torch.cuda.synchronize,
        )
        pinned = lambda: torch.empty(4096, dtype=torch.int64, pin_memory=True).fill_(1)  # noqa: E731
        probe("pinned allocation, the host cache emptied", pinned, mode, empty_host_cache)
        probe("pinned allocation, a cached block reused", pinned, mode, warm_pinned)
        probe("event query", lambda: torch.cuda.Event().query(), mode, torch.cuda.synchronize)


if __name__ == "__main__":
    main()
