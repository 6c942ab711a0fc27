"""Where the command line writes, and what it refuses first: a sweep's ``--out`` that exists
but takes no file, holds a folder where a result file goes, or holds an earlier run's result
file, is a one-line error before
anything is measured; a write that fails after the measurements prints them first; a failed
check leaves no empty folder behind; ``--chunk-sizes`` with no strategy that takes one is
refused; a plan-only sweep reports no scatter settings; a fuzz run writes nothing under the
current directory and gives the caller's hypothesis home back; an empty folder name is refused.
A sweep stopped by any error leaves no folder, one interrupted in its host loops marks what it
did not time, and its plan workload stays inside the plan's limits at every batch size."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
from conftest import DEVICE

from kvcanary_dispatch.cli import main, sweep_report
from kvcanary_dispatch.cli.results import read_csv
from kvcanary_kernels.plan_checks import INT32_MAX

TINY = ["sweep", "--device", DEVICE, "--op", "scatter", "--bs", "8", "--mixes", "ones",
        "--width", "16", "--strategies", "auto", "--quiet"]  # fmt: skip


def _one_error(capsys) -> tuple[str, str]:
    captured = capsys.readouterr()
    lines = [line for line in captured.err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("kvcanary-dispatch: error: "), lines
    return lines[0], captured.out


@pytest.mark.parametrize("where", ["denied", "under /proc"])
def test_an_out_folder_that_takes_no_file_is_refused_before_measuring(
    where, tmp_path, capsys, monkeypatch
):
    if where == "under /proc":
        if not Path("/proc/self").is_dir():
            pytest.skip("no /proc")
        out = Path("/proc")  # exists, and no file can be made there
    else:

        def denied(*args, **kwargs):
            raise PermissionError(13, "Permission denied")

        monkeypatch.setattr(tempfile, "TemporaryFile", denied)
        out = tmp_path / "out"
    assert main([*TINY, "--out", str(out)]) == 2
    err, stdout = _one_error(capsys)
    assert err.startswith(f"kvcanary-dispatch: error: --out {out}: cannot write there"), err
    assert err.endswith("; pass a folder you can write to") and "calls to time" not in stdout


def test_an_out_folder_holding_a_folder_named_as_a_result_is_refused(tmp_path, capsys):
    out = tmp_path / "out"
    (out / "sweep.png").mkdir(parents=True)
    assert main([*TINY, "--out", str(out)]) == 2
    err, stdout = _one_error(capsys)
    assert err.endswith(f"--out {out}: sweep.png is a folder there; pass another --out"), err
    assert "calls to time" not in stdout


def test_an_out_folder_holding_an_earlier_result_is_refused_and_left_as_it_was(tmp_path, capsys):
    """A sweep does not replace an earlier run's files: naming them, it refuses before
    measuring, and the folder keeps what it held."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "sweep.md").write_text("earlier")
    (out / "notes.txt").write_text("mine")
    assert main([*TINY, "--out", str(out)]) == 2
    err, stdout = _one_error(capsys)
    assert err.endswith(
        f"--out {out}: sweep.md is already there; pass another --out, or remove it first"
    ), err
    assert "calls to time" not in stdout
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt", "sweep.md"]
    assert (out / "sweep.md").read_text() == "earlier"
    (out / "sweep.md").unlink()
    assert main([*TINY, "--out", str(out)]) == 0  # other files there are no obstacle
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt", "sweep.csv", "sweep.md",
                                                     "sweep.png"]  # fmt: skip


def test_a_write_that_fails_after_measuring_prints_the_summary(tmp_path, capsys, monkeypatch):
    def full(result, out):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(sweep_report, "write_outputs", full)
    out = tmp_path / "out"
    assert main([*TINY, "--out", str(out)]) == 2
    err, stdout = _one_error(capsys)
    assert f"--out {out}: writing the results failed" in err and "No space left" in err, err
    assert "auto" in stdout.split("calls to time", 1)[1]  # the summary table, after the header


def test_chunk_sizes_with_no_strategy_that_takes_one_are_refused(tmp_path, capsys):
    argv = [*TINY, "--chunk-sizes", "8", "64", "--out", str(tmp_path / "out")]
    assert main(argv) == 2
    err, _ = _one_error(capsys)
    assert "--chunk-sizes 8 64: no strategy swept takes a chunk size (auto run without one)" in err
    assert err.endswith("add one of loop sliced to --strategies, or leave --chunk-sizes out"), err
    assert not (tmp_path / "out").exists()


def test_a_plan_sweep_reports_no_scatter_settings(tmp_path, capsys):
    out = tmp_path / "out"
    argv = ["sweep", "--device", DEVICE, "--op", "plan", "--bs", "8", "--strategies", "auto",
            "--out", str(out), "--quiet"]  # fmt: skip
    assert main(argv) == 0
    header = capsys.readouterr().out.splitlines()[1]
    assert header.strip() == "ops plan; bs 8; strategies auto", header
    md = (out / "sweep.md").read_text()
    assert "(seeded). Batch sizes 8" in md and "pool width" not in md


