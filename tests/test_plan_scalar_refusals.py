"""The plan's two scalars and its settings: ``verify_capacity`` and ``swa_window_size`` that
are not non-negative ints, refused by ``plan_offsets``, the drop-in and the fixed-block launcher
alike, and ``chunk_size`` and ``strategy`` refused by ``check_plan_bundled`` (the check
``ForwardStepGuard`` makes before it grows anything) as ``plan_offsets`` refuses them; each
before any launch, the outputs left as they were."""

from __future__ import annotations

import pytest
import torch
from _helpers import as_kernel_kwargs, dispatch_cases, plan_kwargs, plan_outputs, rejected
from conftest import DEVICE

import kvcanary_dispatch
from kvcanary_dispatch import plan_offsets
from kvcanary_dispatch.plan import check_plan_bundled
from kvcanary_kernels import launch_plan_offsets_kernel as kernel_plan
from kvcanary_kernels.args import bundle_plan_args

_, _plan_case = dispatch_cases(DEVICE)


def _refusals(kind: type[Exception], kw: dict) -> list[str]:
    """The ``kind`` errors' messages of ``plan_offsets``, the drop-in and the fixed-block
    launcher on ``kw`` (``plan_offsets``'s keywords), each raised before any launch with the
    outputs left as they were (``rejected``)."""
    messages = [rejected(kind, lambda: plan_offsets(**kw), plan_outputs(kw))]
    kernel_kw = as_kernel_kwargs(kw)
    outs = [v for k, v in kernel_kw.items() if k.startswith("out_")]
    for fn in (kvcanary_dispatch.launch_plan_offsets_kernel, kernel_plan):
        messages.append(rejected(kind, lambda fn=fn: fn(**kernel_kw), outs))
    return messages


NOT_INTS = {
    "tensor": (lambda v: torch.tensor(v, device=DEVICE), "must be a Python number, got a tensor"),
    "None": (lambda v: None, "must be an int, got None (NoneType); pass a non-negative int"),
    "float": (lambda v: v + 0.5, "must be an int, got "),
    "nan": (lambda v: float("nan"), "must be an int, got nan (float)"),
    "bool": (lambda v: True, "must be an int, got True (bool)"),
    "str": (lambda v: str(v), "must be an int, got '"),
}


@pytest.mark.parametrize("form", NOT_INTS)
@pytest.mark.parametrize("name", ["verify_capacity", "swa_window_size"])
def test_plan_scalars_that_are_not_ints_refused(name, form):
    """A scalar that is not an int is a ``TypeError`` naming it and the fix, from the
    dispatcher, the drop-in and the fixed-block launcher alike, before anything is written: a
    tensor (its value would be read back, a sync, and a failure during capture), ``None`` (a
    model without a window passes 0), a float (truncated, it would plan other offsets than the
    reference), a bool, a string."""
    make, text = NOT_INTS[form]
    kw = plan_kwargs(_plan_case(5))
    kw[name] = make(kw[name])
    want = f"kv-canary: {name} {text}"
    messages = _refusals(TypeError, kw)
    assert all(m.startswith(want) for m in messages), messages


@pytest.mark.parametrize("value", [-0.5, float("-inf"), -3])
@pytest.mark.parametrize("name", ["verify_capacity", "swa_window_size"])
def test_plan_scalars_below_zero_refused_for_their_sign(name, value):
    """A scalar below 0, a float too, is a ``ValueError`` for its sign (sglang's text, at
    sglang's place among the checks), naming the value and the fix, from the dispatcher, the
    drop-in and the fixed-block launcher alike, before anything is written; a float at or
    above 0 is the ``TypeError`` above."""
    kw = plan_kwargs(_plan_case(5))
    kw[name] = value
    fix = "pass a non-negative int" + (" (0 for no window)" if name == "swa_window_size" else "")
    want = f"kv-canary: {name} must be non-negative, got {value}; {fix}"
    assert _refusals(ValueError, kw) == [want] * 3


@pytest.mark.parametrize(
    "settings",
    [
        {"chunk_size": 0},
        {"chunk_size": -4},
        {"chunk_size": 4097},
        {"chunk_size": 2.5},
        {"chunk_size": True},
        {"strategy": "fastest"},
        {"strategy": None},
    ],
    ids=str,
)
@pytest.mark.parametrize("traced", [False, True])
def test_check_plan_bundled_refuses_settings_as_plan_offsets_does(settings, traced):
    """A ``chunk_size`` or ``strategy`` that ``plan_offsets`` refuses: ``check_plan_bundled``
    raises the same error, type and text, eagerly and in its traced form, and writes
    nothing."""
    kw = plan_kwargs(_plan_case(5))
    with pytest.raises(Exception) as want:
        plan_offsets(**kw, **settings)
    options = {"chunk_size": None, "strategy": "auto", **settings}
    i, o = bundle_plan_args(kw)
    call = lambda: check_plan_bundled(i, o, **options, traced=traced)  # noqa: E731
    assert rejected(want.type, call, plan_outputs(kw)) == str(want.value)
