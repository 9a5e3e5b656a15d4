/*
 * hopper.cu -- prefill on Hopper's warpgroup tensor cores (wgmma, sm_90a),
 * fp16 and bf16, causal or not, compiled at runtime by NVRTC.
 *
 * Algorithm
 * -----------------------------------------------------------------------------
 * FlashAttention's tiled online softmax (as in tiled.cu, rules in softmax.cuh)
 * with the matrix products on wgmma.mma_async and the loads in a warpgroup of
 * their own. Per consumer warpgroup (64 packed query rows):
 *
 *   tile 0:  S = Q K_0^T;  P_0 = softmax part of S (below)
 *   tile j:  issue S_j = Q K_j^T            (A = Q, B = K_j: shared memory)
 *            issue O += P_{j-1} V_{j-1}     (A = P_{j-1} in registers, B = V)
 *            wait for S_j; release K_j
 *            mask S_j (tiles crossing the diagonal or the end of the keys);
 *            m' = max(m, rowmax S_j * scale log2 e)   (exact: P <= 1, so the
 *                 largest P of a row is 1 in 16 bits; warp-uniform skip when no row grows)
 *            P_j = exp2(S_j * scale log2 e - m'), its row sums
 *            -- all of this while P_{j-1} V_{j-1} runs on the tensor cores --
 *            wait for P V; release V_{j-1}; O *= exp2(m - m'), l likewise
 *   last:    O += P V of the last tile
 *   out = O / l;  lse = (m + log2 l) ln 2   (a row that sees no key: out 0,
 *                                            lse -inf; a bad length: NaN)
 *
 * GQA packing (as in tiled.cu): the group = num_q_heads / num_kv_heads query
 * heads of one KV head form one row space, packed row r = t * group + g
 * (query position t, query head kv_head * group + g), so each K/V tile in
 * shared memory serves all heads of the group.
 *
 * Tiles and CTAs.  num_m_tiles * batch * num_kv_heads tiles, in the order of
 * prefill_tile (common.cuh: causal tiles heaviest first; with per-sequence
 * addressing, below, num_m_tiles is that of max_seqlen_q). Eager launches are
 * persistent: at most one CTA per SM, each CTA taking its next tile from a
 * counter in device memory (tile_counter, the launch's own: cupy_gqa/_plan.py)
 * when it is done with its last, so the CTAs share the tiles out as the
 * hardware's scheduler would, and a CTA loads its next tile's K_0 and Q rows
 * while it finishes the last one. A launch being captured into a CUDA graph
 * passes no counter: one CTA per tile (the grid is num_tiles).
 *
 * Roles. A CTA has NWG = BLOCK_M / 64 consumer warpgroups (two, BLOCK_M = 128;
 * three, BLOCK_M = 192, at head dim 64, as FlashAttention-3 does: a third warp
 * on each scheduler for the softmax, whose exponentials bound that head dim; and
 * at head dim 128 on 80-key tiles, whose S and P fit a third warpgroup's
 * registers beside O, for groups that pack 192 rows into few positions:
 * cupy_gqa/_specs.py, HOPPER_WG3_TILES) and one producer warpgroup (the last),
 * 128 threads each:
 *   producer   (setmaxnreg down to producer_regs): the tiles' order (above);
 *              per tile K_0, then each consumer warpgroup's 64 rows of Q once
 *              that warpgroup is done with its last tile, by bulk tensor
 *              copies where the host allows (qo_bulk, below), else by the
 *              warpgroup's cp.async, each with the tile's index for the
 *              consumers (next_tile) on the warpgroup's q_full mbarrier;
 *              then K_j and V_j into rings of STAGES stages each, by bulk
 *              tensor copies (TMA: one thread, tensor maps from the host) that
 *              complete on the stage's "full" mbarrier; it waits only for the
 *              stage's "empty" mbarrier. The tile that holds the end of a
 *              sequence that ends before the array's rows do (seqlens_k;
 *              varlen: any but the sequence that ends the packed keys; left
 *              padding) goes by cp.async, which zero-fills the keys past the
 *              end: keys of another sequence or stale cache rows never meet
 *              a zero weight in P V (0 * NaN = NaN);
 *   consumer w (setmaxnreg up to consumer_regs): packed rows [64 w, 64 w + 64)
 *              of the tile, both matrix products and the softmax for them;
 *              then its rows of out (the epilogue, below).
 *
 * Epilogue.  Above head dim 64 a warpgroup writes its rows of out through its
 * rows of the Q tile (by one bulk copy per slab where qo_bulk, else by
 * 16-byte stores), then frees them for its next tile (q_empty). At head dim
 * 64 it frees its Q rows once its last Q K^T is done, so that the next tile's
 * Q lands during the last softmax and P V, and writes out straight from the
 * accumulator registers (4-byte stores, four lanes making 16 contiguous bytes
 * of a row); o_map is unused there. Measured on the H200 (benchmarks/
 * NOTES_hopper.md, step 9): the direct way cuts a tile's fixed cost at head
 * dim 64 (4.56 to 3.84 us) and raises it at 128 (4.98 to 5.41), where a lane
 * has 32 such stores.
 *
 * Q and out by bulk copies (qo_bulk, cupy_gqa/_plan.py: hopper_bulk_qo).  The
 * packed rows of a consumer warpgroup are a box of the (head_dim, heads,
 * seqlen_q, batch) view of q or out: group heads by whole positions, 64 /
 * group of them when group divides 64. For a group that does not, the box is
 * the floor(64 / group) positions that fit, wg_rows = 64 - 64 % group rows
 * (60 for groups 5, 6, 10, 12; 63 for 3, 7, 9, 21), and a tile is NWG such
 * blocks: the block's last 64 - wg_rows rows are idle (zero Q, never stored).
 * The host takes these copies where wg_rows is at least 56, below head dim
 * 256 (whose producer has no register to spare for them). The copy engine
 * fills the rows and columns past the array's ends with zeros on loads and
 * drops them on stores, so the short last tile and padded head dims need no
 * code. Paged and left-padded calls have q and out of the contiguous shape
 * and take the same copies. With other groups, and for varlen calls (a
 * sequence's rows end inside the packed array), Q and out go by the threads'
 * copies (wg_rows 64).
 *
 * Modifiers (hopper_attention_mods; common.cuh: modifiers).  The window's
 * left side moves the first key tile up (KeyRange.start); the scores are
 * changed and masked on each tile by the same rules as tiled.cu
 * (softmax.cuh: frag_mods), and a sink joins the denominator in the epilogue.
 *
 * Per-sequence addressing (hopper_attention_seq<..., ADDR>; common.cuh:
 * Sequence, SEQ_*): varlen (SEQ_VARLEN), paged K/V (SEQ_PAGED) and left padding
 * (SEQ_LEFTPAD). The CTA's
 * sequence (prefill_tile_seq) gives its queries' rows (Q loads, out and lse
 * stores), its key count and its first key k0: a CTA past its sequence's
 * packed rows returns before any copy. The tensor maps are those of k and v as the
 * call passes them -- (1, total_k, heads, head_dim) for varlen -- so key tile
 * j of the sequence is the box at row k0 + j * BLOCK_N (batch coordinate 0
 * for varlen, b for left padding); the cp.async path reads from the same
 * first key. Paged K/V (pages of any multiple of 16 keys): the tensor maps
 * see the pools as (num_pages, page_size, heads, head_dim) arrays, and a key
 * tile inside its sequence is boxes of kv_box = gcd(page_size, BLOCK_N) rows,
 * each at its page (from the block table) and its row in it: a box never
 * crosses a page, since tiles and pages both start at multiples of kv_box. The
 * tile that holds the sequence's end goes by the warpgroup's cp.async, each
 * row through the block table (a page's slots past the end are stale). With
 * left padding as well, tiles start at any key of a page, so every tile goes
 * by cp.async (KV_BY_THREADS): each producer thread's copies are one counted
 * arrival on the stage's full mbarrier as they land, so the producer never
 * waits for its own copies, and the consumers fence the async proxy after
 * their wait. The contiguous kernels are this body with ADDR 0, unchanged.
 *
 * Head dims.  Any head_dim that is a multiple of 8 up to HEAD_DIM_PAD runs;
 * the columns past head_dim are zero in shared memory (Q and K: they add
 * nothing to S; V: the extra output columns are never stored).
 *
 * Shared memory (dynamic, aligned to 1024 bytes; HopperSmem below).  Every
 * tile is stored as HEAD_DIM_PAD / 64 "slabs" of 64 columns; in a slab, row r
 * is 128 bytes and its 16-byte chunk c sits at r * 128 + ((c ^ (r % 8)) * 16)
 * -- the 128-byte swizzle that wgmma reads without bank conflicts
 * (descriptor layout type 1):
 *   [ Q tiles 0 .. Q_SLOTS-1: BLOCK_M rows each | K stages 0 .. STAGES-1 | V stages 0 .. STAGES-1 |
 *     mbarriers | next_tile ]
 * Q_SLOTS (HopperSmem) is 2 where two Q tiles fit beside the K/V stages
 * (head dim 128, two stages) but not at head dim 64 (its epilogue frees Q
 * early): a warpgroup's t-th tile uses Q tile t % Q_SLOTS, so the producer
 * loads its next tile's rows while it still works on (and stages out through)
 * the last one's.
 * K is read K-major (contiguous along head_dim, the reduction of Q K^T); V is
 * read by the same layout as the N-major B operand of P V (trans-b). The
 * output tile is staged through the Q tile's space, in the same layout.
 *
 * Requirements (checked by cupy_gqa/_plan.py): sm_90, head_dim % 8 == 0,
 * head_dim stride 1, 16-byte aligned pointers and strides (K and V: positive,
 * below 2^40 bytes, as the copy engine takes them), scale_log2 > 0.
 * benchmarks/NOTES_hopper.md has each step's prediction and outcome.
 */
