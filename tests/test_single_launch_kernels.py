"""The single-launch scatter kernels' own knobs against the references, byte for byte on
poisoned outputs: ``capped`` heads, caps and tail tiles, ``flat`` tiles and probes,
``segments`` group shapes, ``rows`` tile widths and column programs a request (one tile a
program, or several tiles in steps); the dispatcher picks one setting of each, these cover
the rest (the plan kernels' slicings: ``test_single_launch_plans.py``)."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import pytest
import torch
import triton
from _helpers import BAD_OFFSETS, capped_launcher, guarded_pool
from conftest import DEVICE, GPU

from kvcanary_dispatch import scatter_req_token_ids
from kvcanary_dispatch.testing.cases import (
    POISON_I32,
    check_scatter,
    make_scatter_case,
    scatter_written_mask,
)
from kvcanary_kernels import launch_scatter_req_token_ids_kernel
from kvcanary_kernels.args import ScatterArgs
from kvcanary_kernels.scatter_flat import launch_scatter_flat
from kvcanary_kernels.scatter_rows import launch_scatter_rows, rows_tiles
from kvcanary_kernels.scatter_segments import bind_scatter_segments, launch_scatter_segments


def _segments(reqs: int, cols: int) -> Callable[..., None]:
    """The segments launcher on upstream's four keywords, with the grid its plan gives."""

    def run(**kw) -> None:
        t = ScatterArgs(**kw)
        launch_scatter_segments(t, grid=(triton.cdiv(t.bs, reqs),), reqs=reqs, cols=cols)

    return run


# (reqs, cols, steps, tiles, tail, tail_cols, probes, guess, guess_stride, peel, tails_first):
# caps of 1 to 512 columns; tail tiles as wide as the cap or narrower, one to 16 a program; the
# search 2- to 32-way; the guessed-owner read off or 2 to 32 offsets wide, 1 to 5 requests
# apart; each copy's first step in its loop or peeled off it; tail programs last or first.
CAPPED_SHAPES = [
    (1, 1, 1, 1, 1, 1, 2, 0, 1, 0, 1), (4, 2, 2, 4, 4, 2, 2, 2, 1, 1, 0),
    (2, 4, 1, 2, 2, 2, 4, 0, 1, 1, 1), (8, 8, 4, 16, 16, 8, 8, 8, 2, 0, 0),
    (128, 1, 32, 16, 32, 32, 32, 16, 1, 1, 0), (1, 64, 8, 1, 512, 128, 32, 0, 1, 1, 1),
    (32, 16, 2, 2, 8, 8, 2, 16, 5, 0, 1), (16, 1, 4, 4, 1, 1, 4, 4, 3, 1, 0),
    (128, 8, 4, 16, 32, 32, 32, 32, 4, 0, 1),
]  # fmt: skip


def _flat(token_block: int, probes: int) -> Callable[..., None]:
    """The flat launcher on upstream's four keywords, with the grid its plan gives."""

    def run(**kw) -> None:
        t = ScatterArgs(**kw)
        grid = (triton.cdiv(t.num_tokens, token_block),)
        launch_scatter_flat(t, grid=grid, token_block=token_block, probes=probes)

    return run


def _rows(cols: int, per_request: int | None) -> Callable[..., None]:
    """The rows launcher on upstream's four keywords over ``(bs, per_request)`` programs
    (``None``: one a column tile of the longest possible run)."""

    def run(**kw) -> None:
        t = ScatterArgs(**kw)
        c = per_request or rows_tiles(t.num_tokens, t.pool_out.shape[1], cols)
        launch_scatter_rows(t, grid=(t.bs, c), cols=cols)

    return run


def _scatter_case(seed: int, bs: int, max_len: int, width: int):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(0, max_len + 1, (bs,), generator=g)
    lens = lens * (torch.rand(bs, generator=g) < 0.8)  # empty segments too
    return make_scatter_case(lens, width=width, seed=seed, device=DEVICE)


@pytest.mark.parametrize("reqs,cols", [(1, 16), (2, 512), (4, 8), (32, 4), (256, 1)])
@pytest.mark.parametrize("seed", range(3))
def test_segments_shapes(reqs, cols, seed):
    case = _scatter_case(seed, bs=1 + 37 * seed, max_len=40 * (seed + 1), width=7 + 30 * seed)
    if case.total:
        check_scatter(_segments(reqs=reqs, cols=cols), case)


