"""Score and mask modifiers on every kernel family (rowwise, tiled, hopper,
decode), against the float64 reference; user-written twins of the built-ins
bit-for-bit equal to them.

Outputs are poisoned with NaN before each call, so an unwritten element fails.
"""
import numpy as np
import pytest

import cupy_gqa
from conftest import TOLERANCE, assert_close, assert_lse_close, gpu_available, random_qkv
from reference import reference_attention
from test_modifiers import modifier_kwargs, softcap_mod, unit_mod, window_mod

pytestmark = pytest.mark.gpu
if gpu_available():
    import cupy


_WINDOWS = {"window": (37, 0), "window_noncausal": (21, 13), "all": (45, 0), "all_noncausal": (40, 17)}


def _mods(name, batch, hq):
    return modifier_kwargs(name, batch, hq, _WINDOWS)


MOD_NAMES = ["window", "window_noncausal", "softcap", "sinks", "alibi", "alibi_batch", "score_mod", "score_mod_bounded",
             "score_mod_unit", "score_mod_unit_softcap", "score_mod_unit_alibi", "mask_mod", "all",
             "all_noncausal"]
# (batch, seqlen_q, seqlen_k, Hq, Hkv, D)
PREFILL = {"prefill_gqa": (2, 150, 211, 8, 2, 64), "prefill_mha_d128": (1, 129, 129, 4, 4, 128)}
DECODE = {"decode": (3, 2, 1000, 8, 2, 128), "decode_long_split": (1, 1, 6000, 8, 1, 64)}


def _on_hopper():
    return cupy.cuda.Device().compute_capability == "90"


def _kernels(shape, dtype="float32"):
    """The kernels that take a call of this shape and dtype (head_dim 64 / 128: every family where
    seqlen_q and the device allow)."""
    hopper = ["hopper"] if dtype in ("float16", "bfloat16") and _on_hopper() else []
    return ["rowwise", "tiled"] + hopper + (["decode"] if shape[1] <= 16 else [])


def _run(kernel, shape, dtype, kw, seqlens_k=None, return_arrays=False):
    q, k, v = random_qkv(*shape, dtype, seed=11)
    kw = dict(kw)
    causal = kw.pop("causal", True)
    qd, kd, vd = (cupy.asarray(x) for x in (q, k, v))
    dev_kw = {n: (cupy.asarray(x) if isinstance(x, np.ndarray) and n in ("sinks", "alibi_slopes") else x) for n, x in kw.items()}
    out = cupy.full(q.shape, np.nan, dtype=q.dtype)
    lens = None if seqlens_k is None else cupy.asarray(np.asarray(seqlens_k, np.int32))
    res, lse = cupy_gqa.attention(qd, kd, vd, causal=causal, out=out, return_lse=True, kernel=kernel, seqlens_k=lens, **dev_kw)
    assert res is out
    if return_arrays:
        return out, lse
    ref, ref_lse = reference_attention(q, k, v, causal=causal, seqlens_k=seqlens_k, **kw)
    assert_close(cupy.asnumpy(out), ref, TOLERANCE[dtype], f"{kernel} {dtype} out")
    assert_lse_close(cupy.asnumpy(lse), ref_lse, 1e-5, f"{kernel} {dtype} lse")
    for x, xd in zip((q, k, v), (qd, kd, vd)):
        assert np.array_equal(cupy.asnumpy(xd), x, equal_nan=True), "an input was modified"


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("shape", list(PREFILL) + list(DECODE))
@pytest.mark.parametrize("name", MOD_NAMES)
def test_gpu_modifier_matches_reference(name, shape, dtype):
    dims = {**PREFILL, **DECODE}[shape]
    for kernel in _kernels(dims, dtype) + ["auto"]:
        _run(kernel, dims, dtype, _mods(name, dims[0], dims[3]))


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_gpu_user_buffers_made_at_a_split_launch_keep_their_values(dtype):
    """A score_mod's buffers go to the device at the first launch of its plan, while a
    split decode call holds its workspace from CuPy's pool: the two never share memory
    (the partial results written over the buffer read as a zero bias). A pool of its
    own, so that the workspace's freed block would be the one the buffer takes."""
    dims = DECODE["decode"]
    kw = _mods("all", dims[0], dims[3])
    mod = kw["score_mod"]
    q, k, v = (cupy.asarray(x) for x in random_qkv(*dims, dtype, seed=11))
    dev_kw = {n: cupy.asarray(x) if isinstance(x, np.ndarray) else x for n, x in kw.items()}
    if cupy_gqa.workspace_size(q, k, v, kernel="decode", **dev_kw) == 0:
        pytest.skip("decode does not split this call on this device")
    pool = cupy.cuda.MemoryPool()
    with cupy.cuda.using_allocator(pool.malloc):
        _run("decode", dims, dtype, kw)  # against the reference
        bias = mod.device_buffers(cupy.cuda.Device().id)[0]
        assert np.array_equal(cupy.asnumpy(bias), mod.host_buffer("bias")), "the buffer was written over"
    _run("decode", dims, dtype, kw)  # and from the default pool, the buffer already made