#include "common.cuh"
#include "softmax.cuh"
#include "wgmma.cuh"
#include "sm90.cuh"

namespace hopper_detail {

enum { RESCALE_THRESHOLD = 0 };  // log2 units: exact maxima, P <= 1 (softmax.cuh: LAZY)

using namespace sm90;  // swizzle, descriptors, wgmma fences (kernels/sm90.cuh)

// Named barriers (id 0 is __syncthreads), for NWG consumer warpgroups: the 128
// threads of one consumer warpgroup (ids EPILOGUE_BAR + w), the turn-taking of
// the consumer warpgroups (ids turn_bar + w) and the producer warpgroup (the id
// after those).
__device__ __forceinline__ void warpgroup_sync(int id) { asm volatile("bar.sync %0, 128;\n" ::"r"(id) : "memory"); }
__device__ __forceinline__ void pair_sync(int id) { asm volatile("bar.sync %0, 256;\n" ::"r"(id) : "memory"); }
__device__ __forceinline__ void pair_arrive(int id) { asm volatile("bar.arrive %0, 256;\n" ::"r"(id) : "memory"); }
template <int NWG> __device__ __forceinline__ void producer_sync() {
    asm volatile("bar.sync %0, 128;\n" ::"n"(1 + 2 * NWG) : "memory");
}
enum { EPILOGUE_BAR = 1 };
template <int NWG> __host__ __device__ constexpr int turn_bar() { return EPILOGUE_BAR + NWG; }

// Registers per thread of each role: what the producer frees, the consumers take
// (2 consumer warpgroups: 56 + 2 x 224 = 3 x 168; 3 at head dim 64: 32 + 3 x 160 =
// 4 x 128; 3 at head dim 128, whose 80-key tiles fit the consumers in 152 and whose
// producer spilled 4 bytes at 32 with a causal window: 40 + 3 x 152 = 496 of 4 x 128).
template <int NWG, int HEAD_DIM_PAD> __host__ __device__ constexpr int producer_regs() {
    return NWG == 2 ? 56 : HEAD_DIM_PAD == 64 ? 32 : 40;
}
template <int NWG, int HEAD_DIM_PAD> __host__ __device__ constexpr int consumer_regs() {
    return NWG == 2 ? 224 : HEAD_DIM_PAD == 64 ? 160 : 152;
}

// The packed rows of a consumer warpgroup's block of a tile: 64, or, where Q and
// out go by bulk copies for a group that does not divide 64, the whole positions
// that fit in 64 rows (the copy engine's box is group heads by whole positions):
// 64 - 64 % group (cupy_gqa/_plan.py: hopper_wg_rows, which takes those copies
// only where that is at least HOPPER_MIN_WG_ROWS, and below head dim 256, whose
// producer has no register to spare for it). The block's rows past it are zero in
// shared memory and never stored.
template <int HEAD_DIM_PAD> __device__ __forceinline__ int wg_rows_of(int group, bool bulk_qo) {
    return HEAD_DIM_PAD < 256 && bulk_qo ? 64 - 64 % group : 64;
}

}  // namespace hopper_detail


// Shared-memory layout, one definition for the kernel and for cupy_gqa/_specs.py
// (hopper_smem), which passes its byte count as SMEM_BYTES: a static_assert
// in the kernel holds the two together.
template <int HEAD_DIM_PAD, int BLOCK_M, int BLOCK_N, int STAGES>
struct HopperSmem {
    static constexpr int SLABS = HEAD_DIM_PAD / 64;
    static constexpr int Q_SLAB = BLOCK_M * 128;   // bytes of one 64-column slab of the Q tile
    static constexpr int KV_SLAB = BLOCK_N * 128;  // ... of a K or V tile
    static constexpr int Q_BYTES = SLABS * Q_SLAB;
    static constexpr int KV_BYTES = SLABS * KV_SLAB;
    enum : int { NWG = BLOCK_M / 64 };             // consumer warpgroups
    // The layout's bytes with qs Q tiles: tiles from a 1024-aligned base (qs Q
    // tiles, STAGES K tiles, STAGES V tiles), then the mbarriers (full and empty
    // of each warpgroup's Q rows in each Q tile, of each K and of each V stage),
    // then the next tile of each consumer warpgroup in each Q tile and the
    // producer's (16 bytes a Q tile: NWG <= 3); + 1024 slack for the alignment
    __host__ __device__ static constexpr int bytes(int qs) {
        return qs * Q_BYTES + 2 * STAGES * KV_BYTES + 8 * (2 * NWG * qs + 4 * STAGES) + 16 * qs + 1024;
    }
    // Q tiles: two where they fit in an SM's 227 KB (a warpgroup's next Q rows
    // then load while it still works on its last tile), except at head dim 64,
    // whose epilogue frees Q early anyway (cupy_gqa/_specs.py: hopper_q_slots,
    // the same rule)
    // (an enumerator: NVRTC emits this static member as an unused global otherwise)
    enum : int { Q_SLOTS = HEAD_DIM_PAD != 64 && bytes(2) <= 232448 ? 2 : 1 };
    static constexpr int BARRIERS = 2 * NWG * Q_SLOTS + 4 * STAGES;
    static constexpr int BYTES = bytes(Q_SLOTS);
};

// The kernel's body, for the kernel without modifiers (M = NoMods, MP =
// NoModParams), the one with them (hopper_attention_mods; common.cuh: modifiers)
// and the one with per-sequence addressing ADDR (hopper_attention_seq; common.cuh:
// Sequence; 0: contiguous), described by sp.
template <typename T, int HEAD_DIM_PAD, int BLOCK_M, int BLOCK_N, int STAGES, bool CAUSAL, int SMEM_BYTES, class M,
          class MP, int ADDR = 0>
