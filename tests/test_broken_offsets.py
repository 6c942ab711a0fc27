"""Offsets that break the CSR preconditions (``validate=False``; ``BROKEN_OFFSETS``: out of
order, negative, past ``flat_in``, near the int64 ends) through every scatter strategy and the
kernels they launch. No data makes a call read outside ``flat_in`` or write outside the
addressed rows' first ``width`` columns, and no call loops on: each element written at
column ``c`` of a row is ``flat_in[offsets[r] + c]`` for a request ``r`` naming the row. On
the CPU the interpreter's bounds checks (conftest) fail any read outside the launch's
tensors."""

from __future__ import annotations

import pytest
import torch
from _helpers import BAD_OFFSETS, guarded_pool
from conftest import DEVICE
from hypothesis import given
from hypothesis import strategies as st

from kvcanary_dispatch import SCATTER_STRATEGIES, scatter_req_token_ids
from kvcanary_dispatch.testing.cases import POISON_I32
from kvcanary_dispatch.testing.scatter_inputs import BROKEN_OFFSETS, check_broken_offsets_writes
from kvcanary_kernels import launch_scatter_req_token_ids_kernel
from kvcanary_kernels.args import ScatterArgs
from kvcanary_kernels.scatter_sliced import launch_scatter_sliced, sliced_grid

WIDTH, ROWS, RPI = 6, 5, [3, 0, 2]  # a pool of 5 rows of 6 columns, 3 requests on 3 rows
SPARE = 2  # guard columns past the width, where a write past it shows (else: the next row)


def broken_call(offsets: list[int], tokens: int, device=DEVICE):
    """Keywords of a call on ``tokens`` tokens ``100, 101, ...`` into a poisoned pool with a
    guard row on each side and ``SPARE`` guard columns, and that guarded block, all on
    ``device``."""
    big = guarded_pool(ROWS, WIDTH, device, spare_cols=SPARE)
    kw = dict(
        flat_in=torch.arange(100, 100 + tokens, dtype=torch.int64, device=device),
        offsets=torch.tensor(offsets, dtype=torch.int64, device=device),
        req_pool_indices=torch.tensor(RPI, dtype=torch.int64, device=device),
        pool_out=big[1:-1, :WIDTH],
    )
    return kw, big


def _sliced(**kw: torch.Tensor) -> None:  # slices of 2 requests in a block of 4
    bs, n = int(kw["req_pool_indices"].shape[0]), int(kw["flat_in"].shape[0])
    launch_scatter_sliced(ScatterArgs(**kw), grid=sliced_grid(bs, n, 2, 4), chunk=2, batch_block=4)


@BAD_OFFSETS
@pytest.mark.parametrize("tokens", [12, 13])
@pytest.mark.parametrize("strategy", SCATTER_STRATEGIES)
def test_every_strategy_writes_only_run_tokens_in_the_addressed_rows(offsets, tokens, strategy):
    """Through the dispatcher (``loop`` and ``sliced`` in slices of 2 requests): every element
    that changed lies in an addressed row's first ``width`` columns and holds
    ``flat_in[offsets[r] + c]``, ``r`` the request naming the row and ``c`` the column; the
    guard rows and the unaddressed rows stay poisoned."""
    kw, big = broken_call(offsets, tokens)
    chunk = 2 if strategy in ("loop", "sliced") else None
    scatter_req_token_ids(**kw, strategy=strategy, chunk_size=chunk)
    check_broken_offsets_writes(big, RPI, offsets, kw["flat_in"], width=WIDTH)


_INT64 = st.integers(-(2**63), 2**63 - 1)
_OFFSET = st.one_of(
    st.integers(-3, 45), st.sampled_from([-(2**63), 2**63 - 1, -(2**62), 2**62]), _INT64
)


@st.composite
def broken_offsets(draw) -> list[int]:
    """A CSR of 1-9 runs of 0-8 tokens, shifted by -3 to 3, then up to 3 corruptions: an
    offset set to any value (small, near the int64 ends or anywhere in int64), or two offsets
    swapped; or, one time in five, offsets drawn at random."""
    if draw(st.integers(0, 4)) == 0:
        return draw(st.lists(_OFFSET, min_size=2, max_size=10))
    lens = draw(st.lists(st.integers(0, 8), min_size=1, max_size=9))
    shift = draw(st.integers(-3, 3))
    offsets = [shift + sum(lens[:i]) for i in range(len(lens) + 1)]
    for _ in range(draw(st.integers(0, 3))):
        i, j = (draw(st.integers(0, len(lens))) for _ in range(2))
        if draw(st.booleans()):
            offsets[i] = draw(_OFFSET)
        else:
            offsets[i], offsets[j] = offsets[j], offsets[i]
    return offsets


@given(
    offsets=broken_offsets(),
    tokens=st.integers(0, 45),
    width=st.integers(1, 8),
    chunk=st.integers(1, 4),
    seed=st.integers(0, 2**16),
)
@pytest.mark.parametrize("strategy", SCATTER_STRATEGIES)
def test_any_offsets_write_only_run_tokens_in_the_addressed_rows(
    strategy, offsets, tokens, width, chunk, seed
):
    """The test above on corrupted CSRs and random offsets (``broken_offsets``), any token count
    (none included), pool width and slice size, on distinct random rows of a pool 2 rows
    taller than the batch."""
    bs = len(offsets) - 1
    rows = torch.randperm(bs + 2, generator=torch.Generator().manual_seed(seed))[:bs].tolist()
    big = guarded_pool(bs + 2, width, DEVICE, spare_cols=SPARE)
    flat_in = torch.arange(100, 100 + tokens, dtype=torch.int64, device=DEVICE)
    scatter_req_token_ids(
        flat_in=flat_in,
        offsets=torch.tensor(offsets, dtype=torch.int64, device=DEVICE),
        req_pool_indices=torch.tensor(rows, dtype=torch.int64, device=DEVICE),
        pool_out=big[1:-1, :width],
        strategy=strategy,
        chunk_size=chunk if strategy in ("loop", "sliced") else None,
    )
    check_broken_offsets_writes(big, rows, offsets, flat_in, width=width)


