"""Kernel launches as the dispatcher makes them: ``record_launches`` records every launcher call
(``Launch``), and the checks here hold each launch to its block and, for the sliced paths, to
the slice of the batch it must see."""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from kvcanary_kernels import PLAN_BATCH_BLOCK, SCATTER_BATCH_BLOCK

from .. import plan as _plan
from .. import scatter as _scatter
from .cases import PlanCase, ScatterCase

# A "flat" program holds no block of requests: it searches the offsets in memory, and what it
# holds is one tile of TOKEN_BLOCK tokens (so at most that many non-empty owners), whatever bs
# is. Its invariant is the tile bound: every flat launch stays within this many tokens.
FLAT_TOKEN_BLOCK_LIMIT = 1024

# (module, attribute, kind) of every launcher the dispatcher calls.
_LAUNCHERS = (
    (_scatter, "launch_scatter_req_token_ids_kernel", "scatter_fixed"),
    (_scatter, "launch_scatter_sliced", "scatter_sliced"),
    (_scatter, "launch_scatter_flat", "scatter_flat"),
    (_scatter, "launch_scatter_segments", "scatter_segments"),
    (_plan, "launch_plan_offsets_kernel", "plan_fixed"),
    (_plan, "enqueue_plan_offsets", "plan_fixed"),
    (_plan, "launch_plan_scan", "plan_scan"),
    (_plan, "launch_plan_lookback", "plan_lookback"),
)


@dataclass
class Launch:
    """One launcher call as the dispatcher made it: ``args`` are all its arguments, defaults
    filled in."""

    kind: str
    args: dict = field(repr=False)

    @property
    def bs(self) -> int:
        return int(self.args["req_pool_indices"].shape[0])

    @property
    def block(self) -> int:
        for name in ("batch_block", "bs_block", "token_block", "reqs"):
            if name in self.args:
                return int(self.args[name])
        raise KeyError(f"{self.kind} launch has no block argument")

    def __repr__(self) -> str:
        chunk = f", chunk={self.args['chunk']}" if "chunk" in self.args else ""
        return f"Launch({self.kind}, bs={self.bs}, block={self.block}{chunk})"


@contextlib.contextmanager
def record_launches() -> Iterator[list[Launch]]:
    """Patch the launcher attributes of ``kvcanary_dispatch.scatter`` and ``.plan`` to record
    every call (then run it); restore them on exit. Yields the list of launches."""
    launches: list[Launch] = []
    saved = []

    def spy(fn: Callable, kind: str) -> Callable:
        sig = inspect.signature(fn)

        def wrapper(*args, **kwargs):
            bound = sig.bind(*args, **kwargs)
            bound.apply_defaults()
            launches.append(Launch(kind, dict(bound.arguments)))
            return fn(*args, **kwargs)

        return wrapper

    try:
        for module, name, kind in _LAUNCHERS:
            fn = getattr(module, name)
            saved.append((module, name, fn))
            setattr(module, name, spy(fn, kind))
        yield launches
    finally:
        for module, name, fn in reversed(saved):
            setattr(module, name, fn)


def _is_pow2(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def check_launch_blocks(launches: list[Launch]) -> None:
    """Every launch within its block (at most 511 scatter or 4096 plan requests); blocks are
    powers of two."""
    for launch in launches:
        kind, bs, block = launch.kind, launch.bs, launch.block
        chunk = launch.args.get("chunk")
        assert _is_pow2(block), f"{launch}: block is not a power of two"
        if kind == "scatter_fixed":
            ok = bs + 1 <= block <= SCATTER_BATCH_BLOCK
        elif kind == "scatter_sliced":
            ok = chunk is not None and 1 <= chunk and chunk + 1 <= block <= SCATTER_BATCH_BLOCK
        elif kind == "scatter_flat":
            ok = block <= FLAT_TOKEN_BLOCK_LIMIT
        elif kind == "scatter_segments":  # block: requests a program owns
            ok = block + 1 <= SCATTER_BATCH_BLOCK
        elif kind == "plan_fixed":
            ok = bs <= block <= PLAN_BATCH_BLOCK
        else:
            ok = chunk is not None and 1 <= chunk <= block <= PLAN_BATCH_BLOCK
        assert ok, f"{launch} exceeds its block"


def check_scatter_slices_seen(case: ScatterCase, launches: list[Launch]) -> None:
    """Fixed-block scatter launches cover the batch in order, each with rebased offsets and its
    own slice of ``flat_in``."""
    fixed = [la for la in launches if la.kind == "scatter_fixed"]
    if not fixed:
        return
    offsets = case.offsets.cpu()
    s = a = 0
    for k, la in enumerate(fixed):
        n = la.bs
        b = a + int(la.args["flat_in"].shape[0])
        got = la.args["offsets"].cpu()
        assert int(got[0]) == 0, f"slice {k}: offsets not rebased (start {int(got[0])})"
        assert torch.equal(got + a, offsets[s : s + n + 1]), f"slice {k}: offsets wrong"
        assert b == int(offsets[s + n]), f"slice {k}: flat_in slice ends at {b}"
        assert torch.equal(la.args["flat_in"], case.flat_in[a:b]), f"slice {k}: flat_in"
        assert torch.equal(la.args["req_pool_indices"], case.req_pool_indices[s : s + n]), (
            f"slice {k}: req_pool_indices"
        )
        s, a = s + n, b
    assert (s, a) == (case.bs, case.total), f"slices cover {s} requests, {a} tokens"


def check_plan_slices_seen(case: PlanCase, launches: list[Launch]) -> None:
    """Carried fixed-block plan launches cover the batch in order."""
    fixed = [la for la in launches if la.kind == "plan_fixed" and la.args.get("carry") is not None]
    s = 0
    for k, la in enumerate(fixed):
        n = la.bs
        for name in ("req_pool_indices", "prefix_lens", "extend_seq_lens"):
            want = getattr(case, name)[s : s + n]
            assert torch.equal(la.args[name], want), f"slice {k}: {name}"
        s += n
    assert not fixed or s == case.bs, f"carried slices cover {s} of {case.bs} requests"
