"""The drop-ins ``kvcanary_dispatch.launch_scatter_req_token_ids_kernel`` and
``kvcanary_dispatch.launch_plan_offsets_kernel`` called directly (no integration patch, so the
scalars as they are), against sglang 0.5.23's own launchers (Triton interpreter, CPU): keyword
calls only, edge data byte for byte, scatter beyond the cap off the exact CSR and at bs = 0,
sglang's refusals with its type and text, the negative window the drop-in refuses, and
out-of-order offsets, on which sglang's kernel writes before a row and the drop-in does not."""

from __future__ import annotations

import re

import pytest
import torch
from _sglang_cases import POISON32, POISON64, make_scatter_case

import kvcanary_dispatch as kd

pytest_plugins = ["_sglang_fixtures"]  # the kv fixture (skips without sglang / interpreter)

_SCALAR_OUTS = ("out_verify_num_valid", "out_verify_enable", "out_write_num_valid_reqs")


def _plan_call(
    bs, seed, *, cap=None, lut=False, window=0, vc=10, width=8, neg=False, scratch=4097
) -> dict:
    """A call of upstream's offsets launcher (its 13 keywords), every output poisoned.
    ``neg``: negative prefix/extend lengths and negative slots in ``req_to_token``; ``lut``: a
    30-entry LUT, shorter than the slots (up to 59), so translation clamps."""
    g = torch.Generator().manual_seed(seed)
    rows = torch.randperm(bs, generator=g) + 1
    rows = torch.where(torch.rand(bs, generator=g) < 0.2, 0, rows)
    lo = -3 if neg else 0
    prefix = torch.randint(lo, width + 1, (bs,), generator=g)
    extend = torch.randint(lo, 5, (bs,), generator=g)
    r2t = torch.randint(-2 if neg else 1, 60, (bs + 1, width), generator=g, dtype=torch.int32)
    cap = bs if cap is None else cap
    return dict(
        req_pool_indices=rows,
        prefix_lens=prefix,
        extend_seq_lens=extend,
        req_to_token=r2t,
        full_to_swa_index_mapping=torch.randperm(30, generator=g) if lut else None,
        out_verify_offsets_scratch=torch.full((scratch,), POISON64),
        out_write_offsets=torch.full((cap + 1,), POISON64),
        out_write_seed_slot_indices=torch.full((cap,), POISON64),
        **{n: torch.full((1,), POISON32, dtype=torch.int32) for n in _SCALAR_OUTS},
        swa_window_size=window,
        verify_capacity=vc,
    )


def _outs(kw: dict) -> dict:
    return {k: v for k, v in kw.items() if k.startswith("out_") or k == "pool_out"}


def _fresh(kw: dict) -> dict:
    """``kw`` with its outputs cloned (inputs kept as they are: a clone would drop strides)."""
    return {k: (v.clone() if k in _outs(kw) else v) for k, v in kw.items()}


def _run(fn, kw: dict):
    kw = _fresh(kw)
    try:
        return ("ok", fn(**kw), kw)
    except Exception as err:  # noqa: BLE001 (the outcome is compared)
        return (type(err), str(err), kw)


def _assert_same(kv_fn, drop_in, kw: dict, what: str = "") -> None:
    want, got = _run(kv_fn, kw), _run(drop_in, kw)
    assert got[0] == want[0], (what, want[:2], got[:2])
    if want[0] == "ok":
        assert got[1] is None and want[1] is None
    for name in _outs(kw):
        assert torch.equal(got[2][name], want[2][name]), (what, name)


