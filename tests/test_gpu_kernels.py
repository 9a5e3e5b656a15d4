"""Every CUDA kernel family through the same cases, against the float64 reference.

Outputs are poisoned with NaN before each call, so an unwritten element fails.
A kernel that does not support a case must refuse it with a ValueError.
"""
import numpy as np
import pytest

import cupy_gqa
from conftest import NP_DTYPES, TF32_TOLERANCE, TOLERANCE, assert_close, assert_lse_close, gpu_available, random_qkv, relative_error
from reference import reference_attention

pytestmark = pytest.mark.gpu
if gpu_available():
    import cupy

HEAD_DIMS = [1, 8, 16, 32, 40, 64, 80, 96, 128, 160, 192, 256]
HEADS = {"MHA": (4, 4), "GQA4": (8, 2), "GQA7": (7, 1), "MQA": (4, 1)}
LENGTHS = [(1, 1), (113, 203), (1023, 1024), (64, 1), (7, 1000), (257, 57)]


# What each kernel family promises to run; anything else it must refuse.
# (Written out here, independently of cupy_gqa's own dispatch.)
def expected_to_run(kernel, dtype, head_dim, unit_stride=True, softmax_scale=None, seqlen_q=1):
    if kernel == "tiled":
        positive = softmax_scale is None or softmax_scale > 0
        return dtype in ("float16", "bfloat16", "float32") and head_dim in (32, 64, 96, 128, 256) and unit_stride and positive
    if kernel == "decode":
        return dtype in ("float16", "bfloat16", "float32") and head_dim in (64, 128, 256) and unit_stride and seqlen_q <= 16
    if kernel == "hopper":
        positive = softmax_scale is None or softmax_scale > 0
        hopper = cupy.cuda.Device().compute_capability == "90"
        return hopper and dtype in ("float16", "bfloat16") and head_dim % 8 == 0 and unit_stride and positive
    return True


def refused(kernel, q, k, v, **kw):
    """True (after checking the ValueError) when ``kernel`` must refuse this call."""
    if expected_to_run(kernel, q.dtype.name, q.shape[3], softmax_scale=kw.get("softmax_scale"), seqlen_q=q.shape[1]):
        return False
    with pytest.raises(ValueError, match=rf"kernel: '{kernel}' does not support this call"):
        cupy_gqa.attention(q, k, v, kernel=kernel, **kw)
    return True


def run_case(kernel, q, k, v, *, causal=True, check_lse=True, **kw):
    """Run one call on the GPU into a NaN-poisoned out and compare with the reference."""
    dtype = q.dtype.name
    qd, kd, vd = (cupy.asarray(x) for x in (q, k, v))
    out = cupy.full(q.shape, np.nan, dtype=q.dtype)
    if refused(kernel, qd, kd, vd, causal=causal, out=out, **kw):
        return
    res, lse = cupy_gqa.attention(qd, kd, vd, causal=causal, return_lse=True, out=out, kernel=kernel, **kw)
    assert res is out
    ref, ref_lse = reference_attention(q, k, v, causal=causal, softmax_scale=kw.get("softmax_scale"))
    assert_close(cupy.asnumpy(out), ref, TOLERANCE[dtype], f"{kernel} {dtype} out")
    if check_lse:
        assert_lse_close(cupy.asnumpy(lse), ref_lse, 1e-6 if dtype != "float16" else 1e-5, f"{kernel} lse")
    # the inputs are untouched
    for x, xd in zip((q, k, v), (qd, kd, vd)):
        assert np.array_equal(cupy.asnumpy(xd).view(np.uint8), x.view(np.uint8))


@pytest.mark.parametrize("kernel", cupy_gqa.KERNELS)
@pytest.mark.parametrize("dtype", list(NP_DTYPES))
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("causal", [True, False])
def test_dtype_and_head_dim(kernel, dtype, head_dim, causal):
    q, k, v = random_qkv(2, 113, 203, 8, 2, head_dim, dtype, seed=head_dim)
    run_case(kernel, q, k, v, causal=causal)


@pytest.mark.parametrize("kernel", cupy_gqa.KERNELS)
@pytest.mark.parametrize("dtype", list(NP_DTYPES))
@pytest.mark.parametrize("heads", list(HEADS))
@pytest.mark.parametrize("seqlen_q,seqlen_k", LENGTHS)
@pytest.mark.parametrize("causal", [True, False])
def test_heads_and_lengths(kernel, dtype, heads, seqlen_q, seqlen_k, causal):
    num_q_heads, num_kv_heads = HEADS[heads]
    q, k, v = random_qkv(2, seqlen_q, seqlen_k, num_q_heads, num_kv_heads, 64, dtype, seed=seqlen_q + seqlen_k)
    run_case(kernel, q, k, v, causal=causal)


