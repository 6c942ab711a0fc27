"""What a timing run records and the calls it times: the run's metadata (``Meta``: device,
torch and Triton versions, commit), one row per measurement (``Row``), the CSV writer, and the
callables for every strategy and baseline of an op (``scatter_variants``, ``plan_variants``:
the dispatcher's strategies, the direct fixed-block launch, the per-request grid and the torch
reference). Shared by ``kvcanary-dispatch sweep`` and the benchmark suite (``benchmarks/``)."""

from __future__ import annotations

import csv
import datetime as dt
import os
import platform
import subprocess
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import triton

from kvcanary_kernels import (
    PLAN_BATCH_BLOCK,
    SCATTER_BATCH_BLOCK,
    launch_plan_offsets_kernel,
    launch_scatter_req_token_ids_kernel,
    plan_offsets_ref,
    scatter_req_token_ids_ref,
)

from ..plan import PLAN_STRATEGIES, plan_offsets
from ..scatter import SCATTER_STRATEGIES, scatter_req_token_ids
from ..testing.cases import PlanCase, ScatterCase
from .per_request_grid import scatter_per_request_grid
from .timing import copy_bandwidth_gbs

BYTES_PER_TOKEN = 12  # one int64 read, one int32 written


@dataclass
class Meta:
    device_name: str
    torch: str
    triton: str
    commit: str
    date: str
    copy_gbs: float | None

    @classmethod
    def collect(cls, device: torch.device, commit: str | None = None) -> Meta:
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor()
        return cls(
            device_name=name or "cpu",
            torch=torch.__version__,
            triton=triton.__version__,
            commit=commit or _git_commit(),
            date=dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%MZ"),
            copy_gbs=copy_bandwidth_gbs(device),
        )


def _git_commit() -> str:
    env = os.environ.get("KVCANARY_COMMIT")
    if env:
        return env
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        )
        return out.stdout.strip() or "unknown"
    except OSError:
        return "unknown"


@dataclass
class Row:
    op: str
    variant: str
    bs: int
    mix: str
    tokens: int
    chunk_size: int | None
    kernel_us: float
    graph_us: float | None
    host_loop_us: float
    launches: int | None
    floor_us: float | None = None
    extra: dict = field(default_factory=dict)


def scatter_variants(case: ScatterCase) -> dict[str, Callable[..., None]]:
    v: dict[str, Callable[..., None]] = {}
    for strategy in SCATTER_STRATEGIES:
        v[strategy] = lambda s=strategy, **kw: scatter_req_token_ids(**kw, strategy=s)
    if case.bs + 1 <= SCATTER_BATCH_BLOCK:
        v["fixed_block"] = launch_scatter_req_token_ids_kernel
    v["per_request_grid"] = scatter_per_request_grid
    v["torch_ref"] = scatter_req_token_ids_ref
    return v


def plan_variants(case: PlanCase) -> dict[str, Callable[..., None]]:
    v: dict[str, Callable[..., None]] = {}
    for strategy in PLAN_STRATEGIES:
        v[strategy] = lambda s=strategy, **kw: plan_offsets(**kw, strategy=s)
    if case.bs <= PLAN_BATCH_BLOCK:

        def fixed(out_verify_offsets, **kw):
            launch_plan_offsets_kernel(**kw, out_verify_offsets_scratch=out_verify_offsets)

        v["fixed_block"] = fixed
    v["torch_ref"] = plan_offsets_ref
    return v


def write_csv(rows: list[Row], meta: Meta, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    meta_d = asdict(meta)
    with path.open("w", newline="") as f:
        fields = list(meta_d) + [k for k in asdict(rows[0]) if k != "extra"]
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        for r in rows:
            d = asdict(r)
            d.pop("extra")
            w.writerow({**meta_d, **d})
