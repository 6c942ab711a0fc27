"""Scatter for any batch size and any length distribution in one launch: merge-path shares.

Work items, in batch order: each request is one item and each of its tokens one more, so
request ``r`` sits at item ``f(r) = offsets[r] + r`` and token ``offsets[r] + c`` (column ``c``)
at item ``f(r) + 1 + c``; ``num_items = len(flat_in) + bs``. Program ``p`` owns items
``[p*D, (p+1)*D)`` (``D = items_per_program``): at most ``D`` tokens (flat tokens, counted
before the pool-width clamp) and ``D + 1`` requests, whatever the lengths, so no program's work
grows with one run's length nor with the number of short requests (merge-path partitioning,
as in load-balanced search). A program

1. finds the first request with an item in its range by one ``PROBES``-way search over ``f``
   (``[2, PROBES]`` offsets a dependent step, both range ends at once; none when it owns item 0
   and the last item, as a one-program launch does);
2. walks its requests in groups of ``REQS``, one group at a time. Per group: a packed tile
   ``[REQS, SHORT_COLS]`` copies the first ``SHORT_COLS`` columns of each request's share (short
   runs such as decodes finish here, many to a tile); then the rest of each share, cut into
   ``CHUNK_COLS``-column chunks, goes ``CHUNKS`` chunks a tile (``[CHUNKS, CHUNK_COLS]``), each
   chunk's request found from the group's running chunk counts (``GATHER``: a binary search
   by register gathers, ``[CHUNKS]`` lanes a step; else a ``[CHUNKS, REQS]`` compare).

Tiles (dtypes): search ``[2, PROBES]`` int64; group ``[REQS]`` int64 offsets, rows and int32
columns; packed ``[REQS, SHORT_COLS]`` and chunk ``[CHUNKS, CHUNK_COLS]``: int32 columns,
int64 tokens loaded, int32 stored. A program's serial steps: the search (``log_{PROBES}(bs)``
dependent loads), then per group one packed tile and ``ceil(chunks / CHUNKS)`` chunk tiles.

Register blocks: the search holds ``2 * PROBES <= 256`` offsets and a group ``REQS <= 256``
requests' offsets (two ``[REQS]`` loads, ``offsets[r]`` and ``offsets[r + 1]``): no block holds
512 or more requests' offsets, however many requests a program walks (at most ``D + 1``, one
group at a time). Index arithmetic on items, offsets and tokens is int64 (offsets may exceed
2**31); columns are int32 (``max_context_len`` must stay below ``2**31 - 2 * CHUNK_COLS``).

Results equal ``scatter_req_token_ids_ref`` for any non-decreasing offsets inside
``[0, len(flat_in)]`` (a CSR, or one that leaves tokens unowned at either end). Whatever the
offsets (any order, any values of magnitude below 2**62), reads stay inside ``flat_in``,
``offsets[0:bs + 1]`` and ``req_pool_indices``, writes inside the addressed rows' first
``max_context_len`` columns, and every loop is bounded. No host sync.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .args import ScatterArgs

# Programs the default items_per_program aims at: one wave on an H200 at the default tiles
# (48-54 registers a thread with ptxas for sm_90, so 9-10 programs of 4 warps an SM, 132 SMs).
_PROGRAMS = 1024
_MIN_ITEMS, _MAX_ITEMS = 256, 4096


@triton.jit
def _share(s, e, r, d0, d1, num_tokens, max_context_len):
    """Columns ``[lo, hi)`` (int32, ``0 <= lo <= hi <= max_context_len``) of requests ``r``
    (``[N]`` int64, runs ``[s, e)``) whose items lie in ``[d0, d1)``; their tokens
    ``s + c`` lie inside ``[0, num_tokens)`` whatever ``s`` and ``e``."""
    f1 = s + r + 1  # [N] int64, item of column 0
    lo = tl.maximum(tl.maximum(d0 - f1, -s), 0)
    lo = tl.minimum(lo, max_context_len)
    hi = tl.minimum(tl.minimum(d1 - f1, tl.minimum(e, num_tokens) - s), max_context_len)
    hi = tl.maximum(hi, lo)
    return lo.to(tl.int32), hi.to(tl.int32)


@triton.jit
def _chunk_owner(incl, nch, slot, REQS: tl.constexpr, GATHER: tl.constexpr):
    """For chunk slots ``slot`` (``[W]``) of a group whose requests hold ``nch`` chunks
    (``incl``: running sums, ``[R]``): each slot's request in the group (``R`` past the last
    chunk) and the slot of that request's first chunk."""
    if GATHER:
        # Branchless binary search, log2(R) + 1 register gathers of [W] lanes.
        own = tl.zeros_like(slot)
        for b in tl.static_range(1, 9):  # steps REQS/2, ..., 1 (REQS <= 256)
            if (REQS >> b) > 0:
                go = tl.gather(incl, own + ((REQS >> b) - 1), 0) <= slot
                own = tl.where(go, own + (REQS >> b), own)
        own += (tl.gather(incl, own, 0) <= slot).to(tl.int32)
        first = tl.gather(incl - nch, tl.minimum(own, REQS - 1), 0)
    else:
        # [W, R] compare with the running sums: no gathers, W * R lanes of work.
        le = incl[None, :] <= slot[:, None]  # [W, R]
        own = tl.sum(le.to(tl.int32), axis=1)
        first = tl.max(tl.where(le, incl[None, :], 0), axis=1)
    return own, first


