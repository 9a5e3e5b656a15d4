"""Launch plans: which kernel runs a validated call, with what grid and arguments.

The public function (``api.attention``) validates and hands a :class:`Problem`
here; each ``launch_<family>`` picks the specialization from ``_specs``, sizes
the grid and passes element strides as 64-bit integers. The CUDA side is in
``kernels/<family>.cu``.
"""
from __future__ import annotations

import functools
import itertools
import math
import struct
import threading
from dataclasses import dataclass

import numpy as np

from . import _launch, _mods, _specs, _tma
from ._compile import get_kernel
from ._launch import PackedLaunch

MAX_GRID_X = 2**31 - 1  # CUDA's limit on gridDim.x
FLOAT32_TINY = 2.0**-126  # float32's smallest normal number


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
    mods: object = None  # _mods.Modifiers of a call with modifiers, else None
    seq: object = None  # _seq.SeqLayout of a varlen, paged or left-padded call, else None

    @property
    def group_size(self) -> int:
        return self.num_q_heads // self.num_kv_heads

    @property
    def paged(self) -> bool:
        """Whether K and V come from a paged cache (seq's block table)."""
        return self.seq is not None and self.seq.paged

    @classmethod
    def of(cls, q, k, *, dtype: str, causal: bool, softmax_scale: float, precision: str = "highest", mods=None) -> "Problem":
        batch, seqlen_q, num_q_heads, head_dim = q.shape
        precision = precision if dtype == "float32" else "highest"  # it only means something for float32
        return cls(batch, seqlen_q, k.shape[1], num_q_heads, k.shape[2], head_dim, dtype, causal, softmax_scale, precision, mods)

    def spec(self, spec: _specs.Spec) -> _specs.Spec:
        """``spec``, or its instantiation with this call's modifiers and per-sequence addressing."""
        if self.mods is not None:
            flags = self.mods.flags
            # bf16 P has float32's exponents: the hopper kernels take one exp2 reference for
            # scores in a known range (Modifiers.fixed_ref; fp16's P would underflow)
            if spec.family == "hopper" and self.dtype == "bfloat16" and self.mods.fixed_ref() is not None:
                flags |= _mods.MOD_FIXED_REF
            spec = _specs.with_mods(spec, flags, self.mods.user_code())
        if self.seq is not None:
            spec = _specs.with_seq(spec, self.seq.flags)
        return spec

    def seq_args(self) -> tuple:
        """The SeqParams argument of the *_seq kernels (none without per-sequence
        addressing): its place in the packed arguments (_launch.SEQ), filled
        with seq_params() and given each launch's index-array addresses."""
        return () if self.seq is None else (_launch.SEQ,)

    def seq_params(self) -> bytes:
        return b"" if self.seq is None else self.seq.params()

    def mod_args(self, spec: _specs.Spec, device: int) -> tuple:
        """The ModParams argument of kernel ``spec`` on ``device`` (none without modifiers)."""
        if not spec.mods:
            return ()
        return (self.mods.params(device, self.num_q_heads),)


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
    scale_log2 = problem.softmax_scale * math.log2(math.e)
    if 0 < abs(scale_log2) < FLOAT32_TINY:
        # the kernels' float32 arithmetic flushes a subnormal scale to 0, and a
        # masked score (-inf) times 0 is NaN; at either scale exp2(score *
        # scale) rounds to 1 for every finite score below 2**100
        scale_log2 = math.copysign(FLOAT32_TINY, scale_log2)
    params["scale_log2"] = scale_log2
    for field in ("batch", "seqlen_q", "seqlen_k", "num_q_heads", "num_kv_heads", "group_size", "head_dim", "causal"):
        params[field] = getattr(problem, field)
    if problem.seq is not None and problem.seq.varlen:  # packed rows: sequence b is found by cu_seqlens, not axis 0
        for field in ("q_stride", "k_stride", "v_stride", "o_stride"):
            params[field][0, 0] = 0
    return params


def _current_device() -> int:
    import cupy

    return cupy.cuda.runtime.getDevice()


def current_stream_ptr() -> int:
    """CuPy's current stream on the current device, as a cudaStream_t."""
    import cupy

    return cupy.cuda.get_current_stream().ptr


def address(a) -> int:
    """The device address of a backend array, 0 for None (a null pointer)."""
    return 0 if a is None else a.data.ptr


class _PackedPerDevice:
    """A plan's pre-packed launch (_launch.PackedLaunch) on each device, built by
    the plan's ``_pack`` at its first launch there (which compiles or loads its
    kernels)."""

    extra_args = ()  # per-launch values after the parameter struct (_launch.BLOBS): repeat calls launch through the plan
    fixed_args = ()  # values after those, fixed for the plan (bytes)

    def packed(self) -> PackedLaunch:
        packs = self.__dict__.setdefault("_packs", {})  # device -> PackedLaunch
        device = _current_device()
        packed = packs.get(device)
        if packed is None:
            packed = packs[device] = self._pack(device)
        return packed

    def __call__(self, q, k, v, out, lse, seqlens_k=None, workspace=None) -> None:
        """Launch on CuPy arrays on CuPy's current stream (lse and seqlens_k None: null
        pointers), with the plan's workspace (workspace_bytes) where it takes one, held
        until the launch is queued (call_workspace)."""
        stream = current_stream_ptr()
        work = call_workspace(self, stream, workspace, q, k, v, out, seqlens_k) if self.workspace_bytes else None
        self.launch(stream, address(q), address(k), address(v), address(out), address(lse), address(seqlens_k),
                    address(work))


@dataclass(frozen=True, eq=False)
class Launch(_PackedPerDevice):
    """Everything about a launch except the array arguments.

    :meth:`launch` takes the addresses and the stream (the repeat-call path);
    calling it takes CuPy arrays on CuPy's current stream."""

    spec: _specs.Spec
    grid: tuple
    params: np.ndarray  # PARAMS_DTYPE, shape (1,)
    problem: Problem | None = None  # for the modifiers' ModParams (spec.mods), built per device

    workspace_bytes = 0  # the prefill and rowwise kernels take none (F16x2Launch does)

    def _pack(self, device: int) -> PackedLaunch:
        kernel = get_kernel(self.spec)
        mods = self.problem.mod_args(self.spec, device) if self.problem is not None else ()
        seq = self.problem.seq_args() if self.problem is not None else ()
        args = ("q", "k", "v", "out", "lse", "seqlens_k", self.params.tobytes(), *mods, *seq, *self.extra_args,
                *self.fixed_args)
        seq_params = self.problem.seq_params() if self.problem is not None else b""
        return PackedLaunch([(kernel.kernel.ptr, self.grid[0], self.spec.threads, self.spec.smem, args)], device, keep=(kernel,),
                            seq_params=seq_params)  # fmt: skip

    def launch(self, stream: int, q: int, k: int, v: int, out: int, lse: int, seqlens_k: int, workspace: int = 0,
               seq: tuple = ()) -> None:
        self.packed()(stream, q, k, v, out, lse, seqlens_k, workspace, seq=seq)


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
    spec = problem.spec(_specs.rowwise_spec(problem.dtype, problem.head_dim, vec))
    blocks = rowwise_blocks(problem, spec.team)
    total_threads = blocks * spec.threads
    return Launch(spec, (grid_stride_blocks(total_threads, spec.threads),), make_params(problem, layout, total_threads), problem)


def rowwise_plan_for(problem: Problem, q, k, v, out, *, checked: bool = False) -> Launch:
    """The rowwise plan of a call (rowwise runs every call: nothing to check)."""
    layout = _layout(q, k, v, out)
    vec = (
        problem.head_dim % _specs.vec_width(problem.dtype) == 0
        and device_arch(q.device.id).sm80
        and _vector_issue(layout, (q, k, v, out)) is None
    )
    return plan_rowwise(problem, layout, vec)


def launch_rowwise(problem: Problem, q, k, v, out, lse, seqlens_k=None, *, checked: bool = False, workspace=None) -> Launch:
    """Launch the call's plan and return it (the common launch signature; rowwise takes no workspace)."""
    plan = rowwise_plan_for(problem, q, k, v, out)
    plan(q, k, v, out, lse, seqlens_k)
    return plan


def tiled_unsupported(problem: Problem, q, k, v, out) -> str | None:
    """Why the tiled kernels (kernels/tiled.cu, tiled_tf32.cu) cannot run this call, or None if they can."""
    head_dims = _specs.tiled_head_dims(problem.dtype)
    if not head_dims:
        return f"dtype {problem.dtype} (it takes {', '.join(_specs.TILED_DTYPES + ('float32',))})"
    if problem.head_dim not in head_dims:
        return f"head_dim {problem.head_dim} (it takes {', '.join(map(str, head_dims))} in {problem.dtype})"
    if problem.seq is not None and problem.dtype == "float32" and problem.head_dim not in _specs.TILED_F32_SEQ_HEAD_DIMS:
        return f"head_dim {problem.head_dim} in float32 with {problem.seq.describe()} (it takes {', '.join(map(str, _specs.TILED_F32_SEQ_HEAD_DIMS))})"
    issue = _scale_issue(problem)
    if issue is None:
        arch = device_arch(q.device.id)
        if _specs.tiled_any_spec(problem.dtype, problem.head_dim, problem.causal, problem.precision, arch) is None:
            issue = _arch_issue(q.device.id, arch)
    return issue or _vector_issue(_layout(q, k, v, out), (q, k, v, out))


