"""Unit tests of the dispatcher's API and its refusals: error texts kept from the launchers,
the write-capacity error and non-contiguous inputs. Batch sizes, chunk_size, strategies,
dtypes and host reads: ``test_dispatch_api.py``; the validate=True data checks:
``test_dispatch_validate.py``; the drop-in aliases: ``test_dispatch_drop_in.py``."""

from __future__ import annotations

import re
from functools import partial

import pytest
import torch
from _helpers import (
    as_kernel_kwargs,
    dispatch_cases,
    plan_kwargs,
    plan_outputs,
    rejected,
    scatter_kwargs,
    strided_view,
)
from conftest import DEVICE

import kvcanary_dispatch
from kvcanary_dispatch import (
    PLAN_STRATEGIES,
    SCATTER_STRATEGIES,
    plan_offsets,
    scatter_req_token_ids,
)
from kvcanary_dispatch.testing.cases import (
    check_plan,
    check_scatter,
    make_plan_case,
)
from kvcanary_dispatch.testing.properties import (
    record_launches,
)
from kvcanary_kernels import launch_plan_offsets_kernel as kernel_plan
from kvcanary_kernels import launch_scatter_req_token_ids_kernel as kernel_scatter
from kvcanary_kernels.args import PLAN_INPUT_NAMES, PLAN_OUTPUT_NAMES, SCRATCH_NAME

_scatter_case, _plan_case = dispatch_cases(DEVICE)


# ---------------------------------------------------------------- kernel texts kept


def _scatter_breakages():
    return {
        "flat_in_2d": lambda k: k.update(flat_in=k["flat_in"].view(-1, 1)),
        "offsets_2d": lambda k: k.update(offsets=k["offsets"][None]),
        "rpi_2d": lambda k: k.update(req_pool_indices=k["req_pool_indices"][None]),
        "pool_1d": lambda k: k.update(pool_out=k["pool_out"][0]),
        "flat_in_int32": lambda k: k.update(flat_in=k["flat_in"].int()),
        "rpi_float": lambda k: k.update(req_pool_indices=k["req_pool_indices"].float()),
        "pool_int64": lambda k: k.update(pool_out=k["pool_out"].long()),
        "offsets_short": lambda k: k.update(offsets=k["offsets"][:-1]),
        "offsets_long": lambda k: k.update(offsets=torch.cat([k["offsets"], k["offsets"][-1:]])),
        "pool_cols_strided": lambda k: k.update(pool_out=k["pool_out"][:, ::2]),
        "flat_in_strided": lambda k: k.update(flat_in=strided_view(k["flat_in"])),
    }


def _broken_scatter_kwargs(name: str, bs: int) -> tuple[dict, dict]:
    """Two copies of a scatter's keywords (the launcher's, the dispatcher's), broken by ``name``."""
    case = _scatter_case(bs)
    kernel_kw, kw = scatter_kwargs(case), scatter_kwargs(case)
    _scatter_breakages()[name](kernel_kw)
    _scatter_breakages()[name](kw)
    return kernel_kw, kw


@pytest.mark.parametrize("name", sorted(_scatter_breakages()))
def test_scatter_errors_keep_kernel_texts(name):
    """The dispatcher raises what the fixed-block launcher raises, word for word."""
    kernel_kw, kw = _broken_scatter_kwargs(name, 3)
    with pytest.raises((TypeError, ValueError)) as want:
        kernel_scatter(**kernel_kw)
    for call in (scatter_req_token_ids, kvcanary_dispatch.launch_scatter_req_token_ids_kernel):
        msg = rejected(type(want.value), lambda call=call: call(**kw), [kw["pool_out"]])
        assert msg == str(want.value)


@pytest.mark.parametrize("name", sorted(_scatter_breakages()))
def test_scatter_errors_keep_kernel_texts_past_the_block(name):
    """The same past the launcher's block: at 600 requests the dispatcher raises the fixed-block
    launcher's text for the same fault at 3, word for word, its numbers (shapes, lengths)
    those of the larger call."""
    kernel_kw, _ = _broken_scatter_kwargs(name, 3)
    with pytest.raises((TypeError, ValueError)) as want:
        kernel_scatter(**kernel_kw)
    _, kw = _broken_scatter_kwargs(name, 600)
    msg = rejected(type(want.value), lambda: scatter_req_token_ids(**kw), [kw["pool_out"]])
    words = re.compile(r"\d+")
    assert words.sub("#", msg) == words.sub("#", str(want.value)), msg
    if name in ("offsets_short", "offsets_long"):  # a length: the larger call's own
        assert "!= bs+1 (601)" in msg, msg


