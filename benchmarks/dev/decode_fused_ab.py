#!/usr/bin/env python3
"""Split decode with the merge in the launch's last CTAs (one launch, counters
of the device's ring) against the decode kernel followed by the combine
kernel, on the same plan, the same inputs, in one process.

For each shape (cupy_gqa's choice of kernel, rows per CTA and splits, or
--splits forced): the GPU time per call (CUDA events around CALLS back-to-back
launches of the kept plan, no L2 flush, median of REPS), the wall time per
call of cupy_gqa.attention on torch tensors (2000 calls back to back, as
bench_attention's per-call cases) and the host time of one call (the GPU
idle before it), each mode in turn, twice; and whether the two agree bit for bit.

    python3 benchmarks/dev/decode_fused_ab.py [--shapes L2,L3,...]
"""
import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import cupy  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

import cupy_gqa  # noqa: E402
from cupy_gqa import _plan  # noqa: E402

# name: (batch, seqlen_q, seqlen_k, num_q_heads, num_kv_heads, head_dim)
SHAPES = {
    "L2": (1, 1, 4096, 32, 8, 128),
    "L3": (8, 1, 1024, 32, 8, 128),
    "B1_32k_g8": (1, 1, 32768, 8, 1, 128),
    "B1_128k": (1, 1, 131072, 32, 8, 128),
    "B4_16k_g4": (4, 1, 16384, 32, 8, 128),
    "B32_4000": (32, 1, 4000, 32, 8, 128),
    "spec4_B2_8k": (2, 4, 8192, 32, 8, 128),
}
REPS, CALLS, WALL_CALLS = 15, 20, 2000


def gpu_ms(fn) -> float:
    fn()
    times = []
    for _ in range(REPS):
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        start.record()
        for _ in range(CALLS):
            fn()
        end.record()
        end.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, end) / CALLS)
    return statistics.median(times)


def wall_us(fn) -> tuple[float, float]:
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(WALL_CALLS):
        fn()
    torch.cuda.synchronize()
    per_call = (time.perf_counter() - t0) / WALL_CALLS * 1e6
    host = []
    for _ in range(200):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        host.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    return per_call, statistics.median(host) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default=",".join(SHAPES))
    args = ap.parse_args()
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  cupy {cupy.__version__}")
    print(f"{'shape':12} {'block_m':>7} {'splits':>6} {'mode':>8} {'gpu_us':>8} {'wall_us':>8} {'host_us':>8}  equal")
    for name in args.shapes.split(","):
        b, sq, sk, hq, hkv, d = SHAPES[name]
        g = torch.Generator(device="cuda").manual_seed(0)
        q = torch.randn(b, sq, hq, d, device="cuda", dtype=torch.bfloat16, generator=g)
        k = torch.randn(b, sk, hkv, d, device="cuda", dtype=torch.bfloat16, generator=g)
        v = torch.randn(b, sk, hkv, d, device="cuda", dtype=torch.bfloat16, generator=g)
        qc, kc, vc = (cupy.from_dlpack(x) for x in (q, k, v))
        out = cupy.empty(qc.shape, qc.dtype)
        problem = _plan.Problem.of(qc, kc, dtype="bfloat16", causal=True, softmax_scale=d**-0.5)
        plan = _plan.launch_decode(problem, qc, kc, vc, out, None, None)  # cupy_gqa's choice
        if plan.num_splits == 1:
            print(f"{name:12} {plan.spec.block_m:7} {1:6}  (not split: nothing to compare)")
            continue
        work = cupy.empty(plan.workspace_bytes // 4, cupy.float32)
        results, rows = {}, {}
        for _ in range(2):
            for fused in (True, False):
                _plan.DECODE_FUSED_MERGE = fused
                out.fill(np.nan)
                plan(qc, kc, vc, out, None, None, work)
                results[fused] = cupy.asnumpy(out).tobytes()
                t = gpu_ms(lambda: plan(qc, kc, vc, out, None, None, work)) * 1e3
                per_call, host = wall_us(lambda: cupy_gqa.attention(q, k, v))
                best = rows.get(fused, (1e9, 1e9, 1e9))
                rows[fused] = tuple(min(x, y) for x, y in zip(best, (t, per_call, host)))
        _plan.DECODE_FUSED_MERGE = True
        for fused in (True, False):
            t, per_call, host = rows[fused]
            mode = "fused" if fused else "combine"
            print(f"{name:12} {plan.spec.block_m:7} {plan.num_splits:6} {mode:>8} {t:8.2f} {per_call:8.2f} {host:8.2f}  "
                  f"{results[True] == results[False]}", flush=True)


if __name__ == "__main__":
    main()
