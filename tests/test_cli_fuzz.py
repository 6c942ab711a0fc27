"""``kvcanary-dispatch fuzz``: passing, and failing with a runnable counterexample that
rebuilds the failing case byte for byte (shrunk, saved to a file when large, or as far as
shrinking got when interrupted)."""

from __future__ import annotations

import dataclasses
import time
import types
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from conftest import DEVICE

from kvcanary_dispatch.cli import fuzz, main
from kvcanary_dispatch.cli.fuzz import Call, repro_snippet
from kvcanary_dispatch.testing.cases import assert_bytes_equal, make_scatter_case
from kvcanary_dispatch.testing.strategies import SIZES


def _argv(examples: int, seed: int, *extra: str) -> list[str]:
    """A quiet fuzz on the test device at the CI sizes."""
    return ["fuzz", "--device", DEVICE, "--examples", str(examples), "--sizes", "ci", "--seed",
            str(seed), "--quiet", *extra]  # fmt: skip


def test_fuzz_20_examples(capsys):
    """On the CPU (the interpreter) unless a GPU is present; small sizes either way."""
    assert main(_argv(20, 3)) == 0
    out = capsys.readouterr().out
    assert "20 examples passed" in out and "0 failures" in out


def _snippet(stdout: str) -> str:
    return stdout.split("as a runnable script:\n", 1)[1]


def _rebuilt(snippet: str, monkeypatch, check: str):
    """The case ``snippet`` rebuilds and hands to ``check`` (a ``properties`` function, caught
    there instead of run)."""
    import kvcanary_dispatch.testing.properties as props

    real, seen = getattr(props, check), []
    monkeypatch.setattr(props, check, lambda case, *args, **kwargs: seen.append(case))
    exec(snippet, {"__name__": "__main__"})
    monkeypatch.setattr(props, check, real)
    assert len(seen) == 1
    return seen[0]


def _assert_same_case(got, want) -> None:
    """Every field equal: tensors in dtype, shape, device and every byte."""
    assert type(got) is type(want)
    for f in dataclasses.fields(want):
        a, b = getattr(got, f.name), getattr(want, f.name)
        if isinstance(b, torch.Tensor):
            assert a.device == b.device, f.name
            assert_bytes_equal(a, b, f.name)
        else:
            assert a == b, (f.name, a, b)


_PLANTED_OPS = {"scatter": "check_scatter_property", "plan": "check_plan_property"}


@pytest.mark.parametrize(
    "op,max_bs,shrunk_max",
    [("scatter", ["--max-bs", "40"], 6), ("scatter", [], 6), ("plan", ["--max-bs", "40"], 40)],
    ids=["scatter_max_bs_40", "scatter_default", "plan_max_bs_40"],
)  # fmt: skip
def test_fuzz_failure_prints_a_runnable_shrunk_counterexample(
    monkeypatch, capsys, op, max_bs, shrunk_max
):
    """A planted bug (any call of 3 or more requests fails) is found in the op's calls, shrunk,
    and printed as a script that rebuilds the shrunk case byte for byte (the last case the
    bug failed on: hypothesis replays the shrunk example last) and reproduces it. With the
    default ``--max-bs`` the block edges (255 and up) are drawn too; the shrunk scatter batch is
    still the smallest that fails (plan batches, drawn as a distribution and a seed past a few
    requests, shrink less far)."""
    import kvcanary_dispatch.testing.properties as props

    check = _PLANTED_OPS[op]
    real, failed = getattr(props, check), []

    def planted(case, *args, **kwargs):
        if case.bs >= 3:
            failed.append(case)
            raise AssertionError("planted bug: bs >= 3")
        return real(case, *args, **kwargs)

    monkeypatch.setattr(props, check, planted)
    assert main(_argv(200, 0, "--op", op, *max_bs)) == 1
    out = capsys.readouterr().out
    assert f"FAILED: Call({op}, bs=" in out and "planted bug: bs >= 3" in out
    shrunk_bs = int(out.split(f"FAILED: Call({op}, bs=", 1)[1].split(",", 1)[0])
    shrunk = failed[-1]  # before the script runs, which the planted bug records too
    assert 3 <= shrunk_bs <= shrunk_max and shrunk.bs == shrunk_bs
    snippet = _snippet(out)
    compile(snippet, "repro.py", "exec")
    with pytest.raises(AssertionError, match="planted bug"):
        exec(snippet, {"__name__": "__main__"})  # reproduces (the bug is still planted)
    _assert_same_case(_rebuilt(snippet, monkeypatch, check), shrunk)
    monkeypatch.setattr(props, check, real)
    exec(snippet, {"__name__": "__main__"})  # and passes once it is gone


