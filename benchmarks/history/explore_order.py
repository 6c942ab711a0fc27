"""Step 20 of benchmarks/NOTES.md: the ``capped`` scatter's program order, persistent heads,
an earlier first search round and an early tail load, next to head shapes with fewer steps.

Step 19 left the decode-like misses (drafts, decodes with prefill pieces, one giant run,
U(0,128)) at 1.5-2.1x floor + L0. Its timings say the heads are the critical path there (heads
alone cost nearly the whole kernel), and that U(0,128)'s 4 096 head programs of [8, 128]
move their bytes at about half the copy bandwidth. Knobs of ``_capped_o`` below (the library
kernel otherwise):

- ``TAILS_FIRST``: tail programs take the first program ids, heads the rest (tail programs
  otherwise start last, in a second wave when the grid outgrows what the GPU holds at once);
- ``HEADS``: a runtime count of head programs; each walks the groups ``pid, pid + HEADS, ...``
  (fewer, persistent head programs; ``0``: one per group, the library's grid);
- ``PAR1``: a short-class tail tile issues its first search round (the same ``PROBES`` offsets
  for every tile) together with its guessed offsets, and narrows by both;
- ``EARLY``: a tail tile of one step loads its tokens before the search (only the store waits
  for the owner).

Variant names extend ``explore_heads``' (``s4``, ``c16``, ``r16``, ``w4``, ...) with ``tf``
(tails first), ``ph<k>`` (``k`` head programs per SM), ``par1`` and ``early``; a name
``lib:<overrides>`` runs the library's launcher at ``auto``'s shape with ``T<n>`` tail columns
a step, ``k<n>`` tiles a tail program or ``w<n>`` warps (``lib:T512+k2``). ``--width``
sets the pool width (the benchmark's is 8 192 unless a run is longer); ``u2048_8192`` and
``long_256`` are extra batches of long runs.
``python -m benchmarks.history.explore_order [--dists ...] [--variants ...] [--budget-s S]
[--width W]``.
"""

from __future__ import annotations

from functools import partial

import torch
import triton
import triton.language as tl

from benchmarks.distributions import _dist as distributions_dist
from benchmarks.history import explore_capped
from benchmarks.history.explore_capped import drive, time_variants
from benchmarks.history.explore_heads import variant as heads_variant
from kvcanary_dispatch import scatter_req_token_ids
from kvcanary_dispatch.cli.per_request_grid import scatter_per_request_grid
from kvcanary_dispatch.launch_plan import capped_shape
from kvcanary_kernels.args import ScatterArgs
from kvcanary_kernels.scatter_capped import (
    _copy_columns,
    _head,
    capped_grid,
    launch_scatter_capped,
)


