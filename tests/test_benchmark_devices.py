"""The benchmarks' ``--device``: a CUDA device where torch sees none, or a name torch does not
take, is a usage error (exit 2) naming the fix, before anything is measured or written."""

from __future__ import annotations

import importlib

import pytest
import torch

NO_GPU = "torch sees no CUDA device (torch.cuda.is_available() is False); run it on a GPU machine"


@pytest.mark.parametrize(
    "module, argv, lead",
    [
        ("distributions", ["--device", "cuda"], "--device cuda:"),
        ("plan_sizes", ["--device", "cuda:1"], "--device cuda:1:"),
        ("suite", ["--device", "cuda"], "--device cuda:"),
        ("host_overhead", [], "--device cuda:"),  # cuda by default
        ("launch_cost", [], "it times CUDA launches, but"),
    ],
)
def test_a_cuda_device_without_a_gpu_is_a_usage_error(
    monkeypatch, capsys, tmp_path, module, argv, lead
):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    main = importlib.import_module(f"benchmarks.{module}").main
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exit_:
        main([*argv, "--out", str(out)])
    assert exit_.value.code == 2
    assert f"error: {lead} {NO_GPU}" in capsys.readouterr().err
    assert not out.exists()


def test_a_device_name_torch_does_not_take_is_a_usage_error(capsys, tmp_path):
    from benchmarks import plan_sizes

    with pytest.raises(SystemExit) as exit_:
        plan_sizes.main(["--device", "gpu0", "--out", str(tmp_path / "out")])
    assert exit_.value.code == 2
    assert "error: --device gpu0: " in capsys.readouterr().err  # then torch's own words
