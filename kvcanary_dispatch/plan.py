"""``plan_offsets`` for any batch size.

Strategies (``strategy=``):

- ``"loop"``: the literal design, one fixed-block launch per slice of ``chunk_size`` requests,
  chained by a 3-element device carry (verify total, write total, requests so far), plus the
  carry's zero fill: ``n_slices + 1`` launches.
- ``"scan"``: two launches whatever ``bs``: per-slice sums, then a scan in which each program
  adds up the slices before it and plans its own slice.
- ``"lookback"``: one launch: each program publishes its slice's sums and adds up those of
  every slice before it, in a small state buffer that the launch leaves as it found it, so
  each device and stream keeps one (``kvcanary_dispatch.resident``); a call captured in a
  CUDA graph, or made under ``torch.compile``, fills a fresh one (one more device op).
- ``"recount"``: one launch and no temporary: each program re-reads and sums the requests
  before its slice, so its cost grows with ``bs`` (for batches of a few thousand requests).
- ``"auto"`` (default): one fixed-block launch when ``bs <= chunk``; ``"recount"`` up to
  ``AUTO_PLAN_RECOUNT_MAX_BS`` (4 096) requests on slices of at least ``AUTO_PLAN_CHUNK`` (256);
  else, eagerly, ``"lookback"`` up to ``AUTO_PLAN_LOOKBACK_MAX_BS`` (1 048 576) requests in at
  most ``AUTO_PLAN_LOOKBACK_SLICES`` (512) slices, and ``"scan"`` above it, for a
  ``chunk_size`` that cuts more slices, and whenever the stream is capturing a CUDA graph. On
  an H200 ``scan`` and ``recount`` are the fastest plans as graph replays at their sizes, or
  tied with the fastest; the eager look-back costs about 70 % of ``scan``'s host time per
  call and 1-12 % more device time (``kvcanary_dispatch.launch_plan`` gives the figures). With
  ``chunk_size=None`` it also picks the slice size from ``bs`` (``AUTO_PLAN_CHUNK``, or
  ``AUTO_PLAN_LARGE_CHUNK`` from ``AUTO_PLAN_LARGE_BS`` requests, or for the eager look-back
  at most ``AUTO_PLAN_LOOKBACK_SLICES`` slices; measured fastest on an H200) rather than the
  largest one.

An eager valid call on the current CUDA device whose plan is one launch (one fixed-block
launch, ``"recount"``, the eager ``"lookback"``) is checked and launched in one pass
(``_launched``); any other call takes the full path, whose ordered checks name what is wrong.
Both make the same launch.

No strategy synchronises with the host (``validate=True`` does: it reads the inputs back, and
is refused during CUDA-graph capture). Launches go to the outputs' device and its current
stream, whatever device is current (``kvcanary_dispatch.placement``); under ``torch.compile``
a call is one custom op (``torch.ops.kvcanary_dispatch.plan_offsets``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from kvcanary_kernels._checks import CapacityError
from kvcanary_kernels._launch import BoundKernel, Head
from kvcanary_kernels.args import (
    PLAN_INPUT_NAMES,
    PLAN_OUTPUT_NAMES,
    SCRATCH_NAME,
    PlanInputs,
    PlanOutputs,
    bundle_plan_args,
    name_a_non_plan_tensor,
    plan_keywords,
    plan_signature,
)
from kvcanary_kernels.plan_checks import _fit_head, check_plan_args, checked_plan_head
from kvcanary_kernels.plan_lookback import (
    bind_plan_lookback,
    launch_plan_lookback,
    lookback_state_words,
    new_lookback_state,
)
from kvcanary_kernels.plan_offsets import bind_plan_offsets, enqueue_plan_offsets
from kvcanary_kernels.plan_recount import bind_plan_recount, launch_plan_recount
from kvcanary_kernels.plan_scan import launch_plan_scan

from .aliasing import plan_outputs_share_memory, refuse_shared_memory
from .launch_plan import (
    AUTO_PLAN_CHUNK,
    AUTO_PLAN_LARGE_BS,
    AUTO_PLAN_LARGE_CHUNK,
    AUTO_PLAN_LOOKBACK_MAX_BS,
    AUTO_PLAN_RECOUNT_MAX_BS,
    PLAN_MAX_CHUNK,
    PLAN_STRATEGIES,
    LaunchPlan,
    plan_offsets_launch_plan,
    resolve_plan_chunk,
    resolve_plan_strategy,
)
from .placement import capturing, device_of, on_device, refuse_capture, refuse_unlaunchable
from .resident import cuda_stream_buffer, discard, stream_buffer
from .slicing import refuse_traced_numpy
from .untraced import PENDING as _UNTRACED_PENDING
from .untraced import eager_only, keep_untraced
from .validation import validate_plan_data

__all__ = [
    "AUTO_PLAN_CHUNK",
    "AUTO_PLAN_LARGE_BS",
    "AUTO_PLAN_LARGE_CHUNK",
    "AUTO_PLAN_LOOKBACK_MAX_BS",
    "AUTO_PLAN_RECOUNT_MAX_BS",
    "PLAN_MAX_CHUNK",
    "PLAN_STRATEGIES",
    "launch_plan_offsets_kernel_any_bs",
    "plan_offsets",
    "resolve_plan_chunk",
    "resolve_plan_strategy",
]

_BUNDLE = tuple.__new__  # PlanInputs / PlanOutputs from all their fields, in order
# {verify}: the verify offsets' keyword (the drop-in's is out_verify_offsets_scratch)
_CAPACITY_REMEDY = (
    "size {verify} and out_write_offsets to >= bs + 1 and "
    "out_write_seed_slot_indices to >= bs elements, "
    "or split the step with kvcanary_dispatch.split_forward_step / ForwardStepGuard"
)


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
) -> None:
    """Plan the whole batch for any ``bs``: verify and write offsets
    ``[0, bs]``, seeds ``[0, bs)``, and the scalars of the whole batch. Byte-identical to one
    unbounded fixed-block launch; nothing past index ``bs`` is written.

    ``out_verify_offsets`` needs ``>= bs + 1`` elements; ``write_req_capacity`` is
    ``len(out_write_seed_slot_indices)`` and ``bs`` above it is a ``ValueError``.
    ``chunk_size``: requests per slice, ``None`` = ``PLAN_MAX_CHUNK`` (4096), except that
    ``"auto"`` then picks ``AUTO_PLAN_CHUNK`` (``AUTO_PLAN_LARGE_CHUNK`` from
    ``bs = AUTO_PLAN_LARGE_BS``; for its eager look-back, the smallest power of two from
    ``AUTO_PLAN_CHUNK`` that makes at most ``AUTO_PLAN_LOOKBACK_SLICES`` slices). No output may
    share memory with an input or another output (a ``ValueError`` names the two). Every check
    runs before the first launch; a rejected call writes nothing.

    Preconditions on the data (not read back unless ``validate=True``, which enforces them):
    ``req_pool_indices`` are rows of ``req_to_token``, distinct apart from padding (0), and
    ``prefix_lens[r] <= req_to_token.shape[1]`` wherever a seed is read, and the verify and
    write totals fit in int64 (they are exact up to ``2**63 - 1``). Data that breaks them gives
    undefined offsets and seeds but no stray read: a seed is read only inside the table, and
    a request whose row or prefix points outside it gets seed -1. LUT indices need no care:
    they are clamped to the LUT. ``verify_capacity`` must be at most ``2**31 - 1`` (the int32
    ``out_verify_num_valid`` counts no further). ``swa_window_size > 0`` without a LUT applies
    the window and leaves seeds untranslated.
    """
    # Every field given, in order: built as tuples (a third of the named constructors' time).
    i = _BUNDLE(
        PlanInputs,
        (
            req_pool_indices,
            prefix_lens,
            extend_seq_lens,
            req_to_token,
            full_to_swa_index_mapping,
            swa_window_size,
            verify_capacity,
        ),
    )
    o = _BUNDLE(
        PlanOutputs,
        (
            out_verify_offsets,
            out_write_offsets,
            out_write_seed_slot_indices,
            out_verify_num_valid,
            out_verify_enable,
            out_write_num_valid_reqs,
        ),
    )
    plan_bundled(i, o, chunk_size, strategy, validate)


def plan_bundled(
    i: PlanInputs,
    o: PlanOutputs,
    chunk_size: int | None = None,
    strategy: str = "auto",
    validate: bool = False,
    verify_offsets_name: str = "out_verify_offsets",
    resident: bool = True,
) -> None:
    """``plan_offsets`` on bundled arguments (``verify_offsets_name``: what messages call
    ``o.out_verify_offsets``). ``resident=False`` plans as a captured call (no buffer kept
    between calls: ``kvcanary_dispatch.resident``), as the ``torch.compile`` op does."""
    if torch.compiler.is_compiling():
        # torch.compile sees one opaque custom op (kvcanary_dispatch/ops.py).
        settings = (("verify_capacity", i.verify_capacity), ("swa_window_size", i.swa_window_size))
        refuse_traced_numpy(settings)
        refuse_traced_numpy((("chunk_size", chunk_size),), "plan_offsets ")
        check_plan_bundled(i, o, chunk_size, strategy, verify_offsets_name, traced=True)
        args = plan_keywords(i, o).values()
        torch.ops.kvcanary_dispatch.plan_offsets(*args, chunk_size, strategy, validate)
        return
    if _UNTRACED_PENDING[0]:  # dynamo loaded since the last call: mark the eager path
        keep_untraced()
    if resident and not validate and _launched(i, o, chunk_size, strategy):
        return
    try:
        with on_device(device_of(o.out_verify_offsets)):
            _plan(i, o, chunk_size, strategy, validate, verify_offsets_name, resident)
    except (AttributeError, TypeError) as err:
        name_a_non_plan_tensor(err, i, o, verify_offsets_name)
        raise


def check_plan_bundled(
    i: PlanInputs,
    o: PlanOutputs,
    chunk_size: int | None = None,
    strategy: str = "auto",
    verify_offsets_name: str = "out_verify_offsets",
    traced: bool = False,
) -> None:
    """Every argument check ``plan_bundled`` makes before its first launch (``validate=False``),
    raising what it would raise, and nothing else: no launch, nothing written. For a caller
    that must refuse a call before it changes its own state. ``traced``: the same checks, in
    the same order, on the tensors ``torch.compile`` traces, their metadata only (no launch
    head, whose addresses they lack; no launch plan, whose sizes would specialise the trace):
    else the op's integer arguments would take a tensor or a bool as a number, and the op's
    own checks, when it runs, would name the drop-in's scratch ``out_verify_offsets``."""
    try:
        if traced:
            _checked_head(i, o, verify_offsets_name, check=_check_args)
            check_plan_settings(chunk_size, strategy)
            return
        with on_device(device_of(o.out_verify_offsets)):
            _checked_head(i, o, verify_offsets_name)
            plan_offsets_launch_plan(i.bs, chunk_size, strategy)
    except (AttributeError, TypeError) as err:
        name_a_non_plan_tensor(err, i, o, verify_offsets_name)
        raise


