// sm90.cuh: what the kernels on Hopper's warpgroup tensor cores (wgmma, sm_90a)
// share beside kernels/wgmma.cuh's instructions: the 128-byte-swizzled
// shared-memory tiles they read, their matrix descriptors, and the fences
// around asynchronous products (kernels/hopper.cu, the forward; the 16-bit
// dK/dV kernel of kernels/backward.cu). Tiles are slabs of 64 columns of
// 16-bit elements: row r of a slab is 128 bytes, its 16-byte chunk c at
// swizzle128(r, c); a slab of R rows is R * 128 bytes, from a 1024-byte
// aligned base.
#pragma once

namespace sm90 {

// Byte offset of 16-byte chunk c (0..7) of row r inside a 128-byte-swizzled slab.
__device__ __forceinline__ unsigned swizzle128(int r, int c) {
    return (unsigned)(r * 128 + ((c ^ (r & 7)) << 4));
}

// wgmma shared-memory matrix descriptor: start address, leading and stride
// byte offsets (each >> 4), layout type 1 = 128-byte swizzle.
//   K-major (Q, K):  stride = 1024 (8 rows of 128 bytes), leading unused (1).
//   N-major (V):     stride = 1024 (8 key rows), leading = bytes between slabs
//                    (the next 64 columns of N).
__device__ __forceinline__ unsigned long long make_smem_desc(unsigned addr, unsigned leading, unsigned stride) {
    return (unsigned long long)((addr & 0x3FFFFu) >> 4) | ((unsigned long long)(leading >> 4) << 16) |
           ((unsigned long long)(stride >> 4) << 32) | (1ull << 62);
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory"); }

// Pin accumulator registers at this point of the program: the compiler must
// not move their reads above a wgmma_wait nor their writes below a wgmma.
template <int N>
__device__ __forceinline__ void fence_regs(float (&d)[N]) {
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// An accumulator held as m16n8 fragments [n8 tiles][4], as the flat register
// list wgmma takes (wgmma.cuh: the same order).
template <int N8>
__device__ __forceinline__ float (&flat(float (&frag)[N8][4]))[4 * N8] {
    return reinterpret_cast<float(&)[4 * N8]>(frag);
}

// Shared memory written through the generic proxy (cp.async, st.shared) by this
// thread is ordered before later async-proxy reads (wgmma): this thread's, or
// another's that acquires what this thread releases after the fence.
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// The descriptor step of k16 step kd of a K-major operand whose 64-column slabs
// are slab_bytes apart: four steps of 32 bytes within a slab, then the next slab.
__device__ __forceinline__ unsigned long long kstep(int kd, int slab_bytes) {
    return (unsigned long long)(((kd / 4) * slab_bytes + (kd % 4) * 32) >> 4);
}

}  // namespace sm90
