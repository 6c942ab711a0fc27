"""The dispatcher's properties as plain functions (no pytest), for the tests and ``fuzz``.

Each ``check_*`` raises ``AssertionError`` naming what broke:

- ``check_scatter_property`` / ``check_plan_property``: the dispatched call equals the torch
  reference byte for byte on poisoned outputs; every kernel launch (recorded by
  ``record_launches``) stays within its block; slices see rebased offsets and the matching data;
  dispatching each slice on its own (when there are several) and concatenating the results
  gives the whole.
- ``check_scatter_rejected`` / ``check_plan_rejected``: a call made invalid in a named way
  (``SCATTER_REJECTIONS``, ``PLAN_REJECTIONS``) raises the expected error before any launch
  and leaves every output byte as it was.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from kvcanary_kernels import PLAN_BATCH_BLOCK, SCATTER_BATCH_BLOCK
from kvcanary_kernels._checks import CapacityError

from .. import plan as _plan
from .. import scatter as _scatter
from ..launch_plan import Launch as PlannedLaunch
from ..launch_plan import LaunchPlan
from ..slicing import slice_bounds
from .cases import (
    PLAN_OUT_NAMES,
    PlanCase,
    ScatterCase,
    assert_bytes_equal,
    check_plan,
    check_scatter,
)

# A "flat" program holds no block of requests: it searches the offsets in memory, and what it
# holds is one tile of TOKEN_BLOCK tokens (so at most that many non-empty owners), whatever bs
# is. Its invariant is the tile bound: every flat launch stays within this many tokens.
FLAT_TOKEN_BLOCK_LIMIT = 1024


@dataclass
class Launch:
    """One launcher call as the dispatcher made it: ``args`` are all its arguments, defaults
    filled in; ``plan`` is the ``LaunchPlan`` of the call that made it."""

    kind: str  # the LaunchPlan launcher name: scatter_fixed, scatter_flat, plan_scan, ...
    args: dict = field(repr=False)
    plan: LaunchPlan | None = field(default=None, repr=False)

    @property
    def bundle(self):
        return next(iter(self.args.values()))  # ScatterArgs / PlanInputs, or a keyword dict

    @property
    def bs(self) -> int:
        if self.kind == "scatter_fixed":  # upstream's keyword launcher
            return int(self.args["req_pool_indices"].shape[0])
        return self.bundle.bs

    @property
    def block(self) -> int:
        for name in ("batch_block", "bs_block", "token_block", "reqs", "cols"):
            if name in self.args:
                return int(self.args[name])
        raise KeyError(f"{self.kind} launch has no block argument")

    def __repr__(self) -> str:
        chunk = f", chunk={self.args['chunk']}" if "chunk" in self.args else ""
        return f"Launch({self.kind}, bs={self.bs}, block={self.block}{chunk})"


def _launcher_slots() -> list[tuple[object, str, str]]:
    """(namespace, attribute, kind) of every launcher the dispatcher calls: the scatter
    module's launcher table and upstream launcher, the plan module's launchers."""
    slots: list[tuple[object, str, str]] = [
        (_scatter._LAUNCHERS, name, name) for name in _scatter._LAUNCHERS
    ]
    slots += [
        (_scatter, "launch_scatter_req_token_ids_kernel", "scatter_fixed"),
        (_plan, "enqueue_plan_offsets", "plan_fixed"),
        (_plan, "launch_plan_scan", "plan_scan"),
        (_plan, "launch_plan_lookback", "plan_lookback"),
    ]
    return slots


def _get(space: object, name: str):
    return space[name] if isinstance(space, dict) else getattr(space, name)


def _set(space: object, name: str, value) -> None:
    if isinstance(space, dict):
        space[name] = value
    else:
        setattr(space, name, value)


@contextlib.contextmanager
def record_launches() -> Iterator[list[Launch]]:
    """Patch every launcher the dispatcher calls, and its two plan builders, to record each
    launch with the ``LaunchPlan`` of its call (then run it); restore them on exit. Yields
    the list of launches."""
    launches: list[Launch] = []
    plans: list[LaunchPlan] = []
    saved = []

    def spy(fn: Callable, kind: str) -> Callable:
        sig = inspect.signature(fn)

        def wrapper(*args, **kwargs):
            bound = sig.bind(*args, **kwargs)
            bound.apply_defaults()
            arguments = dict(bound.arguments)
            arguments.update(arguments.pop("keywords", {}))
            launches.append(Launch(kind, arguments, plans[-1] if plans else None))
            return fn(*args, **kwargs)

        return wrapper

    def planner(fn: Callable) -> Callable:
        def wrapper(*args, **kwargs):
            plans.append(fn(*args, **kwargs))
            return plans[-1]

        return wrapper

    slots = _launcher_slots()
    slots += [(_scatter, "scatter_launch_plan", ""), (_plan, "plan_offsets_launch_plan", "")]
    try:
        for space, name, kind in slots:
            fn = _get(space, name)
            saved.append((space, name, fn))
            _set(space, name, spy(fn, kind) if kind else planner(fn))
        yield launches
    finally:
        for space, name, fn in reversed(saved):
            _set(space, name, fn)


def _is_pow2(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def check_launch_blocks(launches: list[Launch]) -> None:
    """Every launch within its block (at most 511 scatter or 4096 plan requests); blocks are
    powers of two; and each call's launches are those of its ``LaunchPlan``, in order, with
    the plan's grids and block parameters."""
    for launch in launches:
        kind, bs, block = launch.kind, launch.bs, launch.block
        chunk = launch.args.get("chunk")
        assert _is_pow2(block), f"{launch}: block is not a power of two"
        if kind == "scatter_fixed":
            ok = bs + 1 <= block <= SCATTER_BATCH_BLOCK
        elif kind == "scatter_sliced":
            ok = chunk is not None and 1 <= chunk and chunk + 1 <= block <= SCATTER_BATCH_BLOCK
        elif kind == "scatter_flat":
            ok = block <= FLAT_TOKEN_BLOCK_LIMIT
        elif kind == "scatter_rows":  # block: columns of one request a program copies
            ok = block <= FLAT_TOKEN_BLOCK_LIMIT
        elif kind == "scatter_segments":  # block: requests a program owns
            ok = block + 1 <= SCATTER_BATCH_BLOCK
        elif kind == "plan_fixed":
            ok = bs <= block <= PLAN_BATCH_BLOCK
        else:
            ok = chunk is not None and 1 <= chunk <= block <= PLAN_BATCH_BLOCK
        assert ok, f"{launch} exceeds its block"
    _check_launches_follow_plans(launches)


