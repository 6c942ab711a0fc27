"""Host time of one fitting ``ForwardStepGuard.plan_step`` step against the ``plan_offsets``
call it makes, and what its per-iteration stream lookup (``_note_stream``) costs.

``python -m benchmarks.history.guard_host_41`` (a GPU; run from the repository root). Per
size, three calls timed side by side by ``benchmarks.host_overhead.loops_us`` (enqueue time,
rounds rotated, one CPU): ``plan``, ``plan_offsets`` with the guard's buffers and keywords;
``guard``, ``plan_step`` (GPU lengths, ``num_tokens`` given) and its one iteration;
``guard_no_note``, the same with ``_note_stream`` returning the stream it saw first, without
looking up the current stream. Prints medians of the per-round ratios to ``plan`` with
quartiles. With ``--profile``: ``cProfile``'s heaviest functions over 3 000 guard steps at
bs 512 with the plan call (``plan_bundled``) replaced by a no-op (the guard's own Python).
Step 39 of ``benchmarks/NOTES.md`` (step 41 of ``tests/gpu/RESULTS.md``).
"""

from __future__ import annotations

import cProfile
import pstats
import statistics
import sys

import torch

from benchmarks.host_overhead import _quartiles, loops_us, pin, plan_keywords
from kvcanary_dispatch import plan_offsets
from kvcanary_dispatch.capacities import CanaryCapacities
from kvcanary_dispatch.forward_step import ForwardStepGuard
from kvcanary_dispatch.step_split import LENGTH_NAMES

SIZES = (8, 512, 4096, 32768, 262144)


def one_size(bs: int, dev: torch.device) -> dict[str, list[float]]:
    kw = plan_keywords(bs, dev)
    lengths = {k: kw[k] for k in LENGTH_NAMES}
    rtt = kw["req_to_token"]
    caps = CanaryCapacities(bs, 4 * bs, 1 << 30)
    guard = ForwardStepGuard(caps, "split", device=dev)
    fixed = ForwardStepGuard(caps, "split", device=dev)
    seen = fixed._note_stream(fixed.buffers.device)  # a device with its index
    fixed._note_stream = lambda device: seen  # the lookup removed, nothing else

    def step(g: ForwardStepGuard) -> None:
        for _ in g.plan_step(**lengths, req_to_token=rtt, num_tokens=4 * bs):
            pass

    direct = dict(
        **lengths,
        req_to_token=rtt,
        verify_capacity=caps.verify_capacity,
        **guard.buffers.tensors(),
    )
    names = ("plan", "guard", "guard_no_note")
    fns = [lambda: plan_offsets(**direct), lambda: step(guard), lambda: step(fixed)]
    return dict(zip(names, loops_us(fns), strict=True))


def profile(dev: torch.device, bs: int = 512, steps: int = 3000) -> None:
    from kvcanary_dispatch import forward_step

    forward_step.plan_bundled = lambda *a, **kw: None  # the guard's own Python only
    kw = plan_keywords(bs, dev)
    lengths = {k: kw[k] for k in LENGTH_NAMES}
    guard = ForwardStepGuard(CanaryCapacities(bs, 4 * bs, 1 << 30), "split", device=dev)

    def run(n: int) -> None:
        for _ in range(n):
            for _ in guard.plan_step(**lengths, req_to_token=kw["req_to_token"], num_tokens=4 * bs):
                pass

    run(100)
    prof = cProfile.Profile()
    prof.runcall(run, steps)
    pstats.Stats(prof).sort_stats("tottime").print_stats(25)


def main() -> None:
    cpu = pin()
    dev = torch.device("cuda")
    if "--profile" in sys.argv:
        profile(dev)
        return
    print(f"cpu {cpu}; {torch.cuda.get_device_name()}; torch {torch.__version__}")
    print("| bs | plan µs | guard µs | guard / plan | no lookup µs | no lookup / plan |")
    print("|---|---|---|---|---|---|")
    for bs in SIZES:
        t = one_size(bs, dev)
        cells = [f"{statistics.median(t['plan']):.1f}"]
        for name in ("guard", "guard_no_note"):
            r = [x / y for x, y in zip(t[name], t["plan"], strict=True)]
            lo, mid, hi = _quartiles(r)
            cells += [f"{statistics.median(t[name]):.1f}", f"{mid:.2f}x ({lo:.2f}-{hi:.2f})"]
        print(f"| {bs} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
