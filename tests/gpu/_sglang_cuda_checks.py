"""The checks of tests/gpu/sglang_cuda.py: each returns a detail string or raises.

Inputs and comparisons come from tests/sglang/_sglang_cases.py; every kernel and reference is
sglang's own (``ctx.kv``), patched through ``kvcanary_dispatch.integrations.sglang``.
"""

from __future__ import annotations

import random
import sys
import time
from dataclasses import dataclass

import torch
from _sglang_canary import CanaryRun
from _sglang_cases import (
    LOOSE,
    OFFSETS_SCALARS,
    POISON64,
    ROUTES,
    VERIFY_ENTRIES,
    assert_plans_identical,
    entries_standin,
    make_plan_case,
    make_scatter_case,
    maybe_applied,
    offsets_patched_vs_unpatched,
    plan_function,
    plan_tensors,
    plans_patched_vs_unpatched,
    poison,
    poisoned_plans,
)

from kvcanary_dispatch.integrations import sglang as integration

VARIANTS = {"plain": {}, "swa": dict(swa=3), "expected": dict(expected=True, kv_offset=1)}


class Skipped(Exception):  # noqa: N818 (a check's outcome, as pytest's Skipped)
    """A check that cannot run here, and why: reported as skipped, not as passed."""


@dataclass
class Ctx:
    kv: object
    device: str
    quick: bool
    max_bs: int
    rng: random.Random


def environment(kv, device: str) -> dict:
    import triton

    env = dict(
        python=sys.version.split()[0],
        torch=torch.__version__,
        triton=triton.__version__,
        sglang=kv.version,
        device=torch.cuda.get_device_name() if device == "cuda" else "cpu",
    )
    try:
        from importlib.metadata import version

        env["apache-tvm-ffi"] = version("apache-tvm-ffi")
    except Exception:
        env["apache-tvm-ffi"] = "absent"
    return env


def force_kernel_path(kv) -> None:
    """On the CPU: sglang's plan takes its kernel path with a stand-in entries kernel."""

    def use_torch_reference(device: torch.device) -> bool:
        return False

    kv.api.use_torch_reference = use_torch_reference
    kv.api.launch_plan_entries_kernel = entries_standin
    torch.cuda.synchronize = lambda *a, **k: None


def build_jit(ctx: Ctx) -> str:
    if ctx.device != "cuda":
        raise Skipped("on the CPU: sglang's stand-in entries kernel runs instead")
    entries = sys.modules["sglang.kernels.ops.kv_canary.plan.entries_kernel"]
    times = {}
    for swa, pool in ((False, False), (True, False), (False, True)):  # the variants used
        start = time.perf_counter()
        entries._jit_plan_entries_module(swa, pool)
        times[f"entries(swa={swa},pool={pool})"] = round(time.perf_counter() - start, 1)
    start = time.perf_counter()
    ctx.kv.write._jit_canary_write_module()
    times["write"] = round(time.perf_counter() - start, 1)
    start = time.perf_counter()
    ctx.kv.verify._jit_canary_verify_module(True)
    times["verify(token=True)"] = round(time.perf_counter() - start, 1)
    return f"seconds: {times}"


def _case(ctx: Ctx, bs: int, variant: str, seed: int):
    return make_plan_case(bs, seed=seed, device=ctx.device, **VARIANTS[variant])


def _cpu(case):
    return type(case)(
        **{k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in vars(case).items()}
    )


def _plan(ctx: Ctx, fn, case, *, device: str, cap_delta: int = 2):
    cap = max(case.total_verify() + cap_delta, 1)
    verify, write = poisoned_plans(
        ctx.kv, verify_capacity=cap, write_req_capacity=case.bs + 1, device=device
    )
    fn(**case.kwargs(verify, write))
    return verify, write


def _vs_reference(ctx: Ctx, case, fn) -> None:
    got = _plan(ctx, fn, case, device=ctx.device)
    ref_fn = ctx.kv.plan_ref.launch_canary_plan_kernels_torch_reference
    want = _plan(ctx, ref_fn, _cpu(case), device="cpu")
    assert_plans_identical(got[0], want[0], f"bs={case.bs} verify plan")
    assert_plans_identical(got[1], want[1], f"bs={case.bs} write plan")


