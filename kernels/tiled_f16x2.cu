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
 *   V   one for the whole row of tiles so far, the smallest e seen (cv):
 *       O = 2^(11 + cv) O_true; a tile whose e is smaller multiplies O by
 *       2^(e - cv) first. A V tile far smaller than the largest before it
 *       keeps 11 + 11 bits down to 2^-14 of that tile's max, relative to it.
 * Infinities and NaNs take no part in a max (the pair of an inf is inf and
 * NaN, of a NaN NaN): as in the other tensor-core kernels, rows whose CTA
 * reads a key tile holding one may see NaN.
 *
 * Algorithm and grid (as kernels/tiled_tf32.cu, FlashAttention-2 style)
 * -----------------------------------------------------------------------------
 * GQA packing: for one (batch b, kv head kvh) the G = group_size query heads
 * that share it are packed into rows r = t*G + g (t = query position). A CTA
 * owns BLOCK_M = 16 * NUM_WARPS consecutive packed rows of one (b, kvh); warp w
 * owns rows [16w, 16w + 16). The grid and tile order are prefill_tile's
 * (common.cuh). Per CTA:
 *   Q: read twice from global memory by the threads (its max, then its
 *      pairs into shared memory)
 *   for each K/V tile j of BLOCK_N keys that some row sees:
 *       K_j, V_j have landed as fp32 (cp.async, issued one tile ahead)
 *       their maxima (each thread's chunks, redux over the warp, a shared
 *       atomicMax), then their pairs, once per CTA; K_{j+1}, V_{j+1} issued
 *       S  = Q K_j^T (3 fp16 products per product, k16)
 *       mask, online softmax (kernels/softmax.cuh, eager, exact exp2)
 *       O += P V_j   (3 fp16 products per product)
 *   out = O / l 2^-(11 + cv), lse = (m + log2 l) ln 2
 * The tensor cores add into an accumulator with truncation (kernels/tf32.cuh):
 * each group of KG k16 steps of S and each tile's P V go into fresh
 * accumulators that are added in IEEE fp32.
 *
 * Shared memory (F16x2Smem below, bytes; SMEM_BYTES must equal its BYTES):
 *   [ Q hi | Q lo | K hi | K lo | V hi | V lo : fp16 rows of D + 8
 *     | K, V landing: fp32 rows of D | the tiles' maxima ]
 * fp16 rows of D + 8 halves (16 bytes mod 128) put the 8 rows of an ldmatrix in
 * distinct banks; the landing rows are read by the threads in 16-byte chunks in
 * order. The epilogue stages out through the Q tiles as fp32 rows of D + 4.
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
        K_HI = Q_LO + QT,
        K_LO = K_HI + KT,
        V_HI = K_LO + KT,
        V_LO = V_HI + KT,
        LAND = V_LO + KT,                     // fp32 K rows [0, BLOCK_N), then V rows
        RED = LAND + 2 * BLOCK_N * HEAD_DIM * 4,  // unsigned [2 parities][K, V], Q's
        BYTES = RED + 32,
    };
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

}  // namespace f16x2_detail

