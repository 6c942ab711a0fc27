"""Step 20 of benchmarks/NOTES.md: one distribution's scatter, three calls, for ``ncu``.

``ncu --set full -k regex:capped --launch-skip 2 --launch-count 1 python -m
benchmarks.history.ncu_run NAME [SHAPE_JSON]`` profiles the third call: ``auto`` on the batch
``benchmarks.distributions`` builds for ``NAME``, or with ``SHAPE_JSON`` the ``capped``
launcher at ``auto``'s shape with those keywords replaced (``'{"peel": 0}'``).
"""

from __future__ import annotations

import json
import sys

import torch

from benchmarks.distributions import distribution_case
from kvcanary_dispatch import scatter_req_token_ids
from kvcanary_dispatch.launch_plan import capped_shape
from kvcanary_kernels.args import ScatterArgs
from kvcanary_kernels.scatter_capped import capped_grid, launch_scatter_capped


def main(name: str, overrides: dict | None) -> None:
    case = distribution_case(name, torch.device("cuda"))
    width = case.width
    kw = case.kwargs(case.fresh_pool())
    shape = {**dict(capped_shape(case.bs, case.total, width)), **(overrides or {})}
    for _ in range(3):
        if overrides is None:
            scatter_req_token_ids(**kw)
        else:
            grid = capped_grid(case.bs, case.total, width, shape)
            launch_scatter_capped(ScatterArgs(**kw), grid=grid, **shape)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main(sys.argv[1], json.loads(sys.argv[2]) if len(sys.argv) > 2 else None)
