#!/usr/bin/env python3
"""Where a tensor-core decode CTA's time goes: the kernel with timestamps.

    python3 benchmarks/dev/decode_timeline.py [--cases D06:64,D06:121,D16:21,D1:1]

Each case is NAME:SPLITS (the splits forced, merged by the combine). The
script takes decode_mma_attention's source as cupy_gqa builds it, puts marks
at named places of kernels/decode.cu (it fails if one is not found), compiles
it with the same options, launches the decode plan with it in place of the
real kernel (one call, inputs not in L2), and reads the marks back. Nothing
in the package or kernels/ changes.

Marks, per CTA (thread 0; the loop's end by lane 0 of each warp), each the
SM's clock64 and the global timer (ns, comparable across SMs):
  start   the kernel's first instruction
  q       the Q tile has landed (after the CTA's barrier)
  loop    warp w has left its key loop (w = 0 .. 3)
  merged  the streams' (m, l, o) are in shared memory (before write_cta_result)
  end     the CTA's result is written
and the SM it ran on (%smid). The report: the spread of the CTAs' start times
from the first, and the mean and the largest per-CTA time of each step (clock
cycles and us at the rated SM clock; then each CTA's time by the global timer
and the clock the SMs ran at), the first CTA's start to the last CTA's end,
against the events' time of the whole call (decode kernel and combine); then
the tail: the CTAs' ends by the global timer (percentiles), and the CTAs that
end in its last microsecond with their SMs and how many CTAs those SMs ran.
Notes: NOTES_decode.md.
"""
import argparse
import math
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import cupy  # noqa: E402
import ml_dtypes  # noqa: E402

from cupy_gqa import _plan, _specs  # noqa: E402
from hopper_timeline import in_place_of, load_traced, with_marks  # noqa: E402

CASES = {  # (batch, seqlen_q, seqlen_k, num_q_heads, num_kv_heads, head_dim)
    "D06": (1, 1, 32768, 8, 1, 128),
    "D16": (4, 1, 8192, 48, 1, 128),
    "D24": (8, 1, 16384, 16, 1, 128),
    "D01": (1, 1, 4096, 32, 8, 128),
    "D1": (16, 1, 8192, 32, 8, 128),
    "D2": (64, 1, 2048, 32, 8, 128),
}
MAX_CTAS = 2048
SLOTS = 9  # start, q, loop x 4 warps, merged, end; the CTA's SM (its %smid, in the clock's place)
PRELUDE = f"""
__device__ unsigned long long dt_trace[{MAX_CTAS} * {SLOTS} * 2];
__device__ __forceinline__ void dt_mark(int slot) {{
    if (blockIdx.x < {MAX_CTAS}) {{
        unsigned long long g;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(g));
        unsigned long long* r = dt_trace + ((unsigned long long)blockIdx.x * {SLOTS} + slot) * 2;
        r[0] = clock64();
        r[1] = g;
    }}
}}
__device__ __forceinline__ void dt_sm() {{
    if (blockIdx.x < {MAX_CTAS}) {{
        unsigned s;
        asm volatile("mov.u32 %0, %%smid;" : "=r"(s));
        dt_trace[((unsigned long long)blockIdx.x * {SLOTS} + 8) * 2] = s;
    }}
}}
"""
INSERTIONS = [  # (a place in kernels/decode.cu, found exactly once; the text put before or after it)
    ("    extern __shared__ __align__(16) unsigned char smem_raw[];\n", "after",
     "    if (threadIdx.x == 0) {\n        dt_mark(0);\n        dt_sm();\n    }\n"),
    ("    cp_async_wait<STAGES - 1>();  // the Q group, for this thread ..\n    __syncthreads();              // .. and for all\n",
     "after", "    if (threadIdx.x == 0) dt_mark(1);\n"),
    ("    if constexpr (ROW_WARPS > 1 && NS > 1) {\n        // every stream's warps meet", "before",
     "    if (threadIdx.x % 32 == 0 && threadIdx.x / 32 < 4) dt_mark(2 + threadIdx.x / 32);\n"),
    ("    __syncthreads();\n    if constexpr (CLUSTER == 1) {\n", "before", "    if (threadIdx.x == 0) dt_mark(6);\n"),
    ("        cluster_merge<T, HEAD_DIM, ROWS, THREADS, CLUSTER>(po, pl, out, lse, p, b, kv_head, rb, len, sqn);\n    }\n",
     "after", "    if (threadIdx.x == 0) dt_mark(7);\n"),
]


def traced_source(spec) -> str:
    return with_marks(spec, PRELUDE, INSERTIONS, "decode_timeline")


