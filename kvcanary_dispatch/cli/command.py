"""``kvcanary-dispatch``: the chunk-size sweep, the property fuzzer and the split explainer.

``main(argv)`` returns the exit status: 0 on success, 1 when a fuzzed or swept call is wrong,
2 on a usage or run-time error (one line on stderr, ``kvcanary-dispatch: error: ...``), 130 on
Ctrl-C. Kernel modules are imported only inside the subcommands, after the device is known:
on the CPU, Triton's interpreter must be switched on before any kernel is defined.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import sys
from collections.abc import Sequence
from pathlib import Path

PROG = "kvcanary-dispatch"
_REEXEC_ENV = "KVCANARY_DISPATCH_REEXEC"

_MAIN_HELP = """\
Any-batch-size dispatch for sglang's fixed-block kv-canary Triton kernels: measure it, fuzz
it, and see how a call is split.

  sweep    time every strategy across chunk sizes, batch sizes and length mixes;
           writes sweep.csv, sweep.png and sweep.md
  fuzz     run the dispatcher's property checks (byte-identical to the torch reference,
           launches within their blocks, rejected calls write nothing) on random inputs
  explain  print how one call is split into slices and launches (no GPU needed)

Run '%(prog)s COMMAND --help' for each command's options."""

_SWEEP_HELP = """\
Sweep the chunk size (powers of two up to the register block, and the largest chunk) x batch
size x strategy x length mix. Each call is checked once against the torch reference, then timed
as in the benchmark suite (kernel time and host overhead; on CUDA also the CUDA-graph replay and
the launch count). Strategies without a chunk size (auto with chunk_size=None, flat, the
per-request-grid baseline, the torch reference, the fixed-block launch) and the HBM floor are
drawn as horizontal reference lines.

On the CPU a small grid runs through Triton's interpreter (about a minute on two cores): its
timings say nothing about GPU performance."""

_FUZZ_HELP = """\
Run the dispatcher's property checks outside pytest with hypothesis: scatter and plan calls of
random batch sizes, chunk sizes, strategies and length distributions, compared byte for byte
with the torch reference on poisoned outputs, plus calls broken on purpose that must be
rejected before any launch. On a failure the shrunk counterexample is printed as a runnable
Python script and the exit status is 1."""

_EXPLAIN_HELP = """\
Print how a call would be split: its slices with their request (and, given --tokens, token)
ranges, every launch with its grid and register block, and the host synchronisations. Pure host
arithmetic: no tensor is made and no GPU is needed."""


class CliError(Exception):
    """A run-time error reported as one line, exit status 2."""


class _Formatter(argparse.RawDescriptionHelpFormatter):
    """Keeps the descriptions' line breaks; every option's help states its own default."""


