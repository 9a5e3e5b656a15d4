"""The public function: validation and dispatch. Launch plans are in ``_plan``."""
from __future__ import annotations

import functools
import math
import numbers

import numpy as np

from . import _interop, _plan
from ._specs import DTYPES, MAX_HEAD_DIM, PRECISIONS
from .cpu import attention_cpu

KERNELS = tuple(_plan.LAUNCH)  # the GPU kernel families, e.g. ("rowwise",)
_KERNEL_CHOICES = ("auto", *KERNELS)
LAYOUTS = ("bshd", "bhsd")  # axis orders of q, k, v and out
_BHSD_TO_BSHD = (0, 2, 1, 3)  # the axes of a "bhsd" array, seen as "bshd"
# The axes of q and of k, v as each layout orders them, for messages.
_AXES = {
    "bshd": ("(batch, seqlen_q, num_q_heads, head_dim)", "(batch, seqlen_k, num_kv_heads, head_dim)"),
    "bhsd": ("(batch, num_q_heads, seqlen_q, head_dim)", "(batch, num_kv_heads, seqlen_k, head_dim)"),
}


def attention(
    q,
    k,
    v,
    *,
    causal=True,
    softmax_scale=None,
    return_lse=False,
    out=None,
    kernel="auto",
    precision="highest",
    seqlens_k=None,
    layout="bshd",
):
    """Causal grouped-query attention: ``softmax(scale * q k^T + mask) v`` per query head.

    Parameters
    ----------
    q : (batch, seqlen_q, num_q_heads, head_dim)
    k : (batch, seqlen_k, num_kv_heads, head_dim)
    v : (batch, seqlen_k, num_kv_heads, head_dim)
        In this axis order for ``layout="bshd"``; ``layout="bhsd"`` swaps the
        sequence and head axes. CuPy arrays, PyTorch tensors (CUDA or CPU),
        NumPy arrays, or any CUDA array exporting ``__dlpack__`` (JAX, ...),
        all of one framework and device. dtype float32, float16, bfloat16 or
        float64, the same for all three; 1 <= head_dim <= 256. Any
        non-negative strides (slices of a packed QKV tensor, transposed
        views): nothing is copied.
    causal : bool, default True
        Mask aligned to the bottom-right corner: query ``i`` sees keys
        ``j <= i + seqlen_k - seqlen_q``. With seqlen_q == seqlen_k this is the
        usual lower triangle; a single decode query sees the whole cache::

            seqlen_q=3, seqlen_k=5            seqlen_q=5, seqlen_k=3
                      keys 0 1 2 3 4                   keys 0 1 2
            query 0        1 1 1 . .       query 0          . . .   <- sees no key:
            query 1        1 1 1 1 .       query 1          . . .      out 0, lse -inf
            query 2        1 1 1 1 1       query 2          1 . .
                                           query 3          1 1 .
                                           query 4          1 1 1

    softmax_scale : float, default ``1 / sqrt(head_dim)``
    return_lse : bool, default False
        Also return ``lse``, float32 (batch, num_q_heads, seqlen_q): the natural
        log of the softmax denominator of the scaled scores, -inf for a row that
        sees no key.
    out : array like q, optional
        Preallocated result (same framework, device, shape, layout and dtype as
        q; any non-negative strides; must not overlap q, k or v).
    kernel : {"auto", "rowwise", "tiled", "hopper", "decode"}
        "rowwise" is one thread (or a small team) per query row with an online
        softmax, and runs every call. "tiled" is the tensor-core kernel for
        float16, bfloat16 and float32 (split TF32, see ``precision``) with
        head_dim 32, 64, 96, 128 or 256, a unit-stride
        head_dim axis, 16-byte aligned rows and softmax_scale > 0. "hopper" is
        the prefill kernel for Hopper GPUs (compute capability 9.0: H100,
        H200) on warpgroup tensor cores, float16 and bfloat16, any head_dim
        that is a multiple of 8, with the same stride, alignment and scale
        rules as "tiled". "decode" is
        the split-KV kernel for a few query tokens against a long KV cache:
        float16, bfloat16 or float32, head_dim 64, 128 or 256, seqlen_q <= 16,
        a unit-stride head_dim axis and 16-byte aligned rows; with the keys cut
        into several ranges it takes a float32 workspace of
        ``batch * num_q_heads * seqlen_q * num_splits * (head_dim + 1)`` values
        from CuPy's memory pool for the duration of the call. "tiled", "hopper"
        and "decode" raise ValueError for a call they don't support. "auto"
        picks "decode" when it applies and seqlen_q * group_size is at most 32
        for float16 and bfloat16 or 4 for float32
        (``_plan.DECODE_AUTO_MAX_ROWS``), else "hopper" when it applies, else
        "tiled" when it applies, else "rowwise". NumPy and CPU torch
        inputs run the NumPy backend and take "auto" only.
    precision : {"highest", "tf32"}, default "highest"
        float32 only (no effect on other dtypes). "highest" is fp32-accurate
        (relative error around 1e-7 to 1e-6): the tiled kernel multiplies on
        the TF32 tensor cores with each operand split into two TF32 parts
        (three products per product); rowwise and decode are plain fp32. "tf32"
        lets the tiled kernel use one TF32 product: faster, with a relative
        error of about 1e-3 (at most 2e-3 in our tests); calls that the tiled
        kernel doesn't take still run in full fp32.
    seqlens_k : (batch,) integer array, optional
        The valid length of each sequence's KV cache (FlashAttention's
        ``cache_seqlens``): keys ``j >= seqlens_k[b]`` of batch ``b`` are
        ignored, and the causal mask is aligned to that length, so query ``t``
        of batch ``b`` sees keys ``j <= t + seqlens_k[b] - seqlen_q``. A
        sequence of length 0 gives zeros and lse = -inf. Default: every
        sequence has all seqlen_k keys.
        A host array (NumPy, list, tuple, CPU torch tensor; any integer dtype)
        is checked on the host (0 <= value <= seqlen_k) and copied to the
        device asynchronously on the call's stream. A CUDA array (CuPy, torch,
        on q's device) is read in place by the kernels: it must be int32 with
        shape (batch,) and unit stride, and its values are not checked on the
        host, since that would wait for the device: every kernel instead gives
        NaN rows (out and lse) for a batch whose value is out of range, and
        reads no key of it. Pass a host array to have the values checked.
        While a CUDA graph is being captured only a CUDA array is taken (a
        ValueError says so): a host array's copy would be captured with this
        call's values.
    layout : {"bshd", "bhsd"}, default "bshd"
        The axis order of q, k, v and out. "bshd" is (batch, seqlen, heads,
        head_dim), as above (FlashAttention's order). "bhsd" is (batch, heads,
        seqlen, head_dim), the order of torch's
        ``scaled_dot_product_attention``: q (batch, num_q_heads, seqlen_q,
        head_dim), k and v (batch, num_kv_heads, seqlen_k, head_dim). Either
        way the kernels read the arrays in place through their strides (a
        "bhsd" array is seen as a transposed "bshd" view), so nothing is
        copied; the result is in the same layout, and lse is (batch,
        num_q_heads, seqlen_q) in both.

    Returns
    -------
    out : like q, in q's framework and layout (or ``(out, lse)`` with ``return_lse``).

    Notes
    -----
    Grouped-query heads: ``group_size = num_q_heads // num_kv_heads`` and query
    head ``h`` reads KV head ``h // group_size``. With 6 query heads and 2 KV
    heads, query heads 0, 1, 2 read KV head 0 and 3, 4, 5 read KV head 1.
    MHA is group_size 1; MQA is num_kv_heads 1.

    Arithmetic is float32 (float64 for float64 inputs); the result is rounded
    to the input dtype. NaN or Inf inside the data propagates as it does in the
    float64 definition. CUDA work is launched on CuPy's current stream, or on
    torch's current stream for torch tensors, with no synchronisation.
    """
    if kernel not in _KERNEL_CHOICES:
        raise ValueError(f"kernel: expected one of {_KERNEL_CHOICES}, got {kernel!r}")
    if precision not in PRECISIONS:
        raise ValueError(f"precision: expected one of {PRECISIONS}, got {precision!r}")
    if layout not in LAYOUTS:
        raise ValueError(f"layout: expected one of {LAYOUTS}, got {layout!r}")
    for name, flag in (("causal", causal), ("return_lse", return_lse)):
        if not isinstance(flag, (bool, np.bool_)):
            raise TypeError(f"{name}: expected a bool, got {type(flag).__name__} {flag!r}")

    named = {"q": q, "k": k, "v": v} if out is None else {"q": q, "k": k, "v": v, "out": out}
    frame = _interop.frame_of(named)
    bhsd = layout == "bhsd"
    dtype = _check_shapes_and_dtypes(q, k, v, bhsd)
    batch, seqlen_q, num_q_heads, head_dim = (q.shape[0], q.shape[2], q.shape[1], q.shape[3]) if bhsd else q.shape
    softmax_scale = _check_scale(softmax_scale, head_dim)
    lens = _check_seqlens_k(seqlens_k, frame, batch, k.shape[2 if bhsd else 1])
    if kernel != "auto" and not frame.on_gpu:
        raise ValueError(f"kernel: {kernel!r} runs on CUDA arrays; CPU inputs use the NumPy backend, kernel='auto'")

    with _interop.running_on(frame):
        qb, kb, vb = (_interop.to_backend(x, frame) for x in (q, k, v))
        for name, a in (("q", qb), ("k", kb), ("v", vb)):
            _check_strides(name, a)
        if out is None:
            out, outb = _interop.empty(tuple(q.shape), q, frame)  # contiguous in the caller's layout
        else:
            outb = _interop.to_backend(out, frame)
            _check_out(out, outb, tuple(q.shape), qb, kb, vb, dtype)
        if bhsd:  # from here on (batch, seqlen, heads, head_dim): transposed views, nothing copied
            qb, kb, vb, outb = (a.transpose(_BHSD_TO_BSHD) for a in (qb, kb, vb, outb))
        lse, lseb = (None, None)
        if return_lse:
            lse, lseb = _interop.empty((batch, num_q_heads, seqlen_q), q, frame, float32=True)

        lensb = _seqlens_k_backend(lens, frame)  # the last check, then the host array's copy
        problem = _plan.Problem.of(
            qb, kb, dtype=dtype, causal=bool(causal), softmax_scale=softmax_scale, precision=precision
        )
        if outb.size == 0:
            pass  # nothing to compute, nothing launched
        elif problem.seqlen_k == 0:
            outb.fill(0)  # every row sees no key
            if lseb is not None:
                lseb.fill(-np.inf)
        elif not frame.on_gpu:
            attention_cpu(qb, kb, vb, outb, lseb, causal=problem.causal, softmax_scale=softmax_scale, seqlens_k=lensb)
        else:
            family = _plan.choose_kernel(problem, qb, kb, vb, outb) if kernel == "auto" else kernel
            # auto's choice has checked that the family supports the call; a forced one checks here
            _plan.LAUNCH[family](problem, qb, kb, vb, outb, lseb, lensb, checked=kernel == "auto")
    return (out, lse) if return_lse else out


