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

// NVRTC defines no INFINITY macro.
template <typename A> __device__ __forceinline__ A neg_inf();
template <> __device__ __forceinline__ float neg_inf<float>() { return __int_as_float(0xff800000); }
template <> __device__ __forceinline__ double neg_inf<double>() { return __longlong_as_double(0xfff0000000000000ULL); }

// exp2 / log2 in the accumulator's precision.
__device__ __forceinline__ float exp2_acc(float x) { return exp2f(x); }
__device__ __forceinline__ double exp2_acc(double x) { return exp2(x); }
__device__ __forceinline__ float log2_acc(float x) { return log2f(x); }
__device__ __forceinline__ double log2_acc(double x) { return log2(x); }

// The valid cache length of sequence b: seqlens_k[b], or seqlen_k when the
// call has no seqlens_k (a null pointer).
__device__ __forceinline__ int seqlen_k_of(const int* seqlens_k, int b, int seqlen_k) { return seqlens_k == nullptr ? seqlen_k : seqlens_k[b]; }

// Keys visible to query position t (causal, aligned bottom-right):
// keys j <= t + seqlen_k - seqlen_q, clipped to [0, seqlen_k].
__device__ __forceinline__ int visible_keys(int t, int seqlen_q, int seqlen_k, bool causal) {
    if (!causal) return seqlen_k;
    const long long end = (long long)t + seqlen_k - seqlen_q + 1;
    return end <= 0 ? 0 : (end >= seqlen_k ? seqlen_k : (int)end);
}
