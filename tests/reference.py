"""The float64 reference, written from the definition and nothing else.

Each KV head is repeated group_size times, then every query position takes a
softmax over the keys it may see. Deliberately slow and literal: it shares no
code with cupy_gqa.
"""
import numpy as np


def reference_attention(q, k, v, *, causal=True, softmax_scale=None, seqlens_k=None, window=None, softcap=None,
                        sinks=None, alibi_slopes=None, score_mod=None, mask_mod=None):
    """(out, lse) in float64 for NumPy inputs q (B, Sq, Hq, D), k and v (B, Sk, Hkv, D).

    seqlens_k (B,): sequence b has only the keys [0, seqlens_k[b]), so it is
    attention over the cache cut to that length (causal mask aligned to it).

    Modifiers (any of them given: the literal loop of _reference_with_modifiers):
    window (left, right), softcap, sinks (Hq,), alibi_slopes (Hq,) or (B, Hq),
    and score_mod / mask_mod as cupy_gqa.ScoreMod / MaskMod, of which only the
    NumPy twin and the buffers are used."""
    if any(x is not None for x in (window, softcap, sinks, alibi_slopes, score_mod, mask_mod)):
        return _reference_with_modifiers(q, k, v, causal, softmax_scale, seqlens_k, window, softcap, sinks,
                                         alibi_slopes, score_mod, mask_mod)  # fmt: skip
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


def _buffers(mod):
    out = {}
    for name, a in mod.buffers.items():
        a = a.get() if hasattr(a, "get") else (a.detach().cpu().numpy() if hasattr(a, "detach") else np.asarray(a))
        out[name] = a
    return out


def _modified_row(q_row, k_rows, b, t, n, seqlen_q, scale, causal, window, softcap, sinks, alibi_slopes, score_mod,
                  mask_mod):  # fmt: skip
    """Row t of sequence b (n keys; q_row (Hq, D), k_rows (n, Hq, D)) by the definitions:
    x = scale * q . k; softcap: x = c tanh(x / c); ALiBi: x -= slope[b, h] |t + d - j|;
    score_mod (with a unit u: x = u f(x / u), bounds on f); then key j is seen when j < len, (causal) j <= t + d, (window) t + d - left
    <= j <= t + d + right (-1: unbounded; causal caps right at 0) and mask_mod; the sink
    adds exp(sink[h]) to the denominator (d = len - seqlen_q). Returns p (Hq, n), the
    probabilities (0 where a key is not seen, or the row sees nothing), p_sink (Hq,), lse
    (Hq,) (-inf where the row sees nothing) and d x / d (scale q . k) (the softcap's slope)."""
    num_q_heads = q_row.shape[0]
    d = n - seqlen_q
    j = np.arange(n)[None, :]
    heads = np.arange(num_q_heads)[:, None]
    left, right = (-1, -1) if window is None else window
    x = np.einsum("hd,jhd->hj", q_row, k_rows) * scale  # (Hq, n)
    slope = np.ones_like(x)
    if softcap is not None:
        x = softcap * np.tanh(x / softcap)
        slope = 1 - (x / softcap) ** 2
    if alibi_slopes is not None:
        slopes = np.asarray(alibi_slopes, dtype=np.float64)
        slopes = slopes if slopes.ndim == 1 else slopes[b]
        x = x - slopes[:, None] * np.abs(t + d - j)
    if score_mod is not None:
        unit = 1.0 if score_mod.unit is None else score_mod.unit  # with a unit u: x = u * f(x / u)
        x = np.broadcast_to(score_mod.numpy(score=x / unit, b=b, h=heads, q_idx=t, kv_idx=j, seqlen_q=seqlen_q,
                                            seqlen_k=n, **_buffers(score_mod)), x.shape).astype(np.float64)  # fmt: skip
        if score_mod.bounds is not None:  # clamped to its bounds (a NaN stays NaN)
            x = np.where(x < score_mod.bounds[0], score_mod.bounds[0], np.where(x > score_mod.bounds[1], score_mod.bounds[1], x))
        x = unit * x
    seen = np.ones((num_q_heads, n), dtype=bool)
    if causal:
        seen &= j <= t + d
    if left >= 0:
        seen &= j >= t + d - left
    if right >= 0 and not causal:
        seen &= j <= t + d + right
    if mask_mod is not None:
        seen &= np.broadcast_to(np.asarray(mask_mod.numpy(b=b, h=heads, q_idx=t, kv_idx=j, seqlen_q=seqlen_q, seqlen_k=n,
                                                          **_buffers(mask_mod)), dtype=bool), seen.shape)  # fmt: skip
    x = np.where(seen, x, -np.inf)
    sink = None if sinks is None else np.asarray(sinks, dtype=np.float64)
    mx = x.max(axis=-1, initial=-np.inf)
    if sink is not None:
        mx = np.maximum(mx, sink)
    mx_ref = np.where(np.isneginf(mx), 0, mx)
    e = np.where(seen, np.exp(x - mx_ref[:, None]), 0)
    e_sink = np.zeros(num_q_heads) if sink is None else np.exp(sink - mx_ref)
    total = e.sum(axis=-1) + e_sink
    ok = total > 0
    safe = np.where(ok, total, 1)
    p = np.where(ok[:, None], e / safe[:, None], 0)
    p_sink = np.where(ok, e_sink / safe, 0)
    lse = np.where(ok, np.log(safe) + mx_ref, -np.inf)
    return p, p_sink, lse, slope


