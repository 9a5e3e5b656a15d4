"""The backward pass on the GPU (kernels/backward.cu through cupy_gqa.attention_backward
and torch autograd), against the float64 reference and torch's own backward.

Each gradient's relative error against the float64 definition must be at most
twice that of torch's sdpa backward in the same dtype (on K/V expanded to every
query head, with the same bottom-right mask) plus a small slack; where torch
can't serve as a yardstick (rows that see no key, which torch turns into NaN)
a fixed bound applies. Results are poisoned with NaN before each call, so an
unwritten element fails; inputs must come back untouched.
"""
import numpy as np
import pytest

import cupy_gqa
from conftest import NP_DTYPES, assert_close, gpu_available, random_qkv, relative_error
from reference import reference_attention_backward

pytestmark = pytest.mark.gpu
if gpu_available():
    import cupy

HEADS = {"MHA": (4, 4), "GQA4": (8, 2), "GQA7": (7, 1), "MQA": (4, 1)}
LENGTHS = [(1, 1), (113, 203), (203, 113), (64, 1), (1, 300), (257, 257), (7, 1000)]
# the bound where torch gives no yardstick, and the slack over 2x torch's error
BOUND = {"float16": 4e-3, "bfloat16": 3e-2, "float32": 1e-5, "float64": 1e-10}
SLACK = {"float16": 1e-3, "bfloat16": 5e-3, "float32": 2e-6, "float64": 1e-11}


def _torch_cuda():
    try:
        import torch
    except ImportError:
        return None
    return torch if torch.cuda.is_available() else None


def run_backward(q, k, v, dout, *, causal=True, softmax_scale=None, seqlens_k=None, views=None):
    """(dq, dk, dv) as NumPy from the GPU, for NumPy inputs (or CuPy ``views`` of them),
    into NaN-poisoned results; checks that the inputs are untouched."""
    qd, kd, vd, dd = views or tuple(cupy.asarray(x) for x in (q, k, v, dout))
    out, lse = cupy_gqa.attention(qd, kd, vd, causal=causal, softmax_scale=softmax_scale, seqlens_k=seqlens_k, return_lse=True)
    before = [cupy.asnumpy(x).copy() for x in (qd, kd, vd, dd, out, lse)]
    grads = tuple(cupy.full(x.shape, np.nan, dtype=x.dtype) for x in (qd, kd, vd))
    res = cupy_gqa.attention_backward(
        dd, qd, kd, vd, out, lse, causal=causal, softmax_scale=softmax_scale, seqlens_k=seqlens_k,
        dq=grads[0], dk=grads[1], dv=grads[2],
    )
    assert all(a is b for a, b in zip(res, grads))
    for x, b in zip((qd, kd, vd, dd, out, lse), before):
        assert np.array_equal(cupy.asnumpy(x).view(np.uint8), b.view(np.uint8)), "an input was modified"
    return tuple(cupy.asnumpy(g) for g in grads)


def torch_backward(q, k, v, dout, *, causal=True, softmax_scale=None):
    """torch's sdpa backward in the inputs' dtype on CUDA, K/V expanded, bottom-right mask."""
    torch = _torch_cuda()
    dtype = getattr(torch, q.dtype.name)
    to = lambda x: torch.from_numpy(x.astype(np.float32) if x.dtype.name == "bfloat16" else x).to("cuda", dtype)  # noqa: E731
    group = q.shape[2] // k.shape[2]
    tq = to(q).transpose(1, 2).requires_grad_()
    tk = to(k).transpose(1, 2).requires_grad_()
    tv = to(v).transpose(1, 2).requires_grad_()
    mask = None
    if causal:
        sq, sk = q.shape[1], k.shape[1]
        i = torch.arange(sq, device="cuda")[:, None]
        mask = torch.arange(sk, device="cuda")[None, :] <= i + sk - sq
    out = torch.nn.functional.scaled_dot_product_attention(
        tq, tk.repeat_interleave(group, dim=1), tv.repeat_interleave(group, dim=1), attn_mask=mask, scale=softmax_scale
    )
    grads = torch.autograd.grad(out, (tq, tk, tv), to(dout).transpose(1, 2))
    return tuple(g.transpose(1, 2).float().cpu().numpy() if dtype == torch.bfloat16 else g.transpose(1, 2).cpu().numpy() for g in grads)


