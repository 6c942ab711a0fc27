"""Property tests of rows far apart in memory: drawn scatter pools and plan ``req_to_token``
tables, each an ``as_strided`` view of ONE backing buffer per module at a drawn row stride
and storage offset, for every strategy, byte-exact against the torch reference.

On a GPU with the memory (about ``10 * BACKING`` bytes free, else skipped) the backing
buffer holds ``5 * 2**30 + 2**20`` int32 elements and the strides include ``2**30 + 7``,
``3 * 2**29 + 1``, ``2**31 - 1`` and ``2**31 + 3``, so a used row's start ``row * stride``
lies past ``2**31`` elements (past ``2**32`` at row 4 of ``2**30 + 7``): a kernel that
computes a row address in int32 writes or reads the wrong place. Without a GPU the same
checks run on a small buffer with strides from 77 up; only the GPU run proves the 64-bit
addressing. ``test_far_rows_were_reached`` checks that examples used a row that far.

What each example checks: ``check_scatter`` / ``check_plan`` (every byte of the pool's rows,
the columns past its width included, or of the plan's outputs, equals the reference's; the
inputs, the table included, unchanged), and that every element of the backing buffer
outside the view's rows is still poison. A failed check goes on with its frames' locals
cleared (``dropping_frames``), so the examples hypothesis keeps while it shrinks hold no
reference pool. The scatter takes any row stride ``>= width`` and any storage offset; the
plan's table must be contiguous, so its row stride is its width: the drawn table is ``[rows,
stride]`` with the case's columns first, the rest poison.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections import Counter
from collections.abc import Iterator
from functools import partial

import pytest
import torch
from _helpers import dropping_frames
from conftest import DEVICE, GPU
from hypothesis import given, note, settings
from hypothesis import strategies as st

from kvcanary_dispatch import (
    PLAN_STRATEGIES,
    SCATTER_STRATEGIES,
    plan_offsets,
    scatter_req_token_ids,
)
from kvcanary_dispatch.testing.cases import (
    POISON_I32,
    PlanCase,
    ScatterCase,
    check_plan,
    check_scatter,
)
from kvcanary_dispatch.testing.strategies import (
    build_plan_case,
    build_scatter_case,
    plan_cases,
    scatter_cases,
)

if GPU:  # 20 GiB: five rows 2**30 + 7 apart (row 4 past 2**32), or two 2**31 + 3 apart
    BACKING = 5 * 2**30 + 2**20
    STRIDES = (2**30 + 7, 3 * 2**29 + 1, 2**31 - 1, 2**31 + 3)
    FAR = 2**31  # a row starting here overflows int32 addressing
else:  # the same shapes in miniature: only the GPU run proves the addressing
    BACKING = 5 * 77 + 40
    STRIDES = (77, 125, 193, 211)
    FAR = 2 * 77  # stands in for 2**31: row 2 of the smallest stride
# Fewer examples than the profile's on the CPU (the interpreter) and on the GPU (each
# example fills and compares up to 20 GiB per strategy).
EXAMPLES = settings(max_examples=min(settings.default.max_examples, 400 if GPU else 25))
CHUNKS = st.sampled_from([None, 1, 2])  # slices of 1 and 2 requests too
REACHED: Counter = Counter()


@pytest.fixture(scope="module")
def backing() -> Iterator[torch.Tensor]:
    """The module's one int32 backing buffer of ``BACKING`` elements (freed after the module)."""
    if GPU and torch.cuda.mem_get_info()[0] < 10 * BACKING + 2**31:
        pytest.skip("needs the GPU memory for rows 2**31 elements apart (about 56 GB)")
    buf = torch.full((BACKING,), POISON_I32, dtype=torch.int32, device=DEVICE)
    yield buf
    buf.set_()  # release the storage now, not when pytest drops the fixture
    if GPU:
        torch.cuda.empty_cache()


