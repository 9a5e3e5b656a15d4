// tiled_f32.cuh: what the float32 tiled kernels share (kernels/tiled_tf32.cu,
// split TF32; kernels/tiled_f16x2.cu, fp16 pairs), written once. Both hold
// one m16 block of rows per warp (g = lane / 4 and g + 8 of the warp's 16) and
// update the online softmax eagerly with exact exponentials (softmax.cuh).
#pragma once
#include "common.cuh"
#include "softmax.cuh"

namespace f32_tiled {

// The softmax step of key tile [n0, n0 + BLOCK_N) on the warp's scores s (raw:
// the update multiplies by ``scale`` inside its exp2): without modifiers the
// mask, on tiles that cross the diagonal or the end of the keys; with them the
// modifiers (softmax.cuh: frag_modify); then the eager update of o, m and l.
// ``row``: the packed row of the lane's first row (g).
template <class M, bool CAUSAL, int BLOCK_N, int NT, int DT, class Keys>
__device__ __forceinline__ void tile_update(float (&s)[NT][4], float (&o)[DT][4], float (&m)[2], float (&l)[2], int n0,
                                            int row, int lane, const Keys& keys, const ModParams& mp,
                                            const mods::Seq& sq, const mods::Diag (&mrow)[2], float scale) {
    if constexpr (!M::ANY) {
        if (n0 + BLOCK_N > keys.free) {
            int last[2];  // last visible key of each of the lane's rows
#pragma unroll
            for (int hf = 0; hf < 2; ++hf) last[hf] = keys.last_key(row + hf * 8);
            softmax::frag_mask(s, n0, lane, last);
        }
        softmax::frag_update<0, true>(s, o, m, l, scale, softmax::ExactExp2());
    } else {
        const float sc = softmax::frag_modify<M, CAUSAL>(s, n0, BLOCK_N, lane, mp, sq, mrow, keys, scale);
        softmax::frag_update<0, true>(s, o, m, l, sc, softmax::ExactExp2());
    }
}

// The epilogue of a warp: out = o / l * unscale(.) for its 16 rows (packed rows
// row_w ..), through its rows sO (ROWF floats each) of shared memory that no
// other warp uses any more, then 16-byte stores; lse of each row. ``unscale``
// maps each of o's elements once it is divided by l (the pairs' scales; the
// identity for split TF32), ``inv_scale`` multiplies 1 / l.
template <class M, int D, int ROWF, int ADDR, class Unscale>
__device__ __forceinline__ void store_rows(float* sO, const float (&o)[D / 8][4], float (&l_run)[2], float (&m_run)[2],
                                           float inv_scale, Unscale unscale, float* __restrict__ out,
                                           float* __restrict__ lse, const AttnParams& p, const ModParams& mp,
                                           const Sequence<ADDR>& sqn, int b, int kvh, int group, int row_w,
                                           int packed_rows, int len, int lane) {
    constexpr int CH = D / 4;  // 16-byte chunks per row
    const int g_lane = lane >> 2, c_lane = lane & 3;
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
        float l;
        const float inv = softmax::frag_row_end<M::SINKS>(l_run[hf], m_run[hf], l, len < 0, [&] {
            return mods::sink2<M, float>(mp, q_head_of(kvh, (row_w + g_lane + hf * 8) % group, group));
        }) * inv_scale;
        const int r = g_lane + hf * 8;
#pragma unroll
        for (int dt = 0; dt < D / 8; ++dt) {
            sO[r * ROWF + dt * 8 + c_lane * 2] = unscale(o[dt][2 * hf] * inv);
            sO[r * ROWF + dt * 8 + c_lane * 2 + 1] = unscale(o[dt][2 * hf + 1] * inv);
        }
        const int pr = row_w + r;
        if (lse != nullptr && c_lane == 0 && pr < packed_rows) {
            const int t = pr / group, g = pr % group;
            lse[sqn.lse_at(kvh, g, group, t, p.num_q_heads, p.seqlen_q)] = softmax::lse(m_run[hf], l, len < 0);
        }
    }
    __syncwarp();
#pragma unroll
    for (int i = 0; i < (16 * CH + 31) / 32; ++i) {
        const int c = lane + i * 32, r = c / CH, ch = c % CH;
        const int pr = row_w + r;
        if (((16 * CH) % 32 == 0 || c < 16 * CH) && pr < packed_rows) {
            const int t = pr / group, g = pr % group;
            float* dst = out + b * p.o_stride[0] + (index_t)(sqn.q0() + t) * p.o_stride[1] + q_head_of(kvh, g, group) * p.o_stride[2] + ch * 4;
            *reinterpret_cast<float4*>(dst) = *reinterpret_cast<const float4*>(sO + r * ROWF + ch * 4);
        }
    }
}

}  // namespace f32_tiled
