"""Step 19 of benchmarks/NOTES.md: shorter dependent-load chains in the ``capped`` scatter.

Step 11 left the decode-like batches (spec, decode_prefill, giant, u128) 1.6-2x floor + L0,
bound by each program's chain of dependent loads: a head program copies its runs' first
``CAP`` columns ``COLS`` a step, and each step's load waits for the previous step's store to
be issued (the compiler cannot move a load of ``flat_in`` above a store to the pool, which it
cannot prove apart); a tail program searches ``log_PROBES(bs)`` rounds for its tile's owner.
The variants here, each checked byte for byte and then graph-replay timed next to the
library's ``auto`` in one run:

- ``oneshot``: the short class's heads copy the whole cap in one ``[REQS, CAP]`` step (the
  library kernel with ``cols = cap``, ``steps = 1``), on 4 or 8 warps;
- ``pipe``: heads and tails issue step ``k + 1``'s load before step ``k``'s store (two loads
  in flight; ``_capped_v`` below, ``PIPE=1``);
- ``bracket``: a tail tile's guessed offsets (``GUESS`` of them, ``GSTRIDE`` apart, around the
  owner equal runs would give) also narrow its search to the bracket they show, so a tile near
  its guess searches one round or none (``BRACKET=1``);
- ``probes``: wider search rounds (fewer of them);
- heads alone (``tails=0``: timing only, wrong where a run passes the cap).

``python -m benchmarks.history.explore_heads [--dists ...] [--budget-s S]``.
"""

from __future__ import annotations

from functools import partial

import triton
import triton.language as tl

from benchmarks.history.explore_capped import drive, time_variants
from kvcanary_dispatch import scatter_req_token_ids
from kvcanary_dispatch.cli.per_request_grid import scatter_per_request_grid
from kvcanary_dispatch.launch_plan import capped_shape
from kvcanary_kernels.scatter_capped import capped_grid
from kvcanary_kernels.scatter_rows import _scatter_rows_kernel


@triton.jit
def _copy(src, dst, lo, hi, stop, COLS: tl.constexpr, PIPE: tl.constexpr):
    """Columns ``[lo, hi)`` of each row (``src``/``dst`` [R] pointers to column 0), ``COLS`` a
    step up to ``stop``; ``PIPE``: the next step's load is issued before this step's store
    (1: masked loads filled with 0, whose select waits for the load; 2: left unfilled); 3 and
    4: the first step peeled off the loop, its masked loads filled with 0 (3) or not (4); 5
    and 6 (with the head's rows read early): as 0 and 3."""
    col = tl.arange(0, COLS)  # [C] int32
    if PIPE == 3 or PIPE == 4 or PIPE == 6:  # the first step peeled, the rest as in PIPE 0
        m0 = (col[None, :] >= lo[:, None]) & (col[None, :] < hi[:, None])  # [R, C]
        if PIPE != 4:
            v0 = tl.load(src[:, None] + col[None, :], mask=m0, other=0)  # [R, C] int64
        else:
            v0 = tl.load(src[:, None] + col[None, :], mask=m0)
        tl.store(dst[:, None] + col[None, :], v0.to(tl.int32), mask=m0)
        for c0 in range(COLS, stop, COLS):
            c = c0 + col
            m = (c[None, :] >= lo[:, None]) & (c[None, :] < hi[:, None])
            v = tl.load(src[:, None] + c[None, :], mask=m, other=0)
            tl.store(dst[:, None] + c[None, :], v.to(tl.int32), mask=m)
    elif PIPE == 1 or PIPE == 2:
        c = col
        m = (c[None, :] >= lo[:, None]) & (c[None, :] < hi[:, None])  # [R, C]
        if PIPE == 1:
            v = tl.load(src[:, None] + c[None, :], mask=m, other=0)  # [R, C] int64
        else:
            v = tl.load(src[:, None] + c[None, :], mask=m)
        for c0 in range(COLS, stop, COLS):
            cn = c0 + col
            mn = (cn[None, :] >= lo[:, None]) & (cn[None, :] < hi[:, None])
            if PIPE == 1:
                vn = tl.load(src[:, None] + cn[None, :], mask=mn, other=0)
            else:
                vn = tl.load(src[:, None] + cn[None, :], mask=mn)
            tl.store(dst[:, None] + c[None, :], v.to(tl.int32), mask=m)
            c = cn
            m = mn
            v = vn
        tl.store(dst[:, None] + c[None, :], v.to(tl.int32), mask=m)
    else:
        for c0 in range(0, stop, COLS):
            c = c0 + col
            m = (c[None, :] >= lo[:, None]) & (c[None, :] < hi[:, None])
            v = tl.load(src[:, None] + c[None, :], mask=m, other=0)
            tl.store(dst[:, None] + c[None, :], v.to(tl.int32), mask=m)


