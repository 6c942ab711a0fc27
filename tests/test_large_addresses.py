"""Rows that start past ``2**31`` elements: a scatter pool and a plan's ``req_to_token`` whose
last rows lie past 2**31 int32 elements (8 GiB) from the first, so every kernel's row
address must be computed in 64 bits. On a GPU with the memory for it the row stride is
``2**30 + 7`` elements; elsewhere a small stride runs the same checks (only the GPU run
proves the addressing). Likewise runs of about ``2**31`` tokens: one that writes columns past
``2**31 - 1``, one that ends just short of them (300 and 290 tokens elsewhere)."""

from __future__ import annotations

import dataclasses
from functools import partial

import pytest
import torch
import triton
import triton.language as tl
from conftest import DEVICE, GPU

from kvcanary_dispatch import (
    PLAN_STRATEGIES,
    SCATTER_STRATEGIES,
    plan_offsets,
    scatter_req_token_ids,
)
from kvcanary_dispatch.testing.cases import (
    POISON_I32,
    assert_bytes_equal,
    check_plan,
    check_scatter,
    make_plan_case,
    make_scatter_case,
)
from kvcanary_kernels.plan_slices import _slice_len

ROW_STRIDE = 2**30 + 7 if GPU else 77  # elements between rows; the GPU's row 2 is past 2**31
WIDTH = 64
# Tokens in one run: on the GPU one past int32's columns, and one whose pool (24 columns wider)
# stays under 2**31 columns, so its column bounds are int32 and a column loop's last step
# reaches 2**31.
WIDE_RUNS = (2**31 + 40, 2**31 - 30) if GPU else (300, 290)


def _free_bytes() -> int:
    """The GPU's free memory once torch's allocator has given back the blocks it caches (an
    earlier test's buffers would otherwise count as used)."""
    torch.cuda.empty_cache()
    return torch.cuda.mem_get_info()[0]


def _need(rows: int, copies: int) -> None:
    """Skip where ``copies`` buffers of ``rows`` rows at ``ROW_STRIDE`` do not fit the GPU."""
    if GPU and _free_bytes() < copies * rows * ROW_STRIDE * 4 + 2**30:
        pytest.skip("needs the GPU memory for rows 2**31 elements apart")


@pytest.mark.parametrize("strategy", SCATTER_STRATEGIES)
def test_scatter_into_rows_past_2_31_elements(strategy):
    """Each request's run lands in its own row, the last row past 2**31 elements; every
    other element of the rows' storage (the columns between them included) stays poison."""
    _need(rows=3, copies=2)
    case = make_scatter_case([5, WIDTH + 3, 1], width=WIDTH, spare_rows=0, seed=3, device=DEVICE)
    rows = torch.tensor([2, 0, 1], dtype=torch.int64, device=DEVICE)
    case = dataclasses.replace(case, req_pool_indices=rows, pool_pitch=ROW_STRIDE)
    pool = check_scatter(partial(scatter_req_token_ids, strategy=strategy), case)
    assert pool.stride(0) == ROW_STRIDE and int(pool[2, 0]) != POISON_I32


@pytest.mark.parametrize("strategy", PLAN_STRATEGIES)
def test_plan_seeds_from_rows_past_2_31_elements(strategy):
    """``req_to_token`` is contiguous with ``ROW_STRIDE`` columns: seeds read
    ``req_to_token[row, prefix - 1]`` up to its last element (past 2**31 from the first on the
    GPU) and equal the reference's."""
    _need(rows=5, copies=2)  # the table and the reference's copy of it
    case = make_plan_case(
        prefix_lens=[5, 9, 3], extend_seq_lens=[2, 1, 4], max_seq_len=16, seed=4, device=DEVICE
    )
    table = torch.full((5, ROW_STRIDE), POISON_I32, dtype=torch.int32, device=DEVICE)
    table[:, :16] = case.req_to_token
    table[4, -1] = 12345  # the last request's seed: the table's last row, last column
    prefix = torch.tensor([9, 5, ROW_STRIDE], dtype=torch.int64, device=DEVICE)
    rows = torch.tensor([1, 3, 4], dtype=torch.int64, device=DEVICE)
    case = dataclasses.replace(case, req_to_token=table, req_pool_indices=rows, prefix_lens=prefix)
    got = check_plan(plan_offsets, case, strategy=strategy)
    assert int(got["out_write_seed_slot_indices"][2]) == 12345


@pytest.mark.parametrize("strategy", SCATTER_STRATEGIES)
@pytest.mark.parametrize("n", WIDE_RUNS)
def test_scatter_a_run_past_2_31_columns(strategy, n):
    """One request's run of ``n`` tokens, starting 7 tokens into ``flat_in``, into a pool row
    24 columns wider: every token lands in its column as int32 (on the GPU, those past
    ``2**31 - 1`` of the longer run included) and the columns past the run stay poison."""
    if GPU and _free_bytes() < n * 12 + 2**32:
        pytest.skip("needs the GPU memory for a run 2**31 tokens long (about 28 GiB)")
    start = 7
    flat_in = torch.arange(start + n, dtype=torch.int64, device=DEVICE).mul_(3).sub_(5 * start)
    offsets = torch.tensor([start, start + n], dtype=torch.int64, device=DEVICE)
    rows = torch.zeros(1, dtype=torch.int64, device=DEVICE)
    pool = torch.full((1, n + 24), POISON_I32, dtype=torch.int32, device=DEVICE)
    scatter_req_token_ids(
        flat_in=flat_in, offsets=offsets, req_pool_indices=rows, pool_out=pool, strategy=strategy
    )
    step = 2**28 if GPU else 64  # bounded temporaries
    for lo in range(0, n, step):
        hi = min(n, lo + step)
        want = flat_in[start + lo : start + hi].to(torch.int32)
        assert_bytes_equal(pool[0, lo:hi], want, f"pool_out[0, {lo}:{hi}]")
    assert bool((pool[0, n:] == POISON_I32).all()), "the scatter wrote past its run"


@triton.jit
def _slice_lens_kernel(out_ptr, chunk, bs):
    k = tl.program_id(0).to(tl.int64)
    tl.store(out_ptr, _slice_len(k * 0, k * 0 + chunk, bs, True))
    tl.store(out_ptr + 1, _slice_len(k * 0, k * 0 + chunk, bs, False).to(tl.int64))


@pytest.mark.parametrize("prefix", [2**31 - 1000, 2**31, 2**32 + 3, 3 * 2**31 + 5])
def test_recount_counts_prefixes_of_2_31_requests_in_int64(prefix):
    """``recount`` sums the requests before its slice, ``k * chunk`` of them, as one slice:
    ``_slice_len`` with ``WIDE`` keeps that count int64 (its int32 form, kept for slices of at
    most 4 096 requests, wraps: 2**32 + 3 requests would read as 3, and a prefix within a tile
    of 2**31 would never end the tile loop)."""
    out = torch.full((2,), -1, dtype=torch.int64, device=DEVICE)
    _slice_lens_kernel[(1,)](out, prefix, 4 * 2**31)
    wide, narrow = out.tolist()
    assert wide == prefix
    assert narrow == (prefix + 2**31) % 2**32 - 2**31  # what the int32 form gives
