/*
 * backward.cu -- the backward pass of causal / non-causal grouped-query
 * attention, compiled at runtime by NVRTC (cupy_gqa.attention_backward).
 *
 * Algorithm (FlashAttention-2's backward, written for this project)
 * -----------------------------------------------------------------------------
 * Scores s = scale q.k, P = softmax(s) per row, out = P V. Given dout and the
 * forward's lse (natural log of each row's softmax denominator), the
 * probabilities are rebuilt without the row max: P = exp(s - lse) =
 * exp2(q.k * scale_log2 - lse2), lse2 = lse * log2(e). Per row
 *     delta = rowsum(dout * out),   dP = dout V^T,   dS = P (dP - delta),
 *     dq = scale dS K,   dk = scale dS^T Q,   dv = P^T dout,
 * with dk and dv of a KV head summed over its group_size query heads.
 *
 * GQA packing, as in the forward (kernels/tiled.cu): for one (batch b, KV
 * head kvh) the G = group_size query heads that read it are packed into rows
 * pr = t * G + g (t = query position, head q_head_of(kvh, g, G)). The masks are
 * common.cuh's: packed row pr sees keys j <= pr / G + diag (causal, aligned
 * bottom-right, diag = seqlen_k - seqlen_q) and j < seqlen_k (the sequence's
 * own length when seqlens_k is given).
 *
 * Three launches, in this order on one stream; nothing is atomic, so two calls
 * give bitwise-equal results (each sum is taken in a fixed order):
 *   1. bwd_preprocess: one warp per packed row; delta = rowsum(dout * out) and
 *      lse2 = lse * log2(e) (+inf for a row that sees no key, so that its P is
 *      0) into a workspace of acc_t<T>, (batch, num_kv_heads, seqlen_q * G),
 *      two values per row. (For float32 and float64 inputs bwd_dq_rows
 *      rebuilds lse2 from its own scores.)
 *   2. dQ, one CTA per block of packed query rows of one (b, kvh), streaming
 *      the K and V tiles that some row sees (the forward's grid and key range,
 *      common.cuh: prefill_tile): S = Q K^T, dP = dO V^T, dS, dQ += dS K, dQ
 *      held in registers and written once. (P is recomputed here and in 3:
 *      two more matrix products than an atomic dQ, but no atomics and no
 *      per-key-block dQ workspace.)
 *   3. dK and dV, one CTA per (key block, b, kvh) (key blocks slowest: in causal
 *      attention the first key blocks have the most rows), the K and V tiles
 *      loaded once, streaming the tiles of packed rows that see some key of the
 *      block (all G heads of the group, so the group's sum happens in the
 *      registers): S^T = K Q^T, dP^T = V dO^T, P^T, dS^T,
 *      dV += P^T dO, dK += dS^T Q; written once at the end.
 *
 * Tensor-core kernels (fp16 / bf16, sm_80+; mma.sync m16n8k16, fp32
 * accumulation, the fragments of kernels/tiled.cu and softmax.cuh):
 *   bwd_dq_mma: NUM_WARPS warps, warp w owns packed rows [16w, 16w + 16) of the
 *     BLOCK_M = 16 NUM_WARPS rows. Q, dO tiles stay in shared memory; K and V
 *     tiles of BLOCK_N keys are double buffered (cp.async, tile j + 1 in flight
 *     while tile j is used). S and dP (fp32) in registers; dS becomes the A
 *     operand of dS K in registers (C fragment pairs -> A fragment, as P in the
 *     forward's P V); K is the B operand through ldmatrix.trans.
 *     Shared memory, rows of HEAD_DIM + 8 elements (16-byte pad: the 8 rows of
 *     an ldmatrix hit distinct bank groups):
 *       [ Q: BLOCK_M | dO: BLOCK_M | K: 2 x BLOCK_N | V: 2 x BLOCK_N ]
 *   bwd_dkdv_mma: KEY_WARPS x DSPLIT warps; warp w owns keys [16 (w % KEY_WARPS),
 *     + 16) of the BLOCK_N = 16 KEY_WARPS keys, and the head dims
 *     [(w / KEY_WARPS) DH, + DH), DH = HEAD_DIM / DSPLIT, of their dK and dV
 *     accumulators (fp32 registers; DSPLIT = 2 at head dims above 128, where
 *     a warp's whole rows would not fit, and the two warps of a key slab then
 *     both compute its S^T and dP^T). The tiles of BLOCK_M packed rows of Q and
 *     dO are double buffered (cp.async), with their lse2 and delta (plain
 *     loads into the next stage, read after the next barrier). P^T and dS^T
 *     become A operands in registers; Q and dO are B operands through
 *     ldmatrix.trans. At the end dK, dV (in T) go through the K and V tiles'
 *     shared memory to 16-byte stores.
 *       [ K: BLOCK_N | V: BLOCK_N | Q: 2 x BLOCK_M | dO: 2 x BLOCK_M ]
 *       [ lse2: 2 x BLOCK_M floats | delta: 2 x BLOCK_M floats ]
 *   Head dims: HEAD_DIM is the padded head dim (32, 64, 96, 128, 192, 256);
 *   the runtime head_dim is a multiple of 8, the 16-byte chunks past it are
 *   zero-filled on load and not stored. Requirements (checked by the Python
 *   layer, which otherwise copies): head_dim stride 1 and 16-byte aligned
 *   rows of q, k, v, dout, dq, dk, dv; scale_log2 > 0 (masked scores are -inf
 *   before the scaling).
 *
 * Hopper kernels (fp16 / bf16, sm_90a, padded head dims 64 and 128; the same
 * grids, masks and rules, every product on wgmma from 128-byte-swizzled tiles,
 * kernels/sm90.cuh; cupy_gqa/_specs.py: BWD_SM90 picks them):
 *   bwd_dq_ws, bwd_dkdv_ws: two consumer warpgroups and a producer warpgroup
 *     that streams the tiles by bulk tensor copies into a ring of stages on
 *     mbarriers (sections 3c, 2c/3d below).
 *
 * float32 tensor-core kernels (sm_80+, the padded head dims above; split TF32,
 * kernels/tf32.cuh: three TF32 m16n8k8 products per product, fp32-class error):
 *   bwd_dq_tf32, bwd_dkdv_tf32: the two kernels above on float32 tiles (rows of
 *     D + 4 floats), P^T, dS^T and dS taken from the accumulators as A operands
 *     (tf32.cuh: frag_a), their B operands read by scalar shared loads. The dQ
 *     kernel rebuilds lse2 from its own scores with the forward's online
 *     softmax and writes it for the dK/dV kernel, whose S^T carries the same
 *     bits (the products with the operands' roles swapped, in the same order).
 *     Above head dim 128 four warps share a slab of 16 rows (dQ) or keys
 *     (dK/dV) and split its head dims, each computing the slab's S and dP.
 *
 * CUDA-core kernels (every dtype and head dim, any strides; float64
 * everywhere, the other dtypes where the tensor-core kernels don't run):
 *   bwd_dq_rows: a team of TEAM lanes per packed row (PL = DPAD / TEAM dims
 *     of q, dout and dq each in registers), 128 / TEAM rows per CTA of one
 *     (b, kvh); K and V pass through shared memory in stages of KEYS keys
 *     ([KEYS][DPAD] of K, then of V). Dot products are reduced over the team
 *     with shuffles. For float32 and float64 inputs it first rebuilds each
 *     row's lse2 from its own exact scores (one more sweep over its keys, the
 *     online-softmax rules of softmax.cuh) and writes it to the workspace for
 *     bwd_dkdv_rows: the forward's lse (split TF32; float32 for float64)
 *     would cap the gradients' accuracy.
 *   bwd_dkdv_rows: a team per key (k, v, dk, dv in registers), 128 / TEAM keys
 *     per CTA; the packed rows that see some key of the CTA pass through
 *     shared memory in stages of ROWS rows: [ROWS][DPAD] of Q, then of dO,
 *     then ROWS of lse2, of delta (acc_t<T>) and of each row's last visible
 *     key (int).
 * A sequence whose seqlens_k value is out of range (a device array the host
 * does not read) gets NaN gradients (dq of its rows, dk and dv of its keys);
 * keys past a sequence's length get dk = dv = 0, rows that see no key dq = 0.
 */
#include "common.cuh"
#include "softmax.cuh"
#include "tf32.cuh"
#include "wgmma.cuh"
#include "sm90.cuh"

// The launch parameters, by value (mirrored by cupy_gqa/_plan.py: BWD_PARAMS_DTYPE).
struct BwdParams {
    AttnParams a;            // q, k, v and out (a.o_stride) strides, shapes, scale_log2, causal
    index_t do_stride[4];    // dout
    index_t dq_stride[4];
    index_t dk_stride[4];
    index_t dv_stride[4];
    index_t lse_stride[3];   // lse: batch, head, seq
    double scale;            // softmax_scale
};
static_assert(sizeof(BwdParams) == 336, "BwdParams must match _plan.BWD_PARAMS_DTYPE");

namespace bwd_detail {

// Two products of one shape side by side, from shared memory through
// ldmatrix: c0 = A0 B0^T and c1 = A1 B1^T for the warp's 16 rows of A (the
// warp's fragment addresses a0, a1) against NT n8 tiles of B (the lane's
// addresses b0, b1; rows ROW elements apart), over KD k16 steps. The dQ pass
// takes S = Q K^T with dP = dO V^T, the dK/dV pass S^T = K Q^T with dP^T = V dO^T.
template <typename T, int NT, int KD, int ROW>
__device__ __forceinline__ void two_products(float (&c0)[NT][4], float (&c1)[NT][4], unsigned a0, unsigned a1,
                                             unsigned b0, unsigned b1) {
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) c0[nt][e] = c1[nt][e] = 0.f;
#pragma unroll
    for (int kd = 0; kd < KD; ++kd) {
        unsigned x0[4], x1[4];
        ldmatrix_x4(x0, a0 + kd * 16 * 2);
        ldmatrix_x4(x1, a1 + kd * 16 * 2);
#pragma unroll
        for (int np = 0; np < NT / 2; ++np) {
            unsigned y0[4], y1[4];
            ldmatrix_x4(y0, b0 + (np * 16 * ROW + kd * 16) * 2);
            ldmatrix_x4(y1, b1 + (np * 16 * ROW + kd * 16) * 2);
            mma_16816<T>(c0[2 * np], x0, y0[0], y0[1]);
            mma_16816<T>(c0[2 * np + 1], x0, y0[2], y0[3]);
            mma_16816<T>(c1[2 * np], x1, y1[0], y1[1]);
            mma_16816<T>(c1[2 * np + 1], x1, y1[2], y1[3]);
        }
    }
}


template <typename A> __device__ __forceinline__ A pos_inf() { return -neg_inf<A>(); }
template <typename A> __host__ __device__ constexpr A log2e() { return A(1.44269504088896340736); }

// Workspace index of packed row pr of (b, kvh).
__device__ __forceinline__ index_t ws_row(const BwdParams& p, int b, int kvh, int pr) {
    return ((index_t)b * p.a.num_kv_heads + kvh) * ((index_t)p.a.seqlen_q * p.a.group_size) + pr;
}

// Elements of T in one 16-byte chunk (the loads' and stores' unit).
template <typename T> __host__ __device__ constexpr int chunk_elems() { return 16 / (int)sizeof(T); }

// Rows [row0, row0 + ROWS) of the packed rows of (b, kvh) of a (batch, seq,
// head, dim) tensor x with element strides st, into shared-memory rows of ROW
// elements (cp.async, 16 bytes each); zero-filled past packed_rows and past
// head_dim (a multiple of 8).
template <typename T, int ROWS, int D, int ROW, int NTHREADS>
__device__ __forceinline__ void load_packed_rows(T* s, const T* x, const index_t* st, int b, int kvh, int row0,
                                                 int packed_rows, int group, int head_dim, int tid) {
    constexpr int E = chunk_elems<T>(), CH = D / E, TOTAL = ROWS * CH;
#pragma unroll
    for (int i = 0; i < (TOTAL + NTHREADS - 1) / NTHREADS; ++i) {
        const int c = tid + i * NTHREADS;
        if (TOTAL % NTHREADS == 0 || c < TOTAL) {
            const int r = c / CH, ch = c - (c / CH) * CH;
            const int pr = row0 + r;
            const bool ok = pr < packed_rows && ch * E < head_dim;
            const int t = pr / group, g = pr - (pr / group) * group;
            const T* src = ok ? x + b * st[0] + (index_t)t * st[1] + (index_t)q_head_of(kvh, g, group) * st[2] + ch * E : x;
            cp_async_16(smem_addr(s + r * ROW + ch * E), src, ok);
        }
    }
}

// Keys [key0, key0 + ROWS) of k or v at (b, kvh) (base), row stride stride_s,
// into shared-memory rows of ROW elements; zero-filled at keys >= seqlen_k and
// dims >= head_dim.
template <typename T, int ROWS, int D, int ROW, int NTHREADS>
__device__ __forceinline__ void load_key_rows(T* s, const T* base, index_t stride_s, const T* any, int key0, int seqlen_k,
                                              int head_dim, int tid) {
    constexpr int E = chunk_elems<T>(), CH = D / E, TOTAL = ROWS * CH;
#pragma unroll
    for (int i = 0; i < (TOTAL + NTHREADS - 1) / NTHREADS; ++i) {
        const int c = tid + i * NTHREADS;
        if (TOTAL % NTHREADS == 0 || c < TOTAL) {
            const int r = c / CH, ch = c - (c / CH) * CH;
            const bool ok = key0 + r < seqlen_k && ch * E < head_dim;
            const T* src = ok ? base + (index_t)(key0 + r) * stride_s + ch * E : any;
            cp_async_16(smem_addr(s + r * ROW + ch * E), src, ok);
        }
    }
}

// 16-byte stores of shared-memory rows (ROW elements each) to rows of a tensor:
// row r goes to dst_row(r) when it is not null, chunks past head_dim skipped.
template <typename T, int ROWS, int D, int ROW, int NTHREADS, class DstRow>
__device__ __forceinline__ void store_rows(const T* s, int head_dim, int tid, DstRow dst_row) {
    constexpr int E = chunk_elems<T>(), CH = D / E, TOTAL = ROWS * CH;
#pragma unroll
    for (int i = 0; i < (TOTAL + NTHREADS - 1) / NTHREADS; ++i) {
        const int c = tid + i * NTHREADS;
        if (TOTAL % NTHREADS == 0 || c < TOTAL) {
            const int r = c / CH, ch = c - (c / CH) * CH;
            T* dst = dst_row(r);
            if (dst != nullptr && ch * E < head_dim)
                *reinterpret_cast<uint4*>(dst + ch * E) = *reinterpret_cast<const uint4*>(s + r * ROW + ch * E);
        }
    }
}

// Packed row pr of (b, kvh) of a (batch, seq, head, dim) tensor x with element
// strides xs: position pr / group of query head q_head_of(kvh, pr % group);
// null past packed_rows.
template <typename T>
__device__ __forceinline__ T* packed_row_ptr(T* x, const index_t* xs, int b, int kvh, int group, int packed_rows, int pr) {
    if (pr >= packed_rows) return nullptr;
    const int t = pr / group, g = pr - (pr / group) * group;
    return x + b * xs[0] + (index_t)t * xs[1] + (index_t)q_head_of(kvh, g, group) * xs[2];
}

// Q and dO rows [row0, row0 + ROWS) of (b, kvh) into sQ and sdO (load_packed_rows).
template <typename T, int ROWS, int D, int ROW, int NTHREADS>
__device__ __forceinline__ void load_q_do(T* sQ, T* sdO, const T* q, const T* dout, const BwdParams& p, int b, int kvh,
                                          int row0, int packed_rows, int group, int head_dim, int tid) {
    load_packed_rows<T, ROWS, D, ROW, NTHREADS>(sQ, q, p.a.q_stride, b, kvh, row0, packed_rows, group, head_dim, tid);
    load_packed_rows<T, ROWS, D, ROW, NTHREADS>(sdO, dout, p.do_stride, b, kvh, row0, packed_rows, group, head_dim, tid);
}

// K and V keys [key0, key0 + ROWS) from their (b, kvh) bases into sK and sV (load_key_rows).
template <typename T, int ROWS, int D, int ROW, int NTHREADS>
__device__ __forceinline__ void load_k_v(T* sK, T* sV, const T* kbase, const T* vbase, const T* k, const T* v,
                                         const BwdParams& p, int key0, int seqlen_k, int head_dim, int tid) {
    load_key_rows<T, ROWS, D, ROW, NTHREADS>(sK, kbase, p.a.k_stride[1], k, key0, seqlen_k, head_dim, tid);
    load_key_rows<T, ROWS, D, ROW, NTHREADS>(sV, vbase, p.a.v_stride[1], v, key0, seqlen_k, head_dim, tid);
}

// ROWS rows of dQ (packed rows from pr0), staged in shared memory at sO, to dq
// by NTHREADS threads (tid: the thread's index among them; rows past
// packed_rows skipped).
template <typename T, int ROWS, int D, int ROW, int NTHREADS>
__device__ __forceinline__ void store_dq(const T* sO, T* dq, const BwdParams& p, int b, int kvh, int pr0,
                                         int packed_rows, int group, int head_dim, int tid) {
    store_rows<T, ROWS, D, ROW, NTHREADS>(sO, head_dim, tid, [&](int r) -> T* {
        return packed_row_ptr(dq, p.dq_stride, b, kvh, group, packed_rows, pr0 + r);
    });
}

// A key block's dK and dV, staged in shared memory at sK and sV, to dk and dv:
// every key of the array, zeros past the sequence's length.
template <typename T, int ROWS, int D, int ROW, int NTHREADS>
__device__ __forceinline__ void store_dk_dv(const T* sK, const T* sV, T* dk, T* dv, const BwdParams& p, int b, int kvh,
                                            int n0, int head_dim, int tid) {
    const int seqlen_k_all = p.a.seqlen_k;
    store_rows<T, ROWS, D, ROW, NTHREADS>(sK, head_dim, tid, [&](int r) -> T* {
        return n0 + r < seqlen_k_all ? dk + b * p.dk_stride[0] + (index_t)(n0 + r) * p.dk_stride[1] + (index_t)kvh * p.dk_stride[2] : nullptr;
    });
    store_rows<T, ROWS, D, ROW, NTHREADS>(sV, head_dim, tid, [&](int r) -> T* {
        return n0 + r < seqlen_k_all ? dv + b * p.dv_stride[0] + (index_t)(n0 + r) * p.dv_stride[1] + (index_t)kvh * p.dv_stride[2] : nullptr;
    });
}

