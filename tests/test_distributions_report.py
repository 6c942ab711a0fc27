"""The distribution benchmark's report: the side-by-side ratios take each round's own empty
launch, the bar reads them (as printed, to three decimals) where a run has rounds, the rounds
come from the right three calls in the right order, and a CPU run writes its files."""

from __future__ import annotations

import csv
import math

import pytest
import torch
from conftest import DEVICE

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
from kvcanary_dispatch.cli.timing import round_order

META = Meta("H", "t", "tr", "c", "d", copy_gbs=1000.0, empty_launch_us=4.0)
FLOOR = 0.5
# Six rounds, as a run takes: auto over floor + that round's L0 reads 1.20, 1.30, 1.40, 1.44,
# 1.50, 1.60 (median 1.42); auto over the grid 0.10, 0.11, 0.12, 0.14, 0.15, 0.16 (median 0.13).
ROUNDS = [
    (1.30 * 4.5, 1.30 * 4.5 / 0.11, 4.0),
    (1.20 * 4.3, 1.20 * 4.3 / 0.10, 3.8),
    (1.60 * 4.2, 1.60 * 4.2 / 0.16, 3.7),
    (1.44 * 4.6, 1.44 * 4.6 / 0.12, 4.1),
    (1.40 * 4.4, 1.40 * 4.4 / 0.15, 3.9),
    (1.50 * 4.5, 1.50 * 4.5 / 0.14, 4.0),
]


def _row(strategy: str, graph_us: float, dist: str = "drafts", **kw) -> Row:
    kw.setdefault("floor_us", FLOOR)
    return META.row("scatter", strategy, None, 16, dist, graph_us=graph_us, **kw)


def _same(n: int, auto: float, grid: float, empty: float) -> list[tuple[float, float, float]]:
    return [(auto, grid, empty)] * n


def test_each_round_has_its_own_empty_launch():
    assert vs_floor(ROUNDS, FLOOR) == pytest.approx((1.42, 1.20, 1.60))
    assert vs_grid(ROUNDS) == pytest.approx((0.13, 0.10, 0.16))


def test_a_zero_time_is_a_failed_timing():
    """A zero replay is a failed timing: an infinite ratio within rounds; as a row's one
    timing, no ratio and no bar (not a pass, and not a fail the printed cells cannot show)."""
    assert vs_grid([(5.0, 0.0, 4.0)]) == (math.inf, math.inf, math.inf)
    assert bar_met(_row("auto", 5.0), _row("per_request_grid", 0.0), None) == "-"
    assert bar_met(_row("auto", 0.0), _row("per_request_grid", 90.0), None) == "-"
    rows = [_row("auto", 0.0), _row("per_request_grid", 90.0)]
    cells = _summary_cells(markdown(rows, META, width=8192, pool_cap_gib=32, balanced={}))
    assert cells[10:15] == ["0.0", "-", "-", "-", "-"]


def test_no_grid_timing_no_bar():
    """Without rounds, a grid that failed or was not run leaves its bar unread: no verdict."""
    auto = _row("auto", 5.0)
    assert bar_met(auto, None, None) == "-"
    assert bar_met(auto, _row("per_request_grid", 90.0, status="wrong"), None) == "-"
    assert bar_met(auto, _row("per_request_grid", 90.0), None) == "yes"


def test_a_wrong_auto_misses_the_bar():
    wrong = _row("auto", 5.0, status="wrong")
    assert bar_met(wrong, _row("per_request_grid", 90.0), ROUNDS) == "NO"
    assert bar_met(wrong, _row("per_request_grid", 90.0), None) == "NO"


