"""cupy_gqa.attention_backward on NumPy arrays and CPU torch tensors (the NumPy
backend), its argument checks, and the torch integration: autograd through
cupy_gqa.attention, gradcheck in float64, torch.compile(fullgraph=True)."""
import numpy as np
import pytest

import cupy_gqa
from conftest import LAYOUTS, NP_DTYPES, assert_close, random_qkv, strided_view
from reference import reference_attention, reference_attention_backward

TOL = {"float32": 1e-5, "float64": 1e-12, "bfloat16": 3e-2, "float16": 4e-3}


def _forward(q, k, v, **kw):
    return cupy_gqa.attention(q, k, v, return_lse=True, **kw)


@pytest.mark.parametrize("dtype", list(NP_DTYPES))
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("heads", [(4, 4), (6, 2), (5, 1)])
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(1, 1), (19, 33), (33, 19), (1, 70)])
def test_numpy_gradients_match_the_reference(dtype, causal, heads, seqlen_q, seqlen_k):
    q, k, v = random_qkv(2, seqlen_q, seqlen_k, *heads, 16, dtype, seed=seqlen_q * 7 + seqlen_k)
    dout = random_qkv(2, seqlen_q, 1, heads[0], 1, 16, dtype, seed=5)[0]
    out, lse = _forward(q, k, v, causal=causal)
    copies = [x.copy() for x in (dout, q, k, v, out, lse)]
    dq, dk, dv = cupy_gqa.attention_backward(dout, q, k, v, out, lse, causal=causal)
    want = reference_attention_backward(dout, q, k, v, causal=causal)
    for name, g, w, x in zip(("dq", "dk", "dv"), (dq, dk, dv), want, (q, k, v)):
        assert g.shape == x.shape and g.dtype == x.dtype
        assert_close(g, w, TOL[dtype], f"{name} {dtype}")
    for x, c in zip((dout, q, k, v, out, lse), copies):  # inputs untouched
        assert np.array_equal(x.view(np.uint8), c.view(np.uint8))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_strided_inputs_and_preallocated_results(layout):
    rng = np.random.default_rng(3)
    q = strided_view(layout, rng, "float32", 2, 21, 6, 16)
    k = strided_view(layout, rng, "float32", 2, 25, 2, 16)
    v = strided_view(layout, rng, "float32", 2, 25, 2, 16)
    dout = strided_view(layout, rng, "float32", 2, 21, 6, 16)
    out, lse = _forward(q, k, v)
    wide = [np.full(x.shape[:3] + (32,), np.nan, np.float32) for x in (q, k, v)]  # strided results
    dq, dk, dv = (w[..., ::2] for w in wide)
    res = cupy_gqa.attention_backward(dout, q, k, v, out, lse, dq=dq, dk=dk, dv=dv)
    assert all(a is b for a, b in zip(res, (dq, dk, dv)))
    want = reference_attention_backward(dout, q, k, v)
    for g, w, full in zip((dq, dk, dv), want, wide):
        assert_close(g, w, 1e-5)
        assert np.isnan(full[..., 1::2]).all()  # nothing else written


def test_bhsd_layout():
    q, k, v = random_qkv(2, 17, 23, 6, 3, 8, "float32", seed=1)
    dout = random_qkv(2, 17, 1, 6, 1, 8, "float32", seed=2)[0]
    t = lambda x: np.ascontiguousarray(x.transpose(0, 2, 1, 3))  # noqa: E731
    out, lse = _forward(t(q), t(k), t(v), layout="bhsd")
    grads = cupy_gqa.attention_backward(t(dout), t(q), t(k), t(v), out, lse, layout="bhsd")
    for g, w in zip(grads, reference_attention_backward(dout, q, k, v)):
        assert_close(g.transpose(0, 2, 1, 3), w, 1e-5)


def test_seqlens_k_rows_without_keys_and_poisoned_results():
    q, k, v = random_qkv(3, 9, 6, 4, 2, 8, "float32", seed=3)
    dout = random_qkv(3, 9, 1, 4, 1, 8, "float32", seed=4)[0]
    lens = [6, 2, 0]
    k[1, 2:], v[1, 2:] = np.nan, np.inf  # past the sequence's length: never read
    out, lse = _forward(q, k, v, seqlens_k=lens)
    dq, dk, dv = (np.full(x.shape, np.nan, np.float32) for x in (q, k, v))
    cupy_gqa.attention_backward(dout, q, k, v, out, lse, seqlens_k=lens, dq=dq, dk=dk, dv=dv)
    assert np.all(dq[0, :3] == 0) and np.all(dq[1, :7] == 0) and np.all(dq[2] == 0)
    assert np.all(dk[1, 2:] == 0) and np.all(dv[1, 2:] == 0) and np.all(dk[2] == 0) and np.all(dv[2] == 0)
    for g, w in zip((dq, dk, dv), reference_attention_backward(dout, q, k, v, seqlens_k=lens)):
        assert_close(g, np.nan_to_num(w), 1e-5)


