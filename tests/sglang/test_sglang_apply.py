"""apply / revert / applied against the installed sglang: idempotence, exact restoration,
other patches and copies of the integration, and sglang's own caps back after revert (the
refusals of an unrecognised sglang are in test_sglang_refusals.py, sglang's kernel registry
in test_sglang_registry.py)."""

from __future__ import annotations

import functools
import importlib.util
import os
import subprocess
import sys
import types
import warnings
from pathlib import Path

import pytest
import torch
from _sglang_cases import make_plan_case, make_scatter_case, poisoned_plans, use_kernel_path
from _sglang_loader import BINDINGS, snapshot_bindings

import kvcanary_dispatch
from kvcanary_dispatch.integrations import sglang as integration
from kvcanary_dispatch.integrations._sglang_inspect import METHODS

pytest_plugins = ["_sglang_fixtures"]  # the kv fixture, and a clean patch state per test


def test_apply_patches_every_binding_and_revert_restores_the_exact_objects(kv):
    before = snapshot_bindings(kv)
    assert len({id(v) for k, v in before.items() if k[1] == "launch_canary_plan_kernels"}) == 1
    integration.apply()
    during = snapshot_bindings(kv)
    for key, original in before.items():
        assert during[key] is not original, f"{key} not patched"
    name = "launch_scatter_req_token_ids_kernel"
    scatter = {during[(short, name)] for short in ("scatter", "expected_mgr")}
    assert len(scatter) == 1, "every binding of the scatter launcher gets the same function"
    assert scatter.pop().__wrapped__ is kvcanary_dispatch.launch_scatter_req_token_ids_kernel
    offsets = {id(during[(s, "launch_plan_offsets_kernel")]) for s in ("offsets", "api")}
    assert len(offsets) == 1, "both bindings of the offsets launcher get the same function"
    assert during[("api", "launch_plan_offsets_kernel")].__wrapped__ is (
        kvcanary_dispatch.launch_plan_offsets_kernel
    )
    plan_fns = {
        id(during[(s, "launch_canary_plan_kernels")])
        for s in BINDINGS["launch_canary_plan_kernels"]
    }
    assert len(plan_fns) == 1, "every binding of launch_canary_plan_kernels gets the same function"
    owners = {(id(o), n) for o, n, _, _ in integration.patched_attributes()}
    assert len(owners) == len(integration.patched_attributes()) >= len(before)
    integration.revert()
    after = snapshot_bindings(kv)
    for key, original in before.items():
        assert after[key] is original, f"{key} not restored to sglang's own object"
    assert not integration.is_applied() and integration.patched_attributes() == []


def test_apply_is_idempotent_and_only_changes_the_policy(kv):
    integration.apply(policy="grow")
    first = snapshot_bindings(kv)
    records = integration.patched_attributes()
    integration.apply(policy="skip")
    assert integration.current_policy() == "skip"
    assert snapshot_bindings(kv) == first and integration.patched_attributes() == records
    integration.revert()
    integration.revert()  # a second revert is a no-op
    assert not integration.is_applied() and integration.current_policy() == "grow"


def test_applied_context_manager_nests(kv):
    before = snapshot_bindings(kv)
    with integration.applied(policy="skip"):
        assert integration.is_applied() and integration.current_policy() == "skip"
        with integration.applied(policy="raise"):
            assert integration.current_policy() == "raise"
        assert integration.is_applied() and integration.current_policy() == "skip"
    assert not integration.is_applied()
    assert all(snapshot_bindings(kv)[k] is v for k, v in before.items())
    with pytest.raises(ValueError, match="policy='split' is not one of grow, skip, raise"):
        integration.apply(policy="split")


def test_current_policy_is_the_default_once_reverted_inside_a_block(kv):
    """A ``revert()`` inside an ``applied`` block that found sglang patched: the block's end
    does not bring a policy back, so ``current_policy()`` reads ``DEFAULT_POLICY`` while
    nothing is applied, as documented."""
    integration.apply(policy="raise")
    with integration.applied(policy="skip"):
        integration.revert()
    assert not integration.is_applied()
    assert integration.current_policy() == integration.DEFAULT_POLICY


def test_revert_restores_bindings_imported_after_apply(kv, monkeypatch):
    integration.apply()
    late = types.ModuleType("sglang.late_importer")
    late.launch_canary_plan_kernels = kv.api.launch_canary_plan_kernels  # bound after apply
    monkeypatch.setitem(sys.modules, "sglang.late_importer", late)
    integration.revert()
    assert late.launch_canary_plan_kernels is kv.api.launch_canary_plan_kernels


