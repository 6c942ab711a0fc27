"""What the command line and the benchmarks' reports leave in a process that calls them in
place (a notebook, a test session, an engine's tooling): the environment, the current CUDA
device, matplotlib's backend and pyplot's figures are as they were, after a refusal or a
failure too; and how ``--device`` is taken (on the CPU, torch.cuda faked with two devices)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import matplotlib
import matplotlib.pyplot as plt
import pytest
import torch
from conftest import two_gpus

from benchmarks import distributions
from benchmarks.distributions_report import plot as plot_distributions
from kvcanary_dispatch.cli import command, main
from kvcanary_dispatch.cli.results import Meta
from kvcanary_dispatch.cli.sweep import SweepConfig, SweepResult
from kvcanary_dispatch.cli.sweep_report import plot as plot_sweep

_REFUSED_IN_PROCESS = """
import os
import kvcanary_dispatch  # the kernels defined compiled, as in a GPU process
from kvcanary_dispatch.cli import main
rc = main(["fuzz", "--device", "cpu", "--examples", "1", "--quiet"])
print(rc, os.environ.get("TRITON_INTERPRET"))
"""


def test_an_in_process_cpu_call_after_compiled_kernels_is_refused_and_changes_nothing():
    """Called in a process (no re-exec) whose kernels were defined compiled, ``--device cpu``
    is refused with the fix, and the environment is left as it was: ``TRITON_INTERPRET``
    still unset (set, each kernel defined later in the process would be interpreted, and
    each child process would inherit it)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run(
        [sys.executable, "-c", _REFUSED_IN_PROCESS], capture_output=True, text=True, env=env,
        timeout=300,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["2", "None"], res.stdout
    assert "set TRITON_INTERPRET=1 before kvcanary_kernels is imported" in res.stderr


@pytest.fixture
def fake_cuda(monkeypatch) -> dict:
    """torch.cuda with two devices, for the CPU, where no CUDA runs: ``current`` the current
    index (0 at first), ``initialized`` whether CUDA is initialised (True at first; a
    ``set_device`` initialises it); ``set_device`` refuses an index past the two."""
    state = {"current": 0, "initialized": True, "count": 2}

    def set_device(device) -> None:
        index = device if isinstance(device, int) else torch.device(device).index
        if not 0 <= index < state["count"]:
            raise RuntimeError(f"invalid device ordinal {index}")
        state.update(current=index, initialized=True)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: state["count"])
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: state["initialized"])
    monkeypatch.setattr(torch.cuda, "current_device", lambda: state["current"])
    monkeypatch.setattr(torch.cuda, "set_device", set_device)
    return state


def _command_on_device(monkeypatch, index: int, outcome: str = "returns") -> None:
    """``explain`` replaced by a command that makes device ``index`` current, then returns 0
    or raises a ``CliError``."""

    def run(args, argv) -> int:
        torch.cuda.set_device(torch.device(f"cuda:{index}"))
        if outcome == "raises":
            raise command.CliError("stopped")
        return 0

    monkeypatch.setitem(command._COMMANDS, "explain", run)


@pytest.mark.parametrize("outcome", ["returns", "raises"])
@pytest.mark.parametrize("callers", [0, 1])
def test_a_command_leaves_the_callers_current_cuda_device(fake_cuda, monkeypatch, outcome, callers):
    """A command makes its ``--device`` current for its timers; once ``main`` returns, the
    caller's own device is current again, after a command that raised too."""
    fake_cuda["current"] = callers
    _command_on_device(monkeypatch, 1 - callers, outcome)
    assert main(["explain", "--op", "scatter", "--bs", "8"]) == (0 if outcome == "returns" else 2)
    assert fake_cuda["current"] == callers


@pytest.mark.parametrize(
    "argv,fix",
    [
        (["explain", "--op", "scatter", "--bs", "8"], "give a smaller --bs or --tokens"),
        (["sweep", "--bs", "8"], "give smaller --bs or --width, or larger --chunk-sizes"),
        (["fuzz", "--examples", "1"], "give a smaller --max-bs, or --sizes ci"),
    ],
    ids=lambda v: v[0] if isinstance(v, list) else "",
)
@pytest.mark.parametrize(
    "error,what",
    [
        (MemoryError(), "host memory (MemoryError)"),
        (RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 8 bytes"
                      "\nmore"), "memory (DefaultCPUAllocator: can't allocate memory: you "
                      "tried to allocate 8 bytes)"),
        (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
         "memory (CUDA out of memory. Tried to allocate 2.00 GiB)"),
    ],
    ids=["MemoryError", "cpu_allocator", "cuda"],
)  # fmt: skip
def test_a_command_out_of_memory_is_one_line_naming_the_fix(
    monkeypatch, capsys, argv, fix, error, what
):
    """Memory that runs out (a plan of millions of slices, a huge batch's inputs; the host's,
    or an allocator's of torch on either device) ends the command with the run-time error's
    exit 2 (1 says a call was wrong) and one line naming what ran out and that command's
    options that shrink the work, not a traceback."""

    def run(args, argv) -> int:
        raise error

    monkeypatch.setitem(command._COMMANDS, argv[0], run)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"kvcanary-dispatch: error: out of {what}: {fix}")
    assert err.count("\n") == 1


def test_an_error_that_only_names_allocation_is_not_taken_for_memory(monkeypatch):
    """A library error that merely mentions allocation (upstream's "exceeds pre-allocated"
    capacity texts) is raised as it came, not reported as memory running out."""
    text = "kv-canary: forward_batch.batch_size=9 exceeds pre-allocated write_req_capacity=8"

    def run(args, argv) -> int:
        raise RuntimeError(text)

    monkeypatch.setitem(command._COMMANDS, "sweep", run)
    with pytest.raises(RuntimeError, match=re.escape(text)):
        main(["sweep", "--bs", "8"])


