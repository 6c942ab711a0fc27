#!/usr/bin/env bash
# The GPU runs that tests/gpu/RESULTS.md lists as owed, by name, one after another, each
# logged under OUT, a new or empty folder (run from the repository root, on a machine with a
# CUDA GPU):
#
#   STEP_TIMEOUT=300 bash tests/gpu/owed.sh OUT suite large memcheck racecheck
#   STEP_TIMEOUT=400 bash tests/gpu/owed.sh OUT2 dist plan_props sglang_cuda
#
# Steps (H100 wall times of tests/gpu/RESULTS.md's step 63, 2026-12-05):
#   suite       the whole suite, 4 processes (tests/sglang skips on a GPU: it drives sglang on
#               the CPU's interpreter; the sglang_cuda step runs sglang's CUDA kernels); 211 s
#               at step 63, 230-255 s at steps 80 and 82, 218 s at step 104, past 270 s
#               at step 106 (one run at step 81 needed more than 320 s: give it
#               STEP_TIMEOUT=430). Verbose (-v: a worker that dies is named with the test it ran) and,
#               with pytest-timeout, each test stopped after 150 s by a watcher thread, which
#               prints every thread's stack and ends the worker: a test that hangs, even
#               inside C code that a signal would not interrupt, is then named by xdist as
#               the test its worker crashed in, instead of holding the step to STEP_TIMEOUT
#   large       tests/test_large_addresses.py: its 2**31-column and 2**31-element runs and
#               recount's int64 count; under 1 minute
#   memcheck    compute-sanitizer memcheck over tests/gpu/sanitize.py, every strategy (69 s),
#               then over its bad-offsets calls alone with each tensor an allocation of its
#               own (PYTORCH_NO_CUDA_MEMORY_CACHING=1; memcheck_bad.log; the whole script so
#               ran past 300 s at step 105)
#   racecheck   compute-sanitizer racecheck over sanitize.py's capped, segments and rows
#               calls; 168 s
#   dist        python -m benchmarks.distributions, its output folder and log packed as
#               dist.tar.gz; 88 s on an H100 at c103818
#   plan_sizes  python -m benchmarks.plan_sizes (the plan's bars at large batch sizes),
#               packed as plan_sizes.tar.gz; 21 s on an H100 at a3d6fe6
#   host_overhead  python -m benchmarks.host_overhead --rounds 3 (host time per call against
#               a bare launch), packed as host_overhead.tar.gz; with OLD_TREE=DIR (a checkout
#               of an earlier commit, or its files) it also times that tree, the two trees
#               alternating; 56 s on an H100 at a3d6fe6, with an old tree
#   plan_props  the five plan test_plan_matches_reference tests at the hypothesis gpu
#               profile; 183-194 s, and about 240 s at step 101 (give it STEP_TIMEOUT=300)
#   guard_full  the guard bands, the guard's capacities and its engine loop at full size (the
#               hypothesis gpu profile: batches up to 131 072 requests; the suite runs them at
#               the ci profile's sizes); 25 s on an H200 at 5694b16, 95 s on an H100 at 125b676,
#               179 s on an H100 at 91d59df
#   sglang_cuda tests/gpu/sglang_cuda.py: sglang 0.5.23's own CUDA kv-canary kernels, patched,
#               against sglang's references (sglang_cuda.log, sglang_cuda.json); needs
#               sglang's wheel in .whl/ (below); 142 s on an H200 at 4953101; on a cold
#               H100 at 91d59df past 250 s (its CUDA-JIT build 63 s), 168 s warm: give
#               it STEP_TIMEOUT=350
#
# STEP_TIMEOUT=S stops any step after S seconds (its status then 124; killed 30 s later if it
# ignores that), so that the steps after it still run inside a machine's limit on one command;
# a step so run is in its own process group, which Ctrl-C does not reach. Without it a step
# runs as it is. OUT receives one file a step (its log; for dist, plan_sizes and
# host_overhead a tarball of its output folder and log; sglang_cuda also sglang_cuda.json,
# memcheck also memcheck_bad.log),
# steps.txt (the GPU, driver, torch and Triton versions, then each step's exit status and
# seconds; also printed at the end), install.log and md5.txt (every file of the tree the steps
# ran on, to compare with `git ls-files | xargs md5sum` of a commit): these 3, then one file
# a step (two for sglang_cuda and memcheck), 8 for the first example and 7 for the second;
# so at most five steps a call where only eight files come back from a machine.
# Wheels under .whl/ are installed without dependencies first, for machines with no package
# index: `pip download --no-deps --only-binary=:all: --python-version 3.12 pytest-xdist
# execnet pytest-timeout apache-tvm-ffi msgspec ninja -d .whl` (3.12: the GPU machine's Python)
# brings pytest-xdist (else the pytest steps run in one process, several times slower;
# steps.txt says so), pytest-timeout (else no per-test limit; steps.txt says so) and what
# sglang's CUDA-JIT build imports; `pip download --no-deps
# --only-binary=:all: --python-version 3.11 sglang==0.5.23 -d .whl` brings sglang, whose wheel
# is tagged for CPython 3.11 only: it is unpacked onto PYTHONPATH for the sglang_cuda step (the
# modules it uses are pure Python), never installed. (Both downloads as for Linux x86-64: run
# them on such a machine, or add `--platform manylinux_2_34_x86_64`.) A wheel pip cannot
# install there fails the whole list, and install.log says which.
set -u
out=${1:?usage: bash tests/gpu/owed.sh OUT STEP...}
shift
for step in "$@"; do  # every name checked before anything runs
    case $step in
        suite | large | memcheck | racecheck | dist | plan_sizes | host_overhead | plan_props \
            | sglang_cuda | guard_full) ;;
        *)
            echo "unknown step '$step' (suite large memcheck racecheck dist plan_sizes" \
                "host_overhead plan_props sglang_cuda guard_full)" >&2
            exit 2
            ;;
    esac
