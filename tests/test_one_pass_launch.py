"""The scatter's one-pass launch (``kvcanary_dispatch.scatter._launched``).

A valid call on the current CUDA device whose plan is one launch (or none) is checked and
launched in one pass; every other call takes the full path, which checks in order and names
what is wrong. On the CPU the pass is driven through ``_one_pass.record_as_on_gpu`` (CPU
tensors pass for the current CUDA device, launches recorded instead of made): each call must
hand the kernel exactly what the full path hands it, and every call the pass declines must
launch nothing. On a GPU the pass runs for real: its results are
compared byte for byte with the reference, and the full path is made to fail so that a call
that leaves the pass shows.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from _helpers import inputs_between_rows, pool_sharing_an_input
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
import kvcanary_dispatch.scatter as scatter
import kvcanary_kernels._launch as fast
from kvcanary_dispatch import scatter_req_token_ids
from kvcanary_dispatch.testing.cases import check_scatter, make_scatter_case
from kvcanary_dispatch.testing.launches import record_launches
from kvcanary_dispatch.testing.rejections import SCATTER_REJECTIONS, check_scatter_rejected
from kvcanary_kernels.scatter_rows import _scatter_rows_kernel

CPU = torch.device("cpu")
ONE_PASS_STRATEGIES = ("auto", "rows", "capped", "flat", "segments")
# (lengths, pool width): one-tile and stepped rows, capped heads with and without tails, a
# batch past rows' bound, empty batches and runs.
SHAPES = [
    ([3, 0, 5], 8),
    ([40] * 7 + [0], 16),
    ([1] * 600, 4),
    ([2000, 3, 0, 700], 1500),
    ([5] * 513, 64),
    ([0, 0], 8),
    ([], 8),
]


@pytest.fixture
def as_on_gpu(monkeypatch) -> list:
    return record_as_on_gpu(monkeypatch)


def _full_path_launches(seen: list, kw: dict, **options) -> list:
    return full_path_launches(seen, scatter, lambda: scatter_req_token_ids(**kw, **options))


@pytest.mark.parametrize("window", [0, 3], ids=["whole rows", "a column window"])
@pytest.mark.parametrize("strategy", ONE_PASS_STRATEGIES)
@pytest.mark.parametrize("lens,width", SHAPES, ids=str)
def test_one_pass_launches_what_the_full_path_launches(as_on_gpu, strategy, lens, width, window):
    """The same launch as the full path's, on whole pool rows and on a column window of a pool
    ``window`` columns wider (its row pitch is not its width)."""
    case = make_scatter_case(lens, width=width, seed=len(lens), device=CPU)
    case = dataclasses.replace(case, pool_pitch=width + window)
    kw = case.kwargs(case.fresh_pool())
    scatter_req_token_ids(**kw, strategy=strategy)
    ours = list(as_on_gpu)
    full = _full_path_launches(as_on_gpu, kw, strategy=strategy)
    assert len(full) == (1 if case.bs and case.total else 0)
    same_launches(ours, full)


@pytest.mark.parametrize("strategy", ["auto", "capped", "rows"])
def test_one_pass_decides_again_for_another_pool_width(as_on_gpu, strategy):
    """Batches of one ``bs`` and one token count on pools of other widths, one call after
    another: each launches what the full path launches for its own pool. (The pass caches its
    decision; on a pool at most ``capped``'s cap wide no run can need a tail, so a decision
    made there and kept for a wider pool with a longer run would leave that run's tail
    unwritten.)"""
    for lens, width in [
        ([3000, 3001, 3001], 4096),
        ([9000, 1, 1], 9002),
        ([3000, 3001, 3001], 3001),
        ([9000, 1, 1], 16384),
    ]:
        case = make_scatter_case(lens, width=width, seed=1, device=CPU)
        kw = case.kwargs(case.fresh_pool())
        start = len(as_on_gpu)
        scatter_req_token_ids(**kw, strategy=strategy)
        ours = as_on_gpu[start:]
        same_launches(ours, _full_path_launches(as_on_gpu, kw, strategy=strategy))


def _strided(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values in a view of stride 2."""
    room = torch.zeros(2 * t.numel(), dtype=t.dtype)
    room[::2] = t
    return room[::2]


# Calls the one pass must leave to the full path: valid ones it does not take, and every kind
# of invalid one. Each: (keywords from valid keywords, options).
def _pitched(pool: torch.Tensor, less: int | None) -> torch.Tensor:
    """``pool``'s shape over its storage with rows ``width + less`` elements apart (``None``:
    every row on the first)."""
    pitch = 0 if less is None else pool.shape[1] + less
    return pool.as_strided(pool.shape, (pitch, 1))


