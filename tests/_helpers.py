"""Helpers shared by the test modules (and ``tests/gpu/sanitize.py``): random plan cases, a
poisoned pool between guard rows, calls with some keywords replaced, the dispatcher's keywords,
a guard with poisoned buffers and the check that they stayed so, forward steps of chosen
requests, the comparison of an engine step's outputs, rejected calls that launch nothing and
leave their outputs as they were, and layouts of tensors in one workspace (a pool sharing
memory with an input, inputs between a pool window's rows, plan outputs sharing memory with an
input or each other), and a call timed behind queued GPU work with every sync refused.
Nothing here imports ``conftest``."""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import TypeVar

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kvcanary_dispatch import scatter_req_token_ids
from kvcanary_dispatch.forward_step import ForwardStepGuard
from kvcanary_dispatch.launch_plan import scatter_launch_plan
from kvcanary_dispatch.resident import buffers
from kvcanary_dispatch.testing.cases import (
    PLAN_OUT_NAMES,
    POISON_I32,
    PlanCase,
    ScatterCase,
    assert_bytes_equal,
    make_plan_case,
)
from kvcanary_dispatch.testing.engine_steps import (
    EngineStep,
    expect_plan,
    expect_scatter,
)
from kvcanary_dispatch.testing.properties import record_launches
from kvcanary_dispatch.testing.scatter_inputs import BROKEN_OFFSETS
from kvcanary_dispatch.testing.strategies import build_plan_case, build_scatter_case
from kvcanary_kernels import launch_plan_offsets_kernel
from kvcanary_kernels.args import ScatterArgs
from kvcanary_kernels.scatter_capped import capped_grid, launch_scatter_capped

T = TypeVar("T")


def strided_view(t: torch.Tensor, fill: int = 0) -> torch.Tensor:
    """``t``'s values (a vector) in every other element of a buffer filled with ``fill``: a
    view of stride 2, not contiguous."""
    wide = torch.full((2 * t.numel(),), fill, dtype=t.dtype, device=t.device)
    wide[::2] = t
    return wide[::2]


# Each BROKEN_OFFSETS list as an ``offsets`` parameter, named by its key.
BAD_OFFSETS = pytest.mark.parametrize(
    "offsets", list(BROKEN_OFFSETS.values()), ids=list(BROKEN_OFFSETS)
)


def guarded_pool(
    rows: int, width: int, device, spare_cols: int = 0, guard_rows: int = 1
) -> torch.Tensor:
    """A poisoned int32 block ``[rows + 2 * guard_rows, width + spare_cols]``: a pool of
    ``rows`` rows of ``width`` columns (``block[guard_rows:-guard_rows, :width]``) between
    ``guard_rows`` guard rows above and below and before ``spare_cols`` guard columns, so that
    a comparison of the whole block shows writes outside the pool too (with no spare column a
    write past the width lands in the next row)."""
    shape = (rows + 2 * guard_rows, width + spare_cols)
    return torch.full(shape, POISON_I32, dtype=torch.int32, device=device)


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


def random_scatter_case(
    bs: int, seed: int = 0, width: int = 4, hi: int = 7, spare_rows: int = 2, *, device
) -> ScatterCase:
    """``build_scatter_case`` of ``bs`` requests drawn from ``seed``: lengths in ``[0, hi]``,
    about 30% of them empty, over a pool ``width`` wide with ``spare_rows`` rows to spare."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(0, hi + 1, (bs,), generator=g)
    lens[torch.rand(bs, generator=g) < 0.3] = 0
    return build_scatter_case(lens, width=width, spare_rows=spare_rows, seed=seed, device=device)


def random_plan_case(bs: int, seed: int = 0, width: int = 16, *, device, **kw) -> PlanCase:
    """``plan_case_at_total`` of ``bs`` random requests (extends in ``[-1, 5)``, a quarter
    padding, spares ``(2, 1)``) over a ``req_to_token`` ``width`` wide, with a LUT of
    ``width + 3`` and a window of 6; ``kw`` overrides."""
    kw = {"lut_len": width + 3, "swa_window_size": 6, **kw}
    return plan_case_at_total(
        bs, seed, width=width, extend=(-1, 5), pad_p=0.25, spare=(2, 1), device=device, **kw
    )


def dispatch_cases(device) -> tuple[Callable[..., ScatterCase], Callable[..., PlanCase]]:
    """``random_scatter_case`` and ``random_plan_case`` making their cases on ``device``."""
    return partial(random_scatter_case, device=device), partial(random_plan_case, device=device)


def scatter_kwargs(case: ScatterCase, **over) -> dict:
    """The scatter's keywords for ``case`` into a fresh pool, with ``over`` added or in their
    place."""
    return {**case.kwargs(case.fresh_pool()), **over}


def plan_kwargs(case: PlanCase, **over) -> dict:
    """``plan_offsets``'s keywords for ``case``: its inputs and fresh outputs, with ``over``
    added or in their place."""
    return {**case.inputs(), **case.fresh_outputs(), **over}


def as_kernel_kwargs(kw: dict) -> dict:
    """``plan_offsets``'s keywords ``kw`` as the fixed-block launcher's (and the drop-in's)
    take them: ``out_verify_offsets`` passed as ``out_verify_offsets_scratch``."""
    kw = dict(kw)
    kw["out_verify_offsets_scratch"] = kw.pop("out_verify_offsets")
    return kw


def fixed_block_plan(**kw) -> None:
    """The fixed-block plan launcher called with ``plan_offsets``'s keywords (``check_plan``
    calls its function so)."""
    launch_plan_offsets_kernel(**as_kernel_kwargs(kw))


def plan_outputs(kwargs: dict) -> list[torch.Tensor]:
    """The output tensors among ``plan_offsets``'s keywords ``kwargs``."""
    return [kwargs[k] for k in PLAN_OUT_NAMES]


