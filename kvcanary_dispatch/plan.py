"""``plan_offsets`` for any batch size.

Strategies (``strategy=``):

- ``"loop"``: the literal design, one fixed-block launch per slice of ``chunk_size`` requests,
  chained by a 3-element device carry (verify total, write total, requests so far), plus the
  carry's zero fill: ``n_slices + 1`` launches.
- ``"scan"``: two launches whatever ``bs``: per-slice sums, then a scan in which each program
  adds up the slices before it and plans its own slice.
- ``"lookback"``: one launch (plus the fill of its small state buffer): each program
  publishes its slice's sums and adds up its predecessors' by decoupled look-back.
- ``"auto"`` (default): one fixed-block launch when ``bs <= chunk``; else ``"scan"`` (on an
  H200 the fastest plan at bs 4 096 to 1 048 576, eager and as a graph replay:
  benchmarks/results/plan_sizes_h200_*.md). With ``chunk_size=None`` it also picks the slice
  size (``AUTO_PLAN_CHUNK``, measured fastest on an H200) rather than the largest one.

No strategy synchronises with the host (``validate=True`` does: it reads the inputs back, and
is refused during CUDA-graph capture). Launches go to the outputs' device and its current
stream, whatever device is current (``kvcanary_dispatch.placement``); under ``torch.compile``
a call is one custom op (``torch.ops.kvcanary_dispatch.plan_offsets``).
"""

from __future__ import annotations

import torch

from kvcanary_kernels import PLAN_BATCH_BLOCK, launch_plan_offsets_kernel
from kvcanary_kernels._checks import PREFIX, CapacityError
from kvcanary_kernels.plan_lookback import launch_plan_lookback
from kvcanary_kernels.plan_offsets import check_plan_args, enqueue_plan_offsets
from kvcanary_kernels.plan_scan import launch_plan_scan

from .placement import on_device, refuse_capture
from .slicing import block_for, resolve_chunk_size, slice_bounds
from .validation import validate_plan_data

PLAN_STRATEGIES = ("auto", "loop", "scan", "lookback")
PLAN_MAX_CHUNK = PLAN_BATCH_BLOCK
AUTO_PLAN_CHUNK = 256  # slices of 256 requests: benchmarks/NOTES.md
_SCAN_WARPS = 8
_LOOKBACK_WARPS = 4

_CAPACITY_REMEDY = (
    "size out_write_offsets to >= bs + 1 and out_write_seed_slot_indices to >= bs elements, "
    "or split the step with kvcanary_dispatch.split_forward_step / ForwardStepGuard"
)


def resolve_plan_chunk(chunk_size: int | None, strategy: str) -> int:
    """Requests per slice: ``chunk_size`` checked (``None`` = ``PLAN_MAX_CHUNK``), except
    that ``"auto"`` with ``None`` takes ``AUTO_PLAN_CHUNK``."""
    chunk = resolve_chunk_size(chunk_size, PLAN_MAX_CHUNK, "plan_offsets")
    return AUTO_PLAN_CHUNK if strategy == "auto" and chunk_size is None else chunk


def resolve_plan_strategy(strategy: str, bs: int, chunk: int) -> str:
    """What ``plan_offsets`` runs: ``"loop"``, ``"fixed"`` (one fixed-block launch for the
    whole batch), ``"scan"`` or ``"lookback"``; ``"auto"`` takes ``"fixed"`` for
    ``bs <= chunk``, else ``"scan"``. A ``ValueError`` for an unknown strategy."""
    if strategy not in PLAN_STRATEGIES:
        raise ValueError(
            f"{PREFIX}plan_offsets strategy={strategy!r} is not one of {', '.join(PLAN_STRATEGIES)}"
        )
    if strategy == "loop":
        return "loop"
    if bs == 0 or (strategy == "auto" and bs <= chunk):
        return "fixed"
    return "scan" if strategy == "auto" else strategy