__device__ __forceinline__ void hopper_body(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                                            T* __restrict__ out, float* __restrict__ lse,
                                            const int* __restrict__ seqlens_k, const AttnParams& p, const MP& mp,
                                            const sm90::TensorMap& k_map,
                                            const sm90::TensorMap& v_map,
                                            const sm90::TensorMap& q_map,
                                            const sm90::TensorMap& o_map, const int qo_bulk,
                                            int* __restrict__ tile_counter, const SeqParams* sp = nullptr) {
    using namespace hopper_detail;
    static_assert(HEAD_DIM_PAD % 64 == 0 && HEAD_DIM_PAD <= 256, "head dims are padded to 64, 128, 192 or 256");
    // The epilogue (see the top): at head dim 64 out goes from the registers and the
    // Q rows are freed after the last Q K^T; above, out is staged through them.
    constexpr bool DIRECT_OUT = HEAD_DIM_PAD == 64;
    static_assert((BLOCK_M == 128 || (BLOCK_M == 192 && HEAD_DIM_PAD <= 128)) && BLOCK_N % 16 == 0,
                  "two consumer warpgroups of 64 rows (three up to head dim 128); 16 keys per step");
    constexpr int NWG = BLOCK_M / 64;          // consumer warpgroups
    constexpr int TURN_BAR = turn_bar<NWG>();
    using L = HopperSmem<HEAD_DIM_PAD, BLOCK_M, BLOCK_N, STAGES>;
    static_assert(SMEM_BYTES == L::BYTES, "SMEM_BYTES is not the size of the shared-memory layout (HopperSmem)");
    static_assert(STAGES >= 2, "the consumers hold V_{j-1} (P V) while V_j arrives");
    constexpr int CHP = HEAD_DIM_PAD / 8;      // 16-byte chunks per padded row
    constexpr int KD = HEAD_DIM_PAD / 16;      // k-steps of Q K^T
    constexpr int NT = BLOCK_N / 8;            // n8 tiles of S (keys)
    constexpr int DT = HEAD_DIM_PAD / 8;       // n8 tiles of O (head dims)
    constexpr int CONSUMERS = BLOCK_M / 64 * 128;
    // Paged K/V with left padding: every K/V tile by the producer warpgroup's cp.async,
    // each thread's copies one counted arrival on the stage's full mbarrier as they land
    // (the copy engine's boxes could cross a page there: see the top)
    constexpr bool KV_BY_THREADS = Sequence<ADDR>::PAGED && Sequence<ADDR>::LEFTPAD;

    const int seqlen_q = p.seqlen_q, num_q_heads = p.num_q_heads;

    extern __shared__ unsigned char smem_raw[];
    const unsigned raw = smem_addr(smem_raw);
    const unsigned base = (raw + 1023u) & ~1023u;  // swizzle atoms need 1024-byte alignment
    unsigned char* const smem = smem_raw + (base - raw);
    const unsigned sQ = base;
    constexpr int QS = L::Q_SLOTS;             // Q tile of a warpgroup's t-th tile: t % QS
    const unsigned sK = sQ + QS * L::Q_BYTES;  // K stage s at sK + s * KV_BYTES
    const unsigned sV = sK + STAGES * L::KV_BYTES;
    const unsigned bars = sV + STAGES * L::KV_BYTES;
    // Each consumer warpgroup h has Q rows of its own (rows [64 h, 64 h + 64) of
    // the Q tile), loaded for its next tile once it is done with the last one,
    // so warpgroup 0 starts a tile while warpgroup 1 still finishes the one before.
    // (in Q tile qs: with two, the next tile's rows land while the last's are in use)
    auto q_full = [&](int h, int qs) { return bars + 8 * (NWG * qs + h); };            // its Q rows have landed
    auto q_empty = [&](int h, int qs) { return bars + 8 * (NWG * QS + NWG * qs + h); };  // ... and are free again
    // K and V run in pipelines of their own: K_j is free again once Q K_j^T is
    // done, V_j only once P_j V_j is, a tile later (see the consumer loop). The
    // rings run on across a persistent CTA's tiles (ring position r: stage
    // r % STAGES, its (r / STAGES)-th use).
    auto k_full = [&](int s) { return bars + 8 * (2 * NWG * QS + s); };               // K stage s has landed
    auto k_empty = [&](int s) { return bars + 8 * (2 * NWG * QS + STAGES + s); };     // ... and has been read
    auto v_full = [&](int s) { return bars + 8 * (2 * NWG * QS + 2 * STAGES + s); }; // V stage s has landed
    auto v_empty = [&](int s) { return bars + 8 * (2 * NWG * QS + 3 * STAGES + s); }; // ... and has been read
    // next_tile[NWG qs + h]: the tile consumer warpgroup h takes when q_full(h, qs)
    // completes (-1: none, the CTA is done); next_tile[NWG QS]: the producer's own copy
    volatile int* const next_tile = reinterpret_cast<volatile int*>(smem + (bars - base) + 8 * L::BARRIERS);

    // Q in and out by bulk tensor copies (the host's choice, qo_bulk): the boxes
    // of q_map and o_map are (64 columns, group heads, wg_rows / group positions),
    // a warpgroup's packed rows in order (see the top). Else (and for varlen calls)
    // by the threads' 16-byte copies.
    const bool bulk_qo = !Sequence<ADDR>::VARLEN && qo_bulk != 0;
    const int tid = threadIdx.x;
    const int group = p.num_q_heads / p.num_kv_heads;
    const int wg_rows = wg_rows_of<HEAD_DIM_PAD>(group, bulk_qo);  // a warpgroup's packed rows (above)
    const int tile_rows = NWG * wg_rows;             // a tile's: rows [h wg_rows, h wg_rows + wg_rows) are warpgroup h's
    TileRows tr = {tile_rows, (seqlen_q * group + tile_rows - 1) / tile_rows};  // common.cuh
    asm volatile("" : "+r"(tr.m_tiles));  // (computed once: ptxas would redo the division in each role)
    if (wg_rows < 64) {
        // the rows of each warpgroup's block that no copy writes: zero, once (the
        // async proxy, wgmma, reads them; each thread's fence, then the barrier)
        const int idle = 64 - wg_rows, chunks = QS * NWG * L::SLABS * idle * 8;
        for (int c = tid; c < chunks; c += blockDim.x) {
            const int ch = c % 8, r = wg_rows + c / 8 % idle, rest = c / 8 / idle;
            const int h = rest % NWG, sl = rest / NWG % L::SLABS, qs = rest / NWG / L::SLABS;
            *reinterpret_cast<uint4*>(smem + qs * L::Q_BYTES + sl * L::Q_SLAB + (h * 64 + r) * 128 + ch * 16) =
                make_uint4(0u, 0u, 0u, 0u);
        }
        fence_proxy_async();
    }
    if (tid == 0) {
        for (int qs = 0; qs < QS; ++qs)
            for (int h = 0; h < NWG; ++h) {
                mbar_init(q_full(h, qs), 1);       // one producer thread arrives (with the copies' bytes, if bulk)
                mbar_init(q_empty(h, qs), 128);    // every thread of warpgroup h
            }
        for (int s = 0; s < STAGES; ++s) {
            // one producer thread arrives (and the copies' bytes land); KV_BY_THREADS: each producer thread
            mbar_init(k_full(s), KV_BY_THREADS ? 128 : 1);
            mbar_init(v_full(s), KV_BY_THREADS ? 128 : 1);
            mbar_init(k_empty(s), CONSUMERS);  // every consumer thread arrives
            mbar_init(v_empty(s), CONSUMERS);
        }
    }
    __syncthreads();

    int left = -1, right = -1;  // the window modifier's sides (common.cuh: KeyRange)
    if constexpr (M::WINDOW) left = mp.window_left, right = mp.window_right;

    if (tid >= CONSUMERS) {
        // =========================== producer warpgroup ===========================
        // Tiles: the CTA's first is blockIdx.x. A persistent CTA (tile_counter,
        // from the host; the grid is then at most one CTA per SM) takes
        // gridDim.x + v next, v from an atomic add on the counter issued at the
        // start of the tile before (its latency hidden behind the tile's copies),
        // until that passes the last tile: the CTAs share the tiles out in
        // launch order as they get free, as the hardware's CTA scheduler would.
        // The counter's values run 0 .. num_tiles - 1 over the launch (one per
        // tile; a CTA's last fetch is past the end); the fetch of the last value
        // puts it back to 0 for the launch that takes this counter next.
        // A tile: K_0 first (it needs only a free stage), then each warpgroup's Q
        // rows once that warpgroup is done with its last tile, then V_0, K_1,
        // V_1, ...; each copy waits only for its stage to be free.
        regs_dec<producer_regs<NWG, HEAD_DIM_PAD>()>();
        const int pt = tid - CONSUMERS;
        const int ch_used = p.head_dim / 8;    // chunks that hold data; the rest are zero
        // paged K/V: the rows of a K/V box, the largest multiple of 16 that divides the page
        // size and BLOCK_N (their gcd: cupy_gqa/_plan.py encodes the tensor maps with it)
        int kv_box = BLOCK_N;
        if constexpr (Sequence<ADDR>::PAGED)
            while (sp->page_size % kv_box != 0 || BLOCK_N % kv_box != 0) kv_box -= 16;
        const int kv_boxes = BLOCK_N / kv_box;  // boxes a slab of a key tile
        const int num_tiles = tr.m_tiles * p.batch * p.num_kv_heads;
        int tile = blockIdx.x, ring = 0, published = 0;
        while (tile >= 0) {
            int fetched = 0;
            if (tile_counter != nullptr && pt == 0) fetched = atomicAdd(tile_counter, 1);
            Sequence<ADDR> sqn;  // the tile's sequence: where its queries and keys are
            const PrefillTile<CAUSAL, M::WINDOW> tl =
                prefill_tile_seq_at<CAUSAL, M::WINDOW, ADDR>(p, seqlens_k, sp, group, left, right, sqn, tile, tr);
            // with per-sequence addressing, a tile past its sequence's rows has nothing to do
            if (ADDR == 0 || tl.row0 < tl.packed_rows) {
                const int b = tl.b, kvh = tl.kv_head, row0 = tl.row0, packed_rows = tl.packed_rows;
                const int seqlen_k = tl.seqlen_k;
                // key tiles j0 + i, i in [0, num_n)
                const int j0 = tl.keys.start / BLOCK_N;
                const int num_n = (tl.keys.end + BLOCK_N - 1) / BLOCK_N - j0;  // end >= start: never negative

                // 16-byte cp.async chunks into the swizzled slabs: chunk c of a tile of R
                // rows is row c / CHP, column chunk c % CHP; rows past the data and the
                // padding columns are zero-filled.
                const T* const kbase = k + (index_t)sqn.k_batch() * p.k_stride[0] + (index_t)sqn.k0() * p.k_stride[1] +
                                       (index_t)kvh * p.k_stride[2];
                const T* const vbase = v + (index_t)sqn.k_batch() * p.v_stride[0] + (index_t)sqn.k0() * p.v_stride[1] +
                                       (index_t)kvh * p.v_stride[2];
                const index_t k_stride_s = p.k_stride[1], v_stride_s = p.v_stride[1];
                // one tile of K or V: chunk c is row c / CHP (key j * BLOCK_N + row), column chunk c % CHP
                // (s0: the stride of axis 0, a page's with paged K/V, whose key rows go
                // through the block table: common.cuh, Sequence::kv_row)
                auto load_tile = [&](unsigned dst, const T* base_ptr, index_t s0, index_t stride_s, const T* dummy, int j) {
                    if constexpr (Sequence<ADDR>::PAGED && 128 % CHP == 0) {
                        // each thread keeps one column chunk and walks rows RS apart, as below;
                        // RS < 16 <= page_size, so a step crosses at most one page boundary, and
                        // the block table is read once a page (keys past the end read nothing)
                        constexpr int RS = 128 / CHP;
                        const int ch = pt % CHP, r0 = pt / CHP;
                        const bool col_ok = ch < ch_used;
                        const unsigned d0 = dst + (ch / 8) * L::KV_SLAB;
                        const int key0 = j * BLOCK_N + r0;
                        int slot, row;
                        sqn.page_of(key0, slot, row);
                        int page = key0 < seqlen_k ? sqn.pages[slot] : 0;
                        const T* const col = base_ptr + ch * 8;
                        auto row_step = [&](int i) {
                            const int key = key0 + i * RS;
                            const bool ok = col_ok && key < seqlen_k;
                            cp_async_16(d0 + swizzle128(r0 + i * RS, ch % 8),
                                        ok ? (const void*)(col + (index_t)page * s0 + (index_t)row * stride_s)
                                           : (const void*)dummy,
                                        ok);
                            row += RS;
                            if (row >= sqn.page_size) {
                                row -= sqn.page_size;
                                ++slot;
                                if (key + RS < seqlen_k) page = sqn.pages[slot];
                            }
                        };
                        if constexpr (NWG > 2) {
                            // not unrolled: the producer of three consumer warpgroups has 32 or 40 registers
#pragma unroll 1
                            for (int i = 0; i < BLOCK_N / RS; ++i) row_step(i);
                        } else {
#pragma unroll
                            for (int i = 0; i < BLOCK_N / RS; ++i) row_step(i);
                        }
                    } else if constexpr (Sequence<ADDR>::PAGED) {
                        auto row_chunk = [&](int c) {
                            const int r = c / CHP, ch = c % CHP;
                            const int key = j * BLOCK_N + r;
                            const bool ok = key < seqlen_k && ch < ch_used;
                            cp_async_16(dst + (ch / 8) * L::KV_SLAB + swizzle128(r, ch % 8),
                                        ok ? (const void*)(base_ptr + sqn.kv_row(key, s0, stride_s) + ch * 8)
                                           : (const void*)dummy,
                                        ok);
                        };
                        // (not unrolled: unrolled, the head-dim-192 producer spilled)
#pragma unroll 1
                        for (int c = pt; c < BLOCK_N * CHP; c += 128) row_chunk(c);
                    } else if constexpr (128 % CHP == 0) {
                        // each thread keeps one column chunk and walks rows RS apart: one
                        // pointer step and one compare per copy (head dims 64, 128, 256)
                        constexpr int RS = 128 / CHP;
                        const int ch = pt % CHP, r0 = pt / CHP;
                        const bool col_ok = ch < ch_used;
                        const T* src = base_ptr + (index_t)(j * BLOCK_N + r0) * stride_s + ch * 8;
                        const unsigned d0 = dst + (ch / 8) * L::KV_SLAB;
#pragma unroll
                        for (int i = 0; i < BLOCK_N / RS; ++i) {
                            const int r = r0 + i * RS;
                            const bool ok = col_ok && j * BLOCK_N + r < seqlen_k;
                            cp_async_16(d0 + swizzle128(r, ch % 8), ok ? (const void*)src : (const void*)dummy, ok);
                            src += RS * stride_s;
                        }
                    } else {
#pragma unroll 4
                        for (int c = pt; c < BLOCK_N * CHP; c += 128) {
                            const int r = c / CHP, ch = c % CHP;
                            const int key = j * BLOCK_N + r;
                            const bool ok = key < seqlen_k && ch < ch_used;
                            cp_async_16(dst + (ch / 8) * L::KV_SLAB + swizzle128(r, ch % 8),
                                        ok ? (const void*)(base_ptr + (index_t)key * stride_s + ch * 8) : (const void*)dummy,
                                        ok);
                        }
                    }
                };
                // The warpgroup's copies have landed once each thread's have, and their
                // writes (generic proxy) are ordered before the consumers' wgmma reads
                // (async proxy) by each thread's proxy fence, before the arrival that
                // releases them.
                auto copies_arrive = [&](unsigned full) {
                    cp_async_wait_all();
                    fence_proxy_async();
                    producer_sync<NWG>();
                    if (pt == 0) mbar_arrive(full);
                };
                // Tile j of K or V into a stage. A tile inside the sequence's keys, or
                // inside the array (the copy engine zero-fills rows past its end), goes
                // by bulk tensor copies, one per slab, issued by one thread; the tile
                // that holds the end of a sequence that ends before the array does
                // (seqlens_k; varlen: every sequence but the one that ends the packed
                // keys; left padding) goes by the warpgroup's cp.async, which zero-fills
                // the keys past it: they are never read (another sequence's keys, an
                // unused slot of a cache), so a NaN there can't reach P V. The tensor
                // maps see k and v as they are: (1, total_k, ...) for varlen, key j of
                // the sequence at row k0 + j, batch 0.
                auto ends_array = [&] {  // the sequence's keys end where the array's rows do
                    if constexpr (Sequence<ADDR>::PAGED) return false;  // (a page's other slots are stale)
                    if constexpr (ADDR == 0) return seqlen_k == p.seqlen_k;
                    else return sqn.k0() + seqlen_k == (Sequence<ADDR>::VARLEN ? sp->total_k : p.seqlen_k);
                };
                const int map_b = Sequence<ADDR>::VARLEN ? 0 : b, map_k0 = sqn.k0();
                auto fill = [&](unsigned full, unsigned dst, const TensorMap& map, const T* base_ptr, index_t s0,
                                index_t stride_s, const T* dummy, int j) {
                    if constexpr (KV_BY_THREADS) {
                        load_tile(dst, base_ptr, s0, stride_s, dummy, j);
                        cp_async_mbar_arrive(full);  // (the consumers' proxy fence follows their wait)
                    } else if (j * BLOCK_N + BLOCK_N <= seqlen_k || ends_array()) {
                        if constexpr (Sequence<ADDR>::PAGED) {
                            // boxes of kv_box rows, none across a page, each from its page: lane b of
                            // the first warp reads box b's page from the block table and issues that
                            // box (one load's latency a tile, not one a box); lane 0's arrival
                            // announces the tile's bytes (the phase needs it, whichever lands first)
                            if (pt < kv_boxes) {  // at most BLOCK_N / 16 <= 8 lanes
                                if (pt == 0) mbar_expect_tx(full, L::KV_BYTES);
                                int slot, row;
                                sqn.page_of(j * BLOCK_N + pt * kv_box, slot, row);
                                const int page = sqn.pages[slot];
#pragma unroll
                                for (int sl = 0; sl < L::SLABS; ++sl)
                                    tma_load_4d(dst + sl * L::KV_SLAB + pt * kv_box * 128, map, full, sl * 64, row, kvh, page);
                            }
                        } else if (pt == 0) {
                            mbar_expect_tx(full, L::KV_BYTES);
#pragma unroll
                            for (int sl = 0; sl < L::SLABS; ++sl)
                                tma_load_4d(dst + sl * L::KV_SLAB, map, full, sl * 64, map_k0 + j * BLOCK_N, kvh, map_b);
                        }
                    } else {
                        load_tile(dst, base_ptr, s0, stride_s, dummy, j);
                        copies_arrive(full);
                    }
                };
                auto fill_k = [&](int i) {  // key tile j0 + i, ring position ring + i
                    const int r = ring + i, stage = r % STAGES;
                    if (r >= STAGES) mbar_wait(k_empty(stage), ((r / STAGES) + 1) & 1);  // its use r - STAGES is done
                    fill(k_full(stage), sK + stage * L::KV_BYTES, k_map, kbase, p.k_stride[0], k_stride_s, k, j0 + i);
                };
                auto fill_v = [&](int i) {
                    const int r = ring + i, stage = r % STAGES;
                    if (r >= STAGES) mbar_wait(v_empty(stage), ((r / STAGES) + 1) & 1);
                    fill(v_full(stage), sV + stage * L::KV_BYTES, v_map, vbase, p.v_stride[0], v_stride_s, v, j0 + i);
                };
                if (num_n > 0) fill_k(0);
                for (int h = 0; h < NWG; ++h) {
                    // warpgroup h's 64 rows of the Q tile, rows past the queries and
                    // columns past head_dim zero-filled, once it is done with its last tile
                    const int qs = published % QS;  // its Q tile; its use published / QS
                    if (published >= QS) mbar_wait(q_empty(h, qs), (published / QS - 1) & 1);
                    if (pt == 0) next_tile[NWG * qs + h] = tile;
                    const unsigned dst = sQ + qs * L::Q_BYTES + h * 64 * 128;
                    if (bulk_qo) {
                        if (pt == 0) {
                            mbar_expect_tx(q_full(h, qs), L::SLABS * wg_rows * 128);
#pragma unroll
                            for (int sl = 0; sl < L::SLABS; ++sl)
                                tma_load_4d(dst + sl * L::Q_SLAB, q_map, q_full(h, qs), sl * 64, kvh * group,
                                            (row0 + h * wg_rows) / group, b);
                        }
                    } else {
                        // (the threads' copies: wg_rows is 64)
                        auto q_chunk = [&](int c) {
                            const int r = c / CHP, ch = c % CHP;
                            const int pr = row0 + h * 64 + r;
                            const bool ok = pr < packed_rows && ch < ch_used;
                            const int t = pr / group, g = pr - (pr / group) * group;
                            const T* src = ok ? q + (index_t)b * p.q_stride[0] + (index_t)(sqn.q0() + t) * p.q_stride[1] +
                                                    (index_t)q_head_of(kvh, g, group) * p.q_stride[2] + ch * 8
                                              : q;
                            cp_async_16(dst + (ch / 8) * L::Q_SLAB + swizzle128(r, ch % 8), src, ok);
                        };
                        if constexpr (NWG > 2) {
                            // not unrolled: its addresses, hoisted out of the tile loop, would
                            // outgrow the producer's registers with three consumer warpgroups
#pragma unroll 1
                            for (int c = pt; c < 64 * CHP; c += 128) q_chunk(c);
                        } else {
                            for (int c = pt; c < 64 * CHP; c += 128) q_chunk(c);  // (ptxas's unrolling: a full one spills)
                        }
                        copies_arrive(q_full(h, qs));
                    }
                }
                for (int i = 0; i < num_n; ++i) {
                    if (i > 0) fill_k(i);
                    fill_v(i);
                }
                ring += num_n;
                ++published;
            }
            // the tile after this one, for the whole warpgroup
            if (pt == 0) {
                int after = -1;
                if (tile_counter != nullptr) {
                    if (fetched == num_tiles - 1) atomicExch(tile_counter, 0);  // the launch's last fetch
                    if (fetched < num_tiles - (int)gridDim.x) after = (int)gridDim.x + fetched;
                }
                next_tile[NWG * QS] = after;
            }
            producer_sync<NWG>();
            tile = __shfl_sync(0xffffffffu, next_tile[NWG * QS], 0);
            producer_sync<NWG>();              // read by all before thread 0 writes it again
        }
        // no more tiles: each warpgroup learns it once it is done with its last
        for (int h = 0; h < NWG; ++h) {
            const int qs = published % QS;
            if (published >= QS) mbar_wait(q_empty(h, qs), (published / QS - 1) & 1);
            if (pt == 0) {
                next_tile[NWG * qs + h] = -1;
                mbar_arrive(q_full(h, qs));
            }
        }
        cp_async_wait_all();                   // nothing in flight when the warpgroup exits
        return;
    }

    // ============================ consumer warpgroups ============================
    regs_inc<consumer_regs<NWG, HEAD_DIM_PAD>()>();
    // converted once: opaque to ptxas, which would otherwise convert the
    // double again on every key tile (F2F and DSETP on the FP64 pipe, in the
    // loop's critical path) rather than hold it in a register
    float scale_log2 = (float)p.scale_log2;
    asm volatile("" : "+f"(scale_log2));
    // (warp-uniform values through a shuffle from lane 0 are known uniform to
    // ptxas, which then keeps the wgmma descriptors built from them in uniform
    // registers: no register-to-uniform moves between the wgmmas)
    const int wg = __shfl_sync(0xffffffffu, tid / 128, 0);  // rows [64 wg, 64 wg + 64) of the tile
    const int lane = tid & 31;
    // the lane's rows hf = 0, 1 of its warpgroup's block: my_lrow() + 8 hf; in the Q tile
    // in shared memory, wg * 64 + that; in the tile's packed rows, my_off + 8 hf
    auto my_lrow = [&] { return (((int)threadIdx.x / 32) & 3) * 16 + (lane >> 2); };
    const int my_off = wg * wg_rows + my_lrow();

    const unsigned long long desc_q0 = make_smem_desc(sQ + wg * 64 * 128, 16, 1024);
    const unsigned long long desc_k0 = make_smem_desc(sK, 16, 1024);
    const unsigned long long desc_v0 = make_smem_desc(sV, L::KV_SLAB, 1024);
    // a k-step of Q K^T moves 32 bytes inside a slab, then to the next slab
    auto stage_off = [](int r) { return (unsigned long long)(((r % STAGES) * L::KV_BYTES) >> 4); };

    // Ping-pong: the consumer warpgroups take turns, in a ring, at issuing their
    // matrix products (named barriers TURN_BAR + wg), so that the tensor cores
    // work on one's while the others run their softmax. A tile with n key tiles
    // has n + 1 turns (tile 0's S; S_j with P_{j-1} V_{j-1}; the last P V), none
    // with n = 0, and the turns run on across the CTA's tiles: the last warpgroup
    // opens the first, each passes one to the next after each of its own, and
    // warpgroup 0 takes the last one's final pass at the end, so every barrier
    // phase that starts also completes (benchmarks/dev/hopper_barriers.py).
    auto take_turn = [&] { pair_sync(TURN_BAR + wg); };
    auto pass_turn = [&] { pair_arrive(TURN_BAR + (NWG == 2 ? wg ^ 1 : (wg + 1) % NWG)); };  // (the xor at two: the code measured before three)
    if (wg == NWG - 1) pair_arrive(TURN_BAR);
    // Whether the softmax of S_j runs while P_{j-1} V_{j-1} does (its registers,
    // O and P, held meanwhile). ALiBi, a score_mod in natural units and the larger
    // tiles need those registers: there the warpgroup waits for P V first, and the
    // other warpgroup's products still overlap its softmax. So does a softcap with
    // three consumer warpgroups (160 or 152 registers a thread). A score_mod in units that is
    // the one score modifier runs where the softcap does (softmax.cuh: frag_unit), so
    // that written as the softcap it costs what the softcap costs, unless its code needs
    // the registers (SERIAL_PV: the variant the host takes where this one spills).
    constexpr bool OVERLAP_PV = !M::ANY || (!M::ALIBI && (!M::SCORE || M::UNIT_ONLY) && !M::SERIAL_PV &&
                                            HEAD_DIM_PAD <= 192 && !(M::UNIT_ONLY && NWG == 3));
    // The generic modifiers' step (softmax.cuh: frag_modify) in a loop for masked and one for
    // unmasked tiles, but where three consumer warpgroups take a window (a causal window with a
    // softcap spilled 12 bytes)
    constexpr bool TWO_LOOPS = NWG == 2 || !M::WINDOW;
    // half tiles (the consumer's key loop below); not with three consumer warpgroups on
    // per-sequence addressing (paged, left-padded: their 160 registers spilled 4 bytes)
    constexpr bool HALF_TILES = !M::ANY && BLOCK_N == 128 && (NWG == 2 || ADDR == 0);

    // With two Q tiles and out by bulk copies, the thread that issues a tile's out
    // copies waits for them to have read its rows only in the warpgroup's next
    // tile, after that tile's first Q K^T is issued (or at its epilogue, or at
    // the end), and only then adds its arrival to the Q tile's q_empty: the
    // producer needs that Q tile again two tiles on, so the wait leaves the
    // warpgroup's path from one tile to the next. held: that Q tile (-1: none).
    int held = -1;
    auto release_held = [&] {
        if constexpr (QS == 2) {
            if (held >= 0) {
                bulk_wait_read();
                mbar_arrive(q_empty(wg, held));
                held = -1;
            }
            __syncwarp();                      // converged again before the next .aligned instruction
        }
    };

    int ring = 0;                              // ring position of the tile's first key tile
    for (int tn = 0;; ++tn) {
        const int qs = tn % QS;                // this tile's Q rows: Q tile qs, its use tn / QS
        mbar_wait(q_full(wg, qs), (tn / QS) & 1);
        const int tile_index = __shfl_sync(0xffffffffu, next_tile[NWG * qs + wg], 0);
        const unsigned sQt = sQ + qs * L::Q_BYTES;  // the Q tile, and the epilogue's staging
        const unsigned long long desc_q = desc_q0 + (unsigned long long)((qs * L::Q_BYTES) >> 4);
        if (tile_index < 0) {
            release_held();                    // nothing in flight reads the rows when the CTA exits
            break;
        }
        Sequence<ADDR> sqn;  // the tile's sequence: where its queries and keys are
        const PrefillTile<CAUSAL, M::WINDOW> tile =
            prefill_tile_seq_at<CAUSAL, M::WINDOW, ADDR>(p, seqlens_k, sp, group, left, right, sqn, tile_index, tr);
        const int b = tile.b, kvh = tile.kv_head, row0 = tile.row0, packed_rows = tile.packed_rows;
        // the packed row of the lane's row hf: pr0 + 8 hf (a row of the block's rows
        // past wg_rows, my_lrow() + 8 hf >= wg_rows, is idle: its Q is zero, nothing stored)
        const int pr0 = row0 + my_off;
        const int len = tile.len, seqlen_k = tile.seqlen_k;  // valid keys of this sequence; len -1: bad, NaN rows
        const KeyRange<CAUSAL, M::WINDOW>& keys = tile.keys;
        const int j0 = keys.start / BLOCK_N;
        const int num_n = (keys.end + BLOCK_N - 1) / BLOCK_N - j0;
        // this warpgroup's key tiles: the first wg_n of the tile's, up to its own rows' end
        // wg_end. With three warpgroups a causal tile's first rows can end key tiles before
        // its last row's, and a tile past them is all -inf for them (P 0, O and l unchanged),
        // so the warpgroup only frees those tiles' stages and takes their turns (below). Two
        // warpgroups walk the tile's whole range: there it measured 1 to 2.6 % slower, with
        // three 1.2 to 1.7 % faster (benchmarks/NOTES_hopper.md, steps 36 and 37). Without a
        // causal mask or a window every row sees the tile's keys
        constexpr bool OWN_KEYS = NWG == 3 && (CAUSAL || M::WINDOW);
        const int wg_row0 = row0 + wg * wg_rows, wg_last = min(wg_row0 + wg_rows, packed_rows) - 1;
        const int wg_end = OWN_KEYS && wg_last >= wg_row0 ? min(keys.end, keys.last_key(wg_last) + 1) : keys.end;
        const int wg_n = !OWN_KEYS               ? num_n
                         : wg_last < wg_row0     ? 0
                                                 : max(0, min(num_n, (wg_end + BLOCK_N - 1) / BLOCK_N - j0));

        // the wgmma accumulators as m16n8 fragments (wgmma.cuh: the same layout)
        float o[DT][4];                        // O: DT n8 tiles of head dims
#pragma unroll
        for (int dt = 0; dt < DT; ++dt)
#pragma unroll
            for (int e = 0; e < 4; ++e) o[dt][e] = 0.f;
        float m_run[2] = {neg_inf<float>(), neg_inf<float>()};  // reference max, log2 units
        float l_run[2] = {0.f, 0.f};           // the lane's part of the row sums
        unsigned pa[BLOCK_N / 16][4];          // P of the last tile as wgmma A fragments

        // the modifiers' view of the lane's rows (common.cuh: mods)
        const mods::Seq sq = mods::seq(b, sqn.seqlen_q(seqlen_q), seqlen_k);
        mods::Diag mrow[2];
        if constexpr (M::ANY) {
#pragma unroll
            for (int hf = 0; hf < 2; ++hf) {
                const int pr = pr0 + 8 * hf;
                mrow[hf] = mods::diag<M>(mp, sq, pr / group, q_head_of(kvh, pr % group, group));
            }
        }

        // S = Q K_j^T and O += P V_j (asynchronous: committed, not waited for); j
        // counts the tile's key tiles, ring + j is its ring position; S of BLOCK_N
        // keys, or of a half tile's first BLOCK_N / 2 (below), P V over K16 k-steps
        auto issue_qk = [&](auto& s, int j) {
            constexpr int KN = 8 * int(sizeof(s) / sizeof(s[0]));
            const unsigned long long desc_k = desc_k0 + stage_off(ring + j);
#pragma unroll
            for (int kd = 0; kd < KD; ++kd)
                Wgmma<T, KN>::ss(flat(s), desc_q + kstep(kd, L::Q_SLAB), desc_k + kstep(kd, L::KV_SLAB), kd);
            wgmma_commit();
        };
        auto issue_pv = [&](int jv, auto k16) {
            const unsigned long long desc_v = desc_v0 + stage_off(ring + jv);
#pragma unroll
            for (int kk = 0; kk < decltype(k16)::value; ++kk)
                Wgmma<T, HEAD_DIM_PAD>::rs(flat(o), pa[kk], desc_v + (unsigned long long)((kk * 16 * 128) >> 4), 1);
            wgmma_commit();
        };
        // A stage's K or V has landed. KV_BY_THREADS: it came by the producer's cp.async
        // (generic proxy), which no thread fenced after they landed: this thread's proxy
        // fence orders them before its wgmma reads (async proxy).
        auto wait_kv = [&](unsigned full, int r) {
            mbar_wait(full, (r / STAGES) & 1);
            if constexpr (KV_BY_THREADS) fence_proxy_async();
        };
        auto wait_k = [&](int j) { wait_kv(k_full((ring + j) % STAGES), ring + j); };
        auto wait_v = [&](int j) { wait_kv(v_full((ring + j) % STAGES), ring + j); };
        // the key tiles this warpgroup masks: those that a row of its own sees only in part
        // (with three warpgroups, of fewer rows than the tile's: a third of a band's edges)
        const KeyRange<CAUSAL, M::WINDOW> wg_keys = OWN_KEYS && wg_last >= wg_row0 ? keys.rows(wg_row0, wg_last) : keys;

        // Mask S of key tile j (tiles crossing the diagonal or the end of the keys), then
        // P = exp2(S * scale_log2 - m) in place (softmax.cuh, exact maxima).
        auto probabilities = [&](auto& s, int j, float (&alpha)[2], float (&rs)[2]) {
            const int n0 = j * BLOCK_N;
            if constexpr (!M::ANY) {
                if (n0 + 8 * int(sizeof(s) / sizeof(s[0])) > wg_keys.free) {
                    const int last[2] = {wg_keys.last_key(pr0), wg_keys.last_key(pr0 + 8)};
                    softmax::frag_mask(s, n0, lane, last);
                }
                return softmax::frag_probabilities<RESCALE_THRESHOLD, true>(s, m_run, alpha, rs, scale_log2,
                                                                            softmax::FastExp2());
            } else if constexpr (M::FIXED_REF) {
                // scores in a known range: the modifiers (one rule in units, a softcap's or a
                // score_mod's: scaled to its units at one multiply), then one reference for every row
                const float scale =
                    softmax::frag_modify<M, CAUSAL, TWO_LOOPS>(s, n0, BLOCK_N, lane, mp, sq, mrow, wg_keys, scale_log2);
                return softmax::frag_probabilities_fixed(s, mp.fixed_ref, m_run, rs, scale, softmax::FastExp2());
            } else if constexpr (M::SOFTCAP_ONLY && NWG == 2) {
                // the softcap with the maxima taken before it (softmax.cuh: frag_unit; with
                // three warpgroups and a window, its two paths spilled 8 bytes)
                float mx[2];
                const float scale =
                    softmax::frag_unit<M, CAUSAL>(s, mx, n0, BLOCK_N, lane, mp, sq, mrow, wg_keys, scale_log2);
                return softmax::frag_probabilities_max<RESCALE_THRESHOLD, true>(s, mx, m_run, alpha, rs, scale,
                                                                                softmax::FastExp2());
            } else {
                // modifiers (softmax.cuh: frag_modify; one rule in units by frag_unit), then the
                // probabilities
                const float scale =
                    softmax::frag_modify<M, CAUSAL, TWO_LOOPS>(s, n0, BLOCK_N, lane, mp, sq, mrow, wg_keys, scale_log2);
                return softmax::frag_probabilities<RESCALE_THRESHOLD, true>(s, m_run, alpha, rs, scale,
                                                                            softmax::FastExp2());
            }
        };
        // P as the A operand of the next P V: the S fragment of keys 16 kk .. is P's
        auto to_operand = [&](const auto& s) {
#pragma unroll
            for (int kk = 0; kk < int(sizeof(s) / sizeof(s[0])) / 2; ++kk) acc_a_operand<T>(s, kk, pa[kk]);
        };
        // A half tile: the last key tile, where no row of the tile sees a key past its
        // first BLOCK_N / 2 (the causal diagonal's, or the end of the keys): its S by a
        // product of BLOCK_N / 2 keys, its softmax on those, its P V on half the
        // k-steps, in code of its own outside the key loop (a branch inside the loop
        // costs every step of it). Plain kernels of 128-key tiles.
        const bool half_last = HALF_TILES && wg_n > 0 && wg_end - (j0 + wg_n - 1) * BLOCK_N <= BLOCK_N / 2;
        using Full = Const<NT>;
        using Half = Const<(HALF_TILES ? NT / 2 : NT)>;

        auto first = [&](auto width) {         // tile 0: S, softmax, P
            float s[decltype(width)::value][4], alpha[2] = {1.f, 1.f}, rs[2];
            wait_k(0);
            take_turn();
            wgmma_fence();
            issue_qk(s, 0);
            pass_turn();
            release_held();                    // the last tile's out copies, while Q K_0^T runs
            wgmma_wait<0>();
            fence_regs(flat(s));
            mbar_arrive(k_empty(ring % STAGES));
            if (DIRECT_OUT && wg_n == 1) mbar_arrive(q_empty(wg, qs));  // the tile's last read of Q is done
            const bool rescale = probabilities(s, j0, alpha, rs);
            softmax::frag_rescale(o, l_run, rescale, alpha, rs);
            to_operand(s);
        };
        auto step = [&](int j, auto width) {
            // S_j = Q K_j^T, then O += P_{j-1} V_{j-1} behind it on the tensor cores;
            // the softmax of S_j runs while P V does
            float s[decltype(width)::value][4], alpha[2] = {1.f, 1.f}, rs[2];
            wait_k(j);
            wait_v(j - 1);
            take_turn();
            wgmma_fence();
            issue_qk(s, j);
            issue_pv(j - 1, Const<BLOCK_N / 16>());
            pass_turn();
            wgmma_wait<1>();                   // S_j is ready: K_j is free
            fence_regs(flat(s));
            mbar_arrive(k_empty((ring + j) % STAGES));
            if (DIRECT_OUT && j == wg_n - 1) mbar_arrive(q_empty(wg, qs));  // and so is Q after the last
            auto pv_done = [&] {
                wgmma_wait<0>();               // P_{j-1} V_{j-1} is done: V_{j-1} is free
                fence_regs(flat(o));
                mbar_arrive(v_empty((ring + j - 1) % STAGES));
            };
            if constexpr (!OVERLAP_PV) pv_done();
            const bool rescale = probabilities(s, j0 + j, alpha, rs);
            if constexpr (OVERLAP_PV) pv_done();
            softmax::frag_rescale(o, l_run, rescale, alpha, rs);
            to_operand(s);
        };
        if (wg_n > 0) {
            if (wg_n == 1 && half_last) first(Half());
            else first(Full());
        }
        for (int j = 1; j < wg_n - (half_last ? 1 : 0); ++j) step(j, Full());
        if (wg_n > 1 && half_last) step(wg_n - 1, Half());
        if (wg_n > 0) {                        // the last tile's P V
            wait_v(wg_n - 1);
            take_turn();
            if (half_last) {                   // (the fence on each path: ptxas adds one there else)
                wgmma_fence();
                issue_pv(wg_n - 1, Const<BLOCK_N / 32>());
            } else {
                wgmma_fence();
                issue_pv(wg_n - 1, Const<BLOCK_N / 16>());
            }
            pass_turn();
            wgmma_wait<0>();
            fence_regs(flat(o));
            mbar_arrive(v_empty((ring + wg_n - 1) % STAGES));
        } else if (num_n > 0) {                // (the turn of the last P V, which every warpgroup takes)
            take_turn();
            pass_turn();
        }
        // the tiles that none of its rows sees: each stage freed once it has landed (an
        // arrival before that would count toward the stage's last use), each turn taken,
        // so that every warpgroup takes num_n + 1 turns a tile
        for (int j = wg_n; j < num_n; ++j) {
            wait_k(j);
            take_turn();
            pass_turn();
            mbar_arrive(k_empty((ring + j) % STAGES));
            wait_v(j);
            mbar_arrive(v_empty((ring + j) % STAGES));
        }
        ring += num_n;

        if constexpr (DIRECT_OUT) {
            if (wg_n == 0) mbar_arrive(q_empty(wg, qs));  // Q was never read

            // ---- epilogue: O / l from the registers straight to out ---------------------------
            // (a lane holds columns 8 dt + 2 (lane % 4) + {0, 1} of its two rows: four
            // lanes write 16 contiguous bytes of a row per dt; the Q rows were freed
            // after the last Q K^T, so the producer loads the next tile's meanwhile)
#pragma unroll
            for (int hf = 0; hf < 2; ++hf) {
                float l;
                const float inv = softmax::frag_row_end<M::SINKS>(l_run[hf], m_run[hf], l, len < 0, [&] {
                    return mods::sink2<M, float>(mp, q_head_of(kvh, (pr0 + 8 * hf) % group, group));
                });
                const int pr = pr0 + 8 * hf;
                const int g = pr % group;
                if (pr < packed_rows && my_lrow() + 8 * hf < wg_rows) {
                    const int t = pr / group;
                    T* dst = out + (index_t)b * p.o_stride[0] + (index_t)(sqn.q0() + t) * p.o_stride[1] +
                             (index_t)q_head_of(kvh, g, group) * p.o_stride[2] + 2 * (lane & 3);
#pragma unroll
                    for (int dt = 0; dt < DT; ++dt)
                        if (dt * 8 < p.head_dim)
                            *reinterpret_cast<unsigned*>(dst + dt * 8) =
                                pack2<T>(o[dt][2 * hf] * inv, o[dt][2 * hf + 1] * inv);
                    if (lse != nullptr && (lane & 3) == 0)
                        lse[sqn.lse_at(kvh, g, group, t, num_q_heads, seqlen_q)] = softmax::lse(m_run[hf], l, len < 0);
                }
            }
        } else {
            release_held();                    // (a tile without keys issued no Q K^T)
            // ---- epilogue: O / l into this warpgroup's rows of the Q tile, then out ----------
            // (only this warpgroup's wgmmas read those rows, and they are done)
#pragma unroll
            for (int hf = 0; hf < 2; ++hf) {
                const int r = wg * 64 + my_lrow() + 8 * hf;
                float l;
                const float inv = softmax::frag_row_end<M::SINKS>(l_run[hf], m_run[hf], l, len < 0, [&] {
                    return mods::sink2<M, float>(mp, q_head_of(kvh, (pr0 + 8 * hf) % group, group));
                });
                if (my_lrow() + 8 * hf < wg_rows) {  // (an idle row's Q stays zero for the tiles to come)
#pragma unroll
                    for (int dt = 0; dt < DT; ++dt) {
                        // columns 8 dt + 2 (lane % 4) + {0, 1}: chunk dt % 8 of slab dt / 8
                        const unsigned addr = (dt / 8) * L::Q_SLAB + swizzle128(r, dt % 8) + 4 * (lane & 3);
                        *reinterpret_cast<unsigned*>(smem + (sQt - base) + addr) =
                            pack2<T>(o[dt][2 * hf] * inv, o[dt][2 * hf + 1] * inv);
                    }
                }
                if (lse != nullptr && (lane & 3) == 0) {
                    const int pr = pr0 + 8 * hf;
                    if (pr < packed_rows && my_lrow() + 8 * hf < wg_rows) {
                        const int t = pr / group, g = pr - (pr / group) * group;
                        lse[sqn.lse_at(kvh, g, group, t, num_q_heads, seqlen_q)] = softmax::lse(m_run[hf], l, len < 0);
                    }
                }
            }
            if (bulk_qo) {
                // this warpgroup's wg_rows rows to out by one bulk copy per slab; the writes above
                // (generic proxy) are ordered before the copy engine's reads by each
                // thread's proxy fence and the warpgroup's barrier
                fence_proxy_async();
                warpgroup_sync(EPILOGUE_BAR + wg);
                if (tid % 128 == 0) {
#pragma unroll
                    for (int sl = 0; sl < L::SLABS; ++sl)
                        tma_store_4d(o_map, sQt + sl * L::Q_SLAB + wg * 64 * 128, sl * 64, kvh * group, (row0 + wg * wg_rows) / group, b);
                    bulk_commit();
                    if constexpr (QS == 2) held = qs;  // read by the next tile (release_held)
                    else bulk_wait_read();             // the rows stay until the copies have read them
                }
            } else {
                warpgroup_sync(EPILOGUE_BAR + wg);
                const int ch_used = p.head_dim / 8;  // (the threads' copies: wg_rows is 64)
                for (int c = tid - wg * 128; c < 64 * ch_used; c += 128) {
                    const int r = wg * 64 + c / ch_used, ch = c - (c / ch_used) * ch_used;
                    const int pr = row0 + r;
                    if (pr < packed_rows) {
                        const int t = pr / group, g = pr - (pr / group) * group;
                        T* dst = out + (index_t)b * p.o_stride[0] + (index_t)(sqn.q0() + t) * p.o_stride[1] +
                                 (index_t)q_head_of(kvh, g, group) * p.o_stride[2] + ch * 8;
                        *reinterpret_cast<uint4*>(dst) =
                            *reinterpret_cast<const uint4*>(smem + (sQt - base) + (ch / 8) * L::Q_SLAB + swizzle128(r, ch % 8));
                    }
                }
            }
            // the warpgroup's Q rows are free for a later tile (the out copies' thread: once they are read)
            if (held < 0) mbar_arrive(q_empty(wg, qs));
        }
    }
    if (wg == 0) take_turn();                  // the last warpgroup's pass after its last turn
}

