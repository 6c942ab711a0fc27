"""The rejected-call properties: a call made invalid in a named way (``SCATTER_REJECTIONS``,
``PLAN_REJECTIONS``) raises the expected error before any launch and leaves every output byte
as it was."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvcanary_kernels._checks import CapacityError

from .. import plan as _plan
from .. import scatter as _scatter
from .cases import (
    PlanCase,
    ScatterCase,
    assert_bytes_equal,
    assert_inputs_kept,
    kept_inputs,
    pool_storage,
)
from .launches import record_launches
from .sizes import I64_MAX


@dataclass
class Rejection:
    """How to break a call: keyword overrides, the error type and a substring of its text."""

    overrides: dict
    exc: type[Exception]
    text: str


def _one(index: int, lo: int, hi: int) -> int:
    """A position in ``[lo, hi)`` picked by ``index``."""
    return lo + index % (hi - lo)


def _scatter_bad_offsets(case: ScatterCase, index: int, how: str) -> Rejection | None:
    offs = case.offsets.clone()
    bs = case.bs
    if how == "start":
        offs += 1
        return Rejection({"offsets": offs, "validate": True}, ValueError, "offsets[0] must be 0")
    if how == "end" and bs >= 1:
        offs[bs] += 1
        return Rejection({"offsets": offs, "validate": True}, ValueError, f"offsets[{bs}]=")
    if how == "down" and bs >= 2:
        r = _one(index, 1, bs)
        offs[r] = offs[r + 1] + 1
        text = f"offsets[{r + 1}]={int(offs[r + 1])} < offsets[{r}]"
        return Rejection({"offsets": offs, "validate": True}, ValueError, text)
    return None


def _bad_rows(
    rpi: torch.Tensor, rows: int, index: int, how: str, distinct: torch.Tensor
) -> tuple | None:
    """``(new req_pool_indices, first bad index)``; ``distinct``: which requests must address
    distinct rows (boolean ``[bs]``)."""
    rpi = rpi.clone()
    bs = int(rpi.numel())
    if how == "negative" and bs >= 1:
        r = _one(index, 0, bs)
        rpi[r] = -1 - index % 5
    elif how == "too_big" and bs >= 1:
        r = _one(index, 0, bs)
        rpi[r] = rows + index % 5
    elif how == "duplicate":
        active = distinct.nonzero()[:, 0].tolist()
        if len(active) < 2:
            return None
        j = _one(index, 1, len(active))
        i = _one(index // 7, 0, j)
        r = active[j]
        rpi[r] = rpi[active[i]]
    else:
        return None
    return rpi, r


def _scatter_bad_rows(case: ScatterCase, index: int, how: str) -> Rejection | None:
    writes = (case.written_lens > 0).cpu()
    bad = _bad_rows(case.req_pool_indices, case.pool_rows, index, how, writes)
    if bad is None:
        return None
    rpi, r = bad
    return Rejection(
        {"req_pool_indices": rpi, "validate": True}, ValueError, f"req_pool_indices[{r}]="
    )


def _scatter_overlapping_pool(case: ScatterCase, index: int) -> Rejection | None:
    """A pool whose rows share memory: its first row expanded (row stride 0), or rows one
    column apart."""
    rows, width = case.pool_rows, case.width
    if rows < 2 or width < 2:
        return None
    pool = case.fresh_pool()
    pool = pool[:1].expand(rows, width) if index % 2 else pool.as_strided((rows, width), (1, 1))
    return Rejection({"pool_out": pool}, ValueError, "pool_out rows overlap in memory")


def _strided(t: torch.Tensor, fill: int) -> torch.Tensor | None:
    """``t``'s values in every other element of a buffer (its other elements ``fill``): a
    non-contiguous copy, or ``None`` where the copy is contiguous all the same (fewer than
    two elements, or a tensor with no rows)."""
    if t.numel() < 2:
        return None
    buf = torch.full((*t.shape[:-1], 2 * t.shape[-1]), fill, dtype=t.dtype, device=t.device)
    view = buf[..., ::2].copy_(t)
    return None if view.is_contiguous() else view


def _elsewhere(t: torch.Tensor) -> torch.Tensor:
    """``t`` on another device than its own: the CPU for a GPU tensor, else ``meta``."""
    return t.to("meta" if t.device.type == "cpu" else "cpu")


def _contiguity(name: str, fill: int, text: str) -> Callable[..., Rejection | None]:
    """The breakage that passes argument ``name`` (a case attribute) strided; ``text`` is
    the refusal's."""

    def breakage(case, index: int) -> Rejection | None:
        t = _strided(getattr(case, name), fill)
        return None if t is None else Rejection({name: t}, ValueError, text)

    return breakage


