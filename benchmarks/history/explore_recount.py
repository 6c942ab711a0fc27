"""Step 16: the one-launch ``recount`` plan at several settings against ``scan``, ``lookback``,
the fixed block and ``auto``: ``python -m benchmarks.history.explore_recount OUT 512,1024,...``
from the repository root (a GPU)."""

import sys
from functools import partial
from pathlib import Path

import torch
import triton

from benchmarks import plan_sizes as ps
from kvcanary_dispatch import plan_offsets
from kvcanary_dispatch.cli.harness import Case, time_case
from kvcanary_dispatch.cli.results import Meta, rows_markdown, write_csv
from kvcanary_dispatch.cli.timing import floor_us, plan_floor_bytes
from kvcanary_kernels.args import bundle_plan_args
from kvcanary_kernels.plan_recount import launch_plan_recount

out = Path(sys.argv[1])
out.mkdir(parents=True, exist_ok=True)
sizes = [int(x) for x in sys.argv[2].split(",")]


def recount(tile, warps, sum_block):
    def impl(chunk_size, **kw):
        i, o = bundle_plan_args(kw)
        grid = (triton.cdiv(i.bs, chunk_size),)
        block = min(tile, triton.next_power_of_2(chunk_size))
        launch_plan_recount(
            i, o, grid=grid, chunk=chunk_size, bs_block=block, num_warps=warps, sum_block=sum_block
        )

    return impl


VARIANTS = [  # name, chunk, tile, warps, sum_block
    ("recount_w8_t256_s1024", 256, 256, 8, 1024),
    ("recount_w4_t256_s1024", 256, 256, 4, 1024),
    ("recount_w8_t256_s2048", 256, 256, 8, 2048),
    ("recount_w8_t512_s1024", 512, 512, 8, 1024),
    ("recount_w8_t1024_s1024", 1024, 1024, 8, 1024),
    ("recount_w4_t256_s1024", 1024, 256, 4, 1024),
    ("recount_w8_t1024_s2048", 1024, 1024, 8, 2048),
    ("recount_w8_t1024_s4096", 1024, 1024, 8, 4096),
]
device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
meta = Meta.collect(device)
print(meta.header(), flush=True)
rows = []
for bs in sizes:
    work = ps._case(bs, device)
    floor = floor_us(plan_floor_bytes(work), meta.copy_gbs)
    inputs = {**work.inputs(), **work.fresh_outputs()}
    calls = [("auto", None, plan_offsets)]
    calls.append(("dispatch_recount", None, partial(plan_offsets, strategy="recount")))
    if bs <= 4096:
        calls.append(("fixed_block", None, ps._fixed))
    for name, impl in (ps._variant("scan", 256, 8), ps._variant("lookback", 256, 4)):
        calls.append((name, 256, impl))
    for name, chunk, tile, warps, sb in VARIANTS:
        if chunk < bs:
            calls.append((name, chunk, recount(tile, warps, sb)))
    case = Case("plan", ps.DISTRIBUTION, bs, bs, floor, inputs, partial(ps._check, work))
    for r in time_case(meta, device, case, calls, rep_ms=50, host_rounds=3):
        rows.append(r)
        print(rows_markdown([r], ps.COLUMNS)[2], flush=True)
write_csv(rows, out / "explore_recount.csv")
text = [meta.header(), ""] + rows_markdown(rows, ps.COLUMNS, ps.HEAD)
(out / "explore_recount.md").write_text("\n".join(text) + "\n")
