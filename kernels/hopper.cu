/*
 * hopper.cu -- prefill on Hopper's warpgroup tensor cores (wgmma, sm_90a),
 * fp16 and bf16, causal or not, compiled at runtime by NVRTC.
 *
 * Algorithm
 * -----------------------------------------------------------------------------
 * The FlashAttention-2 algorithm of tiled.cu with its matrix products moved
 * from per-warp mma.sync to per-warpgroup wgmma.mma_async:
 *
 *   load Q tile (BLOCK_M packed rows x HEAD_DIM_PAD) to shared memory
 *   for each K/V tile j (BLOCK_N keys) that some row of the CTA can see:
 *       K_j, V_j arrive in shared memory (cp.async, two stages: tile j+1 is
 *       in flight while tile j is computed)
 *       S  = Q K_j^T          wgmma, A = Q and B = K_j both from shared memory
 *       S *= scale log2 e; mask S (only tiles crossing the diagonal or the
 *       end of the keys)
 *       m' = max(m, rowmax S); P = exp2(S - m'); l = l exp2(m - m') + rowsum P
 *       O  = O exp2(m - m') + P V_j   wgmma, A = P from registers (fp32 -> T),
 *                                     B = V_j from shared memory
 *   out = O / l;  lse = (m + log2 l) ln 2   (a row that sees no key: out 0,
 *                                            lse -inf)
 * The running max is raised lazily: O and l are rescaled only when some row
 * of the warp sees a score more than 2^8 above its reference.
 *
 * GQA packing (as in tiled.cu): the group = num_q_heads / num_kv_heads query
 * heads of one KV head form one row space, packed row r = t * group + g
 * (query position t, query head kv_head * group + g), so each K/V tile in
 * shared memory serves all heads of the group.
 *
 * Grid and roles.  1-D grid of num_m_tiles * batch * num_kv_heads CTAs, mapped
 * by tile_of_block (common.cuh: causal tiles heaviest first). A CTA is
 * BLOCK_M / 64 warpgroups of 128 threads; warpgroup w owns packed rows
 * [64 w, 64 w + 64) of the tile and runs both matrix products for them.
 * Every thread takes part in the loads.
 *
 * Head dims.  Any head_dim that is a multiple of 8 up to HEAD_DIM_PAD runs;
 * the columns past head_dim are zero in shared memory (Q and K: they add
 * nothing to S; V: the extra output columns are never stored).
 *
 * Shared memory (dynamic, aligned to 1024 bytes).  Every tile is stored as
 * HEAD_DIM_PAD / 64 "slabs" of 64 columns; in a slab, row r is 128 bytes and
 * its 16-byte chunk c sits at r * 128 + ((c ^ (r % 8)) * 16) -- the 128-byte
 * swizzle that wgmma reads without bank conflicts (descriptor layout type 1):
 *   [ Q: BLOCK_M rows | K stage 0 | K stage 1 | V stage 0 | V stage 1 ]
 *   bytes = (BLOCK_M + 4 BLOCK_N) * HEAD_DIM_PAD * 2 (+ 1024 for alignment)
 * K is read K-major (contiguous along head_dim, the reduction of Q K^T); V is
 * read by the same layout as the N-major B operand of P V (trans-b).
 * The output tile is staged through the Q tile's space, in the same layout.
 *
 * Requirements (checked by cupy_gqa/_plan.py): sm_90, head_dim % 8 == 0,
 * head_dim stride 1, 16-byte aligned pointers and strides, scale_log2 > 0.
 */
#include "common.cuh"
#include "wgmma.cuh"

namespace hopper_detail {

constexpr float RESCALE_THRESHOLD = 8.f;  // log2 units: P <= 2^8 between rescales

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

// Shared memory written through the generic proxy (cp.async, st.shared) is
// ordered before this thread's later wgmma reads (async proxy) by this fence.
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

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

// The mbarrier receives one arrival when all of this thread's earlier cp.async
// copies have landed (.noinc: the arrival is one of the counted ones).
__device__ __forceinline__ void cp_async_arrive(unsigned bar) {
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;\n" ::: "memory"); }

// Register budget per warpgroup role (needs a register cap at entry: __launch_bounds__(.., 1)).
template <int N> __device__ __forceinline__ void regs_dec() { asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N)); }
template <int N> __device__ __forceinline__ void regs_inc() { asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N)); }