def _bounded(cast: type, low: float, *, strict: bool = False):
    """An argparse type: ``cast(text)``, at least ``low`` (above it when ``strict``)."""
    kind = "an integer" if cast is int else "a number"

    def parse(text: str):
        try:
            value = cast(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not {kind}: {text!r}") from None
        if value < low or (strict and not value > low):
            raise argparse.ArgumentTypeError(
                f"must be {'>' if strict else '>='} {low}, got {value}"
            )
        return value

    return parse


_positive_int = _bounded(int, 1)
_non_negative_int = _bounded(int, 0)
_positive_float = _bounded(float, 0, strict=True)


def _default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _add_device(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--device",
        default=None,
        metavar="DEV",
        help="cuda, cuda:N or cpu (default: cuda when a CUDA device is present, else cpu; on "
        "the CPU the kernels run in Triton's interpreter)",
    )


def build_parser() -> argparse.ArgumentParser:
    """The ``kvcanary-dispatch`` parser with its three subcommands."""
    from ..plan import PLAN_STRATEGIES
    from ..scatter import SCATTER_STRATEGIES
    from .sweep import DEFAULT_STRATEGIES, STRATEGIES, default_chunk_sizes

    parser = argparse.ArgumentParser(prog=PROG, description=_MAIN_HELP, formatter_class=_Formatter)
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    sw = sub.add_parser(
        "sweep", help="time strategies across chunk sizes; write csv, png, md",
        description=_SWEEP_HELP, formatter_class=_Formatter,
    )  # fmt: skip
    _add_device(sw)
    sw.add_argument(
        "--out",
        type=Path,
        default=None,
        metavar="DIR",
        help="output folder for sweep.csv, sweep.png and sweep.md (default: ./sweep-<timestamp>)",
    )
    sw.add_argument(
        "--op",
        choices=("scatter", "plan", "both"),
        default="scatter",
        help="which call to sweep: scatter_req_token_ids, plan_offsets (decode-like batches, "
        "no length mix) or both (default: %(default)s)",
    )
    sw.add_argument(
        "--bs",
        type=_positive_int,
        nargs="+",
        default=None,
        metavar="N",
        help="batch sizes (default: 512 4096 32768 on a GPU, 64 600 on the CPU)",
    )
    sw.add_argument(
        "--mixes",
        nargs="+",
        choices=("ones", "u128", "u1024"),
        default=None,
        help="scatter segment-length mixes: every length 1, uniform 0-128, uniform 0-1024 "
        "(default: all three on a GPU, ones u128 on the CPU)",
    )
    scatter_chunks = " ".join(map(str, default_chunk_sizes("scatter")))
    sw.add_argument(
        "--chunk-sizes",
        type=_positive_int,
        nargs="+",
        default=None,
        metavar="C",
        help=f"chunk sizes for the chunked strategies; each op drops those above its largest "
        f"chunk (scatter 511, plan 4096) (default on a GPU: scatter {scatter_chunks}, plan "
        "powers of two to 4096; on the CPU: 8 64 511)",
    )
    sw.add_argument(
        "--strategies",
        nargs="+",
        choices=STRATEGIES,
        default=list(DEFAULT_STRATEGIES),
        metavar="S",
        help="swept over chunk sizes: loop, sliced (scatter), scan, lookback (plan); measured "
        "once per batch and drawn as reference lines: auto (chunk_size=None), flat, segments, "
        "per_request_grid "
        "(scatter baseline), torch_ref, fixed_block (only where bs fits the block) (default: "
        f"{' '.join(DEFAULT_STRATEGIES)})",
    )
    sw.add_argument(
        "--max-launches",
        type=_positive_int,
        default=None,
        metavar="N",
        help="skip points whose call makes more kernel launches than this (loop at a small "
        "chunk size); they are listed in sweep.md (default: 1024 on a GPU, 128 on the CPU)",
    )
    sw.add_argument(
        "--width",
        type=_positive_int,
        default=None,
        metavar="W",
        help="scatter pool width, max_context_len (default: 8192 on a GPU, 64 on the CPU)",
    )
    sw.add_argument(
        "--metric",
        choices=("kernel", "graph", "host"),
        default="kernel",
        help="what the plot and the best-chunk tables rank by: kernel time (do_bench; for "
        "calls of a few microseconds it includes the dispatcher's host time), graph (CUDA-"
        "graph replay: device time alone; CUDA only, calls that sync are left out), or host "
        "(wall clock per call in a back-to-back loop) (default: %(default)s)",
    )
    sw.add_argument("--quiet", action="store_true", help="no progress bar")
    sw.set_defaults(func=_cmd_sweep)

    fz = sub.add_parser(
        "fuzz", help="run the dispatcher's property checks on random inputs",
        description=_FUZZ_HELP, formatter_class=_Formatter,
    )  # fmt: skip
    _add_device(fz)
    fz.add_argument(
        "--examples",
        type=_positive_int,
        default=None,
        metavar="N",
        help="stop after N passing examples (default: 100 when --minutes is not given)",
    )
    fz.add_argument(
        "--minutes",
        type=_positive_float,
        default=None,
        metavar="M",
        help="stop after M minutes (checked between batches of 25 examples); with --examples, "
        "whichever comes first",
    )
    fz.add_argument(
        "--max-bs",
        type=_non_negative_int,
        default=None,
        metavar="N",
        help="largest batch size drawn (default: the sizes' own, 3000 for ci, 131072 for gpu)",
    )
    fz.add_argument(
        "--sizes",
        choices=("ci", "gpu"),
        default=None,
        help="input sizes (kvcanary_dispatch.testing.strategies.SIZES): ci = small, every "
        "length drawn (interpreter-friendly); gpu = bs up to 131072, some cases with >= 10M tokens "
        "(default: gpu on CUDA, ci on the CPU)",
    )
    fz.add_argument(
        "--op",
        choices=("scatter", "plan", "both"),
        default="both",
        help="which calls to fuzz (default: %(default)s)",
    )
    fz.add_argument(
        "--seed", type=int, default=None, help="hypothesis seed (default: random, printed)"
    )
    fz.add_argument(
        "--save-dir",
        type=Path,
        default=None,
        metavar="DIR",
        help="where a counterexample too large to print is saved as a .pt file (default: .)",
    )
    fz.add_argument("--quiet", action="store_true", help="no progress line")
    fz.set_defaults(func=_cmd_fuzz)

    ex = sub.add_parser(
        "explain", help="print how a call is split into slices and launches",
        description=_EXPLAIN_HELP, formatter_class=_Formatter,
    )  # fmt: skip
    ex.add_argument(
        "--bs", type=_non_negative_int, required=True, metavar="N", help="batch size (requests)"
    )
    ex.add_argument(
        "--tokens",
        type=_non_negative_int,
        default=None,
        metavar="T",
        help="scatter: total tokens in flat_in, spread uniformly over the requests for the "
        "token ranges and grids (default: unknown; grids that depend on it are not shown)",
    )
    ex.add_argument(
        "--chunk-size",
        type=int,
        default=None,
        metavar="C",
        help="requests per slice (default: None, the dispatcher's own choice)",
    )
    strategies = list(dict.fromkeys((*SCATTER_STRATEGIES, *PLAN_STRATEGIES)))
    ex.add_argument(
        "--strategy",
        choices=strategies,
        default="auto",
        help="scatter: auto, loop, sliced, flat, segments; plan: auto, loop, scan, lookback; "
        "a strategy of one op "
        "explains only that op (default: %(default)s, what a plain call does)",
    )
    ex.add_argument(
        "--op",
        choices=("scatter", "plan", "both"),
        default=None,
        help="which call to explain (default: both, or the one op that has --strategy)",
    )
    ex.add_argument(
        "--offsets",
        choices=("device", "host"),
        default="device",
        help="scatter: where the CSR offsets tensor lives (host: a CPU tensor, the rest on a "
        "GPU) (default: %(default)s)",
    )
    ex.add_argument(
        "--rows",
        type=_positive_int,
        default=6,
        metavar="N",
        help="slice rows to print, the first and last N/2; the rest are counted (default: "
        "%(default)s)",
    )
    ex.set_defaults(func=_cmd_explain)
    return parser


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("kvcanary-dispatch")
    except Exception:  # not installed (run from a checkout)
        return "unknown"


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` (default ``sys.argv[1:]``), run the subcommand, return the exit status.
    Argument errors exit through argparse (status 2, usage line)."""
    args_list = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(args_list)
    args.may_reexec = argv is None  # a process of its own (console script, python -m)
    try:
        return args.func(args, args_list)
    except CliError as err:
        print(f"{PROG}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"\n{PROG}: interrupted", file=sys.stderr)
        return 130


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
    mod = sys.modules.get("kvcanary_kernels.scatter_req_token_ids")
    if mod is None:
        return False
    kernel = getattr(mod, "_scatter_req_token_ids_kernel", None)
    return kernel is not None and type(kernel).__name__ != "InterpretedFunction"


def _prepare_device(name: str | None, argv: list[str], may_reexec: bool):
    """Resolve ``--device``. For the CPU, switch Triton's interpreter on. If the kernels were
    already defined for a GPU (the package was imported before the variable was set), a
    process of its own (``may_reexec``) runs the command again in a fresh Python with the
    variable set; an in-process call gets a ``CliError``."""
    import torch

    name = name or _default_device()
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
    if device.type != "cpu":
        raise CliError(f"--device {name!r}: expected cuda, cuda:N or cpu")
    try:
        import numpy  # noqa: F401  (Triton's interpreter needs it; the runtime does not)
    except ImportError:
        raise CliError(
            "--device cpu runs Triton's interpreter, which needs numpy: "
            'pip install "kvcanary-dispatch[cli]"'
        ) from None
    os.environ["TRITON_INTERPRET"] = "1"
    if _kernels_compiled():
        if os.environ.get(_REEXEC_ENV) or not may_reexec:
            raise CliError(
                "--device cpu needs Triton's interpreter, but the kernels were already compiled "
                "for a GPU: set TRITON_INTERPRET=1 before kvcanary_kernels is imported"
            )
        os.environ[_REEXEC_ENV] = "1"
        sys.stdout.flush()
        sys.stderr.flush()
        os.execv(sys.executable, [sys.executable, "-m", "kvcanary_dispatch", *argv])
    return device


# ---------------------------------------------------------------- sweep


def _cmd_sweep(args: argparse.Namespace, argv: list[str]) -> int:
    _require_extra("sweep", "matplotlib", "cli")
    device = _prepare_device(args.device, argv, args.may_reexec)
    from .progress import Progress, fmt_duration
    from .sweep import (
        CHUNKED,
        CPU_NOTE,
        UNCHUNKED,
        SweepCheckError,
        default_config,
        enumerate_points,
        run_sweep,
        summary_table,
        write_outputs,
    )

    config = default_config(device)
    config.ops = ("scatter", "plan") if args.op == "both" else (args.op,)
    for name in ("bs", "mixes", "chunk_sizes", "max_launches", "width"):
        value = getattr(args, name)
        if value is not None:
            attr = "batch_sizes" if name == "bs" else name
            setattr(config, attr, tuple(value) if isinstance(value, list) else value)
    config.strategies = tuple(dict.fromkeys(args.strategies))
    config.metric = args.metric
    if args.metric == "graph" and device.type != "cuda":
        raise CliError("--metric graph needs CUDA (CUDA-graph replay times)")
    usable = [
        s for s in config.strategies if any(s in CHUNKED[o] + UNCHUNKED[o] for o in config.ops)
    ]
    if not usable:
        raise CliError(f"--strategies {' '.join(config.strategies)}: none applies to {args.op}")
    config.strategies = tuple(usable)
    points, skipped = enumerate_points(config)
    if not points:
        raise CliError(
            f"nothing to measure: all {len(skipped)} points were skipped "
            "(raise --max-launches or use larger --chunk-sizes)"
        )
    out = args.out or Path(f"sweep-{dt.datetime.now():%Y%m%d-%H%M%S}")
    if out.exists() and not out.is_dir():
        raise CliError(f"--out {out}: exists and is not a folder")

    print(f"{PROG} sweep on {device}: {len(points)} calls to time, {len(skipped)} skipped")
    print(
        f"  ops {' '.join(config.ops)}; bs {' '.join(map(str, config.batch_sizes))}; "
        f"mixes {' '.join(config.mixes)}; strategies {' '.join(config.strategies)}"
    )
    if device.type != "cuda":
        print(f"  {CPU_NOTE}")
    print(f"  writing to {out}/", flush=True)
    progress = Progress(None, enabled=not args.quiet)
    try:
        result = run_sweep(config, progress)
    except SweepCheckError as err:
        print(f"{PROG}: error: correctness check failed: {err}", file=sys.stderr)
        return 1
    paths = write_outputs(result, out)
    print()
    print(summary_table(result))
    if result.skipped:
        reasons = sorted({r for _, r in result.skipped})
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
    import random

    from ..testing.strategies import SIZES
    from .fuzz import repro_snippet, run_fuzz
    from .progress import Progress, fmt_duration

    sizes_name = args.sizes or ("gpu" if device.type == "cuda" else "ci")
    sizes = SIZES[sizes_name]
    if args.max_bs is not None:
        sizes = dataclasses.replace(sizes, max_bs=args.max_bs)
    examples = args.examples
    if examples is None and args.minutes is None:
        examples = 100
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
    st = outcome.stats
    kinds = ", ".join(f"{k} {n}" for k, n in sorted(st.by_kind.items())) or "none"
    print(
        f"{st.examples} examples passed in {fmt_duration(st.elapsed_s)} ({kinds}); largest bs "
        f"{st.max_bs}, largest scatter batch {st.max_tokens} tokens"
    )
    if outcome.failure is None:
        print("0 failures")
        return 0
    f = outcome.failure
    err = f"{type(f.error).__name__}: {f.error}".strip().splitlines()
    print(f"\nFAILED: {f.call!r} (hypothesis seed {f.seed})")
    for line in err[:10]:
        print(f"  {line}")
    snippet, saved = repro_snippet(f.call, args.save_dir)
    print("\nShrunk counterexample, as a runnable script:\n")
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
    blocks = []
    for op in ops:
        try:
            if op == "scatter":
                split = explain_scatter(
                    args.bs, args.tokens, args.chunk_size, args.strategy, args.offsets
                )
            else:
                split = explain_plan(args.bs, args.chunk_size, args.strategy)
        except (ValueError, TypeError) as err:
            hint = (
                f" (--op {'plan' if op == 'scatter' else 'scatter'} explains the other call alone)"
            )
            hint = hint if len(ops) > 1 else ""
            raise CliError(str(err).removeprefix("kv-canary: ") + hint) from None
        blocks.append(format_split(split, args.rows))
    print("\n\n".join(blocks))
    return 0
