"""The ``kvcanary-dispatch`` argument parser: the three subcommands, their options and help.

Parsing only: ``kvcanary_dispatch.cli.command`` runs what was parsed (``args.command`` names
the subcommand). Importing this module imports no kernel.
"""

from __future__ import annotations

import argparse
from pathlib import Path

PROG = "kvcanary-dispatch"

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
size x strategy x length mix. Each call is checked against the torch reference (on CUDA also as
a CUDA graph's replay), then timed as in the benchmark suite (kernel time and host overhead; on
CUDA also the CUDA-graph replay and the launch count). Strategies without a chunk size (auto
with chunk_size=None, capped, rows, flat, segments, the per-request-grid baseline, the torch
reference, the fixed-block launch) and the HBM floor are drawn as horizontal reference lines.

On the CPU a small grid runs through Triton's interpreter (one to two and a half minutes on two
cores): its timings say nothing about GPU performance."""

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


class _Formatter(argparse.RawDescriptionHelpFormatter):
    """Keeps the descriptions' line breaks; every option's help states its own default."""


MAX_SIZE = 1 << 40  # requests, tokens or pool columns: an int64 tensor of it is 8 TiB


def _bounded(cast: type, low: float, *, strict: bool = False, high: int | None = None):
    """An argparse type: ``cast(text)``, at least ``low`` (above it when ``strict``), at most
    ``high`` when given."""
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
        if high is not None and value > high:
            raise argparse.ArgumentTypeError(
                f"must be <= {high} (2**{high.bit_length() - 1}: no machine's memory holds "
                f"a batch that large), got {value}"
            )
        return value

    return parse


def _folder(text: str) -> Path:
    """An argparse type: a folder's path, refused when empty (``Path("")`` is ``.``, which a
    user passing an empty value did not name; ``.`` itself is taken)."""
    if not text:
        raise argparse.ArgumentTypeError("an empty path; name a folder (. for this one)")
    return Path(text)


_positive_int = _bounded(int, 1)
_non_negative_int = _bounded(int, 0)
_positive_size = _bounded(int, 1, high=MAX_SIZE)
_size = _bounded(int, 0, high=MAX_SIZE)
_positive_float = _bounded(float, 0, strict=True)


def _opt(p: argparse.ArgumentParser, flag: str, cast, metavar: str, **kw) -> None:
    """An option of type ``cast`` whose default, None, is the subcommand's own choice (its help
    says which)."""
    p.add_argument(flag, type=cast, default=None, metavar=metavar, **kw)


def _subcommand(sub, name: str, text: str, description: str, *, device: bool):
    """A subcommand's parser (with ``--device`` when it runs kernels)."""
    p = sub.add_parser(name, help=text, description=description, formatter_class=_Formatter)
    if device:
        _add_device(p)
    return p


