"""Tensor maps for the bulk tensor copies (TMA) of kernels/hopper.cu.

A tensor map (the driver's ``CUtensorMap``, 128 opaque bytes) describes a
strided array in global memory and the box that one copy moves to shared
memory. It is encoded on the host by the CUDA driver's
``cuTensorMapEncodeTiled``, reached through ctypes (CuPy has no binding for it),
and passed to the kernel by value.

The hopper kernel reads K and V as 4-D tensors (head_dim, seqlen_k, heads,
batch), innermost first, in boxes of 64 head-dim columns (128 bytes: one
swizzle row) by ``block_n`` keys, with the 128-byte swizzle that its wgmma
operands use. Rows and columns past the array's ends are filled with zeros.

Q and out are seen as (head_dim, heads, seqlen_q, batch): a box of 64 columns
by ``group`` heads by ``positions`` query positions is a run of ``group *
positions`` packed rows (row t * group + g: position t, head g of the KV
head's group), the row order of the kernel's tiles. A load fills what lies
past the array with zeros; a store drops it.
"""
from __future__ import annotations

import ctypes
import functools
import sys
import threading

import numpy as np

TENSOR_MAP_BYTES = 128
BOX_COLUMNS = 64  # head-dim columns per box: 64 two-byte elements, one 128-byte swizzle row

# CUtensorMap enums (cuda.h)
_DATA_TYPE_UINT16 = 1  # fp16 and bf16 move as 16-bit words
_INTERLEAVE_NONE = 0
_SWIZZLE_128B = 3
_L2_PROMOTION_256B = 3
_OOB_FILL_ZERO = 0

_u64x4 = ctypes.c_uint64 * 4
_u32x4 = ctypes.c_uint32 * 4


@functools.cache
def _encoder():
    """The driver's cuTensorMapEncodeTiled, or None where the driver has none."""
    try:
        lib = ctypes.CDLL("nvcuda.dll" if sys.platform == "win32" else "libcuda.so.1")
        fn = lib.cuTensorMapEncodeTiled
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_int
    fn.argtypes = [
        ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p, ctypes.POINTER(ctypes.c_uint64),
        ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_uint32), ctypes.POINTER(ctypes.c_uint32),
        ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int,
    ]  # fmt: skip
    return fn


def available() -> bool:
    """Whether tensor maps can be encoded here (a CUDA driver with TMA support)."""
    return _encoder() is not None


def geometry_issue(shape: tuple, strides: tuple) -> str | None:
    """Why the copy engine can't read this (batch, seqlen, heads, head_dim)
    array with byte ``strides`` (pointer and 16-byte rules aside), or None: it
    steps forward, less than 2**40 bytes at a time."""
    for n, s in zip(shape[:3], strides[:3]):
        if n > 1 and not 0 < s < 2**40:
            return f"byte strides {strides} (the copy engine takes strides in (0, 2**40) bytes)"
    return None


def _steps(dims: tuple, step: tuple) -> tuple:
    """Byte strides of dims 1.. (the innermost steps by the element size). A
    dimension of extent 1 is never stepped, so its stride is given as 16
    bytes, which the encoder accepts whatever the array's own stride is (0 for
    a broadcast, say)."""
    return tuple(s if n > 1 else 16 for s, n in zip(step, dims[1:]))


def map_geometry(shape: tuple, strides: tuple, itemsize: int, block_n: int):
    """The encoder's (dims, byte strides, box) for key tiles of a (batch, seqlen,
    heads, head_dim) array with byte ``strides``: dims (head_dim, seqlen, heads,
    batch), innermost first, boxes of ``block_n`` rows of one head."""
    batch, seqlen, heads, head_dim = shape
    dims = (head_dim, seqlen, heads, batch)
    box = (BOX_COLUMNS, block_n, 1, 1)
    assert itemsize == 2, "the hopper kernel moves 16-bit elements"
    return dims, _steps(dims, (strides[1], strides[2], strides[0])), box


def packed_geometry(shape: tuple, strides: tuple, itemsize: int, group: int, positions: int):
    """The encoder's (dims, byte strides, box) for packed-row tiles of a (batch,
    seqlen, heads, head_dim) array: dims (head_dim, heads, seqlen, batch), boxes
    of ``group`` heads by ``positions`` positions."""
    batch, seqlen, heads, head_dim = shape
    dims = (head_dim, heads, seqlen, batch)
    box = (BOX_COLUMNS, group, positions, 1)
    assert itemsize == 2, "the hopper kernel moves 16-bit elements"
    return dims, _steps(dims, (strides[2], strides[1], strides[0])), box


def tile_map(ptr: int, shape: tuple, strides: tuple, itemsize: int, block_n: int) -> bytes:
    """The tensor map (128 bytes) of the array at device address ``ptr`` for
    boxes of ``block_n`` key rows."""
    return _encoder_of(shape, strides, map_geometry(shape, strides, itemsize, block_n))(ptr)


def packed_map(ptr: int, shape: tuple, strides: tuple, itemsize: int, group: int, positions: int) -> bytes:
    """The tensor map of the (q or out) array at ``ptr`` for boxes of ``group *
    positions`` packed rows (packed_geometry)."""
    return _encoder_of(shape, strides, packed_geometry(shape, strides, itemsize, group, positions))(ptr)


@functools.lru_cache(maxsize=256)
def _encoder_of(shape: tuple, strides: tuple, geometry) -> "MapEncoder":
    return MapEncoder(shape, strides, geometry)


class MapEncoder:
    """cuTensorMapEncodeTiled for one array geometry, at any address: the
    driver's arguments are built once (a call passes only the address), and
    each map is written into a buffer aligned to 64 bytes, as the driver
    requires, and returned as bytes. With a stand-in driver that does nothing,
    a map costs 1.7 us of Python so, against 4.7 us when the arguments were
    built at each call; a hopper call on new arrays encodes up to four."""

    def __init__(self, shape: tuple, strides: tuple, geometry):
        encode = _encoder()
        if encode is None:
            raise RuntimeError("the CUDA driver has no cuTensorMapEncodeTiled (it needs CUDA 12 or newer)")
        dims, byte_strides, box = geometry
        self._encode, self._what = encode, (shape, strides, box)
        self._args = (_u64x4(*dims), (ctypes.c_uint64 * 3)(*byte_strides), _u32x4(*box), _u32x4(1, 1, 1, 1))
        self._raw = np.zeros(TENSOR_MAP_BYTES + 64, np.uint8)
        offset = -self._raw.ctypes.data % 64
        self._address = self._raw.ctypes.data + offset
        self._map = self._raw[offset : offset + TENSOR_MAP_BYTES]
        self._lock = threading.Lock()  # one buffer: one encoding at a time

    def __call__(self, ptr: int) -> bytes:
        with self._lock:
            rc = self._encode(
                self._address, _DATA_TYPE_UINT16, 4, ptr, *self._args, _INTERLEAVE_NONE, _SWIZZLE_128B,
                _L2_PROMOTION_256B, _OOB_FILL_ZERO,
            )  # fmt: skip
            if rc != 0:
                shape, strides, box = self._what
                raise RuntimeError(
                    f"cuTensorMapEncodeTiled failed with CUresult {rc} for an array at {ptr:#x} of shape {shape}, "
                    f"byte strides {strides}, box {box}"
                )
            return self._map.tobytes()
