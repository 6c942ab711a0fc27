"""An engine's steps for the engine-loop tests: ``engine_step`` makes a forward step's scatter
and plan over a persistent pool, ``OffsetsStaging`` places its offsets as an engine would
(device, host, a refilled staging buffer), ``poison_`` fills the outputs before a call, and
``expect_scatter`` / ``expect_plan`` compare them with the references afterwards.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvcanary_kernels import plan_offsets_ref, scatter_req_token_ids_ref
from kvcanary_kernels.references import verify_lens_ref

from .cases import (
    PLAN_OUT_NAMES,
    POISON_I32,
    POISON_I64,
    PlanCase,
    ScatterCase,
    assert_bytes_equal,
    assert_inputs_kept,
    offsets_from_lens,
    pool_storage,
)


def poison_(*tensors: torch.Tensor) -> None:
    """Fill int64 tensors with ``POISON_I64`` and the others (int32) with ``POISON_I32``."""
    for t in tensors:
        t.fill_(POISON_I64 if t.dtype == torch.int64 else POISON_I32)


def poisoned_like(t: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(t)
    poison_(out)
    return out


def expect_scatter(
    case: ScatterCase, pool_out: torch.Tensor, what: str, kept: dict | None = None
) -> None:
    """``pool_out`` (poisoned whole before the call) equals the reference run on a poisoned
    copy, every byte: the written runs, and everything else still poison, the columns of a
    wider pool's rows past its width included (a window from column 0, as ``fresh_pool``
    makes). ``kept``: ``ScatterCase.kept()`` taken before the call; the case's inputs must
    still equal it."""
    inputs = case.inputs()
    if kept is not None:
        assert_inputs_kept(inputs, kept, what)
    storage = pool_storage(pool_out)
    want = poisoned_like(storage)
    scatter_req_token_ids_ref(**inputs, pool_out=want[:, : pool_out.shape[1]])
    assert_bytes_equal(storage, want, f"{what}: pool_out")


def expect_plan(
    case: PlanCase, outputs: dict[str, torch.Tensor], what: str, kept: dict | None = None
) -> None:
    """The six plan outputs (poisoned whole before the call, any capacity) equal the reference
    run on poisoned copies, every byte: past index ``bs`` they must still be poison.
    ``kept``: copies of some of the case's inputs (``PlanCase.kept()``) taken before the
    call; those inputs must still equal them."""
    inputs = case.inputs()
    if kept is not None:
        assert_inputs_kept(inputs, kept, what)
    want = {name: poisoned_like(outputs[name]) for name in PLAN_OUT_NAMES}
    plan_offsets_ref(**inputs, **want)
    for name in PLAN_OUT_NAMES:
        assert_bytes_equal(outputs[name], want[name], f"{what}: {name}")


def rolled_offsets(offsets: torch.Tensor) -> torch.Tensor:
    """Another CSR over the same tokens (the segment lengths rotated by one): what an engine's
    next step might leave in a staging buffer. Safe for a kernel to read, wrong for this step."""
    lens = (offsets[1:] - offsets[:-1]).roll(1)
    return offsets_from_lens(lens).to(offsets.dtype)


@dataclass
class EngineStep:
    """One forward step of a serving engine: ``scatter`` writes the step's tokens into the
    engine's persistent pool (rows ``>= 1``, distinct), then ``plan`` plans the same requests
    (some turned into padding, row 0) with that pool as ``req_to_token``."""

    scatter: ScatterCase
    plan: PlanCase

    def kept(self) -> tuple[dict, dict]:
        """Copies of the step's inputs, taken before its calls, for ``expect_scatter``'s and
        ``expect_plan``'s ``kept``: the scatter's, and the plan's but ``req_to_token`` (the
        pool the scatter writes)."""
        return self.scatter.kept(), self.plan.kept(req_to_token=False)


def engine_step(
    seed: int,
    *,
    bs: int,
    mean_run: int,
    pool: torch.Tensor,
    lut: torch.Tensor | None,
    swa_window_size: int,
    capacity_mode: str = "at",
    total: int | None = None,
) -> EngineStep:
    """A step of ``bs`` requests whose runs average ``mean_run`` tokens (lognormal-ish, a fifth
    empty, some past the pool width), on ``pool``'s device. ``capacity_mode``: the verify
    capacity is ``"below"``, ``"at"`` or ``"above"`` the step's verify total. ``total``: the
    runs partition exactly that many tokens instead (``mean_run`` is then unused)."""
    dev = pool.device
    rows, width = int(pool.shape[0]), int(pool.shape[1])
    if not 0 <= bs < rows:
        raise ValueError(f"bs={bs} needs a pool of more than {bs} rows, got {rows}")
    g = torch.Generator().manual_seed(seed)
    if total is None:
        weight = torch.exp(torch.randn(bs, generator=g, dtype=torch.float64))
        weight[torch.rand(bs, generator=g) < 0.2] = 0
        scale = mean_run / max(float(weight.mean()) if bs else 1.0, 1e-9)
        lens = torch.floor(weight * scale).to(torch.int64)
    else:  # a random partition of exactly `total` tokens (a captured graph's fixed shapes)
        cuts = torch.randint(0, total + 1, (max(bs - 1, 0),), generator=g).sort().values
        ends = torch.tensor([total]) if bs else torch.zeros(0, dtype=torch.int64)
        lens = torch.cat([torch.zeros(min(bs, 1), dtype=torch.int64), cuts, ends]).diff()
    offsets = offsets_from_lens(lens)
    total = int(offsets[-1])
    flat_in = torch.randint(-(2**62), 2**62, (total,), generator=g, dtype=torch.int64)
    rpi = (torch.randperm(rows - 1, generator=g)[:bs] + 1).to(torch.int64)
    scatter = ScatterCase(flat_in.to(dev), offsets.to(dev), rpi.to(dev), rows, width)

    padding = torch.rand(bs, generator=g) < 0.15
    prefix = torch.randint(0, 2 * width + 1, (bs,), generator=g)
    extend = torch.randint(-1, 9, (bs,), generator=g)
    seeded = ~padding & (prefix > 0) & (extend > 0)
    prefix = torch.where(seeded, prefix.clamp(max=width), prefix)
    verify_total = int(torch.where(padding, 0, verify_lens_ref(prefix, swa_window_size)).sum())
    capacity = {"below": verify_total - 1, "at": verify_total, "above": verify_total + 1}
    plan = PlanCase(
        torch.where(padding, 0, rpi).to(dev),
        prefix.to(dev),
        extend.to(dev),
        pool,
        lut,
        int(swa_window_size),
        max(capacity[capacity_mode], 0),
        bs,
        bs + 1,
    )
    return EngineStep(scatter, plan)


class OffsetsStaging:
    """An engine's host staging buffers for scatter offsets (int64 and int32), refilled every
    step; ``pinned`` (needs CUDA) as engines keep them."""

    def __init__(self, n: int, *, pinned: bool) -> None:
        self.buf = {
            dt: torch.empty(n, dtype=dt, pin_memory=pinned) for dt in (torch.int64, torch.int32)
        }

    def offsets(
        self, offsets: torch.Tensor, placement: str
    ) -> tuple[torch.Tensor, Callable[[], None] | None]:
        """``offsets`` placed as ``placement`` says (``device``, ``host`` (a fresh CPU tensor)
        or ``staged`` (a view of the staging buffer), each with an ``_int32`` form), and the
        refill to run right after the call: another valid CSR over the same tokens written
        into the staging buffer (``None`` unless staged)."""
        dtype = torch.int32 if placement.endswith("_int32") else torch.int64
        if placement.startswith("device"):
            return offsets.to(dtype), None
        host = offsets.cpu()
        if placement.startswith("host"):
            return host.to(dtype), None
        assert placement.startswith("staged"), placement
        view = self.buf[dtype][: host.numel()]
        view.copy_(host)
        return view, lambda: view.copy_(rolled_offsets(host).to(dtype))
