"""Plan offsets at large batch sizes: the multi-slice plan settings against their floors.

    python -m benchmarks.plan_sizes --out DIR [--bs 4096 131072 1048576] [--explore]
    python -m benchmarks.plan_sizes --device cpu --bs 300 --out DIR   # logic only

For each ``bs`` (random lengths, a quarter of the requests padding, seeds read from a
``req_to_token`` of 256 columns): the ``lookback``, ``scan`` and (bs <= 32 768) ``recount``
launchers at the slice, tile and warp settings ``auto`` takes and their neighbours
(``--explore``: a grid of them), ``auto``, and at bs <= 4096 the direct fixed-block launch;
each checked byte for byte against the torch reference, then timed
(``kvcanary_dispatch.cli.harness``: CUDA-graph replay, eager, host time per call). The same run
measures the empty launch (L0), the floor of bytes
(``kvcanary_dispatch.cli.timing.plan_floor_bytes`` at the measured copy bandwidth) and the
plan's bytes moved by a kernel with none of its logic (``plan_bytes_stream``: random seed
gathers run far below the copy bandwidth). ``plan_sizes.md`` ends with the two bars' readings:
graphed ``auto`` over (floor + L0) side by side (its replays and the empty launch's timed in
turn, each round's own L0: ``graph_bar``), and eager ``auto`` over one fixed-block launch at
4 096 (``eager_bar``). Writes ``plan_sizes.csv`` (the results schema) and ``plan_sizes.md``.
"""

from __future__ import annotations

import argparse
from functools import partial
from pathlib import Path

import torch

from benchmarks import checked_device, interpreter_off_gpu

interpreter_off_gpu(__name__)  # before any kernel module is imported

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from benchmarks.distributions_report import SIDE_BY_SIDE_ROUNDS, fmt_spread, spread  # noqa: E402
from kvcanary_dispatch import plan_offsets  # noqa: E402
from kvcanary_dispatch.cli.harness import Case, time_case  # noqa: E402
from kvcanary_dispatch.cli.results import Meta, rows_markdown, write_csv  # noqa: E402
from kvcanary_dispatch.cli.timing import (  # noqa: E402
    empty_launch,
    floor_us,
    graph_time_us,
    graph_times_interleaved_us,
    plan_floor_bytes,
)
from kvcanary_dispatch.launch_plan import resolve_plan_chunk  # noqa: E402
from kvcanary_dispatch.plan import _LAUNCHERS  # noqa: E402  (the dispatcher's launcher table)
from kvcanary_dispatch.testing.cases import check_plan, make_plan_case  # noqa: E402
from kvcanary_kernels.args import bundle_plan_args  # noqa: E402
from kvcanary_kernels.plan_lookback import (  # noqa: E402
    lookback_state_words,
    new_lookback_state,
)
from kvcanary_kernels.plan_offsets import PLAN_BATCH_BLOCK, enqueue_plan_offsets  # noqa: E402

DISTRIBUTION = "u256_pad25"  # prefixes U(0, 256), 0-63 new tokens, 25 % padding


def _case(bs: int, device: torch.device):
    g = torch.Generator().manual_seed(bs)
    prefix = torch.randint(0, 257, (bs,), generator=g)
    extend = torch.randint(0, 64, (bs,), generator=g)
    pad = torch.rand(bs, generator=g) < 0.25
    return make_plan_case(
        prefix_lens=prefix,
        extend_seq_lens=extend,
        padding=pad,
        max_seq_len=256,
        verify_capacity=2**31 - 1,
        spare_capacity=0,
        seed=bs,
        device=device,
    )


