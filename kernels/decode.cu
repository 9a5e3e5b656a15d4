// decode.cu: split-KV decode, a few query tokens against a long KV cache.
//
// Algorithm
//   Decoding attends seqlen_q = 1 .. 16 new tokens per sequence to a cache of
//   thousands of keys: the work is reading K and V once, at memory speed.
//   GQA packing: one CTA takes ROWS packed rows r = t * group_size + g
//   (query position t, head g of the KV head's group; query head
//   q_head = kv_head * group_size + g) of one (batch b, kv_head), so every
//   K/V byte it reads serves all group_size heads and all seqlen_q tokens.
//   When seqlen_q * group_size > ROWS the rows come in row blocks, one CTA
//   each; the row blocks of one key range run side by side and share K/V in L2.
//   Split-KV: the keys [0, len) of sequence b (len = seqlens_k[b], or seqlen_k)
//   are cut into num_splits equal ranges (whole steps), one CTA each, so that
//   batch * num_kv_heads CTAs that would not fill the GPU become enough.
//
//   Inside a CTA the keys of its range go round-robin to "key groups" of
//   LANES = HEAD_DIM / 8 lanes: lane l of a group holds dims
//   d = (c * LANES + l) * W + e (16-byte chunks c of W elements, 8 dims per
//   lane) of q (pre-scaled by softmax_scale * log2 e) for each row, and of its
//   output accumulator. Per step a group loads U keys' K and V rows (U = 4:
//   8 16-byte loads per lane in flight; fp32 has 2 chunks per row, U = 2) and runs
//   an online softmax over them, per row (log2 domain):
//       s_u   = q . k_u                  (partial dot, then xor-shuffles over LANES)
//       s_u   = -inf where key u is past the row's causal end (or the range)
//       m'    = max(m, s_0 .. s_U-1)
//       o     = o * exp2(m - m') + sum_u exp2(s_u - m') * v_u
//       l     = l * exp2(m - m') + sum_u exp2(s_u - m')
//   The loads of the next step are issued before the current step is
//   computed (a two-deep register pipeline), steps that every row sees in
//   full skip the masking, and o is rescaled only when the running max grows
//   by more than 2^8 (lazy rescale; m is then the reference, not the max).
//   The groups' (m, l, o) are merged with the same rule, first across the
//   groups of a warp (xor-shuffles), then across warps in shared memory.
//   With num_splits == 1 the CTA writes out = o / l and lse = (m + log2 l) ln 2.
//   Otherwise it writes the fp32 partial o / l and its lse (log2 domain) to a
//   workspace, and decode_combine merges the splits of each row:
//       M = max_s lse_s,  out = sum_s exp2(lse_s - M) o_s / sum_s exp2(lse_s - M)
//   Causal masking is aligned bottom-right per sequence: query t of batch b
//   sees keys j <= t + len - seqlen_q. A row that sees no key writes 0 and
//   lse = -inf. A seqlens_k[b] outside [0, seqlen_k] (device arrays are not
//   range-checked on the host) makes every row of batch b NaN, out and lse.
//
// Grid mapping (decode_attention)
//   1-D grid of batch * num_kv_heads * row_blocks * num_splits CTAs of
//   DECODE_THREADS threads, split fastest:
//       blockIdx.x = ((b * num_kv_heads + kv_head) * row_blocks + rb) * num_splits + split
//   row_blocks = ceil(seqlen_q * group_size / ROWS). Warp w, lane = 32 * w + x:
//   key group w * (32 / LANES) + x / LANES, lane x % LANES within it.
//   At step j0 group i reads keys j0 + u * NUM_GROUPS + i, u < U.
//
// Workspace (num_splits > 1; allocated by cupy_gqa/_plan.py from CuPy's pool)
//   packed row index prow = (b * num_kv_heads + kv_head) * (seqlen_q * group_size) + r
//   part_o   float [prow][num_splits][head_dim]   partial out, normalised
//   part_lse float [prow][num_splits]              its lse, log2 domain
//
// Grid mapping (decode_combine)
//   1-D grid-stride loop, one thread per (prow, 4 dims).
//
// Template parameters
//   T         __half, __nv_bfloat16 or float
//   HEAD_DIM  64, 128 or 256 (exactly p.head_dim)
//   ROWS      packed rows per CTA: 1, 2, 4 or 8 (rows past seqlen_q * group_size idle)
// Requirements (checked by the Python layer): head_dim stride 1, 16-byte
// aligned pointers and strides.
#include "common.cuh"

