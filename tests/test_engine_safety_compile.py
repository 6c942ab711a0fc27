"""Engine-safety regression tests, item 8 (items 1 to 4 are in ``test_engine_safety.py``, 5 to 7
in ``test_engine_safety_api.py``); all run on the CPU (``aot_eager``) and on a GPU (inductor).

8. ``torch.compile(fullgraph=True)`` over both functions, over the scatter at ``capped``'s
   tails-first shape, and over a step whose batch size changes (one compile for all sizes); a
   call eager refuses is refused compiled too, and the calls after a refusal stay exact.
"""

from __future__ import annotations

import pytest
import torch
from _helpers import as_kernel_kwargs, expect_auto_tails_first, long_runs_case, rejected
from conftest import DEVICE, GPU
from test_engine_safety import plan_case, scatter_case
from torch._dynamo.testing import CompileCounterWithBackend

import kvcanary_dispatch as kd
from kvcanary_dispatch import (
    CapacityError,
    plan_offsets,
)
from kvcanary_dispatch.testing.engine_steps import (
    expect_plan,
    expect_scatter,
)
from kvcanary_dispatch.testing.launches import record_launches

I32_MAX, I64_MAX = 2**31 - 1, 2**63 - 1
BACKEND = "inductor" if GPU else "aot_eager"  # torch.compile's backend in these tests


# ---------------------------------------------------------------- 8. torch.compile


@pytest.mark.parametrize(
    "strategy,plan_strategy", [("auto", "auto"), ("sliced", "lookback"), ("loop", "scan")]
)
def test_item8_compile_fullgraph(strategy, plan_strategy):
    torch._dynamo.reset()
    s_case, p_case = scatter_case(300), plan_case(300)
    chunk = 64 if strategy == "sliced" else None

    def step(flat_in, offsets, rpi, pool_out, outs):
        scatter = dict(flat_in=flat_in, offsets=offsets, req_pool_indices=rpi, pool_out=pool_out)
        kd.scatter_req_token_ids(**scatter, strategy=strategy, chunk_size=chunk)
        plan_offsets(**p_case.inputs(), **outs, strategy=plan_strategy)

    compiled = torch.compile(step, fullgraph=True, backend=BACKEND)
    pool, outs = s_case.fresh_pool(), p_case.fresh_outputs()
    compiled(s_case.flat_in, s_case.offsets, s_case.req_pool_indices, pool, outs)
    expect_scatter(s_case, pool, "compiled")
    expect_plan(p_case, outs, "compiled")


@pytest.mark.parametrize(
    "strategy,chunk,plan_strategy,plan_chunk",
    [("sliced", 64, "scan", 64), ("segments", None, "lookback", 128), ("loop", 100, "recount", 64)],
)
def test_item8_compiled_calls_keep_their_strategy_and_chunk_size(
    strategy, chunk, plan_strategy, plan_chunk
):
    """The compiled step launches what the eager one does, with the strategy and chunk size it
    was given (every strategy writes the same bytes, so only the launches show a setting
    dropped on the way through the custom ops)."""
    s_case, p_case = scatter_case(300), plan_case(300)

    def step(pool_out, outs):
        kd.scatter_req_token_ids(**s_case.kwargs(pool_out), strategy=strategy, chunk_size=chunk)
        plan_offsets(**p_case.inputs(), **outs, strategy=plan_strategy, chunk_size=plan_chunk)

    def launched(fn) -> list[tuple]:
        pool, outs = s_case.fresh_pool(), p_case.fresh_outputs()
        with record_launches() as launches:
            fn(pool, outs)
        expect_scatter(s_case, pool, "compiled")
        expect_plan(p_case, outs, "compiled")
        return [(la.kind, la.plan.requested, la.plan.chunk) for la in launches]

    torch._dynamo.reset()
    eager = launched(step)
    assert {(requested, c) for _, requested, c in eager} == {
        (strategy, chunk),
        (plan_strategy, plan_chunk),
    }
    assert launched(torch.compile(step, fullgraph=True, backend=BACKEND)) == eager


def test_item8_compile_tails_first_shape():
    """The compiled scatter at ``auto``'s tails-first ``capped`` shape (4 head steps, tail
    programs first), called on three batches of the same shapes with the long run moved (first
    in one, so that the first tail program has work): each result equals the reference on a
    poisoned pool."""
    torch._dynamo.reset()
    cases = [long_runs_case(s, at=at, device=DEVICE) for s, at in ((0, 0), (1, None), (2, None))]
    expect_auto_tails_first(cases[0])
    compiled = torch.compile(kd.scatter_req_token_ids, fullgraph=True, backend=BACKEND)
    for i, case in enumerate(cases):
        pool = case.fresh_pool()
        compiled(**case.kwargs(pool))
        expect_scatter(case, pool, f"compiled, batch {i}")


