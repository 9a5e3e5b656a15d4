/*
 * tiled_f16x2.cu -- tensor-core prefill kernel for float32 grouped-query
 * attention, through fp16 mma.sync, at full fp32 accuracy (fp16 pairs).
 *
 * Precision: fp16 pairs
 * -----------------------------------------------------------------------------
 * Each fp32 operand x, scaled by a power of two sigma (below), is a pair of
 * fp16 numbers,
 *     y = x sigma,   hi = fp16(y),   lo = fp16((y - hi) 2^11),
 * 11 + 11 significant bits, and each product is three fp16 products with fp32
 * accumulation:
 *     S:  Q K^T   = hi_q hi_k + 2^-11 (hi_q lo_k + lo_q hi_k)
 *                   (hi hi and the cross terms in accumulators of their own)
 *     O:  2^11 P V = a hi_v + p lo_v + r hi_v,
 *                   a = fp16(2^11 P), r = fp16(2^11 P - a), p = fp16(P)
 *                   (one accumulator: P <= 1, so a fits fp16)
 * The same accuracy as split TF32 (kernels/tiled_tf32.cu, kernels/tf32.cuh:
 * relative error about 1.4e-7 on both in benchmarks/dev/fp32_pairs_model.py),
 * with the tensor cores at fp16's rate, twice TF32's, and V read as it is
 * (ldmatrix .trans) instead of through scalar loads.
 *
 * Range.  fp16 holds magnitudes up to 65504 and keeps 11 bits above 2^-14.
 * Every tile is scaled so that its largest finite magnitude lies in
 * [2^14, 2^15) (sigma = 2^e, e from the exponent of the tile's max):
 *   Q   one scale for the CTA's tile (eq);
 *   K   one per key tile (ek_j); S_j is then S_true 2^(eq + ek_j), and the
 *       softmax's scale for the tile is scale_log2 2^-(eq + ek_j), so the
 *       scores reach the softmax (and the modifiers) in their true units;
 *   V   tile j by the smallest e of the sequence's tiles 0 .. j (cv_j, which
 *       never grows with j): O = 2^(11 + cv) O_true, and a tile whose cv_j is
 *       smaller multiplies O by 2^(cv_j - cv) first. A V tile far smaller than
 *       a larger one before it keeps 11 + 11 bits down to 2^-14 of that tile's
 *       max, relative to it.
 * Infinities and NaNs take no part in a max (the pair of an inf is inf and
 * NaN, of a NaN NaN): as in the other tensor-core kernels, rows whose CTA
 * reads a key tile holding one may see NaN.
 *
 * Three launches (cupy_gqa/_plan.py: F16x2Launch)
 * -----------------------------------------------------------------------------
 * K and V become pairs once per call, not once per CTA that reads them, in a
 * workspace: for each key tile t = (b * num_kv_heads + kvh) * ntiles + j of
 * BLOCK_N keys of a sequence (ntiles: the tiles of the longest),
 *   pairs[t]   4 BLOCK_N rows of D halves: K hi, K lo, V hi, V lo, zero past
 *              the sequence's keys (tiles wholly past them are not written);
 *   scale[t]   (ek_j, cv_j), int2, at ints + 2 t;
 *   ev[t]      the V tile's own e, at ints + 2 n + t (n tiles in all).
 *   1. f16x2_v_exponents: ev of each V tile (one CTA a tile).
 *   2. f16x2_kv_pairs: cv_j = min ev over tiles 0 .. j, ek_j from the K
 *      tile's max, then both tiles' pairs and scale[t] (one CTA a tile).
 *   3. tiled_f16x2_attention: the prefill kernel below.
 * The per-sequence addressing (varlen, paged K/V, left padding) is the first
 * two kernels' business: the third reads a sequence's tiles at its index b.
 *
 * Algorithm and grid of the prefill kernel (FlashAttention-2 style)
 * -----------------------------------------------------------------------------
 * GQA packing: for one (batch b, kv head kvh) the G = group_size query heads
 * that share it are packed into rows r = t*G + g (t = query position). A CTA
 * owns BLOCK_M = 16 * NUM_WARPS consecutive packed rows of one (b, kvh); warp w
 * owns rows [16w, 16w + 16). The grid and tile order are prefill_tile's
 * (common.cuh). Per CTA:
 *   Q: read twice from global memory by the threads (its max, then its
 *      pairs into shared memory)
 *   for each key tile j that some row sees (pairs by cp.async, one tile ahead):
 *       O to the scale of V_j if cv_j is smaller
 *       S  = Q K_j^T (3 fp16 products per product, k16)
 *       mask, online softmax (kernels/softmax.cuh, eager, exact exp2)
 *       O += P V_j   (3 fp16 products per product)
 *   out = O / l 2^-(11 + cv), lse = (m + log2 l) ln 2
 * The tensor cores add into an accumulator with truncation (kernels/tf32.cuh):
 * each group of KG k16 steps of S and each tile's P V go into fresh
 * accumulators that are added in IEEE fp32.
 *
 * Shared memory (F16x2Smem below, bytes; SMEM_BYTES must equal its BYTES):
 *   [ Q hi | Q lo | stage 0: K hi | K lo | V hi | V lo | stage 1: the same ],
 * fp16 rows of D + 8 halves (16 bytes mod 128: the 8 rows of an ldmatrix in
 * distinct banks). The epilogue stages out through the Q tiles as fp32 rows of
 * D + 4.
 *
 * Requirements (checked by the Python layer): head_dim a multiple of 32,
 * head_dim stride 1, 16-byte aligned rows, scale_log2 > 0.
 */