// Tuning knobs, overridable with -D (benchmarks/decode_dev.py times variants):
// threads per CTA, 16-byte K loads (as many V loads) per lane per step, and
// the CTAs per SM that __launch_bounds__ asks registers for.
#ifndef DECODE_THREADS
#define DECODE_THREADS 128
#endif
#ifndef DECODE_LOADS
#define DECODE_LOADS 4
#endif
#ifndef DECODE_RESCALE_THRESHOLD  // see attend_step; 0: rescale whenever the max grows
#define DECODE_RESCALE_THRESHOLD 8.0f
#endif
#ifndef DECODE_MIN_BLOCKS  // __launch_bounds__' CTAs per SM for ROWS <= 4 (caps the registers)
#define DECODE_MIN_BLOCKS 3
#endif

namespace decode_detail {

constexpr int NUM_WARPS = DECODE_THREADS / 32;
constexpr float LN2 = 0.6931471805599453f;


// W elements of one 16-byte chunk, as floats.
template <typename T>
__device__ __forceinline__ void unpack(const uint4& raw, float* dst) {
    const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
    for (int i = 0; i < 16 / (int)sizeof(T); ++i) dst[i] = to_acc(e[i]);
}

// Merge online-softmax state (m_b, l_b, o_b) into (m, l, o): the two sums
// rescaled to their common max. A side with m = -inf (no key) weighs 0.
__device__ __forceinline__ void merge_weights(float m, float m_b, float& m_new, float& wa, float& wb) {
    m_new = fmaxf(m, m_b);
    const float m_ref = m_new == neg_inf<float>() ? 0.f : m_new;
    wa = exp2f(m - m_ref);
    wb = exp2f(m_b - m_ref);
}

// 2^x in one MUFU.EX2 (ex2.approx: 2^-inf = 0, NaN stays NaN; 2 ulp).
__device__ __forceinline__ float fast_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// K and V chunks of the U keys j, j + NUM_GROUPS, ... of a key group (zeros past k_end).
template <typename T, int U, int C, int NUM_GROUPS, int LANES>
__device__ __forceinline__ void load_step(uint4 (&kr)[U][C], uint4 (&vr)[U][C], const T* k_ptr, const T* v_ptr,
                                          index_t ks, index_t vs, int j, int k_end) {
    constexpr int W = 16 / (int)sizeof(T);
#pragma unroll
    for (int u = 0; u < U; ++u) {
        const int jj = j + u * NUM_GROUPS;
#pragma unroll
        for (int c = 0; c < C; ++c) {
            kr[u][c] = make_uint4(0, 0, 0, 0);
            vr[u][c] = make_uint4(0, 0, 0, 0);
            if (jj < k_end) {
                kr[u][c] = __ldg(reinterpret_cast<const uint4*>(k_ptr + jj * ks + c * LANES * W));
                vr[u][c] = __ldg(reinterpret_cast<const uint4*>(v_ptr + jj * vs + c * LANES * W));
            }
        }
    }
}

// One step of a key group over its U keys j, j + NUM_GROUPS, ... (see the top):
// scores, then the online softmax update of every row. MASK: some key may be
// past k_end or past a row's causal end.
template <typename T, int ROWS, int U, int C, int NUM_GROUPS, int LANES, bool MASK>
__device__ __forceinline__ void attend_step(const uint4 (&kr)[U][C], const uint4 (&vr)[U][C],
                                            const float (&qv)[ROWS][8], float (&m)[ROWS], float (&l)[ROWS],
                                            float (&o)[ROWS][8], int j, int k_end, const int (&n_vis)[ROWS]) {
    constexpr int W = 16 / (int)sizeof(T), DL = 8;
    const float NEG_INF = neg_inf<float>();
    // s_u = q . k_u for every row: partial dots, then a sum over the group's lanes
    float s[U][ROWS];
#pragma unroll
    for (int u = 0; u < U; ++u) {
        float kf[DL];
#pragma unroll
        for (int c = 0; c < C; ++c) unpack<T>(kr[u][c], kf + c * W);
#pragma unroll
        for (int i = 0; i < ROWS; ++i) {
            float a0 = 0.f, a1 = 0.f;  // two chains so the FMAs overlap
#pragma unroll
            for (int d = 0; d < DL; d += 2) {
                a0 = fmaf(qv[i][d], kf[d], a0);
                a1 = fmaf(qv[i][d + 1], kf[d + 1], a1);
            }
            s[u][i] = a0 + a1;
        }
    }
#pragma unroll
    for (int off = LANES / 2; off > 0; off /= 2)
#pragma unroll
        for (int u = 0; u < U; ++u)
#pragma unroll
            for (int i = 0; i < ROWS; ++i) s[u][i] += __shfl_xor_sync(0xffffffffu, s[u][i], off);

    float vf[U][DL];
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
        for (int c = 0; c < C; ++c) unpack<T>(vr[u][c], vf[u] + c * W);
    // online softmax: o = o * exp2(m - m') + sum_u exp2(s_u - m') * v_u
#pragma unroll
    for (int i = 0; i < ROWS; ++i) {
        bool vis[U];
        float m_new = m[i];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            vis[u] = !MASK || (j + u * NUM_GROUPS < k_end && j + u * NUM_GROUPS < n_vis[i]);
            if (!vis[u]) s[u][i] = NEG_INF;
            m_new = fmaxf(m_new, s[u][i]);
        }
        // Lazy rescale: keep the old reference m unless the new max exceeds it
        // by more than DECODE_RESCALE_THRESHOLD (log2 units), so most steps skip
        // the exp2 and the o *= alpha; weights stay <= 2^threshold, exact in fp32.
        if (m_new > m[i] + DECODE_RESCALE_THRESHOLD) {
            const float alpha = fast_exp2(m[i] - m_new);  // 0 while m = -inf
            l[i] *= alpha;
#pragma unroll
            for (int d = 0; d < DL; ++d) o[i][d] *= alpha;
            m[i] = m_new;
        }
        // while every score so far is -inf, 0 is the reference: no (-inf) - (-inf)
        const float m_ref = m[i] == NEG_INF ? 0.f : m[i];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const float pu = fast_exp2(s[u][i] - m_ref);
            l[i] += pu;
            if (vis[u]) {  // a key the row doesn't see adds nothing, even a NaN V
#pragma unroll
                for (int d = 0; d < DL; ++d) o[i][d] = fmaf(pu, vf[u][d], o[i][d]);
            }
        }
    }
}

}  // namespace decode_detail

