"""Size regimes (``Sizes``, ``SIZES``) and the draws every input strategy shares: log-uniform
integers, batch sizes, and ``(chunk_size, bs)`` pairs that reach block edges, the first batch
sizes scatter ``auto`` sends to ``capped``, and near multiples of the chunk."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from hypothesis import strategies as st

from kvcanary_kernels import PLAN_BATCH_BLOCK, SCATTER_BATCH_BLOCK

from ..launch_plan import AUTO_PLAN_CHUNK
from ..scatter_shapes import ROWS_MAX_BS

I64_MAX = 2**63 - 1
I32_MAX = 2**31 - 1
DRAWN_MAX_BS = 24  # up to this bs, lengths are drawn one by one (unless gpu_sizes)
# Batch sizes at the blocks' edges: plan "auto"'s slice (256 requests), scatter's fixed block
# (512), plan's (4096); one below, at and one past each.
_EDGES = (AUTO_PLAN_CHUNK, SCATTER_BATCH_BLOCK, PLAN_BATCH_BLOCK)
BLOCK_EDGE_BS = tuple(edge + d for edge in _EDGES for d in (-1, 0, 1))
# The smallest batch sizes scatter "auto" sends to "capped" (past "rows").
CAPPED_BAND = (ROWS_MAX_BS + 1, ROWS_MAX_BS + 17)

Device = str | torch.device
# A fixed batch size, a strategy for it, or None (the generator's own log-uniform draw).
BatchSize = int | st.SearchStrategy[int] | None


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

    def bounds(self, *names: str) -> dict:
        """The named bounds as keyword arguments (a generator's parameters share their names)."""
        return {name: getattr(self, name) for name in names}


# Every bound in the two regimes, side by side: (ci, gpu). Triton's interpreter runs programs
# one by one (~1 ms a scatter program, ~5 ms a plan one), so ci stays small.
_REGIMES = ("ci", "gpu")
_BOUNDS = {
    "max_bs": (BLOCK_EDGE_BS[-1], 131_072),
    "max_len": (600, 1 << 24),
    "max_width": (64, 4096),
    "max_tokens": (20_000, 16_000_000),
    "max_seq_len": (48, 1024),
    "max_slices": (48, 4096),
    "max_pool_elems": (1 << 20, 1 << 28),
    "big_tokens": (0, 10_000_000),
    "gpu_sizes": (False, True),
    "min_examples": (60, 0),
}
SIZES: dict[str, Sizes] = {
    regime: Sizes(**{name: values[i] for name, values in _BOUNDS.items()})
    for i, regime in enumerate(_REGIMES)
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


def batch_size_strategy(bs: BatchSize, lo: int, hi: int) -> st.SearchStrategy[int]:
    """``bs`` as a strategy: itself, ``just`` it, or (``None``) log-uniform in ``[lo, hi]``."""
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
    block edge (``BLOCK_EDGE_BS``), a third in ``CAPPED_BAND``, else any up to ``max_bs``
    (edges and band only where they lie within ``max_bs``; otherwise the plain draw stands).
    Otherwise a chunk in ``[1, max_chunk]`` and ``bs`` at most ``max_slices`` slices of it, a
    third of the time an exact multiple of the chunk or one either side.

    The branch is drawn first, then the plain ``bs``, then (for an edge, band or near
    multiple) the draw that replaces it. The plain draw is made on every branch, so the
    shrinker can trade a lower branch for a larger plain ``bs``: a failure that any batch size
    shows can shrink past an edge (255) or a multiple of the chunk to the smallest batch. The
    shrinker does not always find that trade: with some seeds such a failure stays at an edge
    (a planted bug failing every ``bs >= 3`` shrank to 3 with seeds 0, 1 and 4 of ``fuzz
    --op scatter --examples 50``, to 255 with seeds 2, 3 and 7). (A
    branch whose set lies past ``max_bs`` would pin ``bs`` to ``max_bs``, where that trade
    may be out of reach once the unused plain draw has shrunk: such a branch draws nothing.)"""
    if draw(st.integers(0, 4)) < 2:
        pick = draw(st.integers(0, 2))
        bs = draw(batch_sizes(max_bs))
        edges = [n for n in BLOCK_EDGE_BS if n <= max_bs]
        if pick == 1 and edges:
            bs = draw(st.sampled_from(edges))
        elif pick == 2 and CAPPED_BAND[0] <= max_bs:
            bs = draw(st.integers(CAPPED_BAND[0], min(CAPPED_BAND[1], max_bs)))
        return None, bs
    edges = sorted({1, 2, max_chunk // 2, max_chunk - 1, max_chunk} - {0})
    chunk = draw(st.one_of(log_uniform(1, max_chunk), st.sampled_from(edges)))
    cap = min(max_bs, chunk * max_slices)
    near = sorted({k * chunk + d for k in (1, 2, 3) for d in (-1, 0, 1)} - {-1})
    near = [n for n in near if n <= cap]
    pick = draw(st.integers(0, 2))
    bs = draw(batch_sizes(cap))
    if near and pick == 2:
        bs = draw(st.sampled_from(near))
    return chunk, bs
