"""Inputs, poisoned outputs and a CPU stand-in for sglang's CUDA entries kernel (test side).

sglang's CUDA-JIT plan entries kernel cannot run without CUDA. On the CPU, ``entries_standin``
(our own torch code, written from the kernel's documented contract in sglang's ``plan/api.py``
docstring) takes its place so that the kernel path of ``launch_canary_plan_kernels`` (sglang's
Triton offsets kernel unpatched, ours patched) runs and is compared with sglang's torch
reference. It reads the offsets from the scratch it is given, so a wrong scratch shows up as
wrong entries; it also records that scratch (``ENTRIES_SCRATCH``) for direct comparison.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from types import SimpleNamespace

import torch

from kvcanary_dispatch.integrations import sglang as integration

POISON64 = -0x2152411021524111  # 0xDEADBEEFDEADBEEF as int64
POISON32 = -0x21524111  # 0xDEADBEEF as int32
ENTRIES_SCRATCH: list[torch.Tensor] = []


def _translate(raw: torch.Tensor, lut: torch.Tensor | None) -> torch.Tensor:
    if lut is None:
        return raw
    safe = raw.clamp(min=0).clamp(max=int(lut.shape[0]) - 1)
    return torch.where(raw < 0, raw, lut[safe])


def entries_standin(
    *,
    req_pool_indices: torch.Tensor,
    prefix_lens: torch.Tensor,
    req_to_token: torch.Tensor,
    full_to_swa_index_mapping: torch.Tensor | None,
    verify_offsets_scratch: torch.Tensor,
    verify_enable: torch.Tensor,
    req_to_verify_expected_tokens: torch.Tensor | None,
    req_to_verify_expected_tokens_valid_lens: torch.Tensor | None,
    out_verify_slot_indices: torch.Tensor,
    out_verify_expected_tokens: torch.Tensor,
    out_verify_expected_positions: torch.Tensor,
    out_verify_prev_slot_indices: torch.Tensor,
    kv_token_id_vs_position_offset: int,
    swa_window_size: int,
) -> None:
    """Fill the verify entries ``[0, scratch[bs])`` as sglang's CUDA entries kernel does
    (same keywords as ``launch_plan_entries_kernel``)."""
    bs = int(req_pool_indices.shape[0])
    assert verify_offsets_scratch.numel() >= bs + 1, "scratch shorter than bs + 1"
    ENTRIES_SCRATCH.append(verify_offsets_scratch[: bs + 1].clone())
    if bs == 0:
        return
    offsets = verify_offsets_scratch[: bs + 1]
    total = int(offsets[bs])
    if total <= 0 or int(verify_enable[0]) == 0:
        return
    assert total <= out_verify_slot_indices.numel(), "enable=1 with total > verify capacity"
    counts = offsets[1:] - offsets[:-1]
    req = torch.repeat_interleave(torch.arange(bs, device=offsets.device), counts)
    entry = torch.arange(total, device=offsets.device) - offsets[req]
    prefix = prefix_lens[req]
    start = (prefix - swa_window_size).clamp(min=0) if swa_window_size > 0 else 0
    pos = start + entry
    rows = req_pool_indices[req]
    lut = full_to_swa_index_mapping
    slot = _translate(req_to_token[rows, pos].to(torch.int64), lut)
    prev_raw = req_to_token[rows, (pos - 1).clamp(min=0)].to(torch.int64)
    prev = torch.where(pos > 0, _translate(prev_raw, lut), torch.full_like(pos, -1))
    expected = torch.full_like(pos, -1)
    if req_to_verify_expected_tokens is not None:
        sot = pos + kv_token_id_vs_position_offset
        ok = (sot >= 0) & (sot < req_to_verify_expected_tokens_valid_lens[req])
        cols = int(req_to_verify_expected_tokens.shape[1])
        gathered = req_to_verify_expected_tokens[rows, sot.clamp(0, cols - 1)].to(torch.int64)
        expected = torch.where(ok, gathered, expected)
    out_verify_slot_indices[:total] = slot
    out_verify_expected_tokens[:total] = expected
    out_verify_expected_positions[:total] = pos
    out_verify_prev_slot_indices[:total] = prev


def record_entries(monkeypatch, kv) -> None:
    """``entries_standin``, which records each call in ``ENTRIES_SCRATCH``, in place of
    sglang's CUDA-JIT entries kernel (and, without CUDA, its helpers' synchronise a no-op)."""
    monkeypatch.setattr(kv.api, "launch_plan_entries_kernel", entries_standin)
    if not torch.cuda.is_available():  # sglang's test helpers synchronise CUDA
        monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)


def use_kernel_path(monkeypatch, kv) -> None:
    """Make sglang's ``launch_canary_plan_kernels`` take its kernel path for CPU tensors:
    ``use_torch_reference`` says no and ``record_entries`` replaces the CUDA-JIT kernel."""

    def use_torch_reference(device: torch.device) -> bool:
        return False

    monkeypatch.setattr(kv.api, "use_torch_reference", use_torch_reference)
    record_entries(monkeypatch, kv)


# PlanCase fields named as launch_canary_plan_kernels's keywords.
_SAME_NAMED = (
    "req_pool_indices",
    "prefix_lens",
    "extend_seq_lens",
    "req_to_token",
    "swa_window_size",
)


@dataclass
class PlanCase:
    req_pool_indices: torch.Tensor
    prefix_lens: torch.Tensor
    extend_seq_lens: torch.Tensor
    req_to_token: torch.Tensor
    lut: torch.Tensor | None
    swa_window_size: int
    expected_tokens: torch.Tensor | None
    valid_lens: torch.Tensor | None
    kv_offset: int

    @property
    def bs(self) -> int:
        return int(self.req_pool_indices.shape[0])

    def total_verify(self) -> int:
        active = self.req_pool_indices != 0
        lens = self.prefix_lens
        if self.swa_window_size > 0:
            lens = lens - (lens - self.swa_window_size).clamp(min=0)
        return int(torch.where(active, lens.clamp(min=0), 0).sum())

    def kwargs(self, verify_plan, write_plan) -> dict:
        """``launch_canary_plan_kernels``'s keywords: this case into the two plans."""
        return dict(
            verify_plan_out=verify_plan,
            write_plan_out=write_plan,
            **{name: getattr(self, name) for name in _SAME_NAMED},
            full_to_swa_index_mapping=self.lut,
            verify_capacity=int(verify_plan.verify_slot_indices.shape[0]),
            req_to_verify_expected_tokens=self.expected_tokens,
            req_to_verify_expected_tokens_valid_lens=self.valid_lens,
            kv_token_id_vs_position_offset=self.kv_offset,
        )