// Named barrier for the 128 threads of one warpgroup (ids 1.., 0 is __syncthreads).
__device__ __forceinline__ void warpgroup_sync(int id) { asm volatile("bar.sync %0, 128;\n" ::"r"(id) : "memory"); }

constexpr int PRODUCER_REGS = 56;   // 56 + 2 x 224 = 3 x 168: what the producer frees, the consumers take
constexpr int CONSUMER_REGS = 224;

}  // namespace hopper_detail


// Shared-memory layout, one definition for the kernel and for cupy_gqa/_specs.py
// (hopper_smem), which passes its byte count as SMEM_BYTES: a static_assert
// in the kernel holds the two together.
template <int HEAD_DIM_PAD, int BLOCK_M, int BLOCK_N, int STAGES>
struct HopperSmem {
    static constexpr int SLABS = HEAD_DIM_PAD / 64;
    static constexpr int Q_SLAB = BLOCK_M * 128;   // bytes of one 64-column slab of the Q tile
    static constexpr int KV_SLAB = BLOCK_N * 128;  // ... of a K or V tile
    static constexpr int Q_BYTES = SLABS * Q_SLAB;
    static constexpr int KV_BYTES = SLABS * KV_SLAB;
    static constexpr int STAGE_BYTES = 2 * KV_BYTES;  // K then V
    static constexpr int BARRIERS = 1 + 2 * STAGES;   // q_full, full[STAGES], empty[STAGES]
    // tiles from a 1024-aligned base, then the barriers; + 1024 slack for the alignment
    static constexpr int BYTES = Q_BYTES + STAGES * STAGE_BYTES + 8 * BARRIERS + 1024;
};