def check_plan_settings(chunk_size: int | None, strategy: str) -> None:
    """``plan_offsets``' checks of its ``chunk_size`` and ``strategy``, which no size changes,
    raising its errors."""
    resolve_plan_chunk(chunk_size, strategy)
    resolve_plan_strategy(strategy, 0, 1)


def _check_args(i: PlanInputs, o: PlanOutputs, verify_offsets_name: str) -> None:
    """What ``checked_plan_head`` checks, with no head built: ``check_plan_args``, no block
    cap."""
    check_plan_args(i, o, bs_block=None, verify_offsets_name=verify_offsets_name)


@eager_only
def _launched(i: PlanInputs, o: PlanOutputs, chunk_size: int | None, strategy: str) -> bool:
    """The one pass of an eager call that ``_plan`` would accept and run as one launch
    (``fixed``, ``recount``, the eager ``lookback``) on the current CUDA device: checked and
    its launch ``Head`` built by ``_fit_head``, the launch looked up by sizes
    (``_one_launch``), then made with the addresses the head read. Returns ``False``, having
    launched nothing, for any other call (another device, a ``loop`` or ``scan`` plan, a
    stream capturing a CUDA graph where the plan differs, anything ``_fit_head`` leaves to
    the ordered checks): the full path then runs it. Nothing here raises but the launch."""
    out = o.out_verify_offsets
    head = _fit_head(i, o)
    if head is None or not out.is_cuda or head.device != torch.cuda.current_device():
        return False
    if plan_outputs_share_memory(i, o, head):
        return False
    bs, lut_len = head.sizes[0], head.sizes[4]  # as plan_head_sizes
    try:
        one = _one_launch(bs, chunk_size, strategy, lut_len > 0)
        row_stride, (rows, width) = i.req_to_token.stride(0), i.req_to_token.shape
    except (TypeError, ValueError, RuntimeError):  # a bad chunk_size or strategy, no strides
        return False
    if one is None:
        return False
    bound, grid, chunk, state_words, by_capture = one
    # out is on the current device: its stream's capture state is the current stream's.
    if by_capture and torch.cuda.is_current_stream_capturing():
        return False
    lead = (row_stride, rows, width, lut_len, bs)  # plan_kernel_scalars, then bs
    tail, stream = (i.swa_window_size, i.verify_capacity), None
    if chunk is None:  # fixed: the verify offsets stand in for the carry
        ints, extra = (*lead, *tail), (out,)
    else:
        ints, extra = (*lead, chunk, *tail), ()
        if state_words:  # the look-back: the stream's resident state
            state, stream = cuda_stream_buffer(_STATE, head.device, state_words, _state_maker(out))
            extra = (state,)
    addresses = (*head.handed, *[t.data_ptr() for t in extra])
    try:
        bound.checked(grid, head.device, (*head.args, *extra), addresses, ints, stream)
    except BaseException:  # as run_plan_offsets_plan: a look-back state may be left part-way
        if state_words:
            discard(_STATE, out.device)
        raise
    return True


