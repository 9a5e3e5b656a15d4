"""Property-based fuzzing of every CUDA kernel family against the NumPy backend.

Random shapes, group sizes, dtypes, layouts (packed, transposed, strided
head_dim), masks and scales, 300 examples per kernel family. A kernel may
refuse a call with ValueError ("does not support"); otherwise its result must
match the NumPy backend (which tests/test_fuzz_cpu.py checks against the
float64 definition) and every output element must be written.
"""
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cupy_gqa
from conftest import LAYOUTS, NP_DTYPES, TOLERANCE, assert_close, gpu_available, strided_view

pytestmark = pytest.mark.gpu
if gpu_available():
    import cupy


@st.composite
def calls(draw):
    num_kv_heads = draw(st.integers(1, 3))
    return dict(
        batch=draw(st.integers(1, 3)),
        seqlen_q=draw(st.integers(1, 300)),
        seqlen_k=draw(st.integers(1, 300)),
        num_kv_heads=num_kv_heads,
        num_q_heads=num_kv_heads * draw(st.integers(1, 8)),
        head_dim=draw(st.sampled_from([1, 8, 24, 32, 40, 64, 72, 96, 128, 200, 256])),
        dtype=draw(st.sampled_from(list(NP_DTYPES))),
        layout=draw(st.sampled_from(LAYOUTS)),
        causal=draw(st.booleans()),
        scale=draw(st.one_of(st.none(), st.floats(-1.0, 1.0, allow_nan=False))),
        seed=draw(st.integers(0, 2**32 - 1)),
    )


@pytest.mark.parametrize("kernel", cupy_gqa.KERNELS)
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(c=calls())
def test_kernel_matches_numpy_backend(kernel, c):
    rng = np.random.default_rng(c["seed"])
    q = strided_view(c["layout"], rng, c["dtype"], c["batch"], c["seqlen_q"], c["num_q_heads"], c["head_dim"], to_array=cupy.asarray)
    k = strided_view(c["layout"], rng, c["dtype"], c["batch"], c["seqlen_k"], c["num_kv_heads"], c["head_dim"], to_array=cupy.asarray)
    v = strided_view(c["layout"], rng, c["dtype"], c["batch"], c["seqlen_k"], c["num_kv_heads"], c["head_dim"], to_array=cupy.asarray)
    out = cupy.full(q.shape, np.nan, dtype=q.dtype)
    try:
        cupy_gqa.attention(q, k, v, causal=c["causal"], softmax_scale=c["scale"], out=out, kernel=kernel)
    except ValueError as e:
        assert "does not support this call" in str(e)
        return
    host = [cupy.asnumpy(x) for x in (q, k, v)]
    expected = cupy_gqa.attention(*host, causal=c["causal"], softmax_scale=c["scale"]).astype(np.float64)
    assert_close(cupy.asnumpy(out), expected, 2 * TOLERANCE[c["dtype"]], f"{kernel} {c}")
