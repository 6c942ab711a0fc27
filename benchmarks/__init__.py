"""The benchmarks (not installed; ``python -m benchmarks.suite|distributions|plan_sizes`` from
the repository root). They measure with ``kvcanary_dispatch.cli``'s harness and write its
results schema; the library never imports this package."""

from __future__ import annotations

import argparse
import os
import sys


def interpreter_off_gpu(module: str) -> None:
    """Called by a benchmark with its ``__name__`` before it imports any kernel module: when it
    runs as a script (``module == "__main__"``) and the run is on the CPU (``--device cpu`` or
    ``cpu:N``, or no CUDA device), switch Triton's interpreter on. Imported as a module, it
    changes nothing."""
    if module != "__main__":
        return
    import torch

    args = sys.argv[1:]
    names = [a.removeprefix("--device=") for a in args if a.startswith("--device=")]
    names += [b for a, b in zip(args, args[1:], strict=False) if a == "--device"]
    on_cpu = any(name.split(":")[0] == "cpu" for name in names)
    if on_cpu or not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")


def checked_device(parser: argparse.ArgumentParser, name: str, *, cuda_only: bool = False):
    """``--device name`` as a ``torch.device`` (``kvcanary_dispatch.cli``'s own check): a
    parser error (exit 2) naming the fix for a name torch does not take, a CUDA device torch
    does not see, the CPU where the kernels were defined for a GPU, or, with ``cuda_only``
    (a benchmark that times CUDA launches), any device but a CUDA one."""
    import kvcanary_kernels
    from kvcanary_dispatch.cli.command import checked_torch_device
    from kvcanary_dispatch.cli.errors import CliError

    try:
        device = checked_torch_device(name)
    except CliError as err:
        parser.error(str(err))
    if cuda_only and device.type != "cuda":
        parser.error(f"--device {name}: it times CUDA launches; pass cuda or cuda:N")
    if device.type == "cpu" and not kvcanary_kernels.INTERPRETED:
        parser.error(
            f"--device {name} needs Triton's interpreter, but the kernels were defined for a "
            "GPU: set TRITON_INTERPRET=1 before they are imported (run the benchmark as "
            "python -m benchmarks.NAME, which sets it for --device cpu)"
        )
    return device


def require_cuda(parser: argparse.ArgumentParser) -> None:
    """For a benchmark that times CUDA launches only: a parser error (exit 2) where torch sees
    no CUDA device."""
    import torch

    if not torch.cuda.is_available():
        parser.error(
            "it times CUDA launches, but torch sees no CUDA device "
            "(torch.cuda.is_available() is False); run it on a GPU machine"
        )