@triton.jit(
    do_not_specialize=[
        "num_tokens",
        "bs",
        "num_items",
        "items_per_program",
        "pool_stride0",
        "max_context_len",
    ]
)
def _scatter_balanced_kernel(
    flat_in_ptr,  # [num_tokens] int64
    offsets_ptr,  # [bs + 1] int64, CSR
    req_pool_indices_ptr,  # [bs] int64
    pool_out_ptr,  # [rows, max_context_len] int32, row stride pool_stride0
    num_tokens,
    bs,
    pool_stride0,
    max_context_len,
    num_items,  # num_tokens + bs
    items_per_program,
    REQS: tl.constexpr,
    SHORT_COLS: tl.constexpr,
    CHUNKS: tl.constexpr,
    CHUNK_COLS: tl.constexpr,
    PROBES: tl.constexpr,
    GATHER: tl.constexpr,
):
    d0 = tl.program_id(0).to(tl.int64) * items_per_program
    d1 = tl.minimum(d0 + items_per_program, num_items)

    # k(d) = #{r < bs : f(r) < d} for d = d0, d1 (lanes 0, 1). Invariant: bot == -1 or
    # f(bot) < d; top == bs or f(top) >= d, f_top = f(top). For CSR offsets (f(0) = offsets[0] >= 0,
    # f(bs - 1) < num_items) k(0) = 0 and k(num_items) = bs need no search.
    lane = tl.arange(0, 2)
    d = tl.where(lane == 0, d0, d1)  # [2] int64
    zero = tl.zeros([2], dtype=tl.int64)
    top = tl.where(d <= 0, zero, zero + bs)  # [2] int64
    bot = tl.where(d >= num_items, zero + bs - 1, zero - 1)
    f_top = tl.where(d <= 0, zero, zero + num_items)
    i = tl.arange(0, PROBES).to(tl.int64)  # [P]
    while tl.max(top - bot, axis=0) > 1:
        gap = tl.maximum(top - bot - 1, 0)  # [2] indices strictly between bot and top
        probe = bot[:, None] + 1 + (gap[:, None] * i[None, :]) // PROBES  # [2, P] in (bot, top)
        open_ = (top - bot > 1)[:, None]
        fp = tl.load(offsets_ptr + probe, mask=open_, other=0) + probe  # [2, P] int64
        below = open_ & (fp < d[:, None])
        above = open_ & ~below
        bot = tl.max(tl.where(below, probe, bot[:, None]), axis=1)
        f_top = tl.min(tl.where(above, fp, f_top[:, None]), axis=1)
        top = tl.min(tl.where(above, probe, top[:, None]), axis=1)
    k0 = tl.sum(tl.where(lane == 0, top, 0), axis=0)
    k1 = tl.sum(tl.where(lane == 1, top, 0), axis=0)
    f_k0 = tl.sum(tl.where(lane == 0, f_top, 0), axis=0)
    # Request k0 - 1 has items in [d0, d1) unless its last item is d0 - 1 (f(k0) == d0).
    r_begin = tl.maximum(k0 - (f_k0 != d0).to(tl.int64), 0)
    r_begin = tl.minimum(r_begin, bs)
    # For CSR offsets k1 - k0 <= d1 - d0, so this cap never binds; it bounds other offsets.
    r_end = tl.minimum(tl.maximum(k1, r_begin), r_begin + items_per_program + 1)

    rq = tl.arange(0, REQS)  # [R] int32
    sc = tl.arange(0, SHORT_COLS)  # [S] int32
    ch = tl.arange(0, CHUNKS)  # [W] int32
    cc = tl.arange(0, CHUNK_COLS)  # [C] int32
    r0 = r_begin
    while r0 < r_end:  # (while loops: Triton 3.6's interpreter cannot range over tensors)
        r = r0 + rq  # [R] int64
        live = r < r_end
        s = tl.load(offsets_ptr + r, mask=live, other=0)  # [R] int64
        e = tl.load(offsets_ptr + r + 1, mask=live, other=0)
        lo, hi = _share(s, e, r, d0, d1, num_tokens, max_context_len)  # [R] int32
        row = tl.load(req_pool_indices_ptr + r, mask=live, other=0)  # [R] int64, with s, e

        # Packed tile [R, S]: columns [lo, lo + S) of every share.
        c = lo[:, None] + sc[None, :]  # [R, S] int32
        m = c < hi[:, None]
        v = tl.load(flat_in_ptr + s[:, None] + c, mask=m, other=0)  # [R, S] int64
        tl.store(pool_out_ptr + (row * pool_stride0)[:, None] + c, v.to(tl.int32), mask=m)

        # Chunk tiles [W, C]: columns [lo + S, hi) of every share, in C-column chunks.
        nch = (tl.maximum(hi - lo - SHORT_COLS, 0) + CHUNK_COLS - 1) // CHUNK_COLS  # [R] int32
        incl = tl.cumsum(nch, axis=0)  # [R] chunks of requests r0 .. r
        total = tl.sum(nch, axis=0)
        q = tl.zeros([], total.dtype)
        while q < total:
            slot = tl.multiple_of(q, CHUNKS) + ch  # [W] int32
            own, first = _chunk_owner(incl, nch, slot, REQS, GATHER)  # [W] int32 each
            rw = r0 + own  # [W] int64
            ok = (slot < total) & (rw < r_end)
            sw = tl.load(offsets_ptr + rw, mask=ok, other=0)  # [W] int64 (cached: just read)
            ew = tl.load(offsets_ptr + rw + 1, mask=ok, other=0)
            low, hiw = _share(sw, ew, rw, d0, d1, num_tokens, max_context_len)  # [W] int32
            roww = tl.load(req_pool_indices_ptr + rw, mask=ok, other=0)  # [W] int64
            col0 = low + SHORT_COLS + (slot - first) * CHUNK_COLS  # [W] int32
            cw = col0[:, None] + cc[None, :]  # [W, C] int32
            mw = ok[:, None] & (cw < hiw[:, None])
            vw = tl.load(flat_in_ptr + sw[:, None] + cw, mask=mw, other=0)  # [W, C] int64
            dst = pool_out_ptr + (roww * pool_stride0)[:, None] + cw
            tl.store(dst, vw.to(tl.int32), mask=mw)
            q += CHUNKS
        r0 += REQS


