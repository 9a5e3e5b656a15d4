"""Launch plans: which kernel runs a validated call, with what grid and arguments.

The public function (``api.attention``) validates and hands a :class:`Problem`
here; each ``launch_<family>`` picks the specialization from ``_specs``, sizes
the grid and passes element strides as 64-bit integers. The CUDA side is in
``kernels/<family>.cu``.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
from cupy.cuda import function as cupy_function

from . import _specs
from ._compile import get_kernel

MAX_GRID_X = 2**31 - 1  # CUDA's limit on gridDim.x


@dataclass(frozen=True)
class Problem:
    batch: int
    seqlen_q: int
    seqlen_k: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    causal: bool
    softmax_scale: float
    precision: str = "highest"  # float32 only ("highest" or "tf32"); "highest" for other dtypes

    @property
    def group_size(self) -> int:
        return self.num_q_heads // self.num_kv_heads

    @classmethod
    def of(cls, q, k, *, dtype: str, causal: bool, softmax_scale: float, precision: str = "highest") -> "Problem":
        batch, seqlen_q, num_q_heads, head_dim = q.shape
        precision = precision if dtype == "float32" else "highest"  # it only means something for float32
        return cls(batch, seqlen_q, k.shape[1], num_q_heads, k.shape[2], head_dim, dtype, causal, softmax_scale, precision)


def element_strides(strides: tuple, itemsize: int) -> tuple[np.int64, ...]:
    """Byte strides in elements, as the int64 values the kernels take."""
    return tuple(np.int64(s // itemsize) for s in strides)


def grid_stride_blocks(total_threads: int, threads_per_block: int) -> int:
    """Blocks for a 1-D grid-stride loop over ``total_threads`` (no 65535-style limit).

    One thread per item when that fits in gridDim.x; beyond that the kernel's
    grid-stride loop covers the rest."""
    return max(1, min(math.ceil(total_threads / threads_per_block), MAX_GRID_X))


# The kernels' one parameter struct, field by field (kernels/common.cuh: AttnParams).
PARAMS_DTYPE = np.dtype(
    [
        ("q_stride", np.int64, 4), ("k_stride", np.int64, 4), ("v_stride", np.int64, 4), ("o_stride", np.int64, 4),
        ("total_threads", np.int64), ("scale_log2", np.float64),
        ("batch", np.int32), ("seqlen_q", np.int32), ("seqlen_k", np.int32), ("num_q_heads", np.int32),
        ("num_kv_heads", np.int32), ("group_size", np.int32), ("head_dim", np.int32), ("causal", np.int32),
    ],
    align=True,
)  # fmt: skip


def make_params(problem: Problem, layout: tuple, total_threads: int = 0) -> np.ndarray:
    """The AttnParams struct as a 1-element NumPy array, which CuPy passes by value."""
    params = np.zeros(1, PARAMS_DTYPE)
    for field, (_, strides, itemsize) in zip(("q_stride", "k_stride", "v_stride", "o_stride"), layout):
        params[field] = element_strides(strides, itemsize)
    params["total_threads"] = total_threads
    params["scale_log2"] = problem.softmax_scale * math.log2(math.e)
    for field in ("batch", "seqlen_q", "seqlen_k", "num_q_heads", "num_kv_heads", "group_size", "head_dim", "causal"):
        params[field] = getattr(problem, field)
    return params


# CuPy passes a 1-element NumPy array by value, reading its address through
# __array_interface__ at every launch, which for a structured dtype costs
# several microseconds; CuPy's own wrapper for that argument, made once per
# launch plan, skips it. (Older CuPy without it: the array itself.)
_by_value = getattr(cupy_function, "CNumpyArray", lambda array: array)


@dataclass(frozen=True, eq=False)
class Launch:
    """Everything about a launch except the array arguments."""

    spec: _specs.Spec
    grid: tuple
    params: np.ndarray  # PARAMS_DTYPE, shape (1,)

    def __post_init__(self):
        object.__setattr__(self, "_params_arg", _by_value(self.params))

    def __call__(self, q, k, v, out, lse, seqlens_k=None) -> None:
        # lse and seqlens_k None are passed as null pointers
        get_kernel(self.spec)(
            self.grid, (self.spec.threads,), (q, k, v, out, lse, seqlens_k, self._params_arg), shared_mem=self.spec.smem
        )


def _layout(*arrays) -> tuple:
    """What a launch plan depends on in the arrays (q, k, v, out), as a cache key."""
    return tuple((a.shape, a.strides, a.itemsize) for a in arrays)


@functools.lru_cache(maxsize=4096)
def _layout_issue(layout: tuple) -> str | None:
    """Why rows of these arrays can't be read as 16-byte vectors (pointers aside), or None."""
    for name, (shape, strides, itemsize) in zip(("q", "k", "v", "out"), layout):
        if shape[3] > 1 and strides[3] != itemsize:
            return f"{name} has head_dim stride {strides[3] // itemsize} (it needs 1)"
        if any(n > 1 and st % 16 for n, st in zip(shape[:3], strides[:3])):
            return f"{name} has strides {strides} bytes (it needs multiples of 16 bytes)"
    return None