@pytest.mark.parametrize("seqlen_q,seqlen_k", [(0, 5), (5, 0), (0, 0)])
def test_empty_sequences_give_zero_gradients(seqlen_q, seqlen_k):
    q, k, v = random_qkv(2, seqlen_q, seqlen_k, 4, 2, 8, "float32")
    dout = np.ones_like(q)
    out, lse = _forward(q, k, v)
    dq, dk, dv = cupy_gqa.attention_backward(dout, q, k, v, out, lse)
    assert dq.shape == q.shape and dk.shape == k.shape and not dq.any() and not dk.any() and not dv.any()


def _args():
    q, k, v = random_qkv(2, 5, 7, 4, 2, 8, "float32")
    out, lse = _forward(q, k, v)
    return dict(dout=np.ones_like(q), q=q, k=k, v=v, out=out, lse=lse)


@pytest.mark.parametrize(
    "change,exc,message",
    [
        (lambda a: a.update(dout=a["dout"][:, :4]), ValueError, r"dout: expected shape \(2, 5, 4, 8\) \(that of q\), got \(2, 4, 4, 8\)"),
        (lambda a: a.update(out=a["out"].astype(np.float64)), TypeError, "out: expected dtype float32 \\(that of q\\), got float64"),
        (lambda a: a.update(lse=a["lse"][:, :, :3]), ValueError, r"lse: expected shape \(2, 4, 5\) \(batch, num_q_heads, seqlen_q\), got \(2, 4, 3\)"),
        (lambda a: a.update(lse=a["lse"].astype(np.float16)), TypeError, "lse: expected dtype float32 .*got float16"),
        (lambda a: a.update(lse=list(a["lse"])), TypeError, "lse: expected the same framework as q"),
        (lambda a: a.update(k=a["k"][:, :, :, :4]), ValueError, "k: expected shape"),
        (lambda a: a.update(dq=np.zeros((2, 5, 4, 4), np.float32)), ValueError, r"dq: expected shape \(2, 5, 4, 8\) \(that of q\)"),
        (lambda a: a.update(dk=np.zeros((2, 7, 2, 8), np.float64)), TypeError, r"dk: expected dtype float32 \(that of k\), got float64"),
        (lambda a: a.update(dv=a["v"]), ValueError, "dv: must not overlap the memory of v"),
        (lambda a: a.update(dq=np.broadcast_to(np.zeros(8, np.float32), (2, 5, 4, 8))), ValueError, "dq: expected no zero strides"),
        (lambda a: a.update(causal="yes"), TypeError, "causal: expected a bool, got str 'yes'"),
        (lambda a: a.update(layout="sbhd"), ValueError, "layout: expected one of"),
        (lambda a: a.update(softmax_scale=float("nan")), ValueError, "softmax_scale: expected a finite number, got nan"),
        (lambda a: a.update(seqlens_k=[1, 8]), ValueError, r"seqlens_k: expected values in \[0, 7\]"),
    ],
)
def test_bad_input_is_refused(change, exc, message):
    args = _args()
    change(args)
    before = {n: np.array(x, copy=True) for n, x in args.items() if isinstance(x, np.ndarray)}
    with pytest.raises(exc, match=message):
        cupy_gqa.attention_backward(**args)
    for n, x in before.items():
        assert np.array_equal(args[n], x, equal_nan=True)


def test_results_must_not_overlap_each_other():
    args = _args()
    buf = np.zeros((2, 7, 2, 8), np.float32)
    with pytest.raises(ValueError, match="dv: must not overlap the memory of dk"):
        cupy_gqa.attention_backward(**args, dk=buf, dv=buf)


# --- torch --------------------------------------------------------------------------


@pytest.fixture
def torch():
    return pytest.importorskip("torch")