def _add_op(p: argparse.ArgumentParser, default: str | None, text: str) -> None:
    p.add_argument("--op", choices=("scatter", "plan", "both"), default=default, help=text)


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
    from .sweep import (
        CPU_CHUNK_SIZES,
        DEFAULT_STRATEGIES,
        MAX_CHUNK,
        STRATEGIES,
        default_chunk_sizes,
    )

    parser = argparse.ArgumentParser(prog=PROG, description=_MAIN_HELP, formatter_class=_Formatter)
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    sw = _subcommand(sub, "sweep", "time strategies across chunk sizes; write csv, png, md",
                            _SWEEP_HELP, device=True)  # fmt: skip
    _opt(
        sw,
        "--out",
        _folder,
        "DIR",
        help="output folder for sweep.csv, sweep.png and sweep.md; one that already holds any of "
        "them is refused (default: ./sweep-<timestamp>)",
    )
    _add_op(
        sw,
        "scatter",
        "which call to sweep: scatter_req_token_ids, plan_offsets (decode-like batches, "
        "no length mix) or both (default: %(default)s)",
    )
    _opt(
        sw,
        "--bs",
        _positive_size,
        "N",
        nargs="+",
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
    _opt(
        sw,
        "--chunk-sizes",
        _positive_int,
        "C",
        nargs="+",
        help=f"chunk sizes for the chunked strategies; each op drops those above its largest "
        f"chunk (scatter {MAX_CHUNK['scatter']}, plan {MAX_CHUNK['plan']}) (default on a GPU: "
        f"scatter {scatter_chunks}, plan powers of two to {MAX_CHUNK['plan']}; on the CPU: "
        f"{' '.join(map(str, CPU_CHUNK_SIZES))})",
    )
    sw.add_argument(
        "--strategies",
        nargs="+",
        choices=STRATEGIES,
        default=list(DEFAULT_STRATEGIES),
        metavar="S",
        help="swept over chunk sizes: loop, sliced (scatter), scan, lookback, recount (plan); "
        "measured "
        "once per batch and drawn as reference lines: auto (chunk_size=None), capped, rows "
        "(scatter), flat, segments, "
        "per_request_grid "
        "(scatter baseline), torch_ref, fixed_block (only where bs fits the block) (default: "
        f"{' '.join(DEFAULT_STRATEGIES)})",
    )
    _opt(
        sw,
        "--max-launches",
        _positive_int,
        "N",
        help="skip points whose call makes more device operations (kernel launches and torch "
        "ops, as explain counts them) than this (loop at a small chunk size); they are listed "
        "in sweep.md (default: 1024 on a GPU, 128 on the CPU)",
    )
    _opt(
        sw,
        "--width",
        _positive_size,
        "W",
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

    fz = _subcommand(sub, "fuzz", "run the dispatcher's property checks on random inputs",
                            _FUZZ_HELP, device=True)  # fmt: skip
    _opt(
        fz,
        "--examples",
        _positive_int,
        "N",
        help="stop after N passing examples (default: 100 when --minutes is not given)",
    )
    _opt(
        fz,
        "--minutes",
        _positive_float,
        "M",
        help="stop after M minutes (checked between batches of 25 examples); with --examples, "
        "whichever comes first",
    )
    _opt(
        fz,
        "--max-bs",
        _size,
        "N",
        help="largest batch size drawn (default: the sizes' own, 4097 for ci, 131072 for gpu)",
    )
    fz.add_argument(
        "--sizes",
        choices=("ci", "gpu"),
        default=None,
        help="input sizes (kvcanary_dispatch.testing.strategies.SIZES): ci = small, every "
        "length drawn (interpreter-friendly); gpu = bs up to 131072, some cases with >= 10M tokens "
        "(default: gpu on CUDA, ci on the CPU)",
    )
    _add_op(fz, "both", "which calls to fuzz (default: %(default)s)")
    fz.add_argument(
        "--seed", type=int, default=None, help="hypothesis seed (default: random, printed)"
    )
    _opt(
        fz,
        "--save-dir",
        _folder,
        "DIR",
        help="where a counterexample too large to print is saved as a .pt file, the script "
        "naming it by its absolute path; made and test-written before fuzzing (a folder the "
        "fuzz makes is removed again if nothing is saved there) (default: .)",
    )
    fz.add_argument("--quiet", action="store_true", help="no progress line")

    ex = _subcommand(sub, "explain", "print how a call is split into slices and launches",
                            _EXPLAIN_HELP, device=False)  # fmt: skip
    ex.add_argument("--bs", type=_size, required=True, metavar="N", help="batch size (requests)")
    _opt(
        ex,
        "--tokens",
        _size,
        "T",
        help="scatter: total tokens in flat_in, spread uniformly over the requests for the "
        "token ranges and grids (default: unknown; grids that depend on it are not shown)",
    )
    _opt(
        ex,
        "--width",
        _size,
        "W",
        help="scatter: pool_out's width (max_context_len), which auto reads (default: unknown; "
        "'capped' is then planned as for the widest pool, and a batch of up to 512 requests "
        "that a call would give 'rows' is shown as 'capped or rows')",
    )
    _opt(
        ex,
        "--chunk-size",
        int,
        "C",
        help="requests per slice (default: None, the dispatcher's own choice)",
    )
    strategies = list(dict.fromkeys((*SCATTER_STRATEGIES, *PLAN_STRATEGIES)))
    ex.add_argument(
        "--strategy",
        choices=strategies,
        default="auto",
        help="scatter: auto, loop, sliced, capped, flat, segments, rows; plan: auto, loop, "
        "scan, lookback, recount; "
        "a strategy of one op "
        "explains only that op (default: %(default)s, what a plain call does)",
    )
    _add_op(ex, None, "which call to explain (default: both, or the one op that has --strategy)")
    ex.add_argument(
        "--offsets",
        choices=("device", "host"),
        help="scatter: where the CSR offsets tensor lives (host: a CPU tensor, the rest on a "
        "GPU) (default: device)",
    )
    ex.add_argument(
        "--capturing",
        action="store_true",
        help="the calls as made on a stream capturing a CUDA graph rather than eager: the "
        "plan then scans large batches and a look-back fills a fresh state, as under "
        "torch.compile; a scatter that reads offsets back ('loop' with device offsets) or "
        "uploads CPU offsets is refused",
    )
    ex.add_argument(
        "--rows",
        type=_positive_int,
        default=6,
        metavar="N",
        help="slice rows to print at most, the first and last halves (the first one more "
        "when N is odd); the rest are counted (default: "
        "%(default)s)",
    )
    return parser


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("kvcanary-dispatch")
    except Exception:  # not installed (run from a checkout)
        return "unknown"