#include "common.cuh"
#include "softmax.cuh"
#include "tiled_f32.cuh"

namespace f16x2_detail {

// k16 steps of S whose products go into one fresh accumulator (see the top)
enum : int { KG = 2 };

// The shared-memory layout (see the top): byte offsets.
template <int HEAD_DIM, int BLOCK_M, int BLOCK_N>
struct F16x2Smem {
    enum : int {
        ROWH = HEAD_DIM + 8,                  // fp16 row, halves
        QT = BLOCK_M * ROWH * 2,              // one fp16 Q tile, bytes
        KT = BLOCK_N * ROWH * 2,              // one fp16 K or V tile
        Q_HI = 0,
        Q_LO = Q_HI + QT,
        STAGE = Q_LO + QT,                    // stage s at STAGE + s * STAGE_BYTES: K hi, K lo, V hi, V lo
        STAGE_BYTES = 4 * KT,
        RED = STAGE + 2 * STAGE_BYTES,        // Q's max (unsigned)
        BYTES = RED + 16,
    };
};

// Threads of the two kernels that make the pairs of K and V
enum : int { PREP_THREADS = 128 };

// Where tile t of the workspace is (see the top): n tiles in all
struct Workspace {
    __half* pairs;
    int* ints;
    int n;
    __device__ __forceinline__ int2* scale() const { return reinterpret_cast<int2*>(ints); }
    __device__ __forceinline__ int* ev() const { return ints + 2 * n; }
};

// The largest finite magnitude of a set of floats, kept as an unsigned key:
// (bits << 1) + 2^24 (mod 2^32) orders finite magnitudes as the floats do and
// puts inf and NaN below every finite value (they wrap to under 2^24).
__device__ __forceinline__ unsigned max_key(unsigned m, float x) {
    return max(m, (__float_as_uint(x) << 1) + 0x01000000u);
}
__device__ __forceinline__ unsigned max_key(unsigned m, const float4& x) {
    return max_key(max_key(max_key(max_key(m, x.x), x.y), x.z), x.w);
}

// The scale exponent e of a tile whose max_key is m: its largest finite
// magnitude times 2^e lies in [2^14, 2^15); 126 for a tile of zeros (or of
// nothing finite). e is in [-113, 126].
__device__ __forceinline__ int scale_exp(unsigned m) {
    const int biased = max((int)(m >> 24), 1) - 1;  // the max's biased exponent (0: zero, subnormal)
    return min(141 - biased, 126);                 // 14 - (biased - 127)
}
// 2^e for e in [-126, 127]
__device__ __forceinline__ float pow2(int e) { return __uint_as_float((unsigned)(e + 127) << 23); }

// The pair of 4 values (already scaled): hi and lo, 4 halves each.
__device__ __forceinline__ void to_pair(const float4& y, uint2& hi, uint2& lo) {
    const __half2 h01 = __floats2half2_rn(y.x, y.y), h23 = __floats2half2_rn(y.z, y.w);
    const float2 f01 = __half22float2(h01), f23 = __half22float2(h23);
    const __half2 l01 = __floats2half2_rn((y.x - f01.x) * 2048.f, (y.y - f01.y) * 2048.f);
    const __half2 l23 = __floats2half2_rn((y.z - f23.x) * 2048.f, (y.w - f23.y) * 2048.f);
    hi = make_uint2(*reinterpret_cast<const unsigned*>(&h01), *reinterpret_cast<const unsigned*>(&h23));
    lo = make_uint2(*reinterpret_cast<const unsigned*>(&l01), *reinterpret_cast<const unsigned*>(&l23));
}

// The three A operands of P V from two probabilities x0, x1 (<= 1) of one row
// (see the top): a = fp16(2^11 x), r = fp16(2^11 x - a), p = fp16(x).
__device__ __forceinline__ void p_operands(float x0, float x1, unsigned& a, unsigned& r, unsigned& p) {
    const float a0 = x0 * 2048.f, a1 = x1 * 2048.f;
    const __half2 ah = __floats2half2_rn(a0, a1);
    const float2 af = __half22float2(ah);
    const __half2 rh = __floats2half2_rn(a0 - af.x, a1 - af.y);
    const __half2 ph = __floats2half2_rn(x0, x1);
    a = *reinterpret_cast<const unsigned*>(&ah);
    r = *reinterpret_cast<const unsigned*>(&rh);
    p = *reinterpret_cast<const unsigned*>(&ph);
}

// The largest key (max_key) over the CTA's PREP_THREADS threads, in every thread
// (red: a word per warp; the barrier first frees it from a reduction before).
__device__ __forceinline__ unsigned cta_max(unsigned m, unsigned* red) {
    m = __reduce_max_sync(0xffffffffu, m);
    __syncthreads();
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = m;
    __syncthreads();
    return max(max(red[0], red[1]), max(red[2], red[3]));
}
__device__ __forceinline__ int cta_min(int x, unsigned* red) {
    x = __reduce_min_sync(0xffffffffu, x);
    __syncthreads();
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = (unsigned)x;
    __syncthreads();
    return min(min((int)red[0], (int)red[1]), min((int)red[2], (int)red[3]));
}

// The key tile of a CTA of the first two kernels: t (blockIdx.x), its index j
// in its (sequence, KV head) bh, and the sequence.
template <int ADDR>
struct PrepTile {
    int t, j, bh, kvh;
    Sequence<ADDR> sqn;
};
template <int ADDR>
__device__ __forceinline__ PrepTile<ADDR> prep_tile(const AttnParams& p, const int* seqlens_k, const SeqParams* sp,
                                                    int ntiles) {
    PrepTile<ADDR> pt;
    pt.t = blockIdx.x;
    pt.bh = pt.t / ntiles;
    pt.j = pt.t - pt.bh * ntiles;
    pt.kvh = pt.bh % p.num_kv_heads;
    pt.sqn = sequence_of<ADDR>(p, seqlens_k, sp, pt.bh / p.num_kv_heads);
    return pt;
}

// The 16-byte chunk c (row c / (D / 4)) of the tile of keys from j0 of x (k or v),
// zero past the sequence's keys.
template <int D, int ADDR>
__device__ __forceinline__ float4 kv_chunk(const float* __restrict__ x, const index_t (&stride)[4],
                                           const PrepTile<ADDR>& pt, int j0, int c) {
    constexpr int CH = D / 4;
    const int r = c / CH, ch = c - r * CH, key = j0 + r;
    if (key >= pt.sqn.len) return make_float4(0.f, 0.f, 0.f, 0.f);
    const float* base = x + pt.sqn.k_batch() * stride[0] + pt.sqn.k0() * stride[1] + pt.kvh * stride[2];
    return __ldg(reinterpret_cast<const float4*>(base + pt.sqn.kv_row(key, stride[0], stride[1]) + ch * 4));
}

// The pairs of the thread's chunks of the tile of keys from j0 of x, scaled by
// sigma, as rows of D halves: hi at dst, lo at dst + BLOCK_N * D (chunk c at 4 c).
template <int BLOCK_N, int D, int ADDR>
__device__ __forceinline__ void store_pairs(__half* __restrict__ dst, const float* __restrict__ x,
                                            const index_t (&stride)[4], const PrepTile<ADDR>& pt, int j0, float sigma) {
#pragma unroll 4
    for (int c = threadIdx.x; c < BLOCK_N * D / 4; c += PREP_THREADS) {
        float4 y = kv_chunk<D>(x, stride, pt, j0, c);
        y.x *= sigma, y.y *= sigma, y.z *= sigma, y.w *= sigma;
        uint2 hi, lo;
        to_pair(y, hi, lo);
        *reinterpret_cast<uint2*>(dst + 4 * c) = hi;
        *reinterpret_cast<uint2*>(dst + BLOCK_N * D + 4 * c) = lo;
    }
}

// The largest key (max_key) of the thread's chunks of the tile of keys from j0 of x.
template <int BLOCK_N, int D, int ADDR>
__device__ __forceinline__ unsigned tile_max_key(const float* __restrict__ x, const index_t (&stride)[4],
                                                 const PrepTile<ADDR>& pt, int j0) {
    unsigned m = 0u;
#pragma unroll 4
    for (int c = threadIdx.x; c < BLOCK_N * D / 4; c += PREP_THREADS) m = max_key(m, kv_chunk<D>(x, stride, pt, j0, c));
    return m;
}

}  // namespace f16x2_detail

