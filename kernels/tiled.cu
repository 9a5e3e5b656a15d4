/*
 * tiled.cu -- tensor-core prefill kernel for causal / non-causal grouped-query
 * attention, fp16 and bf16, compiled at runtime by NVRTC (sm_80 and newer).
 *
 * Algorithm (FlashAttention-2 style, written from scratch for this project)
 * -----------------------------------------------------------------------------
 * GQA packing.  Let G = num_q_heads / num_kv_heads.  For one (batch b, kv head
 * kvh) the G query heads h = kvh*G + g that share that KV head are packed into
 * one long row space:  packed row r = t*G + g  (t = query position), r in
 * [0, seqlen_q*G).  A CTA owns BLOCK_M consecutive packed rows of one (b, kvh),
 * so every K/V tile it streams through shared memory serves G heads at once.
 *
 * Grid (1-D).  gridDim.x = num_m_tiles * batch * num_kv_heads with
 * num_m_tiles = ceil(seqlen_q*G / BLOCK_M).
 *   causal:      m_tile slowest-varying and reversed, so the heavy (late query)
 *                tiles of every (b, kvh) are launched first:
 *                  m_tile = num_m_tiles-1 - blockIdx.x / (batch*num_kv_heads)
 *                  bh     = blockIdx.x % (batch*num_kv_heads)
 *   non-causal:  bh slowest (all tiles of one (b, kvh) run together, so its
 *                K/V stays hot in L2):
 *                  bh = blockIdx.x / num_m_tiles, m_tile = blockIdx.x % num_m_tiles
 *   b = bh / num_kv_heads, kvh = bh % num_kv_heads.
 * Block: NUM_WARPS warps.  Warp w owns packed rows [w*WR, (w+1)*WR) of the
 * tile, WR = BLOCK_M / NUM_WARPS = 16*MT (MT = 1 or 2 m16 row blocks).
 *
 * Per CTA:
 *   load Q tile (BLOCK_M x D) to smem (cp.async, zero-filled past the end)
 *   for each KV tile j (BLOCK_N keys) that some row can see:
 *       K_j, V_j arrive in smem (cp.async, double buffered: tile j+1 is in
 *       flight while tile j is computed)
 *       S   = Q K_j^T                 (mma.sync m16n8k16, fp32 accumulate)
 *       mask S (only tiles that cross the causal diagonal / seqlen_k end)
 *       m'  = max(m, rowmax(S)*scale_log2)
 *       P   = exp2(S*scale_log2 - m')                 (registers, fp32)
 *       l   = l*exp2(m - m') + rowsum(P);  O = O*exp2(m - m')
 *       O  += P V_j                       (P converted to T in registers and
 *                                          used directly as the A operand)
 *   out = O / l;  lse = (m + log2 l) * ln2   (rows that see no key: out = 0,
 *                                             lse = -inf)
 * The softmax rules (mask, update with a lazy rescale, end of a row) are
 * kernels/softmax.cuh's; the scale (> 0) is applied inside its exp2.
 *
 * Shared memory (dynamic; tiled_detail::Smem is the one definition, and the
 * SMEM_BYTES template argument, the size the launch passes, must equal its
 * BYTES).  Rows are padded by 8 elements (16 bytes) so that the 8 row
 * addresses of every ldmatrix land in distinct bank groups:
 *   row = HEAD_DIM + 8 elements
 *   bytes = (BLOCK_M + 4*BLOCK_N) * (HEAD_DIM + 8) * sizeof(T)
 *           [ Q tile | K stage 0 | K stage 1 | V stage 0 | V stage 1 ]
 *   e.g. bf16, D128, BLOCK_M 128, BLOCK_N 64: (128+256)*136*2 = 104448 bytes.
 *
 * Requirements (guaranteed by the Python layer): head_dim stride 1, every
 * pointer 16-byte aligned, every stride a multiple of 8 elements,
 * scale_log2 > 0, num_q_heads % num_kv_heads == 0.
 */
#include "common.cuh"
#include "softmax.cuh"

