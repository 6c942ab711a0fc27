"""Capacities (upstream's sizing from server arguments) and the plan buffers they size. The
split of a forward step: ``test_step_split.py``; the guard's three policies:
``test_capacities_guard.py`` and ``test_guard_split.py``."""

from __future__ import annotations

import re
from functools import partial

import pytest
import torch
from _helpers import random_step
from conftest import DEVICE
from hypothesis import given
from hypothesis import strategies as st

from kvcanary_dispatch.capacities import CanaryCapacities, PlanBuffers, grown_capacity
from kvcanary_dispatch.forward_step import ForwardStepGuard
from kvcanary_dispatch.testing.engine_steps import poison_

make_step = partial(random_step, device=DEVICE)


# ---------------------------------------------------------------- capacities

FROM_ARGS = dict(
    cuda_graph_max_bs=8,
    req_to_token_pool_size=4,
    speculative_num_draft_tokens=None,
    max_prefill_tokens=100,
    chunked_prefill_size=None,
    pool_slot_count=50,
)


def _expected(a: dict) -> tuple[int, int, int]:
    req = max(a["cuda_graph_max_bs"] or 0, a["req_to_token_pool_size"])
    chunk = a["chunked_prefill_size"]
    budget = a["max_prefill_tokens"]
    if chunk is not None and chunk >= 0:
        budget = min(budget, chunk)
    drafts = a["speculative_num_draft_tokens"] or 0
    return req, max(req * max(1, drafts), budget), 3 * a["pool_slot_count"]


@given(
    st.fixed_dictionaries(
        dict(
            cuda_graph_max_bs=st.none() | st.integers(0, 5000),
            req_to_token_pool_size=st.integers(0, 5000),
            speculative_num_draft_tokens=st.none() | st.integers(0, 16),
            max_prefill_tokens=st.integers(0, 70000),
            chunked_prefill_size=st.none() | st.integers(-5, 70000),
            pool_slot_count=st.integers(0, 10**6),
        )
    )
)
def test_from_args_formulas(args):
    caps = CanaryCapacities.from_args(**args)
    got = (caps.write_req_capacity, caps.write_entry_capacity, caps.verify_capacity)
    assert got == _expected(args)


@pytest.mark.parametrize(
    "change,want",
    [
        (dict(), (8, 100, 150)),
        (dict(chunked_prefill_size=30), (8, 30, 150)),
        (dict(chunked_prefill_size=-1), (8, 100, 150)),
        (dict(chunked_prefill_size=2, speculative_num_draft_tokens=4), (8, 32, 150)),
        (dict(speculative_num_draft_tokens=0, max_prefill_tokens=0), (8, 8, 150)),
        (dict(req_to_token_pool_size=20, chunked_prefill_size=0), (20, 20, 150)),
        (dict(cuda_graph_max_bs=None), (4, 100, 150)),  # graphs off: upstream's `or 0`
        (dict(cuda_graph_max_bs=None, max_prefill_tokens=0), (4, 4, 150)),
    ],
)
def test_from_args_examples(change, want):
    caps = CanaryCapacities.from_args(**{**FROM_ARGS, **change})
    assert (caps.write_req_capacity, caps.write_entry_capacity, caps.verify_capacity) == want


@pytest.mark.parametrize("name", [k for k in FROM_ARGS if k != "chunked_prefill_size"])
@pytest.mark.parametrize("bad", [-1, 2.0, "8", True, torch.tensor(8)])
def test_from_args_rejects(name, bad):
    with pytest.raises(ValueError, match=rf"^kv-canary: {name} must be a non-negative integer"):
        CanaryCapacities.from_args(**{**FROM_ARGS, name: bad})


def test_capacities_hold_python_ints():
    """Integer-like fields (numpy's, an ``__index__`` class) are stored as ``int``: a numpy
    int64 kept would wrap when ``grown_capacity`` doubles it and reach the plan as one."""
    np = pytest.importorskip("numpy")

    class Count:
        def __index__(self) -> int:
            return 7

    caps = CanaryCapacities(np.int64(2**62), np.int32(9), Count())
    fields = (caps.write_req_capacity, caps.write_entry_capacity, caps.verify_capacity)
    assert [type(n) for n in fields] == [int, int, int]
    assert fields == (2**62, 9, 7)
    assert grown_capacity(caps.write_req_capacity, 2**62 + 1) == 2**63 - 1  # doubled, capped


