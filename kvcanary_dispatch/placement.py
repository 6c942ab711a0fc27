"""Where a call runs and how host data reaches it: the rules every public function follows.

- **Device**: a call launches on its output tensors' device and that device's current stream,
  whatever device is current (a multi-GPU engine need not set it per call).
- **Host data**: a CPU tensor that must reach the GPU (scatter offsets, a guard's step lengths)
  is copied on the host, during the call, into private pinned staging, then uploaded
  asynchronously on the current stream. The caller may refill or free its own tensor (pinned or
  not) as soon as the call returns; the host never waits on queued GPU work for it.
- **Capture**: such an upload cannot be part of a CUDA graph (a replay would copy the staging
  of capture time), and neither can a device-to-host read; both are a ``ValueError`` naming
  the fix, raised before anything is recorded.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import sys
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TypeVar

import torch
from torch import Tensor

from kvcanary_kernels import INTERPRETED
from kvcanary_kernels._checks import PREFIX

CAPTURE_ERROR = "capturing a CUDA graph"  # every capture refusal contains these words


def on_device(device: torch.device) -> contextlib.AbstractContextManager:
    """A context that makes ``device`` current when it is a CUDA device other than the
    current one (no cost otherwise)."""
    if device.type == "cuda" and device.index is not None:
        if device.index != torch.cuda.current_device():
            return torch.cuda.device(device)
    return _SAME_DEVICE


_SAME_DEVICE = contextlib.nullcontext()  # reusable: it holds no state
_NO_DEVICE = torch.device("cpu")
_Made = TypeVar("_Made")
_FILL_STREAMS: dict[int, torch.cuda.Stream] = {}  # made_apart's, by CUDA device index


def made_apart(
    make: Callable[[], _Made],
    device: torch.device,
    tensors: Callable[[_Made], Iterable[Tensor]],
    what: str,
) -> _Made:
    """``make()``, with the device work it queues (a zero fill) run on a stream kept for it on
    CUDA ``device`` (``_fill_stream``), which the host then waits for: what it returns is
    ready for any stream, and any graph captured later, at once. The host waits for that
    stream alone (the fill, and any work other code queued on the same pooled stream), not for
    what other streams hold; allocating new device memory may wait longer. The allocation and
    the wait run in relaxed capture mode, so neither fails nor breaks a graph another thread
    is capturing (where the runtime's exchange cannot be loaded, in the thread's own mode). The
    ``tensors`` of what it returns are marked as used by the current stream
    (``record_stream``): once freed, their memory is not handed out again before the work
    queued there has run, and it stays cached for the fill stream (later calls reuse it). A
    ``RuntimeError`` naming ``what`` while ``device``'s current stream captures a graph (the
    memory would be the graph's, filled only on replay). On the CPU, ``make()``."""
    with on_device(device):
        if device.type != "cuda":
            return make()
        if capturing(device):
            raise RuntimeError(
                f"{PREFIX}{what} allocates and zero-fills its buffers, which cannot be done "
                f"while the stream is {CAPTURE_ERROR} (they would be the graph's memory, filled "
                "only on replay); do it before capturing"
            )
        index = torch.cuda.current_device()
        current = torch.cuda.current_stream(index)
        apart = _fill_stream(index)
        with torch.cuda.stream(apart), _relaxed_capture_mode():
            made = make()
            apart.synchronize()
        for t in tensors(made):
            t.record_stream(current)
    return made


def _fill_stream(index: int) -> torch.cuda.Stream:
    """``made_apart``'s stream on CUDA device ``index``: a high-priority stream of torch's pool
    (its default-priority pool also hands out ``torch.cuda.graph``'s capture stream), taken
    anew while the one kept is capturing a graph (another thread's, on the same pooled
    stream). Call it with device ``index`` current."""
    for _ in range(_POOL_STREAMS):
        stream = _FILL_STREAMS.get(index)
        if stream is not None:
            with torch.cuda.stream(stream):
                if not torch.cuda.is_current_stream_capturing():
                    return stream
        _FILL_STREAMS[index] = torch.cuda.Stream(index, priority=-1)
    raise RuntimeError(
        f"{PREFIX}every high-priority pooled stream of cuda:{index} is capturing a CUDA graph, "
        "so none can fill a guard's buffers; build or grow the guard outside those captures"
    )


_POOL_STREAMS = 32  # streams torch's pool holds per device and priority
_CAPTURE_MODE_RELAXED = 2  # CU_STREAM_CAPTURE_MODE_RELAXED


@contextlib.contextmanager
def _relaxed_capture_mode() -> Iterator[None]:
    """This thread's CUDA stream-capture mode relaxed for the block (``_capture_mode_exchange``)
    and given back after: an allocation or a host wait there is then allowed while another
    thread captures a graph in torch's default (global) mode, which otherwise refuses it and
    invalidates that capture. The thread's mode is left unchanged where the exchange cannot be
    loaded or refuses."""
    exchange = _capture_mode_exchange()
    mode = ctypes.c_int(_CAPTURE_MODE_RELAXED)
    exchanged = False
    try:
        exchanged = exchange is not None and exchange(ctypes.byref(mode)) == 0
        yield
    finally:
        if exchanged:
            exchange(ctypes.byref(mode))  # the thread's own mode back


