"""sglang's ``launch_canary_plan_kernels`` and ``launch_plan_offsets_kernel``, patched, given
faulty or loosely typed arguments: each fault refused with sglang's type and text, before any
plan or sglang's entries step changes; each argument sglang reads loosely read as sglang reads
it, every output byte for byte. On the CPU, with the kernel path forced as in
``test_sglang_plan.py``.
"""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from _sglang_cases import (
    ENTRIES_SCRATCH,
    LOOSE,
    OFFSETS_SCALARS,
    ROUTES,
    make_plan_case,
    maybe_applied,
    offsets_outputs,
    offsets_patched_vs_unpatched,
    plan_tensors,
    plans_patched_vs_unpatched,
    poisoned_plans,
    record_entries,
)

from kvcanary_dispatch import CapacityError
from kvcanary_dispatch.integrations import sglang as integration

pytest_plugins = ["_sglang_fixtures"]  # the kv fixture, and a clean patch state per test


def test_errors_match_sglangs(forced):
    kv = forced
    case = make_plan_case(10, seed=4)
    cases = [
        (
            dict(swa_window_size=3, full_to_swa_index_mapping=None),
            "requires full_to_swa_index_mapping",
        ),
        (  # the smallest window that needs the mapping
            dict(swa_window_size=1, full_to_swa_index_mapping=None),
            "requires full_to_swa_index_mapping",
        ),
        (dict(verify_capacity=12345), "verify_capacity=12345 does not match"),
        (  # sglang's two checks come before the patch's of the write plan
            dict(swa_window_size=3, full_to_swa_index_mapping=None, write_plan_out=None),
            "requires full_to_swa_index_mapping",
        ),
    ]
    for override, message in cases:
        for applied in (False, True):
            verify, write = poisoned_plans(kv, verify_capacity=50, write_req_capacity=10)
            kwargs = dict(case.kwargs(verify, write), **override)
            with maybe_applied(applied):
                with pytest.raises(ValueError, match=message):
                    kv.kernel_launcher.launch_canary_plan_kernels(**kwargs)


def _plans_copied(*plans) -> list[dict[str, torch.Tensor]]:
    """A copy of each plan's tensors, by field name."""
    return [
        {n: t.clone() for n, t in plan_tensors(p).items() if isinstance(t, torch.Tensor)}
        for p in plans
    ]


def _assert_plans_kept(plans, was: list[dict[str, torch.Tensor]]) -> None:
    """Each plan's tensors equal, byte for byte, the copies ``_plans_copied`` took."""
    for plan, kept in zip(plans, was, strict=True):
        for name, t in kept.items():
            assert torch.equal(getattr(plan, name), t), f"{name} changed by a refused call"


REFUSED = {  # a fault in sglang's plans, what the refusal must say, and its type
    "capacity": (
        lambda v, w: (v, w),  # 4 requests' room for 10
        "kv-canary: bs=10 exceeds write_req_capacity=4; allocate write_plan_out for at least "
        "bs requests (WritePlan.allocate(write_req_capacity=...)); in a server, "
        'kvcanary_dispatch.integrations.sglang.apply(policy="grow" or "skip") grows or skips '
        "the eager steps that outgrow it (not the steps captured in a CUDA graph)",
        CapacityError,
    ),
    "dtype": (
        lambda v, w: (replace(v, enable=v.enable.long()), w),
        "verify_plan_out.enable must have dtype torch.int32, got torch.int64",
        ValueError,
    ),
    "offsets dtype": (
        lambda v, w: (v, replace(w, write_offsets=w.write_offsets.int())),
        "write_plan_out.write_offsets must have dtype torch.int64, got torch.int32",
        ValueError,
    ),
    "not a tensor": (
        lambda v, w: (v, replace(w, write_seed_slot_indices=w.write_seed_slot_indices.tolist())),
        "write_plan_out.write_seed_slot_indices must be a torch.Tensor, got list",
        TypeError,
    ),
    "shared": (
        lambda v, w: (v, replace(w, write_num_valid_reqs=v.verify_num_valid)),
        "launch_canary_plan_kernels verify_plan_out.verify_num_valid shares memory with "
        "write_plan_out.write_num_valid_reqs",
        ValueError,
    ),
}


