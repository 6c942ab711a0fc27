"""CUDA graphs: a dispatched scatter and plan captured once for a fixed bs, then replayed on
inputs refilled in place with new data of the same shapes, equal the torch reference."""

from __future__ import annotations

import pytest
import torch
from _helpers import expect_auto_tails_first, long_runs_case, plan_case_at_total
from conftest import DEVICE, capture_graph

from kvcanary_dispatch import plan_offsets, scatter_req_token_ids
from kvcanary_dispatch.launch_plan import plan_offsets_launch_plan
from kvcanary_dispatch.testing.cases import POISON_I32, assert_bytes_equal
from kvcanary_dispatch.testing.engine_steps import poison_
from kvcanary_dispatch.testing.strategies import build_scatter_case
from kvcanary_kernels import plan_offsets_ref, scatter_req_token_ids_ref

pytestmark = pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs need a GPU")

BS = 3000
WIDTH = 16


def _scatter_lens(total: int, seed: int) -> torch.Tensor:
    """``BS`` lengths summing to ``total`` (a random partition: many short, some empty)."""
    g = torch.Generator().manual_seed(seed)
    cuts = torch.sort(torch.randint(0, total + 1, (BS - 1,), generator=g)).values
    bounds = torch.cat([torch.zeros(1, dtype=torch.int64), cuts, torch.tensor([total])])
    return bounds.diff()


def _scatter(seed: int, total: int):
    return build_scatter_case(
        _scatter_lens(total, seed), width=WIDTH, spare_rows=5, seed=seed, device=DEVICE
    )


def _replay_scatter(case, pool, graph, news: dict) -> None:
    """Per ``seed: new`` case (``case``'s shapes): refill ``case``'s inputs in place with
    ``new``'s, poison ``pool``, replay ``graph`` and compare ``pool`` byte for byte with the
    reference."""
    for seed, new in news.items():
        for name in ("flat_in", "offsets", "req_pool_indices"):
            getattr(case, name).copy_(getattr(new, name))
        pool.fill_(POISON_I32)
        graph.replay()
        want = case.fresh_pool()
        scatter_req_token_ids_ref(**case.kwargs(want))
        torch.cuda.synchronize()
        assert_bytes_equal(pool, want, f"pool_out after replay {seed}")


@pytest.mark.parametrize(
    "strategy,chunk",
    [
        ("auto", None),
        ("capped", None),
        ("flat", None),
        ("segments", None),
        ("sliced", None),
        ("sliced", 100),
    ],
)
def test_scatter_graph_replay(strategy, chunk):
    total = 12 * BS
    case = _scatter(0, total)
    pool = case.fresh_pool()
    graph = capture_graph(
        lambda: scatter_req_token_ids(**case.kwargs(pool), chunk_size=chunk, strategy=strategy)
    )
    _replay_scatter(case, pool, graph, {seed: _scatter(seed, total) for seed in (1, 2, 3)})


def test_scatter_graph_replay_tails_first():
    """``auto``'s shape for means past 512 on a pool wider than 8 steps (4 head steps, the tail
    programs first), captured once and replayed with the giant run moved each time (first in
    one replay, so that the first tail program has work)."""
    case = long_runs_case(0, device=DEVICE)
    expect_auto_tails_first(case)
    pool = case.fresh_pool()
    graph = capture_graph(lambda: scatter_req_token_ids(**case.kwargs(pool)))
    news = {
        seed: long_runs_case(seed, at=0 if seed == 1 else None, device=DEVICE) for seed in (1, 2, 3)
    }
    _replay_scatter(case, pool, graph, news)


def _plan(seed: int):
    shape = dict(width=WIDTH, lut_len=2 * WIDTH, swa_window_size=5, spare=(4, 4))
    return plan_case_at_total(BS, seed, extend=(-1, 6), pad_p=0.2, device=DEVICE, **shape)


# At BS = 3000 auto recounts on its own slices and on 1 024-request ones, and (while capturing)
# scans 100-request ones (plan_offsets_launch_plan says which: asserted below); lookback fills
# a fresh state in the graph; loop zeroes its carried totals in the graph, then makes 30
# fixed-block launches.
PLAN_GRAPHS = [
    ("auto", None, "recount"), ("auto", 1024, "recount"), ("auto", 100, "scan"),
    ("scan", 512, "scan"), ("lookback", 100, "lookback"), ("recount", 100, "recount"),
    ("loop", 100, "loop"),
]  # fmt: skip


@pytest.mark.parametrize("strategy,chunk,runs", PLAN_GRAPHS)
def test_plan_graph_replay(strategy, chunk, runs):
    assert plan_offsets_launch_plan(BS, chunk, strategy, capturing=True).strategy == runs
    case = _plan(0)
    outs = case.fresh_outputs()
    graph = capture_graph(
        lambda: plan_offsets(**case.inputs(), **outs, chunk_size=chunk, strategy=strategy)
    )
    for seed in (1, 2, 3):
        new = _plan(seed)
        case.refill_from(new)
        poison_(*outs.values())
        graph.replay()
        want = case.fresh_outputs()
        plan_offsets_ref(**case.inputs(), **want)  # the captured verify_capacity, as replayed
        torch.cuda.synchronize()
        for name, t in want.items():
            assert_bytes_equal(outs[name], t, f"{name} after replay {seed}")
