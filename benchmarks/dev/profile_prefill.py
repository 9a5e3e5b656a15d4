#!/usr/bin/env python3
"""One call each of cupy_gqa's prefill kernels (hopper, tiled) and torch's cuDNN
backend on chosen prefill cases, inside a profiler range, for Nsight Compute:

    ncu --clock-control none --profile-from-start off --section SpeedOfLight \\
        --section Occupancy --section LaunchStats --section WarpStateStats \\
        --section SchedulerStats --section MemoryWorkloadAnalysis \\
        python3 benchmarks/dev/profile_prefill.py --cases H3,H4
        (--section ComputeWorkloadAnalysis: the pipes' utilisation, e.g. the
        multi-function unit's with --softcap 30 --cases H1 --kernels hopper)

Everything is compiled and warmed up before the range starts. Shapes are the
benchmark's (benchmarks/bench_attention.py: CASES). Notes: benchmarks/NOTES_hopper.md.
"""
import argparse
import sys
from pathlib import Path

import cupy
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import cupy_gqa

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench_attention import CASES  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="H3")
    ap.add_argument("--kernels", default="hopper,tiled")
    ap.add_argument("--softcap", type=float, default=None,
                    help="also profile each cupy_gqa call with this softcap (W2: 30 at H1), beside the plain one")
    args = ap.parse_args()
    by_name = {c.name: c for c in CASES}
    calls = []
    for name in args.cases.split(","):
        c = by_name[name]
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[c.dtype]
        q = torch.randn(c.batch, c.seqlen_q, c.num_q_heads, c.head_dim, device="cuda", dtype=dtype)
        k = torch.randn(c.batch, c.seqlen_k, c.num_kv_heads, c.head_dim, device="cuda", dtype=dtype)
        v = torch.randn_like(k)
        for kernel in args.kernels.split(","):
            for cap in (None,) if args.softcap is None else (None, args.softcap):
                calls.append(lambda q=q, k=k, v=v, kernel=kernel, causal=c.causal, cap=cap: cupy_gqa.attention(
                    q, k, v, causal=causal, kernel=kernel, softcap=cap))
        qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))

        def cudnn(qt=qt, kt=kt, vt=vt, causal=c.causal):
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, enable_gqa=True)
        calls.append(cudnn)
    for fn in calls:  # compile and warm up
        fn()
    torch.cuda.synchronize()
    cupy.cuda.profiler.start()
    for fn in calls:
        fn()
        torch.cuda.synchronize()
    cupy.cuda.profiler.stop()


if __name__ == "__main__":
    main()
