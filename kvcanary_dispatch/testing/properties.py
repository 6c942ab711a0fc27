"""The dispatcher's properties as plain functions (no pytest), for the tests and ``fuzz``.

Each ``check_*`` raises ``AssertionError`` naming what broke:

- ``check_scatter_property`` / ``check_plan_property`` (``equality``): the dispatched call
  equals the torch reference byte for byte on poisoned outputs and leaves its inputs unchanged
  (on CUDA, also when run unrecorded, the engine's one-pass launch); every kernel launch
  (recorded by ``record_launches``, in ``launches``) stays within its block; slices see
  rebased offsets and the matching data; dispatching each slice on its own (when there are
  several) and concatenating the results gives the whole.
- ``check_scatter_rejected`` / ``check_plan_rejected`` (``rejections``): a call made invalid in
  a named way (``SCATTER_REJECTIONS``, ``PLAN_REJECTIONS``) raises the expected error before
  any launch and leaves every byte of its tensors, inputs and outputs, as it was.
- ``check_broken_offsets_writes`` (``scatter_inputs``): after a scatter on offsets that break
  the CSR rules (``BROKEN_OFFSETS``, or any), only the addressed rows' first columns of a
  poisoned pool between guard rows changed, each to the token its row's request names.

Every name is importable from here; the ``fuzz`` command looks the checks up on this module.
"""

from __future__ import annotations

from .equality import (
    OFFSETS_FORMS,
    check_plan_property,
    check_scatter_property,
    offsets_in_form,
)
from .launches import (
    Launch,
    check_launch_blocks,
    check_plan_slices_seen,
    check_scatter_slices_seen,
    record_launches,
)
from .rejections import (
    PLAN_REJECTIONS,
    SCATTER_REJECTIONS,
    Rejection,
    check_plan_rejected,
    check_scatter_rejected,
)
from .scatter_inputs import BROKEN_OFFSETS, check_broken_offsets_writes

__all__ = [
    "BROKEN_OFFSETS",
    "OFFSETS_FORMS",
    "PLAN_REJECTIONS",
    "SCATTER_REJECTIONS",
    "Launch",
    "Rejection",
    "check_broken_offsets_writes",
    "check_launch_blocks",
    "check_plan_property",
    "check_plan_rejected",
    "check_plan_slices_seen",
    "check_scatter_property",
    "check_scatter_rejected",
    "check_scatter_slices_seen",
    "offsets_in_form",
    "record_launches",
]
