"""sglang's scatter at every binding, patched: equal to sglang's own Triton kernel within its
cap, and to sglang's torch reference beyond it (through the manager module's binding and
through ``populate_req_to_expected_token_ids`` itself)."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch
from _sglang_cases import POISON32, make_scatter_case
from _sglang_engine import NoPinTorch

from kvcanary_dispatch.integrations import sglang as integration

pytest_plugins = ["_sglang_fixtures"]  # the kv fixture, and a clean patch state per test


def _clone(case: SimpleNamespace) -> SimpleNamespace:
    return SimpleNamespace(**{k: v.clone() for k, v in vars(case).items()})


@pytest.mark.parametrize("bs", [1, 7, 300, 511])
def test_within_cap_patched_equals_unpatched_byte_for_byte(kv, bs):
    case = make_scatter_case(bs, seed=bs)
    unpatched = _clone(case)
    kv.scatter.launch_scatter_req_token_ids_kernel(**vars(unpatched))
    patched = _clone(case)
    with integration.applied():
        kv.expected_mgr.launch_scatter_req_token_ids_kernel(**vars(patched))
    assert torch.equal(patched.pool_out, unpatched.pool_out)
    untouched = torch.ones(patched.pool_out.shape[0], dtype=torch.bool)
    untouched[case.req_pool_indices] = False
    assert (patched.pool_out[untouched] == POISON32).all(), "rows no request owns changed"


@pytest.mark.parametrize("bs", [512, 513, 4097, 20000])
def test_beyond_cap_equals_sglangs_torch_reference(kv, bs):
    case = make_scatter_case(bs, seed=bs, max_len=3)
    want = _clone(case)
    kv.scatter_ref.scatter_req_token_ids_torch_reference(**vars(want))
    with integration.applied():
        for binding in (kv.scatter, kv.expected_mgr):
            got = _clone(case)
            binding.launch_scatter_req_token_ids_kernel(**vars(got))
            assert torch.equal(got.pool_out, want.pool_out), binding.__name__
    assert (want.pool_out != POISON32).any()


def test_populate_expected_token_ids_at_bs_beyond_the_cap(kv, monkeypatch):
    """sglang's own caller of the scatter, with a ForwardBatch-shaped snapshot of 700 requests."""
    if not torch.cuda.is_available():
        monkeypatch.setattr(kv.expected_mgr, "torch", NoPinTorch())
    gen = torch.Generator().manual_seed(5)
    bs, width = 700, 9
    lens = torch.randint(0, width + 3, (bs,), generator=gen)
    flat = torch.randint(0, 100_000, (int(lens.sum()),), generator=gen)
    rows = torch.randperm(bs, generator=gen) + 1
    batch = SimpleNamespace(req_all_ids_flat=flat, req_all_ids_lens=lens, req_pool_indices=rows)
    pool = torch.full((bs + 1, width), POISON32, dtype=torch.int32)
    with pytest.raises(ValueError, match="exceeds BATCH_BLOCK=512"):
        kv.expected_mgr.populate_req_to_expected_token_ids(
            forward_batch=batch, req_to_verify_expected_tokens=pool.clone()
        )
    got = pool.clone()
    with integration.applied():
        kv.expected_mgr.populate_req_to_expected_token_ids(
            forward_batch=batch, req_to_verify_expected_tokens=got
        )
    want = pool.clone()
    offsets = torch.zeros(bs + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(lens, 0)
    kv.scatter_ref.scatter_req_token_ids_torch_reference(
        flat_in=flat, offsets=offsets, req_pool_indices=rows, pool_out=want
    )
    assert torch.equal(got, want)
    assert (got[0] == POISON32).all(), "the padding row is untouched"


def test_calls_while_another_thread_applies_and_reverts_give_sglangs_bytes(kv):
    """An engine thread calls sglang's scatter binding (looked up each call) while another
    applies, reverts and opens ``applied`` blocks: every call, whichever function it found,
    gives sglang's bytes, none raises, and the binding ends as sglang's own."""
    case = make_scatter_case(40, seed=3)
    want = _clone(case)
    kv.scatter.launch_scatter_req_token_ids_kernel(**vars(want))
    original = kv.expected_mgr.launch_scatter_req_token_ids_kernel
    stop, errors, calls = threading.Event(), [], [0]

    def engine() -> None:
        while not stop.is_set() or calls[0] == 0:
            got = _clone(case)
            try:
                kv.expected_mgr.launch_scatter_req_token_ids_kernel(**vars(got))
                if not torch.equal(got.pool_out, want.pool_out):
                    errors.append(f"call {calls[0]}: other bytes")
            except Exception as err:  # noqa: BLE001 (every failure is the finding)
                errors.append(f"call {calls[0]}: {err!r}")
            calls[0] += 1

    thread = threading.Thread(target=engine)
    thread.start()
    try:
        for _ in range(60):
            integration.apply(policy="skip")
            integration.revert()
            with integration.applied("grow"):
                pass
    finally:
        stop.set()
        thread.join()
    assert not errors, errors[:3]
    assert kv.expected_mgr.launch_scatter_req_token_ids_kernel is original
    assert not integration.is_applied() and calls[0] > 0
