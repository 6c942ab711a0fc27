"""The chunk-size sweep behind ``kvcanary-dispatch sweep``.

Every point is one dispatched call (op, length mix, bs, strategy, chunk size) on a seeded
workload (``kvcanary_dispatch.cli.workloads``). Each call is first checked byte for byte against
the torch reference, then timed with the primitives the benchmark suite shares
(``kvcanary_dispatch.cli.timing``). Strategies that take a chunk size (scatter ``loop`` and
``sliced``, plan ``loop``, ``scan`` and ``lookback``) are swept over chunk sizes; the others
(``auto`` with no chunk size, ``flat``, ``segments``, the per-request-grid baseline, the torch
reference, the fixed-block launch) are measured once per batch and drawn as horizontal reference
lines, as is the HBM floor (12 bytes per moved token at the measured copy bandwidth; GPU only).

Outputs: ``sweep.csv`` (the suite's columns), ``sweep.png`` and ``sweep.md``.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import torch

from ..plan import PLAN_MAX_CHUNK
from ..scatter import SCATTER_MAX_CHUNK
from ..slicing import num_slices
from ..testing.cases import check_plan, check_scatter
from .progress import Progress
from .results import (
    BYTES_PER_TOKEN,
    Meta,
    Row,
    plan_variants,
    scatter_variants,
    write_csv,
)
from .timing import (
    count_launches,
    graph_time_us,
    host_overhead_us,
    kernel_time_us,
)
from .workloads import (
    MIXES,
    POOL_WIDTH,
    plan_workload,
    scatter_workload,
    written_tokens,
)

OPS = ("scatter", "plan")
CHUNKED = {"scatter": ("loop", "sliced"), "plan": ("loop", "scan", "lookback")}
UNCHUNKED = {
    "scatter": ("auto", "flat", "segments", "per_request_grid", "torch_ref", "fixed_block"),
    "plan": ("auto", "torch_ref", "fixed_block"),
}
STRATEGIES = (
    "loop",
    "sliced",
    "scan",
    "lookback",
    "auto",
    "flat",
    "segments",
    "per_request_grid",
    "torch_ref",
    "fixed_block",
)
DEFAULT_STRATEGIES = ("loop", "sliced", "scan", "auto", "per_request_grid", "torch_ref")
MAX_CHUNK = {"scatter": SCATTER_MAX_CHUNK, "plan": PLAN_MAX_CHUNK}
METRICS = {"kernel": "kernel_us", "graph": "graph_us", "host": "host_loop_us"}
_METRIC_TEXT = {
    "kernel": "kernel time: do_bench median on CUDA, wall-clock median on the CPU",
    "graph": "CUDA-graph replay median: device time without launch overhead; calls that sync "
    "with the host (loop, the torch reference) cannot be captured and are left out",
    "host": "host wall clock per call over back-to-back calls closed by one sync",
}
CPU_NOTE = (
    "CPU run: the kernels ran in Triton's interpreter, one program after another; these timings "
    "say nothing about GPU performance (they check that the sweep runs)."
)


def default_chunk_sizes(op: str) -> list[int]:
    """Powers of two below the op's register block, and its largest chunk: scatter 1..256 and
    511, plan 1..2048 and 4096."""
    top = MAX_CHUNK[op]
    return [1 << k for k in range(top.bit_length()) if (1 << k) < top] + [top]


@dataclass
class SweepConfig:
    """What to sweep. ``chunk_sizes=None``: each op's ``default_chunk_sizes``."""

    device: torch.device
    ops: tuple[str, ...] = ("scatter",)
    batch_sizes: tuple[int, ...] = (512, 4096, 32768)
    mixes: tuple[str, ...] = tuple(MIXES)
    chunk_sizes: tuple[int, ...] | None = None
    strategies: tuple[str, ...] = DEFAULT_STRATEGIES
    width: int = POOL_WIDTH
    max_launches: int = 1024
    metric: str = "kernel"

    def chunks_for(self, op: str) -> list[int]:
        sizes = self.chunk_sizes if self.chunk_sizes is not None else default_chunk_sizes(op)
        return sorted({c for c in sizes if 1 <= c <= MAX_CHUNK[op]})


