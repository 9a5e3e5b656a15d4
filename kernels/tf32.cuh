// tf32.cuh: float32 products on the TF32 tensor cores at fp32 accuracy (split
// TF32), written once for the kernels that multiply float32 tiles with
// mma.sync m16n8k8 (kernels/tiled_tf32.cu, the float32 backward in
// kernels/backward.cu).
//
// A TF32 number keeps 10 of fp32's 23 mantissa bits. Each fp32 operand is
// split into a TF32 "big" part and the TF32 rounding of the rest,
//     x = big(x) + small(x),   big = tf32(x),   small = tf32(x - big),
// and each product a*b becomes three TF32 products accumulated in fp32,
//     a*b ~= small(a)*big(b) + big(a)*small(b) + big(a)*big(b)
// (small*small, ~2^-22 relative, is dropped). The tensor cores add into the
// accumulator with truncation, so a long chain of mma into one register drifts
// (one-sided): callers sum short chains in fresh accumulators, in IEEE fp32.
//
// Fragments (m16n8k8, g = lane / 4, c = lane % 4)
//   A (16x8): a0 (g, c), a1 (g+8, c), a2 (g, c+4), a3 (g+8, c+4)
//   B (8x8):  b0 (k c, n g), b1 (k c+4, n g);  C: (g, 2c), (g, 2c+1), (g+8, ..)
// ldmatrix reads an 8x8 matrix of 16-bit elements, which is an 8x4 matrix of
// fp32, and hands lane l element (l / 4, l % 4) of it: exactly an A fragment's
// quarter, or a B fragment of a matrix stored with its n index along rows.
// An accumulator (C layout) becomes an A operand with key 2c as k = c and key
// 2c+1 as k = c+4 (a sum over k may run in any order): frag_a below; the B
// operand of such a product is then read as b0 = B[2c][g], b1 = B[2c+1][g].
#pragma once
#include "common.cuh"

// The split rounds to TF32 with integer ops, (bits + 0x1000) with the low 13
// bits masked where the value itself is needed (x - big): 4 instructions per
// split element instead of the 7 that cvt.rna.tf32 + sub + cvt.rna become in
// SASS (an inf/NaN test and select per cvt). Same values for finite x; the mma
// ignores an operand's low 13 bits either way (F1 -11%, F2 -6% on the H200,
// benchmarks/NOTES.md item 11).

