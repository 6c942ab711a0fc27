"""The order and texts of the argument checks both dispatch functions and their drop-ins run
before any launch: a scalar's own error is not taken for a missing tensor, an absent LUT is not
named as a non-tensor, a tensor of higher rank is refused by name, the drop-in's LUT keyword may
be left out, and a slice size out of range gets its remedy."""

from __future__ import annotations

import pytest
from _helpers import dispatch_cases, plan_kwargs, plan_outputs, rejected, scatter_kwargs
from conftest import DEVICE

import kvcanary_dispatch
from kvcanary_dispatch import SCATTER_MAX_CHUNK, plan_offsets, scatter_req_token_ids
from kvcanary_dispatch.testing.cases import check_plan
from kvcanary_kernels import launch_plan_offsets_kernel as kernel_plan
from kvcanary_kernels.args import PLAN_OUTPUT_NAMES, SCRATCH_NAME

_scatter_case, _plan_case = dispatch_cases(DEVICE)


def test_a_non_tensor_does_not_jump_a_checks_own_type_error():
    """The ordered checks' own ``TypeError`` (a scalar that is not an int) is raised as is,
    even when a ``None`` output, which they pass over, comes earlier in upstream's order: only
    an error that is not one of theirs is re-described as naming a non-tensor."""
    kw = plan_kwargs(_plan_case(5), out_verify_num_valid=None, verify_capacity=1.5)
    msg = rejected(TypeError, lambda: plan_offsets(**kw), [kw["out_verify_offsets"]])
    assert msg.startswith("kv-canary: verify_capacity must be an int, got 1.5 (float)"), msg


@pytest.mark.parametrize("name", PLAN_OUTPUT_NAMES)
def test_plan_without_a_lut_names_the_output_that_is_not_a_tensor(name):
    """With no LUT (``full_to_swa_index_mapping=None``, allowed), a list where an output
    belongs is named, not the absent LUT that comes before it."""
    kw = plan_kwargs(_plan_case(5, lut_len=None))
    assert kw["full_to_swa_index_mapping"] is None
    outputs = [kw[k] for k in PLAN_OUTPUT_NAMES if k != name]
    kw[name] = [1, 2]
    msg = rejected(TypeError, lambda: plan_offsets(**kw), outputs)
    assert msg == f"kv-canary: plan_offsets {name} must be a torch.Tensor, got list"


@pytest.mark.parametrize(
    "name,shape",
    [("prefix_lens", (5, 2)), ("req_to_token", None), ("out_verify_num_valid", (1, 1))],
)
def test_plan_refuses_tensors_of_higher_rank(name, shape):
    """A tensor of more dimensions than its argument has is refused by the rank check, naming
    it, not taken as the flat vector its first rows would pass for (a ``[bs, 2]``
    ``prefix_lens`` passes the length check, and the kernel would read it interleaved)."""
    kw = plan_kwargs(_plan_case(5))
    t = kw[name]
    kw[name] = t[..., None] if shape is None else t.new_zeros(shape)
    want = 2 if name == "req_to_token" else 1
    msg = rejected(ValueError, lambda: plan_offsets(**kw), plan_outputs(kw))
    assert msg == f"kv-canary: {name} must be {want}-D, got shape {tuple(kw[name].shape)}", msg


@pytest.mark.parametrize("fn", ["dispatch", "kernel"])
def test_plan_drop_in_takes_a_call_without_the_lut_keyword(fn):
    """``full_to_swa_index_mapping`` may be left out of the drop-in's keywords (its keyword
    error says so): such a call plans as one with ``None``, the dispatcher's drop-in and the
    fixed-block launcher alike."""
    drop_in = kvcanary_dispatch.launch_plan_offsets_kernel if fn == "dispatch" else kernel_plan

    def without_lut(**kw):
        assert kw.pop("full_to_swa_index_mapping") is None
        drop_in(**kw)

    case = _plan_case(5, lut_len=None)
    check_plan(without_lut, case, out_verify_name=SCRATCH_NAME)


def test_chunk_size_out_of_range_names_the_largest_slice_in_its_remedy():
    """The remedy of an out-of-range ``chunk_size`` gives the size ``None`` stands for."""
    kw = scatter_kwargs(_scatter_case(3), chunk_size=SCATTER_MAX_CHUNK + 1, strategy="sliced")
    msg = rejected(ValueError, lambda: scatter_req_token_ids(**kw), [kw["pool_out"]])
    assert msg.endswith(
        "pass a size in that range, or chunk_size=None for the strategy's default (its largest "
        f"slice, {SCATTER_MAX_CHUNK}; under strategy='auto', auto's own choice)"
    ), msg
