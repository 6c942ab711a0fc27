"""Unit tests of the dispatcher's API: batch sizes around the blocks, chunk_size and strategy
arguments, offsets dtypes, and host reads (syncs). Its refusals (error texts, the write
capacity): ``test_dispatch_api_errors.py``; the drop-in aliases: ``test_dispatch_drop_in.py``;
validate=True: ``test_dispatch_validate.py``."""

from __future__ import annotations

import contextlib
import re
import sys
from collections.abc import Iterator
from functools import partial

import pytest
import torch
from _helpers import dispatch_cases, plan_kwargs, plan_outputs, rejected, scatter_kwargs
from conftest import DEVICE, GPU

import kvcanary_dispatch
from kvcanary_dispatch import (
    PLAN_MAX_CHUNK,
    PLAN_STRATEGIES,
    SCATTER_MAX_CHUNK,
    SCATTER_STRATEGIES,
    plan_offsets,
    scatter_req_token_ids,
)
from kvcanary_dispatch.launch_plan import scatter_launch_plan
from kvcanary_dispatch.plan import check_plan_bundled
from kvcanary_dispatch.testing.cases import (
    POISON_I32,
    assert_bytes_equal,
    check_plan,
    check_scatter,
    make_scatter_case,
)
from kvcanary_dispatch.testing.properties import check_plan_property, check_scatter_property
from kvcanary_dispatch.testing.strategies import build_scatter_case
from kvcanary_kernels import scatter_req_token_ids_ref
from kvcanary_kernels.args import SCRATCH_NAME, bundle_plan_args
from kvcanary_kernels.scatter_rows import ROWS_COLS

_scatter_case, _plan_case = dispatch_cases(DEVICE)


# ---------------------------------------------------------------- any batch size


@pytest.mark.parametrize("strategy", SCATTER_STRATEGIES)
@pytest.mark.parametrize("bs", [0, 1, 511, 512, 513])
def test_scatter_any_bs(strategy, bs):
    check_scatter_property(_scatter_case(bs, seed=bs), None, strategy)


@pytest.mark.parametrize("strategy", PLAN_STRATEGIES)
@pytest.mark.parametrize("bs", [0, 1, 511, 512, 513, 4096, 4097])
def test_plan_any_bs(strategy, bs):
    check_plan_property(_plan_case(bs, seed=bs), None, strategy)


@pytest.mark.parametrize("strategy", SCATTER_STRATEGIES)
def test_scatter_100k_requests_sparse_tokens(strategy):
    """100 000 requests, 95 % of them empty. ``rows`` launches one program a request, so in the
    interpreter (one program after another) it takes 5 000 requests."""
    g = torch.Generator().manual_seed(5)
    bs = 100_000 if GPU or strategy != "rows" else 5_000
    lens = torch.randint(1, 4, (bs,), generator=g) * (torch.rand(bs, generator=g) < 0.05)
    case = build_scatter_case(lens, width=2, spare_rows=1, seed=5, device=DEVICE)
    check_scatter_property(case, None, strategy, check_slices=False)


@pytest.mark.parametrize("strategy", ["auto", "flat", "loop"])
def test_scatter_100k_requests_100k_tokens(strategy):
    case = _scatter_case(100_000, seed=6, width=2, hi=2, spare_rows=1)
    assert case.total > 50_000
    check_scatter_property(case, None, strategy, check_slices=False)


@pytest.mark.parametrize("strategy", PLAN_STRATEGIES)
def test_plan_100k_requests(strategy):
    check_plan_property(_plan_case(100_000, seed=7), None, strategy, check_slices=False)


@pytest.mark.parametrize("lens", [[1024], [1025], [0, 3, 1024, 1], [2049, 0], [7] * 5])
def test_scatter_rows_on_a_pool_wider_than_the_tokens(lens):
    """A pool far wider than the batch's tokens (an engine's long context): the "rows" grid
    that auto takes covers only the columns the tokens can fill, and that holds every run."""
    width = 1 << 16
    case = make_scatter_case(torch.tensor(lens), width=width, seed=len(lens), device=DEVICE)
    assert scatter_launch_plan(case.bs, case.total, None, "auto", "device", width).strategy == (
        "rows"
    )
    for strategy in ("auto", "rows"):
        check_scatter(scatter_req_token_ids, case, strategy=strategy)


