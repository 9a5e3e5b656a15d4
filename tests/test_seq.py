"""Variable-length batches, paged KV caches and left padding on the CPU: the
NumPy backend against the float64 references built sequence by sequence
(tests/reference.py), the references themselves, and every bad input."""
import numpy as np
import pytest

import cupy_gqa
from conftest import NP_DTYPES, TOLERANCE, assert_close, assert_lse_close
from reference import reference_attention, reference_kvcache, reference_varlen


def packed(lens, heads, head_dim, dtype, rng):
    """Random (sum(lens), heads, head_dim) rows and the (len(lens) + 1,) int32 offsets."""
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    return rng.standard_normal((int(cu[-1]), heads, head_dim)).astype(NP_DTYPES[dtype]), cu


def paged_cache(seqlens, page_size, max_pages, num_kv_heads, head_dim, dtype, rng, spare=3):
    """A pool of shuffled pages holding each sequence's keys, its block_table
    (unused slots point at random pages), and the pool."""
    num_pages = len(seqlens) * max_pages + spare
    shape = (num_pages, page_size, num_kv_heads, head_dim)
    k = rng.standard_normal(shape).astype(NP_DTYPES[dtype])
    v = rng.standard_normal(shape).astype(NP_DTYPES[dtype])
    table = rng.permutation(num_pages)[: len(seqlens) * max_pages].reshape(len(seqlens), max_pages).astype(np.int32)
    return k, v, table


# --- the references -----------------------------------------------------------


def test_reference_varlen_is_the_batch_of_its_sequences():
    """Literal: equal lengths give the padded batch's reference; a sequence of one
    key returns its V row; a sequence without keys gives zeros and -inf."""
    rng = np.random.default_rng(0)
    q = rng.standard_normal((2, 5, 4, 8))
    k = rng.standard_normal((2, 7, 2, 8))
    v = rng.standard_normal((2, 7, 2, 8))
    out, lse = reference_varlen(q.reshape(10, 4, 8), k.reshape(14, 2, 8), v.reshape(14, 2, 8), [0, 5, 10], [0, 7, 14])
    ref, ref_lse = reference_attention(q, k, v)
    assert np.allclose(out, ref.reshape(10, 4, 8)) and np.allclose(lse, ref_lse.transpose(1, 0, 2).reshape(4, 10))
    out, lse = reference_varlen(q[0, :1], k[0, :1], v[0, :1], [0, 1, 1], [0, 1, 1])
    assert np.allclose(out[0], np.repeat(v[0, 0], 2, axis=0))
    out, lse = reference_varlen(q[0, :2], k[0, :1], v[0, :1], [0, 1, 2], [0, 1, 1])
    assert not out[1].any() and np.isneginf(lse[:, 1]).all()


def test_reference_kvcache_reads_pages_and_padding():
    """A contiguous cache cut to [leftpad, len) equals the reference over that
    slice; the same keys scattered over shuffled pages give the same result."""
    rng = np.random.default_rng(1)
    q = rng.standard_normal((2, 3, 4, 8))
    k = rng.standard_normal((2, 32, 2, 8))
    v = rng.standard_normal((2, 32, 2, 8))
    out, lse = reference_kvcache(q, k, v, seqlens_k=[20, 32], cache_leftpad=[4, 0])
    ref, ref_lse = reference_attention(q[:1], k[:1, 4:20], v[:1, 4:20])
    assert np.allclose(out[:1], ref) and np.allclose(lse[:1], ref_lse)
    pool_k, pool_v = np.zeros((5, 16, 2, 8)), np.zeros((5, 16, 2, 8))
    table = np.array([[3, 0], [4, 1]])
    for b in range(2):
        for i in range(2):
            pool_k[table[b, i]], pool_v[table[b, i]] = k[b, 16 * i : 16 * i + 16], v[b, 16 * i : 16 * i + 16]
    paged, paged_lse = reference_kvcache(q, pool_k, pool_v, seqlens_k=[20, 32], block_table=table, cache_leftpad=[4, 0])
    assert np.allclose(paged, out) and np.allclose(paged_lse, lse)


# --- the NumPy backend --------------------------------------------------------


# (modifier case of test_modifiers.modifier_kwargs -> window) for the per-sequence calls, whose
# sequences here are a few to a few hundred keys long
SEQ_WINDOWS = {"window": (9, 0), "window_both_noncausal": (5, 3), "all": (11, 0), "all_noncausal": (6, 4)}
SEQ_MODS = ["window", "window_both_noncausal", "softcap", "sinks", "alibi_batch", "score_mod", "score_mod_unit",
            "score_mod_unit_softcap", "mask_mod", "all",
            "all_noncausal"]