@pytest.mark.parametrize("reqs,cols", [(1, 16), (32, 4)])
def test_segments_int64_columns(reqs, cols):
    """``segments`` compiled for an int64 pool width (a width past 2**31 - 1 handed to the
    kernel; no run is wider than the real pool's 40 columns, so no bound cuts one) writes what
    the reference does. Bounds kept int32 at such a width need a run that long to show:
    ``tests/test_large_addresses.py``."""
    g = torch.Generator().manual_seed(11)
    lens = torch.randint(0, 41, (70,), generator=g)
    case = make_scatter_case(lens, width=40, seed=11, device=DEVICE)

    def run(**kw) -> None:
        t = ScatterArgs(**kw)
        wide = (*t.kernel_args()[:-1], 2**31 + 8)
        bind_scatter_segments(reqs=reqs, cols=cols)((triton.cdiv(t.bs, reqs),), wide)

    check_scatter(run, case)


@pytest.mark.parametrize("shape", CAPPED_SHAPES, ids=str)
@pytest.mark.parametrize("seed", range(3))
def test_capped_shapes(shape, seed):
    """Runs shorter and far longer than the cap, pools narrower and wider than it. In the
    interpreter, which runs one program after another, runs are at most 24 tail programs'
    tokens long (a shape whose tail programs hold one token would otherwise run thousands of
    them), and pools at most one column narrower than that, so runs still pass every cap here
    and the pool, with bs above 1 too. Seed 2 runs past the cap on a pool wider than it, so
    its tail programs have tokens to copy, on every shape."""
    names = ("reqs", "cols", "steps", "tiles", "tail", "tail_cols", "probes", "guess")
    names += ("guess_stride", "peel", "tails_first")
    kw = dict(zip(names, shape, strict=True))
    cap = kw["steps"] * kw["cols"]
    max_len = max(90 * (seed + 1), 2 * cap if seed == 2 else 0)
    if not GPU:
        max_len = min(max_len, 24 * kw["tiles"] * kw["tail"])
    width = max(7 + 80 * seed, cap + 33 if seed == 2 else 0)
    width = width if GPU else min(width, max_len - 1)
    case = _scatter_case(seed, bs=1 + 37 * seed, max_len=max_len, width=width)
    if seed == 2:  # a run past the cap, on a pool wider than it: the tails copy tokens
        assert min(int(case.offsets.diff().max()), width) > cap
    if case.total:
        check_scatter(capped_launcher(**kw), case)


@pytest.mark.parametrize("token_block,probes", [(16, 2), (128, 32), (1024, 8)])
@pytest.mark.parametrize("seed", range(3))
def test_flat_tiles(token_block, probes, seed):
    case = _scatter_case(seed, bs=1 + 53 * seed, max_len=30 * (seed + 1), width=5 + 40 * seed)
    if case.total:
        check_scatter(_flat(token_block=token_block, probes=probes), case)


@pytest.mark.parametrize("cols", [2, 16, 1024])
@pytest.mark.parametrize("per_request", [1, 2, 3, None, -3])
@pytest.mark.parametrize("seed", range(3))
def test_rows_grids(cols, per_request, seed):
    """Runs of up to 60-180 tokens in tiles of 2 to 1 024 columns, copied by one program a
    request (every tile in turn), two or three (several steps each), one a tile, or three
    more than tiles (idle); pools narrower and wider than the runs."""
    case = _scatter_case(seed, bs=1 + 13 * seed, max_len=60 * (seed + 1), width=7 + 70 * seed)
    if per_request == -3:
        per_request = rows_tiles(case.total, case.width, cols) + 3
    if case.total:
        check_scatter(_rows(cols, per_request), case)


def _count_stores(monkeypatch) -> list[int]:
    """The elements the interpreter's masked stores write from now on (a one-item list)."""
    from triton.runtime.interpreter import InterpreterBuilder

    stored, real = [0], InterpreterBuilder.create_masked_store

    def counted(self, ptrs, value, mask, *rest):
        stored[0] += int(mask.data.sum())
        return real(self, ptrs, value, mask, *rest)

    monkeypatch.setattr(InterpreterBuilder, "create_masked_store", counted)
    return stored


