"""Run tests against one source mutation: ``mutate(path, old, new, pytest_args)`` replaces the
one occurrence of ``old`` in ``path`` with ``new``, runs ``python -m pytest -q
pytest_args`` in a new process (stopped after ``timeout`` seconds), prints its outcome (for a
mutation, a failure is the expected one) and restores the file, whatever happens."""

import subprocess
import sys


def mutate(path: str, old: str, new: str, pytest_args: list[str], timeout: float = 600) -> int:
    """The pytest return code with ``old`` replaced by ``new`` in ``path`` (file restored), or
    -1 where it ran past ``timeout`` (what it printed until then is printed)."""
    src = open(path).read()
    assert src.count(old) == 1, f"{old!r} is not once in {path}"
    open(path, "w").write(src.replace(old, new))
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *pytest_args]
    try:
        r = subprocess.run(command, capture_output=True, timeout=timeout)
        rc, out, err = r.returncode, r.stdout, r.stderr
    except subprocess.TimeoutExpired as e:
        rc, out, err = -1, e.stdout or b"", e.stderr or b""
    finally:
        open(path, "w").write(src)
    print(f"== {path}: {old.strip()!r} -> {new.strip()!r}: pytest rc={rc}")
    print(out.decode(errors="replace")[-6000:])
    print(err.decode(errors="replace")[-2000:])
    return rc
