"""Validation in cupy_gqa/api.py: every bad input fails clearly, naming the argument."""
import numpy as np
import pytest

import cupy_gqa
from conftest import random_qkv


@pytest.fixture
def qkv():
    return random_qkv(2, 5, 7, 4, 2, 8, "float32")


def call(q, k, v, **kw):
    return cupy_gqa.attention(q, k, v, **kw)


def test_wrong_ndim(qkv):
    q, k, v = qkv
    with pytest.raises(ValueError, match=r"q: expected 4 dimensions .* got shape \(5, 4, 8\)"):
        call(q[0], k, v)
    with pytest.raises(ValueError, match=r"k: expected 4 dimensions"):
        call(q, k[None], v)
    with pytest.raises(ValueError, match=r"v: expected 4 dimensions"):
        call(q, k, v[..., 0])


@pytest.mark.parametrize(
    "which,shape,pattern",
    [
        ("k", (3, 7, 2, 8), r"k: expected shape .*batch=2.* got \(3, 7, 2, 8\)"),
        ("k", (2, 7, 2, 9), r"k: expected shape .*head_dim=8.* got \(2, 7, 2, 9\)"),
        ("v", (2, 6, 2, 8), r"v: expected shape \(2, 7, 2, 8\) \(that of k\), got \(2, 6, 2, 8\)"),
        ("v", (2, 7, 1, 8), r"v: expected shape \(2, 7, 2, 8\)"),
        ("v", (2, 7, 2, 4), r"v: expected shape \(2, 7, 2, 8\)"),
        ("v", (3, 7, 2, 8), r"v: expected shape \(2, 7, 2, 8\)"),
    ],
)
def test_mismatched_shapes(qkv, which, shape, pattern):
    q, k, v = qkv
    bad = np.ones(shape, np.float32)
    with pytest.raises(ValueError, match=pattern):
        call(q, bad, v) if which == "k" else call(q, k, bad)


def test_heads_not_a_multiple():
    q, k, v = random_qkv(1, 4, 4, 6, 4, 8, "float32")
    with pytest.raises(ValueError, match=r"k: expected num_kv_heads >= 1 dividing num_q_heads=6, got num_kv_heads=4"):
        call(q, k, v)


def test_zero_kv_heads():
    q, k, v = random_qkv(1, 4, 4, 2, 1, 8, "float32")
    with pytest.raises(ValueError, match=r"num_kv_heads=0"):
        call(q, k[:, :, :0], v[:, :, :0])


@pytest.mark.parametrize("head_dim", [0, 257, 512])
def test_head_dim_out_of_range(head_dim):
    q, k, v = random_qkv(1, 3, 3, 2, 1, head_dim, "float32")
    with pytest.raises(ValueError, match=rf"q: expected head_dim in \[1, 256\], got {head_dim}"):
        call(q, k, v)


def test_unsupported_and_mixed_dtypes(qkv):
    q, k, v = qkv
    with pytest.raises(TypeError, match=r"q: expected dtype in .*got int32"):
        call(q.astype(np.int32), k, v)
    with pytest.raises(TypeError, match=r"k: expected dtype float32 \(that of q\), got float16"):
        call(q, k.astype(np.float16), v)
    with pytest.raises(TypeError, match=r"v: expected dtype float32 \(that of q\), got float64"):
        call(q, k, v.astype(np.float64))
    with pytest.raises(TypeError, match=r"q: expected dtype in .*got complex64"):
        call(*(x.astype(np.complex64) for x in qkv))


class Foreign:
    """A DLPack producer of another framework, shaped like ``like``, whose memory
    is on DLPack device type ``device_type`` (2: CUDA, 1: host); never converted."""

    def __init__(self, like, device_type):
        self.shape, self.dtype, self._device_type = like.shape, like.dtype, device_type

    def __dlpack__(self, stream=None):
        raise AssertionError("must not be converted")

    def __dlpack_device__(self):
        return (self._device_type, 0)


def test_unknown_and_mixed_frameworks(qkv):
    q, k, v = qkv
    with pytest.raises(TypeError, match=r"q: expected a cupy.ndarray, torch.Tensor, numpy.ndarray .* got builtins.list"):
        call(q.tolist(), k, v)

    # a CUDA DLPack producer is accepted; mixing it with NumPy is not
    with pytest.raises(TypeError, match=r"k: expected the same framework as q .*got .*Foreign"):
        call(q, Foreign(q, device_type=2), v)


@pytest.mark.parametrize("scale", [float("nan"), float("inf"), -float("inf"), np.float32("nan")])
def test_non_finite_softmax_scale(qkv, scale):
    with pytest.raises(ValueError, match=r"softmax_scale: expected a finite number, got"):
        call(*qkv, softmax_scale=scale)


@pytest.mark.parametrize("scale", ["0.1", True, [0.1]])
def test_non_numeric_softmax_scale(qkv, scale):
    with pytest.raises(TypeError, match=r"softmax_scale: expected a real number or None"):
        call(*qkv, softmax_scale=scale)


def test_unknown_kernel(qkv):
    with pytest.raises(ValueError, match=r"kernel: expected one of \('auto', 'rowwise'.*\), got 'flash'"):
        call(*qkv, kernel="flash")