def test_fuzz_plan_examples_each_run_a_plan_check(monkeypatch, capsys):
    """``--op plan``: each passing example ran one of the plan's checks (its property against
    the reference, or a refused call), both kinds among them, on batches of several sizes."""
    import kvcanary_dispatch.testing.properties as props

    calls = {name: [] for name in ("check_plan_property", "check_plan_rejected")}
    for name, seen in calls.items():
        real = getattr(props, name)
        monkeypatch.setattr(
            props, name, lambda *a, real=real, seen=seen, **k: (seen.append(a[0]), real(*a, **k))[1]
        )
    assert main(_argv(12, 4, "--op", "plan")) == 0
    assert "12 examples passed" in capsys.readouterr().out
    ran = calls["check_plan_property"] + calls["check_plan_rejected"]
    assert len(ran) >= 12 and all(calls.values()) and len({c.bs for c in ran}) > 1


def test_a_counterexample_saved_under_a_relative_folder_loads_from_anywhere(
    tmp_path, capsys, monkeypatch
):
    """``--save-dir rel``: the script names the saved inputs by their absolute path, so that it
    reproduces when run from another folder, and rebuilds the case byte for byte."""
    monkeypatch.chdir(tmp_path)
    case = make_scatter_case([3000, 0, 2500], width=8, seed=5, device=DEVICE)
    snippet, saved = repro_snippet(Call("scatter", case, "flat", None), Path("rel"))
    assert saved is not None and saved.is_absolute() and saved.parent == tmp_path / "rel"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    exec(snippet, {"__name__": "__main__"})
    assert "passed: the failure did not reproduce" in capsys.readouterr().out
    _assert_same_case(_rebuilt(snippet, monkeypatch, "check_scatter_property"), case)


def test_large_counterexample_is_saved_and_reloaded(tmp_path, capsys, monkeypatch):
    """A case too large to print is saved beside the script, which loads it back byte for
    byte onto the device it failed on."""
    case = make_scatter_case([3000, 0, 2500], width=8, seed=5, device=DEVICE)
    snippet, saved = repro_snippet(Call("scatter", case, "flat", None), tmp_path)
    assert saved is not None and saved.parent == tmp_path and saved.exists()
    assert f'device = "{case.flat_in.device}"' in snippet  # with its index on a GPU
    exec(snippet, {"__name__": "__main__"})
    assert "passed: the failure did not reproduce" in capsys.readouterr().out
    _assert_same_case(_rebuilt(snippet, monkeypatch, "check_scatter_property"), case)


def _timed_outcomes(monkeypatch) -> tuple[list, Callable[[], None]]:
    """The outcomes of the fuzz runs the command makes from now on, and a call that moves the
    fuzz's clock 1 000 s ahead: a run's ``elapsed_s`` counts that jump only when it is taken
    after the run ends, not at its last example."""
    import kvcanary_dispatch.cli.fuzz as fuzz_mod

    real, seen, jump = fuzz_mod.run_fuzz, [], [0.0]
    monkeypatch.setattr(fuzz_mod, "run_fuzz", lambda **kw: seen.append(real(**kw)) or seen[-1])
    clock = types.SimpleNamespace(perf_counter=lambda: time.perf_counter() + jump[0],
                                  strftime=time.strftime)  # fmt: skip
    monkeypatch.setattr(fuzz_mod, "time", clock)
    return seen, lambda: jump.__setitem__(0, 1000.0)


