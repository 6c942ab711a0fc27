"""The fixed-block launchers' errors, by type and text, with outputs untouched by a rejected
call (their results: tests/test_kernels.py)."""

from __future__ import annotations

import re
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from _helpers import as_kernel_kwargs, fixed_block_plan, plan_case_32
from conftest import DEVICE

from kvcanary_dispatch import launch_plan_offsets_kernel as drop_in_plan
from kvcanary_dispatch import plan_offsets
from kvcanary_dispatch.testing.cases import (
    check_plan,
    check_scatter,
    make_plan_case,
    make_scatter_case,
)
from kvcanary_kernels import (
    PLAN_BATCH_BLOCK,
    SCATTER_BATCH_BLOCK,
    launch_plan_offsets_kernel,
    launch_scatter_req_token_ids_kernel,
)
from kvcanary_kernels._checks import require_block, require_same_device
from kvcanary_kernels.args import SCRATCH_NAME


def _scatter_args(bs=3, width=4):
    case = make_scatter_case([2] * bs, width=width, device=DEVICE)
    return case, case.fresh_pool()


# (argument, what it is replaced with, the launcher's text after "scatter_req_token_ids ")
SCATTER_SHAPE_ERRORS = [
    ("flat_in", lambda t: t.view(-1, 1), "flat_in must be 1-D, got shape (6, 1)"),
    ("offsets", lambda t: t[None], "offsets must be 1-D, got shape (1, 4)"),
    ("req_pool_indices", lambda t: t[None], "req_pool_indices must be 1-D, got shape (1, 3)"),
    ("pool_out", lambda t: t[0], "pool_out must be 2-D, got shape (4,)"),
    ("offsets", lambda t: t[:-1], "offsets length 3 != bs+1 (4)"),
]
SCATTER_DTYPE_ERRORS = [
    ("flat_in", lambda t: t.int(), "flat_in must be int64, got torch.int32"),
    ("offsets", lambda t: t.int(), "offsets must be int64, got torch.int32"),
    ("req_pool_indices", lambda t: t.float(), "req_pool_indices must be int64, got torch.float32"),
    ("pool_out", lambda t: t.long(), "pool_out must be int32, got torch.int64"),
]
SCATTER_ERRORS = [(*e, ValueError) for e in SCATTER_SHAPE_ERRORS] + [
    (*e, TypeError) for e in SCATTER_DTYPE_ERRORS
]


@pytest.mark.parametrize("arg,mutate,text,exc", SCATTER_ERRORS)
def test_scatter_errors(arg, mutate, text, exc):
    case, pool = _scatter_args()
    kwargs = case.kwargs(pool)
    kwargs[arg] = mutate(kwargs[arg])
    before = pool.clone()
    text = f"kv-canary: scatter_req_token_ids {text}"
    with pytest.raises(exc, match=f"^{re.escape(text)}$"):
        launch_scatter_req_token_ids_kernel(**kwargs)
    assert torch.equal(pool, before)


@pytest.mark.parametrize("block", [4, SCATTER_BATCH_BLOCK])
def test_scatter_cap_error(block):
    case, pool = _scatter_args(bs=block)
    before = pool.clone()
    text = (
        f"kv-canary: scatter_req_token_ids bs+1={block + 1} exceeds BATCH_BLOCK={block}; "
        f"this fixed-block launcher takes bs+1 <= batch_block <= {SCATTER_BATCH_BLOCK}: call "
        "kvcanary_dispatch.scatter_req_token_ids, which takes any batch size"
    )
    with pytest.raises(ValueError, match=f"^{re.escape(text)}$"):
        launch_scatter_req_token_ids_kernel(**case.kwargs(pool), batch_block=block)
    assert torch.equal(pool, before)


@pytest.mark.parametrize("block", [0, 3, 1024])
def test_scatter_bad_block(block):
    case, pool = _scatter_args()
    with pytest.raises(ValueError, match=r"batch_block=\d+ must be a power of two in \[1, 512\]"):
        launch_scatter_req_token_ids_kernel(**case.kwargs(pool), batch_block=block)


