"""float32 at precision="highest" through both schemes of the tiled kernel
(cupy_gqa/_specs.py: F32_PRODUCTS): split TF32 and fp16 pairs, against the
float64 reference, on inputs whose magnitudes test fp16's range: fp16 pairs
scale each tile by a power of two (kernels/tiled_f16x2.cu), split TF32 needs
none. The rest of the GPU suite runs either scheme through
CUPY_GQA_TEST_F32_PRODUCTS (tests/conftest.py)."""
import math

import numpy as np
import pytest

import cupy_gqa
from conftest import TOLERANCE, assert_close, assert_lse_close, gpu_available, random_qkv
from cupy_gqa import _plan, _specs
from reference import reference_attention

pytestmark = pytest.mark.gpu
if gpu_available():
    import cupy


@pytest.fixture(params=_specs.F32_PRODUCTS)
def products(request):
    old = _plan.set_f32_highest(request.param)
    yield request.param
    _plan.set_f32_highest(old)


def _inputs(case, head_dim):
    """(q, k, v) float32 of one case: 200 queries of 8 heads against 300 keys of 2."""
    q, k, v = random_qkv(2, 200, 300, 8, 2, head_dim, "float32", seed=head_dim)
    f32 = np.float32
    if case == "scores_of_30":
        return q * f32(math.sqrt(10)), k * f32(math.sqrt(10)), v
    if case == "tiny":  # under fp16's normal range: 1e-20 and 1e-30
        return q * f32(1e-20), k * f32(1e-20), v * f32(1e-30)
    if case == "huge":  # q and v over fp16's largest, 65504 (k under its range: scores as scores_of_30's)
        return q * f32(1e14), k * f32(1e-13), v * f32(1e30)
    if case == "outlier_key":  # the last key 2^20 times larger than the rest of its tile
        k = k.copy()
        k[:, -1] *= f32(2.0**20)
        return q, k, v
    if case == "v_grows":  # V by 2^30 from the first key to the last (O rescaled as it grows)
        return q, k, (v * (2.0 ** np.linspace(0, 30, 300, dtype=np.float32))[None, :, None, None]).astype(f32)
    if case == "v_shrinks":
        return q, k, (v * (2.0 ** np.linspace(0, -30, 300, dtype=np.float32))[None, :, None, None]).astype(f32)
    return q, k, v


@pytest.mark.parametrize("head_dim", [32, 64, 96, 128, 256])
@pytest.mark.parametrize("case", ["normal", "scores_of_30", "tiny", "huge", "outlier_key", "v_grows", "v_shrinks"])
@pytest.mark.parametrize("causal", [True, False])
def test_float32_highest_across_magnitudes(products, head_dim, case, causal):
    q, k, v = _inputs(case, head_dim)
    qd, kd, vd = (cupy.asarray(x) for x in (q, k, v))
    out = cupy.full(q.shape, np.nan, dtype=np.float32)
    _, lse = cupy_gqa.attention(qd, kd, vd, causal=causal, out=out, return_lse=True, kernel="tiled")
    ref, ref_lse = reference_attention(q, k, v, causal=causal)
    assert_close(cupy.asnumpy(out), ref, TOLERANCE["float32"], f"{products} {case}")
    assert_lse_close(cupy.asnumpy(lse), ref_lse, 1e-6, f"{products} {case} lse")


def test_float32_highest_runs_the_chosen_kernel(products):
    """The switch reaches the launch: the plan's kernel is the scheme's."""
    q, k, v = (cupy.asarray(x) for x in random_qkv(1, 64, 64, 4, 2, 128, "float32"))
    out = cupy.empty_like(q)
    problem = _plan.Problem.of(q, k, dtype="float32", causal=True, softmax_scale=128**-0.5)
    plan = _plan.tiled_plan_for(problem, q, k, v, out)
    arch = _plan.device_arch(q.device.id)
    expected = "tiled_f16x2.cu" if products == "f16x2" and _specs.tiled_f16x2_spec(128, True, arch) else "tiled_tf32.cu"
    assert plan.spec.source == expected
