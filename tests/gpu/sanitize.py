"""One script for compute-sanitizer (memcheck, racecheck): every strategy of both dispatch
functions at a few shapes — one slice, many slices, a slice boundary inside a long segment,
all-empty segments, decodes or drafts among runs past ``capped``'s cap, long runs on a wide
pool (its tail programs first), a run ``rows`` copies in two steps, 512 requests (``auto``'s
largest ``rows`` batch) with a run copied in four — each checked against the reference; then
every strategy and the fixed-block kernel with offsets that break the CSR rules
(``validate=False``), and ``capped`` so on a pool wide enough for its tail programs to come
first and on a pool wider than its cap with runs of 8 tokens on average (its tail programs
read guessed offsets), which they must survive without an out-of-bounds access, each into a
poisoned pool between guard rows, checked after the call to hold only tokens of the runs that
name its rows (``check_broken_offsets_writes``); and every plan strategy and the fixed-block
launcher on plan data that breaks the preconditions (``BROKEN_PLAN_DATA``: rows outside the
table, prefixes past it), each equal to the reference. The bad calls alone (``bad``) also run
under memcheck with ``PYTORCH_NO_CUDA_MEMORY_CACHING=1``, so that each tensor is an allocation
of its own and an access just past one is reported, not hidden inside a block of torch's cache
(the whole script so takes over 5 minutes). Everything
runs twice: the first pass compiles and launches through ``kernel[grid]``, the second through
the cached compiled kernels' launchers (``kvcanary_kernels._launch``, tensor addresses handed
as integers), and fails if any of its launches leaves that path.

    compute-sanitizer --tool memcheck python tests/gpu/sanitize.py
    PYTORCH_NO_CUDA_MEMORY_CACHING=1 \
        compute-sanitizer --tool memcheck python tests/gpu/sanitize.py bad   # no cache
    compute-sanitizer --tool racecheck python tests/gpu/sanitize.py capped   # that scatter only
    compute-sanitizer --tool racecheck python tests/gpu/sanitize.py plan     # plan only

Arguments other than ``plan`` and ``bad`` name the scatter strategies to run (and no plan call).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

from kvcanary_dispatch import (
    PLAN_STRATEGIES,
    SCATTER_STRATEGIES,
    plan_offsets,
    scatter_req_token_ids,
)
from kvcanary_dispatch.launch_plan import resolve_scatter_strategy
from kvcanary_dispatch.scatter_shapes import capped_shape, rows_grid
from kvcanary_dispatch.testing.cases import (
    POISON_I32,
    check_plan,
    check_scatter,
    make_plan_case,
    make_scatter_case,
)
from kvcanary_dispatch.testing.plan_inputs import (
    BROKEN_PLAN_DATA,
    broken_plan_case,
    check_broken_plan,
)
from kvcanary_dispatch.testing.scatter_inputs import BROKEN_OFFSETS, check_broken_offsets_writes
from kvcanary_kernels import launch_scatter_req_token_ids_kernel

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/: its _helpers
from _helpers import guarded_pool, random_plan_lens  # noqa: E402

DEVICE = "cuda"
SPARE = 2  # guard columns past a bad-offsets call's pool, where a write past its width shows
SCATTER_SHAPES = {
    "one_slice": ([3, 0, 5, 2], 8),
    "many_slices": ([1, 0, 2] * 400, 4),
    "boundary_in_long_segment": ([1] * 6 + [5000] + [2] * 6, 8192),
    "all_empty": ([0] * 1500, 16),
    "decodes_and_long_runs": ([1] * 700 + [3000] + [1] * 300 + [900, 0, 5], 4096),
    # capped: drafts, whose tail tiles the guessed reads show idle, around runs past the cap
    "drafts_and_long_runs": ([4, 8, 6, 5, 7] * 300 + [2500] + [6] * 200 + [40, 33, 0, 31], 4096),
    # capped: head tiles one request wide, 4 steps, the tail programs first (asserted in main)
    "long_runs_wide_pool": ([9000, 0, 600, 13000, 4097, 100], 16384),
    # rows: 16 column programs a request, the long run's 20 tiles in two steps (asserted)
    "rows_steps": ([20000] + [3] * 127, 32768),
    # auto's rows at its largest bs: 8 column programs a request, the full-width run in 4 steps
    "rows_512": ([32768] + [3] * 511, 32768),
}


def main(only: list[str]) -> None:
    """Every strategy of both functions; ``only``: those scatter strategies and no plan call,
    ``["plan"]``: the plan calls alone, or ``["bad"]``: the bad-offsets calls alone."""
    plan_only, bad_only = only == ["plan"], only == ["bad"]
    scatter_strategies = [] if plan_only or bad_only else only
    n = 0
    lens, width = SCATTER_SHAPES["drafts_and_long_runs"]
    assert dict(capped_shape(len(lens), sum(lens), width))["guess"] > 0
    lens, width = SCATTER_SHAPES["long_runs_wide_pool"]
    assert dict(capped_shape(len(lens), sum(lens), width))["tails_first"] == 1
    lens, width = SCATTER_SHAPES["rows_steps"]
    assert rows_grid(len(lens), sum(lens), width)[1] == 16
    lens, width = SCATTER_SHAPES["rows_512"]
    assert rows_grid(len(lens), sum(lens), width) == (512, 8)
    assert resolve_scatter_strategy("auto", len(lens), sum(lens), None, width) == "rows"
    for lens, width in SCATTER_SHAPES.values() if not (plan_only or bad_only) else ():
        case = make_scatter_case(lens, width=width, device=DEVICE)
        for strategy in scatter_strategies or SCATTER_STRATEGIES:
            for chunk in (None, 1, 7):
                kw = {} if chunk is None else {"chunk_size": chunk}
                check_scatter(scatter_req_token_ids, case, strategy=strategy, **kw)
                n += 1
    for bs in (0, 5, 600, 5000) if not (scatter_strategies or bad_only) else ():
        case = make_plan_case(
            **random_plan_lens(bs, bs, prefix_hi=17, extend=(0, 4), pad_p=0.2),
            max_seq_len=16,
            lut_len=10,
            swa_window_size=4,
            device=DEVICE,
        )
        for strategy in PLAN_STRATEGIES:
            for chunk in (None, 1, 256, 1024):  # None: 4 096-request slices in 1 024-request tiles
                kw = {} if chunk is None else {"chunk_size": chunk}
                check_plan(plan_offsets, case, strategy=strategy, **kw)
                n += 1
    bad_plans = 0
    for name in BROKEN_PLAN_DATA if not scatter_strategies else ():  # plan, bad or all
        case, r = broken_plan_case(name, lut=True, window=3, device=DEVICE)
        bad_plans += check_broken_plan(case, r, chunks=(2,))
    flat_in = torch.arange(12, dtype=torch.int64, device=DEVICE)
    rows = [3, 0, 2]
    block = guarded_pool(5, 6, DEVICE, spare_cols=SPARE)  # 5 rows of 6 columns, guards around
    bad_calls = 0
    for bad in BROKEN_OFFSETS.values() if not plan_only else ():
        call = BadCall(flat_in, bad, rows, block)
        for strategy in scatter_strategies or SCATTER_STRATEGIES:
            chunk = 2 if strategy in ("loop", "sliced") else None  # slices of 2 requests
            call.run(partial(scatter_req_token_ids, strategy=strategy, chunk_size=chunk))
            bad_calls += 1
        if not scatter_strategies:  # the fixed-block kernel, which sliced's slices share
            call.run(launch_scatter_req_token_ids_kernel)
            bad_calls += 1
    assert dict(capped_shape(2, 20000, 9000))["tails_first"] == 1
    assert dict(capped_shape(500, 4000, 64))["guess"] > 0
    capped = not plan_only and (not scatter_strategies or "capped" in scatter_strategies)
    for call in _capped_bad_calls(rows[:2]) if capped else ():
        call.run(partial(scatter_req_token_ids, strategy="capped"))
        bad_calls += 1
    if torch.device(DEVICE).type == "cuda":  # tests/test_gpu_sanitize_script.py: the CPU too
        torch.cuda.synchronize()
    print(
        f"sanitize.py: {n} dispatched calls matched the reference, "
        f"{bad_calls} bad-offsets calls ran, {bad_plans} plans on broken data matched it"
    )


@dataclass
class BadCall:
    """A scatter on offsets that break the CSR rules, into ``block[1:-1, :-SPARE]`` (``block``
    a pool between guard rows, before ``SPARE`` guard columns)."""

    flat_in: torch.Tensor
    offsets: list[int]
    rows: list[int]
    block: torch.Tensor

    def run(self, scatter: Callable[..., None]) -> None:
        """``scatter`` on the poisoned pool, then the promise checked on every element."""
        self.block.fill_(POISON_I32)
        scatter(
            flat_in=self.flat_in,
            offsets=torch.tensor(self.offsets, dtype=torch.int64, device=DEVICE),
            req_pool_indices=torch.tensor(self.rows, dtype=torch.int64, device=DEVICE),
            pool_out=self.block[1:-1, :-SPARE],
        )
        width = self.block.shape[1] - SPARE
        check_broken_offsets_writes(self.block, self.rows, self.offsets, self.flat_in, width=width)


def _capped_bad_calls(rows: list[int]) -> Iterator[BadCall]:
    """``capped``'s calls with offsets that break the CSR rules, past the shapes above: on a
    pool wider than 8 steps of 1 024 columns (``rows``: two distinct rows of it), where its
    one-request head tiles take 4 steps and its tail programs come first; then, for the short
    class's guessed reads, offsets in no order for 500 requests, 8 tokens each on average, on
    a pool wider than the cap, so that its tail programs run and guess."""
    wide_in = torch.arange(20000, dtype=torch.int64, device=DEVICE)
    wide_block = guarded_pool(4, 9000, DEVICE, spare_cols=SPARE)
    for bad in ([0, 15000, 3000], [-5, 12000, 20000], [19000, 2, 40], [0, 2**40, 7]):
        yield BadCall(wide_in, bad, rows, wide_block)
    g = torch.Generator().manual_seed(5)
    draft_in = torch.arange(4000, dtype=torch.int64, device=DEVICE)
    draft_rows = torch.randperm(600, generator=g)[:500].tolist()
    draft_block = guarded_pool(600, 64, DEVICE, spare_cols=SPARE)
    for _ in range(3):
        offsets = torch.randint(-50, 4100, (501,), generator=g).tolist()
        yield BadCall(draft_in, offsets, draft_rows, draft_block)


def _second_pass(only: list[str]) -> None:
    """``main`` again, failing if any launch leaves the cached path (``JITFunction.run``)."""
    from triton.runtime.jit import JITFunction

    real, calls = JITFunction.run, [0]

    def counted(self, *args, **kwargs):
        calls[0] += 1
        return real(self, *args, **kwargs)

    JITFunction.run = counted
    try:
        main(only)
    finally:
        JITFunction.run = real
    print(f"sanitize.py: second pass, {calls[0]} launches left the cached path")
    if calls[0]:
        raise SystemExit("the second pass was meant to launch every kernel from the cache")


if __name__ == "__main__":
    main(sys.argv[1:])
    _second_pass(sys.argv[1:])