// The shared-memory layouts (see the top): offsets in elements of T.
template <typename T, int D, int BLOCK_M, int BLOCK_N>
struct DqSmem {
    enum : int {
        ROW = D + 8,
        STAGE = BLOCK_N * ROW,       // one K (or V) tile
        Q = 0,                       // [BLOCK_M][ROW]
        DO = Q + BLOCK_M * ROW,      // [BLOCK_M][ROW]
        K = DO + BLOCK_M * ROW,      // [2][BLOCK_N][ROW]
        V = K + 2 * STAGE,           // [2][BLOCK_N][ROW]
        END = V + 2 * STAGE,
        BYTES = END * (int)sizeof(T),
    };
};
template <typename T, int D, int BLOCK_N, int BLOCK_M>
struct DkvSmem {
    enum : int {
        ROW = D + 8,
        STAGE = BLOCK_M * ROW,       // one Q (or dO) tile
        K = 0,                       // [BLOCK_N][ROW]
        V = K + BLOCK_N * ROW,       // [BLOCK_N][ROW]
        Q = V + BLOCK_N * ROW,       // [2][BLOCK_M][ROW]
        DO = Q + 2 * STAGE,          // [2][BLOCK_M][ROW]
        END = DO + 2 * STAGE,
        LSE2_BYTE = END * (int)sizeof(T),          // float [2][BLOCK_M]
        DELTA_BYTE = LSE2_BYTE + 2 * BLOCK_M * 4,  // float [2][BLOCK_M]
        BYTES = DELTA_BYTE + 2 * BLOCK_M * 4,
    };
};
// The float32 tensor-core kernels' layouts (split TF32, kernels/tf32.cuh):
// rows of D + 4 floats (16 bytes mod 128: the 8 rows of an ldmatrix and the 32
// scalar B loads hit distinct banks); offsets in floats.
template <int D, int BLOCK_M, int BLOCK_N, int PRESPLIT>
struct DqTf32Smem {
    enum : int {
        ROW = D + 4,
        STAGE = BLOCK_N * ROW,               // one K (or V) tile
        Q = 0,                               // [BLOCK_M][ROW]
        DO = Q + BLOCK_M * ROW,              // [BLOCK_M][ROW]
        K = DO + BLOCK_M * ROW,              // [2][BLOCK_N][ROW]
        V = K + 2 * STAGE,                   // [2][BLOCK_N][ROW]
        K_SMALL = V + 2 * STAGE,             // [BLOCK_N][ROW], PRESPLIT >= 1
        V_SMALL = K_SMALL + STAGE,           // [BLOCK_N][ROW], PRESPLIT >= 1
        Q_SMALL = V_SMALL + STAGE,           // [BLOCK_M][ROW], PRESPLIT == 2
        DO_SMALL = Q_SMALL + BLOCK_M * ROW,  // [BLOCK_M][ROW], PRESPLIT == 2
        END = PRESPLIT == 2 ? DO_SMALL + BLOCK_M * ROW : PRESPLIT == 1 ? Q_SMALL : K_SMALL,
        BYTES = END * 4,
    };
};
template <int D, int BLOCK_N, int BLOCK_M>
struct DkvTf32Smem {
    enum : int {
        ROW = D + 4,
        STAGE = BLOCK_M * ROW,               // one Q (or dO) tile
        K = 0,                               // [BLOCK_N][ROW]
        V = K + BLOCK_N * ROW,               // [BLOCK_N][ROW]
        K_SMALL = V + BLOCK_N * ROW,         // [BLOCK_N][ROW]
        V_SMALL = K_SMALL + BLOCK_N * ROW,   // [BLOCK_N][ROW]
        Q = V_SMALL + BLOCK_N * ROW,         // [2][BLOCK_M][ROW]
        DO = Q + 2 * STAGE,                  // [2][BLOCK_M][ROW]
        Q_SMALL = DO + 2 * STAGE,            // [BLOCK_M][ROW]
        DO_SMALL = Q_SMALL + STAGE,          // [BLOCK_M][ROW]
        END = DO_SMALL + STAGE,
        LSE2_BYTE = END * 4,                 // float [2][BLOCK_M]
        DELTA_BYTE = LSE2_BYTE + 2 * BLOCK_M * 4,
        BYTES = DELTA_BYTE + 2 * BLOCK_M * 4,
    };
};
template <typename T, int DPAD, int KEYS>
struct DqRowsSmem {
    enum : int {
        K = 0,                       // [KEYS][DPAD]
        V = K + KEYS * DPAD,         // [KEYS][DPAD]
        BYTES = (V + KEYS * DPAD) * (int)sizeof(T),
    };
};
template <typename T, int DPAD, int ROWS>
struct DkvRowsSmem {
    enum : int {
        Q = 0,                                                   // T [ROWS][DPAD]
        DO = Q + ROWS * DPAD,                                    // T [ROWS][DPAD]
        LSE2_BYTE = (DO + ROWS * DPAD) * (int)sizeof(T),         // acc [ROWS]
        DELTA_BYTE = LSE2_BYTE + ROWS * (int)sizeof(acc_t<T>),   // acc [ROWS]
        LAST_BYTE = DELTA_BYTE + ROWS * (int)sizeof(acc_t<T>),   // int [ROWS]
        BYTES = LAST_BYTE + ROWS * 4,
    };
};

// The CTA of a dK/dV kernel: key block n_block (slowest), then (b, kvh), and
// the tiles of BLOCK_M packed rows that see some key of its BLOCK_N keys.
struct KeyBlock {
    int b, kvh, n0;           // batch, KV head, first key
    int len, seqlen_k, diag;  // seqlen_k_of (-1: bad), max(len, 0), seqlen_k - seqlen_q
    int group, packed_rows;   // group size, seqlen_q * group
    int m_begin, num_m;       // first row tile, row tiles
};
// The packed rows [first, end) that see some key of [key0, key_last] (key0 <
// seqlen_k): from the first row that sees key0 on (causal), and with the window
// modifier (M::WINDOW) only the rows whose band reaches the keys: t + diag - left
// <= key_last and (not causal) t + diag + right >= key0.
struct RowSpan {
    int first, end;
};
template <class M>
__device__ __forceinline__ RowSpan rows_seeing(int key0, int key_last, int diag, int group, int packed_rows, bool causal,
                                               const ModParams& mp) {
    RowSpan rows = {first_row_seeing(key0, diag, group, causal), packed_rows};
    if constexpr (M::WINDOW) {
        long long t0 = rows.first / group, t1 = packed_rows / group;  // queries [t0, t1)
        if (!causal && mp.window_right >= 0) t0 = max(t0, (long long)key0 - diag - mp.window_right);
        if (mp.window_left >= 0) t1 = min(t1, (long long)key_last - diag + mp.window_left + 1);
        rows = t1 <= t0 ? RowSpan{0, 0} : RowSpan{(int)(t0 * group), (int)(t1 * group)};
    }
    return rows;
}

template <bool CAUSAL, int BLOCK_N, int BLOCK_M, class M = NoMods>
__device__ __forceinline__ KeyBlock key_block(const BwdParams& p, const int* seqlens_k, const ModParams& mp) {
    KeyBlock kb;
    const int num_bh = p.a.batch * p.a.num_kv_heads;
    const int n_block = (int)(blockIdx.x / num_bh), bh = (int)(blockIdx.x % num_bh);
    kb.b = bh / p.a.num_kv_heads;
    kb.kvh = bh - kb.b * p.a.num_kv_heads;
    kb.n0 = n_block * BLOCK_N;
    kb.group = p.a.group_size;
    kb.packed_rows = p.a.seqlen_q * kb.group;
    kb.len = seqlen_k_of(seqlens_k, kb.b, p.a.seqlen_k);
    kb.seqlen_k = max(kb.len, 0);
    kb.diag = kb.seqlen_k - p.a.seqlen_q;
    // the packed rows that see some key of the block, in tiles of BLOCK_M
    const RowSpan rows = kb.n0 < kb.seqlen_k ? rows_seeing<M>(kb.n0, min(kb.n0 + BLOCK_N, kb.seqlen_k) - 1, kb.diag,
                                                              kb.group, kb.packed_rows, CAUSAL, mp)
                                             : RowSpan{kb.packed_rows, kb.packed_rows};
    kb.m_begin = rows.first / BLOCK_M * BLOCK_M;
    kb.num_m = rows.first < rows.end ? (rows.end - kb.m_begin + BLOCK_M - 1) / BLOCK_M : 0;
    return kb;
}

// The lse2 and delta of packed rows [m0, m0 + BLOCK_M) of a dK/dV kernel's row
// tile (plain loads, read after the next barrier); rows past the end get P = 0
// (lse2 = +inf) and dS = 0.
template <int BLOCK_M, int NTHREADS>
__device__ __forceinline__ void load_row_stats(float* sLse2, float* sDelta, const float* lse2_ws, const float* delta_ws,
                                               const BwdParams& p, const KeyBlock& kb, int m0, int tid) {
    for (int i = tid; i < BLOCK_M; i += NTHREADS) {
        const int pr = m0 + i;
        const bool ok = pr < kb.packed_rows;
        sLse2[i] = ok ? lse2_ws[ws_row(p, kb.b, kb.kvh, pr)] : pos_inf<float>();
        sDelta[i] = ok ? delta_ws[ws_row(p, kb.b, kb.kvh, pr)] : 0.f;
    }
}

// The lse2 and delta of a dQ kernel's lane rows (packed rows row and row + 8, the
// lane's rows g and g + 8 of its warp); rows past the end get P = 0 (lse2 = +inf)
// and dS = 0.
__device__ __forceinline__ void lane_row_stats(float (&lse2_r)[2], float (&delta_r)[2], const float* lse2_ws,
                                               const float* delta_ws, const BwdParams& p, int b, int kvh, int row,
                                               int packed_rows) {
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
        const int pr = row + hf * 8;
        const bool ok = pr < packed_rows;
        lse2_r[hf] = ok ? lse2_ws[ws_row(p, b, kvh, pr)] : pos_inf<float>();
        delta_r[hf] = ok ? delta_ws[ws_row(p, b, kvh, pr)] : 0.f;
    }
}

// A dQ kernel's key tile [n0, n0 + BLOCK_N) of scores s (raw) and dP: the mask
// (tiles crossing the diagonal or the end of the keys, softmax.cuh's rule) on
// the lane's rows (packed rows row and row + 8), then P = exp2(S scale_log2 -
// lse2) (masked: 0) and dS = P (dP - delta) into s.
template <int BLOCK_N, int NT, class Keys>
__device__ __forceinline__ void scores_to_ds(float (&s)[NT][4], const float (&dp)[NT][4], int n0, const Keys& keys,
                                             int row, int lane, float scale_log2, const float (&lse2_r)[2],
                                             const float (&delta_r)[2]) {
    if (n0 + BLOCK_N > keys.free) {
        int last[2];
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) last[hf] = keys.last_key(row + hf * 8);
        softmax::frag_mask(s, n0, lane, last);
    }
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const float pv = fast_exp2(fmaf(s[nt][e], scale_log2, -lse2_r[e >> 1]));
            s[nt][e] = pv * (dp[nt][e] - delta_r[e >> 1]);
        }
}

// Row tile m0 of a dK/dV kernel into one stage: Q and dO (cp.async), and each
// row's lse2 and delta (plain loads, read after the next barrier); rows past the
// end get P = 0 (lse2 = +inf) and dS = 0.
template <typename T, int BLOCK_M, int D, int ROW, int NTHREADS>
__device__ __forceinline__ void load_row_tile(T* sQ, T* sdO, float* sLse2, float* sDelta, const T* q, const T* dout,
                                              const float* lse2_ws, const float* delta_ws, const BwdParams& p,
                                              const KeyBlock& kb, int m0, int head_dim, int tid) {
    load_q_do<T, BLOCK_M, D, ROW, NTHREADS>(sQ, sdO, q, dout, p, kb.b, kb.kvh, m0, kb.packed_rows, kb.group, head_dim, tid);
    load_row_stats<BLOCK_M, NTHREADS>(sLse2, sDelta, lse2_ws, delta_ws, p, kb, m0, tid);
}

// S^T of a dK/dV kernel (rows: the lane's keys key_r; columns: packed rows
// from m0) on a tile that crosses the end of the keys or the causal diagonal:
// keys past the sequence, and (causal) rows that don't see the key, -inf.
// Element (nt, e): key key_r[e >> 1], packed row m0 + 8 nt + 2 (lane % 4) + (e & 1).
template <bool CAUSAL, int NT>
__device__ __forceinline__ void mask_keys_t(float (&s)[NT][4], const int (&key_r)[2], int m0, int lane, const KeyBlock& kb) {
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int c = 0; c < 2; ++c) {
            const int pr = m0 + nt * 8 + (lane & 3) * 2 + c;
            const int last = CAUSAL ? min(kb.seqlen_k - 1, pr / kb.group + kb.diag) : kb.seqlen_k - 1;
#pragma unroll
            for (int hf = 0; hf < 2; ++hf)
                if (key_r[hf] > last) s[nt][2 * hf + c] = neg_inf<float>();
        }
}

// P^T = exp2(S^T scale_log2 - lse2) (masked: 0) into s, dS^T = P^T (dP^T - delta)
// into dpt, with the stage's lse2 and delta of each column (packed row).
template <int NT, class Exp2>
__device__ __forceinline__ void probs_t(float (&s)[NT][4], float (&dpt)[NT][4], float scale_log2, const float* lse2_s,
                                        const float* delta_s, int lane, Exp2 exp2) {
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int c = 0; c < 2; ++c) {
            const int col = nt * 8 + (lane & 3) * 2 + c;
            const float l2 = lse2_s[col], de = delta_s[col];
#pragma unroll
            for (int hf = 0; hf < 2; ++hf) {
                const int e = 2 * hf + c;
                const float pv = exp2(fmaf(s[nt][e], scale_log2, -l2));
                s[nt][e] = pv;
                dpt[nt][e] = pv * (dpt[nt][e] - de);
            }
        }
}

// ---- the modifiers (common.cuh: mods) in the 16-bit tensor-core passes ----
// P is rebuilt from the modified scores, and dS takes the chain rule of the score
// modifiers: with x = softmax_scale q.k and x' its modified score,
//     P = exp(x' - lse),   dS = P (dP - delta) dx'/dx,
// dx'/dx the softcap's 1 - tanh^2 (ALiBi adds a constant; mods::score_nat_grad).
// lse is the forward's, sinks included, so the sinks change nothing here; their
// own gradient is bwd_dsinks's. Scores go to natural units as the forward's
// tensor-core kernels take them (softmax.cuh: frag_modify), and a masked
// score's P and dS are 0 whatever its products.

// A dQ kernel's view of the modifiers for the lane's packed rows row and row + 8
// (rows past the end take the last row's: their P is 0 through lse2 = +inf, and a
// mask_mod never sees a query past seqlen_q).
struct LaneMods {
    mods::Seq sq;
    mods::Diag row[2];
};
template <class M>
__device__ __forceinline__ LaneMods lane_mods(const ModParams& mp, int b, int seqlen_q, int seqlen_k, int kvh, int group,
                                              int row, int packed_rows) {
    LaneMods lm;
    lm.sq = mods::seq(b, seqlen_q, seqlen_k);
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
        const int pr = min(row + hf * 8, packed_rows - 1), t = pr / group;
        lm.row[hf] = mods::diag<M>(mp, lm.sq, t, q_head_of(kvh, pr - t * group, group));
    }
    return lm;
}

// scores_to_ds with the modifiers M: the mask where some row of the tile may not
// see a key of it (keys.unmasked) or with a mask_mod.
template <class M, bool CAUSAL, int BLOCK_N, int NT, class Keys>
__device__ __forceinline__ void scores_to_ds_mods(float (&s)[NT][4], const float (&dp)[NT][4], int n0, const Keys& keys,
                                                  int lane, float scale_log2, const float (&lse2_r)[2],
                                                  const float (&delta_r)[2], const ModParams& mp, const LaneMods& lm) {
    const bool mask = M::MASK || !keys.unmasked(n0, BLOCK_N);
    const float scale = scale_log2 * 0.69314718055994530942f;  // softmax_scale, as frag_to_natural has it
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int j = n0 + nt * 8 + (lane & 3) * 2 + (e & 1);
            const mods::Diag& r = lm.row[e >> 1];
            const bool seen = !mask || mods::visible<M, CAUSAL>(mp, lm.sq, r, j);
            float grad = 1.f, pv;
            if constexpr (M::SCORES) {
                const float x = mods::score_nat_grad<M>(s[nt][e] * scale, mp, lm.sq, r, j, grad);
                pv = fast_exp2(fmaf(x, 1.44269504088896340736f, -lse2_r[e >> 1]));
            } else {
                pv = fast_exp2(fmaf(s[nt][e], scale_log2, -lse2_r[e >> 1]));
            }
            s[nt][e] = seen ? pv * (dp[nt][e] - delta_r[e >> 1]) * grad : 0.f;
        }
}

// Whether row tile m0 (BLOCK_M packed rows) of a dK/dV kernel with modifiers needs
// the mask on its key block: the plain kernels' test (keys past the sequence, a
// row before a key's causal start; written in their `if`, where it compiles to
// two branches), a mask_mod, or a row whose window ends inside the block.
template <class M, bool CAUSAL, int BLOCK_N, int BLOCK_M>
__device__ __forceinline__ bool tile_masked(const KeyBlock& kb, int m0, const ModParams& mp) {
    if (M::MASK || kb.n0 + BLOCK_N > kb.seqlen_k || (CAUSAL && kb.n0 + BLOCK_N - 1 > m0 / kb.group + kb.diag))
        return true;
    if constexpr (M::WINDOW) {
        const long long t_first = m0 / kb.group, t_last = (min(m0 + BLOCK_M, kb.packed_rows) - 1) / kb.group;
        return (mp.window_left >= 0 && t_last + kb.diag - mp.window_left > kb.n0) ||
               (!CAUSAL && mp.window_right >= 0 && t_first + kb.diag + mp.window_right < kb.n0 + BLOCK_N - 1);
    }
    return false;
}

