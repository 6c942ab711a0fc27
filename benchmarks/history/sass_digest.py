"""A digest of every dispatch kernel's machine code for an H100/H200 (sm_90), without a GPU.

Compiles each kernel at the block settings the launch plans pick (and a few more) through
``triton.compile`` for sm_90, disassembles the cubin with the ``nvdisasm`` Triton ships, drops
comments, directives and symbol names, and prints one line per kernel and setting with a hash
of what is left. Two trees (or two Triton versions) that print the same lines run the same
instructions on the GPU, so a rewrite meant to leave the code unchanged (step 30 of
benchmarks/NOTES.md: ``for`` loops written as ``while`` loops) can be checked on the CPU:

    python -m benchmarks.history.sass_digest > a.txt    # then on the other tree: > b.txt
    diff a.txt b.txt

``--dump DIR`` also writes each disassembly there. Run it without ``TRITON_INTERPRET``.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import re
import subprocess
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kvcanary_dispatch.launch_plan import plan_offsets_launch_plan, scatter_launch_plan
from kvcanary_kernels.plan_lookback import LOOKBACK_SUMS_BLOCK, RESET_BLOCK
from kvcanary_kernels.plan_recount import RECOUNT_SUM_BLOCK
from kvcanary_kernels.plan_scan import SUMS_BLOCK
from kvcanary_kernels.scatter_capped import CAPPED_PROBES
from kvcanary_kernels.scatter_flat import FLAT_PROBES
from kvcanary_kernels.scatter_sliced import sliced_token_block

I64, I32 = "*i64", "*i32"
SCATTER = {"flat_in_ptr": I64, "offsets_ptr": I64, "req_pool_indices_ptr": I64,
           "pool_out_ptr": I32, "num_tokens": "i32", "bs": "i32", "pool_stride0": "i32",
           "max_context_len": "i32"}  # fmt: skip
PLAN = {"req_pool_indices_ptr": I64, "prefix_lens_ptr": I64, "extend_seq_lens_ptr": I64,
        "req_to_token_ptr": I32, "lut_ptr": I64, "verify_offsets_ptr": I64,
        "write_offsets_ptr": I64, "seed_ptr": I64, "verify_num_valid_ptr": I32,
        "verify_enable_ptr": I32, "write_num_valid_reqs_ptr": I32, "req_to_token_stride0": "i32",
        "lut_len": "i32"}  # fmt: skip
PLAN_SCALARS = {"bs": "i32", "chunk": "i32", "swa_window_size": "i32"}
# (bs, tokens) for the scatter plans: mean runs of 1 to 1 024 tokens, longer, a tiny batch
SCATTER_SIZES = (*((4096, 4096 << b) for b in range(11)), (1000, 10**7), (8, 5000))
# balanced settings: the launcher's defaults and tiles that stress its boundaries
BALANCED_SETTINGS = (
    dict(REQS=128, SHORT_COLS=8, CHUNKS=8, CHUNK_COLS=64),
    dict(REQS=2, SHORT_COLS=1, CHUNKS=2, CHUNK_COLS=2),
    dict(REQS=256, SHORT_COLS=4, CHUNKS=4, CHUNK_COLS=256),
)
PLAN_CALLS = ((1 << 20, None, "auto"), (4097, None, "auto"), (1000, None, "auto"),
              (5000, None, "scan"), (5000, None, "lookback"), (5000, None, "recount"),
              (5, 1, "lookback"))  # fmt: skip
BALANCED = {"num_items": "i32", "items_per_program": "i32"}


def jobs() -> list[tuple[str, str, dict, dict, int]]:
    """(module, kernel, signature, constexprs, warps), each setting once."""
    out: dict[str, tuple] = {}

    def add(module: str, kernel: str, sig: dict, constexprs: dict, warps: int = 4) -> None:
        job = (f"kvcanary_kernels.{module}", kernel, sig, constexprs, warps)
        out[repr(job)] = job

    for bs, tokens in SCATTER_SIZES:
        for width in (None, 8192, 1 << 17):
            for strategy in ("capped", "segments", "flat", "rows"):
                if strategy == "rows" and width is None:
                    continue
                (la,) = scatter_launch_plan(bs, tokens, None, strategy, "device", width).launches
                p = dict(la.params)
                warps = p.pop("num_warps", 4)
                c = {k.upper(): v for k, v in p.items()}
                if strategy == "capped":
                    c["PROBES"] = CAPPED_PROBES
                if strategy == "flat":
                    c["PROBES"] = FLAT_PROBES
                add(f"scatter_{strategy}", f"_scatter_{strategy}_kernel", SCATTER, c, warps)
    for block in (2, 8, 64, 512):
        c = {"TOKEN_BLOCK": sliced_token_block(block), "BATCH_BLOCK": block}
        add("scatter_sliced", "_scatter_sliced_kernel", {**SCATTER, "chunk": "i32"}, c)
    for setting in BALANCED_SETTINGS:
        for gather in (False, True):
            c = {**setting, "PROBES": 64, "GATHER": gather}
            add("scatter_balanced", "_scatter_balanced_kernel", {**SCATTER, **BALANCED}, c)
    for call in PLAN_CALLS:
        for capturing in (False, True):
            plan = plan_offsets_launch_plan(*call, capturing=capturing)
            p = dict(plan.launches[0].params)
            tile, warps = p.get("bs_block"), p.get("num_warps", 4)
            if plan.strategy not in ("scan", "lookback", "recount"):
                continue
            for lut in (False, True):
                sig = {**PLAN, **PLAN_SCALARS, "verify_capacity": "i32"}
                if plan.strategy == "scan":
                    sums = {k: PLAN[k] for k in list(PLAN)[:3]} | {"sums_ptr": I64}
                    add("plan_scan", "_plan_slice_sums_kernel", {**sums, **PLAN_SCALARS},
                        {"BS_BLOCK": tile}, warps)  # fmt: skip
                    sig = {**PLAN, "sums_ptr": I64, **PLAN_SCALARS, "verify_capacity": "i32"}
                    c = {"HAS_LUT": lut, "BS_BLOCK": tile, "SUMS_BLOCK": SUMS_BLOCK}
                elif plan.strategy == "recount":
                    c = {"HAS_LUT": lut, "BS_BLOCK": tile, "SUM_BLOCK": RECOUNT_SUM_BLOCK}
                else:
                    sig = {**PLAN, "state_ptr": I64, **PLAN_SCALARS, "verify_capacity": "i32"}
                    c = {"HAS_LUT": lut, "BS_BLOCK": tile, "RESET_BLOCK": RESET_BLOCK,
                         "SUMS_BLOCK": LOOKBACK_SUMS_BLOCK}  # fmt: skip
                add(f"plan_{plan.strategy}", f"_plan_{plan.strategy}_kernel", sig, c, warps)
    return list(out.values())


def sass(module: str, kernel: str, sig: dict, constexprs: dict, warps: int) -> str:
    """The kernel's sm_90 SASS, comments, directives and symbol names dropped."""
    fn = getattr(importlib.import_module(module), kernel)
    src = ASTSource(fn=fn, signature={**sig, **dict.fromkeys(constexprs, "constexpr")},
                    constexprs=constexprs)  # fmt: skip
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
    cubin = Path("/tmp") / f"sass_digest_{kernel}.cubin"
    cubin.write_bytes(compiled.asm["cubin"])
    text = subprocess.run([str(tool), "-c", str(cubin)], capture_output=True, text=True,
                          check=True).stdout  # fmt: skip
    lines = []
    for line in text.splitlines():
        line = re.sub(r"/\*[^*]*\*/", "", line).split("//")[0].strip()
        if line and not line.startswith("."):
            lines.append(line.replace(kernel, "K"))
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dump", type=Path, help="write each disassembly to this folder")
    args = ap.parse_args()
    print(f"# Triton {triton.__version__}, sm_90")
    for i, (module, kernel, sig, constexprs, warps) in enumerate(jobs()):
        code = sass(module, kernel, sig, constexprs, warps)
        digest = hashlib.sha256(code.encode()).hexdigest()[:16]
        print(f"{module.rsplit('.', 1)[1]}.{kernel} {constexprs} warps={warps} "
              f"{len(code.splitlines())} lines {digest}", flush=True)  # fmt: skip
        if args.dump:
            args.dump.mkdir(parents=True, exist_ok=True)
            (args.dump / f"{i:02d}_{kernel}.sass").write_text(code)


if __name__ == "__main__":
    main()
