/*
 * tiled_tf32.cu -- tensor-core prefill kernel for float32 grouped-query
 * attention, through TF32 mma.sync, at full fp32 accuracy (split TF32).
 *
 * Precision: split TF32 (kernels/tf32.cuh): each fp32 operand is a TF32 big
 * part plus a TF32 small part, each product three TF32 products; fp32-class
 * error at tensor-core rates. SPLIT = false keeps only big*big: plain TF32,
 * ~1e-3 relative error.
 *
 * Algorithm and grid (as kernels/tiled.cu, FlashAttention-2 style)
 * -----------------------------------------------------------------------------
 * GQA packing: for one (batch b, kv head kvh) the G = group_size query heads
 * that share it are packed into rows r = t*G + g (t = query position). A CTA
 * owns BLOCK_M = 16 * NUM_WARPS consecutive packed rows of one (b, kvh); warp w
 * owns rows [16w, 16w + 16). 1-D grid of num_m_tiles * batch * num_kv_heads
 * CTAs; causal: m_tile slowest and reversed (heavy, late tiles first);
 * non-causal: (b, kvh) slowest so its K/V stays in L2.
 *   load Q tile (cp.async)
 *   for each K/V tile j of BLOCK_N keys that some row sees (double buffered,
 *   tile j+1 in flight while j is used):
 *       S  = Q K_j^T                   (m16n8k8 TF32 mma, x3 when SPLIT)
 *       mask S on tiles that cross the causal diagonal or the end of the keys
 *       m' = max(m, rowmax(S) * scale_log2);  P = exp2(S * scale_log2 - m')
 *       l  = l * exp2(m - m') + rowsum(P);  O = O * exp2(m - m') + P V_j
 *   out = O / l, lse = (m + log2 l) * ln 2  (no visible key: 0 and -inf)
 * The softmax rules (mask, update, end of a row) are kernels/softmax.cuh's;
 * the scale (> 0) is applied inside its exp2 (exp2f), m raised at every tile.
 *
 * Fragments (m16n8k8; layouts in kernels/tf32.cuh)
 * -----------------------------------------------------------------------------
 * Q (A) and K (B of Q K^T, K rows are its columns) come from shared memory
 * through ldmatrix. P V takes P from the S accumulator as A (tf32.cuh:
 * frag_a, key 2c as k = c and key 2c+1 as k = c+4), so V's B fragment is
 * b0 = V[2c][g], b1 = V[2c+1][g] (scalar shared loads).
 *
 * Where the split happens (PRESPLIT)
 * -----------------------------------------------------------------------------
 * Every warp reads every K and V element of a tile, and Q at every tile, so
 * splitting in registers at each use repeats the same cvt/sub/cvt work
 * NUM_WARPS times per K/V element and num_n times per Q element.
 *   0: split in registers at each use (always for SPLIT = false).
 *   1: each K and V tile is split once per CTA right after it lands: big parts
 *      in place, small parts in a single-buffered side tile; Q as in 0.
 *   2: as 1, and the Q tile too, once, at the first K/V tile.
 * The side tiles cost shared memory (and so CTAs per SM): the table in
 * cupy_gqa/_specs.py picks the mode per head dim.
 *
 * Shared memory (tf32_detail::Smem is the one definition, and the SMEM_BYTES
 * template argument, the size the launch passes, must equal its BYTES): rows
 * of D + 4 floats (row stride = 16 bytes mod 128), so the 8 rows of an
 * ldmatrix and the 32 scalar V loads hit distinct banks:
 *   [ Q tile | K stage 0 | K stage 1 | V stage 0 | V stage 1
 *     | K small | V small (PRESPLIT >= 1) | Q small (PRESPLIT == 2) ]
 *   bytes = (BLOCK_M + 4 * BLOCK_N + (PRESPLIT >= 1) * 2 * BLOCK_N
 *            + (PRESPLIT == 2) * BLOCK_M) * (D + 4) * 4
 *
 * Requirements (checked by the Python layer): head_dim stride 1, 16-byte
 * aligned rows, scale_log2 > 0.
 */
#include "common.cuh"
#include "softmax.cuh"
#include "tf32.cuh"
#include "tiled_f32.cuh"

