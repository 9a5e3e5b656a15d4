"""The NumPy backend: the same semantics as the CUDA kernels, on the CPU.

It follows the tiled algorithm rather than materialising whole score
matrices: for each (batch, KV head) it takes blocks of query rows of all
``group_size`` heads that share the KV head, and streams blocks of keys
through an online softmax, so memory stays bounded by the block sizes.
Arithmetic is float32 for float16 / bfloat16 / float32 inputs and float64 for
float64 inputs, as on the GPU.
"""
from __future__ import annotations

import numpy as np

from . import _mods

# A block of scores holds at most group_size * Q_BLOCK * K_BLOCK values.
Q_BLOCK = 256
K_BLOCK = 1024


# float16 -> float32 by a table of every bit pattern (256 KB, made on first use): np.take
# of it reads twice as fast as NumPy's float16 cast, with the same bits (NaN payloads too)
_F16_TABLE = None


def _acc(x, acc):
    """x (an input block) in the accumulation type acc, C-contiguous."""
    global _F16_TABLE
    if x.dtype == np.float16 and acc is np.float32:
        if _F16_TABLE is None:
            _F16_TABLE = np.arange(65536, dtype=np.uint16).view(np.float16).astype(np.float32)
        return np.take(_F16_TABLE, x.view(np.uint16))
    return x.astype(acc, order="C", copy=False)  # (no copy of a block already so: it is only read)


def _rows_at(a, b):
    """a (..., n) @ b (n, m) as one matrix product of a's rows (one BLAS call, not one per
    leading index as a stacked matmul makes)."""
    return (a.reshape(-1, a.shape[-1]) @ b).reshape(*a.shape[:-1], b.shape[-1])


def _rows_t_at(a, b):
    """sum over the leading indices of a[..]^T b[..]: a (..., n), b (..., m) -> (n, m), one
    matrix product (np.einsum would loop without BLAS)."""
    return a.reshape(-1, a.shape[-1]).T @ b.reshape(-1, b.shape[-1])


def attention_cpu(q, k, v, out, lse, *, causal: bool, softmax_scale: float, seqlens_k=None, mods=None) -> None:
    """Write attention(q, k, v) into ``out`` and, if given, the log-sum-exp into ``lse``.

    q : (batch, seqlen_q, num_q_heads, head_dim); k, v : (batch, seqlen_k, num_kv_heads, head_dim)
    out : like q; lse : float32 (batch, num_q_heads, seqlen_q) or None.
    seqlens_k : (batch,) integers in [0, seqlen_k], or None: batch b uses keys
    [0, seqlens_k[b]) only, and its causal mask is aligned to that length.
    mods : _mods.CpuModifiers or None: window, softcap, ALiBi, sinks and the
    user modifiers' NumPy twins, by the rules of cupy_gqa/_mods.py.
    Inputs are validated by the caller.
    """
    if mods is not None:
        return _attention_cpu_mods(q, k, v, out, lse, causal=causal, softmax_scale=softmax_scale, seqlens_k=seqlens_k, mods=mods)
    batch, seqlen_q, num_q_heads, head_dim = q.shape
    seqlen_k, num_kv_heads = k.shape[1], k.shape[2]
    group_size = num_q_heads // num_kv_heads
    acc = np.float64 if q.dtype == np.float64 else np.float32
    scale = acc(softmax_scale)

    for b in range(batch):
        len_b = seqlen_k if seqlens_k is None else int(seqlens_k[b])  # keys [0, len_b) exist
        offset = len_b - seqlen_q  # causal, bottom-right: t sees keys j <= t + offset
        for kv_head in range(num_kv_heads):
            heads = slice(kv_head * group_size, (kv_head + 1) * group_size)  # kv_head = q_head // group_size
            for t0 in range(0, seqlen_q, Q_BLOCK):
                t1 = min(seqlen_q, t0 + Q_BLOCK)
                # (group_size, rows, head_dim), pre-scaled
                qb = _acc(np.swapaxes(q[b, t0:t1, heads, :], 0, 1), acc) * scale
                t = np.arange(t0, t1)
                n_keys = np.clip(t + offset + 1, 0, len_b) if causal else np.full(t1 - t0, len_b)
                m = np.full((group_size, t1 - t0), -np.inf, dtype=acc)
                l = np.zeros_like(m)
                o = np.zeros((group_size, t1 - t0, head_dim), dtype=acc)
                keys = int(n_keys.max(initial=0))  # the block's rows see keys [0, keys) at most
                for j0 in range(0, keys, K_BLOCK):
                    j1 = min(keys, j0 + K_BLOCK)
                    kb = _acc(k[b, j0:j1, kv_head, :], acc)
                    vb = _acc(v[b, j0:j1, kv_head, :], acc)
                    s = _rows_at(qb, kb.T)  # (group_size, rows, keys)
                    visible = np.arange(j0, j1)[None, :] < n_keys[:, None] if causal and j1 > n_keys.min() else None
                    if visible is not None:
                        np.copyto(s, -np.inf, where=~visible[None])
                    # online softmax: o = o * exp(m - m') + exp(s - m') @ v (s becomes P in place)
                    m_new = np.maximum(m, s.max(axis=-1))
                    m_ref = np.where(m_new == -np.inf, 0, m_new)  # no NaN from (-inf) - (-inf)
                    alpha = np.exp(m - m_ref)
                    p = np.exp(np.subtract(s, m_ref[..., None], out=s), out=s)
                    l = l * alpha + p.sum(axis=-1)
                    o = o * alpha[..., None] + _masked_pv(p, vb, visible)
                    m = m_new
                seen = n_keys > 0  # rows that see no key: out 0, lse -inf
                with np.errstate(divide="ignore", invalid="ignore"):
                    res = np.where(seen[None, :, None], o / l[..., None], 0)
                    block_lse = np.where(seen[None, :], m + np.log(l), -np.inf)
                out[b, t0:t1, heads, :] = np.swapaxes(res, 0, 1).astype(out.dtype)
                if lse is not None:
                    lse[b, heads, t0:t1] = block_lse