template <typename T, int HEAD_DIM, int ROWS>
__global__ void __launch_bounds__(DECODE_THREADS, ROWS <= 4 ? DECODE_MIN_BLOCKS : 1) decode_attention(
    const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
    T* __restrict__ out, float* __restrict__ lse, const int* __restrict__ seqlens_k, const AttnParams p,
    float* __restrict__ part_o, float* __restrict__ part_lse, const int num_splits)
{
    using namespace decode_detail;
    constexpr int W = 16 / (int)sizeof(T);        // elements per 16-byte chunk
    constexpr int DL = 8;                         // dims per lane
    constexpr int C = DL / W;                     // chunks per lane and row (fp32: 2)
    constexpr int LANES = HEAD_DIM / DL;          // lanes per key group
    constexpr int GROUPS_PER_WARP = 32 / LANES;
    constexpr int NUM_GROUPS = NUM_WARPS * GROUPS_PER_WARP;
    // keys per group per step (ROWS 8 halves it to stay in registers)
    constexpr int LOADS = ROWS >= 8 ? DECODE_LOADS / 2 : DECODE_LOADS;
    constexpr int U = LOADS / C > 0 ? LOADS / C : 1;
    static_assert(LANES >= 1 && LANES <= 32 && 32 % LANES == 0, "HEAD_DIM in {8 .. 256}, a power of two");
    static_assert(DL == 8, "attend_step holds 8 dims per lane");
    const float NEG_INF = neg_inf<float>();

    // --- which work: (b, kv_head, row block, split) -------------------------
    const int group_size = p.group_size;
    const int rows_total = p.seqlen_q * group_size;
    const int row_blocks = (rows_total + ROWS - 1) / ROWS;
    index_t idx = blockIdx.x;
    const int split = (int)(idx % num_splits);    idx /= num_splits;
    const int rb = (int)(idx % row_blocks);       idx /= row_blocks;
    const int kv_head = (int)(idx % p.num_kv_heads);
    const int b = (int)(idx / p.num_kv_heads);
    const int len = seqlen_k_of(seqlens_k, b, p.seqlen_k);  // -1: bad seqlens_k[b]

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int group = warp * GROUPS_PER_WARP + lane / LANES;
    const int gl = lane % LANES;  // lane within the key group

    // rows of this CTA: r = rb * ROWS + i = t * group_size + g
    float qv[ROWS][DL];
    int n_vis[ROWS];  // keys [0, n_vis) visible to the row (0 for idle rows)
    int n_max = 0, n_min = 1 << 30;  // over the live rows
#pragma unroll
    for (int i = 0; i < ROWS; ++i) {
        const int r = rb * ROWS + i;
        const int t = r / group_size, g = r % group_size;
        const bool live = r < rows_total && len >= 0;
        n_vis[i] = live ? visible_keys(t, p.seqlen_q, len, p.causal != 0) : 0;
        n_max = max(n_max, n_vis[i]);
        if (live) n_min = min(n_min, n_vis[i]);
        const T* q_row = q + b * p.q_stride[0] + t * p.q_stride[1]
                       + q_head_of(kv_head, g, group_size) * p.q_stride[2];
#pragma unroll
        for (int c = 0; c < C; ++c) {
            uint4 raw = make_uint4(0, 0, 0, 0);
            if (live) raw = __ldg(reinterpret_cast<const uint4*>(q_row + (c * LANES + gl) * W));
            float x[W];
            unpack<T>(raw, x);
#pragma unroll
            for (int e = 0; e < W; ++e) qv[i][c * W + e] = x[e] * (float)p.scale_log2;
        }
    }

    // this split's keys: [k_begin, k_end), cut from [0, len) in equal parts of
    // whole steps, and clipped to the last key any row of the CTA sees
    constexpr int STEP = NUM_GROUPS * U;
    const int chunk = ((max(len, 0) + num_splits - 1) / num_splits + STEP - 1) / STEP * STEP;
    const int k_begin = split * chunk;
    const int k_end = min(min(k_begin + chunk, max(len, 0)), n_max);

    float m[ROWS], l[ROWS], o[ROWS][DL];
#pragma unroll
    for (int i = 0; i < ROWS; ++i) {
        m[i] = NEG_INF;
        l[i] = 0.f;
#pragma unroll
        for (int d = 0; d < DL; ++d) o[i][d] = 0.f;
    }

    // keys [k_begin, k_full) come in whole steps that every live row sees: no mask
    const int k_full = k_begin + max(0, min(k_end, n_min) - k_begin) / STEP * STEP;
    const T* k_ptr = k + b * p.k_stride[0] + kv_head * p.k_stride[2] + gl * W;
    const T* v_ptr = v + b * p.v_stride[0] + kv_head * p.v_stride[2] + gl * W;
    const index_t ks = p.k_stride[1], vs = p.v_stride[1];

    // software pipeline: step j0 + STEP's loads are in flight while step j0 is computed
    uint4 kr[U][C], vr[U][C], kn[U][C], vn[U][C];
    load_step<T, U, C, NUM_GROUPS, LANES>(kr, vr, k_ptr, v_ptr, ks, vs, k_begin + group, k_end);
    for (int j0 = k_begin; j0 < k_end; j0 += STEP) {
        load_step<T, U, C, NUM_GROUPS, LANES>(kn, vn, k_ptr, v_ptr, ks, vs, j0 + STEP + group, k_end);
        if (j0 + STEP <= k_full)
            attend_step<T, ROWS, U, C, NUM_GROUPS, LANES, false>(kr, vr, qv, m, l, o, j0 + group, k_end, n_vis);
        else
            attend_step<T, ROWS, U, C, NUM_GROUPS, LANES, true>(kr, vr, qv, m, l, o, j0 + group, k_end, n_vis);
#pragma unroll
        for (int u = 0; u < U; ++u)
#pragma unroll
            for (int c = 0; c < C; ++c) {
                kr[u][c] = kn[u][c];
                vr[u][c] = vn[u][c];
            }
    }

    // merge the key groups of each warp: lanes gl, gl + LANES, ... hold the same dims
#pragma unroll
    for (int off = LANES; off < 32; off *= 2) {
#pragma unroll
        for (int i = 0; i < ROWS; ++i) {
            const float m_b = __shfl_xor_sync(0xffffffffu, m[i], off);
            const float l_b = __shfl_xor_sync(0xffffffffu, l[i], off);
            float m_new, wa, wb;
            merge_weights(m[i], m_b, m_new, wa, wb);
            l[i] = l[i] * wa + l_b * wb;
#pragma unroll
            for (int d = 0; d < DL; ++d) {
                const float o_b = __shfl_xor_sync(0xffffffffu, o[i][d], off);
                o[i][d] = o[i][d] * wa + o_b * wb;
            }
            m[i] = m_new;
        }
    }

    // then the warps, through shared memory
    __shared__ float sm_m[NUM_WARPS][ROWS], sm_l[NUM_WARPS][ROWS];
    __shared__ float sm_o[NUM_WARPS][ROWS][HEAD_DIM];
    if (lane < LANES) {
#pragma unroll
        for (int i = 0; i < ROWS; ++i) {
            if (lane == 0) {
                sm_m[warp][i] = m[i];
                sm_l[warp][i] = l[i];
            }
#pragma unroll
            for (int c = 0; c < C; ++c)
#pragma unroll
                for (int e = 0; e < W; ++e) sm_o[warp][i][(c * LANES + gl) * W + e] = o[i][c * W + e];
        }
    }
    __syncthreads();

    // one thread per (row, dim): the CTA's result for that element
    for (int x = threadIdx.x; x < ROWS * HEAD_DIM; x += DECODE_THREADS) {
        const int i = x / HEAD_DIM, d = x % HEAD_DIM;
        const int r = rb * ROWS + i;
        if (r >= rows_total) break;  // rows are the slow index: the rest are idle too
        float mm = NEG_INF;
#pragma unroll
        for (int w = 0; w < NUM_WARPS; ++w) mm = fmaxf(mm, sm_m[w][i]);
        const float m_ref = mm == NEG_INF ? 0.f : mm;
        float ls = 0.f, os = 0.f;
#pragma unroll
        for (int w = 0; w < NUM_WARPS; ++w) {
            const float wt = exp2f(sm_m[w][i] - m_ref);
            ls = fmaf(sm_l[w][i], wt, ls);
            os = fmaf(sm_o[w][i][d], wt, os);
        }
        // a row that saw no key (of this split): 0 and lse = -inf
        const float res = ls == 0.f ? 0.f : os / ls;
        const float lse2 = ls == 0.f ? NEG_INF : mm + log2f(ls);
        if (num_splits == 1) {
            const int t = r / group_size, g = r % group_size;
            const int q_head = q_head_of(kv_head, g, group_size);
            const bool bad = len < 0;
            out[b * p.o_stride[0] + t * p.o_stride[1] + q_head * p.o_stride[2] + d] = from_acc<T>(bad ? quiet_nan() : res);
            if (lse != nullptr && d == 0)
                lse[((index_t)b * p.num_q_heads + q_head) * p.seqlen_q + t] = bad ? quiet_nan() : lse2 * LN2;
        } else {
            const index_t prow = ((index_t)b * p.num_kv_heads + kv_head) * rows_total + r;
            part_o[(prow * num_splits + split) * HEAD_DIM + d] = res;
            if (d == 0) part_lse[prow * num_splits + split] = lse2;
        }
    }
}

