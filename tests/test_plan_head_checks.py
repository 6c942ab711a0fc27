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
