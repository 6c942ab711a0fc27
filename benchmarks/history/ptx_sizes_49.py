"""Compile the three scatter kernels that step 49 changed for sm_90 on a machine without a GPU
(Triton's own ptxas), and count their PTX instructions, for a tree given as the root that
holds its ``kernels`` package:

    python benchmarks/history/ptx_sizes_49.py ROOT

Shapes: ``rows`` with 1 024-column tiles; ``segments`` 32 x 32; ``capped``'s short class (its
decode shape, guessed reads) and a long class (32 x 32 heads, 8 steps). A compile that fails
raises.
"""

from __future__ import annotations

import importlib
import re
import sys

sys.path.insert(0, sys.argv[1])

import triton  # noqa: E402
import triton.compiler as tc  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
PTRS = {"flat_in_ptr": "*i64", "offsets_ptr": "*i64", "req_pool_indices_ptr": "*i64",
        "pool_out_ptr": "*i32"}  # fmt: skip
CAPPED_SHORT = dict(REQS=128, COLS=1, STEPS=32, TILES=16, TAIL=32, TAIL_COLS=32, PROBES=32,
                    GUESS=32, GUESS_STRIDE=4, PEEL=1, TAILS_FIRST=0)  # fmt: skip
CAPPED_LONG = dict(REQS=32, COLS=32, STEPS=8, TILES=16, TAIL=256, TAIL_COLS=64, PROBES=32,
                   GUESS=0, GUESS_STRIDE=1, PEEL=0, TAILS_FIRST=0)  # fmt: skip


def ptx_instructions(fn, consts: dict[str, int], width_type: str = "i32") -> int:
    sig = dict(PTRS, num_tokens="i64", bs="i32", pool_stride0="i64", max_context_len=width_type)
    sig.update({k: "constexpr" for k in consts})
    keys = {(fn.arg_names.index(k),): v for k, v in consts.items()}
    ptx = triton.compile(tc.ASTSource(fn=fn, signature=sig, constexprs=keys), target=TARGET)
    lines = ptx.asm["ptx"].splitlines()
    return sum(1 for x in lines if re.match(r"\s+[a-z]", x) and not x.strip().startswith("."))


def main() -> None:
    rows = importlib.import_module("kernels.scatter_rows")._scatter_rows_kernel
    segments = importlib.import_module("kernels.scatter_segments")._scatter_segments_kernel
    capped = importlib.import_module("kernels.scatter_capped")._scatter_capped_kernel
    counts = {
        "rows": ptx_instructions(rows, {"COLS": 1024}),
        "segments": ptx_instructions(segments, {"REQS": 32, "COLS": 32}),
        "segments_int64_width": ptx_instructions(segments, {"REQS": 32, "COLS": 32}, "i64"),
        "capped_short": ptx_instructions(capped, CAPPED_SHORT),
        "capped_long": ptx_instructions(capped, CAPPED_LONG),
    }
    print(f"triton {triton.__version__}, sm_90, {sys.argv[1]}: " +
          ", ".join(f"{k} {v}" for k, v in counts.items()))  # fmt: skip


if __name__ == "__main__":
    main()