namespace tf32_detail {

// The shared-memory layout (see the top): offsets in floats.
template <int HEAD_DIM, int BLOCK_M, int BLOCK_N, int PRESPLIT>
struct Smem {
    enum : int {
        ROW = HEAD_DIM + 4,        // padded row
        STAGE = BLOCK_N * ROW,     // one K (or V) tile
        Q = 0,                     // [BLOCK_M][ROW]
        K = Q + BLOCK_M * ROW,     // [2][BLOCK_N][ROW]
        V = K + 2 * STAGE,         // [2][BLOCK_N][ROW]
        K_SMALL = V + 2 * STAGE,   // [BLOCK_N][ROW], PRESPLIT >= 1
        V_SMALL = K_SMALL + STAGE, // [BLOCK_N][ROW], PRESPLIT >= 1
        Q_SMALL = V_SMALL + STAGE, // [BLOCK_M][ROW], PRESPLIT == 2
        END = PRESPLIT == 2 ? Q_SMALL + BLOCK_M * ROW : PRESPLIT == 1 ? Q_SMALL : K_SMALL,
        BYTES = END * (int)sizeof(float),
    };
};

}  // namespace tf32_detail

// The kernel's body, for the kernel without modifiers (M = NoMods) and the one
// with them (tiled_tf32_attention_mods, common.cuh: modifiers). ADDR: the
// per-sequence addressing (common.cuh: Sequence; 0: contiguous) of sp.
template <int HEAD_DIM, int BLOCK_M, int BLOCK_N, int NUM_WARPS, bool CAUSAL, bool SPLIT, int PRESPLIT, int SMEM_BYTES, class M,
          int ADDR = 0>
