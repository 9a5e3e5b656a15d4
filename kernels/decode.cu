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
//   each; the row blocks of one key range are neighbours in the grid, run side
//   by side and share K/V in L2 (decode_mma_attention takes up to 64 rows in
//   one CTA, so that most shapes need one row block).
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
//   decode_mma_attention_cluster (sm_90; 2 to 8 splits): the splits of a row
//   block form one thread-block cluster, which merges them by the same rule
//   through distributed shared memory (decode_detail::cluster_merge): one
//   launch and no workspace.
//   These rules (and the end of a row below) are kernels/softmax.cuh's.
//   Causal masking is aligned bottom-right per sequence: query t of batch b
//   sees keys j <= t + len - seqlen_q. A row that sees no key writes 0 and
//   lse = -inf. A seqlens_k[b] outside [0, seqlen_k] (device arrays are not
//   range-checked on the host) makes every row of batch b NaN, out and lse.
//
// Grid mapping (decode_attention)
//   1-D grid of batch * num_kv_heads * num_splits * row_blocks CTAs of
//   DECODE_THREADS threads, row block fastest:
//       blockIdx.x = ((b * num_kv_heads + kv_head) * num_splits + split) * row_blocks + rb
//   row_blocks = ceil(seqlen_q * group_size / ROWS): the row blocks that read
//   the same keys are neighbours in the grid, so they run at the same time and
//   all but one take the keys from L2. Warp w, lane = 32 * w + x:
//   key group w * (32 / LANES) + x / LANES, lane x % LANES within it.
//   At step j0 group i reads keys j0 + u * NUM_GROUPS + i, u < U.
//   The cluster kernel puts the splits of a row block side by side instead
//   (split fastest), so that they form one cluster:
//       blockIdx.x = ((b * num_kv_heads + kv_head) * row_blocks + rb) * num_splits + split
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
//   HEAD_DIM  64, 128 or 256: the CUDA-core kernel's is p.head_dim; the
//             tensor-core kernels' is p.head_dim (a multiple of 8) rounded up:
//             columns past p.head_dim are zero in shared memory (Q, K, V) and
//             never written (out, part_o, whose rows are p.head_dim long)
//   ROWS      packed rows per CTA: 1, 2, 4 or 8 (rows past seqlen_q * group_size idle)
// Requirements (checked by the Python layer): head_dim stride 1, 16-byte
// aligned pointers and strides.
#include "common.cuh"
#include "softmax.cuh"

// Constants are enumerators: NVRTC would emit a namespace-scope constexpr
// variable as an (unused) global in every cubin.
enum : int {
    DECODE_THREADS = 128,           // threads per CTA (cupy_gqa/_specs.py: DECODE_THREADS)
    DECODE_LOADS = 4,               // 16-byte K loads (as many V loads) per lane per step
    DECODE_RESCALE_THRESHOLD = 8,   // of the lazy rescale, log2 units (see attend_step)
    DECODE_MIN_BLOCKS = 3,          // __launch_bounds__' CTAs per SM for ROWS <= 4 (caps the registers)
};

