"""Frameworks on the GPU (cupy_gqa/_interop.py): torch tensors, streams, DLPack, devices, threads."""
import threading

import numpy as np
import pytest

import cupy_gqa
from conftest import TOLERANCE, assert_close, gpu_available, random_qkv
from reference import reference_attention

pytestmark = pytest.mark.gpu
if gpu_available():
    import cupy

torch = pytest.importorskip("torch") if gpu_available() else None


def torch_qkv(dtype, seqlen=96, requires_grad=False):
    q, k, v = random_qkv(2, seqlen, seqlen, 8, 2, 64, "float32", seed=5)
    ts = [torch.from_numpy(x).to("cuda", dtype).requires_grad_(requires_grad) for x in (q, k, v)]
    return ts, [t.detach().float().cpu().numpy() for t in ts]


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "float64"])
def test_torch_tensors_in_torch_out(dtype):
    (q, k, v), host = torch_qkv(getattr(torch, dtype))
    out, lse = cupy_gqa.attention(q, k, v, return_lse=True)
    assert isinstance(out, torch.Tensor) and out.dtype == q.dtype and out.device == q.device
    assert isinstance(lse, torch.Tensor) and lse.dtype == torch.float32 and lse.shape == (2, 8, 96)
    ref, ref_lse = reference_attention(*host)
    assert_close(out.double().cpu().numpy(), ref, TOLERANCE[dtype], dtype)


def test_torch_out_is_written_in_place():
    (q, k, v), host = torch_qkv(torch.bfloat16)
    out = torch.full_like(q, float("nan"))
    assert cupy_gqa.attention(q, k, v, out=out) is out
    assert_close(out.double().cpu().numpy(), reference_attention(*host)[0], TOLERANCE["bfloat16"])


def test_torch_non_default_stream_no_sync():
    """Work is queued on torch's current stream: results are visible there after
    a wait on that stream alone, and the call does not block the host."""
    (q, k, v), host = torch_qkv(torch.float32, seqlen=512)
    ref = reference_attention(*host)[0]
    cupy_gqa.attention(q, k, v)  # compile outside the measured part
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        # a long kernel first on the side stream: if attention ran on another
        # stream or synchronised the device, its result or timing would show it
        torch.cuda._sleep(200_000_000)
        outs = [cupy_gqa.attention(q, k, v) for _ in range(4)]
        assert not side.query()  # the host was not held until the stream drained
    side.synchronize()
    for out in outs:
        assert_close(out.cpu().numpy(), ref, TOLERANCE["float32"], "side stream")


@pytest.mark.parametrize("n_streams", [4])
def test_concurrent_streams_torch_and_cupy(n_streams):
    (q, k, v), host = torch_qkv(torch.float16)
    ref = reference_attention(*host)[0]
    streams = [torch.cuda.Stream() for _ in range(n_streams)]
    outs = []
    for s in streams:
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            outs.append(cupy_gqa.attention(q, k, v))
    cq, ck, cv = (cupy.asarray(x.astype(np.float16)) for x in host)
    couts = []
    for _ in range(n_streams):
        with cupy.cuda.Stream(non_blocking=True) as s:
            couts.append(cupy_gqa.attention(cq, ck, cv))
            s.synchronize()
    for s, out in zip(streams, outs):
        s.synchronize()
        assert_close(out.double().cpu().numpy(), ref, TOLERANCE["float16"], "torch stream")
    for out in couts:
        assert_close(cupy.asnumpy(out), ref, TOLERANCE["float16"], "cupy stream")


def test_requires_grad_records_the_backward():
    (q, k, v), _ = torch_qkv(torch.float32, requires_grad=True)
    out = cupy_gqa.attention(q, k, v)
    assert out.requires_grad and out.is_cuda
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    assert dq.shape == q.shape and dk.shape == k.shape and bool(torch.isfinite(dq).all())
    with torch.no_grad():
        res = cupy_gqa.attention(q.detach(), k.detach(), v.detach())
    assert not res.requires_grad


