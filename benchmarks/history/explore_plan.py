"""Step 12 of benchmarks/NOTES.md: where a large plan's time goes.

For batches ``KIND:BS`` (``random``: distinct random pool rows
of a 256-column ``req_to_token``, as ``benchmarks.plan_sizes``; ``sorted``: the same rows in
ascending order; ``noseed``: no request reads a seed; ``narrow``: random rows of an 8-column
table; default: random at 32 768, 131 072 and 1 048 576, narrow at 1 048 576), graph-replay
µs of:

- the ``scan`` and ``lookback`` launchers at several slice, tile, warp and window settings
  (``explore_12_plan_2.log`` also has each with the seeds written in the first pass, a
  variant removed after that run, commit 9d9319d; ``explore_12_plan_1.log`` came from the
  script's first version, which timed the scan's two launches apart);
- ``benchmarks.plan_sizes.plan_bytes_stream``, which moves the plan's bytes with none of its
  logic: read the three inputs and write the lengths in place of the offsets (``stream``),
  plus the seed gather (``stream+seed``), plus a per-tile ``tl.cumsum``
  (``stream+seed+cumsum``).

Every plan launch is checked byte for byte first. ``--ncu-target``: one eager ``scan`` call on
the ``random`` batch, for ``ncu`` to profile.

    python -m benchmarks.history.explore_plan [--cases KIND:BS ...] [--ncu-target]
"""

from __future__ import annotations

import argparse
from functools import partial

import torch

from benchmarks import interpreter_off_gpu

interpreter_off_gpu(__name__)  # before any kernel module is imported

import triton  # noqa: E402

from benchmarks.plan_sizes import plan_bytes_stream  # noqa: E402
from kvcanary_dispatch.cli.results import Meta  # noqa: E402
from kvcanary_dispatch.cli.timing import (  # noqa: E402
    floor_us,
    graph_time_us,
    plan_floor_bytes,
)
from kvcanary_dispatch.testing.cases import check_plan, make_plan_case  # noqa: E402
from kvcanary_kernels.args import bundle_plan_args  # noqa: E402
from kvcanary_kernels.plan_lookback import launch_plan_lookback  # noqa: E402
from kvcanary_kernels.plan_scan import launch_plan_scan  # noqa: E402


def make_case(kind: str, bs: int, device: torch.device):
    g = torch.Generator().manual_seed(bs)
    width = 8 if kind == "narrow" else 256
    prefix = torch.randint(0, width + 1, (bs,), generator=g)
    extend = torch.randint(0, 64, (bs,), generator=g)
    if kind == "noseed":
        extend.zero_()
    pad = torch.rand(bs, generator=g) < 0.25
    case = make_plan_case(
        prefix_lens=prefix, extend_seq_lens=extend, padding=pad, max_seq_len=width,
        verify_capacity=2**31 - 1, spare_capacity=0, seed=bs, device=device,
    )  # fmt: skip
    if kind == "sorted":
        rows = case.req_pool_indices
        live = rows != 0
        rows[live] = torch.sort(rows[live]).values
    return case


def variants():
    """(name, fn(**kw), checked): every call takes a case's inputs and outputs."""

    def sliced(launch, chunk, **params):
        def fn(**kw):
            i, o = bundle_plan_args(kw)
            launch(i, o, grid=(triton.cdiv(i.bs, chunk),), chunk=chunk, **params)

        return fn

    def stream(seed, cumsum, block=1024, warps=4):
        return partial(plan_bytes_stream, seed=seed, cumsum=cumsum, block=block, warps=warps)

    out = []
    for chunk, tile, warps in ((256, 256, 4), (256, 256, 8), (512, 256, 4), (1024, 256, 4)):
        fn = sliced(launch_plan_scan, chunk, bs_block=tile, num_warps=warps)
        out.append((f"scan c{chunk} t{tile} w{warps}", fn, True))
    looks = [(c, 256, 4, w) for c in (256, 512, 1024) for w in (128, 1024)]
    looks += [(1024, 256, 8, 1024), (1024, 1024, 8, 1024)]
    for chunk, tile, warps, window in looks:
        fn = sliced(launch_plan_lookback, chunk, bs_block=tile, num_warps=warps, window=window)
        out.append((f"lookback c{chunk} t{tile} w{warps} lb{window}", fn, True))
    for seed, cumsum in ((False, False), (True, False), (True, True)):
        name = "stream" + ("+seed" if seed else "") + ("+cumsum" if cumsum else "")
        out.append((name, stream(seed, cumsum), False))
    out.append(("stream+seed 256/w4", stream(True, False, 256, 4), False))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--cases",
        nargs="+",
        default=["random:1048576", "random:131072", "random:32768", "narrow:1048576"],
        help="KIND:BS, KIND one of random, sorted, noseed, narrow",
    )
    parser.add_argument("--ncu-target", action="store_true")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    device = torch.device(args.device)
    if args.ncu_target:
        case = make_case("random", 1 << 20, device)
        kw = {**case.inputs(), **case.fresh_outputs()}
        for name, fn, _ in variants():
            if name.startswith(("scan c1024 t256 w4", "lookback c1024 t256 w4 lb1024")):
                fn(**kw)
        torch.cuda.synchronize()
        return
    meta = Meta.collect(device)
    print(meta.header(), flush=True)
    for spec in args.cases:
        kind, bs = spec.split(":")
        case = make_case(kind, int(bs), device)
        floor = floor_us(plan_floor_bytes(case), meta.copy_gbs)
        print(f"\n## {kind}: bs {bs}, floor {floor or float('nan'):.1f} µs", flush=True)
        kw = {**case.inputs(), **case.fresh_outputs()}
        for name, fn, checked in variants():
            try:
                if checked:
                    check_plan(fn, case)
                fn(**kw)
                t = graph_time_us(lambda fn=fn, kw=kw: fn(**kw), device)
            except Exception as err:  # noqa: BLE001 (a failed variant is reported, not fatal)
                print(f"{name:36s} failed: {str(err).splitlines()[0][:200]}", flush=True)
                continue
            print(f"{name:36s} {t if t is not None else float('nan'):8.1f}", flush=True)


if __name__ == "__main__":
    main()
