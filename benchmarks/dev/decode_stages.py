#!/usr/bin/env python3
"""The tensor-core decode kernel's pipeline depth against the calls it runs:
cp.async stages per key stream (the table's 3 at head dim 128) at forced
split counts, merged by the combine or by the cluster.

    python3 benchmarks/dev/decode_stages.py [--cases D06,D1] [--stages 3,4,6] [--rounds 3]

A stream keeps STAGES - 1 tiles of 16 keys in flight, so a CTA that streams
alone (grids of at most one CTA per SM) waits on about one memory latency
per STAGES - 1 tiles: the small calls' time per tile (the cost model's
DECODE_TILE_S) should fall with the stages, while the full grids (D1, D2:
bandwidth-bound, two CTAs per SM at 3 stages) should not gain. GPU time as
decode_cluster_ab.py measures it (CUDA events, a 256 MB buffer zeroed before
each repetition), best of the rounds' medians, the stage counts timed in
turn. Notes: benchmarks/NOTES_decode.md.
"""
import argparse
import math
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import cupy  # noqa: E402

from cupy_gqa import _plan, _specs  # noqa: E402
from decode_cluster_ab import gpu_us, inputs  # noqa: E402

# name: (batch, seqlen_q, seqlen_k, num_q_heads, num_kv_heads, head_dim), [(splits, cluster)]
CASES = {
    "D06": ((1, 1, 32768, 8, 1, 128), [(32, False), (64, False), (121, False)]),
    "D16": ((4, 1, 8192, 48, 1, 128), [(21, False), (32, False)]),
    "D24": ((8, 1, 16384, 16, 1, 128), [(14, False), (8, True)]),
    "D01": ((1, 1, 4096, 32, 8, 128), [(8, True), (16, False)]),
    "D02": ((8, 1, 8192, 32, 8, 128), [(2, True), (1, False)]),
    "D1": ((16, 1, 8192, 32, 8, 128), [(1, False)]),
    "D2": ((64, 1, 2048, 32, 8, 128), [(1, False)]),
    # head dim 64 (the sweep's D18 and D23): half of head dim 128's bytes in flight at the same stages
    "D18": ((16, 1, 8192, 32, 8, 64), [(2, True), (1, False)]),
    "D23": ((8, 1, 8192, 64, 8, 64), [(4, True), (2, True)]),
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--stages", default="3,4,5,6")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    stages = [int(s) for s in args.stages.split(",")]
    dev = cupy.cuda.Device()
    print(f"{cupy.cuda.runtime.getDeviceProperties(dev.id)['name'].decode()}  cupy {cupy.__version__}  "
          f"{args.rounds} rounds; GPU us, best of the rounds' medians (L2 flushed)")
    print(f"{'case':6s} {'splits':>6s} {'merge':>8s} " + " ".join(f"{'s' + str(s):>8s}" for s in stages))
    for name in args.cases.split(","):
        shape, configs = CASES[name]
        batch, sq, sk, hq, hkv, d = shape
        q, k, v = inputs(shape)
        out = cupy.empty_like(q)
        lse = cupy.empty((batch, hq, sq), dtype=cupy.float32)
        problem = _plan.Problem.of(q, k, dtype="bfloat16", causal=True, softmax_scale=1 / math.sqrt(d))
        layout = _plan._layout(q, k, v, out)
        for splits, cluster in configs:
            plans = []
            for st in stages:
                spec = _specs.decode_mma_spec("bfloat16", d, st)
                plan = _plan._decode_plan(problem, layout, spec, splits, cluster)
                work = cupy.empty(max(plan.workspace_bytes // 4, 1), dtype=cupy.float32)
                plans.append((plan, work))
            best = [math.inf] * len(stages)
            for r in range(args.rounds):
                order = range(len(stages)) if r % 2 == 0 else reversed(range(len(stages)))
                for i in order:
                    plan, work = plans[i]
                    best[i] = min(best[i], gpu_us(plan, (q, k, v, out, lse), work))
            outs = []
            for plan, work in plans:
                out.fill(np.nan)
                plan(q, k, v, out, lse, None, work if plan.combined else None)
                outs.append(cupy.asnumpy(out.astype(cupy.float32)))
            diff = max(float(np.abs(o - outs[0]).max()) for o in outs)
            print(f"{name:6s} {splits:6d} {'cluster' if cluster else 'combine':>8s} "
                  + " ".join(f"{b:8.2f}" for b in best) + f"   max |diff| {diff:.1e}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
