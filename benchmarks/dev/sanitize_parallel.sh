#!/usr/bin/env bash
# tests/sanitize.sh with each tool, and each group of kernel families, in its own
# process at once (the tools' runs are independent; one GPU holds them all).
#   SANITIZE_GROUPS="hopper tiled|decode rowwise|backward" benchmarks/dev/sanitize_parallel.sh OUTDIR
# SANITIZE_TOOLS (default: all four) picks the tools.
# Prints one line per (tool, group) with its exit code and summary; exits non-zero if any failed.
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${1:-/tmp/sanitize}
mkdir -p "$out"
IFS='|' read -r -a groups <<<"${SANITIZE_GROUPS:-hopper tiled|decode rowwise|backward}"
for g in "${groups[@]}"; do (cd tests && python3 sanitize_driver.py $g >/dev/null); done  # compile first, once
pids=()
for tool in ${SANITIZE_TOOLS:-memcheck racecheck initcheck synccheck}; do
  for i in "${!groups[@]}"; do
    SANITIZE_KERNELS="${groups[$i]}" bash tests/sanitize.sh "$tool" >"$out/sanitize_${tool}_$i.txt" 2>&1 &
    pids+=("$!:$tool:$i")
  done
done
status=0
for entry in "${pids[@]}"; do
  IFS=: read -r pid tool i <<<"$entry"
  wait "$pid"; rc=$?
  [ "$rc" -ne 0 ] && status=1
  echo "$tool [${groups[$i]}] rc $rc: $(grep -E 'sanitize_driver:|SUMMARY' "$out/sanitize_${tool}_$i.txt" | tr -s ' ' | tr '\n' ' ')"
done
exit $status
