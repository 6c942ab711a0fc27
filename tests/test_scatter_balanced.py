"""The balanced (merge-path) scatter kernel against the torch reference, byte for byte.

Every call writes into a poisoned pool that is a view of a larger poisoned buffer (guard rows
above and below, guard columns past the width, so the row stride is not the width); the
reference runs on an identical buffer and the two must agree in every byte, guards included.
Length distributions cover the benchmark's shapes (decodes, speculative decoding, uniform,
lognormal, decodes with chunked-prefill pieces, one giant run among short ones, few long
prefills, tiny batches, empty runs, runs clamped by the pool width) at interpreter-friendly
sizes on the CPU and at full size on a GPU; offsets past 2**31; and offsets that are not a CSR,
which must keep reads and writes in bounds.
"""

from __future__ import annotations

import math
import os
import tempfile
from functools import partial

import pytest
import torch
from _helpers import guarded_pool
from conftest import DEVICE
from hypothesis import given
from hypothesis import strategies as st
from test_broken_offsets import broken_offsets

from kvcanary_dispatch.testing.cases import (
    ScatterCase,
    assert_bytes_equal,
    make_scatter_case,
)
from kvcanary_dispatch.testing.scatter_inputs import check_broken_offsets_writes
from kvcanary_kernels import scatter_req_token_ids_ref
from kvcanary_kernels.args import ScatterArgs
from kvcanary_kernels.scatter_balanced import (
    balanced_items_per_program,
    balanced_probes,
    launch_scatter_balanced,
)

FULL = DEVICE == "cuda"  # full sizes on a GPU; interpreter-friendly ones on the CPU
GUARD = 3  # poisoned rows above and below the pool, and columns past its width

# Tile settings: the launcher's defaults, and others that stress every boundary.
CONFIGS = {
    "default": {},
    "tiny_tiles": dict(reqs=2, short_cols=1, chunks=2, chunk_cols=2, probes=2),
    "small_tiles": dict(reqs=4, short_cols=2, chunks=4, chunk_cols=32, probes=2),
    "gather_owner": dict(reqs=8, short_cols=4, chunks=4, chunk_cols=8, gather=True),
    "wide": dict(reqs=256, short_cols=4, chunks=4, chunk_cols=256, probes=64, gather=True),
    "narrow": dict(reqs=32, short_cols=16, chunks=32, chunk_cols=16, probes=4),
}


