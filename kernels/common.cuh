// common.cuh: element types and conversions shared by every kernel family.
//
// Each storage type T has an accumulator type: float for half, bfloat16 and
// float, double for double. Kernels load T, compute in acc_t<T>, store T.
// NVRTC has no <cstdint>, so 64-bit offsets are spelled `long long` (index_t).
#pragma once
#include <cuda_fp16.h>
#include <cuda_bf16.h>

typedef long long index_t;

// The launch parameters of every kernel family, passed by value as one
// argument (one argument launches much faster from Python than twenty).
// Mirrored field by field by cupy_gqa/_plan.py: PARAMS_DTYPE.
struct AttnParams {
    index_t q_stride[4];    // element strides of q: batch, seq, head, dim
    index_t k_stride[4];
    index_t v_stride[4];
    index_t o_stride[4];    // of out
    index_t total_threads;  // rowwise: threads in the grid-stride loop
    double scale_log2;      // softmax_scale * log2(e): the kernels use exp2
    int batch, seqlen_q, seqlen_k, num_q_heads, num_kv_heads, group_size, head_dim, causal;
};
static_assert(sizeof(AttnParams) == 176, "AttnParams must match _plan.PARAMS_DTYPE");

// GQA: query head q_head reads KV head q_head / group_size, so the group_size
// query heads of KV head kv_head are kv_head * group_size + g, g < group_size.
__device__ __forceinline__ int q_head_of(int kv_head, int g, int group_size) { return kv_head * group_size + g; }

template <typename T> struct acc_type { typedef float type; };
template <> struct acc_type<double> { typedef double type; };
template <typename T> using acc_t = typename acc_type<T>::type;