// Merge the num_splits partial results of each packed row (see the top).
template <typename T>
__global__ void __launch_bounds__(128) decode_combine(
    T* __restrict__ out, float* __restrict__ lse, const int* __restrict__ seqlens_k, const AttnParams p,
    const float* __restrict__ part_o, const float* __restrict__ part_lse, const int num_splits)
{
    using namespace decode_detail;
    const float NEG_INF = neg_inf<float>();
    const int group_size = p.group_size, rows_total = p.seqlen_q * group_size;
    const int quads = p.head_dim / 4;
    const index_t total = (index_t)p.batch * p.num_kv_heads * rows_total * quads;
    for (index_t x = (index_t)blockIdx.x * blockDim.x + threadIdx.x; x < total; x += (index_t)gridDim.x * blockDim.x) {
        const index_t prow = x / quads;
        const int d = (int)(x % quads) * 4;
        const int r = (int)(prow % rows_total);
        const index_t bh = prow / rows_total;
        const int kv_head = (int)(bh % p.num_kv_heads), b = (int)(bh / p.num_kv_heads);
        const int t = r / group_size, q_head = q_head_of(kv_head, r % group_size, group_size);

        const float* lse_s = part_lse + prow * num_splits;
        float mm = NEG_INF;
        for (int s = 0; s < num_splits; ++s) mm = fmaxf(mm, lse_s[s]);
        const float m_ref = mm == NEG_INF ? 0.f : mm;
        float ls = 0.f;
        float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
        for (int s = 0; s < num_splits; ++s) {
            const float wt = exp2f(lse_s[s] - m_ref);  // 0 for a split that saw no key
            const float4 ov = *reinterpret_cast<const float4*>(part_o + (prow * num_splits + s) * p.head_dim + d);
            ls += wt;
            acc.x = fmaf(wt, ov.x, acc.x);
            acc.y = fmaf(wt, ov.y, acc.y);
            acc.z = fmaf(wt, ov.z, acc.z);
            acc.w = fmaf(wt, ov.w, acc.w);
        }
        const bool bad = seqlen_k_of(seqlens_k, b, p.seqlen_k) < 0;
        const float inv = ls == 0.f ? 0.f : 1.f / ls;
        T* o_row = out + b * p.o_stride[0] + t * p.o_stride[1] + q_head * p.o_stride[2] + d;
        o_row[0] = from_acc<T>(bad ? quiet_nan() : acc.x * inv);
        o_row[1] = from_acc<T>(bad ? quiet_nan() : acc.y * inv);
        o_row[2] = from_acc<T>(bad ? quiet_nan() : acc.z * inv);
        o_row[3] = from_acc<T>(bad ? quiet_nan() : acc.w * inv);
        if (lse != nullptr && d == 0)
            lse[((index_t)b * p.num_q_heads + q_head) * p.seqlen_q + t] =
                bad ? quiet_nan() : (ls == 0.f ? NEG_INF : (mm + log2f(ls)) * LN2);
    }
}
