"""``scatter_req_token_ids`` for any batch size.

Strategies (``strategy=``):

- ``"loop"``: the literal design, one fixed-block launch per slice of ``chunk_size`` requests,
  each with rebased offsets (``offsets[s:e+1] - offsets[s]``, one small device op) and its
  slice of ``flat_in``. It needs the slice-boundary offsets on the host: with device offsets,
  one device-to-host copy per call of those ``n_slices + 1`` values, before the first launch
  (a sync; not capturable in a CUDA graph); with CPU offsets, none.
- ``"sliced"``: one launch, the slice index on a grid axis; each program holds one slice of at
  most ``chunk_size`` requests in its register block. No device-to-host copy.
- ``"capped"``: one launch; head programs copy the first ``cap`` columns of each run for groups
  of requests (a few column steps, no search), tail programs the tokens past the cap in fixed
  token tiles (one search each). No program's work grows with one run's length or with the
  number of short runs; shapes come from the mean run length and the pool width.
  ``chunk_size`` does not apply.
  No device-to-host copy.
- ``"flat"``: one launch over a flat token grid; each program finds its tokens' owners by a
  search over the offsets. ``chunk_size`` does not apply. No device-to-host copy.
- ``"segments"``: one launch over groups of requests; each program copies its requests' runs
  of tokens column block by column block (no search). Its group shape comes from the mean
  segment length, and a program takes ``run / cols`` serial steps for its longest run: one
  run far longer than the mean makes it slow (``"flat"`` splits any run over many programs).
  ``chunk_size`` does not apply. No device-to-host copy.
- ``"rows"``: one launch over ``(bs, C)`` programs; program ``(r, c)`` copies column tiles
  ``c, c + C, ...`` (1 024 columns each) of request ``r``'s run. ``C`` is one a tile while
  the grid stays within 2 048 programs; past that, ``C`` keeps it near 2 048 but lets no run
  take more than 4 tiles a program
  (``kvcanary_dispatch.scatter_shapes.rows_grid``); for small batches. No device-to-host copy.
- ``"auto"`` (default): from host-known sizes only (``bs``, ``len(flat_in)``, the pool
  width): ``"rows"`` when the batch has at most 512 requests and the ``"rows"`` grid at most
  4 096 programs; else ``"capped"`` (benchmarks/NOTES.md, steps 11, 30 and 31, have the
  measurements); an explicit ``chunk_size`` makes it ``"sliced"``. No device-to-host copy.

A valid call on the current CUDA device whose plan is one launch (or none) is checked and
launched in one pass (``_launched``: each check read once, the launch looked up by the call's
sizes, each tensor's address read once); any other call, valid or not, takes the full path,
whose ordered checks name what is wrong. Both make the same launch.

Device, streams and host data follow ``kvcanary_dispatch.placement``: launches go to
``pool_out``'s device and its current stream; CPU ``offsets`` with device tensors are copied on
the host during the call into private pinned staging and uploaded asynchronously (the caller's
tensor may be refilled as soon as the call returns); under CUDA-graph capture CPU offsets,
``"loop"`` with device offsets (when it has tokens to copy) and ``validate=True`` are a
``ValueError`` (pass device offsets and a single-launch strategy). ``validate=True`` adds data
checks that read the inputs back (a sync).
"""

from __future__ import annotations

import functools

import torch

from kvcanary_kernels import launch_scatter_req_token_ids_kernel
from kvcanary_kernels._launch import BoundKernel
from kvcanary_kernels.args import ScatterArgs, name_a_non_scatter_tensor
from kvcanary_kernels.scatter_capped import bind_scatter_capped, launch_scatter_capped
from kvcanary_kernels.scatter_flat import bind_scatter_flat, launch_scatter_flat
from kvcanary_kernels.scatter_req_token_ids import check_scatter_args
from kvcanary_kernels.scatter_rows import bind_scatter_rows, launch_scatter_rows
from kvcanary_kernels.scatter_segments import bind_scatter_segments, launch_scatter_segments
from kvcanary_kernels.scatter_sliced import launch_scatter_sliced

