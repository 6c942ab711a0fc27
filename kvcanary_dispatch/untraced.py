"""The eager path's functions kept out of dynamo's reach.

Under ``torch.compile`` the public functions call their custom ops (``kvcanary_dispatch.ops``)
and never reach their eager path. Dynamo reaches it in one case: after an exception met while
it traced a frame (a refusal, with ``fullgraph=False``), it runs that frame eagerly from then
on and compiles the frames it calls one by one, this library's eager path among them, which
it cannot compile (torch 2.11 on an H100: ``InternalTorchDynamoError`` from FX's code
generation for the plan's one-pass launch; on the CPU: Triton's interpreter). The functions
registered with ``eager_only`` are marked for dynamo to run untraced, with everything they
call, once dynamo is loaded: ``keep_untraced`` marks them, at the first eager call after
``torch._dynamo`` is imported (``PENDING[0]`` until then; a list, so that the callers read
it without a function call). Without dynamo's per-code strategies (an older torch) nothing is
marked.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from typing import TypeVar

_F = TypeVar("_F", bound=Callable)
_EAGER_ONLY: list[Callable] = []
PENDING = [True]  # no function marked yet (callers test PENDING[0] before keep_untraced())
_LOCK = threading.Lock()  # one thread marks; PENDING[0] turns False once every mark is set


def eager_only(fn: _F) -> _F:
    """Register ``fn``, a function reached only outside dynamo's tracing, to be marked."""
    _EAGER_ONLY.append(fn)
    return fn


def keep_untraced() -> None:
    """Mark every ``eager_only`` function for dynamo to skip, with the frames it calls, once
    ``torch._dynamo`` is loaded (nothing before: importing it would cost the caller most of a
    second); ``PENDING[0]`` turns False only once every mark is set, under a lock, so a
    thread that finds it False never enters an unmarked function. Marks made stay through
    ``torch._dynamo.reset()`` (which resets only code dynamo has compiled, and dynamo never
    compiles a marked function)."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    if eval_frame is None:
        return
    with _LOCK:  # a caller that sees PENDING[0] False finds every function marked
        if not PENDING[0]:
            return
        try:
            from torch._dynamo.types import FrameAction, FrameExecStrategy

            skip = FrameExecStrategy(FrameAction.SKIP, FrameAction.SKIP)  # the frame and below
            for fn in _EAGER_ONLY:
                eval_frame.set_code_exec_strategy(fn.__code__, skip)
        except (ImportError, AttributeError):  # a torch without per-code strategies
            pass
        PENDING[0] = False
