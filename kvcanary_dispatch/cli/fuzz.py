"""The dispatcher's property checks run by hypothesis outside pytest (``kvcanary-dispatch fuzz``).

Each example is one ``Call``: a dispatched scatter or plan compared byte for byte with the torch
reference (``properties.check_scatter_property`` / ``check_plan_property``), or a call broken
in a named way that must be rejected before any launch (``check_*_rejected``). Inputs come from
``kvcanary_dispatch.testing.strategies`` with the bounds of one of its ``SIZES``. On a failure,
hypothesis shrinks the call and ``repro_snippet`` turns the shrunk one into a runnable script.
"""

from __future__ import annotations

import dataclasses
import functools
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from hypothesis import HealthCheck, Phase, Verbosity, given, reject, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st

from ..plan import PLAN_MAX_CHUNK, PLAN_STRATEGIES
from ..scatter import SCATTER_MAX_CHUNK, SCATTER_STRATEGIES
from ..testing import properties as _props
from ..testing.cases import PlanCase, ScatterCase
from ..testing.strategies import Sizes, chunk_and_bs, plan_cases_for, scatter_cases_for
from .errors import out_of_memory

KINDS = {
    "scatter": ("scatter", "scatter_rejected"),
    "plan": ("plan", "plan_rejected"),
}
_REJECTION_MAX_BS = 40
_LITERAL_MAX_ELEMS = 4096  # larger counterexamples are saved to a .pt file


@dataclass
class Call:
    """One fuzzed call and the check that judges it."""

    kind: str  # "scatter", "plan", "scatter_rejected" or "plan_rejected"
    case: ScatterCase | PlanCase
    strategy: str
    chunk: int | None = None
    offsets: str = "int64"  # scatter: how the offsets are passed (OFFSETS_FORMS)
    validate: bool = False
    rejection: str | None = None
    index: int = 0
    one_pass: bool = False  # a rejected call made unrecorded, the one-pass launch on

    def run(self) -> bool:
        """Run the check; ``False`` when a rejection needs a larger batch (not a test)."""
        if self.kind == "scatter":
            _props.check_scatter_property(
                self.case, self.chunk, self.strategy, offsets=self.offsets, validate=self.validate
            )
        elif self.kind == "plan":
            _props.check_plan_property(self.case, self.chunk, self.strategy, validate=self.validate)
        elif self.kind == "scatter_rejected":
            return _props.check_scatter_rejected(
                self.case, self.rejection, self.index, self.strategy, self.one_pass
            )
        else:
            return _props.check_plan_rejected(
                self.case, self.rejection, self.index, self.strategy, self.one_pass
            )
        return True

    @property
    def tokens(self) -> int:
        return self.case.total if isinstance(self.case, ScatterCase) else 0

    def __repr__(self) -> str:
        extra = (
            f", rejection={self.rejection!r}, one_pass={self.one_pass}"
            if self.rejection
            else f", chunk={self.chunk}"
        )
        return f"Call({self.kind}, bs={self.case.bs}, strategy={self.strategy!r}{extra})"


def calls(kinds: tuple[str, ...], sizes: Sizes, device: str) -> st.SearchStrategy[Call]:
    """Calls of the given kinds with inputs bounded by ``sizes``."""

    @st.composite
    def build(draw: st.DrawFn) -> Call:
        kind = draw(st.sampled_from(kinds))
        if kind in ("scatter", "plan"):
            top = SCATTER_MAX_CHUNK if kind == "scatter" else PLAN_MAX_CHUNK
            chunk, bs = draw(chunk_and_bs(top, sizes.max_bs, sizes.max_slices))
            chunk = draw(st.sampled_from([chunk, None]))
            if kind == "scatter":
                return Call(
                    kind,
                    draw(scatter_cases_for(sizes, device, bs=bs)),
                    draw(st.sampled_from(SCATTER_STRATEGIES)),
                    chunk,
                    offsets=draw(st.sampled_from(_props.OFFSETS_FORMS)),
                    validate=draw(st.booleans()),
                )
            return Call(
                kind,
                draw(plan_cases_for(sizes, device, bs=bs)),
                draw(st.sampled_from(PLAN_STRATEGIES)),
                chunk,
                validate=draw(st.booleans()),
            )
        bs = st.integers(0, min(_REJECTION_MAX_BS, sizes.max_bs))
        if kind == "scatter_rejected":
            case = draw(scatter_cases_for(sizes, device, bs=bs))
            names, strategies = sorted(_props.SCATTER_REJECTIONS), SCATTER_STRATEGIES
        else:
            case = draw(plan_cases_for(sizes, device, bs=bs))
            names, strategies = sorted(_props.PLAN_REJECTIONS), PLAN_STRATEGIES
        return Call(
            kind,
            case,
            draw(st.sampled_from(strategies)),
            rejection=draw(st.sampled_from(names)),
            index=draw(st.integers(0, 2**16)),
            one_pass=draw(st.booleans()),
        )

    return build()


