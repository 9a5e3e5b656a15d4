#!/usr/bin/env python3
"""How fast the GPU reads a decode call's K and V in the order the decode kernel
reads them, against other orders of the same bytes: no attention, only loads.

    python3 benchmarks/dev/decode_read_pattern.py [--cases D1,D2] [--u 2,4,8] [--reps 20]
                                                  [--tma 16x4,16x8,32x4,32x8,64x2,64x4,128x2,128x3]
                                                  [--flush dirty,clean] [--policies none,evict_first]

K and V are (batch, seqlen_k, num_kv_heads, head_dim) bf16, as D1 and D2 of
bench_attention.py. Each pattern copies both arrays once, whole, into shared
memory by 16-byte cp.async (as the decode kernel does), 128 threads a CTA, U
chunks of K and U of V a thread per group and two groups in flight (--u: 2, 4
and 8, 16 to 64 KB a CTA):
  head    one CTA per (batch, KV head), as decode's unsplit launch: each key
          row is head_dim * 2 bytes at a stride of num_kv_heads * head_dim * 2
          (D1: 256 B every 2 KB, the eight heads of a batch row read by eight
          CTAs side by side)
  row     one CTA per (batch, key range): the same number of CTAs, each key's
          whole row of every head (2 KB contiguous), the keys split in
          num_kv_heads ranges
  rowN    as row, each batch row cut in more key ranges so that the grid (N
          CTAs) is a multiple of the SMs: every SM the same number
  flat    the arrays as one contiguous stream, two CTAs per SM (the ceiling of
          this copy loop)
and, with --tma (TxS: T keys a copy, S stages in flight), the head order by bulk
tensor copies (TMA) on mbarriers, as kernels/hopper.cu loads its key tiles: one
thread of each (batch, KV head) CTA issues, per tile of T keys, the boxes of 64
head-dim columns by T keys of K and of V (the tensor maps of cupy_gqa/_tma.py)
onto the stage's mbarrier, S tiles in flight (tma TxS: 512 T S bytes a CTA at
head dim 128). Whether the copy engine streams faster than 16-byte cp.async is
the question behind a decode kernel on bulk copies (benchmarks/NOTES_decode.md).
GPU time by CUDA events, a 256 MB buffer zeroed before each repetition (no K
or V in L2), the median of REPS; GB/s over the bytes of K and V. --flush clean reads
that buffer instead, so L2 holds clean lines: the difference is what writing back
the zeroed buffer's dirty lines costs the reads. --policies gives the bulk tensor
and one-dimensional bulk copies an L2 policy (evict_first: the call's lines go first, the
dirty ones stay). If `row`
reads faster than `head` by more than the 2 % that D1 and D2 trail cuDNN by,
the order of the heads' reads is worth a kernel (benchmarks/NOTES_decode.md).
"""
import argparse
import pathlib
import statistics

import cupy
import numpy as np

from cupy_gqa import _tma

KERNELS = pathlib.Path(__file__).resolve().parents[2] / "kernels"

