"""The float64 reference, written from the definition and nothing else.

Each KV head is repeated group_size times, then every query position takes a
softmax over the keys it may see. Deliberately slow and literal: it shares no
code with cupy_gqa.
"""
import numpy as np


def reference_attention(q, k, v, *, causal=True, softmax_scale=None, seqlens_k=None):
    """(out, lse) in float64 for NumPy inputs q (B, Sq, Hq, D), k and v (B, Sk, Hkv, D).

    seqlens_k (B,): sequence b has only the keys [0, seqlens_k[b]), so it is
    attention over the cache cut to that length (causal mask aligned to it)."""
    if seqlens_k is not None:
        parts = [
            reference_attention(q[b : b + 1], k[b : b + 1, :n], v[b : b + 1, :n], causal=causal, softmax_scale=softmax_scale)
            for b, n in enumerate(int(n) for n in seqlens_k)
        ]
        return np.concatenate([o for o, _ in parts]), np.concatenate([lse for _, lse in parts])
    q, k, v = (np.asarray(x).astype(np.float64) for x in (q, k, v))
    batch, seqlen_q, num_q_heads, head_dim = q.shape
    seqlen_k, num_kv_heads = k.shape[1], k.shape[2]
    group_size = num_q_heads // num_kv_heads
    k = np.repeat(k, group_size, axis=2)  # query head h reads KV head h // group_size
    v = np.repeat(v, group_size, axis=2)
    scale = 1.0 / np.sqrt(head_dim) if softmax_scale is None else softmax_scale

    out = np.zeros((batch, seqlen_q, num_q_heads, head_dim))
    lse = np.full((batch, num_q_heads, seqlen_q), -np.inf)
    for t in range(seqlen_q):
        n = min(seqlen_k, t + seqlen_k - seqlen_q + 1) if causal else seqlen_k
        if n <= 0:
            continue  # sees no key: zeros, lse = -inf
        s = np.einsum("bhd,bjhd->bhj", q[:, t], k[:, :n]) * scale
        mx = s.max(axis=-1, keepdims=True)
        e = np.exp(s - mx)
        total = e.sum(axis=-1)
        out[:, t] = np.einsum("bhj,bjhd->bhd", e / total[..., None], v[:, :n])
        lse[:, :, t] = np.log(total) + mx[..., 0]
    return out, lse


def reference_attention_backward(dout, q, k, v, *, causal=True, softmax_scale=None, seqlens_k=None):
    """(dq, dk, dv) in float64: the gradients of reference_attention's out for
    the upstream gradient dout, from the definition (softmax Jacobian written
    out per row), KV heads repeated and their gradients summed back."""
    dout, q, k, v = (np.asarray(x).astype(np.float64) for x in (dout, q, k, v))
    batch, seqlen_q, num_q_heads, head_dim = q.shape
    seqlen_k, num_kv_heads = k.shape[1], k.shape[2]
    group_size = num_q_heads // num_kv_heads
    scale = 1.0 / np.sqrt(head_dim) if softmax_scale is None else softmax_scale
    dq = np.zeros_like(q)
    dk = np.zeros((batch, seqlen_k, num_q_heads, head_dim))
    dv = np.zeros((batch, seqlen_k, num_q_heads, head_dim))
    for b in range(batch):
        n_b = seqlen_k if seqlens_k is None else int(seqlens_k[b])
        for h in range(num_q_heads):
            kh, vh = k[b, :n_b, h // group_size], v[b, :n_b, h // group_size]
            for t in range(seqlen_q):
                n = min(n_b, t + n_b - seqlen_q + 1) if causal else n_b
                if n <= 0:
                    continue  # sees no key: out is 0 whatever q, k, v are
                s = kh[:n] @ q[b, t, h] * scale
                p = np.exp(s - s.max())
                p /= p.sum()
                dp = vh[:n] @ dout[b, t, h]  # d loss / d p_j
                ds = p * (dp - p @ dp)  # softmax Jacobian: diag(p) - p p^T
                dq[b, t, h] = scale * ds @ kh[:n]
                dk[b, :n, h] += scale * np.outer(ds, q[b, t, h])
                dv[b, :n, h] += np.outer(p, dout[b, t, h])
    # query head h reads KV head h // group_size: sum the group's gradients
    dk = dk.reshape(batch, seqlen_k, num_kv_heads, group_size, head_dim).sum(axis=3)
    dv = dv.reshape(batch, seqlen_k, num_kv_heads, group_size, head_dim).sum(axis=3)
    return dq, dk, dv
