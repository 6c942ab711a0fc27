"""The calls a timing run measures, by strategy: every strategy of the dispatcher, the direct
fixed-block launch (where the batch fits its block), the per-request-grid baseline (scatter)
and the torch reference. Each takes the op's keywords (and ``chunk_size`` where it has one)."""

from __future__ import annotations

from collections.abc import Callable

from kvcanary_kernels import (
    PLAN_BATCH_BLOCK,
    SCATTER_BATCH_BLOCK,
    launch_plan_offsets_kernel,
    launch_scatter_req_token_ids_kernel,
    plan_offsets_ref,
    scatter_req_token_ids_ref,
)

from ..plan import PLAN_STRATEGIES, plan_offsets
from ..scatter import SCATTER_STRATEGIES, scatter_req_token_ids
from ..testing.cases import PlanCase, ScatterCase
from .per_request_grid import scatter_per_request_grid


def scatter_calls(case: ScatterCase) -> dict[str, Callable[..., None]]:
    calls: dict[str, Callable[..., None]] = {}
    for strategy in SCATTER_STRATEGIES:
        calls[strategy] = lambda s=strategy, **kw: scatter_req_token_ids(**kw, strategy=s)
    if case.bs + 1 <= SCATTER_BATCH_BLOCK:
        calls["fixed_block"] = launch_scatter_req_token_ids_kernel
    calls["per_request_grid"] = scatter_per_request_grid
    calls["torch_ref"] = scatter_req_token_ids_ref
    return calls


def plan_fixed_block(out_verify_offsets, **kw) -> None:
    """The direct fixed-block plan launch, with the dispatcher's keywords."""
    launch_plan_offsets_kernel(**kw, out_verify_offsets_scratch=out_verify_offsets)


def plan_calls(case: PlanCase) -> dict[str, Callable[..., None]]:
    calls: dict[str, Callable[..., None]] = {}
    for strategy in PLAN_STRATEGIES:
        calls[strategy] = lambda s=strategy, **kw: plan_offsets(**kw, strategy=s)
    if case.bs <= PLAN_BATCH_BLOCK:
        calls["fixed_block"] = plan_fixed_block
    calls["torch_ref"] = plan_offsets_ref
    return calls