namespace tiled_detail {

#define TILED_NEG_INF (__uint_as_float(0xff800000u))

// Packed row r of a CTA that owns kv head kvh is query position r / group of
// query head q_head_of(kvh, r % group) (common.cuh: the one GQA mapping).

// Constants are enumerators: NVRTC would emit a namespace-scope constexpr
// variable as an (unused) global in every cubin.
enum : int {
    // Lazy rescaling: the running max m is only raised when some row of the
    // warp sees a score more than RESCALE_THRESHOLD (log2 units) above it; until
    // then P = exp2(S*scale - m) <= 2^threshold (fine in fp16/bf16 and fp32 l,
    // O) and the O *= exp2(m_old - m_new) pass is skipped.
    RESCALE_THRESHOLD = 8,
    // Registers: 8-warp tiles (16 rows per warp) are capped at 128 registers so
    // that two CTAs fit on an SM; 4-warp tiles may use up to 255.
    MIN_BLOCKS_8W = 2,
};

// The shared-memory layout (see the top): offsets in elements of T.
template <typename T, int HEAD_DIM, int BLOCK_M, int BLOCK_N>
struct Smem {
    enum : int {
        ROW = HEAD_DIM + 8,        // padded row
        STAGE = BLOCK_N * ROW,     // one K (or V) tile
        Q = 0,                     // [BLOCK_M][ROW]
        K = Q + BLOCK_M * ROW,     // [2][BLOCK_N][ROW]
        V = K + 2 * STAGE,         // [2][BLOCK_N][ROW]
        END = V + 2 * STAGE,
        BYTES = END * (int)sizeof(T),
    };
};

}  // namespace tiled_detail

// The kernel's body, for the kernel without modifiers (M = NoMods) and the one
// with them (tiled_attention_mods, common.cuh: modifiers). ADDR: the
// per-sequence addressing (common.cuh: Sequence; 0: contiguous) of sp.
template <typename T, int HEAD_DIM, int BLOCK_M, int BLOCK_N, int NUM_WARPS, bool CAUSAL, int SMEM_BYTES, class M,
          int ADDR = 0>
