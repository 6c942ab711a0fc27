"""The ``kvcanary-dispatch`` command line: argument and run-time errors, and a tiny CPU sweep
and its three files (``fuzz``: ``tests/test_cli_fuzz.py``; ``explain``:
``tests/test_cli_explain.py``)."""

from __future__ import annotations

import csv
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import triton
from conftest import DEVICE

from kvcanary_dispatch.cli import build_parser, main
from kvcanary_dispatch.cli.results import fmt_us

REPO = Path(__file__).resolve().parents[1]
CSV_COLUMNS = [
    "gpu", "torch", "triton", "commit", "function", "strategy", "chunk", "bs", "distribution",
    "eager_us", "graph_us", "host_us", "floor_us", "empty_launch_us", "status", "tokens",
    "launches", "error", "date", "width",
]  # fmt: skip


def _env_without_interpreter() -> dict[str, str]:
    """The environment of a new shell: the package is installed, no interpreter switch."""
    return {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}


def _error_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.strip()]


# ---------------------------------------------------------------- help and errors


def test_module_help_in_a_subprocess():
    out = subprocess.run(
        [sys.executable, "-m", "kvcanary_dispatch", "--help"],
        capture_output=True, text=True, cwd=REPO, env=_env_without_interpreter(), timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    for command in ("sweep", "fuzz", "explain"):
        assert command in out.stdout


def test_output_closed_early_ends_quietly():
    """``explain | head``: the reader closes stdout before the output ends; the command stops
    with status 141 (128 + SIGPIPE) and no traceback."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvcanary_dispatch", "explain", "--bs", "5000", "--op", "both"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=REPO, env=_env_without_interpreter(),
    )  # fmt: skip
    proc.stdout.close()  # before the command writes anything
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141, err
    assert err == ""


@pytest.mark.parametrize("command", ["sweep", "fuzz", "explain"])
def test_subcommand_help_explains_every_option(command, capsys):
    with pytest.raises(SystemExit) as exc:
        main([command, "--help"])
    assert exc.value.code == 0
    assert f"usage: kvcanary-dispatch {command}" in capsys.readouterr().out
    sub = next(a for a in build_parser()._actions if a.dest == "command").choices[command]
    for action in sub._actions:
        assert action.help and len(action.help) > 10, action.option_strings


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["bogus"],
        ["explain"],
        ["explain", "--bs", "ten"],
        ["explain", "--bs", "-1"],
        ["explain", "--bs", "4", "--strategy", "bogus"],
        ["sweep", "--bs", "0"],
        ["sweep", "--mixes", "u9"],
        ["sweep", "--strategies", "fastest"],
        ["fuzz", "--examples", "0"],
        ["fuzz", "--minutes", "-1"],
        *(  # sizes past 2**40, each once (they ended in tracebacks from torch or range)
            [cmd, *more, flag, str(2**40 + 1)]
            for cmd, more, flags in (
                ("sweep", [], ("--bs", "--width")),
                ("explain", [], ("--bs",)),
                ("explain", ["--bs", "300"], ("--tokens", "--width")),
                ("fuzz", [], ("--max-bs",)),
            )
            for flag in flags
        ),
    ],
)
def test_argument_errors_exit_2_with_usage(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = _error_lines(capsys.readouterr().err)
    assert err[0].startswith("usage: kvcanary-dispatch")
    assert err[-1].startswith("kvcanary-dispatch") and "error:" in err[-1]
    if str(2**40 + 1) in argv:
        assert err[-1].endswith(
            f"must be <= {2**40} (2**40: no machine's memory holds a batch that large), got "
            f"{2**40 + 1}"
        )


@pytest.mark.parametrize(
    "argv, text",
    [
        (["explain", "--bs", "10", "--chunk-size", "600"], "chunk_size=600 is outside [1, 511]"),
        (["explain", "--bs", "10", "--op", "plan", "--chunk-size", "0"], "outside [1, 4096]"),
        (["explain", "--bs", "10", "--op", "plan", "--strategy", "sliced"], "not a plan strategy"),
        (["explain", "--bs", "10", "--tokens", "100", "--strategy", "rows"],
         "strategy='rows' needs the pool width: pass width=pool_out.shape[1] (--width on the "),
        (["sweep", "--device", "tpu"], "expected cuda, cuda:N or cpu"),
        (["sweep", "--device", DEVICE, "--bs", "600", "--max-launches", "1",
          "--strategies", "loop", "--chunk-sizes", "1"],
         "points were skipped (raise --max-launches or use larger --chunk-sizes)"),
        (["sweep", "--device", DEVICE, "--bs", "600", "--op", "scatter",
          "--strategies", "fixed_block"],
         "skipped (fixed_block is one unsplit launch: give --bs at most 511 or add a"),
        (["explain", "--bs", "10", "--op", "plan", "--tokens", "5"],
         "--tokens describes the scatter call, which this command does not explain (it "
         "explains: plan); drop it or pass --op scatter or --op both"),
        (["explain", "--bs", "10", "--strategy", "scan", "--width", "5", "--offsets", "host"],
         "--width --offsets describe the scatter call, which this command does not explain (it "
         "explains: plan); drop them or pass a strategy both calls have, such as auto"),
        (["explain", "--bs", "10", "--op", "plan", "--chunk-size", "0"],
         "pass a size in that range, or omit --chunk-size for the strategy's default (its "
         "largest slice, 4096; under --strategy auto, auto's own choice)"),
        (["explain", "--bs", "0", "--tokens", "5", "--op", "scatter"],
         "bs=0 with tokens=5: a batch of no requests has no tokens"),
        (["explain", "--bs", str(2**40), "--op", "plan"],
         f"bs={2**40} in slices of 1024 requests makes {2**30} slices, and explain describes "
         "at most 4194304; pass a smaller --bs, or a larger --chunk-size (up to 4096)"),
        (["explain", "--bs", str(2**31), "--strategy", "loop", "--op", "scatter", "--chunk-size",
          "1"], "up to 511)"),
        (["sweep", "--device", DEVICE, "--strategies", "loop", "--chunk-sizes", "1000"],
         "--chunk-sizes 1000: none is a scatter chunk (1 to 511), so scatter's loop would "
         "measure nothing; give sizes up to 511, or leave those out"),
        (["sweep", "--device", DEVICE, "--op", "both", "--strategies", "loop", "--chunk-sizes",
          "5000"], "--chunk-sizes 5000: none is a scatter chunk (1 to 511)"),
        (["sweep", "--device", DEVICE, "--op", "plan", "--mixes", "u1024", "--width", "5"],
         "--mixes --width describe the scatter, which --op plan does not sweep; drop them or "
         "pass --op both"),
        (["sweep", "--device", DEVICE, "--strategies", "scan", "lookback"],
         "--strategies scan lookback: none applies to scatter; pass --op plan or --op both"),
    ],
)  # fmt: skip
def test_runtime_errors_are_one_line(argv, text, capsys):
    assert main(argv) == 2
    err = _error_lines(capsys.readouterr().err)
    assert len(err) == 1, err
    assert err[0].startswith("kvcanary-dispatch: error: ") and text in err[0]


def test_unusable_output_folders_are_refused_before_any_work(tmp_path, capsys):
    """A sweep's ``--out`` or a fuzz's ``--save-dir`` under a plain file is a one-line error
    (exit 2) before anything is measured or fuzzed, not a traceback after."""
    afile = tmp_path / "afile"
    afile.write_text("")
    sweep = ["sweep", "--device", DEVICE, "--bs", "4", "--mixes", "ones", "--strategies", "auto",
             "--out", str(afile / "sub")]  # fmt: skip
    fuzz = ["fuzz", "--device", DEVICE, "--examples", "1", "--save-dir", str(afile / "sub")]
    for argv, text in ((sweep, "--out"), (fuzz, "--save-dir")):
        assert main(argv) == 2
        captured = capsys.readouterr()
        err = _error_lines(captured.err)
        assert len(err) == 1 and err[0].startswith(f"kvcanary-dispatch: error: {text} "), err
        assert "is not a folder" in err[0] or "cannot make the folder" in err[0], err
        assert "examples passed" not in captured.out and "calls to time" not in captured.out


@pytest.mark.parametrize("where", ["denied", "under /proc"])
def test_a_save_dir_that_cannot_be_written_is_refused_before_fuzzing(
    where, tmp_path, capsys, monkeypatch
):
    """A ``--save-dir`` that exists, or could, but takes no file is refused before fuzzing
    (else a failure found and shrunk would end in a traceback, its inputs lost)."""
    if where == "under /proc":
        if not Path("/proc/self").is_dir():
            pytest.skip("no /proc")
        save = Path("/proc/kvc-save")  # a folder of /proc, where nothing can be made
    else:
        import tempfile

        def denied(*args, **kwargs):
            raise PermissionError(13, "Permission denied")

        monkeypatch.setattr(tempfile, "TemporaryFile", denied)
        save = tmp_path / "save" / "deeper"
    argv = ["fuzz", "--device", DEVICE, "--examples", "1", "--save-dir", str(save)]
    assert main(argv) == 2
    captured = capsys.readouterr()
    err = _error_lines(captured.err)
    assert len(err) == 1, err
    assert err[0].startswith(f"kvcanary-dispatch: error: --save-dir {save}: cannot write there")
    assert err[0].endswith("; pass a folder you can write to"), err
    assert "examples passed" not in captured.out
    if where == "denied":  # the folders made to be tried are removed with the refusal
        assert list(tmp_path.iterdir()) == []


def test_a_sweep_too_large_for_memory_is_one_line(tmp_path, capsys):
    """A batch whose pool cannot be allocated is a one-line error (exit 2) naming the fix, and
    the output folder the sweep made, still empty, is removed."""
    out = tmp_path / "s"
    argv = ["sweep", "--device", DEVICE, "--out", str(out), "--bs", "8", "--mixes", "ones",
            "--strategies", "auto", "--width", str(10**11), "--quiet"]  # fmt: skip
    assert main(argv) == 2
    err = _error_lines(capsys.readouterr().err)
    assert len(err) == 1 and err[0].startswith("kvcanary-dispatch: error: out of memory ("), err
    assert err[0].endswith("): give smaller --bs or --width, or larger --chunk-sizes (fewer "
                           "slices to plan)"), err  # fmt: skip
    assert not out.exists()


def test_a_sweep_interrupted_before_its_first_row_writes_the_header(tmp_path, monkeypatch, capsys):
    """Interrupted before anything was measured, the sweep exits 130, its CSV still has the
    results schema's header (a reader of partial results sees the columns, no row), and the
    summary and report say that nothing was measured."""
    from kvcanary_dispatch.cli import sweep

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(sweep, "time_case", interrupted)
    out = tmp_path / "s"
    argv = ["sweep", "--device", DEVICE, "--out", str(out), "--bs", "8", "--mixes", "ones",
            "--strategies", "auto", "--width", "16", "--quiet"]  # fmt: skip
    assert main(argv) == 130
    with (out / "sweep.csv").open() as f:
        reader = csv.DictReader(f)
        assert reader.fieldnames == CSV_COLUMNS and list(reader) == []
    assert "(nothing was measured)" in capsys.readouterr().out
    assert "Nothing was measured." in (out / "sweep.md").read_text()


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
@pytest.mark.parametrize(
    "argv, text",
    [
        (["sweep", "--device", "cuda"], "no CUDA device is available"),
        (
            ["sweep", "--device", "cpu", "--metric", "graph"],
            "--metric graph needs CUDA (CUDA-"
            "graph replay times); pass --device cuda on a GPU, or --metric kernel or host",
        ),
    ],
)
def test_cuda_only_requests_without_a_gpu_are_one_line(argv, text, capsys):
    assert main(argv) == 2
    err = _error_lines(capsys.readouterr().err)
    assert len(err) == 1 and text in err[0]


# ---------------------------------------------------------------- sweep


def _read_csv(path: Path) -> tuple[list[str], list[dict]]:
    with path.open() as f:
        reader = csv.DictReader(f)
        return list(reader.fieldnames or []), list(reader)


def test_sweep_notes_an_op_its_chunk_sizes_leave_out(tmp_path, capsys):
    """``--op both`` with chunk sizes only the plan takes: the plan's loop is measured, the
    scatter's is not, and the sweep says so before it starts."""
    argv = ["sweep", "--device", DEVICE, "--out", str(tmp_path / "s"), "--op", "both", "--bs",
            "8", "--mixes", "ones", "--width", "16", "--strategies", "loop", "--chunk-sizes",
            "1000", "--quiet"]  # fmt: skip
    assert main(argv) == 0
    stdout = capsys.readouterr().out
    assert "note: --chunk-sizes 1000: none is a scatter chunk (1 to 511), so scatter's loop " \
        "would measure nothing: not measured" in stdout  # fmt: skip
    rows = list(csv.DictReader((tmp_path / "s" / "sweep.csv").open()))
    assert {(r["function"], r["strategy"], r["chunk"]) for r in rows} == {("plan", "loop", "1000")}


def test_sweep_notes_strategies_of_another_op(tmp_path, capsys):
    argv = ["sweep", "--device", DEVICE, "--out", str(tmp_path / "s"), "--bs", "8", "--mixes",
            "ones", "--width", "16", "--strategies", "auto", "scan", "lookback",
            "--quiet"]  # fmt: skip
    assert main(argv) == 0
    stdout = capsys.readouterr().out
    assert "note: --strategies scan lookback: not scatter strategies, not measured" in stdout
    default = ["sweep", "--device", DEVICE, "--out", str(tmp_path / "d"), "--bs", "8", "--mixes",
               "ones", "--width", "16", "--chunk-sizes", "8", "--quiet"]  # fmt: skip
    assert main(default) == 0  # the default list holds both ops' strategies: no note
    assert "note:" not in capsys.readouterr().out


def test_sweep_measures_every_unchunked_scatter_strategy(tmp_path, capsys):
    """Each of the library's scatter strategies without slices (``rows``, which ``auto`` takes
    up to 512 requests, among them) is measured once a batch, checked first, and says ok; with
    no chunked strategy the summary lists these calls with their times."""
    strategies = ["capped", "rows", "flat", "segments"]
    argv = ["sweep", "--device", DEVICE, "--out", str(tmp_path / "s"), "--bs", "8", "--mixes",
            "ones", "--width", "16", "--strategies", *strategies, "--quiet"]  # fmt: skip
    assert main(argv) == 0
    _, rows = _read_csv(tmp_path / "s" / "sweep.csv")
    assert [(r["strategy"], r["chunk"], r["status"]) for r in rows] == [
        (s, "", "ok") for s in strategies
    ]
    out = capsys.readouterr().out
    assert "no chunked strategy was measured; the calls measured once:" in out
    fastest = min(float(r["eager_us"]) for r in rows)
    for r in rows:
        us = float(r["eager_us"])
        ratio = f"{us / fastest:.2f}x"
        line = next(
            x for x in out.splitlines() if x.startswith(f"scatter  ones  8   {r['strategy']} ")
        )
        assert line.split()[4:6] == [fmt_us(us), ratio], line
    assert "No chunked strategy was measured" in (tmp_path / "s" / "sweep.md").read_text()


def test_tiny_sweep_writes_csv_png_md(tmp_path, capsys, monkeypatch):
    """On the CPU (the interpreter) unless a GPU is present. Each file names the versions,
    commit and date of the run."""
    from matplotlib.figure import Figure

    titles, suptitle = [], Figure.suptitle

    def recorded(fig, text, **kwargs):
        titles.append(text)
        return suptitle(fig, text, **kwargs)

    monkeypatch.setattr(Figure, "suptitle", recorded)
    out = tmp_path / "sweep"
    argv = ["sweep", "--device", DEVICE, "--out", str(out), "--op", "both", "--bs", "8",
            "--mixes", "ones", "--chunk-sizes", "4", "511", "--width", "16", "--max-launches",
            "5", "--strategies", "loop", "sliced", "scan", "auto", "per_request_grid",
            "--quiet"]  # fmt: skip
    assert main(argv) == 0
    stdout = capsys.readouterr().out
    cpu = DEVICE == "cpu"
    assert ("say nothing about GPU performance" in stdout) == cpu
    assert "best chunk" in stdout  # the summary table

    columns, rows = _read_csv(out / "sweep.csv")
    assert columns == CSV_COLUMNS
    got = {(r["function"], r["strategy"], r["chunk"]) for r in rows}
    want = {
        ("scatter", "loop", "511"), ("scatter", "sliced", "4"),
        ("scatter", "sliced", "511"), ("scatter", "auto", ""),
        ("scatter", "per_request_grid", ""), ("plan", "loop", "4"), ("plan", "loop", "511"),
        ("plan", "scan", "4"), ("plan", "scan", "511"), ("plan", "auto", ""),
    }  # fmt: skip
    # Skipped past --max-launches 5: scatter loop at chunk 4 (2 launches, 2 offset rebases and
    # the 3 ops of its read-back); in: at chunk 511 (5), plan loop at chunk 4 (2 launches +
    # the carry fill), as their LaunchPlans count.
    assert got == want
    for r in rows:
        assert float(r["eager_us"]) > 0 and float(r["host_us"]) > 0
        assert r["status"] == "ok" and r["error"] == "" and r["distribution"] in ("ones", "decode")
        assert r["width"] == ("16" if r["function"] == "scatter" else "")
        assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\dZ", r["date"])
        assert r["date"] == rows[0]["date"]
        if cpu:  # CUDA only
            assert r["graph_us"] == r["floor_us"] == r["launches"] == r["empty_launch_us"] == ""
        else:
            assert int(r["launches"]) >= 1 and float(r["empty_launch_us"]) > 0

    png = (out / "sweep.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    versions = f"torch {torch.__version__}, Triton {triton.__version__}, commit " \
        f"{rows[0]['commit']}, {rows[0]['date']}"  # fmt: skip
    assert len(titles) == 1 and versions in titles[0].replace("\n", " ")

    md = (out / "sweep.md").read_text()
    assert ("say nothing about GPU performance" in md) == cpu
    assert f"{torch.__version__}, Triton {triton.__version__}, commit " in md
    assert f", {rows[0]['date']}; " in md  # the csv's date is the run's, as the report says
    assert "## Best chunk size per batch size" in md
    assert "| scatter | ones | 8 | loop |" in md and "| plan | decode | 8 | scan |" in md
    assert "## Skipped (1)" in md
    assert "scatter ones bs=8 loop chunk=4: 7 device ops a call (launches and torch ops)" in md


@pytest.mark.parametrize("op", ["scatter", "plan"])
def test_sweep_exits_1_on_a_wrong_result(op, tmp_path, capsys, monkeypatch):
    """A swept call whose output differs from the reference stops the sweep: exit status 1,
    the call named on stderr, no result files (numbers of a wrong kernel are not results), and
    no empty folder left."""
    from kvcanary_dispatch.cli import sweep

    def wrong_auto(calls_of):
        def calls(case):
            calls = calls_of(case)
            right = calls["auto"]

            def auto(**kw):
                right(**kw)
                out = kw["pool_out"] if op == "scatter" else kw["out_write_offsets"]
                out.view(-1)[1] += 1  # one element off

            calls["auto"] = auto
            return calls

        return calls

    name = f"{op}_calls"
    monkeypatch.setattr(sweep, name, wrong_auto(getattr(sweep, name)))
    out = tmp_path / "sweep"
    argv = ["sweep", "--device", DEVICE, "--out", str(out), "--op", op, "--bs", "8",
            "--strategies", "auto", "--quiet"]  # fmt: skip
    argv += ["--mixes", "ones", "--width", "16"] if op == "scatter" else []
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "correctness check failed" in err and f"{op} auto bs=8" in err, err
    assert not out.exists()  # the folder the sweep made, and left empty, is removed


def test_sweep_through_the_module_reexecs_for_the_interpreter(tmp_path):
    """The real entry point imports the kernels before it parses ``--device``: without
    TRITON_INTERPRET in the environment it must still run on the CPU."""
    out = tmp_path / "s"
    cmd = [sys.executable, "-m", "kvcanary_dispatch", "sweep", "--device", "cpu", "--out",
           str(out), "--bs", "4", "--mixes", "ones", "--chunk-sizes", "511", "--width", "8",
           "--strategies", "loop", "auto"]  # fmt: skip
    res = subprocess.run(
        cmd, capture_output=True, text=True, cwd=tmp_path, env=_env_without_interpreter(),
        timeout=300,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert {p.name for p in out.iterdir()} == {"sweep.csv", "sweep.png", "sweep.md"}