def test_fuzz_interrupted_while_shrinking_reports_the_failure_so_far(monkeypatch, capsys):
    """Ctrl-C while a failure is being shrunk: the smallest failing call seen so far is printed
    with its script, which reproduces it, and the fuzz exits 1 (a failure), not 130."""
    import kvcanary_dispatch.testing.properties as props

    real, failed = props.check_scatter_property, []

    def planted(case, *args, **kwargs):
        if case.bs >= 3:
            failed.append(case)
            if len(failed) == 4:  # the first failure and three shrinking steps
                jump()
                raise KeyboardInterrupt
            raise AssertionError("planted bug: bs >= 3")
        return real(case, *args, **kwargs)

    monkeypatch.setattr(props, "check_scatter_property", planted)
    outcomes, jump = _timed_outcomes(monkeypatch)
    assert main(_argv(200, 0, "--op", "scatter")) == 1
    out = capsys.readouterr().out
    assert "FAILED: Call(scatter, bs=" in out and "planted bug: bs >= 3" in out
    assert "Counterexample, shrinking interrupted, as a runnable script:" in out
    assert outcomes[0].interrupted and outcomes[0].stats.elapsed_s >= 1000  # its whole time
    shrunk = failed[2]  # the last call that failed before the interrupt
    assert f"FAILED: Call(scatter, bs={shrunk.bs}," in out
    snippet = _snippet(out)
    _assert_same_case(_rebuilt(snippet, monkeypatch, "check_scatter_property"), shrunk)


def test_fuzz_interrupted_before_any_failure_says_so(monkeypatch, capsys):
    """Ctrl-C with no failure found: the examples passed are counted, and the fuzz exits 130
    saying no failure was among them."""
    import kvcanary_dispatch.testing.properties as props

    real, seen = props.check_scatter_property, []

    def interrupted(case, *args, **kwargs):
        seen.append(case)
        if len(seen) == 6:
            jump()
            raise KeyboardInterrupt
        return real(case, *args, **kwargs)

    monkeypatch.setattr(props, "check_scatter_property", interrupted)
    outcomes, jump = _timed_outcomes(monkeypatch)
    assert main(_argv(200, 1, "--op", "scatter")) == 130
    assert outcomes[0].interrupted and outcomes[0].stats.elapsed_s >= 1000
    captured = capsys.readouterr()
    assert " examples passed in " in captured.out and "0 failures" not in captured.out
    assert "interrupted: no failure among the examples run" in captured.err


def test_a_save_dir_made_for_nothing_is_removed_again(tmp_path, monkeypatch, capsys):
    """``--save-dir`` is made before fuzzing (to refuse an unwritable one at once); when no
    file is saved there the folders the fuzz made go again, while a folder that existed stays,
    and one that received a counterexample keeps it."""
    import kvcanary_dispatch.cli.fuzz as fuzz_mod
    import kvcanary_dispatch.testing.properties as props

    base = _argv(3, 0, "--op", "scatter", "--save-dir")
    assert main([*base, str(tmp_path / "new" / "deeper")]) == 0
    assert "0 failures" in capsys.readouterr().out
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "b").mkdir()  # a/../b is b, which existed: it stays, and a goes again
    assert main([*base, str(tmp_path / "a" / ".." / "b")]) == 0
    assert [p.name for p in tmp_path.iterdir()] == ["b"]
    (tmp_path / "b").rmdir()
    (tmp_path / "kept").mkdir()
    assert main([*base, str(tmp_path / "kept")]) == 0
    assert (tmp_path / "kept").is_dir() and list((tmp_path / "kept").iterdir()) == []

    def planted(case, *args, **kwargs):
        jump()
        raise AssertionError("planted bug: every call")

    monkeypatch.setattr(props, "check_scatter_property", planted)
    monkeypatch.setattr(fuzz_mod, "_LITERAL_MAX_ELEMS", -1)  # every case is saved, not printed
    outcomes, jump = _timed_outcomes(monkeypatch)
    assert main([*base, str(tmp_path / "made")]) == 1
    assert outcomes[0].failure is not None and outcomes[0].stats.elapsed_s >= 1000
    saved = list((tmp_path / "made").iterdir())
    assert len(saved) == 1 and saved[0].suffix == ".pt"
    assert f"(its inputs are saved in {saved[0]})" in capsys.readouterr().out