__device__ __forceinline__ void tiled_body(
    const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
    T* __restrict__ out,
    float* __restrict__ lse,
    const int* __restrict__ seqlens_k,
    const AttnParams& p, const ModParams& mp, const SeqParams* sp = nullptr)
{
    const int batch = p.batch, seqlen_q = p.seqlen_q;
    const int num_q_heads = p.num_q_heads, num_kv_heads = p.num_kv_heads;
    const long long q_stride_b = p.q_stride[0], q_stride_s = p.q_stride[1], q_stride_h = p.q_stride[2];
    const long long k_stride_b = p.k_stride[0], k_stride_s = p.k_stride[1], k_stride_h = p.k_stride[2];
    const long long v_stride_b = p.v_stride[0], v_stride_s = p.v_stride[1], v_stride_h = p.v_stride[2];
    const long long o_stride_b = p.o_stride[0], o_stride_s = p.o_stride[1], o_stride_h = p.o_stride[2];
    const float scale_log2 = (float)p.scale_log2;
    using namespace tiled_detail;
    constexpr int D = HEAD_DIM;
    constexpr int NTHREADS = NUM_WARPS * 32;
    using L = Smem<T, HEAD_DIM, BLOCK_M, BLOCK_N>;
    constexpr int ROW = L::ROW;                // padded smem row, elements
    constexpr int WR = BLOCK_M / NUM_WARPS;    // rows per warp
    constexpr int MT = WR / 16;                // m16 blocks per warp
    constexpr int KD = D / 16;                 // k16 steps of Q K^T
    constexpr int NT = BLOCK_N / 8;            // n8 tiles of S
    constexpr int DT = D / 8;                  // n8 tiles of O
    constexpr int CH = D / 8;                  // 16-byte chunks per row
    static_assert(D % 16 == 0 && BLOCK_N % 16 == 0, "tile shapes");
    static_assert(WR % 16 == 0 && MT >= 1 && MT <= 2, "16 or 32 rows per warp");
    static_assert(sizeof(T) == 2, "fp16 / bf16 only");
    static_assert(SMEM_BYTES == L::BYTES, "SMEM_BYTES is not the size of the shared-memory layout");

    extern __shared__ __align__(16) unsigned char smem_raw[];
    T* sQ = reinterpret_cast<T*>(smem_raw) + L::Q;
    T* sK = reinterpret_cast<T*>(smem_raw) + L::K;
    T* sV = reinterpret_cast<T*>(smem_raw) + L::V;

    const int tid = threadIdx.x;
    const int lane = tid & 31;
    const int warp = tid >> 5;

    // ---- this CTA's (b, kv head, rows) and keys (common.cuh) ---------------
    Sequence<ADDR> sqn;  // the CTA's sequence: where its queries and keys are
    const PrefillTile<CAUSAL, M::WINDOW> tile = prefill_tile_seq<CAUSAL, BLOCK_M, M::WINDOW, ADDR>(
        p, seqlens_k, sp, num_q_heads / num_kv_heads, mp.window_left, mp.window_right, sqn, blockIdx.x);
    if constexpr (ADDR != 0) {
        if (tile.row0 >= tile.packed_rows) return;  // past its sequence's rows (the whole CTA)
    }
    const int b = tile.b, kvh = tile.kv_head, row0 = tile.row0, group = tile.group, packed_rows = tile.packed_rows;
    const int len = tile.len, seqlen_k = tile.seqlen_k;  // valid keys of this sequence; len -1: bad, NaN rows
    const KeyRange<CAUSAL, M::WINDOW>& keys = tile.keys;
    const int num_n = (keys.end + BLOCK_N - 1) / BLOCK_N;
    const int j_first = M::WINDOW ? keys.start / BLOCK_N : 0;  // tiles before the window's band are skipped

    const T* kbase = k + (long long)sqn.k_batch() * k_stride_b + (long long)sqn.k0() * k_stride_s + (long long)kvh * k_stride_h;
    const T* vbase = v + (long long)sqn.k_batch() * v_stride_b + (long long)sqn.k0() * v_stride_s + (long long)kvh * v_stride_h;

    // ---- async loads ---------------------------------------------------------
    {   // Q tile: packed row r -> (t, g); zero-filled past the end
        constexpr int TOTAL = BLOCK_M * CH;
#pragma unroll
        for (int i = 0; i < (TOTAL + NTHREADS - 1) / NTHREADS; ++i) {
            const int c = tid + i * NTHREADS;
            if (TOTAL % NTHREADS == 0 || c < TOTAL) {
                const int r = c / CH, ch = c - (c / CH) * CH;
                const int pr = row0 + r;
                const bool ok = pr < packed_rows;
                const int t = pr / group, g = pr - (pr / group) * group;
                const T* src = ok ? q + (long long)b * q_stride_b + (long long)(sqn.q0() + t) * q_stride_s
                                        + (long long)q_head_of(kvh, g, group) * q_stride_h + ch * 8
                                  : q;
                cp_async_16(smem_addr(sQ + r * ROW + ch * 8), src, ok);
            }
        }
    }
    // K/V tile loader.  Fast path (NTHREADS divisible by CH and BLOCK_N by
    // NTHREADS/CH): thread tid copies chunk tid % CH of rows tid / CH +
    // i * (NTHREADS / CH), with per-thread global pointers.  Otherwise (D 96)
    // chunk c = tid + i*NTHREADS is split into (row, chunk) each time.
    constexpr bool KV_FAST = (NTHREADS % CH == 0) && (BLOCK_N % (NTHREADS / CH) == 0);
    constexpr int KV_ROWS_PER_IT = KV_FAST ? NTHREADS / CH : 1;
    constexpr int KV_ITERS = KV_FAST ? BLOCK_N / KV_ROWS_PER_IT : (BLOCK_N * CH + NTHREADS - 1) / NTHREADS;
    const int kv_r = KV_FAST ? tid / CH : 0, kv_ch = KV_FAST ? tid - (tid / CH) * CH : 0;
    const T* k_thr = kbase + (long long)kv_r * k_stride_s + kv_ch * 8;
    const T* v_thr = vbase + (long long)kv_r * v_stride_s + kv_ch * 8;
    const unsigned sKV_thr = smem_addr(sK + kv_r * ROW + kv_ch * 8);
    constexpr unsigned KV_STAGE_BYTES = L::STAGE * sizeof(T);
    constexpr unsigned K_TO_V_BYTES = (L::V - L::K) * sizeof(T);  // a K stage's address -> its V stage's
    auto load_kv = [&](int j, int stage) {
        const int key0 = j * BLOCK_N + kv_r;
        const T* kp = k_thr + (long long)(j * BLOCK_N) * k_stride_s;
        const T* vp = v_thr + (long long)(j * BLOCK_N) * v_stride_s;
        const unsigned dK = sKV_thr + stage * KV_STAGE_BYTES;
#pragma unroll
        for (int i = 0; i < KV_ITERS; ++i) {
            if constexpr (KV_FAST && Sequence<ADDR>::PAGED) {  // each key row through the block table
                const int key = key0 + i * KV_ROWS_PER_IT;
                const bool ok = key < seqlen_k;
                const unsigned d = dK + i * KV_ROWS_PER_IT * ROW * 2;
                cp_async_16(d, ok ? (const void*)(kbase + sqn.kv_row(key, k_stride_b, k_stride_s) + kv_ch * 8) : (const void*)k, ok);
                cp_async_16(d + K_TO_V_BYTES,
                            ok ? (const void*)(vbase + sqn.kv_row(key, v_stride_b, v_stride_s) + kv_ch * 8) : (const void*)v, ok);
            } else if constexpr (KV_FAST) {
                const bool ok = key0 + i * KV_ROWS_PER_IT < seqlen_k;
                const unsigned d = dK + i * KV_ROWS_PER_IT * ROW * 2;
                cp_async_16(d, ok ? (const void*)(kp + (long long)i * KV_ROWS_PER_IT * k_stride_s) : (const void*)k, ok);
                cp_async_16(d + K_TO_V_BYTES, ok ? (const void*)(vp + (long long)i * KV_ROWS_PER_IT * v_stride_s) : (const void*)v, ok);
            } else {
                const int c = tid + i * NTHREADS;
                if (c < BLOCK_N * CH) {
                    const int r = c / CH, ch = c - (c / CH) * CH;
                    const bool ok = key0 + r < seqlen_k;
                    const unsigned d = dK + (r * ROW + ch * 8) * 2;
                    if constexpr (Sequence<ADDR>::PAGED) {
                        const int key = j * BLOCK_N + r;
                        cp_async_16(d, ok ? (const void*)(kbase + sqn.kv_row(key, k_stride_b, k_stride_s) + ch * 8) : (const void*)k, ok);
                        cp_async_16(d + K_TO_V_BYTES,
                                    ok ? (const void*)(vbase + sqn.kv_row(key, v_stride_b, v_stride_s) + ch * 8) : (const void*)v, ok);
                    } else {
                        cp_async_16(d, ok ? (const void*)(kp + (long long)r * k_stride_s + ch * 8) : (const void*)k, ok);
                        cp_async_16(d + K_TO_V_BYTES, ok ? (const void*)(vp + (long long)r * v_stride_s + ch * 8) : (const void*)v, ok);
                    }
                }
            }
        }
    };

    if (num_n > j_first) load_kv(j_first, j_first & 1);
    cp_async_commit();                         // group 0: Q and K/V tile 0 (j_first)

    // ---- per-thread row bookkeeping ------------------------------------------
    // Thread holds rows  lane/4 (+8) of each m16 block: hr = 2*mt + half.
    const int warp_row0 = warp * WR;
    float o_acc[MT][DT][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int dt = 0; dt < DT; ++dt)
#pragma unroll
            for (int e = 0; e < 4; ++e) o_acc[mt][dt][e] = 0.f;
    float m_run[MT][2], l_run[MT][2];          // running max (log2 domain), partial sum
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) { m_run[mt][hf] = TILED_NEG_INF; l_run[mt][hf] = 0.f; }

    // ldmatrix lane offsets (elements within a tile).
    //  A (Q) and B-trans (V): matrices {rows 0-7,k 0-7},{rows 8-15,k 0-7},{rows 0-7,k 8-15},{rows 8-15,k 8-15}
    //  B (K):                 matrices {keys 0-7,d 0-7},{keys 0-7,d 8-15},{keys 8-15,d 0-7},{keys 8-15,d 8-15}
    const int a_off = (((lane >> 3) & 1) * 8 + (lane & 7)) * ROW + (lane >> 4) * 8;
    const int k_off = ((lane >> 4) * 8 + (lane & 7)) * ROW + ((lane >> 3) & 1) * 8;
    const unsigned sQ_warp = smem_addr(sQ + warp_row0 * ROW + a_off);

    // the modifiers' view of the lane's rows (common.cuh: mods)
    const mods::Seq sq = mods::seq(b, sqn.seqlen_q(seqlen_q), seqlen_k);
    mods::Diag mrow[MT][2];
    if constexpr (M::ANY) {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int hf = 0; hf < 2; ++hf) {
                const int pr = row0 + warp_row0 + mt * 16 + (lane >> 2) + hf * 8;
                mrow[mt][hf] = mods::diag<M>(mp, sq, pr / group, q_head_of(kvh, pr % group, group));
            }
    }

    for (int j = j_first; j < num_n; ++j) {
        const int stage = j & 1;
        cp_async_wait<0>();                    // tile j (and Q) landed for this thread
        __syncthreads();                       // ... for all threads; stage j+1's old data is consumed
        if (j + 1 < num_n) load_kv(j + 1, stage ^ 1);
        cp_async_commit();

        const unsigned sK_lane = smem_addr(sK + stage * BLOCK_N * ROW + k_off);
        const unsigned sV_lane = smem_addr(sV + stage * BLOCK_N * ROW + a_off);

        // ---- S = Q K^T --------------------------------------------------------
        float s[MT][NT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) s[mt][nt][e] = 0.f;
#pragma unroll
        for (int kd = 0; kd < KD; ++kd) {
            unsigned qa[MT][4];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) ldmatrix_x4(qa[mt], sQ_warp + (mt * 16 * ROW + kd * 16) * 2);
#pragma unroll
            for (int np = 0; np < NT / 2; ++np) {
                unsigned kb[4];
                ldmatrix_x4(kb, sK_lane + (np * 16 * ROW + kd * 16) * 2);
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    mma_16816<T>(s[mt][2 * np], qa[mt], kb[0], kb[1]);
                    mma_16816<T>(s[mt][2 * np + 1], qa[mt], kb[2], kb[3]);
                }
            }
        }

        // ---- mask (only tiles crossing the diagonal or the end of the keys) ---
        const int n0 = j * BLOCK_N;
        if constexpr (!M::ANY) {
            if (n0 + BLOCK_N > keys.free) {
                int last[MT][2];                   // last visible key of each of the lane's rows
#pragma unroll
                for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                    for (int hf = 0; hf < 2; ++hf) last[mt][hf] = keys.last_key(row0 + warp_row0 + mt * 16 + (lane >> 2) + hf * 8);
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) softmax::frag_mask(s[mt], n0, lane, last[mt]);
            }
            // ---- online softmax (softmax.cuh), the scale inside the exp2, lazy rescale -----
            softmax::frag_update<RESCALE_THRESHOLD, true>(s, o_acc, m_run, l_run, scale_log2, softmax::FastExp2());
        } else {
            // modifiers (softmax.cuh: frag_modify), then the update
            float scale = scale_log2;
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
                scale = softmax::frag_modify<M, CAUSAL>(s[mt], n0, BLOCK_N, lane, mp, sq, mrow[mt], keys, scale_log2);
            softmax::frag_update<RESCALE_THRESHOLD, true>(s, o_acc, m_run, l_run, scale, softmax::FastExp2());
        }

        // ---- O += P V  (C fragment of S pairs -> A fragment of P) ---------------
