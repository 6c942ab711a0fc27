"""The chunk-size sweep's report: the best chunk size per (op, mix, bs, strategy), the summary
table printed at the end of ``kvcanary-dispatch sweep``, and its files ``sweep.csv`` (the rows of
``kvcanary_dispatch.cli.results``), ``sweep.md`` and ``sweep.png`` (matplotlib, imported only
here)."""

from __future__ import annotations

import math
import textwrap
from dataclasses import dataclass
from pathlib import Path

from .results import Row, fmt_ratio, fmt_us, rows_markdown, write_csv
from .sweep import CHUNKED, CPU_NOTE, OPS, SweepResult
from .workloads import MIXES

METRICS = {"kernel": "eager_us", "graph": "graph_us", "host": "host_us"}
_METRIC_TEXT = {
    "kernel": "kernel time: do_bench median on CUDA, wall-clock median on the CPU",
    "graph": "CUDA-graph replay median: device time without launch overhead; calls that sync "
    "with the host (scatter's loop, the torch reference) cannot be captured and are left out",
    "host": "host wall clock per call over back-to-back calls closed by one sync",
}


@dataclass
class Best:
    """The best chunk size of one chunked strategy at one (op, mix, bs)."""

    op: str
    mix: str
    bs: int
    strategy: str
    chunk: int
    value: float  # the metric, microseconds
    best_at_bs: float  # the best of every strategy measured at this (op, mix, bs)
    best_at_bs_strategy: str
    refs: dict[str, float]  # reference strategy -> metric
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
    keys = sorted(
        {(r.function, r.distribution, r.bs) for r in rows},
        key=lambda k: (*_panel_key(k[:2]), k[2]),
    )
    for op, mix, bs in keys:
        here = [r for r in rows if (r.function, r.distribution, r.bs) == (op, mix, bs)]
        overall = min(here, key=lambda r: _value(r, metric))
        refs = {r.strategy: _value(r, metric) for r in here if r.chunk is None}
        for strategy in CHUNKED[op]:
            mine = [r for r in here if r.strategy == strategy and r.chunk is not None]
            if not mine:
                continue
            b = min(mine, key=lambda r: _value(r, metric))
            label = overall.strategy + (f"@{overall.chunk}" if overall.chunk else "")
            out.append(
                Best(
                    op, mix, bs, strategy, int(b.chunk), _value(b, metric),
                    _value(overall, metric), label, refs, b.floor_us,
                )
            )  # fmt: skip
    return out


def summary_table(result: SweepResult) -> str:
    """Plain-text table: the best chunk size per (op, mix, bs, strategy) and its cost against
    the best measured call there, ``auto``, the per-request grid and the floor. Without a
    chunked strategy, the calls measured once; without any measurement, a line that says so."""
    metric = result.config.metric
    head = ("op", "mix", "bs", "strategy", "best chunk", f"{metric} us", "vs best", "vs auto",
            "vs grid", "vs floor")  # fmt: skip
    body = []
    for b in best_chunks(result.rows, metric):
        body.append(
            (
                b.op, b.mix, str(b.bs), b.strategy, str(b.chunk), fmt_us(b.value),
                fmt_ratio(b.value, b.best_at_bs), fmt_ratio(b.value, b.refs.get("auto")),
                fmt_ratio(b.value, b.refs.get("per_request_grid")), fmt_ratio(b.value, b.floor_us),
            )
        )  # fmt: skip
    if body:
        return _text_table(head, body)
    once = _once_table(result.rows, metric)
    if once is None:
        return "(nothing was measured)"
    return "(no chunked strategy was measured; the calls measured once:)\n" + once


def _once_table(rows: list[Row], metric: str) -> str | None:
    """Plain-text table of the calls without a chunk size, against the best of them at their
    (op, mix, bs), the per-request grid and the floor; ``None`` when there is none."""
    rows = [r for r in _ranked(rows, metric) if r.chunk is None]
    head = ("op", "mix", "bs", "strategy", f"{metric} us", "vs best", "vs grid", "vs floor")
    body = []
    for r in sorted(rows, key=lambda r: (*_panel_key((r.function, r.distribution)), r.bs)):
        here = [
            q
            for q in rows
            if (q.function, q.distribution, q.bs) == (r.function, r.distribution, r.bs)
        ]
        grid = next((_value(q, metric) for q in here if q.strategy == "per_request_grid"), None)
        v = _value(r, metric)
        body.append(
            (
                r.function, r.distribution, str(r.bs), r.strategy, fmt_us(v),
                fmt_ratio(v, min(_value(q, metric) for q in here)), fmt_ratio(v, grid),
                fmt_ratio(v, r.floor_us),
            )
        )  # fmt: skip
    return _text_table(head, body) if body else None