def _reference_with_modifiers(q, k, v, causal, softmax_scale, seqlens_k, window, softcap, sinks, alibi_slopes,
                              score_mod, mask_mod):  # fmt: skip
    """Row by row, from the definitions (_modified_row)."""
    q, k, v = (np.asarray(x).astype(np.float64) for x in (q, k, v))
    batch, seqlen_q, num_q_heads, head_dim = q.shape
    seqlen_k, num_kv_heads = k.shape[1], k.shape[2]
    group_size = num_q_heads // num_kv_heads
    k = np.repeat(k, group_size, axis=2)
    v = np.repeat(v, group_size, axis=2)
    scale = 1.0 / np.sqrt(head_dim) if softmax_scale is None else softmax_scale
    out = np.zeros((batch, seqlen_q, num_q_heads, head_dim))
    lse = np.full((batch, num_q_heads, seqlen_q), -np.inf)
    for b in range(batch):
        n = seqlen_k if seqlens_k is None else int(seqlens_k[b])
        for t in range(seqlen_q):
            p, _, lse[b, :, t], _ = _modified_row(q[b, t], k[b, :n], b, t, n, seqlen_q, scale, causal, window, softcap,
                                                  sinks, alibi_slopes, score_mod, mask_mod)  # fmt: skip
            out[b, t] = np.einsum("hj,jhd->hd", p, v[b, :n])
    return out, lse


