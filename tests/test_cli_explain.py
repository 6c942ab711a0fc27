"""``kvcanary-dispatch explain``: what it prints for a batch (slices, launches, grids, the graph
plan under ``--capturing``, what capture refuses), checked against the dispatcher's real
launches for scatter and plan across batch sizes, chunk sizes and strategies."""

from __future__ import annotations

import re

import pytest
import torch
from conftest import DEVICE

from kvcanary_dispatch import plan_offsets, scatter_req_token_ids
from kvcanary_dispatch.cli import main
from kvcanary_dispatch.cli.explain import explain_plan, explain_scatter, uniform_offsets
from kvcanary_dispatch.launch_plan import SCATTER_STRATEGIES, resolve_scatter_strategy
from kvcanary_dispatch.testing.cases import make_scatter_case, offsets_from_lens
from kvcanary_dispatch.testing.properties import record_launches
from kvcanary_dispatch.testing.strategies import build_plan_case
from kvcanary_kernels.scatter_req_token_ids import scatter_grid


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


@pytest.mark.parametrize("bs,noted", [(0, False), (5000, True)])
def test_explain_notes_the_largest_plan_slice_only_where_there_are_slices(capsys, bs, noted):
    """``scan`` at bs = 0 runs one fixed-block launch, which has no slice: no note on slices."""
    assert main(["explain", "--op", "plan", "--bs", str(bs), "--strategy", "scan"]) == 0
    text = capsys.readouterr().out
    assert ("chunk_size=None: the largest slice, 4096 requests" in text) == noted, text


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
    run can fill, names where the choice turns, in its header too, and matches the calls on
    either side of it."""
    argv = ["explain", "--op", "scatter", "--bs", "128", "--width", "262144"]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "tokens=unknown, strategy=auto (runs rows up to 131072 tokens, capped past them)" in text
    assert "auto takes 'rows' up to 131072 tokens and 'capped' past them; shown: 'capped'" in text
    for tokens, runs in (("131072", "rows"), ("131073", "capped")):
        assert main([*argv, "--tokens", tokens]) == 0
        assert f"strategy=auto (runs {runs})" in capsys.readouterr().out
    assert main(["explain", "--op", "scatter", "--bs", "8", "--width", "8192"]) == 0
    text = capsys.readouterr().out  # rows whatever the tokens: nothing turns
    assert "strategy=auto (runs rows)" in text and "up to" not in text


@pytest.mark.parametrize(
    "bs, width", [(1, 64), (8, 64), (8, 100000), (300, 4096), (512, 8), (513, 8), (100000, 64)]
)
def test_explain_without_tokens_names_the_choice_auto_makes_for_any_count(bs, width, capsys):
    """Where auto's choice does not turn on the token count, the header and the note name that
    one choice, the resolver's at every token count; no note names another strategy."""
    assert main(["explain", "--op", "scatter", "--bs", str(bs), "--width", str(width)]) == 0
    text = capsys.readouterr().out
    counts = (0, 1, width - 1, width, width + 1, 4 * width, 2**20, 2**31)
    (runs,) = {resolve_scatter_strategy("auto", bs, t, None, width) for t in counts}
    assert f"strategy=auto (runs {runs})" in text, text
    assert f"auto runs {runs!r} for {bs} request" in text and "whatever the token count" in text
    others = set(SCATTER_STRATEGIES) - {runs, "auto"}
    notes = [line for line in text.splitlines() if "note:" in line]
    assert not [n for n in notes for name in others if f"'{name}'" in n], notes


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
     (1000, 2000, None, "segments"), (1000, 2000, None, "capped"), (40, 9000, None, "auto"),
     (100, 5, 10, "loop"), (20, 2560, 10, "loop")],  # empty slices; slices of 5 x 256 tokens
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
        # each launch's grid, from the tokens of the slice the launcher was handed
        sizes = [int(la.args["flat_in"].shape[0]) for la in launches]
        assert [la.grid for la in triton] == [scatter_grid(n) for n in sizes if n]
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


def test_explain_prints_at_most_the_rows_asked_and_counts_the_rest(capsys):
    """``--rows N`` prints at most N slice rows, the first half (one more when N is odd)
    and the last, and the rows shown and the hidden count add up to the slices."""
    argv = ["explain", "--op", "scatter", "--bs", "100", "--tokens", "50", "--strategy", "loop",
            "--chunk-size", "10"]  # fmt: skip
    for rows, first, last in ((1, [0], []), (2, [0], [9]), (5, [0, 1, 2], [8, 9]),
                              (9, [0, 1, 2, 3, 4], [6, 7, 8, 9]), (10, list(range(10)), []),
                              (11, list(range(10)), [])):  # fmt: skip
        assert main([*argv, "--rows", str(rows)]) == 0
        text = capsys.readouterr().out
        assert "10 slice(s)" in text
        printed = [int(m) for m in re.findall(r"^ +(\d+)  \[", text, flags=re.M)]
        assert printed == first + last, (rows, text)
        hidden = 10 - len(printed)
        if hidden == 0:
            assert "more slice" not in text
        else:
            assert f"({hidden} more slice{'s' if hidden > 1 else ''})" in text, text


