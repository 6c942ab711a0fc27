"""Steps 31 and 32: host µs of ``scatter_req_token_ids`` and of each of its steps, with the
launch stubbed out, on a machine without a GPU (CPU tensors that pass for tensors on the current
CUDA device: ``Tensor.is_cuda``, ``torch.cuda.current_device`` and ``BoundKernel._launch``
replaced, so the figures are the Python before the compiled launcher, less the CUDA queries).
The whole call takes the one pass (step 32); "full path" is the call with it declined, as
every call ran before step 32. Best of 7 rounds of 3 000 calls:
``PYTHONPATH=. taskset -c 1 python benchmarks/history/scatter_host_cpu.py``, on the tree of
its steps (c3da1ef): ``validation.promote_offsets``, which it times, was removed in a02d3da."""

import timeit
from contextlib import nullcontext
from unittest import mock

import torch

import kvcanary_kernels._launch as launch

torch.cuda.current_device = lambda: -1  # the CPU tensors' get_device()
torch.Tensor.is_cuda = property(lambda self: True)
launch.BoundKernel._launch = lambda self, key, *args, **kw: launch._COMPILED.get(key)

import kvcanary_dispatch as kd  # noqa: E402
import kvcanary_dispatch.scatter as scatter  # noqa: E402
from kvcanary_dispatch.launch_plan import scatter_launch_plan  # noqa: E402
from kvcanary_dispatch.placement import on_device  # noqa: E402
from kvcanary_dispatch.scatter import _launched, _one_launch, _scatter  # noqa: E402
from kvcanary_dispatch.testing.cases import make_scatter_case  # noqa: E402
from kvcanary_dispatch.validation import promote_offsets  # noqa: E402
from kvcanary_kernels.args import ScatterArgs  # noqa: E402
from kvcanary_kernels.scatter_req_token_ids import check_scatter_args  # noqa: E402


def host_us(fn, calls: int = 3000, rounds: int = 7) -> float:
    fn()
    return 1e6 * min(timeit.repeat(fn, number=calls, repeat=rounds)) / calls


for bs in (8, 4096):
    case = make_scatter_case([3] * bs, width=64, device=torch.device("cpu"))
    kw = case.kwargs(case.fresh_pool())
    t = ScatterArgs(kw["flat_in"], kw["offsets"], kw["req_pool_indices"], kw["pool_out"])
    f, o, _, p = t
    strategy = scatter_launch_plan(bs, f.shape[0], None, "auto", "device", p.shape[1]).strategy
    steps = {
        "the whole call": lambda kw=kw: kd.scatter_req_token_ids(**kw),
        "  _launched (the one pass)": lambda t=t: _launched(*t, None, "auto"),
        "    _one_launch (cached)": lambda bs=bs, f=f, p=p: _one_launch(
            bs, f.shape[0], None, "auto", p.shape[1]
        ),
        "the whole call, full path": lambda kw=kw: kd.scatter_req_token_ids(**kw),
        "  torch.compiler.is_compiling()": torch.compiler.is_compiling,
        "  on_device(pool_out.device)": lambda p=p: on_device(p.device),
        "  _scatter (inside on_device)": lambda t=t: _scatter(*t, None, "auto", False),
        "    offsets.is_cpu, promote_offsets": lambda o=o: o.is_cpu or promote_offsets(o),
        "    ScatterArgs": lambda t=t: ScatterArgs(*t),
        "    check_scatter_args": lambda t=t: check_scatter_args(t, batch_block=None),
        "    scatter_launch_plan (cached)": lambda bs=bs, f=f, p=p: scatter_launch_plan(
            bs, f.shape[0], None, "auto", "device", p.shape[1]
        ),
        "    kernel_args": t.kernel_args,
        "    specialise(kernel_args)": lambda t=t: launch.specialise(t.kernel_args(), -1),
    }
    print(f"bs {bs} (auto: {strategy})")
    for name, fn in steps.items():
        full = "full path" in name  # timed with the one pass declined
        with (
            mock.patch.object(scatter, "_launched", lambda *args: False) if full else nullcontext()
        ):
            print(f"  {name:38s} {host_us(fn):6.2f} us")
