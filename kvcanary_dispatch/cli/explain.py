"""How a dispatched call is split, rendered from the call's own ``LaunchPlan``.

``explain_scatter`` and ``explain_plan`` build the ``LaunchPlan`` the dispatcher would build
for those sizes (``kvcanary_dispatch.launch_plan``: strategy, slices, launches, grids, blocks,
temporaries, host syncs) and add what only data decides, under uniform lengths: the token
range of each slice, and the grid of each ``loop`` slice. ``format_split`` renders one as text
for ``kvcanary-dispatch explain``.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from kvcanary_kernels import SCATTER_TOKEN_BLOCK
from kvcanary_kernels.scatter_req_token_ids import scatter_grid

from ..launch_plan import (
    PLAN_MAX_CHUNK,
    SCATTER_MAX_CHUNK,
    STAGED_SYNC,
    LaunchPlan,
    plan_offsets_launch_plan,
    resolve_plan_chunk,
    resolve_scatter_strategy,
    scatter_launch_plan,
)
from ..slicing import resolve_chunk_size

# The most slices explain describes: past it a call's slice list alone takes gigabytes (a
# batch that large has index tensors of terabytes).
MAX_SLICES = 1 << 22


@dataclass(frozen=True)
class Launch:
    """One Triton kernel launch of a call, or one of its temporaries (``kernel`` says which:
    ``"temporary: ..."``).
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
    torch_ops: int = 0  # device ops the temporaries cost (LaunchPlan.torch_ops)

    @property
    def triton_launches(self) -> list[Launch]:
        return [la for la in self.launches if not la.kernel.startswith("temporary")]