def test_scatter_zero_tokens_launches_nothing(monkeypatch):
    """No token: no launch (every lane of one would be masked, so the pool alone cannot tell),
    the pool untouched."""
    import kvcanary_kernels.scatter_req_token_ids as module

    bound, binds = module._bound, []
    monkeypatch.setattr(module, "_bound", lambda *blocks: binds.append(blocks) or bound(*blocks))
    case, pool = _scatter_args()
    before = pool.clone()
    empty = torch.empty(0, dtype=torch.int64, device=DEVICE)
    zeros = torch.zeros(4, dtype=torch.int64, device=DEVICE)
    launch_scatter_req_token_ids_kernel(
        flat_in=empty, offsets=zeros, req_pool_indices=case.req_pool_indices, pool_out=pool
    )
    assert binds == [] and torch.equal(pool, before)
    launch_scatter_req_token_ids_kernel(**case.kwargs(pool))  # the spy sees a launch
    assert len(binds) == 1


def _plan_kwargs(bs=3, capacity=None, lut=False):
    case = make_plan_case(
        prefix_lens=[4] * bs,
        extend_seq_lens=[1] * bs,
        max_seq_len=8,
        lut_len=5 if lut else None,
        swa_window_size=2 if lut else 0,
        device=DEVICE,
    )
    out = case.fresh_outputs()
    if capacity is not None:
        out["out_write_offsets"] = out["out_write_offsets"][: capacity + 1].clone()
        out["out_write_seed_slot_indices"] = out["out_write_seed_slot_indices"][:capacity].clone()
    return as_kernel_kwargs({**case.inputs(), **out})


PLAN_ERRORS = [
    (
        lambda k: k.update(prefix_lens=torch.arange(6, device=DEVICE)[::2]),
        "kv-canary: prefix_lens must be contiguous; pass prefix_lens.contiguous()",
    ),
    (
        lambda k: k.update(req_to_token=k["req_to_token"].t()),
        "kv-canary: req_to_token must be contiguous; pass req_to_token.contiguous()",
    ),
    (
        lambda k: k.update(req_pool_indices=k["req_pool_indices"].int()),
        "kv-canary: req_pool_indices must have dtype torch.int64, got torch.int32; pass "
        "req_pool_indices.to(torch.int64)",
    ),
    (
        lambda k: k.update(req_to_token=k["req_to_token"].long()),
        "kv-canary: req_to_token must have dtype torch.int32, got torch.int64; pass "
        "req_to_token.to(torch.int32)",
    ),
    (
        lambda k: k.update(
            full_to_swa_index_mapping=torch.zeros(3, dtype=torch.int32, device=DEVICE)
        ),
        "kv-canary: full_to_swa_index_mapping must have dtype torch.int64, got torch.int32; pass "
        "full_to_swa_index_mapping.to(torch.int64)",
    ),
    (
        lambda k: k.update(out_verify_enable=k["out_verify_enable"].long()),
        "kv-canary: out_verify_enable must have dtype torch.int32, got torch.int64; pass "
        "out_verify_enable.to(torch.int32)",
    ),
    (
        lambda k: k.update(out_write_offsets=k["out_write_offsets"][None]),
        "kv-canary: out_write_offsets must be 1-D, got shape (1, 7)",
    ),
    (
        lambda k: k.update(req_to_token=k["req_to_token"][0]),
        "kv-canary: req_to_token must be 2-D, got shape (8,)",
    ),
    (
        lambda k: k.update(out_write_offsets=k["out_write_offsets"][:0]),
        "kv-canary: write_offsets_len must be positive, got 0; size out_write_offsets to "
        "len(out_write_seed_slot_indices) + 1 elements",
    ),
    (
        lambda k: k.update(verify_capacity=-1),
        "kv-canary: verify_capacity must be non-negative, got -1; pass a non-negative int",
    ),
    (
        lambda k: k.update(swa_window_size=-1),
        "kv-canary: swa_window_size must be non-negative, got -1; pass a non-negative int (0 "
        "for no window)",
    ),
    (
        lambda k: k.update(prefix_lens=k["prefix_lens"][:2]),
        "kv-canary: prefix_lens length must be 3, got 2",
    ),
    (
        lambda k: k.update(extend_seq_lens=k["extend_seq_lens"][:1]),
        "kv-canary: extend_seq_lens length must be 3, got 1",
    ),
    (
        lambda k: k.update(out_verify_offsets_scratch=k["out_verify_offsets_scratch"][:3]),
        "kv-canary: out_verify_offsets_scratch length must be >= 4, got 3",
    ),
    (
        lambda k: k.update(out_verify_num_valid=torch.zeros(2, dtype=torch.int32, device=DEVICE)),
        "kv-canary: out_verify_num_valid length must be 1, got 2",
    ),
    (
        lambda k: k.update(out_write_offsets=k["out_write_offsets"][:5]),
        "kv-canary: write_offsets_len must equal write_req_capacity + 1, got 5 and 6; size "
        "out_write_offsets to len(out_write_seed_slot_indices) + 1 = 7 elements",
    ),
    (
        lambda k: k.update(verify_capacity=2**31),
        "kv-canary: verify_capacity=2147483648 exceeds 2147483647: the int32 "
        "out_verify_num_valid cannot count past it; pass verify_capacity="
        "min(verify_capacity, 2147483647) (a step with more verify entries turns its verify off)",
    ),
]


