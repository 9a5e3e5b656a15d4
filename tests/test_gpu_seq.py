"""Variable-length batches, paged KV caches and left padding on the GPU: each
kernel family against the float64 references built sequence by sequence
(tests/reference.py), outputs NaN-poisoned before every call, and each path
captured into a CUDA graph and replayed after the lengths, offsets and page
tables change in place."""
import numpy as np
import pytest

import cupy_gqa
from cupy_gqa import _fast, api
from conftest import NP_DTYPES, TOLERANCE, assert_close, assert_lse_close, gpu_available
from reference import reference_kvcache, reference_varlen

pytestmark = pytest.mark.gpu
if gpu_available():
    import cupy

KERNELS = ["auto", "rowwise", "tiled", "hopper", "decode"]


def _skip_unsupported(kernel, dtype, seqlen_q=1, paged=False):
    cc = int(cupy.cuda.Device().compute_capability)
    if kernel in ("tiled", "decode") and dtype != "float32" and cc < 80:
        pytest.skip("tensor-core kernels: compute capability 8.0 or newer")
    if kernel == "decode" and seqlen_q > 16:
        pytest.skip("decode: at most 16 query tokens")
    if kernel == "hopper" and (cc != 90 or dtype not in ("float16", "bfloat16")):
        pytest.skip("hopper: compute capability 9.0, fp16 / bf16")


def _tolerance(kernel, dtype):
    return TOLERANCE[dtype] if dtype != "float32" or kernel in ("rowwise", "decode") else 2e-6


def _packed(lens, heads, head_dim, dtype, rng):
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    return rng.standard_normal((int(cu[-1]), heads, head_dim)).astype(NP_DTYPES[dtype]), cu


def _pool(num_seqs, page_size, max_pages, heads, head_dim, dtype, rng, spare=5):
    """A pool of pages and a block_table over it in shuffled order (some pages unused)."""
    num_pages = num_seqs * max_pages + spare
    k = rng.standard_normal((num_pages, page_size, heads, head_dim)).astype(NP_DTYPES[dtype])
    v = rng.standard_normal((num_pages, page_size, heads, head_dim)).astype(NP_DTYPES[dtype])
    table = rng.permutation(num_pages)[: num_seqs * max_pages].reshape(num_seqs, max_pages).astype(np.int32)
    return k, v, table


# --- varlen -----------------------------------------------------------------------


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("lens_q,lens_k", [
    ([1, 1, 1, 1], [1, 700, 0, 129]),            # decode: one key, many, none
    ([5, 0, 16, 3], [40, 9, 300, 2]),            # a few queries; seqlen_q > seqlen_k in the last
    ([130, 1, 64, 77], [130, 300, 64, 1000]),    # prefill, lengths not multiples of a tile
])  # fmt: skip
def test_varlen(kernel, dtype, lens_q, lens_k):
    _skip_unsupported(kernel, dtype, max(lens_q))
    rng = np.random.default_rng(sum(lens_q) + sum(lens_k))
    q, cu_q = _packed(lens_q, 8, 128, dtype, rng)
    k, cu_k = _packed(lens_k, 2, 128, dtype, rng)
    v, _ = _packed(lens_k, 2, 128, dtype, rng)
    ref, ref_lse = reference_varlen(q, k, v, cu_q, cu_k)
    out = cupy.full(q.shape, np.nan, dtype=q.dtype)
    res, lse = cupy_gqa.attention_varlen(*(cupy.asarray(x) for x in (q, k, v)), cupy.asarray(cu_q), cupy.asarray(cu_k),
                                         max(lens_q), max(lens_k), out=out, return_lse=True, kernel=kernel)  # fmt: skip
    assert res is out
    assert_close(cupy.asnumpy(res), ref, _tolerance(kernel, dtype), f"varlen {kernel} {dtype}")
    assert_lse_close(cupy.asnumpy(lse), ref_lse, 1e-5)


def test_varlen_host_offsets_and_torch():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(1)
    q, cu_q = _packed([3, 40], 4, 64, "float16", rng)
    k, cu_k = _packed([50, 40], 1, 64, "float16", rng)
    v, _ = _packed([50, 40], 1, 64, "float16", rng)
    out = cupy_gqa.attention_varlen(*(torch.from_numpy(x).cuda() for x in (q, k, v)), cu_q, cu_k, 40, 50)
    assert isinstance(out, torch.Tensor) and out.is_cuda
    assert_close(out.cpu().numpy(), reference_varlen(q, k, v, cu_q, cu_k)[0], TOLERANCE["float16"])


