"""layout="bhsd" (cupy_gqa/api.py): (batch, heads, seqlen, head_dim) arrays, read and written in place."""
import numpy as np
import pytest

import cupy_gqa
from cupy_gqa import _plan, api
from conftest import TOLERANCE, assert_close, assert_lse_close, random_qkv
from reference import reference_attention


def to_bhsd(x):
    """A contiguous (batch, heads, seqlen, head_dim) copy of a bshd array."""
    return np.ascontiguousarray(x.transpose(0, 2, 1, 3))


def bshd(x):
    return x.transpose(0, 2, 1, 3)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "float64"])
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(9, 13), (13, 9), (1, 40)])
@pytest.mark.parametrize("causal", [True, False])
def test_bhsd_matches_reference(dtype, seqlen_q, seqlen_k, causal):
    q, k, v = random_qkv(2, seqlen_q, seqlen_k, 6, 2, 16, dtype, seed=seqlen_q)
    out, lse = cupy_gqa.attention(to_bhsd(q), to_bhsd(k), to_bhsd(v), causal=causal, return_lse=True, layout="bhsd")
    assert out.shape == (2, 6, seqlen_q, 16) and out.dtype == q.dtype and out.flags.c_contiguous
    assert lse.shape == (2, 6, seqlen_q)  # (batch, num_q_heads, seqlen_q) in both layouts
    ref, ref_lse = reference_attention(q, k, v, causal=causal)
    assert_close(bshd(out), ref, TOLERANCE[dtype], dtype)
    assert_lse_close(lse, ref_lse, 1e-5)


def test_bhsd_equals_bshd_exactly():
    q, k, v = random_qkv(2, 17, 23, 8, 2, 32, "float32", seed=3)
    want, want_lse = cupy_gqa.attention(q, k, v, return_lse=True)
    got, got_lse = cupy_gqa.attention(to_bhsd(q), to_bhsd(k), to_bhsd(v), return_lse=True, layout="bhsd")
    assert np.array_equal(bshd(got), want) and np.array_equal(got_lse, want_lse)
    assert np.array_equal(cupy_gqa.attention(q, k, v, layout="bshd"), want)  # the default, named


def test_bhsd_out_is_written_in_place():
    q, k, v = random_qkv(1, 10, 12, 4, 2, 8, "float32")
    storage = np.full((1, 4, 10, 16), np.nan, np.float32)
    out = storage[..., 4:12]  # a strided bhsd view
    assert cupy_gqa.attention(to_bhsd(q), to_bhsd(k), to_bhsd(v), out=out, layout="bhsd") is out
    assert_close(bshd(out), reference_attention(q, k, v)[0], TOLERANCE["float32"])
    assert np.isnan(storage[..., :4]).all() and np.isnan(storage[..., 12:]).all()  # nothing else written


def test_bhsd_is_read_and_written_without_copies(monkeypatch):
    """The NumPy backend gets bshd views of the caller's own memory, and writes the returned array."""
    q, k, v = (to_bhsd(x) for x in random_qkv(2, 5, 7, 4, 2, 8, "float32"))
    seen = {}

    def spy(qb, kb, vb, outb, lseb, **kw):
        seen.update(q=qb, k=kb, v=vb, out=outb)
        outb[...] = 0

    monkeypatch.setattr(api, "attention_cpu", spy)
    out = cupy_gqa.attention(q, k, v, layout="bhsd")
    for name, caller in (("q", q), ("k", k), ("v", v), ("out", out)):
        view = seen[name]
        assert view.shape == bshd(caller).shape, name
        assert view.__array_interface__["data"][0] == caller.__array_interface__["data"][0], name
        assert view.strides == bshd(caller).strides, name


def test_bhsd_with_seqlens_k():
    q, k, v = random_qkv(3, 2, 30, 4, 1, 16, "float32", seed=7)
    lens = [30, 0, 11]
    out, lse = cupy_gqa.attention(to_bhsd(q), to_bhsd(k), to_bhsd(v), seqlens_k=lens, return_lse=True, layout="bhsd")
    ref, ref_lse = reference_attention(q, k, v, seqlens_k=lens)
    assert_close(bshd(out), ref, TOLERANCE["float32"])
    assert_lse_close(lse, ref_lse, 1e-5)


def test_bhsd_strided_views_of_a_packed_tensor():
    # (batch, Hq + 2 Hkv, seqlen, head_dim) sliced on the head axis
    rng = np.random.default_rng(2)
    qkv = rng.standard_normal((2, 8 + 2 + 2, 20, 16))
    q, k, v = qkv[:, :8], qkv[:, 8:10], qkv[:, 10:]
    out = cupy_gqa.attention(q, k, v, layout="bhsd")
    assert_close(bshd(out), reference_attention(bshd(q), bshd(k), bshd(v))[0], TOLERANCE["float64"])


@pytest.mark.parametrize("layout", ["BSHD", "sbhd", "thd", None, 1])
def test_unknown_layout(layout):
    q, k, v = random_qkv(1, 3, 3, 2, 1, 8, "float32")
    with pytest.raises(ValueError, match=r"layout: expected one of \('bshd', 'bhsd'\), got "):
        cupy_gqa.attention(q, k, v, layout=layout)


