"""Per-sequence addressing: variable-length batches, paged KV caches, left padding.

The public side is ``attention_varlen`` (packed sequences, FlashAttention's
``flash_attn_varlen_func`` convention) and the ``block_table`` and
``cache_leftpad`` keywords of ``attention`` (``flash_attn_with_kvcache``'s).
This module checks their index arrays, describes a call's addressing to the
kernels (:class:`SeqLayout`, mirrored by kernels/common.cuh: SeqParams) and
runs the NumPy backend sequence by sequence.

Every index array is read in place by the kernels when it is a CUDA int32
array, so a call can be captured into a CUDA graph and replayed after the
lengths, offsets or page tables change; nothing on the host depends on their
values (``max_seqlen_q`` and ``max_seqlen_k`` are host integers given by the
caller). Host arrays are checked on the host and copied to the device at each
call.
"""
from __future__ import annotations

import numbers
from dataclasses import dataclass, replace

import numpy as np

from . import _interop

# kernels/common.cuh: SEQ_* (the ADDR template argument of the *_seq kernels)
SEQ_VARLEN = 1  # queries and keys packed along one axis, offsets cu_seqlens_q / cu_seqlens_k
SEQ_PAGED = 2  # keys in pages of page_size rows, found through block_table
SEQ_LEFTPAD = 4  # each sequence's keys start at cache_leftpad[b]

PAGE_MULTIPLE = 16  # page_size must be a multiple of this

# kernels/common.cuh: SeqParams, field by field
SEQ_PARAMS_DTYPE = np.dtype(
    [
        ("cu_seqlens_q", np.uint64), ("cu_seqlens_k", np.uint64), ("block_table", np.uint64), ("leftpad", np.uint64),
        ("block_table_stride", np.int64), ("page_size", np.int32), ("total_q", np.int32), ("total_k", np.int32),
        ("pad", np.int32),
    ],
    align=True,
)  # fmt: skip
assert SEQ_PARAMS_DTYPE.itemsize == 56


@dataclass(frozen=True)
class SeqLayout:
    """How the kernels find each sequence's queries and keys (kernels/common.cuh:
    SeqParams): the SEQ_* flags, the page geometry, the packed totals and the
    device addresses of the index arrays (0: not given)."""

    flags: int
    page_size: int = 0
    block_table_stride: int = 0  # elements between the rows of block_table
    total_q: int = 0  # SEQ_VARLEN: rows of q (lse is (num_q_heads, total_q))
    total_k: int = 0  # SEQ_VARLEN: rows of k and v
    cu_seqlens_q: int = 0
    cu_seqlens_k: int = 0
    block_table: int = 0
    leftpad: int = 0

    @property
    def varlen(self) -> bool:
        return bool(self.flags & SEQ_VARLEN)

    @property
    def paged(self) -> bool:
        return bool(self.flags & SEQ_PAGED)

    def params(self) -> bytes:
        sp = np.zeros(1, SEQ_PARAMS_DTYPE)
        for field in ("cu_seqlens_q", "cu_seqlens_k", "block_table", "leftpad", "block_table_stride", "page_size",
                      "total_q", "total_k"):  # fmt: skip
            sp[field] = getattr(self, field)
        return sp.tobytes()

    def describe(self) -> str:
        """What the call uses, for messages."""
        parts = [name for flag, name in ((SEQ_VARLEN, "varlen"), (SEQ_PAGED, "block_table"), (SEQ_LEFTPAD, "cache_leftpad"))
                 if self.flags & flag]  # fmt: skip
        return " and ".join(parts)


_HOST = "a list, tuple, NumPy array or CPU torch tensor"


def check_index_array(name: str, a, frame: _interop.Frame, shape: tuple, what: str, accepted: str = _HOST):
    """An integer index array (cu_seqlens_*, block_table, cache_leftpad, seqlens_k),
    checked on the host without touching the device: ("host", int64 NumPy array)
    or ("device", the CUDA array, int32 of this shape on q's device). `what` names
    the shape's axes and `accepted` every form that a wrong type is told of."""
    kind = "list" if isinstance(a, (list, tuple)) else _interop._kind(a)
    if kind == "unknown":
        raise TypeError(
            f"{name}: expected {accepted}, or a CUDA array of int32, got {type(a).__module__}.{type(a).__qualname__}"
        )
    if kind == "list" or kind == "numpy" or (kind == "torch" and a.device.type == "cpu"):
        if kind == "torch":
            if a.is_floating_point() or a.is_complex() or _interop.dtype_name(a) == "bool":
                raise TypeError(f"{name}: expected an integer dtype, got {_interop.dtype_name(a)}")
            a = a.numpy()
        host = np.asarray(a)
        if kind == "list" and host.size == 0:
            host = host.astype(np.int64)  # [] is float64 to NumPy
        if host.dtype.kind not in "iu":
            raise TypeError(f"{name}: expected an integer dtype, got {host.dtype}")
        if host.shape != shape:
            raise ValueError(f"{name}: expected shape {shape} {what}, got {host.shape}")
        return ("host", host.astype(np.int64))
    dev = _interop._device_of(a, kind, name)
    if not frame.on_gpu:
        raise ValueError(f"{name}: expected {_HOST} for CPU inputs, got an array on cuda:{dev}")
    if dev != frame.device:
        raise ValueError(f"{name}: expected device cuda:{frame.device} (that of q), got cuda:{dev}")
    if _interop.dtype_name(a) != "int32":
        raise TypeError(
            f"{name}: expected dtype int32 for a CUDA array (the kernels read it in place), got {_interop.dtype_name(a)}"
        )
    if tuple(a.shape) != shape:
        raise ValueError(f"{name}: expected shape {shape} {what}, got {tuple(a.shape)}")
    return ("device", a)


