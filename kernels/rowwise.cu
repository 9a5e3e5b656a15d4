// rowwise.cu: one query row per thread (or per small team of threads), online softmax.
//
// Algorithm
//   The project's first kernel, generalised from the seed. A "row" is one
//   (batch, query head, query position). Its owner scans the visible keys once,
//   in order, keeping a running max m, a running denominator l and a running
//   weighted sum o of V rows (online softmax); no score row is materialised:
//       s     = (q * softmax_scale * log2(e)) . k_j          (log2 domain)
//       m'    = max(m, s)
//       o     = o * exp2(m - m') + exp2(s - m') * v_j
//       l     = l * exp2(m - m') + exp2(s - m')
//   and finally out = o / l, lse = (m + log2 l) * ln 2.
//   Causal masking is aligned bottom-right: position t sees keys
//   j <= t + seqlen_k - seqlen_q. A row that sees no key writes 0 and lse = -inf.
//
// Grid mapping
//   1-D grid-stride loop over TEAM * (number of rows) threads; TEAM consecutive
//   lanes own one row and split head_dim between them (lane i holds dims
//   i, i + TEAM, ...), reducing the dot product with __shfl_xor_sync. TEAM is 1
//   for small head dims and grows so that q and o stay in registers.
//   Rows are ordered (t_rev, batch, kv_head, g) from slowest to fastest, where
//   t_rev = seqlen_q - 1 - t and g is the head within the KV head's group:
//     * all group_size heads of one KV head are neighbours in a warp and every
//       lane of the warp reads the same key index j at the same step, so a K/V
//       row is fetched once and broadcast;
//     * a warp's rows share one position t, so causal loop lengths agree;
//     * the longest rows (late t) start first, which evens out the tail.
//
// Template parameters
//   T     storage type (float, double, __half, __nv_bfloat16)
//   DPAD  head_dim rounded up to the specialisation's bucket; head_dim <= DPAD
//         is a runtime value and the unused dims are predicated off, so every
//         register array is indexed with compile-time constants.
//   TEAM  threads per row (1, 2, 4, 8); DPAD % TEAM == 0.
//   UNIT_D  the head_dim axis of q, k, v and out has stride 1. Then per-dim
//         offsets are constants; otherwise each costs a 64-bit register.
#include "common.cuh"

template <typename T, int DPAD, int TEAM, bool UNIT_D>
__global__ void __launch_bounds__(128) rowwise_attention(
    const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
    T* __restrict__ out, float* __restrict__ lse,
    int batch, int seqlen_q, int seqlen_k, int num_kv_heads, int group_size, int head_dim, int causal,
    index_t q_sb, index_t q_ss, index_t q_sh, index_t q_sd,
    index_t k_sb, index_t k_ss, index_t k_sh, index_t k_sd,
    index_t v_sb, index_t v_ss, index_t v_sh, index_t v_sd,
    index_t o_sb, index_t o_ss, index_t o_sh, index_t o_sd,
    acc_t<T> scale_log2, index_t total_threads)
{
    typedef acc_t<T> acc;
    constexpr int PER_LANE = DPAD / TEAM;
    const acc NEG_INF = neg_inf<acc>();
    if (UNIT_D) q_sd = k_sd = v_sd = o_sd = 1;
    const int lane = threadIdx.x % TEAM;
    // The lanes of one team, for shuffles that other (finished) teams skip.
    const unsigned team_mask = (TEAM == 32) ? 0xffffffffu
        : (((1u << TEAM) - 1u) << ((threadIdx.x % 32) / TEAM * TEAM));

    for (index_t gid = (index_t)blockIdx.x * blockDim.x + threadIdx.x; gid < total_threads;
         gid += (index_t)gridDim.x * blockDim.x) {
        index_t row = gid / TEAM;
        const int g = (int)(row % group_size);      row /= group_size;
        const int kv_head = (int)(row % num_kv_heads); row /= num_kv_heads;
        const int b = (int)(row % batch);            row /= batch;
        const int t = seqlen_q - 1 - (int)row;
        const int q_head = kv_head * group_size + g;  // GQA: kv_head = q_head / group_size

        const T* q_row = q + b * q_sb + t * q_ss + q_head * q_sh;
        const T* k_row = k + b * k_sb + kv_head * k_sh;
        const T* v_row = v + b * v_sb + kv_head * v_sh;

        acc qv[PER_LANE], o[PER_LANE];
#pragma unroll
        for (int i = 0; i < PER_LANE; ++i) {
            const int d = i * TEAM + lane;
            qv[i] = d < head_dim ? to_acc(q_row[d * q_sd]) * scale_log2 : (acc)0;
            o[i] = 0;
        }

        const int n_keys = visible_keys(t, seqlen_q, seqlen_k, causal != 0);
        acc m = NEG_INF, l = 0;
        for (int j = 0; j < n_keys; ++j, k_row += k_ss, v_row += v_ss) {
            // s = q . k_j, in CHAINS independent partial sums so the FMAs overlap
            constexpr int CHAINS = PER_LANE < 4 ? PER_LANE : 4;
            acc part[CHAINS];
#pragma unroll
            for (int c = 0; c < CHAINS; ++c) part[c] = 0;
#pragma unroll
            for (int i = 0; i < PER_LANE; ++i) {
                const int d = i * TEAM + lane;
                if (d < head_dim) part[i % CHAINS] += qv[i] * to_acc(k_row[d * k_sd]);
            }
            acc s = part[0];
#pragma unroll
            for (int c = 1; c < CHAINS; ++c) s += part[c];
#pragma unroll
            for (int off = TEAM / 2; off > 0; off /= 2) s += __shfl_xor_sync(team_mask, s, off);

            // online softmax: o = o * exp2(m - m') + exp2(s - m') * v_j
            const acc m_new = s > m ? s : m;
            // While every score so far is -inf, use 0 as the reference so that
            // exp2(-inf - (-inf)) never makes a NaN (a -inf score weighs 0).
            const acc m_ref = m_new == NEG_INF ? (acc)0 : m_new;
            const acc alpha = exp2_acc(m - m_ref);
            const acc p = exp2_acc(s - m_ref);
            l = l * alpha + p;
#pragma unroll
            for (int i = 0; i < PER_LANE; ++i) {
                const int d = i * TEAM + lane;
                const acc vd = d < head_dim ? to_acc(v_row[d * v_sd]) : (acc)0;
                o[i] = o[i] * alpha + p * vd;
            }
            m = m_new;
        }

        // A row with no visible key is all zeros with lse = -inf.
        const acc inv_l = n_keys == 0 ? (acc)0 : (acc)1 / l;
        T* o_row = out + b * o_sb + t * o_ss + q_head * o_sh;
#pragma unroll
        for (int i = 0; i < PER_LANE; ++i) {
            const int d = i * TEAM + lane;
            if (d < head_dim) o_row[d * o_sd] = from_acc<T>(o[i] * inv_l);
        }
        if (lse != nullptr && lane == 0) {
            const acc ln2 = (acc)0.69314718055994530942;
            lse[((index_t)b * num_kv_heads * group_size + q_head) * seqlen_q + t] =
                n_keys == 0 ? neg_inf<float>() : (float)((m + log2_acc(l)) * ln2);
        }
    }
}