def _check_launches_follow_plans(launches: list[Launch]) -> None:
    """Group the launches by the plan of their call; each group is that plan's launch list
    (a ``loop`` slice with no tokens launches nothing, so it may be missing)."""
    groups: list[tuple[LaunchPlan, list[Launch]]] = []
    for la in launches:
        assert la.plan is not None, f"{la} was made without a LaunchPlan"
        if not groups or groups[-1][0] is not la.plan:
            groups.append((la.plan, []))
        groups[-1][1].append(la)
    for plan, made in groups:
        if plan.slices:
            ends = [e for _, e in plan.slices]
            starts = [s for s, _ in plan.slices]
            assert starts == [0, *ends[:-1]] and ends[-1] == plan.bs, (
                f"{plan.strategy}: slices {plan.slices[:3]}... do not tile [0, {plan.bs})"
            )
        planned = list(plan.launches)
        for la in made:
            while planned and not _matches(la, planned[0]):
                assert plan.strategy == "loop", f"{la} is not the plan's next launch {planned[0]}"
                planned.pop(0)  # an empty loop slice: its launcher returned before launching
            assert planned, f"{la} is not in its plan ({plan.strategy}, bs={plan.bs})"
            planned.pop(0)


def _matches(la: Launch, planned: PlannedLaunch) -> bool:
    if la.kind != planned.launcher:
        return False
    if "grid" in la.args and la.args["grid"] != planned.grid:
        return False
    if planned.requests is not None and la.bs != planned.requests[1] - planned.requests[0]:
        return False
    return all(la.args.get(k) == v for k, v in planned.params)


def _check_scatter_slices_seen(case: ScatterCase, launches: list[Launch]) -> None:
    """Fixed-block scatter launches cover the batch in order, each with rebased offsets and its
    own slice of ``flat_in``."""
    fixed = [la for la in launches if la.kind == "scatter_fixed"]
    if not fixed:
        return
    offsets = case.offsets.cpu()
    s = a = 0
    for k, la in enumerate(fixed):
        n = la.bs
        b = a + int(la.args["flat_in"].shape[0])
        got = la.args["offsets"].cpu()
        assert int(got[0]) == 0, f"slice {k}: offsets not rebased (start {int(got[0])})"
        assert torch.equal(got + a, offsets[s : s + n + 1]), f"slice {k}: offsets wrong"
        assert b == int(offsets[s + n]), f"slice {k}: flat_in slice ends at {b}"
        assert torch.equal(la.args["flat_in"], case.flat_in[a:b]), f"slice {k}: flat_in"
        assert torch.equal(la.args["req_pool_indices"], case.req_pool_indices[s : s + n]), (
            f"slice {k}: req_pool_indices"
        )
        s, a = s + n, b
    assert (s, a) == (case.bs, case.total), f"slices cover {s} requests, {a} tokens"


