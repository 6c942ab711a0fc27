"""The benchmark suite: every strategy side by side with the direct fixed-block launch, the
per-request-grid baseline, the torch reference and the HBM floor, in one process on one device.

    python -m benchmarks.suite --out benchmarks/results

Writes ``<out>/<tag>.csv`` (one row per measurement, keyed by device name, torch and Triton
versions and git commit) and ``<out>/<tag>.md`` (tables and the bar checks).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterable
from functools import partial
from pathlib import Path

import torch

from kvcanary_dispatch import PLAN_STRATEGIES
from kvcanary_dispatch.cli.results import (
    BYTES_PER_TOKEN,
    Meta,
    Row,
    plan_variants,
    scatter_variants,
    write_csv,
)
from kvcanary_dispatch.cli.timing import (
    count_launches,
    graph_time_us,
    host_overhead_interleaved_us,
    kernel_time_us,
)
from kvcanary_dispatch.cli.workloads import (
    BATCH_SIZES,
    MIXES,
    plan_workload,
    scatter_workload,
    written_tokens,
)
from kvcanary_dispatch.testing.cases import check_plan, check_scatter


def measure(fn: Callable[[], None], device: torch.device) -> dict:
    """Kernel and graph time and launch count of one call (host overhead: ``_add_host``)."""
    return dict(
        kernel_us=kernel_time_us(fn, device),
        graph_us=graph_time_us(fn, device),
        host_loop_us=float("nan"),
        launches=count_launches(fn, device),
    )


def _add_host(rows: list[Row], fns: list[Callable[[], None]], device, log) -> None:
    """Host overhead of one case's calls, measured interleaved (so their ratios are fair)."""
    for row, us in zip(rows, host_overhead_interleaved_us(fns, device), strict=True):
        row.host_loop_us = us
        log(_fmt(row))


def run_scatter(
    device: torch.device,
    batch_sizes: Iterable[int],
    mixes: Iterable[str],
    copy_gbs: float | None,
    variants: Iterable[str] | None = None,
    chunk_sizes: Iterable[int | None] = (None,),
    log: Callable[[str], None] = print,
) -> list[Row]:
    rows = []
    for mix in mixes:
        for bs in batch_sizes:
            case = scatter_workload(bs, mix, device)
            moved = written_tokens(case)
            floor = BYTES_PER_TOKEN * moved / (copy_gbs * 1e3) if copy_gbs else None
            pool = case.fresh_pool()
            case_rows, fns = [], []
            for name, impl in scatter_variants(case).items():
                if variants is not None and name not in variants:
                    continue
                strategy_chunks = chunk_sizes if name in ("loop", "sliced", "auto") else (None,)
                for chunk in strategy_chunks:
                    kw = {"chunk_size": chunk} if chunk is not None else {}
                    check_scatter(impl, case, **kw)
                    fns.append(partial(impl, **case.kwargs(pool), **kw))
                    m = measure(fns[-1], device)
                    case_rows.append(
                        Row("scatter", name, bs, mix, case.total, chunk, **m, floor_us=floor)
                    )
            _add_host(case_rows, fns, device, log)
            rows += case_rows
            del pool, case
    return rows


def run_plan(
    device: torch.device,
    batch_sizes: Iterable[int],
    variants: Iterable[str] | None = None,
    chunk_sizes: Iterable[int | None] = (None,),
    log: Callable[[str], None] = print,
) -> list[Row]:
    rows = []
    for bs in batch_sizes:
        case = plan_workload(bs, device)
        outs = case.fresh_outputs()
        case_rows, fns = [], []
        for name, impl in plan_variants(case).items():
            if variants is not None and name not in variants:
                continue
            for chunk in chunk_sizes if name in PLAN_STRATEGIES else (None,):
                kw = {"chunk_size": chunk} if chunk is not None else {}
                check_plan(impl, case, **kw)
                fns.append(partial(impl, **case.inputs(), **outs, **kw))
                m = measure(fns[-1], device)
                case_rows.append(Row("plan", name, bs, "decode", bs, chunk, **m))
        _add_host(case_rows, fns, device, log)
        rows += case_rows
    return rows


def _fmt(r: Row) -> str:
    g = f"{r.graph_us:9.1f}" if r.graph_us is not None else "        -"
    return (
        f"{r.op:7s} {r.variant:17s} bs={r.bs:<7d} {r.mix:6s} chunk={r.chunk_size!s:5s} "
        f"kernel={r.kernel_us:9.1f}us graph={g}us host={r.host_loop_us:8.1f}us "
        f"launches={r.launches}"
    )


def _find(rows, op, variant, bs, mix=None):
    for r in rows:
        if r.op == op and r.variant == variant and r.bs == bs and (mix is None or r.mix == mix):
            return r
    return None


