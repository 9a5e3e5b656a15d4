#!/usr/bin/env python3
"""The rate of TF32 wgmma with both operands in shared memory (sm_90), against
bf16 wgmma on the same bytes: what a split-TF32 Hopper kernel for float32 can
lean on (benchmarks/NOTES_hopper.md: fp32 on wgmma).

Every SM runs one CTA of WGS warpgroups; each warpgroup issues m64nNk8 TF32
(or m64nNk16 bf16) products in a loop, KSTEPS of them per commit group, one
group in flight behind the one it waits for, A (its own 64 rows) and B
(shared by the warpgroups) read from shared memory without swizzle (K-major
core matrices of 8 rows x 16 bytes, 128 bytes apart along K). No data moves
in from memory: the loop measures the tensor pipe fed from shared memory
alone. TFLOP/s counts 2 * 64 * N * K per product.

    python3 benchmarks/dev/tf32_wgmma_rate.py [--iters 4000]
    python3 benchmarks/dev/tf32_wgmma_rate.py --compile-only    # NVRTC, no GPU
"""
import argparse
import sys

KSTEPS = 4  # products per commit group (k-steps of one 32-byte slab column each)

TEMPLATE = r"""
extern "C" __global__ void __launch_bounds__(WGS * 128, 1) rate(float* sink, int iters) {
    // A: 64 rows per warpgroup, B: N rows (shared); KSTEPS k-steps of 32 bytes a row each
    // (TF32 k8 or bf16 k16), stored as two core matrices of 16 bytes side by side
    __shared__ __align__(128) unsigned char sa[WGS * 64 * 32 * KSTEPS];
    __shared__ __align__(128) unsigned char sb[N * 32 * KSTEPS];
    const int t = threadIdx.x, wg = t / 128;
    for (int i = t; i < (int)sizeof(sa) / 4; i += blockDim.x) reinterpret_cast<float*>(sa)[i] = 1.0f / (1 + i % 7);
    for (int i = t; i < (int)sizeof(sb) / 4; i += blockDim.x) reinterpret_cast<float*>(sb)[i] = 1.0f / (1 + i % 5);
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    __syncthreads();
    auto desc = [](unsigned addr, unsigned lbo, unsigned sbo) {
        return (unsigned long long)((addr >> 4) & 0x3FFF) | ((unsigned long long)((lbo >> 4) & 0x3FFF) << 16) |
               ((unsigned long long)((sbo >> 4) & 0x3FFF) << 32);
    };
    // a k-step's operand: rows of 32 bytes as 2 core matrices (8 rows x 16 bytes) side by side along K
    // (LBO 128), row blocks of 8 rows 256 bytes apart (SBO); k-step s at s * (rows * 32) bytes
    const unsigned a0 = (unsigned)__cvta_generic_to_shared(sa) + wg * 64 * 32 * KSTEPS;
    const unsigned b0 = (unsigned)__cvta_generic_to_shared(sb);
    float d[N / 2];
#pragma unroll
    for (int i = 0; i < N / 2; ++i) d[i] = 0.f;
    for (int it = 0; it < iters; ++it) {
        asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
        for (int s = 0; s < KSTEPS; ++s) {
            const unsigned long long da = desc(a0 + s * 64 * 32, 128, 256), db = desc(b0 + s * N * 32, 128, 256);
            WGMMA
        }
        asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
        asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory");
    }
    asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
    float acc = 0.f;
#pragma unroll
    for (int i = 0; i < N / 2; ++i) acc += d[i];
    if (acc == 12345.f) sink[t] = acc;  // keeps the products alive
}
"""


