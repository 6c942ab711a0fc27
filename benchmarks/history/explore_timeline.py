"""Steps 23-24 of benchmarks/NOTES.md: where a ``capped`` program's time goes, phase by phase.

Steps 21-22 left decodes with prefill pieces at ~1.9x floor + L0 and found that fewer or
cheaper search rounds do not move their tail programs. ``_stamped`` below is the library
kernel (``kvcanary_kernels.scatter_capped``: the same helpers, in the same order) with
time stamps between its phases, each read once the phase's loaded values are in registers
(the stamp takes a value derived from them as an input):

- every program: the global timer (ns, shared by all SMs) at its start and end, its SM;
- a head program: the SM's cycle counter at its start, once its rows and offsets are read,
  and once its copy's stores are issued;
- a tail program: the cycle counter at its start, after the guessed read, after the search
  (and its number of rounds), after its owners' offsets, after their rows, and once its
  copy's stores are issued; and how many of its tiles copy anything.

A stamp adds a reduction and a scalar store (``STAMP = 0`` compiles none of them; ``WORK = 0``:
the grid with no program's work, for timing). ``OLD = 1`` runs step 22's guess and search
rounds (``_guess_div``, ``_narrow_div``: an int64 division a tile, and probes
``w * p // (PROBES + 1)`` apart) in place of the library's. ``FITS = 1`` adds a short-run
idle test: a tile whose guessed reads on either side of its first token are at most ``CAP``
apart is idle (its owner's run lies between them), the two values read again by their
indices. (Step 23's run 5 took them by reductions over the reads instead, as the library of
401f900 did, in this file as of that commit. Since step 42 the library kernel has this test
too, as ``_fits_between`` before ``_guessed_bounds``: here ``FITS = 0`` is the kernel before
that step.) ``ENDS = 1``: when a tile still needs two or
more rounds, one search of two tiles finds the owners of the first and last tiles left, which
bound every such tile's search (``_by_ends``; ``2 x PROBES`` offsets a round, not
``TILES x PROBES``). ``SAMPLE = S`` (a power of two): ``S`` offsets evenly spaced over the
batch, read once a program beside the guess (the two reads in flight together), bound each
tile's search to ``bs / S`` requests before its rounds (``_sampled``); with ``ENDS = 1`` as
well, the read is compared with the program's first and last tiles' first tokens only, one
pair of bounds for every tile (``_sampled_ends``). Per batch the
library's ``auto``,
then each tail code of ``KINDS``, unstamped and stamped, are graph-replay timed twice,
alternating; then each kind's stamps over ``--launches`` eager launches (L2-warm), with
``--tiles`` also the library's rounds at other tail tile counts a program (short class).
``python -m benchmarks.history.explore_timeline [--dists ...] [--launches N] [--tiles T ...]``
prints, per kind of program, the median and maximum of each phase (cycles, and ns at the SM
clock the stamps measure) and of start and end (ns after the first program's start), then
the program that ended last. Step 23's runs had earlier forms of this file: run 1 without
``OLD``, runs 1-3 without ``WORK``, runs 1-4 without ``FITS`` (their "now" is the library),
run 5 with that commit's reduction form as its "now"; runs 3-5 printed as ``programs=`` the
largest grid of ``--tiles``, not the library's. Step 24's run 1 had ``KINDS`` with
``FITS`` + ``ENDS`` and without ``SAMPLE``, in this file as of ced0188; run 2 had step 22's,
``ENDS`` and 512 a tile in ``KINDS``, not the per-program samples; runs 1-2 did not print
the last program's end a launch.
"""

from __future__ import annotations

import argparse
from functools import partial

import torch
import triton
import triton.language as tl

from benchmarks.distributions import WIDTH, _check_pool, _dist
from kvcanary_dispatch import scatter_req_token_ids
from kvcanary_dispatch.cli.timing import graph_time_us
from kvcanary_dispatch.launch_plan import capped_shape
from kvcanary_dispatch.testing.cases import make_scatter_case
from kvcanary_kernels import scatter_req_token_ids_ref
from kvcanary_kernels.scatter_capped import (
    CAPPED_PROBES,
    _copy_columns,
    _guess,
    _guess_at,
    _guessed_bounds,
    _narrow,
    _role,
    capped_grid,
)