namespace decode_detail {

// The work of CTA blockIdx.x (see the grid mapping above): batch b, KV head,
// row block rb of ROWS packed rows, key range split; len = seqlen_k_of
// (-1: a bad seqlens_k[b]).
struct DecodeWork {
    int b, kv_head, rb, split, len;
};
// SPLIT_FASTEST (the cluster kernels): the splits of one row block are
// neighbours instead, blockIdx.x = ((b * num_kv_heads + kv_head) * row_blocks + rb)
// * num_splits + split, so that they form one thread-block cluster.
template <int ROWS, bool SPLIT_FASTEST = false>
__device__ __forceinline__ DecodeWork decode_work(const AttnParams& p, const int* seqlens_k, int num_splits) {
    const int row_blocks = (p.seqlen_q * p.group_size + ROWS - 1) / ROWS;
    index_t idx = blockIdx.x;
    int rb, split;
    if constexpr (SPLIT_FASTEST) {
        split = (int)(idx % num_splits);  idx /= num_splits;
        rb = (int)(idx % row_blocks);     idx /= row_blocks;
    } else {
        rb = (int)(idx % row_blocks);     idx /= row_blocks;
        split = (int)(idx % num_splits);  idx /= num_splits;
    }
    const int kv_head = (int)(idx % p.num_kv_heads);
    const int b = (int)(idx / p.num_kv_heads);
    return {b, kv_head, rb, split, seqlen_k_of(seqlens_k, b, p.seqlen_k)};
}

// The same with the CTA's sequence (common.cuh: Sequence; ADDR 0: contiguous,
// len from decode_work), whose lengths and rows the kernel then reads.
template <int ROWS, int ADDR, bool SPLIT_FASTEST = false>
__device__ __forceinline__ DecodeWork decode_work_seq(const AttnParams& p, const int* seqlens_k, const SeqParams* sp,
                                                      int num_splits, Sequence<ADDR>& sqn) {
    DecodeWork w = decode_work<ROWS, SPLIT_FASTEST>(p, ADDR == 0 ? seqlens_k : nullptr, num_splits);
    if constexpr (ADDR == 0) {
        sqn.b = w.b;
        sqn.len = w.len;
    } else {
        sqn = sequence_of<ADDR>(p, seqlens_k, sp, w.b);
        w.len = sqn.len;
    }
    return w;
}

enum : int { NUM_WARPS = DECODE_THREADS / 32 };

// W elements of one 16-byte chunk, as floats.
template <typename T>
__device__ __forceinline__ void unpack(const uint4& raw, float* dst) {
    const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
    for (int i = 0; i < 16 / (int)sizeof(T); ++i) dst[i] = to_acc(e[i]);
}

// K and V chunks of the U keys j, j + NUM_GROUPS, ... of a key group (zeros past k_end).
// (Key jj's row: sqn.kv_row, common.cuh; ks0, vs0: the strides of axis 0 of k, v.)
template <typename T, int U, int C, int NUM_GROUPS, int LANES, int ADDR>
__device__ __forceinline__ void load_step(uint4 (&kr)[U][C], uint4 (&vr)[U][C], const T* k_ptr, const T* v_ptr,
                                          index_t ks, index_t vs, int j, int k_end, const Sequence<ADDR>& sqn,
                                          index_t ks0, index_t vs0) {
    constexpr int W = 16 / (int)sizeof(T);
#pragma unroll
    for (int u = 0; u < U; ++u) {
        const int jj = j + u * NUM_GROUPS;
#pragma unroll
        for (int c = 0; c < C; ++c) {
            kr[u][c] = make_uint4(0, 0, 0, 0);
            vr[u][c] = make_uint4(0, 0, 0, 0);
            if (jj < k_end) {
                kr[u][c] = __ldg(reinterpret_cast<const uint4*>(k_ptr + sqn.kv_row(jj, ks0, ks) + c * LANES * W));
                vr[u][c] = __ldg(reinterpret_cast<const uint4*>(v_ptr + sqn.kv_row(jj, vs0, vs) + c * LANES * W));
            }
        }
    }
}

// One step of a key group over its U keys j, j + NUM_GROUPS, ... (see the top):
// scores, then the online softmax update of every row. MASK: some key may be
// past k_end or past a row's causal end.
// M: the modifiers (common.cuh: mods), with each row's view of them in mrow.
template <typename T, int ROWS, int U, int C, int NUM_GROUPS, int LANES, bool MASK, class M = NoMods>
__device__ __forceinline__ void attend_step(const uint4 (&kr)[U][C], const uint4 (&vr)[U][C],
                                            const float (&qv)[ROWS][8], float (&m)[ROWS], float (&l)[ROWS],
                                            float (&o)[ROWS][8], int j, int k_end, const int (&n_vis)[ROWS],
                                            const ModParams* mp = nullptr, const mods::Seq* sq = nullptr,
                                            const mods::Row* mrow = nullptr) {
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
            if constexpr (M::ANY) {
                if (M::MASKS && vis[u]) vis[u] = mods::visible<M>(*mp, *sq, mrow[i], j + u * NUM_GROUPS);
                if (M::SCORES && vis[u]) s[u][i] = mods::score<M>(s[u][i], *mp, *sq, mrow[i], j + u * NUM_GROUPS);
            }
            if (!vis[u]) s[u][i] = NEG_INF;
            m_new = fmaxf(m_new, s[u][i]);
        }
        // Lazy rescale: keep the old reference m unless the new max exceeds it
        // by more than DECODE_RESCALE_THRESHOLD (log2 units), so most steps skip
        // the exp2 and the o *= alpha; weights stay <= 2^threshold, exact in fp32.
        if (m_new > m[i] + DECODE_RESCALE_THRESHOLD) {
            const float alpha = softmax::raise_ref(m[i], m_new, softmax::FastExp2());  // 0 while m = -inf
            l[i] *= alpha;
#pragma unroll
            for (int d = 0; d < DL; ++d) o[i][d] *= alpha;
        }
        const float m_ref = softmax::ref(m[i]);  // 0 while every score so far is -inf
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

// The merge of the split results (lse2_s: lse in the log2 domain, o_s: o / l)
// of E output elements of one row, over splits s0, s0 + step, .. < n
// (decode_combine: a lane's share of them; cluster_merge: all):
//     mm = max_s lse2_s,  ls = sum_s exp2(lse2_s - mm),  acc = sum_s exp2(lse2_s - mm) o_s
// (a split that saw no key has lse2 = -inf and weighs 0); out = acc / ls.
template <int UNROLL, int E, class Lse, class O>
__device__ __forceinline__ void merge_parts(int s0, int n, int step, const Lse& lse_of, const O& o_of, float& mm,
                                            float& ls, float (&acc)[E]) {
    mm = neg_inf<float>();
#pragma unroll UNROLL
    for (int s = s0; s < n; s += step) mm = fmaxf(mm, lse_of(s));
    ls = 0.f;
#pragma unroll
    for (int e = 0; e < E; ++e) acc[e] = 0.f;
#pragma unroll UNROLL
    for (int s = s0; s < n; s += step) {
        const float wt = softmax::merge_weight(lse_of(s), mm);
        ls += wt;
        float ov[E];
        o_of(s, ov);
#pragma unroll
        for (int e = 0; e < E; ++e) acc[e] = fmaf(wt, ov[e], acc[e]);
    }
}

// Where a split's partial result (o / l normalised, its lse in the log2
// domain) goes: row(i, r, lse2) writes the lse of the CTA's row i (packed row r)
// and returns where the row's HEAD_DIM values go ...
// ... the workspace (see the top), merged by decode_combine;
struct WorkspacePart {
    float* o;
    float* lse;
    index_t prow0;  // the packed row index of (b, kv_head)'s row 0
    int split, num_splits, head_dim;  // (rows of p.head_dim values)
    __device__ __forceinline__ float* row(int i, int r, float lse2) const {
        const index_t at = (prow0 + r) * num_splits + split;
        lse[at] = lse2;
        return o + at * head_dim;
    }
};
// ... or the CTA's own shared memory, o[i][HEAD_DIM] and lse[i], merged by
// its cluster (cluster_merge).
template <int HEAD_DIM>
struct SmemPart {
    float* o;
    float* lse;
    __device__ __forceinline__ float* row(int i, int r, float lse2) const {
        lse[i] = lse2;
        return o + i * HEAD_DIM;
    }
};

// The CTA's result for its ROWS packed rows of row block rb. Each of NW warps
// left its (m, l, o) per row in shared memory: m_w[w * ROWS + i], l_w[same],
// o_w[(w * ROWS + i) * HEAD_DIM + d], with o and l relative to 2^m (log2
// domain). Two passes. One thread per row merges the row's (m, l): the warps'
// weights, the factor that normalises the row (1 / l; with a sink, its share;
// NaN for a bad length), where the row goes (out, or ``part``'s row) and its
// lse, written here; these go to row_w (shared memory the caller gives:
// row_scratch floats, 8-byte aligned). Then one thread per (row, dim) merges o
// with them and writes out = o / l (num_splits == 1), or this split's
// normalised partial (WorkspacePart, SmemPart). The row's exponentials,
// logarithm, reciprocal and address arithmetic so run once per row, in
// parallel, and the second pass is a few loads, FMAs and a store per element
// with nothing from one row to the next (a thread per element doing all of
// it, a division and its slow path in every row, took 0.25 us a row).
// M: the modifiers; a sink joins the row here when num_splits == 1 (else in
// decode_combine_mods).
// sqn: the CTA's sequence (common.cuh: Sequence), where its out and lse rows are.
template <int NW, int ROWS>
__host__ __device__ constexpr int row_scratch() { return (NW + 3) * ROWS; }
template <typename T, int HEAD_DIM, int ROWS, int NW, int THREADS, class M = NoMods, int ADDR = 0, class Part>
__device__ __forceinline__ void write_cta_result(const float* m_w, const float* l_w, const float* o_w, float* row_w,
                                                 T* out, float* lse, const AttnParams& p, int b, int kv_head, int rb,
                                                 int num_splits, int len, const Part& part,
                                                 const ModParams* mp, const Sequence<ADDR>& sqn) {
    static_assert(ROWS <= THREADS, "a thread per row");
    const float NEG_INF = neg_inf<float>();
    const int group_size = p.group_size, rows_total = p.seqlen_q * group_size;
    void** const dst_w = reinterpret_cast<void**>(row_w);  // [ROWS] where row i goes (nullptr: nowhere)
    float* const wt_w = row_w + 2 * ROWS;                  // [NW][ROWS] the warps' weights
    float* const sc_w = row_w + (NW + 2) * ROWS;           // [ROWS] the factor of the merged o
    if (threadIdx.x < ROWS) {
        const int i = threadIdx.x, r = rb * ROWS + i;
        float mm = NEG_INF;
#pragma unroll
        for (int w = 0; w < NW; ++w) mm = fmaxf(mm, m_w[w * ROWS + i]);
        float ls = 0.f;
#pragma unroll
        for (int w = 0; w < NW; ++w) {
            const float wt = softmax::merge_weight(m_w[w * ROWS + i], mm);
            ls = fmaf(l_w[w * ROWS + i], wt, ls);
            wt_w[w * ROWS + i] = wt;
        }
        void* dst = nullptr;
        float scale = 0.f;
        const int t = r / group_size;
        if (r < rows_total && (ADDR == 0 || t < sqn.seqlen_q(p.seqlen_q))) {  // (ADDR: past the sequence's queries)
            if (num_splits == 1) {
                const int q_head = q_head_of(kv_head, r % group_size, group_size);
                float alpha = 1.f;
                if constexpr (M::SINKS)  // the sink joins the denominator (softmax.cuh: fold_sink)
                    alpha = softmax::fold_sink(mm, ls, mods::sink2<M, float>(*mp, q_head));
                const bool bad = len < 0;
                const bool seen = ls != 0.f;  // (with a sink's share, if any)
                scale = softmax::out_scale(ls, seen, bad) * alpha;
                dst = out + b * p.o_stride[0] + (sqn.q0() + t) * p.o_stride[1] + q_head * p.o_stride[2];
                if (lse != nullptr) lse[sqn.lse_at(q_head, t, p.num_q_heads, p.seqlen_q)] = softmax::lse(mm, ls, seen, bad);
            } else {
                const bool seen = ls != 0.f;  // a row that saw no key (of this split): 0 and lse = -inf
                scale = softmax::out_scale(ls, seen, false);  // (a bad length: NaN in the combine)
                dst = part.row(i, r, softmax::lse2(mm, ls, seen));
            }
        }
        dst_w[i] = dst;
        sc_w[i] = scale;
    }
    __syncthreads();
    constexpr int ITERS = (ROWS * HEAD_DIM + THREADS - 1) / THREADS;
#pragma unroll
    for (int it = 0; it < ITERS; ++it) {
        const int x = threadIdx.x + it * THREADS;
        const int i = x / HEAD_DIM, d = x % HEAD_DIM;
        if (ROWS * HEAD_DIM % THREADS != 0 && x >= ROWS * HEAD_DIM) break;
        void* const dst = dst_w[i];
        if (dst == nullptr || d >= p.head_dim) continue;  // (padded columns: never written)
        float os = 0.f;
#pragma unroll
        for (int w = 0; w < NW; ++w) os = fmaf(o_w[(w * ROWS + i) * HEAD_DIM + d], wt_w[w * ROWS + i], os);
        const float res = os * sc_w[i];
        if (num_splits == 1)
            static_cast<T*>(dst)[d] = from_acc<T>(res);
        else
            static_cast<float*>(dst)[d] = res;
    }
}

}  // namespace decode_detail