def uniform_offsets(bs: int, tokens: int, at: list[int]) -> list[int]:
    """CSR offsets at request indices ``at`` when ``tokens`` are spread as evenly as possible
    over ``bs`` requests (request ``r`` starts at ``floor(r * tokens / bs)``)."""
    return [(r * tokens) // bs if bs else 0 for r in at]


def _block(params: tuple[tuple[str, int], ...]) -> str:
    return ", ".join(f"{k.upper()}={v}" for k, v in params if k != "num_warps")


def _rendered(plan: LaunchPlan, token_ranges: list[tuple[int, int]] | None) -> list[Launch]:
    """The plan's temporaries, then each Triton kernel of each launch; a ``loop``
    slice's grid from its (uniform) token range, a slice with no tokens launching nothing."""
    out = [Launch(f"temporary: {t}", None) for t in plan.temporaries]
    for k, la in enumerate(plan.launches):
        grid, index = la.grid, (k if la.requests is not None and plan.slices else None)
        if plan.function == "scatter_req_token_ids" and plan.strategy == "loop":
            if token_ranges is not None:
                a, b = token_ranges[k]
                if a == b:
                    continue  # the launcher returns without launching
                grid = scatter_grid(b - a)  # the launcher's own
        out += [Launch(name, grid, _block(la.params), index) for name in la.kernels]
    return out


def _refuse_too_many_slices(bs: int, chunk: int, max_chunk: int) -> None:
    slices = -(-bs // chunk)
    if slices > MAX_SLICES:
        raise ValueError(
            f"bs={bs} in slices of {chunk} requests makes {slices} slices, and explain "
            f"describes at most {MAX_SLICES}; pass a smaller --bs, or a larger --chunk-size "
            f"(up to {max_chunk})"
        )


def explain_scatter(
    bs: int,
    tokens: int | None = None,
    chunk_size: int | None = None,
    strategy: str = "auto",
    offsets_on: str = "device",
    width: int | None = None,
    capturing: bool = False,
) -> Split:
    """Describe ``scatter_req_token_ids`` on ``bs`` requests and ``tokens`` flat tokens (lengths
    assumed uniform; ``None`` = unknown: grids that depend on it are left out) into a pool
    ``width`` columns wide (``None`` = unknown, as ``scatter_launch_plan`` takes it).
    ``offsets_on``: ``"device"`` or ``"host"`` (a CPU offsets tensor with the rest on a GPU).
    ``capturing``: on a stream capturing a CUDA graph, where a call that reads offsets back or
    uploads CPU offsets is refused. Raises the dispatcher's own errors for a bad
    ``chunk_size`` or ``strategy``."""
    if bs < 0 or (tokens is not None and tokens < 0):
        raise ValueError("bs and tokens must be non-negative")
    if bs == 0 and tokens:
        raise ValueError(f"bs=0 with tokens={tokens}: a batch of no requests has no tokens")
    chunk = resolve_chunk_size(chunk_size, SCATTER_MAX_CHUNK, "scatter_req_token_ids")
    if resolve_scatter_strategy(strategy, bs, tokens or 0, chunk_size, width) in ("loop", "sliced"):
        _refuse_too_many_slices(bs, chunk, SCATTER_MAX_CHUNK)
    known, notes, turns = tokens is not None, [], None
    stand_in = max(bs, 1)  # for an unknown token count
    if not known and strategy == "auto" and chunk_size is None and width is not None:
        # auto's choice can turn on the token count (the "rows" grid covers min(width, tokens)
        # columns): plan for the most columns a run can fill, and say where the choice turns.
        turns = _auto_by_tokens(bs, width, stand_in)
        if turns is not None:
            few, limit, many = turns
            notes.append(
                f"auto takes {few!r} up to {limit} tokens and {many!r} past them; shown: "
                f"{many!r}, planned as for {max(width, stand_in)} tokens"
            )
            stand_in = max(width, stand_in)
    plan = scatter_launch_plan(bs, tokens if known else stand_in, chunk_size, strategy,
                               offsets_on, width)  # fmt: skip
    resolved = plan.strategy
    if turns is not None:  # the header says both, as where the width is unknown
        resolved = f"{turns[0]} up to {turns[1]} tokens, {turns[2]} past them"
    # Without a width, auto's choice is open where a narrow pool would give "rows".
    open_choice = (
        strategy == "auto" and chunk_size is None and width is None and bs > 0
        and resolve_scatter_strategy("auto", bs, tokens if known else stand_in, None, 1) == "rows"
    )  # fmt: skip
    if strategy == "auto" and chunk_size is None and not known:
        if bs and turns is None and not open_choice:  # else a note above or below names both
            given = f"{bs} request{'s' if bs != 1 else ''}"
            given += "" if width is None else f" and a pool {width} wide"
            notes.append(f"auto runs {resolved!r} for {given}, whatever the token count")
    elif strategy == "auto" and known and not open_choice:
        why = "no chunk_size" if chunk_size is None else "an explicit chunk_size"
        notes.append(f"auto with {why} runs {resolved!r}")
    if open_choice:
        resolved = "capped or rows"
        notes.append(
            "pool width unknown: shown is 'capped', planned as for the widest pool; a call of "
            f"{bs} request{'s' if bs > 1 else ''} takes 'rows' where its pool width keeps the "
            "rows grid small enough: pass --width for the call's own choice"
        )
    elif plan.strategy == "capped" and width is None:
        notes.append(
            "pool width unknown: 'capped' (its head steps and tail programs) is planned as "
            "for the widest pool; pass --width for the call's own shapes"
        )
    if known and bs:
        notes.append(
            f"token ranges assume uniform lengths ({tokens} tokens over {bs} requests, "
            f"~{tokens / bs:.4g} a request); real batches differ"
        )
    if plan.slices and chunk_size is None:
        notes.append(f"chunk_size=None: the largest slice, {SCATTER_MAX_CHUNK} requests")
    if chunk_size is not None and plan.chunk is None and bs:
        notes.append(f"chunk_size does not apply to {resolved} (it has no request slices)")
    token_ranges = None
    if known and plan.slices:
        at = uniform_offsets(bs, tokens, [s for s, _ in plan.slices] + [bs])
        token_ranges = list(zip(at[:-1], at[1:], strict=True))
    launches = _rendered(plan, token_ranges) if (bs and tokens != 0) else []
    if not known and plan.strategy != "loop":
        launches = [Launch(la.kernel, None, la.block) for la in launches]
        notes.append("grids depend on the token count: pass --tokens for them")
    elif not known:
        notes.append(
            f"each loop launch's grid is (cdiv(slice tokens, {SCATTER_TOKEN_BLOCK}),), and a "
            "slice with no tokens launches nothing: pass --tokens for the grids"
        )
    if bs == 0 or tokens == 0:
        why = "bs == 0" if bs == 0 else "no tokens"
        notes.append(f"{why}: the call returns after its checks, no kernel launch")
    syncs = list(plan.host_syncs) or [STAGED_SYNC if offsets_on == "host" else "none"]
    refusal = plan.capture_refusal if capturing else None
    if refusal is not None:  # checked before the first launch: nothing runs
        what, fix = refusal[0], refusal[1].format(device="the pool's device")
        if not known and plan.host_syncs:
            fix += " (a call with no token to copy reads nothing back and is captured)"
        notes.insert(0, f"while capturing a CUDA graph this call is refused (ValueError): "
                        f"{what}; {fix}")  # fmt: skip
        resolved, launches, syncs = f"{resolved}, refused while capturing", [], ["none"]
        return Split("scatter", strategy, resolved, bs, tokens, None, [], None, launches,
                     syncs, notes)  # fmt: skip
    return Split(
        "scatter", strategy, resolved, bs, tokens, plan.chunk, list(plan.slices), token_ranges,
        launches, syncs, notes, plan.torch_ops,
    )  # fmt: skip


def _auto_by_tokens(bs: int, width: int, least: int) -> tuple[str, int, str] | None:
    """Where scatter ``auto``'s choice on ``bs`` requests and a pool ``width`` wide turns with the
    token count, read from ``resolve_scatter_strategy`` itself: (its choice at ``least`` tokens,
    the most tokens that keep it, its choice from ``width`` tokens on, past which no run fills
    more columns), or ``None`` when it does not turn."""

    def choice(t: int) -> str:
        return resolve_scatter_strategy("auto", bs, t, None, width)

    few, many = choice(least), choice(max(width, least))
    if few == many:
        return None
    tokens = range(least, max(width, least) + 1)
    turn = bisect.bisect_left(tokens, True, key=lambda t: choice(t) != few)  # monotone in tokens
    return few, tokens[turn] - 1, many


def explain_plan(
    bs: int, chunk_size: int | None = None, strategy: str = "auto", capturing: bool = False
) -> Split:
    """Describe ``plan_offsets`` on ``bs`` requests, eager or (``capturing``) on a stream
    capturing a CUDA graph or under ``torch.compile``, which plan alike (a fresh look-back
    state, never the stream's). Raises the dispatcher's own errors for a bad ``chunk_size``
    or ``strategy``."""
    if bs < 0:
        raise ValueError("bs must be non-negative")
    chunk = resolve_plan_chunk(chunk_size, strategy, bs, capturing)
    _refuse_too_many_slices(bs, chunk, PLAN_MAX_CHUNK)
    plan = plan_offsets_launch_plan(bs, chunk_size, strategy, capturing)
    notes = []
    if plan.by_capture:
        other = plan_offsets_launch_plan(bs, chunk_size, strategy, not capturing)
        when = "eager" if capturing else "while capturing a CUDA graph or under torch.compile"
        flag = "without" if capturing else "with"
        notes.append(
            f"{when} this call runs {other.strategy} with {other.device_ops} device op(s): "
            f"explain it {flag} --capturing"
        )
    if strategy == "auto" and chunk_size is None:
        if plan.strategy != "fixed":
            notes.append(f"auto with chunk_size=None uses {chunk}-request slices at this bs")
    elif chunk_size is None and plan.slices:  # (a fixed launch has no slice)
        notes.append(f"chunk_size=None: the largest slice, {PLAN_MAX_CHUNK} requests")
    notes.append(
        {
            "loop": "the slices run one after another, chained by the device carry",
            "fixed": f"{'bs == 0' if bs == 0 else 'bs <= chunk'}: one fixed-block launch "
            "plans the whole batch",
            "scan": "launch 1 sums each slice; in launch 2 each program adds up the slices "
            "before it",
            "lookback": "each program publishes its slice's sums and adds up those of every "
            "slice before it, waiting for any not yet published",
            "recount": "each program re-reads and sums the requests before its slice "
            "(one launch, no temporary)",
        }[plan.strategy]
    )
    slices = [se for se in plan.slices if se != (0, 0)]
    return Split(
        "plan", strategy, plan.strategy, bs, None, plan.chunk, slices, None,
        _rendered(plan, None), ["none"], notes, plan.torch_ops,
    )  # fmt: skip


def _fmt_grid(grid: tuple[int, ...] | None) -> str:
    if grid is None:
        return "-"
    return "(" + ", ".join(str(g) for g in grid) + ("," if len(grid) == 1 else "") + ")"


def _elide(n: int, show: int) -> list[int | None]:
    """Indices to print out of ``n``, at most ``show`` of them: all if they fit, else the
    first ``ceil(show / 2)`` and the last ``show // 2`` with ``None`` marking the gap."""
    if n <= show:
        return list(range(n))
    head = (show + 1) // 2
    return list(range(head)) + [None] + list(range(n - (show - head), n))


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
        shown = _elide(len(split.slices), show)
        for k in shown:
            if k is None:
                hidden = len(split.slices) - (len(shown) - 1)
                lines.append(f"  {'...':>7}  ({hidden} more slice{'s' if hidden > 1 else ''})")
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
                if not la.kernel.startswith("temporary")
            ]
            grid = ", ".join(grids) if grids else ("-" if by_slice else "")
            if by_slice and not grids and split.token_ranges is not None:
                grid = "no launch (no tokens)"
            if not split.triton_launches:
                grid = "no launch"
            elif not by_slice:  # one launch for all slices: the slice is a program row
                grid = f"programs ({k}, *)" if split.resolved == "sliced" else f"program {k}"
            lines.append(f"  {k:>7}  {f'[{s}, {e})':<20} {tok}{grid}".rstrip())
    n_triton = len(split.triton_launches)
    summary = f"  launches: {n_triton} Triton launch(es)"
    if split.torch_ops:
        summary += f" + {split.torch_ops} torch device op(s)"
    lines.append(summary)
    for kernel, group in kinds.items():
        grids = {_fmt_grid(la.grid) for la in group}
        shown = ", ".join(sorted(grids)[:4]) + (", ..." if len(grids) > 4 else "")
        block = group[0].block
        extra = f"; {block}" if block else ""
        if kernel.startswith("temporary"):
            lines.append(f"    {kernel}")
        else:
            lines.append(f"    {len(group)} x {kernel}, grid {shown}{extra}")
    lines.append("  host syncs: " + "; ".join(split.host_syncs))
    lines.append("    (validate=True adds data checks that read the inputs back: a sync)")
    for note in split.notes:
        lines.append(f"  note: {note}")
    return "\n".join(lines)
