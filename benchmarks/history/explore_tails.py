"""Step 22 of benchmarks/NOTES.md: tail tiles that find their owner, or learn they have no
work, in fewer dependent reads.

Step 21 found that on decodes with prefill pieces the tail programs set the time: the linear
guess misses the owners of tiles inside the pieces by thousands of requests, and each such
tile searches three rounds. On drafts and U(0,128) no run reaches the cap, yet every tail
tile whose first token is not a run's first searches a round and reads its owner's offsets
before it finds nothing to copy. Knobs of ``_tail_t`` below (the library's ``_tail`` as it
was before this step otherwise, except that its idle test goes through an int64 max of the
offsets read, not an int32 max of a flag: the copy's ``auto`` reads 0.3-0.6 µs slower than
the library on the decode batches), and ``_tail_c`` (``c``), the search the library kept:

- ``SAMPLE`` (``s<n>``): each tail program also reads ``n`` offsets evenly spaced over the
  batch (the same for every program, so they stay in L2), issued with the guess; each tile's
  search starts inside the sample interval that holds its first token, intersected with the
  guess's bounds (a search over ``bs`` requests then starts ``bs / n`` wide);
- ``BRACKET`` (``b``, ``bb``): a tile keeps the offsets at its search bounds (``v_lo <=
  a < v_hi``); its owner's run lies inside ``[v_lo, v_hi)``, so the tile has no column past
  the cap when ``v_hi - v_lo <= CAP``, or when ``v_lo > a + TAIL - 1 - CAP`` (the library's
  test, widened from the guess's reads to every read). ``b`` tests after the first reads,
  ``bb`` after every search round as well; an idle tile stops searching and skips its
  owner's reads;
- ``c`` (counted bounds): the guess and every search round place each tile's bounds from
  one int32 count of the offsets read at or before its first token (``offsets`` are
  non-decreasing where results count), not from int64 max/min reductions of the indices;
  ``f`` (with ``c``): the number of rounds the widest tile needs, from one reduction after
  the guess, in place of a program-wide reduction before each round; ``pl``: every copy's
  first step outside its loop (``auto`` peels only tiles one column or one request wide);
  ``rowpar``: the owner's row read with its offsets; ``early``: a one-step tile's tokens
  read before its search, for tiles the guess leaves busy; ``ps<n>``: one sample of ``n``
  offsets a program, bounding every tile's search by the owners of its first and last tiles;
- ``far<k>`` (``explore_far``'s head step, short class only), ``heads``/``tails`` (timing
  only: the other kind of program returns at once).

``lib auto`` is the library's own call: the previous search in runs 1-4 (logged as
``explore_22_tails_{1..4}.log``), ``c``'s from commit 05fa028 on. ``python -m
benchmarks.history.explore_tails [--dists ...] [--variants ...] [--budget-s S] [--width W]``.
"""

from __future__ import annotations

import re

import triton
import triton.language as tl

from benchmarks.history.explore_capped import drive, named_explore
from benchmarks.history.explore_far import _head_f, _owner_copy
from kvcanary_dispatch.launch_plan import CAPPED_SHORT_MEAN, capped_shape
from kvcanary_kernels.scatter_capped import _guess, _narrow, _role, capped_grid

# A bracket value no read gives: gaps built from it never pass the cap.
_FAR: tl.constexpr = tl.constexpr(1 << 61)


