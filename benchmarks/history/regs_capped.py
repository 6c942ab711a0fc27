"""Step 20 of benchmarks/NOTES.md: registers a thread of the ``capped`` kernel, compiled for
sm_90 without a GPU (Triton's bundled ``ptxas`` and ``cuobjdump -res-usage``), whole and with
only its head or only its tail path, at ``auto``'s shapes.

``python -m benchmarks.history.regs_capped [--tail-cols-div N] [--sass]`` (no
``TRITON_INTERPRET``; ``N``: tail copy steps ``N`` times narrower than ``auto``'s; ``--sass``:
also the whole kernel's and the tail path's SASS instructions, ``IMAD``s and an md5 of the
instruction text, from ``cuobjdump -sass``, step 23). The
counts come from the local Triton (3.9 here); the H200's Triton 3.6 gave 53 for U(0,128)'s
whole kernel, against 64 here, so compare within one Triton only.
"""

from __future__ import annotations

import argparse
import hashlib
import subprocess
from pathlib import Path

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kvcanary_dispatch.launch_plan import capped_shape
from kvcanary_kernels.scatter_capped import CAPPED_PROBES, _head, _scatter_capped_kernel, _tail

CUOBJDUMP = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
SIGNATURE = {"flat_in_ptr": "*i64", "offsets_ptr": "*i64", "req_pool_indices_ptr": "*i64",
             "pool_out_ptr": "*i32", "num_tokens": "i32", "bs": "i32", "pool_stride0": "i32",
             "max_context_len": "i32"}  # fmt: skip
# (label, bs, tokens, pool width): the distribution benchmark's batches
BATCHES = [("U(0,128)", 32768, 2104578, 8192), ("drafts", 16384, 98269, 8192),
           ("decodes + prefills", 8192, 27213, 8192), ("32 768 decodes", 32768, 32768, 8192),
           ("giant", 4096, 2155709, 65536), ("lognormal 2", 16384, 7619348, 65536)]  # fmt: skip


@triton.jit
def _heads_only(flat_in_ptr, offsets_ptr, req_pool_indices_ptr, pool_out_ptr, num_tokens, bs,
                pool_stride0, max_context_len, REQS: tl.constexpr, COLS: tl.constexpr,
                STEPS: tl.constexpr, TILES: tl.constexpr, TAIL: tl.constexpr,
                TAIL_COLS: tl.constexpr, PROBES: tl.constexpr, GUESS: tl.constexpr,
                GUESS_STRIDE: tl.constexpr, PEEL: tl.constexpr,
                TAILS_FIRST: tl.constexpr):  # fmt: skip
    _head(tl.program_id(0).to(tl.int64), flat_in_ptr, offsets_ptr, req_pool_indices_ptr,
          pool_out_ptr, num_tokens, bs, pool_stride0, max_context_len, REQS, COLS, STEPS * COLS,
          PEEL)  # fmt: skip


@triton.jit
def _tails_only(flat_in_ptr, offsets_ptr, req_pool_indices_ptr, pool_out_ptr, num_tokens, bs,
                pool_stride0, max_context_len, REQS: tl.constexpr, COLS: tl.constexpr,
                STEPS: tl.constexpr, TILES: tl.constexpr, TAIL: tl.constexpr,
                TAIL_COLS: tl.constexpr, PROBES: tl.constexpr, GUESS: tl.constexpr,
                GUESS_STRIDE: tl.constexpr, PEEL: tl.constexpr,
                TAILS_FIRST: tl.constexpr):  # fmt: skip
    _tail(tl.program_id(0).to(tl.int64), flat_in_ptr, offsets_ptr, req_pool_indices_ptr,
          pool_out_ptr, num_tokens, bs, pool_stride0, max_context_len, STEPS * COLS, TILES, TAIL,
          TAIL_COLS, PROBES, GUESS, GUESS_STRIDE, PEEL)  # fmt: skip


def registers(kernel, constexprs: dict, warps: int, cubin: Path) -> str:
    """The ``REG:n`` field of ``cuobjdump -res-usage`` for ``kernel`` compiled for sm_90."""
    sig = {**SIGNATURE, **dict.fromkeys(constexprs, "constexpr")}
    src = ASTSource(fn=kernel, signature=sig, constexprs=constexprs)
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
    cubin.write_bytes(compiled.asm["cubin"])
    out = subprocess.run([CUOBJDUMP, "-res-usage", cubin], capture_output=True, text=True).stdout
    return next(w for line in out.splitlines() for w in line.split() if w.startswith("REG:"))


def sass_counts(cubin: Path) -> str:
    """Instructions and ``IMAD``s of the kernel last written to ``cubin``, and the md5 of its
    instruction text (equal md5s: the same machine code)."""
    out = subprocess.run([CUOBJDUMP, "-sass", cubin], capture_output=True, text=True).stdout
    text = [line.split("*/", 1)[1].split() for line in out.splitlines()
            if line.strip().startswith("/*") and "*/" in line]  # fmt: skip
    words = [w for w in text if w and not w[0].startswith("/*")]  # [guard] opcode operands
    ops = [w[1] if w[0].startswith("@") else w[0] for w in words]
    md5 = hashlib.md5(repr(words).encode()).hexdigest()[:12]
    return f"{len(ops)} instructions, {sum(op.startswith('IMAD') for op in ops)} IMAD, md5 {md5}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tail-cols-div", type=int, default=1)
    ap.add_argument("--sass", action="store_true")
    args = ap.parse_args()
    div = args.tail_cols_div
    cubin = Path("/tmp/regs_capped.cubin")
    for label, bs, tokens, width in BATCHES:
        shape = dict(capped_shape(bs, tokens, width))
        warps = shape.pop("num_warps")
        shape["tail_cols"] = max(1, shape["tail_cols"] // div)
        constexprs = {"PROBES": CAPPED_PROBES, **{k.upper(): v for k, v in shape.items()}}
        counts = [registers(k, constexprs, warps, cubin)
                  for k in (_heads_only, _tails_only, _scatter_capped_kernel)]  # fmt: skip
        counts = [counts[2], counts[0], counts[1]]  # whole, heads, tails
        print(f"{label:20s} whole {counts[0]:7s} heads {counts[1]:7s} tails {counts[2]:7s} {shape}")
        if args.sass:  # the cubin holds the whole kernel, compiled last
            print(f"{'':20s} whole kernel: {sass_counts(cubin)}")
            registers(_tails_only, constexprs, warps, cubin)
            print(f"{'':20s} tail path: {sass_counts(cubin)}")


if __name__ == "__main__":
    main()
