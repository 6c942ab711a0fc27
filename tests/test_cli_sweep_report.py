"""The sweep's report (summary table, ``sweep.md``) read on a result whose times are chosen
here: each ratio against its own column, the best chunk and the fastest call, the metric asked
for, an interrupted run and the skipped points."""

from __future__ import annotations

import torch

from kvcanary_dispatch.cli.results import Meta
from kvcanary_dispatch.cli.sweep import (
    Point,
    Skip,
    SweepConfig,
    SweepResult,
    enumerate_points,
    planned_launches,
)
from kvcanary_dispatch.cli.sweep_report import markdown, summary_table


def _made_up_sweep(metric: str = "kernel", interrupted: bool = False):
    """A sweep result with times chosen here: scatter ``ones`` bs=8, loop 40/20 us at chunks 4/8,
    sliced 10/30 us, auto 25 us, the per-request grid 50 us, a 5 us floor; two skipped points."""
    meta = Meta("cpu", "2.x", "3.x", "abc1234", "2026-01-01T00:00Z", None, None)

    def row(strategy, chunk, us, host_us):
        return meta.row("scatter", strategy, chunk, 8, "ones", eager_us=us, host_us=host_us,
                        floor_us=5.0, tokens=32, width=16)  # fmt: skip

    rows = [row("loop", 4, 40.0, 4.0), row("loop", 8, 20.0, 6.0), row("sliced", 4, 10.0, 9.0),
            row("sliced", 8, 30.0, 3.0), row("auto", None, 25.0, 7.0),
            row("per_request_grid", None, 50.0, 12.0)]  # fmt: skip
    config = SweepConfig(torch.device("cpu"), ops=("scatter",), batch_sizes=(8,),
                         mixes=("ones",), strategies=("loop", "sliced", "auto", "per_request_grid"),
                         width=16, metric=metric)  # fmt: skip
    skipped = [Skip(Point("scatter", "ones", 8, "loop", 2), "too many launches", "raise it"),
               Skip(Point("scatter", "ones", 8, "sliced", 2), "another reason", "fix")]  # fmt: skip
    return SweepResult(meta, rows, skipped, config, interrupted=interrupted)


def test_summary_table_figures_and_columns():
    """Best chunk per strategy and its ratios, each under its own header: loop's best is chunk
    8 (20 us): 20/10 against the fastest call (sliced@4), 20/25 against auto, 20/50 against the
    grid, 20/5 against the floor."""
    lines = summary_table(_made_up_sweep()).splitlines()
    assert lines[0] == ("op       mix   bs  strategy  best chunk  kernel us  vs best  vs auto  "
                        "vs grid  vs floor")  # fmt: skip
    assert lines[2:] == [
        "scatter  ones  8   loop      8           20.0       2.00x    0.80x    0.40x    4.00x",
        "scatter  ones  8   sliced    4           10.0       1.00x    0.40x    0.20x    2.00x",
    ]


def test_summary_table_reads_the_metric_asked_for():
    """``--metric host``: the host times (loop's best chunk is 4 at 4 us, not the kernel
    times' 8)."""
    lines = summary_table(_made_up_sweep("host")).splitlines()
    assert "host us" in lines[0] and "kernel us" not in lines[0]
    loop, sliced = (line.split() for line in lines[2:])
    # 4/3 against the fastest (sliced@8), 4/7 against auto, 4/12 against the grid, 4/5 the floor
    assert loop == ["scatter", "ones", "8", "loop", "4", "4.0", "1.33x", "0.57x", "0.33x", "0.80x"]
    assert sliced[4:7] == ["8", "3.0", "1.00x"]


def test_sweep_markdown_figures_columns_and_skipped_points():
    """``sweep.md``: the interrupted mark, the summary with the fastest call there, each chunk's
    cost against its strategy's best, every measurement's row, and the skipped points."""
    md = markdown(_made_up_sweep(interrupted=True)).splitlines()
    assert "**Interrupted: partial results.**" in md
    head = md.index("| op | mix | bs | strategy | best chunk | us | vs best | fastest there | "
                    "vs auto | vs grid | vs floor |")  # fmt: skip
    assert md[head + 2 : head + 4] == [
        "| scatter | ones | 8 | loop | 8 | 20.0 | 2.00x | sliced@4 | 0.80x | 0.40x | 4.00x |",
        "| scatter | ones | 8 | sliced | 4 | 10.0 | 1.00x | sliced@4 | 0.40x | 0.20x | 2.00x |",
    ]
    # each chunk against its strategy's best: loop 40/20 and 20/20, sliced 10/10 and 30/10
    cost = md.index("| op | mix | bs | strategy | 4 | 8 |")
    assert md[cost + 2 : cost + 4] == [
        "| scatter | ones | 8 | loop | 2.00x | 1.00x |",
        "| scatter | ones | 8 | sliced | 1.00x | 3.00x |",
    ]
    every = md.index("| op | mix | bs | tokens | strategy | chunk | kernel us | graph us | "
                     "host us | launches | floor us |")  # fmt: skip
    assert "| scatter | ones | 8 | 32 | auto | - | 25.0 | - | 7.0 | - | 5.0 |" in md[every:]
    assert md[-4:] == ["## Skipped (2)", "",
                       "- scatter ones bs=8 loop chunk=2: too many launches",
                       "- scatter ones bs=8 sliced chunk=2: another reason"]  # fmt: skip


def test_once_table_figures_and_columns():
    """No chunked strategy: each call against the fastest at its batch (auto, 25 us), the
    per-request grid (50 us) and the floor (5 us)."""
    result = _made_up_sweep()
    result.rows = [r for r in result.rows if r.chunk is None]
    lines = summary_table(result).splitlines()
    assert lines[0] == "(no chunked strategy was measured; the calls measured once:)"
    assert lines[1] == "op       mix   bs  strategy          kernel us  vs best  vs grid  vs floor"
    assert [line.split() for line in lines[3:]] == [
        ["scatter", "ones", "8", "auto", "25.0", "1.00x", "0.50x", "5.00x"],
        ["scatter", "ones", "8", "per_request_grid", "50.0", "2.00x", "1.00x", "10.00x"],
    ]


def test_a_loop_past_max_launches_is_skipped_without_its_plan():
    """A loop point with more slices than ``--max-launches`` is skipped by its slice count,
    a lower bound on its device ops, without listing its 1.25 * 10**9 slices (which took
    minutes); one within the limit by its plan's own count."""
    config = SweepConfig(torch.device("cpu"), ops=("scatter",), batch_sizes=(10**10, 8),
                         mixes=("ones",), strategies=("loop",), chunk_sizes=(8,),
                         max_launches=128)  # fmt: skip
    points, skipped = enumerate_points(config)
    assert [s.reason for s in skipped] == [
        "at least 1250000000 device ops a call (a launch a slice) > --max-launches 128"
    ]
    assert points == [Point("scatter", "ones", 8, "loop", 8)]
    assert planned_launches("scatter", "loop", 8, 8) == 5  # a launch, its rebase, a read-back
