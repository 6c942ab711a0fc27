"""Step 18: why the look-back plan is slower on the device than ``scan`` past 100 000 requests.

    python -m benchmarks.history.explore_chained OUT 131072,262144,524288,1048576

Candidates, each checked byte for byte then timed (graph replay, eager, host), against ``scan``
and the look-back (step 17's decoupled look-back when these runs were made; the step-18 kernel,
which is the candidate below, since), all on state buffers filled once (re-armed by each
launch):

- ``chained``: one launch; each program publishes its slice's two sums and then adds up every
  predecessor's published sums, ``SUMS_BLOCK`` slices a step, spinning on a block until all of
  it is published (no inclusive prefixes: no chain of look-backs, ``scan``'s second launch with
  a spin). Programs take slices by start ticket. The last program done re-arms the state.

And, timing only (wrong outputs, graph replay): each kernel cut after its bases are known
(``PLAN=False``), to split chain time from planning time.
"""

import sys
from functools import partial
from pathlib import Path

import torch
import triton
import triton.language as tl

from benchmarks import plan_sizes as ps
from kvcanary_dispatch import plan_offsets
from kvcanary_dispatch.cli.harness import Case, time_case
from kvcanary_dispatch.cli.results import Meta, rows_markdown, write_csv
from kvcanary_dispatch.cli.timing import floor_us, graph_time_us, plan_floor_bytes
from kvcanary_kernels.args import bundle_plan_args, plan_kernel_scalars
from kvcanary_kernels.plan_lookback import (
    UNSET,
    _publish,
    launch_plan_lookback,
    lookback_state_words,
)
from kvcanary_kernels.plan_scan import _plan_slice_sums_kernel
from kvcanary_kernels.plan_slices import _plan_numbered_slice, _plan_slice_sums

_UNSET_C: tl.constexpr = tl.constexpr(UNSET)


@triton.jit
def _chained_kernel(
    req_pool_indices_ptr, prefix_lens_ptr, extend_seq_lens_ptr, req_to_token_ptr, lut_ptr,
    verify_offsets_ptr, write_offsets_ptr, seed_ptr, verify_num_valid_ptr, verify_enable_ptr,
    write_num_valid_reqs_ptr, req_to_token_stride0, lut_len, state_ptr, bs, chunk,
    swa_window_size, verify_capacity,
    HAS_LUT: tl.constexpr, BS_BLOCK: tl.constexpr, SUMS_BLOCK: tl.constexpr,
    RESET_BLOCK: tl.constexpr, PLAN: tl.constexpr, TICKET: tl.constexpr,
    DONE: tl.constexpr = True, SPIN: tl.constexpr = True, SPLIT: tl.constexpr = False,
    CG: tl.constexpr = False,
):  # fmt: skip
    n_slices = tl.num_programs(0)
    if TICKET == 1:
        k = (tl.atomic_add(state_ptr, 1) - _UNSET_C).to(tl.int64)
    elif TICKET == 2:
        k = (tl.atomic_add(state_ptr, 1, sem="relaxed") - _UNSET_C).to(tl.int64)
    else:
        k = tl.program_id(0).to(tl.int64)
    sums = state_ptr + 2  # [n_slices, 2] int64: (verify, write) per slice
    verify_sum, write_sum = _plan_slice_sums(
        k, chunk, bs, req_pool_indices_ptr, prefix_lens_ptr, extend_seq_lens_ptr,
        swa_window_size, BS_BLOCK,
    )  # fmt: skip
    if SPLIT:  # verify sums at [0, n), write sums at [n, 2n)
        v_at = sums
        w_at = sums + n_slices
        step = 1
    else:  # (verify, write) per slice
        v_at = sums
        w_at = sums + 1
        step = 2
    _publish(v_at + step * k, verify_sum)
    _publish(w_at + step * k, write_sum)
    verify_acc = tl.zeros([SUMS_BLOCK], dtype=tl.int64)  # [S] int64
    write_acc = tl.zeros([SUMS_BLOCK], dtype=tl.int64)
    for j0 in range(0, k, SUMS_BLOCK):
        j = j0 + tl.arange(0, SUMS_BLOCK)  # [S] int64
        before = j < k
        if CG:  # L2, may be vectorised; the spin below reads volatile
            v = tl.load(v_at + step * j, mask=before, other=0, cache_modifier=".cg")  # [S] int64
            w = tl.load(w_at + step * j, mask=before, other=0, cache_modifier=".cg")
        else:
            v = tl.load(v_at + step * j, mask=before, other=0, volatile=True)  # [S] int64
            w = tl.load(w_at + step * j, mask=before, other=0, volatile=True)
        waiting = tl.max(((v == _UNSET_C) | (w == _UNSET_C)).to(tl.int32), axis=0)
        if SPIN:
            while waiting != 0:
                v = tl.load(v_at + step * j, mask=before, other=0, volatile=True)
                w = tl.load(w_at + step * j, mask=before, other=0, volatile=True)
                waiting = tl.max(((v == _UNSET_C) | (w == _UNSET_C)).to(tl.int32), axis=0)
        verify_acc += v
        write_acc += w
    verify_base = tl.sum(verify_acc, axis=0)
    write_base = tl.sum(write_acc, axis=0)
    if DONE and tl.atomic_add(state_ptr + 1, 1) - _UNSET_C == n_slices - 1:
        used = 2 + 2 * n_slices.to(tl.int64)
        for w0 in range(0, used, RESET_BLOCK):
            r = w0 + tl.arange(0, RESET_BLOCK)
            tl.store(state_ptr + r, tl.full([RESET_BLOCK], _UNSET_C, tl.int64), mask=r < used)
    if PLAN:
        _plan_numbered_slice(
            k, n_slices, chunk, req_pool_indices_ptr, prefix_lens_ptr, extend_seq_lens_ptr,
            req_to_token_ptr, req_to_token_stride0, lut_ptr, lut_len, verify_offsets_ptr,
            write_offsets_ptr, seed_ptr, verify_num_valid_ptr, verify_enable_ptr,
            write_num_valid_reqs_ptr, bs, swa_window_size, verify_capacity, verify_base,
            write_base, HAS_LUT, BS_BLOCK,
        )  # fmt: skip
    else:  # keep the bases live
        tl.store(verify_num_valid_ptr, (verify_base + write_base).to(tl.int32), mask=k == 0)