// ---- 1. the exponent of each V tile --------------------------------------------
template <int HEAD_DIM, int BLOCK_N, int ADDR>
__device__ __forceinline__ void f16x2_v_exponents_body(const float* __restrict__ v, const int* __restrict__ seqlens_k,
                                                       const AttnParams& p, f16x2_detail::Workspace ws, int ntiles,
                                                       const SeqParams* sp) {
    using namespace f16x2_detail;
    __shared__ unsigned red[PREP_THREADS / 32];
    const PrepTile<ADDR> pt = prep_tile<ADDR>(p, seqlens_k, sp, ntiles);
    const int j0 = pt.j * BLOCK_N;
    if (j0 >= pt.sqn.len) return;  // past the sequence's keys (or a bad length): no CTA reads the tile
    const unsigned m = cta_max(tile_max_key<BLOCK_N, HEAD_DIM>(v, p.v_stride, pt, j0), red);
    if (threadIdx.x == 0) ws.ev()[pt.t] = scale_exp(m);
}

// ---- 2. the pairs of each K and V tile, and their scales ------------------------
template <int HEAD_DIM, int BLOCK_N, int ADDR>
__device__ __forceinline__ void f16x2_kv_pairs_body(const float* __restrict__ k, const float* __restrict__ v,
                                                    const int* __restrict__ seqlens_k, const AttnParams& p,
                                                    f16x2_detail::Workspace ws, int ntiles, const SeqParams* sp) {
    using namespace f16x2_detail;
    constexpr int D = HEAD_DIM;
    __shared__ unsigned red[PREP_THREADS / 32];
    const PrepTile<ADDR> pt = prep_tile<ADDR>(p, seqlens_k, sp, ntiles);
    const int j0 = pt.j * BLOCK_N;
    if (j0 >= pt.sqn.len) return;
    __half* tile = ws.pairs + (size_t)pt.t * (4 * BLOCK_N * D);

    // cv_j: the smallest e of the V tiles 0 .. j of (sequence, KV head) bh
    int cv = 127;
    const int* ev = ws.ev() + (size_t)pt.bh * ntiles;
    for (int i = threadIdx.x; i <= pt.j; i += PREP_THREADS) cv = min(cv, ev[i]);
    cv = cta_min(cv, red);

    // (each chunk read twice, the second time from L1 or L2)
    const int ek = scale_exp(cta_max(tile_max_key<BLOCK_N, D>(k, p.k_stride, pt, j0), red));
    store_pairs<BLOCK_N, D>(tile, k, p.k_stride, pt, j0, pow2(ek));
    store_pairs<BLOCK_N, D>(tile + 2 * BLOCK_N * D, v, p.v_stride, pt, j0, pow2(cv));
    if (threadIdx.x == 0) ws.scale()[pt.t] = make_int2(ek, cv);
}

