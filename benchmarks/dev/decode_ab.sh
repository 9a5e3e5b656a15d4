#!/usr/bin/env bash
# A decode patch of benchmarks/dev/pending against this tree, on one GPU, in one call:
# the decode sweep's points and D1, D2 (bench_attention.py, torch in the same run), and in the
# first round the one-KV-head calls at several split counts (decode_layouts.py), with
# this tree (A) after a smoke test of the patch (decode_smoke.py), then with the patch applied to it (B), then (ROUNDS=2, the default) A and
# B again; between them the patched tree's decode GPU tests. Logs and results under
# $OUT/decode_ab.
#   [ROUNDS=1] benchmarks/dev/decode_ab.sh PATCH_NAME
set -uo pipefail
cd "$(dirname "$0")/../.."
name=$1
out=${OUT:-/tmp/device_check}/decode_ab
mkdir -p "$out"
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$out/gpu.txt"
bench() {  # side round
    timeout 120 python3 -u benchmarks/bench_attention.py --sweep --sweep-kind decode --no-compile-probe \
        --out "$out/$1_$2" > "$out/sweep_$1_$2.txt" 2>&1
    timeout 60 python3 -u benchmarks/bench_attention.py --cases D1,D2 --no-compile-probe --no-plot \
        --out "$out/$1_$2_table" > "$out/table_$1_$2.txt" 2>&1
    echo "== $1 round $2"
    grep -E "geometric|worst" "$out/sweep_$1_$2.txt" | tail -2
    grep -E " D[12] " "$out/table_$1_$2.txt" | tail -8
    if [ "$2" = 1 ]; then  # the one-KV-head calls at several split counts (measured / model us)
        timeout 60 python3 benchmarks/dev/decode_layouts.py --cases D16,D24,D05 --splits 8,16,19,22,33,64 \
            > "$out/layouts_$1.txt" 2>&1
        grep -E "block_m 16|choice" "$out/layouts_$1.txt"
    fi
}
patch -p1 < "benchmarks/dev/pending/$name.patch" || exit 1
timeout 60 python3 benchmarks/dev/decode_smoke.py || { patch -R -p1 < "benchmarks/dev/pending/$name.patch"; exit 1; }
patch -R -p1 < "benchmarks/dev/pending/$name.patch"
bench A 1
patch -p1 < "benchmarks/dev/pending/$name.patch" || exit 1
timeout 150 python3 -m pytest -q -x -n 16 tests/test_gpu_decode.py tests/test_gpu_seq.py -k "decode or paged" > "$out/tests_B.txt" 2>&1
tail -2 "$out/tests_B.txt"
bench B 1
patch -R -p1 < "benchmarks/dev/pending/$name.patch"
[ "${ROUNDS:-2}" -ge 2 ] || exit 0
bench A 2
patch -p1 < "benchmarks/dev/pending/$name.patch"
bench B 2
patch -R -p1 < "benchmarks/dev/pending/$name.patch"