def default_config(device: torch.device) -> SweepConfig:
    """GPU: bs 512, 4096, 32768, every mix, every default chunk size, pool width 8192, at most
    1024 launches a call. CPU (interpreter): a grid that runs in about a minute on two cores."""
    if device.type == "cuda":
        return SweepConfig(device)
    return SweepConfig(
        device,
        batch_sizes=(64, 600),
        mixes=("ones", "u128"),
        chunk_sizes=(8, 64, 511),
        width=64,
        max_launches=128,
    )


@dataclass(frozen=True)
class Point:
    op: str
    mix: str
    bs: int
    variant: str
    chunk: int | None


def planned_launches(op: str, variant: str, bs: int, chunk: int | None) -> int:
    """Device operations one call makes, from host arithmetic (loop: one a slice; plan loop adds
    the carry's zero fill, plan lookback its state's; a scan is two launches)."""
    if variant == "loop" and chunk is not None:
        return num_slices(bs, chunk) + (1 if op == "plan" else 0)
    return 2 if (op, variant) in (("plan", "scan"), ("plan", "lookback")) else 1


def enumerate_points(config: SweepConfig) -> tuple[list[Point], list[tuple[Point, str]]]:
    """The points to measure, in run order, and the skipped ones with the reason."""
    points: list[Point] = []
    skipped: list[tuple[Point, str]] = []
    for op in config.ops:
        mixes = config.mixes if op == "scatter" else ("decode",)
        block = MAX_CHUNK[op]  # the fixed-block launch's request limit
        for mix in mixes:
            for bs in config.batch_sizes:
                for variant in config.strategies:
                    if variant in CHUNKED[op]:
                        for chunk in config.chunks_for(op):
                            p = Point(op, mix, bs, variant, chunk)
                            n = planned_launches(op, variant, bs, chunk)
                            if n > config.max_launches:
                                reason = (
                                    f"{n} kernel launches a call > --max-launches "
                                    f"{config.max_launches}"
                                )
                                skipped.append((p, reason))
                            else:
                                points.append(p)
                    elif variant in UNCHUNKED[op]:
                        p = Point(op, mix, bs, variant, None)
                        if variant == "fixed_block" and bs > block:
                            skipped.append((p, f"bs > the fixed block's {block} requests"))
                        else:
                            points.append(p)
    return points, skipped


@dataclass
class SweepResult:
    meta: Meta
    rows: list[Row]
    skipped: list[tuple[Point, str]]
    config: SweepConfig
    interrupted: bool = False
    notes: list[str] = field(default_factory=list)


class SweepCheckError(AssertionError):
    """A measured call disagreed with the torch reference."""


def _measure(fn: Callable[[], None], device: torch.device) -> dict:
    """The suite's timings; on the CPU (interpreter) the fewest calls that give a number."""
    kernel = kernel_time_us(fn, device)
    if device.type != "cuda":
        host = host_overhead_us(fn, device, n=1, rounds=1)
        return dict(kernel_us=kernel, graph_us=None, host_loop_us=host, launches=None)
    n = max(3, min(100, int(2e5 / max(kernel, 1.0))))  # about 0.2 s a round
    with warnings.catch_warnings():
        # A call that syncs cannot be captured (graph_us = None): torch warns about the empty
        # graph; the profiler warns about its cycles. Neither says anything here.
        warnings.simplefilter("ignore", UserWarning)
        graph = graph_time_us(fn, device)
        launches = count_launches(fn, device)
    return dict(
        kernel_us=kernel,
        graph_us=graph,
        host_loop_us=host_overhead_us(fn, device, n=n),
        launches=launches,
    )


