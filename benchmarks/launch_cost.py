"""Where a call's host time goes: one launch and the dispatcher's Python, taken apart.

``python -m benchmarks.launch_cost --out DIR`` (a GPU). Host µs per call (enqueue time of
``CALLS`` back-to-back calls, median of ``ROUNDS``) of: an empty kernel with the scatter
kernels' argument list launched as ``kernel[grid](...)``, through a ``BoundKernel`` of
``kvcanary_kernels._launch`` (what the launchers call), through the compiled kernel's runner
with everything precomputed, and through its launcher directly with the tensors' addresses
(what a cached launch ends in); the pieces a launch adds (specialisation key, current device
and stream); a torch allocation and fill; and ``scatter_req_token_ids`` / ``plan_offsets``
(``auto``) whole and with their Triton launches replaced by a no-op (the dispatcher's Python
alone). Pinned to one CPU, as ``benchmarks.host_overhead``. Writes ``launch_cost.csv`` and
``launch_cost.md``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.runtime import driver

from benchmarks import host_overhead, require_cuda

CALLS = 200
ROUNDS = 11


@triton.jit
def empty_scatter(a, b, c, d, n, bs, stride, width, BLOCK: tl.constexpr):
    pass


def host_us(fn) -> float:
    return host_overhead.host_us(fn, CALLS, ROUNDS)


def measure() -> dict[str, float]:
    import kvcanary_dispatch as kd
    import kvcanary_kernels._launch as fast
    from kvcanary_dispatch.testing.cases import make_plan_case, make_scatter_case

    dev = torch.device("cuda")
    case = make_scatter_case([4] * 8, width=64, device=dev)
    pool = case.fresh_pool()
    sc = case.kwargs(pool)
    args = (case.flat_in, case.offsets, case.req_pool_indices, pool, case.total, 8, 64, 64)
    grid = (1,)
    compiled = empty_scatter[grid](*args, BLOCK=1024)
    index = torch.cuda.current_device()
    stream = driver.active.get_current_stream(index)
    runner = compiled[(1, 1, 1)]
    direct = (compiled.run, compiled.function, compiled.packed_metadata)
    bound = fast.binder(empty_scatter, "BLOCK")(1024)
    addresses = [a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args]

    def launcher() -> None:
        run, function, packed = direct
        run(1, 1, 1, stream, function, packed, None, None, None, *addresses, 1024)

    def plan_kw(bs: int) -> dict:
        p = make_plan_case(prefix_lens=[8] * bs, extend_seq_lens=[4] * bs, max_seq_len=16,
                           device=dev)  # fmt: skip
        return {**p.inputs(), **p.fresh_outputs()}

    small, big = plan_kw(64), plan_kw(4096)
    out = {
        "empty kernel[grid](...)": host_us(lambda: empty_scatter[grid](*args, BLOCK=1024)),
        "empty via BoundKernel": host_us(lambda: bound(grid, args)),
        "empty via compiled runner": host_us(lambda: runner(*args, 1024, stream=stream)),
        "empty via its launcher, addresses": host_us(launcher),
        "specialization_key": host_us(
            lambda: fast.specialization_key(empty_scatter, 0, args, {"BLOCK": 1024})
        ),
        "torch.cuda.current_device": host_us(torch.cuda.current_device),
        "get_current_stream": host_us(lambda: driver.active.get_current_stream(index)),
        "torch.empty((16, 2))": host_us(
            lambda: torch.empty((16, 2), dtype=torch.int64, device=dev)
        ),  # fmt: skip
        "torch.full((65,))": host_us(
            lambda: torch.full((65,), -1, dtype=torch.int64, device=dev)
        ),  # fmt: skip
        "scatter auto bs 8": host_us(lambda: kd.scatter_req_token_ids(**sc)),
        "plan auto bs 64": host_us(lambda: kd.plan_offsets(**small)),
        "plan auto bs 4096": host_us(lambda: kd.plan_offsets(**big)),
        "plan lookback bs 4096": host_us(lambda: kd.plan_offsets(**big, strategy="lookback")),
    }
    # Every launcher launches through a BoundKernel: __call__, with_head (the plan's full
    # path) or checked (the one-pass launches of both functions).
    real = {name: getattr(fast.BoundKernel, name) for name in ("__call__", "with_head", "checked")}
    for name in real:
        setattr(fast.BoundKernel, name, lambda *args: None)
    try:
        out["scatter auto bs 8, no launch"] = host_us(lambda: kd.scatter_req_token_ids(**sc))
        out["plan auto bs 64, no launch"] = host_us(lambda: kd.plan_offsets(**small))
        out["plan auto bs 4096, no launch"] = host_us(lambda: kd.plan_offsets(**big))
    finally:
        for name, method in real.items():
            setattr(fast.BoundKernel, name, method)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    require_cuda(ap)
    host_overhead.pin()  # one CPU, as host_overhead's measurements
    res = measure()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "launch_cost.csv").write_text(
        "what,host_us\n" + "".join(f'"{k}",{v:.2f}\n' for k, v in res.items())
    )
    name = torch.cuda.get_device_name()
    lines = [f"# Host µs per call ({name}, torch {torch.__version__}, Triton {triton.__version__})",
             "", "| what | host µs |", "|---|---|"]  # fmt: skip
    lines += [f"| {k} | {v:.2f} |" for k, v in res.items()]
    (args.out / "launch_cost.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