@pytest.mark.parametrize("mutate,text", PLAN_ERRORS)
def test_plan_errors(mutate, text):
    kw = _plan_kwargs()
    outs = {k: v.clone() for k, v in kw.items() if k.startswith("out_")}
    mutate(kw)
    with pytest.raises(ValueError, match=f"^{re.escape(text)}$"):
        launch_plan_offsets_kernel(**kw)
    for k, v in outs.items():
        if kw[k].shape == v.shape:
            assert torch.equal(kw[k], v), k


def test_plan_window_without_lut_is_accepted():
    """Upstream's launcher accepts ``swa_window_size > 0`` without a LUT: the window applies to
    the verify lengths and seeds are not translated."""
    case = make_plan_case(
        prefix_lens=[1, 7, 16, 3, 0],
        extend_seq_lens=[1, 1, 0, 2, 4],
        max_seq_len=16,
        lut_len=None,
        swa_window_size=4,
        device=DEVICE,
    )
    assert case.lut is None and case.swa_window_size == 4
    got = check_plan(launch_plan_offsets_kernel, case, out_verify_name="out_verify_offsets_scratch")
    # The window shortens verify lengths to min(prefix, 4): 1 + 4 + 4 + 3 + 0.
    assert int(got["out_verify_offsets"][case.bs]) == 12


@pytest.mark.parametrize("block", [2, PLAN_BATCH_BLOCK])
def test_plan_bs_cap_error(block):
    bs = block + 1
    kw = _plan_kwargs(bs=bs)
    outs = {k: v.clone() for k, v in kw.items() if k.startswith("out_")}
    text = (
        f"kv-canary: offsets kernel bs must be in [0, {block}], got {bs}; this fixed-block "
        f"launcher takes bs <= bs_block <= {PLAN_BATCH_BLOCK}: call "
        "kvcanary_dispatch.plan_offsets, which takes any batch size"
    )
    with pytest.raises(ValueError, match=f"^{re.escape(text)}$"):
        launch_plan_offsets_kernel(**kw, bs_block=block)
    for k, v in outs.items():
        assert torch.equal(kw[k], v), k