N_STAMPS = 12  # int64 words a program: see FIELDS
STAMPS: tl.constexpr = tl.constexpr(N_STAMPS)
FIELDS = ("gt_start", "clk_start", "clk_read", "clk_search", "clk_owner", "clk_row",
          "clk_copy", "gt_end", "sm", "kind", "rounds", "busy")  # fmt: skip
HEAD, TAIL = 1, 2  # FIELDS' "kind"
# The tail code compared: step 22's rounds; the library's; the library's with a short-run
# idle test from the two bracketing offsets read again (no reduction), with one search of the
# first and last tiles' owners (step 24's run 1 timed these with step 22's and with both), with
# 256 offsets evenly spaced over the batch read beside the guess, per tile, and with 256 or
# 1 024 bounding the program's first and last tiles' owners (step 24's run 2 timed 512 per tile
# and ENDS alone).
KINDS = {"library": {}, "fits by two reads": {"fits": 1}, "sample 256": {"sample": 256},
         "program sample 256": {"sample": 256, "ends": 1},
         "program sample 1024": {"sample": 1024, "ends": 1}}  # fmt: skip


@triton.jit
def _dep(x):
    """An int64 scalar that is 0 unless ``x`` (``[N]``) holds -7777, known only once ``x``
    is: a stamp that adds it is read after ``x`` arrives."""
    return tl.where(tl.min(x.to(tl.int64), axis=0) == -7777, 1, 0).to(tl.int64)


@triton.jit
def _stamp(st, k: tl.constexpr, x, STAMP: tl.constexpr):
    """With ``STAMP``, word ``k`` of ``st``: the cycle counter once ``x`` (``[N]``, or
    ``None``: in program order) is known."""
    if STAMP:
        if x is None:
            tl.store(st + k, _clock(tl.program_id(0).to(tl.int64) * 0))
        else:
            tl.store(st + k, _clock(_dep(x)))


@triton.jit
def _put(st, k: tl.constexpr, v, STAMP: tl.constexpr):
    if STAMP:
        tl.store(st + k, v)


