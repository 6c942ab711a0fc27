"""The ``validate=True`` data checks of both dispatch functions: the first offending index
named, nothing written, valid batches (padding included) accepted and equal to the
references."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from _helpers import dispatch_cases, plan_kwargs, plan_outputs, rejected, scatter_kwargs
from conftest import DEVICE

from kvcanary_dispatch import (
    PLAN_STRATEGIES,
    SCATTER_STRATEGIES,
    plan_offsets,
    scatter_req_token_ids,
)
from kvcanary_dispatch.testing.cases import check_plan, make_plan_case, make_scatter_case
from kvcanary_dispatch.testing.properties import check_plan_property, check_scatter_property
from kvcanary_dispatch.testing.sizes import I64_MAX

_scatter_case, _plan_case = dispatch_cases(DEVICE)


def _validate_scatter(case, **over) -> str:
    kw = scatter_kwargs(case, validate=True, **over)
    return rejected(ValueError, lambda: scatter_req_token_ids(**kw), [kw["pool_out"]])


@pytest.mark.parametrize("strategy", SCATTER_STRATEGIES)
def test_validate_scatter_offsets(strategy):
    case = _scatter_case(12, seed=3, hi=5)
    offs = case.offsets.clone()
    offs[4], offs[9] = offs[5] + 1, offs[10] + 2  # decreases at 5 and 10
    msg = _validate_scatter(case, offsets=offs, strategy=strategy)
    assert f"offsets[5]={int(offs[5])} < offsets[4]={int(offs[4])}" in msg
    msg = _validate_scatter(case, offsets=case.offsets + 1, strategy=strategy)
    assert "offsets[0] must be 0, got 1" in msg
    end = case.offsets.clone()
    end[-1] += 1
    msg = _validate_scatter(case, offsets=end, strategy=strategy)
    assert f"offsets[12]={case.total + 1} must equal len(flat_in)={case.total}" in msg


@pytest.mark.parametrize("strategy", SCATTER_STRATEGIES)
def test_validate_scatter_rows(strategy):
    case = _scatter_case(12, seed=4, hi=5)
    rows = case.pool_rows
    rpi = case.req_pool_indices.clone()
    rpi[3], rpi[8] = -1, rows
    msg = _validate_scatter(case, req_pool_indices=rpi, strategy=strategy)
    assert "req_pool_indices[3]=-1" in msg and f"[0, {rows})" in msg
    rpi = case.req_pool_indices.clone()
    rpi[6], rpi[10] = rows + 4, -2
    msg = _validate_scatter(case, req_pool_indices=rpi, strategy=strategy)
    assert f"req_pool_indices[6]={rows + 4}" in msg
    rpi = case.req_pool_indices.clone()
    rpi[9], rpi[10] = rpi[2], rpi[0]  # runs of 3 and 4 tokens on those of 1 and 4
    msg = _validate_scatter(case, req_pool_indices=rpi, strategy=strategy)
    assert f"req_pool_indices[9]={int(rpi[2])} repeats req_pool_indices[2]" in msg


@pytest.mark.parametrize("strategy", SCATTER_STRATEGIES)
def test_validate_scatter_lets_padding_share_a_row(strategy):
    """Requests with nothing to write (empty runs) may repeat a row, as CUDA-graph padding
    repeats row 0: the result is defined, and equal to the reference; a writing request that
    repeats a row is still refused, naming it."""
    lens = [3, 0, 5, 0, 2, 0, 0, 4]
    case = make_scatter_case(lens, width=6, spare_rows=2, seed=9, device=DEVICE)
    rpi = case.req_pool_indices.clone()
    rpi[[1, 3, 5, 6]] = 0  # padding on row 0, which no writing request addresses
    rpi[[0, 2, 4, 7]] = torch.tensor([3, 5, 7, 1], device=DEVICE)
    padded = replace(case, req_pool_indices=rpi)
    check_scatter_property(padded, None, strategy, validate=True)
    rpi[5] = 5  # an empty run on a writing request's row
    check_scatter_property(replace(case, req_pool_indices=rpi), None, strategy, validate=True)
    rpi[7] = 3  # a writing request on request 0's row
    msg = _validate_scatter(replace(case, req_pool_indices=rpi), strategy=strategy)
    assert msg.endswith("req_pool_indices[7]=3 repeats req_pool_indices[0]; requests must "
                        "address distinct pool rows: give each request that writes its own "
                        "row (those with empty runs may share one)")  # fmt: skip


def test_validate_scatter_accepts_valid_batches():
    for strategy in SCATTER_STRATEGIES:
        check_scatter_property(_scatter_case(600, seed=2), 64, strategy, validate=True)


def _validate_plan(case, **over) -> str:
    kw = plan_kwargs(case, validate=True, **over)
    return rejected(ValueError, lambda: plan_offsets(**kw), plan_outputs(kw))


@pytest.mark.parametrize("strategy", PLAN_STRATEGIES)
def test_validate_plan(strategy):
    n = 10
    case = _plan_case(n, padding=torch.zeros(n, dtype=torch.bool), seed=5)
    width = int(case.req_to_token.shape[1])
    prefix, extend = case.prefix_lens.clone(), case.extend_seq_lens.clone()
    prefix[4], extend[4] = width + 1, 2
    prefix[7], extend[7] = width + 5, 1
    msg = _validate_plan(case, prefix_lens=prefix, extend_seq_lens=extend, strategy=strategy)
    assert f"prefix_lens[4]={width + 1} exceeds req_to_token.shape[1]={width}" in msg

    rpi = case.req_pool_indices.clone()
    rpi[5], rpi[8] = rpi[1], rpi[0]
    msg = _validate_plan(case, req_pool_indices=rpi, strategy=strategy)
    assert f"req_pool_indices[5]={int(rpi[1])} repeats req_pool_indices[1]" in msg

    rows = int(case.req_to_token.shape[0])
    rpi = case.req_pool_indices.clone()
    rpi[2], rpi[3] = rows, -1
    msg = _validate_plan(case, req_pool_indices=rpi, strategy=strategy)
    assert msg.endswith(
        f"plan_offsets req_pool_indices[2]={rows} is outside [0, {rows}) (req_to_token has "
        f"{rows} rows); pass indices of req_to_token's rows"
    ), msg


@pytest.mark.parametrize("strategy", PLAN_STRATEGIES)
def test_validate_plan_accepts_padding_and_unseeded_long_prefixes(strategy):
    """Padding rows (pool index 0) repeat freely; a prefix past the pool is fine where no seed
    is read (padding, or nothing to write)."""
    n = 600
    pad = torch.arange(n) % 3 == 0
    case = _plan_case(n, padding=pad, seed=6)
    width = int(case.req_to_token.shape[1])
    prefix, extend = case.prefix_lens.clone(), case.extend_seq_lens.clone()
    prefix[0], extend[0] = width + 9, 3  # padding
    prefix[1], extend[1] = width + 9, 0  # active, writes nothing
    case.prefix_lens, case.extend_seq_lens = prefix, extend
    check_plan_property(case, 128, strategy, validate=True)


@pytest.mark.parametrize("strategy", SCATTER_STRATEGIES)
def test_validate_scatter_refuses_offsets_ending_before_flat_in(strategy):
    """``offsets[bs]`` must equal ``len(flat_in)`` both ways: an end short of it (tokens of
    ``flat_in`` no request owns) is refused as one past it is, naming both."""
    case = make_scatter_case([2, 3, 0, 4], width=6, spare_rows=2, seed=1, device=DEVICE)
    short = case.offsets.clone()
    short[-1] -= 1  # 9 -> 8, still non-decreasing
    msg = _validate_scatter(case, offsets=short, strategy=strategy)
    assert msg.endswith("offsets[4]=8 must equal len(flat_in)=9; flat_in holds the runs' "
                        "tokens back to back, no more"), msg  # fmt: skip


@pytest.mark.parametrize("strategy", SCATTER_STRATEGIES)
def test_validate_scatter_zero_width_pool_lets_rows_repeat(strategy):
    """A request writes only what falls inside the pool's width: on a pool 0 columns wide no
    request writes, so requests with non-empty runs may share a row, and ``validate=True``
    takes the call."""
    case = make_scatter_case([2, 3, 0, 4], width=0, spare_rows=2, seed=1, device=DEVICE)
    rpi = case.req_pool_indices.clone()
    rpi[1] = rpi[0]  # runs of 2 and 3 tokens on one row
    check_scatter_property(replace(case, req_pool_indices=rpi), None, strategy, validate=True)


@pytest.mark.parametrize(
    "prefix,extend", [([I64_MAX, I64_MAX, 5], [0, 0, 2]), ([3, 3, 5], [I64_MAX, I64_MAX, 2])],
    ids=["verify", "write"],
)  # fmt: skip
def test_validate_plan_totals_leave_padding_out(prefix, extend):
    """Padding requests (pool row 0) verify and write nothing: their prefixes and new
    tokens, however many, do not count towards the verify or write total, and
    ``validate=True`` takes the call."""
    case = make_plan_case(
        prefix_lens=prefix,
        extend_seq_lens=extend,
        padding=[True, True, False],
        max_seq_len=8,
        device=DEVICE,
    )
    check_plan(plan_offsets, case, validate=True)


def _two_repeats(rpi: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``rpi`` (distinct values) with requests 0 and 1 on its largest row and requests 2 and 3
    on its smallest: the repeat that comes first in the batch (request 1) has the larger
    value, so a sort by value meets request 3's repeat first. Returns the largest row too."""
    values = sorted(rpi.tolist())
    hi, lo = values[-1], values[0]
    rest = [v for v in rpi.tolist() if v not in (hi, lo)][: rpi.numel() - 4]
    out = torch.tensor([hi, hi, lo, lo, *rest], dtype=torch.int64, device=rpi.device)
    assert out.numel() == rpi.numel()
    return out, hi


