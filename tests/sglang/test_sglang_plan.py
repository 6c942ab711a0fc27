"""sglang's ``launch_canary_plan_kernels``, patched: equal to sglang's own kernel path within
its cap (byte for byte, poisoned outputs, the scratch too), to sglang's torch reference beyond
it, through sglang's shipped test helpers, with a capture-safe scratch.

On the CPU the kernel path is forced (``use_kernel_path``): sglang's Triton offsets kernel
(unpatched) or ours (patched) runs under Triton's interpreter, and ``entries_standin`` takes
the place of sglang's CUDA-JIT entries kernel. tests/gpu/sglang_cuda.py runs the real one.
"""

from __future__ import annotations

import functools
import random
from dataclasses import dataclass, replace

import pytest
import torch
from _sglang_cases import (
    ENTRIES_SCRATCH,
    POISON64,
    ROUTES,
    VERIFY_ENTRIES,
    assert_plans_identical,
    entries_standin,
    make_plan_case,
    maybe_applied,
    plan_function,
    poisoned_plans,
    record_entries,
)

from kvcanary_dispatch.integrations import _sglang_plan
from kvcanary_dispatch.integrations import sglang as integration

pytest_plugins = ["_sglang_fixtures"]  # the kv fixture, and a clean patch state per test

VARIANTS = {
    "plain": dict(),
    "swa": dict(swa=2),
    "expected": dict(expected=True, kv_offset=1),
    "overflow": dict(expected=True),
}


def _run(kv, fn, case, *, cap_delta: int, write_cap: int):
    """Call ``fn`` (a binding of the plan API) on ``case`` into freshly poisoned plans."""
    cap = max(case.total_verify() + cap_delta, 1)
    verify, write = poisoned_plans(kv, verify_capacity=cap, write_req_capacity=write_cap)
    fn(**case.kwargs(verify, write))
    return verify, write


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("bs", [0, 1, 37, 300, 4096])
def test_within_cap_patched_equals_unpatched_byte_for_byte(forced, bs, variant):
    kv = forced
    case = make_plan_case(bs, seed=bs * 7 + len(variant), **VARIANTS[variant])
    overflow = variant == "overflow" and case.total_verify() > 1  # capacity >= 1
    delta = -1 if overflow else 3
    want = _run(kv, kv.api.launch_canary_plan_kernels, case, cap_delta=delta, write_cap=bs + 5)
    with integration.applied():
        got = _run(
            kv,
            kv.kernel_launcher.launch_canary_plan_kernels,
            case,
            cap_delta=delta,
            write_cap=bs + 5,
        )
    assert_plans_identical(got[0], want[0], "verify plan")
    assert_plans_identical(got[1], want[1], "write plan")
    sglang_scratch, our_scratch = ENTRIES_SCRATCH
    assert torch.equal(our_scratch, sglang_scratch), "verify offsets differ"
    if overflow:
        assert int(got[0].enable[0]) == 0


@pytest.mark.parametrize("bs", [512, 513, 4097, 20000])
@pytest.mark.parametrize("variant", ["plain", "expected"])
def test_beyond_cap_equals_sglangs_torch_reference(forced, bs, variant):
    kv = forced
    case = make_plan_case(bs, seed=bs + len(variant), **VARIANTS[variant])
    want = _run(
        kv,
        kv.plan_ref.launch_canary_plan_kernels_torch_reference,
        case,
        cap_delta=0,
        write_cap=bs + 2,
    )
    with integration.applied():
        for binding in (kv.api, kv.plan_pkg, kv.kernel_launcher):
            got = _run(kv, binding.launch_canary_plan_kernels, case, cap_delta=0, write_cap=bs + 2)
            assert_plans_identical(got[0], want[0], f"{binding.__name__} verify plan")
            assert_plans_identical(got[1], want[1], f"{binding.__name__} write plan")
    assert int(want[0].enable[0]) == 1 and int(want[1].write_num_valid_reqs[0]) == bs


@pytest.mark.parametrize("bs", [0, 37, 5000])
def test_each_patched_call_plans_into_a_scratch_of_bs_plus_1(forced, monkeypatch, bs):
    """The verify-offsets scratch the patched plan hands sglang's entries step holds exactly
    ``bs + 1`` offsets (not sglang's fixed 4 097, nor a bound of any other size), on the
    plan's device, allocated afresh for each call."""
    kv = forced
    case = make_plan_case(bs, seed=bs + 1)
    scratches = []
    standin = kv.api.launch_plan_entries_kernel

    @functools.wraps(standin)  # the parameters apply() checks
    def recording(**kwargs):
        scratches.append(kwargs["verify_offsets_scratch"])
        return standin(**kwargs)

    monkeypatch.setattr(kv.api, "launch_plan_entries_kernel", recording)
    with integration.applied():
        for _ in range(2):
            _run(
                kv,
                kv.kernel_launcher.launch_canary_plan_kernels,
                case,
                cap_delta=0,
                write_cap=bs + 1,
            )
    assert [tuple(s.shape) for s in scratches] == [(bs + 1,)] * 2
    assert all(
        s.dtype == torch.int64 and s.device == case.req_pool_indices.device for s in scratches
    )
    assert scratches[0] is not scratches[1]


