"""seqlens_k on the CPU: the NumPy backend against the float64 reference, the
reference itself, and every bad seqlens_k (README's bad-input table)."""
import numpy as np
import pytest

import cupy_gqa
from conftest import TOLERANCE, assert_close, assert_lse_close, random_qkv
from reference import reference_attention


def test_reference_cuts_the_cache():
    """Literal: one query and a cache of length 1 returns that key's V row; a
    full length is the same as no seqlens_k; length 0 is zeros and -inf."""
    q, k, v = random_qkv(3, 1, 9, 4, 2, 16, "float64")
    out, lse = reference_attention(q, k, v, seqlens_k=[1, 9, 0])
    assert np.allclose(out[0], np.repeat(v[0, 0], 2, axis=0))
    full, full_lse = reference_attention(q[1:2], k[1:2], v[1:2])
    assert np.array_equal(out[1:2], full) and np.array_equal(lse[1:2], full_lse)
    assert not out[2].any() and np.isneginf(lse[2]).all()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float64"])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(1, 1), (4, 300), (16, 2100), (40, 33)])
def test_cpu_backend_with_seqlens_k(dtype, causal, seqlen_q, seqlen_k):
    rng = np.random.default_rng(seqlen_q + seqlen_k)
    seqlens_k = rng.integers(0, seqlen_k + 1, size=5)
    seqlens_k[:2] = (0, seqlen_k)  # an empty and a full sequence
    q, k, v = random_qkv(5, seqlen_q, seqlen_k, 6, 2, 16, dtype, seed=seqlen_q)
    for b, n in enumerate(seqlens_k):  # keys past the length must never reach a result
        k[b, n:] = np.nan
        v[b, n:] = np.inf
    out = np.full(q.shape, np.nan, dtype=q.dtype)
    res, lse = cupy_gqa.attention(q, k, v, causal=causal, return_lse=True, out=out, seqlens_k=seqlens_k)
    ref, ref_lse = reference_attention(q, k, v, causal=causal, seqlens_k=seqlens_k)
    assert_close(res, ref, TOLERANCE[dtype], f"cpu {dtype}")
    assert_lse_close(lse, ref_lse, 1e-5)


@pytest.mark.parametrize("as_", ["list", "tuple", "int8", "uint16", "int64"])
def test_host_forms_and_dtypes(as_):
    q, k, v = random_qkv(3, 2, 50, 4, 1, 8, "float32")
    lens = [50, 7, 0]
    given = {"list": lens, "tuple": tuple(lens)}.get(as_, np.array(lens, dtype=as_ if as_ not in ("list", "tuple") else None))
    out, lse = cupy_gqa.attention(q, k, v, return_lse=True, seqlens_k=given)
    ref, ref_lse = reference_attention(q, k, v, seqlens_k=lens)
    assert_close(out, ref, TOLERANCE["float32"])
    assert_lse_close(lse, ref_lse)
    assert list(given) == lens  # untouched


def test_cpu_torch_seqlens_k():
    torch = pytest.importorskip("torch")
    q, k, v = random_qkv(2, 3, 40, 4, 2, 8, "float32")
    out = cupy_gqa.attention(*(torch.from_numpy(x) for x in (q, k, v)), seqlens_k=torch.tensor([40, 5]))
    assert_close(out.numpy(), reference_attention(q, k, v, seqlens_k=[40, 5])[0], TOLERANCE["float32"])


# --- bad input: one test each ---------------------------------------------------


@pytest.fixture
def qkv():
    return random_qkv(2, 1, 100, 4, 1, 8, "float32")


def test_seqlens_k_not_an_array(qkv):
    with pytest.raises(TypeError, match=r"seqlens_k: expected None, a list, tuple, NumPy array or CPU torch tensor, or a CUDA array of int32, got builtins.str"):
        cupy_gqa.attention(*qkv, seqlens_k="100")


def test_seqlens_k_not_integer(qkv):
    with pytest.raises(TypeError, match=r"seqlens_k: expected an integer dtype, got float64"):
        cupy_gqa.attention(*qkv, seqlens_k=np.array([1.0, 2.0]))
    with pytest.raises(TypeError, match=r"seqlens_k: expected an integer dtype, got bool"):
        cupy_gqa.attention(*qkv, seqlens_k=[True, False])


def test_seqlens_k_wrong_shape(qkv):
    with pytest.raises(ValueError, match=r"seqlens_k: expected shape \(2,\) \(the batch of q\), got \(3,\)"):
        cupy_gqa.attention(*qkv, seqlens_k=[1, 2, 3])
    with pytest.raises(ValueError, match=r"seqlens_k: expected shape \(2,\) \(the batch of q\), got \(2, 1\)"):
        cupy_gqa.attention(*qkv, seqlens_k=[[1], [2]])


@pytest.mark.parametrize("lens,bad,at", [([100, 101], 101, 1), ([-1, 3], -1, 0)])
def test_seqlens_k_out_of_range(qkv, lens, bad, at):
    with pytest.raises(ValueError, match=rf"seqlens_k: expected values in \[0, 100\] \(0 to seqlen_k\), got {bad} at batch {at}"):
        cupy_gqa.attention(*qkv, seqlens_k=lens)