@dataclass
class FuzzStats:
    examples: int = 0
    by_kind: Counter = field(default_factory=Counter)
    max_bs: int = 0
    max_tokens: int = 0
    elapsed_s: float = 0.0
    batches: int = 0


@dataclass
class Failure:
    call: Call
    error: BaseException
    seed: int


@dataclass
class FuzzOutcome:
    stats: FuzzStats
    failure: Failure | None
    # Stopped by Ctrl-C (KeyboardInterrupt): the examples so far, and a failure found before
    # it as far as it was shrunk (the smallest failing call seen)
    interrupted: bool = False


class _OutOfMemory(BaseException):
    """An example's allocation that did not fit (its error is ``args[0]``), carried out of
    hypothesis, which neither shrinks nor reports what is not an ``Exception``."""


def _own_hypothesis_home(fn: Callable[..., FuzzOutcome]) -> Callable[..., FuzzOutcome]:
    """``fn`` run with hypothesis's files (its constants cache; the fuzz keeps no example
    database) in a temporary folder, removed after, so that nothing is written under the
    current directory; the caller's hypothesis home is set back after."""

    @functools.wraps(fn)
    def run(*args, **kwargs) -> FuzzOutcome:
        from hypothesis import configuration

        before = getattr(configuration, "__hypothesis_home_directory", None)
        with tempfile.TemporaryDirectory(prefix="kvcanary-fuzz-") as home:
            configuration.set_hypothesis_home_dir(home)
            try:
                return fn(*args, **kwargs)
            finally:
                configuration.set_hypothesis_home_dir(before)

    return run


@_own_hypothesis_home
def run_fuzz(
    *,
    device: str,
    sizes: Sizes,
    ops: tuple[str, ...] = ("scatter", "plan"),
    examples: int | None = None,
    minutes: float | None = None,
    seed: int = 0,
    on_example: Callable[[FuzzStats, bool], None] | None = None,
    batch: int = 25,
) -> FuzzOutcome:
    """Run examples until ``examples`` pass or ``minutes`` are up (whichever comes first; at
    least one of them must be given), in batches of ``batch`` examples, each batch a fresh
    hypothesis run seeded ``seed + batch index``. Stops at the first failure, after shrinking
    it. ``on_example(stats, shrinking)`` is called after every example. A ``KeyboardInterrupt``
    ends the run with what it has (``interrupted``): the examples passed, and a failure found
    before it, shrunk as far as it got. An example that runs out of memory (``out_of_memory``)
    is no failure: its error is raised as it came (while a failure is shrunk, such a smaller
    case is skipped)."""
    if examples is None and minutes is None:
        raise ValueError("give examples or minutes")
    kinds = tuple(k for op in ops for k in KINDS[op])
    strategy = calls(kinds, sizes, device)
    stats = FuzzStats()
    start = time.perf_counter()
    deadline = start + 60 * minutes if minutes is not None else None
    state: dict = {"failure": None, "shrinking": False}

    def body(call: Call) -> None:
        try:
            applicable = call.run()
        except Exception as err:
            if out_of_memory(err) is not None:  # the machine's limit, not a wrong result
                if state["shrinking"]:
                    reject()
                raise _OutOfMemory(err) from None
            state["failure"] = (call, err)
            state["shrinking"] = True
            if on_example:
                on_example(stats, True)
            raise
        if not applicable:
            reject()
        if not state["shrinking"]:
            stats.examples += 1
            stats.by_kind[call.kind] += 1
            stats.max_bs = max(stats.max_bs, call.case.bs)
            stats.max_tokens = max(stats.max_tokens, call.tokens)
            stats.elapsed_s = time.perf_counter() - start
            if on_example:
                on_example(stats, False)

    k = 0
    try:
        while True:
            remaining = None if examples is None else examples - stats.examples
            if remaining is not None and remaining <= 0:
                break
            if deadline is not None and time.perf_counter() >= deadline:
                break
            n = (
                batch
                if remaining is None
                else (remaining if deadline is None else min(batch, remaining))
            )
            prop = settings(
                max_examples=n,
                deadline=None,
                database=None,
                derandomize=False,
                phases=(Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink),
                suppress_health_check=list(HealthCheck),
                report_multiple_bugs=False,
                verbosity=Verbosity.quiet,
            )(given(call=strategy)(body))
            before = stats.examples
            try:
                hypothesis_seed(seed + k)(prop)()
            except _OutOfMemory as stop:
                raise stop.args[0] from None
            except KeyboardInterrupt:
                found = state["failure"]
                failure = Failure(found[0], found[1], seed + k) if found is not None else None
                return FuzzOutcome(stats, failure, interrupted=True)
            except Exception as err:
                call, first = state["failure"] or (None, err)
                if call is None:
                    raise
                return FuzzOutcome(stats, Failure(call, first, seed + k))
            stats.batches += 1
            k += 1
            if stats.examples == before:  # nothing valid was generated: do not spin
                break
        return FuzzOutcome(stats, None)
    finally:  # whichever way the run ends, its time is what it took
        stats.elapsed_s = time.perf_counter() - start


