"""Exploration of the single-launch kernels' tuning knobs on the bar's workloads; prints tables.

- scatter ``flat``: token block x probes per search step x warps (bs 511 and 32768, three mixes)
- plan ``scan``: slice size x warps (bs 4096, 32768, 131072), next to the fixed-block kernel
"""

from __future__ import annotations

from functools import partial

import torch

from kvcanary_dispatch.cli.per_request_grid import scatter_per_request_grid
from kvcanary_dispatch.cli.timing import graph_time_us, kernel_time_us
from kvcanary_dispatch.cli.workloads import MIXES, plan_workload, scatter_workload
from kvcanary_dispatch.testing.cases import check_plan, check_scatter
from kvcanary_kernels import launch_plan_offsets_kernel
from kvcanary_kernels.plan_scan import launch_plan_scan
from kvcanary_kernels.scatter_flat import launch_scatter_flat


def _flat(tb, probes, warps, **kw):
    launch_scatter_flat(**kw, token_block=tb, probes=probes, num_warps=warps)


def _scan(chunk, warps, **kw):
    launch_plan_scan(**kw, chunk=chunk, bs_block=chunk, num_warps=warps)


def _fixed(out_verify_offsets, **kw):
    launch_plan_offsets_kernel(**kw, out_verify_offsets_scratch=out_verify_offsets)


def explore_scatter(device: torch.device) -> None:
    for mix in MIXES:
        for bs in (511, 32768):
            case = scatter_workload(bs, mix, device)
            pool = case.fresh_pool()
            base = kernel_time_us(partial(scatter_per_request_grid, **case.kwargs(pool)), device)
            print(f"{mix:6s} bs={bs:6d} tokens={case.total:9d} per_request_grid {base:8.1f}us")
            for tb in (128, 256, 512, 1024, 2048):
                for probes in (8, 32, 64):
                    for warps in (4, 8):
                        fn = partial(_flat, tb, probes, warps)
                        check_scatter(fn, case)
                        t = kernel_time_us(partial(fn, **case.kwargs(pool)), device)
                        print(f"    flat tb={tb:5d} probes={probes:3d} warps={warps} {t:8.1f}us")


def explore_plan(device: torch.device) -> None:
    for bs in (4096, 32768, 131072):
        case = plan_workload(bs, device)
        outs = case.fresh_outputs()
        if bs <= 4096:
            fn = partial(_fixed, **case.inputs(), **outs)
            print(
                f"plan bs={bs:6d} fixed_block eager {kernel_time_us(fn, device):7.1f}us "
                f"graph {graph_time_us(fn, device):7.1f}us"
            )
        for chunk in (256, 512, 1024, 2048, 4096):
            for warps in (4, 8, 16):
                check_plan(partial(_scan, chunk, warps), case)
                fn = partial(_scan, chunk, warps, **case.inputs(), **outs)
                print(
                    f"plan bs={bs:6d} scan chunk={chunk:5d} warps={warps:2d} eager "
                    f"{kernel_time_us(fn, device):7.1f}us graph {graph_time_us(fn, device):7.1f}us"
                )


if __name__ == "__main__":
    dev = torch.device("cuda")
    explore_plan(dev)
    explore_scatter(dev)
