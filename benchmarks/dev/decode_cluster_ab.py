#!/usr/bin/env python3
"""A split decode call merged by its thread-block clusters against the same
call merged by the combine kernel (kernels/decode.cu), at forced split counts.

    python3 benchmarks/dev/decode_cluster_ab.py [--cases D01,D02] [--rounds 4]

Per case and (splits, merge[, variant: one CTA an SM, or the spread policy]), three numbers:
  gpu_us    CUDA events around one call, a 256 MB buffer zeroed before each
            repetition (no input in L2), median of REPS; the combine path's
            workspace is allocated beforehand, as a caller's
  loop_us   wall time of CALLS calls back to back / CALLS (no flush; the
            combine path takes its workspace from CuPy's pool each call, as
            a call without workspace= does): what a decode loop sees
  host_us   the host time of one call with the GPU idle (median)
The configurations are timed in turn, the order reversed every other round.
Also printed: decode_dispatch's choice for the case. Notes: benchmarks/NOTES_decode.md.
"""
import argparse
import dataclasses
import math
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import cupy  # noqa: E402
import ml_dtypes  # noqa: E402

from cupy_backends.cuda.api import driver  # noqa: E402
from cupy_gqa import _compile, _plan, _specs  # noqa: E402

REPS, CALLS = 30, 1000
FLUSH = cupy.empty(256 * 2**20 // 4, dtype=cupy.int32)

# (splits, cluster, ONE): the kernel launched with ONE_CTA_SMEM bytes of shared memory, more than
# half an SM's, so that no SM holds two of its CTAs (the kernel uses its own size of it);
# (splits, cluster, SPREAD): the cluster kernel under the driver's cluster scheduling policy
# "spread" (CU_FUNC_ATTRIBUTE_CLUSTER_SCHEDULING_POLICY_PREFERENCE = 15, CU_CLUSTER_SCHEDULING_
# POLICY_SPREAD = 1; every other configuration runs with the default, 0)
ONE, SPREAD = "1/SM", "spread"
ONE_CTA_SMEM = 120 * 1024
FUNC_ATTRIBUTE_CLUSTER_SCHEDULING_POLICY = 15

# name: (batch, seqlen_q, seqlen_k, num_q_heads, num_kv_heads, head_dim), then (splits, cluster) to
# time (and a variant: ONE or SPREAD), then the dtype (bfloat16 where not given). D07 (the sweep's fp16 point) and D02 read the same
# bytes in the same number of CTAs (4096 keys each): clusters of 4 against 2, fp16 against bf16
CASES = {
    "D01": ((1, 1, 4096, 32, 8, 128), [(16, False), (8, True), (8, False), (4, True)]),
    "D02": ((8, 1, 8192, 32, 8, 128), [(2, True), (2, False), (4, True), (1, False)]),
    "D06": ((1, 1, 32768, 8, 1, 128), [(121, False), (8, True), (64, False)]),
    "B2_S2048_mqa": ((2, 1, 2048, 16, 1, 64), [(8, True), (8, False), (16, False)]),
    "D1": ((16, 1, 8192, 32, 8, 128), [(1, False), (2, True), (4, True)]),
    "D2": ((64, 1, 2048, 32, 8, 128), [(1, False), (2, True)]),
    "D07": ((4, 1, 16384, 32, 8, 128), [(4, True), (4, False), (2, True), (4, True, ONE), (4, True, SPREAD),
                                        (8, True), (8, True, SPREAD)], "float16"),
    "D07_bf16": ((4, 1, 16384, 32, 8, 128), [(4, True), (4, False), (2, True), (4, True, ONE), (4, True, SPREAD)]),
    "D02_fp16": ((8, 1, 8192, 32, 8, 128), [(2, True), (2, False), (4, True), (2, True, ONE), (2, True, SPREAD)],
                 "float16"),
    "D1_spread": ((16, 1, 8192, 32, 8, 128), [(1, False), (2, True), (2, True, SPREAD), (2, False)]),
    "D01_spread": ((1, 1, 4096, 32, 8, 128), [(8, True), (8, True, SPREAD), (8, True, ONE), (8, False)]),
    # D1's per-CTA work (one KV head's 8192 keys, 4 query heads on it) in 128 CTAs and in 132 (every
    # SM of an H100 or H200): whether the unsplit launch is bound per SM (bytes in flight) or by HBM
    "pairs128": ((32, 1, 8192, 16, 4, 128), [(1, False)]),
    "pairs132": ((33, 1, 8192, 16, 4, 128), [(1, False)]),
    # the sweep's one-KV-head points: the model's split through the combine against portable clusters
    "D16": ((4, 1, 8192, 48, 1, 128), [(19, False), (16, False), (8, True), (4, True), (32, False)]),
    "D24": ((8, 1, 16384, 16, 1, 128), [(14, False), (16, False), (8, True), (4, True), (32, False)]),
    "D05": ((16, 1, 8192, 8, 1, 128), [(8, False), (8, True), (4, True), (16, False)]),
}
TYPES = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16}


def inputs(shape, dtype):
    batch, sq, sk, hq, hkv, d = shape
    rnd = lambda *s: cupy.random.standard_normal(s, dtype=cupy.float32).astype(TYPES[dtype])  # noqa: E731
    return rnd(batch, sq, hq, d), rnd(batch, sk, hkv, d), rnd(batch, sk, hkv, d)