def _vector_issue(layout: tuple, arrays) -> str | None:
    """Why (q, k, v, out) can't be read as 16-byte vectors, or None."""
    issue = _layout_issue(layout)
    if issue is None:
        for name, a in zip(("q", "k", "v", "out"), arrays):
            if a.data.ptr % 16:
                return f"{name} is not 16-byte aligned"
    return issue


def rowwise_blocks(problem: Problem, team: int) -> int:
    """Blocks of kernels/rowwise.cu: each holds hb heads of one KV head's group
    at tb positions (hb * tb <= 128 / team rows), for one (batch, kv_head)."""
    rows = _specs.ROWWISE_THREADS // team
    hb = min(problem.group_size, rows)
    tb = rows // hb
    return math.ceil(problem.seqlen_q / tb) * problem.batch * problem.num_kv_heads * math.ceil(problem.group_size / hb)


@functools.lru_cache(maxsize=4096)
def plan_rowwise(problem: Problem, layout: tuple, vec: bool) -> Launch:
    spec = _specs.rowwise_spec(problem.dtype, problem.head_dim, vec)
    blocks = rowwise_blocks(problem, spec.team)
    total_threads = blocks * spec.threads
    return Launch(spec, (grid_stride_blocks(total_threads, spec.threads),), make_params(problem, layout, total_threads))


def launch_rowwise(problem: Problem, q, k, v, out, lse, seqlens_k=None) -> None:
    layout = _layout(q, k, v, out)
    vec = problem.head_dim % _specs.vec_width(problem.dtype) == 0 and _vector_issue(layout, (q, k, v, out)) is None
    plan_rowwise(problem, layout, vec)(q, k, v, out, lse, seqlens_k)


def tiled_unsupported(problem: Problem, q, k, v, out) -> str | None:
    """Why the tiled kernels (kernels/tiled.cu, tiled_tf32.cu) cannot run this call, or None if they can."""
    head_dims = _specs.tiled_head_dims(problem.dtype)
    if not head_dims:
        return f"dtype {problem.dtype} (it takes {', '.join(_specs.TILED_DTYPES + ('float32',))})"
    if problem.head_dim not in head_dims:
        return f"head_dim {problem.head_dim} (it takes {', '.join(map(str, head_dims))} in {problem.dtype})"
    if not problem.softmax_scale > 0:
        return f"softmax_scale {problem.softmax_scale} (it takes positive scales)"
    if problem.seqlen_q * problem.group_size >= 2**31:  # packed rows are 32-bit in the kernel
        return f"seqlen_q * group_size = {problem.seqlen_q * problem.group_size} (it takes < 2**31)"
    return _vector_issue(_layout(q, k, v, out), (q, k, v, out))


@functools.lru_cache(maxsize=4096)
def plan_tiled(problem: Problem, layout: tuple) -> Launch:
    if problem.dtype == "float32":
        spec = _specs.TILED_F32[problem.head_dim, problem.causal, problem.precision]
    else:
        spec = _specs.TILED[problem.dtype, problem.head_dim, problem.causal]
    num_m_tiles = math.ceil(problem.seqlen_q * problem.group_size / spec.block_m)
    blocks = num_m_tiles * problem.batch * problem.num_kv_heads
    if blocks > MAX_GRID_X:
        raise ValueError(f"q: too many query rows for one launch ({blocks} blocks > {MAX_GRID_X})")
    return Launch(spec, (blocks,), make_params(problem, layout))


def launch_tiled(problem: Problem, q, k, v, out, lse, seqlens_k=None) -> None:
    reason = tiled_unsupported(problem, q, k, v, out)
    if reason is not None:
        raise ValueError(f"kernel: 'tiled' does not support this call: {reason}; use kernel='auto' or 'rowwise'")
    plan_tiled(problem, _layout(q, k, v, out))(q, k, v, out, lse, seqlens_k)


# The GPU kernel families, in the order the public ``kernel=`` lists them.
LAUNCH = {"rowwise": launch_rowwise, "tiled": launch_tiled}


def choose_kernel(problem: Problem, q, k, v, out) -> str:
    """The kernel ``kernel="auto"`` runs for this call: the tensor-core kernel
    whenever it supports the call, else the rowwise kernel, which runs anything."""
    return "tiled" if tiled_unsupported(problem, q, k, v, out) is None else "rowwise"
