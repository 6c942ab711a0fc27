"""The ``torch.compile`` custom ops (``kvcanary_dispatch.ops``) pass ``torch.library.opcheck``:
their schemas declare exactly what they mutate (the inputs, int32 offsets among them, are left
as they were), their fake implementations agree with the real ones, no autograd kernel is
missing, and AOT dispatch with dynamic shapes runs them."""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICE

import kvcanary_dispatch.ops  # noqa: F401  (registers the ops)
from kvcanary_dispatch.testing.cases import make_plan_case, make_scatter_case
from kvcanary_kernels.args import PLAN_INPUT_NAMES, PLAN_OUTPUT_NAMES, PLAN_SCALAR_NAMES


def _passes(op, args: tuple) -> None:
    results = torch.library.opcheck(op, args)
    assert all(v == "SUCCESS" for v in results.values()), results


@pytest.mark.parametrize("offsets_dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("strategy,chunk", [("auto", None), ("loop", 2), ("rows", None),
                                            ("capped", None), ("sliced", 2)])  # fmt: skip
def test_scatter_op_passes_opcheck(strategy, chunk, offsets_dtype):
    case = make_scatter_case([3, 0, 5, 2, 9], width=8, seed=2, device=DEVICE)
    offsets = case.offsets.to(offsets_dtype)
    args = (case.flat_in, offsets, case.req_pool_indices, case.fresh_pool(), chunk, strategy)
    _passes(torch.ops.kvcanary_dispatch.scatter_req_token_ids.default, (*args, False))


@pytest.mark.parametrize("lut_len", [None, 5])
@pytest.mark.parametrize("strategy,chunk", [("auto", None), ("scan", 2), ("lookback", 2),
                                            ("recount", 2), ("loop", 2)])  # fmt: skip
def test_plan_op_passes_opcheck(strategy, chunk, lut_len):
    lens = dict(prefix_lens=[2, 3, 0, 4, 1], extend_seq_lens=[1, 2, 3, 0, 2], max_seq_len=8)
    case = make_plan_case(**lens, lut_len=lut_len, swa_window_size=2, device=DEVICE)
    inputs, outputs = case.inputs(), case.fresh_outputs()
    args = [inputs[n] for n in PLAN_INPUT_NAMES] + [outputs[n] for n in PLAN_OUTPUT_NAMES]
    args += [inputs[n] for n in PLAN_SCALAR_NAMES] + [chunk, strategy, False]
    _passes(torch.ops.kvcanary_dispatch.plan_offsets.default, tuple(args))


def test_op_schemas_declare_an_optional_lut_and_outputs_of_their_own():
    """What the compiler reads of the ops: the LUT may be ``None`` (``Tensor?``), each output
    is mutated under an alias set of its own (``Tensor(mK!)``: no two alias each other), and
    the scalars stay symbolic (``SymInt``). opcheck and eager calls accept a weaker schema, so
    only the schema itself shows it."""
    plan = str(torch.ops.kvcanary_dispatch.plan_offsets.default._schema)
    assert "Tensor? full_to_swa_index_mapping," in plan, plan
    for k, name in enumerate(PLAN_OUTPUT_NAMES):
        assert f"Tensor(m{k}!) {name}," in plan, plan
    for name in PLAN_SCALAR_NAMES:
        assert f"SymInt {name}," in plan, plan
    scatter = str(torch.ops.kvcanary_dispatch.scatter_req_token_ids.default._schema)
    assert "Tensor flat_in, Tensor offsets, Tensor req_pool_indices, Tensor(m0!) pool_out," in (
        scatter
    )