@pytest.mark.parametrize("lut", [False, True])
@pytest.mark.parametrize("window", [-1, -2])
def test_plan_drop_in_refuses_a_negative_window_and_its_fix_plans_as_sglang(kv, window, lut):
    """sglang's launcher reads ``swa_window_size < 0`` as full attention; the drop-in refuses
    it, writing nothing, with the text the README gives, and the fix it names (``max(window,
    0)``) plans what sglang's launcher plans for the negative window."""
    kw = _plan_call(40, seed=5, lut=lut, window=window, vc=200)
    refused = _run(kd.launch_plan_offsets_kernel, kw)
    text = f"kv-canary: swa_window_size must be non-negative, got {window}; pass a non-negative"
    assert refused[0] is ValueError and refused[1].startswith(text), refused[:2]
    for name in _outs(kw):
        assert torch.equal(refused[2][name], kw[name]), name  # nothing written
    fixed = {**kw, "swa_window_size": max(window, 0)}
    want, got = (
        _run(kv.offsets.launch_plan_offsets_kernel, kw),
        _run(kd.launch_plan_offsets_kernel, fixed),
    )
    assert want[0] == got[0] == "ok", (want[:2], got[:2])
    for name in _outs(kw):
        assert torch.equal(got[2][name], want[2][name]), name


def test_drop_ins_refuse_positional_calls_in_upstreams_order_as_sglang(kv):
    """Upstream's launchers are keyword-only: a call with the arguments in upstream's order,
    all or the first one positional, is a ``TypeError`` for sglang and for the drop-ins, and
    writes nothing. Catches a drop-in given positional parameters (e.g. ``*args`` mapped onto
    upstream's order, or the plan drop-in's ``**keywords`` widened to ``*args, **keywords``)."""
    sc = vars(make_scatter_case(6, seed=3))
    pc = _plan_call(6, seed=1)
    for up, dn, kw in (
        (
            kv.scatter.launch_scatter_req_token_ids_kernel,
            kd.launch_scatter_req_token_ids_kernel,
            sc,
        ),
        (kv.offsets.launch_plan_offsets_kernel, kd.launch_plan_offsets_kernel, pc),
    ):
        names = list(kw)
        for n_positional in (len(names), 1):
            for fn in (up, dn):
                call = _fresh(kw)
                before = {k: v.clone() for k, v in _outs(call).items()}
                args = [call[k] for k in names[:n_positional]]
                rest = {k: call[k] for k in names[n_positional:]}
                with pytest.raises(TypeError, match="positional argument"):
                    fn(*args, **rest)
                for k, v in before.items():
                    assert torch.equal(call[k], v), (fn, k)


_PLAN_GRID = [
    # (bs, lut, window, verify_capacity, extra write capacity, negative data)
    (0, False, 0, 0, 0, False),
    (0, True, 3, 0, 3, False),
    (1, False, 0, 0, 0, True),
    (40, False, 0, 7, 3, True),
    (40, True, 0, 1000, 0, True),
    (40, True, 2, 7, 0, True),
    (40, False, 100, 1000, 3, True),
    (40, True, 100, 0, 3, False),
    (300, True, 3, 1000, 0, True),
]


@pytest.mark.parametrize("bs,lut,window,vc,extra,neg", _PLAN_GRID)
def test_plan_drop_in_equals_sglangs_launcher_on_edge_data(kv, bs, lut, window, vc, extra, neg):
    """The drop-in called directly (not through the patch) against sglang's Triton launcher,
    byte for byte over poisoned outputs (nothing past index ``bs`` written), returning
    ``None``: bs = 0; padding rows; negative prefix and extend lengths; negative slots in
    ``req_to_token`` (a LUT passes them through); slots past the LUT's end (clamped);
    a LUT with window 0 (still translates); a window longer than every prefix; verify
    capacity 0 with nothing to verify (enable 1) and below the total (enable 0, count
    clamped); write buffers larger than ``bs``. Catches, e.g., ``verify_total <
    verify_capacity`` for ``<=`` in ``_plan_store_scalars``, dropping ``slot < 0`` from the
    LUT pass-through, or ``tl.maximum(extend, 0)`` removed from ``_plan_lens``."""
    kw = _plan_call(bs, seed=bs + vc, lut=lut, window=window, vc=vc, neg=neg, cap=bs + extra)
    _assert_same(kv.offsets.launch_plan_offsets_kernel, kd.launch_plan_offsets_kernel, kw)