// mask_keys_t and probs_t with the modifiers M, on S^T (rows: the lane's keys
// key_r; columns: packed rows from m0, their lse2 and delta from the stage):
// P^T into s, dS^T into dpt; 0 where masked and past the packed rows.
template <class M, bool CAUSAL, int NT>
__device__ __forceinline__ void probs_t_mods(float (&s)[NT][4], float (&dpt)[NT][4], const int (&key_r)[2], int m0,
                                             int lane, const KeyBlock& kb, bool mask, float scale_log2,
                                             const float* lse2_s, const float* delta_s, const ModParams& mp) {
    const mods::Seq sq = {kb.b, kb.packed_rows / kb.group, kb.seqlen_k, kb.diag};
    const float scale = scale_log2 * 0.69314718055994530942f;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int c = 0; c < 2; ++c) {
            const int col = nt * 8 + (lane & 3) * 2 + c, pr = m0 + col;
            const bool live = pr < kb.packed_rows;
            const int prc = live ? pr : kb.packed_rows - 1, t = prc / kb.group;  // (a mask_mod sees real queries)
            const mods::Diag r = mods::diag<M>(mp, sq, t, q_head_of(kb.kvh, prc - t * kb.group, kb.group));
            const float l2 = lse2_s[col], de = delta_s[col];
#pragma unroll
            for (int hf = 0; hf < 2; ++hf) {
                const int e = 2 * hf + c, j = key_r[hf];
                const bool seen = live && (!mask || mods::visible<M, CAUSAL>(mp, sq, r, j));
                float grad = 1.f, pv;
                if constexpr (M::SCORES) {
                    const float x = mods::score_nat_grad<M>(s[nt][e] * scale, mp, sq, r, j, grad);
                    pv = fast_exp2(fmaf(x, 1.44269504088896340736f, -l2));
                } else {
                    pv = fast_exp2(fmaf(s[nt][e], scale_log2, -l2));
                }
                s[nt][e] = seen ? pv : 0.f;
                dpt[nt][e] = seen ? pv * (dpt[nt][e] - de) * grad : 0.f;
            }
        }
}

// NP products of one shape side by side in split TF32 (kernels/tf32.cuh):
// c[i] = A_i B_i^T for a warp's 16 rows of A_i (the lane's ldmatrix address
// a[i]) against NT n8 tiles of B_i (b[i]; rows of its n index, ROW floats
// apart), over KD k8 steps, each group of KG steps in fresh accumulators summed
// in IEEE fp32. A_PRE, B_PRE: the operand was split in shared memory (its
// small parts *_small[i] bytes after the big ones), else it is split here.
// SWAPPED: these are S^T = K Q^T and dP^T = V dO^T of the dK/dV kernel, whose
// bits must be those of the dQ kernel's S = Q K^T and dP = dO V^T (tf32.cuh:
// mma_f32_swapped; the same k8 groups in the same order, whatever NP).
template <int NP, int NT, int KD, int ROW, bool A_PRE, bool B_PRE, bool SWAPPED>
__device__ __forceinline__ void products_tf32(float (&c)[NP][NT][4], const unsigned (&a)[NP], const int (&a_small)[NP],
                                              const unsigned (&b)[NP], const int (&b_small)[NP]) {
    using namespace tf32_detail;
#pragma unroll
    for (int i = 0; i < NP; ++i)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) c[i][nt][e] = 0.f;
#pragma unroll
    for (int kg = 0; kg < KD; kg += KG) {
        float part[NP][NT][4];
#pragma unroll
        for (int i = 0; i < NP; ++i)
#pragma unroll
            for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) part[i][nt][e] = 0.f;
#pragma unroll 1
        for (int kd = kg; kd < kg + KG && kd < KD; ++kd) {  // not unrolled: ptxas would hoist every step's loads
#pragma unroll
            for (int i = 0; i < NP; ++i) {
                unsigned xb[4], xs[4];
                ldmatrix_split<A_PRE>(xb, xs, a[i] + kd * 8 * 4, a_small[i]);
#pragma unroll
                for (int np = 0; np < NT / 2; ++np) {
                    unsigned yb[4], ys[4];
                    ldmatrix_split<B_PRE>(yb, ys, b[i] + (np * 16 * ROW + kd * 8) * 4, b_small[i]);
                    if (SWAPPED) {
                        mma_f32_swapped<true>(part[i][2 * np], xb, xs, yb[0], yb[1], ys[0], ys[1]);
                        mma_f32_swapped<true>(part[i][2 * np + 1], xb, xs, yb[2], yb[3], ys[2], ys[3]);
                    } else {
                        mma_f32<true>(part[i][2 * np], xb, xs, yb[0], yb[1], ys[0], ys[1]);
                        mma_f32<true>(part[i][2 * np + 1], xb, xs, yb[2], yb[3], ys[2], ys[3]);
                    }
                }
            }
        }
#pragma unroll
        for (int i = 0; i < NP; ++i)
#pragma unroll
            for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) c[i][nt][e] += part[i][nt][e];
    }
}

// A float32 tile of ROWS rows (ROW floats apart, D used) split in place by the
// CTA: big parts over the raw values, small parts into ``small`` (tf32.cuh).
template <int ROWS, int D, int ROW, int NTHREADS>
__device__ __forceinline__ void split_tile(float* raw, float* small, int tid) {
    constexpr int CH = D / 4, TOTAL = ROWS * CH;
#pragma unroll
    for (int i = 0; i < (TOTAL + NTHREADS - 1) / NTHREADS; ++i) {
        const int c = tid + i * NTHREADS;
        if (TOTAL % NTHREADS == 0 || c < TOTAL) {
            const int r = c / CH, ch = c - (c / CH) * CH;
            split_chunk_in_place(raw + r * ROW + ch * 4, small + r * ROW + ch * 4);
        }
    }
}

}  // namespace bwd_detail

// ---- 1. delta = rowsum(dout * out), lse2 = lse * log2(e) ---------------------------
// One warp per packed row, a grid-stride loop over all of them. lse nullptr:
// delta only (float64: bwd_dq_rows writes lse2).
template <typename T>
__global__ void __launch_bounds__(256) bwd_preprocess(const T* __restrict__ out, const T* __restrict__ dout,
                                                      const float* __restrict__ lse, acc_t<T>* __restrict__ delta,
                                                      acc_t<T>* __restrict__ lse2, const BwdParams p) {
    typedef acc_t<T> A;
    const int lane = threadIdx.x & 31;
    const int group = p.a.group_size;
    const index_t packed = (index_t)p.a.seqlen_q * group;
    const index_t rows = (index_t)p.a.batch * p.a.num_kv_heads * packed;
    const index_t warps = (index_t)gridDim.x * (blockDim.x / 32);
    for (index_t r = (index_t)blockIdx.x * (blockDim.x / 32) + (threadIdx.x >> 5); r < rows; r += warps) {
        const index_t bk = r / packed;
        const int pr = (int)(r - bk * packed);
        const int b = (int)(bk / p.a.num_kv_heads), kvh = (int)(bk - (index_t)b * p.a.num_kv_heads);
        const int t = pr / group, h = q_head_of(kvh, pr - t * group, group);
        const T* o = out + b * p.a.o_stride[0] + (index_t)t * p.a.o_stride[1] + (index_t)h * p.a.o_stride[2];
        const T* d = dout + b * p.do_stride[0] + (index_t)t * p.do_stride[1] + (index_t)h * p.do_stride[2];
        A sum = 0;
        for (int i = lane; i < p.a.head_dim; i += 32) sum += to_acc(o[i * p.a.o_stride[3]]) * to_acc(d[i * p.do_stride[3]]);
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
        if (lane == 0) {
            delta[r] = sum;
            if (lse != nullptr) {
                const float l = lse[b * p.lse_stride[0] + (index_t)h * p.lse_stride[1] + (index_t)t * p.lse_stride[2]];
                lse2[r] = l == neg_inf<float>() ? bwd_detail::pos_inf<A>() : (A)l * bwd_detail::log2e<A>();
            }
        }
    }
}

// ---- 2. dQ on the tensor cores ----------------------------------------------------------
// SMEM_BYTES: the dynamic shared memory the launch passes (cupy_gqa/_specs.py:
// bwd_dq_smem), checked against the layout at compile time.
// The kernel's body, for the kernel without modifiers (M = NoMods) and the one
// with them (bwd_dq_mma_mods).
template <typename T, int HEAD_DIM, int BLOCK_M, int BLOCK_N, int NUM_WARPS, bool CAUSAL, int SMEM_BYTES, class M>
__device__ __forceinline__ void bwd_dq_mma_body(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                                                const T* __restrict__ dout, const float* __restrict__ delta_ws,
                                                const float* __restrict__ lse2_ws, T* __restrict__ dq,
                                                const int* __restrict__ seqlens_k, const BwdParams& p,
                                                const ModParams& mp) {
    using namespace bwd_detail;
    constexpr int D = HEAD_DIM;
    constexpr int NTHREADS = NUM_WARPS * 32;
    using L = DqSmem<T, D, BLOCK_M, BLOCK_N>;
    constexpr int ROW = L::ROW;
    constexpr int KD = D / 16;      // k16 steps of Q K^T and dO V^T
    constexpr int NT = BLOCK_N / 8; // n8 tiles of S and dP
    constexpr int DT = D / 8;       // n8 tiles of dQ
    static_assert(BLOCK_M == 16 * NUM_WARPS, "16 rows per warp");
    static_assert(D % 16 == 0 && BLOCK_N % 16 == 0, "tile shapes");
    static_assert(sizeof(T) == 2, "fp16 / bf16 only");
    static_assert(SMEM_BYTES == L::BYTES, "SMEM_BYTES is not the size of the shared-memory layout");

    extern __shared__ __align__(16) unsigned char smem_raw[];
    T* sQ = reinterpret_cast<T*>(smem_raw) + L::Q;
    T* sdO = reinterpret_cast<T*>(smem_raw) + L::DO;
    T* sK = reinterpret_cast<T*>(smem_raw) + L::K;
    T* sV = reinterpret_cast<T*>(smem_raw) + L::V;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const float scale_log2 = (float)p.a.scale_log2;
    const int head_dim = p.a.head_dim;

    // ---- this CTA's (b, kv head, rows) and keys (with the window: its band): the forward's (common.cuh) ----
    const PrefillTile<CAUSAL, M::WINDOW> tile = prefill_tile_mods_at<CAUSAL, M::WINDOW>(
        p.a, seqlens_k, p.a.group_size, M::WINDOW ? mp.window_left : -1, M::WINDOW ? mp.window_right : -1, blockIdx.x,
        tile_rows<BLOCK_M>(p.a, p.a.group_size));
    const int b = tile.b, kvh = tile.kv_head, row0 = tile.row0, group = tile.group, packed_rows = tile.packed_rows;
    const int len = tile.len, seqlen_k = tile.seqlen_k;  // len -1: a bad seqlens_k value, NaN rows
    const KeyRange<CAUSAL, M::WINDOW>& keys = tile.keys;
    const int j_first = keys.start / BLOCK_N, num_n = (keys.end + BLOCK_N - 1) / BLOCK_N;  // key tiles [j_first, num_n)
    const T* kbase = k + b * p.a.k_stride[0] + (index_t)kvh * p.a.k_stride[2];
    const T* vbase = v + b * p.a.v_stride[0] + (index_t)kvh * p.a.v_stride[2];

    load_q_do<T, BLOCK_M, D, ROW, NTHREADS>(sQ, sdO, q, dout, p, b, kvh, row0, packed_rows, group, head_dim, tid);
    auto load_kv = [&](int j, int stage) {
        load_k_v<T, BLOCK_N, D, ROW, NTHREADS>(sK + stage * L::STAGE, sV + stage * L::STAGE, kbase, vbase, k, v, p,
                                              j * BLOCK_N, seqlen_k, head_dim, tid);
    };
    if (j_first < num_n) load_kv(j_first, 0);
    cp_async_commit();  // group 0: Q, dO and K/V tile j_first

    // The lane's rows g = lane / 4 and g + 8 of the warp's 16: their lse2 and delta.
    const int lane_row = row0 + warp * 16 + (lane >> 2);
    float lse2_r[2], delta_r[2];
    lane_row_stats(lse2_r, delta_r, lse2_ws, delta_ws, p, b, kvh, lane_row, packed_rows);
    [[maybe_unused]] LaneMods lm;
    if constexpr (M::ANY) lm = lane_mods<M>(mp, b, p.a.seqlen_q, seqlen_k, kvh, group, lane_row, packed_rows);
    float dq_acc[DT][4];
#pragma unroll
    for (int dt = 0; dt < DT; ++dt)
#pragma unroll
        for (int e = 0; e < 4; ++e) dq_acc[dt][e] = 0.f;

    // ldmatrix lane offsets (kernels/tiled.cu): a_off for A operands and the
    // transposed B operands, k_off for B operands read from rows of their n index
    const int a_off = (((lane >> 3) & 1) * 8 + (lane & 7)) * ROW + (lane >> 4) * 8;
    const int k_off = ((lane >> 4) * 8 + (lane & 7)) * ROW + ((lane >> 3) & 1) * 8;
    const unsigned sQ_warp = smem_addr(sQ + warp * 16 * ROW + a_off);
    const unsigned sdO_warp = smem_addr(sdO + warp * 16 * ROW + a_off);

    for (int j = j_first; j < num_n; ++j) {
        const int stage = (j - j_first) & 1;
        cp_async_wait<0>();  // tile j landed for this thread
        __syncthreads();     // ... for all; the other stage's tile is consumed
        if (j + 1 < num_n) load_kv(j + 1, stage ^ 1);
        cp_async_commit();
        const unsigned sK_lane = smem_addr(sK + stage * L::STAGE + k_off);
        const unsigned sV_lane = smem_addr(sV + stage * L::STAGE + k_off);
        const unsigned sKt_lane = smem_addr(sK + stage * L::STAGE + a_off);

        // ---- S = Q K^T, dP = dO V^T ----
        float s[NT][4], dp[NT][4];
        bwd_detail::two_products<T, NT, KD, ROW>(s, dp, sQ_warp, sdO_warp, sK_lane, sV_lane);

        // ---- mask, P = exp2(S scale_log2 - lse2) (masked: 0), dS = P (dP - delta), in s ----
        if constexpr (M::ANY)
            scores_to_ds_mods<M, CAUSAL, BLOCK_N>(s, dp, j * BLOCK_N, keys, lane, scale_log2, lse2_r, delta_r, mp, lm);
        else
            scores_to_ds<BLOCK_N>(s, dp, j * BLOCK_N, keys, lane_row, lane, scale_log2, lse2_r, delta_r);

        // ---- dQ += dS K (C fragment pairs -> A fragment; K through ldmatrix.trans) ----
#pragma unroll
        for (int kk = 0; kk < BLOCK_N / 16; ++kk) {
            unsigned pa[4];
            acc_a_operand<T>(s, kk, pa);
#pragma unroll
            for (int dp2 = 0; dp2 < DT / 2; ++dp2) {
                unsigned kb[4];
                ldmatrix_x4_trans(kb, sKt_lane + (kk * 16 * ROW + dp2 * 16) * 2);
                mma_16816<T>(dq_acc[2 * dp2], pa, kb[0], kb[1]);
                mma_16816<T>(dq_acc[2 * dp2 + 1], pa, kb[2], kb[3]);
            }
        }
    }
    cp_async_wait<0>();  // nothing in flight (also when num_n == 0)
    __syncthreads();     // every warp is done with the tiles

    // ---- dq = scale dQ, through the warp's own Q rows, then 16-byte stores ----
    const float sc = len < 0 ? quiet_nan() : (float)p.scale;
    T* sO = sQ + warp * 16 * ROW;
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
        const int r = (lane >> 2) + hf * 8;
#pragma unroll
        for (int dt = 0; dt < DT; ++dt)
            *reinterpret_cast<unsigned*>(sO + r * ROW + dt * 8 + (lane & 3) * 2) =
                pack2<T>(dq_acc[dt][2 * hf] * sc, dq_acc[dt][2 * hf + 1] * sc);
    }
    __syncwarp();
    store_dq<T, 16, D, ROW, 32>(sO, dq, p, b, kvh, row0 + warp * 16, packed_rows, group, head_dim, lane);
}
template <typename T, int HEAD_DIM, int BLOCK_M, int BLOCK_N, int NUM_WARPS, bool CAUSAL, int SMEM_BYTES>
__global__ void __launch_bounds__(NUM_WARPS * 32, 1)
bwd_dq_mma(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v, const T* __restrict__ dout,
           const float* __restrict__ delta_ws, const float* __restrict__ lse2_ws, T* __restrict__ dq,
           const int* __restrict__ seqlens_k, const BwdParams p) {
    bwd_dq_mma_body<T, HEAD_DIM, BLOCK_M, BLOCK_N, NUM_WARPS, CAUSAL, SMEM_BYTES, NoMods>(
        q, k, v, dout, delta_ws, lse2_ws, dq, seqlens_k, p, ModParams{});
}
// The same with modifiers (FLAGS: common.cuh, MOD_*; no MOD_SCORE), their ModParams after the BwdParams.
template <typename T, int HEAD_DIM, int BLOCK_M, int BLOCK_N, int NUM_WARPS, bool CAUSAL, int SMEM_BYTES, int FLAGS>
__global__ void __launch_bounds__(NUM_WARPS * 32, 1)
bwd_dq_mma_mods(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v, const T* __restrict__ dout,
                const float* __restrict__ delta_ws, const float* __restrict__ lse2_ws, T* __restrict__ dq,
                const int* __restrict__ seqlens_k, const BwdParams p, const ModParams mp) {
    bwd_dq_mma_body<T, HEAD_DIM, BLOCK_M, BLOCK_N, NUM_WARPS, CAUSAL, SMEM_BYTES, Mods<FLAGS, true>>(
        q, k, v, dout, delta_ws, lse2_ws, dq, seqlens_k, p, mp);
}

