"""The benchmarks (not installed; ``python -m benchmarks.suite|distributions|plan_sizes`` from
the repository root). They measure with ``kvcanary_dispatch.cli``'s harness and write its
results schema; the library never imports this package."""

from __future__ import annotations

import os
import sys


def interpreter_off_gpu(module: str) -> None:
    """Called by a benchmark with its ``__name__`` before it imports any kernel module: when it
    runs as a script (``module == "__main__"``) and the run is on the CPU (``--device cpu``, or
    no CUDA device), switch Triton's interpreter on. Imported as a module, it changes nothing."""
    if module != "__main__":
        return
    import torch

    args = sys.argv[1:]
    on_cpu = "--device=cpu" in args or any(
        a == "--device" and b == "cpu" for a, b in zip(args, args[1:], strict=False)
    )
    if on_cpu or not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
