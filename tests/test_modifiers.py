"""Score and mask modifiers on the NumPy backend (cupy_gqa/cpu.py) against the
float64 reference (tests/reference.py): window, softcap, sinks, ALiBi and
user-written score_mod / mask_mod, alone and together, with GQA, seqlens_k,
decode shapes and non-causal calls; and their bad inputs."""
import importlib.util

import numpy as np
import pytest

import cupy_gqa
from cupy_gqa import cpu
from conftest import TOLERANCE, assert_close, assert_lse_close, random_qkv
from reference import reference_attention

HAS_CUPY = importlib.util.find_spec("cupy") is not None


def softcap_mod(cap=30.0, half=False):
    """A user score_mod that is the built-in softcap (``half``: as the kernels for fp16 and
    bf16 inputs compute it, with the hardware tanh): tanh in units of the cap, with its bounds."""
    return cupy_gqa.ScoreMod(
        cuda="return fast_tanh(score);" if half else "return tanh(score);",
        numpy=lambda score, **_: np.tanh(score),
        unit=cap,
        bounds=(-1, 1),
    )


def unit_mod():
    """A score_mod in units of 2 that reads a per-head buffer and the positions (in units:
    score (1 + bias[h] / 4) - 0.005 * distance to the diagonal key), unbounded."""
    return cupy_gqa.ScoreMod(
        # in double, as its NumPy twin
        cuda="return score * (1.0 + 0.25 * bias[h]) - 0.005 * (double)abs(q_idx + seqlen_k - seqlen_q - kv_idx);",
        numpy=lambda score, h, q_idx, kv_idx, seqlen_q, seqlen_k, bias, **_:
            score * (1.0 + 0.25 * bias[h]) - 0.005 * np.abs(q_idx + seqlen_k - seqlen_q - kv_idx),
        buffers={"bias": np.linspace(-1, 1, 8).astype(np.float32)},
        unit=2.0,
    )


def clamped_mod():
    """A score_mod whose function leaves its bounds for most scores: clamped to them."""
    return cupy_gqa.ScoreMod(
        cuda="return 2.0 * score - 0.25;",  # (in double, as its NumPy twin)
        numpy=lambda score, **_: 2.0 * score - 0.25,
        bounds=(-1.5, 2.5),
    )


def window_mod(left):
    """A user mask_mod that is the built-in causal window (left, 0)."""
    return cupy_gqa.MaskMod(
        cuda="return kv_idx >= q_idx + seqlen_k - seqlen_q - w[0];",
        numpy=lambda q_idx, kv_idx, seqlen_q, seqlen_k, w, **_: kv_idx >= q_idx + seqlen_k - seqlen_q - w[0],
        buffers={"w": np.int32([left])},
    )


def head_bias_mod():
    """A score_mod that reads a per-head buffer and the positions: score + bias[h] - 0.01 * (distance of
    the key from the query's diagonal key), so that long sequences keep weights of a sane size."""
    return cupy_gqa.ScoreMod(
        # in double, as its NumPy twin: the float64 kernels compare at 1e-12
        cuda="return score + bias[h] - 0.01 * (double)abs(q_idx + seqlen_k - seqlen_q - kv_idx);",
        numpy=lambda score, h, q_idx, kv_idx, seqlen_q, seqlen_k, bias, **_:
            score + bias[h] - 0.01 * np.abs(q_idx + seqlen_k - seqlen_q - kv_idx),
        buffers={"bias": np.linspace(-1, 1, 8).astype(np.float32)},
    )


def even_heads_odd_keys_mod():
    """A mask_mod that depends on the head: even heads skip odd keys."""
    return cupy_gqa.MaskMod(
        cuda="return (h % 2 == 1) || (kv_idx % 2 == 0);",
        numpy=lambda h, kv_idx, **_: (h % 2 == 1) | (kv_idx % 2 == 0),
    )


