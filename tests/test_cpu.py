"""The NumPy backend (cupy_gqa/cpu.py) against the float64 reference."""
import numpy as np
import pytest

import cupy_gqa
from cupy_gqa import cpu
from conftest import NP_DTYPES, TOLERANCE, assert_close, assert_lse_close, random_qkv
from reference import reference_attention

LENGTHS = [(1, 1), (113, 203), (64, 1), (7, 100), (57, 30), (40, 40)]
HEADS = [(4, 4), (8, 2), (7, 1), (4, 1)]  # MHA, GQA 4:1, GQA 7:1, MQA


@pytest.fixture(params=[False, True], ids=["one-block", "many-blocks"])
def blocks(request, monkeypatch):
    """Run each case once with the default blocks and once with tiny ones, so
    that the online softmax crosses many query and key blocks."""
    if request.param:
        monkeypatch.setattr(cpu, "Q_BLOCK", 5)
        monkeypatch.setattr(cpu, "K_BLOCK", 7)


@pytest.mark.parametrize("seqlen_q,seqlen_k", LENGTHS)
@pytest.mark.parametrize("num_q_heads,num_kv_heads", HEADS)
@pytest.mark.parametrize("causal", [True, False])
def test_matches_reference(seqlen_q, seqlen_k, num_q_heads, num_kv_heads, causal, blocks):
    q, k, v = random_qkv(2, seqlen_q, seqlen_k, num_q_heads, num_kv_heads, 24, "float64", seed=seqlen_q)
    out = np.full_like(q, np.nan)
    res, lse = cupy_gqa.attention(q, k, v, causal=causal, return_lse=True, out=out)
    assert res is out
    ref, ref_lse = reference_attention(q, k, v, causal=causal)
    assert_close(out, ref, TOLERANCE["float64"], "out")
    assert_lse_close(lse, ref_lse, 1e-6)  # lse is float32


@pytest.mark.parametrize("dtype", list(NP_DTYPES))
@pytest.mark.parametrize("head_dim", [1, 8, 40, 256])
def test_dtypes_and_head_dims(dtype, head_dim):
    q, k, v = random_qkv(1, 33, 47, 6, 2, head_dim, dtype, seed=head_dim)
    out = cupy_gqa.attention(q, k, v)
    assert out.dtype == q.dtype and out.shape == q.shape
    assert_close(out, reference_attention(q, k, v)[0], TOLERANCE[dtype], dtype)


def test_fully_masked_rows_are_zero_with_minus_inf_lse():
    # seqlen_q > seqlen_k, causal: the first seqlen_q - seqlen_k rows see no key
    q, k, v = random_qkv(2, 9, 4, 4, 2, 16, "float32")
    out, lse = cupy_gqa.attention(q, k, v, return_lse=True)
    assert np.all(out[:, :5] == 0) and np.all(np.isneginf(lse[:, :, :5]))
    assert np.all(np.isfinite(out)) and np.all(np.isfinite(lse[:, :, 5:]))
    assert_close(out, reference_attention(q, k, v)[0], TOLERANCE["float32"])


def test_decode_query_sees_whole_cache():
    q, k, v = random_qkv(3, 1, 50, 8, 2, 32, "float64")
    causal = cupy_gqa.attention(q, k, v, causal=True)
    assert_close(causal, cupy_gqa.attention(q, k, v, causal=False), 1e-15)
    assert_close(causal, reference_attention(q, k, v, causal=False)[0], 1e-12)


def test_strided_views_no_copy():
    # a packed QKV tensor (B, S, Hq + 2 Hkv, D) sliced on the head axis, and a
    # (B, H, S, D) tensor viewed through a transpose
    rng = np.random.default_rng(1)
    qkv = rng.standard_normal((2, 30, 8 + 2 + 2, 16))
    q, k, v = qkv[:, :, :8], qkv[:, :, 8:10], qkv[:, :, 10:]
    ref = reference_attention(q, k, v)[0]
    assert_close(cupy_gqa.attention(q, k, v), ref, 1e-12, "packed")
    bhsd = np.ascontiguousarray(q.transpose(0, 2, 1, 3))
    assert_close(cupy_gqa.attention(bhsd.transpose(0, 2, 1, 3), k, v), ref, 1e-12, "transposed")


def test_softmax_scale_and_large_scores():
    q, k, v = random_qkv(1, 20, 20, 4, 4, 8, "float32", scale=30.0)
    out, lse = cupy_gqa.attention(q, k, v, softmax_scale=0.7, return_lse=True)
    ref, ref_lse = reference_attention(q, k, v, softmax_scale=0.7)
    assert np.all(np.isfinite(out))
    assert_close(out, ref, 1e-5)
    assert_lse_close(lse, ref_lse, 1e-5)


def test_nan_in_data_propagates_like_the_reference():
    q, k, v = random_qkv(1, 6, 6, 2, 1, 4, "float64")
    v[0, 2, 0, 1] = np.nan  # key 2 is seen by rows 2.. only
    out = cupy_gqa.attention(q, k, v)
    ref = reference_attention(q, k, v)[0]
    assert np.array_equal(np.isnan(out), np.isnan(ref))
    assert np.isnan(out).any()


def test_empty_inputs():
    q, k, v = random_qkv(2, 0, 5, 4, 2, 8, "float32")
    out, lse = cupy_gqa.attention(q, k, v, return_lse=True)
    assert out.shape == (2, 0, 4, 8) and lse.shape == (2, 4, 0)
    q, k, v = random_qkv(2, 3, 0, 4, 2, 8, "float32")
    out, lse = cupy_gqa.attention(q, k, v, return_lse=True)
    assert np.all(out == 0) and np.all(np.isneginf(lse))


def test_inputs_are_not_modified():
    q, k, v = random_qkv(1, 10, 12, 4, 2, 8, "float16")
    copies = [x.copy() for x in (q, k, v)]
    cupy_gqa.attention(q, k, v)
    for x, c in zip((q, k, v), copies):
        assert np.array_equal(x, c)


def test_torch_cpu_tensors_give_torch_results():
    torch = pytest.importorskip("torch")
    q, k, v = random_qkv(1, 10, 12, 4, 2, 8, "float32")
    for dtype in (torch.float32, torch.bfloat16):
        tq, tk, tv = (torch.from_numpy(x).to(dtype) for x in (q, k, v))
        out = cupy_gqa.attention(tq, tk, tv)
        assert isinstance(out, torch.Tensor) and out.dtype == dtype
        ref = reference_attention(tq.float().numpy(), tk.float().numpy(), tv.float().numpy())[0]
        assert_close(out.float().numpy(), ref, 1.6e-2 if dtype == torch.bfloat16 else 1e-5)
