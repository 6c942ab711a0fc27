"""Without a GPU, Triton's interpreter runs the kernels but never compiles them, so a kernel
that only fails to compile (a tile shape the interpreter accepts, a loop-carried value whose
shape changes) would first fail on a GPU. This compiles, for an H100/H200 (sm_90) and in a
process without the interpreter, the ``capped`` scatter kernel at every shape ``auto`` can give
it and the multi-slice plan kernels at the tile and warp settings the launch plans pick, and
checks that the ``capped`` kernel refuses a search of one probe when it compiles.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import GPU

from kvcanary_dispatch.launch_plan import plan_offsets_launch_plan
from kvcanary_dispatch.scatter_shapes import capped_shape

ROOT = Path(__file__).resolve().parent.parent
# Each job: [module, kernel name, signature (non-constexpr arguments), constexprs, warps].
_COMPILE = """
import importlib, json, sys
import triton
from triton.backends import backends
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

if "nvidia" not in backends:
    sys.exit(3)  # this Triton cannot target sm_90 at all
for module, name, signature, constexprs, warps in json.loads(sys.argv[1]):
    kernel = getattr(importlib.import_module(module), name)
    src = ASTSource(fn=kernel, signature={**signature, **dict.fromkeys(constexprs, "constexpr")},
                    constexprs=constexprs)
    triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
    print("compiled", name, constexprs, warps, flush=True)
"""
_I64, _I32 = "*i64", "*i32"
_PLAN_ARGS = {  # the leading arguments of every plan kernel (kvcanary_kernels.args)
    "req_pool_indices_ptr": _I64, "prefix_lens_ptr": _I64, "extend_seq_lens_ptr": _I64,
    "req_to_token_ptr": _I32, "lut_ptr": _I64, "verify_offsets_ptr": _I64,
    "write_offsets_ptr": _I64, "seed_ptr": _I64, "verify_num_valid_ptr": _I32,
    "verify_enable_ptr": _I32, "write_num_valid_reqs_ptr": _I32, "req_to_token_stride0": "i32",
    "req_to_token_rows": "i32", "req_to_token_width": "i32", "lut_len": "i32",
}  # fmt: skip
_SCALARS = {"bs": "i32", "chunk": "i32", "swa_window_size": "i32"}


_CAPPED_ARGS = {"flat_in_ptr": _I64, "offsets_ptr": _I64, "req_pool_indices_ptr": _I64,
                "pool_out_ptr": _I32, "num_tokens": "i32", "bs": "i32", "pool_stride0": "i32",
                "max_context_len": "i32"}  # fmt: skip


def _run_compile(jobs: list) -> subprocess.CompletedProcess:
    """The jobs compiled in a process without the interpreter (skips where this Triton has
    no NVIDIA backend)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    res = subprocess.run(
        [sys.executable, "-c", _COMPILE, json.dumps(jobs)],
        capture_output=True, text=True, env=env, timeout=600,
    )  # fmt: skip
    if res.returncode == 3:
        pytest.skip("this Triton has no NVIDIA backend")
    return res


def _compile(jobs: list) -> None:
    res = _run_compile(jobs)
    assert res.returncode == 0, res.stderr[-3000:]  # any other failure is the kernels' own
    assert res.stdout.count("compiled") == len(jobs)


@pytest.mark.skipif(GPU, reason="a GPU compiles every kernel the other tests launch")
def test_capped_compiles_for_sm90_at_every_auto_shape():
    from kvcanary_kernels.scatter_capped import CAPPED_PROBES

    # Means 1..16 take the short shapes (columns 1-16), longer ones the long (columns 32-1024;
    # one request wide with the tail programs first, or on a narrow pool without).
    shapes = {json.dumps(dict(capped_shape(1000, 1000 * (1 << b), None))) for b in range(11)}
    shapes.add(json.dumps(dict(capped_shape(1000, 1000 << 10, 8192))))  # 8 steps, no tails
    jobs = []
    for shape in map(json.loads, sorted(shapes)):
        warps = shape.pop("num_warps")
        constexprs = {"PROBES": CAPPED_PROBES, **{k.upper(): v for k, v in shape.items()}}
        jobs.append(["kvcanary_kernels.scatter_capped", "_scatter_capped_kernel", _CAPPED_ARGS,
                     constexprs, warps])  # fmt: skip
    assert len(jobs) == 12
    _compile(jobs)


@pytest.mark.skipif(GPU, reason="a GPU compiles every kernel the other tests launch")
def test_rows_and_segments_compile_for_sm90():
    """``rows`` at its tile, and ``segments`` at every shape ``segments_shape`` gives, each with
    an int32 and an int64 pool width (Triton passes a width of 2**31 or more as int64)."""
    from kvcanary_dispatch.scatter_shapes import segments_shape
    from kvcanary_kernels.scatter_rows import ROWS_COLS

    shapes = {segments_shape(1000, 1000 * (1 << b)) for b in range(12)}
    jobs = []
    for width in ("i32", "i64"):
        args = {**_CAPPED_ARGS, "max_context_len": width}
        jobs.append(["kvcanary_kernels.scatter_rows", "_scatter_rows_kernel", args,
                     {"COLS": ROWS_COLS}, 4])  # fmt: skip
        for reqs, cols in sorted(shapes):
            jobs.append(["kvcanary_kernels.scatter_segments", "_scatter_segments_kernel", args,
                         {"REQS": reqs, "COLS": cols}, 4])  # fmt: skip
    assert len(shapes) == 9
    _compile(jobs)