def check_against_reference(got, q, k, v, dout, what, *, causal=True, softmax_scale=None, seqlens_k=None, torch_ok=True):
    dtype = q.dtype.name
    want = reference_attention_backward(dout, q, k, v, causal=causal, softmax_scale=softmax_scale, seqlens_k=seqlens_k)
    theirs = None
    if torch_ok and seqlens_k is None and _torch_cuda() is not None and (not causal or q.shape[1] <= k.shape[1]):
        theirs = torch_backward(q, k, v, dout, causal=causal, softmax_scale=softmax_scale)
    for name, g, w, t in zip(("dq", "dk", "dv"), got, want, theirs or (None,) * 3):
        theirs_err = None if t is None else relative_error(t, w)
        if theirs_err is None or not np.isfinite(theirs_err):  # no torch result (or torch's is NaN: negative scales)
            tol = BOUND[dtype]
        else:
            tol = 2 * theirs_err + SLACK[dtype]
        assert_close(g, w, tol, f"{what} {name} {dtype}" + ("" if t is None else f" (torch {theirs_err:.2e})"))


def _dout(q, seed=11):
    return random_qkv(q.shape[0], q.shape[1], 1, q.shape[2], 1, q.shape[3], q.dtype.name, seed=seed)[0]


@pytest.mark.parametrize("dtype", list(NP_DTYPES))
@pytest.mark.parametrize("heads", list(HEADS))
@pytest.mark.parametrize("seqlen_q,seqlen_k", LENGTHS)
@pytest.mark.parametrize("causal", [True, False])
def test_heads_and_lengths(dtype, heads, seqlen_q, seqlen_k, causal):
    q, k, v = random_qkv(2, seqlen_q, seqlen_k, *HEADS[heads], 64, dtype, seed=seqlen_q + seqlen_k)
    dout = _dout(q)
    got = run_backward(q, k, v, dout, causal=causal)
    check_against_reference(got, q, k, v, dout, f"{heads} {seqlen_q}x{seqlen_k}", causal=causal)


@pytest.mark.parametrize("dtype", list(NP_DTYPES))
@pytest.mark.parametrize("head_dim", [1, 8, 20, 32, 40, 64, 80, 96, 128, 136, 160, 192, 200, 256])
@pytest.mark.parametrize("causal", [True, False])
def test_head_dims(dtype, head_dim, causal):
    """Every padded head dim of the tensor-core kernels (multiples of 8) and the
    CUDA-core kernels' buckets (the others)."""
    q, k, v = random_qkv(2, 97, 150, 8, 2, head_dim, dtype, seed=head_dim)
    dout = _dout(q)
    got = run_backward(q, k, v, dout, causal=causal)
    check_against_reference(got, q, k, v, dout, f"D{head_dim}", causal=causal)


