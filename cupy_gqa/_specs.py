"""The one table of compiled kernel specializations, per GPU architecture.

Every CUDA template instantiation that cupy_gqa can launch is listed here, and
nowhere else: the runtime compile cache, ``python -m cupy_gqa compile`` and the
tests all read it. :data:`ARCHS` lists the architecture families with the
shared memory a block may take; each ``*_spec`` function gives the
specialization of a kernel family for a call on one architecture (None where
the family doesn't run there), :func:`specs_for` an architecture's whole table
and :data:`SPECS` the union. Reading this file tells you what is supported.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Arch:
    """A GPU architecture family: what its kernels may use."""

    name: str  # sm_XX, the NVRTC target
    smem: int  # largest dynamic shared memory of one block (opt-in), bytes
    sm80: bool  # cp.async, ldmatrix and bf16 mma.sync (compute capability 8.0 and newer)

    @property
    def clusters(self) -> bool:
        """Thread-block clusters and distributed shared memory (9.0 and newer)."""
        return int(self.name[3:]) >= 90

    @property
    def dependent_launch(self) -> bool:
        """Programmatic dependent launches (griddepcontrol; 9.0 and newer)."""
        return int(self.name[3:]) >= 90


ARCHS = {
    a.name: a
    for a in (
        Arch("sm_70", 98304, False),  # V100
        Arch("sm_75", 65536, False),  # T4, RTX 20xx
        Arch("sm_80", 166912, True),  # A100, A30
        Arch("sm_86", 101376, True),  # RTX 30xx, A10, A40, RTX A6000
        Arch("sm_87", 166912, True),  # Jetson Orin
        Arch("sm_89", 101376, True),  # RTX 40xx, L4, L40
        Arch("sm_90", 232448, True),  # H100, H200
        Arch("sm_100", 232448, True),  # B200
        Arch("sm_120", 101376, True),  # RTX 50xx
    )
}


@functools.lru_cache(maxsize=None)
def arch_of(major: int, minor: int) -> Arch:
    """The family of a device of compute capability major.minor: its own, else
    the nearest older one (sm_72 -> sm_70, sm_103 -> sm_100)."""
    cc = major * 10 + minor
    known = sorted(ARCHS.values(), key=lambda a: int(a.name[3:]))
    older = [a for a in known if int(a.name[3:]) <= cc]
    if not older:
        raise ValueError(f"compute capability {major}.{minor} is older than any architecture cupy_gqa builds for ({known[0].name})")
    same_major = [a for a in older if int(a.name[3:]) // 10 == major]
    return (same_major or older)[-1]

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
    block_m: int = 0  # tiled, decode, hopper: packed query rows per CTA
    block_n: int = 0  # hopper: keys per tile (the rows of a tensor-map box); float32 dK/dV: packed rows per Q/dO tile
    smem: int = 0  # dynamic shared memory per block, bytes (the kernel's SMEM_BYTES, checked there)
    options: tuple = ()  # extra NVRTC options
    arch: str | None = None  # the one target it is built for (e.g. "sm_90a"); None: the device's own
    sm80: bool = True  # uses cp.async / ldmatrix / mma.sync: compute capability 8.0 or newer
    mods: int = 0  # the modifiers' FLAGS (_mods.MOD_*) of a *_mods instantiation; 0: none
    user_code: str = ""  # the CUDA code of user modifiers (ScoreMod, MaskMod), put into common.cuh


MODS_FAMILIES = ("rowwise", "tiled", "hopper", "decode")  # the kernel families that take modifiers
# The backward's kernels that take them (backward.cu: *_mods; float32 calls with
# modifiers run the CUDA-core pair, not split TF32), and no score_mod (its derivative).
BWD_MODS_KERNELS = ("bwd_dq_mma<", "bwd_dkdv_mma<", "bwd_dq_ws<", "bwd_dkdv_ws<", "bwd_dq_rows<", "bwd_dkdv_rows<")


def takes_mods(spec: Spec) -> bool:
    """Whether ``spec``'s kernel has a *_mods instantiation."""
    if spec.family == "backward":
        return spec.name.startswith(BWD_MODS_KERNELS)
    return spec.family in MODS_FAMILIES and not is_decode_cluster(spec) and not is_f16x2_prep(spec)


def with_mods(spec: Spec, flags: int, user_code: str = "") -> Spec:
    """The instantiation of ``spec``'s kernel with the modifiers ``flags``
    (kernels/*.cu: ``<name>_mods<..., FLAGS>``), or ``spec`` itself for none.
    The combine kernel of decode only needs the sinks."""
    if spec.family == "decode" and not spec.block_m:  # decode_combine: sinks only
        flags &= 8  # _mods.MOD_SINKS
        user_code = ""
    if not flags:
        return spec
    assert takes_mods(spec), spec.name
    assert not (spec.family == "backward" and flags & 16), "the backward pass takes no score_mod"
    if flags & (4 | 16 | 32):  # _mods.MOD_ALIBI, MOD_SCORE, MOD_MASK
        spec = _two_consumer_warpgroups(spec)
    kernel, args, spec = _sixteen_rows_per_warp(spec)
    return replace(spec, name=f"{kernel}_mods<{args[:-1]}, {flags}>", mods=flags, user_code=user_code)


def with_serial_pv(spec: Spec) -> Spec:
    """``spec``, a hopper instantiation with a score_mod in units, whose softmax waits for
    the last tile's P V (kernels/common.cuh: MOD_SERIAL_PV): what _compile.get_kernel
    takes where the user's code does not fit the registers of the softmax beside P V."""
    from ._mods import MOD_SERIAL_PV

    flags = spec.mods | MOD_SERIAL_PV
    head, last = spec.name[:-1].rsplit(", ", 1)
    assert spec.family == "hopper" and int(last) == spec.mods, spec.name
    return replace(spec, name=f"{head}, {flags}>", mods=flags)


def _sixteen_rows_per_warp(spec: Spec) -> tuple:
    """(kernel name, template arguments, spec) of ``spec`` for an instantiation
    that adds registers (modifiers, per-sequence addressing): the tiled kernel
    at head_dim 96 and up with 32 rows per warp takes 16 (twice the warps, same
    tile), where the extra registers fit."""
    kernel, args = spec.name.split("<", 1)
    if spec.source == "tiled.cu" and spec.head_dim >= 96 and spec.block_m // (spec.threads // 32) > 16:
        warps = spec.block_m // 16
        parts = args[:-1].split(", ")
        parts[4] = str(warps)  # T, HEAD_DIM, BLOCK_M, BLOCK_N, NUM_WARPS, CAUSAL, SMEM_BYTES
        args, spec = ", ".join(parts) + ">", replace(spec, threads=warps * 32)
    return kernel, args, spec


SEQ_FAMILIES = ("rowwise", "tiled", "hopper", "decode")  # the kernel families with per-sequence addressing
# The float32 tiled kernel's head dims with per-sequence addressing: at 256 its
# registers spill (the calls run rowwise).
TILED_F32_SEQ_HEAD_DIMS = (32, 64, 96, 128)
SEQ_ADDRS = (1, 2, 4, 6)  # the SEQ_* sums the API makes (_seq.py): varlen; paged; left padding; paged and left padding


def seq_addrs(family: str) -> tuple:
    """The SEQ_* sums kernel family ``family`` takes (every family of
    SEQ_FAMILIES takes them all)."""
    return SEQ_ADDRS if family in SEQ_FAMILIES else ()


def with_seq(spec: Spec, addr: int) -> Spec:
    """The instantiation of ``spec``'s kernel with the per-sequence addressing
    ``addr`` (kernels/common.cuh: SEQ_*; kernels/*.cu: ``<name>_seq<..., ADDR>``),
    or ``spec`` itself for 0. A ``spec`` with modifiers (with_mods) becomes
    ``<name>_seq_mods<..., ADDR, FLAGS>``."""
    if not addr:
        return spec
    assert addr in seq_addrs(spec.family), (spec.family, addr)
    kernel, args, spec = _sixteen_rows_per_warp(spec)
    if spec.mods:
        base, flags = kernel.removesuffix("_mods"), args[:-1].rsplit(", ", 1)
        return replace(spec, name=f"{base}_seq_mods<{flags[0]}, {addr}, {flags[1]}>")
    return replace(spec, name=f"{kernel}_seq<{args[:-1]}, {addr}>")