_STATES: dict[tuple[str, int], torch.Tensor] = {}


def _state(name: str, like: torch.Tensor, words: int) -> torch.Tensor:
    key = (name, words)
    if key not in _STATES:
        _STATES[key] = like.new_full((words,), UNSET, dtype=torch.int64)
    return _STATES[key]


def chained(tile, warps, sums_block, plan=True, ticket=1, done=True, spin=True, split=False,
            cg=False):  # fmt: skip
    name = f"chained_w{warps}_t{tile}_s{sums_block}" + ("" if ticket else "_pid")
    name += f"_t{ticket}d{int(done)}s{int(spin)}" + ("_split" if split else "")
    name += "_cg" if cg else ""

    def impl(chunk_size, **kw):
        i, o = bundle_plan_args(kw)
        n = triton.cdiv(i.bs, chunk_size)
        state = _state(name + str(plan), o.out_verify_offsets, 2 + 2 * n)
        if not done:  # no re-arm: a fresh state per call
            state.fill_(UNSET)
        _chained_kernel[(n,)](
            i.req_pool_indices, i.prefix_lens, i.extend_seq_lens, i.req_to_token,
            i.full_to_swa_index_mapping if i.full_to_swa_index_mapping is not None
            else o.out_verify_offsets,
            o.out_verify_offsets, o.out_write_offsets, o.out_write_seed_slot_indices,
            o.out_verify_num_valid, o.out_verify_enable, o.out_write_num_valid_reqs,
            *plan_kernel_scalars(i), state, i.bs, chunk_size, int(i.swa_window_size),
            int(i.verify_capacity), HAS_LUT=i.full_to_swa_index_mapping is not None,
            BS_BLOCK=min(tile, triton.next_power_of_2(chunk_size)), SUMS_BLOCK=sums_block,
            RESET_BLOCK=1024, PLAN=plan, TICKET=ticket, DONE=done, SPIN=spin, SPLIT=split, CG=cg,
            num_warps=warps,
        )  # fmt: skip

    return name, impl