def _attention_cpu_mods(q, k, v, out, lse, *, causal, softmax_scale, seqlens_k, mods) -> None:
    """attention_cpu with modifiers (see _mods.py for the rules): the same blocks
    and online softmax, with the scores modified and masked by _modified_scores
    (only the key blocks of the rows' bands are read), and the sinks folded in at
    the end."""
    batch, seqlen_q, num_q_heads, head_dim = q.shape
    seqlen_k, num_kv_heads = k.shape[1], k.shape[2]
    group_size = num_q_heads // num_kv_heads
    acc = np.float64 if q.dtype == np.float64 else np.float32
    scale = acc(softmax_scale)

    for b in range(batch):
        len_b = seqlen_k if seqlens_k is None else int(seqlens_k[b])
        offset = len_b - seqlen_q  # t's diagonal key: t + offset
        slopes = None if mods.alibi is None else mods.slopes(b).astype(acc)
        for kv_head in range(num_kv_heads):
            heads = slice(kv_head * group_size, (kv_head + 1) * group_size)
            for t0 in range(0, seqlen_q, Q_BLOCK):
                t1 = min(seqlen_q, t0 + Q_BLOCK)
                qb = _acc(np.swapaxes(q[b, t0:t1, heads, :], 0, 1), acc) * scale
                t = np.arange(t0, t1)
                first, last = _key_band(t, offset, len_b, causal, mods)
                m = np.full((group_size, t1 - t0), -np.inf, dtype=acc)
                l = np.zeros_like(m)
                o = np.zeros((group_size, t1 - t0, head_dim), dtype=acc)
                lo, hi = int(first.min(initial=0)), int(last.max(initial=-1)) + 1
                for j0 in range(lo, hi, K_BLOCK):
                    j1 = min(hi, j0 + K_BLOCK)
                    kb = _acc(k[b, j0:j1, kv_head, :], acc)
                    vb = _acc(v[b, j0:j1, kv_head, :], acc)
                    with np.errstate(invalid="ignore"):  # a non-finite K at a masked key: its scores are dropped
                        s = _rows_at(qb, kb.T)  # (group_size, rows, keys), scaled
                    s, visible, _ = _modified_scores(
                        s, mods, b=b, heads=heads, t=t, j=np.arange(j0, j1), first=first, last=last,
                        offset=offset, seqlen_q=seqlen_q, len_b=len_b, slopes=slopes,
                    )  # fmt: skip
                    m_new = np.maximum(m, s.max(axis=-1))
                    m_ref = np.where(m_new == -np.inf, 0, m_new)
                    alpha = np.exp(m - m_ref)
                    p = np.exp(s - m_ref[..., None])
                    l = l * alpha + p.sum(axis=-1)
                    o = o * alpha[..., None] + _masked_pv(p, vb, visible)
                    m = m_new
                if mods.sinks is not None:  # the sink joins the denominator, no value (softmax.cuh: fold_sink)
                    sink = mods.sinks[heads].astype(acc)[:, None]
                    m_new = np.maximum(m, sink)
                    alpha = np.exp(m - m_new)
                    l = l * alpha + np.exp(sink - m_new)
                    o = o * alpha[..., None]
                    m = m_new
                seen = l > 0  # rows that see no key (and no sink): out 0, lse -inf
                with np.errstate(divide="ignore", invalid="ignore"):
                    res = np.where(seen[..., None], o / l[..., None], 0)
                    block_lse = np.where(seen, m + np.log(l), -np.inf)
                out[b, t0:t1, heads, :] = np.swapaxes(res, 0, 1).astype(out.dtype)
                if lse is not None:
                    lse[b, heads, t0:t1] = block_lse


