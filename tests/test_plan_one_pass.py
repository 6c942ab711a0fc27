"""The plan's one-pass launch (``kvcanary_dispatch.plan._launched``).

An eager valid call on the current CUDA device whose plan is one launch (``fixed``,
``recount``, the eager ``lookback``) is checked, its launch head built (``_fit_head``) and
launched in one pass; every other call takes the full path. On the CPU, through
``_one_pass.record_as_on_gpu``: each call hands the kernel exactly what the full path hands
it, and a call the pass declines launches nothing. On a GPU: results byte for byte equal to
the reference with the full path made to fail, so a call that leaves the pass shows.
"""

from __future__ import annotations

import pytest
import torch
from _helpers import (
    PLAN_SHARED,
    lookback_states,
    plan_call,
    random_plan_case,
    share_plan_memory,
)
from _one_pass import (
    full_path_launches,
    one_pass_or_full_path,
    record_as_on_gpu,
    same_launches,
)
from conftest import DEVICE, gpu
from hypothesis import given
from hypothesis import strategies as st

import kvcanary_dispatch.plan as plan
from kvcanary_dispatch import plan_offsets
from kvcanary_dispatch.launch_plan import plan_offsets_launch_plan
from kvcanary_dispatch.resident import release
from kvcanary_dispatch.testing.cases import (
    assert_bytes_equal,
    check_plan,
)
from kvcanary_dispatch.testing.engine_steps import poison_
from kvcanary_dispatch.testing.rejections import PLAN_REJECTIONS, check_plan_rejected
from kvcanary_kernels._launch import BoundKernel

CPU = torch.device("cpu")
ONE_LAUNCH = ("fixed", "recount", "lookback")
# (bs, strategy, chunk_size): auto's fixed, recount and look-back batches, the named one-launch
# strategies on small slices, and plans the pass leaves to the full path (scan, loop).
CALLS = [
    (0, "auto", None),
    (5, "auto", None),
    (300, "auto", None),
    (5000, "auto", None),
    (40, "recount", 16),
    (40, "lookback", 8),
    (40, "scan", 8),
    (40, "loop", 16),
]


@pytest.fixture
def as_on_gpu(monkeypatch) -> list:
    return record_as_on_gpu(monkeypatch)


def _keywords(bs: int, lut: bool, seed: int = 0) -> dict:
    case = random_plan_case(bs, seed, device=CPU, **({} if lut else {"lut_len": None}))
    return {**case.inputs(), **case.fresh_outputs()}


def _full(seen: list, kw: dict, **options) -> list:
    return full_path_launches(seen, plan, lambda: plan_offsets(**kw, **options))


@pytest.mark.parametrize("lut", [True, False])
@pytest.mark.parametrize("bs,strategy,chunk_size", CALLS, ids=str)
def test_one_pass_launches_what_the_full_path_launches(as_on_gpu, bs, strategy, chunk_size, lut):
    kw, options = _keywords(bs, lut, seed=bs), {"strategy": strategy, "chunk_size": chunk_size}
    plan_offsets(**kw, **options)
    ours = list(as_on_gpu)
    full = _full(as_on_gpu, kw, **options)
    if plan_offsets_launch_plan(bs, chunk_size, strategy).strategy in ONE_LAUNCH:
        assert len(full) == 1
        same_launches(ours, full)
    else:  # declined: the full path ran both times (scan's temporary differs between them)
        assert [(path, bound) for path, bound, *_ in ours] == [(p, b) for p, b, *_ in full]
        assert full and all(path == "full" for path, *_ in full)


def test_one_pass_leaves_a_capturing_stream_to_the_full_path(as_on_gpu, monkeypatch):
    """A look-back plan differs while the stream captures: then the full path plans it."""
    kw = _keywords(5000, lut=True)
    assert plan_offsets_launch_plan(5000).strategy == "lookback"
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert (
        plan._launched(*plan.bundle_plan_args(dict(kw), "out_verify_offsets"), None, "auto")
        is False
    )
    assert as_on_gpu == []
    kw = _keywords(300, lut=True)  # recount: the same plan either way, no capture query
    assert plan._launched(*plan.bundle_plan_args(dict(kw), "out_verify_offsets"), None, "auto")


