"""The chunk-size sweep behind ``kvcanary-dispatch sweep``.

Every point is one dispatched call (op, length mix, bs, strategy, chunk size) on a seeded
workload (``kvcanary_dispatch.cli.workloads``). Each call is first checked byte for byte against
the torch reference, then timed with the primitives the benchmark suite shares
(``kvcanary_dispatch.cli.timing``). Strategies that take a chunk size (scatter ``loop`` and
``sliced``, plan ``loop``, ``scan``, ``lookback`` and ``recount``) are swept over chunk sizes;
the others (``auto`` with no chunk size, ``flat``, ``segments``, the per-request-grid baseline,
the torch reference, the fixed-block launch) are measured once per batch and drawn as horizontal
reference lines, as is the HBM floor (12 bytes per moved token at the measured copy bandwidth;
GPU only).

Outputs (``kvcanary_dispatch.cli.sweep_report``): ``sweep.csv`` (the rows of
``kvcanary_dispatch.cli.results``, as every benchmark writes them), ``sweep.png`` and ``sweep.md``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from functools import partial

import torch

from ..launch_plan import plan_offsets_launch_plan, scatter_launch_plan
from ..plan import PLAN_MAX_CHUNK
from ..scatter import SCATTER_MAX_CHUNK
from ..slicing import SliceBounds
from ..testing.cases import check_plan, check_scatter
from .calls import plan_calls, scatter_calls
from .harness import Case, CheckError, time_case
from .progress import Progress
from .results import Meta, Row
from .timing import floor_us, scatter_token_bytes
from .workloads import MIXES, POOL_WIDTH, plan_workload, scatter_workload

OPS = ("scatter", "plan")
CHUNKED = {"scatter": ("loop", "sliced"), "plan": ("loop", "scan", "lookback", "recount")}
UNCHUNKED = {
    "scatter": (
        "auto",
        "capped",
        "rows",
        "flat",
        "segments",
        "per_request_grid",
        "torch_ref",
        "fixed_block",
    ),
    "plan": ("auto", "torch_ref", "fixed_block"),
}
# Every strategy the sweep knows, the chunked ones first, each once.
STRATEGIES = tuple(
    dict.fromkeys(s for table in (CHUNKED, UNCHUNKED) for op in OPS for s in table[op])
)
DEFAULT_STRATEGIES = ("loop", "sliced", "scan", "auto", "per_request_grid", "torch_ref")
MAX_CHUNK = {"scatter": SCATTER_MAX_CHUNK, "plan": PLAN_MAX_CHUNK}
CPU_CHUNK_SIZES = (8, 64, SCATTER_MAX_CHUNK)  # the CPU sweep's chunk sizes (the interpreter)
CPU_NOTE = (
    "CPU run: the kernels ran in Triton's interpreter, one program after another; these timings "
    "say nothing about GPU performance (they check that the sweep runs)."
)


def default_chunk_sizes(op: str) -> list[int]:
    """Powers of two below the op's register block, and its largest chunk: scatter 1..256 and
    511, plan 1..2048 and 4096."""
    top = MAX_CHUNK[op]
    return [1 << k for k in range(top.bit_length()) if (1 << k) < top] + [top]


@dataclass
class SweepConfig:
    """What to sweep. ``chunk_sizes=None``: each op's ``default_chunk_sizes``."""

    device: torch.device
    ops: tuple[str, ...] = ("scatter",)
    batch_sizes: tuple[int, ...] = (512, 4096, 32768)
    mixes: tuple[str, ...] = tuple(MIXES)
    chunk_sizes: tuple[int, ...] | None = None
    strategies: tuple[str, ...] = DEFAULT_STRATEGIES
    width: int = POOL_WIDTH
    max_launches: int = 1024
    metric: str = "kernel"

    def chunks_for(self, op: str) -> list[int]:
        sizes = self.chunk_sizes if self.chunk_sizes is not None else default_chunk_sizes(op)
        return sorted({c for c in sizes if 1 <= c <= MAX_CHUNK[op]})


def default_config(device: torch.device) -> SweepConfig:
    """GPU: bs 512, 4096, 32768, every mix, every default chunk size, pool width 8192, at most
    1024 launches a call. CPU (interpreter): a grid that runs in one to two and a half minutes
    on two cores."""
    if device.type == "cuda":
        return SweepConfig(device)
    return SweepConfig(
        device,
        batch_sizes=(64, 600),
        mixes=("ones", "u128"),
        chunk_sizes=CPU_CHUNK_SIZES,
        width=64,
        max_launches=128,
    )


@dataclass(frozen=True)
class Point:
    op: str
    mix: str
    bs: int
    strategy: str
    chunk: int | None


def planned_launches(op: str, strategy: str, bs: int, chunk: int | None) -> int:
    """Device operations one eager call makes, read from its ``LaunchPlan`` (Triton launches
    plus its temporaries: a loop plan's carry fill, ...; an eager look-back fills nothing),
    for a batch of ``4 * bs`` tokens."""
    if op == "plan":
        plan = plan_offsets_launch_plan(bs, chunk, strategy)
    else:
        plan = scatter_launch_plan(bs, 4 * bs, chunk, strategy)
    return plan.device_ops


