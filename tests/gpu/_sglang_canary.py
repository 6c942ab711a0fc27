"""The whole kv canary on one device and, in lockstep, with sglang's torch references on the
CPU: plan (patched ``launch_canary_plan_kernels``) -> verify -> the model's KV write -> write,
step after step, compared byte for byte. Used by tests/gpu/sglang_cuda.py (sglang's CUDA write
and verify kernels) and, through it, by the CPU smoke test (their torch references).

The driver is ours; every canary function it calls is sglang's own (``kv`` holds the modules).
"""

from __future__ import annotations

import torch
from _sglang_cases import POISON32, assert_plans_identical, poisoned_plans

KV_BYTES = 16


class CanaryRun:
    """``n`` requests on rows ``1..n``; KV slots handed out from 1; one canary buffer whose
    real-KV fingerprint covers ``real_kv``. ``step`` runs one forward step on ``device`` and on
    the CPU reference side and checks that both agree."""

    def __init__(self, kv, *, n: int, context: int, device: str, seed: int = 0) -> None:
        self.kv, self.n, self.context, self.device = kv, n, context, torch.device(device)
        self.gen = torch.Generator().manual_seed(seed)
        rows, slots = n + 1, n * context + 1
        self.next_slot = 1
        self.length = torch.zeros(rows, dtype=torch.int64)
        self.tokens = torch.zeros(rows, context, dtype=torch.int64)
        host = dict(
            req_to_token=torch.zeros(rows, context, dtype=torch.int32),
            real_kv=torch.zeros(slots, KV_BYTES, dtype=torch.uint8),
            canary=torch.zeros(slots, kv.verify.CANARY_SLOT_BYTES, dtype=torch.uint8),
            expected=torch.full((rows, context), POISON32, dtype=torch.int32),
        )
        self.ref = {k: v.clone() for k, v in host.items()}
        self.dev = {k: v.to(self.device) for k, v in host.items()}
        log = kv.helpers.FakeViolationLog.allocate
        self.ref_log = log(capacity=256, device=torch.device("cpu"))
        self.dev_log = log(capacity=256, device=self.device)
        for lg in (self.ref_log, self.dev_log):
            lg.enable_chain_position_assert.fill_(1)

    def _context(self, side: dict, log):
        v = self.kv.verify
        source = v.RealKvSource(
            tensor=side["real_kv"], page_size=1, num_bytes_per_token=KV_BYTES, read_bytes=KV_BYTES
        )
        return v.VerifyOrWriteContext(
            canary_buf=side["canary"],
            kernel_kind=v.CanaryLaunchTag.TAIL_K_FULL,
            violation_ring=log.ring,
            violation_write_index=log.write_index,
            slot_run_counter=log.slot_run_counter,
            kernel_run_counter=log.kernel_run_counter,
            real_kv_sources=(source,),
            real_kv_hash_mode=self.kv.consts.RealKvHashMode.ALL,
            enable_chain_position_assert=log.enable_chain_position_assert,
        )

    def _new_tokens(self, rows: torch.Tensor, extend: torch.Tensor) -> dict:
        bs, total = int(rows.numel()), int(extend.sum())
        offsets = torch.zeros(bs + 1, dtype=torch.int64)
        offsets[1:] = torch.cumsum(extend, 0)
        owner = torch.repeat_interleave(torch.arange(bs), extend)
        prefix = self.length[rows]
        pos = prefix[owner] + torch.arange(total) - offsets[owner]
        slots = torch.arange(self.next_slot, self.next_slot + total)
        self.next_slot += total
        ids = torch.randint(0, 32_000, (total,), generator=self.gen)
        self.tokens[rows[owner], pos] = ids
        self.length[rows] += extend
        for side in (self.ref, self.dev):
            side["req_to_token"][
                rows[owner].to(side["req_to_token"].device), pos.to(side["req_to_token"].device)
            ] = slots.to(torch.int32).to(side["req_to_token"].device)
        lens = self.length[rows]
        mask = torch.arange(self.context)[None, :] < lens[:, None]
        snap_off = torch.zeros(bs + 1, dtype=torch.int64)
        snap_off[1:] = torch.cumsum(lens, 0)
        return dict(
            prefix=prefix,
            pos=pos,
            slots=slots,
            ids=ids,
            flat=self.tokens[rows][mask],
            snap_off=snap_off,
            lens=lens,
        )

    def slot(self, row: int, position: int) -> int:
        return int(self.ref["req_to_token"][row, position])

    def step(self, rows: torch.Tensor, extend: torch.Tensor, corrupt=None) -> list[tuple]:
        """One step for ``rows`` (each extended by ``extend`` tokens). ``corrupt`` may hold
        ``kv=(row, pos)`` (flip a KV byte before the step) and ``token=(row, pos)`` (a wrong
        expected token in the step's snapshot). Returns the device's new violations as sorted
        ``(slot, position, reason bits, expected token)``; raises on any device/ref mismatch."""
        kv, corrupt = self.kv, corrupt or {}
        new = self._new_tokens(rows, extend)
        if "kv" in corrupt:
            s = self.slot(*corrupt["kv"])
            for side in (self.ref, self.dev):
                side["real_kv"][s, 3] ^= 0x10
        flat = new["flat"].clone()
        if "token" in corrupt:
            row, pos = corrupt["token"]
            flat[int(new["snap_off"][int((rows == row).nonzero())]) + pos] += 1
        before = int(self.ref_log.write_index[0])
        # The expected-token snapshot: sglang's scatter (patched) vs its torch reference.
        kv.scatter.launch_scatter_req_token_ids_kernel(
            flat_in=flat.to(self.device),
            offsets=new["snap_off"].to(self.device),
            req_pool_indices=rows.to(self.device),
            pool_out=self.dev["expected"],
        )
        kv.scatter_ref.scatter_req_token_ids_torch_reference(
            flat_in=flat,
            offsets=new["snap_off"],
            req_pool_indices=rows,
            pool_out=self.ref["expected"],
        )
        assert torch.equal(self.dev["expected"].cpu(), self.ref["expected"]), "expected-token pool"
        plans = {}
        for name, side, fn, device in (
            ("dev", self.dev, kv.api.launch_canary_plan_kernels, self.device),
            (
                "ref",
                self.ref,
                kv.plan_ref.launch_canary_plan_kernels_torch_reference,
                torch.device("cpu"),
            ),
        ):
            verify, write = poisoned_plans(
                kv,
                verify_capacity=self.n * self.context,
                write_req_capacity=int(rows.numel()),
                device=device,
            )
            fn(
                verify_plan_out=verify,
                write_plan_out=write,
                req_pool_indices=rows.to(device),
                prefix_lens=new["prefix"].to(device),
                extend_seq_lens=extend.to(device),
                req_to_token=side["req_to_token"],
                swa_window_size=0,
                full_to_swa_index_mapping=None,
                verify_capacity=self.n * self.context,
                req_to_verify_expected_tokens=side["expected"],
                req_to_verify_expected_tokens_valid_lens=new["lens"].to(device),
                kv_token_id_vs_position_offset=0,
            )
            plans[name] = (verify, write)
        assert_plans_identical(plans["dev"][0], plans["ref"][0], "verify plan")
        assert_plans_identical(plans["dev"][1], plans["ref"][1], "write plan")
        ctx_dev = self._context(self.dev, self.dev_log)
        ctx_ref = self._context(self.ref, self.ref_log)
        kv.verify.launch_canary_verify_kernel(
            context=ctx_dev, plan=plans["dev"][0], check_verify_expected_token=True
        )
        kv.verify_ref.launch_canary_verify_kernel_torch_reference(
            context=ctx_ref, plan=plans["ref"][0], check_verify_expected_token=True
        )
        kv_bytes = torch.randint(0, 256, (new["slots"].numel(), KV_BYTES), generator=self.gen).to(
            torch.uint8
        )
        self.ref["real_kv"][new["slots"]] = kv_bytes  # the model's KV write
        self.dev["real_kv"][new["slots"].to(self.device)] = kv_bytes.to(self.device)
        args = dict(positions=new["pos"], input_ids=new["ids"], out_cache_loc=new["slots"])
        no_assert = dict(
            enable_write_input_assert=False,
            expected_input_tokens=None,
            expected_input_positions=None,
        )
        dev_args = {k: v.to(self.device) for k, v in args.items()}
        kv.write.launch_canary_write_kernel(
            context=ctx_dev, plan=plans["dev"][1], **no_assert, **dev_args
        )
        kv.write_ref.launch_canary_write_kernel_torch_reference(
            context=ctx_ref, plan=plans["ref"][1], **no_assert, **args
        )
        assert torch.equal(self.dev["canary"].cpu(), self.ref["canary"]), "canary buffers differ"
        for field in ("write_index", "slot_run_counter", "kernel_run_counter"):
            assert torch.equal(getattr(self.dev_log, field).cpu(), getattr(self.ref_log, field)), (
                field
            )
        return self._new_violations(before)

    def _new_violations(self, before: int) -> list[tuple]:
        c = self.kv.consts
        after = min(int(self.ref_log.write_index[0]), self.ref_log.ring.shape[0])
        keys = (
            c.VIOLATION_FIELD_SLOT_IDX,
            c.VIOLATION_FIELD_POSITION,
            c.VIOLATION_FIELD_FAIL_REASON_BITS,
            c.VIOLATION_FIELD_EXPECTED_TOKEN,
        )
        rows = {}
        for name, log in (("dev", self.dev_log), ("ref", self.ref_log)):
            rows[name] = sorted(
                tuple(r[k] for k in keys) for r in log.ring[before:after].cpu().tolist()
            )
        assert rows["dev"] == rows["ref"], (
            f"violations differ: {rows['dev'][:4]} vs {rows['ref'][:4]}"
        )
        return rows["dev"]
