// rowwise.cu: one query row per thread (or per small team of threads), online softmax.
//
// Algorithm
//   The project's first kernel, generalised from the seed. A "row" is one
//   (batch, query head, query position). Its owner scans the visible keys once,
//   in order, keeping a running max m, a running denominator l and a running
//   weighted sum o of V rows (online softmax); no score row is materialised.
//   Keys are taken KB = 4 at a time, so that the four dot products overlap and
//   the rescale is paid once per four keys:
//       s_u   = (q * softmax_scale * log2(e)) . k_{j+u}     u < KB (log2 domain)
//       m'    = max(m, s_0 .. s_3)
//       o     = o * exp2(m - m') + sum_u exp2(s_u - m') * v_{j+u}
//       l     = l * exp2(m - m') + sum_u exp2(s_u - m')
//   and finally out = o / l, lse = (m + log2 l) * ln 2 (kernels/softmax.cuh's rules).
//   Causal masking is aligned bottom-right: position t sees keys
//   j <= t + seqlen_k - seqlen_q (seqlen_k: the sequence's own length when
//   seqlens_k is given). A row that sees no key writes 0 and lse = -inf.
//
// Grid mapping
//   Blocks of 128 threads, R = 128 / TEAM rows each. TEAM consecutive lanes own
//   one row and split head_dim between them (a lane holds DPAD / TEAM dims of
//   q and o in registers), reducing the dot product with __shfl_xor_sync. All
//   rows of a block belong to one (batch, kv_head): HB = min(group_size, R)
//   heads of its group at TB = R / HB neighbouring positions, row r of the
//   block being (t = t0 - r / HB, g = g0 + r % HB). So every K/V row is loaded
//   once per block, into shared memory, and serves all of the block's rows.
//   The 1-D grid (a grid-stride loop over blocks, no 65535-style limit) is
//   ordered, slowest to fastest,
//       (t_block from the end, batch, kv_head, g_block)
//   so the latest (longest causal) positions are launched first. Rows past the
//   group or before position 0 take part in loading and barriers only.
//
// Shared memory
//   K and V stream through two stages of KEYS rows each, [stage][KEYS][DPAD] of
//   T, densely packed (row j of a stage at j * DPAD), zero-filled past head_dim
//   and past the block's last visible key:
//       smem = 2 stages * 2 (K, V) * KEYS * DPAD * sizeof(T)
//   (RowwiseSmem is the one definition; the SMEM_BYTES template argument, the
//   size the launch passes, must equal its BYTES.)
//   VEC: 16-byte cp.async copies, the next stage in flight while this one is
//   used. Otherwise every element is loaded through its 64-bit stride (any
//   layout works) and stored to shared memory by the same thread.
//
// Template parameters
//   T     storage type (float, double, __half, __nv_bfloat16)
//   DPAD  head_dim rounded up to the specialisation's bucket; the runtime
//         head_dim <= DPAD and the unused dims are zeros in registers and in
//         shared memory, so every register array is indexed with constants.
//   TEAM  threads per row (1 .. 16); DPAD / TEAM is a whole number of 16-byte
//         vectors.
//   VEC   the head_dim axis of q, k, v and out has stride 1, every row starts
//         16-byte aligned and head_dim is a multiple of 16 / sizeof(T).
//   KEYS  keys per shared-memory stage.
//   SMEM_BYTES  the dynamic shared memory the launch passes (see Shared memory).
#include "common.cuh"
#include "softmax.cuh"

#define ROWWISE_THREADS 128
#define ROWWISE_KB 4  // keys per online-softmax update

// Stage keys [j0, j0 + KEYS) of K and V (rows k_row + j * k_stride[1], ...)
// into sK / sV; keys >= n_keys and dims >= head_dim become zeros.
template <typename T, int DPAD, bool VEC, int KEYS, int ADDR>
__device__ __forceinline__ void stage_kv(T* sK, T* sV, const T* k_row, const T* v_row, int j0, int n_keys,
                                         const AttnParams& p, const Sequence<ADDR>& sqn) {
    constexpr int W = 16 / (int)sizeof(T);
    if (VEC) {
        constexpr int UNITS = KEYS * DPAD / W;  // 16-byte vectors per stage of K
#pragma unroll
        for (int i = 0; i < (UNITS + ROWWISE_THREADS - 1) / ROWWISE_THREADS; ++i) {
            const int u = i * ROWWISE_THREADS + threadIdx.x;
            if (UNITS % ROWWISE_THREADS != 0 && u >= UNITS) break;
            const int j = u / (DPAD / W), d = u % (DPAD / W) * W;
            const bool ok = j0 + j < n_keys && d < p.head_dim;
            const index_t jj = ok ? j0 + j : 0;
            cp_async_16(smem_addr(sK + j * DPAD + d),
                        ok ? (const void*)(k_row + sqn.kv_row(jj, p.k_stride[0], p.k_stride[1]) + d) : k_row, ok);
            cp_async_16(smem_addr(sV + j * DPAD + d),
                        ok ? (const void*)(v_row + sqn.kv_row(jj, p.v_stride[0], p.v_stride[1]) + d) : v_row, ok);
        }
    } else {
        constexpr int ELEMS = KEYS * DPAD;
        T kx[(ELEMS + ROWWISE_THREADS - 1) / ROWWISE_THREADS], vx[(ELEMS + ROWWISE_THREADS - 1) / ROWWISE_THREADS];
#pragma unroll
        for (int i = 0; i < (ELEMS + ROWWISE_THREADS - 1) / ROWWISE_THREADS; ++i) {  // all loads in flight first
            const int e = i * ROWWISE_THREADS + threadIdx.x;
            const int j = e / DPAD, d = e % DPAD;
            const bool ok = (ELEMS % ROWWISE_THREADS == 0 || e < ELEMS) && j0 + j < n_keys && d < p.head_dim;
            kx[i] = ok ? k_row[sqn.kv_row(j0 + j, p.k_stride[0], p.k_stride[1]) + d * p.k_stride[3]] : from_acc<T>((acc_t<T>)0);
            vx[i] = ok ? v_row[sqn.kv_row(j0 + j, p.v_stride[0], p.v_stride[1]) + d * p.v_stride[3]] : from_acc<T>((acc_t<T>)0);
        }
#pragma unroll
        for (int i = 0; i < (ELEMS + ROWWISE_THREADS - 1) / ROWWISE_THREADS; ++i) {
            const int e = i * ROWWISE_THREADS + threadIdx.x;
            if (ELEMS % ROWWISE_THREADS != 0 && e >= ELEMS) break;
            sK[e] = kx[i];
            sV[e] = vx[i];
        }
    }
}

// The shared-memory layout (see the top): offsets in elements of T.
template <typename T, int DPAD, int KEYS>
struct RowwiseSmem {
    enum : int {
        STAGE = KEYS * DPAD,  // one stage of K (or V): KEYS rows of DPAD
        K = 0,                // [2][KEYS][DPAD]
        V = K + 2 * STAGE,    // [2][KEYS][DPAD]
        END = V + 2 * STAGE,
        BYTES = END * (int)sizeof(T),
    };
};