// ---- 3. the prefill kernel ---------------------------------------------------------
// The kernel's body, for the kernel without modifiers (M = NoMods) and the one
// with them (tiled_f16x2_attention_mods, common.cuh: modifiers). ADDR: the
// per-sequence addressing (common.cuh: Sequence; 0: contiguous) of sp.
template <int HEAD_DIM, int BLOCK_M, int BLOCK_N, int NUM_WARPS, bool CAUSAL, int SMEM_BYTES, class M, int ADDR = 0>
__device__ __forceinline__ void tiled_f16x2_body(
    const float* __restrict__ q, float* __restrict__ out, float* __restrict__ lse, const int* __restrict__ seqlens_k,
    const AttnParams& p, f16x2_detail::Workspace ws, int ntiles, const ModParams& mp, const SeqParams* sp = nullptr)
{
    using namespace f16x2_detail;
    constexpr int D = HEAD_DIM;
    constexpr int NTHREADS = NUM_WARPS * 32;
    using L = F16x2Smem<HEAD_DIM, BLOCK_M, BLOCK_N>;
    constexpr int ROWH = L::ROWH;          // fp16 row, halves
    constexpr int ROWF = D + 4;            // the epilogue's fp32 row, floats
    constexpr int KD = D / 16;             // k16 steps of Q K^T
    constexpr int NT = BLOCK_N / 8;        // n8 tiles of S
    constexpr int KK = BLOCK_N / 16;       // k16 steps of P V
    constexpr int DT = D / 8;              // n8 tiles of O
    constexpr int CH = D / 4;              // 16-byte fp32 chunks per row
    constexpr int RCH = D / 8;             // 16-byte chunks per fp16 row
    constexpr int TCH = 4 * BLOCK_N * RCH; // 16-byte chunks of a tile's pairs
    static_assert(BLOCK_M == 16 * NUM_WARPS, "16 rows per warp");
    static_assert(D % 32 == 0 && BLOCK_N % 16 == 0, "tile shapes");
    static_assert(TCH % NTHREADS == 0, "a tile's chunks divide the threads");
    static_assert(SMEM_BYTES == L::BYTES, "SMEM_BYTES is not the size of the shared-memory layout");
    static_assert(2 * L::QT >= BLOCK_M * ROWF * 4, "the epilogue's rows fit in the Q tiles");
    const float NEG_INF = neg_inf<float>();

    extern __shared__ __align__(16) unsigned char smem_raw[];
    unsigned char* const smem = smem_raw;
    unsigned* red = reinterpret_cast<unsigned*>(smem + L::RED);

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g_lane = lane >> 2;

    // ---- which (b, kvh, m_tile) this CTA owns ----------------------------------
    Sequence<ADDR> sqn;  // the CTA's sequence: where its queries are
    const PrefillTile<CAUSAL, M::WINDOW> tile = prefill_tile_seq<CAUSAL, BLOCK_M, M::WINDOW, ADDR>(
        p, seqlens_k, sp, p.group_size, mp.window_left, mp.window_right, sqn, blockIdx.x);
    if constexpr (ADDR != 0) {
        if (tile.row0 >= tile.packed_rows) return;  // past its sequence's rows (the whole CTA)
    }
    const int b = tile.b, kvh = tile.kv_head, row0 = tile.row0, group = tile.group, packed_rows = tile.packed_rows;
    const int len = tile.len;  // valid keys of this sequence; -1: bad, NaN rows
    const KeyRange<CAUSAL, M::WINDOW>& keys = tile.keys;
    const int num_n = (keys.end + BLOCK_N - 1) / BLOCK_N;
    const int j_first = M::WINDOW ? keys.start / BLOCK_N : 0;  // tiles before the window's band are skipped
    const size_t bh_tile = (size_t)(b * p.num_kv_heads + kvh) * ntiles;  // the workspace's tile 0 of (b, kvh)
    const __half* pairs = ws.pairs + bh_tile * (4 * BLOCK_N * D);
    const int2* scales = ws.scale() + bh_tile;
    const unsigned s_base = smem_addr(smem);

    // ---- the pairs of tile j into stage j & 1: 4 BLOCK_N rows (K hi, K lo, V hi, V lo)
    auto load_pairs = [&](int j) {
        const __half* src = pairs + (size_t)j * (4 * BLOCK_N * D);
        const unsigned dst = s_base + L::STAGE + (j & 1) * L::STAGE_BYTES;
#pragma unroll
        for (int i = 0; i < TCH / NTHREADS; ++i) {
            const int c = tid + i * NTHREADS;
            cp_async_16(dst + ((c / RCH) * ROWH + (c % RCH) * 8) * 2, src + c * 8, true);
        }
    };
    int2 sc_next = make_int2(0, 127);  // (ek, cv) of the next tile, read with its pairs
    if (num_n > j_first) {
        load_pairs(j_first);
        sc_next = scales[j_first];
    }
    cp_async_commit();

    // ---- Q: its max, then its pairs (read twice by the threads; rows past the end are 0)
    auto q_chunk = [&](int c) {
        const int r = c / CH, ch = c % CH, pr = row0 + r;
        if (pr >= packed_rows) return make_float4(0.f, 0.f, 0.f, 0.f);
        const int t = pr / group, g = pr % group;
        return __ldg(reinterpret_cast<const float4*>(q + b * p.q_stride[0] + (index_t)(sqn.q0() + t) * p.q_stride[1] +
                                                     q_head_of(kvh, g, group) * p.q_stride[2] + ch * 4));
    };
    if (tid == 0) red[0] = 0u;
    __syncthreads();
    {
        unsigned mk = 0u;
#pragma unroll 4
        for (int c = tid; c < BLOCK_M * CH; c += NTHREADS) mk = max_key(mk, q_chunk(c));
        mk = __reduce_max_sync(0xffffffffu, mk);
        if (lane == 0) atomicMax(red, mk);
    }
    __syncthreads();
    const int eq = scale_exp(red[0]);
    {
        const float sigma = pow2(eq);
#pragma unroll 4
        for (int c = tid; c < BLOCK_M * CH; c += NTHREADS) {
            float4 y = q_chunk(c);
            y.x *= sigma, y.y *= sigma, y.z *= sigma, y.w *= sigma;
            uint2 hi, lo;
            to_pair(y, hi, lo);
            const int off = ((c / CH) * ROWH + (c % CH) * 4) * 2;
            *reinterpret_cast<uint2*>(smem + L::Q_HI + off) = hi;
            *reinterpret_cast<uint2*>(smem + L::Q_LO + off) = lo;
        }
    }
    const float q_unscale = pow2(-eq);

    // ---- per-thread state: rows g_lane and g_lane + 8 of the warp's 16 ----------
    float o_acc[DT][4];
#pragma unroll
    for (int dt = 0; dt < DT; ++dt)
#pragma unroll
        for (int e = 0; e < 4; ++e) o_acc[dt][e] = 0.f;
    float m_run[2] = {NEG_INF, NEG_INF}, l_run[2] = {0.f, 0.f};  // log2-domain max, partial sums
    int cv = 127;  // O's V scale exponent (see the top): above every tile's until the first

    // ldmatrix lane offsets (halves within a tile), as kernels/tiled.cu:
    //  A (Q) and B-trans (V): {rows 0-7, k 0-7}, {rows 8-15, k 0-7}, {rows 0-7, k 8-15}, {rows 8-15, k 8-15}
    //  B (K):                 {keys 0-7, d 0-7}, {keys 0-7, d 8-15}, {keys 8-15, d 0-7}, {keys 8-15, d 8-15}
    const int a_off = (((lane >> 3) & 1) * 8 + (lane & 7)) * ROWH + (lane >> 4) * 8;
    const int k_off = ((lane >> 4) * 8 + (lane & 7)) * ROWH + ((lane >> 3) & 1) * 8;
    const unsigned sQ_warp = s_base + L::Q_HI + (warp * 16 * ROWH + a_off) * 2;

    // the modifiers' view of the lane's rows (common.cuh: mods)
    const mods::Seq sq = mods::seq(b, sqn.seqlen_q(p.seqlen_q), tile.seqlen_k);
    mods::Diag mrow[2];
    if constexpr (M::ANY) {
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
            const int pr = row0 + warp * 16 + g_lane + hf * 8;
            mrow[hf] = mods::diag<M>(mp, sq, pr / group, q_head_of(kvh, pr % group, group));
        }
    }

    for (int j = j_first; j < num_n; ++j) {
        cp_async_wait<0>();  // tile j landed for this thread
        __syncthreads();     // ... for all threads; every warp is done with tile j - 1's stage
        const int2 sc = sc_next;
        if (j + 1 < num_n) {
            load_pairs(j + 1);
            sc_next = scales[j + 1];
        }
        cp_async_commit();
        const unsigned stage = s_base + L::STAGE + (j & 1) * L::STAGE_BYTES;
        const unsigned sK_lane = stage + k_off * 2;
        const unsigned sV_lane = stage + 2 * L::KT + a_off * 2;
        if (sc.y < cv) {  // a larger V than any before: O to the new scale (CTA-uniform)
            const float f = sc.y - cv >= -126 ? pow2(sc.y - cv) : 0.f;
#pragma unroll
            for (int dt = 0; dt < DT; ++dt)
#pragma unroll
                for (int e = 0; e < 4; ++e) o_acc[dt][e] *= f;
            cv = sc.y;
        }

        // ---- S = Q K^T: hi hi, and the cross terms apart --------------------------------
        float s[NT][4] = {};
#pragma unroll 1
        for (int kg = 0; kg < KD; kg += KG) {
            float main_[NT][4] = {}, cross[NT][4] = {};
#pragma unroll
            for (int kd = kg; kd < kg + KG && kd < KD; ++kd) {
                unsigned qh[4], ql[4];
                ldmatrix_x4(qh, sQ_warp + kd * 32);
                ldmatrix_x4(ql, sQ_warp + (L::Q_LO - L::Q_HI) + kd * 32);
#pragma unroll
                for (int np = 0; np < NT / 2; ++np) {
                    unsigned kh[4], kl[4];
                    const unsigned at = sK_lane + (np * 16 * ROWH + kd * 16) * 2;
                    ldmatrix_x4(kh, at);
                    ldmatrix_x4(kl, at + L::KT);
#pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        mma_16816<__half>(cross[2 * np + h], qh, kl[2 * h], kl[2 * h + 1]);
                        mma_16816<__half>(cross[2 * np + h], ql, kh[2 * h], kh[2 * h + 1]);
                        mma_16816<__half>(main_[2 * np + h], qh, kh[2 * h], kh[2 * h + 1]);
                    }
                }
            }
#pragma unroll
            for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) s[nt][e] += fmaf(cross[nt][e], 4.8828125e-4f, main_[nt][e]);
        }

        // ---- mask or modifiers, online softmax, in the scores' true units -------------
        // (S is S_true 2^(eq + ek); the scale stays > 0: -inf * scale is -inf)
        const float scale_j = fmaxf((float)p.scale_log2 * q_unscale * pow2(-sc.x), 1.17549435e-38f);
        f32_tiled::tile_update<M, CAUSAL, BLOCK_N>(s, o_acc, m_run, l_run, j * BLOCK_N, row0 + warp * 16 + g_lane, lane,
                                                   keys, mp, sq, mrow, scale_j);

        // ---- O += P V (O is 2^(11 + cv) O_true): small terms first, then a hi_v ---------
        unsigned pa[KK][4], pr_[KK][4], pp[KK][4];
