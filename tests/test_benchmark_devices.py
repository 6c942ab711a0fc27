"""The benchmarks' devices: a CUDA device torch does not see, or a name torch does not take, is
a usage error (exit 2) naming the fix (the command line's own check), before anything is
measured or written; the benchmarks that time CUDA launches only say so without a GPU."""

from __future__ import annotations

import importlib

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
    err = _usage_error(module, ["--device", "cpu"], tmp_path, capsys)
    assert (
        "error: --device cpu needs Triton's interpreter, but the kernels were defined for a "
        "GPU: set TRITON_INTERPRET=1 before they are imported (run the benchmark as python -m "
        "benchmarks.NAME, which sets it for --device cpu)"
    ) in err
