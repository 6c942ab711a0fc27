"""Ordered offsets that do not cover ``flat_in`` exactly (``validate=False``): a first offset
past token 0, a last one short of ``len(flat_in)`` or past it, runs that start past it. The
fixed-block launcher takes them and copies only the tokens of ``flat_in`` its runs own; every
dispatcher strategy must give its bytes, read nothing outside ``flat_in`` and leave the
inputs as they were."""

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


@pytest.mark.parametrize("shape", ["gap_both_ends", "end_short"])
def test_the_fixed_block_bytes_are_the_reference(shape):
    """Where the runs lie inside ``flat_in``, the launcher the test above compares with gives
    the torch reference's bytes: the tokens outside ``[offsets[0], offsets[bs])`` are copied
    nowhere."""
    flat_in, offsets, rpi, rows, width = _case(shape)
    want = _run(scatter_req_token_ids_ref, flat_in, offsets, rpi, rows, width)
    assert_bytes_equal(_run(fixed_block, flat_in, offsets, rpi, rows, width), want, shape)
