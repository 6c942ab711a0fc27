"""The public functions as torch custom ops, for ``torch.compile``.

Under compilation (``torch.compiler.is_compiling()``) ``scatter_req_token_ids`` and
``plan_offsets`` call these ops, which the compiler keeps as opaque calls that mutate their
output tensors; eagerly the functions run directly (a custom op's dispatch costs host time).
The ops take the functions' arguments positionally, in the functions' keyword order; their
schemas are written from the argument names of ``kvcanary_kernels.args``. Their integer
arguments (``chunk_size``, the plan's ``swa_window_size`` and ``verify_capacity``) are
``SymInt``: a dynamic size passed as one (``verify_capacity`` as a verify buffer's length)
stays symbolic, so a step compiled with dynamic shapes does not recompile for each batch
size.
"""

from __future__ import annotations

import torch

from kvcanary_kernels.args import (
    PLAN_INPUT_NAMES,
    PLAN_OUTPUT_NAMES,
    PLAN_SCALAR_NAMES,
    PlanInputs,
    PlanOutputs,
    ScatterArgs,
)

from .plan import plan_bundled
from .scatter import scatter_req_token_ids

_OPTIONS = "SymInt? chunk_size, str strategy, bool validate"


def _schema(tensors: list[str], scalars: tuple[str, ...], mutated: tuple[str, ...]) -> str:
    """``(Tensor a, Tensor(m0!) b, ..., SymInt s, <options>) -> ()``; ``Tensor?`` for the LUT."""
    args = []
    for name in tensors:
        kind = "Tensor?" if name == "full_to_swa_index_mapping" else "Tensor"
        if name in mutated:
            kind = f"Tensor(m{mutated.index(name)}!)"
        args.append(f"{kind} {name}")
    args += [f"SymInt {name}" for name in scalars]  # SymInt: a dynamic size stays symbolic
    return f"({', '.join(args)}, {_OPTIONS}) -> ()"


def _scatter_impl(flat_in, offsets, req_pool_indices, pool_out, chunk_size, strategy, validate):
    scatter_req_token_ids(
        flat_in=flat_in,
        offsets=offsets,
        req_pool_indices=req_pool_indices,
        pool_out=pool_out,
        chunk_size=chunk_size,
        strategy=strategy,
        validate=validate,
    )


def _plan_impl(*args) -> None:
    n_in, n_out = len(PLAN_INPUT_NAMES), len(PLAN_OUTPUT_NAMES)
    inputs = list(args[:n_in]) + list(args[n_in + n_out : n_in + n_out + 2])
    i = PlanInputs(*inputs)
    o = PlanOutputs(*args[n_in : n_in + n_out])
    # A CUDA-graph tree's warm-up runs the op eagerly with its allocations routed to the
    # graph's pool: no buffer kept between calls (kvcanary_dispatch.resident).
    plan_bundled(i, o, *args[n_in + n_out + 2 :], resident=False)


def _no_output(*args) -> None:
    return None


_SCATTER_TENSORS = list(ScatterArgs._fields)
_scatter_op = torch.library.custom_op(
    "kvcanary_dispatch::scatter_req_token_ids",
    _scatter_impl,
    mutates_args=("pool_out",),
    schema=_schema(_SCATTER_TENSORS, (), ("pool_out",)),
)
_scatter_op.register_fake(_no_output)
_plan_op = torch.library.custom_op(
    "kvcanary_dispatch::plan_offsets",
    _plan_impl,
    mutates_args=PLAN_OUTPUT_NAMES,
    schema=_schema([*PLAN_INPUT_NAMES, *PLAN_OUTPUT_NAMES], PLAN_SCALAR_NAMES, PLAN_OUTPUT_NAMES),
)
_plan_op.register_fake(_no_output)
