"""Helpers shared by the test modules (and ``tests/gpu/sanitize.py``): random plan cases,
calls with some keywords replaced, the comparison of an engine step's outputs, and rejected
calls that launch nothing and leave their outputs as they were. Nothing here imports
``conftest``."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from kvcanary_dispatch import scatter_req_token_ids
from kvcanary_dispatch.testing.cases import (
    EngineStep,
    PlanCase,
    ScatterCase,
    assert_bytes_equal,
    expect_plan,
    expect_scatter,
    make_plan_case,
)
from kvcanary_dispatch.testing.properties import record_launches
from kvcanary_dispatch.testing.strategies import build_plan_case


def random_plan_lens(
    g: torch.Generator | int,
    bs: int,
    *,
    prefix_hi: int,
    extend: tuple[int, int],
    pad_p: float,
) -> dict[str, torch.Tensor]:
    """Random lengths of ``bs`` requests, drawn from ``g`` (an int: a fresh generator with that
    seed) in this order: ``prefix_lens`` in ``[0, prefix_hi)``, ``extend_seq_lens`` in
    ``[extend[0], extend[1])``, then ``padding`` (each request padding with probability
    ``pad_p``): keywords of ``make_plan_case`` / ``build_plan_case``."""
    if isinstance(g, int):
        g = torch.Generator().manual_seed(g)
    return dict(
        prefix_lens=torch.randint(0, prefix_hi, (bs,), generator=g),
        extend_seq_lens=torch.randint(*extend, (bs,), generator=g),
        padding=torch.rand(bs, generator=g) < pad_p,
    )


def plan_case_32(
    bs: int, seed: int, *, device, extend: tuple[int, int] = (-1, 6), **kw
) -> PlanCase:
    """``make_plan_case`` of ``bs`` random requests (``random_plan_lens`` seeded with ``seed``:
    prefixes in ``[0, 33)``, a fifth padding) over a ``req_to_token`` 32 wide, with a LUT of 40
    and a window of 8; ``kw`` (``verify_capacity``, ``lut_len``, ...) overrides."""
    lens = random_plan_lens(seed, bs, prefix_hi=33, extend=extend, pad_p=0.2)
    args = dict(max_seq_len=32, lut_len=40, swa_window_size=8, seed=seed, device=device)
    return make_plan_case(**lens, **{**args, **kw})


def plan_case_at_total(
    bs: int,
    seed: int,
    *,
    width: int,
    extend: tuple[int, int],
    pad_p: float,
    spare: tuple[int, int],
    device,
    **kw,
) -> PlanCase:
    """``build_plan_case`` of ``bs`` random requests (``random_plan_lens`` seeded with ``seed``:
    prefixes in ``[0, 2 * width)``) over a ``req_to_token`` ``width`` wide, the verify capacity
    exactly the verify total; ``spare``: ``(spare_capacity, spare_verify)``; ``kw``
    (``lut_len``, ``swa_window_size``, ...) overrides."""
    lens = random_plan_lens(seed, bs, prefix_hi=2 * width, extend=extend, pad_p=pad_p)
    at_total = dict(capacity_mode="at", capacity_delta=0, seed=seed, device=device)
    spares = dict(spare_capacity=spare[0], spare_verify=spare[1])
    return build_plan_case(**{**lens, "max_seq_len": width, **at_total, **spares, **kw})


def plan_step_kwargs(case: PlanCase, **over) -> dict:
    """``ForwardStepGuard.plan_step``'s keywords for ``case``: its inputs but the verify
    capacity (the guard's own), with ``over`` added or in their place."""
    kw = case.inputs()
    del kw["verify_capacity"]
    return {**kw, **over}


def scatter_with(
    case: ScatterCase, pool: torch.Tensor, fn: Callable[..., None] = scatter_req_token_ids, **kw
) -> None:
    """``fn`` (``scatter_req_token_ids`` by default) on ``case`` into ``pool``, with the keywords
    ``kw`` added or put in place of the case's own (``offsets=...``)."""
    fn(**{**case.kwargs(pool), **kw})


def expect_step(step: EngineStep, pool: torch.Tensor, plan_out: dict, what: str) -> None:
    """Both outputs of an engine step (poisoned whole before it) equal the references."""
    expect_scatter(step.scatter, pool, what)
    expect_plan(step.plan, plan_out, what)


def rejected(exc: type[Exception], call: Callable[[], object], outputs: list[torch.Tensor]) -> str:
    """``call()`` raises ``exc`` before any launch and leaves ``outputs`` as they were, byte for
    byte; returns the message."""
    before = [t.clone() for t in outputs]
    with record_launches() as launches, pytest.raises(exc) as info:
        call()
    assert not launches, launches
    for t, b in zip(outputs, before, strict=True):
        assert_bytes_equal(t, b, "output after a rejected call")
    return str(info.value)