def _scatter_pool_column_stride(case: ScatterCase, index: int) -> Rejection | None:
    """A pool whose columns are two elements apart (every other column of a wider pool); a
    single column has no column stride (it is a valid window of a wider pool)."""
    pool = _strided(case.fresh_pool().contiguous(), 0)
    if pool is None or case.width < 2:
        return None
    return Rejection({"pool_out": pool}, ValueError, "pool_out rows must be contiguous")


_CHUNK_REJECTIONS = {
    "chunk_zero": (0, ValueError),
    "chunk_negative": (-3, ValueError),
    "chunk_too_big": (None, ValueError),
    "chunk_bool": (True, TypeError),
    "chunk_float": (2.0, TypeError),
}


def _chunk_rejection(name: str, maximum: int) -> Rejection:
    value, exc = _CHUNK_REJECTIONS[name]
    value = maximum + 1 if value is None else value
    return Rejection({"chunk_size": value}, exc, "chunk_size")


def _call_rejections(max_chunk: int) -> dict[str, Callable[..., Rejection | None]]:
    """The breakages both calls share: each of ``_CHUNK_REJECTIONS`` (against ``max_chunk``)
    and an unknown strategy."""
    table: dict[str, Callable[..., Rejection | None]] = {
        name: (lambda c, i, n=name: _chunk_rejection(n, max_chunk)) for name in _CHUNK_REJECTIONS
    }
    table["strategy_unknown"] = lambda c, i: Rejection({"strategy": "bogus"}, ValueError, "bogus")
    return table


def _scatter_rejections() -> dict[str, Callable[[ScatterCase, int], Rejection | None]]:
    table = _call_rejections(_scatter.SCATTER_MAX_CHUNK)
    table.update(
        offsets_float=lambda c, i: Rejection(
            {"offsets": c.offsets.double()}, TypeError, "torch.float64"
        ),
        offsets_bool=lambda c, i: Rejection({"offsets": c.offsets > 0}, TypeError, "torch.bool"),
        offsets_int16=lambda c, i: Rejection(
            {"offsets": c.offsets.to(torch.int16)}, TypeError, "torch.int16"
        ),
        offsets_short=lambda c, i: Rejection(
            {"offsets": c.offsets[:-1]}, ValueError, f"offsets length {c.bs} != bs+1"
        ),
        flat_in_int32=lambda c, i: Rejection(
            {"flat_in": c.flat_in.to(torch.int32)}, TypeError, "flat_in must be int64"
        ),
        flat_in_2d=lambda c, i: Rejection(
            {"flat_in": c.flat_in[None]}, ValueError, "flat_in must be 1-D"
        ),
        pool_int64=lambda c, i: Rejection(
            {"pool_out": c.fresh_pool().to(torch.int64)}, TypeError, "pool_out must be int32"
        ),
        offsets_start=lambda c, i: _scatter_bad_offsets(c, i, "start"),
        offsets_end=lambda c, i: _scatter_bad_offsets(c, i, "end"),
        offsets_decreasing=lambda c, i: _scatter_bad_offsets(c, i, "down"),
        rows_negative=lambda c, i: _scatter_bad_rows(c, i, "negative"),
        rows_too_big=lambda c, i: _scatter_bad_rows(c, i, "too_big"),
        rows_duplicate=lambda c, i: _scatter_bad_rows(c, i, "duplicate"),
        pool_rows_overlap=_scatter_overlapping_pool,
        pool_column_stride=_scatter_pool_column_stride,
        rows_int32=lambda c, i: Rejection(
            {"req_pool_indices": c.req_pool_indices.to(torch.int32)},
            TypeError,
            "req_pool_indices must be int64, got torch.int32",
        ),
        rows_2d=lambda c, i: Rejection(
            {"req_pool_indices": c.req_pool_indices[None]},
            ValueError,
            "req_pool_indices must be 1-D",
        ),
        rows_strided=_contiguity("req_pool_indices", 0, "req_pool_indices must be contiguous"),
        flat_in_strided=_contiguity("flat_in", 0, "flat_in must be contiguous"),
        offsets_strided=_contiguity("offsets", -7, "offsets must be contiguous"),
        flat_in_elsewhere=lambda c, i: Rejection(
            {"flat_in": _elsewhere(c.flat_in)}, ValueError, "flat_in must be on pool_out's device"
        ),
        rows_elsewhere=lambda c, i: Rejection(
            {"req_pool_indices": _elsewhere(c.req_pool_indices)},
            ValueError,
            "req_pool_indices must be on pool_out's device",
        ),
    )
    return table


