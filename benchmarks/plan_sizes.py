"""Plan offsets at large batch sizes: every single-launch plan setting against its floor.

    python -m benchmarks.plan_sizes --out DIR [--bs 4096 131072 1048576]

For each ``bs`` (random lengths, a quarter of the requests padding, seeds read from a
``req_to_token`` of 256 columns): ``lookback`` and ``scan`` at several slice sizes and warp
counts, ``auto``, and at bs <= 4096 the direct fixed-block launch; each checked byte for byte
against the torch reference, then timed as a CUDA-graph replay, eagerly, and as host time per
call. Also timed in the same run: an empty Triton kernel's graph replay (the launch floor) and
the floor of bytes (requests' 24 input bytes and 24 output bytes, plus one 32-byte sector per
seed read, at the measured copy bandwidth). Writes ``plan_sizes.csv`` and ``plan_sizes.md``.
"""

from __future__ import annotations

import argparse
import csv
import os
from functools import partial

import torch
import triton

from kvcanary_dispatch import plan_offsets
from kvcanary_dispatch.cli.timing import (
    copy_bandwidth_gbs,
    graph_time_us,
    host_overhead_interleaved_us,
    kernel_time_us,
)
from kvcanary_dispatch.testing.cases import check_plan, make_plan_case
from kvcanary_kernels.plan_lookback import launch_plan_lookback
from kvcanary_kernels.plan_offsets import enqueue_plan_offsets
from kvcanary_kernels.plan_scan import launch_plan_scan


@triton.jit
def _empty_kernel(x_ptr):
    pass  # the launch floor: one program that does nothing


def _case(bs: int, device: torch.device):
    g = torch.Generator().manual_seed(bs)
    prefix = torch.randint(0, 257, (bs,), generator=g)
    extend = torch.randint(0, 64, (bs,), generator=g)
    pad = torch.rand(bs, generator=g) < 0.25
    return make_plan_case(
        prefix_lens=prefix,
        extend_seq_lens=extend,
        padding=pad,
        max_seq_len=256,
        verify_capacity=2**31 - 1,
        spare_capacity=0,
        seed=bs,
        device=device,
    )


def _variants(bs: int) -> dict[str, object]:
    out: dict[str, object] = {"auto": plan_offsets}
    if bs <= 4096:
        out["fixed"] = partial(enqueue_plan_offsets, bs_block=triton.next_power_of_2(bs))
    for chunk in (256, 1024, 2048):
        out[f"lookback/{chunk}/w4"] = partial(
            launch_plan_lookback, chunk=chunk, bs_block=chunk, num_warps=4
        )
    for chunk in (256, 1024):
        out[f"scan/{chunk}"] = partial(launch_plan_scan, chunk=chunk, bs_block=chunk, num_warps=8)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--bs", type=int, nargs="+", default=[4096, 131072, 1048576])
    args = parser.parse_args()
    device = torch.device("cuda")
    os.makedirs(args.out, exist_ok=True)
    gbs = copy_bandwidth_gbs(device)
    x = torch.zeros(1, device=device)
    empty_us = graph_time_us(lambda: _empty_kernel[(1,)](x), device)
    print(f"copy bandwidth {gbs:.0f} GB/s, empty-kernel graph replay {empty_us:.2f} us")
    rows = []
    for bs in args.bs:
        case = _case(bs, device)
        seeds = int(
            ((case.req_pool_indices != 0) & (case.prefix_lens > 0) & (case.extend_seq_lens > 0))
            .sum()
            .item()
        )
        floor_us = (48 * bs + 32 * seeds) / (gbs * 1e3)
        outs = case.fresh_outputs()
        variants = _variants(bs)
        calls = {}
        for name, fn in variants.items():
            if name == "fixed":
                kw = dict(outs)
                kw["out_verify_offsets_scratch"] = kw.pop("out_verify_offsets")
                check_plan(fn, case, out_verify_name="out_verify_offsets_scratch")
            else:
                kw = outs
                check_plan(fn, case)
            calls[name] = partial(fn, **case.inputs(), **kw)
        hosts = host_overhead_interleaved_us(list(calls.values()), device, n=200, rounds=7)
        for (name, call), host in zip(calls.items(), hosts, strict=True):
            row = dict(
                bs=bs,
                variant=name,
                graph_us=graph_time_us(call, device),
                eager_us=kernel_time_us(call, device),
                host_us=host,
                floor_us=floor_us,
                empty_us=empty_us,
            )
            row["graph_vs_floor_plus_empty"] = row["graph_us"] / (floor_us + empty_us)
            rows.append(row)
            print(
                f"bs={bs:>8} {name:<18} graph {row['graph_us']:8.2f}  eager "
                f"{row['eager_us']:8.2f}  host {host:7.2f}  /(floor+L0) "
                f"{row['graph_vs_floor_plus_empty']:.2f}",
                flush=True,
            )
    with open(os.path.join(args.out, "plan_sizes.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    with open(os.path.join(args.out, "plan_sizes.md"), "w") as f:
        f.write(
            f"copy bandwidth {gbs:.0f} GB/s; empty-kernel graph replay {empty_us:.2f} us\n\n"
            "| bs | variant | graph us | eager us | host us | floor us | graph/(floor+L0) |\n"
            "|---|---|---|---|---|---|---|\n"
        )
        for r in rows:
            f.write(
                f"| {r['bs']} | {r['variant']} | {r['graph_us']:.2f} | {r['eager_us']:.2f} | "
                f"{r['host_us']:.2f} | {r['floor_us']:.2f} | "
                f"{r['graph_vs_floor_plus_empty']:.2f} |\n"
            )


if __name__ == "__main__":
    main()