def seq_check_specs(arch: "Arch") -> tuple:
    """Every per-sequence instantiation of ``arch``'s table, for the compile
    checks (registers, spills; tests/test_compile.py, ``python -m cupy_gqa compile --seq``)."""
    picked: dict[str, Spec] = {}
    for spec in specs_for(arch):
        if spec.source == "tiled_tf32.cu" and spec.head_dim not in TILED_F32_SEQ_HEAD_DIMS:
            continue
        if spec.family in SEQ_FAMILIES and not is_decode_cluster(spec):  # the cluster kernel: contiguous only
            for addr in seq_addrs(spec.family):
                s = with_seq(spec, addr)
                if s is not spec:
                    picked.setdefault(s.name, s)
    return tuple(picked.values())


# Instantiations with every built-in modifier (FLAGS 15), one per kernel file, for
# the compile checks (registers, spills; tests/test_compile.py).
def seq_mods_check_specs(arch: "Arch", flags: int = 15) -> tuple:
    """Every per-sequence instantiation of ``arch``'s table with the modifiers
    ``flags`` (``<name>_seq_mods<..., ADDR, FLAGS>``), for the compile checks;
    the decode combine's takes the sinks alone."""
    picked: dict[str, Spec] = {}
    for spec in specs_for(arch):
        if spec.source == "tiled_tf32.cu" and spec.head_dim not in TILED_F32_SEQ_HEAD_DIMS:
            continue
        if spec.family in SEQ_FAMILIES and not is_decode_cluster(spec) and not is_f16x2_prep(spec):
            for addr in seq_addrs(spec.family):
                s = with_seq(with_mods(spec, flags), addr)
                picked.setdefault(s.name, s)
    return tuple(picked.values())


def mods_check_specs(arch: "Arch") -> tuple:
    picked: dict[str, Spec] = {}
    for spec in specs_for(arch):
        if takes_mods(spec) and spec.family != "backward":
            s = with_mods(spec, 15)
            picked.setdefault(s.name, s)
    for s in bwd_mods_check_specs(arch, 15):
        picked.setdefault(s.name, s)
    return tuple(picked.values())


def bwd_mods_check_specs(arch: "Arch", flags: int) -> tuple:
    """The backward's *_mods instantiations of ``arch`` with the modifiers ``flags``,
    as bwd_mods_specs picks them for every dtype, head dim and kind (the
    tensor-core ones of bf16: fp16's are the same code on other types)."""
    picked: dict[str, Spec] = {}
    for dtype in DTYPES:
        for head_dim in (*BWD_MMA_HEAD_DIMS, *ROWWISE_BUCKETS):
            for causal in (True, False):
                for cores in (True, False) if dtype != "float16" else (False,):
                    for kind in BWD_SM90_KINDS:
                        for s in bwd_mods_specs(dtype, head_dim, causal, arch, flags, "", cores, kind):
                            picked.setdefault(s.name, s)
    return tuple(picked.values())


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
        sm80=vec,  # the vector variant copies with cp.async; the other runs everywhere
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


@functools.lru_cache(maxsize=None)
def tiled_spec(dtype: str, head_dim: int, causal: bool, arch: Arch) -> Spec | None:
    """The fp16 / bf16 tiled kernel for one (dtype, head_dim, causal) on ``arch``:
    the table's tile, with BLOCK_N halved (down to 16) until it fits the
    architecture's shared memory; None on a GPU without sm_80 features, or
    when no tile fits."""
    bm, bn, warps = TILED_TILES[head_dim]
    while tiled_smem(head_dim, bm, bn) > arch.smem and bn > 16:
        bn //= 2
    smem = tiled_smem(head_dim, bm, bn)
    if not arch.sm80 or smem > arch.smem:
        return None
    return Spec(
        family="tiled",
        source="tiled.cu",
        name=f"tiled_attention<{CTYPES[dtype]}, {head_dim}, {bm}, {bn}, {warps}, {str(causal).lower()}, {smem}>",
        dtype=dtype,
        head_dim=head_dim,
        threads=warps * 32,
        block_m=bm,
        smem=smem,
    )


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


# precision "highest" multiplies float32 on the tensor cores in one of two ways,
# each three products per product, each fp32-accurate on the tests' inputs:
#   "tf32x3"  split TF32 (kernels/tiled_tf32.cu), at TF32's rate;
#   "f16x2"   fp16 pairs (kernels/tiled_f16x2.cu), at fp16's rate (twice TF32's),
#             each tile scaled by a power of two into fp16's range.
# The calls take fp16 pairs, 1.85 times split TF32's speed at F1 on the H200
# (benchmarks/NOTES_hopper.md), where their table has the head dim and the tile
# fits and the call has F32_PAIRS_MIN_FLOPS of visible products or more; split
# TF32 elsewhere (head dim 256, 99 KB GPUs at 128, and small calls, where the
# pairs' two extra launches cost more than their rate saves: about 12 us against
# 7.4 us saved per GFLOP at F2, benchmarks/NOTES_hopper.md). F32_HIGHEST, when
# set (_plan.set_f32_highest: the tests and benchmarks that run both), makes
# every call take that scheme. Both are compiled and tested (dev/tf32_ab.py).
F32_HIGHEST: str | None = None
F32_PRODUCTS = ("tf32x3", "f16x2")
F32_PAIRS_MIN_FLOPS = 2e9
# head_dim -> (BLOCK_M, BLOCK_N, NUM_WARPS) of kernels/tiled_f16x2.cu: fp16 pairs
# of a Q tile and two stages of K and V pairs (made once per call, in a workspace,
# by its first two kernels); two CTAs per SM on the 227 KB GPUs. Not at head dim
# 256, whose O (128 registers a thread) spills there: split TF32 takes it, as it
# takes a head dim whose tile does not fit.
# The head dims 64 and 128 take the tiles that timed fastest beside the others in one
# process (benchmarks/NOTES_hopper.md: 128 rows of 8 warps at 128, 16-key tiles at 64).
TILED_F16X2_TILES = {
    32: (64, 64, 4),
    64: (64, 16, 4),
    96: (64, 32, 4),
    128: (128, 32, 8),
}
F16X2_PREP_THREADS = 128  # kernels/tiled_f16x2.cu: f16x2_detail::PREP_THREADS


def tiled_f16x2_smem(head_dim: int, block_m: int, block_n: int) -> int:
    """Dynamic shared memory of kernels/tiled_f16x2.cu (f16x2_detail::F16x2Smem):
    the fp16 pairs of a Q tile and two stages of the pairs of a K and a V tile
    (rows of head_dim + 8 halves), and 16 bytes for Q's max."""
    return (2 * block_m + 8 * block_n) * (head_dim + 8) * 2 + 16


@functools.lru_cache(maxsize=None)
def tiled_f16x2_spec(head_dim: int, causal: bool, arch: Arch) -> Spec | None:
    """The float32 fp16-pair tiled kernel for one (head_dim, causal) on ``arch``,
    or None where it does not fit or without sm_80."""
    if head_dim not in TILED_F16X2_TILES:
        return None
    bm, bn, warps = TILED_F16X2_TILES[head_dim]
    smem = tiled_f16x2_smem(head_dim, bm, bn)
    if not arch.sm80 or smem > arch.smem:
        return None
    return Spec(
        family="tiled",
        source="tiled_f16x2.cu",
        name=f"tiled_f16x2_attention<{head_dim}, {bm}, {bn}, {warps}, {str(causal).lower()}, {smem}>",
        dtype="float32",
        head_dim=head_dim,
        threads=warps * 32,
        block_m=bm,
        block_n=bn,
        smem=smem,
    )


F16X2_PREP = ("f16x2_v_exponents", "f16x2_kv_pairs")  # the kernels that make the K and V pairs, in launch order


