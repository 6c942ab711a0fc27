"""The fixed-block kernels against their torch references, byte for byte (their launchers'
errors: tests/test_kernel_launcher_errors.py)."""

from __future__ import annotations

import pytest
import torch
from _helpers import fixed_block_plan, plan_case_32, random_plan_lens
from conftest import DEVICE

from kvcanary_dispatch.testing.cases import (
    check_plan,
    check_scatter,
    make_plan_case,
    make_scatter_case,
)
from kvcanary_kernels import (
    PLAN_BATCH_BLOCK,
    SCATTER_BATCH_BLOCK,
    launch_plan_offsets_kernel,
    launch_scatter_req_token_ids_kernel,
)

# ---------------------------------------------------------------- scatter, results

SCATTER_EDGES = {
    "bs0": ([], 4),
    "bs1": ([3], 4),
    "bs1_empty": ([0], 4),
    "all_empty": ([0] * 9, 4),
    "longer_than_width": ([9, 1, 17, 0, 4], 4),
    "width1": ([3, 0, 2], 1),
    "mixed": ([0, 5, 0, 0, 1, 300, 2], 64),
    "span_token_blocks": ([700, 1, 300], 1024),
}


@pytest.mark.parametrize("name", SCATTER_EDGES)
def test_scatter_edges(name):
    lens, width = SCATTER_EDGES[name]
    check_scatter(
        launch_scatter_req_token_ids_kernel, make_scatter_case(lens, width=width, device=DEVICE)
    )


@pytest.mark.parametrize("block", [2, 8, 64, SCATTER_BATCH_BLOCK])
def test_scatter_bs_exactly_at_block(block):
    g = torch.Generator().manual_seed(block)
    lens = torch.randint(0, 6, (block - 1,), generator=g)
    case = make_scatter_case(lens, width=4, device=DEVICE, seed=block)
    check_scatter(launch_scatter_req_token_ids_kernel, case, batch_block=block)


@pytest.mark.parametrize("seed", range(4))
def test_scatter_random(seed):
    g = torch.Generator().manual_seed(seed)
    bs = int(torch.randint(0, 200, (1,), generator=g))
    lens = torch.randint(0, 40, (bs,), generator=g) * (torch.rand(bs, generator=g) < 0.7)
    case = make_scatter_case(
        lens, width=int(torch.randint(1, 48, (1,), generator=g)), seed=seed, device=DEVICE
    )
    check_scatter(launch_scatter_req_token_ids_kernel, case, batch_block=256)


# ---------------------------------------------------------------- plan, results

PLAN_EDGES = {
    "bs0": dict(prefix_lens=[], extend_seq_lens=[]),
    "bs1": dict(prefix_lens=[4], extend_seq_lens=[2]),
    "bs1_no_prefix": dict(prefix_lens=[0], extend_seq_lens=[3]),
    "bs1_no_extend": dict(prefix_lens=[5], extend_seq_lens=[0]),
    "padding": dict(prefix_lens=[3, 4, 5, 6], extend_seq_lens=[1, 2, 3, 4], padding=[0, 1, 1, 0]),
    "all_padding": dict(prefix_lens=[3, 4], extend_seq_lens=[1, 2], padding=[1, 1]),
    "swa": dict(
        prefix_lens=[1, 7, 16, 3], extend_seq_lens=[1, 1, 0, 2], swa_window_size=4, lut_len=200
    ),
    "swa_window_covers_all": dict(
        prefix_lens=[1, 2], extend_seq_lens=[1, 1], swa_window_size=50, lut_len=9
    ),
    "lut_clamped": dict(prefix_lens=[2, 9, 16], extend_seq_lens=[1, 4, 2], lut_len=3),
    "lut_len1": dict(prefix_lens=[2, 9], extend_seq_lens=[1, 4], lut_len=1),
    "verify_overflow": dict(prefix_lens=[9, 9, 9], extend_seq_lens=[1, 1, 1], verify_capacity=20),
    "verify_exact": dict(prefix_lens=[9, 9, 9], extend_seq_lens=[1, 1, 1], verify_capacity=27),
    "verify_zero_capacity": dict(prefix_lens=[9], extend_seq_lens=[1], verify_capacity=0),
}


@pytest.mark.parametrize("name", PLAN_EDGES)
def test_plan_edges(name):
    case = make_plan_case(max_seq_len=16, device=DEVICE, **PLAN_EDGES[name])
    check_plan(fixed_block_plan, case)


@pytest.mark.parametrize("block", [1, 2, 16, PLAN_BATCH_BLOCK])
def test_plan_bs_exactly_at_block(block):
    case = plan_case_32(block, block, extend=(0, 5), verify_capacity=block * 4, device=DEVICE)
    check_plan(fixed_block_plan, case, bs_block=block)


@pytest.mark.parametrize("seed", range(4))
def test_plan_random(seed):
    g = torch.Generator().manual_seed(seed)
    bs = int(torch.randint(0, 300, (1,), generator=g))
    use_lut = seed % 2 == 0
    case = make_plan_case(
        **random_plan_lens(g, bs, prefix_hi=65, extend=(-2, 9), pad_p=0.3),
        max_seq_len=64,
        lut_len=50 if use_lut else None,
        swa_window_size=int(torch.randint(1, 20, (1,), generator=g)) if use_lut else 0,
        verify_capacity=int(torch.randint(0, 40 * max(bs, 1), (1,), generator=g)),
        device=DEVICE,
        seed=seed,
    )
    check_plan(fixed_block_plan, case, bs_block=512)


def test_plan_carry_chains_slices():
    """Consecutive launches with a carry equal one launch over the whole batch."""
    bs = 37
    case = make_plan_case(
        **random_plan_lens(7, bs, prefix_hi=20, extend=(0, 5), pad_p=0.3),
        max_seq_len=20,
        verify_capacity=150,
        device=DEVICE,
    )

    def chained(**kw):
        carry = torch.zeros(3, dtype=torch.int64, device=DEVICE)
        ins = ("req_pool_indices", "prefix_lens", "extend_seq_lens")
        for s in range(0, bs, 8):
            e = min(s + 8, bs)
            sliced = {k: kw[k][s:e] for k in ins}
            launch_plan_offsets_kernel(
                **sliced,
                req_to_token=kw["req_to_token"],
                full_to_swa_index_mapping=None,
                out_verify_offsets_scratch=kw["out_verify_offsets"][s:],
                out_write_offsets=kw["out_write_offsets"][s:],
                out_write_seed_slot_indices=kw["out_write_seed_slot_indices"][s:],
                out_verify_num_valid=kw["out_verify_num_valid"],
                out_verify_enable=kw["out_verify_enable"],
                out_write_num_valid_reqs=kw["out_write_num_valid_reqs"],
                swa_window_size=0,
                verify_capacity=kw["verify_capacity"],
                bs_block=8,
                carry=carry,
            )

    check_plan(chained, case)