@pytest.mark.parametrize("bs", [1, 6, 300])
def test_scatter_drop_in_equals_sglang_on_short_flat_in_and_column_windows(kv, bs):
    """Within sglang's cap, where sglang's kernel is well defined off the CSR precondition:
    ``flat_in`` shorter than ``offsets[bs]`` (only the tokens present are copied), and a pool
    that is a column window ``[lo, hi)`` of a wider buffer (row pitch > width; zero and one
    columns too): the whole buffer, window and gaps, byte for byte. Catches a row pitch taken
    from the width instead of ``stride(0)``, or a read of ``flat_in`` past its end."""
    case = vars(make_scatter_case(bs, seed=bs, max_len=8, width=5))
    up, dn = kv.scatter.launch_scatter_req_token_ids_kernel, kd.launch_scatter_req_token_ids_kernel
    n = case["flat_in"].shape[0]
    for cut in {1, n // 2, n}:
        _assert_same(up, dn, {**case, "flat_in": case["flat_in"][: n - cut]}, f"short by {cut}")
    rows = case["pool_out"].shape[0]
    for lo, hi in ((3, 8), (7, 12), (4, 5), (5, 5)):
        bufs = [torch.full((rows, 12), POISON32, dtype=torch.int32) for _ in range(2)]
        for fn, buf in zip((up, dn), bufs, strict=True):
            assert fn(**{**case, "pool_out": buf[:, lo:hi]}) is None
        assert torch.equal(bufs[0], bufs[1]), (lo, hi)


@pytest.mark.parametrize(
    "bs,width,mode",
    [
        (600, 1, "head"),
        (600, 64, "short"),
        (1500, 5, "long"),
        (1500, 64, "head"),
        (513, 1, "short"),
    ],
)
def test_scatter_drop_in_beyond_the_cap_equals_sglangs_reference_off_the_exact_csr(
    kv, bs, width, mode
):
    """Beyond sglang's ``bs + 1 <= 512`` cap, with ordered offsets that do not span
    ``flat_in`` exactly (the docstring's promise: the fixed-block bytes, nothing read outside
    ``flat_in``): a head gap (``offsets[0] = 5``), ``flat_in`` a third short, or 17 tokens
    long; widths 1, 5 and 64 (``auto`` picks ``rows`` or ``capped``), runs up to 40 tokens.
    Equal to sglang's torch reference. Catches ``capped``/``rows`` shapes or tails that
    assume ``offsets[0] == 0`` or ``offsets[bs] == len(flat_in)``."""
    g = torch.Generator().manual_seed(bs + width)
    lens = torch.randint(0, 41, (bs,), generator=g)
    offsets = torch.zeros(bs + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(lens, 0)
    n = int(offsets[-1])
    if mode == "head":
        offsets, n = offsets + 5, n + 5
    n = {"short": n - n // 3, "long": n + 17}.get(mode, n)
    kw = dict(
        flat_in=torch.randint(-(2**40), 2**40, (n,), generator=g),
        offsets=offsets,
        req_pool_indices=torch.randperm(bs + 2, generator=g)[:bs],
    )
    pool = torch.full((bs + 2, width), POISON32, dtype=torch.int32)
    want, got = pool.clone(), pool.clone()
    kv.scatter_ref.scatter_req_token_ids_torch_reference(**kw, pool_out=want)
    assert kd.launch_scatter_req_token_ids_kernel(**kw, pool_out=got) is None
    assert torch.equal(got, want)
    assert (want != POISON32).any()


def test_scatter_drop_in_at_bs_0_as_sglang(kv):
    """bs = 0 (one offset, no tokens) into a poisoned pool, zero-row and zero-width pools
    too: no write and ``None``, as sglang."""
    up, dn = kv.scatter.launch_scatter_req_token_ids_kernel, kd.launch_scatter_req_token_ids_kernel
    for shape in ((3, 4), (0, 4), (3, 0)):
        kw = dict(
            flat_in=torch.zeros(0, dtype=torch.int64),
            offsets=torch.zeros(1, dtype=torch.int64),
            req_pool_indices=torch.zeros(0, dtype=torch.int64),
            pool_out=torch.full(shape, POISON32, dtype=torch.int32),
        )
        _assert_same(up, dn, kw, str(shape))


_SCATTER_FAULTS = {  # faults sglang refuses, not in test_sglang_first_errors' list
    "flat_in 0-d": lambda k: {"flat_in": torch.tensor(3)},
    "pool_out 3-D": lambda k: {"pool_out": k["pool_out"][None]},
    "offsets one too long": lambda k: {"offsets": torch.cat([k["offsets"], k["offsets"][-1:]])},
    "req_pool_indices bool": lambda k: {"req_pool_indices": k["req_pool_indices"].bool()},
    "pool_out uint8": lambda k: {"pool_out": k["pool_out"].to(torch.uint8)},
    "flat_in uint64": lambda k: {"flat_in": k["flat_in"].to(torch.uint64)},
}
_PLAN_FAULTS = {
    "scratch 2-D": lambda k: {"out_verify_offsets_scratch": k["out_verify_offsets_scratch"][None]},
    "req_to_token 3-D": lambda k: {"req_to_token": k["req_to_token"][None]},
    "out_verify_num_valid 0-d": lambda k: {"out_verify_num_valid": torch.tensor(0).int()},
    "out_write_num_valid_reqs int64": lambda k: {
        "out_write_num_valid_reqs": k["out_write_num_valid_reqs"].long()
    },
    "seeds one longer": lambda k: {
        "out_write_seed_slot_indices": torch.cat([k["out_write_seed_slot_indices"]] * 2)[:41]
    },
    "prefix_lens on meta": lambda k: {"prefix_lens": k["prefix_lens"].to("meta")},
    "req_to_token transposed": lambda k: {"req_to_token": k["req_to_token"].t()},
    "verify_capacity -2": lambda k: {"verify_capacity": -2},
}


@pytest.mark.parametrize(
    "which,fault", [("scatter", f) for f in _SCATTER_FAULTS] + [("plan", f) for f in _PLAN_FAULTS]
)
def test_drop_ins_refuse_what_sglang_refuses_with_its_type_and_text_writing_nothing(
    kv, which, fault
):
    """The drop-ins called directly: sglang's exception type, sglang's text (the drop-in may
    add a fix after ``;``), and every output as it was. Catches a check dropped or moved after
    the launch, or reordered past another that names a different fault."""
    if which == "scatter":
        up, dn = (
            kv.scatter.launch_scatter_req_token_ids_kernel,
            kd.launch_scatter_req_token_ids_kernel,
        )
        base = vars(make_scatter_case(6, seed=3))
        kw = {**base, **_SCATTER_FAULTS[fault](base)}
    else:
        up, dn = kv.offsets.launch_plan_offsets_kernel, kd.launch_plan_offsets_kernel
        base = _plan_call(40, seed=5, vc=500)
        kw = {**base, **_PLAN_FAULTS[fault](base)}
    want = _run(up, kw)
    assert want[0] not in ("ok",), want
    call = _fresh(kw)
    before = {k: v.clone() for k, v in _outs(call).items() if v.device.type != "meta"}
    with pytest.raises(Exception) as err:
        dn(**call)
    assert issubclass(err.type, want[0]), (err.type, want[:2])
    got = str(err.value)
    assert got == want[1] or got.startswith(want[1] + ";"), (got, want[1])
    for k, v in before.items():
        assert torch.equal(call[k], v), f"a refused call changed {k}"


def test_scatter_drop_in_stays_in_bounds_where_sglangs_kernel_writes_before_a_row(kv):
    """Out-of-order offsets ``[0, 9, 4, 12]``: sglang's kernel gives token 5 to request 1
    (two offsets are <= 5) at column ``5 - 9 = -4`` of its row, row 0 here, so before the
    pool, which the interpreter's bounds checks refuse. The drop-in copies each run into its
    row's first columns (auto takes ``rows`` here) and nothing else."""
    big = torch.full((7, 6), POISON32, dtype=torch.int32)
    kw = dict(
        flat_in=torch.arange(100, 112, dtype=torch.int64),
        offsets=torch.tensor([0, 9, 4, 12]),
        req_pool_indices=torch.tensor([3, 0, 2]),
        pool_out=big[1:-1],
    )
    with pytest.raises(Exception, match=r"store of 4-byte elements at \d+ address\(es\) outside"):
        kv.scatter.launch_scatter_req_token_ids_kernel(**kw)
    big.fill_(POISON32)
    kd.launch_scatter_req_token_ids_kernel(**kw)
    want = torch.full_like(big, POISON32)  # each run copied (run 1, [9, 4), is empty)
    want[4], want[3] = torch.arange(100, 106), torch.arange(104, 110)  # runs 0 and 2, 6 columns
    assert torch.equal(big, want), big.tolist()


@pytest.mark.parametrize(
    "offsets,tokens,outside",
    [
        ([2, 4, 8, 12], 12, "byte -8 of 'offsets_ptr'"),  # a head gap: tokens 0, 1 unowned
        ([0, 4, 8, 12], 15, "byte 24 of 'req_pool_indices_ptr'"),  # flat_in 3 tokens longer
        ([0, 0, 0, 0], 5, "byte 24 of 'req_pool_indices_ptr'"),  # every run empty
    ],
)
def test_scatter_drop_in_stays_in_bounds_where_sglangs_kernel_reads_past_its_tensors(
    kv, offsets, tokens, outside
):
    """Ordered offsets inside ``flat_in`` that leave tokens unowned at either end: sglang's
    kernel gives a token before ``offsets[0]`` the owner -1 and reads ``offsets[-1]``, and a
    token at or past ``offsets[bs]`` the owner ``bs`` and reads ``req_pool_indices[bs]``; the
    interpreter's bounds checks refuse both reads. The drop-in copies each run, as sglang's
    torch reference does, and reads nothing outside its tensors."""
    kw = dict(
        flat_in=torch.arange(100, 100 + tokens, dtype=torch.int64),
        offsets=torch.tensor(offsets),
        req_pool_indices=torch.tensor([3, 0, 2]),
    )
    big = torch.full((7, 6), POISON32, dtype=torch.int32)
    with pytest.raises(Exception, match=rf"load of 8-byte elements .*{re.escape(outside)}"):
        kv.scatter.launch_scatter_req_token_ids_kernel(**kw, pool_out=big[1:-1])
    want, got = big.clone().fill_(POISON32), big.clone().fill_(POISON32)
    kv.scatter_ref.scatter_req_token_ids_torch_reference(**kw, pool_out=want[1:-1])
    kd.launch_scatter_req_token_ids_kernel(**kw, pool_out=got[1:-1])
    assert torch.equal(got, want), got.tolist()
    runs = sum(min(b, tokens) - a for a, b in zip(offsets[:-1], offsets[1:], strict=True))
    assert int((want != POISON32).sum()) == runs


@pytest.mark.parametrize("row,outside", [(7, r"byte \d+"), (-1, r"byte -\d+")])
def test_plan_drop_in_reads_no_seed_where_sglangs_launcher_reads_past_the_table(kv, row, outside):
    """A request whose pool row lies outside ``req_to_token`` (one past its 7 rows, or -1):
    sglang's launcher reads its seed there, which the interpreter's bounds checks refuse. The
    drop-in gives that request seed -1, and every other output byte as sglang's launcher does
    with the row made a real one (an eighth row added to the table): the request's lengths
    still count, as its row is non-zero."""
    kw = _plan_call(6, seed=3)
    kw["req_pool_indices"][2], kw["prefix_lens"][2], kw["extend_seq_lens"][2] = row, 4, 2
    with pytest.raises(Exception, match=rf"load of 4-byte .* is {outside} of \W*req_to_token_ptr"):
        kv.offsets.launch_plan_offsets_kernel(**_fresh(kw))
    got = _run(kd.launch_plan_offsets_kernel, kw)[2]
    inside = {**kw, "req_pool_indices": kw["req_pool_indices"].clone()}
    inside["req_pool_indices"][2] = 7  # rows 1-6 are the others' (or 0)
    inside["req_to_token"] = torch.cat([kw["req_to_token"], kw["req_to_token"][:1]])
    want = _run(kv.offsets.launch_plan_offsets_kernel, inside)[2]
    assert int(want["out_write_seed_slot_indices"][2]) != -1  # a seed is read there
    want["out_write_seed_slot_indices"][2] = -1
    for name in _outs(kw):
        assert torch.equal(got[name], want[name]), name
