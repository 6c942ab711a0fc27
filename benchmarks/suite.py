"""The benchmark suite: every strategy side by side with the direct fixed-block launch, the
per-request-grid baseline, the torch reference and the HBM floor, in one process on one device.

    python -m benchmarks.suite --out benchmarks/results
    python -m benchmarks.suite --device cpu --bs 8 --mixes ones --out DIR   # logic only

Writes ``<out>/<tag>.csv`` (the rows of ``kvcanary_dispatch.cli.results``, keyed by GPU name,
torch and Triton versions and git commit) and ``<out>/<tag>.md`` (the suite's claims, a view
over those rows, and every measurement). Its claims are an earlier, looser bar than the
distribution, plan-size and host-time benchmarks read (eager time against 2.5x a floor of 12
bytes a token without L0; a fixed-block launch as the base of the plan and host claims; host
times from the harness, closing sync included): those benchmarks, not this one, state where
the library stands against its floors and a bare launch.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

from benchmarks import checked_device, interpreter_off_gpu

interpreter_off_gpu(__name__)  # before any kernel module is imported

from kvcanary_dispatch import PLAN_STRATEGIES  # noqa: E402
from kvcanary_dispatch.cli.calls import plan_calls, scatter_calls  # noqa: E402
from kvcanary_dispatch.cli.harness import Case, time_case  # noqa: E402
from kvcanary_dispatch.cli.results import Meta, Row, rows_markdown, write_csv  # noqa: E402
from kvcanary_dispatch.cli.timing import floor_us, scatter_token_bytes  # noqa: E402
from kvcanary_dispatch.cli.workloads import (  # noqa: E402
    BATCH_SIZES,
    MIXES,
    plan_workload,
    scatter_workload,
)
from kvcanary_dispatch.testing.cases import check_plan, check_scatter  # noqa: E402

SCATTER_CHUNKED = ("loop", "sliced", "auto")


def _calls(calls: dict, strategies, chunk_sizes, chunked) -> list[tuple[str, int | None, object]]:
    """(strategy, chunk, impl) for each wanted strategy, over ``chunk_sizes`` where it has one."""
    return [
        (name, chunk, impl)
        for name, impl in calls.items()
        if strategies is None or name in strategies
        for chunk in (chunk_sizes if name in chunked else (None,))
    ]


@dataclass(frozen=True)
class Run:
    """What every case of one suite run shares: where it runs (``meta``, ``device``), which
    strategies it times (``None``: all) and at which chunk sizes where a strategy takes one,
    and where each measured row is logged."""

    meta: Meta
    device: torch.device
    strategies: Iterable[str] | None = None
    chunk_sizes: Iterable[int | None] = (None,)
    log: Callable[[str], None] = print

    def time(
        self, case: Case, calls: dict[str, Callable[..., None]], chunked: Iterable[str]
    ) -> list[Row]:
        """The wanted ``calls`` (strategy: impl) timed on ``case`` and logged, each strategy in
        ``chunked`` once per chunk size."""
        todo = _calls(calls, self.strategies, self.chunk_sizes, chunked)
        return _logged(time_case(self.meta, self.device, case, todo), self.log)


def run_scatter(run: Run, batch_sizes: Iterable[int], mixes: Iterable[str]) -> list[Row]:
    """The scatter rows: every length mix at every batch size."""
    rows = []
    for mix in mixes:
        for bs in batch_sizes:
            work = scatter_workload(bs, mix, run.device)
            floor = floor_us(scatter_token_bytes(work), run.meta.copy_gbs)
            check = partial(_check, check_scatter, work)
            case = Case(
                "scatter", mix, bs, work.total, floor, work.kwargs(work.fresh_pool()), check
            )
            rows += run.time(case, scatter_calls(work), SCATTER_CHUNKED)
            del case, work
    return rows


def run_plan(run: Run, batch_sizes: Iterable[int]) -> list[Row]:
    """The plan rows: decode-like batches at every batch size."""
    rows = []
    for bs in batch_sizes:
        work = plan_workload(bs, run.device)
        inputs = {**work.inputs(), **work.fresh_outputs()}
        case = Case("plan", "decode", bs, bs, None, inputs, partial(_check, check_plan, work))
        rows += run.time(case, plan_calls(work), PLAN_STRATEGIES)
    return rows


def _check(check, work, impl, **kw) -> None:
    check(impl, work, **kw)


def _logged(rows: list[Row], log: Callable[[str], None]) -> list[Row]:
    for r in rows:
        g = f"{r.graph_us:9.1f}" if r.graph_us is not None else "        -"
        log(
            f"{r.function:7s} {r.strategy:17s} bs={r.bs:<7d} {r.distribution:6s} "
            f"chunk={r.chunk!s:5s} eager={r.eager_us:9.1f}us graph={g}us "
            f"host={r.host_us:8.1f}us launches={r.launches}"
        )
    return rows


def _find(rows, function, strategy, bs, dist=None):
    for r in rows:
        if (r.function, r.strategy, r.bs) == (function, strategy, bs) and dist in (
            None,
            r.distribution,
        ):
            return r
    return None


def bar_checks(rows: list[Row]) -> list[tuple[str, str, bool | None]]:
    """The bar, each claim as (claim, measured, met)."""
    out = []

    def claim(text: str, a: float | None, b: float | None, bound: float) -> None:
        if a is not None and b:
            out.append((text, f"{a / b:.2f}x", a / b <= bound))

    def pair(strategy, bs, base, base_bs, mix=None):
        return _find(rows, "scatter", strategy, bs, mix), _find(rows, "scatter", base, base_bs, mix)

    for mix in MIXES:
        a, g = pair("auto", 32768, "per_request_grid", 32768, mix)
        if a and g:
            claim(f"scatter bs=32768 {mix}: auto <= 1.0x per-request grid", a.eager_us,
                  g.eager_us, 1.0)  # fmt: skip
    a = _find(rows, "scatter", "auto", 32768, "u1024")
    if a:
        claim("scatter bs=32768 u1024: auto <= 2.5x HBM floor", a.eager_us, a.floor_us, 2.5)
    for mix in MIXES:
        for bs in (1, 64, 511):
            a, f = pair("auto", bs, "fixed_block", bs, mix)
            if a and f:
                claim(f"scatter bs={bs} {mix}: auto <= 1.1x fixed-block", a.eager_us, f.eager_us,
                      1.1)  # fmt: skip
                claim(f"host bs={bs} {mix}: auto <= 1.5x fixed-block", a.host_us, f.host_us, 1.5)
        a, f = pair("auto", 32768, "fixed_block", 511, mix)
        if a and f:
            claim(f"host bs=32768 {mix}: auto <= 3x fixed-block at bs=511", a.host_us, f.host_us,
                  3.0)  # fmt: skip
    a, f = _find(rows, "plan", "auto", 131072), _find(rows, "plan", "fixed_block", 4096)
    if a and f:
        met = a.launches is not None and a.launches <= 2
        out.append(("plan bs=131072: auto <= 2 launches", str(a.launches), met))
        claim("plan bs=131072 eager: auto <= 2x fixed-block at 4096", a.eager_us, f.eager_us, 2.0)
        if a.graph_us:
            claim("plan bs=131072 graphed: auto <= 2x fixed-block at 4096", a.graph_us,
                  f.graph_us, 2.0)  # fmt: skip
    return out


ALL_COLUMNS = ["function", "strategy", "bs", "distribution", "tokens", "chunk", "eager_us",
               "graph_us", "host_us", "launches", "floor_us", "status"]  # fmt: skip


def markdown(rows: list[Row], meta: Meta) -> str:
    """The suite's report, a view over its rows: the bar, then every measurement."""
    lines = [
        f"# Benchmark results: {meta.gpu}",
        "",
        meta.header(),
        "",
        "Times in microseconds: eager = `triton.testing.do_bench` median; graph = CUDA-graph "
        "replay median (`-`: the call syncs with the host, not capturable); host = wall clock "
        "per call over up to 100 calls closed by one sync (median of 5 loops, interleaved "
        "across a case's strategies); floor = 12 bytes per moved token at the measured copy "
        "bandwidth.",
        "",
        "## The bar",
        "",
        "| claim | measured | met |",
        "|---|---|---|",
    ]
    for text, measured, met in bar_checks(rows):
        lines.append(f"| {text} | {measured} | {'yes' if met else 'NO'} |")
    lines += ["", "## All measurements", ""]
    lines += rows_markdown(rows, ALL_COLUMNS)
    return "\n".join(lines) + "\n"


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
    device = checked_device(p, args.device)
    meta = Meta.collect(device)
    print(f"# {meta}")
    run = Run(meta, device)
    rows: list[Row] = []
    if "scatter" in args.ops:
        rows += run_scatter(run, args.bs, args.mixes)
    if "plan" in args.ops:
        rows += run_plan(run, args.bs)
    tag = args.tag or f"{meta.gpu.replace(' ', '_')}_{meta.date[:10]}"
    args.out.mkdir(parents=True, exist_ok=True)
    write_csv(rows, args.out / f"{tag}.csv")
    (args.out / f"{tag}.md").write_text(markdown(rows, meta))
    print(f"wrote {args.out / (tag + '.csv')} and {args.out / (tag + '.md')}")
    for text, measured, met in bar_checks(rows):
        print(f"{'ok ' if met else 'MISS'} {text}: {measured}")


if __name__ == "__main__":
    main()
