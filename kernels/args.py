"""The launchers' tensor arguments as small bundles, and upstream's flat keywords mapped onto them.

A scatter call is one ``ScatterArgs``. Upstream's plan launcher takes 13 flat keywords; inside
this package a plan call is one ``PlanInputs`` and one ``PlanOutputs``. ``PLAN_INPUT_NAMES``,
``PLAN_OUTPUT_NAMES`` and ``PLAN_SCALAR_NAMES`` are those keywords, in upstream's order, named
once here: the custom op schema and the sglang signature checks read them from this module.
"""

from __future__ import annotations

import inspect
from typing import NamedTuple

import torch

from ._checks import PREFIX, name_a_non_tensor
from ._launch import Head, make_head

PLAN_INPUT_NAMES = (
    "req_pool_indices",
    "prefix_lens",
    "extend_seq_lens",
    "req_to_token",
    "full_to_swa_index_mapping",
)
PLAN_OUTPUT_NAMES = (
    "out_verify_offsets",
    "out_write_offsets",
    "out_write_seed_slot_indices",
    "out_verify_num_valid",
    "out_verify_enable",
    "out_write_num_valid_reqs",
)
PLAN_SCALAR_NAMES = ("swa_window_size", "verify_capacity")
# Upstream's fixed-block launcher names its verify offsets output this way.
SCRATCH_NAME = "out_verify_offsets_scratch"


class ScatterArgs(NamedTuple):
    """A scatter's tensors, by upstream's keyword names. (The bundles are named tuples: one is
    built on every call, in less than half a frozen dataclass's time.)"""

    flat_in: torch.Tensor  # [num_tokens] int64
    offsets: torch.Tensor  # [bs + 1] int64, a CSR over flat_in
    req_pool_indices: torch.Tensor  # [bs] int64, distinct rows of pool_out
    pool_out: torch.Tensor  # [rows, max_context_len] int32, rows contiguous (or one column)

    @property
    def bs(self) -> int:
        return self.req_pool_indices.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.flat_in.shape[0]

    def kernel_args(self) -> tuple:
        """The leading positional arguments every scatter kernel takes, in its signature's
        order: the four tensors, ``num_tokens``, ``bs``, the pool's row stride and width."""
        flat_in, offsets, req_pool_indices, pool = self
        tokens, bs = flat_in.shape[0], req_pool_indices.shape[0]
        return (flat_in, offsets, req_pool_indices, pool, tokens, bs, pool.stride(0), pool.shape[1])


class PlanInputs(NamedTuple):
    """What a plan reads: per-request tensors of ``bs`` elements, the token table, an optional
    full-to-SWA slot LUT, and the two scalars."""

    req_pool_indices: torch.Tensor  # [bs] int64, 0 = padding
    prefix_lens: torch.Tensor  # [bs] int64
    extend_seq_lens: torch.Tensor  # [bs] int64
    req_to_token: torch.Tensor  # [rows, max_seq_len] int32
    full_to_swa_index_mapping: torch.Tensor | None  # [lut_len] int64
    swa_window_size: int
    verify_capacity: int

    @property
    def bs(self) -> int:
        return self.req_pool_indices.shape[0]

    def requests(self, s: int, e: int) -> PlanInputs:
        """Requests ``[s, e)`` of the batch (views)."""
        return self._replace(
            req_pool_indices=self.req_pool_indices[s:e],
            prefix_lens=self.prefix_lens[s:e],
            extend_seq_lens=self.extend_seq_lens[s:e],
        )


class PlanOutputs(NamedTuple):
    """What a plan writes: offsets ``[0, bs]``, seeds ``[0, bs)`` and three int32 scalars."""

    out_verify_offsets: torch.Tensor  # [>= bs + 1] int64
    out_write_offsets: torch.Tensor  # [write_req_capacity + 1] int64
    out_write_seed_slot_indices: torch.Tensor  # [write_req_capacity] int64
    out_verify_num_valid: torch.Tensor  # [1] int32
    out_verify_enable: torch.Tensor  # [1] int32
    out_write_num_valid_reqs: torch.Tensor  # [1] int32

    def from_request(self, s: int) -> PlanOutputs:
        """The per-request outputs from request ``s`` on (views; the scalars unchanged)."""
        return self._replace(
            out_verify_offsets=self.out_verify_offsets[s:],
            out_write_offsets=self.out_write_offsets[s:],
            out_write_seed_slot_indices=self.out_write_seed_slot_indices[s:],
        )


