"""Scatter across length distributions: every strategy, the balanced kernel's settings (each a
strategy of its own, ``balanced_*``) and the per-request grid, next to the bytes floor and an
empty launch, in one run on one device.

    python -m benchmarks.distributions --out DIR              # a GPU: ~3-5 minutes
    python -m benchmarks.distributions --device cpu --quick --out DIR   # logic only
    python -m benchmarks.distributions --width 131072 --out DIR   # engine-sized pools

Per distribution: floor = bytes moved at the measured device copy bandwidth (flat_in read as
int64 for every written token, offsets and indices read once, each request's run written as
whole 32-byte sectors of its pool row); L0 = an empty Triton kernel's CUDA-graph replay, same
run. Each strategy is checked byte for byte against the torch reference on a poisoned pool
before it is timed (``kvcanary_dispatch.cli.harness``: eager = ``do_bench`` median, graph =
CUDA-graph replay median, host = wall clock per call, interleaved across the distribution's
strategies). The balanced settings are first compiled in processes of their own, so a compiler
crash costs one strategy, not the run; a strategy that raises is recorded with its error and
the run goes on; past ``--budget-s`` the rest is skipped. Writes ``distributions.{csv,md,png}``
(the csv in the results schema) into ``--out``, and on a GPU ``auto_vs_grid.csv``: the two
graph replays timed alternately, ``SIDE_BY_SIDE_ROUNDS`` rounds a distribution. Exit status:
0 all good; 1 some strategy gave a wrong result; 2 some strategy raised.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

from benchmarks import interpreter_off_gpu

interpreter_off_gpu(__name__)  # before any kernel module is imported

from kvcanary_dispatch import scatter_req_token_ids  # noqa: E402
from kvcanary_dispatch.cli.harness import Case, ContextLost, _short, time_case  # noqa: E402
from kvcanary_dispatch.cli.per_request_grid import scatter_per_request_grid  # noqa: E402
from kvcanary_dispatch.cli.results import (  # noqa: E402
    Meta,
    Row,
    fmt_ratio,
    fmt_us,
    rows_markdown,
    write_csv,
)
from kvcanary_dispatch.cli.timing import (  # noqa: E402
    floor_us,
    graph_times_interleaved_us,
    scatter_sector_bytes,
)
from kvcanary_dispatch.testing.cases import (  # noqa: E402
    POISON_I32,
    ScatterCase,
    make_scatter_case,
)
from kvcanary_kernels import scatter_req_token_ids_ref  # noqa: E402
from kvcanary_kernels.args import ScatterArgs  # noqa: E402
from kvcanary_kernels.scatter_balanced import launch_scatter_balanced  # noqa: E402

STRATEGIES = ("capped", "rows", "flat", "segments", "sliced", "auto")
# The balanced kernel's settings, one strategy each: launcher keywords (its defaults first).
BALANCED = {
    "balanced": {},  # reqs=128 short_cols=8 chunks=8 chunk_cols=64 compare, 4 warps, auto D, P
    "balanced_gather": dict(gather=True),
    "balanced_w8": dict(chunks=16, num_warps=8),
    "balanced_w8_c128": dict(chunks=16, chunk_cols=128, num_warps=8),
    "balanced_c256": dict(chunks=4, chunk_cols=256),
    "balanced_r256_s4": dict(reqs=256, short_cols=4),
    "balanced_d256": dict(items_per_program=256),
    "balanced_d1024": dict(items_per_program=1024),
    "balanced_d4096": dict(items_per_program=4096),
    "balanced_p32": dict(probes=32),
    "balanced_p128": dict(probes=128),
}
WIDTH = 8192  # pool width (an engine's max context) unless a run is longer
POOL_MAX_BYTES = 32 << 30  # a pool's cap (two are held): 262 144 decodes get narrower pools

_PROBE = """
import json, sys, torch
from kvcanary_kernels.scatter_balanced import launch_scatter_balanced
dev = torch.device(sys.argv[2])
flat = torch.arange(1000, dtype=torch.int64, device=dev)
pool = torch.zeros(3, 1024, dtype=torch.int32, device=dev)
from kvcanary_kernels.args import ScatterArgs
launch_scatter_balanced(ScatterArgs(flat, torch.tensor([0, 1, 300, 1000], device=dev),
    torch.tensor([2, 0, 1], device=dev), pool), **json.loads(sys.argv[1]))