from .aliasing import Span, meet, refuse_shared_memory, run
from .launch_plan import (
    HOST_OFFSETS_UNDER_CAPTURE,
    SCATTER_MAX_CHUNK,
    SCATTER_STRATEGIES,
    LaunchPlan,
    resolve_scatter_strategy,
    scatter_launch_plan,
)
from .placement import device_of, on_device, refuse_capture, refuse_unlaunchable, upload_into
from .slicing import refuse_traced_numpy, resolve_chunk_size
from .untraced import PENDING as _UNTRACED_PENDING
from .untraced import eager_only, keep_untraced
from .validation import OFFSETS_DTYPES, validate_scatter_data

__all__ = [
    "SCATTER_MAX_CHUNK",
    "SCATTER_STRATEGIES",
    "launch_scatter_req_token_ids_kernel_any_bs",
    "resolve_scatter_strategy",
    "scatter_req_token_ids",
]


def scatter_req_token_ids(
    *,
    flat_in: torch.Tensor,
    offsets: torch.Tensor,
    req_pool_indices: torch.Tensor,
    pool_out: torch.Tensor,
    chunk_size: int | None = None,
    strategy: str = "auto",
    validate: bool = False,
) -> None:
    """For every request ``r`` of any batch size:
    ``pool_out[req_pool_indices[r], :n] = flat_in[offsets[r]:offsets[r] + n]`` as int32 with
    ``n = min(offsets[r+1] - offsets[r], pool_out.shape[1])``; nothing else in ``pool_out``
    changes. Byte-identical to one unbounded fixed-block launch.

    ``offsets`` may be int32 (widened) and may live on the CPU while the rest is on a GPU: it
    is then copied during the call (never read after it returns) and uploaded asynchronously;
    not allowed during CUDA-graph capture. Offsets read in place (int64 on ``pool_out``'s
    device) must be contiguous; offsets copied first (int32, or CPU offsets for a GPU pool)
    may have any stride. ``pool_out``'s rows must be contiguous and must not overlap (a
    column window of a wider pool will do), nor share memory with an input (a
    ``ValueError``). The call runs on ``pool_out``'s device and its current stream; inputs on
    another device are a ``ValueError``. Under ``torch.compile`` it
    is one custom op (``torch.ops.kvcanary_dispatch.scatter_req_token_ids``).
    ``chunk_size``: requests per slice for the slicing strategies, ``None`` =
    ``SCATTER_MAX_CHUNK`` (511); with ``"auto"``, an explicit ``chunk_size`` selects
    ``"sliced"`` (``None`` lets it pick ``"rows"`` or ``"capped"``, which have no request
    slices). Every check runs before the first launch; a rejected call writes nothing.

    Preconditions on the data (not read back unless ``validate=True``, which enforces them):
    ``offsets`` is a CSR over ``flat_in`` (``offsets[0] == 0``, non-decreasing,
    ``offsets[bs] == len(flat_in)``) and ``req_pool_indices`` are rows of ``pool_out``,
    distinct among the requests that write (padding requests with empty runs may share a
    row). Ordered offsets that do not span ``flat_in`` exactly (``0 <= offsets[0]``,
    non-decreasing, ``offsets[bs]`` short of ``len(flat_in)`` or past it) give the fixed-block
    launcher's bytes: only the tokens of ``flat_in`` that a run owns are copied, and nothing
    outside ``flat_in`` is read. Offsets in any other order or range (near the int64 ends
    included) give no defined bytes, but every strategy still reads no token outside
    ``flat_in`` (nor any offset or row index outside its tensor), writes only the addressed
    rows' first ``pool_out.shape[1]`` columns (each element it writes is ``flat_in[offsets[r]
    + c]`` for a request ``r`` naming that row, at its column ``c``) and ends. Rows outside
    ``[0, rows)`` write out of bounds, and two writing requests on one row race.
    """
    if torch.compiler.is_compiling():
        # torch.compile sees one opaque custom op (kvcanary_dispatch/ops.py), which checks
        # the call when it runs; the chunk size and strategy are checked as it is traced,
        # since the op's SymInt would take a bool or a tensor (or a numpy value) as a number.
        refuse_traced_numpy((("chunk_size", chunk_size),), "scatter_req_token_ids ")
        resolve_chunk_size(chunk_size, SCATTER_MAX_CHUNK, "scatter_req_token_ids")
        resolve_scatter_strategy(strategy, 0, 0, chunk_size)
        torch.ops.kvcanary_dispatch.scatter_req_token_ids(
            flat_in, offsets, req_pool_indices, pool_out, chunk_size, strategy, validate
        )
        return
    if _UNTRACED_PENDING[0]:  # dynamo loaded since the last call: mark the eager path
        keep_untraced()
    if not validate and _launched(
        flat_in, offsets, req_pool_indices, pool_out, chunk_size, strategy
    ):
        return
    try:
        with on_device(device_of(pool_out)):
            _scatter(flat_in, offsets, req_pool_indices, pool_out, chunk_size, strategy, validate)
    except (AttributeError, TypeError) as err:  # a non-tensor argument? say which
        t = ScatterArgs(flat_in, offsets, req_pool_indices, pool_out)
        name_a_non_scatter_tensor(err, t)
        raise