def plan_step_kwargs(case: PlanCase, **over) -> dict:
    """``ForwardStepGuard.plan_step``'s keywords for ``case``: its inputs but the verify
    capacity (the guard's own), with ``over`` added or in their place."""
    kw = case.inputs()
    del kw["verify_capacity"]
    return {**kw, **over}


def poisoned_guard(device, caps, policy, **kw) -> tuple[ForwardStepGuard, dict]:
    """A ``ForwardStepGuard`` on ``device`` whose buffers are all -5, and a copy of them."""
    guard = ForwardStepGuard(caps, policy, device=device, **kw)
    for t in guard.buffers.tensors().values():
        t.fill_(-5)
    return guard, {k: v.clone() for k, v in guard.buffers.tensors().items()}


def assert_guard_untouched(guard, before: dict) -> None:
    """Every buffer of ``guard`` equal to its copy in ``before``."""
    for k, v in guard.buffers.tensors().items():
        assert torch.equal(v, before[k]), k


def scatter_with(
    case: ScatterCase, pool: torch.Tensor, fn: Callable[..., None] = scatter_req_token_ids, **kw
) -> None:
    """``fn`` (``scatter_req_token_ids`` by default) on ``case`` into ``pool``, with the keywords
    ``kw`` added or put in place of the case's own (``offsets=...``)."""
    fn(**{**case.kwargs(pool), **kw})


@dataclass
class Step:
    req_pool_indices: torch.Tensor  # [bs] int64 on the host, 0 = padding
    prefix_lens: torch.Tensor
    extend_seq_lens: torch.Tensor
    req_to_token: torch.Tensor  # [rows, width] int32 on the step's device

    def lengths(self) -> dict:
        return dict(
            req_pool_indices=self.req_pool_indices,
            prefix_lens=self.prefix_lens,
            extend_seq_lens=self.extend_seq_lens,
        )

    @property
    def tokens(self) -> list[int]:
        return self.extend_seq_lens.clamp(min=0).tolist()


def random_step(reqs: list[tuple[int, int, bool]], seed: int = 0, *, device) -> Step:
    """A forward step of ``reqs``: (prefix, extend, padding) per request; distinct rows, random
    positive slots drawn from ``seed``, ``req_to_token`` on ``device``."""
    g = torch.Generator().manual_seed(seed)
    bs = len(reqs)
    prefix = torch.tensor([p for p, _, _ in reqs], dtype=torch.int64)
    extend = torch.tensor([x for _, x, _ in reqs], dtype=torch.int64)
    rows = bs + 2
    rpi = (torch.randperm(rows - 1, generator=g)[:bs] + 1).to(torch.int64)
    rpi[torch.tensor([pad for _, _, pad in reqs], dtype=torch.bool)] = 0
    width = max([p + max(x, 0) for p, x, _ in reqs], default=0) + 1
    r2t = torch.randint(1, 2**30, (rows, width), generator=g, dtype=torch.int32)
    return Step(rpi, prefix.reshape(bs), extend.reshape(bs), r2t.to(device))