def run_sweep(
    config: SweepConfig,
    progress: Progress | None = None,
    log: Callable[[str], None] = print,
) -> SweepResult:
    """Measure every point of ``config``. Raises ``SweepCheckError`` when a call's output
    differs from the reference; a ``KeyboardInterrupt`` stops the sweep and returns what was
    measured (``interrupted=True``)."""
    device = config.device
    meta = Meta.collect(device)
    points, skipped = enumerate_points(config)
    if progress is not None:
        progress.total = len(points)
    result = SweepResult(meta, [], skipped, config)
    done = 0
    try:
        for (op, mix, bs), group in _grouped(points):
            if op == "scatter":
                case = scatter_workload(bs, mix, device, width=config.width)
                moved = written_tokens(case)
                gbs = meta.copy_gbs
                floor = BYTES_PER_TOKEN * moved / (gbs * 1e3) if gbs else None
                variants, tokens = scatter_variants(case), case.total
                out = dict(pool_out=case.fresh_pool())
                check, inputs = check_scatter, case.kwargs(out["pool_out"])
            else:
                case = plan_workload(bs, device)
                floor, variants, tokens = None, plan_variants(case), bs
                check, inputs = check_plan, {**case.inputs(), **case.fresh_outputs()}
            for p in group:
                if progress is not None:
                    chunk = f" chunk={p.chunk}" if p.chunk else ""
                    progress.update(done, f"{op} {mix} bs={bs} {p.variant}{chunk}")
                impl = variants[p.variant]
                kw = {"chunk_size": p.chunk} if p.chunk is not None else {}
                try:
                    check(impl, case, **kw)
                except AssertionError as err:
                    raise SweepCheckError(
                        f"{op} {p.variant} bs={bs} mix={mix} chunk={p.chunk} differs from the "
                        f"torch reference: {err}"
                    ) from err
                m = _measure(partial(impl, **inputs, **kw), device)
                row = Row(op, p.variant, bs, mix, tokens, p.chunk, **m, floor_us=floor)
                result.rows.append(row)
                done += 1
            del case, inputs
    except KeyboardInterrupt:
        result.interrupted = True
    finally:
        if progress is not None:
            progress.update(done, "done" if not result.interrupted else "interrupted")
            progress.close()
    return result


def _grouped(points: list[Point]) -> Iterable[tuple[tuple[str, str, int], list[Point]]]:
    """Consecutive points sharing (op, mix, bs): one workload each."""
    group: list[Point] = []
    for p in points:
        if group and (group[0].op, group[0].mix, group[0].bs) != (p.op, p.mix, p.bs):
            yield (group[0].op, group[0].mix, group[0].bs), group
            group = []
        group.append(p)
    if group:
        yield (group[0].op, group[0].mix, group[0].bs), group


# ---------------------------------------------------------------- analysis


@dataclass
class Best:
    """The best chunk size of one chunked strategy at one (op, mix, bs)."""

    op: str
    mix: str
    bs: int
    variant: str
    chunk: int
    value: float  # the metric, microseconds
    best_at_bs: float  # the best of every variant measured at this (op, mix, bs)
    best_at_bs_variant: str
    refs: dict[str, float]  # reference variant -> metric
    floor_us: float | None


def _panel_key(op_mix: tuple[str, str]) -> tuple[int, int]:
    op, mix = op_mix
    order = list(MIXES)
    return OPS.index(op), order.index(mix) if mix in order else len(order)


def _value(row: Row, metric: str) -> float | None:
    v = getattr(row, METRICS[metric])
    return None if v is None else float(v)


def _ranked(rows: list[Row], metric: str) -> list[Row]:
    """The rows that have ``metric`` (a call that syncs has no CUDA-graph time)."""
    return [r for r in rows if _value(r, metric) is not None]