FLUSH = cupy.empty(256 * 2**20 // 4, dtype=cupy.int32)
CASES = {"D1": (16, 8192, 8, 128), "D2": (64, 2048, 8, 128), "D05": (16, 8192, 1, 128)}
THREADS = 128

SRC = r"""
// Each thread copies chunks of 16 bytes into shared memory by cp.async (as decode
// does): chunks t, t + THREADS, .. of its CTA's list, U of K and U of V a group, two
// groups in flight (the next issued before the last is waited for).
__device__ __forceinline__ void cp16(unsigned dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src));
}
__device__ __forceinline__ void commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> __device__ __forceinline__ void wait_group() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

// chunk i of the CTA's list -> its offset in k (and v): `Offset` maps it
template <class Offset>
__device__ __forceinline__ unsigned stream(const uint4* kb, const uint4* vb, long long c0, long long c1, Offset offset) {
  extern __shared__ uint4 sbuf[];  // [2 stages][2 U][THREADS]
  int stage = 0;
  for (long long i0 = c0 + threadIdx.x; i0 < c1; i0 += (long long)THREADS * U) {
    uint4* st = sbuf + stage * 2 * U * THREADS;
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const long long i = i0 + (long long)u * THREADS;
      if (i < c1) {
        const long long off = offset(i);
        cp16((unsigned)__cvta_generic_to_shared(st + u * THREADS + threadIdx.x), kb + off);
        cp16((unsigned)__cvta_generic_to_shared(st + (U + u) * THREADS + threadIdx.x), vb + off);
      }
    }
    commit();
    wait_group<1>();  // the group before this one has landed
    stage ^= 1;
  }
  wait_group<0>();
  __syncthreads();
  const uint4 r = sbuf[threadIdx.x];  // one chunk read back (the copies are not dead)
  return r.x ^ r.w;
}

// one CTA per (b, h): `rows` rows of `row_chunks` chunks, heads * row_chunks chunks apart
extern "C" __global__ void __launch_bounds__(THREADS) head(const uint4* k, const uint4* v, unsigned* out,
                                                           int heads, int rows, int row_chunks) {
  const int b = blockIdx.x / heads, h = blockIdx.x % heads;
  const long long stride = (long long)heads * row_chunks;
  const long long base = (long long)b * rows * stride + (long long)h * row_chunks;
  out[blockIdx.x * THREADS + threadIdx.x] = stream(k + base, v + base, 0, (long long)rows * row_chunks,
      [=](long long i) { return (i / row_chunks) * stride + i % row_chunks; });
}

// one CTA per (b, key range): the contiguous chunks of batch row b (every head) in
// `ranges` equal ranges
extern "C" __global__ void __launch_bounds__(THREADS) row(const uint4* k, const uint4* v, unsigned* out,
                                                          int ranges, long long row_chunks_all) {
  const int b = blockIdx.x / ranges, r = blockIdx.x % ranges;
  const long long per = (row_chunks_all + ranges - 1) / ranges;
  const long long c0 = (long long)r * per, c1 = min(c0 + per, row_chunks_all);
  const long long base = (long long)b * row_chunks_all;
  out[blockIdx.x * THREADS + threadIdx.x] = stream(k + base, v + base, c0, c1, [](long long i) { return i; });
}
"""


# The head order by bulk tensor copies (TMA): thread 0 of the CTA of (b, h) issues the
# boxes of K's and V's key tile i (64 columns by T keys, every 64-column slab) onto
# stage i % S's mbarrier, after waiting for that stage's last tile; the other threads
# wait at the end. The maps live in global memory (generic addresses; written before
# the launch).
TMA_SRC = r"""
#include "sm90.cuh"
using namespace sm90;
// with POLICY (a 64-bit L2 cache policy), the same copies carry it (`.L2::cache_hint`)
__device__ __forceinline__ void load_box(unsigned dst, const TensorMap& map, unsigned bar, int c0, int c1, int c2, int c3) {
#ifdef POLICY
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.L2::cache_hint"
      " [%0], [%1, {%2, %3, %4, %5}], [%6], %7;\n"
      ::"r"(dst), "l"(reinterpret_cast<unsigned long long>(&map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(bar),
        "l"((unsigned long long)POLICY) : "memory");
#else
  tma_load_4d(dst, map, bar, c0, c1, c2, c3);
#endif
}
extern "C" __global__ void __launch_bounds__(THREADS) tma_head(const TensorMap* kmap, const TensorMap* vmap,
                                                               unsigned* out, int heads, int rows) {
  extern __shared__ __align__(1024) unsigned char sbuf[];  // [S stages][K, V][SLABS][T rows][128 bytes]
  __shared__ __align__(8) unsigned long long bars[S];
  constexpr unsigned SLAB = T * 128, STAGE = 2 * SLABS * SLAB;
  const int b = blockIdx.x / heads, h = blockIdx.x % heads;
  const unsigned base = (unsigned)__cvta_generic_to_shared(sbuf);
  const unsigned bar0 = (unsigned)__cvta_generic_to_shared(bars);
  const int tiles = (rows + T - 1) / T;
  if (threadIdx.x == 0) {
    for (int s = 0; s < S; ++s) mbar_init(bar0 + 8 * s, 1);
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    for (int i = 0; i < tiles; ++i) {
      const int s = i % S;
      if (i >= S) mbar_wait(bar0 + 8 * s, (i / S - 1) & 1);
      mbar_expect_tx(bar0 + 8 * s, STAGE);
      for (int sl = 0; sl < SLABS; ++sl) {
        load_box(base + s * STAGE + sl * SLAB, *kmap, bar0 + 8 * s, sl * 64, i * T, h, b);
        load_box(base + s * STAGE + (SLABS + sl) * SLAB, *vmap, bar0 + 8 * s, sl * 64, i * T, h, b);
      }
    }
    for (int i = tiles > S ? tiles - S : 0; i < tiles; ++i) mbar_wait(bar0 + 8 * (i % S), (i / S) & 1);
  }
  __syncthreads();
  const uint4 r = reinterpret_cast<const uint4*>(sbuf)[threadIdx.x];  // read back (the copies are not dead)
  out[blockIdx.x * THREADS + threadIdx.x] = r.x ^ r.w;
}

// The same order by one-dimensional bulk copies (no tensor map): lane i < T of warp 0 copies
// key row i of the tile, K's and V's (SLABS * 128 bytes each, rows padded by 16 bytes in
// shared memory, as a decode tile without the swizzle would lie), onto the stage's mbarrier.
#if T <= 32
__device__ __forceinline__ void bulk_row(unsigned dst, const void* src, unsigned bytes, unsigned bar) {
#ifdef POLICY
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], %2, [%3], %4;\n"
               ::"r"(dst), "l"(src), "r"(bytes), "r"(bar), "l"((unsigned long long)POLICY) : "memory");
#else
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n"
               ::"r"(dst), "l"(src), "r"(bytes), "r"(bar) : "memory");
#endif
}
extern "C" __global__ void __launch_bounds__(THREADS) bulk_head(const unsigned char* k, const unsigned char* v,
                                                                unsigned* out, int heads, int rows) {
  extern __shared__ __align__(1024) unsigned char sbuf[];  // [S stages][K, V][T rows][ROW + 16 bytes]
  __shared__ __align__(8) unsigned long long bars[S];
  constexpr unsigned ROW = SLABS * 128, PITCH = ROW + 16, STAGE = 2 * T * PITCH;
  const int b = blockIdx.x / heads, h = blockIdx.x % heads, lane = threadIdx.x;
  const unsigned base = (unsigned)__cvta_generic_to_shared(sbuf);
  const unsigned bar0 = (unsigned)__cvta_generic_to_shared(bars);
  const long long key_stride = (long long)heads * ROW;
  const unsigned char* kh = k + ((long long)b * rows * heads + h) * ROW;
  const unsigned char* vh = v + ((long long)b * rows * heads + h) * ROW;
  const int tiles = (rows + T - 1) / T;
  if (threadIdx.x < 32) {
    if (lane == 0) {
      for (int s = 0; s < S; ++s) mbar_init(bar0 + 8 * s, 1);
      asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncwarp();
    for (int i = 0; i < tiles; ++i) {
      const int s = i % S, n = min(T, rows - i * T);
      if (i >= S) mbar_wait(bar0 + 8 * s, (i / S - 1) & 1);
      if (lane == 0) mbar_expect_tx(bar0 + 8 * s, 2 * n * ROW);
      __syncwarp();
      if (lane < n) {
        const long long off = (long long)(i * T + lane) * key_stride;
        bulk_row(base + s * STAGE + lane * PITCH, kh + off, ROW, bar0 + 8 * s);
        bulk_row(base + s * STAGE + (T + lane) * PITCH, vh + off, ROW, bar0 + 8 * s);
      }
    }
    for (int i = tiles > S ? tiles - S : 0; i < tiles; ++i) mbar_wait(bar0 + 8 * (i % S), (i / S) & 1);
  }
  __syncthreads();
  const uint4 r = reinterpret_cast<const uint4*>(sbuf)[threadIdx.x];
  out[blockIdx.x * THREADS + threadIdx.x] = r.x ^ r.w;
}
#endif
"""


# L2 policies for --policies: the one `createpolicy.fractional.L2::evict_first.b64 p, 1.0`
# makes (CUTLASS's EVICT_FIRST hint) and evict_normal
POLICIES = {"none": None, "evict_first": 0x12F0000000000000, "evict_normal": 0x1000000000000000}


def tma_module(t: int, stages: int, slabs: int, policy: int | None = None):
    hint = "" if policy is None else f"#define POLICY {policy:#x}ull\n"
    return cupy.RawModule(
        code=f"#define THREADS {THREADS}\n#define T {t}\n#define S {stages}\n#define SLABS {slabs}\n{hint}" + TMA_SRC,
        options=("-std=c++17", f"-I{KERNELS}"),
    )


def tma_map(ptr: int, shape: tuple, t: int) -> cupy.ndarray:
    """The tensor map of a (batch, seqlen, heads, head_dim) 16-bit array at ptr, in device memory."""
    batch, seqlen, heads, d = shape
    strides = (seqlen * heads * d * 2, heads * d * 2, d * 2, 2)
    return cupy.asarray(np.frombuffer(_tma.tile_map(ptr, shape, strides, 2, t), dtype=np.uint8))


def module(u: int):
    return cupy.RawModule(code=f"#define THREADS {THREADS}\n#define U {u}\n" + SRC, options=("-std=c++17",))


def smem_bytes(u: int) -> int:
    return 2 * 2 * u * THREADS * 16


def flush_dirty():
    FLUSH.fill(0)  # as the benchmark's timer: L2 left full of dirty lines


def flush_clean():
    FLUSH.max()  # L2 left full of clean lines: nothing to write back when the call's reads evict them


FLUSHES = {"dirty": flush_dirty, "clean": flush_clean}


def time_call(fn, reps: int, flush) -> float:
    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    times = []
    for _ in range(reps):
        flush()
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, end) * 1e3)
    return statistics.median(times)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default="D1,D2")
    parser.add_argument("--u", default="2,4,8", help="chunks of K (and of V) a thread copies per group")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tma", default="16x4,16x8,32x4,32x8,64x2,64x4,128x2,128x3",
                        help="bulk tensor copies in the head order: T keys a copy x S stages ('' for none)")
    parser.add_argument("--flush", default="dirty", help="what L2 holds before each repetition: dirty (the "
                        "benchmark's zeroed buffer), clean (the same buffer read), or both, comma-separated")
    parser.add_argument("--policies", default="none", help="the bulk tensor copies' L2 policies: none, "
                        "evict_first, evict_normal, comma-separated")
    args = parser.parse_args()
    for flush in args.flush.split(","):
        print(f"== L2 before each repetition: {flush} lines of a 256 MB buffer")
        measure(args, FLUSHES[flush])


