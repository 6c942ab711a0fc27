"""Step 17: host µs of the pieces of a plan call on the look-back path (bs 64 to 131 072),
pinned, one process: ``python -m benchmarks.history.plan_host_parts_17 OUT`` from the
repository root (a GPU). Its run in results/plan_host_parts_resident.csv built the bundles
field by field; the calls timed were the same."""

import sys
from pathlib import Path

import torch
from triton.runtime import driver

import kvcanary_dispatch as kd
import kvcanary_dispatch.plan as kplan
from benchmarks import host_overhead as ho
from kvcanary_dispatch.placement import capturing
from kvcanary_dispatch.resident import stream_buffer
from kvcanary_dispatch.testing.cases import make_plan_case
from kvcanary_kernels.args import bundle_plan_args, plan_kernel_head, plan_kernel_scalars
from kvcanary_kernels.plan_offsets import check_plan_args


def pieces(bs: int, dev: torch.device) -> dict:
    p = make_plan_case(prefix_lens=[8] * bs, extend_seq_lens=[4] * bs, max_seq_len=16, device=dev)
    kw = {**p.inputs(), **p.fresh_outputs()}
    i, o = bundle_plan_args(kw)
    head = plan_kernel_head(i, o, o.out_verify_offsets)
    a = (*head.args, *plan_kernel_scalars(i), o.out_verify_offsets, bs, 0, 1 << 30)
    make = kplan._state_maker(o.out_verify_offsets)
    return {
        "bare_plan kernel[grid]": lambda: ho.bare_plan[(1,)](*a, BLOCK=256),
        "plan_offsets auto": lambda: kd.plan_offsets(**kw),
        "plan_offsets lookback": lambda: kd.plan_offsets(**kw, strategy="lookback", chunk_size=256),
        "plan_offsets scan": lambda: kd.plan_offsets(**kw, strategy="scan", chunk_size=256),
        "check_plan_args": lambda: check_plan_args(i, o, bs_block=None),
        "plan_kernel_head": lambda: plan_kernel_head(i, o, o.out_verify_offsets),
        "capturing()": lambda: capturing(dev),
        "stream_buffer": lambda: stream_buffer("plan_lookback", dev, 64, make),
        "get_current_stream": lambda: driver.active.get_current_stream(0),
    }


ho.pin()
rows = []
for bs in (64, 1024, 8192, 131072):
    for k, fn in pieces(bs, torch.device("cuda")).items():
        rows.append((bs, k, ho.host_us(fn, 200, 11)))
        print(f"bs {bs:7d} {k:26s} {rows[-1][2]:7.2f}", flush=True)
d = Path(sys.argv[1])
d.mkdir(parents=True, exist_ok=True)
text = "".join(f'{b},"{k}",{v:.2f}\n' for b, k, v in rows)
(d / "plan_host_parts.csv").write_text("bs,what,host_us\n" + text)
