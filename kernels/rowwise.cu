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
//   1-D grid-stride loop over p.total_threads threads; TEAM consecutive lanes
//   own one row and split head_dim between them, reducing the dot product with
//   __shfl_xor_sync. TEAM is 1 for small head dims and grows with head_dim so
//   that q and o stay in registers. Rows are ordered, slowest to fastest,
//       (t_block from the end, batch, kv_head, t within the block, g)
//   where g < group_size is the head within the KV head's group and a t_block
//   holds TB = (32 / TEAM) / group_size positions (at least 1). So one warp
//   holds every head of one KV head at TB neighbouring positions: all its
//   lanes read the same K/V row j at the same step, one broadcast load for
//   the warp, and the latest (longest causal) positions are launched first.
//   Rows past seqlen_q (the last, partial t_block) do nothing.
//
// Template parameters
//   T     storage type (float, double, __half, __nv_bfloat16)
//   DPAD  head_dim rounded up to the specialisation's bucket; the runtime
//         head_dim <= DPAD and the unused dims are predicated off, so every
//         register array is indexed with compile-time constants.
//   TEAM  threads per row (1 .. 32); DPAD % TEAM == 0.
//   VEC   16-byte loads: the head_dim axis of q, k, v and out has stride 1,
//         every row starts 16-byte aligned and head_dim is a multiple of
//         16 / sizeof(T). Otherwise each element is loaded on its own through
//         its 64-bit stride (any layout works).
#include "common.cuh"

// W elements starting at ptr (stride `stride` between elements), as acc, or
// zeros when !pred. With VEC the W elements are one aligned 16-byte load.
template <typename T, int W, bool VEC>
__device__ __forceinline__ void load_chunk(const T* ptr, index_t stride, bool pred, acc_t<T> (&dst)[W]) {
    if (VEC) {
        uint4 raw = make_uint4(0, 0, 0, 0);
        if (pred) raw = __ldg(reinterpret_cast<const uint4*>(ptr));
        const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
        for (int i = 0; i < W; ++i) dst[i] = to_acc(e[i]);
    } else {
#pragma unroll
        for (int i = 0; i < W; ++i) dst[i] = pred ? to_acc(ptr[i * stride]) : (acc_t<T>)0;
    }
}

