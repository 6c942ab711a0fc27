"""The distribution benchmark's report: the side-by-side ratios take each round's own empty
launch, the bar reads them where a run has rounds, and a CPU run writes its files."""

from __future__ import annotations

import csv

import pytest

from benchmarks import distributions
from benchmarks.distributions_report import (
    ROUND_COLUMNS,
    bar_met,
    markdown,
    vs_floor,
    vs_grid,
    write_rounds,
)
from kvcanary_dispatch.cli.results import Meta, Row, read_csv

META = Meta("H", "t", "tr", "c", "d", copy_gbs=1000.0, empty_launch_us=4.0)
FLOOR = 0.5


def _row(strategy: str, graph_us: float, dist: str = "drafts") -> Row:
    return META.row("scatter", strategy, None, 16, dist, floor_us=FLOOR, graph_us=graph_us)


def test_each_round_has_its_own_empty_launch():
    rounds = [(6.0, 60.0, 4.0), (6.3, 63.0, 3.7), (9.0, 70.0, 5.5)]
    mid, lo, hi = vs_floor(rounds, FLOOR)
    assert (lo, mid, hi) == pytest.approx((6.0 / 4.5, 9.0 / 6.0, 6.3 / 4.2))
    assert vs_grid(rounds) == pytest.approx((0.1, 0.1, 9.0 / 70.0))


@pytest.mark.parametrize(
    "auto_us,rounds,want",
    [
        # One timing each: 7.0 / (0.5 + 4.0) = 1.56x, over the bar; its rounds read 1.43x.
        (7.0, None, "NO"),
        (7.0, [(6.6, 90.0, 4.0), (6.6, 90.0, 4.1), (6.7, 90.0, 4.2)], "yes"),
        # One timing under the bar; the rounds, with a smaller L0, over it.
        (6.6, [(6.6, 90.0, 3.8), (6.6, 90.0, 3.7), (6.6, 90.0, 4.0)], "NO"),
        # Under the floor bar, but slower than the grid: 1.01x printed.
        (5.0, [(5.05, 5.0, 4.0), (5.05, 5.0, 4.0), (5.05, 5.0, 4.0)], "NO"),
        (5.0, [(5.0, 5.01, 4.0), (5.0, 5.01, 4.0), (5.0, 5.01, 4.0)], "yes"),  # 0.998x: 1.00x
    ],
)
def test_the_bar_reads_the_rounds_where_there_are_some(auto_us, rounds, want):
    assert bar_met(_row("auto", auto_us), _row("per_request_grid", 90.0), rounds) == want


def test_no_bar_without_auto_or_floor():
    grid = _row("per_request_grid", 90.0)
    assert bar_met(None, grid, None) == "-"
    no_floor = META.row("scatter", "auto", None, 16, "drafts", graph_us=5.0)
    assert bar_met(no_floor, grid, None) == "-"


def test_markdown_prints_both_floor_ratios_and_the_rounds_bar():
    rows = [_row("auto", 7.0), _row("per_request_grid", 90.0)]
    rounds = {"drafts": [(6.6, 90.0, 4.0), (6.6, 90.0, 4.1), (6.7, 90.0, 4.2)]}
    text = markdown(rows, META, rounds, width=8192, pool_cap_gib=32, balanced={})
    line = next(x for x in text.splitlines() if x.startswith("| drafts |"))
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells[10:15] == ["7.0", "1.56x", "1.43x (1.43-1.47)", "0.07x (0.07-0.07)", "yes"]


def test_rounds_file_holds_the_three_replays(tmp_path):
    path = tmp_path / "r.csv"
    write_rounds({"a": [(1.0, 2.0, 3.0)], "b": [(4.0, 5.0, 6.0), (7.0, 8.0, 9.5)]}, path)
    got = list(csv.DictReader(path.open()))
    assert list(got[0]) == ["distribution", "round", *ROUND_COLUMNS]
    assert [(r["distribution"], r["round"], r["empty_graph_us"]) for r in got] == [
        ("a", "0", "3.000"), ("b", "0", "6.000"), ("b", "1", "9.500"),
    ]  # fmt: skip
    write_rounds({}, tmp_path / "none.csv")
    assert not (tmp_path / "none.csv").exists()


def test_a_cpu_run_writes_its_rows_and_report(tmp_path, capsys):
    """``--quick`` on the CPU (no rounds there): every row checked against the reference,
    the table made with the one-timing columns and no side-by-side ones."""
    argv = ["--device", "cpu", "--quick", "--out", str(tmp_path), "--dists", "tiny_8",
            "--strategies", "auto", "per_request_grid"]  # fmt: skip
    assert distributions.main(argv) == 0
    rows = read_csv(tmp_path / "distributions.csv")
    assert sorted((r.strategy, r.status) for r in rows) == [
        ("auto", "ok"), ("per_request_grid", "ok"),
    ]  # fmt: skip
    line = next(
        x for x in (tmp_path / "distributions.md").read_text().splitlines()
        if x.startswith("| tiny_8 |")
    )  # fmt: skip
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells[12] == "-" and cells[14] == "-"  # no rounds, no floor: no bar
    assert not (tmp_path / "auto_vs_grid.csv").exists()