def unpatched_plan(ctx: Ctx) -> str:
    assert not integration.is_applied()
    for bs in (300, 4096):
        _vs_reference(
            ctx, _case(ctx, bs, "expected", seed=bs), ctx.kv.api.launch_canary_plan_kernels
        )
    try:
        _plan(
            ctx,
            ctx.kv.api.launch_canary_plan_kernels,
            _case(ctx, 5000, "plain", 1),
            device=ctx.device,
        )
    except ValueError as err:
        assert "at most bs=4096" in str(err), err
        return "bs 300, 4096 equal the reference; bs 5000 raises sglang's cap error"
    raise AssertionError("unpatched sglang accepted bs=5000")


def unpatched_scatter(ctx: Ctx) -> str:
    case = make_scatter_case(511, seed=3, device=ctx.device)
    want = case.pool_out.cpu()
    ref_args = {k: v.cpu() for k, v in vars(case).items()}
    ctx.kv.scatter_ref.scatter_req_token_ids_torch_reference(**dict(ref_args, pool_out=want))
    ctx.kv.scatter.launch_scatter_req_token_ids_kernel(**vars(case))
    assert torch.equal(case.pool_out.cpu(), want), "bs=511"
    case = make_scatter_case(600, seed=3, device=ctx.device)
    try:
        ctx.kv.scatter.launch_scatter_req_token_ids_kernel(**vars(case))
    except ValueError as err:
        assert "exceeds BATCH_BLOCK=512" in str(err), err
        return "bs 511 equals the reference; bs 600 raises sglang's cap error"
    raise AssertionError("unpatched sglang scatter accepted bs=600")


def within_caps_plan(ctx: Ctx) -> str:
    sizes = (1, 300) if ctx.quick else (1, 37, 300, 4096)
    for bs in sizes:
        for variant in VARIANTS:
            case = _case(ctx, bs, variant, seed=bs + 11)
            want = _plan(ctx, ctx.kv.api.launch_canary_plan_kernels, case, device=ctx.device)
            with integration.applied():
                got = _plan(ctx, ctx.kv.api.launch_canary_plan_kernels, case, device=ctx.device)
            assert_plans_identical(got[0], want[0], f"bs={bs} {variant} verify plan")
            assert_plans_identical(got[1], want[1], f"bs={bs} {variant} write plan")
    return f"bs {sizes} x {sorted(VARIANTS)}: identical, poisoned tails included"


def loose_arguments(ctx: Ctx) -> str:
    """Each argument sglang reads more loosely than ``plan_offsets``: patched, the call plans
    what unpatched sglang plans, byte for byte, poisoned tails included. ``LOOSE`` by both
    ``ROUTES`` (the patched plan function, and sglang's own held from before the patch, whose
    body calls the patched offsets launcher); ``OFFSETS_SCALARS`` through sglang's offsets
    launcher (sglang's Triton kernel, unpatched)."""
    case = _case(ctx, 37, "expected", seed=5)
    for loose, value in sorted(LOOSE.items()):
        for route in ROUTES:
            over = value(case.total_verify() + 3)
            plans_patched_vs_unpatched(ctx.kv, case, route, ctx.device, label=loose, **over)
    swa = _case(ctx, 37, "swa", seed=5)
    for name, scalars in sorted(OFFSETS_SCALARS.items()):
        offsets_patched_vs_unpatched(ctx.kv, swa, scalars, ctx.device, label=name)
    return (
        f"{sorted(LOOSE)} by both routes, and sglang's offsets launcher with "
        f"{sorted(OFFSETS_SCALARS)}: patched == unpatched"
    )


PAST_INT32 = 2**31 + 1  # verify entries: sglang's plan length for a pool of 715 827 883 slots
PAST_INT32_BYTES = len(VERIFY_ENTRIES) * 8 * PAST_INT32  # 64 GiB of int64 entries