template <typename T, int HEAD_DIM_PAD, int BLOCK_M, int BLOCK_N, int STAGES, bool CAUSAL, int SMEM_BYTES>
__global__ void __launch_bounds__(BLOCK_M / 64 * 128 + 128, 1)
hopper_attention(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v, T* __restrict__ out,
                 float* __restrict__ lse, const int* __restrict__ seqlens_k, const AttnParams p) {
    using namespace hopper_detail;
    static_assert(HEAD_DIM_PAD % 64 == 0 && HEAD_DIM_PAD <= 256, "head dims are padded to 64, 128, 192 or 256");
    static_assert(BLOCK_M % 64 == 0 && BLOCK_N % 16 == 0, "wgmma tiles: 64 rows per warpgroup, 16 keys per step");
    using L = HopperSmem<HEAD_DIM_PAD, BLOCK_M, BLOCK_N, STAGES>;
    static_assert(SMEM_BYTES == L::BYTES, "SMEM_BYTES is not the size of the shared-memory layout (HopperSmem)");
    static_assert(STAGES >= 2, "the consumers hold tile j - 1 (P V) while tile j arrives");
    constexpr int CHP = HEAD_DIM_PAD / 8;      // 16-byte chunks per padded row
    constexpr int KD = HEAD_DIM_PAD / 16;      // k-steps of Q K^T
    constexpr int NS = BLOCK_N / 2;            // S accumulators per thread
    constexpr int NO = HEAD_DIM_PAD / 2;       // O accumulators per thread
    constexpr int CONSUMERS = BLOCK_M / 64 * 128;

    const int batch = p.batch, seqlen_q = p.seqlen_q, num_q_heads = p.num_q_heads, num_kv_heads = p.num_kv_heads;

    extern __shared__ unsigned char smem_raw[];
    const unsigned raw = smem_addr(smem_raw);
    const unsigned base = (raw + 1023u) & ~1023u;  // swizzle atoms need 1024-byte alignment
    unsigned char* const smem = smem_raw + (base - raw);
    const unsigned sQ = base;
    const unsigned sKV = sQ + L::Q_BYTES;      // stage s: K at sKV + s * STAGE_BYTES, V KV_BYTES after it
    const unsigned bars = sKV + STAGES * L::STAGE_BYTES;
    const unsigned q_full = bars;              // the Q tile has landed
    auto full = [&](int s) { return bars + 8 * (1 + s); };            // K/V stage s has landed
    auto empty = [&](int s) { return bars + 8 * (1 + STAGES + s); };  // ... and has been consumed

    const int tid = threadIdx.x;
    if (tid == 0) {
        mbar_init(q_full, 128);
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(full(s), 128);           // every producer thread arrives
            mbar_init(empty(s), CONSUMERS);    // every consumer thread arrives
        }
    }
    __syncthreads();

    const int group = num_q_heads / num_kv_heads;
    const int packed_rows = seqlen_q * group;
    const int num_m_tiles = (packed_rows + BLOCK_M - 1) / BLOCK_M;
    const TileOfBlock tile = tile_of_block<CAUSAL>(num_m_tiles, batch, num_kv_heads);
    const int b = tile.b, kvh = tile.kv_head;
    const int row0 = tile.m_tile * BLOCK_M;
    const int len = seqlen_k_of(seqlens_k, b, p.seqlen_k);  // valid keys of this sequence; -1: bad, NaN rows
    const int seqlen_k = max(len, 0);

    // ---- key range: keys [0, n_end) are read, [0, n_free) need no mask -------
    const int diag = seqlen_k - seqlen_q;      // query t sees keys j <= t + diag
    const int last_row = min(row0 + BLOCK_M, packed_rows) - 1;
    int n_end = seqlen_k, n_free = seqlen_k;
    if (CAUSAL) {
        n_end = max(0, min(seqlen_k, last_row / group + diag + 1));
        n_free = max(0, min(seqlen_k, row0 / group + diag + 1));
    }
    const int num_n = (n_end + BLOCK_N - 1) / BLOCK_N;

    if (tid >= CONSUMERS) {
        // =========================== producer warpgroup ===========================
        // 16-byte cp.async chunks into the swizzled slabs: chunk c of a tile of R
        // rows is row c / CHP, column chunk c % CHP; rows past the data and the
        // padding columns are zero-filled. Tile j goes to stage j % STAGES once
        // the consumers have released that stage; each thread's copies of it
        // arrive on full[stage] when they land (cp.async.mbarrier.arrive), so
        // the producer only ever waits for free stages.
        regs_dec<PRODUCER_REGS>();
        const int pt = tid - CONSUMERS;
        const int ch_used = p.head_dim / 8;    // chunks that hold data; the rest are zero
        for (int c = pt; c < BLOCK_M * CHP; c += 128) {
            const int r = c / CHP, ch = c % CHP;
            const int pr = row0 + r;
            const bool ok = pr < packed_rows && ch < ch_used;
            const int t = pr / group, g = pr - (pr / group) * group;
            const T* src = ok ? q + (index_t)b * p.q_stride[0] + (index_t)t * p.q_stride[1] +
                                    (index_t)q_head_of(kvh, g, group) * p.q_stride[2] + ch * 8
                              : q;
            cp_async_16(sQ + (ch / 8) * L::Q_SLAB + swizzle128(r, ch % 8), src, ok);
        }
        cp_async_arrive(q_full);
        const T* const kbase = k + (index_t)b * p.k_stride[0] + (index_t)kvh * p.k_stride[2];
        const T* const vbase = v + (index_t)b * p.v_stride[0] + (index_t)kvh * p.v_stride[2];
        const index_t k_stride_s = p.k_stride[1], v_stride_s = p.v_stride[1];
        for (int j = 0; j < num_n; ++j) {
            const int stage = j % STAGES;
            if (j >= STAGES) mbar_wait(empty(stage), ((j / STAGES) + 1) & 1);  // tile j - STAGES consumed
            const unsigned dK = sKV + stage * L::STAGE_BYTES, dV = dK + L::KV_BYTES;
#pragma unroll 4
            for (int c = pt; c < BLOCK_N * CHP; c += 128) {
                const int r = c / CHP, ch = c % CHP;
                const int key = j * BLOCK_N + r;
                const bool ok = key < seqlen_k && ch < ch_used;
                const unsigned off = (ch / 8) * L::KV_SLAB + swizzle128(r, ch % 8);
                cp_async_16(dK + off, ok ? (const void*)(kbase + (index_t)key * k_stride_s + ch * 8) : (const void*)k, ok);
                cp_async_16(dV + off, ok ? (const void*)(vbase + (index_t)key * v_stride_s + ch * 8) : (const void*)v, ok);
            }
            cp_async_arrive(full(stage));
        }
        cp_async_wait_all();                   // nothing in flight when the warpgroup exits
        return;
    }

    // ============================ consumer warpgroups ============================
    regs_inc<CONSUMER_REGS>();
    const float scale_log2 = (float)p.scale_log2;
    const int wg = tid / 128;                  // rows [64 wg, 64 wg + 64) of the tile
    const int lane = tid & 31;
    const int my_row = wg * 64 + ((tid / 32) & 3) * 16 + (lane >> 2);  // + 8 h, h = 0, 1

    float o[NO];