@eager_only
def _launched(
    flat_in: torch.Tensor,
    offsets: torch.Tensor,
    req_pool_indices: torch.Tensor,
    pool_out: torch.Tensor,
    chunk_size: int | None,
    strategy: str,
) -> bool:
    """The one pass of a call that ``_scatter`` would accept and run as at most one launch on
    the current device: the checks of that path read once each (plain ``torch.Tensor``s; the
    three vectors int64 of stride ``(1,)``, which stands for 1-D and contiguous; ``pool_out``
    int32, 2-D, its rows contiguous and disjoint; all CUDA tensors on the current device;
    ``offsets`` of ``bs + 1`` elements), the plan's launch looked up by sizes (``_one_launch``)
    and made with each tensor's address read once. Returns ``False``, having launched
    nothing, for any other call (another device, CPU or int32 offsets, a ``loop`` or
    ``sliced`` plan that launches, an unknown strategy, a subclass, a non-tensor): the full
    path then checks it in order and names what is wrong. Nothing here raises."""
    try:
        device = pool_out.get_device()
        if not (
            flat_in.__class__ is offsets.__class__ is req_pool_indices.__class__ is torch.Tensor
            and pool_out.__class__ is torch.Tensor
            and flat_in.dtype is offsets.dtype is req_pool_indices.dtype is torch.int64
            and pool_out.dtype is torch.int32
            and flat_in.stride() == offsets.stride() == req_pool_indices.stride() == (1,)
            and len(strides := pool_out.stride()) == 2
            and strides[1] == 1
            and pool_out.is_cuda  # index and type: another device type may share the index
            and flat_in.is_cuda
            and offsets.is_cuda
            and req_pool_indices.is_cuda
            and flat_in.get_device() == offsets.get_device() == device
            and req_pool_indices.get_device() == device == torch.cuda.current_device()
        ):
            return False
        bs, tokens, width = req_pool_indices.shape[0], flat_in.shape[0], pool_out.shape[1]
        if offsets.shape[0] != bs + 1 or strides[0] < width:
            return False
        one = _one_launch(bs, tokens, chunk_size, strategy, width)
    except (AttributeError, TypeError, RuntimeError, ValueError):
        return False  # a non-tensor, an unhashable or invalid chunk_size or strategy
    if one is None:
        return False
    tensors = (flat_in, offsets, req_pool_indices, pool_out)
    addresses = tuple([x.data_ptr() for x in tensors])
    if _pool_shares_memory(addresses, pool_out.shape[0], strides[0], width, tokens, bs):
        return False
    if one:
        bound, grid = one
        bound.checked(grid, device, tensors, addresses, (tokens, bs, strides[0], width))
    return True


