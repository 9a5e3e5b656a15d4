"""Time the hopper kernel of several checkouts, each in a process of its own.

    python benchmarks/dev/hopper_variants.py DIR [DIR ...] [--cases H1,H3] [--reps 20] [--rounds 1]

Each DIR holds a copy of `cupy_gqa/` and `kernels/` (say from
`git archive REV cupy_gqa kernels | tar -x -C DIR`). Each runs in a process of
its own with DIR first on the import path, and prints one line per case: the
median of --reps CUDA-event timings of `attention(..., kernel="hopper")` after
a warm-up (0.3 s of calls: the clocks up from idle), with torch's cuDNN
backend timed the same way in the first DIR's process. With --rounds N the
DIRs run N times, the order reversed every other round, and each keeps its
best median (processes differ by a few per cent from one to the next).
The table's cases and their shapes come from benchmarks/bench_attention.py.
"""
import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))

WORKER = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
sys.path.insert(0, sys.argv[2])
import cupy, torch
import cupy_gqa
from bench_attention import CASES
cases, reps, with_torch = sys.argv[3].split(","), int(sys.argv[4]), sys.argv[5] == "1"

def median_ms(fn):
    import time
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < 0.3:  # the clocks up from idle before timing
        fn()
        cupy.cuda.runtime.deviceSynchronize()
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    times = []
    for _ in range(reps):
        start.record(); fn(); stop.record(); stop.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, stop))
    return sorted(times)[len(times) // 2]

for name in cases:
    c = next(c for c in CASES if c.name == name)
    dt = {"bf16": torch.bfloat16, "fp16": torch.float16}[c.dtype]
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(c.batch, c.seqlen_q, c.num_q_heads, c.head_dim, device="cuda", dtype=dt, generator=g)
    k = torch.randn(c.batch, c.seqlen_k, c.num_kv_heads, c.head_dim, device="cuda", dtype=dt, generator=g)
    v = torch.randn_like(k)
    out = torch.empty_like(q)
    qc, kc, vc, oc = (cupy.from_dlpack(x) for x in (q, k, v, out))
    row = {"case": name, "hopper_ms": median_ms(lambda: cupy_gqa.attention(qc, kc, vc, causal=c.causal, out=oc, kernel="hopper"))}
    if with_torch:
        from torch.nn.attention import SDPBackend, sdpa_kernel
        qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            row["cudnn_ms"] = median_ms(lambda: torch.nn.functional.scaled_dot_product_attention(
                qt, kt, vt, is_causal=c.causal, enable_gqa=True))
    print(json.dumps(row), flush=True)
"""


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("dirs", nargs="+")
    parser.add_argument("--cases", default="H1,H2,H3,H4,N1,H5,H6,H7")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=1,
                        help="run the dirs this many times, the order reversed every other round; the best median of each")
    args = parser.parse_args()
    rows = {}
    for r in range(args.rounds):
        for i, d in enumerate(args.dirs if r % 2 == 0 else args.dirs[::-1]):
            proc = subprocess.run(
                [sys.executable, "-c", WORKER, os.path.abspath(d), os.path.dirname(HERE), args.cases, str(args.reps),
                 "1" if d == args.dirs[0] else "0"],
                capture_output=True, text=True, timeout=300,
            )  # fmt: skip
            if proc.returncode:
                print(f"{d}: failed\n{proc.stderr[-3000:]}", flush=True)
                continue
            for line in proc.stdout.splitlines():
                row = json.loads(line)
                best = rows.setdefault(row["case"], {})
                for key, value in ((d, row["hopper_ms"]), ("cudnn", row.get("cudnn_ms"))):
                    if value is not None:
                        best[key] = min(best.get(key, value), value)
    names = [os.path.basename(os.path.normpath(d)) for d in args.dirs]
    print("case   " + " ".join(f"{n:>10}" for n in names) + "      cudnn")
    for case, r in rows.items():
        print(f"{case:6} " + " ".join(f"{r.get(d, float('nan')):10.3f}" for d in args.dirs) + f" {r.get('cudnn', float('nan')):10.3f}")


if __name__ == "__main__":
    main()
