"""Step 25 of benchmarks/NOTES.md: what a ``capped`` launch's graph replay is made of.

Step 24 found that programs ending sooner did not move the replay. Here the library kernel
is rebuilt from its own source with one helper swapped (``_rejit``: the same code, other
globals), so that each variant differs from the library in one thing:

- ``library``: nothing swapped (it must time as ``auto`` does, and it is checked byte for
  byte against the reference on a poisoned pool);
- ``no stores``: every copy's tokens loaded, no store issued (each store's mask also needs the
  stored int32 token to be -7777, which no token is: the loads stay, as narrow as the
  library's, the stores do not; the pool is checked untouched);
- ``no copy``: each program's chain up to its copy (offsets, rows, the tail search, the
  owner's offsets and row), no token loaded and no store issued (one store masked off by a
  value built from both addresses and the column bounds keeps every program's chain);

against the same grid doing nothing (``explore_timeline``'s ``WORK = 0``) and an empty
kernel's replay (L0), on the batches ``auto`` sends to ``capped``; and first, what a chain of
dependent loads costs a replay (``_chain``: one program, 0 to 8 loads each at the address
the last one read, then a store); and per batch, stores alone (``_row_stores``: 1, 8 or 16
int32 words at the start of each of the batch's pool rows, in its order and sorted). Each
is graph-replay timed twice, alternating, in one run:
``python -m benchmarks.history.explore_drain [--dists ...]``. Step 25's runs 1 and 2 had
earlier forms of two variants: ``no stores`` compared the int64 token (64-bit token loads),
and ``no copy`` masked its store by ``lo + hi`` alone, which a head clamps to ``[0, CAP]``
(the compiler removed the heads' chain).
"""

from __future__ import annotations

import argparse
import types
from functools import partial

import torch
import triton
import triton.language as tl

import kvcanary_kernels.scatter_capped as capped
from benchmarks.distributions import WIDTH, _check_pool, _dist
from benchmarks.history.explore_timeline import N_STAMPS, launch_stamped
from kvcanary_dispatch import scatter_req_token_ids
from kvcanary_dispatch.cli.timing import empty_launch_us, graph_time_us
from kvcanary_dispatch.launch_plan import capped_shape
from kvcanary_dispatch.testing.cases import POISON_I32, make_scatter_case
from kvcanary_kernels import scatter_req_token_ids_ref

NEVER: tl.constexpr = tl.constexpr(-7777)  # no token, offset or row holds it
CHECKED = ("lib auto", "library")  # the rest must leave the pool untouched


@triton.jit
def _copy_step_loads(src, dst, lo, hi, c):
    """``_copy_step`` with its store masked off by the stored (int32) tokens themselves: the
    token loads stay as narrow as the library's (it stores only their low 32 bits)."""
    m = (c[None, :] >= lo[:, None]) & (c[None, :] < hi[:, None])  # [R, C]
    v = tl.load(src[:, None] + c[None, :], mask=m, other=0).to(tl.int32)  # [R, C]
    tl.store(dst[:, None] + c[None, :], v, mask=m & (v == NEVER))


@triton.jit
def _copy_columns_none(src, dst, lo, hi, COLS: tl.constexpr, PEEL: tl.constexpr):
    """No copy: one store at ``dst`` (known once the rows are), masked off by a value that
    depends on both addresses (known once the offsets and rows are) and on ``lo``, ``hi``,
    which the compiler cannot bound (``lo + hi`` alone it can: a head clamps both to
    ``[0, CAP]``, and the chain was then compiled away)."""
    key = src.to(tl.int64) + dst.to(tl.int64) + lo + hi  # [R] int64
    tl.store(dst, key.to(tl.int32), mask=key == NEVER)


@triton.jit
def _chain(buf_ptr, out_ptr, LOADS: tl.constexpr):
    """One program: ``LOADS`` dependent loads (each address the last load's value), then one
    store."""
    i = tl.program_id(0).to(tl.int64)
    for _ in tl.static_range(LOADS):
        i = tl.load(buf_ptr + i)  # int64
    tl.store(out_ptr, i)


def chain_us(dev: torch.device, loads: int, words: int = 1 << 20) -> float:
    """Graph replay of ``_chain`` over ``words`` int64 words, each pointing 4 099 words on."""
    buf = (torch.arange(words, dtype=torch.int64, device=dev) + 4099) % words
    out = torch.zeros(1, dtype=torch.int64, device=dev)
    return graph_time_us(lambda: _chain[(1,)](buf, out, LOADS=loads, num_warps=1), dev)


@triton.jit
def _row_stores(pool_ptr, rows_ptr, bs, stride, BLOCK: tl.constexpr, WORDS: tl.constexpr):
    """Stores alone: ``WORDS`` int32 at the start of each of ``bs`` pool rows (``[BLOCK]``
    rows a program, their indices read once)."""
    r = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # [B] int64
    row = tl.load(rows_ptr + r, mask=r < bs, other=0)  # [B] int64
    c = tl.arange(0, WORDS)  # [W] int32
    m = (r < bs)[:, None] & (c[None, :] >= 0)  # [B, W]
    tl.store(pool_ptr + row[:, None] * stride + c[None, :], (r[:, None] + c).to(tl.int32), mask=m)


