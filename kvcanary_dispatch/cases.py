"""Concrete inputs for the two kernels, poisoned outputs, and byte-exact comparison.

Shared by the tests, the fuzz command and the benchmarks: a case holds the inputs, ``fresh_*``
returns poisoned outputs, and ``check_*`` runs an implementation and the torch reference on
identical poisoned outputs and compares every byte, including the bytes nothing may write.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kvcanary_kernels import plan_offsets_ref, scatter_req_token_ids_ref

POISON_I32 = -0x2A2A2A2B  # distinctive, negative: never a token id, slot or offset
POISON_I64 = -0x2A2A2A2A2A2A2A2B


def offsets_from_lens(lens: torch.Tensor) -> torch.Tensor:
    """CSR offsets ``[len(lens) + 1]`` int64 from segment lengths."""
    out = torch.zeros(lens.numel() + 1, dtype=torch.int64, device=lens.device)
    torch.cumsum(lens.to(torch.int64), 0, out=out[1:])
    return out


@dataclass
class ScatterCase:
    flat_in: torch.Tensor  # [total] int64
    offsets: torch.Tensor  # [bs + 1] int64
    req_pool_indices: torch.Tensor  # [bs] int64, distinct rows
    pool_rows: int
    width: int  # max_context_len

    @property
    def bs(self) -> int:
        return int(self.req_pool_indices.shape[0])

    @property
    def total(self) -> int:
        return int(self.flat_in.shape[0])

    def fresh_pool(self) -> torch.Tensor:
        return torch.full(
            (self.pool_rows, self.width), POISON_I32, dtype=torch.int32, device=self.flat_in.device
        )

    def kwargs(self, pool_out: torch.Tensor) -> dict:
        return dict(
            flat_in=self.flat_in,
            offsets=self.offsets,
            req_pool_indices=self.req_pool_indices,
            pool_out=pool_out,
        )


def make_scatter_case(
    lens: Sequence[int] | torch.Tensor,
    *,
    width: int,
    spare_rows: int = 1,
    seed: int = 0,
    device: str | torch.device = "cpu",
) -> ScatterCase:
    """Random token ids (full int64 range), distinct random pool rows."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.as_tensor(lens, dtype=torch.int64).cpu()
    bs = lens.numel()
    offsets = offsets_from_lens(lens)
    total = int(offsets[-1])
    flat_in = torch.randint(-(2**62), 2**62, (total,), generator=g, dtype=torch.int64)
    rows = bs + spare_rows
    rpi = torch.randperm(rows, generator=g)[:bs].to(torch.int64)
    return ScatterCase(flat_in.to(device), offsets.to(device), rpi.to(device), rows, int(width))


def scatter_written_mask(case: ScatterCase) -> torch.Tensor:
    """Boolean ``[rows, width]``: the elements the contract lets a scatter write."""
    lens = (case.offsets[1:] - case.offsets[:-1]).clamp(min=0, max=case.width)
    mask = torch.zeros(case.pool_rows, case.width, dtype=torch.bool, device=lens.device)
    cols = torch.arange(case.width, device=lens.device)
    mask[case.req_pool_indices] = cols[None, :] < lens[:, None]
    return mask


def check_scatter(impl: Callable[..., None], case: ScatterCase, **impl_kwargs) -> torch.Tensor:
    """Run ``impl`` and the reference on poisoned pools; assert byte equality and that nothing
    outside the written mask changed. Returns the implementation's pool."""
    got = case.fresh_pool()
    want = case.fresh_pool()
    impl(**case.kwargs(got), **impl_kwargs)
    scatter_req_token_ids_ref(**case.kwargs(want))
    outside = ~scatter_written_mask(case)
    assert torch.all(got[outside] == POISON_I32), "scatter wrote outside its segments"
    assert_bytes_equal(got, want, "pool_out")
    return got


PLAN_OUT_NAMES = (
    "out_verify_offsets",
    "out_write_offsets",
    "out_write_seed_slot_indices",
    "out_verify_num_valid",
    "out_verify_enable",
    "out_write_num_valid_reqs",
)