// The kernel's body, for the kernel without modifiers (M = NoMods) and the one
// with them (decode_attention_mods, common.cuh: modifiers).
// ADDR: the per-sequence addressing (common.cuh: Sequence; 0: contiguous) of sp.
template <typename T, int HEAD_DIM, int ROWS, class M, int ADDR = 0>
__device__ __forceinline__ void decode_body(
    const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
    T* __restrict__ out, float* __restrict__ lse, const int* __restrict__ seqlens_k, const AttnParams& p,
    float* __restrict__ part_o, float* __restrict__ part_lse, const int num_splits, const ModParams& mp,
    const SeqParams* sp = nullptr)
{
    using namespace decode_detail;
    allow_dependent_launch();  // the combine's CTAs may start (they wait for this kernel)
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
    // (call_rows: the call's packed rows, computed here as the contiguous kernel always has)
    const int group_size = p.group_size, call_rows = p.seqlen_q * group_size;
    Sequence<ADDR> sqn;  // the CTA's sequence: where its queries and keys are
    const DecodeWork work = decode_work_seq<ROWS, ADDR>(p, seqlens_k, sp, num_splits, sqn);
    const int split = work.split, rb = work.rb, kv_head = work.kv_head, b = work.b, len = work.len;  // len -1: bad
    const int rows_total = sqn.packed_rows(call_rows, group_size);  // the sequence's packed rows

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int group = warp * GROUPS_PER_WARP + lane / LANES;
    const int gl = lane % LANES;  // lane within the key group

    // rows of this CTA: r = rb * ROWS + i = t * group_size + g
    float qv[ROWS][DL];
    int n_vis[ROWS];  // keys [0, n_vis) visible to the row (0 for idle rows)
    int n_max = 0, n_min = 1 << 30;  // over the live rows
    const mods::Seq sq = mods::seq(b, sqn.seqlen_q(p.seqlen_q), max(len, 0));
    mods::Row mrow[M::ANY ? ROWS : 1];  // the rows' view of the modifiers (common.cuh: mods)
    int first_min = 1 << 30;            // (window) the first key any live row sees
#pragma unroll
    for (int i = 0; i < ROWS; ++i) {
        const int r = rb * ROWS + i;
        const int t = r / group_size, g = r % group_size;
        const bool live = r < rows_total && len >= 0;
        if constexpr (M::ANY) {
            mrow[i] = {t, 0, 0, -1, 0.f};
            if (live) mrow[i] = mods::row<M>(mp, sq, t, q_head_of(kv_head, g, group_size), p.causal != 0);
            n_vis[i] = mrow[i].last + 1;
            if (live) first_min = min(first_min, mrow[i].first);
        } else {
            n_vis[i] = live ? visible_keys(t, sqn.seqlen_q(p.seqlen_q), len, p.causal != 0) : 0;
        }
        n_max = max(n_max, n_vis[i]);
        if (live) n_min = min(n_min, n_vis[i]);
        const T* q_row = q + b * p.q_stride[0] + (sqn.q0() + t) * p.q_stride[1]
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
    // (with the window or mask_mod: none)
    const int k_full = M::MASKS ? k_begin : k_begin + max(0, min(k_end, n_min) - k_begin) / STEP * STEP;
    // (window) whole steps before the first key any row sees are skipped; the
    // steps keep their places, so each key meets the same lane as without
    const int j_start = M::WINDOW ? k_begin + max(0, first_min - k_begin) / STEP * STEP : k_begin;
    const T* k_ptr = k + sqn.k_batch() * p.k_stride[0] + sqn.k0() * p.k_stride[1] + kv_head * p.k_stride[2] + gl * W;
    const T* v_ptr = v + sqn.k_batch() * p.v_stride[0] + sqn.k0() * p.v_stride[1] + kv_head * p.v_stride[2] + gl * W;
    const index_t ks = p.k_stride[1], vs = p.v_stride[1];

    // software pipeline: step j0 + STEP's loads are in flight while step j0 is computed
    uint4 kr[U][C], vr[U][C], kn[U][C], vn[U][C];
    load_step<T, U, C, NUM_GROUPS, LANES>(kr, vr, k_ptr, v_ptr, ks, vs, j_start + group, k_end, sqn, p.k_stride[0],
                                          p.v_stride[0]);
    for (int j0 = j_start; j0 < k_end; j0 += STEP) {
        load_step<T, U, C, NUM_GROUPS, LANES>(kn, vn, k_ptr, v_ptr, ks, vs, j0 + STEP + group, k_end, sqn, p.k_stride[0],
                                              p.v_stride[0]);
        if (j0 + STEP <= k_full)
            attend_step<T, ROWS, U, C, NUM_GROUPS, LANES, false, M>(kr, vr, qv, m, l, o, j0 + group, k_end, n_vis, &mp, &sq, mrow);
        else
            attend_step<T, ROWS, U, C, NUM_GROUPS, LANES, true, M>(kr, vr, qv, m, l, o, j0 + group, k_end, n_vis, &mp, &sq, mrow);
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
        for (int i = 0; i < ROWS; ++i) softmax::shfl_merge(0xffffffffu, off, m[i], l[i], o[i]);
    }

    // then the warps, through shared memory
    __shared__ float sm_m[NUM_WARPS][ROWS], sm_l[NUM_WARPS][ROWS];
    __shared__ float sm_o[NUM_WARPS][ROWS][HEAD_DIM];
    __shared__ __align__(8) float sm_w[row_scratch<NUM_WARPS, ROWS>()];  // write_cta_result's per-row values
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

    const WorkspacePart part{part_o, part_lse, ((index_t)b * p.num_kv_heads + kv_head) * call_rows, split, num_splits,
                             HEAD_DIM};
    write_cta_result<T, HEAD_DIM, ROWS, NUM_WARPS, DECODE_THREADS, M>(&sm_m[0][0], &sm_l[0][0], &sm_o[0][0][0], sm_w, out, lse,
                                                                      p, b, kv_head, rb, num_splits, len, part, &mp, sqn);
}

template <typename T, int HEAD_DIM, int ROWS>
__global__ void __launch_bounds__(DECODE_THREADS, ROWS <= 4 ? DECODE_MIN_BLOCKS : 1) decode_attention(
    const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
    T* __restrict__ out, float* __restrict__ lse, const int* __restrict__ seqlens_k, const AttnParams p,
    float* __restrict__ part_o, float* __restrict__ part_lse, const int num_splits)
{
    decode_body<T, HEAD_DIM, ROWS, NoMods>(q, k, v, out, lse, seqlens_k, p, part_o, part_lse, num_splits, ModParams{});
}

// The same with the modifiers FLAGS (common.cuh: MOD_*), whose values are in mp.
template <typename T, int HEAD_DIM, int ROWS, int FLAGS>
__global__ void __launch_bounds__(DECODE_THREADS, ROWS <= 4 ? DECODE_MIN_BLOCKS : 1) decode_attention_mods(
    const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
    T* __restrict__ out, float* __restrict__ lse, const int* __restrict__ seqlens_k, const AttnParams p,
    float* __restrict__ part_o, float* __restrict__ part_lse, const int num_splits, const ModParams mp)
{
    decode_body<T, HEAD_DIM, ROWS, Mods<FLAGS, sizeof(T) == 2>>(q, k, v, out, lse, seqlens_k, p, part_o, part_lse, num_splits, mp);
}

// ---- decode_mma_attention: fp16 / bf16 on tensor cores -----------------------
// The same work split as decode_attention (CTA = (b, kv_head, row block of
// ROWS = 16 * ROW_WARPS packed rows, split)), but the products run on
// mma.sync m16n8k16 as in tiled.cu: 16 packed rows are the M dimension of a
// warp's tile, so one tensor-core tile serves every row of a GQA group and
// every query token at once, and an instruction stream of ~8 mma per 8 keys
// replaces ~600 CUDA-core instructions.
// The NW warps form NW / ROW_WARPS key streams of ROW_WARPS warps: warp
// w = s * ROW_WARPS + rt takes rows rt * 16 .. + 16 of the CTA's block and
// the key tiles of stream s: tile u = 0, 1, .. of the CTA's range (DECODE_MMA_BN
// keys each) goes to stream u % STREAMS. A stream runs its own STAGES-deep
// cp.async pipeline in its own shared memory, each of its warps copying
// 1 / ROW_WARPS of a tile; its warps meet at a named barrier per tile
// (ROW_WARPS 1: __syncwarp, no CTA barrier in the loop). So every K/V byte of
// the range is read once from memory for all ROWS rows (ROW_WARPS 4: 64 rows,
// multi-query attention with many heads), and the rows of a tile cost tensor
// time, not bytes. Per tile a warp computes S = Q K^T (16 x 16, fp32) for its
// 16 rows, masks it when the tile crosses a row's causal end or the range
// end, updates its online softmax (lazy rescale, as in tiled.cu) and adds
// P V. At the end the streams' (m, l, o) go through shared memory to
// write_cta_result.
//
// Shared memory (dynamic; decode_detail::MmaSmem is the one definition, and
// the SMEM_BYTES template argument, the size the launch passes, must equal its
// BYTES; Q rows padded by 8 elements as in tiled.cu, K/V rows swizzled, see kv_at):
//   [ Q: ROWS x (HEAD_DIM + 8) | stream 0: stage 0 K, V | stage 1 K, V | ... | stream 1 ... ]
//   then, reusing the stages once every warp is done: m, l [STREAMS][ROWS],
//   o [STREAMS][ROWS][HEAD_DIM] fp32, and write_cta_result's per-row values.
enum : int {
    DECODE_MMA_WARPS = 4,  // warps per CTA (cupy_gqa/_specs.py: DECODE_MMA_WARPS)
    DECODE_MMA_BN = 16,    // keys per K/V tile (cupy_gqa/_specs.py: DECODE_MMA_BN)
};

namespace decode_detail {
// The combine's lanes per output quad (cupy_gqa/_plan.py: decode_combine_lanes): enough
// that a lane takes at most 4 of the splits (DECODE_MAX_SPLITS 128), all its loads in
// flight at once (_plan.DECODE_COMBINE_UNROLL), whatever the split count.
__device__ __forceinline__ int combine_lanes(int num_splits) {
    return num_splits > 64 ? 32 : num_splits > 32 ? 16 : num_splits >= 8 ? 8 : num_splits >= 4 ? 4 : num_splits >= 2 ? 2 : 1;
}
// cp_async_16 with an L2::128B prefetch size hint (H200: 2% faster than none
// with padded K/V rows, the same once they are swizzled).
__device__ __forceinline__ void copy_16(unsigned dst, const void* src, bool pred) {
    asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(pred ? 16 : 0));
}

// Element offset of 16-byte chunk c of row r (r % 8 == swz) in a K/V tile:
// rows of exactly HEAD_DIM elements, chunk c stored at c ^ (r % 8), so the 8
// row addresses of an ldmatrix hit 8 different bank groups and each 128-byte
// piece of a row lands in one aligned 128-byte piece of shared memory (a row
// padded to HEAD_DIM + 8 would split most such copies in two: twice the L2
// requests).
template <int HEAD_DIM>
__device__ __forceinline__ int kv_at(int r, int c, int swz) {
    return r * HEAD_DIM + (c ^ swz) * 8;
}

// The shared-memory layout of decode_mma_attention (see above): offsets in bytes.
template <typename T, int HEAD_DIM, int ROW_WARPS, int STAGES>
struct MmaSmem {
    enum : int {
        ROWS = 16 * ROW_WARPS,                   // packed rows of the CTA
        STREAMS = DECODE_MMA_WARPS / ROW_WARPS,  // key streams
        Q_ROW = HEAD_DIM + 8,                    // padded Q row, elements
        TILE = DECODE_MMA_BN * HEAD_DIM,         // one K (or V) tile, elements (kv_at)
        STREAM = STAGES * 2 * TILE,              // one stream's stages [STAGES][K, V], elements
        Q = 0,                                   // [ROWS][Q_ROW] of T
        KV = Q + ROWS * Q_ROW * (int)sizeof(T),  // [STREAMS][STREAM] of T
        KV_END = KV + STREAMS * STREAM * (int)sizeof(T),
        M_W = KV,                                // the merge, over the stages: m [STREAMS][ROWS] fp32,
        L_W = M_W + STREAMS * ROWS * (int)sizeof(float),  // l [STREAMS][ROWS],
        O_W = L_W + STREAMS * ROWS * (int)sizeof(float),  // o [STREAMS][ROWS][HEAD_DIM]
        ROW_W = O_W + STREAMS * ROWS * HEAD_DIM * (int)sizeof(float),  // write_cta_result's per-row values
        MERGE_END = ROW_W + row_scratch<STREAMS, ROWS>() * (int)sizeof(float),
        BYTES = KV_END > MERGE_END ? KV_END : MERGE_END,
        // (cluster kernel) the CTA's partial result for its cluster (SmemPart): o [ROWS][HEAD_DIM]
        // over stream 0's o (each thread writes the element it has merged, after reading it),
        // lse [ROWS] over Q (unused after the last tile)
        PART_O = O_W,
        PART_LSE = Q,
    };
};

// The ROW_WARPS warps of key stream s meet here once per tile: their copies of
// the tile (cp_async_wait before) are then visible to all of them, and the
// stage they last read is free. One warp: __syncwarp; more (two streams at
// most): named barrier 1 + s, as an immediate so that ptxas reserves only those.
template <int ROW_WARPS>
__device__ __forceinline__ void stream_sync(int s) {
    static_assert(ROW_WARPS == 1 || DECODE_MMA_WARPS / ROW_WARPS <= 2, "named barriers 1 and 2");
    if constexpr (ROW_WARPS == 1)
        __syncwarp();
    else if (s == 0)
        asm volatile("bar.sync 1, %0;\n" ::"n"(ROW_WARPS * 32) : "memory");
    else
        asm volatile("bar.sync 2, %0;\n" ::"n"(ROW_WARPS * 32) : "memory");
}

// ---- thread-block clusters (sm_90) ---------------------------------------------
__device__ __forceinline__ void cluster_sync() {
    asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}
__device__ __forceinline__ unsigned cluster_rank() {
    unsigned r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
    return r;
}
// The float at shared-memory address addr (this CTA's) in the shared memory of
// the cluster's CTA ``rank`` (distributed shared memory).
__device__ __forceinline__ float ld_cluster(unsigned addr, unsigned rank) {
    unsigned remote;
    float x;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(remote) : "r"(addr), "r"(rank));
    asm volatile("ld.shared::cluster.f32 %0, [%1];\n" : "=f"(x) : "r"(remote) : "memory");
    return x;
}

