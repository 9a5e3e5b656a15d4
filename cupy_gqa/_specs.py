"""The one table of compiled kernel specializations.

Every CUDA template instantiation that cupy_gqa can launch is listed here, and
nowhere else: the runtime compile cache, ``python -m cupy_gqa compile`` and the
tests all read :data:`SPECS`. Reading this file tells you what is supported.
"""
from __future__ import annotations

from dataclasses import dataclass

# dtype name (numpy / ml_dtypes spelling) -> C++ storage type in the kernels.
CTYPES = {
    "float32": "float",
    "float16": "__half",
    "bfloat16": "__nv_bfloat16",
    "float64": "double",
}
DTYPES = tuple(CTYPES)
ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}

MAX_HEAD_DIM = 256


@dataclass(frozen=True)
class Spec:
    """One template instantiation of one kernel family."""

    family: str  # kernel family, also the public ``kernel=`` name
    source: str  # file under kernels/
    name: str  # C++ name expression handed to NVRTC
    dtype: str
    head_dim: int  # largest head_dim this instantiation serves
    threads: int  # threads per block
    team: int = 1  # rowwise: threads that share one query row
    block_m: int = 0  # tiled, decode: packed query rows per CTA
    smem: int = 0  # dynamic shared memory per block, bytes (the kernel's SMEM_BYTES, checked there)
    options: tuple = ()  # extra NVRTC options
    arch: str | None = None  # the one target it is built for (e.g. "sm_90a"); None: the device's own


# --- rowwise: one query row per thread (team) ----------------------------------
# head_dim is rounded up to a bucket; unused dims are zeros. TEAM lanes share a
# row so that each lane's slice of q and of the accumulator stays in registers
# (ptxas reports no spills): at most 32 dims per lane, 16 for fp64. K and V pass
# through shared memory in stages of KEYS rows, about 4 KB per stage of K.
# VEC: 16-byte cp.async loads (unit-stride, 16-byte aligned rows, head_dim a
# multiple of the 16-byte element count); the other variant takes any strides.
ROWWISE_BUCKETS = (8, 16, 32, 64, 128, 256)
ROWWISE_THREADS = 128  # kernels/rowwise.cu: ROWWISE_THREADS


