"""tests/gpu/sglang_cuda.py (the H200 run against sglang's CUDA kernels) smoke-tested small on
this machine: every check of it runs, on sglang's torch references, and passes; a mismatch
makes it exit non-zero."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

pytest_plugins = ["_sglang_fixtures"]  # the kv fixture, and a clean patch state per test


SCRIPT = Path(__file__).resolve().parents[1] / "gpu" / "sglang_cuda.py"


def test_gpu_script_runs_small_on_the_cpu(kv, tmp_path):
    env = dict(os.environ, TRITON_INTERPRET="1")
    cmd = [sys.executable, str(SCRIPT), "--device", "cpu", "--quick", "--out", str(tmp_path)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    summary = json.loads((tmp_path / "sglang_cuda.json").read_text())
    assert summary["failed"] == [] and len(summary["results"]) == 11
    assert summary["skipped"] == [
        "build sglang's CUDA-JIT kernels",
        "a verify plan past 2**31 - 1 entries: patched == unpatched",
    ]
    assert "9 passed, 2 skipped, 0 failed" in (tmp_path / "sglang_cuda.log").read_text()
