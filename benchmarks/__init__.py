"""The benchmarks (not installed; ``python -m benchmarks.suite|distributions|plan_sizes`` from
the repository root). They measure with ``kvcanary_dispatch.cli``'s harness and write its
results schema; the library never imports this package."""

from __future__ import annotations

import argparse
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


def checked_device(parser: argparse.ArgumentParser, name: str, what: str | None = None):
    """``--device name`` as a ``torch.device``; a parser error (exit 2) naming the fix for a
    name torch does not take, or a CUDA device where torch sees none (the message led by
    ``what``, by default ``--device name:``)."""
    what = f"--device {name}:" if what is None else what
    import torch

    try:
        device = torch.device(name)
    except RuntimeError as err:
        parser.error(f"{what} {err}")
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error(
            f"{what} torch sees no CUDA device (torch.cuda.is_available() is False); "
            "run it on a GPU machine (or, where the benchmark takes --device cpu, check its "
            "logic on the CPU: the interpreter's times say nothing of a GPU's)"
        )
    return device