def _moved(device, *tensors: torch.Tensor | None) -> list[torch.Tensor | None]:
    """``tensors`` on ``device``, in order (``None`` stays ``None``)."""
    dev = torch.device(device)
    return [None if t is None else t.to(dev) for t in tensors]


def make_plan_case(
    bs: int,
    *,
    seed: int,
    device: str = "cpu",
    swa: int = 0,
    expected: bool = False,
    padding: float = 0.1,
    max_prefix: int = 3,
    max_extend: int = 3,
    kv_offset: int = 0,
) -> PlanCase:
    """A random plan input of ``bs`` requests on distinct pool rows (``padding`` of them row
    0), slots in ``[1, pool]``; ``swa`` > 0 adds a permutation LUT; ``expected`` a token pool."""
    gen = torch.Generator().manual_seed(seed)
    width = max_prefix + max_extend + 1
    rows = torch.randperm(bs, generator=gen) + 1
    rows = torch.where(torch.rand(bs, generator=gen) < padding, 0, rows)
    prefix = torch.randint(0, max_prefix + 1, (bs,), generator=gen)
    extend = torch.randint(0, max_extend + 1, (bs,), generator=gen)
    pool = (bs + 1) * width
    r2t = torch.randint(1, pool + 1, (bs + 1, width), generator=gen, dtype=torch.int32)
    lut = torch.randperm(pool + 1, generator=gen) if swa > 0 else None
    tokens = lens = None
    if expected:
        tokens = torch.randint(0, 50_000, (bs + 1, width + 1), generator=gen, dtype=torch.int32)
        lens = torch.randint(0, width + 2, (bs,), generator=gen)
    inputs = (rows, prefix, extend, r2t, lut)
    return PlanCase(*_moved(device, *inputs), swa, *_moved(device, tokens, lens), kv_offset)