// ---- 3. dK, dV on the tensor cores ------------------------------------------------------
// SMEM_BYTES: cupy_gqa/_specs.py: bwd_dkdv_smem, checked against the layout.
// The kernel's body, for the kernel without modifiers (M = NoMods) and the one
// with them (bwd_dkdv_mma_mods).
template <typename T, int HEAD_DIM, int BLOCK_M, int KEY_WARPS, int DSPLIT, bool CAUSAL, int SMEM_BYTES, class M>
__device__ __forceinline__ void bwd_dkdv_mma_body(const T* __restrict__ q, const T* __restrict__ k,
                                                  const T* __restrict__ v, const T* __restrict__ dout,
                                                  const float* __restrict__ delta_ws, const float* __restrict__ lse2_ws,
                                                  T* __restrict__ dk, T* __restrict__ dv,
                                                  const int* __restrict__ seqlens_k, const BwdParams& p,
                                                  const ModParams& mp) {
    using namespace bwd_detail;
    constexpr int D = HEAD_DIM;
    constexpr int NTHREADS = KEY_WARPS * DSPLIT * 32;
    constexpr int BLOCK_N = 16 * KEY_WARPS;  // keys per CTA
    constexpr int DH = D / DSPLIT;           // head dims of a warp's dK, dV
    using L = DkvSmem<T, D, BLOCK_N, BLOCK_M>;
    constexpr int ROW = L::ROW;
    constexpr int KD = D / 16;       // k16 steps of K Q^T and V dO^T
    constexpr int NT = BLOCK_M / 8;  // n8 tiles of S^T and dP^T (packed rows)
    constexpr int DTH = DH / 8;      // n8 tiles of the warp's dK, dV
    static_assert(D % 16 == 0 && DH % 16 == 0 && BLOCK_M % 16 == 0, "tile shapes");
    static_assert(sizeof(T) == 2, "fp16 / bf16 only");
    static_assert(SMEM_BYTES == L::BYTES, "SMEM_BYTES is not the size of the shared-memory layout");

    extern __shared__ __align__(16) unsigned char smem_raw[];
    T* sK = reinterpret_cast<T*>(smem_raw) + L::K;
    T* sV = reinterpret_cast<T*>(smem_raw) + L::V;
    T* sQ = reinterpret_cast<T*>(smem_raw) + L::Q;
    T* sdO = reinterpret_cast<T*>(smem_raw) + L::DO;
    float* sLse2 = reinterpret_cast<float*>(smem_raw + L::LSE2_BYTE);
    float* sDelta = reinterpret_cast<float*>(smem_raw + L::DELTA_BYTE);
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int ks = warp % KEY_WARPS, dpart = warp / KEY_WARPS;  // key slab, head-dim part
    const float scale_log2 = (float)p.a.scale_log2;
    const int head_dim = p.a.head_dim;

    // ---- this CTA's (key block, b, kv head): key blocks slowest ----
    const KeyBlock kb = key_block<CAUSAL, BLOCK_N, BLOCK_M, M>(p, seqlens_k, mp);
    const int b = kb.b, kvh = kb.kvh, n0 = kb.n0, len = kb.len, seqlen_k = kb.seqlen_k;
    const int m_begin = kb.m_begin, num_m = kb.num_m;

    load_k_v<T, BLOCK_N, D, ROW, NTHREADS>(sK, sV, k + b * p.a.k_stride[0] + (index_t)kvh * p.a.k_stride[2],
                                          v + b * p.a.v_stride[0] + (index_t)kvh * p.a.v_stride[2], k, v, p, n0, seqlen_k,
                                          head_dim, tid);
    auto load_rows = [&](int m, int stage) {
        load_row_tile<T, BLOCK_M, D, ROW, NTHREADS>(sQ + stage * L::STAGE, sdO + stage * L::STAGE, sLse2 + stage * BLOCK_M,
                                                    sDelta + stage * BLOCK_M, q, dout, lse2_ws, delta_ws, p, kb,
                                                    m_begin + m * BLOCK_M, head_dim, tid);
    };
    if (num_m > 0) load_rows(0, 0);
    cp_async_commit();  // group 0: K, V and row tile 0

    float dk_acc[DTH][4], dv_acc[DTH][4];
#pragma unroll
    for (int dt = 0; dt < DTH; ++dt)
#pragma unroll
        for (int e = 0; e < 4; ++e) dk_acc[dt][e] = dv_acc[dt][e] = 0.f;

    const int a_off = (((lane >> 3) & 1) * 8 + (lane & 7)) * ROW + (lane >> 4) * 8;
    const int k_off = ((lane >> 4) * 8 + (lane & 7)) * ROW + ((lane >> 3) & 1) * 8;
    const unsigned sK_warp = smem_addr(sK + ks * 16 * ROW + a_off);
    const unsigned sV_warp = smem_addr(sV + ks * 16 * ROW + a_off);
    int key_r[2];  // the lane's keys (rows of S^T)
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) key_r[hf] = n0 + ks * 16 + (lane >> 2) + hf * 8;

    for (int m = 0; m < num_m; ++m) {
        const int stage = m & 1;
        cp_async_wait<0>();  // row tile m landed for this thread
        __syncthreads();     // ... for all (and its lse2, delta); the other stage is consumed
        if (m + 1 < num_m) load_rows(m + 1, stage ^ 1);
        cp_async_commit();
        const int m0 = m_begin + m * BLOCK_M;
        const unsigned sQ_lane = smem_addr(sQ + stage * L::STAGE + k_off);
        const unsigned sdO_lane = smem_addr(sdO + stage * L::STAGE + k_off);
        const unsigned sQt_lane = smem_addr(sQ + stage * L::STAGE + a_off);
        const unsigned sdOt_lane = smem_addr(sdO + stage * L::STAGE + a_off);

        // ---- S^T = K Q^T, dP^T = V dO^T (rows: the warp's 16 keys; columns: packed rows) ----
        float s[NT][4], dpt[NT][4];
        bwd_detail::two_products<T, NT, KD, ROW>(s, dpt, sK_warp, sV_warp, sQ_lane, sdO_lane);

        // ---- the mask (keys past the sequence, (causal) rows that don't see the key, the modifiers'),
        //      P^T = exp2(S^T scale_log2 - lse2) (masked: 0), dS^T = P^T (dP^T - delta) ----
        if constexpr (M::ANY) {
            probs_t_mods<M, CAUSAL>(s, dpt, key_r, m0, lane, kb, tile_masked<M, CAUSAL, BLOCK_N, BLOCK_M>(kb, m0, mp),
                                    scale_log2, sLse2 + stage * BLOCK_M, sDelta + stage * BLOCK_M, mp);
        } else {
            if (n0 + BLOCK_N > seqlen_k || (CAUSAL && n0 + BLOCK_N - 1 > m0 / kb.group + kb.diag))
                mask_keys_t<CAUSAL>(s, key_r, m0, lane, kb);
            probs_t(s, dpt, scale_log2, sLse2 + stage * BLOCK_M, sDelta + stage * BLOCK_M, lane, softmax::FastExp2());
        }

        // ---- dV += P^T dO, dK += dS^T Q (the warp's head dims) ----
#pragma unroll
        for (int kk = 0; kk < BLOCK_M / 16; ++kk) {
            unsigned pa[4], sa[4];
            acc_a_operand<T>(s, kk, pa);
            acc_a_operand<T>(dpt, kk, sa);
#pragma unroll
            for (int dp2 = 0; dp2 < DTH / 2; ++dp2) {
                const int off = (kk * 16 * ROW + dpart * DH + dp2 * 16) * 2;
                unsigned ob[4], qb[4];
                ldmatrix_x4_trans(ob, sdOt_lane + off);
                ldmatrix_x4_trans(qb, sQt_lane + off);
                mma_16816<T>(dv_acc[2 * dp2], pa, ob[0], ob[1]);
                mma_16816<T>(dv_acc[2 * dp2 + 1], pa, ob[2], ob[3]);
                mma_16816<T>(dk_acc[2 * dp2], sa, qb[0], qb[1]);
                mma_16816<T>(dk_acc[2 * dp2 + 1], sa, qb[2], qb[3]);
            }
        }
    }
    cp_async_wait<0>();  // nothing in flight (also when num_m == 0)
    __syncthreads();     // every warp is done with K and V

    // ---- dk = scale dK, dv = dV, through the K and V tiles, then 16-byte stores ----
    const float sc_k = len < 0 ? quiet_nan() : (float)p.scale;
    const float sc_v = len < 0 ? quiet_nan() : 1.f;
    T* sdK = sK + ks * 16 * ROW + dpart * DH;
    T* sdV = sV + ks * 16 * ROW + dpart * DH;
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
        const int r = (lane >> 2) + hf * 8;
#pragma unroll
        for (int dt = 0; dt < DTH; ++dt) {
            const int off = r * ROW + dt * 8 + (lane & 3) * 2;
            *reinterpret_cast<unsigned*>(sdK + off) = pack2<T>(dk_acc[dt][2 * hf] * sc_k, dk_acc[dt][2 * hf + 1] * sc_k);
            *reinterpret_cast<unsigned*>(sdV + off) = pack2<T>(dv_acc[dt][2 * hf] * sc_v, dv_acc[dt][2 * hf + 1] * sc_v);
        }
    }
    __syncthreads();
    store_dk_dv<T, BLOCK_N, D, ROW, NTHREADS>(sK, sV, dk, dv, p, b, kvh, n0, head_dim, tid);
}
template <typename T, int HEAD_DIM, int BLOCK_M, int KEY_WARPS, int DSPLIT, bool CAUSAL, int SMEM_BYTES>
__global__ void __launch_bounds__(KEY_WARPS * DSPLIT * 32, 1)
bwd_dkdv_mma(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v, const T* __restrict__ dout,
             const float* __restrict__ delta_ws, const float* __restrict__ lse2_ws, T* __restrict__ dk,
             T* __restrict__ dv, const int* __restrict__ seqlens_k, const BwdParams p) {
    bwd_dkdv_mma_body<T, HEAD_DIM, BLOCK_M, KEY_WARPS, DSPLIT, CAUSAL, SMEM_BYTES, NoMods>(
        q, k, v, dout, delta_ws, lse2_ws, dk, dv, seqlens_k, p, ModParams{});
}
// The same with modifiers (FLAGS: common.cuh, MOD_*; no MOD_SCORE), their ModParams after the BwdParams.
template <typename T, int HEAD_DIM, int BLOCK_M, int KEY_WARPS, int DSPLIT, bool CAUSAL, int SMEM_BYTES, int FLAGS>
__global__ void __launch_bounds__(KEY_WARPS * DSPLIT * 32, 1)
bwd_dkdv_mma_mods(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v, const T* __restrict__ dout,
                  const float* __restrict__ delta_ws, const float* __restrict__ lse2_ws, T* __restrict__ dk,
                  T* __restrict__ dv, const int* __restrict__ seqlens_k, const BwdParams p, const ModParams mp) {
    bwd_dkdv_mma_body<T, HEAD_DIM, BLOCK_M, KEY_WARPS, DSPLIT, CAUSAL, SMEM_BYTES, Mods<FLAGS, true>>(
        q, k, v, dout, delta_ws, lse2_ws, dk, dv, seqlens_k, p, mp);
}

// ---- 3c. What the passes on Hopper's warpgroup tensor cores share (wgmma, sm_90a) --------
// bwd_dq_mma's and bwd_dkdv_mma's products on wgmma (kernels/wgmma.cuh; tiles and
// descriptors: kernels/sm90.cuh), every operand a tile of 64-column slabs with
// the 128-byte swizzle. For a warpgroup of 64 keys (dK/dV) or 64 packed rows (dQ):
//   S^T  = K Q^T    ss: A = K (K-major), B = the Q tile (K-major), N = BLOCK_M
//   dP^T = V dO^T   ss: A = V, B = the dO tile
//   dV  += P^T dO   rs: A = P^T (registers, as P in the forward), B = the dO tile
//                   read contiguous along N = HEAD_DIM (trans-b, as V in the forward)
//   dK  += dS^T Q   rs: A = dS^T, B = the Q tile (trans-b)
//   S = Q K^T, dP = dO V^T (ss), dQ += dS K (rs, K read trans-b)
// The rows of a wgmma accumulator are those of the mma.sync kernels' warps, so
// mask_keys_t, probs_t and scores_to_ds apply as they are. dQ, dK and dV stay
// in registers (head dims up to 128) and go to memory from them at the end
// (4-byte stores, four lanes making 16 contiguous bytes of a row).

// Two products of one shape on wgmma, side by side and waited for: c0 = A0 B0^T
// and c1 = A1 B1^T for a warpgroup's 64 rows of A (descriptors a0, a1: K-major
// slabs A_SLAB bytes apart) against N rows of B (b0, b1: B_SLAB apart), over KD
// k16 steps (kernels/sm90.cuh). The dQ pass takes S = Q K^T with dP = dO V^T,
// the dK/dV pass S^T = K Q^T with dP^T = V dO^T (as two_products, on mma.sync).
template <typename T, int N, int KD, int A_SLAB, int B_SLAB>
__device__ __forceinline__ void two_products_wgmma(float (&c0)[N / 8][4], float (&c1)[N / 8][4], unsigned long long a0,
                                                   unsigned long long a1, unsigned long long b0, unsigned long long b1) {
    using namespace sm90;
    wgmma_fence();
#pragma unroll
    for (int kd = 0; kd < KD; ++kd) Wgmma<T, N>::ss(flat(c0), a0 + kstep(kd, A_SLAB), b0 + kstep(kd, B_SLAB), kd);
#pragma unroll
    for (int kd = 0; kd < KD; ++kd) Wgmma<T, N>::ss(flat(c1), a1 + kstep(kd, A_SLAB), b1 + kstep(kd, B_SLAB), kd);
    wgmma_commit();
    wgmma_wait<0>();
    fence_regs(flat(c0));
    fence_regs(flat(c1));
}

// ROWS rows of a tensor into a tile of swizzled slabs (SLAB bytes apart) at dst,
// 16 bytes per cp.async; row r is read from row_ptr(r) (null: zeros), chunks
// past head_dim zero-filled.
template <typename T, int ROWS, int D, int SLAB, int NTHREADS, class RowPtr>
__device__ __forceinline__ void load_swizzled(unsigned dst, const T* any, int head_dim, int tid, RowPtr row_ptr) {
    constexpr int CHP = D / 8;  // 16-byte chunks of a padded row
#pragma unroll 4
    for (int c = tid; c < ROWS * CHP; c += NTHREADS) {
        const int r = c / CHP, ch = c % CHP;
        const T* src = row_ptr(r);
        const bool ok = src != nullptr && ch * 8 < head_dim;
        cp_async_16(dst + (ch / 8) * SLAB + sm90::swizzle128(r, ch % 8), ok ? (const void*)(src + ch * 8) : (const void*)any, ok);
    }
}

// One row tile of a wgmma dK/dV kernel, for a warpgroup's 64 keys
// (descriptors desc_k, desc_v) against the tile's Q and dO (q_at, do_at: BLOCK_M
// rows in slabs R_SLAB bytes apart) with their lse2 and delta, waited for:
//   S^T = K Q^T, dP^T = V dO^T; the mask (keys past the sequence; causal: rows
//   that don't see the key); P^T = exp2(S^T scale_log2 - lse2) (masked: 0),
//   dS^T = P^T (dP^T - delta); dV += P^T dO, dK += dS^T Q (P^T and dS^T as A
//   operands from the registers, dO and Q read trans-b).
template <typename T, int D, int BLOCK_M, int BLOCK_N, int KD, int KV_SLAB, int R_SLAB, bool CAUSAL, class M>
__device__ __forceinline__ void dkdv_tile_wgmma(float (&dk_acc)[D / 8][4], float (&dv_acc)[D / 8][4],
                                                unsigned long long desc_k, unsigned long long desc_v, unsigned q_at,
                                                unsigned do_at, const float* lse2_s, const float* delta_s, int m0,
                                                const int (&key_r)[2], int lane, float scale_log2,
                                                const bwd_detail::KeyBlock& kb, const ModParams& mp) {
    using namespace bwd_detail;
    using namespace sm90;
    constexpr int NT = BLOCK_M / 8;  // n8 tiles of S^T and dP^T (packed rows)
    float s[NT][4], dpt[NT][4];
    two_products_wgmma<T, BLOCK_M, KD, KV_SLAB, R_SLAB>(s, dpt, desc_k, desc_v, make_smem_desc(q_at, 16, 1024),
                                                       make_smem_desc(do_at, 16, 1024));
    if constexpr (M::ANY) {
        probs_t_mods<M, CAUSAL>(s, dpt, key_r, m0, lane, kb, tile_masked<M, CAUSAL, BLOCK_N, BLOCK_M>(kb, m0, mp),
                                scale_log2, lse2_s, delta_s, mp);
    } else {
        if (kb.n0 + BLOCK_N > kb.seqlen_k || (CAUSAL && kb.n0 + BLOCK_N - 1 > m0 / kb.group + kb.diag))
            mask_keys_t<CAUSAL>(s, key_r, m0, lane, kb);
        probs_t(s, dpt, scale_log2, lse2_s, delta_s, lane, softmax::FastExp2());
    }
    unsigned pa[BLOCK_M / 16][4], sa[BLOCK_M / 16][4];
#pragma unroll
    for (int kk = 0; kk < BLOCK_M / 16; ++kk) {
        acc_a_operand<T>(s, kk, pa[kk]);
        acc_a_operand<T>(dpt, kk, sa[kk]);
    }
    const unsigned long long desc_do_t = make_smem_desc(do_at, R_SLAB, 1024);
    const unsigned long long desc_q_t = make_smem_desc(q_at, R_SLAB, 1024);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < BLOCK_M / 16; ++kk)
        Wgmma<T, D>::rs(flat(dv_acc), pa[kk], desc_do_t + (unsigned long long)((kk * 16 * 128) >> 4), 1);
#pragma unroll
    for (int kk = 0; kk < BLOCK_M / 16; ++kk)
        Wgmma<T, D>::rs(flat(dk_acc), sa[kk], desc_q_t + (unsigned long long)((kk * 16 * 128) >> 4), 1);
    wgmma_commit();
    wgmma_wait<0>();
    fence_regs(flat(dv_acc));
    fence_regs(flat(dk_acc));
}

// One key tile of a wgmma dQ kernel, for a warpgroup's 64 packed
// rows (descriptors desc_q, desc_do; the lane's rows from row, their lse2 and
// delta) against the tile's K and V (k_at, v_at: BLOCK_N keys from n0 in slabs
// KV_SLAB bytes apart), waited for: S = Q K^T, dP = dO V^T; the mask, P =
// exp2(S scale_log2 - lse2) (masked: 0), dS = P (dP - delta) (scores_to_ds);
// dQ += dS K (dS as A operands from the registers, K read trans-b).
template <typename T, int D, int BLOCK_N, int KD, int R_SLAB, int KV_SLAB, class M, bool CAUSAL, class Keys>
__device__ __forceinline__ void dq_tile_wgmma(float (&dq_acc)[D / 8][4], unsigned long long desc_q, unsigned long long desc_do,
                                              unsigned k_at, unsigned v_at, int n0, const Keys& keys, int row, int lane,
                                              float scale_log2, const float (&lse2_r)[2], const float (&delta_r)[2],
                                              const ModParams& mp, const bwd_detail::LaneMods& lm) {
    using namespace bwd_detail;
    using namespace sm90;
    constexpr int NT = BLOCK_N / 8;  // n8 tiles of S and dP (keys)
    float s[NT][4], dp[NT][4];
    two_products_wgmma<T, BLOCK_N, KD, R_SLAB, KV_SLAB>(s, dp, desc_q, desc_do, make_smem_desc(k_at, 16, 1024),
                                                       make_smem_desc(v_at, 16, 1024));
    if constexpr (M::ANY)
        scores_to_ds_mods<M, CAUSAL, BLOCK_N>(s, dp, n0, keys, lane, scale_log2, lse2_r, delta_r, mp, lm);
    else
        scores_to_ds<BLOCK_N>(s, dp, n0, keys, row, lane, scale_log2, lse2_r, delta_r);
    unsigned sa[BLOCK_N / 16][4];
#pragma unroll
    for (int kk = 0; kk < BLOCK_N / 16; ++kk) acc_a_operand<T>(s, kk, sa[kk]);
    const unsigned long long desc_k_t = make_smem_desc(k_at, KV_SLAB, 1024);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < BLOCK_N / 16; ++kk)
        Wgmma<T, D>::rs(flat(dq_acc), sa[kk], desc_k_t + (unsigned long long)((kk * 16 * 128) >> 4), 1);
    wgmma_commit();
    wgmma_wait<0>();
    fence_regs(flat(dq_acc));
}

