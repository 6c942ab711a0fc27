"""``tests/gpu/sanitize.py``'s bad-offsets calls (``sanitize.py bad``, what compute-sanitizer's
memcheck runs without torch's cache on a GPU) on the suite's device: the script stays
runnable where no GPU is, and every call's guarded pool passes ``check_broken_offsets_writes``
(the script checks each one; on the CPU the interpreter's bounds checks also refuse any read
outside the launch's tensors)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from conftest import DEVICE

from kvcanary_dispatch import SCATTER_STRATEGIES
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
    out = capsys.readouterr().out
    assert f"0 dispatched calls matched the reference, {calls} bad-offsets calls ran" in out