template <typename T, int HEAD_DIM_PAD, int BLOCK_M, int BLOCK_N, int STAGES, bool CAUSAL, int SMEM_BYTES>
__global__ void __launch_bounds__(BLOCK_M / 64 * 128 + 128, 1)
hopper_attention(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v, T* __restrict__ out,
                 float* __restrict__ lse, const int* __restrict__ seqlens_k, const AttnParams p,
                 const __grid_constant__ sm90::TensorMap k_map, const __grid_constant__ sm90::TensorMap v_map,
                 const __grid_constant__ sm90::TensorMap q_map, const __grid_constant__ sm90::TensorMap o_map,
                 const int qo_bulk, int* __restrict__ tile_counter) {
    hopper_body<T, HEAD_DIM_PAD, BLOCK_M, BLOCK_N, STAGES, CAUSAL, SMEM_BYTES, NoMods>(
        q, k, v, out, lse, seqlens_k, p, NoModParams{}, k_map, v_map, q_map, o_map, qo_bulk, tile_counter);
}

// The same with modifiers (FLAGS: common.cuh, MOD_*), their ModParams after the
// AttnParams.
template <typename T, int HEAD_DIM_PAD, int BLOCK_M, int BLOCK_N, int STAGES, bool CAUSAL, int SMEM_BYTES, int FLAGS>
__global__ void __launch_bounds__(BLOCK_M / 64 * 128 + 128, 1)
hopper_attention_mods(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v, T* __restrict__ out,
                      float* __restrict__ lse, const int* __restrict__ seqlens_k, const AttnParams p,
                      const ModParams mp, const __grid_constant__ sm90::TensorMap k_map,
                      const __grid_constant__ sm90::TensorMap v_map,
                      const __grid_constant__ sm90::TensorMap q_map,
                      const __grid_constant__ sm90::TensorMap o_map, const int qo_bulk,
                      int* __restrict__ tile_counter) {
    hopper_body<T, HEAD_DIM_PAD, BLOCK_M, BLOCK_N, STAGES, CAUSAL, SMEM_BYTES, Mods<FLAGS, sizeof(T) == 2>>(
        q, k, v, out, lse, seqlens_k, p, mp, k_map, v_map, q_map, o_map, qo_bulk, tile_counter);
}

