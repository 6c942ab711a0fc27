set -u
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
export PYTHONPATH=$PWD
R=$OUT/r; mkdir -p $R
{ git rev-parse HEAD 2>/dev/null; md5sum kernels/*.py kvcanary_dispatch/*.py; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; python3 -c "import torch,triton,sys;print(torch.__version__,triton.__version__,sys.version.split()[0])"; } > $R/versions.txt 2>&1
T0=$(date +%s)
timeout 170 python3 -m pytest -v -rs -p no:cacheprovider tests/test_guard_streams.py tests/test_large_addresses.py tests/test_capacities.py --durations=8 > $R/targeted.txt 2>&1; echo "targeted rc=$? $(( $(date +%s)-T0 ))s" >> $R/summary.txt
T1=$(date +%s)
cat > /tmp/mut.py <<'PY'
import sys, pytest
from kvcanary_dispatch import placement
placement.EarlyUpload.order_reads = lambda self, *a, **k: None
sys.exit(pytest.main(["-q", "-p", "no:cacheprovider", "tests/test_guard_streams.py", "-k", "waits or capture"]))
PY
timeout 60 python3 /tmp/mut.py > $R/mutation_no_order_reads.txt 2>&1; echo "mutation rc=$? (expect 1) $(( $(date +%s)-T1 ))s" >> $R/summary.txt
T2=$(date +%s)
timeout 370 python3 -m pytest -q -rs -p no:cacheprovider tests --ignore=tests/test_guard_streams.py --ignore=tests/test_large_addresses.py --ignore=tests/test_capacities.py > $R/suite_rest.txt 2>&1; echo "suite_rest rc=$? $(( $(date +%s)-T2 ))s" >> $R/summary.txt
tail -3 $R/targeted.txt $R/mutation_no_order_reads.txt $R/suite_rest.txt; cat $R/summary.txt
