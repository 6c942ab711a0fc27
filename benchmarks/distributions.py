"""Scatter across length distributions: every strategy, the balanced kernel's variants and
the per-request grid, next to the bytes floor and an empty launch, in one run on one device.

    python -m benchmarks.distributions --out DIR              # a GPU: ~3-5 minutes
    python -m benchmarks.distributions --device cpu --quick --out DIR   # logic only

Per distribution: floor = bytes moved at the measured device copy bandwidth (flat_in read as
int64 for every written token, offsets and indices read once, each request's run written as
whole 32-byte sectors of its pool row); L0 = an empty Triton kernel's CUDA-graph replay, same
run. Each variant is checked byte for byte against the torch reference on a poisoned pool
before it is timed (eager = ``do_bench`` median, graph = CUDA-graph replay median, host = wall
clock per call, interleaved across the distribution's variants). The balanced variants are
first compiled in processes of their own, so a compiler crash costs one variant, not the run;
a variant that raises is recorded with its error and the run goes on; past ``--budget-s`` the
rest is skipped. Writes ``distributions.{csv,md,png}`` into ``--out``. Exit status: 0 all
good; 1 some variant gave a wrong result; 2 some variant raised.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

import torch

_CPU = not torch.cuda.is_available() or bool({"cpu", "--device=cpu"} & set(sys.argv[1:]))
if __name__ == "__main__" and _CPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported

import triton  # noqa: E402

from kvcanary_dispatch import scatter_req_token_ids  # noqa: E402
from kvcanary_dispatch.cli.per_request_grid import scatter_per_request_grid  # noqa: E402
from kvcanary_dispatch.cli.timing import graph_time_us, host_overhead_interleaved_us, kernel_time_us  # noqa: E402
from kvcanary_dispatch.testing.cases import POISON_I32, ScatterCase, make_scatter_case  # noqa: E402
from kvcanary_kernels import scatter_req_token_ids_ref  # noqa: E402
from kvcanary_kernels.scatter_balanced import launch_scatter_balanced  # noqa: E402

from .suite import Meta  # noqa: E402

STRATEGIES = ("flat", "segments", "sliced", "auto")
# The balanced kernel's variants: launcher keywords (the launcher's defaults first).
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
SECTOR = 32


@triton.jit
def _empty_kernel(x_ptr):
    pass


_PROBE = """
import json, sys, torch
from kvcanary_kernels.scatter_balanced import launch_scatter_balanced
dev = torch.device(sys.argv[2])
flat = torch.arange(1000, dtype=torch.int64, device=dev)
pool = torch.zeros(3, 1024, dtype=torch.int32, device=dev)
launch_scatter_balanced(flat_in=flat, offsets=torch.tensor([0, 1, 300, 1000], device=dev),
    req_pool_indices=torch.tensor([2, 0, 1], device=dev), pool_out=pool, **json.loads(sys.argv[1]))
torch.cuda.synchronize(dev) if dev.type == "cuda" else None
assert torch.equal(pool[0, :299].cpu(), torch.arange(1, 300, dtype=torch.int32))
"""


def probe_compiles(device: torch.device, log) -> dict[str, str]:
    """Compile and run each balanced variant once in a process of its own, all at once: a
    crash (a compiler assertion aborts the process) or a hang marks that variant broken
    instead of ending the run; a Python exception is left to the in-process run to record.
    Also warms Triton's cache. Returns {variant: error}."""
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
                 "decode_prefill_8192", "tiny_16_u1024")  # fmt: skip


def _dist(name: str, quick: bool, g: torch.Generator) -> torch.Tensor:
    """Segment lengths of one named distribution (``quick``: at most 64 requests, runs of 128
    tokens or more 64x shorter, so that the interpreter runs every variant in seconds)."""

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
    raise ValueError(f"unknown distribution {name!r}")


@dataclass
class Row:
    dist: str
    bs: int
    tokens: int
    written: int
    width: int
    floor_us: float | None
    empty_us: float | None
    variant: str
    params: str
    eager_us: float | None = None
    graph_us: float | None = None
    host_us: float | None = None
    status: str = "ok"  # ok | wrong | error | skipped
    error: str = ""

    @property
    def best_us(self) -> float | None:
        return self.graph_us if self.graph_us is not None else self.eager_us

    @property
    def bound_us(self) -> float | None:
        """floor + L0 (the bar's denominator)."""
        if self.floor_us is None or self.empty_us is None:
            return None
        return self.floor_us + self.empty_us


