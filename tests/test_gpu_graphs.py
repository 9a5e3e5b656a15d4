"""CUDA graphs: every kernel family and path captured with torch.cuda.graph and
with CuPy's stream capture, replayed after the inputs (and a device
seqlens_k) change in place, each replay checked against the float64
reference. Outputs are NaN-poisoned before every replay.
"""
import numpy as np
import pytest

import cupy_gqa
from conftest import TOLERANCE, assert_close, assert_lse_close, gpu_available, random_qkv
from reference import reference_attention

pytestmark = pytest.mark.gpu
if gpu_available():
    import cupy

    from cupy_gqa import _fast, _plan, _specs

# name: (kernel, (batch, seqlen_q, seqlen_k, num_q_heads, num_kv_heads, head_dim), dtype, split)
# split: whether the decode kernel cuts the keys into several ranges (a workspace);
# seqlen_k 300 < 2 * DECODE_MIN_SPLIT_KEYS never splits, 1 or 2 (batch, KV head)
# pairs against thousands of keys always do; "cluster": it splits them into 2 to
# 8 ranges, merged in thread-block clusters where the GPU has them (no workspace)
# and by the combine elsewhere.
CASES = {
    "rowwise": ("rowwise", (2, 40, 72, 6, 2, 40), "float32", False),
    "tiled": ("tiled", (2, 96, 128, 8, 2, 64), "float16", False),
    "hopper": ("hopper", (2, 96, 160, 8, 2, 128), "bfloat16", False),
    "auto_prefill": ("auto", (1, 64, 64, 4, 4, 64), "bfloat16", False),
    "decode": ("decode", (2, 1, 300, 8, 2, 128), "bfloat16", False),
    "decode_split": ("decode", (1, 2, 8192, 8, 1, 128), "bfloat16", True),
    "decode_split_f32": ("decode", (1, 1, 3000, 4, 1, 64), "float32", True),
    "auto_decode_split": ("auto", (2, 1, 2048, 16, 1, 64), "float16", "cluster"),
    "decode_cluster": ("decode", (4, 1, 4096, 16, 4, 128), "bfloat16", "cluster"),
    # float32 "highest" on fp16 pairs (at this size only when chosen: _scheme): K and V become pairs in a workspace first
    "tiled_f32": ("tiled", (2, 96, 200, 8, 2, 64), "float32", "pairs"),
    # the same call by default: under _specs.F32_PAIRS_MIN_FLOPS, split TF32 (no workspace)
    "tiled_f32_small": ("tiled", (2, 96, 200, 8, 2, 64), "float32", "f32"),
}
VARIANTS = ["plain", "out", "return_lse", "seqlens_k", "workspace", "first_call"]


def _skip_unsupported(kernel, dtype):
    cc = int(cupy.cuda.Device().compute_capability)
    if kernel == "hopper" and cc != 90:
        pytest.skip("hopper: compute capability 9.0 only")
    if kernel != "rowwise" and dtype != "float32" and cc < 80:
        pytest.skip("tensor-core kernels: compute capability 8.0 or newer")


@pytest.fixture(autouse=True)
def _scheme(request):
    """The "pairs" case runs fp16 pairs at its size (calls take them from
    _specs.F32_PAIRS_MIN_FLOPS up), unless CUPY_GQA_TEST_F32_PRODUCTS set a scheme."""
    callspec = getattr(request.node, "callspec", None)
    case = callspec.params.get("case") if callspec is not None else None
    if case in CASES and CASES[case][3] == "pairs" and _specs.F32_HIGHEST is None:
        old = _plan.set_f32_highest("f16x2")
        yield
        _plan.set_f32_highest(old)
    else:
        yield


def _needs_workspace(split):
    if split in ("pairs", "f32"):  # pairs where they were set; at these sizes the default is split TF32
        return _specs.F32_HIGHEST == "f16x2" and int(cupy.cuda.Device().compute_capability) >= 80
    return split is True or (split == "cluster" and int(cupy.cuda.Device().compute_capability) < 90)