@pytest.mark.parametrize(
    "auto_us,rounds,want",
    [
        # One timing each: 7.0 / (0.5 + 4.0) = 1.56x, over the bar; its rounds read 1.42x.
        (7.0, None, "NO"),
        (7.0, ROUNDS, "yes"),
        # One timing under the bar (1.47x); the rounds, with a smaller L0, over it (1.57x).
        (6.6, None, "yes"),
        (6.6, _same(6, 6.6, 90.0, 3.7), "NO"),
        # As printed: 1.5004x prints 1.500x and passes; 1.5006x prints 1.501x and does not.
        (5.0, _same(6, 1.5004 * 4.5, 90.0, 4.0), "yes"),
        (5.0, _same(6, 1.5006 * 4.5, 90.0, 4.0), "NO"),
        # Under the floor bar, but over the grid's: 1.0004x prints 1.000x, 1.0006x 1.001x,
        # and a committed median, 1.0026x (a tie within noise), prints 1.003x: over the bar.
        (5.0, _same(6, 5.002, 5.0, 4.0), "yes"),
        (5.0, _same(6, 5.003, 5.0, 4.0), "NO"),
        (5.0, _same(6, 5.013, 5.0, 4.0), "NO"),
    ],
)
def test_the_bar_reads_the_rounds_where_there_are_some(auto_us, rounds, want):
    assert bar_met(_row("auto", auto_us), _row("per_request_grid", 90.0), rounds) == want


def test_no_bar_without_auto_or_floor():
    grid = _row("per_request_grid", 90.0)
    assert bar_met(None, grid, ROUNDS) == "-"
    assert bar_met(_row("auto", 5.0, floor_us=None), grid, ROUNDS) == "-"
    no_l0 = Meta("H", "t", "tr", "c", "d", copy_gbs=1000.0, empty_launch_us=None)
    auto = no_l0.row("scatter", "auto", None, 16, "drafts", floor_us=FLOOR, graph_us=7.0)
    assert bar_met(auto, grid, None) == "-"  # no L0 at all
    assert bar_met(auto, grid, ROUNDS) == "yes"  # the rounds hold their own


def test_markdown_prints_both_floor_ratios_and_the_rounds_bar():
    rows = [_row("auto", 7.0), _row("per_request_grid", 90.0)]
    text = markdown(rows, META, {"drafts": ROUNDS}, width=8192, pool_cap_gib=32, balanced={})
    cells = _summary_cells(text)
    assert cells[10:15] == ["7.0", "1.556x", "1.420x (1.20-1.60)", "0.130x (0.10-0.16)", "yes"]
    assert "median ratio of 6 rounds" in text
    # Without rounds the bar reads the one-timing cells, printed to the same decimals.
    cells = _summary_cells(markdown(rows, META, width=8192, pool_cap_gib=32, balanced={}))
    assert cells[10:15] == ["7.0", "1.556x", "-", "0.078x", "NO"]


def _summary_cells(text: str) -> list[str]:
    line = next(x for x in text.splitlines() if x.startswith("| drafts |"))
    return [c.strip() for c in line.strip("|").split("|")]


def test_each_call_goes_first_in_turn():
    assert [round_order(3, k) for k in range(4)] == [[0, 1, 2], [1, 2, 0], [2, 0, 1], [0, 1, 2]]
    assert [round_order(2, k) for k in range(3)] == [[0, 1], [1, 0], [0, 1]]


def test_rounds_are_auto_grid_and_the_empty_launch(monkeypatch):
    """``run_distribution`` hands the timer ``auto``'s call, the grid's and the empty launch,
    in that order, and keeps the times as (auto, grid, L0) rounds."""
    called: list[str] = []
    real = distributions.strategies()

    def tagged(name):
        def call(**kw):
            called.append(name)
            real[name](**kw)

        return call

    def fake_timer(fns, device, rounds):
        assert rounds == distributions.SIDE_BY_SIDE_ROUNDS  # (from distributions_report)
        called.clear()
        for fn in fns:
            fn()
        return [[10.0 + i + k for k in range(rounds)] for i in range(len(fns))]

    monkeypatch.setattr(distributions, "strategies", lambda: {
        n: tagged(n) for n in ("auto", "per_request_grid")
    })  # fmt: skip
    monkeypatch.setattr(distributions, "empty_launch", lambda d: lambda: called.append("L0"))
    monkeypatch.setattr(distributions, "graph_times_interleaved_us", fake_timer)
    meta = Meta.collect(torch.device(DEVICE), commit="test")
    rows, rounds = distributions.run_distribution(
        "tiny_8", torch.device(DEVICE), meta, True, None, {}, math.inf, lambda m: None
    )
    assert sorted((r.strategy, r.status) for r in rows) == [
        ("auto", "ok"),
        ("per_request_grid", "ok"),
    ]
    assert called == ["auto", "per_request_grid", "L0"]
    assert rounds == [(10.0 + k, 11.0 + k, 12.0 + k) for k in range(6)]


