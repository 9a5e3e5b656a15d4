"""Shared test helpers: random inputs, the error measure, and the GPU marker."""
import functools
import importlib.util
import os

import ml_dtypes
import numpy as np
import pytest

# Relative error ||out - ref|| / ||ref|| against float64 that each dtype must meet.
TOLERANCE = {"float32": 2e-6, "float16": 2e-3, "bfloat16": 1.6e-2, "float64": 1e-12}
TF32_TOLERANCE = 2e-3  # precision="tf32" on the tiled kernel (one TF32 product)
NP_DTYPES = {
    "float32": np.dtype(np.float32),
    "float16": np.dtype(np.float16),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "float64": np.dtype(np.float64),
}


# CUPY_GQA_TEST_F16X2_TILES="128:128,32,8;64:64,16,4" runs the fp16 pairs
# (kernels/tiled_f16x2.cu) at these tiles, head_dim: BLOCK_M,BLOCK_N,NUM_WARPS, in
# place of their table's (cupy_gqa/_specs.py: TILED_F16X2_TILES).
if os.environ.get("CUPY_GQA_TEST_F16X2_TILES"):
    from cupy_gqa import _plan, _specs

    for item in os.environ["CUPY_GQA_TEST_F16X2_TILES"].split(";"):
        head_dim, tile = item.split(":")
        _specs.TILED_F16X2_TILES[int(head_dim)] = tuple(int(x) for x in tile.split(","))
    _specs.tiled_f16x2_spec.cache_clear()
    _specs.tiled_f32_spec.cache_clear()
    _specs.specs_for.cache_clear()
    _plan.set_f32_highest(_specs.F32_HIGHEST)  # (forgets the plans made with the table's tiles)
# CUPY_GQA_TEST_F32_PRODUCTS (one of cupy_gqa._specs.F32_PRODUCTS) runs the
# suite's float32 calls with precision="highest" on that scheme of the tiled
# kernel (split TF32 or fp16 pairs), where the calls take the other one.
if os.environ.get("CUPY_GQA_TEST_F32_PRODUCTS"):
    from cupy_gqa import _plan

    _plan.set_f32_highest(os.environ["CUPY_GQA_TEST_F32_PRODUCTS"])
# CUPY_GQA_TEST_BWD_SM90=mma runs the suite's 16-bit backward calls on sm_90 with
# the mma.sync dQ and dK/dV kernels in place of their own (cupy_gqa/_specs.py: BWD_SM90).
if os.environ.get("CUPY_GQA_TEST_BWD_SM90"):
    from cupy_gqa import _plan

    _plan.set_bwd_sm90(os.environ["CUPY_GQA_TEST_BWD_SM90"])


def dev_tool(name: str):
    """benchmarks/dev/<name>.py loaded as a module: for the tests that check a development
    tool against the kernels or the model it reads."""
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "dev", name + ".py")
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@functools.cache
def gpu_available() -> bool:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


def pytest_report_header(config):
    """Say at the start where the time goes: NVRTC compiles each kernel specialization once."""
    from cupy_gqa.__main__ import gpu_status

    name, reason = gpu_status()
    cache = os.environ.get("CUPY_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cupy", "kernel_cache")
    lines = []
    if gpu_available():
        lines.append(f"cupy_gqa: GPU tests run on {name or reason}")
        lines.append(
            "cupy_gqa: each kernel specialization compiles with NVRTC at its first use (about a second), "
            f"then loads from CuPy's cache {cache}; the first GPU tests of a fresh cache are the slow ones"
        )
    else:
        lines.append(f"cupy_gqa: GPU tests skip: {reason}")
    if importlib.util.find_spec("cupy") is not None:
        lines.append(
            "cupy_gqa: test_compile.py compiles every kernel specialization with NVRTC for sm_80 and sm_90 "
            "(no GPU needed; most of a CPU-only run's time)"
        )
    return lines


