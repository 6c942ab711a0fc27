"""Mutations of the guard's fill (``placement.made_apart``), each with the tests that must
catch it: ``python3 tests/gpu/guard_fill_mutations.py NAME`` from the repository root, on a
GPU, applies mutation NAME (``no_relaxed``: the host wait outside relaxed capture mode;
``no_sync``: no host wait; ``current_stream``: the fill on the caller's stream, as before),
runs those tests of ``tests/test_guard_fill.py``, prints the outcome (a failure is the
expected one) and restores the file."""

import sys

from _mutate import mutate

P = "kvcanary_dispatch/placement.py"
MUTATIONS = {
    "no_relaxed": (
        P,
        "        with torch.cuda.stream(apart), _relaxed_capture_mode():\n",
        "        with torch.cuda.stream(apart):  # mutation\n",
        "leave_another_threads_capture_whole",
    ),
    "no_sync": (
        P,
        "            apart.synchronize()\n",
        "            pass  # mutation\n",
        "wait_for_their_fill",
    ),
    "current_stream": (
        P,
        '        if device.type != "cuda":\n',
        "        if True:  # mutation\n",
        "filled_before or wait_for_their_fill or another_threads",
    ),
}
if __name__ == "__main__":
    path, old, new, k = MUTATIONS[sys.argv[1]]
    mutate(path, old, new, ["tests/test_guard_fill.py", "-k", k])