COMPILE_REFUSALS = {  # name: (function, keywords in place of the case's, error, text)
    "plan verify_capacity tensor": (
        "plan", {"verify_capacity": torch.tensor(5)}, TypeError,
        "kv-canary: verify_capacity must be a Python number, got a tensor; pass int(",
    ),
    "plan verify_capacity bool": (
        "plan", {"verify_capacity": True}, TypeError,
        "kv-canary: verify_capacity must be an int, got True (bool)",
    ),
    "plan verify_capacity float": (
        "plan", {"verify_capacity": 5.0}, TypeError,
        "kv-canary: verify_capacity must be an int, got 5.0 (float)",
    ),
    "plan window past int64": (
        "plan", {"swa_window_size": 2**63}, ValueError,
        "kv-canary: swa_window_size=9223372036854775808 exceeds 9223372036854775807",
    ),
    "plan chunk bool": (
        "plan", {"chunk_size": True}, TypeError,
        "kv-canary: plan_offsets chunk_size must be an int or None, got True",
    ),
    "plan past capacity": (
        "plan", {"out_verify_offsets": torch.zeros(4, dtype=torch.int64),
                 "out_write_offsets": torch.zeros(4, dtype=torch.int64),
                 "out_write_seed_slot_indices": torch.zeros(3, dtype=torch.int64)}, CapacityError,
        "kv-canary: bs=6 exceeds write_req_capacity=3; size out_verify_offsets and",
    ),
    "drop-in past capacity": (
        "drop-in", {"out_verify_offsets_scratch": torch.zeros(7, dtype=torch.int64),
                    "out_write_offsets": torch.zeros(4, dtype=torch.int64),
                    "out_write_seed_slot_indices": torch.zeros(3, dtype=torch.int64)},
        CapacityError,
        "kv-canary: bs=6 exceeds write_req_capacity=3; size out_verify_offsets_scratch and",
    ),
    "drop-in scratch short": (
        "drop-in", {"out_verify_offsets_scratch": torch.zeros(5, dtype=torch.int64)}, ValueError,
        "kv-canary: out_verify_offsets_scratch length must be >= 7",
    ),
    "scatter chunk tensor": (
        "scatter", {"chunk_size": torch.tensor(3)}, TypeError,
        "kv-canary: scatter_req_token_ids chunk_size must be an int or None, got a tensor",
    ),
    "scatter chunk bool": (
        "scatter", {"chunk_size": True}, TypeError,
        "kv-canary: scatter_req_token_ids chunk_size must be an int or None, got True",
    ),
    "scatter strategy": (
        "scatter", {"strategy": "nope"}, ValueError,
        "kv-canary: scatter_req_token_ids strategy='nope' is not one of",
    ),
}  # fmt: skip


@pytest.mark.parametrize("fullgraph", [False, True])
@pytest.mark.parametrize("name", COMPILE_REFUSALS)
def test_item8_compile_refuses_what_eager_refuses(name, fullgraph):
    """Compiled, a call eager refuses is refused with eager's text, nothing written: the op's
    integer arguments (SymInt) would take a tensor or a bool as a number, a float or an int
    past int64 would fail in torch's fake call, and the op's own checks would name the
    drop-in's scratch ``out_verify_offsets``. With ``fullgraph=True`` torch raises its own
    error for an exception met while tracing, which carries eager's text."""
    function, over, error, text = COMPILE_REFUSALS[name]
    if function == "scatter":
        case = scatter_case(6, seed=3)
        pool = case.fresh_pool()
        kw, outputs, fn = {**case.kwargs(pool), **over}, [pool], kd.scatter_req_token_ids
    else:
        case = plan_case(6)
        outs = case.fresh_outputs()
        kw, fn = {**case.inputs(), **outs, **over}, plan_offsets
        if function == "drop-in":
            kw = as_kernel_kwargs(kw)
            kw = {**kw, **over, "full_to_swa_index_mapping": None}
            fn = kd.launch_plan_offsets_kernel
        kw = {k: v.to(DEVICE) if isinstance(v, torch.Tensor) and v.dim() else v
              for k, v in kw.items()}  # fmt: skip
        outputs = [v for k, v in kw.items() if k.startswith("out_")]
    eager = rejected(error, lambda: fn(**kw), outputs)
    assert eager.startswith(text), eager
    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=fullgraph, backend=BACKEND)
    msg = rejected(RuntimeError if fullgraph else error, lambda: compiled(**kw), outputs)
    assert (text in msg) if fullgraph else msg == eager, msg