@pytest.mark.parametrize("lens", [[40_000] + [3] * 127, [0, 17_000, 5] * 40 + [24_000] * 8])
def test_scatter_rows_copies_long_runs_in_steps(lens):
    """128 requests on a 65 536-column pool: "rows" (auto's choice) gives each request fewer
    programs than a long run has tiles, so those programs copy several tiles each."""
    width = 1 << 16
    case = make_scatter_case(torch.tensor(lens), width=width, seed=len(lens), device=DEVICE)
    plan = scatter_launch_plan(case.bs, case.total, None, "auto", "device", width)
    (launch,) = plan.launches
    assert plan.strategy == "rows" and launch.grid[1] * ROWS_COLS < max(lens)
    for strategy in ("auto", "rows"):
        check_scatter(scatter_req_token_ids, case, strategy=strategy)


def test_scatter_one_column_pool_of_any_column_stride():
    """A one-column pool is rows of one element whatever its column stride (torch calls it
    contiguous, and ``.contiguous()`` returns it as it is): taken, and each row's one column
    written where the reference writes it; a two-column pool of that layout is refused."""
    case = _scatter_case(300, seed=3, width=1)
    for strategy in SCATTER_STRATEGIES:
        store = torch.full((3, case.pool_rows), POISON_I32, dtype=torch.int32, device=DEVICE)
        want = store.clone()
        pool = store.t()[:, 1:2]  # [rows, 1], strides (1, rows)
        assert pool.stride() == (1, case.pool_rows) and pool.is_contiguous()
        scatter_req_token_ids(**case.kwargs(pool), strategy=strategy)
        scatter_req_token_ids_ref(**case.kwargs(want.t()[:, 1:2]))
        assert_bytes_equal(store, want, f"one-column pool, {strategy}")
    two = torch.zeros((2, case.pool_rows), dtype=torch.int32, device=DEVICE).t()
    msg = rejected(ValueError, lambda: scatter_req_token_ids(**case.kwargs(two)), [two])
    assert msg.endswith(f"pool_out rows must be contiguous, got strides {two.stride()}"), msg


@pytest.mark.parametrize(
    "layout",
    [
        pytest.param(lambda base, rows, w: base[:1].expand(rows, w), id="expanded"),
        pytest.param(lambda base, rows, w: base.as_strided((rows, w), (w - 1, 1)), id="stride_w-1"),
        pytest.param(lambda base, rows, w: base.as_strided((rows, 1), (0, 1)), id="one_column"),
    ],
)
@pytest.mark.parametrize("entry", ["dispatch", "drop_in"])
def test_scatter_overlapping_pool_rows_refused(layout, entry):
    """A pool whose rows share memory (row stride below the width) would take racing writes
    from requests named as distinct rows: a ValueError before any launch, naming the strides
    and the width, the memory under it untouched; every strategy."""
    case = _scatter_case(40, seed=21, width=4)
    base = torch.full((case.pool_rows, 4), POISON_I32, dtype=torch.int32, device=DEVICE)
    pool = layout(base, case.pool_rows, 4)
    width = pool.shape[1]
    if entry == "dispatch":
        calls = [partial(scatter_req_token_ids, strategy=s) for s in SCATTER_STRATEGIES]
    else:
        calls = [kvcanary_dispatch.launch_scatter_req_token_ids_kernel]
    for fn in calls:
        msg = rejected(ValueError, partial(fn, **case.kwargs(pool)), [base, case.flat_in])
        assert msg == (
            f"kv-canary: scatter_req_token_ids pool_out rows overlap in memory: strides "
            f"{pool.stride()} for {width} columns; pass a pool whose rows are disjoint "
            f"(row stride >= {width}), not an expanded or as_strided view"
        ), msg


def test_scatter_one_row_pool_of_any_row_stride():
    """One row cannot overlap another: a ``[1, width]`` pool of row stride 0 is taken and
    written where the reference writes it."""
    case = _scatter_case(1, seed=4, width=6, spare_rows=0)
    assert case.pool_rows == 1 and case.total > 0
    for strategy in SCATTER_STRATEGIES:
        row = torch.full((6,), POISON_I32, dtype=torch.int32, device=DEVICE)
        want = row.clone()
        pool = row.as_strided((1, 6), (0, 1))
        scatter_req_token_ids(**case.kwargs(pool), strategy=strategy)
        scatter_req_token_ids_ref(**case.kwargs(want[None]))
        assert_bytes_equal(row, want, f"one-row pool, {strategy}")


