"""The split-KV decode kernel (kernels/decode.cu) and seqlens_k on the GPU, against the float64 reference.

Decode shapes: seqlen_q 1 to 16 against seqlen_k 1 to 20000, group sizes 1,
4, 6, 7, 8, 16, 48, 64, 71, head dims 64, 128, 256 (and multiples of 8
between them, padded, in float16 / bfloat16), float16 / bfloat16 /
float32, every rows-per-CTA layout (16, 32, 64 on tensor cores, 1 to 8 on
CUDA cores) with one row block or several, ragged seqlens_k (0 and full
included, on the host or the device), lse. Outputs are NaN-poisoned before
each call.
"""
import numpy as np
import pytest

import cupy_gqa
from conftest import TOLERANCE, assert_close, assert_lse_close, gpu_available, random_qkv, strided_view
from reference import reference_attention

pytestmark = pytest.mark.gpu
if gpu_available():
    import cupy

    from cupy_gqa import _plan, _specs

DTYPES = ["bfloat16", "float16", "float32"]
GROUPS = {"MHA": (8, 8), "GQA4": (8, 2), "GQA8": (16, 2), "GQA16": (16, 1)}


def check(q, k, v, *, causal=True, seqlens_k=None, lens_on="host", kernel="decode", num_splits=None, block_m=None,
          cluster=None, what=""):
    """One GPU call into NaN-poisoned out / lse, compared with the reference
    (num_splits, block_m: the decode kernel with that many key ranges and rows
    per CTA in place of decode_dispatch's choice; cluster: its splits merged
    by their cluster (True) or by the combine (False), None: as decode_cluster says)."""
    dtype = q.dtype.name
    qd, kd, vd = (cupy.asarray(x) for x in (q, k, v))
    out = cupy.full(q.shape, np.nan, dtype=q.dtype)
    lens = None if seqlens_k is None else (cupy.asarray(seqlens_k, dtype=cupy.int32) if lens_on == "device" else seqlens_k)
    if num_splits is None:
        res, lse = cupy_gqa.attention(qd, kd, vd, causal=causal, return_lse=True, out=out, kernel=kernel, seqlens_k=lens)
        assert res is out
    else:  # the decode kernel with a forced number of key ranges
        problem = _plan.Problem.of(qd, kd, dtype=dtype, causal=causal, softmax_scale=1 / np.sqrt(q.shape[3]))
        lse = cupy.full((q.shape[0], q.shape[2], q.shape[1]), np.nan, dtype=cupy.float32)
        lens_d = None if lens is None else cupy.asarray(lens, dtype=cupy.int32)
        plan = _plan._launch_decode_forced_splits(problem, qd, kd, vd, out, lse, lens_d, num_splits, block_m=block_m,
                                                  cluster=cluster)
        assert cluster is None or plan.cluster == cluster
    ref, ref_lse = reference_attention(q, k, v, causal=causal, seqlens_k=seqlens_k)
    assert_close(cupy.asnumpy(out), ref, TOLERANCE[dtype], f"{kernel} {dtype} out {what}")
    assert_lse_close(cupy.asnumpy(lse), ref_lse, 1e-5, f"{kernel} {dtype} lse {what}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("heads", list(GROUPS))
@pytest.mark.parametrize("seqlen_q", [1, 2, 5, 16])
def test_dtype_head_dim_group(dtype, head_dim, heads, seqlen_q):
    num_q_heads, num_kv_heads = GROUPS[heads]
    q, k, v = random_qkv(2, seqlen_q, 700, num_q_heads, num_kv_heads, head_dim, dtype, seed=head_dim + seqlen_q)
    check(q, k, v, causal=True)


@pytest.mark.parametrize("seqlen_q", [1, 3, 8, 16])
@pytest.mark.parametrize("seqlen_k", [1, 2, 15, 16, 17, 255, 1000, 4097, 20000])
@pytest.mark.parametrize("causal", [True, False])
def test_lengths(seqlen_q, seqlen_k, causal):
    """Every seqlen_q against short and long caches, including seqlen_q > seqlen_k
    (causal rows that see no key: 0 and lse -inf)."""
    if seqlen_k == 20000 and seqlen_q > 3:
        pytest.skip("the float64 reference is slow there; 20000 runs with seqlen_q 1 and 3")
    q, k, v = random_qkv(1, seqlen_q, seqlen_k, 4, 1, 128, "bfloat16", seed=seqlen_q * 7 + seqlen_k)
    check(q, k, v, causal=causal, what=f"seqlen_q={seqlen_q} seqlen_k={seqlen_k}")


@pytest.mark.parametrize("num_splits", [1, 2, 3, 7, 40, 64, 100, 128])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_forced_splits(num_splits, dtype):
    """Split and unsplit paths agree with the reference, ranges shorter than a step included."""
    q, k, v = random_qkv(3, 4, 3000, 16, 2, 128, dtype, seed=num_splits)
    check(q, k, v, num_splits=num_splits, seqlens_k=np.array([3000, 1, 1789]), what=f"num_splits={num_splits}")


@pytest.mark.parametrize("kernel", ["decode", "tiled", "hopper", "rowwise", "auto"])
@pytest.mark.parametrize("lens_on", ["host", "device"])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("seqlen_q", [1, 4, 16])
def test_ragged_seqlens_k(kernel, lens_on, causal, seqlen_q):
    """Ragged cache lengths, with an empty and a full sequence, in every kernel."""
    seqlens_k = np.array([0, 2048, 1, 3, 1000, 17])
    q, k, v = random_qkv(len(seqlens_k), seqlen_q, 2048, 8, 2, 128, "float16", seed=seqlen_q)
    for b, n in enumerate(seqlens_k):  # keys past a sequence's length never reach a result
        k[b, n:] = np.nan
        v[b, n:] = np.nan
    check(q, k, v, causal=causal, seqlens_k=seqlens_k, lens_on=lens_on, kernel=kernel)


@pytest.mark.parametrize("head_dim", [64, 256])
@pytest.mark.parametrize("heads", ["MHA", "GQA16"])
def test_ragged_seqlens_k_many_batches(head_dim, heads):
    """Enough (batch, KV head) pairs that the grid has a single key range."""
    num_q_heads, num_kv_heads = GROUPS[heads]
    rng = np.random.default_rng(head_dim)
    seqlens_k = rng.integers(0, 600, size=40)
    seqlens_k[:2] = (0, 600)
    q, k, v = random_qkv(40, 2, 600, num_q_heads, num_kv_heads, head_dim, "bfloat16", seed=1)
    check(q, k, v, seqlens_k=seqlens_k)


@pytest.mark.parametrize("layout", ["packed", "transposed"])
def test_strided_layouts(layout):
    """Slices of a packed tensor and (batch, heads, seq, dim) views run without a copy."""
    rng = np.random.default_rng(3)
    q = strided_view(layout, rng, "bfloat16", 2, 3, 8, 128, cupy.asarray)
    k = strided_view(layout, rng, "bfloat16", 2, 999, 2, 128, cupy.asarray)
    v = strided_view(layout, rng, "bfloat16", 2, 999, 2, 128, cupy.asarray)
    out, lse = cupy_gqa.attention(q, k, v, return_lse=True, kernel="decode")
    ref, ref_lse = reference_attention(*(cupy.asnumpy(x) for x in (q, k, v)))
    assert_close(cupy.asnumpy(out), ref, TOLERANCE["bfloat16"], layout)
    assert_lse_close(cupy.asnumpy(lse), ref_lse, 1e-5)


@pytest.mark.parametrize("kernel", cupy_gqa.KERNELS)
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_device_seqlens_k_out_of_range_gives_nan_rows(kernel, dtype):
    """Device values are not checked on the host; every kernel marks a bad batch with NaN."""
    q, k, v = (cupy.asarray(x) for x in random_qkv(3, 2, 100, 8, 2, 64, dtype))
    lens = cupy.asarray([100, 101, -1], dtype=cupy.int32)
    if kernel == "hopper" and (dtype == "float32" or cupy.cuda.Device().compute_capability != "90"):
        pytest.skip("hopper: fp16 / bf16 on sm_90 only")
    out, lse = cupy_gqa.attention(q, k, v, return_lse=True, kernel=kernel, seqlens_k=lens)
    out, lse = cupy.asnumpy(out).astype(np.float32), cupy.asnumpy(lse)
    assert np.isfinite(out[0]).all() and np.isfinite(lse[0]).all()
    assert np.isnan(out[1:]).all() and np.isnan(lse[1:]).all()


def test_unsupported_calls_are_refused():
    q, k, v = (cupy.asarray(x) for x in random_qkv(1, 17, 50, 4, 1, 64, "bfloat16"))
    with pytest.raises(ValueError, match=r"kernel: 'decode' does not support this call: seqlen_q 17"):
        cupy_gqa.attention(q, k, v, kernel="decode")
    q, k, v = (cupy.asarray(x) for x in random_qkv(1, 1, 50, 4, 1, 100, "bfloat16"))
    with pytest.raises(ValueError, match=r"does not support this call: head_dim 100 \(it takes a multiple of 8 up to 256"):
        cupy_gqa.attention(q, k, v, kernel="decode")
    q, k, v = (cupy.asarray(x) for x in random_qkv(1, 1, 50, 4, 1, 96, "float32"))
    with pytest.raises(ValueError, match=r"does not support this call: head_dim 96 \(it takes 64, 128, 256 in float32\)"):
        cupy_gqa.attention(q, k, v, kernel="decode")
    q, k, v = (cupy.asarray(x) for x in random_qkv(1, 1, 50, 4, 1, 64, "float64"))
    with pytest.raises(ValueError, match=r"kernel: 'decode' does not support this call: dtype float64"):
        cupy_gqa.attention(q, k, v, kernel="decode")


@pytest.mark.parametrize("dtype", DTYPES)
def test_auto_follows_the_cost_model(dtype):
    """auto runs what _plan.decode_dispatch chooses: decode for a few query
    tokens against a cache, whatever the heads per KV head (multi-query with 64
    heads included), the prefill kernel for many rows against few keys."""
    device = cupy.cuda.Device().id
    for shape in ((2, 1, 2048, 32, 8), (2, 1, 2048, 64, 1), (2, 4, 2048, 28, 4), (64, 16, 512, 64, 8)):
        q, k, v = (cupy.asarray(x) for x in random_qkv(*shape, 64, dtype))
        problem = _plan.Problem.of(q, k, dtype=dtype, causal=True, softmax_scale=1.0)
        choice = _plan.decode_dispatch(problem, _plan.sm_count(device), _plan.device_arch(device))
        picked = _plan.choose_kernel(problem, q, k, v, cupy.empty_like(q))
        assert (picked == "decode") == (choice.kernel == "decode"), (shape, picked, choice)
        if shape[3] == 64 and shape[4] == 1:
            assert picked == "decode", choice


# --- row packing: any rows per KV head, in 16 / 32 / 64-row CTAs (fp16 / bf16),
# --- 1 to 8 (float32); any key length, split or not --------------------------

ROW_SHAPES = {  # (batch, seqlen_q, num_q_heads, num_kv_heads): rows = seqlen_q * group
    "group7": (2, 1, 28, 4),      # odd group
    "group7_sq3": (2, 3, 14, 2),  # 21 rows
    "mqa64": (2, 1, 64, 1),       # one 64-row block
    "mqa71": (1, 1, 71, 1),       # 64 + 7 rows
    "mqa48_sq2": (1, 2, 48, 1),   # 96 rows
    "tp_rank": (3, 1, 8, 1),      # 8 query heads, 1 KV head
}


def _block_ms(dtype):
    return _specs.decode_block_ms(dtype)


def _clusters():
    return int(cupy.cuda.Device().compute_capability) >= 90


@pytest.mark.parametrize("cluster", [2, 4, 8])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_cluster_merge(cluster, dtype, head_dim):
    """A split call's splits in one thread-block cluster that merges them itself
    (decode_mma_attention_cluster, sm_90), at every rows-per-CTA layout, with
    ragged device lengths (0 and full included), several row blocks, and a
    range of keys shorter than a split; the same call by the combine agrees."""
    if not _clusters():
        pytest.skip("thread-block clusters: compute capability 9.0 or newer")
    q, k, v = random_qkv(3, 5, 2500, 16, 2, head_dim, dtype, seed=cluster * 1000 + head_dim)  # 40 rows per KV head
    lens = np.array([2500, 0, 77], dtype=np.int32)
    for block_m in (16, 32, 64):
        for merged in (True, False):
            check(q, k, v, num_splits=cluster, block_m=block_m, cluster=merged, seqlens_k=lens, lens_on="device",
                  what=f"cluster={cluster} merged={merged} D{head_dim} block_m={block_m}")
    check(q, k, v, causal=False, num_splits=cluster, cluster=True, what=f"cluster={cluster} non-causal")


def test_cluster_merge_bad_length_gives_nan_rows():
    """A device length outside [0, seqlen_k] makes its batch's rows NaN in the cluster merge too."""
    if not _clusters():
        pytest.skip("thread-block clusters: compute capability 9.0 or newer")
    q, k, v = (cupy.asarray(x) for x in random_qkv(3, 1, 3000, 8, 2, 128, "bfloat16", seed=5))
    problem = _plan.Problem.of(q, k, dtype="bfloat16", causal=True, softmax_scale=1 / np.sqrt(128))
    out = cupy.full(q.shape, np.nan, dtype=q.dtype)
    lse = cupy.full((3, 8, 1), np.nan, dtype=cupy.float32)
    lens = cupy.asarray([3000, 3001, 1500], dtype=cupy.int32)
    plan = _plan._launch_decode_forced_splits(problem, q, k, v, out, lse, lens, 4, cluster=True)
    assert plan.cluster and plan.workspace_bytes == 0
    o, l = cupy.asnumpy(out).astype(np.float64), cupy.asnumpy(lse)
    assert np.isnan(o[1]).all() and np.isnan(l[1]).all()
    host = [cupy.asnumpy(a) for a in (q, k, v)]
    for b, n in ((0, 3000), (2, 1500)):
        ref, ref_lse = reference_attention(*(a[b:b + 1] for a in host), causal=True, seqlens_k=np.array([n]))
        assert_close(o[b:b + 1], ref, TOLERANCE["bfloat16"], f"cluster batch {b}")
        assert_lse_close(l[b:b + 1], ref_lse, 1e-5, f"cluster batch {b} lse")


def test_cluster_refused_where_it_does_not_apply():
    q, k, v = (cupy.asarray(x) for x in random_qkv(1, 1, 3000, 8, 2, 64, "float32", seed=1))
    problem = _plan.Problem.of(q, k, dtype="float32", causal=True, softmax_scale=0.125)
    out = cupy.empty_like(q)
    lse = cupy.empty((1, 8, 1), dtype=cupy.float32)
    with pytest.raises(ValueError, match="cluster: no cluster kernel for 4 splits"):
        _plan._launch_decode_forced_splits(problem, q, k, v, out, lse, None, 4, cluster=True)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", list(ROW_SHAPES))
@pytest.mark.parametrize("seqlen_k", [1, 63, 1000, 4000])
def test_row_packing_every_block_size(dtype, shape, seqlen_k):
    """Every rows-per-CTA layout of the dtype, split and unsplit, against the
    float64 reference: odd groups, many rows per KV head, several row blocks,
    key lengths that are not multiples of 16, 64 or the split size."""
    batch, seqlen_q, hq, hkv = ROW_SHAPES[shape]
    q, k, v = random_qkv(batch, seqlen_q, seqlen_k, hq, hkv, 128, dtype, seed=seqlen_k + hq)
    for block_m in _block_ms(dtype):
        for num_splits in (1, 3):
            check(q, k, v, num_splits=num_splits, block_m=block_m,
                  what=f"{shape} seqlen_k={seqlen_k} block_m={block_m} splits={num_splits}")


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("block_m", [32, 64])
def test_multi_warp_streams_every_head_dim(dtype, head_dim, block_m):
    """The 2- and 4-warp key streams (named barriers, shared stages) at every head dim."""
    q, k, v = random_qkv(2, 1, 777, 64, 2, head_dim, dtype, seed=head_dim + block_m)
    for num_splits in (1, 2, 7):
        check(q, k, v, num_splits=num_splits, block_m=block_m, what=f"D{head_dim} block_m={block_m} splits={num_splits}")


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("head_dim", [8, 40, 72, 80, 96, 104, 136, 160, 192, 248])
def test_padded_head_dims(dtype, head_dim):
    """head_dims between the kernels' 64, 128 and 256, padded inside the
    kernel: every rows-per-CTA layout, unsplit, through the combine (3 splits)
    and in clusters (4, sm_90), with ragged device lengths (0 and full
    included), several row blocks, causal or not. The memory past a row's
    head_dim holds the next head's (or key's) values, so a padded column
    that were read, or an output column written past head_dim, would show."""
    q, k, v = random_qkv(3, 3, 1500, 16, 2, head_dim, dtype, seed=head_dim)  # 24 rows per KV head
    lens = np.array([1500, 0, 333], dtype=np.int32)
    for block_m in _block_ms(dtype):
        for num_splits, cluster in ((1, None), (3, False), (4, True if _clusters() else None)):
            check(q, k, v, num_splits=num_splits, block_m=block_m, cluster=cluster, seqlens_k=lens, lens_on="device",
                  what=f"D{head_dim} block_m={block_m} splits={num_splits}")
    check(q, k, v, causal=False, what=f"D{head_dim} non-causal")
    # the modifiers' kernel: a sliding window, a softcap and sinks
    mods = {"window": (500, 0), "softcap": 20.0, "sinks": np.linspace(-1, 1, 16).astype(np.float32)}
    qd, kd, vd = (cupy.asarray(x) for x in (q, k, v))
    res, lse = cupy_gqa.attention(qd, kd, vd, kernel="decode", return_lse=True,
                                  **{**mods, "sinks": cupy.asarray(mods["sinks"])})
    ref, ref_lse = reference_attention(q, k, v, causal=True, **mods)
    assert_close(cupy.asnumpy(res), ref, TOLERANCE[dtype], f"D{head_dim} window, softcap, sinks")
    assert_lse_close(cupy.asnumpy(lse), ref_lse, 1e-5)
    # out= a view whose rows are longer than head_dim: the columns past it stay as they were
    qd, kd, vd = (cupy.asarray(x) for x in (q, k, v))
    wide = cupy.full(q.shape[:3] + (head_dim + 8,), 7, dtype=q.dtype)
    cupy_gqa.attention(qd, kd, vd, kernel="decode", out=wide[..., :head_dim])
    assert (cupy.asnumpy(wide[..., head_dim:]) == 7).all()
    ref, _ = reference_attention(q, k, v, causal=True)
    assert_close(cupy.asnumpy(wide[..., :head_dim]), ref, TOLERANCE[dtype], f"D{head_dim} into a wider out")


@pytest.mark.parametrize("head_dim", [80, 96])
def test_padded_head_dims_auto_takes_decode(head_dim):
    """auto runs decode at a padded head dim where the cost model says so
    (Phi-3-mini's decode: 32 heads of 96, one per KV head)."""
    q, k, v = random_qkv(2, 1, 3000, 32, 32, head_dim, "bfloat16", seed=head_dim)
    problem = _plan.Problem.of(cupy.asarray(q), cupy.asarray(k), dtype="bfloat16", causal=True,
                               softmax_scale=1 / np.sqrt(head_dim))
    device = cupy.cuda.Device().id
    assert _plan.decode_dispatch(problem, _plan.sm_count(device), _plan.device_arch(device)).kernel == "decode"
    check(q, k, v, kernel="auto", what=f"auto D{head_dim}")


@pytest.mark.parametrize("seqlen_q", range(2, 9))
@pytest.mark.parametrize("lens_on", ["host", "device"])
def test_speculative_decoding_bottom_right_causal(seqlen_q, lens_on):
    """seqlen_q 2 .. 8 with group 8 (16 to 64 rows), causal aligned to each
    sequence's own length (ragged seqlens_k, on the host or the device), auto's
    choice and every tensor-core block size."""
    seqlens_k = np.array([2500, 5, 1, 1037])
    q, k, v = random_qkv(4, seqlen_q, 2500, 32, 4, 128, "bfloat16", seed=seqlen_q)
    for b, n in enumerate(seqlens_k):  # keys past a sequence's length never reach a result
        k[b, n:] = np.nan
        v[b, n:] = np.nan
    check(q, k, v, seqlens_k=seqlens_k, lens_on=lens_on, kernel="auto", what=f"seqlen_q={seqlen_q} auto")
    for block_m in _block_ms("bfloat16"):
        check(q, k, v, seqlens_k=seqlens_k, lens_on=lens_on, num_splits=2, block_m=block_m,
              what=f"seqlen_q={seqlen_q} block_m={block_m}")


@pytest.mark.parametrize("shape", ["mqa64", "mqa71", "group7"])
def test_auto_on_the_row_shapes(shape):
    """auto (decode_dispatch's block size and splits) with lse, one long cache."""
    batch, seqlen_q, hq, hkv = ROW_SHAPES[shape]
    q, k, v = random_qkv(batch, seqlen_q, 20000, hq, hkv, 64, "bfloat16", seed=hq)
    check(q, k, v, kernel="auto", what=shape)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("growth", ["none", "rising"])
def test_large_and_rising_scores(dtype, growth):
    """The tensor-core kernel's lazy rescale: scores of +-30 and more, and a
    running max that keeps rising along the cache (a rescale every few tiles),
    split and unsplit."""
    q, k, v = random_qkv(2, 3, 5000, 16, 2, 128, dtype, seed=11, scale=2.5)
    if growth == "rising":  # key j leans towards the queries by a factor growing with j
        ramp = np.linspace(0.0, 1.0, k.shape[1])[None, :, None, None]
        k = (k.astype(np.float64) + 1.5 * ramp * q[:, :1, ::8].astype(np.float64)).astype(k.dtype)
    for num_splits in (None, 1, 5):
        check(q, k, v, num_splits=num_splits, what=f"growth={growth} splits={num_splits}")


def test_torch_seqlens_k():
    torch = pytest.importorskip("torch")
    q, k, v = random_qkv(3, 2, 300, 8, 2, 128, "float16", seed=5)
    seqlens_k = np.array([300, 0, 123])
    tq, tk, tv = (torch.from_numpy(x).cuda() for x in (q, k, v))
    ref, _ = reference_attention(q, k, v, seqlens_k=seqlens_k)
    for lens in (torch.tensor(seqlens_k), torch.tensor(seqlens_k, dtype=torch.int32, device="cuda")):
        with torch.no_grad():
            out = cupy_gqa.attention(tq, tk, tv, seqlens_k=lens)
        assert_close(out.float().cpu().numpy(), ref, TOLERANCE["float16"], f"torch seqlens_k on {lens.device}")


# --- bad seqlens_k on the GPU (README's bad-input table) ----------------------


def _qkv_gpu():
    return tuple(cupy.asarray(x) for x in random_qkv(2, 1, 100, 4, 1, 64, "bfloat16"))


def test_device_seqlens_k_must_be_int32():
    with pytest.raises(TypeError, match=r"seqlens_k: expected dtype int32 for a CUDA array .*, got int64"):
        cupy_gqa.attention(*_qkv_gpu(), seqlens_k=cupy.asarray([1, 2], dtype=cupy.int64))


def test_device_seqlens_k_wrong_shape():
    with pytest.raises(ValueError, match=r"seqlens_k: expected shape \(2,\) \(the batch of q\), got \(3,\)"):
        cupy_gqa.attention(*_qkv_gpu(), seqlens_k=cupy.asarray([1, 2, 3], dtype=cupy.int32))


def test_device_seqlens_k_strided():
    lens = cupy.asarray([1, 0, 2, 0], dtype=cupy.int32)[::2]
    with pytest.raises(ValueError, match=r"seqlens_k: expected a unit-stride last axis .*, got strides \(8,\)"):
        cupy_gqa.attention(*_qkv_gpu(), seqlens_k=lens)


def test_device_seqlens_k_for_cpu_inputs():
    q, k, v = random_qkv(2, 1, 100, 4, 1, 64, "float32")
    with pytest.raises(ValueError, match=r"seqlens_k: expected a list, tuple, NumPy array or CPU torch tensor for CPU inputs"):
        cupy_gqa.attention(q, k, v, seqlens_k=cupy.asarray([1, 2], dtype=cupy.int32))


def test_host_seqlens_k_checked_for_gpu_inputs():
    with pytest.raises(ValueError, match=r"seqlens_k: expected values in \[0, 100\] \(0 to seqlen_k\), got 101 at batch 1"):
        cupy_gqa.attention(*_qkv_gpu(), seqlens_k=[100, 101])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seqlen_k", [1, 17])
def test_softmax_scale_zero(dtype, seqlen_k):
    """softmax_scale 0: every visible key weighs the same, keys masked in a
    partial tile included (0 * -inf must not turn into NaN)."""
    q, k, v = random_qkv(1, 1, seqlen_k, 4, 1, 64, dtype, seed=seqlen_k)
    out = cupy.full(q.shape, np.nan, dtype=q.dtype)
    cupy_gqa.attention(*(cupy.asarray(x) for x in (q, k, v)), softmax_scale=0.0, out=out, kernel="decode")
    ref, _ = reference_attention(q, k, v, causal=True, softmax_scale=0.0)
    assert_close(cupy.asnumpy(out), ref, TOLERANCE[dtype], f"decode {dtype} scale 0")


def test_host_seqlens_k_is_refused_during_graph_capture():
    """A host seqlens_k would be copied into the graph with this call's values."""
    q, k, v = (cupy.asarray(x) for x in random_qkv(2, 1, 256, 8, 2, 64, "bfloat16"))
    cupy_gqa.attention(q, k, v, seqlens_k=[256, 100])  # compiled and planned before the capture
    lens = cupy.asarray([256, 100], dtype=cupy.int32)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        try:
            with pytest.raises(ValueError, match=r"seqlens_k: expected a CUDA int32 array while a CUDA graph is being captured"):
                cupy_gqa.attention(q, k, v, seqlens_k=[256, 100])
            out = cupy_gqa.attention(q, k, v, seqlens_k=lens)  # a device array is fine
        finally:
            graph = stream.end_capture()
    graph.launch(stream)
    stream.synchronize()
    ref = reference_attention(*(cupy.asnumpy(x) for x in (q, k, v)), seqlens_k=[256, 100])[0]
    assert_close(cupy.asnumpy(out), ref, TOLERANCE["bfloat16"], "replayed graph")
