"""One case, many calls: the loop that ``kvcanary-dispatch sweep`` and every benchmark run.

For each call of a case (a strategy, maybe a chunk size), in order: check it against the torch
reference (eagerly, and on a GPU also as a CUDA graph's replay), then time it
(``kvcanary_dispatch.cli.timing``: eager, CUDA-graph replay, launch count); last, the host time
of all of the case's calls, their loops interleaved. Each call becomes one ``Row`` of
``kvcanary_dispatch.cli.results``.
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import partial

import torch

from .calls import refused_under_capture
from .results import Meta, Row
from .timing import add_host_times, replayed, time_call


class CheckError(AssertionError):
    """A measured call disagreed with the torch reference."""


class ContextLost(RuntimeError):
    """A CUDA error poisoned the context: nothing further can run in this process."""


@dataclass
class Case:
    """One workload: what its rows say about it, its keyword inputs, and its check:
    ``check(impl, **kw)`` raises ``AssertionError`` when ``impl(**inputs, **kw)`` is wrong."""

    function: str  # scatter | plan
    distribution: str
    bs: int
    tokens: int
    floor_us: float | None
    inputs: dict
    check: Callable[..., None]

    @property
    def width(self) -> int | None:
        """The scatter pool's width; ``None`` for a plan."""
        pool = self.inputs.get("pool_out")
        return None if pool is None else int(pool.shape[1])


def _short(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]


def _check_context(device: torch.device, what: str) -> None:
    if device.type == "cuda":
        try:
            torch.cuda.synchronize(device)
        except Exception as e:  # noqa: BLE001
            raise ContextLost(f"CUDA context lost after {what}: {_short(e)}") from e


def _check_and_time(
    device: torch.device,
    case: Case,
    row: Row,
    impl: Callable[..., None],
    chunk: int | None,
    record_failures: bool,
    rep_ms: int,
) -> Callable[[], None] | None:
    """Check one call, time it into ``row``; return the call when it was timed."""
    kw = {"chunk_size": chunk} if chunk is not None else {}
    fn = partial(impl, **case.inputs, **kw)
    try:
        case.check(impl, **kw)
        refused = refused_under_capture(
            case.function, row.strategy, chunk, case.bs, case.tokens, case.inputs
        )
        if device.type == "cuda" and not refused:  # the graph timed below, checked first
            try:
                case.check(replayed(impl, device), **kw)
            except AssertionError as err:
                raise AssertionError(f"as a CUDA graph's replay: {err}") from err
        row.set_timing(time_call(fn, device, rep_ms=rep_ms, launches=True, graph=not refused))
        return fn
    except AssertionError as err:
        what = f"{case.function} {row.strategy} bs={case.bs} mix={case.distribution} chunk={chunk}"
        if not record_failures:
            raise CheckError(f"{what} differs from the torch reference: {err}") from err
        row.status, row.error = "wrong", str(err).splitlines()[0][:300]
    except Exception as err:
        if not record_failures:
            raise
        row.status, row.error = "error", _short(err)
        traceback.print_exc(limit=3)
        _check_context(device, f"{case.distribution}/{row.strategy}")
    return None


def time_case(
    meta: Meta,
    device: torch.device,
    case: Case,
    calls: Iterable[tuple[str, int | None, Callable[..., None]]],
    *,
    out: list[Row] | None = None,
    record_failures: bool = False,
    deadline: float | None = None,
    broken: dict[str, str] | None = None,
    rep_ms: int = 100,
    host_rounds: int | None = None,
    before: Callable[[str, int | None], None] | None = None,
) -> list[Row]:
    """Check and time each ``(strategy, chunk, impl)`` of ``calls`` on ``case`` and return
    their rows, also appended to ``out`` as they are made (a ``KeyboardInterrupt`` keeps what
    was measured there; rows checked and timed but stopped before their host time are
    ``skipped``). A wrong result raises ``CheckError`` naming the call, or, with
    ``record_failures``, is a row with status ``wrong``, an exception one with status ``error``
    (and ``broken[strategy]`` a row with that error, not run); past the ``time.monotonic()``
    ``deadline`` the rest are ``skipped``. ``before(strategy, chunk)`` is called before each
    call is checked. Host times: 5 rounds of up to 100 calls on CUDA, the fewest calls that time
    on the CPU (the interpreter), unless ``host_rounds`` is given."""
    rows = []
    timed: list[tuple[Row, Callable[[], None]]] = []
    for strategy, chunk, impl in calls:
        row = meta.row(case.function, strategy, chunk, case.bs, case.distribution,
                       floor_us=case.floor_us, tokens=case.tokens, width=case.width)  # fmt: skip
        if deadline is not None and time.monotonic() > deadline:
            row.status, row.error = "skipped", "time budget spent"
        elif broken and strategy in broken:
            row.status, row.error = "error", broken[strategy]
        else:
            if before is not None:
                before(strategy, chunk)
            fn = _check_and_time(device, case, row, impl, chunk, record_failures, rep_ms)
            if fn is not None:
                timed.append((row, fn))
        rows.append(row)
        if out is not None:
            out.append(row)
    cuda = device.type == "cuda"
    rounds = host_rounds if host_rounds is not None else (5 if cuda else 1)
    try:
        add_host_times([r for r, _ in timed], [f for _, f in timed], device,
                       n=100 if cuda else 1, rounds=rounds)  # fmt: skip
    except KeyboardInterrupt:  # the rows kept in ``out`` say what they lack
        for row, _ in timed:
            if row.host_us is None:
                row.status, row.error = "skipped", "interrupted before its host time"
        raise
    except Exception:
        if not record_failures:
            raise
        traceback.print_exc(limit=3)
    return rows
