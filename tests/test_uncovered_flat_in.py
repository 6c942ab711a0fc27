"""Ordered offsets that do not cover ``flat_in`` exactly (``validate=False``): a first offset
past token 0, a last one short of ``len(flat_in)`` or past it, runs that start past it. The
fixed-block launcher takes them and copies only the tokens of ``flat_in`` its runs own; every
dispatcher strategy must give its bytes, read nothing outside ``flat_in`` and leave the
inputs as they were: called once, and (at 300 and 1 500 requests, against the launcher run a
block at a time) called again or replayed from a CUDA graph on inputs refilled in place; and
offsets far past the end, up to ``2**63 - 1``, into a pool that is a column window."""

from __future__ import annotations

import pytest
import torch
from _helpers import guarded_pool
from conftest import DEVICE

from kvcanary_dispatch import SCATTER_STRATEGIES, scatter_req_token_ids
from kvcanary_dispatch.testing.cases import POISON_I32, assert_bytes_equal
from kvcanary_kernels import launch_scatter_req_token_ids_kernel as fixed_block
from kvcanary_kernels.references import scatter_req_token_ids_ref

# (request lengths, tokens of flat_in before offsets[0], tokens after offsets[bs]: negative =
# offsets[bs] past the end of flat_in by that many), pool width. Runs longer than the width
# and than `rows`' 1 024-column tile, empty runs, and whole runs past flat_in's end.
_SHAPES = {
    "gap_both_ends": ([3, 0, 700, 1, 90, 0, 1200, 5], 50, 37, 1100),
    "end_short": ([4, 4, 0, 9, 2000, 1], 0, 2500, 3000),
    "end_past": ([5, 0, 30, 8, 2600, 3], 0, -1000, 2500),
    "runs_past_the_end": ([6, 7, 9, 40, 0, 12], 2, -60, 16),
    "many_short_end_past": ([1, 2, 0, 3] * 100, 5, -150, 8),
}
_CHUNKS = {"loop": 7, "sliced": 7}  # several slices, so that slices rebase over the gaps


def _case(name: str):
    lens, before, after, width = _SHAPES[name]
    g = torch.Generator().manual_seed(len(lens) + before)
    offsets = torch.tensor([0, *lens]).cumsum(0) + before
    n = int(offsets[-1]) + after
    flat_in = torch.randint(-(2**62), 2**62, (n,), generator=g, dtype=torch.int64)
    rows = len(lens) + 3
    rpi = torch.randperm(rows, generator=g)[: len(lens)]
    return flat_in.to(DEVICE), offsets.to(DEVICE), rpi.to(DEVICE), rows, width


def _run(launch, flat_in, offsets, rpi, rows, width, **kw) -> torch.Tensor:
    """``launch`` into a poisoned pool between two guard rows; returns the whole block."""
    big = guarded_pool(rows, width, DEVICE)
    launch(flat_in=flat_in, offsets=offsets, req_pool_indices=rpi, pool_out=big[1:-1], **kw)
    return big


@pytest.mark.parametrize("shape", list(_SHAPES))
@pytest.mark.parametrize("strategy", SCATTER_STRATEGIES)
def test_every_strategy_gives_the_fixed_block_bytes(strategy, shape):
    flat_in, offsets, rpi, rows, width = _case(shape)
    kept = flat_in.clone(), offsets.clone(), rpi.clone()
    want = _run(fixed_block, flat_in, offsets, rpi, rows, width)
    assert int((want != POISON_I32).sum()) > 0  # the case writes something
    got = _run(
        scatter_req_token_ids, flat_in, offsets, rpi, rows, width,
        strategy=strategy, chunk_size=_CHUNKS.get(strategy),
    )  # fmt: skip
    assert_bytes_equal(got, want, f"{strategy} on {shape}")
    for before, after in zip(kept, (flat_in, offsets, rpi), strict=True):
        assert torch.equal(before, after)


_INT64_MAX = 2**63 - 1
# Ordered offsets of 4 requests over a 10-token flat_in, far past its end
_FAR_OFFSETS = {
    "a_run_to_int64_max": [0, 4, _INT64_MAX - 3, _INT64_MAX - 2, _INT64_MAX - 1],
    "the_last_at_int64_max": [0, 4, 7, 9, _INT64_MAX],
    "all_at_int64_max": [_INT64_MAX] * 5,
    "from_near_int64_max": [_INT64_MAX - k for k in (10, 5, 1, 0, 0)],
    "past_int32": [2**31 - 2, 2**31 + 3, 2**32, 2**32 + 1, 2**33],
}


def _into_a_window(launch, flat_in, offsets, rpi, width: int, **kw) -> torch.Tensor:
    """``launch`` into columns ``[2, 2 + width)`` of rows 1-4 of a poisoned 6-row block (a
    pool whose pitch is wider than its rows); returns the whole block."""
    block = torch.full((6, width + 3), POISON_I32, dtype=torch.int32, device=DEVICE)
    launch(flat_in=flat_in, offsets=offsets, req_pool_indices=rpi,
           pool_out=block[1:-1, 2 : 2 + width], **kw)  # fmt: skip
    return block


