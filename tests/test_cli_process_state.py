"""What the command line and the benchmarks' reports leave in a process that calls them in
place (a notebook, a test session, an engine's tooling): the environment, the current CUDA
device, matplotlib's backend and pyplot's figures are as they were, after a refusal or a
failure too."""

from __future__ import annotations

import os
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
def fake_cuda_device(monkeypatch) -> list[int]:
    """torch.cuda's current device as a list of one index, with CUDA initialised, device 0
    current and ``set_device`` switching it: for the CPU, where no CUDA runs."""
    current = [0]

    def set_device(device) -> None:
        current[0] = device if isinstance(device, int) else torch.device(device).index

    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current[0])
    monkeypatch.setattr(torch.cuda, "set_device", set_device)
    return current


@pytest.mark.parametrize("outcome", ["returns", "raises"])
def test_a_command_leaves_the_callers_current_cuda_device(fake_cuda_device, monkeypatch, outcome):
    """A command makes its ``--device`` current for its timers; once ``main`` returns, the
    caller's device is current again, after a command that raised too."""

    def command_on_device_1(args, argv) -> int:
        torch.cuda.set_device(torch.device("cuda:1"))
        if outcome == "raises":
            raise command.CliError("stopped")
        return 0

    monkeypatch.setitem(command._COMMANDS, "explain", command_on_device_1)
    assert main(["explain", "--op", "scatter", "--bs", "8"]) == (0 if outcome == "returns" else 2)
    assert fake_cuda_device == [0]


def test_the_distributions_benchmark_leaves_the_callers_current_cuda_device(
    fake_cuda_device, monkeypatch, tmp_path
):
    """``benchmarks.distributions.main`` on ``cuda:1`` times there, and gives the caller its
    device back."""
    seen = []

    def run(args, device) -> int:
        seen.append((device, fake_cuda_device[0]))
        return 0

    monkeypatch.setattr(distributions, "_run", run)
    assert distributions.main(["--device", "cuda:1", "--out", str(tmp_path)]) == 0
    assert seen == [(torch.device("cuda:1"), 1)]
    assert fake_cuda_device == [0]


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