def test_item8_compile_overlapping_pool_refused():
    """Compiled, a pool whose rows share memory is refused too, nothing launched and the memory
    under it untouched: by torch (its mutated-input check sees the overlap first) or by the
    dispatcher's own check."""
    torch._dynamo.reset()
    case = scatter_case(40, seed=21)
    base = case.fresh_pool()
    pool = base[:1].expand(base.shape)
    compiled = torch.compile(kd.scatter_req_token_ids, fullgraph=True, backend=BACKEND)
    msg = rejected((RuntimeError, ValueError), lambda: compiled(**case.kwargs(pool)), [base])
    assert (
        "more than one element of the written-to tensor refers to a single memory location" in msg
        or "pool_out rows overlap in memory" in msg
    ), msg


def test_item8_compile_pool_sharing_flat_in_refused():
    """Compiled, a pool that shares memory with ``flat_in`` (a view of one dtype over the
    other's) is refused, nothing launched and the pool untouched: by torch, which cannot
    functionalize a mutated input viewed at another dtype, before the op runs."""
    case = scatter_case(40, seed=22)
    pool = case.fresh_pool()
    shared = pool.view(-1)[: 2 * case.flat_in.numel()].view(torch.int64)
    kw = {**case.kwargs(pool), "flat_in": shared}
    eager = rejected(ValueError, lambda: kd.scatter_req_token_ids(**kw), [pool])
    assert "pool_out shares memory with flat_in" in eager, eager
    torch._dynamo.reset()
    compiled = torch.compile(kd.scatter_req_token_ids, fullgraph=True, backend=BACKEND)
    msg = rejected(Exception, lambda: compiled(**kw), [pool])
    assert "input mutations on views with different dtypes" in msg or eager in msg, msg


@pytest.mark.parametrize("function", ["plan", "scatter"])
def test_item8_compile_validate_reads_the_data_as_eager_does(function):
    """``validate=True`` compiled (``fullgraph=True``): the op reads the data back when it runs,
    as the eager call does, so two writing requests on one row are refused with the eager
    message, nothing written."""
    torch._dynamo.reset()
    if function == "plan":
        case = plan_case(8)
        kw = {**case.inputs(), **case.fresh_outputs()}
        rpi = kw["req_pool_indices"].clone()
        rpi[:2] = 1  # two active requests (row 0 is padding) on one row
        fn, kw = plan_offsets, {**kw, "req_pool_indices": rpi}
        outputs = [kw[n] for n in case.fresh_outputs()]
    else:
        case = scatter_case(8)
        pool = case.fresh_pool()
        kw = case.kwargs(pool)
        offsets = torch.arange(9, dtype=torch.int64, device=DEVICE)  # every run one token
        rpi = kw["req_pool_indices"].clone()
        rpi[1] = rpi[0]
        fn = kd.scatter_req_token_ids
        kw = {**kw, "flat_in": kw["flat_in"].new_zeros(8), "offsets": offsets}
        kw["req_pool_indices"] = rpi
        outputs = [pool]
    eager = rejected(ValueError, lambda: fn(**kw, validate=True), outputs)
    assert "distinct" in eager or "own row" in eager, eager
    compiled = torch.compile(fn, fullgraph=True, backend=BACKEND)
    msg = rejected(Exception, lambda: compiled(**kw, validate=True), outputs)
    assert eager in msg, msg


