"""Compiled steps that scatter into views of the caller's pool, against the reference, byte for
byte, the rest of the pool untouched. torch's functionalization of custom ops that mutate an
argument (``auto_functionalized_v2``, torch 2.11 and 2.13) misplaces the writes into a view
made inside the compiled function of an argument that is itself a view at a non-zero storage
offset (reproduced without this library, ``tests/gpu/compile_views_probe.py``); the patterns
that are not affected (the window passed itself: the documented way out) are pinned here, and
so is what torch's first functionalization (``enable_auto_functionalized_v2 = False``) mends
and what it does not."""

from __future__ import annotations

import pytest
import torch
import torch._inductor.config as inductor_config
from conftest import DEVICE
from test_engine_safety_compile import BACKEND  # inductor on a GPU, aot_eager on the CPU

from kvcanary_dispatch import plan_offsets, scatter_req_token_ids
from kvcanary_kernels import plan_offsets_ref, scatter_req_token_ids_ref

FLAT = [10, 11, 12, 20, 21]
WINDOWS = {  # the argument the compiled step is given: a view of an [3, 8] int32 buffer
    "whole": (slice(None), slice(None)),
    "rows 1:": (slice(1, None), slice(None)),
    "columns 2:": (slice(None), slice(2, None)),
}


def _run(step, window: str, inner: bool, unchecked: tuple[int, slice] | None = None) -> None:
    """``step`` compiled, on the buffer's ``window``, against the reference on the same view
    of a copy (``inner``: the step writes into ``table[:, :4]``, a view it makes); every
    element of the buffer compared but ``unchecked`` (a row and columns of it), if given."""
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
    if unchecked is not None:
        big[unchecked] = want[unchecked]
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


# torch defect: inductor with the first functionalization writes into row 2's columns 2 and 3,
# past the scatter (torch 2.11; the same with a minimal torch.library custom op): 0 in
# tests/gpu/compile_views_probe.py, even with the allocator's free blocks holding 7777, and at
# step 63, but the right -1 in the suite at step 104 (why not found). Those two are left
# unchecked there; every other element is compared.
INDUCTOR_ROWS_DEFECT = (2, slice(2, 4))


@pytest.mark.parametrize("window", ["rows 1:", "columns 2:"])
def test_compiled_scatter_into_a_view_of_a_window_with_v1_functionalization(window):
    """The affected pattern, with torch's first functionalization of mutating custom ops: right
    under ``aot_eager`` for both windows and under inductor for a column window; under
    inductor a row window is right but for the two elements torch's defect writes."""
    unchecked = INDUCTOR_ROWS_DEFECT if BACKEND == "inductor" and window == "rows 1:" else None
    with inductor_config.patch(enable_auto_functionalized_v2=False):
        _run(_into_a_view_of_it, window, inner=True, unchecked=unchecked)


def _plan_into_a_carved_workspace(planner, rpi, prefix, extend, r2t, vo, wo, seeds, scalars):
    planner(
        req_pool_indices=rpi, prefix_lens=prefix, extend_seq_lens=extend, req_to_token=r2t,
        full_to_swa_index_mapping=None, swa_window_size=0, verify_capacity=100,
        out_verify_offsets=vo, out_write_offsets=wo, out_write_seed_slot_indices=seeds,
        out_verify_num_valid=scalars[0:1], out_verify_enable=scalars[1:2],
        out_write_num_valid_reqs=scalars[2:3],
    )  # fmt: skip


@pytest.mark.parametrize("start", [0, 4])
def test_compiled_plan_into_scalars_carved_from_a_window(start):
    """The plan's three scalars carved inside the step from a window of one int32 workspace:
    at offset 0 as is, at offset 4 (the affected pattern, whose scalars torch hands the op as
    empty) with torch's first functionalization; every buffer equal to the reference's."""
    inputs = [torch.tensor(v, device=DEVICE) for v in ([1, 0, 2], [2, 5, 3], [1, 1, 4])]
    r2t = torch.arange(24, dtype=torch.int32, device=DEVICE).reshape(3, 8)

    def buffers():
        i64 = dict(dtype=torch.int64, device=DEVICE)
        return [torch.full((8,), -9, **i64), torch.full((4,), -9, **i64),
                torch.full((3,), -9, **i64),
                torch.full((12,), -9, dtype=torch.int32, device=DEVICE)]  # fmt: skip

    got, want = buffers(), buffers()
    step = _plan_into_a_carved_workspace
    step(plan_offsets_ref, *inputs, r2t, *want[:3], want[3][start : start + 3])
    torch._dynamo.reset()
    with inductor_config.patch(enable_auto_functionalized_v2=start == 0):
        compiled = torch.compile(step, fullgraph=True, backend=BACKEND)
        compiled(plan_offsets, *inputs, r2t, *got[:3], got[3][start : start + 3])
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w), (g.tolist(), w.tolist())
