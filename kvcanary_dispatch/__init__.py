"""Any-batch-size dispatch for sglang's fixed-block kv-canary Triton kernels.

``scatter_req_token_ids`` and ``plan_offsets`` accept any batch size and give results
byte-identical to one unbounded fixed-block launch. ``launch_scatter_req_token_ids_kernel`` and
``launch_plan_offsets_kernel`` are drop-ins with upstream's exact keyword names. Every call
runs on its tensors' device and that device's current stream; ``kvcanary_dispatch.placement``
states the rules for host data and CUDA-graph capture.
"""

from kvcanary_kernels._checks import CapacityError

from . import ops  # noqa: E402, F401  (registers the torch.compile custom ops)
from .capacities import CanaryCapacities, PlanBuffers
from .forward_step import POLICIES as FORWARD_STEP_POLICIES
from .forward_step import ForwardStepGuard, SubStep, split_forward_step
from .plan import PLAN_MAX_CHUNK, PLAN_STRATEGIES, plan_offsets
from .plan import launch_plan_offsets_kernel_any_bs as launch_plan_offsets_kernel
from .scatter import SCATTER_MAX_CHUNK, SCATTER_STRATEGIES, scatter_req_token_ids
from .scatter import (
    launch_scatter_req_token_ids_kernel_any_bs as launch_scatter_req_token_ids_kernel,
)

__all__ = [
    "FORWARD_STEP_POLICIES",
    "CapacityError",
    "CanaryCapacities",
    "ForwardStepGuard",
    "PlanBuffers",
    "SubStep",
    "split_forward_step",
    "PLAN_MAX_CHUNK",
    "PLAN_STRATEGIES",
    "SCATTER_MAX_CHUNK",
    "SCATTER_STRATEGIES",
    "launch_plan_offsets_kernel",
    "launch_scatter_req_token_ids_kernel",
    "plan_offsets",
    "scatter_req_token_ids",
]
