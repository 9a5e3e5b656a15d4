#!/usr/bin/env python3
"""One call each of cupy_gqa's decode kernel (as auto dispatches it, and at forced
split counts) and torch's flash and cuDNN backends on chosen decode cases,
inside a profiler range, for Nsight Compute:

    ncu --clock-control none --profile-from-start off --section SpeedOfLight \\
        --section LaunchStats --section MemoryWorkloadAnalysis \\
        python3 benchmarks/dev/profile_decode.py --cases D01,D06,D16 --splits 1

Cases are the benchmark's, by name (benchmarks/bench_attention.py: CASES and
SHAPE_SWEEP); each case's dispatch (rows per CTA, splits, the cost model's
time) is printed first. Everything is compiled and warmed up before the range
starts. Notes: benchmarks/NOTES_decode.md.
"""
import argparse
import sys
from pathlib import Path

import cupy
import ml_dtypes
import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import cupy_gqa
from cupy_gqa import _plan

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench_attention import CASES, SHAPE_SWEEP  # noqa: E402

DTYPES = {"bf16": ("bfloat16", ml_dtypes.bfloat16), "fp16": ("float16", np.float16)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="D1")
    ap.add_argument("--splits", default="", help="forced split counts of cupy_gqa's decode kernel, beside auto's")
    args = ap.parse_args()
    by_name = {c.name: c for c in (*CASES, *SHAPE_SWEEP)}
    arch = _plan.device_arch(cupy.cuda.Device().id)
    calls = []
    for name in args.cases.split(","):
        c = by_name[name]
        batch, sq, sk, hq, hkv, d = c.batch, c.seqlen_q, c.seqlen_k, c.num_q_heads, c.num_kv_heads, c.head_dim
        dtype, np_dtype = DTYPES[c.dtype]
        rnd = lambda *s: cupy.random.standard_normal(s, dtype=cupy.float32).astype(np_dtype)  # noqa: E731
        q, k, v = rnd(batch, sq, hq, d), rnd(batch, sk, hkv, d), rnd(batch, sk, hkv, d)
        out = cupy.empty_like(q)
        problem = _plan.Problem.of(q, k, dtype=dtype, causal=True, softmax_scale=1 / np.sqrt(d))
        choice = _plan.decode_dispatch(problem, _plan.sm_count(cupy.cuda.Device().id), arch)
        print(f"{name}: B{batch} Sq{sq} Sk{sk} Hq{hq} Hkv{hkv} D{d} {dtype}: {choice}")
        for ns in (int(x) for x in args.splits.split(",") if x):
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
