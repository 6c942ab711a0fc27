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

import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/: its _capture
from _capture import call_beside_a_capture  # noqa: E402

MODES = ("global", "thread_local", "relaxed")


def probe(name: str, op: Callable[[], object], mode: str, prep: Callable[[], object]) -> None:
    prep()
    seen = call_beside_a_capture(op, mode)
    mine = "ok" if seen.call_error is None else repr(seen.call_error)[:120]
    capture = [repr(err)[:120] for err in seen.capture_errors] or "whole"
    replay = "-" if seen.replay_right is None else str(seen.replay_right)
    print(f"[{mode}] {name}: this thread: {mine} | capture: {capture} | replay right: {replay}",
          flush=True)  # fmt: skip


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