#pragma unroll
        for (int kk = 0; kk < KK; ++kk)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                // e: rows g / g+8 (e & 1) of keys 16 kk + 2c (e < 2) or 16 kk + 8 + 2c
                const float* x = s[2 * kk + (e >> 1)] + 2 * (e & 1);
                p_operands(x[0], x[1], pa[kk][e], pr_[kk][e], pp[kk][e]);
            }
#pragma unroll
        for (int dp = 0; dp < DT / 2; ++dp) {
            float part[2][4] = {};
#pragma unroll
            for (int kk = 0; kk < KK; ++kk) {
                unsigned vh[4], vl[4];
                const unsigned at = sV_lane + (kk * 16 * ROWH + dp * 16) * 2;
                ldmatrix_x4_trans(vh, at);
                ldmatrix_x4_trans(vl, at + L::KT);
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    mma_16816<__half>(part[h], pr_[kk], vh[2 * h], vh[2 * h + 1]);
                    mma_16816<__half>(part[h], pp[kk], vl[2 * h], vl[2 * h + 1]);
                    mma_16816<__half>(part[h], pa[kk], vh[2 * h], vh[2 * h + 1]);
                }
            }
#pragma unroll
            for (int h = 0; h < 2; ++h)
#pragma unroll
                for (int e = 0; e < 4; ++e) o_acc[2 * dp + h][e] += part[h][e];
        }
    }
    cp_async_wait<0>();  // nothing left in flight (also when num_n == 0)
    __syncthreads();     // every warp is done with the Q tiles before they are overwritten

    // ---- epilogue: O / l 2^-(11 + cv) into the warp's rows of the Q tiles, then 16-byte stores
    const float v_unscale = pow2(-min(cv, 126));
    f32_tiled::store_rows<M, D, ROWF>(reinterpret_cast<float*>(smem + L::Q_HI) + warp * 16 * ROWF, o_acc, l_run, m_run,
                                      4.8828125e-4f, [&](float x) { return x * v_unscale; }, out, lse, p, mp, sqn, b,
                                      kvh, group, row0 + warp * 16, packed_rows, len, lane);
}