def best_chunks(rows: list[Row], metric: str = "kernel") -> list[Best]:
    """Per (op, mix, bs) and chunked strategy, the chunk size with the lowest metric."""
    out = []
    rows = _ranked(rows, metric)
    keys = sorted({(r.op, r.mix, r.bs) for r in rows}, key=lambda k: (*_panel_key(k[:2]), k[2]))
    for op, mix, bs in keys:
        here = [r for r in rows if (r.op, r.mix, r.bs) == (op, mix, bs)]
        overall = min(here, key=lambda r: _value(r, metric))
        refs = {r.variant: _value(r, metric) for r in here if r.chunk_size is None}
        for variant in CHUNKED[op]:
            mine = [r for r in here if r.variant == variant and r.chunk_size is not None]
            if not mine:
                continue
            b = min(mine, key=lambda r: _value(r, metric))
            label = overall.variant + (f"@{overall.chunk_size}" if overall.chunk_size else "")
            out.append(
                Best(
                    op, mix, bs, variant, int(b.chunk_size), _value(b, metric),
                    _value(overall, metric), label, refs, b.floor_us,
                )
            )  # fmt: skip
    return out


def _ratio(a: float | None, b: float | None) -> str:
    if a is None or b is None or b <= 0:
        return "-"
    x = a / b
    return f"{x:.2f}x" if x < 100 else f"{x:.3g}x"


def _us(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x:.1f}" if x < 1e4 else f"{x:.3g}"


def summary_table(result: SweepResult) -> str:
    """Plain-text table: the best chunk size per (op, mix, bs, strategy) and its cost against
    the best measured call there, ``auto``, the per-request grid and the floor."""
    metric = result.config.metric
    head = ("op", "mix", "bs", "strategy", "best chunk", f"{metric} us", "vs best", "vs auto",
            "vs grid", "vs floor")  # fmt: skip
    body = []
    for b in best_chunks(result.rows, metric):
        body.append(
            (
                b.op, b.mix, str(b.bs), b.variant, str(b.chunk), _us(b.value),
                _ratio(b.value, b.best_at_bs), _ratio(b.value, b.refs.get("auto")),
                _ratio(b.value, b.refs.get("per_request_grid")), _ratio(b.value, b.floor_us),
            )
        )  # fmt: skip
    if not body:
        return "(no chunked strategy was measured)"
    widths = [max(len(h), *(len(r[i]) for r in body)) for i, h in enumerate(head)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(head, widths, strict=True))]
    lines.append("  ".join("-" * w for w in widths))
    for r in body:
        lines.append("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)))
    return "\n".join(line.rstrip() for line in lines)


# ---------------------------------------------------------------- files


def write_outputs(result: SweepResult, out: Path) -> list[Path]:
    """Write ``sweep.csv``, ``sweep.png`` and ``sweep.md`` under ``out``; return their paths."""
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "sweep.csv", out / "sweep.png", out / "sweep.md"]
    if result.rows:
        write_csv(result.rows, result.meta, paths[0])
    else:
        paths[0].write_text("")
    plot(result, paths[1])
    paths[2].write_text(markdown(result))
    return paths


def _device_title(result: SweepResult) -> str:
    if result.config.device.type != "cuda":
        return "the CPU (Triton interpreter)"
    return result.meta.device_name