@pytest.mark.parametrize("bad", [torch.tensor(4), torch.tensor(True), torch.tensor([4])])
def test_capacities_refuse_tensors(bad):
    """A tensor count is refused, not read back (``operator.index`` would take its value)."""
    text = "kv-canary: verify_capacity must be a non-negative integer, got a tensor; pass int("
    with pytest.raises(ValueError, match=re.escape(text)):
        CanaryCapacities(write_req_capacity=1, write_entry_capacity=1, verify_capacity=bad)


@pytest.mark.parametrize("name", list(FROM_ARGS))
def test_from_args_refuses_a_tensor_with_the_fix_and_its_value_unread(name):
    """Every server argument given as a tensor is refused with a tensor count's text; its
    value is not in it (printing a CUDA tensor reads it back: a sync, an error in a capture)."""
    with pytest.raises(ValueError) as err:
        CanaryCapacities.from_args(**{**FROM_ARGS, name: torch.tensor(12345)})
    text = str(err.value)
    assert text.endswith(f"got a tensor; pass int({name}), read once outside any CUDA graph")
    assert "12345" not in text, text


@pytest.mark.parametrize("bad", [2.5, "64", False, torch.tensor(64)])
def test_from_args_rejects_chunked_prefill_size(bad):
    with pytest.raises(ValueError, match=r"^kv-canary: chunked_prefill_size must be an integer"):
        CanaryCapacities.from_args(**{**FROM_ARGS, "chunked_prefill_size": bad})


@pytest.mark.parametrize("name", ["write_req_capacity", "write_entry_capacity"])
def test_capacities_past_int64_are_refused(name):
    """A step's totals are int64: a write capacity past it would let a step whose total wraps
    fit, so it is refused, naming the largest; ``2**63 - 1`` itself is taken."""
    caps = dict(write_req_capacity=4, write_entry_capacity=4, verify_capacity=0)
    assert getattr(CanaryCapacities(**{**caps, name: 2**63 - 1}), name) == 2**63 - 1
    text = f"kv-canary: {name}={2**63} is past int64; pass a capacity of at most {2**63 - 1} "
    with pytest.raises(ValueError, match=f"^{re.escape(text)}"):
        CanaryCapacities(**{**caps, name: 2**63})


@pytest.mark.parametrize(
    "override, sizes",
    [
        ({"cuda_graph_max_bs": 2**63}, (2**63, 2**63)),
        ({"req_to_token_pool_size": 2**62, "speculative_num_draft_tokens": 2}, (2**62, 2**63)),
    ],
)
def test_from_args_past_int64_names_the_server_arguments(override, sizes):
    """Server arguments whose capacities pass int64 are refused naming those arguments (not
    a capacity the caller never passed), with the sizes they give and the bound."""
    args = {**FROM_ARGS, **override}
    text = (
        f"kv-canary: CanaryCapacities.from_args(cuda_graph_max_bs={args['cuda_graph_max_bs']}, "
        f"req_to_token_pool_size={args['req_to_token_pool_size']}, "
        f"speculative_num_draft_tokens={args['speculative_num_draft_tokens']}, "
        f"max_prefill_tokens=100, chunked_prefill_size=None) sizes write_req_capacity="
        f"{sizes[0]} and write_entry_capacity={sizes[1]}, past int64; pass server arguments "
        f"whose capacities are at most {2**63 - 1}"
    )
    with pytest.raises(ValueError) as err:
        CanaryCapacities.from_args(**args)
    assert str(err.value) == text


@pytest.mark.parametrize(
    "capacity, needed, grown",
    [
        (5, 5, 5),
        (5, 6, 10),
        (5, 11, 11),
        (2**62 + 1, 2**62 + 2, 2**63 - 1),
        (2**63 - 2, 2**63 - 1, 2**63 - 1),
    ],
)
def test_grown_capacity_doubles_up_to_int64(capacity, needed, grown):
    assert grown_capacity(capacity, needed) == grown


def test_grow_near_int64_plans_the_step():
    """A "grow" guard past 2**62 entries grows to 2**63 - 1 (doubling would pass int64, the
    most a capacity may be) and plans a step of 2**62 + 2 tokens (padding included)."""
    caps = CanaryCapacities(write_req_capacity=2, write_entry_capacity=2**62 + 1, verify_capacity=9)
    guard = ForwardStepGuard(caps, "grow", device=DEVICE)
    rows = torch.arange(16, dtype=torch.int32, device=DEVICE).reshape(4, 4)
    steps = list(guard.plan_step(req_pool_indices=[1], prefix_lens=[0], extend_seq_lens=[1],
                                 req_to_token=rows, num_tokens=2**62 + 2))  # fmt: skip
    assert guard.capacities.write_entry_capacity == 2**63 - 1
    assert guard.grow_count == 1
    assert [sub.num_tokens for sub, _ in steps] == [2**62 + 2]


