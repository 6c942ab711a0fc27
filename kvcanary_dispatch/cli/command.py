"""``kvcanary-dispatch``: the chunk-size sweep, the property fuzzer and the split explainer.

``main(argv)`` returns the exit status: 0 on success, 1 when a fuzzed or swept call is wrong,
2 on a usage or run-time error (one line on stderr, ``kvcanary-dispatch: error: ...``), 130 on
Ctrl-C, 141 (silently) when the reader of stdout closes it early, as ``| head`` does. The
options are parsed by ``kvcanary_dispatch.cli.parser``; this module runs the subcommands. On
the CPU, Triton's interpreter must be on before any kernel is defined; importing
``kvcanary_dispatch.cli`` already defines them (it imports the library), so a command run as
its own process without ``TRITON_INTERPRET=1`` runs itself again in a fresh Python with it set
(``_prepare_device``), and an in-process call is refused.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import os
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from .errors import CliError, out_of_memory
from .folders import drop_made, writable_folder
from .parser import PROG, build_parser

if TYPE_CHECKING:
    import torch

    from ..testing.sizes import Sizes
    from .fuzz import FuzzOutcome

_REEXEC_ENV = "KVCANARY_DISPATCH_REEXEC"
# Each command's options that make its work smaller, for an error that says it ran out.
_SMALLER = {
    "sweep": "give smaller --bs or --width, or larger --chunk-sizes (fewer slices to plan)",
    "fuzz": "give a smaller --max-bs, or --sizes ci",
    "explain": "give a smaller --bs or --tokens, or a larger --chunk-size (fewer slices)",
}
_SIGPIPE_STATUS = 141  # 128 + SIGPIPE, what a shell reports for a tool its reader closed on


def _default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` (default ``sys.argv[1:]``), run the subcommand, return the exit status.
    Argument errors exit through argparse (status 2, usage line)."""
    args_list = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(args_list)
    args.may_reexec = argv is None  # a process of its own (console script, python -m)
    try:
        with current_cuda_device_kept():  # a command makes its --device current
            return _COMMANDS[args.command](args, args_list)
    except CliError as err:
        print(f"{PROG}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"\n{PROG}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # stdout closed early (``| head``): stop quietly, as a pipe tool does
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no error at exit
        return _SIGPIPE_STATUS
    except Exception as err:  # a plan of millions of slices, a huge batch's inputs
        if (what := out_of_memory(err)) is None:
            raise
        print(f"{PROG}: error: out of {what}: {_SMALLER[args.command]}", file=sys.stderr)
        return 2


@contextlib.contextmanager
def current_cuda_device_kept() -> Iterator[None]:
    """The CUDA device current on entry is current again on exit, whatever the body made
    current (a command makes its ``--device`` current for the timers, which use the current
    device): an in-process caller gets its own back. Device 0, CUDA's default, when CUDA was
    not initialised on entry."""
    import torch

    before = torch.cuda.current_device() if torch.cuda.is_initialized() else 0
    try:
        yield
    finally:
        if torch.cuda.is_initialized():
            # A sticky CUDA error fails this too: the body's own error is the one to report.
            with contextlib.suppress(RuntimeError):
                torch.cuda.set_device(before)


def _require_extra(command: str, module: str, extra: str) -> None:
    """A one-line error naming the extra to install when ``module`` cannot be imported."""
    try:
        __import__(module)
    except ImportError:
        raise CliError(
            f'{PROG} {command} needs {module}: pip install "kvcanary-dispatch[{extra}]"'
        ) from None


# ---------------------------------------------------------------- device set-up


def _kernels_compiled() -> bool:
    """True when a kernel module is already imported with compiled (not interpreted) kernels."""
    kernels = sys.modules.get("kvcanary_kernels")
    return kernels is not None and getattr(kernels, "INTERPRETED", True) is False


def checked_torch_device(name: str):
    """``torch.device(name)`` for a ``--device`` option: a ``CliError`` naming the fix for a
    name torch does not take, or a CUDA device torch does not see."""
    import torch

    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        raise CliError(f"--device {name!r}: expected cuda, cuda:N or cpu") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise CliError(
                f"--device {name}: no CUDA device is available (torch.cuda.is_available() is "
                "False); use --device cpu"
            )
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise CliError(f"--device {name}: only {torch.cuda.device_count()} CUDA device(s)")
    return device


def _prepare_device(name: str | None, argv: list[str], may_reexec: bool):
    """Resolve ``--device``. For the CPU, switch Triton's interpreter on. If the kernels were
    already defined for a GPU (the package was imported before the variable was set), a
    process of its own (``may_reexec``) runs the command again in a fresh Python with the
    variable set; an in-process call gets a ``CliError``."""
    import torch

    name = _default_device() if name is None else name  # '' is refused as a name
    device = checked_torch_device(name)
    if device.type == "cuda":
        if os.environ.get("TRITON_INTERPRET") == "1":
            print(
                f"{PROG}: warning: TRITON_INTERPRET=1 is set: the kernels run in Triton's "
                "interpreter, not compiled for the GPU",
                file=sys.stderr,
            )
        # The library runs on its tensors' device whatever is current; the timers (CUDA events,
        # graphs, synchronize) use the current device, so make it this one.
        if device.index is not None:
            torch.cuda.set_device(device)
        return device
    if device.type != "cpu" or device.index is not None:  # (one CPU device: no cpu:N)
        raise CliError(f"--device {name!r}: expected cuda, cuda:N or cpu")
    try:
        import numpy  # noqa: F401  (Triton's interpreter needs it; the runtime does not)
    except ImportError:
        raise CliError(
            "--device cpu runs Triton's interpreter, which needs numpy: "
            'pip install "kvcanary-dispatch[cli]"'
        ) from None
    compiled = _kernels_compiled()
    if compiled and (os.environ.get(_REEXEC_ENV) or not may_reexec):
        raise CliError(  # before the variable is set: a refused call leaves the process as it was
            "--device cpu needs Triton's interpreter, but the kernels were already compiled "
            "for a GPU: set TRITON_INTERPRET=1 before kvcanary_kernels is imported"
        )
    os.environ["TRITON_INTERPRET"] = "1"
    if compiled:
        os.environ[_REEXEC_ENV] = "1"
        sys.stdout.flush()
        sys.stderr.flush()
        # -P (Python 3.11+): the working directory is not put first on the path, so a checkout
        # there does not replace the installed copy this process runs (3.10 has no such flag)
        safe = ["-P"] if sys.version_info >= (3, 11) else []
        os.execv(sys.executable, [sys.executable, *safe, "-m", "kvcanary_dispatch", *argv])
    return device


# ---------------------------------------------------------------- sweep


def _cmd_sweep(args: argparse.Namespace, argv: list[str]) -> int:
    _require_extra("sweep", "matplotlib", "cli")
    device = _prepare_device(args.device, argv, args.may_reexec)
    from .progress import Progress, fmt_duration
    from .sweep import CPU_NOTE, SweepCheckError, enumerate_points, run_sweep
    from .sweep_args import sweep_config
    from .sweep_report import OUTPUT_NAMES, summary_table, write_outputs

    config, notes = sweep_config(args, device)
    points, skipped = enumerate_points(config)
    if not points:
        fixes = dict.fromkeys(s.fix for s in skipped)
        raise CliError(
            f"nothing to measure: all {len(skipped)} points were skipped ({'; '.join(fixes)})"
        )
    out = args.out or Path(f"sweep-{dt.datetime.now():%Y%m%d-%H%M%S}")
    made = writable_folder(out, "--out")  # before anything is measured: nothing lost
    taken = [name for name in OUTPUT_NAMES if (out / name).is_dir()]
    if taken:
        drop_made(made)
        raise CliError(f"--out {out}: {', '.join(taken)} is a folder there; pass another --out")
    earlier = [name for name in OUTPUT_NAMES if os.path.lexists(out / name)]
    if earlier:  # an earlier run's results are not replaced silently
        one = len(earlier) == 1
        raise CliError(
            f"--out {out}: {', '.join(earlier)} {'is' if one else 'are'} already there; pass "
            f"another --out, or remove {'it' if one else 'them'} first"
        )

    print(f"{PROG} sweep on {device}: {len(points)} calls to time, {len(skipped)} skipped")
    print(
        f"  ops {' '.join(config.ops)}; bs {' '.join(map(str, config.batch_sizes))}; "
        + (f"mixes {' '.join(config.mixes)}; " if "scatter" in config.ops else "")
        + f"strategies {' '.join(config.strategies)}"
    )
    if device.type != "cuda":
        print(f"  {CPU_NOTE}")
    for note in notes:
        print(f"  {note}")
    print(f"  writing to {out}/", flush=True)
    progress = Progress(None, enabled=not args.quiet)
    try:
        result = run_sweep(config, progress)
    except SweepCheckError as err:
        drop_made(made)  # nothing measured is written: the folder goes too
        print(f"{PROG}: error: correctness check failed: {err}", file=sys.stderr)
        return 1
    except Exception:  # nothing measured is written: the folder goes (memory: see main)
        drop_made(made)
        raise
    try:
        paths = write_outputs(result, out)
    except OSError as err:  # the folder changed under the run: the summary is kept
        print(summary_table(result))
        raise CliError(f"--out {out}: writing the results failed ({err}); the summary above "
                       "is what was measured") from None  # fmt: skip
    print()
    print(summary_table(result))
    if result.skipped:
        reasons = sorted({s.reason for s in result.skipped})
        more = f" and {len(reasons) - 1} other reason(s)" if len(reasons) > 1 else ""
        print(f"\nskipped {len(result.skipped)} point(s), listed in sweep.md: {reasons[0]}{more}")
    print(f"\nwrote {', '.join(str(p) for p in paths)} in {fmt_duration(progress.elapsed())}")
    if device.type != "cuda":
        print(CPU_NOTE)
    if result.interrupted:
        print(f"{PROG}: interrupted: partial results written", file=sys.stderr)
        return 130
    return 0


# ---------------------------------------------------------------- fuzz


def _cmd_fuzz(args: argparse.Namespace, argv: list[str]) -> int:
    _require_extra("fuzz", "hypothesis", "cli")
    device = _prepare_device(args.device, argv, args.may_reexec)
    import dataclasses

    from ..testing.strategies import SIZES

    sizes_name = args.sizes or ("gpu" if device.type == "cuda" else "ci")
    sizes = SIZES[sizes_name]
    if args.max_bs is not None:
        sizes = dataclasses.replace(sizes, max_bs=args.max_bs)
    examples = args.examples
    if examples is None and args.minutes is None:
        examples = 100
    made: list[Path] = []  # the folders --save-dir made, dropped again if nothing is saved
    if args.save_dir is not None:  # checked now, not after a failure was found and shrunk
        made = writable_folder(args.save_dir, "--save-dir")
    try:
        return _fuzz(args, device, sizes_name, sizes, examples)
    finally:
        drop_made(made)


def _fuzz(
    args: argparse.Namespace,
    device: torch.device,
    sizes_name: str,
    sizes: Sizes,
    examples: int | None,
) -> int:
    """The fuzz command once its options and folder are settled: run, then report."""
    import random

    from .fuzz import run_fuzz
    from .progress import Progress

    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2**31)
    ops = ("scatter", "plan") if args.op == "both" else (args.op,)
    limit = []
    if examples is not None:
        limit.append(f"{examples} examples")
    if args.minutes is not None:
        limit.append(f"{args.minutes:g} minutes")
    print(
        f"{PROG} fuzz on {device}: {' or '.join(limit)}, ops {' '.join(ops)}, sizes "
        f"{sizes_name} (max bs {sizes.max_bs}), seed {seed}",
        flush=True,
    )
    progress = Progress(examples, enabled=not args.quiet)

    def on_example(stats, shrinking: bool) -> None:
        kinds = ", ".join(f"{k} {n}" for k, n in sorted(stats.by_kind.items()))
        text = f"max bs {stats.max_bs}, max tokens {stats.max_tokens}; {kinds}"
        if shrinking:
            text = "FAILED, shrinking the counterexample...; " + text
        progress.update(stats.examples, text)

    try:
        outcome = run_fuzz(
            device=str(device),
            sizes=sizes,
            ops=ops,
            examples=examples,
            minutes=args.minutes,
            seed=seed,
            on_example=on_example,
        )
    finally:
        progress.close()
    return _report_fuzz(outcome, ops, args.save_dir)


