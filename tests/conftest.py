"""Test set-up: Triton's interpreter on machines without a GPU, hypothesis profiles, devices
and the markers that need them.

``TRITON_INTERPRET=1`` must be set before any kernel module is imported, so it is set here,
at collection time, when no CUDA device is present; the interpreter then skips its repeated
patching of ``triton.language`` in helper calls (``tests/_interpreter.py``).
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ.get("TRITON_INTERPRET") == "1":
    from _interpreter import skip_repeated_patching  # noqa: E402
    from _interpreter_bounds import check_bounds  # noqa: E402

    skip_repeated_patching()  # test speed only: tests/_interpreter.py
    check_bounds()  # an access outside a launch's tensors fails: tests/_interpreter_bounds.py

from hypothesis import HealthCheck, settings  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
GPU = DEVICE == "cuda"
TWO_GPUS = GPU and torch.cuda.device_count() >= 2

settings.register_profile(
    "ci",
    derandomize=True,
    database=None,
    deadline=None,
    max_examples=25,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "dev",
    deadline=None,
    max_examples=50,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "gpu",
    deadline=None,
    max_examples=2000,
    print_blob=True,
    suppress_health_check=list(HealthCheck),
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


# The variables that change what the library, the command line and the tests do. Only these
# are watched: torch and Triton set others for themselves at first use (cache folders, tool
# paths), whichever test that happens in.
_WATCHED_ENV = ("KVCANARY", "TRITON_INTERPRET", "HYPOTHESIS", "CUDA_VISIBLE_DEVICES", "MPLBACKEND")


def _environment() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k.startswith(_WATCHED_ENV)}


@pytest.fixture(autouse=True)
def _environment_left_as_found():
    """Every test leaves the variables of ``_WATCHED_ENV`` as it found them: one a test leaves
    set (``TRITON_INTERPRET=1`` on a GPU machine) changes what later tests in its worker run.
    A change is undone, and the test that made it fails, naming the variables."""
    before = _environment()
    yield
    after = _environment()
    if after != before:
        changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
        for name in after.keys() - before.keys():
            del os.environ[name]
        os.environ.update(before)
        pytest.fail(f"the test left environment variables changed: {changed}")


def gpu(test):
    """Marked ``gpu`` and skipped without a CUDA device."""
    return pytest.mark.gpu(pytest.mark.skipif(not GPU, reason="needs a CUDA device")(test))


def two_gpus(test):
    """Marked ``gpu`` and skipped without two CUDA devices."""
    return pytest.mark.gpu(pytest.mark.skipif(not TWO_GPUS, reason="needs two CUDA devices")(test))


def engine_steps(cpu: int) -> int:
    """Steps of an engine loop: ``KVCANARY_ENGINE_STEPS``, else 1000 on a GPU and ``cpu``
    without."""
    env = os.environ.get("KVCANARY_ENGINE_STEPS")
    return int(env) if env else (1000 if GPU else cpu)


def capture_graph(fn) -> torch.cuda.CUDAGraph:
    """Warm ``fn`` up on a side stream (Triton compiles, the allocator settles), then capture
    one call of it in a CUDA graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph
