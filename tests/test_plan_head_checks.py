"""Plan refusals that the one-pass launch head (``kernels.plan_checks._fit_head``) must not
let through, and a non-tensor ``carry`` on the fixed-block launcher: each refused before any
launch, with the fixed-block launcher's text, the outputs left as they were."""

from __future__ import annotations

import re

import pytest
import torch
from _helpers import (
    as_kernel_kwargs,
    dispatch_cases,
    plan_kwargs,
    plan_outputs,
    rejected,
    strided_view,
)
from conftest import DEVICE

import kvcanary_dispatch
from kvcanary_dispatch import plan_offsets
from kvcanary_kernels import launch_plan_offsets_kernel as kernel_plan

_scatter_case, _plan_case = dispatch_cases(DEVICE)


@pytest.mark.parametrize("strategy", ["auto", "recount", "lookback", "scan"])
def test_plan_refuses_a_strided_lut(strategy):
    """A strided LUT is refused by name, by the dispatcher at every strategy and by the
    drop-in launcher, as the fixed-block launcher refuses it: a head that took it would
    read the LUT as contiguous (the poison between its elements as SWA slots)."""
    kw = plan_kwargs(_plan_case(5, lut_len=7))
    kw["full_to_swa_index_mapping"] = strided_view(kw["full_to_swa_index_mapping"], fill=-1)
    text = (
        "kv-canary: full_to_swa_index_mapping must be contiguous; pass "
        "full_to_swa_index_mapping.contiguous()"
    )
    with pytest.raises(ValueError, match=f"^{re.escape(text)}$"):
        kernel_plan(**as_kernel_kwargs(kw), bs_block=8)
    assert (
        rejected(ValueError, lambda: plan_offsets(**kw, strategy=strategy), plan_outputs(kw))
        == text
    )
    drop_in = as_kernel_kwargs(kw)
    call = lambda: kvcanary_dispatch.launch_plan_offsets_kernel(**drop_in)  # noqa: E731
    assert rejected(ValueError, call, plan_outputs(kw)) == text


@pytest.mark.parametrize(
    "name", ["out_verify_num_valid", "out_verify_enable", "out_write_num_valid_reqs"]
)
def test_plan_refuses_each_scalar_output_of_two_elements(name):
    """Each of the three int32 scalar outputs holds exactly one element: a two-element one is
    refused with the launcher's text, whichever it is."""
    kw = plan_kwargs(_plan_case(5))
    kw[name] = torch.zeros(2, dtype=torch.int32, device=DEVICE)
    text = f"kv-canary: {name} length must be 1, got 2"
    with pytest.raises(ValueError, match=f"^{text}$"):
        kernel_plan(**as_kernel_kwargs(kw), bs_block=8)
    assert rejected(ValueError, lambda: plan_offsets(**kw), plan_outputs(kw)) == text


@pytest.mark.parametrize("carry", [[0, 0, 0], (0, 0, 0), 0])
def test_fixed_block_launcher_names_a_non_tensor_carry(carry):
    """A ``carry`` that is not a tensor is a ``TypeError`` naming it, as every other plan
    argument's, before any launch (not Python's own error from reading its attributes)."""
    kw = plan_kwargs(_plan_case(5))
    call = lambda: kernel_plan(**as_kernel_kwargs(kw), bs_block=8, carry=carry)  # noqa: E731
    text = f"kv-canary: plan_offsets carry must be a torch.Tensor, got {type(carry).__name__}"
    assert rejected(TypeError, call, plan_outputs(kw)) == text


def _longer_write_offsets(kw: dict) -> None:
    n = kw["out_write_offsets"].numel()
    kw["out_write_offsets"] = torch.zeros(n + 1, dtype=torch.int64, device=DEVICE)


def _short_outputs_with_a_2d_write_pair(kw: dict) -> None:
    """Verify offsets and seeds too short for the batch of 5, beside write offsets of one
    element more than the seeds but 2-D: not the well-formed pair of a capacity error."""
    kw["out_verify_offsets"] = kw["out_verify_offsets"][:3].clone()
    kw["out_write_seed_slot_indices"] = kw["out_write_seed_slot_indices"][:3].clone()
    kw["out_write_offsets"] = kw["out_write_offsets"][:4].clone()[:, None]


@pytest.mark.parametrize(
    "mutate,text",
    [
        (_longer_write_offsets, "kv-canary: write_offsets_len must equal write_req_capacity + 1, "
         "got 9 and 7; size out_write_offsets to len(out_write_seed_slot_indices) + 1 = 8 "
         "elements"),
        (_short_outputs_with_a_2d_write_pair, "kv-canary: out_verify_offsets length must be >= "
         "6, got 3"),
    ],
    ids=["write_offsets_one_longer", "2d_write_pair"],
)  # fmt: skip
def test_plan_refuses_a_write_pair_of_the_wrong_shape(mutate, text):
    """Write offsets longer than the seeds + 1 are refused, not planned into (the one-pass
    head checks the length is exactly that); short outputs beside a 2-D write pair keep the
    length error, not the capacity error of a whole output set sized for fewer requests."""
    kw = plan_kwargs(_plan_case(5))
    mutate(kw)
    assert rejected(ValueError, lambda: plan_offsets(**kw), plan_outputs(kw)) == text