def _check_plan_slices_seen(case: PlanCase, launches: list[Launch]) -> None:
    """Carried fixed-block plan launches cover the batch in order."""
    fixed = [la for la in launches if la.kind == "plan_fixed" and la.args.get("carry") is not None]
    s = 0
    for k, la in enumerate(fixed):
        n = la.bs
        for name in ("req_pool_indices", "prefix_lens", "extend_seq_lens"):
            want = getattr(case, name)[s : s + n]
            assert torch.equal(getattr(la.bundle, name), want), f"slice {k}: {name}"
        s += n
    assert not fixed or s == case.bs, f"carried slices cover {s} of {case.bs} requests"


def _offsets_variant(offsets: torch.Tensor, variant: str) -> torch.Tensor:
    if variant == "int32":
        return offsets.to(torch.int32)
    if variant == "host":
        return offsets.cpu()
    if variant == "host_int32":
        return offsets.cpu().to(torch.int32)
    assert variant == "int64", variant
    return offsets


OFFSETS_VARIANTS = ("int64", "int32", "host", "host_int32")


def check_scatter_property(
    case: ScatterCase,
    chunk_size: int | None,
    strategy: str,
    *,
    offsets: str = "int64",
    validate: bool = False,
    check_slices: bool = True,
) -> list[Launch]:
    """Dispatched scatter == reference byte for byte (poisoned pool), launches within blocks,
    and (``check_slices``) slice-by-slice dispatch == the whole. ``offsets`` passes them as
    one of ``OFFSETS_VARIANTS``. Returns the recorded launches."""

    def impl(**kw) -> None:
        kw["offsets"] = _offsets_variant(kw["offsets"], offsets)
        _scatter.scatter_req_token_ids(
            **kw, chunk_size=chunk_size, strategy=strategy, validate=validate
        )

    with record_launches() as launches:
        whole = check_scatter(impl, case)
    check_launch_blocks(launches)
    _check_scatter_slices_seen(case, launches)
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
        assert_bytes_equal(pool, whole, "pool_out of the slices, one by one")
    return launches


def check_plan_property(
    case: PlanCase,
    chunk_size: int | None,
    strategy: str,
    *,
    validate: bool = False,
    check_slices: bool = True,
) -> list[Launch]:
    """Dispatched plan == reference byte for byte (poisoned outputs), launches within blocks,
    and (``check_slices``) each slice planned on its own, shifted by the running totals and
    concatenated, gives the whole batch's offsets, seeds and scalars. Returns the launches."""
    with record_launches() as launches:
        whole = check_plan(
            _plan.plan_offsets, case, chunk_size=chunk_size, strategy=strategy, validate=validate
        )
    check_launch_blocks(launches)
    _check_plan_slices_seen(case, launches)
    if check_slices and case.bs > (chunk_size or _plan.PLAN_MAX_CHUNK):  # else: the call again
        _check_plan_slices(case, chunk_size, strategy, whole)
    return launches


def _check_plan_slices(
    case: PlanCase, chunk_size: int | None, strategy: str, whole: dict[str, torch.Tensor]
) -> None:
    verify_base = write_base = 0
    for s, e in slice_bounds(case.bs, chunk_size or _plan.PLAN_MAX_CHUNK):
        n = e - s
        part = dataclasses.replace(
            case,
            req_pool_indices=case.req_pool_indices[s:e],
            prefix_lens=case.prefix_lens[s:e],
            extend_seq_lens=case.extend_seq_lens[s:e],
            write_req_capacity=n,
            verify_len=n + 1,
        )
        out = part.fresh_outputs()
        _plan.plan_offsets(**part.inputs(), **out, chunk_size=chunk_size, strategy=strategy)
        for name, base in (("out_verify_offsets", verify_base), ("out_write_offsets", write_base)):
            assert_bytes_equal(out[name] + base, whole[name][s : e + 1], f"{name}[{s}:{e + 1}]")
        seeds = "out_write_seed_slot_indices"
        assert_bytes_equal(out[seeds], whole[seeds][s:e], f"{seeds}[{s}:{e}]")
        verify_base += int(out["out_verify_offsets"][n])
        write_base += int(out["out_write_offsets"][n])
    cap = case.verify_capacity
    scalars = (
        ("out_verify_num_valid", min(verify_base, cap)),
        ("out_verify_enable", int(verify_base <= cap)),
        ("out_write_num_valid_reqs", case.bs),
    )
    for name, want in scalars:
        assert int(whole[name][0]) == want, f"{name}={int(whole[name][0])}, slices give {want}"
    assert int(whole["out_write_offsets"][case.bs]) == write_base, "write total"