def _past_max_launches(op: str, strategy: str, bs: int, chunk: int, config: SweepConfig) -> str:
    """Why a point makes more device ops than ``--max-launches``, or ``""``. A ``loop``
    launches a slice at a time, so one with more slices than that (counted, not listed: a
    list of them takes minutes at 10**10 requests) is past it without its plan."""
    limit = config.max_launches
    least = len(SliceBounds(bs, chunk)) if strategy == "loop" else 0
    if least > limit:
        return f"at least {least} device ops a call (a launch a slice) > --max-launches {limit}"
    n = planned_launches(op, strategy, bs, chunk)
    if n > limit:
        return f"{n} device ops a call (launches and torch ops) > --max-launches {limit}"
    return ""


@dataclass(frozen=True)
class Skip:
    """A point not measured: why, and the options that would measure it."""

    point: Point
    reason: str
    fix: str


def enumerate_points(config: SweepConfig) -> tuple[list[Point], list[Skip]]:
    """The points to measure, in run order, and the skipped ones."""
    points: list[Point] = []
    skipped: list[Skip] = []
    for op in config.ops:
        mixes = config.mixes if op == "scatter" else ("decode",)
        block = MAX_CHUNK[op]  # the fixed-block launch's request limit
        for mix in mixes:
            for bs in config.batch_sizes:
                for strategy in config.strategies:
                    if strategy in CHUNKED[op]:
                        for chunk in config.chunks_for(op):
                            p = Point(op, mix, bs, strategy, chunk)
                            reason = _past_max_launches(op, strategy, bs, chunk, config)
                            if reason:
                                fix = "raise --max-launches or use larger --chunk-sizes"
                                skipped.append(Skip(p, reason, fix))
                            else:
                                points.append(p)
                    elif strategy in UNCHUNKED[op]:
                        p = Point(op, mix, bs, strategy, None)
                        if strategy == "fixed_block" and bs > block:
                            reason = f"bs > the fixed block's {block} requests"
                            fix = (
                                f"fixed_block is one unsplit launch: give --bs at most {block} "
                                "or add a splitting strategy"
                            )
                            skipped.append(Skip(p, reason, fix))
                        else:
                            points.append(p)
    return points, skipped


@dataclass
class SweepResult:
    meta: Meta
    rows: list[Row]
    skipped: list[Skip]
    config: SweepConfig
    interrupted: bool = False
    notes: list[str] = field(default_factory=list)


SweepCheckError = CheckError  # a measured call disagreed with the torch reference


def _check(check: Callable[..., None], work, impl: Callable[..., None], **kw) -> None:
    check(impl, work, **kw)


def run_sweep(
    config: SweepConfig,
    progress: Progress | None = None,
    log: Callable[[str], None] = print,
) -> SweepResult:
    """Measure every point of ``config``. Raises ``SweepCheckError`` when a call's output
    differs from the reference; a ``KeyboardInterrupt`` stops the sweep and returns what was
    measured (``interrupted=True``; rows stopped before their host time are ``skipped``, by
    ``time_case``)."""
    device = config.device
    meta = Meta.collect(device)
    points, skipped = enumerate_points(config)
    if progress is not None:
        progress.total = len(points)
    result = SweepResult(meta, [], skipped, config)
    done = 0
    try:
        for (op, mix, bs), group in _grouped(points):
            if op == "scatter":
                work = scatter_workload(bs, mix, device, width=config.width)
                floor = floor_us(scatter_token_bytes(work), meta.copy_gbs)
                calls, tokens = scatter_calls(work), work.total
                check, inputs = check_scatter, work.kwargs(work.fresh_pool())
            else:
                work = plan_workload(bs, device)
                floor, calls, tokens = None, plan_calls(work), bs
                check, inputs = check_plan, {**work.inputs(), **work.fresh_outputs()}
            case = Case(op, mix, bs, tokens, floor, inputs, partial(_check, check, work))

            def before(strategy: str, chunk: int | None, op=op, mix=mix, bs=bs) -> None:
                nonlocal done
                if progress is not None:
                    text = f" chunk={chunk}" if chunk else ""
                    progress.update(done, f"{op} {mix} bs={bs} {strategy}{text}")
                done += 1

            todo = [(p.strategy, p.chunk, calls[p.strategy]) for p in group]
            time_case(meta, device, case, todo, out=result.rows, before=before)
            del case, work, inputs
    except KeyboardInterrupt:
        result.interrupted = True
    finally:
        if progress is not None:
            progress.update(done, "done" if not result.interrupted else "interrupted")
            progress.close()
    return result


def _grouped(points: list[Point]) -> Iterable[tuple[tuple[str, str, int], list[Point]]]:
    """Consecutive points sharing (op, mix, bs): one workload each."""
    group: list[Point] = []
    for p in points:
        if group and (group[0].op, group[0].mix, group[0].bs) != (p.op, p.mix, p.bs):
            yield (group[0].op, group[0].mix, group[0].bs), group
            group = []
        group.append(p)
    if group:
        yield (group[0].op, group[0].mix, group[0].bs), group