def _torch_qkv(torch, shape_q, shape_kv, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g, dtype=torch.float64).to(dtype).requires_grad_() for s in (shape_q, shape_kv, shape_kv)]


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("shapes", [((1, 4, 4, 8), (1, 6, 2, 8)), ((2, 6, 3, 4), (2, 3, 1, 4)), ((1, 5, 2, 3), (1, 5, 2, 3))])
def test_gradcheck_float64(torch, causal, shapes):
    q, k, v = _torch_qkv(torch, *shapes, torch.float64, seed=len(shapes[0]))
    assert torch.autograd.gradcheck(lambda a, b, c: cupy_gqa.attention(a, b, c, causal=causal), (q, k, v))


def test_gradcheck_seqlens_k_scale_and_bhsd(torch):
    q, k, v = _torch_qkv(torch, (2, 3, 5, 4), (2, 1, 6, 4), torch.float64, seed=3)  # bhsd
    fn = lambda a, b, c: cupy_gqa.attention(a, b, c, seqlens_k=[4, 6], softmax_scale=0.8, layout="bhsd")  # noqa: E731
    assert torch.autograd.gradcheck(fn, (q, k, v))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_autograd_matches_torch_sdpa(torch, dtype):
    """Gradients through cupy_gqa.attention against torch's own sdpa on expanded K/V."""
    tdtype = getattr(torch, dtype)
    q, k, v = _torch_qkv(torch, (2, 4, 13, 16), (2, 2, 13, 16), tdtype, seed=7)  # bhsd
    out = cupy_gqa.attention(q, k, v, layout="bhsd")
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    ref = torch.nn.functional.scaled_dot_product_attention(
        q64, k64.repeat_interleave(2, dim=1), v64.repeat_interleave(2, dim=1), is_causal=True
    )
    want = torch.autograd.grad(ref, (q64, k64, v64), dout.double())
    for g, w in zip(grads, want):
        assert g.dtype == tdtype
        assert_close(g.double().numpy(), w.numpy(), TOL[dtype])


def test_lse_is_not_differentiable_and_out_is_refused(torch):
    q, k, v = _torch_qkv(torch, (1, 4, 2, 8), (1, 4, 2, 8), torch.float32)
    out, lse = cupy_gqa.attention(q, k, v, return_lse=True)
    assert out.requires_grad and not lse.requires_grad
    with pytest.raises(ValueError, match="out: expected None when q, k or v requires grad"):
        cupy_gqa.attention(q, k, v, out=torch.empty(1, 4, 2, 8))
    with torch.no_grad():  # no autograd: no custom op, and out= works
        res = cupy_gqa.attention(q, k, v, out=torch.empty(1, 4, 2, 8))
    assert not res.requires_grad
    assert torch.equal(res, out.detach())


def test_bad_input_under_autograd_names_the_argument(torch):
    q, k, v = _torch_qkv(torch, (1, 4, 2, 8), (1, 4, 2, 8), torch.float32)
    with pytest.raises(ValueError, match=r"v: expected shape \(1, 4, 2, 8\) \(that of k\)"):
        cupy_gqa.attention(q, k, v[:, :3])
    with pytest.raises(TypeError, match="softmax_scale: expected a real number or None, got str"):
        cupy_gqa.attention(q, k, v, softmax_scale="x")
    with pytest.raises(TypeError, match="seqlens_k: expected an integer dtype, got float64"):
        cupy_gqa.attention(q, k, v, seqlens_k=[1.0])


# The built-in modifiers through the public API: (kwargs, causal), scores of a few units so that the softcap bends them.
_MODS = {
    "window": ({"window": (3, 0)}, True),
    "window_noncausal": ({"window": (2, 4)}, False),
    "softcap": ({"softcap": 1.5}, True),
    "sinks": ({"sinks": "sinks"}, True),
    "alibi": ({"alibi_slopes": "slopes"}, False),
    "alibi_batch": ({"alibi_slopes": "batch_slopes"}, True),
    "all": ({"window": (4, 0), "softcap": 1.5, "sinks": "sinks", "alibi_slopes": "slopes"}, True),
}