@pytest.mark.parametrize("fault", sorted(REFUSED))
def test_a_refused_call_changes_no_plan_and_names_sglangs_arguments(forced, fault):
    """Patched, a call the plan refuses leaves both plans as they were, byte for byte (the write
    offsets past the batch are zeroed only once every check has passed; sglang zeroes them all
    before its kernel's checks), and its message names the plans' fields the caller passed,
    not ``plan_offsets``' parameters."""
    kv = forced
    case = make_plan_case(10, seed=4)
    room = 4 if fault == "capacity" else 10
    verify, write = poisoned_plans(kv, verify_capacity=case.total_verify(), write_req_capacity=room)
    fault_in, text, kind = REFUSED[fault]
    verify, write = fault_in(verify, write)
    was = _plans_copied(verify, write)
    with integration.applied(), pytest.raises(kind) as err:
        kv.kernel_launcher.launch_canary_plan_kernels(**case.kwargs(verify, write))
    assert text in str(err.value), str(err.value)
    assert "out_" not in str(err.value), str(err.value)
    # The refusal itself, reworded: its type and the frames below the patch kept.
    assert type(err.value) is kind
    assert err.traceback[-1].path.name != "_sglang_plan.py", err.traceback[-1]
    _assert_plans_kept((verify, write), was)


def _short(t: torch.Tensor) -> torch.Tensor:
    return t[:-1]


def _int32(verify_plan) -> torch.Tensor:
    return verify_plan.verify_expected_tokens.int()


def _short_prev(verify_plan) -> torch.Tensor:
    return _short(verify_plan.verify_prev_slot_indices)


def _strided(verify_plan) -> torch.Tensor:
    t = verify_plan.verify_expected_positions
    return t.repeat_interleave(2)[::2]  # the same values, every other element of a copy


def _refused_before_the_plan(kv, kwargs: dict, plans: tuple, text: str, kind: type) -> None:
    """Patched, ``launch_canary_plan_kernels(**kwargs)`` raises ``kind`` (itself) saying
    ``text``, before sglang's entries step runs, and leaves ``plans`` as they were."""
    was = _plans_copied(*plans)
    ENTRIES_SCRATCH.clear()
    with integration.applied(), pytest.raises(kind) as err:
        kv.kernel_launcher.launch_canary_plan_kernels(**kwargs)
    assert type(err.value) is kind
    assert text in str(err.value), str(err.value)
    assert ENTRIES_SCRATCH == [], "the entries step ran"
    _assert_plans_kept(plans, was)


POOL, LENS = "req_to_verify_expected_tokens", "req_to_verify_expected_tokens_valid_lens"
ENTRIES_REFUSED = {  # a fault only sglang's entries step sees: (verify plan, keywords) -> both
    "entry dtype": lambda v, kw: (replace(v, verify_expected_tokens=_int32(v)), kw),
    "entry length": lambda v, kw: (replace(v, verify_prev_slot_indices=_short_prev(v)), kw),
    "entry strided": lambda v, kw: (replace(v, verify_expected_positions=_strided(v)), kw),
    "pool without lengths": lambda v, kw: (v, {**kw, LENS: None}),
    "pool dtype": lambda v, kw: (v, {**kw, POOL: kw[POOL].long()}),
    "lengths short": lambda v, kw: (v, {**kw, LENS: _short(kw[LENS])}),
    "offset None": lambda v, kw: (v, {**kw, "kv_token_id_vs_position_offset": None}),
    "offset past int32": lambda v, kw: (v, {**kw, "kv_token_id_vs_position_offset": 2**31}),
    "entry 2-D": lambda v, kw: (replace(v, verify_slot_indices=v.verify_slot_indices[:, None]), kw),
    "pool 3-D": lambda v, kw: (v, {**kw, POOL: kw[POOL][None]}),
    "lengths elsewhere": lambda v, kw: (v, {**kw, LENS: kw[LENS].to("meta")}),
}  # fmt: skip
ENTRIES_TEXT = {  # what each refusal says, and its type
    "entry 2-D": ("verify_plan_out.verify_slot_indices must be 1-D, got shape (", ValueError),
    "pool 3-D": (f"{POOL} must be 2-D, got shape (1, ", ValueError),
    "lengths elsewhere": (
        f"{LENS} must be on verify_plan_out.verify_slot_indices's device cpu, got meta; "
        f"pass {LENS}.to(verify_plan_out.verify_slot_indices.device)",
        ValueError,
    ),
    "entry dtype": (
        "verify_plan_out.verify_expected_tokens must have dtype torch.int64, got torch.int32",
        ValueError,
    ),
    "entry length": ("verify_plan_out.verify_prev_slot_indices length must be ", ValueError),
    "entry strided": ("verify_plan_out.verify_expected_positions must be contiguous", ValueError),
    "pool without lengths": (
        f"launch_plan_entries_kernel requires {LENS} when {POOL} is set",
        ValueError,
    ),
    "pool dtype": (f"{POOL} must have dtype torch.int32, got torch.int64", ValueError),
    "lengths short": (f"{LENS} length must be 10, got 9", ValueError),
    "offset None": ("launch_canary_plan_kernels kv_token_id_vs_position_offset=None: ", TypeError),
    "offset past int32": (
        "kv_token_id_vs_position_offset=2147483648 does not fit the int32 sglang's entries kernel "
        "takes; pass a value in [-2147483648, 2147483647]",
        ValueError,
    ),
}


