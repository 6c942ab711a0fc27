"""Fixed-block scatter of a request-major flat token array into a per-request pool.

One program per ``TOKEN_BLOCK`` tokens. Each program holds all ``bs + 1`` CSR offsets in one
register block of ``BATCH_BLOCK`` lanes and finds the owner of token ``t`` as
``count(offsets <= t) - 1``, hence the cap ``bs + 1 <= BATCH_BLOCK``. Whatever the offsets,
it reads no token outside ``flat_in`` and writes only the owners' rows' first
``max_context_len`` columns.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._checks import PREFIX, require_block, require_same_device
from ._launch import binder
from .args import ScatterArgs, name_a_non_scatter_tensor

SCATTER_BATCH_BLOCK = 512
SCATTER_TOKEN_BLOCK = 256

_NAME = f"{PREFIX}scatter_req_token_ids"
# What the dispatcher, which also takes int32 offsets, adds to a wrong offsets dtype's text.
_OFFSETS_FIX = (
    "; int32 is also taken (widened losslessly); build them in int64, e.g. "
    "torch.cumsum(lens.to(torch.int64), 0)"
)
_INT64_MAX = tl.constexpr(2**63 - 1)


@triton.jit
def _scatter_tile(
    tok,  # [T] int64, token indices rebased to the slice (0 = flat_in[base])
    num_tokens,  # tokens in the slice: base + num_tokens <= len(flat_in)
    rel_offs,  # [B] int64, the slice's rebased offsets; lanes past n_reqs hold INT64_MAX
    n_reqs,  # requests in the slice
    base,  # int64 in [0, len(flat_in)], the token the slice's indices count from
    flat_in_ptr,  # at flat_in[base]
    offsets_ptr,  # at the slice's first request
    req_pool_indices_ptr,  # at the slice's first request
    pool_out_ptr,
    pool_stride0,
    max_context_len,
):
    """Scatter one tile of a slice: owner = count(rebased offsets <= t) - 1.

    Whatever the offsets, an element is written only at a column in ``[0, max_context_len)``
    of an owner's row: the owner's start is compared with the token's absolute index, which
    cannot overflow int64 whatever the start is.
    """
    le = (rel_offs[None, :] <= tok[:, None]).to(tl.int32)  # [T, B] int32
    owner = tl.sum(le, axis=1) - 1  # [T] int32, -1 before offsets[0]
    valid = (tok < num_tokens) & (owner >= 0) & (owner < n_reqs)
    start = tl.load(offsets_ptr + owner, mask=valid, other=0)  # [T] int64, absolute
    at = base + tok  # [T] int64, the token's index in flat_in
    valid = valid & (start <= at) & (start > at - max_context_len)
    col = at - start  # [T] int64, position inside the request: [0, max_context_len) if valid
    row = tl.load(req_pool_indices_ptr + owner, mask=valid, other=0)  # [T] int64
    val = tl.load(flat_in_ptr + tok, mask=valid, other=0)  # [T] int64
    tl.store(pool_out_ptr + row * pool_stride0 + col, val.to(tl.int32), mask=valid)


@triton.jit(do_not_specialize=["num_tokens", "bs", "pool_stride0", "max_context_len"])
def _scatter_req_token_ids_kernel(
    flat_in_ptr,  # [num_tokens] int64
    offsets_ptr,  # [bs + 1] int64, CSR
    req_pool_indices_ptr,  # [bs] int64
    pool_out_ptr,  # [rows, max_context_len] int32, row stride pool_stride0
    num_tokens,
    bs,
    pool_stride0,
    max_context_len,
    TOKEN_BLOCK: tl.constexpr,
    BATCH_BLOCK: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64) * TOKEN_BLOCK + tl.arange(0, TOKEN_BLOCK)  # [T] int64
    lanes = tl.arange(0, BATCH_BLOCK)  # [B]
    # Lanes past bs hold INT64_MAX so they never count as "<= t".
    offs = tl.load(offsets_ptr + lanes, mask=lanes <= bs, other=_INT64_MAX)  # [B] int64
    _scatter_tile(
        tok,
        num_tokens,
        offs,
        bs,
        0,
        flat_in_ptr,
        offsets_ptr,
        req_pool_indices_ptr,
        pool_out_ptr,
        pool_stride0,
        max_context_len,
    )


def check_scatter_args(t: ScatterArgs, *, batch_block: int | None) -> int:
    """The launcher's checks, in the upstream order; returns ``bs``. ``batch_block=None``
    skips the block cap (for callers that split the batch themselves)."""
    flat_in, offsets, req_pool_indices, pool_out = t
    # One expression when every tensor is right (the usual call: one device, the dtypes and
    # ranks, contiguous inputs); else the checks one kind at a time, in upstream's order.
    # pool_out need only have contiguous rows (checked below).
    i64 = torch.int64
    try:
        tensors_ok = (
            pool_out.device == flat_in.device == offsets.device == req_pool_indices.device
            and pool_out.dtype is torch.int32
            and flat_in.dtype is i64
            and offsets.dtype is i64
            and req_pool_indices.dtype is i64
            and pool_out.dim() == 2
            and flat_in.dim() == offsets.dim() == req_pool_indices.dim() == 1
            and flat_in.is_contiguous()
            and offsets.is_contiguous()
            and req_pool_indices.is_contiguous()
        )
    except AttributeError:  # a non-tensor among them: the ordered checks come first
        tensors_ok = False
    if not tensors_ok:
        _check_tensor_kinds(_named_inputs(t), pool_out, widens_int32=batch_block is None)
    bs = req_pool_indices.shape[0]
    if offsets.shape[0] != bs + 1:
        raise ValueError(f"{_NAME} offsets length {offsets.shape[0]} != bs+1 ({bs + 1})")
    if batch_block is not None and bs + 1 > batch_block:  # (the block checked by the launcher)
        raise ValueError(
            f"{_NAME} bs+1={bs + 1} exceeds BATCH_BLOCK={batch_block}; this fixed-block "
            f"launcher takes bs+1 <= batch_block <= {SCATTER_BATCH_BLOCK}: call "
            "kvcanary_dispatch.scatter_req_token_ids, which takes any batch size"
        )
    rows, width = pool_out.shape
    if pool_out.stride(1) != 1 and width > 1:  # one column: any stride is a row
        raise ValueError(
            f"{_NAME} pool_out rows must be contiguous, got strides {pool_out.stride()}"
        )
    if pool_out.stride(0) < width and rows > 1:  # rows sharing memory: racing writes
        raise ValueError(
            f"{_NAME} pool_out rows overlap in memory: strides {pool_out.stride()} for "
            f"{width} columns; pass a pool whose rows are disjoint (row stride >= {width}), "
            "not an expanded or as_strided view"
        )
    if not tensors_ok:
        require_same_device(pool_out, "pool_out", _named_inputs(t))
    return bs


def _named_inputs(t: ScatterArgs) -> tuple[tuple[torch.Tensor, str], ...]:
    return (
        (t.flat_in, "flat_in"),
        (t.offsets, "offsets"),
        (t.req_pool_indices, "req_pool_indices"),
    )


def _check_tensor_kinds(inputs: tuple, pool_out: torch.Tensor, *, widens_int32: bool) -> None:
    """Ranks, then dtypes, then contiguity: the first failure raises. ``widens_int32``: the
    caller (the dispatcher) takes int32 offsets too, which its refusal says."""
    for t, name in inputs:
        if t.dim() != 1:
            raise ValueError(f"{_NAME} {name} must be 1-D, got shape {tuple(t.shape)}")
    if pool_out.dim() != 2:
        raise ValueError(f"{_NAME} pool_out must be 2-D, got shape {tuple(pool_out.shape)}")
    for t, name in inputs:
        if t.dtype != torch.int64:
            fix = _OFFSETS_FIX if widens_int32 and name == "offsets" else ""
            raise TypeError(f"{_NAME} {name} must be int64, got {t.dtype}{fix}")
    if pool_out.dtype != torch.int32:
        raise TypeError(f"{_NAME} pool_out must be int32, got {pool_out.dtype}")
    for t, name in inputs:
        if not t.is_contiguous():
            raise ValueError(f"{_NAME} {name} must be contiguous; pass {name}.contiguous()")


def launch_scatter_req_token_ids_kernel(
    *,
    flat_in: torch.Tensor,
    offsets: torch.Tensor,
    req_pool_indices: torch.Tensor,
    pool_out: torch.Tensor,
    batch_block: int = SCATTER_BATCH_BLOCK,
) -> None:
    """``pool_out[req_pool_indices[r], :n_r] = flat_in[offsets[r]:offsets[r] + n_r]`` (int32),
    ``n_r = min(offsets[r+1] - offsets[r], pool_out.shape[1])``; nothing else changes.

    ``batch_block`` is the register block actually launched (a power of two, at most
    ``SCATTER_BATCH_BLOCK``); the call needs ``bs + 1 <= batch_block``.
    """
    # First, and here only: None, which check_scatter_args reads as the dispatcher's call, is
    # refused too.
    batch_block = require_block(batch_block, "batch_block", SCATTER_BATCH_BLOCK)
    t = ScatterArgs(flat_in, offsets, req_pool_indices, pool_out)
    try:
        check_scatter_args(t, batch_block=batch_block)
    except (AttributeError, TypeError) as err:  # a non-tensor argument? say which
        name_a_non_scatter_tensor(err, t)
        raise
    if t.num_tokens == 0:
        return
    _bound(SCATTER_TOKEN_BLOCK, batch_block)(scatter_grid(t.num_tokens), t.kernel_args())


def scatter_grid(num_tokens: int) -> tuple[int]:
    """The fixed-block launch's grid over ``num_tokens`` tokens: one program a
    ``SCATTER_TOKEN_BLOCK`` (no launch for 0 tokens)."""
    return (triton.cdiv(num_tokens, SCATTER_TOKEN_BLOCK),)


_bound = binder(_scatter_req_token_ids_kernel, "TOKEN_BLOCK", "BATCH_BLOCK")
