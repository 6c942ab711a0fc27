"""The ``kvcanary-dispatch`` command line: argument and run-time errors, a tiny CPU sweep and
its three files, ``explain`` (checked against the dispatcher's real launches), and ``fuzz``
passing and failing with a runnable counterexample."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import DEVICE

from kvcanary_dispatch import plan_offsets, scatter_req_token_ids
from kvcanary_dispatch.cli import build_parser, main
from kvcanary_dispatch.cli.explain import explain_plan, explain_scatter, uniform_offsets
from kvcanary_dispatch.cli.fuzz import Call, repro_snippet
from kvcanary_dispatch.testing.cases import make_scatter_case, offsets_from_lens
from kvcanary_dispatch.testing.properties import record_launches
from kvcanary_dispatch.testing.strategies import build_plan_case

REPO = Path(__file__).resolve().parents[1]
CSV_COLUMNS = [
    "gpu", "torch", "triton", "commit", "function", "strategy", "chunk", "bs", "distribution",
    "eager_us", "graph_us", "host_us", "floor_us", "empty_launch_us", "status", "tokens",
    "launches", "error",
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
    ],
)
def test_argument_errors_exit_2_with_usage(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = _error_lines(capsys.readouterr().err)
    assert err[0].startswith("usage: kvcanary-dispatch")
    assert err[-1].startswith("kvcanary-dispatch") and "error:" in err[-1]


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
         "omit --chunk-size for the largest slice (4096)"),
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


def test_explain_counts_the_slices_it_hides(capsys):
    """However few rows are shown, the rows and the hidden count add up to the slices."""
    argv = ["explain", "--op", "scatter", "--bs", "100", "--tokens", "50", "--strategy", "loop",
            "--chunk-size", "10"]  # fmt: skip
    for rows, hidden in ((1, 8), (2, 8), (6, 4), (9, None)):
        assert main([*argv, "--rows", str(rows)]) == 0
        text = capsys.readouterr().out
        assert "10 slice(s)" in text
        if hidden is None:
            assert "more slices" not in text
        else:
            assert f"({hidden} more slices)" in text, text


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
@pytest.mark.parametrize(
    "argv, text",
    [
        (["sweep", "--device", "cuda"], "no CUDA device is available"),
        (["sweep", "--device", "cpu", "--metric", "graph"], "--metric graph needs CUDA"),
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


def test_tiny_sweep_writes_csv_png_md(tmp_path, capsys):
    """On the CPU (the interpreter) unless a GPU is present."""
    out = tmp_path / "sweep"
    argv = ["sweep", "--device", DEVICE, "--out", str(out), "--op", "both", "--bs", "8",
            "--mixes", "ones", "--chunk-sizes", "4", "511", "--width", "16", "--max-launches",
            "2", "--strategies", "loop", "sliced", "scan", "auto", "per_request_grid",
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
        ("scatter", "per_request_grid", ""), ("plan", "loop", "511"), ("plan", "scan", "4"),
        ("plan", "scan", "511"), ("plan", "auto", ""),
    }  # fmt: skip
    # Skipped past --max-launches 2: plan loop at chunk 4 (2 launches + the carry fill) and
    # scatter loop at chunk 4 (2 launches + 2 offset rebases), as their LaunchPlans count.
    assert got == want
    for r in rows:
        assert float(r["eager_us"]) > 0 and float(r["host_us"]) > 0
        assert r["status"] == "ok" and r["error"] == "" and r["distribution"] in ("ones", "decode")
        if cpu:  # CUDA only
            assert r["graph_us"] == r["floor_us"] == r["launches"] == r["empty_launch_us"] == ""
        else:
            assert int(r["launches"]) >= 1 and float(r["empty_launch_us"]) > 0

    png = (out / "sweep.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000

    md = (out / "sweep.md").read_text()
    assert ("say nothing about GPU performance" in md) == cpu
    assert "## Best chunk size per batch size" in md
    assert "| scatter | ones | 8 | loop |" in md and "| plan | decode | 8 | scan |" in md
    assert "## Skipped (2)" in md
    assert "plan decode bs=8 loop chunk=4: 3 device ops a call (launches and torch ops)" in md


@pytest.mark.parametrize("op", ["scatter", "plan"])
def test_sweep_exits_1_on_a_wrong_result(op, tmp_path, capsys, monkeypatch):
    """A swept call whose output differs from the reference stops the sweep: exit status 1,
    the call named on stderr, no result files (numbers of a wrong kernel are not results)."""
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
    assert not out.exists() or not any(out.iterdir())


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


# ---------------------------------------------------------------- explain


def test_explain_bs_100000(capsys):
    assert main(["explain", "--bs", "100000"]) == 0
    text = capsys.readouterr().out
    head = "scatter_req_token_ids: bs=100000, tokens=unknown, strategy=auto (runs capped)"
    assert head in text
    assert "plan_offsets: bs=100000, strategy=auto (runs lookback)" in text
    assert "391 slice(s) of at most 256 requests" in text
    assert "(385 more slices)" in text and "[99840, 100000)" in text
    assert "1 x _plan_lookback_kernel, grid (391,)" in text
    assert "temporary: state: 784 int64 words of the stream's resident buffer" in text
    assert "(filled only when made or grown)" in text
    assert (
        "while capturing a CUDA graph or under torch.compile this call runs scan with 2 device "
        "op(s)" in text
    )
    assert text.count("host syncs: none") == 2
    assert len(text.splitlines()) < 40  # long splits are elided, not printed in full


def test_explain_capturing_shows_the_graph_plan(capsys):
    assert main(["explain", "--bs", "100000", "--op", "plan", "--capturing"]) == 0
    text = capsys.readouterr().out
    assert "plan_offsets: bs=100000, strategy=auto (runs scan)" in text
    assert "1 x _plan_slice_sums_kernel, grid (391,)" in text
    assert "1 x _plan_scan_kernel, grid (391,)" in text
    assert "launches: 2 Triton launch(es)\n" in text  # the sums buffer is no device op
    assert "eager this call runs lookback with 1 device op(s)" in text
    argv = ["explain", "--bs", "5000", "--strategy", "lookback", "--chunk-size", "256"]
    assert main([*argv, "--capturing"]) == 0
    text = capsys.readouterr().out
    assert "launches: 1 Triton launch(es) + 1 torch device op(s)" in text
    assert "temporary: state: 42 int64 filled with INT64_MIN, one torch op" in text


@pytest.mark.parametrize(
    "argv, refused",
    [
        (["--strategy", "loop"], "strategy='loop' reads the slice-boundary offsets back; use a "
         "single-launch strategy"),
        (["--offsets", "host"], "got offsets on the CPU; pass offsets on the pool's device"),
        (["--strategy", "sliced", "--offsets", "device"], None),
        ([], None),
    ],
)  # fmt: skip
def test_explain_capturing_says_which_scatter_capture_refuses(argv, refused, capsys):
    """``--capturing`` describes the scatter too: a call the dispatcher refuses under capture
    (a read-back, an upload) is explained as refused, with nothing launched; others as eager."""
    base = ["explain", "--bs", "1000", "--tokens", "4000", "--width", "64", "--op", "scatter"]
    assert main([*base, *argv, "--capturing"]) == 0
    text = capsys.readouterr().out
    assert main([*base, *argv]) == 0
    eager = capsys.readouterr().out
    if refused is None:
        assert text == eager and "refused" not in text
    else:
        want = "note: while capturing a CUDA graph this call is refused (ValueError): "
        assert want in text and refused in text, text
        assert "refused while capturing)" in text.splitlines()[0]
        assert "launches: 0 Triton launch(es)" in text and want not in eager


def test_explain_a_split_with_no_launch(capsys):
    """No tokens: the slices launch nothing, and no offsets are read back."""
    for argv in (["--bs", "1000", "--tokens", "0"], ["--bs", "0", "--tokens", "0"]):
        assert main(["explain", *argv, "--strategy", "loop", "--op", "scatter"]) == 0
        text = capsys.readouterr().out
        assert "launches: 0 Triton launch(es)" in text and "host syncs: none" in text, text
        assert "program" not in text
    assert main(["explain", "--bs", "1000", "--tokens", "0", "--strategy", "sliced"]) == 0
    text = capsys.readouterr().out
    assert "no launch" in text and "programs (" not in text, text


def test_explain_without_a_width_leaves_rows_or_capped_open(capsys):
    """A batch ``auto`` may give ``rows``: without ``--width`` the choice is left open; with
    one, it is the call's (a real call always has a width)."""
    assert main(["explain", "--bs", "100", "--tokens", "400", "--op", "scatter"]) == 0
    text = capsys.readouterr().out
    assert "strategy=auto (runs capped or rows)" in text and "runs 'capped'" not in text
    assert main(["explain", "--bs", "100", "--tokens", "400", "--width", "8192"]) == 0
    assert "strategy=auto (runs rows)" in capsys.readouterr().out
    assert main(["explain", "--bs", "600", "--tokens", "400", "--op", "scatter"]) == 0
    assert "strategy=auto (runs capped)" in capsys.readouterr().out  # past rows' 512