def seq_mods(name, batch, hq):
    """The modifiers of case ``name`` (and causal) for a per-sequence call of ``batch`` sequences."""
    from test_modifiers import modifier_kwargs

    kw = modifier_kwargs(name, batch, hq, SEQ_WINDOWS)
    return kw, kw.pop("causal", True)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float64"])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("lens_q,lens_k", [
    ([5, 0, 1, 33, 70], [9, 4, 0, 33, 200]),  # an empty query run, a sequence without keys, seqlen_q > seqlen_k
    ([1, 1, 1], [1, 300, 17]),                # decode
    ([65, 64, 2], [65, 64, 130]),             # prefill, not multiples of a tile
])  # fmt: skip
def test_cpu_varlen(dtype, causal, lens_q, lens_k):
    rng = np.random.default_rng(len(lens_q) + sum(lens_k))
    q, cu_q = packed(lens_q, 6, 16, dtype, rng)
    k, cu_k = packed(lens_k, 2, 16, dtype, rng)
    v, _ = packed(lens_k, 2, 16, dtype, rng)
    out = np.full(q.shape, np.nan, dtype=q.dtype)
    res, lse = cupy_gqa.attention_varlen(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=causal, return_lse=True, out=out)
    assert res is out and lse.shape == (6, q.shape[0]) and lse.dtype == np.float32
    ref, ref_lse = reference_varlen(q, k, v, cu_q, cu_k, causal=causal)
    assert_close(res, ref, TOLERANCE[dtype], f"varlen {dtype}")
    assert_lse_close(lse, ref_lse, 1e-5)


@pytest.mark.parametrize("name", SEQ_MODS)
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_cpu_varlen_modifiers(name, dtype):
    """Every modifier on packed sequences, each sequence by its own rules (its own
    diagonal, its index as b for ALiBi's slopes and the user modifiers), against the
    float64 reference built sequence by sequence; a sequence without keys gives
    zeros and lse -inf, or the sink's."""
    rng = np.random.default_rng(3)
    lens_q, lens_k = [5, 0, 1, 33, 20], [9, 4, 0, 33, 70]
    q, cu_q = packed(lens_q, 8, 16, dtype, rng)
    k, cu_k = packed(lens_k, 2, 16, dtype, rng)
    v, _ = packed(lens_k, 2, 16, dtype, rng)
    kw, causal = seq_mods(name, len(lens_q), 8)
    out = np.full(q.shape, np.nan, dtype=q.dtype)
    res, lse = cupy_gqa.attention_varlen(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=causal, return_lse=True,
                                         out=out, **kw)  # fmt: skip
    ref, ref_lse = reference_varlen(q, k, v, cu_q, cu_k, causal=causal, **kw)
    assert_close(res, ref, TOLERANCE[dtype], f"varlen {name} {dtype}")
    assert_lse_close(lse, ref_lse, 1e-5)


@pytest.mark.parametrize("name", SEQ_MODS)
@pytest.mark.parametrize("leftpad", [False, True])
def test_cpu_paged_modifiers(name, leftpad):
    """Every modifier on a paged cache (with and without left padding), chunked
    prefill of 3 queries, against the float64 reference sequence by sequence."""
    rng = np.random.default_rng(4)
    seqlens = np.array([0, 1, 16, 40, 45])
    k, v, table = paged_cache(seqlens, 16, 3, 2, 16, "float32", rng)
    q = rng.standard_normal((len(seqlens), 3, 8, 16)).astype(np.float32)
    pad = np.array([0, 1, 5, 0, 30]) if leftpad else None
    kw, causal = seq_mods(name, len(seqlens), 8)
    out = np.full(q.shape, np.nan, dtype=q.dtype)
    res, lse = cupy_gqa.attention(q, k, v, block_table=table, seqlens_k=seqlens, cache_leftpad=pad, causal=causal,
                                  return_lse=True, out=out, **kw)  # fmt: skip
    ref, ref_lse = reference_kvcache(q, k, v, seqlens_k=seqlens, block_table=table, cache_leftpad=pad, causal=causal, **kw)
    assert_close(res, ref, TOLERANCE["float32"], f"paged {name}")
    assert_lse_close(lse, ref_lse, 1e-5)


