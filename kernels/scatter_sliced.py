"""Scatter for any batch size in one launch, the slice index on a grid axis.

Grid ``(n_slices, G)``. Program ``(k, j)`` holds slice ``k`` (requests ``[k*chunk,
(k+1)*chunk)``) rebased into one ``BATCH_BLOCK``-lane register block, exactly as the
fixed-block kernel holds a whole batch, and scatters tiles ``j, j+G, j+2G, ...`` of the slice's
tokens. ``G`` comes from host-known sizes (the mean tiles per slice), so there is no host sync.
Whatever the offsets (ordered or not, near the int64 ends), a program reads no token outside
``flat_in``, writes only its requests' rows' first ``max_context_len`` columns, and ends.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._launch import MAX_GRID_Y, binder
from .args import ScatterArgs
from .scatter_req_token_ids import _INT64_MAX, _scatter_tile

SLICED_TOKEN_ELEMS = 16384  # TOKEN_BLOCK * BATCH_BLOCK: the [T, B] owner tile per step


@triton.jit(do_not_specialize=["num_tokens", "bs", "pool_stride0", "max_context_len", "chunk"])
def _scatter_sliced_kernel(
    flat_in_ptr,  # [num_tokens] int64
    offsets_ptr,  # [bs + 1] int64
    req_pool_indices_ptr,  # [bs] int64
    pool_out_ptr,  # [rows, max_context_len] int32
    num_tokens,  # len(flat_in)
    bs,
    pool_stride0,
    max_context_len,
    chunk,
    TOKEN_BLOCK: tl.constexpr,
    BATCH_BLOCK: tl.constexpr,
):
    k = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1).to(tl.int64)
    tiles_stride = tl.num_programs(1).to(tl.int64) * TOKEN_BLOCK
    s = k * chunk
    n_reqs = tl.minimum(bs - s, chunk)
    lanes = tl.arange(0, BATCH_BLOCK)
    # The slice's tokens, rebased: from its first offset to its last, and inside flat_in as
    # the fixed-block kernel's tokens are (offsets[bs] past len(flat_in) copies only the
    # tokens there). Both ends are clamped into [0, num_tokens], so that no offsets, ordered
    # or not, make a program read outside flat_in or loop past it.
    base = tl.minimum(tl.maximum(tl.load(offsets_ptr + s), 0), num_tokens)
    end = tl.minimum(tl.maximum(tl.load(offsets_ptr + s + n_reqs), base), num_tokens)
    slice_tokens = end - base
    # [B] int64, rebased. Clamping into [-1, num_tokens] first keeps "offset <= t" for every
    # token t of flat_in and cannot overflow; lanes past n_reqs hold INT64_MAX.
    in_slice = lanes <= n_reqs
    rel_offs = tl.load(offsets_ptr + s + lanes, mask=in_slice, other=_INT64_MAX)
    rel_offs = tl.minimum(tl.maximum(rel_offs, -1), num_tokens) - base
    rel_offs = tl.where(in_slice, rel_offs, _INT64_MAX)
    t0 = j * TOKEN_BLOCK
    while t0 < slice_tokens:  # (a while: Triton 3.6's interpreter cannot range over tensors)
        _scatter_tile(
            tl.multiple_of(t0, TOKEN_BLOCK) + tl.arange(0, TOKEN_BLOCK),
            slice_tokens,
            rel_offs,
            n_reqs,
            base,
            flat_in_ptr + base,
            offsets_ptr + s,
            req_pool_indices_ptr + s,
            pool_out_ptr,
            pool_stride0,
            max_context_len,
        )
        t0 += tiles_stride


def sliced_grid(bs: int, num_tokens: int, chunk: int, batch_block: int) -> tuple[int, int]:
    """``(slices, token tiles)``: one program row per slice of ``chunk`` requests, as many
    ``sliced_token_block(batch_block)``-token tiles as a slice holds on average."""
    n_slices = triton.cdiv(bs, chunk)
    mean_tiles = triton.cdiv(num_tokens, n_slices * sliced_token_block(batch_block))
    return n_slices, max(1, min(mean_tiles, MAX_GRID_Y))


def sliced_token_block(batch_block: int) -> int:
    """Tokens a program takes per step: the ``[TOKEN_BLOCK, BATCH_BLOCK]`` owner tile holds
    ``SLICED_TOKEN_ELEMS`` elements."""
    return max(16, SLICED_TOKEN_ELEMS // batch_block)


def launch_scatter_sliced(
    t: ScatterArgs, *, grid: tuple[int, int], chunk: int, batch_block: int
) -> None:
    """One launch over ``grid = sliced_grid(...)``; ``chunk + 1 <= batch_block`` (a power of
    two). Arguments are checked by the caller (``check_scatter_args``)."""
    _bound(sliced_token_block(batch_block), batch_block)(grid, (*t.kernel_args(), chunk))


_bound = binder(_scatter_sliced_kernel, "TOKEN_BLOCK", "BATCH_BLOCK")
