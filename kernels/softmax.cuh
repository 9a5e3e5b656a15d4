// softmax.cuh: the online-softmax rules every kernel follows, written once.
//
// Log2 domain. A score is s = (q . k) * softmax_scale * log2(e). A key that a
// row must not see (past its causal end, past the sequence or the key range)
// gets s = -inf after the scaling, so that it weighs exp2(-inf) = 0 whatever
// the scale, 0 included. (A kernel whose scale is > 0, checked on the host,
// may mask first and multiply inside the exp2: -inf * scale is still -inf.)
//
// Per row the state is (m, l, o): the reference m (the running max of the
// scores, or, with the lazy rescale, up to 2^threshold below it), and
//     l = sum_j exp2(s_j - m),   o = sum_j exp2(s_j - m) v_j.
// Update with new scores s_j:
//     m'    = max(m, max_j s_j)          (lazy: only when max_j s_j > m + threshold)
//     alpha = exp2(m - ref(m')),  p_j = exp2(s_j - ref(m'))
//     l'    = l alpha + sum_j p_j,  o' = o alpha + sum_j p_j v_j
// where ref(m) = m, except 0 while the row has seen no key (m = -inf), so that
// no (-inf) - (-inf) makes a NaN. Merging two states (key groups, warps,
// splits) is the same rule with the other side's m in place of max_j s_j.
// End of a row: out = o / l, lse = (m + log2 l) ln 2 (natural log); a row that
// saw no key writes out 0 and lse -inf; a row of a sequence whose length is
// bad (seqlens_k[b] outside [0, seqlen_k]) writes NaN, out and lse.
#pragma once
#include "common.cuh"

