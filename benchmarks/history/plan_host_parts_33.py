"""Step 33: where the eager look-back's host time goes, on a GPU host. Per bs (4 096: one
``recount`` launch; 32 768 and 1 048 576: the look-back), the pieces of one ``auto`` call are
timed in one process, interleaved round by round with the bare launch
(``benchmarks.host_overhead.loops_us``): the whole call, the call with the capture query
answered by a constant, the one-launch pass alone, ``_fit_head``, the capture query, the
resident-state lookup (by device, as the full path; by the index and stream, as the one pass
since step 33), the current-stream query, and the compiled launch alone
(``BoundKernel.checked`` with the call's arguments). The first run (step 33, before the one
pass read the stream once) timed the pass as it stood at b15b173. ``python -m
benchmarks.history.plan_host_parts_33 OUT`` from the repository root; writes
``OUT/plan_host_parts_33.csv``."""

import statistics
import sys
from pathlib import Path

import torch
from triton.runtime import driver

import kvcanary_dispatch as kd
import kvcanary_dispatch.plan as kplan
from benchmarks import host_overhead as ho
from kvcanary_dispatch.resident import cuda_stream_buffer, stream_buffer
from kvcanary_kernels.args import PlanInputs, PlanOutputs, plan_kernel_scalars


def pieces(bs: int, dev: torch.device) -> dict:
    kw = ho.plan_keywords(bs, dev)
    names_i = PlanInputs._fields
    i = PlanInputs(*(kw[n] for n in names_i))
    o = PlanOutputs(*(kw[n] for n in PlanOutputs._fields))
    bound, grid, chunk, words, by_capture = kplan._one_launch(bs, None, "auto", False)
    head = kplan._fit_head(i, o)
    out = o.out_verify_offsets
    extra = (
        (stream_buffer(kplan._STATE, out.device, words, kplan._state_maker(out)),) if words else ()
    )
    ints = (*plan_kernel_scalars(i), bs, chunk, 0, 1 << 30)
    tensors, addresses = (*head.args, *extra), (*head.handed, *[t.data_ptr() for t in extra])
    bare = ho.bare_plan_args(kw)

    def no_query():  # the one pass's capture query answered by a constant
        query = torch.cuda.is_current_stream_capturing
        torch.cuda.is_current_stream_capturing = bool  # bool() is False
        try:
            kd.plan_offsets(**kw)
        finally:
            torch.cuda.is_current_stream_capturing = query

    return {
        "bare_plan kernel[grid]": lambda: ho.bare_plan[(1,)](*bare, BLOCK=256),
        "plan_offsets auto": lambda: kd.plan_offsets(**kw),
        "auto, capture query a constant": no_query,
        "_launched (the one pass)": lambda: kplan._launched(i, o, None, "auto"),
        "_fit_head": lambda: kplan._fit_head(i, o),
        "is_current_stream_capturing": torch.cuda.is_current_stream_capturing,
        "stream_buffer lookup": lambda: stream_buffer(
            kplan._STATE, out.device, words, kplan._state_maker(out)
        ),
        "cuda_stream_buffer lookup": lambda: cuda_stream_buffer(
            kplan._STATE, 0, words, kplan._state_maker(out)
        ),
        "get_current_stream": lambda: driver.active.get_current_stream(0),
        "checked launch alone": lambda: bound.checked(grid, head.device, tensors, addresses, ints),
        "nothing (loop floor)": lambda: None,
    }


def time_pieces(pieces_of, sizes: tuple[int, ...], out: Path, name: str) -> None:
    """Time ``pieces_of(bs, device)``'s calls for each of ``sizes``, pinned, 3 repeats of 15
    interleaved rounds of 50 calls; print each median and write ``out/<name>.csv``."""
    ho.pin()
    rows = []
    for bs in sizes:
        named = pieces_of(bs, torch.device("cuda"))
        for rep in range(3):
            samples = ho.loops_us(list(named.values()), 50, 15)
            for what, us in zip(named, samples, strict=True):
                med = statistics.median(us)
                rows.append((bs, rep, what, med))
                print(f"bs {bs:7d} rep {rep} {what:40s} {med:7.2f}", flush=True)
    out.mkdir(parents=True, exist_ok=True)
    lines = "".join(f'{b},{r},"{w}",{v:.2f}\n' for b, r, w, v in rows)
    (out / f"{name}.csv").write_text("bs,rep,what,host_us\n" + lines)


if __name__ == "__main__":
    time_pieces(pieces, (4096, 32768, 1048576), Path(sys.argv[1]), "plan_host_parts_33")
