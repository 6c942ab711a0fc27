"""Step 21 of benchmarks/NOTES.md: shorter load chains for decodes with prefill pieces, and a
register cap for the long class.

Step 19 found that on decodes with a few prefill pieces neither the heads alone nor a tail
search one round shorter moved the time: both chains are about as long. A head group holding a
piece copies 8 dependent steps of ``[REQS, COLS]``; a tail tile of the piece reads its guess,
searches up to three rounds, then its owner's offsets, then its row, then its tokens. Knobs of
``_capped_f`` below (the library kernel otherwise):

- ``FAR`` (``far<k>``): a head group with at most ``k`` rows whose run passes ``COLS``
  copies its first step for every row, then each such row's columns ``[COLS, CAP)`` in one
  ``[CAP]`` step, all issued together; a group with more takes the library's steps;
- ``ROWPAR`` (``rowpar``): a tail tile reads its owner's row with the owner's offsets, not
  after them;
- ``PAR1`` (``par1``): step 20's first search round issued with the guess;
- ``maxnreg`` (``m<n>``): Triton's register cap per thread, for U(0,128)'s occupancy.

``lib auto`` is the library's own call. ``python -m benchmarks.history.explore_far
[--dists ...] [--variants ...] [--budget-s S] [--width W]``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from benchmarks.history.explore_capped import drive, named_explore
from kvcanary_dispatch.launch_plan import capped_shape
from kvcanary_kernels.scatter_capped import _copy_columns, _copy_step, _role, capped_grid


@triton.jit
def _add4(a0, a1, a2, a3, b0, b1, b2, b3):
    return a0 + b0, a1 + b1, a2 + b2, a3 + b3


@triton.jit
def _head_f(g, flat_in_ptr, offsets_ptr, req_pool_indices_ptr, pool_out_ptr, num_tokens, bs,
            pool_stride0, max_context_len, REQS: tl.constexpr, COLS: tl.constexpr,
            CAP: tl.constexpr, PEEL: tl.constexpr, FAR: tl.constexpr):  # fmt: skip
    """The library's ``_head`` with ``FAR`` (module docstring)."""
    r = g * REQS + tl.arange(0, REQS)  # [R] int64
    in_batch = r < bs
    row = tl.load(req_pool_indices_ptr + r, mask=in_batch, other=0)
    start = tl.load(offsets_ptr + r, mask=in_batch, other=0)
    end = tl.load(offsets_ptr + r + 1, mask=in_batch, other=0)
    lo = tl.minimum(tl.maximum(-start, 0), CAP).to(tl.int32)
    hi = tl.minimum(tl.minimum(end, num_tokens) - start, tl.minimum(max_context_len, CAP))
    hi = tl.maximum(hi, 0).to(tl.int32)
    src = flat_in_ptr + start
    dst = pool_out_ptr + row * pool_stride0
    if FAR > 0:
        far = hi > COLS  # [R]
        if tl.sum(far.to(tl.int32), axis=0) <= FAR:
            _copy_step(src, dst, lo, tl.minimum(hi, COLS), tl.arange(0, COLS))
            rank = tl.cumsum(far.to(tl.int32), axis=0) - 1  # [R] int32
            c = tl.arange(0, CAP)  # [CAP] int32
            for i in tl.static_range(FAR):  # the i-th far row's [COLS, hi) in one step
                sel = far & (rank == i)
                s_i, row_i, lo_i, hi_i = tl.reduce(
                    (tl.where(sel, start, 0), tl.where(sel, row, 0), tl.where(sel, lo, 0),
                     tl.where(sel, hi, 0)), 0, _add4,
                )  # fmt: skip
                m = (c >= tl.maximum(lo_i, COLS)) & (c < hi_i)  # none when there is no i-th
                v = tl.load(flat_in_ptr + s_i + c, mask=m, other=0)  # [CAP] int64
                tl.store(pool_out_ptr + row_i * pool_stride0 + c, v.to(tl.int32), mask=m)
        else:
            _copy_columns(src, dst, lo, hi, COLS, PEEL)
    else:
        _copy_columns(src, dst, lo, hi, COLS, PEEL)