def floor_bytes(case: ScatterCase, pool: torch.Tensor) -> int:
    """Reads: each written token's int64, offsets, indices. Writes: whole 32-byte sectors."""
    lens = (case.offsets[1:] - case.offsets[:-1]).clamp(min=0, max=case.width).cpu()
    rows = case.req_pool_indices.cpu()
    start = pool.data_ptr() + rows * pool.stride(0) * pool.element_size()
    end = start + lens * pool.element_size()  # one past the last byte written
    sectors = torch.where(lens > 0, (end - 1) // SECTOR - start // SECTOR + 1, 0)
    return int(8 * lens.sum() + 8 * (2 * case.bs + 1) + SECTOR * sectors.sum())


def variants() -> dict[str, tuple[Callable[..., None], str]]:
    """name -> (callable taking the scatter keywords, parameters as text)."""
    out: dict[str, tuple[Callable[..., None], str]] = {
        "per_request_grid": (scatter_per_request_grid, "")
    }
    for s in STRATEGIES:
        out[s] = (lambda s=s, **kw: scatter_req_token_ids(**kw, strategy=s), f"strategy={s}")
    for name, params in BALANCED.items():
        text = " ".join(f"{k}={v}" for k, v in params.items()) or "defaults"
        out[name] = (lambda p=params, **kw: launch_scatter_balanced(**kw, **p), text)
    return out


def _short(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]


class ContextLost(RuntimeError):
    """A CUDA error poisoned the context: nothing further can run in this process."""


def _check_context(device: torch.device, what: str) -> None:
    if device.type == "cuda":
        try:
            torch.cuda.synchronize(device)
        except Exception as e:  # noqa: BLE001
            raise ContextLost(f"CUDA context lost after {what}: {_short(e)}") from e


def run_distribution(name, device, copy_gbs, quick, names, broken, deadline, log) -> list[Row]:
    g = torch.Generator().manual_seed(len(name))
    lens = _dist(name, quick, g)
    unit = 16 if quick else 1024
    width = max(WIDTH // (64 if quick else 1), -(-int(lens.max()) // unit) * unit)
    case = make_scatter_case(lens, width=width, seed=1, device=device)
    pool, want = case.fresh_pool(), case.fresh_pool()
    scatter_req_token_ids_ref(**case.kwargs(want))
    written = int((case.offsets[1:] - case.offsets[:-1]).clamp(min=0, max=width).sum())
    floor = floor_bytes(case, pool) / (copy_gbs * 1e3) if copy_gbs else None
    buf = torch.zeros(1, device=device)
    empty = graph_time_us(lambda: _empty_kernel[(1,)](buf), device)
    base = dict(dist=name, bs=case.bs, tokens=case.total, written=written, width=width)
    log(f"== {name}: bs={case.bs} tokens={case.total} width={width} floor={floor} L0={empty}")
    rows, fns = [], []
    for vname, (impl, params) in variants().items():
        if names is not None and vname not in names:
            continue
        row = Row(**base, floor_us=floor, empty_us=empty, variant=vname, params=params)
        rows.append(row)
        if time.monotonic() > deadline:
            row.status, row.error = "skipped", "time budget spent"
            continue
        if vname in broken:
            row.status, row.error = "error", broken[vname]
            continue
        fn = partial(impl, **case.kwargs(pool))
        try:
            pool.fill_(POISON_I32)
            fn()
            if not torch.equal(pool, want):
                diff = (pool != want).nonzero()
                row.status = "wrong"
                row.error = f"{diff.shape[0]} elements differ, first at {diff[0].tolist()}"
                log(f"   {vname:18s} WRONG RESULT: {row.error}")
                continue
            row.eager_us = kernel_time_us(fn, device, rep_ms=50 if not quick else 1)
            row.graph_us = graph_time_us(fn, device)
            fns.append((row, fn))
        except Exception as e:  # noqa: BLE001
            row.status, row.error = "error", _short(e)
            log(f"   {vname:18s} ERROR {row.error}")
            traceback.print_exc(limit=3)
            _check_context(device, f"{name}/{vname}")
    if fns:
        try:
            rounds = 1 if quick else 5
            host = host_overhead_interleaved_us([f for _, f in fns], device, rounds=rounds)
            for (row, _), us in zip(fns, host, strict=True):
                row.host_us = us
        except Exception as e:  # noqa: BLE001
            log(f"   host-time loop failed: {_short(e)}")
    for r in (r for r in rows if r.status == "ok"):
        log(
            f"   {r.variant:18s} eager={_us(r.eager_us)} graph={_us(r.graph_us)} "
            f"host={_us(r.host_us)} vs floor+L0 {_ratio(r.best_us, r.bound_us)}"
        )
    return rows


def _us(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


def _ratio(a: float | None, b: float | None) -> str:
    return "-" if a is None or not b else f"{a / b:.2f}x"


def write_csv(rows: list[Row], meta: Meta, path: Path) -> None:
    meta_d = asdict(meta)
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(meta_d) + list(asdict(rows[0])))
        w.writeheader()
        w.writerows({**meta_d, **asdict(r)} for r in rows)


def _by_dist(rows: list[Row]) -> dict[str, dict[str, Row]]:
    out: dict[str, dict[str, Row]] = {}
    for r in rows:
        out.setdefault(r.dist, {})[r.variant] = r
    return out


def _best_balanced(vs: dict[str, Row]) -> Row | None:
    ok = [r for n, r in vs.items() if n in BALANCED and r.status == "ok" and r.best_us]
    return min(ok, key=lambda r: r.best_us) if ok else None


def markdown(rows: list[Row], meta: Meta) -> str:
    metric = "graph replay" if any(r.graph_us is not None for r in rows) else "eager (CPU)"
    lines = [
        f"# Scatter across length distributions: {meta.device_name}",
        "",
        f"torch {meta.torch}, Triton {meta.triton}, commit {meta.commit}, {meta.date}; copy "
        f"bandwidth {meta.copy_gbs and round(meta.copy_gbs)} GB/s (read + write).",
        "",
        f"µs, {metric}. floor: bytes at the copy bandwidth (32-byte write sectors); L0: an "
        "empty Triton kernel's graph replay. Bar: `<= 1.5x (floor + L0)` and `<= 1.0x grid`.",
        "",
        "| distribution | bs | tokens | floor + L0 | grid | flat | segments | sliced | auto | "
        "balanced | best balanced variant | balanced / (floor+L0) | balanced / grid | bar |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for dist, vs in _by_dist(rows).items():
        any_row = next(iter(vs.values()))

        def t(v: str, vs=vs) -> str:
            r = vs.get(v)
            return "-" if r is None else (_us(r.best_us) if r.status == "ok" else r.status)

        bal, grid, best = vs.get("balanced"), vs.get("per_request_grid"), _best_balanced(vs)
        b = bal.best_us if bal and bal.status == "ok" else None
        g = grid.best_us if grid and grid.status == "ok" else None
        bound = any_row.bound_us
        met = "-"
        if b is not None and bound:
            met = "yes" if b <= 1.5 * bound and (g is None or b <= g) else "NO"
        best_txt = f"{best.variant} {_us(best.best_us)}" if best else "-"
        lines.append(
            f"| {dist} | {any_row.bs} | {any_row.tokens} | {_us(bound)} | {t('per_request_grid')} "
            f"| {t('flat')} | {t('segments')} | {t('sliced')} | {t('auto')} | {t('balanced')} | "
            f"{best_txt} | {_ratio(b, bound)} | {_ratio(b, g)} | {met} |"
        )
    head = (
        "| distribution | variant | params | eager | graph | host | floor | L0 | status | error |"
    )
    lines += ["", "## All rows", "", head + " |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r.dist} | {r.variant} | {r.params} | {_us(r.eager_us)} | {_us(r.graph_us)} | "
            f"{_us(r.host_us)} | {_us(r.floor_us)} | {_us(r.empty_us)} | {r.status} | "
            f"{r.error.replace('|', '/')} |"
        )
    return "\n".join(lines) + "\n"


def plot(rows: list[Row], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = _by_dist(rows)
    dists = list(groups)
    names = [v for v in variants() if any(v in vs for vs in groups.values())]
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
    p.add_argument("--variants", nargs="+", choices=list(variants()), default=None)
    p.add_argument("--budget-s", type=float, help="skip what is left past this (330; quick 60)")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda":
        if device.index is not None:
            torch.cuda.set_device(device)
    elif os.environ.get("TRITON_INTERPRET") != "1":
        p.error("--device cpu needs TRITON_INTERPRET=1 before the kernels are imported")
    args.out.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    meta = Meta.collect(device)
    print(f"# {meta}", flush=True)

    def log(msg: str) -> None:
        print(f"[{time.monotonic() - start:6.1f}s] {msg}", flush=True)

    rows: list[Row] = []
    deadline = start + (args.budget_s or (60.0 if args.quick else 330.0))
    broken = probe_compiles(device, log)
    for name in args.dists:
        try:
            rows += run_distribution(
                name, device, meta.copy_gbs, args.quick, args.variants, broken, deadline, log
            )
        except ContextLost as e:  # keep what was measured
            log(f"ABORTED: {e}")
            rows.append(Row(name, 0, 0, 0, 0, None, None, "-", "", status="error", error=str(e)))
            break
        except Exception as e:  # noqa: BLE001  (e.g. out of memory building the case)
            log(f"{name}: FAILED {_short(e)}")
            rows.append(Row(name, 0, 0, 0, 0, None, None, "-", "", status="error", error=_short(e)))
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if rows:
        write_csv(rows, meta, args.out / "distributions.csv")
        text = markdown(rows, meta)
        (args.out / "distributions.md").write_text(text)
        print(text.split("## All rows")[0], flush=True)
        try:
            plot(rows, args.out / "distributions.png")
        except Exception as e:  # noqa: BLE001
            log(f"plot failed: {_short(e)}")
    log(f"wrote {args.out}/distributions.{{csv,md,png}}")
    wrong = [f"{r.dist}/{r.variant}" for r in rows if r.status == "wrong"]
    errors = [f"{r.dist}/{r.variant}" for r in rows if r.status == "error"]
    if wrong:
        print(f"WRONG RESULTS ({len(wrong)}): {', '.join(wrong)}", file=sys.stderr)
        return 1
    if errors:
        print(f"variants that raised ({len(errors)}): {', '.join(errors)}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
