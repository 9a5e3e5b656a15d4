#!/usr/bin/env python3
"""float32 attention through pairs of 16-bit-precision numbers, modelled in float64
on the CPU: how far from the float64 definition each way of splitting the
operands lands (benchmarks/NOTES_hopper.md: fp32 on wgmma through fp16 pairs).

    python3 benchmarks/dev/fp32_pairs_model.py

One non-causal head, 512 queries, 2048 keys, random normal inputs (q and k
times 1 or 3), the relative error (Frobenius) of out for:
  exact32    fp32 operands, exact products and sums, out rounded to fp32
  tf32split  tiled_tf32's rule: x = big + small, both TF32 (tf32.cuh: split),
             three products a_s b_b + a_b b_s + a_b b_b
  fp16pair   x = hi + lo 2^-11, hi = fp16(x), lo = fp16((x - hi) 2^11), three
             products hi hi + 2^-11 (hi lo + lo hi)
P is rounded to fp32 and split the same way for P V. Products and sums are
exact (float64), so only the operands' representation differs.
"""
import math

import numpy as np


def fp16_pair(x):
    hi = x.astype(np.float16).astype(np.float64)
    lo = ((x - hi) * 2.0**11).astype(np.float16).astype(np.float64)
    return hi, lo * 2.0**-11


def tf32_split(x):
    x32 = x.astype(np.float32)
    big32 = ((x32.view(np.uint32) + np.uint32(0x1000)) & np.uint32(0xFFFFE000)).view(np.float32)
    rest = (x32 - big32).astype(np.float32)
    small32 = ((rest.view(np.uint32) + np.uint32(0x1000)) & np.uint32(0xFFFFE000)).view(np.float32)
    return big32.astype(np.float64), small32.astype(np.float64)


def attention(q, k, v, mode, scale):
    if mode == "exact32":
        s = q @ k.T
        p = np.exp((s - s.max(1, keepdims=True)) * scale)
        return ((p / p.sum(1, keepdims=True)) @ v).astype(np.float32)
    split = fp16_pair if mode == "fp16pair" else tf32_split
    (qh, ql), (kh, kl) = split(q), split(k)
    s = (qh @ kh.T + (qh @ kl.T + ql @ kh.T)).astype(np.float32).astype(np.float64)
    c = scale * math.log2(math.e)
    p = np.exp2((s * c - s.max(1, keepdims=True) * c).astype(np.float32)).astype(np.float64)
    (ph, pl), (vh, vl) = split(p), split(v)
    return ((ph @ vh + (ph @ vl + pl @ vh)) / p.sum(1, keepdims=True)).astype(np.float32)


def main():
    rng = np.random.default_rng(0)
    for head_dim, size in ((128, 1.0), (128, 3.0), (64, 1.0)):
        draw = lambda n, s: (rng.standard_normal((n, head_dim)) * s).astype(np.float32).astype(np.float64)  # noqa: E731
        q, k, v = draw(512, size), draw(2048, size), draw(2048, 1.0)
        scale = head_dim**-0.5
        s = q @ k.T
        p = np.exp((s - s.max(1, keepdims=True)) * scale)
        ref = (p / p.sum(1, keepdims=True)) @ v
        errors = {m: np.linalg.norm(attention(q, k, v, m, scale) - ref) / np.linalg.norm(ref) for m in ("exact32", "tf32split", "fp16pair")}
        print(f"D{head_dim} inputs x{size:g}: " + "  ".join(f"{m} {e:.2e}" for m, e in errors.items()))


if __name__ == "__main__":
    main()