def poisoned_plans(kv, *, verify_capacity: int, write_req_capacity: int, device="cpu"):
    """A ``(VerifyPlan, WritePlan)`` pair allocated by sglang, every element poisoned."""
    verify = kv.verify.VerifyPlan.allocate(verify_capacity=verify_capacity, device=device)
    write = kv.write.WritePlan.allocate(write_req_capacity=write_req_capacity, device=device)
    for plan in (verify, write):
        for t in plan_tensors(plan).values():
            poison(t)
    return verify, write


def poison(t: torch.Tensor) -> None:
    """Every element of ``t`` set to the poison of its width."""
    t.fill_(POISON64 if t.dtype == torch.int64 else POISON32)


def plan_tensors(plan) -> dict[str, torch.Tensor]:
    return {name: getattr(plan, name) for name in plan.__dataclass_fields__}


def assert_plans_identical(got, want, what: str) -> None:
    """Every element of every tensor of two plans equal, byte for byte (poisoned ones too)."""
    for name, t in plan_tensors(got).items():
        ref = getattr(want, name)
        assert t.dtype == ref.dtype and t.shape == ref.shape, f"{what}: {name} shape/dtype"
        diff = (t.cpu() != ref.cpu()).nonzero().flatten()
        assert diff.numel() == 0, (
            f"{what}: {name} differs at {diff[:8].tolist()}: "
            f"got {t.cpu()[diff[:8]].tolist()} want {ref.cpu()[diff[:8]].tolist()}"
        )