BREAKAGES = {
    "int32 offsets": (lambda kw: {**kw, "offsets": kw["offsets"].to(torch.int32)}, {}),
    "int32 flat_in": (lambda kw: {**kw, "flat_in": kw["flat_in"].to(torch.int32)}, {}),
    "int64 pool": (lambda kw: {**kw, "pool_out": kw["pool_out"].to(torch.int64)}, {}),
    "strided flat_in": (lambda kw: {**kw, "flat_in": _strided(kw["flat_in"])}, {}),
    "strided rows": (lambda kw: {**kw, "req_pool_indices": _strided(kw["req_pool_indices"])}, {}),
    "2-D rows": (lambda kw: {**kw, "req_pool_indices": kw["req_pool_indices"][:, None]}, {}),
    "1-D pool": (lambda kw: {**kw, "pool_out": kw["pool_out"].reshape(-1)}, {}),
    "column-major pool": (lambda kw: {**kw, "pool_out": kw["pool_out"].t().contiguous().t()}, {}),
    "short offsets": (lambda kw: {**kw, "offsets": kw["offsets"][:-1]}, {}),
    # rows a column apart and rows on one another: the full path refuses both
    "overlapping pool rows": (lambda kw: {**kw, "pool_out": _pitched(kw["pool_out"], -1)}, {}),
    "pool rows on one another": (lambda kw: {**kw, "pool_out": _pitched(kw["pool_out"], None)}, {}),
    "a subclass": (
        lambda kw: {**kw, "flat_in": torch.nn.Parameter(kw["flat_in"], requires_grad=False)},
        {},
    ),
    "a subclass pool": (
        lambda kw: {**kw, "pool_out": torch.nn.Parameter(kw["pool_out"], requires_grad=False)},
        {},
    ),
    "None offsets": (lambda kw: {**kw, "offsets": None}, {}),
    "a list": (lambda kw: {**kw, "req_pool_indices": kw["req_pool_indices"].tolist()}, {}),
    "loop": (dict, {"strategy": "loop"}),
    "sliced": (dict, {"strategy": "sliced"}),
    "a chunk_size": (dict, {"chunk_size": 2}),
    "a zero chunk_size": (dict, {"chunk_size": 0}),
    "a list chunk_size": (dict, {"chunk_size": [2]}),
    "an unknown strategy": (dict, {"strategy": "fastest"}),
}


@pytest.mark.parametrize("name", BREAKAGES)
def test_one_pass_declines_and_launches_nothing(as_on_gpu, name):
    case = make_scatter_case([3, 0, 5, 2], width=8, seed=2, device=CPU)
    breaking, options = BREAKAGES[name]
    kw = breaking(case.kwargs(case.fresh_pool()))
    args = [kw[k] for k in ("flat_in", "offsets", "req_pool_indices", "pool_out")]
    chunk_size, strategy = options.get("chunk_size"), options.get("strategy", "auto")
    assert scatter._launched(*args, chunk_size, strategy) is False
    assert as_on_gpu == []


@pytest.mark.parametrize("lens", [[], [0, 0, 0]], ids=["bs0", "no_tokens"])
@pytest.mark.parametrize("strategy", ["loop", "sliced", "auto"])
def test_one_pass_takes_a_call_with_nothing_to_launch(as_on_gpu, strategy, lens):
    """No request or no token: every strategy launches nothing and reads nothing back (a
    ``loop`` has no slice offsets to read): the pass takes the call, launching nothing."""
    case = make_scatter_case(lens, width=8, seed=2, device=CPU)
    kw = case.kwargs(case.fresh_pool())
    assert scatter._launched(*kw.values(), None, strategy) is True
    assert as_on_gpu == []


@pytest.mark.parametrize("name", ["flat_in", "offsets", "req_pool_indices", "pool_out"])
@pytest.mark.parametrize("elsewhere", ["another index", "another device type"])
def test_one_pass_declines_one_tensor_elsewhere(as_on_gpu, monkeypatch, name, elsewhere):
    """One tensor on another GPU, or on another device type with the same index (a lazy or
    XLA tensor: ``is_cuda`` false): the full path refuses the call, the pass declines it."""
    case = make_scatter_case([3, 1, 4], width=8, device=CPU)
    kw = case.kwargs(case.fresh_pool())
    target = kw[name]
    assert scatter._launched(*kw.values(), None, "auto") is True  # as it stands: taken
    if elsewhere == "another index":
        real = torch.Tensor.get_device
        monkeypatch.setattr(
            torch.Tensor, "get_device", lambda self: 1 if self is target else real(self)
        )
    else:
        monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: self is not target))
    as_on_gpu.clear()
    assert scatter._launched(*kw.values(), None, "auto") is False
    assert as_on_gpu == []


