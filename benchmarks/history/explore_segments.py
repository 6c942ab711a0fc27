"""Step 5 of benchmarks/NOTES_1_to_10.md: the ``segments`` scatter's group shape and dispatcher
cost.

- scatter: ``segments`` over (requests x columns x warps) next to ``flat`` (auto's tile) and the
  per-request grid, for the suite's batch sizes and mixes; one skewed batch (a 65 536-token
  request among U(0, 1024) ones) where one program copies the long run alone.
- plan: host, kernel and graph time of ``plan_offsets`` per strategy next to a bare fixed-block
  launch at bs = 4096 (the bar's reference), interleaved.

``python -m benchmarks.history.explore_segments [ncu-target]``: with ``ncu-target`` it only
runs one u1024 call of ``flat`` and of ``segments``, for ``ncu`` to profile.
"""

from __future__ import annotations

import sys
from functools import partial

import torch

from kvcanary_dispatch import plan_offsets, scatter_req_token_ids
from kvcanary_dispatch.cli.per_request_grid import scatter_per_request_grid
from kvcanary_dispatch.cli.timing import graph_time_us, host_overhead_interleaved_us, kernel_time_us
from kvcanary_dispatch.cli.workloads import (
    plan_workload,
    scatter_workload,
    segment_lengths,
    written_tokens,
)
from kvcanary_dispatch.scatter import flat_token_block
from kvcanary_dispatch.testing.cases import check_plan, check_scatter, make_scatter_case
from kvcanary_kernels import launch_plan_offsets_kernel
from kvcanary_kernels.scatter_flat import launch_scatter_flat
from kvcanary_kernels.scatter_segments import launch_scatter_segments

COPY_GBS = 4245.0  # the suite's measured device copy rate (results/h200_2026-11-29.md)
SHAPES = [(1, 1024, 4), (1, 1024, 8), (1, 2048, 8), (2, 512, 4), (4, 256, 4), (8, 128, 4),
          (16, 64, 4), (32, 32, 4), (64, 16, 4), (128, 8, 4), (256, 4, 4), (4, 64, 2)]  # fmt: skip
CASES = [(32768, "u1024"), (32768, "u128"), (32768, "ones"), (131072, "u1024"),
         (131072, "u128"), (131072, "ones"), (4096, "u1024"), (4096, "u128"), (4096, "ones"),
         (511, "u1024"), (511, "u128"), (511, "ones"), (64, "u1024"), (64, "u128"),
         (1, "u1024")]  # fmt: skip


def _segments(reqs, cols, warps, **kw):
    launch_scatter_segments(**kw, reqs=reqs, cols=cols, num_warps=warps)


def _flat(**kw):
    bs, tokens = int(kw["req_pool_indices"].shape[0]), int(kw["flat_in"].shape[0])
    launch_scatter_flat(**kw, token_block=flat_token_block(bs, tokens))


def _rows(title, case, shapes, extra=()) -> None:
    """One case: ``flat``, ``segments`` at each shape, then ``extra`` (label, impl) pairs."""
    pool = case.fresh_pool()
    floor = 12 * written_tokens(case) / (COPY_GBS * 1e3)
    print(f"{title} tokens={case.total} floor {floor:.2f}us")
    impls = [("flat", _flat)]
    impls += [(f"segments {r}x{c} w{w}", partial(_segments, r, c, w)) for r, c, w in shapes]
    for label, fn in [*impls, *extra]:
        check_scatter(fn, case)
        t = kernel_time_us(partial(fn, **case.kwargs(pool)), torch.device("cuda"))
        print(f"  {label:24s} {t:8.1f}us {t / floor:6.2f}x floor")


def explore_scatter() -> None:
    dev = torch.device("cuda")
    for bs, mix in CASES:
        case = scatter_workload(bs, mix, dev)
        _rows(f"{mix} bs={bs}", case, SHAPES, [("per_request_grid", scatter_per_request_grid)])
    lens = segment_lengths(4096, "u1024")
    lens[0] = 65536
    case = make_scatter_case(lens, width=131072, seed=0, device=dev)
    title = "skewed bs=4096 u1024 + one 65536-token run"
    _rows(title, case, [(1, 1024, 4), (2, 512, 4), (1, 2048, 8)], [("auto", scatter_req_token_ids)])


def _fixed(out_verify_offsets, **kw):
    launch_plan_offsets_kernel(**kw, out_verify_offsets_scratch=out_verify_offsets)


def explore_plan() -> None:
    dev = torch.device("cuda")
    small = plan_workload(4096, dev)
    fns = {"fixed@4096 launcher": partial(_fixed, **small.inputs(), **small.fresh_outputs())}
    for bs in (4096, 131072):
        case = plan_workload(bs, dev)
        outs = case.fresh_outputs()
        for strategy in ("auto", "scan", "lookback"):
            check_plan(partial(plan_offsets, strategy=strategy), case)
            fns[f"{strategy}@{bs}"] = partial(
                plan_offsets, **case.inputs(), **outs, strategy=strategy
            )
    hosts = host_overhead_interleaved_us(list(fns.values()), dev, rounds=9)
    for (name, fn), host in zip(fns.items(), hosts, strict=True):
        k, g = kernel_time_us(fn, dev), graph_time_us(fn, dev)
        print(f"plan {name:20s} kernel {k:6.1f} graph {g:6.1f} host {host:6.1f}us")


def ncu_target() -> None:
    case = scatter_workload(32768, "u1024", torch.device("cuda"))
    pool = case.fresh_pool()
    _flat(**case.kwargs(pool))
    scatter_req_token_ids(**case.kwargs(pool), strategy="segments")
    torch.cuda.synchronize()


if __name__ == "__main__":
    if sys.argv[1:] == ["ncu-target"]:
        ncu_target()
    else:
        explore_plan()
        explore_scatter()