def _pool_shares_memory(
    addresses: tuple[int, ...], rows: int, pitch: int, width: int, tokens: int, bs: int
) -> bool:
    """Whether ``pool_out`` (``rows`` int32 rows of ``width`` at ``pitch``) shares a byte with
    ``flat_in``, ``offsets`` or ``req_pool_indices`` (int64 vectors), from their addresses:
    first against the pool's whole extent, then row by row for what falls inside it."""
    flat, offsets, indices, pool = addresses
    end = pool + ((rows - 1) * pitch + width) * 4
    if not (rows and width) or (
        (flat >= end or flat + tokens * 8 <= pool or not tokens)
        and (offsets >= end or offsets + bs * 8 + 8 <= pool)
        and (indices >= end or indices + bs * 8 <= pool or not bs)
    ):
        return False
    rows_of = Span(pool, rows, pitch * 4, width * 4)
    return (
        meet(rows_of, run(flat, tokens * 8))
        or meet(rows_of, run(offsets, (bs + 1) * 8))
        or meet(rows_of, run(indices, bs * 8))
    )


_BINDERS = {
    "scatter_capped": bind_scatter_capped,
    "scatter_flat": bind_scatter_flat,
    "scatter_segments": bind_scatter_segments,
    "scatter_rows": bind_scatter_rows,
}


@functools.lru_cache(maxsize=4096, typed=True)
def _one_launch(
    bs: int, tokens: int, chunk_size: int | None, strategy: str, width: int
) -> tuple[BoundKernel, tuple[int, ...]] | tuple[()] | None:
    """The one launch of ``scatter_launch_plan`` for device offsets, as (bound kernel, grid);
    ``()`` when the plan launches nothing (any strategy, with no request or no token);
    ``None`` when it is not a single launch of a kernel that takes
    ``ScatterArgs.kernel_args()`` alone (``loop``, ``sliced``). Raises the plan's errors."""
    plan = scatter_launch_plan(bs, tokens, chunk_size, strategy, "device", width)
    if plan.host_syncs or plan.torch_ops:
        return None
    if not plan.launches:
        return ()
    (launch,) = plan.launches
    bind = _BINDERS.get(launch.launcher)
    return None if bind is None else (bind(**launch.kwargs), launch.grid)