#pragma unroll
    for (int i = 0; i < NO; ++i) o[i] = 0.f;
    float m_run[2] = {__int_as_float(0xff800000), __int_as_float(0xff800000)};  // running max, log2 domain
    float l_run[2] = {0.f, 0.f};               // per-thread partial row sums
    unsigned pa[BLOCK_N / 16][4];              // P of the previous tile as wgmma A fragments

    const unsigned long long desc_q = make_smem_desc(sQ + wg * 64 * 128, 16, 1024);
    const unsigned long long desc_k0 = make_smem_desc(sKV, 16, 1024);
    const unsigned long long desc_v0 = make_smem_desc(sKV + L::KV_BYTES, L::KV_SLAB, 1024);
    // a k-step of Q K^T moves 32 bytes inside a slab, then to the next slab
    auto kstep = [](int kd, int slab_bytes) { return (unsigned long long)(((kd / 4) * slab_bytes + (kd % 4) * 32) >> 4); };
    auto stage_off = [](int j) { return (unsigned long long)(((j % STAGES) * L::STAGE_BYTES) >> 4); };

    // O += P V_j for the P in pa (asynchronous: committed, not waited for)
    auto issue_pv = [&](int jv) {
        const unsigned long long desc_v = desc_v0 + stage_off(jv);
#pragma unroll
        for (int kk = 0; kk < BLOCK_N / 16; ++kk)
            Wgmma<T, HEAD_DIM_PAD>::rs(o, pa[kk], desc_v + (unsigned long long)((kk * 16 * 128) >> 4), 1);
        wgmma_commit();
    };

    // S = Q K_j^T (asynchronous: committed, not waited for)
    auto issue_qk = [&](float (&s)[NS], int j) {
        const unsigned long long desc_k = desc_k0 + stage_off(j);
#pragma unroll
        for (int kd = 0; kd < KD; ++kd)
            Wgmma<T, BLOCK_N>::ss(s, desc_q + kstep(kd, L::Q_SLAB), desc_k + kstep(kd, L::KV_SLAB), kd);
        wgmma_commit();
    };

    // Scale and mask S of tile j, update the running max; P = exp2(S - m) in
    // place, its row sums in rs. Returns whether the warp raised its max
    // (alpha = exp2(m_old - m_new) then holds the factor for O and l).
    auto softmax = [&](float (&s)[NS], int j, float (&alpha)[2], float (&rs)[2]) {
        // s[4 nt + e]: row my_row + 8 (e / 2), key n0 + 8 nt + 2 (lane % 4) + e % 2
#pragma unroll
        for (int i = 0; i < NS; ++i) s[i] *= scale_log2;  // scale, then mask
        const int n0 = j * BLOCK_N;
        if (n0 + BLOCK_N > n_free) {           // only tiles crossing the diagonal or the end
            int key_limit[2];                  // last visible key of each of the thread's rows
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int pr = row0 + my_row + 8 * h;
                key_limit[h] = CAUSAL ? min(seqlen_k - 1, pr / group + diag) : seqlen_k - 1;
            }
#pragma unroll
            for (int i = 0; i < NS; ++i) {
                const int key = n0 + 8 * (i / 4) + 2 * (lane & 3) + (i & 1);
                if (key > key_limit[(i / 2) & 1]) s[i] = __int_as_float(0xff800000);
            }
        }
        float mx[2];
        bool grow = false;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            float m = __int_as_float(0xff800000);