def test_revert_restores_bindings_a_module_outside_sglang_imported_while_applied(kv, monkeypatch):
    """A plugin outside ``sglang.*`` that imports the launchers by name while the patch is in
    place holds the replacements; ``revert()`` gives it sglang's own back, as it does
    sglang's modules, and a module that bound them before ``apply()`` keeps what it bound."""
    names = ("launch_canary_plan_kernels", "launch_scatter_req_token_ids_kernel")
    owners = {
        "launch_canary_plan_kernels": kv.api,
        "launch_scatter_req_token_ids_kernel": kv.scatter,
    }
    originals = {n: getattr(owners[n], n) for n in names}
    early = types.ModuleType("kvcanary_test_early_plugin")
    for n in names:
        setattr(early, n, originals[n])
    monkeypatch.setitem(sys.modules, early.__name__, early)
    integration.apply()
    plugin = types.ModuleType("kvcanary_test_plugin")
    for n in names:
        setattr(plugin, n, getattr(owners[n], n))  # `from sglang... import n`, while applied
        assert getattr(plugin, n) is not originals[n]
    monkeypatch.setitem(sys.modules, plugin.__name__, plugin)
    integration.revert()
    for n in names:
        assert getattr(plugin, n) is originals[n], n
        assert getattr(early, n) is originals[n], n
        assert getattr(owners[n], n) is originals[n], n


def test_revert_restores_sglangs_cap_errors(kv, monkeypatch):
    case = make_scatter_case(600, seed=1)
    with pytest.raises(ValueError, match=r"bs\+1=601 exceeds BATCH_BLOCK=512"):
        kv.expected_mgr.launch_scatter_req_token_ids_kernel(**vars(case))
    with integration.applied():
        kv.expected_mgr.launch_scatter_req_token_ids_kernel(**vars(case))
    with pytest.raises(ValueError, match=r"bs\+1=601 exceeds BATCH_BLOCK=512"):
        kv.expected_mgr.launch_scatter_req_token_ids_kernel(**vars(case))

    use_kernel_path(monkeypatch, kv)
    plan = make_plan_case(4097, seed=2)
    outs = poisoned_plans(kv, verify_capacity=plan.total_verify() + 1, write_req_capacity=4097)
    with integration.applied():
        kv.kernel_launcher.launch_canary_plan_kernels(**plan.kwargs(*outs))
    with pytest.raises(ValueError, match="supports at most bs=4096 reqs per launch, got bs=4097"):
        kv.kernel_launcher.launch_canary_plan_kernels(**plan.kwargs(*outs))


def test_importing_the_package_and_integration_does_not_import_sglang():
    code = (
        "import sys, kvcanary_dispatch, kvcanary_dispatch.integrations, "
        "kvcanary_dispatch.integrations.sglang as s; "
        "assert not any(m == 'sglang' or m.startswith('sglang.') for m in sys.modules), "
        "sorted(m for m in sys.modules if m.startswith('sglang')); "
        "assert not s.is_applied(); print('ok')"
    )
    env = dict(os.environ)
    if not torch.cuda.is_available():
        env["TRITON_INTERPRET"] = "1"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_revert_leaves_a_patch_made_after_apply_and_says_so(kv):
    """A wrapper installed over the patch after ``apply()`` (a tracer) stays where it is at
    ``revert()``, with a warning naming it; every other binding gets sglang's object back."""
    before = snapshot_bindings(kv)
    integration.apply()

    def tracer(**kw):
        raise AssertionError("not called")

    kv.kernel_launcher.launch_canary_plan_kernels = tracer
    with pytest.warns(RuntimeWarning, match=r"kernel_launcher\.launch_canary_plan_kernels \(now"):
        integration.revert()
    assert kv.kernel_launcher.launch_canary_plan_kernels is tracer
    after = snapshot_bindings(kv)
    assert all(after[k] is v for k, v in before.items() if k[0] != "kernel_launcher")
    kv.kernel_launcher.launch_canary_plan_kernels = before[
        ("kernel_launcher", "launch_canary_plan_kernels")
    ]


@pytest.mark.parametrize("then", ["revert", "apply"])
def test_a_binding_left_by_revert_is_restored_once_the_other_patch_is_undone(kv, then):
    """A tracer wraps a patched binding, ``revert()`` leaves it (warning), and the tracer
    unhooks by putting back what it found: this integration's replacement. As the warning
    says, ``revert()`` (or ``apply()``) then puts sglang's original back there: sglang is not
    left patched for good, and ``apply()`` is not refused by this integration's own
    leftover."""
    before = snapshot_bindings(kv)
    integration.apply()
    replacement = kv.kernel_launcher.launch_canary_plan_kernels

    def tracer(**kw):
        raise AssertionError("not called")

    kv.kernel_launcher.launch_canary_plan_kernels = tracer
    with pytest.warns(RuntimeWarning, match=r"Undo that patch, then call revert\(\) again"):
        integration.revert()
    kv.kernel_launcher.launch_canary_plan_kernels = replacement  # the tracer unhooks
    if then == "apply":
        integration.apply()
        patched = snapshot_bindings(kv)
        assert all(patched[k] is not v for k, v in before.items()), "apply() patched all"
    integration.revert()
    assert not integration.is_applied() and snapshot_bindings(kv) == before


