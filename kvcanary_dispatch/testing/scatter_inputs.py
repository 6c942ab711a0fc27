"""Scatter inputs: ``build_scatter_case`` makes a ``ScatterCase`` from lengths and a seed,
``scatter_cases`` draws whole batches (lengths one by one for small ones, else a length
distribution and a seed); ``BROKEN_OFFSETS`` names offsets that break the CSR rules, and
``check_broken_offsets_writes`` checks what a scatter on any offsets left in a guarded pool."""

from __future__ import annotations

import torch
from hypothesis import strategies as st

from ..scatter_shapes import CAPPED_SHORT_MEAN, ROWS_MAX_BS
from .cases import POISON_I32, ScatterCase, offsets_from_lens
from .sizes import (
    DRAWN_MAX_BS,
    I64_MAX,
    BatchSize,
    Device,
    Sizes,
    batch_size_strategy,
    log_uniform,
)

# Columns a drawn pool's rows have past its width (a column window of a wider pool); 0 first,
# so that hypothesis shrinks to a plain pool.
POOL_PITCH_EXTRA = (0, 1, 5)
# Offsets that break the CSR rules (validate=False), by name, for 3 requests over a flat_in of
# 12 tokens: out of order, outside [0, 12], near int32's and int64's limits, and 2**63 or more
# apart (where end - start wraps).
BROKEN_OFFSETS = {
    "decreasing": [0, 9, 4, 12],
    "negative_start": [-5, 3, 3, 12],
    "past_flat_in": [0, 2, 40, 41],
    "past_flat_in_mid_run": [0, 4, 8, 20],
    "empty_head_runs": [3, 3, 3, 12],
    "reversed": [7, 7, 1, 0],
    "huge_negative": [-(2**62) + 1, 3, 2**31 + 5, 12],
    "huge_positive": [0, 2**32, 4, 2**62 - 1],
    "near_int32_ends": [2**31 - 2, -(2**31), 5, 2**62 - 1],
    "int64_min": [-(2**63), -1, 3, 12],
    "end_int64_min": [0, 9, -(2**63), 12],
    "start_int64_max": [2**63 - 1, -2, 3, 12],
    "wrapping_span": [-(2**63), 2**62, 3, 12],
    "wrapping_span_from_just_below_0": [-2, 2**63 - 1, 3, 12],  # tokens 0 and up: written
    "int64_min_after_a_start": [2, -(2**63) + 1, 6, 12],
}
_HIGH_32 = -(2**32)  # int64 mask of the high 32 bits


def check_broken_offsets_writes(
    block: torch.Tensor,
    rows: list[int],
    offsets: list[int],
    flat_in: torch.Tensor,
    *,
    guard: int = 1,
    width: int | None = None,
) -> None:
    """The promise of a scatter on any offsets (``validate=False``), on ``block``: a pool
    poisoned with ``POISON_I32`` between ``guard`` guard rows on each side, its first
    ``width`` columns (all by default) the call's ``pool_out``; ``rows`` its distinct
    ``req_pool_indices``. Every element that is no longer poison lies in a row of ``rows`` and
    a column ``c < width`` and holds ``flat_in[t]`` (as int32), ``t = offsets[r] + c`` inside
    ``flat_in``, ``r`` the request naming the row; else ``AssertionError`` names the first
    element that breaks it. Give the pool columns past ``width``: where a row's pitch is its
    width, a write past the width lands in the next row, and may hold what that row may."""
    assert len(set(rows)) == len(rows), f"rows must be distinct, got {rows}"
    block, flat = block.cpu(), flat_in.cpu()
    width = block.shape[1] if width is None else width
    owner = torch.full((block.shape[0],), -1, dtype=torch.int64)  # [block rows]: request or -1
    owner[torch.tensor(rows, dtype=torch.int64) + guard] = torch.arange(len(rows))
    starts = torch.tensor(offsets[:-1] + [0], dtype=torch.int64)[owner]  # -1: the trailing 0
    # [block rows, block columns] int64 tokens; a start near 2**63 wraps negative, outside
    cols = torch.arange(block.shape[1])
    tokens = starts[:, None] + cols
    named = (owner[:, None] >= 0) & (cols < width) & (tokens >= 0) & (tokens < flat.numel())
    want = torch.full_like(block, POISON_I32)
    want[named] = flat[tokens[named]].to(block.dtype)
    wrong = (block != POISON_I32) & (block != want)
    if wrong.any():
        i, c = wrong.nonzero()[0].tolist()
        raise AssertionError(
            f"row {i - guard} column {c} holds {int(block[i, c])}, want "
            f"{'poison' if not named[i, c] else int(want[i, c])} (rows {rows}, offsets "
            f"{offsets}, {flat.numel()} tokens)"
        )