#pragma unroll
        for (int kk = 0; kk < BLOCK_N / 16; ++kk) {
            unsigned pa[MT][4];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) acc_a_operand<T>(s[mt], kk, pa[mt]);
#pragma unroll
            for (int dp = 0; dp < DT / 2; ++dp) {
                unsigned vb[4];
                ldmatrix_x4_trans(vb, sV_lane + (kk * 16 * ROW + dp * 16) * 2);
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    mma_16816<T>(o_acc[mt][2 * dp], pa[mt], vb[0], vb[1]);
                    mma_16816<T>(o_acc[mt][2 * dp + 1], pa[mt], vb[2], vb[3]);
                }
            }
        }
    }
    cp_async_wait<0>();                        // nothing left in flight (also when num_n == 0)
    __syncthreads();                           // Q tile in smem complete before we overwrite it

    // ---- epilogue: O /= l, lse, write O through the warp's own Q rows --------------
    T* sO = sQ + warp_row0 * ROW;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
            const int r = mt * 16 + (lane >> 2) + hf * 8;
            float l;
            const float inv = softmax::frag_row_end<M::SINKS>(l_run[mt][hf], m_run[mt][hf], l, len < 0, [&] {
                return mods::sink2<M, float>(mp, q_head_of(kvh, (row0 + warp_row0 + r) % group, group));
            });