// A dQ kernel's accumulator rows (the lane's packed rows row and row + 8),
// scaled by sc, to dq: rows past packed_rows skipped, 4-byte stores (four lanes
// making 16 contiguous bytes of a row).
template <typename T, int DT>
__device__ __forceinline__ void store_dq_acc(const float (&acc)[DT][4], T* dq, const BwdParams& p, int b, int kvh, int row,
                                             int packed_rows, int group, int lane, int head_dim, float sc) {
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
        const int pr = row + hf * 8;
        if (pr >= packed_rows) continue;
        const int t = pr / group, g = pr - (pr / group) * group;
        T* dst = dq + b * p.dq_stride[0] + (index_t)t * p.dq_stride[1] + (index_t)q_head_of(kvh, g, group) * p.dq_stride[2] +
                 2 * (lane & 3);
#pragma unroll
        for (int dt = 0; dt < DT; ++dt)
            if (dt * 8 < head_dim)
                *reinterpret_cast<unsigned*>(dst + dt * 8) = pack2<T>(acc[dt][2 * hf] * sc, acc[dt][2 * hf + 1] * sc);
    }
}

// A dK/dV kernel's accumulator rows (the lane's keys key_r) to dk (scaled by
// sc_k) and dv (by sc_v): every key of the array (zeros past the sequence's
// length), 4-byte stores as store_dq_acc's.
template <typename T, int DT>
__device__ __forceinline__ void store_dk_dv_acc(const float (&dk_acc)[DT][4], const float (&dv_acc)[DT][4], T* dk, T* dv,
                                                const BwdParams& p, int b, int kvh, const int (&key_r)[2], int lane,
                                                int head_dim, float sc_k, float sc_v) {
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
        const int key = key_r[hf];
        if (key >= p.a.seqlen_k) continue;
        T* dk_row = dk + b * p.dk_stride[0] + (index_t)key * p.dk_stride[1] + (index_t)kvh * p.dk_stride[2] + 2 * (lane & 3);
        T* dv_row = dv + b * p.dv_stride[0] + (index_t)key * p.dv_stride[1] + (index_t)kvh * p.dv_stride[2] + 2 * (lane & 3);
#pragma unroll
        for (int dt = 0; dt < DT; ++dt) {
            if (dt * 8 < head_dim) {
                *reinterpret_cast<unsigned*>(dk_row + dt * 8) = pack2<T>(dk_acc[dt][2 * hf] * sc_k, dk_acc[dt][2 * hf + 1] * sc_k);
                *reinterpret_cast<unsigned*>(dv_row + dt * 8) = pack2<T>(dv_acc[dt][2 * hf] * sc_v, dv_acc[dt][2 * hf + 1] * sc_v);
            }
        }
    }
}

// ---- 2c/3d. The passes on wgmma with a producer warpgroup (sm_90a) -----------------------
// The mma.sync kernels' grids, key ranges, row tiles and rules, each tile's
// products and softmax as in 3c (dq_tile_wgmma, dkdv_tile_wgmma), with the
// streamed tiles loaded by a warpgroup of their own, as the forward's
// (kernels/hopper.cu): two consumer warpgroups compute, the producer (the
// last warpgroup, its registers given to the consumers by setmaxnreg) fills a
// ring of STAGES stages, each with a "full" and an "empty" mbarrier, and waits
// only for a stage to be free. The consumers never meet at a barrier: each
// waits for the stage it needs and frees it when its products are done.
// The tiles read once per CTA (dQ: Q and dO; dK/dV: K and V) are loaded by
// every thread's cp.async before the roles split.
//   dQ:    K and V tiles of BLOCK_N keys by bulk tensor copies (k_map, v_map:
//          boxes of 64 columns by BLOCK_N keys); the tile that holds the end
//          of a sequence that ends before the array does (seqlens_k) by the
//          producer's cp.async, which zero-fills the keys past it (a NaN
//          there would reach dQ += dS K through 0 * NaN).
//   dK/dV: Q and dO tiles of BLOCK_M = 64 packed rows by bulk tensor copies
//          where `bulk` (the host's choice: the group divides 64 and the
//          copy engine takes q's and dout's strides; q_map, do_map: boxes of
//          64 columns by group heads by 64 / group positions, whose rows past
//          the queries the copy engine fills with zeros), else by the
//          producer's cp.async; each row's lse2 and delta by 4-byte cp.async
//          (zero past the rows: with Q and dO rows of zeros, P = 1 there
//          gives dV and dK nothing, and dS = 0).
template <int HEAD_DIM, int BLOCK_N, int STAGES>
struct DqWsSmem {
    enum : int {
        SLABS = HEAD_DIM / 64, BLOCK_M = 128,
        R_SLAB = BLOCK_M * 128, R_BYTES = SLABS * R_SLAB,        // the Q or dO tile
        KV_SLAB = BLOCK_N * 128, KV_BYTES = SLABS * KV_SLAB,     // a K or V tile
        Q = 0, DO = R_BYTES, K = 2 * R_BYTES, V = K + STAGES * KV_BYTES,
        BARS = V + STAGES * KV_BYTES,                             // full [STAGES], empty [STAGES]
        BYTES = BARS + 16 * STAGES + 1024,                        // + the alignment's slack
    };
};
template <int HEAD_DIM, int BLOCK_M, int STAGES>
struct DkvWsSmem {
    enum : int {
        SLABS = HEAD_DIM / 64, BLOCK_N = 128,
        KV_SLAB = BLOCK_N * 128, KV_BYTES = SLABS * KV_SLAB,     // the K or V tile
        R_SLAB = BLOCK_M * 128, R_BYTES = SLABS * R_SLAB,        // a Q or dO tile
        K = 0, V = KV_BYTES, Q = 2 * KV_BYTES, DO = Q + STAGES * R_BYTES,
        STATS = DO + STAGES * R_BYTES,                            // lse2 [STAGES][BLOCK_M], delta [STAGES][BLOCK_M]
        BARS = STATS + 2 * STAGES * BLOCK_M * 4,                  // full [STAGES], empty [STAGES]
        BYTES = BARS + 16 * STAGES + 1024,                        // + the alignment's slack
    };
};

// Registers per thread of each role, as the forward's (two consumer warpgroups
// and the producer: 2 x 224 + 56 <= 65536 / 128).
enum { WS_PRODUCER_REGS = 56, WS_CONSUMER_REGS = 224 };
// The producer warpgroup's named barrier (id 1; 0 is __syncthreads).
__device__ __forceinline__ void ws_producer_sync() { asm volatile("bar.sync 1, 128;\n" ::: "memory"); }

// One 4-byte cp.async (zero-filled where !pred); its arrival on an mbarrier once
// landed: sm90::cp_async_mbar_arrive (counted in the mbarrier's init).
__device__ __forceinline__ void cp_async_4(unsigned dst, const void* src, bool pred) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(pred ? 4 : 0));
}

// The end of a ws kernel's prologue: the tiles every thread loaded by cp.async
// have landed, ordered before the consumers' wgmma reads (async proxy), for all
// threads (and the mbarriers' init).
__device__ __forceinline__ void ws_tiles_loaded() {
    cp_async_commit();
    cp_async_wait<0>();
    sm90::fence_proxy_async();
    __syncthreads();
}

// SMEM_BYTES: cupy_gqa/_specs.py: bwd_dq_ws_smem, checked against the layout.
// The kernel's body, for the kernel without modifiers (M = NoMods) and the one
// with them (bwd_dq_ws_mods).
template <typename T, int HEAD_DIM, int BLOCK_N, int STAGES, bool CAUSAL, int SMEM_BYTES, class M>
__device__ __forceinline__ void bwd_dq_ws_body(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                                               const T* __restrict__ dout, const float* __restrict__ delta_ws,
                                               const float* __restrict__ lse2_ws, T* __restrict__ dq,
                                               const int* __restrict__ seqlens_k, const BwdParams& p, const ModParams& mp,
                                               const sm90::TensorMap& k_map, const sm90::TensorMap& v_map) {
    using namespace bwd_detail;
    using namespace sm90;
    constexpr int D = HEAD_DIM, NWG = 2, BLOCK_M = 64 * NWG, CONSUMERS = 128 * NWG;
    using L = DqWsSmem<D, BLOCK_N, STAGES>;
    constexpr int KD = D / 16;       // k16 steps of Q K^T and dO V^T
    constexpr int DT = D / 8;        // n8 tiles of dQ
    static_assert(sizeof(T) == 2, "fp16 / bf16 only");
    static_assert(D % 64 == 0 && D <= 128 && BLOCK_N % 16 == 0 && BLOCK_N <= 256, "head dims 64 and 128; keys in k16 steps");
    static_assert(STAGES >= 2, "a stage fills while the consumers read the other");
    static_assert(SMEM_BYTES == L::BYTES, "SMEM_BYTES is not the size of the shared-memory layout");

    extern __shared__ unsigned char smem_raw[];
    const unsigned raw = smem_addr(smem_raw);
    const unsigned base = (raw + 1023u) & ~1023u;  // swizzle atoms need 1024-byte alignment
    const int tid = threadIdx.x;
    const int head_dim = p.a.head_dim;
    auto full = [&](int s) { return base + L::BARS + 8 * s; };              // stage s's K and V have landed
    auto empty = [&](int s) { return base + L::BARS + 8 * (STAGES + s); };  // ... and have been read

    // ---- this CTA's (b, kv head, rows) and keys (with the window: its band): the forward's (common.cuh) ----
    const PrefillTile<CAUSAL, M::WINDOW> tile = prefill_tile_mods_at<CAUSAL, M::WINDOW>(
        p.a, seqlens_k, p.a.group_size, M::WINDOW ? mp.window_left : -1, M::WINDOW ? mp.window_right : -1, blockIdx.x,
        tile_rows<BLOCK_M>(p.a, p.a.group_size));
    const int b = tile.b, kvh = tile.kv_head, row0 = tile.row0, group = tile.group, packed_rows = tile.packed_rows;
    const int len = tile.len, seqlen_k = tile.seqlen_k;  // len -1: a bad seqlens_k value, NaN rows
    const KeyRange<CAUSAL, M::WINDOW>& keys = tile.keys;
    const int j_first = keys.start / BLOCK_N, num_n = (keys.end + BLOCK_N - 1) / BLOCK_N;  // key tiles [j_first, num_n)

    if (tid == 0) {
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(full(s), 1);           // one producer thread arrives (with the copies' bytes, if bulk)
            mbar_init(empty(s), CONSUMERS);  // every consumer thread arrives
        }
    }
    // ---- Q and dO once, by every thread ----
    auto packed = [&](const T* x, const index_t* xs) {
        return [=](int r) { return packed_row_ptr(x, xs, b, kvh, group, packed_rows, row0 + r); };
    };
    load_swizzled<T, BLOCK_M, D, L::R_SLAB, 384>(base + L::Q, q, head_dim, tid, packed(q, p.a.q_stride));
    load_swizzled<T, BLOCK_M, D, L::R_SLAB, 384>(base + L::DO, dout, head_dim, tid, packed(dout, p.do_stride));
    ws_tiles_loaded();

    if (tid >= CONSUMERS) {
        // =========================== producer warpgroup ===========================
        regs_dec<WS_PRODUCER_REGS>();
        const int pt = tid - CONSUMERS;
        const T* kbase = k + b * p.a.k_stride[0] + (index_t)kvh * p.a.k_stride[2];
        const T* vbase = v + b * p.a.v_stride[0] + (index_t)kvh * p.a.v_stride[2];
        for (int j = j_first; j < num_n; ++j) {
            const int i = j - j_first, st = i % STAGES;  // the CTA's i-th tile
            if (i >= STAGES) mbar_wait(empty(st), ((i / STAGES) + 1) & 1);  // its use i - STAGES is done
            const unsigned k_at = base + L::K + st * L::KV_BYTES, v_at = base + L::V + st * L::KV_BYTES;
            const int key0 = j * BLOCK_N;
            if (key0 + BLOCK_N <= seqlen_k || seqlen_k == p.a.seqlen_k) {
                // inside the sequence's keys, or inside the array (zeros past its end)
                if (pt == 0) {
                    mbar_expect_tx(full(st), 2 * L::KV_BYTES);
#pragma unroll
                    for (int sl = 0; sl < L::SLABS; ++sl) {
                        tma_load_4d(k_at + sl * L::KV_SLAB, k_map, full(st), sl * 64, key0, kvh, b);
                        tma_load_4d(v_at + sl * L::KV_SLAB, v_map, full(st), sl * 64, key0, kvh, b);
                    }
                }
            } else {
                load_swizzled<T, BLOCK_N, D, L::KV_SLAB, 128>(k_at, k, head_dim, pt, [&](int r) -> const T* {
                    return key0 + r < seqlen_k ? kbase + (index_t)(key0 + r) * p.a.k_stride[1] : nullptr;
                });
                load_swizzled<T, BLOCK_N, D, L::KV_SLAB, 128>(v_at, v, head_dim, pt, [&](int r) -> const T* {
                    return key0 + r < seqlen_k ? vbase + (index_t)(key0 + r) * p.a.v_stride[1] : nullptr;
                });
                cp_async_wait_all();
                fence_proxy_async();  // each thread's writes before the consumers' wgmma reads,
                ws_producer_sync();   // all of them before the one arrival
                if (pt == 0) mbar_arrive(full(st));
            }
        }
        return;
    }

    // ============================ consumer warpgroups ============================
    regs_inc<WS_CONSUMER_REGS>();
    const int lane = tid & 31, warp = tid >> 5;
    float scale_log2 = (float)p.a.scale_log2;
    asm volatile("" : "+f"(scale_log2));  // (converted once, not per tile)
    // The lane's rows g = lane / 4 and g + 8 of the warp's 16: their lse2 and delta.
    const int lane_row = row0 + warp * 16 + (lane >> 2);
    float lse2_r[2], delta_r[2];
    lane_row_stats(lse2_r, delta_r, lse2_ws, delta_ws, p, b, kvh, lane_row, packed_rows);
    [[maybe_unused]] LaneMods lm;
    if constexpr (M::ANY) lm = lane_mods<M>(mp, b, p.a.seqlen_q, seqlen_k, kvh, group, lane_row, packed_rows);
    float dq_acc[DT][4];
#pragma unroll
    for (int dt = 0; dt < DT; ++dt)
#pragma unroll
        for (int e = 0; e < 4; ++e) dq_acc[dt][e] = 0.f;
    const int wg = __shfl_sync(0xffffffffu, tid / 128, 0);  // A's rows [64 wg, 64 wg + 64) of the Q and dO tiles
    const unsigned long long desc_q = make_smem_desc(base + L::Q + wg * 64 * 128, 16, 1024);
    const unsigned long long desc_do = make_smem_desc(base + L::DO + wg * 64 * 128, 16, 1024);

    for (int j = j_first; j < num_n; ++j) {
        const int i = j - j_first, st = i % STAGES;
        mbar_wait(full(st), (i / STAGES) & 1);
        const unsigned k_at = base + L::K + st * L::KV_BYTES, v_at = base + L::V + st * L::KV_BYTES;

        dq_tile_wgmma<T, D, BLOCK_N, KD, L::R_SLAB, L::KV_SLAB, M, CAUSAL>(
            dq_acc, desc_q, desc_do, k_at, v_at, j * BLOCK_N, keys, lane_row, lane, scale_log2, lse2_r, delta_r, mp, lm);
        mbar_arrive(empty(st));  // the stage is free for the producer
    }

    // ---- dq = scale dQ from the registers (rows past packed_rows skipped) ----
    store_dq_acc<T, DT>(dq_acc, dq, p, b, kvh, lane_row, packed_rows, group, lane, head_dim,
                        len < 0 ? quiet_nan() : (float)p.scale);
}
template <typename T, int HEAD_DIM, int BLOCK_N, int STAGES, bool CAUSAL, int SMEM_BYTES>
__global__ void __launch_bounds__(384, 1)
bwd_dq_ws(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v, const T* __restrict__ dout,
          const float* __restrict__ delta_ws, const float* __restrict__ lse2_ws, T* __restrict__ dq,
          const int* __restrict__ seqlens_k, const BwdParams p, const __grid_constant__ sm90::TensorMap k_map,
          const __grid_constant__ sm90::TensorMap v_map) {
    bwd_dq_ws_body<T, HEAD_DIM, BLOCK_N, STAGES, CAUSAL, SMEM_BYTES, NoMods>(q, k, v, dout, delta_ws, lse2_ws, dq, seqlens_k,
                                                                            p, ModParams{}, k_map, v_map);
}
// The same with modifiers (FLAGS: common.cuh, MOD_*; no MOD_SCORE), their ModParams after the BwdParams.
template <typename T, int HEAD_DIM, int BLOCK_N, int STAGES, bool CAUSAL, int SMEM_BYTES, int FLAGS>
__global__ void __launch_bounds__(384, 1)
bwd_dq_ws_mods(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v, const T* __restrict__ dout,
               const float* __restrict__ delta_ws, const float* __restrict__ lse2_ws, T* __restrict__ dq,
               const int* __restrict__ seqlens_k, const BwdParams p, const ModParams mp,
               const __grid_constant__ sm90::TensorMap k_map, const __grid_constant__ sm90::TensorMap v_map) {
    bwd_dq_ws_body<T, HEAD_DIM, BLOCK_N, STAGES, CAUSAL, SMEM_BYTES, Mods<FLAGS, true>>(
        q, k, v, dout, delta_ws, lse2_ws, dq, seqlens_k, p, mp, k_map, v_map);
}