def _report_fuzz(outcome: FuzzOutcome, ops: tuple[str, ...], save_dir: Path | None) -> int:
    """Print a fuzz run's summary and any failure with its script; the exit status."""
    from .fuzz import repro_snippet
    from .progress import fmt_duration

    st = outcome.stats
    kinds = ", ".join(f"{k} {n}" for k, n in sorted(st.by_kind.items())) or "none"
    largest = f"largest bs {st.max_bs}"
    if "scatter" in ops:
        largest += f", largest scatter batch {st.max_tokens} tokens"
    print(f"{st.examples} examples passed in {fmt_duration(st.elapsed_s)} ({kinds}); {largest}")
    if outcome.failure is None:
        if outcome.interrupted:
            print(f"{PROG}: interrupted: no failure among the examples run", file=sys.stderr)
            return 130
        print("0 failures")
        return 0
    f = outcome.failure
    err = f"{type(f.error).__name__}: {f.error}".strip().splitlines()
    print(f"\nFAILED: {f.call!r} (hypothesis seed {f.seed})")
    for line in err[:10]:
        print(f"  {line}")
    snippet, saved = repro_snippet(f.call, save_dir)
    what = "Shrunk counterexample"
    if outcome.interrupted:
        what = "Counterexample, shrinking interrupted"
    print(f"\n{what}, as a runnable script:\n")
    print(snippet)
    if saved is not None:
        print(f"(its inputs are saved in {saved})")
    print(f"{PROG}: fuzz found a failure", file=sys.stderr)
    return 1


