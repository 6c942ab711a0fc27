"""The CPU interpreter's bounds checks (``tests/_interpreter_bounds.py``) catch each kind of
access outside a launch's tensors, and let everything inside them, or masked off, through."""

from __future__ import annotations

import os

import pytest
import torch
import triton
import triton.language as tl

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="checks Triton's CPU interpreter"
)


@triton.jit
def _read_discarded(src_ptr, dst_ptr, shift, n, BLOCK: tl.constexpr):
    # src, dst: int32 [n]; every lane reads src[i + shift] and then writes src[i] alone, so a
    # read outside src changes no output
    i = tl.arange(0, BLOCK)
    keep = i < n
    ahead = tl.load(src_ptr + i + shift, mask=keep)
    tl.store(dst_ptr + i, tl.where(ahead == ahead, tl.load(src_ptr + i, mask=keep), 0), mask=keep)


@triton.jit
def _write_at(dst_ptr, shift, n, BLOCK: tl.constexpr):
    # dst: int32 [n]; writes 7 at dst[i + shift] for i < n
    i = tl.arange(0, BLOCK)
    tl.store(dst_ptr + i + shift, tl.full([BLOCK], 7, tl.int32), mask=i < n)


@triton.jit
def _add_at(dst_ptr, shift):
    # dst: int32 [>= 1]; one atomic add at dst[shift]
    tl.atomic_add(dst_ptr + shift, 1)


@triton.jit
def _gather(src_ptr, stride, dst_ptr, n, BLOCK: tl.constexpr):
    # src: int32 [>= n] with a stride; dst: int32 [>= n]; dst[i] = src[i * stride] for i < n
    i = tl.arange(0, BLOCK)
    tl.store(dst_ptr + i, tl.load(src_ptr + i * stride, mask=i < n), mask=i < n)


def _run(kernel, *args) -> None:
    kernel[(1,)](*args)


def test_a_discarded_read_past_the_end_is_named():
    src = torch.arange(8, dtype=torch.int32)
    dst = torch.full((8,), -1, dtype=torch.int32)
    with pytest.raises(Exception, match=r"_read_discarded, program \(0, 0, 0\): load of 4-byte"):
        _run(_read_discarded, src, dst, 1, 8, 8)
    with pytest.raises(Exception, match="byte 32 of 'src_ptr', whose view spans 32 bytes"):
        _run(_read_discarded, src, dst, 1, 8, 8)


def test_a_read_before_a_views_first_element_is_caught_inside_its_storage():
    whole = torch.arange(16, dtype=torch.int32)
    src, dst = whole[4:12], torch.full((8,), -1, dtype=torch.int32)
    with pytest.raises(Exception, match="byte -4 of 'src_ptr', whose view spans 32 bytes"):
        _run(_read_discarded, src, dst, -1, 8, 8)


def test_accesses_inside_the_tensors_or_masked_off_pass():
    src = torch.arange(8, dtype=torch.int32)
    dst = torch.full((8,), -1, dtype=torch.int32)
    _run(_read_discarded, src, dst, 0, 8, 16)  # lanes 8-15 point past src, masked off
    assert torch.equal(dst, src)
    _run(_read_discarded, src, dst, 1, 7, 8)  # the last lane allowed reads src[7]
    out = torch.full((8,), -1, dtype=torch.int32)
    _run(_write_at, out, 0, 8, 8)
    assert torch.equal(out, torch.full((8,), 7, dtype=torch.int32))


def test_a_store_past_the_end_is_refused_before_it_writes():
    whole = torch.full((9,), -1, dtype=torch.int32)
    with pytest.raises(Exception, match=r"store of 4-byte elements at 1 address\(es\)"):
        _run(_write_at, whole[:8], 1, 8, 8)
    assert torch.equal(whole, torch.full((9,), -1, dtype=torch.int32))  # nothing written


def test_an_atomic_past_the_end_is_caught():
    whole = torch.zeros(3, dtype=torch.int32)
    _run(_add_at, whole[:2], 1)
    assert whole.tolist() == [0, 1, 0]
    with pytest.raises(Exception, match="atomic update"):
        _run(_add_at, whole[:2], 2)
    assert whole.tolist() == [0, 1, 0]


def test_a_strided_views_bytes_are_its_elements_not_the_gaps_between_them():
    rows = torch.arange(16, dtype=torch.int32).reshape(4, 4)
    column = rows[:3, 1]  # elements 1, 5 and 9 of a 16-element storage; stride 4
    dst = torch.full((4,), -1, dtype=torch.int32)
    _run(_gather, column, 4, dst, 3, 4)
    assert dst.tolist() == [1, 5, 9, -1]
    with pytest.raises(Exception, match="byte 48 of 'src_ptr', whose view spans 36 bytes"):
        _run(_gather, column, 4, dst, 4, 4)  # element 13: in the storage, past the view
    with pytest.raises(Exception, match=r"byte 8 of 'src_ptr', .* in 3 rows of 4 bytes, 16 apart"):
        _run(_gather, column, 2, dst, 3, 4)  # element 3, between the view's first two


def test_a_column_windows_rows_are_its_bytes_not_the_columns_between_them():
    pool = torch.arange(32, dtype=torch.int32).reshape(4, 8)
    window = pool[1:, 2:5]  # rows of 3 elements, 8 apart
    dst = torch.full((4,), -1, dtype=torch.int32)
    _run(_gather, window, 8, dst, 3, 4)  # the window's first column
    assert dst.tolist() == [10, 18, 26, -1]
    _run(_gather, window[:, 2:], 8, dst, 3, 4)  # and its last, through a narrower window
    assert dst.tolist() == [12, 20, 28, -1]
    with pytest.raises(Exception, match=r"byte 12 of 'src_ptr', .* in 3 rows of 8 bytes, 32 apart"):
        _run(_gather, window[:, 1:], 3, dst, 2, 4)  # window[0, 4]: pool[1, 6], a gap column
    assert dst.tolist() == [12, 20, 28, -1]


def test_overlapping_rows_are_one_run():
    storage = torch.arange(64, dtype=torch.int32)
    rows = storage.as_strided((3, 4), (2, 1))  # rows of 4 elements, 2 apart: elements 0-7
    dst = torch.full((8,), -1, dtype=torch.int32)
    _run(_gather, rows, 1, dst, 8, 8)  # elements 6 and 7 lie in the last row alone
    assert dst.tolist() == list(range(8))
    with pytest.raises(Exception, match="byte 32 of 'src_ptr', whose view spans 32 bytes"):
        _run(_gather, rows, 1, dst, 9, 16)  # element 8: past the last row