@pytest.mark.parametrize("strategy", SCATTER_STRATEGIES)
def test_validate_scatter_names_the_earliest_repeat(strategy):
    """Two rows repeated by writing requests: the message names request 1 (repeating request
    0), the earliest repeat in the batch, and the call writes nothing."""
    case = make_scatter_case([2, 3, 1, 4, 2, 1], width=6, spare_rows=3, seed=1, device=DEVICE)
    rpi, hi = _two_repeats(case.req_pool_indices)
    kw = scatter_kwargs(case, req_pool_indices=rpi, validate=True, strategy=strategy)
    msg = rejected(ValueError, lambda: scatter_req_token_ids(**kw), [kw["pool_out"]])
    assert f"req_pool_indices[1]={hi} repeats req_pool_indices[0]; " in msg, msg


@pytest.mark.parametrize("seed", range(4))
def test_validate_scatter_names_the_earliest_repeat_among_many(seed):
    """In a batch of 120 requests with many repeated rows (where an unstable sort of the rows
    would pair them in any order), the message still names the earliest repeat and the first
    request with that row."""
    bs = 120
    case = make_scatter_case([1 + r % 3 for r in range(bs)], width=4, seed=seed, device=DEVICE)
    pick = torch.randint(0, bs, (bs,), generator=torch.Generator().manual_seed(seed))
    rpi = case.req_pool_indices[pick.to(DEVICE)]
    rows, seen = rpi.tolist(), {}  # row -> the first request with it
    later = 0
    while rows[later] not in seen:
        seen[rows[later]] = later
        later += 1
    kw = scatter_kwargs(case, req_pool_indices=rpi, validate=True)
    msg = rejected(ValueError, lambda: scatter_req_token_ids(**kw), [kw["pool_out"]])
    want = (
        f"req_pool_indices[{later}]={rows[later]} repeats req_pool_indices[{seen[rows[later]]}]; "
    )
    assert want in msg, msg


@pytest.mark.parametrize("strategy", PLAN_STRATEGIES)
def test_validate_plan_names_the_earliest_repeat(strategy):
    """The same for the plan (active rows, none of them padding)."""
    case = make_plan_case(
        prefix_lens=[1, 2, 3, 1, 2, 3],
        extend_seq_lens=[1, 2, 1, 2, 1, 2],
        padding=[False] * 6,
        max_seq_len=8,
        seed=2,
        device=DEVICE,
    )
    assert bool((case.req_pool_indices != 0).all())
    rpi, hi = _two_repeats(case.req_pool_indices)
    kw = plan_kwargs(case, req_pool_indices=rpi, validate=True, strategy=strategy)
    msg = rejected(ValueError, lambda: plan_offsets(**kw), plan_outputs(kw))
    assert f"req_pool_indices[1]={hi} repeats req_pool_indices[0]; " in msg, msg
