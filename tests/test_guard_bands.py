"""Guard bands: every output lives inside a larger buffer filled with poison; after a dispatched
call every byte outside what the contract lets it write is unchanged and every byte inside
equals the reference. Small sizes on the CPU; full sizes (bs up to 131 072, ~40 M tokens, pool
widths 1..8192) with ``HYPOTHESIS_PROFILE=gpu`` on a GPU. Each test prints the poisoned bytes
it checked (``-s`` shows them)."""

from __future__ import annotations

import os

import pytest
import torch
from _helpers import plan_case_32, scatter_with
from conftest import DEVICE

from kvcanary_dispatch import (
    PLAN_MAX_CHUNK,
    PLAN_STRATEGIES,
    SCATTER_MAX_CHUNK,
    SCATTER_STRATEGIES,
    plan_offsets,
)
from kvcanary_dispatch.testing.cases import (
    PLAN_OUT_NAMES,
    POISON_I32,
    POISON_I64,
    make_scatter_case,
    scatter_written_mask,
)
from kvcanary_kernels import plan_offsets_ref, scatter_req_token_ids_ref

FULL = os.environ.get("HYPOTHESIS_PROFILE") == "gpu" and DEVICE == "cuda"
GUARD = 64  # poisoned elements on every side of every output

# (bs, max segment length, pool width); the full set runs on a GPU only.
SCATTER_SIZES = [(0, 4, 1), (1, 9, 1), (37, 12, 5), (300, 6, 128), (700, 40, 16)]
if FULL:
    SCATTER_SIZES += [(4097, 700, 1024), (131_072, 380, 8192), (32_768, 1200, 512)]
CHUNKS = [None, 1, 3, 64, SCATTER_MAX_CHUNK]


def _guarded(shape: tuple[int, ...], fill: int, dtype: torch.dtype) -> tuple[torch.Tensor, tuple]:
    """A poisoned buffer GUARD elements larger on every side, and the index of the inner view."""
    big = torch.full(tuple(n + 2 * GUARD for n in shape), fill, dtype=dtype, device=DEVICE)
    inner = tuple(slice(GUARD, GUARD + n) for n in shape)
    return big, inner


def _lens(bs: int, max_len: int, seed: int) -> torch.Tensor:
    """Lengths up to ``max_len``, a fifth of them empty and one in 50 twenty times longer
    (runs past ``capped``'s cap, for its tail programs)."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(0, max_len + 1, (bs,), generator=g)
    lens = lens * (torch.rand(bs, generator=g) < 0.8)
    return torch.where(torch.rand(bs, generator=g) < 0.02, 20 * max_len, lens)


@pytest.mark.parametrize("strategy", SCATTER_STRATEGIES)
@pytest.mark.parametrize("bs,max_len,width", SCATTER_SIZES)
def test_scatter_guard_bands(strategy, bs, max_len, width):
    case = make_scatter_case(_lens(bs, max_len, bs), width=width, seed=bs, device=DEVICE)
    checked = 0
    for chunk in CHUNKS if strategy not in ("capped", "flat", "segments") else [None]:
        if strategy == "loop" and chunk is not None and bs // chunk > 1024:
            continue  # thousands of launches: covered at smaller bs
        big, inner = _guarded((case.pool_rows, case.width), POISON_I32, torch.int32)
        pool = big[inner]  # a strided view: row stride width + 2 * GUARD
        kw = {} if chunk is None else {"chunk_size": chunk}
        scatter_with(case, pool, strategy=strategy, **kw)
        want_big, _ = _guarded((case.pool_rows, case.width), POISON_I32, torch.int32)
        scatter_with(case, want_big[inner], scatter_req_token_ids_ref)
        allowed = torch.zeros_like(big, dtype=torch.bool)
        allowed[inner] = scatter_written_mask(case)
        assert torch.all(big[~allowed] == POISON_I32), f"{strategy} chunk={chunk}: wrote outside"
        assert torch.equal(big, want_big), f"{strategy} chunk={chunk}: differs from reference"
        checked += big.numel() * big.element_size()
    print(f"guard-bands scatter {strategy} bs={bs} tokens={case.total}: {checked} bytes checked")


PLAN_SIZES = [0, 1, 255, 257, 3000]
if FULL:
    PLAN_SIZES += [4097, 65_536, 131_072]


@pytest.mark.parametrize("strategy", PLAN_STRATEGIES)
@pytest.mark.parametrize("bs", PLAN_SIZES)
def test_plan_guard_bands(strategy, bs):
    case = plan_case_32(bs, bs, verify_capacity=bs * 10, device=DEVICE)
    shapes = {k: v.shape for k, v in case.fresh_outputs().items()}
    dtypes = {k: v.dtype for k, v in case.fresh_outputs().items()}
    checked = 0
    for chunk in (None, 1, 100, PLAN_MAX_CHUNK):
        if chunk == 1 and bs > 1024 and (strategy == "loop" or not FULL):
            continue  # thousands of launches, or of interpreted programs
        got, want = {}, {}
        for name in PLAN_OUT_NAMES:
            fill = POISON_I64 if dtypes[name] == torch.int64 else POISON_I32
            got[name] = _guarded(tuple(shapes[name]), fill, dtypes[name])
            want[name] = _guarded(tuple(shapes[name]), fill, dtypes[name])
        kw = {} if chunk is None else {"chunk_size": chunk}
        plan_offsets(
            **case.inputs(), **{k: b[i] for k, (b, i) in got.items()}, strategy=strategy, **kw
        )
        plan_offsets_ref(**case.inputs(), **{k: b[i] for k, (b, i) in want.items()})
        for name in PLAN_OUT_NAMES:
            g_big, w_big = got[name][0], want[name][0]
            allowed = torch.zeros_like(g_big, dtype=torch.bool)
            n = bs + 1 if name.endswith("offsets") else bs if "seed" in name else 1
            allowed[GUARD : GUARD + n] = True
            fill = POISON_I64 if dtypes[name] == torch.int64 else POISON_I32
            assert torch.all(g_big[~allowed] == fill), f"{name}: written outside [0, {n})"
            assert torch.equal(g_big, w_big), f"{strategy} chunk={chunk}: {name} differs"
            checked += g_big.numel() * g_big.element_size()
    print(f"guard-bands plan {strategy} bs={bs}: {checked} bytes checked")