def _vo(kwargs: dict) -> str:
    """The verify offsets' keyword: the dispatcher's or upstream's."""
    return "out_verify_offsets" if "out_verify_offsets" in kwargs else "out_verify_offsets_scratch"


def _plan_breakages():
    dev = DEVICE
    return {
        "prefix_strided": lambda k: k.update(
            prefix_lens=torch.arange(2 * len(k["prefix_lens"]), device=dev)[::2]
        ),
        "r2t_transposed": lambda k: k.update(req_to_token=k["req_to_token"].t()),
        "rpi_int32": lambda k: k.update(req_pool_indices=k["req_pool_indices"].int()),
        "r2t_int64": lambda k: k.update(req_to_token=k["req_to_token"].long()),
        "lut_int32": lambda k: k.update(
            full_to_swa_index_mapping=torch.zeros(3, dtype=torch.int32, device=dev)
        ),
        "enable_int64": lambda k: k.update(out_verify_enable=k["out_verify_enable"].long()),
        "write_offsets_2d": lambda k: k.update(out_write_offsets=k["out_write_offsets"][None]),
        "r2t_1d": lambda k: k.update(req_to_token=k["req_to_token"][0]),
        "write_offsets_empty": lambda k: k.update(out_write_offsets=k["out_write_offsets"][:0]),
        "verify_capacity_negative": lambda k: k.update(verify_capacity=-1),
        "swa_negative": lambda k: k.update(swa_window_size=-1),
        "swa_past_int64": lambda k: k.update(swa_window_size=2**63),
        "prefix_short": lambda k: k.update(prefix_lens=k["prefix_lens"][:-1]),
        "extend_short": lambda k: k.update(extend_seq_lens=k["extend_seq_lens"][:1]),
        "verify_offsets_short": lambda k: k.update({_vo(k): k[_vo(k)][: len(k["prefix_lens"])]}),
        "num_valid_len2": lambda k: k.update(
            out_verify_num_valid=torch.zeros(2, dtype=torch.int32, device=dev)
        ),
        "write_offsets_mismatch": lambda k: k.update(out_write_offsets=k["out_write_offsets"][:-1]),
        "lut_empty": lambda k: k.update(
            full_to_swa_index_mapping=k["full_to_swa_index_mapping"][:0]
        ),
        "rpi_0d": lambda k: k.update(req_pool_indices=k["req_pool_indices"][0]),
        "seeds_0d": lambda k: k.update(
            out_write_seed_slot_indices=k["out_write_seed_slot_indices"][0]
        ),
        "prefix_meta": lambda k: k.update(prefix_lens=k["prefix_lens"].to("meta")),
    }


@pytest.mark.parametrize("name", sorted(_plan_breakages()))
def test_plan_errors_keep_kernel_texts(name):
    """``plan_offsets`` raises the launcher's texts (naming its own ``out_verify_offsets``)."""
    kw = plan_kwargs(_plan_case(5))
    _plan_breakages()[name](kw)
    with pytest.raises(ValueError) as want:
        kernel_plan(**as_kernel_kwargs(kw), bs_block=8)
    text = str(want.value).replace("out_verify_offsets_scratch", "out_verify_offsets")
    msg = rejected(ValueError, lambda: plan_offsets(**kw), plan_outputs(kw))
    assert msg == text


@pytest.mark.parametrize("name", sorted(_plan_breakages()))
def test_plan_drop_in_errors_keep_kernel_texts(name):
    """The drop-in alias takes upstream's keywords, so it must raise upstream's texts word for
    word, ``out_verify_offsets_scratch`` included."""
    kw = as_kernel_kwargs(plan_kwargs(_plan_case(5)))
    _plan_breakages()[name](kw)
    with pytest.raises(ValueError) as want:
        kernel_plan(**kw, bs_block=8)
    outs = [v for k, v in kw.items() if k.startswith("out_")]
    msg = rejected(ValueError, lambda: kvcanary_dispatch.launch_plan_offsets_kernel(**kw), outs)
    assert msg == str(want.value)


