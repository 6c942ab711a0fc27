"""The distribution benchmark's batches: the pool widths it runs them on (``--width``), which
must hold every run whole and, where a run allows, keep a pool within ``POOL_MAX_BYTES``."""

from __future__ import annotations

import pytest
import torch

from benchmarks import distributions
from benchmarks.distributions import POOL_MAX_BYTES, WIDTH, distribution_case

ENGINE_WIDTH = 131_072


@pytest.mark.parametrize(
    "name,width_floor,want",
    [
        ("tiny_8", WIDTH, WIDTH),
        ("tiny_8", ENGINE_WIDTH, ENGINE_WIDTH),
        ("segments_worst_128", WIDTH, 16_384),  # its 16 384-token run
        ("segments_worst_128", ENGINE_WIDTH, ENGINE_WIDTH),
        ("lognormal2_16384", WIDTH, 125_952),  # its tail's 125 343-token run, uncut
        ("ones_32768", ENGINE_WIDTH, ENGINE_WIDTH),  # 16 GiB: within the cap
        ("ones_262144", WIDTH, WIDTH),
        ("ones_262144", ENGINE_WIDTH, 31_744),  # 262 145 rows: 128 GiB at the floor's width
    ],
)
def test_pool_width(name, width_floor, want):
    case = distribution_case(name, torch.device("cpu"), width_floor=width_floor)
    longest = int(case.offsets.diff().max())
    assert case.width == want
    assert case.width % 1024 == 0 and case.width >= longest  # every run whole
    assert 4 * case.pool_rows * case.width <= POOL_MAX_BYTES


def test_a_huge_floor_is_narrowed_to_the_cap():
    case = distribution_case("prefills_64", torch.device("cpu"), width_floor=1 << 40)
    assert case.width == POOL_MAX_BYTES // (4 * case.pool_rows) // 1024 * 1024


def test_the_cap_never_cuts_a_run(monkeypatch):
    monkeypatch.setattr(distributions, "POOL_MAX_BYTES", 1 << 20)  # 2 032 columns at 129 rows
    case = distribution_case("segments_worst_128", torch.device("cpu"), width_floor=ENGINE_WIDTH)
    assert case.width == 16_384  # its longest run: not the floor, not the cap's 1 024


def test_quick_batches_take_16_column_units():
    """``--quick`` (the interpreter's sizes): the floor 64x narrower, runs rounded to 16."""
    case = distribution_case("segments_worst_128", torch.device("cpu"), quick=True)
    assert (case.bs, int(case.offsets.diff().max()), case.width) == (4, 256, 256)
    case = distribution_case("tiny_8", torch.device("cpu"), quick=True)
    assert case.width == WIDTH // 64