def _mod_kwargs(name, num_q_heads, batch, seed):
    rng = np.random.default_rng(seed)
    made = {"sinks": rng.standard_normal(num_q_heads).astype(np.float32),
            "slopes": (2.0 ** -np.arange(1, num_q_heads + 1)).astype(np.float32),
            "batch_slopes": rng.uniform(0.05, 0.5, (batch, num_q_heads)).astype(np.float32)}  # fmt: skip
    kw, causal = _MODS[name]
    return {n: made[x] if isinstance(x, str) else x for n, x in kw.items()}, causal


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("name", list(_MODS))
def test_numpy_gradients_with_modifiers_match_the_reference(dtype, name):
    """attention_backward with the forward's modifiers: (dq, dk, dv) against the float64 reference,
    and with sinks a fourth result, the sinks' gradient (float32, (num_q_heads,))."""
    q, k, v = random_qkv(2, 23, 31, 6, 2, 16, dtype, seed=len(name))
    q, k = q * 2, k * 2
    dout = random_qkv(2, 23, 1, 6, 1, 16, dtype, seed=9)[0]
    kw, causal = _mod_kwargs(name, 6, 2, seed=3)
    out, lse = _forward(q, k, v, causal=causal, **kw)
    grads = cupy_gqa.attention_backward(dout, q, k, v, out, lse, causal=causal, **kw)
    want = reference_attention_backward(dout, q, k, v, causal=causal, **kw)
    assert len(grads) == len(want) == (4 if "sinks" in kw else 3)
    for g, w, what in zip(grads, want, ("dq", "dk", "dv", "dsinks")):
        assert_close(g, w, TOL[dtype] if what != "dsinks" else 1e-5, f"{what} {name} {dtype}")
    if "sinks" in kw:
        assert grads[3].dtype == np.float32 and grads[3].shape == (6,)


def test_backward_modifier_checks():
    """A score_mod has no derivative here: refused by name; the modifiers' own checks as the forward's."""
    q, k, v = random_qkv(1, 5, 5, 4, 2, 8, "float32", seed=1)
    out, lse = _forward(q, k, v)
    score = cupy_gqa.ScoreMod(cuda="return score;", numpy=lambda score, **_: score)
    with pytest.raises(ValueError, match=r"^score_mod: expected None, got a ScoreMod: the backward pass takes no score_mod"):
        cupy_gqa.attention_backward(out, q, k, v, out, lse, score_mod=score)
    with pytest.raises(ValueError, match=r"^sinks: expected shape \(4,\) \(num_q_heads,\), got \(3,\)"):
        cupy_gqa.attention_backward(out, q, k, v, out, lse, sinks=np.zeros(3, np.float32))
    with pytest.raises(TypeError, match="^sinks: expected dtype float32, got float64"):
        cupy_gqa.attention_backward(out, q, k, v, out, lse, sinks=np.zeros(4))
    with pytest.raises(ValueError, match="^softcap: expected a finite number > 0"):
        cupy_gqa.attention_backward(out, q, k, v, out, lse, softcap=-1.0)
    with pytest.raises(TypeError, match="^window: expected"):
        cupy_gqa.attention_backward(out, q, k, v, out, lse, window=3)


@pytest.mark.parametrize("name", list(_MODS))
def test_autograd_with_builtin_modifiers_matches_the_reference(torch, name):
    """The built-in modifiers go through the autograd op: every gradient (the sinks' too, when they
    require grad) is the float64 reference's; out is the forward's."""
    q, k, v = random_qkv(2, 11, 14, 6, 3, 8, "float64", seed=len(name) + 1)
    q, k = q * 2, k * 2
    dout = random_qkv(2, 11, 1, 6, 1, 8, "float64", seed=4)[0]
    kw, causal = _mod_kwargs(name, 6, 2, seed=5)
    tkw = {n: torch.tensor(x, requires_grad=n == "sinks") if isinstance(x, np.ndarray) else x for n, x in kw.items()}
    tq, tk, tv = (torch.tensor(x, requires_grad=True) for x in (q, k, v))
    out = cupy_gqa.attention(tq, tk, tv, causal=causal, **tkw)
    assert out.requires_grad
    out.backward(torch.tensor(dout))
    want = reference_attention_backward(dout, q, k, v, causal=causal, **kw)
    got = [tq.grad, tk.grad, tv.grad] + ([tkw["sinks"].grad] if "sinks" in kw else [])
    for g, w, what in zip(got, want, ("dq", "dk", "dv", "dsinks")):
        assert_close(g.numpy(), w, 1e-12 if what != "dsinks" else 1e-5, f"{what} {name}")
    assert_close(out.detach().numpy(), reference_attention(q, k, v, causal=causal, **kw)[0], 1e-12)
    if "alibi_slopes" in kw:
        assert tkw["alibi_slopes"].grad is None  # not a parameter of the attention


