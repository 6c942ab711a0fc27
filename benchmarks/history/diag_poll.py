"""Which condition makes explore_poll's kernel fault: a map left set by an earlier call or not.

``python -m benchmarks.history.diag_poll MODE POLLS CALLS [once]``: ``once`` runs step 66's
poll (one read an entry), else step 65's."""

import sys
from functools import partial

import torch
import triton

from benchmarks.distributions import WIDTH, _dist
from benchmarks.history import explore_poll as ep
from kvcanary_dispatch.scatter_shapes import capped_shape
from kvcanary_dispatch.testing.cases import POISON_I32, make_scatter_case
from kvcanary_kernels import scatter_req_token_ids_ref
from kvcanary_kernels.scatter_capped import capped_grid

mode, polls = sys.argv[1], int(sys.argv[2])
polled = partial(ep._polled, one_read=sys.argv[4:] == ["once"])
dev = torch.device("cuda")
name = "decode_prefill_8192"
lens = _dist(name, False, torch.Generator().manual_seed(len(name)))
case = make_scatter_case(lens, width=WIDTH, seed=1, device=dev)
p = dict(capped_shape(case.bs, case.total, WIDTH))
grid = capped_grid(case.bs, case.total, WIDTH, p)[0]
heads = triton.cdiv(case.bs, p["reqs"])
m = torch.full(((grid - heads) * p["tiles"],), -1, dtype=torch.int32, device=dev)
want = case.fresh_pool()
scatter_req_token_ids_ref(**case.kwargs(want))
cap = p["steps"] * p["cols"]
a = cap + torch.arange(m.numel(), dtype=torch.int64) * p["tail"]
owners = (torch.searchsorted(case.offsets.cpu(), a, right=True) - 1).clamp(0, case.bs - 1)
owners = torch.where(a < case.total, owners, -1).to(torch.int32).to(dev)
pool = case.fresh_pool()
bad = 0
for k in range(int(sys.argv[3])):
    if mode == "fresh":
        m.fill_(-1)
    elif mode == "owners":
        m.copy_(owners)
    elif mode == "half":  # owners on even tiles, -1 on odd ones: programs with both kinds
        m.copy_(torch.where(torch.arange(m.numel(), device=dev) % 2 == 0, owners, -1))
    pool.fill_(POISON_I32)
    polled(p, m, polls, **case.kwargs(pool))
    torch.cuda.synchronize(dev)
    bad += not torch.equal(pool, want)
    if k % 100 == 0 or k < 5:
        print(
            f"{mode} polls={polls} call {k}: left set {int((m != -1).sum())} wrong so far {bad}",
            flush=True,
        )
print(f"{mode} polls={polls}: done, wrong {bad}")
if mode == "fresh":  # eager kernel durations by events, the map re-armed outside them
    from benchmarks.history.explore_owner import _library

    def timed(fn) -> float:
        m.fill_(-1)
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        fn(**case.kwargs(pool))
        end.record()
        torch.cuda.synchronize(dev)
        return begin.elapsed_time(end) * 1e3

    runs = {"library": lambda **kw: _library(p, **kw),
            f"polled {polls}": lambda **kw: polled(p, m, polls, **kw)}  # fmt: skip
    times = {k: [] for k in runs}
    for _ in range(400):
        for k, fn in runs.items():
            times[k].append(timed(fn))
    for k, t in times.items():
        t = torch.tensor(t)
        print(
            f"eager, events: {k:10s} median {float(t.median()):.2f} us, "
            f"p10 {float(t.quantile(0.1)):.2f}, p90 {float(t.quantile(0.9)):.2f}"
        )
if mode == "graphtime":  # warm replays of graphs that each re-arm the map first (a memset)
    from benchmarks.history.explore_owner import _library
    from kvcanary_dispatch.cli.timing import empty_launch

    calls = {
        "L0": empty_launch(dev),
        "memset": lambda: m.fill_(-1),
        "memset + library": lambda: (m.fill_(-1), _library(p, **case.kwargs(pool))),
        f"memset + polled {polls}": lambda: (
            m.fill_(-1),
            polled(p, m, polls, **case.kwargs(pool)),
        ),
    }
    graphs, warm = ep.warm_replays_us(calls, dev)
    for label, t in warm.items():
        print(
            f"graph replays, L2 warm, 6 x 500: {label:18s} median {ep._med(t):.2f} us  "
            f"rounds {' '.join(f'{v:.2f}' for v in t)}"
        )
    pool.fill_(POISON_I32)
    graphs[f"memset + polled {polls}"].replay()
    torch.cuda.synchronize(dev)
    print(
        f"after one more replay: pool equals the reference {torch.equal(pool, want)}; "
        f"map entries left set {int((m != -1).sum())}"
    )