def test_swa_beyond_cap_equals_sglangs_torch_reference(forced):
    case = make_plan_case(4500, seed=11, swa=2, expected=True)
    want = _run(
        forced,
        forced.plan_ref.launch_canary_plan_kernels_torch_reference,
        case,
        cap_delta=2,
        write_cap=4500,
    )
    with integration.applied():
        got = _run(
            forced,
            forced.kernel_launcher.launch_canary_plan_kernels,
            case,
            cap_delta=2,
            write_cap=4500,
        )
    assert_plans_identical(got[0], want[0], "verify plan")
    assert_plans_identical(got[1], want[1], "write plan")


def test_non_cuda_device_keeps_sglangs_torch_reference(kv, monkeypatch):
    """Without forcing, a CPU plan goes to sglang's torch reference, patched or not: the
    entries kernel's stand-in, which records each call, is installed and never called."""
    record_entries(monkeypatch, kv)
    ENTRIES_SCRATCH.clear()
    case = make_plan_case(5000, seed=3, expected=True)
    want = _run(kv, kv.api.launch_canary_plan_kernels, case, cap_delta=1, write_cap=5000)
    with integration.applied():
        got = _run(
            kv, kv.kernel_launcher.launch_canary_plan_kernels, case, cap_delta=1, write_cap=5000
        )
    assert ENTRIES_SCRATCH == [], "the kernel path ran on a non-CUDA device"
    assert_plans_identical(got[0], want[0], "verify plan")
    assert_plans_identical(got[1], want[1], "write plan")


@pytest.mark.parametrize("route", ROUTES)
def test_a_verify_plan_past_int32_plans_as_sglang_does(forced, monkeypatch, route):
    """A verify plan of ``2**31 + 1`` entries (sglang's length for a pool of 715 827 883
    slots), which ``plan_offsets`` alone would refuse as a capacity: patched, the call plans
    what unpatched sglang plans, byte for byte: the write plan, the verify count and enable,
    and the verify offsets handed to sglang's entries step. The plan's entries are stride-0
    stand-ins (a plan that long would take 64 GiB) that the recording entries step leaves as
    they were. Either route."""
    kv = forced
    held = kv.api.launch_canary_plan_kernels
    case = make_plan_case(37, seed=5)
    handed: list[tuple[torch.Tensor, torch.Tensor]] = []

    @functools.wraps(entries_standin)  # its signature, which apply() checks
    def entries(**kw) -> None:
        handed.append(
            (kw["verify_offsets_scratch"][: case.bs + 1].clone(), kw["verify_enable"].clone())
        )

    monkeypatch.setattr(kv.api, "launch_plan_entries_kernel", entries)
    # The stand-ins are stride 0, which sglang's entries kernel refuses (the patch checks it
    # first): lifted here, where the plan is what is tested.
    monkeypatch.setattr(_sglang_plan, "require_contiguous", lambda tensors: None)
    plans = []
    for applied in (False, True):
        verify, write = poisoned_plans(kv, verify_capacity=1, write_req_capacity=37)
        long = {n: getattr(verify, n).expand(2**31 + 1) for n in VERIFY_ENTRIES}
        verify = replace(verify, **long)
        with maybe_applied(applied):
            plan_function(kv, route, held)(**case.kwargs(verify, write))
        plans.append((verify, write))
    assert_plans_identical(plans[1][1], plans[0][1], "write plan")
    for (verify, _), (offsets, enable) in zip(plans, handed, strict=True):
        assert int(verify.enable[0]) == int(enable[0]) == 1 and int(offsets[-1]) > 0
        assert int(verify.verify_num_valid[0]) == int(offsets[-1]) == case.total_verify()
        assert all(int(getattr(verify, n)[0]) == POISON64 for n in VERIFY_ENTRIES)
    assert torch.equal(handed[1][0], handed[0][0])