@pytest.mark.parametrize("fault", sorted(ENTRIES_REFUSED))
def test_a_fault_only_sglangs_entries_step_sees_is_refused_before_the_plan(forced, fault):
    """Patched, a call that sglang's entries step would refuse (its vectors, the expected-token
    pool and its lengths, the int32 scalars) is refused before the offsets are planned, naming
    the argument, and leaves both plans as they were, byte for byte (sglang's own call has
    written its offsets and scalars by then)."""
    kv = forced
    case = make_plan_case(10, seed=4, expected=True)
    verify, write = poisoned_plans(kv, verify_capacity=case.total_verify(), write_req_capacity=10)
    verify, kwargs = ENTRIES_REFUSED[fault](verify, case.kwargs(verify, write))
    kwargs["verify_plan_out"] = verify
    text, kind = ENTRIES_TEXT[fault]
    _refused_before_the_plan(kv, kwargs, (verify, write), text, kind)


@pytest.mark.parametrize("offset", [2**31 - 1, -(2**31)])
def test_an_offset_at_int32s_ends_plans_as_sglang_does(forced, offset):
    """``kv_token_id_vs_position_offset`` at either end of the int32 sglang's entries kernel
    takes is accepted, and plans what unpatched sglang plans, byte for byte (one past is
    refused: ``ENTRIES_REFUSED``)."""
    case = make_plan_case(10, seed=4, expected=True)
    ENTRIES_SCRATCH.clear()
    plans_patched_vs_unpatched(
        forced, case, ROUTES[0], label=f"offset {offset}", kv_token_id_vs_position_offset=offset
    )
    assert ENTRIES_SCRATCH, "the entries step never ran"


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("loose", sorted(LOOSE))
def test_an_argument_sglang_reads_loosely_plans_as_sglang_does(forced, loose, route):
    """Patched, a call with such an argument plans what unpatched sglang plans, byte for
    byte, by either route."""
    case = make_plan_case(37, seed=5)
    over = LOOSE[loose](case.total_verify() + 3)
    plans_patched_vs_unpatched(forced, case, route, label=loose, **over)


@pytest.mark.parametrize("scalars", sorted(OFFSETS_SCALARS))
def test_sglangs_offsets_launcher_reads_its_scalars_as_sglang_does(forced, scalars):
    """sglang's ``launch_plan_offsets_kernel``, called directly with such a scalar: patched
    (through the binding its plan API calls), every output equals unpatched sglang's, byte for
    byte, the scratch's and the write plan's poisoned tails included."""
    case = make_plan_case(37, seed=5, swa=3)
    offsets_patched_vs_unpatched(forced, case, OFFSETS_SCALARS[scalars], label=scalars)


@pytest.mark.parametrize("capacity", [-0.5, float("-inf"), -1])
def test_sglangs_offsets_launcher_refuses_a_negative_capacity_as_sglang_does(forced, capacity):
    """A ``verify_capacity`` below 0 (a float too): patched, the same ``ValueError`` as
    unpatched sglang's, with the fix after a ``;``."""
    kv = forced
    case = make_plan_case(37, seed=5)
    errors = []
    for applied in (False, True):
        with maybe_applied(applied), pytest.raises(ValueError) as e:
            offsets_outputs(
                kv.api.launch_plan_offsets_kernel, case, lambda t: {"verify_capacity": capacity}
            )
        errors.append(str(e.value))
    assert errors[0] == f"kv-canary: verify_capacity must be non-negative, got {capacity}"
    assert errors[1] == errors[0] + "; pass a non-negative int", errors


def test_sglangs_offsets_launcher_takes_a_numpy_capacity_as_its_int(forced):
    """A numpy integer ``verify_capacity`` (read from a config array): patched, the outputs
    equal unpatched sglang's for the same Python int, byte for byte."""
    kv = forced
    case = make_plan_case(37, seed=5, swa=3)
    want = offsets_outputs(
        kv.api.launch_plan_offsets_kernel, case, lambda total: {"verify_capacity": total - 2}
    )
    with integration.applied():  # the binding looked up while applied, as sglang's API does
        got = offsets_outputs(
            kv.api.launch_plan_offsets_kernel,
            case,
            lambda total: {"verify_capacity": np.int64(total - 2)},
        )
    assert want.keys() == got.keys()
    for name, t in want.items():
        assert torch.equal(got[name], t), name


