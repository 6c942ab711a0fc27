"""Plan inputs: ``build_plan_case`` makes a ``PlanCase`` from lengths and a seed, and
``plan_cases`` draws whole batches (lengths one by one for small ones, else a few parameters
and a seed), a sixth of them with int64-extreme totals (``EXTREME_TOTALS``);
``broken_plan_case`` makes one whose data breaks the preconditions (``BROKEN_PLAN_DATA``),
which ``check_broken_plan`` runs through every plan strategy against the reference."""

from __future__ import annotations

import dataclasses

import torch
from hypothesis import strategies as st

from kvcanary_kernels import launch_plan_offsets_kernel
from kvcanary_kernels.references import verify_lens_ref

from ..launch_plan import PLAN_STRATEGIES
from ..plan import plan_offsets
from .cases import PlanCase, check_plan, make_plan_case, random_lut
from .sizes import (
    DRAWN_MAX_BS,
    I32_MAX,
    I64_MAX,
    BatchSize,
    Device,
    Sizes,
    batch_size_strategy,
    log_uniform,
)

# Plan verify and write totals of the int64-extreme cases: at int32's end (the verify count
# and the largest verify_capacity), and from 2**61 on, up to the int64 end.
EXTREME_TOTALS = (I32_MAX - 1, I32_MAX, I32_MAX + 1, 2**61 - 1, 2**61, 2**62)
EXTREME_TOTALS += (2**62 + 12_345, I64_MAX - 2**20, I64_MAX)


# Plan data that breaks the preconditions (validate=False), by name: (request, what, value)
# for a request's pool row outside req_to_token ("rows": the table's row count) or its
# prefix past the table's width, in a batch of 6 requests (BROKEN_PLAN_LENS: prefix and
# extend lengths) on a table of 8 rows and BROKEN_PLAN_WIDTH columns (not square, so that
# rows and width swapped show).
BROKEN_PLAN_LENS, BROKEN_PLAN_WIDTH = ([3, 5, 2, 8, 4, 1], [2, 1, 3, 1, 2, 2]), 11
BROKEN_PLAN_DATA = {
    "row_one_past_the_table": (1, "row", "rows"),
    "row_far_past_the_table": (1, "row", 2**40),
    "negative_row": (4, "row", -1),
    "int64_min_row": (0, "row", -(2**63)),
    "prefix_one_past_the_width": (3, "prefix", BROKEN_PLAN_WIDTH + 1),
    "prefix_far_past_the_width": (5, "prefix", 2**40),
}


def broken_plan_case(
    name: str, *, lut: bool, window: int, device: str | torch.device
) -> tuple[PlanCase, int]:
    """``make_plan_case`` on ``BROKEN_PLAN_LENS`` (a LUT of 10 if ``lut``, the window
    ``window``) with ``BROKEN_PLAN_DATA[name]``'s value in place, and the request it broke:
    a plan reads no seed for it (seed -1)."""
    case = make_plan_case(
        prefix_lens=BROKEN_PLAN_LENS[0], extend_seq_lens=BROKEN_PLAN_LENS[1],
        max_seq_len=BROKEN_PLAN_WIDTH, lut_len=10 if lut else None, swa_window_size=window,
        device=device,
    )  # fmt: skip
    r, what, value = BROKEN_PLAN_DATA[name]
    value = case.req_to_token.shape[0] if value == "rows" else value
    assert case.req_to_token.shape[0] != BROKEN_PLAN_WIDTH  # rows and width told apart
    field = "req_pool_indices" if what == "row" else "prefix_lens"
    values = getattr(case, field).clone()
    values[r] = value
    return dataclasses.replace(case, **{field: values}), r


def check_broken_plan(case: PlanCase, request: int, chunks: tuple[int | None, ...]) -> int:
    """Every plan strategy at each of ``chunks`` and the fixed-block launcher on a
    ``broken_plan_case``: each equal to the reference byte for byte (``check_plan``), with
    seed -1 for ``request``, whose seed lies outside the table, and some other seed read.
    Returns the number of calls made."""
    launcher = dict(out_verify_name="out_verify_offsets_scratch")
    calls = [
        (plan_offsets, dict(strategy=s, chunk_size=c)) for s in PLAN_STRATEGIES for c in chunks
    ]
    for impl, kw in [*calls, (launch_plan_offsets_kernel, launcher)]:
        seeds = check_plan(impl, case, **kw)["out_write_seed_slot_indices"][: case.bs]
        assert int(seeds[request]) == -1, (impl.__name__, kw)
        assert (seeds != -1).any(), (impl.__name__, kw)  # the other requests' seeds are read
    return len(calls) + 1


