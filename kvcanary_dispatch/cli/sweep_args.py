"""The sweep command's options read into a ``SweepConfig``: each option checked against the
others before anything is measured (a one-line ``CliError`` naming the option and its fix), and
the notes to print about options that apply to part of the sweep only."""

from __future__ import annotations

import argparse

import torch

from .errors import CliError
from .sweep import (
    CHUNKED,
    DEFAULT_STRATEGIES,
    MAX_CHUNK,
    UNCHUNKED,
    SweepConfig,
    default_config,
)


def sweep_config(args: argparse.Namespace, device: torch.device) -> tuple[SweepConfig, list[str]]:
    """The sweep ``args`` ask for on ``device``, and the notes to print about it."""
    config = default_config(device)
    config.ops = ("scatter", "plan") if args.op == "both" else (args.op,)
    scatter_only = [f for f, v in (("--mixes", args.mixes), ("--width", args.width)) if v]
    if scatter_only and "scatter" not in config.ops:
        one = len(scatter_only) == 1
        raise CliError(
            f"{' '.join(scatter_only)} describe{'s' if one else ''} the scatter, which --op "
            f"{args.op} does not sweep; drop {'it' if one else 'them'} or pass --op both"
        )
    for name in ("bs", "mixes", "chunk_sizes", "max_launches", "width"):
        value = getattr(args, name)
        if value is not None:
            attr = "batch_sizes" if name == "bs" else name
            # (a value given twice is measured once)
            setattr(config, attr, tuple(dict.fromkeys(value)) if isinstance(value, list) else value)
    config.strategies = tuple(dict.fromkeys(args.strategies))
    config.metric = args.metric
    if args.metric == "graph" and device.type != "cuda":
        raise CliError(
            "--metric graph needs CUDA (CUDA-graph replay times); pass --device cuda on a GPU, "
            "or --metric kernel or host"
        )
    usable = [
        s for s in config.strategies if any(s in CHUNKED[o] + UNCHUNKED[o] for o in config.ops)
    ]
    if not usable:
        owners = [  # the ops the strategies belong to
            o for o in CHUNKED if any(s in CHUNKED[o] + UNCHUNKED[o] for s in config.strategies)
        ]
        fix = f"; pass --op {' or '.join(owners)} or --op both" if owners else ""
        raise CliError(
            f"--strategies {' '.join(config.strategies)}: none applies to {args.op}{fix}"
        )
    given = args.strategies != list(DEFAULT_STRATEGIES)  # the default mixes both ops' names
    unused = [s for s in config.strategies if s not in usable] if given else []
    dropped = f"note: --strategies {' '.join(unused)}: not {args.op} strategies, not measured"
    notes = [dropped] if unused else []
    config.strategies = tuple(usable)
    # Each op drops the chunk sizes past its largest; one left with none for its chunked
    # strategies is an error, unless another op's chunked strategies keep some (then a note).
    chunked = {op: [s for s in config.strategies if s in CHUNKED[op]] for op in config.ops}
    if args.chunk_sizes is not None and not any(chunked.values()):
        takers = sorted({s for op in config.ops for s in CHUNKED[op]})
        raise CliError(
            f"--chunk-sizes {' '.join(map(str, args.chunk_sizes))}: no strategy swept takes a "
            f"chunk size ({' '.join(config.strategies)} run without one); add one of "
            f"{' '.join(takers)} to --strategies, or leave --chunk-sizes out"
        )
    starved = [op for op, names in chunked.items() if names and not config.chunks_for(op)]
    for op in starved:
        text = (
            f"--chunk-sizes {' '.join(map(str, args.chunk_sizes))}: none is a {op} chunk (1 to "
            f"{MAX_CHUNK[op]}), so {op}'s {' '.join(chunked[op])} would measure nothing"
        )
        if len(starved) == sum(1 for names in chunked.values() if names):
            raise CliError(f"{text}; give sizes up to {MAX_CHUNK[op]}, or leave those out")
        notes.append(f"note: {text}: not measured")
    return config, notes