def test_explain_plan_fixed_has_no_slice_size(capsys):
    assert main(["explain", "--bs", "1", "--op", "plan"]) == 0
    text = capsys.readouterr().out
    assert "one fixed-block launch" in text and "slices" not in text, text


def test_explain_gives_each_mode_its_own_slices(capsys):
    """Past 131 072 requests eager auto looks back in larger slices than its captured scan."""
    for flag, plan in (([], "lookback"), (["--capturing"], "scan")):
        assert main(["explain", "--bs", "300000", "--op", "plan", *flag]) == 0
        text = capsys.readouterr().out
        chunk = 1024 if plan == "lookback" else 256
        assert f"strategy=auto (runs {plan})" in text
        assert f"auto with chunk_size=None uses {chunk}-request slices at this bs" in text
        assert f"{-(-300000 // chunk)} slice(s) of at most {chunk} requests" in text


def test_explain_bs_100000_loop_with_tokens(capsys):
    argv = ["explain", "--bs", "100000", "--tokens", "1000000", "--strategy", "loop"]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "196 slice(s) of at most 511 requests" in text
    assert "(190 more slices)" in text
    assert "[99645, 100000)      [996450, 1000000)" in text
    assert "196 x _scatter_req_token_ids_kernel" in text and "BATCH_BLOCK=512" in text
    assert "one device-to-host copy of the 197 slice-boundary offsets" in text
    assert "25 x _plan_offsets_kernel, grid (1,)" in text
    assert "uniform lengths" in text


