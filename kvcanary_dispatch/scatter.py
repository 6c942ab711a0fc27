"""``scatter_req_token_ids`` for any batch size.

Strategies (``strategy=``):

- ``"loop"``: the literal design, one fixed-block launch per slice of ``chunk_size`` requests,
  each with rebased offsets (``offsets[s:e+1] - offsets[s]``, one small device op) and its
  slice of ``flat_in``. It needs the slice-boundary offsets on the host: with device offsets,
  one device-to-host copy per call of those ``n_slices + 1`` values, before the first launch
  (a sync; not capturable in a CUDA graph); with CPU offsets, none.
- ``"sliced"``: one launch, the slice index on a grid axis; each program holds one slice of at
  most ``chunk_size`` requests in its register block. No device-to-host copy.
- ``"flat"``: one launch over a flat token grid; each program finds its tokens' owners by a
  search over the offsets. ``chunk_size`` does not apply. No device-to-host copy.
- ``"segments"``: one launch over groups of requests; each program copies its requests' runs
  of tokens column block by column block (no search). Its group shape comes from the mean
  segment length, and a program takes ``run / cols`` serial steps for its longest run: one
  run far longer than the mean makes it slow (``"flat"`` splits any run over many programs).
  ``chunk_size`` does not apply. No device-to-host copy.
- ``"auto"`` (default): from host-known sizes only (``bs``, ``len(flat_in)``): ``"segments"``
  for batches of >= 64 requests averaging 256 to 4096 tokens, else ``"flat"``
  (benchmarks/NOTES.md has the measurements); an explicit ``chunk_size`` makes it
  ``"sliced"``. No device-to-host copy.

Device, streams and host data follow ``kvcanary_dispatch.placement``: launches go to
``pool_out``'s device and its current stream; CPU ``offsets`` with device tensors are copied on
the host during the call into private pinned staging and uploaded asynchronously (the caller's
tensor may be refilled as soon as the call returns); under CUDA-graph capture CPU offsets,
``"loop"`` with device offsets and ``validate=True`` are a ``ValueError`` (pass device offsets
and a single-launch strategy). ``validate=True`` adds data checks that read the inputs back (a
sync).
"""

from __future__ import annotations

import torch

from kvcanary_kernels import SCATTER_BATCH_BLOCK, launch_scatter_req_token_ids_kernel
from kvcanary_kernels._checks import PREFIX
from kvcanary_kernels.scatter_flat import launch_scatter_flat
from kvcanary_kernels.scatter_req_token_ids import check_scatter_args
from kvcanary_kernels.scatter_segments import launch_scatter_segments
from kvcanary_kernels.scatter_sliced import launch_scatter_sliced

from .placement import on_device, refuse_capture, upload
from .slicing import block_for, resolve_chunk_size, slice_bounds
from .validation import promote_offsets, require_offsets_dtype, validate_scatter_data

SCATTER_STRATEGIES = ("auto", "loop", "sliced", "flat", "segments")
SCATTER_MAX_CHUNK = SCATTER_BATCH_BLOCK - 1
# auto takes "segments" for batches of at least SEGMENTS_MIN_BS requests whose mean segment
# length lies in [SEGMENTS_MIN_MEAN, SEGMENTS_MAX_MEAN] tokens (benchmarks/NOTES.md, step 5):
# there its columns are >= 256 wide, so a run far longer than the mean costs one program
# len/cols serial steps; shorter means go to "flat", whose tiles split any run.
SEGMENTS_MIN_BS = 64
SEGMENTS_MIN_MEAN = 256
SEGMENTS_MAX_MEAN = 4096
_SEGMENTS_TILE = 1024  # elements of a "segments" program's [reqs, cols] tile
_SEGMENTS_MAX_REQS = 256  # a "segments" program's most requests (a power of two < 512)


def resolve_scatter_strategy(
    strategy: str, bs: int, num_tokens: int, chunk_size: int | None
) -> str:
    """The strategy ``scatter_req_token_ids`` runs; a ``ValueError`` for an unknown one."""
    if strategy not in SCATTER_STRATEGIES:
        raise ValueError(
            f"{PREFIX}scatter_req_token_ids strategy={strategy!r} is not one of "
            f"{', '.join(SCATTER_STRATEGIES)}"
        )
    if strategy != "auto":
        return strategy
    if chunk_size is not None:
        return "sliced"
    long_runs = SEGMENTS_MIN_MEAN * bs <= num_tokens <= SEGMENTS_MAX_MEAN * bs
    return "segments" if bs >= SEGMENTS_MIN_BS and long_runs else "flat"