// The kernels. Every one takes the launch's arguments in one order (cupy_gqa/_plan.py:
// F16x2Launch): q, k, v, out, lse, seqlens_k, p, the workspace's pairs and ints,
// ntiles, then the modifiers' mp (*_mods) or the per-sequence sp (*_seq).
#define F16X2_ARGS                                                                                             \
    const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,                    \
        float* __restrict__ out, float* __restrict__ lse, const int* __restrict__ seqlens_k, const AttnParams p, \
        __half* __restrict__ pairs, int* __restrict__ ints, const int ntiles
#define F16X2_WORKSPACE f16x2_detail::Workspace{pairs, ints, p.batch * p.num_kv_heads * ntiles}

template <int HEAD_DIM, int BLOCK_N>
__global__ void __launch_bounds__(f16x2_detail::PREP_THREADS) f16x2_v_exponents(F16X2_ARGS) {
    f16x2_v_exponents_body<HEAD_DIM, BLOCK_N, 0>(v, seqlens_k, p, F16X2_WORKSPACE, ntiles, nullptr);
}
template <int HEAD_DIM, int BLOCK_N, int ADDR>
__global__ void __launch_bounds__(f16x2_detail::PREP_THREADS) f16x2_v_exponents_seq(F16X2_ARGS, const SeqParams sp) {
    f16x2_v_exponents_body<HEAD_DIM, BLOCK_N, ADDR>(v, seqlens_k, p, F16X2_WORKSPACE, ntiles, &sp);
}
template <int HEAD_DIM, int BLOCK_N>
__global__ void __launch_bounds__(f16x2_detail::PREP_THREADS) f16x2_kv_pairs(F16X2_ARGS) {
    f16x2_kv_pairs_body<HEAD_DIM, BLOCK_N, 0>(k, v, seqlens_k, p, F16X2_WORKSPACE, ntiles, nullptr);
}
template <int HEAD_DIM, int BLOCK_N, int ADDR>
__global__ void __launch_bounds__(f16x2_detail::PREP_THREADS) f16x2_kv_pairs_seq(F16X2_ARGS, const SeqParams sp) {
    f16x2_kv_pairs_body<HEAD_DIM, BLOCK_N, ADDR>(k, v, seqlens_k, p, F16X2_WORKSPACE, ntiles, &sp);
}

