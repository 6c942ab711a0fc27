"""numpy integers as the integer settings (``chunk_size``, the plan's ``swa_window_size`` and
``verify_capacity``): eagerly they are ints; under ``torch.compile``, which traces a numpy
scalar as an array, a call given one is refused as it is traced, naming the setting and
``int(...)``, nothing written (``fullgraph=True``: torch's error carries that text). With
``fullgraph=False`` dynamo then runs the step eagerly, where the numpy value is an int again:
that call is exact, and so are the step's later calls (the library's eager path runs
untraced: ``kvcanary_dispatch.untraced``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from _helpers import rejected
from test_engine_safety import plan_case, scatter_case
from test_engine_safety_compile import BACKEND

import kvcanary_dispatch as kd
from kvcanary_dispatch.testing.engine_steps import expect_plan, expect_scatter

SETTINGS = {  # name: (function, keyword, numpy value, the message's start)
    "plan window": ("plan", "swa_window_size", np.int64(5), "kv-canary: swa_window_size is a"),
    "plan capacity": ("plan", "verify_capacity", np.uint32(900), "kv-canary: verify_capacity is"),
    "plan chunk": ("plan", "chunk_size", np.int16(64), "kv-canary: plan_offsets chunk_size is"),
    "scatter chunk": (
        "scatter", "chunk_size", np.uint8(7), "kv-canary: scatter_req_token_ids chunk_size is"
    ),
}  # fmt: skip


def _call(name: str):
    """``(step, its keywords, the outputs, a check of them against the reference)`` for
    ``SETTINGS[name]``, on fresh (poisoned) outputs."""
    function, keyword, value, _ = SETTINGS[name]
    if function == "plan":
        case = plan_case(300, **({} if keyword == "chunk_size" else {keyword: int(value)}))
        outs = case.fresh_outputs()
        kw = {**case.inputs(), **outs, keyword: value}
        return kd.plan_offsets, kw, list(outs.values()), lambda: expect_plan(case, outs, name)
    case = scatter_case(300)
    pool = case.fresh_pool()
    kw = {**case.kwargs(pool), keyword: value}
    return kd.scatter_req_token_ids, kw, [pool], lambda: expect_scatter(case, pool, name)


@pytest.mark.parametrize("name", SETTINGS)
def test_numpy_settings_are_ints_eagerly(name):
    fn, kw, _, check = _call(name)
    fn(**kw)
    check()


@pytest.mark.parametrize("name", SETTINGS)
def test_numpy_settings_compiled_fullgraph_are_refused_naming_int(name):
    _, keyword, _, text = SETTINGS[name]
    fn, kw, outputs, _ = _call(name)
    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, backend=BACKEND)
    msg = rejected(RuntimeError, lambda: compiled(**kw), outputs)
    assert text in msg and f"pass int({keyword}) to the compiled call" in msg, msg


@pytest.mark.parametrize("name", SETTINGS)
def test_numpy_settings_compiled_without_fullgraph_run_eagerly_and_exact(name):
    """The refused call runs eagerly, exact; so do the step's later calls, with the numpy
    value or its int (dynamo keeps the step eager; its eager path runs untraced)."""
    torch._dynamo.reset()
    compiled = None
    for value in (None, int):
        fn, kw, _, check = _call(name)
        compiled = compiled or torch.compile(fn, backend=BACKEND)
        keyword = SETTINGS[name][1]
        compiled(**(kw if value is None else {**kw, keyword: value(kw[keyword])}))
        check()


def test_the_eager_path_is_marked_before_pending_clears(monkeypatch):
    """``kvcanary_dispatch.untraced``: every eager-only function is marked while ``PENDING``
    still reads True (a thread that reads False never meets an unmarked one), the eager path's
    four entry points among them."""
    import torch._dynamo.eval_frame as eval_frame

    from kvcanary_dispatch import plan, scatter, untraced

    marked, real = [], eval_frame.set_code_exec_strategy

    def spy(code, strategy):
        marked.append((code, untraced.PENDING[0]))
        real(code, strategy)

    monkeypatch.setattr(eval_frame, "set_code_exec_strategy", spy)
    untraced.PENDING[0] = True  # as before the first eager call (marking again is harmless)
    untraced.keep_untraced()
    assert untraced.PENDING == [False]
    assert marked and all(pending for _, pending in marked), marked
    codes = {code for code, _ in marked}
    entry = (plan._launched, plan._plan, scatter._launched, scatter._scatter)
    assert {fn.__code__ for fn in entry} <= codes


def test_a_torch_without_per_code_strategies_marks_nothing_and_stops_asking(monkeypatch):
    """``keep_untraced`` on a torch whose dynamo has no ``set_code_exec_strategy``: nothing
    is marked, no error reaches the caller, and ``PENDING`` turns False so that later calls
    do not try again; before dynamo is loaded it leaves ``PENDING`` True."""
    import sys

    import torch._dynamo.eval_frame as eval_frame

    from kvcanary_dispatch import untraced

    monkeypatch.setattr(untraced, "PENDING", [True])  # the callers' list left as it is
    monkeypatch.delitem(sys.modules, "torch._dynamo.eval_frame")
    untraced.keep_untraced()
    assert untraced.PENDING == [True]  # dynamo not loaded: nothing to mark yet
    monkeypatch.setitem(sys.modules, "torch._dynamo.eval_frame", eval_frame)
    monkeypatch.delattr(eval_frame, "set_code_exec_strategy")
    untraced.keep_untraced()
    assert untraced.PENDING == [False]