@triton.jit
def _head_v(g, flat_in_ptr, offsets_ptr, req_pool_indices_ptr, pool_out_ptr, num_tokens, bs,
            pool_stride0, max_context_len, REQS: tl.constexpr, COLS: tl.constexpr,
            CAP: tl.constexpr, PIPE: tl.constexpr):  # fmt: skip
    """``PIPE`` 5 and 6: each request's pool row read with its offsets (not after them, for
    non-empty runs only), then the copy of ``PIPE`` 0 (5) or 3 (6)."""
    r = g * REQS + tl.arange(0, REQS)  # [R] int64
    in_batch = r < bs
    if PIPE >= 5:
        row = tl.load(req_pool_indices_ptr + r, mask=in_batch, other=0)
    start = tl.load(offsets_ptr + r, mask=in_batch, other=0)
    end = tl.load(offsets_ptr + r + 1, mask=in_batch, other=0)
    lo = tl.minimum(tl.maximum(-start, 0), CAP).to(tl.int32)
    hi = tl.minimum(tl.minimum(end, num_tokens) - start, tl.minimum(max_context_len, CAP))
    hi = tl.maximum(hi, 0).to(tl.int32)
    if PIPE < 5:
        row = tl.load(req_pool_indices_ptr + r, mask=in_batch & (hi > lo), other=0)
    src = flat_in_ptr + start
    dst = pool_out_ptr + row * pool_stride0
    _copy(src, dst, lo, hi, tl.max(hi, axis=0), COLS, PIPE)


@triton.jit
def _tail_v(q, flat_in_ptr, offsets_ptr, req_pool_indices_ptr, pool_out_ptr, num_tokens, bs,
            pool_stride0, max_context_len, CAP: tl.constexpr, TILES: tl.constexpr,
            TAIL: tl.constexpr, TAIL_COLS: tl.constexpr, PROBES: tl.constexpr,
            GUESS: tl.constexpr, GSTRIDE: tl.constexpr, BRACKET: tl.constexpr,
            PIPE: tl.constexpr):  # fmt: skip
    a = CAP + (q * TILES + tl.arange(0, TILES)) * TAIL  # [N] int64
    i = tl.arange(1, PROBES + 1).to(tl.int64)  # [P]
    lo = a * 0
    hi = lo + bs
    idle = lo != 0
    if GUESS > 0:
        k = a * bs // tl.maximum(num_tokens, 1) - (GUESS // 2) * GSTRIDE  # [N] int64
        g = tl.arange(0, GUESS) * GSTRIDE
        j = tl.minimum(tl.maximum(k[:, None] + g[None, :], 0), bs)  # [N, G]
        seen = tl.load(offsets_ptr + j)  # [N, G] int64
        inside = (seen > (a + TAIL - 1 - CAP)[:, None]) & (seen <= a[:, None])
        idle = tl.max(inside.to(tl.int32), axis=1) > 0
        if BRACKET:
            below = seen <= a[:, None]  # [N, G]
            lo = tl.max(tl.where(below, tl.minimum(j, bs - 1), lo[:, None]), axis=1)
            hi = tl.min(tl.where(below, hi[:, None], j), axis=1)
        hi = tl.where(idle, lo, hi)
    while tl.max(hi - lo, axis=0) > 1:
        probe = lo[:, None] + (hi - lo)[:, None] * i[None, :] // (PROBES + 1)
        le = tl.load(offsets_ptr + probe) <= a[:, None]
        lo = tl.max(tl.where(le, probe, lo[:, None]), axis=1)
        hi = tl.min(tl.where(le, hi[:, None], probe), axis=1)
    start = tl.load(offsets_ptr + lo, mask=~idle, other=0)
    end = tl.load(offsets_ptr + lo + 1, mask=~idle, other=0)
    t0 = tl.maximum(a, start + CAP)
    t1 = tl.minimum(tl.minimum(a + TAIL, end), tl.minimum(num_tokens, start + max_context_len))
    busy = (t1 > t0) & ~idle
    row = tl.load(req_pool_indices_ptr + lo, mask=busy, other=0)
    lo_c = (t0 - a).to(tl.int32)
    hi_c = tl.where(busy, t1 - a, 0).to(tl.int32)
    src = flat_in_ptr + a
    dst = pool_out_ptr + row * pool_stride0 + (a - start)
    _copy(src, dst, lo_c, hi_c, tl.max(hi_c, axis=0), TAIL_COLS, PIPE)