@pytest.mark.parametrize("strategy", PLAN_STRATEGIES)
def test_plan_window_past_int64_refused_and_the_largest_plans(strategy):
    """A window past int64 (the kernels' integer width) is refused naming the fix: the largest
    int64 window plans as the reference does, verifying every (non-negative) prefix whole."""
    case = make_plan_case(prefix_lens=[5, 0, 9, 3], extend_seq_lens=[1, 2, 0, 4], max_seq_len=12,
                          lut_len=7, swa_window_size=2**63 - 1, device=DEVICE)  # fmt: skip
    check_plan(partial(plan_offsets, strategy=strategy), case)
    # The fixed-block launcher takes the ordered checks (the dispatcher's fitting call does not)
    check_plan(kernel_plan, case, out_verify_name=SCRATCH_NAME)
    kw = {**case.inputs(), **case.fresh_outputs(), "swa_window_size": 2**63}
    msg = rejected(ValueError, lambda: plan_offsets(**kw, strategy=strategy), plan_outputs(kw))
    assert msg == (
        f"kv-canary: swa_window_size={2**63} exceeds {2**63 - 1}: the kernels take it as int64; "
        f"pass a window of at most {2**63 - 1} (any window at least as long as the longest "
        "prefix plans the same)"
    )


@pytest.mark.parametrize("strategy", PLAN_STRATEGIES)
def test_plan_negative_prefix_verifies_nothing_under_the_largest_window(strategy):
    """A negative prefix verifies nothing under any window. Under ``W = 2**63 - 1``, the
    contract's ``prefix - W`` would wrap in int64 (as it does upstream) and plan runs near
    ``2**63``; the runs are those of no window, and ``validate=True`` takes the call."""
    lengths = dict(prefix_lens=[-5, 3, -(2**62), 9], extend_seq_lens=[1, 2, 0, 4])
    case = make_plan_case(
        **lengths, max_seq_len=12, lut_len=7, swa_window_size=2**63 - 1, device=DEVICE
    )
    got = check_plan(partial(plan_offsets, strategy=strategy, validate=True), case)
    assert got["out_verify_offsets"][:5].tolist() == [0, 0, 3, 3, 12]
    assert got["out_verify_num_valid"].tolist() == [12] and got["out_verify_enable"].tolist() == [1]


def test_a_non_tensor_does_not_jump_the_ordered_checks():
    """A non-tensor where a tensor belongs leaves the ordered checks their order: an error
    they raise first for another argument is still the one raised."""
    kw = plan_kwargs(_plan_case(5), out_verify_num_valid=None, verify_capacity=-1)
    with pytest.raises(ValueError, match="verify_capacity must be non-negative"):
        plan_offsets(**kw)
    kw = plan_kwargs(_plan_case(5), out_write_offsets=None)
    kw["out_write_seed_slot_indices"] = kw["out_write_seed_slot_indices"].int()
    with pytest.raises(ValueError, match="out_write_seed_slot_indices must have dtype"):
        plan_offsets(**kw)
    for none in ("req_pool_indices", "pool_out", "offsets"):  # pool_out and offsets: read first
        kw = scatter_kwargs(_scatter_case(3), **{none: None})
        kw["flat_in"] = kw["flat_in"].view(-1, 1)
        with pytest.raises(ValueError, match="flat_in must be 1-D"):
            scatter_req_token_ids(**kw)
    for none in ("out_verify_offsets", "out_write_offsets"):
        kw = plan_kwargs(_plan_case(5), **{none: None})
        kw["prefix_lens"] = kw["prefix_lens"].int()
        with pytest.raises(ValueError, match="prefix_lens must have dtype torch.int64"):
            plan_offsets(**kw)


@pytest.mark.parametrize(
    "call, over, want",
    [
        # scatter: named at the rank checks, taken flat_in, offsets, req_pool_indices, pool_out
        ("scatter", {"flat_in": None, "offsets": "2-D"}, "flat_in must be a torch.Tensor"),
        ("scatter", {"offsets": None, "flat_in": "2-D"}, "flat_in must be 1-D"),
        ("scatter", {"offsets": None, "req_pool_indices": "int32"},
         "offsets must be a torch.Tensor"),
        # plan: a list at the contiguity check, the first of all
        ("plan", {"prefix_lens": "list", "extend_seq_lens": "int32"},
         "prefix_lens must be a torch.Tensor, got list"),
        # a None req_pool_indices when bs is read: after the dtypes
        ("plan", {"req_pool_indices": None, "prefix_lens": "int32"},
         "prefix_lens must have dtype torch.int64"),
        ("plan", {"req_pool_indices": None, "verify_capacity": -1},
         "req_pool_indices must be a torch.Tensor"),
        # the write buffers' None when their lengths are read: before the scalars
        ("plan", {"out_write_seed_slot_indices": None, "verify_capacity": -1},
         "out_write_seed_slot_indices must be a torch.Tensor"),
        # the scalars: verify_capacity's type, then the window's
        ("plan", {"verify_capacity": None, "swa_window_size": "tensor"},
         "verify_capacity must be an int, got None"),
    ],
)  # fmt: skip
def test_a_non_tensor_is_named_where_the_checks_first_touch_it(call, over, want):
    """The order ``docs/contract.md`` gives for an argument that is not a tensor (and for the
    scalars' types), each case against another fault it comes before or after."""

    def bad(name, value, kw):
        t = kw[name]
        forms = {"2-D": lambda: t.view(1, -1), "int32": lambda: t.int(),
                 "list": lambda: t.tolist(), "tensor": lambda: torch.tensor(1)}  # fmt: skip
        return forms[value]() if isinstance(value, str) else value

    if call == "scatter":
        kw, fn = scatter_kwargs(_scatter_case(3)), scatter_req_token_ids
    else:
        kw, fn = plan_kwargs(_plan_case(5)), plan_offsets
    kw.update({name: bad(name, value, kw) for name, value in over.items()})
    with pytest.raises((TypeError, ValueError)) as info:
        fn(**kw)
    assert str(info.value).startswith("kv-canary: ") and want in str(info.value), info.value