// The merge of a row block's CLUSTER splits, one CTA each in one cluster: each
// left its partial result at the same place of its shared memory (SmemPart:
// po[ROWS][HEAD_DIM], pl[ROWS]); after a cluster barrier, CTA rank c merges
// elements c * THREADS + tid, + CLUSTER * THREADS, .. of the block's
// ROWS x HEAD_DIM from every CTA's (merge_parts, the combine's rule) and
// writes out and lse; a second barrier keeps each CTA's shared memory until
// the others have read it. No workspace, no second launch.
template <typename T, int HEAD_DIM, int ROWS, int THREADS, int CLUSTER, int ADDR>
__device__ __forceinline__ void cluster_merge(const float* po, const float* pl, T* out, float* lse, const AttnParams& p,
                                              int b, int kv_head, int rb, int len, const Sequence<ADDR>& sqn) {
    cluster_sync();  // every split's partial result is written (release / acquire)
    const int group_size = p.group_size, rows_total = sqn.packed_rows(p.seqlen_q * group_size, group_size);
    const unsigned o_base = smem_addr(po), l_base = smem_addr(pl);
    const bool bad = len < 0;
    for (int x = (int)cluster_rank() * THREADS + threadIdx.x; x < ROWS * HEAD_DIM; x += CLUSTER * THREADS) {
        const int i = x / HEAD_DIM, d = x % HEAD_DIM, r = rb * ROWS + i;
        if (r >= rows_total) break;  // rows are the slow index: the rest are idle too
        if (d >= p.head_dim) continue;  // (padded columns: never written)
        float lse2[CLUSTER];  // each split's lse of the row, read once
#pragma unroll
        for (int s = 0; s < CLUSTER; ++s) lse2[s] = ld_cluster(l_base + 4 * i, s);
        float mm, ls, acc[1];
        merge_parts<CLUSTER>(
            0, CLUSTER, 1, [&](int s) { return lse2[s]; },
            [&](int s, float (&ov)[1]) { ov[0] = ld_cluster(o_base + 4 * (i * HEAD_DIM + d), s); }, mm, ls, acc);
        const int t = r / group_size, q_head = q_head_of(kv_head, r % group_size, group_size);
        const bool seen = ls != 0.f;
        out[b * p.o_stride[0] + (sqn.q0() + t) * p.o_stride[1] + q_head * p.o_stride[2] + d] =
            from_acc<T>(acc[0] * softmax::out_scale(ls, seen, bad));
        if (lse != nullptr && d == 0)
            lse[sqn.lse_at(q_head, t, p.num_q_heads, p.seqlen_q)] = softmax::lse(mm, ls, seen, bad);
    }
    cluster_sync();  // ... and read by every CTA of the cluster
}
}  // namespace decode_detail

