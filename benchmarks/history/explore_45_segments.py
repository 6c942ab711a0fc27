"""``segments`` with int64 column bounds (7730024) against bounds in the pool width's integer
type (int32 below 2**31 columns), side by side on one GPU:

    git show 4953101:kernels/scatter_segments.py > /tmp/segments_old.py
    python -m benchmarks.history.explore_45_segments /tmp/segments_old.py

Per distribution of ``benchmarks.distributions``: both kernels, with the group shape the
library's plan gives (``segments_shape``), checked byte for byte against the torch reference
on a poisoned pool, then their CUDA-graph replays timed alternately (``ROUNDS`` rounds, each
kernel first in turn). Prints each kernel's median µs and the median per-round ratio new / old
(least and greatest in brackets). Off CUDA (``TRITON_INTERPRET=1``) the quick batches are
checked, not timed."""

from __future__ import annotations

import importlib.util
import statistics
import sys

import torch
import triton

from benchmarks.distributions import DISTRIBUTIONS, distribution_case
from kvcanary_dispatch.cli.timing import graph_times_interleaved_us
from kvcanary_dispatch.launch_plan import segments_shape
from kvcanary_dispatch.testing.cases import POISON_I32
from kvcanary_kernels import scatter_req_token_ids_ref
from kvcanary_kernels import scatter_segments as new
from kvcanary_kernels.args import ScatterArgs

ROUNDS = 8


def _load_old(path: str):
    """The kernel file at ``path`` as a module of the kernels package (its relative imports
    resolve there)."""
    spec = importlib.util.spec_from_file_location("kvcanary_kernels._segments_old", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main(old_path: str) -> None:
    old = _load_old(old_path)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    where = torch.cuda.get_device_name() if device.type == "cuda" else "CPU (checks only)"
    print(f"{where}, torch {torch.__version__}, Triton {triton.__version__}")
    print("| distribution | reqs, cols | new µs | old µs | new / old |")
    print("|---|---|---|---|---|")
    for name in DISTRIBUTIONS:
        case = distribution_case(name, device, quick=device.type == "cpu")
        reqs, cols = segments_shape(case.bs, case.total)
        grid = (triton.cdiv(case.bs, reqs),)
        want = case.fresh_pool()
        scatter_req_token_ids_ref(**case.kwargs(want))
        calls = []
        for module in (new, old):
            pool = case.fresh_pool()
            kernel = module.bind_scatter_segments(reqs=reqs, cols=cols)
            args = ScatterArgs(**case.kwargs(pool)).kernel_args()
            kernel(grid, args)
            if not torch.equal(pool, want):
                raise AssertionError(f"{name}: {module.__name__} differs from the reference")
            pool.fill_(POISON_I32)
            calls.append(lambda kernel=kernel, grid=grid, args=args: kernel(grid, args))
        times = graph_times_interleaved_us(calls, device, ROUNDS)
        if times is None:  # off CUDA: checked, not timed
            print(f"| {name} | {reqs}, {cols} | checked | checked | - |")
            continue
        t_new, t_old = times
        ratios = [a / b for a, b in zip(t_new, t_old, strict=True)]
        print(
            f"| {name} | {reqs}, {cols} | {statistics.median(t_new):.1f} | "
            f"{statistics.median(t_old):.1f} | {statistics.median(ratios):.3f} "
            f"({min(ratios):.3f}-{max(ratios):.3f}) |",
            flush=True,
        )


if __name__ == "__main__":
    main(sys.argv[1])
