#!/usr/bin/env python3
"""The NumPy backend's time (cupy_gqa/cpu.py), forward and backward, on a few shapes.

    python3 benchmarks/dev/cpu_backend.py [--reps 3] [--backward]

NumPy inputs, float32 and float16, causal and not: the best of REPS calls, and
GFLOP/s over the visible pairs (4 * batch * heads * pairs * head_dim forward, 2.5
times that backward). To compare two checkouts, run it in each with PYTHONPATH
set to the checkout.
"""
import argparse
import time

import numpy as np

import cupy_gqa

# (batch, seqlen_q, seqlen_k, num_q_heads, num_kv_heads, head_dim)
SHAPES = [(1, 1024, 1024, 8, 2, 64), (2, 2048, 2048, 16, 4, 128), (4, 1, 4096, 32, 8, 128), (1, 4096, 4096, 8, 1, 64)]


def best_of(fn, reps):
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--backward", action="store_true", help="also time attention_backward")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    print(f"numpy {np.__version__}, cupy_gqa from {cupy_gqa.__file__}")
    for b, sq, sk, hq, hkv, d in SHAPES:
        for dtype in (np.float32, np.float16):
            for causal in (True, False):
                q = rng.standard_normal((b, sq, hq, d)).astype(dtype)
                k = rng.standard_normal((b, sk, hkv, d)).astype(dtype)
                v = rng.standard_normal((b, sk, hkv, d)).astype(dtype)
                pairs = sum(min(sk, max(0, t + sk - sq + 1)) for t in range(sq)) if causal else sq * sk
                flops = 4 * b * hq * pairs * d
                out, lse = cupy_gqa.attention(q, k, v, causal=causal, return_lse=True)
                fwd = best_of(lambda: cupy_gqa.attention(q, k, v, causal=causal), args.reps)
                line = (f"B{b} Sq{sq} Sk{sk} Hq{hq} Hkv{hkv} D{d} {np.dtype(dtype).name:8s} "
                        f"{'causal' if causal else 'full  '}  forward {fwd * 1e3:9.1f} ms {flops / fwd / 1e9:6.1f} GFLOP/s")  # fmt: skip
                if args.backward and sq > 1:
                    dout = rng.standard_normal(out.shape).astype(dtype)
                    bwd = best_of(lambda: cupy_gqa.attention_backward(dout, q, k, v, out, lse, causal=causal), args.reps)
                    line += f"  backward {bwd * 1e3:9.1f} ms {2.5 * flops / bwd / 1e9:6.1f} GFLOP/s"
                print(line, flush=True)


if __name__ == "__main__":
    main()
