#!/usr/bin/env python3
"""float32 attention through fp16 pairs, modelled in float64 on the CPU: the
arithmetic of kernels/tiled_f16x2.cu (tile scales, the cross terms' own
accumulator, P's three parts, V's running scale, the online softmax over key
tiles) against split TF32 (kernels/tiled_tf32.cu) and the float64 definition.

    python3 benchmarks/dev/fp32_pairs_model.py [--head-dims 32,64,96,128]

Per case, the relative error (Frobenius) of out against float64 for:
  tf32x3  split TF32: x = big + small, both TF32 (tf32.cuh: split), three
          products small big + big small + big big
  f16x2   the kernel's rule (kernels/tiled_f16x2.cu, top): per tile
          y = x 2^e with the tile's largest finite magnitude in [2^14, 2^15),
          hi = fp16(y), lo = fp16((y - hi) 2^11); S = hi hi + 2^-11 (hi lo +
          lo hi); 2^11 P V = a hi_v + p lo_v + r hi_v, a = fp16(2^11 P),
          r = fp16(2^11 P - a), p = fp16(P); O rescaled when a V tile is
          larger than every tile before it
Products of fp16 or TF32 numbers are exact in float64, as on the tensor cores;
sums are float64 and the scores, P and out are rounded to float32 where the
kernels hold them in float32. Cases: the GPU tests' inputs (random normal,
scores of 30, near-tied maxima) and ranges the tile scales must take (tiny and
huge magnitudes, a key 2^20 larger than the rest of its tile, V tiles that
grow and shrink by 2^30 along the keys), causal, 200 queries of a group of 4
against 300 keys.
"""
import argparse
import math

import numpy as np

BLOCK_M, BLOCK_N = 64, 32  # the kernel's tile at head dim 128 (the model's results do not depend on it much)


def f16(x):
    return np.asarray(x, dtype=np.float64).astype(np.float16).astype(np.float64)


def f32(x):
    return np.asarray(x, dtype=np.float64).astype(np.float32).astype(np.float64)


def scale_exp(x):
    """The kernel's scale_exp: 2^e puts the largest finite magnitude of x in [2^14, 2^15); 126 for none."""
    a = np.abs(x[np.isfinite(x)])
    m = a.max() if a.size else 0.0
    if m < 2.0**-126:  # zero or subnormal: biased exponent 0
        return 126
    return min(14 - math.floor(math.log2(m)), 126)


def pair(y):
    """(hi, lo) of scaled values y (float32), lo holding (y - hi) 2^11."""
    hi = f16(y)
    return hi, f16(f32(y - hi) * 2048.0)


def tf32(x):
    x32 = np.asarray(x, dtype=np.float32)
    return ((x32.view(np.uint32) + np.uint32(0x1000)) & np.uint32(0xFFFFE000)).view(np.float32).astype(np.float64)


def tf32_split(x):
    big = tf32(x)
    return big, tf32(f32(x - big))


