"""The fixed-block kv-canary Triton kernels, their launchers and torch references."""

from .plan_offsets import PLAN_BATCH_BLOCK, launch_plan_offsets_kernel
from .references import plan_offsets_ref, scatter_req_token_ids_ref
from .scatter_req_token_ids import (
    SCATTER_BATCH_BLOCK,
    SCATTER_TOKEN_BLOCK,
    launch_scatter_req_token_ids_kernel,
)

__all__ = [
    "PLAN_BATCH_BLOCK",
    "SCATTER_BATCH_BLOCK",
    "SCATTER_TOKEN_BLOCK",
    "launch_plan_offsets_kernel",
    "launch_scatter_req_token_ids_kernel",
    "plan_offsets_ref",
    "scatter_req_token_ids_ref",
]