// SMEM_BYTES: the dynamic shared memory the launch passes (cupy_gqa/_specs.py:
// decode_mma_smem), checked against the layout at compile time.
// The kernel's body, for the kernel without modifiers (M = NoMods) and the one
// with them (decode_mma_attention_mods, common.cuh: modifiers).
// ADDR: the per-sequence addressing (common.cuh: Sequence; 0: contiguous) of sp.
template <typename T, int HEAD_DIM, int ROW_WARPS, int STAGES, int SMEM_BYTES, class M, int ADDR = 0, int CLUSTER = 1>
__device__ __forceinline__ void decode_mma_body(
    const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
    T* __restrict__ out, float* __restrict__ lse, const int* __restrict__ seqlens_k, const AttnParams& p,
    float* __restrict__ part_o, float* __restrict__ part_lse, const int num_splits, const ModParams& mp,
    const SeqParams* sp = nullptr)
{
    using namespace decode_detail;
    constexpr int NW = DECODE_MMA_WARPS, THREADS = NW * 32;
    using L = MmaSmem<T, HEAD_DIM, ROW_WARPS, STAGES>;
    constexpr int ROWS = L::ROWS, NS = L::STREAMS, BN = DECODE_MMA_BN;
    constexpr int D = HEAD_DIM, ROW = L::Q_ROW;     // padded smem row, elements
    constexpr int CH = D / 8;                       // 16-byte chunks per row
    constexpr int KD = D / 16;                      // k16 steps of Q K^T
    constexpr int NT = BN / 8;                      // n8 tiles of S
    constexpr int DT = D / 8;                       // n8 tiles of O
    constexpr int TILE = L::TILE;                   // elements of one K (or V) tile (rows of D, kv_at)
    constexpr int RPP = 32 / CH;                    // key rows a warp copies per pass
    constexpr int PASSES = BN / RPP / ROW_WARPS;    // copy passes of each warp of a stream per tile
    constexpr bool Q_REGS = D <= 128;               // Q fragments in registers (D 256: from smem)
    // P as two 16-bit terms in P V (P = hi + rounded rest): the rounding of P leaves
    // the error, which is then the output's own rounding. One more mma per P V mma,
    // where the tensor cores have room beside the loads: one or two row warps
    constexpr bool P_PAIR = ROW_WARPS <= 2;
    static_assert(sizeof(T) == 2, "fp16 / bf16 only");
    static_assert(SMEM_BYTES == L::BYTES, "SMEM_BYTES is not the size of the shared-memory layout");
    static_assert(D % 16 == 0 && CH >= 8 && CH <= 32 && 32 % CH == 0 && BN % 16 == 0 && BN % RPP == 0, "tile shapes");
    static_assert(NW % ROW_WARPS == 0 && PASSES >= 1 && PASSES * RPP * ROW_WARPS == BN, "ROW_WARPS: 1, 2 or 4");
    const float NEG_INF = neg_inf<float>();
    const float scale_log2 = (float)p.scale_log2;

    extern __shared__ __align__(16) unsigned char smem_raw[];
    T* sQ = reinterpret_cast<T*>(smem_raw + L::Q);
    allow_dependent_launch();  // the combine's CTAs may start (they wait for this kernel)

    // --- which work: (b, kv_head, row block, split) -------------------------
    // (call_rows: the call's packed rows, computed here as the contiguous kernel always has)
    const int group_size = p.group_size, call_rows = p.seqlen_q * group_size;
    Sequence<ADDR> sqn;  // the CTA's sequence: where its queries and keys are
    const DecodeWork work = decode_work_seq<ROWS, ADDR, (CLUSTER > 1)>(p, seqlens_k, sp, num_splits, sqn);
    const int split = work.split, rb = work.rb, kv_head = work.kv_head, b = work.b, len = work.len;  // len -1: bad
    const int rows_total = sqn.packed_rows(call_rows, group_size);  // the sequence's packed rows
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int stream = warp / ROW_WARPS, rt = warp % ROW_WARPS;  // key stream, row tile (rows rt * 16 ..)

    // --- Q tile (zero past the last row) and the rows' visible keys -----------
    for (int c = threadIdx.x; c < ROWS * CH; c += THREADS) {
        const int i = c / CH, ch = c % CH, r = rb * ROWS + i;
        const bool live = r < rows_total && len >= 0 && ch * 8 < p.head_dim;  // (padded columns: zeros)
        const int t = r / group_size, g = r % group_size;
        const T* src = live ? q + b * p.q_stride[0] + (sqn.q0() + t) * p.q_stride[1] + q_head_of(kv_head, g, group_size) * p.q_stride[2] + ch * 8 : q;
        cp_async_16(smem_addr(sQ + i * ROW + ch * 8), src, live);
    }
    cp_async_commit();
    // n_max, first_min over the CTA's live rows (the stream's loads), n_min over the warp's (its masks)
    int n_max = 0, n_min = 1 << 30;
    int n_vis[2];                    // of this lane's rows rt * 16 + lane / 4 and + 8
    const mods::Seq sq = mods::seq(b, sqn.seqlen_q(p.seqlen_q), max(len, 0));
    mods::Row mrow[2];               // (modifiers) the lane's rows' view of them (common.cuh: mods)
    int first_min = 1 << 30;         // (window) the first key any live row sees
    const int my_row = rt * 16 + lane / 4;
    if constexpr (M::ANY) {
#pragma unroll(ROWS <= 16 ? ROWS : 1)
        for (int i = 0; i < ROWS; ++i) {
            const int r = rb * ROWS + i;
            const bool live = r < rows_total && len >= 0;
            mods::Row mr = {r / group_size, 0, 0, -1, 0.f};
            if (live) mr = mods::row<M>(mp, sq, r / group_size, q_head_of(kv_head, r % group_size, group_size), p.causal != 0);
            const int n = mr.last + 1;
            if (live) {
                first_min = min(first_min, mr.first);
                n_max = max(n_max, n);
                if (i / 16 == rt) n_min = min(n_min, n);
            }
            if (i == my_row) { mrow[0] = mr; n_vis[0] = n; }
            if (i == my_row + 8) { mrow[1] = mr; n_vis[1] = n; }
        }
    } else {
        // without modifiers a row's visible keys grow with its query (visible_keys), so the
        // extremes are the first and last live rows' (a loop over the rows costs a division
        // a row at the start of every CTA)
        const int r0 = rb * ROWS, r_end = len >= 0 ? min(r0 + ROWS, rows_total) : r0;  // live rows [r0, r_end)
        const int sq_len = sqn.seqlen_q(p.seqlen_q);
        const bool causal = p.causal != 0;
        auto vis = [&](int r) { return r < r_end ? visible_keys(r / group_size, sq_len, len, causal) : 0; };
        if (r_end > r0) n_max = vis(r_end - 1);
        if (r0 + rt * 16 < r_end) n_min = vis(r0 + rt * 16);
        n_vis[0] = vis(r0 + my_row);
        n_vis[1] = vis(r0 + my_row + 8);
    }

    // --- this split's keys [k_begin, k_end), in tiles of BN -----------------
    const int chunk = ((max(len, 0) + num_splits - 1) / num_splits + BN - 1) / BN * BN;
    const int k_begin = split * chunk;
    const int k_end = min(min(k_begin + chunk, max(len, 0)), n_max);
    const int k_free = min(k_end, n_min);  // keys below it are seen by every live row of the warp: no mask
    const int num_tiles = k_end > k_begin ? (k_end - k_begin + BN - 1) / BN : 0;
    // tiles s, s + NS, .. of stream s: u_first (window: the first tile any row sees) to
    // num_tiles, as indices i of the stream's tiles [first(s), count(s))
    const int u_first = M::WINDOW ? max(0, first_min - k_begin) / BN : 0;
    auto count = [&](int s) { return num_tiles > s ? (num_tiles - s + NS - 1) / NS : 0; };
    auto first = [&](int s) { return u_first > s ? (u_first - s + NS - 1) / NS : 0; };
    const int my_tiles = count(stream);
    const int last[2] = {min(k_end, n_vis[0]) - 1, min(k_end, n_vis[1]) - 1};  // last key rows lane / 4 (+ 8) see
    // (window) the stream's tiles before the first key any row sees are skipped;
    // every tile keeps its stream, so each key meets the same lane as without
    const int i_first = first(stream);
    if constexpr (M::WINDOW) {
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) mrow[hf].last = min(mrow[hf].last, k_end - 1);
    } else if constexpr (M::ANY) {
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) mrow[hf].last = min(mrow[hf].last, k_end - 1);
    }

    // lane copies 16-byte chunk lane % CH of key rows ld_r + RPP * i of a tile (the warp's
    // band of PASSES * RPP rows in its stream's tile). Everything a copy's addresses need
    // that does not change from tile to tile is computed here, once: the loop is short
    // (one warp per scheduler), and its address arithmetic was most of it.
    const int ld_r = rt * PASSES * RPP + lane / CH, ld_ch = lane % CH;
    // (a padded head dim) a lane of a column past p.head_dim copies zeros, from column 0
    const bool ld_col = ld_ch * 8 < p.head_dim;
    const int src_ch = ld_col ? ld_ch : 0;
    const index_t ks = p.k_stride[1], vs = p.v_stride[1];
    const index_t k_pass = RPP * ks, v_pass = RPP * vs;  // from pass i to i + 1, elements
    // shared memory: rows ld_r + RPP * i for i < SWZ_P have distinct swizzles (kv_at);
    // pass i + SWZ_P is row + 8, the same swizzle, 8 * D elements further
    constexpr int SWZ_P = 8 / RPP < PASSES ? 8 / RPP : PASSES;
    const T* sW = reinterpret_cast<T*>(smem_raw + L::KV) + stream * L::STREAM;  // this stream's stages: [STAGES][K, V][BN][D]
    unsigned dst[SWZ_P];