def _key_band(t, offset, len_b, causal, mods):
    """The band of keys [first, last] of each query row t (an array of rows), by
    seqlens_k (keys [0, len_b)), causal (j <= t + offset) and the window
    ([t + offset - left, t + offset + right], -1 unbounded)."""
    left, right = mods.window_left, mods.window_right
    last = np.full(len(t), len_b - 1)
    if causal:
        last = np.minimum(last, t + offset)
    elif right >= 0:
        last = np.minimum(last, t + offset + right)
    first = np.maximum(0, t + offset - left) if left >= 0 else np.zeros(len(t), dtype=np.int64)
    return first, last


def _modified_scores(s, mods, *, b, heads, t, j, first, last, offset, seqlen_q, len_b, slopes):
    """A block of scores modified and masked, the one place of these rules on
    the CPU, forward and backward (see _mods.py).

    s : (group_size, rows, keys) scaled scores x = softmax_scale * q . k of the
    query heads ``heads`` (a slice), rows ``t`` and keys ``j`` (arrays);
    first, last : the rows' bands (_key_band); offset = len_b - seqlen_q;
    slopes : sequence b's ALiBi slopes (num_q_heads,) in s's dtype, or None.
    In this order: softcap x = cap * tanh(x / cap); ALiBi x -= slope[h] * |t +
    offset - j|; score_mod; then keys outside the band or refused by mask_mod
    become -inf. Returns (s, visible, slope): visible (group_size, rows, keys)
    bool, and slope = 1 - tanh(x / cap)^2, the softcap's derivative, which the
    backward pass needs (ALiBi adds a constant), or None without softcap.
    """
    acc = s.dtype.type
    rows, keys = s.shape[1:]
    h_idx = np.arange(heads.start, heads.stop)[:, None, None]  # (group_size, 1, 1)
    visible = (j[None, :] >= first[:, None]) & (j[None, :] <= last[:, None])  # (rows, keys)
    slope = None
    with np.errstate(all="ignore"):  # scores of masked keys are dropped below
        if mods.softcap:
            cap = acc(mods.softcap)
            tanh = np.tanh(s / cap)
            s = cap * tanh
            slope = 1 - tanh * tanh
        if slopes is not None:
            s = s - slopes[heads][:, None, None] * np.abs(t[:, None] + offset - j[None, :]).astype(acc)
        if mods.score_fn is not None:
            s = np.asarray(mods.score_fn(
                score=s, b=b + mods.batch_offset, h=h_idx, q_idx=t[None, :, None], kv_idx=j[None, None, :],
                seqlen_q=seqlen_q, seqlen_k=len_b, **mods.score_buffers,
            ), dtype=acc)  # fmt: skip
            s = np.broadcast_to(s, (len(h_idx), rows, keys))
    if mods.mask_fn is not None:
        user = np.asarray(mods.mask_fn(
            b=b + mods.batch_offset, h=h_idx, q_idx=t[None, :, None], kv_idx=j[None, None, :], seqlen_q=seqlen_q,
            seqlen_k=len_b, **mods.mask_buffers,
        ), dtype=bool)  # fmt: skip
        visible = np.broadcast_to(visible[None] & user, (len(h_idx), rows, keys))
    else:
        visible = np.broadcast_to(visible[None], (len(h_idx), rows, keys))
    return np.where(visible, s, -np.inf), visible, slope