@pytest.mark.parametrize("dtype", list(NP_DTYPES))
@pytest.mark.parametrize("device_lens", [False, True])
def test_seqlens_k(dtype, device_lens):
    """Keys past a sequence's length get dk = dv = 0, rows that see no key dq = 0;
    NaN and Inf past the length are never read."""
    q, k, v = random_qkv(4, 40, 90, 8, 2, 64, dtype, seed=4)
    lens = np.array([90, 37, 0, 5])
    k[1, 37:], v[1, 37:] = np.nan, np.inf
    dout = _dout(q)
    seqlens = cupy.asarray(lens.astype(np.int32)) if device_lens else lens
    dq, dk, dv = run_backward(q, k, v, dout, seqlens_k=seqlens)
    assert np.all(dk[1, 37:] == 0) and np.all(dv[1, 37:] == 0) and np.all(dk[2] == 0) and np.all(dq[2] == 0)
    assert np.all(dq[3, :35] == 0)  # 40 queries on 5 keys, bottom-right: the first 35 see none
    want = [np.nan_to_num(w) for w in reference_attention_backward(dout, q, k, v, seqlens_k=lens)]
    for name, g, w in zip(("dq", "dk", "dv"), (dq, dk, dv), want):
        assert_close(g, w, BOUND[dtype], f"seqlens_k {name}")


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_bad_device_seqlens_k_gives_nan_gradients_of_that_batch(dtype):
    q, k, v = random_qkv(2, 16, 32, 4, 2, 64, dtype, seed=5)
    dout = _dout(q)
    qd, kd, vd, dd = (cupy.asarray(x) for x in (q, k, v, dout))
    out, lse = cupy_gqa.attention(qd, kd, vd, return_lse=True)
    lens = cupy.asarray(np.array([32, 33], np.int32))  # 33 > seqlen_k: not checked on the host
    dq, dk, dv = (cupy.asnumpy(g) for g in cupy_gqa.attention_backward(dd, qd, kd, vd, out, lse, seqlens_k=lens))
    assert np.isnan(dq[1]).all() and np.isnan(dk[1]).all() and np.isnan(dv[1]).all()
    assert np.isfinite(dq[0]).all() and np.isfinite(dk[0]).all()


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("layout", ["packed_qkv", "bhsd_transposed", "strided_head_dim", "bhsd_layout"])
def test_strided_inputs_and_results(dtype, layout):
    rng = np.random.default_rng(7)
    hq, hkv, d, s = 8, 2, 64, 77
    draw = lambda shape: cupy.asarray(rng.standard_normal(shape).astype(NP_DTYPES[dtype]))  # noqa: E731
    if layout == "packed_qkv":
        packed = draw((2, s, hq + 2 * hkv, d))
        views = packed[:, :, :hq], packed[:, :, hq : hq + hkv], packed[:, :, hq + hkv :], draw((2, s, hq + 1, d))[:, :, 1:]
    elif layout in ("bhsd_transposed", "bhsd_layout"):
        views = tuple(draw((2, h, s, d)).transpose(0, 2, 1, 3) for h in (hq, hkv, hkv, hq))
    else:
        views = tuple(draw((2, s, h, 2 * d))[..., ::2] for h in (hq, hkv, hkv, hq))
    host = [cupy.asnumpy(x) for x in views]
    if layout == "bhsd_layout":  # the arrays in (batch, heads, seq, dim) order, layout="bhsd"
        bv = [x.transpose(0, 2, 1, 3) for x in views]
        out, lse = cupy_gqa.attention(*bv[:3], return_lse=True, layout="bhsd")
        grads = cupy_gqa.attention_backward(bv[3], *bv[:3], out, lse, layout="bhsd")
        got = [cupy.asnumpy(g.transpose(0, 2, 1, 3)) for g in grads]
    else:
        out, lse = cupy_gqa.attention(*views[:3], return_lse=True)
        wide = [cupy.full(x.shape[:3] + (2 * d,), np.nan, dtype=x.dtype) for x in views[:3]]  # strided results
        cupy_gqa.attention_backward(views[3], *views[:3], out, lse, dq=wide[0][..., 1::2], dk=wide[1][..., 1::2], dv=wide[2][..., 1::2])
        got = [cupy.asnumpy(w[..., 1::2]) for w in wide]
        assert all(bool(cupy.isnan(w[..., ::2]).all()) for w in wide)  # nothing else written
    check_against_reference(got, *host[:3], host[3], layout, torch_ok=False)


@pytest.mark.parametrize("dtype", list(NP_DTYPES))
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("head_dim", [128, 256])
def test_deterministic(dtype, causal, head_dim):
    """Two calls (and a third after other work) give bitwise-equal gradients (at head dim
    256 the tensor-core kernels split a slab's head dims between warps)."""
    head_dim = head_dim if dtype != "float64" else head_dim // 2
    q, k, v = (cupy.asarray(x) for x in random_qkv(2, 300, 300, 8, 2, head_dim, dtype, seed=3))
    dout = cupy.asarray(_dout(cupy.asnumpy(q)))
    out, lse = cupy_gqa.attention(q, k, v, causal=causal, return_lse=True)
    first = [cupy.asnumpy(g) for g in cupy_gqa.attention_backward(dout, q, k, v, out, lse, causal=causal)]
    for _ in range(2):
        cupy_gqa.attention(q, k, v)  # other work in between
        again = [cupy.asnumpy(g) for g in cupy_gqa.attention_backward(dout, q, k, v, out, lse, causal=causal)]
        for a, b in zip(first, again):
            assert np.array_equal(a.view(np.uint8), b.view(np.uint8))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("causal", [True, False])
