"""Two rules of ``kvcanary_dispatch.aliasing`` that the overlap tests cannot reach: tensors on
different devices share nothing, whatever their addresses, and the one-pass plan's record of
calls found disjoint stays bounded however many layouts a process sees."""

from __future__ import annotations

import pytest
import torch
from _helpers import plan_call
from conftest import DEVICE

from kvcanary_dispatch import aliasing, plan_offsets
from kvcanary_dispatch.aliasing import Span, refuse_shared_memory


def test_tensors_on_different_devices_share_nothing(monkeypatch):
    """Two devices' memories are apart even where their addresses coincide (here every tensor
    is given the same span): only tensors on one device are compared."""
    monkeypatch.setattr(aliasing, "span_of", lambda t: Span(4096, 1, 0, 64))
    out = torch.empty(8, dtype=torch.int64)
    elsewhere = torch.empty(8, dtype=torch.int64, device="meta")
    refuse_shared_memory("f", ((out, "out"),), ((elsewhere, "x"), (None, "absent")))
    with pytest.raises(ValueError, match=r"^kv-canary: f out shares memory with y; pass "):
        refuse_shared_memory("f", ((out, "out"),), ((elsewhere, "x"), (out.clone(), "y")))


def test_the_record_of_disjoint_plan_calls_stays_bounded(monkeypatch):
    """A process that plans into ever new buffers does not grow the record without bound: a
    full record starts over, keeping the call just checked."""
    full = {(("layout", k), (0, 0, 0, 0, 0)) for k in range(aliasing._DISJOINT_MAX)}
    monkeypatch.setattr(aliasing, "_DISJOINT", full)
    inputs, outputs = plan_call(5, lut=True, device=DEVICE)
    plan_offsets(**inputs, **outputs)
    assert len(aliasing._DISJOINT) == 1, len(aliasing._DISJOINT)
    plan_offsets(**inputs, **outputs)  # the same call again: found in the record
    assert len(aliasing._DISJOINT) == 1