#pragma unroll
            for (int dt = 0; dt < DT; ++dt) {
                const unsigned pk = pack2<T>(o_acc[mt][dt][2 * hf] * inv, o_acc[mt][dt][2 * hf + 1] * inv);
                *reinterpret_cast<unsigned*>(sO + r * ROW + dt * 8 + (lane & 3) * 2) = pk;
            }
            if (lse != nullptr && (lane & 3) == 0) {
                const int pr = row0 + warp_row0 + r;
                if (pr < packed_rows) {
                    const int t = pr / group, g = pr - (pr / group) * group;
                    const long long idx = sqn.lse_at(kvh, g, group, t, num_q_heads, seqlen_q);
                    lse[idx] = softmax::lse(m_run[mt][hf], l, len < 0);
                }
            }
        }
    __syncwarp();
    constexpr int OTOTAL = WR * CH;
#pragma unroll
    for (int i = 0; i < (OTOTAL + 31) / 32; ++i) {
        const int c = lane + i * 32;
        if (OTOTAL % 32 == 0 || c < OTOTAL) {
            const int r = c / CH, ch = c - (c / CH) * CH;
            const int pr = row0 + warp_row0 + r;
            if (pr < packed_rows) {
                const int t = pr / group, g = pr - (pr / group) * group;
                T* dst = out + (long long)b * o_stride_b + (long long)(sqn.q0() + t) * o_stride_s
                             + (long long)q_head_of(kvh, g, group) * o_stride_h + ch * 8;
                *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(sO + r * ROW + ch * 8);
            }
        }
    }
}