def _plan_seen(verify, write, n: int) -> tuple[dict, bool]:
    """What a plan call left: its first ``n`` entries, scalars and write plan (copied to the
    CPU); and whether every entry from ``n`` on is still poison."""
    seen = {name: getattr(verify, name)[:n] for name in VERIFY_ENTRIES}
    seen.update(num_valid=verify.verify_num_valid, enable=verify.enable)
    seen.update(plan_tensors(write))
    seen = {name: t.to("cpu", copy=True) for name, t in seen.items()}  # a copy on any device
    tails = all(not (getattr(verify, name)[n:] != POISON64).any() for name in VERIFY_ENTRIES)
    return seen, tails


def verify_plan_past_int32(ctx: Ctx) -> str:
    """A verify plan of ``2**31 + 1`` entries (64 GiB), sglang's own CUDA entries kernel
    writing it: patched, the step plans what unpatched sglang plans, byte for byte (its first
    entries past the step's count, the scalars, the write plan), and neither writes an entry
    past them; by both ``ROUTES``. ``tests/sglang/test_sglang_plan.py`` checks the same on
    the CPU with stride-0 stand-ins. A ``Skipped`` where the GPU has not the memory free."""
    if ctx.device != "cuda":
        raise Skipped("on the CPU: needs 64 GiB of plan")
    torch.cuda.empty_cache()  # what earlier checks left cached counts as free here
    free = torch.cuda.mem_get_info()[0]
    if free < PAST_INT32_BYTES + 2**33:
        raise Skipped(f"{free / 2**30:.0f} GiB free, needs 72")
    kv, held = ctx.kv, ctx.kv.api.launch_canary_plan_kernels
    case = _case(ctx, 37, "expected", seed=5)
    n, count = case.total_verify() + 64, case.total_verify()
    verify, write = poisoned_plans(
        kv, verify_capacity=PAST_INT32, write_req_capacity=37, device=ctx.device
    )
    seen = {}
    for route in ("unpatched", *ROUTES):
        for name in VERIFY_ENTRIES:
            poison(getattr(verify, name)[:n])
        for t in (verify.verify_num_valid, verify.enable, *plan_tensors(write).values()):
            poison(t)
        with maybe_applied(route != "unpatched"):
            plan_function(kv, route, held)(**case.kwargs(verify, write))
        torch.cuda.synchronize()
        seen[route], tails = _plan_seen(verify, write, n)
        assert tails, f"{route}: an entry past the step's count written"
    del verify, write
    torch.cuda.empty_cache()  # the 64 GiB back before the later checks
    want = seen["unpatched"]
    assert int(want["num_valid"][0]) == count and int(want["enable"][0]) == 1, want["num_valid"]
    for route in ROUTES:
        for name, t in seen[route].items():
            assert torch.equal(t, want[name]), f"{route}: {name} {t[:8]} != {want[name][:8]}"
    return f"{PAST_INT32} entries, step of {count}: {ROUTES} == unpatched, past them untouched"


def within_caps_scatter(ctx: Ctx) -> str:
    for bs in (1, 300, 511):
        case = make_scatter_case(bs, seed=bs, device=ctx.device)
        want = case.pool_out.clone()
        ctx.kv.scatter.launch_scatter_req_token_ids_kernel(**dict(vars(case), pool_out=want))
        got = case.pool_out.clone()
        with integration.applied():
            ctx.kv.scatter.launch_scatter_req_token_ids_kernel(**dict(vars(case), pool_out=got))
        assert torch.equal(got, want), f"bs={bs}"
    return "bs 1, 300, 511 identical"


def _beyond_sizes(ctx: Ctx) -> list[int]:
    sizes = [512, 4097] if ctx.quick else [512, 4097, 20000, 50000]
    return sorted({*sizes, ctx.max_bs})


def beyond_caps_plan(ctx: Ctx) -> str:
    fn = ctx.kv.api.launch_canary_plan_kernels
    for bs in _beyond_sizes(ctx):
        for variant in ("plain", "expected") if bs == ctx.max_bs else VARIANTS:
            _vs_reference(ctx, _case(ctx, bs, variant, seed=bs + len(variant)), fn)
    return f"bs {_beyond_sizes(ctx)} equal sglang's torch reference"


