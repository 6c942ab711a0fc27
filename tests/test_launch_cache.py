"""Launches through the cached compiled kernel (``kvcanary_kernels._launch``).

On the CPU (Triton's interpreter) ``launch`` always goes through ``kernel[grid]``; the key is
checked there. On a GPU a repeated shape skips ``JITFunction.run``, and a call whose tensors
or integers specialise differently (an unaligned view, an integer past int32) must not reuse
another specialisation's binary: every such call is compared byte for byte with the
reference.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from _helpers import random_plan_lens
from conftest import DEVICE, GPU, gpu

import kvcanary_kernels._launch as fast
from kvcanary_dispatch import plan_offsets, scatter_req_token_ids
from kvcanary_dispatch.testing.cases import (
    check_plan,
    check_scatter,
    make_plan_case,
    make_scatter_case,
)
from kvcanary_kernels.args import (
    PLAN_INPUT_NAMES,
    PLAN_OUTPUT_NAMES,
    ScatterArgs,
    bundle_plan_args,
    plan_kernel_head,
)
from kvcanary_kernels.plan_checks import _fit_head
from kvcanary_kernels.scatter_rows import _scatter_rows_kernel, launch_scatter_rows

SCATTER_STRATEGIES = ("rows", "capped", "flat", "segments", "sliced", "loop")


def key(*args, device=0, **meta):
    return fast.specialization_key(_scatter_rows_kernel, device, args, meta)


def test_key_tells_apart_what_triton_specialises_on():
    base = torch.zeros(64, dtype=torch.int64)
    aligned, unaligned = base[2:10], base[1:9]  # 16 and 8 bytes past an aligned start
    assert base.data_ptr() % 16 == 0
    assert key(aligned) == key(base[4:12])
    assert key(aligned) != key(unaligned)
    assert key(aligned) != key(aligned.to(torch.int32))
    assert key(5) == key(7)
    assert len({key(1), key(2), key(16), key(2**31), key(2**31 + 1), key(2**63)}) == 6
    assert key(2) == key(2**31 - 1)  # int32, not 1, not a multiple of 16
    assert key(32) == key(2**20)  # both divisible by 16, both int32
    assert key(-(2**31)) != key(-(2**31) - 1)
    assert key(None) != key(0)
    assert key(1) != key(True) and key(0) != key(False)  # an int's entry is never a bool's
    assert key(aligned, COLS=1024) != key(aligned, COLS=512)
    assert key(aligned, COLS=1024) != key(aligned, COLS=1024, num_warps=8)
    assert key(aligned, device=0) != key(aligned, device=1)


def test_equal_keys_mean_equal_triton_specialisation():
    """Against the installed Triton's own per-argument specialisation: wherever two arguments
    share a key, Triton specialises them alike (the key may only be finer)."""
    jit = pytest.importorskip("triton.runtime.jit")
    spec = getattr(jit, "native_specialize_impl", None)
    if spec is None:
        pytest.skip("this Triton has no native_specialize_impl")
    from triton.backends.compiler import BaseBackend

    base = torch.zeros(64, dtype=torch.int64)
    values = [base[2:10], base[1:9], base[4:12], base[3:9].to(torch.int32), base.to(torch.int32)]
    values += [0, 1, 2, 15, 16, 17, 2**31 - 16, 2**31 - 1, 2**31, 2**31 + 1, -(2**31)]
    values += [-(2**31) - 1, -16, 2**63 - 1, 2**63, 2**64 - 1, None, True, False]

    def triton_spec(arg):
        return spec(BaseBackend, arg, False, True, True)  # not const, specialised, aligned

    pairs = [(a, b) for a in values for b in values if type(a) is type(b) and key(a) == key(b)]
    assert len(pairs) > len(values)  # some distinct values share a key
    for a, b in pairs:
        assert triton_spec(a) == triton_spec(b), (a, b)


def test_bound_kernels_one_per_kernel_and_meta():
    """A launcher's bound kernel is built once per distinct block parameters, told apart by
    type (Triton compiles ``True`` and ``1`` apart), with every name given a value."""
    bound = fast.binder(_scatter_rows_kernel, "COLS", "num_warps")
    assert bound(1024, 4) is bound(1024, 4)
    assert bound(1024, 4).meta == {"COLS": 1024, "num_warps": 4}
    assert bound(1024, 4).kernel is _scatter_rows_kernel
    # With two or more values an untyped cache would hand back bound(1, 4) for (True, 4).
    assert bound(True, 4) is not bound(1, 4) and bound(True, 4).meta["COLS"] is True
    with pytest.raises(ValueError):
        bound(1024)  # two names, one value


@pytest.mark.skipif(GPU, reason="the interpreter path")
def test_interpreter_calls_never_cache():
    fast._COMPILED.clear()
    check_scatter(scatter_req_token_ids, make_scatter_case([3, 0, 5], width=8, seed=1))
    assert fast._COMPILED == {}


def _count_runs(monkeypatch) -> list[int]:
    """Count ``JITFunction.run`` calls (Triton's own per-call path) from now on."""
    from triton.runtime.jit import JITFunction

    calls = [0]
    real = JITFunction.run

    def counted(self, *args, **kwargs):
        calls[0] += 1
        return real(self, *args, **kwargs)

    monkeypatch.setattr(JITFunction, "run", counted)
    return calls


@gpu
@pytest.mark.parametrize("strategy", SCATTER_STRATEGIES)
def test_repeated_shape_skips_triton_run_and_stays_exact(strategy, monkeypatch):
    lens = torch.randint(0, 40, (600,), generator=torch.Generator().manual_seed(3))
    first = make_scatter_case(lens, width=48, seed=1, device=DEVICE)
    check_scatter(scatter_req_token_ids, first, strategy=strategy)
    runs = _count_runs(monkeypatch)
    for seed in (2, 3):  # same shapes, new data
        case = make_scatter_case(lens, width=48, seed=seed, device=DEVICE)
        check_scatter(scatter_req_token_ids, case, strategy=strategy)
    assert runs[0] == 0


def _unaligned(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values in a view that starts 8 bytes past a 16-byte boundary."""
    room = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)
    view = room[1:]
    view.copy_(t)
    assert view.data_ptr() % 16 != 0
    return view


@gpu
@pytest.mark.parametrize("strategy", SCATTER_STRATEGIES)
@pytest.mark.parametrize("which", ["flat_in", "offsets", "req_pool_indices"])
def test_unaligned_views_after_aligned_calls(strategy, which, monkeypatch):
    monkeypatch.setattr(fast, "_COMPILED", {})  # no key from earlier tests
    lens = torch.randint(1, 70, (300,), generator=torch.Generator().manual_seed(4))
    case = make_scatter_case(lens, width=64, seed=5, device=DEVICE)
    check_scatter(scatter_req_token_ids, case, strategy=strategy)  # aligned: cached
    runs = _count_runs(monkeypatch)
    setattr(case, which, _unaligned(getattr(case, which)))
    check_scatter(scatter_req_token_ids, case, strategy=strategy)
    # The unaligned view reached a kernel under a key of its own (``loop`` passes rebased
    # copies of the offsets, never the view).
    assert runs[0] >= (0 if (strategy, which) == ("loop", "offsets") else 1)
    runs[0] = 0
    setattr(case, which, getattr(case, which).clone())  # aligned again: the cached binary
    check_scatter(scatter_req_token_ids, case, strategy=strategy)
    assert runs[0] == 0


@gpu
@pytest.mark.parametrize("strategy", ["auto", "scan", "lookback", "loop"])
def test_plan_repeated_and_unaligned(strategy, monkeypatch):
    monkeypatch.setattr(fast, "_COMPILED", {})  # no key from earlier tests
    lens = random_plan_lens(6, 1500, prefix_hi=40, extend=(-1, 6), pad_p=0.2)
    case = make_plan_case(**lens, max_seq_len=48, lut_len=100, seed=6, device=DEVICE)
    check_plan(plan_offsets, case, strategy=strategy)
    runs = _count_runs(monkeypatch)
    check_plan(plan_offsets, case, strategy=strategy)
    assert runs[0] == 0
    case.prefix_lens = _unaligned(case.prefix_lens)
    check_plan(plan_offsets, case, strategy=strategy)
    assert runs[0] >= 1  # a key of its own, not the aligned binary


@contextlib.contextmanager
def _launch_hook(which: str, hook):
    """Register ``hook`` as Triton's launch ``which`` hook ("enter" or "exit", a profiler's
    way in) for the block: the hook chain's ``add`` where Triton has one (3.6 and later),
    else the plain attribute."""
    from triton import knobs

    name = f"launch_{which}_hook"
    chain = getattr(knobs.runtime, name)
    if hasattr(chain, "add"):
        chain.add(hook)
        try:
            yield
        finally:
            chain.remove(hook)
        return
    setattr(knobs.runtime, name, hook)
    try:
        yield
    finally:
        setattr(knobs.runtime, name, chain)


@gpu
@pytest.mark.parametrize("which", ["enter", "exit"])
def test_launch_hook_sees_cached_launches(which, monkeypatch):
    """A registered launch hook (enter or exit) is called for every launch of a cached key,
    with the kernel's name, and the results stay exact; once it is removed the direct launch
    is exact again. Every call here takes the cached path (no ``JITFunction.run``)."""
    monkeypatch.setattr(fast, "_COMPILED", {})
    lens = torch.randint(0, 40, (20,), generator=torch.Generator().manual_seed(8))
    check_scatter(scatter_req_token_ids, make_scatter_case(lens, width=48, seed=1, device=DEVICE))
    assert fast._COMPILED  # the key is cached: the next calls take the cached path
    runs = _count_runs(monkeypatch)
    seen = []
    with _launch_hook(which, lambda metadata: seen.append(metadata.get()["name"])):
        for seed in (2, 3):
            case = make_scatter_case(lens, width=48, seed=seed, device=DEVICE)
            check_scatter(scatter_req_token_ids, case, strategy="rows")
    assert seen == ["_scatter_rows_kernel"] * 2
    check_scatter(scatter_req_token_ids, make_scatter_case(lens, width=48, seed=4, device=DEVICE))
    assert len(seen) == 2
    assert runs[0] == 0


@gpu
def test_cached_key_refuses_a_cpu_tensor(monkeypatch):
    """A cached launch hands the launcher the addresses of tensors on the current device; a
    CPU tensor reaching a kernel launcher directly at a cached key is handed as the tensor and
    refused before the launch, as Triton refuses it, and writes nothing (no CPU address
    reaches the GPU)."""
    monkeypatch.setattr(fast, "_COMPILED", {})
    case = make_scatter_case([3, 5, 2], width=16, seed=2, device=DEVICE)
    pool = case.fresh_pool()
    launch_scatter_rows(case.args(pool), grid=(3, 1))
    assert fast._COMPILED
    runs = _count_runs(monkeypatch)
    before = pool.clone()
    cpu = ScatterArgs(case.flat_in.cpu(), case.offsets, case.req_pool_indices, pool)
    with pytest.raises(ValueError, match="cpu tensor"):
        launch_scatter_rows(cpu, grid=(3, 1))
    torch.cuda.synchronize()
    assert torch.equal(pool, before)
    assert runs[0] == 0  # refused on the cached path, not by Triton's own launch


def test_addresses_handed_only_for_the_current_device():
    """``launch`` hands an integer address only for a tensor on the device it launches on;
    a CPU tensor or another device's tensor goes to the launcher as the tensor, which checks
    it as Triton does. Ints, ``None`` and bools pass unchanged."""
    cpu = torch.zeros(4, dtype=torch.int64)
    _, handed = fast.specialise((cpu, 7, None, True), 0)
    assert handed[0] is cpu and handed[1:] == [7, None, True]
    if GPU:
        here = torch.zeros(4, dtype=torch.int64, device=DEVICE)
        index = here.get_device()
        assert fast.specialise((here,), index)[1] == [here.data_ptr()]
        assert fast.specialise((here,), index + 1)[1][0] is here  # another device's view


def test_plan_head_keys_each_misaligned_address():
    """A plan call's ``Head``: its tensors in the kernels' order, their addresses handed,
    the key 0 while all are 16-byte aligned and each address's residue otherwise (Triton
    compiles an unaligned pointer apart), and the outputs' device."""
    lens = random_plan_lens(3, 40, prefix_hi=17, extend=(0, 4), pad_p=0.2)
    case = make_plan_case(**lens, max_seq_len=16, lut_len=10, device=DEVICE)
    i, o = bundle_plan_args({**case.inputs(), **case.fresh_outputs()})
    head = plan_kernel_head(i, o, spare=o.out_verify_offsets)
    want = (*i[:4], i.full_to_swa_index_mapping, *o)
    assert all(a is b for a, b in zip(head.args, want, strict=True))
    assert head.handed == tuple(t.data_ptr() for t in want)
    assert head.key == 0 and head.device == o.out_verify_offsets.get_device()
    shifted = o._replace(out_write_offsets=o.out_write_offsets[1:])  # 8 bytes on
    residues = plan_kernel_head(i, shifted, spare=o.out_verify_offsets).key
    assert residues == (0,) * 6 + (8,) + (0,) * 4
    spare = o.out_verify_offsets[1:]  # stands in for an absent LUT: keyed as well
    no_lut = i._replace(full_to_swa_index_mapping=None)
    assert plan_kernel_head(no_lut, o, spare=spare).key == (0,) * 4 + (8,) + (0,) * 6