#pragma unroll
    for (int i = 0; i < SWZ_P; ++i) dst[i] = smem_addr(sW + kv_at<D>(ld_r + i * RPP, ld_ch, (ld_r + i * RPP) & 7));
    // the next tile this stream copies: its first key, and (contiguous) the lane's rows of it
    int next_key0 = k_begin + (stream + i_first * NS) * BN;
    const T* k_next = k + sqn.k_batch() * p.k_stride[0] + sqn.k0() * ks + kv_head * p.k_stride[2] + (ld_r + (index_t)next_key0) * ks + src_ch * 8;
    const T* v_next = v + sqn.k_batch() * p.v_stride[0] + sqn.k0() * vs + kv_head * p.v_stride[2] + (ld_r + (index_t)next_key0) * vs + src_ch * 8;
    const index_t k_step = (index_t)NS * BN * ks, v_step = (index_t)NS * BN * vs;  // from one of the stream's tiles to its next
    // (pages) the pages of the next tile this stream copies, read while the tiles before it compute
    typename Sequence<ADDR>::PageSpan span = {0, 0, 0};
    auto look_up = [&](int key0) {
        if (key0 < k_end) span = sqn.page_span(key0, min(BN, k_end - key0));
    };
    if constexpr (Sequence<ADDR>::PAGED) look_up(next_key0);
    // copy the stream's next tile (keys next_key0 .. + BN, zero past k_end) into stage `stage`
    auto load_tile = [&](int stage) {
        const int key0 = next_key0;
        const T* kp = k_next;  // the lane's row of pass 0; pass i: kp + i * k_pass
        const T* vp = v_next;
        [[maybe_unused]] index_t k_jump = 0, v_jump = 0;  // (pages) from the first page's rows to the second's
        [[maybe_unused]] int page_left = 0;  // (pages) passes i with RPP * i < page_left read the first page
        if constexpr (Sequence<ADDR>::PAGED) {
            const typename Sequence<ADDR>::PageSpan here = span;
            look_up(key0 + NS * BN);  // tiles stream, stream + NS, .. in order
            const index_t row = here.row + ld_r;  // the lane's first row, on the first page
            kp = k + kv_head * p.k_stride[2] + src_ch * 8 + (index_t)here.first * p.k_stride[0] + row * ks;
            vp = v + kv_head * p.v_stride[2] + src_ch * 8 + (index_t)here.first * p.v_stride[0] + row * vs;
            page_left = sqn.page_size - (int)row;
            // row page_size of the first page is row 0 of the second
            k_jump = (index_t)(here.second - here.first) * p.k_stride[0] - (index_t)sqn.page_size * ks;
            v_jump = (index_t)(here.second - here.first) * p.v_stride[0] - (index_t)sqn.page_size * vs;
        } else {
            k_next += k_step;
            v_next += v_step;
        }
        next_key0 = key0 + NS * BN;
        const unsigned st = stage * 2 * TILE * (int)sizeof(T);
        // the lane's pass i has a key while RPP * i < left (every pass of a full tile); a pass
        // past the range copies nothing (zeros) from the tile's first key row, which exists
        const int left = k_end - key0 - ld_r;
        const T* k_safe = kp - (index_t)ld_r * ks;
        const T* v_safe = vp - (index_t)ld_r * vs;
#pragma unroll
        for (int i = 0; i < PASSES; ++i) {
            const unsigned d = dst[i % SWZ_P] + st + (i / SWZ_P) * 8 * D * (int)sizeof(T);
            const T* ki = kp;
            const T* vi = vp;
            if constexpr (Sequence<ADDR>::PAGED && Sequence<ADDR>::LEFTPAD) {  // (a tile starts on a page's
                if (RPP * i >= page_left) {                                       // multiple of 16 without)
                    ki += k_jump;
                    vi += v_jump;
                }
            }
            const bool ok = RPP * i < left && ld_col;
            copy_16(d, ok ? ki : k_safe, ok);
            copy_16(d + TILE * (int)sizeof(T), ok ? vi : v_safe, ok);
            kp += k_pass;
            vp += v_pass;
        }
    };
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
        if (i_first + s < my_tiles) load_tile((i_first + s) % STAGES);
        cp_async_commit();
    }

    // ldmatrix lane offsets (elements), as in tiled.cu:
    //  A (Q) and B-trans (V): matrices {rows 0-7,k 0-7},{rows 8-15,k 0-7},{rows 0-7,k 8-15},{rows 8-15,k 8-15}
    //  B (K):                 matrices {keys 0-7,d 0-7},{keys 0-7,d 8-15},{keys 8-15,d 0-7},{keys 8-15,d 8-15}
    //  (in the K/V tiles, the row of every address is lane & 7 modulo 8: its swizzle)
    const int a_off = (((lane >> 3) & 1) * 8 + (lane & 7)) * ROW + (lane >> 4) * 8;
    const unsigned sQ_lane = smem_addr(sQ + rt * 16 * ROW + a_off);
    const int k_row = (lane >> 4) * 8 + (lane & 7), k_ch = (lane >> 3) & 1;  // + 16 np, + 2 kd
    const int v_row = ((lane >> 3) & 1) * 8 + (lane & 7), v_ch = lane >> 4;  // + 16 kk, + 2 dp
    const int swz = lane & 7;
    // byte offsets in a stage of chunk k_ch + 2 * j (v_ch + 2 * j) of the lane's row: chunk
    // c + 8 * m is the one of c, 64 * m elements further (the swizzle only touches bits 0-2)
    unsigned k_off[4], v_off[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        k_off[j] = kv_at<D>(k_row, k_ch + 2 * j, swz) * (int)sizeof(T);
        v_off[j] = (TILE + kv_at<D>(v_row, v_ch + 2 * j, swz)) * (int)sizeof(T);
    }
    cp_async_wait<STAGES - 1>();  // the Q group, for this thread ..
    __syncthreads();              // .. and for all
    unsigned q_frag[Q_REGS ? KD : 1][4];
    if constexpr (Q_REGS) {
#pragma unroll
        for (int kd = 0; kd < KD; ++kd) ldmatrix_x4(q_frag[kd], sQ_lane + kd * 32);
    }

    float o[DT][4], m_run[2], l_run[2];  // rows lane / 4 (+ 8): m in log2 units, o and l relative to 2^m
#pragma unroll
    for (int dt = 0; dt < DT; ++dt)