@pytest.mark.parametrize("width", [1, 64])
@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("strategy", SCATTER_STRATEGIES)
def test_every_strategy_on_600_corrupted_requests(strategy, seed, width):
    """The promise past the fixed block's 512 requests, where ``sliced`` and ``loop`` cut
    slices of 100 requests and ``capped`` runs its tails: a CSR of 600 runs of 0-13 tokens and
    one of 300, then 40 offsets set at random around ``flat_in`` and three to int64's ends and
    ``2**40``, on distinct random rows; something is written, and only what the promise
    allows."""
    g = torch.Generator().manual_seed(seed)
    bs = 600
    lens = torch.randint(0, 14, (bs,), generator=g)
    lens[int(torch.randint(0, bs, (1,), generator=g))] = 300
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lens.cumsum(0)])
    n = int(offsets[-1])
    offsets[torch.randint(0, bs + 1, (40,), generator=g)] = torch.randint(
        -20, n + 20, (40,), generator=g
    )
    offsets[torch.randint(0, bs + 1, (3,), generator=g)] = torch.tensor(
        [-(2**63), 2**63 - 1, 2**40]
    )
    rows = torch.randperm(bs + 5, generator=g)[:bs]
    flat_in = torch.arange(100, 100 + n, dtype=torch.int64, device=DEVICE)
    big = guarded_pool(bs + 5, width, DEVICE, spare_cols=SPARE)
    scatter_req_token_ids(
        flat_in=flat_in,
        offsets=offsets.to(DEVICE),
        req_pool_indices=rows.to(DEVICE),
        pool_out=big[1:-1, :width],
        strategy=strategy,
        chunk_size=100 if strategy in ("loop", "sliced") else None,
    )
    assert (big != POISON_I32).any()
    check_broken_offsets_writes(big, rows.tolist(), offsets.tolist(), flat_in, width=width)


@pytest.mark.parametrize("name", ["past_flat_in", "past_flat_in_mid_run", "empty_head_runs"])
@pytest.mark.parametrize("tokens", [12, 13])
def test_sliced_copies_only_the_tokens_inside_flat_in(name, tokens):
    """Ordered offsets that start past 0 or end past ``flat_in`` (12 or 13 tokens): ``sliced``
    writes each addressed element whose token lies inside ``flat_in``, that token, reading
    nothing outside it; the rest of a poisoned pool and its guard rows stay untouched."""
    offsets = BROKEN_OFFSETS[name]
    kw, big = broken_call(offsets, tokens)
    _sliced(**kw)
    want = torch.full_like(big, POISON_I32)
    for r, row in enumerate(RPI):
        for c in range(WIDTH):
            if offsets[r] + c < min(offsets[r + 1], tokens):
                want[1 + row, c] = 100 + offsets[r] + c
    assert torch.equal(big, want)


def _owner_rule(offsets, tokens, width, slices):
    """``{(request, column): token}`` the owner rule writes: slice ``(s, n, lo, hi)`` sends
    each token ``t`` in ``[lo, hi)`` to ``r = s + count(offsets[s:s+n+1] <= t) - 1`` if
    ``s <= r < s + n``, at column ``t - offsets[r]`` if that lies in ``[0, width)``."""
    out = {}
    for s, n, lo, hi in slices:
        for t in range(lo, hi):
            r = s + sum(o <= t for o in offsets[s : s + n + 1]) - 1
            if s <= r < s + n and 0 <= t - offsets[r] < width:
                out[r, t - offsets[r]] = t
    return out


@BAD_OFFSETS
@pytest.mark.parametrize("tokens", [12, 13])
@pytest.mark.parametrize("kernel", ["sliced", "fixed_block"])
def test_owner_rule_kernels_stay_in_bounds_whatever_the_offsets(offsets, tokens, kernel):
    """The fixed-block kernel and ``sliced`` (slices of 2 requests) on offsets that break the
    CSR preconditions: each writes what the owner rule gives, the fixed-block kernel over
    every token of ``flat_in``, ``sliced`` a slice over the tokens from its first offset to
    its last clamped into ``flat_in``. So they read only ``flat_in``, write only the
    addressed rows' first ``width`` columns and end (offsets near the int64 ends neither
    overflow nor loop); the rest of a poisoned pool, and a guard row on each side, stay
    untouched. On ordered offsets the rule is each run's copy (the test above)."""
    kw, big = broken_call(offsets, tokens)
    if kernel == "sliced":
        _sliced(**kw)
        clamp = lambda o, lo: min(max(o, lo), tokens)  # noqa: E731
        slices = [(s, n, clamp(offsets[s], 0), clamp(offsets[s + n], clamp(offsets[s], 0)))
                  for s, n in ((0, 2), (2, 1))]  # fmt: skip
    else:
        launch_scatter_req_token_ids_kernel(**kw, batch_block=4)
        slices = [(0, len(RPI), 0, tokens)]
    want = torch.full_like(big, POISON_I32)
    for (r, c), t in _owner_rule(offsets, tokens, WIDTH, slices).items():
        want[1 + RPI[r], c] = 100 + t
    assert torch.equal(big, want)