@pytest.mark.parametrize("function", ["plan", "scatter"])
def test_item8_calls_after_a_refusal_met_while_tracing_stay_exact(function):
    """With ``fullgraph=False`` a call refused while traced leaves its step to dynamo's eager
    fallback from then on (dynamo's rule for an exception met while tracing), in which dynamo
    would compile the library's eager path frame by frame, and fail (torch 2.11 on an H100:
    ``InternalTorchDynamoError`` from FX's code generation; on the CPU: the interpreter). The
    eager path is marked to run untraced (``kvcanary_dispatch.untraced``), so the step's later
    calls, at the refused call's neighbours' sizes, equal the references, with no
    ``torch._dynamo.reset()``."""
    torch._dynamo.reset()
    if function == "plan":

        def step(p_in, outs):
            plan_offsets(**p_in, **outs)

        small = plan_case(300).fresh_outputs()  # 300 requests' outputs, for 700 requests
        with pytest.raises(CapacityError, match=r"^kv-canary: bs=700 exceeds write_req_capacity"):
            torch.compile(step, backend=BACKEND)(plan_case(700).inputs(), small)
    else:

        def step(case, pool, strategy):
            kd.scatter_req_token_ids(**case.kwargs(pool), strategy=strategy)

        case = scatter_case(300)
        with pytest.raises(ValueError, match=r"strategy='nope' is not one of"):
            torch.compile(step, backend=BACKEND)(case, case.fresh_pool(), "nope")
    compiled = torch.compile(step, backend=BACKEND)  # the same code: dynamo keeps its verdict
    for bs in (300, 500, 300):
        if function == "plan":
            case = plan_case(bs)
            outs = case.fresh_outputs()
            compiled(case.inputs(), outs)
            expect_plan(case, outs, f"bs {bs} after the refusal")
        else:
            case = scatter_case(bs)
            pool = case.fresh_pool()
            compiled(case, pool, "auto")
            expect_scatter(case, pool, f"bs {bs} after the refusal")


@pytest.fixture
def no_duck_sizing():
    """Sizes that happen to be equal in one batch are not tied together (duck sizing), so that
    such a coincidence cannot add a compile. Through torch's own config patch, which restores
    the setting after the test (a plain ``monkeypatch.setattr`` deleted it from torch's config
    on undo, and every later compile then failed)."""
    with torch.fx.experimental._config.patch(use_duck_shape=False):
        yield


@pytest.mark.parametrize("dynamic,compiles", [(True, 1), (None, 2)])
@pytest.mark.usefixtures("no_duck_sizing")
def test_item8_compile_once_for_every_batch_size(dynamic, compiles):
    """A compiled step called at four batch sizes, with the plan's ``verify_capacity`` the
    length of a verify buffer (as an engine's step passes it): sizes and scalars stay symbolic
    through the custom ops, so ``dynamic=True`` compiles once and automatic dynamic shapes
    twice (static first), not once per size; each call's outputs equal the references."""
    torch._dynamo.reset()

    def step(flat_in, offsets, rpi, pool_out, p_in, outs, verify_buffer):
        scatter = dict(flat_in=flat_in, offsets=offsets, req_pool_indices=rpi, pool_out=pool_out)
        kd.scatter_req_token_ids(**scatter)
        plan_offsets(**{**p_in, "verify_capacity": verify_buffer.shape[0]}, **outs)

    counter = CompileCounterWithBackend(BACKEND)
    compiled = torch.compile(step, fullgraph=True, dynamic=dynamic, backend=counter)
    for bs in (300, 700, 1500, 2999):
        s_case, p_case = scatter_case(bs), plan_case(bs)
        pool, outs = s_case.fresh_pool(), p_case.fresh_outputs()
        verify_buffer = torch.empty(p_case.verify_capacity, dtype=torch.int64, device=DEVICE)
        args = (s_case.flat_in, s_case.offsets, s_case.req_pool_indices, pool)
        compiled(*args, p_case.inputs(), outs, verify_buffer)
        expect_scatter(s_case, pool, f"compiled, bs {bs}")
        expect_plan(p_case, outs, f"compiled, bs {bs}")
    assert counter.frame_count == compiles


@pytest.mark.usefixtures("no_duck_sizing")
def test_item8_compile_once_for_every_chunk_size():
    """``chunk_size`` taken from a tensor's length stays symbolic too: three slice sizes, one
    compile under ``dynamic=True``, each call's outputs equal the references."""
    torch._dynamo.reset()
    s_case, p_case = scatter_case(700), plan_case(700)

    def step(flat_in, offsets, rpi, pool_out, outs, chunk):
        scatter = dict(flat_in=flat_in, offsets=offsets, req_pool_indices=rpi, pool_out=pool_out)
        kd.scatter_req_token_ids(**scatter, chunk_size=chunk.shape[0])
        plan_offsets(**p_case.inputs(), **outs, chunk_size=chunk.shape[0])

    counter = CompileCounterWithBackend(BACKEND)
    compiled = torch.compile(step, fullgraph=True, dynamic=True, backend=counter)
    for chunk in (64, 100, 256):
        pool, outs = s_case.fresh_pool(), p_case.fresh_outputs()
        args = (s_case.flat_in, s_case.offsets, s_case.req_pool_indices, pool, outs)
        compiled(*args, torch.empty(chunk, device=DEVICE))
        expect_scatter(s_case, pool, f"compiled, chunk {chunk}")
        expect_plan(p_case, outs, f"compiled, chunk {chunk}")
    assert counter.frame_count == 1