// The kernel's body, for the kernel without modifiers (M = NoMods) and the one
// with them (tiled_f16x2_attention_mods, common.cuh: modifiers). ADDR: the
// per-sequence addressing (common.cuh: Sequence; 0: contiguous) of sp.
template <int HEAD_DIM, int BLOCK_M, int BLOCK_N, int NUM_WARPS, bool CAUSAL, int SMEM_BYTES, class M, int ADDR = 0>
__device__ __forceinline__ void tiled_f16x2_body(
    const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,
    float* __restrict__ out, float* __restrict__ lse, const int* __restrict__ seqlens_k, const AttnParams& p,
    const ModParams& mp, const SeqParams* sp = nullptr)
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
    static_assert(BLOCK_M == 16 * NUM_WARPS, "16 rows per warp");
    static_assert(D % 32 == 0 && BLOCK_N % 16 == 0, "tile shapes");
    static_assert(SMEM_BYTES == L::BYTES, "SMEM_BYTES is not the size of the shared-memory layout");
    static_assert(2 * L::QT >= BLOCK_M * ROWF * 4, "the epilogue's rows fit in the Q tiles");
    const float NEG_INF = neg_inf<float>();

    extern __shared__ __align__(16) unsigned char smem_raw[];
    unsigned char* const smem = smem_raw;
    const float* land = reinterpret_cast<const float*>(smem + L::LAND);
    unsigned* red = reinterpret_cast<unsigned*>(smem + L::RED);  // [parity * 2 + {0: K, 1: V}], [4]: Q

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g_lane = lane >> 2;

    // ---- which (b, kvh, m_tile) this CTA owns ----------------------------------
    Sequence<ADDR> sqn;  // the CTA's sequence: where its queries and keys are
    const PrefillTile<CAUSAL, M::WINDOW> tile = prefill_tile_seq<CAUSAL, BLOCK_M, M::WINDOW, ADDR>(
        p, seqlens_k, sp, p.group_size, mp.window_left, mp.window_right, sqn, blockIdx.x);
    if constexpr (ADDR != 0) {
        if (tile.row0 >= tile.packed_rows) return;  // past its sequence's rows (the whole CTA)
    }
    const int b = tile.b, kvh = tile.kv_head, row0 = tile.row0, group = tile.group, packed_rows = tile.packed_rows;
    const int len = tile.len, seqlen_k = tile.seqlen_k;  // valid keys of this sequence; len -1: bad, NaN rows
    const KeyRange<CAUSAL, M::WINDOW>& keys = tile.keys;
    const int num_n = (keys.end + BLOCK_N - 1) / BLOCK_N;
    const int j_first = M::WINDOW ? keys.start / BLOCK_N : 0;  // tiles before the window's band are skipped
    const float* kbase = k + sqn.k_batch() * p.k_stride[0] + sqn.k0() * p.k_stride[1] + kvh * p.k_stride[2];
    const float* vbase = v + sqn.k_batch() * p.v_stride[0] + sqn.k0() * p.v_stride[1] + kvh * p.v_stride[2];

    // ---- K/V tile j as fp32 into the landing rows (16 bytes per copy, zero-filled past the end)
    // (a thread's chunks are rows r0, r0 + RSTEP, .. at one column where CH divides
    // the threads: its addresses then step by a row each, not one division each)
    constexpr bool ROWS_STEP = NTHREADS % CH == 0;
    constexpr int RSTEP = ROWS_STEP ? NTHREADS / CH : 1;
    auto load_kv = [&](int j) {
#pragma unroll
        for (int i = 0; i < (BLOCK_N * CH + NTHREADS - 1) / NTHREADS; ++i) {
            const int c = tid + i * NTHREADS;
            const int r = ROWS_STEP ? tid / CH + i * RSTEP : c / CH, ch = ROWS_STEP ? tid % CH : c % CH;
            if ((BLOCK_N * CH) % NTHREADS == 0 || c < BLOCK_N * CH) {
                const int key = j * BLOCK_N + r;
                const bool ok = key < seqlen_k;
                const unsigned dst = smem_addr(land) + (unsigned)c * 16u;
                cp_async_16(dst, ok ? kbase + sqn.kv_row(key, p.k_stride[0], p.k_stride[1]) + ch * 4 : k, ok);
                cp_async_16(dst + BLOCK_N * D * 4, ok ? vbase + sqn.kv_row(key, p.v_stride[0], p.v_stride[1]) + ch * 4 : v, ok);
            }
        }
    };
    if (num_n > j_first) load_kv(j_first);
    cp_async_commit();

    // ---- Q: its max, then its pairs (read twice by the threads; rows past the end are 0)
    auto q_chunk = [&](int c) {
        const int r = c / CH, ch = c % CH, pr = row0 + r;
        if (pr >= packed_rows) return make_float4(0.f, 0.f, 0.f, 0.f);
        const int t = pr / group, g = pr % group;
        return __ldg(reinterpret_cast<const float4*>(q + b * p.q_stride[0] + (index_t)(sqn.q0() + t) * p.q_stride[1] +
                                                     q_head_of(kvh, g, group) * p.q_stride[2] + ch * 4));
    };
    if (tid < 5) red[tid] = 0u;
    __syncthreads();
    {
        unsigned mk = 0u;
#pragma unroll 4
        for (int c = tid; c < BLOCK_M * CH; c += NTHREADS) mk = max_key(mk, q_chunk(c));
        mk = __reduce_max_sync(0xffffffffu, mk);
        if (lane == 0) atomicMax(red + 4, mk);
    }
    __syncthreads();
    const int eq = scale_exp(red[4]);
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
    const unsigned s_base = smem_addr(smem);
    const unsigned sQ_warp = s_base + L::Q_HI + (warp * 16 * ROWH + a_off) * 2;
    const unsigned sK_lane = s_base + L::K_HI + k_off * 2;
    const unsigned sV_lane = s_base + L::V_HI + a_off * 2;

    // the modifiers' view of the lane's rows (common.cuh: mods)
    const mods::Seq sq = mods::seq(b, sqn.seqlen_q(p.seqlen_q), seqlen_k);
    mods::Diag mrow[2];
    if constexpr (M::ANY) {
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
            const int pr = row0 + warp * 16 + g_lane + hf * 8;
            mrow[hf] = mods::diag<M>(mp, sq, pr / group, q_head_of(kvh, pr % group, group));
        }
    }

    for (int j = j_first; j < num_n; ++j) {
        const int par = 2 * (j & 1);
        cp_async_wait<0>();  // tile j landed for this thread
        __syncthreads();     // ... for all threads; every warp is done with the pairs of tile j - 1

        // ---- the tile's maxima, then its pairs (each element once per CTA) ----------
        {
            unsigned mk = 0u, mv = 0u;
#pragma unroll 2
            for (int i = 0; i < (BLOCK_N * CH + NTHREADS - 1) / NTHREADS; ++i) {
                const int c = tid + i * NTHREADS;
                if ((BLOCK_N * CH) % NTHREADS == 0 || c < BLOCK_N * CH) {
                    mk = max_key(mk, reinterpret_cast<const float4*>(land)[c]);
                    mv = max_key(mv, reinterpret_cast<const float4*>(land + BLOCK_N * D)[c]);
                }
            }
            mk = __reduce_max_sync(0xffffffffu, mk);
            mv = __reduce_max_sync(0xffffffffu, mv);
            if (lane == 0) {
                atomicMax(red + par, mk);
                atomicMax(red + par + 1, mv);
            }
        }
        __syncthreads();
        const int ek = scale_exp(red[par]);
        {
            const int ev = scale_exp(red[par + 1]);
            if (ev < cv) {  // a larger V than any before: O to the new scale (CTA-uniform)
                const float f = ev - cv >= -126 ? pow2(ev - cv) : 0.f;
#pragma unroll
                for (int dt = 0; dt < DT; ++dt)
#pragma unroll
                    for (int e = 0; e < 4; ++e) o_acc[dt][e] *= f;
                cv = ev;
            }
            const float sk = pow2(ek), sv = pow2(cv);
#pragma unroll 2
            for (int i = 0; i < (BLOCK_N * CH + NTHREADS - 1) / NTHREADS; ++i) {
                const int c = tid + i * NTHREADS;
                if ((BLOCK_N * CH) % NTHREADS == 0 || c < BLOCK_N * CH) {
                    const int off = ((c / CH) * ROWH + (c % CH) * 4) * 2;
                    float4 y = reinterpret_cast<const float4*>(land)[c];
                    y.x *= sk, y.y *= sk, y.z *= sk, y.w *= sk;
                    uint2 hi, lo;
                    to_pair(y, hi, lo);
                    *reinterpret_cast<uint2*>(smem + L::K_HI + off) = hi;
                    *reinterpret_cast<uint2*>(smem + L::K_LO + off) = lo;
                    y = reinterpret_cast<const float4*>(land + BLOCK_N * D)[c];
                    y.x *= sv, y.y *= sv, y.z *= sv, y.w *= sv;
                    to_pair(y, hi, lo);
                    *reinterpret_cast<uint2*>(smem + L::V_HI + off) = hi;
                    *reinterpret_cast<uint2*>(smem + L::V_LO + off) = lo;
                }
            }
        }
        __syncthreads();  // the pairs are complete; the landing rows are free
        if (tid == 0) red[par] = red[par + 1] = 0u;  // for tile j + 2 (every thread has read them)
        if (j + 1 < num_n) load_kv(j + 1);
        cp_async_commit();

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
                    ldmatrix_x4(kl, at + (L::K_LO - L::K_HI));
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
        const float scale_j = fmaxf((float)p.scale_log2 * q_unscale * pow2(-ek), 1.17549435e-38f);
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
                ldmatrix_x4_trans(vl, at + (L::V_LO - L::V_HI));
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

// SMEM_BYTES: the dynamic shared memory the launch passes (cupy_gqa/_specs.py:
// tiled_f16x2_smem), checked against the layout at compile time.
template <int HEAD_DIM, int BLOCK_M, int BLOCK_N, int NUM_WARPS, bool CAUSAL, int SMEM_BYTES>
__global__ void __launch_bounds__(NUM_WARPS * 32, 1) tiled_f16x2_attention(
    const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,
    float* __restrict__ out, float* __restrict__ lse, const int* __restrict__ seqlens_k, const AttnParams p)
{
    tiled_f16x2_body<HEAD_DIM, BLOCK_M, BLOCK_N, NUM_WARPS, CAUSAL, SMEM_BYTES, NoMods>(
        q, k, v, out, lse, seqlens_k, p, ModParams{});
}

// The same with the modifiers FLAGS (common.cuh: MOD_*), whose values are in mp.
template <int HEAD_DIM, int BLOCK_M, int BLOCK_N, int NUM_WARPS, bool CAUSAL, int SMEM_BYTES, int FLAGS>
__global__ void __launch_bounds__(NUM_WARPS * 32, 1) tiled_f16x2_attention_mods(
    const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,
    float* __restrict__ out, float* __restrict__ lse, const int* __restrict__ seqlens_k, const AttnParams p,
    const ModParams mp)
{
    tiled_f16x2_body<HEAD_DIM, BLOCK_M, BLOCK_N, NUM_WARPS, CAUSAL, SMEM_BYTES, Mods<FLAGS>>(
        q, k, v, out, lse, seqlens_k, p, mp);
}

// The same with per-sequence addressing ADDR (common.cuh: SEQ_*: varlen, paged
// K/V, left padding), described by sp.
template <int HEAD_DIM, int BLOCK_M, int BLOCK_N, int NUM_WARPS, bool CAUSAL, int SMEM_BYTES, int ADDR>
__global__ void __launch_bounds__(NUM_WARPS * 32, 1) tiled_f16x2_attention_seq(
    const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,
    float* __restrict__ out, float* __restrict__ lse, const int* __restrict__ seqlens_k, const AttnParams p,
    const SeqParams sp)
{
    tiled_f16x2_body<HEAD_DIM, BLOCK_M, BLOCK_N, NUM_WARPS, CAUSAL, SMEM_BYTES, NoMods, ADDR>(
        q, k, v, out, lse, seqlens_k, p, ModParams{}, &sp);
}
