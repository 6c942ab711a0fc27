"""The benchmark workloads: batch sizes, length mixes and case builders (seeded, reproducible)."""

from __future__ import annotations

import torch

from kvcanary_kernels.plan_checks import INT32_MAX

from ..testing.cases import PlanCase, ScatterCase, make_plan_case, make_scatter_case

BATCH_SIZES = (1, 64, 511, 512, 4096, 32768, 131072)
POOL_WIDTH = 8192
# Segment-length mixes: name -> inclusive upper bound of a uniform draw (1 = every length 1).
MIXES = {"ones": None, "u128": 128, "u1024": 1024}
PLAN_MAX_SEQ_LEN = 1024


def segment_lengths(bs: int, mix: str, seed: int = 0) -> torch.Tensor:
    hi = MIXES[mix]
    if hi is None:
        return torch.ones(bs, dtype=torch.int64)
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, hi + 1, (bs,), generator=g, dtype=torch.int64)


def scatter_workload(
    bs: int, mix: str, device: torch.device, width: int = POOL_WIDTH, seed: int = 0
) -> ScatterCase:
    return make_scatter_case(segment_lengths(bs, mix, seed), width=width, seed=seed, device=device)


def written_tokens(case: ScatterCase) -> int:
    """Tokens a scatter must move: each segment clamped to the pool width."""
    return int(case.written_lens.sum())


def plan_workload(bs: int, device: torch.device, seed: int = 0) -> PlanCase:
    """Decode-like batch: prefixes U(0, 1024), 1-8 new tokens, 10% padding, SWA window 512 with
    a LUT, verify capacity 3x the pool's slots (the upstream sizing), at most int32's largest
    (the plan's limit: from bs = 699 049 the upstream sizing passes it)."""
    g = torch.Generator().manual_seed(seed)
    return make_plan_case(
        prefix_lens=torch.randint(0, PLAN_MAX_SEQ_LEN + 1, (bs,), generator=g),
        extend_seq_lens=torch.randint(1, 9, (bs,), generator=g),
        padding=torch.rand(bs, generator=g) < 0.1,
        max_seq_len=PLAN_MAX_SEQ_LEN,
        lut_len=1 << 20,
        swa_window_size=512,
        verify_capacity=min(3 * (bs + 2) * PLAN_MAX_SEQ_LEN, INT32_MAX),
        seed=seed,
        device=device,
    )