torch.cuda.synchronize(dev) if dev.type == "cuda" else None
assert torch.equal(pool[0, :299].cpu(), torch.arange(1, 300, dtype=torch.int32))
"""


def probe_compiles(device: torch.device, log) -> dict[str, str]:
    """Compile and run each balanced setting once in a process of its own, all at once: a
    crash (a compiler assertion aborts the process) or a hang marks that strategy broken
    instead of ending the run; a Python exception is left to the in-process run to record.
    Also warms Triton's cache. Returns {strategy: error}."""
    if device.type != "cuda":
        return {}
    args = [sys.executable, "-c", _PROBE]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    pipes = dict(stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    procs = {
        name: subprocess.Popen([*args, json.dumps(params), str(device)], **pipes)
        for name, params in BALANCED.items()
    }
    broken = {}
    for name, proc in procs.items():
        try:
            _, err = proc.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate()
        if proc.returncode != 0:
            tail = (err.strip().splitlines() or [""])[-1][:250]
            log(f"   {name}: compile probe exited {proc.returncode}: {tail}")
            if proc.returncode != 1:
                broken[name] = f"compile probe exited {proc.returncode}: {tail}"
    return broken


UNIFORM = {  # name: (shortest run, longest run, bs), lengths uniform in between
    "u128_32768": (0, 128, 32768), "u1024_32768": (0, 1024, 32768), "spec_16384": (4, 8, 16384),
    "prefills_64": (8192, 32768, 64), "tiny_8": (0, 128, 8), "tiny_16_u1024": (0, 1024, 16),
}  # fmt: skip
# The table first, in case the time budget runs out.
DISTRIBUTIONS = ("prefills_64", "giant_4096", "lognormal2_16384", "ones_262144", "ones_32768",
                 "tiny_8", "u1024_32768", "lognormal1_16384", "u128_32768", "spec_16384",
                 "decode_prefill_8192", "tiny_16_u1024", "segments_worst_128")  # fmt: skip


def _dist(name: str, quick: bool, g: torch.Generator) -> torch.Tensor:
    """Segment lengths of one named distribution (``quick``: at most 64 requests, runs of 128
    tokens or more 64x shorter, so that the interpreter runs every strategy in seconds)."""

    def n(bs: int) -> int:
        return min(max(bs // 512, 4), 64) if quick else bs

    def ln(tokens: int) -> int:
        return max(tokens // 64, 1) if quick and tokens >= 128 else tokens

    def uniform(lo, hi, count):
        return torch.randint(lo, hi + 1, (count,), generator=g, dtype=torch.int64)

    if name.startswith("ones_"):
        return torch.ones(n(int(name[5:])), dtype=torch.int64)
    if name in UNIFORM:
        lo, hi, bs = UNIFORM[name]
        return uniform(ln(lo), ln(hi), n(bs))
    if name in ("lognormal1_16384", "lognormal2_16384"):
        sigma = 1.0 if name.startswith("lognormal1") else 2.0
        mu = math.log(ln(460)) - sigma * sigma / 2  # mean ~460 tokens
        x = (torch.randn(n(16384), generator=g, dtype=torch.float64) * sigma + mu).exp()
        return x.round().clamp(max=ln(65536)).to(torch.int64)
    if name == "decode_prefill_8192":  # decodes and four chunked-prefill pieces
        lens = torch.ones(n(8192), dtype=torch.int64)
        lens[torch.randperm(lens.numel(), generator=g)[:4]] = uniform(ln(2048), ln(8192), 4)
        return lens
    if name == "giant_4096":  # one 65 536-token run among 4 095 U(0, 1024) ones
        lens = uniform(0, ln(1024), n(4096))
        lens[int(torch.randint(0, lens.numel(), (1,), generator=g))] = ln(65536)
        return lens
    if name == "segments_worst_128":  # the longest run auto lets "segments" take serially
        lens = torch.full((n(128),), ln(130), dtype=torch.int64)
        lens[0] = ln(16384)  # mean 257 tokens: 512 columns a step, 32 steps for this run
        return lens
    raise ValueError(f"unknown distribution {name!r}")


def distribution_case(name: str, device: torch.device, quick: bool = False,
                      width_floor: int = WIDTH) -> ScatterCase:  # fmt: skip
    """The batch of distribution ``name`` (seeded by its name), on a pool ``width_floor``
    columns wide (``quick``: 64x narrower), narrowed to multiples of 1 024 (16) columns where
    the pool would pass ``POOL_MAX_BYTES``, or, where a run is longer, the next multiple past
    it."""
    lens = _dist(name, quick, torch.Generator().manual_seed(len(name)))
    unit = 16 if quick else 1024
    fits = max(unit, POOL_MAX_BYTES // (4 * (len(lens) + 1)) // unit * unit)
    width = min(width_floor // (64 if quick else 1), fits)
    width = max(width, -(-int(lens.max()) // unit) * unit)
    return make_scatter_case(lens, width=width, seed=1, device=device)


def strategies() -> dict[str, Callable[..., None]]:
    """name -> callable taking the scatter keywords."""
    out: dict[str, Callable[..., None]] = {"per_request_grid": scatter_per_request_grid}
    for s in STRATEGIES:
        out[s] = lambda s=s, **kw: scatter_req_token_ids(**kw, strategy=s)
    for name, params in BALANCED.items():
        out[name] = lambda p=params, **kw: launch_scatter_balanced(ScatterArgs(**kw), **p)
    return out


def _check_pool(case, pool: torch.Tensor, want: torch.Tensor, impl, **kw) -> None:
    pool.fill_(POISON_I32)
    impl(**case.kwargs(pool), **kw)
    if not torch.equal(pool, want):
        diff = (pool != want).nonzero()
        raise AssertionError(f"{diff.shape[0]} elements differ, first at {diff[0].tolist()}")


def run_distribution(
    name, device, meta, quick, names, broken, deadline, log, width_floor=WIDTH
) -> tuple[list[Row], list[tuple[float, float]] | None]:
    """The distribution's rows, and ``auto``'s and the grid's graph replays timed alternately
    (``SIDE_BY_SIDE_ROUNDS`` pairs, µs; ``None`` off CUDA or unless both were timed)."""
    work = distribution_case(name, device, quick, width_floor)
    width = work.width
    pool, want = work.fresh_pool(), work.fresh_pool()
    scatter_req_token_ids_ref(**work.kwargs(want))
    floor = floor_us(scatter_sector_bytes(work, pool), meta.copy_gbs)
    log(f"== {name}: bs={work.bs} tokens={work.total} width={width} floor={floor} "
        f"L0={meta.empty_launch_us}")  # fmt: skip
    check = partial(_check_pool, work, pool, want)
    case = Case("scatter", name, work.bs, work.total, floor, work.kwargs(pool), check)
    todo = [(s, None, f) for s, f in strategies().items() if names is None or s in names]
    rounds, rep_ms = (1, 1) if quick else (5, 50)
    rows = time_case(meta, device, case, todo, record_failures=True, deadline=deadline,
                     broken=broken, rep_ms=rep_ms, host_rounds=rounds)  # fmt: skip
    for r in rows:
        if r.status == "ok":
            times = (
                f"eager={fmt_us(r.eager_us)} graph={fmt_us(r.graph_us)} host={fmt_us(r.host_us)}"
            )
            log(f"   {r.strategy:18s} {times} vs floor+L0 {fmt_ratio(r.best_us, r.bound_us)}")
        else:
            log(f"   {r.strategy:18s} {r.status.upper()}: {r.error}")
    ok = {r.strategy for r in rows if r.status == "ok"}
    pairs = None
    if {"auto", "per_request_grid"} <= ok and time.monotonic() <= deadline:
        impls = strategies()  # the same calls the rows above timed
        calls = [partial(impls[k], **case.inputs) for k in ("auto", "per_request_grid")]
        try:  # a failure here costs the side-by-side ratio, not the rows measured above
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # as time_call does
                times = graph_times_interleaved_us(calls, device, SIDE_BY_SIDE_ROUNDS)
        except Exception as e:  # noqa: BLE001
            log(f"   auto / grid side by side: FAILED {_short(e)}")
            times = None
        pairs = None if times is None else list(zip(*times, strict=True))
        if pairs:
            log(f"   auto / grid side by side: {_side_by_side(pairs)}")
    return rows, pairs


SIDE_BY_SIDE_ROUNDS = 6  # alternate replays of auto's and the grid's graphs, for their ratio


def _ratio_range(pairs: list[tuple[float, float]]) -> tuple[float, float, float]:
    """Median, least and greatest of the pairs' ratios (first / second)."""
    ratios = sorted(a / g for a, g in pairs)
    return statistics.median(ratios), ratios[0], ratios[-1]


def _side_by_side(pairs: list[tuple[float, float]]) -> str:
    mid, lo, hi = _ratio_range(pairs)
    return f"{mid:.2f}x ({lo:.2f}-{hi:.2f})"


def _by_dist(rows: list[Row]) -> dict[str, dict[str, Row]]:
    out: dict[str, dict[str, Row]] = {}
    for r in rows:
        out.setdefault(r.distribution, {})[r.strategy] = r
    return out


def _best_balanced(vs: dict[str, Row]) -> Row | None:
    ok = [r for n, r in vs.items() if n in BALANCED and r.status == "ok" and r.best_us]
    return min(ok, key=lambda r: r.best_us) if ok else None


def markdown(
    rows: list[Row],
    meta: Meta,
    side: dict[str, list[tuple[float, float]]] | None = None,
    width: int = WIDTH,
) -> str:
    """The report; ``side``: per distribution, ``auto``'s and the grid's replays timed
    alternately, which then give the ``auto / grid`` column and its bar."""
    side = side or {}
    metric = "graph replay" if any(r.graph_us is not None for r in rows) else "eager (CPU)"
    lines = [
        f"# Scatter across length distributions: {meta.gpu}",
        "",
        meta.header(),
        "",
        f"µs, {metric}. floor: bytes at the copy bandwidth (32-byte write sectors); L0: an "
        "empty Triton kernel's graph replay. The bar, for `auto`: `<= 1.5x (floor + L0)` and "
        "`<= 1.0x grid`. `auto / grid`: on a GPU, the median ratio of "
        f"{SIDE_BY_SIDE_ROUNDS} rounds in which the two graphs' replays are timed alternately, "
        "each going first in turn (least and greatest in brackets); the columns before it "
        f"come from one timing each. Pools are {width} columns wide (an engine's longest "
        "context), or wider where a run is longer, or narrower where the pool would pass "
        f"{POOL_MAX_BYTES >> 30} GiB (each batch's width is in the run's log).",
        "",
        "| distribution | bs | tokens | floor + L0 | grid | capped | rows | flat | segments | "
        "sliced | auto | auto / (floor+L0) | auto / grid | bar | balanced | best balanced "
        "setting |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for dist, vs in _by_dist(rows).items():
        any_row = next(iter(vs.values()))

        def t(v: str, vs=vs) -> str:
            r = vs.get(v)
            return "-" if r is None else (fmt_us(r.best_us) if r.status == "ok" else r.status)

        auto, grid, best = vs.get("auto"), vs.get("per_request_grid"), _best_balanced(vs)
        a = auto.best_us if auto and auto.status == "ok" else None
        g = grid.best_us if grid and grid.status == "ok" else None
        bound = any_row.bound_us
        pairs = side.get(dist)
        vs_grid = _ratio_range(pairs)[0] if pairs else (a / g if a and g else None)
        vs_grid_txt = _side_by_side(pairs) if pairs else fmt_ratio(a, g)
        met = "-"
        if a is not None and bound:
            # The ratio to the grid as printed, to two decimals.
            met = (
                "yes"
                if a <= 1.5 * bound and (vs_grid is None or round(vs_grid, 2) <= 1.0)
                else "NO"
            )
        best_txt = f"{best.strategy} {fmt_us(best.best_us)}" if best else "-"
        lines.append(
            f"| {dist} | {any_row.bs} | {any_row.tokens} | {fmt_us(bound)} | "
            f"{t('per_request_grid')} | {t('capped')} | {t('rows')} | {t('flat')} | "
            f"{t('segments')} | {t('sliced')} | "
            f"{t('auto')} | {fmt_ratio(a, bound)} | {vs_grid_txt} | {met} | "
            f"{t('balanced')} | {best_txt} |"
        )
    params = ", ".join(
        f"`{n}` " + (" ".join(f"{k}={v}" for k, v in kw.items()) or "defaults")
        for n, kw in BALANCED.items()
    )
    lines += ["", "## All rows", "", f"Balanced settings: {params}.", ""]
    lines += rows_markdown(rows, ALL_COLUMNS, ALL_HEAD)
    return "\n".join(lines) + "\n"


ALL_COLUMNS = ["distribution", "strategy", "eager_us", "graph_us", "host_us", "floor_us",
               "empty_launch_us", "status", "error"]  # fmt: skip
ALL_HEAD = ["distribution", "strategy", "eager", "graph", "host", "floor", "L0", "status",
            "error"]  # fmt: skip


def _write_side_by_side(side: dict[str, list[tuple[float, float]]], path: Path) -> None:
    if side:
        lines = ["distribution,round,auto_graph_us,grid_graph_us"]
        lines += [
            f"{d},{k},{a:.3f},{g:.3f}" for d, ps in side.items() for k, (a, g) in enumerate(ps)
        ]
        path.write_text("\n".join(lines) + "\n")


def plot(rows: list[Row], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = _by_dist(rows)
    dists = list(groups)
    names = [v for v in strategies() if any(v in vs for vs in groups.values())]
    fig, ax = plt.subplots(figsize=(max(8, 1.1 * len(dists) + 3), 5.5))
    markers = "os^vD<>pP*Xhd"
    for i, v in enumerate(names):
        xs, ys = [], []
        for x, d in enumerate(dists):
            r = groups[d].get(v)
            denom = r.bound_us if r is not None and r.bound_us else None
            if r is not None and r.status == "ok" and r.best_us:
                xs.append(x + (i - len(names) / 2) * 0.04)
                ys.append(r.best_us / denom if denom else r.best_us)
        style = "-" if v in ("balanced", "auto", "per_request_grid") else ""
        ax.plot(xs, ys, marker=markers[i % len(markers)], linestyle=style, label=v, alpha=0.8)
    has_bound = any(r.bound_us for r in rows)
    if has_bound:
        ax.axhline(1.5, color="k", linestyle="--", linewidth=1, label="bar: 1.5x (floor + L0)")
    ax.set_yscale("log")
    ax.set_xticks(range(len(dists)), dists, rotation=30, ha="right")
    ax.set_ylabel("time / (floor + L0)" if has_bound else "µs (CPU interpreter: meaningless)")
    ax.set_title("scatter_req_token_ids by length distribution (lower is better)")
    ax.legend(fontsize=7, ncol=2)
    ax.grid(True, which="both", axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--quick", action="store_true", help="interpreter-sized batches")
    p.add_argument("--dists", nargs="+", choices=DISTRIBUTIONS, default=list(DISTRIBUTIONS))
    p.add_argument("--strategies", nargs="+", choices=list(strategies()), default=None)
    p.add_argument("--budget-s", type=float, help="skip what is left past this (330; quick 60)")
    p.add_argument("--width", type=int, default=WIDTH,
                   help=f"pool width, unless a run is longer (default {WIDTH}; an engine's "
                   "longest context, e.g. 131072, adds idle columns)")  # fmt: skip
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda":
        if device.index is not None:
            torch.cuda.set_device(device)
    elif os.environ.get("TRITON_INTERPRET") != "1":
        p.error("--device cpu needs TRITON_INTERPRET=1 before the kernels are imported (run it "
                "as python -m benchmarks.distributions, which sets it)")  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    meta = Meta.collect(device)
    print(f"# {meta}", flush=True)

    def log(msg: str) -> None:
        print(f"[{time.monotonic() - start:6.1f}s] {msg}", flush=True)

    rows: list[Row] = []
    side: dict[str, list[tuple[float, float]]] = {}
    deadline = start + (args.budget_s or (60.0 if args.quick else 330.0))
    broken = probe_compiles(device, log)
    for name in args.dists:
        try:
            dist_rows, pairs = run_distribution(
                name, device, meta, args.quick, args.strategies, broken, deadline, log, args.width
            )
            rows += dist_rows
            if pairs:
                side[name] = pairs
        except ContextLost as e:  # keep what was measured
            log(f"ABORTED: {e}")
            rows.append(meta.row("scatter", "-", None, 0, name, status="error", error=str(e)))
            break
        except Exception as e:  # noqa: BLE001  (e.g. out of memory building the case)
            log(f"{name}: FAILED {_short(e)}")
            rows.append(meta.row("scatter", "-", None, 0, name, status="error", error=_short(e)))
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if rows:
        write_csv(rows, args.out / "distributions.csv")
        _write_side_by_side(side, args.out / "auto_vs_grid.csv")
        text = markdown(rows, meta, side, args.width // (64 if args.quick else 1))
        (args.out / "distributions.md").write_text(text)
        print(text.split("## All rows")[0], flush=True)
        try:
            plot(rows, args.out / "distributions.png")
        except Exception as e:  # noqa: BLE001
            log(f"plot failed: {_short(e)}")
    log(f"wrote {args.out}/distributions.{{csv,md,png}}")
    wrong = [f"{r.distribution}/{r.strategy}" for r in rows if r.status == "wrong"]
    errors = [f"{r.distribution}/{r.strategy}" for r in rows if r.status == "error"]
    if wrong:
        print(f"WRONG RESULTS ({len(wrong)}): {', '.join(wrong)}", file=sys.stderr)
        return 1
    if errors:
        print(f"strategies that raised ({len(errors)}): {', '.join(errors)}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
