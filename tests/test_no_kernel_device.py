"""Calls no kernel can run are refused before anything runs, the fix named: CPU tensors in a
process whose kernels were defined for a GPU (``TRITON_INTERPRET`` unset when the package was
first imported), and a guard for CUDA where torch sees no GPU. Meta tensors:
``test_dispatch_api.py``."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from test_cli import REPO, _env_without_interpreter

from kvcanary_dispatch import CanaryCapacities, ForwardStepGuard

_CPU_REFUSAL = (
    " is a CPU tensor, but the kernels were defined for a GPU: CPU tensors run only in "
    "Triton's interpreter; pass CUDA tensors, or set TRITON_INTERPRET=1 before "
    "kvcanary_dispatch (or kvcanary_kernels) is first imported"
)

# Run in a fresh Python without TRITON_INTERPRET: every call on CPU tensors, its outputs
# poisoned first; prints, per call, the error's type and text and whether the outputs kept
# their poison.
_CALLS = r"""
import json
import torch
import kvcanary_kernels
from kvcanary_dispatch import (
    CanaryCapacities, ForwardStepGuard, plan_offsets, scatter_req_token_ids)
from kvcanary_dispatch.testing.cases import make_plan_case, make_scatter_case
from kvcanary_dispatch.testing.engine_steps import poison_

def attempt(call, outputs):
    poison_(*outputs)
    kept = [t.clone() for t in outputs]
    try:
        call()
        error = None
    except Exception as err:
        error = [type(err).__name__, str(err)]
    untouched = all(torch.equal(a, b) for a, b in zip(outputs, kept))
    return {"error": error, "untouched": untouched}

seen = {"interpreted": kvcanary_kernels.INTERPRETED}
scatter = make_scatter_case([3, 0, 5] * 100, width=8)
for strategy in ("auto", "loop", "sliced"):
    pool = scatter.fresh_pool()
    seen[f"scatter {strategy}"] = attempt(
        lambda: scatter_req_token_ids(**scatter.kwargs(pool), strategy=strategy), [pool])
plan = make_plan_case(prefix_lens=[1, 4, 2] * 100, extend_seq_lens=[2, 0, 3] * 100,
                      max_seq_len=16)
for strategy in ("auto", "loop"):
    outputs = plan.fresh_outputs()
    seen[f"plan {strategy}"] = attempt(
        lambda: plan_offsets(**plan.inputs(), **outputs, strategy=strategy),
        list(outputs.values()))
guard = ForwardStepGuard(CanaryCapacities(8, 64, 10**6), device="cpu")
seen["guard step"] = attempt(
    lambda: list(guard.plan_step(req_pool_indices=plan.req_pool_indices[:5],
                                 prefix_lens=plan.prefix_lens[:5],
                                 extend_seq_lens=plan.extend_seq_lens[:5],
                                 req_to_token=plan.req_to_token)),
    list(guard.buffers.tensors().values()))
print(json.dumps(seen))
"""


@pytest.fixture(scope="module")
def calls_without_the_interpreter() -> dict:
    out = subprocess.run(
        [sys.executable, "-c", _CALLS],
        capture_output=True, text=True, cwd=REPO, env=_env_without_interpreter(), timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.splitlines()[-1])


@pytest.mark.parametrize(
    "call, name",
    [
        ("scatter auto", "scatter_req_token_ids pool_out"),
        ("scatter loop", "scatter_req_token_ids pool_out"),
        ("scatter sliced", "scatter_req_token_ids pool_out"),
        ("plan auto", "plan_offsets out_verify_offsets"),
        ("plan loop", "plan_offsets out_verify_offsets"),
        ("guard step", "plan_offsets out_verify_offsets"),
    ],
)
def test_cpu_tensors_refused_where_the_kernels_are_compiled(
    calls_without_the_interpreter, call, name
):
    seen = calls_without_the_interpreter
    assert seen["interpreted"] is False
    assert seen[call] == {
        "error": ["ValueError", f"kv-canary: {name}{_CPU_REFUSAL}"],
        "untouched": True,
    }


def test_a_guard_for_cuda_without_a_gpu_is_refused(monkeypatch):
    """Before: a ``RuntimeError`` about a "dummy base class" from torch's stream query."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError) as err:  # the device as given, its index included
        ForwardStepGuard(CanaryCapacities(4, 16, 100), device="cuda:1")
    assert str(err.value).startswith("kv-canary: ForwardStepGuard(device=cuda:1) needs")
    with pytest.raises(RuntimeError) as err:
        ForwardStepGuard(CanaryCapacities(4, 16, 100), device="cuda")
    assert str(err.value) == (
        "kv-canary: ForwardStepGuard(device=cuda) needs a CUDA device, but torch sees none "
        "(torch.cuda.is_available() is False); run where a GPU is visible, or pass "
        "device='cpu' in a process whose kernels run in Triton's interpreter "
        "(TRITON_INTERPRET=1 before kvcanary_dispatch is first imported)"
    )