def _masked_pv(p, vb, visible):
    """p @ vb, where a key that a row does not see adds nothing, even if its V is NaN or Inf.

    p : (group_size, rows, keys), 0 at masked keys; vb : (keys, head_dim);
    visible : (rows, keys) or (group_size, rows, keys) bool, or None when nothing is masked.
    """
    bad = ~np.isfinite(vb) if visible is not None else None
    if bad is None or not bad.any():
        return _rows_at(p, vb)
    pv = _rows_at(p, np.where(bad, 0, vb))
    j, d = np.nonzero(bad)  # the few non-finite V entries, added where visible
    vis = visible if visible.ndim == 3 else visible[None]
    with np.errstate(invalid="ignore"):  # 0 * Inf at the masked keys, dropped here
        extra = np.where(vis[..., j], p[..., j] * vb[j, d], 0)
    np.add.at(pv, (slice(None), slice(None), d), extra)
    return pv


def attention_backward_cpu(
    dout, q, k, v, out, lse, dq, dk, dv, *, causal: bool, softmax_scale: float, seqlens_k=None, mods=None, dsinks=None
) -> None:
    """The gradients of attention(q, k, v) for the upstream gradient ``dout``,
    written into ``dq``, ``dk``, ``dv`` (shaped like q, k, v), and with sinks
    into ``dsinks``.

    ``out`` and ``lse`` are the forward's results (lse natural-log, float32
    (batch, num_q_heads, seqlen_q), the sink included); the probabilities are
    rebuilt from them, P = exp(x_mod - lse), as a tiled backward does, where
    x = scale * q k^T and x_mod is x modified and masked as in the forward
    (_modified_scores). Per row, delta = rowsum(dout * out) and
        dS = P * (dout v^T - delta) * (1 - tanh(x / softcap)^2, or 1 without softcap),
        dq = scale * dS k,   dk = scale * dS^T q,   dv = P^T dout,
    with dk and dv of a KV head summed over the group_size query heads that
    read it. Rows that see no key get dq = 0; keys that no row sees, and keys
    past seqlens_k[b], get dk = dv = 0.

    mods : _mods.CpuModifiers or None: window, softcap, ALiBi, sinks and
    mask_mod as attention_cpu takes them; a score_mod is refused (ValueError),
    its derivative being unknown.
    dsinks : float32 (num_q_heads,) or None; with mods.sinks, it receives
        d loss / d sinks[h] = - sum over (b, t) of exp(sinks[h] - lse[b, h, t]) * delta[b, h, t]
    (the sink's probability times minus delta: the sink joins the denominator
    with value 0). Left untouched without sinks; None: not computed.

    float32 arithmetic (float64 for float64 inputs, whose lse is rebuilt in
    float64 when a float32 one is given). Inputs are validated by the caller
    and never modified.
    """
    if mods is not None and mods.score_fn is not None:
        raise ValueError(
            "score_mod: the backward pass takes no score_mod (it would need its derivative); "
            "softcap, alibi_slopes, window, sinks and mask_mod have backward passes"
        )
    batch, seqlen_q, num_q_heads, head_dim = q.shape
    seqlen_k, num_kv_heads = k.shape[1], k.shape[2]
    group_size = num_q_heads // num_kv_heads
    acc = np.float64 if q.dtype == np.float64 else np.float32
    scale = acc(softmax_scale)
    if acc is np.float64 and lse.dtype != np.float64:
        # a float32 lse would cap float64 gradients at float32 accuracy: rebuild it in float64
        lse = np.empty((batch, num_q_heads, seqlen_q))
        attention_cpu(q, k, v, np.empty_like(q), lse, causal=causal, softmax_scale=softmax_scale, seqlens_k=seqlens_k,
                      mods=mods)  # fmt: skip
    mods = _mods.CpuModifiers() if mods is None else mods  # no modifiers: the band is seqlens_k and causal alone
    dsinks_acc = np.zeros(num_q_heads)  # float64: a sum over every row of every sequence

    for b in range(batch):
        len_b = seqlen_k if seqlens_k is None else int(seqlens_k[b])
        offset = len_b - seqlen_q  # t's diagonal key: t + offset
        slopes = None if mods.alibi is None else mods.slopes(b).astype(acc)
        for kv_head in range(num_kv_heads):
            heads = slice(kv_head * group_size, (kv_head + 1) * group_size)  # kv_head = q_head // group_size
            dk_acc = np.zeros((seqlen_k, head_dim), dtype=acc)  # keys no row sees, and those past len_b, stay 0
            dv_acc = np.zeros((seqlen_k, head_dim), dtype=acc)
            for t0 in range(0, seqlen_q, Q_BLOCK):
                t1 = min(seqlen_q, t0 + Q_BLOCK)
                qb = _acc(np.swapaxes(q[b, t0:t1, heads, :], 0, 1), acc)  # (group_size, rows, head_dim)
                dob = _acc(np.swapaxes(dout[b, t0:t1, heads, :], 0, 1), acc)
                ob = _acc(np.swapaxes(out[b, t0:t1, heads, :], 0, 1), acc)
                lse_b = lse[b, heads, t0:t1].astype(acc)  # (group_size, rows)
                delta = (dob * ob).sum(axis=-1)  # rowsum(dout * out)
                seen = lse_b > -np.inf  # a row that sees no key (and no sink) has P = 0
                lse_ref = np.where(seen, lse_b, 0)
                if mods.sinks is not None:  # d sink = -P_sink * delta, P_sink = exp(sink - lse)
                    p_sink = np.where(seen, np.exp(mods.sinks[heads].astype(acc)[:, None] - lse_ref), 0)
                    dsinks_acc[heads] -= (p_sink * delta).sum(axis=-1, dtype=np.float64)
                t = np.arange(t0, t1)
                first, last = _key_band(t, offset, len_b, causal, mods)
                dq_b = np.zeros_like(qb)
                lo, hi = int(first.min(initial=0)), int(last.max(initial=-1)) + 1  # only the band's key blocks
                for j0 in range(lo, hi, K_BLOCK):
                    j1 = min(hi, j0 + K_BLOCK)
                    kb = _acc(k[b, j0:j1, kv_head, :], acc)
                    vb = _acc(v[b, j0:j1, kv_head, :], acc)
                    with np.errstate(invalid="ignore"):  # a non-finite K or V at a masked key: dropped below
                        x = _rows_at(qb, kb.T) * scale  # (group_size, rows, keys)
                        dp = _rows_at(dob, vb.T)
                    x, visible, slope = _modified_scores(
                        x, mods, b=b, heads=heads, t=t, j=np.arange(j0, j1), first=first, last=last,
                        offset=offset, seqlen_q=seqlen_q, len_b=len_b, slopes=slopes,
                    )  # fmt: skip
                    p = np.where(visible, np.exp(x - lse_ref[..., None]), 0)
                    ds = p * (dp - delta[..., None])
                    if slope is not None:
                        ds = ds * slope  # d x_capped / d x: the softcap's tanh
                    ds = np.where(visible, ds, 0)  # a non-finite V (hence dp) or K at a masked key adds nothing
                    dq_b += _masked_pv(ds, kb, visible) * scale
                    dk_acc[j0:j1] += _rows_t_at(ds, qb) * scale
                    dv_acc[j0:j1] += _rows_t_at(p, dob)
                dq[b, t0:t1, heads, :] = np.swapaxes(dq_b, 0, 1).astype(dq.dtype)
            dk[b, :, kv_head, :] = dk_acc.astype(dk.dtype)
            dv[b, :, kv_head, :] = dv_acc.astype(dv.dtype)
    if mods.sinks is not None and dsinks is not None:
        dsinks[...] = dsinks_acc.astype(dsinks.dtype)
