"""The backward pass of the NumPy backend (cupy_gqa.cpu.attention_backward_cpu)
against the float64 reference of the definition, whose own gradients are
checked by finite differences first."""
import numpy as np
import pytest

from conftest import TOLERANCE, assert_close, random_qkv
from cupy_gqa import _mods, cpu
from reference import reference_attention, reference_attention_backward


def _loss(q, k, v, dout, **kw):
    return float((reference_attention(q, k, v, **kw)[0] * dout).sum())


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(3, 5), (5, 3), (4, 4)])
def test_reference_gradients_match_finite_differences(causal, seqlen_q, seqlen_k):
    """The reference's gradients are those of its forward (central differences, float64)."""
    q, k, v = random_qkv(1, seqlen_q, seqlen_k, 4, 2, 3, "float64", seed=seqlen_q * 10 + seqlen_k)
    dout = np.random.default_rng(1).standard_normal(q.shape)
    grads = reference_attention_backward(dout, q, k, v, causal=causal)
    eps = 1e-6
    for x, g in zip((q, k, v), grads):
        for idx in np.ndindex(x.shape):
            old = x[idx]
            x[idx] = old + eps
            up = _loss(q, k, v, dout, causal=causal)
            x[idx] = old - eps
            down = _loss(q, k, v, dout, causal=causal)
            x[idx] = old
            assert abs((up - down) / (2 * eps) - g[idx]) < 1e-6, idx


_MOD_CASES = {
    "window": dict(window=(2, 0)),
    "window_noncausal": dict(window=(1, 2), causal=False),
    "softcap": dict(softcap=0.7),
    "sinks": dict(sinks="sinks"),
    "alibi": dict(alibi_slopes="slopes"),
    "alibi_batch": dict(alibi_slopes="batch_slopes"),
    "mask_mod": dict(mask_mod="mask"),
    "all": dict(window=(3, 0), softcap=0.7, sinks="sinks", alibi_slopes="slopes", mask_mod="mask"),
    "all_noncausal": dict(window=(2, 1), softcap=0.7, sinks="sinks", alibi_slopes="batch_slopes", mask_mod="mask",
                          causal=False),
}  # fmt: skip


@pytest.mark.parametrize("seqlens_k", [None, [5, 2]])
@pytest.mark.parametrize("name", list(_MOD_CASES))
def test_reference_gradients_with_modifiers_match_finite_differences(name, seqlens_k):
    """The reference's gradients with the built-in modifiers (and a mask_mod) are those
    of its forward, the sinks' included (central differences, float64): the rule that
    a backward pass with modifiers will be checked against."""
    from test_modifiers import even_heads_odd_keys_mod

    rng = np.random.default_rng(len(name))
    q, k, v = random_qkv(2, 4, 6, 4, 2, 3, "float64", seed=len(name))
    q, k = q * 2, k * 2  # scores of a few units: the softcap bends them
    made = {"sinks": rng.standard_normal(4), "slopes": 2.0 ** -np.arange(1, 5),
            "batch_slopes": np.stack([2.0 ** -np.arange(1, 5), 3.0 ** -np.arange(1, 5)]),
            "mask": even_heads_odd_keys_mod()}  # fmt: skip
    kw = {n: made[x] if isinstance(x, str) else x for n, x in _MOD_CASES[name].items()}
    kw["seqlens_k"] = seqlens_k
    dout = rng.standard_normal(q.shape)
    grads = reference_attention_backward(dout, q, k, v, **kw)
    inputs = [q, k, v] + ([kw["sinks"]] if "sinks" in kw else [])
    assert len(grads) == len(inputs)
    eps = 1e-6
    for x, g in zip(inputs, grads):
        for idx in np.ndindex(x.shape):
            old = x[idx]
            x[idx] = old + eps
            up = _loss(q, k, v, dout, **kw)
            x[idx] = old - eps
            down = _loss(q, k, v, dout, **kw)
            x[idx] = old
            assert abs((up - down) / (2 * eps) - g[idx]) < 1e-6, (name, idx)
    if seqlens_k is not None:  # keys past a sequence's length get nothing
        assert not grads[1][1, seqlens_k[1]:].any() and not grads[2][1, seqlens_k[1]:].any()


def _backward(dout, q, k, v, *, causal=True, softmax_scale=None, seqlens_k=None, mods=None):
    """(dq, dk, dv), and dsinks when mods has sinks, of the NumPy backend, its forward giving out and lse."""
    scale = 1.0 / np.sqrt(q.shape[3]) if softmax_scale is None else softmax_scale
    out = np.full(q.shape, np.nan, dtype=q.dtype)
    lse = np.full((q.shape[0], q.shape[2], q.shape[1]), np.nan, dtype=np.float32)
    cpu.attention_cpu(q, k, v, out, lse, causal=causal, softmax_scale=scale, seqlens_k=seqlens_k, mods=mods)
    dq, dk, dv = (np.full(x.shape, np.nan, dtype=x.dtype) for x in (q, k, v))  # poisoned: every element written
    sinks = mods is not None and mods.sinks is not None
    dsinks = np.full(q.shape[2], np.nan, dtype=np.float32) if sinks else None
    cpu.attention_backward_cpu(dout, q, k, v, out, lse, dq, dk, dv, causal=causal, softmax_scale=scale,
                               seqlens_k=seqlens_k, mods=mods, dsinks=dsinks)  # fmt: skip
    return (dq, dk, dv, dsinks) if sinks else (dq, dk, dv)


