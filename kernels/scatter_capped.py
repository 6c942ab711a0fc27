"""Scatter for any batch size and any length distribution in one launch: capped head groups
plus tail tiles, so that no program's work grows with one run's length.

The grid holds two kinds of program, ``cdiv(bs, REQS)`` head programs first, then the tail
programs (with ``TAILS_FIRST``, the tail programs first: CUDA does not promise an order, but
the GPUs measured start lower ids first, so the tail programs then start first; the order
changes speed only). ``CAP = STEPS * COLS``.

- Head program ``g`` owns requests ``[g*REQS, (g+1)*REQS)`` (a ``[REQS, COLS]`` tile) and copies
  the first ``CAP`` columns of each one's run, ``COLS`` columns a step: at most ``STEPS``
  steps, one offsets read per request, no owner search. Short runs (decodes, speculative
  drafts) finish in one step, many to a tile.
- Tail program ``q`` owns ``TILES`` tiles of ``TAIL`` flat tokens, ``[a, a + TAIL)`` with
  ``a = CAP + (q*TILES + j)*TAIL``, and copies each tile's tokens whose column is ``CAP`` or more.
  Since ``TAIL <= CAP``, only the owner of a tile's first token ``a`` can have such tokens (a
  later request starts inside the tile, so its columns there are below ``TAIL``): one
  ``PROBES``-way search for each tile's owner, all tiles at once (each round narrows a tile's
  bounds by the number of its reads at or before its first token), then one contiguous run a
  tile, ``TAIL_COLS`` tokens a step. With ``GUESS > 0`` each tile first reads ``GUESS`` offsets,
  ``GUESS_STRIDE`` requests apart, around the owner a batch of equal runs would give ``a``. A
  run boundary inside ``(a + TAIL - 1 - CAP, a]`` shows that the owner starts too late for any
  column past the cap (in a decode batch every tile sees one), and the adjacent reads on either
  side of ``a`` (``GUESS_STRIDE`` requests apart) at most ``CAP`` tokens apart show that the
  owner's run fits under the cap (speculative drafts, whose ``GUESS_STRIDE`` consecutive runs
  fit under it): either way the tile skips the search. Else the offsets read narrow the search
  to the requests between the last one at or before ``a`` and the first one past it.
  ``capped_grid`` gives ``cdiv(num_tokens - CAP, TILES * TAIL)`` tail programs when a column
  past ``CAP`` can be written (``min(num_tokens, max_context_len) > CAP``), else none; the
  kernel takes the programs past the ``cdiv(bs, REQS)`` heads as tail programs, whatever their
  number (tiles past ``num_tokens`` copy nothing).

Tiles (dtypes): head ``[REQS]`` int64 offsets and rows, int32 columns, ``[REQS, COLS]`` int64
tokens loaded and int32 stored; tail ``[TILES]`` int64 tile starts and owners, search
``[TILES, PROBES]`` and guess ``[TILES, GUESS]`` int64 offsets (counted into ``[TILES]``
int32), copy ``[TILES, TAIL_COLS]`` int64 tokens loaded, int32 stored. No block holds more
than 512 offsets: ``capped_shape`` gives head groups of at most 256 requests and guess and
search blocks of at most 16 x 32.

Results equal ``scatter_req_token_ids_ref`` for any non-decreasing offsets inside
``[0, len(flat_in)]``. Whatever the offsets (any order, any int64 values),
reads stay inside ``flat_in``, ``offsets[0:bs + 1]`` and ``req_pool_indices``, writes inside the
addressed rows' first ``max_context_len`` columns, and every loop is bounded. No host sync.
"""

from __future__ import annotations

from collections.abc import Mapping

import triton
import triton.language as tl

from ._launch import BoundKernel, binder
from .args import ScatterArgs
from .scatter_segments import _run_columns

CAPPED_PROBES = 32  # offsets a tail program reads per search step


@triton.jit
def _copy_step(src, dst, lo, hi, c):
    """Columns ``c`` (``[C]`` int32) of each row that lie in ``[lo, hi)``: ``src`` and ``dst``
    are ``[R]`` pointers to column 0 of each row's run and pool row, ``lo`` and ``hi`` ``[R]``
    int32."""
    m = (c[None, :] >= lo[:, None]) & (c[None, :] < hi[:, None])  # [R, C]
    v = tl.load(src[:, None] + c[None, :], mask=m, other=0)  # [R, C] int64
    tl.store(dst[:, None] + c[None, :], v.to(tl.int32), mask=m)