def attention(q, k, v, mode, scale, causal=True):
    """out (n, group, d) of one KV head: q (n, group, d), k and v (m, d)."""
    n, group, d = q.shape
    m = k.shape[0]
    rows = q.reshape(n * group, d)  # packed rows r = t * group + g
    out = np.empty_like(rows)
    c = scale * math.log2(math.e)
    for r0 in range(0, n * group, BLOCK_M):
        qb = rows[r0 : r0 + BLOCK_M]
        last = np.arange(r0, r0 + len(qb)) // group + (m - n) if causal else np.full(len(qb), m - 1)
        if mode == "f16x2":
            eq = scale_exp(qb)
            qh, ql = pair(f32(qb * 2.0**eq))
        else:
            qh, ql = tf32_split(qb)
        mrun = np.full(len(qb), -np.inf)
        l = np.zeros(len(qb))
        o = np.zeros((len(qb), d))
        cv = 127
        for n0 in range(0, min(m, last.max() + 1), BLOCK_N):
            kt, vt = k[n0 : n0 + BLOCK_N], v[n0 : n0 + BLOCK_N]
            if mode == "f16x2":
                ek, ev = scale_exp(kt), scale_exp(vt)
                if ev < cv:
                    o *= 2.0 ** (ev - cv) if ev - cv >= -126 else 0.0
                    cv = ev
                kh, kl = pair(f32(kt * 2.0**ek))
                vh, vl = pair(f32(vt * 2.0**cv))
                s = f32(qh @ kh.T + 2.0**-11 * (qh @ kl.T + ql @ kh.T))
                sc = max(c * 2.0**-eq * 2.0**-ek, 2.0**-126)
            else:
                kh, kl = tf32_split(kt)
                vh, vl = tf32_split(vt)
                s = f32(ql @ kh.T + qh @ kl.T + qh @ kh.T)
                sc = c
            keys = np.arange(n0, n0 + len(kt))
            s = np.where(keys[None, :] > last[:, None], -np.inf, s)
            mnew = np.maximum(mrun, f32(s.max(1) * sc))
            ref = np.where(mnew == -np.inf, 0.0, mnew)
            alpha = f32(np.exp2(mrun - ref))
            p = f32(np.exp2(f32(s * sc - ref[:, None])))
            l = f32(l * alpha + p.sum(1))
            o = f32(o * alpha[:, None])
            if mode == "f16x2":
                a = f16(p * 2048.0)
                rr = f16(f32(p * 2048.0 - a))
                o = f32(o + (rr @ vh + f16(p) @ vl + a @ vh))
            else:
                pb, ps = tf32_split(p)
                o = f32(o + (ps @ vh + pb @ vl + pb @ vh))
            mrun = mnew
        if mode == "f16x2":
            out[r0 : r0 + len(qb)] = f32(f32(o * (1.0 / l)[:, None] * 2.0**-11) * 2.0 ** -min(cv, 126))
        else:
            out[r0 : r0 + len(qb)] = f32(o / l[:, None])
    return out.reshape(n, group, d)


def reference(q, k, v, scale, causal=True):
    n, group, d = q.shape
    m = k.shape[0]
    s = np.einsum("tgd,jd->tgj", q, k) * scale
    if causal:
        s = np.where(np.arange(m)[None, None, :] > (np.arange(n) + m - n)[:, None, None], -np.inf, s)
    p = np.exp(s - s.max(2, keepdims=True))
    return np.einsum("tgj,jd->tgd", p / p.sum(2, keepdims=True), v)


def cases(d, rng):
    """(name, q, k, v, rows that the comparison covers) at head dim d."""
    n, m, group = 200, 300, 4
    draw = lambda *shape: rng.standard_normal(shape).astype(np.float32).astype(np.float64)  # noqa: E731
    q, k, v = draw(n, group, d), draw(m, d), draw(m, d)
    every = slice(None)
    yield "normal", q, k, v, every
    yield "scores_of_30", q * math.sqrt(10), k * math.sqrt(10), v, every
    base = k[rng.integers(0, 3, size=m)]
    yield "near_ties", q, f32((base + rng.standard_normal(base.shape) * 1e-6) * 3.0), v, every
    yield "tiny", q * 1e-20, k * 1e-20, v * 1e-30, every
    yield "huge", q * 1e15, k * 1e-13, v * 1e30, every
    kk = k.copy()
    kk[m - 1] *= 2.0**20  # only the last query sees it; the rest of its tile is 2^20 smaller
    yield "outlier_key", q, kk, v, slice(0, n - 1 - BLOCK_N)
    vv = v * (2.0 ** np.linspace(0, 30, m))[:, None]  # V grows along the keys
    yield "v_grows_2^30", q, k, f32(vv), every
    yield "v_shrinks_2^30", q, k, f32(v * (2.0 ** np.linspace(0, -30, m))[:, None]), every


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--head-dims", default="32,64,96,128")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    print(f"{'case':<16} {'d':>4} {'tf32x3':>9} {'f16x2':>9}")
    for d in map(int, args.head_dims.split(",")):
        for name, q, k, v, rows in cases(d, rng):
            scale = d**-0.5
            ref = reference(q, k, v, scale)[rows]
            err = {}
            for mode in ("tf32x3", "f16x2"):
                out = attention(q, k, v, mode, scale)[rows]
                err[mode] = np.linalg.norm(out - ref) / np.linalg.norm(ref)
            print(f"{name:<16} {d:>4} {err['tf32x3']:9.2e} {err['f16x2']:9.2e}", flush=True)


if __name__ == "__main__":
    main()
