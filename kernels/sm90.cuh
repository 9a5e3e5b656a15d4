// sm90.cuh: what the kernels on Hopper's warpgroup tensor cores (wgmma, sm_90a)
// share beside kernels/wgmma.cuh's instructions: the 128-byte-swizzled
// shared-memory tiles they read, their matrix descriptors, the fences around
// asynchronous products, mbarriers, bulk tensor copies (TMA) and the register
// budget of warpgroup roles (kernels/hopper.cu, the forward; the 16-bit
// Hopper kernels of kernels/backward.cu). Tiles are slabs of 64 columns of
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

// ---- mbarriers (shared memory, CTA scope) --------------------------------------
__device__ __forceinline__ void mbar_init(unsigned bar, unsigned count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive(unsigned bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
// Wait until the phase of the given parity has completed.
__device__ __forceinline__ void mbar_wait(unsigned bar, unsigned parity) {
    unsigned done;
    do {
        asm volatile(
            "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
            : "=r"(done) : "r"(bar), "r"(parity) : "memory");
    } while (!done);
}

__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;\n" ::: "memory"); }
// One of the mbarrier's counted arrivals (.noinc: counted in its init), made once
// every cp.async this thread has issued so far has landed (the thread goes on at once).
__device__ __forceinline__ void cp_async_mbar_arrive(unsigned bar) {
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}

// ---- bulk tensor copies (TMA) ----------------------------------------------------
// A tensor map (the driver's CUtensorMap, 128 bytes) is encoded on the host
// (cupy_gqa/_tma.py) and passed as a __grid_constant__ kernel parameter.
struct alignas(64) TensorMap { unsigned long long words[16]; };

// The next phase of the mbarrier also waits for `bytes` bytes of bulk copies;
// this is one of its counted arrivals.
__device__ __forceinline__ void mbar_expect_tx(unsigned bar, unsigned bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
// The box of `map` at coordinates (c0, c1, c2, c3), innermost first, to shared
// memory at dst (laid out by the map's swizzle); its bytes count on mbarrier bar.
__device__ __forceinline__ void tma_load_4d(unsigned dst, const TensorMap& map, unsigned bar, int c0, int c1, int c2, int c3) {
    asm volatile(
        "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5}], [%6];\n"
        ::"r"(dst), "l"(reinterpret_cast<unsigned long long>(&map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(bar)
        : "memory");
}

// The box of shared memory at src (laid out by the map's swizzle) to `map` at
// coordinates (c0, c1, c2, c3); the copy engine drops what falls outside the
// tensor. The caller commits the copies as a bulk group (bulk_commit) and waits
// until they have read src (bulk_wait_read) before src is written again.
__device__ __forceinline__ void tma_store_4d(const TensorMap& map, unsigned src, int c0, int c1, int c2, int c3) {
    asm volatile(
        "cp.async.bulk.tensor.4d.global.shared::cta.tile.bulk_group [%0, {%2, %3, %4, %5}], [%1];\n"
        ::"l"(reinterpret_cast<unsigned long long>(&map)), "r"(src), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
        : "memory");
}
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
__device__ __forceinline__ void bulk_wait_read() { asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory"); }

// Register budget per warpgroup role (needs a register cap at entry: __launch_bounds__(.., 1)).
template <int N> __device__ __forceinline__ void regs_dec() { asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N)); }
template <int N> __device__ __forceinline__ void regs_inc() { asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N)); }

}  // namespace sm90