def _lens_values(step, batch, seqlen_k):
    """Cache lengths for replay ``step``: all different, 1 to seqlen_k - 1."""
    return [max(1, seqlen_k * (step + 1 + i) // (batch + 3)) for i in range(batch)]


def _check(out, lse, host, seqlens_k, dtype, what):
    ref, ref_lse = reference_attention(*host, causal=True, seqlens_k=seqlens_k)
    assert_close(np.asarray(out).astype(np.float64), ref, TOLERANCE[dtype], what)
    if lse is not None:
        assert_lse_close(np.asarray(lse), ref_lse, 1e-5, f"{what} lse")


# --- torch.cuda.graph -----------------------------------------------------------------


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("case", list(CASES))
def test_torch_graph_replays_new_inputs(case, variant):
    torch = pytest.importorskip("torch")
    kernel, (batch, seqlen_q, seqlen_k, hq, hkv, d), dtype, split = CASES[case]
    _skip_unsupported(kernel, dtype)
    tdtype = getattr(torch, dtype)

    def inputs(seed):
        return [torch.from_numpy(x).to("cuda", tdtype) for x in random_qkv(batch, seqlen_q, seqlen_k, hq, hkv, d, "float32", seed=seed)]

    q, k, v = inputs(0)
    split = _needs_workspace(split)
    assert (cupy_gqa.workspace_size(q, k, v, kernel=kernel) > 0) == split, "the case's split assumption"
    lens = torch.full((batch,), seqlen_k, dtype=torch.int32, device="cuda") if variant == "seqlens_k" else None
    out = torch.full_like(q, float("nan")) if variant == "out" else None
    workspace = cupy_gqa.workspace(q, k, v, kernel=kernel) if variant == "workspace" else None
    assert (workspace is not None) == (variant == "workspace" and split)
    return_lse = variant == "return_lse"

    def call():
        return cupy_gqa.attention(q, k, v, kernel=kernel, out=out, return_lse=return_lse, seqlens_k=lens, workspace=workspace)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):  # compile, plan, and the repeat-call entry, outside the capture
            call()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    if variant == "first_call":
        _fast.clear()  # the capture runs the full path
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        res = call()
    res_out, res_lse = res if return_lse else (res, None)
    if out is not None:
        assert res_out is out
    for step in range(2):
        for t, new in zip((q, k, v), inputs(step + 1)):
            t.copy_(new)
        values = None
        if lens is not None:
            values = _lens_values(step, batch, seqlen_k)
            lens.copy_(torch.tensor(values, dtype=torch.int32))
        res_out.fill_(float("nan"))
        if res_lse is not None:
            res_lse.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        host = [t.float().cpu().numpy() for t in (q, k, v)]
        lse_host = None if res_lse is None else res_lse.cpu().numpy()
        _check(res_out.float().cpu().numpy(), lse_host, host, values, dtype, f"torch graph {case} {variant} replay {step}")


def test_torch_host_seqlens_k_is_refused_during_capture():
    torch = pytest.importorskip("torch")
    q, k, v = (torch.from_numpy(x).to("cuda", torch.bfloat16) for x in random_qkv(2, 1, 256, 8, 2, 64, "float32"))
    lens = torch.tensor([256, 100], dtype=torch.int32, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            cupy_gqa.attention(q, k, v, seqlens_k=[256, 100])
            cupy_gqa.attention(q, k, v, seqlens_k=lens)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        with pytest.raises(ValueError, match=r"seqlens_k: expected a CUDA int32 array while a CUDA graph is being captured"):
            cupy_gqa.attention(q, k, v, seqlens_k=[256, 100])
        out = cupy_gqa.attention(q, k, v, seqlens_k=lens)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    host = [t.float().cpu().numpy() for t in (q, k, v)]
    _check(out.float().cpu().numpy(), None, host, [256, 100], "bfloat16", "torch graph after a refused call")


# --- CuPy stream capture ------------------------------------------------------------------


@pytest.mark.parametrize("variant", ["out", "return_lse", "seqlens_k", "first_call"])
@pytest.mark.parametrize("case", list(CASES))
def test_cupy_graph_replays_new_inputs(case, variant):
    kernel, (batch, seqlen_q, seqlen_k, hq, hkv, d), dtype, split = CASES[case]
    _skip_unsupported(kernel, dtype)

    def inputs(seed):
        return random_qkv(batch, seqlen_q, seqlen_k, hq, hkv, d, dtype, seed=seed)

    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        q, k, v = (cupy.asarray(x) for x in inputs(0))
        out = cupy.full(q.shape, np.nan, dtype=q.dtype)
        lens = cupy.full((batch,), seqlen_k, dtype=cupy.int32) if variant == "seqlens_k" else None
        workspace = cupy_gqa.workspace(q, k, v, kernel=kernel, out=out)  # None where the call needs none
        assert (workspace is not None) == _needs_workspace(split)
        return_lse = variant == "return_lse"

        def call():
            return cupy_gqa.attention(q, k, v, kernel=kernel, out=out, return_lse=return_lse, seqlens_k=lens, workspace=workspace)

        for _ in range(2):  # compile, plan, and the repeat-call entry, outside the capture
            call()
        stream.synchronize()
        if variant == "first_call":
            _fast.clear()
        stream.begin_capture()
        try:
            res = call()
        finally:
            graph = stream.end_capture()
    res_out, res_lse = res if return_lse else (res, None)
    assert res_out is out
    for step in range(2):
        with stream:
            for a, new in zip((q, k, v), inputs(step + 1)):
                a[...] = cupy.asarray(new)
            values = None
            if lens is not None:
                values = _lens_values(step, batch, seqlen_k)
                lens[...] = cupy.asarray(values, dtype=cupy.int32)
            out.fill(np.nan)
            if res_lse is not None:
                res_lse.fill(np.nan)
        graph.launch(stream)
        stream.synchronize()
        host = [cupy.asnumpy(a) for a in (q, k, v)]
        lse_host = None if res_lse is None else cupy.asnumpy(res_lse)
        _check(cupy.asnumpy(out), lse_host, host, values, dtype, f"cupy graph {case} {variant} replay {step}")


# (batch, seqlen_q, seqlen_k, num_q_heads, num_kv_heads, head_dim), dtype, the fp16 pairs' bytes or None
REFUSED = {
    "split_decode": ((1, 1, 8192, 8, 1, 128), "bfloat16", None, "this call splits the keys"),
    # float32 "highest" on fp16 pairs: (batch, KV head) x 10 tiles of 32 keys
    "f32_pairs": ((2, 130, 300, 8, 2, 128), "float32", 2 * 2 * 10 * (4 * 32 * 128 * 2 + 12), "this float32 call"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_cupy_workspace_from_the_pool_is_refused_during_capture(case):
    """A workspace from CuPy's memory pool would go back to the pool while the
    graph still writes to it: inside a capture, a call that takes one (a split
    decode; float32 on fp16 pairs) needs workspace=."""
    shape, dtype, need, why = REFUSED[case]
    if dtype == "float32" and int(cupy.cuda.Device().compute_capability) < 80:
        pytest.skip("tensor-core kernels: compute capability 8.0 or newer")
    old = _plan.set_f32_highest("f16x2")
    try:
        q, k, v = (cupy.asarray(x) for x in random_qkv(*shape, dtype))
        out = cupy.empty_like(q)
        stream = cupy.cuda.Stream(non_blocking=True)
        with stream:
            for _ in range(2):
                cupy_gqa.attention(q, k, v, out=out)  # outside a capture the pool is fine
            stream.synchronize()
            workspace = cupy_gqa.workspace(q, k, v, out=out)
            assert workspace is not None and workspace.nbytes == cupy_gqa.workspace_size(q, k, v, out=out)
            assert need is None or workspace.nbytes == need
            stream.begin_capture()
            try:
                with pytest.raises(ValueError, match=rf"caller-owned buffer while a CUDA graph is being captured \({why}"):
                    cupy_gqa.attention(q, k, v, out=out)
                cupy_gqa.attention(q, k, v, out=out, workspace=workspace)
            finally:
                graph = stream.end_capture()
            out.fill(np.nan)
            graph.launch(stream)
            stream.synchronize()
        _check(cupy.asnumpy(out), None, [cupy.asnumpy(a) for a in (q, k, v)], None, dtype, f"cupy graph {case}")
    finally:
        _plan.set_f32_highest(old)


# --- the workspace's checks ------------------------------------------------------------------


def test_workspace_is_checked():
    q, k, v = (cupy.asarray(x) for x in random_qkv(1, 1, 8192, 8, 1, 128, "bfloat16"))
    need = cupy_gqa.workspace_size(q, k, v)
    assert need > 0
    with pytest.raises(TypeError, match=r"workspace: expected dtype float32, got float16"):
        cupy_gqa.attention(q, k, v, workspace=cupy.empty(need, cupy.float16))
    with pytest.raises(ValueError, match=rf"workspace: expected at least {need} bytes"):
        cupy_gqa.attention(q, k, v, workspace=cupy.empty(need // 4 - 1, cupy.float32))
    with pytest.raises(ValueError, match=r"workspace: expected a contiguous array"):
        cupy_gqa.attention(q, k, v, workspace=cupy.empty(need // 2, cupy.float32)[::2])
    with pytest.raises(ValueError, match=r"workspace: expected a 16-byte aligned address"):
        cupy_gqa.attention(q, k, v, workspace=cupy.empty(need // 4 + 4, cupy.float32)[1:])
    buf = cupy.empty(need // 4 + q.size, cupy.float32)  # out in its first bytes, seen as q's dtype
    with pytest.raises(ValueError, match=r"workspace: must not overlap the memory of out"):
        cupy_gqa.attention(q, k, v, out=buf.view(q.dtype)[: q.size].reshape(q.shape), workspace=buf[: need // 4])
    good = cupy.empty(need // 4, cupy.float32)
    for _ in range(2):  # the full path, then the repeat path of this signature
        cupy_gqa.attention(q, k, v, workspace=good)
    q_in = buf.view(q.dtype)[: q.size].reshape(q.shape)  # q's signature, inside the workspace below
    q_in[...] = q
    with pytest.raises(ValueError, match=r"workspace: must not overlap the memory of q"):
        cupy_gqa.attention(q_in, k, v, workspace=buf[: need // 4])