def test_hopper_backward_kinds_agree_and_repeat(dtype, causal):
    """On sm_90 the kernels with a producer warpgroup ("ws", the calls' own) and
    the mma.sync ones (_specs.BWD_SM90_KINDS) each repeat bit for bit and give
    the same dq, dk and dv bit for bit (the same products in the same order).
    17 key blocks on 8 (batch, KV head) pairs: more CTAs than the GPU's SMs."""
    from cupy_gqa import _plan

    if cupy.cuda.Device().compute_capability != "90":
        pytest.skip("sm_90 kernels")
    q, k, v = (cupy.asarray(x) for x in random_qkv(2, 2100, 2100, 16, 4, 128, dtype, seed=5))
    dout = cupy.asarray(_dout(cupy.asnumpy(q)))
    out, lse = cupy_gqa.attention(q, k, v, causal=causal, return_lse=True)
    grads = {}
    for kind in _plan._specs.BWD_SM90_KINDS:
        old = _plan.set_bwd_sm90(kind)
        try:
            runs = [[cupy.asnumpy(g) for g in cupy_gqa.attention_backward(dout, q, k, v, out, lse, causal=causal)]
                    for _ in range(2)]
        finally:
            _plan.set_bwd_sm90(old)
        for a, b in zip(*runs):
            assert np.array_equal(a.view(np.uint8), b.view(np.uint8)), f"{kind}: two calls differ"
        grads[kind] = runs[0]
    for kind, got in grads.items():
        for name, g, m in zip(("dq", "dk", "dv"), got, grads["mma"]):
            assert np.array_equal(g.view(np.uint8), m.view(np.uint8)), f"{kind} {name}"


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("softmax_scale", [1.0, -0.5])
@pytest.mark.parametrize("head_dim", [32, 128])
def test_large_scores_and_custom_scale(dtype, softmax_scale, head_dim):
    """Scores of several hundred, and a negative scale (the CUDA-core kernels then).
    In float32 the dK/dV pass must see the very scores whose lse the dQ pass
    rebuilt: one ulp of a score of several hundred moves P by 1e-5."""
    q, k, v = random_qkv(1, 65, 65, 4, 2, head_dim, dtype, seed=8, scale=6.0 if dtype != "float16" else 3.0)
    dout = _dout(q)
    got = run_backward(q, k, v, dout, softmax_scale=softmax_scale)
    check_against_reference(got, q, k, v, dout, f"scale {softmax_scale}", softmax_scale=softmax_scale)


def _random_case(seed):
    rng = np.random.default_rng(seed)
    num_kv = int(rng.integers(1, 4))
    return dict(
        batch=int(rng.integers(1, 4)), seqlen_q=int(rng.integers(1, 300)), seqlen_k=int(rng.integers(1, 300)),
        heads=(num_kv * int(rng.integers(1, 7)), num_kv), head_dim=int(rng.choice([8, 16, 24, 32, 48, 64, 72, 96, 128, 160, 256])),
        dtype=str(rng.choice(list(NP_DTYPES))), causal=bool(rng.integers(0, 2)),
    )  # fmt: skip