__device__ __forceinline__ void tiled_tf32_body(
    const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,
    float* __restrict__ out, float* __restrict__ lse, const int* __restrict__ seqlens_k, const AttnParams& p,
    const ModParams& mp, const SeqParams* sp = nullptr)
{
    using namespace tf32_detail;
    constexpr int D = HEAD_DIM;
    constexpr int NTHREADS = NUM_WARPS * 32;
    using L = Smem<HEAD_DIM, BLOCK_M, BLOCK_N, PRESPLIT>;
    constexpr int ROW = L::ROW;            // padded shared-memory row, floats
    constexpr int KD = D / 8;              // k8 steps of Q K^T
    constexpr int NT = BLOCK_N / 8;        // n8 tiles of S (= k8 steps of P V)
    constexpr int DT = D / 8;              // n8 tiles of O
    constexpr int CH = D / 4;              // 16-byte chunks per row
    static_assert(BLOCK_M == 16 * NUM_WARPS, "16 rows per warp");
    static_assert(D % 32 == 0 && BLOCK_N % 16 == 0, "tile shapes");
    static_assert(PRESPLIT >= 0 && PRESPLIT <= 2 && (SPLIT || PRESPLIT == 0), "PRESPLIT: 0, 1 or 2, with SPLIT");
    static_assert(SMEM_BYTES == L::BYTES, "SMEM_BYTES is not the size of the shared-memory layout");
    const float NEG_INF = neg_inf<float>();
    const float scale_log2 = (float)p.scale_log2;

    extern __shared__ __align__(16) unsigned char smem_raw[];
    float* sQ = reinterpret_cast<float*>(smem_raw) + L::Q;
    float* sK = reinterpret_cast<float*>(smem_raw) + L::K;  // [2][BLOCK_N][ROW]
    float* sV = reinterpret_cast<float*>(smem_raw) + L::V;  // [2][BLOCK_N][ROW]
    // PRESPLIT >= 1: the small parts of the current K and V tiles; 2: and of Q
    // (the big parts overwrite the raw values in place)
    float* sKsm = reinterpret_cast<float*>(smem_raw) + L::K_SMALL;
    float* sVsm = reinterpret_cast<float*>(smem_raw) + L::V_SMALL;
    float* sQsm = reinterpret_cast<float*>(smem_raw) + L::Q_SMALL;

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g_lane = lane >> 2, c_lane = lane & 3;

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

    // ---- asynchronous loads (16 bytes per thread and copy, zero-filled past the end)
#pragma unroll
    for (int i = 0; i < (BLOCK_M * CH + NTHREADS - 1) / NTHREADS; ++i) {
        const int c = tid + i * NTHREADS, r = c / CH, ch = c % CH;
        if ((BLOCK_M * CH) % NTHREADS == 0 || c < BLOCK_M * CH) {
            const int pr = row0 + r, t = pr / group, g = pr % group;
            const bool ok = pr < packed_rows;
            const float* src = q + b * p.q_stride[0] + (index_t)(sqn.q0() + t) * p.q_stride[1]
                               + q_head_of(kvh, g, group) * p.q_stride[2] + ch * 4;
            cp_async_16(smem_addr(sQ + r * ROW + ch * 4), ok ? src : q, ok);
        }
    }
    auto load_kv = [&](int j, int stage) {
#pragma unroll
        for (int i = 0; i < (BLOCK_N * CH + NTHREADS - 1) / NTHREADS; ++i) {
            const int c = tid + i * NTHREADS, r = c / CH, ch = c % CH;
            if ((BLOCK_N * CH) % NTHREADS == 0 || c < BLOCK_N * CH) {
                const int key = j * BLOCK_N + r;
                const bool ok = key < seqlen_k;
                const int dst = (stage * BLOCK_N + r) * ROW + ch * 4;
                cp_async_16(smem_addr(sK + dst), ok ? kbase + sqn.kv_row(key, p.k_stride[0], p.k_stride[1]) + ch * 4 : k, ok);
                cp_async_16(smem_addr(sV + dst), ok ? vbase + sqn.kv_row(key, p.v_stride[0], p.v_stride[1]) + ch * 4 : v, ok);
            }
        }
    };
    if (num_n > j_first) load_kv(j_first, j_first & 1);
    cp_async_commit();  // group 0: Q and K/V tile 0 (j_first)

    // ---- per-thread state: rows g_lane and g_lane + 8 of the warp's 16 ----------
    float o_acc[DT][4];
#pragma unroll
    for (int dt = 0; dt < DT; ++dt)
#pragma unroll
        for (int e = 0; e < 4; ++e) o_acc[dt][e] = 0.f;
    float m_run[2] = {NEG_INF, NEG_INF}, l_run[2] = {0.f, 0.f};  // log2-domain max, partial sums

    // ldmatrix row addresses: Q {rows 0-7, k 0-3}, {rows 8-15, k 0-3}, {rows 0-7, k 4-7}, {rows 8-15, k 4-7};
    // K {keys 0-7, d 0-3}, {keys 0-7, d 4-7}, {keys 8-15, d 0-3}, {keys 8-15, d 4-7}
    const unsigned sQ_lane = smem_addr(sQ + (warp * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * ROW + (lane >> 4) * 4);
    const int k_off = ((lane & 7) + (lane >> 4) * 8) * ROW + ((lane >> 3) & 1) * 4;

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
        const int stage = j & 1;
        cp_async_wait<0>();  // tile j (and Q) landed for this thread
        __syncthreads();     // ... for all threads; the other stage is free again
        if (j + 1 < num_n) load_kv(j + 1, stage ^ 1);
        cp_async_commit();
        float* sKs = sK + stage * BLOCK_N * ROW;
        float* sVs = sV + stage * BLOCK_N * ROW;
        if (PRESPLIT >= 1) {  // big parts in place, small parts beside (each element once per CTA)
            if (PRESPLIT == 2 && j == j_first) {  // the first tile this CTA reads (a window may skip some)
#pragma unroll
                for (int i = 0; i < (BLOCK_M * CH + NTHREADS - 1) / NTHREADS; ++i) {
                    const int c = tid + i * NTHREADS, r = c / CH, ch = c % CH;
                    if ((BLOCK_M * CH) % NTHREADS == 0 || c < BLOCK_M * CH)
                        split_chunk_in_place(sQ + r * ROW + ch * 4, sQsm + r * ROW + ch * 4);
                }
            }
#pragma unroll
            for (int i = 0; i < (BLOCK_N * CH + NTHREADS - 1) / NTHREADS; ++i) {
                const int c = tid + i * NTHREADS, r = c / CH, ch = c % CH;
                if ((BLOCK_N * CH) % NTHREADS == 0 || c < BLOCK_N * CH) {
                    split_chunk_in_place(sKs + r * ROW + ch * 4, sKsm + r * ROW + ch * 4);
                    split_chunk_in_place(sVs + r * ROW + ch * 4, sVsm + r * ROW + ch * 4);
                }
            }
            __syncthreads();
        }

        // ---- S = Q K^T --------------------------------------------------------------
        // Each group of KG k-steps goes into a fresh accumulator, and the groups
        // are summed in IEEE fp32 (tf32.cuh: the mma's adds truncate).
        float s[NT][4] = {};
#pragma unroll
        for (int kg = 0; kg < KD; kg += KG) {
            float part[NT][4] = {};
#pragma unroll
            for (int kd = kg; kd < kg + KG && kd < KD; ++kd) {
                unsigned qa[4], qb[4], qs[4];
                if (PRESPLIT == 2) {
                    ldmatrix_x4(qb, sQ_lane + kd * 8 * 4);
                    ldmatrix_x4(qs, sQ_lane + (L::Q_SMALL - L::Q) * 4 + kd * 8 * 4);  // the same lane's sQsm
                } else {
                    ldmatrix_x4(qa, sQ_lane + kd * 8 * 4);
#pragma unroll
                    for (int e = 0; e < 4; ++e) split<SPLIT>(__uint_as_float(qa[e]), qb[e], qs[e]);
                }
#pragma unroll
                for (int np = 0; np < NT / 2; ++np) {
                    unsigned kr[4], kb[4], ks[4];
                    if (PRESPLIT >= 1) {
                        ldmatrix_x4(kb, smem_addr(sKs + k_off + np * 16 * ROW + kd * 8));
                        ldmatrix_x4(ks, smem_addr(sKsm + k_off + np * 16 * ROW + kd * 8));
                    } else {
                        ldmatrix_x4(kr, smem_addr(sKs + k_off + np * 16 * ROW + kd * 8));
#pragma unroll
                        for (int e = 0; e < 4; ++e) split<SPLIT>(__uint_as_float(kr[e]), kb[e], ks[e]);
                    }
                    mma_f32<SPLIT>(part[2 * np], qb, qs, kb[0], kb[1], ks[0], ks[1]);
                    mma_f32<SPLIT>(part[2 * np + 1], qb, qs, kb[2], kb[3], ks[2], ks[3]);
                }
            }
#pragma unroll
            for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) s[nt][e] += part[nt][e];
        }

        // ---- mask or modifiers, online softmax (eager, the scale inside the exp2) --
        f32_tiled::tile_update<M, CAUSAL, BLOCK_N>(s, o_acc, m_run, l_run, j * BLOCK_N, row0 + warp * 16 + g_lane, lane,
                                                   keys, mp, sq, mrow, scale_log2);

        // ---- O += P V: key 2c is k = c, key 2c+1 is k = c+4 ----------------------
        // (each n8 tile of O gets this K/V tile's product in a fresh accumulator,
        // added in IEEE fp32: no truncation drift over long rows)
        unsigned pb[NT][4], ps[NT][4];
#pragma unroll
        for (int kk = 0; kk < NT; ++kk) frag_a<SPLIT>(s[kk], pb[kk], ps[kk]);
        const float* v_lane = sVs + 2 * c_lane * ROW + g_lane;
        const float* vsm_lane = sVsm + 2 * c_lane * ROW + g_lane;
#pragma unroll
        for (int dt = 0; dt < DT; ++dt) {
            float part[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
            for (int kk = 0; kk < NT; ++kk) {
                unsigned vb0, vs0, vb1, vs1;
                if (PRESPLIT >= 1) {
                    vb0 = __float_as_uint(v_lane[kk * 8 * ROW + dt * 8]);
                    vb1 = __float_as_uint(v_lane[(kk * 8 + 1) * ROW + dt * 8]);
                    vs0 = __float_as_uint(vsm_lane[kk * 8 * ROW + dt * 8]);
                    vs1 = __float_as_uint(vsm_lane[(kk * 8 + 1) * ROW + dt * 8]);
                } else {
                    split<SPLIT>(v_lane[kk * 8 * ROW + dt * 8], vb0, vs0);
                    split<SPLIT>(v_lane[(kk * 8 + 1) * ROW + dt * 8], vb1, vs1);
                }
                mma_f32<SPLIT>(part, pb[kk], ps[kk], vb0, vb1, vs0, vs1);
            }
#pragma unroll
            for (int e = 0; e < 4; ++e) o_acc[dt][e] += part[e];
        }
    }
    cp_async_wait<0>();  // nothing left in flight (also when num_n == 0)
    __syncthreads();     // every warp is done with sQ before it is overwritten

    // ---- epilogue: O / l into the warp's own Q rows, then 16-byte stores --------
    f32_tiled::store_rows<M, D, ROW>(sQ + warp * 16 * ROW, o_acc, l_run, m_run, 1.f, [](float x) { return x; }, out, lse,
                                     p, mp, sqn, b, kvh, group, row0 + warp * 16, packed_rows, len, lane);
}