@triton.jit(do_not_specialize=["num_tokens", "bs", "pool_stride0", "max_context_len"])
def _capped_v(
    flat_in_ptr, offsets_ptr, req_pool_indices_ptr, pool_out_ptr,
    num_tokens, bs, pool_stride0, max_context_len,
    REQS: tl.constexpr, COLS: tl.constexpr, STEPS: tl.constexpr, TILES: tl.constexpr,
    TAIL: tl.constexpr, TAIL_COLS: tl.constexpr, PROBES: tl.constexpr, GUESS: tl.constexpr,
    GSTRIDE: tl.constexpr, BRACKET: tl.constexpr, PIPE: tl.constexpr,
):  # fmt: skip
    """``kernels/scatter_capped.py``'s kernel with the ``PIPE`` and ``BRACKET`` knobs."""
    pid = tl.program_id(0).to(tl.int64)
    groups = (bs.to(tl.int64) + REQS - 1) // REQS
    if pid < groups:
        _head_v(pid, flat_in_ptr, offsets_ptr, req_pool_indices_ptr, pool_out_ptr, num_tokens,
                bs, pool_stride0, max_context_len, REQS, COLS, STEPS * COLS, PIPE)  # fmt: skip
    else:
        _tail_v(pid - groups, flat_in_ptr, offsets_ptr, req_pool_indices_ptr, pool_out_ptr,
                num_tokens, bs, pool_stride0, max_context_len, STEPS * COLS, TILES, TAIL,
                TAIL_COLS, PROBES, GUESS, GSTRIDE, BRACKET, PIPE)  # fmt: skip