def setup(shape, qkv, splits, cluster, variant="", *, dtype):
    batch, sq, sk, hq, hkv, d = shape
    q, k, v = qkv
    out = cupy.empty_like(q)
    lse = cupy.empty((batch, hq, sq), dtype=cupy.float32)
    problem = _plan.Problem.of(q, k, dtype=dtype, causal=True, softmax_scale=1 / math.sqrt(d))
    arch = _specs.arch_of(*divmod(int(cupy.cuda.Device().compute_capability), 10))
    block_m = _plan.decode_dispatch(problem, _plan.sm_count(0), arch).block_m
    spec = _specs.decode_spec(dtype, d, block_m, arch)
    plan = _plan._decode_plan(problem, _plan._layout(q, k, v, out), spec, splits, cluster)
    if variant == ONE:
        wide = dataclasses.replace(plan.spec, smem=ONE_CTA_SMEM)
        _compile.get_kernel(plan.spec).max_dynamic_shared_size_bytes = ONE_CTA_SMEM  # (the same kernel)
        plan = dataclasses.replace(plan, spec=wide)
    function = _compile.get_kernel(plan.spec).kernel.ptr
    policy = 1 if variant == SPREAD else 0

    def prepare():
        if plan.cluster:
            driver.funcSetAttribute(function, FUNC_ATTRIBUTE_CLUSTER_SCHEDULING_POLICY, policy)
    work = cupy.empty(max(plan.workspace_bytes // 4, 1), dtype=cupy.float32)
    return plan, (q, k, v, out, lse), work, prepare


def gpu_us(plan, arrays, work):
    q, k, v, out, lse = arrays
    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    times = []
    for _ in range(REPS):
        FLUSH.fill(0)
        start.record()
        plan(q, k, v, out, lse, None, work if plan.combined else None)
        end.record()
        end.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, end) * 1e3)
    return float(np.median(times))


def loop_us(plan, arrays):
    q, k, v, out, lse = arrays
    for _ in range(50):
        plan(q, k, v, out, lse, None)
    cupy.cuda.Device().synchronize()
    t0 = time.perf_counter()
    for _ in range(CALLS):
        plan(q, k, v, out, lse, None)
    cupy.cuda.Device().synchronize()
    return (time.perf_counter() - t0) / CALLS * 1e6


def host_us(plan, arrays):
    q, k, v, out, lse = arrays
    times = []
    for _ in range(200):
        cupy.cuda.Device().synchronize()
        t0 = time.perf_counter()
        plan(q, k, v, out, lse, None)
        times.append(time.perf_counter() - t0)
    cupy.cuda.Device().synchronize()
    return float(np.median(times)) * 1e6


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--rounds", type=int, default=4)
    args = ap.parse_args()
    dev = cupy.cuda.Device()
    print(f"{cupy.cuda.runtime.getDeviceProperties(dev.id)['name'].decode()}  cupy {cupy.__version__}  "
          f"{args.rounds} rounds; best of the rounds' medians")
    print(f"{'case':14s} {'splits':>6s} {'merge':>14s} {'gpu_us':>8s} {'loop_us':>8s} {'host_us':>8s} {'GB/s':>7s}  dispatch")
    for name in args.cases.split(","):
        shape, configs, dtype = (*CASES[name], "bfloat16")[:3]
        qkv = inputs(shape, dtype)
        setups = [setup(shape, qkv, *config, dtype=dtype) for config in configs]
        best = {i: [math.inf] * 3 for i in range(len(configs))}
        for r in range(args.rounds):
            order = range(len(configs)) if r % 2 == 0 else reversed(range(len(configs)))
            for i in order:
                plan, arrays, work, prepare = setups[i]
                prepare()
                got = (gpu_us(plan, arrays, work), loop_us(plan, arrays), host_us(plan, arrays))
                best[i] = [min(a, b) for a, b in zip(best[i], got)]
        problem = _plan.Problem(*shape[:6], dtype, True, 1 / math.sqrt(shape[5]))
        arch = _specs.arch_of(*divmod(int(dev.compute_capability), 10))
        choice = _plan.decode_dispatch(problem, _plan.sm_count(dev.id), arch)
        kv_bytes = 2 * shape[0] * shape[2] * shape[4] * shape[5] * 2  # K and V, 16-bit
        for i, (s, c, *variant) in enumerate(configs):
            g, lp, h = best[i]
            merge = ("cluster" if c else "combine") + "".join("," + v for v in variant)
            gbs = kv_bytes / (g * 1e-6) / 1e9
            print(f"{name:14s} {s:6d} {merge:>14s} {g:8.2f} {lp:8.2f} {h:8.2f} {gbs:7.0f}  "
                  f"{choice.block_m} rows, {choice.num_splits} splits" if i == 0 else
                  f"{name:14s} {s:6d} {merge:>14s} {g:8.2f} {lp:8.2f} {h:8.2f} {gbs:7.0f}")
        # every configuration's output against the first's (the same inputs)
        outs = []
        for plan, arrays, work, prepare in setups:
            prepare()
            q, k, v, out, lse = arrays
            plan(q, k, v, out, lse, None, work if plan.combined else None)
            outs.append(cupy.asnumpy(out.astype(cupy.float32)))
        ref = outs[0]
        print(f"{name:14s} max |out - first config's|: " + ", ".join(f"{np.abs(o - ref).max():.2e}" for o in outs[1:]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