@pytest.mark.parametrize("width", [4, 1100])
@pytest.mark.parametrize("name", list(_FAR_OFFSETS))
@pytest.mark.parametrize("strategy", SCATTER_STRATEGIES)
def test_offsets_up_to_int64_max_give_the_fixed_block_bytes(strategy, name, width):
    """Every strategy (``loop`` and ``sliced`` with 1, 3 and the default requests a slice),
    where no address or length may wrap: the launcher's bytes, inputs left as they were."""
    flat_in = torch.arange(10, dtype=torch.int64, device=DEVICE) * 7 - 30
    offsets = torch.tensor(_FAR_OFFSETS[name], dtype=torch.int64, device=DEVICE)
    rpi = torch.tensor([1, 3, 0, 2], device=DEVICE)
    kept = flat_in.clone(), offsets.clone(), rpi.clone()
    want = _into_a_window(fixed_block, flat_in, offsets, rpi, width)
    # the launcher writes where a run starts inside flat_in (its first request's, here)
    assert bool((want != POISON_I32).any()) == (_FAR_OFFSETS[name][0] < len(flat_in))
    for chunk in [None, 1, 3] if strategy in _CHUNKS else [None]:
        got = _into_a_window(scatter_req_token_ids, flat_in, offsets, rpi, width,
                             strategy=strategy, chunk_size=chunk)  # fmt: skip
        assert_bytes_equal(got, want, f"{strategy} chunk={chunk} on {name}")
    for before, after in zip(kept, (flat_in, offsets, rpi), strict=True):
        assert torch.equal(before, after)


@pytest.mark.parametrize("shape", ["gap_both_ends", "end_short"])
def test_the_fixed_block_bytes_are_the_reference(shape):
    """Where the runs lie inside ``flat_in``, the launcher the test above compares with gives
    the torch reference's bytes: the tokens outside ``[offsets[0], offsets[bs])`` are copied
    nowhere."""
    flat_in, offsets, rpi, rows, width = _case(shape)
    want = _run(scatter_req_token_ids_ref, flat_in, offsets, rpi, rows, width)
    assert_bytes_equal(_run(fixed_block, flat_in, offsets, rpi, rows, width), want, shape)


_BLOCK = 511  # requests a fixed-block launch takes (bs + 1 offsets within its 512)


def _fixed_block_slices(flat_in, offsets, rpi, pool_out) -> None:
    """The fixed-block launcher over any bs: one launch per ``_BLOCK`` requests, each given
    its requests' own offsets unrebased (it takes offsets that do not start at 0), so the
    bytes are those of one unbounded launch."""
    for s in range(0, len(rpi), _BLOCK):
        e = min(s + _BLOCK, len(rpi))
        fixed_block(flat_in=flat_in, offsets=offsets[s : e + 1], req_pool_indices=rpi[s:e],
                    pool_out=pool_out)  # fmt: skip


def _layout(bs: int, n: int, seed: int, end: str):
    """Ordered offsets over ``n`` tokens of ``flat_in`` with a gap before the first, one
    1 500-token run, and the last offset ``end`` = "short" of ``n`` or "past" it."""
    g = torch.Generator().manual_seed(seed)
    hi = n - 1500 - 40 if end == "short" else n - 1500 + 300
    offsets = torch.sort(torch.randint(1 + seed % 30, hi, (bs + 1,), generator=g)).values
    offsets[int(torch.randint(1, bs + 1, (1,), generator=g)) :] += 1500
    flat_in = torch.randint(-(2**62), 2**62, (n,), generator=g, dtype=torch.int64)
    rpi = torch.randperm(bs + 3, generator=g)[:bs]
    return flat_in.to(DEVICE), offsets.to(DEVICE), rpi.to(DEVICE)


@pytest.mark.parametrize("mode", ["eager", "graph"])
@pytest.mark.parametrize("bs", [300, 1500])
@pytest.mark.parametrize("strategy", [s for s in SCATTER_STRATEGIES if s != "loop"])
def test_refilled_inputs_with_uncovered_offsets_give_the_fixed_block_bytes(strategy, bs, mode):
    """One call made (``graph``: captured once) on offsets short of ``flat_in``'s end, then
    run again (``graph``: replayed) on inputs refilled in place with offsets short of it and
    past it (runs beyond its last token): each run gives the fixed-block launcher's bytes on
    the new inputs and leaves those inputs as they were. (``loop`` reads device offsets back,
    which a capture refuses; it is in the eager test above.)"""
    if mode == "graph" and DEVICE != "cuda":
        pytest.skip("CUDA graphs need a GPU")
    from conftest import capture_graph

    n, width = 5000, 64
    flat_in, offsets, rpi = _layout(bs, n, 0, "short")
    big = guarded_pool(bs + 3, width, DEVICE)

    def call():
        scatter_req_token_ids(
            flat_in=flat_in, offsets=offsets, req_pool_indices=rpi, pool_out=big[1:-1],
            strategy=strategy, chunk_size=_CHUNKS.get(strategy),
        )  # fmt: skip

    run = capture_graph(call).replay if mode == "graph" else call
    for seed, end in ((1, "past"), (2, "short"), (3, "past")):
        new = _layout(bs, n, seed, end)
        assert (int(new[1][-1]) > n) == (end == "past")
        for dst, src in zip((flat_in, offsets, rpi), new, strict=True):
            dst.copy_(src)
        big.fill_(POISON_I32)
        run()
        want = guarded_pool(bs + 3, width, DEVICE)
        _fixed_block_slices(*new, want[1:-1])
        assert int((want != POISON_I32).sum()) > 0
        assert_bytes_equal(big, want, f"{strategy} {mode} run {seed} ({end})")
        for kept, now in zip(new, (flat_in, offsets, rpi), strict=True):
            assert torch.equal(kept, now)