@pytest.mark.parametrize(
    "capacity, text",
    [
        (float("nan"), "verify_capacity must be an int, got nan (float)"),
        (torch.tensor(60), "verify_capacity must be a Python number, got a tensor; "),
        (np.float32(60.0), "verify_capacity must be an int, got np.float32(60.0) (float32)"),
    ],
    ids=["NaN", "tensor", "numpy float"],
)
def test_sglangs_offsets_launcher_refuses_a_capacity_it_cannot_read(forced, capacity, text):
    """Patched, a ``verify_capacity`` that is NaN, a tensor (reading it would sync) or a numpy
    float is a ``TypeError`` naming it (sglang's own launcher takes NaN, and its kernel fails
    on the other two from inside)."""
    case = make_plan_case(37, seed=5)
    with integration.applied(), pytest.raises(TypeError) as err:
        offsets_outputs(
            forced.api.launch_plan_offsets_kernel, case, lambda total: {"verify_capacity": capacity}
        )
    assert text in str(err.value), str(err.value)


@pytest.mark.parametrize("fault", ["verify plan None", "verify slots None"])
def test_on_sglangs_torch_reference_route_a_verify_plan_is_checked_first(kv, monkeypatch, fault):
    """Off CUDA, where sglang's own torch reference plans, the patched call still reads the
    verify plan's device first: a verify plan that is not one is the same ``TypeError`` as on
    the kernel path (not an ``AttributeError`` from inside), and the write plan is kept."""
    record_entries(monkeypatch, kv)
    case = make_plan_case(10, seed=4)
    verify, write = poisoned_plans(kv, verify_capacity=case.total_verify(), write_req_capacity=10)
    make, text, kind = MALFORMED[fault]
    _refused_before_the_plan(
        kv, make(verify, write, case.kwargs(verify, write)), (write,), text, kind
    )


_VERIFY_FIX = "pass a VerifyPlan.allocate(verify_capacity=..., device=...)"
_WRITE_FIX = "pass a WritePlan.allocate(write_req_capacity=..., device=...)"
MALFORMED = {  # an argument sglang reads before it checks any: (verify, write, keywords) ->
    # keywords, the refusal's text and type (sglang's own call fails with an AttributeError,
    # an IndexError or a bare TypeError from inside)
    "verify plan None": (
        lambda v, w, kw: {**kw, "verify_plan_out": None},
        "verify_plan_out must be sglang's VerifyPlan, got NoneType (no verify_slot_indices); "
        + _VERIFY_FIX,
        TypeError,
    ),
    "verify slots None": (
        lambda v, w, kw: {**kw, "verify_plan_out": replace(v, verify_slot_indices=None)},
        "verify_plan_out.verify_slot_indices must be a torch.Tensor, got NoneType",
        TypeError,
    ),
    "write plan None": (
        lambda v, w, kw: {**kw, "write_plan_out": None},
        "write_plan_out must be sglang's WritePlan, got NoneType (no write_offsets); " + _WRITE_FIX,
        TypeError,
    ),
    "write plan without a field": (
        lambda v, w, kw: {
            **kw,
            "write_plan_out": SimpleNamespace(
                write_offsets=w.write_offsets, write_seed_slot_indices=w.write_seed_slot_indices
            ),
        },
        "write_plan_out must be sglang's WritePlan, got SimpleNamespace (no "
        "write_num_valid_reqs); " + _WRITE_FIX,
        TypeError,
    ),
    "indices None": (
        lambda v, w, kw: {**kw, "req_pool_indices": None},
        "launch_canary_plan_kernels req_pool_indices must be a torch.Tensor, got NoneType",
        TypeError,
    ),
    "indices 0-d": (
        lambda v, w, kw: {**kw, "req_pool_indices": kw["req_pool_indices"][0]},
        "kv-canary: req_pool_indices must be 1-D, got shape ()",
        ValueError,
    ),
    "window None": (
        lambda v, w, kw: {**kw, "swa_window_size": None},
        "launch_canary_plan_kernels swa_window_size=None: ",
        TypeError,
    ),
}


@pytest.mark.parametrize("fault", sorted(MALFORMED))
def test_a_malformed_argument_is_named_and_changes_no_plan(forced, fault):
    """Patched, a plan that is not sglang's (``None``, or missing a field the call reads), a
    verify plan whose slot indices are not a tensor, ``req_pool_indices`` that is not a tensor
    or is 0-d, and a window that cannot be compared are refused with a ``TypeError`` or
    ``ValueError`` naming the argument, where unpatched sglang fails from inside with another
    error or none of these words; neither plan changes."""
    kv = forced
    case = make_plan_case(10, seed=4)
    verify, write = poisoned_plans(kv, verify_capacity=case.total_verify(), write_req_capacity=10)
    make, text, kind = MALFORMED[fault]
    kwargs = make(verify, write, case.kwargs(verify, write))
    _refused_before_the_plan(kv, kwargs, (verify, write), text, kind)
    with pytest.raises(Exception) as theirs:  # (it may zero the write offsets first)
        kv.kernel_launcher.launch_canary_plan_kernels(**kwargs)
    assert text not in str(theirs.value), str(theirs.value)