def _prefill_launch(problem: Problem, layout: tuple, spec: _specs.Spec, tile_rows: int | None = None) -> Launch:
    """The 1-D grid of the prefill kernels (tiled, tiled_tf32, hopper): one CTA per
    tile of packed rows (seqlen_q * group_size of them) of each (batch, KV head);
    a tile is block_m rows, or tile_rows (hopper's, hopper_wg_rows)."""
    num_m_tiles = math.ceil(problem.seqlen_q * problem.group_size / (tile_rows or spec.block_m))
    blocks = num_m_tiles * problem.batch * problem.num_kv_heads
    if blocks > MAX_GRID_X:
        raise ValueError(f"q: too many query rows for one launch ({blocks} blocks > {MAX_GRID_X})")
    return Launch(spec, (blocks,), make_params(problem, layout), problem)


def visible_flops(problem: Problem) -> float:
    """FLOPs of the call's two products on the (query, key) pairs its mask lets
    through (bottom-right causal; a call's largest lengths where they vary per
    sequence; modifiers' masks not counted): 4 head_dim a pair."""
    sq, sk = problem.seqlen_q, problem.seqlen_k
    pairs = sq * sk
    if problem.causal:  # row i sees min(sk, max(0, i + sk - sq + 1)) keys
        first = max(0, sq - sk)  # rows before it see none
        n = sq - first
        lo = first + sk - sq + 1  # the first seeing row's keys (>= 1)
        pairs = n * lo + n * (n - 1) // 2
    return 4.0 * problem.head_dim * pairs * problem.batch * problem.num_q_heads


def f32_products(problem: Problem) -> str:
    """float32 "highest"'s scheme for this call (_specs.F32_PRODUCTS): the one
    set by set_f32_highest, else fp16 pairs from _specs.F32_PAIRS_MIN_FLOPS of
    visible products up and split TF32 below."""
    if _specs.F32_HIGHEST is not None:
        return _specs.F32_HIGHEST
    return "f16x2" if visible_flops(problem) >= _specs.F32_PAIRS_MIN_FLOPS else "tf32x3"


@functools.lru_cache(maxsize=4096)
def plan_tiled(problem: Problem, layout: tuple, arch: _specs.Arch) -> Launch:
    products = f32_products(problem) if problem.dtype == "float32" else None
    spec = _specs.tiled_any_spec(problem.dtype, problem.head_dim, problem.causal, problem.precision, arch, products)
    launch = _prefill_launch(problem, layout, problem.spec(spec))
    if spec.source == "tiled_f16x2.cu":
        return F16x2Launch.of(launch, spec)
    return launch


@dataclass(frozen=True, eq=False)
class F16x2Launch(Launch):
    """The float32 fp16-pair prefill (kernels/tiled_f16x2.cu): two kernels that
    make the pairs of K and V once per call, one CTA per key tile of block_n keys
    (ntiles per sequence and KV head: the longest sequence's), then the prefill
    kernel ``spec`` that reads them.

    Workspace: workspace_bytes, the pairs (4 * block_n * head_dim fp16 values
    per tile) then 12 bytes of scale exponents per tile; calling the plan takes
    it as ``workspace`` as DecodeLaunch does (a caller's array, a function of the
    byte count, or None: CuPy's pool, refused while a CUDA graph is captured)."""

    prep: tuple = ()  # the two Specs, in launch order
    ntiles: int = 0

    @classmethod
    def of(cls, launch: Launch, table_spec: _specs.Spec) -> "F16x2Launch":
        problem = launch.problem
        ntiles = math.ceil(problem.seqlen_k / table_spec.block_n)
        tiles = problem.batch * problem.num_kv_heads * ntiles
        if tiles > MAX_GRID_X:
            raise ValueError(f"k: too many key tiles for one launch ({tiles} > {MAX_GRID_X})")
        # (the pairs' kernels read K and V alone: the sequences' addressing, no modifiers)
        prep = tuple(_specs.with_seq(s, problem.seq.flags) if problem.seq is not None else s
                     for s in _specs.f16x2_prep_specs(table_spec))  # fmt: skip
        return cls(launch.spec, launch.grid, launch.params, problem, prep=prep, ntiles=ntiles)

    @property
    def tiles(self) -> int:
        return self.problem.batch * self.problem.num_kv_heads * self.ntiles

    @property
    def part_lse_offset(self) -> int:
        """Bytes from the workspace's start to the scale exponents (after the pairs)."""
        return self.tiles * 4 * self.spec.block_n * self.spec.head_dim * 2

    @property
    def workspace_bytes(self) -> int:
        return self.part_lse_offset + 12 * self.tiles

    def workspace_message(self) -> str:
        return (f"this float32 call makes fp16 pairs of k and v first (precision 'highest') and needs a float32 "
                f"workspace of {self.workspace_bytes} bytes")

    def _pack(self, device: int) -> PackedLaunch:
        """The two kernels that make the pairs, then the prefill kernel."""
        base = ("q", "k", "v", "out", "lse", "seqlens_k", self.params.tobytes(), "part_o", "part_lse",
                np.int32(self.ntiles).tobytes())  # fmt: skip
        seq = self.problem.seq_args()
        kernels, keep = [], []
        for spec in self.prep:
            kernel = get_kernel(spec)
            kernels.append((kernel.kernel.ptr, self.tiles, spec.threads, 0, (*base, *seq)))
            keep.append(kernel)
        kernel = get_kernel(self.spec)
        mods = self.problem.mod_args(self.spec, device)
        kernels.append((kernel.kernel.ptr, self.grid[0], self.spec.threads, self.spec.smem, (*base, *mods, *seq)))
        keep.append(kernel)
        return PackedLaunch(kernels, device, keep=keep, part_lse_offset=self.part_lse_offset,
                            seq_params=self.problem.seq_params())  # fmt: skip


def set_f32_highest(products: str | None) -> str | None:
    """Make float32 calls with precision="highest" run the tiled kernel's scheme
    ``products`` (_specs.F32_PRODUCTS) from now on, in this process, whatever
    their size (None: the default, by size: f32_products); returns the setting
    before. For the tests and benchmarks that run both schemes: the plans and
    repeat-call entries made under the old one are forgotten."""
    if products is not None and products not in _specs.F32_PRODUCTS:
        raise ValueError(f"products: expected one of {_specs.F32_PRODUCTS} or None, got {products!r}")
    from . import _fast

    old, _specs.F32_HIGHEST = _specs.F32_HIGHEST, products
    plan_tiled.cache_clear()
    _fast.clear()
    return old


def tiled_plan_for(problem: Problem, q, k, v, out, *, checked: bool = False) -> Launch:
    """``checked``: choose_kernel has already found that tiled_unsupported is None."""
    reason = None if checked else tiled_unsupported(problem, q, k, v, out)
    if reason is not None:
        raise ValueError(f"kernel: 'tiled' does not support this call: {reason}; use kernel='auto' or 'rowwise'")
    return plan_tiled(problem, _layout(q, k, v, out), device_arch(q.device.id))


def launch_tiled(problem: Problem, q, k, v, out, lse, seqlens_k=None, *, checked: bool = False, workspace=None) -> Launch:
    plan = tiled_plan_for(problem, q, k, v, out, checked=checked)
    plan(q, k, v, out, lse, seqlens_k, workspace)
    return plan


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
    if not _tma.available():
        return "a CUDA driver without tensor maps (cuTensorMapEncodeTiled)"
    issue = _tma.geometry_issue(k.shape, k.strides) or _tma.geometry_issue(v.shape, v.strides)
    if issue is not None:
        return f"k or v with {issue}"
    return _scale_issue(problem) or _vector_issue(_layout(q, k, v, out), (q, k, v, out))


HOPPER_MIN_WG_ROWS = 56  # the fewest packed rows of a warpgroup's 64 that bulk copies of Q and out may leave it


def hopper_wg_rows(group: int, bulk_qo: bool) -> int:
    """The packed rows of a hopper consumer warpgroup (kernels/hopper.cu:
    wg_rows_of): 64, or with Q and out by bulk copies, the whole positions of
    the group that fit in 64 rows (the copy engine's box is group heads by
    whole positions), 64 - 64 % group."""
    return 64 - 64 % group if bulk_qo else 64