# Calls the pass must leave to the full path. Each: (keywords from valid ones, options).
BREAKAGES = {
    "int32 prefix_lens": (lambda kw: {**kw, "prefix_lens": kw["prefix_lens"].int()}, {}),
    "int64 table": (lambda kw: {**kw, "req_to_token": kw["req_to_token"].long()}, {}),
    "strided extend": (
        lambda kw: {**kw, "extend_seq_lens": kw["extend_seq_lens"].repeat(2)[::2]},
        {},
    ),
    "1-D table": (lambda kw: {**kw, "req_to_token": kw["req_to_token"].reshape(-1)}, {}),
    "transposed table": (lambda kw: {**kw, "req_to_token": kw["req_to_token"].t()}, {}),
    "short verify offsets": (
        lambda kw: {**kw, "out_verify_offsets": kw["out_verify_offsets"][:1]},
        {},
    ),
    "no write capacity": (
        lambda kw: {
            **kw,
            "out_write_offsets": kw["out_write_offsets"][:1],
            "out_write_seed_slot_indices": kw["out_write_seed_slot_indices"][:0],
        },
        {},
    ),
    "a float window": (lambda kw: {**kw, "swa_window_size": 6.0}, {}),
    "a bool capacity": (lambda kw: {**kw, "verify_capacity": True}, {}),
    "a capacity past int32": (lambda kw: {**kw, "verify_capacity": 2**31}, {}),
    "None output": (lambda kw: {**kw, "out_verify_enable": None}, {}),
    "a subclass": (
        lambda kw: {
            **kw,
            "prefix_lens": torch.nn.Parameter(kw["prefix_lens"], requires_grad=False),
        },
        {},
    ),
    "a zero chunk_size": (dict, {"chunk_size": 0}),
    "a list chunk_size": (dict, {"chunk_size": [8]}),
    "an unknown strategy": (dict, {"strategy": "fastest"}),
    "scan": (dict, {"strategy": "scan", "chunk_size": 4}),
    "loop": (dict, {"strategy": "loop", "chunk_size": 4}),
}


@pytest.mark.parametrize("name", BREAKAGES)
def test_one_pass_declines_and_launches_nothing(as_on_gpu, name):
    breaking, options = BREAKAGES[name]
    kw = breaking(_keywords(9, lut=True))
    i, o = plan.bundle_plan_args(dict(kw), "out_verify_offsets")
    chunk_size, strategy = options.get("chunk_size"), options.get("strategy", "auto")
    assert plan._launched(i, o, chunk_size, strategy) is False
    assert as_on_gpu == []


@pytest.mark.parametrize(
    "name", ["prefix_lens", "req_to_token", "full_to_swa_index_mapping", "out_verify_enable"]
)
def test_one_pass_declines_one_tensor_elsewhere(as_on_gpu, monkeypatch, name):
    """One tensor on another device: the full path refuses the call, the pass declines it."""
    kw = _keywords(9, lut=True)
    target, real = kw[name], torch.Tensor.device
    bundles = plan.bundle_plan_args(dict(kw), "out_verify_offsets")
    assert plan._launched(*bundles, None, "auto") is True  # as it stands: taken
    elsewhere = torch.device("cuda", 1)
    monkeypatch.setattr(
        torch.Tensor,
        "device",
        property(lambda self: elsewhere if self is target else real.__get__(self)),
    )
    as_on_gpu.clear()
    assert plan._launched(*bundles, None, "auto") is False
    assert as_on_gpu == []


def test_one_pass_declines_another_device_type(as_on_gpu, monkeypatch):
    """Tensors of another device type whose index is the current GPU's (lazy or XLA tensors:
    ``is_cuda`` false): the pass declines the call."""
    bundles = plan.bundle_plan_args(dict(_keywords(9, lut=True)), "out_verify_offsets")
    assert plan._launched(*bundles, None, "auto") is True  # as it stands: taken
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: False))
    as_on_gpu.clear()
    assert plan._launched(*bundles, None, "auto") is False
    assert as_on_gpu == []


def test_one_pass_declines_another_device_validate_and_compile_ops(as_on_gpu, monkeypatch):
    kw = _keywords(9, lut=False)
    i, o = plan.bundle_plan_args(dict(kw), "out_verify_offsets")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)  # not the tensors' device
    assert plan._launched(i, o, None, "auto") is False
    monkeypatch.setattr(torch.cuda, "current_device", lambda: -1)
    ran = []
    monkeypatch.setattr(plan, "_plan", lambda *args: ran.append(args))
    plan_offsets(**kw, validate=True)
    plan.plan_bundled(i, o, resident=False)  # the torch.compile op's call
    assert len(ran) == 2 and as_on_gpu == []


@given(
    bs=st.integers(0, 600),
    lut=st.booleans(),
    breakage=st.none() | st.sampled_from(list(BREAKAGES)),  # about half the calls valid
    strategy=st.sampled_from(["auto", "recount", "lookback", "scan"]),
    chunk_size=st.sampled_from([None, 1, 64, 256]),
)
def test_one_pass_never_accepts_what_the_full_path_refuses(bs, lut, breakage, strategy, chunk_size):
    """Whatever the sizes, and with each kind of breakage: when the one pass launches, the full
    path accepts the call and makes the same launch; a refused call launches nothing."""
    with pytest.MonkeyPatch.context() as m:
        seen = record_as_on_gpu(m)
        kw, options = _keywords(bs, lut, seed=bs), {"strategy": strategy, "chunk_size": chunk_size}
        if breakage is not None:
            breaking, extra = BREAKAGES[breakage]
            kw, options = breaking(kw), {**options, **extra}
        call = lambda: plan_offsets(**kw, **options)  # noqa: E731
        one_pass_or_full_path(seen, plan, call, broken=breakage is not None)