template <typename T, int DPAD, int TEAM, bool VEC>
__global__ void __launch_bounds__(128) rowwise_attention(
    const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
    T* __restrict__ out, float* __restrict__ lse, const int* __restrict__ seqlens_k, const AttnParams p)
{
    typedef acc_t<T> acc;
    constexpr int W = VEC ? 16 / (int)sizeof(T) : 1;  // elements per load
    constexpr int PER_LANE = DPAD / TEAM;             // dims each lane holds
    constexpr int CHUNKS = PER_LANE / W;              // lane's dims: d = (c * TEAM + lane) * W + e
    static_assert(PER_LANE % W == 0, "a lane holds whole 16-byte chunks");
    const acc NEG_INF = neg_inf<acc>();
    const acc scale_log2 = (acc)p.scale_log2;
    const int lane = threadIdx.x % TEAM;
    // The lanes of one team, for shuffles that other (finished) teams skip.
    const unsigned team_mask = (TEAM == 32) ? 0xffffffffu
        : (((1u << TEAM) - 1u) << ((threadIdx.x % 32) / TEAM * TEAM));
    const int group_size = p.group_size;
    const int t_block = max(1, (32 / TEAM) / group_size);  // TB positions per warp
    const index_t q_sd = VEC ? 1 : p.q_stride[3], k_sd = VEC ? 1 : p.k_stride[3];
    const index_t v_sd = VEC ? 1 : p.v_stride[3], o_sd = VEC ? 1 : p.o_stride[3];

    for (index_t gid = (index_t)blockIdx.x * blockDim.x + threadIdx.x; gid < p.total_threads;
         gid += (index_t)gridDim.x * blockDim.x) {
        index_t row = gid / TEAM;
        const int g = (int)(row % group_size);           row /= group_size;
        const int t_in = (int)(row % t_block);           row /= t_block;
        const int kv_head = (int)(row % p.num_kv_heads); row /= p.num_kv_heads;
        const int b = (int)(row % p.batch);              row /= p.batch;
        const index_t t_from_end = row * t_block + t_in;
        if (t_from_end >= p.seqlen_q) continue;  // padding of the last t_block
        const int t = p.seqlen_q - 1 - (int)t_from_end;
        const int q_head = q_head_of(kv_head, g, group_size);

        const T* q_row = q + b * p.q_stride[0] + t * p.q_stride[1] + q_head * p.q_stride[2];
        const T* k_row = k + b * p.k_stride[0] + kv_head * p.k_stride[2];
        const T* v_row = v + b * p.v_stride[0] + kv_head * p.v_stride[2];

        acc qv[PER_LANE], o[PER_LANE];
#pragma unroll
        for (int c = 0; c < CHUNKS; ++c) {
            const int d0 = (c * TEAM + lane) * W;
            acc x[W];
            load_chunk<T, W, VEC>(q_row + d0 * q_sd, q_sd, d0 < p.head_dim, x);
#pragma unroll
            for (int e = 0; e < W; ++e) {
                qv[c * W + e] = x[e] * scale_log2;
                o[c * W + e] = 0;
            }
        }

        const int n_keys = visible_keys(t, p.seqlen_q, seqlen_k_of(seqlens_k, b, p.seqlen_k), p.causal != 0);
        acc m = NEG_INF, l = 0;
        for (int j = 0; j < n_keys; ++j, k_row += p.k_stride[1], v_row += p.v_stride[1]) {
            // s = q . k_j, in CHAINS independent partial sums so the FMAs overlap
            constexpr int CHAINS = PER_LANE < 4 ? PER_LANE : 4;
            acc part[CHAINS];
#pragma unroll
            for (int i = 0; i < CHAINS; ++i) part[i] = 0;
            acc vj[PER_LANE];
#pragma unroll
            for (int c = 0; c < CHUNKS; ++c) {
                const int d0 = (c * TEAM + lane) * W;
                acc kx[W], vx[W];
                load_chunk<T, W, VEC>(k_row + d0 * k_sd, k_sd, d0 < p.head_dim, kx);
                load_chunk<T, W, VEC>(v_row + d0 * v_sd, v_sd, d0 < p.head_dim, vx);  // in flight with k
#pragma unroll
                for (int e = 0; e < W; ++e) {
                    part[(c * W + e) % CHAINS] += qv[c * W + e] * kx[e];
                    vj[c * W + e] = vx[e];
                }
            }
            acc s = part[0];
#pragma unroll
            for (int i = 1; i < CHAINS; ++i) s += part[i];
#pragma unroll
            for (int off = TEAM / 2; off > 0; off /= 2) s += __shfl_xor_sync(team_mask, s, off);

            // online softmax: o = o * exp2(m - m') + exp2(s - m') * v_j
            const acc m_new = s > m ? s : m;
            // While every score so far is -inf, use 0 as the reference so that
            // exp2(-inf - (-inf)) never makes a NaN (a -inf score weighs 0).
            const acc m_ref = m_new == NEG_INF ? (acc)0 : m_new;
            const acc alpha = exp2_acc(m - m_ref);
            const acc pj = exp2_acc(s - m_ref);
            l = l * alpha + pj;
#pragma unroll
            for (int i = 0; i < PER_LANE; ++i) o[i] = o[i] * alpha + pj * vj[i];
            m = m_new;
        }

        // A row with no visible key is all zeros with lse = -inf.
        const acc inv_l = n_keys == 0 ? (acc)0 : (acc)1 / l;
        T* o_row = out + b * p.o_stride[0] + t * p.o_stride[1] + q_head * p.o_stride[2];
#pragma unroll
        for (int c = 0; c < CHUNKS; ++c) {
#pragma unroll
            for (int e = 0; e < W; ++e) {
                const int d = (c * TEAM + lane) * W + e;
                if (d < p.head_dim) o_row[d * o_sd] = from_acc<T>(o[c * W + e] * inv_l);
            }
        }
        if (lse != nullptr && lane == 0) {
            const acc ln2 = (acc)0.69314718055994530942;
            lse[((index_t)b * p.num_q_heads + q_head) * p.seqlen_q + t] =
                n_keys == 0 ? neg_inf<float>() : (float)((m + log2_acc(l)) * ln2);
        }
    }
}
