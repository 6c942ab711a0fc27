"""Compiled steps that scatter into views of the caller's pool, against the reference, byte for
byte, the rest of the pool untouched. torch's functionalization of custom ops that mutate an
argument (``auto_functionalized_v2``, torch 2.13 at least) misplaces the writes into a view
made inside the compiled function of an argument that is itself a view at a non-zero storage
offset (reproduced without this library); the patterns that are not affected, and the
documented way out of the one that is (``enable_auto_functionalized_v2 = False``), are pinned
here."""

from __future__ import annotations

import pytest
import torch
import torch._inductor.config as inductor_config
from conftest import DEVICE, GPU

from kvcanary_dispatch import scatter_req_token_ids
from kvcanary_kernels import scatter_req_token_ids_ref

BACKEND = "inductor" if GPU else "aot_eager"
FLAT = [10, 11, 12, 20, 21]
WINDOWS = {  # the argument the compiled step is given: a view of an [3, 8] int32 buffer
    "whole": (slice(None), slice(None)),
    "rows 1:": (slice(1, None), slice(None)),
    "columns 2:": (slice(None), slice(2, None)),
}


def _run(step, window: str, inner: bool) -> None:
    """``step`` compiled, on the buffer's ``window``, against the reference on the same view
    of a copy (``inner``: the step writes into ``table[:, :4]``, a view it makes)."""
    flat = torch.tensor(FLAT, device=DEVICE)
    offsets = torch.tensor([0, 3, 5], device=DEVICE)
    rows = torch.tensor([0, 1], device=DEVICE)
    big = torch.full((3, 8), -1, dtype=torch.int32, device=DEVICE)
    want = big.clone()
    view = want[WINDOWS[window]]
    pool = view[:, :4] if inner else view
    scatter_req_token_ids_ref(flat_in=flat, offsets=offsets, req_pool_indices=rows, pool_out=pool)
    torch._dynamo.reset()
    torch.compile(step, fullgraph=True, backend=BACKEND)(flat, offsets, rows, big[WINDOWS[window]])
    assert torch.equal(big, want), (big.tolist(), want.tolist())


def _into_the_argument(flat, offsets, rows, table):
    scatter_req_token_ids(flat_in=flat, offsets=offsets, req_pool_indices=rows, pool_out=table)


def _into_a_view_of_it(flat, offsets, rows, table):
    pool = table[:, :4]
    scatter_req_token_ids(flat_in=flat, offsets=offsets, req_pool_indices=rows, pool_out=pool)


@pytest.mark.parametrize("window", list(WINDOWS))
def test_compiled_scatter_into_the_window_it_is_given(window):
    _run(_into_the_argument, window, inner=False)


def test_compiled_scatter_into_a_view_of_an_argument_at_offset_zero():
    _run(_into_a_view_of_it, "whole", inner=True)


@pytest.mark.parametrize("window", ["rows 1:", "columns 2:"])
def test_compiled_scatter_into_a_view_of_a_window_with_v1_functionalization(window):
    """The affected pattern, with torch's first functionalization of mutating custom ops (the
    way out the README gives)."""
    with inductor_config.patch(enable_auto_functionalized_v2=False):
        _run(_into_a_view_of_it, window, inner=True)