def _rowwise_team(dtype: str, dpad: int) -> int:
    per_lane = 16 if dtype == "float64" else 32
    return max(1, dpad // per_lane)


def _rowwise_keys(dtype: str, dpad: int) -> int:
    return max(8, min(64, 4096 // (dpad * ITEMSIZE[dtype])))


def rowwise_smem(dtype: str, dpad: int) -> int:
    """Two stages of K and of V, KEYS rows of DPAD elements each (kernels/rowwise.cu:
    RowwiseSmem; the kernel refuses to compile with another SMEM_BYTES)."""
    return 2 * 2 * _rowwise_keys(dtype, dpad) * dpad * ITEMSIZE[dtype]


def vec_width(dtype: str) -> int:
    """Elements in one 16-byte load."""
    return 16 // ITEMSIZE[dtype]


ROWWISE = {
    (dtype, dpad, vec): Spec(
        family="rowwise",
        source="rowwise.cu",
        name=(
            f"rowwise_attention<{CTYPES[dtype]}, {dpad}, {_rowwise_team(dtype, dpad)}, {str(vec).lower()}, "
            f"{_rowwise_keys(dtype, dpad)}, {rowwise_smem(dtype, dpad)}>"
        ),
        dtype=dtype,
        head_dim=dpad,
        threads=ROWWISE_THREADS,
        team=_rowwise_team(dtype, dpad),
        smem=rowwise_smem(dtype, dpad),
    )
    for dtype in DTYPES
    for dpad in ROWWISE_BUCKETS
    for vec in (True, False)
}


def rowwise_spec(dtype: str, head_dim: int, vec: bool) -> Spec:
    dpad = next(b for b in ROWWISE_BUCKETS if b >= head_dim)
    return ROWWISE[dtype, dpad, vec]


# --- tiled: tensor-core prefill, fp16 / bf16 ------------------------------------
# head_dim -> (BLOCK_M packed query rows per CTA, BLOCK_N keys per K/V tile,
# NUM_WARPS), chosen by measurement on the H200 (benchmarks/NOTES_tiled.md).
TILED_TILES = {
    32: (128, 64, 4),
    64: (128, 64, 4),
    96: (128, 64, 8),
    128: (128, 64, 4),
    256: (64, 32, 4),
}
TILED_DTYPES = ("float16", "bfloat16")


def tiled_smem(head_dim: int, block_m: int, block_n: int) -> int:
    """Dynamic shared memory of kernels/tiled.cu: a Q tile and two K and two V
    stages, rows padded by 8 elements, 2-byte elements (tiled_detail::Smem;
    the kernel refuses to compile with another SMEM_BYTES)."""
    return (block_m + 4 * block_n) * (head_dim + 8) * 2


TILED = {
    (dtype, head_dim, causal): Spec(
        family="tiled",
        source="tiled.cu",
        name=(
            f"tiled_attention<{CTYPES[dtype]}, {head_dim}, {bm}, {bn}, {warps}, {str(causal).lower()}, "
            f"{tiled_smem(head_dim, bm, bn)}>"
        ),
        dtype=dtype,
        head_dim=head_dim,
        threads=warps * 32,
        block_m=bm,
        smem=tiled_smem(head_dim, bm, bn),
    )
    for dtype in TILED_DTYPES
    for head_dim, (bm, bn, warps) in TILED_TILES.items()
    for causal in (True, False)
}

# --- tiled, float32: split-TF32 tensor cores (kernels/tiled_tf32.cu) ----------
# precision "highest": three TF32 products per product (fp32-class error);
# "tf32": one (about 1e-3 relative error).
# head_dim -> (BLOCK_M, BLOCK_N, NUM_WARPS, PRESPLIT). PRESPLIT ("highest" only)
# is where the operands are split into TF32 parts: 0 per warp in registers,
# 1 K and V once per CTA in shared memory, 2 also Q (kernels/tiled_tf32.cu). The
# largest mode that keeps 2 CTAs per SM (1 at D256, where 2 never fit; 2 would
# not fit at all).
PRECISIONS = ("highest", "tf32")
TILED_F32_TILES = {
    32: (64, 32, 4, 2),
    64: (64, 32, 4, 2),
    96: (64, 32, 4, 1),
    128: (64, 16, 4, 1),
    256: (64, 16, 4, 1),
}


def tiled_f32_smem(head_dim: int, block_m: int, block_n: int, presplit: int) -> int:
    """Dynamic shared memory of kernels/tiled_tf32.cu: a Q tile, two K and two
    V stages, and the side tiles of the small parts (one K and one V tile from
    presplit 1, the Q tile at 2); rows padded by 4 floats (tf32_detail::Smem;
    the kernel refuses to compile with another SMEM_BYTES)."""
    tiles = block_m + 4 * block_n + (2 * block_n if presplit >= 1 else 0) + (block_m if presplit == 2 else 0)
    return tiles * (head_dim + 4) * 4


def tiled_f32_spec(head_dim: int, causal: bool, precision: str) -> Spec:
    """The float32 tiled kernel for one (head_dim, causal, precision)."""
    bm, bn, warps, presplit = TILED_F32_TILES[head_dim]
    split = precision == "highest"
    presplit = presplit if split else 0
    smem = tiled_f32_smem(head_dim, bm, bn, presplit)
    return Spec(
        family="tiled",
        source="tiled_tf32.cu",
        name=(
            f"tiled_tf32_attention<{head_dim}, {bm}, {bn}, {warps}, {str(causal).lower()}, "
            f"{str(split).lower()}, {presplit}, {smem}>"
        ),
        dtype="float32",
        head_dim=head_dim,
        threads=warps * 32,
        block_m=bm,
        smem=smem,
    )


TILED_F32 = {
    (head_dim, causal, precision): tiled_f32_spec(head_dim, causal, precision)
    for head_dim in TILED_F32_TILES
    for causal in (True, False)
    for precision in PRECISIONS
}


def tiled_head_dims(dtype: str) -> tuple:
    """The head dims the tiled kernel takes in this dtype (none: not at all)."""
    return tuple(TILED_F32_TILES) if dtype == "float32" else tuple(TILED_TILES) if dtype in TILED_DTYPES else ()


# --- hopper: wgmma prefill for sm_90, fp16 / bf16 (kernels/hopper.cu) ---------
# Padded head dim -> (BLOCK_M packed rows per CTA, 64 per consumer warpgroup;
# BLOCK_N keys per K/V tile; STAGES of K/V in the producer's ring). head_dim is
# padded to the next of these (any multiple of 8 up to 256 runs).
HOPPER_TILES = {
    64: (128, 128, 4),
    128: (128, 128, 3),
    192: (128, 96, 2),
    256: (128, 64, 2),
}
HOPPER_DTYPES = ("float16", "bfloat16")
HOPPER_ARCH = "sm_90a"
# Padded head dims at which kernel="auto" prefers hopper to tiled when both
# apply, as measured on the H200 (benchmarks/NOTES_hopper.md); where tiled
# does not apply (head_dim 80, 160, 192, ...), auto takes hopper anyway.
HOPPER_AUTO_OVER_TILED = {64: False, 128: False, 192: True, 256: True}


def hopper_head_dim_pad(head_dim: int) -> int:
    """The padded head dim of the hopper kernel that serves ``head_dim``."""
    return next(d for d in HOPPER_TILES if d >= head_dim)


def hopper_smem(head_dim_pad: int, block_m: int, block_n: int, stages: int) -> int:
    """Dynamic shared memory of kernels/hopper.cu, HopperSmem::BYTES (the kernel
    static_asserts that the two agree): the Q tile and STAGES K and V tiles,
    2-byte elements, 8-byte mbarriers, 1024 bytes of alignment slack."""
    return (block_m + 2 * stages * block_n) * head_dim_pad * 2 + 8 * (1 + 2 * stages) + 1024


HOPPER = {
    (dtype, dpad, causal): Spec(
        family="hopper",
        source="hopper.cu",
        name=(
            f"hopper_attention<{CTYPES[dtype]}, {dpad}, {bm}, {bn}, {stages}, {str(causal).lower()}, "
            f"{hopper_smem(dpad, bm, bn, stages)}>"
        ),
        dtype=dtype,
        head_dim=dpad,
        threads=bm // 64 * 128 + 128,  # consumer warpgroups and one producer warpgroup
        block_m=bm,
        smem=hopper_smem(dpad, bm, bn, stages),
        options=(f"-arch={HOPPER_ARCH}",),
        arch=HOPPER_ARCH,
    )
    for dtype in HOPPER_DTYPES
    for dpad, (bm, bn, stages) in HOPPER_TILES.items()
    for causal in (True, False)
}

# --- decode: split-KV, a few query tokens against a long KV cache --------------
# One CTA takes block_m packed rows (seqlen_q * group_size of them, in row
# blocks beyond that) of one (batch, KV head) and one key range
# (kernels/decode.cu); a second kernel merges the key ranges.
#   fp16 / bf16: tensor cores (decode_mma_attention), 16 rows per CTA, each of
#     DECODE_MMA_WARPS warps streaming its own key tiles of DECODE_MMA_BN keys
#     through a cp.async pipeline of DECODE_MMA_STAGES[head_dim] stages.
#   float32: CUDA cores (decode_attention), DECODE_ROWS rows per CTA; 8 dims of
#     each row per lane keep q and the accumulator in registers (no spills).
DECODE_DTYPES = ("float16", "bfloat16", "float32")
DECODE_HEAD_DIMS = (64, 128, 256)
DECODE_MAX_SEQLEN_Q = 16
DECODE_ROWS = (1, 2, 4, 8)
DECODE_THREADS = 128  # kernels/decode.cu: DECODE_THREADS
DECODE_MMA_DTYPES = ("float16", "bfloat16")
DECODE_MMA_ROWS = 16
DECODE_MMA_WARPS = 4  # kernels/decode.cu: DECODE_MMA_WARPS
DECODE_MMA_BN = 16  # kernels/decode.cu: DECODE_MMA_BN
DECODE_MMA_STAGES = {64: 3, 128: 3, 256: 2}  # per warp; 2 CTAs per SM at D128, 1 at D256
# CTAs per SM that the split rule (_plan.decode_num_splits) fills: one CTA of
# the tensor-core kernel keeps ~64 KB in flight, enough for the SM's share of
# HBM, and every extra split costs the combine (H200, benchmarks/NOTES_decode.md);
# the CUDA-core kernel needs all its resident CTAs (None) to hide its issue time.
DECODE_WAVE_CTAS = {"float16": 1, "bfloat16": 1, "float32": None}


def decode_mma_smem(head_dim: int, stages: int) -> int:
    """Dynamic shared memory of decode_mma_attention: the Q tile (rows padded by
    8 elements), then each warp's stages of a K and a V tile (swizzled rows of
    head_dim elements), or, when larger, the fp32 (m, l, o) of every warp's rows
    that replace them (decode_detail::MmaSmem; the kernel refuses to compile
    with another SMEM_BYTES)."""
    stages_bytes = DECODE_MMA_WARPS * stages * 2 * DECODE_MMA_BN * head_dim * 2
    merge_bytes = DECODE_MMA_WARPS * DECODE_MMA_ROWS * (head_dim + 2) * 4
    return DECODE_MMA_ROWS * (head_dim + 8) * 2 + max(stages_bytes, merge_bytes)


def decode_mma_spec(dtype: str, head_dim: int) -> Spec:
    """The tensor-core decode kernel for one (dtype, head_dim)."""
    stages = DECODE_MMA_STAGES[head_dim]
    smem = decode_mma_smem(head_dim, stages)
    return Spec(
        family="decode",
        source="decode.cu",
        name=f"decode_mma_attention<{CTYPES[dtype]}, {head_dim}, {stages}, {smem}>",
        dtype=dtype,
        head_dim=head_dim,
        threads=DECODE_MMA_WARPS * 32,
        block_m=DECODE_MMA_ROWS,
        smem=smem,
    )


def decode_cuda_core_spec(dtype: str, head_dim: int, rows: int) -> Spec:
    """decode_attention (CUDA cores) for ``rows`` packed rows per CTA."""
    return Spec(
        family="decode",
        source="decode.cu",
        name=f"decode_attention<{CTYPES[dtype]}, {head_dim}, {rows}>",
        dtype=dtype,
        head_dim=head_dim,
        threads=DECODE_THREADS,
        block_m=rows,
    )


DECODE = {
    **{
        (dtype, head_dim, DECODE_MMA_ROWS): decode_mma_spec(dtype, head_dim)
        for dtype in DECODE_MMA_DTYPES
        for head_dim in DECODE_HEAD_DIMS
    },
    **{("float32", head_dim, rows): decode_cuda_core_spec("float32", head_dim, rows)
       for head_dim in DECODE_HEAD_DIMS for rows in DECODE_ROWS},
}
DECODE_COMBINE = {
    dtype: Spec(
        family="decode",
        source="decode.cu",
        name=f"decode_combine<{CTYPES[dtype]}>",
        dtype=dtype,
        head_dim=max(DECODE_HEAD_DIMS),
        threads=128,
    )
    for dtype in DECODE_DTYPES
}


def decode_spec(dtype: str, head_dim: int, rows: int) -> Spec:
    """The decode kernel for ``rows`` = seqlen_q * group_size packed rows."""
    if dtype in DECODE_MMA_DTYPES:
        return DECODE[dtype, head_dim, DECODE_MMA_ROWS]
    fit = next((r for r in DECODE_ROWS if r >= rows), DECODE_ROWS[-1])
    return DECODE[dtype, head_dim, fit]


SPECS: tuple[Spec, ...] = (
    *ROWWISE.values(), *TILED.values(), *TILED_F32.values(), *HOPPER.values(), *DECODE.values(), *DECODE_COMBINE.values()
)
