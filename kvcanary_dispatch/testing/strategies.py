"""Hypothesis strategies that build whole dispatcher inputs (``ScatterCase``, ``PlanCase``).

Small batches draw every length through hypothesis, so failures shrink well. Larger ones (and
every batch in ``gpu_sizes`` mode) draw a handful of parameters — ``bs``, a length
distribution, a seed — and make the tensors with torch from the seed, so a case with
``bs = 131072`` and tens of millions of tokens costs a few draws. Sizes live in ``SIZES``, keyed
by hypothesis profile name; ``sizes_for()`` reads ``HYPOTHESIS_PROFILE``. Nothing here needs
pytest, so the ``fuzz`` command can use it too. To reach every path ``auto`` can take, draws
include ``chunk_size=None``, block-edge batch sizes, long runs and int64-extreme plan totals.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from hypothesis import strategies as st

from ..launch_plan import SEGMENTS_MAX_MEAN, SEGMENTS_MIN_BS, SEGMENTS_MIN_MEAN
from .cases import PlanCase, ScatterCase, offsets_from_lens

_I64_MAX = 2**63 - 1
_I32_MAX = 2**31 - 1
_DRAWN_MAX_BS = 24  # up to this bs, lengths are drawn one by one (unless gpu_sizes)
# Batch sizes at the fixed blocks' edges (scatter: 512 requests a block, plan: 4096).
BLOCK_EDGE_BS = (255, 256, 257, 511, 512, 513, 4095, 4096, 4097)
# Batch sizes that can take scatter "segments" at interpreter-affordable token counts.
SEGMENTS_BAND = (SEGMENTS_MIN_BS, SEGMENTS_MIN_BS + 16)
# Plan verify and write totals of the int64-extreme cases: at int32's end (the verify count
# and the largest verify_capacity), and from 2**61 (where a packed look-back word wraps) on.
EXTREME_TOTALS = (_I32_MAX - 1, _I32_MAX, _I32_MAX + 1, 2**61 - 1, 2**61, 2**62)
EXTREME_TOTALS += (2**62 + 12_345, _I64_MAX - 2**20, _I64_MAX)


@dataclass(frozen=True)
class Sizes:
    """Bounds for one test regime."""

    max_bs: int
    max_len: int  # longest scatter segment
    max_width: int  # scatter pool width (max_context_len)
    max_tokens: int  # scatter tokens per case
    max_seq_len: int  # plan req_to_token width
    max_slices: int  # slices per dispatched call: bounds cdiv(bs, chunk_size)
    max_pool_elems: int  # rows * width of one pool or req_to_token
    big_tokens: int  # > 0: some scatter cases hold at least this many tokens
    gpu_sizes: bool  # every case from a seed (no per-element draws)
    min_examples: int  # property tests run at least this many examples


SIZES: dict[str, Sizes] = {
    # Triton's interpreter runs programs one by one: ~1 ms a scatter program, ~5 ms a plan one.
    "ci": Sizes(
        max_bs=BLOCK_EDGE_BS[-1],
        max_len=600,
        max_width=64,
        max_tokens=20_000,
        max_seq_len=48,
        max_slices=48,
        max_pool_elems=1 << 20,
        big_tokens=0,
        gpu_sizes=False,
        min_examples=100,
    ),
    "gpu": Sizes(
        max_bs=131_072,
        max_len=1 << 24,
        max_width=4096,
        max_tokens=16_000_000,
        max_seq_len=1024,
        max_slices=4096,
        max_pool_elems=1 << 28,
        big_tokens=10_000_000,
        gpu_sizes=True,
        min_examples=0,
    ),
}


def sizes_for(profile: str | None = None) -> Sizes:
    """``SIZES["gpu"]`` for the gpu profile, else ``SIZES["ci"]``; ``profile=None`` reads
    ``HYPOTHESIS_PROFILE`` (default ``ci``)."""
    name = profile if profile is not None else os.environ.get("HYPOTHESIS_PROFILE", "ci")
    return SIZES["gpu"] if name == "gpu" else SIZES["ci"]


@st.composite
def log_uniform(draw: st.DrawFn, lo: int, hi: int) -> int:
    """An int in ``[lo, hi]`` whose bit length is uniform: every magnitude gets its share."""
    bits = draw(st.integers(lo.bit_length(), hi.bit_length()))
    a, b = max(lo, (1 << bits) >> 1), min(hi, (1 << bits) - 1)
    return draw(st.integers(a, b)) if a <= b else draw(st.integers(lo, hi))


def _ints(bs: int | st.SearchStrategy[int] | None, lo: int, hi: int) -> st.SearchStrategy[int]:
    if isinstance(bs, int):
        return st.just(bs)
    return bs if bs is not None else log_uniform(lo, hi)


def batch_sizes(max_bs: int) -> st.SearchStrategy[int]:
    """``bs`` in ``[0, max_bs]``, every magnitude about equally likely."""
    return log_uniform(0, max_bs)


@st.composite
def chunk_and_bs(
    draw: st.DrawFn, max_chunk: int, max_bs: int, max_slices: int
) -> tuple[int | None, int]:
    """``(chunk_size, bs)``. Two times in five ``chunk_size=None`` (the functions' defaults, and
    what lets ``auto`` pick its own strategy and slices), with ``bs`` a third of the time at a
    block edge (``BLOCK_EDGE_BS``), a third in ``SEGMENTS_BAND``, else any up to ``max_bs``.
    Otherwise a chunk in ``[1, max_chunk]`` and ``bs`` at most ``max_slices`` slices of it, a
    third of the time an exact multiple of the chunk or one either side."""
    if draw(st.integers(0, 4)) < 2:
        edges = [n for n in BLOCK_EDGE_BS if n <= max_bs]
        band = (min(SEGMENTS_BAND[0], max_bs), min(SEGMENTS_BAND[1], max_bs))
        pick = draw(st.integers(0, 2))
        if pick == 0 and edges:
            return None, draw(st.sampled_from(edges))
        if pick == 1:
            return None, draw(st.integers(*band))
        return None, draw(batch_sizes(max_bs))
    edges = sorted({1, 2, max_chunk // 2, max_chunk - 1, max_chunk} - {0})
    chunk = draw(st.one_of(log_uniform(1, max_chunk), st.sampled_from(edges)))
    cap = min(max_bs, chunk * max_slices)
    near = sorted({k * chunk + d for k in (1, 2, 3) for d in (-1, 0, 1)} - {-1})
    near = [n for n in near if n <= cap]
    if near and draw(st.integers(0, 2)) == 0:
        return chunk, draw(st.sampled_from(near))
    return chunk, draw(batch_sizes(cap))


# ---------------------------------------------------------------- scatter


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
    lens: torch.Tensor, *, width: int, spare_rows: int, seed: int, device: str | torch.device
) -> ScatterCase:
    """Random token ids over the whole int64 range and distinct random pool rows, made on
    ``device`` from ``seed``."""
    dev = torch.device(device)
    g = torch.Generator(device=dev).manual_seed(seed)
    lens = lens.to(dev, torch.int64)
    bs = int(lens.numel())
    offsets = offsets_from_lens(lens)
    total = int(offsets[-1]) if bs else 0
    flat_in = torch.randint(-_I64_MAX, _I64_MAX, (total,), generator=g, device=dev)
    rows = bs + spare_rows
    rpi = torch.randperm(rows, generator=g, device=dev)[:bs].to(torch.int64)
    return ScatterCase(flat_in, offsets, rpi, rows, int(width))


@st.composite
def scatter_cases(
    draw: st.DrawFn,
    max_bs: int,
    max_len: int,
    max_width: int,
    device: str | torch.device = "cpu",
    *,
    bs: int | st.SearchStrategy[int] | None = None,
    max_tokens: int | None = None,
    max_pool_elems: int = 1 << 22,
    big_tokens: int = 0,
    gpu_sizes: bool = False,
) -> ScatterCase:
    """A whole scatter batch: many empty segments, some longer than the pool width, spare
    (never written) pool rows. ``bs`` fixes the batch size or gives its strategy."""
    max_tokens = max_tokens if max_tokens is not None else max_bs * max_len
    n = draw(_ints(bs, 0, max_bs))
    spare_rows = draw(st.integers(0, 3))
    rows = n + spare_rows
    width = draw(st.integers(1, max(1, min(max_width, max_pool_elems // max(rows, 1)))))
    seed = draw(st.integers(0, 2**32 - 1))
    long_mean = min(SEGMENTS_MAX_MEAN + 2, max_len, max_tokens // max(n, 1))
    if n >= SEGMENTS_MIN_BS and long_mean >= SEGMENTS_MIN_MEAN and draw(st.integers(0, 3)):
        # Long runs (scatter "auto" takes "segments"), the mean near either edge of its range.
        lo = SEGMENTS_MIN_MEAN - 2
        mean = draw(st.one_of(st.integers(lo, lo + 4), st.integers(lo, long_mean)))
        lens = _partition(n, mean * n, draw(st.sampled_from([0.0, 0.1])), max_len, seed)
    elif n <= _DRAWN_MAX_BS and not gpu_sizes:
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
    return build_scatter_case(lens, width=width, spare_rows=spare_rows, seed=seed, device=device)


def scatter_cases_for(
    sizes: Sizes,
    device: str | torch.device = "cpu",
    *,
    bs: int | st.SearchStrategy[int] | None = None,
) -> st.SearchStrategy[ScatterCase]:
    """``scatter_cases`` with the bounds of ``sizes``."""
    return scatter_cases(
        sizes.max_bs,
        sizes.max_len,
        sizes.max_width,
        device,
        bs=bs,
        max_tokens=sizes.max_tokens,
        max_pool_elems=sizes.max_pool_elems,
        big_tokens=sizes.big_tokens,
        gpu_sizes=sizes.gpu_sizes,
    )


# ---------------------------------------------------------------- plan


def build_plan_case(
    *,
    prefix_lens: torch.Tensor,
    extend_seq_lens: torch.Tensor,
    padding: torch.Tensor,
    max_seq_len: int,
    lut_len: int | None,
    swa_window_size: int,
    capacity_mode: str,
    capacity_delta: int,
    spare_capacity: int,
    spare_verify: int,
    seed: int,
    device: str | torch.device,
) -> PlanCase:
    """A plan batch made on ``device`` from ``seed``: distinct active pool rows (row 0 for
    padding), slots in ``req_to_token`` from -3 up to past the LUT's end, seeded requests'
    prefixes clamped to ``max_seq_len``. ``capacity_mode``: the verify capacity is ``"below"``,
    ``"at"`` or ``"above"`` the verify total, by ``capacity_delta``, or ``"int32_max"``: within
    2 below ``2**31 - 1``, the largest accepted (all modes are clamped to it)."""
    dev = torch.device(device)
    g = torch.Generator(device=dev).manual_seed(seed)
    pad = padding.to(dev, torch.bool)
    extend = extend_seq_lens.to(dev, torch.int64)
    prefix = prefix_lens.to(dev, torch.int64)
    bs = int(prefix.numel())
    seeded = ~pad & (prefix > 0) & (extend > 0)
    prefix = torch.where(seeded, prefix.clamp(max=max_seq_len), prefix)
    rows = bs + 2
    rpi = torch.randperm(rows - 1, generator=g, device=dev)[:bs].to(torch.int64) + 1
    rpi = torch.where(pad, 0, rpi)
    slot_hi = 2 * lut_len + 2 if lut_len is not None else _I32_MAX
    r2t = torch.randint(-3, slot_hi, (rows, max_seq_len), generator=g, device=dev)
    r2t = r2t.to(torch.int32)
    lut = None
    if lut_len is not None:
        lut = torch.randint(0, 2**40, (lut_len,), generator=g, device=dev)
    start = (prefix - swa_window_size).clamp(min=0) if swa_window_size > 0 else 0
    total = int(torch.where(pad, 0, (prefix - start).clamp(min=0)).sum()) if bs else 0
    if capacity_mode == "below":
        capacity = total - 1 - capacity_delta
    elif capacity_mode == "above":
        capacity = total + 1 + capacity_delta
    elif capacity_mode == "int32_max":
        capacity = _I32_MAX - capacity_delta % 3
    else:
        capacity = total
    capacity = min(max(capacity, 0), _I32_MAX)  # the largest verify_capacity accepted
    return PlanCase(
        rpi,
        prefix,
        extend,
        r2t,
        lut,
        int(swa_window_size),
        capacity,
        bs + spare_capacity,
        bs + 1 + spare_verify,
    )


def _seeded_plan_lens(
    bs: int, max_seq_len: int, params: dict, g: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    prefix = torch.randint(0, 2 * max_seq_len + 1, (bs,), generator=g)
    prefix[torch.rand(bs, generator=g) < params["zero_prefix"]] = 0
    extend = torch.randint(0, params["max_extend"] + 1, (bs,), generator=g)
    extend[torch.rand(bs, generator=g) < params["zero_extend"]] = 0
    odd = torch.rand(bs, generator=g) < params["odd_frac"]
    extend[odd] = -torch.randint(1, 3, (bs,), generator=g)[odd]
    if params["huge"]:  # int64 sums: prefixes far past any pool, where no seed is read
        huge = (torch.rand(bs, generator=g) < 0.1) & (extend <= 0)
        prefix[huge] = torch.randint(2**31, 2**36, (bs,), generator=g)[huge]
    padding = torch.rand(bs, generator=g) < params["pad_frac"]
    return prefix, extend, padding


def _extreme_lens(
    prefix: torch.Tensor,
    extend: torch.Tensor,
    padding: torch.Tensor,
    max_seq_len: int,
    totals: tuple[int, int],
    seed: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Lengths whose verify and write totals (no window) are exactly ``totals``: up to three
    active requests take the verify rest as prefixes (their extend zeroed: no seed is read),
    up to two others the write rest as extends (their prefix zeroed: no seed). Unchanged when
    fewer than two requests are active or the others already exceed a target."""
    active = ~padding
    idx = active.nonzero()[:, 0]
    if idx.numel() < 2:
        return prefix, extend
    g = torch.Generator().manual_seed(seed)
    idx = idx[torch.randperm(idx.numel(), generator=g)]
    k = min(3, idx.numel() - 1)
    big_v, big_w = idx[:k], idx[k : k + 2]
    prefix, extend = prefix.clone(), extend.clone()
    seeded = active & (prefix > 0) & (extend > 0)  # build_plan_case clamps these prefixes
    prefix = torch.where(seeded, prefix.clamp(max=max_seq_len), prefix)
    big = torch.cat([big_v, big_w])
    prefix[big], extend[big] = 0, 0
    for t, chosen, total in ((prefix, big_v, totals[0]), (extend, big_w, totals[1])):
        rest = total - int(torch.where(active, t.clamp(min=0), 0).sum())
        if rest < 0:
            return prefix, extend  # smaller targets than the lengths already hold: no extreme
        for i, j in enumerate(chosen.tolist()):
            t[j] = rest // len(chosen) + (rest % len(chosen) if i == 0 else 0)
    return prefix, extend


