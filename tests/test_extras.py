"""Dependencies by role: the runtime needs torch and triton only; the command line says which
extra to install when a subcommand's dependency is missing."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvcanary_dispatch.cli import main


def test_import_loads_neither_matplotlib_nor_hypothesis():
    code = (
        "import sys, kvcanary_dispatch; "
        "assert 'matplotlib' not in sys.modules and 'hypothesis' not in sys.modules, "
        "sorted(m for m in sys.modules if m.split('.')[0] in ('matplotlib', 'hypothesis'))"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize(
    "argv, module",
    [
        (["sweep", "--device", "cpu"], "matplotlib"),
        (["fuzz", "--device", "cpu", "--examples", "1"], "hypothesis"),
    ],
)
def test_a_missing_extra_is_named(argv, module, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, module, None)  # ``import module`` raises ImportError
    assert main(argv) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert err == [
        f"kvcanary-dispatch: error: kvcanary-dispatch {argv[0]} needs {module}: "
        'pip install "kvcanary-dispatch[cli]"'
    ]


def test_the_interpreter_without_numpy_names_the_extra(monkeypatch, capsys):
    """Triton's interpreter imports numpy; the runtime's dependencies do not bring it."""
    monkeypatch.setitem(sys.modules, "numpy", None)
    assert main(["fuzz", "--device", "cpu", "--examples", "1"]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert err == [
        "kvcanary-dispatch: error: --device cpu runs Triton's interpreter, which needs numpy: "
        'pip install "kvcanary-dispatch[cli]"'
    ]
