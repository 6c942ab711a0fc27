"""Step 16: host µs of the pieces of a plan_offsets call (bs 64, 1 024, 4 096), pinned, one
process: ``python -m benchmarks.history.plan_host_parts OUT`` from the repository root (a
GPU)."""

import sys
from pathlib import Path

import torch
import triton

import kvcanary_dispatch as kd
import kvcanary_dispatch.plan as kplan
import kvcanary_kernels._launch as fast
from benchmarks import host_overhead as ho
from kvcanary_dispatch.launch_plan import plan_offsets_launch_plan
from kvcanary_dispatch.placement import on_device
from kvcanary_dispatch.testing.cases import make_plan_case
from kvcanary_kernels.args import PlanInputs, PlanOutputs, plan_kernel_head, plan_kernel_scalars
from kvcanary_kernels.plan_offsets import _fit_head, check_plan_args, enqueue_plan_offsets

NAMES_I = ("req_pool_indices", "prefix_lens", "extend_seq_lens", "req_to_token",
           "full_to_swa_index_mapping", "swa_window_size", "verify_capacity")  # fmt: skip
NAMES_O = ("out_verify_offsets", "out_write_offsets", "out_write_seed_slot_indices",
           "out_verify_num_valid", "out_verify_enable", "out_write_num_valid_reqs")  # fmt: skip


def pieces(bs: int, dev: torch.device) -> dict:
    p = make_plan_case(prefix_lens=[8] * bs, extend_seq_lens=[4] * bs, max_seq_len=16, device=dev)
    kw = {**p.inputs(), **p.fresh_outputs()}
    i = PlanInputs(*(kw[n] for n in NAMES_I))
    o = PlanOutputs(*(kw[n] for n in NAMES_O))
    head = plan_kernel_head(i, o, spare=o.out_verify_offsets)
    a = (*head.args, *plan_kernel_scalars(i), o.out_verify_offsets, bs, 0, 1 << 30)
    return {
        "bare_plan kernel[grid]": lambda: ho.bare_plan[(1,)](*a, BLOCK=256),
        "plan_offsets auto": lambda: kd.plan_offsets(**kw),
        "plan_offsets recount": lambda: kd.plan_offsets(**kw, strategy="recount"),
        "plan_bundled auto": lambda: kplan.plan_bundled(i, o),
        "bundles only": lambda: (
            PlanInputs(*(kw[n] for n in NAMES_I)),
            PlanOutputs(*(kw[n] for n in NAMES_O)),
        ),
        "check_plan_args": lambda: check_plan_args(i, o, bs_block=None),
        "_fit_head": lambda: _fit_head(i, o),
        "launch_plan lookup": lambda: plan_offsets_launch_plan(bs, None, "auto"),
        "is_compiling": torch.compiler.is_compiling,
        "on_device": lambda: on_device(dev),
        "plan_kernel_head": lambda: plan_kernel_head(i, o, spare=o.out_verify_offsets),
        "specialise 17 args": lambda: fast.specialise(a, 0),
        "enqueue fixed": lambda: enqueue_plan_offsets(i, o, bs_block=triton.next_power_of_2(bs)),
    }


ho.pin()
out = {}
for bs in (64, 1024, 4096):
    for k, fn in pieces(bs, torch.device("cuda")).items():
        out[(bs, k)] = ho.host_us(fn, 200, 11)
        print(f"bs {bs:5d} {k:28s} {out[(bs, k)]:7.2f}", flush=True)
d = Path(sys.argv[1])
d.mkdir(parents=True, exist_ok=True)
rows = "".join(f'{b},"{k}",{v:.2f}\n' for (b, k), v in out.items())
(d / "plan_host_parts.csv").write_text("bs,what,host_us\n" + rows)