def lookback(tile, warps, sums_block):
    """The dispatcher's look-back launcher on a state of its own. Runs 1-3 ran step 17's kernel
    here (``window=`` predecessor slices a step, rows named ``_lb``); from step 18 that
    launcher is the chained scan, taking ``sums_block=``."""
    name = f"lookback_w{warps}_t{tile}_s{sums_block}_resident"

    def impl(chunk_size, **kw):
        i, o = bundle_plan_args(kw)
        n = triton.cdiv(i.bs, chunk_size)
        state = _state(name, o.out_verify_offsets, lookback_state_words(n))
        block = min(tile, triton.next_power_of_2(chunk_size))
        launch_plan_lookback(
            i, o, grid=(n,), chunk=chunk_size, bs_block=block, num_warps=warps,
            sums_block=sums_block, state=state,
        )  # fmt: skip

    return name, impl


def sums_only(tile, warps):
    def impl(chunk_size, **kw):
        i, o = bundle_plan_args(kw)
        n = triton.cdiv(i.bs, chunk_size)
        sums = o.out_verify_offsets.new_empty((n, 2))
        _plan_slice_sums_kernel[(n,)](
            i.req_pool_indices, i.prefix_lens, i.extend_seq_lens, sums, i.bs, chunk_size,
            int(i.swa_window_size), BS_BLOCK=min(tile, triton.next_power_of_2(chunk_size)),
            num_warps=warps,
        )  # fmt: skip

    return impl


def fill_only(chunk_size, **kw):
    i, o = bundle_plan_args(kw)
    n = triton.cdiv(i.bs, chunk_size)
    _state("fill", o.out_verify_offsets, 2 + 2 * n).fill_(UNSET)


ATTRIBUTION = [  # (label, ticket, done, spin): the chain cut after the bases, timing only
    ("pid, fresh state, no spin (reads only)", 0, False, False),
    ("pid, fresh state, spin", 0, False, True),
    ("ticket acq_rel, fresh state, spin", 1, False, True),
    ("ticket relaxed, fresh state, spin", 2, False, True),
    ("pid, done counter, spin", 0, True, True),
    ("ticket acq_rel, done counter, spin", 1, True, True),
    ("ticket relaxed, done counter, spin", 2, True, True),
]


def attribution(out: Path, sizes: list[int], chunks: list[int]) -> None:
    device = torch.device("cuda")
    lines = []
    for bs in sizes:
        work = ps._case(bs, device)
        inputs = {**work.inputs(), **work.fresh_outputs()}
        for c in chunks:
            n = triton.cdiv(bs, c)
            t = graph_time_us(partial(sums_only(256, 4), c, **inputs), device)
            lines.append(f"| {bs} | {c} | {n} | sums kernel alone | {t:.1f} |")
            t = graph_time_us(partial(fill_only, c, **inputs), device)
            lines.append(f"| {bs} | {c} | {n} | state fill alone | {t:.1f} |")
            for label, ticket, done, spin in ATTRIBUTION:
                _, impl = chained(256, 4, 1024, plan=False, ticket=ticket, done=done, spin=spin)
                t = graph_time_us(partial(impl, c, **inputs), device)
                lines.append(f"| {bs} | {c} | {n} | {label} | {t:.1f} |")
            for label, ticket, done in (("plan, ticket relaxed, done", 2, True),
                                        ("plan, pid, fresh state", 0, False)):  # fmt: skip
                _, impl = chained(256, 4, 1024, ticket=ticket, done=done)
                t = graph_time_us(partial(impl, c, **inputs), device)
                lines.append(f"| {bs} | {c} | {n} | {label} | {t:.1f} |")
            print("\n".join(lines[-11:]), flush=True)
    head = ["| bs | chunk | programs | variant | graph us |", "|---|---|---|---|---|"]
    (out / "attribution.md").write_text("\n".join(head + lines) + "\n")


REFINE = [  # (bs, chunks)
    (131072, (256, 512)),
    (262144, (256, 1024)),
    (524288, (1024,)),
    (1048576, (1024, 2048)),
]


