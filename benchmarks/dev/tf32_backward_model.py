#!/usr/bin/env python3
"""A float64 model of the float32 backward kernels' arithmetic (kernels/backward.cu:
bwd_dq_tf32, bwd_dkdv_tf32), to see their gradient error before a GPU runs them.

    python3 benchmarks/dev/tf32_backward_model.py [--head-dims 32,64,128] [--scales 1,6]

Inputs as tests/test_gpu_backward.py draws them (random_qkv, B1 S65 Hq4 Hkv2
causal, softmax_scale 1.0 at scale 6: scores of several hundred; 1/sqrt(D) at
scale 1). The model follows the kernels' order of operations:
  - operands split into TF32 big and small parts as tf32.cuh's split does; the
    tensor cores read each operand truncated to TF32 and add each m16n8k8
    product into the accumulator once, rounding toward zero (the products
    exact, the eight of a k8 step summed exactly: an assumption);
  - Q K^T and dO V^T as three products per k8 step (small x big, big x small,
    big x big), groups of KG = 4 steps in fresh accumulators added in fp32;
  - dQ: the online softmax over key tiles of BLOCK_N (softmax.cuh), dS K per tile
    in a fresh accumulator; lse2 = m + log2 l;
  - dK, dV: P^T = exp2(s scale_log2 - lse2) from the same score bits, per row
    tile of BLOCK_M in fresh accumulators.
Everything else is fp32 arithmetic rounded to nearest. It prints the relative
error (Frobenius, against float64) of dq, dk, dv beside torch's CPU float32
backward (its math path: exact fp32 products, a proxy for the GPU's), and the
gradient test's tolerance computed from that proxy (2 x torch + 2e-6).
"""
import argparse
import math
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from conftest import random_qkv, relative_error  # noqa: E402
from reference import reference_attention_backward  # noqa: E402

from cupy_gqa import _specs  # noqa: E402

KG = 4


def f32(x):
    return np.asarray(x, np.float64).astype(np.float32).astype(np.float64)


def rz(x):
    """x rounded toward zero to float32."""
    x = np.asarray(x, np.float64)
    y = x.astype(np.float32)
    over = np.abs(y.astype(np.float64)) > np.abs(x)
    y[over] = np.nextafter(y[over], np.float32(0))
    return y.astype(np.float64)


def trunc13(bits):
    return (bits & np.uint32(0xFFFFE000)).view(np.float32).astype(np.float64)


def split(x):
    """(big, small) as the tensor cores read them (tf32.cuh: split, then truncation)."""
    x32 = np.asarray(x, np.float32)
    bits = x32.view(np.uint32)
    big_bits = (bits + np.uint32(0x1000)) & np.uint32(0xFFFFE000)
    big = big_bits.view(np.float32)
    small = (x32 - big).astype(np.float32)
    return big.astype(np.float64), trunc13(small.view(np.uint32) + np.uint32(0x1000))


def mma_chain(c, pairs):
    """c after the mma instructions of ``pairs`` ((A, B) of one k8 step each), in order."""
    for a, b in pairs:
        c = rz(c + a @ b)
    return c


def product_nt(a, b, kd_steps):
    """A B^T (rows of A and of B along the reduction), the kernels' S = Q K^T."""
    ab, as_ = split(a)
    bb, bs = split(b)
    c = np.zeros((a.shape[0], b.shape[0]))
    for g in range(0, kd_steps, KG):
        part = np.zeros_like(c)
        for kd in range(g, min(g + KG, kd_steps)):
            sl = slice(8 * kd, 8 * kd + 8)
            part = mma_chain(part, [(as_[:, sl], bb[:, sl].T), (ab[:, sl], bs[:, sl].T), (ab[:, sl], bb[:, sl].T)])
        c = f32(c + part)
    return c


def product_rows(a, x):
    """A X for A from an accumulator (its columns the reduction) and X's rows, one
    fresh accumulator for the whole call (the kernels' per-tile part)."""
    ab, as_ = split(a)
    xb, xs = split(x)
    part = np.zeros((a.shape[0], x.shape[1]))
    for kk in range(0, a.shape[1], 8):
        sl = slice(kk, kk + 8)
        part = mma_chain(part, [(as_[:, sl], xb[sl]), (ab[:, sl], xs[sl]), (ab[:, sl], xb[sl])])
    return part