@pytest.mark.skipif(GPU, reason="counts the interpreter's stores")
@pytest.mark.parametrize("cols", [2, 16])
@pytest.mark.parametrize("per_request", [1, 3, None, -3])
def test_rows_writes_each_element_once(cols, per_request, monkeypatch):
    """However a request's tiles are spread over its programs, each element of its run is
    stored once: a program that copied tiles twice, or another program's, would write the same
    bytes and pass every comparison above."""
    stored = _count_stores(monkeypatch)
    case = _scatter_case(2, bs=27, max_len=180, width=147)
    if per_request == -3:
        per_request = rows_tiles(case.total, case.width, cols) + 3
    got = check_scatter(_rows(cols, per_request), case)
    assert stored[0] == int(scatter_written_mask(case).sum()) > 0, got.shape


@pytest.mark.skipif(GPU, reason="counts the interpreter's stores")
@pytest.mark.parametrize(
    "strategy,chunk", [("sliced", 4), ("loop", 4), ("capped", None), ("flat", None),
                       ("segments", None)],
)  # fmt: skip
def test_every_strategy_writes_each_element_once(strategy, chunk, monkeypatch):
    """As ``rows`` above, each single-launch strategy and the loop store each written element
    once: a program that copied another's tiles again writes the same bytes."""
    stored = _count_stores(monkeypatch)
    # Slices of ~3 000 tokens: "sliced" runs several token-tile programs a slice, some of
    # them copying more than one tile (slices are uneven).
    case = _scatter_case(3, bs=27, max_len=1500, width=1400)
    impl = partial(scatter_req_token_ids, strategy=strategy, chunk_size=chunk)
    got = check_scatter(impl, case)
    assert stored[0] == int(scatter_written_mask(case).sum()) > 0, got.shape


@BAD_OFFSETS
@pytest.mark.parametrize("tokens", [12, 13])
@pytest.mark.parametrize(
    "strategy",
    ["segments", "capped", "capped_strided_guess", "capped_peeled", "capped_tails_first"],
)
def test_stays_in_bounds_whatever_the_offsets(offsets, tokens, strategy):
    """Offsets that break the CSR preconditions (validate=False): ``segments`` and ``capped``
    write only the addressed rows' first ``width`` columns, each element the token its
    request's run puts there, reading only ``flat_in`` (12 or 13 tokens: a tail tile then
    ends inside or past it); the rest of a poisoned pool, and a guard row on each side, stay
    untouched. ``segments``, and ``capped`` below its cap (2 columns here), write every such
    element; past the cap ``capped`` may leave some out (its tail search assumes ordered
    offsets)."""
    width, rows = 6, 5
    flat_in = torch.arange(100, 100 + tokens, dtype=torch.int64, device=DEVICE)
    big = guarded_pool(rows, width, DEVICE)
    pool = big[1:-1]
    rpi = torch.tensor([3, 0, 2], dtype=torch.int64, device=DEVICE)
    shape = dict(reqs=2, cols=1, steps=2, tiles=2, tail=2, tail_cols=2, probes=2, guess=2)
    run = {
        "segments": _segments(reqs=2, cols=4),
        "capped": capped_launcher(**shape),
        "capped_strided_guess": capped_launcher(**shape, guess_stride=3),
        "capped_peeled": capped_launcher(**shape, peel=1),
        "capped_tails_first": capped_launcher(**shape, tails_first=1),
    }[strategy]
    run(
        flat_in=flat_in,
        offsets=torch.tensor(offsets, dtype=torch.int64, device=DEVICE),
        req_pool_indices=rpi,
        pool_out=pool,
    )
    want = torch.full_like(big, POISON_I32)
    for r, row in enumerate(rpi.tolist()):
        for c in range(width):
            t = offsets[r] + c
            if 0 <= t < min(offsets[r + 1], len(flat_in)):
                want[1 + row, c] = int(flat_in[t])
    if strategy.startswith("capped"):  # past the cap: the token its run puts there, or untouched
        past = torch.zeros_like(big, dtype=torch.bool)
        past[:, 2:] = True
        keep = past & (big == POISON_I32)
        want = torch.where(keep, big, want)
    assert torch.equal(big, want)


