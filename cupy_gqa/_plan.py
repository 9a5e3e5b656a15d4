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

    @property
    def group_size(self) -> int:
        return self.num_q_heads // self.num_kv_heads

    @classmethod
    def of(cls, q, k, *, dtype: str, causal: bool, softmax_scale: float) -> "Problem":
        batch, seqlen_q, num_q_heads, head_dim = q.shape
        return cls(batch, seqlen_q, k.shape[1], num_q_heads, k.shape[2], head_dim, dtype, causal, softmax_scale)


def element_strides(strides: tuple, itemsize: int) -> tuple[np.int64, ...]:
    """Byte strides in elements, as the int64 values the kernels take."""
    return tuple(np.int64(s // itemsize) for s in strides)


def grid_stride_blocks(total_threads: int, threads_per_block: int) -> int:
    """Blocks for a 1-D grid-stride loop over ``total_threads`` (no 65535-style limit).

    One thread per item when that fits in gridDim.x; beyond that the kernel's
    grid-stride loop covers the rest."""
    return max(1, min(math.ceil(total_threads / threads_per_block), MAX_GRID_X))


def scale_log2(problem: Problem):
    """softmax_scale * log2(e), in the accumulator's precision: the kernels use exp2."""
    acc = np.float64 if problem.dtype == "float64" else np.float32
    return acc(problem.softmax_scale * math.log2(math.e))


@dataclass(frozen=True)
class Launch:
    """Everything about a launch except the five array arguments."""

    spec: _specs.Spec
    grid: tuple
    block: tuple
    scalars: tuple  # the kernel's arguments after (q, k, v, out, lse)

    def __call__(self, q, k, v, out, lse) -> None:
        lse_arg = lse if lse is not None else np.uint64(0)  # a null pointer
        get_kernel(self.spec)(self.grid, self.block, (q, k, v, out, lse_arg, *self.scalars), shared_mem=self.spec.smem)


def _layout(*arrays) -> tuple:
    """The part of the arrays a launch plan depends on, as a cache key."""
    return tuple((a.strides, a.itemsize) for a in arrays)


@functools.lru_cache(maxsize=4096)
def plan_rowwise(problem: Problem, layout: tuple) -> Launch:
    (q_st, isz), (k_st, _), (v_st, _), (o_st, _) = layout
    unit_d = all(st[3] == isz for st in (q_st, k_st, v_st, o_st)) or problem.head_dim == 1
    spec = _specs.rowwise_spec(problem.dtype, problem.head_dim, unit_d)
    total_threads = problem.batch * problem.num_q_heads * problem.seqlen_q * spec.team
    i32 = np.int32
    scalars = (
        i32(problem.batch), i32(problem.seqlen_q), i32(problem.seqlen_k), i32(problem.num_kv_heads),
        i32(problem.group_size), i32(problem.head_dim), i32(problem.causal),
        *(s for st in (q_st, k_st, v_st, o_st) for s in element_strides(st, isz)),
        scale_log2(problem), np.int64(total_threads),
    )  # fmt: skip
    return Launch(spec, (grid_stride_blocks(total_threads, spec.threads),), (spec.threads,), scalars)


def launch_rowwise(problem: Problem, q, k, v, out, lse) -> None:
    plan_rowwise(problem, _layout(q, k, v, out))(q, k, v, out, lse)


def tiled_unsupported(problem: Problem, q, k, v, out) -> str | None:
    """Why kernels/tiled.cu cannot run this call, or None if it can."""
    if problem.dtype not in _specs.TILED_DTYPES:
        return f"dtype {problem.dtype} (it takes {', '.join(_specs.TILED_DTYPES)})"
    if problem.head_dim not in _specs.TILED_TILES:
        return f"head_dim {problem.head_dim} (it takes {', '.join(map(str, _specs.TILED_TILES))})"
    if not problem.softmax_scale > 0:
        return f"softmax_scale {problem.softmax_scale} (it takes positive scales)"
    for name, a in (("q", q), ("k", k), ("v", v), ("out", out)):
        if a.strides[3] != a.itemsize:
            return f"{name} has head_dim stride {a.strides[3] // a.itemsize} (it needs 1)"
        if any(n > 1 and st % (8 * a.itemsize) for n, st in zip(a.shape[:3], a.strides[:3])):
            return f"{name} has strides {a.strides} bytes (it needs multiples of 16 bytes)"
        if _data_ptr(a) % 16:
            return f"{name} is not 16-byte aligned"
    return None


def _data_ptr(a) -> int:
    return a.data.ptr


@functools.lru_cache(maxsize=4096)
def plan_tiled(problem: Problem, layout: tuple) -> Launch:
    spec = _specs.TILED[problem.dtype, problem.head_dim, problem.causal]
    num_m_tiles = math.ceil(problem.seqlen_q * problem.group_size / spec.block_m)
    blocks = num_m_tiles * problem.batch * problem.num_kv_heads
    if blocks > MAX_GRID_X:
        raise ValueError(f"q: too many query rows for one launch ({blocks} blocks > {MAX_GRID_X})")
    i32 = np.int32
    scalars = (
        i32(problem.batch), i32(problem.seqlen_q), i32(problem.seqlen_k),
        i32(problem.num_q_heads), i32(problem.num_kv_heads),
        *(s for st, isz in layout for s in element_strides(st[:3], isz)),
        np.float32(scale_log2(problem)),
    )  # fmt: skip
    return Launch(spec, (blocks,), (spec.threads,), scalars)


def launch_tiled(problem: Problem, q, k, v, out, lse) -> None:
    reason = tiled_unsupported(problem, q, k, v, out)
    if reason is not None:
        raise ValueError(f"kernel: 'tiled' does not support this call: {reason}; use kernel='auto' or 'rowwise'")
    plan_tiled(problem, _layout(q, k, v, out))(q, k, v, out, lse)


# The GPU kernel families, in the order the public ``kernel=`` lists them.
LAUNCH = {"rowwise": launch_rowwise, "tiled": launch_tiled}


def choose_kernel(problem: Problem, q, k, v, out) -> str:
    """The kernel ``kernel="auto"`` runs for this call: the tensor-core kernel
    whenever it supports the call, else the rowwise kernel, which runs anything."""
    return "tiled" if tiled_unsupported(problem, q, k, v, out) is None else "rowwise"