def test_plan_write_capacity_error():
    kw = _plan_kwargs(bs=3, capacity=2)
    outs = {k: v.clone() for k, v in kw.items() if k.startswith("out_")}
    with pytest.raises(ValueError, match=r"^kv-canary: bs=3 exceeds write_req_capacity=2$"):
        launch_plan_offsets_kernel(**kw)
    for k, v in outs.items():
        assert torch.equal(kw[k], v), k


@pytest.mark.skipif(DEVICE != "cuda", reason="needs a second device")
def test_plan_device_error():
    kw = _plan_kwargs()
    kw["prefix_lens"] = kw["prefix_lens"].cpu()
    text = (
        "kv-canary: prefix_lens must be on out_verify_offsets_scratch's device cuda:0, got cpu; "
        "pass prefix_lens.to(out_verify_offsets_scratch.device)"
    )
    with pytest.raises(ValueError, match=f"^{re.escape(text)}$"):
        launch_plan_offsets_kernel(**kw)


def test_meta_tensors_among_cpu_ones_refused():
    """CPU and meta tensors both report ``get_device() == -1``: the device check must still
    tell them apart."""
    case, pool = _scatter_args()
    kwargs = {k: v.cpu() for k, v in case.kwargs(pool).items()}
    kwargs["pool_out"] = torch.empty(pool.shape, dtype=torch.int32, device="meta")
    text = (
        "kv-canary: flat_in must be on pool_out's device meta, got cpu; pass "
        "flat_in.to(pool_out.device)"
    )
    with pytest.raises(ValueError, match=f"^{re.escape(text)}$"):
        launch_scatter_req_token_ids_kernel(**kwargs)
    kw = {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in _plan_kwargs().items()}
    kw["prefix_lens"] = kw["prefix_lens"].to("meta")
    text = (
        "kv-canary: prefix_lens must be on out_verify_offsets_scratch's device cpu, got meta; "
        "pass prefix_lens.to(out_verify_offsets_scratch.device)"
    )
    with pytest.raises(ValueError, match=f"^{re.escape(text)}$"):
        launch_plan_offsets_kernel(**kw)


@pytest.mark.parametrize(
    "name,value",
    [("flat_in", None), ("flat_in", [1, 2]), ("offsets", (0, 2)), ("pool_out", None)],
)
def test_scatter_launcher_names_a_non_tensor(name, value):
    """A non-tensor where the fixed-block scatter takes a tensor is its ``TypeError`` naming the
    argument, not an ``AttributeError`` from inside the checks; the pool untouched."""
    case, pool = _scatter_args()
    kwargs = {**case.kwargs(pool), name: value}
    before = pool.clone()
    text = f"kv-canary: scatter_req_token_ids {name} must be a torch.Tensor, got "
    with pytest.raises(TypeError, match=f"^{re.escape(text)}{type(value).__name__}$"):
        launch_scatter_req_token_ids_kernel(**kwargs)
    assert torch.equal(pool, before)


@pytest.mark.parametrize(
    "name,value",
    [
        ("req_pool_indices", None),
        ("prefix_lens", [4, 4, 4]),
        ("req_to_token", None),
        ("out_verify_enable", None),
    ],
)
def test_fixed_block_plan_names_a_non_tensor(name, value):
    """The fixed-block plan likewise (a ``None`` that every check passed over included: its
    address is read before the launch); no output written."""
    kwargs = {**_plan_kwargs(), name: value}
    outs = {k: v.clone() for k, v in kwargs.items() if k.startswith("out_") and v is not None}
    text = f"kv-canary: plan_offsets {name} must be a torch.Tensor, got {type(value).__name__}"
    with pytest.raises(TypeError, match=f"^{re.escape(text)}$"):
        launch_plan_offsets_kernel(**kwargs)
    for k, v in outs.items():
        assert torch.equal(kwargs[k], v), k


