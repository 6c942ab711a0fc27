"""How a dispatched call is split: slices, launches, grids and host syncs, from host arithmetic.

``explain_scatter`` and ``explain_plan`` mirror the decisions of ``scatter_req_token_ids`` and
``plan_offsets`` (strategy resolution, slice bounds, register blocks) and the launchers' grid
rules, without tensors or a GPU. ``format_split`` renders one as text for
``kvcanary-dispatch explain``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvcanary_kernels import SCATTER_TOKEN_BLOCK
from kvcanary_kernels.scatter_sliced import MAX_GRID_Y, SLICED_TOKEN_ELEMS

from ..plan import AUTO_PLAN_CHUNK, PLAN_MAX_CHUNK, resolve_plan_chunk, resolve_plan_strategy
from ..scatter import (
    SCATTER_MAX_CHUNK,
    SEGMENTS_MAX_MEAN,
    SEGMENTS_MIN_BS,
    SEGMENTS_MIN_MEAN,
    flat_token_block,
    resolve_scatter_strategy,
    segments_shape,
)
from ..slicing import block_for, resolve_chunk_size, slice_bounds

_HOST_COPY_SYNC = (
    "none: the CPU offsets are copied on the host into private pinned staging during the call, "
    "then uploaded asynchronously (no wait on queued work); refused during CUDA-graph capture"
)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class Launch:
    """One device operation of a call: a Triton kernel, or a torch op (``kernel`` says which).
    ``grid`` is ``None`` when it depends on data the caller did not give (the token count)."""

    kernel: str
    grid: tuple[int, ...] | None
    block: str = ""
    slice_index: int | None = None


@dataclass
class Split:
    """The whole description of one call."""

    op: str
    strategy: str  # as requested
    resolved: str  # what ``strategy`` resolves to for this call
    bs: int
    tokens: int | None
    chunk: int | None  # requests per slice, None when the strategy has no slices
    slices: list[tuple[int, int]]
    token_ranges: list[tuple[int, int]] | None
    launches: list[Launch]
    host_syncs: list[str]
    notes: list[str] = field(default_factory=list)

    @property
    def triton_launches(self) -> list[Launch]:
        return [la for la in self.launches if not la.kernel.startswith("torch")]


def uniform_offsets(bs: int, tokens: int, at: list[int]) -> list[int]:
    """CSR offsets at request indices ``at`` when ``tokens`` are spread as evenly as possible
    over ``bs`` requests (request ``r`` starts at ``floor(r * tokens / bs)``)."""
    return [(r * tokens) // bs if bs else 0 for r in at]


def explain_scatter(
    bs: int,
    tokens: int | None = None,
    chunk_size: int | None = None,
    strategy: str = "auto",
    offsets_on: str = "device",
) -> Split:
    """Describe ``scatter_req_token_ids`` on ``bs`` requests and ``tokens`` flat tokens (lengths
    assumed uniform; ``None`` = unknown). ``offsets_on``: ``"device"`` or ``"host"`` (a CPU
    offsets tensor with the rest on a GPU). Raises the dispatcher's own errors for a bad
    ``chunk_size`` or ``strategy``."""
    if bs < 0 or (tokens is not None and tokens < 0):
        raise ValueError("bs and tokens must be non-negative")
    chunk = resolve_chunk_size(chunk_size, SCATTER_MAX_CHUNK, "scatter_req_token_ids")
    notes = []
    if strategy == "auto" and chunk_size is None and tokens is None:
        resolved = "flat or segments"
        notes.append(
            f"auto runs 'segments' when bs >= {SEGMENTS_MIN_BS} and {SEGMENTS_MIN_MEAN} * bs <= "
            f"tokens <= {SEGMENTS_MAX_MEAN} * bs, else 'flat': pass --tokens to know which"
        )
    else:
        resolved = resolve_scatter_strategy(strategy, bs, tokens or 0, chunk_size)
    if strategy == "auto" and tokens is not None:
        why = "no chunk_size" if chunk_size is None else "an explicit chunk_size"
        notes.append(f"auto with {why} runs {resolved!r}")
    if tokens is not None and bs:
        notes.append(
            f"token ranges assume uniform lengths ({tokens} tokens over {bs} requests, "
            f"~{tokens / bs:.4g} a request); real batches differ"
        )
    if bs == 0 or tokens == 0:
        why = "bs == 0" if bs == 0 else "no tokens"
        return Split(
            "scatter", strategy, resolved, bs, tokens, None, [], None, [],
            [_HOST_COPY_SYNC if offsets_on == "host" else "none"],
            notes + [f"{why}: the call returns after its checks, no kernel launch"],
        )  # fmt: skip

    if resolved == "flat":
        launches, syncs, slices, chunk_out = _scatter_flat(bs, tokens, notes), ["none"], [], None
    elif resolved == "segments":
        launches, syncs, slices, chunk_out = _scatter_segments(bs, tokens), ["none"], [], None
    elif resolved == "flat or segments":
        launches = [Launch("_scatter_flat_kernel or _scatter_segments_kernel", None)]
        syncs, slices, chunk_out = ["none"], [], None
    else:
        slices, chunk_out = slice_bounds(bs, chunk), chunk
        if chunk_size is None:
            notes.append(f"chunk_size=None: the largest slice, {SCATTER_MAX_CHUNK} requests")
        if resolved == "sliced":
            launches, syncs = _scatter_sliced(bs, tokens, chunk, len(slices), notes), ["none"]
        else:
            launches, syncs = _scatter_loop(bs, tokens, chunk, slices, offsets_on, notes)
    if offsets_on == "host":
        syncs = [_HOST_COPY_SYNC]
        upload = "torch: stage the CPU offsets in pinned memory, upload them asynchronously"
        launches = [Launch(upload, None), *launches]
    if resolved in ("flat", "segments") and chunk_size is not None:
        notes.append(f"chunk_size does not apply to {resolved} (it has no request slices)")
    token_ranges = None
    if tokens is not None and slices:
        at = uniform_offsets(bs, tokens, [s for s, _ in slices] + [bs])
        token_ranges = list(zip(at[:-1], at[1:], strict=True))
    return Split(
        "scatter", strategy, resolved, bs, tokens, chunk_out, slices, token_ranges, launches,
        syncs, notes,
    )  # fmt: skip


def _scatter_flat(bs: int, tokens: int | None, notes: list[str]) -> list[Launch]:
    if tokens is None:
        notes.append(
            "flat's tile is 128 tokens when tokens < 8 * bs, else 1024: pass --tokens for the grid"
        )
        return [Launch("_scatter_flat_kernel", None, "TOKEN_BLOCK=128 or 1024")]
    tb = flat_token_block(bs, tokens)
    return [Launch("_scatter_flat_kernel", (_cdiv(tokens, tb),), f"TOKEN_BLOCK={tb}")]


def _scatter_segments(bs: int, tokens: int | None) -> list[Launch]:
    if tokens is None:
        return [Launch("_scatter_segments_kernel", None, "REQS x COLS from the mean length")]
    reqs, cols = segments_shape(bs, tokens)
    return [Launch("_scatter_segments_kernel", (_cdiv(bs, reqs),), f"REQS={reqs}, COLS={cols}")]


def _scatter_sliced(
    bs: int, tokens: int | None, chunk: int, n_slices: int, notes: list[str]
) -> list[Launch]:
    batch_block = block_for(chunk + 1)
    token_block = max(16, SLICED_TOKEN_ELEMS // batch_block)
    block = f"BATCH_BLOCK={batch_block}, TOKEN_BLOCK={token_block}"
    if tokens is None:
        notes.append(
            f"sliced's second grid axis is min(cdiv(tokens, {n_slices} * {token_block}), "
            f"{MAX_GRID_Y}): pass --tokens for it"
        )
        return [Launch("_scatter_sliced_kernel", None, block)]
    tiles = max(1, min(_cdiv(tokens, n_slices * token_block), MAX_GRID_Y))
    return [Launch("_scatter_sliced_kernel", (n_slices, tiles), block)]


def _scatter_loop(
    bs: int,
    tokens: int | None,
    chunk: int,
    slices: list[tuple[int, int]],
    offsets_on: str,
    notes: list[str],
) -> tuple[list[Launch], list[str]]:
    n = len(slices)
    block = f"BATCH_BLOCK={block_for(chunk + 1)}"
    if offsets_on == "host":
        syncs = []  # the offsets' copy to the device, added by the caller
    else:
        syncs = [
            f"one device-to-host copy of the {n + 1} slice-boundary offsets, before the first "
            "launch"
        ]
    at = uniform_offsets(bs, tokens, [s for s, _ in slices] + [bs]) if tokens else None
    launches = []
    if offsets_on != "host":
        launches.append(
            Launch("torch: gather the slice-boundary offsets, copy them to the host", None)
        )
    for k in range(n):
        launches.append(Launch("torch: rebase offsets (offsets[s:e+1] - offsets[s])", None, "", k))
        grid = None
        if at is not None:
            slice_tokens = at[k + 1] - at[k]
            if slice_tokens == 0:
                continue  # the launcher returns without launching
            grid = (_cdiv(slice_tokens, SCATTER_TOKEN_BLOCK),)
        launches.append(Launch("_scatter_req_token_ids_kernel", grid, block, k))
    if at is None:
        notes.append(
            f"each loop launch's grid is (cdiv(slice tokens, {SCATTER_TOKEN_BLOCK}),), and a "
            "slice with no tokens launches nothing: pass --tokens for the grids"
        )
    return launches, syncs


def explain_plan(bs: int, chunk_size: int | None = None, strategy: str = "auto") -> Split:
    """Describe ``plan_offsets`` on ``bs`` requests. Raises the dispatcher's own errors for a
    bad ``chunk_size`` or ``strategy``."""
    if bs < 0:
        raise ValueError("bs must be non-negative")
    chunk = resolve_plan_chunk(chunk_size, strategy)
    resolved = resolve_plan_strategy(strategy, bs, chunk)
    notes = []
    if strategy == "auto" and chunk_size is None:
        notes.append(f"auto with chunk_size=None uses {AUTO_PLAN_CHUNK}-request slices")
    elif chunk_size is None:
        notes.append(f"chunk_size=None: the largest slice, {PLAN_MAX_CHUNK} requests")
    syncs = ["none"]
    if resolved == "loop":
        slices = slice_bounds(bs, chunk)
        block = f"BS_BLOCK={block_for(chunk)}, carry"
        launches = [Launch("torch: zero the 3-element carry", None)]
        for k, _ in enumerate(slices or [(0, 0)]):
            launches.append(Launch("_plan_offsets_kernel", (1,), block, k))
        notes.append("the slices run one after another, chained by the device carry")
        return Split(
            "plan", strategy, "loop", bs, None, chunk, slices, None, launches, syncs, notes
        )
    if resolved == "fixed":
        why = "bs == 0" if bs == 0 else f"bs <= {chunk}"
        notes.append(f"{why}: one fixed-block launch plans the whole batch")
        launches = [Launch("_plan_offsets_kernel", (1,), f"BS_BLOCK={block_for(max(bs, 1))}")]
        return Split("plan", strategy, "fixed", bs, None, None, [], None, launches, syncs, notes)
    slices = slice_bounds(bs, chunk)
    n = len(slices)
    block = f"BS_BLOCK={block_for(chunk)}"
    if resolved == "scan":
        launches = [
            Launch("_plan_slice_sums_kernel", (n,), block),
            Launch("_plan_scan_kernel", (n,), block),
        ]
        notes.append(
            "launch 1 sums each slice; in launch 2 each program adds up the slices before it"
        )
    else:
        launches = [
            Launch("torch: fill the look-back state (1 + 4 * slices int64)", None),
            Launch("_plan_lookback_kernel", (n,), block),
        ]
        notes.append(
            "each program publishes its slice's sums and adds up its predecessors' (decoupled "
            "look-back)"
        )
    return Split("plan", strategy, resolved, bs, None, chunk, slices, None, launches, syncs, notes)


def _fmt_grid(grid: tuple[int, ...] | None) -> str:
    if grid is None:
        return "-"
    return "(" + ", ".join(str(g) for g in grid) + ("," if len(grid) == 1 else "") + ")"


def _elide(n: int, show: int) -> list[int | None]:
    """Indices to print out of ``n``: all if few, else the first and last ``show // 2`` with
    ``None`` marking the gap."""
    if n <= show + 1:
        return list(range(n))
    head = max(1, show // 2)
    tail = max(1, show - head)
    return list(range(head)) + [None] + list(range(n - tail, n))


def format_split(split: Split, show: int = 6) -> str:
    """Text for one call: header, slices with their request and token ranges and launches,
    the launch summary and the host syncs. At most ``show`` slice rows (first and last)."""
    tokens = "unknown" if split.tokens is None else str(split.tokens)
    fn = "scatter_req_token_ids" if split.op == "scatter" else "plan_offsets"
    head = f"{fn}: bs={split.bs}"
    if split.op == "scatter":
        head += f", tokens={tokens}"
    head += f", strategy={split.strategy}"
    if split.resolved != split.strategy:
        head += f" (runs {split.resolved})"
    lines = [head]
    kinds: dict[str, list[Launch]] = {}
    for la in split.launches:
        kinds.setdefault(la.kernel, []).append(la)
    if split.slices:
        lines.append(
            f"  {len(split.slices)} slice(s) of at most {split.chunk} requests"
            + ("" if split.resolved != "sliced" else " (slice index = grid axis 0)")
        )
        by_slice: dict[int, list[Launch]] = {}
        for la in split.launches:
            if la.slice_index is not None:
                by_slice.setdefault(la.slice_index, []).append(la)
        tok_head = f"{'tokens':<26} " if split.op == "scatter" else ""
        lines.append(f"  {'slice':>7}  {'requests':<20} {tok_head}launch grid")
        for k in _elide(len(split.slices), show):
            if k is None:
                hidden = len(split.slices) - show
                lines.append(f"  {'...':>7}  ({hidden} more slices)")
                continue
            s, e = split.slices[k]
            tok = "-"
            if split.token_ranges is not None:
                a, b = split.token_ranges[k]
                tok = f"[{a}, {b})"
            tok = f"{tok:<26} " if split.op == "scatter" else ""
            grids = [
                _fmt_grid(la.grid)
                for la in by_slice.get(k, [])
                if not la.kernel.startswith("torch")
            ]
            grid = ", ".join(grids) if grids else ("-" if by_slice else "")
            if by_slice and not grids and split.token_ranges is not None:
                grid = "no launch (no tokens)"
            if not by_slice:  # one launch for all slices: the slice is a program row
                grid = f"programs ({k}, *)" if split.resolved == "sliced" else f"program {k}"
            lines.append(f"  {k:>7}  {f'[{s}, {e})':<20} {tok}{grid}".rstrip())
    n_triton = len(split.triton_launches)
    n_torch = len(split.launches) - n_triton
    summary = f"  launches: {n_triton} Triton launch(es)"
    if n_torch:
        summary += f" + {n_torch} torch device op(s)"
    lines.append(summary)
    for kernel, group in kinds.items():
        grids = {_fmt_grid(la.grid) for la in group}
        shown = ", ".join(sorted(grids)[:4]) + (", ..." if len(grids) > 4 else "")
        block = group[0].block
        extra = f"; {block}" if block else ""
        if kernel.startswith("torch"):
            lines.append(f"    {len(group)} x {kernel}")
        else:
            lines.append(f"    {len(group)} x {kernel}, grid {shown}{extra}")
    lines.append("  host syncs: " + "; ".join(split.host_syncs))
    lines.append("    (validate=True adds data checks that read the inputs back: a sync)")
    for note in split.notes:
        lines.append(f"  note: {note}")
    return "\n".join(lines)