namespace softmax {

template <typename A> __host__ __device__ constexpr A ln2() { return A(0.69314718055994530942); }
template <typename A> __host__ __device__ constexpr A log2e() { return A(1.44269504088896340736); }

// The exp2 of the scores, as a type: ex2.approx (float; 2^-inf = 0) or exact.
struct FastExp2 {
    __device__ __forceinline__ float operator()(float x) const { return fast_exp2(x); }
};
struct ExactExp2 {  // exp2f, or exp2 in double
    template <typename A> __device__ __forceinline__ A operator()(A x) const { return exp2_acc(x); }
};

// The reference that exp2 subtracts: m, or 0 while the row has seen no key.
template <typename A> __device__ __forceinline__ A ref(A m) { return m == neg_inf<A>() ? (A)0 : m; }

// A row's move to the reference m_new (>= m): m = m_new; returns the factor
// alpha = exp2(m_old - ref(m_new)) for l and o (0 while m_old = -inf).
template <typename A, class Exp2> __device__ __forceinline__ A raise_ref(A& m, A m_new, Exp2 exp2) {
    const A alpha = exp2(m - ref(m_new));
    m = m_new;
    return alpha;
}

// Weights of two states (m, ..) and (m_b, ..) in their merge, and its m.
// A side with m = -inf (no key) weighs 0.
__device__ __forceinline__ void merge_weights(float m, float m_b, float& m_new, float& wa, float& wb) {
    m_new = fmaxf(m, m_b);
    const float m_ref = ref(m_new);
    wa = exp2f(m - m_ref);
    wb = exp2f(m_b - m_ref);
}

// Merge the state (m, l, o[0..N)) of this lane with that of lane ^ off (a
// __shfl_xor_sync over the lanes of mask): both lanes end with the merged state.
template <int N>
__device__ __forceinline__ void shfl_merge(unsigned mask, int off, float& m, float& l, float (&o)[N]) {
    const float m_b = __shfl_xor_sync(mask, m, off);
    const float l_b = __shfl_xor_sync(mask, l, off);
    float m_new, wa, wb;
    merge_weights(m, m_b, m_new, wa, wb);
    l = l * wa + l_b * wb;
#pragma unroll
    for (int d = 0; d < N; ++d) {
        const float o_b = __shfl_xor_sync(mask, o[d], off);
        o[d] = o[d] * wa + o_b * wb;
    }
    m = m_new;
}

// The weight of a state (m_s, ..) in a merge of several whose largest m is
// m_max (all -inf: no side saw a key, and each weighs 0).
__device__ __forceinline__ float merge_weight(float m_s, float m_max) { return exp2f(m_s - ref(m_max)); }

// ---- the end of a row ------------------------------------------------------------
// seen: the row saw some key (else out 0, lse -inf); bad: its sequence length is
// bad (out and lse NaN). Where seen is not given it is l > 0: the largest score
// a row saw weighs exp2(s - m) >= 1 in l. (The test is made after the bad one,
// as written here: a seen computed up front changes the epilogue's branches.)
// out = o * out_scale(l, ..)
template <typename A> __device__ __forceinline__ A out_scale(A l, bool seen, bool bad) {
    return bad ? (A)quiet_nan() : seen ? (A)1 / l : (A)0;
}
template <typename A> __device__ __forceinline__ A out_scale(A l, bool bad) {
    return bad ? (A)quiet_nan() : l > (A)0 ? (A)1 / l : (A)0;
}
// lse in log2 units (a split's partial result), and natural, as the kernels write it
template <typename A> __device__ __forceinline__ A lse2(A m, A l, bool seen) {
    return seen ? m + log2_acc(l) : neg_inf<A>();
}
template <typename A> __device__ __forceinline__ float lse(A m, A l, bool seen, bool bad) {
    return bad ? quiet_nan() : seen ? (float)((m + log2_acc(l)) * ln2<A>()) : neg_inf<float>();
}
template <typename A> __device__ __forceinline__ float lse(A m, A l, bool bad) {
    return bad ? quiet_nan() : l > (A)0 ? (float)((m + log2_acc(l)) * ln2<A>()) : neg_inf<float>();
}

// ---- sinks (common.cuh: modifiers) ----------------------------------------------
// A row's state (m, l) at its end takes the sink s (log2 units) as one more
// score that adds no value: m' = max(m, s), l' = l exp2(m - m') + exp2(s - m');
// returns exp2(m - m'), the factor of o (0 for a row that saw no key, whose
// out stays 0 while its lse becomes the sink's). Then every row has l > 0.
template <typename A> __device__ __forceinline__ A fold_sink(A& m, A& l, A s) {
    const A m_new = s > m ? s : m;  // a NaN sink keeps m, and NaN reaches l below
    const A alpha = exp2_acc(m - m_new);
    l = l * alpha + exp2_acc(s - m_new);
    m = m_new;
    return alpha;
}

// ---- tensor-core fragments ---------------------------------------------------------
// An m16n8 accumulator fragment float[4] holds, in lane (g = lane / 4, c = lane % 4),
// elements (row g, cols 2c, 2c+1) (e = 0, 1) and (row g + 8, same cols) (e = 2, 3):
// row hf of the lane is elements 2 hf, 2 hf + 1, and the quad (4 lanes) shares the row.
// S: s[NT][4], NT n8 tiles of keys; O: o[DT][4], DT n8 tiles of dims; per row
// hf: m[hf], l[hf] (l: the lane's partial sum, reduced over the quad at the end).

// Scores of keys past last[hf] (row hf's last visible key) become -inf; element
// (nt, e) is key key0 + 8 nt + 2 (lane % 4) + (e & 1).
template <int NT>
__device__ __forceinline__ void frag_mask(float (&s)[NT][4], int key0, int lane, const int (&last)[2]) {
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e)
            if (key0 + nt * 8 + (lane & 3) * 2 + (e & 1) > last[e >> 1]) s[nt][e] = neg_inf<float>();
}

// The modifiers on a fragment of scores in log2 units (common.cuh: mods): the
// score modifiers (on the keys the row sees: a user's score_mod never runs on
// a masked key), and (when ``mask``) keys that row hf does not see become -inf; element (nt, e) is key key0 + 8 nt + 2 (lane % 4) + (e & 1) of row e / 2.
template <class M, int NT>
__device__ __forceinline__ void frag_mods(float (&s)[NT][4], int key0, int lane, const ModParams& mp,
                                          const mods::Seq& sq, const mods::Row (&row)[2], bool mask) {
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int j = key0 + nt * 8 + (lane & 3) * 2 + (e & 1);
            const mods::Row& r = row[e >> 1];
            s[nt][e] = (mask && !mods::visible<M>(mp, sq, r, j)) ? neg_inf<float>() : mods::score<M>(s[nt][e], mp, sq, r, j);
        }
}