def modifier_kwargs(name, batch, hq, windows, seed=7):
    """The modifiers of case ``name`` for ``batch`` sequences and ``hq`` query heads: sinks and ALiBi
    slopes drawn here, and the window of each windowed case from ``windows`` (name -> (left, right)),
    which the CPU and GPU tests size to their sequences."""
    rng = np.random.default_rng(seed)
    sinks = rng.standard_normal(hq).astype(np.float32)
    slopes = (2.0 ** -np.arange(1, hq + 1)).astype(np.float32)
    kw = {
        "softcap": {"softcap": 2.5},
        "sinks": {"sinks": sinks},
        "alibi": {"alibi_slopes": slopes},
        "alibi_batch": {"alibi_slopes": np.stack([slopes * (b + 1) for b in range(batch)])},
        "score_mod": {"score_mod": head_bias_mod()},
        "score_mod_bounded": {"score_mod": clamped_mod()},
        "score_mod_unit": {"score_mod": unit_mod()},
        "score_mod_unit_softcap": {"score_mod": softcap_mod(4.0), "mask_mod": even_heads_odd_keys_mod(), "sinks": sinks},
        "score_mod_unit_alibi": {"score_mod": unit_mod(), "alibi_slopes": slopes},
        "mask_mod": {"mask_mod": even_heads_odd_keys_mod()},
        "all": {"softcap": 3.0, "sinks": sinks, "alibi_slopes": slopes, "score_mod": head_bias_mod(),
                "mask_mod": even_heads_odd_keys_mod()},
        "all_noncausal": {"softcap": 3.0, "sinks": sinks, "alibi_slopes": slopes, "score_mod": head_bias_mod(),
                          "mask_mod": even_heads_odd_keys_mod()},
    }
    if name not in kw and name not in windows:
        raise KeyError(name)
    kw = kw.get(name, {})
    if name in windows:
        kw = {**kw, "window": windows[name]}
    if name.endswith("noncausal"):
        kw = {**kw, "causal": False}
    return kw


_WINDOWS = {"window": (9, 0), "window_left_only_noncausal": (7, -1), "window_both_noncausal": (5, 3),
            "window_right_only_noncausal": (-1, 2), "window_zero": (0, 0), "all": (11, 0), "all_noncausal": (6, 4)}


def _mods(name, batch, hq):
    return modifier_kwargs(name, batch, hq, _WINDOWS)


MOD_NAMES = ["window", "window_left_only_noncausal", "window_both_noncausal", "window_right_only_noncausal",
             "window_zero", "softcap", "sinks", "alibi", "alibi_batch", "score_mod", "score_mod_bounded", "score_mod_unit",
             "score_mod_unit_softcap", "score_mod_unit_alibi", "mask_mod", "all", "all_noncausal"]
# (batch, seqlen_q, seqlen_k, Hq, Hkv, D): prefill, GQA with more keys, decode against a long cache, more queries than keys
SHAPES = {
    "prefill": (2, 37, 37, 8, 8, 16),
    "gqa": (2, 29, 45, 8, 2, 16),
    "decode": (2, 2, 300, 8, 2, 32),
    "short_k": (1, 40, 13, 8, 4, 16),
}


