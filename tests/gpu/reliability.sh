#!/usr/bin/env bash
# The GPU reliability runs, one after another, each logged under $1 (default
# tests/gpu/results/, where the committed evidence lives; run from the repository root):
# compute-sanitizer memcheck and racecheck over tests/gpu/sanitize.py, the full-size guard
# bands, then every other test at the hypothesis `gpu` profile (2000 examples a property).
# The 10-minute soak runs beside it:
#   python3 -m kvcanary_dispatch fuzz --device cuda --sizes gpu --minutes 10
set -u
out=${1:-tests/gpu/results}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
step() { echo "== $1 $(date -u +%H:%M:%S)" >> "$out/steps.txt"; }
step memcheck
compute-sanitizer --tool memcheck python3 tests/gpu/sanitize.py > "$out/memcheck.txt" 2>&1
step racecheck
compute-sanitizer --tool racecheck python3 tests/gpu/sanitize.py > "$out/racecheck.txt" 2>&1
step guard_bands
HYPOTHESIS_PROFILE=gpu python3 -m pytest -q -s -p no:cacheprovider tests/test_guard_bands.py \
    > "$out/guard_bands.txt" 2>&1
step pytest_gpu_profile
HYPOTHESIS_PROFILE=gpu python3 -m pytest -q -p no:cacheprovider --ignore=tests/test_guard_bands.py \
    tests > "$out/pytest_gpu_profile.txt" 2>&1
step done