@triton.jit
def _tail_o(q, flat_in_ptr, offsets_ptr, req_pool_indices_ptr, pool_out_ptr, num_tokens, bs,
            pool_stride0, max_context_len, CAP: tl.constexpr, TILES: tl.constexpr,
            TAIL: tl.constexpr, TAIL_COLS: tl.constexpr, PROBES: tl.constexpr,
            GUESS: tl.constexpr, GUESS_STRIDE: tl.constexpr, PEEL: tl.constexpr,
            PAR1: tl.constexpr, EARLY: tl.constexpr):  # fmt: skip
    """The library's ``_tail`` with ``PAR1`` and ``EARLY`` (module docstring)."""
    a = CAP + (q * TILES + tl.arange(0, TILES)) * TAIL  # [N] int64
    i = tl.arange(1, PROBES + 1).to(tl.int64)  # [P] int64
    if EARLY:  # [N, TAIL] int64 tokens, loaded before the owner is known
        tcol = tl.arange(0, TAIL)
        tok = a[:, None] + tcol[None, :]
        early_v = tl.load(flat_in_ptr + tok, mask=tok < num_tokens, other=0)
    lo = a * 0
    hi = lo + bs
    idle = lo != 0
    if GUESS > 0:
        k = a * bs // tl.maximum(num_tokens, 1) - (GUESS // 2) * GUESS_STRIDE
        step = tl.arange(0, GUESS) * GUESS_STRIDE
        j = tl.minimum(tl.maximum(k[:, None] + step[None, :], 0), bs)  # [N, G]
        seen = tl.load(offsets_ptr + j)
        if PAR1:  # round one of the search over [0, bs), issued with the guess
            p1 = bs.to(tl.int64) * i // (PROBES + 1)  # [P] int64, in [0, bs)
            le1 = tl.load(offsets_ptr + p1)[None, :] <= a[:, None]  # [N, P]
        inside = (seen > (a + TAIL - 1 - CAP)[:, None]) & (seen <= a[:, None])
        idle = tl.max(inside.to(tl.int32), axis=1) > 0
        below = seen <= a[:, None]
        lo = tl.max(tl.where(below, tl.minimum(j, bs - 1), lo[:, None]), axis=1)
        hi = tl.min(tl.where(below, hi[:, None], j), axis=1)
        if PAR1:
            lo = tl.maximum(lo, tl.max(tl.where(le1, p1[None, :], 0), axis=1))
            hi = tl.minimum(hi, tl.min(tl.where(le1, bs, p1[None, :]), axis=1))
        hi = tl.where(idle, lo, hi)
    while tl.max(hi - lo, axis=0) > 1:
        probe = lo[:, None] + (hi - lo)[:, None] * i[None, :] // (PROBES + 1)
        le = tl.load(offsets_ptr + probe) <= a[:, None]
        lo = tl.max(tl.where(le, probe, lo[:, None]), axis=1)
        hi = tl.min(tl.where(le, hi[:, None], probe), axis=1)
    start = tl.load(offsets_ptr + lo, mask=~idle, other=0)
    end = tl.load(offsets_ptr + lo + 1, mask=~idle, other=0)
    t0 = tl.maximum(a, start + CAP)
    t1 = tl.minimum(tl.minimum(a + TAIL, end), tl.minimum(num_tokens, start + max_context_len))
    busy = (t1 > t0) & ~idle
    row = tl.load(req_pool_indices_ptr + lo, mask=busy, other=0)
    src = flat_in_ptr + a
    dst = pool_out_ptr + row * pool_stride0 + (a - start)
    lo_c = (t0 - a).to(tl.int32)
    hi_c = tl.where(busy, t1 - a, 0).to(tl.int32)
    if EARLY:
        m = (tcol[None, :] >= lo_c[:, None]) & (tcol[None, :] < hi_c[:, None])
        tl.store(dst[:, None] + tcol[None, :], early_v.to(tl.int32), mask=m)
    else:
        _copy_columns(src, dst, lo_c, hi_c, TAIL_COLS, PEEL)


@triton.jit(do_not_specialize=["num_tokens", "bs", "pool_stride0", "max_context_len", "heads"])
def _capped_o(
    flat_in_ptr, offsets_ptr, req_pool_indices_ptr, pool_out_ptr,
    num_tokens, bs, pool_stride0, max_context_len, heads,
    REQS: tl.constexpr, COLS: tl.constexpr, STEPS: tl.constexpr, TILES: tl.constexpr,
    TAIL: tl.constexpr, TAIL_COLS: tl.constexpr, PROBES: tl.constexpr, GUESS: tl.constexpr,
    GUESS_STRIDE: tl.constexpr, PEEL: tl.constexpr, TAILS_FIRST: tl.constexpr,
    PAR1: tl.constexpr, EARLY: tl.constexpr,
):  # fmt: skip
    """``kernels/scatter_capped.py``'s kernel with the knobs of the module docstring;
    ``heads``: head programs (each walks groups ``heads`` apart)."""
    pid = tl.program_id(0).to(tl.int64)
    groups = (bs.to(tl.int64) + REQS - 1) // REQS
    tails = tl.num_programs(0) - heads
    if TAILS_FIRST:
        is_head = pid >= tails
        h = pid - tails
        t = pid
    else:
        is_head = pid < heads
        h = pid
        t = pid - heads
    if is_head:
        for g in range(h, groups, heads):
            _head(g, flat_in_ptr, offsets_ptr, req_pool_indices_ptr, pool_out_ptr, num_tokens,
                  bs, pool_stride0, max_context_len, REQS, COLS, STEPS * COLS, PEEL)  # fmt: skip
    else:
        _tail_o(t, flat_in_ptr, offsets_ptr, req_pool_indices_ptr, pool_out_ptr, num_tokens,
                bs, pool_stride0, max_context_len, STEPS * COLS, TILES, TAIL, TAIL_COLS,
                PROBES, GUESS, GUESS_STRIDE, PEEL, PAR1, EARLY)  # fmt: skip