// The kernel's body, for the kernel without modifiers (M = NoMods) and the one
// with them (rowwise_attention_mods, common.cuh: modifiers); MP: ModParams, or
// NoModParams for M = NoMods. ADDR: the per-sequence addressing (common.cuh:
// Sequence; 0: contiguous), described by sp (nullptr for 0).
template <typename T, int DPAD, int TEAM, bool VEC, int KEYS, int SMEM_BYTES, class M, class MP, int ADDR = 0>
__device__ __forceinline__ void rowwise_body(
    const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
    T* __restrict__ out, float* __restrict__ lse, const int* __restrict__ seqlens_k, const AttnParams& p,
    const MP& mp, const SeqParams* sp = nullptr)
{
    typedef acc_t<T> acc;
    constexpr int W = 16 / (int)sizeof(T);     // elements per 16-byte vector
    constexpr int PER_LANE = DPAD / TEAM;      // dims each lane holds
    constexpr int CHUNKS = PER_LANE / W;       // lane's dims: d = (c * TEAM + lane) * W + e
    constexpr int R = ROWWISE_THREADS / TEAM;  // rows per block
    constexpr int KB = ROWWISE_KB;
    static_assert(PER_LANE % W == 0 && CHUNKS >= 1, "a lane holds whole 16-byte vectors");
    static_assert(KEYS % KB == 0, "a stage holds whole key batches");
    using L = RowwiseSmem<T, DPAD, KEYS>;
    static_assert(SMEM_BYTES == L::BYTES, "SMEM_BYTES is not the size of the shared-memory layout");
    const acc NEG_INF = neg_inf<acc>();

    extern __shared__ __align__(16) unsigned char smem_raw[];
    T* const sK = reinterpret_cast<T*>(smem_raw) + L::K;  // [2][KEYS][DPAD]
    T* const sV = reinterpret_cast<T*>(smem_raw) + L::V;  // [2][KEYS][DPAD]

    const int lane = threadIdx.x % TEAM;
    const int r = threadIdx.x / TEAM;              // row of the block
    // The lanes of one team, for shuffles (a team is always wholly active or idle).
    const unsigned team_mask = (TEAM == 32) ? 0xffffffffu
        : (((1u << TEAM) - 1u) << ((threadIdx.x % 32) / TEAM * TEAM));
    const int group_size = p.group_size;
    const int hb = min(group_size, R);             // heads per block
    const int tb = R / hb;                         // positions per block
    const int g_blocks = (group_size + hb - 1) / hb;
    const index_t t_blocks = (p.seqlen_q + tb - 1) / tb;
    const index_t total_blocks = t_blocks * p.batch * p.num_kv_heads * g_blocks;

    for (index_t blk = blockIdx.x; blk < total_blocks; blk += gridDim.x) {
        index_t rest = blk;
        const int g_block = (int)(rest % g_blocks);      rest /= g_blocks;
        const int kv_head = (int)(rest % p.num_kv_heads); rest /= p.num_kv_heads;
        const int b = (int)(rest % p.batch);             rest /= p.batch;
        const int t_block = (int)rest;                   // 0: the latest positions
        const Sequence<ADDR> sqn = sequence_of<ADDR>(p, seqlens_k, sp, b);  // its queries and keys (common.cuh)
        const int len = sqn.len;  // -1: bad seqlens_k[b], NaN rows
        const int seqlen_k = max(len, 0);

        // This thread's row, and whether it exists.
        const int g = g_block * hb + r % hb;
        const int t = sqn.seqlen_q(p.seqlen_q) - 1 - (t_block * tb + r / hb);
        const bool active = r < tb * hb && g < group_size && t >= 0;
        const int q_head = q_head_of(kv_head, g, group_size);
        // Modifiers (common.cuh: mods): the row's key bounds, ALiBi slope, ...
        const mods::Seq sq = mods::seq(b, sqn.seqlen_q(p.seqlen_q), seqlen_k);
        mods::Row mrow;
        int n_keys;
        if constexpr (M::ANY) {
            mrow = {t, q_head, 0, -1, 0.f};
            if (active) mrow = mods::row<M>(mp, sq, t, q_head, p.causal != 0);
            n_keys = mrow.last + 1;
        } else {
            n_keys = active ? visible_keys(t, sqn.seqlen_q(p.seqlen_q), seqlen_k, p.causal != 0) : 0;
        }
        // Keys any row of the block sees: those of its latest position.
        int n_block = visible_keys(sqn.seqlen_q(p.seqlen_q) - 1 - t_block * tb, sqn.seqlen_q(p.seqlen_q), seqlen_k,
                                   p.causal != 0);
        if (Sequence<ADDR>::VARLEN && sqn.seqlen_q(p.seqlen_q) - 1 - t_block * tb < 0) n_block = 0;  // past a short sequence
        // ... and (window) from the first key of its earliest position: stages before it are skipped
        int st_first = 0;
        if constexpr (M::WINDOW) {
            if (mp.window_left >= 0) {
                const int t_min = max(0, sqn.seqlen_q(p.seqlen_q) - 1 - (t_block * tb + tb - 1));
                st_first = (int)min((long long)seqlen_k, max(0LL, (long long)t_min + sq.diag - mp.window_left)) / KEYS;
            }
        }

        const T* k_row = k + sqn.k_batch() * p.k_stride[0] + sqn.k0() * p.k_stride[1] + kv_head * p.k_stride[2];
        const T* v_row = v + sqn.k_batch() * p.v_stride[0] + sqn.k0() * p.v_stride[1] + kv_head * p.v_stride[2];
        const T* q_row = q + b * p.q_stride[0] + (index_t)(sqn.q0() + (active ? t : 0)) * p.q_stride[1] + q_head * p.q_stride[2];
        const index_t q_sd = VEC ? 1 : p.q_stride[3], o_sd = VEC ? 1 : p.o_stride[3];

        // q (pre-scaled into the log2 domain) and o in registers.
        acc qv[PER_LANE], o[PER_LANE];
#pragma unroll
        for (int c = 0; c < CHUNKS; ++c) {
            const int d0 = (c * TEAM + lane) * W;
            acc x[W];
            if (VEC) {
                uint4 raw = make_uint4(0, 0, 0, 0);
                if (active && d0 < p.head_dim) raw = *reinterpret_cast<const uint4*>(q_row + d0);
                unpack16<T>(raw, x);
            } else {
#pragma unroll
                for (int e = 0; e < W; ++e)
                    x[e] = active && d0 + e < p.head_dim ? to_acc(q_row[(d0 + e) * q_sd]) : (acc)0;
            }
#pragma unroll
            for (int e = 0; e < W; ++e) {
                qv[c * W + e] = x[e] * (acc)p.scale_log2;
                o[c * W + e] = 0;
            }
        }

        acc m = NEG_INF, l = 0;
        const int n_stages = (n_block + KEYS - 1) / KEYS;
        __syncthreads();  // the previous block's last stage is no longer read
        if constexpr (M::WINDOW) {
            if (n_stages > st_first)
                stage_kv<T, DPAD, VEC, KEYS, ADDR>(sK + (st_first & 1) * L::STAGE, sV + (st_first & 1) * L::STAGE, k_row,
                                             v_row, st_first * KEYS, n_block, p, sqn);
        } else {
            if (n_stages > 0) stage_kv<T, DPAD, VEC, KEYS, ADDR>(sK, sV, k_row, v_row, 0, n_block, p, sqn);
        }
        if (VEC) cp_async_commit();
        for (int st = st_first; st < n_stages; ++st) {
            const int buf = st & 1;
            if (st + 1 < n_stages) {  // next stage in flight while this one is used
                stage_kv<T, DPAD, VEC, KEYS, ADDR>(sK + (buf ^ 1) * L::STAGE, sV + (buf ^ 1) * L::STAGE,
                                             k_row, v_row, (st + 1) * KEYS, n_block, p, sqn);
            }
            if (VEC) {
                cp_async_commit();
                cp_async_wait<1>();  // stage st has landed for this thread
            }
            __syncthreads();         // ... and for every thread

            const T* sk = sK + buf * L::STAGE;
            const T* sv = sV + buf * L::STAGE;
            const int j_end = min(KEYS, n_keys - st * KEYS);  // this row's keys in the stage
            for (int j = 0; j < j_end; j += KB) {
                // s_u = q . k_{j+u}: KB independent dot products
                acc s[KB];
#pragma unroll
                for (int u = 0; u < KB; ++u) s[u] = 0;
#pragma unroll
                for (int c = 0; c < CHUNKS; ++c) {
                    const int d0 = (c * TEAM + lane) * W;
#pragma unroll
                    for (int u = 0; u < KB; ++u) {
                        acc kx[W];
                        unpack16<T>(*reinterpret_cast<const uint4*>(sk + (j + u) * DPAD + d0), kx);
#pragma unroll
                        for (int e = 0; e < W; ++e) s[u] += qv[c * W + e] * kx[e];
                    }
                }
                bool vis[KB];  // (modifiers) the row sees key j + u
#pragma unroll
                for (int u = 0; u < KB; ++u) {
#pragma unroll
                    for (int off = TEAM / 2; off > 0; off /= 2) s[u] += __shfl_xor_sync(team_mask, s[u], off);
                    if constexpr (!M::ANY) {
                        if (j + u >= j_end) s[u] = NEG_INF;  // past this row's last key
                    } else {
                        const int key = st * KEYS + j + u;
                        vis[u] = j + u < j_end && mods::visible<M>(mp, sq, mrow, key);
                        s[u] = vis[u] ? mods::score<M>(s[u], mp, sq, mrow, key) : NEG_INF;
                    }
                }

                // online softmax over the batch: o = o * exp2(m - m') + sum_u exp2(s_u - m') v_u
                acc m_new = m;
#pragma unroll
                for (int u = 0; u < KB; ++u) m_new = s[u] > m_new ? s[u] : m_new;
                // (softmax.cuh: the reference is 0 while every score so far is -inf)
                const acc alpha = softmax::raise_ref(m, m_new, softmax::ExactExp2());
                const acc m_ref = softmax::ref(m);
                acc pu[KB];
#pragma unroll
                for (int u = 0; u < KB; ++u) pu[u] = exp2_acc(s[u] - m_ref);
                l = l * alpha + ((pu[0] + pu[1]) + (pu[2] + pu[3]));
#pragma unroll
                for (int i = 0; i < PER_LANE; ++i) o[i] *= alpha;
#pragma unroll
                for (int u = 0; u < KB; ++u) {
                    if (M::ANY ? vis[u] : j + u < j_end) {  // masked keys add nothing, not even 0 * Inf = NaN
#pragma unroll
                        for (int c = 0; c < CHUNKS; ++c) {
                            acc vx[W];
                            unpack16<T>(*reinterpret_cast<const uint4*>(sv + (j + u) * DPAD + (c * TEAM + lane) * W), vx);
#pragma unroll
                            for (int e = 0; e < W; ++e) o[c * W + e] += pu[u] * vx[e];
                        }
                    }
                }
            }
            __syncthreads();  // every row is done with this stage before it is refilled
        }

        if (active) {
            // A row with no visible key is all zeros with lse = -inf (with a sink: lse = the sink).
            acc inv_l;
            bool seen;
            if constexpr (!M::ANY) {
                seen = n_keys != 0;
                inv_l = softmax::out_scale(l, seen, len < 0);
            } else {
                const acc alpha = M::SINKS ? softmax::fold_sink(m, l, mods::sink2<M, acc>(mp, q_head)) : (acc)1;
                seen = l > (acc)0;  // (the window and mask_mod may leave a row no key)
                inv_l = softmax::out_scale(l, seen, len < 0) * alpha;
            }
            T* o_row = out + b * p.o_stride[0] + (sqn.q0() + t) * p.o_stride[1] + q_head * p.o_stride[2];
#pragma unroll
            for (int c = 0; c < CHUNKS; ++c) {
                const int d0 = (c * TEAM + lane) * W;
                if (VEC) {
                    if (d0 < p.head_dim) {
                        acc x[W];
#pragma unroll
                        for (int i = 0; i < W; ++i) x[i] = o[c * W + i] * inv_l;
                        *reinterpret_cast<uint4*>(o_row + d0) = pack16<T>(x);
                    }
                } else {
#pragma unroll
                    for (int i = 0; i < W; ++i)
                        if (d0 + i < p.head_dim) o_row[(d0 + i) * o_sd] = from_acc<T>(o[c * W + i] * inv_l);
                }
            }
            if (lse != nullptr && lane == 0)
                lse[sqn.lse_at(q_head, t, p.num_q_heads, p.seqlen_q)] = softmax::lse(m, l, seen, len < 0);
        }
    }
}