def _check_shapes_and_dtypes(q, k, v, bhsd: bool = False) -> str:
    """The dtype of q, k, v after checking their dtypes and shapes, in the caller's layout."""
    q_axes, kv_axes = _AXES["bhsd" if bhsd else "bshd"]
    for name, x in (("q", q), ("k", k), ("v", v)):
        if len(x.shape) != 4:
            axes = q_axes if name == "q" else kv_axes
            raise ValueError(f"{name}: expected 4 dimensions {axes}, got shape {tuple(x.shape)}")
    dtype = _interop.dtype_name(q)
    if dtype not in DTYPES:
        raise TypeError(f"q: expected dtype in {DTYPES}, got {dtype}")
    for name, x in (("k", k), ("v", v)):
        if _interop.dtype_name(x) != dtype:
            raise TypeError(f"{name}: expected dtype {dtype} (that of q), got {_interop.dtype_name(x)}")

    heads = 1 if bhsd else 2  # the axis of the heads
    batch, num_q_heads, head_dim = q.shape[0], q.shape[heads], q.shape[3]
    num_kv_heads = k.shape[heads]
    if k.shape[0] != batch or k.shape[3] != head_dim:
        raise ValueError(
            f"k: expected shape {kv_axes} with batch={batch} and head_dim={head_dim} from q, got {tuple(k.shape)}"
        )
    if tuple(v.shape) != tuple(k.shape):
        raise ValueError(f"v: expected shape {tuple(k.shape)} (that of k), got {tuple(v.shape)}")
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"q: expected head_dim in [1, {MAX_HEAD_DIM}], got {head_dim}")
    if num_kv_heads < 1 or num_q_heads < 1 or num_q_heads % num_kv_heads:
        raise ValueError(
            f"k: expected num_kv_heads >= 1 dividing num_q_heads={num_q_heads}, got num_kv_heads={num_kv_heads}"
        )
    return dtype