def test_scatter_strided_pool_rows():
    """A pool that is a column window of a wider pool: rows keep their stride."""
    case = _scatter_case(700, seed=8, width=4)
    for strategy in SCATTER_STRATEGIES:
        wide = torch.full((case.pool_rows, 9), POISON_I32, dtype=torch.int32, device=DEVICE)
        want = wide.clone()
        scatter_req_token_ids(**case.kwargs(wide[:, 2:6]), strategy=strategy)
        scatter_req_token_ids_ref(**case.kwargs(want[:, 2:6]))
        assert_bytes_equal(wide, want, f"wide pool, {strategy}")


# ---------------------------------------------------------------- chunk_size and strategy

BAD_CHUNKS = [
    (0, ValueError),
    (-1, ValueError),
    (True, TypeError),
    (2.0, TypeError),
    ("8", TypeError),
    ([8], TypeError),  # unhashable: named by the check, not by a cache
    (torch.tensor(8), TypeError),  # a read-back, and a cache key per tensor
    (torch.tensor([8]), TypeError),
]


def _names_the_chunk(msg: str, chunk: object) -> bool:
    """The message names the value, or for a tensor (whose value would be read back) says so
    and names the fix."""
    if isinstance(chunk, torch.Tensor):
        return "chunk_size must be an int or None, got a tensor; pass int(chunk_size)" in msg
    return "chunk_size" in msg and repr(chunk) in msg


@pytest.mark.parametrize("strategy", SCATTER_STRATEGIES)
@pytest.mark.parametrize("chunk,exc", BAD_CHUNKS + [(SCATTER_MAX_CHUNK + 1, ValueError)])
def test_scatter_chunk_size_checked(strategy, chunk, exc):
    for bs in (0, 3):
        kw = scatter_kwargs(_scatter_case(bs), chunk_size=chunk, strategy=strategy)
        msg = rejected(exc, lambda kw=kw: scatter_req_token_ids(**kw), [kw["pool_out"]])
        assert _names_the_chunk(msg, chunk), msg
        if exc is ValueError:
            assert f"[1, {SCATTER_MAX_CHUNK}]" in msg


@pytest.mark.parametrize("strategy", PLAN_STRATEGIES)
@pytest.mark.parametrize("chunk,exc", BAD_CHUNKS + [(PLAN_MAX_CHUNK + 1, ValueError)])
def test_plan_chunk_size_checked(strategy, chunk, exc):
    for bs in (0, 3):
        kw = plan_kwargs(_plan_case(bs), chunk_size=chunk, strategy=strategy)
        msg = rejected(exc, lambda kw=kw: plan_offsets(**kw), plan_outputs(kw))
        assert _names_the_chunk(msg, chunk), msg
        if exc is ValueError:
            assert f"[1, {PLAN_MAX_CHUNK}]" in msg


@pytest.mark.parametrize("chunk", [None, 1, 2, SCATTER_MAX_CHUNK])
def test_scatter_chunk_size_accepted(chunk):
    check_scatter(scatter_req_token_ids, _scatter_case(40), chunk_size=chunk, strategy="loop")


@pytest.mark.parametrize("chunk", [None, 1, 2, PLAN_MAX_CHUNK])
def test_plan_chunk_size_accepted(chunk):
    check_plan(plan_offsets, _plan_case(40), chunk_size=chunk, strategy="loop")


@pytest.mark.parametrize("fast", ["fast", ["auto"]])  # a list: unhashable, named all the same
def test_unknown_strategy(fast):
    kw = scatter_kwargs(_scatter_case(3), strategy=fast)
    msg = rejected(ValueError, lambda: scatter_req_token_ids(**kw), [kw["pool_out"]])
    assert f"strategy={fast!r} is not one of" in msg and all(s in msg for s in SCATTER_STRATEGIES)
    kw = plan_kwargs(_plan_case(3), strategy="flat" if fast == "fast" else fast)
    msg = rejected(ValueError, lambda: plan_offsets(**kw), plan_outputs(kw))
    want = "'flat'" if fast == "fast" else repr(fast)
    assert f"strategy={want} is not one of" in msg and all(s in msg for s in PLAN_STRATEGIES)


# ---------------------------------------------------------------- offsets dtype (int32 widened)


