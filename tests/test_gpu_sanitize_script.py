"""``tests/gpu/sanitize.py``'s bad calls (``sanitize.py bad``, what compute-sanitizer's memcheck
runs without torch's cache on a GPU) on the suite's device: the script stays runnable where no
GPU is, every scatter's guarded pool passes ``check_broken_offsets_writes`` and every plan on
broken data equals the reference (the script checks each; on the CPU the interpreter's bounds
checks also refuse any read outside the launch's tensors)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from conftest import DEVICE

from kvcanary_dispatch import PLAN_STRATEGIES, SCATTER_STRATEGIES
from kvcanary_dispatch.testing.plan_inputs import BROKEN_PLAN_DATA
from kvcanary_dispatch.testing.scatter_inputs import BROKEN_OFFSETS

SCRIPT = Path(__file__).resolve().parent / "gpu" / "sanitize.py"
CAPPED_CALLS = 7  # sanitize._capped_bad_calls: 4 on a wide pool, 3 of drafts


def test_sanitize_bad_offsets_calls_run_and_pass(monkeypatch, capsys):
    spec = importlib.util.spec_from_file_location("kvc_sanitize", SCRIPT)
    sanitize = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, sanitize)  # its dataclass looks itself up
    spec.loader.exec_module(sanitize)
    monkeypatch.setattr(sanitize, "DEVICE", DEVICE)
    sanitize.main(["bad"])
    calls = len(BROKEN_OFFSETS) * (len(SCATTER_STRATEGIES) + 1) + CAPPED_CALLS
    plans = len(BROKEN_PLAN_DATA) * (len(PLAN_STRATEGIES) + 1)
    out = capsys.readouterr().out
    want = f"{calls} bad-offsets calls ran, {plans} plans on broken data matched it"
    assert f"sanitize.py: 0 dispatched calls matched the reference, {want}" in out
