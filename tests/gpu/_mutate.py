"""Run tests against source mutations, each in its own copy of the working tree.

``make_copy`` copies the tree's files (tracked, and untracked but not ignored) into a temporary
folder, links ``kvcanary_kernels`` to its ``kernels/`` and applies a mutation (the one
occurrence of an ``old`` text in a file replaced by ``new``); ``run_pytest`` runs pytest there
with the copy first on ``PYTHONPATH``, so the copy's packages are imported, not those of an
installed checkout, and the working tree is never edited. ``mutate`` does both for one mutation,
prints the outcome (for a mutation, a failure is the expected one) and removes the copy.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def tree_files() -> list[str]:
    """The working tree's files: tracked, and untracked but not ignored."""
    out = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", "-z"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.decode()
    return [f for f in out.split("\0") if f]


def make_copy(files: list[str], mutant: tuple[str, str, str] | None = None) -> Path:
    """A temporary copy of ``files``, with ``kvcanary_kernels`` a link to its ``kernels/`` and
    ``mutant`` (file, old, new) applied."""
    dest = Path(tempfile.mkdtemp(prefix="kvc_mutant_"))
    for f in files:
        if (ROOT / f).is_file():  # (a tracked file deleted in the working tree is skipped)
            (dest / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / f, dest / f)
    if not (dest / "kvcanary_kernels").exists():
        (dest / "kvcanary_kernels").symlink_to("kernels", target_is_directory=True)
    if mutant is not None:
        path, old, new = mutant
        src = (dest / path).read_text()
        assert src.count(old) == 1, f"{old!r} is not once in {path}"
        (dest / path).write_text(src.replace(old, new))
    return dest


def run_pytest(copy: Path, args: list[str], timeout: float) -> tuple[int | None, str]:
    """pytest's return code (``None`` past ``timeout``) and output, ``python -m pytest -q -p
    no:cacheprovider -x args`` run in ``copy`` with ``copy`` first on ``PYTHONPATH``."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(copy), env.get("PYTHONPATH")]))
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x", *args]
    try:
        r = subprocess.run(
            command, cwd=copy, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            timeout=timeout,
        )  # fmt: skip
        return r.returncode, r.stdout.decode(errors="replace")
    except subprocess.TimeoutExpired as e:
        return None, (e.stdout or b"").decode(errors="replace")


def mutate(path: str, old: str, new: str, pytest_args: list[str], timeout: float = 600) -> int:
    """The pytest return code with ``old`` replaced by ``new`` in ``path`` (in a copy of the
    tree), or -1 where it ran past ``timeout`` (what it printed until then is printed)."""
    copy = make_copy(tree_files(), (path, old, new))
    try:
        rc, out = run_pytest(copy, pytest_args, timeout)
    finally:
        shutil.rmtree(copy, ignore_errors=True)
    print(f"== {path}: {old.strip()!r} -> {new.strip()!r}: pytest rc={rc}")
    print(out[-8000:])
    return -1 if rc is None else rc
