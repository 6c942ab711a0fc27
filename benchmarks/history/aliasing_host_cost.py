"""Host time of the shared-memory checks the one-pass paths run before a launch (µs per call,
median of 15 loops of 20 000): the plan's ``plan_outputs_share_memory`` when its call was
seen before (a hit: the tensors' addresses and sizes) and when not (every key new, as for an
engine whose batch size changes every step), and the scatter's ``_pool_shares_memory``; then
what the full paths run: ``refuse_shared_memory`` on a scatter call (its pool a column window,
its three inputs contiguous) and ``span_of`` of such a pool, of a contiguous vector and of a
strided one. ``python -m benchmarks.history.aliasing_host_cost [--device cuda]``."""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from kvcanary_dispatch import aliasing
from kvcanary_dispatch.scatter import _pool_shares_memory
from kvcanary_dispatch.testing.cases import make_plan_case, make_scatter_case
from kvcanary_kernels.args import bundle_plan_args
from kvcanary_kernels.plan_offsets import checked_plan_head

LOOPS, CALLS = 15, 20_000


def per_call_us(fn) -> float:
    times = []
    for _ in range(LOOPS):
        t0 = time.perf_counter()
        for _ in range(CALLS):
            fn()
        times.append((time.perf_counter() - t0) / CALLS * 1e6)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    device = ap.parse_args().device
    case = make_plan_case(
        prefix_lens=[3] * 4096, extend_seq_lens=[1] * 4096, max_seq_len=16, lut_len=64,
        device=device,
    )  # fmt: skip
    keywords = {**case.inputs(), "verify_capacity": case.verify_capacity}
    i, o = bundle_plan_args({**keywords, **case.fresh_outputs()}, "out_verify_offsets")
    head = checked_plan_head(i, o)
    seen = aliasing._DISJOINT
    hit = lambda: aliasing.plan_outputs_share_memory(i, o, head)  # noqa: E731
    miss = lambda: (seen.clear(), aliasing.plan_outputs_share_memory(i, o, head))  # noqa: E731
    clear = lambda: (seen.clear(), None)  # noqa: E731
    s = make_scatter_case([5] * 4096, width=64, device=device)
    pool = s.fresh_pool()
    addresses = (s.flat_in.data_ptr(), s.offsets.data_ptr(), s.req_pool_indices.data_ptr(),
                 pool.data_ptr())  # fmt: skip
    rows, pitch = pool.shape[0], pool.stride(0)

    def scatter() -> bool:
        return _pool_shares_memory(addresses, rows, pitch, 64, s.total, 4096)

    window = torch.zeros(4097, 80, dtype=torch.int32, device=device)[:, :64]
    inputs = ((s.flat_in, "flat_in"), (s.offsets, "offsets"), (s.req_pool_indices, "rows"))
    strided = torch.zeros(2 * 4097, dtype=torch.int32, device=device)[::2]

    def full_scatter() -> None:
        aliasing.refuse_shared_memory("scatter", ((window, "pool_out"),), inputs)

    clear_us = per_call_us(clear)
    rows = {
        "plan, seen before": per_call_us(hit),
        "plan, new (less the set's clear)": per_call_us(miss) - clear_us,
        "scatter": per_call_us(scatter),
        "scatter's full path (refuse_shared_memory)": per_call_us(full_scatter),
        "span_of, a pool's column window": per_call_us(lambda: aliasing.span_of(window)),
        "span_of, a contiguous vector": per_call_us(lambda: aliasing.span_of(s.offsets)),
        "span_of, a strided vector": per_call_us(lambda: aliasing.span_of(strided)),
    }
    print(f"device {device}; torch {torch.__version__}")
    for name, us in rows.items():
        print(f"{name}: {us:.3f} us")


if __name__ == "__main__":
    main()
