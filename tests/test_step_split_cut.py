"""Where a step that does not fit is cut, and what its sub-steps hold: the greedy cut that
``split_forward_step`` documents, checked against a plain request-by-request statement of it,
and sub-steps that are views of the caller's lengths where no request is cut and copies where
one is (the caller's tensors never written). Coverage, budgets and chained plans:
``test_step_split.py``."""

from __future__ import annotations

from functools import partial
from itertools import accumulate, product

import torch
from _helpers import random_step
from conftest import DEVICE
from hypothesis import given
from hypothesis import strategies as st
from test_step_split import capacities_for, requests

from kvcanary_dispatch.capacities import CanaryCapacities
from kvcanary_dispatch.forward_step import split_forward_step
from kvcanary_dispatch.step_split import _cut

make_step = partial(random_step, device=DEVICE)
Cut = tuple[int, int, int, int, int]  # req_start, req_stop, first_done, token_start, token_stop


def _cuts(subs: list) -> list[Cut]:
    """Each sub-step's ``Cut``."""
    return [(s.req_start, s.req_stop, s.first_done, s.token_start, s.token_stop) for s in subs]


def greedy_cut(tokens: list[int], req_cap: int, token_cap: int) -> list[Cut]:
    """The cut as ``split_forward_step`` states it, one request at a time: a request of at
    most ``token_cap`` tokens joins the open sub-step while both budgets hold, else opens the
    next; a longer one fills what the open sub-step has left (if it has room for a request
    and a token), then whole sub-steps, its last piece opening the next sub-step."""
    out: list[Cut] = []
    open_: list[int] | None = None  # req_start, req_stop, first_done, token_start, token_stop
    count = 0  # requests (or pieces) in the open sub-step

    def close() -> None:
        nonlocal open_
        if open_ is not None:
            out.append(tuple(open_))
        open_ = None

    flat = 0
    for r, n in enumerate(tokens):
        used = 0 if open_ is None else open_[4] - open_[3]
        room = open_ is not None and count < req_cap
        if n <= token_cap:
            if room and used + n <= token_cap:
                open_[1], open_[4], count = r + 1, open_[4] + n, count + 1
            else:
                close()
                open_, count = [r, r + 1, 0, flat, flat + n], 1
        else:
            done = 0
            if room and used < token_cap:
                done = token_cap - used
                open_[1], open_[4] = r + 1, open_[4] + done
            close()
            while n - done > token_cap:
                out.append((r, r + 1, done, flat + done, flat + done + token_cap))
                done += token_cap
            open_, count = [r, r + 1, done, flat + done, flat + n], 1
        flat += n
    close()
    return out


def test_cut_is_greedy_on_every_small_step():
    """Every step of up to 5 requests of -1 to 7 tokens, under every request budget 1-3 and
    token budget 1-4 it does not fit."""
    for bs in range(6):
        for lens in product([-1, 0, 1, 2, 3, 5, 7], repeat=bs):
            tokens = [max(n, 0) for n in lens]
            bounds = list(accumulate(tokens, initial=0))
            for req_cap, token_cap in product(range(1, 4), range(1, 5)):
                if bs <= req_cap and bounds[-1] <= token_cap:
                    continue  # fits: never cut
                got = _cut(bounds, req_cap, token_cap)
                assert got == greedy_cut(tokens, req_cap, token_cap), (lens, req_cap, token_cap)


@given(
    st.lists(requests(), min_size=1, max_size=60).flatmap(
        lambda reqs: st.tuples(
            st.just(reqs),
            capacities_for(len(reqs), sum(max(x, 0) for _, x, _ in reqs), max_subs=12),
        )
    )
)
def test_split_forward_step_cuts_greedily(drawn):
    reqs, caps = drawn
    step = make_step(reqs)
    if caps.fits(len(reqs), sum(step.tokens)):
        return  # one sub-step, the step itself: test_step_split.py
    subs = split_forward_step(**step.lengths(), capacities=caps)
    want = greedy_cut(step.tokens, caps.write_req_capacity, caps.write_entry_capacity)
    assert _cuts(subs) == want


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def test_sub_steps_are_views_unless_they_hold_a_cut_request():
    """Requests 0-1 fit whole, request 2 (9 tokens, budget 4) is cut in three, request 3
    joins its last piece: the first sub-step's lengths are views of the caller's, the three
    holding a piece are copies, and every sub-step's pool rows are views (a piece keeps its
    row). The caller's tensors are left as they were."""
    rpi = torch.tensor([1, 2, 3, 4])
    prefix = torch.tensor([0, 5, 2, 1])
    extend = torch.tensor([2, 2, 9, 1])
    before = [t.clone() for t in (rpi, prefix, extend)]
    subs = split_forward_step(
        req_pool_indices=rpi,
        prefix_lens=prefix,
        extend_seq_lens=extend,
        capacities=CanaryCapacities(2, 4, 0),
    )
    assert _cuts(subs) == [(0, 2, 0, 0, 4), (2, 3, 0, 4, 8), (2, 3, 4, 8, 12), (2, 4, 8, 12, 14)]
    caller = {_storage(prefix), _storage(extend)}
    shares = [{_storage(s.prefix_lens), _storage(s.extend_seq_lens)} <= caller for s in subs]
    assert shares == [True, False, False, False]
    assert all(_storage(s.req_pool_indices) == _storage(rpi) for s in subs)
    assert [s.extend_seq_lens.tolist() for s in subs] == [[2, 2], [4], [4], [1, 1]]
    assert [s.prefix_lens.tolist() for s in subs] == [[0, 5], [2], [6], [10, 1]]
    for t, kept in zip((rpi, prefix, extend), before, strict=True):
        assert torch.equal(t, kept)