def bar_checks(rows: list[Row]) -> list[tuple[str, str, bool | None]]:
    """The issue's bar, each as (claim, measured, met)."""
    out = []

    def ratio(a, b):
        return None if a is None or b is None else a / b

    for mix in MIXES:
        a, g = (
            _find(rows, "scatter", "auto", 32768, mix),
            _find(rows, "scatter", "per_request_grid", 32768, mix),
        )
        if a and g:
            x = ratio(a.kernel_us, g.kernel_us)
            out.append(
                (f"scatter bs=32768 {mix}: auto <= 1.0x per-request grid", f"{x:.2f}x", x <= 1.0)
            )
    a = _find(rows, "scatter", "auto", 32768, "u1024")
    if a and a.floor_us:
        x = a.kernel_us / a.floor_us
        out.append(("scatter bs=32768 u1024: auto <= 2.5x HBM floor", f"{x:.2f}x", x <= 2.5))
    for mix in MIXES:
        for bs in (1, 64, 511):
            a, f = (
                _find(rows, "scatter", "auto", bs, mix),
                _find(rows, "scatter", "fixed_block", bs, mix),
            )
            if a and f:
                x = a.kernel_us / f.kernel_us
                out.append(
                    (f"scatter bs={bs} {mix}: auto <= 1.1x fixed-block", f"{x:.2f}x", x <= 1.1)
                )
                y = a.host_loop_us / f.host_loop_us
                out.append((f"host bs={bs} {mix}: auto <= 1.5x fixed-block", f"{y:.2f}x", y <= 1.5))
        a, f = (
            _find(rows, "scatter", "auto", 32768, mix),
            _find(rows, "scatter", "fixed_block", 511, mix),
        )
        if a and f:
            y = a.host_loop_us / f.host_loop_us
            out.append(
                (f"host bs=32768 {mix}: auto <= 3x fixed-block at bs=511", f"{y:.2f}x", y <= 3.0)
            )
    a, f = _find(rows, "plan", "auto", 131072), _find(rows, "plan", "fixed_block", 4096)
    if a and f:
        out.append(
            (
                "plan bs=131072: auto <= 2 launches",
                str(a.launches),
                a.launches is not None and a.launches <= 2,
            )
        )
        x = a.kernel_us / f.kernel_us
        out.append(("plan bs=131072 eager: auto <= 2x fixed-block at 4096", f"{x:.2f}x", x <= 2.0))
        if a.graph_us and f.graph_us:
            y = a.graph_us / f.graph_us
            out.append(
                ("plan bs=131072 graphed: auto <= 2x fixed-block at 4096", f"{y:.2f}x", y <= 2.0)
            )
    return out


def write_markdown(rows: list[Row], meta: Meta, path: Path) -> None:
    lines = [
        f"# Benchmark results: {meta.device_name}",
        "",
        f"torch {meta.torch}, Triton {meta.triton}, commit {meta.commit}, {meta.date}; "
        f"device copy bandwidth {meta.copy_gbs and round(meta.copy_gbs)} GB/s (read + write).",
        "",
        "Times in microseconds: kernel = `triton.testing.do_bench` median; graph = CUDA-graph "
        "replay median (`-`: the call syncs with the host, not capturable); host = wall clock "
        "per call over up to 100 calls closed by one sync (median of 5 loops, interleaved "
        "across a case's variants); floor = 12 bytes per moved token at the measured copy "
        "bandwidth.",
        "",
        "## The bar",
        "",
        "| claim | measured | met |",
        "|---|---|---|",
    ]
    for claim, measured, met in bar_checks(rows):
        lines.append(f"| {claim} | {measured} | {'yes' if met else 'NO'} |")
    lines += ["", "## All measurements", ""]
    lines.append(
        "| op | variant | bs | mix | tokens | chunk | kernel | graph | host | launches | floor |"
    )
    lines.append("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        f = lambda x: "-" if x is None else (f"{x:.1f}" if isinstance(x, float) else str(x))  # noqa: E731
        lines.append(
            f"| {r.op} | {r.variant} | {r.bs} | {r.mix} | {r.tokens} | {f(r.chunk_size)} | "
            f"{f(r.kernel_us)} | {f(r.graph_us)} | {f(r.host_loop_us)} | {f(r.launches)} | "
            f"{f(r.floor_us)} |"
        )
    path.write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--bs", type=int, nargs="+", default=list(BATCH_SIZES))
    p.add_argument("--mixes", nargs="+", default=list(MIXES), choices=list(MIXES))
    p.add_argument("--ops", nargs="+", default=["scatter", "plan"], choices=["scatter", "plan"])
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    p.add_argument("--tag", default=None, help="file name stem (default: device and date)")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    meta = Meta.collect(device)
    print(f"# {meta}")
    rows: list[Row] = []
    if "scatter" in args.ops:
        rows += run_scatter(device, args.bs, args.mixes, meta.copy_gbs)
    if "plan" in args.ops:
        rows += run_plan(device, args.bs)
    tag = args.tag or f"{meta.device_name.replace(' ', '_')}_{meta.date[:10]}"
    write_csv(rows, meta, args.out / f"{tag}.csv")
    write_markdown(rows, meta, args.out / f"{tag}.md")
    print(f"wrote {args.out / (tag + '.csv')} and {args.out / (tag + '.md')}")
    for claim, measured, met in bar_checks(rows):
        print(f"{'ok ' if met else 'MISS'} {claim}: {measured}")


if __name__ == "__main__":
    main()