SCATTER_REJECTIONS = _scatter_rejections()


def _plan_seed_past_width(case: PlanCase, index: int) -> Rejection | None:
    active = (case.req_pool_indices != 0).nonzero()[:, 0].tolist()
    if not active:
        return None
    r = active[_one(index, 0, len(active))]
    prefix = case.prefix_lens.clone()
    extend = case.extend_seq_lens.clone()
    prefix[r] = case.req_to_token.shape[1] + 1 + index % 3
    extend[r] = max(int(extend[r]), 1)
    # Requests before r stay as they were: seeded ones have prefixes within the pool.
    return Rejection(
        {"prefix_lens": prefix, "extend_seq_lens": extend, "validate": True},
        ValueError,
        f"prefix_lens[{r}]=",
    )


def _plan_bad_rows(case: PlanCase, index: int, how: str) -> Rejection | None:
    rpi, rows = case.req_pool_indices, int(case.req_to_token.shape[0])
    bad = _bad_rows(rpi, rows, index, how, (rpi != 0).cpu())
    if bad is None:
        return None
    rpi, r = bad
    return Rejection(
        {"req_pool_indices": rpi, "validate": True}, ValueError, f"req_pool_indices[{r}]="
    )


def _plan_small_capacity(case: PlanCase, index: int) -> Rejection | None:
    if case.bs == 0:
        return None
    cap = _one(index, 0, case.bs)
    out = case.fresh_outputs()
    return Rejection(
        {
            "out_write_offsets": out["out_write_offsets"][: cap + 1].clone(),
            "out_write_seed_slot_indices": out["out_write_seed_slot_indices"][:cap].clone(),
        },
        CapacityError,
        f"bs={case.bs} exceeds write_req_capacity={cap}",
    )


