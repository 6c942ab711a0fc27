"""The lengths a ``ForwardStepGuard`` step takes: 1-D integers of any width, from a tensor or a
sequence, widened to int64 without a value changed; anything else refused before anything is
written."""

from __future__ import annotations

import re
from functools import partial

import pytest
import torch
from _helpers import assert_guard_untouched, poisoned_guard, random_step
from conftest import DEVICE

from kvcanary_dispatch.capacities import CanaryCapacities
from kvcanary_dispatch.forward_step import ForwardStepGuard

make_step = partial(random_step, device=DEVICE)


@pytest.mark.parametrize("policy", ["split", "grow", "raise"])
@pytest.mark.parametrize(
    "name,values,text",
    [
        ("prefix_lens", [3.9, 2.5], "prefix_lens must hold integers, got 3.9 (float)"),
        ("extend_seq_lens", [True, False], "extend_seq_lens must hold integers, got True (bool)"),
        ("req_pool_indices", [1, 2.5], "req_pool_indices must hold integers, got 2.5 (float)"),
        ("prefix_lens", "float64", "prefix_lens must hold integers, got torch.float64"),
        ("extend_seq_lens", "bool", "extend_seq_lens must hold integers, got torch.bool"),
        ("extend_seq_lens", None, "extend_seq_lens must be a 1-D integer tensor or a sequence"),
        (
            "prefix_lens",
            3,
            "prefix_lens must be a 1-D integer tensor or a sequence of int, got int",
        ),
        ("prefix_lens", [[1], [2]], "prefix_lens must be 1-D, got shape (2, 1)"),
        ("prefix_lens", "numpy 2-D", "prefix_lens must be 1-D, got shape (1, 2)"),
        ("prefix_lens", "tensor rows", "prefix_lens must be 1-D, got an item of shape (2,) at [0]"),
        ("prefix_lens", [[1], [2, 3]], "prefix_lens must be 1-D, got an item of shape (1,) at [0]"),
        (
            "prefix_lens",
            "uint64 and an array",
            "prefix_lens must be 1-D, got an item of shape (2,) at [1]",
        ),
        pytest.param(  # torch.as_tensor warns (once) before refusing a list holding arrays
            "prefix_lens",
            "one-element array",
            "prefix_lens must be 1-D, got an item of shape (1,) at [0]",
            marks=pytest.mark.filterwarnings("ignore:Creating a tensor from a list of numpy"),
        ),
        ("prefix_lens", [5, range(2)], "prefix_lens must be 1-D, got an item of shape (2,) at [1]"),
        (
            "prefix_lens",
            "empty tensor",
            "prefix_lens must be 1-D, got an item of shape (0,) at [0]",
        ),
        ("extend_seq_lens", "1-D bools", "extend_seq_lens must hold integers, got True (bool)"),
        ("extend_seq_lens", "uint64 past int64", "extend_seq_lens[1]=18446744073709551615 is past"),
        ("prefix_lens", [5, 2**63], "prefix_lens[1]=9223372036854775808 is past int64; pass"),
        ("prefix_lens", [-(2**63) - 1, 5], "prefix_lens[0]=-9223372036854775809 is past int64"),
        ("extend_seq_lens", "0-d bools", "extend_seq_lens must hold integers, got True (bool)"),
        ("prefix_lens", "0-d uint64 past int64", "prefix_lens[1]=9223372036854775808 is past"),
        ("req_pool_indices", "set", "req_pool_indices must be a 1-D integer tensor or a seq"),
        ("prefix_lens", "dict", "prefix_lens must be a 1-D integer tensor or a seq"),
    ],
)
def test_guard_refuses_lengths_that_are_not_integers(policy, name, values, text):
    """Lengths are 1-D integers: a float or bool is refused, not truncated, from a sequence or
    a CPU tensor alike (on a GPU guard too, where CPU lengths are uploaded), a sequence of 0-d
    tensors included; so is a missing, scalar or 2-D length (a sequence of longer tensors,
    arrays or sequences too, the item named), a set (no order) or a mapping, or a uint64 one
    past int64 (named, not wrapped negative); nothing is written."""
    step = make_step([(1, 2, False), (0, 1, False)])
    kw = dict(**step.lengths(), req_to_token=step.req_to_token)
    if values == "numpy 2-D":
        kw[name] = pytest.importorskip("numpy").zeros((1, 2), dtype="int64")
    elif values == "uint64 past int64":
        kw[name] = torch.tensor([1, -1]).view(torch.uint64)  # 2**64 - 1 at [1]
    elif values == "0-d bools":  # each a tensor: torch counts True as 1
        kw[name] = [torch.tensor(True), torch.tensor(False)]
    elif values == "0-d uint64 past int64":  # torch cannot make these int64
        kw[name] = [torch.tensor(5, dtype=torch.uint64), torch.tensor(2**63, dtype=torch.uint64)]
    elif values == "tensor rows":  # torch.as_tensor refuses them: read item by item
        kw[name] = [torch.tensor([1, 2]), torch.tensor([3, 4])]
    elif values == "one-element array":  # an array is not a value, whatever its size
        kw[name] = [pytest.importorskip("numpy").zeros(1, dtype="int64"), 3]
    elif values == "empty tensor":
        kw[name] = [torch.zeros(0, dtype=torch.int64), 1]
    elif values == "1-D bools":  # one-element tensors count as their values
        kw[name] = [torch.tensor([True]), torch.tensor([False])]
    elif values == "uint64 and an array":  # torch.as_tensor refuses numpy uint64 scalars
        np = pytest.importorskip("numpy")
        kw[name] = [np.uint64(5), np.zeros(2, dtype="int64")]
    elif values == "set":  # iterated in hash order, not the caller's
        kw[name] = set(torch.as_tensor(kw[name]).tolist())
    elif values == "dict":  # a mapping: its keys would be read as the lengths
        kw[name] = dict.fromkeys(torch.as_tensor(kw[name]).tolist(), 0)
    elif isinstance(values, str):
        kw[name] = torch.as_tensor(kw[name]).cpu().to(getattr(torch, values))
    else:
        kw[name] = values
    guard, before = poisoned_guard(DEVICE, CanaryCapacities(1, 1, 9), policy)
    with pytest.raises((TypeError, ValueError), match=re.escape(f"kv-canary: {text}")):
        for _ in guard.plan_step(**kw):
            pass
    assert_guard_untouched(guard, before)
    assert guard.grow_count == 0


