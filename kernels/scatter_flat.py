"""Scatter for any batch size in one launch over a flat token grid, owners found in-kernel.

Program ``p`` owns tokens ``[p*TOKEN_BLOCK, (p+1)*TOKEN_BLOCK)``. It finds the owners of its
first and last token by a many-way search over the offsets (``PROBES`` reads per step), then
each token's owner by a binary search narrowed to that range: a program touches at most
``TOKEN_BLOCK`` non-empty requests and reads no offset outside ``[0, bs]``. No host sync.
Whatever the offsets, it reads no token outside ``flat_in`` and writes only the owners' rows'
first ``max_context_len`` columns.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._launch import BoundKernel, binder
from .args import ScatterArgs

FLAT_TOKEN_BLOCK = 1024
FLAT_PROBES = 32  # offsets read per search step


@triton.jit(do_not_specialize=["num_tokens", "bs", "pool_stride0", "max_context_len"])
def _scatter_flat_kernel(
    flat_in_ptr,  # [num_tokens] int64
    offsets_ptr,  # [bs + 1] int64
    req_pool_indices_ptr,  # [bs] int64
    pool_out_ptr,  # [rows, max_context_len] int32
    num_tokens,
    bs,
    pool_stride0,
    max_context_len,
    TOKEN_BLOCK: tl.constexpr,
    PROBES: tl.constexpr,
):
    first = tl.program_id(0).to(tl.int64) * TOKEN_BLOCK
    last = tl.minimum(first + TOKEN_BLOCK, num_tokens) - 1
    tok = first + tl.arange(0, TOKEN_BLOCK)  # [T] int64
    # The tile's tokens are read first, so their latency overlaps the owner search below.
    val = tl.load(flat_in_ptr + tok, mask=tok < num_tokens, other=0)  # [T] int64
    # Owners of the tile's first and last token (the last r < bs with offsets[r] <= t) by a
    # PROBES-ary search: each step reads PROBES evenly spaced offsets of [lo, hi) at once and
    # keeps the gap holding the owner, so the range shrinks (PROBES + 1)-fold per dependent load.
    ends = tl.where(tl.arange(0, 2) == 0, first, last)  # [2] int64
    lo = tl.zeros([2], dtype=tl.int64)  # offsets[lo] <= t (offsets[0] = 0)
    hi = tl.zeros([2], dtype=tl.int64) + bs  # hi == bs or offsets[hi] > t
    i = tl.arange(1, PROBES + 1).to(tl.int64)  # [P]
    while tl.max(hi - lo, axis=0) > 1:
        probe = lo[:, None] + ((hi - lo)[:, None] * i[None, :]) // (PROBES + 1)  # [2, P]
        le = tl.load(offsets_ptr + probe) <= ends[:, None]  # [2, P]; probe in [lo, hi)
        lo = tl.max(tl.where(le, probe, lo[:, None]), axis=1)
        hi = tl.min(tl.where(le, hi[:, None], probe), axis=1)
    lo_req = tl.min(lo, axis=0)
    hi_req = tl.max(lo, axis=0)

    # As in the fixed-block kernel, tokens outside [offsets[0], offsets[bs]) have no owner.
    valid = (tok < num_tokens) & (tok >= tl.load(offsets_ptr)) & (tok < tl.load(offsets_ptr + bs))
    owner = tl.zeros([TOKEN_BLOCK], dtype=tl.int64) + lo_req  # [T] int64
    top = tl.zeros([TOKEN_BLOCK], dtype=tl.int64) + hi_req + 1
    span = hi_req - lo_req
    while span > 0:
        mid = (owner + top) // 2
        open_ = top - owner > 1
        go_right = tl.load(offsets_ptr + mid, mask=open_, other=0) <= tok
        owner = tl.where(open_ & go_right, mid, owner)
        top = tl.where(open_ & ~go_right, mid, top)
        span = span // 2

    # The column lies in [0, max_context_len) by two compares, which cannot overflow int64
    # whatever the offsets (tok lies in [0, num_tokens)), where tok - start could. The first
    # holds already, even on offsets in no order: the first token's search ends at or below
    # the last's (each step they share their probes, or their ranges are disjoint, or the
    # first's is empty, hi <= lo, and its lo stays), so offsets[lo_req] <= first (or lo_req
    # is 0, and valid has offsets[0] <= tok), and the binary search steps only onto offsets
    # <= tok. It is kept so that the bound rests on no argument.
    start = tl.load(offsets_ptr + owner, mask=valid, other=0)  # [T] int64
    valid = valid & (start <= tok) & (start > tok - max_context_len)
    col = tok - start  # [T] int64, in [0, max_context_len) where valid
    row = tl.load(req_pool_indices_ptr + owner, mask=valid, other=0)  # [T] int64
    tl.store(pool_out_ptr + row * pool_stride0 + col, val.to(tl.int32), mask=valid)


def bind_scatter_flat(
    *, token_block: int = FLAT_TOKEN_BLOCK, probes: int = FLAT_PROBES, num_warps: int = 4
) -> BoundKernel:
    """The kernel bound to these block keywords (powers of two): called with a grid and
    ``ScatterArgs.kernel_args()``, it is ``launch_scatter_flat``'s launch."""
    return _bound(token_block, probes, num_warps)


def launch_scatter_flat(
    t: ScatterArgs,
    *,
    grid: tuple[int],
    token_block: int = FLAT_TOKEN_BLOCK,
    probes: int = FLAT_PROBES,
    num_warps: int = 4,
) -> None:
    """One launch over ``grid = (cdiv(len(flat_in), token_block),)`` programs. Needs
    ``bs >= 1`` and ``len(flat_in) >= 1``; arguments are checked by the caller."""
    bind_scatter_flat(token_block=token_block, probes=probes, num_warps=num_warps)(
        grid, t.kernel_args()
    )


_bound = binder(_scatter_flat_kernel, "TOKEN_BLOCK", "PROBES", "num_warps")