def test_capped_refuses_a_one_probe_search():
    """A search round of one probe (at ``lo``) would never narrow, so its loop would not end:
    the kernel refuses ``PROBES = 1`` when it compiles. Compiled here, not launched, so that a
    kernel that took one probe fails this test rather than hanging it. (Runs on a GPU machine
    too: the refusal is the compiler's.)"""
    shape = {"REQS": 2, "COLS": 2, "STEPS": 2, "TILES": 2, "TAIL": 4, "TAIL_COLS": 2, "PROBES": 1,
             "GUESS": 0, "GUESS_STRIDE": 1, "PEEL": 0, "TAILS_FIRST": 0}  # fmt: skip
    job = ["kvcanary_kernels.scatter_capped", "_scatter_capped_kernel", _CAPPED_ARGS, shape, 4]
    res = _run_compile([job])
    assert res.returncode == 1 and "compiled" not in res.stdout, res.stdout
    # A compiled kernel's error names the outermost call site; the assertion's text is in its
    # chain of causes, which the traceback prints.
    assert "a search round needs at least 2 probes" in res.stderr, res.stderr[-3000:]


# (bs, chunk_size, strategy), each eager and captured: auto's two slice sizes for look-back and
# scan and its recount, explicit slices of one full tile and of several, and a batch smaller
# than its tile.
PLAN_CALLS = [
    (1 << 20, None, "auto"), (4097, None, "auto"), (1000, None, "auto"), (5000, None, "scan"),
    (5000, None, "lookback"), (5000, None, "recount"), (5000, 1024, "scan"), (5, None, "scan"),
    (5, 1, "lookback"),
]  # fmt: skip


@pytest.mark.skipif(GPU, reason="a GPU compiles every kernel the other tests launch")
def test_plan_slices_compile_for_sm90_at_the_launch_plans_settings():
    from kvcanary_kernels.plan_lookback import LOOKBACK_SUMS_BLOCK, RESET_BLOCK
    from kvcanary_kernels.plan_recount import RECOUNT_SUM_BLOCK
    from kvcanary_kernels.plan_scan import SUMS_BLOCK

    jobs, seen = [], set()
    modes = (False, True)
    plans = [plan_offsets_launch_plan(*call, capturing=c) for call in PLAN_CALLS for c in modes]
    for plan in plans:
        params = dict(plan.launches[0].params)
        tile, warps = params["bs_block"], params["num_warps"]
        if (plan.strategy, tile, warps) in seen:
            continue
        seen.add((plan.strategy, tile, warps))
        for lut in (False, True):
            if plan.strategy == "scan":
                if not lut:
                    sums = {"req_pool_indices_ptr": _I64, "prefix_lens_ptr": _I64,
                            "extend_seq_lens_ptr": _I64, "sums_ptr": _I64, **_SCALARS}  # fmt: skip
                    jobs.append(["kvcanary_kernels.plan_scan", "_plan_slice_sums_kernel", sums,
                                 {"BS_BLOCK": tile}, warps])  # fmt: skip
                sig = {**_PLAN_ARGS, "sums_ptr": _I64, **_SCALARS, "verify_capacity": "i32"}
                constexprs = {"HAS_LUT": lut, "BS_BLOCK": tile, "SUMS_BLOCK": SUMS_BLOCK}
                jobs.append(["kvcanary_kernels.plan_scan", "_plan_scan_kernel", sig, constexprs,
                             warps])  # fmt: skip
            elif plan.strategy == "recount":
                sig = {**_PLAN_ARGS, **_SCALARS, "verify_capacity": "i32"}
                constexprs = {"HAS_LUT": lut, "BS_BLOCK": tile, "SUM_BLOCK": RECOUNT_SUM_BLOCK}
                jobs.append(["kvcanary_kernels.plan_recount", "_plan_recount_kernel", sig,
                             constexprs, warps])  # fmt: skip
            else:
                sig = {**_PLAN_ARGS, "state_ptr": _I64, **_SCALARS, "verify_capacity": "i32"}
                constexprs = {"HAS_LUT": lut, "BS_BLOCK": tile, "RESET_BLOCK": RESET_BLOCK,
                              "SUMS_BLOCK": LOOKBACK_SUMS_BLOCK}  # fmt: skip
                jobs.append(["kvcanary_kernels.plan_lookback", "_plan_lookback_kernel", sig,
                             constexprs, warps])  # fmt: skip
    assert {s for s, _, _ in seen} == {"scan", "lookback", "recount"} and len(seen) >= 9
    _compile(jobs)
