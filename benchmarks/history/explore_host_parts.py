"""Step 28: what each piece of ``plan_offsets``' host path costs on a GPU host, one process.

``python -m benchmarks.history.explore_host_parts`` (a GPU; pin it with ``taskset -c N``).
Each figure is the best of 7 rounds of ``timeit``, µs per call: the CUDA queries a call makes
(current device, current stream, capture state), the library's own steps on a real call's
arguments (placement, the one-pass check and head, the launch plan, the look-back's resident
state), the whole call per strategy, the same call with the compiled launcher stubbed out, and
the bare ``kernel[grid]`` launch ``benchmarks.host_overhead`` compares against.
"""

from __future__ import annotations

import timeit

import torch
import triton
from triton.runtime import driver

import kvcanary_dispatch as kd
import kvcanary_kernels._launch as launch
from benchmarks.host_overhead import bare_plan, bare_plan_args, plan_keywords
from kvcanary_dispatch.launch_plan import plan_offsets_launch_plan
from kvcanary_dispatch.placement import capturing, on_device
from kvcanary_dispatch.plan import _LAUNCHERS, _STATE, _plan, _state_maker, run_plan_offsets_plan
from kvcanary_dispatch.resident import stream_buffer
from kvcanary_kernels.args import PlanInputs, PlanOutputs, bundle_plan_args
from kvcanary_kernels.plan_lookback import lookback_state_words
from kvcanary_kernels.plan_offsets import checked_plan_head


def us(fn, calls: int = 2000, rounds: int = 7) -> float:
    fn()
    torch.cuda.synchronize()
    best = min(timeit.repeat(fn, number=calls, repeat=rounds)) / calls
    torch.cuda.synchronize()
    return 1e6 * best


def main() -> None:
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    print(f"torch {torch.__version__}, Triton {triton.__version__}, {torch.cuda.get_device_name()}")
    rows = {
        "torch.cuda.current_device()": torch.cuda.current_device,
        "torch.cuda.is_current_stream_capturing()": torch.cuda.is_current_stream_capturing,
        "torch._C._cuda_isCurrentStreamCapturing()": torch._C._cuda_isCurrentStreamCapturing,
        "driver.active.get_current_stream(0)": lambda: driver.active.get_current_stream(0),
        "torch._C._cuda_getCurrentRawStream(0)": lambda: torch._C._cuda_getCurrentRawStream(0),
        "capturing(dev)": lambda: capturing(dev),
        "on_device(dev) entered": lambda: on_device(dev).__enter__(),
    }
    for name, fn in rows.items():
        print(f"{name:48s} {us(fn, 20000):6.3f}")
    for bs in (8, 4096, 32768, 131072):
        time_size(bs, dev)


def time_size(bs: int, dev: torch.device) -> None:
    kw = plan_keywords(bs, dev)
    i, o = bundle_plan_args(kw, "out_verify_offsets")
    plan = plan_offsets_launch_plan(bs, None, "auto")
    words = lookback_state_words(plan.launches[0].grid[0])
    bare = bare_plan_args(kw)
    parts = {
        "checked_plan_head": lambda: checked_plan_head(i, o, "out_verify_offsets"),
        "plan_offsets_launch_plan": lambda: plan_offsets_launch_plan(bs, None, "auto"),
        "stream_buffer (look-back state)": lambda: stream_buffer(
            _STATE, dev, words, _state_maker(o.out_verify_offsets)
        ),
        f"plan_offsets auto ({plan.strategy})": lambda: kd.plan_offsets(**kw),
        "bare_plan[(1,)]": lambda: bare_plan[(1,)](*bare, BLOCK=256),
    }
    for name, fn in parts.items():
        print(f"bs {bs:7d} {name:40s} {us(fn):6.3f}")
    real = launch.BoundKernel._launch
    launch.BoundKernel._launch = lambda self, key, *args: launch._COMPILED.get(key)
    try:
        stubbed = us(lambda: kd.plan_offsets(**kw))
    finally:
        launch.BoundKernel._launch = real
    print(f"bs {bs:7d} {'plan_offsets auto, launch stubbed':40s} {stubbed:6.3f}")
    decompose(bs, kw, i, o)


def decompose(bs: int, kw: dict, i, o) -> None:
    """The same call's Python with the launch stubbed, from the outside in."""
    head = checked_plan_head(i, o, "out_verify_offsets")
    plan = plan_offsets_launch_plan(bs, None, "auto")
    (one,) = plan.launches if len(plan.launches) == 1 else plan.launches[:1]
    extra = {}
    if plan.strategy == "lookback":
        words = lookback_state_words(one.grid[0])
        extra["state"] = stream_buffer(_STATE, o.out_verify_offsets.device, words,
                                       _state_maker(o.out_verify_offsets))  # fmt: skip
    launcher = _LAUNCHERS.get(one.launcher)
    parts = {
        "torch.compiler.is_compiling()": torch.compiler.is_compiling,
        "PlanInputs + PlanOutputs": lambda: (PlanInputs(*i), PlanOutputs(*o)),
        "_plan (inside on_device)": lambda: _plan(i, o, None, "auto", False, "x"),
        "run_plan_offsets_plan": lambda: run_plan_offsets_plan(plan, i, o, head),
    }
    if launcher is not None:
        parts[f"{one.launcher}(head=...)"] = lambda: launcher(
            i, o, grid=one.grid, head=head, **extra, **one.kwargs
        )
    real = launch.BoundKernel._launch
    launch.BoundKernel._launch = lambda self, key, *args: launch._COMPILED.get(key)
    try:
        for name, fn in parts.items():
            print(f"bs {bs:7d}   stubbed: {name:31s} {us(fn):6.3f}")
    finally:
        launch.BoundKernel._launch = real


if __name__ == "__main__":
    main()