__device__ __forceinline__ float to_acc(float x) { return x; }
__device__ __forceinline__ double to_acc(double x) { return x; }
__device__ __forceinline__ float to_acc(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_acc(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T> __device__ __forceinline__ T from_acc(acc_t<T> x);
template <> __device__ __forceinline__ float from_acc<float>(float x) { return x; }
template <> __device__ __forceinline__ double from_acc<double>(double x) { return x; }
template <> __device__ __forceinline__ __half from_acc<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_acc<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

// One 16-byte vector <-> its 16 / sizeof(T) elements as acc, through register
// bit casts only (no address-taken locals, which ptxas would put on the stack).
template <typename T> __device__ __forceinline__ void unpack16(const uint4& r, acc_t<T>* x);
template <> __device__ __forceinline__ void unpack16<float>(const uint4& r, float* x) {
    x[0] = __uint_as_float(r.x); x[1] = __uint_as_float(r.y); x[2] = __uint_as_float(r.z); x[3] = __uint_as_float(r.w);
}
template <> __device__ __forceinline__ void unpack16<double>(const uint4& r, double* x) {
    x[0] = __hiloint2double((int)r.y, (int)r.x); x[1] = __hiloint2double((int)r.w, (int)r.z);
}
template <> __device__ __forceinline__ void unpack16<__nv_bfloat16>(const uint4& r, float* x) {
    const unsigned w[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) { x[2 * i] = __uint_as_float(w[i] << 16); x[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u); }
}
template <> __device__ __forceinline__ void unpack16<__half>(const uint4& r, float* x) {
    const unsigned w[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        x[2 * i] = __half2float(__ushort_as_half((unsigned short)(w[i] & 0xffffu)));
        x[2 * i + 1] = __half2float(__ushort_as_half((unsigned short)(w[i] >> 16)));
    }
}

template <typename T> __device__ __forceinline__ uint4 pack16(const acc_t<T>* x);
template <> __device__ __forceinline__ uint4 pack16<float>(const float* x) {
    return make_uint4(__float_as_uint(x[0]), __float_as_uint(x[1]), __float_as_uint(x[2]), __float_as_uint(x[3]));
}
template <> __device__ __forceinline__ uint4 pack16<double>(const double* x) {
    return make_uint4((unsigned)__double2loint(x[0]), (unsigned)__double2hiint(x[0]),
                      (unsigned)__double2loint(x[1]), (unsigned)__double2hiint(x[1]));
}
__device__ __forceinline__ unsigned pack_pair(__half lo, __half hi) {
    return (unsigned)__half_as_ushort(lo) | ((unsigned)__half_as_ushort(hi) << 16);
}
__device__ __forceinline__ unsigned pack_pair(__nv_bfloat16 lo, __nv_bfloat16 hi) {
    return (unsigned)__bfloat16_as_ushort(lo) | ((unsigned)__bfloat16_as_ushort(hi) << 16);
}
template <> __device__ __forceinline__ uint4 pack16<__half>(const float* x) {
    unsigned w[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) w[i] = pack_pair(__float2half_rn(x[2 * i]), __float2half_rn(x[2 * i + 1]));
    return make_uint4(w[0], w[1], w[2], w[3]);
}
template <> __device__ __forceinline__ uint4 pack16<__nv_bfloat16>(const float* x) {
    unsigned w[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) w[i] = pack_pair(__float2bfloat16_rn(x[2 * i]), __float2bfloat16_rn(x[2 * i + 1]));
    return make_uint4(w[0], w[1], w[2], w[3]);
}

// NVRTC defines no INFINITY macro.
template <typename A> __device__ __forceinline__ A neg_inf();
template <> __device__ __forceinline__ float neg_inf<float>() { return __int_as_float(0xff800000); }
template <> __device__ __forceinline__ double neg_inf<double>() { return __longlong_as_double(0xfff0000000000000ULL); }

// exp2 / log2 in the accumulator's precision.
__device__ __forceinline__ float exp2_acc(float x) { return exp2f(x); }
__device__ __forceinline__ double exp2_acc(double x) { return exp2(x); }
__device__ __forceinline__ float log2_acc(float x) { return log2f(x); }
__device__ __forceinline__ double log2_acc(double x) { return log2(x); }

// Keys visible to query position t (causal, aligned bottom-right):
// keys j <= t + seqlen_k - seqlen_q, clipped to [0, seqlen_k].
__device__ __forceinline__ int visible_keys(int t, int seqlen_q, int seqlen_k, bool causal) {
    if (!causal) return seqlen_k;
    const long long end = (long long)t + seqlen_k - seqlen_q + 1;
    return end <= 0 ? 0 : (end >= seqlen_k ? seqlen_k : (int)end);
}

// The keys that a CTA of the prefill kernels (tiled, tiled_tf32, hopper) reads
// for its packed rows [row0, last_row] (packed row pr is query pr / group),
// with causal masking aligned bottom-right: query t sees keys j <= t + diag,
// diag = seqlen_k - seqlen_q. Keys [start, end) are read, and those in
// [free_start, free) are visible to every row of the CTA (tiles there need no
// mask). WINDOW (the window modifier, see "Modifiers" below): query t sees keys
// [t + diag - left, t + diag + right] (left, right -1: unbounded on that side;
// causal caps right at 0), so start and free_start move up with the left side
// and end and free down with the right one; without it start = free_start = 0.
template <bool CAUSAL, bool WINDOW = false>
struct KeyRange {
    int end, free, diag, seqlen_k, group;
    enum : int { start = 0, free_start = 0 };  // the window's left side (WINDOW: see below)
    __device__ __forceinline__ KeyRange(int row0, int last_row, int seqlen_q, int seqlen_k_, int group_)
        : end(seqlen_k_), free(seqlen_k_), diag(seqlen_k_ - seqlen_q), seqlen_k(seqlen_k_), group(group_) {
        if (CAUSAL) {
            end = max(0, min(seqlen_k, last_row / group + diag + 1));
            free = max(0, min(seqlen_k, row0 / group + diag + 1));
        }
    }
    // the last key packed row pr sees
    __device__ __forceinline__ int last_key(int pr) const {
        return CAUSAL ? min(seqlen_k - 1, pr / group + diag) : seqlen_k - 1;
    }
    // the first key packed row pr sees
    __device__ __forceinline__ int first_key(int) const { return 0; }
    // whether keys [n0, n0 + n) are seen by every row of the CTA (no mask needed)
    __device__ __forceinline__ bool unmasked(int n0, int n) const { return n0 + n <= free; }
    // the range of rows [row0, last_row] of the same sequence (some of the CTA's rows)
    __device__ __forceinline__ KeyRange rows(int row0, int last_row) const {
        return KeyRange(row0, last_row, seqlen_k - diag, seqlen_k, group);
    }
};

// WINDOW: the band [t + diag - left, t + diag + right] of each row (-1: that
// side unbounded; causal: right is 0).
template <bool CAUSAL>
struct KeyRange<CAUSAL, true> {
    int end, free, diag, seqlen_k, group;
    int start, free_start, left, right;
    __device__ __forceinline__ KeyRange(int row0, int last_row, int seqlen_q, int seqlen_k_, int group_, int left_,
                                        int right_)
        : end(seqlen_k_), free(seqlen_k_), diag(seqlen_k_ - seqlen_q), seqlen_k(seqlen_k_), group(group_),
          start(0), free_start(0), left(left_), right(CAUSAL ? 0 : right_) {
        if (right >= 0) {
            end = clamp_key((long long)(last_row / group) + diag + right + 1);
            free = clamp_key((long long)(row0 / group) + diag + right + 1);
        }
        if (left >= 0) {
            start = clamp_key((long long)(row0 / group) + diag - left);
            free_start = clamp_key((long long)(last_row / group) + diag - left);
        }
    }
    __device__ __forceinline__ int clamp_key(long long j) const {
        return (int)(j < 0 ? 0 : (j > seqlen_k ? seqlen_k : j));
    }
    __device__ __forceinline__ int last_key(int pr) const {
        return right >= 0 ? clamp_key((long long)(pr / group) + diag + right + 1) - 1 : seqlen_k - 1;
    }
    __device__ __forceinline__ int first_key(int pr) const {
        return left >= 0 ? clamp_key((long long)(pr / group) + diag - left) : 0;
    }
    __device__ __forceinline__ bool unmasked(int n0, int n) const { return n0 + n <= free && n0 >= free_start; }
    __device__ __forceinline__ KeyRange rows(int row0, int last_row) const {
        return KeyRange(row0, last_row, seqlen_k - diag, seqlen_k, group, left, right);
    }
};

// The first packed row (packed row pr = query pr / group, common to the
// prefill kernels) that sees key `key`, with causal masking aligned
// bottom-right (query t sees keys j <= t + diag, diag = seqlen_k - seqlen_q):
// query max(0, key - diag); 0 without the mask. The backward pass's key
// blocks (kernels/backward.cu) read the packed rows from there on. (key < seqlen_k,
// so the query is at most seqlen_q and the packed row fits an int.)
__device__ __forceinline__ int first_row_seeing(int key, int diag, int group, bool causal) {
    return causal ? max(0, key - diag) * group : 0;
}

// The tiles of the prefill kernels, in launch order: tile index (blockIdx.x,
// or the index a persistent CTA takes next) -> (batch b, KV head kv_head, tile
// m_tile of BLOCK_M packed query rows), num_m_tiles tiles per (b, kv_head).
//   causal:     the (b, kv_head) pairs in sections of `section` pairs whose K
//               and V fit PREFILL_L2_SECTION_BYTES together (seqlen_k keys of
//               head_dim, counted at 2 bytes an element), one section after
//               another; in each, m_tile slowest and reversed, so that its
//               heavy (late) tiles are launched first, and the tiles running
//               at once are a few pairs' neighbouring row blocks, which read
//               the same K/V from L2 (with every pair in one section, a
//               launch of many KV heads ran each pair's tiles far apart and
//               read its K/V from HBM for each);
//   non-causal: (b, kv_head) slowest, so its K/V stays in L2 across its tiles.
enum : int { PREFILL_L2_SECTION_BYTES = 16 << 20 };
struct TileOfBlock {
    int b, kv_head, m_tile;
};
template <bool CAUSAL>
__device__ __forceinline__ TileOfBlock tile_of_block(const AttnParams& p, int num_m_tiles, int tile) {
    const int num_kv_heads = p.num_kv_heads, num_bh = p.batch * num_kv_heads;
    int m_tile, bh;
    if (CAUSAL) {
        // (in float: a 64-bit division would cost the producer warps registers they don't have)
        const float pair_bytes = fmaxf(4.f * (float)p.seqlen_k * (float)p.head_dim, 1.f);
        const int section = max(1, min(num_bh, (int)((float)PREFILL_L2_SECTION_BYTES / pair_bytes)));
        const int per = section * num_m_tiles;  // tiles of a full section
        const int sec = tile / per, within = tile - sec * per;
        const int pairs = min(section, num_bh - sec * section);  // (the last section may be short)
        m_tile = num_m_tiles - 1 - within / pairs;
        bh = sec * section + within % pairs;
    } else {
        bh = tile / num_m_tiles;
        m_tile = tile % num_m_tiles;
    }
    const int b = bh / num_kv_heads;
    return {b, bh - b * num_kv_heads, m_tile};
}

// A CTA of the prefill kernels (tiled, tiled_tf32, hopper): its batch b and KV
// head (group = num_q_heads / num_kv_heads, as the caller has it), its packed rows [row0, row0 + BLOCK_M) of the group * seqlen_q rows of
// that KV head (packed row r = query t * group + head g of the group), the
// sequence's valid keys (len = seqlen_k_of: -1 for a bad length, seqlen_k =
// max(len, 0)) and the keys the CTA reads (WINDOW: within the window
// [left, right] of the window modifier).
template <bool CAUSAL, bool WINDOW = false>
struct PrefillTile {
    int b, kv_head, row0, group, packed_rows, len, seqlen_k;
    KeyRange<CAUSAL, WINDOW> keys;
};

__device__ __forceinline__ int seqlen_k_of(const int* seqlens_k, int b, int seqlen_k);

// A kernel's tiles: `rows` packed rows each, m_tiles = ceil(seqlen_q * group /
// rows) of them per (b, kv_head). BLOCK_M rows (tile_rows<BLOCK_M>) but for
// hopper's bulk copies of a group that does not divide 64, whose tiles hold
// whole positions and so fewer rows (kernels/hopper.cu): the *_at functions
// take them; prefill_tile<CAUSAL, BLOCK_M> and its kin are those of BLOCK_M.
struct TileRows {
    int rows, m_tiles;
};
template <int BLOCK_M> __device__ __forceinline__ TileRows tile_rows(const AttnParams& p, int group) {
    return {BLOCK_M, (p.seqlen_q * group + BLOCK_M - 1) / BLOCK_M};
}

template <bool CAUSAL>
__device__ __forceinline__ PrefillTile<CAUSAL> prefill_tile_at(const AttnParams& p, const int* seqlens_k, int group,
                                                           int tile, const TileRows& tr) {
    const int packed_rows = p.seqlen_q * group;
    const TileOfBlock t = tile_of_block<CAUSAL>(p, tr.m_tiles, tile);
    const int row0 = t.m_tile * tr.rows;
    const int len = seqlen_k_of(seqlens_k, t.b, p.seqlen_k);
    const int seqlen_k = max(len, 0);
    return {t.b, t.kv_head, row0, group, packed_rows, len, seqlen_k,
            KeyRange<CAUSAL>(row0, min(row0 + tr.rows, packed_rows) - 1, p.seqlen_q, seqlen_k, group)};
}
template <bool CAUSAL, int BLOCK_M>
__device__ __forceinline__ PrefillTile<CAUSAL> prefill_tile(const AttnParams& p, const int* seqlens_k, int group,
                                                        int tile) {
    return prefill_tile_at<CAUSAL>(p, seqlens_k, group, tile, tile_rows<BLOCK_M>(p, group));
}

// The same for a kernel with modifiers (WINDOW: the keys within the window
// [left, right] of the window modifier).
template <bool CAUSAL, bool WINDOW>
__device__ __forceinline__ PrefillTile<CAUSAL, WINDOW> prefill_tile_mods_at(const AttnParams& p, const int* seqlens_k,
                                                                           int group, int left, int right, int tile,
                                                                           const TileRows& tr) {
    if constexpr (!WINDOW) {
        return prefill_tile_at<CAUSAL>(p, seqlens_k, group, tile, tr);
    } else {
        const int packed_rows = p.seqlen_q * group;
        const TileOfBlock t = tile_of_block<CAUSAL>(p, tr.m_tiles, tile);
        const int row0 = t.m_tile * tr.rows;
        const int len = seqlen_k_of(seqlens_k, t.b, p.seqlen_k);
        const int seqlen_k = max(len, 0);
        return {t.b, t.kv_head, row0, group, packed_rows, len, seqlen_k,
                KeyRange<CAUSAL, true>(row0, min(row0 + tr.rows, packed_rows) - 1, p.seqlen_q, seqlen_k, group, left,
                                       right)};
    }
}

// The same for any per-sequence addressing (common.cuh: Sequence, below), which
// also gives the CTA's sequence sqn: with ADDR 0 prefill_tile_mods itself; with
// per-sequence addressing the packed rows and the keys are those of the CTA's
// sequence (the grid is sized by max_seqlen_q: a CTA past its sequence's rows
// has row0 >= packed_rows and nothing to do).
template <int ADDR> struct Sequence;
struct SeqParams;
template <int ADDR>
__device__ __forceinline__ Sequence<ADDR> sequence_of(const AttnParams& p, const int* seqlens_k, const SeqParams* sp, int b);
template <bool CAUSAL, bool WINDOW, int ADDR>
__device__ __forceinline__ PrefillTile<CAUSAL, WINDOW> prefill_tile_seq_at(const AttnParams& p, const int* seqlens_k,
                                                                          const SeqParams* sp, int group, int left,
                                                                          int right, Sequence<ADDR>& sqn, int index,
                                                                          const TileRows& tr) {
    if constexpr (ADDR == 0) {
        const PrefillTile<CAUSAL, WINDOW> tile =
            prefill_tile_mods_at<CAUSAL, WINDOW>(p, seqlens_k, group, left, right, index, tr);
        sqn.b = tile.b;
        sqn.len = tile.len;
        return tile;
    } else {
        const TileOfBlock t = tile_of_block<CAUSAL>(p, tr.m_tiles, index);
        sqn = sequence_of<ADDR>(p, seqlens_k, sp, t.b);
        const int packed_rows = sqn.seqlen_q(p.seqlen_q) * group;
        const int row0 = t.m_tile * tr.rows;
        const int seqlen_k = max(sqn.len, 0);
        const int last_row = max(row0, min(row0 + tr.rows, packed_rows) - 1);
        if constexpr (WINDOW)  // the window's band of the sequence's own keys
            return {t.b, t.kv_head, row0, group, packed_rows, sqn.len, seqlen_k,
                    KeyRange<CAUSAL, true>(row0, last_row, sqn.seqlen_q(p.seqlen_q), seqlen_k, group, left, right)};
        else
            return {t.b, t.kv_head, row0, group, packed_rows, sqn.len, seqlen_k,
                    KeyRange<CAUSAL>(row0, last_row, sqn.seqlen_q(p.seqlen_q), seqlen_k, group)};
    }
}
template <bool CAUSAL, int BLOCK_M, bool WINDOW, int ADDR>
__device__ __forceinline__ PrefillTile<CAUSAL, WINDOW> prefill_tile_seq(const AttnParams& p, const int* seqlens_k,
                                                                       const SeqParams* sp, int group, int left, int right,
                                                                       Sequence<ADDR>& sqn, int index) {
    return prefill_tile_seq_at<CAUSAL, WINDOW, ADDR>(p, seqlens_k, sp, group, left, right, sqn, index,
                                                     tile_rows<BLOCK_M>(p, group));
}

// Valid keys of batch b: seqlens_k[b] when the caller gave per-sequence cache
// lengths (kernel argument seqlens_k, else nullptr), otherwise seqlen_k; -1
// when seqlens_k[b] is outside [0, seqlen_k] (possible only for a device array,
// which the host doesn't read): the kernels then write NaN rows for batch b
// (out and lse) and read no key, never out of bounds.
__device__ __forceinline__ int seqlen_k_of(const int* seqlens_k, int b, int seqlen_k) {
    if (seqlens_k == nullptr) return seqlen_k;
    const int len = seqlens_k[b];
    return (len < 0 || len > seqlen_k) ? -1 : len;
}

__device__ __forceinline__ float quiet_nan() { return __int_as_float(0x7fffffff); }

// ---- per-sequence addressing: variable lengths, paged K/V, left padding ------------
// The one rule by which every kernel family finds sequence b's queries, keys and
// lse (cupy_gqa/_seq.py is the Python side). ADDR (the *_seq kernels' template
// argument; 0 for the others) is a sum of:
//   SEQ_VARLEN   q, k, v, out are packed: (total, heads, head_dim) with axis 0 of
//                stride 0 (cupy_gqa/_plan.py: make_params); query t of sequence b
//                is row cu_seqlens_q[b] + t, key j row cu_seqlens_k[b] + j; lse is
//                (num_q_heads, total_q). p.seqlen_q, p.seqlen_k are max_seqlen_q, _k.
//   SEQ_PAGED    k, v are (num_pages, page_size, heads, head_dim) pools: key j of
//                sequence b is row j % page_size of page block_table[b][j / page_size]
//                (page_size any multiple of 16); its length is seqlens_k[b], at most
//                p.seqlen_k = max_pages_per_seq * page_size.
//   SEQ_LEFTPAD  the keys of sequence b start at leftpad[b]: key j of the kernels is
//                key leftpad[b] + j of the cache, and len = seqlens_k[b] - leftpad[b],
//                so the causal diagonal stays at the end of the keys.
// The kernels then see each sequence as one of the contiguous case: seqlen_q
// queries, keys [0, len), query t seeing keys j <= t + len - seqlen_q, and only
// the addresses differ. Lengths and offsets are read in place (CUDA graphs);
// values out of range (not checked on the host for device arrays) give NaN rows
// and read no key, or, where the queries themselves are out of range, write nothing.
enum : int { SEQ_VARLEN = 1, SEQ_PAGED = 2, SEQ_LEFTPAD = 4 };

// Mirrored field by field by cupy_gqa/_seq.py: SEQ_PARAMS_DTYPE.
struct SeqParams {
    const int* cu_seqlens_q;    // SEQ_VARLEN: (batch + 1,)
    const int* cu_seqlens_k;    // SEQ_VARLEN: (batch + 1,)
    const int* block_table;     // SEQ_PAGED: block_table[b * block_table_stride + i]
    const int* leftpad;         // SEQ_LEFTPAD: (batch,)
    index_t block_table_stride;
    int page_size;              // SEQ_PAGED
    int total_q, total_k;       // SEQ_VARLEN: rows of q, of k and v
    int pad;
};
static_assert(sizeof(SeqParams) == 56, "SeqParams must match _seq.SEQ_PARAMS_DTYPE");

// Sequence b as the kernels see it (ADDR: the SEQ_* flags). For ADDR 0 every
// accessor is the contiguous expression itself, in the order the contiguous
// kernels evaluate it (q0() and k0() are the constant 0; the call's values come
// in by reference, read where the expression reads them): the contiguous
// instantiations compile to the code they had without per-sequence addressing.
// The bodies take the SeqParams by pointer, nullptr for ADDR 0, for the same
// reason (a SeqParams object, even an empty one, changes the contiguous code).
template <int ADDR>
struct Sequence {
    enum : int {
        VARLEN = (ADDR & SEQ_VARLEN) != 0,
        PAGED = (ADDR & SEQ_PAGED) != 0,
        LEFTPAD = (ADDR & SEQ_LEFTPAD) != 0,
    };
    int b, len;            // len: the valid keys, -1 for a bad length (NaN rows)
    int seqlen_q_;         // VARLEN: the sequence's queries
    int q0_, k0_;          // first query row (VARLEN); first key (VARLEN row, LEFTPAD key)
    int page_size;
    const int* pages;      // PAGED: the sequence's row of block_table
    index_t lse_rows;      // VARLEN: total_q, lse's head stride

    // The sequence's queries (others: the call's, seqlen_q as the kernel has it).
    __device__ __forceinline__ int seqlen_q(const int& seqlen_q) const { return VARLEN ? seqlen_q_ : seqlen_q; }
    // The sequence's packed rows (queries times group; others: rows, the call's).
    __device__ __forceinline__ int packed_rows(int rows, int group) const { return VARLEN ? seqlen_q_ * group : rows; }
    // The row (on axis 1 of q and out) of query 0.
    __device__ __forceinline__ int q0() const { return VARLEN ? q0_ : 0; }
    // The batch index that multiplies axis 0's stride of k and v (pages: none).
    __device__ __forceinline__ int k_batch() const { return PAGED ? 0 : b; }
    // The row (on axis 1 of k and v) of key 0, on top of k_batch (pages: in kv_row).
    __device__ __forceinline__ int k0() const { return (!PAGED && (VARLEN || LEFTPAD)) ? k0_ : 0; }
    // Element offset of key j's row from k + k_batch() * s0 + k0() * s1 + head * s2.
    __device__ __forceinline__ index_t kv_row(index_t j, index_t s0, index_t s1) const {
        if (!PAGED) return j * s1;
        int slot, row;
        page_of((int)j, slot, row);
        return (index_t)pages[slot] * s0 + (index_t)row * s1;
    }
    // PAGED: where key j is: its page's slot in the sequence's row of block_table,
    // and its row in that page.
    __device__ __forceinline__ void page_of(int j, int& slot, int& row) const {
        const int jj = (LEFTPAD ? k0_ : 0) + j;
        slot = jj / page_size;
        row = jj - slot * page_size;
    }
    // PAGED: the pages that keys j .. j + n - 1 (n <= page_size, all below len) lie
    // on, at most two, and key j's row in the first: read from the block table one
    // tile ahead of the copies that use them, so the copies wait on no load.
    struct PageSpan { int first, second, row; };
    __device__ __forceinline__ PageSpan page_span(int j, int n) const {
        const int jj = (LEFTPAD ? k0_ : 0) + j;
        const int slot = jj / page_size;
        const int row = jj - slot * page_size;
        const int first = pages[slot];
        return {first, row + n > page_size ? pages[slot + 1] : first, row};
    }
    // The index of lse's (query head h, query t); num_q_heads, seqlen_q: the call's
    // (references, read where the contiguous expression reads them).
    __device__ __forceinline__ index_t lse_at(int h, int t, const int& num_q_heads, const int& seqlen_q) const {
        if (VARLEN) return (index_t)h * lse_rows + q0_ + t;
        return ((index_t)b * num_q_heads + h) * seqlen_q + t;
    }
    // The same for query head q_head_of(kv_head, g, group), computed in that order.
    __device__ __forceinline__ index_t lse_at(int kv_head, int g, int group, int t, const int& num_q_heads,
                                             const int& seqlen_q) const {
        if (VARLEN) return (index_t)q_head_of(kv_head, g, group) * lse_rows + q0_ + t;
        return ((index_t)b * num_q_heads + q_head_of(kv_head, g, group)) * seqlen_q + t;
    }
};

__device__ __forceinline__ int seqlen_k_of(const int* seqlens_k, int b, int seqlen_k);

// Sequence b of the call: its lengths and where its rows are (see above); sp
// is read only for ADDR != 0.
template <int ADDR>
__device__ __forceinline__ Sequence<ADDR> sequence_of(const AttnParams& p, const int* seqlens_k, const SeqParams* sp, int b) {
    Sequence<ADDR> s;
    s.b = b;
    s.seqlen_q_ = 0;
    s.q0_ = s.k0_ = 0;
    s.page_size = 0;
    s.pages = nullptr;
    s.lse_rows = 0;
    if constexpr (ADDR == 0) {
        s.len = seqlen_k_of(seqlens_k, b, p.seqlen_k);
    } else {
        s.seqlen_q_ = p.seqlen_q;
        if constexpr ((ADDR & SEQ_VARLEN) != 0) {
            const int q0 = sp->cu_seqlens_q[b], q1 = sp->cu_seqlens_q[b + 1];
            const int k0 = sp->cu_seqlens_k[b], k1 = sp->cu_seqlens_k[b + 1];
            const bool q_ok = q0 >= 0 && q1 >= q0 && q1 <= sp->total_q && q1 - q0 <= p.seqlen_q;
            s.seqlen_q_ = q_ok ? q1 - q0 : 0;  // queries out of range: nothing to write
            s.q0_ = q_ok ? q0 : 0;
            const bool k_ok = k0 >= 0 && k1 >= k0 && k1 <= sp->total_k && k1 - k0 <= p.seqlen_k;
            s.len = k_ok ? k1 - k0 : -1;
            s.k0_ = k_ok ? k0 : 0;
            s.lse_rows = sp->total_q;
        } else {
            s.len = seqlen_k_of(seqlens_k, b, p.seqlen_k);
        }
        if constexpr ((ADDR & SEQ_PAGED) != 0) {
            s.page_size = sp->page_size;
            s.pages = sp->block_table + b * sp->block_table_stride;
        }
        if constexpr ((ADDR & SEQ_LEFTPAD) != 0) {
            const int first = sp->leftpad[b];
            if (s.len >= 0) {
                const bool ok = first >= 0 && first <= s.len;
                s.k0_ += ok ? first : 0;
                s.len = ok ? s.len - first : -1;
            }
        }
    }
    return s;
}

// ---- modifiers (window, softcap, ALiBi, sinks, score_mod, mask_mod) ---------------
// The rules every kernel family follows, written once (cupy_gqa/_mods.py is the
// Python side, tests/reference.py the definition). With b the batch, h the
// query head, t the query position, j the key, diag = len - seqlen_q (len: the
// sequence's valid keys) and x = softmax_scale * (q . k), natural units:
//   softcap:   x = softcap * tanh(x / softcap)   (fp16 / bf16 inputs: fast_tanh, below)
//   ALiBi:     x = x - slope[b][h] * |t + diag - j|
//   score_mod: x = user_score_mod(x, b, h, t, j, seqlen_q, len)       (in this order)
//              (with a unit u, MOD_SCORE_UNIT: x = u * user_score_mod(x / u, ...), as the
//              softcap is cap * tanh(x / cap): see to_unit below)
// then a key is masked (weight 0) outside the causal / sequence bounds, outside
// the window [t + diag - left, t + diag + right] (-1: unbounded side; causal
// caps right at 0), or where user_mask_mod(b, h, t, j, seqlen_q, len) is false.
// Sinks: sink[h] (natural units) joins the row's softmax denominator once,
// exp(sink - m), and adds no value (softmax.cuh: fold_sink); lse includes it.
// A kernel with modifiers is a separate instantiation (FLAGS != 0) that takes a
// ModParams after its AttnParams; the kernels without them are unchanged.
enum : int { MOD_WINDOW = 1, MOD_SOFTCAP = 2, MOD_ALIBI = 4, MOD_SINKS = 8, MOD_SCORE = 16, MOD_MASK = 32,
             MOD_FIXED_REF = 64, MOD_SCORE_UNIT = 128, MOD_SERIAL_PV = 256 };

// Mirrored field by field by cupy_gqa/_mods.py: MOD_PARAMS_DTYPE.
struct ModParams {
    const float* sinks;           // MOD_SINKS: (num_q_heads,) float32 sink logits
    const float* alibi;           // MOD_ALIBI: slopes, alibi[b * alibi_batch_stride + h]
    const void* buffers[6];       // the user modifiers' buffers (score_mod's, then mask_mod's)
    index_t alibi_batch_stride;   // 0: slopes (num_q_heads,); num_q_heads: (batch, num_q_heads)
    double softcap;               // MOD_SOFTCAP: > 0
    int window_left, window_right;  // MOD_WINDOW: -1 unbounded (causal: right is 0)
    float fixed_ref;              // MOD_FIXED_REF: every row's exp2 reference, log2 units
    double score_unit;            // MOD_SCORE_UNIT: the score_mod's unit, > 0
};
static_assert(sizeof(ModParams) == 104, "ModParams must match _mods.MOD_PARAMS_DTYPE");
// What a kernel without modifiers passes its body in place of a ModParams: an
// empty struct, so that nothing is built (a 104-byte ModParams{} temporary,
// though unused, changes the order of the generated code).
struct NoModParams {};

// HALF: the kernel's inputs are fp16 or bf16, whose softcap takes fast_tanh (below).
template <int FLAGS, bool HALF = false>
struct Mods {
    enum : int {
        FAST_TANH = HALF,
        ANY = FLAGS != 0,
        WINDOW = (FLAGS & MOD_WINDOW) != 0,
        SOFTCAP = (FLAGS & MOD_SOFTCAP) != 0,
        ALIBI = (FLAGS & MOD_ALIBI) != 0,
        SINKS = (FLAGS & MOD_SINKS) != 0,
        SCORE = (FLAGS & MOD_SCORE) != 0,
        // the score_mod reads and returns scores in units of ModParams::score_unit
        SCORE_UNIT = (FLAGS & MOD_SCORE_UNIT) != 0,
        MASK = (FLAGS & MOD_MASK) != 0,
        SCORES = SOFTCAP || ALIBI || SCORE,  // the scores change
        MASKS = WINDOW || MASK,              // keys inside the causal bounds may be masked
        // softcap is the one score modifier: a row's maximum is the softcap of its raw
        // maximum (softmax.cuh: frag_unit)
        SOFTCAP_ONLY = SOFTCAP && !ALIBI && !SCORE,
        // the one score modifier is a rule in units, x = u * f(x / u): the softcap, or a
        // score_mod with a unit. The tensor-core prefill kernels then scale the raw score
        // to units in one multiply and put u in their exponential's scale (softmax.cuh:
        // frag_unit), the same arithmetic for both, so that a score_mod spelling the
        // softcap in units gives the built-in's bits.
        UNIT_ONLY = SOFTCAP_ONLY || (SCORE && SCORE_UNIT && !SOFTCAP && !ALIBI),
        // the modified scores lie in a known range (a softcap's, or a score_mod's
        // bounds) narrow enough for one exp2 reference, ModParams::fixed_ref, for every
        // row and tile: no row maxima, no rescale (cupy_gqa/_mods.py: Modifiers.fixed_ref;
        // bf16 P, which has float32's exponents; the hopper kernels)
        FIXED_REF = (FLAGS & MOD_FIXED_REF) != 0,
        // hopper: the softmax waits for the last tile's P V (a score_mod in units whose code
        // does not fit the registers beside it; cupy_gqa/_compile.py: get_kernel)
        SERIAL_PV = (FLAGS & MOD_SERIAL_PV) != 0,
    };
    // the same masks, no score modifier
    typedef Mods<FLAGS & ~(MOD_SOFTCAP | MOD_ALIBI | MOD_SCORE | MOD_SCORE_UNIT | MOD_SERIAL_PV), HALF> MasksOnly;
};
typedef Mods<0> NoMods;

// Programmatic dependent launches (sm_90; cupy_gqa/_launch.py: a kernel launched as
// the dependent of the one before it). The first kernel lets the dependent's CTAs
// start once each of its own CTAs has run this (they then wait, not the launch) ...
__device__ __forceinline__ void allow_dependent_launch() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}
// ... and the dependent waits here until the first kernel has finished and its writes
// are visible. Both do nothing in a kernel not launched that way, and below sm_90.
__device__ __forceinline__ void wait_for_prior_kernel() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

// The hardware tanh (one MUFU instruction; relative error at most 2^-10.9, about
// fp16's rounding): softcap's in the kernels for fp16 and bf16 inputs, as
// cap * fast_tanh(x * (1 / cap)), where the exact tanhf and division would cost
// more than the matrix products. A user's score_mod may call it too.
__device__ __forceinline__ float fast_tanh(float x) {
#if __CUDA_ARCH__ >= 750
    float y;
    asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
#else
    return tanhf(x);
#endif
}

// The user modifiers (cupy_gqa.ScoreMod, cupy_gqa.MaskMod): cupy_gqa/_compile.py
// puts their code at the marker below; without them these are the identity.
// @user-mods@
#ifndef CUPY_GQA_USER_SCORE_MOD
template <typename A>
__device__ __forceinline__ A user_score_mod(A score, int, int, int, int, int, int, const ModParams&) { return score; }
#endif
#ifndef CUPY_GQA_USER_MASK_MOD
__device__ __forceinline__ bool user_mask_mod(int, int, int, int, int, int, const ModParams&) { return true; }
#endif

namespace mods {

// What the rules need of a sequence: its batch, lengths and diagonal.
struct Seq {
    int b, seqlen_q, len, diag;  // len: valid keys (>= 0); diag = len - seqlen_q
};
__device__ __forceinline__ Seq seq(int b, int seqlen_q, int len) { return {b, seqlen_q, len, len - seqlen_q}; }

// What they need of a row: query position t, query head h, its ALiBi slope,
// and its first and last visible key under the window and the causal and
// sequence bounds (last < first: none).
struct Row {
    int t, h, first, last;
    float slope;
};

// The keys [first, last] that the row of diagonal key c = t + diag sees under the
// sequence's end, the causal mask and the window (last < first: none), in
// [0, len] and [-1, len - 1]. (No overflow: -seqlen_q <= c < len, and len +
// seqlen_q fits an int.)
struct Bounds {
    int first, last;
};
template <class M>
__device__ __forceinline__ Bounds bounds(const ModParams& mp, const Seq& sq, int c, bool causal) {
    int first = 0, last = sq.len - 1;
    if (causal && c < last) last = c;
    if (M::WINDOW) {
        if (mp.window_left >= 0 && c > mp.window_left) first = c - mp.window_left;
        if (!causal && mp.window_right >= 0 && mp.window_right < last - c) last = c + mp.window_right;
    }
    return {min(first, sq.len), max(last, -1)};
}

// The key bounds of query t (causal: the causal end; window: its band).
template <class M>
__device__ __forceinline__ Row row(const ModParams& mp, const Seq& sq, int t, int h, bool causal) {
    const Bounds kb = bounds<M>(mp, sq, t + sq.diag, causal);
    float slope = 0.f;
    if (M::ALIBI) slope = mp.alibi[sq.b * mp.alibi_batch_stride + h];
    return {t, h, kb.first, kb.last, slope};
}

// A score in natural units (x = softmax_scale * q . k) after the score modifiers,
// in A's precision: the one rule of every kernel family. (Of query t, head h,
// ALiBi slope.) The tensor-core prefill kernels keep it in natural units and
// apply log2(e) inside their exp2 (softmax.cuh: frag_modify).
//
// A rule in units (the softcap; a score_mod with a unit) reads x / u, as the fp16 and bf16
// kernels compute it x * (1 / u), and its result counts in units of u.
template <class M, typename A>
__device__ __forceinline__ A to_unit(A x, double u) {
    if constexpr (M::FAST_TANH)
        return x * (1.f / (A)u);
    else
        return x / (A)u;
}
// The softcap's f, of a score in units of the cap (fp16 and bf16 inputs: fast_tanh).
template <class M, typename A>
__device__ __forceinline__ A softcap_f(A y) {
    if constexpr (M::FAST_TANH)
        return fast_tanh(y);
    else
        return tanh(y);
}
template <class M, typename A>
__device__ __forceinline__ A softcap_tanh(A x, const ModParams& mp) {  // tanh(x / cap)
    return softcap_f<M>(to_unit<M>(x, mp.softcap));
}
// The score modifiers' value and, with GRAD, their slope d score / d x in *grad
// (the softcap's 1 - tanh^2; 1 without a softcap): the backward pass's chain rule
// (kernels/backward.cu). A score_mod has no derivative here. dist: ALiBi's
// distance |t + diag - j| as A (the form below computes it; the tensor-core
// kernels' fragments count it in float from a key tile's first key: no
// conversion per score).
template <class M, bool GRAD, typename A>
__device__ __forceinline__ A score_nat_grad(A x, const ModParams& mp, const Seq& sq, int t, int h, float slope, int j,
                                            A dist, A* grad) {
    static_assert(!(GRAD && M::SCORE), "the backward pass takes no score_mod");
    if (M::SOFTCAP) {
        const A th = softcap_tanh<M>(x, mp);
        x = (A)mp.softcap * th;
        if (GRAD) *grad = (A)1 - th * th;
    } else if (GRAD) {
        *grad = (A)1;
    }
    // one rounding, spelled out: a multiply and a subtract are fused or not at ptxas' choice,
    // which may differ between two copies of the same loop
    if (M::ALIBI) x = fma(-(A)slope, dist, x);
    if (M::SCORE_UNIT)
        x = (A)mp.score_unit * user_score_mod<A>(to_unit<M>(x, mp.score_unit), sq.b, h, t, j, sq.seqlen_q, sq.len, mp);
    else if (M::SCORE)
        x = user_score_mod<A>(x, sq.b, h, t, j, sq.seqlen_q, sq.len, mp);
    return x;
}
template <class M, bool GRAD, typename A>
__device__ __forceinline__ A score_nat_grad(A x, const ModParams& mp, const Seq& sq, int t, int h, float slope, int j,
                                            A* grad) {
    const A dist = M::ALIBI ? (A)abs(t + sq.diag - j) : (A)0;
    return score_nat_grad<M, GRAD, A>(x, mp, sq, t, h, slope, j, dist, grad);
}
template <class M, typename A>
__device__ __forceinline__ A score_nat(A x, const ModParams& mp, const Seq& sq, int t, int h, float slope, int j) {
    return score_nat_grad<M, false, A>(x, mp, sq, t, h, slope, j, nullptr);
}
// The same from and to log2 units (s2 = softmax_scale * log2(e) * q . k): the
// CUDA-core kernels' form (rowwise, decode).
template <class M, typename A>
__device__ __forceinline__ A score_of(A s2, const ModParams& mp, const Seq& sq, int t, int h, float slope, int j) {
    if (!M::SCORES) return s2;
    return score_nat<M, A>(s2 * (A)0.69314718055994530942, mp, sq, t, h, slope, j) * (A)1.44269504088896340736;
}
template <class M, typename A>
__device__ __forceinline__ A score(A s2, const ModParams& mp, const Seq& sq, const Row& r, int j) {
    return score_of<M, A>(s2, mp, sq, r.t, r.h, r.slope, j);
}

// Whether row r sees key j (j in [0, len)): its bounds and mask_mod.
template <class M>
__device__ __forceinline__ bool visible(const ModParams& mp, const Seq& sq, const Row& r, int j) {
    bool ok = j >= r.first && j <= r.last;
    if (M::MASK) ok = ok && user_mask_mod(sq.b, r.h, r.t, j, sq.seqlen_q, sq.len, mp);
    return ok;
}

// The tensor-core prefill kernels (tiled, tiled_tf32) hold less of a row across
// their key loop, where registers are short: its diagonal key c = t + diag, its
// ALiBi slope (ALiBi) and its query head (score_mod, mask_mod); its key bounds
// are taken from c (bounds, above) where a tile is masked, and
// its head for the sink is recomputed after the loop. Unused fields cost nothing.
struct Diag {
    int c, h;
    float slope;
};
template <class M>
__device__ __forceinline__ Diag diag(const ModParams& mp, const Seq& sq, int t, int h) {
    Diag d = {t + sq.diag, 0, 0.f};
    if (M::SCORE || M::MASK) d.h = h;
    if (M::ALIBI) d.slope = mp.alibi[sq.b * mp.alibi_batch_stride + h];
    return d;
}
// Whether the row's mask_mod (if any) lets it see key j; and whether the row sees
// key j (j >= 0) at all: within its bounds, and let by the mask_mod.
template <class M>
__device__ __forceinline__ bool user_visible(const ModParams& mp, const Seq& sq, const Diag& r, int j) {
    return !M::MASK || user_mask_mod(sq.b, r.h, r.c - sq.diag, j, sq.seqlen_q, sq.len, mp);
}
template <class M, bool CAUSAL>
__device__ __forceinline__ bool visible(const ModParams& mp, const Seq& sq, const Diag& r, int j) {
    const Bounds kb = bounds<M>(mp, sq, r.c, CAUSAL);
    return j >= kb.first && j <= kb.last && user_visible<M>(mp, sq, r, j);
}
template <class M, typename A>
__device__ __forceinline__ A score_nat(A x, const ModParams& mp, const Seq& sq, const Diag& r, int j, A dist) {
    return score_nat_grad<M, false, A>(x, mp, sq, r.c - sq.diag, r.h, r.slope, j, dist, nullptr);
}
template <class M, typename A>
__device__ __forceinline__ A score_nat_grad(A x, const ModParams& mp, const Seq& sq, const Diag& r, int j, A& grad) {
    return score_nat_grad<M, true, A>(x, mp, sq, r.c - sq.diag, r.h, r.slope, j, &grad);
}

// The one rule in units of M::UNIT_ONLY: its unit, and its function f of a score in
// units (row r, key j): the softcap's tanh, or the score_mod.
template <class M>
__device__ __forceinline__ float unit_of(const ModParams& mp) {
    static_assert(M::UNIT_ONLY, "one score modifier, a rule in units");
    return (float)(M::SOFTCAP ? mp.softcap : mp.score_unit);
}
template <class M>
__device__ __forceinline__ float unit_rule(float x, const ModParams& mp, const Seq& sq, const Diag& r, int j) {
    static_assert(M::UNIT_ONLY, "one score modifier, a rule in units");
    if constexpr (M::SOFTCAP)
        return softcap_f<M>(x);
    else
        return user_score_mod<float>(x, sq.b, r.h, r.c - sq.diag, j, sq.seqlen_q, sq.len, mp);
}

// A sink in log2 units, for query head h (0 without sinks: unused).
template <class M, typename A>
__device__ __forceinline__ A sink2(const ModParams& mp, int h) {
    return M::SINKS ? (A)mp.sinks[h] * (A)1.44269504088896340736 : (A)0;
}
// (a kernel without modifiers has no sinks)
template <class M, typename A>
__device__ __forceinline__ A sink2(const NoModParams&, int) {
    return (A)0;
}

}  // namespace mods

// ---- asynchronous global -> shared copies (cp.async, sm_80+) ----------------
__device__ __forceinline__ unsigned smem_addr(const void* p) {
    return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

// 16-byte async copy global -> shared; when !pred nothing is read and the 16
// destination bytes are zero-filled (src-size 0).
__device__ __forceinline__ void cp_async_16(unsigned dst, const void* src, bool pred) {
    const int n = pred ? 16 : 0;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(n));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

// Four 8x8 matrices of 16-bit elements (or 8x4 of 32-bit ones) from shared
// memory; lanes 8i..8i+7 give the row addresses of matrix i, and lane l gets
// element (row l / 4, 32-bit column l % 4) of each matrix.
__device__ __forceinline__ void ldmatrix_x4(unsigned (&r)[4], unsigned addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}

// The same four 8x8 matrices, each transposed: lane l gets element
// (column l / 4, 16-bit row pair 2 (l % 4)) -- the B operand of P V from V's rows.
__device__ __forceinline__ void ldmatrix_x4_trans(unsigned (&r)[4], unsigned addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}

// ---- 16-bit tensor cores (tiled.cu, decode.cu) --------------------------------
// C(16x8, f32) += A(16x16, T, row-major) * B(16x8, T, column-major)
template <typename T>
__device__ __forceinline__ void mma_16816(float (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1);
template <>
__device__ __forceinline__ void mma_16816<__half>(float (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
template <>
__device__ __forceinline__ void mma_16816<__nv_bfloat16>(float (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// An int as a type: a width or a count chosen at compile time, passed to a
// generic lambda.
template <int N> struct Const {
    static constexpr int value = N;
};

// Two floats -> packed pair of T (lo in the low 16 bits).
template <typename T> __device__ __forceinline__ unsigned pack2(float lo, float hi);
template <> __device__ __forceinline__ unsigned pack2<__half>(float lo, float hi) {
    __half2 h = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<unsigned*>(&h);
}
template <> __device__ __forceinline__ unsigned pack2<__nv_bfloat16>(float lo, float hi) {
    __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<unsigned*>(&h);
}

// The A operand (m16k16: packed pairs of T) of k16 step kk of a product over an
// accumulator's columns (P V over the keys of S, the backward's dS K, P^T dO,
// dS^T Q): its C fragments of n8 tiles 2 kk and 2 kk + 1.
template <typename T, int NT>
__device__ __forceinline__ void acc_a_operand(const float (&c)[NT][4], int kk, unsigned (&a)[4]) {
    a[0] = pack2<T>(c[2 * kk][0], c[2 * kk][1]);              // row g,     columns 16 kk + 2 (lane % 4), + 1
    a[1] = pack2<T>(c[2 * kk][2], c[2 * kk][3]);              // row g + 8
    a[2] = pack2<T>(c[2 * kk + 1][0], c[2 * kk + 1][1]);      // row g,     columns 16 kk + 8 + 2 (lane % 4), + 1
    a[3] = pack2<T>(c[2 * kk + 1][2], c[2 * kk + 1][3]);      // row g + 8
}

// What acc_a_operand's rounding to T left of the same C fragments, rounded to T
// in turn (a = that operand): a and this hold the fragments to about twice T's
// precision.
template <typename T, int NT>
__device__ __forceinline__ void acc_a_rest(const float (&c)[NT][4], int kk, const unsigned (&a)[4], unsigned (&r)[4]) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
        const float* x = c[2 * kk + (e >> 1)] + 2 * (e & 1);  // the pair a[e] holds
        const T* h = reinterpret_cast<const T*>(&a[e]);
        r[e] = pack2<T>(x[0] - to_acc(h[0]), x[1] - to_acc(h[1]));
    }
}

// 2^x in one MUFU.EX2 (ex2.approx.ftz: 2^-inf = 0, NaN stays NaN; 2 ulp).
__device__ __forceinline__ float fast_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}
