"""The repeat-call path of ``attention`` for CuPy arrays and torch CUDA tensors.

Everything that depends only on a call's *signature* is decided by the first
call of that signature (``api.attention`` validates, plans and launches it)
and kept in an :class:`Entry`: the checks of framework, device, dtypes,
shapes, strides, flags and kernel support, the plan (kernel, grid, packed
constant arguments), the shapes of what the call allocates, the byte extent
of each array. The signature is everything those depend on:

- per array (q, k, v, out, a device seqlens_k, workspace): type, dtype, shape,
  strides, device (and requires_grad for torch);
- whether all of q, k, v and out sit at 16-byte aligned addresses (the vector
  kernels need it);
- where seqlens_k lives (none, host, device), whether out and workspace are
  given;
- causal, softmax_scale, return_lse, kernel, precision, layout, each with its
  type (True and 1, 1.0 and True must not share an entry).

A repeat call builds the signature, finds its entry and reads only what can
differ between calls: the addresses (the overlap of out and of the workspace
with the inputs is checked on every call), a host seqlens_k's values (checked
and copied on every call) and the current stream. It reads torch tensors
through ``data_ptr()``, ``shape`` and ``stride()``, with no DLPack, and
launches through the driver (``_launch.PackedLaunch``). Whatever the
signature can't be built for (other array types, unhashable arguments) takes
the full path, which raises the errors; an invalid call never gets an entry.
"""
from __future__ import annotations

import sys

import numpy as np

MAX_ENTRIES = 4096  # signatures kept; the table starts over beyond it
_entries: dict = {}
_types: dict = {}  # array type -> "torch" or "cupy", registered by the full path


def clear() -> None:
    """Forget every entry (the next call of each signature takes the full path)."""
    _entries.clear()


def register(array_type, kind: str) -> None:
    _types[array_type] = kind


def remember(key, entry) -> None:
    if len(_entries) >= MAX_ENTRIES:
        _entries.clear()
    _entries[key] = entry


def signature(q, k, v, out, seqlens_k, workspace, flags: tuple, index: tuple = ()):
    """(key, addresses) of a CUDA call, or None where only the full path applies.

    addresses: q, k, v, out (0: none given), seqlens_k (0: none, None: on the
    host), workspace (0: none given), and the per-sequence index arrays'
    (``index``: cu_seqlens_q, cu_seqlens_k, block_table, cache_leftpad, each
    None or a CUDA array; a host one takes the full path, which checks its
    values), () for a call without them."""
    t = type(q)
    kind = _types.get(t)
    if kind == "torch":
        arrays = (
            q.dtype, q.shape, q.stride(), q.get_device(), q.requires_grad,
            type(k), k.dtype, k.shape, k.stride(), k.get_device(), k.requires_grad,
            type(v), v.dtype, v.shape, v.stride(), v.get_device(), v.requires_grad,
        )  # fmt: skip
        qp, kp, vp = q.data_ptr(), k.data_ptr(), v.data_ptr()
        if out is None:
            out_sig, op = None, 0
        else:
            out_sig = (type(out), out.dtype, out.shape, out.stride(), out.get_device(), out.requires_grad)
            op = out.data_ptr()
        if workspace is None:
            ws_sig, wp = None, 0
        else:
            ws_sig = (type(workspace), workspace.dtype, workspace.shape, workspace.stride(), workspace.get_device(), workspace.requires_grad)
            wp = workspace.data_ptr()
    elif kind == "cupy":
        qd, kd, vd = q.data, k.data, v.data
        arrays = (
            q.dtype, q.shape, q.strides, qd.device_id,
            type(k), k.dtype, k.shape, k.strides, kd.device_id,
            type(v), v.dtype, v.shape, v.strides, vd.device_id,
        )  # fmt: skip
        qp, kp, vp = qd.ptr, kd.ptr, vd.ptr
        if out is None:
            out_sig, op = None, 0
        else:
            od = out.data
            out_sig = (type(out), out.dtype, out.shape, out.strides, od.device_id)
            op = od.ptr
        if workspace is None:
            ws_sig, wp = None, 0
        else:
            wd = workspace.data
            ws_sig = (type(workspace), workspace.dtype, workspace.shape, workspace.strides, wd.device_id)
            wp = wd.ptr
    else:
        return None

    if seqlens_k is None:
        lens_sig, lp = None, 0
    else:
        lt = type(seqlens_k)
        lkind = _types.get(lt)
        if lkind == "torch" and seqlens_k.get_device() >= 0:
            lens_sig = (lt, seqlens_k.dtype, seqlens_k.shape, seqlens_k.stride(), seqlens_k.get_device())
            lp = seqlens_k.data_ptr()
        elif lkind == "cupy":
            ld = seqlens_k.data
            lens_sig = (lt, seqlens_k.dtype, seqlens_k.shape, seqlens_k.strides, ld.device_id)
            lp = ld.ptr
        elif lkind == "torch" or lt in (list, tuple, np.ndarray):
            lens_sig, lp = (lt, "host"), None
        else:
            return None
    index_sig, sp = (), ()
    if index:
        index_sig, sp = _index_signature(index)
        if index_sig is None:
            return None
    aligned = not (qp | kp | vp | op) & 15
    key = (t, arrays, out_sig, ws_sig, lens_sig, aligned, flags, index_sig)
    return key, (qp, kp, vp, op, lp, wp, sp)