def test_mixed_frameworks_and_devices():
    (q, k, v), _ = torch_qkv(torch.float32)
    with pytest.raises(TypeError, match=r"k: expected the same framework as q"):
        cupy_gqa.attention(q, cupy.asarray(k.cpu().numpy()), v)
    with pytest.raises(ValueError, match=r"k: expected device cuda:0 \(that of q\), got cpu"):
        cupy_gqa.attention(q, k.cpu(), v)
    with pytest.raises(TypeError, match=r"k: expected the same framework as q"):
        cupy_gqa.attention(cupy.asarray(q.cpu().numpy()), k.cpu().numpy(), v.cpu().numpy())


def test_out_aliasing_on_gpu():
    (q, k, v), _ = torch_qkv(torch.float32)
    buf = torch.empty(q.numel(), device="cuda")
    v_in_buf = buf[: v.numel()].view(v.shape)
    v_in_buf.copy_(v)
    with pytest.raises(ValueError, match=r"out: must not overlap the memory of v"):
        cupy_gqa.attention(q, k, v_in_buf, out=buf.view(q.shape))


def test_foreign_dlpack_array_returns_cupy():
    """Any CUDA array exporting __dlpack__ (JAX, ...) is accepted and gives CuPy."""
    (q, k, v), host = torch_qkv(torch.float32)

    class Foreign:
        def __init__(self, t):
            self._t, self.shape, self.dtype = t, tuple(t.shape), np.dtype(np.float32)

        def __dlpack__(self, stream=None, **kw):
            return self._t.__dlpack__(stream=stream)

        def __dlpack_device__(self):
            return self._t.__dlpack_device__()

    out = cupy_gqa.attention(Foreign(q), Foreign(k), Foreign(v))
    assert isinstance(out, cupy.ndarray)
    assert_close(cupy.asnumpy(out), reference_attention(*host)[0], TOLERANCE["float32"])


def test_threads_first_calls_compile_once(monkeypatch):
    """8 threads make their first calls at once across 4 specializations; each
    specialization compiles exactly once and every result is right."""
    from cupy_gqa import _compile, _specs

    # head dims that only rowwise serves (fp16 / bf16: not a multiple of 8), so
    # that auto runs the four rowwise specializations on every GPU
    cases = [("float32", 24), ("float16", 20), ("bfloat16", 44), ("float64", 12)] * 2
    specs = {_specs.rowwise_spec(dt, d, d % _specs.vec_width(dt) == 0).name for dt, d in cases}
    for key in [key for key in _compile._kernels if key[0] in specs]:
        del _compile._kernels[key]  # forget them, as in a fresh process
    built = []
    real = cupy.RawModule

    def counting(*args, **kw):
        built.extend(kw["name_expressions"])
        return real(*args, **kw)

    monkeypatch.setattr(cupy, "RawModule", counting)
    inputs = [random_qkv(1, 33, 33, 4, 2, d, dt, seed=i) for i, (dt, d) in enumerate(cases)]
    errors, results = [], [None] * len(cases)
    barrier = threading.Barrier(len(cases))

    def work(i):
        try:
            barrier.wait()
            with cupy.cuda.Stream(non_blocking=True) as s:
                results[i] = cupy.asnumpy(cupy_gqa.attention(*(cupy.asarray(x) for x in inputs[i])))
                s.synchronize()
        except Exception as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(cases))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert sorted(built) == sorted(specs)  # each exactly once
    for (dt, _), x, res in zip(cases, inputs, results):
        assert_close(res, reference_attention(*x)[0], TOLERANCE[dt], dt)


@pytest.mark.parametrize("head_dim", [16, 128])
def test_torch_repeat_calls_on_new_tensors(head_dim):
    """torch calls of one signature on different tensors, all alive (a model's
    layers): the repeat path reads each call's own q, k and v (hopper: its own
    tensor maps), in the layout a transformers layer passes."""
    dims = (2, 40, 300, 4, 2, head_dim)
    held = []
    for seed in range(4):
        q, k, v = random_qkv(*dims, "float16", seed=seed)
        t = [torch.from_numpy(np.ascontiguousarray(x.transpose(0, 2, 1, 3))).cuda() for x in (q, k, v)]  # (B, H, S, D)
        held.append(t)
        out = cupy_gqa.attention(*t, layout="bhsd")
        got = out.transpose(1, 2).cpu().numpy()
        assert_close(got, reference_attention(q, k, v)[0], TOLERANCE["float16"], f"call {seed}")
