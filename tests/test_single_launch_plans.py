"""The plan kernels' own slicings against the reference, byte for byte on poisoned outputs:
``lookback``, ``scan`` and ``recount`` over slice sizes and tiles the dispatcher does not pick
(it picks one setting of each), their folding of slice sums across steps, the look-back's
refusal of settings that would give a published sum several readers, and, on a GPU, many
racing slices with totals near 2**62 and ``auto``'s large slices."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest
import torch
import triton
from _helpers import plan_case_32
from conftest import DEVICE, GPU

from kvcanary_dispatch import plan_offsets
from kvcanary_dispatch.launch_plan import (
    AUTO_PLAN_LARGE_BS,
    AUTO_PLAN_LARGE_CHUNK,
    plan_offsets_launch_plan,
)
from kvcanary_dispatch.testing.cases import check_plan, make_plan_case
from kvcanary_kernels.args import bundle_plan_args
from kvcanary_kernels.plan_lookback import LOOKBACK_SUMS_BLOCK, launch_plan_lookback
from kvcanary_kernels.plan_recount import RECOUNT_SUM_BLOCK, launch_plan_recount
from kvcanary_kernels.plan_scan import SUMS_BLOCK as SCAN_SUMS_BLOCK
from kvcanary_kernels.plan_scan import launch_plan_scan


def _plan_slices(launch: Callable, chunk: int, **params) -> Callable[..., None]:
    """A sliced plan launcher on the plan's flat keywords, over ``cdiv(bs, chunk)`` slices."""

    def run(**keywords) -> None:
        i, o = bundle_plan_args(keywords)
        launch(i, o, grid=(triton.cdiv(i.bs, chunk),), chunk=chunk, **params)

    return run


def _plan_case(seed: int, bs: int):
    no_lut = {} if seed % 2 else {"lut_len": None, "swa_window_size": 0}
    verify_capacity = None if seed % 3 else 5 * bs
    return plan_case_32(bs, seed, verify_capacity=verify_capacity, device=DEVICE, **no_lut)


# More slices than one look-back step reads, so the sums before a slice can span steps; slices
# walked in several tiles (tile < chunk), with a last tile cut by the slice end or by bs.
PLAN_SLICINGS = [
    (1, 1, 3 * LOOKBACK_SUMS_BLOCK + 5),
    (5, 8, 301),
    (64, 64, 1000),
    (256, 256, 257),
    (12, 4, 301),
    (100, 32, 1000),
    (512, 128, 1500),
    (1024, 256, 2100),  # auto's large slices (from bs 1 048 576)
]


@pytest.mark.parametrize("launch", [launch_plan_lookback, launch_plan_scan, launch_plan_recount])
@pytest.mark.parametrize("chunk,bs_block,bs", PLAN_SLICINGS)
@pytest.mark.parametrize("seed", range(2))
def test_plan_slicings(launch, chunk, bs_block, bs, seed):
    """In the interpreter only the look-back takes the one-request slicing past one look-back
    step's reach (773 slices): the others fold 1 024 or 2 048 slices' sums a step, which 773
    does not reach either, so they take 301 there."""
    if not GPU and chunk == 1 and launch is not launch_plan_lookback:
        bs = min(bs, 301)
    check_plan(_plan_slices(launch, chunk=chunk, bs_block=bs_block), _plan_case(seed, bs))


@pytest.mark.parametrize(
    "sums_block, num_warps, fix",
    [
        (128, 8, "sums_block >= 256 or num_warps <= 4"),
        (256, 16, "sums_block >= 512 or num_warps <= 8"),
        (16, 1, "sums_block >= 32"),
    ],
)
def test_lookback_refuses_sums_blocks_smaller_than_its_threads(sums_block, num_warps, fix):
    """Each published sum a look-back wait reads must be held by one thread (the kernel's
    module says why): a sums block smaller than the launch's threads is refused before
    anything runs, naming both and the fix, and the outputs stay poisoned."""
    case = _plan_case(0, 40)
    outs = case.fresh_outputs()
    kept = {name: t.clone() for name, t in outs.items()}
    run = _plan_slices(launch_plan_lookback, 4, bs_block=4, num_warps=num_warps,
                       sums_block=sums_block)  # fmt: skip
    with pytest.raises(ValueError) as err:
        run(**case.inputs(), **outs)
    assert str(err.value) == (
        f"kv-canary: plan look-back sums_block={sums_block} is less than the {32 * num_warps} "
        f"threads of num_warps={num_warps}; pass {fix} (each published sum a wait reads must "
        "be held by one thread)"
    )
    assert all(torch.equal(outs[name], kept[name]) for name in outs)