def test_explain_reads_the_pool_width(capsys):
    """The width decides "rows" for small batches and, for "capped", whether tail programs
    run (none when no column past the cap fits the pool)."""
    argv = ["explain", "--op", "scatter", "--bs", "600", "--tokens", "180000"]
    assert main([*argv, "--width", "4"]) == 0  # mean 300: 2 x 512 heads, cap 4 096
    text = capsys.readouterr().out
    assert "auto with no chunk_size runs 'capped'" in text and "grid (300,)" in text
    assert main(argv) == 0  # unknown width: tails for every 4 096 tokens past the cap
    text = capsys.readouterr().out
    assert "grid (343,)" in text and "pass --width" in text
    for bs, runs in ((8, "rows"), (300, "rows"), (512, "rows"), (513, "capped")):
        argv = ["explain", "--op", "scatter", "--bs", str(bs), "--tokens", "9000", "--width", "4"]
        assert main(argv) == 0
        assert f"auto with no chunk_size runs '{runs}'" in capsys.readouterr().out


def test_explain_says_where_auto_turns_on_the_token_count(capsys):
    """With the width known and the tokens not, auto's choice can turn on the token count
    (the "rows" grid covers min(width, tokens) columns): explain plans for the most columns a
    run can fill, names where the choice turns, and matches the calls on either side of it."""
    argv = ["explain", "--op", "scatter", "--bs", "128", "--width", "262144"]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "tokens=unknown, strategy=auto (runs capped)" in text
    assert "auto takes 'rows' up to 131072 tokens and 'capped' past them" in text
    for tokens, runs in (("131072", "rows"), ("131073", "capped")):
        assert main([*argv, "--tokens", tokens]) == 0
        assert f"strategy=auto (runs {runs})" in capsys.readouterr().out
    assert main(["explain", "--op", "scatter", "--bs", "8", "--width", "8192"]) == 0
    text = capsys.readouterr().out  # rows whatever the tokens: nothing turns
    assert "strategy=auto (runs rows)" in text and "up to" not in text