// SMEM_BYTES: cupy_gqa/_specs.py: bwd_dkdv_ws_smem, checked against the layout.
// The kernel's body, for the kernel without modifiers (M = NoMods) and the one
// with them (bwd_dkdv_ws_mods).
template <typename T, int HEAD_DIM, int BLOCK_M, int STAGES, bool CAUSAL, int SMEM_BYTES, class M>
__device__ __forceinline__ void bwd_dkdv_ws_body(const T* __restrict__ q, const T* __restrict__ k,
                                                 const T* __restrict__ v, const T* __restrict__ dout,
                                                 const float* __restrict__ delta_ws, const float* __restrict__ lse2_ws,
                                                 T* __restrict__ dk, T* __restrict__ dv,
                                                 const int* __restrict__ seqlens_k, const BwdParams& p,
                                                 const ModParams& mp, const sm90::TensorMap& q_map,
                                                 const sm90::TensorMap& do_map, const int bulk) {
    using namespace bwd_detail;
    using namespace sm90;
    constexpr int D = HEAD_DIM, NWG = 2, BLOCK_N = 64 * NWG, CONSUMERS = 128 * NWG;
    using L = DkvWsSmem<D, BLOCK_M, STAGES>;
    constexpr int KD = D / 16;       // k16 steps of K Q^T and V dO^T
    constexpr int DT = D / 8;        // n8 tiles of dK, dV
    static_assert(sizeof(T) == 2, "fp16 / bf16 only");
    static_assert(D % 64 == 0 && D <= 128 && BLOCK_M == 64, "head dims 64 and 128; row tiles of 64 (one stats row a producer thread)");
    static_assert(STAGES >= 2, "a stage fills while the consumers read the other");
    static_assert(SMEM_BYTES == L::BYTES, "SMEM_BYTES is not the size of the shared-memory layout");

    extern __shared__ unsigned char smem_raw[];
    const unsigned raw = smem_addr(smem_raw);
    const unsigned base = (raw + 1023u) & ~1023u;  // swizzle atoms need 1024-byte alignment
    const float* sLse2 = reinterpret_cast<const float*>(smem_raw + (base - raw) + L::STATS);
    const float* sDelta = sLse2 + STAGES * BLOCK_M;
    const int tid = threadIdx.x;
    const int head_dim = p.a.head_dim;
    auto full = [&](int s) { return base + L::BARS + 8 * s; };              // stage s's rows have landed
    auto empty = [&](int s) { return base + L::BARS + 8 * (STAGES + s); };  // ... and have been read

    // ---- this CTA's (key block, b, kv head): key blocks slowest ----
    const KeyBlock kb = key_block<CAUSAL, BLOCK_N, BLOCK_M, M>(p, seqlens_k, mp);
    const int b = kb.b, kvh = kb.kvh, n0 = kb.n0, len = kb.len, seqlen_k = kb.seqlen_k;
    const int num_m = kb.num_m, group = kb.group;

    if (tid == 0) {
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(full(s), 129);         // each producer thread (its stats' cp.async) and one more (below)
            mbar_init(empty(s), CONSUMERS);  // every consumer thread arrives
        }
    }
    // ---- K and V once, by every thread ----
    const T* kbase = k + b * p.a.k_stride[0] + (index_t)kvh * p.a.k_stride[2];
    const T* vbase = v + b * p.a.v_stride[0] + (index_t)kvh * p.a.v_stride[2];
    load_swizzled<T, BLOCK_N, D, L::KV_SLAB, 384>(base + L::K, k, head_dim, tid, [&](int r) -> const T* {
        return n0 + r < seqlen_k ? kbase + (index_t)(n0 + r) * p.a.k_stride[1] : nullptr;
    });
    load_swizzled<T, BLOCK_N, D, L::KV_SLAB, 384>(base + L::V, v, head_dim, tid, [&](int r) -> const T* {
        return n0 + r < seqlen_k ? vbase + (index_t)(n0 + r) * p.a.v_stride[1] : nullptr;
    });
    ws_tiles_loaded();

    if (tid >= CONSUMERS) {
        // =========================== producer warpgroup ===========================
        // Per row tile, into stage m % STAGES once it is free: thread pt's stats
        // value (lse2 of row pt, or delta of row pt - 64) by cp.async, then an
        // arrival when it lands; Q and dO by thread 0's bulk copies (its
        // expect_tx is the 129th arrival), or by every thread's cp.async,
        // each thread arriving once they have landed and the 129th from thread 0.
        regs_dec<WS_PRODUCER_REGS>();
        const int pt = tid - CONSUMERS;
        // pt < 64: lse2 [st][pt]; else delta [st][pt - 64]
        const unsigned stats = base + L::STATS + 4 * ((pt < BLOCK_M ? 0 : STAGES * BLOCK_M) + (pt & (BLOCK_M - 1)));
        const float* stats_ws = pt < BLOCK_M ? lse2_ws : delta_ws;
        const index_t ws0 = ws_row(p, b, kvh, 0) + (pt & (BLOCK_M - 1));
        for (int m = 0; m < num_m; ++m) {
            const int st = m % STAGES;
            if (m >= STAGES) mbar_wait(empty(st), ((m / STAGES) + 1) & 1);  // its use m - STAGES is done
            const int m0 = kb.m_begin + m * BLOCK_M;
            const bool row_ok = m0 + (pt & (BLOCK_M - 1)) < kb.packed_rows;
            cp_async_4(stats + 4 * st * BLOCK_M, stats_ws + ws0 + m0, row_ok);
            const unsigned q_at = base + L::Q + st * L::R_BYTES, do_at = base + L::DO + st * L::R_BYTES;
            if (bulk) {
                cp_async_mbar_arrive(full(st));
                if (pt == 0) {
                    mbar_expect_tx(full(st), 2 * L::R_BYTES);
#pragma unroll
                    for (int sl = 0; sl < L::SLABS; ++sl) {
                        tma_load_4d(q_at + sl * L::R_SLAB, q_map, full(st), sl * 64, kvh * group, m0 / group, b);
                        tma_load_4d(do_at + sl * L::R_SLAB, do_map, full(st), sl * 64, kvh * group, m0 / group, b);
                    }
                }
            } else {
                auto packed = [&](const T* x, const index_t* xs) {
                    return [=](int r) { return packed_row_ptr(x, xs, b, kvh, group, kb.packed_rows, m0 + r); };
                };
                load_swizzled<T, BLOCK_M, D, L::R_SLAB, 128>(q_at, q, head_dim, pt, packed(q, p.a.q_stride));
                load_swizzled<T, BLOCK_M, D, L::R_SLAB, 128>(do_at, dout, head_dim, pt, packed(dout, p.do_stride));
                cp_async_wait_all();
                fence_proxy_async();  // this thread's writes before the consumers' wgmma reads
                mbar_arrive(full(st));
                if (pt == 0) mbar_arrive(full(st));
            }
        }
        cp_async_wait_all();  // nothing in flight when the warpgroup exits
        return;
    }

    // ============================ consumer warpgroups ============================
    regs_inc<WS_CONSUMER_REGS>();
    const int lane = tid & 31, warp = tid >> 5;
    float scale_log2 = (float)p.a.scale_log2;
    asm volatile("" : "+f"(scale_log2));  // (converted once, not per tile)
    float dk_acc[DT][4], dv_acc[DT][4];
#pragma unroll
    for (int dt = 0; dt < DT; ++dt)
#pragma unroll
        for (int e = 0; e < 4; ++e) dk_acc[dt][e] = dv_acc[dt][e] = 0.f;
    int key_r[2];  // the lane's keys (rows of S^T)
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) key_r[hf] = n0 + warp * 16 + (lane >> 2) + hf * 8;
    const int wg = __shfl_sync(0xffffffffu, tid / 128, 0);  // A's rows [64 wg, 64 wg + 64) of the K and V tiles
    const unsigned long long desc_k = make_smem_desc(base + L::K + wg * 64 * 128, 16, 1024);
    const unsigned long long desc_v = make_smem_desc(base + L::V + wg * 64 * 128, 16, 1024);

    for (int m = 0; m < num_m; ++m) {
        const int st = m % STAGES;
        mbar_wait(full(st), (m / STAGES) & 1);
        const int m0 = kb.m_begin + m * BLOCK_M;
        const unsigned q_at = base + L::Q + st * L::R_BYTES, do_at = base + L::DO + st * L::R_BYTES;

        dkdv_tile_wgmma<T, D, BLOCK_M, BLOCK_N, KD, L::KV_SLAB, L::R_SLAB, CAUSAL, M>(
            dk_acc, dv_acc, desc_k, desc_v, q_at, do_at, sLse2 + st * BLOCK_M, sDelta + st * BLOCK_M, m0, key_r, lane,
            scale_log2, kb, mp);
        mbar_arrive(empty(st));  // the stage is free for the producer
    }

    // ---- dk = scale dK, dv = dV from the registers ----
    store_dk_dv_acc<T, DT>(dk_acc, dv_acc, dk, dv, p, b, kvh, key_r, lane, head_dim, len < 0 ? quiet_nan() : (float)p.scale,
                           len < 0 ? quiet_nan() : 1.f);
}
template <typename T, int HEAD_DIM, int BLOCK_M, int STAGES, bool CAUSAL, int SMEM_BYTES>
__global__ void __launch_bounds__(384, 1)
bwd_dkdv_ws(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v, const T* __restrict__ dout,
            const float* __restrict__ delta_ws, const float* __restrict__ lse2_ws, T* __restrict__ dk,
            T* __restrict__ dv, const int* __restrict__ seqlens_k, const BwdParams p,
            const __grid_constant__ sm90::TensorMap q_map, const __grid_constant__ sm90::TensorMap do_map,
            const int bulk) {
    bwd_dkdv_ws_body<T, HEAD_DIM, BLOCK_M, STAGES, CAUSAL, SMEM_BYTES, NoMods>(
        q, k, v, dout, delta_ws, lse2_ws, dk, dv, seqlens_k, p, ModParams{}, q_map, do_map, bulk);
}
// The same with modifiers (FLAGS: common.cuh, MOD_*; no MOD_SCORE), their ModParams after the BwdParams.
template <typename T, int HEAD_DIM, int BLOCK_M, int STAGES, bool CAUSAL, int SMEM_BYTES, int FLAGS>
__global__ void __launch_bounds__(384, 1)
bwd_dkdv_ws_mods(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v, const T* __restrict__ dout,
                 const float* __restrict__ delta_ws, const float* __restrict__ lse2_ws, T* __restrict__ dk,
                 T* __restrict__ dv, const int* __restrict__ seqlens_k, const BwdParams p, const ModParams mp,
                 const __grid_constant__ sm90::TensorMap q_map, const __grid_constant__ sm90::TensorMap do_map,
                 const int bulk) {
    bwd_dkdv_ws_body<T, HEAD_DIM, BLOCK_M, STAGES, CAUSAL, SMEM_BYTES, Mods<FLAGS, true>>(
        q, k, v, dout, delta_ws, lse2_ws, dk, dv, seqlens_k, p, mp, q_map, do_map, bulk);
}

// ---- 2b. dQ in float32 on the tensor cores (split TF32) --------------------------------
// bwd_dq_mma's grid, key range and pipeline on float32 tiles (kernels/tf32.cuh:
// three TF32 products per product, fp32-class error), with one addition: like
// bwd_dq_rows for float32, it rebuilds each row's lse2 from its own scores (the
// forward's lse comes from other arithmetic, and at scores of a few hundred the
// difference would move every P by more than the gradients' accuracy). It runs
// the forward's online softmax on them (softmax.cuh: frag_update): dQ
// accumulates exp2(s - m) (dP - delta) K, rescaled as m rises and divided by l
// at the end, and lse2 = m + log2 l goes to the workspace for bwd_dkdv_tf32,
// whose scores are these bits (two_products_tf32: SWAPPED). PRESPLIT: where
// the operands are split (as in kernels/tiled_tf32.cu): 0 in registers at
// each use, 1 each K and V tile once per CTA, 2 also Q and dO, once. DSPLIT:
// warps sharing a 16-row slab, each with head dims [dpart DH, + DH) of its dQ
// (DSPLIT = 4 above head dim 128, where a warp's whole rows would spill, and
// with two ptxas, 8 to 60 bytes, at the half); each computes the slab's S and
// dP (the same bits, so the same m and l).
template <int HEAD_DIM, int BLOCK_M, int BLOCK_N, int ROW_WARPS, int DSPLIT, bool CAUSAL, int PRESPLIT, int SMEM_BYTES>
__global__ void __launch_bounds__(ROW_WARPS * DSPLIT * 32, 1)
bwd_dq_tf32(const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,
            const float* __restrict__ dout, const float* __restrict__ delta_ws, float* __restrict__ lse2_ws,
            float* __restrict__ dq, const int* __restrict__ seqlens_k, const BwdParams p) {
    using namespace bwd_detail;
    using namespace tf32_detail;
    constexpr int D = HEAD_DIM;
    constexpr int NTHREADS = ROW_WARPS * DSPLIT * 32;
    constexpr int DH = D / DSPLIT;   // head dims of a warp's dQ
    using L = DqTf32Smem<D, BLOCK_M, BLOCK_N, PRESPLIT>;
    constexpr int ROW = L::ROW;
    constexpr int KD = D / 8;        // k8 steps of Q K^T and dO V^T
    constexpr int NT = BLOCK_N / 8;  // n8 tiles of S and dP (k8 steps of dS K)
    constexpr int DT = DH / 8;       // n8 tiles of the warp's dQ
    static_assert(BLOCK_M == 16 * ROW_WARPS, "16 rows per slab");
    static_assert(D % 32 == 0 && DH % 8 == 0 && BLOCK_N % 16 == 0, "tile shapes");
    static_assert(PRESPLIT >= 0 && PRESPLIT <= 2, "PRESPLIT: 0, 1 or 2");
    static_assert(SMEM_BYTES == L::BYTES, "SMEM_BYTES is not the size of the shared-memory layout");

    extern __shared__ __align__(16) unsigned char smem_raw[];
    float* const smem = reinterpret_cast<float*>(smem_raw);
    float* sQ = smem + L::Q;
    float* sdO = smem + L::DO;
    float* sK = smem + L::K;
    float* sV = smem + L::V;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g_lane = lane >> 2, c_lane = lane & 3;
    const int slab = warp % ROW_WARPS, dpart = warp / ROW_WARPS;  // rows [16 slab, + 16), dims [dpart DH, + DH)
    const float scale_log2 = (float)p.a.scale_log2;
    const int head_dim = p.a.head_dim;

    // ---- this CTA's (b, kv head, rows) and keys: the forward's (common.cuh) ----
    const PrefillTile<CAUSAL> tile = prefill_tile<CAUSAL, BLOCK_M>(p.a, seqlens_k, p.a.group_size, blockIdx.x);
    const int b = tile.b, kvh = tile.kv_head, row0 = tile.row0, group = tile.group, packed_rows = tile.packed_rows;
    const int len = tile.len, seqlen_k = tile.seqlen_k;  // len -1: a bad seqlens_k value, NaN rows
    const KeyRange<CAUSAL>& keys = tile.keys;
    const int num_n = (keys.end + BLOCK_N - 1) / BLOCK_N;
    const float* kbase = k + b * p.a.k_stride[0] + (index_t)kvh * p.a.k_stride[2];
    const float* vbase = v + b * p.a.v_stride[0] + (index_t)kvh * p.a.v_stride[2];

    load_q_do<float, BLOCK_M, D, ROW, NTHREADS>(sQ, sdO, q, dout, p, b, kvh, row0, packed_rows, group, head_dim, tid);
    auto load_kv = [&](int j, int stage) {
        load_k_v<float, BLOCK_N, D, ROW, NTHREADS>(sK + stage * L::STAGE, sV + stage * L::STAGE, kbase, vbase, k, v, p,
                                              j * BLOCK_N, seqlen_k, head_dim, tid);
    };
    if (num_n > 0) load_kv(0, 0);
    cp_async_commit();  // group 0: Q, dO and K/V tile 0

    float delta_r[2];  // the lane's rows g and g + 8 of the warp's 16
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
        const int pr = row0 + slab * 16 + g_lane + hf * 8;
        delta_r[hf] = pr < packed_rows ? delta_ws[ws_row(p, b, kvh, pr)] : 0.f;
    }
    float dq_acc[DT][4];
#pragma unroll
    for (int dt = 0; dt < DT; ++dt)
