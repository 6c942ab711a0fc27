"""Device buffers kept from call to call, one per device and stream, in each host thread.

A launch that leaves its buffer as it found it (the plan look-back's state) need not fill a
fresh one per call: it can reuse one buffer for every launch ordered after the last, that is,
on the same stream. ``stream_buffer`` keeps such a buffer per (name, device, current stream) in
the calling thread, made once by the caller's ``make`` and replaced by a larger one when a call
needs more. Buffers are per thread because one stream handle can stand for a stream per thread
(CUDA's per-thread default stream); they are freed with their thread or by ``release``. Their
size is the caller's: the plan look-back keeps ``2 + 2 * n_slices`` int64 words, rounded up to
a power of two, for the most slices a call on that stream has had.

A stream's buffer must not be handed to a launch that may overlap its later launches: a
launch recorded in a CUDA graph (a replay may run anywhere), or one made under ``torch.compile``
(a CUDA-graph tree's warm-up runs it eagerly, its allocations routed to the graph's memory
pool). Those launches take a fresh buffer. A launch that fails after ``stream_buffer`` may have
left the buffer changed: ``discard`` drops it. Not covered: a stream handle that CUDA hands to
a new stream while launches on the destroyed one are still running.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch
from triton.runtime import driver

_LOCAL = threading.local()  # .buffers: (name, CUDA index or None, stream handle) -> buffer


def buffers() -> dict[tuple[str, int | None, int], torch.Tensor]:
    """The calling thread's buffers, by (name, CUDA device index or ``None`` for the CPU,
    stream handle)."""
    try:
        return _LOCAL.buffers
    except AttributeError:
        _LOCAL.buffers = {}
        return _LOCAL.buffers


def current_stream_handle(index: int) -> int:
    """The handle (``cudaStream_t``) of CUDA device ``index``'s current stream, as torch's
    ``current_stream(index).cuda_stream`` gives it, without building a ``Stream`` object."""
    return driver.active.get_current_stream(index)


def _key(name: str, device: torch.device) -> tuple[str, int | None, int]:
    if device.type != "cuda":
        return (name, None, 0)
    index = torch.cuda.current_device() if device.index is None else device.index
    return (name, index, current_stream_handle(index))


def stream_buffer(
    name: str, device: torch.device, size: int, make: Callable[[int], torch.Tensor]
) -> torch.Tensor:
    """The calling thread's buffer ``name`` for ``device``'s current stream, at least ``size``
    elements long (``make(n)`` builds one of ``n`` elements, in the state the launches leave
    it in). Call it with ``device`` current, never for a launch that may overlap the stream's
    later ones (module docstring). On the CPU (kernels run in the calling thread) one buffer
    serves the thread."""
    return _kept(_key(name, device), size, make)


def cuda_stream_buffer(
    name: str, index: int, size: int, make: Callable[[int], torch.Tensor]
) -> tuple[torch.Tensor, int]:
    """``stream_buffer`` for CUDA device ``index``, the current device (a caller that has
    checked that need not build a ``torch.device``), and the handle of the stream the buffer
    belongs to, for the caller's launch to go to."""
    stream = current_stream_handle(index)
    return _kept((name, index, stream), size, make), stream


def _kept(
    key: tuple[str, int | None, int], size: int, make: Callable[[int], torch.Tensor]
) -> torch.Tensor:
    kept = buffers()
    buffer = kept.get(key)
    if buffer is None or buffer.shape[0] < size:
        # Sized to the next power of two: a growing batch reallocates a few times at most.
        buffer = kept[key] = make(1 << (size - 1).bit_length())
    return buffer


def discard(name: str, device: torch.device) -> None:
    """Drop the calling thread's buffer ``name`` for ``device``'s current stream (after a
    launch that failed and may not have left it as it found it)."""
    buffers().pop(_key(name, device), None)


def release() -> None:
    """Drop every buffer of the calling thread (each is freed once no tensor refers to it)."""
    buffers().clear()