def index_backend(name: str, checked, frame: _interop.Frame):
    """A checked index array as the backend reads it: an int64 NumPy array (CPU),
    or an int32 CuPy array on the current device whose last axis has unit stride
    (a host array is copied on the current stream)."""
    b, in_place = _interop.checked_backend(name, checked, frame, np.int32)
    if not in_place:
        return b
    if b.ndim and b.shape[-1] > 1 and b.strides[-1] != b.itemsize:
        raise ValueError(f"{name}: expected a unit-stride last axis (it is read in place), got strides {b.strides} bytes")
    if b.ndim == 2 and b.shape[0] > 1 and b.strides[0] < 0:
        raise ValueError(f"{name}: expected non-negative strides, got {b.strides} bytes")
    return b


def check_max_seqlen(name: str, value) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name}: expected a host integer >= 0, got {type(value).__name__} {value!r}")
    if value < 0:
        raise ValueError(f"{name}: expected a host integer >= 0, got {value}")
    return int(value)


def check_cu_seqlens(name: str, host: np.ndarray, total: int, max_seqlen: int, total_name: str, max_name: str) -> None:
    """The values of a host cu_seqlens: 0 <= cu[0] <= cu[1] <= ... <= cu[-1] <= total,
    every length at most max_seqlen."""
    if host.size == 0:
        return
    if host[0] < 0:
        raise ValueError(f"{name}: expected values >= 0, got {host[0]} at index 0")
    lens = np.diff(host)
    bad = np.flatnonzero(lens < 0)
    if bad.size:
        i = int(bad[0])
        raise ValueError(
            f"{name}: expected non-decreasing offsets, got {host[i + 1]} after {host[i]} at index {i + 1}"
        )
    if host[-1] > total:
        raise ValueError(f"{name}: expected a last offset <= {total} ({total_name}), got {host[-1]}")
    long = np.flatnonzero(lens > max_seqlen)
    if long.size:
        i = int(long[0])
        raise ValueError(
            f"{name}: expected sequence lengths <= {max_name}={max_seqlen}, got {lens[i]} for sequence {i}"
        )


def attention_seq_cpu(q, k, v, out, lse, *, causal: bool, softmax_scale: float, seq: SeqLayout, cu_seqlens_q=None,
                      cu_seqlens_k=None, block_table=None, seqlens_k=None, leftpad=None, mods=None) -> None:  # fmt: skip
    """The NumPy backend of a per-sequence call: each sequence's queries, keys
    (gathered from its pages for a paged cache) and results are cut out and run
    through cpu.attention_cpu as a batch of one, which writes into views of out
    and lse.

    q, out : (batch, seqlen_q, num_q_heads, head_dim), or (1, total_q, ...) for varlen;
    k, v : (batch, seqlen_k, ...), (num_pages, page_size, ...) when paged, (1, total_k, ...) for varlen;
    lse : (batch, num_q_heads, seqlen_q), (num_q_heads, total_q) for varlen, or None.
    The index arrays are int64 NumPy arrays whose values the caller has checked.
    mods: _mods.CpuModifiers or None; each sequence runs them as batch b (its
    index: ALiBi's row of slopes, a user modifier's b).
    """
    from .cpu import attention_cpu

    batch = len(cu_seqlens_q) - 1 if seq.varlen else q.shape[0]
    for b in range(batch):
        if seq.varlen:
            q0, q1 = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1])
            k0, k1 = int(cu_seqlens_k[b]), int(cu_seqlens_k[b + 1])
            qs, os_ = q[:, q0:q1], out[:, q0:q1]
            ks, vs = k[:, k0:k1], v[:, k0:k1]
            ls = None if lse is None else lse[None, :, q0:q1]
        else:
            qs, os_ = q[b : b + 1], out[b : b + 1]
            ls = None if lse is None else lse[b : b + 1]
            end = k.shape[1] if seqlens_k is None else int(seqlens_k[b])
            if seq.paged:
                end = int(seqlens_k[b])
                pages = block_table[b, : -(-end // seq.page_size)]
                ks = k[pages].reshape(1, -1, *k.shape[2:])[:, :end]
                vs = v[pages].reshape(1, -1, *v.shape[2:])[:, :end]
            else:
                ks, vs = k[b : b + 1, :end], v[b : b + 1, :end]
            if leftpad is not None:
                first = int(leftpad[b])
                ks, vs = ks[:, first:], vs[:, first:]
        if qs.shape[1] == 0:
            continue
        if ks.shape[1] == 0:  # every row sees no key
            os_[...] = 0
            if ls is not None:  # lse -inf, or with sinks the sink's
                ls[...] = -np.inf if mods is None or mods.sinks is None else mods.sinks[None, :, None]
            continue
        attention_cpu(qs, ks, vs, os_, ls, causal=causal, softmax_scale=softmax_scale,
                      mods=None if mods is None else replace(mods, batch_offset=b))