# ---------------------------------------------------------------- the counterexample


def _literal(t: torch.Tensor | None) -> str:
    if t is None:
        return "None"
    return f"torch.tensor({t.cpu().tolist()!r}, dtype={t.dtype}, device=device)"


def _case_elems(case: ScatterCase | PlanCase) -> int:
    return sum(
        getattr(case, f.name).numel()
        for f in dataclasses.fields(case)
        if isinstance(getattr(case, f.name), torch.Tensor)
    )


def repro_snippet(call: Call, save_dir: Path | None = None) -> tuple[str, Path | None]:
    """A self-contained Python script that rebuilds ``call``'s inputs and runs its check.
    Inputs of more than a few thousand elements are saved to ``save_dir`` (a ``.pt`` file the
    script loads); returns the script and that file (or ``None``)."""
    case = call.case
    cls = type(case).__name__
    dev = case.flat_in.device if isinstance(case, ScatterCase) else case.device
    device = str(dev)  # "cuda:1" where the failure was found on that GPU
    rejected = (
        f"case, {call.rejection!r}, index={call.index}, strategy={call.strategy!r}, "
        f"one_pass={call.one_pass!r}"
    )
    fn, args = {
        "scatter": (
            "check_scatter_property",
            f"case, {call.chunk!r}, {call.strategy!r}, offsets={call.offsets!r}, "
            f"validate={call.validate!r}",
        ),
        "plan": (
            "check_plan_property",
            f"case, {call.chunk!r}, {call.strategy!r}, validate={call.validate!r}",
        ),
        "scatter_rejected": ("check_scatter_rejected", rejected),
        "plan_rejected": ("check_plan_rejected", rejected),
    }[call.kind]
    lines = ['"""kvcanary-dispatch fuzz counterexample: raises if the failure reproduces."""', ""]
    if device == "cpu":
        lines += [
            "import os",
            "",
            "# No GPU: Triton's interpreter, switched on before any kernel module is imported.",
            'os.environ.setdefault("TRITON_INTERPRET", "1")',
            "",
        ]
    lines += [
        "import torch",
        "",
        f"from kvcanary_dispatch.testing.cases import {cls}",
        f"from kvcanary_dispatch.testing.properties import {fn}",
        "",
        f'device = "{device}"',
    ]
    saved = None
    if _case_elems(case) <= _LITERAL_MAX_ELEMS:
        lines.append(f"case = {cls}(")
        for f in dataclasses.fields(case):
            v = getattr(case, f.name)
            is_t = isinstance(v, torch.Tensor) or (f.name == "lut" and v is None)
            lines.append(f"    {f.name}={_literal(v) if is_t else repr(v)},")
        lines.append(")")
    else:
        save_dir = (save_dir if save_dir is not None else Path.cwd()).resolve()  # any folder
        save_dir.mkdir(parents=True, exist_ok=True)
        saved = save_dir / f"kvcanary-fuzz-{time.strftime('%Y%m%d-%H%M%S')}.pt"
        fields = {}
        for f in dataclasses.fields(case):
            v = getattr(case, f.name)
            fields[f.name] = v.cpu() if isinstance(v, torch.Tensor) else v
        torch.save(fields, saved)
        lines += [
            f"fields = torch.load({str(saved)!r})",
            f"case = {cls}(",
            "    **{k: v.to(device) if isinstance(v, torch.Tensor) else v "
            "for k, v in fields.items()}",
            ")",
        ]
    lines += [f"{fn}({args})", 'print("passed: the failure did not reproduce")']
    return "\n".join(lines) + "\n", saved