namespace tf32_detail {

// k8 steps whose products go into one fresh accumulator before it is added,
// in IEEE fp32, to the running sum (see the top: the truncating adds).
enum : int { KG = 4 };  // (an enum: a namespace-scope constexpr variable would be a global in every program)

// x = big + small, both TF32 (small = 0 when !SPLIT, and unused)
template <bool SPLIT>
__device__ __forceinline__ void split(float x, unsigned& big, unsigned& small) {
    // round to nearest, ties away, in the magnitude bits: add half a TF32 ulp and
    // drop the 13 low bits (mask for x - big; the mma ignores them for small)
    big = (__float_as_uint(x) + 0x1000u) & 0xffffe000u;
    small = SPLIT ? __float_as_uint(x - __uint_as_float(big)) + 0x1000u : 0u;
}

// C(16x8) += A(16x8) * B(8x8), TF32 inputs, fp32 accumulate
__device__ __forceinline__ void mma_1688(float (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// C += A * B in split TF32 (small terms first, then big * big) or plain TF32.
template <bool SPLIT>
__device__ __forceinline__ void mma_f32(float (&c)[4], const unsigned (&ab)[4], const unsigned (&as)[4],
                                        unsigned bb0, unsigned bb1, unsigned bs0, unsigned bs1) {
    if (SPLIT) {
        mma_1688(c, as, bb0, bb1);
        mma_1688(c, ab, bs0, bs1);
    }
    mma_1688(c, ab, bb0, bb1);
}

// The same three products with the operands' roles swapped: C^T += B^T A^T
// (here ab/as are B^T's parts, bb/bs A^T's) in the order of mma_f32's C += A B,
// small(A) big(B) first. Each element then gets the same three terms in the same
// order: the bits of C, transposed (a kernel that computes S^T = K Q^T matches
// one that computes S = Q K^T).
template <bool SPLIT>
__device__ __forceinline__ void mma_f32_swapped(float (&c)[4], const unsigned (&ab)[4], const unsigned (&as)[4],
                                                unsigned bb0, unsigned bb1, unsigned bs0, unsigned bs1) {
    if (SPLIT) {
        mma_1688(c, ab, bs0, bs1);
        mma_1688(c, as, bb0, bb1);
    }
    mma_1688(c, ab, bb0, bb1);
}

// The A operand (big and small parts) of an accumulator tile c (C layout,
// 16 x 8, keys along n) for a product over its keys: key 2c is k = c, key
// 2c+1 is k = c+4 (see the top).
template <bool SPLIT>
__device__ __forceinline__ void frag_a(const float (&c)[4], unsigned (&big)[4], unsigned (&small)[4]) {
    split<SPLIT>(c[0], big[0], small[0]);
    split<SPLIT>(c[2], big[1], small[1]);
    split<SPLIT>(c[1], big[2], small[2]);
    split<SPLIT>(c[3], big[3], small[3]);
}

// An A operand (or a B operand stored along its n index) of one k8 step from
// shared memory through ldmatrix, at ``addr``: PRE, split beforehand (the big
// parts there, the small ones ``small_off`` bytes on: split_chunk_in_place);
// else raw values, split here.
template <bool PRE, bool SPLIT = true>
__device__ __forceinline__ void ldmatrix_split(unsigned (&big)[4], unsigned (&small)[4], unsigned addr, int small_off) {
    if (PRE) {
        ldmatrix_x4(big, addr);
        ldmatrix_x4(small, addr + small_off);
    } else {
        unsigned raw[4];
        ldmatrix_x4(raw, addr);
#pragma unroll
        for (int e = 0; e < 4; ++e) split<SPLIT>(__uint_as_float(raw[e]), big[e], small[e]);
    }
}

// The B operand of a product whose A comes from an accumulator (frag_a): of the
// k8 step whose rows start at x (the lane's element, row 2c and column g of a
// matrix ROW floats a row), b0 = X[2c][g] and b1 = X[2c+1][g] (scalar shared
// loads), big and small; PRE as for ldmatrix_split (xs: the small parts' copy).
template <bool PRE, int ROW, bool SPLIT = true>
__device__ __forceinline__ void frag_b_rows(const float* x, const float* xs, unsigned& b0, unsigned& b1, unsigned& s0,
                                            unsigned& s1) {
    if (PRE) {
        b0 = __float_as_uint(x[0]);
        b1 = __float_as_uint(x[ROW]);
        s0 = __float_as_uint(xs[0]);
        s1 = __float_as_uint(xs[ROW]);
    } else {
        split<SPLIT>(x[0], b0, s0);
        split<SPLIT>(x[ROW], b1, s1);
    }
}

// acc += A X (the forward's O += P V; the backward's dQ += dS K, dV += P^T dO,
// dK += dS^T Q): A (16 rows x 8 NT, an accumulator: frag_a) against the rows
// of X of the same k index (x, xs: the lane's element of X's big and small
// parts, row 2c and column g of its first n8 tile; DT n8 tiles of X's columns;
// PRE: X split beforehand, else raw at x), each n8 tile's product in a fresh
// accumulator, added in IEEE fp32 (no truncation drift over long rows).
template <bool PRE, int NT, int DT, int ROW, bool SPLIT = true>
__device__ __forceinline__ void acc_rows_product(float (&acc)[DT][4], const float (&a)[NT][4], const float* x,
                                                 const float* xs) {
    unsigned ab[NT][4], as[NT][4];
#pragma unroll
    for (int kk = 0; kk < NT; ++kk) frag_a<SPLIT>(a[kk], ab[kk], as[kk]);
#pragma unroll
    for (int dt = 0; dt < DT; ++dt) {
        float part[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
        for (int kk = 0; kk < NT; ++kk) {
            unsigned b0, b1, s0, s1;
            frag_b_rows<PRE, ROW, SPLIT>(x + kk * 8 * ROW + dt * 8, xs + kk * 8 * ROW + dt * 8, b0, b1, s0, s1);
            mma_f32<SPLIT>(part, ab[kk], as[kk], b0, b1, s0, s1);
        }
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[dt][e] += part[e];
    }
}

}  // namespace tf32_detail

// One 16-byte chunk of an operand tile in shared memory, split once for the
// whole CTA (rather than by every warp at each use): the big parts overwrite
// the raw values, the small parts go to ``small``.
__device__ __forceinline__ void split_chunk_in_place(float* raw, float* small) {
    float4 x = *reinterpret_cast<const float4*>(raw), b, sm;
    unsigned ub[4], us[4];
    tf32_detail::split<true>(x.x, ub[0], us[0]);
    tf32_detail::split<true>(x.y, ub[1], us[1]);
    tf32_detail::split<true>(x.z, ub[2], us[2]);
    tf32_detail::split<true>(x.w, ub[3], us[3]);
    b = make_float4(__uint_as_float(ub[0]), __uint_as_float(ub[1]), __uint_as_float(ub[2]), __uint_as_float(ub[3]));
    sm = make_float4(__uint_as_float(us[0]), __uint_as_float(us[1]), __uint_as_float(us[2]), __uint_as_float(us[3]));
    *reinterpret_cast<float4*>(raw) = b;
    *reinterpret_cast<float4*>(small) = sm;
}