def _run(shape, dtype, kw, seqlens_k=None, blocks=None, monkeypatch=None):
    q, k, v = random_qkv(*shape, dtype, seed=3)
    kw = dict(kw)
    causal = kw.pop("causal", True)
    if blocks is not None:
        monkeypatch.setattr(cpu, "Q_BLOCK", blocks[0])
        monkeypatch.setattr(cpu, "K_BLOCK", blocks[1])
    copies = [a.copy() for a in (q, k, v)] + [np.array(x, copy=True) for x in kw.values() if isinstance(x, np.ndarray)]
    out, lse = cupy_gqa.attention(q, k, v, causal=causal, seqlens_k=seqlens_k, return_lse=True, **kw)
    ref, ref_lse = reference_attention(q, k, v, causal=causal, seqlens_k=seqlens_k, **kw)
    for a, b in zip([q, k, v] + [x for x in kw.values() if isinstance(x, np.ndarray)], copies):
        assert np.array_equal(a, b, equal_nan=True), "an input was modified"
    return out, lse, ref, ref_lse


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("name", MOD_NAMES)
def test_modifier_matches_reference(name, shape, dtype):
    dims = SHAPES[shape]
    out, lse, ref, ref_lse = _run(dims, dtype, _mods(name, dims[0], dims[3]))
    assert_close(out, ref, TOLERANCE[dtype], f"{name} {shape} {dtype}")
    assert_lse_close(lse, ref_lse, 1e-5)


@pytest.mark.parametrize("name", ["window", "window_both_noncausal", "sinks", "alibi_batch", "all", "all_noncausal"])
@pytest.mark.parametrize("shape", ["gqa", "decode"])
def test_modifier_with_seqlens_k_and_small_blocks(name, shape, monkeypatch):
    """seqlens_k (a sequence of 0 keys included) moves the diagonal, ALiBi's distances and the window per
    sequence; small NumPy blocks run the online softmax and the window's block skipping across blocks."""
    dims = SHAPES[shape]
    lens = [0, dims[2] - 5]
    out, lse, ref, ref_lse = _run(dims, "float64", _mods(name, dims[0], dims[3]), seqlens_k=lens, blocks=(7, 8),
                                  monkeypatch=monkeypatch)
    assert_close(out, ref, TOLERANCE["float64"], f"{name} {shape}")
    assert_lse_close(lse, ref_lse, 1e-6)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_modifiers_half_dtypes(dtype):
    dims = SHAPES["gqa"]
    out, lse, ref, ref_lse = _run(dims, dtype, _mods("all", dims[0], dims[3]))
    assert_close(out, ref, TOLERANCE[dtype], dtype)


def test_builtins_equal_their_user_written_twins():
    q, k, v = random_qkv(2, 33, 61, 8, 2, 16, "float32", seed=4)
    a = cupy_gqa.attention(q, k, v, softcap=30.0)
    b = cupy_gqa.attention(q, k, v, score_mod=softcap_mod(30.0))
    np.testing.assert_array_equal(a, b)
    a = cupy_gqa.attention(q, k, v, window=(10, 0))
    b = cupy_gqa.attention(q, k, v, mask_mod=window_mod(10))
    np.testing.assert_array_equal(a, b)


def test_window_semantics_and_rows_without_keys():
    """window (0, 0) non-causal: each query sees its diagonal key only; queries past the keys see none."""
    q, k, v = random_qkv(1, 6, 4, 2, 1, 8, "float64", seed=5)
    out, lse = cupy_gqa.attention(q, k, v, causal=False, window=(0, 0), return_lse=True)
    d = 4 - 6
    for t in range(6):
        j = t + d
        if j < 0:
            assert np.all(out[0, t] == 0) and np.all(np.isneginf(lse[0, :, t]))
        else:
            np.testing.assert_allclose(out[0, t], np.repeat(v[0, j], 2, axis=0), rtol=1e-12)


def test_sinks_alone_give_the_sink_as_lse_of_rows_without_keys():
    q, k, v = random_qkv(1, 5, 3, 2, 2, 8, "float32", seed=6)
    sinks = np.float32([0.5, -1.0])
    out, lse = cupy_gqa.attention(q, k, v, sinks=sinks, return_lse=True)
    assert np.all(out[0, :2] == 0)  # queries 0, 1 see no key (bottom-right causal)
    np.testing.assert_allclose(lse[0, :, :2], np.repeat(sinks[:, None], 2, axis=1))
    out0, lse0 = cupy_gqa.attention(q, k[:, :0], v[:, :0], sinks=sinks, return_lse=True)  # no keys at all
    assert np.all(out0 == 0)
    np.testing.assert_allclose(lse0[0], np.repeat(sinks[:, None], 5, axis=1))


