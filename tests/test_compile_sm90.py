"""Without a GPU, Triton's interpreter runs the kernels but never compiles them, so a kernel
that only fails to compile (a tile shape the interpreter accepts, a loop-carried value whose
shape changes) would first fail on a GPU. This compiles the ``capped`` scatter kernel for an
H100/H200 (sm_90) at every shape ``auto`` can give it, in a process without the interpreter.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import GPU

from kvcanary_dispatch.launch_plan import capped_shape

ROOT = Path(__file__).resolve().parent.parent
_COMPILE = """
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kvcanary_kernels.scatter_capped import CAPPED_PROBES
from kvcanary_kernels.scatter_capped import _scatter_capped_kernel as kernel

signature = {"flat_in_ptr": "*i64", "offsets_ptr": "*i64", "req_pool_indices_ptr": "*i64",
             "pool_out_ptr": "*i32", "num_tokens": "i32", "bs": "i32", "pool_stride0": "i32",
             "max_context_len": "i32"}
for shape in json.loads(sys.argv[1]):
    warps = shape.pop("num_warps")
    constexprs = {"PROBES": CAPPED_PROBES, **{k.upper(): v for k, v in shape.items()}}
    src = ASTSource(fn=kernel, signature={**signature, **dict.fromkeys(constexprs, "constexpr")},
                    constexprs=constexprs)
    triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
    print("compiled", constexprs, warps, flush=True)
"""


@pytest.mark.skipif(GPU, reason="a GPU compiles every kernel the other tests launch")
def test_capped_compiles_for_sm90_at_every_auto_shape():
    # Means 1..16 take the short shapes (columns 1-16), longer ones the long (columns 32-1024).
    shapes = {json.dumps(dict(capped_shape(1000, 1000 * (1 << b)))) for b in range(11)}
    shapes = [json.loads(s) for s in sorted(shapes)]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    res = subprocess.run(
        [sys.executable, "-c", _COMPILE, json.dumps(shapes)],
        capture_output=True, text=True, env=env, timeout=600,
    )  # fmt: skip
    if res.returncode != 0 and "CompilationError" not in res.stderr:
        pytest.skip(f"no sm_90 toolchain in this Triton: {res.stderr.strip()[-300:]}")
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.count("compiled") == len(shapes) == 11