@dataclass
class PlanCase:
    req_pool_indices: torch.Tensor  # [bs] int64, 0 = padding
    prefix_lens: torch.Tensor  # [bs] int64
    extend_seq_lens: torch.Tensor  # [bs] int64
    req_to_token: torch.Tensor  # [rows, max_seq_len] int32
    lut: torch.Tensor | None  # [lut_len] int64
    swa_window_size: int
    verify_capacity: int
    write_req_capacity: int
    verify_len: int  # length of the verify offsets output (>= bs + 1)

    @property
    def bs(self) -> int:
        return int(self.req_pool_indices.shape[0])

    @property
    def device(self) -> torch.device:
        return self.req_pool_indices.device

    def fresh_outputs(self) -> dict[str, torch.Tensor]:
        d = self.device
        full64 = lambda n: torch.full((n,), POISON_I64, dtype=torch.int64, device=d)  # noqa: E731
        full32 = lambda n: torch.full((n,), POISON_I32, dtype=torch.int32, device=d)  # noqa: E731
        return dict(
            out_verify_offsets=full64(self.verify_len),
            out_write_offsets=full64(self.write_req_capacity + 1),
            out_write_seed_slot_indices=full64(self.write_req_capacity),
            out_verify_num_valid=full32(1),
            out_verify_enable=full32(1),
            out_write_num_valid_reqs=full32(1),
        )

    def inputs(self) -> dict:
        return dict(
            req_pool_indices=self.req_pool_indices,
            prefix_lens=self.prefix_lens,
            extend_seq_lens=self.extend_seq_lens,
            req_to_token=self.req_to_token,
            full_to_swa_index_mapping=self.lut,
            swa_window_size=self.swa_window_size,
            verify_capacity=self.verify_capacity,
        )


def make_plan_case(
    *,
    prefix_lens: Sequence[int] | torch.Tensor,
    extend_seq_lens: Sequence[int] | torch.Tensor,
    padding: Sequence[bool] | torch.Tensor | None = None,
    max_seq_len: int,
    lut_len: int | None = None,
    swa_window_size: int = 0,
    verify_capacity: int | None = None,
    spare_capacity: int = 3,
    seed: int = 0,
    device: str | torch.device = "cpu",
) -> PlanCase:
    """Random distinct pool rows (row 0 for padding requests), random slots in ``req_to_token``
    (some negative), and a random LUT whose length may be shorter than the slot range.
    ``verify_capacity=None`` means "exactly the total"."""
    g = torch.Generator().manual_seed(seed)
    prefix = torch.as_tensor(prefix_lens, dtype=torch.int64).cpu()
    extend = torch.as_tensor(extend_seq_lens, dtype=torch.int64).cpu()
    bs = prefix.numel()
    pad = (
        torch.zeros(bs, dtype=torch.bool)
        if padding is None
        else torch.as_tensor(padding, dtype=torch.bool).cpu()
    )
    rows = bs + 2
    rpi = (torch.randperm(rows - 1, generator=g)[:bs] + 1).to(torch.int64)
    rpi[pad] = 0
    slot_hi = max(2 * (lut_len or 64), 2)
    r2t = torch.randint(-3, slot_hi, (rows, max_seq_len), generator=g, dtype=torch.int32)
    lut = None
    if lut_len is not None:
        lut = torch.randint(0, 2**40, (lut_len,), generator=g, dtype=torch.int64).to(device)
    if verify_capacity is None:
        ws = (prefix - swa_window_size).clamp(min=0) if swa_window_size > 0 else 0
        verify_capacity = int(torch.where(pad, 0, (prefix - ws).clamp(min=0)).sum())
    return PlanCase(
        rpi.to(device),
        prefix.to(device),
        extend.to(device),
        r2t.to(device),
        lut,
        int(swa_window_size),
        int(verify_capacity),
        bs + spare_capacity,
        bs + 1 + spare_capacity,
    )


def check_plan(
    impl: Callable[..., None],
    case: PlanCase,
    *,
    out_verify_name: str = "out_verify_offsets",
    **impl_kwargs,
) -> dict[str, torch.Tensor]:
    """Run ``impl`` and the reference on poisoned outputs; assert every byte equal (elements past
    index ``bs`` stay poisoned). Returns the implementation's outputs."""
    got = case.fresh_outputs()
    want = case.fresh_outputs()
    impl_out = dict(got)
    impl_out[out_verify_name] = impl_out.pop("out_verify_offsets")
    impl(**case.inputs(), **impl_out, **impl_kwargs)
    plan_offsets_ref(**case.inputs(), **want)
    bs = case.bs
    for name in ("out_verify_offsets", "out_write_offsets"):
        assert torch.all(got[name][bs + 1 :] == POISON_I64), f"{name} written past index bs"
    assert torch.all(got["out_write_seed_slot_indices"][bs:] == POISON_I64), "seeds past bs"
    for name in PLAN_OUT_NAMES:
        assert_bytes_equal(got[name], want[name], name)
    return got


def assert_bytes_equal(got: torch.Tensor, want: torch.Tensor, name: str) -> None:
    """Exact equality of dtype, shape and every byte; the message names the first mismatch."""
    assert got.dtype == want.dtype and got.shape == want.shape, (name, got.dtype, want.dtype)
    diff = (got != want).nonzero()
    if diff.numel():
        first = tuple(int(i) for i in diff[0])
        raise AssertionError(
            f"{name}: {diff.shape[0]} elements differ, first at {first}: "
            f"got {got[first].item()}, want {want[first].item()}"
        )
