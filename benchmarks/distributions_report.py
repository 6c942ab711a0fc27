"""The distribution benchmark's report: its table, its plot and its rounds file, from the rows
and rounds that ``benchmarks.distributions`` measures.

A round is one replay each of ``auto``'s graph, the per-request grid's and an empty launch's
(L0), timed one after another, each going first in turn (``cli.timing.round_order``). The
ratios taken round by round, ``auto / grid`` and ``auto / (floor + L0)``, are measured side by
side; the bar reads their medians where a run has rounds (a GPU), else the one timing of each
that the rows hold, and reads every ratio as printed: to ``BAR_DECIMALS`` decimals, enough that
a median a few tenths of a percent over a bar prints over it.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping
from pathlib import Path

from kvcanary_dispatch.cli.results import Meta, Row, fmt_us, rows_markdown

ROUND_COLUMNS = ("auto_graph_us", "grid_graph_us", "empty_graph_us")
Round = tuple[float, float, float]  # auto's, the grid's and the empty launch's replays, µs
SIDE_BY_SIDE_ROUNDS = 6  # rounds of replays timed in turn (auto's, a baseline's, L0's)
BAR_VS_FLOOR = 1.5  # auto <= 1.5x (floor + L0)
BAR_VS_GRID = 1.0  # auto <= 1.0x the per-request grid
BAR_DECIMALS = 3  # the bar reads each ratio as printed, to this many decimals

ALL_COLUMNS = ["distribution", "strategy", "eager_us", "graph_us", "host_us", "floor_us",
               "empty_launch_us", "status", "error"]  # fmt: skip
ALL_HEAD = ["distribution", "strategy", "eager", "graph", "host", "floor", "L0", "status",
            "error"]  # fmt: skip


def _ratio(a: float, b: float) -> float:
    return a / b if b > 0 else math.inf  # a zero time is a failed timing, not a fast one


def spread(ratios: Iterable[float]) -> tuple[float, float, float]:
    """Median, least and greatest of the ratios."""
    r = sorted(ratios)
    return statistics.median(r), r[0], r[-1]


def vs_grid(rounds: list[Round]) -> tuple[float, float, float]:
    """``auto / grid``, round by round: ``spread``'s triple."""
    return spread(_ratio(a, g) for a, g, _ in rounds)


def vs_floor(rounds: list[Round], floor: float) -> tuple[float, float, float]:
    """``auto / (floor + L0)`` with each round's own L0 (``floor``: µs): ``spread``'s triple."""
    return spread(_ratio(a, floor + e) for a, _, e in rounds)


def fmt_bar_ratio(x: float | None) -> str:
    """A ratio the bar reads, as the table prints it: ``"1.432x"`` (``-``: not measured)."""
    return "-" if x is None else f"{x:.{BAR_DECIMALS}f}x"


def fmt_spread(mid_lo_hi: tuple[float, float, float]) -> str:
    """``spread``'s triple as the table prints it: ``"1.432x (1.41-1.47)"``."""
    mid, lo, hi = mid_lo_hi
    return f"{fmt_bar_ratio(mid)} ({lo:.2f}-{hi:.2f})"


def write_rounds(side: Mapping[str, list[Round]], path: Path) -> None:
    """``side`` (distribution -> its rounds) as csv; nothing when it is empty."""
    if side:
        lines = [",".join(("distribution", "round", *ROUND_COLUMNS))]
        lines += [
            f"{d},{k}," + ",".join(f"{t:.3f}" for t in r)
            for d, rounds in side.items()
            for k, r in enumerate(rounds)
        ]
        path.write_text("\n".join(lines) + "\n")


def by_dist(rows: list[Row]) -> dict[str, dict[str, Row]]:
    """The rows by distribution, then by strategy, in the order they came."""
    out: dict[str, dict[str, Row]] = {}
    for r in rows:
        out.setdefault(r.distribution, {})[r.strategy] = r
    return out


def _ok_us(r: Row | None) -> float | None:
    """The row's time, or ``None`` where it was not timed, failed, or read zero (a failed
    timing, not a fast one)."""
    ok = r is not None and r.status == "ok" and r.best_us is not None and r.best_us > 0
    return r.best_us if ok else None


def bar_met(row_auto: Row | None, row_grid: Row | None, rounds: list[Round] | None) -> str:
    """Whether ``auto`` meets both bars: ``"yes"`` or ``"NO"``, from the rounds' medians where
    given (they hold their own L0), else from the rows' one timing each; ``"NO"`` where
    ``auto``'s output was wrong; ``"-"`` where ``auto``, the floor or, without rounds, the
    grid or L0 was not measured (a bar not read is not met)."""
    if row_auto is not None and row_auto.status == "wrong":
        return "NO"
    a, g = _ok_us(row_auto), _ok_us(row_grid)
    floor = row_auto.floor_us if row_auto is not None else None
    if a is None or floor is None:
        return "-"
    if rounds:
        to_floor, to_grid = vs_floor(rounds, floor)[0], vs_grid(rounds)[0]
    elif row_auto.bound_us is None or g is None:
        return "-"
    else:
        to_floor, to_grid = _ratio(a, row_auto.bound_us), _ratio(a, g)
    met = round(to_floor, BAR_DECIMALS) <= BAR_VS_FLOOR
    return "yes" if met and round(to_grid, BAR_DECIMALS) <= BAR_VS_GRID else "NO"


def _one_timing_ratio(a: float | None, b: float | None) -> str:
    return fmt_bar_ratio(a / b if a is not None and b else None)