@triton.jit
def _owner_copy(a, lo, idle, flat_in_ptr, offsets_ptr, req_pool_indices_ptr, pool_out_ptr,
                num_tokens, pool_stride0, max_context_len, CAP: tl.constexpr,
                TAIL: tl.constexpr, TAIL_COLS: tl.constexpr, PEEL: tl.constexpr,
                ROWPAR: tl.constexpr, EARLY: tl.constexpr, early):  # fmt: skip
    """The library's end of ``_tail``: each tile's owner ``lo`` read (``ROWPAR``: its row
    with its offsets), then the tile's columns past the cap copied (``EARLY``, step 22's
    ``explore_tails``: stored from ``early``, the ``[N, TAIL_COLS]`` tokens read before the
    search)."""
    start = tl.load(offsets_ptr + lo, mask=~idle, other=0)
    end = tl.load(offsets_ptr + lo + 1, mask=~idle, other=0)
    if ROWPAR:
        row = tl.load(req_pool_indices_ptr + lo, mask=~idle, other=0)
    t0 = tl.maximum(a, start + CAP)
    t1 = tl.minimum(tl.minimum(a + TAIL, end), tl.minimum(num_tokens, start + max_context_len))
    busy = (t1 > t0) & ~idle
    if not ROWPAR:
        row = tl.load(req_pool_indices_ptr + lo, mask=busy, other=0)
    dst = pool_out_ptr + row * pool_stride0 + (a - start)
    lo_c = (t0 - a).to(tl.int32)
    hi_c = tl.where(busy, t1 - a, 0).to(tl.int32)
    if EARLY:
        c = tl.arange(0, TAIL_COLS)
        m = (c[None, :] >= lo_c[:, None]) & (c[None, :] < hi_c[:, None])
        tl.store(dst[:, None] + c[None, :], early.to(tl.int32), mask=m)
    else:
        _copy_columns(flat_in_ptr + a, dst, lo_c, hi_c, TAIL_COLS, PEEL)


@triton.jit
def _tail_f(q, flat_in_ptr, offsets_ptr, req_pool_indices_ptr, pool_out_ptr, num_tokens, bs,
            pool_stride0, max_context_len, CAP: tl.constexpr, TILES: tl.constexpr,
            TAIL: tl.constexpr, TAIL_COLS: tl.constexpr, PROBES: tl.constexpr,
            GUESS: tl.constexpr, GUESS_STRIDE: tl.constexpr, PEEL: tl.constexpr,
            ROWPAR: tl.constexpr, PAR1: tl.constexpr):  # fmt: skip
    """The library's ``_tail`` with ``ROWPAR`` and ``PAR1`` (module docstring)."""
    a = CAP + (q * TILES + tl.arange(0, TILES)) * TAIL
    i = tl.arange(1, PROBES + 1).to(tl.int64)
    lo = a * 0
    hi = lo + bs
    idle = lo != 0
    if GUESS > 0:
        k = a * bs // tl.maximum(num_tokens, 1) - (GUESS // 2) * GUESS_STRIDE
        step = tl.arange(0, GUESS) * GUESS_STRIDE
        j = tl.minimum(tl.maximum(k[:, None] + step[None, :], 0), bs)
        seen = tl.load(offsets_ptr + j)
        if PAR1:
            p1 = bs.to(tl.int64) * i // (PROBES + 1)
            le1 = tl.load(offsets_ptr + p1)[None, :] <= a[:, None]
        inside = (seen > (a + TAIL - 1 - CAP)[:, None]) & (seen <= a[:, None])
        idle = tl.max(inside.to(tl.int32), axis=1) > 0
        below = seen <= a[:, None]
        lo = tl.max(tl.where(below, tl.minimum(j, bs - 1), lo[:, None]), axis=1)
        hi = tl.min(tl.where(below, hi[:, None], j), axis=1)
        if PAR1:
            lo = tl.maximum(lo, tl.max(tl.where(le1, p1[None, :], 0), axis=1))
            hi = tl.minimum(hi, tl.min(tl.where(le1, bs, p1[None, :]), axis=1))
        hi = tl.where(idle, lo, hi)
    while tl.max(hi - lo, axis=0) > 1:
        probe = lo[:, None] + (hi - lo)[:, None] * i[None, :] // (PROBES + 1)
        le = tl.load(offsets_ptr + probe) <= a[:, None]
        lo = tl.max(tl.where(le, probe, lo[:, None]), axis=1)
        hi = tl.min(tl.where(le, hi[:, None], probe), axis=1)
    _owner_copy(a, lo, idle, flat_in_ptr, offsets_ptr, req_pool_indices_ptr, pool_out_ptr,
                num_tokens, pool_stride0, max_context_len, CAP, TAIL, TAIL_COLS, PEEL, ROWPAR,
                0, a)  # fmt: skip