def test_a_command_that_initialises_cuda_leaves_device_0_current(fake_cuda, monkeypatch):
    """CUDA not initialised on entry (no device current yet): a command that initialises it
    on device 1 leaves device 0, CUDA's default, current."""
    fake_cuda["initialized"] = False
    _command_on_device(monkeypatch, 1)
    assert main(["explain", "--op", "scatter", "--bs", "8"]) == 0
    assert fake_cuda["current"] == 0


def test_the_distributions_benchmark_leaves_the_callers_current_cuda_device(
    fake_cuda, monkeypatch, tmp_path
):
    """``benchmarks.distributions.main`` on ``cuda:1`` times there, and gives the caller its
    device back."""
    seen = []

    def run(args, device) -> int:
        seen.append((device, fake_cuda["current"]))
        return 0

    monkeypatch.setattr(distributions, "_run", run)
    assert distributions.main(["--device", "cuda:1", "--out", str(tmp_path)]) == 0
    assert seen == [(torch.device("cuda:1"), 1)]
    assert fake_cuda["current"] == 0


# ---------------------------------------------------------------- --device


def test_an_indexed_cuda_device_is_made_current_for_the_timers(fake_cuda):
    assert command._prepare_device("cuda:1", [], False) == torch.device("cuda:1")
    assert fake_cuda["current"] == 1


@pytest.mark.parametrize("name", ["cuda:2", "cuda:3"])
def test_a_cuda_index_past_the_devices_is_one_line(fake_cuda, name):
    """Refused with the count, before ``set_device`` would raise torch's own error."""
    with pytest.raises(command.CliError, match=rf"^--device {name}: only 2 CUDA device\(s\)$"):
        command._prepare_device(name, [], False)
    assert fake_cuda["current"] == 0


@pytest.mark.parametrize("name", ["meta", "mps", "cpu:1"])  # one CPU device, no index
def test_a_device_neither_cuda_nor_cpu_is_refused(name):
    with pytest.raises(command.CliError, match=r"expected cuda, cuda:N or cpu$"):
        command._prepare_device(name, [], False)


def test_cuda_under_the_interpreter_warns_and_only_then(fake_cuda, monkeypatch, capsys):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    command._prepare_device("cuda:0", [], False)
    assert "warning: TRITON_INTERPRET=1 is set" in capsys.readouterr().err
    monkeypatch.delenv("TRITON_INTERPRET")
    command._prepare_device("cuda:0", [], False)
    assert "warning" not in capsys.readouterr().err


def test_the_reexec_for_the_interpreter_marks_its_child(monkeypatch):
    """Kernels already compiled, a process of its own: ``--device cpu`` runs the command again
    in a new Python with the interpreter on and the child marked, so that a child that still
    finds compiled kernels is refused instead of running itself again, without end."""
    monkeypatch.setattr(command, "_kernels_compiled", lambda: True)
    # A copy of the environment without the two variables: what the call sets stays in it
    # (monkeypatch.delenv of an unset variable would not undo a later assignment)
    unset = (command._REEXEC_ENV, "TRITON_INTERPRET")
    monkeypatch.setattr(os, "environ", {k: v for k, v in os.environ.items() if k not in unset})

    class Execed(Exception):
        pass

    def execv(path, args):
        raise Execed(dict(os.environ), args)

    monkeypatch.setattr(os, "execv", execv)
    with pytest.raises(Execed) as info:
        command._prepare_device("cpu", ["fuzz", "--device", "cpu"], True)
    env, args = info.value.args
    assert env[command._REEXEC_ENV] == env["TRITON_INTERPRET"] == "1"
    # -P (3.11+): a package in the working directory does not replace the running one
    safe = ["-P"] if sys.version_info >= (3, 11) else []
    assert args[1:] == [*safe, "-m", "kvcanary_dispatch", "fuzz", "--device", "cpu"]


# ---------------------------------------------------------------- plots


@pytest.fixture
def callers_pyplot():
    """The caller's matplotlib: an interactive-like backend (svg) and one open figure; put
    back afterwards."""
    backend = matplotlib.get_backend()
    matplotlib.use("svg")
    mine = plt.figure()
    yield mine
    plt.close(mine)
    matplotlib.use(backend)


def _plots(tmp_path):
    sweep = SweepResult(Meta.collect(torch.device("cpu")), [], [], SweepConfig(torch.device("cpu")))
    return {
        "sweep": lambda path: plot_sweep(sweep, path),
        "distributions": lambda path: plot_distributions([], path, ["auto"], ["auto"]),
    }


@pytest.mark.parametrize("which", ["sweep", "distributions"])
def test_a_plot_keeps_the_callers_backend_and_figures(callers_pyplot, tmp_path, which):
    """Drawn and saved, a plot changes neither the backend nor pyplot's figures; one whose
    save fails (a missing folder) raises and leaves no figure behind either."""
    plot = _plots(tmp_path)[which]
    plot(tmp_path / "a.png")
    assert (tmp_path / "a.png").stat().st_size > 0
    with pytest.raises(FileNotFoundError):
        plot(tmp_path / "missing" / "b.png")
    assert matplotlib.get_backend() == "svg"
    assert plt.get_fignums() == [callers_pyplot.number]


@two_gpus
def test_fuzz_on_the_second_gpu_gives_the_caller_its_device_back(capsys):
    """On a real second GPU: ``fuzz --device cuda:1`` runs there and device 0 is current
    again once ``main`` returns."""
    torch.cuda.set_device(0)
    assert main(["fuzz", "--device", "cuda:1", "--examples", "2", "--quiet"]) == 0
    assert torch.cuda.current_device() == 0