#pragma unroll
        for (int e = 0; e < 4; ++e) o[dt][e] = 0.f;
    m_run[0] = m_run[1] = NEG_INF;
    l_run[0] = l_run[1] = 0.f;

    for (int i = i_first; i < my_tiles; ++i) {
        cp_async_wait<STAGES - 2>();   // tile i landed, for this lane ..
        stream_sync<ROW_WARPS>(stream);  // .. and the stream; stage (i - 1) % STAGES is free again
        if (i + STAGES - 1 < my_tiles) load_tile((i + STAGES - 1) % STAGES);
        cp_async_commit();
        const unsigned sK_st = smem_addr(sW + (i % STAGES) * 2 * TILE);
        const int key0 = k_begin + (stream + i * NS) * BN;

        // S = Q K^T
        float s[NT][4];
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) s[nt][e] = 0.f;
#pragma unroll
        for (int kd = 0; kd < KD; ++kd) {
            unsigned qa[4];
            if constexpr (Q_REGS) {
#pragma unroll
                for (int e = 0; e < 4; ++e) qa[e] = q_frag[kd][e];
            } else {
                ldmatrix_x4(qa, sQ_lane + kd * 32);
            }
#pragma unroll
            for (int np = 0; np < NT / 2; ++np) {
                unsigned kb[4];
                ldmatrix_x4(kb, sK_st + k_off[kd % 4] + (kd / 4) * 64 * (int)sizeof(T) + np * 16 * D * (int)sizeof(T));
                mma_16816<T>(s[2 * np], qa, kb[0], kb[1]);
                mma_16816<T>(s[2 * np + 1], qa, kb[2], kb[3]);
            }
        }
        // to log2 units first, so that a mask of -inf stays -inf for any scale (0 too)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) s[nt][e] *= scale_log2;
        // then mask keys past a row's causal end or past the range
        if constexpr (!M::ANY) {
            if (key0 + BN > k_free) softmax::frag_mask(s, key0, lane, last);
        } else {  // the modifiers (common.cuh: mods), and their mask where some row may not see a key
            const bool mask = M::MASKS || key0 + BN > k_free;
            if (M::SCORES || mask) softmax::frag_mods<M>(s, key0, lane, mp, sq, mrow, mask);
        }
        // online softmax (softmax.cuh), lazy rescale
        softmax::frag_update<DECODE_RESCALE_THRESHOLD, false>(s, o, m_run, l_run, 0.f, softmax::FastExp2());
        // O += P V: the C fragments of S, paired, are the A fragment of P (P_PAIR: and of
        // its rest, whose products go first)
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk) {
            unsigned pa[4], pr[4];
            acc_a_operand<T>(s, kk, pa);
            if constexpr (P_PAIR) acc_a_rest<T>(s, kk, pa, pr);
#pragma unroll
            for (int dp = 0; dp < DT / 2; ++dp) {
                unsigned vb[4];
                ldmatrix_x4_trans(vb, sK_st + v_off[dp % 4] + (dp / 4) * 64 * (int)sizeof(T) + kk * 16 * D * (int)sizeof(T));
                if constexpr (P_PAIR) {
                    mma_16816<T>(o[2 * dp], pr, vb[0], vb[1]);
                    mma_16816<T>(o[2 * dp + 1], pr, vb[2], vb[3]);
                }
                mma_16816<T>(o[2 * dp], pa, vb[0], vb[1]);
                mma_16816<T>(o[2 * dp + 1], pa, vb[2], vb[3]);
            }
        }
    }

    if constexpr (ROW_WARPS > 1 && NS > 1) {
        // every stream's warps meet as many barriers before the merge's, which is how
        // compute-sanitizer's racecheck pairs barriers up (it reports the merge's
        // writes as racing with the last tiles' reads otherwise)
        int most = 0;
#pragma unroll
        for (int s = 0; s < NS; ++s) most = max(most, count(s) - first(s));
        for (int i = max(my_tiles - i_first, 0); i < most; ++i) stream_sync<ROW_WARPS>(stream);
    }

    // --- merge the warps (write_cta_result), through the freed stages ------------
    cp_async_wait<0>();
    __syncthreads();
    float* m_w = reinterpret_cast<float*>(smem_raw + L::M_W);
    float* l_w = reinterpret_cast<float*>(smem_raw + L::L_W);
    float* o_w = reinterpret_cast<float*>(smem_raw + L::O_W);
    float* row_w = reinterpret_cast<float*>(smem_raw + L::ROW_W);
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
        float l = l_run[hf];
        l += __shfl_xor_sync(0xffffffffu, l, 1);
        l += __shfl_xor_sync(0xffffffffu, l, 2);
        const int i = my_row + 8 * hf;
        if (lane % 4 == 0) {
            m_w[stream * ROWS + i] = m_run[hf];
            l_w[stream * ROWS + i] = l;
        }
#pragma unroll
        for (int dt = 0; dt < DT; ++dt)
            *reinterpret_cast<float2*>(o_w + (stream * ROWS + i) * D + dt * 8 + (lane % 4) * 2) =
                make_float2(o[dt][2 * hf], o[dt][2 * hf + 1]);
    }
    __syncthreads();
    if constexpr (CLUSTER == 1) {
        const WorkspacePart part{part_o, part_lse, ((index_t)b * p.num_kv_heads + kv_head) * call_rows, split,
                                 num_splits, p.head_dim};
        write_cta_result<T, HEAD_DIM, ROWS, NS, THREADS, M>(m_w, l_w, o_w, row_w, out, lse, p, b, kv_head, rb, num_splits,
                                                             len, part, &mp, sqn);
    } else {
        // the split's partial result into this CTA's shared memory, then the
        // cluster's CTAs (the row block's splits) merge them (cluster_merge)
        float* po = reinterpret_cast<float*>(smem_raw + L::PART_O);
        float* pl = reinterpret_cast<float*>(smem_raw + L::PART_LSE);
        write_cta_result<T, HEAD_DIM, ROWS, NS, THREADS, M>(m_w, l_w, o_w, row_w, out, lse, p, b, kv_head, rb, CLUSTER, len,
                                                             SmemPart<HEAD_DIM>{po, pl}, &mp, sqn);
        cluster_merge<T, HEAD_DIM, ROWS, THREADS, CLUSTER>(po, pl, out, lse, p, b, kv_head, rb, len, sqn);
    }
}

template <typename T, int HEAD_DIM, int ROW_WARPS, int STAGES, int SMEM_BYTES>
__global__ void __launch_bounds__(DECODE_MMA_WARPS * 32, 1) decode_mma_attention(
    const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
    T* __restrict__ out, float* __restrict__ lse, const int* __restrict__ seqlens_k, const AttnParams p,
    float* __restrict__ part_o, float* __restrict__ part_lse, const int num_splits)
{
    decode_mma_body<T, HEAD_DIM, ROW_WARPS, STAGES, SMEM_BYTES, NoMods>(q, k, v, out, lse, seqlens_k, p, part_o, part_lse,
                                                            num_splits, ModParams{});
}

// The same with the row block's CLUSTER (2 to 8) splits in one thread-block
// cluster, which merges them itself (decode_detail::cluster_merge; sm_90):
// one launch, no workspace (part_o, part_lse unused; num_splits == CLUSTER).
#if __CUDA_ARCH__ >= 900
template <typename T, int HEAD_DIM, int ROW_WARPS, int STAGES, int CLUSTER, int SMEM_BYTES>
__global__ void __cluster_dims__(CLUSTER, 1, 1) __launch_bounds__(DECODE_MMA_WARPS * 32, 1) decode_mma_attention_cluster(
    const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
    T* __restrict__ out, float* __restrict__ lse, const int* __restrict__ seqlens_k, const AttnParams p,
    float* __restrict__ part_o, float* __restrict__ part_lse, const int num_splits)
{
    static_assert(CLUSTER >= 2 && CLUSTER <= 8, "a portable cluster: 2 to 8 CTAs");
    decode_mma_body<T, HEAD_DIM, ROW_WARPS, STAGES, SMEM_BYTES, NoMods, 0, CLUSTER>(
        q, k, v, out, lse, seqlens_k, p, nullptr, nullptr, CLUSTER, ModParams{});
}
#endif

// The same with the modifiers FLAGS (common.cuh: MOD_*), whose values are in mp.
template <typename T, int HEAD_DIM, int ROW_WARPS, int STAGES, int SMEM_BYTES, int FLAGS>
__global__ void __launch_bounds__(DECODE_MMA_WARPS * 32, 1) decode_mma_attention_mods(
    const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
    T* __restrict__ out, float* __restrict__ lse, const int* __restrict__ seqlens_k, const AttnParams p,
    float* __restrict__ part_o, float* __restrict__ part_lse, const int num_splits, const ModParams mp)
{
    decode_mma_body<T, HEAD_DIM, ROW_WARPS, STAGES, SMEM_BYTES, Mods<FLAGS, sizeof(T) == 2>>(q, k, v, out, lse, seqlens_k, p, part_o, part_lse,
                                                                 num_splits, mp);
}