def test_a_second_copy_of_the_integration_is_refused_while_the_first_holds_the_patch(
    kv, monkeypatch
):
    """A copy of this module loaded under another name (a vendored copy) finds the
    patch in place: it refuses, naming it, instead of wrapping the wrappers (whose ``revert``
    would leave sglang patched)."""
    path = Path(integration.__file__)
    spec = importlib.util.spec_from_file_location(f"{integration.__package__}._copy", path)
    copy = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, copy)
    spec.loader.exec_module(copy)
    integration.apply()
    patched = snapshot_bindings(kv)
    with pytest.raises(copy.IncompatibleSglangError) as err:
        copy.apply()
    assert "is already kvcanary-dispatch's replacement" in str(err.value)
    assert "call revert() on the copy that applied it" in str(err.value)
    assert snapshot_bindings(kv) == patched and not copy.is_applied()


def test_overlapping_applied_blocks_keep_the_patch_until_the_last_ends(kv):
    """Blocks that overlap without nesting (two threads): the first one's end leaves the
    second's patch and policy in force; the second's end reverts."""
    first, second = integration.applied("grow"), integration.applied("skip")
    first.__enter__()
    second.__enter__()
    first.__exit__(None, None, None)
    assert integration.is_applied() and integration.current_policy() == "skip"
    second.__exit__(None, None, None)
    assert not integration.is_applied()


def test_overlapping_applied_blocks_put_back_the_policy_in_force_after_each_end(kv):
    """Over a patch ``apply()`` made, blocks that overlap without nesting: while one is open
    its policy is in force (the newest's, when several are), and once none is, ``apply()``'s;
    a block's end never brings back the policy of a block already ended."""
    integration.apply("grow")
    first, second = integration.applied("skip"), integration.applied("raise")
    first.__enter__()
    second.__enter__()
    first.__exit__(None, None, None)
    assert integration.current_policy() == "raise"
    second.__exit__(None, None, None)
    assert integration.is_applied() and integration.current_policy() == "grow"
    with integration.applied("skip"):
        integration.apply("raise")  # in force at once, and as the blocks open now end
        with integration.applied("skip"):
            assert integration.current_policy() == "skip"
        assert integration.current_policy() == "raise"
    assert integration.is_applied() and integration.current_policy() == "raise"


def test_apply_inside_a_block_that_put_the_patch_keeps_it_after_the_block(kv):
    """A block opened on unpatched sglang puts the patch; an ``apply()`` made while it is open
    (a server's start-up, in another thread) is for good: the block's end leaves the patch
    and ``apply()``'s policy in force; ``revert()`` then undoes it."""
    assert not integration.is_applied()
    with integration.applied("skip"):
        integration.apply("grow")
        assert integration.current_policy() == "grow"
    assert integration.is_applied() and integration.current_policy() == "grow"
    integration.revert()
    assert not integration.is_applied()
    with integration.applied("skip"):  # a block that puts the patch still takes it away
        assert integration.is_applied()
    assert not integration.is_applied()


def test_reload_over_an_earlier_versions_state_keeps_revert_and_applied_working(kv):
    """``importlib.reload`` keeps the patch's state class, which an earlier version of this
    module made with other fields (one ``policy``, an integer count of open blocks, no record
    of bindings left): the reloaded module fills in its own, so that the policy, ``applied``
    and ``revert`` still work."""
    integration.apply("skip")
    state = integration._State
    saved = {k: getattr(state, k) for k in ("blocks", "left", "base")}
    state.blocks, state.policy = 0, "skip"  # as an earlier version left them
    del state.left, state.base
    try:
        importlib.reload(integration)
        assert integration._State is state and integration.current_policy() == "skip"
        with integration.applied("raise"):
            assert integration.current_policy() == "raise"
        assert integration.current_policy() == "skip"
        integration.revert()
        assert not integration.is_applied()
    finally:
        del state.policy
        for k, v in saved.items():
            if not isinstance(getattr(state, k, None), type(v)):
                setattr(state, k, v)


