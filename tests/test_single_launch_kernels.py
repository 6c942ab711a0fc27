"""The single-launch kernels' own knobs against the references, byte for byte on poisoned
outputs: ``flat`` tiles and probes, ``segments`` group shapes, ``scan`` and ``lookback``
slice sizes (the dispatcher picks one setting of each; these cover the rest)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import triton
from _helpers import plan_case_32
from conftest import DEVICE

from kvcanary_dispatch.testing.cases import (
    POISON_I32,
    check_plan,
    check_scatter,
    make_plan_case,
    make_scatter_case,
)
from kvcanary_kernels.args import ScatterArgs, bundle_plan_args
from kvcanary_kernels.plan_lookback import LOOK_BACK_WINDOW, launch_plan_lookback
from kvcanary_kernels.plan_scan import launch_plan_scan
from kvcanary_kernels.scatter_flat import launch_scatter_flat
from kvcanary_kernels.scatter_segments import launch_scatter_segments


def _segments(reqs: int, cols: int) -> Callable[..., None]:
    """The segments launcher on upstream's four keywords, with the grid its plan gives."""

    def run(**kw) -> None:
        t = ScatterArgs(**kw)
        launch_scatter_segments(t, grid=(triton.cdiv(t.bs, reqs),), reqs=reqs, cols=cols)

    return run


def _flat(token_block: int, probes: int) -> Callable[..., None]:
    """The flat launcher on upstream's four keywords, with the grid its plan gives."""

    def run(**kw) -> None:
        t = ScatterArgs(**kw)
        grid = (triton.cdiv(t.num_tokens, token_block),)
        launch_scatter_flat(t, grid=grid, token_block=token_block, probes=probes)

    return run


def _plan_slices(launch: Callable, chunk: int, **params) -> Callable[..., None]:
    """A sliced plan launcher on the plan's flat keywords, over ``cdiv(bs, chunk)`` slices."""

    def run(**keywords) -> None:
        i, o = bundle_plan_args(keywords)
        launch(i, o, grid=(triton.cdiv(i.bs, chunk),), chunk=chunk, **params)

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


@pytest.mark.parametrize("token_block,probes", [(16, 2), (128, 32), (1024, 8)])
@pytest.mark.parametrize("seed", range(3))
def test_flat_tiles(token_block, probes, seed):
    case = _scatter_case(seed, bs=1 + 53 * seed, max_len=30 * (seed + 1), width=5 + 40 * seed)
    if case.total:
        check_scatter(_flat(token_block=token_block, probes=probes), case)


@pytest.mark.parametrize(
    "offsets",
    [[0, 9, 4, 12], [-5, 3, 3, 12], [0, 2, 40, 41], [7, 7, 1, 0]],
    ids=["decreasing", "negative_start", "past_flat_in", "reversed"],
)
def test_segments_stays_in_bounds_whatever_the_offsets(offsets):
    """Offsets that break the CSR preconditions (validate=False): ``segments`` writes only
    the addressed rows' first ``width`` columns, reading only ``flat_in``; the rest of a
    poisoned pool, and a guard row on each side, stay untouched."""
    width, rows = 6, 5
    flat_in = torch.arange(100, 112, dtype=torch.int64, device=DEVICE)
    big = torch.full((rows + 2, width), POISON_I32, dtype=torch.int32, device=DEVICE)
    pool = big[1:-1]
    rpi = torch.tensor([3, 0, 2], dtype=torch.int64, device=DEVICE)
    _segments(reqs=2, cols=4)(
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
    assert torch.equal(big, want)


def _plan_case(seed: int, bs: int):
    no_lut = {} if seed % 2 else {"lut_len": None, "swa_window_size": 0}
    verify_capacity = None if seed % 3 else 5 * bs
    return plan_case_32(bs, seed, verify_capacity=verify_capacity, device=DEVICE, **no_lut)


# More slices than one look-back window reads, so a walk back can span windows.
PLAN_SLICINGS = [(1, 1, 3 * LOOK_BACK_WINDOW + 5), (5, 8, 301), (64, 64, 1000), (256, 256, 257)]


@pytest.mark.parametrize("launch", [launch_plan_lookback, launch_plan_scan])
@pytest.mark.parametrize("chunk,bs_block,bs", PLAN_SLICINGS)
@pytest.mark.parametrize("seed", range(2))
def test_plan_slicings(launch, chunk, bs_block, bs, seed):
    check_plan(_plan_slices(launch, chunk=chunk, bs_block=bs_block), _plan_case(seed, bs))


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="look-back races show only on a GPU")
def test_lookback_stress_many_slices_huge_totals():
    """4 096 slices racing through the look-back, totals near 2**62: every repetition equal to
    the reference byte for byte (a torn or stale published word would show as a wrong offset)."""
    bs, chunk = 1 << 20, 256
    g = torch.Generator().manual_seed(5)
    for rep in range(20):
        prefix = torch.randint(0, 1 << 42, (bs,), generator=g, dtype=torch.int64)
        extend = torch.randint(0, 1 << 42, (bs,), generator=g, dtype=torch.int64)
        prefix[::3] = 0
        prefix[rep * 977 + 1] = 1 << 61  # one request alone worth 2**61
        # A seed is read only where prefix > 0 and extend > 0: keep those apart (width 1).
        extend[prefix > 0] = 0
        case = make_plan_case(
            prefix_lens=prefix,
            extend_seq_lens=extend,
            max_seq_len=1,
            verify_capacity=2**31 - 1,
            seed=rep,
            device=DEVICE,
        )
        got = check_plan(
            _plan_slices(launch_plan_lookback, chunk=chunk, bs_block=chunk, num_warps=4), case
        )
        assert int(got["out_verify_offsets"][bs]) > 1 << 61
