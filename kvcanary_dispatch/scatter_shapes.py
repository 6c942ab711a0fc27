"""The block shapes and grids of the scatter strategies, from host-known sizes only (the
batch's request count, its token count and the pool width): what ``launch_plan`` plans each
launch with, and what ``auto``'s choice between ``"rows"`` and ``"capped"`` reads."""

from __future__ import annotations

import triton

from kvcanary_kernels._launch import MAX_GRID_Y
from kvcanary_kernels.scatter_capped import capped_tails_run
from kvcanary_kernels.scatter_flat import FLAT_TOKEN_BLOCK
from kvcanary_kernels.scatter_rows import rows_tiles

# auto takes "rows" (programs by request and column tile: two dependent loads, then copies)
# for batches of at most ROWS_MAX_BS requests whose rows_grid has at most ROWS_MAX_PROGRAMS
# programs. Every program reads its offsets and row, idle or not (about 0.6 ns each once a
# graph replay has ~1 000), and a program that copies several tiles of a long run copies them
# one after another (about 0.5 us a step). So each request gets enough column programs to keep
# the number of programs near ROWS_TARGET_PROGRAMS, but at least enough for any run to take at
# most ROWS_MAX_STEPS steps; past ROWS_MAX_PROGRAMS the batch takes "capped", whose programs'
# work is bounded whatever one run's length (benchmarks/NOTES.md, steps 11, 30 and 31). On an
# H200, graph replay (step 30): 128 x U(0,1024) on a 32 768-wide pool 6.2 us (one program a
# tile, 4 096 programs: 7.5; "capped" 6.1); 64 runs of 4 096 tokens on a 131 072-wide pool
# 6.8 (it took "capped": 9.1); 128 such runs 7.6 ("capped" 9.6); one 131 072-token run among
# 127 of 130 tokens, 4 steps, 9.7 ("capped" 9.1; 8 steps: 11.0). Step 31, bs 256 and 512 on
# the grids this rule gives "rows": at most 2.2 % slower than "capped" on decodes and U(0,1024),
# 0.67-1.00x on long runs (512 requests, half empty and half 8 192 tokens: 13.1 against 16.3); at
# bs 1 024 decodes lose 6 % (6.6 against 6.3), so larger batches take "capped".
ROWS_MAX_BS = 512
ROWS_TARGET_PROGRAMS = 2048
ROWS_MAX_STEPS = 4
ROWS_MAX_PROGRAMS = 4096
# "capped" shapes, from the mean run length and the pool width (host sizes): batches averaging
# at most CAPPED_SHORT_MEAN tokens (decodes, drafts) take narrow groups of <= 128 requests on 4
# warps, a cap of >= 32 columns and tail programs of 512 tokens; longer ones groups of <= 256
# on 2 warps, CAPPED_LONG_STEPS (8) head steps and tail programs of 4 096 tokens (the fastest of
# 16 shapes on an H200 over the distribution benchmark; one-request head tiles: below). Short
# batches' tail programs first read CAPPED_GUESS offsets, CAPPED_GUESS_STRIDE requests apart,
# around the owner equal runs would give their first token: that shows a decode batch's tiles
# idle without the search (32 768 decodes: 7.0 against 8.3 us; 262 144: 25.9 against 29.0) and
# leaves drafts of 4-8 tokens one search round (16 384 drafts: 7.2-7.3 against 8.3 us for 16
# adjacent offsets; no change on the decodes), and none where two of the offsets read around a
# tile are at most the cap apart (the kernel's _fits_between; 65 536 drafts: 9.1 against 10.3).
# Longer batches read none: it slowed u128 by 1-2 us. Head tiles one column or one request
# wide issue each copy's first step outside its loop (on an H200, graph replay: U(1024)
# 61.2 -> 57.7 us, 32 768 decodes 6.8-6.9 -> 6.5-6.7, 262 144 decodes 25.7 -> 25.2-25.3, one
# giant run 18.3 -> 17.6); wider tiles do not (drafts +0.2-0.3 us, U(0,128) +0.2).
# Head tiles one request wide (means past 512) take CAPPED_WIDE_STEPS steps, the tail programs
# first, when a run can write past 8 steps: a long run's head program, one request copying
# 1 024 columns a step, was the batch's critical path (H200, graph replay: one 65 536-token run
# among 4 095 U(0,1024) 18.0 -> 14.7 us; 256 runs of U(1024,16384) 17.0 -> 14.1; U(0,1024) and
# U(0,2048) on a 32 768-wide pool within 1 %; step 20). On pools at most 8 steps wide they keep
# 8 steps and run no tail program: 4 steps there launch tails that cost U(0,1024) 57.5 -> 63.1.
CAPPED_SHORT_MEAN = 16
CAPPED_LONG_STEPS = 8
CAPPED_WIDE_STEPS = 4
CAPPED_GUESS = 32
CAPPED_GUESS_STRIDE = 4
CAPPED_TILE = 1024  # elements of a head program's [reqs, cols] tile (at most)
SEGMENTS_TILE = 1024  # elements of a "segments" program's [reqs, cols] tile
SEGMENTS_MAX_REQS = 256  # a "segments" program's most requests (a power of two < 512)
FLAT_SHORT_TOKEN_BLOCK = 128  # "flat" tile for short segments (fewer than 8 tokens on average)


