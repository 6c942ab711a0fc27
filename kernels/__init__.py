"""The fixed-block kv-canary Triton kernels, their launchers and torch references."""

from .plan_offsets import _PLAN_BS_BLOCK_SIZE, launch_plan_offsets_kernel
from .references import plan_offsets_ref, scatter_req_token_ids_ref
from .scatter_req_token_ids import (
    _SCATTER_BATCH_BLOCK,
    _SCATTER_TOKEN_BLOCK,
    launch_scatter_req_token_ids_kernel,
)

__all__ = [
    "_PLAN_BS_BLOCK_SIZE",
    "_SCATTER_BATCH_BLOCK",
    "_SCATTER_TOKEN_BLOCK",
    "launch_plan_offsets_kernel",
    "launch_scatter_req_token_ids_kernel",
    "plan_offsets_ref",
    "scatter_req_token_ids_ref",
]