@pytest.mark.parametrize("dtype", ["float32", "float64", "bfloat16", "float16"])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("heads", [(4, 4), (8, 2), (7, 1)])
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(37, 53), (53, 37), (1, 300), (300, 300)])
def test_backward_matches_the_reference(dtype, causal, heads, seqlen_q, seqlen_k):
    q, k, v = random_qkv(2, seqlen_q, seqlen_k, *heads, 24, dtype, seed=seqlen_q + seqlen_k)
    dout = random_qkv(2, seqlen_q, 1, heads[0], 1, 24, dtype, seed=7)[0]
    got = _backward(dout, q, k, v, causal=causal)
    want = reference_attention_backward(dout, q, k, v, causal=causal)
    tol = {"float32": 1e-5, "float64": 1e-12, "bfloat16": 3e-2, "float16": 4e-3}[dtype]
    for name, g, w in zip(("dq", "dk", "dv"), got, want):
        assert_close(g, w, tol, f"{name} {dtype}")


def test_rows_without_keys_and_keys_past_seqlens_k_get_zero_gradients():
    q, k, v = random_qkv(3, 9, 6, 4, 2, 8, "float32", seed=3)
    dout = random_qkv(3, 9, 1, 4, 1, 8, "float32", seed=4)[0]
    seqlens_k = np.array([6, 2, 0])
    k[1, 2:], v[1, 2:] = np.nan, np.inf  # past the sequence's length: never read
    dq, dk, dv = _backward(dout, q, k, v, seqlens_k=seqlens_k)
    assert np.all(dq[0, :3] == 0)  # causal, 9 queries on 6 keys: the first 3 see none
    assert np.all(dq[1, :7] == 0) and np.all(dq[2] == 0)
    assert np.all(dk[1, 2:] == 0) and np.all(dv[1, 2:] == 0) and np.all(dk[2] == 0) and np.all(dv[2] == 0)
    want = reference_attention_backward(dout, q, k, v, seqlens_k=seqlens_k)
    for g, w in zip((dq, dk, dv), want):
        assert_close(g, np.nan_to_num(w), 1e-5)


def test_custom_scale_and_inputs_untouched():
    q, k, v = random_qkv(1, 20, 20, 6, 3, 16, "float32", seed=9)
    dout = random_qkv(1, 20, 1, 6, 1, 16, "float32", seed=10)[0]
    copies = [x.copy() for x in (dout, q, k, v)]
    got = _backward(dout, q, k, v, softmax_scale=0.7)
    want = reference_attention_backward(dout, q, k, v, softmax_scale=0.7)
    for g, w in zip(got, want):
        assert_close(g, w, 1e-5)
    for x, c in zip((dout, q, k, v), copies):
        assert np.array_equal(x, c)


def _mod_case(name, batch, num_q_heads, seed=11):
    """The reference's keyword arguments of _MOD_CASES[name] (causal included) for
    ``num_q_heads`` heads, its sinks and slopes float32 as the backend takes them."""
    from test_modifiers import even_heads_odd_keys_mod

    rng = np.random.default_rng(seed)
    slopes = (2.0 ** -np.arange(1, num_q_heads + 1)).astype(np.float32)
    made = {"sinks": rng.standard_normal(num_q_heads).astype(np.float32), "slopes": slopes,
            "batch_slopes": np.stack([slopes * (b + 1) for b in range(batch)]),
            "mask": even_heads_odd_keys_mod()}  # fmt: skip
    kw = {n: made[x] if isinstance(x, str) else x for n, x in _MOD_CASES[name].items()}
    kw.setdefault("causal", True)
    return kw


def _cpu_mods(kw, seqlen_q, seqlen_k):
    """The CpuModifiers of the reference's keyword arguments ``kw``, as the public API builds them."""
    window = _mods.check_window(kw.get("window"), kw["causal"], seqlen_q, seqlen_k)
    mask = kw.get("mask_mod")
    return _mods.CpuModifiers(
        window_left=-1 if window is None else window[0], window_right=-1 if window is None else window[1],
        softcap=_mods.check_softcap(kw.get("softcap")), sinks=kw.get("sinks"), alibi=kw.get("alibi_slopes"),
        mask_fn=None if mask is None else mask.numpy, mask_buffers=None if mask is None else mask.host_buffers(),
    )  # fmt: skip