def beyond_caps_scatter(ctx: Ctx) -> str:
    for bs in _beyond_sizes(ctx):
        case = make_scatter_case(bs, seed=bs, max_len=3, device=ctx.device)
        want = case.pool_out.cpu()
        cpu = {k: v.cpu() for k, v in vars(case).items()}
        ctx.kv.scatter_ref.scatter_req_token_ids_torch_reference(**dict(cpu, pool_out=want))
        ctx.kv.scatter.launch_scatter_req_token_ids_kernel(**vars(case))
        assert torch.equal(case.pool_out.cpu(), want), f"bs={bs}"
    return f"bs {_beyond_sizes(ctx)} equal sglang's torch reference"


def sglang_helpers(ctx: Ctx) -> str:
    kv = ctx.kv
    diff, inv = kv.differential, kv.invariants.PlanInvariants

    def draw(r: random.Random):
        bs = r.randint(4097, 6000 if ctx.quick else 40000)
        case = make_plan_case(bs, seed=r.randint(0, 2**31), device=ctx.device, swa=r.choice([0, 3]))
        return case, r.choice([0, 17, -1])

    def run_one(drawn) -> None:
        case, delta = drawn
        cap = max(case.total_verify() + delta, 1)
        pairs = tuple(
            poisoned_plans(kv, verify_capacity=cap, write_req_capacity=case.bs, device=ctx.device)
            for _ in range(2)
        )
        extras = tuple(torch.zeros(0, dtype=torch.int64, device=ctx.device) for _ in range(4))
        common = dict(
            req_pool_indices=case.req_pool_indices,
            prefix_lens=case.prefix_lens,
            extend_seq_lens=case.extend_seq_lens,
            swa_window_size=case.swa_window_size,
        )
        diff.run_plan_diff(
            plan_pair=pairs,
            req_to_token=case.req_to_token,
            extras=extras,
            full_to_swa_index_mapping=case.lut,
            **common,
        )
        inv.assert_all(
            verify_plan=pairs[0][0],
            write_plan=pairs[0][1],
            extras_slot_indices=extras[0],
            extras_positions=extras[1],
            extras_prev_slot_indices=extras[2],
            extras_count=0,
            **common,
        )

    assert diff.launch_canary_plan_kernels is kv.api.launch_canary_plan_kernels
    kv.fuzz_driver.run_fuzz_combo(
        0, draw_fn=draw, run_one_fn=run_one, summarize_fn=lambda d: f"bs={d[0].bs}", n_iter=4
    )
    return "4 fuzz iterations at bs 4097+: differential and invariants hold"


def _expect_reference(kv, case, verify, write, cap: int) -> None:
    """``verify``/``write`` (on the GPU) hold sglang's torch reference plan of ``case``."""
    want = poisoned_plans(kv, verify_capacity=cap, write_req_capacity=case.bs, device="cpu")
    kv.plan_ref.launch_canary_plan_kernels_torch_reference(**_cpu(case).kwargs(*want))
    n = int(want[0].verify_num_valid[0])
    for field in ("verify_num_valid", "enable"):
        assert torch.equal(getattr(verify, field).cpu(), getattr(want[0], field)), field
    for field in VERIFY_ENTRIES:
        assert torch.equal(getattr(verify, field)[:n].cpu(), getattr(want[0], field)[:n]), field
    got_w = write.write_offsets[: case.bs + 1].cpu()
    assert torch.equal(got_w, want[1].write_offsets[: case.bs + 1]), "write_offsets"
    got_s = write.write_seed_slot_indices[: case.bs].cpu()
    assert torch.equal(got_s, want[1].write_seed_slot_indices[: case.bs]), "seeds"