@triton.jit
def _sreg(dep, ASM: tl.constexpr):
    """``ASM`` (PTX that sets ``$0`` from a special register, plus ``$1``) on ``dep``: a read
    that cannot move above what ``dep`` waits for."""
    return tl.inline_asm_elementwise(ASM, "=l,l", [dep], dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def _clock(dep):
    """The SM's cycle counter plus ``dep``."""
    return _sreg(dep, "{ .reg .u64 t; mov.u64 t, %clock64; add.u64 $0, t, $1; }")


@triton.jit
def _gtime(dep):
    """The global timer (ns) plus ``dep``."""
    return _sreg(dep, "{ .reg .u64 t; mov.u64 t, %globaltimer; add.u64 $0, t, $1; }")


@triton.jit
def _smid(dep):
    """The SM's number plus ``dep``."""
    return _sreg(dep, "{ .reg .u32 t; mov.u32 t, %smid; cvt.u64.u32 $0, t; add.u64 $0, $0, $1; }")


@triton.jit
def _head_s(g, st, flat_in_ptr, offsets_ptr, req_pool_indices_ptr, pool_out_ptr, num_tokens,
            bs, pool_stride0, max_context_len, REQS: tl.constexpr, COLS: tl.constexpr,
            CAP: tl.constexpr, PEEL: tl.constexpr, STAMP: tl.constexpr):  # fmt: skip
    """``_head``'s body, stamped (``st``: the program's ``[STAMPS]`` int64 words)."""
    r = g * REQS + tl.arange(0, REQS)  # [R] int64
    in_batch = r < bs
    row = tl.load(req_pool_indices_ptr + r, mask=in_batch, other=0)  # [R] int64
    start = tl.load(offsets_ptr + r, mask=in_batch, other=0)  # [R] int64
    end = tl.load(offsets_ptr + r + 1, mask=in_batch, other=0)  # [R] int64
    _stamp(st, 2, row + start + end, STAMP)
    lo = tl.minimum(tl.maximum(-start, 0), CAP).to(tl.int32)
    hi = tl.minimum(tl.minimum(end, num_tokens) - start, tl.minimum(max_context_len, CAP))
    hi = tl.maximum(hi, 0).to(tl.int32)
    _copy_columns(flat_in_ptr + start, pool_out_ptr + row * pool_stride0, lo, hi, COLS, PEEL)
    _stamp(st, 6, None, STAMP)
    _put(st, 9, 1, STAMP)


@triton.jit
def _tail_s(q, st, flat_in_ptr, offsets_ptr, req_pool_indices_ptr, pool_out_ptr, num_tokens,
            bs, pool_stride0, max_context_len, CAP: tl.constexpr, TILES: tl.constexpr,
            TAIL: tl.constexpr, TAIL_COLS: tl.constexpr, PROBES: tl.constexpr,
            GUESS: tl.constexpr, GUESS_STRIDE: tl.constexpr, PEEL: tl.constexpr,
            STAMP: tl.constexpr, OLD: tl.constexpr, FITS: tl.constexpr,
            ENDS: tl.constexpr, SAMPLE: tl.constexpr):  # fmt: skip
    """``_tail``'s body, stamped; ``OLD``: step 22's guess and search rounds; ``FITS``: a
    short-run idle test from the two bracketing offsets read again; ``ENDS``: one search for
    the owners of the first and last tiles left to search bounds every tile's; ``SAMPLE``:
    that many offsets evenly spaced over the batch, read beside the guess, bound each tile's
    search (``_sampled``; with ``ENDS``, one pair of bounds for all: ``_sampled_ends``)."""
    zero = q * 0
    a = CAP + (q * TILES + tl.arange(0, TILES)) * TAIL  # [N] int64
    lo = a * 0
    hi = lo + bs
    idle = lo != 0
    if GUESS > 0:
        if OLD:
            n_le, last, past, idle = _guess_div(
                a, offsets_ptr, num_tokens, bs, CAP, TAIL, GUESS, GUESS_STRIDE
            )  # fmt: skip
        else:
            n_le, last, past, idle = _guess(
                a, offsets_ptr, num_tokens, bs, CAP, TAIL, GUESS, GUESS_STRIDE
            )  # fmt: skip
        lo, hi = _guessed_bounds(n_le, last, past, idle, bs, GUESS)
        if FITS and not OLD:  # the two bracketing reads' values read again (L1), no reduction
            near = (n_le > 0) & (n_le < GUESS) & ~idle  # [N]: bracketed by two reads
            v_le = tl.load(offsets_ptr + last, mask=near, other=0)  # [N] int64
            v_gt = tl.load(offsets_ptr + past, mask=near, other=CAP + 1)  # [N] int64
            idle = idle | (near & (v_gt - v_le <= CAP))
            hi = tl.where(idle, lo, hi)
    if SAMPLE > 0 and ENDS:
        a0 = CAP + q * TILES * TAIL  # int64: the first tile's first token
        lo, hi = _sampled_ends(lo, hi, a0, a0 + (TILES - 1) * TAIL, offsets_ptr, bs, SAMPLE)
    elif SAMPLE > 0:
        lo, hi = _sampled(lo, hi, a, offsets_ptr, bs, SAMPLE)
    elif ENDS and not OLD:
        lo, hi = _by_ends(lo, hi, a, offsets_ptr, bs, PROBES)
    _stamp(st, 2, hi, STAMP)
    rounds = zero
    while tl.max(hi - lo, axis=0) > 1:
        if OLD:
            lo, hi = _narrow_div(lo, hi, a, offsets_ptr, PROBES)
        else:
            lo, hi = _narrow(lo, hi, a, offsets_ptr, PROBES)
        rounds += 1
    _stamp(st, 3, lo, STAMP)
    start = tl.load(offsets_ptr + lo, mask=~idle, other=0)  # [N] int64
    end = tl.load(offsets_ptr + lo + 1, mask=~idle, other=0)  # [N] int64
    _stamp(st, 4, start + end, STAMP)
    t0 = tl.maximum(a, start + CAP)
    t1 = tl.minimum(tl.minimum(a + TAIL, end), tl.minimum(num_tokens, start + max_context_len))
    busy = (t1 > t0) & ~idle  # [N]
    row = tl.load(req_pool_indices_ptr + lo, mask=busy, other=0)  # [N] int64
    _stamp(st, 5, row, STAMP)
    dst = pool_out_ptr + row * pool_stride0 + (a - start)
    lo_c = (t0 - a).to(tl.int32)
    hi_c = tl.where(busy, t1 - a, 0).to(tl.int32)
    _copy_columns(flat_in_ptr + a, dst, lo_c, hi_c, TAIL_COLS, PEEL)
    _stamp(st, 6, None, STAMP)
    _put(st, 9, 2, STAMP)
    _put(st, 10, rounds, STAMP)
    _put(st, 11, tl.sum(busy.to(tl.int64), axis=0), STAMP)


@triton.jit
def _by_ends(lo, hi, a, offsets_ptr, bs, PROBES: tl.constexpr):
    """When some tile still needs two or more rounds: the owners of the first and last tiles
    left to search (``[N]`` bounds ``lo``, ``hi``; first tokens ``a``), found by one search of
    two tiles (``2 x PROBES`` offsets a round, not ``N x PROBES``), bound every such tile's:
    with non-decreasing offsets their owners lie between. Whatever the offsets, the bounds stay
    in ``[0, bs]`` with ``lo <= hi``."""
    left = hi - lo > 1  # [N]: tiles left to search
    if tl.max(hi - lo, axis=0) > PROBES:
        e = tl.arange(0, 2)  # [2]: the first and the last tile left
        a_first = tl.min(tl.where(left, a, a + (1 << 62)), axis=0)  # int64
        a_last = tl.max(tl.where(left, a, -1), axis=0)  # int64
        ea = tl.where(e == 0, a_first, a_last)  # [2] int64
        elo = ea * 0  # [2] int64
        ehi = elo + bs
        while tl.max(ehi - elo, axis=0) > 1:
            elo, ehi = _narrow(elo, ehi, ea, offsets_ptr, PROBES)
        o_first = tl.min(elo, axis=0)  # int64: the first tile's owner
        o_last = tl.max(elo, axis=0)  # int64: the last tile's owner
        lo = tl.where(left, tl.maximum(lo, o_first), lo)
        hi = tl.where(left, tl.maximum(tl.minimum(hi, o_last + 1), lo), hi)
    return lo, hi


@triton.jit
def _sample(offsets_ptr, bs, SAMPLE: tl.constexpr):
    """``SAMPLE`` offsets (a power of two) at ``j_p = p * bs // SAMPLE``, ``p < SAMPLE``: one
    ``[S]`` int64 read a program, independent of the guess, so both are in flight at once."""
    j = tl.arange(0, SAMPLE).to(tl.int64) * bs // SAMPLE  # [S] int64, in [0, bs)
    return tl.load(offsets_ptr + j)


@triton.jit
def _sample_bounds(lo, hi, m_lo, m_hi, bs, SAMPLE: tl.constexpr):
    """``[lo, hi)`` (``[N]`` int64) intersected with ``[j_(m_lo - 1), j_(m_hi))`` (counts of
    ``_sample``'s offsets at or before a token, at least 1 each; ``j_SAMPLE = bs``). Whatever
    the offsets, the bounds stay in ``[0, bs]`` with ``lo <= hi``."""
    new_lo = tl.maximum(lo, (m_lo - 1) * bs // SAMPLE)
    return new_lo, tl.maximum(tl.minimum(hi, m_hi * bs // SAMPLE), new_lo)


@triton.jit
def _sampled(lo, hi, a, offsets_ptr, bs, SAMPLE: tl.constexpr):
    """``_sample``'s read bounds each tile's search: with ``m`` of its offsets at or before a
    tile's first token ``a`` (at least 1), its owner lies in ``[j_(m-1), j_m)`` (the empty
    ``[0, 0)`` where ``offsets[0] > a`` and ``SAMPLE > bs``, with ``lo = 0`` its owner)."""
    seen = _sample(offsets_ptr, bs, SAMPLE)  # [S] int64
    n_le = tl.sum((seen[None, :] <= a[:, None]).to(tl.int32), axis=1)  # [N] int32
    m = tl.maximum(n_le, 1).to(tl.int64)  # [N]; 0 only where offsets[0] > a
    return _sample_bounds(lo, hi, m, m, bs, SAMPLE)


@triton.jit
def _sampled_ends(lo, hi, a0, a1, offsets_ptr, bs, SAMPLE: tl.constexpr):
    """``_sample``'s read, compared with the program's first and last tiles' first tokens
    only (``a0 <= a1``, int64): with non-decreasing offsets every tile's owner lies between
    theirs, so one pair of bounds serves every tile. One int32 sum counts both (``SAMPLE``
    below 2**15)."""
    tl.static_assert(SAMPLE < 32768, "both counts share one int32 sum")
    seen = _sample(offsets_ptr, bs, SAMPLE)  # [S] int64
    both = tl.sum((seen <= a0).to(tl.int32) + ((seen <= a1).to(tl.int32) << 16), axis=0)
    m0 = tl.maximum(both & 0xFFFF, 1).to(tl.int64)
    m1 = tl.maximum(both >> 16, 1).to(tl.int64)
    return _sample_bounds(lo, hi, m0, m1, bs, SAMPLE)


@triton.jit
def _guess_div(a, offsets_ptr, num_tokens, bs, CAP: tl.constexpr, TAIL: tl.constexpr,
               GUESS: tl.constexpr, GUESS_STRIDE: tl.constexpr):  # fmt: skip
    """Step 22's ``_guess``: the guess by an int64 division a tile."""
    k = a * bs // tl.maximum(num_tokens, 1) - (GUESS // 2) * GUESS_STRIDE  # [N] int64
    return _guess_at(k, a, offsets_ptr, bs, CAP, TAIL, GUESS, GUESS_STRIDE)


@triton.jit
def _narrow_div(lo, hi, a, offsets_ptr, PROBES: tl.constexpr):
    """Step 22's ``_narrow``: ``PROBES`` probes ``w * p // (PROBES + 1)`` apart (int64
    divisions by a constant that is not a power of two)."""
    w = hi - lo  # [N] int64
    p = tl.arange(1, PROBES + 1)  # [P] int32
    probe = lo[:, None] + w[:, None] * p[None, :] // (PROBES + 1)  # [N, P] int64
    n_le = tl.sum((tl.load(offsets_ptr + probe) <= a[:, None]).to(tl.int32), axis=1)  # [N]
    return lo + w * n_le // (PROBES + 1), lo + w * (n_le + 1) // (PROBES + 1)


@triton.jit(do_not_specialize=["num_tokens", "bs", "pool_stride0", "max_context_len"])
def _stamped(
    flat_in_ptr, offsets_ptr, req_pool_indices_ptr, pool_out_ptr, stamps_ptr,
    num_tokens, bs, pool_stride0, max_context_len,
    REQS: tl.constexpr, COLS: tl.constexpr, STEPS: tl.constexpr, TILES: tl.constexpr,
    TAIL: tl.constexpr, TAIL_COLS: tl.constexpr, PROBES: tl.constexpr, GUESS: tl.constexpr,
    GUESS_STRIDE: tl.constexpr, PEEL: tl.constexpr, TAILS_FIRST: tl.constexpr,
    STAMP: tl.constexpr, OLD: tl.constexpr, WORK: tl.constexpr, FITS: tl.constexpr,
    ENDS: tl.constexpr, SAMPLE: tl.constexpr,
):  # fmt: skip
    zero = tl.program_id(0).to(tl.int64) * 0
    st = stamps_ptr + tl.program_id(0).to(tl.int64) * STAMPS  # [STAMPS] int64 words: FIELDS
    if STAMP:
        tl.store(st + 0, _gtime(zero))
        tl.store(st + 1, _clock(zero))
        tl.store(st + 8, _smid(zero))
    is_head, head_id, tail_id = _role(bs, REQS, TAILS_FIRST)
    if not WORK:  # timing only: the grid and the stamps, no program's work
        pass
    elif is_head:
        _head_s(head_id, st, flat_in_ptr, offsets_ptr, req_pool_indices_ptr, pool_out_ptr,
                num_tokens, bs, pool_stride0, max_context_len, REQS, COLS, STEPS * COLS,
                PEEL, STAMP)  # fmt: skip
    else:
        _tail_s(tail_id, st, flat_in_ptr, offsets_ptr, req_pool_indices_ptr, pool_out_ptr,
                num_tokens, bs, pool_stride0, max_context_len, STEPS * COLS, TILES, TAIL,
                TAIL_COLS, PROBES, GUESS, GUESS_STRIDE, PEEL, STAMP, OLD, FITS, ENDS,
                SAMPLE)  # fmt: skip
    if STAMP:
        tl.store(st + 7, _gtime(zero))


def launch_stamped(p: dict, stamps: torch.Tensor, flat_in, offsets, req_pool_indices, pool_out,
                   stamp: int = 1, old: int = 0, work: int = 1, fits: int = 0,
                   ends: int = 0, sample: int = 0) -> None:  # fmt: skip
    bs, n, width = req_pool_indices.numel(), flat_in.numel(), pool_out.shape[1]
    _stamped[capped_grid(bs, n, width, p)](
        flat_in, offsets, req_pool_indices, pool_out, stamps, n, bs, pool_out.stride(0), width,
        REQS=p["reqs"], COLS=p["cols"], STEPS=p["steps"], TILES=p["tiles"], TAIL=p["tail"],
        TAIL_COLS=p["tail_cols"], PROBES=p.get("probes", CAPPED_PROBES), GUESS=p["guess"],
        GUESS_STRIDE=p["guess_stride"], PEEL=p["peel"], TAILS_FIRST=p["tails_first"],
        STAMP=stamp, OLD=old, WORK=work, FITS=fits, ENDS=ends, SAMPLE=sample,
        num_warps=p["num_warps"],
    )  # fmt: skip


def _stats(x: torch.Tensor) -> str:
    x = x.double()
    return f"{x.median().item():7.0f} {x.max().item():7.0f}" if x.numel() else "      -       -"


def report(runs: list[torch.Tensor]) -> None:
    """Phase statistics over every program of every launch (``runs``: ``[programs, STAMPS]``
    int64 each)."""
    f = {k: i for i, k in enumerate(FIELDS)}
    rows = []
    for s in runs:
        s = s.clone()
        s[:, f["gt_end"]] -= s[:, f["gt_start"]].min()
        s[:, f["gt_start"]] -= s[:, f["gt_start"]].min()
        rows.append(s)
    s = torch.cat(rows)
    span = (s[:, f["gt_end"]] - s[:, f["gt_start"]]).double()
    cyc = (s[:, f["clk_copy"]] - s[:, f["clk_start"]]).double()
    long = span > 1500
    ghz = (cyc[long] / span[long]).median().item() if bool(long.any()) else float("nan")
    print(f"  SM clock from the stamps: {ghz:.2f} GHz; global timer steps seen: "
          f"{sorted(set(torch.diff(s[:, f['gt_start']].sort().values).tolist()))[:6]}")  # fmt: skip
    print(f"  {'phase':28s} {'median':>7s} {'max':>7s}   (cycles, then ns at that clock)")
    for kind, label in ((HEAD, "head"), (TAIL, "tail, busy"), (TAIL, "tail, idle")):
        k = s[s[:, f["kind"]] == kind]
        if label != "head":
            k = k[(k[:, f["busy"]] > 0) == (label == "tail, busy")]
        n = k.shape[0] // max(len(runs), 1)
        print(f"  -- {label}: {n} programs a launch; rounds {_stats(k[:, f['rounds']])}")
        print(f"  {'start (ns after first)':28s} {_stats(k[:, f['gt_start']])}")
        print(f"  {'end (ns after first start)':28s} {_stats(k[:, f['gt_end']])}")
        steps = (("read", "clk_start", "clk_read"), ("copy", "clk_read", "clk_copy"))
        if kind == TAIL:
            steps = (("guess", "clk_start", "clk_read"), ("search", "clk_read", "clk_search"),
                     ("owner offsets", "clk_search", "clk_owner"), ("row", "clk_owner", "clk_row"),
                     ("copy issued", "clk_row", "clk_copy"))  # fmt: skip
        for phase, p0, p1 in steps + (("whole", "clk_start", "clk_copy"),):
            d = (k[:, f[p1]] - k[:, f[p0]]).double()
            print(f"  {phase:28s} {_stats(d)}  {_stats(d / ghz)}")
    ends = torch.stack([r[:, f["gt_end"]].max() for r in rows]).double()
    print(f"  last program's end, a launch (ns after its first start): median "
          f"{ends.median().item():.0f}, max {ends.max().item():.0f}")  # fmt: skip
    last = s[s[:, f["gt_end"]].argmax()]
    print(
        "  last to end: "
        + ", ".join(f"{k}={int(v)}" for k, v in zip(FIELDS, last.tolist(), strict=True))
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dists", nargs="+", default=["decode_prefill_8192", "spec_16384",
                                                    "ones_32768", "u128_32768"])  # fmt: skip
    ap.add_argument("--launches", type=int, default=20)
    ap.add_argument("--tiles", type=int, nargs="*", default=[],
                    help="also these tail tiles a program (short class)")  # fmt: skip
    args = ap.parse_args()
    dev = torch.device("cuda")
    for name in args.dists:
        lens = _dist(name, False, torch.Generator().manual_seed(len(name)))
        width = max(WIDTH, -(-int(lens.max()) // 1024) * 1024)
        case = make_scatter_case(lens, width=width, seed=1, device=dev)
        p = dict(capped_shape(case.bs, case.total, width))
        programs = capped_grid(case.bs, case.total, width, p)[0]
        for tiles in args.tiles if p["guess"] else ():  # the short class only
            programs = max(
                programs, capped_grid(case.bs, case.total, width, {**p, "tiles": tiles})[0]
            )
        stamps = torch.zeros(programs, N_STAMPS, dtype=torch.int64, device=dev)
        pool, want = case.fresh_pool(), case.fresh_pool()
        scatter_req_token_ids_ref(**case.kwargs(want))
        grid = capped_grid(case.bs, case.total, width, p)[0]
        print(f"== {name} bs={case.bs} tokens={case.total} shape={p} programs={grid}")
        times = {"lib auto": partial(scatter_req_token_ids)}
        for label, kw in KINDS.items():
            for stamp in (0, 1):
                run = partial(launch_stamped, p, stamps, stamp=stamp, **kw)
                times[f"{label}{', stamped' if stamp else ''}"] = run
        for _ in range(2):  # twice, alternating, for the noise
            for label, run in times.items():
                _check_pool(case, pool, want, run)
                us = graph_time_us(partial(run, **case.kwargs(pool)), dev)
                print(f"  graph replay {us:6.1f} us  {label}", flush=True)
        shapes = [(label, p, kw) for label, kw in KINDS.items()]
        shapes += [(f"now, {t} tiles a tail program", {**p, "tiles": t}, {}) for t in args.tiles]
        for label, q, kw in shapes if p["guess"] else shapes[: len(KINDS)]:
            runs = []
            for _ in range(args.launches):
                stamps.fill_(0)
                launch_stamped(q, stamps, **case.kwargs(pool), **kw)
                torch.cuda.synchronize(dev)
                runs.append(stamps[: capped_grid(case.bs, case.total, width, q)[0]].cpu())
            if q is not p:
                _check_pool(case, pool, want, partial(launch_stamped, q, stamps, stamp=0))
                us = graph_time_us(
                    partial(launch_stamped, q, stamps, **case.kwargs(pool), stamp=0), dev
                )
                print(f"  graph replay {us:6.1f} us  {label}, unstamped", flush=True)
            us = graph_time_us(
                partial(launch_stamped, q, stamps, **case.kwargs(pool), stamp=0, work=0), dev
            )
            print(f"  graph replay {us:6.1f} us  {label}: its grid doing nothing", flush=True)
            print(f"  -- timeline, {label}")
            report(runs)


if __name__ == "__main__":
    main()