@st.composite
def layouts(draw: st.DrawFn, rows: int, width: int, natural: int) -> tuple[int, int]:
    """``(row stride, storage offset)`` of ``rows`` rows of at least ``width`` elements that fit
    the backing buffer: the case's own stride (``natural``, first: what failures shrink to) or
    one of ``STRIDES``; the offset 0, 1 (unaligned), the largest that fits, or any."""
    fits = [s for s in (natural, *STRIDES) if s >= width and rows * s <= BACKING]
    stride = draw(st.sampled_from(fits))
    room = BACKING - rows * stride
    return stride, draw(st.one_of(st.sampled_from([0, min(1, room), room]), st.integers(0, room)))


def assert_poison_outside(backing: torch.Tensor, start: int, length: int) -> None:
    """Every element of ``backing`` outside ``[start, start + length)`` is still poison (its
    min and max, so no full-size temporary), then the inside is poisoned again."""
    for part in (backing[:start], backing[start + length :]):
        if part.numel():
            lo, hi = torch.aminmax(part)
            assert int(lo) == int(hi) == POISON_I32, "a write outside the view's rows"
    backing[start : start + length].fill_(POISON_I32)


@st.composite
def dense_scatter_cases(draw: st.DrawFn, max_bs: int, max_width: int) -> ScatterCase:
    """Scatter cases (``build_scatter_case``) with no spare rows and every run non-empty, some
    past the width: every row is written, the last the farthest. ``scatter_cases`` draws
    these too, but rarely."""
    bs, width = draw(st.integers(1, max_bs)), draw(st.integers(1, max_width))
    lens = draw(st.lists(st.integers(1, 2 * width), min_size=bs, max_size=bs))
    seed = draw(st.integers(0, 2**32 - 1))
    return build_scatter_case(
        torch.tensor(lens), width=width, spare_rows=0, seed=seed, device=DEVICE
    )


@st.composite
def seeded_plan_cases(draw: st.DrawFn, max_bs: int, max_seq_len: int) -> PlanCase:
    """Plan cases (``build_plan_case``) whose every request reads a seed, ``req_to_token[row,
    prefix - 1]``: no padding, prefixes in ``[1, width]``, extends in ``[1, 4]``, with or
    without a window and a LUT. ``plan_cases`` draws seeded requests too, but rarely."""
    bs, width = draw(st.integers(1, max_bs)), draw(st.integers(1, max_seq_len))
    lens = partial(st.lists, min_size=bs, max_size=bs)
    return build_plan_case(
        prefix_lens=torch.tensor(draw(lens(st.integers(1, width)))),
        extend_seq_lens=torch.tensor(draw(lens(st.integers(1, 4)))),
        padding=torch.zeros(bs, dtype=torch.bool),
        max_seq_len=width,
        lut_len=draw(st.one_of(st.none(), st.integers(1, 4 * width + 4))),
        swa_window_size=draw(st.sampled_from([0, 1, width])),
        capacity_mode=draw(st.sampled_from(["below", "at", "above"])),
        capacity_delta=0,
        spare_capacity=draw(st.integers(0, 1)),
        spare_verify=draw(st.integers(0, 1)),
        seed=draw(st.integers(0, 2**32 - 1)),
        device=DEVICE,
    )


@dataclasses.dataclass
class ViewCase(ScatterCase):
    """A ``ScatterCase`` whose first ``fresh_pool()`` is ``view`` (``check_scatter`` takes the
    implementation's pool first: the test asserts it got the view back); later calls make
    the reference's ``[pool_rows, pool_pitch]`` pool as usual."""

    view: torch.Tensor | None = None

    def fresh_pool(self) -> torch.Tensor:
        view, self.view = self.view, None
        return view if view is not None else super().fresh_pool()


