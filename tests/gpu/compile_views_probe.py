"""Which compiled steps that scatter into a view made inside the step, of a window of the
caller's buffer, write what eager writes: this library's scatter and a minimal mutating custom
op defined with ``torch.library`` alone, under each backend and each functionalization of
mutating custom ops.

    python tests/gpu/compile_views_probe.py    # one line a case: ok, or the rows that differ

It names the torch and Triton it ran on; ``tests/test_compile_views.py`` pins what holds. Before
each compiled call the allocator's small free blocks are filled with 7777, so a wrong element
that reads 7777 came from memory torch handed out without initialising it."""

from __future__ import annotations

import torch
import torch._inductor.config as inductor_config
import triton

from kvcanary_dispatch import scatter_req_token_ids

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SENTINEL = 7777
WINDOWS = {  # the window of an [3, 8] int32 buffer each step is handed
    "whole": (slice(None),),
    "rows 1:": (slice(1, None),),
    "columns 2:": (slice(None), slice(2, None)),
}


@torch.library.custom_op("kvc_probe::two_runs", mutates_args=("out",))
def two_runs(src: torch.Tensor, out: torch.Tensor) -> None:
    """Writes src[0:3] into out's row 0 and src[3:5] into its row 1."""
    out[0, :3] = src[:3].to(out.dtype)
    out[1, :2] = src[3:5].to(out.dtype)


@two_runs.register_fake
def _(src: torch.Tensor, out: torch.Tensor) -> None:
    return None


def ours(flat, table):
    scatter_req_token_ids(
        flat_in=flat, offsets=torch.tensor([0, 3, 5], device=flat.device),
        req_pool_indices=torch.tensor([0, 1], device=flat.device), pool_out=table[:, :4],
    )  # fmt: skip


def torchs(flat, table):
    two_runs(flat, table[:, :4])


def case(step, window: str, backend: str, v2: bool) -> str:
    flat = torch.tensor([10, 11, 12, 20, 21], device=DEVICE)
    big = torch.full((3, 8), -1, dtype=torch.int32, device=DEVICE)
    want = big.clone()
    step(flat, want[WINDOWS[window]])
    torch._dynamo.reset()
    with inductor_config.patch(enable_auto_functionalized_v2=v2):
        compiled = torch.compile(step, fullgraph=True, backend=backend)
        compiled(flat, big.clone()[WINDOWS[window]])  # compiles: its allocations are done
        blocks = [torch.full((32,), SENTINEL, dtype=torch.int32, device=DEVICE) for _ in range(64)]
        del blocks  # back to the caching allocator's free list, still holding the sentinel
        compiled(flat, big[WINDOWS[window]])
    if torch.equal(big, want):
        return "ok"
    bad = [r for r in range(3) if not torch.equal(big[r], want[r])]
    return "; ".join(f"row {r} {big[r].tolist()} want {want[r].tolist()}" for r in bad)


def main() -> None:
    print(f"torch {torch.__version__} triton {triton.__version__} on {DEVICE}")
    backends = ["aot_eager", "inductor"] if DEVICE == "cuda" else ["aot_eager"]
    for step in (ours, torchs):
        for backend in backends:
            for v2 in (True, False):
                for window in WINDOWS:
                    try:
                        got = case(step, window, backend, v2)
                    except Exception as e:  # a compile error is a result too
                        got = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
                    print(f"{step.__name__:6} {backend:9} v{2 if v2 else 1} {window:10} {got}")


if __name__ == "__main__":
    main()