@pytest.mark.parametrize("name", ["window", "window_noncausal", "sinks", "alibi_batch", "all", "all_noncausal"])
@pytest.mark.parametrize("shape", ["prefill_gqa", "decode"])
def test_gpu_modifier_with_seqlens_k(name, shape):
    dims = {**PREFILL, **DECODE}[shape]
    lens = [0, dims[2] - 77, dims[2]][: dims[0]]
    for kernel in _kernels(dims, "bfloat16"):
        _run(kernel, dims, "bfloat16", _mods(name, dims[0], dims[3]), seqlens_k=lens)


def test_gpu_modifiers_float64_rowwise():
    """float64 runs rowwise only, in double: the modifiers too."""
    dims = PREFILL["prefill_gqa"]
    _run("rowwise", dims, "float64", _mods("all", dims[0], dims[3]))


@pytest.mark.parametrize("shape", ["prefill_gqa", "prefill_mha_d128", "decode", "decode_long_split"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_gpu_user_twins_are_bit_for_bit_the_builtins(shape, dtype):
    """A ScoreMod written as softcap and a MaskMod written as the causal window give the very
    bits of the built-ins, in every kernel family."""
    dims = {**PREFILL, **DECODE}[shape]
    for kernel in _kernels(dims, dtype):
        a, la = _run(kernel, dims, dtype, {"softcap": 30.0}, return_arrays=True)
        b, lb = _run(kernel, dims, dtype, {"score_mod": softcap_mod(30.0, half=dtype != "float32")}, return_arrays=True)
        assert cupy.array_equal(a, b) and cupy.array_equal(la, lb), f"{kernel}: softcap"
        a, la = _run(kernel, dims, dtype, {"window": (50, 0)}, return_arrays=True)
        b, lb = _run(kernel, dims, dtype, {"mask_mod": window_mod(50)}, return_arrays=True)
        assert cupy.array_equal(a, b) and cupy.array_equal(la, lb), f"{kernel}: window"


def test_gpu_hopper_score_mod_in_units_that_spills_takes_the_serial_kernel():
    """A score_mod in units whose code spills beside P V at head dim 128 (unit_mod: double
    arithmetic and a buffer) runs hopper's variant that waits for P V where that one needs
    less local memory (the registers each needs depend on NVRTC's version): right, and the
    kernel the call took is the one with the least local memory of the two."""
    if not _on_hopper():
        pytest.skip("hopper runs on compute capability 9.0")
    from cupy_gqa import _compile, _mods, _plan, _specs

    dims = PREFILL["prefill_mha_d128"]
    for mod in (unit_mod(), softcap_mod(30.0, half=True)):
        _run("hopper", dims, "bfloat16", {"score_mod": mod})
        mods = _mods.Modifiers(score_mod=mod)
        problem = _plan.Problem(dims[0], dims[1], dims[2], dims[3], dims[4], dims[5], "bfloat16", True, 0.1, mods=mods)
        spec = problem.spec(_specs.hopper_spec("bfloat16", dims[5], True, _specs.ARCHS["sm_90"]))
        taken = [kern for key, kern in _compile._kernels.items() if key[0] == spec.name and key[2] == spec.user_code]
        assert len(taken) == 1, spec.name
        beside = _compile._compile_module(spec)
        serial = _compile._compile_module(_specs.with_serial_pv(spec))
        sizes = (taken[0].local_size_bytes, beside.local_size_bytes, serial.local_size_bytes)
        want = serial if 0 < beside.local_size_bytes and serial.local_size_bytes < beside.local_size_bytes else beside
        assert (taken[0].local_size_bytes, taken[0].num_regs) == (want.local_size_bytes, want.num_regs), sizes


# Long enough that the window's left side skips whole key tiles and the pipeline
# of the hopper kernel wraps its stages: (batch, seqlen_q, seqlen_k, Hq, Hkv, D)
LONG = {"long_gqa_d128": (2, 700, 1500, 8, 2, 128), "long_d80": (1, 1000, 1000, 6, 2, 80),
        "long_d256": (1, 600, 900, 4, 1, 256)}


@pytest.mark.parametrize("shape", list(LONG))
@pytest.mark.parametrize("mods", [{"window": (200, 0)}, {"window": (130, 300), "causal": False},
                                  {"window": (257, 0), "softcap": 20.0, "sinks": "sinks"},
                                  {"alibi_slopes": "slopes", "window": (64, 0)}])
def test_gpu_hopper_long_windows(shape, mods):
    """hopper (and auto, which takes it there) with windows far shorter than the keys."""
    if not _on_hopper():
        pytest.skip("hopper runs on compute capability 9.0")
    dims = LONG[shape]
    rng = np.random.default_rng(3)
    kw = {n: (rng.standard_normal(dims[3]).astype(np.float32) if x == "sinks"
              else (2.0 ** -np.arange(1, dims[3] + 1)).astype(np.float32) if x == "slopes" else x)
          for n, x in mods.items()}
    for kernel in ("hopper", "auto"):
        _run(kernel, dims, "bfloat16", kw)
    lens = [dims[2] - 333, dims[2]][: dims[0]]
    _run("hopper", dims, "float16", kw, seqlens_k=lens)


def test_gpu_auto_takes_hopper_with_modifiers():
    if not _on_hopper():
        pytest.skip("hopper runs on compute capability 9.0")
    q, k, v = (cupy.asarray(x) for x in random_qkv(1, 2048, 2048, 8, 2, 128, "bfloat16"))
    from cupy_gqa import _mods, _plan

    problem = _plan.Problem.of(q, k, dtype="bfloat16", causal=True, softmax_scale=0.1, mods=_mods.Modifiers(softcap=30.0))
    assert _plan.choose_kernel(problem, q, k, v, cupy.empty_like(q)) == "hopper"


def test_gpu_repeat_calls_and_torch():
    """softcap and window calls take the repeat path the second time; sinks calls the full path each time;
    torch tensors (sinks a torch CUDA tensor) give the same results."""
    torch = pytest.importorskip("torch")
    q, k, v = random_qkv(2, 64, 300, 8, 2, 64, "float16", seed=2)
    sinks = np.linspace(-1, 1, 8).astype(np.float32)
    ref, _ = reference_attention(q, k, v, softcap=5.0, window=(30, 0), sinks=sinks)
    qd, kd, vd = (cupy.asarray(x) for x in (q, k, v))
    for _ in range(3):
        out = cupy_gqa.attention(qd, kd, vd, softcap=5.0, window=(30, 0), sinks=cupy.asarray(sinks))
        assert_close(cupy.asnumpy(out), ref, TOLERANCE["float16"], "cupy")
    ref2, _ = reference_attention(q, k, v, softcap=5.0, window=(30, 0))
    for _ in range(3):
        out = cupy_gqa.attention(qd, kd, vd, softcap=5.0, window=(30, 0))
        assert_close(cupy.asnumpy(out), ref2, TOLERANCE["float16"], "cupy, repeat path")
    tq, tk, tv = (torch.from_dlpack(x) for x in (qd, kd, vd))
    ts = torch.from_numpy(sinks).cuda()
    for _ in range(2):
        out = cupy_gqa.attention(tq, tk, tv, softcap=5.0, window=(30, 0), sinks=ts)
        assert_close(out.float().cpu().numpy(), ref, TOLERANCE["float16"], "torch")


def test_gpu_bad_modifier_arrays():
    q, k, v = (cupy.asarray(x) for x in random_qkv(2, 8, 8, 4, 2, 64, "float16"))
    with pytest.raises(TypeError, match="sinks: expected dtype float32, got float16"):
        cupy_gqa.attention(q, k, v, sinks=cupy.zeros(4, cupy.float16))
    with pytest.raises(ValueError, match=r"alibi_slopes: expected shape \(4,\) or \(2, 4\)"):
        cupy_gqa.attention(q, k, v, alibi_slopes=cupy.zeros(5, cupy.float32))
    with pytest.raises(ValueError, match="sinks: expected a contiguous CUDA array"):
        cupy_gqa.attention(q, k, v, sinks=cupy.zeros(8, cupy.float32)[::2])
