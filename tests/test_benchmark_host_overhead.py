"""The host-time benchmark's baselines and checks: its bare launches are empty kernels with
the signatures of the kernels they stand for (same arguments in the same order, integers
unspecialised where theirs are, as many constexprs), and every call it times is first
compared with the reference, so a call that writes nothing, or a wrong value, is refused
before it is timed."""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import pytest
import torch
from conftest import DEVICE

import kvcanary_dispatch as kd
from benchmarks import host_overhead as ho
from kvcanary_dispatch.capacities import CanaryCapacities
from kvcanary_dispatch.forward_step import ForwardStepGuard
from kvcanary_kernels.plan_offsets import _plan_offsets_kernel
from kvcanary_kernels.scatter_rows import _scatter_rows_kernel


def _params(kernel) -> list[tuple[str, bool, bool]]:
    """Per parameter: (name, constexpr, unspecialised), from a compiled kernel or the
    interpreter's."""
    if hasattr(kernel, "params"):  # a JITFunction
        return [(p.name, p.is_constexpr, bool(p.do_not_specialize)) for p in kernel.params]
    free = set(kernel.kwargs["do_not_specialize"] or ())
    signature = inspect.signature(kernel.fn).parameters.items()
    return [(n, "constexpr" in str(p.annotation), n in free) for n, p in signature]


def _shape(kernel) -> list[tuple[bool, bool]]:
    return [(constexpr, free) for _, constexpr, free in _params(kernel)]


@pytest.mark.parametrize(
    "bare, real", [(ho.bare_scatter, _scatter_rows_kernel), (ho.bare_plan, _plan_offsets_kernel)]
)
def test_a_bare_kernel_has_its_kernels_signature(bare, real):
    assert _shape(bare) == _shape(real)


def test_bare_plan_args_are_in_the_plan_kernels_order():
    kw = ho.plan_keywords(5, torch.device("cpu"))
    args = ho.bare_plan_args(kw)
    names = [name for name, constexpr, _ in _params(_plan_offsets_kernel) if not constexpr]
    assert len(args) == len(names)
    for a, name in zip(args, names, strict=True):
        assert isinstance(a, torch.Tensor) == name.endswith("_ptr"), name
    named = dict(zip(names, args, strict=True))
    for name in ("req_pool_indices", "prefix_lens", "extend_seq_lens", "req_to_token"):
        assert named[f"{name}_ptr"] is kw[name]
    assert named["verify_offsets_ptr"] is kw["out_verify_offsets"]
    assert named["seed_ptr"] is kw["out_write_seed_slot_indices"]
    assert named["write_num_valid_reqs_ptr"] is kw["out_write_num_valid_reqs"]
    assert (named["req_to_token_stride0"], named["lut_len"], named["bs"]) == (64, 0, 5)
    assert (named["req_to_token_rows"], named["req_to_token_width"]) == (6, 64)
    assert (named["swa_window_size"], named["verify_capacity"]) == (0, 1 << 30)


def test_scatter_keywords_are_in_the_scatter_kernels_order():
    sc = ho.scatter_keywords(3, torch.device("cpu"))
    pointers = [name for name, _, _ in _params(_scatter_rows_kernel) if name.endswith("_ptr")]
    assert [f"{name}_ptr" for name in sc] == pointers
    assert sc["offsets"].tolist() == [0, 4, 8, 12] and sc["flat_in"].numel() == 12


def _inputs(bs: int = 6):
    sc = ho.scatter_keywords(bs, torch.device(DEVICE))
    plan_kw = ho.plan_keywords(bs, torch.device(DEVICE))
    guard = ForwardStepGuard(CanaryCapacities(bs, 4 * bs, 1 << 30), device=DEVICE)
    lengths = {k: plan_kw[k] for k in ("req_pool_indices", "prefix_lens", "extend_seq_lens")}

    def guard_buffers(poison, write=True):
        poison(*guard.buffers.tensors().values())
        if not write:  # a step that plans nothing
            return guard.buffers.tensors()
        steps = guard.plan_step(**lengths, req_to_token=plan_kw["req_to_token"])
        return [planned.tensors() for _, planned in steps][-1]

    return sc, plan_kw, guard_buffers


def _skip_last(call, name):
    """``call``, then its output ``name``'s last element poisoned back (an unwritten one)."""

    def wrong(**kw):
        call(**kw)
        kw[name].view(-1)[-1] = -1

    return wrong


