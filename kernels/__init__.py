"""The fixed-block kv-canary Triton kernels, their launchers and torch references."""

from triton.runtime.jit import JITFunction

# Every kernel module, so that all of them are defined at this import, for a GPU or for
# Triton's interpreter alike (Triton decides when a kernel is defined), as INTERPRETED says.
from . import (  # noqa: F401
    plan_lookback,
    plan_recount,
    plan_scan,
    plan_slices,
    scatter_balanced,
    scatter_capped,
    scatter_flat,
    scatter_rows,
    scatter_segments,
    scatter_sliced,
)
from .plan_offsets import PLAN_BATCH_BLOCK, launch_plan_offsets_kernel
from .references import plan_offsets_ref, scatter_req_token_ids_ref
from .scatter_req_token_ids import (
    SCATTER_BATCH_BLOCK,
    SCATTER_TOKEN_BLOCK,
    _scatter_req_token_ids_kernel,
    launch_scatter_req_token_ids_kernel,
)

# Whether the kernels were defined for Triton's interpreter (TRITON_INTERPRET on when this
# package was first imported, by kvcanary_dispatch or directly), the only way they take CPU
# tensors; fixed for the process.
INTERPRETED = not isinstance(_scatter_req_token_ids_kernel, JITFunction)

__all__ = [
    "INTERPRETED",
    "PLAN_BATCH_BLOCK",
    "SCATTER_BATCH_BLOCK",
    "SCATTER_TOKEN_BLOCK",
    "launch_plan_offsets_kernel",
    "launch_scatter_req_token_ids_kernel",
    "plan_offsets_ref",
    "scatter_req_token_ids_ref",
]