SCATTER_TENSORS = ("flat_in", "offsets", "req_pool_indices", "pool_out")


@pytest.mark.parametrize("name", SCATTER_TENSORS)
@pytest.mark.parametrize("value", [None, "list"])
def test_scatter_names_an_argument_that_is_not_a_tensor(name, value):
    """``None`` or a list where a tensor belongs: a ``TypeError`` naming it, before any
    launch, nothing written."""
    kw = scatter_kwargs(_scatter_case(3))
    outputs = [kw["pool_out"]] if name != "pool_out" else []
    kw[name] = kw[name].tolist() if value == "list" else None
    msg = rejected(TypeError, lambda: scatter_req_token_ids(**kw), outputs)
    got = type(kw[name]).__name__
    assert msg == f"kv-canary: scatter_req_token_ids {name} must be a torch.Tensor, got {got}"


@pytest.mark.parametrize("name", [*PLAN_INPUT_NAMES, *PLAN_OUTPUT_NAMES])
def test_plan_names_an_argument_that_is_not_a_tensor(name):
    """A list where a tensor belongs, or ``None`` (but for the optional LUT): a
    ``TypeError`` naming it, before any launch, the other outputs untouched; the drop-in
    names its verify offsets by its own keyword."""
    kw = plan_kwargs(_plan_case(5))
    assert kw["full_to_swa_index_mapping"] is not None
    outputs = [kw[k] for k in PLAN_OUTPUT_NAMES if k != name]
    for value in ([1, 2], None) if name != "full_to_swa_index_mapping" else ([1, 2],):
        kw[name] = value
        msg = rejected(TypeError, lambda: plan_offsets(**kw), outputs)
        got = type(value).__name__
        assert msg == f"kv-canary: plan_offsets {name} must be a torch.Tensor, got {got}"
    if name == "out_verify_offsets":
        drop_in = {SCRATCH_NAME if k == name else k: v for k, v in kw.items()}
        msg = rejected(
            TypeError, lambda: kvcanary_dispatch.launch_plan_offsets_kernel(**drop_in), outputs
        )
        assert msg == f"kv-canary: plan_offsets {SCRATCH_NAME} must be a torch.Tensor, got NoneType"


@pytest.mark.parametrize("lut", [True, False])
def test_valid_calls_skip_the_ordered_checks(lut, monkeypatch):
    """A valid call is accepted by the checks' one expression (the usual call's cost): the
    ordered checks, which name what is wrong, never run. Every breakage above goes through
    them instead, since it raises their text."""
    import kvcanary_kernels.plan_checks as plan_module
    import kvcanary_kernels.scatter_req_token_ids as scatter_module

    def ordered(*args, **kwargs):
        raise AssertionError("the ordered checks ran on a valid call")

    monkeypatch.setattr(scatter_module, "_check_tensor_kinds", ordered)
    monkeypatch.setattr(scatter_module, "require_same_device", ordered)
    monkeypatch.setattr(plan_module, "require_contiguous", ordered)
    monkeypatch.setattr(plan_module, "require_same_device", ordered)
    check_scatter(scatter_req_token_ids, _scatter_case(7))
    case = _plan_case(5, lut_len=7 if lut else None)
    assert (case.lut is not None) == lut
    check_plan(plan_offsets, case)


# ---------------------------------------------------------------- write capacity