def markdown(
    rows: list[Row],
    meta: Meta,
    side: Mapping[str, list[Round]] | None = None,
    *,
    width: int,
    pool_cap_gib: int,
    balanced: Mapping[str, Mapping[str, object]],
) -> str:
    """The report: a summary line a distribution, then every row. ``side``: per distribution,
    its rounds (they give the side-by-side columns and the bar); ``width`` and
    ``pool_cap_gib``: the run's pool width and pool cap, for the text; ``balanced``: the
    balanced kernel's settings by strategy name, for the best one's column and their legend."""
    side = side or {}
    metric = "graph replay" if any(r.graph_us is not None for r in rows) else "eager (CPU)"
    n = max((len(v) for v in side.values()), default=0)
    lines = [
        f"# Scatter across length distributions: {meta.gpu}",
        "",
        meta.header(),
        "",
        f"µs, {metric}. floor: bytes at the copy bandwidth (32-byte write sectors); L0: an "
        f"empty Triton kernel's graph replay. The bar, for `auto`: `<= {BAR_VS_FLOOR}x (floor "
        f"+ L0)` and `<= {BAR_VS_GRID}x grid`, each ratio as printed ({BAR_DECIMALS} decimals). "
        "The side-by-side "
        f"columns: on a GPU, the median ratio of {n or 'the'} rounds in which `auto`'s, the "
        "grid's and the empty launch's graphs are replayed one after another, each going "
        "first in turn (least and greatest in brackets), the floor + L0 one with each round's "
        "own L0; the bar reads them where they were measured (without them, the `auto / grid` "
        "column is one timing each). The other columns come from one timing each (L0 timed once at "
        f"the run's start). Pools are {width} columns wide (an engine's longest context), or "
        f"wider where a run is longer, or narrower where the pool would pass {pool_cap_gib} GiB "
        "(each batch's width is in the run's log).",
        "",
        "| distribution | bs | tokens | floor + L0 | grid | capped | rows | flat | segments | "
        "sliced | auto | auto / (floor+L0) | auto / (floor+L0), side by side | auto / grid, "
        "side by side | bar | balanced | best balanced setting |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for dist, vs in by_dist(rows).items():
        any_row = next(iter(vs.values()))

        def t(v: str, vs=vs) -> str:
            r = vs.get(v)
            return "-" if r is None else (fmt_us(r.best_us) if r.status == "ok" else r.status)

        auto, grid = vs.get("auto"), vs.get("per_request_grid")
        a, g, bound = _ok_us(auto), _ok_us(grid), any_row.bound_us
        rounds = side.get(dist)
        floor = any_row.floor_us
        to_floor = fmt_spread(vs_floor(rounds, floor)) if rounds and floor is not None else "-"
        to_grid = fmt_spread(vs_grid(rounds)) if rounds else _one_timing_ratio(a, g)
        ok = [r for n, r in vs.items() if n in balanced and _ok_us(r)]
        best = min(ok, key=lambda r: r.best_us) if ok else None
        best_txt = f"{best.strategy} {fmt_us(best.best_us)}" if best else "-"
        lines.append(
            f"| {dist} | {any_row.bs} | {any_row.tokens} | {fmt_us(bound)} | "
            f"{t('per_request_grid')} | {t('capped')} | {t('rows')} | {t('flat')} | "
            f"{t('segments')} | {t('sliced')} | {t('auto')} | {_one_timing_ratio(a, bound)} | "
            f"{to_floor} | {to_grid} | {bar_met(auto, grid, rounds)} | {t('balanced')} | "
            f"{best_txt} |"
        )
    params = ", ".join(
        f"`{n}` " + (" ".join(f"{k}={v}" for k, v in kw.items()) or "defaults")
        for n, kw in balanced.items()
    )
    lines += ["", "## All rows", "", f"Balanced settings: {params}.", ""]
    lines += rows_markdown(rows, ALL_COLUMNS, ALL_HEAD)
    return "\n".join(lines) + "\n"


def plot(rows: list[Row], path: Path, order: Iterable[str], lines: Iterable[str]) -> None:
    """Each strategy's time over floor + L0 (µs where no floor), one x a distribution;
    ``order``: the strategies' legend order, ``lines``: those drawn joined."""
    from matplotlib.figure import Figure  # not pyplot's: the caller's backend is kept

    groups = by_dist(rows)
    dists = list(groups)
    names = [v for v in order if any(v in vs for vs in groups.values())]
    joined = set(lines)
    fig = Figure(figsize=(max(8, 1.1 * len(dists) + 3), 5.5))
    ax = fig.subplots()
    markers = "os^vD<>pP*Xhd"
    for i, v in enumerate(names):
        xs, ys = [], []
        for x, d in enumerate(dists):
            r = groups[d].get(v)
            us = _ok_us(r)
            if us:
                xs.append(x + (i - len(names) / 2) * 0.04)
                ys.append(us / r.bound_us if r.bound_us else us)
        style = "-" if v in joined else ""
        ax.plot(xs, ys, marker=markers[i % len(markers)], linestyle=style, label=v, alpha=0.8)
    has_bound = any(r.bound_us for r in rows)
    if has_bound:
        ax.axhline(BAR_VS_FLOOR, color="k", linestyle="--", linewidth=1,
                   label=f"bar: {BAR_VS_FLOOR}x (floor + L0)")  # fmt: skip
    ax.set_yscale("log")
    ax.set_xticks(range(len(dists)), dists, rotation=30, ha="right")
    ax.set_ylabel("time / (floor + L0)" if has_bound else "µs (CPU interpreter: meaningless)")
    ax.set_title("scatter_req_token_ids by length distribution (lower is better)")
    if ax.get_legend_handles_labels()[0]:  # (no rows measured: no legend to draw)
        ax.legend(fontsize=7, ncol=2)
    ax.grid(True, which="both", axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