// SMEM_BYTES: the dynamic shared memory the launch passes (cupy_gqa/_specs.py:
// tiled_smem), checked against the layout at compile time.
template <typename T, int HEAD_DIM, int BLOCK_M, int BLOCK_N, int NUM_WARPS, bool CAUSAL, int SMEM_BYTES>
__global__ void __launch_bounds__(NUM_WARPS * 32, ((NUM_WARPS >= 8 && BLOCK_M / NUM_WARPS == 16) ? tiled_detail::MIN_BLOCKS_8W : 1))
tiled_attention(
    const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
    T* __restrict__ out,
    float* __restrict__ lse,
    const int* __restrict__ seqlens_k,
    const AttnParams p)
{
    tiled_body<T, HEAD_DIM, BLOCK_M, BLOCK_N, NUM_WARPS, CAUSAL, SMEM_BYTES, NoMods>(q, k, v, out, lse, seqlens_k, p,
                                                                                     ModParams{});
}

// The same with the modifiers FLAGS (common.cuh: MOD_*), whose values are in mp.
// The modifiers need registers of their own: one CTA per SM's register file
// (all 255 registers a thread may take), and from head dim 96 on 16 rows per
// warp (cupy_gqa/_specs.py: with_mods), so that nothing spills.
template <typename T, int HEAD_DIM, int BLOCK_M, int BLOCK_N, int NUM_WARPS, bool CAUSAL, int SMEM_BYTES, int FLAGS>
__global__ void __launch_bounds__(NUM_WARPS * 32, 1)
tiled_attention_mods(
    const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
    T* __restrict__ out,
    float* __restrict__ lse,
    const int* __restrict__ seqlens_k,
    const AttnParams p, const ModParams mp)
{
    tiled_body<T, HEAD_DIM, BLOCK_M, BLOCK_N, NUM_WARPS, CAUSAL, SMEM_BYTES, Mods<FLAGS, sizeof(T) == 2>>(q, k, v, out, lse, seqlens_k,
                                                                                          p, mp);
}

// The same with per-sequence addressing ADDR (common.cuh: SEQ_*: varlen, paged
// K/V, left padding), described by sp. The addressing needs registers of its
// own: one CTA per SM's register file, as with the modifiers.
template <typename T, int HEAD_DIM, int BLOCK_M, int BLOCK_N, int NUM_WARPS, bool CAUSAL, int SMEM_BYTES, int ADDR>
__global__ void __launch_bounds__(NUM_WARPS * 32, 1)
tiled_attention_seq(
    const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
    T* __restrict__ out,
    float* __restrict__ lse,
    const int* __restrict__ seqlens_k,
    const AttnParams p, const SeqParams sp)
{
    tiled_body<T, HEAD_DIM, BLOCK_M, BLOCK_N, NUM_WARPS, CAUSAL, SMEM_BYTES, NoMods, ADDR>(
        q, k, v, out, lse, seqlens_k, p, ModParams{}, &sp);
}

// The same with per-sequence addressing ADDR and the modifiers FLAGS.
template <typename T, int HEAD_DIM, int BLOCK_M, int BLOCK_N, int NUM_WARPS, bool CAUSAL, int SMEM_BYTES, int ADDR, int FLAGS>
__global__ void __launch_bounds__(NUM_WARPS * 32, 1)
tiled_attention_seq_mods(
    const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
    T* __restrict__ out,
    float* __restrict__ lse,
    const int* __restrict__ seqlens_k,
    const AttnParams p, const ModParams mp, const SeqParams sp)
{
    tiled_body<T, HEAD_DIM, BLOCK_M, BLOCK_N, NUM_WARPS, CAUSAL, SMEM_BYTES, Mods<FLAGS, sizeof(T) == 2>, ADDR>(
        q, k, v, out, lse, seqlens_k, p, mp, &sp);
}