@gpu
@pytest.mark.parametrize("lut", [True, False])
@pytest.mark.parametrize(
    "bs,strategy,chunk_size", [c for c in CALLS if c[1] not in ("scan", "loop")], ids=str
)
def test_one_pass_on_gpu_is_exact_and_leaves_no_path(monkeypatch, bs, strategy, chunk_size, lut):
    """These calls stay in the one pass (the full path would raise), three times each (the
    cached launch; the look-back's state re-armed by each launch), with new data each time."""

    def full_path(*args):
        raise AssertionError("the call left the one pass")

    monkeypatch.setattr(plan, "_plan", full_path)
    for seed in (1, 2, 3):
        case = random_plan_case(bs, seed, device=DEVICE, **({} if lut else {"lut_len": None}))
        check_plan(plan_offsets, case, strategy=strategy, chunk_size=chunk_size)


@gpu
@pytest.mark.parametrize(
    "bs,strategy,chunk_size", [c for c in CALLS if c[1] not in ("scan", "loop")], ids=str
)
def test_one_pass_launches_on_the_current_stream(monkeypatch, bs, strategy, chunk_size):
    """On a side stream that sleeps, then poisons the outputs, then plans: a launch on any
    other stream lands before the poison and leaves it showing. The look-back reads the
    stream's handle once, for its resident state and its launch; this side stream's state is
    made by this call."""

    def full_path(*args):
        raise AssertionError("the call left the one pass")

    monkeypatch.setattr(plan, "_plan", full_path)
    case = random_plan_case(bs, 7, device=DEVICE)
    options = {"strategy": strategy, "chunk_size": chunk_size}
    want = check_plan(plan_offsets, case, **options)  # the current stream, against the reference
    got = case.fresh_outputs()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)  # ~25 ms: a launch elsewhere runs first
        poison_(*got.values())
        plan_offsets(**case.inputs(), **got, **options)
    side.synchronize()
    for name, tensor in want.items():
        assert_bytes_equal(got[name], tensor, f"{name}, planned on a side stream")


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype")
def test_one_pass_declines_a_nested_table(as_on_gpu):
    """A strided nested tensor passes ``_fit_head`` (a plain ``torch.Tensor``, 2-D) but has no
    strides: the pass declines it without raising (the full path names the error)."""
    kw = _keywords(2, lut=False)
    rows = kw["req_to_token"]
    nested = torch.nested.nested_tensor([rows[0], rows[1], rows[2]], layout=torch.strided)
    i, o = plan.bundle_plan_args({**kw, "req_to_token": nested}, "out_verify_offsets")
    assert plan._launched(i, o, None, "auto") is False
    assert as_on_gpu == []


@pytest.mark.parametrize("strategy", ["auto", "recount", "lookback"])
@pytest.mark.parametrize("name", sorted(PLAN_REJECTIONS))
def test_one_pass_refuses_every_named_rejection(as_on_gpu, name, strategy):
    """Each breakage of the rejection properties, made as an engine makes the call (the one
    pass on, every tensor passing for one on the current GPU): refused with its text, every
    tensor unchanged, nothing launched by either path."""
    case = random_plan_case(9, 3, device=CPU)
    assert check_plan_rejected(case, name, index=5, strategy=strategy, one_pass=True)
    assert as_on_gpu == []


@pytest.mark.parametrize("bs", [5, 300])  # fixed and recount under auto
@pytest.mark.parametrize(("out", "other"), PLAN_SHARED, ids=[f"{o}-{t}" for o, t in PLAN_SHARED])
def test_one_pass_leaves_outputs_sharing_memory_to_the_full_path(as_on_gpu, bs, out, other):
    """An output sharing one element with an input or another output: the one pass declines
    the call, which the full path refuses by name, nothing launched; the same call with
    outputs of their own is taken."""
    inputs, outputs = plan_call(bs, lut=True, device=CPU)
    plan_offsets(**inputs, **outputs)
    assert [path for path, *_ in as_on_gpu] == ["one pass"]
    as_on_gpu.clear()
    share_plan_memory(inputs, outputs, out, other)
    with pytest.raises(ValueError, match=f"plan_offsets {out} shares memory with {other}"):
        plan_offsets(**inputs, **outputs)
    assert as_on_gpu == []


def test_a_failed_one_pass_look_back_drops_its_state(as_on_gpu, monkeypatch):
    """The one pass's look-back launch stopping part-way (an interrupt) may leave the stream's
    state dirty: the call drops it, where a launch that went through keeps it."""
    release()
    kw, options = _keywords(40, lut=True), {"strategy": "lookback", "chunk_size": 8}
    plan_offsets(**kw, **options)
    assert [path for path, *_ in as_on_gpu] == ["one pass"] and len(lookback_states()) == 1

    def stops_part_way(self, grid, device, tensors, *rest):
        tensors[-1][:5] = 7  # the state, last of the launch's tensors
        raise KeyboardInterrupt

    monkeypatch.setattr(BoundKernel, "checked", stops_part_way)
    with pytest.raises(KeyboardInterrupt):
        plan_offsets(**kw, **options)
    assert lookback_states() == []