def test_window_unbounded_and_past_every_key_is_no_window():
    q, k, v = random_qkv(1, 20, 20, 2, 1, 8, "float32", seed=8)
    plain = cupy_gqa.attention(q, k, v)
    for window in ((-1, -1), (-1, 0), (40, 0), (1000, 5)):
        np.testing.assert_array_equal(cupy_gqa.attention(q, k, v, window=window), plain)


def test_torch_cpu_sinks_and_layout():
    torch = pytest.importorskip("torch")
    q, k, v = random_qkv(2, 9, 9, 4, 2, 8, "float32", seed=9)
    sinks = np.float32([0.1, 0.2, -0.3, 1.0])
    ref, _ = reference_attention(q, k, v, sinks=sinks, window=(3, 0))
    tq, tk, tv = (torch.from_numpy(x).transpose(1, 2) for x in (q, k, v))
    out = cupy_gqa.attention(tq, tk, tv, layout="bhsd", sinks=torch.from_numpy(sinks), window=(3, 0))
    assert_close(out.transpose(1, 2).numpy(), ref, TOLERANCE["float32"])


# --- bad input -----------------------------------------------------------------------
q0, k0, v0 = random_qkv(2, 8, 8, 4, 2, 8, "float32")


@pytest.mark.parametrize(
    "kw, exc, message",
    [
        ({"window": 5}, TypeError, r"window: expected None or a pair \(left, right\) of integers >= -1, got 5"),
        ({"window": (1, 2, 3)}, TypeError, r"window: expected None or a pair"),
        ({"window": (1.5, 0)}, TypeError, r"window: expected integers \(left, right\), got float 1.5 for left"),
        ({"window": (-2, 0)}, ValueError, r"window: expected left and right >= -1 \(-1: unbounded\), got left=-2"),
        ({"window": (3, -5)}, ValueError, r"got right=-5"),
        ({"softcap": 0.0}, ValueError, r"softcap: expected a finite number > 0 \(None: no softcap\), got 0.0"),
        ({"softcap": -1}, ValueError, r"softcap: expected a finite number > 0"),
        ({"softcap": float("nan")}, ValueError, r"softcap: expected a finite number > 0 \(None: no softcap\), got nan"),
        ({"softcap": "30"}, TypeError, r"softcap: expected a real number > 0 or None, got str"),
        ({"sinks": np.zeros(4, np.float64)}, TypeError, r"sinks: expected dtype float32, got float64"),
        ({"sinks": np.zeros(3, np.float32)}, ValueError, r"sinks: expected shape \(4,\) \(num_q_heads,\), got \(3,\)"),
        ({"sinks": np.zeros((2, 4), np.float32)}, ValueError, r"sinks: expected shape \(4,\)"),
        ({"sinks": "x"}, TypeError, r"sinks: expected None or a float32 array"),
        ({"alibi_slopes": np.zeros(4, np.float16)}, TypeError, r"alibi_slopes: expected dtype float32, got float16"),
        ({"alibi_slopes": np.zeros((3, 4), np.float32)}, ValueError,
         r"alibi_slopes: expected shape \(4,\) or \(2, 4\) \(num_q_heads,\) or \(batch, num_q_heads\), got \(3, 4\)"),
        ({"score_mod": lambda s: s}, TypeError, r"score_mod: expected a cupy_gqa.ScoreMod or None, got function"),
        ({"mask_mod": softcap_mod()}, TypeError, r"mask_mod: expected a cupy_gqa.MaskMod or None, got ScoreMod"),
        ({"score_mod": cupy_gqa.ScoreMod(cuda="return score;")}, ValueError,
         r"score_mod: has no numpy= function, which the NumPy backend"),
    ],
)
def test_bad_modifier_input(kw, exc, message):
    with pytest.raises(exc, match=message):
        cupy_gqa.attention(q0, k0, v0, **kw)


