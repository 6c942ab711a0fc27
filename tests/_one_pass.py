"""Drive the one-pass launches (``scatter._launched``, ``plan._launched``) without a GPU.

``record_as_on_gpu`` makes CPU tensors pass for tensors on the current CUDA device
(``is_cuda`` true, false for a ``meta`` tensor, the current device their ``get_device()``,
-1, its current stream ``STREAM``, not capturing; resident buffers kept under that device and
stream on both paths) and records launches instead of making them: the one pass's through
``BoundKernel.checked``, the full path's through ``BoundKernel.__call__`` and ``with_head``,
each as ``(path, bound kernel, grid, arguments)``. ``full_path_launches`` runs a call with the
one pass switched off; ``same_launches`` holds the one pass to the full path's launches: the
same bound kernel, grid, tensors (identical objects) and integers (of the same types);
``one_pass_or_full_path`` runs a call, broken or not, and holds it to both rules.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import kvcanary_dispatch.placement as placement
import kvcanary_dispatch.resident as resident
from kvcanary_kernels._launch import BoundKernel
from kvcanary_kernels.plan_lookback import _plan_lookback_kernel

STREAM = 12345  # the current stream's handle, as the recorded calls see it


def record_as_on_gpu(monkeypatch: pytest.MonkeyPatch) -> list:
    seen: list = []
    # CPU tensors pass for the GPU's; a tensor elsewhere (meta) stays off it.
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: self.device.type == "cpu"))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: -1)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    # No kernel runs (the launches are recorded), so CPU tensors are taken where the kernels
    # are compiled for a GPU too.
    monkeypatch.setattr(placement, "INTERPRETED", True)
    monkeypatch.setattr(resident, "current_stream_handle", lambda index: STREAM)
    # Both paths' resident buffers under the key of the current device's current stream.
    monkeypatch.setattr(resident, "_key", lambda name, device: (name, -1, STREAM))

    def checked(self, grid, device, tensors, addresses, ints, stream=None):
        assert device == -1 and addresses == tuple(t.data_ptr() for t in tensors)
        # The look-back launches on the stream whose state it took; the others read it then.
        assert stream == (STREAM if self.kernel is _plan_lookback_kernel else None)
        seen.append(("one pass", self, grid, (*tensors, *ints)))

    def with_head(self, grid, head, tensors, ints):
        seen.append(("full", self, grid, (*head.args, *tensors, *ints)))

    monkeypatch.setattr(BoundKernel, "checked", checked)
    monkeypatch.setattr(BoundKernel, "with_head", with_head)
    monkeypatch.setattr(
        BoundKernel, "__call__", lambda self, grid, args: seen.append(("full", self, grid, args))
    )
    return seen


def full_path_launches(seen: list, module: object, call: Callable[[], None]) -> list:
    """What ``call`` launches with ``module``'s one pass switched off."""
    with pytest.MonkeyPatch.context() as m:
        m.setattr(module, "_launched", lambda *args: False)
        start = len(seen)
        call()
        return seen[start:]


def _same_arguments(a: tuple, b: tuple) -> bool:
    return len(a) == len(b) and all(
        x is y if isinstance(x, torch.Tensor) else (type(x), x) == (type(y), y)
        for x, y in zip(a, b, strict=True)
    )


def same_launches(ours: list, full: list) -> None:
    assert [path for path, *_ in ours] == ["one pass"] * len(full)
    assert [path for path, *_ in full] == ["full"] * len(full)
    for (_, bound, grid, args), (_, bound_full, grid_full, args_full) in zip(
        ours, full, strict=True
    ):
        assert bound is bound_full and grid == grid_full
        assert _same_arguments(args, args_full)


def one_pass_or_full_path(
    seen: list, module: object, call: Callable[[], None], broken: bool
) -> None:
    """Run ``call`` (``broken``: with a breakage): refused with a ``ValueError`` or
    ``TypeError`` only if broken, and then having launched nothing; a call that took the one
    pass made the full path's launches; any other made the full path's alone (the same
    kernels and grids; a temporary may differ), and one that launched nothing, nothing."""
    try:
        call()
    except (ValueError, TypeError):
        assert seen == [] and broken
        return
    ours = list(seen)
    full = full_path_launches(seen, module, call)
    if ours and ours[0][0] == "one pass":
        same_launches(ours, full)
    else:
        assert [la[:3] for la in ours] == [la[:3] for la in full]
        assert all(path == "full" for path, *_ in full)
