"""Mutations of the code that only a CUDA GPU runs in earnest, each with the tests that must
catch it.

``python3 tests/gpu/gpu_path_mutations.py [-j N] [--timeout S] [--tests SELECTION] [NAME ...]``
from the repository root first runs every mutant's test selection on the unmutated files (in
one copy of the tree, ``N`` selections at once), then applies each mutant (all of them, or those
named) in a copy of its own (``_mutate.make_copy``) and runs its selection there, ``N`` at once.
A run is ``python -m pytest -q -p no:cacheprovider -x SELECTION``, stopped after ``--timeout``
seconds (default 240). A selection is ``"FILES -k EXPR"``, each file named as ``X`` for
``tests/test_X.py``; ``--tests`` gives every mutant that one selection instead of its own. For
each mutant it prints the pytest return code and the end of the output, then a table: rc 1 is
"killed" (the expected outcome), rc 0 "survived", a run past the limit "timeout", a signal
"crashed" (the mutant showed, though not as a failed test) and any other code "error" (5: the
selection collected nothing). A mutant whose selection failed unmutated is marked "no
baseline": it cannot be judged. The exit status is 0 only when the baseline passed and every
mutant was killed. ``--list`` lists the mutants.

The mutants change what a user would see: a wrong byte, a refusal missed, a launch made where
the call should be refused, a cached launch or buffer reused where it must not be. They cover
the scatter's and the plan's one-pass launches (their checks, shared-memory checks and cached
launch look-ups), the refusals during CUDA-graph capture, CPU and int32 offsets on their way to
the GPU, the plan look-back's state kept per stream and thread, and the cached compiled
launches. On a CPU most of them are caught too, through the tests that make CPU tensors pass
for the current GPU's (``tests/_one_pass.py``) or read the stream as capturing; the pinned
upload of CPU offsets and the compiled launches' cache keys and stream need the GPU. Not
covered: the device guard that makes a tensor's GPU current (``on_device``), which needs two
GPUs.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

from _mutate import ROOT, make_copy, run_pytest, tree_files

SC, PL = "kvcanary_dispatch/scatter.py", "kvcanary_dispatch/plan.py"
RS, PC = "kvcanary_dispatch/resident.py", "kvcanary_dispatch/placement.py"
KL = "kernels/_launch.py"
ONE_LAUNCH_KEY = "_one_launch.__dict__.setdefault"  # a cache keyed on too little

# NAME: (file, old, new, "test files (tests/test_X.py) -k expression"). Each old text occurs
# once in its file.
# fmt: off
MUTANTS = {
    # The scatter's one pass takes an int64 pool: a refusal missed.
    "sc_pool_dtype": (SC, "and pool_out.dtype is torch.int32\n", "and True  # mutation\n",
        "dispatch_api_errors one_pass_launch -k pool_int64 or declines_and_launches_nothing"),
    # It takes int32 flat_in.
    "sc_flat_dtype": (SC,
        "and flat_in.dtype is offsets.dtype is req_pool_indices.dtype is torch.int64\n",
        "and offsets.dtype is req_pool_indices.dtype is torch.int64  # mutation\n",
        "dispatch_api_errors one_pass_launch -k flat_in_int32 or declines_and_launches_nothing"),
    # It takes a strided or 2-D flat_in (read as contiguous).
    "sc_flat_stride": (SC,
        "and flat_in.stride() == offsets.stride() == req_pool_indices.stride() == (1,)\n",
        "and offsets.stride() == req_pool_indices.stride() == (1,)  # mutation\n",
        "dispatch_api_errors -k flat_in_strided or flat_in_2d or non_contiguous_inputs"),
    # It takes strided int64 device offsets (read as contiguous).
    "sc_offsets_stride": (SC,
        "and flat_in.stride() == offsets.stride() == req_pool_indices.stride() == (1,)\n",
        "and flat_in.stride() == req_pool_indices.stride() == (1,)  # mutation\n",
        "dispatch_api_errors -k strided_offsets or offsets_2d"),
    # It takes a pool whose columns are strided (written as contiguous).
    "sc_pool_col_stride": (SC, "and strides[1] == 1\n", "and strides[1] >= 1  # mutation\n",
        "dispatch_api_errors dispatch_api -k pool_cols_strided or one_column_pool"),
    # It takes flat_in on another GPU than the pool's (a CPU tensor is declined by is_cuda).
    "sc_flat_device": (SC, "and flat_in.get_device() == offsets.get_device() == device\n",
        "and offsets.get_device() == device  # mutation\n",
        "dispatch_properties one_pass_launch -k elsewhere"),
    # It takes req_pool_indices on another GPU.
    "sc_rows_device": (SC,
        "and req_pool_indices.get_device() == device == torch.cuda.current_device()\n",
        "and device == torch.cuda.current_device()  # mutation\n",
        "dispatch_properties one_pass_launch -k elsewhere"),
    # It launches on the current GPU a call whose tensors are all on another.
    "sc_current_device": (SC,
        "and req_pool_indices.get_device() == device == torch.cuda.current_device()\n",
        "and req_pool_indices.get_device() == device  # mutation\n",
        "one_pass_launch -k another_device"),
    # It takes a flat_in of another device type that shares the GPU's index.
    "sc_is_cuda": (SC, "            and flat_in.is_cuda\n", "            and True  # mutation\n",
        "one_pass_launch -k elsewhere"),
    # It takes offsets of another length than bs + 1.
    "sc_offsets_len": (SC, "if offsets.shape[0] != bs + 1 or strides[0] < width:\n",
        "if strides[0] < width:  # mutation\n", "dispatch_api_errors one_pass_launch -k "
        "offsets_short or offsets_long or declines_and_launches_nothing"),
    # It takes a pool whose rows overlap.
    "sc_row_overlap": (SC, "if offsets.shape[0] != bs + 1 or strides[0] < width:\n",
        "if offsets.shape[0] != bs + 1:  # mutation\n",
        "dispatch_api -k overlapping_pool_rows or one_row_pool"),
    # Its shared-memory prefilter ends the pool before its last row.
    "sc_pool_end": (SC, "end = pool + ((rows - 1) * pitch + width) * 4\n",
        "end = pool + (rows - 1) * pitch * 4  # mutation\n",
        "aliasing one_pass_launch -k pool_sharing_memory"),
    # Its shared-memory check skipped.
    "sc_share_skipped": (SC, "if _pool_shares_memory(addresses, pool_out.shape[0], strides[0],"
        " width, tokens, bs):\n", "if False:  # mutation\n",
        "aliasing one_pass_launch -k scatter_refuses or scatter_accepts or one_pass_sees or "
        "pool_sharing_memory or windows_rows"),
    # Its row-by-row check no longer compares flat_in.
    "sc_share_flat_rows": (SC, "meet(rows_of, run(flat, tokens * 8))\n", "False  # mutation\n",
        "aliasing one_pass_launch -k pool_sharing_memory"),
    # Its launch gets the pool's width for its row pitch: a column window written wrong.
    "sc_pitch_arg": (SC, "addresses, (tokens, bs, strides[0], width))\n",
        "addresses, (tokens, bs, width, width))  # mutation\n",
        "dispatch_api aliasing one_pass_launch -k strided_pool_rows or "
        "inputs_between_a_pool_windows_rows or full_path_launches"),
    # Its cached launch keyed without the token count: the first count for (bs, width) sticks.
    "sc_stale_tokens": (SC, "one = _one_launch(bs, tokens, chunk_size, strategy, width)\n",
        f"one = _one_launch(bs, {ONE_LAUNCH_KEY}((bs, width), tokens), chunk_size, strategy,"
        " width)  # mutation\n", "engine_loop -k eager_loop_every_strategy"),
    # Its cached launch keyed without the pool width: a plan for a pool no wider than
    # capped's cap (no tails) kept for a wider pool whose longer run needs them.
    "sc_stale_width": (SC, "one = _one_launch(bs, tokens, chunk_size, strategy, width)\n",
        f"one = _one_launch(bs, tokens, chunk_size, strategy, {ONE_LAUNCH_KEY}((bs, tokens, "
        "chunk_size, strategy), width))  # mutation\n", "one_pass_launch -k another_pool_width"),
    # int32 device offsets widened into a buffer never filled from them (zeros, not garbage:
    # a block of the caching allocator could hold the right offsets by chance).
    "sc_widen_unfilled": (SC, "offsets.copy_(widen)\n", "offsets.zero_()  # mutation\n",
        "dispatch_api dispatch_api_errors one_pass_launch -k int32_offsets_promoted or "
        "strided_offsets or int64_copy"),
    # CPU int32 offsets uploaded as int32 (refused by the kernels' checks).
    "sc_host_not_widened": (SC,
        "offsets = torch.empty(offsets.shape, dtype=torch.int64, device=device)\n",
        "offsets = torch.empty(offsets.shape, dtype=offsets.dtype, device=device)  # mutation\n",
        "engine_safety dispatch_api -k item1 or cpu_offsets_no_device_to_host_copy"),
    # CPU offsets not refused during capture (the graph would replay capture-time offsets).
    "sc_host_capture": (SC, "refuse_capture(device, what, fix.format(device=device))\n",
        "pass  # mutation\n",
        "engine_safety engine_safety_host -k host_offsets_refused_during_capture or "
        "host_offsets_refused_before"),
    # The plan's capture refusal ignored: a loop's slice-offset read-back recorded in a graph.
    "sc_loop_capture": (SC,
        "refusal = plan.capture_refusal if offsets_on != \"host\" else None"
        "  # host: refused above\n",
        "refusal = None  # mutation\n",
        "engine_safety engine_safety_host -k loop_with_device_offsets_refused_during_capture or "
        "int32_device_offsets_refused_before_any_op"),
    # The plan's validate=True not refused during capture.
    "pl_validate_capture": (PL, "refuse_capture(\n            o.out_verify_offsets.device,\n",
        "(lambda *a: None)(  # mutation\n            o.out_verify_offsets.device,\n",
        "engine_safety engine_safety_host -k plan_validate_refused_during_capture or "
        "validate_refused_before"),
    # CPU offsets uploaded straight from the caller's tensor: a pinned one is read late.
    "pc_upload_unstaged": (PC,
        "staging = torch.empty(host.shape, dtype=device_copy.dtype, pin_memory=True)\n"
        "    staging.copy_(host)\n    device_copy.copy_(staging, non_blocking=True)\n",
        "device_copy.copy_(host, non_blocking=True)  # mutation\n",
        "engine_safety engine_safety_host -k item1 or back_to_back"),
    # The plan's one pass launches its eager plan while the stream captures.
    "pl_capture_ignored": (PL, "if by_capture and torch.cuda.is_current_stream_capturing():\n",
        "if False:  # mutation\n", "resident_state cuda_graph plan_one_pass -k "
        "captured_call or plan_graph_replay or capturing_stream"),
    # The full path plans a capturing stream's call as an eager one (the resident state).
    "pl_full_capture_plan": (PL, "if plan.by_capture and (not resident or capturing(o.out_verify"
        "_offsets.device)):\n", "if plan.by_capture and not resident:  # mutation\n",
        "resident_state cuda_graph -k captured_call or planned_as_captured or plan_graph_replay"),
    # The plan's one pass launches on the current GPU a call whose tensors are on another.
    "pl_current_device": (PL,
        "if head is None or not out.is_cuda or head.device != torch.cuda.current_device():",
        "if head is None or not out.is_cuda:  # mutation", "plan_one_pass -k another_device"),
    # ... and a call on another device type that shares the GPU's index.
    "pl_is_cuda": (PL,
        "if head is None or not out.is_cuda or head.device != torch.cuda.current_device():",
        "if head is None or head.device != torch.cuda.current_device():  # mutation",
        "plan_one_pass -k elsewhere or another_device"),
    # The plan's one pass launches outputs that share memory with an input or each other.
    "pl_share_skipped": (PL,
        "    if plan_outputs_share_memory(i, o, head):\n        return False\n",
        "    pass  # mutation\n", "aliasing plan_one_pass -k sharing_memory or refuses"),
    # The plan's cached launch keyed without the LUT: the first call's kernel for both.
    "pl_stale_lut": (PL, "one = _one_launch(bs, chunk_size, strategy, lut_len > 0)\n",
        f"one = _one_launch(bs, chunk_size, strategy, {ONE_LAUNCH_KEY}((bs, chunk_size, "
        "strategy), lut_len > 0))  # mutation\n",
        "plan_one_pass -k on_gpu_is_exact or launches_what_the_full_path"),
    # The one pass's look-back state kept after a launch that failed part-way.
    "pl_discard_skipped": (PL, "if state_words:\n            discard(_STATE, out.device)\n",
        "if state_words:\n            pass  # mutation\n",
        "resident_state plan_one_pass -k failed"),
    # One look-back state for every stream of a device.
    "rs_stream_shared": (RS, "return _kept((name, index, stream), size, make), stream\n",
        "return _kept((name, index, 0), size, make), stream  # mutation\n",
        "resident_state -k streams_keep or cuda_stream_buffer or captured_call"),
    # One set of look-back states for every host thread.
    "rs_thread_shared": (RS, "_LOCAL = threading.local()",
        '_LOCAL = type("Shared", (), {})()  # mutation',
        "resident_state -k threads_keep or own_buffers"),
    # A look-back state too small for the call is kept.
    "rs_no_grow": (RS, "if buffer is None or buffer.shape[0] < size:\n",
        "if buffer is None:  # mutation\n", "resident_state -k re_arms or every_size"),
    # The one-pass launches' cached binary keyed without the addresses' alignment.
    "kl_residues": (KL, '"checked", _residues(addresses), _widths(ints, device))\n',
        '"checked", 0, _widths(ints, device))  # mutation\n',
        "one_pass_launch launch_cache -k on_gpu_is_exact or unaligned"),
    # ... keyed without the integers' widths (a window past int32 read as an int32).
    "kl_widths": (KL, '"checked", _residues(addresses), _widths(ints, device))\n',
        '"checked", _residues(addresses), True)  # mutation\n', "launch_cache -k past_int32"),
    # Cached launches that are not handed a stream go to the legacy default stream.
    "kl_default_stream": (KL, "stream = driver.active.get_current_stream(device)\n",
        "stream = 0  # mutation\n", "plan_one_pass -k launches_on_the_current_stream"),
}
# fmt: on


def selection(tests: str) -> list[str]:
    """The pytest arguments of a mutant's ``tests`` string."""
    files, _, keywords = tests.partition(" -k ")
    paths = [f"tests/test_{name}.py" for name in files.split()]
    return [*paths, "-k", keywords] if keywords else paths


