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
# launch plan, skips it. (Older CuPy without it: the array itself.) CuPy is
# imported at the first plan, so that the NumPy backend runs without it; with
# no CuPy at all, plans can still be made (tests), just not launched.
@functools.cache
def _by_value_wrapper():
    try:
        from cupy.cuda import function as cupy_function
    except ImportError:
        cupy_function = None
    return getattr(cupy_function, "CNumpyArray", lambda array: array)


def _by_value(array):
    return _by_value_wrapper()(array)


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
    """``vec``: the cp.async variant (rows read as 16-byte vectors, sm_80 and newer)."""
    spec = _specs.rowwise_spec(problem.dtype, problem.head_dim, vec)
    blocks = rowwise_blocks(problem, spec.team)
    total_threads = blocks * spec.threads
    return Launch(spec, (grid_stride_blocks(total_threads, spec.threads),), make_params(problem, layout, total_threads))


def launch_rowwise(problem: Problem, q, k, v, out, lse, seqlens_k=None, *, checked: bool = False) -> None:
    # rowwise runs every call: nothing to check (checked is the common launch signature)
    layout = _layout(q, k, v, out)
    vec = (
        problem.head_dim % _specs.vec_width(problem.dtype) == 0
        and device_arch(q.device.id).sm80
        and _vector_issue(layout, (q, k, v, out)) is None
    )
    plan_rowwise(problem, layout, vec)(q, k, v, out, lse, seqlens_k)


def tiled_unsupported(problem: Problem, q, k, v, out) -> str | None:
    """Why the tiled kernels (kernels/tiled.cu, tiled_tf32.cu) cannot run this call, or None if they can."""
    head_dims = _specs.tiled_head_dims(problem.dtype)
    if not head_dims:
        return f"dtype {problem.dtype} (it takes {', '.join(_specs.TILED_DTYPES + ('float32',))})"
    if problem.head_dim not in head_dims:
        return f"head_dim {problem.head_dim} (it takes {', '.join(map(str, head_dims))} in {problem.dtype})"
    issue = _scale_issue(problem)
    if issue is None:
        arch = device_arch(q.device.id)
        if _specs.tiled_any_spec(problem.dtype, problem.head_dim, problem.causal, problem.precision, arch) is None:
            issue = _arch_issue(q.device.id, arch)
    return issue or _vector_issue(_layout(q, k, v, out), (q, k, v, out))


def _prefill_launch(problem: Problem, layout: tuple, spec: _specs.Spec) -> Launch:
    """The 1-D grid of the prefill kernels (tiled, tiled_tf32, hopper): one CTA per
    block_m packed rows (seqlen_q * group_size of them) of each (batch, KV head)."""
    num_m_tiles = math.ceil(problem.seqlen_q * problem.group_size / spec.block_m)
    blocks = num_m_tiles * problem.batch * problem.num_kv_heads
    if blocks > MAX_GRID_X:
        raise ValueError(f"q: too many query rows for one launch ({blocks} blocks > {MAX_GRID_X})")
    return Launch(spec, (blocks,), make_params(problem, layout))


@functools.lru_cache(maxsize=4096)
def plan_tiled(problem: Problem, layout: tuple, arch: _specs.Arch) -> Launch:
    spec = _specs.tiled_any_spec(problem.dtype, problem.head_dim, problem.causal, problem.precision, arch)
    return _prefill_launch(problem, layout, spec)


def launch_tiled(problem: Problem, q, k, v, out, lse, seqlens_k=None, *, checked: bool = False) -> None:
    """``checked``: choose_kernel has already found that tiled_unsupported is None."""
    reason = None if checked else tiled_unsupported(problem, q, k, v, out)
    if reason is not None:
        raise ValueError(f"kernel: 'tiled' does not support this call: {reason}; use kernel='auto' or 'rowwise'")
    plan_tiled(problem, _layout(q, k, v, out), device_arch(q.device.id))(q, k, v, out, lse, seqlens_k)


@functools.lru_cache(maxsize=64)
def compute_capability(device: int) -> tuple[int, int]:
    """(major, minor) of CUDA device ``device``."""
    import cupy

    cc = cupy.cuda.Device(device).compute_capability  # e.g. "90"
    return int(cc[:-1]), int(cc[-1])


