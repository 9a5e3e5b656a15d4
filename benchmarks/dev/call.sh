#!/usr/bin/env bash
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/o}; mkdir -p $OUT
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
reap() { nvidia-smi --query-compute-apps=pid --format=csv,noheader | xargs -r kill -9; }
echo "$(date -u +%FT%TZ) $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader) $(git rev-parse --short HEAD 2>/dev/null)"
t0=$SECONDS
(SANITIZE_GROUPS=backward timeout -s KILL 290 bash benchmarks/dev/sanitize_parallel.sh $OUT/san > $OUT/san.txt 2>&1; echo "sanitizer rc $? in $((SECONDS-t0)) s" >> $OUT/san.txt) &
timeout -s KILL 200 python3 -m pytest -q -n 8 -p no:cacheprovider -rf --tb=short tests/test_gpu_backward.py tests/test_gpu_interop.py > $OUT/tests.txt 2>&1
echo "backward and interop tests rc $? in $((SECONDS-t0)) s"; grep -E "^E |passed|failed|FAILED" $OUT/tests.txt | head -20
wait; reap; cat $OUT/san.txt
