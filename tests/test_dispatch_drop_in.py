"""The drop-in aliases ``launch_scatter_req_token_ids_kernel`` and
``launch_plan_offsets_kernel``: upstream's keyword-only signatures, any batch size where the
fixed-block launchers refused, and upstream's keyword errors (the launchers' error texts they
keep: ``test_dispatch_api_errors.py``)."""

from __future__ import annotations

import inspect

import pytest
from _helpers import as_kernel_kwargs, dispatch_cases, plan_kwargs, rejected
from conftest import DEVICE

import kvcanary_dispatch
from kvcanary_dispatch.testing.cases import (
    check_plan,
    check_scatter,
)

_scatter_case, _plan_case = dispatch_cases(DEVICE)


UPSTREAM_SCATTER = ("flat_in", "offsets", "req_pool_indices", "pool_out")
# Upstream's keyword order, written out here (not derived from the library it checks).
UPSTREAM_PLAN = tuple(
    "req_pool_indices prefix_lens extend_seq_lens req_to_token full_to_swa_index_mapping "
    "out_verify_offsets_scratch out_write_offsets out_write_seed_slot_indices "
    "out_verify_num_valid out_verify_enable out_write_num_valid_reqs swa_window_size "
    "verify_capacity".split()
)


@pytest.mark.parametrize(
    "fn,names",
    [
        (kvcanary_dispatch.launch_scatter_req_token_ids_kernel, UPSTREAM_SCATTER),
        (kvcanary_dispatch.launch_plan_offsets_kernel, UPSTREAM_PLAN),
    ],
)
def test_drop_in_signatures(fn, names):
    params = inspect.signature(fn).parameters
    assert tuple(params) == names
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in params.values())
    assert all(p.default is inspect.Parameter.empty for p in params.values())


@pytest.mark.parametrize("bs", [0, 513, 4097])
def test_drop_in_scatter(bs):
    case = _scatter_case(bs, seed=bs)
    check_scatter(kvcanary_dispatch.launch_scatter_req_token_ids_kernel, case)
    with pytest.raises(TypeError):
        kvcanary_dispatch.launch_scatter_req_token_ids_kernel(
            **case.kwargs(case.fresh_pool()), chunk_size=4
        )


@pytest.mark.parametrize("bs", [0, 513, 4097])
def test_drop_in_plan(bs):
    case = _plan_case(bs, seed=bs)
    check_plan(
        kvcanary_dispatch.launch_plan_offsets_kernel,
        case,
        out_verify_name="out_verify_offsets_scratch",
    )


@pytest.mark.parametrize(
    "change,named",
    [
        ({"chunk_size": 4}, "unexpected chunk_size"),
        ({"bs_block": 8}, "unexpected bs_block"),
        ({"out_verify_offsets_scratch": None}, "missing out_verify_offsets_scratch"),
        (
            {"out_verify_offsets_scratch": None, "out_verify_offsets": "scratch"},
            "missing out_verify_offsets_scratch; unexpected out_verify_offsets",
        ),
        (
            {"verify_capacity": None, "bs_block": 8, "strategy": "scan"},
            "missing verify_capacity; unexpected bs_block, strategy",
        ),
        (  # several missing: in upstream's order, whatever order the call had them in
            {"swa_window_size": None, "req_to_token": None, "out_write_offsets": None},
            "missing req_to_token, out_write_offsets, swa_window_size",
        ),
    ],
)
def test_drop_in_plan_keyword_errors(change, named):
    """Upstream's keywords and no others: a wrong set is a ``TypeError`` naming each missing
    and unexpected keyword and listing upstream's, before any launch, outputs untouched.
    (``None`` in ``change`` drops the keyword; ``"scratch"`` passes the scratch tensor.)"""
    kw = as_kernel_kwargs(plan_kwargs(_plan_case(600, seed=3)))
    outs = [v for k, v in kw.items() if k.startswith("out_")]
    scratch = kw["out_verify_offsets_scratch"]
    for key, value in change.items():
        if value is None:
            del kw[key]
        else:
            kw[key] = scratch if value == "scratch" else value
    msg = rejected(TypeError, lambda: kvcanary_dispatch.launch_plan_offsets_kernel(**kw), outs)
    assert msg.startswith(f"kv-canary: plan arguments: {named}; the keywords are "), msg
    assert msg.endswith(", ".join(UPSTREAM_PLAN) + " (full_to_swa_index_mapping may be left out)")