def test_a_call_between_another_calls_two_kernels_changes_nothing(forced, monkeypatch):
    """Two plan calls whose kernels interleave (two streams or threads on one device): call B
    runs whole between call A's offsets kernel and its entries kernel. Each call has its own
    scratch, as unpatched sglang's has, so both equal sglang's torch reference (a scratch
    shared by the device would hand A's entries B's offsets)."""
    kv = forced
    cases = {
        "A": make_plan_case(6, seed=1, padding=0.0, max_prefix=6),
        "B": make_plan_case(9, seed=2, max_prefix=6),
    }

    def poisoned(case):
        return poisoned_plans(kv, verify_capacity=case.total_verify() + 1, write_req_capacity=9)

    plans = {k: poisoned(c) for k, c in cases.items()}
    wants = {k: poisoned(c) for k, c in cases.items()}
    for k, c in cases.items():
        kv.plan_ref.launch_canary_plan_kernels_torch_reference(**c.kwargs(*wants[k]))
    entries = kv.api.launch_plan_entries_kernel
    order = []

    def interleaved(**kw):
        if not order:  # A's entries: first run B whole
            order.append("B")
            kv.kernel_launcher.launch_canary_plan_kernels(**cases["B"].kwargs(*plans["B"]))
        order.append(int(kw["req_pool_indices"].shape[0]))
        return entries(**kw)

    with integration.applied():  # then the entries step, looked up at call time
        monkeypatch.setattr(kv.api, "launch_plan_entries_kernel", interleaved)
        kv.kernel_launcher.launch_canary_plan_kernels(**cases["A"].kwargs(*plans["A"]))
    assert order == ["B", 9, 6], order
    for k in cases:
        assert_plans_identical(plans[k][0], wants[k][0], f"verify plan of {k}")
        assert_plans_identical(plans[k][1], wants[k][1], f"write plan of {k}")


def test_reserving_a_scratch_is_deprecated_and_does_nothing():
    with pytest.warns(DeprecationWarning, match="no longer needed and does nothing"):
        assert integration.reserve_verify_offsets_scratch("cpu", max_bs=100_000) is None


@dataclass
class _FuzzInputs:
    req_pool_indices: torch.Tensor
    prefix_lens: torch.Tensor
    extend_seq_lens: torch.Tensor
    req_to_token: torch.Tensor
    swa_window_size: int
    full_to_swa_index_mapping: torch.Tensor | None
    verify_capacity: int
    write_req_capacity: int


def test_sglangs_own_helpers_beyond_the_cap(forced):
    """sglang's differential (plan vs its torch reference), plan invariants and fuzz driver,
    with the patched function bound in sglang's ``_differential`` module, at bs > 4096."""
    kv = forced

    def draw(r: random.Random) -> _FuzzInputs:
        bs = r.randint(4097, 6000)
        swa = r.choice([0, 3])
        case = make_plan_case(bs, seed=r.randint(0, 2**31), swa=swa, padding=r.random() * 0.5)
        total = case.total_verify()
        return _FuzzInputs(
            case.req_pool_indices,
            case.prefix_lens,
            case.extend_seq_lens,
            case.req_to_token,
            swa,
            case.lut,
            r.choice([total, total + 17, max(total - 1, 1)]),
            bs + r.randint(0, 3),
        )

    def run_one(i: _FuzzInputs) -> None:
        pairs = tuple(
            poisoned_plans(
                kv, verify_capacity=i.verify_capacity, write_req_capacity=i.write_req_capacity
            )
            for _ in range(2)
        )
        extras = tuple(torch.zeros(0, dtype=torch.int64) for _ in range(4))
        kv.differential.run_plan_diff(
            plan_pair=pairs,
            req_pool_indices=i.req_pool_indices,
            prefix_lens=i.prefix_lens,
            extend_seq_lens=i.extend_seq_lens,
            req_to_token=i.req_to_token,
            extras=extras,
            swa_window_size=i.swa_window_size,
            full_to_swa_index_mapping=i.full_to_swa_index_mapping,
        )
        kv.invariants.PlanInvariants.assert_all(
            verify_plan=pairs[0][0],
            write_plan=pairs[0][1],
            req_pool_indices=i.req_pool_indices,
            prefix_lens=i.prefix_lens,
            extend_seq_lens=i.extend_seq_lens,
            swa_window_size=i.swa_window_size,
            extras_slot_indices=extras[0],
            extras_positions=extras[1],
            extras_prev_slot_indices=extras[2],
            extras_count=0,
        )

    def summarize(i: _FuzzInputs) -> str:
        return f"bs={i.req_pool_indices.numel()} swa={i.swa_window_size} cap={i.verify_capacity}"

    with pytest.raises(ValueError, match="at most bs=4096"):
        run_one(draw(random.Random(0)))  # unpatched: sglang's own cap
    with integration.applied():
        assert kv.differential.launch_canary_plan_kernels is kv.api.launch_canary_plan_kernels
        kv.fuzz_driver.run_fuzz_combo(
            0, draw_fn=draw, run_one_fn=run_one, summarize_fn=summarize, n_iter=3
        )
