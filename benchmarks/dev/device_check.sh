#!/usr/bin/env bash
# One command that checks and measures this checkout on a GPU machine.
#   benchmarks/dev/device_check.sh tests [..]   the GPU test suite (pytest -n 16, failures named as they come,
#                                               their tracebacks kept as they come, then the failed tests
#                                               rerun in one process);
#                                               test files or pytest arguments replace the default (`tests`
#                                               but the compile command's all-architecture sweep)
#   benchmarks/dev/device_check.sh sanitize     tests/sanitize.sh (all four compute-sanitizer tools)
#   benchmarks/dev/device_check.sh bench [..]   benchmarks/bench_attention.py [args], results under $OUT/results
#   benchmarks/dev/device_check.sh prefill      one call for a prefill-kernel change, each part under a time
#                                               limit: the hopper and other-architecture GPU tests, the
#                                               sanitizer on hopper, a quick H1-H7/N1 bench, SASS counts
#   benchmarks/dev/device_check.sh results [..] the canonical runs, each under a limit (seconds in RESULTS_LIMITS, 0 skips
#                                               one; unbuffered, so a run stopped by its limit leaves its log):
#                                               bench_attention.py [args], bench_model.py, train_check.py;
#                                               everything they write is packed in $OUT/results.tgz. bench_model
#                                               takes a call of its own (RESULTS_LIMITS="0 520 0"): with the
#                                               table it does not fit one call's 600 s on an H100
#                                               (it did not finish in 150 s there); MODEL_ARGS adds bench_model's
#                                               arguments. bench_model and the sweep in one call:
#                                               RESULTS_LIMITS="150 420 0" MODEL_ARGS="--reps 5" device_check.sh results --sweep --no-compile-probe
#   benchmarks/dev/device_check.sh profile [..] benchmarks/dev/profile_prefill.py [args] (or $PROFILE_SCRIPT, e.g.
#                                               benchmarks/dev/profile_decode.py) under Nsight Compute (clocks left
#                                               alone), the report in $OUT/profile.txt
#   benchmarks/dev/device_check.sh backward     one call for the backward pass: its GPU tests and the sanitizer
#                                               on its kernels (with the modifiers; each tool a process);
#                                               G1-G3: the bench stage, the training check: results
#   benchmarks/dev/device_check.sh pending      each patch of benchmarks/dev/pending in a copy of this tree, by
#                                               what it touches: a per-sequence feature (tests/test_gpu_seq.py):
#                                               those GPU tests and the sanitizer's per-sequence groups, nothing
#                                               else; kernels: hopper's GPU tests, hopper_ab.py (this
#                                               tree against the copy, in one process) and hopper_cta_cost.py;
#                                               decode's GPU tests, its sanitizer group, decode_stages.py in each
#   benchmarks/dev/device_check.sh seq          one call for the per-sequence calls (varlen, paged, left
#                                               padding): their GPU tests with decode, graphs and interop, a
#                                               D1/P1-P3/V1 bench, then the sanitizer on every family's
#                                               per-sequence calls (each tool a process)
#   benchmarks/dev/device_check.sh paged        one call for prefill on paged caches: the per-sequence, graph and
#                                               repeat-call GPU tests, paged_prefill.py (hopper on pages, tiled on
#                                               pages, hopper on the same keys contiguous), then the sanitizer's
#                                               hopper per-sequence group (each tool a process); PAGED_OTHER=DIR
#                                               adds hopper on pages by DIR's package (paged_prefill.py --other),
#                                               PAGED_PREFILL_ARGS more of its arguments
#   benchmarks/dev/device_check.sh f32          one call for float32's two schemes of precision="highest"
#                                               (cupy_gqa/_specs.py: F32_PRODUCTS): both through
#                                               tests/test_gpu_f32_products.py, fp16 pairs through the float32
#                                               GPU tests and the sanitizer on tiled, F1/F2 timed side by side
#   benchmarks/dev/device_check.sh bwd_sm90     one call for the 16-bit backward's Hopper kernels (sm_90): the
#                                               backward GPU tests and the sanitizer's backward group with the
#                                               kernels of BWD_SM90 (default ws: CUPY_GQA_TEST_BWD_SM90), then
#                                               bwd_ab.py (mma.sync and ws at a few tiles, side by side)
#   benchmarks/dev/device_check.sh first        one call (under 600 s), each part under a limit: the float32 GPU
#                                               tests (fp16 pairs at the candidate tiles F16X2_TILES:
#                                               CUPY_GQA_TEST_F16X2_TILES), the 16-bit backward's tests, the
#                                               sanitizer on tiled and the backward, bwd_ab.py, p_rounding.py
#                                               (torch's errors beside the rounding models on the same inputs),
#                                               G1-G3 beside torch
#   benchmarks/dev/device_check.sh probe        mufu_rate.py, decode_read_pattern.py, decode_cluster_ab.py (D1, D2),
#                                               each under PROBE_S seconds: measurements, no tests
#   benchmarks/dev/device_check.sh timelines    where a tile's and a decode CTA's time goes: hopper_timeline.py
#                                               (HOPPER_TIMELINE_CASES, default W1, H1_S8k, H3) and
#                                               decode_timeline.py (DECODE_TIMELINE_CASES, default D16 and D24 at
#                                               the model's split counts and at 16, D1), each under 150 s
#   benchmarks/dev/device_check.sh next         the two pending dispatch patches (cluster margin, modifiers on three
#                                               warpgroups): timings against this tree, then the wg3 copy's modifier tests
#   benchmarks/dev/device_check.sh canon        the canonical runs in one call: the table, the sweep, --modifiers
#                                               (results.tgz), then the lazy rescale's patch against this tree (CANON_AB=0: not)
#   benchmarks/dev/device_check.sh ab           one call of side-by-side timings, no tests (a change that lands
#                                               runs them): bwd_ab.py $BWD_AB_ARGS (invocations separated by
#                                               ';'), then each patch of
#                                               PENDING_ONLY (a+b: b applied on top of a) in a copy of this tree: hopper_ab.py (this tree
#                                               against the copy; with PENDING_SOFTCAP also with that softcap)
#                                               and p_rounding.py's errors in both trees (PENDING_ERROR_CASES,
#                                               none: skipped); PENDING_ALIBI=1 adds a run with ALiBi,
#                                               PENDING_WINDOW=L one with window=(L, 0) on PENDING_WINDOW_CASES
#                                               (default H1_S8k: W1 at L 1024)
# Logs go to $OUT (default /tmp/device_check); the last lines printed are a summary.
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-/tmp/device_check}
mkdir -p "$out"
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
# a hung kernel must not eat the call: what a part leaves running on the GPU is killed after it
reap() { nvidia-smi --query-compute-apps=pid --format=csv,noheader | xargs -r kill -9; }
stage=${1:-tests}
shift || true
# errors_both DIR CASES PREFIX: p_rounding.py's errors (cupy_gqa's kernels, torch's, the models) on CASES
# in this tree and in the patched copy DIR, each into $out/PREFIX_<tree>.txt, the kernels' lines printed
errors_both() {
  local t
  for t in "$PWD" "$1"; do
    (cd "$t" && PYTHONPATH="$t" timeout -s KILL 120 python3 benchmarks/dev/p_rounding.py --cases "$2" --device cuda) \
      >"$out/$3_$(basename "$t").txt" 2>&1
    echo "== p_rounding in $(basename "$t"): rc $?"
    reap
    grep -E "cupy_gqa|torch" "$out/$3_$(basename "$t").txt" | tail -15
  done
}
# patched_copy DIR NAME...: a fresh copy of this tree in DIR with benchmarks/dev/pending/NAME.patch
# applied for each NAME in turn; says which one does not apply, and fails then
patched_copy() {
  local d=$1 part; shift
  rm -rf "$d"; mkdir -p "$d"
  cp -r cupy_gqa kernels tests benchmarks pyproject.toml setup.cfg README.md "$d"/
  for part in "$@"; do
    if ! (cd "$d" && patch -p1 -s <"$d/benchmarks/dev/pending/$part.patch"); then
      echo "$(basename "$d"): $part does not apply"; return 1
    fi
  done
}
echo "$(date -u +%FT%TZ) $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader) $(git rev-parse --short HEAD 2>/dev/null)"
case "$stage" in
  tests)
    # a hung kernel must not eat the call: a time limit, and GPU processes left behind are killed.
    # -v prints each result as it comes, so a run cut short by the limit still names its failures
    # (the whole suite took 356 s with 16 workers on the H200 machine)
    # by default the whole suite but tests/test_compile.py: NVRTC compiles that need no GPU (the CI
    # runs them), 1170 s of the workers' time on an H100 machine at 63626f0, which then stopped the
    # suite at its 420 s limit with 40 tests to go
    if [ $# -eq 0 ]; then
      set -- tests --ignore tests/test_compile.py
    fi
    # each failure's traceback goes to gpu_tests_failures.txt as it comes (tests/conftest.py):
    # a failure that only shows beside the other workers' load keeps its message
    # and each test's time to gpu_tests_durations.txt (the slowest and the files' sums printed)
    rm -f "$out/gpu_tests_failures.txt" "$out/gpu_tests_durations.txt"
    CUPY_GQA_FAILURE_LOG="$out/gpu_tests_failures.txt" CUPY_GQA_DURATION_LOG="$out/gpu_tests_durations.txt" \
      timeout -s KILL "${TESTS_LIMIT_S:-420}" \
      python3 -m pytest -v -n "${TESTS_WORKERS:-16}" -p no:cacheprovider -rf "$@" >"$out/gpu_tests.txt" 2>&1
    rc=$?
    reap
    grep -E "^=+ .*(passed|failed)" "$out/gpu_tests.txt" | tail -1
    if [ -s "$out/gpu_tests_durations.txt" ]; then
      echo "== test time by file (s, summed over workers), then the slowest tests"
      awk '{split($2, a, "::"); t[a[1]] += $1} END {for (f in t) printf "%8.1f %s\n", t[f], f}' \
        "$out/gpu_tests_durations.txt" | sort -rn | head -12
      sort -rn "$out/gpu_tests_durations.txt" | head -10 | cut -c1-160
    fi
    grep -E " FAILED | ERROR " "$out/gpu_tests.txt" | sed -E 's/^\[gw[0-9]+\] \[ *[0-9]+%\] //' | sort -u | head -40
    [ -s "$out/gpu_tests_failures.txt" ] && grep -E "^=== |^E " "$out/gpu_tests_failures.txt" | head -40
    # the failures again, one process, with their tracebacks: a suite stopped by its limit prints none
    # (an array: the test ids' brackets must not be read as globs)
    mapfile -t failed < <(grep -oE "(FAILED|ERROR) tests/[^ ]+" "$out/gpu_tests.txt" | awk '{print $2}' | sort -u | head -10)
    if [ ${#failed[@]} -gt 0 ]; then
      timeout -s KILL "${RETRY_LIMIT_S:-90}" python3 -m pytest -q -p no:cacheprovider --tb=short "${failed[@]}" \
        >"$out/gpu_tests_failed.txt" 2>&1
      reap
      grep -E "^E |Error|assert|passed|failed" "$out/gpu_tests_failed.txt" | head -40
    fi
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
  prefill)
    # a hung kernel must not eat the call: every part has a limit, and GPU processes left behind are killed
    timeout -s KILL 150 python3 -m pytest -q -x -n 12 -p no:cacheprovider tests/test_gpu_kernels.py \
      tests/test_gpu_decode.py tests/test_gpu_fuzz.py -k "hopper or other_architectures" >"$out/gpu_tests.txt" 2>&1
    echo "tests rc $?"; reap; grep -E "passed|failed|FAILED" "$out/gpu_tests.txt" | tail -5
    SANITIZE_KERNELS=hopper timeout -s KILL 150 bash tests/sanitize.sh >"$out/sanitize.txt" 2>&1
    echo "sanitize rc $?"; reap; grep -E "ERROR SUMMARY|sanitize_driver:|exit code" "$out/sanitize.txt"
    timeout -s KILL 120 python3 benchmarks/bench_attention.py --cases H1,H2,H3,H4,N1,H5,H6,H7 --quick --no-plot \
      --no-compile-probe --out "$out/results" >"$out/bench.txt" 2>&1
    echo "bench rc $?"; reap
    grep -E "cupy_gqa\[(tiled|hopper)\]|torch_(flash|cudnn)" "$out/bench.txt" | cut -c10-80
    NVDISASM=nvdisasm timeout 60 python3 benchmarks/dev/sass_stats.py hopper >"$out/sass.txt" 2>&1
    cut -c1-60,140- "$out/sass.txt" | tail -8 ;;
  backward)
    timeout -s KILL 200 python3 -m pytest -q -n 16 -p no:cacheprovider tests/test_gpu_backward.py \
      tests/test_gpu_interop.py "$@" >"$out/gpu_tests.txt" 2>&1
    echo "tests rc $?"; reap; grep -E "passed|failed|FAILED" "$out/gpu_tests.txt" | tail -30
    # (each tool and part a process at once: the whole group in one racecheck process did not end in 360 s)
    SANITIZE_GROUPS="backward:cases|backward:mods" timeout -s KILL 360 bash benchmarks/dev/sanitize_parallel.sh "$out/sanitize" >"$out/sanitize.txt" 2>&1
    echo "sanitize rc $?"; reap; cat "$out/sanitize.txt"; grep -h "FAIL" "$out"/sanitize/*.txt | head -20 ;;
  seq)
    t0=$SECONDS
    timeout -s KILL 240 python3 -m pytest -q -n 16 -p no:cacheprovider -rf tests/test_gpu_seq.py tests/test_gpu_decode.py \
      tests/test_gpu_graphs.py tests/test_gpu_interop.py tests/test_fast.py >"$out/gpu_tests.txt" 2>&1
    echo "tests rc $? in $((SECONDS - t0)) s"; reap; grep -E "passed|failed|FAILED" "$out/gpu_tests.txt" | tail -20
    timeout -s KILL 90 python3 benchmarks/bench_attention.py --cases D1,P1,P2,P3,P4,P5,V1 --no-plot --no-compile-probe \
      --out "$out/results" >"$out/bench.txt" 2>&1
    echo "bench rc $?"; reap; grep -E "^\[.*(P[1-5]|D1|V1) " "$out/bench.txt" | grep -E "auto|contiguous|cudnn|varlen" | cut -c10-160
    t0=$SECONDS
    SANITIZE_GROUPS="hopper:seq|tiled:seq|rowwise:seq|decode:seq" timeout -s KILL 240 \
      bash benchmarks/dev/sanitize_parallel.sh "$out/sanitize"
    echo "sanitize rc $? in $((SECONDS - t0)) s"; reap ;;
  paged)
    t0=$SECONDS
    timeout -s KILL 240 python3 -m pytest -q -n 16 -p no:cacheprovider -rf tests/test_gpu_seq.py tests/test_gpu_graphs.py \
      tests/test_fast.py "$@" >"$out/gpu_tests.txt" 2>&1
    echo "tests rc $? in $((SECONDS - t0)) s"; reap; grep -E "passed|failed|FAILED" "$out/gpu_tests.txt" | tail -20
    timeout -s KILL "${PAGED_PREFILL_S:-120}" python3 benchmarks/dev/paged_prefill.py ${PAGED_OTHER:+--other "$PAGED_OTHER"} ${PAGED_PREFILL_ARGS:-} \
      >"$out/paged_prefill.txt" 2>&1
    echo "paged_prefill rc $?"; reap; cat "$out/paged_prefill.txt"
    t0=$SECONDS
    SANITIZE_GROUPS="hopper:seq" timeout -s KILL 200 bash benchmarks/dev/sanitize_parallel.sh "$out/sanitize"
    echo "sanitize rc $? in $((SECONDS - t0)) s"; reap ;;
  first)
    part() {  # part NAME LIMIT_S COMMAND...: run, report rc, time and the pytest summary or the output's tail
      local name=$1 limit=$2; shift 2; local t0=$SECONDS
      timeout -s KILL "$limit" "$@" >"$out/first_$name.txt" 2>&1
      echo "== $name: rc $? in $((SECONDS - t0)) s"; reap
      grep -E "^(FAILED|ERROR)|[0-9]+ (passed|failed)|rc [0-9]" "$out/first_$name.txt" | sort -u | head -12
    }
    part f32_suite 90 env CUPY_GQA_TEST_F32_PRODUCTS=f16x2 CUPY_GQA_TEST_F16X2_TILES="${F16X2_TILES:-128:128,32,8;64:64,16,4}" python3 -m pytest -q -n 16 -p no:cacheprovider -rf tests/test_gpu_kernels.py \
      tests/test_gpu_modifiers.py tests/test_gpu_seq.py tests/test_gpu_graphs.py tests/test_gpu_fuzz.py \
      tests/test_gpu_backward.py tests/test_gpu_interop.py tests/test_gpu_f32_products.py -k "float32 or fp32 or f32"
    part bwd_ws 75 python3 -m pytest -q -n 16 -p no:cacheprovider -rf \
      tests/test_gpu_backward.py -k "float16 or bfloat16 or random or deterministic or torch"
    part sanitize 220 env SANITIZE_GROUPS="tiled|backward" \
      bash benchmarks/dev/sanitize_parallel.sh "$out/first_san"
    cat "$out/first_sanitize.txt" | cut -c1-300
    part bwd_ab 80 python3 benchmarks/dev/bwd_ab.py --cases G1,G2,G2s --rounds 2 \
      --configs mma,ws:64x64x2,ws:64x64x3
    grep -E " ms \(" "$out/first_bwd_ab.txt" | cut -c1-220
    part p_rounding 45 python3 benchmarks/dev/p_rounding.py --cases D24,D1,P03
    grep -E "^(D24|D1|P03) " "$out/first_p_rounding.txt"
    part bench 60 python3 benchmarks/bench_attention.py --cases G1,G2,G3 --no-plot --no-compile-probe \
      --out "$out/first_bench"
    grep -hE "^\| (G1|G2|G3) \| (cupy_gqa\[auto\]|torch_flash|torch_efficient_expanded) " "$out"/first_bench/*.md \
      | cut -d'|' -f2-9 ;;
  ab)
    IFS=';' read -r -a runs <<<"${BWD_AB_ARGS:-}"  # invocations, separated by ';'
    for i in "${!runs[@]}"; do
      t0=$SECONDS
      # shellcheck disable=SC2086
      timeout -s KILL "${BWD_AB_S:-200}" python3 benchmarks/dev/bwd_ab.py ${runs[$i]} >"$out/bwd_ab_$i.txt" 2>&1
      echo "== bwd_ab ${runs[$i]}: rc $? in $((SECONDS - t0)) s"; reap
      grep -E " ms \(|Error|error:" "$out/bwd_ab_$i.txt" | cut -c1-220
    done
    read -r -a only <<<"${PENDING_ONLY:-}"
    for name in "${only[@]}"; do
      # a+b: patch a, then b on top of it, in one copy (its files named a_plus_b: plain characters)
      IFS='+' read -r -a parts <<<"$name"
      name=${name//+/_plus_}
      d=/tmp/pending_$name
      patched_copy "$d" "${parts[@]}" || continue
      t0=$SECONDS
      timeout -s KILL "${AB_S:-200}" python3 benchmarks/dev/hopper_ab.py "$d" --cases "${PENDING_CASES:-H1,H2,H3,H4,N1,H6}" \
        --rounds 3 >"$out/ab_${name}.txt" 2>&1
      echo "== $name: hopper_ab rc $? in $((SECONDS - t0)) s"; reap; tail -12 "$out/ab_${name}.txt"
      if [ -n "${PENDING_SOFTCAP:-}" ]; then  # both trees again with that softcap
        t0=$SECONDS
        timeout -s KILL "${AB_S:-200}" python3 benchmarks/dev/hopper_ab.py "$d" --cases "${PENDING_CASES:-H1,H2,H3,H4,N1,H6}" \
          --rounds 3 --softcap "$PENDING_SOFTCAP" >"$out/ab_${name}_softcap.txt" 2>&1
        echo "== $name: hopper_ab softcap $PENDING_SOFTCAP rc $? in $((SECONDS - t0)) s"; reap; tail -12 "$out/ab_${name}_softcap.txt"
      fi
      if [ -n "${PENDING_WINDOW:-}" ]; then  # both trees again with window=(PENDING_WINDOW, 0)
        t0=$SECONDS
        timeout -s KILL "${AB_S:-200}" python3 benchmarks/dev/hopper_ab.py "$d" --cases "${PENDING_WINDOW_CASES:-H1_S8k}" \
          --rounds 3 --window "$PENDING_WINDOW" >"$out/ab_${name}_window.txt" 2>&1
        echo "== $name: hopper_ab window $PENDING_WINDOW rc $? in $((SECONDS - t0)) s"; reap; tail -6 "$out/ab_${name}_window.txt"
      fi
      if [ -n "${PENDING_ALIBI:-}" ]; then  # both trees again with ALiBi
        t0=$SECONDS
        timeout -s KILL "${AB_S:-200}" python3 benchmarks/dev/hopper_ab.py "$d" --cases "${PENDING_CASES:-H1,H2,H3,H4,N1,H6}" \
          --rounds 3 --alibi >"$out/ab_${name}_alibi.txt" 2>&1
        echo "== $name: hopper_ab alibi rc $? in $((SECONDS - t0)) s"; reap; tail -12 "$out/ab_${name}_alibi.txt"
      fi
      [ "${PENDING_ERROR_CASES:-}" != none ] && errors_both "$d" "${PENDING_ERROR_CASES:-P03,H3,H4}" "ab_${name}_errors"
    done ;;
  bwd_sm90)
    kind=${BWD_SM90:-ws}  # (the calls' own; mma for the other kernels)
    t0=$SECONDS
    CUPY_GQA_TEST_BWD_SM90=$kind timeout -s KILL 240 python3 -m pytest -q -n 8 -p no:cacheprovider -rf \
      tests/test_gpu_backward.py tests/test_gpu_interop.py >"$out/bwd_sm90_tests.txt" 2>&1
    echo "tests ($kind) rc $? in $((SECONDS - t0)) s"; reap; grep -E "passed|failed|FAILED" "$out/bwd_sm90_tests.txt" | tail -20
    timeout -s KILL 200 python3 benchmarks/dev/bwd_ab.py --cases G1,G2,G2s \
      --configs mma,ws:64x64x2,ws:64x64x3,ws:128x64x2 >"$out/bwd_ab.txt" 2>&1
    echo "ab rc $?"; reap; grep -E " ms \(" "$out/bwd_ab.txt"
    t0=$SECONDS
    CUPY_GQA_TEST_BWD_SM90=$kind SANITIZE_KERNELS=backward timeout -s KILL 180 bash tests/sanitize.sh >"$out/sanitize.txt" 2>&1
    echo "sanitize rc $? in $((SECONDS - t0)) s"; reap; grep -E "ERROR SUMMARY|sanitize_driver:|exit code|FAIL" "$out/sanitize.txt" ;;
  f32)
    t0=$SECONDS
    timeout -s KILL 150 python3 -m pytest -q -n 16 -p no:cacheprovider -rf tests/test_gpu_f32_products.py \
      >"$out/f32_tests.txt" 2>&1
    echo "both schemes rc $? in $((SECONDS - t0)) s"; reap; grep -E "passed|failed|FAILED" "$out/f32_tests.txt" | tail -12
    t0=$SECONDS
    CUPY_GQA_TEST_F32_PRODUCTS=f16x2 timeout -s KILL 240 python3 -m pytest -q -n 16 -p no:cacheprovider -rf \
      tests/test_gpu_kernels.py tests/test_gpu_modifiers.py tests/test_gpu_seq.py tests/test_gpu_fuzz.py \
      tests/test_gpu_graphs.py -k "float32 or fp32" >"$out/f16x2_tests.txt" 2>&1
    echo "fp16 pairs suite rc $? in $((SECONDS - t0)) s"; reap; grep -E "passed|failed|FAILED" "$out/f16x2_tests.txt" | tail -12
    timeout -s KILL 120 python3 benchmarks/dev/tf32_ab.py --cases F1,F2,F1s --modes t,f16x2 --shapes table,w8,n16 \
      >"$out/f32_ab.txt" 2>&1
    echo "ab rc $?"; reap; tail -14 "$out/f32_ab.txt"
    t0=$SECONDS
    CUPY_GQA_TEST_F32_PRODUCTS=f16x2 SANITIZE_KERNELS=tiled timeout -s KILL 200 bash tests/sanitize.sh >"$out/sanitize.txt" 2>&1
    echo "sanitize rc $? in $((SECONDS - t0)) s"; reap; grep -E "ERROR SUMMARY|sanitize_driver:|exit code|FAIL" "$out/sanitize.txt" ;;
  results)
    read -r lb lm lt <<<"${RESULTS_LIMITS:-330 0 90}"
    mkdir -p "$out/results"
    if [ "$lb" -gt 0 ]; then
      t0=$SECONDS
      timeout -s KILL "$lb" python3 -u benchmarks/bench_attention.py --out "$out/results" "$@" >"$out/bench.txt" 2>&1
      echo "bench rc $? in $((SECONDS - t0)) s"; reap; grep -E "^\| " "$out/results/"*.md 2>/dev/null | grep -vE "rowwise|naive|seed|math|efficient" | cut -c1-150 | head -70
    fi
    if [ "$lm" -gt 0 ]; then
      t0=$SECONDS
      timeout -s KILL "$lm" python3 -u benchmarks/bench_model.py --out "$out/results" ${MODEL_ARGS:-} >"$out/model.txt" 2>&1
      echo "model rc $? in $((SECONDS - t0)) s"; reap; tail -25 "$out/model.txt"
    fi
    if [ "$lt" -gt 0 ]; then
      t0=$SECONDS
      timeout -s KILL "$lt" python3 -u benchmarks/train_check.py --out "$out/results" >"$out/train.txt" 2>&1
      echo "train rc $? in $((SECONDS - t0)) s"; reap; tail -4 "$out/train.txt"
    fi
    tar czf "$out/results.tgz" -C "$out" results && rm -rf "$out/results" ;;
  profile)
    timeout -s KILL "${PROFILE_LIMIT_S:-300}" ncu --clock-control none --profile-from-start off --section SpeedOfLight \
      --section Occupancy --section LaunchStats --section WarpStateStats --section SchedulerStats \
      --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis python3 "${PROFILE_SCRIPT:-benchmarks/dev/profile_prefill.py}" "$@" \
      >"$out/profile.txt" 2>&1
    rc=$?
    reap
    grep -E "^  [a-z_]+.*\(|Duration|Throughput|Achieved Occupancy|Registers Per|Block Limit|Stall|Issued Warp|No Eligible|Pipe|SM Busy|Issue Slots|Dispatch|^D[0-9]" \
      "$out/profile.txt" | cut -c1-150 | head -120
    exit $rc ;;
  pending)
    # each patch of benchmarks/dev/pending, applied to a copy of this tree, by the kernels it
    # touches: hopper.cu or softmax.cuh -- hopper's GPU tests and the sanitizer's hopper group in the copy
    # (at once), then hopper_ab.py (this tree and the copy timed in turn in one process; with
    # PENDING_ERROR_CASES also p_rounding.py's errors in both; with PENDING_CTA_COST=1 also
    # hopper_cta_cost.py in each); decode.cu -- the decode,
    # per-sequence and graph GPU tests and the sanitizer's decode group in the copy (at once),
    # then, unless PENDING_DECODE_STAGES=0, p_rounding.py's errors (PENDING_ERROR_CASES) in both and
    # decode_stages.py --stages 3 in this tree, and with DECODE_STAGES_ARGS decode_stages.py in the copy,
    # with PENDING_DECODE_AB decode_cluster_ab.py (its arguments) in the copy; PENDING_TESTS=0 skips the
    # decode tests and sanitizer (timings first, checks once a change wins).
    # (tests and sanitizer under PENDING_TESTS_S, default 380 s: on a fresh machine the sanitizer's hopper
    # group compiled for more than 240 s beside the tests). PENDING_ONLY (names or globs, space-separated) picks patches; PENDING_SOFTCAP=30 adds a hopper_ab.py
    # run of the cases with that softcap on both sides, PENDING_ALIBI=1 one with ALiBi, PENDING_WINDOW=L
    # one with window=(L, 0) on PENDING_WINDOW_CASES (default H1_S8k: W1 at L 1024); after any patch's
    # stage, PENDING_BENCH (bench_attention.py's arguments, e.g. "--cases D1,D2" or "--modifiers") runs
    # the benchmark in the copy
    here=$PWD
    shopt -s nullglob
    patches=()
    read -r -a only <<<"${PENDING_ONLY:-*}"  # (no expansion against this directory's files)
    for g in "${only[@]}"; do patches+=(benchmarks/dev/pending/$g.patch); done
    [ ${#patches[@]} -eq 0 ] && echo "no patches in benchmarks/dev/pending"
    for patch in "${patches[@]}"; do
      name=$(basename "$patch" .patch); d=/tmp/pending_$name
      patched_copy "$d" "$name" || continue
      t0=$SECONDS
      if grep -q "^diff --git a/tests/test_gpu_seq.py" "$patch"; then
        # a feature of the per-sequence calls: their GPU tests with the modifiers' and the graphs', and
        # the sanitizer's per-sequence groups, in the copy (at once); no timings
        (cd "$d" && export PYTHONPATH="$d" && CUPY_GQA_FAILURE_LOG="$out/pending_${name}_failures.txt" \
          timeout -s KILL "${PENDING_TESTS_S:-380}" python3 -m pytest -q -n 12 -p no:cacheprovider -rf \
          tests/test_gpu_seq.py tests/test_gpu_modifiers.py tests/test_gpu_graphs.py) >"$out/pending_${name}_tests.txt" 2>&1 &
        (cd "$d" && PYTHONPATH="$d" SANITIZE_GROUPS="hopper:seq tiled:seq|rowwise:seq decode:seq" \
          timeout -s KILL "${PENDING_TESTS_S:-380}" bash benchmarks/dev/sanitize_parallel.sh "$out/pending_${name}_san") \
          >"$out/pending_${name}_san.txt" 2>&1 &
        wait
        echo "$name: per-sequence tests and sanitizer in $((SECONDS - t0)) s"; reap
        grep -E "passed|failed|FAILED" "$out/pending_${name}_tests.txt" | sort -u | tail -12; cat "$out/pending_${name}_san.txt"
        [ -s "$out/pending_${name}_failures.txt" ] && grep -E "^=== |^E " "$out/pending_${name}_failures.txt" | head -30
        continue
      fi
      if grep -qE "^diff --git a/kernels/(hopper.cu|softmax.cuh)" "$patch"; then
        (cd "$d" && export PYTHONPATH="$d" && timeout -s KILL "${PENDING_TESTS_S:-380}" python3 -m pytest -q -n 12 -p no:cacheprovider \
          -rf tests/test_gpu_kernels.py tests/test_gpu_seq.py tests/test_gpu_modifiers.py tests/test_gpu_graphs.py \
          tests/test_gpu_fuzz.py -k "hopper or twins") >"$out/pending_${name}_tests.txt" 2>&1 &
        (cd "$d" && PYTHONPATH="$d" SANITIZE_GROUPS=hopper timeout -s KILL "${PENDING_TESTS_S:-380}" \
          bash benchmarks/dev/sanitize_parallel.sh "$out/pending_${name}_san") >"$out/pending_${name}_san.txt" 2>&1 &
        wait
        echo "$name: hopper tests and sanitizer in $((SECONDS - t0)) s"; reap
        grep -E "passed|failed|FAILED" "$out/pending_${name}_tests.txt" | tail -8; cat "$out/pending_${name}_san.txt"
        cases=${PENDING_CASES:-H1,H2,H3,H4,N1,H6}
        timeout -s KILL 200 python3 benchmarks/dev/hopper_ab.py "$d" --cases "$cases" --rounds 3 >"$out/pending_${name}_ab.txt" 2>&1
        reap; cat "$out/pending_${name}_ab.txt"
        [ -n "${PENDING_ERROR_CASES:-}" ] && errors_both "$d" "$PENDING_ERROR_CASES" "pending_${name}_errors"
        if [ -n "${PENDING_SOFTCAP:-}" ]; then
          timeout -s KILL 200 python3 benchmarks/dev/hopper_ab.py "$d" --cases "$cases" --rounds 3 \
            --softcap "$PENDING_SOFTCAP" >"$out/pending_${name}_ab_softcap.txt" 2>&1
          reap; cat "$out/pending_${name}_ab_softcap.txt"
        fi
        if [ -n "${PENDING_ALIBI:-}" ]; then
          timeout -s KILL 200 python3 benchmarks/dev/hopper_ab.py "$d" --cases "$cases" --rounds 3 \
            --alibi >"$out/pending_${name}_ab_alibi.txt" 2>&1
          reap; cat "$out/pending_${name}_ab_alibi.txt"
        fi
        if [ -n "${PENDING_WINDOW:-}" ]; then  # both trees again with window=(PENDING_WINDOW, 0)
          timeout -s KILL 200 python3 benchmarks/dev/hopper_ab.py "$d" --cases "${PENDING_WINDOW_CASES:-H1_S8k}" \
            --rounds 3 --window "$PENDING_WINDOW" >"$out/pending_${name}_ab_window.txt" 2>&1
          reap; cat "$out/pending_${name}_ab_window.txt"
        fi
        if [ -n "${PENDING_CTA_COST:-}" ]; then
          for t in "$here" "$d"; do
            (cd "$t" && PYTHONPATH="$t" timeout -s KILL 60 python3 benchmarks/dev/hopper_cta_cost.py --kernels hopper \
              --head-dims 64,128) 2>&1 | grep -E "per wave =" | sed "s|^|$(basename "$t"): |"
            reap
          done
        fi
      fi
      if grep -q "^diff --git a/kernels/decode.cu" "$patch" && [ "${PENDING_TESTS:-1}" != 0 ]; then
        t0=$SECONDS
        (cd "$d" && export PYTHONPATH="$d" && timeout -s KILL "${PENDING_TESTS_S:-380}" python3 -m pytest -q -n 8 -p no:cacheprovider \
          -rf tests/test_gpu_decode.py tests/test_gpu_seq.py tests/test_gpu_graphs.py -k "decode or paged or graph") \
          >"$out/pending_${name}_tests.txt" 2>&1 &
        (cd "$d" && PYTHONPATH="$d" SANITIZE_GROUPS=decode timeout -s KILL "${PENDING_TESTS_S:-380}" \
          bash benchmarks/dev/sanitize_parallel.sh "$out/pending_${name}_san") >"$out/pending_${name}_san.txt" 2>&1 &
        wait
        echo "$name: decode tests and sanitizer in $((SECONDS - t0)) s"; reap
        grep -E "passed|failed|FAILED" "$out/pending_${name}_tests.txt" | tail -8; cat "$out/pending_${name}_san.txt"
      fi
      if grep -q "^diff --git a/kernels/decode.cu" "$patch"; then
        if [ "${PENDING_DECODE_STAGES:-1}" != 0 ]; then
          echo "== decode_stages.py in this tree"
          timeout -s KILL 120 python3 benchmarks/dev/decode_stages.py --stages 3 --rounds 3 2>&1 | tail -16; reap
          errors_both "$d" "${PENDING_ERROR_CASES:-D1,D2,D06,D16,D24}" "pending_${name}_errors"
        fi
        if [ -n "${DECODE_STAGES_ARGS:-}" ]; then
          echo "== decode_stages.py --stages 3 $DECODE_STAGES_ARGS in the copy"
          (cd "$d" && PYTHONPATH="$d" timeout -s KILL 120 python3 benchmarks/dev/decode_stages.py --stages 3 --rounds 3 \
            $DECODE_STAGES_ARGS) 2>&1 | tail -16
          reap
        fi
        if [ -n "${PENDING_DECODE_AB:-}" ]; then  # forced launches side by side (decode_cluster_ab.py), in the copy
          echo "== decode_cluster_ab.py $PENDING_DECODE_AB in the copy"
          (cd "$d" && PYTHONPATH="$d" timeout -s KILL 150 python3 -u benchmarks/dev/decode_cluster_ab.py \
            $PENDING_DECODE_AB) 2>&1 | tee "$out/pending_${name}_decode_ab.txt" | tail -30
          reap
        fi
      fi
      if [ -n "${PENDING_BENCH:-}" ]; then
        # bench_attention.py in the copy (PENDING_BENCH: its arguments), against torch's backends in the same run
        echo "== bench_attention.py $PENDING_BENCH in the copy"
        (cd "$d" && PYTHONPATH="$d" timeout -s KILL 150 python3 benchmarks/bench_attention.py $PENDING_BENCH \
          --no-plot --no-compile-probe --out "$out/pending_${name}_bench") 2>&1 | tail -24
        reap
      fi
    done ;;
  probe)
    # measurements of the machine and of layouts, no tests, each under a limit: the multi-function
    # unit's and the conversions' rates (mufu_rate.py), decode's orders of reads without attention
    # (decode_read_pattern.py), D1 and D2 split in clusters (decode_cluster_ab.py)
    for cmd in "mufu_rate.py" "decode_read_pattern.py --cases D1,D2" "decode_cluster_ab.py --cases D1,D2 --rounds 2"; do
      t0=$SECONDS; f="$out/probe_${cmd%%.py*}.txt"
      # shellcheck disable=SC2086
      timeout -s KILL "${PROBE_S:-120}" python3 benchmarks/dev/$cmd >"$f" 2>&1
      echo "== $cmd: rc $? in $((SECONDS - t0)) s"; reap; tail -24 "$f" | cut -c1-160
    done ;;
  timelines)
    t0=$SECONDS; timeout -s KILL 150 python3 -u benchmarks/dev/hopper_timeline.py \
        --cases "${HOPPER_TIMELINE_CASES:-W1,H1_S8k,H3}" >"$out/hopper_timeline.txt" 2>&1
    echo "== hopper_timeline: rc $? in $((SECONDS - t0)) s"; reap; grep -vE "^  +[0-9]+ key tiles" "$out/hopper_timeline.txt" | tail -60
    t0=$SECONDS; timeout -s KILL 150 python3 -u benchmarks/dev/decode_timeline.py \
        --cases "${DECODE_TIMELINE_CASES:-D16:19,D16:16,D24:14,D24:16,D1:1}" >"$out/decode_timeline.txt" 2>&1
    echo "== decode_timeline: rc $? in $((SECONDS - t0)) s"; reap; tail -70 "$out/decode_timeline.txt" ;;
  next)
    # the two pending dispatch patches in one call (NOTES.md, "Next" 2), each part under a limit, the
    # timings first: decode_cluster_ab.py at D24, D16, D05, then the decode sweep in this tree and with
    # dev/pending/decode_cluster_margin.patch;
    # --modifiers in this tree and with dev/pending/hopper_mods_wg3.patch, hopper_ab.py with ALiBi
    # (H1, H4) between the two; then tests/test_gpu_modifiers.py in the wg3 copy
    d=/tmp/pending_hopper_mods_wg3
    patched_copy "$d" hopper_mods_wg3
    echo "== decode_cluster_ab.py: the one-KV-head points at the model's launch and at 8 in clusters, in one process"
    timeout -s KILL 90 python3 -u benchmarks/dev/decode_cluster_ab.py --cases D24,D16,D05 --rounds 3 2>&1 \
      | tee "$out/next_decode_ab.txt" | tail -20; reap
    echo "== decode sweep, this tree"
    timeout -s KILL 90 python3 benchmarks/bench_attention.py --sweep --sweep-kind decode --no-plot --no-compile-probe \
      --out "$out/next_decode_base" 2>&1 | grep -E "decode:|D(16|24) +(cupy|torch_cudnn)"; reap
    echo "== decode sweep, with the cluster margin"
    PENDING_ONLY=decode_cluster_margin PENDING_BENCH="--sweep --sweep-kind decode" bash "$0" pending 2>&1 \
      | grep -E "decode:|D(16|24) +(cupy|torch_cudnn)"
    for t in "$PWD" "$d"; do
      echo "== --modifiers in $t"
      (cd "$t" && PYTHONPATH="$t" timeout -s KILL 90 python3 benchmarks/bench_attention.py --modifiers --no-compile-probe \
        --no-plot --out "$out/next_mods_$(basename "$t")") 2>&1 | grep -E "W[123] "; reap
    done
    echo "== hopper_ab.py with ALiBi, this tree against the wg3 copy"
    timeout -s KILL 90 python3 benchmarks/dev/hopper_ab.py "$d" --cases H1,H4 --rounds 2 --alibi 2>&1 | tail -8; reap
    echo "== tests/test_gpu_modifiers.py in the wg3 copy"
    (cd "$d" && PYTHONPATH="$d" timeout -s KILL 240 python3 -m pytest -q -n 16 -p no:cacheprovider -rf \
      tests/test_gpu_modifiers.py) >"$out/next_wg3_tests.txt" 2>&1
    echo "rc $?"; reap; tail -3 "$out/next_wg3_tests.txt"; grep -E "^FAILED" "$out/next_wg3_tests.txt" | head ;;
  canon)
    # the canonical runs in one call (on an H200 for the issues' lines; about 400 s on an H100):
    # the table, the sweep and --modifiers into $out/results (packed in results.tgz), then the
    # lazy rescale (dev/pending/hopper_lazy_max.patch) timed against this tree's exact maxima with
    # the errors of both (as the ab stage does), unless CANON_AB=0
    echo "canon on: $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)"
    mkdir -p "$out/results"
    for args in "--no-compile-probe --no-plot" "--sweep --no-compile-probe" "--modifiers --no-compile-probe --no-plot"; do
      t0=$SECONDS; log="$out/canon_$(echo "$args" | cut -d' ' -f1 | tr -d -).txt"
      # shellcheck disable=SC2086
      timeout -s KILL "${CANON_LIMIT_S:-220}" python3 -u benchmarks/bench_attention.py --out "$out/results" $args >"$log" 2>&1
      echo "== bench_attention.py $args: rc $? in $((SECONDS - t0)) s"; reap
      grep -E "geometric|W1|W2|W3" "$log" | tail -6
    done
    grep -hE "^\| (H[1-7]|N1|D1|D2|F1|P[1-3]|V1) \| (cupy_gqa\[auto\]|torch_cudnn|torch_flash|torch_varlen|torch_efficient_expanded) " \
      "$out/results/"*.md 2>/dev/null | grep -v sweep | cut -d'|' -f2-4,8 | head -60
    tar czf "$out/results.tgz" -C "$out" results
    if [ "${CANON_AB:-1}" != 0 ]; then
      OUT="$out/ab" PENDING_ONLY=hopper_lazy_max PENDING_CASES=H1,H2,H3,H4,N1,H5,H6 PENDING_ERROR_CASES=H3,H4,P03 \
        AB_S=220 bash "$0" ab 2>&1 | tail -40
    fi ;;
  *) echo "unknown stage $stage"; exit 2 ;;
esac