def build_plan_case(
    *,
    prefix_lens: torch.Tensor,
    extend_seq_lens: torch.Tensor,
    padding: torch.Tensor,
    max_seq_len: int,
    lut_len: int | None,
    swa_window_size: int,
    capacity_mode: str,
    capacity_delta: int,
    spare_capacity: int,
    spare_verify: int,
    seed: int,
    device: Device,
) -> PlanCase:
    """A plan batch made on ``device`` from ``seed``: distinct active pool rows (row 0 for
    padding), slots in ``req_to_token`` from -3 up to past the LUT's end, LUT values of every
    magnitude and sign (``random_lut``), seeded requests' prefixes clamped to
    ``max_seq_len``. ``capacity_mode``: the verify capacity is ``"below"``,
    ``"at"`` or ``"above"`` the verify total, by ``capacity_delta``, or ``"int32_max"``: within
    2 below ``2**31 - 1``, the largest accepted (all modes are clamped to it)."""
    dev = torch.device(device)
    g = torch.Generator(device=dev).manual_seed(seed)
    pad = padding.to(dev, torch.bool)
    extend = extend_seq_lens.to(dev, torch.int64)
    prefix = prefix_lens.to(dev, torch.int64)
    bs = int(prefix.numel())
    seeded = ~pad & (prefix > 0) & (extend > 0)
    prefix = torch.where(seeded, prefix.clamp(max=max_seq_len), prefix)
    rows = bs + 2
    rpi = torch.randperm(rows - 1, generator=g, device=dev)[:bs].to(torch.int64) + 1
    rpi = torch.where(pad, 0, rpi)
    slot_hi = 2 * lut_len + 2 if lut_len is not None else I32_MAX
    r2t = torch.randint(-3, slot_hi, (rows, max_seq_len), generator=g, device=dev)
    r2t = r2t.to(torch.int32)
    lut = random_lut(lut_len, g, dev) if lut_len is not None else None
    total = int(torch.where(pad, 0, verify_lens_ref(prefix, swa_window_size)).sum()) if bs else 0
    if capacity_mode == "below":
        capacity = total - 1 - capacity_delta
    elif capacity_mode == "above":
        capacity = total + 1 + capacity_delta
    elif capacity_mode == "int32_max":
        capacity = I32_MAX - capacity_delta % 3
    else:
        capacity = total
    capacity = min(max(capacity, 0), I32_MAX)  # the largest verify_capacity accepted
    return PlanCase(
        rpi,
        prefix,
        extend,
        r2t,
        lut,
        int(swa_window_size),
        capacity,
        bs + spare_capacity,
        bs + 1 + spare_verify,
    )