def stores_us(rows: torch.Tensor, pool: torch.Tensor, words: int) -> float:
    """Graph replay of ``_row_stores`` (128 rows a program)."""
    bs = rows.numel()
    grid = (triton.cdiv(bs, 128),)
    return graph_time_us(
        lambda: _row_stores[grid](pool, rows, bs, pool.stride(0), BLOCK=128, WORDS=words),
        pool.device,
    )


def _rejit(jit_fn, *, do_not_specialize=(), **replace):
    """``jit_fn`` compiled from its own source with the globals ``replace`` swapped in."""
    f = jit_fn.fn
    scope = {**f.__globals__, **replace}
    g = types.FunctionType(f.__code__, scope, f.__name__, f.__defaults__, f.__closure__)
    g.__module__, g.__qualname__, g.__doc__ = f.__module__, f.__qualname__, f.__doc__
    g.__annotations__ = dict(f.__annotations__)  # Triton 3.6 reads constexprs from them
    return triton.jit(g, do_not_specialize=list(do_not_specialize))


def _kernel(**replace):
    """The library kernel with ``replace`` swapped into its head and tail code."""
    head = _rejit(capped._head, **replace)
    tail = _rejit(capped._tail, **replace)
    dns = ["num_tokens", "bs", "pool_stride0", "max_context_len"]
    return _rejit(capped._scatter_capped_kernel, do_not_specialize=dns, _head=head, _tail=tail)


KERNELS = {
    "library": _kernel(),
    "no stores": _kernel(_copy_columns=_rejit(capped._copy_columns, _copy_step=_copy_step_loads)),
    "no copy": _kernel(_copy_columns=_copy_columns_none),
}


def _launch(kernel, p: dict, flat_in, offsets, req_pool_indices, pool_out) -> None:
    bs, n, width = req_pool_indices.numel(), flat_in.numel(), pool_out.shape[1]
    kernel[capped.capped_grid(bs, n, width, p)](
        flat_in, offsets, req_pool_indices, pool_out, n, bs, pool_out.stride(0), width,
        REQS=p["reqs"], COLS=p["cols"], STEPS=p["steps"], TILES=p["tiles"], TAIL=p["tail"],
        TAIL_COLS=p["tail_cols"], PROBES=p.get("probes", capped.CAPPED_PROBES),
        GUESS=p["guess"], GUESS_STRIDE=p["guess_stride"], PEEL=p["peel"],
        TAILS_FIRST=p["tails_first"], num_warps=p["num_warps"],
    )  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dists", nargs="+", default=["decode_prefill_8192", "spec_16384",
                    "ones_32768", "u128_32768", "giant_4096", "ones_262144"])  # fmt: skip
    args = ap.parse_args()
    dev = torch.device("cuda")
    print(f"empty kernel (L0): {empty_launch_us(dev):.2f} us")
    for _ in range(2):  # twice, alternating
        print(
            "  one program's chain of dependent loads, then a store (graph replay, us): "
            + ", ".join(f"{k} loads {chain_us(dev, k):.2f}" for k in range(0, 9, 2))
        )
    for name in args.dists:
        lens = _dist(name, False, torch.Generator().manual_seed(len(name)))
        width = max(WIDTH, -(-int(lens.max()) // 1024) * 1024)
        case = make_scatter_case(lens, width=width, seed=1, device=dev)
        p = dict(capped_shape(case.bs, case.total, width))
        grid = capped.capped_grid(case.bs, case.total, width, p)[0]
        print(f"== {name} bs={case.bs} tokens={case.total} shape={p} programs={grid}")
        pool, want = case.fresh_pool(), case.fresh_pool()
        scatter_req_token_ids_ref(**case.kwargs(want))
        untouched = torch.full_like(pool, POISON_I32)
        stamps = torch.zeros(grid, N_STAMPS, dtype=torch.int64, device=dev)
        runs = {"lib auto": scatter_req_token_ids}
        runs.update({k: partial(_launch, kern, p) for k, kern in KERNELS.items()})
        runs["grid doing nothing"] = partial(launch_stamped, p, stamps, stamp=0, work=0)
        for label, run in runs.items():  # checked before any timing
            _check_pool(case, pool, want if label in CHECKED else untouched, run)
        for _ in range(2):  # twice, alternating, for the noise
            for label, run in runs.items():
                us = graph_time_us(partial(run, **case.kwargs(pool)), dev)
                print(f"  graph replay {us:6.2f} us  {label}", flush=True)
            rows = case.req_pool_indices
            for order, r in (("its rows", rows), ("its rows sorted", rows.sort().values)):
                print(
                    f"  stores alone, {order}, int32 words a row (graph replay, us): "
                    + ", ".join(f"{w}: {stores_us(r, pool, w):.2f}" for w in (1, 8, 16))
                )


if __name__ == "__main__":
    main()