#pragma unroll
            for (int nt = 0; nt < NS / 4; ++nt) m = fmaxf(m, fmaxf(s[4 * nt + 2 * h], s[4 * nt + 2 * h + 1]));
            m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 1));  // the 4 lanes of a row
            m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 2));
            mx[h] = m;
            grow |= m > m_run[h] + RESCALE_THRESHOLD;
        }
        const bool rescale = __any_sync(0xffffffffu, grow);  // warp-uniform lazy rescale
        auto exponentials = [&]() {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const float m_use = m_run[h] == __int_as_float(0xff800000) ? 0.f : m_run[h];
                rs[h] = 0.f;
#pragma unroll
                for (int nt = 0; nt < NS / 4; ++nt) {
                    // P = exp2(S - m)
                    const float p0 = fast_exp2(s[4 * nt + 2 * h] - m_use);
                    const float p1 = fast_exp2(s[4 * nt + 2 * h + 1] - m_use);
                    s[4 * nt + 2 * h] = p0;
                    s[4 * nt + 2 * h + 1] = p1;
                    rs[h] += p0 + p1;
                }
            }
        };
        // The exponentials sit inside both branches on purpose: ptxas schedules
        // within a basic block, and in the block after the branches it would
        // hoist the caller's wait for P V above them, losing the overlap.
        if (rescale) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const float m_new = fmaxf(m_run[h], mx[h]);
                // exp2(m_old - m_new): 0 while m_old = -inf
                alpha[h] = fast_exp2(m_run[h] - (m_new == __int_as_float(0xff800000) ? 0.f : m_new));
                m_run[h] = m_new;
            }
            exponentials();
        } else {
            exponentials();
        }
        return rescale;
    };

    // online softmax: O *= exp2(m_old - m_new), l = l exp2(m_old - m_new) + rowsum P;
    // then P becomes the A fragments (the S fragment of keys 16 kk .. is P's).
    auto fold = [&](float (&s)[NS], bool rescale, const float (&alpha)[2], const float (&rs)[2]) {
        if (rescale) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                l_run[h] *= alpha[h];
#pragma unroll
                for (int nt = 0; nt < NO / 4; ++nt) {
                    o[4 * nt + 2 * h] *= alpha[h];
                    o[4 * nt + 2 * h + 1] *= alpha[h];
                }
            }
        }
        l_run[0] += rs[0];
        l_run[1] += rs[1];
