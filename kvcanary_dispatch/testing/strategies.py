"""Hypothesis strategies that build whole dispatcher inputs (``ScatterCase``, ``PlanCase``).

Small batches draw every length through hypothesis, so failures shrink well. Larger ones (and
every batch in ``gpu_sizes`` mode) draw a handful of parameters — ``bs``, a length
distribution, a seed — and make the tensors with torch from the seed, so a case with
``bs = 131072`` and tens of millions of tokens costs a few draws. Sizes live in ``SIZES``, keyed
by hypothesis profile name; ``sizes_for()`` reads ``HYPOTHESIS_PROFILE``. Nothing here needs
pytest, so the ``fuzz`` command can use it too. To reach every path ``auto`` can take, draws
include ``chunk_size=None``, block-edge batch sizes, long runs and int64-extreme plan totals.

The strategies live by role, and every name is importable from here:

- ``sizes``: the size regimes and the shared draws (``log_uniform``, ``batch_sizes``,
  ``chunk_and_bs``);
- ``scatter_inputs``: ``build_scatter_case``, ``scatter_cases``, ``scatter_cases_for``;
- ``plan_inputs``: ``build_plan_case``, ``plan_cases``, ``plan_cases_for``.
"""

from __future__ import annotations

from .plan_inputs import EXTREME_TOTALS, build_plan_case, plan_cases, plan_cases_for
from .scatter_inputs import build_scatter_case, scatter_cases, scatter_cases_for
from .sizes import (
    BLOCK_EDGE_BS,
    CAPPED_BAND,
    SIZES,
    BatchSize,
    Device,
    Sizes,
    batch_size_strategy,
    batch_sizes,
    chunk_and_bs,
    log_uniform,
    sizes_for,
)

__all__ = [
    "BLOCK_EDGE_BS",
    "EXTREME_TOTALS",
    "CAPPED_BAND",
    "SIZES",
    "BatchSize",
    "Device",
    "Sizes",
    "batch_size_strategy",
    "batch_sizes",
    "build_plan_case",
    "build_scatter_case",
    "chunk_and_bs",
    "log_uniform",
    "plan_cases",
    "plan_cases_for",
    "scatter_cases",
    "scatter_cases_for",
    "sizes_for",
]
