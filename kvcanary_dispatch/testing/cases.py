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
from kvcanary_kernels.args import (
    PLAN_INPUT_NAMES,
    PLAN_OUTPUT_NAMES,
    PLAN_SCALAR_NAMES,
    ScatterArgs,
)
from kvcanary_kernels.references import verify_lens_ref

POISON_I32 = -0x2A2A2A2B  # distinctive, negative: never a token id, slot or offset
POISON_I64 = -0x2A2A2A2A2A2A2A2B


def random_lut(n: int, g: torch.Generator, device: str | torch.device) -> torch.Tensor:
    """``[n]`` int64 SWA indices of every magnitude and both signs (a full-range draw, about
    a quarter of them kept whole and the rest shifted right by 1 to 62 bits), drawn with ``g``,
    a generator on ``device``: the plan copies seeds from it as they are, all 64 bits."""
    lo, hi = -(2**63), 2**63 - 1
    full = torch.randint(lo, hi, (n,), generator=g, device=device, dtype=torch.int64)
    shift = torch.randint(-20, 63, (n,), generator=g, device=device, dtype=torch.int64)
    return full >> shift.clamp(min=0)


def offsets_from_lens(lens: torch.Tensor) -> torch.Tensor:
    """CSR offsets ``[len(lens) + 1]`` int64 from segment lengths."""
    out = torch.zeros(lens.numel() + 1, dtype=torch.int64, device=lens.device)
    torch.cumsum(lens.to(torch.int64), 0, out=out[1:])
    return out


# A pool nothing writes (no storage): stands in where only a call's sizes are read.
_NO_POOL = torch.empty(0, 0, dtype=torch.int32, device="meta")


@dataclass
class ScatterCase:
    """A scatter's inputs and the shape of the pool it writes, ``[pool_rows, width]``.

    ``args(pool_out)`` is the call on a pool as a ``ScatterArgs``, ``kwargs(pool_out)`` the same
    as upstream's keywords; ``bs`` and ``total`` are that call's ``bs`` and ``num_tokens``.
    """

    flat_in: torch.Tensor  # [total] int64
    offsets: torch.Tensor  # [bs + 1] int64
    req_pool_indices: torch.Tensor  # [bs] int64, distinct rows among the requests that write
    pool_rows: int
    width: int  # max_context_len
    pool_pitch: int = 0  # the pool's row stride: a column window of a wider pool (0: width)

    def args(self, pool_out: torch.Tensor) -> ScatterArgs:
        """The scatter of this case's inputs into ``pool_out``."""
        return ScatterArgs(self.flat_in, self.offsets, self.req_pool_indices, pool_out)

    def kwargs(self, pool_out: torch.Tensor) -> dict:
        """``args(pool_out)`` as upstream's keywords (``flat_in``, ..., ``pool_out``)."""
        return self.args(pool_out)._asdict()

    @property
    def bs(self) -> int:
        return self.args(_NO_POOL).bs

    @property
    def total(self) -> int:
        return self.args(_NO_POOL).num_tokens

    @property
    def written_lens(self) -> torch.Tensor:
        """``[bs]`` int64: the tokens each request writes, its run cut to ``[0, width]``."""
        return (self.offsets[1:] - self.offsets[:-1]).clamp(min=0, max=self.width)

    def inputs(self) -> dict:
        """The call's keywords but ``pool_out``."""
        return {n: v for n, v in self.kwargs(_NO_POOL).items() if n != "pool_out"}

    def kept(self) -> dict:
        """Copies of ``inputs()``: taken before a call, what it must leave unchanged."""
        return kept_inputs(self.inputs())

    def fresh_pool(self) -> torch.Tensor:
        """A ``[pool_rows, width]`` int32 pool on the inputs' device, every element poison: the
        first ``width`` columns of a ``[pool_rows, pool_pitch]`` pool when ``pool_pitch`` is
        wider (its other columns poison too, and no scatter may write them). One more poisoned
        row follows it in its storage (``guard_row``), so that a write past its last row lands
        there, where ``check_scatter`` sees it, rather than in other memory."""
        pitch = max(self.pool_pitch, self.width)
        dev = self.flat_in.device
        base = torch.full((self.pool_rows + 1, pitch), POISON_I32, dtype=torch.int32, device=dev)
        return base[:-1] if pitch == self.width else base[:-1, : self.width]


def make_scatter_case(
    lens: Sequence[int] | torch.Tensor,
    *,
    width: int,
    spare_rows: int = 1,
    seed: int = 0,
    device: str | torch.device = "cpu",
) -> ScatterCase:
    """Random token ids in [-2**62, 2**62) (the pool keeps their low 32 bits, as the reference
    does), distinct random pool rows."""
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
    """Boolean ``[rows, width]``: the elements the contract lets a scatter write (a row that
    several requests address, padding with empty runs, is the union of theirs)."""
    lens = case.written_lens
    hits = torch.zeros(case.pool_rows, case.width, dtype=torch.int32, device=lens.device)
    cols = torch.arange(case.width, device=lens.device)
    hits.index_add_(0, case.req_pool_indices, (cols[None, :] < lens[:, None]).to(torch.int32))
    return hits > 0