def test_reference_per_sequence_modifiers_are_the_contiguous_ones():
    """The per-sequence references with modifiers: equal lengths give the contiguous
    reference of the padded batch (ALiBi's rows and a score_mod's b by sequence)."""
    from test_modifiers import modifier_kwargs

    rng = np.random.default_rng(5)
    q = rng.standard_normal((2, 6, 4, 8))
    k = rng.standard_normal((2, 9, 2, 8))
    v = rng.standard_normal((2, 9, 2, 8))
    kw = modifier_kwargs("all", 2, 4, {"all": (3, 0)})
    kw["alibi_slopes"] = np.stack([kw["alibi_slopes"], 2 * kw["alibi_slopes"]])
    ref, ref_lse = reference_attention(q, k, v, **kw)
    out, lse = reference_varlen(q.reshape(12, 4, 8), k.reshape(18, 2, 8), v.reshape(18, 2, 8), [0, 6, 12], [0, 9, 18], **kw)
    assert np.allclose(out, ref.reshape(12, 4, 8)) and np.allclose(lse, ref_lse.transpose(1, 0, 2).reshape(4, 12))
    cache, cache_lse = reference_kvcache(q, k, v, **kw)
    assert np.allclose(cache, ref) and np.allclose(cache_lse, ref_lse)


@pytest.mark.parametrize("dtype", ["float32", "float16", "float64"])
@pytest.mark.parametrize("page_size", [16, 32, 256])
@pytest.mark.parametrize("seqlen_q", [1, 5])
def test_cpu_paged(dtype, page_size, seqlen_q):
    """Decode and chunked prefill against shuffled pages: lengths 0, 1, a whole
    page, one past it and the most the table holds."""
    rng = np.random.default_rng(page_size + seqlen_q)
    max_pages = 3
    seqlens = np.array([0, 1, page_size, page_size + 1, max_pages * page_size - 3, max_pages * page_size])
    k, v, table = paged_cache(seqlens, page_size, max_pages, 2, 16, dtype, rng)
    q = rng.standard_normal((len(seqlens), seqlen_q, 4, 16)).astype(NP_DTYPES[dtype])
    out = np.full(q.shape, np.nan, dtype=q.dtype)
    res, lse = cupy_gqa.attention(q, k, v, block_table=table, seqlens_k=seqlens, return_lse=True, out=out)
    ref, ref_lse = reference_kvcache(q, k, v, seqlens_k=seqlens, block_table=table)
    assert_close(res, ref, TOLERANCE[dtype], f"paged {dtype} page {page_size}")
    assert_lse_close(lse, ref_lse, 1e-5)


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("causal", [True, False])
def test_cpu_leftpad(paged, causal):
    """cache_leftpad with and without pages, and the left-padded prefill batch:
    a row's keys start at its padding, its causal diagonal stays at the end."""
    rng = np.random.default_rng(7)
    seqlens = np.array([40, 48, 17, 48])
    leftpad = np.array([0, 13, 17, 47])  # none, some, all (no key), all but one
    if paged:
        k, v, table = paged_cache(seqlens, 16, 3, 2, 32, "float32", rng)
        kw = {"block_table": table}
    else:
        k, v = (rng.standard_normal((4, 48, 2, 32)).astype(np.float32) for _ in range(2))
        kw = {}
    q = rng.standard_normal((4, 6, 8, 32)).astype(np.float32)
    out = np.full(q.shape, np.nan, dtype=q.dtype)
    res, lse = cupy_gqa.attention(q, k, v, seqlens_k=seqlens, cache_leftpad=leftpad, causal=causal, return_lse=True,
                                  out=out, **kw)  # fmt: skip
    ref, ref_lse = reference_kvcache(q, k, v, seqlens_k=seqlens, cache_leftpad=leftpad, causal=causal,
                                     block_table=kw.get("block_table"))  # fmt: skip
    assert_close(res, ref, TOLERANCE["float32"])
    assert_lse_close(lse, ref_lse)


def test_cpu_left_padded_prefill_batch():
    """transformers' batched prefill: q, k, v of one length, each row padded on
    the left; the valid rows equal each sequence run alone."""
    rng = np.random.default_rng(3)
    q = rng.standard_normal((3, 20, 4, 16)).astype(np.float32)
    k, v = (rng.standard_normal((3, 20, 2, 16)).astype(np.float32) for _ in range(2))
    pad = [0, 7, 19]
    out = cupy_gqa.attention(q, k, v, cache_leftpad=pad)
    for b, p in enumerate(pad):
        alone, _ = reference_attention(q[b : b + 1, p:], k[b : b + 1, p:], v[b : b + 1, p:])
        assert_close(out[b : b + 1, p:], alone, TOLERANCE["float32"], f"row {b}")
        assert not out[b, :p].any()  # padding queries see no key