def device_arch(device: int) -> _specs.Arch:
    """The architecture family (_specs.ARCHS) whose kernel table serves ``device``."""
    return _specs.arch_of(*compute_capability(device))


def _arch_issue(device: int, arch: _specs.Arch) -> str:
    """Why a kernel family that has no specialization for ``arch`` can't run there."""
    major, minor = compute_capability(device)
    if not arch.sm80:
        return f"a device of compute capability {major}.{minor} (it needs 8.0 or newer: cp.async and mma.sync)"
    return (
        f"a device of compute capability {major}.{minor}, whose blocks take at most {arch.smem} bytes of "
        f"shared memory (no tile of it fits)"
    )


def _scale_issue(problem: Problem) -> str | None:
    """The tensor-core kernels scale scores in float32 and take the row max
    before scaling, so they need a float32 scale * log2(e) that is positive."""
    if not np.float32(problem.softmax_scale * math.log2(math.e)) > 0:
        return f"softmax_scale {problem.softmax_scale} (it takes scales whose float32 scale * log2(e) is positive)"
    if problem.seqlen_q * problem.group_size >= 2**31:  # packed rows are 32-bit in the kernels
        return f"seqlen_q * group_size = {problem.seqlen_q * problem.group_size} (it takes < 2**31)"
    return None


def hopper_unsupported(problem: Problem, q, k, v, out) -> str | None:
    """Why kernels/hopper.cu cannot run this call, or None if it can."""
    if problem.dtype not in _specs.HOPPER_DTYPES:
        return f"dtype {problem.dtype} (it takes {', '.join(_specs.HOPPER_DTYPES)})"
    if problem.head_dim % 8:
        return f"head_dim {problem.head_dim} (it takes multiples of 8 up to {_specs.MAX_HEAD_DIM})"
    if _specs.hopper_spec(problem.dtype, problem.head_dim, problem.causal, device_arch(q.device.id)) is None:
        cc = compute_capability(q.device.id)  # the one table rule: hopper kernels are sm_90's alone
        return f"a device of compute capability {cc[0]}.{cc[1]} (it runs on 9.0, Hopper)"
    return _scale_issue(problem) or _vector_issue(_layout(q, k, v, out), (q, k, v, out))


@functools.lru_cache(maxsize=4096)
def plan_hopper(problem: Problem, layout: tuple) -> Launch:
    spec = _specs.HOPPER[problem.dtype, _specs.hopper_head_dim_pad(problem.head_dim), problem.causal]
    return _prefill_launch(problem, layout, spec)


def launch_hopper(problem: Problem, q, k, v, out, lse, seqlens_k=None, *, checked: bool = False) -> None:
    """``checked``: choose_kernel has already found that hopper_unsupported is None."""
    reason = None if checked else hopper_unsupported(problem, q, k, v, out)
    if reason is not None:
        raise ValueError(f"kernel: 'hopper' does not support this call: {reason}; use kernel='auto', 'tiled' or 'rowwise'")
    plan_hopper(problem, _layout(q, k, v, out))(q, k, v, out, lse, seqlens_k)


def decode_unsupported(problem: Problem, q, k, v, out) -> str | None:
    """Why kernels/decode.cu cannot run this call, or None if it can."""
    if problem.dtype not in _specs.DECODE_DTYPES:
        return f"dtype {problem.dtype} (it takes {', '.join(_specs.DECODE_DTYPES)})"
    if problem.head_dim not in _specs.DECODE_HEAD_DIMS:
        return f"head_dim {problem.head_dim} (it takes {', '.join(map(str, _specs.DECODE_HEAD_DIMS))})"
    if problem.seqlen_q > _specs.DECODE_MAX_SEQLEN_Q:
        return f"seqlen_q {problem.seqlen_q} (it takes 1 to {_specs.DECODE_MAX_SEQLEN_Q} query tokens)"
    arch = device_arch(q.device.id)
    if _specs.decode_spec(problem.dtype, problem.head_dim, problem.seqlen_q * problem.group_size, arch) is None:
        return _arch_issue(q.device.id, arch)
    return _vector_issue(_layout(q, k, v, out), (q, k, v, out))


DECODE_MAX_SPLITS = 64  # key ranges per (batch, KV head, row block)
DECODE_MIN_SPLIT_KEYS = 256  # no key range shorter than this