@pytest.mark.parametrize("kernel", ["auto", "hopper", "tiled"])
@pytest.mark.parametrize("head_dim,page_size", [(64, 16), (80, 48), (128, 16), (128, 256), (192, 32), (192, 48), (256, 64)])
@pytest.mark.parametrize("leftpad", [False, True])
def test_paged_long(kernel, head_dim, page_size, leftpad):
    """Prefill and chunked prefill against paged caches long enough for several
    key tiles of every prefill kernel, pages shuffled in the pool: lengths that
    end inside a page and inside a tile, a sequence with no key, queries fewer
    than the keys; NaN in every page and slot that no sequence reads (so a key
    read past a sequence's end, or a wrong page, shows). hopper's boxes are
    gcd(page_size, key tile) rows: 16, 32, 48, 64 and 128 here. Auto takes hopper
    on 9.0 at these lengths."""
    dtype = "bfloat16"
    _skip_unsupported(kernel, dtype, 2000, paged=True)
    if kernel == "tiled" and head_dim in (80, 192):
        pytest.skip(f"tiled: no head_dim {head_dim}")
    rng = np.random.default_rng(head_dim + page_size + leftpad)
    max_pages = -(-1300 // page_size)
    seqlens = np.array([1300, 0, 777, 1100], dtype=np.int32)
    pads = np.array([0, 0, 130, 1099], dtype=np.int32) if leftpad else None  # none, none, some, all but one
    k, v, table = _pool(len(seqlens), page_size, max_pages, 4, head_dim, dtype, rng, spare=3)
    used = np.zeros(k.shape[:2], dtype=bool)
    for b, n in enumerate(seqlens):
        for j in range(pads[b] if leftpad else 0, n):
            used[table[b, j // page_size], j % page_size] = True
    k[~used], v[~used] = np.nan, np.nan  # never read
    q = rng.standard_normal((len(seqlens), 700, 16, head_dim)).astype(NP_DTYPES[dtype])
    index = {"block_table": table, "seqlens_k": seqlens, "cache_leftpad": pads}
    ref, ref_lse = reference_kvcache(q, k, v, **index)
    out = cupy.full(q.shape, np.nan, dtype=q.dtype)
    res, lse = cupy_gqa.attention(*(cupy.asarray(x) for x in (q, k, v)), out=out, return_lse=True, kernel=kernel,
                                  **{n: cupy.asarray(a) for n, a in index.items() if a is not None})  # fmt: skip
    assert_close(cupy.asnumpy(res), ref, TOLERANCE[dtype], f"paged {kernel} D{head_dim} page {page_size}")
    assert_lse_close(cupy.asnumpy(lse), ref_lse, 1e-5)


@pytest.mark.parametrize("kernel", ["auto", "hopper", "tiled"])
def test_paged_bhsd(kernel):
    """A pool laid out (num_pages, num_kv_heads, page_size, head_dim) with q and
    out (batch, heads, seqlen, head_dim): the same keys through other strides."""
    dtype = "float16"
    _skip_unsupported(kernel, dtype, 300, paged=True)
    rng = np.random.default_rng(12)
    k, v, table = _pool(3, 64, 10, 2, 128, dtype, rng)  # (pages, page_size, heads, head_dim)
    seqlens = np.array([640, 300, 65], dtype=np.int32)
    q = rng.standard_normal((3, 300, 8, 128)).astype(NP_DTYPES[dtype])
    ref, _ = reference_kvcache(q, k, v, seqlens_k=seqlens, block_table=table)
    kt, vt, qt = (cupy.asarray(np.ascontiguousarray(x.transpose(0, 2, 1, 3))) for x in (k, v, q))
    res = cupy_gqa.attention(qt, kt, vt, block_table=cupy.asarray(table), seqlens_k=cupy.asarray(seqlens),
                             layout="bhsd", kernel=kernel)  # fmt: skip
    assert_close(cupy.asnumpy(res).transpose(0, 2, 1, 3), ref, TOLERANCE[dtype], f"paged bhsd {kernel}")


@pytest.mark.parametrize("kernel", ["auto", "hopper", "tiled"])
@pytest.mark.parametrize("head_dim", [64, 80, 128, 256])
@pytest.mark.parametrize("causal", [True, False])
def test_varlen_long(kernel, head_dim, causal):
    """Prefill lengths around and past the tiles of hopper (128, 96 or 64 keys):
    every sequence but the last ends inside a key tile that holds the next
    one's keys, the last ends before the packed array (padding rows after it),
    and seqlen_q differs from seqlen_k in some; auto takes hopper from
    max_seqlen_k 1024 on (on 9.0)."""
    dtype = "bfloat16"
    _skip_unsupported(kernel, dtype, 2000)
    if kernel == "tiled" and head_dim == 80:
        pytest.skip("tiled: no head_dim 80")
    lens_q = [1100, 1, 130, 700, 257]
    lens_k = [1100, 129, 130, 1500, 1023]
    rng = np.random.default_rng(head_dim + causal)
    q, cu_q = _packed(lens_q, 16, head_dim, dtype, rng)
    k, cu_k = _packed(lens_k + [37], 4, head_dim, dtype, rng)  # 37 padding rows past the last sequence
    v, _ = _packed(lens_k + [37], 4, head_dim, dtype, rng)
    k[cu_k[-2]:], v[cu_k[-2]:] = np.nan, np.nan  # never read
    cu_k = cu_k[:-1]
    ref, ref_lse = reference_varlen(q, k[: cu_k[-1]], v[: cu_k[-1]], cu_q, cu_k, causal=causal)
    out = cupy.full(q.shape, np.nan, dtype=q.dtype)
    res, lse = cupy_gqa.attention_varlen(*(cupy.asarray(x) for x in (q, k, v)), cupy.asarray(cu_q), cupy.asarray(cu_k),
                                         max(lens_q), max(lens_k), causal=causal, out=out, return_lse=True,
                                         kernel=kernel)  # fmt: skip
    assert_close(cupy.asnumpy(res), ref, TOLERANCE[dtype], f"varlen {kernel} D{head_dim} causal {causal}")
    assert_lse_close(cupy.asnumpy(lse), ref_lse, 1e-5)


@pytest.mark.parametrize("kernel", ["hopper", "tiled", "rowwise"])
def test_varlen_nan_stays_in_its_sequence(kernel):
    """A NaN in one sequence's keys and values (its own rows then NaN) never
    reaches the sequences beside it: the key tile that holds a sequence's end
    also holds the next one's first keys, which must not enter P V (0 * NaN)."""
    dtype = "bfloat16"
    _skip_unsupported(kernel, dtype, 300)
    lens = [200, 300, 150]
    rng = np.random.default_rng(11)
    q, cu = _packed(lens, 8, 128, dtype, rng)
    k, _ = _packed(lens, 2, 128, dtype, rng)
    v, _ = _packed(lens, 2, 128, dtype, rng)
    k[cu[1] : cu[1] + 5], v[cu[1] : cu[1] + 5] = np.nan, np.inf  # sequence 1's first keys
    k[cu[2] - 1], v[cu[2] - 1] = np.inf, np.nan  # ... and its last
    res = cupy.asnumpy(cupy_gqa.attention_varlen(*(cupy.asarray(x) for x in (q, k, v)), cupy.asarray(cu),
                                                 cupy.asarray(cu), 300, 300, kernel=kernel))  # fmt: skip
    for b in (0, 2):
        rows = slice(cu[b], cu[b + 1])
        ref, _ = reference_varlen(q[rows], k[rows], v[rows], cu[b : b + 2] - cu[b], cu[b : b + 2] - cu[b])
        assert_close(res[rows], ref, TOLERANCE[dtype], f"sequence {b} beside a NaN one, {kernel}")


# --- paged ------------------------------------------------------------------------


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("page_size", [16, 32, 256])
@pytest.mark.parametrize("seqlen_q", [1, 5, 40])
def test_paged(kernel, page_size, seqlen_q):
    dtype = "bfloat16"
    _skip_unsupported(kernel, dtype, seqlen_q, paged=True)
    rng = np.random.default_rng(page_size + seqlen_q)
    max_pages = max(2, 600 // page_size)
    cap = max_pages * page_size
    seqlens = np.array([0, 1, page_size, page_size + 1, cap - 7, cap], dtype=np.int32)
    k, v, table = _pool(len(seqlens), page_size, max_pages, 2, 128, dtype, rng)
    q = rng.standard_normal((len(seqlens), seqlen_q, 8, 128)).astype(NP_DTYPES[dtype])
    ref, ref_lse = reference_kvcache(q, k, v, seqlens_k=seqlens, block_table=table)
    out = cupy.full(q.shape, np.nan, dtype=q.dtype)
    res, lse = cupy_gqa.attention(*(cupy.asarray(x) for x in (q, k, v)), block_table=cupy.asarray(table),
                                  seqlens_k=cupy.asarray(seqlens), out=out, return_lse=True, kernel=kernel)  # fmt: skip
    assert_close(cupy.asnumpy(res), ref, TOLERANCE[dtype], f"paged {kernel} page {page_size}")
    assert_lse_close(cupy.asnumpy(lse), ref_lse, 1e-5)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_paged_decode_split(dtype):
    """Few (batch, KV head) pairs against long paged caches: the decode kernel
    splits the keys (a workspace) and the combine merges them."""
    rng = np.random.default_rng(3)
    k, v, table = _pool(2, 16, 300, 1, 64, dtype, rng)
    seqlens = np.array([4800, 3001], dtype=np.int32)
    q = rng.standard_normal((2, 1, 4, 64)).astype(NP_DTYPES[dtype])
    args = [cupy.asarray(x) for x in (q, k, v)]
    kw = {"block_table": cupy.asarray(table), "seqlens_k": cupy.asarray(seqlens), "kernel": "decode"}
    assert cupy_gqa.workspace_size(*args, **kw) > 0
    res, lse = cupy_gqa.attention(*args, **kw, return_lse=True)
    ref, ref_lse = reference_kvcache(q, k, v, seqlens_k=seqlens, block_table=table)
    assert_close(cupy.asnumpy(res), ref, TOLERANCE[dtype])
    assert_lse_close(cupy.asnumpy(lse), ref_lse, 1e-5)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("head_dim", [80, 96, 192])
def test_paged_decode_padded_head_dim(dtype, head_dim):
    """Paged decode at head dims the kernel pads (to 128 or 256), split through
    the combine."""
    rng = np.random.default_rng(head_dim)
    k, v, table = _pool(2, 16, 300, 1, head_dim, dtype, rng)
    seqlens = np.array([4800, 3001], dtype=np.int32)
    q = rng.standard_normal((2, 1, 4, head_dim)).astype(NP_DTYPES[dtype])
    args = [cupy.asarray(x) for x in (q, k, v)]
    kw = {"block_table": cupy.asarray(table), "seqlens_k": cupy.asarray(seqlens), "kernel": "decode"}
    assert cupy_gqa.workspace_size(*args, **kw) > 0
    res, lse = cupy_gqa.attention(*args, **kw, return_lse=True)
    ref, ref_lse = reference_kvcache(q, k, v, seqlens_k=seqlens, block_table=table)
    assert_close(cupy.asnumpy(res), ref, TOLERANCE[dtype], f"paged D{head_dim}")
    assert_lse_close(cupy.asnumpy(lse), ref_lse, 1e-5)


@pytest.mark.parametrize("block_m", [16, 32, 64])
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("addressing", ["varlen", "paged_leftpad"])
def test_decode_row_layouts(monkeypatch, block_m, num_splits, addressing):
    """Each tensor-core decode layout (16, 32 or 64 packed rows per CTA) with
    per-sequence addressing, whole and split: 7 query heads per KV head and
    ragged query counts end row blocks mid-CTA, and shorter sequences leave
    whole row blocks idle."""
    from cupy_gqa import _plan

    dtype = "bfloat16"
    _skip_unsupported("decode", dtype)
    monkeypatch.setattr(_plan, "decode_dispatch", lambda *a: _plan.DecodeChoice("decode", block_m, num_splits, 0.0, 1.0))
    _plan.plan_decode.cache_clear()
    rng = np.random.default_rng(block_m + num_splits)
    try:
        if addressing == "varlen":
            lens_q, lens_k = [8, 1, 5, 8], [700, 0, 129, 1500]
            q, cu_q = _packed(lens_q, 14, 128, dtype, rng)
            k, cu_k = _packed(lens_k, 2, 128, dtype, rng)
            v, _ = _packed(lens_k, 2, 128, dtype, rng)
            ref, ref_lse = reference_varlen(q, k, v, cu_q, cu_k)
            out = cupy.full(q.shape, np.nan, dtype=q.dtype)
            res, lse = cupy_gqa.attention_varlen(*(cupy.asarray(x) for x in (q, k, v)), cupy.asarray(cu_q),
                                                 cupy.asarray(cu_k), max(lens_q), max(lens_k), out=out,
                                                 return_lse=True, kernel="decode")  # fmt: skip
        else:
            seqlens, leftpad = np.int32([900, 40, 1200]), np.int32([100, 40, 0])  # some padding, all, none
            k, v, table = _pool(3, 32, 40, 2, 128, dtype, rng)
            q = rng.standard_normal((3, 6, 14, 128)).astype(NP_DTYPES[dtype])
            ref, ref_lse = reference_kvcache(q, k, v, seqlens_k=seqlens, block_table=table, cache_leftpad=leftpad)
            out = cupy.full(q.shape, np.nan, dtype=q.dtype)
            res, lse = cupy_gqa.attention(*(cupy.asarray(x) for x in (q, k, v)), block_table=cupy.asarray(table),
                                          seqlens_k=cupy.asarray(seqlens), cache_leftpad=cupy.asarray(leftpad), out=out,
                                          return_lse=True, kernel="decode")  # fmt: skip
        assert_close(cupy.asnumpy(res), ref, TOLERANCE[dtype], f"{addressing} block_m={block_m} splits={num_splits}")
        assert_lse_close(cupy.asnumpy(lse), ref_lse, 1e-5)
    finally:
        _plan.plan_decode.cache_clear()  # no forced plan outlives the test


# --- left padding -----------------------------------------------------------------


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("seqlen_q", [1, 48])
def test_leftpad(kernel, paged, seqlen_q):
    dtype = "float16"
    _skip_unsupported(kernel, dtype, seqlen_q, paged)
    rng = np.random.default_rng(seqlen_q + paged)
    seqlens = np.array([96, 80, 33, 96], dtype=np.int32)
    leftpad = np.array([0, 17, 33, 95], dtype=np.int32)  # none, some, all (no key), all but one
    if paged:
        k, v, table = _pool(4, 32, 3, 2, 64, dtype, rng)
        kw = {"block_table": cupy.asarray(table)}
    else:
        k, v = (rng.standard_normal((4, 96, 2, 64)).astype(NP_DTYPES[dtype]) for _ in range(2))
        kw = {}
    q = rng.standard_normal((4, seqlen_q, 4, 64)).astype(NP_DTYPES[dtype])
    ref, ref_lse = reference_kvcache(q, k, v, seqlens_k=seqlens, cache_leftpad=leftpad, block_table=table if paged else None)
    out = cupy.full(q.shape, np.nan, dtype=q.dtype)
    res, lse = cupy_gqa.attention(*(cupy.asarray(x) for x in (q, k, v)), seqlens_k=cupy.asarray(seqlens),
                                  cache_leftpad=cupy.asarray(leftpad), out=out, return_lse=True, kernel=kernel, **kw)  # fmt: skip
    assert_close(cupy.asnumpy(res), ref, TOLERANCE[dtype], f"leftpad {kernel}")
    assert_lse_close(cupy.asnumpy(lse), ref_lse, 1e-5)


def test_bad_device_lengths_give_nan_rows():
    """A device cache_leftpad past its sequence's end (not checked on the host)
    gives NaN rows of that sequence, and the others stay right."""
    rng = np.random.default_rng(4)
    q = rng.standard_normal((2, 1, 4, 64)).astype(np.float16)
    k, v = (rng.standard_normal((2, 64, 1, 64)).astype(np.float16) for _ in range(2))
    res = cupy_gqa.attention(*(cupy.asarray(x) for x in (q, k, v)), seqlens_k=cupy.asarray(np.int32([64, 10])),
                             cache_leftpad=cupy.asarray(np.int32([3, 11])))  # fmt: skip
    res = cupy.asnumpy(res)
    assert np.isnan(res[1]).all()
    ref, _ = reference_kvcache(q[:1], k[:1], v[:1], seqlens_k=[64], cache_leftpad=[3])
    assert_close(res[:1], ref, TOLERANCE["float16"])


# --- CUDA graphs: captured once, replayed after the lengths change ---------------------


def _capture(call):
    """Capture ``call`` on a non-blocking stream, which does not wait for the
    legacy default stream: the caller's writes are finished first, and a
    test's later writes go on the returned stream (``with stream:``)."""
    cupy.cuda.Device().synchronize()
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        call()  # compiles and plans outside the capture
        stream.synchronize()
        stream.begin_capture()
        try:
            call()
        finally:
            graph = stream.end_capture()
    return stream, graph


@pytest.mark.parametrize("kernel", KERNELS)
def test_graph_varlen(kernel):
    dtype = "bfloat16"
    _skip_unsupported(kernel, dtype, 16)
    rng = np.random.default_rng(5)
    max_q, max_k, total_q, total_k = 16, 900, 40, 1800
    q = cupy.asarray(rng.standard_normal((total_q, 8, 128)).astype(NP_DTYPES[dtype]))
    k = cupy.asarray(rng.standard_normal((total_k, 2, 128)).astype(NP_DTYPES[dtype]))
    v = cupy.asarray(rng.standard_normal((total_k, 2, 128)).astype(NP_DTYPES[dtype]))
    cu_q, cu_k = cupy.zeros(4, cupy.int32), cupy.zeros(4, cupy.int32)
    out = cupy.empty_like(q)
    steps = [([16, 8, 16], [900, 1, 899]), ([1, 16, 7], [0, 300, 17]), ([13, 13, 14], [600, 600, 600])]
    cu_q[...] = cupy.asarray(np.concatenate([[0], np.cumsum(steps[0][0])]), dtype=cupy.int32)
    cu_k[...] = cupy.asarray(np.concatenate([[0], np.cumsum(steps[0][1])]), dtype=cupy.int32)
    ws = cupy_gqa.workspace(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max_q, max_seqlen_k=max_k,
                                   kernel=kernel)  # fmt: skip

    stream, graph = _capture(lambda: cupy_gqa.attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, out=out, kernel=kernel,
                                                               workspace=ws))  # fmt: skip
    for lens_q, lens_k in steps[1:]:
        with stream:
            cu_q[...] = cupy.asarray(np.concatenate([[0], np.cumsum(lens_q)]), dtype=cupy.int32)
            cu_k[...] = cupy.asarray(np.concatenate([[0], np.cumsum(lens_k)]), dtype=cupy.int32)
            out.fill(np.nan)
        graph.launch(stream)
        stream.synchronize()
        hq, hk, hv, hcq, hck = (cupy.asnumpy(a) for a in (q, k, v, cu_q, cu_k))
        ref, _ = reference_varlen(hq, hk, hv, hcq, hck)
        rows = int(hcq[-1])
        assert_close(cupy.asnumpy(out)[:rows], ref[:rows], TOLERANCE[dtype], f"graph varlen {kernel} {lens_q}")


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("page_size", [16, 256])
@pytest.mark.parametrize("leftpad", [False, True])
def test_graph_paged(kernel, page_size, leftpad):
    dtype = "float16"
    _skip_unsupported(kernel, dtype, 4, paged=True)
    rng = np.random.default_rng(page_size + leftpad)
    max_pages = 4096 // page_size
    k, v, table = _pool(3, page_size, max_pages, 2, 128, dtype, rng)
    q = cupy.asarray(rng.standard_normal((3, 4, 8, 128)).astype(NP_DTYPES[dtype]))
    k, v, table_d = cupy.asarray(k), cupy.asarray(v), cupy.asarray(table)
    seqlens = cupy.asarray(np.int32([4096, 1, 2000]))
    pads = cupy.asarray(np.int32([0, 0, 0]))
    out = cupy.empty_like(q)
    kw = {"block_table": table_d, "seqlens_k": seqlens, "kernel": kernel, "out": out}
    if leftpad:
        kw["cache_leftpad"] = pads
    kw["workspace"] = cupy_gqa.workspace(q, k, v, **kw)

    stream, graph = _capture(lambda: cupy_gqa.attention(q, k, v, **kw))
    for lens, pad, perm in (([17, 4096, 300], [3, 4000, 0], False), ([2048, 0, 4095], [2047, 0, 1], True)):
        with stream:
            seqlens[...] = cupy.asarray(np.int32(lens))
            pads[...] = cupy.asarray(np.int32(pad))
            if perm:  # the pages move: the same table slots point elsewhere
                table_d[...] = table_d[:, ::-1].copy()
            out.fill(np.nan)
        graph.launch(stream)
        stream.synchronize()
        ref, _ = reference_kvcache(cupy.asnumpy(q), cupy.asnumpy(k), cupy.asnumpy(v), seqlens_k=lens,
                                   block_table=cupy.asnumpy(table_d), cache_leftpad=pad if leftpad else None)  # fmt: skip
        assert_close(cupy.asnumpy(out), ref, TOLERANCE[dtype], f"graph paged {kernel} page {page_size}")


# --- modifiers on per-sequence calls -----------------------------------------------------


def _seq_mods(name, batch, hq):
    from test_seq import seq_mods

    return seq_mods(name, batch, hq)


SEQ_MODS = ["window", "window_both_noncausal", "softcap", "sinks", "alibi_batch", "score_mod", "score_mod_unit",
            "score_mod_unit_softcap", "mask_mod", "all",
            "all_noncausal"]


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("name", SEQ_MODS)
@pytest.mark.parametrize("lens_q,lens_k", [
    ([1, 1, 3, 1], [1, 300, 0, 129]),        # decode: one key, many, none
    ([40, 1, 17, 70], [40, 300, 17, 130]),   # prefill, lengths not multiples of a tile
])  # fmt: skip
def test_varlen_modifiers(kernel, dtype, name, lens_q, lens_k):
    """Every modifier on packed sequences, each by its own rules (diagonal, b for
    ALiBi's rows and the user modifiers), against the float64 reference."""
    _skip_unsupported(kernel, dtype, max(lens_q))
    rng = np.random.default_rng(sum(lens_q) + sum(lens_k))
    q, cu_q = _packed(lens_q, 8, 64, dtype, rng)
    k, cu_k = _packed(lens_k, 2, 64, dtype, rng)
    v, _ = _packed(lens_k, 2, 64, dtype, rng)
    kw, causal = _seq_mods(name, len(lens_q), 8)
    ref, ref_lse = reference_varlen(q, k, v, cu_q, cu_k, causal=causal, **kw)
    out = cupy.full(q.shape, np.nan, dtype=q.dtype)
    res, lse = cupy_gqa.attention_varlen(*(cupy.asarray(x) for x in (q, k, v)), cupy.asarray(cu_q), cupy.asarray(cu_k),
                                         max(lens_q), max(lens_k), out=out, return_lse=True, kernel=kernel,
                                         causal=causal, **kw)  # fmt: skip
    assert res is out
    assert_close(cupy.asnumpy(res), ref, _tolerance(kernel, dtype), f"varlen {name} {kernel} {dtype}")
    assert_lse_close(cupy.asnumpy(lse), ref_lse, 1e-5)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("name", SEQ_MODS)
@pytest.mark.parametrize("addressing", ["paged", "paged_leftpad", "leftpad"])
@pytest.mark.parametrize("seqlen_q", [1, 24])
def test_kvcache_modifiers(kernel, name, addressing, seqlen_q):
    """Every modifier on a paged cache (shuffled pages), a left-padded one and both,
    decode and chunked prefill, against the float64 reference."""
    dtype = "bfloat16"
    paged = addressing.startswith("paged")
    _skip_unsupported(kernel, dtype, seqlen_q, paged=paged)
    rng = np.random.default_rng(seqlen_q + len(addressing))
    seqlens = np.array([0, 1, 32, 90, 200], dtype=np.int32)
    pad = np.array([0, 1, 5, 0, 150], dtype=np.int32) if addressing.endswith("leftpad") else None
    if paged:
        k, v, table = _pool(len(seqlens), 32, 7, 2, 64, dtype, rng)
        index = {"block_table": cupy.asarray(table)}
    else:
        k, v = (rng.standard_normal((len(seqlens), 224, 2, 64)).astype(NP_DTYPES[dtype]) for _ in range(2))
        table, index = None, {}
    if pad is not None:
        index["cache_leftpad"] = cupy.asarray(pad)
    q = rng.standard_normal((len(seqlens), seqlen_q, 8, 64)).astype(NP_DTYPES[dtype])
    kw, causal = _seq_mods(name, len(seqlens), 8)
    ref, ref_lse = reference_kvcache(q, k, v, seqlens_k=seqlens, block_table=table, cache_leftpad=pad, causal=causal, **kw)
    out = cupy.full(q.shape, np.nan, dtype=q.dtype)
    res, lse = cupy_gqa.attention(*(cupy.asarray(x) for x in (q, k, v)), seqlens_k=cupy.asarray(seqlens), out=out,
                                  return_lse=True, kernel=kernel, causal=causal, **index, **kw)  # fmt: skip
    assert_close(cupy.asnumpy(res), ref, TOLERANCE[dtype], f"{addressing} {name} {kernel}")
    assert_lse_close(cupy.asnumpy(lse), ref_lse, 1e-5)


@pytest.mark.parametrize("kernel", KERNELS)
def test_graph_varlen_modifiers(kernel):
    """A varlen call with a window and a softcap captured into a CUDA graph,
    replayed after the offsets change in place; then its repeat calls with another
    window take an entry of their own."""
    dtype = "float16"
    _skip_unsupported(kernel, dtype, 8)
    rng = np.random.default_rng(8)
    max_q, max_k, total_q, total_k = 8, 700, 24, 1400
    q = cupy.asarray(rng.standard_normal((total_q, 8, 128)).astype(NP_DTYPES[dtype]))
    k, v = (cupy.asarray(rng.standard_normal((total_k, 2, 128)).astype(NP_DTYPES[dtype])) for _ in range(2))
    cu_q, cu_k = cupy.asarray(np.int32([0, 8, 9, 17])), cupy.asarray(np.int32([0, 700, 701, 1400]))
    out = cupy.empty_like(q)
    mods = {"window": (100, 0), "softcap": 5.0}
    args = (q, k, v, cu_q, cu_k, max_q, max_k)
    kw = {"kernel": kernel, "out": out, **mods}
    kw["workspace"] = cupy_gqa.workspace(*args[:3], **{n: a for n, a in zip(api._VARLEN_ARGS, args[3:])}, **kw)
    stream, graph = _capture(lambda: cupy_gqa.attention_varlen(*args, **kw))
    for offsets_q, offsets_k in (([0, 3, 11, 12], [0, 300, 1000, 1001]), ([0, 8, 16, 24], [0, 1, 100, 800])):
        with stream:
            cu_q[...] = cupy.asarray(np.int32(offsets_q))
            cu_k[...] = cupy.asarray(np.int32(offsets_k))
            out.fill(np.nan)
        graph.launch(stream)
        stream.synchronize()
        ref, _ = reference_varlen(cupy.asnumpy(q), cupy.asnumpy(k), cupy.asnumpy(v), offsets_q, offsets_k, **mods)
        rows = offsets_q[-1]  # rows past the last sequence are nobody's
        assert_close(cupy.asnumpy(out)[:rows], ref[:rows], TOLERANCE[dtype], f"graph varlen modifiers {kernel}")
    for window in ((100, 0), (3, 0), (100, 0)):  # repeat calls: each window its own entry
        out.fill(np.nan)
        cupy_gqa.attention_varlen(*args, **{**kw, "window": window, "workspace": None})
        ref, _ = reference_varlen(cupy.asnumpy(q), cupy.asnumpy(k), cupy.asnumpy(v), cupy.asnumpy(cu_q),
                                  cupy.asnumpy(cu_k), window=window, softcap=5.0)  # fmt: skip
        assert_close(cupy.asnumpy(out), ref, TOLERANCE[dtype], f"repeat varlen window {window} {kernel}")


# --- repeat calls: the signature's entry with each call's index arrays -------------------


def _full_path_refused(*args, **kwargs):
    pytest.fail("a repeat call of a kept signature took the full path, not its entry")


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("framework", ["cupy", "torch"])
def test_repeat_paged_calls_on_new_index_arrays(kernel, framework, monkeypatch):
    """Calls of one signature with other tables, lengths and left padding (the
    repeat-call entry patches their addresses into the launch; the full path is
    refused for the second call), then the first call's arrays again (its plan
    launched by the full path after the entry wrote other addresses): every
    result against the float64 reference."""
    dtype = "float16"  # NumPy has it, so torch takes the arrays as they are
    _skip_unsupported(kernel, dtype, 4, paged=True)
    if framework == "torch":
        torch = pytest.importorskip("torch")
    rng = np.random.default_rng(31)
    page, max_pages = 32, 8
    k, v, _ = _pool(3, page, max_pages, 2, 64, dtype, rng, spare=7)
    q = rng.standard_normal((3, 4, 8, 64)).astype(NP_DTYPES[dtype])
    steps = []
    for lens, pads in (([256, 1, 100], [0, 0, 99]), ([17, 256, 40], [16, 3, 0]), ([256, 1, 100], [0, 0, 99])):
        table = rng.permutation(len(k))[: 3 * max_pages].reshape(3, max_pages).astype(np.int32)
        steps.append((table, np.int32(lens), np.int32(pads)))
    steps[2] = steps[0]  # the first call's arrays again
    to = (lambda a: torch.as_tensor(a).cuda()) if framework == "torch" else cupy.asarray  # noqa: E731
    qd, kd, vd = (to(a) for a in (q, k, v))
    arrays = [tuple(to(a) for a in step) for step in steps[:2]]
    arrays.append(arrays[0])
    for i, ((table, lens, pads), (table_d, lens_d, pads_d)) in enumerate(zip(steps, arrays)):
        if i == 2:
            _fast.clear()  # the full path, whose cached plan's buffer holds call 1's addresses
        with monkeypatch.context() as m:
            if i == 1:
                m.setattr(api, "_attention_seq", _full_path_refused)
            res = cupy_gqa.attention(qd, kd, vd, block_table=table_d, seqlens_k=lens_d, cache_leftpad=pads_d, kernel=kernel)
        got = res.float().cpu().numpy() if framework == "torch" else cupy.asnumpy(res)
        ref, _ = reference_kvcache(q, k, v, seqlens_k=lens, block_table=table, cache_leftpad=pads)
        assert_close(got, ref, TOLERANCE[dtype], f"repeat paged {kernel} {framework} lens {list(lens)}")


@pytest.mark.parametrize("kernel", KERNELS)
def test_repeat_varlen_calls_on_new_offsets(kernel, monkeypatch):
    dtype = "bfloat16"
    _skip_unsupported(kernel, dtype, 16)
    rng = np.random.default_rng(32)
    q = cupy.asarray(rng.standard_normal((40, 8, 128)).astype(NP_DTYPES[dtype]))
    k = cupy.asarray(rng.standard_normal((1800, 2, 128)).astype(NP_DTYPES[dtype]))
    v = cupy.asarray(rng.standard_normal((1800, 2, 128)).astype(NP_DTYPES[dtype]))
    steps = [([16, 8, 16], [900, 1, 899]), ([1, 16, 7], [0, 300, 17]), ([16, 8, 16], [900, 1, 899])]
    offsets = [tuple(cupy.asarray(np.concatenate([[0], np.cumsum(x)]).astype(np.int32)) for x in step) for step in steps[:2]]
    offsets.append(offsets[0])
    for i, (cu_q, cu_k) in enumerate(offsets):
        if i == 2:
            _fast.clear()  # the full path, whose cached plan's buffer holds call 1's addresses
        out = cupy.full(q.shape, np.nan, dtype=q.dtype)
        with monkeypatch.context() as m:
            if i == 1:
                m.setattr(api, "_attention_seq", _full_path_refused)
            cupy_gqa.attention_varlen(q, k, v, cu_q, cu_k, 16, 900, out=out, kernel=kernel)
        hq, hk, hv, hcq, hck = (cupy.asnumpy(a) for a in (q, k, v, cu_q, cu_k))
        rows = int(hcq[-1])
        ref, _ = reference_varlen(hq, hk, hv, hcq, hck)
        assert_close(cupy.asnumpy(out)[:rows], ref[:rows], TOLERANCE[dtype], f"repeat varlen {kernel} {list(np.diff(hcq))}")
