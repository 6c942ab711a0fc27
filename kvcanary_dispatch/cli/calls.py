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

from ..launch_plan import plan_offsets_launch_plan, scatter_launch_plan
from ..plan import PLAN_STRATEGIES, plan_offsets
from ..scatter import SCATTER_STRATEGIES, scatter_req_token_ids
from ..testing.cases import PlanCase, ScatterCase
from .per_request_grid import scatter_per_request_grid

# Calls that read device values back to size their work: never capturable.
HOST_SYNCING = frozenset({"torch_ref"})


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


def refused_under_capture(
    function: str, strategy: str, chunk: int | None, bs: int, tokens: int, inputs: dict
) -> bool:
    """Whether the ``strategy`` call of ``function`` (``scatter`` or ``plan``) on ``inputs`` (a
    batch of ``bs`` requests and ``tokens`` tokens) cannot be captured in a CUDA graph: the
    torch references read sizes back, and a dispatcher call says so in its launch plan
    (``LaunchPlan.capture_refusal``: CPU offsets for a GPU pool, a ``loop``'s read-back).
    The other calls here are capturable."""
    if strategy in HOST_SYNCING:
        return True
    if function == "scatter" and strategy in SCATTER_STRATEGIES:
        pool, offsets = inputs["pool_out"], inputs["offsets"]
        on = ("cpu" if pool.is_cpu else "host") if offsets.is_cpu else "device"
        plan = scatter_launch_plan(bs, tokens, chunk, strategy, on, int(pool.shape[1]))
    elif function == "plan" and strategy in PLAN_STRATEGIES:
        plan = plan_offsets_launch_plan(bs, chunk, strategy, capturing=True)
    else:
        return False
    return plan.capture_refusal is not None