def test_launch_blocks_take_numpy_integers():
    """A block given as a numpy integer is taken as its value (as a chunk size is): the batch
    it fits runs right, and one request more is refused naming that block."""
    case = make_scatter_case([3, 0, 5], width=6, seed=2, device=DEVICE)
    check_scatter(launch_scatter_req_token_ids_kernel, case, batch_block=np.int64(4))
    over = make_scatter_case([3, 0, 5, 1], width=6, seed=2, device=DEVICE)
    with pytest.raises(ValueError, match=re.escape("bs+1=5 exceeds BATCH_BLOCK=4;")):
        check_scatter(launch_scatter_req_token_ids_kernel, over, batch_block=np.int64(4))
    plan = plan_case_32(8, 5, extend=(0, 5), verify_capacity=40, device=DEVICE)
    check_plan(fixed_block_plan, plan, bs_block=np.int32(8))
    over = plan_case_32(9, 5, extend=(0, 5), verify_capacity=40, device=DEVICE)
    with pytest.raises(ValueError, match=re.escape("bs must be in [0, 8], got 9")):
        check_plan(fixed_block_plan, over, bs_block=np.int32(8))


@pytest.mark.parametrize("block", [None, 4.0, True, "4", np.float64(4), torch.tensor(4)])
def test_launch_blocks_must_be_ints(block):
    """A block that is not an integer (``None``, a float, a bool, a tensor, whose value only a
    read-back gives) is the block's own error before anything is read, not a Triton failure or
    a launch of a one-lane block."""
    case, pool = _scatter_args()
    before = pool.clone()
    with pytest.raises(ValueError, match=r"^kv-canary: batch_block=.* must be a power of two in"):
        launch_scatter_req_token_ids_kernel(**case.kwargs(pool), batch_block=block)
    assert torch.equal(pool, before)
    with pytest.raises(ValueError, match=r"^kv-canary: bs_block=.* must be a power of two in"):
        launch_plan_offsets_kernel(**_plan_kwargs(bs=1), bs_block=block)


@pytest.mark.parametrize("fn", ["dispatch", "drop-in"])
def test_verify_offsets_of_exactly_bs_plus_one_pass_the_ordered_checks(fn):
    """``bs + 1`` verify offsets are enough on the ordered checks too (a numpy
    ``verify_capacity`` leaves the fast head for them), and every byte equals the reference."""
    case = make_plan_case(prefix_lens=[2, 3, 0, 4, 1], extend_seq_lens=[1, 2, 3, 0, 2],
                          max_seq_len=8, lut_len=5, swa_window_size=2, device=DEVICE)  # fmt: skip
    case = replace(case, verify_len=case.bs + 1, verify_capacity=np.int64(case.verify_capacity))
    if fn == "dispatch":
        check_plan(plan_offsets, case)
    else:
        check_plan(drop_in_plan, case, out_verify_name=SCRATCH_NAME)


def test_devices_are_told_apart_by_their_index():
    """Tensors on two GPUs of one host are on different devices: the refusal names both (stand-
    ins carry the devices: no GPU is needed); a ``None`` (an absent optional input) passes."""
    ref = SimpleNamespace(device=torch.device("cuda", 0))
    same = SimpleNamespace(device=torch.device("cuda", 0))
    require_same_device(ref, "out", [(same, "y"), (None, "z")])
    other = SimpleNamespace(device=torch.device("cuda", 1))
    with pytest.raises(ValueError) as err:
        require_same_device(ref, "out", [(same, "y"), (other, "x")])
    assert str(err.value) == (
        "kv-canary: x must be on out's device cuda:0, got cuda:1; pass x.to(out.device)"
    )


@pytest.mark.parametrize("block", [4.0, "4", None, 3, 1024])
def test_a_bad_block_is_named_as_given(block):
    """A launch block that is not an integer, not a power of two or past the module's block is
    refused naming the value as the caller gave it."""
    with pytest.raises(ValueError) as err:
        require_block(block, "batch_block", 512)
    assert str(err.value) == f"kv-canary: batch_block={block!r} must be a power of two in [1, 512]"