def _uniform_case(bs: int, tokens: int, width: int = 4):
    at = uniform_offsets(bs, tokens, list(range(bs + 1)))
    lens = torch.tensor(at[1:]) - torch.tensor(at[:-1])
    case = make_scatter_case(lens, width=width, seed=bs, device=DEVICE)
    assert torch.equal(case.offsets.cpu(), offsets_from_lens(lens))
    return case


@pytest.mark.parametrize(
    "bs, tokens, chunk, strategy",
    [(1200, 3000, None, "loop"), (1200, 300, 100, "loop"), (700, 5000, 64, "sliced"),
     (700, 5000, None, "auto"), (90, 10000, None, "flat"), (7, 0, 3, "loop"),
     (600, 180000, None, "auto"), (300, 90000, None, "auto"), (300, 30000, 7, "segments"),
     (1000, 2000, None, "segments"), (1000, 2000, None, "capped"), (40, 9000, None, "auto")],
)  # fmt: skip
def test_explain_scatter_matches_the_dispatcher(bs, tokens, chunk, strategy):
    case = _uniform_case(bs, tokens)
    split = explain_scatter(bs, tokens, chunk, strategy, width=case.width)
    with record_launches() as launches:
        scatter_req_token_ids(**case.kwargs(case.fresh_pool()), chunk_size=chunk, strategy=strategy)
    triton = split.triton_launches
    if tokens == 0:  # returns after its checks
        assert not launches and not split.launches
    elif split.resolved == "loop":  # the spy sees the launcher calls, empty slices included
        assert len(launches) == len(split.slices)
        assert len(triton) == sum(1 for a, b in split.token_ranges if b > a)
        assert all(la.block == int(triton[0].block.split("=")[1]) for la in launches)
    else:
        assert len(launches) == len(triton) == 1
    if split.resolved == "sliced":
        assert triton[0].grid == launches[0].args["grid"]
    if split.resolved == "flat":
        block = launches[0].args["token_block"]
        assert triton[0].grid == (-(-tokens // block),)
    if split.resolved == "capped":
        p = launches[0].args
        assert triton[0].grid == p["grid"] and f"REQS={p['reqs']}, COLS={p['cols']}" in (
            triton[0].block
        )
    if split.resolved == "rows":
        assert triton[0].grid == launches[0].args["grid"]
    if split.resolved == "segments":
        reqs, cols = launches[0].args["reqs"], launches[0].args["cols"]
        assert (
            triton[0].grid == (-(-bs // reqs),) and f"REQS={reqs}, COLS={cols}" in triton[0].block
        )


@pytest.mark.parametrize(
    "bs, chunk, strategy, kinds",
    [(5000, None, "auto", ["plan_lookback"]), (1000, None, "auto", ["plan_recount"]),
     (200, None, "auto", ["plan_fixed"]), (1000, 300, "loop", ["plan_fixed"] * 4),
     (0, None, "loop", ["plan_fixed"]), (1000, 128, "scan", ["plan_scan"]),
     (0, None, "scan", ["plan_fixed"]), (1000, 128, "lookback", ["plan_lookback"]),
     (0, None, "lookback", ["plan_fixed"]), (1000, 128, "recount", ["plan_recount"]),
     (0, None, "recount", ["plan_fixed"])],
)  # fmt: skip
def test_explain_plan_matches_the_dispatcher(bs, chunk, strategy, kinds):
    split = explain_plan(bs, chunk, strategy)
    g = torch.Generator().manual_seed(bs)
    case = build_plan_case(
        prefix_lens=torch.randint(0, 9, (bs,), generator=g),
        extend_seq_lens=torch.randint(0, 3, (bs,), generator=g),
        padding=torch.zeros(bs, dtype=torch.bool),
        max_seq_len=8, lut_len=None, swa_window_size=0, capacity_mode="at",
        capacity_delta=0, spare_capacity=0, spare_verify=0, seed=bs, device=DEVICE,
    )  # fmt: skip
    with record_launches() as launches:
        plan_offsets(**case.inputs(), **case.fresh_outputs(), chunk_size=chunk, strategy=strategy)
    assert [la.kind for la in launches] == kinds
    kernels = {"plan_fixed": 1, "plan_scan": 2, "plan_lookback": 1, "plan_recount": 1}
    assert len(split.triton_launches) == sum(kernels[k] for k in kinds)


# ---------------------------------------------------------------- fuzz


def test_fuzz_20_examples(capsys):
    """On the CPU (the interpreter) unless a GPU is present; small sizes either way."""
    argv = ["fuzz", "--device", DEVICE, "--examples", "20", "--sizes", "ci", "--seed", "3",
            "--quiet"]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "20 examples passed" in out and "0 failures" in out


def _snippet(stdout: str) -> str:
    return stdout.split("as a runnable script:\n", 1)[1]


@pytest.mark.parametrize("max_bs", [["--max-bs", "40"], []], ids=["max_bs_40", "default"])
def test_fuzz_failure_prints_a_runnable_shrunk_counterexample(monkeypatch, capsys, max_bs):
    """A planted bug (any scatter of 3 or more requests fails) is found, shrunk, and printed
    as a script that reproduces it. With the default ``--max-bs`` the block edges (255 and
    up) are drawn too; the shrunk batch is still the smallest that fails."""
    import kvcanary_dispatch.testing.properties as props

    real = props.check_scatter_property

    def planted(case, *args, **kwargs):
        assert case.bs < 3, "planted bug: bs >= 3"
        return real(case, *args, **kwargs)

    monkeypatch.setattr(props, "check_scatter_property", planted)
    argv = ["fuzz", "--device", DEVICE, "--examples", "200", "--op", "scatter", "--sizes", "ci",
            "--seed", "0", "--quiet", *max_bs]  # fmt: skip
    assert main(argv) == 1
    out = capsys.readouterr().out
    assert "FAILED: Call(scatter, bs=" in out and "planted bug: bs >= 3" in out
    shrunk_bs = int(out.split("FAILED: Call(scatter, bs=", 1)[1].split(",", 1)[0])
    assert 3 <= shrunk_bs <= 6
    snippet = _snippet(out)
    compile(snippet, "repro.py", "exec")
    with pytest.raises(AssertionError, match="planted bug"):
        exec(snippet, {"__name__": "__main__"})  # reproduces (the bug is still planted)
    monkeypatch.setattr(props, "check_scatter_property", real)
    exec(snippet, {"__name__": "__main__"})  # and passes once it is gone


def test_large_counterexample_is_saved_and_reloaded(tmp_path, capsys):
    case = make_scatter_case([3000, 0, 2500], width=8, seed=5, device=DEVICE)
    snippet, saved = repro_snippet(Call("scatter", case, "flat", None), tmp_path)
    assert saved is not None and saved.parent == tmp_path and saved.exists()
    exec(snippet, {"__name__": "__main__"})
    assert "passed: the failure did not reproduce" in capsys.readouterr().out