# ---------------------------------------------------------------- rejected calls


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


def _bad_rows(rpi: torch.Tensor, rows: int, index: int, how: str, lo: int = 0) -> tuple | None:
    """``(new req_pool_indices, first bad index)``; ``lo``: the smallest valid active row."""
    rpi = rpi.clone()
    bs = int(rpi.numel())
    if how == "negative" and bs >= 1:
        r = _one(index, 0, bs)
        rpi[r] = -1 - index % 5
    elif how == "too_big" and bs >= 1:
        r = _one(index, 0, bs)
        rpi[r] = rows + index % 5
    elif how == "duplicate":
        active = (rpi >= lo).nonzero()[:, 0].tolist()
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
    bad = _bad_rows(case.req_pool_indices, case.pool_rows, index, how)
    if bad is None:
        return None
    rpi, r = bad
    return Rejection(
        {"req_pool_indices": rpi, "validate": True}, ValueError, f"req_pool_indices[{r}]="
    )


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


def _scatter_rejections() -> dict[str, Callable[[ScatterCase, int], Rejection | None]]:
    table: dict[str, Callable[[ScatterCase, int], Rejection | None]] = {
        name: (lambda c, i, n=name: _chunk_rejection(n, _scatter.SCATTER_MAX_CHUNK))
        for name in _CHUNK_REJECTIONS
    }
    table.update(
        strategy_unknown=lambda c, i: Rejection({"strategy": "bogus"}, ValueError, "bogus"),
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
    bad = _bad_rows(case.req_pool_indices, int(case.req_to_token.shape[0]), index, how, lo=1)
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


# verify_capacity values the int32 out_verify_num_valid cannot hold (2**31 - 1 is accepted).
_PAST_INT32 = (2**31, 2**31 + 1, 3 * 2**31, 2**62, 2**63 - 1)


def _plan_rejections() -> dict[str, Callable[[PlanCase, int], Rejection | None]]:
    table: dict[str, Callable[[PlanCase, int], Rejection | None]] = {
        name: (lambda c, i, n=name: _chunk_rejection(n, _plan.PLAN_MAX_CHUNK))
        for name in _CHUNK_REJECTIONS
    }
    table.update(
        strategy_unknown=lambda c, i: Rejection({"strategy": "bogus"}, ValueError, "bogus"),
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
    )
    return table


PLAN_REJECTIONS = _plan_rejections()


def _expect_rejection(call: Callable[[], None], rejection: Rejection, what: str) -> None:
    with record_launches() as launches:
        try:
            call()
        except rejection.exc as err:
            message = str(err)
        else:
            raise AssertionError(f"{what}: accepted, expected {rejection.exc.__name__}")
    assert rejection.text in message, f"{what}: {message!r} lacks {rejection.text!r}"
    assert not launches, f"{what}: rejected after launching {launches}"


def check_scatter_rejected(
    case: ScatterCase, name: str, index: int = 0, strategy: str = "auto"
) -> bool:
    """Break the call as ``SCATTER_REJECTIONS[name]`` says (``index`` picks a position), and
    check the error and that ``pool_out`` is untouched. ``False`` if the breakage needs a
    larger batch."""
    rejection = SCATTER_REJECTIONS[name](case, index)
    if rejection is None:
        return False
    kwargs = {**case.kwargs(case.fresh_pool()), "strategy": strategy, **rejection.overrides}
    before = kwargs["pool_out"].clone()
    _expect_rejection(lambda: _scatter.scatter_req_token_ids(**kwargs), rejection, name)
    assert_bytes_equal(kwargs["pool_out"], before, f"{name}: pool_out after the rejected call")
    return True


def check_plan_rejected(case: PlanCase, name: str, index: int = 0, strategy: str = "auto") -> bool:
    """As ``check_scatter_rejected``, for ``plan_offsets`` and all six outputs."""
    rejection = PLAN_REJECTIONS[name](case, index)
    if rejection is None:
        return False
    kwargs = {**case.inputs(), **case.fresh_outputs(), "strategy": strategy}
    kwargs.update(rejection.overrides)
    before = {k: kwargs[k].clone() for k in PLAN_OUT_NAMES}
    _expect_rejection(lambda: _plan.plan_offsets(**kwargs), rejection, name)
    for k in PLAN_OUT_NAMES:
        assert_bytes_equal(kwargs[k], before[k], f"{name}: {k} after the rejected call")
    return True