// The same for the tensor-core prefill kernels, with the rows held as mods::Diag,
// on scores in natural units (mods::score_nat). ALiBi's distance |c - j| is counted
// in float from the row's c - key0 - 2 (lane % 4), which the unmasked tile's loop
// converts once a row (the masked loop, a branch per score, once a score): the same
// value as a conversion per score while |c - j| < 2^24.
// The row's bounds (mods::visible) are taken once a tile, relative to the lane's first
// key: element (nt, e) is then in them when its constant offset 8 nt + (e & 1) is, two
// comparisons a score.
template <class M, bool CAUSAL, int NT>
__device__ __forceinline__ void frag_mods(float (&s)[NT][4], int key0, int lane, const ModParams& mp,
                                          const mods::Seq& sq, const mods::Diag (&row)[2], bool mask) {
    const int base = key0 + (lane & 3) * 2;  // the lane's first key
    int lo[2], hi[2];
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
        const mods::Bounds kb = mods::bounds<M>(mp, sq, row[hf].c, CAUSAL);
        lo[hf] = kb.first - base;
        hi[hf] = kb.last - base;
    }
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int c = nt * 8 + (e & 1), j = base + c;
            const mods::Diag& r = row[e >> 1];
            const float dist = M::ALIBI ? fabsf((float)(r.c - base) - (float)c) : 0.f;
            const bool seen = c >= lo[e >> 1] && c <= hi[e >> 1] && mods::user_visible<M>(mp, sq, r, j);
            s[nt][e] = (mask && !seen) ? neg_inf<float>() : mods::score_nat<M>(s[nt][e], mp, sq, r, j, dist);
        }
}

// The raw scores of a tile in natural units (softmax_scale * q . k), as the score
// modifiers take them (scale_log2 = softmax_scale * log2(e)).
template <int NT>
__device__ __forceinline__ void frag_to_natural(float (&s)[NT][4], float scale_log2) {
    const float scale = scale_log2 * ln2<float>();  // softmax_scale
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[nt][e] *= scale;
}

// Row hf's max of s over the quad: a tree of pairwise maxima, log2(2 NT) deep
// where a running max is a chain of NT dependent instructions (each waiting
// for the last). fmaxf drops a NaN operand, so the order changes nothing; the
// -inf last makes a row of NaNs -inf, as a running max from -inf does.
template <int NT>
__device__ __forceinline__ float frag_row_max(const float (&s)[NT][4], int hf) {
    float v[NT];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) v[nt] = fmaxf(s[nt][2 * hf], s[nt][2 * hf + 1]);
#pragma unroll
    for (int w = 1; w < NT; w *= 2)
#pragma unroll
        for (int nt = 0; nt + w < NT; nt += 2 * w) v[nt] = fmaxf(v[nt], v[nt + w]);
    float mx = fmaxf(v[0], neg_inf<float>());
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    return mx;
}

