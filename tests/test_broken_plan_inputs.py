"""Plan data that breaks the preconditions (``validate=False``, ``BROKEN_PLAN_DATA``): a pool
row outside ``req_to_token`` (its last row plus one, far past it, negative, int64's minimum)
or a prefix past its width, through every plan strategy (one slice, and slices of 2
requests) and the fixed-block launcher, with and without a LUT and a window. Such a request
reads no seed: its seed is -1, as the reference gives, and every other byte equals the
reference's; on the CPU the interpreter's bounds checks fail any read outside the launch's
tensors (a seed read at a row or column outside the table was one, before the kernels
bounded it)."""

from __future__ import annotations

import pytest
from conftest import DEVICE

from kvcanary_dispatch.testing.plan_inputs import (
    BROKEN_PLAN_DATA,
    broken_plan_case,
    check_broken_plan,
)


@pytest.mark.parametrize("window", [0, 3])
@pytest.mark.parametrize("lut", [False, True])
@pytest.mark.parametrize("name", list(BROKEN_PLAN_DATA))
def test_a_seed_outside_the_table_is_not_read(name, lut, window):
    case, r = broken_plan_case(name, lut=lut, window=window, device=DEVICE)
    check_broken_plan(case, r, chunks=(None, 2))