def model(q, k, v, dout, out, scale, block_n, block_m):
    batch, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    g = hq // hkv
    dpad = 32 * math.ceil(d / 32)
    pad = lambda x: np.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, dpad - d)])  # noqa: E731
    q, k, v, dout, out = (pad(x.astype(np.float64)) for x in (q, k, v, dout, out))
    scale_log2 = f32(scale * math.log2(math.e))
    dq = np.zeros_like(q)
    dk = np.zeros_like(k)
    dv = np.zeros_like(v)
    diag = sk - sq
    for b in range(batch):
        for h in range(hkv):
            rows = sq * g
            qp = q[b, :, h * g : (h + 1) * g].reshape(rows, dpad)  # packed row t * g + gi
            dop = dout[b, :, h * g : (h + 1) * g].reshape(rows, dpad)
            op = out[b, :, h * g : (h + 1) * g].reshape(rows, dpad)
            kb, vb = k[b, :, h], v[b, :, h]
            delta = f32(np.sum(f32(dop * op), axis=1))
            s = product_nt(qp, kb, dpad // 8)
            dp = product_nt(dop, vb, dpad // 8)
            last = np.arange(rows) // g + diag
            visible = np.arange(sk)[None, :] <= last[:, None]
            s = np.where(visible, s, -np.inf)
            # ---- dQ: the online softmax over key tiles ----
            m = np.full(rows, -np.inf)
            l = np.zeros(rows)
            acc = np.zeros((rows, dpad))
            for j0 in range(0, sk, block_n):
                st, dpt = s[:, j0 : j0 + block_n], dp[:, j0 : j0 + block_n]
                mx = f32(st.max(axis=1) * scale_log2)
                m_new = np.maximum(m, mx)
                ref_new = np.where(m_new == -np.inf, 0.0, m_new)
                with np.errstate(invalid="ignore"):
                    alpha = f32(np.exp2(np.where(m == -np.inf, -np.inf, m - ref_new)))
                p = f32(np.exp2(f32(st * scale_log2 - ref_new[:, None])))
                l = f32(f32(l * alpha) + f32(p.sum(axis=1)))
                acc = f32(acc * alpha[:, None])
                ds = f32(p * f32(dpt - delta[:, None]))
                acc = f32(acc + product_rows(ds, kb[j0 : j0 + block_n]))
                m = m_new
            with np.errstate(divide="ignore"):
                fac = np.where(l > 0, f32(f32(1.0 / l) * scale), 0.0)
                lse2 = np.where(l > 0, f32(m + f32(np.log2(np.where(l > 0, l, 1.0)))), np.inf)
            dqp = f32(acc * fac[:, None])
            dq[b, :, h * g : (h + 1) * g] = dqp.reshape(sq, g, dpad)
            # ---- dK, dV: P^T from the same score bits and lse2 ----
            pt = f32(np.exp2(f32(s * scale_log2 - lse2[:, None])))  # (rows, keys); -inf -> 0
            dst = f32(pt * f32(dp - delta[:, None]))
            dkb = np.zeros((sk, dpad))
            dvb = np.zeros((sk, dpad))
            for m0 in range(0, rows, block_m):
                r = slice(m0, m0 + block_m)
                dvb = f32(dvb + product_rows(pt[r].T, dop[r]))
                dkb = f32(dkb + product_rows(dst[r].T, qp[r]))
            dk[b, :, h] = f32(dkb * scale)
            dv[b, :, h] = dvb
    return dq[..., :d], dk[..., :d], dv[..., :d]


def torch_errors(q, k, v, dout, scale, want):
    import torch

    tq, tk, tv = (torch.from_numpy(x).transpose(1, 2).requires_grad_() for x in (q, k, v))
    g = q.shape[2] // k.shape[2]
    sq, sk = q.shape[1], k.shape[1]
    mask = torch.arange(sk)[None, :] <= torch.arange(sq)[:, None] + sk - sq
    o = torch.nn.functional.scaled_dot_product_attention(
        tq, tk.repeat_interleave(g, 1), tv.repeat_interleave(g, 1), attn_mask=mask, scale=scale
    )
    grads = torch.autograd.grad(o, (tq, tk, tv), torch.from_numpy(dout).transpose(1, 2))
    return [relative_error(x.transpose(1, 2).numpy(), w) for x, w in zip(grads, want)], o.detach().transpose(1, 2).numpy()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--head-dims", default="32,64,128")
    parser.add_argument("--scales", default="1,6")
    args = parser.parse_args()
    arch = _specs.ARCHS["sm_90"]
    for d in map(int, args.head_dims.split(",")):
        dq_spec, dkdv_spec = _specs.bwd_mma_specs("float32", d, True, arch)
        block_n = int(dq_spec.name.split("<")[1].split(",")[2])
        block_m = int(dkdv_spec.name.split("<")[1].split(",")[1])
        for input_scale in map(float, args.scales.split(",")):
            q, k, v = random_qkv(1, 65, 65, 4, 2, d, "float32", seed=8, scale=input_scale)
            dout = random_qkv(1, 65, 1, 4, 1, d, "float32", seed=11)[0]
            softmax_scale = 1.0 if input_scale > 1 else d**-0.5
            want = reference_attention_backward(dout, q, k, v, softmax_scale=softmax_scale)
            theirs, out = torch_errors(q, k, v, dout, softmax_scale, want)
            ours = [relative_error(x, w) for x, w in zip(model(q, k, v, dout, out, softmax_scale, block_n, block_m), want)]
            line = "  ".join(f"{n} {o:.2e} (torch {t:.2e}, tol {2 * t + 2e-6:.2e})" for n, o, t in zip(("dq", "dk", "dv"), ours, theirs))
            print(f"D{d} inputs x{input_scale:g} scale {softmax_scale:.3g} BLOCK_N {block_n} BLOCK_M {block_m}: {line}")


if __name__ == "__main__":
    main()