@eager_only
def _scatter(
    flat_in: torch.Tensor,
    offsets: torch.Tensor,
    req_pool_indices: torch.Tensor,
    pool_out: torch.Tensor,
    chunk_size: int | None,
    strategy: str,
    validate: bool,
) -> None:
    """``scatter_req_token_ids`` on ``pool_out``'s device, made current by the caller: every
    check, then the call's ``LaunchPlan``, then its launches."""
    # int32 or CPU offsets are replaced below by an int64 copy: the shared-memory check
    # reads the caller's own.
    given = offsets
    host_offsets = widen = None
    offsets_on = "device"
    if not isinstance(offsets, torch.Tensor) or offsets.dtype not in OFFSETS_DTYPES:
        pass  # the ordered checks name it (ranks, then dtypes), unless another comes first
    elif not offsets.is_cpu:
        if offsets.dtype is not torch.int64:
            # Widened into this int64 buffer only once nothing refuses the call: a refusal
            # during capture must come before any op is recorded.
            widen, offsets = (
                offsets,
                torch.empty(offsets.shape, dtype=torch.int64, device=offsets.device),
            )
    elif device_of(pool_out).type == "cpu":  # or no tensor: the ordered checks name it
        offsets = host_offsets = offsets.to(torch.int64)  # a no-op for int64
        offsets_on = "cpu"
    else:
        device = pool_out.device
        # The plan's capture_refusal for host offsets, made here: before their upload.
        what, fix = HOST_OFFSETS_UNDER_CAPTURE
        refuse_capture(device, what, fix.format(device=device))
        # Staged and uploaded into this int64 buffer only once nothing refuses the call; read
        # during the call (the upload, a loop's slice bounds), never after it returns.
        host_offsets = offsets
        offsets = torch.empty(offsets.shape, dtype=torch.int64, device=device)
        offsets_on = "host"
    t = ScatterArgs(flat_in, offsets, req_pool_indices, pool_out)
    bs = check_scatter_args(t, batch_block=None)
    refuse_unlaunchable(pool_out.device, "scatter_req_token_ids pool_out")
    inputs = ((flat_in, "flat_in"), (given, "offsets"), (req_pool_indices, "req_pool_indices"))
    refuse_shared_memory("scatter_req_token_ids", ((pool_out, "pool_out"),), inputs)
    tokens, width = flat_in.shape[0], pool_out.shape[1]
    plan = scatter_launch_plan(bs, tokens, chunk_size, strategy, offsets_on, width)
    refusal = plan.capture_refusal if offsets_on != "host" else None  # host: refused above
    if refusal is not None:
        what, fix = refusal
        refuse_capture(pool_out.device, what, fix.format(device=pool_out.device))
    if validate:
        refuse_capture(
            pool_out.device,
            "scatter_req_token_ids validate=True reads the inputs back",
            "validate outside capture, or pass validate=False",
        )
    if widen is not None:
        offsets.copy_(widen)
    elif offsets_on == "host":
        upload_into(offsets, host_offsets)
    if validate:
        validate_scatter_data(flat_in, offsets, req_pool_indices, pool_out.shape)
    run_scatter_plan(plan, t, host_offsets)


_LAUNCHERS = {
    "scatter_capped": launch_scatter_capped,
    "scatter_flat": launch_scatter_flat,
    "scatter_segments": launch_scatter_segments,
    "scatter_sliced": launch_scatter_sliced,
    "scatter_rows": launch_scatter_rows,
}


def run_scatter_plan(plan: LaunchPlan, t: ScatterArgs, host_offsets: torch.Tensor | None) -> None:
    """Make ``plan``'s launches on checked arguments. ``loop`` slices read their boundary
    offsets from ``host_offsets`` when given, else with one device-to-host copy."""
    if plan.strategy != "loop":
        for launch in plan.launches:
            _LAUNCHERS[launch.launcher](t, grid=launch.grid, **launch.kwargs)
        return
    if not plan.launches:
        return
    starts = [s for s, _ in plan.slices] + [plan.bs]
    if host_offsets is None:
        # The one device-to-host copy of this path: the slice-boundary offsets.
        index = torch.tensor(starts, device=t.offsets.device)
        token_at = t.offsets[index].cpu().tolist()
    else:
        token_at = host_offsets[starts].tolist()
    n = t.num_tokens
    for k, launch in enumerate(plan.launches):
        # The slice's tokens from its first offset to its last, clamped into flat_in as
        # sliced's are, whatever the offsets. (The rebased offsets below may wrap in int64
        # near its ends, where sliced clamps them first: a wrapped start writes nothing.)
        a = min(max(token_at[k], 0), n)
        (s, e), b = launch.requests, min(max(token_at[k + 1], a), n)
        launch_scatter_req_token_ids_kernel(
            flat_in=t.flat_in[a:b],
            offsets=t.offsets[s : e + 1] - a,
            req_pool_indices=t.req_pool_indices[s:e],
            pool_out=t.pool_out,
            **launch.kwargs,
        )


def launch_scatter_req_token_ids_kernel_any_bs(
    *,
    flat_in: torch.Tensor,
    offsets: torch.Tensor,
    req_pool_indices: torch.Tensor,
    pool_out: torch.Tensor,
) -> None:
    """Drop-in for upstream's ``launch_scatter_req_token_ids_kernel`` (same keywords), with no
    batch-size cap."""
    scatter_req_token_ids(
        flat_in=flat_in, offsets=offsets, req_pool_indices=req_pool_indices, pool_out=pool_out
    )
