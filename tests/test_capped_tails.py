"""``capped``'s tail programs against the reference, byte for byte on poisoned pools: runs
past the cap at ``auto``'s shapes and at shapes chosen to stress the tail tiles (one giant run
among empty ones, long runs among decodes and drafts, runs just past the cap, offsets inside
``flat_in``); and the tail tiles its guessed reads show idle, observed directly. That the
kernel refuses a one-probe search is checked where it compiles (``test_compile_sm90``)."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl
from _helpers import capped_launcher
from conftest import DEVICE, GPU

from kvcanary_dispatch.scatter_shapes import capped_shape
from kvcanary_dispatch.testing.cases import ScatterCase, check_scatter, make_scatter_case
from kvcanary_kernels.scatter_capped import _fits_between, _guess

# Shapes whose tails must work here: a small cap; the widest tail tile (512 tokens, copied 128 a
# step) with a pool and runs past it; a guessed-owner read of adjacent offsets; auto's short
# class (32 offsets 4 requests apart); a peeled tail with the tail programs first; auto's
# decode shape (peeled). auto's own tails-first shape, whose cap is 4 096 columns, has tests
# of its own below.
TAIL_SHAPES = {
    "small": dict(reqs=4, cols=4, steps=2, tiles=4, tail=8, tail_cols=4, probes=4, guess=0),
    "wide_tail": dict(
        reqs=1, cols=64, steps=8, tiles=1, tail=512, tail_cols=128, probes=32, guess=0
    ),
    "guess": dict(reqs=128, cols=1, steps=32, tiles=16, tail=32, tail_cols=32, probes=32, guess=16),
    "guess_stride": dict(capped_shape(3000, 3000 * 6, None)),  # auto's, for drafts of 4-8 tokens
    "peel_tails_first": dict(reqs=1, cols=4, steps=2, tiles=2, tail=8, tail_cols=4, probes=4,
                             guess=0, peel=1, tails_first=1),
    "peel_decodes": dict(capped_shape(3000, 3000, None)),  # auto's for decodes: one column, peeled
}  # fmt: skip


_MIXED = [9000, 0, 5000, 100, 4097, 13000, 4096]


@pytest.mark.parametrize(
    "lens,width",
    [
        (_MIXED, 8192), (_MIXED, 12288), ([9000] + [0] * 9, 9000),
        ([0] * 5 + [9000] + [0] * 4, 9000), ([0] * 9 + [9000], 9000),
        ([4097, 4100, 600, 4098], 12288),
    ],
    ids=["mixed_8192", "mixed", "giant_first", "giant_middle", "giant_last", "just_past_cap"],
)  # fmt: skip
def test_capped_auto_shape_for_runs_past_its_cap(lens, width):
    """``auto``'s shape for means past 512 on runs longer than its cap: on a pool wider than 8
    steps (9 000 or 12 288 columns), 4 head steps (a cap of 4 096 columns) with the tail
    programs first; on one 8 192 wide, 8 steps and no tail program. Runs past the pool are cut
    to it; one giant run among empty ones puts every tail tile's owner at the batch's start,
    middle or end; runs a few tokens past the cap leave one busy tail tile each."""
    case = make_scatter_case(torch.tensor(lens), width=width, seed=3, device=DEVICE)
    shape = dict(capped_shape(case.bs, case.total, width))
    assert (shape["steps"], shape["tails_first"]) == ((4, 1) if width > 8192 else (8, 0))
    check_scatter(capped_launcher(**shape), case)


@pytest.mark.parametrize("shape", TAIL_SHAPES)
def test_capped_one_giant_run_among_empty_ones(shape):
    """Every token in one run past many empty requests (the tail search lands on the last of
    the equal offsets), and the same run first and last in the batch."""
    for at in (0, 40, 99):
        lens = torch.zeros(100, dtype=torch.int64)
        lens[at] = 1500
        case = make_scatter_case(lens, width=2000, seed=at, device=DEVICE)
        check_scatter(capped_launcher(**TAIL_SHAPES[shape]), case)


@pytest.mark.parametrize("shape", TAIL_SHAPES)
def test_capped_decodes_with_a_few_long_runs(shape):
    """Decodes with a few runs far past the cap: only some tail tiles have work. Spread over the
    batch, the long runs put every tile's guessed owner far off (each tile searches); at its
    end, after 3 000 decodes, they leave the guesses over the decodes near enough to show tiles
    idle (in the interpreter, shapes without a guess take 600 decodes there)."""
    spread = torch.ones(300, dtype=torch.int64)
    spread[[7, 150, 299]] = torch.tensor([40, 900, 1300])
    at_end = torch.ones(3000 if GPU or TAIL_SHAPES[shape]["guess"] else 600, dtype=torch.int64)
    at_end[-2:] = torch.tensor([70, 45])
    for lens in (spread, at_end):
        case = make_scatter_case(lens, width=1024, seed=5, device=DEVICE)
        check_scatter(capped_launcher(**TAIL_SHAPES[shape]), case)


@pytest.mark.parametrize("shape", TAIL_SHAPES)
@pytest.mark.parametrize(
    "lens", [[5], [300], [3, 0, 40, 2], [6] * 50], ids=["bs1", "bs1_past_cap", "mixed", "drafts"]
)
def test_capped_reads_nothing_past_the_batch(shape, lens):
    """Tokens past ``offsets[bs]`` (more than the cap of them) have no owner, so tail tiles
    there search up to the batch's last request. ``offsets`` and ``req_pool_indices`` are
    views whose next element is a sentinel (an offset of 2**40; a pool row no request owns),
    so a read of ``offsets[bs + 1]`` or ``req_pool_indices[bs]`` would write the wrong row or
    token (a bounds slip the interpreter does not report). bs = 1 included."""
    base = make_scatter_case(lens, width=600, spare_rows=2, seed=1, device=DEVICE)
    spare = sorted(set(range(base.pool_rows)) - set(base.req_pool_indices.tolist()))[0]
    offsets = torch.cat([base.offsets, base.offsets.new_tensor([2**40])])[:-1]
    rows = torch.cat([base.req_pool_indices, base.req_pool_indices.new_tensor([spare])])[:-1]
    ownerless = torch.arange(1000, 1500, dtype=torch.int64, device=DEVICE)
    case = ScatterCase(
        torch.cat([base.flat_in, ownerless]), offsets, rows, base.pool_rows, base.width
    )
    check_scatter(capped_launcher(**TAIL_SHAPES[shape]), case)


@pytest.mark.parametrize("shape", [k for k, v in TAIL_SHAPES.items() if v["guess"]])
@pytest.mark.parametrize("long_at", ["start", "middle", "end"])
def test_capped_drafts_with_a_few_long_runs(shape, long_at):
    """Drafts of 4-8 tokens (where the guessed offsets bracket a tail tile's owner, or miss it
    by a few requests) with runs far past the cap placed where they throw the guess off for
    every tile after them, or for none."""
    g = torch.Generator().manual_seed(len(long_at))
    lens = torch.randint(4, 9, (2000,), generator=g)
    at = {"start": [0, 1, 2], "middle": [700, 1000, 1001], "end": [1997, 1998, 1999]}[long_at]
    lens[at] = torch.tensor([300, 1500, 45])
    case = make_scatter_case(lens, width=1600, seed=7, device=DEVICE)
    check_scatter(capped_launcher(**TAIL_SHAPES[shape]), case)


@pytest.mark.parametrize("shape", [k for k, v in TAIL_SHAPES.items() if v["guess"]])
def test_capped_drafts_with_runs_just_past_the_cap(shape):
    """Drafts of 4-8 tokens with runs of exactly the cap and one, two and the cap's own length
    past it, among them, each between empty runs: the guessed offsets around a tile inside such
    a run lie just that run apart (one or two tokens past the cap), so a tile test that took a
    run one token past the cap for one inside it would leave those columns unwritten."""
    kw = TAIL_SHAPES[shape]
    cap = kw["steps"] * kw["cols"]
    g = torch.Generator().manual_seed(3)
    lens = torch.randint(4, 9, (1500,), generator=g)
    at = torch.arange(100, 1500, 97)
    for d in (-3, -2, -1, 1, 2, 3):  # empty neighbours: offsets read 4 apart can hold one run
        lens[at + d] = 0
    lens[at] = torch.tensor([cap, cap + 1, cap + 2, 2 * cap]).repeat(len(at))[: len(at)]
    case = make_scatter_case(lens, width=2 * cap + 5, seed=11, device=DEVICE)
    check_scatter(capped_launcher(**kw), case)


@pytest.mark.parametrize("shape", TAIL_SHAPES)
def test_capped_offsets_inside_flat_in(shape):
    """Ordered offsets that start past token 0 and end before the last token (the tokens
    outside ``[offsets[0], offsets[bs])`` have no owner and are not written)."""
    base = make_scatter_case([3, 0, 700, 1, 90, 0, 1200], width=1100, seed=2, device=DEVICE)
    pad = torch.arange(-50, 0, dtype=torch.int64, device=DEVICE)
    case = ScatterCase(
        torch.cat([pad, base.flat_in, pad]), base.offsets + 50, base.req_pool_indices,
        base.pool_rows, base.width,
    )  # fmt: skip
    check_scatter(capped_launcher(**TAIL_SHAPES[shape]), case)


@triton.jit
def _idle_flags(offsets_ptr, out_ptr, num_tokens, bs, CAP: tl.constexpr, TILES: tl.constexpr,
                TAIL: tl.constexpr, GUESS: tl.constexpr, GUESS_STRIDE: tl.constexpr):  # fmt: skip
    """Per tail tile of program ``q`` (the kernel's tiles), 1 where the guessed reads alone
    show it idle, 2 where ``_fits_between`` adds it, else 0 (``[TILES]`` int8)."""
    q = tl.program_id(0).to(tl.int64)
    j = q * TILES + tl.arange(0, TILES)  # [N] int64, the tiles
    a = CAP + j * TAIL  # [N] int64, each tile's first token
    n_le, last, past, idle = _guess(
        a, offsets_ptr, num_tokens, bs, CAP, TAIL, GUESS, GUESS_STRIDE
    )  # fmt: skip
    fits = _fits_between(n_le, last, past, idle, offsets_ptr, CAP, GUESS)
    flag = tl.where(idle, 1, tl.where(fits, 2, 0)).to(tl.int8)  # [N]
    tl.store(out_ptr + j, flag)


@pytest.mark.parametrize(
    "lo,hi,near_cap", [(4, 8, 0), (1, 3, 0), (8, 16, 0), (0, 12, 0), (4, 8, 1)]
)
def test_capped_draft_tiles_idle_by_the_guessed_reads(lo, hi, near_cap):
    """The tail tiles that ``auto``'s short-class shape shows idle from its guessed reads,
    observed directly: none holds a token whose column is the cap or more (the reference's
    columns), and on drafts whose runs, ``GUESS_STRIDE`` (4) at a time, fit under the cap
    (4-8 tokens with a cap of 32, 1-3 with 32, 8-16 with 64) nearly every tile is shown idle
    without a search, most by ``_fits_between``. ``near_cap``: runs of the cap and one or two
    past it among the drafts, between empty runs, so that two guessed reads can lie just one
    run apart."""
    g = torch.Generator().manual_seed(lo * 100 + hi)
    lens = torch.randint(lo, hi + 1, (3000,), generator=g)
    if near_cap:  # drafts' cap: 32 (asserted below)
        at = torch.arange(100, 3000, 61)
        for d in (-3, -2, -1, 1, 2, 3):
            lens[at + d] = 0
        lens[at] = torch.tensor([32, 33, 34]).repeat(len(at))[: len(at)]
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lens.cumsum(0)])
    bs, n = len(lens), int(offsets[-1])
    p = dict(capped_shape(bs, n, None))
    cap, tiles, tail = p["steps"] * p["cols"], p["tiles"], p["tail"]
    assert cap == 32 or not near_cap
    programs = triton.cdiv(n - cap, tiles * tail)
    flags = torch.full((programs * tiles,), -1, dtype=torch.int8, device=DEVICE)
    _idle_flags[(programs,)](
        offsets.to(DEVICE), flags, n, bs, CAP=cap, TILES=tiles, TAIL=tail, GUESS=p["guess"],
        GUESS_STRIDE=p["guess_stride"],
    )  # fmt: skip
    flags = flags.cpu()
    assert int(flags.min()) >= 0, "a tile's flag was not written"
    # A tile's tokens at a column of the cap or more can only be its first token's owner's
    # (a later owner starts inside the tile, at columns below TAIL <= cap).
    first = cap + torch.arange(programs * tiles) * tail
    owner = (torch.searchsorted(offsets, first, right=True) - 1).clamp(0, bs - 1)
    last_own = torch.minimum(first + tail, offsets[owner + 1]).clamp(max=n) - 1  # its last token
    holds = (first < n) & (last_own - offsets[owner] >= cap)
    assert not bool((holds & (flags > 0)).any()), "an idle tile holds a column past the cap"
    if hi * p["guess_stride"] <= cap and not near_cap:
        assert float((flags > 0).float().mean()) >= 0.9, flags.bincount()
        assert int((flags == 2).sum()) > int((flags == 1).sum()), flags.bincount()
