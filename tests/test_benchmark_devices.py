"""The benchmarks' devices: a CUDA device torch does not see, a name torch does not take, or the
CPU where the kernels were defined for a GPU is a usage error (exit 2) naming the fix (the
command line's own check), before anything is measured or written; the benchmarks that time
CUDA launches only say so without a GPU, or for any other device."""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path

import pytest
import torch

NO_GPU = "no CUDA device is available (torch.cuda.is_available() is False); use --device cpu"
CUDA_ONLY = (
    "it times CUDA launches, but torch sees no CUDA device (torch.cuda.is_available() is "
    "False); run it on a GPU machine"
)


def _usage_error(module: str, argv: list[str], tmp_path, capsys) -> str:
    main = importlib.import_module(f"benchmarks.{module}").main
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exit_:
        main([*argv, "--out", str(out)])
    assert exit_.value.code == 2
    assert not out.exists()
    return capsys.readouterr().err


@pytest.mark.parametrize(
    "module, argv, text",
    [
        ("distributions", ["--device", "cuda"], f"--device cuda: {NO_GPU}"),
        ("plan_sizes", ["--device", "cuda:1"], f"--device cuda:1: {NO_GPU}"),
        ("suite", ["--device", "cuda"], f"--device cuda: {NO_GPU}"),
        ("host_overhead", [], CUDA_ONLY),  # cuda by default
        ("launch_cost", [], CUDA_ONLY),
    ],
)
def test_a_cuda_device_without_a_gpu_is_a_usage_error(
    monkeypatch, capsys, tmp_path, module, argv, text
):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert f"error: {text}" in _usage_error(module, argv, tmp_path, capsys)


def test_a_cuda_index_past_the_gpus_is_a_usage_error(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    err = _usage_error("plan_sizes", ["--device", "cuda:1"], tmp_path, capsys)
    assert "error: --device cuda:1: only 1 CUDA device(s)" in err


def test_a_device_name_torch_does_not_take_is_a_usage_error(capsys, tmp_path):
    err = _usage_error("distributions", ["--device", "gpu0"], tmp_path, capsys)
    assert "error: --device 'gpu0': expected cuda, cuda:N or cpu" in err


@pytest.mark.parametrize("module", ["distributions", "plan_sizes", "suite"])
def test_the_cpu_with_kernels_defined_for_a_gpu_is_a_usage_error(
    monkeypatch, capsys, tmp_path, module
):
    # As in a process that imported the kernels without TRITON_INTERPRET and set it after:
    # the kernels are what decides, not the variable.
    import kvcanary_kernels

    monkeypatch.setattr(kvcanary_kernels, "INTERPRETED", False)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(Path, "mkdir", _ran_past_the_check)  # fail fast, not after a run
    err = _usage_error(module, ["--device", "cpu"], tmp_path, capsys)
    assert (
        "error: --device cpu needs Triton's interpreter, but the kernels were defined for a "
        "GPU: set TRITON_INTERPRET=1 before they are imported (run the benchmark as python -m "
        "benchmarks.NAME, which sets it for --device cpu)"
    ) in err


def _ran_past_the_check(*args, **kwargs):
    raise AssertionError("the benchmark went on past its device check")


@pytest.mark.parametrize("name", ["cpu", "cpu:0"])
def test_a_benchmark_that_times_cuda_launches_takes_no_other_device(
    monkeypatch, capsys, tmp_path, name
):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(Path, "mkdir", _ran_past_the_check)
    err = _usage_error("host_overhead", ["--device", name], tmp_path, capsys)
    assert f"error: --device {name}: it times CUDA launches; pass cuda or cuda:N" in err


@pytest.mark.parametrize(
    "argv, interpreted",
    [
        (["--device", "cpu"], True),
        (["--device=cpu"], True),
        (["--device", "cpu:0"], True),
        (["--device=cpu:0"], True),
        (["--device", "cuda"], False),
        (["--device", "cuda:1", "--out", "cpu"], False),
        ([], False),
    ],
)
def test_a_benchmark_run_on_the_cpu_switches_the_interpreter_on(monkeypatch, argv, interpreted):
    from benchmarks import interpreter_off_gpu

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # its value is restored after
    monkeypatch.setattr(sys, "argv", ["distributions.py", *argv])
    interpreter_off_gpu("__main__")
    assert (os.environ.pop("TRITON_INTERPRET", None) == "1") is interpreted
    interpreter_off_gpu("benchmarks.distributions")  # imported, not run: nothing changes
    assert "TRITON_INTERPRET" not in os.environ
