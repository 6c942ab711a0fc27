"""Device buffers kept from call to call, one per device, stream and host thread.

A launch that leaves its buffer as it found it (the plan look-back's state) need not fill a
fresh one per call: it can reuse one buffer for every launch ordered after the last, that is,
on the same stream. ``stream_buffer`` keeps such a buffer per (name, device, current stream,
calling thread), made once by the caller's ``make`` and replaced by a larger one when a call
needs more. The thread is part of the key because one stream handle can stand for a stream per
thread (CUDA's per-thread default stream). A stream's buffer is never handed out while the stream is
capturing a CUDA graph: a replay may run anywhere, concurrently with the stream's later
launches, so a captured launch takes a fresh buffer of its own. Not covered: a stream handle
that CUDA hands to a new stream while launches on the destroyed one are still running.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch
from triton.runtime import driver

# (name, CUDA device index or None for the CPU, stream handle, thread) -> buffer
_BUFFERS: dict[tuple[str, int | None, int, int], torch.Tensor] = {}
_thread = threading.get_ident


def stream_buffer(
    name: str, device: torch.device, size: int, make: Callable[[int], torch.Tensor]
) -> torch.Tensor:
    """The buffer ``name`` of ``device``'s current stream, at least ``size`` elements long
    (``make(n)`` builds one of ``n`` elements, in the state the launches leave it in). Call it
    with ``device`` current and never while its stream is capturing (``placement.capturing``).
    On the CPU (kernels run in the calling thread) one buffer serves each thread."""
    if device.type == "cuda":
        index = torch.cuda.current_device() if device.index is None else device.index
        key = (name, index, driver.active.get_current_stream(index), _thread())
    else:
        key = (name, None, 0, _thread())
    buffer = _BUFFERS.get(key)
    if buffer is None or buffer.shape[0] < size:
        # Sized to the next power of two: a growing batch reallocates a few times at most.
        buffer = _BUFFERS[key] = make(1 << (size - 1).bit_length())
    return buffer
