"""The equality properties: a dispatched call equals the torch reference byte for byte on
poisoned outputs, its launches stay within their blocks and see their slices, and dispatching
each slice on its own (when there are several) and concatenating the results gives the whole.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch

from .. import plan as _plan
from .. import scatter as _scatter
from ..slicing import slice_bounds
from .cases import (
    PLAN_OUT_NAMES,
    PlanCase,
    ScatterCase,
    assert_bytes_equal,
    assert_inputs_kept,
    check_plan,
    check_scatter,
    kept_inputs,
    pool_storage,
)
from .launches import (
    Launch,
    check_launch_blocks,
    check_plan_slices_seen,
    check_scatter_slices_seen,
    record_launches,
)

# How check_scatter_property can pass the offsets: the dtype (int64 or int32), where they
# live (on the case's device, or ``host``: a CPU tensor), and ``int32_strided``: every other
# element of an int32 buffer (copied offsets may have any stride).
OFFSETS_FORMS = ("int64", "int32", "host", "host_int32", "int32_strided")
_STRIDED_GAP = -7  # the int32_strided buffer's elements between the offsets: no valid offset


def offsets_in_form(offsets: torch.Tensor, form: str) -> torch.Tensor:
    """``offsets`` (int64, on the case's device) as ``form`` (one of ``OFFSETS_FORMS``) says."""
    if form == "int32":
        return offsets.to(torch.int32)
    if form == "int32_strided":
        buf = torch.full((2 * offsets.numel(),), _STRIDED_GAP, dtype=torch.int32)
        return buf.to(offsets.device)[::2].copy_(offsets)
    if form == "host":
        return offsets.cpu()
    if form == "host_int32":
        return offsets.cpu().to(torch.int32)
    assert form == "int64", form
    return offsets


@contextlib.contextmanager
def _inputs_kept(inputs: dict, what: str):
    """Asserts on exit that every tensor of ``inputs`` holds the bytes it held on entry."""
    kept = kept_inputs(inputs)
    yield
    assert_inputs_kept(inputs, kept, what)


def check_scatter_property(
    case: ScatterCase,
    chunk_size: int | None,
    strategy: str,
    *,
    offsets: str = "int64",
    validate: bool = False,
    check_slices: bool = True,
) -> list[Launch]:
    """Dispatched scatter == reference byte for byte (poisoned pool), inputs unchanged,
    launches within blocks, and (``check_slices``) slice-by-slice dispatch == the whole. The
    call is checked with its launches recorded (which takes the full path), then on CUDA
    again unrecorded (the one-pass launch an engine's call takes). ``offsets`` passes them as
    one of ``OFFSETS_FORMS``. Returns the recorded launches."""

    def impl(**kw) -> None:
        kw["offsets"] = offsets_in_form(kw["offsets"], offsets)  # the tensor the call sees
        with _inputs_kept({"offsets": kw["offsets"]}, f"as passed ({offsets})"):
            _scatter.scatter_req_token_ids(
                **kw, chunk_size=chunk_size, strategy=strategy, validate=validate
            )

    with record_launches() as launches:
        whole = check_scatter(impl, case)
    if case.flat_in.is_cuda:  # unrecorded: the one-pass launch, where the call takes it
        pool = case.fresh_pool()
        with _inputs_kept(case.inputs(), "unrecorded"):
            impl(**case.inputs(), pool_out=pool)
        assert_bytes_equal(pool_storage(pool), pool_storage(whole), "pool_out, unrecorded")
    check_launch_blocks(launches)
    check_scatter_slices_seen(case, launches)
    bounds = slice_bounds(case.bs, chunk_size or _scatter.SCATTER_MAX_CHUNK)
    if check_slices and len(bounds) > 1:  # one slice would repeat the whole call
        pool = case.fresh_pool()
        host = case.offsets.cpu()
        for s, e in bounds:
            a, b = int(host[s]), int(host[e])
            _scatter.scatter_req_token_ids(
                flat_in=case.flat_in[a:b],
                offsets=case.offsets[s : e + 1] - a,
                req_pool_indices=case.req_pool_indices[s:e],
                pool_out=pool,
                chunk_size=chunk_size,
                strategy=strategy,
            )
        assert_bytes_equal(
            pool_storage(pool), pool_storage(whole), "pool_out of the slices, one by one"
        )
    return launches


def check_plan_property(
    case: PlanCase,
    chunk_size: int | None,
    strategy: str,
    *,
    validate: bool = False,
    check_slices: bool = True,
) -> list[Launch]:
    """Dispatched plan == reference byte for byte (poisoned outputs), inputs unchanged, the
    same again unrecorded on CUDA (as ``check_scatter_property``), launches within blocks,
    and (``check_slices``) each slice planned on its own, shifted by the running totals and
    concatenated, gives the whole batch's offsets, seeds and scalars. Returns the launches."""
    with record_launches() as launches:
        whole = check_plan(
            _plan.plan_offsets, case, chunk_size=chunk_size, strategy=strategy, validate=validate
        )
    if case.device.type == "cuda":  # unrecorded: the one-pass launch, where the call takes it
        out, inputs = case.fresh_outputs(), case.inputs()
        with _inputs_kept(inputs, "unrecorded"):
            _plan.plan_offsets(
                **inputs, **out, chunk_size=chunk_size, strategy=strategy, validate=validate
            )
        for name in PLAN_OUT_NAMES:
            assert_bytes_equal(out[name], whole[name], f"{name}, unrecorded")
    check_launch_blocks(launches)
    check_plan_slices_seen(case, launches)
    # The call's own slices (auto's are 256 or 1 024 requests, not chunk_size's default).
    bounds = _plan.plan_offsets_launch_plan(case.bs, chunk_size, strategy).slices
    if check_slices and len(bounds) > 1:  # one slice would repeat the call
        _check_plan_slices(case, bounds, chunk_size, strategy, whole)
    return launches


def _check_plan_slices(
    case: PlanCase,
    bounds: tuple[tuple[int, int], ...],
    chunk_size: int | None,
    strategy: str,
    whole: dict[str, torch.Tensor],
) -> None:
    """Each slice of ``bounds`` planned on its own, its offsets shifted by the totals of the
    slices before it, gives ``whole``'s offsets, seeds and scalars. Every slice's call is
    queued before anything is compared, and each output is compared once over all slices, so
    thousands of slices cost no read-back each."""
    outs = []
    for s, e in bounds:
        n = e - s
        part = dataclasses.replace(
            case,
            req_pool_indices=case.req_pool_indices[s:e],
            prefix_lens=case.prefix_lens[s:e],
            extend_seq_lens=case.extend_seq_lens[s:e],
            write_req_capacity=n,
            verify_len=n + 1,
        )
        outs.append(part.fresh_outputs())
        _plan.plan_offsets(**part.inputs(), **outs[-1], chunk_size=chunk_size, strategy=strategy)
    dev = case.device
    # Slice k's n_k + 1 offsets sit at [s_k + k, e_k + k] of the concatenation: one shared end
    # a slice, so position p is whole's index p - k.
    sizes = torch.tensor([e - s + 1 for s, e in bounds], device=dev)
    length = case.bs + len(bounds)
    slice_of = torch.repeat_interleave(
        torch.arange(len(bounds), device=dev), sizes, output_size=length
    )
    index = torch.arange(length, device=dev) - slice_of
    totals = []
    for name in ("out_verify_offsets", "out_write_offsets"):
        got = torch.cat([out[name] for out in outs])
        slice_totals = got[torch.cumsum(sizes, 0) - 1]
        bases = torch.cumsum(slice_totals, 0) - slice_totals
        shifted = got + bases.repeat_interleave(sizes, output_size=length)
        _assert_slices_equal(shifted, whole[name][index], name, bounds, extra=1)
        totals.append(slice_totals.sum())
    seeds = "out_write_seed_slot_indices"
    got = torch.cat([out[seeds] for out in outs])
    _assert_slices_equal(got, whole[seeds][: case.bs], seeds, bounds, extra=0)
    verify_base, write_base = torch.stack(totals).tolist()
    cap = case.verify_capacity
    scalars = (
        ("out_verify_num_valid", min(verify_base, cap)),
        ("out_verify_enable", int(verify_base <= cap)),
        ("out_write_num_valid_reqs", case.bs),
    )
    for name, want in scalars:
        assert int(whole[name][0]) == want, f"{name}={int(whole[name][0])}, slices give {want}"
    assert int(whole["out_write_offsets"][case.bs]) == write_base, "write total"


def _assert_slices_equal(
    got: torch.Tensor, want: torch.Tensor, name: str, bounds: list[tuple[int, int]], extra: int
) -> None:
    """``got`` (each slice's ``e - s + extra`` elements, concatenated) == ``want`` byte for
    byte; the message names the first differing slice and element."""
    assert got.dtype == want.dtype and got.shape == want.shape, (
        name, got.dtype, want.dtype, got.shape, want.shape
    )  # fmt: skip
    diff = (got != want).nonzero()
    if not diff.numel():
        return
    first = int(diff[0, 0])
    offset = 0
    for s, e in bounds:
        if first < offset + e - s + extra:
            break
        offset += e - s + extra
    raise AssertionError(
        f"{name}[{s}:{e + extra}], slices one by one: {diff.shape[0]} element(s) differ (a wrong "
        f"total shifts the slices after it), first at {s + first - offset}: got "
        f"{got[first].item()}, want {want[first].item()}"
    )