@pytest.mark.parametrize("strategy", SCATTER_STRATEGIES)
def test_int32_offsets_promoted(strategy):
    case = _scatter_case(1200, seed=9)
    for variant in ("int32", "host_int32"):
        check_scatter_property(case, 100, strategy, offsets=variant, check_slices=False)
    offsets32 = case.offsets.to(torch.int32)

    def with_int32_offsets(**kw) -> None:
        scatter_req_token_ids(**{**kw, "offsets": offsets32}, strategy=strategy)

    check_scatter(with_int32_offsets, case)  # the pool equals the reference's, byte for byte
    assert offsets32.dtype == torch.int32  # the caller's tensor is left as it was
    assert torch.equal(offsets32, case.offsets.to(torch.int32))


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.float64, torch.bool, torch.int16, torch.uint8, torch.int8]
)
def test_offsets_bad_dtype_names_dtype_and_fix(dtype):
    case = _scatter_case(3)
    kw = scatter_kwargs(case, offsets=case.offsets.to(dtype))
    msg = rejected(TypeError, lambda: scatter_req_token_ids(**kw), [kw["pool_out"]])
    # sglang's launcher's text, which users search for, word for word, then the fix
    assert msg.startswith(f"kv-canary: scatter_req_token_ids offsets must be int64, got {dtype};")
    assert re.search(rf"got {re.escape(str(dtype))}\b.*int64", msg), msg


# ---------------------------------------------------------------- host reads and syncs

_HOST_READS = ("item", "tolist", "cpu", "numpy", "__int__", "__index__", "__bool__", "__float__")
_OURS = ("kvcanary_dispatch.", "kvcanary_kernels.")


@contextlib.contextmanager
def _count_host_reads() -> Iterator[list[str]]:
    """Count tensor-to-host reads (``.item()``, ``.tolist()``, ``int(t)``, ...) made directly by
    the dispatcher's or the launchers' code, not by Triton's interpreter."""
    calls: list[str] = []
    saved = {}

    def wrap(name: str, fn):
        def wrapper(self, *args, **kwargs):
            caller = sys._getframe(1).f_globals.get("__name__", "")
            if caller.startswith(_OURS):
                calls.append(f"{caller}: .{name}()")
            return fn(self, *args, **kwargs)

        return wrapper

    try:
        for name in _HOST_READS:
            saved[name] = torch.Tensor.__dict__.get(name)
            setattr(torch.Tensor, name, wrap(name, getattr(torch.Tensor, name)))
        yield calls
    finally:
        for name, fn in saved.items():
            if fn is None:
                delattr(torch.Tensor, name)
            else:
                setattr(torch.Tensor, name, fn)


@pytest.mark.parametrize("strategy", SCATTER_STRATEGIES)
def test_scatter_host_reads_do_not_grow_with_slices(strategy):
    """Host-side offsets: the loop reads its slice bounds once (one ``.tolist()`` of a CPU
    tensor), never per slice; the single-launch strategies read nothing."""
    case = _scatter_case(60, seed=11)
    host = case.offsets.cpu()
    counts = []
    for chunk in (1, 7, None):
        pool = case.fresh_pool()
        with _count_host_reads() as calls:
            scatter_req_token_ids(
                **{**case.kwargs(pool), "offsets": host}, chunk_size=chunk, strategy=strategy
            )
        counts.append(len(calls))
    assert counts[0] == counts[1] == counts[2], counts
    assert counts[0] <= (1 if strategy == "loop" else 0), calls


@pytest.mark.parametrize("strategy", PLAN_STRATEGIES)
def test_plan_reads_nothing_back(strategy):
    case = _plan_case(60, seed=12)
    for chunk in (1, 7, None):
        with _count_host_reads() as calls:
            plan_offsets(**plan_kwargs(case), chunk_size=chunk, strategy=strategy)
        assert not calls, calls


def _device_to_host_copies(fn) -> int:
    from torch.profiler import ProfilerActivity, profile

    fn()  # compile outside the count
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    names = [e.name for e in prof.events()]
    assert any("scatter" in n or "plan" in n for n in names), "the profiler saw no kernel"
    return sum("DtoH" in n or "Device -> Pageable" in n for n in names)


