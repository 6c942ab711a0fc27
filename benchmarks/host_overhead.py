"""Host time per call of ``auto`` against one bare Triton launch with the same arguments.

``python -m benchmarks.host_overhead --out DIR [--old-tree DIR]`` (a GPU). Host time is the
enqueue time: the wall clock of ``CALLS`` back-to-back calls, stopped before the closing
synchronisation, divided by ``CALLS`` (few enough calls that the launch queue never fills, so
device time does not leak in). In each of ``ROUNDS`` rounds a size's calls (``auto``, the
look-back, the bare launch) take such a loop each, in an order rotated round by round, so
that each ratio to the bare launch is taken from loops timed side by side; a call's figure
is the median of its loops, a ratio the median of its per-round ratios. The bare launches
are empty Triton kernels defined here, with the argument lists of the scatter and plan
kernels, launched as ``kernel[grid](...)``. Each tree runs in ``--rounds`` subprocesses
(with ``--old-tree``, a checkout of an earlier commit, the trees alternate, so that before
and after share the run; each child imports its own tree's ``kvcanary_dispatch`` and
``kernels/``, or the run stops); the table pools their rounds. Every subprocess runs on one CPU
(``--cpu``, default the highest this process may use), the same for both trees; even so the
bare launch moves between processes (17-28 µs on the H200 hosts), so compare ratios, not
times. ``plan lookback`` is ``plan_offsets(strategy="lookback")`` (up to
``AUTO_PLAN_RECOUNT_MAX_BS``, 4 096 requests, ``auto`` plans otherwise). ``guard step`` is
one step that fits through ``ForwardStepGuard.plan_step`` (the same GPU lengths and
``num_tokens``) and its iteration, which makes the ``auto`` call into the guard's buffers: its
ratio is to ``plan auto``. Every call is first run once on poisoned outputs and compared
with the reference (``check_calls``). Writes ``host_overhead.csv`` and ``host_overhead.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import triton
import triton.language as tl

SIZES = (8, 64, 512, 4096, 32768, 131072, 524288, 1048576)
CALLS = 50
ROUNDS = 15
RATIOS = (
    ("scatter_auto", "scatter_bare"),
    ("plan_auto", "plan_bare"),
    ("plan_lookback", "plan_bare"),
    ("guard_step", "plan_auto"),
)


# The bare launches: empty kernels with the signatures of ``_scatter_rows_kernel`` and
# ``_plan_offsets_kernel`` (the same tensors, integers unspecialised where theirs are, and as
# many constexprs), so that a bare launch pays Triton's per-launch work on the same arguments.
@triton.jit(do_not_specialize=["n", "bs", "stride", "width"])
def bare_scatter(a, b, c, d, n, bs, stride, width, COLS: tl.constexpr):
    pass


@triton.jit(do_not_specialize=["stride", "rows", "width", "lut_len", "bs", "swa", "cap"])
def bare_plan(
    a, b, c, d, lut, e, f, g, h, i, j, carry, stride, rows, width, lut_len, bs, swa, cap,
    HAS_LUT: tl.constexpr, HAS_CARRY: tl.constexpr, BS_BLOCK: tl.constexpr,
):  # fmt: skip
    pass


def scatter_keywords(bs: int, dev: torch.device) -> dict:
    """``scatter_req_token_ids``' keywords for ``bs`` runs of 4 tokens, request ``r`` into
    row ``r`` of a 64-column pool: a valid call."""
    i64 = dict(dtype=torch.int64, device=dev)
    return dict(  # in _scatter_rows_kernel's order, as bare_scatter takes them
        flat_in=torch.arange(4 * bs, **i64),
        offsets=torch.arange(0, 4 * bs + 1, 4, **i64),
        req_pool_indices=torch.arange(bs, **i64),
        pool_out=torch.zeros((bs, 64), dtype=torch.int32, device=dev),
    )


def plan_keywords(bs: int, dev: torch.device) -> dict:
    """``plan_offsets``' keywords for ``bs`` requests of 8 cached and 4 new tokens each, rows
    ``1..bs`` of a 64-column table of distinct slots, no LUT: a valid call, planned by
    ``auto`` as any engine's."""
    i64, i32 = dict(dtype=torch.int64, device=dev), dict(dtype=torch.int32, device=dev)
    return dict(
        req_pool_indices=torch.arange(1, bs + 1, **i64),
        prefix_lens=torch.full((bs,), 8, **i64),
        extend_seq_lens=torch.full((bs,), 4, **i64),
        req_to_token=torch.arange((bs + 1) * 64, **i32).view(bs + 1, 64),  # distinct seeds
        full_to_swa_index_mapping=None,
        out_verify_offsets=torch.empty(bs + 1, **i64),
        out_write_offsets=torch.empty(bs + 1, **i64),
        out_write_seed_slot_indices=torch.empty(bs, **i64),
        out_verify_num_valid=torch.empty(1, **i32),
        out_verify_enable=torch.empty(1, **i32),
        out_write_num_valid_reqs=torch.empty(1, **i32),
        swa_window_size=0,
        verify_capacity=1 << 30,
    )