// The same with per-sequence addressing ADDR (common.cuh: SEQ_*: varlen, left
// padding; not paged K/V), described by sp, its SeqParams after the AttnParams.
template <typename T, int HEAD_DIM_PAD, int BLOCK_M, int BLOCK_N, int STAGES, bool CAUSAL, int SMEM_BYTES, int ADDR>
__global__ void __launch_bounds__(BLOCK_M / 64 * 128 + 128, 1)
hopper_attention_seq(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v, T* __restrict__ out,
                     float* __restrict__ lse, const int* __restrict__ seqlens_k, const AttnParams p, const SeqParams sp,
                     const __grid_constant__ sm90::TensorMap k_map,
                     const __grid_constant__ sm90::TensorMap v_map,
                     const __grid_constant__ sm90::TensorMap q_map,
                     const __grid_constant__ sm90::TensorMap o_map, const int qo_bulk,
                     int* __restrict__ tile_counter) {
    hopper_body<T, HEAD_DIM_PAD, BLOCK_M, BLOCK_N, STAGES, CAUSAL, SMEM_BYTES, NoMods, NoModParams, ADDR>(
        q, k, v, out, lse, seqlens_k, p, NoModParams{}, k_map, v_map, q_map, o_map, qo_bulk, tile_counter, &sp);
}