def refine(out: Path) -> None:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    meta = Meta.collect(device)
    print(meta.header(), flush=True)
    rows = []
    for bs, chunks in REFINE:
        if device.type != "cuda":
            bs, chunks = 600, (256,)
        work = ps._case(bs, device)
        floor = floor_us(plan_floor_bytes(work), meta.copy_gbs)
        inputs = {**work.inputs(), **work.fresh_outputs()}
        calls = [("auto", None, plan_offsets)]
        for c in chunks:
            calls.append(("scan_w8_t256", c, ps._variant("scan", 256, 8)[1]))
            calls.append(("scan_w4_t256", c, ps._variant("scan", 256, 4)[1]))
            calls.append((*lookback(256, 8, 256)[:1], c, lookback(256, 8, 256)[1]))
            for warps, sb, split, cg in (
                (8, 256, False, False), (8, 256, True, False), (8, 256, True, True),
                (8, 512, True, True), (8, 1024, True, True), (4, 1024, True, True),
                (4, 256, True, True),
            ):  # fmt: skip
                name, impl = chained(256, warps, sb, ticket=2, split=split, cg=cg)
                calls.append((name, c, impl))
        case = Case("plan", ps.DISTRIBUTION, bs, bs, floor, inputs, partial(ps._check, work))
        for r in time_case(meta, device, case, calls, rep_ms=50, host_rounds=1):
            rows.append(r)
            print(rows_markdown([r], ps.COLUMNS)[2], flush=True)
        if device.type != "cuda":
            break
    write_csv(rows, out / "refine.csv")
    text = [meta.header(), ""] + rows_markdown(rows, ps.COLUMNS, ps.HEAD)
    (out / "refine.md").write_text("\n".join(text) + "\n")


def main():
    out = Path(sys.argv[1])
    if sys.argv[2] == "refine":
        out.mkdir(parents=True, exist_ok=True)
        refine(out)
        return
    if len(sys.argv) > 3 and sys.argv[3] == "attrib":
        out.mkdir(parents=True, exist_ok=True)
        attribution(out, [int(x) for x in sys.argv[2].split(",")], [256, 1024])
        return
    out.mkdir(parents=True, exist_ok=True)
    sizes = [int(x) for x in sys.argv[2].split(",")]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    meta = Meta.collect(device)
    print(meta.header(), flush=True)
    rows, cut = [], []
    for bs in sizes:
        work = ps._case(bs, device)
        floor = floor_us(plan_floor_bytes(work), meta.copy_gbs)
        inputs = {**work.inputs(), **work.fresh_outputs()}
        calls = [("auto", None, plan_offsets)]
        chunks = (256, 1024) if bs >= 262144 else (256,)
        for c in chunks:
            calls.append(("scan_w8_t256", c, ps._variant("scan", 256, 8)[1]))
            calls.append(("scan_w4_t256", c, ps._variant("scan", 256, 4)[1]))
            for warps in (4, 8):
                name, impl = lookback(256, warps, 256)
                calls.append((name, c, impl))
            for warps in (4, 8):
                for sb in (256, 1024):
                    name, impl = chained(256, warps, sb)
                    calls.append((name, c, impl))
            name, impl = chained(256, 4, 1024, ticket=0)
            calls.append((name, c, impl))
        case = Case("plan", ps.DISTRIBUTION, bs, bs, floor, inputs, partial(ps._check, work))
        for r in time_case(meta, device, case, calls, rep_ms=50, host_rounds=1):
            rows.append(r)
            print(rows_markdown([r], ps.COLUMNS)[2], flush=True)
        if device.type == "cuda":
            for c in chunks:
                for warps in (4, 8):
                    t = graph_time_us(partial(sums_only(256, warps), c, **inputs), device)
                    cut.append(f"- bs {bs} chunk {c}: sums kernel alone w{warps} {t:.1f} µs")
                    print(cut[-1], flush=True)
                    _, impl = chained(256, warps, 1024, plan=False)
                    t = graph_time_us(partial(impl, c, **inputs), device)
                    cut.append(f"- bs {bs} chunk {c}: chained w{warps} s1024 cut {t:.1f} µs")
                    print(cut[-1], flush=True)
    write_csv(rows, out / "explore_chained.csv")
    text = [meta.header(), ""] + rows_markdown(rows, ps.COLUMNS, ps.HEAD) + ["", *cut]
    (out / "explore_chained.md").write_text("\n".join(text) + "\n")


if __name__ == "__main__":
    main()
