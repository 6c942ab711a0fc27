"""The one results schema of ``kvcanary-dispatch sweep`` and the benchmarks (``benchmarks/``):
the run's metadata (``Meta``), one ``Row`` per measured call, the CSV writer and reader, and a
markdown view over rows (``rows_markdown``). Every CSV they write has the columns ``COLUMNS``:

    gpu, torch, triton, commit       where and on what it ran (``gpu``: the device's name)
    function                         scatter or plan
    strategy                         a dispatcher strategy or a baseline (fixed_block, ...)
    chunk                            requests per slice (empty: the call's own choice)
    bs, distribution                 batch size and length distribution (a mix's name)
    eager_us, graph_us, host_us      the call's times (``kvcanary_dispatch.cli.timing``)
    floor_us, empty_launch_us        the bytes floor (the writer's: the sweep's 12 bytes a
                                     written token, the distribution run's 32-byte sectors)
                                     and the empty launch (L0) of the run
    status                           ok | wrong | error | skipped
    tokens, launches, error          the scatter's flat tokens, ``len(flat_in)``, of which runs
                                     past the pool width write fewer (plan: bs), device
                                     operations, why not ok
    date, width                      the run's start (UTC) and the scatter pool's width
                                     (``max_context_len``; empty for the plan)
"""

from __future__ import annotations

import csv
import datetime as dt
import os
import platform
import subprocess
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch
import triton

from .timing import Timing, copy_bandwidth_gbs, empty_launch_us


@dataclass
class Meta:
    """What a run shares: the device and versions, and its floors' denominators."""

    gpu: str
    torch: str
    triton: str
    commit: str
    date: str
    copy_gbs: float | None
    empty_launch_us: float | None

    @classmethod
    def collect(cls, device: torch.device, commit: str | None = None) -> Meta:
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor()
        return cls(
            gpu=name or "cpu",
            torch=torch.__version__,
            triton=triton.__version__,
            commit=commit or _git_commit(),
            date=dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%MZ"),
            copy_gbs=copy_bandwidth_gbs(device),
            empty_launch_us=empty_launch_us(device),
        )

    def versions(self) -> str:
        """Versions, commit and date, as ``header`` begins."""
        return f"torch {self.torch}, Triton {self.triton}, commit {self.commit}, {self.date}"

    def header(self) -> str:
        """One line: versions, commit, date, copy bandwidth and (where measured) L0."""
        gbs = f"{self.copy_gbs:.0f} GB/s (read + write)" if self.copy_gbs else None
        text = f"{self.versions()}; device copy bandwidth {gbs or 'not measured (no GPU)'}"
        if self.empty_launch_us is not None:
            text += f"; empty launch (L0) {self.empty_launch_us:.1f} µs"
        return text + "."

    def row(self, function: str, strategy: str, chunk: int | None, bs: int, distribution: str,
            *, timing: Timing | None = None, **kw) -> Row:  # fmt: skip
        """A row of this run; ``timing``'s fields fill the times and the launch count."""
        t = asdict(timing) if timing is not None else {}
        return Row(
            self.gpu, self.torch, self.triton, self.commit, function, strategy, chunk, bs,
            distribution, empty_launch_us=self.empty_launch_us, date=self.date, **t, **kw,
        )  # fmt: skip


_CHECKOUT = Path(__file__).resolve().parents[2]  # this package's repository, if it is one


def _git_commit(checkout: Path = _CHECKOUT) -> str:
    """``KVCANARY_COMMIT`` if set, else the short commit of the checkout that holds this
    package (not of the folder the command runs in), with ``+dirty`` when tracked files differ
    from it (the results are then not that commit's); ``unknown`` for an installed copy."""
    env = os.environ.get("KVCANARY_COMMIT")
    if env:
        return env
    if not (checkout / ".git").exists():
        return "unknown"
    try:
        out = subprocess.run(
            ["git", "describe", "--always", "--exclude=*", "--abbrev=7", "--dirty=+dirty"],
            capture_output=True,
            text=True,
            cwd=checkout,
        )
        return out.stdout.strip() or "unknown"
    except OSError:
        return "unknown"


@dataclass
class Row:
    """One measured (or failed, or skipped) call."""

    gpu: str
    torch: str
    triton: str
    commit: str
    function: str
    strategy: str
    chunk: int | None
    bs: int
    distribution: str
    eager_us: float | None = None
    graph_us: float | None = None
    host_us: float | None = None
    floor_us: float | None = None
    empty_launch_us: float | None = None
    status: str = "ok"
    tokens: int | None = None
    launches: int | None = None
    error: str = ""
    date: str = ""  # the run's start, UTC
    width: int | None = None  # the scatter pool's width (max_context_len); None for the plan

    def set_timing(self, timing: Timing) -> None:
        for k, v in asdict(timing).items():
            setattr(self, k, v)

    @property
    def best_us(self) -> float | None:
        """The device time when there is one (graph replay), else the eager time."""
        return self.graph_us if self.graph_us is not None else self.eager_us

    @property
    def bound_us(self) -> float | None:
        """floor + L0: what no call can beat."""
        if self.floor_us is None or self.empty_launch_us is None:
            return None
        return self.floor_us + self.empty_launch_us

    @property
    def vs_bound(self) -> float | None:
        """best_us / (floor + L0): 1.0 is as fast as a call can be."""
        best, bound = self.best_us, self.bound_us
        return best / bound if best is not None and bound else None


COLUMNS = [f.name for f in fields(Row)]
_INT = {"chunk", "bs", "tokens", "launches", "width"}
_FLOAT = {"eager_us", "graph_us", "host_us", "floor_us", "empty_launch_us"}


def write_csv(rows: list[Row], path: Path) -> None:
    """``rows`` as CSV with the header ``COLUMNS`` (``None`` is an empty cell)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        w.writeheader()
        w.writerows(asdict(r) for r in rows)


def read_csv(path: Path) -> list[Row]:
    """The rows ``write_csv`` wrote."""

    def value(k: str, v: str):
        if k in _INT | _FLOAT:
            return None if v == "" else (int(v) if k in _INT else float(v))
        return v

    with path.open(newline="") as f:
        return [Row(**{k: value(k, v) for k, v in d.items()}) for d in csv.DictReader(f)]


def fmt_us(x: float | None) -> str:
    """Microseconds for a table: ``-`` for none, one decimal below 10 000, else 3 digits."""
    if x is None:
        return "-"
    return f"{x:.1f}" if x < 1e4 else f"{x:.3g}"


def fmt_ratio(a: float | None, b: float | None) -> str:
    """``a / b`` as ``1.23x`` (3 digits from 100x), ``-`` when either is missing."""
    if a is None or b is None or b <= 0:
        return "-"
    x = a / b
    return f"{x:.2f}x" if x < 100 else f"{x:.3g}x"


def _cell(row: Row, column: str) -> str:
    v = getattr(row, column)
    if column in _FLOAT or column in ("best_us", "bound_us"):
        return fmt_us(v)
    if column == "vs_bound":
        return "-" if v is None else f"{v:.2f}x"
    return "-" if v is None or v == "" else str(v).replace("|", "/")


def rows_markdown(rows: list[Row], columns: list[str], head: list[str] | None = None) -> list[str]:
    """A markdown table of ``rows``, one line a row: the given columns (any ``Row`` field or
    property), under ``head`` (default: the column names)."""
    lines = ["| " + " | ".join(head or columns) + " |", "|" + "---|" * len(columns)]
    for r in rows:
        lines.append("| " + " | ".join(_cell(r, c) for c in columns) + " |")
    return lines