_HOST_SEQLENS = "a list, tuple, NumPy array or CPU torch tensor"


def _check_seqlens_k(seqlens_k, frame: _interop.Frame, batch: int, seqlen_k: int):
    """seqlens_k, validated on the host without touching the device.

    Returns None, ("host", int64 NumPy array) with every value checked, or
    ("device", the CUDA array) with its dtype, shape and device checked."""
    if seqlens_k is None:
        return None
    kind = "list" if isinstance(seqlens_k, (list, tuple)) else _interop._kind(seqlens_k)
    on_cpu = kind in ("list", "numpy") or (kind == "torch" and seqlens_k.device.type == "cpu")
    if kind == "unknown":
        raise TypeError(
            f"seqlens_k: expected None, {_HOST_SEQLENS}, or a CUDA array of int32, "
            f"got {type(seqlens_k).__module__}.{type(seqlens_k).__qualname__}"
        )
    expected_shape = f"({batch},) (the batch of q)"
    if not on_cpu:
        dev = _interop._device_of(seqlens_k, kind)
        if not frame.on_gpu:
            raise ValueError(f"seqlens_k: expected {_HOST_SEQLENS} for CPU inputs, got an array on cuda:{dev}")
        if dev != frame.device:
            raise ValueError(f"seqlens_k: expected device cuda:{frame.device} (that of q), got cuda:{dev}")
        if _interop.dtype_name(seqlens_k) != "int32":
            raise TypeError(
                f"seqlens_k: expected dtype int32 for a CUDA array (the kernels read it in place), "
                f"got {_interop.dtype_name(seqlens_k)}"
            )
        if tuple(seqlens_k.shape) != (batch,):
            raise ValueError(f"seqlens_k: expected shape {expected_shape}, got {tuple(seqlens_k.shape)}")
        return ("device", seqlens_k)

    if kind == "torch":
        if seqlens_k.is_floating_point() or seqlens_k.is_complex() or _interop.dtype_name(seqlens_k) == "bool":
            raise TypeError(f"seqlens_k: expected an integer dtype, got {_interop.dtype_name(seqlens_k)}")
        seqlens_k = seqlens_k.numpy()
    host = np.asarray(seqlens_k)
    if kind == "list" and host.size == 0:
        host = host.astype(np.int64)  # [] is float64 to NumPy
    if host.dtype.kind not in "iu":
        raise TypeError(f"seqlens_k: expected an integer dtype, got {host.dtype}")
    if host.shape != (batch,):
        raise ValueError(f"seqlens_k: expected shape {expected_shape}, got {host.shape}")
    bad = np.flatnonzero((host < 0) | (host > seqlen_k))
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"seqlens_k: expected values in [0, {seqlen_k}] (0 to seqlen_k), got {host[i]} at batch {i}")
    return ("host", host.astype(np.int64))