def test_cpu_paged_bhsd_and_torch():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(5)
    k, v, table = paged_cache([20, 35], 16, 3, 2, 16, "float32", rng)
    q = rng.standard_normal((2, 3, 4, 16)).astype(np.float32)
    ref, _ = reference_kvcache(q, k, v, seqlens_k=[20, 35], block_table=table)
    out = cupy_gqa.attention(*(torch.from_numpy(x) for x in (q, k, v)), block_table=torch.from_numpy(table),
                             seqlens_k=torch.tensor([20, 35]))  # fmt: skip
    assert isinstance(out, torch.Tensor)
    assert_close(out.numpy(), ref, TOLERANCE["float32"])
    bhsd = cupy_gqa.attention(q.transpose(0, 2, 1, 3), k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3),
                              block_table=table, seqlens_k=[20, 35], layout="bhsd")  # fmt: skip
    assert_close(bhsd.transpose(0, 2, 1, 3), ref, TOLERANCE["float32"])


def test_cpu_varlen_torch_and_empty():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(6)
    q, cu_q = packed([3, 4], 2, 8, "float32", rng)
    k, cu_k = packed([5, 6], 1, 8, "float32", rng)
    v, _ = packed([5, 6], 1, 8, "float32", rng)
    out = cupy_gqa.attention_varlen(*(torch.from_numpy(x) for x in (q, k, v)), torch.from_numpy(cu_q),
                                    torch.from_numpy(cu_k), 4, 6)  # fmt: skip
    assert_close(out.numpy(), reference_varlen(q, k, v, cu_q, cu_k)[0], TOLERANCE["float32"])
    none, lse = cupy_gqa.attention_varlen(q[:0], k[:0], v[:0], [0], [0], 0, 0, return_lse=True)
    assert none.shape == (0, 2, 8) and lse.shape == (2, 0)
    zeros, lse = cupy_gqa.attention_varlen(q, k[:0], v[:0], cu_q, [0, 0, 0], 4, 0, return_lse=True)
    assert not zeros.any() and np.isneginf(lse).all()


def test_inputs_untouched():
    rng = np.random.default_rng(8)
    q, cu_q = packed([3, 4], 2, 8, "float32", rng)
    k, cu_k = packed([5, 6], 1, 8, "float32", rng)
    v, _ = packed([5, 6], 1, 8, "float32", rng)
    copies = [x.copy() for x in (q, k, v, cu_q, cu_k)]
    cupy_gqa.attention_varlen(q, k, v, cu_q, cu_k, 4, 6)
    assert all(np.array_equal(a, b) for a, b in zip((q, k, v, cu_q, cu_k), copies))


# --- bad input: one test each ---------------------------------------------------


def _varlen_args():
    rng = np.random.default_rng(9)
    q, cu_q = packed([3, 4], 4, 8, "float32", rng)
    k, cu_k = packed([5, 6], 2, 8, "float32", rng)
    v, _ = packed([5, 6], 2, 8, "float32", rng)
    return q, k, v, cu_q, cu_k


@pytest.mark.parametrize("change,exc,message", [
    ({"cu_seqlens_q": np.array([0, 3, 7], dtype=np.float32)}, TypeError, "cu_seqlens_q: expected an integer dtype, got float32"),
    ({"cu_seqlens_q": "0,3,7"}, TypeError, "cu_seqlens_q: expected a list, tuple"),
    ({"cu_seqlens_k": [0, 5]}, ValueError, "cu_seqlens_k: expected shape (3,) (batch + 1, that of cu_seqlens_q), got (2,)"),
    ({"cu_seqlens_q": [[0, 3, 7]]}, ValueError, "cu_seqlens_q: expected shape (batch + 1,) with batch >= 0, got (1, 3)"),
    ({"cu_seqlens_q": [0, 4, 3]}, ValueError, "cu_seqlens_q: expected non-decreasing offsets, got 3 after 4 at index 2"),
    ({"cu_seqlens_k": [-1, 5, 11]}, ValueError, "cu_seqlens_k: expected values >= 0, got -1 at index 0"),
    ({"cu_seqlens_k": [0, 5, 12]}, ValueError, "cu_seqlens_k: expected a last offset <= 11 (total_k), got 12"),
    ({"max_seqlen_q": 3}, ValueError, "cu_seqlens_q: expected sequence lengths <= max_seqlen_q=3, got 4 for sequence 1"),
    ({"max_seqlen_k": 2.0}, TypeError, "max_seqlen_k: expected a host integer >= 0, got float 2.0"),
    ({"max_seqlen_k": -1}, ValueError, "max_seqlen_k: expected a host integer >= 0, got -1"),
    ({"q": np.zeros((7, 4, 8, 1), np.float32)}, ValueError, "q: expected 3 dimensions (total_q, num_q_heads, head_dim), got shape (7, 4, 8, 1)"),
    ({"k": np.zeros((11, 3, 8), np.float32), "v": np.zeros((11, 3, 8), np.float32)}, ValueError, "k: expected num_kv_heads >= 1 dividing num_q_heads=4, got num_kv_heads=3"),
    ({"v": np.zeros((11, 2, 8), np.float16)}, TypeError, "v: expected dtype float32 (that of q), got float16"),
    ({"kernel": "decode"}, ValueError, "kernel: 'decode' runs on CUDA arrays"),
])  # fmt: skip
def test_bad_varlen(change, exc, message):
    q, k, v, cu_q, cu_k = _varlen_args()
    args = {"q": q, "k": k, "v": v, "cu_seqlens_q": cu_q, "cu_seqlens_k": cu_k, "max_seqlen_q": 4, "max_seqlen_k": 6}
    kwargs = {}
    for name, value in change.items():
        (args if name in args else kwargs)[name] = value
    with pytest.raises(exc) as info:
        cupy_gqa.attention_varlen(*args.values(), **kwargs)
    assert str(info.value).startswith(message), str(info.value)