def variant(bs: int, tokens: int, name: str) -> dict:
    """Launch keywords of ``_capped_v`` for one named variant on this batch (``tails``: whether
    tail programs run)."""
    p = dict(capped_shape(bs, tokens, None))
    # The library's own shape (its guess brackets the search since step 19).
    p.update(probes=32, gstride=p.pop("guess_stride"), bracket=int(p["guess"] > 0), pipe=0)
    p["tails"] = 1
    short = p["guess"] > 0
    for part in name.split("+"):
        if part == "auto":
            continue
        if part.startswith("oneshot"):  # heads: the cap in one step (short class only)
            if short:
                cap = p["cols"] * p["steps"]
                p.update(cols=cap, steps=1, reqs=min(p["reqs"], 4096 // cap))
        elif part.startswith("w"):
            p["num_warps"] = int(part[1:])
        elif part.startswith("pipe"):  # pipe: filled loads; pipe2: unfilled
            p["pipe"] = int(part[4:] or 1)
        elif part.startswith("peel"):  # peel: filled loads; peel2: unfilled
            p["pipe"] = 2 + int(part[4:] or 1)
        elif part == "early":  # the head's rows read with its offsets
            p["pipe"] = 5
        elif part == "earlypeel":
            p["pipe"] = 6
        elif part.startswith("bracket"):  # bracket<G>s<stride>
            g, s = part[7:].split("s")
            p.update(bracket=1, guess=int(g), gstride=int(s))
        elif part.startswith("p") and part[1:].isdigit():
            p["probes"] = int(part[1:])
        elif part.startswith("tail"):  # tail<div>: tail tiles cap/div tokens (same per program)
            per_tail = p["tiles"] * p["tail"]
            p["tail"] = max(1, p["tail"] // int(part[4:]))
            p["tiles"] = per_tail // p["tail"]
            p["tail_cols"] = min(p["tail"], max(1, 4096 // p["tiles"]))
        elif part == "heads":
            p["tails"] = 0
        elif part[0] in "srcTk" and part[1:].isdigit():  # steps, reqs, cols, tail_cols, tiles
            key = {"s": "steps", "r": "reqs", "c": "cols", "T": "tail_cols", "k": "tiles"}
            p[key[part[0]]] = int(part[1:])
        else:
            raise ValueError(part)
    cap = p["steps"] * p["cols"]
    if p["tail"] > cap:  # keep TAIL <= CAP and the tokens a tail program covers
        per_tail = p["tiles"] * p["tail"]
        p.update(tail=cap, tiles=per_tail // cap)
    p["tail_cols"] = min(p["tail_cols"], p["tail"])
    return p


def run_variant(p: dict, flat_in, offsets, req_pool_indices, pool_out, **kw) -> None:
    bs, n, width = req_pool_indices.numel(), flat_in.numel(), pool_out.shape[1]
    grid = capped_grid(bs, n, width if p["tails"] else 0, p)
    _capped_v[grid](
        flat_in, offsets, req_pool_indices, pool_out, n, bs, pool_out.stride(0), width,
        REQS=p["reqs"], COLS=p["cols"], STEPS=p["steps"], TILES=p["tiles"], TAIL=p["tail"],
        TAIL_COLS=p["tail_cols"], PROBES=p["probes"], GUESS=p["guess"], GSTRIDE=p["gstride"],
        BRACKET=p["bracket"], PIPE=p["pipe"], num_warps=p["num_warps"],
    )  # fmt: skip


VARIANTS = [
    "auto", "auto+pipe", "oneshot", "oneshot+w8", "oneshot+pipe", "bracket16s1", "bracket64s1",
    "bracket64s2", "oneshot+bracket64s2", "oneshot+bracket64s2+pipe", "oneshot+bracket64s2+tail2",
    "p128", "oneshot+bracket64s2+p128", "heads", "oneshot+heads", "pipe+heads",
]  # fmt: skip


ROWS = [(512, 4), (1024, 4), (1024, 8), (2048, 4), (2048, 8), (4096, 8), (4096, 16)]


def run_rows(cols: int, warps: int, flat_in, offsets, req_pool_indices, pool_out, **kw) -> None:
    bs, width = req_pool_indices.numel(), pool_out.shape[1]
    _scatter_rows_kernel[(bs, triton.cdiv(width, cols))](
        flat_in, offsets, req_pool_indices, pool_out, flat_in.numel(), bs, pool_out.stride(0),
        width, COLS=cols, num_warps=warps,
    )  # fmt: skip


def explore(names, dev, meta, deadline, variants) -> None:
    def build(case) -> dict:
        impls = {"grid": scatter_per_request_grid, "lib auto": scatter_req_token_ids}
        seen = set()
        for v in variants:
            p = variant(case.bs, case.total, v)
            key = tuple(sorted(p.items()))
            if key in seen:  # a variant that changes nothing on this batch
                continue
            seen.add(key)
            impls[f"{v} {p}"] = partial(run_variant, p)
        if case.bs <= 128:
            for cols, warps in ROWS:
                impls[f"rows cols={cols} warps={warps}"] = partial(run_rows, cols, warps)
        return impls

    time_variants(names, dev, meta, deadline, build, lambda label: "'tails': 0" in label)


def main() -> None:
    drive(explore, VARIANTS)


if __name__ == "__main__":
    main()