def variant(bs: int, tokens: int, name: str, sms: int) -> dict:
    """Launch keywords of ``_capped_o`` for one named variant."""
    parts = name.split("+")
    mine = {"tf", "par1", "early"}
    base = "+".join(p for p in parts if p not in mine and not p.startswith("ph")) or "auto"
    p = heads_variant(bs, tokens, base)
    p.update(tails_first=int("tf" in parts), par1=int("par1" in parts))
    p["early"] = int("early" in parts and p["tail_cols"] == p["tail"])
    groups = triton.cdiv(bs, p["reqs"])
    p["heads"] = groups
    for part in parts:
        if part.startswith("ph"):
            p["heads"] = min(groups, int(part[2:]) * sms)
    p["peel"] = int(1 in (p["reqs"], p["cols"]))
    return p


def run_variant(p: dict, flat_in, offsets, req_pool_indices, pool_out, **kw) -> None:
    bs, n, width = req_pool_indices.numel(), flat_in.numel(), pool_out.shape[1]
    (full,) = capped_grid(bs, n, width if p["tails"] else 0, p)
    grid = (full - triton.cdiv(bs, p["reqs"]) + p["heads"],)
    _capped_o[grid](
        flat_in, offsets, req_pool_indices, pool_out, n, bs, pool_out.stride(0), width,
        p["heads"], REQS=p["reqs"], COLS=p["cols"], STEPS=p["steps"], TILES=p["tiles"],
        TAIL=p["tail"], TAIL_COLS=p["tail_cols"], PROBES=p["probes"], GUESS=p["guess"],
        GUESS_STRIDE=p["gstride"], PEEL=p["peel"], TAILS_FIRST=p["tails_first"],
        PAR1=p["par1"], EARLY=p["early"], num_warps=p["num_warps"],
    )  # fmt: skip


VARIANTS = ["auto", "tf", "ph4", "ph8", "tf+ph8", "par1", "early", "par1+early", "s4", "s2",
            "tf+s4", "r16+w4", "heads"]  # fmt: skip


def lib_shape(bs: int, tokens: int, width: int, name: str) -> dict:
    """``auto``'s ``capped`` shape with ``name``'s overrides (``T<n>``: tail columns a step,
    ``k<n>``: tiles a tail program, ``w<n>``: warps; joined by ``+``)."""
    shape = dict(capped_shape(bs, tokens, width))
    keys = {"T": "tail_cols", "k": "tiles", "w": "num_warps"}
    for part in name.split("+"):
        shape[keys[part[0]]] = int(part[1:])
    shape["tail_cols"] = min(shape["tail_cols"], shape["tail"])
    return shape


def run_lib(shape: dict, flat_in, offsets, req_pool_indices, pool_out, **kw) -> None:
    t = ScatterArgs(flat_in, offsets, req_pool_indices, pool_out)
    grid = capped_grid(t.bs, t.num_tokens, pool_out.shape[1], shape)
    launch_scatter_capped(t, grid=grid, **shape)


def explore(names, dev, meta, deadline, variants) -> None:
    sms = torch.cuda.get_device_properties(dev).multi_processor_count

    def build(case) -> dict:
        impls = {"grid": scatter_per_request_grid, "lib auto": scatter_req_token_ids}
        seen = set()
        for v in variants:
            if v.startswith("lib:"):  # the library's launcher at auto's shape, overridden
                shape = lib_shape(case.bs, case.total, case.width, v[4:])
                impls[f"{v} {shape}"] = partial(run_lib, shape)
                continue
            p = variant(case.bs, case.total, v, sms)
            key = tuple(sorted(p.items()))
            if key not in seen:  # skip a variant that changes nothing on this batch
                seen.add(key)
                impls[f"{v} {p}"] = partial(run_variant, p)
        return impls

    time_variants(names, dev, meta, deadline, build, lambda label: "'tails': 0" in label)


EXTRA = {  # batches of long runs past the distribution benchmark's: name -> (lo, hi, bs)
    "u2048_8192": (0, 2048, 8192),
    "long_256": (1024, 16384, 256),
}


def _dist(name: str, quick: bool, g: torch.Generator) -> torch.Tensor:
    if name in EXTRA:
        lo, hi, bs = EXTRA[name]
        return torch.randint(lo, hi + 1, (bs,), generator=g, dtype=torch.int64)
    return distributions_dist(name, quick, g)


def main() -> None:
    explore_capped._dist = _dist  # the extra batches too
    drive(explore, VARIANTS)


if __name__ == "__main__":
    main()