done
if [ -e "$out" ] && [ -n "$(ls -A "$out")" ]; then
    echo "$out is not empty: give each call a new folder" >&2
    exit 2
fi
mkdir -p "$out"
export PYTHONUNBUFFERED=1
# The results folder may sit inside the tree: keep it out of the md5 list.
skip=$(realpath -m --relative-to=. "$out")

notes=()
wheels=()
for w in .whl/*.whl; do  # sglang's is unpacked by its step, not installed
    [ -e "$w" ] && [[ $(basename "$w") != sglang-* ]] && wheels+=("$w")
done
if [ ${#wheels[@]} -gt 0 ]; then
    python3 -m pip install -q --no-deps "${wheels[@]}" > "$out/install.log" 2>&1 \
        || notes+=("installing .whl/*.whl failed: install.log")
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . >> "$out/install.log" 2>&1 \
    || { echo "install failed: $out/install.log" >&2; exit 1; }
# What .gitignore ignores stays out of it too.
find . -type f -not -path './.git/*' -not -path './.whl/*' -not -path "./$skip/*" \
    -not -path '*/__pycache__/*' -not -path '*.egg-info/*' -not -path '*/.hypothesis/*' \
    -not -path '*/.pytest_cache/*' -not -path '*/.ruff_cache/*' -not -path '*/.venv/*' \
    -not -path '*/venv/*' -not -path '*/build/*' -not -path '*/sweep-*/*' \
    -not -path './.bench_old/*' -printf '%P\n' | LC_ALL=C sort | xargs -d '\n' md5sum \
    > "$out/md5.txt"
if python3 -c "import xdist" 2> /dev/null; then
    suite_par=(-n 4 --dist loadfile) props_par=(-n 5 --dist load)
else
    suite_par=() props_par=()
    notes+=("pytest-xdist missing: every pytest step runs in one process")
fi
if python3 -c "import pytest_timeout" 2> /dev/null; then
    suite_limit=(--timeout 150 --timeout-method thread)
else
    suite_limit=()
    notes+=("pytest-timeout missing: the suite's tests run without a per-test limit")
fi
{
    nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv,noheader
    python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
    for note in ${notes[@]+"${notes[@]}"}; do echo "note: $note"; done
} > "$out/steps.txt" 2>&1

run_step() {  # NAME COMMAND...: the command's output into OUT/NAME.log, its status into steps.txt
    local name=$1 start=$SECONDS
    shift
    if [ -n "${STEP_TIMEOUT:-}" ]; then
        timeout -k 30 "$STEP_TIMEOUT" "$@" > "$out/$name.log" 2>&1
    else
        "$@" > "$out/$name.log" 2>&1
    fi
    echo "$name rc=$? $((SECONDS - start)) s" >> "$out/steps.txt"
}

pack() {  # NAME: a benchmark's output folder OUT/NAME and its log packed as OUT/NAME.tar.gz
    if [ ! -d "$out/$1" ]; then
        echo "$1: no output folder (see $1.log)" >> "$out/steps.txt"
    elif tar -czf "$out/$1.tar.gz" -C "$out" "$1" "$1.log" 2>> "$out/steps.txt"; then
        rm -r "${out:?}/$1" "$out/$1.log"
    fi
}

for step in "$@"; do
    case $step in
        suite) run_step suite python3 -m pytest -v -rfE ${suite_par[@]+"${suite_par[@]}"} \
            ${suite_limit[@]+"${suite_limit[@]}"} -p no:cacheprovider tests ;;
        large) run_step large python3 -m pytest -q -rs -p no:cacheprovider \
            tests/test_large_addresses.py ;;
        memcheck) run_step memcheck compute-sanitizer --tool memcheck python3 tests/gpu/sanitize.py
            PYTORCH_NO_CUDA_MEMORY_CACHING=1 run_step memcheck_bad \
                compute-sanitizer --tool memcheck python3 tests/gpu/sanitize.py bad ;;
        racecheck) run_step racecheck compute-sanitizer --tool racecheck \
            python3 tests/gpu/sanitize.py capped segments rows ;;
        dist)
            run_step dist python3 -m benchmarks.distributions --out "$out/dist"
            pack dist
            ;;
        plan_sizes)
            run_step plan_sizes python3 -m benchmarks.plan_sizes --out "$out/plan_sizes"
            pack plan_sizes
            ;;
        host_overhead)
            run_step host_overhead python3 -m benchmarks.host_overhead --out "$out/host_overhead" \
                --rounds 3 ${OLD_TREE:+--old-tree "$OLD_TREE"}
            pack host_overhead
            ;;
        sglang_cuda)
            site=$(mktemp -d) scratch=$(mktemp -d)
            wheel=$(compgen -G ".whl/sglang-*.whl" | head -n 1)
            if [ -z "$wheel" ]; then
                echo "sglang_cuda: no .whl/sglang-*.whl to unpack: not run" >> "$out/steps.txt"
            elif ! python3 -m zipfile -e "$wheel" "$site" > "$out/sglang_cuda.log" 2>&1; then
                echo "sglang_cuda: unpacking $wheel failed (sglang_cuda.log)" >> "$out/steps.txt"
            else
                run_step sglang_cuda env PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}" \
                    python3 tests/gpu/sglang_cuda.py --out "$scratch"
                cp "$scratch/sglang_cuda.json" "$out/" 2> /dev/null \
                    || echo "sglang_cuda: it wrote no sglang_cuda.json" >> "$out/steps.txt"
            fi
            rm -rf "$site" "$scratch"
            ;;
        plan_props) run_step plan_props env HYPOTHESIS_PROFILE=gpu python3 -m pytest -v \
            ${props_par[@]+"${props_par[@]}"} -p no:cacheprovider tests/test_dispatch_properties.py \
            -k test_plan_matches_reference ;;
        guard_full) run_step guard_full env HYPOTHESIS_PROFILE=gpu python3 -m pytest -q -s -rs \
            -p no:cacheprovider tests/test_guard_bands.py tests/test_capacities_guard.py \
            tests/test_engine_loop_guard.py ;;
    esac
done
cat "$out/steps.txt"