def test_one_pass_declines_another_device_and_validate(as_on_gpu, monkeypatch):
    case = make_scatter_case([3, 1], width=4, device=CPU)
    kw = case.kwargs(case.fresh_pool())
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)  # not the tensors' device
    assert scatter._launched(*kw.values(), None, "auto") is False
    monkeypatch.setattr(torch.cuda, "current_device", lambda: -1)
    monkeypatch.setattr(scatter, "_scatter", lambda *args: as_on_gpu.append(("full", args)))
    scatter_req_token_ids(**kw, validate=True)
    assert [path for path, *_ in as_on_gpu] == ["full"]


@pytest.mark.parametrize("other", ["flat_in", "offsets", "req_pool_indices"])
@pytest.mark.parametrize("end", ["first", "last"])
def test_one_pass_declines_a_pool_sharing_memory(as_on_gpu, other, end):
    """A pool sharing one int32 word with an input's first or last element only: the one pass
    declines the call (which the full path refuses: test_aliasing), though it takes the same
    call on a pool of its own."""
    case = make_scatter_case([3, 5, 0, 4], width=8, device=CPU)
    inputs, pool, _ = pool_sharing_an_input(case, other, end)
    vectors = [inputs[k] for k in ("flat_in", "offsets", "req_pool_indices")]
    assert scatter._launched(*vectors, case.fresh_pool(), None, "auto") is True
    as_on_gpu.clear()
    assert scatter._launched(*vectors, pool, None, "auto") is False
    assert as_on_gpu == []


def test_one_pass_takes_inputs_between_a_pool_windows_rows(as_on_gpu):
    """Inputs kept in the columns past a pool window's width, between its rows, share no byte
    with it: the one pass takes the call and launches what the full path launches."""
    case = make_scatter_case([3, 5, 0, 4], width=8, device=CPU)
    spare = 2 * max(t.numel() for t in case.inputs().values())  # int32 columns past the window
    ws = torch.full((case.pool_rows, case.width + spare), -1, dtype=torch.int32)
    kw = {**inputs_between_rows(case, ws, case.width), "pool_out": ws[:, : case.width]}
    scatter_req_token_ids(**kw)
    ours = list(as_on_gpu)
    assert len(ours) == 1
    same_launches(ours, _full_path_launches(as_on_gpu, kw))


def test_int32_device_offsets_launch_on_an_int64_copy(as_on_gpu, monkeypatch):
    """int32 offsets on the GPU (CPU tensors passing for device ones, ``is_cpu`` false): the
    one pass declines them, and the full path launches what it launches for int64 offsets of
    the same values, on a widened copy; the caller's tensor is left as it was."""
    case = make_scatter_case([3, 5, 0, 4], width=8, device=CPU)
    kw = case.kwargs(case.fresh_pool())
    want = _full_path_launches(as_on_gpu, kw)
    as_on_gpu.clear()
    offsets32 = case.offsets.to(torch.int32)
    with monkeypatch.context() as m:
        m.setattr(torch.Tensor, "is_cpu", property(lambda self: False))
        scatter_req_token_ids(**{**kw, "offsets": offsets32})
    assert [path for path, *_ in as_on_gpu] == ["full"] == [path for path, *_ in want]
    (_, bound, grid, args), (_, bound64, grid64, args64) = as_on_gpu[0], want[0]
    assert bound is bound64 and grid == grid64 and len(args) == len(args64)
    for got, was in zip(args, args64, strict=True):
        if isinstance(was, torch.Tensor):
            assert got.dtype == was.dtype and torch.equal(got, was)
        else:
            assert (type(got), got) == (type(was), was)
    assert offsets32.dtype == torch.int32
    assert torch.equal(offsets32, case.offsets.to(torch.int32))


