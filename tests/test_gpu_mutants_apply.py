"""The GPU mutation scripts under ``tests/gpu/`` stay applicable: each mutant's ``old`` text
occurs exactly once in its file, and its ``new`` text differs. A script whose text has gone
stale stops on its own check before running anything, so its mutants would go unrun on the GPU
without this check on the CPU."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

GPU = Path(__file__).resolve().parent / "gpu"
ROOT = GPU.parents[1]


def _mutants() -> list[tuple[str, str, str, str]]:
    """(script.mutant, file, old, new) of every mutant of the three scripts."""
    sys.path.insert(0, str(GPU))
    try:
        found = []
        for script, table in (
            ("gpu_path_mutations", "MUTANTS"),
            ("guard_fill_mutations", "MUTATIONS"),
            ("large_address_mutations", "MUTATIONS"),
        ):
            module = importlib.import_module(script)
            for name, (path, old, new, *_) in getattr(module, table).items():
                found.append((f"{script}.{name}", path, old, new))
        return found
    finally:
        sys.path.remove(str(GPU))


@pytest.mark.parametrize("name,path,old,new", [pytest.param(*m, id=m[0]) for m in _mutants()])
def test_each_mutant_applies_once(name, path, old, new):
    assert (ROOT / path).read_text().count(old) == 1, f"{name}: {old!r} not once in {path}"
    assert new != old
