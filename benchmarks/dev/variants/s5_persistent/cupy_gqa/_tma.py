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
"""
from __future__ import annotations

import ctypes
import functools
import sys

import numpy as np

TENSOR_MAP_BYTES = 128
TENSOR_MAP_DTYPE = np.dtype((np.void, TENSOR_MAP_BYTES))
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


def map_geometry(shape: tuple, strides: tuple, itemsize: int, block_n: int):
    """The encoder's (dims, byte strides, box) for a (batch, seqlen, heads, head_dim)
    array with byte ``strides``: dims innermost first, strides of dims 1.. (the
    head_dim stride is the element size). A dimension of extent 1 is never
    stepped, so its stride is given as 16 bytes, which the encoder accepts
    whatever the array's own stride is (0 for a broadcast, say)."""
    batch, seqlen, heads, head_dim = shape
    dims = (head_dim, seqlen, heads, batch)
    step = (strides[1], strides[2], strides[0])
    byte_strides = tuple(s if n > 1 else 16 for s, n in zip(step, dims[1:]))
    box = (BOX_COLUMNS, block_n, 1, 1)
    assert itemsize == 2, "the hopper kernel moves 16-bit elements"
    return dims, byte_strides, box


def tile_map(ptr: int, shape: tuple, strides: tuple, itemsize: int, block_n: int) -> np.ndarray:
    """The tensor map of the array at device address ``ptr`` for boxes of
    ``block_n`` rows, as a 1-element NumPy array of 128 bytes that CuPy passes
    by value."""
    encode = _encoder()
    if encode is None:
        raise RuntimeError("the CUDA driver has no cuTensorMapEncodeTiled (it needs CUDA 12 or newer)")
    dims, byte_strides, box = map_geometry(shape, strides, itemsize, block_n)
    out = np.zeros(1, TENSOR_MAP_DTYPE)
    rc = encode(
        out.ctypes.data, _DATA_TYPE_UINT16, 4, ctypes.c_void_p(ptr), _u64x4(*dims), (ctypes.c_uint64 * 3)(*byte_strides),
        _u32x4(*box), _u32x4(1, 1, 1, 1), _INTERLEAVE_NONE, _SWIZZLE_128B, _L2_PROMOTION_256B, _OOB_FILL_ZERO,
    )  # fmt: skip
    if rc != 0:
        raise RuntimeError(
            f"cuTensorMapEncodeTiled failed with CUresult {rc} for an array at {ptr:#x} of shape {shape}, "
            f"byte strides {strides}, box {box}"
        )
    return out