@pytest.mark.parametrize("precision", ["fp32", "TF32", None, 32])
def test_unknown_precision(qkv, precision):
    with pytest.raises(ValueError, match=r"precision: expected one of \('highest', 'tf32'\), got "):
        call(*qkv, precision=precision)


def test_gpu_kernel_on_cpu_inputs(qkv):
    with pytest.raises(ValueError, match=r"kernel: 'rowwise' runs on CUDA arrays"):
        call(*qkv, kernel="rowwise")


@pytest.mark.parametrize("flag", ["causal", "return_lse"])
def test_flags_must_be_bool(qkv, flag):
    with pytest.raises(TypeError, match=rf"{flag}: expected a bool, got str"):
        call(*qkv, **{flag: "yes"})


def test_negative_strides(qkv):
    q, k, v = qkv
    with pytest.raises(ValueError, match=r"k: expected non-negative strides"):
        call(q, k[:, ::-1], v)


def test_out_wrong_shape_dtype_framework(qkv):
    q, k, v = qkv
    with pytest.raises(ValueError, match=r"out: expected shape \(2, 5, 4, 8\) \(that of q\), got \(2, 5, 4, 7\)"):
        call(q, k, v, out=np.empty((2, 5, 4, 7), np.float32))
    with pytest.raises(TypeError, match=r"out: expected dtype float32 \(that of q\), got float64"):
        call(q, k, v, out=np.empty(q.shape, np.float64))
    with pytest.raises(TypeError, match=r"out: expected the same framework as q"):
        call(q, k, v, out=q.tolist())


def test_out_aliasing_an_input(qkv):
    q, k, v = qkv
    with pytest.raises(ValueError, match=r"out: must not overlap the memory of q"):
        call(q, k, v, out=q)
    packed = np.random.default_rng(0).standard_normal((2, 5, 8, 8)).astype(np.float32)
    with pytest.raises(ValueError, match=r"out: must not overlap the memory of q"):
        call(packed[:, :, :4], k, v, out=packed[:, :, 4:])


def test_out_with_overlapping_elements(qkv):
    q, k, v = qkv
    out = np.broadcast_to(np.empty((1, 1, 1, 8), np.float32), q.shape)
    with pytest.raises(ValueError, match=r"out: expected no zero strides"):
        call(q, k, v, out=out)


def test_broadcast_inputs_are_fine(qkv):
    # zero strides on inputs are legal (non-negative): a KV head shared by broadcast
    q, k, v = qkv
    kb = np.broadcast_to(k[:, :, :1], k.shape)
    from reference import reference_attention
    from conftest import assert_close

    assert_close(call(q, kb, v), reference_attention(q, np.ascontiguousarray(kb), v)[0], 1e-5)


def test_empty_out_is_accepted():
    # found by tests/test_fuzz_cpu.py: NumPy gives empty arrays all-zero strides
    q, k, v = random_qkv(1, 0, 0, 1, 1, 3, "float32")
    out = np.empty(q.shape, np.float32)
    assert call(q, k, v, out=out) is out


def test_memory_the_kernels_cant_read_is_named(qkv):
    """An array in memory neither backend reads (a DLPack CPU producer other than
    NumPy, a torch tensor on another device) is refused with its argument's name."""
    q, k, v = qkv
    # a DLPack producer of host memory that isn't NumPy
    with pytest.raises(TypeError, match=r"^q: expected a CUDA array \(DLPack device type 2\), got DLPack device type 1; pass CPU data"):
        call(Foreign(q, device_type=1), k, v)
    torch = pytest.importorskip("torch")
    meta = torch.empty(2, dtype=torch.int32, device="meta")
    tq, tk, tv = (torch.from_numpy(x) for x in qkv)
    with pytest.raises(TypeError, match=r"^seqlens_k: expected a CUDA or CPU torch tensor, got one on device meta"):
        cupy_gqa.attention(tq, tk, tv, seqlens_k=meta)
    with pytest.raises(TypeError, match=r"^cu_seqlens_q: expected a CUDA or CPU torch tensor, got one on device meta"):
        cupy_gqa.attention_varlen(tq[0], tk[0], tv[0], torch.empty(2, dtype=torch.int32, device="meta"), [0, 1], 1, 1)


def test_workspace_functions_and_their_earlier_names(qkv):
    """workspace_size and workspace are the functions decode_workspace_size and
    decode_workspace were: one object each, exported under both names. CPU
    calls take no workspace; a keyword attention lacks is refused by name."""
    assert cupy_gqa.decode_workspace_size is cupy_gqa.workspace_size
    assert cupy_gqa.decode_workspace is cupy_gqa.workspace
    assert {"workspace", "workspace_size", "decode_workspace", "decode_workspace_size"} <= set(cupy_gqa.__all__)
    q, k, v = qkv
    assert cupy_gqa.workspace_size(q, k, v) == 0 and cupy_gqa.workspace(q, k, v) is None
    with pytest.raises(TypeError, match="workspace_size: unexpected keyword 'windw'"):
        cupy_gqa.workspace_size(q, k, v, windw=(4, 0))