def _zero_seeds(call):
    """``call``, but its seeds all 0 (a plan that does not read the table)."""

    def wrong(**kw):
        call(**kw)
        kw["out_write_seed_slot_indices"].zero_()

    return wrong


@pytest.mark.parametrize(
    "flaw", [None, "scatter", "plan auto", "plan seeds", "guard", "guard writes nothing"]
)
def test_check_calls_refuses_a_wrong_call(flaw):
    sc, plan_kw, guard_buffers = _inputs()
    scatter = _skip_last(kd.scatter_req_token_ids, "pool_out") if flaw == "scatter" else \
        kd.scatter_req_token_ids  # fmt: skip
    plan = {"plan auto": _skip_last(kd.plan_offsets, "out_write_offsets"),
            "plan seeds": _zero_seeds(kd.plan_offsets)}.get(flaw, kd.plan_offsets)  # fmt: skip
    guard = guard_buffers
    if flaw == "guard":
        seven = torch.tensor([7], device=DEVICE)
        guard = lambda p: {**guard_buffers(p), "out_verify_enable": seven}  # noqa: E731
    if flaw == "guard writes nothing":
        guard = lambda p: guard_buffers(p, write=False)  # noqa: E731
    if flaw is None:
        ho.check_calls(scatter, {"auto": plan}, guard, sc, plan_kw)
    else:
        named = {"plan seeds": "plan auto", "guard writes nothing": "guard"}.get(flaw, flaw)
        with pytest.raises(AssertionError, match=f"^{named}"):
            ho.check_calls(scatter, {"auto": plan}, guard, sc, plan_kw)


_SHOW_FILES = (
    "import json; from benchmarks.host_overhead import package_files as f; print(json.dumps(f()))"
)


@pytest.mark.parametrize("path", ["own", "the tree alone"])
def test_each_tree_is_timed_with_its_own_packages(tmp_path, monkeypatch, path):
    # main() with --old-tree, each child's measurement stubbed but its imports real (a Python
    # started with the environment main gives the child, this checkout's benchmarks package
    # last on its path): the old tree's children import its kvcanary_dispatch and kernels.
    # With the old tree alone on the path, kvcanary_kernels (the kernels/ folder, renamed by
    # the install) comes from this checkout, and the run stops instead of timing a mix.
    import os
    import shutil
    import subprocess
    import sys

    from test_cli import REPO

    import benchmarks

    tree = tmp_path / "tree"
    for folder in ho.PACKAGES.values():
        shutil.copytree(REPO / folder, tree / folder, ignore=shutil.ignore_patterns("__pycache__"))
    real_run, children = subprocess.run, []
    calls = ("scatter_auto", "scatter_bare", "plan_auto", "plan_lookback", "plan_bare")
    times = {str(bs): {c: [1.0, 2.0] for c in (*calls, "guard_step")} for bs in ho.SIZES}

    def child(cmd, env, cwd, **_):
        children.append(Path(cwd))
        python_path = os.pathsep.join((env["PYTHONPATH"], str(REPO)))
        shown = real_run(
            [sys.executable, "-c", _SHOW_FILES], env={**env, "PYTHONPATH": python_path},
            cwd=cwd, capture_output=True, text=True,
        )  # fmt: skip
        assert shown.returncode == 0, shown.stderr
        files = json.loads(shown.stdout.splitlines()[-1])
        out = json.dumps({"files": files, "times": times})
        return subprocess.CompletedProcess(cmd, 0, out + "\n", "")

    monkeypatch.setattr(ho.subprocess, "run", child)
    monkeypatch.setattr(benchmarks, "require_cuda", lambda parser: None)
    monkeypatch.setattr(benchmarks, "checked_device", lambda parser, name, cuda_only: None)
    monkeypatch.setattr(ho, "pin", lambda cpu=None: 0)
    if path == "the tree alone":
        monkeypatch.setattr(ho, "tree_pythonpath", lambda tree, links: str(tree))
    monkeypatch.chdir(REPO)
    out = tmp_path / "out"
    argv = ["--out", str(out), "--old-tree", str(tree), "--rounds", "1"]
    if path == "own":
        assert ho.main(argv) == 0
        assert children == [REPO, tree.resolve()]
        assert "| 8 | old |" in (out / "host_overhead.md").read_text()
    else:
        with pytest.raises(SystemExit, match=r"^old tree .*: kvcanary_kernels came from "):
            ho.main(argv)
        assert not out.exists()