def decode_num_splits(problem: Problem, row_blocks: int, slots: int) -> int:
    """Key ranges per (batch, KV head, row block): enough CTAs to fill the
    ``slots`` (SMs x resident CTAs each) in whole waves, and no more.

    Among 1 .. max splits, the fewest whose wave efficiency
    n / (slots * ceil(n / slots)), n = CTAs, is within 10% of the best. The
    CTAs of a call all take about as long, so a partial last wave costs a
    whole one (H200, benchmarks/NOTES_decode.md: D1 with 396 slots runs 0.18 ms
    at 3 splits, 384 CTAs, and 0.23 ms at 4, 512 CTAs)."""
    base = problem.batch * problem.num_kv_heads * row_blocks
    most = max(1, min(DECODE_MAX_SPLITS, problem.seqlen_k // DECODE_MIN_SPLIT_KEYS))
    eff = [n / (slots * math.ceil(n / slots)) for n in (base * s for s in range(1, most + 1))]
    best = max(eff)
    return next(s for s, e in enumerate(eff, 1) if e >= 0.9 * best)


@dataclass(frozen=True, eq=False)
class DecodeLaunch:
    """The split-KV decode kernel and, with num_splits > 1, its combine kernel.

    Workspace (num_splits > 1): one float32 buffer from CuPy's memory pool on
    the current stream, packed_rows * num_splits * (head_dim + 1) values
    (packed_rows = batch * num_q_heads * seqlen_q): the partial outputs and
    their lse. It returns to the pool when the call returns; the pool is
    stream-ordered, so no synchronisation is needed."""

    spec: _specs.Spec
    combine: _specs.Spec
    grid: tuple
    combine_grid: tuple
    params: np.ndarray
    num_splits: int
    workspace_rows: int  # packed rows: batch * num_q_heads * seqlen_q

    @property
    def workspace_bytes(self) -> int:
        if self.num_splits == 1:
            return 0
        return 4 * self.workspace_rows * self.num_splits * (self.spec.head_dim + 1)

    def __post_init__(self):
        object.__setattr__(self, "_params_arg", _by_value(self.params))
        object.__setattr__(self, "_num_splits_arg", np.int32(self.num_splits))

    def __call__(self, q, k, v, out, lse, seqlens_k) -> None:
        kernel = get_kernel(self.spec)
        threads = (self.spec.threads,)
        ns = self._num_splits_arg
        smem = self.spec.smem
        if self.num_splits == 1:
            kernel(self.grid, threads, (q, k, v, out, lse, seqlens_k, self._params_arg, None, None, ns), shared_mem=smem)
            return
        import cupy

        n_o = self.workspace_rows * self.num_splits * self.spec.head_dim
        work = cupy.empty(n_o + self.workspace_rows * self.num_splits, dtype=cupy.float32)
        part_o, part_lse = work[:n_o], work[n_o:]
        kernel(self.grid, threads, (q, k, v, out, lse, seqlens_k, self._params_arg, part_o, part_lse, ns), shared_mem=smem)
        get_kernel(self.combine)(
            self.combine_grid, (self.combine.threads,), (out, lse, seqlens_k, self._params_arg, part_o, part_lse, ns)
        )


def _decode_plan(problem: Problem, layout: tuple, spec: _specs.Spec, num_splits: int) -> DecodeLaunch:
    """The launch of decode kernel ``spec`` with ``num_splits`` key ranges."""
    row_blocks = math.ceil(problem.seqlen_q * problem.group_size / spec.block_m)
    blocks = problem.batch * problem.num_kv_heads * row_blocks * num_splits
    if blocks > MAX_GRID_X:
        raise ValueError(f"q: too many query rows for one launch ({blocks} blocks > {MAX_GRID_X})")
    packed_rows = problem.batch * problem.num_q_heads * problem.seqlen_q
    combine = _specs.DECODE_COMBINE[problem.dtype]
    combine_blocks = grid_stride_blocks(packed_rows * problem.head_dim // 4, combine.threads)
    params = make_params(problem, layout)
    return DecodeLaunch(spec, combine, (blocks,), (combine_blocks,), params, num_splits, packed_rows)


@functools.lru_cache(maxsize=4096)
def plan_decode(problem: Problem, layout: tuple, slots: int, arch: _specs.Arch) -> DecodeLaunch:
    """``slots``: SMs x resident CTAs of the decode kernel per SM."""
    rows = problem.seqlen_q * problem.group_size
    spec = _specs.decode_spec(problem.dtype, problem.head_dim, rows, arch)
    num_splits = decode_num_splits(problem, math.ceil(rows / spec.block_m), slots)
    return _decode_plan(problem, layout, spec, num_splits)


@functools.lru_cache(maxsize=64)
def _resident_slots(spec: _specs.Spec, device: int) -> int:
    """SMs x CTAs of the decode kernel ``spec`` per SM that the split rule fills on
    ``device``: those that fit at a time, at most _specs.DECODE_WAVE_CTAS."""
    import cupy
    from cupy.cuda import driver

    per_sm = driver.occupancyMaxActiveBlocksPerMultiprocessor(get_kernel(spec).kernel.ptr, spec.threads, spec.smem)
    wave = _specs.DECODE_WAVE_CTAS[spec.dtype]
    return max(1, min(per_sm, wave or per_sm)) * cupy.cuda.Device(device).attributes["MultiProcessorCount"]


def _check_decode(problem: Problem, q, k, v, out) -> None:
    reason = decode_unsupported(problem, q, k, v, out)
    if reason is not None:
        raise ValueError(f"kernel: 'decode' does not support this call: {reason}; use kernel='auto' or 'rowwise'")


def launch_decode(problem: Problem, q, k, v, out, lse, seqlens_k, *, checked: bool = False) -> None:
    """``checked``: choose_kernel has already found that decode_unsupported is None."""
    if not checked:
        _check_decode(problem, q, k, v, out)
    arch = device_arch(q.device.id)
    spec = _specs.decode_spec(problem.dtype, problem.head_dim, problem.seqlen_q * problem.group_size, arch)
    slots = _resident_slots(spec, q.device.id)
    plan_decode(problem, _layout(q, k, v, out), slots, arch)(q, k, v, out, lse, seqlens_k)


def _launch_decode_forced_splits(problem: Problem, q, k, v, out, lse, seqlens_k, num_splits: int) -> None:
    """launch_decode with ``num_splits`` key ranges in place of the split rule's
    choice: for the tests of the split path and benchmarks/dev, not the API."""
    _check_decode(problem, q, k, v, out)
    rows = problem.seqlen_q * problem.group_size
    spec = _specs.decode_spec(problem.dtype, problem.head_dim, rows, device_arch(q.device.id))
    _decode_plan(problem, _layout(q, k, v, out), spec, num_splits)(q, k, v, out, lse, seqlens_k)


# The GPU kernel families, in the order the public ``kernel=`` lists them.
LAUNCH = {"rowwise": launch_rowwise, "tiled": launch_tiled, "hopper": launch_hopper, "decode": launch_decode}

# "auto" takes the decode kernel up to this many packed rows (seqlen_q * group_size)
# per (batch, KV head), by dtype; beyond, the tiled kernel is faster (H200,
# benchmarks/NOTES_decode.md). float32's CUDA-core dot products lose from 8 rows.
DECODE_AUTO_MAX_ROWS = {"float32": 4, "float16": 32, "bfloat16": 32}


def choose_kernel(problem: Problem, q, k, v, out) -> str:
    """The kernel ``kernel="auto"`` runs for this call: the decode kernel for a
    few query rows per KV head, else the Hopper kernel on sm_90 where it is
    the faster tensor-core kernel (_specs.HOPPER_AUTO_OVER_TILED) or the only
    one, else the mma.sync tensor-core kernel, each when it supports the
    call, else the rowwise kernel, which runs anything."""
    if problem.seqlen_q * problem.group_size <= DECODE_AUTO_MAX_ROWS.get(problem.dtype, 0) and decode_unsupported(problem, q, k, v, out) is None:
        return "decode"
    tiled = tiled_unsupported(problem, q, k, v, out) is None
    if hopper_unsupported(problem, q, k, v, out) is None and (
        not tiled or _specs.HOPPER_AUTO_OVER_TILED[_specs.hopper_head_dim_pad(problem.head_dim)]
    ):
        return "hopper"
    return "tiled" if tiled else "rowwise"