def _seeded_lens(
    bs: int, target: int, kind: str, zero_frac: float, long_frac: float, g: torch.Generator
) -> torch.Tensor:
    """``bs`` lengths summing to at most ``target``: a weight per request (uniform, lognormal or
    constant), ``zero_frac`` of them zeroed, ``long_frac`` of them 50x heavier."""
    if bs == 0:
        return torch.zeros(0, dtype=torch.int64)
    if kind == "uniform":
        w = torch.rand(bs, generator=g, dtype=torch.float64)
    elif kind == "lognormal":
        w = torch.exp(2 * torch.randn(bs, generator=g, dtype=torch.float64))
    else:
        w = torch.ones(bs, dtype=torch.float64)
    w[torch.rand(bs, generator=g, dtype=torch.float64) < zero_frac] = 0
    w[torch.rand(bs, generator=g, dtype=torch.float64) < long_frac] *= 50
    total_w = float(w.sum())
    if total_w == 0:
        return torch.zeros(bs, dtype=torch.int64)
    return torch.floor(w * (target / total_w)).to(torch.int64)


def _partition(n: int, total: int, zero_frac: float, max_len: int, seed: int) -> torch.Tensor:
    """``n`` lengths of at most ``max_len`` summing to exactly ``total`` (``<= n * max_len``):
    uniform weights, ``zero_frac`` of them zeroed, the rounding remainder spread one by one."""
    g = torch.Generator().manual_seed(seed)
    w = torch.rand(n, generator=g, dtype=torch.float64) + 0.5
    w[torch.rand(n, generator=g, dtype=torch.float64) < zero_frac] = 0
    w = w if float(w.sum()) > 0 else torch.ones(n, dtype=torch.float64)
    lens = torch.floor(w * (total / float(w.sum()))).to(torch.int64).clamp_(max=max_len)
    while (short := total - int(lens.sum())) > 0:
        room = (lens < max_len).nonzero()[:, 0]
        if short < room.numel():
            lens[room[:short]] += 1
        else:
            lens[room] = (lens[room] + short // room.numel()).clamp_(max=max_len)
    return lens


def build_scatter_case(
    lens: torch.Tensor,
    *,
    width: int,
    spare_rows: int,
    seed: int,
    device: Device,
    pool_pitch: int = 0,
    share_rows: bool = False,
) -> ScatterCase:
    """Random token ids over the whole int64 range (a sixteenth of them 0 and another
    sixteenth with their low 32 bits 0: what a masked or zero-filled load gives) and distinct
    random pool rows, made on ``device`` from ``seed``; ``pool_pitch`` as ``ScatterCase``'s.
    ``share_rows``: requests with empty runs take another request's row instead (a writer's
    too), as padding may."""
    dev = torch.device(device)
    g = torch.Generator(device=dev).manual_seed(seed)
    lens = lens.to(dev, torch.int64)
    bs = int(lens.numel())
    offsets = offsets_from_lens(lens)
    total = int(offsets[-1]) if bs else 0
    flat_in = torch.randint(-I64_MAX, I64_MAX, (total,), generator=g, device=dev)
    pick = torch.randint(0, 16, (total,), generator=g, device=dev)
    flat_in = torch.where(pick == 0, 0, torch.where(pick == 1, flat_in & _HIGH_32, flat_in))
    rows = bs + spare_rows
    rpi = torch.randperm(rows, generator=g, device=dev)[:bs].to(torch.int64)
    if share_rows and bs:
        other = rpi[torch.randint(0, bs, (bs,), generator=g, device=dev)]
        rpi = torch.where(lens == 0, other, rpi)
    return ScatterCase(flat_in, offsets, rpi, rows, int(width), int(pool_pitch))


@st.composite
def scatter_cases(
    draw: st.DrawFn,
    max_bs: int,
    max_len: int,
    max_width: int,
    device: Device = "cpu",
    *,
    bs: BatchSize = None,
    max_tokens: int | None = None,
    max_pool_elems: int = 1 << 22,
    big_tokens: int = 0,
    gpu_sizes: bool = False,
) -> ScatterCase:
    """A whole scatter batch: many empty segments, some longer than the pool width, spare
    (never written) pool rows, sometimes a pool that is a column window of a wider one, half
    the time empty runs sharing rows (``build_scatter_case``). ``bs``
    fixes the batch size or gives its strategy."""
    max_tokens = max_tokens if max_tokens is not None else max_bs * max_len
    n = draw(batch_size_strategy(bs, 0, max_bs))
    spare_rows = draw(st.integers(0, 3))
    rows = n + spare_rows
    width = draw(st.integers(1, max(1, min(max_width, max_pool_elems // max(rows, 1)))))
    pitch = width + draw(st.sampled_from(POOL_PITCH_EXTRA))
    seed = draw(st.integers(0, 2**32 - 1))
    mean_hi = min(max_len, max_tokens // max(n, 1))
    if n > ROWS_MAX_BS and mean_hi >= 1 and draw(st.integers(0, 3)):
        # Batches scatter "auto" sends to "capped": the mean either side of the edge between
        # its short and long shapes, or any; then maybe one run far past the cap (its tails).
        edge = st.integers(max(1, CAPPED_SHORT_MEAN - 2), CAPPED_SHORT_MEAN + 3)
        mean = min(mean_hi, draw(st.one_of(edge, log_uniform(1, mean_hi))))
        lens = _partition(n, mean * n, draw(st.sampled_from([0.0, 0.1, 0.9])), max_len, seed)
        at = seed % n
        room = min(max_len - int(lens[at]), max_tokens - int(lens.sum()))
        lens[at] += draw(st.one_of(st.just(0), log_uniform(0, max(room, 0))))
    elif n <= DRAWN_MAX_BS and not gpu_sizes:
        hi = max(0, min(max_len, max_tokens // max(n, 1)))
        length = st.one_of(
            st.just(0), st.integers(0, min(width, hi)), st.integers(min(width + 1, hi), hi)
        )
        lens = torch.tensor(draw(st.lists(length, min_size=n, max_size=n)), dtype=torch.int64)
    else:
        big = big_tokens > 0 and n > 0 and draw(st.integers(0, 9)) == 0
        lo_target = min(big_tokens, max_tokens) if big else 0
        target = draw(log_uniform(lo_target, max(lo_target, max_tokens)))
        kind = draw(st.sampled_from(["uniform", "lognormal", "constant"]))
        zero_frac = draw(st.sampled_from([0.5, 0.0, 0.9, 1.0]))
        long_frac = draw(st.sampled_from([0.0, 0.02, 0.3]))
        g = torch.Generator().manual_seed(seed)
        lens = _seeded_lens(n, target, kind, zero_frac, long_frac, g).clamp_(max=max_len)
        if big and int(lens.sum()) < lo_target:  # the clamp or the zeroing ate the budget
            lens[-1] += lo_target - int(lens.sum())
    room = min(max_len, max_tokens)
    if gpu_sizes and n and room and not bool(lens.any()) and draw(st.integers(0, 15)):
        # At GPU sizes a batch whose requests all came out empty (a zero fraction of 1.0, or a
        # zero token target) stays so one time in sixteen; the rest give one request tokens,
        # so that fewer examples of a GPU fuzz copy nothing. (The CPU sizes keep their empty
        # batches: they launch nothing, which keeps the interpreter's runs short.)
        lens[seed % n] = draw(st.integers(1, room))
    return build_scatter_case(
        lens,
        width=width,
        spare_rows=spare_rows,
        seed=seed,
        device=device,
        pool_pitch=pitch,
        share_rows=draw(st.booleans()),
    )


def scatter_cases_for(
    sizes: Sizes, device: Device = "cpu", *, bs: BatchSize = None
) -> st.SearchStrategy[ScatterCase]:
    """``scatter_cases`` with the bounds of ``sizes``."""
    bounds = sizes.bounds(
        "max_bs", "max_len", "max_width", "max_tokens", "max_pool_elems", "big_tokens", "gpu_sizes"
    )
    return scatter_cases(device=device, bs=bs, **bounds)
