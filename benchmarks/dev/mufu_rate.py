#!/usr/bin/env python3
"""Rate and latency of the multi-function unit's operations that the softmax
uses (tanh.approx and ex2.approx, f32 and f16), and of the conversions beside
them (int to float, a float pair to bf16x2), measured in SM cycles:

    python3 benchmarks/dev/mufu_rate.py

Rate: 8 blocks of 256 threads per SM, each thread 8 independent chains of the
operation; results per SM per cycle, each SM's from its first block's start to
its last block's end (clock64 and %smid; blocks of one SM need not overlap).
Latency: one warp, one dependent chain; cycles per operation.
The softcap's floor (benchmarks/NOTES_hopper.md) assumes tanh and ex2 share one
rate of 16 results per SM per cycle.
"""
import cupy as cp
import numpy as np

OPS = {
    "tanh.f32": "asm volatile(\"tanh.approx.f32 %0, %0;\" : \"+f\"(a[c]));",
    "ex2.f32": "asm volatile(\"ex2.approx.ftz.f32 %0, %0;\" : \"+f\"(a[c]));",
    "tanh.f16": "{ unsigned short h; asm volatile(\"cvt.rn.f16.f32 %0, %1;\" : \"=h\"(h) : \"f\"(a[c])); "
                "asm volatile(\"tanh.approx.f16 %0, %0;\" : \"+h\"(h)); "
                "asm volatile(\"cvt.f32.f16 %0, %1;\" : \"=f\"(a[c]) : \"h\"(h)); }",
    "tanh+ex2": "if (c & 1) asm volatile(\"ex2.approx.ftz.f32 %0, %0;\" : \"+f\"(a[c])); "
                "else asm volatile(\"tanh.approx.f32 %0, %0;\" : \"+f\"(a[c]));",
    "ffma": "a[c] = fmaf(a[c], 0.999f, 0.001f);",
    # conversions: an int's to float (ALiBi's distance), two floats to a bf16 pair (P to
    # the P V operand); each result's bits feed the next
    "i2f": "asm volatile(\"cvt.rn.f32.s32 %0, %1;\" : \"=f\"(a[c]) : \"r\"(__float_as_int(a[c])));",
    "f2bf16x2": "{ unsigned u; asm volatile(\"cvt.rn.bf16x2.f32 %0, %1, %1;\" : \"=r\"(u) : \"f\"(a[c])); "
                "a[c] = __uint_as_float(u); }",
    # half each: the rate of a mix says whether the two share a unit (16: one unit; 32: two)
    "ex2+i2f": "if (c & 1) asm volatile(\"ex2.approx.ftz.f32 %0, %0;\" : \"+f\"(a[c])); "
               "else asm volatile(\"cvt.rn.f32.s32 %0, %1;\" : \"=f\"(a[c]) : \"r\"(__float_as_int(a[c])));",
    "ex2+f2bf16x2": "if (c & 1) asm volatile(\"ex2.approx.ftz.f32 %0, %0;\" : \"+f\"(a[c])); "
                    "else { unsigned u; asm volatile(\"cvt.rn.bf16x2.f32 %0, %1, %1;\" : \"=r\"(u) : \"f\"(a[c])); "
                    "a[c] = __uint_as_float(u); }",
}
SRC = r"""
extern "C" __global__ void k(long long* span, float* out, int n) {
  float a[CHAINS];
  #pragma unroll
  for (int c = 0; c < CHAINS; ++c) a[c] = 0.25f + 0.01f * (threadIdx.x + c);
  __syncthreads();
  long long t0 = clock64();
  for (int i = 0; i < n; ++i) {
    #pragma unroll
    for (int c = 0; c < CHAINS; ++c) { OP }
  }
  __syncthreads();
  long long t1 = clock64();
  float s = 0.f;
  #pragma unroll
  for (int c = 0; c < CHAINS; ++c) s += a[c];
  out[blockIdx.x * blockDim.x + threadIdx.x] = s;
  if (threadIdx.x == 0) {
    unsigned sm;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
    span[3 * blockIdx.x] = sm; span[3 * blockIdx.x + 1] = t0; span[3 * blockIdx.x + 2] = t1;
  }
}
"""


def run(op: str, chains: int, blocks: int, threads: int, n: int) -> float:
    """Operations per SM per cycle (mean over the SMs that ran blocks)."""
    src = SRC.replace("OP", OPS[op]).replace("CHAINS", str(chains))
    kern = cp.RawKernel(src, "k", options=("-arch=sm_90",))
    span = cp.zeros(3 * blocks, dtype=cp.int64)
    out = cp.empty(blocks * threads, dtype=cp.float32)
    kern((blocks,), (threads,), (span, out, cp.int32(n)))  # warm-up
    kern((blocks,), (threads,), (span, out, cp.int32(n)))
    cp.cuda.runtime.deviceSynchronize()
    s = span.get().reshape(blocks, 3)
    rates = []
    for sm in np.unique(s[:, 0]):
        mine = s[s[:, 0] == sm]
        rates.append(len(mine) * threads * chains * n / (mine[:, 2].max() - mine[:, 1].min()))
    return float(np.mean(rates))


def main():
    sms = cp.cuda.Device().attributes["MultiProcessorCount"]
    print(cp.cuda.runtime.getDeviceProperties(0)["name"].decode(), f"{sms} SMs")
    n = 4096
    for op in OPS:
        rate = run(op, 8, sms * 8, 256, n)
        lat = 32 / run(op, 1, 1, 32, n)
        print(f"{op:10s} rate {rate:7.2f} per SM per cycle   latency {lat:6.1f} cycles (dependent chain)")


if __name__ == "__main__":
    main()
