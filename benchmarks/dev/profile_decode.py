#!/usr/bin/env python3
"""One call each of cupy_gqa's decode kernel and torch's flash and cuDNN
backends on D1 (and D2), inside a profiler range, for Nsight Compute:

    ncu --clock-control none --profile-from-start off --section SpeedOfLight \\
        --section LaunchStats --section MemoryWorkloadAnalysis python3 benchmarks/dev/profile_decode.py

Everything is compiled and warmed up before the range starts. Notes:
benchmarks/NOTES_decode.md.
"""
import argparse

import cupy
import ml_dtypes
import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import cupy_gqa
from cupy_gqa import _plan

SHAPES = {"D1": (16, 1, 8192, 32, 8, 128), "D2": (64, 1, 2048, 32, 8, 128)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="D1")
    ap.add_argument("--splits", default="1,2", help="forced split counts of cupy_gqa's decode kernel")
    args = ap.parse_args()
    calls = []
    for name in args.cases.split(","):
        batch, sq, sk, hq, hkv, d = SHAPES[name]
        rnd = lambda *s: cupy.random.standard_normal(s, dtype=cupy.float32).astype(ml_dtypes.bfloat16)  # noqa: E731
        q, k, v = rnd(batch, sq, hq, d), rnd(batch, sk, hkv, d), rnd(batch, sk, hkv, d)
        out = cupy.empty_like(q)
        problem = _plan.Problem.of(q, k, dtype="bfloat16", causal=True, softmax_scale=1 / np.sqrt(d))
        for ns in map(int, args.splits.split(",")):
            calls.append(lambda q=q, k=k, v=v, out=out, ns=ns, problem=problem: _plan._launch_decode_forced_splits(
                problem, q, k, v, out, None, None, ns))
        qt, kt, vt = (torch.from_dlpack(x).transpose(1, 2) for x in (q, k, v))
        for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION):
            def call(backend=backend, qt=qt, kt=kt, vt=vt):
                with sdpa_kernel(backend):
                    F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)  # seqlen_q 1: no mask
            calls.append(call)
        calls.append(lambda q=q, k=k, v=v: cupy_gqa.attention(q, k, v))
    for fn in calls:  # compile and warm up
        fn()
    cupy.cuda.Device().synchronize()
    cupy.cuda.profiler.start()
    for fn in calls:
        fn()
        cupy.cuda.Device().synchronize()
    cupy.cuda.profiler.stop()


if __name__ == "__main__":
    main()
