"""A toy serving loop around sglang's real ``SingleForwardManager`` (test side).

The manager, its canary buffers, endpoints and device state are sglang's own classes; only the
scheduler around them is ours: requests live on rows of a ``req_to_token`` table, every step
(an extend of some tokens per request) takes fresh KV slots, builds a ForwardBatch-shaped
object, calls the manager's hooks in sglang's order (``pre_ops_outside_graph``,
``pre_ops_maybe_inside_graph``, the "model forward" that writes the step's KV bytes,
``post_ops_maybe_inside_graph``), and reads sglang's violation log. ``post_ops_outside_graph``
is not called on the CPU: it only ticks sglang's overflow warner, whose device-to-host copy
needs pinned memory, which a CPU-only torch cannot allocate.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

SLOT_BYTES = 32  # CANARY_SLOT_BYTES: four int64 fields
KV_BYTES = 16  # real KV bytes per slot, folded into the tail canary's real_kv_hash


class FakeMode:
    """The forward-mode queries sglang's kv-canary code asks (extend or decode)."""

    def __init__(self, decode: bool) -> None:
        self._decode = decode

    def is_decode_or_idle(self) -> bool:
        return self._decode

    def is_decode(self) -> bool:
        return self._decode

    def is_target_verify(self) -> bool:
        return False

    def is_draft_extend_v2(self) -> bool:
        return False

    def is_extend(self) -> bool:
        return not self._decode


class NoPinTorch:
    """``torch`` for sglang's expected-token scatter on a CPU-only machine: the same module
    with ``pin_memory=`` dropped (a CPU-only torch has no pinned allocator)."""

    def __getattr__(self, name: str):
        fn = getattr(torch, name)
        if name in ("zeros", "empty", "tensor", "full"):

            def no_pin(*args, **kwargs):
                kwargs.pop("pin_memory", None)
                return fn(*args, **kwargs)

            return no_pin
        return fn