#pragma unroll
        for (int kk = 0; kk < BLOCK_N / 16; ++kk) {
            pa[kk][0] = pack2<T>(s[8 * kk + 0], s[8 * kk + 1]);  // row r,     keys 16 kk + 2c, +1
            pa[kk][1] = pack2<T>(s[8 * kk + 2], s[8 * kk + 3]);  // row r + 8
            pa[kk][2] = pack2<T>(s[8 * kk + 4], s[8 * kk + 5]);  // row r,     keys 16 kk + 8 + 2c, +1
            pa[kk][3] = pack2<T>(s[8 * kk + 6], s[8 * kk + 7]);  // row r + 8
        }
    };

    mbar_wait(q_full, 0);
    fence_proxy_async();                       // cp.async (generic proxy) writes -> wgmma reads
    if (num_n > 0) {
        // tile 0: S, softmax, P
        float s[NS], alpha[2] = {1.f, 1.f}, rs[2];
        mbar_wait(full(0), 0);
        fence_proxy_async();
        wgmma_fence();
        issue_qk(s, 0);
        wgmma_wait<0>();
        fence_regs(s);
        const bool rescale = softmax(s, 0, alpha, rs);
        fold(s, rescale, alpha, rs);
    }
    for (int j = 1; j < num_n; ++j) {
        // S_j = Q K_j^T, then O += P_{j-1} V_{j-1} behind it on the tensor cores;
        // the softmax of S_j runs while P V does
        float s[NS], alpha[2] = {1.f, 1.f}, rs[2];
        mbar_wait(full(j % STAGES), (j / STAGES) & 1);
        fence_proxy_async();
        wgmma_fence();
        issue_qk(s, j);
        wgmma_fence();                         // P V is a pipeline stage of its own
        issue_pv(j - 1);
        wgmma_wait<1>();                       // S_j is ready
        fence_regs(s);
        const bool rescale = softmax(s, j, alpha, rs);
        wgmma_wait<0>();                       // P_{j-1} V_{j-1} is done: release its stage
        fence_regs(o);
        mbar_arrive(empty((j - 1) % STAGES));
        fold(s, rescale, alpha, rs);
    }
    if (num_n > 0) {                           // the last tile's P V
        wgmma_fence();
        issue_pv(num_n - 1);
        wgmma_wait<0>();
        fence_regs(o);
        mbar_arrive(empty((num_n - 1) % STAGES));
    }

    // ---- epilogue: O / l into this warpgroup's rows of the Q tile, then out ----------
    // (only this warpgroup's wgmmas read those rows, and they are done)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        float l = l_run[h];
        l += __shfl_xor_sync(0xffffffffu, l, 1);
        l += __shfl_xor_sync(0xffffffffu, l, 2);
        const float inv = len < 0 ? quiet_nan() : l > 0.f ? 1.f / l : 0.f;
        const int r = my_row + 8 * h;
#pragma unroll
        for (int nt = 0; nt < NO / 4; ++nt) {
            // columns 8 nt + 2 (lane % 4) + {0, 1}: chunk nt % 8 of slab nt / 8
            const unsigned addr = (nt / 8) * L::Q_SLAB + swizzle128(r, nt % 8) + 4 * (lane & 3);
            *reinterpret_cast<unsigned*>(smem + (sQ - base) + addr) =
                pack2<T>(o[4 * nt + 2 * h] * inv, o[4 * nt + 2 * h + 1] * inv);
        }
        if (lse != nullptr && (lane & 3) == 0) {
            const int pr = row0 + r;
            if (pr < packed_rows) {
                const int t = pr / group, g = pr - (pr / group) * group;
                const index_t idx = ((index_t)b * num_q_heads + q_head_of(kvh, g, group)) * seqlen_q + t;
                // natural-log LSE: (m + log2 l) * ln 2
                lse[idx] = len < 0 ? quiet_nan() : l > 0.f ? (m_run[h] + log2f(l)) * 0.6931471805599453f
                                                           : __int_as_float(0xff800000);
            }
        }
    }
    warpgroup_sync(1 + wg);
    const int ch_used = p.head_dim / 8;
    for (int c = tid - wg * 128; c < 64 * ch_used; c += 128) {
        const int r = wg * 64 + c / ch_used, ch = c - (c / ch_used) * ch_used;
        const int pr = row0 + r;
        if (pr < packed_rows) {
            const int t = pr / group, g = pr - (pr / group) * group;
            T* dst = out + (index_t)b * p.o_stride[0] + (index_t)t * p.o_stride[1] +
                     (index_t)q_head_of(kvh, g, group) * p.o_stride[2] + ch * 8;
            *reinterpret_cast<uint4*>(dst) =
                *reinterpret_cast<const uint4*>(smem + (sQ - base) + (ch / 8) * L::Q_SLAB + swizzle128(r, ch % 8));
        }
    }
}