def segments_shape(bs: int, num_tokens: int) -> tuple[int, int]:
    """``"segments"``' (requests, columns) per program: columns the mean segment length
    rounded up to a power of two (4 to 1024), requests filling a 1024-element tile."""
    mean = -(-num_tokens // max(bs, 1))
    cols = min(_SEGMENTS_TILE, max(4, 1 << (mean - 1).bit_length()))
    return min(_SEGMENTS_MAX_REQS, _SEGMENTS_TILE // cols), cols


def flat_token_block(bs: int, num_tokens: int) -> int:
    """``"flat"``'s tokens per program, from host-known sizes only: short segments (a program
    spans many requests) search faster in small tiles; long ones amortise the search over large
    tiles (benchmarks/NOTES.md has the measurements)."""
    return 128 if num_tokens < 8 * bs else 1024


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
    not allowed during CUDA-graph capture. The call runs on ``pool_out``'s device and its
    current stream; inputs on another device are a ``ValueError``. Under ``torch.compile`` it
    is one custom op (``torch.ops.kvcanary_dispatch.scatter_req_token_ids``).
    ``chunk_size``: requests per slice for the slicing strategies, ``None`` =
    ``SCATTER_MAX_CHUNK`` (511); with ``"auto"``, an explicit ``chunk_size`` selects
    ``"sliced"`` (``None`` lets it pick ``"segments"`` or ``"flat"``, which have no request
    slices). Every check runs before the first launch; a rejected call writes nothing.

    Preconditions on the data (not read back unless ``validate=True``, which enforces them):
    ``offsets`` is a CSR over ``flat_in`` (``offsets[0] == 0``, non-decreasing,
    ``offsets[bs] == len(flat_in)``) and ``req_pool_indices`` are distinct rows of
    ``pool_out``. Data that breaks them can make a kernel write out of bounds.
    """
    if torch.compiler.is_compiling():
        # torch.compile sees one opaque custom op (kvcanary_dispatch/ops.py).
        torch.ops.kvcanary_dispatch.scatter_req_token_ids(
            flat_in, offsets, req_pool_indices, pool_out, chunk_size, strategy, validate
        )
        return
    device = pool_out.device
    with on_device(device):
        _scatter(flat_in, offsets, req_pool_indices, pool_out, chunk_size, strategy, validate)


def _scatter(
    flat_in: torch.Tensor,
    offsets: torch.Tensor,
    req_pool_indices: torch.Tensor,
    pool_out: torch.Tensor,
    chunk_size: int | None,
    strategy: str,
    validate: bool,
) -> None:
    """``scatter_req_token_ids`` on ``pool_out``'s device, made current by the caller."""
    device = pool_out.device
    host_offsets = None
    if offsets.device.type == "cpu" and device.type != "cpu":
        require_offsets_dtype(offsets)
        refuse_capture(
            device,
            "scatter_req_token_ids got offsets on the CPU",
            f"pass offsets on {device} (e.g. uploaded before capture into a static buffer)",
        )
        host_offsets = offsets  # read now (loop strategy), never after the call returns
        offsets = upload(offsets, device, torch.int64)
    else:
        offsets = promote_offsets(offsets)
        if offsets.device.type == "cpu":
            host_offsets = offsets
    bs = check_scatter_args(
        flat_in=flat_in,
        offsets=offsets,
        req_pool_indices=req_pool_indices,
        pool_out=pool_out,
        batch_block=None,
    )
    chunk = resolve_chunk_size(chunk_size, SCATTER_MAX_CHUNK, "scatter_req_token_ids")
    num_tokens = int(flat_in.shape[0])
    strategy = resolve_scatter_strategy(strategy, bs, num_tokens, chunk_size)
    if strategy == "loop" and host_offsets is None:
        refuse_capture(
            device,
            "scatter_req_token_ids strategy='loop' reads the slice-boundary offsets back",
            "use a single-launch strategy ('auto', 'segments', 'flat' or 'sliced')",
        )
    if validate:
        refuse_capture(
            device,
            "scatter_req_token_ids validate=True reads the inputs back",
            "validate outside capture, or pass validate=False",
        )
        validate_scatter_data(flat_in, offsets, req_pool_indices, int(pool_out.shape[0]))
    if bs == 0 or num_tokens == 0:
        return
    if strategy == "segments":
        reqs, cols = segments_shape(bs, num_tokens)
        launch_scatter_segments(
            flat_in=flat_in,
            offsets=offsets,
            req_pool_indices=req_pool_indices,
            pool_out=pool_out,
            reqs=reqs,
            cols=cols,
        )
    elif strategy == "flat":
        launch_scatter_flat(
            flat_in=flat_in,
            offsets=offsets,
            req_pool_indices=req_pool_indices,
            pool_out=pool_out,
            token_block=flat_token_block(bs, num_tokens),
        )
    elif strategy == "sliced":
        launch_scatter_sliced(
            flat_in=flat_in,
            offsets=offsets,
            req_pool_indices=req_pool_indices,
            pool_out=pool_out,
            chunk=chunk,
            batch_block=block_for(chunk + 1),
        )
    else:
        _scatter_loop(flat_in, offsets, host_offsets, req_pool_indices, pool_out, chunk)


def _scatter_loop(
    flat_in: torch.Tensor,
    offsets: torch.Tensor,
    host_offsets: torch.Tensor | None,
    req_pool_indices: torch.Tensor,
    pool_out: torch.Tensor,
    chunk: int,
) -> None:
    bounds = slice_bounds(int(req_pool_indices.shape[0]), chunk)
    starts = [s for s, _ in bounds] + [bounds[-1][1]]
    if host_offsets is None:
        # The one device-to-host copy of this path: the slice-boundary offsets.
        index = torch.tensor(starts, device=offsets.device)
        host_offsets = offsets[index].cpu()
        token_at = host_offsets.tolist()
    else:
        token_at = host_offsets[starts].tolist()
    block = block_for(chunk + 1)
    for k, (s, e) in enumerate(bounds):
        a, b = token_at[k], token_at[k + 1]
        launch_scatter_req_token_ids_kernel(
            flat_in=flat_in[a:b],
            offsets=offsets[s : e + 1] - a,
            req_pool_indices=req_pool_indices[s:e],
            pool_out=pool_out,
            batch_block=block,
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