// SMEM_BYTES: the dynamic shared memory the launch passes (cupy_gqa/_specs.py:
// tiled_f16x2_smem), checked against the layout at compile time.
template <int HEAD_DIM, int BLOCK_M, int BLOCK_N, int NUM_WARPS, bool CAUSAL, int SMEM_BYTES>
__global__ void __launch_bounds__(NUM_WARPS * 32, 1) tiled_f16x2_attention(F16X2_ARGS) {
    tiled_f16x2_body<HEAD_DIM, BLOCK_M, BLOCK_N, NUM_WARPS, CAUSAL, SMEM_BYTES, NoMods>(
        q, out, lse, seqlens_k, p, F16X2_WORKSPACE, ntiles, ModParams{});
}

// The same with the modifiers FLAGS (common.cuh: MOD_*), whose values are in mp.
template <int HEAD_DIM, int BLOCK_M, int BLOCK_N, int NUM_WARPS, bool CAUSAL, int SMEM_BYTES, int FLAGS>
__global__ void __launch_bounds__(NUM_WARPS * 32, 1) tiled_f16x2_attention_mods(F16X2_ARGS, const ModParams mp) {
    tiled_f16x2_body<HEAD_DIM, BLOCK_M, BLOCK_N, NUM_WARPS, CAUSAL, SMEM_BYTES, Mods<FLAGS>>(
        q, out, lse, seqlens_k, p, F16X2_WORKSPACE, ntiles, mp);
}