TRACED = [  # (what a tracer wraps, made with functools.wraps)
    ("post_ops_maybe_inside_graph", False),
    *((name, True) for name in METHODS),
    ("launch_scatter_req_token_ids_kernel", True),  # in every sglang module holding it
]


def _holders(kv, name: str) -> list[object]:
    """What holds ``name``: the manager class for a step method, else every sglang module
    holding sglang's own scatter launcher."""
    cls = kv.manager.SingleForwardManager
    if name in METHODS:
        return [cls]
    own = vars(kv.scatter)[name]
    return [m for m in integration._sglang_modules() if vars(m).get(name) is own]


@pytest.mark.parametrize("unhooks", [True, False], ids=["tracer unhooks", "tracer stays"])
@pytest.mark.parametrize("name,wraps", TRACED)
def test_revert_after_an_apply_over_a_patch_left_at_revert(kv, name, wraps, unhooks):
    """A tracer with the function's own parameters wraps a patched step method or the
    patched scatter launcher, and ``revert()`` leaves it (warning); ``apply()`` then patches
    over the tracer (one made with ``functools.wraps`` too, which copies the replacement's tag:
    it is not taken for one, and its capacity checks are read through it), with a replacement
    of its own. If the tracer unhooks, putting back what it found (the first patch's
    function), ``revert()`` puts sglang's original back without a warning (nothing is left
    inside another patch), and a later ``apply()`` and ``revert()`` are silent too. If it
    stays, ``revert()`` puts the tracer back, silently: the tracer is what this ``apply()``
    found there."""
    owners = _holders(kv, name)
    assert len(owners) >= (1 if name in METHODS else 2), owners
    held = lambda: {vars(o)[name] for o in owners}  # noqa: E731
    (original,) = held()
    integration.apply()
    (first,) = held()

    if wraps:
        traced = functools.wraps(first)(lambda *args, **kwargs: first(*args, **kwargs))
    else:

        def traced(self, forward_batch, pre_ops_output):
            return first(self, forward_batch, pre_ops_output)

    for o in owners:
        setattr(o, name, traced)
    try:
        with pytest.warns(RuntimeWarning, match=rf"\.{name} \(now <function"):
            integration.revert()
        integration.apply()
        (second,) = held()
        assert second not in (original, first, traced)
        if unhooks:
            for o in owners:
                setattr(o, name, first)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            integration.revert()
            assert held() == {original if unhooks else traced}
            assert not integration.is_applied()
            if unhooks:
                integration.apply()
                integration.revert()
                assert held() == {original}
    finally:
        for o in owners:
            setattr(o, name, original)


@pytest.mark.parametrize("name", [*METHODS, "launch_scatter_req_token_ids_kernel"])
def test_a_tracer_over_sglangs_own_function_is_taken_as_sglangs(kv, name):
    """A tracer made with ``functools.wraps`` over sglang's own step method or scatter
    launcher before ``apply()`` keeps the parameters, so ``apply()`` takes it as sglang's
    function (the step methods' capacity checks read through it) and ``revert()`` puts the
    tracer back, silently."""
    owners = _holders(kv, name)
    (original,) = {vars(o)[name] for o in owners}
    traced = functools.wraps(original)(lambda *args, **kwargs: original(*args, **kwargs))
    for o in owners:
        setattr(o, name, traced)
    try:
        integration.apply()
        assert {vars(o)[name] for o in owners}.isdisjoint({original, traced})
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            integration.revert()
        assert {vars(o)[name] for o in owners} == {traced}
    finally:
        integration.revert()
        for o in owners:
            setattr(o, name, original)


def test_applied_refuses_an_unknown_policy_before_patching(kv):
    """``applied()`` checks its policy as ``apply()`` does: an unknown one is a ``ValueError``
    on entry and nothing is patched (else the step wrappers would read it as ``"skip"``)."""
    with pytest.raises(ValueError, match="policy='split' is not one of grow, skip, raise"):
        with integration.applied(policy="split"):
            pass
    assert not integration.is_applied()


def test_a_module_named_like_sglang_but_outside_it_keeps_what_it_bound(kv, monkeypatch):
    """Only ``sglang`` and ``sglang.*`` are sglang's: a module whose name merely starts with
    "sglang" (``sglang_router``, a plugin) that bound a launcher before ``apply()`` keeps it,
    as any module outside sglang does."""
    name = "launch_canary_plan_kernels"
    own = vars(kv.api)[name]
    outside = types.ModuleType("sglang_kvcanary_test_plugin")
    setattr(outside, name, own)
    monkeypatch.setitem(sys.modules, outside.__name__, outside)
    integration.apply()
    assert getattr(outside, name) is own
    assert all(o is not outside for o, _, _, _ in integration.patched_attributes())