def measure(args, flush):
    dev = cupy.cuda.Device()
    sms = dev.attributes["MultiProcessorCount"]
    print(cupy.cuda.runtime.getDeviceProperties(dev.id)["name"].decode(), f"{sms} SMs, {THREADS} threads a CTA")
    for name in args.cases.split(","):
        batch, seqlen, heads, d = CASES[name]
        k = cupy.random.randint(0, 2**31 - 1, size=batch * seqlen * heads * d // 2, dtype=np.int64).astype(np.int32)
        v = cupy.random.randint(0, 2**31 - 1, size=k.size, dtype=np.int64).astype(np.int32)
        nbytes = 2 * k.nbytes
        row_chunks = d * 2 // 16  # 16-byte chunks of one head's key row
        row_all = seqlen * heads * row_chunks  # chunks of one batch row, every head
        ranges_even = -(-sms // batch)  # key ranges per batch row so that the grid is a multiple of the SMs
        while (batch * ranges_even) % sms and ranges_even < 64:
            ranges_even += 1
        out = cupy.empty(max(batch * heads, batch * ranges_even, 2 * sms) * THREADS, dtype=cupy.uint32)
        print(f"{name}: B{batch} S{seqlen} Hkv{heads} D{d}, K and V {nbytes / 1e6:.0f} MB")
        for u in (int(x) for x in args.u.split(",")):
            mod = module(u)
            k_head, k_row = mod.get_function("head"), mod.get_function("row")
            smem = smem_bytes(u)
            for f in (k_head, k_row):
                f.max_dynamic_shared_size_bytes = smem
            launch = lambda f, grid, *a: f((grid,), (THREADS,), (k, v, out, *a), shared_mem=smem)  # noqa: E731
            patterns = {
                "head": lambda: launch(k_head, batch * heads, np.int32(heads), np.int32(seqlen), np.int32(row_chunks)),
                "row": lambda: launch(k_row, batch * heads, np.int32(heads), np.int64(row_all)),
                f"row{batch * ranges_even}": lambda: launch(k_row, batch * ranges_even, np.int32(ranges_even), np.int64(row_all)),
                "flat": lambda: launch(k_row, 2 * sms, np.int32(2 * sms), np.int64(row_all * batch)),
            }
            best = {p: float("inf") for p in patterns}
            order = list(patterns)
            for r in range(args.rounds):
                for p in order if r % 2 == 0 else order[::-1]:
                    patterns[p]()  # warm-up
                    best[p] = min(best[p], time_call(patterns[p], args.reps, flush))
            print(f"  U {u} ({smem // 1024} KB a CTA in flight at most)")
            for p in patterns:
                print(f"    {p:8s} {best[p]:9.2f} us  {nbytes / best[p] / 1e3:8.1f} GB/s  {best['head'] / best[p]:6.3f} x head's speed")
        head_us = best["head"]  # (the last U's)
        for ts in filter(None, args.tma.split(",")):
            t, stages = (int(x) for x in ts.split("x"))
            slabs = d // 64
            maps = (tma_map(k.data.ptr, (batch, seqlen, heads, d), t), tma_map(v.data.ptr, (batch, seqlen, heads, d), t))
            runs = []
            for policy in args.policies.split(","):
                mod = tma_module(t, stages, slabs, POLICIES[policy])
                hint = "" if policy == "none" else f" {policy}"
                runs.append((mod, "tma" + hint, "tma_head", stages * 2 * slabs * t * 128, maps))
                if t <= 32:  # the same by one-dimensional bulk copies, a lane per key row
                    runs.append((mod, "bulk rows" + hint, "bulk_head", stages * 2 * t * (slabs * 128 + 16), (k, v)))
            for mod, label, name, smem, sources in runs:
                f = mod.get_function(name)
                f.max_dynamic_shared_size_bytes = smem
                run = lambda: f((batch * heads,), (THREADS,), (*sources, out, np.int32(heads), np.int32(seqlen)), shared_mem=smem)  # noqa: E731, B023
                us = float("inf")
                for _ in range(args.rounds):
                    run()
                    us = min(us, time_call(run, args.reps, flush))
                print(f"  {label} {t}x{stages} ({smem // 1024} KB a CTA in flight)")
                print(f"    {'head':8s} {us:9.2f} us  {nbytes / us / 1e3:8.1f} GB/s  {head_us / us:6.3f} x cp.async head's speed (last U)")


if __name__ == "__main__":
    main()