@pytest.mark.parametrize("strategy", PLAN_STRATEGIES)
@pytest.mark.parametrize("bs,capacity", [(5, 3), (4097, 4096), (1, 0)])
def test_plan_write_capacity_error(strategy, bs, capacity):
    kw = plan_kwargs(_plan_case(bs), strategy=strategy)
    kw["out_write_offsets"] = kw["out_write_offsets"][: capacity + 1].clone()
    kw["out_write_seed_slot_indices"] = kw["out_write_seed_slot_indices"][:capacity].clone()
    msg = rejected(ValueError, lambda: plan_offsets(**kw), plan_outputs(kw))
    assert f"bs={bs} exceeds write_req_capacity={capacity}" in msg
    assert "out_write_seed_slot_indices" in msg  # the remedy: size the outputs for bs


def test_plan_write_capacity_remedy_names_real_api():
    kw = plan_kwargs(_plan_case(5))
    kw["out_write_offsets"] = kw["out_write_offsets"][:4].clone()
    kw["out_write_seed_slot_indices"] = kw["out_write_seed_slot_indices"][:3].clone()
    with pytest.raises(ValueError) as info:
        plan_offsets(**kw)
    groups = re.findall(r"kvcanary_dispatch\.(\w+)((?: / \w+)*)", str(info.value))
    names = [n for g in groups for n in [g[0], *re.findall(r"\w+", g[1])]]
    assert names == ["split_forward_step", "ForwardStepGuard"], str(info.value)
    for name in names:
        assert hasattr(kvcanary_dispatch, name), f"remedy names kvcanary_dispatch.{name}"


# ---------------------------------------------------------------- non-contiguous inputs


@pytest.mark.parametrize("arg", ["flat_in", "req_pool_indices"])
@pytest.mark.parametrize("strategy", SCATTER_STRATEGIES)
def test_scatter_non_contiguous_inputs(arg, strategy):
    """A strided 1-D input gives the reference's result or a ValueError before any launch,
    never a silently wrong pool (strided ``offsets``: ``test_scatter_strided_offsets``)."""
    case = _scatter_case(6, seed=16, spare_rows=4)

    def impl(**kw):
        strided = {**kw, arg: strided_view(kw[arg])}
        try:
            with record_launches() as launches:
                scatter_req_token_ids(**strided, strategy=strategy)
        except ValueError as err:
            assert not launches and f"{arg} must be contiguous" in str(err)
            scatter_req_token_ids(**kw, strategy=strategy)

    check_scatter(impl, case)


@pytest.mark.parametrize("place", ["device", "host"])
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("strategy", SCATTER_STRATEGIES)
def test_scatter_strided_offsets(strategy, dtype, place):
    """Offsets the kernels read in place (int64 on ``pool_out``'s device) must be contiguous:
    strided ones are a ValueError before any launch, the pool untouched. Offsets the call
    copies first (int32, widened; or host offsets uploaded for a GPU pool) may have any stride,
    and the result is the reference's, the caller's tensor left as it was."""
    case = _scatter_case(700, seed=17, spare_rows=4)
    if place == "host" and DEVICE == "cpu":
        pytest.skip("host offsets for a GPU pool need a GPU")
    in_place = dtype is torch.int64 and place == "device"
    strided = strided_view(case.offsets.to(dtype))
    if place == "host":
        strided = strided_view(strided.cpu())
    assert strided.stride() == (2,)
    before = strided.clone()
    if in_place:
        kw = scatter_kwargs(case, offsets=strided)
        call = partial(scatter_req_token_ids, **kw, strategy=strategy)
        msg = rejected(ValueError, call, [kw["pool_out"], kw["flat_in"], strided])
        assert msg.endswith("offsets must be contiguous; pass offsets.contiguous()"), msg
        return
    check_scatter(
        lambda **kw: scatter_req_token_ids(**{**kw, "offsets": strided}, strategy=strategy), case
    )
    assert torch.equal(strided, before)


@pytest.mark.parametrize("strategy", PLAN_STRATEGIES)
def test_one_element_outputs_of_any_stride(strategy):
    """The three one-element outputs may have any stride (each is contiguous): such a call
    is exact, though it leaves the one-pass check for the ordered checks."""
    case = _plan_case(40)

    def impl(**kw):
        names = ("out_verify_num_valid", "out_verify_enable", "out_write_num_valid_reqs")
        wides = {n: torch.full((3,), 99, dtype=torch.int32, device=DEVICE) for n in names}
        strided = {n: w[::2][1:] for n, w in wides.items()}  # element 2, stride 2
        plan_offsets(**{**kw, **strided}, strategy=strategy)
        for name, wide in wides.items():
            assert wide[0] == wide[1] == 99, name  # nothing written beside it
            kw[name].copy_(wide[2:])

    check_plan(impl, case)