def bundle_plan_args(
    keywords: dict, verify_offsets_name: str = "out_verify_offsets"
) -> tuple[PlanInputs, PlanOutputs]:
    """Upstream's flat keywords as bundles; ``verify_offsets_name`` is the keyword of the verify
    offsets output. A ``TypeError`` names any missing or unexpected keyword."""
    keywords = dict(keywords)
    keywords.setdefault("full_to_swa_index_mapping", None)
    expected = (*PLAN_INPUT_NAMES, verify_offsets_name, *PLAN_OUTPUT_NAMES[1:], *PLAN_SCALAR_NAMES)
    missing = [k for k in expected if k not in keywords]
    unexpected = sorted(set(keywords) - set(expected))
    if missing or unexpected:
        parts = [f"missing {', '.join(missing)}"] if missing else []
        parts += [f"unexpected {', '.join(unexpected)}"] if unexpected else []
        raise TypeError(
            f"{PREFIX}plan arguments: {'; '.join(parts)}; the keywords are "
            f"{', '.join(expected)} (full_to_swa_index_mapping may be left out)"
        )
    keywords["out_verify_offsets"] = keywords.pop(verify_offsets_name)
    inputs = PlanInputs(**{k: keywords[k] for k in (*PLAN_INPUT_NAMES, *PLAN_SCALAR_NAMES)})
    outputs = PlanOutputs(**{k: keywords[k] for k in PLAN_OUTPUT_NAMES})
    return inputs, outputs


def plan_kernel_head(i: PlanInputs, o: PlanOutputs, spare: torch.Tensor) -> Head:
    """The 11 tensors every plan kernel takes first, in its signature's order, as a launch
    ``Head``; ``spare`` stands in for the LUT when there is none (never read then). For
    arguments ``check_plan_args`` has passed: it fixes each tensor's dtype and puts all of
    them on one device."""
    lut = i.full_to_swa_index_mapping
    args = (
        i.req_pool_indices,
        i.prefix_lens,
        i.extend_seq_lens,
        i.req_to_token,
        lut if lut is not None else spare,
        *o,  # the six outputs, PlanOutputs' order being the kernels'
    )
    return make_head(args, tuple(map(torch.Tensor.data_ptr, args)), args[5].get_device())


def plan_kernel_scalars(i: PlanInputs) -> tuple[int, int, int, int]:
    """The four integers every plan kernel takes first after its tensors: the token table's
    row stride, rows and width (``max_seq_len``; no seed is read outside them) and the LUT's
    length (0 without one)."""
    lut = i.full_to_swa_index_mapping
    rows, width = i.req_to_token.shape
    return i.req_to_token.stride(0), rows, width, int(lut.shape[0]) if lut is not None else 0


def plan_keywords(i: PlanInputs, o: PlanOutputs) -> dict:
    """The bundles as upstream's 13 flat keywords, in upstream's order (inputs, outputs,
    scalars; the verify offsets output named ``out_verify_offsets``)."""
    kw = {name: getattr(i, name) for name in PLAN_INPUT_NAMES}
    kw.update((name, getattr(o, name)) for name in PLAN_OUTPUT_NAMES)
    kw.update((name, getattr(i, name)) for name in PLAN_SCALAR_NAMES)
    return kw


def plan_signature(verify_offsets_name: str, *extra: inspect.Parameter) -> inspect.Signature:
    """Upstream's keyword-only signature (no defaults), the verify offsets output named
    ``verify_offsets_name``, then ``extra``: for functions that take ``**keywords``."""
    names = [*PLAN_INPUT_NAMES, verify_offsets_name, *PLAN_OUTPUT_NAMES[1:], *PLAN_SCALAR_NAMES]
    params = [inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY) for n in names]
    return inspect.Signature([*params, *extra], return_annotation=None)


def name_a_non_scatter_tensor(err: Exception, t: ScatterArgs) -> None:
    """After ``err`` from a scatter call: a ``TypeError`` naming the first argument that is not
    a tensor, if there is one; else return (the caller re-raises)."""
    name_a_non_tensor(err, "scatter_req_token_ids", zip(t, t._fields, strict=True))


def name_a_non_plan_tensor(
    err: Exception, i: PlanInputs, o: PlanOutputs, verify_offsets_name: str
) -> None:
    """After ``err`` from a plan call: a ``TypeError`` naming the first argument that is not a
    tensor (the LUT may be ``None``), if there is one; else return (the caller re-raises)."""
    names = (*PLAN_INPUT_NAMES, verify_offsets_name, *PLAN_OUTPUT_NAMES[1:])
    named = zip((*i[: len(PLAN_INPUT_NAMES)], *o), names, strict=True)
    name_a_non_tensor(err, "plan_offsets", named, optional=("full_to_swa_index_mapping",))
