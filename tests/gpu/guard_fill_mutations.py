"""Mutations of the guard's fill (``placement.made_apart``), each with the tests that must
catch it: ``python3 tests/gpu/guard_fill_mutations.py NAME`` from the repository root, on a
GPU, applies mutation NAME (``no_relaxed``: the host wait outside relaxed capture mode;
``no_sync``: no host wait; ``current_stream``: the fill on the caller's stream, as before),
runs those tests of ``tests/test_guard_fill.py``, prints the outcome (a failure is the
expected one) and restores the file."""

import subprocess
import sys

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
name = sys.argv[1]
path, old, new, k = MUTATIONS[name]
src = open(path).read()
assert src.count(old) == 1, name
open(path, "w").write(src.replace(old, new))
try:
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "tests/test_guard_fill.py",
            "-k",
            k,
        ],
        capture_output=True,
        text=True,
    )
    print(f"== mutation {name}: rc={r.returncode}")
    print(r.stdout[-6000:])
    print(r.stderr[-2000:])
finally:
    open(path, "w").write(src)