// The same with per-sequence addressing ADDR and the modifiers FLAGS: ModParams, then SeqParams.
template <typename T, int HEAD_DIM_PAD, int BLOCK_M, int BLOCK_N, int STAGES, bool CAUSAL, int SMEM_BYTES, int ADDR,
          int FLAGS>
__global__ void __launch_bounds__(BLOCK_M / 64 * 128 + 128, 1)
hopper_attention_seq_mods(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                          T* __restrict__ out, float* __restrict__ lse, const int* __restrict__ seqlens_k,
                          const AttnParams p, const ModParams mp, const SeqParams sp,
                          const __grid_constant__ sm90::TensorMap k_map,
                          const __grid_constant__ sm90::TensorMap v_map,
                          const __grid_constant__ sm90::TensorMap q_map,
                          const __grid_constant__ sm90::TensorMap o_map, const int qo_bulk,
                          int* __restrict__ tile_counter) {
    hopper_body<T, HEAD_DIM_PAD, BLOCK_M, BLOCK_N, STAGES, CAUSAL, SMEM_BYTES, Mods<FLAGS, sizeof(T) == 2>, ModParams,
                ADDR>(q, k, v, out, lse, seqlens_k, p, mp, k_map, v_map, q_map, o_map, qo_bulk, tile_counter, &sp);
}