def markdown(result: SweepResult) -> str:
    """The sweep's report: set-up, best chunk sizes, every chunk's cost against its strategy's
    best, the reference calls, and what was skipped."""
    meta, config, metric = result.meta, result.config, result.config.metric
    col = METRICS[metric]
    lines = [f"# Chunk-size sweep: {_device_title(result)}", ""]
    if config.device.type != "cuda":
        lines += [f"**{CPU_NOTE}**", ""]
    if result.interrupted:
        lines += ["**Interrupted: partial results.**", ""]
    gbs = f"{meta.copy_gbs:.0f} GB/s" if meta.copy_gbs else "not measured (no GPU)"
    lines += [
        f"torch {meta.torch}, Triton {meta.triton}, commit {meta.commit}, {meta.date}; "
        f"device copy bandwidth {gbs}.",
        "",
        f"Metric: `{col}` ({_METRIC_TEXT[metric]}), "
        "microseconds. Workloads: `kvcanary_dispatch.cli.workloads` (seeded), scatter pool width "
        f"{config.width}. Batch sizes {', '.join(map(str, config.batch_sizes))}; strategies "
        f"{', '.join(config.strategies)}.",
        "",
        "## Best chunk size per batch size",
        "",
        "`vs best`: against the fastest call measured at that batch (any strategy or chunk); "
        "`vs auto`: against the default call (`chunk_size=None`); `vs grid`: against the "
        "per-request-grid baseline; `vs floor`: against the HBM floor.",
        "",
        "| op | mix | bs | strategy | best chunk | us | vs best | fastest there | vs auto "
        "| vs grid | vs floor |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for b in best_chunks(result.rows, metric):
        lines.append(
            f"| {b.op} | {b.mix} | {b.bs} | {b.variant} | {b.chunk} | {_us(b.value)} | "
            f"{_ratio(b.value, b.best_at_bs)} | {b.best_at_bs_variant} | "
            f"{_ratio(b.value, b.refs.get('auto'))} | "
            f"{_ratio(b.value, b.refs.get('per_request_grid'))} | {_ratio(b.value, b.floor_us)} |"
        )
    lines += ["", "## What each chunk size costs against its strategy's best", ""]
    for op in OPS:
        chunks = sorted({r.chunk_size for r in result.rows if r.op == op and r.chunk_size})
        if not chunks:
            continue
        lines.append("| op | mix | bs | strategy | " + " | ".join(map(str, chunks)) + " |")
        lines.append("|---|---|---|---|" + "---|" * len(chunks))
        for b in best_chunks(result.rows, metric):
            if b.op != op:
                continue
            cells = []
            for c in chunks:
                r = next(
                    (
                        r for r in result.rows
                        if (r.op, r.mix, r.bs, r.variant, r.chunk_size)
                        == (op, b.mix, b.bs, b.variant, c)
                    ),
                    None,
                )  # fmt: skip
                cells.append("-" if r is None else _ratio(_value(r, metric), b.value))
            lines.append(f"| {op} | {b.mix} | {b.bs} | {b.variant} | " + " | ".join(cells) + " |")
        lines.append("")
    lines += [
        "## Every measurement",
        "",
        "| op | mix | bs | tokens | variant | chunk | kernel us | graph us | host us | launches "
        "| floor us |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result.rows:
        lines.append(
            f"| {r.op} | {r.mix} | {r.bs} | {r.tokens} | {r.variant} | "
            f"{'-' if r.chunk_size is None else r.chunk_size} | {_us(r.kernel_us)} | "
            f"{_us(r.graph_us)} | {_us(r.host_loop_us)} | "
            f"{'-' if r.launches is None else r.launches} | {_us(r.floor_us)} |"
        )
    if result.skipped:
        lines += ["", f"## Skipped ({len(result.skipped)})", ""]
        for p, reason in result.skipped:
            lines.append(f"- {p.op} {p.mix} bs={p.bs} {p.variant} chunk={p.chunk}: {reason}")
    return "\n".join(lines) + "\n"


_REF_STYLE = {
    "auto": dict(ls=":", lw=1.6, color="tab:green", label="auto (chunk_size=None)"),
    "flat": dict(ls=":", lw=1.2, color="tab:olive", label="flat"),
    "segments": dict(ls=":", lw=1.2, color="tab:cyan", label="segments"),
    "per_request_grid": dict(ls="--", lw=1.4, color="tab:red", label="per-request grid baseline"),
    "torch_ref": dict(ls="-.", lw=1.0, color="tab:gray", label="torch reference"),
    "fixed_block": dict(ls=(0, (1, 3)), lw=1.4, color="tab:brown", label="fixed-block launch"),
}
_FLOOR_SPAN = 100  # draw the floor only within this factor below the fastest call
_FLOOR_STYLE = dict(ls="-", lw=2.5, color="black", alpha=0.35, label="HBM floor")
_CURVE_STYLE = {
    "loop": dict(marker="o", color="tab:blue"),
    "sliced": dict(marker="s", color="tab:orange"),
    "scan": dict(marker="^", color="tab:purple"),
    "lookback": dict(marker="v", color="tab:pink"),
}


def plot(result: SweepResult, path: Path) -> None:
    """One panel per (op, mix) row and batch-size column: the metric against chunk size (log
    axes), one line per chunked strategy, reference calls and the floor as horizontal lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullLocator

    metric = result.config.metric
    rows = _ranked(result.rows, metric)
    panel_rows = sorted({(r.op, r.mix) for r in rows}, key=_panel_key)
    bss = sorted({r.bs for r in rows})
    nr, nc = max(1, len(panel_rows)), max(1, len(bss))
    fig, axes = plt.subplots(nr, nc, figsize=(4.6 * nc + 0.6, 3.3 * nr + 1.4), squeeze=False)
    handles: dict[str, object] = {}
    for i, (op, mix) in enumerate(panel_rows):
        for j, bs in enumerate(bss):
            ax = axes[i][j]
            here = [r for r in rows if (r.op, r.mix, r.bs) == (op, mix, bs)]
            if not here:
                ax.set_visible(False)
                continue
            chunks = sorted({r.chunk_size for r in here if r.chunk_size})
            for variant in CHUNKED[op]:
                pts = sorted(
                    (r.chunk_size, _value(r, metric))
                    for r in here
                    if r.variant == variant and r.chunk_size
                )
                if pts:
                    (h,) = ax.plot(*zip(*pts, strict=True), lw=1.8, ms=5, label=variant,
                                   **_CURVE_STYLE[variant])  # fmt: skip
                    handles.setdefault(variant, h)
            for r in here:
                if r.chunk_size is None and r.variant in _REF_STYLE:
                    h = ax.axhline(_value(r, metric), **_REF_STYLE[r.variant])
                    handles.setdefault(r.variant, h)
            floor = next((r.floor_us for r in here if r.floor_us), None)
            lowest = min(_value(r, metric) for r in here)
            if floor and floor >= lowest / _FLOOR_SPAN:
                handles.setdefault("floor", ax.axhline(floor, **_FLOOR_STYLE))

            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            if chunks:
                ax.set_xticks(chunks)
                ax.set_xticklabels([str(c) for c in chunks], fontsize=7)
                ax.set_xlim(chunks[0] / 1.4, chunks[-1] * 1.4)
            ax.xaxis.set_minor_locator(NullLocator())
            ax.grid(True, which="major", alpha=0.3)
            tokens = here[0].tokens
            title = f"{op} {mix}, bs={bs}" + (f" ({tokens} tokens)" if op == "scatter" else "")
            if floor and floor < lowest / _FLOOR_SPAN:  # a note, not an axis stretched to it
                title += f"; floor {floor:.2g} us, off scale"
            ax.set_title(title, fontsize=9)
            if j == 0:
                ax.set_ylabel(f"{metric} time (us)")
            if i == nr - 1:
                ax.set_xlabel("chunk size (requests per slice)")
    title = f"kvcanary-dispatch sweep on {_device_title(result)}: {metric} time vs chunk size"
    sub = []
    if result.config.device.type != "cuda":
        sub.append("CPU: Triton interpreter timings, they say nothing about GPU performance")
        sub.append("no HBM floor on the CPU")
    if metric == "graph":
        sub.append("calls that sync with the host (loop, torch reference) have no graph time")
    if result.interrupted:
        sub.append("interrupted: partial results")
    fig.suptitle(title + ("\n" + "; ".join(sub) if sub else ""), fontsize=11)
    if not rows:
        axes[0][0].text(0.5, 0.5, "no measurements", ha="center", va="center")
    order = [k for k in (*_CURVE_STYLE, *_REF_STYLE, "floor") if k in handles]
    labels = [_REF_STYLE[k]["label"] if k in _REF_STYLE else k for k in order]
    labels = ["HBM floor (12 B/token)" if k == "floor" else lab for k, lab in zip(order, labels,
              strict=True)]  # fmt: skip
    if order:
        fig.legend([handles[k] for k in order], labels, loc="lower center",
                   ncol=len(order) if len(order) <= 7 else -(-len(order) // 2), fontsize=8,
                   frameon=False)  # fmt: skip
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
