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
(the csv in the results schema; ``benchmarks.distributions_report`` makes the table and the
plot) into ``--out``, and on a GPU ``auto_vs_grid.csv``: ``auto``'s, the grid's and the empty
launch's graph replays timed in turn, ``SIDE_BY_SIDE_ROUNDS`` rounds a distribution. Exit status:
0 all good; 1 some strategy gave a wrong result; 2 some strategy raised.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

from benchmarks import checked_device, interpreter_off_gpu

interpreter_off_gpu(__name__)  # before any kernel module is imported

from benchmarks.distributions_report import (  # noqa: E402
    SIDE_BY_SIDE_ROUNDS,
    Round,
    fmt_spread,
    markdown,
    plot,
    vs_floor,
    vs_grid,
    write_rounds,
)
from kvcanary_dispatch import scatter_req_token_ids  # noqa: E402
from kvcanary_dispatch.cli.command import current_cuda_device_kept  # noqa: E402
from kvcanary_dispatch.cli.harness import Case, ContextLost, _short, time_case  # noqa: E402
from kvcanary_dispatch.cli.per_request_grid import scatter_per_request_grid  # noqa: E402
from kvcanary_dispatch.cli.results import Meta, Row, fmt_ratio, fmt_us, write_csv  # noqa: E402
from kvcanary_dispatch.cli.timing import (  # noqa: E402
    empty_launch,
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
    "balanced": {},  # launch_scatter_balanced's own defaults
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
PLOT_LINES = ("balanced", "auto", "per_request_grid")  # drawn joined in the plot
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
        return x.round().to(torch.int64)  # the whole tail: sigma 2's longest run is 125 343
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
    name: str,
    device: torch.device,
    meta: Meta,
    quick: bool,
    names: list[str] | None,
    broken: dict[str, str],
    deadline: float,
    log: Callable[[str], None],
    width_floor: int = WIDTH,
) -> tuple[list[Row], list[Round] | None]:
    """The distribution's rows, and its rounds: ``auto``'s, the grid's and an empty launch's
    graph replays timed in turn (``SIDE_BY_SIDE_ROUNDS`` of them, µs; ``None`` off CUDA or
    unless ``auto`` and the grid were both timed)."""
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
    host_rounds, rep_ms = (1, 1) if quick else (5, 50)
    rows = time_case(meta, device, case, todo, record_failures=True, deadline=deadline,
                     broken=broken, rep_ms=rep_ms, host_rounds=host_rounds)  # fmt: skip
    for r in rows:
        if r.status == "ok":
            times = (
                f"eager={fmt_us(r.eager_us)} graph={fmt_us(r.graph_us)} host={fmt_us(r.host_us)}"
            )
            log(f"   {r.strategy:18s} {times} vs floor+L0 {fmt_ratio(r.best_us, r.bound_us)}")
        else:
            log(f"   {r.strategy:18s} {r.status.upper()}: {r.error}")
    ok = {r.strategy for r in rows if r.status == "ok"}
    side = None
    if {"auto", "per_request_grid"} <= ok and time.monotonic() <= deadline:
        impls = strategies()  # the same calls the rows above timed
        calls = [partial(impls[k], **case.inputs) for k in ("auto", "per_request_grid")]
        try:  # a failure here costs the side-by-side ratios, not the rows measured above
            calls.append(empty_launch(device))
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # as time_call does
                times = graph_times_interleaved_us(calls, device, SIDE_BY_SIDE_ROUNDS)
        except Exception as e:  # noqa: BLE001
            log(f"   side by side: FAILED {_short(e)}")
            times = None
        side = None if times is None else list(zip(*times, strict=True))
        if side:
            log(f"   auto / grid side by side: {fmt_spread(vs_grid(side))}")
            if floor is not None:
                log(f"   auto / (floor + L0) side by side: {fmt_spread(vs_floor(side, floor))}")
    return rows, side


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
    if args.budget_s is not None and args.budget_s < 0:
        p.error(f"--budget-s {args.budget_s:g} is negative; pass 0 or more seconds")
    device = checked_device(p, args.device)
    args.out.mkdir(parents=True, exist_ok=True)
    with current_cuda_device_kept():  # the timers use the current device: make it this one
        if device.type == "cuda" and device.index is not None:
            torch.cuda.set_device(device)
        return _run(args, device)


def _run(args: argparse.Namespace, device: torch.device) -> int:
    """Every distribution timed on ``device``, the outputs written; the exit status."""
    start = time.monotonic()
    meta = Meta.collect(device)
    print(f"# {meta}", flush=True)

    def log(msg: str) -> None:
        print(f"[{time.monotonic() - start:6.1f}s] {msg}", flush=True)

    rows: list[Row] = []
    side: dict[str, list[Round]] = {}
    budget = args.budget_s if args.budget_s is not None else (60.0 if args.quick else 330.0)
    deadline = start + budget
    broken = probe_compiles(device, log)
    for name in args.dists:
        try:
            dist_rows, rounds = run_distribution(
                name, device, meta, args.quick, args.strategies, broken, deadline, log, args.width
            )
            rows += dist_rows
            if rounds:
                side[name] = rounds
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
        write_rounds(side, args.out / "auto_vs_grid.csv")
        width = args.width // (64 if args.quick else 1)
        text = markdown(rows, meta, side, width=width, pool_cap_gib=POOL_MAX_BYTES >> 30,
                        balanced=BALANCED)  # fmt: skip
        (args.out / "distributions.md").write_text(text)
        print(text.split("## All rows")[0], flush=True)
        try:
            plot(rows, args.out / "distributions.png", strategies(), PLOT_LINES)
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