@triton.jit
def _copy_columns(src, dst, lo, hi, COLS: tl.constexpr, PEEL: tl.constexpr):
    """Columns ``[lo, hi)`` of each row, ``COLS`` a step (arguments as ``_copy_step``'s).
    ``PEEL``: the first step is issued outside the loop."""
    col = tl.arange(0, COLS)  # [C] int32
    first: tl.constexpr = COLS if PEEL else 0
    if PEEL:
        _copy_step(src, dst, lo, hi, col)
    stop = tl.max(hi, axis=0)
    c0 = tl.full([], first, stop.dtype)
    while c0 < stop:  # (a while: Triton 3.6's interpreter cannot range over tensors)
        _copy_step(src, dst, lo, hi, tl.multiple_of(c0, COLS) + col)
        c0 += COLS


@triton.jit
def _head(
    g,  # int64, the group
    flat_in_ptr,
    offsets_ptr,
    req_pool_indices_ptr,
    pool_out_ptr,
    num_tokens,
    bs,
    pool_stride0,
    max_context_len,
    REQS: tl.constexpr,
    COLS: tl.constexpr,
    CAP: tl.constexpr,
    PEEL: tl.constexpr,
):
    """Columns ``[0, CAP)`` of the runs of requests ``[g*REQS, (g+1)*REQS)``."""
    r = g * REQS + tl.arange(0, REQS)  # [R] int64
    in_batch = r < bs
    # Rows read with the offsets, not after them: the copy's first load then waits for one
    # read, not two in a row.
    row = tl.load(req_pool_indices_ptr + r, mask=in_batch, other=0)  # [R] int64
    start = tl.load(offsets_ptr + r, mask=in_batch, other=0)  # [R] int64
    end = tl.load(offsets_ptr + r + 1, mask=in_batch, other=0)  # [R] int64
    # Columns [lo, hi) of each row: the run cut to flat_in, the pool width and CAP.
    lo, hi = _run_columns(start, end, num_tokens, tl.minimum(max_context_len, CAP))
    lo, hi = lo.to(tl.int32), hi.to(tl.int32)  # [R] int32 each
    src = flat_in_ptr + start  # [R] pointers to column 0 of each run
    dst = pool_out_ptr + row * pool_stride0  # [R] pointers to column 0 of each row
    _copy_columns(src, dst, lo, hi, COLS, PEEL)  # at most CAP / COLS steps