def _paged_args():
    rng = np.random.default_rng(10)
    k, v, table = paged_cache([20, 35], 16, 3, 2, 8, "float32", rng)
    q = rng.standard_normal((2, 2, 4, 8)).astype(np.float32)
    return {"q": q, "k": k, "v": v}, {"block_table": table, "seqlens_k": [20, 35]}


@pytest.mark.parametrize("change,exc,message", [
    ({"k": np.zeros((9, 24, 2, 8), np.float32), "v": np.zeros((9, 24, 2, 8), np.float32)}, ValueError,
     "k: expected a page_size (axis 1 of (num_pages, page_size, num_kv_heads, head_dim)) that is a positive multiple of 16, got 24"),
    ({"block_table": np.zeros((3, 3), np.int32)}, ValueError, "block_table: expected shape (2, 3) (batch, max_pages_per_seq), got (3, 3)"),
    ({"block_table": np.zeros(6, np.int32)}, ValueError, "block_table: expected shape (batch, max_pages_per_seq) with batch=2, got (6,)"),
    ({"block_table": np.zeros((2, 3), np.float64)}, TypeError, "block_table: expected an integer dtype, got float64"),
    ({"block_table": np.full((2, 3), 9, np.int32)}, ValueError, "block_table: expected page indices in [0, 9) (num_pages), got 9 at [0, 0]"),
    ({"seqlens_k": None}, ValueError, "seqlens_k: expected each sequence's number of keys with block_table, got None"),
    ({"seqlens_k": [20, 49]}, ValueError, "seqlens_k: expected values in [0, 48] (0 to seqlen_k), got 49 at batch 1"),
    ({"cache_leftpad": [21, 0]}, ValueError, "cache_leftpad: expected values in [0, seqlens_k[b]] (0 to the sequence's end, 20), got 21 at batch 0"),
    ({"cache_leftpad": [0]}, ValueError, "cache_leftpad: expected shape (2,) (the batch of q), got (1,)"),
    ({"alibi_slopes": np.ones((3, 4), np.float32)}, ValueError,
     "alibi_slopes: expected shape (4,) or (2, 4) (num_q_heads,) or (batch, num_q_heads), got (3, 4)"),
    ({"k": np.zeros((9, 16, 3, 8), np.float32), "v": np.zeros((9, 16, 3, 8), np.float32)}, ValueError,
     "k: expected num_kv_heads >= 1 dividing num_q_heads=4, got num_kv_heads=3"),
])  # fmt: skip
def test_bad_paged(change, exc, message):
    arrays, kwargs = _paged_args()
    for name, value in change.items():
        (arrays if name in arrays else kwargs)[name] = value
    with pytest.raises(exc) as info:
        cupy_gqa.attention(*arrays.values(), **kwargs)
    assert str(info.value).startswith(message), str(info.value)


def test_bad_seq_with_grad():
    torch = pytest.importorskip("torch")
    q, k, v, cu_q, cu_k = _varlen_args()
    tq = torch.from_numpy(q).requires_grad_()
    with pytest.raises(ValueError, match="q: expected tensors that don't require grad"):
        cupy_gqa.attention_varlen(tq, torch.from_numpy(k), torch.from_numpy(v), cu_q, cu_k, 4, 6)