def balanced_items_per_program(bs: int, num_tokens: int) -> int:
    """Default ``items_per_program`` from host-known sizes: ``_PROGRAMS`` equal shares,
    within ``[_MIN_ITEMS, _MAX_ITEMS]``."""
    return min(_MAX_ITEMS, max(_MIN_ITEMS, -(-(num_tokens + bs) // _PROGRAMS)))


def balanced_probes(bs: int) -> int:
    """Default ``probes``: a search takes ``s`` dependent steps for ``bs`` up to about
    ``probes ** s``; 128 probes resolve ``bs <= 16 384`` in two steps, 64 probes
    ``bs <= 262 144`` in three, with half the probe loads."""
    return 128 if bs <= 16384 else 64


def launch_scatter_balanced(
    t: ScatterArgs,
    *,
    items_per_program: int | None = None,
    reqs: int = 128,
    short_cols: int = 8,
    chunks: int = 8,
    chunk_cols: int = 64,
    probes: int | None = None,
    gather: bool = False,
    num_warps: int = 4,
) -> tuple[int]:
    """``pool_out[req_pool_indices[r], :n_r] = flat_in[offsets[r]:offsets[r] + n_r]`` (int32),
    ``n_r = min(offsets[r+1] - offsets[r], pool_out.shape[1])``, in one launch over
    ``cdiv(len(flat_in) + bs, items_per_program)`` programs. Returns the grid.

    - ``items_per_program``: ``D``; ``None``: ``balanced_items_per_program(bs, len(flat_in))``.
    - ``reqs`` (<= 256), ``short_cols``: the packed tile ``[reqs, short_cols]``.
    - ``chunks``, ``chunk_cols``: the chunk tile ``[chunks, chunk_cols]``.
    - ``probes`` (<= 128): offsets read per search step; ``None``: ``balanced_probes(bs)``.
    - ``gather``: find chunk owners by register gathers (``tl.gather``), else by a
      ``[chunks, reqs]`` compare.
    - ``num_warps``: warps a program.

    Tile sizes are powers of two. Needs ``bs >= 1`` and ``len(flat_in) >= 1``; tensors are
    checked by the caller (``check_scatter_args``: 1-D contiguous int64 inputs,
    ``len(offsets) == bs + 1``, int32 pool with rows contiguous, one device).
    """
    bs, num_tokens = t.bs, t.num_tokens
    items = items_per_program
    if items is None:
        items = balanced_items_per_program(bs, num_tokens)
    probes = balanced_probes(bs) if probes is None else probes
    if reqs > 256 or not 1 <= probes <= 128 or items < 1:
        raise ValueError(
            f"kv-canary: scatter_balanced needs reqs <= 256 and 1 <= probes <= 128 (register "
            f"blocks below 512 offsets) and items_per_program >= 1; got reqs={reqs}, "
            f"probes={probes}, items_per_program={items}"
        )
    grid = (triton.cdiv(num_tokens + bs, items),)
    _scatter_balanced_kernel[grid](
        *t.kernel_args(),
        num_tokens + bs,
        items,
        REQS=reqs,
        SHORT_COLS=short_cols,
        CHUNKS=chunks,
        CHUNK_COLS=chunk_cols,
        PROBES=probes,
        GATHER=gather,
        num_warps=num_warps,
    )
    return grid