def test_fuzz_counts_only_the_examples_it_checked(monkeypatch):
    """A rejection call whose case needs a larger batch (``Call.run`` returns ``False``) is
    rejected from the hypothesis run and appears in no counter, so that ``--examples N`` means
    N checks. ``Call.run`` is stubbed (no kernel), so which calls apply is known."""
    ran: Counter = Counter()

    def run(self) -> bool:  # applicable unless a rejection call
        applicable = not self.kind.endswith("_rejected")
        ran[applicable] += 1
        return applicable

    monkeypatch.setattr(fuzz.Call, "run", run)
    outcome = fuzz.run_fuzz(device=DEVICE, sizes=SIZES["ci"], examples=12, seed=5)
    assert outcome.failure is None
    assert ran[False] > 0  # some calls did not apply: the case this test is about
    stats = outcome.stats
    assert stats.examples == 12 == sum(stats.by_kind.values()) == ran[True]
    assert not [kind for kind in stats.by_kind if kind.endswith("_rejected")], stats.by_kind


_CPU_OOM = "DefaultCPUAllocator: can't allocate memory: you tried to allocate 8 bytes"


def test_an_example_out_of_memory_ends_the_fuzz_as_one_line_not_a_failure(
    tmp_path, monkeypatch, capsys
):
    """An example whose allocation does not fit is the machine's limit, not a wrong result:
    the fuzz stops with the memory error's one line (exit 2, naming the options that shrink
    the work), prints and saves no counterexample, and drops the ``--save-dir`` it made."""
    import kvcanary_dispatch.testing.properties as props

    real, seen = props.check_scatter_property, []

    def out_of_memory(case, *args, **kwargs):
        seen.append(case)
        if len(seen) == 3:
            raise RuntimeError(_CPU_OOM)
        return real(case, *args, **kwargs)

    monkeypatch.setattr(props, "check_scatter_property", out_of_memory)
    save = tmp_path / "made"
    assert main(_argv(50, 0, "--op", "scatter", "--save-dir", str(save))) == 2
    captured = capsys.readouterr()
    assert len(seen) == 3 and "FAILED" not in captured.out, captured.out
    assert captured.err == (
        f"kvcanary-dispatch: error: out of memory ({_CPU_OOM}): give a smaller --max-bs, or "
        "--sizes ci\n"
    )
    assert list(tmp_path.iterdir()) == []


def test_a_smaller_case_out_of_memory_while_shrinking_is_skipped(monkeypatch, capsys):
    """While a failure is shrunk, a smaller case that runs out of memory is skipped, not the
    end of the run: the failure found is reported (exit 1) with the case it failed on."""
    import kvcanary_dispatch.testing.properties as props

    real, failing = props.check_scatter_property, []

    def planted(case, *args, **kwargs):
        if case.bs >= 3 and not failing:
            failing.append(case.bs)
        if failing and case.bs == failing[0]:
            raise AssertionError(f"planted bug: bs == {case.bs}")
        if failing and case.bs >= 3:  # every other case the shrinker tries past 2 requests
            raise RuntimeError(_CPU_OOM)
        return real(case, *args, **kwargs)

    monkeypatch.setattr(props, "check_scatter_property", planted)
    assert main(_argv(200, 0, "--op", "scatter")) == 1
    out = capsys.readouterr().out
    assert f"FAILED: Call(scatter, bs={failing[0]}," in out, out
    assert f"planted bug: bs == {failing[0]}" in out