// SMEM_BYTES: the dynamic shared memory the launch passes (cupy_gqa/_specs.py:
// tiled_f32_smem), checked against the layout at compile time.
template <int HEAD_DIM, int BLOCK_M, int BLOCK_N, int NUM_WARPS, bool CAUSAL, bool SPLIT, int PRESPLIT, int SMEM_BYTES>
__global__ void __launch_bounds__(NUM_WARPS * 32, 1) tiled_tf32_attention(
    const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,
    float* __restrict__ out, float* __restrict__ lse, const int* __restrict__ seqlens_k, const AttnParams p)
{
    tiled_tf32_body<HEAD_DIM, BLOCK_M, BLOCK_N, NUM_WARPS, CAUSAL, SPLIT, PRESPLIT, SMEM_BYTES, NoMods>(
        q, k, v, out, lse, seqlens_k, p, ModParams{});
}

// The same with the modifiers FLAGS (common.cuh: MOD_*), whose values are in mp.
template <int HEAD_DIM, int BLOCK_M, int BLOCK_N, int NUM_WARPS, bool CAUSAL, bool SPLIT, int PRESPLIT, int SMEM_BYTES,
          int FLAGS>
__global__ void __launch_bounds__(NUM_WARPS * 32, 1) tiled_tf32_attention_mods(
    const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,
    float* __restrict__ out, float* __restrict__ lse, const int* __restrict__ seqlens_k, const AttnParams p,
    const ModParams mp)
{
    tiled_tf32_body<HEAD_DIM, BLOCK_M, BLOCK_N, NUM_WARPS, CAUSAL, SPLIT, PRESPLIT, SMEM_BYTES, Mods<FLAGS>>(
        q, k, v, out, lse, seqlens_k, p, mp);
}

