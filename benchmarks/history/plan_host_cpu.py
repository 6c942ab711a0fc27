"""Steps 27 and 32: host µs of ``plan_offsets`` with its launch stubbed out, on a machine without
a GPU (CPU tensors that pass for tensors on the current CUDA device: ``Tensor.is_cuda``,
``torch.cuda.current_device`` and ``BoundKernel._launch`` replaced, so the figure is the Python
before the compiled launcher, less the CUDA queries). Since step 32 a call takes the one pass;
"full path" is the call with it declined, as every call ran before. To compare two trees, run
it alternately with each first on the path, from outside the repository:
``PYTHONPATH=TREE taskset -c 1 python benchmarks/history/plan_host_cpu.py`` (TREE holding
``kvcanary_dispatch`` and ``kvcanary_kernels``)."""

import timeit
from unittest import mock

import torch

import kvcanary_kernels._launch as launch

torch.cuda.current_device = lambda: -1  # the CPU tensors' get_device()
torch.Tensor.is_cuda = property(lambda self: True)
launch.BoundKernel._launch = lambda self, key, *args: launch._COMPILED.get(key)

import kvcanary_dispatch as kd  # noqa: E402
import kvcanary_dispatch.plan as plan  # noqa: E402
from kvcanary_dispatch.testing.cases import make_plan_case  # noqa: E402


def host_us(fn, calls: int = 3000, rounds: int = 7) -> float:
    fn()
    return 1e6 * min(timeit.repeat(fn, number=calls, repeat=rounds)) / calls


for bs in (8, 64, 512, 4096, 32768):
    case = make_plan_case(prefix_lens=[8] * bs, extend_seq_lens=[4] * bs, max_seq_len=16,
                          device=torch.device("cpu"))  # fmt: skip
    kw = {**case.inputs(), **case.fresh_outputs()}
    one = host_us(lambda kw=kw: kd.plan_offsets(**kw))
    with mock.patch.object(plan, "_launched", lambda *args: False):
        full = host_us(lambda kw=kw: kd.plan_offsets(**kw))
    print(f"bs {bs:6d} plan_offsets auto {one:6.2f} us, full path {full:6.2f} us")
