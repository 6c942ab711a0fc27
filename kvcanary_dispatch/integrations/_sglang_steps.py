"""Capacity policies for sglang's per-forward kv-canary step manager.

sglang 0.5.23's ``SingleForwardManager.pre_ops_outside_graph`` raises a ``RuntimeError`` when a
step has more requests than ``_write_req_capacity`` or more tokens than
``_write_entry_capacity``, and ``pre_ops_maybe_inside_graph`` allocates the step's plan buffers
(``VerifyPlan``, ``WritePlan``, ``ExpectedInputs``, ``PlanInput``) from those two numbers on every
call (a captured CUDA graph keeps the buffers of its capture). The replacements built here put
a policy where the raise was:

- ``"grow"``: raise each capacity the step outgrows (at least doubled) before the step,
  outside any capture; the step's buffers are then allocated at the new size and the canary
  runs whole. If the sglang hook the growth was made for then raises, the growth is given
  back (one that hook kept stays if a later hook refuses the step); ``revert()``
  gives every manager its capacities from before its first growth (``restore_capacities``).
- ``"skip"``: run no canary kernel for that step (no plan, write or verify); count and log it.
- ``"raise"``: sglang's own behaviour, unchanged, against the manager's capacities as they are
  (a manager grown under ``"grow"`` keeps them until ``revert()``).

Nothing of sglang is imported here: its manager module is handed in by the integration.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import asdict, dataclass
from types import ModuleType
from typing import Any

import torch

from ..capacities import grown_capacity

POLICIES = ("grow", "skip", "raise")
LOG = logging.getLogger("kvcanary_dispatch.integrations.sglang")
_SKIP_LOG_INTERVAL_S = 60.0


@dataclass
class CanaryCoverage:
    """What the capacity policy did, for users and monitoring. Read it with
    ``kvcanary_dispatch.integrations.sglang.coverage()``; ``snapshot()`` gives a dict.

    - ``grown_steps``: growths made (``"grow"``): each step hook that found its batch past the
      capacities and raised them (a step whose inside-graph batch outgrows what its outside
      hook grew to counts twice);
    - ``write_req_capacity`` / ``write_entry_capacity``: the largest capacities a manager held
      after a growth, each of the two whether or not that growth raised it (a step that
      outgrows the tokens only leaves the request capacity as it was, and reports it); 0 until
      a growth;
    - ``skipped_steps``, ``skipped_requests``, ``skipped_tokens``: steps the canary did not run
      for (``"skip"``), and their requests and tokens: coverage lost.
    """

    grown_steps: int = 0
    write_req_capacity: int = 0
    write_entry_capacity: int = 0
    skipped_steps: int = 0
    skipped_requests: int = 0
    skipped_tokens: int = 0

    def snapshot(self) -> dict[str, int]:
        """The counters as a plain dict (a copy)."""
        with _LOCK:
            return asdict(self)

    def reset(self) -> None:
        """Set every counter back to 0; the next skip is logged at once, in full, as the
        first one was."""
        with _LOCK:
            for name in asdict(self):
                setattr(self, name, 0)
        _SKIP_LOG.rearm()


# The lock, the counters and the growth record are kept when importlib.reload runs this module
# again: the wrappers an earlier run made, the integration's coverage() and revert() share them.
_LOCK = globals().get("_LOCK", threading.Lock())
COVERAGE = globals().get("COVERAGE", CanaryCoverage())


class _SkipLog:
    """The first skip is logged at once with what it costs; later ones at most once a minute."""

    def __init__(self) -> None:
        self._last = None

    def rearm(self) -> None:
        """Log the next skip as the first one."""
        self._last = None

    def note(self, bs: int, tokens: int, req_cap: int, entry_cap: int) -> None:
        now = time.monotonic()
        if self._last is not None and now - self._last < _SKIP_LOG_INTERVAL_S:
            return
        first = self._last is None
        self._last = now
        snap = COVERAGE.snapshot()
        LOG.warning(
            "kv-canary (kvcanary-dispatch policy 'skip'): no canary for a step of %d requests "
            "and %d tokens (capacities %d requests, %d tokens); %d steps, %d requests, %d "
            "tokens skipped so far.%s",
            bs,
            tokens,
            req_cap,
            entry_cap,
            snap["skipped_steps"],
            snap["skipped_requests"],
            snap["skipped_tokens"],
            (
                " The skipped tokens get no canary entries, so later verifies of these "
                "requests can report violations at those positions; policy 'grow' keeps "
                "coverage whole"
                if first
                else ""
            ),
        )


_SKIP_LOG = _SkipLog()


class SkippedForward:
    """What the patched ``pre_ops_maybe_inside_graph`` returns for a skipped step; the patched
    ``post_ops_maybe_inside_graph`` recognises it and launches nothing."""

    __slots__ = ("bs", "tokens")

    def __init__(self, bs: int, tokens: int) -> None:
        self.bs = bs
        self.tokens = tokens


def _fits(manager: Any, bs: int, tokens: int) -> bool:
    return bs <= manager._write_req_capacity and tokens <= manager._write_entry_capacity


def _capturing(device: Any) -> bool:
    device = torch.device(device)
    if device.type != "cuda":
        return False
    with torch.cuda.device(device):
        return torch.cuda.is_current_stream_capturing()


# Each grown manager's capacities from before its first growth, for ``restore_capacities``.
_BEFORE_GROWTH: weakref.WeakKeyDictionary[Any, tuple[int, int]] = globals().get(
    "_BEFORE_GROWTH", weakref.WeakKeyDictionary()
)


def restore_capacities() -> int:
    """Give every manager grown under ``"grow"`` the two capacities it had before its first
    growth (sglang's own, so steps above them raise as upstream); returns how many."""
    with _LOCK:
        grown = list(_BEFORE_GROWTH.items())
        _BEFORE_GROWTH.clear()
    for manager, (req, entry) in grown:
        manager._write_req_capacity, manager._write_entry_capacity = req, entry
    return len(grown)


def _grow(manager: Any, bs: int, tokens: int) -> Callable[[], None]:
    """Grow ``manager`` for the step; returns what undoes it (the capacities and counters)."""
    old_req, old_entry = manager._write_req_capacity, manager._write_entry_capacity
    new_req, new_entry = grown_capacity(old_req, bs), grown_capacity(old_entry, tokens)
    with _LOCK:
        first = manager not in _BEFORE_GROWTH
        if first:  # recorded before anything changes: a manager it fails on is left as it was
            _BEFORE_GROWTH[manager] = (old_req, old_entry)
        manager._write_req_capacity = new_req
        manager._write_entry_capacity = new_entry
        largest = COVERAGE.write_req_capacity, COVERAGE.write_entry_capacity
        COVERAGE.grown_steps += 1
        COVERAGE.write_req_capacity = max(largest[0], new_req)
        COVERAGE.write_entry_capacity = max(largest[1], new_entry)
        grown_to = COVERAGE.write_req_capacity, COVERAGE.write_entry_capacity

    def undo() -> None:
        manager._write_req_capacity, manager._write_entry_capacity = old_req, old_entry
        with _LOCK:
            if first:
                _BEFORE_GROWTH.pop(manager, None)
            COVERAGE.grown_steps -= 1
            if (COVERAGE.write_req_capacity, COVERAGE.write_entry_capacity) == grown_to:
                COVERAGE.write_req_capacity, COVERAGE.write_entry_capacity = largest

    LOG.warning(
        "kv-canary (kvcanary-dispatch policy 'grow'): a step of %d requests and %d tokens "
        "outgrew the canary's per-step capacities; write_req_capacity %d -> %d, "
        "write_entry_capacity %d -> %d (step buffers are allocated per eager step; captured "
        "CUDA graphs keep theirs)",
        bs,
        tokens,
        old_req,
        new_req,
        old_entry,
        new_entry,
    )
    return undo


def _grown_call(manager: Any, bs: int, tokens: int, call: Callable[[], Any]) -> Any:
    """Grow ``manager``, then ``call()`` sglang's hook; if it raises, the growth is undone."""
    undo = _grow(manager, bs, tokens)
    try:
        return call()
    except BaseException:
        undo()
        raise


def make_manager_methods(
    manager_mod: ModuleType, originals: dict[str, Callable], policy: Callable[[], str]
) -> dict[str, Callable]:
    """Replacements for ``SingleForwardManager``'s three step methods.

    ``originals`` maps each method name to sglang's function; ``policy()`` returns the policy in
    force at call time. A step that fits, and every step under ``"raise"``, runs sglang's own
    method unchanged. Sizes come from the host (``batch_size``, ``positions.shape[0]``,
    ``req_pool_indices.shape[0]``): no sync. During CUDA-graph capture nothing is grown or
    skipped (sglang never captures a batch above its capacities; if one did, its own error
    stands, since a skip or a growth would be baked into the graph).
    """
    phases = manager_mod._SingleForwardPhase
    pre_out = originals["pre_ops_outside_graph"]
    pre_in = originals["pre_ops_maybe_inside_graph"]
    post_in = originals["post_ops_maybe_inside_graph"]

    def pre_ops_outside_graph(self: Any, *, maybe_inaccurate_forward_batch: Any) -> None:
        batch = maybe_inaccurate_forward_batch
        bs = int(batch.batch_size)
        tokens = int(batch.positions.shape[0])
        mode = policy()
        if mode == "raise" or _fits(self, bs, tokens):
            return pre_out(self, maybe_inaccurate_forward_batch=batch)
        if mode == "grow":
            return _grown_call(
                self, bs, tokens, lambda: pre_out(self, maybe_inaccurate_forward_batch=batch)
            )
        # "skip": the outside work (phase step, expected-token scatter) does not depend on the
        # capacities; run it with the check satisfied, then restore them. The inside hook
        # decides on the step's accurate batch whether the canary kernels are skipped.
        saved = self._write_req_capacity, self._write_entry_capacity
        self._write_req_capacity, self._write_entry_capacity = (
            max(saved[0], bs),
            max(saved[1], tokens),
        )
        try:
            return pre_out(self, maybe_inaccurate_forward_batch=batch)
        finally:
            self._write_req_capacity, self._write_entry_capacity = saved

    def pre_ops_maybe_inside_graph(self: Any, forward_batch: Any) -> Any:
        bs = int(forward_batch.req_pool_indices.shape[0])
        tokens = int(forward_batch.positions.shape[0])
        mode = policy()
        if mode == "raise" or _fits(self, bs, tokens) or _capturing(self._device):
            return pre_in(self, forward_batch)
        if mode == "grow":
            return _grown_call(self, bs, tokens, lambda: pre_in(self, forward_batch))
        with _LOCK:
            COVERAGE.skipped_steps += 1
            COVERAGE.skipped_requests += bs
            COVERAGE.skipped_tokens += tokens
        _SKIP_LOG.note(bs, tokens, self._write_req_capacity, self._write_entry_capacity)
        self._phase_checker.update(
            expect_phase=phases.AFTER_PRE_OUT,
            next_phase=phases.AFTER_PRE_MAYBE_IN,
            caller_name="SingleForwardManager.pre_ops_maybe_inside_graph",
        )
        return SkippedForward(bs, tokens)

    def post_ops_maybe_inside_graph(self: Any, forward_batch: Any, pre_ops_output: Any) -> None:
        if not isinstance(pre_ops_output, SkippedForward):
            return post_in(self, forward_batch, pre_ops_output)
        self._phase_checker.update(
            expect_phase=phases.AFTER_PRE_MAYBE_IN,
            next_phase=phases.AFTER_POST_MAYBE_IN,
            caller_name="SingleForwardManager.post_ops_maybe_inside_graph",
        )
        # No verify ran, so none overflowed: keep sglang's overflow warner quiet (the skip is
        # counted and logged above).
        self._output_buffer.verify_plan_enable.fill_(1)
        return None

    made = {
        "pre_ops_outside_graph": pre_ops_outside_graph,
        "pre_ops_maybe_inside_graph": pre_ops_maybe_inside_graph,
        "post_ops_maybe_inside_graph": post_ops_maybe_inside_graph,
    }
    for name, fn in made.items():
        fn.__qualname__ = f"SingleForwardManager.{name}"
        fn.__doc__ = (
            f"kvcanary-dispatch's capacity-policy wrapper of sglang's {name} "
            "(see kvcanary_dispatch.integrations.sglang)."
        )
    return made