def test_user_mod_constructor_checks():
    with pytest.raises(TypeError, match="score_mod: expected cuda= a non-empty string"):
        cupy_gqa.ScoreMod(cuda="")
    with pytest.raises(ValueError, match="buffer names must be identifiers"):
        cupy_gqa.ScoreMod(cuda="return score;", buffers={"score": np.float32([1])})
    with pytest.raises(TypeError, match=r"buffer 'x': expected dtype in"):
        cupy_gqa.MaskMod(cuda="return true;", buffers={"x": np.complex64([1])})
    with pytest.raises(ValueError, match="expected at most 6 buffers"):
        cupy_gqa.MaskMod(cuda="return true;", buffers={f"b{i}": np.int32([i]) for i in range(7)})
    with pytest.raises(TypeError, match=r"score_mod: expected bounds= None or a pair \(low, high\) of real numbers, got 3"):
        cupy_gqa.ScoreMod(cuda="return score;", bounds=3)
    with pytest.raises(TypeError, match=r"score_mod: expected bounds= real numbers \(low, high\), got str '1' for high"):
        cupy_gqa.ScoreMod(cuda="return score;", bounds=(0, "1"))
    with pytest.raises(ValueError, match=r"score_mod: expected bounds= finite numbers with low <= high, got \(1.0, -1.0\)"):
        cupy_gqa.ScoreMod(cuda="return score;", bounds=(1, -1))
    with pytest.raises(ValueError, match=r"got \(-inf, 0.0\)"):
        cupy_gqa.ScoreMod(cuda="return score;", bounds=(-np.inf, 0))
    assert cupy_gqa.ScoreMod(cuda="return score;", bounds=[np.float32(-2), 3]).bounds == (-2.0, 3.0)
    with pytest.raises(TypeError, match=r"score_mod: expected unit= a real number > 0 or None, got str '2'"):
        cupy_gqa.ScoreMod(cuda="return score;", unit="2")
    with pytest.raises(TypeError, match=r"score_mod: expected unit= a real number > 0 or None, got bool True"):
        cupy_gqa.ScoreMod(cuda="return score;", unit=True)
    for bad in (0, -1.5, np.inf, np.nan):
        with pytest.raises(ValueError, match=r"score_mod: expected unit= a finite number > 0 \(None: natural units\), got"):
            cupy_gqa.ScoreMod(cuda="return score;", unit=bad)
    mod = cupy_gqa.ScoreMod(cuda="return score;", unit=np.float32(4), bounds=(-1, 0.5))
    assert mod.unit == 4.0 and mod.natural_bounds() == (-4.0, 2.0) and "unit=4.0" in repr(mod)