#pragma unroll
        for (int e = 0; e < 4; ++e) dq_acc[dt][e] = 0.f;
    float m_run[2] = {neg_inf<float>(), neg_inf<float>()}, l_run[2] = {0.f, 0.f};

    // ldmatrix lane offsets (kernels/tiled_tf32.cu): a_off for the slab's rows of
    // A (Q, dO), k_off for B read from rows of its n index (K, V)
    const int a_off = (slab * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * ROW + (lane >> 4) * 4;
    const int k_off = ((lane & 7) + (lane >> 4) * 8) * ROW + ((lane >> 3) & 1) * 4;
    constexpr int Q_SMALL = (L::Q_SMALL - L::Q) * 4;  // bytes from a big part to its small part (PRESPLIT 2)

    for (int j = 0; j < num_n; ++j) {
        const int stage = j & 1;
        cp_async_wait<0>();  // tile j landed for this thread
        __syncthreads();     // ... for all; the other stage's tile is consumed
        if (j + 1 < num_n) load_kv(j + 1, stage ^ 1);
        cp_async_commit();
        float* sKs = sK + stage * L::STAGE;
        float* sVs = sV + stage * L::STAGE;
        if (PRESPLIT >= 1) {  // big parts in place, small parts beside, each element once per CTA
            if (PRESPLIT == 2 && j == 0) {
                split_tile<BLOCK_M, D, ROW, NTHREADS>(sQ, smem + L::Q_SMALL, tid);
                split_tile<BLOCK_M, D, ROW, NTHREADS>(sdO, smem + L::DO_SMALL, tid);
            }
            split_tile<BLOCK_N, D, ROW, NTHREADS>(sKs, smem + L::K_SMALL, tid);
            split_tile<BLOCK_N, D, ROW, NTHREADS>(sVs, smem + L::V_SMALL, tid);
            __syncthreads();
        }
        const int k_small = (L::K_SMALL - L::K - stage * L::STAGE) * 4;
        const int v_small = (L::V_SMALL - L::V - stage * L::STAGE) * 4;

        // ---- S = Q K^T, dP = dO V^T ----
        float sdp[2][NT][4];
        float (&s)[NT][4] = sdp[0];
        float (&dp)[NT][4] = sdp[1];
        {
            const unsigned a[2] = {smem_addr(sQ + a_off), smem_addr(sdO + a_off)};
            const unsigned bb[2] = {smem_addr(sKs + k_off), smem_addr(sVs + k_off)};
            const int a_small[2] = {Q_SMALL, Q_SMALL}, b_small[2] = {k_small, v_small};
            products_tf32<2, NT, KD, ROW, PRESPLIT == 2, PRESPLIT >= 1, false>(sdp, a, a_small, bb, b_small);
        }

        // ---- mask (tiles crossing the diagonal or the end of the keys), softmax.cuh's rule ----
        const int n0 = j * BLOCK_N;
        if (n0 + BLOCK_N > keys.free) {
            int last[2];
#pragma unroll
            for (int hf = 0; hf < 2; ++hf) last[hf] = keys.last_key(row0 + slab * 16 + g_lane + hf * 8);
            softmax::frag_mask(s, n0, lane, last);
        }

        // ---- the online softmax: s becomes exp2(s scale_log2 - m), dQ and l follow m ----
        softmax::frag_update<0, true>(s, dq_acc, m_run, l_run, scale_log2, softmax::ExactExp2());

        // ---- dS = P (dP - delta), unnormalised; dQ += dS K (K: B of rows 2c, 2c+1) ----
#pragma unroll
        for (int kk = 0; kk < NT; ++kk)
#pragma unroll
            for (int e = 0; e < 4; ++e) s[kk][e] *= dp[kk][e] - delta_r[e >> 1];
        const int lane_at = 2 * c_lane * ROW + dpart * DH + g_lane;
        acc_rows_product<PRESPLIT >= 1, NT, DT, ROW>(dq_acc, s, sKs + lane_at, smem + L::K_SMALL + lane_at);
    }
    cp_async_wait<0>();  // nothing in flight (also when num_n == 0)
    __syncthreads();     // every warp is done with the tiles

    // ---- dq = scale dQ / l and lse2 = m + log2 l (+inf: no key seen; NaN: bad length) ----
    float* sO = sQ + slab * 16 * ROW + dpart * DH;  // the slab's Q rows, the warp's dims
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
        float l;
        const float f = softmax::frag_row_end<false>(l_run[hf], m_run[hf], l, len < 0, [] { return 0.f; }) * (float)p.scale;
        const int r = g_lane + hf * 8;
#pragma unroll
        for (int dt = 0; dt < DT; ++dt) {
            sO[r * ROW + dt * 8 + c_lane * 2] = dq_acc[dt][2 * hf] * f;
            sO[r * ROW + dt * 8 + c_lane * 2 + 1] = dq_acc[dt][2 * hf + 1] * f;
        }
        const int pr = row0 + slab * 16 + r;
        if (dpart == 0 && c_lane == 0 && pr < packed_rows)
            lse2_ws[ws_row(p, b, kvh, pr)] = len < 0 ? quiet_nan() : l > 0.f ? m_run[hf] + log2f(l) : pos_inf<float>();
    }
    if (DSPLIT == 1) {  // a warp's rows are its own
        __syncwarp();
        store_dq<float, 16, D, ROW, 32>(sQ + slab * 16 * ROW, dq, p, b, kvh, row0 + slab * 16, packed_rows, group, head_dim, lane);
    } else {
        __syncthreads();
        store_dq<float, BLOCK_M, D, ROW, NTHREADS>(sQ, dq, p, b, kvh, row0, packed_rows, group, head_dim, tid);
    }
}

// ---- 3b. dK, dV in float32 on the tensor cores (split TF32) -----------------------------
// bwd_dkdv_mma's grid, row tiles and pipeline on float32 tiles: K and V are split
// once (big parts in place, small parts beside), each Q and dO tile once when
// it lands; S^T = K Q^T carries the bits of bwd_dq_tf32's S, so P^T = exp2(S^T
// scale_log2 - lse2) uses the lse2 that kernel rebuilt from them. dV += P^T dO
// and dK += dS^T Q take P^T and dS^T from the accumulators (tf32.cuh: frag_a),
// each row tile's product in fresh accumulators.
template <int HEAD_DIM, int BLOCK_M, int KEY_WARPS, int DSPLIT, bool CAUSAL, int SMEM_BYTES>
__global__ void __launch_bounds__(KEY_WARPS * DSPLIT * 32, 1)
bwd_dkdv_tf32(const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,
              const float* __restrict__ dout, const float* __restrict__ delta_ws, const float* __restrict__ lse2_ws,
              float* __restrict__ dk, float* __restrict__ dv, const int* __restrict__ seqlens_k, const BwdParams p) {
    using namespace bwd_detail;
    using namespace tf32_detail;
    constexpr int D = HEAD_DIM;
    constexpr int NTHREADS = KEY_WARPS * DSPLIT * 32;
    constexpr int BLOCK_N = 16 * KEY_WARPS;  // keys per CTA
    constexpr int DH = D / DSPLIT;           // head dims of a warp's dK, dV
    using L = DkvTf32Smem<D, BLOCK_N, BLOCK_M>;
    constexpr int ROW = L::ROW;
    constexpr int KD = D / 8;        // k8 steps of K Q^T and V dO^T
    constexpr int NT = BLOCK_M / 8;  // n8 tiles of S^T and dP^T (packed rows; k8 steps of dV, dK)
    constexpr int DTH = DH / 8;      // n8 tiles of the warp's dK, dV
    static_assert(D % 32 == 0 && DH % 8 == 0 && BLOCK_M % 16 == 0, "tile shapes");
    static_assert(SMEM_BYTES == L::BYTES, "SMEM_BYTES is not the size of the shared-memory layout");

    extern __shared__ __align__(16) unsigned char smem_raw[];
    float* const smem = reinterpret_cast<float*>(smem_raw);
    float* sK = smem + L::K;
    float* sV = smem + L::V;
    float* sQ = smem + L::Q;
    float* sdO = smem + L::DO;
    float* sLse2 = reinterpret_cast<float*>(smem_raw + L::LSE2_BYTE);
    float* sDelta = reinterpret_cast<float*>(smem_raw + L::DELTA_BYTE);
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g_lane = lane >> 2, c_lane = lane & 3;
    const int ks = warp % KEY_WARPS, dpart = warp / KEY_WARPS;  // key slab, head-dim part
    const float scale_log2 = (float)p.a.scale_log2;
    const int head_dim = p.a.head_dim;

    // ---- this CTA's (key block, b, kv head): key blocks slowest ----
    const KeyBlock kb = key_block<CAUSAL, BLOCK_N, BLOCK_M>(p, seqlens_k, ModParams{});
    const int b = kb.b, kvh = kb.kvh, n0 = kb.n0, len = kb.len, seqlen_k = kb.seqlen_k;
    const int m_begin = kb.m_begin, num_m = kb.num_m;

    load_k_v<float, BLOCK_N, D, ROW, NTHREADS>(sK, sV, k + b * p.a.k_stride[0] + (index_t)kvh * p.a.k_stride[2],
                                          v + b * p.a.v_stride[0] + (index_t)kvh * p.a.v_stride[2], k, v, p, n0, seqlen_k,
                                          head_dim, tid);
    auto load_rows = [&](int m, int stage) {
        load_row_tile<float, BLOCK_M, D, ROW, NTHREADS>(sQ + stage * L::STAGE, sdO + stage * L::STAGE,
                                                        sLse2 + stage * BLOCK_M, sDelta + stage * BLOCK_M, q, dout,
                                                        lse2_ws, delta_ws, p, kb, m_begin + m * BLOCK_M, head_dim, tid);
    };
    if (num_m > 0) load_rows(0, 0);
    cp_async_commit();  // group 0: K, V and row tile 0

    float dk_acc[DTH][4], dv_acc[DTH][4];
#pragma unroll
    for (int dt = 0; dt < DTH; ++dt)
#pragma unroll
        for (int e = 0; e < 4; ++e) dk_acc[dt][e] = dv_acc[dt][e] = 0.f;

    // ldmatrix lane offsets: a_off for the warp's 16 keys of K and V (A), k_off
    // for the packed rows of Q and dO (B, read from rows of its n index)
    const int a_off = (ks * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * ROW + (lane >> 4) * 4;
    const int k_off = ((lane & 7) + (lane >> 4) * 8) * ROW + ((lane >> 3) & 1) * 4;
    constexpr int K_SMALL = (L::K_SMALL - L::K) * 4, V_SMALL = (L::V_SMALL - L::V) * 4;  // bytes, big to small
    int key_r[2];  // the lane's keys (rows of S^T)
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) key_r[hf] = n0 + ks * 16 + g_lane + hf * 8;

    for (int m = 0; m < num_m; ++m) {
        const int stage = m & 1;
        cp_async_wait<0>();  // row tile m landed for this thread
        __syncthreads();     // ... for all (and its lse2, delta); the other stage is consumed
        if (m + 1 < num_m) load_rows(m + 1, stage ^ 1);
        cp_async_commit();
        const int m0 = m_begin + m * BLOCK_M;
        float* sQs = sQ + stage * L::STAGE;
        float* sdOs = sdO + stage * L::STAGE;
        if (m == 0) {  // K and V: landed with row tile 0
            split_tile<BLOCK_N, D, ROW, NTHREADS>(sK, smem + L::K_SMALL, tid);
            split_tile<BLOCK_N, D, ROW, NTHREADS>(sV, smem + L::V_SMALL, tid);
        }
        split_tile<BLOCK_M, D, ROW, NTHREADS>(sQs, smem + L::Q_SMALL, tid);
        split_tile<BLOCK_M, D, ROW, NTHREADS>(sdOs, smem + L::DO_SMALL, tid);
        __syncthreads();
        const int q_small = (L::Q_SMALL - L::Q - stage * L::STAGE) * 4;
        const int do_small = (L::DO_SMALL - L::DO - stage * L::STAGE) * 4;

        // ---- S^T = K Q^T, dP^T = V dO^T (rows: the warp's 16 keys; columns: packed rows) ----
        float sdp[2][NT][4];
        float (&s)[NT][4] = sdp[0];
        float (&dpt)[NT][4] = sdp[1];
        {
            const unsigned a[2] = {smem_addr(sK + a_off), smem_addr(sV + a_off)};
            const unsigned bb[2] = {smem_addr(sQs + k_off), smem_addr(sdOs + k_off)};
            const int a_small[2] = {K_SMALL, V_SMALL}, b_small[2] = {q_small, do_small};
            products_tf32<2, NT, KD, ROW, true, true, true>(sdp, a, a_small, bb, b_small);
        }

        // ---- mask: keys past the sequence, and (causal) rows that don't see the key ----
        if (n0 + BLOCK_N > seqlen_k || (CAUSAL && n0 + BLOCK_N - 1 > m0 / kb.group + kb.diag))
            mask_keys_t<CAUSAL>(s, key_r, m0, lane, kb);

        // ---- P^T = exp2(S^T scale_log2 - lse2) (masked: 0), dS^T = P^T (dP^T - delta) ----
        probs_t(s, dpt, scale_log2, sLse2 + stage * BLOCK_M, sDelta + stage * BLOCK_M, lane, softmax::ExactExp2());

        // ---- dV += P^T dO, then dK += dS^T Q (the warp's head dims; B of rows 2c, 2c+1) ----
        const int lane_at = 2 * c_lane * ROW + dpart * DH + g_lane;
        acc_rows_product<true, NT, DTH, ROW>(dv_acc, s, sdOs + lane_at, smem + L::DO_SMALL + lane_at);
        acc_rows_product<true, NT, DTH, ROW>(dk_acc, dpt, sQs + lane_at, smem + L::Q_SMALL + lane_at);
    }
    cp_async_wait<0>();  // nothing in flight (also when num_m == 0)
    __syncthreads();     // every warp is done with K and V

    // ---- dk = scale dK, dv = dV, through the K and V tiles, then 16-byte stores ----
    const float sc_k = len < 0 ? quiet_nan() : (float)p.scale;
    const float sc_v = len < 0 ? quiet_nan() : 1.f;
    float* sdK = sK + ks * 16 * ROW + dpart * DH;
    float* sdV = sV + ks * 16 * ROW + dpart * DH;
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
        const int r = g_lane + hf * 8;
#pragma unroll
        for (int dt = 0; dt < DTH; ++dt) {
            const int off = r * ROW + dt * 8 + c_lane * 2;
            sdK[off] = dk_acc[dt][2 * hf] * sc_k;
            sdK[off + 1] = dk_acc[dt][2 * hf + 1] * sc_k;
            sdV[off] = dv_acc[dt][2 * hf] * sc_v;
            sdV[off + 1] = dv_acc[dt][2 * hf + 1] * sc_v;
        }
    }
    __syncthreads();
    store_dk_dv<float, BLOCK_N, D, ROW, NTHREADS>(sK, sV, dk, dv, p, b, kvh, n0, head_dim, tid);
}

// ---- CUDA-core kernels: any dtype, head dim and strides ------------------------------------
#define BWD_ROWS_THREADS 128

namespace bwd_detail {

// Sum over the team's lanes (TEAM consecutive lanes, a power of two).
template <int TEAM, typename A>
__device__ __forceinline__ A team_sum(A x, unsigned mask) {
#pragma unroll
    for (int off = TEAM / 2; off > 0; off /= 2) x += __shfl_xor_sync(mask, x, off);
    return x;
}

template <int TEAM>
__device__ __forceinline__ unsigned team_mask() {
    return TEAM == 32 ? 0xffffffffu : (((1u << TEAM) - 1u) << ((threadIdx.x % 32) / TEAM * TEAM));
}

// Keys [key0, key0 + KEYS) of k or v at (b, kvh) (base) into s[KEYS][DPAD]: any
// strides; zeros at keys >= n_keys and dims >= head_dim.
template <typename T, int DPAD, int KEYS>
__device__ __forceinline__ void stage_keys(T* s, const T* base, index_t stride_s, index_t stride_d, int key0, int n_keys,
                                           int head_dim) {
    for (int e = threadIdx.x; e < KEYS * DPAD; e += BWD_ROWS_THREADS) {
        const int j = e / DPAD, d = e - (e / DPAD) * DPAD;
        const bool ok = key0 + j < n_keys && d < head_dim;
        s[e] = ok ? base[(index_t)(key0 + j) * stride_s + d * stride_d] : from_acc<T>((acc_t<T>)0);
    }
}

// Packed rows [row0, row0 + ROWS) of (b, kvh) of a (batch, seq, head, dim)
// tensor x (strides st) into s[ROWS][DPAD]; zeros past packed_rows and head_dim.
template <typename T, int DPAD, int ROWS>
__device__ __forceinline__ void stage_packed_rows(T* s, const T* x, const index_t* st, int b, int kvh, int row0,
                                                  int packed_rows, int group, int head_dim) {
    for (int e = threadIdx.x; e < ROWS * DPAD; e += BWD_ROWS_THREADS) {
        const int i = e / DPAD, d = e - (e / DPAD) * DPAD;
        const int pr = row0 + i;
        const bool ok = pr < packed_rows && d < head_dim;
        const int t = pr / group, g = pr - (pr / group) * group;
        s[e] = ok ? x[b * st[0] + (index_t)t * st[1] + (index_t)q_head_of(kvh, g, group) * st[2] + d * st[3]]
                  : from_acc<T>((acc_t<T>)0);
    }
}

}  // namespace bwd_detail

namespace bwd_detail {
// A CUDA-core kernel's score of key j for its row (query t, head h, mods::Row mr)
// from the raw product s = q . k, in log2 units: s scale_log2 without modifiers;
// with them the modified score (mods::score_nat_grad, natural units from
// softmax_scale) times log2(e), and the softcap's slope in grad.
template <class M, typename A>
__device__ __forceinline__ A rows_score2(A s, A scale_log2, A scale, const ModParams& mp, const mods::Seq& sq,
                                         const mods::Row& mr, int j, A& grad) {
    if constexpr (M::SCORES) {
        return mods::score_nat_grad<M, true, A>(s * scale, mp, sq, mr.t, mr.h, mr.slope, j, &grad) * log2e<A>();
    } else {
        grad = (A)1;
        return s * scale_log2;
    }
}
}  // namespace bwd_detail