@given(
    lens=st.lists(st.integers(0, 40), max_size=40),
    width=st.integers(1, 64),
    breakage=st.none() | st.sampled_from(list(BREAKAGES)),  # about half the calls valid
    strategy=st.sampled_from(ONE_PASS_STRATEGIES),
)
def test_one_pass_never_accepts_what_the_full_path_refuses(lens, width, breakage, strategy):
    """Whatever the sizes, and with each kind of breakage: when the one pass launches, the full
    path accepts the call and makes the same launch; a call it declines launches nothing
    before the full path's checks."""
    with pytest.MonkeyPatch.context() as m:
        seen = record_as_on_gpu(m)
        case = make_scatter_case(lens, width=width, seed=len(lens), device=CPU)
        kw, options = case.kwargs(case.fresh_pool()), {"strategy": strategy}
        if breakage is not None:
            breaking, extra = BREAKAGES[breakage]
            kw, options = breaking(kw), {**options, **extra}
        call = lambda: scatter_req_token_ids(**kw, **options)  # noqa: E731
        one_pass_or_full_path(seen, scatter, call, broken=breakage is not None)


def test_record_launches_switches_the_one_pass_off_and_back():
    one_pass = scatter._launched, plan._launched
    with record_launches():
        assert scatter._launched is not one_pass[0] and plan._launched is not one_pass[1]
        assert scatter._launched(None, None, None, None, None, "auto") is False
        assert plan._launched(None, None, None, "auto") is False
    assert (scatter._launched, plan._launched) == one_pass


@gpu
@pytest.mark.parametrize("strategy", ONE_PASS_STRATEGIES)
@pytest.mark.parametrize("lens,width", SHAPES, ids=str)
def test_one_pass_on_gpu_is_exact_and_leaves_no_path(monkeypatch, strategy, lens, width):
    """Every one of these calls stays in the one pass (the full path would raise), twice (the
    cached launch), then once more with every vector at an unaligned address."""

    def full_path(*args):
        raise AssertionError("the call left the one pass")

    monkeypatch.setattr(scatter, "_scatter", full_path)
    for seed in (1, 2):
        case = make_scatter_case(lens, width=width, seed=seed, device=DEVICE)
        check_scatter(scatter_req_token_ids, case, strategy=strategy)
    room = {k: torch.empty(v.numel() + 1, dtype=v.dtype, device=DEVICE) for k, v in _vectors(case)}
    for k, v in _vectors(case):
        room[k][1:].copy_(v)
        assert room[k][1:].data_ptr() % 16 == (8 if v.numel() else 0)  # empty: address 0
    unaligned = dataclasses.replace(case, **{k: room[k][1:] for k in room})
    check_scatter(scatter_req_token_ids, unaligned, strategy=strategy)


def _vectors(case) -> list[tuple[str, torch.Tensor]]:
    return [(k, getattr(case, k)) for k in ("flat_in", "offsets", "req_pool_indices")]


@pytest.mark.parametrize("strategy", ONE_PASS_STRATEGIES)
@pytest.mark.parametrize("name", sorted(SCATTER_REJECTIONS))
def test_one_pass_refuses_every_named_rejection(as_on_gpu, name, strategy):
    """Each breakage of the rejection properties, made as an engine makes the call (the one
    pass on, every tensor passing for one on the current GPU): refused with its text, every
    tensor unchanged, nothing launched by either path."""
    case = make_scatter_case([3, 1, 4, 0, 5], width=8, seed=4, device=CPU)
    assert check_scatter_rejected(case, name, index=5, strategy=strategy, one_pass=True)
    assert as_on_gpu == []


@pytest.fixture
def recorded_keys(monkeypatch) -> list[tuple]:
    keys: list[tuple] = []

    def record(self, key, device, grid, args, handed, free=0, stream=None):
        keys.append(key)

    monkeypatch.setattr(fast.BoundKernel, "_launch", record)
    return keys


def test_checked_launch_keys_hold_address_residues(recorded_keys):
    """``BoundKernel.checked``'s cache key holds its tensors' address residues modulo 16 (Triton
    compiles a pointer not 16-byte aligned apart) and its integers' width: two aligned calls
    share a key; an address 8 bytes off, or an integer past int32, gets one of its own. On the
    CPU the interpreter never caches, so the key is read where ``_launch`` would take it; on a
    GPU a shared key would run the aligned binary on the unaligned tensor."""
    bound = fast.BoundKernel(_scatter_rows_kernel, {"COLS": 1024})
    bound._compiles = True  # the compiled path's key, whatever the machine
    tensors = (torch.zeros(4, dtype=torch.int64),)
    calls = [
        ((4096,), (5, 9)),
        ((8192,), (6, 10)),  # aligned, int32: the first call's key
        ((4104,), (5, 9)),  # 8 bytes past a 16-byte boundary
        ((4096,), (5, 2**31)),  # an integer past int32
    ]
    for addresses, ints in calls:
        bound.checked((1,), 0, tensors, addresses, ints)
    first, same, unaligned, wide = recorded_keys
    assert first == same
    assert unaligned != first
    assert wide != first and wide != unaligned