def rows_grid(bs: int, num_tokens: int, width: int) -> tuple[int, int]:
    """The "rows" grid ``(bs, C)``: ``C`` column programs a request, at most the tiles of the
    longest run a CSR over the tokens can hold (``rows_tiles``: one program a tile for small
    batches) and otherwise ``ROWS_TARGET_PROGRAMS // bs``, but enough for that run to take at
    most ``ROWS_MAX_STEPS`` tiles a program; never more than ``MAX_GRID_Y`` (CUDA's limit,
    reached only by an explicit "rows" on ~2**28 columns, whose runs then take more steps)."""
    tiles = rows_tiles(num_tokens, width)
    per_request = ROWS_TARGET_PROGRAMS // max(bs, 1)
    return (bs, min(MAX_GRID_Y, tiles, max(triton.cdiv(tiles, ROWS_MAX_STEPS), per_request)))


def capped_shape(bs: int, num_tokens: int, width: int | None) -> tuple[tuple[str, int], ...]:
    """``"capped"``'s block parameters (the launcher's keywords) from the mean run length and
    the pool ``width`` (``None``: unknown, planned as unbounded): columns the mean rounded up to
    a power of two (1 to 1024), requests filling a 1024-element tile (at most 128 for short
    runs, 256 for long), the cap and tail tiles of the class, and a peeled first copy step for
    tiles one column or one request wide. Head tiles one request wide (means past 512) take a
    cap of ``CAPPED_WIDE_STEPS`` steps and put the tail programs first, unless 8 steps cover
    every column a run can write (``min(num_tokens, width) <= 8 * 1024``: then no tail program
    runs)."""
    mean = max(1, -(-num_tokens // max(bs, 1)))
    cols = min(CAPPED_TILE, 1 << (mean - 1).bit_length())
    short = mean <= CAPPED_SHORT_MEAN
    reqs = min(128 if short else 256, CAPPED_TILE // cols)
    steps = max(4, 32 // cols) if short else CAPPED_LONG_STEPS  # cap >= 32 columns
    pool = num_tokens if width is None else width
    wide = reqs == 1 and capped_tails_run(num_tokens, pool, steps * cols)  # one-request tiles
    steps = CAPPED_WIDE_STEPS if wide else steps
    per_tail = 512 if short else 4096  # tokens a tail program covers
    tail = min(steps * cols, per_tail)
    tiles = per_tail // tail
    tail_cols = min(tail, CAPPED_TILE // tiles)
    return (
        ("reqs", reqs), ("cols", cols), ("steps", steps), ("tiles", tiles), ("tail", tail),
        ("tail_cols", tail_cols), ("guess", CAPPED_GUESS if short else 0),
        ("guess_stride", CAPPED_GUESS_STRIDE if short else 1), ("peel", int(1 in (reqs, cols))),
        ("tails_first", int(wide)), ("num_warps", 4 if short else 2),
    )  # fmt: skip


def segments_shape(bs: int, num_tokens: int) -> tuple[int, int]:
    """``"segments"``' (requests, columns) per program: columns the mean segment length
    rounded up to a power of two (4 to 1024), requests filling a 1024-element tile."""
    mean = -(-num_tokens // max(bs, 1))
    cols = min(SEGMENTS_TILE, max(4, 1 << (mean - 1).bit_length()))
    return min(SEGMENTS_MAX_REQS, SEGMENTS_TILE // cols), cols


def flat_token_block(bs: int, num_tokens: int) -> int:
    """``"flat"``'s tokens per program: short segments (a program spans many requests) search
    faster in small tiles; long ones amortise the search over large tiles."""
    return FLAT_SHORT_TOKEN_BLOCK if num_tokens < 8 * bs else FLAT_TOKEN_BLOCK