def plan_offsets(
    *,
    req_pool_indices: torch.Tensor,
    prefix_lens: torch.Tensor,
    extend_seq_lens: torch.Tensor,
    req_to_token: torch.Tensor,
    full_to_swa_index_mapping: torch.Tensor | None = None,
    out_verify_offsets: torch.Tensor,
    out_write_offsets: torch.Tensor,
    out_write_seed_slot_indices: torch.Tensor,
    out_verify_num_valid: torch.Tensor,
    out_verify_enable: torch.Tensor,
    out_write_num_valid_reqs: torch.Tensor,
    swa_window_size: int = 0,
    verify_capacity: int,
    chunk_size: int | None = None,
    strategy: str = "auto",
    validate: bool = False,
    _verify_offsets_name: str = "out_verify_offsets",
) -> None:
    """Plan the whole batch for any ``bs``: verify and write offsets
    ``[0, bs]``, seeds ``[0, bs)``, and the scalars of the whole batch. Byte-identical to one
    unbounded fixed-block launch; nothing past index ``bs`` is written.

    ``out_verify_offsets`` needs ``>= bs + 1`` elements; ``write_req_capacity`` is
    ``len(out_write_seed_slot_indices)`` and ``bs`` above it is a ``ValueError``.
    ``chunk_size``: requests per slice, ``None`` = ``PLAN_MAX_CHUNK`` (4096), except that
    ``"auto"`` then picks ``AUTO_PLAN_CHUNK``. Every check runs
    before the first launch; a rejected call writes nothing.

    Preconditions on the data (not read back unless ``validate=True``, which enforces them):
    ``req_pool_indices`` are rows of ``req_to_token``, distinct apart from padding (0), and
    ``prefix_lens[r] <= req_to_token.shape[1]`` wherever a seed is read, and the verify and
    write totals fit in int64 (they are exact up to ``2**63 - 1``). LUT indices need no care:
    they are clamped to the LUT. ``verify_capacity`` must be at most ``2**31 - 1`` (the int32
    ``out_verify_num_valid`` counts no further). ``swa_window_size > 0`` without a LUT applies
    the window and leaves seeds untranslated.
    """
    if torch.compiler.is_compiling():
        # torch.compile sees one opaque custom op (kvcanary_dispatch/ops.py).
        torch.ops.kvcanary_dispatch.plan_offsets(
            req_pool_indices,
            prefix_lens,
            extend_seq_lens,
            req_to_token,
            full_to_swa_index_mapping,
            out_verify_offsets,
            out_write_offsets,
            out_write_seed_slot_indices,
            out_verify_num_valid,
            out_verify_enable,
            out_write_num_valid_reqs,
            swa_window_size,
            verify_capacity,
            chunk_size,
            strategy,
            validate,
        )
        return
    args = dict(
        req_pool_indices=req_pool_indices,
        prefix_lens=prefix_lens,
        extend_seq_lens=extend_seq_lens,
        req_to_token=req_to_token,
        full_to_swa_index_mapping=full_to_swa_index_mapping,
        out_write_offsets=out_write_offsets,
        out_write_seed_slot_indices=out_write_seed_slot_indices,
        out_verify_num_valid=out_verify_num_valid,
        out_verify_enable=out_verify_enable,
        out_write_num_valid_reqs=out_write_num_valid_reqs,
        swa_window_size=swa_window_size,
        verify_capacity=verify_capacity,
    )
    device = out_verify_offsets.device
    with on_device(device):
        _plan(args, out_verify_offsets, chunk_size, strategy, validate, _verify_offsets_name)