@pytest.mark.parametrize(
    "launch,chunk,bs_block,bs",
    [
        (launch_plan_scan, 2, 2, 2 * SCAN_SUMS_BLOCK + 9),  # a program folds 1 024 slices a step
        (launch_plan_recount, 1024, 256, 2 * RECOUNT_SUM_BLOCK + 300),  # re-adds 2 048 a step
    ],
)
def test_plan_bases_fold_past_one_step(launch, chunk, bs_block, bs):
    """The slices before the last ones span two of their program's folding steps: each
    step's sums add to the base carried from the steps before (a base re-set each step would
    lose the earlier slices' totals)."""
    check_plan(_plan_slices(launch, chunk=chunk, bs_block=bs_block), _plan_case(0, bs))


# (launcher, chunk, tile, warps): the look-back's 256-request slices (4 096 programs; on 4
# warps, more of them resident at once), the large slices walked in tiles that plan auto's scan
# takes from AUTO_PLAN_LARGE_BS, eager auto's look-back slices at that size, and the recount
# (whose programs each re-add up to a million requests).
STRESS_SLICINGS = [
    (launch_plan_lookback, 256, 256, 8),
    (launch_plan_scan, 1024, 256, 4),
    (launch_plan_lookback, 2048, 256, 8),
    (launch_plan_lookback, 256, 256, 4),
    (launch_plan_recount, 1024, 256, 8),
]


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="look-back races show only on a GPU")
@pytest.mark.parametrize("launch,chunk,tile,warps", STRESS_SLICINGS)
def test_plan_stress_many_slices_huge_totals(launch, chunk, tile, warps):
    """512-4 096 slices racing (through the look-back), totals near 2**62: every repetition
    equal to the reference byte for byte (a torn or stale published word, or a tile's carry
    lost, would show as a wrong offset)."""
    bs = 1 << 20
    g = torch.Generator().manual_seed(5)
    for rep in range(20):
        prefix = torch.randint(0, 1 << 42, (bs,), generator=g, dtype=torch.int64)
        extend = torch.randint(0, 1 << 42, (bs,), generator=g, dtype=torch.int64)
        prefix[::3] = 0
        prefix[rep * 977 + 1] = 1 << 61  # one request alone worth 2**61
        # A seed is read only where prefix > 0 and extend > 0: keep those apart (width 1).
        extend[prefix > 0] = 0
        case = make_plan_case(
            prefix_lens=prefix,
            extend_seq_lens=extend,
            max_seq_len=1,
            verify_capacity=2**31 - 1,
            seed=rep,
            device=DEVICE,
        )
        got = check_plan(_plan_slices(launch, chunk=chunk, bs_block=tile, num_warps=warps), case)
        assert int(got["out_verify_offsets"][bs]) > 1 << 61


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="a million requests: GPU only")
@pytest.mark.parametrize("lut", [False, True])
def test_plan_auto_large_slices(lut):
    """plan_offsets auto past AUTO_PLAN_LARGE_BS (1 024-request slices walked in tiles, a
    ragged last slice and tile), with and without a LUT and window: equal to the reference."""
    bs = AUTO_PLAN_LARGE_BS + 777
    g = torch.Generator().manual_seed(bs)
    case = make_plan_case(
        prefix_lens=torch.randint(0, 65, (bs,), generator=g),
        extend_seq_lens=torch.randint(-1, 9, (bs,), generator=g),
        padding=torch.rand(bs, generator=g) < 0.2,
        max_seq_len=64,
        lut_len=5000 if lut else None,
        swa_window_size=16 if lut else 0,
        verify_capacity=None,
        seed=bs,
        device=DEVICE,
    )
    assert plan_offsets_launch_plan(bs).chunk == AUTO_PLAN_LARGE_CHUNK
    check_plan(plan_offsets, case)


def test_plan_lookback_total_wrapping_onto_unset_finishes():
    """Past the int64 precondition a slice's write sum can wrap onto the look-back's UNSET
    word value (2**62 + 2**62 == INT64_MIN): it is published as INT64_MIN + 1, so the slices
    after it stop waiting (the totals from there are wrong, never a hang). The first slice's
    offsets are exact."""
    case = make_plan_case(
        prefix_lens=[0, 0, 0, 0],
        extend_seq_lens=[2**62, 2**62, 1, 1],
        max_seq_len=1,
        verify_capacity=0,
        device=DEVICE,
    )
    outs = case.fresh_outputs()
    run = _plan_slices(launch_plan_lookback, chunk=2, bs_block=2)
    done = threading.Event()

    def call() -> None:
        run(**case.inputs(), **outs)
        if DEVICE == "cuda":
            torch.cuda.synchronize()
        done.set()

    threading.Thread(target=call, daemon=True).start()  # a hang stays in its thread
    assert done.wait(timeout=120), "the look-back waited forever on a wrapped slice sum"
    write = outs["out_write_offsets"].cpu()
    assert write[:3].tolist() == [0, 2**62, -(2**63)]