@pytest.mark.parametrize("seed", range(40))
def test_random_calls(seed):
    c = _random_case(seed)
    q, k, v = random_qkv(c["batch"], c["seqlen_q"], c["seqlen_k"], *c["heads"], c["head_dim"], c["dtype"], seed=seed)
    dout = _dout(q, seed + 1)
    got = run_backward(q, k, v, dout, causal=c["causal"])
    check_against_reference(got, q, k, v, dout, str(c), causal=c["causal"])


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("head_dim", [64, 120])
def test_float32_wide_key_blocks(monkeypatch, causal, head_dim):
    """float32's dK/dV kernel with its wide key blocks (_specs.BWD_TF32_DKDV_WIDE,
    where they fit as measured: sm_90), which a call takes where the grid is long
    against the SMs (here: a GPU of one SM; of a million, the table's kernel),
    against the float64 reference and, where the two share their row tiles (head
    dim 64), bit for bit against the table's kernel; with seqlens_k."""
    from cupy_gqa import _plan, _specs

    launched = []
    get = _plan.get_kernel
    monkeypatch.setattr(_plan, "get_kernel", lambda spec: launched.append(spec.name) or get(spec))
    arch = _plan.device_arch(cupy.cuda.Device().id)
    dpad = _specs.bwd_head_dim_pad(head_dim)
    if _specs.bwd_dkdv_tf32_spec(dpad, causal, arch, wide=True) is None:
        pytest.skip(f"no wide float32 dK/dV kernel on {arch.name}")
    q, k, v = random_qkv(3, 333, 1400, 8, 2, head_dim, "float32", seed=head_dim)
    dout = _dout(q)
    lens = [1400, 777, 0]
    grads = {}
    for sms, wide in ((10**6, False), (1, True)):
        monkeypatch.setattr(_plan, "sm_count", lambda device: sms)
        launched.clear()
        grads[wide] = run_backward(q, k, v, dout, causal=causal, seqlens_k=lens)
        assert _specs.bwd_dkdv_tf32_spec(dpad, causal, arch, wide=wide).name in launched, launched
        check_against_reference(grads[wide], q, k, v, dout, f"wide {wide}", causal=causal, seqlens_k=lens)
    if head_dim == 64:
        for name, a, b in zip(("dq", "dk", "dv"), grads[False], grads[True]):
            assert np.array_equal(a.view(np.uint8), b.view(np.uint8)), name


@pytest.mark.parametrize("cc", [(8, 6), (7, 5)])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("head_dim", [64, 128, 192, 256])
def test_other_architectures_tables(monkeypatch, cc, dtype, head_dim):
    """The backward kernels of sm_86's table (99 KB of shared memory: smaller
    tiles) and sm_75's (no mma.sync: the CUDA-core kernels), run on this GPU."""
    from cupy_gqa import _plan

    monkeypatch.setattr(_plan, "compute_capability", lambda device: cc)
    q, k, v = random_qkv(2, 130, 150, 8, 2, head_dim, dtype, seed=head_dim)
    dout = _dout(q)
    got = run_backward(q, k, v, dout)
    check_against_reference(got, q, k, v, dout, f"sm_{cc[0]}{cc[1]}", torch_ok=False)


def test_empty_and_zero_length_calls():
    for sq, sk in ((0, 5), (5, 0)):
        q, k, v = (cupy.asarray(x) for x in random_qkv(2, sq, sk, 4, 2, 64, "float16"))
        out, lse = cupy_gqa.attention(q, k, v, return_lse=True)
        dq, dk, dv = cupy_gqa.attention_backward(cupy.ones_like(q), q, k, v, out, lse)
        assert not bool(dq.any()) and not bool(dk.any()) and not bool(dv.any())


# --- torch ---------------------------------------------------------------------------


@pytest.fixture
def torch():
    t = pytest.importorskip("torch")
    if not t.cuda.is_available():
        pytest.skip("torch without CUDA")
    return t


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("shapes", [((1, 5, 4, 8), (1, 7, 2, 8)), ((2, 7, 3, 16), (2, 4, 1, 16))])
def test_gradcheck_float64_cuda(torch, causal, shapes):
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(s, generator=g, device="cuda", dtype=torch.float64, requires_grad=True) for s in (shapes[0], shapes[1], shapes[1]))
    assert torch.autograd.gradcheck(lambda a, b, c: cupy_gqa.attention(a, b, c, causal=causal), (q, k, v))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_torch_autograd_on_cuda(torch, dtype):
    """cupy_gqa.attention's autograd gives attention_backward's gradients, on torch's stream."""
    tdtype = getattr(torch, dtype)
    q = torch.randn(2, 300, 8, 64, device="cuda", dtype=tdtype, requires_grad=True)
    k = torch.randn(2, 300, 2, 64, device="cuda", dtype=tdtype, requires_grad=True)
    v = torch.randn(2, 300, 2, 64, device="cuda", dtype=tdtype, requires_grad=True)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())  # the inputs are ready
    with torch.cuda.stream(stream):
        out = cupy_gqa.attention(q, k, v)
        dout = torch.randn_like(out)
        grads = torch.autograd.grad(out, (q, k, v), dout)
        out2, lse = cupy_gqa.attention(q.detach(), k.detach(), v.detach(), return_lse=True)
        direct = cupy_gqa.attention_backward(dout, q.detach(), k.detach(), v.detach(), out2, lse)
    stream.synchronize()
    for a, b in zip(grads, direct):
        assert torch.equal(a, b)


