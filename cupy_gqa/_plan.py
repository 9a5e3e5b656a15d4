"""Launch plans: which kernel runs a validated call, with what grid and arguments.

The public function (``api.attention``) validates and hands a :class:`Problem`
here; each ``launch_<family>`` picks the specialization from ``_specs``, sizes
the grid and passes element strides as 64-bit integers. The CUDA side is in
``kernels/<family>.cu``.
"""
from __future__ import annotations

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


def element_strides(a) -> tuple[np.int64, ...]:
    """Strides of a backend array in elements, as the int64 values the kernels take."""
    return tuple(np.int64(s // a.itemsize) for s in a.strides)


def grid_stride_blocks(total_threads: int, threads_per_block: int) -> int:
    """Blocks for a 1-D grid-stride loop over ``total_threads`` (no 65535-style limit).

    One thread per item when that fits in gridDim.x; beyond that the kernel's
    grid-stride loop covers the rest."""
    return max(1, min(math.ceil(total_threads / threads_per_block), MAX_GRID_X))


def scale_log2(problem: Problem):
    """softmax_scale * log2(e), in the accumulator's precision: the kernels use exp2."""
    acc = np.float64 if problem.dtype == "float64" else np.float32
    return acc(problem.softmax_scale * math.log2(math.e))


def _ptr_or_null(a):
    return a if a is not None else np.uint64(0)  # a null pointer argument


def launch_rowwise(problem: Problem, q, k, v, out, lse) -> None:
    unit_d = all(a.strides[3] == a.itemsize or a.shape[3] == 1 for a in (q, k, v, out))
    spec = _specs.rowwise_spec(problem.dtype, problem.head_dim, unit_d)
    total_threads = problem.batch * problem.num_q_heads * problem.seqlen_q * spec.team
    blocks = grid_stride_blocks(total_threads, spec.threads)
    i32 = np.int32
    get_kernel(spec)(
        (blocks,),
        (spec.threads,),
        (
            q, k, v, out, _ptr_or_null(lse),
            i32(problem.batch), i32(problem.seqlen_q), i32(problem.seqlen_k), i32(problem.num_kv_heads),
            i32(problem.group_size), i32(problem.head_dim), i32(problem.causal),
            *element_strides(q), *element_strides(k), *element_strides(v), *element_strides(out),
            scale_log2(problem), np.int64(total_threads),
        ),
    )  # fmt: skip


LAUNCH = {"rowwise": launch_rowwise}


def choose_kernel(problem: Problem, q, k, v, out) -> str:
    """The kernel ``kernel="auto"`` runs for this call."""
    return "rowwise"
