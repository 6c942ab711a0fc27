"""The public functions as torch custom ops, for ``torch.compile``.

Under compilation (``torch.compiler.is_compiling()``) ``scatter_req_token_ids`` and
``plan_offsets`` call these ops, which the compiler keeps as opaque calls that mutate their
output tensors; eagerly the functions run directly (a custom op's dispatch costs host time).
The ops take the functions' arguments positionally, in the functions' keyword order.
"""

from __future__ import annotations

import torch

from .plan import plan_offsets
from .scatter import scatter_req_token_ids

_PLAN_OUTPUTS = (
    "out_verify_offsets",
    "out_write_offsets",
    "out_write_seed_slot_indices",
    "out_verify_num_valid",
    "out_verify_enable",
    "out_write_num_valid_reqs",
)


@torch.library.custom_op("kvcanary_dispatch::scatter_req_token_ids", mutates_args=("pool_out",))
def _scatter_op(
    flat_in: torch.Tensor,
    offsets: torch.Tensor,
    req_pool_indices: torch.Tensor,
    pool_out: torch.Tensor,
    chunk_size: int | None,
    strategy: str,
    validate: bool,
) -> None:
    scatter_req_token_ids(**locals())  # the parameters, by the function's keyword names


@_scatter_op.register_fake
def _(flat_in, offsets, req_pool_indices, pool_out, chunk_size, strategy, validate) -> None:
    return None


@torch.library.custom_op("kvcanary_dispatch::plan_offsets", mutates_args=_PLAN_OUTPUTS)
def _plan_op(
    req_pool_indices: torch.Tensor,
    prefix_lens: torch.Tensor,
    extend_seq_lens: torch.Tensor,
    req_to_token: torch.Tensor,
    full_to_swa_index_mapping: torch.Tensor | None,
    out_verify_offsets: torch.Tensor,
    out_write_offsets: torch.Tensor,
    out_write_seed_slot_indices: torch.Tensor,
    out_verify_num_valid: torch.Tensor,
    out_verify_enable: torch.Tensor,
    out_write_num_valid_reqs: torch.Tensor,
    swa_window_size: int,
    verify_capacity: int,
    chunk_size: int | None,
    strategy: str,
    validate: bool,
) -> None:
    plan_offsets(**locals())  # the parameters, by the function's keyword names


@_plan_op.register_fake
def _(*args) -> None:
    return None