@functools.cache
def _capture_mode_exchange() -> Callable[..., int] | None:
    """The thread's capture-mode exchange of the library torch runs on: the CUDA driver's
    ``cuThreadExchangeStreamCaptureMode`` (CUDA 10.1 on), or HIP's
    ``hipThreadExchangeStreamCaptureMode`` on a ROCm build (the same modes, relaxed = 2);
    ``None`` where that library or function cannot be loaded."""
    if torch.version.hip:
        libraries = (ctypes.util.find_library("amdhip64"), "libamdhip64.so")
        name = "hipThreadExchangeStreamCaptureMode"
    else:
        libraries = ("nvcuda.dll" if sys.platform == "win32" else "libcuda.so.1",)
        name = "cuThreadExchangeStreamCaptureMode"
    for library in filter(None, libraries):
        try:
            exchange = getattr(ctypes.CDLL(library), name)
            break
        except (OSError, AttributeError):
            continue
    else:
        return None
    exchange.argtypes = [ctypes.POINTER(ctypes.c_int)]
    exchange.restype = ctypes.c_int
    return exchange


def device_of(t: object) -> torch.device:
    """``t.device``, or the CPU for an argument without one (a ``None`` where a tensor belongs:
    the ordered checks then name it, unless they name another argument first)."""
    return getattr(t, "device", _NO_DEVICE)


def refuse_unlaunchable(device: torch.device, name: str) -> None:
    """A ``ValueError`` naming ``name`` when no kernel can run on ``device``: the meta device
    (such a tensor has no data for a kernel to read or write), or the CPU while the kernels
    are compiled for a GPU (CPU tensors run only in Triton's interpreter). Checked after the
    ordered checks (which put every tensor on one device), before any launch."""
    if device.type == "meta":
        raise ValueError(
            f"{PREFIX}{name} is a meta tensor, which holds no data for the kernels to read or "
            "write; pass CUDA tensors (or CPU tensors under TRITON_INTERPRET=1)"
        )
    if device.type == "cpu" and not INTERPRETED:
        raise ValueError(
            f"{PREFIX}{name} is a CPU tensor, but the kernels were defined for a GPU: CPU "
            "tensors run only in Triton's interpreter; pass CUDA tensors, or set "
            "TRITON_INTERPRET=1 before kvcanary_dispatch (or kvcanary_kernels) is first imported"
        )


def capturing(device: torch.device) -> bool:
    """Whether ``device``'s current stream is capturing a CUDA graph. Call it under
    ``on_device(device)``."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def refuse_capture(device: torch.device, what: str, fix: str) -> None:
    """A ``ValueError`` when ``device``'s current stream is capturing: ``what`` cannot be
    recorded in a CUDA graph; ``fix`` says what to pass instead."""
    if capturing(device):
        raise ValueError(
            f"{PREFIX}{what} while the stream is {CAPTURE_ERROR}: a graph cannot record it "
            f"(a replay would reuse capture-time data); {fix}"
        )


def upload_into(device_copy: torch.Tensor, host: torch.Tensor) -> None:
    """Fill ``device_copy`` (a GPU tensor of ``host``'s shape) with ``host`` (a CPU tensor):
    copied now into private pinned staging of ``device_copy``'s dtype (the only read of
    ``host``), then uploaded asynchronously on the current stream. The staging block is not
    reused before that copy completes (torch's pinned allocator records the copy's stream)."""
    staging = torch.empty(host.shape, dtype=device_copy.dtype, pin_memory=True)
    staging.copy_(host)
    device_copy.copy_(staging, non_blocking=True)


def upload_rows(rows: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """Equal-length 1-D CPU tensors as int64 rows of one ``device`` tensor: one staging copy
    per row, one upload for all (see ``upload_into``). Rows of other lengths are a ``ValueError``
    (a one-element row would otherwise be broadcast)."""
    n = int(rows[0].shape[0])
    if any(tuple(row.shape) != (n,) for row in rows):
        raise ValueError(
            f"{PREFIX}a forward step's request tensors must be 1-D and of one length, got "
            f"shapes {[tuple(row.shape) for row in rows]}; pass one entry per request in each"
        )
    staging = torch.empty((len(rows), n), dtype=torch.int64, pin_memory=True)
    for i, row in enumerate(rows):
        staging[i].copy_(row)
    return list(staging.to(device, non_blocking=True).unbind(0))


@dataclass(frozen=True)
class StreamFence:
    """Work queued on ``stream`` up to ``done`` (a guard's grow: ``on_grow``'s work, the
    step's lengths uploaded) that reads queued later, perhaps on another stream, must
    follow; ``tensors``, allocated there, are what those reads use."""

    tensors: tuple[torch.Tensor, ...]
    stream: torch.cuda.Stream
    done: torch.cuda.Event

    @classmethod
    def now(cls, tensors: tuple[torch.Tensor, ...], device: torch.device) -> StreamFence:
        """A fence past all that CUDA ``device``'s current stream holds now. Call under
        ``on_device(device)``."""
        stream = torch.cuda.current_stream(device)
        done = torch.cuda.Event()
        done.record(stream)
        return cls(tensors, stream, done)

    def order_reads(self, device: torch.device) -> None:
        """Make what the fence covers safe to read on ``device``'s current stream (not
        capturing): on another stream than the fence's, that stream waits for ``done`` on the
        device (the host does not wait) and the tensors are marked as used by it
        (``record_stream``), so their memory is not handed out before its reads have run."""
        stream = torch.cuda.current_stream(device)
        if stream != self.stream:
            stream.wait_event(self.done)
            for t in self.tensors:
                t.record_stream(stream)