def _seqlens_k_backend(lens, frame: _interop.Frame):
    """The checked seqlens_k as the backend takes it: None, an int64 NumPy
    array (CPU), or an int32 cupy.ndarray on the current device and stream."""
    if lens is None:
        return None
    where, a = lens
    if not frame.on_gpu:
        return a
    import cupy

    if where == "host":
        if cupy.cuda.get_current_stream().is_capturing():
            # the copy would be captured with this call's values, and every replay would reuse them
            raise ValueError(
                "seqlens_k: expected a CUDA int32 array while a CUDA graph is being captured "
                "(a host array is copied at each call, and the graph would replay this call's values), got a host array"
            )
        return cupy.asarray(a.astype(np.int32))  # async: CuPy stages it in pinned memory on the current stream
    if _interop._kind(a) == "torch":
        a = _interop.to_backend(a, _interop.Frame("torch", frame.device))
    elif not isinstance(a, cupy.ndarray):
        a = cupy.from_dlpack(a)
    if a.size > 1 and a.strides[0] != a.itemsize:
        raise ValueError(f"seqlens_k: expected a unit-stride CUDA array (it is read in place), got strides {a.strides} bytes")
    return a


def _check_scale(softmax_scale, head_dim: int) -> float:
    if softmax_scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(softmax_scale, (bool, np.bool_)) or not isinstance(softmax_scale, numbers.Real):
        raise TypeError(f"softmax_scale: expected a real number or None, got {type(softmax_scale).__name__}")
    if not math.isfinite(softmax_scale):
        raise ValueError(f"softmax_scale: expected a finite number, got {softmax_scale}")
    return float(softmax_scale)


