"""The plan-size benchmark's eager bar: plan ``auto``'s eager time at each bs over one
fixed-block launch's at 4 096 requests, from the same run, printed only when both were
measured; and a run of the benchmark itself on the test device, which checks every call
before it times it."""

from __future__ import annotations

from types import SimpleNamespace

from conftest import DEVICE

from benchmarks import plan_sizes


def _row(strategy: str, bs: int, eager_us: float | None):
    return SimpleNamespace(strategy=strategy, bs=bs, eager_us=eager_us)


def test_eager_bar_reads_auto_over_the_fixed_block_at_4096():
    rows = [_row("fixed_block", 512, 5.0), _row("auto", 4096, 9.7), _row("fixed_block", 4096, 31.3),
            _row("scan", 1048576, 70.0), _row("auto", 1048576, 70.2)]  # fmt: skip
    lines = plan_sizes.eager_bar(rows)
    assert lines[1].startswith("Eager `auto` over one fixed-block launch at bs = 4096 (31.3 µs")
    assert lines[3:] == ["- bs 4096: 0.31x (9.7 µs)", "- bs 1048576: 2.24x (70.2 µs)"]


def test_eager_bar_needs_both_timings():
    assert plan_sizes.eager_bar([_row("auto", 4096, 9.7)]) == []
    assert plan_sizes.eager_bar([_row("fixed_block", 4096, 31.3), _row("auto", 8, None)]) == []


def test_a_run_writes_its_tables(tmp_path):
    plan_sizes.main(["--device", DEVICE, "--bs", "300", "--out", str(tmp_path)])
    text = (tmp_path / "plan_sizes.md").read_text()
    assert "| 300 | auto |" in text and "| 300 | fixed_block |" in text


def test_graph_bar_reads_each_round_with_its_own_l0():
    side = {131072: ([18.0, 17.0, 19.0], [4.5, 5.0, 4.0], 3.1)}  # auto, L0, floor (µs)
    lines = plan_sizes.graph_bar(side)
    assert lines[1].startswith("Graphed `auto` over (floor + L0), side by side (6 rounds")
    # rounds: 18/7.6, 17/8.1, 19/7.1 -> median 2.368..., least 2.10, greatest 2.68
    assert lines[3:] == ["- bs 131072: 2.368x (2.10-2.68)"]
    assert plan_sizes.graph_bar({}) == []