def run_case(name: str, splits: int, say) -> None:
    batch, sq, sk, hq, hkv, d = CASES[name]
    rnd = lambda *s: cupy.random.standard_normal(s, dtype=cupy.float32).astype(ml_dtypes.bfloat16)  # noqa: E731
    q, k, v = rnd(batch, sq, hq, d), rnd(batch, sk, hkv, d), rnd(batch, sk, hkv, d)
    out = cupy.empty_like(q)
    lse = cupy.empty((batch, hq, sq), dtype=cupy.float32)
    problem = _plan.Problem.of(q, k, dtype="bfloat16", causal=True, softmax_scale=1 / math.sqrt(d))
    arch = _specs.arch_of(*divmod(int(cupy.cuda.Device().compute_capability), 10))
    spec = _specs.decode_spec("bfloat16", d, 16, arch)
    plan_spec = problem.spec(spec)
    module, kernel = load_traced(plan_spec, traced_source(plan_spec))
    with in_place_of(plan_spec, kernel):
        plan = _plan._decode_plan(problem, _plan._layout(q, k, v, out), spec, splits, False)
        work = cupy.empty(max(plan.workspace_bytes // 4, 1), dtype=cupy.float32)
        plan(q, k, v, out, lse, None, work if plan.combined else None)  # load, warm up
        trace = module.get_global("dt_trace")
        buf = cupy.ndarray((MAX_CTAS * SLOTS * 2,), cupy.uint64, trace)
        flush = cupy.empty(256 * 2**20 // 4, dtype=cupy.int32)
        times = []
        for _ in range(5):
            buf.fill(0)
            flush.fill(0)
            start, stop = cupy.cuda.Event(), cupy.cuda.Event()
            start.record()
            plan(q, k, v, out, lse, None, work if plan.combined else None)
            stop.record()
            stop.synchronize()
            times.append(cupy.cuda.get_elapsed_time(start, stop) * 1e3)
        marks = cupy.asnumpy(buf).reshape(MAX_CTAS, SLOTS, 2)  # the last call's
    ctas = plan.grid[0]
    clock_ghz = cupy.cuda.Device().attributes["ClockRate"] / 1e6
    m = marks[:ctas].astype(np.int64)
    clk, gt = m[:, :, 0], m[:, :, 1]
    say(f"\n## {name}:{splits}: B{batch} Sk{sk} Hq{hq} Hkv{hkv} D{d}, {ctas} CTAs; events {np.median(times):.2f} us "
        f"(median of 5, last {times[-1]:.2f})")
    start0 = gt[:, 0].min()
    say(f"CTA starts after the first (global timer, us): median {np.median(gt[:, 0] - start0) / 1e3:.2f}, "
        f"max {np.max(gt[:, 0] - start0) / 1e3:.2f}; first start to last end {(gt[:, 7].max() - start0) / 1e3:.2f} us")
    steps = [("start to Q landed", 0, 1), ("Q landed to warp 0's loop end", 1, 2),
             ("slowest warp's loop end", 1, None), ("loops to merged", None, 6), ("write_cta_result", 6, 7),
             ("start to end", 0, 7)]
    loop_end = clk[:, 2:6].max(axis=1)
    for label, a, b in steps:
        ca = clk[:, a] if a is not None else loop_end
        cb = clk[:, b] if b is not None else loop_end
        x = (cb - ca) / clock_ghz / 1e3
        say(f"  {label:32s} mean {x.mean():7.2f} us   max {x.max():7.2f} us")
    spread = (clk[:, 2:6].max(axis=1) - clk[:, 2:6].min(axis=1)) / clock_ghz / 1e3
    say(f"  warps' loop ends, spread in a CTA  mean {spread.mean():7.2f} us")
    # the rows above count clock64 at the rated clock; the global timer gives the SMs' own
    ns = np.maximum(gt[:, 7] - gt[:, 0], 1)
    say(f"  start to end (global timer)      mean {ns.mean() / 1e3:7.2f} us   max {ns.max() / 1e3:7.2f} us; "
        f"SM clock {np.median((clk[:, 7] - clk[:, 0]) / ns):.2f} GHz (rated {clock_ghz:.2f})")
    # the tail: which CTAs end last, on which SMs (and how many CTAs each of those SMs ran)
    ends = (gt[:, 7] - start0) / 1e3
    sm = clk[:, 8]
    per_sm = np.bincount(sm, minlength=int(sm.max()) + 1)
    say("  CTA ends (global timer, us after the first start): "
        + ", ".join(f"p{q} {np.percentile(ends, q):.2f}" for q in (10, 50, 90, 99)) + f", max {ends.max():.2f}")
    late = np.flatnonzero(ends >= ends.max() - 1.0)
    say(f"  ending in the last 1 us: {late.size} CTAs; (CTA, SM, CTAs on that SM): "
        + " ".join(f"({i},{sm[i]},{per_sm[sm[i]]})" for i in late[:24]))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default="D06:64,D06:121,D16:21,D24:14,D01:16,D1:1")
    args = ap.parse_args()
    print(f"# decode_timeline.py --cases {args.cases}; {cupy.cuda.runtime.getDeviceProperties(0)['name'].decode()}")
    for item in args.cases.split(","):
        name, splits = item.split(":")
        run_case(name, int(splits), print)
    return 0


if __name__ == "__main__":
    sys.exit(main())