@triton.jit(do_not_specialize=["num_tokens", "bs", "pool_stride0", "max_context_len"])
def _capped_f(
    flat_in_ptr, offsets_ptr, req_pool_indices_ptr, pool_out_ptr,
    num_tokens, bs, pool_stride0, max_context_len,
    REQS: tl.constexpr, COLS: tl.constexpr, STEPS: tl.constexpr, TILES: tl.constexpr,
    TAIL: tl.constexpr, TAIL_COLS: tl.constexpr, PROBES: tl.constexpr, GUESS: tl.constexpr,
    GUESS_STRIDE: tl.constexpr, PEEL: tl.constexpr, TAILS_FIRST: tl.constexpr,
    FAR: tl.constexpr, ROWPAR: tl.constexpr, PAR1: tl.constexpr, ONLY: tl.constexpr,
):  # fmt: skip
    is_head, head_id, tail_id = _role(bs, REQS, TAILS_FIRST)
    if is_head and ONLY != 2:
        _head_f(head_id, flat_in_ptr, offsets_ptr, req_pool_indices_ptr, pool_out_ptr,
                num_tokens, bs, pool_stride0, max_context_len, REQS, COLS, STEPS * COLS, PEEL,
                FAR)  # fmt: skip
    elif not is_head and ONLY != 1:
        _tail_f(tail_id, flat_in_ptr, offsets_ptr, req_pool_indices_ptr, pool_out_ptr,
                num_tokens, bs, pool_stride0, max_context_len, STEPS * COLS, TILES, TAIL,
                TAIL_COLS, PROBES, GUESS, GUESS_STRIDE, PEEL, ROWPAR, PAR1)  # fmt: skip


def variant(bs: int, tokens: int, width: int, name: str) -> dict:
    """Launch keywords of ``_capped_f`` for one named variant: ``auto``'s shape, then the
    parts of ``name`` joined by ``+`` (``far<k>``, ``rowpar``, ``par1``, ``m<n>``)."""
    p = dict(capped_shape(bs, tokens, width))
    p.update(far=0, rowpar=0, par1=0, maxnreg=None, only=0, probes=32)
    for part in name.split("+"):
        if part == "auto":
            continue
        if part.startswith("far"):
            p["far"] = int(part[3:]) if p["reqs"] > 1 and p["steps"] > 1 else 0
        elif part in ("rowpar", "par1"):
            p[part] = 1
        elif part in ("heads", "tails"):  # timing only: the other kind of program returns
            p["only"] = 1 if part == "heads" else 2
        elif part.startswith("p") and part[1:].isdigit():
            p["probes"] = int(part[1:])
        elif part.startswith("m") and part[1:].isdigit():
            p["maxnreg"] = int(part[1:])
        else:
            raise ValueError(part)
    p["par1"] = p["par1"] if p["guess"] else 0
    return p


def run_variant(p: dict, flat_in, offsets, req_pool_indices, pool_out, **kw) -> None:
    bs, n, width = req_pool_indices.numel(), flat_in.numel(), pool_out.shape[1]
    grid = capped_grid(bs, n, width, p)
    extra = {} if p["maxnreg"] is None else {"maxnreg": p["maxnreg"]}
    _capped_f[grid](
        flat_in, offsets, req_pool_indices, pool_out, n, bs, pool_out.stride(0), width,
        REQS=p["reqs"], COLS=p["cols"], STEPS=p["steps"], TILES=p["tiles"], TAIL=p["tail"],
        TAIL_COLS=p["tail_cols"], PROBES=p["probes"], GUESS=p["guess"],
        GUESS_STRIDE=p["guess_stride"], PEEL=p["peel"], TAILS_FIRST=p["tails_first"],
        FAR=p["far"], ROWPAR=p["rowpar"], PAR1=p["par1"], ONLY=p["only"],
        num_warps=p["num_warps"], **extra,
    )  # fmt: skip


VARIANTS = ["auto", "far1", "far2", "rowpar", "par1", "rowpar+par1", "far1+rowpar",
            "far2+rowpar", "far2+rowpar+par1", "m32", "m40", "m48", "far2+rowpar+m40"]  # fmt: skip


explore = named_explore(variant, run_variant)


def main() -> None:
    drive(explore, VARIANTS)


if __name__ == "__main__":
    main()