def verdict(rc: int | None) -> str:
    if rc is None:
        return "timeout"
    if rc < 0:
        return f"crashed (signal {-rc})"
    return {0: "survived", 1: "killed"}.get(rc, "error")


_PRINT = threading.Lock()


def report(title: str, rc: int | None, outcome: str, out: str, lines: int = 25) -> None:
    """Print ``title``, the return code, ``outcome`` and the last ``lines`` of ``out``."""
    with _PRINT:
        print(f"== {title}: pytest rc={rc} ({outcome})")
        print("\n".join(out.rstrip().splitlines()[-lines:]), flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", metavar="NAME", help="mutants to run (all if none)")
    parser.add_argument("-j", "--jobs", type=int, default=8, help="runs at once (8)")
    parser.add_argument("--timeout", type=float, default=240, help="seconds a run (240)")
    parser.add_argument(
        "--tests",
        metavar="SELECTION",
        help='one selection for every mutant: "FILES -k EXPR", X for tests/test_X.py',
    )
    parser.add_argument("--list", action="store_true", help="list the mutants and exit")
    parser.add_argument("--no-baseline", action="store_true", help="skip the unmutated runs")
    a = parser.parse_args()
    if a.list:
        for name, (path, _, _, tests) in MUTANTS.items():
            print(f"{name:22} {path:32} {tests}")
        return 0
    unknown = [n for n in a.names if n not in MUTANTS]
    if unknown:
        parser.error(f"unknown mutants {unknown}; --list lists them")
    names = a.names or list(MUTANTS)
    if a.tests:
        for name in names:
            MUTANTS[name] = (*MUTANTS[name][:3], a.tests)
    for name in names:  # every old text once, in the working tree, before any run
        path, old, _, _ = MUTANTS[name]
        assert (ROOT / path).read_text().count(old) == 1, f"{name}: {old!r} not once in {path}"
    files = tree_files()
    pool = ThreadPoolExecutor(max_workers=a.jobs)
    failed_baseline: dict[str, int | None] = {}
    if not a.no_baseline:
        base = make_copy(files)
        tests = sorted({MUTANTS[n][3] for n in names})

        def baseline(t: str) -> None:
            rc, out = run_pytest(base, selection(t), a.timeout)
            outcome, lines = ("passed", 3) if rc == 0 else ("FAILED", 25)
            report(f"baseline {t}", rc, outcome, out, lines)
            if rc != 0:
                failed_baseline[t] = rc

        list(pool.map(baseline, tests))
        shutil.rmtree(base, ignore_errors=True)
        if failed_baseline:
            print("\n!!!!! THE UNMUTATED BASELINE FAILED: the mutants of these selections cannot")
            print("!!!!! be judged (their verdict is 'no baseline'):")
            for t, rc in failed_baseline.items():
                print(f"!!!!!   rc={rc}: {t}")
            print(flush=True)

    def mutant(name: str) -> tuple[int | None, str]:
        path, old, new, tests = MUTANTS[name]
        copy = make_copy(files, (path, old, new))
        try:
            rc, out = run_pytest(copy, selection(tests), a.timeout)
        finally:
            shutil.rmtree(copy, ignore_errors=True)
        outcome = "no baseline" if tests in failed_baseline else verdict(rc)
        report(f"{name} ({path})", rc, outcome, out)
        return rc, outcome

    results = dict(zip(names, pool.map(mutant, names), strict=True))
    print(f"\n{'NAME':22} {'FILE':32} {'RC':>5}  VERDICT")
    for name, (rc, outcome) in results.items():
        print(f"{name:22} {MUTANTS[name][0]:32} {rc!s:>5}  {outcome}")
    killed = all(rc == 1 for rc, _ in results.values())
    return 0 if killed and not failed_baseline else 1


if __name__ == "__main__":
    sys.exit(main())