def source(kind: str, n: int, wgs: int) -> str:
    regs = ", ".join(f"%{i}" for i in range(n // 2))
    outs = ", ".join(f'"+f"(d[{i}])' for i in range(n // 2))
    # scale-d is a predicate (accumulate: set from the constant operand 1)
    if kind == "tf32":
        instr = f"wgmma.mma_async.sync.aligned.m64n{n}k8.f32.tf32.tf32 {{{regs}}}, %{n // 2}, %{n // 2 + 1}, p, 1, 1;"
    else:  # bf16 on the same 32 bytes a row: one k16 step
        instr = f"wgmma.mma_async.sync.aligned.m64n{n}k16.f32.bf16.bf16 {{{regs}}}, %{n // 2}, %{n // 2 + 1}, p, 1, 1, 0, 0;"
    asm = f"{{\\n.reg .pred p;\\nsetp.ne.b32 p, %{n // 2 + 2}, 0;\\n{instr}\\n}}\\n"
    wgmma = f'asm volatile("{asm}" : {outs} : "l"(da), "l"(db), "r"(1));'
    return (TEMPLATE.replace("WGMMA", wgmma).replace("KSTEPS", str(KSTEPS)).replace("WGS", str(wgs))
            .replace("N / 2", str(n // 2)).replace("N * 32", str(n * 32)))


CONFIGS = [("tf32", 64, 1), ("tf32", 64, 2), ("tf32", 128, 1), ("tf32", 128, 2), ("tf32", 256, 1), ("tf32", 256, 2),
           ("bf16", 128, 2), ("bf16", 256, 2)]


def compile_only() -> int:
    from cupy.cuda import nvrtc

    failed = 0
    for kind, n, wgs in CONFIGS:
        prog = nvrtc.createProgram(source(kind, n, wgs), "rate.cu", [], [])
        try:
            nvrtc.compileProgram(prog, ["--gpu-architecture=sm_90a", "-std=c++17", "-Xptxas", "-v"])
            log = nvrtc.getProgramLog(prog)
            print(f"{kind} n{n} x{wgs}: ok {' '.join(line.strip() for line in log.splitlines() if 'registers' in line)}")
        except nvrtc.NVRTCError:
            failed += 1
            print(f"{kind} n{n} x{wgs}: FAILED\n{nvrtc.getProgramLog(prog)}")
        finally:
            nvrtc.destroyProgram(prog)
    return 1 if failed else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iters", type=int, default=4000)
    ap.add_argument("--compile-only", action="store_true")
    args = ap.parse_args()
    if args.compile_only:
        return compile_only()
    import cupy

    dev = cupy.cuda.Device()
    sms = dev.attributes["MultiProcessorCount"]
    name = cupy.cuda.runtime.getDeviceProperties(dev.id)["name"].decode()
    print(f"{name}, {sms} SMs, one CTA each; {KSTEPS} products per commit group, {args.iters} groups per warpgroup")
    sink = cupy.zeros(1024, dtype=cupy.float32)
    for kind, n, wgs in CONFIGS:
        kernel = cupy.RawModule(code=source(kind, n, wgs), options=("-arch=sm_90a", "-std=c++17")).get_function("rate")
        kernel((sms,), (wgs * 128,), (sink, cupy.int32(10)))  # load and warm up
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        best = float("inf")
        for _ in range(5):
            start.record()
            kernel((sms,), (wgs * 128,), (sink, cupy.int32(args.iters)))
            end.record()
            end.synchronize()
            best = min(best, cupy.cuda.get_elapsed_time(start, end) * 1e-3)
        k = 8 if kind == "tf32" else 16
        flops = 2 * 64 * n * k * KSTEPS * args.iters * wgs * sms
        operand_bytes_per_s = (64 + n) * 32 * KSTEPS * args.iters * wgs * sms / best  # A and B read by the products
        print(f"  {kind} m64n{n}k{k}, {wgs} warpgroup(s): {flops / best / 1e12:7.1f} TFLOP/s, "
              f"operands {operand_bytes_per_s / 1e12:6.2f} TB/s from shared memory over the GPU")
    return 0


if __name__ == "__main__":
    sys.exit(main())