@pytest.mark.parametrize(
    "form", ["list", "numpy uint64 list", "cpu int32", "cpu int16", "cpu int64 strided"]
)
def test_guard_takes_integers_of_any_width(form):
    """Integer lengths are widened to contiguous int64, never changed: sequences of Python or
    numpy integers, and CPU tensors of any integer width or stride (on a GPU guard too)."""
    np = pytest.importorskip("numpy")
    step = make_step([(1, 2, False), (0, 1, False), (1, 4, True)])
    host = {k: torch.as_tensor(v).cpu() for k, v in step.lengths().items()}
    if form == "list":
        lengths = {k: v.tolist() for k, v in host.items()}
    elif form == "numpy uint64 list":
        lengths = {k: list(v.clamp(min=0).numpy().astype(np.uint64)) for k, v in host.items()}
    elif form == "cpu int64 strided":
        lengths = {k: v.repeat_interleave(2)[::2] for k, v in host.items()}
        assert not lengths["req_pool_indices"].is_contiguous()
    else:
        lengths = {k: v.to(getattr(torch, form.split()[1])) for k, v in host.items()}
    guard = ForwardStepGuard(CanaryCapacities(4, 10, 9), device=DEVICE)
    ((sub, buf),) = guard.plan_step(**lengths, req_to_token=step.req_to_token)
    if form == "numpy uint64 list":
        host = {k: v.clamp(min=0) for k, v in host.items()}
    lens = host["extend_seq_lens"].clamp(min=0) * (host["req_pool_indices"] != 0)
    assert buf.write_offsets[1:4].tolist() == torch.cumsum(lens, 0).tolist()
    assert sub.batch_size == 3 and sub.extend_seq_lens.dtype == torch.int64