@triton.jit
def _guess(a, offsets_ptr, num_tokens, bs, CAP: tl.constexpr, TAIL: tl.constexpr,
           GUESS: tl.constexpr, GUESS_STRIDE: tl.constexpr):  # fmt: skip
    """``_guess_at`` around the owner a batch of equal runs would give each tile's first token
    ``a`` (``[N]`` int64; a decode batch's exact owner)."""
    # The guess a * bs / num_tokens in float64 (one division a program, not an int64 one a
    # tile): a guess, exact enough (off by at most one) and clamped below like any other.
    ratio = bs.to(tl.float64) / tl.maximum(num_tokens, 1).to(tl.float64)
    k = (a.to(tl.float64) * ratio).to(tl.int64) - (GUESS // 2) * GUESS_STRIDE  # [N] int64
    return _guess_at(k, a, offsets_ptr, bs, CAP, TAIL, GUESS, GUESS_STRIDE)


@triton.jit
def _guess_at(k, a, offsets_ptr, bs, CAP: tl.constexpr, TAIL: tl.constexpr,
              GUESS: tl.constexpr, GUESS_STRIDE: tl.constexpr):  # fmt: skip
    """One read of ``GUESS`` offsets, ``GUESS_STRIDE`` requests apart from request ``k``, for
    each tile's first token ``a`` (both ``[N]`` int64). Returns ``[N]`` tensors: ``n_le``
    (int32) the reads at or before ``a``, which with non-decreasing offsets come first;
    ``last`` the last such read's index (clamped to ``bs - 1``: a read at ``bs`` bounds the
    owner to ``bs - 1``) and ``past`` the next read's, the search's bounds; ``idle``, a read in
    ``(a + TAIL - 1 - CAP, a]``: the tile's owner starts after ``a + TAIL - 1 - CAP``, so every
    column in the tile is below ``CAP``. The indices stay inside ``[0, bs]`` whatever ``k``
    and the offsets."""
    step = tl.arange(0, GUESS) * GUESS_STRIDE  # [G] int32
    j = tl.minimum(tl.maximum(k[:, None] + step[None, :], 0), bs)  # [N, G] int64
    seen = tl.load(offsets_ptr + j)  # [N, G] int64
    n_le = tl.sum((seen <= a[:, None]).to(tl.int32), axis=1)  # [N]
    n_win = n_le - tl.sum((seen <= (a + TAIL - 1 - CAP)[:, None]).to(tl.int32), axis=1)
    last = tl.minimum(tl.maximum(k + (n_le - 1) * GUESS_STRIDE, 0), bs - 1)  # [N] int64
    past = tl.minimum(tl.maximum(k + n_le * GUESS_STRIDE, 0), bs)  # [N] int64
    return n_le, last, past, n_win > 0


@triton.jit
def _guessed_bounds(n_le, last, past, idle, bs, GUESS: tl.constexpr):
    """Each tile's search bounds ``(lo, hi)`` from ``_guess_at``'s results: ``[last, past)``,
    from 0 where no read is at or before its first token and to ``bs`` where every one is;
    empty (``hi == lo``) where ``idle``."""
    lo = tl.where(n_le > 0, last, 0)  # [N] int64
    hi = tl.where(n_le < GUESS, past, bs)  # [N] int64
    return lo, tl.where(idle, lo, hi)


@triton.jit
def _fits_between(n_le, last, past, idle, offsets_ptr, CAP: tl.constexpr, GUESS: tl.constexpr):
    """``idle`` (``[N]``, from ``_guess_at``), also where the tile's first token lies between
    two adjacent guessed reads ``last`` and ``past`` (``[N]`` int64) whose offsets are at most
    ``CAP`` apart: with non-decreasing offsets its owner is in ``[last, past)``, so its run lies
    between them and no column of the tile reaches the cap. The two offsets are read again by
    index (the guess just read them), not taken by a reduction over the reads; both indices
    stay inside ``[0, bs]`` whatever the offsets."""
    near = (n_le > 0) & (n_le < GUESS) & ~idle  # [N]: a read on either side of the first token
    v_le = tl.load(offsets_ptr + last, mask=near, other=0)  # [N] int64
    v_gt = tl.load(offsets_ptr + past, mask=near, other=CAP + 1)  # [N] int64
    return idle | (near & (v_gt - v_le <= CAP))


@triton.jit
def _narrow(lo, hi, a, offsets_ptr, PROBES: tl.constexpr):
    """One search round: ``PROBES`` offsets at ``lo + w * p // PROBES`` (``p < PROBES``,
    ``w = hi - lo``) in each tile's ``[lo, hi)`` (``[N]`` int64); the number ``m`` at or
    before ``a`` (one int32 sum a tile; at least 1, since the first probe is ``lo``) places
    the new bounds between probes ``m - 1`` and ``m``. ``PROBES`` is a power of two, at least 2
    (one probe, at ``lo``, would never narrow), so the divisions are shifts (with a sign
    fix-up). Returns ``(lo, hi)``, each interval wider than one narrowed, with
    ``lo <= new lo <= new hi <= hi`` whatever the offsets."""
    tl.static_assert(PROBES >= 2, "a search round needs at least 2 probes")
    w = hi - lo  # [N] int64
    p = tl.arange(0, PROBES)  # [P] int32
    probe = lo[:, None] + w[:, None] * p[None, :] // PROBES  # [N, P] int64
    n_le = tl.sum((tl.load(offsets_ptr + probe) <= a[:, None]).to(tl.int32), axis=1)  # [N]
    m = tl.maximum(n_le, 1)  # [N] int32; 0 only where offsets[lo] > a (lo == 0, or unsorted)
    return lo + w * (m - 1) // PROBES, lo + w * m // PROBES


@triton.jit
def _tail(
    q,  # int64, the tail program
    flat_in_ptr,
    offsets_ptr,
    req_pool_indices_ptr,
    pool_out_ptr,
    num_tokens,
    bs,
    pool_stride0,
    max_context_len,
    CAP: tl.constexpr,
    TILES: tl.constexpr,
    TAIL: tl.constexpr,
    TAIL_COLS: tl.constexpr,
    PROBES: tl.constexpr,
    GUESS: tl.constexpr,
    GUESS_STRIDE: tl.constexpr,
    PEEL: tl.constexpr,
):
    """Tiles ``[a, a + TAIL)`` (``a = CAP + (q*TILES + j)*TAIL``, ``j < TILES``): each tile's
    tokens whose column is ``CAP`` or more."""
    a = CAP + (q * TILES + tl.arange(0, TILES)) * TAIL  # [N] int64, each tile's first token
    # Each tile's owner, the last r < bs with offsets[r] <= a (0 when there is none), by a
    # PROBES-ary search. Every read narrows [lo, hi) by a count: with non-decreasing offsets
    # the reads at or before a come first, so their number places the new bounds (one int32
    # sum a tile). Whatever the offsets, 0 <= lo <= bs - 1 and hi <= bs, and lo <= hi wherever
    # a * bs / num_tokens < 2**63 (every tile of capped_grid's grid; on a grid past it the
    # guess's int64 conversion may overflow: the indices stay clamped, the search ends, and
    # such a tile starts past num_tokens, so it copies nothing). The guessed offsets first
    # show idle tiles (no search) or bound the search.
    lo = a * 0  # [N] int64; offsets[lo] <= a, or lo == 0
    hi = lo + bs  # [N] int64; hi == bs or offsets[hi] > a
    idle = lo != 0  # [N], all False: tiles shown to hold no column past the cap
    if GUESS > 0:
        n_le, last, past, idle = _guess(
            a, offsets_ptr, num_tokens, bs, CAP, TAIL, GUESS, GUESS_STRIDE
        )  # fmt: skip
        idle = _fits_between(n_le, last, past, idle, offsets_ptr, CAP, GUESS)
        lo, hi = _guessed_bounds(n_le, last, past, idle, bs, GUESS)
    while tl.max(hi - lo, axis=0) > 1:
        lo, hi = _narrow(lo, hi, a, offsets_ptr, PROBES)
    start = tl.load(offsets_ptr + lo, mask=~idle, other=0)  # [N] int64
    end = tl.load(offsets_ptr + lo + 1, mask=~idle, other=0)  # [N] int64
    # Tokens [t0, t1) of each tile: its owner's, at columns [CAP, max_context_len), in flat_in.
    t0 = tl.maximum(a, start + CAP)
    t1 = tl.minimum(tl.minimum(a + TAIL, end), tl.minimum(num_tokens, start + max_context_len))
    busy = (t1 > t0) & ~idle  # [N]
    row = tl.load(req_pool_indices_ptr + lo, mask=busy, other=0)  # [N] int64
    src = flat_in_ptr + a  # [N] pointers to each tile's first token
    dst = pool_out_ptr + row * pool_stride0 + (a - start)  # [N] pointers to its column
    lo_c = (t0 - a).to(tl.int32)  # [N] int32, in [0, TAIL] where busy
    hi_c = tl.where(busy, t1 - a, 0).to(tl.int32)  # [N] int32
    _copy_columns(src, dst, lo_c, hi_c, TAIL_COLS, PEEL)  # at most TAIL / TAIL_COLS steps


@triton.jit
def _role(bs, REQS: tl.constexpr, TAILS_FIRST: tl.constexpr):
    """This program's kind and number: ``(is_head, head_id, tail_id)`` (int64 ids). Head
    programs take ids ``[0, groups)``, tail programs the rest; with ``TAILS_FIRST`` tail
    programs take ``[0, tails)`` and heads the rest (lower ids start first in practice: speed
    only)."""
    pid = tl.program_id(0).to(tl.int64)
    groups = (bs.to(tl.int64) + REQS - 1) // REQS  # int64: bs near 2**31 arrives as int32
    if TAILS_FIRST:
        tails = tl.num_programs(0) - groups
        return pid >= tails, pid - tails, pid
    return pid < groups, pid, pid - groups


@triton.jit(do_not_specialize=["num_tokens", "bs", "pool_stride0", "max_context_len"])
def _scatter_capped_kernel(
    flat_in_ptr,  # [num_tokens] int64
    offsets_ptr,  # [bs + 1] int64
    req_pool_indices_ptr,  # [bs] int64
    pool_out_ptr,  # [rows, max_context_len] int32
    num_tokens,
    bs,
    pool_stride0,
    max_context_len,
    REQS: tl.constexpr,
    COLS: tl.constexpr,
    STEPS: tl.constexpr,
    TILES: tl.constexpr,
    TAIL: tl.constexpr,
    TAIL_COLS: tl.constexpr,
    PROBES: tl.constexpr,
    GUESS: tl.constexpr,
    GUESS_STRIDE: tl.constexpr,
    PEEL: tl.constexpr,
    TAILS_FIRST: tl.constexpr,
):
    is_head, head_id, tail_id = _role(bs, REQS, TAILS_FIRST)
    if is_head:
        _head(
            head_id, flat_in_ptr, offsets_ptr, req_pool_indices_ptr, pool_out_ptr,
            num_tokens, bs, pool_stride0, max_context_len, REQS, COLS, STEPS * COLS, PEEL,
        )  # fmt: skip
    else:
        _tail(
            tail_id, flat_in_ptr, offsets_ptr, req_pool_indices_ptr, pool_out_ptr,
            num_tokens, bs, pool_stride0, max_context_len, STEPS * COLS, TILES, TAIL, TAIL_COLS,
            PROBES, GUESS, GUESS_STRIDE, PEEL,
        )  # fmt: skip


def capped_tails_run(num_tokens: int, width: int, cap: int) -> bool:
    """Whether a column past ``cap`` can be written (``min(num_tokens, width) > cap``): then
    ``capped_grid`` gives tail programs."""
    return min(num_tokens, width) > cap


def capped_grid(bs: int, num_tokens: int, width: int, shape: Mapping[str, int]) -> tuple[int]:
    """The grid of ``launch_scatter_capped`` with the keywords ``shape`` (its ``reqs``,
    ``cols``, ``steps``, ``tiles`` and ``tail`` are read): head programs for every group of
    ``reqs`` requests, then one tail program per ``tiles * tail`` tokens past the cap
    (``steps * cols``); none when no column past the cap can be written
    (``min(num_tokens, width) <= cap``)."""
    cap = shape["steps"] * shape["cols"]
    heads = triton.cdiv(bs, shape["reqs"])
    if not capped_tails_run(num_tokens, width, cap):
        return (heads,)
    return (heads + triton.cdiv(num_tokens - cap, shape["tiles"] * shape["tail"]),)


def bind_scatter_capped(
    *,
    reqs: int,
    cols: int,
    steps: int,
    tiles: int,
    tail: int,
    tail_cols: int,
    probes: int = CAPPED_PROBES,
    guess: int = 0,
    guess_stride: int = 1,
    peel: int = 0,
    tails_first: int = 0,
    num_warps: int = 4,
) -> BoundKernel:
    """The kernel bound to these block keywords: called with a grid and
    ``ScatterArgs.kernel_args()``, it is ``launch_scatter_capped``'s launch. Every block
    parameter is a power of two (``probes`` at least 2; ``guess`` may also be 0;
    ``guess_stride`` is a positive integer with ``guess * guess_stride < 2**31``; ``peel`` 0 or
    1: each copy's first step issued outside its loop; ``tails_first`` 0 or 1: tail programs
    take the first program ids), with ``tail <= steps * cols`` and ``tail_cols <= tail``."""
    shape = (reqs, cols, steps, tiles, tail, tail_cols, probes, guess, guess_stride, peel)
    return _bound(*shape, tails_first, num_warps)


def launch_scatter_capped(t: ScatterArgs, *, grid: tuple[int], **keywords: int) -> None:
    """One launch over ``grid = capped_grid(bs, num_tokens, width, keywords)``, ``keywords``
    those of ``bind_scatter_capped``. Needs ``bs >= 1``; arguments are checked by the
    caller."""
    bind_scatter_capped(**keywords)(grid, t.kernel_args())


_bound = binder(
    _scatter_capped_kernel,
    *("REQS", "COLS", "STEPS", "TILES", "TAIL", "TAIL_COLS", "PROBES", "GUESS", "GUESS_STRIDE"),
    *("PEEL", "TAILS_FIRST", "num_warps"),
)