def test_bhsd_messages_use_the_callers_axes():
    q, k, v = (to_bhsd(x) for x in random_qkv(2, 5, 7, 4, 2, 8, "float32"))
    with pytest.raises(ValueError, match=r"q: expected 4 dimensions \(batch, num_q_heads, seqlen_q, head_dim\), got shape \(4, 5,"):
        cupy_gqa.attention(q[0], k, v, layout="bhsd")
    with pytest.raises(ValueError, match=r"k: expected shape \(batch, num_kv_heads, seqlen_k, head_dim\) with batch=2"):
        cupy_gqa.attention(q, k[:1], v, layout="bhsd")
    with pytest.raises(ValueError, match=r"k: expected num_kv_heads >= 1 dividing num_q_heads=4, got num_kv_heads=3"):
        kv3 = np.zeros((2, 3, 7, 8), np.float32)
        cupy_gqa.attention(q, kv3, kv3, layout="bhsd")
    with pytest.raises(ValueError, match=r"out: expected shape \(2, 4, 5, 8\) \(that of q\), got \(2, 5, 4, 8\)"):
        cupy_gqa.attention(q, k, v, out=np.empty((2, 5, 4, 8), np.float32), layout="bhsd")
    with pytest.raises(ValueError, match=r"seqlens_k: expected values in \[0, 7\]"):
        cupy_gqa.attention(q, k, v, seqlens_k=[7, 8], layout="bhsd")


def test_torch_cpu_bhsd():
    torch = pytest.importorskip("torch")
    q, k, v = random_qkv(1, 10, 12, 4, 2, 8, "float32")
    tq, tk, tv = (torch.from_numpy(to_bhsd(x)) for x in (q, k, v))
    out = cupy_gqa.attention(tq, tk, tv, layout="bhsd")
    assert isinstance(out, torch.Tensor) and tuple(out.shape) == (1, 4, 10, 8) and out.is_contiguous()
    assert_close(bshd(out.numpy()), reference_attention(q, k, v)[0], TOLERANCE["float32"])


# --- GPU -------------------------------------------------------------------------

CASES = {  # kernel: (batch, seqlen_q, seqlen_k, num_q_heads, num_kv_heads, head_dim, dtype)
    "rowwise": (2, 33, 47, 6, 2, 40, "float32"),
    "tiled": (2, 70, 90, 8, 2, 64, "float16"),
    "decode": (3, 1, 600, 8, 2, 128, "bfloat16"),
}


def _spy_launches(monkeypatch):
    """Record the backend arrays each launch gets."""
    from cupy_gqa import _fast

    _fast.clear()  # the repeat-call path launches without these functions
    seen = []
    for family, launch in list(_plan.LAUNCH.items()):

        def spy(problem, q, k, v, out, *rest, _launch=launch, _family=family, **kw):
            seen.append((_family, q, k, v, out))
            return _launch(problem, q, k, v, out, *rest, **kw)

        monkeypatch.setitem(_plan.LAUNCH, family, spy)
    return seen


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", list(CASES))
def test_cupy_bhsd_matches_reference(kernel, monkeypatch):
    import cupy

    batch, sq, sk, hq, hkv, d, dtype = CASES[kernel]
    q, k, v = random_qkv(batch, sq, sk, hq, hkv, d, dtype, seed=11)
    cq, ck, cv = (cupy.asarray(to_bhsd(x)) for x in (q, k, v))
    seen = _spy_launches(monkeypatch)
    out, lse = cupy_gqa.attention(cq, ck, cv, return_lse=True, layout="bhsd", kernel=kernel)
    assert isinstance(out, cupy.ndarray) and out.shape == (batch, hq, sq, d) and out.flags.c_contiguous
    assert lse.shape == (batch, hq, sq)
    ref, ref_lse = reference_attention(q, k, v)
    assert_close(bshd(cupy.asnumpy(out)), ref, TOLERANCE[dtype], kernel)
    assert_lse_close(cupy.asnumpy(lse), ref_lse, 1e-5)
    [(family, qb, kb, vb, outb)] = seen
    assert family == kernel
    for caller, view in ((cq, qb), (ck, kb), (cv, vb), (out, outb)):  # views of the caller's memory
        assert view.data.ptr == caller.data.ptr and view.strides == bshd(caller).strides


@pytest.mark.gpu
def test_cupy_bhsd_auto_and_out():
    import cupy

    q, k, v = random_qkv(2, 1, 300, 16, 2, 64, "float16", seed=4)  # auto: decode
    cq, ck, cv = (cupy.asarray(to_bhsd(x)) for x in (q, k, v))
    out = cupy.full((2, 16, 1, 64), cupy.nan, dtype=cupy.float16)
    assert cupy_gqa.attention(cq, ck, cv, out=out, layout="bhsd") is out
    assert_close(bshd(cupy.asnumpy(out)), reference_attention(q, k, v)[0], TOLERANCE["float16"])


@pytest.mark.gpu
def test_torch_cuda_bhsd_zero_copy(monkeypatch):
    torch = pytest.importorskip("torch")
    q, k, v = random_qkv(2, 64, 64, 8, 2, 64, "float32", seed=9)
    tq, tk, tv = (torch.from_numpy(to_bhsd(x)).to("cuda", torch.bfloat16) for x in (q, k, v))
    host = [bshd(t.float().cpu().numpy()) for t in (tq, tk, tv)]
    seen = _spy_launches(monkeypatch)
    out = cupy_gqa.attention(tq, tk, tv, layout="bhsd")
    assert isinstance(out, torch.Tensor) and tuple(out.shape) == (2, 8, 64, 64) and out.is_contiguous()
    assert_close(bshd(out.double().cpu().numpy()), reference_attention(*host)[0], TOLERANCE["bfloat16"])
    [(_, qb, kb, vb, outb)] = seen
    for caller, view in ((tq, qb), (tk, kb), (tv, vb), (out, outb)):
        assert view.data.ptr == caller.data_ptr()
    given = torch.full_like(tq, float("nan"))
    assert cupy_gqa.attention(tq, tk, tv, out=given, layout="bhsd") is given
    assert torch.equal(given, out)
