#!/usr/bin/env python3
"""The fixed cost of one prefill CTA against the cost of one key tile.

Non-causal calls whose CTAs each hold exactly one m-tile (seqlen_q * group =
BLOCK_M packed rows) and n key tiles of 128 keys, with a fixed number of CTAs
(batch * num_kv_heads, several waves of one CTA per SM): the time per wave is
a + b * n. A least-squares fit over n gives a (launch, set-up, the Q load,
the first tile that overlaps nothing, the epilogue) and b (a key tile in the
steady state). Short causal calls (H3: 2.5 key tiles per CTA) pay a on every
CTA.

    python3 benchmarks/dev/hopper_cta_cost.py --kernels hopper,tiled --head-dims 64,128
"""
import argparse

import cupy
import numpy as np

import cupy_gqa


def time_ms(fn, reps=30):
    fn()
    cupy.cuda.Device().synchronize()
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    times = []
    for _ in range(reps):
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, stop))
    return float(np.median(times))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kernels", default="hopper,tiled")
    ap.add_argument("--head-dims", default="64,128")
    ap.add_argument("--tiles", default="1,2,3,4,6,8")
    ap.add_argument("--waves", type=int, default=8)
    ap.add_argument("--dtype", default="float16")
    args = ap.parse_args()
    sms = cupy.cuda.Device().attributes["MultiProcessorCount"]
    hq, hkv = 32, 8
    group = hq // hkv
    rng = cupy.random.default_rng(0)
    print(f"{sms} SMs, {args.waves} waves of one CTA per SM, Hq{hq} Hkv{hkv}, {args.dtype}, non-causal")
    for d in (int(x) for x in args.head_dims.split(",")):
        for kernel in args.kernels.split(","):
            block_m = 128 if kernel == "hopper" else 64  # tiled's packed rows per CTA (its table, D64/D128)
            sq = block_m // group
            batch = args.waves * sms // hkv
            ns = [int(x) for x in args.tiles.split(",")]
            per_wave = []
            for n in ns:
                sk = 128 * n
                q = rng.standard_normal((batch, sq, hq, d), dtype=np.float32).astype(args.dtype)
                k = rng.standard_normal((batch, sk, hkv, d), dtype=np.float32).astype(args.dtype)
                v = rng.standard_normal((batch, sk, hkv, d), dtype=np.float32).astype(args.dtype)
                out = cupy.empty_like(q)
                t = time_ms(lambda: cupy_gqa.attention(q, k, v, causal=False, kernel=kernel, out=out))
                ctas = batch * hkv
                waves = ctas / sms  # nominal: tiled may hold more than one CTA per SM
                per_wave.append(1e3 * t / waves)
                print(f"  D{d} {kernel:6s} n={n} batch={batch} sk={sk}: {t:.4f} ms, {1e3 * t / waves:.2f} us per wave")
            b, a = np.polyfit(ns, per_wave, 1)
            print(f"D{d} {kernel}: per wave = {a:.2f} us + {b:.2f} us x tiles")


if __name__ == "__main__":
    main()