def test_rounds_file_holds_the_three_replays(tmp_path):
    path = tmp_path / "r.csv"
    write_rounds({"a": [(1.0, 2.0, 3.0)], "b": [(4.0, 5.0, 6.0), (7.0, 8.0, 9.5)]}, path)
    got = list(csv.DictReader(path.open()))
    assert list(got[0]) == ["distribution", "round", *ROUND_COLUMNS]
    assert [tuple(r.values()) for r in got] == [
        ("a", "0", "1.000", "2.000", "3.000"),
        ("b", "0", "4.000", "5.000", "6.000"),
        ("b", "1", "7.000", "8.000", "9.500"),
    ]
    write_rounds({}, tmp_path / "none.csv")
    assert not (tmp_path / "none.csv").exists()


def _quick_tiny_run(out, *extra: str) -> tuple[int, list[tuple[str, str]]]:
    """``--quick`` on tiny_8 into ``out``: the exit status and each row's (strategy, status)."""
    argv = ["--device", DEVICE, "--quick", "--out", str(out), "--dists", "tiny_8", *extra]
    status = distributions.main(argv)
    rows = read_csv(out / "distributions.csv")
    return status, sorted((r.strategy, r.status) for r in rows)


def test_a_quick_run_writes_its_rows_and_report(tmp_path):
    """``--quick`` on the suite's device: every row checked against the reference (a wrong
    result exits 1: the test below), the table and rows written; the rounds file on CUDA only
    (no rounds off it)."""
    status, rows = _quick_tiny_run(tmp_path, "--strategies", "auto", "per_request_grid")
    assert status == 0 and rows == [("auto", "ok"), ("per_request_grid", "ok")]
    assert "| tiny_8 | 4 |" in (tmp_path / "distributions.md").read_text()
    assert (tmp_path / "auto_vs_grid.csv").exists() == (DEVICE == "cuda")


def test_a_zero_budget_skips_everything_and_a_negative_one_is_refused(tmp_path, capsys):
    """``--budget-s 0`` is a budget of no seconds (every strategy skipped, none timed), not
    the default; a negative budget is a usage error naming the value."""
    status, rows = _quick_tiny_run(tmp_path, "--strategies", "auto", "--budget-s", "0")
    assert status == 0 and rows == [("auto", "skipped")]
    with pytest.raises(SystemExit) as exit_:
        _quick_tiny_run(tmp_path, "--strategies", "auto", "--budget-s", "-1")
    assert exit_.value.code == 2
    assert "--budget-s -1 is negative; pass 0 or more seconds" in capsys.readouterr().err


def test_a_wrong_strategy_is_a_wrong_row_and_exit_1(tmp_path, monkeypatch, capsys):
    """A strategy whose pool differs from the reference (here ``auto`` writing nothing) is
    recorded as ``wrong``, named on stderr, and the run exits 1; the others stay ``ok``."""
    real = distributions.strategies

    def auto_writes_nothing():
        impls = real()
        impls["auto"] = lambda **kw: None
        return impls

    monkeypatch.setattr(distributions, "strategies", auto_writes_nothing)
    status, rows = _quick_tiny_run(tmp_path, "--strategies", "auto", "per_request_grid")
    assert status == 1 and rows == [("auto", "wrong"), ("per_request_grid", "ok")]
    assert "WRONG RESULTS (1): tiny_8/auto" in capsys.readouterr().err