def bare_plan_args(kw: dict) -> tuple:
    """``bare_plan``'s arguments for the plan keywords ``kw`` (upstream's order, no LUT), in
    ``_plan_offsets_kernel``'s order: the four inputs, the LUT (the verify offsets stand in),
    the six outputs, the carry (the verify offsets again), then the table's row stride, rows
    and width, the LUT length (0), ``bs``, the window and the capacity. Built once, so that a
    bare launch times the launch alone."""
    p = list(kw.values())
    rtt, ref, bs = p[3], p[5], p[0].shape[0]
    return (*p[:4], ref, *p[5:11], ref, rtt.stride(0), *rtt.shape, 0, bs, p[11], p[12])


def check_calls(scatter, plans: dict, guard_buffers, sc: dict, plan_kw: dict) -> None:
    """Each timed call, before it is timed, run once on poisoned outputs and compared whole
    with the reference: ``scatter(**sc)``; each of ``plans`` (name: a ``plan_offsets``-like
    call) on ``plan_kw``; the guard step, whose buffers (``guard_buffers(poison)`` poisons
    them with ``poison(*tensors)``, runs the step and returns them) must equal the reference plan
    of ``plan_kw``. An ``AssertionError`` names the call."""
    from kvcanary_dispatch.testing.engine_steps import poison_
    from kvcanary_kernels import plan_offsets_ref, scatter_req_token_ids_ref

    def same(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
        assert torch.equal(got, want), f"{what} differs from the reference"

    want = sc["pool_out"].clone()
    poison_(want, sc["pool_out"])
    scatter_req_token_ids_ref(**{**sc, "pool_out": want})
    scatter(**sc)
    same(sc["pool_out"], want, "scatter auto")
    outputs = [k for k in plan_kw if k.startswith("out_")]
    ref = {k: plan_kw[k].clone() for k in outputs}
    poison_(*ref.values())
    plan_offsets_ref(**{**plan_kw, **ref})
    for name, call in plans.items():
        poison_(*(plan_kw[k] for k in outputs))
        call(**plan_kw)
        for k in outputs:
            same(plan_kw[k], ref[k], f"plan {name} {k}")
    got = guard_buffers(poison_)
    for k in outputs:
        same(got[k], ref[k], f"guard step {k}")


def loops_us(fns, calls: int = CALLS, rounds: int = ROUNDS) -> list[list[float]]:
    """Per call in ``fns``, its ``rounds`` loop times: each round times ``calls`` back-to-back
    calls of each in turn (the order rotated by one each round), µs per call, enqueue time
    only; the current device is synchronised after each loop, not timed."""
    for fn in fns:
        fn()
    torch.cuda.synchronize()
    samples: list[list[float]] = [[] for _ in fns]
    for r in range(rounds):
        for k in (*range(r % len(fns), len(fns)), *range(r % len(fns))):
            fn = fns[k]
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            samples[k].append(1e6 * (time.perf_counter() - t0) / calls)
            torch.cuda.synchronize()
    return samples


def host_us(fn, calls: int = CALLS, rounds: int = ROUNDS) -> float:
    """The median of ``fn``'s loop times (``loops_us``), µs per call."""
    return statistics.median(loops_us([fn], calls, rounds)[0])


def _quartiles(values: list[float]) -> list[float]:
    """First quartile, median and third quartile of ``values``."""
    return statistics.quantiles(values, n=4, method="inclusive") if len(values) > 1 else values * 3


def pin(cpu: int | None = None) -> int:
    """Run every thread of this process, and those it starts later, on one CPU (``None``: the
    highest it may use); returns it."""
    cpu = max(os.sched_getaffinity(0)) if cpu is None else cpu
    for task in os.listdir("/proc/self/task"):  # threads torch and Triton already started
        os.sched_setaffinity(int(task), {cpu})
    return cpu


PACKAGES = {"kvcanary_dispatch": "kvcanary_dispatch", "kvcanary_kernels": "kernels"}


def tree_pythonpath(tree: Path, links: Path) -> str:
    """``PYTHONPATH`` for a child that imports ``tree``'s own packages: ``links`` (made here),
    where ``kvcanary_kernels`` is a link to the tree's ``kernels/``, then the tree. Without
    the link an older tree's ``kvcanary_dispatch`` would import this checkout's kernels
    through the editable install's name mapping."""
    links.mkdir(parents=True)
    (links / "kvcanary_kernels").symlink_to(tree / PACKAGES["kvcanary_kernels"])
    return os.pathsep.join((str(links), str(tree)))


def package_files() -> dict[str, str]:
    """The files this process imported each package from, links resolved."""
    import importlib

    return {name: str(Path(importlib.import_module(name).__file__).resolve()) for name in PACKAGES}


def require_own_packages(name: str, tree: Path, files: dict[str, str]) -> None:
    """Stop the run (``SystemExit``) when a child of tree ``name`` imported a package from
    outside that tree: its times would not be the tree's."""
    for package, folder in PACKAGES.items():
        own = (tree / folder / "__init__.py").resolve()
        if Path(files[package]) != own:
            raise SystemExit(
                f"{name} tree ({tree}): {package} came from {files[package]}, not {own}; pass "
                "--old-tree a whole checkout (with kernels/ and kvcanary_dispatch/)"
            )


def _measure_tree(device: str) -> dict:
    """In a subprocess whose path holds one tree: host µs per call for every size."""
    import kvcanary_dispatch as kd
    from kvcanary_dispatch.capacities import CanaryCapacities
    from kvcanary_dispatch.forward_step import ForwardStepGuard

    dev = torch.device(device)
    if dev.index is not None:  # host_us synchronises the current device
        torch.cuda.set_device(dev)

    def one_size(bs: int) -> dict:
        sc = scatter_keywords(bs, dev)
        plan_kw = plan_keywords(bs, dev)
        guard = ForwardStepGuard(CanaryCapacities(bs, 4 * bs, 1 << 30), device=dev)
        # plan_step's length keywords, spelled here: older trees have no shared name for them
        lengths = {k: plan_kw[k] for k in ("req_pool_indices", "prefix_lens", "extend_seq_lens")}
        rtt = plan_kw["req_to_token"]

        def guard_step() -> None:
            for _ in guard.plan_step(**lengths, req_to_token=rtt, num_tokens=4 * bs):
                pass

        def guard_buffers(poison) -> dict[str, torch.Tensor]:  # the step, for its check
            poison(*guard.buffers.tensors().values())
            for _, planned in guard.plan_step(**lengths, req_to_token=rtt, num_tokens=4 * bs):
                got = planned.tensors()
            return got

        scatter_grid = (triton.cdiv(4 * bs, 1024),)
        pool = sc["pool_out"]
        scatter_args = (*sc.values(), 4 * bs, bs, pool.stride(0), pool.shape[1])
        plan_args = bare_plan_args(plan_kw)
        lookback = lambda **kw: kd.plan_offsets(**kw, strategy="lookback")  # noqa: E731
        plans = {"auto": kd.plan_offsets, "lookback": lookback}  # checked; timed as called
        check_calls(kd.scatter_req_token_ids, plans, guard_buffers, sc, plan_kw)
        scatter = loops_us(
            [
                lambda: kd.scatter_req_token_ids(**sc),
                lambda: bare_scatter[scatter_grid](*scatter_args, COLS=1024),
            ]
        )
        plan = loops_us(
            [
                lambda: kd.plan_offsets(**plan_kw),
                lambda: kd.plan_offsets(**plan_kw, strategy="lookback"),
                lambda: bare_plan[(1,)](*plan_args, HAS_LUT=False, HAS_CARRY=False, BS_BLOCK=256),
                guard_step,
            ]
        )
        names = (
            *("scatter_auto", "scatter_bare"),
            *("plan_auto", "plan_lookback", "plan_bare", "guard_step"),
        )
        return dict(zip(names, (*scatter, *plan), strict=True))

    return {bs: one_size(bs) for bs in SIZES}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--old-tree", type=Path, default=None)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--rounds", type=int, default=3, help="alternations of the trees")
    ap.add_argument("--cpu", type=int, default=None, help="the CPU every measurement runs on")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if not args.child:  # a child may run with another tree's benchmarks package on its path
        from benchmarks import checked_device, require_cuda

        require_cuda(ap)
        checked_device(ap, args.device, cuda_only=True)
    cpu = pin(args.cpu)  # this process too: its children start on the same CPU
    if args.child:  # one line: its packages' files and its times
        print(json.dumps({"files": package_files(), "times": _measure_tree(args.device)}))
        return 0
    trees = {"new": Path.cwd()}
    if args.old_tree is not None:
        trees["old"] = args.old_tree.resolve()
    runs: dict[str, list[dict]] = {name: [] for name in trees}
    with tempfile.TemporaryDirectory(prefix="host-overhead-") as scratch:
        paths = {name: tree_pythonpath(tree, Path(scratch) / name) for name, tree in trees.items()}
        for _ in range(args.rounds):
            for name, tree in trees.items():
                env = dict(os.environ, PYTHONPATH=paths[name])
                cmd = [sys.executable, str(Path(__file__).resolve()), "--out", "-", "--child"]
                cmd += ["--device", args.device, "--cpu", str(cpu)]
                res = subprocess.run(cmd, env=env, cwd=tree, capture_output=True, text=True)
                if res.returncode:
                    raise SystemExit(f"{name}: {res.stderr[-2000:]}")
                child = json.loads(res.stdout.strip().splitlines()[-1])
                require_own_packages(name, tree, child["files"])
                runs[name].append(child["times"])
    args.out.mkdir(parents=True, exist_ok=True)
    # Per (tree, bs, call): every loop time of every subprocess, and per-round ratios.
    pooled = {
        (name, int(bs), key): [us for run in samples for us in run[bs][key]]
        for name, samples in runs.items()
        for bs in samples[0]
        for key in samples[0][bs]
    }
    ratios = {
        (name, int(bs), call, base): [
            x / y for run in samples for x, y in zip(run[bs][call], run[bs][base], strict=True)
        ]
        for name, samples in runs.items()
        for bs in samples[0]
        for call, base in RATIOS
    }
    csv = ["tree,bs,call,host_us,ratio_q1,ratio_median,ratio_q3"]
    for (name, bs, key), us in pooled.items():
        base = dict(RATIOS).get(key)
        r = ratios.get((name, bs, key, base), [])
        cells = ",".join(f"{q:.3f}" for q in _quartiles(r)) if r else ",,"
        csv.append(f"{name},{bs},{key},{statistics.median(us):.2f},{cells}")
    (args.out / "host_overhead.csv").write_text("\n".join(csv) + "\n")
    lines = [
        "| bs | tree | scatter auto | bare | ratio | plan auto | bare | ratio | plan lookback "
        "| ratio | guard step | / plan auto |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    def us(t: str, bs: int, key: str) -> str:
        return f"{statistics.median(pooled[(t, bs, key)]):.1f}"

    def ratio(t: str, bs: int, call: str) -> str:
        r = ratios[(t, bs, call, dict(RATIOS)[call])]
        lo, mid, hi = _quartiles(r)
        return f"{mid:.2f}x ({lo:.2f}-{hi:.2f})"

    for bs in SIZES:
        for t in trees:
            lines.append(
                f"| {bs} | {t} | {us(t, bs, 'scatter_auto')} | {us(t, bs, 'scatter_bare')} | "
                f"{ratio(t, bs, 'scatter_auto')} | {us(t, bs, 'plan_auto')} | "
                f"{us(t, bs, 'plan_bare')} | {ratio(t, bs, 'plan_auto')} | "
                f"{us(t, bs, 'plan_lookback')} | {ratio(t, bs, 'plan_lookback')} | "
                f"{us(t, bs, 'guard_step')} | {ratio(t, bs, 'guard_step')} |"
            )
    (args.out / "host_overhead.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