def _check_modifier_gradients(name, dtype, seqlen_q, seqlen_k, seqlens_k, tol):
    batch, num_q_heads, num_kv_heads, head_dim = 3, 8, 2, 16
    # scores of a unit or two (q . k / sqrt(head_dim) with q, k of std 1.25): softcap 0.7 bends them
    shape = (batch, seqlen_q, seqlen_k, num_q_heads, num_kv_heads, head_dim)
    q, k, v = random_qkv(*shape, dtype, seed=len(name), scale=1.25)
    dout = random_qkv(batch, seqlen_q, 1, num_q_heads, 1, head_dim, dtype, seed=5)[0]
    kw = _mod_case(name, batch, num_q_heads)
    mods = _cpu_mods(kw, seqlen_q, seqlen_k)
    copies = [x.copy() for x in (dout, q, k, v)]
    got = _backward(dout, q, k, v, causal=kw["causal"], seqlens_k=seqlens_k, mods=mods)
    want = reference_attention_backward(dout, q, k, v, seqlens_k=seqlens_k, **kw)
    assert len(got) == len(want) == (4 if "sinks" in kw else 3)
    for what, g, w in zip(("dq", "dk", "dv", "dsinks"), got, want):
        tol_what = max(tol, 1e-7) if what == "dsinks" else tol  # dsinks is float32, as the sinks are
        assert_close(g, w, tol_what, f"{what} {name} {dtype} ({seqlen_q}, {seqlen_k}) seqlens_k={seqlens_k}")
    for x, c in zip((dout, q, k, v), copies):
        assert np.array_equal(x.view(np.uint8), c.view(np.uint8)), "an input was modified"


@pytest.mark.parametrize("seqlens_k", [False, True])
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(37, 53), (53, 37)])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("name", list(_MOD_CASES))
def test_backward_with_modifiers_matches_the_reference(name, dtype, seqlen_q, seqlen_k, seqlens_k):
    """dq, dk, dv and dsinks with the built-in modifiers and a mask_mod, GQA 8:2; with
    seqlens_k, a full sequence, one of no keys and one of 7 (most rows see none)."""
    lens = np.array([seqlen_k, 0, 7]) if seqlens_k else None
    _check_modifier_gradients(name, dtype, seqlen_q, seqlen_k, lens, {"float32": 1e-5, "float64": 1e-12}[dtype])


def test_backward_with_modifiers_bfloat16():
    _check_modifier_gradients("all", "bfloat16", 37, 53, np.array([53, 0, 30]), 3e-2)


def test_backward_with_modifiers_small_blocks(monkeypatch):
    """Blocks smaller than the sequences: the band's key blocks, and the sinks' sum, across blocks."""
    monkeypatch.setattr(cpu, "Q_BLOCK", 7)
    monkeypatch.setattr(cpu, "K_BLOCK", 8)
    _check_modifier_gradients("all", "float64", 37, 53, np.array([53, 0, 30]), 1e-12)
    _check_modifier_gradients("all_noncausal", "float64", 53, 37, None, 1e-12)


def test_backward_with_modifiers_ignores_keys_that_no_row_sees():
    """NaN and Inf in K and V at keys outside every band (before the window, past seqlens_k)
    and at keys that a mask_mod refuses to every head leave the gradients finite and
    those keys' dk, dv zero."""
    q, k, v = random_qkv(2, 5, 40, 4, 2, 8, "float32", seed=12)
    dout = random_qkv(2, 5, 1, 4, 1, 8, "float32", seed=13)[0]
    seqlens_k = np.array([40, 30])
    refused = lambda kv_idx, **_: kv_idx % 5 != 3  # noqa: E731
    mods = _mods.CpuModifiers(window_left=3, softcap=0.7, sinks=np.float32([0.3, -0.2, 1.0, 0.0]), mask_fn=refused,
                              mask_buffers={})  # fmt: skip
    unseen = np.zeros((2, 40), dtype=bool)
    # causal window (3, 0): row t sees keys [t + diag - 3, t + diag], diag = 35 and 25
    unseen[0, :32] = unseen[1, :22] = unseen[1, 30:] = True
    unseen[:, 3::5] = True
    want = _backward(dout, q, k, v, seqlens_k=seqlens_k, mods=mods)
    for bad_k, bad_v in ((np.nan, np.inf), (-np.inf, np.nan)):
        k_bad, v_bad = k.copy(), v.copy()
        k_bad[unseen], v_bad[unseen] = bad_k, bad_v
        dq, dk, dv, dsinks = _backward(dout, q, k_bad, v_bad, seqlens_k=seqlens_k, mods=mods)
        assert np.isfinite(dq).all() and np.isfinite(dsinks).all()
        assert not dk[unseen].any() and not dv[unseen].any()
        for g, w in zip((dq, dk, dv, dsinks), want):
            np.testing.assert_array_equal(g, w)


def test_backward_refuses_a_score_mod():
    q, k, v = random_qkv(1, 4, 4, 2, 1, 8, "float32", seed=14)
    mods = _mods.CpuModifiers(score_fn=lambda score, **_: score, score_buffers={})
    grads = [np.zeros_like(x) for x in (q, k, v)]
    message = r"score_mod: the backward pass takes no score_mod \(it would need its derivative\)"
    with pytest.raises(ValueError, match=message):
        cpu.attention_backward_cpu(q, q, k, v, q, np.zeros((1, 2, 4), np.float32), *grads, causal=True,
                                   softmax_scale=0.35, mods=mods)  # fmt: skip
