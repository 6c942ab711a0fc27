"""What the benchmark results record about the tree that produced them."""

from __future__ import annotations

import subprocess

from kvcanary_dispatch.cli.results import _git_commit


def test_results_name_a_dirty_tree(tmp_path, monkeypatch):
    """Results name the commit they ran on, and say so when tracked files differ from it."""
    monkeypatch.delenv("KVCANARY_COMMIT", raising=False)
    monkeypatch.chdir(tmp_path)
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false"]
    subprocess.run([*git, "init", "-q"], check=True)
    (tmp_path / "f").write_text("a")
    subprocess.run([*git, "add", "f"], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "x"], check=True)
    subprocess.run([*git, "tag", "v1"], check=True)  # a tag must not replace the hash
    head = subprocess.run([*git, "rev-parse", "--short=7", "HEAD"], capture_output=True,
                          text=True, check=True).stdout.strip()  # fmt: skip
    assert _git_commit(tmp_path) == head
    (tmp_path / "f").write_text("b")
    assert _git_commit(tmp_path) == f"{head}+dirty"
    # Run from inside another repository, results name this package's checkout, not it.
    assert not _git_commit().startswith(head)
    assert _git_commit(tmp_path / "no-repo") == "unknown"
    monkeypatch.setenv("KVCANARY_COMMIT", "named")
    assert _git_commit() == "named" == _git_commit(tmp_path)