def make_scatter_case(bs: int, *, seed: int, max_len: int = 6, width: int = 5, device="cpu"):
    """Scatter inputs: ``bs`` segments of 0..max_len tokens (some longer than the pool's
    ``width`` columns, so rows are truncated) on distinct rows of a poisoned pool."""
    gen = torch.Generator().manual_seed(seed)
    lens = torch.randint(0, max_len + 1, (bs,), generator=gen)
    offsets = torch.zeros(bs + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(lens, 0)
    flat = torch.randint(-(2**40), 2**40, (int(offsets[-1]),), generator=gen)
    rows = torch.randperm(bs + 3, generator=gen)[:bs]
    pool = torch.full((bs + 3, width), POISON32, dtype=torch.int32)
    flat, offsets, rows, pool = _moved(device, flat, offsets, rows, pool)
    return SimpleNamespace(flat_in=flat, offsets=offsets, req_pool_indices=rows, pool_out=pool)


LOOSE = {  # an argument sglang reads more loosely than plan_offsets, and the call's value for it
    # sglang's kernels and torch reference read a window <= 0 as full attention, and its server
    # passes the model's window as it is (plan_offsets itself refuses a negative window).
    "window below zero": lambda capacity: dict(swa_window_size=-1),
    # sglang checks verify_capacity against its plan's length with != and passes it on as it
    # is, so a float equal to that length plans (plan_offsets itself takes only an int: the
    # patch passes the plan's length).
    "float verify_capacity": lambda capacity: dict(verify_capacity=float(capacity)),
}


# A verify plan's entry vectors, each of its capacity's length.
VERIFY_ENTRIES = (
    "verify_slot_indices",
    "verify_expected_tokens",
    "verify_expected_positions",
    "verify_prev_slot_indices",
)


# sglang's offsets launcher's scalars, as a caller may pass them (``total``: the step's verify
# entries): each one plan_offsets alone refuses or reads otherwise.
OFFSETS_SCALARS = {
    "window below zero": lambda total: dict(swa_window_size=-1, verify_capacity=total + 3),
    "float capacity": lambda total: dict(verify_capacity=float(total + 3)),
    "float capacity under the total": lambda total: dict(verify_capacity=total - 1.5),
    # float32 rounds it up to the total: sglang's kernel plans the whole verify
    "float capacity a hair under the total": lambda total: dict(verify_capacity=total - 1e-10),
    "bool capacity": lambda total: dict(verify_capacity=True),
    "capacity past int32": lambda total: dict(verify_capacity=2**31 + 1),
    "capacity infinite": lambda total: dict(verify_capacity=float("inf")),
    "capacity past float32": lambda total: dict(verify_capacity=1e39),  # (no float32 holds it)
    # sglang's launcher reads the window as int(swa_window_size)
    "window a float": lambda total: dict(swa_window_size=2.7, verify_capacity=total),
    "window a 0-d tensor": lambda total: dict(
        swa_window_size=torch.tensor(-2), verify_capacity=total
    ),
}


def offsets_outputs(launch, case: PlanCase, scalars, device="cpu") -> dict[str, torch.Tensor]:
    """``launch`` (a binding of sglang's ``launch_plan_offsets_kernel``) run on ``case`` with
    ``scalars(total verify entries)`` (``OFFSETS_SCALARS``) into outputs poisoned first (a
    scratch of sglang's 4 097 elements, a write plan for 40 requests): the outputs."""
    dev = torch.device(device)
    out = dict(
        out_verify_offsets_scratch=torch.full((4097,), POISON64, device=dev),
        out_write_offsets=torch.full((41,), POISON64, device=dev),
        out_write_seed_slot_indices=torch.full((40,), POISON64, device=dev),
        **{
            name: torch.full((1,), POISON32, dtype=torch.int32, device=dev)
            for name in ("out_verify_num_valid", "out_verify_enable", "out_write_num_valid_reqs")
        },
    )
    kwargs = dict(
        {name: getattr(case, name) for name in _SAME_NAMED},
        full_to_swa_index_mapping=case.lut,
        **out,
    )
    launch(**dict(kwargs, **scalars(case.total_verify())))
    return out


def maybe_applied(patched: bool) -> AbstractContextManager:
    """The patch applied for a block (``patched``), or nothing."""
    return integration.applied() if patched else nullcontext()


# How a caller reaches sglang's plan: through a binding the patch replaces (looked up at call
# time), or through sglang's own function bound before apply() by a module outside sglang
# (which keeps it), whose body then calls the patched offsets launcher.
ROUTES = ("patched binding", "sglang's function held from before apply()")


def plan_function(kv, route: str, held):
    """sglang's plan API as ``route`` reaches it now (``held``: sglang's own function, taken
    before the patch)."""
    return held if route == ROUTES[1] else kv.kernel_launcher.launch_canary_plan_kernels


def plans_patched_vs_unpatched(
    kv, case: PlanCase, route: str, device="cpu", *, label: str = "", **over
) -> None:
    """``case`` planned by sglang's plan API into poisoned plans (``verify_capacity`` the
    case's total + 3, ``over`` overriding keywords), unpatched and then patched by ``route``:
    every tensor of both plans equal, byte for byte (``label`` names the case in a failure)."""
    held = kv.api.launch_canary_plan_kernels  # taken unpatched
    capacity = case.total_verify() + 3
    plans = []
    for patched in (False, True):
        verify, write = poisoned_plans(
            kv, verify_capacity=capacity, write_req_capacity=case.bs, device=device
        )
        with maybe_applied(patched):
            plan_function(kv, route, held)(**dict(case.kwargs(verify, write), **over))
        plans.append((verify, write))
    assert_plans_identical(plans[1][0], plans[0][0], f"{label} {route}: verify plan")
    assert_plans_identical(plans[1][1], plans[0][1], f"{label} {route}: write plan")


def offsets_patched_vs_unpatched(
    kv, case: PlanCase, scalars, device="cpu", *, label: str = ""
) -> None:
    """sglang's offsets launcher (its plan API's binding) on ``case`` with ``scalars``
    (``OFFSETS_SCALARS``), unpatched and then patched: sglang's launcher ran (it counted the
    batch), and every output, poisoned first, is equal byte for byte (``label`` names the case
    in a failure)."""
    outputs = []
    for patched in (False, True):
        with maybe_applied(patched):
            launch = kv.api.launch_plan_offsets_kernel
            outputs.append(offsets_outputs(launch, case, scalars, device=device))
    assert int(outputs[0]["out_write_num_valid_reqs"][0]) == case.bs, f"{label}: sglang ran"
    for name, want in outputs[0].items():
        got = outputs[1][name]
        assert torch.equal(got, want), f"{label} {name}: {got} != {want}"