def test_score_mod_in_units_is_u_times_f_of_x_over_u():
    """With a unit u the function sees softmax_scale * q . k / u and the new score is u times
    its result (bounds on the result): the NumPy backend against scores written out."""
    q, k, v = random_qkv(1, 7, 9, 2, 1, 8, "float64", seed=12)
    seen = []

    def fn(score, **_):
        seen.append(np.array(score))
        return score**3

    out = cupy_gqa.attention(q, k, v, score_mod=cupy_gqa.ScoreMod(cuda="return score;", numpy=fn, unit=3.0))
    x = np.einsum("qhd,khd->hqk", q[0], np.repeat(k[0], 2, axis=1)) / np.sqrt(8)
    np.testing.assert_allclose(seen[0], x / 3.0, rtol=1e-12)  # (the NumPy backend's (heads, rows, keys))
    s = 3.0 * (x / 3.0) ** 3 + np.where(np.arange(9)[None, :] <= np.arange(7)[:, None] + 2, 0, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    want = np.einsum("hqk,khd->qhd", p / p.sum(-1, keepdims=True), np.repeat(v[0], 2, axis=1))
    assert_close(out[0], want, 1e-12)
    ref, _ = reference_attention(q, k, v, score_mod=cupy_gqa.ScoreMod(cuda="return score;", numpy=fn, unit=3.0))
    assert_close(out, ref, 1e-12)


def test_bounded_score_mod_is_clamped_nan_kept():
    """A score_mod's bounds clamp its scores on the NumPy backend as in the reference; a NaN
    score is not clamped (its row gives what it gives without bounds)."""
    fn = lambda score, q_idx, **_: np.where(q_idx == 3, np.nan, 4.0 * score)  # noqa: E731
    mod = cupy_gqa.ScoreMod(cuda="return score;", numpy=fn, bounds=(-1.0, 2.0))
    q, k, v = random_qkv(1, 6, 6, 2, 2, 8, "float64", seed=5)
    out, lse = cupy_gqa.attention(q, k, v, score_mod=mod, return_lse=True)
    ref, ref_lse = reference_attention(q, k, v, score_mod=mod)
    assert_close(out, ref, 1e-12)
    assert_lse_close(lse, ref_lse, 1e-6)  # (lse is float32)
    unbounded = cupy_gqa.attention(q, k, v, score_mod=cupy_gqa.ScoreMod(cuda="return score;", numpy=fn))
    assert np.array_equal(out[0, 3], unbounded[0, 3], equal_nan=True)
    assert not np.allclose(np.delete(out, 3, axis=1), np.delete(unbounded, 3, axis=1))
    raw = (4.0 * np.einsum("qhd,khd->hqk", q[0], k[0]) / np.sqrt(8))[:, np.tril(np.ones((6, 6), bool))]
    assert (raw > 2).any() and (raw < -1).any()  # the bounds matter for these inputs


def test_fixed_reference_of_the_modifiers():
    """The one exp2 reference (log2 units) a kernel may take for scores in a known range: the
    middle of a softcap's or a bounded score_mod's range, where it is at most 160 log2 units
    wide; none with ALiBi after a softcap, or a score_mod without bounds after it."""
    from cupy_gqa import _mods

    log2e = 1.4426950408889634
    assert _mods.Modifiers(softcap=30.0).fixed_ref() == 0.0
    assert _mods.Modifiers(softcap=55.0, window=True, sinks=True).fixed_ref() == 0.0
    assert _mods.Modifiers(softcap=56.0).fixed_ref() is None  # 161.6 log2 units
    assert _mods.Modifiers(softcap=30.0, alibi=1).fixed_ref() is None
    assert _mods.Modifiers(softcap=30.0, score_mod=head_bias_mod()).fixed_ref() is None
    bounded = cupy_gqa.ScoreMod(cuda="return score;", bounds=(-10, 30))
    assert _mods.Modifiers(softcap=30.0, alibi=1, score_mod=bounded).fixed_ref() == float(np.float32(10 * log2e))
    assert _mods.Modifiers().fixed_ref() is None
    # a score_mod with a unit: its bounds count in the unit; the twin of softcap 30 takes its reference
    assert _mods.Modifiers(score_mod=softcap_mod(30.0)).fixed_ref() == _mods.Modifiers(softcap=30.0).fixed_ref()
    assert _mods.Modifiers(score_mod=softcap_mod(56.0)).fixed_ref() is None
    shifted = cupy_gqa.ScoreMod(cuda="return score;", bounds=(0, 10), unit=2.0)
    assert _mods.Modifiers(score_mod=shifted).fixed_ref() == float(np.float32(10 * log2e))


def test_plan_takes_the_fixed_reference_for_bf16_on_hopper_only():
    """MOD_FIXED_REF (64) joins the flags of the hopper kernel for bf16 inputs (whose P has
    float32's exponents), never fp16's or another family's."""
    from cupy_gqa import _mods, _plan, _specs

    arch = _specs.ARCHS["sm_90"]
    for dtype, softcap, fixed in (("bfloat16", 30.0, True), ("float16", 30.0, False), ("bfloat16", 60.0, False)):
        problem = _plan.Problem(1, 64, 64, 4, 4, 128, dtype, True, 0.1, mods=_mods.Modifiers(softcap=softcap))
        hopper = problem.spec(_specs.hopper_spec(dtype, 128, True, arch))
        assert hopper.mods == (66 if fixed else 2), hopper.name
        assert problem.spec(_specs.tiled_spec(dtype, 128, True, arch)).mods == 2
    mp = np.frombuffer(_mods.Modifiers(softcap=30.0).params(0, 4), _mods.MOD_PARAMS_DTYPE)
    assert mp["fixed_ref"][0] == 0.0 and mp["softcap"][0] == 30.0 and mp["score_unit"][0] == 0.0
    # a score_mod with a unit: MOD_SCORE_UNIT (128) in the flags, the unit in the parameters
    twin = _mods.Modifiers(score_mod=cupy_gqa.ScoreMod(cuda="return fast_tanh(score);", unit=30.0, bounds=(-1, 1)))
    problem = _plan.Problem(1, 64, 64, 4, 4, 128, "bfloat16", True, 0.1, mods=twin)
    assert problem.spec(_specs.hopper_spec("bfloat16", 128, True, arch)).mods == 16 | 64 | 128
    assert problem.spec(_specs.tiled_spec("bfloat16", 128, True, arch)).mods == 16 | 128
    mp = np.frombuffer(twin.params(0, 4), _mods.MOD_PARAMS_DTYPE)
    assert mp["score_unit"][0] == 30.0 and mp["softcap"][0] == 0.0 and mp["fixed_ref"][0] == 0.0


def test_hopper_score_mod_in_units_has_a_serial_variant():
    """hopper's kernel with a user score_mod in units has a variant whose softmax waits for P V
    (MOD_SERIAL_PV, 256), which the compile takes where the user's code spills beside P V; the
    other kernels and the built-in softcap have none."""
    from cupy_gqa import _compile, _mods, _plan, _specs

    arch = _specs.ARCHS["sm_90"]
    mods = _mods.Modifiers(score_mod=unit_mod())
    for addr in (0, 1):
        problem = _plan.Problem(1, 64, 64, 4, 4, 128, "bfloat16", True, 0.1, mods=mods)
        spec = _specs.with_seq(problem.spec(_specs.hopper_spec("bfloat16", 128, True, arch)), addr)
        assert _compile._serial_pv_fallback(spec), spec.name
        serial = _specs.with_serial_pv(spec)
        assert serial.mods == 16 | 128 | 256 and serial.name == spec.name.replace(", 144>", ", 400>")
        assert serial.user_code == spec.user_code and not _compile._serial_pv_fallback(serial)
        tiled = problem.spec(_specs.tiled_spec("bfloat16", 128, True, arch))
        assert not _compile._serial_pv_fallback(tiled)
    softcap = _plan.Problem(1, 64, 64, 4, 4, 128, "bfloat16", True, 0.1, mods=_mods.Modifiers(softcap=30.0))
    assert not _compile._serial_pv_fallback(softcap.spec(_specs.hopper_spec("bfloat16", 128, True, arch)))


@pytest.mark.skipif(not HAS_CUPY, reason="needs CuPy's NVRTC")
def test_bad_snippet_shows_nvrtc_message_with_the_users_line_numbers():
    with pytest.raises(ValueError, match=r"score_mod: NVRTC could not compile the code[\s\S]*score_mod\(3\): error: identifier \"undefined_name\" is undefined"):
        cupy_gqa.ScoreMod(cuda="float x = score;\nx = x * 2.f;\nreturn x + undefined_name;")
    with pytest.raises(ValueError, match=r"mask_mod\(1\): error"):
        cupy_gqa.MaskMod(cuda="return q_idx >= ;")