@BAD_OFFSETS
@pytest.mark.parametrize("per_request", [1, 3])
def test_rows_stays_in_bounds_whatever_the_offsets(offsets, per_request):
    """The same offsets through ``rows`` (tiles of 2 columns; one program a request, which
    copies its tiles in steps, or one a tile): it writes exactly the addressed rows' columns
    below ``min(end - start, width)`` whose token lies inside ``flat_in``, each that token (as
    the fixed-block kernel does); the rest of a poisoned pool, and a guard row on each side,
    stay untouched."""
    width, rows = 6, 5
    flat_in = torch.arange(100, 112, dtype=torch.int64, device=DEVICE)
    big = guarded_pool(rows, width, DEVICE)
    rpi = torch.tensor([3, 0, 2], dtype=torch.int64, device=DEVICE)
    _rows(2, per_request)(
        flat_in=flat_in,
        offsets=torch.tensor(offsets, dtype=torch.int64, device=DEVICE),
        req_pool_indices=rpi,
        pool_out=big[1:-1],
    )
    want = torch.full_like(big, POISON_I32)
    for r, row in enumerate(rpi.tolist()):
        for c in range(min(offsets[r + 1] - offsets[r], width)):
            t = offsets[r] + c
            if 0 <= t < len(flat_in):
                want[1 + row, c] = int(flat_in[t])
    assert torch.equal(big, want)


@pytest.mark.skipif(GPU, reason="counts the interpreter's stores")
@pytest.mark.parametrize("guess", [0, 4])
def test_capped_past_its_cap_writes_each_element_once(guess, monkeypatch):
    """``capped`` with a cap of 8 columns on runs of up to 59 tokens in a pool 50 wide: each
    element is stored once, its heads stopping at the cap where the tail tiles take over (a
    head that copied its whole run would write the same bytes twice and pass every
    comparison; auto's cap is at least as wide as the pools of the store count above)."""
    stored = _count_stores(monkeypatch)
    lens = torch.randint(0, 60, (9,), generator=torch.Generator().manual_seed(5))
    case = make_scatter_case(lens, width=50, seed=5, device=DEVICE)
    shape = dict(reqs=4, cols=4, steps=2, tiles=4, tail=8, tail_cols=4, probes=4, guess=guess)
    check_scatter(capped_launcher(**shape), case)
    assert stored[0] == int(scatter_written_mask(case).sum()) > 0


def _sentinel_views(offsets: list[int], rows: list[int], spare: int):
    """``offsets`` and ``req_pool_indices`` as views one element into tensors whose element
    before is an offset of 0 and the pool row ``spare``, which no request addresses: a read of
    ``offsets[-1]`` or ``req_pool_indices[-1]`` then writes that row (a bounds slip the
    interpreter does not report)."""
    make = partial(torch.tensor, dtype=torch.int64, device=DEVICE)
    return make([0, *offsets])[1:], make([spare, *rows])[1:]


@BAD_OFFSETS
def test_capped_unguessed_reads_nothing_before_the_batch(offsets):
    """``capped`` without guessed bounds (``guess=0``, auto's class of long runs) on the same
    offsets: its tail search reads no offset before ``offsets[0]`` and no row before
    ``req_pool_indices[0]``; the spare row, the row no request addresses and the guard rows
    stay poisoned."""
    width, rows, spare = 6, 5, 4
    big = guarded_pool(rows, width, DEVICE)
    offs, rpi = _sentinel_views(offsets, [3, 0, 2], spare)
    shape = dict(reqs=2, cols=1, steps=2, tiles=2, tail=2, tail_cols=2, probes=2, guess=0)
    flat_in = torch.arange(100, 112, dtype=torch.int64, device=DEVICE)
    run = capped_launcher(**shape)
    run(flat_in=flat_in, offsets=offs, req_pool_indices=rpi, pool_out=big[1:-1])
    for r in (0, 1 + 1, 1 + spare, rows + 1):
        assert (big[r] == POISON_I32).all(), r


def test_fixed_block_reads_nothing_before_the_batch():
    """The fixed-block scatter on tokens before ``offsets[0]`` (3 of them, ownerless): no
    owner of -1, so the row before ``req_pool_indices[0]`` (the spare) and the unaddressed row
    stay poisoned, and each run lands in its row."""
    width, rows, spare = 8, 4, 3
    big = guarded_pool(rows, width, DEVICE)
    offs, rpi = _sentinel_views([3, 6, 12], [1, 0], spare)
    flat_in = torch.arange(100, 112, dtype=torch.int64, device=DEVICE)
    launch_scatter_req_token_ids_kernel(
        flat_in=flat_in, offsets=offs, req_pool_indices=rpi, pool_out=big[1:-1]
    )
    want = torch.full_like(big, POISON_I32)
    want[1 + 1, :3] = flat_in[3:6].int()
    want[1 + 0, :6] = flat_in[6:12].int()
    assert torch.equal(big, want)