@triton.jit
def _tail_t(q, flat_in_ptr, offsets_ptr, req_pool_indices_ptr, pool_out_ptr, num_tokens, bs,
            pool_stride0, max_context_len, CAP: tl.constexpr, TILES: tl.constexpr,
            TAIL: tl.constexpr, TAIL_COLS: tl.constexpr, PROBES: tl.constexpr,
            GUESS: tl.constexpr, GUESS_STRIDE: tl.constexpr, PEEL: tl.constexpr,
            SAMPLE: tl.constexpr, BRACKET: tl.constexpr, PSAMPLE: tl.constexpr,
            ROWPAR: tl.constexpr, EARLY: tl.constexpr):  # fmt: skip
    """The library's ``_tail`` with ``SAMPLE``, ``BRACKET``, ``PSAMPLE``, ``ROWPAR`` and
    ``EARLY`` (module docstring)."""
    a = CAP + (q * TILES + tl.arange(0, TILES)) * TAIL  # [N] int64
    i = tl.arange(1, PROBES + 1).to(tl.int64)  # [P]
    lo = a * 0  # [N]; offsets[lo] <= a, or lo == 0
    hi = lo + bs  # [N]; hi == bs or offsets[hi] > a
    v_lo = lo - _FAR  # [N]; a value read at an index in [0, owner], else -_FAR
    v_hi = lo + _FAR  # [N]; a value read at an index in (owner, bs], else _FAR
    if SAMPLE > 0:
        js = tl.arange(0, SAMPLE).to(tl.int64) * bs // SAMPLE  # [S] in [0, bs)
        sv = tl.load(offsets_ptr + js)  # [S] int64, the same for every program
        ls = sv[None, :] <= a[:, None]  # [N, S]
        lo = tl.max(tl.where(ls, js[None, :], lo[:, None]), axis=1)
        hi = tl.min(tl.where(ls, hi[:, None], js[None, :]), axis=1)
        v_lo = tl.max(tl.where(ls, sv[None, :], v_lo[:, None]), axis=1)
        v_hi = tl.min(tl.where(ls, v_hi[:, None], sv[None, :]), axis=1)
    if PSAMPLE > 0:
        # One sample for the program: its tiles' owners lie between the owner of its first
        # tile's start a0 and that of its last tile's start a1.
        a0 = CAP + q * TILES * TAIL
        a1 = a0 + (TILES - 1) * TAIL
        js = tl.arange(0, PSAMPLE).to(tl.int64) * bs // PSAMPLE  # [S] in [0, bs)
        sv = tl.load(offsets_ptr + js)  # [S] int64, the same for every program
        c0 = tl.sum((sv <= a0).to(tl.int32), axis=0)  # samples at or before a0
        c1 = tl.sum((sv <= a1).to(tl.int32), axis=0)
        lo = lo + tl.maximum(c0 - 1, 0).to(tl.int64) * bs // PSAMPLE
        hi = tl.where(c1 < PSAMPLE, c1.to(tl.int64) * bs // PSAMPLE + lo * 0, hi)
        v_lo = tl.maximum(v_lo, tl.max(tl.where(sv <= a0, sv, -_FAR), axis=0))
        v_hi = tl.minimum(v_hi, tl.min(tl.where(sv > a1, sv, _FAR), axis=0))
    if GUESS > 0:
        k = a * bs // tl.maximum(num_tokens, 1) - (GUESS // 2) * GUESS_STRIDE
        step = tl.arange(0, GUESS) * GUESS_STRIDE  # [G]
        j = tl.minimum(tl.maximum(k[:, None] + step[None, :], 0), bs)  # [N, G] in [0, bs]
        seen = tl.load(offsets_ptr + j)  # [N, G]
        below = seen <= a[:, None]
        lo = tl.maximum(lo, tl.max(tl.where(below, tl.minimum(j, bs - 1), lo[:, None]), axis=1))
        hi = tl.minimum(hi, tl.min(tl.where(below, hi[:, None], j), axis=1))
        # j == bs at or before a: every run ends by a, so no tile work depends on it
        v_lo = tl.maximum(v_lo, tl.max(tl.where(below & (j < bs), seen, v_lo[:, None]), axis=1))
        v_hi = tl.minimum(v_hi, tl.min(tl.where(below, v_hi[:, None], seen), axis=1))
    if BRACKET > 0:
        idle = (v_hi - v_lo <= CAP) | (v_lo > a + TAIL - 1 - CAP)
    elif GUESS > 0:  # the library's test: a boundary read in (a + TAIL - 1 - CAP, a]
        idle = v_lo > a + TAIL - 1 - CAP
    else:
        idle = lo != lo
    hi = tl.where(idle, lo, hi)
    early = a  # unused unless EARLY
    if EARLY:  # one-step tiles: the tokens are read before the search, for tiles not idle
        c = tl.arange(0, TAIL_COLS)
        early = tl.load(
            flat_in_ptr + a[:, None] + c[None, :],
            mask=~idle[:, None] & (a[:, None] + c[None, :] < num_tokens),
            other=0,
        )
    while tl.max(hi - lo, axis=0) > 1:
        probe = lo[:, None] + (hi - lo)[:, None] * i[None, :] // (PROBES + 1)  # [N, P]
        pv = tl.load(offsets_ptr + probe)  # [N, P]
        le = pv <= a[:, None]
        lo = tl.max(tl.where(le, probe, lo[:, None]), axis=1)
        hi = tl.min(tl.where(le, hi[:, None], probe), axis=1)
        if BRACKET > 1:
            v_lo = tl.maximum(v_lo, tl.max(tl.where(le, pv, v_lo[:, None]), axis=1))
            v_hi = tl.minimum(v_hi, tl.min(tl.where(le, v_hi[:, None], pv), axis=1))
            idle = idle | (v_hi - v_lo <= CAP) | (v_lo > a + TAIL - 1 - CAP)
            hi = tl.where(idle, lo, hi)
    _owner_copy(a, lo, idle, flat_in_ptr, offsets_ptr, req_pool_indices_ptr, pool_out_ptr,
                num_tokens, pool_stride0, max_context_len, CAP, TAIL, TAIL_COLS, PEEL, ROWPAR,
                EARLY, early)  # fmt: skip


@triton.jit
def _tail_c(q, flat_in_ptr, offsets_ptr, req_pool_indices_ptr, pool_out_ptr, num_tokens, bs,
            pool_stride0, max_context_len, CAP: tl.constexpr, TILES: tl.constexpr,
            TAIL: tl.constexpr, TAIL_COLS: tl.constexpr, PROBES: tl.constexpr,
            GUESS: tl.constexpr, GUESS_STRIDE: tl.constexpr, PEEL: tl.constexpr,
            FIXED: tl.constexpr, ROWPAR: tl.constexpr, PSAMPLE: tl.constexpr):  # fmt: skip
    """Counted bounds (the library's ``_tail`` from this step on) with ``FIXED`` rounds,
    ``ROWPAR`` and ``PSAMPLE``. With ``PSAMPLE``, bounds are intersected by max/min, so
    offsets out of order can leave ``lo > hi`` (reads stay in bounds: an exploration)."""
    a = CAP + (q * TILES + tl.arange(0, TILES)) * TAIL  # [N] int64
    lo = a * 0  # [N] int64; offsets[lo] <= a, or lo == 0
    hi = lo + bs  # [N] int64; hi == bs or offsets[hi] > a
    idle = lo != lo  # [N], all False
    if PSAMPLE > 0:  # counted: samples at or before the program's first and last tiles
        a0 = CAP + q * TILES * TAIL
        js = tl.arange(0, PSAMPLE).to(tl.int64) * bs // PSAMPLE  # [S] in [0, bs)
        sv = tl.load(offsets_ptr + js)  # [S] int64
        c0 = tl.sum((sv <= a0).to(tl.int32), axis=0)
        c1 = tl.sum((sv <= a0 + (TILES - 1) * TAIL).to(tl.int32), axis=0)
        lo = lo + tl.maximum(c0 - 1, 0).to(tl.int64) * bs // PSAMPLE
        hi = tl.where(c1 < PSAMPLE, c1.to(tl.int64) * bs // PSAMPLE + lo * 0, hi)
    if GUESS > 0:
        n_le, last, past, idle = _guess(
            a, offsets_ptr, num_tokens, bs, CAP, TAIL, GUESS, GUESS_STRIDE
        )  # fmt: skip
        lo = tl.where(n_le > 0, tl.maximum(lo, last), lo)
        hi = tl.where(n_le < GUESS, tl.minimum(hi, past), hi)
        hi = tl.where(idle, lo, hi)
    if FIXED:  # the rounds the widest tile needs, from one reduction
        w = tl.max(hi - lo, axis=0)
        rounds = 0
        while w > 1:
            w = (w + PROBES - 1) // PROBES  # the library's rounds narrow PROBES-fold (step 23)
            rounds += 1
        for _ in range(rounds):
            lo, hi = _narrow(lo, hi, a, offsets_ptr, PROBES)
    else:
        while tl.max(hi - lo, axis=0) > 1:
            lo, hi = _narrow(lo, hi, a, offsets_ptr, PROBES)
    _owner_copy(a, lo, idle, flat_in_ptr, offsets_ptr, req_pool_indices_ptr, pool_out_ptr,
                num_tokens, pool_stride0, max_context_len, CAP, TAIL, TAIL_COLS, PEEL, ROWPAR,
                0, a)  # fmt: skip


@triton.jit(do_not_specialize=["num_tokens", "bs", "pool_stride0", "max_context_len"])
def _capped_t(
    flat_in_ptr, offsets_ptr, req_pool_indices_ptr, pool_out_ptr,
    num_tokens, bs, pool_stride0, max_context_len,
    REQS: tl.constexpr, COLS: tl.constexpr, STEPS: tl.constexpr, TILES: tl.constexpr,
    TAIL: tl.constexpr, TAIL_COLS: tl.constexpr, PROBES: tl.constexpr, GUESS: tl.constexpr,
    GUESS_STRIDE: tl.constexpr, PEEL: tl.constexpr, TAILS_FIRST: tl.constexpr,
    FAR: tl.constexpr, SAMPLE: tl.constexpr, BRACKET: tl.constexpr, PSAMPLE: tl.constexpr,
    ROWPAR: tl.constexpr, EARLY: tl.constexpr, CNT: tl.constexpr, FIXED: tl.constexpr,
    ONLY: tl.constexpr,
):  # fmt: skip
    is_head, head_id, tail_id = _role(bs, REQS, TAILS_FIRST)
    if is_head and ONLY != 2:
        _head_f(head_id, flat_in_ptr, offsets_ptr, req_pool_indices_ptr, pool_out_ptr,
                num_tokens, bs, pool_stride0, max_context_len, REQS, COLS, STEPS * COLS, PEEL,
                FAR)  # fmt: skip
    elif not is_head and ONLY != 1 and CNT:
        _tail_c(tail_id, flat_in_ptr, offsets_ptr, req_pool_indices_ptr, pool_out_ptr,
                num_tokens, bs, pool_stride0, max_context_len, STEPS * COLS, TILES, TAIL,
                TAIL_COLS, PROBES, GUESS, GUESS_STRIDE, PEEL, FIXED, ROWPAR, PSAMPLE)  # fmt: skip
    elif not is_head and ONLY != 1:
        _tail_t(tail_id, flat_in_ptr, offsets_ptr, req_pool_indices_ptr, pool_out_ptr,
                num_tokens, bs, pool_stride0, max_context_len, STEPS * COLS, TILES, TAIL,
                TAIL_COLS, PROBES, GUESS, GUESS_STRIDE, PEEL, SAMPLE, BRACKET, PSAMPLE, ROWPAR,
                EARLY)  # fmt: skip


def variant(bs: int, tokens: int, width: int, name: str) -> dict:
    """Launch keywords of ``_capped_t`` for one named variant: ``auto``'s shape, then the
    parts of ``name`` joined by ``+`` (``s<n>``, ``ps<n>``, ``b``, ``bb``, ``c``, ``f``,
    ``rowpar``, ``early``, ``pl``, ``p<n>`` probes, ``far<k>``, ``g<n>x<k>``: ``n`` guessed
    offsets ``k`` requests apart in either class, ``w<n>``: ``n`` warps, ``heads``, ``tails``)."""
    p = dict(capped_shape(bs, tokens, width))
    p.update(
        far=0, sample=0, bracket=0, psample=0, rowpar=0, early=0, cnt=0, fixed=0, only=0, probes=32
    )
    short = -(-tokens // max(bs, 1)) <= CAPPED_SHORT_MEAN
    for part in name.split("+"):
        if part == "auto":
            continue
        if part.startswith("far"):
            p["far"] = int(part[3:]) if short and p["reqs"] > 1 and p["steps"] > 1 else 0
        elif part.startswith("s") and part[1:].isdigit():
            p["sample"] = int(part[1:])
        elif part.startswith("ps") and part[2:].isdigit():
            p["psample"] = int(part[2:])
        elif part in ("rowpar", "early"):
            p[part] = 1
        elif part in ("c", "f"):  # counted bounds; fixed rounds (with c)
            p["cnt" if part == "c" else "fixed"] = 1
        elif re.fullmatch(r"p\d+", part):  # probes a search round
            p["probes"] = int(part[1:])
        elif part == "pl":  # every copy's first step outside its loop
            p["peel"] = 1
        elif part in ("b", "bb"):
            p["bracket"] = len(part)
        elif re.fullmatch(r"g\d+x\d+", part):  # guessed offsets x stride, either class
            p["guess"], p["guess_stride"] = map(int, part[1:].split("x"))
        elif re.fullmatch(r"w\d+", part):  # warps a program (step 23)
            p["num_warps"] = int(part[1:])
        elif part in ("heads", "tails"):  # timing only: the other kind of program returns
            p["only"] = 1 if part == "heads" else 2
        else:
            raise ValueError(part)
    return p


def run_variant(p: dict, flat_in, offsets, req_pool_indices, pool_out, **kw) -> None:
    bs, n, width = req_pool_indices.numel(), flat_in.numel(), pool_out.shape[1]
    _capped_t[capped_grid(bs, n, width, p)](
        flat_in, offsets, req_pool_indices, pool_out, n, bs, pool_out.stride(0), width,
        REQS=p["reqs"], COLS=p["cols"], STEPS=p["steps"], TILES=p["tiles"], TAIL=p["tail"],
        TAIL_COLS=p["tail_cols"], PROBES=p["probes"], GUESS=p["guess"],
        GUESS_STRIDE=p["guess_stride"], PEEL=p["peel"], TAILS_FIRST=p["tails_first"],
        FAR=p["far"], SAMPLE=p["sample"], BRACKET=p["bracket"], PSAMPLE=p["psample"],
        ROWPAR=p["rowpar"], EARLY=p["early"] if p["tail"] == p["tail_cols"] else 0,
        CNT=p["cnt"], FIXED=p["fixed"], ONLY=p["only"],
        num_warps=p["num_warps"],
    )  # fmt: skip


# Run 1: per-tile samples and the bracket test; run 2: one sample a program, the row read with
# the owner's offsets, tokens read before the search, the far-row head step.
RUN1 = [
    "auto",
    "b",
    "bb",
    "s128",
    "s512",
    "b+s512",
    "bb+s512",
    "bb+s2048",
    "bb+s512+g32x4",
    "bb+s512+g32x2",
    "far1+bb+s512",
    "far1+bb+s512+g32x4",
    "tails",
    "tails+bb+s512",
    "tails+bb+s512+g32x4",
    "heads",
    "heads+far1",
]
RUN2 = [
    "auto",
    "b",
    "ps512",
    "ps1024",
    "b+ps512",
    "bb+ps512",
    "rowpar+b+ps512",
    "early+rowpar+b+ps512",
    "far1+rowpar+b+ps512",
    "far1+early+rowpar+b+ps512",
    "far1+early+rowpar+b+ps1024",
    "far1+early+rowpar+b",
    "tails+rowpar+b+ps512",
    "tails+early+rowpar+b+ps512",
    "heads+far1",
]
# Run 3: counted bounds (c), fixed rounds (f), peeled first copy steps (pl).
RUN3 = [
    "auto",
    "c",
    "c+f",
    "pl",
    "c+f+pl",
    "c+rowpar",
    "far1",
    "far1+c+f",
    "far1+c+f+pl",
    "tails",
    "tails+c",
    "tails+c+f",
    "tails+c+f+pl",
    "heads",
    "heads+pl",
    "heads+far1",
    "heads+far1+pl",
]
# Run 4: counted bounds with other probe counts, guesses and a program sample.
VARIANTS = ["auto", "c", "c+p16", "c+p64", "c+ps256", "c+ps512", "c+f+ps512", "c+g64x2",
            "c+g64x4", "c+g16x8", "far1+c", "far1+c+ps512", "tails+c", "tails+c+ps512",
            "tails+c+p64"]  # fmt: skip


explore = named_explore(variant, run_variant)


def main() -> None:
    drive(explore, VARIANTS)


if __name__ == "__main__":
    main()