class ToyEngine:
    """Requests on rows ``1..n`` of ``req_to_token``, KV slots handed out in order from 1."""

    def __init__(
        self,
        kv,
        *,
        n_requests: int,
        max_context_len: int,
        write_req_capacity: int,
        write_entry_capacity: int,
        verify_capacity: int,
        seed: int = 0,
    ) -> None:
        self.kv = kv
        self.gen = torch.Generator().manual_seed(seed)
        self.rows = n_requests + 1
        self.num_slots = n_requests * max_context_len + 1
        self.req_to_token = torch.zeros(self.rows, max_context_len, dtype=torch.int32)
        self.real_kv = torch.zeros(self.num_slots, KV_BYTES, dtype=torch.uint8)
        self.tokens: list[list[int]] = [[] for _ in range(self.rows)]
        self.next_slot = 1
        consts = kv.consts
        config = kv.config.CanaryConfig(
            mode=kv.config.CanaryMode.LOG,
            ring_capacity=1024,
            sweep_interval=0,
            real_kv_hash_mode=consts.RealKvHashMode.ALL,
            enable_write_input_assert=False,
            enable_verify_token_assert=True,
            stats_print_every_n_steps=0,
        )
        self.state = kv.state.CanaryDeviceState.allocate(
            config=config,
            device=torch.device("cpu"),
            num_tags=len(kv.verify.CanaryLaunchTag),
            req_to_token_alloc_size=self.rows,
            max_context_len=max_context_len,
        )
        self.state.req_to_verify_expected_tokens.fill_(-7)
        source = kv.verify.RealKvSource(
            tensor=self.real_kv, page_size=1, num_bytes_per_token=KV_BYTES, read_bytes=KV_BYTES
        )
        group = kv.buffer_group.CanaryBufferGroup(
            kind=kv.buffer_group.PoolKind.FULL,
            k_head=torch.zeros(self.num_slots, SLOT_BYTES, dtype=torch.uint8),
            k_tail=torch.zeros(self.num_slots, SLOT_BYTES, dtype=torch.uint8),
            v_head=None,
            v_tail=None,
            real_kv_sources_k=(source,),
            real_kv_sources_v=(),
            swa_index_lut=None,
            kv_token_id_vs_position_offset=0,
        )
        endpoints = kv.endpoint.build_endpoints_from_group(group=group, device_state=self.state)
        self.manager = kv.manager.SingleForwardManager(
            config=config,
            device=torch.device("cpu"),
            device_state=self.state,
            buffer_groups=(group,),
            endpoints=endpoints,
            req_to_token_pool=SimpleNamespace(req_to_token=self.req_to_token),
            swa_window_size=0,
            per_forward_verify_capacity=verify_capacity,
            per_forward_write_req_capacity=write_req_capacity,
            per_forward_write_entry_capacity=write_entry_capacity,
            d2h_stream=None,
            token_oracle_manager=None,
            swa_divergence_report=None,
            is_eagle_draft_decode=False,
        )

    def batch(self, rows: list[int], extend: int, decode: bool) -> SimpleNamespace:
        """Take slots for ``extend`` new tokens of each request and build its ForwardBatch."""
        positions, input_ids, out_loc, prefix_lens = [], [], [], []
        for row in rows:
            prefix = len(self.tokens[row])
            prefix_lens.append(prefix)
            new = torch.randint(0, 32_000, (extend,), generator=self.gen).tolist()
            for j in range(extend):
                self.req_to_token[row, prefix + j] = self.next_slot
                out_loc.append(self.next_slot)
                self.next_slot += 1
                positions.append(prefix + j)
            input_ids.extend(new)
            self.tokens[row].extend(new)
        snapshot = [t for row in rows for t in self.tokens[row]]
        return SimpleNamespace(
            batch_size=len(rows),
            req_pool_indices=torch.tensor(rows, dtype=torch.int64),
            positions=torch.tensor(positions, dtype=torch.int64),
            input_ids=torch.tensor(input_ids, dtype=torch.int64),
            out_cache_loc=torch.tensor(out_loc, dtype=torch.int64),
            extend_prefix_lens=torch.tensor(prefix_lens, dtype=torch.int64),
            extend_seq_lens=torch.full((len(rows),), extend, dtype=torch.int64),
            seq_lens=torch.tensor(prefix_lens, dtype=torch.int64) + extend,
            forward_mode=FakeMode(decode),
            spec_info=None,
            req_all_ids_flat=torch.tensor(snapshot, dtype=torch.int64),
            req_all_ids_lens=torch.tensor([len(self.tokens[r]) for r in rows]),
        )

    def run(self, batch: SimpleNamespace) -> object:
        """One forward step through the manager's hooks; returns what the inside pre-op gave."""
        m = self.manager
        m.pre_ops_outside_graph(maybe_inaccurate_forward_batch=batch)
        out = m.pre_ops_maybe_inside_graph(batch)
        kv_bytes = torch.randint(
            0, 256, (batch.out_cache_loc.numel(), KV_BYTES), generator=self.gen
        )
        self.real_kv[batch.out_cache_loc] = kv_bytes.to(torch.uint8)  # the model's KV write
        m.post_ops_maybe_inside_graph(batch, out)
        return out

    def step(self, rows: list[int], extend: int = 1, decode: bool = True) -> object:
        return self.run(self.batch(rows, extend, decode))

    def violations(self) -> list[dict]:
        """sglang's violation log, as dicts of (kind, slot, position, tokens, reason bits)."""
        consts = self.kv.consts
        log = self.state.violation_log
        n = min(int(log.violation_write_index[0]), int(log.violation_ring.shape[0]))
        out = []
        for row in log.violation_ring[:n].tolist():
            out.append(
                dict(
                    kind=row[consts.VIOLATION_FIELD_KERNEL_KIND],
                    slot=row[consts.VIOLATION_FIELD_SLOT_IDX],
                    position=row[consts.VIOLATION_FIELD_POSITION],
                    stored_token=row[consts.VIOLATION_FIELD_STORED_TOKEN],
                    expected_token=row[consts.VIOLATION_FIELD_EXPECTED_TOKEN],
                    bits=row[consts.VIOLATION_FIELD_FAIL_REASON_BITS],
                )
            )
        return out

    def kernel_runs(self) -> int:
        return int(self.state.kernel_run_counters.sum())

    def slot(self, row: int, position: int) -> int:
        return int(self.req_to_token[row, position])


def toy_engine(kv, n: int, *, req_cap: int, entry_cap: int, context: int = 12) -> ToyEngine:
    """A ``ToyEngine`` of ``n`` requests of up to ``context`` tokens whose manager holds
    ``req_cap`` requests and ``entry_cap`` tokens a step, and every verify entry."""
    return ToyEngine(
        kv,
        n_requests=n,
        max_context_len=context,
        write_req_capacity=req_cap,
        write_entry_capacity=entry_cap,
        verify_capacity=n * context,
    )