def _plan_total_past_int64(case: PlanCase, index: int, what: str) -> Rejection | None:
    """Two requests' runs that add up past ``2**63 - 1`` (``validate=True``; for the verify
    total, no window): ``what`` is ``"write"`` (extends; no prefix for either, so no seed
    read) or ``"verify"`` (prefixes; no extend for either). No such run before them."""
    active = (case.req_pool_indices != 0).nonzero()[:, 0].tolist()
    if len(active) < 2:
        return None
    j = _one(index, 1, len(active))
    first, over = active[_one(index // 7, 0, j)], active[j]
    grown, cleared = ("extend_seq_lens", "prefix_lens")[:: 1 if what == "write" else -1]
    runs, other = getattr(case, grown).clone(), getattr(case, cleared).clone()
    runs[: over + 1] = 0
    runs[first], runs[over] = I64_MAX, 1 + index % 3
    other[first] = other[over] = 0
    window = {} if what == "write" else {"swa_window_size": 0}
    return Rejection(
        {grown: runs, cleared: other, **window, "validate": True},
        ValueError,
        f"the {what} total passes {I64_MAX} at request {over} ({grown}[{over}]=",
    )


def _plan_output_strided(case: PlanCase, index: int) -> Rejection | None:
    t = _strided(case.fresh_outputs()["out_write_offsets"], 0)
    text = "out_write_offsets must be contiguous"
    return None if t is None else Rejection({"out_write_offsets": t}, ValueError, text)


# verify_capacity values the int32 out_verify_num_valid cannot hold (2**31 - 1 is accepted).
_PAST_INT32 = (2**31, 2**31 + 1, 3 * 2**31, 2**62, 2**63 - 1)


def _plan_rejections() -> dict[str, Callable[[PlanCase, int], Rejection | None]]:
    table = _call_rejections(_plan.PLAN_MAX_CHUNK)
    table.update(
        prefix_int32=lambda c, i: Rejection(
            {"prefix_lens": c.prefix_lens.to(torch.int32)},
            ValueError,
            "prefix_lens must have dtype torch.int64, got torch.int32",
        ),
        verify_capacity_negative=lambda c, i: Rejection(
            {"verify_capacity": -1}, ValueError, "verify_capacity must be non-negative"
        ),
        verify_capacity_past_int32=lambda c, i: Rejection(
            {"verify_capacity": (v := _PAST_INT32[i % len(_PAST_INT32)])},
            ValueError,
            f"verify_capacity={v}",
        ),
        verify_offsets_short=lambda c, i: Rejection(
            {"out_verify_offsets": c.fresh_outputs()["out_verify_offsets"][: c.bs].clone()},
            ValueError,
            f"length must be >= {c.bs + 1}, got {c.bs}",
        ),
        capacity_below_bs=_plan_small_capacity,
        seed_past_width=_plan_seed_past_width,
        rows_negative=lambda c, i: _plan_bad_rows(c, i, "negative"),
        rows_too_big=lambda c, i: _plan_bad_rows(c, i, "too_big"),
        rows_duplicate=lambda c, i: _plan_bad_rows(c, i, "duplicate"),
        write_total_past_int64=lambda c, i: _plan_total_past_int64(c, i, "write"),
        verify_total_past_int64=lambda c, i: _plan_total_past_int64(c, i, "verify"),
        rows_int32=lambda c, i: Rejection(
            {"req_pool_indices": c.req_pool_indices.to(torch.int32)},
            ValueError,
            "req_pool_indices must have dtype torch.int64, got torch.int32",
        ),
        rows_strided=_contiguity("req_pool_indices", 0, "req_pool_indices must be contiguous"),
        req_to_token_strided=_contiguity("req_to_token", -3, "req_to_token must be contiguous"),
        lut_int32=lambda c, i: (
            None
            if c.lut is None
            else Rejection(
                {"full_to_swa_index_mapping": c.lut.to(torch.int32)},
                ValueError,
                "full_to_swa_index_mapping must have dtype torch.int64, got torch.int32",
            )
        ),
        output_strided=_plan_output_strided,
        req_to_token_elsewhere=lambda c, i: Rejection(
            {"req_to_token": _elsewhere(c.req_to_token)},
            ValueError,
            "req_to_token must be on out_verify_offsets's device",
        ),
    )
    return table


PLAN_REJECTIONS = _plan_rejections()


def _expect_rejection(
    call: Callable[[], None], rejection: Rejection, what: str, one_pass: bool
) -> None:
    recording = contextlib.nullcontext([]) if one_pass else record_launches()
    with recording as launches:
        try:
            call()
        except rejection.exc as err:
            message = str(err)
        else:
            raise AssertionError(f"{what}: accepted, expected {rejection.exc.__name__}")
    assert rejection.text in message, f"{what}: {message!r} lacks {rejection.text!r}"
    assert not launches, f"{what}: rejected after launching {launches}"


def _check_rejected(
    call: Callable[..., None], kwargs: dict, rejection: Rejection, name: str, one_pass: bool
) -> None:
    """``call(**kwargs)`` refused as ``rejection`` says, every tensor of ``kwargs`` unchanged."""
    kept = kept_inputs(kwargs)
    _expect_rejection(lambda: call(**kwargs), rejection, name, one_pass)
    assert_inputs_kept(kwargs, kept, f"{name}: rejected call")


def check_scatter_rejected(
    case: ScatterCase, name: str, index: int = 0, strategy: str = "auto", one_pass: bool = False
) -> bool:
    """Break the call as ``SCATTER_REJECTIONS[name]`` says (``index`` picks a position), and
    check the error and that every tensor of the call, ``pool_out`` (a window's columns past
    its width too) and the inputs, is untouched. The call is recorded (``record_launches``:
    the full path, no launch allowed), or with ``one_pass`` made as an engine makes it, the
    one-pass launch on, where a launch shows only as a changed byte. ``False`` if the
    breakage needs a larger batch."""
    rejection = SCATTER_REJECTIONS[name](case, index)
    if rejection is None:
        return False
    pool = case.fresh_pool()
    whole = pool_storage(pool).clone()  # a window's columns past its width included
    kwargs = {**case.kwargs(pool), "strategy": strategy, **rejection.overrides}
    _check_rejected(_scatter.scatter_req_token_ids, kwargs, rejection, name, one_pass)
    assert_bytes_equal(pool_storage(pool), whole, f"{name}: rejected call, pool_out's rows")
    return True


def check_plan_rejected(
    case: PlanCase, name: str, index: int = 0, strategy: str = "auto", one_pass: bool = False
) -> bool:
    """As ``check_scatter_rejected``, for ``plan_offsets``: its inputs and all six outputs."""
    rejection = PLAN_REJECTIONS[name](case, index)
    if rejection is None:
        return False
    kwargs = {**case.inputs(), **case.fresh_outputs(), "strategy": strategy}
    kwargs.update(rejection.overrides)
    _check_rejected(_plan.plan_offsets, kwargs, rejection, name, one_pass)
    return True