@EXAMPLES
@given(
    case=st.one_of(
        scatter_cases(max_bs=4, max_len=40, max_width=16, device=DEVICE, max_pool_elems=BACKING),
        dense_scatter_cases(max_bs=5, max_width=16),
    ),
    data=st.data(),
    chunk=CHUNKS,
    validate=st.booleans(),
)
def test_scatter_into_far_apart_rows(
    backing: torch.Tensor, case: ScatterCase, data: st.DataObject, chunk: int | None, validate: bool
) -> None:
    """Every strategy scatters into a view of the backing buffer at a drawn row stride and
    storage offset exactly as the reference does, and writes nothing outside its rows."""
    rows, width = case.pool_rows, case.width
    stride, offset = data.draw(layouts(rows, width, max(case.pool_pitch, width)), "layout")
    writes = case.req_pool_indices[case.written_lens > 0]
    REACHED["ran scatter"] += 1
    REACHED["scatter"] += bool(writes.numel()) and int(writes.max()) * stride >= FAR
    backing.fill_(POISON_I32)  # a failed example may have left writes behind
    for strategy in SCATTER_STRATEGIES:
        note(f"running strategy={strategy!r}")
        view = backing.as_strided((rows, width), (stride, 1), offset)
        far = ViewCase(**{**vars(case), "pool_pitch": stride}, view=view)
        impl = partial(scatter_req_token_ids, strategy=strategy, chunk_size=chunk)
        assert dropping_frames(check_scatter, partial(impl, validate=validate), far) is view
        assert_poison_outside(backing, offset, rows * stride)


@EXAMPLES
@given(
    case=st.one_of(
        plan_cases(max_bs=3, device=DEVICE, max_seq_len=16, max_pool_elems=BACKING),
        seeded_plan_cases(max_bs=3, max_seq_len=16),
    ),
    data=st.data(),
    chunk=CHUNKS,
    validate=st.booleans(),
)
def test_plan_reads_far_apart_rows(
    backing: torch.Tensor, case: PlanCase, data: st.DataObject, chunk: int | None, validate: bool
) -> None:
    """Every strategy plans from a ``req_to_token`` that is a contiguous ``[rows, stride]``
    view of the backing buffer (the case's table in its first columns, poison after) exactly
    as the reference does, and leaves the table and the rest of the buffer unchanged."""
    rows, width = case.req_to_token.shape
    stride, offset = data.draw(layouts(rows, width, width), "layout")
    rpi, prefix = case.req_pool_indices, case.prefix_lens
    seeded = (rpi != 0) & (prefix > 0) & (case.extend_seq_lens > 0)  # reads a seed
    REACHED["ran plan"] += 1
    REACHED["plan"] += bool(seeded.any()) and int((rpi * stride + prefix - 1)[seeded].max()) >= FAR
    backing.fill_(POISON_I32)
    for strategy in PLAN_STRATEGIES:
        note(f"running strategy={strategy!r}")
        table = backing.as_strided((rows, stride), (stride, 1), offset)
        table[:, :width] = case.req_to_token
        far = dataclasses.replace(case, req_to_token=table)
        dropping_frames(
            check_plan, plan_offsets, far, strategy=strategy, chunk_size=chunk, validate=validate
        )
        assert_poison_outside(backing, offset, rows * stride)


def test_far_rows_were_reached() -> None:
    """The examples above scattered into, and planned from, a row starting at least ``FAR``
    elements into its view (past ``2**31`` on a GPU)."""
    if not (REACHED["ran scatter"] and REACHED["ran plan"]):
        pytest.skip("needs both property tests above to run first (in this session)")
    missing = [k for k in ("scatter", "plan") if not REACHED[k]]
    assert not missing, f"no example reached a row {FAR} elements in: {missing}; {REACHED}"


def test_a_failed_check_keeps_none_of_its_tensors() -> None:
    """The error ``dropping_frames`` lets through, held as hypothesis holds a failing example's,
    keeps nothing of the failed check alive, and still ends where the check raised it."""
    kept = []

    def check() -> None:
        reference = torch.zeros(8, device=DEVICE)
        kept.append(weakref.ref(reference))
        raise AssertionError("pool_out: 1 elements differ")

    with pytest.raises(AssertionError, match="pool_out: 1 elements differ") as held:
        dropping_frames(check)
    assert kept[0]() is None, held
    assert held.traceback[-1].name == "check", held.traceback[-1]
