"""sglang 0.5.23's own CUDA kv-canary kernels, patched by kvcanary-dispatch, on a GPU.

Builds sglang's CUDA-JIT kernels (plan entries, write, verify; apache-tvm-ffi), then checks,
failing loudly (exit 1) on any mismatch and writing ``OUT/sglang_cuda.log`` and
``OUT/sglang_cuda.json`` (``--out OUT``, default ``tests/gpu/results/``):

1. sglang unpatched on the GPU: its plan equals its torch reference within its cap, and raises
   above it (the environment is right);
2. within the caps, patched == unpatched byte for byte (poisoned plans, scatter pools), also
   for arguments sglang reads loosely (a window below zero, a float ``verify_capacity``) and
   for a verify plan of ``2**31 + 1`` entries (64 GiB; skipped on the CPU and where less GPU
   memory is free);
3. beyond the caps (up to ``--max-bs``, 131 072): the patched plan (with sglang's CUDA entries
   kernel) and scatter equal sglang's torch references; sglang's own test helpers (differential,
   invariants, fuzz driver) pass against the patched plan;
4. the whole canary (patched plan, sglang's CUDA verify and write) over several steps at bs up
   to ``--max-bs``, in lockstep with sglang's torch references: clean steps report nothing,
   a flipped KV byte and a wrong expected token are reported at their slot and position;
5. CUDA graphs of the patched plan at 8 192 and 131 073 requests replay correctly on new
   inputs (each call's scratch is allocated inside the capture), and two plan calls on two
   streams at once each give their own reference plan.

Run on the GPU machine from the repo root (no network; wheels in .whl/, fetched elsewhere with
``pip download --no-deps`` for that machine's Python: sglang 0.5.23, apache-tvm-ffi, and
msgspec and ninja, which sglang's CUDA-JIT build imports). sglang 0.5.23's wheel is tagged for
CPython 3.11 (cp311) and pip refuses it on another Python; the modules used here are pure
Python, so it is unpacked:

    python3 -c "import glob, zipfile; zipfile.ZipFile(glob.glob('.whl/sglang-*.whl')[0])\
.extractall('/tmp/site')" && python3 -m pip install -q --no-index --no-deps --no-compile \
        --target /tmp/site $(ls .whl/*.whl | grep -v sglang-) && \
    export PYTHONPATH=/tmp/site:$PYTHONPATH && \
    python3 -m pip install --no-deps --no-build-isolation -e . && \
    python3 tests/gpu/sglang_cuda.py --out $OUT

(``python3 -m pip``, not ``pip``: a bare ``pip`` may belong to another interpreter than the
``python3`` that has torch, and install the package where that one never looks.)
``bash tests/gpu/owed.sh OUT sglang_cuda`` does the same with the other wheels installed
rather than put under ``--target`` (so that ninja's program is on ``PATH``), and logs the
GPU, versions and the tree's md5 list beside it.

``--device cpu --quick`` runs the same checks small on the CPU (Triton's interpreter, sglang's
torch references and a stand-in for its CUDA entries kernel): the smoke test CI runs.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "sglang")]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--out",
        type=Path,
        default=HERE / "results",
        help="folder for the log and the json (default: tests/gpu/results, the evidence folder)",
    )
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--max-bs", type=int, default=131_072, help="largest batch (default 131072)")
    p.add_argument("--quick", action="store_true", help="small sizes (the CPU smoke test)")
    return p.parse_args()


class Report:
    """Runs named checks, logs each (to stdout and OUT/sglang_cuda.log), keeps failures; a
    check that raises ``skipped`` (with why) is reported as skipped."""

    def __init__(self, out: Path, skipped: type[Exception]) -> None:
        out.mkdir(parents=True, exist_ok=True)
        self.out, self.results, self.skipped = out, [], skipped
        self.log = open(out / "sglang_cuda.log", "w")

    def line(self, text: str) -> None:
        print(text, flush=True)
        self.log.write(text + "\n")
        self.log.flush()

    def check(self, name: str, fn, *args) -> None:
        start = time.perf_counter()
        try:
            detail = fn(*args) or ""
            status = "pass"
        except self.skipped as why:  # cannot run here: said so, not counted as passed
            detail, status = str(why), "skip"
        except Exception:  # every failure is reported, then the run goes on
            detail, status = traceback.format_exc(), "FAIL"
        secs = time.perf_counter() - start
        self.results.append(dict(check=name, status=status, seconds=round(secs, 2), detail=detail))
        self.line(f"[{status}] {name} ({secs:.1f} s) {detail if status != 'FAIL' else ''}")
        if status == "FAIL":
            self.line(detail)

    def finish(self, env: dict) -> int:
        failed = [r["check"] for r in self.results if r["status"] == "FAIL"]
        skipped = [r["check"] for r in self.results if r["status"] == "skip"]
        summary = dict(env=env, results=self.results, failed=failed, skipped=skipped)
        (self.out / "sglang_cuda.json").write_text(json.dumps(summary, indent=1))
        passed = len(self.results) - len(failed) - len(skipped)
        self.line(f"{passed} passed, {len(skipped)} skipped, {len(failed)} failed")
        self.log.close()
        return 1 if failed else 0


def main() -> int:
    args = parse_args()
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: run with --device cpu for the smoke test", file=sys.stderr)
        return 2
    from _sglang_loader import load_kv_canary

    kv = load_kv_canary(stub_jit=args.device == "cpu", srt=True, stub_srt_utils=True)
    import _sglang_cuda_checks as checks

    from kvcanary_dispatch.integrations import sglang as integration

    max_bs = min(args.max_bs, 6000) if args.quick else args.max_bs
    rep = Report(args.out, checks.Skipped)
    env = checks.environment(kv, args.device)
    rep.line(f"environment: {json.dumps(env)}")
    ctx = checks.Ctx(
        kv=kv, device=args.device, quick=args.quick, max_bs=max_bs, rng=random.Random(0)
    )
    if args.device == "cpu":
        checks.force_kernel_path(kv)
    rep.check("build sglang's CUDA-JIT kernels", checks.build_jit, ctx)
    rep.check(
        "unpatched sglang plan: torch reference within its cap, error above",
        checks.unpatched_plan,
        ctx,
    )
    rep.check(
        "unpatched sglang scatter: torch reference within its cap, error above",
        checks.unpatched_scatter,
        ctx,
    )
    rep.check("within caps: patched == unpatched (plan)", checks.within_caps_plan, ctx)
    rep.check("within caps: patched == unpatched (scatter)", checks.within_caps_scatter, ctx)
    rep.check("arguments sglang reads loosely: patched == unpatched", checks.loose_arguments, ctx)
    rep.check(
        "a verify plan past 2**31 - 1 entries: patched == unpatched",
        checks.verify_plan_past_int32,
        ctx,
    )
    with integration.applied(policy="grow"):
        rep.check("beyond caps: plan == sglang torch reference", checks.beyond_caps_plan, ctx)
        rep.check("beyond caps: scatter == sglang torch reference", checks.beyond_caps_scatter, ctx)
        rep.check(
            "sglang's differential/invariants/fuzz driver beyond the cap",
            checks.sglang_helpers,
            ctx,
        )
        rep.check("end-to-end canary with corruption", checks.end_to_end, ctx)
        if args.device == "cuda":
            rep.check("CUDA graph of the patched plan", checks.cuda_graph, ctx)
    return rep.finish(env)


if __name__ == "__main__":
    sys.exit(main())