def expect_step(
    step: EngineStep,
    pool: torch.Tensor,
    plan_out: dict,
    what: str,
    kept: tuple[dict, dict] | None = None,
) -> None:
    """Both outputs of an engine step (poisoned whole before it) equal the references;
    ``kept``: ``step.kept()`` taken before the step's calls, its inputs checked unchanged."""
    scatter_kept, plan_kept = kept if kept is not None else (None, None)
    expect_scatter(step.scatter, pool, what, scatter_kept)
    expect_plan(step.plan, plan_out, what, plan_kept)


def rejected(exc: type[Exception], call: Callable[[], object], outputs: list[torch.Tensor]) -> str:
    """``call()`` raises ``exc`` before any launch and leaves ``outputs`` as they were, byte for
    byte; returns the message. Launches are counted through ``record_launches``, which turns
    the one-pass launches off, so the call is then made again with them on, as an engine makes
    it (on a GPU a one pass that took the call would launch instead of raising), and must raise
    the same."""
    before = [t.clone() for t in outputs]
    with record_launches() as launches, pytest.raises(exc) as info:
        call()
    assert not launches, launches
    with pytest.raises(exc) as again:
        call()
    assert str(again.value) == str(info.value)
    # The comparisons run on the current stream, after anything a call launched there.
    for t, b in zip(outputs, before, strict=True):
        assert_bytes_equal(t, b, "output after a rejected call")
    return str(info.value)


def dropping_frames(check: Callable[..., T], *args: object, **kwargs: object) -> T:
    """``check(*args, **kwargs)``; an ``AssertionError`` it raises goes on with the locals of
    the check's frames cleared (every tensor they hold dropped), its traceback kept, so that
    hypothesis still tells failures apart by where they were raised. Hypothesis keeps a
    failing example's error while it shrinks; without this, each kept error would keep its
    comparison's reference alive (up to 20 GiB a pool in the large-address properties on a
    GPU)."""
    try:
        return check(*args, **kwargs)
    except AssertionError as err:
        traceback.clear_frames(err.__traceback__.tb_next)  # the check's frames, all finished
        raise


def lookback_states() -> list[torch.Tensor]:
    """The calling thread's plan look-back states (``kvcanary_dispatch.resident``)."""
    return [b for (name, *_), b in buffers().items() if name == "plan_lookback"]


def pool_sharing_an_input(
    case: ScatterCase, other: str, end: str
) -> tuple[dict, torch.Tensor, torch.Tensor]:
    """The case's inputs, with ``inputs[other]`` moved into a workspace ``ws`` (int64) and
    ``pool_out`` an int32 view of ``ws`` that shares one half of that input's first (``end =
    "first"``: the pool's last word) or last element (``"last"``: its first word) only; the
    input's values kept, the rest of ``ws`` -1. Returns ``(inputs, pool_out, ws)``."""
    inputs = case.inputs()
    t, n, cells = inputs[other], inputs[other].numel(), case.pool_rows * case.width
    ws = torch.full((n + cells,), -1, device=t.device)  # the input, then room for the pool
    at = 0 if end == "last" else cells  # the input's first int64 element in ws
    ws[at : at + n] = t
    inputs[other] = ws[at : at + n]
    first = 2 * (at + n) - 1 if end == "last" else 2 * at + 1 - cells  # the pool's first int32
    pool = ws.view(torch.int32)[first : first + cells].view(case.pool_rows, case.width)
    return inputs, pool, ws


def inputs_between_rows(case: ScatterCase, ws: torch.Tensor, first: int) -> dict:
    """The case's inputs moved into the rows of ``ws`` (a 2-D int32 tensor), one input a row
    from int32 column ``first`` on, as int64 views of those columns."""
    inputs = case.inputs()
    for r, name in enumerate(("flat_in", "offsets", "req_pool_indices")):
        t = inputs[name]
        gap = ws[r, first : first + 2 * t.numel()].view(torch.int64)
        gap.copy_(t)
        inputs[name] = gap
    return inputs


def plan_call(bs: int, lut: bool, device: str | torch.device) -> tuple[dict, dict]:
    """A plan call's inputs (``verify_capacity`` included) and outputs: ``bs`` requests, a LUT
    and window or neither."""
    case = make_plan_case(
        prefix_lens=[(7 * r) % 13 for r in range(bs)],
        extend_seq_lens=[1 + r % 3 for r in range(bs)],
        max_seq_len=16,
        lut_len=40 if lut else None,
        swa_window_size=4 if lut else 0,
        seed=bs,
        device=device,
    )
    inputs = {**case.inputs(), "verify_capacity": case.verify_capacity}
    return inputs, case.fresh_outputs()