_BINDERS = {  # the one-launch plans' kernels, by LaunchPlan strategy
    "fixed": bind_plan_offsets,
    "recount": bind_plan_recount,
    "lookback": bind_plan_lookback,
}


@functools.lru_cache(maxsize=4096, typed=True)
def _one_launch(
    bs: int, chunk_size: int | None, strategy: str, has_lut: bool
) -> tuple[BoundKernel, tuple[int, ...], int | None, int, bool] | None:
    """The eager plan's one launch: (bound kernel, grid, ``chunk`` (``None`` for ``fixed``),
    look-back state words (0: none), whether the plan differs on a capturing stream);
    ``None`` when the plan is not one launch of ``_BINDERS``' kernels. Raises the plan's
    errors."""
    plan = plan_offsets_launch_plan(bs, chunk_size, strategy)
    bind = _BINDERS.get(plan.strategy)
    if bind is None:
        return None
    (launch,) = plan.launches
    keywords = dict(launch.kwargs)
    chunk = keywords.pop("chunk", None)
    words = lookback_state_words(launch.grid[0]) if plan.strategy == "lookback" else 0
    bound = bind(has_lut=has_lut, **keywords)
    return bound, launch.grid, chunk, words, plan.by_capture


@eager_only
def _plan(
    i: PlanInputs,
    o: PlanOutputs,
    chunk_size: int | None,
    strategy: str,
    validate: bool,
    verify_offsets_name: str,
    resident: bool = True,
) -> None:
    """``plan_offsets`` on the outputs' device, made current by the caller: every check, then
    the call's ``LaunchPlan`` (the captured one while the stream captures, or without
    ``resident``), then its launches."""
    head = _checked_head(i, o, verify_offsets_name)
    bs = i.bs
    plan = plan_offsets_launch_plan(bs, chunk_size, strategy)
    if plan.by_capture and (not resident or capturing(o.out_verify_offsets.device)):
        plan = plan_offsets_launch_plan(bs, chunk_size, strategy, capturing=True)
    if validate:
        refuse_capture(
            o.out_verify_offsets.device,
            "plan_offsets validate=True reads the inputs back",
            "validate outside capture, or pass validate=False",
        )
        validate_plan_data(
            i.req_pool_indices, i.prefix_lens, i.extend_seq_lens, i.req_to_token, i.swa_window_size
        )
    run_plan_offsets_plan(plan, i, o, head)


