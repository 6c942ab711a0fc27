"""Step 27: host µs of ``plan_offsets`` with its launch stubbed out, on a machine without a GPU
(CPU tensors; ``torch.cuda.current_device`` and ``BoundKernel._launch`` replaced, so the figure
is the Python before the compiled launcher, less the CUDA queries). To compare two trees, run
it alternately with each first on the path, from outside the repository:
``PYTHONPATH=TREE taskset -c 1 python benchmarks/history/plan_host_cpu.py`` (TREE holding
``kvcanary_dispatch`` and ``kvcanary_kernels``)."""

import timeit

import torch

import kvcanary_kernels._launch as launch

torch.cuda.current_device = lambda: -1  # the CPU tensors' get_device()
launch.BoundKernel._launch = lambda self, key, *args: launch._COMPILED.get(key)

import kvcanary_dispatch as kd  # noqa: E402
from kvcanary_dispatch.testing.cases import make_plan_case  # noqa: E402


def host_us(fn, calls: int = 3000, rounds: int = 7) -> float:
    fn()
    return 1e6 * min(timeit.repeat(fn, number=calls, repeat=rounds)) / calls


for bs in (8, 64, 512, 4096, 32768):
    case = make_plan_case(prefix_lens=[8] * bs, extend_seq_lens=[4] * bs, max_seq_len=16,
                          device=torch.device("cpu"))  # fmt: skip
    kw = {**case.inputs(), **case.fresh_outputs()}
    print(f"bs {bs:6d} plan_offsets auto {host_us(lambda kw=kw: kd.plan_offsets(**kw)):6.2f} us")