def _seeded_plan_lens(
    bs: int, max_seq_len: int, params: dict, g: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    prefix = torch.randint(0, 2 * max_seq_len + 1, (bs,), generator=g)
    prefix[torch.rand(bs, generator=g) < params["zero_prefix"]] = 0
    extend = torch.randint(0, params["max_extend"] + 1, (bs,), generator=g)
    extend[torch.rand(bs, generator=g) < params["zero_extend"]] = 0
    odd = torch.rand(bs, generator=g) < params["odd_frac"]
    extend[odd] = -torch.randint(1, 3, (bs,), generator=g)[odd]
    odd = torch.rand(bs, generator=g) < params["odd_frac"]  # negative prefixes too
    prefix[odd] = -torch.randint(1, 3, (bs,), generator=g)[odd]
    if params["huge"]:  # int64 sums: prefixes far past any pool, where no seed is read
        huge = (torch.rand(bs, generator=g) < 0.1) & (extend <= 0)
        prefix[huge] = torch.randint(2**31, 2**36, (bs,), generator=g)[huge]
    padding = torch.rand(bs, generator=g) < params["pad_frac"]
    return prefix, extend, padding


def _extreme_lens(
    prefix: torch.Tensor,
    extend: torch.Tensor,
    padding: torch.Tensor,
    max_seq_len: int,
    totals: tuple[int, int],
    seed: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Lengths whose verify and write totals (no window) are exactly ``totals``: up to three
    active requests take the verify rest as prefixes (their extend zeroed: no seed is read),
    up to two others the write rest as extends (their prefix zeroed: no seed). Unchanged when
    fewer than two requests are active or the others already exceed a target."""
    active = ~padding
    idx = active.nonzero()[:, 0]
    if idx.numel() < 2:
        return prefix, extend
    g = torch.Generator().manual_seed(seed)
    idx = idx[torch.randperm(idx.numel(), generator=g)]
    k = min(3, idx.numel() - 1)
    big_v, big_w = idx[:k], idx[k : k + 2]
    prefix, extend = prefix.clone(), extend.clone()
    seeded = active & (prefix > 0) & (extend > 0)  # build_plan_case clamps these prefixes
    prefix = torch.where(seeded, prefix.clamp(max=max_seq_len), prefix)
    big = torch.cat([big_v, big_w])
    prefix[big], extend[big] = 0, 0
    for t, chosen, total in ((prefix, big_v, totals[0]), (extend, big_w, totals[1])):
        rest = total - int(torch.where(active, t.clamp(min=0), 0).sum())
        if rest < 0:
            return prefix, extend  # smaller targets than the lengths already hold: no extreme
        for i, j in enumerate(chosen.tolist()):
            t[j] = rest // len(chosen) + (rest % len(chosen) if i == 0 else 0)
    return prefix, extend


@st.composite
def plan_cases(
    draw: st.DrawFn,
    max_bs: int,
    device: Device = "cpu",
    *,
    bs: BatchSize = None,
    max_seq_len: int = 48,
    max_pool_elems: int = 1 << 22,
    gpu_sizes: bool = False,
) -> PlanCase:
    """A whole plan batch: many zero prefixes and extends (a few negative), prefixes past the
    pool where no seed is read, padding rows, SWA windows (up to ``2**63 - 1``) with and
    without LUTs (shorter than the slot range, values of every magnitude and sign), one case
    in six with int64-extreme totals (``EXTREME_TOTALS``), verify capacities below, at and
    above the total or at int32's end, spare output capacity."""
    n = draw(batch_size_strategy(bs, 0, max_bs))
    width = draw(st.integers(1, max(1, min(max_seq_len, max_pool_elems // (n + 2)))))
    seed = draw(st.integers(0, 2**32 - 1))
    if n <= DRAWN_MAX_BS and not gpu_sizes:
        req = st.tuples(
            st.one_of(st.just(0), st.integers(-2, 2 * width)),
            st.one_of(st.just(0), st.integers(-2, 9)),
            st.booleans(),
        )
        reqs = draw(st.lists(req, min_size=n, max_size=n))
        prefix = torch.tensor([r[0] for r in reqs], dtype=torch.int64)
        extend = torch.tensor([r[1] for r in reqs], dtype=torch.int64)
        padding = torch.tensor([r[2] for r in reqs], dtype=torch.bool)
    else:
        params = dict(
            zero_prefix=draw(st.sampled_from([0.0, 0.3, 0.9])),
            zero_extend=draw(st.sampled_from([0.0, 0.5, 1.0])),
            max_extend=draw(st.sampled_from([1, 8, 4096])),
            odd_frac=draw(st.sampled_from([0.0, 0.05])),
            pad_frac=draw(st.sampled_from([0.0, 0.25, 0.9, 1.0])),
            huge=draw(st.integers(0, 7)) == 0,
        )
        g = torch.Generator().manual_seed(seed)
        prefix, extend, padding = _seeded_plan_lens(n, width, params, g)
    extreme = draw(st.integers(0, 5)) == 0  # int64 totals: no window, which would cap them
    if extreme:
        totals = (draw(st.sampled_from(EXTREME_TOTALS)), draw(st.sampled_from(EXTREME_TOTALS)))
        prefix, extend = _extreme_lens(prefix, extend, padding, width, totals, seed)
    use_lut = draw(st.integers(0, 3)) > 0
    lut_len = draw(st.integers(1, 4 * width + 4)) if use_lut else None
    # A window without a LUT applies the window and translates no seed (upstream's launcher).
    # Windows past every prefix too, up to int64's end (they must clamp nothing, nor wrap).
    windows = st.one_of(st.just(0), st.integers(1, 2 * width), log_uniform(2 * width, I64_MAX))
    window = 0 if extreme else draw(windows)
    return build_plan_case(
        prefix_lens=prefix,
        extend_seq_lens=extend,
        padding=padding,
        max_seq_len=width,
        lut_len=lut_len,
        swa_window_size=window,
        capacity_mode=draw(st.sampled_from(["below", "at", "above", "int32_max"])),
        capacity_delta=draw(st.one_of(st.just(0), st.integers(0, 1000))),
        spare_capacity=draw(st.integers(0, 3)),
        spare_verify=draw(st.integers(0, 3)),
        seed=seed,
        device=device,
    )


def plan_cases_for(
    sizes: Sizes, device: Device = "cpu", *, bs: BatchSize = None
) -> st.SearchStrategy[PlanCase]:
    """``plan_cases`` with the bounds of ``sizes``."""
    return plan_cases(
        device=device, bs=bs, **sizes.bounds("max_bs", "max_seq_len", "max_pool_elems", "gpu_sizes")
    )