@pytest.mark.parametrize("kernel", cupy_gqa.KERNELS)
@pytest.mark.parametrize("head_dim", [16, 128])
def test_repeat_calls_on_new_arrays(kernel, head_dim):
    """Calls of one signature on different arrays (the repeat-call path: a model's
    layers): each reads its own q, k and v (hopper: its own tensor maps)."""
    dims = (2, 40, 300, 4, 2, head_dim)
    if not expected_to_run(kernel, "bfloat16", head_dim, seqlen_q=dims[1]):
        return
    held = []  # every call's arrays stay alive, so no address repeats
    for seed in range(4):
        q, k, v = random_qkv(*dims, "bfloat16", seed=seed)
        held.append(tuple(cupy.asarray(x) for x in (q, k, v)))
        out = cupy_gqa.attention(*held[-1], kernel=kernel)
        assert_close(cupy.asnumpy(out), reference_attention(q, k, v)[0], TOLERANCE["bfloat16"], f"{kernel} call {seed}")


@pytest.mark.parametrize("kernel", cupy_gqa.KERNELS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("head_dim", [16, 64])
def test_mixed_layouts_as_transformers_passes_them(kernel, dtype, head_dim):
    """layout="bhsd" with q and k contiguous in that order (they come out of the
    rotary embedding) and v a transposed view of (batch, seq, heads, dim) storage,
    as a transformers model's attention layer passes them."""
    rng = np.random.default_rng(11)
    batch, seqlen, hq, hkv = 2, 40, 4, 2
    q = cupy.asarray(rng.standard_normal((batch, hq, seqlen, head_dim)).astype(NP_DTYPES[dtype]))
    k = cupy.asarray(rng.standard_normal((batch, hkv, seqlen, head_dim)).astype(NP_DTYPES[dtype]))
    v = cupy.asarray(rng.standard_normal((batch, seqlen, hkv, head_dim)).astype(NP_DTYPES[dtype])).transpose(0, 2, 1, 3)
    if not expected_to_run(kernel, dtype, head_dim, seqlen_q=seqlen):
        return
    out = cupy_gqa.attention(q, k, v, layout="bhsd", kernel=kernel, softmax_scale=head_dim**-0.5)
    host = [cupy.asnumpy(x).transpose(0, 2, 1, 3) for x in (q, k, v)]
    ref = reference_attention(*host, softmax_scale=head_dim**-0.5)[0]
    assert_close(cupy.asnumpy(out).transpose(0, 2, 1, 3), ref, TOLERANCE[dtype], f"{kernel} mixed layouts")


@pytest.mark.parametrize("kernel", cupy_gqa.KERNELS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("layout", ["packed_qkv", "bhsd_transposed", "strided_head_dim"])
@pytest.mark.parametrize("head_dim", [16, 64])
def test_strided_layouts(kernel, dtype, layout, head_dim):
    """Views that must work without a copy: slices of a packed QKV tensor, a
    (batch, heads, seq, dim) tensor seen through a transpose, a strided last axis
    (head_dim 16: narrower than hopper's padded tile)."""
    rng = np.random.default_rng(7)
    num_q_heads, num_kv_heads = 8, 2
    if layout == "packed_qkv":
        qkv = rng.standard_normal((2, 77, num_q_heads + 2 * num_kv_heads, head_dim)).astype(NP_DTYPES[dtype])
        packed = cupy.asarray(qkv)
        views = packed[:, :, :8], packed[:, :, 8:10], packed[:, :, 10:]
    elif layout == "bhsd_transposed":
        views = tuple(
            cupy.asarray(rng.standard_normal((2, h, 77, head_dim)).astype(NP_DTYPES[dtype])).transpose(0, 2, 1, 3)
            for h in (num_q_heads, num_kv_heads, num_kv_heads)
        )
    else:
        views = tuple(
            cupy.asarray(rng.standard_normal((2, 77, h, 2 * head_dim)).astype(NP_DTYPES[dtype]))[..., ::2]
            for h in (num_q_heads, num_kv_heads, num_kv_heads)
        )
    host = [cupy.asnumpy(x) for x in views]
    out = cupy.full(views[0].shape, np.nan, dtype=views[0].dtype)
    if not expected_to_run(kernel, dtype, head_dim, unit_stride=layout != "strided_head_dim", seqlen_q=77):
        with pytest.raises(ValueError, match=rf"kernel: '{kernel}' does not support this call"):
            cupy_gqa.attention(*views, out=out, kernel=kernel)
        return
    cupy_gqa.attention(*views, out=out, kernel=kernel)
    assert_close(cupy.asnumpy(out), reference_attention(*host)[0], TOLERANCE[dtype], layout)
    # a strided out works too: write into every other slot of a wider buffer
    # a strided out: every other slot of a wider buffer (the auto kernel if this one needs unit stride)
    wide = cupy.full(views[0].shape[:3] + (2 * head_dim,), np.nan, dtype=views[0].dtype)
    out_kernel = kernel if expected_to_run(kernel, dtype, head_dim, unit_stride=False, seqlen_q=77) else "auto"
    cupy_gqa.attention(*views, out=wide[..., 1::2], kernel=out_kernel)
    assert_close(cupy.asnumpy(wide[..., 1::2]), reference_attention(*host)[0], TOLERANCE[dtype], "strided out")
    assert bool(cupy.isnan(wide[..., ::2]).all())  # and nothing else
    # out as the head slice of a wider (batch, seq, 2 * heads, dim) buffer keeps unit stride
    wide = cupy.full(views[0].shape[:2] + (2 * num_q_heads, head_dim), np.nan, dtype=views[0].dtype)
    cupy_gqa.attention(*views, out=wide[:, :, num_q_heads:], kernel=kernel)
    assert_close(cupy.asnumpy(wide[:, :, num_q_heads:]), reference_attention(*host)[0], TOLERANCE[dtype], "head-sliced out")
    assert bool(cupy.isnan(wide[:, :, :num_q_heads]).all())


@pytest.mark.parametrize("kernel", cupy_gqa.KERNELS)
@pytest.mark.parametrize("num_q_heads,num_kv_heads", [(2, 2), (8, 4), (16, 1), (32, 2), (64, 1), (6, 2), (14, 2),
                                                      (26, 2)])
@pytest.mark.parametrize("head_dim", [40, 128])
def test_out_view_inside_a_larger_buffer(kernel, num_q_heads, num_kv_heads, head_dim):
    """out as a view of a NaN buffer that is longer in every axis (positions,
    heads, head dims): the call writes the view and nothing around it, for
    group sizes whose packed rows make whole tiles of positions (1 to 64), or
    nearly (3, 7: 63 rows of a warpgroup's 64; hopper then stores by bulk
    copies, which must clip at the view's ends), and one that does not (13:
    52 rows, by the threads). seqlen_q 150 ends inside a tile."""
    seqlen_q, seqlen_k = 150, 170
    q, k, v = random_qkv(2, seqlen_q, seqlen_k, num_q_heads, num_kv_heads, head_dim, "bfloat16", seed=num_q_heads)
    if not expected_to_run(kernel, "bfloat16", head_dim, seqlen_q=seqlen_q):
        return
    big = cupy.full((3, seqlen_q + 20, num_q_heads + 3, head_dim + 24), np.nan, dtype=q.dtype)
    out = big[1:, 5 : 5 + seqlen_q, 2 : 2 + num_q_heads, 8 : 8 + head_dim]
    qd, kd, vd = (cupy.asarray(x) for x in (q, k, v))
    assert cupy_gqa.attention(qd, kd, vd, out=out, kernel=kernel) is out
    assert_close(cupy.asnumpy(out), reference_attention(q, k, v)[0], TOLERANCE["bfloat16"], f"{kernel} out view")
    around = cupy.ones(big.shape, dtype=bool)
    around[1:, 5 : 5 + seqlen_q, 2 : 2 + num_q_heads, 8 : 8 + head_dim] = False
    assert bool(cupy.isnan(big[around]).all()), "an element outside the out view was written"


@pytest.mark.parametrize("kernel", cupy_gqa.KERNELS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_large_scores_and_custom_scale(kernel, dtype):
    q, k, v = random_qkv(1, 65, 65, 4, 2, 32, dtype, scale=30.0)
    run_case(kernel, q, k, v, softmax_scale=1.0)  # scores of several hundred
    run_case(kernel, q, k, v, softmax_scale=-0.5)  # a negative scale flips the max
    run_case(kernel, q, k, v, softmax_scale=1e-45)  # subnormal in float32: uniform weights, masked keys still out


@pytest.mark.parametrize("kernel", ("auto", *cupy_gqa.KERNELS))
@pytest.mark.parametrize("precision", ["highest", "tf32"])
@pytest.mark.parametrize("head_dim", [32, 64, 80, 128, 256])
@pytest.mark.parametrize("inputs", ["scores_of_30", "near_ties"])
def test_float32_precision(kernel, precision, head_dim, inputs):
    """float32 is fp32-accurate (2e-6) with precision="highest", also for large
    scores and near-tied maxima; "tf32" on the tiled kernel stays within its
    documented bound, and is really the cheaper arithmetic (error above 2e-6)."""
    rng = np.random.default_rng(head_dim)
    q, k, v = random_qkv(2, 200, 300, 8, 2, head_dim, "float32", seed=head_dim)
    if inputs == "scores_of_30":  # scaled scores with a standard deviation near 10
        q, k = q * np.float32(np.sqrt(10.0)), k * np.float32(np.sqrt(10.0))
    else:  # every key is one of 3, up to a perturbation of 1e-6: maxima nearly tied
        base = k[:, rng.integers(0, 3, size=300)]
        k = (base + rng.standard_normal(base.shape) * 1e-6).astype(np.float32) * np.float32(3.0)
    out = cupy.full(q.shape, np.nan, dtype=np.float32)
    if kernel != "auto" and refused(kernel, *(cupy.asarray(x) for x in (q, k, v)), out=out, precision=precision):
        return
    cupy_gqa.attention(*(cupy.asarray(x) for x in (q, k, v)), out=out, kernel=kernel, precision=precision)
    ref = reference_attention(q, k, v)[0]
    uses_tf32 = precision == "tf32" and kernel in ("auto", "tiled") and head_dim != 80
    assert_close(cupy.asnumpy(out), ref, TF32_TOLERANCE if uses_tf32 else 2e-6, f"{kernel} {precision} {inputs}")
    if uses_tf32:
        assert relative_error(cupy.asnumpy(out), ref) > 2e-6, "precision='tf32' should use one TF32 product"


@pytest.mark.parametrize("kernel", cupy_gqa.KERNELS)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [True, False])
def test_error_not_worse_than_torch(kernel, dtype, head_dim, causal):
    """In fp16 / bf16 our error is at most torch's own on the same inputs (plus 5% noise)."""
    torch = pytest.importorskip("torch")
    if not expected_to_run(kernel, dtype, head_dim, seqlen_q=1000):
        pytest.skip(f"{kernel} does not run seqlen_q 1000 (tests/test_gpu_decode.py covers it)")
    q, k, v = random_qkv(2, 1000, 1000, 8, 2, head_dim, dtype, seed=11)
    ref = reference_attention(q, k, v, causal=causal)[0]
    tq, tk, tv = (torch.from_numpy(x.astype(np.float32)).cuda().to(getattr(torch, dtype)).transpose(1, 2) for x in (q, k, v))
    theirs = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=causal, enable_gqa=True)
    torch_err = relative_error(theirs.transpose(1, 2).double().cpu().numpy(), ref)
    if refused(kernel, *(cupy.asarray(x) for x in (q, k, v)), causal=causal):
        return
    ours = cupy_gqa.attention(*(cupy.asarray(x) for x in (q, k, v)), causal=causal, kernel=kernel)
    err = relative_error(cupy.asnumpy(ours), ref)
    assert err <= 1.05 * torch_err, f"{kernel} {dtype}: error {err:.3e} > torch's {torch_err:.3e}"


@pytest.mark.parametrize("kernel", cupy_gqa.KERNELS)
def test_fully_masked_rows(kernel):
    q, k, v = random_qkv(2, 40, 9, 4, 1, 64, "float16")  # the first 31 rows see no key
    if kernel == "decode":  # at most 16 query tokens: the first 7 of 16 see no key
        q, k, v = random_qkv(2, 16, 9, 4, 1, 64, "float16")
        out, lse = cupy_gqa.attention(*(cupy.asarray(x) for x in (q, k, v)), return_lse=True, kernel=kernel)
        out, lse = cupy.asnumpy(out), cupy.asnumpy(lse)
        assert np.all(out[:, :7] == 0) and np.all(np.isneginf(lse[:, :, :7]))
        assert np.all(np.isfinite(out)) and np.all(np.isfinite(lse[:, :, 7:]))
        return
    out, lse = cupy_gqa.attention(*(cupy.asarray(x) for x in (q, k, v)), return_lse=True, kernel=kernel)
    out, lse = cupy.asnumpy(out), cupy.asnumpy(lse)
    assert np.all(out[:, :31] == 0) and np.all(np.isneginf(lse[:, :, :31]))
    assert np.all(np.isfinite(out)) and np.all(np.isfinite(lse[:, :, 31:]))


def test_auto_matches_the_numpy_backend():
    q, k, v = random_qkv(2, 80, 80, 8, 2, 32, "float32")
    gpu = cupy.asnumpy(cupy_gqa.attention(*(cupy.asarray(x) for x in (q, k, v))))
    assert_close(gpu, cupy_gqa.attention(q, k, v).astype(np.float64), 1e-6)


def test_empty_launches_nothing():
    q, k, v = (cupy.asarray(x) for x in random_qkv(2, 5, 0, 4, 2, 8, "float32"))
    out, lse = cupy_gqa.attention(q, k, v, return_lse=True)
    assert bool((out == 0).all()) and bool(cupy.isneginf(lse).all())
    q, k, v = (cupy.asarray(x) for x in random_qkv(0, 5, 5, 4, 2, 8, "float32"))
    assert cupy_gqa.attention(q, k, v).shape == (0, 5, 4, 8)


@pytest.mark.parametrize("kernel", cupy_gqa.KERNELS)
@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_more_than_2_31_elements(kernel, dtype):
    """q and out of 2**31 + 2048 elements (4.3 GB each in fp16): 64-bit offsets."""
    batch, seqlen_q, num_q_heads, head_dim = 2, 2**20 + 1, 8, 128
    if kernel == "decode":  # at most 16 query tokens: 2**31 elements of K and V instead
        if dtype != "float16":
            pytest.skip("decode: one dtype is enough for the 2**31-element K and V")
        return _decode_more_than_2_31_elements()
    rng = np.random.default_rng(3)
    q = cupy.random.standard_normal((batch, seqlen_q, num_q_heads, head_dim), dtype=cupy.float32).astype(dtype)
    k, v = (cupy.asarray(rng.standard_normal((batch, 16, 2, head_dim)).astype(dtype)) for _ in range(2))
    assert q.size > 2**31
    out = cupy.full(q.shape, np.nan, dtype=q.dtype)
    if refused(kernel, q, k, v, causal=False, out=out):
        return
    cupy_gqa.attention(q, k, v, causal=False, out=out, kernel=kernel)
    rows = [0, 1, seqlen_q // 2, seqlen_q - 2, seqlen_q - 1]
    for b in range(batch):
        qs = cupy.asnumpy(q[b : b + 1, rows])
        ref = reference_attention(qs, cupy.asnumpy(k[b : b + 1]), cupy.asnumpy(v[b : b + 1]), causal=False)[0]
        assert_close(cupy.asnumpy(out[b : b + 1, rows]), ref, TOLERANCE[dtype], f"batch {b} sampled rows")
    del q, out
    cupy.get_default_memory_pool().free_all_blocks()


@pytest.mark.parametrize("kernel", cupy_gqa.KERNELS)
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_scores_of_1e4_do_not_overflow(kernel, dtype):
    """Scores of +-1e4 (and their differences) must not turn into NaN or Inf."""
    q, k, v = random_qkv(1, 50, 50, 4, 2, 64, dtype)
    q = (q.astype(np.float32) * 12.5).astype(q.dtype)  # |q . k| * scale reaches ~1e4 with this scale
    run_case(kernel, q, k, v, softmax_scale=100.0, check_lse=False)


@pytest.mark.parametrize("kernel", cupy_gqa.KERNELS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("bad", [np.inf, np.nan])
def test_non_finite_values_in_unseen_keys(kernel, dtype, bad):
    """Inf / NaN in K and V at the last key, which only the last query sees
    (causal): every other row is exactly the attention over the finite keys.
    Tensor-core kernels (README): guaranteed for rows whose CTA reads no key
    tile that holds the bad key: here the rows that see at most 240 keys
    (key tiles of 64 in tiled, 128 in hopper; a CTA takes 32 query positions
    of the group of 4 in tiled and 48 in hopper at head_dim 64, whose CTA of
    positions 240 to 287 reads the tile of keys 256 to 383)."""
    n = 300
    q, k, v = random_qkv(1, n, n, 8, 2, 64, dtype, seed=5)
    k[:, n - 1], v[:, n - 1] = bad, bad
    if refused(kernel, *(cupy.asarray(x) for x in (q, k, v))):
        return
    out = cupy.asnumpy(cupy_gqa.attention(*(cupy.asarray(x) for x in (q, k, v)), kernel=kernel))
    ref = reference_attention(q[:, : n - 1], k[:, : n - 1], v[:, : n - 1])[0]
    clean = n - 1 if kernel == "rowwise" else 240
    assert_close(out[:, :clean], ref[:, :clean], TOLERANCE[dtype], f"{kernel}: rows that never see the bad key")
    assert np.isnan(out[:, n - 1].astype(np.float32)).any(), "the last row sees it: NaN, as in the definition"


def test_m1_peak_memory_beyond_inputs_and_outputs():
    """M1 (fp32, causal, B1 S32768 Hq32 Hkv8 D128): the call allocates at most
    1% of the input size beyond out and lse (it allocates nothing today)."""
    pool = cupy.get_default_memory_pool()
    batch, seqlen, num_q_heads, num_kv_heads, head_dim = 1, 32768, 32, 8, 128
    q = cupy.random.standard_normal((batch, seqlen, num_q_heads, head_dim), dtype=cupy.float32)
    k = cupy.random.standard_normal((batch, seqlen, num_kv_heads, head_dim), dtype=cupy.float32)
    v = cupy.random.standard_normal((batch, seqlen, num_kv_heads, head_dim), dtype=cupy.float32)
    inputs = q.nbytes + k.nbytes + v.nbytes
    cupy.cuda.Device().synchronize()
    before = pool.used_bytes()
    peak = before
    out, lse = cupy_gqa.attention(q, k, v, return_lse=True)
    peak = max(peak, pool.used_bytes())  # nothing is freed inside the call, so used_bytes after it is the peak
    extra = peak - before - out.nbytes - lse.nbytes
    assert extra <= 0.01 * inputs, f"{extra} bytes beyond inputs and outputs (> 1% of {inputs})"
    rows = [0, 1, seqlen // 2, seqlen - 1]
    from reference import reference_attention

    # sampled rows of head group 0 against the reference (query t sees keys 0..t)
    for t in rows:
        ref = reference_attention(
            cupy.asnumpy(q[:, t : t + 1, :4]), cupy.asnumpy(k[:, : t + 1, :1]), cupy.asnumpy(v[:, : t + 1, :1]), causal=True
        )[0]
        assert_close(cupy.asnumpy(out[:, t : t + 1, :4]), ref, TOLERANCE["float32"], f"row {t}")


def _decode_more_than_2_31_elements():
    """k and v of 2**31 + 2**17 elements each (fp16, 4.3 GB each), 3 query tokens: 64-bit offsets."""
    batch, seqlen_k, num_kv_heads, head_dim = 2, 2**20 + 64, 8, 128
    k = cupy.random.standard_normal((batch, seqlen_k, num_kv_heads, head_dim), dtype=cupy.float32).astype(cupy.float16)
    v = cupy.random.standard_normal((batch, seqlen_k, num_kv_heads, head_dim), dtype=cupy.float32).astype(cupy.float16)
    assert k.size > 2**31
    q = cupy.random.standard_normal((batch, 3, 2 * num_kv_heads, head_dim), dtype=cupy.float32).astype(cupy.float16)
    seqlens_k = np.array([seqlen_k, seqlen_k - 5])
    out = cupy_gqa.attention(q, k, v, kernel="decode", seqlens_k=seqlens_k)
    for b in range(batch):  # the two query heads of the last KV head
        heads = slice(2 * num_kv_heads - 2, 2 * num_kv_heads)
        ref = reference_attention(
            cupy.asnumpy(q[b : b + 1, :, heads]),
            cupy.asnumpy(k[b : b + 1, : seqlens_k[b], -1:]),
            cupy.asnumpy(v[b : b + 1, : seqlens_k[b], -1:]),
        )[0]
        assert_close(cupy.asnumpy(out[b : b + 1, :, heads]), ref, TOLERANCE["float16"], f"batch {b}")
    del k, v
    cupy.get_default_memory_pool().free_all_blocks()


@pytest.mark.parametrize("cc", [(8, 6), (7, 5)])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("head_dim", [64, 96, 128, 256])
@pytest.mark.parametrize("seqlen_q", [1, 3, 130])
def test_other_architectures_tables(monkeypatch, cc, dtype, head_dim, seqlen_q):
    """The kernel tables of other GPUs, run on this one: 99 KB of shared memory
    per block (sm_86, sm_89, sm_120: smaller tiles, shorter decode pipelines)
    and no cp.async (sm_75: rowwise without vector copies, float32 decode).
    auto picks only from that table, and the pick is right."""
    from cupy_gqa import _plan, _specs

    monkeypatch.setattr(_plan, "compute_capability", lambda device: cc)
    arch = _specs.arch_of(*cc)
    q, k, v = random_qkv(2, seqlen_q, 300, 8, 2, head_dim, dtype, seed=head_dim + seqlen_q)
    qd, kd, vd = (cupy.asarray(x) for x in (q, k, v))
    problem = _plan.Problem.of(qd, kd, dtype=dtype, causal=True, softmax_scale=head_dim**-0.5)
    family = _plan.choose_kernel(problem, qd, kd, vd, qd)
    assert family != "hopper"
    if not arch.sm80:
        assert family in ("rowwise", "decode") and (family == "rowwise" or dtype == "float32")
    run_case("auto", q, k, v)


def test_warmup_leaves_nothing_to_compile():
    """After warmup for (float16, head_dim 64), prefill and decode calls of that
    kind load no new kernel (what a CUDA-graph capture needs)."""
    from cupy_gqa import _compile

    assert cupy_gqa.warmup(dtypes=["float16"], head_dims=[64]) > 0
    before = set(_compile._kernels)
    for seqlen_q in (1, 200):  # decode, prefill
        q, k, v = (cupy.asarray(x) for x in random_qkv(2, seqlen_q, 300, 8, 2, 64, "float16", seed=seqlen_q))
        cupy_gqa.attention(q, k, v)
        cupy_gqa.attention(q, k, v, causal=False, kernel="rowwise")
    assert set(_compile._kernels) == before


# --- hopper: persistent CTAs ---------------------------------------------------------


def _hopper_only():
    if cupy.cuda.Device().compute_capability != "90":
        pytest.skip("hopper: compute capability 9.0 only")


@pytest.mark.parametrize("ctas", [1, 3, 7])
@pytest.mark.parametrize("num_q_heads,num_kv_heads,head_dim", [(8, 2, 128), (6, 2, 64), (4, 4, 80), (26, 2, 128),
                                                               (8, 4, 128)])
@pytest.mark.parametrize("causal", [True, False])
def test_hopper_persistent_ctas_walk_every_tile(monkeypatch, ctas, num_q_heads, num_kv_heads, head_dim, causal):
    """Few persistent CTAs (1, 3, 7) take every tile between them from a
    counter of the device's ring: tiles with no keys, Q and out by bulk copies (groups 4,
    3 in blocks of 63 rows, 1, 2) and by the threads (13), and a per-batch key count; three
    consumer warpgroups whose first rows end key tiles before the tile's last (group 2 at
    head dim 128: 96 positions a tile). Twice, so the second
    launch finds its counter at 0 too; the result equals one CTA per tile bit
    for bit, and every counter of the ring reads 0 afterwards."""
    _hopper_only()
    from cupy_gqa import _plan

    q, k, v = random_qkv(3, 300, 260, num_q_heads, num_kv_heads, head_dim, "bfloat16", seed=ctas + head_dim)
    qd, kd, vd = (cupy.asarray(x) for x in (q, k, v))
    lens = cupy.asarray(np.array([260, 0, 97], np.int32))
    monkeypatch.setattr(_plan.HopperLaunch, "ctas", lambda self, device: min(ctas, self.grid[0]))
    outs = []
    for _ in range(2):
        out = cupy.full(q.shape, np.nan, dtype=q.dtype)
        cupy_gqa.attention(qd, kd, vd, causal=causal, out=out, kernel="hopper", seqlens_k=lens)
        outs.append(out)
    monkeypatch.setattr(_plan, "HOPPER_PERSISTENT", False)
    single = cupy.full(q.shape, np.nan, dtype=q.dtype)
    cupy_gqa.attention(qd, kd, vd, causal=causal, out=single, kernel="hopper", seqlens_k=lens)
    for b, n in enumerate((260, 0, 97)):
        if n:
            ref = reference_attention(q[b : b + 1], k[b : b + 1, :n], v[b : b + 1, :n], causal=causal)[0]
            assert_close(cupy.asnumpy(outs[0][b : b + 1]), ref, TOLERANCE["bfloat16"], f"batch {b}")
        else:
            assert bool((outs[0][b] == 0).all())  # no keys: zeros
    for out in outs:
        assert cupy.asnumpy(out).tobytes() == cupy.asnumpy(single).tobytes()
    ring = _plan.counter_ring(cupy.cuda.Device().id)
    counters = cupy.ndarray((_plan.COUNTER_SLOTS,), cupy.int32, cupy.cuda.MemoryPointer(ring, 0))
    assert not bool(counters.any())


@pytest.mark.parametrize("group", [3, 5, 6, 7, 12, 14])
@pytest.mark.parametrize("head_dim", [64, 120, 192])
@pytest.mark.parametrize("causal", [True, False])
def test_hopper_blocks_of_whole_positions(group, head_dim, causal):
    """A group that does not divide 64 but leaves a warpgroup at least 56 rows
    of whole positions: hopper moves Q and out by bulk copies of 64 - 64 % group
    rows a warpgroup (the rest idle), so its tiles hold fewer packed rows than
    64 per warpgroup (three warpgroups at head dim 64, whose out goes from the
    registers; two above, through shared memory). out and lse against float64,
    with a per-batch key count (0, partial, full), seqlen_q off every tile, and
    the persistent CTAs' result equal bit for bit to one CTA per tile."""
    _hopper_only()
    from cupy_gqa import _plan

    q, k, v = random_qkv(3, 201, 230, 2 * group, 2, head_dim, "bfloat16", seed=group + head_dim)
    qd, kd, vd = (cupy.asarray(x) for x in (q, k, v))
    lens = np.array([230, 0, 77], np.int32)
    problem = _plan.Problem(3, 201, 230, 2 * group, 2, head_dim, "bfloat16", causal, head_dim**-0.5)
    assert _plan.hopper_plan_for(problem, qd, kd, vd, qd).bulk_qo
    out = cupy.full(q.shape, np.nan, dtype=q.dtype)
    res, lse = cupy_gqa.attention(qd, kd, vd, causal=causal, out=out, return_lse=True, kernel="hopper",
                                  seqlens_k=cupy.asarray(lens))
    for b, n in enumerate(lens):
        if n:
            ref, ref_lse = reference_attention(q[b : b + 1], k[b : b + 1, :n], v[b : b + 1, :n], causal=causal)
            assert_close(cupy.asnumpy(res[b : b + 1]), ref, TOLERANCE["bfloat16"], f"batch {b}")
            assert_lse_close(cupy.asnumpy(lse[b : b + 1]), ref_lse, 1e-6, f"batch {b} lse")
        else:
            assert bool((res[b] == 0).all()) and bool(cupy.isneginf(lse[b]).all())
    old = _plan.HOPPER_PERSISTENT
    try:
        _plan.HOPPER_PERSISTENT = False
        single = cupy_gqa.attention(qd, kd, vd, causal=causal, kernel="hopper", seqlens_k=cupy.asarray(lens))
    finally:
        _plan.HOPPER_PERSISTENT = old
    assert cupy.asnumpy(single).tobytes() == cupy.asnumpy(res).tobytes()


def test_hopper_streams_run_at_once():
    """Calls on several streams at once each take a tile counter of their own:
    every result is right (a shared counter would hand one call's tiles to
    another's CTAs)."""
    _hopper_only()
    q, k, v = random_qkv(2, 700, 700, 16, 4, 128, "float16", seed=5)
    qd, kd, vd = (cupy.asarray(x) for x in (q, k, v))
    ref = reference_attention(q, k, v)[0]
    cupy.cuda.Device().synchronize()  # the inputs are there before streams that don't wait for the default one
    streams = [cupy.cuda.Stream(non_blocking=True) for _ in range(4)]
    outs = []
    for _ in range(3):
        for s in streams:
            with s:
                out = cupy.full(q.shape, np.nan, dtype=q.dtype)
                cupy_gqa.attention(qd, kd, vd, out=out, kernel="hopper")
                outs.append(out)
    for s in streams:
        s.synchronize()
    for out in outs:
        assert_close(cupy.asnumpy(out), ref, TOLERANCE["float16"], "stream")