def test_torch_compile_on_cuda(torch):
    def f(q, k, v):
        return cupy_gqa.attention(q, k, v, layout="bhsd").float().square().sum()

    q = torch.randn(2, 8, 100, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(2, 2, 100, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(2, 2, 100, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    loss = torch.compile(f, fullgraph=True)(q, k, v)
    got = torch.autograd.grad(loss, (q, k, v))
    want = torch.autograd.grad(f(q, k, v), (q, k, v))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


# ---- the modifiers (window, softcap, sinks, ALiBi, mask_mod) --------------------------------
MOD_CASES = {
    "window": ({"window": (37, 0)}, True),
    "window_noncausal": ({"window": (21, 13)}, False),
    "softcap": ({"softcap": 2.5}, True),
    "sinks": ({"sinks": "sinks"}, True),
    "alibi": ({"alibi_slopes": "slopes"}, True),
    "alibi_batch_noncausal": ({"alibi_slopes": "batch_slopes"}, False),
    "mask_mod": ({"mask_mod": "mask"}, True),
    "all": ({"window": (45, 0), "softcap": 3.0, "sinks": "sinks", "alibi_slopes": "slopes", "mask_mod": "mask"}, True),
}


def _mod_kwargs(name, batch, hq, seed=3):
    from test_modifiers import even_heads_odd_keys_mod

    rng = np.random.default_rng(seed)
    made = {"sinks": rng.standard_normal(hq).astype(np.float32),
            "slopes": (2.0 ** -np.arange(1, hq + 1)).astype(np.float32),
            "batch_slopes": rng.uniform(0.02, 0.3, (batch, hq)).astype(np.float32), "mask": even_heads_odd_keys_mod()}  # fmt: skip
    kw, causal = MOD_CASES[name]
    return {n: made[x] if isinstance(x, str) else x for n, x in kw.items()}, causal


def run_backward_mods(q, k, v, dout, kw, causal):
    """(dq, dk, dv[, dsinks]) as NumPy from the GPU with modifiers ``kw`` (host arrays as given),
    into NaN-poisoned results; the inputs untouched."""
    qd, kd, vd, dd = (cupy.asarray(x) for x in (q, k, v, dout))
    kwd = {n: cupy.asarray(x) if isinstance(x, np.ndarray) else x for n, x in kw.items()}
    out, lse = cupy_gqa.attention(qd, kd, vd, causal=causal, return_lse=True, **kwd)
    before = [cupy.asnumpy(x).copy() for x in (qd, kd, vd, dd, out, lse)]
    grads = tuple(cupy.full(x.shape, np.nan, dtype=x.dtype) for x in (qd, kd, vd))
    res = cupy_gqa.attention_backward(dd, qd, kd, vd, out, lse, causal=causal, dq=grads[0], dk=grads[1], dv=grads[2],
                                      **kwd)  # fmt: skip
    assert all(a is b for a, b in zip(res, grads)) and len(res) == (4 if "sinks" in kw else 3)
    for x, b in zip((qd, kd, vd, dd, out, lse), before):
        assert np.array_equal(cupy.asnumpy(x).view(np.uint8), b.view(np.uint8)), "an input was modified"
    return tuple(cupy.asnumpy(g) for g in res)


def check_mods(got, q, k, v, dout, kw, causal, what):
    want = reference_attention_backward(dout, q, k, v, causal=causal, **kw)
    dtype = q.dtype.name
    for name, g, w in zip(("dq", "dk", "dv", "dsinks"), got, want):
        assert_close(g, w, BOUND[dtype] if name != "dsinks" else max(BOUND[dtype], 1e-5), f"{what} {name} {dtype}")


@pytest.mark.parametrize("dtype", list(NP_DTYPES))
@pytest.mark.parametrize("head_dim", [20, 64, 96, 128])
@pytest.mark.parametrize("name", list(MOD_CASES))
@pytest.mark.parametrize("kind", ["ws", "mma"])
def test_modifiers(dtype, head_dim, name, kind):
    """Each modifier (and all of them) against the float64 reference: fp16 / bf16 on the tensor
    cores (on sm_90 both kinds: the producer-warpgroup pair, which ALiBi and a mask_mod leave for the
    mma.sync one, and the mma.sync pair), float32 and float64 and head dim 20 on the CUDA cores;
    GQA, more keys than queries and the other way round, a window that leaves whole key tiles out."""
    from cupy_gqa import _plan

    if kind == "ws" and (dtype not in ("float16", "bfloat16") or cupy.cuda.Device().compute_capability != "90"):
        pytest.skip("the kernels with a producer warpgroup: fp16 / bf16 on sm_90")
    rng_len = {"window": (150, 230), "window_noncausal": (230, 150)}.get(name, (130, 190))
    q, k, v = random_qkv(2, *rng_len, 8, 2, head_dim, dtype, seed=head_dim + len(name))
    dout = _dout(q)
    kw, causal = _mod_kwargs(name, 2, 8)
    old = _plan.set_bwd_sm90(kind)
    try:
        got = run_backward_mods(q, k, v, dout, kw, causal)
    finally:
        _plan.set_bwd_sm90(old)
    check_mods(got, q, k, v, dout, kw, causal, f"{name} D{head_dim} {kind}")


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_modifiers_deterministic(dtype):
    """Two calls with every built-in modifier give bitwise-equal gradients, the sinks' included."""
    q, k, v = (cupy.asarray(x) for x in random_qkv(2, 300, 400, 8, 2, 128, dtype, seed=4))
    dout = cupy.asarray(_dout(cupy.asnumpy(q)))
    kw, causal = _mod_kwargs("all", 2, 8)
    kw = {n: cupy.asarray(x) if isinstance(x, np.ndarray) else x for n, x in kw.items()}
    out, lse = cupy_gqa.attention(q, k, v, causal=causal, return_lse=True, **kw)
    runs = [[cupy.asnumpy(g) for g in cupy_gqa.attention_backward(dout, q, k, v, out, lse, causal=causal, **kw)]
            for _ in range(2)]  # fmt: skip
    for a, b in zip(*runs):
        assert np.array_equal(a.view(np.uint8), b.view(np.uint8))


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_torch_autograd_with_modifiers_on_cuda(torch, dtype):
    """A sliding window, softcap and learned sinks (Gemma 2 / gpt-oss training) through torch
    autograd on CUDA: every gradient, the sinks' too, against the float64 reference."""
    tdtype = getattr(torch, dtype)
    rng = np.random.default_rng(6)
    q, k, v = random_qkv(2, 200, 200, 8, 2, 64, "float32", seed=8)
    dout = _dout(q)
    sinks = rng.standard_normal(8).astype(np.float32)
    t = lambda x: torch.tensor(x, device="cuda", dtype=tdtype, requires_grad=True)  # noqa: E731
    tq, tk, tv = t(q), t(k), t(v)
    ts = torch.tensor(sinks, device="cuda", requires_grad=True)
    td = torch.tensor(dout, device="cuda", dtype=tdtype)
    out = cupy_gqa.attention(tq, tk, tv, window=(31, 0), softcap=2.0, sinks=ts)
    out.backward(td)
    # the reference on the inputs as the GPU saw them (rounded to the dtype)
    seen = [x.detach().float().cpu().numpy().astype(np.float64) for x in (td, tq, tk, tv)]
    want = reference_attention_backward(*seen, window=(31, 0), softcap=2.0, sinks=sinks)
    for name, g, w in zip(("dq", "dk", "dv", "dsinks"), (tq.grad, tk.grad, tv.grad, ts.grad), want):
        assert_close(g.float().cpu().numpy(), w, BOUND[dtype] if name != "dsinks" else max(BOUND[dtype], 1e-5), name)