def _graph_replays_new_inputs(kv, bs: int, device: str, seeds: tuple[int, int]) -> None:
    """Capture the patched plan at ``bs`` (its scratch taken inside the capture), copy new
    inputs into the captured ones, replay: the reference plan of the new inputs."""
    dev = torch.device(device)
    cases = [make_plan_case(bs, seed=s, device=device, expected=True) for s in seeds]
    cap = max(c.total_verify() for c in cases) + 5
    static = cases[0]
    verify, write = poisoned_plans(kv, verify_capacity=cap, write_req_capacity=bs, device=dev)
    fn = kv.api.launch_canary_plan_kernels
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn(**static.kwargs(verify, write))  # warm-up (JIT, Triton compile) outside capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn(**static.kwargs(verify, write))
    for name in PLAN_CASE_INPUTS:
        getattr(static, name).copy_(getattr(cases[1], name))
    graph.replay()
    torch.cuda.synchronize()
    _expect_reference(kv, cases[1], verify, write, cap)


PLAN_CASE_INPUTS = (
    "req_pool_indices",
    "prefix_lens",
    "extend_seq_lens",
    "req_to_token",
    "expected_tokens",
    "valid_lens",
)


def cuda_graph(ctx: Ctx) -> str:
    """Graphs of the patched plan at 8 192 and at 131 073 requests (past every cap; each call
    allocates its own scratch, inside the capture too) replay on new inputs; and two plan calls
    on two streams at once each give their own reference plan."""
    kv = ctx.kv
    _graph_replays_new_inputs(kv, 8192, ctx.device, (1, 2))
    big = 131_073 if not ctx.quick else 4097
    _graph_replays_new_inputs(kv, big, ctx.device, (3, 4))
    cases = [make_plan_case(n, seed=n, device=ctx.device, expected=True) for n in (50_000, 70_000)]
    caps = [c.total_verify() + 5 for c in cases]
    plans = [
        poisoned_plans(kv, verify_capacity=cap, write_req_capacity=c.bs, device=ctx.device)
        for c, cap in zip(cases, caps, strict=True)
    ]
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    torch.cuda.synchronize()
    for stream, case, plan in zip(streams, cases, plans, strict=True):
        with torch.cuda.stream(stream):
            kv.api.launch_canary_plan_kernels(**case.kwargs(*plan))
    torch.cuda.synchronize()
    for case, plan, cap in zip(cases, plans, caps, strict=True):
        _expect_reference(kv, case, *plan, cap)
    return (
        f"bs 8192 and {big}: replays on new inputs equal the reference; bs 50 000 and 70 000 "
        "on two streams at once each equal theirs"
    )


def end_to_end(ctx: Ctx) -> str:
    kv, details = ctx.kv, []
    sizes = [600] if ctx.quick else sorted({600, 5000, ctx.max_bs})
    bits = kv.consts.FailReason
    for n in sizes:
        run = CanaryRun(kv, n=n, context=8, device=ctx.device, seed=n)
        rows = torch.randperm(n, generator=torch.Generator().manual_seed(n)) + 1
        prefill = torch.randint(1, 4, (n,), generator=torch.Generator().manual_seed(1))
        assert run.step(rows, prefill) == [], "prefill reported violations"
        ones = torch.ones(n, dtype=torch.int64)
        assert run.step(rows, ones) == [], "clean decode reported violations"
        kv_at = (int(rows[n // 3]), 1)
        tok_at = (int(rows[-1]), 0)
        found = run.step(rows, ones, corrupt=dict(kv=kv_at, token=tok_at))
        kv_rows = [v for v in found if v[2] & int(bits.VERIFY_REAL_KV_HASH_MISMATCH)]
        tok_rows = [v for v in found if v[2] & int(bits.VERIFY_TOKEN_MISMATCH)]
        assert len(kv_rows) + len(tok_rows) == len(found) == 2, found
        assert (kv_rows[0][0], kv_rows[0][1]) == (run.slot(*kv_at), kv_at[1]), kv_rows
        assert (tok_rows[0][0], tok_rows[0][1]) == (run.slot(*tok_at), tok_at[1]), tok_rows
        assert tok_rows[0][3] == int(run.tokens[tok_at]) + 1, tok_rows
        details.append(f"bs {n}: 2 clean steps, both corruptions reported where injected")
    return "; ".join(details)
