"""The benchmarks (not installed; ``python -m benchmarks.suite|distributions|plan_sizes`` from
the repository root). They measure with ``kvcanary_dispatch.cli``'s harness and write its
results schema; the library never imports this package."""

from __future__ import annotations

import os
import sys


def interpreter_off_gpu() -> None:
    """Before any kernel module is imported: switch Triton's interpreter on when the run is on
    the CPU (``--device cpu``, or no CUDA device)."""
    import torch

    args = sys.argv[1:]
    on_cpu = "--device=cpu" in args or any(
        a == "--device" and b == "cpu" for a, b in zip(args, args[1:], strict=False)
    )
    if on_cpu or not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