def reference_attention_backward(dout, q, k, v, *, causal=True, softmax_scale=None, seqlens_k=None, window=None,
                                 softcap=None, sinks=None, alibi_slopes=None, mask_mod=None):  # fmt: skip
    """(dq, dk, dv) in float64: the gradients of reference_attention's out for the
    upstream gradient dout, from the definition, row by row (_modified_row): with p
    the probabilities and out = p v, d x = p (v . dout - out . dout) (the softmax
    Jacobian, diag(p) - p p^T, applied), d (scale q . k) = d x times the softcap's
    slope 1 - (x_c / c)^2; KV heads repeated and their gradients summed back.

    Modifiers as reference_attention takes them (window, softcap, sinks,
    alibi_slopes, mask_mod); with sinks it returns (dq, dk, dv, dsinks), the sink
    (whose value is 0) taking d sink = -p_sink (out . dout). A score_mod has no
    gradient here: it would need its derivative."""
    dout, q, k, v = (np.asarray(x).astype(np.float64) for x in (dout, q, k, v))
    batch, seqlen_q, num_q_heads, head_dim = q.shape
    seqlen_k, num_kv_heads = k.shape[1], k.shape[2]
    group_size = num_q_heads // num_kv_heads
    scale = 1.0 / np.sqrt(head_dim) if softmax_scale is None else softmax_scale
    dq = np.zeros_like(q)
    dk = np.zeros((batch, seqlen_k, num_q_heads, head_dim))
    dv = np.zeros((batch, seqlen_k, num_q_heads, head_dim))
    dsinks = np.zeros(num_q_heads)
    for b in range(batch):
        n = seqlen_k if seqlens_k is None else int(seqlens_k[b])
        kb = np.repeat(k[b, :n], group_size, axis=1)  # (n, Hq, D): query head h reads KV head h // group_size
        vb = np.repeat(v[b, :n], group_size, axis=1)
        for t in range(seqlen_q):
            p, p_sink, _, slope = _modified_row(q[b, t], kb, b, t, n, seqlen_q, scale, causal, window, softcap, sinks,
                                                alibi_slopes, None, mask_mod)  # fmt: skip
            out = np.einsum("hj,jhd->hd", p, vb)
            dp = np.einsum("jhd,hd->hj", vb, dout[b, t])  # d loss / d p_j
            od = np.einsum("hd,hd->h", out, dout[b, t])  # out . dout = sum_j p_j dp_j
            dx0 = p * (dp - od[:, None]) * slope
            dq[b, t] += scale * np.einsum("hj,jhd->hd", dx0, kb)
            dk[b, :n] += scale * np.einsum("hj,hd->jhd", dx0, q[b, t])
            dv[b, :n] += np.einsum("hj,hd->jhd", p, dout[b, t])
            dsinks -= p_sink * od
    # query head h reads KV head h // group_size: sum the group's gradients
    dk = dk.reshape(batch, seqlen_k, num_kv_heads, group_size, head_dim).sum(axis=3)
    dv = dv.reshape(batch, seqlen_k, num_kv_heads, group_size, head_dim).sum(axis=3)
    return (dq, dk, dv) if sinks is None else (dq, dk, dv, dsinks)


def _sequence_with_modifiers(q, k, v, b, causal, softmax_scale, mods):
    """(out (Sq, Hq, D), lse (Hq, Sq)) in float64 of one sequence, sequence b of a
    per-sequence call, with the modifiers ``mods`` (reference_attention's keywords),
    row by row from the definitions (_modified_row): its own queries and keys
    numbered from 0, its own diagonal, and b for ALiBi's row of slopes and the
    user modifiers."""
    seqlen_q, num_q_heads, head_dim = q.shape
    n, num_kv_heads = k.shape[0], k.shape[1]
    group_size = num_q_heads // num_kv_heads
    k, v = np.repeat(k, group_size, axis=1), np.repeat(v, group_size, axis=1)
    scale = 1.0 / np.sqrt(head_dim) if softmax_scale is None else softmax_scale
    out = np.zeros((seqlen_q, num_q_heads, head_dim))
    lse = np.full((num_q_heads, seqlen_q), -np.inf)
    for t in range(seqlen_q):
        p, _, lse[:, t], _ = _modified_row(q[t], k, b, t, n, seqlen_q, scale, causal, mods.get("window"),
                                           mods.get("softcap"), mods.get("sinks"), mods.get("alibi_slopes"),
                                           mods.get("score_mod"), mods.get("mask_mod"))  # fmt: skip
        out[t] = np.einsum("hj,jhd->hd", p, v)
    return out, lse


