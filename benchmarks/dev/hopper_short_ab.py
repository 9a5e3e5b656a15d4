#!/usr/bin/env python3
"""hopper against tiled on short prefill calls, where auto's key thresholds
(_specs.HOPPER_BULK_QO_AUTO_MIN_KEYS, HOPPER_AUTO_MIN_KEYS) decide between them.

    python benchmarks/dev/hopper_short_ab.py [--seqlens 128,256,384,512,768,1024]

Timing: decode_layouts.median_ms (CuPy events around back-to-back calls,
per call, the median of its REPS) on CuPy inputs (the repeat path); L2 not
flushed (the inputs of these calls fit in it either way). The run of
2026-12-04 took the median of 9. Prints ms per call and hopper / tiled.
"""
import argparse
import sys
from pathlib import Path

import ml_dtypes
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import cupy  # noqa: E402

import cupy_gqa  # noqa: E402
from decode_layouts import REPS, median_ms  # noqa: E402
from cupy_gqa import _plan  # noqa: E402

# (batch, num_q_heads, num_kv_heads, head_dim): the sweep's P18 and P16 classes, D64, MHA
SHAPES = [(64, 32, 8, 128), (16, 12, 2, 128), (32, 32, 8, 64), (16, 32, 32, 128), (64, 32, 8, 96)]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqlens", default="128,256,384,512,768,1024")
    args = ap.parse_args()
    print(f"{cupy.cuda.runtime.getDeviceProperties(0)['name'].decode()}  bf16 causal, ms per call (median of {REPS})")
    print(f"{'shape':28s} {'S':>5s} {'tiled':>8s} {'hopper':>8s} {'h/t':>6s}  auto")
    for b, hq, hkv, d in SHAPES:
        for s in (int(x) for x in args.seqlens.split(",")):
            q, k, v = (cupy.asarray(np.random.default_rng(i).standard_normal(sh).astype(ml_dtypes.bfloat16))
                       for i, sh in enumerate(((b, s, hq, d), (b, s, hkv, d), (b, s, hkv, d))))
            out = cupy.empty_like(q)
            t = {kn: median_ms(lambda kn=kn: cupy_gqa.attention(q, k, v, out=out, kernel=kn)) for kn in ("tiled", "hopper")}
            problem = _plan.Problem.of(q, k, dtype="bfloat16", causal=True, softmax_scale=d**-0.5)
            auto = _plan.choose_kernel(problem, q, k, v, out)
            print(f"B{b} Hq{hq} Hkv{hkv} D{d}".ljust(28) + f" {s:5d} {t['tiled']:8.4f} {t['hopper']:8.4f} {t['hopper'] / t['tiled']:6.3f}  {auto}",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
