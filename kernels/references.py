"""Torch references for the kernels (any device, no Triton).

Each writes exactly the elements its kernel writes, with the same bytes, and nothing else.
Tests and benchmarks share them.
"""

from __future__ import annotations

import torch

from .args import bundle_plan_args


def scatter_req_token_ids_ref(
    *,
    flat_in: torch.Tensor,
    offsets: torch.Tensor,
    req_pool_indices: torch.Tensor,
    pool_out: torch.Tensor,
) -> None:
    """``pool_out[req_pool_indices[r], :n] = flat_in[offsets[r]:offsets[r] + n]`` as int32,
    ``n = min(offsets[r+1] - offsets[r], pool_out.shape[1])``, for every request ``r``. Equal
    to the kernels for offsets of the CSR contract (``0 <= offsets[0]``, non-decreasing,
    ``offsets[bs] <= len(flat_in)``); outside it (a negative offset reads ``flat_in`` from its
    end here) they may differ."""
    bs = int(req_pool_indices.shape[0])
    if bs == 0 or flat_in.numel() == 0:
        return
    width = int(pool_out.shape[1])
    starts = offsets[:-1].to(torch.int64)
    lens = (offsets[1:] - offsets[:-1]).clamp(min=0, max=width)
    # One (request, column) pair per written element, vectorised: no per-request loop.
    req = torch.repeat_interleave(torch.arange(bs, device=flat_in.device), lens)
    first = torch.cumsum(lens, 0) - lens
    col = torch.arange(req.numel(), device=flat_in.device) - first[req]
    pool_out[req_pool_indices[req], col] = flat_in[starts[req] + col].to(torch.int32)


def verify_lens_ref(prefix: torch.Tensor, swa_window_size: int) -> torch.Tensor:
    """Each request's verify run, padding aside: ``prefix - window_start``, at least 0, with
    ``window_start = max(prefix - W, 0)`` when ``W > 0``; computed as ``prefix`` clamped to
    ``[0, W]``, which never wraps."""
    verify = prefix.clamp(min=0)
    return verify.clamp(max=int(swa_window_size)) if swa_window_size > 0 else verify


def plan_offsets_ref(**keywords) -> None:
    """Whole-batch plan with no block, by the dispatcher's keywords (``PLAN_INPUT_NAMES``,
    ``PLAN_SCALAR_NAMES``, ``PLAN_OUTPUT_NAMES`` of ``kvcanary_kernels.args``): writes offsets
    ``[0, bs]``, seeds ``[0, bs)`` and the three scalars."""
    i, o = bundle_plan_args(keywords)
    req_pool_indices, swa_window_size = i.req_pool_indices, i.swa_window_size
    bs = i.bs
    active = req_pool_indices != 0
    prefix, extend = i.prefix_lens, i.extend_seq_lens
    zero = torch.zeros_like(prefix)
    verify_len = torch.where(active, verify_lens_ref(prefix, swa_window_size), zero)
    write_len = torch.where(active, extend.clamp(min=0), zero)

    o.out_verify_offsets[0] = 0
    o.out_write_offsets[0] = 0
    o.out_verify_offsets[1 : bs + 1] = torch.cumsum(verify_len, 0)
    o.out_write_offsets[1 : bs + 1] = torch.cumsum(write_len, 0)

    rows, width = i.req_to_token.shape
    in_table = (req_pool_indices > 0) & (req_pool_indices < rows) & (prefix <= width)
    has_seed = in_table & (prefix > 0) & (write_len > 0)  # a seed outside the table: -1
    slot = zero.clone()
    slot[has_seed] = i.req_to_token[req_pool_indices[has_seed], prefix[has_seed] - 1].to(
        torch.int64
    )
    lut = i.full_to_swa_index_mapping
    if lut is not None:
        mapped = lut[slot.clamp(min=0, max=lut.shape[0] - 1)]
        slot = torch.where(slot < 0, slot, mapped)
    o.out_write_seed_slot_indices[:bs] = torch.where(has_seed, slot, torch.full_like(slot, -1))

    total_verify = int(verify_len.sum())
    o.out_verify_num_valid.fill_(min(total_verify, i.verify_capacity))
    o.out_verify_enable.fill_(int(total_verify <= i.verify_capacity))
    o.out_write_num_valid_reqs.fill_(bs)