// Merge the num_splits partial results of each packed row (see the top); M:
// the modifiers, of which only the sinks act here.
// ADDR: the per-sequence addressing (common.cuh: Sequence; 0: contiguous) of sp.
template <typename T, class M, int ADDR = 0>
__device__ __forceinline__ void decode_combine_body(
    T* __restrict__ out, float* __restrict__ lse, const int* __restrict__ seqlens_k, const AttnParams& p,
    const float* __restrict__ part_o, const float* __restrict__ part_lse, const int num_splits, const ModParams* mp,
    const SeqParams* sp = nullptr)
{
    using namespace decode_detail;
    wait_for_prior_kernel();  // (launched as the decode kernel's dependent) its partials are written
    const int group_size = p.group_size, rows_total = p.seqlen_q * group_size;
    const int quads = p.head_dim / 4;
    // J adjacent lanes share an output quad, lane j taking splits j, j + J, .. (at most 4,
    // their loads in flight at once), then merge through shuffles: the same two round
    // trips to L2 (lse, then the partials) for any number of splits
    const int J = combine_lanes(num_splits);
    const int lane = threadIdx.x % 32, j = lane % J;
    const unsigned group = J == 32 ? 0xffffffffu : ((1u << J) - 1u) << (lane - j);
    const index_t total = (index_t)p.batch * p.num_kv_heads * rows_total * quads * J;
    for (index_t x = (index_t)blockIdx.x * blockDim.x + threadIdx.x; x < total; x += (index_t)gridDim.x * blockDim.x) {
        const index_t prow = x / J / quads;
        const int d = (int)(x / J % quads) * 4;
        const int r = (int)(prow % rows_total);
        const index_t bh = prow / rows_total;
        const int kv_head = (int)(bh % p.num_kv_heads), b = (int)(bh / p.num_kv_heads);
        const int t = r / group_size, q_head = q_head_of(kv_head, r % group_size, group_size);
        Sequence<ADDR> sqn;  // the row's sequence: its rows and length
        if constexpr (ADDR == 0) {
            sqn.b = b;
        } else {
            sqn = sequence_of<ADDR>(p, seqlens_k, sp, b);
            if (t >= sqn.seqlen_q(p.seqlen_q)) continue;  // past the sequence's queries (the group's lanes alike)
        }
        const bool bad = (ADDR == 0 ? seqlen_k_of(seqlens_k, b, p.seqlen_k) : sqn.len) < 0;
        T* o_row = out + b * p.o_stride[0] + (sqn.q0() + t) * p.o_stride[1] + q_head * p.o_stride[2] + d;
        float* lse_row = lse != nullptr && d == 0 ? lse + sqn.lse_at(q_head, t, p.num_q_heads, p.seqlen_q) : nullptr;

        const float* lse_s = part_lse + prow * num_splits;
        float mm, ls, acc[4];
        merge_parts<4>(
            j, num_splits, J, [&](int s) { return lse_s[s]; },
            [&](int s, float (&ov)[4]) {
                const float4 x = *reinterpret_cast<const float4*>(part_o + (prow * num_splits + s) * p.head_dim + d);
                ov[0] = x.x, ov[1] = x.y, ov[2] = x.z, ov[3] = x.w;
            },
            mm, ls, acc);
#pragma unroll
        for (int off = 1; off < 32; off *= 2)  // the group's states, pairwise (J <= 32)
            if (off < J) softmax::shfl_merge(group, off, mm, ls, acc);
        if (j != 0) continue;
        if constexpr (M::SINKS) {  // the sink joins the denominator once (softmax.cuh: fold_sink)
            const float alpha = softmax::fold_sink(mm, ls, mods::sink2<M, float>(*mp, q_head));
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[e] *= alpha;
        }
        const bool seen = ls != 0.f;
        const float inv = softmax::out_scale(ls, seen, bad);  // NaN when bad
#pragma unroll
        for (int e = 0; e < 4; ++e) o_row[e] = from_acc<T>(acc[e] * inv);
        if (lse_row != nullptr) *lse_row = softmax::lse(mm, ls, seen, bad);
    }
}

template <typename T>
__global__ void __launch_bounds__(128) decode_combine(
    T* __restrict__ out, float* __restrict__ lse, const int* __restrict__ seqlens_k, const AttnParams p,
    const float* __restrict__ part_o, const float* __restrict__ part_lse, const int num_splits)
{
    decode_combine_body<T, NoMods>(out, lse, seqlens_k, p, part_o, part_lse, num_splits, nullptr);
}

// The same with the sinks (FLAGS: MOD_SINKS), whose values are in mp.
template <typename T, int FLAGS>
__global__ void __launch_bounds__(128) decode_combine_mods(
    T* __restrict__ out, float* __restrict__ lse, const int* __restrict__ seqlens_k, const AttnParams p,
    const float* __restrict__ part_o, const float* __restrict__ part_lse, const int num_splits, const ModParams mp)
{
    decode_combine_body<T, Mods<FLAGS, sizeof(T) == 2>>(out, lse, seqlens_k, p, part_o, part_lse, num_splits, &mp);
}

// The same with per-sequence addressing ADDR (common.cuh: SEQ_*: varlen, paged
// K/V, left padding), described by sp.
template <typename T, int HEAD_DIM, int ROWS, int ADDR>
__global__ void __launch_bounds__(DECODE_THREADS, ROWS <= 4 ? DECODE_MIN_BLOCKS : 1) decode_attention_seq(
    const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
    T* __restrict__ out, float* __restrict__ lse, const int* __restrict__ seqlens_k, const AttnParams p,
    float* __restrict__ part_o, float* __restrict__ part_lse, const int num_splits, const SeqParams sp)
{
    decode_body<T, HEAD_DIM, ROWS, NoMods, ADDR>(q, k, v, out, lse, seqlens_k, p, part_o, part_lse, num_splits,
                                                 ModParams{}, &sp);
}

template <typename T, int HEAD_DIM, int ROW_WARPS, int STAGES, int SMEM_BYTES, int ADDR>
__global__ void __launch_bounds__(DECODE_MMA_WARPS * 32, 1) decode_mma_attention_seq(
    const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
    T* __restrict__ out, float* __restrict__ lse, const int* __restrict__ seqlens_k, const AttnParams p,
    float* __restrict__ part_o, float* __restrict__ part_lse, const int num_splits, const SeqParams sp)
{
    decode_mma_body<T, HEAD_DIM, ROW_WARPS, STAGES, SMEM_BYTES, NoMods, ADDR>(q, k, v, out, lse, seqlens_k, p, part_o,
                                                                              part_lse, num_splits, ModParams{}, &sp);
}

template <typename T, int ADDR>
__global__ void __launch_bounds__(128) decode_combine_seq(
    T* __restrict__ out, float* __restrict__ lse, const int* __restrict__ seqlens_k, const AttnParams p,
    const float* __restrict__ part_o, const float* __restrict__ part_lse, const int num_splits, const SeqParams sp)
{
    decode_combine_body<T, NoMods, ADDR>(out, lse, seqlens_k, p, part_o, part_lse, num_splits, nullptr, &sp);
}

// The same with per-sequence addressing ADDR and the modifiers FLAGS: ModParams, then SeqParams.
template <typename T, int HEAD_DIM, int ROWS, int ADDR, int FLAGS>
__global__ void __launch_bounds__(DECODE_THREADS, ROWS <= 4 ? DECODE_MIN_BLOCKS : 1) decode_attention_seq_mods(
    const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
    T* __restrict__ out, float* __restrict__ lse, const int* __restrict__ seqlens_k, const AttnParams p,
    float* __restrict__ part_o, float* __restrict__ part_lse, const int num_splits, const ModParams mp,
    const SeqParams sp)
{
    decode_body<T, HEAD_DIM, ROWS, Mods<FLAGS, sizeof(T) == 2>, ADDR>(q, k, v, out, lse, seqlens_k, p, part_o, part_lse,
                                                                      num_splits, mp, &sp);
}

template <typename T, int HEAD_DIM, int ROW_WARPS, int STAGES, int SMEM_BYTES, int ADDR, int FLAGS>
__global__ void __launch_bounds__(DECODE_MMA_WARPS * 32, 1) decode_mma_attention_seq_mods(
    const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
    T* __restrict__ out, float* __restrict__ lse, const int* __restrict__ seqlens_k, const AttnParams p,
    float* __restrict__ part_o, float* __restrict__ part_lse, const int num_splits, const ModParams mp,
    const SeqParams sp)
{
    decode_mma_body<T, HEAD_DIM, ROW_WARPS, STAGES, SMEM_BYTES, Mods<FLAGS, sizeof(T) == 2>, ADDR>(
        q, k, v, out, lse, seqlens_k, p, part_o, part_lse, num_splits, mp, &sp);
}

template <typename T, int ADDR, int FLAGS>
__global__ void __launch_bounds__(128) decode_combine_seq_mods(
    T* __restrict__ out, float* __restrict__ lse, const int* __restrict__ seqlens_k, const AttnParams p,
    const float* __restrict__ part_o, const float* __restrict__ part_lse, const int num_splits, const ModParams mp,
    const SeqParams sp)
{
    decode_combine_body<T, Mods<FLAGS, sizeof(T) == 2>, ADDR>(out, lse, seqlens_k, p, part_o, part_lse, num_splits, &mp,
                                                              &sp);
}