def pool_storage(pool: torch.Tensor) -> torch.Tensor:
    """Every element of ``pool``'s rows, the columns past its width included: ``[rows, row
    stride]``, for a pool as ``ScatterCase.fresh_pool`` makes it (a window from column 0)."""
    rows, pitch = pool.shape[0], pool.stride(0)
    if rows == 0 or pitch == pool.shape[1] or not pool.untyped_storage().nbytes():
        return pool  # (a [rows, 0] pool with no storage reports a row stride of 1)
    return pool.as_strided((rows, pitch), (pitch, 1), pool.storage_offset())


def guard_row(pool: torch.Tensor) -> torch.Tensor:
    """The row past ``pool``'s last in its storage, a whole row stride wide: for a pool as
    ``ScatterCase.fresh_pool`` makes it, poison that no scatter may write. Empty where the
    storage ends first (a pool made otherwise, or no column wide)."""
    pitch = pool.stride(0)
    start = pool.storage_offset() + pool.shape[0] * pitch
    if not pool.shape[1] or (start + pitch) * pool.element_size() > pool.untyped_storage().nbytes():
        return pool.new_empty(0)
    return pool.as_strided((pitch,), (1,), start)


def kept_inputs(inputs: dict) -> dict:
    """A copy of a call's keywords, each tensor cloned: what the call must leave unchanged."""
    return {n: v.clone() if isinstance(v, torch.Tensor) else v for n, v in inputs.items()}


def assert_inputs_kept(inputs: dict, kept: dict, what: str) -> None:
    """Each tensor of ``inputs`` (a call's keywords) still equals its copy in ``kept``, every
    byte (meta tensors hold no data: skipped)."""
    for name, was in kept.items():
        if isinstance(was, torch.Tensor) and was.device.type != "meta":
            assert_bytes_equal(inputs[name], was, f"{what}: {name} changed by the call")


def check_scatter(impl: Callable[..., None], case: ScatterCase, **impl_kwargs) -> torch.Tensor:
    """Run ``impl`` on a poisoned pool and the reference on another, the reference on a copy
    of the inputs taken before ``impl`` ran; assert byte equality (the columns of a wider
    pool's rows past its width included), that nothing outside the written mask changed, and
    that ``impl`` left its inputs unchanged. Returns the implementation's pool."""
    got = case.fresh_pool()
    want = case.fresh_pool()
    inputs = case.inputs()
    kept = kept_inputs(inputs)
    impl(**inputs, pool_out=got, **impl_kwargs)
    assert_inputs_kept(inputs, kept, "scatter")
    scatter_req_token_ids_ref(**kept, pool_out=want)
    outside = ~scatter_written_mask(case)
    assert torch.all(got[outside] == POISON_I32), "scatter wrote outside its segments"
    assert torch.all(guard_row(got) == POISON_I32), "scatter wrote past the pool's last row"
    assert_bytes_equal(pool_storage(got), pool_storage(want), "pool_out")
    return got


# The six plan outputs, in upstream's keyword order (the dispatcher's and the reference's).
PLAN_OUT_NAMES = PLAN_OUTPUT_NAMES


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
        """The plan's inputs and scalars as upstream's keywords, in its order (``lut`` as
        ``full_to_swa_index_mapping``)."""
        names = (*PLAN_INPUT_NAMES, *PLAN_SCALAR_NAMES)
        return {n: getattr(self, "lut" if n == "full_to_swa_index_mapping" else n) for n in names}

    def refill_from(self, other: PlanCase) -> None:
        """Copy ``other``'s input tensors into this case's, in place (same shapes): a graph
        captured on this case replays on ``other``'s data."""
        theirs = other.inputs()
        for name, tensor in self.inputs().items():
            if isinstance(tensor, torch.Tensor):
                tensor.copy_(theirs[name])

    def kept(self, *, req_to_token: bool = True) -> dict:
        """Copies of ``inputs()`` (``req_to_token=False``: all but the table, which an engine
        step's scatter writes before its plan): taken before a call, what it must leave
        unchanged."""
        inputs = self.inputs()
        if not req_to_token:
            del inputs["req_to_token"]
        return kept_inputs(inputs)


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
    (some negative), and a random LUT (``random_lut``) whose length may be shorter than the
    slot range.
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
    lut = random_lut(lut_len, g, "cpu").to(device) if lut_len is not None else None
    if verify_capacity is None:
        verify_capacity = int(torch.where(pad, 0, verify_lens_ref(prefix, swa_window_size)).sum())
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
    """Run ``impl`` and the reference on poisoned outputs, the reference on a copy of the
    inputs taken before ``impl`` ran; assert every byte equal (elements past index ``bs`` stay
    poisoned) and that ``impl`` left its inputs unchanged. Returns the implementation's
    outputs."""
    got = case.fresh_outputs()
    want = case.fresh_outputs()
    impl_out = dict(got)
    impl_out[out_verify_name] = impl_out.pop("out_verify_offsets")
    inputs = case.inputs()
    kept = kept_inputs(inputs)
    impl(**inputs, **impl_out, **impl_kwargs)
    assert_inputs_kept(inputs, kept, "plan")
    plan_offsets_ref(**kept, **want)
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