def _check_strides(name: str, a) -> None:
    issue = _stride_issue(a.strides, a.itemsize)
    if issue is not None:
        raise ValueError(f"{name}: {issue}")


@functools.lru_cache(maxsize=1024)
def _stride_issue(strides: tuple, itemsize: int) -> str | None:
    if any(s < 0 for s in strides):
        return f"expected non-negative strides, got {strides} bytes (a reversed view?)"
    if any(s % itemsize for s in strides):
        return f"expected strides that are multiples of the item size {itemsize}, got {strides}"
    return None


def _check_out(out, outb, q_shape: tuple, qb, kb, vb, dtype: str) -> None:
    if tuple(out.shape) != q_shape:
        raise ValueError(f"out: expected shape {q_shape} (that of q), got {tuple(out.shape)}")
    if _interop.dtype_name(out) != dtype:
        raise TypeError(f"out: expected dtype {dtype} (that of q), got {_interop.dtype_name(out)}")
    if outb.size == 0:
        return  # nothing is written (NumPy gives empty arrays zero strides)
    _check_strides("out", outb)
    if any(s == 0 and n > 1 for n, s in zip(outb.shape, outb.strides)):
        raise ValueError(f"out: expected no zero strides (its elements would overlap), got strides {outb.strides}")
    lo, hi = _interop.byte_span(outb)
    for name, a in (("q", qb), ("k", kb), ("v", vb)):
        a_lo, a_hi = _interop.byte_span(a)
        if lo < a_hi and a_lo < hi:
            raise ValueError(f"out: must not overlap the memory of {name}")


def warmup(*, dtypes=None, head_dims=None, device=None) -> int:
    """Make every kernel that calls of these dtypes and head dims can launch on
    a CUDA device ready now, so that no later call compiles: at a server's
    start, or before capturing CUDA graphs (nothing may compile inside a
    capture).

    Parameters
    ----------
    dtypes : iterable of str, optional
        Dtype names ("float16", "bfloat16", "float32", "float64"); default all.
    head_dims : iterable of int, optional
        Head dims the calls will have (1 to 256); default all.
    device : int, optional
        CUDA device; default CuPy's current one.

    Each specialization of the device's kernel table that serves one of these
    (dtype, head_dim) pairs is compiled by NVRTC, or loaded from CuPy's disk
    cache when an earlier process compiled it, and loaded on the device; the
    decode kernels' occupancy, which their launch plans read, is queried too.
    Returns the number of specializations made ready. The first warm-up of a
    full table compiles about a hundred kernels: a minute or two, once per
    machine.
    """
    dtype_set = set(DTYPES) if dtypes is None else set(dtypes)
    unknown = dtype_set - set(DTYPES)
    if unknown:
        raise ValueError(f"dtypes: expected names in {DTYPES}, got {sorted(unknown)}")
    dims = None if head_dims is None else set(head_dims)
    if dims is not None and not all(isinstance(d, numbers.Integral) and 1 <= d <= MAX_HEAD_DIM for d in dims):
        raise ValueError(f"head_dims: expected integers in [1, {MAX_HEAD_DIM}], got {sorted(dims, key=str)}")
    import cupy

    from . import _compile, _specs

    device = cupy.cuda.Device().id if device is None else int(device)
    ready = 0
    with cupy.cuda.Device(device):
        for spec in _specs.specs_for(_plan.device_arch(device)):
            if spec.dtype not in dtype_set or (dims is not None and not any(_specs.serves(spec, d) for d in dims)):
                continue
            _compile.get_kernel(spec)
            if spec.family == "decode" and spec.block_m:  # the split kernels, not the combine
                _plan._resident_slots(spec, device)
            ready += 1
    return ready