// The same with per-sequence addressing ADDR (common.cuh: SEQ_*: varlen, paged
// K/V, left padding), described by sp.
template <int HEAD_DIM, int BLOCK_M, int BLOCK_N, int NUM_WARPS, bool CAUSAL, bool SPLIT, int PRESPLIT, int SMEM_BYTES,
          int ADDR>
__global__ void __launch_bounds__(NUM_WARPS * 32, 1) tiled_tf32_attention_seq(
    const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,
    float* __restrict__ out, float* __restrict__ lse, const int* __restrict__ seqlens_k, const AttnParams p,
    const SeqParams sp)
{
    tiled_tf32_body<HEAD_DIM, BLOCK_M, BLOCK_N, NUM_WARPS, CAUSAL, SPLIT, PRESPLIT, SMEM_BYTES, NoMods, ADDR>(
        q, k, v, out, lse, seqlens_k, p, ModParams{}, &sp);
}

// The same with per-sequence addressing ADDR and the modifiers FLAGS.
template <int HEAD_DIM, int BLOCK_M, int BLOCK_N, int NUM_WARPS, bool CAUSAL, bool SPLIT, int PRESPLIT, int SMEM_BYTES,
          int ADDR, int FLAGS>
__global__ void __launch_bounds__(NUM_WARPS * 32, 1) tiled_tf32_attention_seq_mods(
    const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,
    float* __restrict__ out, float* __restrict__ lse, const int* __restrict__ seqlens_k, const AttnParams p,
    const ModParams mp, const SeqParams sp)
{
    tiled_tf32_body<HEAD_DIM, BLOCK_M, BLOCK_N, NUM_WARPS, CAUSAL, SPLIT, PRESPLIT, SMEM_BYTES, Mods<FLAGS>, ADDR>(
        q, k, v, out, lse, seqlens_k, p, mp, &sp);
}
