"""Launch plans (cupy_gqa/_plan.py) and the specialization table, as pure functions."""
import numpy as np
import pytest

from cupy_gqa import _plan, _specs


@pytest.mark.parametrize("total", [1, 127, 128, 129, 10**6, 2**31 * 128, 10**13])
def test_grid_stride_blocks(total):
    blocks = _plan.grid_stride_blocks(total, 128)
    assert 1 <= blocks <= 2**31 - 1  # gridDim.x limit; no 65535-style cap
    if total <= (2**31 - 1) * 128:
        assert blocks * 128 >= total and (blocks - 1) * 128 < total  # one thread per item
    else:
        assert blocks == 2**31 - 1  # the kernel's grid-stride loop covers the rest


def test_element_strides_are_int64_beyond_2_31():
    # a (2, 2**20 + 1, 8, 128) fp16 tensor has 2**31 + 2048 elements: the batch
    # stride alone is over 2**30 elements and its last element sits beyond 2**31
    shape = (2, 2**20 + 1, 8, 128)
    contiguous = tuple(int(np.prod(shape[i + 1 :])) * 2 for i in range(4))
    strides = _plan.element_strides(contiguous, 2)
    assert all(isinstance(s, np.int64) for s in strides)
    last = sum((n - 1) * s for n, s in zip(shape, strides))
    assert last == 2 * (2**20 + 1) * 8 * 128 - 1 > 2**31
    assert last.dtype == np.int64  # no wrap-around on the way


def test_scale_log2_precision():
    p32 = _plan.Problem(1, 1, 1, 1, 1, 64, "bfloat16", True, 0.125)
    p64 = _plan.Problem(1, 1, 1, 1, 1, 64, "float64", True, 0.125)
    assert isinstance(_plan.scale_log2(p32), np.float32)
    assert isinstance(_plan.scale_log2(p64), np.float64)
    assert _plan.scale_log2(p64) == pytest.approx(0.125 / np.log(2), rel=1e-15)


@pytest.mark.parametrize("head_dim", range(1, 257))
@pytest.mark.parametrize("unit_d", [True, False])
def test_every_head_dim_has_a_rowwise_specialization(head_dim, unit_d):
    for dtype in _specs.DTYPES:
        spec = _specs.rowwise_spec(dtype, head_dim, unit_d)
        assert spec.head_dim >= head_dim and spec.dtype == dtype and spec in _specs.SPECS
        assert spec.head_dim % spec.team == 0 and spec.team <= 32


def test_spec_names_are_unique():
    names = [s.name for s in _specs.SPECS]
    assert len(names) == len(set(names))


def test_rowwise_plan_passes_64_bit_strides_and_counts():
    problem = _plan.Problem(2, 2**20 + 1, 16, 8, 2, 128, "float16", False, 0.1)
    contiguous = ((2**20 + 1) * 8 * 128 * 2, 8 * 128 * 2, 128 * 2, 2)
    kv = (16 * 2 * 128 * 2, 2 * 128 * 2, 128 * 2, 2)
    launch = _plan.plan_rowwise(problem, ((contiguous, 2), (kv, 2), (kv, 2), (contiguous, 2)))
    assert launch.spec.name == "rowwise_attention<__half, 128, 4, true>"
    strides, total_threads = launch.scalars[7:23], launch.scalars[-1]
    assert all(isinstance(s, np.int64) for s in strides) and strides[0] == (2**20 + 1) * 8 * 128
    assert isinstance(total_threads, np.int64) and total_threads == 2 * 8 * (2**20 + 1) * 4
    assert launch.grid == (_plan.grid_stride_blocks(int(total_threads), 128),)