def _text_table(head: tuple[str, ...], body: list[tuple[str, ...]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in body)) for i, h in enumerate(head)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(head, widths, strict=True))]
    lines.append("  ".join("-" * w for w in widths))
    for r in body:
        lines.append("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)))
    return "\n".join(line.rstrip() for line in lines)


# ---------------------------------------------------------------- files


OUTPUT_NAMES = ("sweep.csv", "sweep.png", "sweep.md")  # what a sweep writes, in order


def write_outputs(result: SweepResult, out: Path) -> list[Path]:
    """Write ``OUTPUT_NAMES`` under ``out``; return their paths."""
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / name for name in OUTPUT_NAMES]
    write_csv(result.rows, paths[0])  # the header even with no row
    plot(result, paths[1])
    paths[2].write_text(markdown(result))
    return paths


def _device_title(result: SweepResult) -> str:
    if result.config.device.type != "cuda":
        return "the CPU (Triton interpreter)"
    return result.meta.gpu


_EVERY = ["function", "distribution", "bs", "tokens", "strategy", "chunk", "eager_us",
          "graph_us", "host_us", "launches", "floor_us"]  # fmt: skip
_EVERY_HEAD = ["op", "mix", "bs", "tokens", "strategy", "chunk", "kernel us", "graph us",
               "host us", "launches", "floor us"]  # fmt: skip


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
    lines += [
        meta.header(),
        "",
        f"Metric: `{col}` ({_METRIC_TEXT[metric]}), "
        "microseconds. Workloads: `kvcanary_dispatch.cli.workloads` (seeded)"
        + (f", scatter pool width {config.width}" if "scatter" in config.ops else "")
        + f". Batch sizes {', '.join(map(str, config.batch_sizes))}; strategies "
        f"{', '.join(config.strategies)}.",
        "",
        "## Best chunk size per batch size",
        "",
        "`vs best`: against the fastest call measured at that batch (any strategy or chunk); "
        "`vs auto`: against the default call (`chunk_size=None`); `vs grid`: against the "
        "per-request-grid baseline; `vs floor`: against the HBM floor.",
        "",
    ]
    bests = best_chunks(result.rows, metric)
    if bests:
        lines += [
            "| op | mix | bs | strategy | best chunk | us | vs best | fastest there | vs auto "
            "| vs grid | vs floor |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
    elif _ranked(result.rows, metric):
        lines.append("No chunked strategy was measured; the calls measured once are under "
                     "*Every measurement*.")  # fmt: skip
    else:
        lines.append("Nothing was measured.")
    for b in bests:
        lines.append(
            f"| {b.op} | {b.mix} | {b.bs} | {b.strategy} | {b.chunk} | {fmt_us(b.value)} | "
            f"{fmt_ratio(b.value, b.best_at_bs)} | {b.best_at_bs_strategy} | "
            f"{fmt_ratio(b.value, b.refs.get('auto'))} | "
            f"{fmt_ratio(b.value, b.refs.get('per_request_grid'))} | "
            f"{fmt_ratio(b.value, b.floor_us)} |"
        )
    lines += ["", "## What each chunk size costs against its strategy's best", ""]
    for op in OPS:
        chunks = sorted({r.chunk for r in result.rows if r.function == op and r.chunk})
        if not chunks:
            continue
        lines.append("| op | mix | bs | strategy | " + " | ".join(map(str, chunks)) + " |")
        lines.append("|---|---|---|---|" + "---|" * len(chunks))
        for b in bests:
            if b.op != op:
                continue
            cells = []
            for c in chunks:
                r = next(
                    (
                        r for r in result.rows
                        if (r.function, r.distribution, r.bs, r.strategy, r.chunk)
                        == (op, b.mix, b.bs, b.strategy, c)
                    ),
                    None,
                )  # fmt: skip
                cells.append("-" if r is None else fmt_ratio(_value(r, metric), b.value))
            lines.append(f"| {op} | {b.mix} | {b.bs} | {b.strategy} | " + " | ".join(cells) + " |")
        lines.append("")
    lines += ["## Every measurement", ""]
    lines += rows_markdown(result.rows, _EVERY, _EVERY_HEAD)
    if result.skipped:
        lines += ["", f"## Skipped ({len(result.skipped)})", ""]
        for s in result.skipped:
            p = s.point
            lines.append(f"- {p.op} {p.mix} bs={p.bs} {p.strategy} chunk={p.chunk}: {s.reason}")
    return "\n".join(lines) + "\n"


_REF_STYLE = {
    "auto": dict(ls=":", lw=1.6, color="tab:green", label="auto (chunk_size=None)"),
    "capped": dict(ls=":", lw=1.2, color="tab:purple", label="capped"),
    "flat": dict(ls=":", lw=1.2, color="tab:olive", label="flat"),
    "segments": dict(ls=":", lw=1.2, color="tab:cyan", label="segments"),
    "per_request_grid": dict(ls="--", lw=1.4, color="tab:red", label="per-request grid baseline"),
    "torch_ref": dict(ls="-.", lw=1.0, color="tab:gray", label="torch reference"),
    "fixed_block": dict(ls=(0, (1, 3)), lw=1.4, color="tab:brown", label="fixed-block launch"),
}
_FLOOR_SPAN = 100  # draw the floor only within this factor below the fastest call
_MIN_WIDTH = 9.0  # inches: a one-panel-wide plot still holds its title and a legend row
_TITLE_CHARS_PER_INCH = 10  # the 11-pt title's characters a line holds, per inch of width
_LEGEND_INCHES = 1.8  # one legend entry's width at 8 pt
_FLOOR_STYLE = dict(ls="-", lw=2.5, color="black", alpha=0.35, label="HBM floor")
_CURVE_STYLE = {
    "loop": dict(marker="o", color="tab:blue"),
    "sliced": dict(marker="s", color="tab:orange"),
    "scan": dict(marker="^", color="tab:purple"),
    "lookback": dict(marker="v", color="tab:pink"),
    "recount": dict(marker="D", color="tab:olive"),
}


def plot(result: SweepResult, path: Path) -> None:
    """One panel per (op, mix) row and batch-size column: the metric against chunk size (log
    axes), one line per chunked strategy, reference calls and the floor as horizontal lines."""
    # A Figure of its own, not pyplot's: the caller's backend and figures stay as they were,
    # and nothing is left registered if drawing or saving raises.
    from matplotlib.figure import Figure
    from matplotlib.ticker import NullLocator

    metric = result.config.metric
    rows = _ranked(result.rows, metric)
    panel_rows = sorted({(r.function, r.distribution) for r in rows}, key=_panel_key)
    bss = sorted({r.bs for r in rows})
    nr, nc = max(1, len(panel_rows)), max(1, len(bss))
    width, height = max(4.6 * nc + 0.6, _MIN_WIDTH), 3.3 * nr + 1.4
    fig = Figure(figsize=(width, height))
    axes = fig.subplots(nr, nc, squeeze=False)
    handles: dict[str, object] = {}
    for i, (op, mix) in enumerate(panel_rows):
        for j, bs in enumerate(bss):
            ax = axes[i][j]
            here = [r for r in rows if (r.function, r.distribution, r.bs) == (op, mix, bs)]
            if not here:
                ax.set_visible(False)
                continue
            chunks = sorted({r.chunk for r in here if r.chunk})
            for strategy in CHUNKED[op]:
                pts = sorted(
                    (r.chunk, _value(r, metric)) for r in here if r.strategy == strategy and r.chunk
                )
                if pts:
                    (h,) = ax.plot(*zip(*pts, strict=True), lw=1.8, ms=5, label=strategy,
                                   **_CURVE_STYLE[strategy])  # fmt: skip
                    handles.setdefault(strategy, h)
            for r in here:
                if r.chunk is None and r.strategy in _REF_STYLE:
                    h = ax.axhline(_value(r, metric), **_REF_STYLE[r.strategy])
                    handles.setdefault(r.strategy, h)
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
        sub.append("calls that sync with the host (scatter loop, torch ref.) have no graph time")
    if result.interrupted:
        sub.append("interrupted: partial results")
    chars = int(width * _TITLE_CHARS_PER_INCH)
    lines = textwrap.wrap(title, chars) + textwrap.wrap("; ".join(sub), chars)
    lines += textwrap.wrap(result.meta.versions(), chars)
    fig.suptitle("\n".join(lines), fontsize=11)
    if not rows:
        axes[0][0].text(0.5, 0.5, "no measurements", ha="center", va="center")
    order = [k for k in (*_CURVE_STYLE, *_REF_STYLE, "floor") if k in handles]
    labels = [_REF_STYLE[k]["label"] if k in _REF_STYLE else k for k in order]
    labels = ["HBM floor (12 B/token)" if k == "floor" else lab for k, lab in zip(order, labels,
              strict=True)]  # fmt: skip
    ncol = max(1, min(len(order), int(width // _LEGEND_INCHES)))
    legend_rows = math.ceil(len(order) / ncol)
    if order:
        fig.legend([handles[k] for k in order], labels, loc="lower center", ncol=ncol,
                   fontsize=8, frameon=False)  # fmt: skip
    # Room below the panels for the legend's rows (about 0.22 inch each) and above for the
    # title's lines (about 0.17 inch each).
    bottom = min(0.3, (0.1 + 0.22 * legend_rows) / height)
    top = 1 - min(0.3, 0.17 * len(lines) / height)
    fig.tight_layout(rect=(0, bottom, 1, top))
    fig.savefig(path, dpi=110)