@st.composite
def plan_cases(
    draw: st.DrawFn,
    max_bs: int,
    device: str | torch.device = "cpu",
    *,
    bs: int | st.SearchStrategy[int] | None = None,
    max_seq_len: int = 48,
    max_pool_elems: int = 1 << 22,
    gpu_sizes: bool = False,
) -> PlanCase:
    """A whole plan batch: many zero prefixes and extends (a few negative), prefixes past the
    pool where no seed is read, padding rows, SWA windows with and without LUTs (shorter than
    the slot range), one case in six with int64-extreme totals (``EXTREME_TOTALS``), verify
    capacities below, at and above the total or at int32's end, spare output capacity."""
    n = draw(_ints(bs, 0, max_bs))
    width = draw(st.integers(1, max(1, min(max_seq_len, max_pool_elems // (n + 2)))))
    seed = draw(st.integers(0, 2**32 - 1))
    if n <= _DRAWN_MAX_BS and not gpu_sizes:
        req = st.tuples(
            st.one_of(st.just(0), st.integers(-2, 2 * width)),
            st.one_of(st.just(0), st.integers(-2, 9)),
            st.booleans(),
        )
        reqs = draw(st.lists(req, min_size=n, max_size=n))
        prefix = torch.tensor([r[0] for r in reqs], dtype=torch.int64)
        extend = torch.tensor([r[1] for r in reqs], dtype=torch.int64)
        padding = torch.tensor([r[2] for r in reqs], dtype=torch.bool)
    else:
        params = dict(
            zero_prefix=draw(st.sampled_from([0.0, 0.3, 0.9])),
            zero_extend=draw(st.sampled_from([0.0, 0.5, 1.0])),
            max_extend=draw(st.sampled_from([1, 8, 4096])),
            odd_frac=draw(st.sampled_from([0.0, 0.05])),
            pad_frac=draw(st.sampled_from([0.0, 0.25, 0.9, 1.0])),
            huge=draw(st.integers(0, 7)) == 0,
        )
        g = torch.Generator().manual_seed(seed)
        prefix, extend, padding = _seeded_plan_lens(n, width, params, g)
    extreme = draw(st.integers(0, 5)) == 0  # int64 totals: no window, which would cap them
    if extreme:
        totals = (draw(st.sampled_from(EXTREME_TOTALS)), draw(st.sampled_from(EXTREME_TOTALS)))
        prefix, extend = _extreme_lens(prefix, extend, padding, width, totals, seed)
    use_lut = draw(st.integers(0, 3)) > 0
    lut_len = draw(st.integers(1, 4 * width + 4)) if use_lut else None
    # A window without a LUT applies the window and translates no seed (upstream's launcher).
    window = 0 if extreme else draw(st.one_of(st.just(0), st.integers(1, 2 * width)))
    return build_plan_case(
        prefix_lens=prefix,
        extend_seq_lens=extend,
        padding=padding,
        max_seq_len=width,
        lut_len=lut_len,
        swa_window_size=window,
        capacity_mode=draw(st.sampled_from(["below", "at", "above", "int32_max"])),
        capacity_delta=draw(st.one_of(st.just(0), st.integers(0, 1000))),
        spare_capacity=draw(st.integers(0, 3)),
        spare_verify=draw(st.integers(0, 3)),
        seed=seed,
        device=device,
    )


def plan_cases_for(
    sizes: Sizes,
    device: str | torch.device = "cpu",
    *,
    bs: int | st.SearchStrategy[int] | None = None,
) -> st.SearchStrategy[PlanCase]:
    """``plan_cases`` with the bounds of ``sizes``."""
    return plan_cases(
        sizes.max_bs,
        device,
        bs=bs,
        max_seq_len=sizes.max_seq_len,
        max_pool_elems=sizes.max_pool_elems,
        gpu_sizes=sizes.gpu_sizes,
    )