// SMEM_BYTES: the dynamic shared memory the launch passes (cupy_gqa/_specs.py:
// rowwise_smem), checked against the layout at compile time.
template <typename T, int DPAD, int TEAM, bool VEC, int KEYS, int SMEM_BYTES>
__global__ void __launch_bounds__(ROWWISE_THREADS, 1) rowwise_attention(
    const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
    T* __restrict__ out, float* __restrict__ lse, const int* __restrict__ seqlens_k, const AttnParams p)
{
    rowwise_body<T, DPAD, TEAM, VEC, KEYS, SMEM_BYTES, NoMods>(q, k, v, out, lse, seqlens_k, p, NoModParams{});
}

// The same with the modifiers FLAGS (common.cuh: MOD_*), whose values are in mp.
template <typename T, int DPAD, int TEAM, bool VEC, int KEYS, int SMEM_BYTES, int FLAGS>
__global__ void __launch_bounds__(ROWWISE_THREADS, 1) rowwise_attention_mods(
    const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
    T* __restrict__ out, float* __restrict__ lse, const int* __restrict__ seqlens_k, const AttnParams p,
    const ModParams mp)
{
    rowwise_body<T, DPAD, TEAM, VEC, KEYS, SMEM_BYTES, Mods<FLAGS, sizeof(T) == 2>>(q, k, v, out, lse, seqlens_k, p, mp);
}