// frag_modify for one score modifier that is a rule in units, x = u * f(x / u)
// (M::UNIT_ONLY: the softcap, f = tanh, u = cap; or a score_mod with a unit): the raw
// scores s become s * (softmax_scale / u), in units of u at one multiply, and the
// returned exp2 scale is u * log2(e), so that P = exp2(f * u * log2(e) - m): where
// scaling to natural units, dividing by u and multiplying by it took three multiplies a
// score, this takes one, and a score_mod spelling the softcap in units (f = fast_tanh,
// u = cap) computes the very same. The raw scores are masked first (masks read no
// score); the rows' maxima in mx (MAXIMA, the softcap only: it is monotone, so the tanh
// of the raw maxima are the rows' largest f, and the exponentials need not wait for every
// tanh; without, for one fixed reference or the maxima of f taken after, none). f runs on
// the visible scores only; masked ones stay -inf (P 0), and an unmasked tile takes no
// mask test per score.
template <class M, bool CAUSAL, bool MAXIMA = true, int NT, class Keys>
__device__ __forceinline__ float frag_unit(float (&s)[NT][4], float (&mx)[2], int n0, int n, int lane,
                                           const ModParams& mp, const mods::Seq& sq, const mods::Diag (&row)[2],
                                           const Keys& keys, float scale_log2) {
    static_assert(M::UNIT_ONLY, "one score modifier, a rule in units");
    static_assert(!MAXIMA || M::SOFTCAP_ONLY, "the maxima before f need a monotone f");
    const float u = mods::unit_of<M>(mp);
    const float scale_over_u = scale_log2 * ln2<float>() / u;  // softmax_scale / u
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[nt][e] *= scale_over_u;
    const bool mask = M::MASK || !keys.unmasked(n0, n);
    if (mask) frag_mods<typename M::MasksOnly, CAUSAL>(s, n0, lane, mp, sq, row, true);
    if constexpr (MAXIMA) {
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
            const float raw = frag_row_max(s, hf);
            mx[hf] = raw == neg_inf<float>() ? raw : mods::unit_rule<M>(raw, mp, sq, row[hf], 0);
        }
    }
    auto rule = [&](int nt, int e) {
        const int j = n0 + nt * 8 + (lane & 3) * 2 + (e & 1);
        return mods::unit_rule<M>(s[nt][e], mp, sq, row[e >> 1], j);
    };
    if (mask) {
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e)
                if (s[nt][e] != neg_inf<float>()) s[nt][e] = rule(nt, e);
    } else {  // (no score was masked: f of every one)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) s[nt][e] = rule(nt, e);
    }
    return u * log2e<float>();
}

// The modifiers' step of a tensor-core kernel on the raw scores of the key tile
// [n0, n0 + n), before its softmax update: scores to natural units first when the
// score modifiers change them, then the score modifiers and, on a tile that some
// row may not fully see (keys.unmasked) or with a mask_mod, the mask. Returns the
// scale the update applies inside its exp2 (s * scale - ref): log2(e) on the
// modified scores, scale_log2 on the raw ones, u * log2(e) on a rule's in units.
// TWO_LOOPS: the masked and the unmasked tile take a loop each (as frag_unit), so
// that an unmasked tile makes no mask test per score (ALiBi 1.4 to 1.6 times faster at
// head dim 128); false: one loop that tests a tile's mask flag per score, for a kernel
// whose registers do not hold the second copy (hopper's three consumer warpgroups
// with a window).
template <class M, bool CAUSAL, bool TWO_LOOPS = true, int NT, class Keys>
__device__ __forceinline__ float frag_modify(float (&s)[NT][4], int n0, int n, int lane, const ModParams& mp,
                                            const mods::Seq& sq, const mods::Diag (&row)[2], const Keys& keys,
                                            float scale_log2) {
    if constexpr (M::UNIT_ONLY) {  // one rule in units (the softcap, a score_mod in units): frag_unit
        float unused[2];
        return frag_unit<M, CAUSAL, false>(s, unused, n0, n, lane, mp, sq, row, keys, scale_log2);
    }
    const bool mask = M::MASK || !keys.unmasked(n0, n);
    if constexpr (M::SCORES) frag_to_natural(s, scale_log2);
    if constexpr (TWO_LOOPS) {
        if (mask)
            frag_mods<M, CAUSAL>(s, n0, lane, mp, sq, row, true);
        else if constexpr (M::SCORES)
            frag_mods<M, CAUSAL>(s, n0, lane, mp, sq, row, false);
    } else if (M::SCORES || mask) {
        frag_mods<M, CAUSAL>(s, n0, lane, mp, sq, row, mask);
    }
    return M::SCORES ? log2e<float>() : scale_log2;
}

// Row sum over the quad of the lanes' partial l.
__device__ __forceinline__ float frag_row_sum(float l) {
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    return l;
}