def hopper_bulk_qo(problem: Problem, q_layout: tuple, out_layout: tuple) -> bool:
    """Whether the hopper kernel moves Q and out by bulk tensor copies: a
    warpgroup's box holds whole positions of one group, so the group must leave
    it at least HOPPER_MIN_WG_ROWS of its 64 rows (every group that divides 64;
    3, 5, 6, 7, 9, 10, 12, 14, 15 and others that nearly do; these below head
    dim 256, whose kernel has no register to spare for the shorter blocks),
    and q and out must be arrays the copy engine steps through; varlen calls
    keep the threads' copies (a sequence's rows end inside the packed array,
    and a store would run on; paged and left-padded calls have q and out of
    the contiguous shape). The layouts are _layout's (shape, byte strides,
    itemsize)."""
    group = problem.group_size
    if (problem.seq is not None and problem.seq.varlen) or group > 64 or hopper_wg_rows(group, True) < HOPPER_MIN_WG_ROWS:
        return False
    if 64 % group and _specs.hopper_head_dim_pad(problem.head_dim) == 256:
        return False
    return all(_tma.geometry_issue(shape, strides) is None for shape, strides, _ in (q_layout, out_layout))


def hopper_auto_min_keys(problem: Problem, q, out) -> int:
    """The keys from which auto prefers hopper to tiled (_specs)."""
    if hopper_bulk_qo(problem, *_layout(q, out)):
        return _specs.HOPPER_BULK_QO_AUTO_MIN_KEYS
    return _specs.HOPPER_AUTO_MIN_KEYS


# The hopper kernel's tile counters (kernels/hopper.cu: persistent CTAs take
# their next tile from one). A counter reads 0 between launches: the launch's
# last fetch puts it back. Each launch takes the next counter of a ring of
# COUNTER_SLOTS per device, so launches that may run at once (on other
# streams, from other threads) never share one: a counter comes round again
# only COUNTER_SLOTS launches later, far more than a device queues. A launch
# captured into a CUDA graph takes none (its replays could run beside each
# other) and runs one CTA per tile.
COUNTER_SLOTS = 1 << 16
HOPPER_PERSISTENT = True  # eager launches run persistent CTAs (tests and benchmarks/dev switch it)
_counter_rings: dict = {}  # device -> its ring's allocation, zeroed once
_next_counter = itertools.count()
_counters_lock = threading.Lock()


def counter_ring(device: int):
    """``device``'s ring of tile counters (the current device): its own
    allocation, outside the memory pool, zeroed once when first asked for."""
    ring = _counter_rings.get(device)
    if ring is None:
        with _counters_lock:
            ring = _counter_rings.get(device)
            if ring is None:
                from cupy.cuda import memory, runtime

                ring = memory.Memory(4 * COUNTER_SLOTS)
                runtime.memsetAsync(ring.ptr, 0, 4 * COUNTER_SLOTS, 0)
                runtime.streamSynchronize(0)  # zero before any stream's launch reads it (once per device)
                _counter_rings[device] = ring
    return ring


def tile_counter(device: int) -> int:
    """The address of the next tile counter of ``device``'s ring."""
    return counter_ring(device).ptr + 4 * (next(_next_counter) % COUNTER_SLOTS)


