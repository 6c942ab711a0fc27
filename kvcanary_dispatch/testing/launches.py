"""Kernel launches as the dispatcher makes them: ``record_launches`` records every launcher call
(``Launch``) with the ``LaunchPlan`` of its call, and the checks here hold each launch to its
plan and its block and, for the sliced paths, to the slice of the batch it must see."""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from kvcanary_kernels import PLAN_BATCH_BLOCK, SCATTER_BATCH_BLOCK
from kvcanary_kernels.scatter_flat import FLAT_TOKEN_BLOCK
from kvcanary_kernels.scatter_rows import ROWS_COLS

from .. import plan as _plan
from .. import scatter as _scatter
from ..launch_plan import PLAN_MAX_TILE, LaunchPlan
from ..launch_plan import Launch as PlannedLaunch
from .cases import PlanCase, ScatterCase


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
    ]
    slots += [(_plan._LAUNCHERS, name, name) for name in _plan._LAUNCHERS]
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
    the list of launches. The one-pass launches of both functions, which call no launcher, are
    off meanwhile: every call takes the full path (same plan, same bound kernels)."""
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
        for module in (_scatter, _plan):
            saved.append((module, "_launched", module._launched))
            module._launched = _full_path_only
        yield launches
    finally:
        for space, name, fn in reversed(saved):
            _set(space, name, fn)


def _full_path_only(*args: object) -> bool:
    return False


def _is_pow2(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def check_launch_blocks(launches: list[Launch]) -> None:
    """Every launch within its block (at most 511 scatter or 4096 plan requests a program;
    a multi-slice plan program walks its slice in tiles of at most ``PLAN_MAX_TILE``
    requests, no wider than the slice or the batch needs); blocks are powers of two; and
    each call's launches are those of its ``LaunchPlan``, in order, with the plan's grids and
    block parameters."""
    for launch in launches:
        kind, bs, block = launch.kind, launch.bs, launch.block
        chunk = launch.args.get("chunk")
        assert _is_pow2(block), f"{launch}: block is not a power of two"
        if kind == "scatter_fixed":
            ok = bs + 1 <= block <= SCATTER_BATCH_BLOCK
        elif kind == "scatter_sliced":
            ok = chunk is not None and 1 <= chunk and chunk + 1 <= block <= SCATTER_BATCH_BLOCK
        elif kind == "scatter_flat":  # block: one tile of tokens, whatever bs is
            ok = block <= FLAT_TOKEN_BLOCK
        elif kind == "scatter_rows":  # block: columns of one request a program copies
            ok = block <= ROWS_COLS
        elif kind in ("scatter_segments", "scatter_capped"):  # block: requests a program owns
            ok = block + 1 <= SCATTER_BATCH_BLOCK
        elif kind == "plan_fixed":
            ok = bs <= block <= PLAN_BATCH_BLOCK
        else:  # multi-slice plans: block = requests of a slice a program holds at once
            ok = chunk is not None and 1 <= chunk <= PLAN_BATCH_BLOCK
            ok = ok and block <= PLAN_MAX_TILE and block < 2 * min(chunk, bs)
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


def check_scatter_slices_seen(case: ScatterCase, launches: list[Launch]) -> None:
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


def check_plan_slices_seen(case: PlanCase, launches: list[Launch]) -> None:
    """Carried fixed-block plan launches cover the batch in order. Compared once over all
    launches (no read-back a launch); the launch-by-launch walk names the first that differs."""
    fixed = [la for la in launches if la.kind == "plan_fixed" and la.args.get("carry") is not None]
    names = ("req_pool_indices", "prefix_lens", "extend_seq_lens")
    if not fixed or (
        sum(la.bs for la in fixed) == case.bs
        and all(getattr(la.bundle, n).shape[0] == la.bs for la in fixed for n in names)
        and all(
            torch.equal(torch.cat([getattr(la.bundle, n) for la in fixed]), getattr(case, n))
            for n in names
        )
    ):
        return
    s = 0
    for k, la in enumerate(fixed):
        n = la.bs
        for name in names:
            want = getattr(case, name)[s : s + n]
            assert torch.equal(getattr(la.bundle, name), want), f"slice {k}: {name}"
        s += n
    assert s == case.bs, f"carried slices cover {s} of {case.bs} requests"
