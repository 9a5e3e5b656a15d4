#!/usr/bin/env bash
# Run every kernel family under each compute-sanitizer tool (on a GPU machine).
#   tests/sanitize.sh [tool ...]      default: memcheck racecheck initcheck synccheck
#   SANITIZE_KERNELS="tiled decode" tests/sanitize.sh ...   only these kernel families
#   SANITIZE_KERNELS=backward tests/sanitize.sh ...          only the backward pass (kernels/backward.cu)
#   SANITIZE_KERNELS="tiled:seq decode:mods" tests/sanitize.sh ...  only those families' per-sequence
#                                                            (or modifier) calls
# Exits non-zero if any tool reports an error or a result is wrong.
set -uo pipefail
cd "$(dirname "$0")"
tools=("$@")
[ ${#tools[@]} -eq 0 ] && tools=(memcheck racecheck initcheck synccheck)
status=0
python3 sanitize_driver.py ${SANITIZE_KERNELS:-} >/dev/null || status=1  # compile everything first, outside the tools
for tool in "${tools[@]}"; do
  echo "== compute-sanitizer --tool $tool"
  compute-sanitizer --tool "$tool" --error-exitcode 99 --print-limit 20 python3 sanitize_driver.py ${SANITIZE_KERNELS:-} 2>&1 \
    | grep -E "ERROR SUMMARY|sanitize_driver:|FAIL|Error|error" | head -30
  rc=${PIPESTATUS[0]}
  echo "   exit code $rc"
  [ "$rc" -ne 0 ] && status=1
done
exit $status