def _plan(
    args: dict,
    out_verify_offsets: torch.Tensor,
    chunk_size: int | None,
    strategy: str,
    validate: bool,
    verify_offsets_name: str,
) -> None:
    """``plan_offsets`` on ``out_verify_offsets``' device, made current by the caller."""
    try:
        bs = check_plan_args(
            **args,
            out_verify_offsets_scratch=out_verify_offsets,
            bs_block=None,
            verify_offsets_name=verify_offsets_name,
        )
    except CapacityError as err:
        raise CapacityError(f"{err}; {_CAPACITY_REMEDY}") from None
    chunk = resolve_plan_chunk(chunk_size, strategy)
    device = out_verify_offsets.device
    strategy = resolve_plan_strategy(strategy, bs, chunk)
    if validate:
        refuse_capture(
            device,
            "plan_offsets validate=True reads the inputs back",
            "validate outside capture, or pass validate=False",
        )
        validate_plan_data(
            args["req_pool_indices"],
            args["prefix_lens"],
            args["extend_seq_lens"],
            args["req_to_token"],
        )

    if strategy == "loop":
        _plan_loop(args, out_verify_offsets, bs, chunk)
    elif strategy == "fixed":
        # Checked above for the whole batch; one launch of a block >= bs needs nothing more.
        enqueue_plan_offsets(
            **args, out_verify_offsets_scratch=out_verify_offsets, bs_block=block_for(max(bs, 1))
        )
    else:
        launch = launch_plan_scan if strategy == "scan" else launch_plan_lookback
        launch(
            **args,
            out_verify_offsets=out_verify_offsets,
            chunk=chunk,
            bs_block=block_for(chunk),
            num_warps=_SCAN_WARPS if strategy == "scan" else _LOOKBACK_WARPS,
        )


def _plan_loop(args: dict, out_verify_offsets: torch.Tensor, bs: int, chunk: int) -> None:
    carry = torch.zeros(3, dtype=torch.int64, device=out_verify_offsets.device)
    per_request = ("req_pool_indices", "prefix_lens", "extend_seq_lens")
    block = block_for(chunk)
    for s, e in slice_bounds(bs, chunk) or [(0, 0)]:
        sliced = {k: (v[s:e] if k in per_request else v) for k, v in args.items()}
        sliced["out_write_offsets"] = args["out_write_offsets"][s:]
        sliced["out_write_seed_slot_indices"] = args["out_write_seed_slot_indices"][s:]
        launch_plan_offsets_kernel(
            **sliced,
            out_verify_offsets_scratch=out_verify_offsets[s:],
            bs_block=block,
            carry=carry,
        )


def launch_plan_offsets_kernel_any_bs(
    *,
    req_pool_indices: torch.Tensor,
    prefix_lens: torch.Tensor,
    extend_seq_lens: torch.Tensor,
    req_to_token: torch.Tensor,
    full_to_swa_index_mapping: torch.Tensor | None,
    out_verify_offsets_scratch: torch.Tensor,
    out_write_offsets: torch.Tensor,
    out_write_seed_slot_indices: torch.Tensor,
    out_verify_num_valid: torch.Tensor,
    out_verify_enable: torch.Tensor,
    out_write_num_valid_reqs: torch.Tensor,
    swa_window_size: int,
    verify_capacity: int,
) -> None:
    """Drop-in for upstream's ``launch_plan_offsets_kernel`` (same keywords), with no
    batch-size block cap. ``out_verify_offsets_scratch`` must hold ``bs + 1`` elements (upstream
    allocates 4 097, enough only for ``bs <= 4096``). Like upstream's launcher it accepts
    ``swa_window_size > 0`` without a LUT (the window applies, seeds are not translated)."""
    plan_offsets(
        req_pool_indices=req_pool_indices,
        prefix_lens=prefix_lens,
        extend_seq_lens=extend_seq_lens,
        req_to_token=req_to_token,
        full_to_swa_index_mapping=full_to_swa_index_mapping,
        out_verify_offsets=out_verify_offsets_scratch,
        out_write_offsets=out_write_offsets,
        out_write_seed_slot_indices=out_write_seed_slot_indices,
        out_verify_num_valid=out_verify_num_valid,
        out_verify_enable=out_verify_enable,
        out_write_num_valid_reqs=out_write_num_valid_reqs,
        swa_window_size=swa_window_size,
        verify_capacity=verify_capacity,
        _verify_offsets_name="out_verify_offsets_scratch",
    )