@pytest.mark.parametrize("lut", [True, False])
def test_one_pass_plan_check_builds_the_plan_head(lut):
    """A valid call's one-pass check returns ``plan_kernel_head``'s ``Head`` (the verify
    offsets standing in for an absent LUT), also with a misaligned output."""
    case = make_plan_case(**random_plan_lens(9, 30, prefix_hi=17, extend=(0, 4), pad_p=0.2),
                          max_seq_len=16, lut_len=10 if lut else None, device=DEVICE)  # fmt: skip
    i, o = bundle_plan_args({**case.inputs(), **case.fresh_outputs()})
    wide = torch.zeros(o.out_write_offsets.numel() + 1, dtype=torch.int64, device=DEVICE)
    for outs in (o, o._replace(out_write_offsets=wide[1:])):  # the second 8 bytes off
        head = _fit_head(i, outs)
        want = plan_kernel_head(i, outs, spare=outs.out_verify_offsets)
        assert head is not None and (head.key, head.device) == (want.key, want.device)
        assert head.handed == want.handed
        assert all(a is b for a, b in zip(head.args, want.args, strict=True))
    assert want.key != 0  # the misaligned view is keyed by its residues


class _NotContiguous(torch.Tensor):
    """A subclass whose ``is_contiguous`` disagrees with its stride: the ordered checks refuse
    it, so the one-pass check must not accept it."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func is torch.Tensor.is_contiguous:
            return False
        return super().__torch_function__(func, types, args, kwargs or {})


def _plan_breaks():
    from test_dispatch_api_errors import _plan_breakages

    breaks = dict(_plan_breakages())
    # A non-tensor in each tensor's place (a list: None is a valid LUT).
    for name in (*PLAN_INPUT_NAMES, *PLAN_OUTPUT_NAMES):
        breaks[f"{name}_list"] = lambda k, name=name: k.update({name: [0, 1]})
    breaks["capacity_float"] = lambda k: k.update(verify_capacity=float(k["verify_capacity"]))
    breaks["rpi_subclass_not_contiguous"] = lambda k: k.update(
        req_pool_indices=k["req_pool_indices"].as_subclass(_NotContiguous)
    )
    breaks["enable_nested"] = lambda k: k.update(
        out_verify_enable=torch.nested.nested_tensor([k["out_verify_enable"]])
    )
    breaks["scalar_strided"] = lambda k: k.update(
        out_verify_enable=torch.zeros(2, dtype=torch.int32, device=DEVICE)[::2]
    )
    return breaks


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype stage")
@pytest.mark.parametrize("name", sorted(_plan_breaks()))
def test_one_pass_plan_check_accepts_no_breakage(name):
    """The one-pass check accepts no call the ordered checks refuse: each breakage of the
    error-text tests, a non-tensor in each tensor's place, a subclass that calls itself not
    contiguous and a nested tensor give ``None`` (nothing raises), which sends the call
    through the ordered checks. So do two calls they pass (a float capacity, a one-element
    output of stride 2: ``test_one_element_outputs_of_any_stride``)."""
    case = make_plan_case(**random_plan_lens(4, 5, prefix_hi=9, extend=(0, 4), pad_p=0.2),
                          max_seq_len=16, lut_len=10, device=DEVICE)  # fmt: skip
    kw = {**case.inputs(), **case.fresh_outputs()}
    assert _fit_head(*bundle_plan_args(kw)) is not None
    _plan_breaks()[name](kw)
    assert _fit_head(*bundle_plan_args(kw)) is None


def _int_width_probe_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def _probe(x_ptr, n, BLOCK: tl.constexpr):  # n specialised: with_head must refuse it
        tl.store(x_ptr + tl.arange(0, BLOCK), n, mask=tl.arange(0, BLOCK) < 1)

    return _probe


@gpu
def test_with_head_refuses_integers_triton_specialises(monkeypatch):
    """``with_head`` keys its integers by width, which is right only for ``do_not_specialize``
    parameters: a kernel whose integer is specialised is refused on its first launch with a
    ``TypeError`` naming the parameter, and nothing is written."""
    monkeypatch.setattr(fast, "_COMPILED", {})
    x = torch.full((16,), -7, dtype=torch.int64, device=DEVICE)
    head = fast.make_head((x,), (x.data_ptr(),), x.get_device())
    bound = fast.BoundKernel(_int_width_probe_kernel(), {"BLOCK": 16})
    with pytest.raises(TypeError, match="n is not a do_not_specialize parameter"):
        bound.with_head((1,), head, (), (5,))
    torch.cuda.synchronize()
    assert torch.equal(x, torch.full_like(x, -7)) and fast._COMPILED == {}


@gpu
@pytest.mark.parametrize("strategy", ["auto", "recount", "scan", "lookback"])
def test_plan_integers_past_int32_compile_apart(strategy, monkeypatch):
    """The plan kernels' integers are keyed by width alone: a window past int32 after int32
    calls takes a binary of its own (an int32 one would read the window as 5) and stays
    exact, and the int32 binary is reused after it."""
    monkeypatch.setattr(fast, "_COMPILED", {})
    lens = random_plan_lens(12, 700, prefix_hi=40, extend=(0, 6), pad_p=0.2)
    case = make_plan_case(**lens, max_seq_len=48, seed=3, device=DEVICE)
    case.swa_window_size = 7
    check_plan(plan_offsets, case, strategy=strategy)
    runs = _count_runs(monkeypatch)
    case.swa_window_size = 2**40 + 5
    check_plan(plan_offsets, case, strategy=strategy)
    assert runs[0] >= 1
    runs[0] = 0
    case.swa_window_size = 9
    check_plan(plan_offsets, case, strategy=strategy)
    assert runs[0] == 0


def _declared_free(kernel) -> set[str]:
    """The parameters ``kernel`` declares ``do_not_specialize``, compiled or interpreted."""
    if hasattr(kernel, "params"):
        return {p.name for p in kernel.params if p.do_not_specialize}
    names = kernel.kwargs.get("do_not_specialize") or ()
    return {n if isinstance(n, str) else kernel.arg_names[n] for n in names}


def _spy_width_keyed(monkeypatch) -> list[tuple]:
    """Record every launch whose integers are keyed by width alone (``with_head``, the full
    path's plan launches; ``checked``, the one-pass launches of both functions), as (bound
    kernel, tensors before the integers, integers)."""
    seen = []
    with_head, checked = fast.BoundKernel.with_head, fast.BoundKernel.checked

    def spy_head(self, grid, head, tensors, ints):
        seen.append((self, len(head.args) + len(tensors), len(ints)))
        return with_head(self, grid, head, tensors, ints)

    def spy_checked(self, grid, device, tensors, addresses, ints, stream=None):
        seen.append((self, len(tensors), len(ints)))
        return checked(self, grid, device, tensors, addresses, ints, stream)

    monkeypatch.setattr(fast.BoundKernel, "with_head", spy_head)
    monkeypatch.setattr(fast.BoundKernel, "checked", spy_checked)
    return seen


def _expect_declared_free(seen: list[tuple]) -> None:
    assert seen
    for bound, first, n in seen:
        names = bound.kernel.arg_names
        assert set(names[first : first + n]) <= _declared_free(bound.kernel), names
        assert set(names[first + n :]) <= set(bound.meta), names  # constexprs only after


@pytest.mark.parametrize("strategy", ["auto", "loop", "scan", "lookback", "recount"])
def test_width_keyed_plan_integers_are_declared_free(strategy, monkeypatch):
    """Every integer a plan launch keys by width alone is a ``do_not_specialize`` parameter,
    and only constexprs follow them: checked here from the kernels' declarations, so the CPU
    catches what the compiled path refuses at a first launch. (On the CPU every call takes the
    full path; on a GPU ``auto``, ``lookback`` and ``recount`` take the one pass.)"""
    seen = _spy_width_keyed(monkeypatch)
    lens = random_plan_lens(13, 300, prefix_hi=20, extend=(0, 5), pad_p=0.2)
    case = make_plan_case(**lens, max_seq_len=24, lut_len=30, seed=2, device=DEVICE)
    chunk = 64 if strategy != "auto" else None
    check_plan(plan_offsets, case, strategy=strategy, chunk_size=chunk)
    _expect_declared_free(seen)


@gpu
@pytest.mark.parametrize("strategy", ["auto", "rows", "capped", "flat", "segments"])
def test_width_keyed_scatter_integers_are_declared_free(strategy, monkeypatch):
    """The same for the scatter's one-pass launches (a GPU: the CPU never takes them)."""
    seen = _spy_width_keyed(monkeypatch)
    check_scatter(
        scatter_req_token_ids,
        make_scatter_case([3, 900, 0, 17], width=1000, device=DEVICE),
        strategy=strategy,
    )
    _expect_declared_free(seen)