@pytest.mark.skipif(DEVICE != "cuda", reason="CPU offsets vs device tensors needs a GPU")
@pytest.mark.parametrize("strategy", SCATTER_STRATEGIES)
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_scatter_cpu_offsets_no_device_to_host_copy(strategy, dtype):
    case = _scatter_case(3000, seed=13)
    host = case.offsets.cpu().to(dtype)

    def impl(**kw):
        kw["offsets"] = host
        scatter_req_token_ids(**kw, chunk_size=100, strategy=strategy)

    check_scatter(impl, case)
    pool = case.fresh_pool()
    assert _device_to_host_copies(lambda: impl(**case.kwargs(pool))) == 0


@pytest.mark.skipif(DEVICE != "cuda", reason="device offsets: needs a GPU")
@pytest.mark.parametrize("strategy", SCATTER_STRATEGIES)
def test_scatter_device_offsets_copies(strategy):
    """Device offsets: the loop copies its slice bounds back once per call; the single-launch
    strategies copy nothing."""
    case = _scatter_case(3000, seed=14)
    pool = case.fresh_pool()
    call = lambda: scatter_req_token_ids(**case.kwargs(pool), chunk_size=100, strategy=strategy)  # noqa: E731
    assert _device_to_host_copies(call) == (1 if strategy == "loop" else 0)


@pytest.mark.skipif(DEVICE != "cuda", reason="needs a GPU")
@pytest.mark.parametrize("strategy", PLAN_STRATEGIES)
def test_plan_no_device_to_host_copy(strategy):
    case = _plan_case(9000, seed=15)
    kw = plan_kwargs(case)
    assert (
        _device_to_host_copies(lambda: plan_offsets(**kw, chunk_size=1000, strategy=strategy)) == 0
    )


_META_REFUSAL = (
    " is a meta tensor, which holds no data for the kernels to read or write; pass CUDA "
    "tensors (or CPU tensors under TRITON_INTERPRET=1)"
)


def _on_meta(kw: dict, keep_on_host: tuple[str, ...] = ()) -> dict:
    """``kw`` with every tensor but those named in ``keep_on_host`` moved to the meta device."""
    return {
        k: v.to("meta") if isinstance(v, torch.Tensor) and k not in keep_on_host else v
        for k, v in kw.items()
    }


@pytest.mark.parametrize("strategy", SCATTER_STRATEGIES)
@pytest.mark.parametrize("offsets_on_host", [False, True])
@pytest.mark.parametrize("bs", [0, 5])
def test_scatter_meta_tensors_refused(strategy, offsets_on_host, bs):
    """Meta tensors (shapes without data) are a ``ValueError`` naming them and the fix, raised
    after the ordered checks, for every strategy and for offsets a caller keeps on the host;
    an empty batch too. Without it torch raised a bare ``NotImplementedError`` at the launch."""
    host = ("offsets",) if offsets_on_host else ()
    case = make_scatter_case([2] * bs, width=4)
    kw = _on_meta(scatter_kwargs(case), host)
    with pytest.raises(ValueError) as err:
        scatter_req_token_ids(**kw, strategy=strategy)
    assert str(err.value) == f"kv-canary: scatter_req_token_ids pool_out{_META_REFUSAL}"
    bad = _on_meta(scatter_kwargs(case), host)
    bad["flat_in"] = bad["flat_in"].int()  # an earlier argument's error is named first
    with pytest.raises(TypeError, match="flat_in must be int64"):
        scatter_req_token_ids(**bad, strategy=strategy)


@pytest.mark.parametrize("strategy", PLAN_STRATEGIES)
def test_plan_meta_tensors_refused(strategy):
    """Meta tensors in ``plan_offsets``, the drop-in (naming its own keyword) and
    ``ForwardStepGuard``'s refusal check: a ``ValueError`` naming the verify offsets and the
    fix, after the ordered checks."""
    kw = _on_meta(plan_kwargs(_plan_case(6)))
    fix = _META_REFUSAL
    with pytest.raises(ValueError) as err:
        plan_offsets(**kw, strategy=strategy)
    assert str(err.value) == f"kv-canary: plan_offsets out_verify_offsets{fix}"
    with pytest.raises(ValueError) as err:
        check_plan_bundled(*bundle_plan_args(kw), None, strategy)
    assert str(err.value) == f"kv-canary: plan_offsets out_verify_offsets{fix}"
    drop_in = {SCRATCH_NAME if k == "out_verify_offsets" else k: v for k, v in kw.items()}
    with pytest.raises(ValueError) as err:
        kvcanary_dispatch.launch_plan_offsets_kernel(**drop_in)
    assert str(err.value) == f"kv-canary: plan_offsets {SCRATCH_NAME}{fix}"