def test_fuzz_writes_nothing_in_the_current_folder(tmp_path, monkeypatch, capsys):
    from hypothesis import configuration

    monkeypatch.chdir(tmp_path)
    mine = tmp_path / "my-hypothesis"
    configuration.set_hypothesis_home_dir(mine)
    try:
        assert main(["fuzz", "--device", DEVICE, "--examples", "3", "--seed", "1", "--quiet"]) == 0
        assert getattr(configuration, "__hypothesis_home_directory") == mine  # given back
    finally:
        configuration.set_hypothesis_home_dir(None)
    assert list(tmp_path.iterdir()) == []


def test_a_failed_check_removes_the_empty_folders_it_made(tmp_path, capsys, monkeypatch):
    """``--out`` several folders deep, none there before: a sweep whose check fails removes
    every folder it made (and none it did not)."""
    from kvcanary_dispatch.cli import sweep

    real = sweep.scatter_calls

    def wrong(case):
        calls = real(case)
        right = calls["auto"]

        def auto(**kw):
            right(**kw)
            kw["pool_out"].view(-1)[1] += 1

        calls["auto"] = auto
        return calls

    monkeypatch.setattr(sweep, "scatter_calls", wrong)
    out = tmp_path / "a" / "b" / "sweep"
    assert main([*TINY, "--out", str(out)]) == 1
    assert "correctness check failed" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []  # a/, a/b/ and sweep/ gone; tmp_path kept


@pytest.mark.parametrize(
    "argv", [[*TINY, "--out", ""], ["fuzz", "--examples", "1", "--save-dir", ""]]
)
def test_an_empty_folder_name_is_refused(argv, tmp_path, capsys, monkeypatch):
    """``--out ''`` or ``--save-dir ''`` is a usage error (exit 2), not the current folder
    (``Path("")`` is ``.``), and nothing is written there."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    assert "an empty path; name a folder (. for this one)" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_a_sweep_stopped_by_any_error_removes_the_empty_folders_it_made(tmp_path, monkeypatch):
    """An error the sweep does not report itself (here a workload that cannot be built)
    propagates as it came, and the folders the sweep made, empty, go first."""
    from kvcanary_dispatch.cli import sweep

    def broken(*args, **kwargs):
        raise ValueError("planted: no workload")

    monkeypatch.setattr(sweep, "scatter_workload", broken)
    with pytest.raises(ValueError, match="planted: no workload"):
        main([*TINY, "--out", str(tmp_path / "a" / "sweep")])
    assert list(tmp_path.iterdir()) == []


def test_rows_interrupted_before_their_host_time_are_skipped(tmp_path, monkeypatch, capsys):
    """Ctrl-C in a batch's host loops (its calls checked and timed eagerly): the rows written
    for them say they were skipped, and why, rather than ``ok`` with no host time."""
    from kvcanary_dispatch.cli import harness

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(harness, "add_host_times", interrupted)
    out = tmp_path / "s"
    assert main([*TINY, "--strategies", "auto", "fixed_block", "--out", str(out)]) == 130
    rows = read_csv(out / "sweep.csv")
    assert [r.strategy for r in rows] == ["auto", "fixed_block"]
    for r in rows:
        assert (r.status, r.error, r.host_us) == ("skipped", "interrupted before its host time",
                                                  None), r  # fmt: skip
        assert r.eager_us is not None and r.eager_us > 0, r


def test_the_plan_workload_keeps_its_verify_capacity_within_int32(monkeypatch):
    """The plan workload's verify capacity (3x the pool's slots) stops at int32's largest,
    the plan's limit, which it passes from bs = 699 049: a plan sweep of a million requests
    is measured, not refused."""
    from kvcanary_dispatch.cli import workloads

    monkeypatch.setattr(workloads, "make_plan_case", lambda **kw: kw)
    for bs, want in [(699_048, 3 * 699_050 * 1024), (699_049, INT32_MAX), (1 << 20, INT32_MAX)]:
        assert workloads.plan_workload(bs, "cpu")["verify_capacity"] == want, bs
    assert 3 * 699_051 * 1024 > INT32_MAX >= 3 * 699_050 * 1024


def test_an_empty_device_name_is_refused(capsys):
    """``--device ''`` is refused as a name torch does not take, not read as the default
    device."""
    assert main(["fuzz", "--device", "", "--examples", "1"]) == 2
    assert capsys.readouterr().err == (
        "kvcanary-dispatch: error: --device '': expected cuda, cuda:N or cpu\n"
    )