@pytest.mark.parametrize("strategy", ["capped", "rows", "flat", "segments"])
def test_explain_says_chunk_size_does_not_apply_where_the_plan_has_no_slices(strategy):
    """The note reads the plan (no request slices), whichever strategy runs."""
    split = explain_scatter(40, 4000, 8, strategy, width=256)
    assert f"chunk_size does not apply to {strategy} (it has no request slices)" in split.notes
    assert not any("does not apply" in n for n in explain_scatter(40, 4000, 8, "sliced").notes)


@pytest.mark.parametrize("strategy", ["auto", "capped"])
def test_explain_capped_without_a_width_says_its_shapes_are_the_widest_pools(strategy):
    """``capped`` planned with no pool width (its head steps and tail programs as for the
    widest pool) says so and names ``--width``, asked for by name or taken by ``auto``."""
    split = explain_scatter(600, 180000, None, strategy)
    assert any("pool width unknown" in n and "--width" in n for n in split.notes), split.notes
    assert not any("pool width unknown" in n for n in explain_scatter(600, 180000, None, strategy,
                                                                      width=4).notes)  # fmt: skip


def test_explain_loop_token_ranges_and_empty_slices(capsys):
    """5 tokens over 100 requests in slices of 10: request r starts at floor(r * 5 / 100), so
    slice k holds tokens [k // 2, (k + 1) // 2): the even slices none (no launch), the odd ones
    one token (one launch, grid (1,)); the note gives the mean run length."""
    split = explain_scatter(100, 5, 10, "loop")
    assert split.token_ranges == [(k // 2, (k + 1) // 2) for k in range(10)]
    assert [la.slice_index for la in split.triton_launches] == [1, 3, 5, 7, 9]
    assert [la.grid for la in split.triton_launches] == [(1,)] * 5
    assert any("(5 tokens over 100 requests, ~0.05 a request)" in n for n in split.notes)
    argv = ["explain", "--op", "scatter", "--bs", "100", "--tokens", "5", "--strategy", "loop",
            "--chunk-size", "10", "--rows", "10"]  # fmt: skip
    assert main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[4].split() == ["1", "[10,", "20)", "[0,", "1)", "(1,)"]
    assert lines[5].split() == ["2", "[20,", "30)", "[1,", "1)", "no", "launch", "(no", "tokens)"]
    assert "  launches: 5 Triton launch(es) + 13 torch device op(s)" in lines  # 10 rebases, 3
    assert "    5 x _scatter_req_token_ids_kernel, grid (1,); BATCH_BLOCK=16" in lines


def test_explain_host_offsets_names_the_staging_not_none():
    """CPU offsets with the rest on a GPU: the call stages and uploads them; the host-syncs line
    says so rather than a bare "none" (the device-offsets call's)."""
    host = explain_scatter(1000, 4000, None, "auto", offsets_on="host", width=64)
    device = explain_scatter(1000, 4000, None, "auto", offsets_on="device", width=64)
    assert device.host_syncs == ["none"]
    assert len(host.host_syncs) == 1
    assert host.host_syncs[0].startswith("none: the CPU offsets are copied on the host into "
                                         "private pinned staging")  # fmt: skip


def test_explain_without_tokens_prints_no_grid_it_cannot_know(capsys):
    """With the token count unknown, a single-launch strategy's grid is not printed (the plan
    behind it used a stand-in token count)."""
    assert main(["explain", "--op", "scatter", "--bs", "600", "--width", "4"]) == 0
    text = capsys.readouterr().out
    assert "    1 x _scatter_capped_kernel, grid -; REQS=" in text, text
    assert "note: grids depend on the token count: pass --tokens for them" in text


@pytest.mark.parametrize(
    "argv,hint",
    [
        (["--chunk-size", "1000"], True),  # past the scatter's 511, inside the plan's 4 096
        (["--chunk-size", "0"], False),  # refused by both
        (["--bs", "5000000", "--chunk-size", "1"], False),  # too many slices for both
    ],
)
def test_a_refused_call_points_at_the_other_only_where_that_one_is_explained(argv, hint, capsys):
    """With both calls explained, the one refused is the error (exit 2, one line), and it
    points at ``--op plan`` only where the plan alone would be explained."""
    assert main(["explain", "--bs", "10", *argv]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.startswith("kvcanary-dispatch: error: ")
    assert captured.err.count("\n") == 1
    assert captured.err.endswith(" (--op plan explains the other call alone)\n") == hint
    if hint:
        assert main(["explain", "--op", "plan", "--bs", "10", *argv]) == 0