@triton.jit
def _plan_bytes_kernel(
    pool_ptr, prefix_ptr, extend_ptr, r2t_ptr, stride0, vo_ptr, wo_ptr, seed_ptr, bs,
    SEED: tl.constexpr, CUMSUM: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """The plan's bytes without its logic: each program reads a block of the three [bs] int64
    inputs, writes the lengths (their per-block ``tl.cumsum`` with ``CUMSUM``) where the offsets
    go and, with ``SEED``, gathers the int32 seed from ``req_to_token``."""
    r = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # [B] int64
    m = r < bs
    pool = tl.load(pool_ptr + r, mask=m, other=0)  # [B] int64
    prefix = tl.load(prefix_ptr + r, mask=m, other=0)
    extend = tl.load(extend_ptr + r, mask=m, other=0)
    v = tl.where(pool != 0, prefix, 0)
    w = tl.where(pool != 0, tl.maximum(extend, 0), 0)
    if CUMSUM:
        v = tl.cumsum(v, axis=0)
        w = tl.cumsum(w, axis=0)
    tl.store(vo_ptr + 1 + r, v, mask=m)
    tl.store(wo_ptr + 1 + r, w, mask=m)
    if SEED:
        has = (pool != 0) & (prefix > 0) & (extend > 0)
        slot = tl.load(r2t_ptr + pool * stride0 + prefix - 1, mask=has, other=0).to(tl.int64)
        tl.store(seed_ptr + r, tl.where(has, slot, -1), mask=m)


def plan_bytes_stream(
    *, seed: bool = True, cumsum: bool = False, block: int = 256, warps: int = 4, **kw
) -> None:
    """``_plan_bytes_kernel`` on a plan call's keywords (its outputs get wrong values): the
    time a plan's reads, seed gathers and writes take at the least on the device."""
    i, o = bundle_plan_args(kw)
    _plan_bytes_kernel[(triton.cdiv(i.bs, block),)](
        i.req_pool_indices, i.prefix_lens, i.extend_seq_lens, i.req_to_token,
        i.req_to_token.stride(0), o.out_verify_offsets, o.out_write_offsets,
        o.out_write_seed_slot_indices, i.bs, SEED=seed, CUMSUM=cumsum, BLOCK=block,
        num_warps=warps,
    )  # fmt: skip


def _fixed(**kw) -> None:
    i, o = bundle_plan_args(kw)
    enqueue_plan_offsets(i, o, bs_block=triton.next_power_of_2(i.bs))


def _variant(kind: str, tile: int | None, warps: int, sums_block: int | None = None, res=False):
    """``(name, impl)`` of one launcher setting; ``impl`` takes ``chunk_size``. ``res``: a
    look-back on a state buffer of its own, filled once and re-armed by each launch (as the
    dispatcher's per-stream buffer; the timing harness runs calls one after another),
    rather than a fresh one filled per call."""
    launch = _LAUNCHERS[f"plan_{kind}"]
    extra = {} if sums_block is None else {"sums_block": sums_block}
    name = f"{kind}_w{warps}" + (f"_t{tile}" if tile else "")
    name += f"_s{sums_block}" if sums_block else ""
    name += "_resident" if res else ""
    states: dict[int, torch.Tensor] = {}

    def impl(chunk_size: int, **kw) -> None:
        i, o = bundle_plan_args(kw)
        grid = (triton.cdiv(i.bs, chunk_size),)
        bs_block = min(tile or chunk_size, triton.next_power_of_2(chunk_size))
        if res:
            words = lookback_state_words(grid[0])
            if words not in states:
                states[words] = new_lookback_state(o.out_verify_offsets, words)
            extra["state"] = states[words]
        launch(i, o, grid=grid, chunk=chunk_size, bs_block=bs_block, num_warps=warps, **extra)

    return name, impl


def calls(bs: int, explore: bool = False) -> list[tuple[str, int | None, object]]:
    """(strategy, chunk, impl): the dispatcher's auto, the fixed block, the launchers (with
    ``explore``, a grid of slice sizes, tile sizes, warps and look-back sums blocks)."""
    out: list[tuple[str, int | None, object]] = [("auto", None, plan_offsets)]
    if bs <= 4096:
        out.append(("fixed_block", None, _fixed))
    if not explore:
        # The look-back on a fresh state and on a resident one (as eager auto runs it), at
        # 256-request slices, 1 024 and the slices eager auto takes.
        chunks = sorted({256, 1024, resolve_plan_chunk(None, "auto", bs)})
        settings = [("lookback", 256, 8, None, c) for c in (256, 1024)]
        settings += [("lookback_resident", 256, 8, None, c) for c in chunks]
        settings += [("scan", 256, 8, None, 256), ("scan", 256, 4, None, 1024)]
        if bs <= 32768:  # past it each program's re-read of its predecessors dominates
            settings.append(("recount", 256, 8, None, 256))
    else:
        settings = [
            (kind, tile, warps, sums_block, chunk)
            for kind, blocks in (("scan", (None,)), ("lookback", (256, 1024)))
            for chunk in (256, 512, 1024, 2048, 4096)
            for tile in (256, 1024)
            for warps in (4, 8)
            for sums_block in blocks
            if tile <= chunk and chunk <= max(256, bs // 64)
        ]
    for kind, tile, warps, sums_block, chunk in settings:
        res = kind == "lookback_resident"
        name, impl = _variant("lookback" if res else kind, tile, warps, sums_block, res)
        out.append((name, chunk, impl))
    return out


COLUMNS = ["bs", "strategy", "chunk", "graph_us", "eager_us", "host_us", "floor_us",
           "empty_launch_us", "vs_bound"]  # fmt: skip
HEAD = ["bs", "strategy", "chunk", "graph us", "eager us", "host us", "floor us", "L0 us",
        "graph/(floor+L0)"]  # fmt: skip


def graph_bar(side: dict[int, tuple[list[float], list[float], float]]) -> list[str]:
    """The graphed bar's reading, per bs: ``side[bs]`` is ``auto``'s replays, the empty
    launch's replays timed in the same rounds (µs) and the floor (µs); each round's ratio is
    ``auto / (floor + that round's L0)``; median (least-greatest). Empty when nothing was
    timed side by side (off CUDA)."""
    if not side:
        return []
    head = (
        f"Graphed `auto` over (floor + L0), side by side ({SIDE_BY_SIDE_ROUNDS} rounds of its "
        "replay and the empty launch's, each round's own L0; the bar: <= 1.5x):"
    )
    lines = ["", head, ""]
    for bs, (auto, empty, floor) in side.items():
        ratios = spread(a / (floor + e) for a, e in zip(auto, empty, strict=True))
        lines.append(f"- bs {bs}: {fmt_spread(ratios)}")
    return lines


def eager_bar(rows) -> list[str]:
    """The eager bar's reading, per bs: plan ``auto``'s eager time over one fixed-block
    launch's at ``PLAN_BATCH_BLOCK`` requests, both from this run (one timing each); empty
    when either was not measured."""
    base = next((r.eager_us for r in rows if r.strategy == "fixed_block"
                 and r.bs == PLAN_BATCH_BLOCK and r.eager_us), None)  # fmt: skip
    autos = [r for r in rows if r.strategy == "auto" and r.eager_us]
    if base is None or not autos:
        return []
    head = (f"Eager `auto` over one fixed-block launch at bs = {PLAN_BATCH_BLOCK} "
            f"({base:.1f} µs, same run; the bar: <= 1.2x):")  # fmt: skip
    return ["", head, ""] + [f"- bs {r.bs}: {r.eager_us / base:.2f}x ({r.eager_us:.1f} µs)"
                             for r in autos]  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--bs", type=int, nargs="+", default=[4096, 131072, 1048576])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--explore", action="store_true", help="a grid of slice, tile, warp and sums-block settings"
    )
    args = parser.parse_args(argv)
    device = checked_device(parser, args.device)
    args.out.mkdir(parents=True, exist_ok=True)
    meta = Meta.collect(device)
    print(meta.header(), flush=True)
    rows = []
    streams = []
    side: dict[int, tuple[list[float], list[float], float]] = {}
    for bs in args.bs:
        work = _case(bs, device)
        floor = floor_us(plan_floor_bytes(work), meta.copy_gbs)
        inputs = {**work.inputs(), **work.fresh_outputs()}
        stream = graph_time_us(partial(plan_bytes_stream, **inputs), device)
        if stream is not None:
            streams.append(f"- bs {bs}: {stream:.1f} µs")
            print(streams[-1], flush=True)
        case = Case("plan", DISTRIBUTION, bs, bs, floor, inputs, partial(_check, work))
        quick = {"rep_ms": 50, "host_rounds": 1} if args.explore else {}
        for r in time_case(meta, device, case, calls(bs, args.explore), **quick):
            rows.append(r)
            print(rows_markdown([r], COLUMNS)[2], flush=True)
            if r.strategy == "auto" and r.status == "ok" and floor is not None:
                times = graph_times_interleaved_us(
                    [partial(plan_offsets, **inputs), empty_launch(device)],
                    device,
                    SIDE_BY_SIDE_ROUNDS,
                )
                if times is not None:
                    side[bs] = (*times, floor)
                    print(graph_bar({bs: side[bs]})[-1], flush=True)
    write_csv(rows, args.out / "plan_sizes.csv")
    text = [meta.header(), ""] + rows_markdown(rows, COLUMNS, HEAD)
    if streams:
        text += ["", "The plan's bytes without its logic (`plan_bytes_stream`: inputs read, seeds "
                 "gathered, lengths written; graph replay, same run):", "", *streams]  # fmt: skip
    text += graph_bar(side) + eager_bar(rows)
    (args.out / "plan_sizes.md").write_text("\n".join(text) + "\n")


def _check(work, impl, **kw) -> None:
    check_plan(impl, work, **kw)


if __name__ == "__main__":
    main()
