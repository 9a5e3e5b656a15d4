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


def attention(
    q, k, v, *, causal=True, softmax_scale=None, return_lse=False, out=None, kernel="auto", precision="highest"
):
    """Causal grouped-query attention: ``softmax(scale * q k^T + mask) v`` per query head.

    Parameters
    ----------
    q : (batch, seqlen_q, num_q_heads, head_dim)
    k : (batch, seqlen_k, num_kv_heads, head_dim)
    v : (batch, seqlen_k, num_kv_heads, head_dim)
        CuPy arrays, PyTorch tensors (CUDA or CPU), NumPy arrays, or any CUDA
        array exporting ``__dlpack__`` (JAX, ...), all of one framework and
        device. dtype float32, float16, bfloat16 or float64, the same for all
        three; 1 <= head_dim <= 256. Any non-negative strides (slices of a
        packed QKV tensor, transposed views): nothing is copied.
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
        Preallocated result (same framework, device, shape and dtype as q; any
        non-negative strides; must not overlap q, k or v).
    kernel : {"auto", "rowwise", "tiled"}
        "rowwise" is one thread (or a small team) per query row with an online
        softmax, and runs every call. "tiled" is the tensor-core kernel for
        float16, bfloat16 and float32 (split TF32, see ``precision``) with
        head_dim 32, 64, 96, 128 or 256, a unit-stride
        head_dim axis, 16-byte aligned rows and softmax_scale > 0; it raises
        ValueError for anything else. "auto" picks "tiled" when it applies,
        else "rowwise". NumPy and CPU torch inputs run the NumPy backend and
        take "auto" only.
    precision : {"highest", "tf32"}, default "highest"
        float32 only (no effect on other dtypes). "highest" is fp32-accurate
        (relative error around 1e-7 to 1e-6): the tiled kernel multiplies on
        the TF32 tensor cores with each operand split into two TF32 parts
        (three products per product), and rowwise is plain fp32. "tf32" lets
        the tiled kernel use one TF32 product: faster, with a relative error
        of about 1e-3 (at most 2e-3 in our tests); calls that the tiled kernel
        doesn't take still run rowwise, in full fp32.

    Returns
    -------
    out : like q, in q's framework (or ``(out, lse)`` with ``return_lse``).

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
    for name, flag in (("causal", causal), ("return_lse", return_lse)):
        if not isinstance(flag, (bool, np.bool_)):
            raise TypeError(f"{name}: expected a bool, got {type(flag).__name__} {flag!r}")

    named = {"q": q, "k": k, "v": v} if out is None else {"q": q, "k": k, "v": v, "out": out}
    frame = _interop.frame_of(named)
    dtype = _check_shapes_and_dtypes(q, k, v)
    head_dim = q.shape[3]
    softmax_scale = _check_scale(softmax_scale, head_dim)
    if kernel != "auto" and not frame.on_gpu:
        raise ValueError(f"kernel: {kernel!r} runs on CUDA arrays; CPU inputs use the NumPy backend, kernel='auto'")

    with _interop.running_on(frame):
        qb, kb, vb = (_interop.to_backend(x, frame) for x in (q, k, v))
        for name, a in (("q", qb), ("k", kb), ("v", vb)):
            _check_strides(name, a)
        if out is None:
            out, outb = _interop.empty(tuple(q.shape), q, frame)
        else:
            outb = _interop.to_backend(out, frame)
            _check_out(out, outb, qb, kb, vb, dtype)
        lse, lseb = (None, None)
        if return_lse:
            lse, lseb = _interop.empty((q.shape[0], q.shape[2], q.shape[1]), q, frame, float32=True)

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
            attention_cpu(qb, kb, vb, outb, lseb, causal=problem.causal, softmax_scale=softmax_scale)
        else:
            family = _plan.choose_kernel(problem, qb, kb, vb, outb) if kernel == "auto" else kernel
            _plan.LAUNCH[family](problem, qb, kb, vb, outb, lseb)
    return (out, lse) if return_lse else out


def _check_shapes_and_dtypes(q, k, v) -> str:
    for name, x in (("q", q), ("k", k), ("v", v)):
        if len(x.shape) != 4:
            layout = "(batch, seqlen_q, num_q_heads, head_dim)" if name == "q" else "(batch, seqlen_k, num_kv_heads, head_dim)"
            raise ValueError(f"{name}: expected 4 dimensions {layout}, got shape {tuple(x.shape)}")
    dtype = _interop.dtype_name(q)
    if dtype not in DTYPES:
        raise TypeError(f"q: expected dtype in {DTYPES}, got {dtype}")
    for name, x in (("k", k), ("v", v)):
        if _interop.dtype_name(x) != dtype:
            raise TypeError(f"{name}: expected dtype {dtype} (that of q), got {_interop.dtype_name(x)}")

    batch, _, num_q_heads, head_dim = q.shape
    _, seqlen_k, num_kv_heads, _ = k.shape
    expected_kv = (batch, seqlen_k, num_kv_heads, head_dim)
    if k.shape[0] != batch or k.shape[3] != head_dim:
        raise ValueError(
            f"k: expected shape (batch, seqlen_k, num_kv_heads, head_dim) with batch={batch} and "
            f"head_dim={head_dim} from q, got {tuple(k.shape)}"
        )
    if tuple(v.shape) != expected_kv:
        raise ValueError(f"v: expected shape {expected_kv} (that of k), got {tuple(v.shape)}")
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"q: expected head_dim in [1, {MAX_HEAD_DIM}], got {head_dim}")
    if num_kv_heads < 1 or num_q_heads < 1 or num_q_heads % num_kv_heads:
        raise ValueError(
            f"k: expected num_kv_heads >= 1 dividing num_q_heads={num_q_heads}, got num_kv_heads={num_kv_heads}"
        )
    return dtype


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


def _check_out(out, outb, qb, kb, vb, dtype: str) -> None:
    if tuple(out.shape) != tuple(qb.shape):
        raise ValueError(f"out: expected shape {tuple(qb.shape)} (that of q), got {tuple(out.shape)}")
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