def _index_signature(index: tuple):
    """(signature, addresses) of the per-sequence index arrays, (None, ()) if one
    is not a CUDA array of a registered type."""
    sigs, addresses = [], []
    for a in index:
        if a is None:
            sigs.append(None)
            addresses.append(0)
            continue
        t = type(a)
        kind = _types.get(t)
        if kind == "torch" and a.get_device() >= 0:
            sigs.append((t, a.dtype, a.shape, a.stride(), a.get_device()))
            addresses.append(a.data_ptr())
        elif kind == "cupy":
            d = a.data
            sigs.append((t, a.dtype, a.shape, a.strides, d.device_id))
            addresses.append(d.ptr)
        else:
            return None, ()
    return tuple(sigs), tuple(addresses)


def lookup(key):
    return _entries.get(key)


def _overlaps(lo: int, hi: int, a_lo: int, a_hi: int) -> bool:
    return lo < a_hi and a_lo < hi


class Entry:
    """One signature's decisions; calling it runs a repeat call.

    ``extents``: bytes spanned by q, k, v, out (and a device seqlens_k), from
    their first element. ``host_lens``: the full path's check and copy of a host
    seqlens_k, returning the device array (kept until the launch is queued)."""

    __slots__ = (
        "kind", "device", "launch", "return_lse", "out_shape", "lse_shape", "dtype", "aligned_out",
        "q_ext", "k_ext", "v_ext", "out_ext", "lens_ext", "ws_bytes", "host_lens", "capture_message", "torch_device", "_stream",
        "_empty", "_float32", "_capturing", "_get_device", "_set_device",
    )  # fmt: skip

    def __init__(
        self, *, kind, device, launch, return_lse, out_shape, lse_shape, dtype, aligned_out, extents, ws_bytes, host_lens,
        capture_message="",
    ):  # fmt: skip
        self.kind, self.device, self.launch = kind, device, launch  # (stream, q, k, v, out, lse, seqlens_k, workspace)
        self.return_lse, self.out_shape, self.lse_shape, self.dtype = return_lse, out_shape, lse_shape, dtype
        self.aligned_out = aligned_out  # the plan needs a 16-byte aligned out (a new one is checked)
        self.q_ext, self.k_ext, self.v_ext, self.out_ext, self.lens_ext = extents
        self.ws_bytes, self.host_lens, self.capture_message = ws_bytes, host_lens, capture_message
        from cupy.cuda import runtime

        self._get_device, self._set_device = runtime.getDevice, runtime.setDevice
        self._capturing = runtime.streamIsCapturing
        if kind == "torch":
            torch = sys.modules["torch"]
            self.torch_device = torch.device("cuda", device)
            self._empty, self._float32 = torch.empty, torch.float32
            raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
            if raw is not None:
                self._stream = raw
            else:
                self._stream = lambda index: torch.cuda.current_stream(index).cuda_stream
        else:
            import cupy

            self.torch_device = None
            self._empty, self._float32 = cupy.empty, cupy.float32
            self._stream = lambda index: cupy.cuda.get_current_stream(index).ptr

    def _new(self, shape, dtype):
        if self.kind == "torch":
            return self._empty(shape, dtype=dtype, device=self.torch_device)
        return self._empty(shape, dtype=dtype)  # on the current device, set by the caller

    def _address(self, a) -> int:
        return a.data_ptr() if self.kind == "torch" else a.data.ptr

    def __call__(self, q, k, v, out, seqlens_k, workspace, addresses):
        """The result, or None when this call must take the full path after all."""
        qp, kp, vp, op, lp, wp, sp = addresses
        previous = self._get_device()
        if previous != self.device:
            self._set_device(self.device)
        try:
            if out is None:
                # torch: new_empty takes q's dtype and device (a third cheaper than torch.empty's keywords)
                out = q.new_empty(self.out_shape) if self.kind == "torch" else self._new(self.out_shape, self.dtype)
                op = self._address(out)
                if self.aligned_out and op & 15:
                    return None
            else:  # the addresses are the call's own: checked every call
                hi = op + self.out_ext
                if _overlaps(op, hi, qp, qp + self.q_ext):
                    raise ValueError("out: must not overlap the memory of q")
                if _overlaps(op, hi, kp, kp + self.k_ext):
                    raise ValueError("out: must not overlap the memory of k")
                if _overlaps(op, hi, vp, vp + self.v_ext):
                    raise ValueError("out: must not overlap the memory of v")
            lse, lsep = None, 0
            if self.return_lse:
                lse = self._new(self.lse_shape, self._float32)
                lsep = self._address(lse)
            lens = None
            if lp is None:  # host values: checked and copied at every call
                lens = self.host_lens(seqlens_k)
                lp = lens.data.ptr
            stream = self._stream(self.device)
            work = None
            if self.ws_bytes:
                if workspace is not None:
                    self._check_workspace(wp, qp, kp, vp, op, lp)
                elif self.kind == "torch":  # torch's allocator: capture-aware, on this stream
                    work = self._new((self.ws_bytes // 4,), self._float32)
                    wp = work.data_ptr()
                elif self._capturing(stream):
                    raise ValueError(self.capture_message)
                else:  # CuPy's pool, stream-ordered on this (current) stream
                    work = self._new((self.ws_bytes // 4,), self._float32)
                    wp = work.data.ptr
            else:
                wp = 0
            if sp:  # a per-sequence call: its index arrays' addresses too
                self.launch(stream, qp, kp, vp, op, lsep, lp, wp, seq=sp)
            else:
                self.launch(stream, qp, kp, vp, op, lsep, lp, wp)
        finally:
            if previous != self.device:
                self._set_device(previous)
        return (out, lse) if self.return_lse else out

    def _check_workspace(self, wp, qp, kp, vp, op, lp) -> None:
        if wp % 16:
            raise ValueError(f"workspace: expected a 16-byte aligned address, got {wp:#x}")
        hi = wp + self.ws_bytes
        for name, p, ext in (("q", qp, self.q_ext), ("k", kp, self.k_ext), ("v", vp, self.v_ext), ("out", op, self.out_ext)):
            if _overlaps(wp, hi, p, p + ext):
                raise ValueError(f"workspace: must not overlap the memory of {name}")
        if lp and self.lens_ext and _overlaps(wp, hi, lp, lp + self.lens_ext):
            raise ValueError("workspace: must not overlap the memory of seqlens_k")