def test_autograd_through_the_sinks_alone(torch):
    """Sinks that require grad (gpt-oss learns them) take the autograd op even when q, k and v don't."""
    q, k, v = (torch.tensor(x) for x in random_qkv(1, 6, 6, 4, 2, 8, "float64", seed=2))
    sinks = torch.zeros(4, dtype=torch.float32, requires_grad=True)
    cupy_gqa.attention(q, k, v, sinks=sinks).sum().backward()
    assert sinks.grad is not None and sinks.grad.shape == (4,) and bool((sinks.grad != 0).all())
    mask = cupy_gqa.MaskMod(cuda="return true;", numpy=lambda kv_idx, **_: kv_idx >= 0)
    with pytest.raises(ValueError, match="^mask_mod: expected None when q, k, v or the sinks require grad"):
        cupy_gqa.attention(q, k, v, sinks=sinks, mask_mod=mask)


@pytest.mark.parametrize("name", ["score_mod", "mask_mod"])
def test_user_modifiers_under_autograd_are_refused_by_name(torch, name):
    """A score_mod has no derivative, and the autograd op carries no mask_mod: a call that needs
    autograd refuses them, naming the modifier; without autograd (no_grad, or inputs that don't
    require grad) they run."""
    q, k, v = _torch_qkv(torch, (1, 5, 4, 8), (1, 5, 2, 8), torch.float32)
    value = {
        "score_mod": cupy_gqa.ScoreMod(cuda="return score;", numpy=lambda score, **_: score),
        "mask_mod": cupy_gqa.MaskMod(cuda="return true;", numpy=lambda kv_idx, **_: kv_idx >= 0),
    }[name]
    with pytest.raises(ValueError, match=rf"^{name}: expected None when q, k, v or the sinks require grad"):
        cupy_gqa.attention(q, k, v, **{name: value})
    with torch.no_grad():
        out = cupy_gqa.attention(q, k, v, **{name: value})
    assert not out.requires_grad
    assert torch.equal(cupy_gqa.attention(q.detach(), k.detach(), v.detach(), **{name: value}), out)


def test_backward_of_a_torch_call(torch):
    """attention_backward on CPU torch tensors gives torch tensors."""
    q, k, v = (x.detach() for x in _torch_qkv(torch, (1, 6, 4, 8), (1, 6, 2, 8), torch.float32))
    out, lse = cupy_gqa.attention(q, k, v, return_lse=True)
    dout = torch.randn_like(out)
    dq, dk, dv = cupy_gqa.attention_backward(dout, q, k, v, out, lse)
    assert all(isinstance(g, torch.Tensor) for g in (dq, dk, dv))
    for g, w in zip((dq, dk, dv), reference_attention_backward(*(x.numpy() for x in (dout, q, k, v)))):
        assert_close(g.numpy(), w, 1e-5)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_torch_compile_fullgraph_forward_and_backward(torch, backend):
    """No graph break: the custom op and its fake implementation trace, forward and backward."""
    import torch._dynamo

    torch._dynamo.reset()

    def f(q, k, v, w):
        y = cupy_gqa.attention(q @ w, k, v, causal=True, layout="bhsd")
        return (y * y).sum()

    q, k, v = _torch_qkv(torch, (2, 4, 9, 8), (2, 2, 9, 8), torch.float32, seed=2)
    w = torch.eye(8, requires_grad=True)
    compiled = torch.compile(f, fullgraph=True, backend=backend)
    try:
        loss = compiled(q, k, v, w)
    except Exception as e:  # inductor needs a working C++ toolchain on the CPU
        if backend == "inductor" and "Dynamo" not in type(e).__name__ and "Unsupported" not in str(type(e)):
            pytest.skip(f"inductor cannot build for the CPU here: {type(e).__name__}")
        raise
    got = torch.autograd.grad(loss, (q, k, v, w))
    want_loss = f(q, k, v, w)
    want = torch.autograd.grad(want_loss, (q, k, v, w))
    torch.testing.assert_close(loss, want_loss)
    for g, x in zip(got, want):
        torch.testing.assert_close(g, x)


def test_import_without_torch_needs_no_torch():
    """The torch module is imported only for torch tensors (tests/test_no_cupy.py runs without torch)."""
    import subprocess
    import sys

    code = "import sys, cupy_gqa, numpy as np; q = np.ones((1, 2, 2, 4), np.float32); cupy_gqa.attention(q, q, q); print('torch' in sys.modules)"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert res.stdout.strip() == "False"