def test_capacities_reject_negative_fields():
    with pytest.raises(ValueError, match="^kv-canary: write_entry_capacity must be"):
        CanaryCapacities(write_req_capacity=1, write_entry_capacity=-1, verify_capacity=0)


@pytest.mark.parametrize("req_cap", [0, 1, 7])
def test_plan_buffers_allocate(req_cap):
    buf = PlanBuffers.allocate(CanaryCapacities(req_cap, 3, 9), DEVICE)
    shapes = [(k, (tuple(v.shape), v.dtype)) for k, v in buf.tensors().items()]
    assert shapes == list(
        {  # upstream's order: its offsets launcher's outputs, in order
            "out_verify_offsets": ((req_cap + 1,), torch.int64),
            "out_write_offsets": ((req_cap + 1,), torch.int64),
            "out_write_seed_slot_indices": ((req_cap,), torch.int64),
            "out_verify_num_valid": ((1,), torch.int32),
            "out_verify_enable": ((1,), torch.int32),
            "out_write_num_valid_reqs": ((1,), torch.int32),
        }.items()
    )
    assert buf.device == torch.empty(0, device=DEVICE).device
    assert all(not t.any() for t in buf.tensors().values()), "allocate is zero-filled"


@pytest.mark.parametrize("req_cap", [3, 9])
def test_plan_buffers_resized_keeps_what_graphs_address_and_zero_fills_the_rest(req_cap):
    """Every tensor whose shape stays is the same object, values kept; a new one reads zero
    however dirty the one it replaces was."""
    buf = PlanBuffers.allocate(CanaryCapacities(3, 5, 9), DEVICE)
    poison_(*buf.tensors().values())
    before = {k: v.clone() for k, v in buf.tensors().items()}
    got = buf.resized(CanaryCapacities(req_cap, 50, 90))
    assert got.capacities == CanaryCapacities(req_cap, 50, 90)
    for name, tensor in got.tensors().items():
        old = buf.tensors()[name]
        if req_cap == 3 or tensor.numel() == 1:  # the scalars always; all, at the same shape
            assert tensor is old and torch.equal(tensor, before[name]), name
        else:
            assert tensor is not old and not tensor.any(), f"{name} not zero-filled"
            assert torch.equal(old, before[name]), f"{name}: the replaced tensor was written"


@pytest.mark.parametrize("memory", ["as allocated", "dirty"])
def test_guard_buffers_read_zero_when_built_and_when_grown(monkeypatch, memory):
    """Nothing is planned into a guard's buffers until its iterator runs: before that they read
    zero, whether built or grown by ``plan_step``, also where the memory a grow allocates
    unfilled holds old values (``dirty``: what ``torch.empty`` may hand out)."""
    if memory == "dirty":
        allocate = PlanBuffers.allocate.__func__

        def dirty(cls, caps, device, *, zeroed=True):
            made = allocate(cls, caps, device, zeroed=zeroed)
            if not zeroed:
                poison_(*made.tensors().values())
            return made

        monkeypatch.setattr(PlanBuffers, "allocate", classmethod(dirty))
    guard = ForwardStepGuard(CanaryCapacities(2, 4, 8), "grow", device=DEVICE)
    assert all(not t.any() for t in guard.buffers.tensors().values())
    step = make_step([(1, 3, False)] * 5)
    planned = guard.plan_step(**step.lengths(), req_to_token=step.req_to_token)
    assert guard.grow_count == 1
    assert all(not t.any() for t in guard.buffers.tensors().values())
    ((_, buffers),) = planned
    assert buffers.write_offsets.tolist() == [0, 3, 6, 9, 12, 15]


def test_overflow_names_the_first_capacity_a_step_exceeds():
    """A batch exactly at the request capacity with too many tokens exceeds the token
    capacity first: upstream's token text, not the batch's; one request more is the batch's
    text, naming the tokens too where they also exceed theirs."""
    caps = CanaryCapacities(4, 8, 99)
    tokens = "kv-canary: forward_batch token count=9 exceeds pre-allocated write_entry_capacity=8;"
    assert caps.overflow_message(4, 9).startswith(tokens)
    batch = "kv-canary: forward_batch.batch_size=5 exceeds pre-allocated write_req_capacity=4;"
    assert caps.overflow_message(5, 8).startswith(batch)
    assert "token count" not in caps.overflow_message(5, 8)
    assert "(its token count=9 also exceeds write_entry_capacity=8" in caps.overflow_message(5, 9)