// dQ (and, in float64, lse2) on CUDA cores. SMEM_BYTES: _specs.bwd_rows_dq_smem.
// The kernel's body, for the kernel without modifiers (M = NoMods) and the one
// with them (bwd_dq_rows_mods).
template <typename T, int DPAD, int TEAM, int KEYS, int SMEM_BYTES, class M>
__device__ __forceinline__ void bwd_dq_rows_body(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                                                 const T* __restrict__ dout, const acc_t<T>* __restrict__ delta_ws,
                                                 acc_t<T>* __restrict__ lse2_ws, T* __restrict__ dq,
                                                 const int* __restrict__ seqlens_k, const BwdParams& p,
                                                 const ModParams& mp) {
    using namespace bwd_detail;
    typedef acc_t<T> A;
    // float32 and float64 inputs: rebuild lse2 from this kernel's own exact
    // scores. The forward's lse comes from other arithmetic (split TF32, or
    // float32 for float64), and at scores of a few hundred the difference
    // moves every P by more than the gradients' float32 accuracy.
    constexpr bool RECOMPUTE = sizeof(T) >= 4;
    constexpr int PL = DPAD / TEAM;             // dims per lane: d = i * TEAM + lane
    constexpr int R = BWD_ROWS_THREADS / TEAM;  // rows per CTA
    using L = DqRowsSmem<T, DPAD, KEYS>;
    static_assert(PL * TEAM == DPAD && (TEAM & (TEAM - 1)) == 0 && TEAM <= 32, "team shape");
    static_assert(SMEM_BYTES == L::BYTES, "SMEM_BYTES is not the size of the shared-memory layout");
    extern __shared__ __align__(16) unsigned char smem_raw[];
    T* sK = reinterpret_cast<T*>(smem_raw) + L::K;
    T* sV = reinterpret_cast<T*>(smem_raw) + L::V;

    const int lane = threadIdx.x % TEAM, r = threadIdx.x / TEAM;
    const unsigned mask = team_mask<TEAM>();
    const int group = p.a.group_size, packed_rows = p.a.seqlen_q * group;
    const int num_bh = p.a.batch * p.a.num_kv_heads;
    const int row_blocks = (packed_rows + R - 1) / R;
    const int rb = row_blocks - 1 - (int)(blockIdx.x / num_bh);  // the latest (longest causal) rows first
    const int bh = (int)(blockIdx.x % num_bh), b = bh / p.a.num_kv_heads, kvh = bh - b * p.a.num_kv_heads;
    const int len = seqlen_k_of(seqlens_k, b, p.a.seqlen_k), seqlen_k = max(len, 0);
    const bool causal = p.a.causal != 0;

    const int pr = rb * R + r;
    const bool active = pr < packed_rows;
    const int t = active ? pr / group : 0, h = q_head_of(kvh, active ? pr - t * group : 0, group);
    // the row's keys [first, n_keys) and the block's [k_lo, n_block) (its first and last rows')
    const mods::Seq sq = mods::seq(b, p.a.seqlen_q, seqlen_k);
    mods::Row mr = {t, h, 0, -1, 0.f};
    int k_lo = 0, n_block;
    if constexpr (M::ANY) {
        if (active) mr = mods::row<M>(mp, sq, t, h, causal);
        const int h0 = q_head_of(kvh, 0, group);
        k_lo = mods::row<M>(mp, sq, rb * R / group, h0, causal).first;
        n_block = mods::row<M>(mp, sq, (min(rb * R + R, packed_rows) - 1) / group, h0, causal).last + 1;
    } else {
        mr.last = (active ? visible_keys(t, p.a.seqlen_q, seqlen_k, causal) : 0) - 1;
        n_block = visible_keys((min(rb * R + R, packed_rows) - 1) / group, p.a.seqlen_q, seqlen_k, causal);  // its last row's keys
    }
    const int first = mr.first, n_keys = mr.last + 1;
    const A scale_log2 = (A)p.a.scale_log2, scale = (A)p.scale;  // (scale: the modifiers' natural units)

    A qv[PL], dov[PL], acc[PL];
    const T* q_row = q + b * p.a.q_stride[0] + (index_t)t * p.a.q_stride[1] + (index_t)h * p.a.q_stride[2];
    const T* do_row = dout + b * p.do_stride[0] + (index_t)t * p.do_stride[1] + (index_t)h * p.do_stride[2];
#pragma unroll
    for (int i = 0; i < PL; ++i) {
        const int d = i * TEAM + lane;
        const bool ok = active && d < p.a.head_dim;
        qv[i] = ok ? to_acc(q_row[d * p.a.q_stride[3]]) : (A)0;
        dov[i] = ok ? to_acc(do_row[d * p.do_stride[3]]) : (A)0;
        acc[i] = 0;
    }
    const index_t ws = active ? ws_row(p, b, kvh, pr) : 0;
    const A delta = active ? delta_ws[ws] : (A)0;
    A lse2 = (!RECOMPUTE && active) ? lse2_ws[ws] : (A)0;
    const T* kbase = k + b * p.a.k_stride[0] + (index_t)kvh * p.a.k_stride[2];
    const T* vbase = v + b * p.a.v_stride[0] + (index_t)kvh * p.a.v_stride[2];
    const int st_first = k_lo / KEYS, n_stages = (n_block + KEYS - 1) / KEYS;  // stages [st_first, n_stages)

    if constexpr (RECOMPUTE) {  // lse2 = log2 sum_j exp2(s_j), online (softmax.cuh's rules), with the sink
        A m = neg_inf<A>(), l = 0;
        for (int st = st_first; st < n_stages; ++st) {
            __syncthreads();
            stage_keys<T, DPAD, KEYS>(sK, kbase, p.a.k_stride[1], p.a.k_stride[3], st * KEYS, n_block, p.a.head_dim);
            __syncthreads();
            const int j_end = min(KEYS, n_keys - st * KEYS);
            for (int j = M::ANY ? max(0, first - st * KEYS) : 0; j < j_end; ++j) {
                if (M::MASK && !mods::visible<M>(mp, sq, mr, st * KEYS + j)) continue;  // (the team's row: uniform)
                A sd = 0, grad;
#pragma unroll
                for (int i = 0; i < PL; ++i) sd += qv[i] * to_acc(sK[j * DPAD + i * TEAM + lane]);
                const A sj = rows_score2<M>(team_sum<TEAM>(sd, mask), scale_log2, scale, mp, sq, mr, st * KEYS + j, grad);
                const A alpha = softmax::raise_ref(m, m > sj ? m : sj, softmax::ExactExp2());
                l = l * alpha + exp2_acc(sj - softmax::ref(m));
            }
        }
        if constexpr (M::SINKS) {
            if (active) softmax::fold_sink(m, l, (A)mp.sinks[h] * log2e<A>());
        }
        lse2 = l > (A)0 ? m + log2_acc(l) : pos_inf<A>();
        if (active && lane == 0) lse2_ws[ws] = lse2;
    }

    for (int st = st_first; st < n_stages; ++st) {
        __syncthreads();  // the previous stage is consumed
        stage_keys<T, DPAD, KEYS>(sK, kbase, p.a.k_stride[1], p.a.k_stride[3], st * KEYS, n_block, p.a.head_dim);
        stage_keys<T, DPAD, KEYS>(sV, vbase, p.a.v_stride[1], p.a.v_stride[3], st * KEYS, n_block, p.a.head_dim);
        __syncthreads();
        const int j_end = min(KEYS, n_keys - st * KEYS);  // this row's keys in the stage
        for (int j = M::ANY ? max(0, first - st * KEYS) : 0; j < j_end; ++j) {
            if (M::MASK && !mods::visible<M>(mp, sq, mr, st * KEYS + j)) continue;  // (the team's row: uniform)
            A sd = 0, dd = 0, grad;
#pragma unroll
            for (int i = 0; i < PL; ++i) {
                sd += qv[i] * to_acc(sK[j * DPAD + i * TEAM + lane]);
                dd += dov[i] * to_acc(sV[j * DPAD + i * TEAM + lane]);
            }
            const A sj = rows_score2<M>(team_sum<TEAM>(sd, mask), scale_log2, scale, mp, sq, mr, st * KEYS + j, grad);
            const A dpj = team_sum<TEAM>(dd, mask);
            const A pj = exp2_acc(sj - lse2);
            const A ds = pj * (dpj - delta) * grad;
#pragma unroll
            for (int i = 0; i < PL; ++i) acc[i] += ds * to_acc(sK[j * DPAD + i * TEAM + lane]);
        }
    }

    if (active) {
        const A sc = len < 0 ? (A)quiet_nan() : (A)p.scale;
        T* dq_row = dq + b * p.dq_stride[0] + (index_t)t * p.dq_stride[1] + (index_t)h * p.dq_stride[2];
#pragma unroll
        for (int i = 0; i < PL; ++i) {
            const int d = i * TEAM + lane;
            if (d < p.a.head_dim) dq_row[d * p.dq_stride[3]] = from_acc<T>(acc[i] * sc);
        }
    }
}
template <typename T, int DPAD, int TEAM, int KEYS, int SMEM_BYTES>
__global__ void __launch_bounds__(BWD_ROWS_THREADS, 1)
bwd_dq_rows(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v, const T* __restrict__ dout,
            const acc_t<T>* __restrict__ delta_ws, acc_t<T>* __restrict__ lse2_ws, T* __restrict__ dq,
            const int* __restrict__ seqlens_k, const BwdParams p) {
    bwd_dq_rows_body<T, DPAD, TEAM, KEYS, SMEM_BYTES, NoMods>(q, k, v, dout, delta_ws, lse2_ws, dq, seqlens_k, p,
                                                             ModParams{});
}
// The same with modifiers (FLAGS: common.cuh, MOD_*; no MOD_SCORE), their ModParams after the BwdParams.
template <typename T, int DPAD, int TEAM, int KEYS, int SMEM_BYTES, int FLAGS>
__global__ void __launch_bounds__(BWD_ROWS_THREADS, 1)
bwd_dq_rows_mods(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v, const T* __restrict__ dout,
                 const acc_t<T>* __restrict__ delta_ws, acc_t<T>* __restrict__ lse2_ws, T* __restrict__ dq,
                 const int* __restrict__ seqlens_k, const BwdParams p, const ModParams mp) {
    bwd_dq_rows_body<T, DPAD, TEAM, KEYS, SMEM_BYTES, Mods<FLAGS, sizeof(T) == 2>>(q, k, v, dout, delta_ws, lse2_ws, dq,
                                                                                  seqlens_k, p, mp);
}

// dK, dV on CUDA cores. SMEM_BYTES: _specs.bwd_rows_dkdv_smem.
// The kernel's body, for the kernel without modifiers (M = NoMods) and the one
// with them (bwd_dkdv_rows_mods).
template <typename T, int DPAD, int TEAM, int ROWS, int SMEM_BYTES, class M>
__device__ __forceinline__ void bwd_dkdv_rows_body(const T* __restrict__ q, const T* __restrict__ k,
                                                   const T* __restrict__ v, const T* __restrict__ dout,
                                                   const acc_t<T>* __restrict__ delta_ws,
                                                   const acc_t<T>* __restrict__ lse2_ws, T* __restrict__ dk,
                                                   T* __restrict__ dv, const int* __restrict__ seqlens_k,
                                                   const BwdParams& p, const ModParams& mp) {
    using namespace bwd_detail;
    typedef acc_t<T> A;
    constexpr int PL = DPAD / TEAM;
    constexpr int R = BWD_ROWS_THREADS / TEAM;  // keys per CTA
    using L = DkvRowsSmem<T, DPAD, ROWS>;
    static_assert(PL * TEAM == DPAD && (TEAM & (TEAM - 1)) == 0 && TEAM <= 32, "team shape");
    static_assert(SMEM_BYTES == L::BYTES, "SMEM_BYTES is not the size of the shared-memory layout");
    extern __shared__ __align__(16) unsigned char smem_raw[];
    T* sQ = reinterpret_cast<T*>(smem_raw) + L::Q;
    T* sdO = reinterpret_cast<T*>(smem_raw) + L::DO;
    A* sLse2 = reinterpret_cast<A*>(smem_raw + L::LSE2_BYTE);
    A* sDelta = reinterpret_cast<A*>(smem_raw + L::DELTA_BYTE);
    int* sLast = reinterpret_cast<int*>(smem_raw + L::LAST_BYTE);

    const int lane = threadIdx.x % TEAM, r = threadIdx.x / TEAM;
    const unsigned mask = team_mask<TEAM>();
    const int group = p.a.group_size, packed_rows = p.a.seqlen_q * group;
    const int num_bh = p.a.batch * p.a.num_kv_heads;
    const int kb = (int)(blockIdx.x / num_bh);  // key blocks slowest: the first ones have the most rows (causal)
    const int bh = (int)(blockIdx.x % num_bh), b = bh / p.a.num_kv_heads, kvh = bh - b * p.a.num_kv_heads;
    const int len = seqlen_k_of(seqlens_k, b, p.a.seqlen_k), seqlen_k = max(len, 0);
    const int diag = seqlen_k - p.a.seqlen_q;
    const bool causal = p.a.causal != 0;
    const int j = kb * R + r;  // this team's key
    const bool active = j < p.a.seqlen_k;
    const A scale_log2 = (A)p.a.scale_log2, scale = (A)p.scale;  // (scale: the modifiers' natural units)

    A kv[PL], vv[PL], dka[PL], dva[PL];
    const T* k_row = k + b * p.a.k_stride[0] + (index_t)(j < seqlen_k ? j : 0) * p.a.k_stride[1] + (index_t)kvh * p.a.k_stride[2];
    const T* v_row = v + b * p.a.v_stride[0] + (index_t)(j < seqlen_k ? j : 0) * p.a.v_stride[1] + (index_t)kvh * p.a.v_stride[2];
#pragma unroll
    for (int i = 0; i < PL; ++i) {
        const int d = i * TEAM + lane;
        const bool ok = j < seqlen_k && d < p.a.head_dim;  // keys past the sequence: zeros, never visible
        kv[i] = ok ? to_acc(k_row[d * p.a.k_stride[3]]) : (A)0;
        vv[i] = ok ? to_acc(v_row[d * p.a.v_stride[3]]) : (A)0;
        dka[i] = dva[i] = 0;
    }
    const int key0 = kb * R;
    // the packed rows that see some key of the CTA (with the window: its band)
    const RowSpan rows = key0 < seqlen_k ? rows_seeing<M>(key0, min(key0 + R, seqlen_k) - 1, diag, group, packed_rows,
                                                          causal, mp)
                                         : RowSpan{packed_rows, packed_rows};
    const mods::Seq sq = mods::seq(b, p.a.seqlen_q, seqlen_k);

    for (int row0 = rows.first; row0 < rows.end; row0 += ROWS) {
        __syncthreads();  // the previous stage is consumed
        stage_packed_rows<T, DPAD, ROWS>(sQ, q, p.a.q_stride, b, kvh, row0, packed_rows, group, p.a.head_dim);
        stage_packed_rows<T, DPAD, ROWS>(sdO, dout, p.do_stride, b, kvh, row0, packed_rows, group, p.a.head_dim);
        for (int i = threadIdx.x; i < ROWS; i += BWD_ROWS_THREADS) {
            const int pr = row0 + i;
            const bool ok = pr < packed_rows;
            sLse2[i] = ok ? lse2_ws[ws_row(p, b, kvh, pr)] : (A)0;
            sDelta[i] = ok ? delta_ws[ws_row(p, b, kvh, pr)] : (A)0;
            sLast[i] = ok ? (causal ? min(seqlen_k - 1, pr / group + diag) : seqlen_k - 1) : -1;  // last visible key
        }
        __syncthreads();
        for (int i = 0; i < ROWS; ++i) {
            if (j > sLast[i]) continue;  // the row does not see this key (uniform over the team)
            mods::Row mr = {0, 0, 0, -1, 0.f};
            if constexpr (M::ANY) {  // the row's bounds and modifiers (sLast: its causal end)
                const int pr = row0 + i, t = pr / group;
                mr = mods::row<M>(mp, sq, t, q_head_of(kvh, pr - t * group, group), causal);
                if (!mods::visible<M>(mp, sq, mr, j)) continue;
            }
            A sd = 0, dd = 0, grad;
#pragma unroll
            for (int e = 0; e < PL; ++e) {
                sd += to_acc(sQ[i * DPAD + e * TEAM + lane]) * kv[e];
                dd += to_acc(sdO[i * DPAD + e * TEAM + lane]) * vv[e];
            }
            const A s = rows_score2<M>(team_sum<TEAM>(sd, mask), scale_log2, scale, mp, sq, mr, j, grad);
            const A dp = team_sum<TEAM>(dd, mask);
            const A pj = exp2_acc(s - sLse2[i]);
            const A ds = pj * (dp - sDelta[i]) * grad;
#pragma unroll
            for (int e = 0; e < PL; ++e) {
                dka[e] += ds * to_acc(sQ[i * DPAD + e * TEAM + lane]);
                dva[e] += pj * to_acc(sdO[i * DPAD + e * TEAM + lane]);
            }
        }
    }

    if (active) {
        const A sc_k = len < 0 ? (A)quiet_nan() : (A)p.scale, sc_v = len < 0 ? (A)quiet_nan() : (A)1;
        T* dk_row = dk + b * p.dk_stride[0] + (index_t)j * p.dk_stride[1] + (index_t)kvh * p.dk_stride[2];
        T* dv_row = dv + b * p.dv_stride[0] + (index_t)j * p.dv_stride[1] + (index_t)kvh * p.dv_stride[2];
#pragma unroll
        for (int i = 0; i < PL; ++i) {
            const int d = i * TEAM + lane;
            if (d < p.a.head_dim) {
                dk_row[d * p.dk_stride[3]] = from_acc<T>(dka[i] * sc_k);
                dv_row[d * p.dv_stride[3]] = from_acc<T>(dva[i] * sc_v);
            }
        }
    }
}
template <typename T, int DPAD, int TEAM, int ROWS, int SMEM_BYTES>
__global__ void __launch_bounds__(BWD_ROWS_THREADS, 1)
bwd_dkdv_rows(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v, const T* __restrict__ dout,
              const acc_t<T>* __restrict__ delta_ws, const acc_t<T>* __restrict__ lse2_ws, T* __restrict__ dk,
              T* __restrict__ dv, const int* __restrict__ seqlens_k, const BwdParams p) {
    bwd_dkdv_rows_body<T, DPAD, TEAM, ROWS, SMEM_BYTES, NoMods>(q, k, v, dout, delta_ws, lse2_ws, dk, dv, seqlens_k, p,
                                                               ModParams{});
}
// The same with modifiers (FLAGS: common.cuh, MOD_*; no MOD_SCORE), their ModParams after the BwdParams.
template <typename T, int DPAD, int TEAM, int ROWS, int SMEM_BYTES, int FLAGS>
__global__ void __launch_bounds__(BWD_ROWS_THREADS, 1)
bwd_dkdv_rows_mods(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v, const T* __restrict__ dout,
                   const acc_t<T>* __restrict__ delta_ws, const acc_t<T>* __restrict__ lse2_ws, T* __restrict__ dk,
                   T* __restrict__ dv, const int* __restrict__ seqlens_k, const BwdParams p, const ModParams mp) {
    bwd_dkdv_rows_body<T, DPAD, TEAM, ROWS, SMEM_BYTES, Mods<FLAGS, sizeof(T) == 2>>(q, k, v, dout, delta_ws, lse2_ws, dk,
                                                                                    dv, seqlens_k, p, mp);
}

// ---- 4. The sinks' gradient ------------------------------------------------------------
// d loss / d sinks[h] = -sum over the rows (b, t) of head h of p_sink delta, with
// p_sink = exp(sinks[h] - lse) = exp2(sink2 - lse2) the sink's share of the row's
// softmax (it adds no value, so d out / d sink = -p_sink out) and delta =
// rowsum(dout * out), both from the workspace (lse2 includes the sink). One CTA
// per query head, a fixed order of sums: bitwise-equal results call to call. A
// row of a bad seqlens_k value (NaN lse2) makes its head's gradient NaN.
template <typename A>
__global__ void __launch_bounds__(256) bwd_dsinks(const A* __restrict__ delta_ws, const A* __restrict__ lse2_ws,
                                                  float* __restrict__ dsinks, const BwdParams p, const ModParams mp) {
    __shared__ A part[256];
    const int h = blockIdx.x, group = p.a.group_size, kvh = h / group, g = h - kvh * group;
    const A sink2 = (A)mp.sinks[h] * bwd_detail::log2e<A>();
    const index_t rows = (index_t)p.a.batch * p.a.seqlen_q;  // (b, t) of the head
    A sum = 0;
    for (index_t r = threadIdx.x; r < rows; r += blockDim.x) {
        const int b = (int)(r / p.a.seqlen_q), t = (int)(r - (index_t)b * p.a.seqlen_q);
        const index_t w = bwd_detail::ws_row(p, b, kvh, t * group + g);
        sum += exp2_acc(sink2 - lse2_ws[w]) * delta_ws[w];
    }
    part[threadIdx.x] = sum;
    __syncthreads();
#pragma unroll
    for (int n = 128; n > 0; n /= 2) {
        if ((int)threadIdx.x < n) part[threadIdx.x] += part[threadIdx.x + n];
        __syncthreads();
    }
    if (threadIdx.x == 0) dsinks[h] = (float)-part[0];
}