// The same with per-sequence addressing ADDR (common.cuh: SEQ_*: varlen, paged
// K/V, left padding), described by sp.
template <typename T, int DPAD, int TEAM, bool VEC, int KEYS, int SMEM_BYTES, int ADDR>
__global__ void __launch_bounds__(ROWWISE_THREADS, 1) rowwise_attention_seq(
    const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
    T* __restrict__ out, float* __restrict__ lse, const int* __restrict__ seqlens_k, const AttnParams p,
    const SeqParams sp)
{
    rowwise_body<T, DPAD, TEAM, VEC, KEYS, SMEM_BYTES, NoMods, NoModParams, ADDR>(q, k, v, out, lse, seqlens_k, p,
                                                                                NoModParams{}, &sp);
}

// The same with per-sequence addressing ADDR and the modifiers FLAGS.
template <typename T, int DPAD, int TEAM, bool VEC, int KEYS, int SMEM_BYTES, int ADDR, int FLAGS>
__global__ void __launch_bounds__(ROWWISE_THREADS, 1) rowwise_attention_seq_mods(
    const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
    T* __restrict__ out, float* __restrict__ lse, const int* __restrict__ seqlens_k, const AttnParams p,
    const ModParams mp, const SeqParams sp)
{
    rowwise_body<T, DPAD, TEAM, VEC, KEYS, SMEM_BYTES, Mods<FLAGS, sizeof(T) == 2>, ModParams, ADDR>(
        q, k, v, out, lse, seqlens_k, p, mp, &sp);
}