# ---------------------------------------------------------------- explain


def _cmd_explain(args: argparse.Namespace, argv: list[str]) -> int:
    from ..plan import PLAN_STRATEGIES
    from ..scatter import SCATTER_STRATEGIES
    from .explain import explain_plan, explain_scatter, format_split

    if args.op is not None:
        ops = ("scatter", "plan") if args.op == "both" else (args.op,)
    else:
        ops = tuple(
            op
            for op, names in (("scatter", SCATTER_STRATEGIES), ("plan", PLAN_STRATEGIES))
            if args.strategy in names
        )
    for op in ops:
        names = SCATTER_STRATEGIES if op == "scatter" else PLAN_STRATEGIES
        if args.strategy not in names:
            raise CliError(
                f"--strategy {args.strategy} is not a {op} strategy ({', '.join(names)})"
            )
    _refuse_other_op_options(args, ops)
    splits, errors = {}, {}
    for op in ops:
        try:
            if op == "scatter":
                offsets = args.offsets or "device"
                splits[op] = explain_scatter(
                    args.bs, args.tokens, args.chunk_size, args.strategy, offsets, args.width,
                    args.capturing,
                )  # fmt: skip
            else:
                splits[op] = explain_plan(args.bs, args.chunk_size, args.strategy, args.capturing)
        except (ValueError, TypeError) as err:
            errors[op] = err
    if errors:  # the first refusal, and the call that was explained, if any
        err = next(iter(errors.values()))
        hint = "".join(f" (--op {op} explains the other call alone)" for op in splits)
        text = (
            str(err)
            .removeprefix("kv-canary: ")
            .replace("chunk_size=None for", "omit --chunk-size for")
            .replace("strategy='auto'", "--strategy auto")
        )
        raise CliError(text + hint) from None
    blocks = [format_split(split, args.rows) for split in splits.values()]
    print("\n\n".join(blocks))
    return 0


def _refuse_other_op_options(args: argparse.Namespace, ops: tuple[str, ...]) -> None:
    """An option that describes a call not explained is an error, not silently ignored."""
    given = {
        "scatter": [
            flag
            for flag, value in (
                ("--tokens", args.tokens),
                ("--width", args.width),
                ("--offsets", args.offsets),
            )
            if value is not None
        ],
    }
    for op, flags in given.items():
        if flags and op not in ops:
            one = len(flags) == 1
            fix = (
                f"pass --op {op} or --op both"
                if args.op is not None
                else f"pass a strategy both calls have, such as auto (--strategy "
                f"{args.strategy} is a {ops[0]} strategy only)"
            )
            raise CliError(
                f"{' '.join(flags)} describe{'s' if one else ''} the {op} call, which this "
                f"command does not explain (it explains: {' '.join(ops)}); drop "
                f"{'it' if one else 'them'} or {fix}"
            )


_COMMANDS = {"sweep": _cmd_sweep, "fuzz": _cmd_fuzz, "explain": _cmd_explain}
