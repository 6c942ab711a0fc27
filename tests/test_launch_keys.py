"""The launch keys of ``kvcanary_kernels._launch`` against what Triton specialises a compiled
kernel on: two calls that Triton would compile apart must never share a key (else a cached
launch reuses a binary compiled for other arguments: a wrong result on a GPU). Each test
here caught a mutant of ``_launch.py`` that the cache tests let through."""

from __future__ import annotations

import pytest
import torch
import triton.language as tl
from triton.runtime.jit import JITFunction

import kvcanary_kernels._launch as fast
from kvcanary_kernels.scatter_rows import _scatter_rows_kernel


def key(*args, device=0, **meta):
    return fast.specialization_key(_scatter_rows_kernel, device, args, meta)


def test_integer_key_tells_16_divisible_from_8_divisible():
    """Triton marks an integer divisible by 16 (not merely by 8) as such."""
    assert key(8) != key(16) and key(24) != key(32) and key(-8) != key(-16)
    assert key(8) == key(24)


def test_constexpr_key_tells_bool_from_int():
    """``True`` and ``1`` are equal in Python but different constexprs to Triton."""
    t = torch.zeros(8, dtype=torch.int64)
    assert key(t, COLS=True) != key(t, COLS=1)


def test_widths_keep_each_wide_integers_class_and_position():
    """Integers past int32 are typed i64 or u64 by Triton, position by position: tuples that
    differ in either get different width keys; int32 ones, at both bounds, the one key."""
    w = fast._widths
    assert w((5, 9), 0) is True
    assert w((2**31 - 1, -(2**31)), 0) is True
    assert w((5, 2**31), 0) != w((2**31, 5), 0)
    assert w((5, 2**31), 0) != w((5, 2**63), 0)
    assert w((5, -(2**31) - 1), 0) is not True


def _recording_keys(monkeypatch) -> tuple[list, fast.BoundKernel]:
    """A compiling ``BoundKernel`` on device 0 whose launches record their keys instead."""
    keys = []
    monkeypatch.setattr(fast.BoundKernel, "_launch", lambda self, k, *a, **kw: keys.append(k))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    bound = fast.BoundKernel(_scatter_rows_kernel, {"COLS": 1024})
    bound._compiles = True
    return keys, bound


def test_with_head_keys_hold_head_residues(monkeypatch):
    """A one-pass launch keys on its head's address residues: an aligned head and heads
    misaligned in either tensor never share a key (the launch itself recorded, not run)."""
    keys, bound = _recording_keys(monkeypatch)
    t = torch.zeros(4, dtype=torch.int64)
    for addresses in ((4096, 8192), (4112, 8208), (4104, 8192), (4096, 8200)):
        bound.with_head((1,), fast.make_head((t, t), addresses, 0), (), (5,))
    first, same, off0, off1 = keys
    assert first == same and len({first, off0, off1}) == 3


def test_first_refuses_a_specialised_width_keyed_integer():
    """An integer the key reads by width only must be one Triton does not specialise on
    value: a specialised one is refused, naming it, before any launch."""

    def _probe(x_ptr, n, BLOCK: tl.constexpr):
        tl.store(x_ptr + tl.arange(0, BLOCK), n, mask=tl.arange(0, BLOCK) < 1)

    probe = JITFunction(_probe)  # the compiled form's parameters, even under the interpreter
    x = torch.full((16,), -7, dtype=torch.int64)
    bound = fast.BoundKernel(probe, {"BLOCK": 16})
    with pytest.raises(TypeError, match="n is not a do_not_specialize parameter"):
        bound._first(("probe",), (1,), (x, 5), free=1)
    assert torch.equal(x, torch.full_like(x, -7))


def test_with_head_keys_hold_the_more_tensors_spec(monkeypatch):
    """It keys on the tensors after its head too: with one head, a further tensor 16-byte
    aligned (twice), 8 bytes off, or of another dtype gives a key of its own each time."""
    keys, bound = _recording_keys(monkeypatch)
    t = torch.zeros(4, dtype=torch.int64)
    head = fast.make_head((t, t), (4096, 8192), 0)
    more = torch.zeros(64, dtype=torch.int64)
    assert more.data_ptr() % 16 == 0
    for extra in (more, more[2:], more[1:], more.int()):
        bound.with_head((1,), head, (extra,), (5,))
    aligned, aligned_again, off, other_dtype = keys
    assert aligned == aligned_again and len({aligned, off, other_dtype}) == 3