def f16x2_prep_specs(spec: Spec) -> tuple[Spec, Spec]:
    """The two kernels that make the pairs of K and V for tiled_f16x2 ``spec``
    (its head dim and key tile; kernels/tiled_f16x2.cu), in launch order."""
    return tuple(
        Spec(
            family="tiled",
            source="tiled_f16x2.cu",
            name=f"{kernel}<{spec.head_dim}, {spec.block_n}>",
            dtype="float32",
            head_dim=spec.head_dim,
            threads=F16X2_PREP_THREADS,
            block_n=spec.block_n,
        )
        for kernel in F16X2_PREP
    )


def is_f16x2_prep(spec: Spec) -> bool:
    """Whether ``spec`` makes fp16 pairs for tiled_f16x2 (no modifier instantiations)."""
    return spec.name.split("<", 1)[0].removesuffix("_seq") in F16X2_PREP


@functools.lru_cache(maxsize=None)
def tiled_f32_spec(head_dim: int, causal: bool, precision: str, arch: Arch, products: str | None = None) -> Spec | None:
    """The float32 tiled kernel for one (head_dim, causal, precision) on ``arch``:
    for "highest", the scheme ``products`` (F32_PRODUCTS; default the pairs: a
    call's own comes from _plan.f32_products): fp16 pairs where their table has
    the head dim and the tile fits, else split
    TF32's tile and PRESPLIT mode, with the mode lowered until it fits the
    architecture's shared memory; None where nothing fits or without sm_80."""
    if precision == "highest" and (products or "f16x2") == "f16x2":
        spec = tiled_f16x2_spec(head_dim, causal, arch)
        if spec is not None:
            return spec
    bm, bn, warps, presplit = TILED_F32_TILES[head_dim]
    split = precision == "highest"
    presplit = presplit if split else 0
    while tiled_f32_smem(head_dim, bm, bn, presplit) > arch.smem and presplit > 0:
        presplit -= 1
    smem = tiled_f32_smem(head_dim, bm, bn, presplit)
    if not arch.sm80 or smem > arch.smem:
        return None
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


def tiled_any_spec(dtype: str, head_dim: int, causal: bool, precision: str, arch: Arch, products: str | None = None) -> Spec | None:
    """The tiled kernel (fp16 / bf16 or float32) for a call on ``arch``, or None;
    ``products``: float32 "highest"'s scheme (tiled_f32_spec)."""
    if head_dim not in tiled_head_dims(dtype):
        return None
    if dtype == "float32":
        return tiled_f32_spec(head_dim, causal, precision, arch, products)
    return tiled_spec(dtype, head_dim, causal, arch)


def tiled_head_dims(dtype: str) -> tuple:
    """The head dims the tiled kernel takes in this dtype (none: not at all)."""
    return tuple(TILED_F32_TILES) if dtype == "float32" else tuple(TILED_TILES) if dtype in TILED_DTYPES else ()


# --- hopper: wgmma prefill for sm_90, fp16 / bf16 (kernels/hopper.cu) ---------
# Padded head dim -> (BLOCK_M packed rows per CTA, 64 per consumer warpgroup;
# BLOCK_N keys per K/V tile; STAGES of K/V in the producer's ring). head_dim is
# padded to the next of these (any multiple of 8 up to 256 runs).
HOPPER_TILES = {
    64: (192, 128, 4),
    128: (128, 128, 2),
    192: (128, 96, 2),
    256: (128, 64, 2),
}
# Padded head dim -> the tile of its kernel with three consumer warpgroups (192 rows),
# for the calls whose group packs a tile's 192 rows into few positions
# (HOPPER_WG3_MIN_GROUP query heads a KV head or more: at most 96 positions a tile).
# At head dim 128 a third warpgroup's 152 registers a thread hold S and P of 80 keys
# beside O, not of 128; its tile costs the short rows' fixed parts less and keeps the
# tensor cores busier (benchmarks/NOTES_hopper.md, step 35: 0.88 to 0.95 of the
# two-warpgroup time from group 3 on, on an H100; step 37: 0.97 at group 2, where
# each warpgroup walks only its own rows' keys), where group 1, whose CTAs span 192
# positions, loses (1.03 to 1.05). Paged calls keep the two-warpgroup tile: a
# page's boxes are the largest multiple of 16 dividing the page and BLOCK_N, 16 keys
# for 80-key tiles whatever the page.
HOPPER_WG3_TILES = {
    128: (192, 80, 3),
}
HOPPER_WG3_MIN_GROUP = 2
HOPPER_DTYPES = ("float16", "bfloat16")
HOPPER_ARCH = "sm_90a"
# kernel="auto" prefers hopper to tiled, where both apply, from this many keys
# on, as measured on the H200 (benchmarks/NOTES_hopper.md, 2026-12-03: hopper
# 1.00 ms against tiled 1.59 at H1, 4096 keys; 0.245 against 0.281 at H4, head
# dim 64 and 2048 keys; at H3, 512 keys, tiled ahead when hopper copies Q and
# out by its threads, 0.171 against 0.187, where hopper's per-CTA cost weighs
# most; hopper ahead, 0.137, when it moves them by bulk copies). Where tiled
# does not apply (head_dim 80, 160, 192, ...), auto takes hopper at any length.
# Since hopper's steps 8 to 13 (benchmarks/dev/hopper_short_ab.py, 2026-12-04,
# NOTES_hopper): with bulk copies hopper takes 0.63 to 0.85 of tiled's time
# from 128 keys on (B64 S256 Hq32 Hkv8 D128, the sweep's P18: 0.167 against
# 0.243 ms); with the threads' copies (group 6) 0.92 at 256 keys, 1.25 at 128.
HOPPER_AUTO_MIN_KEYS = 256
HOPPER_BULK_QO_AUTO_MIN_KEYS = 128  # where Q and out go by bulk copies (_plan.hopper_bulk_qo)


def hopper_head_dim_pad(head_dim: int) -> int:
    """The padded head dim of the hopper kernel that serves ``head_dim``."""
    return next(d for d in HOPPER_TILES if d >= head_dim)


HOPPER_SMEM_MAX = 232448  # an sm_90 CTA's dynamic shared memory at most (227 KB)