def _guarded_pool(rows: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The guarded block and the pool inside it."""
    big = guarded_pool(rows, width, DEVICE, spare_cols=GUARD, guard_rows=GUARD)
    return big, big[GUARD : GUARD + rows, :width]


def _check(case: ScatterCase, **kw) -> None:
    """The kernel and the reference on identical guarded pools: every byte equal."""
    got, pool = _guarded_pool(case.pool_rows, case.width)
    want, ref_pool = _guarded_pool(case.pool_rows, case.width)
    launch_scatter_balanced(case.args(pool), **kw)
    scatter_req_token_ids_ref(**case.kwargs(ref_pool))
    if not torch.equal(got, want):
        assert_bytes_equal(got, want, "pool_out with guard rows and columns")


def _lens(kind: str, seed: int) -> tuple[torch.Tensor, int]:
    """Segment lengths and a pool width for one named distribution."""
    g = torch.Generator().manual_seed(seed)
    k = 8 if FULL else 1  # size factor on a GPU
    randint = partial(torch.randint, generator=g, dtype=torch.int64)
    if kind == "decodes":
        return torch.ones(1200 * k), 4
    if kind == "spec":
        return randint(4, 9, (400 * k,)), 16
    if kind == "u128":
        return randint(0, 129, (60 * k,)), 128
    if kind == "u1024":
        return randint(0, 1025, (9 * k,)), 1024
    if kind in ("lognormal1", "lognormal2"):
        sigma = 1.0 if kind == "lognormal1" else 2.0
        x = torch.randn(50 * k, generator=g) * sigma + 3.0
        lens = x.exp().round().clamp(max=6000).to(torch.int64)
        return lens, int(lens.max()) + 1
    if kind == "decode_prefill":
        lens = torch.ones(700 * k, dtype=torch.int64)
        lens[randint(0, lens.numel(), (3,))] = randint(500, 2000, (3,))
        return lens, 2048
    if kind == "long_prefills":
        return randint(1500, 3000, (3,)) * k, 3000 * k
    if kind == "tiny":
        return randint(0, 129, (int(randint(1, 17, (1,))),)), 128
    if kind == "empties":
        return randint(0, 30, (500 * k,)) * (torch.rand(500 * k, generator=g) < 0.2), 32
    if kind == "clamped":
        return randint(0, 200, (40 * k,)), 50
    raise ValueError(kind)


KINDS = ["decodes", "spec", "u128", "u1024", "lognormal1", "lognormal2", "decode_prefill"]
KINDS += ["long_prefills", "tiny", "empties", "clamped"]


@pytest.mark.parametrize("config", ["default", "gather_owner", "small_tiles"])
@pytest.mark.parametrize("kind", KINDS)
def test_distributions(kind, config):
    lens, width = _lens(kind, seed=len(kind))
    case = make_scatter_case(lens, width=width, spare_rows=2, seed=3, device=DEVICE)
    if case.total:
        _check(case, **CONFIGS[config])


@pytest.mark.parametrize("items", [1, 2, 3, 5, 8, 131])
@pytest.mark.parametrize("config", ["default", "tiny_tiles", "gather_owner"])
def test_program_boundaries(items, config):
    """Program ranges of a few items cut every run, every request item and every empty run."""
    lens = [0, 3, 0, 0, 1, 7, 2, 0, 12, 1, 1, 0, 5]
    case = make_scatter_case(lens, width=6, spare_rows=2, seed=items, device=DEVICE)
    _check(case, items_per_program=items, **CONFIGS[config])


@given(
    lens=st.lists(st.integers(0, 40), min_size=1, max_size=30),
    width=st.integers(1, 48),
    items=st.integers(1, 300),
    config=st.sampled_from(sorted(CONFIGS)),
    seed=st.integers(0, 2**16),
)
def test_property(lens, width, items, config, seed):
    case = make_scatter_case(lens, width=width, spare_rows=1, seed=seed, device=DEVICE)
    if case.total:
        _check(case, items_per_program=items, **CONFIGS[config])


@pytest.mark.parametrize("items", [1, 3, 16, None])
def test_tokens_outside_the_runs(items):
    """Non-decreasing offsets that leave tokens before the first run and after the last one:
    those are never written."""
    case = make_scatter_case([0, 4, 9, 0, 2, 0], width=5, spare_rows=2, seed=8, device=DEVICE)
    n = case.total
    case.flat_in = torch.arange(100, 100 + n + 9, dtype=torch.int64, device=DEVICE)
    case.offsets = case.offsets + 4  # 4 unowned tokens first, 5 last
    _check(case, items_per_program=items)


def test_all_empty_but_one_token():
    case = make_scatter_case([0] * 700 + [1] + [0] * 300, width=2, seed=1, device=DEVICE)
    _check(case, items_per_program=64)


def test_many_decodes():
    """262 144 single-token decodes (2**21 on a GPU): one packed tile a group."""
    bs = 1 << (21 if FULL else 18)
    case = make_scatter_case(torch.ones(bs, dtype=torch.int64), width=2, seed=2, device=DEVICE)
    _check(case, **({} if FULL else dict(items_per_program=1 << 16, reqs=256, short_cols=4)))


def test_giant_run_among_short_ones():
    """One 65 536-token run among 4 095 short ones (U(0, 1024) on a GPU): the giant run is
    split over many programs; every program's work stays bounded."""
    g = torch.Generator().manual_seed(5)
    short = torch.randint(0, 1025 if FULL else 17, (4095,), generator=g)
    lens = torch.cat([short[:1234], torch.tensor([65536]), short[1234:]])
    case = make_scatter_case(lens, width=65536, seed=5, device=DEVICE)
    cpu = dict(items_per_program=1 << 14, reqs=256, chunks=8, chunk_cols=1024)
    _check(case, **({} if FULL else cpu))


def test_many_requests_mostly_empty():
    """A huge batch of mostly empty runs: each empty run is an item, so no program walks more
    than items_per_program + 1 requests."""
    bs = 1 << (22 if FULL else 16)
    g = torch.Generator().manual_seed(6)
    lens = torch.randint(1, 40, (bs,), generator=g) * (torch.rand(bs, generator=g) < 0.002)
    case = make_scatter_case(lens, width=64, seed=6, device=DEVICE)
    _check(case, **({} if FULL else dict(items_per_program=1 << 15, reqs=256)))


def test_offsets_past_2_31():
    """Offsets, items and token indices past 2**31 (int64 arithmetic everywhere): a 2**31-token
    run clamped to the width, then short runs read from the end of ``flat_in``, with program
    boundaries inside the first and the last run. On the CPU ``flat_in`` maps a sparse file;
    only the pages read are ever touched."""
    n = 2**31 + 40
    lens = [n - 30, 0, 5, 25]
    with tempfile.TemporaryDirectory() as tmp:
        if DEVICE == "cpu":
            path = os.path.join(tmp, "flat_in")
            with open(path, "wb") as f:
                f.truncate(n * 8)
            flat = torch.from_file(path, shared=False, size=n, dtype=torch.int64)
        else:
            flat = torch.empty(n, dtype=torch.int64, device=DEVICE)
        g = torch.Generator().manual_seed(7)
        for a, b in ((0, 100), (n - 40, n)):
            flat[a:b] = torch.randint(-(2**62), 2**62, (b - a,), generator=g).to(DEVICE)
        offsets = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device=DEVICE)
        rpi = torch.tensor([2, 0, 4, 1], device=DEVICE)
        case = ScatterCase(flat, offsets, rpi, pool_rows=6, width=64)
        # Boundaries at item (n + 4 - 14) // 2 (inside the long run) and n - 10 (the last run).
        _check(case, items_per_program=(n + 4 - 14) // 2)
        _check(case, items_per_program=2**28, **CONFIGS["gather_owner"])
        del flat, case


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("items", [1, 4, 37, None])
def test_offsets_that_are_not_a_csr_stay_in_bounds(seed, items):
    """Offsets in any order, some outside ``[0, len(flat_in)]`` (validate=False): writes land
    only in the addressed rows' first ``width`` columns, and each written value is
    ``flat_in[offsets[r] + c]`` for that row's request, read inside ``flat_in``."""
    g = torch.Generator().manual_seed(seed)
    n, bs, width, rows = 50, 12, 9, 15
    flat = torch.randint(-(2**62), 2**62, (n,), generator=g, dtype=torch.int64)
    # Many offsets near either end of flat_in, where clamping matters.
    offsets = torch.randint(-8, n + 9, (bs + 1,), generator=g, dtype=torch.int64)
    ends = torch.randint(-6, 7, (bs + 1,), generator=g) + torch.where(offsets > n // 2, n, 0)
    offsets = torch.where(torch.rand(bs + 1, generator=g) < 0.5, ends, offsets)
    rpi = torch.randperm(rows, generator=g)[:bs]
    config = CONFIGS[sorted(CONFIGS)[seed % len(CONFIGS)]]
    big, pool = _guarded_pool(rows, width)
    launch_scatter_balanced(
        ScatterArgs(flat.to(DEVICE), offsets.to(DEVICE), rpi.to(DEVICE), pool),
        items_per_program=items,
        **config,
    )
    check_broken_offsets_writes(big, rpi.tolist(), offsets.tolist(), flat, guard=GUARD, width=width)


_BELOW_2_62 = 2**62 - 1  # the kernel's promise holds for offsets of magnitude below 2**62


@given(
    offsets=broken_offsets(),
    tokens=st.integers(0, 45),
    items=st.sampled_from([1, 2, 5, None]),
    config=st.sampled_from(sorted(CONFIGS)),
    seed=st.integers(0, 2**16),
)
def test_broken_offsets_below_2_62_stay_in_bounds(offsets, tokens, items, config, seed):
    """``test_broken_offsets.py``'s corrupted CSRs and random offsets, each offset clamped to
    a magnitude below 2**62 (the range this kernel promises), on distinct random rows of a
    guarded pool: only the addressed rows' first ``width`` columns change, each to the token
    its row's request names (on the CPU the interpreter's bounds checks catch any read outside
    the launch's tensors)."""
    offsets = [max(-_BELOW_2_62, min(o, _BELOW_2_62)) for o in offsets]
    bs, width = len(offsets) - 1, 6
    rpi = torch.randperm(bs + 2, generator=torch.Generator().manual_seed(seed))[:bs]
    flat = torch.arange(100, 100 + tokens, dtype=torch.int64)
    big, pool = _guarded_pool(bs + 2, width)
    args = ScatterArgs(flat.to(DEVICE), torch.tensor(offsets).to(DEVICE), rpi.to(DEVICE), pool)
    launch_scatter_balanced(args, items_per_program=items, **CONFIGS[config])
    check_broken_offsets_writes(big, rpi.tolist(), offsets, flat, guard=GUARD, width=width)


def test_default_items_and_probes():
    for bs, tokens in [(1, 1), (8, 500), (32768, 32768), (32768, 16 << 20), (1 << 20, 1 << 24)]:
        items = balanced_items_per_program(bs, tokens)
        assert 256 <= items <= 4096
        assert items in (256, 4096) or math.ceil((bs + tokens) / items) == 1024
        probes = balanced_probes(bs)
        assert probes in (64, 128) and (probes == 128) == (bs <= 16384)


@pytest.mark.parametrize(
    "bad",
    [dict(reqs=512), dict(probes=256), dict(probes=0), dict(probes=-4), dict(items_per_program=0)],
)
def test_register_blocks_stay_below_512(bad):
    """Settings past the register blocks, and a 0 or negative count (not the default, which
    only ``None`` asks for), are refused before the launch, the pool untouched."""
    case = make_scatter_case([1, 2], width=4, device=DEVICE)
    pool = case.fresh_pool()
    before = pool.clone()
    with pytest.raises(ValueError, match="reqs <= 256 and 1 <= probes <= 128"):
        launch_scatter_balanced(case.args(pool), **bad)
    assert torch.equal(pool, before)
