"""The benchmarks' floors (``cli.timing``), against byte-by-byte counts made here: the scatter's
reads at their element sizes and its writes as the 32-byte sectors each run covers at its
row's address; the plan's bytes a request, a sector a seed, and the LUT's distinct sectors."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvcanary_dispatch.cli.timing import (
    SECTOR,
    floor_us,
    plan_floor_bytes,
    scatter_sector_bytes,
    scatter_token_bytes,
)
from kvcanary_dispatch.testing.cases import ScatterCase, make_plan_case, make_scatter_case


def _run_sectors(pool: torch.Tensor, row: int, n: int) -> int:
    """Sectors covered by ``n`` elements written from column 0 of ``pool``'s row ``row``,
    counted element by element."""
    size = pool.element_size()
    first = pool.data_ptr() + row * pool.stride(0) * size
    return len({(first + c * size + b) // SECTOR for c in range(n) for b in range(size)})


def _pool(rows: int, width: int, pitch: int, shift: int) -> torch.Tensor:
    """A ``[rows, width]`` int32 pool with row stride ``pitch``, ``shift`` elements into its
    storage (moving every row's alignment to the 32-byte sectors)."""
    store = torch.empty(rows * pitch + shift, dtype=torch.int32)
    return store[shift:].as_strided((rows, width), (pitch, 1))


@pytest.mark.parametrize("shift", [0, 1, 3, 7])
@pytest.mark.parametrize("pitch", [16, 20, 37])
def test_scatter_floor_counts_the_sectors_each_run_covers(shift, pitch):
    lens = [8, 1, 0, 9, 16, 3, 15]  # runs past the width (16) are cut to it
    case = make_scatter_case(lens, width=16, seed=4)
    pool = _pool(case.pool_rows, 16, pitch, shift)
    cut = [min(n, 16) for n in lens]
    writes = sum(
        _run_sectors(pool, int(r), n) for r, n in zip(case.req_pool_indices, cut, strict=True)
    )
    reads = 8 * sum(cut) + 8 * (len(lens) + 1) + 8 * len(lens)
    assert scatter_sector_bytes(case, pool) == reads + SECTOR * writes


def test_scatter_floor_reads_at_the_inputs_element_sizes():
    """int32 offsets and indices (both taken by the API) read 4 bytes each, not 8."""
    case = make_scatter_case([5, 0, 7], width=8, seed=2)
    narrow = ScatterCase(
        case.flat_in, case.offsets.to(torch.int32), case.req_pool_indices.to(torch.int32),
        case.pool_rows, case.width,
    )  # fmt: skip
    pool = _pool(case.pool_rows, 8, 8, 0)
    assert scatter_sector_bytes(case, pool) - scatter_sector_bytes(narrow, pool) == 4 * (3 + 1 + 3)


def _plan_count(case) -> int:
    """The plan's floor counted request by request."""
    nbytes, lut_sectors = 0, set()
    for k in range(case.bs):
        row, prefix = int(case.req_pool_indices[k]), int(case.prefix_lens[k])
        nbytes += 3 * 8 + 3 * 8  # three int64 inputs read, three int64 outputs written
        if row != 0 and prefix > 0 and int(case.extend_seq_lens[k]) > 0:
            nbytes += SECTOR  # the seed, one random read of req_to_token
            slot = int(case.req_to_token[row, prefix - 1])
            if case.lut is not None and slot >= 0:
                at = case.lut.data_ptr() + min(slot, case.lut.numel() - 1) * 8
                lut_sectors.add(at // SECTOR)
    return nbytes + SECTOR * len(lut_sectors)


@pytest.mark.parametrize("lut_len", [None, 1, 5, 40, 1000])
def test_plan_floor_counts_seeds_and_the_lut_sectors_they_read(lut_len):
    case = make_plan_case(
        prefix_lens=[0, 3, 5, 9, 1, 12, 7, 2, 4, 11] * 6,
        extend_seq_lens=[2, 0, 4, 1, 3, 2, 5, 1, 0, 6] * 6,
        padding=[False, False, True] + [False] * 57,
        max_seq_len=16,
        lut_len=lut_len,
        seed=9,
    )
    want = _plan_count(case)
    assert plan_floor_bytes(case) == want
    if lut_len is not None:  # the LUT adds something: seeds with a slot >= 0 exist
        assert want > plan_floor_bytes(dataclasses.replace(case, lut=None))


def test_plan_floor_leaves_out_seeds_below_zero():
    """A seed below 0 is not translated: no LUT read, not even of its first entry."""
    case = make_plan_case(
        prefix_lens=[4] * 16, extend_seq_lens=[1] * 16, max_seq_len=8, lut_len=4096, seed=1
    )
    rows = case.req_pool_indices
    case.req_to_token[rows, 3] = 64 + 8 * torch.arange(16, dtype=torch.int32)  # sectors 2-33
    case.req_to_token[rows[::2], 3] = -1  # half untranslated
    want = 48 * 16 + SECTOR * 16 + SECTOR * 8
    assert _plan_count(case) == want == plan_floor_bytes(case)


def test_floor_us_converts_bytes_at_gbs_to_microseconds():
    """3 MB at 3 000 GB/s (3e12 bytes a second) is 1 us; no bandwidth, no floor."""
    assert floor_us(3_000_000, 3000.0) == pytest.approx(1.0)
    assert floor_us(3_000_000, None) is None


def test_scatter_plain_floor_is_12_bytes_a_written_token():
    """Runs of 3, 0 and 7 tokens into a pool 5 wide write 3 + 0 + 5 tokens: 8 x (8 read + 4
    written) bytes."""
    case = make_scatter_case([3, 0, 7], width=5)
    assert scatter_token_bytes(case) == 96
