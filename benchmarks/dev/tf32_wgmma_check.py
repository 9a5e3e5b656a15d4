#!/usr/bin/env python3
"""What a TF32 wgmma does with the low bits of its float32 operands (sm_90).

A fp32-accurate Hopper prefill (split TF32: hi * hi + hi * lo + lo * hi, as
tiled_tf32 does on mma.sync) needs to know whether `wgmma ... .tf32.tf32`
ignores the low 13 mantissa bits of a 32-bit operand (then the raw float32
values can serve as `hi` and only `lo = x - trunc(x)` needs a copy) or rounds
them (then `hi` must be rounded on the way in). One warpgroup computes
D = A B^T for A 64 x 8 and B 8 x 8 float32 values with random low bits, both
operands in shared memory (K-major, no swizzle: core matrices of 8 rows x
16 bytes, K-adjacent ones 128 bytes apart, row-adjacent ones 256), and the result is
compared with the product of the operands truncated to TF32, rounded to
nearest TF32, and exact (float64). The smallest error names the behaviour.

    python3 benchmarks/dev/tf32_wgmma_check.py
"""
import sys

import numpy as np

SOURCE = r"""
extern "C" __global__ void __launch_bounds__(128) tf32_wgmma(const float* a, const float* b, float* d) {
    // A: 64 x 8, B: 8 x 8, both K-major; core matrix (m / 8, k / 4) of A at byte
    // ((m / 8) * 2 + k / 4) * 128, row m % 8 at 16 (m % 8), element k % 4 at 4 (k % 4)
    __shared__ __align__(128) float sa[64 * 8];
    __shared__ __align__(128) float sb[8 * 8];
    const int t = threadIdx.x;
    for (int i = t; i < 64 * 8; i += 128) {
        const int m = i / 8, k = i % 8;
        sa[((m / 8) * 2 + k / 4) * 32 + (m % 8) * 4 + k % 4] = a[i];
    }
    for (int i = t; i < 8 * 8; i += 128) {
        const int n = i / 8, k = i % 8;
        sb[(k / 4) * 32 + n * 4 + k % 4] = b[i];
    }
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    __syncthreads();
    auto desc = [](const void* p, unsigned lbo, unsigned sbo) {
        const unsigned addr = static_cast<unsigned>(__cvta_generic_to_shared(p));
        return (unsigned long long)((addr >> 4) & 0x3FFF) | ((unsigned long long)((lbo >> 4) & 0x3FFF) << 16) |
               ((unsigned long long)((sbo >> 4) & 0x3FFF) << 32);
    };
    const unsigned long long da = desc(sa, 128, 256), db = desc(sb, 128, 256);
    float d0 = 0.f, d1 = 0.f, d2 = 0.f, d3 = 0.f;
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %6, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n8k8.f32.tf32.tf32 {%0, %1, %2, %3}, %4, %5, p, 1, 1;\n}\n"
        : "+f"(d0), "+f"(d1), "+f"(d2), "+f"(d3)
        : "l"(da), "l"(db), "r"(0));
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
    asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
    // the m64n8 accumulator: warp w rows 16 w + lane / 4 (+ 8), columns 2 (lane % 4) + {0, 1}
    const int w = t / 32, lane = t % 32, row = 16 * w + lane / 4, col = 2 * (lane % 4);
    d[row * 8 + col] = d0;
    d[row * 8 + col + 1] = d1;
    d[(row + 8) * 8 + col] = d2;
    d[(row + 8) * 8 + col + 1] = d3;
}
"""


def truncate_tf32(x: np.ndarray) -> np.ndarray:
    return (x.view(np.uint32) & np.uint32(0xFFFFE000)).view(np.float32)


def round_tf32(x: np.ndarray) -> np.ndarray:
    """Round to nearest TF32 (10 mantissa bits), ties away from zero (cvt.rna.tf32.f32)."""
    u = x.view(np.uint32).astype(np.uint64)
    return ((u + 0x1000) & 0xFFFFE000).astype(np.uint32).view(np.float32)


def main() -> int:
    import cupy

    rng = np.random.default_rng(0)
    a = rng.uniform(1.0, 2.0, (64, 8)).astype(np.float32) * rng.choice([-1.0, 1.0], (64, 8)).astype(np.float32)
    b = rng.uniform(1.0, 2.0, (8, 8)).astype(np.float32) * rng.choice([-1.0, 1.0], (8, 8)).astype(np.float32)
    module = cupy.RawModule(code=SOURCE, options=("-arch=sm_90a", "-std=c++17"))
    kernel = module.get_function("tf32_wgmma")
    d = cupy.full((64, 8), np.nan, dtype=cupy.float32)
    kernel((1,), (128,), (cupy.asarray(a), cupy.asarray(b), d))
    got = cupy.asnumpy(d).astype(np.float64)
    refs = {
        "operands truncated to tf32": truncate_tf32(a).astype(np.float64) @ truncate_tf32(b).astype(np.float64).T,
        "operands rounded to nearest tf32": round_tf32(a).astype(np.float64) @ round_tf32(b).astype(np.float64).T,
        "operands exact (float32)": a.astype(np.float64) @ b.astype(np.float64).T,
    }
    print(f"{cupy.cuda.runtime.getDeviceProperties(0)['name'].decode()}: wgmma m64n8k8 tf32, A 64x8, B 8x8")
    errors = {}
    for name, ref in refs.items():
        errors[name] = float(np.abs(got - ref).max() / np.abs(ref).max())
        print(f"  max error against {name:34} {errors[name]:.3e}")
    best = min(errors, key=errors.get)
    print(f"closest: {best}")
    return 0 if np.isfinite(got).all() else 1


if __name__ == "__main__":
    sys.exit(main())
