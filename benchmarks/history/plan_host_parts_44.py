"""Step 44: the pieces of an eager plan ``auto`` call's one pass (``_launched``) on a GPU host,
with the shared-memory check. Per bs (64: one fixed-block launch; 1 048 576: the look-back),
timed in one pinned process, interleaved round by round with the bare launch
(``benchmarks.host_overhead.loops_us``, 3 repeats): the whole call, the pass alone, its
pieces (``_fit_head``, the shared-memory check on a call seen before, the launch look-up, the
device and capture queries through ``torch.cuda`` and through the bindings they wrap, the
resident-state look-up, the compiled launch alone). ``python -m
benchmarks.history.plan_host_parts_44 OUT`` from the repository root; writes
``OUT/plan_host_parts_44.csv``."""

import sys
from pathlib import Path

import torch

import kvcanary_dispatch as kd
import kvcanary_dispatch.plan as kplan
from benchmarks import host_overhead as ho
from benchmarks.history.plan_host_parts_33 import time_pieces
from kvcanary_dispatch.aliasing import plan_outputs_share_memory
from kvcanary_dispatch.resident import cuda_stream_buffer
from kvcanary_kernels.args import PlanInputs, PlanOutputs, plan_kernel_scalars


def pieces(bs: int, dev: torch.device) -> dict:
    kw = ho.plan_keywords(bs, dev)
    i = PlanInputs(*(kw[n] for n in PlanInputs._fields))
    o = PlanOutputs(*(kw[n] for n in PlanOutputs._fields))
    bound, grid, chunk, words, _ = kplan._one_launch(bs, None, "auto", False)
    head = kplan._fit_head(i, o)
    out = o.out_verify_offsets
    make = kplan._state_maker(out)
    extra = (cuda_stream_buffer(kplan._STATE, 0, words, make)[0],) if words else (out,)
    lead = (*plan_kernel_scalars(i), bs)
    ints = (*lead, 0, 1 << 30) if chunk is None else (*lead, chunk, 0, 1 << 30)
    tensors, addresses = (*head.args, *extra), (*head.handed, *[t.data_ptr() for t in extra])
    bare = ho.bare_plan_args(kw)
    return {
        "bare_plan kernel[grid]": lambda: ho.bare_plan[(1,)](*bare, BLOCK=256),
        "plan_offsets auto": lambda: kd.plan_offsets(**kw),
        "_launched (the one pass)": lambda: kplan._launched(i, o, None, "auto"),
        "_fit_head": lambda: kplan._fit_head(i, o),
        "shared-memory check, seen before": lambda: plan_outputs_share_memory(i, o, head),
        "_one_launch look-up": lambda: kplan._one_launch(bs, None, "auto", False),
        "torch.cuda.current_device": torch.cuda.current_device,
        "torch._C._cuda_getDevice": torch._C._cuda_getDevice,
        "torch.cuda.is_current_stream_capturing": torch.cuda.is_current_stream_capturing,
        "torch._C._cuda_isCurrentStreamCapturing": torch._C._cuda_isCurrentStreamCapturing,
        "cuda_stream_buffer look-up": lambda: cuda_stream_buffer(
            kplan._STATE, 0, words, kplan._state_maker(out)
        ),
        "checked launch alone": lambda: bound.checked(grid, head.device, tensors, addresses, ints),
        "nothing (loop floor)": lambda: None,
    }


if __name__ == "__main__":
    time_pieces(pieces, (64, 1048576), Path(sys.argv[1]), "plan_host_parts_44")