def pytest_collection_modifyitems(config, items):
    if gpu_available():
        return
    skip = pytest.mark.skip(reason="no CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


_durations: dict = {}  # setup and call times of the tests not yet torn down (CUPY_GQA_DURATION_LOG)


def pytest_runtest_logreport(report):
    """With CUPY_GQA_FAILURE_LOG set, each failure's report is appended to that file as it
    comes (with pytest-xdist, by the controller): a run stopped by a time limit keeps the
    tracebacks that pytest would only have printed at its end. With CUPY_GQA_DURATION_LOG,
    each test's time likewise."""
    path = os.environ.get("CUPY_GQA_FAILURE_LOG")
    if path and report.failed and "PYTEST_XDIST_WORKER" not in os.environ:
        with open(path, "a") as f:
            f.write(f"=== {report.nodeid} ({report.when})\n{report.longreprtext}\n\n")
    # CUPY_GQA_DURATION_LOG: each test's time (setup, call and teardown, seconds) as it ends, so
    # that a run stopped by its limit still says where the time went
    path = os.environ.get("CUPY_GQA_DURATION_LOG")
    if path and report.when == "teardown" and "PYTEST_XDIST_WORKER" not in os.environ:
        with open(path, "a") as f:
            f.write(f"{report.duration + _durations.pop(report.nodeid, 0.0):.3f} {report.nodeid}\n")
    elif path and "PYTEST_XDIST_WORKER" not in os.environ:
        _durations[report.nodeid] = _durations.get(report.nodeid, 0.0) + report.duration


def random_qkv(batch, seqlen_q, seqlen_k, num_q_heads, num_kv_heads, head_dim, dtype, seed=0, scale=1.0):
    """Random normal NumPy q, k, v (never zeros), rounded to ``dtype``."""
    rng = np.random.default_rng(seed)
    draw = lambda s: (rng.standard_normal(s) * scale).astype(NP_DTYPES[dtype])  # noqa: E731
    return (
        draw((batch, seqlen_q, num_q_heads, head_dim)),
        draw((batch, seqlen_k, num_kv_heads, head_dim)),
        draw((batch, seqlen_k, num_kv_heads, head_dim)),
    )


LAYOUTS = ("contiguous", "packed", "transposed", "strided_d")


def strided_view(layout, rng, dtype, batch, seqlen, heads, head_dim, to_array=lambda x: x):
    """A random (batch, seqlen, heads, head_dim) view in one of LAYOUTS: contiguous,
    a head slice of a packed tensor, a (batch, heads, seqlen, dim) tensor seen
    through a transpose, or every other element of a wider head_dim axis. The
    storage is made by ``to_array`` (NumPy by default; cupy.asarray for the GPU)."""
    draw = lambda shape: to_array(rng.standard_normal(shape).astype(NP_DTYPES[dtype]))  # noqa: E731
    if layout == "transposed":
        return draw((batch, heads, seqlen, head_dim)).transpose(0, 2, 1, 3)
    if layout == "strided_d":
        return draw((batch, seqlen, heads, 2 * head_dim))[..., 1::2]
    if layout == "packed":
        return draw((batch, seqlen, heads + 1, head_dim))[:, :, 1:]
    return draw((batch, seqlen, heads, head_dim))


def relative_error(out, ref, norm=None) -> float:
    """||out - ref|| / ||ref||, or / ``norm`` when given."""
    out = np.asarray(out).astype(np.float64)
    denom = np.linalg.norm(ref) if norm is None else norm
    return float(np.linalg.norm(out - ref) / (denom if denom > 0 else 1.0))


def assert_close(out, ref, tol, what="", norm=None):
    """Relative error within tol and no NaN; on failure say where and how much.

    ``norm`` replaces ||ref|| as the scale of the error."""
    out = np.asarray(out).astype(np.float64)
    assert out.shape == ref.shape, f"{what}: shape {out.shape} != {ref.shape}"
    bad = np.isnan(out) & ~np.isnan(ref)
    if bad.any():
        idx = tuple(int(i) for i in np.argwhere(bad)[0])
        raise AssertionError(f"{what}: {int(bad.sum())} NaN elements (unwritten?), first at {idx}")
    err = relative_error(out, ref, norm)
    if not err <= tol:
        diff = np.abs(out - ref)
        idx = tuple(int(i) for i in np.unravel_index(np.argmax(diff), diff.shape))
        raise AssertionError(
            f"{what}: relative error {err:.3e} > {tol:.1e}; worst element {idx}: got {out[idx]!r}, want {ref[idx]!r}"
        )


def assert_lse_close(lse, ref_lse, tol=1e-5, what="lse"):
    lse = np.asarray(lse).astype(np.float64)
    masked = np.isneginf(ref_lse)
    assert np.array_equal(np.isneginf(lse), masked), f"{what}: -inf pattern differs from the reference"
    if (~masked).any():
        # relative to the largest |lse|: a score's rounding error scales with |q| |k|, not with itself
        err = np.max(np.abs(lse[~masked] - ref_lse[~masked])) / max(1.0, np.max(np.abs(ref_lse[~masked])))
        assert err <= tol, f"{what}: max error {err:.3e} > {tol:.1e}"
