"""Dispatcher-level input handling: offsets dtype promotion and the opt-in data checks.

The data checks (``validate=True``) read the inputs back to the host, so they synchronise; they
run before any launch and name the first offending index.
"""

from __future__ import annotations

from itertools import accumulate

import torch

from kvcanary_kernels._checks import PREFIX
from kvcanary_kernels.plan_checks import INT64_MAX
from kvcanary_kernels.references import verify_lens_ref

_SCATTER = f"{PREFIX}scatter_req_token_ids"
_PLAN = f"{PREFIX}plan_offsets"
_CSR_FIX = "build offsets as 0 then torch.cumsum(lens, 0) of the runs' lengths (lens >= 0)"
# The scatter's offsets dtypes: int64, and int32, widened losslessly.
OFFSETS_DTYPES = (torch.int64, torch.int32)


def _first(mask: torch.Tensor) -> int | None:
    idx = mask.nonzero()
    return int(idx[0, 0]) if idx.numel() else None


def _first_duplicate(rpi: torch.Tensor, among: torch.Tensor, what: str, fix: str) -> None:
    """Raise on the earliest request of the boolean ``among`` whose pool index ``rpi`` repeats
    an earlier one's among them (``fix``: what the message ends with)."""
    values, positions = rpi[among], among.nonzero()[:, 0]
    order = torch.argsort(values, stable=True)
    ordered = values[order]
    repeat = ordered[1:] == ordered[:-1]
    if not bool(repeat.any()):
        return
    later = positions[order[1:][repeat]]
    k = int(torch.argmin(later))
    v = ordered[1:][repeat][k]
    first = positions[order[torch.searchsorted(ordered, v)]]
    raise ValueError(
        f"{what}req_pool_indices[{int(later[k])}]={int(v)} repeats "
        f"req_pool_indices[{int(first)}]; requests must address distinct pool rows: {fix}"
    )


def _check_rows(rpi: torch.Tensor, rows: int, what: str, pool: str) -> None:
    bad = _first((rpi < 0) | (rpi >= rows))
    if bad is not None:
        raise ValueError(
            f"{what}req_pool_indices[{bad}]={int(rpi[bad])} is outside [0, {rows}) "
            f"({pool} has {rows} rows); pass indices of {pool}'s rows"
        )


def validate_scatter_data(
    flat_in: torch.Tensor,
    offsets: torch.Tensor,
    req_pool_indices: torch.Tensor,
    pool_out_shape: tuple[int, ...],
) -> None:
    """Offsets a CSR over ``flat_in`` (start 0, non-decreasing, end ``len(flat_in)``); pool
    indices in range, and distinct among the requests that write (a run non-empty within the
    pool's width): a repeated row whose other requests write nothing, such as padding
    requests on row 0, leaves the result defined."""
    rows, width = int(pool_out_shape[0]), int(pool_out_shape[1])
    offs = offsets.cpu()
    bs = offs.numel() - 1
    if int(offs[0]) != 0:
        raise ValueError(f"{_SCATTER} offsets[0] must be 0, got {int(offs[0])}; {_CSR_FIX}")
    down = _first(offs[1:] < offs[:-1])
    if down is not None:
        raise ValueError(
            f"{_SCATTER} offsets must be non-decreasing: offsets[{down + 1}]="
            f"{int(offs[down + 1])} < offsets[{down}]={int(offs[down])}; {_CSR_FIX}"
        )
    if int(offs[bs]) != flat_in.shape[0]:
        raise ValueError(
            f"{_SCATTER} offsets[{bs}]={int(offs[bs])} must equal len(flat_in)={flat_in.shape[0]}; "
            "flat_in holds the runs' tokens back to back, no more"
        )
    rpi = req_pool_indices.cpu()
    _check_rows(rpi, rows, f"{_SCATTER} ", "pool_out")
    writes = (offs[1:] - offs[:-1]).clamp(max=width) > 0  # non-decreasing offsets: >= 0
    fix = "give each request that writes its own row (those with empty runs may share one)"
    _first_duplicate(rpi, writes, f"{_SCATTER} ", fix)


def _check_total(lens: torch.Tensor, what: str, name: str, values: torch.Tensor) -> None:
    """A ``ValueError`` naming the first request at which the running sum of ``lens``
    (non-negative CPU int64, each taken from ``values``, the argument ``name``) passes
    ``2**63 - 1``."""
    if not lens.numel() or int(lens.max()) * lens.numel() <= INT64_MAX:
        return  # no sum of these can pass it
    bad = next((r for r, t in enumerate(accumulate(lens.tolist())) if t > INT64_MAX), None)
    if bad is not None:
        raise ValueError(
            f"{_PLAN} the {what} total passes {INT64_MAX} at request {bad} ({name}[{bad}]="
            f"{int(values[bad])}): the int64 offsets cannot hold it; plan fewer or shorter "
            "requests"
        )


def validate_plan_data(
    req_pool_indices: torch.Tensor,
    prefix_lens: torch.Tensor,
    extend_seq_lens: torch.Tensor,
    req_to_token: torch.Tensor,
    swa_window_size: int,
) -> None:
    """Pool indices in range, active (non-zero) ones distinct, every seed read inside
    ``req_to_token`` (``prefix_lens[r] <= req_to_token.shape[1]`` where a seed is read), and
    the verify and write totals at most ``2**63 - 1``."""
    rpi = req_pool_indices.cpu()
    rows, width = int(req_to_token.shape[0]), int(req_to_token.shape[1])
    _check_rows(rpi, rows, f"{_PLAN} ", "req_to_token")
    active = rpi != 0
    _first_duplicate(rpi, active, f"{_PLAN} ", "give each request its own row (0 marks padding)")
    prefix, extend = prefix_lens.cpu(), extend_seq_lens.cpu()
    seeded = active & (prefix > 0) & (extend > 0)
    bad = _first(seeded & (prefix > width))
    if bad is not None:
        raise ValueError(
            f"{_PLAN} prefix_lens[{bad}]={int(prefix[bad])} exceeds req_to_token.shape[1]="
            f"{width}: the seed reads req_to_token[row, prefix - 1]; pass a req_to_token at least "
            "that wide, or prefix_lens within its width"
        )
    verify = verify_lens_ref(prefix, swa_window_size)  # the plan's verify runs
    zero = torch.zeros_like(verify)
    _check_total(torch.where(active, verify, zero), "verify", "prefix_lens", prefix)
    _check_total(torch.where(active, extend.clamp(min=0), zero), "write", "extend_seq_lens", extend)