def _hopper_bytes(q_slots: int, head_dim_pad: int, block_m: int, block_n: int, stages: int) -> int:
    """HopperSmem::bytes (kernels/hopper.cu): q_slots Q tiles and STAGES K and
    STAGES V tiles, 2-byte elements, the 8-byte mbarriers (full and empty of each
    warpgroup's Q rows in each Q tile, of each K and of each V stage), 16 bytes
    of tile indices per Q tile, 1024 bytes of alignment slack."""
    tiles = (q_slots * block_m + 2 * stages * block_n) * head_dim_pad * 2
    return tiles + 8 * (2 * (block_m // 64) * q_slots + 4 * stages) + 16 * q_slots + 1024


def hopper_q_slots(head_dim_pad: int, block_m: int, block_n: int, stages: int) -> int:
    """Q tiles of kernels/hopper.cu (HopperSmem::Q_SLOTS, the same rule): two
    where they fit beside the K/V stages (a warpgroup's next Q rows then load
    while it works on its last tile), except at head dim 64, whose epilogue
    frees Q early; else one."""
    two = _hopper_bytes(2, head_dim_pad, block_m, block_n, stages)
    return 2 if head_dim_pad != 64 and two <= HOPPER_SMEM_MAX else 1


def hopper_smem(head_dim_pad: int, block_m: int, block_n: int, stages: int) -> int:
    """Dynamic shared memory of kernels/hopper.cu, HopperSmem::BYTES (the kernel
    static_asserts that the two agree), with hopper_q_slots Q tiles."""
    qs = hopper_q_slots(head_dim_pad, block_m, block_n, stages)
    return _hopper_bytes(qs, head_dim_pad, block_m, block_n, stages)


def _hopper_tile_spec(dtype: str, dpad: int, bm: int, bn: int, stages: int, causal: bool) -> Spec:
    """hopper_attention for one tile (bm packed rows: bm / 64 consumer warpgroups; bn keys; stages)."""
    return Spec(
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
        block_n=bn,
        smem=hopper_smem(dpad, bm, bn, stages),
        # -default-device: the kernel's generic lambdas (the half tiles' widths) are device code;
        # NVRTC 12 takes an unannotated generic lambda for a host function without it
        options=(f"-arch={HOPPER_ARCH}", "-default-device"),
        arch=HOPPER_ARCH,
    )


def _hopper_table(tiles: dict) -> dict:
    """(dtype, padded head dim, causal) -> the hopper kernel of each tile of ``tiles``."""
    return {
        (dtype, dpad, causal): _hopper_tile_spec(dtype, dpad, bm, bn, stages, causal)
        for dtype in HOPPER_DTYPES
        for dpad, (bm, bn, stages) in tiles.items()
        for causal in (True, False)
    }


HOPPER = _hopper_table(HOPPER_TILES)
HOPPER_WG3 = _hopper_table(HOPPER_WG3_TILES)


def _two_consumer_warpgroups(spec: Spec) -> Spec:
    """The hopper kernel ``spec`` with two consumer warpgroups (128 rows) where
    it has three: ALiBi or a user's score_mod or mask_mod needs the registers
    that a third warpgroup takes (160 a thread, against 224 with two; with
    three, ALiBi spilled 240 bytes at head dim 64). A window, sinks and a
    softcap keep three (a softcap there waits for its P V before its softmax:
    kernels/hopper.cu, OVERLAP_PV). The key tile stays: each row then meets its
    keys in the same tiles as with three, so a user's twin of a built-in (a
    score_mod written as the softcap) gives the built-in's very bits."""
    if spec.family != "hopper" or spec.block_m <= 128:
        return spec
    ctype, dpad, _, bn, stages, causal, _ = spec.name.split("<", 1)[1][:-1].split(", ")
    return _hopper_tile_spec(spec.dtype, int(dpad), 128, int(bn), int(stages), causal == "true")


def hopper_tile(dtype: str, head_dim: int, causal: bool, group_size: int = 1, paged: bool = False) -> Spec:
    """The hopper kernel of a call with ``group_size`` query heads a KV head, K/V in
    pages or not: the three-warpgroup tile (HOPPER_WG3_TILES) where the head dim has
    one, the group is at least HOPPER_WG3_MIN_GROUP and K/V are not paged, else
    HOPPER_TILES'."""
    dpad = hopper_head_dim_pad(head_dim)
    if dpad in HOPPER_WG3_TILES and group_size >= HOPPER_WG3_MIN_GROUP and not paged:
        return HOPPER_WG3[dtype, dpad, causal]
    return HOPPER[dtype, dpad, causal]


def hopper_spec(dtype: str, head_dim: int, causal: bool, arch: Arch, group_size: int = 1,
                paged: bool = False) -> Spec | None:
    """hopper_tile's kernel for a call on ``arch`` (sm_90 only), or None."""
    if arch.name != "sm_90" or dtype not in HOPPER_DTYPES or head_dim % 8 or head_dim > MAX_HEAD_DIM:
        return None
    return hopper_tile(dtype, head_dim, causal, group_size, paged)


# --- decode: split-KV, a few query tokens against a long KV cache --------------
# One CTA takes block_m packed rows (seqlen_q * group_size of them, in row
# blocks beyond that) of one (batch, KV head) and one key range
# (kernels/decode.cu); a second kernel merges the key ranges. Which block_m,
# how many key ranges, and decode or the prefill kernel at all, is
# _plan.decode_dispatch's cost model.
#   fp16 / bf16: tensor cores (decode_mma_attention), 16 * ROW_WARPS rows per
#     CTA (DECODE_MMA_ROW_WARPS): the DECODE_MMA_WARPS warps form
#     DECODE_MMA_WARPS / ROW_WARPS key streams, each streaming its key tiles of
#     DECODE_MMA_BN keys through its own cp.async pipeline, one 16-row tile per
#     warp of a stream, so that 16, 32 or 64 rows read each K/V byte once.
#   float32: CUDA cores (decode_attention), DECODE_ROWS rows per CTA; 8 dims of
#     each row per lane keep q and the accumulator in registers (no spills).
DECODE_DTYPES = ("float16", "bfloat16", "float32")
DECODE_HEAD_DIMS = (64, 128, 256)
DECODE_MAX_SEQLEN_Q = 16
DECODE_ROWS = (1, 2, 4, 8)
DECODE_THREADS = 128  # kernels/decode.cu: DECODE_THREADS
DECODE_MMA_DTYPES = ("float16", "bfloat16")
DECODE_MMA_ROW_WARPS = (1, 2, 4)  # 16, 32, 64 rows per CTA
DECODE_MMA_WARPS = 4  # kernels/decode.cu: DECODE_MMA_WARPS
DECODE_MMA_BN = 16  # kernels/decode.cu: DECODE_MMA_BN
# Stages of the 4-stream layout (ROW_WARPS 1): 2 CTAs per SM at D128, 1 at D256.
# The layouts with fewer streams take more stages, so that every layout keeps
# as many key tiles in flight per CTA (DECODE_MMA_WARPS * (stages - 1)):
# at D128 8 tiles of 8 KB (K and V), 64 KB, what one CTA per SM needs to
# reach the HBM rate (benchmarks/NOTES_decode.md, v3).
DECODE_MMA_STAGES = {64: 3, 128: 3, 256: 2}


def decode_head_dim(dtype: str, head_dim: int) -> int | None:
    """The head dim of the decode kernel that runs a call of (dtype, head_dim):
    the tensor-core kernels (float16, bfloat16) take any multiple of 8 up to
    256, rounded up to the next of DECODE_HEAD_DIMS (kernels/decode.cu: the
    padded columns are zeros and never written); the CUDA-core kernel
    (float32) takes DECODE_HEAD_DIMS exactly. None where none runs it."""
    if dtype in DECODE_MMA_DTYPES:
        if head_dim % 8 != 0 or not 0 < head_dim <= max(DECODE_HEAD_DIMS):
            return None
        return min(d for d in DECODE_HEAD_DIMS if d >= head_dim)
    return head_dim if dtype in DECODE_DTYPES and head_dim in DECODE_HEAD_DIMS else None


def decode_mma_stages(head_dim: int, row_warps: int) -> int:
    """The table's stages of the layout with ``row_warps`` warps per key stream."""
    return 1 + (DECODE_MMA_STAGES[head_dim] - 1) * row_warps


def decode_mma_smem(head_dim: int, stages: int, row_warps: int = 1) -> int:
    """Dynamic shared memory of decode_mma_attention: the Q tile (16 * row_warps
    rows padded by 8 elements), then each key stream's stages of a K and a V
    tile (swizzled rows of head_dim elements), or, when larger, the fp32
    (m, l, o) of every stream's rows that replace them (decode_detail::MmaSmem;
    the kernel refuses to compile with another SMEM_BYTES). The cluster
    kernel's partial result reuses that space."""
    rows, streams = 16 * row_warps, DECODE_MMA_WARPS // row_warps
    stages_bytes = streams * stages * 2 * DECODE_MMA_BN * head_dim * 2
    merge_bytes = streams * rows * (head_dim + 2) * 4 + (streams + 3) * rows * 4  # + write_cta_result's row values
    return rows * (head_dim + 8) * 2 + max(stages_bytes, merge_bytes)


def decode_mma_spec(dtype: str, head_dim: int, stages: int | None = None, row_warps: int = 1) -> Spec:
    """The tensor-core decode kernel for one (dtype, head_dim) and 16 * row_warps
    rows per CTA, with the table's stages unless ``stages`` is given."""
    stages = decode_mma_stages(head_dim, row_warps) if stages is None else stages
    smem = decode_mma_smem(head_dim, stages, row_warps)
    return Spec(
        family="decode",
        source="decode.cu",
        name=f"decode_mma_attention<{CTYPES[dtype]}, {head_dim}, {row_warps}, {stages}, {smem}>",
        dtype=dtype,
        head_dim=head_dim,
        threads=DECODE_MMA_WARPS * 32,
        block_m=16 * row_warps,
        smem=smem,
    )


# A split call's splits in one thread-block cluster (architectures with
# clusters, Arch.clusters): the CLUSTER splits of a row block run as one
# cluster, which merges them through distributed shared memory
# (decode_mma_attention_cluster): one launch, no workspace, no combine.
# Tensor-core kernel, no modifiers, contiguous K/V; portable cluster sizes.
DECODE_CLUSTERS = (2, 4, 8)


def is_decode_cluster(spec: Spec) -> bool:
    """Whether ``spec`` is a cluster kernel of decode (no modifier or per-sequence instantiations)."""
    return spec.name.startswith("decode_mma_attention_cluster<")


def decode_cluster_spec(spec: Spec, cluster: int) -> Spec:
    """decode_mma_attention ``spec`` as its cluster kernel of ``cluster`` splits."""
    kernel, args = spec.name.split("<", 1)
    assert kernel == "decode_mma_attention" and cluster in DECODE_CLUSTERS, (spec.name, cluster)
    head, smem = args[:-1].rsplit(", ", 1)  # T, HEAD_DIM, ROW_WARPS, STAGES | SMEM_BYTES
    return replace(spec, name=f"decode_mma_attention_cluster<{head}, {cluster}, {smem}>")


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
        sm80=False,
    )


DECODE = {
    **{
        (dtype, head_dim, 16 * row_warps): decode_mma_spec(dtype, head_dim, row_warps=row_warps)
        for dtype in DECODE_MMA_DTYPES
        for head_dim in DECODE_HEAD_DIMS
        for row_warps in DECODE_MMA_ROW_WARPS
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
        sm80=False,
    )
    for dtype in DECODE_DTYPES
}


# Registers per thread that decode_ctas_per_sm assumes: at least what ptxas
# gives (NVRTC 12, sm_80 to sm_90; tests/test_compile.py checks it), the
# tensor-core kernel by head_dim; the CUDA-core kernel takes its
# __launch_bounds__' cap (168 up to 4 rows, for 3 CTAs per SM; 255 at 8).
DECODE_MMA_REGS = {64: 128, 128: 200, 256: 255}
REGISTERS_PER_SM = 65536  # every architecture of ARCHS


def decode_regs(spec: Spec) -> int:
    """The registers per thread decode_ctas_per_sm assumes for decode kernel ``spec``."""
    if spec.sm80:
        return DECODE_MMA_REGS[spec.head_dim]
    return 168 if spec.block_m <= 4 else 255


def decode_ctas_per_sm(spec: Spec, arch: Arch) -> int:
    """CTAs of decode kernel ``spec`` that one SM of ``arch`` holds at a time, from
    its registers (decode_regs, allocated in units of 8 per thread) and shared
    memory (an SM has the block limit + 1 KB, each CTA reserves 1 KB; the
    CUDA-core kernel's merge arrays are static: [4 warps][rows][head_dim + 2]
    floats). Static, so that a plan is the same on every device of an
    architecture and needs no kernel to be loaded."""
    regs = -(-decode_regs(spec) // 8) * 8
    by_regs = REGISTERS_PER_SM // (spec.threads * regs)
    warps = DECODE_THREADS // 32  # the CUDA-core kernel's static merge arrays and write_cta_result's row values
    static = 0 if spec.sm80 else (warps * spec.block_m * (spec.head_dim + 2) + (warps + 3) * spec.block_m) * 4
    by_smem = (arch.smem + 1024) // (spec.smem + static + 1024)
    return max(1, min(by_regs, by_smem))


def decode_block_ms(dtype: str) -> tuple:
    """The packed rows per CTA (block_m) that the decode kernels of ``dtype`` take."""
    if dtype in DECODE_MMA_DTYPES:
        return tuple(16 * rw for rw in DECODE_MMA_ROW_WARPS)
    return DECODE_ROWS if dtype in DECODE_DTYPES else ()


@functools.lru_cache(maxsize=None)
def decode_spec(dtype: str, head_dim: int, block_m: int, arch: Arch) -> Spec | None:
    """The decode kernel of ``block_m`` packed rows per CTA (decode_block_ms) on
    ``arch``: in fp16 / bf16 the tensor-core kernel (sm_80 and newer), its
    pipeline shortened (down to 2 stages) where the table's does not fit the
    shared memory; in float32 the CUDA-core kernel (every architecture). None
    where it doesn't run. ``head_dim``: the call's (decode_head_dim pads it)."""
    head_dim = decode_head_dim(dtype, head_dim)
    if head_dim is None or block_m not in decode_block_ms(dtype):
        return None
    spec = DECODE[dtype, head_dim, block_m]
    if dtype in DECODE_MMA_DTYPES:
        if not arch.sm80:
            return None
        row_warps, stages = block_m // 16, decode_mma_stages(head_dim, block_m // 16)
        while spec.smem > arch.smem and stages > 2:
            stages -= 1
            spec = decode_mma_spec(dtype, head_dim, stages, row_warps)
        return spec if spec.smem <= arch.smem else None
    return spec


def decode_specs(dtype: str, head_dim: int, arch: Arch) -> tuple[Spec, ...]:
    """The decode kernels that can run a call of (dtype, head_dim) on ``arch``,
    by block_m: the candidates of _plan.decode_dispatch."""
    return tuple(s for s in (decode_spec(dtype, head_dim, m, arch) for m in decode_block_ms(dtype)) if s is not None)


# --- backward: kernels/backward.cu (cupy_gqa.attention_backward) ---------------
# Three launches per call: bwd_preprocess (delta, lse2), a dQ kernel and a dK/dV
# kernel. On sm_80+ fp16 / bf16 use the tensor-core pair (bwd_dq_mma,
# bwd_dkdv_mma) and float32 its split-TF32 pair (bwd_dq_tf32, bwd_dkdv_tf32),
# at head_dim padded to one of BWD_MMA_HEAD_DIMS (any multiple of 8 runs);
# every other call (float64, other head dims, GPUs without mma.sync) the
# CUDA-core pair (bwd_dq_rows, bwd_dkdv_rows), which takes any strides.
BWD_MMA16_DTYPES = ("float16", "bfloat16")  # bwd_dq_mma, bwd_dkdv_mma
BWD_MMA_DTYPES = (*BWD_MMA16_DTYPES, "float32")
BWD_MMA_HEAD_DIMS = (32, 64, 96, 128, 192, 256)
# padded head dim -> dQ kernel (BLOCK_M packed rows = 16 per warp, BLOCK_N keys per K/V tile, NUM_WARPS)
BWD_DQ_TILES = {32: (64, 64, 4), 64: (64, 64, 4), 96: (64, 64, 4), 128: (64, 64, 4), 192: (64, 32, 4), 256: (64, 32, 4)}
# padded head dim -> dK/dV kernel (KEY_WARPS: 16 keys each, BLOCK_M packed rows per Q/dO tile,
# DSPLIT: warps sharing a key slab's head dims, 2 above 128 where one warp's dK, dV rows don't fit)
BWD_DKDV_TILES = {32: (4, 64, 1), 64: (4, 64, 1), 96: (4, 32, 1), 128: (4, 32, 1), 192: (4, 32, 2), 256: (4, 32, 2)}
# float32 (split TF32, rows of head_dim + 4 floats): padded head dim -> dQ kernel (BLOCK_M, BLOCK_N,
# ROW_WARPS: 16-row slabs, DSPLIT: warps sharing a slab's head dims, PRESPLIT: where Q, dO, K, V are
# split, as in tiled_tf32: 0 at each use, 1 K and V once per CTA, 2 also Q and dO) and dK/dV kernel
# (KEY_WARPS, BLOCK_M, DSPLIT). The largest split mode that keeps two dQ CTAs per SM where one does
# (D32 to D128; at D128 split 0 timed 0.90 of split 1's single CTA, H200), else the largest that
# fits; a warp keeps at most 64 head dims of dQ, and of dK and dV each (beside them the products'
# operands: above, ptxas spills), and above head dim 128 a 16-row slab's dQ is split four ways (two
# spilled 8 to 60 bytes with NVRTC 12 or 13 on some architectures).
BWD_TF32_DQ_TILES = {
    32: (64, 32, 4, 1, 2), 64: (64, 32, 4, 1, 1), 96: (64, 32, 4, 1, 0), 128: (64, 16, 4, 1, 0),
    192: (32, 16, 2, 4, 0), 256: (32, 16, 2, 4, 0),
}  # fmt: skip
BWD_TF32_DKDV_TILES = {32: (4, 32, 1), 64: (4, 32, 1), 96: (2, 16, 2), 128: (2, 32, 2), 192: (2, 16, 4), 256: (1, 16, 4)}
# The float32 dK/dV kernel's wide key blocks: padded head dim -> (KEY_WARPS, BLOCK_M, DSPLIT, COST).
# Eight warps share each Q and dO tile (and its split) where the table's four leave the SM a warp
# a scheduler: an SM gets through more of the work, but the first key block of a causal grid, which
# sees every row, takes longer, and with a short grid that block is the call's time. COST is the
# time of one of the wide kernel's row tiles, alone on an SM, over one of the table kernel's
# (benchmarks/dev/bwd_ab.py, H200: at head dim 64 a 128-key block's 32-row tile 1.165 of a 64-key
# block's; at 128 a 64-key block's 16-row tile 0.86 of a 32-key block's 32-row tile);
# _plan.plan_backward takes the one with the shorter estimate (bwd_tf32_dkdv_estimate).
BWD_TF32_DKDV_WIDE = {64: (8, 32, 1, 1.165), 128: (4, 16, 2, 0.86)}
BWD_PREPROCESS_THREADS = 256  # kernels/backward.cu: bwd_preprocess's __launch_bounds__
BWD_ROWS_THREADS = 128  # kernels/backward.cu: BWD_ROWS_THREADS


def bwd_head_dim_pad(head_dim: int) -> int:
    """The padded head dim of the tensor-core backward kernels that serves ``head_dim``."""
    return next(d for d in BWD_MMA_HEAD_DIMS if d >= head_dim)


def bwd_dq_smem(head_dim: int, block_m: int, block_n: int) -> int:
    """bwd_dq_mma's shared memory: Q and dO tiles, two K and two V stages, rows
    padded by 8 elements of 2 bytes (bwd_detail::DqSmem)."""
    return (2 * block_m + 4 * block_n) * (head_dim + 8) * 2


def bwd_dkdv_smem(head_dim: int, block_n: int, block_m: int) -> int:
    """bwd_dkdv_mma's: the K and V tiles, two stages of Q and of dO, rows padded
    by 8 elements of 2 bytes, and two stages of lse2 and delta floats
    (bwd_detail::DkvSmem)."""
    return (2 * block_n + 4 * block_m) * (head_dim + 8) * 2 + 4 * block_m * 4


def bwd_dq_tf32_smem(head_dim: int, block_m: int, block_n: int, presplit: int) -> int:
    """bwd_dq_tf32's shared memory: Q and dO tiles, two K and two V stages, the
    small parts of a K and a V tile (presplit >= 1) and of Q and dO (2), rows of
    head_dim + 4 floats (bwd_detail::DqTf32Smem)."""
    tiles = 2 * block_m + 4 * block_n + (2 * block_n if presplit >= 1 else 0) + (2 * block_m if presplit == 2 else 0)
    return tiles * (head_dim + 4) * 4


def bwd_dkdv_tf32_smem(head_dim: int, block_n: int, block_m: int) -> int:
    """bwd_dkdv_tf32's: K and V with their small parts, two stages of Q and of dO
    and the small parts of one of each, rows of head_dim + 4 floats, and two
    stages of lse2 and delta floats (bwd_detail::DkvTf32Smem)."""
    return (4 * block_n + 6 * block_m) * (head_dim + 4) * 4 + 4 * block_m * 4


@functools.lru_cache(maxsize=None)
def bwd_dq_tf32_spec(head_dim_pad: int, causal: bool, arch: Arch) -> Spec | None:
    """The float32 dQ kernel: the table's split mode lowered, then BLOCK_N halved
    (down to 16), then BLOCK_M with its slabs (16 rows each), until it fits ``arch``."""
    bm, bn, slabs, dsplit, presplit = BWD_TF32_DQ_TILES[head_dim_pad]
    while bwd_dq_tf32_smem(head_dim_pad, bm, bn, presplit) > arch.smem and (presplit > 0 or bn > 16 or bm > 16):
        if presplit > 0:
            presplit -= 1
        elif bn > 16:
            bn //= 2
        else:
            bm, slabs = bm // 2, slabs // 2
    smem = bwd_dq_tf32_smem(head_dim_pad, bm, bn, presplit)
    if not arch.sm80 or smem > arch.smem:
        return None
    return Spec(
        family="backward",
        source="backward.cu",
        name=f"bwd_dq_tf32<{head_dim_pad}, {bm}, {bn}, {slabs}, {dsplit}, {str(causal).lower()}, {presplit}, {smem}>",
        dtype="float32",
        head_dim=head_dim_pad,
        threads=slabs * dsplit * 32,
        block_m=bm,  # packed query rows per CTA
        smem=smem,
    )


@functools.lru_cache(maxsize=None)
def bwd_dkdv_tf32_spec(head_dim_pad: int, causal: bool, arch: Arch, wide: bool = False) -> Spec | None:
    """The float32 dK/dV kernel, BLOCK_M halved (down to 16), then the key warps,
    until it fits ``arch``; ``wide``: BWD_TF32_DKDV_WIDE's tiles as they are (their
    COST was measured at those), None where that table has no such head dim or they
    do not fit."""
    if wide and head_dim_pad not in BWD_TF32_DKDV_WIDE:
        return None
    kw, bm, dsplit = BWD_TF32_DKDV_WIDE[head_dim_pad][:3] if wide else BWD_TF32_DKDV_TILES[head_dim_pad]
    while not wide and bwd_dkdv_tf32_smem(head_dim_pad, 16 * kw, bm) > arch.smem and (bm > 16 or kw > 1):
        if bm > 16:
            bm //= 2
        else:
            kw //= 2
    smem = bwd_dkdv_tf32_smem(head_dim_pad, 16 * kw, bm)
    if not arch.sm80 or smem > arch.smem:
        return None
    return Spec(
        family="backward",
        source="backward.cu",
        name=f"bwd_dkdv_tf32<{head_dim_pad}, {bm}, {kw}, {dsplit}, {str(causal).lower()}, {smem}>",
        dtype="float32",
        head_dim=head_dim_pad,
        threads=kw * dsplit * 32,
        block_m=16 * kw,  # keys per CTA
        block_n=bm,  # packed rows per Q/dO tile
        smem=smem,
    )


@functools.lru_cache(maxsize=None)
def bwd_dq_mma_spec(dtype: str, head_dim_pad: int, causal: bool, arch: Arch, narrow: int = 0) -> Spec | None:
    """The tensor-core dQ kernel, BLOCK_N halved (down to 16) until it fits ``arch``;
    ``narrow``: the table's BLOCK_N halved that many times to begin with (bwd_mods_specs)."""
    bm, bn, warps = BWD_DQ_TILES[head_dim_pad]
    bn = max(16, bn >> narrow)
    while bwd_dq_smem(head_dim_pad, bm, bn) > arch.smem and bn > 16:
        bn //= 2
    smem = bwd_dq_smem(head_dim_pad, bm, bn)
    if dtype not in BWD_MMA16_DTYPES or not arch.sm80 or smem > arch.smem:
        return None
    return Spec(
        family="backward",
        source="backward.cu",
        name=f"bwd_dq_mma<{CTYPES[dtype]}, {head_dim_pad}, {bm}, {bn}, {warps}, {str(causal).lower()}, {smem}>",
        dtype=dtype,
        head_dim=head_dim_pad,
        threads=warps * 32,
        block_m=bm,  # packed query rows per CTA
        smem=smem,
    )


@functools.lru_cache(maxsize=None)
def bwd_dkdv_mma_spec(dtype: str, head_dim_pad: int, causal: bool, arch: Arch, narrow: int = 0) -> Spec | None:
    """The tensor-core dK/dV kernel, BLOCK_M halved (down to 16), then the key
    warps, until it fits ``arch``; ``narrow``: the table's BLOCK_M halved that many
    times to begin with (bwd_mods_specs)."""
    kw, bm, dsplit = BWD_DKDV_TILES[head_dim_pad]
    bm = max(16, bm >> narrow)
    while bwd_dkdv_smem(head_dim_pad, 16 * kw, bm) > arch.smem and (bm > 16 or kw > 1):
        if bm > 16:
            bm //= 2
        else:
            kw //= 2
    smem = bwd_dkdv_smem(head_dim_pad, 16 * kw, bm)
    if dtype not in BWD_MMA16_DTYPES or not arch.sm80 or smem > arch.smem:
        return None
    return Spec(
        family="backward",
        source="backward.cu",
        name=f"bwd_dkdv_mma<{CTYPES[dtype]}, {head_dim_pad}, {bm}, {kw}, {dsplit}, {str(causal).lower()}, {smem}>",
        dtype=dtype,
        head_dim=head_dim_pad,
        threads=kw * dsplit * 32,
        block_m=16 * kw,  # keys per CTA
        smem=smem,
    )


def _bwd_rows_team(dtype: str, dpad: int) -> int:
    """Lanes per row (key): 16 dims each (8 in float64), so that the 3 (4) register
    arrays of a lane stay small."""
    return max(1, dpad // (8 if dtype == "float64" else 16))


def _bwd_rows_stage(dtype: str, dpad: int) -> int:
    """Keys (rows) per shared-memory stage: about 8 KB of each operand."""
    return max(8, min(64, 8192 // (dpad * ITEMSIZE[dtype])))


def bwd_rows_dq_smem(dtype: str, dpad: int) -> int:
    """bwd_dq_rows: a stage of K and one of V (bwd_detail::DqRowsSmem)."""
    return 2 * _bwd_rows_stage(dtype, dpad) * dpad * ITEMSIZE[dtype]


def bwd_rows_dkdv_smem(dtype: str, dpad: int) -> int:
    """bwd_dkdv_rows: a stage of Q and one of dO, and each row's lse2, delta
    (accumulator type) and last key (int) (bwd_detail::DkvRowsSmem)."""
    rows = _bwd_rows_stage(dtype, dpad)
    acc = 8 if dtype == "float64" else 4
    return 2 * rows * dpad * ITEMSIZE[dtype] + rows * (2 * acc + 4)


def _bwd_rows_spec(dtype: str, dpad: int, which: str) -> Spec:
    team, stage = _bwd_rows_team(dtype, dpad), _bwd_rows_stage(dtype, dpad)
    smem = bwd_rows_dq_smem(dtype, dpad) if which == "dq" else bwd_rows_dkdv_smem(dtype, dpad)
    return Spec(
        family="backward",
        source="backward.cu",
        name=f"bwd_{which}_rows<{CTYPES[dtype]}, {dpad}, {team}, {stage}, {smem}>",
        dtype=dtype,
        head_dim=dpad,
        threads=BWD_ROWS_THREADS,
        team=team,
        block_m=BWD_ROWS_THREADS // team,  # rows (dq) or keys (dkdv) per CTA
        smem=smem,
        sm80=False,
    )


BWD_ROWS = {(dtype, dpad, which): _bwd_rows_spec(dtype, dpad, which)
            for dtype in DTYPES for dpad in ROWWISE_BUCKETS for which in ("dq", "dkdv")}  # fmt: skip


def _bwd_rows_pass(name: str, dtype: str, threads: int) -> Spec:
    """A backward kernel over rows that serves every head dim (any architecture)."""
    return Spec(family="backward", source="backward.cu", name=name, dtype=dtype, head_dim=MAX_HEAD_DIM, threads=threads,
                sm80=False)  # fmt: skip


BWD_PREPROCESS = {dtype: _bwd_rows_pass(f"bwd_preprocess<{CTYPES[dtype]}>", dtype, BWD_PREPROCESS_THREADS) for dtype in DTYPES}
# The sinks' gradient (backward.cu: bwd_dsinks), by the workspace's type: float32 but for float64.
BWD_DSINKS_THREADS = 256
BWD_DSINKS = {dtype: _bwd_rows_pass(f"bwd_dsinks<{'double' if dtype == 'float64' else 'float'}>", dtype, BWD_DSINKS_THREADS)
              for dtype in DTYPES}  # fmt: skip


# --- the 16-bit backward on sm_90's warpgroup tensor cores (backward.cu: bwd_dq_ws, bwd_dkdv_ws) ---
# Two consumer warpgroups (128 packed rows or keys per CTA) and a producer warpgroup
# that streams the tiles by bulk tensor copies into STAGES stages on mbarriers.
# Padded head dim -> (BLOCK_N keys per K/V tile, STAGES) of dQ, (BLOCK_M = 64 packed
# rows per Q/dO tile, STAGES) of dK/dV. On the H100 G1 2.3 and G2 1.6 times
# faster than mma.sync, its gradients bit for bit (benchmarks/NOTES_backward.md).
BWD_DQ_WS_TILES = {64: (64, 2), 128: (64, 2)}
BWD_DKDV_WS_TILES = {64: (64, 2), 128: (64, 2)}
BWD_WS_THREADS = 384
# The kernels the 16-bit backward calls take on sm_90: "ws" (bwd_dq_ws, bwd_dkdv_ws,
# where they take the head dim) or "mma" (bwd_dq_mma, bwd_dkdv_mma: the other
# architectures' kernels). _plan.set_bwd_sm90 changes it.
BWD_SM90_KINDS = ("mma", "ws")
BWD_SM90 = "ws"


def bwd_dq_ws_smem(head_dim: int, block_n: int, stages: int) -> int:
    """bwd_dq_ws's: the Q and dO tiles of 128 rows, STAGES stages of K and V, in
    64-column slabs of 128-byte rows, two mbarriers a stage, and the 1024-byte
    alignment's slack (bwd_detail::DqWsSmem)."""
    return (2 * 128 + 2 * stages * block_n) * (head_dim // 64) * 128 + 16 * stages + 1024


def bwd_dkdv_ws_smem(head_dim: int, block_m: int, stages: int) -> int:
    """bwd_dkdv_ws's: the K and V tiles of 128 keys, STAGES stages of Q and dO,
    of lse2 and delta, two mbarriers a stage, and the 1024-byte alignment's slack
    (bwd_detail::DkvWsSmem)."""
    return (2 * 128 + 2 * stages * block_m) * (head_dim // 64) * 128 + 8 * stages * block_m + 16 * stages + 1024


@functools.lru_cache(maxsize=None)
def bwd_ws_spec(which: str, dtype: str, head_dim_pad: int, causal: bool, arch: Arch) -> Spec | None:
    """The dQ (``which`` "dq") or dK/dV ("dkdv") kernel with a producer
    warpgroup for a padded head dim on ``arch`` (sm_90 only), or None."""
    tiles = BWD_DQ_WS_TILES if which == "dq" else BWD_DKDV_WS_TILES
    if arch.name != "sm_90" or dtype not in BWD_MMA16_DTYPES or head_dim_pad not in tiles:
        return None
    block, stages = tiles[head_dim_pad]
    smem = (bwd_dq_ws_smem if which == "dq" else bwd_dkdv_ws_smem)(head_dim_pad, block, stages)
    return Spec(
        family="backward",
        source="backward.cu",
        name=f"bwd_{which}_ws<{CTYPES[dtype]}, {head_dim_pad}, {block}, {stages}, {str(causal).lower()}, {smem}>",
        dtype=dtype,
        head_dim=head_dim_pad,
        threads=BWD_WS_THREADS,
        block_m=128,  # packed rows (dQ) or keys (dK/dV) per CTA
        block_n=block,  # keys per K/V tile (dQ) or packed rows per Q/dO tile (dK/dV)
        smem=smem,
        options=(f"-arch={HOPPER_ARCH}",),
        arch=HOPPER_ARCH,
    )


def is_bwd_ws(spec: Spec) -> bool:
    """Whether ``spec`` is one of the backward kernels with a producer warpgroup (with modifiers too)."""
    return spec.name.startswith(("bwd_dq_ws<", "bwd_dkdv_ws<", "bwd_dq_ws_mods<", "bwd_dkdv_ws_mods<"))


def bwd_mma_specs(dtype: str, head_dim: int, causal: bool, arch: Arch, sm90: str | None = None) -> tuple[Spec, Spec] | None:
    """The tensor-core (dQ, dK/dV) kernels for a call on ``arch``, or None where
    they don't run; on sm_90 those of ``sm90`` (BWD_SM90_KINDS; None: BWD_SM90)."""
    if dtype not in BWD_MMA_DTYPES or head_dim % 8 or head_dim > MAX_HEAD_DIM or not arch.sm80:
        return None
    dpad = bwd_head_dim_pad(head_dim)
    if dtype == "float32":
        dq, dkdv = bwd_dq_tf32_spec(dpad, causal, arch), bwd_dkdv_tf32_spec(dpad, causal, arch)
    else:
        dq, dkdv = bwd_dq_mma_spec(dtype, dpad, causal, arch), bwd_dkdv_mma_spec(dtype, dpad, causal, arch)
        if (BWD_SM90 if sm90 is None else sm90) == "ws":
            dq = bwd_ws_spec("dq", dtype, dpad, causal, arch) or dq
            dkdv = bwd_ws_spec("dkdv", dtype, dpad, causal, arch) or dkdv
    return None if dq is None or dkdv is None else (dq, dkdv)


def bwd_mods_specs(dtype: str, head_dim: int, causal: bool, arch: Arch, flags: int, user_code: str = "",
                   tensor_cores: bool = True, sm90: str | None = None) -> tuple[Spec, Spec]:  # fmt: skip
    """The (dQ, dK/dV) kernels of a backward call with the modifiers ``flags``
    (no score_mod) on ``arch``, as *_mods instantiations. fp16 / bf16 on the
    tensor cores (``tensor_cores``: _plan.backward_mma_unsupported found none
    against): the mma.sync pair with half the table's S tile, a quarter with a
    mask_mod (the modifiers' rule holds more registers per score, where the
    plain kernels use all 255: with the table's tiles the built-ins spilled up
    to 248 bytes; a mask_mod's dK/dV kernel still spills 20 to 64 bytes at its
    smallest tile, 16 rows), on sm_90 the pair with a producer warpgroup, but
    with ALiBi or a mask_mod (their dK/dV kernel spilled 92 to 100 bytes
    there). float32 and float64, and what the tensor cores don't run: the
    CUDA-core pair."""
    pair = None
    if tensor_cores and dtype in BWD_MMA16_DTYPES:
        dpad = bwd_head_dim_pad(head_dim)
        narrow = 2 if flags & 32 else 1  # _mods.MOD_MASK
        pair = bwd_dq_mma_spec(dtype, dpad, causal, arch, narrow), bwd_dkdv_mma_spec(dtype, dpad, causal, arch, narrow)
        if (BWD_SM90 if sm90 is None else sm90) == "ws" and not flags & (4 | 32):  # _mods.MOD_ALIBI, MOD_MASK
            ws = bwd_ws_spec("dq", dtype, dpad, causal, arch), bwd_ws_spec("dkdv", dtype, dpad, causal, arch)
            pair = ws if None not in ws else pair
        pair = None if None in pair else pair
    if pair is None:
        pair = bwd_rows_specs(dtype, head_dim)
    return tuple(with_mods(s, flags, user_code) for s in pair)


def bwd_rows_specs(dtype: str, head_dim: int) -> tuple[Spec, Spec]:
    """The CUDA-core (dQ, dK/dV) kernels for ``head_dim`` (rounded up to a rowwise bucket)."""
    dpad = next(b for b in ROWWISE_BUCKETS if b >= head_dim)
    return BWD_ROWS[dtype, dpad, "dq"], BWD_ROWS[dtype, dpad, "dkdv"]


def rowwise_spec_for(dtype: str, head_dim: int, vec: bool, arch: Arch) -> Spec:
    """rowwise for ``arch``: the vector variant only where cp.async exists."""
    return rowwise_spec(dtype, head_dim, vec and arch.sm80)


def serves(spec: Spec, head_dim: int) -> bool:
    """Whether ``spec`` is the specialization of its family for calls of ``head_dim``
    (rowwise and hopper round head_dim up; decode's combine serves every one)."""
    if spec.family == "rowwise":
        return spec.head_dim == next(b for b in ROWWISE_BUCKETS if b >= head_dim)
    if spec.family == "hopper":
        return head_dim % 8 == 0 and spec.head_dim == hopper_head_dim_pad(head_dim)
    if spec.family == "decode" and not spec.block_m:
        return True
    if spec.family == "backward":
        if spec.name.startswith("bwd_preprocess"):
            return True
        if "_mma<" in spec.name or "_tf32<" in spec.name:
            return head_dim % 8 == 0 and spec.head_dim == bwd_head_dim_pad(head_dim)
        return spec.head_dim == next(b for b in ROWWISE_BUCKETS if b >= head_dim)
    return spec.head_dim == head_dim


@functools.lru_cache(maxsize=None)
def specs_for(arch: Arch) -> tuple[Spec, ...]:
    """Every specialization that cupy_gqa may launch on ``arch``: its table."""
    found: dict[str, Spec] = {}

    def add(spec):
        if spec is None or (spec.arch is not None and spec.arch.rstrip("a") != arch.name):
            return
        assert spec.smem <= arch.smem and (arch.sm80 or not spec.sm80), (spec.name, arch.name)
        found.setdefault(spec.name, spec)

    for (dtype, dpad, vec), spec in ROWWISE.items():
        add(spec if arch.sm80 or not spec.sm80 else None)
    for dtype in (*TILED_DTYPES, "float32"):
        for head_dim in tiled_head_dims(dtype):
            for causal in (True, False):
                for precision in PRECISIONS if dtype == "float32" else ("highest",):
                    add(tiled_any_spec(dtype, head_dim, causal, precision, arch))
                if dtype == "float32":  # both schemes of "highest" (F32_PRODUCTS)
                    for products in F32_PRODUCTS:
                        spec = tiled_f32_spec(head_dim, causal, "highest", arch, products)
                        add(spec)
                        if spec is not None and spec.source == "tiled_f16x2.cu":
                            for prep in f16x2_prep_specs(spec):
                                add(prep)
    for dtype in HOPPER_DTYPES:
        for dpad in HOPPER_TILES:
            for causal in (True, False):
                add(hopper_spec(dtype, dpad, causal, arch))
                add(hopper_spec(dtype, dpad, causal, arch, group_size=HOPPER_WG3_MIN_GROUP))
    for dtype in DECODE_DTYPES:
        for head_dim in DECODE_HEAD_DIMS:
            for spec in decode_specs(dtype, head_dim, arch):
                add(spec)
                if spec.sm80 and arch.clusters:
                    for cluster in DECODE_CLUSTERS:
                        add(decode_cluster_spec(spec, cluster))
        add(DECODE_COMBINE[dtype])
    for dtype in DTYPES:  # the backward pass
        add(BWD_PREPROCESS[dtype])
        add(BWD_DSINKS[dtype])
        for dpad in ROWWISE_BUCKETS:
            for spec in bwd_rows_specs(dtype, dpad):
                add(spec)
        for dpad in BWD_MMA_HEAD_DIMS:
            for causal in (True, False):
                for kind in ("mma", None):  # (mma.sync: the fallback where the bulk copies can't read k, v)
                    for spec in bwd_mma_specs(dtype, dpad, causal, arch, kind) or ():
                        add(spec)
                if dtype == "float32" and arch.sm80:
                    add(bwd_dkdv_tf32_spec(dpad, causal, arch, wide=True))
    return tuple(found.values())


SPECS: tuple[Spec, ...] = tuple({s.name: s for arch in ARCHS.values() for s in specs_for(arch)}.values())
"""Every specialization of every architecture's table."""
