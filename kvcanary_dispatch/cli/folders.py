"""The folders the command line writes to (a sweep's ``--out``, a fuzz's ``--save-dir``):
made and test-written before any work, and the folders made removed again when nothing is
written there."""

from __future__ import annotations

import tempfile
from pathlib import Path

from .errors import CliError


def writable_folder(path: Path, flag: str) -> list[Path]:
    """Make ``path`` and write a file there once, before any work is done; a one-line
    ``CliError`` naming ``flag`` when it is under a file or takes no file, with what was made
    removed again. Returns the folders made here, outermost first (none: ``path`` existed),
    as the folders they are on disk (``..`` and links resolved), for ``drop_made``."""
    real = path.resolve()  # "a/../b" is "b": only folders that did not exist are made
    chain = (real, *real.parents)
    first = next(k for k, p in enumerate(chain) if p.exists())  # the nearest that exists
    if not chain[first].is_dir():
        raise CliError(f"{flag} {path}: {chain[first]} is not a folder")
    made: list[Path] = []
    try:
        for p in reversed(chain[:first]):
            p.mkdir()
            made.append(p)
        tempfile.TemporaryFile(dir=real).close()
    except OSError as err:
        drop_made(made)
        raise CliError(
            f"{flag} {path}: cannot write there ({err.strerror or err}); pass a folder you can "
            "write to"
        ) from None
    return made


def drop_made(made: list[Path]) -> None:
    """Remove the folders ``writable_folder`` made, innermost first, each while it is empty."""
    for p in reversed(made):
        if not p.is_dir() or any(p.iterdir()):
            return
        p.rmdir()