def share_plan_memory(inputs: dict, outputs: dict, out: str, other: str) -> None:
    """Make ``outputs[out]`` share its last element with the first of ``other`` (an input or
    an output), ``other``'s values kept."""
    o, t = outputs[out], {**inputs, **outputs}[other]
    if o.dtype == torch.int32:  # a scalar output: the first int32 word of ``other``
        o = t.view(-1).view(torch.int32)[: o.numel()]
    else:
        ws = torch.empty(o.numel() + t.numel() - 1, dtype=o.dtype, device=o.device)
        ws[: o.numel()], ws[o.numel() - 1 :] = o, t
        o, t = ws[: o.numel()], ws[o.numel() - 1 :]
        (inputs if other in inputs else outputs)[other] = t
    outputs[out] = o


PLAN_SHARED = [
    ("out_verify_offsets", "prefix_lens"),
    ("out_write_seed_slot_indices", "req_pool_indices"),
    ("out_write_offsets", "out_write_seed_slot_indices"),
    ("out_verify_num_valid", "req_to_token"),
    ("out_verify_enable", "full_to_swa_index_mapping"),
    ("out_write_num_valid_reqs", "extend_seq_lens"),  # the last output
]


def long_runs_case(
    seed: int,
    *,
    bs: int = 600,
    total: int = 360_000,
    giant: int = 12_000,
    at: int | None = None,
    device: str = "cpu",
) -> ScatterCase:
    """``bs`` runs summing to ``total`` on a 16 384-column pool, one of them (request ``at``;
    ``None``: a place set by ``seed``) ``giant`` tokens longer. The defaults give more requests
    than ``auto`` sends to ``rows``, runs averaging 600 tokens (``capped``'s one-request head
    tiles) and a run past the 4 096-column cap: ``auto``'s tails-first shape. Same shapes for
    every seed."""
    g = torch.Generator().manual_seed(seed)
    cuts = torch.sort(torch.randint(0, total - giant + 1, (bs - 1,), generator=g)).values
    lens = torch.cat([torch.zeros(1, dtype=torch.int64), cuts, torch.tensor([total - giant])])
    lens = lens.diff()
    pick = int(torch.randint(0, bs, (1,), generator=g))
    lens[pick if at is None else at] += giant
    return build_scatter_case(lens, width=16384, spare_rows=3, seed=seed, device=device)


def expect_auto_tails_first(case: ScatterCase) -> None:
    """``auto`` plans ``case`` as ``capped`` with the tail programs first."""
    plan = scatter_launch_plan(case.bs, case.total, None, "auto", "device", case.width)
    assert plan.strategy == "capped" and dict(plan.launches[0].params)["tails_first"] == 1


def capped_launcher(**shape: int) -> Callable[..., None]:
    """The capped launcher at block parameters ``shape`` on upstream's four keywords, with the
    grid ``capped_grid`` gives."""

    def run(**kw) -> None:
        t = ScatterArgs(**kw)
        grid = capped_grid(t.bs, t.num_tokens, t.pool_out.shape[1], shape)
        launch_scatter_capped(t, grid=grid, **shape)

    return run


class OpLog(TorchDispatchMode):
    """Logs every aten op dispatched inside it, by name (``"aten.zeros.default"``)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


QUEUED_HOST_S = 0.3  # a call's host seconds behind ~1 s of queued GPU work: one that waits takes it


def seconds_behind_queued_work(call: Callable[[], object]) -> tuple[float, float]:
    """``call()`` behind ~1 s of queued GPU work, under torch's sync debug mode ("error") and
    with every ``synchronize`` (device, stream, event) raising: the seconds until it returned
    and until the GPU finished. A call that waits for the GPU returns after the queued work."""
    torch.cuda.synchronize()
    torch.cuda._sleep(int(2e9))  # ~1 s of queued GPU work
    with pytest.MonkeyPatch.context() as patch:
        for owner in (torch.cuda, torch.cuda.Stream, torch.cuda.Event):
            name = f"{owner.__name__}.synchronize"
            patch.setattr(owner, "synchronize", partial(_refused_sync, name))
        start = time.perf_counter()
        torch.cuda.set_sync_debug_mode("error")
        try:
            call()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    host_s = time.perf_counter() - start
    torch.cuda.synchronize()
    return host_s, time.perf_counter() - start


def _refused_sync(name: str, *args, **kwargs):
    raise AssertionError(f"the call ran {name}")