// The same with per-sequence addressing ADDR (common.cuh: SEQ_*: varlen, paged
// K/V, left padding), described by sp.
template <int HEAD_DIM, int BLOCK_M, int BLOCK_N, int NUM_WARPS, bool CAUSAL, int SMEM_BYTES, int ADDR>
__global__ void __launch_bounds__(NUM_WARPS * 32, 1) tiled_f16x2_attention_seq(F16X2_ARGS, const SeqParams sp) {
    tiled_f16x2_body<HEAD_DIM, BLOCK_M, BLOCK_N, NUM_WARPS, CAUSAL, SMEM_BYTES, NoMods, ADDR>(
        q, out, lse, seqlens_k, p, F16X2_WORKSPACE, ntiles, ModParams{}, &sp);
}

// The same with per-sequence addressing ADDR and the modifiers FLAGS.
template <int HEAD_DIM, int BLOCK_M, int BLOCK_N, int NUM_WARPS, bool CAUSAL, int SMEM_BYTES, int ADDR, int FLAGS>
__global__ void __launch_bounds__(NUM_WARPS * 32, 1) tiled_f16x2_attention_seq_mods(F16X2_ARGS, const ModParams mp,
                                                                                     const SeqParams sp) {
    tiled_f16x2_body<HEAD_DIM, BLOCK_M, BLOCK_N, NUM_WARPS, CAUSAL, SMEM_BYTES, Mods<FLAGS>, ADDR>(
        q, out, lse, seqlens_k, p, F16X2_WORKSPACE, ntiles, mp, &sp);
}