// The end of a fragment row, for the epilogue: l becomes the row's sum over the
// quad (from the lane's part l_lane); with SINKS the sink (sink(): log2 units)
// joins the denominator, m and l becoming the row's with it (fold_sink).
// Returns the factor that normalises the row (out = o * factor: NaN for a bad
// length, 0 for a row that saw no key).
template <bool SINKS, class Sink>
__device__ __forceinline__ float frag_row_end(float l_lane, float& m, float& l, bool bad, Sink sink) {
    l = frag_row_sum(l_lane);
    if constexpr (SINKS) {
        const float alpha = fold_sink(m, l, sink());
        return out_scale(l, bad) * alpha;
    }
    return out_scale(l, bad);
}

// Row hf of s becomes P = exp2(s - m_ref) (SCALE_IN_EXP2: exp2(s * scale - m_ref));
// returns the lane's part of rowsum(P), summed from the first pair (no 0 + ..).
template <bool SCALE_IN_EXP2, int NT, class Exp2>
__device__ __forceinline__ float frag_row_probabilities(float (&s)[NT][4], int hf, float m_ref, float scale, Exp2 exp2) {
    float rs;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
        const float x0 = s[nt][2 * hf], x1 = s[nt][2 * hf + 1];
        const float p0 = exp2(SCALE_IN_EXP2 ? fmaf(x0, scale, -m_ref) : x0 - m_ref);
        const float p1 = exp2(SCALE_IN_EXP2 ? fmaf(x1, scale, -m_ref) : x1 - m_ref);
        s[nt][2 * hf] = p0;
        s[nt][2 * hf + 1] = p1;
        rs = nt == 0 ? p0 + p1 : rs + (p0 + p1);
    }
    return rs;
}

// One tile's update (see the top) of the lane's rows in MT m16 blocks: s
// becomes P in place. SCALE_IN_EXP2: s is unscaled and scale (> 0) is applied
// inside the exp2 (s * scale - ref); else s is already scaled. LAZY > 0: m is
// raised only when some row of the warp sees a score more than LAZY above it
// (warp-uniform branch; P <= 2^LAZY meanwhile); 0: at every tile.
template <int LAZY, bool SCALE_IN_EXP2, int MT, int NT, int DT, class Exp2>
__device__ __forceinline__ void frag_update(float (&s)[MT][NT][4], float (&o)[MT][DT][4], float (&m)[MT][2],
                                            float (&l)[MT][2], float scale, Exp2 exp2) {
    float mxs[MT][2];  // rowmax(S), scaled
    bool rescale = true;
    if constexpr (LAZY > 0) {  // all rows' maxima first, for the warp's vote
        bool grow = false;
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int hf = 0; hf < 2; ++hf) {
                const float mx = frag_row_max(s[mt], hf);
                mxs[mt][hf] = SCALE_IN_EXP2 ? mx * scale : mx;
                grow |= mxs[mt][hf] > m[mt][hf] + (float)LAZY;
            }
        rescale = __any_sync(0xffffffffu, grow);
    }
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
            if constexpr (LAZY == 0) {  // each row's max where it is used
                const float mx = frag_row_max(s[mt], hf);
                mxs[mt][hf] = SCALE_IN_EXP2 ? mx * scale : mx;
            }
            if (rescale) {
                const float alpha = raise_ref(m[mt][hf], fmaxf(m[mt][hf], mxs[mt][hf]), exp2);
                l[mt][hf] *= alpha;
#pragma unroll
                for (int dt = 0; dt < DT; ++dt) {
                    o[mt][dt][2 * hf] *= alpha;
                    o[mt][dt][2 * hf + 1] *= alpha;
                }
            }
            l[mt][hf] += frag_row_probabilities<SCALE_IN_EXP2>(s[mt], hf, ref(m[mt][hf]), scale, exp2);
        }
}

// The same for one m16 block (MT = 1) held without the block index.
template <int LAZY, bool SCALE_IN_EXP2, int NT, int DT, class Exp2>
__device__ __forceinline__ void frag_update(float (&s)[NT][4], float (&o)[DT][4], float (&m)[2], float (&l)[2],
                                            float scale, Exp2 exp2) {
    frag_update<LAZY, SCALE_IN_EXP2>(reinterpret_cast<float(&)[1][NT][4]>(s), reinterpret_cast<float(&)[1][DT][4]>(o),
                                     reinterpret_cast<float(&)[1][2]>(m), reinterpret_cast<float(&)[1][2]>(l), scale,
                                     exp2);
}