def _checked_head(
    i: PlanInputs,
    o: PlanOutputs,
    verify_offsets_name: str,
    check: Callable[[PlanInputs, PlanOutputs, str], Head | None] = checked_plan_head,
) -> Head | None:
    """``check`` (``checked_plan_head``, or ``_check_args`` on traced tensors), a capacity error
    completed with its remedy; then meta tensors refused."""
    # Raised past the handler and from its message: dynamo (torch 2.11) cannot trace a raise
    # ``from None`` of this class, and formats an error it traces as its repr.
    try:
        head, completed = check(i, o, verify_offsets_name), None
    except CapacityError as err:
        completed = f"{err.args[0]}; {_CAPACITY_REMEDY.format(verify=verify_offsets_name)}"
    if completed is not None:
        raise CapacityError(completed)
    refuse_unlaunchable(o.out_verify_offsets.device, f"plan_offsets {verify_offsets_name}")
    if head is not None and plan_outputs_share_memory(i, o, head):
        refuse_shared_memory(
            "plan_offsets",
            tuple(zip(o, (verify_offsets_name, *PLAN_OUTPUT_NAMES[1:]), strict=True)),
            tuple(zip(i[:5], PLAN_INPUT_NAMES, strict=True)),
        )
    return head


def run_plan_offsets_plan(
    plan: LaunchPlan, i: PlanInputs, o: PlanOutputs, head: Head | None = None
) -> None:
    """Make ``plan``'s launches on checked arguments (``head``: their ``checked_plan_head``,
    if the caller has it)."""
    if plan.strategy == "loop":
        carry = torch.zeros(3, dtype=torch.int64, device=o.out_verify_offsets.device)
        for launch in plan.launches:
            s, e = launch.requests
            enqueue_plan_offsets(i.requests(s, e), o.from_request(s), carry=carry, **launch.kwargs)
        return
    (launch,) = plan.launches
    if plan.strategy == "fixed":
        # Checked above for the whole batch; one launch of a block >= bs needs nothing more.
        enqueue_plan_offsets(i, o, head=head, **launch.kwargs)
    elif plan.strategy == "lookback" and not plan.capturing:  # captured: a fresh state
        out, words = o.out_verify_offsets, lookback_state_words(launch.grid[0])
        state = stream_buffer(_STATE, out.device, words, _state_maker(out))
        try:
            run = _LAUNCHERS[launch.launcher]
            run(i, o, grid=launch.grid, state=state, head=head, **launch.kwargs)
        except BaseException:  # it may have stopped part-way (the CPU interpreter)
            discard(_STATE, out.device)
            raise
    else:
        _LAUNCHERS[launch.launcher](i, o, grid=launch.grid, head=head, **launch.kwargs)


_STATE = "plan_lookback"  # the resident buffer's name


def _state_maker(like: torch.Tensor):
    return lambda words: new_lookback_state(like, words)


_LAUNCHERS = {  # the multi-slice launchers, by LaunchPlan launcher name
    "plan_scan": launch_plan_scan,
    "plan_lookback": launch_plan_lookback,
    "plan_recount": launch_plan_recount,
}


def launch_plan_offsets_kernel_any_bs(**keywords: torch.Tensor | int | None) -> None:
    """Drop-in for upstream's ``launch_plan_offsets_kernel`` (its 13 keywords, the verify
    offsets output named ``out_verify_offsets_scratch``), with no batch-size block cap.
    ``out_verify_offsets_scratch`` must hold ``bs + 1`` elements (upstream allocates 4 097,
    enough only for ``bs <= 4096``). Like upstream's launcher it accepts
    ``swa_window_size > 0`` without a LUT (the window applies, seeds are not translated)."""
    i, o = bundle_plan_args(keywords, SCRATCH_NAME)
    plan_bundled(i, o, verify_offsets_name=SCRATCH_NAME)


launch_plan_offsets_kernel_any_bs.__signature__ = plan_signature(SCRATCH_NAME)