def reference_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, *, causal=True, softmax_scale=None, **mods):
    """(out, lse) in float64 of packed sequences: q (total_q, Hq, D), k and v
    (total_k, Hkv, D); sequence b is rows [cu_q[b], cu_q[b + 1]) of q and
    [cu_k[b], cu_k[b + 1]) of k, v, each run through reference_attention on its
    own (with modifiers, reference_attention's keywords: _sequence_with_modifiers,
    b the sequence's index). out is (total_q, Hq, D), lse (Hq, total_q); rows of
    no sequence stay NaN (nothing defines them)."""
    q, k, v = (np.asarray(x).astype(np.float64) for x in (q, k, v))
    mods = {name: value for name, value in mods.items() if value is not None}
    out = np.full(q.shape, np.nan)
    lse = np.full((q.shape[1], q.shape[0]), np.nan)
    for b in range(len(cu_seqlens_q) - 1):
        q0, q1 = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1])
        k0, k1 = int(cu_seqlens_k[b]), int(cu_seqlens_k[b + 1])
        if q1 == q0:
            continue
        if mods:
            out[q0:q1], lse[:, q0:q1] = _sequence_with_modifiers(q[q0:q1], k[k0:k1], v[k0:k1], b, causal, softmax_scale, mods)
            continue
        if k1 == k0:  # no key: zeros and -inf
            out[q0:q1], lse[:, q0:q1] = 0.0, -np.inf
            continue
        o, l = reference_attention(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], causal=causal, softmax_scale=softmax_scale)
        out[q0:q1], lse[:, q0:q1] = o[0], l[0]
    return out, lse


def reference_kvcache(q, k_cache, v_cache, *, seqlens_k=None, block_table=None, cache_leftpad=None, causal=True,
                      softmax_scale=None, **mods):  # fmt: skip
    """(out, lse) in float64 of q (B, Sq, Hq, D) against a KV cache: contiguous
    (B, Sk, Hkv, D), or with block_table (B, max_pages) a pool of pages
    (num_pages, page_size, Hkv, D) where key j of sequence b is row j % page_size
    of page block_table[b, j // page_size]. Sequence b's keys are [cache_leftpad[b]
    (default 0), seqlens_k[b] (default all)), gathered key by key, then
    reference_attention runs on the gathered keys of each sequence alone (so the
    causal diagonal is at the end of the keys); with modifiers
    (reference_attention's keywords), _sequence_with_modifiers."""
    q, k_cache, v_cache = (np.asarray(x).astype(np.float64) for x in (q, k_cache, v_cache))
    mods = {name: value for name, value in mods.items() if value is not None}
    batch, seqlen_q, num_q_heads, head_dim = q.shape
    out = np.zeros(q.shape)
    lse = np.full((batch, num_q_heads, seqlen_q), -np.inf)
    for b in range(batch):
        end = (block_table.shape[1] * k_cache.shape[1] if block_table is not None else k_cache.shape[1]) if seqlens_k is None else int(seqlens_k[b])
        first = 0 if cache_leftpad is None else int(cache_leftpad[b])
        rows = []
        for j in range(first, end):
            if block_table is None:
                rows.append((k_cache[b, j], v_cache[b, j]))
            else:
                page_size = k_cache.shape[1]
                page = int(block_table[b, j // page_size])
                rows.append((k_cache[page, j % page_size], v_cache[page, j % page_size]))
        if mods:
            shape = (0, *k_cache.shape[2:])
            ks = np.stack([r[0] for r in rows]) if rows else np.zeros(shape)
            vs = np.stack([r[1] for r in rows]) if rows else np.zeros(shape)
            out[b], lse[b] = _sequence_with_modifiers(q[b], ks, vs, b, causal, softmax_scale, mods)
            continue
        if not rows:
            continue
        ks = np.stack([r[0] for r in rows])[None]
        vs = np.stack([r[1] for r in rows])[None]
        out[b : b + 1], lse[b : b + 1] = reference_attention(q[b : b + 1], ks, vs, causal=causal, softmax_scale=softmax_scale)
    return out, lse