// The same update in two halves, for a kernel whose O is still being written by
// the tensor cores while P is computed (hopper.cu): frag_probabilities raises m
// (lazily, LAZY > 0) and turns s into P, returning whether the warp raised its
// reference, with the factors in alpha and the lane's row sums in rs;
// frag_rescale then brings O and l along once O is free.
// (row_max(hf): row hf's maximum of s; frag_probabilities_max below takes them given.)
template <int LAZY, bool SCALE_IN_EXP2, int NT, class RowMax, class Exp2>
__device__ __forceinline__ bool frag_probabilities_by(float (&s)[NT][4], RowMax row_max, float (&m)[2],
                                                      float (&alpha)[2], float (&rs)[2], float scale, Exp2 exp2) {
    static_assert(LAZY >= 0, "LAZY: a threshold in log2 units");
    float mxs[2];
    bool grow = false;
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
        const float mx = row_max(hf);
        mxs[hf] = SCALE_IN_EXP2 ? mx * scale : mx;
        grow |= mxs[hf] > m[hf] + (float)LAZY;
    }
    const bool rescale = __any_sync(0xffffffffu, grow);
    // The exponentials are written into both arms of the branch: ptxas schedules
    // within a basic block, and in one after the branch it may hoist the caller's
    // next wait (for the tensor cores writing O) above them.
    if (rescale) {
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
            alpha[hf] = raise_ref(m[hf], fmaxf(m[hf], mxs[hf]), exp2);
            rs[hf] = frag_row_probabilities<SCALE_IN_EXP2>(s, hf, ref(m[hf]), scale, exp2);
        }
    } else {
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) rs[hf] = frag_row_probabilities<SCALE_IN_EXP2>(s, hf, ref(m[hf]), scale, exp2);
    }
    return rescale;
}
template <int LAZY, bool SCALE_IN_EXP2, int NT, class Exp2>
__device__ __forceinline__ bool frag_probabilities(float (&s)[NT][4], float (&m)[2], float (&alpha)[2], float (&rs)[2],
                                                   float scale, Exp2 exp2) {
    return frag_probabilities_by<LAZY, SCALE_IN_EXP2>(s, [&](int hf) { return frag_row_max(s, hf); }, m, alpha, rs,
                                                      scale, exp2);
}
template <int LAZY, bool SCALE_IN_EXP2, int NT, class Exp2>
__device__ __forceinline__ bool frag_probabilities_max(float (&s)[NT][4], const float (&mx)[2], float (&m)[2],
                                                       float (&alpha)[2], float (&rs)[2], float scale, Exp2 exp2) {
    return frag_probabilities_by<LAZY, SCALE_IN_EXP2>(s, [&](int hf) { return mx[hf]; }, m, alpha, rs, scale, exp2);
}

// The update of a tile whose scores lie in a known range (Mods::FIXED_REF): every
// row takes the one reference m_ref (log2 units, between the range's ends), so P =
// exp2(s * scale - m_ref) needs no row maxima and O and l are never rescaled; the
// lane's row sums in rs. m becomes m_ref (the epilogue's lse, a sink's share).
// Returns false: no rescale.
template <int NT, class Exp2>
__device__ __forceinline__ bool frag_probabilities_fixed(float (&s)[NT][4], float m_ref, float (&m)[2], float (&rs)[2],
                                                         float scale, Exp2 exp2) {
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
        m[hf] = m_ref;
        rs[hf] = frag_row_probabilities<true>(s, hf, m_ref, scale, exp2);
    }
    return false;
}

template <int DT>
__device__ __forceinline__ void frag_rescale(float (&o)[DT][4], float (&l)[2], bool rescale, const float (&alpha)[2],
                                             const float (&rs)[2]) {
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
        if (rescale) {
            l[hf] *= alpha[hf];
#pragma unroll
            for (int dt = 0; dt < DT; ++dt) {
                o[dt][2 * hf] *= alpha[hf];
                o[dt][2 * hf + 1] *= alpha[hf];
            }
        }
        l[hf] += rs[hf];
    }
}

}  // namespace softmax
