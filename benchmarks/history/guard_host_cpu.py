"""Step 59: host µs of one ``ForwardStepGuard`` step (``plan_step`` and its one iteration) with
the plan call stubbed out, on a machine without a GPU: the guard's own Python (the length
conversions, the token count, the fit check, the sub-step and its plan inputs), lengths and
buffers on the CPU. To compare two trees, run it alternately with each first on the path, from
outside the repository: ``PYTHONPATH=TREE TRITON_INTERPRET=1 python
benchmarks/history/guard_host_cpu.py`` (TREE holding ``kvcanary_dispatch`` and
``kvcanary_kernels``)."""

import timeit

import torch

import kvcanary_dispatch.forward_step as forward_step
from kvcanary_dispatch import CanaryCapacities, ForwardStepGuard

forward_step.plan_bundled = lambda *args: None  # the guard's own host path only


def host_us(fn, calls: int = 20000, rounds: int = 3) -> float:
    fn()
    return 1e6 * min(timeit.repeat(fn, number=calls, repeat=rounds)) / calls


for bs in (8, 64, 512):
    guard = ForwardStepGuard(CanaryCapacities(4096, 1 << 20, 1 << 24), device="cpu")
    lengths = dict(
        req_pool_indices=torch.arange(1, bs + 1, dtype=torch.int64),
        prefix_lens=torch.full((bs,), 5, dtype=torch.int64),
        extend_seq_lens=torch.full((bs,), 3, dtype=torch.int64),
    )
    rtt = torch.zeros(bs + 1, 64, dtype=torch.int32)

    def step(lengths=lengths, rtt=rtt, guard=guard, n=3 * bs) -> None:
        for _ in guard.plan_step(**lengths, req_to_token=rtt, num_tokens=n):
            pass

    print(f"bs {bs:4d} guard step without its plan {host_us(step):6.2f} us")
