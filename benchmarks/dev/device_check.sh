#!/usr/bin/env bash
# One device-tool call that checks and measures this checkout on the GPU machine.
#   benchmarks/dev/device_check.sh tests        the GPU test suite (pytest -n 8)
#   benchmarks/dev/device_check.sh sanitize     tests/sanitize.sh (all four compute-sanitizer tools)
#   benchmarks/dev/device_check.sh bench [..]   benchmarks/bench_attention.py [args], results under $OUT/results
# Logs go to $OUT (the device tool brings them back); the last lines printed are a summary.
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-/tmp/device_check}
mkdir -p "$out"
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
stage=${1:-tests}
shift || true
echo "$(date -u +%FT%TZ) $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader) $(git rev-parse --short HEAD 2>/dev/null)"
case "$stage" in
  tests)
    python3 -m pytest -q -n 8 -p no:cacheprovider tests "$@" >"$out/gpu_tests.txt" 2>&1
    rc=$?
    grep -iE "passed|failed|error" "$out/gpu_tests.txt" | grep -v Warning | tail -40
    exit $rc ;;
  sanitize)
    bash tests/sanitize.sh "$@" >"$out/sanitize.txt" 2>&1
    rc=$?
    cat "$out/sanitize.txt"
    exit $rc ;;
  bench)
    python3 benchmarks/bench_attention.py --out "$out/results" "$@" >"$out/bench.txt" 2>&1
    rc=$?
    tail -60 "$out/bench.txt"
    exit $rc ;;
  *) echo "unknown stage $stage"; exit 2 ;;
esac