@dataclass(frozen=True, eq=False)
class HopperLaunch(Launch):
    """A hopper launch: the prefill grid, and the tensor maps of K and V (and,
    where ``bulk_qo``, of q and out) for the kernel's bulk copies
    (kernels/hopper.cu), encoded by the driver (_tma.py) at the first launch
    with each address and kept for the next."""

    layouts: tuple = ()  # (shape, byte strides, itemsize) of q, k, v and out
    bulk_qo: bool = False  # q and out by bulk copies too (hopper_bulk_qo)
    extra_args = ("k_map", "v_map", "q_map", "o_map")

    MAPS_KEPT = 64  # encoded tensor maps kept per plan (a serving loop reuses its cache's)

    @property
    def fixed_args(self) -> tuple:
        return (struct.pack("<i", int(self.bulk_qo)), "counter")

    def ctas(self, device: int) -> int:
        """The persistent grid on ``device``: one CTA per SM (the kernel's
        resources allow one), at most one per tile."""
        return min(self.grid[0], sm_count(device))

    def launch(self, stream: int, q: int, k: int, v: int, out: int, lse: int, seqlens_k: int, workspace: int = 0,
               seq: tuple = ()) -> None:
        maps = (self._tensor_map(1, k), self._tensor_map(2, v))
        if self.bulk_qo:
            # at head dim 64 the kernel writes out from its registers (kernels/hopper.cu: epilogue)
            maps += (self._tensor_map(0, q),)
            maps += (self._tensor_map(3, out) if self.spec.head_dim > 64 else bytes(_launch.BLOB_BYTES),)
        packed = self.packed()
        if not HOPPER_PERSISTENT or _stream_is_capturing(stream):
            packed(stream, q, k, v, out, lse, seqlens_k, blobs=maps, seq=seq)  # one CTA per tile, no counter
        else:
            device = packed.device
            packed(stream, q, k, v, out, lse, seqlens_k, blobs=maps, seq=seq, counter=tile_counter(device),
                   grid_x=self.ctas(device))  # fmt: skip

    def _tensor_map(self, which: int, ptr: int) -> bytes:
        """The map of argument ``which`` (0 q, 1 k, 2 v, 3 out) at ``ptr``."""
        maps = self.__dict__.setdefault("_maps", {})
        encoded = maps.get((which, ptr))
        if encoded is None:
            shape, strides, itemsize = self.layouts[which]
            if which in (1, 2):  # key tiles; of a paged pool, boxes that never cross a page (kernels/hopper.cu)
                rows = self.spec.block_n
                if self.problem.paged:
                    rows = math.gcd(self.problem.seq.page_size, rows)
                encoded = _tma.tile_map(ptr, shape, strides, itemsize, rows)
            else:  # packed rows: a consumer warpgroup's rows of the tile, whole positions
                group = self.problem.group_size
                encoded = _tma.packed_map(ptr, shape, strides, itemsize, group, hopper_wg_rows(group, True) // group)
            if len(maps) >= self.MAPS_KEPT:
                maps.clear()
            maps[(which, ptr)] = encoded
        return encoded


@functools.lru_cache(maxsize=4096)
def plan_hopper(problem: Problem, layout: tuple) -> HopperLaunch:
    spec = _specs.hopper_tile(problem.dtype, problem.head_dim, problem.causal, problem.group_size, problem.paged)
    bulk_qo = hopper_bulk_qo(problem, layout[0], layout[3])
    tile_rows = spec.block_m // 64 * hopper_wg_rows(problem.group_size, bulk_qo)
    launch = _prefill_launch(problem, layout, problem.spec(spec), tile_rows)
    return HopperLaunch(launch.spec, launch.grid, launch.params, launch.problem, layouts=layout, bulk_qo=bulk_qo)


def hopper_plan_for(problem: Problem, q, k, v, out, *, checked: bool = False) -> Launch:
    """``checked``: choose_kernel has already found that hopper_unsupported is None."""
    reason = None if checked else hopper_unsupported(problem, q, k, v, out)
    if reason is not None:
        raise ValueError(f"kernel: 'hopper' does not support this call: {reason}; use kernel='auto', 'tiled' or 'rowwise'")
    return plan_hopper(problem, _layout(q, k, v, out))


def launch_hopper(problem: Problem, q, k, v, out, lse, seqlens_k=None, *, checked: bool = False, workspace=None) -> Launch:
    plan = hopper_plan_for(problem, q, k, v, out, checked=checked)
    plan(q, k, v, out, lse, seqlens_k)
    return plan


def decode_unsupported(problem: Problem, q, k, v, out) -> str | None:
    """Why kernels/decode.cu cannot run this call, or None if it can."""
    if problem.dtype not in _specs.DECODE_DTYPES:
        return f"dtype {problem.dtype} (it takes {', '.join(_specs.DECODE_DTYPES)})"
    if _specs.decode_head_dim(problem.dtype, problem.head_dim) is None:
        takes = ("a multiple of 8 up to 256" if problem.dtype in _specs.DECODE_MMA_DTYPES
                 else ", ".join(map(str, _specs.DECODE_HEAD_DIMS)))
        return f"head_dim {problem.head_dim} (it takes {takes} in {problem.dtype})"
    if problem.seqlen_q > _specs.DECODE_MAX_SEQLEN_Q:
        return f"seqlen_q {problem.seqlen_q} (it takes 1 to {_specs.DECODE_MAX_SEQLEN_Q} query tokens)"
    arch = device_arch(q.device.id)
    if not _specs.decode_specs(problem.dtype, problem.head_dim, arch):
        return _arch_issue(q.device.id, arch)
    return _vector_issue(_layout(q, k, v, out), (q, k, v, out))


DECODE_MAX_SPLITS = 128  # key ranges per (batch, KV head, row block)
DECODE_MIN_SPLIT_KEYS = 256  # no key range shorter than this

# --- decode_dispatch: the decode cost model -----------------------------------
# Rates of an H200 (132 SMs; the SM count comes from the device), each either
# measured in benchmarks/NOTES_decode.md or derived there from a measurement.
# On other GPUs the absolute times are off, but the choices rest on ratios
# (bytes against compute, CTAs against SMs), which hold on every recent part.
DECODE_HBM_BYTES_PER_S = 4.24e12  # device copy rate: the floor of a K/V pass
DECODE_L2_BYTES_PER_S = 10e12  # L2 to SMs: row blocks after the first read K/V from L2
# A CTA with B bytes of loads in flight streams B / latency: D1 (v3b), one CTA
# of 64 KB in flight per SM, reached 3940 GB/s, 31 GB/s per CTA, so the loaded
# latency is at most 2 us; 1.5 us leaves the HBM the limit there, as measured.
DECODE_LATENCY_S = 1.5e-6
# What a CTA costs besides streaming: its Q load and pipeline fill (a latency
# each, unhidden), its merge and the write of its rows.
DECODE_CTA_FIXED_S = 2e-6
# A key stream of the tensor-core kernel takes its tiles one after another, and
# each tile's chain (wait, products, softmax, products) is latency with one warp
# per scheduler: 0.5 to 0.7 us per 16-key tile at head dims 64 and 128,
# whatever the rows (benchmarks/dev/decode_layouts.py at one split: 0.51 to
# 0.56 us for 64-row CTAs, one stream; 0.59 to 0.67 for 16-row CTAs, four).
# So 4 streams of 16 rows beat one of 64 wherever a CTA's tiles, not the
# bytes, set its time.
DECODE_TILE_S = 0.6e-6
# The combine kernel: a dependent launch and its tail (ncu: 4.5 us for D1 at
# 2 splits), then 2 L2 round trips (lse, partials) per DECODE_COMBINE_UNROLL
# splits of each of its lanes (decode_combine_lanes per output quad).
DECODE_COMBINE_FIXED_S = 3e-6
DECODE_COMBINE_ROUND_S = 0.3e-6
DECODE_COMBINE_UNROLL = 4  # kernels/decode.cu: decode_combine_body
# And per split through the combine, whatever its lanes: fitted to calls timed
# as a model's decode step finds its layer's K/V, out of L2 (decode_layouts.py
# on 28 shapes, benchmarks/NOTES_decode.md). Without it the model split D06's
# shape (B1, 32768 keys, one KV head) 121 ways, measured 18.3 us against 16.8
# at 64: past about 512 keys a split, more CTAs no longer shorten the pass.
DECODE_SPLIT_S = 60e-9
# The cluster kernel's merge in place of the combine (decode_cluster): two
# cluster barriers and one round trip to the other CTAs' shared memory, in
# the same launch. With it the model puts 8 splits in clusters 2.7 us ahead
# of 8 through the combine at D01's shape; the H200 measured 2.9
# (benchmarks/NOTES_decode.md, the cluster merge).
DECODE_CLUSTER_MERGE_S = 1e-6

# Tensor-core (mma.sync m16n8k16) FLOP rate of one SM in the decode kernel,
# padded rows counted: 1024 dense FMA per clock at 1.8 GHz, the softmax and
# ldmatrix between the products. CUDA-core kernel (float32): issue-bound, the
# bf16 CUDA-core kernel at 4 rows ran at ~3500 GB/s, 14 TFLOP/s over 132 SMs.
DECODE_MMA_FLOPS_PER_SM = 3.7e12
DECODE_FFMA_FLOPS_PER_SM = 1.0e11
# The prefill kernels (tiled, hopper, tiled_tf32) as decode's alternative: one
# CTA per 128 (64) packed rows of a (batch, KV head), every key, no split;
# about 500 TFLOP/s for fp16 / bf16 on the H200 (hopper), 80 for float32 at
# precision "highest" (three TF32 products), three times that at "tf32"; a
# CTA keeps about 64 KB of K/V in flight.
PREFILL_MMA_FLOPS_PER_SM = 3.8e12
PREFILL_TF32X3_FLOPS_PER_SM = 0.6e12
PREFILL_BYTES_IN_FLIGHT = 65536
# Choices the model times within this fraction of the best are ties, which
# the fewest CTAs win (decode_dispatch).
DECODE_TIE = 0.02
# A split into clusters (decode_cluster) wins over the model's best choice
# within this many seconds: at D01's shape (B1, 4096 keys, 8 KV heads) the
# model put 16 splits through the combine 0.3 us ahead of 8 in clusters, and
# the H200 measured 18.0 against 15.0 us of GPU time, and 14.7 against 6.8 us
# of host time per call (benchmarks/NOTES_decode.md: the cluster merge). An
# absolute margin, and only in place of a split through the combine (not of
# one launch without a split): on the long calls it changes nothing.
DECODE_CLUSTER_MARGIN_S = 2e-6


def _combine_lanes(num_splits: int) -> int:
    if num_splits > 64:
        return 32
    return 16 if num_splits > 32 else 8 if num_splits >= 8 else 4 if num_splits >= 4 else 2 if num_splits >= 2 else 1


# by split count, 0 to DECODE_MAX_SPLITS: the combine's lanes, and whether clusters can take the splits
_COMBINE_LANES = np.array([_combine_lanes(n) for n in range(DECODE_MAX_SPLITS + 1)])
_CLUSTER_SPLITS = np.array([n in _specs.DECODE_CLUSTERS for n in range(DECODE_MAX_SPLITS + 1)])


def decode_combine_lanes(num_splits):
    """Lanes of the combine kernel per output quad (kernels/decode.cu: combine_lanes):
    at most DECODE_COMBINE_UNROLL splits a lane, up to DECODE_MAX_SPLITS. An int,
    or an array of them for an array of split counts."""
    lanes = _COMBINE_LANES[np.minimum(num_splits, DECODE_MAX_SPLITS)]  # (past it: the table's last, 32)
    return int(lanes) if np.ndim(lanes) == 0 else lanes


def decode_bytes_in_flight(spec: _specs.Spec) -> int:
    """K/V bytes one CTA of decode kernel ``spec`` keeps in flight: the
    tensor-core kernel's key streams, stages - 1 tiles each; the CUDA-core
    kernel's next step, DECODE_LOADS (2 at 8 rows) 16-byte K and V loads per lane."""
    itemsize = _specs.ITEMSIZE[spec.dtype]
    if spec.sm80:
        row_warps = spec.block_m // 16
        stages = int(spec.name.split(", ")[3])  # decode_mma_attention<T, D, ROW_WARPS, STAGES, SMEM>
        streams = _specs.DECODE_MMA_WARPS // row_warps
        return streams * (stages - 1) * _specs.DECODE_MMA_BN * 2 * spec.head_dim * itemsize
    return spec.threads * (2 if spec.block_m >= 8 else 4) * 16 * 2


def decode_cluster(problem: Problem, spec: _specs.Spec, num_splits: int, arch: _specs.Arch) -> bool:
    """Whether decode kernel ``spec`` runs a call of ``num_splits`` key ranges
    as clusters that merge their own splits (_specs.DECODE_CLUSTERS: the
    tensor-core kernel without modifiers on contiguous K/V, on an
    architecture with clusters), rather than with a workspace and the combine."""
    return bool(decode_clusters(problem, (spec,), np.array([num_splits]), arch)[0, 0])


def decode_clusters(problem: Problem, specs: tuple, num_splits: np.ndarray, arch: _specs.Arch) -> np.ndarray:
    """decode_cluster of every decode kernel of ``specs`` (rows) at every split
    count of ``num_splits`` (columns)."""
    can = [[arch.clusters and spec.sm80 and problem.mods is None and problem.seq is None] for spec in specs]
    return np.array(can, dtype=bool) & _CLUSTER_SPLITS[np.minimum(num_splits, DECODE_MAX_SPLITS)]


def decode_seconds(problem: Problem, spec: _specs.Spec, num_splits: int, sms: int, arch: _specs.Arch) -> float:
    """The cost model's time of decode kernel ``spec`` with ``num_splits`` key
    ranges (and the combine), on ``sms`` SMs of ``arch`` (decode_times).

    n CTAs = batch * num_kv_heads * row_blocks * num_splits; the busiest SM
    runs c = ceil(n / sms) of them, decode_ctas_per_sm at a time; each streams
    its key range (seqlen_k: the model never reads device lengths) at
    bytes in flight / DECODE_LATENCY_S and computes its padded rows:
        t_sm     = waves * DECODE_CTA_FIXED_S + max(c * bytes / (resident * rate), c * flops / FLOPS_PER_SM,
                                                waves * tiles per key stream * DECODE_TILE_S)
        t_kernel = max(t_sm, K/V bytes / HBM, row_blocks * K/V bytes / L2)
    plus, split, the combine: DECODE_COMBINE_FIXED_S, its round trips,
    DECODE_SPLIT_S a split, and the partials' bytes (written and read) at the
    HBM rate; or, split into clusters (decode_cluster), DECODE_CLUSTER_MERGE_S."""
    return float(decode_times(problem, (spec,), np.array([num_splits]), sms, arch)[0, 0])


@functools.lru_cache(maxsize=256)
def _decode_columns(specs: tuple, arch: _specs.Arch) -> tuple:
    """decode_times' values of each kernel of ``specs``, a column each: block_m,
    decode_ctas_per_sm, decode_bytes_in_flight, head_dim, sm80."""
    rows = [(s.block_m, _specs.decode_ctas_per_sm(s, arch), decode_bytes_in_flight(s), s.head_dim, s.sm80) for s in specs]
    return tuple(np.array(column)[:, None] for column in zip(*rows))


def decode_times(problem: Problem, specs: tuple, num_splits: np.ndarray, sms: int, arch: _specs.Arch) -> np.ndarray:
    """decode_seconds of every decode kernel of ``specs`` (rows) at every split
    count of ``num_splits`` (columns), at once: decode_dispatch's table, the
    same operations in the same order as one at a time (so the same floats)."""
    ceil = lambda x: np.ceil(x).astype(np.int64)  # noqa: E731  (of a true division, as math.ceil)
    ns = np.asarray(num_splits, dtype=np.int64)[None, :]
    rows = problem.seqlen_q * problem.group_size
    block_m, ctas_per_sm, in_flight, head_dim, sm80 = _decode_columns(specs, arch)
    row_blocks = ceil(rows / block_m)
    key_bytes = 2 * problem.head_dim * _specs.ITEMSIZE[problem.dtype]  # K and V of one key
    n = problem.batch * problem.num_kv_heads * row_blocks * ns
    c = ceil(n / sms)
    resident = np.minimum(c, ctas_per_sm)
    waves = ceil(c / resident)
    tile = _specs.DECODE_MMA_BN
    keys = np.minimum(problem.seqlen_k, ceil(ceil(problem.seqlen_k / ns) / tile) * tile)
    rate = in_flight / DECODE_LATENCY_S
    flops = 4 * block_m * head_dim * keys  # (padded columns computed too)
    per_sm = np.where(sm80, DECODE_MMA_FLOPS_PER_SM, DECODE_FFMA_FLOPS_PER_SM)
    # (tensor cores) the tiles of each key stream, in sequence
    streams = np.where(sm80, _specs.DECODE_MMA_WARPS // np.maximum(block_m // 16, 1), 0)
    issue = np.where(streams > 0, waves * ceil(ceil(keys / tile) / np.maximum(streams, 1)) * DECODE_TILE_S, 0.0)
    # (a padded head dim streams as many keys in flight as its kernel's: its bytes are fewer, not its keys)
    slot_bytes = 2 * head_dim * _specs.ITEMSIZE[problem.dtype]
    t_sm = waves * DECODE_CTA_FIXED_S + np.maximum(
        np.maximum(c * keys * slot_bytes / (resident * rate), c * flops / per_sm), issue)
    kv_bytes = problem.batch * problem.num_kv_heads * problem.seqlen_k * key_bytes
    t = np.maximum(np.maximum(t_sm, kv_bytes / DECODE_HBM_BYTES_PER_S), row_blocks * kv_bytes / DECODE_L2_BYTES_PER_S)
    partials = problem.batch * problem.num_q_heads * problem.seqlen_q * ns * (problem.head_dim + 1) * 4
    per_lane = ceil(ns / decode_combine_lanes(ns))
    combined = t + (DECODE_COMBINE_FIXED_S + 2 * ceil(per_lane / DECODE_COMBINE_UNROLL) * DECODE_COMBINE_ROUND_S)
    combined = combined + ns * DECODE_SPLIT_S
    combined = combined + 2 * partials / DECODE_HBM_BYTES_PER_S
    clusters = decode_clusters(problem, specs, ns[0], arch)
    return np.where(clusters, t + DECODE_CLUSTER_MERGE_S, np.where(ns > 1, combined, t))


def prefill_seconds(problem: Problem, sms: int) -> float:
    """The cost model's time of the prefill kernel for a decode-shaped call: one
    CTA per block_m packed rows (the tiled table's) of each (batch, KV head),
    each streaming every key at PREFILL_BYTES_IN_FLIGHT / DECODE_LATENCY_S and
    computing block_m rows against them (no key split, so few (batch, KV head)
    pairs leave SMs idle), at least one K/V pass at the HBM rate."""
    if problem.dtype == "float32":
        block_m = _specs.TILED_F32_TILES.get(problem.head_dim, (64,))[0]
        per_sm = PREFILL_TF32X3_FLOPS_PER_SM * (3 if problem.precision == "tf32" else 1)
    else:
        block_m = _specs.TILED_TILES.get(problem.head_dim, (128,))[0]
        per_sm = PREFILL_MMA_FLOPS_PER_SM
    rows = problem.seqlen_q * problem.group_size
    key_bytes = 2 * problem.head_dim * _specs.ITEMSIZE[problem.dtype]
    n = problem.batch * problem.num_kv_heads * math.ceil(rows / block_m)
    c = math.ceil(n / sms)
    stream = problem.seqlen_k * key_bytes / (PREFILL_BYTES_IN_FLIGHT / DECODE_LATENCY_S)
    compute = 4 * block_m * problem.head_dim * problem.seqlen_k / per_sm
    kv_bytes = problem.batch * problem.num_kv_heads * problem.seqlen_k * key_bytes
    return max(c * (DECODE_CTA_FIXED_S + max(stream, compute)), kv_bytes / DECODE_HBM_BYTES_PER_S)


@dataclass(frozen=True)
class DecodeChoice:
    """decode_dispatch's answer: the kernel for a call, and decode's launch."""

    kernel: str  # "decode" or "prefill"
    block_m: int  # decode: packed rows per CTA (a _specs.decode_block_ms value; 0 when decode can't run)
    num_splits: int  # decode: key ranges per (batch, KV head, row block)
    decode_s: float  # the model's time of that decode launch (inf when decode can't run)
    prefill_s: float  # the model's time of the prefill kernel


@functools.lru_cache(maxsize=4096)
def decode_dispatch(problem: Problem, sms: int, arch: _specs.Arch) -> DecodeChoice:
    """The one decision for a decode-shaped call (seqlen_q <= DECODE_MAX_SEQLEN_Q):
    decode or the prefill kernel, and decode's rows per CTA and key ranges.

    Every decode kernel of the dtype and head dim (_specs.decode_specs: 16, 32
    or 64 rows per CTA on tensor cores, 1 to 8 on CUDA cores) at every split
    count from 1 to min(DECODE_MAX_SPLITS, seqlen_k / DECODE_MIN_SPLIT_KEYS)
    is timed by decode_seconds; of those within DECODE_TIE of the fastest, the
    one of fewest CTAs (then the smaller block) is decode's launch: the fewest
    passes over K/V from L2 and the least combine work. Where that
    launch splits through the combine, a split into clusters (decode_cluster:
    one launch, no workspace) within DECODE_CLUSTER_MARGIN_S of the fastest
    takes its place, the fastest of them. auto takes it
    unless prefill_seconds is smaller. Depends on the shape alone (never on
    device lengths): the same plan for every call of a shape, as a CUDA graph
    needs."""
    inf = float("inf")
    specs = _specs.decode_specs(problem.dtype, problem.head_dim, arch)
    prefill = prefill_seconds(problem, sms)
    if not specs:
        return DecodeChoice("prefill", 0, 1, inf, prefill)
    rows = problem.seqlen_q * problem.group_size
    most = max(1, min(DECODE_MAX_SPLITS, problem.seqlen_k // DECODE_MIN_SPLIT_KEYS))
    # every kernel (rows) at every split count (columns) that fits a grid of MAX_GRID_X CTAs
    splits = np.arange(1, most + 1)
    block_ms = _decode_columns(specs, arch)[0]
    ctas = problem.batch * problem.num_kv_heads * -(-rows // block_ms) * splits
    fits = ctas <= MAX_GRID_X
    if not fits.any():  # too many rows for one grid: the launch raises
        return DecodeChoice("prefill", specs[0].block_m, 1, inf, prefill)
    seconds = decode_times(problem, specs, splits, sms, arch)
    clustered = decode_clusters(problem, specs, splits, arch)
    ctas, seconds, clustered = ctas[fits], seconds[fits], clustered[fits]
    block_ms, splits = np.broadcast_to(block_ms, fits.shape)[fits], np.broadcast_to(splits, fits.shape)[fits]
    best = seconds.min()
    # the ties' least (CTAs, block_m, splits, seconds, in clusters), in that order
    tied = np.flatnonzero(seconds <= best * (1 + DECODE_TIE))
    i = tied[np.lexsort((clustered[tied], seconds[tied], splits[tied], block_ms[tied], ctas[tied]))[0]]
    near = np.flatnonzero(clustered & (seconds <= best + DECODE_CLUSTER_MARGIN_S))
    if splits[i] > 1 and not clustered[i] and near.size:  # the fastest of them, then fewest CTAs, smaller block
        i = near[np.lexsort((block_ms[near], ctas[near], seconds[near]))[0]]
    t = float(seconds[i])
    return DecodeChoice("decode" if t <= prefill else "prefill", int(block_ms[i]), int(splits[i]), t, prefill)


def _stream_is_capturing(stream: int) -> bool:
    from cupy.cuda import runtime

    return bool(runtime.streamIsCapturing(stream))


@functools.lru_cache(maxsize=64)
def sm_count(device: int) -> int:
    """Streaming multiprocessors of CUDA device ``device``."""
    import cupy

    return cupy.cuda.Device(device).attributes["MultiProcessorCount"]


@dataclass(frozen=True, eq=False)
class DecodeLaunch(_PackedPerDevice):
    """The split-KV decode kernel and, with num_splits > 1, its combine kernel
    (or, ``cluster``, none: the cluster kernel merges its own splits).

    Workspace (num_splits > 1, not cluster): workspace_bytes of float32 values, the partial
    outputs (packed_rows * num_splits * head_dim, the call's head_dim, packed_rows = batch *
    num_q_heads * seqlen_q) then their lse (packed_rows * num_splits), at a
    16-byte aligned address. Calling the plan takes it as ``workspace``: a
    caller's CuPy array (checked here), a function of the byte count that
    returns one (torch's allocator, for torch inputs), or None: then it comes
    from CuPy's memory pool on the current stream and returns to the pool when
    the call returns (the pool is stream-ordered, so nothing waits), except
    while the stream is captured into a CUDA graph, which such a buffer would
    outlive: that raises a ValueError."""

    spec: _specs.Spec
    combine: _specs.Spec
    grid: tuple
    combine_grid: tuple
    params: np.ndarray
    num_splits: int
    workspace_rows: int  # packed rows: batch * num_q_heads * seqlen_q
    problem: Problem  # the call: its head_dim (the workspace's rows; spec's may be padded), its modifiers' ModParams
    cluster: bool = False  # spec is the cluster kernel of num_splits splits (_specs.decode_cluster_spec)

    @property
    def combined(self) -> bool:
        """Whether the splits go through the workspace and the combine kernel."""
        return self.num_splits > 1 and not self.cluster

    @property
    def workspace_bytes(self) -> int:
        if not self.combined:
            return 0
        return 4 * self.workspace_rows * self.num_splits * (self.problem.head_dim + 1)

    @property
    def part_lse_offset(self) -> int:
        """Bytes from the workspace's start to the partial lse."""
        return 4 * self.workspace_rows * self.num_splits * self.problem.head_dim

    def _pack(self, device: int) -> PackedLaunch:
        """The decode kernel, then the combine kernel when split (not in clusters)."""
        params, ns = self.params.tobytes(), np.int32(self.num_splits).tobytes()
        kernel = get_kernel(self.spec)
        mods = self.problem.mod_args(self.spec, device)
        seq = self.problem.seq_args()
        args = ("q", "k", "v", "out", "lse", "seqlens_k", params, "part_o", "part_lse", ns, *mods, *seq)
        kernels, keep = [(kernel.kernel.ptr, self.grid[0], self.spec.threads, self.spec.smem, args)], [kernel]
        if self.combined:
            combine = get_kernel(self.combine)
            mods = self.problem.mod_args(self.combine, device)
            args = ("out", "lse", "seqlens_k", params, "part_o", "part_lse", ns, *mods, *seq)
            # a programmatic dependent where the device has them: its CTAs start as the
            # decode kernel's run, and wait for its partials (griddepcontrol.wait)
            dependent = device_arch(device).dependent_launch
            kernels.append((combine.kernel.ptr, self.combine_grid[0], self.combine.threads, self.combine.smem, args,
                            dependent))
            keep.append(combine)
        seq_params = self.problem.seq_params()
        return PackedLaunch(kernels, device, keep=keep, part_lse_offset=self.part_lse_offset, seq_params=seq_params)

    def launch(self, stream: int, q: int, k: int, v: int, out: int, lse: int, seqlens_k: int, workspace: int = 0,
               seq: tuple = ()) -> None:
        """``workspace``: the address of a checked workspace when combined."""
        self.packed()(stream, q, k, v, out, lse, seqlens_k, workspace if self.combined else 0, seq=seq)

    def workspace_message(self) -> str:
        return f"this call splits the keys into {self.num_splits} ranges and needs a float32 workspace of {self.workspace_bytes} bytes"


def call_workspace(plan, stream: int, workspace, q, k, v, out, seqlens_k):
    """The workspace of a call of ``plan`` (workspace_bytes > 0), as a CuPy array:
    ``workspace`` a caller's CuPy array (checked here), a function of the byte
    count that returns one (torch's allocator, for torch inputs), or None: then
    it comes from CuPy's memory pool on the current stream and returns to the
    pool when the caller drops it (the pool is stream-ordered, so nothing waits),
    except while the stream is captured into a CUDA graph, which such a buffer
    would outlive: that raises a ValueError.

    The caller holds it until the launch is queued: a buffer dropped before
    would go back to the pool while the first launch of a plan still makes its
    arguments, and an array made there (a user modifier's buffers, copied to
    the device once and kept) could take the same memory, which the kernels
    then write their partial results over."""
    if workspace is None:
        import cupy

        if cupy.cuda.runtime.streamIsCapturing(stream):
            raise ValueError(workspace_capture_message(plan))
        workspace = cupy.empty(plan.workspace_bytes // 4, dtype=cupy.float32)  # CuPy's pool, this stream
    elif callable(workspace):
        workspace = workspace(plan.workspace_bytes)
    else:
        check_workspace(workspace, plan.workspace_bytes, {"q": q, "k": k, "v": v, "out": out, "seqlens_k": seqlens_k})
    return workspace


def workspace_capture_message(plan) -> str:
    return (
        f"workspace: expected a caller-owned buffer while a CUDA graph is being captured ({plan.workspace_message()}; "
        f"a buffer from CuPy's memory pool would go back to the pool while the graph still writes to it), got None; "
        f"pass workspace=cupy_gqa.workspace(q, k, v, ...)"
    )


def check_workspace(workspace, needed: int, others: dict) -> None:
    """A caller's workspace (a CuPy array, dtype and contiguity already checked)
    for a call that needs ``needed`` bytes: its size, address and overlap with
    the call's other arrays (``others``: name -> CuPy array or None)."""
    if workspace.nbytes < needed:
        raise ValueError(
            f"workspace: expected at least {needed} bytes ({needed // 4} float32 values) for this call, "
            f"got {workspace.nbytes} bytes; cupy_gqa.workspace_size gives the size"
        )
    if needed == 0:
        return
    ptr = workspace.data.ptr
    if ptr % 16:
        raise ValueError(f"workspace: expected a 16-byte aligned address, got {ptr:#x}")
    hi = ptr + needed
    for name, a in others.items():
        if a is not None and a.size:
            from ._interop import byte_span

            a_lo, a_hi = byte_span(a)
            if ptr < a_hi and a_lo < hi:
                raise ValueError(f"workspace: must not overlap the memory of {name}")


def _decode_plan(problem: Problem, layout: tuple, spec: _specs.Spec, num_splits: int, cluster: bool = False) -> DecodeLaunch:
    """The launch of decode kernel ``spec`` with ``num_splits`` key ranges, as
    clusters where ``cluster`` (decode_cluster holds)."""
    row_blocks = math.ceil(problem.seqlen_q * problem.group_size / spec.block_m)
    blocks = problem.batch * problem.num_kv_heads * row_blocks * num_splits
    if blocks > MAX_GRID_X:
        raise ValueError(f"q: too many query rows for one launch ({blocks} blocks > {MAX_GRID_X})")
    packed_rows = problem.batch * problem.num_q_heads * problem.seqlen_q
    combine = problem.spec(_specs.DECODE_COMBINE[problem.dtype])
    combine_blocks = grid_stride_blocks(packed_rows * problem.head_dim // 4 * decode_combine_lanes(num_splits), combine.threads)
    params = make_params(problem, layout)
    kernel = _specs.decode_cluster_spec(spec, num_splits) if cluster else problem.spec(spec)
    return DecodeLaunch(kernel, combine, (blocks,), (combine_blocks,), params, num_splits, packed_rows, problem, cluster)


@functools.lru_cache(maxsize=4096)
def plan_decode(problem: Problem, layout: tuple, sms: int, arch: _specs.Arch) -> DecodeLaunch:
    """Decode's launch as decode_dispatch chooses it, on ``sms`` SMs of ``arch``."""
    choice = decode_dispatch(problem, sms, arch)
    spec = _specs.decode_spec(problem.dtype, problem.head_dim, choice.block_m, arch)
    return _decode_plan(problem, layout, spec, choice.num_splits, decode_cluster(problem, spec, choice.num_splits, arch))


def _check_decode(problem: Problem, q, k, v, out) -> None:
    reason = decode_unsupported(problem, q, k, v, out)
    if reason is not None:
        raise ValueError(f"kernel: 'decode' does not support this call: {reason}; use kernel='auto' or 'rowwise'")


def decode_plan_for(problem: Problem, q, k, v, out, *, checked: bool = False) -> DecodeLaunch:
    """``checked``: choose_kernel has already found that decode_unsupported is None."""
    if not checked:
        _check_decode(problem, q, k, v, out)
    device = q.device.id
    return plan_decode(problem, _layout(q, k, v, out), sm_count(device), device_arch(device))


def launch_decode(problem: Problem, q, k, v, out, lse, seqlens_k, *, checked: bool = False, workspace=None) -> DecodeLaunch:
    """``checked``: choose_kernel has already found that decode_unsupported is None.
    ``workspace``: as DecodeLaunch takes it."""
    plan = decode_plan_for(problem, q, k, v, out, checked=checked)
    plan(q, k, v, out, lse, seqlens_k, workspace)
    return plan


def _launch_decode_forced_splits(problem: Problem, q, k, v, out, lse, seqlens_k, num_splits: int, workspace=None,
                                 block_m: int | None = None, cluster: bool | None = None) -> DecodeLaunch:
    """launch_decode with ``num_splits`` key ranges (and ``block_m`` rows per
    CTA, when given) in place of decode_dispatch's choice: for the tests of
    the split path and the row layouts, and benchmarks/dev, not the API.
    ``cluster``: the splits merged in clusters (True: a ValueError where
    decode_cluster does not hold) or by the combine (False); None: as
    decode_cluster says."""
    _check_decode(problem, q, k, v, out)
    device = q.device.id
    arch = device_arch(device)
    if block_m is None:
        block_m = decode_dispatch(problem, sm_count(device), arch).block_m
    spec = _specs.decode_spec(problem.dtype, problem.head_dim, block_m, arch)
    if spec is None:
        raise ValueError(f"block_m: expected one of {_specs.decode_block_ms(problem.dtype)} that fits {arch.name}, got {block_m}")
    can = decode_cluster(problem, spec, num_splits, arch)
    if cluster and not can:
        raise ValueError(f"cluster: no cluster kernel for {num_splits} splits of this call on {arch.name}")
    plan = _decode_plan(problem, _layout(q, k, v, out), spec, num_splits, can if cluster is None else cluster)
    plan(q, k, v, out, lse, seqlens_k, workspace)
    return plan


# The GPU kernel families, in the order the public ``kernel=`` lists them: each
# launches a validated call and returns its plan ...
LAUNCH = {"rowwise": launch_rowwise, "tiled": launch_tiled, "hopper": launch_hopper, "decode": launch_decode}
# ... or only makes the plan (checked as the launch would).
PLAN_FOR = {"rowwise": rowwise_plan_for, "tiled": tiled_plan_for, "hopper": hopper_plan_for, "decode": decode_plan_for}

def choose_kernel(problem: Problem, q, k, v, out) -> str:
    """The kernel ``kernel="auto"`` runs for this call: the decode kernel where
    it runs the call and decode_dispatch's cost model finds it faster than
    the prefill kernel (a few query tokens against a cache, for any number of
    query heads per KV head), else the Hopper kernel on sm_90 where it is
    the faster tensor-core kernel (_specs.HOPPER_AUTO_MIN_KEYS keys or
    more, HOPPER_BULK_QO_AUTO_MIN_KEYS where it moves Q and out by bulk
    copies; varlen: max_seqlen_k) or the only
    one, else the mma.sync tensor-core kernel, each when it supports the
    call, else the rowwise kernel, which runs anything."""
    if decode_unsupported(problem, q, k, v, out) is None:
        device = q.device.id
        if decode_dispatch(problem, sm_count(device), device_arch(device)).kernel == "decode":
            return "decode"
    tiled = tiled_unsupported(problem, q, k, v, out) is None
    if hopper_unsupported(problem, q, k, v, out) is None and (not tiled or problem.seqlen_k >= hopper_auto_min_keys(problem, q, out)):
        return "hopper"
    return "tiled" if tiled else "rowwise"


# --- the backward pass (kernels/backward.cu, api.attention_backward) ---------------

# The backward kernels' parameter struct (kernels/backward.cu: BwdParams).
BWD_PARAMS_DTYPE = np.dtype(
    [
        ("a", PARAMS_DTYPE), ("do_stride", np.int64, 4), ("dq_stride", np.int64, 4), ("dk_stride", np.int64, 4),
        ("dv_stride", np.int64, 4), ("lse_stride", np.int64, 3), ("scale", np.float64),
    ],
    align=True,
)  # fmt: skip
assert BWD_PARAMS_DTYPE.itemsize == 336


def backward_mma_unsupported(problem: Problem, arch: _specs.Arch) -> str | None:
    """Why the tensor-core backward kernels cannot run this call (the CUDA-core
    ones then do), or None. Layouts don't matter: other strides are copied."""
    if _specs.bwd_mma_specs(problem.dtype, problem.head_dim, problem.causal, arch) is None:
        return f"dtype {problem.dtype}, head_dim {problem.head_dim} on {arch.name}"
    if problem.mods is not None and problem.dtype == "float32":
        return "float32 with modifiers (the split-TF32 kernels take none)"
    return _scale_issue(problem)


def _vector_ok(a) -> bool:
    """Whether the tensor-core backward kernels can read or write ``a`` as 16-byte row vectors."""
    shape, strides = a.shape, a.strides
    if shape[3] > 1 and strides[3] != a.itemsize:
        return False
    return not any(n > 1 and s % 16 for n, s in zip(shape[:3], strides[:3])) and a.data.ptr % 16 == 0


# A tensor map as a kernel argument: CuPy passes a one-element NumPy array's bytes by value.
_MAP_ARG = np.dtype([("words", "<u8", (16,))])


@dataclass(frozen=True, eq=False)
class BackwardLaunch:
    """The three launches of one backward call: preprocess, dQ, dK/dV. The
    kernels with a producer warpgroup (bwd_dq_ws, bwd_dkdv_ws) also take tensor
    maps: of k and v (dQ), and of q and dout where ``bulk_rows`` (dK/dV),
    encoded at the first launch with each address and kept for the next."""

    pre: _specs.Spec
    dq: _specs.Spec
    dkdv: _specs.Spec
    grids: tuple  # of the three
    params: np.ndarray  # BWD_PARAMS_DTYPE, shape (1,)
    rows: int  # packed rows: batch * num_q_heads * seqlen_q (workspace values of each kind)
    layouts: tuple = ()  # _layout's (shape, byte strides, itemsize) of q, k, v and dout, for the tensor maps
    group: int = 1
    bulk_rows: bool = False  # bwd_dkdv_ws moves Q and dO by bulk copies (bwd_bulk_rows)
    mod_params: np.ndarray | None = None  # the modifiers' ModParams (_mods.MOD_PARAMS_DTYPE, shape (1,)), or None
    dsinks: _specs.Spec | None = None  # the sinks' gradient (bwd_dsinks), with sinks
    num_q_heads: int = 0

    MAPS_KEPT = 64  # encoded tensor maps kept per plan

    def __call__(self, dout, q, k, v, out, lse, dq, dk, dv, seqlens_k, dsinks=None) -> None:
        import cupy

        acc = cupy.float64 if self.pre.dtype == "float64" else cupy.float32
        work = cupy.empty(2 * self.rows, dtype=acc)  # delta, lse2: from CuPy's pool, on the current stream
        delta, lse2 = work[: self.rows], work[self.rows :]
        # float32 and float64: the dQ kernels rebuild lse2 from their own scores (kernels/backward.cu)
        lse_arg = None if self.pre.dtype in ("float32", "float64") else lse
        g_pre, g_dq, g_dkdv = self.grids
        prm = self.params  # CuPy passes a 1-element NumPy array by value (a few microseconds, three launches)
        mp = () if self.mod_params is None else (self.mod_params,)  # the *_mods kernels' ModParams
        dq_args = (q, k, v, dout, delta, lse2, dq, seqlens_k, prm, *mp)
        dkdv_args = (q, k, v, dout, delta, lse2, dk, dv, seqlens_k, prm, *mp)
        if _specs.is_bwd_ws(self.dq):
            dq_args += (self._map(1, k), self._map(2, v))
            if self.bulk_rows:
                dkdv_args += (self._map(0, q), self._map(3, dout), np.int32(1))
            else:
                dkdv_args += (_NO_MAP, _NO_MAP, np.int32(0))
        get_kernel(self.pre)(g_pre, (self.pre.threads,), (out, dout, lse_arg, delta, lse2, prm))
        get_kernel(self.dq)(g_dq, (self.dq.threads,), dq_args, shared_mem=self.dq.smem)
        get_kernel(self.dkdv)(g_dkdv, (self.dkdv.threads,), dkdv_args, shared_mem=self.dkdv.smem)
        if self.dsinks is not None:  # after the dQ kernel, which writes lse2 for float32 and float64
            get_kernel(self.dsinks)((self.num_q_heads,), (self.dsinks.threads,), (delta, lse2, dsinks, prm, *mp))

    def _map(self, which: int, a) -> np.ndarray:
        """The tensor map of argument ``which`` (0 q, 1 k, 2 v, 3 dout) at ``a``'s
        address: key tiles of the dQ kernel's BLOCK_N rows (k, v), or packed-row
        tiles of 64 rows (q, dout: the group's heads by 64 / group positions)."""
        maps = self.__dict__.setdefault("_maps", {})
        ptr = a.data.ptr
        arg = maps.get((which, ptr))
        if arg is None:
            shape, strides, itemsize = self.layouts[which]
            if which in (1, 2):
                encoded = _tma.tile_map(ptr, shape, strides, itemsize, self.dq.block_n)
            else:
                encoded = _tma.packed_map(ptr, shape, strides, itemsize, self.group, 64 // self.group)
            arg = np.frombuffer(encoded, _MAP_ARG).copy()
            if len(maps) >= self.MAPS_KEPT:
                maps.clear()
            maps[(which, ptr)] = arg
        return arg


_NO_MAP = np.zeros(1, _MAP_ARG)  # the argument of a map the kernel does not read


def bwd_ws_unsupported(layouts: tuple) -> str | None:
    """Why the backward kernels with a producer warpgroup can't take arrays of
    these layouts (_layout's of q, k, v and dout), or None: their dQ pass reads
    k and v by bulk tensor copies."""
    if not _tma.available():
        return "a CUDA driver without tensor maps (cuTensorMapEncodeTiled)"
    for name, (shape, strides, _) in zip(("k", "v"), layouts[1:3]):
        issue = _tma.geometry_issue(shape, strides)
        if issue is not None:
            return f"{name}: {issue}"
    return None


def bwd_bulk_rows(group: int, layouts: tuple) -> bool:
    """Whether bwd_dkdv_ws moves its Q and dO tiles by bulk tensor copies: a tile's 64 packed rows are whole positions of one group (the
    group divides 64), the driver encodes tensor maps, and q and dout are arrays
    the copy engine steps through."""
    q_layout, dout_layout = layouts[0], layouts[3]
    return (
        64 % group == 0
        and _tma.available()
        and all(_tma.geometry_issue(sh, st) is None for sh, st, _ in (q_layout, dout_layout))
    )


def bwd_tf32_dkdv_estimate(problem: Problem, spec: _specs.Spec, cost: float, arch: _specs.Arch, sms: int) -> float:
    """The time of ``spec``'s dK/dV grid for ``problem`` on ``sms`` SMs, in row
    tiles of cost ``cost`` each: its row tiles spread over every CTA the SMs hold
    at once, or its heaviest key block's, whichever is longer (the blocks start
    heaviest first: key blocks are the grid's slowest index)."""
    keys = spec.block_m  # keys per CTA
    rows = spec.block_n  # packed rows per row tile
    packed = problem.seqlen_q * problem.group_size
    n0 = np.arange(0, problem.seqlen_k, keys)
    if problem.causal:  # the first row that sees key n0 (bottom-right): rows [(n0 - diag) group, ..)
        first = np.clip(n0 - (problem.seqlen_k - problem.seqlen_q), 0, None) * problem.group_size
        first = np.where(first < packed, first // rows * rows, packed)
    else:
        first = np.zeros_like(n0)
    tiles = -(-(packed - first) // rows)
    per_sm = max(1, min((arch.smem + 1024) // (spec.smem + 1024), 2048 // spec.threads))  # (1 KB reserved a CTA)
    total = float(tiles.sum()) * problem.batch * problem.num_kv_heads
    return max(total / (sms * per_sm), float(tiles.max(initial=0))) * cost


@functools.lru_cache(maxsize=4096)
def plan_backward(problem: Problem, layout: tuple, arch: _specs.Arch, mma: bool, sms: int, device: int = 0) -> BackwardLaunch:
    """``layout``: _layout of (q, k, v, out, dout, dq, dk, dv) and lse's strides;
    ``sms``: the device's SMs (the float32 dK/dV kernel's key blocks follow the
    grid's length: _specs.BWD_TF32_DKDV_WIDE); ``device``: where a call with
    modifiers reads a mask_mod's buffers."""
    *arrays, lse_strides = layout
    params = np.zeros(1, BWD_PARAMS_DTYPE)
    params["a"] = make_params(problem, tuple(arrays[:4]))
    for field, (_, strides, itemsize) in zip(("do_stride", "dq_stride", "dk_stride", "dv_stride"), arrays[4:]):
        params[field] = element_strides(strides, itemsize)
    params["lse_stride"] = element_strides(lse_strides, 4)
    params["scale"] = problem.softmax_scale
    packed = problem.seqlen_q * problem.group_size
    if packed >= 2**31:
        raise ValueError(f"q: seqlen_q * group_size = {packed} (the backward kernels take < 2**31)")
    bh = problem.batch * problem.num_kv_heads
    # where the bulk copies can't read k and v, sm_90 takes the kernels without them
    sm90 = "mma" if bwd_ws_unsupported(tuple(arrays[:3]) + (arrays[4],)) is not None else None
    mod_params = dsinks = None
    if problem.mods is not None:
        dq, dkdv = _specs.bwd_mods_specs(problem.dtype, problem.head_dim, problem.causal, arch, problem.mods.flags,
                                         problem.mods.user_code(), mma, sm90)  # fmt: skip
        mod_params = np.frombuffer(problem.mods.params(device, problem.num_q_heads), _mods.MOD_PARAMS_DTYPE).copy()
        dsinks = _specs.BWD_DSINKS[problem.dtype] if problem.mods.sinks else None
    elif mma:
        dq, dkdv = _specs.bwd_mma_specs(problem.dtype, problem.head_dim, problem.causal, arch, sm90)
        wide = _specs.bwd_dkdv_tf32_spec(dkdv.head_dim, problem.causal, arch, wide=True) if problem.dtype == "float32" else None
        if wide is not None:
            cost = _specs.BWD_TF32_DKDV_WIDE[dkdv.head_dim][3]
            if bwd_tf32_dkdv_estimate(problem, wide, cost, arch, sms) < bwd_tf32_dkdv_estimate(problem, dkdv, 1.0, arch, sms):
                dkdv = wide
    else:
        dq, dkdv = _specs.bwd_rows_specs(problem.dtype, problem.head_dim)
    rows = problem.batch * problem.num_q_heads * problem.seqlen_q
    pre = _specs.BWD_PREPROCESS[problem.dtype]
    grids = (
        (grid_stride_blocks(rows * 32, pre.threads),),
        (math.ceil(packed / dq.block_m) * bh,),  # block_m: packed rows per CTA
        (math.ceil(problem.seqlen_k / dkdv.block_m) * bh,),  # block_m: keys per CTA
    )
    if max(g[0] for g in grids) > MAX_GRID_X:
        raise ValueError(f"q: too many rows for one launch ({max(g[0] for g in grids)} blocks > {MAX_GRID_X})")
    maps = tuple(arrays[:3]) + (arrays[4],)  # q, k, v, dout
    bulk = _specs.is_bwd_ws(dkdv) and bwd_bulk_rows(problem.group_size, maps)
    return BackwardLaunch(pre, dq, dkdv, grids, params, rows, maps, problem.group_size, bulk, mod_params, dsinks,
                          problem.num_q_heads)


def set_bwd_sm90(kind: str) -> str:
    """Make 16-bit backward calls on sm_90 take the dQ and dK/dV kernels of
    ``kind`` from now on, in this process (_specs.BWD_SM90_KINDS: "mma", "ws");
    returns the previous kind. For the tests and benchmarks that run both: the
    backward plans made before are forgotten."""
    if kind not in _specs.BWD_SM90_KINDS:
        raise ValueError(f"kind: expected one of {_specs.BWD_SM90_KINDS}, got {kind!r}")
    old, _specs.BWD_SM90 = _specs.BWD_SM90, kind
    plan_backward.cache_clear()
    return old


def launch_backward(problem: Problem, dout, q, k, v, out, lse, dq, dk, dv, seqlens_k=None, dsinks=None) -> None:
    """The backward pass of a validated call (arrays in (batch, seqlen, heads,
    head_dim) order, non-empty), and with sinks their gradient into ``dsinks``.
    The tensor-core kernels (fp16, bf16, float32) read and write 16-byte row
    vectors: arrays in other layouts go through contiguous copies (inputs are
    never modified); the CUDA-core kernels take any strides."""
    import cupy

    arch = device_arch(q.device.id)
    mma = backward_mma_unsupported(problem, arch) is None
    targets = (dq, dk, dv)
    bits = np.dtype(f"u{q.itemsize}")  # copies move the bit patterns, whatever CuPy makes of the dtype
    if mma:
        q, k, v, dout = (a if _vector_ok(a) else cupy.ascontiguousarray(a.view(bits)).view(a.dtype) for a in (q, k, v, dout))
        dq, dk, dv = (a if _vector_ok(a) else cupy.empty(a.shape, a.dtype) for a in (dq, dk, dv))
    layout = (*_layout(q, k, v, out, dout, dq, dk, dv), lse.strides)
    plan = plan_backward(problem, layout, arch, mma, sm_count(q.device.id), q.device.id)
    plan(dout, q, k, v, out, lse, dq, dk, dv, seqlens_k, dsinks)
    for target, result in zip(targets, (dq, dk, dv)):
        if result is not target:
            target.view(bits)[...] = result.view(bits)
