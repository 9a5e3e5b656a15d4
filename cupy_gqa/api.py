"""The public function: validation and dispatch. Launch plans are in ``_plan``."""
from __future__ import annotations

import functools
import math
import numbers
import sys

import numpy as np

from . import _fast, _interop, _mods, _plan, _seq
from ._specs import DTYPES, MAX_HEAD_DIM, PRECISIONS
from .cpu import attention_backward_cpu, attention_cpu

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
    workspace=None,
    window=None,
    softcap=None,
    sinks=None,
    alibi_slopes=None,
    score_mod=None,
    mask_mod=None,
    block_table=None,
    cache_leftpad=None,
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
        float16, bfloat16 and float32 (fp16 pairs or split TF32, see ``precision``) with
        head_dim 32, 64, 96, 128 or 256, a unit-stride
        head_dim axis, 16-byte aligned rows and softmax_scale > 0. "hopper" is
        the prefill kernel for Hopper GPUs (compute capability 9.0: H100,
        H200) on warpgroup tensor cores, float16 and bfloat16, any head_dim
        that is a multiple of 8, with the same stride, alignment and scale
        rules as "tiled". "decode" is
        the split-KV kernel for a few query tokens against a long KV cache:
        float16 and bfloat16 at any head_dim that is a multiple of 8 (padded to
        64, 128 or 256 inside the kernel), float32 at head_dim 64, 128 or 256;
        seqlen_q <= 16,
        a unit-stride head_dim axis and 16-byte aligned rows; with the keys cut
        into several ranges it takes a float32 workspace (see ``workspace``).
        "tiled", "hopper"
        and "decode" raise ValueError for a call they don't support. "auto"
        picks "decode" when it applies and its cost model
        (``_plan.decode_dispatch``: bytes of K and V, CTAs against SMs,
        occupancy, tensor-core time, the combine) times it faster than the
        prefill kernel, which for decode shapes it nearly always is, whatever
        the number of query heads per KV head; else "hopper" when it applies, else
        "tiled" when it applies, else "rowwise". NumPy and CPU torch
        inputs run the NumPy backend and take "auto" only.
    precision : {"highest", "tf32"}, default "highest"
        float32 only (no effect on other dtypes). "highest" is fp32-accurate
        (relative error around 1e-7 to 1e-6): the tiled kernel writes each
        operand as a pair of fp16 numbers and sums three fp16 tensor-core
        products (head_dim 32 to 128, calls of 2 GFLOP of visible products or
        more; the pairs of k and v take a workspace), or splits each into two
        TF32 parts, also three products (elsewhere); rowwise and decode are
        plain fp32. "tf32"
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
    workspace : float32 CUDA array, optional
        Scratch for a decode call that splits the keys into num_splits > 1
        ranges merged by the combine kernel (``4 * batch * num_q_heads *
        seqlen_q * num_splits * (head_dim + 1)`` bytes; none when it doesn't
        split, or when its 2 to 8 ranges run as a thread-block cluster that
        merges them, on sm_90 and newer in float16 and bfloat16; num_splits is
        at most 128), and for a float32 call with precision "highest" on fp16
        pairs (the tiled kernel at head_dim 32 to 128): the pairs of K and V,
        about the bytes of k and v. ``workspace_size(q, k, v, **kwargs)``
        gives its size for a call (0: none) and ``workspace(q, k, v,
        **kwargs)`` allocates it. It must be of q's
        framework and device, contiguous, 16-byte aligned, at least that
        size, and overlap none of q, k, v, out and seqlens_k. Without it,
        torch inputs take the scratch from torch's allocator (capture-aware)
        and CuPy inputs from CuPy's memory pool, returned when the call
        returns; while a CUDA graph is captured, CuPy inputs must pass one (a
        ValueError says so): the graph writes into it at every replay. Other
        calls, and CPU inputs, ignore it.
    window : (left, right), optional
        Local (sliding-window) attention, FlashAttention's ``window_size``:
        query ``i`` sees keys ``j`` in ``[i + d - left, i + d + right]``, d =
        seqlen_k - seqlen_q (bottom-right, per sequence with seqlens_k); -1
        leaves that side unbounded. With ``causal`` right is 0 at most. The
        tiled kernels skip key tiles outside the band.
    softcap : float > 0, optional
        Scores become ``softcap * tanh(score / softcap)``, score = softmax_scale
        * q . k, before masking (Gemma 2; FlashAttention's order). For fp16
        and bf16 inputs the GPU kernels use the hardware tanh (relative error
        at most 2^-10.9), as FlashAttention does.
    sinks : (num_q_heads,) float32 array, optional
        Sink logits (gpt-oss): ``exp(sinks[h] - m)`` joins the softmax
        denominator of every row of head h and adds no value; lse includes
        it (a row that sees no key then has out 0 and lse = its sink).
    alibi_slopes : (num_q_heads,) or (batch, num_q_heads) float32 array, optional
        ALiBi: ``-slope * |i + d - j|`` is added to the scaled score
        (FlashAttention's convention).
    score_mod : cupy_gqa.ScoreMod, optional
        A user-written score modifier (CUDA code and its NumPy twin), applied
        after softcap and ALiBi.
    mask_mod : cupy_gqa.MaskMod, optional
        A user-written mask on top of causal, seqlens_k and window.
        The modifiers combine with each other, GQA, seqlens_k and layout, in
        every kernel family. sinks and alibi_slopes are read in place when they
        are CUDA arrays of q's device, else copied there at each call; calls
        with them take the full path every call (no repeat-call entry). A torch
        call that needs autograd (q, k, v or the sinks require grad), or one
        inside ``torch.compile``, takes the built-in ones through the custom op
        (the backward pass takes them; the sinks get their gradient) and raises
        ValueError for a score_mod or a mask_mod.
    block_table : (batch, max_pages_per_seq) integer array, optional
        A paged KV cache (FlashAttention's ``block_table``): k and v are then
        ``(num_pages, page_size, num_kv_heads, head_dim)`` pools of pages
        (``(num_pages, num_kv_heads, page_size, head_dim)`` with
        ``layout="bhsd"``), page_size a multiple of 16, and key ``j`` of
        sequence ``b`` is row ``j % page_size`` of page ``block_table[b, j //
        page_size]``. seqlens_k is required: sequence b has keys ``[0,
        seqlens_k[b])`` (at most ``max_pages_per_seq * page_size``). Works for
        decode and for chunked prefill (several new queries per sequence,
        bottom-right causal as above). Pages may be shared and in any order.
        ``kernel="hopper"`` takes no block_table (its bulk copies read one
        strided array): auto runs decode, tiled or rowwise.
    cache_leftpad : (batch,) integer array, optional
        Left padding (FlashAttention's ``cache_leftpad``): the keys of sequence
        ``b`` are ``[cache_leftpad[b], seqlens_k[b])`` (seqlens_k default:
        seqlen_k), and the causal diagonal stays at the end: query ``t`` sees
        keys ``cache_leftpad[b] <= j <= t + seqlens_k[b] - seqlen_q``. A
        left-padded batch (transformers' layout for batched generation) runs
        as it is. block_table and cache_leftpad take the modifiers, applied
        to each sequence's own keys (after cache_leftpad); see README.md
        "Variable length, paged KV cache, left padding" for their rules (CUDA
        int32 arrays are read in place, host ones checked).

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

    The first call of each signature (framework, device, dtypes, shapes,
    strides, alignment, flags) checks and plans it; later calls of that
    signature check only what can differ (addresses: overlaps and alignment;
    host seqlens_k values) and launch the kept plan (``_fast``). Every path
    can be captured into a CUDA graph once its kernels are compiled
    (``warmup``), with a CUDA seqlens_k and, for CuPy's capture of a split
    decode call, a ``workspace``.

    torch autograd: when q, k or v requires grad (and grad mode is on), or
    inside ``torch.compile``, the call runs as the custom op
    ``torch.ops.cupy_gqa.attention`` (``cupy_gqa._torch``), whose backward is
    :func:`attention_backward`; it saves out and lse for the backward, nothing
    quadratic. lse is returned as a non-differentiable tensor; ``out`` must be
    None then.
    """
    if block_table is not None or cache_leftpad is not None:
        flags = _mod_flags(("seq", type(causal), causal, type(softmax_scale), softmax_scale, type(return_lse), return_lse,
                            kernel, precision, layout), window, softcap, score_mod, mask_mod)  # fmt: skip
        if sinks is None and alibi_slopes is None:  # calls with those arrays take the full path every call
            result = _repeat_seq_call(q, k, v, out, seqlens_k, workspace, flags, (None, None, block_table, cache_leftpad))
            if result is not None:
                return result
        return _attention_seq(
            q, k, v, causal=causal, softmax_scale=softmax_scale, return_lse=return_lse, out=out, kernel=kernel,
            precision=precision, layout=layout, workspace=workspace, seqlens_k=seqlens_k, block_table=block_table,
            cache_leftpad=cache_leftpad, flags=flags, window=window, softcap=softcap, sinks=sinks,
            alibi_slopes=alibi_slopes, score_mod=score_mod, mask_mod=mask_mod,
        )  # fmt: skip
    if out is None and _torch_op_call(q, k, v, sinks):
        _torch_op_modifiers(q, k, v, sinks, score_mod=score_mod, mask_mod=mask_mod)
        from . import _torch

        return _torch.attention(
            q, k, v, causal=causal, softmax_scale=softmax_scale, return_lse=return_lse, kernel=kernel,
            precision=precision, seqlens_k=seqlens_k, layout=layout, window=window, softcap=softcap, sinks=sinks,
            alibi_slopes=alibi_slopes,
        )
    if out is not None and _torch_grad_needed(q, k, v, sinks):
        raise ValueError(
            "out: expected None when q, k or v requires grad (autograd returns a new tensor), got a tensor; "
            "call it under torch.no_grad() to write into out"
        )
    flags = _mod_flags((type(causal), causal, type(softmax_scale), softmax_scale, type(return_lse), return_lse, kernel,
                        precision, layout), window, softcap, score_mod, mask_mod)  # fmt: skip
    found = entry = None
    if sinks is None and alibi_slopes is None:  # calls with those arrays take the full path every call
        try:  # a repeat call of a signature seen before (CuPy arrays, torch CUDA tensors): _fast
            found = _fast.signature(q, k, v, out, seqlens_k, workspace, flags)
            entry = None if found is None else _fast.lookup(found[0])
        except Exception:  # arguments no signature can hold (unhashable, ...): the full path says what is wrong
            found = entry = None
    if entry is not None:
        result = entry(q, k, v, out, seqlens_k, workspace, found[1])
        if result is not None:
            return result
    return _attention(
        q, k, v, causal=causal, softmax_scale=softmax_scale, return_lse=return_lse, out=out, kernel=kernel,
        precision=precision, seqlens_k=seqlens_k, layout=layout, workspace=workspace, flags=flags, window=window,
        softcap=softcap, sinks=sinks, alibi_slopes=alibi_slopes, score_mod=score_mod, mask_mod=mask_mod,
    )  # fmt: skip


def _torch_grad_needed(q, k, v, sinks=None) -> bool:
    """Whether a torch call must record autograd: grad mode on and an input that
    requires grad (q, k, v, or the sinks: learned parameters in gpt-oss)."""
    torch = sys.modules.get("torch")
    if torch is None or not isinstance(q, torch.Tensor):
        return False
    # (each argument in turn, not a generator: this runs on every torch call's repeat path)
    wants = (
        q.requires_grad
        or getattr(k, "requires_grad", False) is True
        or getattr(v, "requires_grad", False) is True
        or (sinks is not None and getattr(sinks, "requires_grad", False) is True)
    )
    return wants and torch.is_grad_enabled()


def _torch_op_call(q, k, v, sinks=None) -> bool:
    """Whether a call goes through the torch custom op: autograd, or a trace of torch.compile."""
    torch = sys.modules.get("torch")
    if torch is None or not isinstance(q, torch.Tensor):
        return False
    return _torch_grad_needed(q, k, v, sinks) or torch.compiler.is_compiling()


def _torch_op_modifiers(q, k, v, sinks, *, score_mod, mask_mod) -> None:
    """Refuse the user modifiers on a call that goes through the torch custom op
    (the built-in ones go through it): a score_mod has no derivative, and the op's
    schema carries no Python object."""
    given = [(name, value) for name, value in (("score_mod", score_mod), ("mask_mod", mask_mod)) if value is not None]
    if not given:
        return
    name, value = given[0]
    if _torch_grad_needed(q, k, v, sinks):
        why = ("q, k, v or the sinks require grad, and the backward pass takes no score_mod (it would need its "
               "derivative)" if name == "score_mod" else "q, k, v or the sinks require grad, and the autograd op takes "
               "no mask_mod")  # fmt: skip
        hint = "call it under torch.no_grad(), or use the built-in modifiers (window, softcap, alibi_slopes, sinks)"
        if name == "mask_mod":
            hint += ", or cupy_gqa.attention_backward, which takes the mask_mod"
    else:
        why = f"inside torch.compile the call runs as the custom op torch.ops.cupy_gqa.attention, which takes no {name}"
        hint = "call it outside torch.compile (torch.compiler.disable)"
    raise ValueError(f"{name}: expected None when {why}, got a {type(value).__name__}; {hint}")


def attention_varlen(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    *,
    causal=True,
    softmax_scale=None,
    return_lse=False,
    out=None,
    kernel="auto",
    precision="highest",
    workspace=None,
    window=None,
    softcap=None,
    sinks=None,
    alibi_slopes=None,
    score_mod=None,
    mask_mod=None,
):
    """Attention over a batch of sequences of different lengths, packed without
    padding (FlashAttention's ``flash_attn_varlen_func`` convention).

    Parameters
    ----------
    q : (total_q, num_q_heads, head_dim)
    k, v : (total_k, num_kv_heads, head_dim)
        The queries (keys, values) of every sequence, one after the other:
        sequence ``b`` has rows ``[cu_seqlens_q[b], cu_seqlens_q[b + 1])`` of q
        and ``[cu_seqlens_k[b], cu_seqlens_k[b + 1])`` of k and v. Frameworks,
        dtypes, head dims and strides as for :func:`attention`.
    cu_seqlens_q, cu_seqlens_k : (batch + 1,) integer arrays
        Non-decreasing offsets from 0 (``cu[b + 1] - cu[b]`` is sequence b's
        length; ``cu[-1]`` at most total_q, total_k). A CUDA array (int32,
        unit stride, on q's device) is read in place by the kernels and not
        checked on the host; a sequence whose offsets are out of range (a
        length below 0 or above max_seqlen_*, an end past total_*) gives NaN
        rows, or none where its query rows are out of range. A host array
        (list, NumPy, CPU torch; any integer dtype) is checked on the host
        and copied to the device at each call.
    max_seqlen_q, max_seqlen_k : int
        Host integers bounding every sequence's length (the launch is sized by
        them, so nothing waits for the device).
    causal : bool, default True
        Bottom-right per sequence: query ``t`` of sequence ``b`` sees keys
        ``j <= t + len_k(b) - len_q(b)``; a row that sees no key gives 0 and
        lse -inf, as in :func:`attention`.
    return_lse : bool
        Also return lse, float32 ``(num_q_heads, total_q)`` (FlashAttention's
        varlen layout): ``lse[h, cu_seqlens_q[b] + t]``.
    softmax_scale, out, kernel, precision, workspace
        As for :func:`attention` (out like q; "auto" runs decode, hopper,
        tiled or rowwise by the same rules, with max_seqlen_q and
        max_seqlen_k as the lengths).
    window, softcap, sinks, alibi_slopes, score_mod, mask_mod
        The modifiers, as for :func:`attention`, per sequence: each one's
        queries and keys are numbered from 0, its diagonal is its own
        (``len_k(b) - len_q(b)``), and ``b`` (ALiBi's slopes of shape
        ``(batch, num_q_heads)``, a score_mod's or mask_mod's ``b``) is the
        sequence's index.

    Returns
    -------
    out : like q (or ``(out, lse)`` with ``return_lse``).

    Every index array is read in place when it is a CUDA int32 array, so the
    call can be captured into a CUDA graph and replayed after the lengths
    change (within max_seqlen_*, which the graph keeps). The backward pass
    takes no varlen calls yet.
    """
    flags = _mod_flags(("varlen", type(max_seqlen_q), max_seqlen_q, type(max_seqlen_k), max_seqlen_k, type(causal),
                        causal, type(softmax_scale), softmax_scale, type(return_lse), return_lse, kernel, precision),
                       window, softcap, score_mod, mask_mod)  # fmt: skip
    if sinks is None and alibi_slopes is None:  # calls with those arrays take the full path every call
        result = _repeat_seq_call(q, k, v, out, None, workspace, flags, (cu_seqlens_q, cu_seqlens_k, None, None))
        if result is not None:
            return result
    return _attention_seq(
        q, k, v, causal=causal, softmax_scale=softmax_scale, return_lse=return_lse, out=out, kernel=kernel,
        precision=precision, layout="bshd", workspace=workspace,
        varlen=(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k), flags=flags, window=window, softcap=softcap,
        sinks=sinks, alibi_slopes=alibi_slopes, score_mod=score_mod, mask_mod=mask_mod,
    )  # fmt: skip


def _repeat_seq_call(q, k, v, out, seqlens_k, workspace, flags: tuple, index: tuple):
    """A per-sequence call through its signature's entry (_fast), or None for the
    full path: a first call, host index arrays or lengths, autograd or a trace
    (whose refusal the full path raises), arguments no signature holds."""
    if _torch_op_call(q, k, v):
        return None
    try:
        found = _fast.signature(q, k, v, out, seqlens_k, workspace, flags, index)
        entry = None if found is None else _fast.lookup(found[0])
    except Exception:  # unhashable and other odd arguments: the full path says what is wrong
        return None
    if entry is None:
        return None
    return entry(q, k, v, out, seqlens_k, workspace, found[1])


def _mod_flags(flags: tuple, window, softcap, score_mod, mask_mod) -> tuple:
    """A call's repeat-call flags (_fast.signature) with the modifiers that its
    plan depends on (sinks and alibi_slopes: none, such calls take the full path)."""
    if window is not None or softcap is not None or score_mod is not None or mask_mod is not None:
        flags += (type(window), window, type(softcap), softcap, score_mod, mask_mod)
    return flags


def _check_modifiers(frame, causal, seqlen_q: int, seqlen_k: int, batch: int, num_q_heads: int, *, window, softcap,
                     sinks, alibi_slopes, score_mod, mask_mod) -> tuple:  # fmt: skip
    """The modifiers' checks, made before anything is allocated: (window, softcap,
    sinks, alibi_slopes) checked (_mods.check_window's pair or None, the softcap or
    0, the arrays as _check_mod_array keeps them), and whether there are any."""
    win = _mods.check_window(window, bool(causal), seqlen_q, seqlen_k)
    cap = _mods.check_softcap(softcap)
    _mods.check_user_mod("score_mod", score_mod, _mods.ScoreMod)
    _mods.check_user_mod("mask_mod", mask_mod, _mods.MaskMod)
    sinks_a = _check_mod_array("sinks", sinks, frame, ((num_q_heads,),), "(num_q_heads,)")
    alibi_a = _check_mod_array(
        "alibi_slopes", alibi_slopes, frame, ((num_q_heads,), (batch, num_q_heads)), "(num_q_heads,) or (batch, num_q_heads)"
    )
    if not frame.on_gpu:
        for mod in (score_mod, mask_mod):
            if mod is not None:
                mod.numpy_function()  # CPU inputs run the NumPy twin: it must be there
    has_mods = win is not None or cap or sinks_a is not None or alibi_a is not None or score_mod or mask_mod
    return win, cap, sinks_a, alibi_a, bool(has_mods)


def _modifiers(frame, checked: tuple, score_mod, mask_mod) -> tuple:
    """(mods, sinks, alibi_slopes) of a call (inside running_on(frame)): the
    _mods.Modifiers of its kernels and the two arrays on the backend, or
    (None, None, None) for a call without modifiers."""
    win, cap, sinks_a, alibi_a, has_mods = checked
    if not has_mods:
        return None, None, None
    sinks_b = _mod_array_backend("sinks", sinks_a, frame)
    alibi_b = _mod_array_backend("alibi_slopes", alibi_a, frame)
    mods = _mods.Modifiers(
        window=win is not None, window_left=win[0] if win else -1, window_right=win[1] if win else -1,
        softcap=cap, sinks=sinks_b is not None, alibi=0 if alibi_b is None else alibi_b.ndim,
        score_mod=score_mod, mask_mod=mask_mod,
        sinks_ptr=sinks_b.data.ptr if frame.on_gpu and sinks_b is not None else 0,
        alibi_ptr=alibi_b.data.ptr if frame.on_gpu and alibi_b is not None else 0,
    )  # fmt: skip
    return mods, sinks_b, alibi_b


def _check_heads(q_shape, k_shape, v_shape, q_axes: str, kv_axes: str, heads: int, dims: int) -> None:
    """num_q_heads, num_kv_heads and head_dim of per-sequence calls' q and k / v."""
    if tuple(v_shape) != tuple(k_shape):
        raise ValueError(f"v: expected shape {tuple(k_shape)} (that of k), got {tuple(v_shape)}")
    if k_shape[dims] != q_shape[dims]:
        raise ValueError(f"k: expected shape {kv_axes} with head_dim={q_shape[dims]} from q, got {tuple(k_shape)}")
    head_dim, num_q_heads, num_kv_heads = q_shape[dims], q_shape[heads], k_shape[heads]
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"q: expected head_dim in [1, {MAX_HEAD_DIM}], got {head_dim}")
    if num_kv_heads < 1 or num_q_heads < 1 or num_q_heads % num_kv_heads:
        raise ValueError(
            f"k: expected num_kv_heads >= 1 dividing num_q_heads={num_q_heads}, got num_kv_heads={num_kv_heads}"
        )


def _check_dtypes(q, k, v) -> str:
    dtype = _interop.dtype_name(q)
    if dtype not in DTYPES:
        raise TypeError(f"q: expected dtype in {DTYPES}, got {dtype}")
    for name, x in (("k", k), ("v", v)):
        if _interop.dtype_name(x) != dtype:
            raise TypeError(f"{name}: expected dtype {dtype} (that of q), got {_interop.dtype_name(x)}")
    return dtype


def _backend_arrays(q, k, v, out, workspace, frame: _interop.Frame, dtype: str) -> tuple:
    """(qb, kb, vb, out, outb, wsb): the backend views of q, k, v with their strides
    checked, out (a new one, contiguous in the caller's layout, or the caller's,
    checked) and its view, and a caller's workspace checked (GPU only: CPU inputs
    need none, a given one is ignored). Inside running_on(frame)."""
    qb, kb, vb = (_interop.to_backend(x, frame) for x in (q, k, v))
    for name, a in (("q", qb), ("k", kb), ("v", vb)):
        _check_strides(name, a)
    wsb = _check_workspace(workspace, frame) if workspace is not None and frame.on_gpu else None
    if out is None:
        out, outb = _interop.empty(tuple(q.shape), q, frame)
    else:
        outb = _interop.to_backend(out, frame)
        _check_out(out, outb, tuple(q.shape), qb, kb, vb, dtype)
    return qb, kb, vb, out, outb, wsb


def _check_options(kernel, precision, layout, causal, return_lse) -> None:
    """The options every forward call checks first, by the same rules."""
    if kernel not in _KERNEL_CHOICES:
        raise ValueError(f"kernel: expected one of {_KERNEL_CHOICES}, got {kernel!r}")
    if precision not in PRECISIONS:
        raise ValueError(f"precision: expected one of {PRECISIONS}, got {precision!r}")
    if layout not in LAYOUTS:
        raise ValueError(f"layout: expected one of {LAYOUTS}, got {layout!r}")
    for name, flag in (("causal", causal), ("return_lse", return_lse)):
        if not isinstance(flag, (bool, np.bool_)):
            raise TypeError(f"{name}: expected a bool, got {type(flag).__name__} {flag!r}")


def _attention_seq(q, k, v, *, causal, softmax_scale, return_lse, out, kernel, precision, layout, workspace,
                   varlen=None, seqlens_k=None, block_table=None, cache_leftpad=None, plan_only=False,
                   flags=None, window=None, softcap=None, sinks=None, alibi_slopes=None, score_mod=None,
                   mask_mod=None):  # fmt: skip
    """The per-sequence calls (_seq): attention_varlen (``varlen``: the cu_seqlens
    and max_seqlen arguments) and attention with block_table or cache_leftpad:
    every check, the plan, the launch; then, where the index arrays and
    seqlens_k are CUDA arrays (read in place: no host values to check), the
    signature's entry for later calls (``flags``: the caller's, None for
    none), which gives the kernels each call's index-array addresses."""
    _check_options(kernel, precision, layout, causal, return_lse)
    if _torch_op_call(q, k, v):
        what = "attention_varlen" if varlen is not None else "block_table and cache_leftpad"
        raise ValueError(
            f"q: expected tensors that don't require grad (and a call outside torch.compile) with {what}, "
            f"which the backward pass and the custom op take no calls of yet; call it under torch.no_grad()"
        )
    named = {"q": q, "k": k, "v": v}
    if out is not None:
        named["out"] = out
    if workspace is not None:
        named["workspace"] = workspace
    frame = _interop.frame_of(named)
    bhsd = layout == "bhsd"
    seq_flags = 0
    if varlen is not None:
        cu_q, cu_k, max_q, max_k = varlen
        seq_flags |= _seq.SEQ_VARLEN
        for name, x, axes in (("q", q, "(total_q, num_q_heads, head_dim)"), ("k", k, "(total_k, num_kv_heads, head_dim)"),
                              ("v", v, "(total_k, num_kv_heads, head_dim)")):  # fmt: skip
            if len(x.shape) != 3:
                raise ValueError(f"{name}: expected 3 dimensions {axes}, got shape {tuple(x.shape)}")
        dtype = _check_dtypes(q, k, v)
        _check_heads(q.shape, k.shape, v.shape, "(total_q, num_q_heads, head_dim)", "(total_k, num_kv_heads, head_dim)", 1, 2)
        total_q, num_q_heads, head_dim = q.shape
        total_k = k.shape[0]
        max_q = _seq.check_max_seqlen("max_seqlen_q", max_q)
        max_k = _seq.check_max_seqlen("max_seqlen_k", max_k)
        n = _len_of(cu_q)
        if n < 1:
            shape = np.shape(cu_q) if isinstance(cu_q, (list, tuple)) else getattr(cu_q, "shape", None)
            if shape is not None:
                raise ValueError(f"cu_seqlens_q: expected shape (batch + 1,) with batch >= 0, got {tuple(shape)}")
        cu_q_c = _seq.check_index_array("cu_seqlens_q", cu_q, frame, (n,), "(batch + 1,)")
        batch = n - 1
        cu_k_c = _seq.check_index_array("cu_seqlens_k", cu_k, frame, (batch + 1,), "(batch + 1, that of cu_seqlens_q)")
        if cu_q_c[0] == "host":
            _seq.check_cu_seqlens("cu_seqlens_q", cu_q_c[1], total_q, max_q, "total_q", "max_seqlen_q")
        if cu_k_c[0] == "host":
            _seq.check_cu_seqlens("cu_seqlens_k", cu_k_c[1], total_k, max_k, "total_k", "max_seqlen_k")
        seqlen_q, seqlen_k = max_q, max_k
        lse_shape = (num_q_heads, total_q)
        lens = leftpad = table = None
    else:
        q_axes, kv_axes = _AXES[layout]
        table = None
        if block_table is None:
            dtype = _check_shapes_and_dtypes(q, k, v, bhsd)
        else:
            seq_flags |= _seq.SEQ_PAGED
            kv_axes = "(num_pages, num_kv_heads, page_size, head_dim)" if bhsd else "(num_pages, page_size, num_kv_heads, head_dim)"
            for name, x, axes in (("q", q, q_axes), ("k", k, kv_axes), ("v", v, kv_axes)):
                if len(x.shape) != 4:
                    raise ValueError(f"{name}: expected 4 dimensions {axes}, got shape {tuple(x.shape)}")
            dtype = _check_dtypes(q, k, v)
            _check_heads(q.shape, k.shape, v.shape, q_axes, kv_axes, 1 if bhsd else 2, 3)
        batch, seqlen_q, num_q_heads, head_dim = (q.shape[0], q.shape[2], q.shape[1], q.shape[3]) if bhsd else tuple(q.shape)
        seqlen_k = k.shape[2 if bhsd else 1]
        if block_table is not None:
            num_pages, page_size = k.shape[0], seqlen_k
            if page_size % _seq.PAGE_MULTIPLE or page_size == 0:
                raise ValueError(
                    f"k: expected a page_size (axis {2 if bhsd else 1} of {kv_axes}) that is a positive multiple of "
                    f"{_seq.PAGE_MULTIPLE}, got {page_size}"
                )
            if len(getattr(block_table, "shape", np.shape(block_table))) != 2:
                raise ValueError(
                    f"block_table: expected shape (batch, max_pages_per_seq) with batch={batch}, "
                    f"got {tuple(np.shape(block_table) if isinstance(block_table, (list, tuple)) else block_table.shape)}"
                )
            max_pages = int((np.shape(block_table) if isinstance(block_table, (list, tuple)) else block_table.shape)[1])
            table = _seq.check_index_array("block_table", block_table, frame, (batch, max_pages), "(batch, max_pages_per_seq)")
            if table[0] == "host" and table[1].size:
                bad = np.argwhere((table[1] < 0) | (table[1] >= num_pages))
                if bad.size:
                    i, j = (int(x) for x in bad[0])
                    raise ValueError(
                        f"block_table: expected page indices in [0, {num_pages}) (num_pages), got {table[1][i, j]} at [{i}, {j}]"
                    )
            seqlen_k = max_pages * page_size  # the most keys a sequence can have
            if seqlens_k is None:
                raise ValueError("seqlens_k: expected each sequence's number of keys with block_table, got None")
        lens = _check_seqlens_k(seqlens_k, frame, batch, seqlen_k)
        leftpad = None
        if cache_leftpad is not None:
            seq_flags |= _seq.SEQ_LEFTPAD
            leftpad = _seq.check_index_array("cache_leftpad", cache_leftpad, frame, (batch,), "(the batch of q)")
            if leftpad[0] == "host":
                ends = lens[1] if lens is not None and lens[0] == "host" else np.full(batch, seqlen_k)
                bad = np.flatnonzero((leftpad[1] < 0) | (leftpad[1] > ends))
                if bad.size:
                    i = int(bad[0])
                    raise ValueError(
                        f"cache_leftpad: expected values in [0, seqlens_k[b]] (0 to the sequence's end, {ends[i]}), "
                        f"got {leftpad[1][i]} at batch {i}"
                    )
        lse_shape = (batch, num_q_heads, seqlen_q)
        cu_q_c = cu_k_c = None
    softmax_scale = _check_scale(softmax_scale, head_dim)
    # (varlen: the longest sequences bound the window's reach; ALiBi's batch is the sequences')
    checked_mods = _check_modifiers(frame, causal, seqlen_q, seqlen_k, batch, num_q_heads, window=window, softcap=softcap,
                                    sinks=sinks, alibi_slopes=alibi_slopes, score_mod=score_mod, mask_mod=mask_mod)  # fmt: skip
    if kernel != "auto" and not frame.on_gpu:
        raise ValueError(f"kernel: {kernel!r} runs on CUDA arrays; CPU inputs use the NumPy backend, kernel='auto'")

    with _interop.running_on(frame):
        qb, kb, vb, out, outb, wsb = _backend_arrays(q, k, v, out, workspace, frame, dtype)
        if bhsd:
            qb, kb, vb, outb = (a.transpose(_BHSD_TO_BSHD) for a in (qb, kb, vb, outb))
        mods, sinks_b, alibi_b = _modifiers(frame, checked_mods, score_mod, mask_mod)
        if varlen is not None:  # (1, total, heads, head_dim) views: the kernels' axis 0 has stride 0 (_plan.make_params)
            qb, kb, vb, outb = (a[None] for a in (qb, kb, vb, outb))
        lse = lseb = None
        if return_lse and not plan_only:
            lse, lseb = _interop.empty(lse_shape, q, frame, float32=True)
        cu_qb = _seq.index_backend("cu_seqlens_q", cu_q_c, frame)
        cu_kb = _seq.index_backend("cu_seqlens_k", cu_k_c, frame)
        tableb = _seq.index_backend("block_table", table, frame)
        leftb = _seq.index_backend("cache_leftpad", leftpad, frame)
        lensb = _seq.index_backend("seqlens_k", lens, frame)
        addr = (lambda a: 0 if a is None else a.data.ptr) if frame.on_gpu else (lambda a: 0)  # noqa: E731
        seq = _seq.SeqLayout(
            flags=seq_flags, page_size=kb.shape[1] if seq_flags & _seq.SEQ_PAGED else 0,
            block_table_stride=0 if tableb is None else tableb.strides[0] // tableb.itemsize,
            total_q=qb.shape[1] if varlen is not None else 0, total_k=kb.shape[1] if varlen is not None else 0,
            cu_seqlens_q=addr(cu_qb), cu_seqlens_k=addr(cu_kb), block_table=addr(tableb), leftpad=addr(leftb),
        )  # fmt: skip
        problem = _plan.Problem(batch, seqlen_q, seqlen_k, num_q_heads, kb.shape[2], head_dim, dtype, bool(causal),
                                softmax_scale, precision if dtype == "float32" else "highest", mods, seq)  # fmt: skip
        empty = outb.size == 0 or batch == 0
        if plan_only:
            if not frame.on_gpu or empty or seqlen_k == 0:
                return None
            family = _plan.choose_kernel(problem, qb, kb, vb, outb) if kernel == "auto" else kernel
            return _plan.PLAN_FOR[family](problem, qb, kb, vb, outb, checked=kernel == "auto")
        if empty:
            if lseb is not None and lseb.size:
                lseb.fill(-np.inf)
        elif seqlen_k == 0:
            outb.fill(0)  # no sequence has a key
            if lseb is not None:  # lse -inf, or with sinks the sink's
                lseb.fill(-np.inf)
                if sinks_b is not None:
                    lseb[...] = sinks_b[:, None] if varlen is not None else sinks_b[None, :, None]
        elif not frame.on_gpu:
            _seq.attention_seq_cpu(qb, kb, vb, outb, lseb, causal=bool(causal), softmax_scale=softmax_scale, seq=seq,
                                   cu_seqlens_q=cu_qb, cu_seqlens_k=cu_kb, block_table=tableb, seqlens_k=lensb,
                                   leftpad=leftb, mods=None if mods is None else _mods.CpuModifiers.of(mods, sinks_b, alibi_b))  # fmt: skip
        else:
            family = _plan.choose_kernel(problem, qb, kb, vb, outb) if kernel == "auto" else kernel
            if wsb is not None:
                ws_arg = wsb
            elif frame.kind == "torch":
                ws_arg = functools.partial(_torch_workspace, frame)
            else:
                ws_arg = None
            plan = _plan.LAUNCH[family](problem, qb, kb, vb, outb, lseb, lensb, checked=kernel == "auto", workspace=ws_arg)
            checked = (lens, cu_q_c, cu_k_c, table, leftpad)
            # sinks / alibi_slopes: their addresses are in the plan, so every call takes the full path
            if (flags is not None and plan is not None and all(c is None or c[0] == "device" for c in checked)
                    and not (mods is not None and mods.per_call)):  # fmt: skip
                _remember(q, k, v, out, seqlens_k, workspace, flags, frame, plan, (qb, kb, vb, outb, lensb),
                          out_given="out" in named, return_lse=bool(return_lse), lse_shape=lse_shape, lens=lens,
                          seqlen_k=seqlen_k, index=(cu_q, cu_k, block_table, cache_leftpad) if varlen is not None
                          else (None, None, block_table, cache_leftpad))  # fmt: skip
    return (out, lse) if return_lse else out


def _len_of(a) -> int:
    """The length of a 1-D index array's first axis, for its shape check (anything else: -1)."""
    shape = np.shape(a) if isinstance(a, (list, tuple)) else getattr(a, "shape", None)
    return int(shape[0]) if shape is not None and len(shape) == 1 else 0


def _attention(q, k, v, *, causal, softmax_scale, return_lse, out, kernel, precision, seqlens_k, layout, workspace, flags,
               window=None, softcap=None, sinks=None, alibi_slopes=None, score_mod=None, mask_mod=None, plan_only=False,
               lse64=False):  # fmt: skip
    """The full path: every check, the plan, the launch; then the signature's
    entry for later calls (none when ``flags`` is None: the torch custom op's
    calls). ``plan_only``: return the plan (or None where no kernel runs)
    without allocating or launching anything but a new out. ``lse64``: a
    float64 lse for float64 inputs on the CPU (the NumPy backend computes it in
    float64; the CUDA kernels write float32), for callers that merge partial
    results by their lse (cupy_gqa.distributed)."""
    _check_options(kernel, precision, layout, causal, return_lse)

    named = {"q": q, "k": k, "v": v}
    if out is not None:
        named["out"] = out
    if workspace is not None:
        named["workspace"] = workspace
    frame = _interop.frame_of(named)
    bhsd = layout == "bhsd"
    dtype = _check_shapes_and_dtypes(q, k, v, bhsd)
    batch, seqlen_q, num_q_heads, head_dim = (q.shape[0], q.shape[2], q.shape[1], q.shape[3]) if bhsd else q.shape
    seqlen_k = k.shape[2 if bhsd else 1]
    softmax_scale = _check_scale(softmax_scale, head_dim)
    lens = _check_seqlens_k(seqlens_k, frame, batch, seqlen_k)
    checked_mods = _check_modifiers(frame, causal, seqlen_q, seqlen_k, batch, num_q_heads, window=window, softcap=softcap,
                                    sinks=sinks, alibi_slopes=alibi_slopes, score_mod=score_mod, mask_mod=mask_mod)  # fmt: skip
    if kernel != "auto" and not frame.on_gpu:
        raise ValueError(f"kernel: {kernel!r} runs on CUDA arrays; CPU inputs use the NumPy backend, kernel='auto'")

    with _interop.running_on(frame):
        qb, kb, vb, out, outb, wsb = _backend_arrays(q, k, v, out, workspace, frame, dtype)
        if bhsd:  # from here on (batch, seqlen, heads, head_dim): transposed views, nothing copied
            qb, kb, vb, outb = (a.transpose(_BHSD_TO_BSHD) for a in (qb, kb, vb, outb))
        mods, sinks_b, alibi_b = _modifiers(frame, checked_mods, score_mod, mask_mod)
        problem = _plan.Problem.of(
            qb, kb, dtype=dtype, causal=bool(causal), softmax_scale=softmax_scale, precision=precision, mods=mods
        )
        runs = frame.on_gpu and outb.size != 0 and problem.seqlen_k != 0
        if plan_only:
            if not runs:
                return None
            family = _plan.choose_kernel(problem, qb, kb, vb, outb) if kernel == "auto" else kernel
            return _plan.PLAN_FOR[family](problem, qb, kb, vb, outb, checked=kernel == "auto")
        lse, lseb = (None, None)
        if return_lse:
            lse, lseb = _interop.empty(
                (batch, num_q_heads, seqlen_q), q, frame, float32=not (lse64 and dtype == "float64" and not frame.on_gpu)
            )

        lensb = _seq.index_backend("seqlens_k", lens, frame)  # the last check, then the host array's copy
        if outb.size == 0:
            pass  # nothing to compute, nothing launched
        elif problem.seqlen_k == 0:
            outb.fill(0)  # every row sees no key
            if lseb is not None:  # lse -inf, or with sinks the sink's
                lseb.fill(-np.inf)
                if sinks_b is not None:
                    lseb[...] = sinks_b[None, :, None]
        elif not frame.on_gpu:
            attention_cpu(qb, kb, vb, outb, lseb, causal=problem.causal, softmax_scale=softmax_scale, seqlens_k=lensb,
                          mods=None if mods is None else _mods.CpuModifiers.of(mods, sinks_b, alibi_b))  # fmt: skip
        else:
            family = _plan.choose_kernel(problem, qb, kb, vb, outb) if kernel == "auto" else kernel
            if wsb is not None:
                ws_arg = wsb
            elif frame.kind == "torch":  # torch's allocator: on torch's stream, and capture-aware
                ws_arg = functools.partial(_torch_workspace, frame)
            else:
                ws_arg = None  # CuPy's pool (refused while capturing)
            # auto's choice has checked that the family supports the call; a forced one checks here
            plan = _plan.LAUNCH[family](problem, qb, kb, vb, outb, lseb, lensb, checked=kernel == "auto", workspace=ws_arg)
            # flags None: the torch op's calls; sinks / alibi_slopes: their addresses are in the plan
            if runs and plan is not None and flags is not None and not (mods is not None and mods.per_call):
                _remember(q, k, v, out, seqlens_k, workspace, flags, frame, plan, (qb, kb, vb, outb, lensb),
                          out_given="out" in named, return_lse=bool(return_lse),
                          lse_shape=(batch, num_q_heads, seqlen_q), lens=lens, seqlen_k=seqlen_k)  # fmt: skip
    return (out, lse) if return_lse else out


def _torch_workspace(frame: _interop.Frame, nbytes: int):
    """A float32 workspace from torch's allocator, as a CuPy view (it keeps the tensor alive)."""
    torch = sys.modules["torch"]
    t = torch.empty(nbytes // 4, dtype=torch.float32, device=torch.device("cuda", frame.device))
    return _interop.to_backend(t, frame)


def _remember(q, k, v, out, seqlens_k, workspace, flags, frame, plan, backend, *, out_given, return_lse, lse_shape, lens, seqlen_k,
              index=()):  # fmt: skip
    """Keep this call's decisions for the later calls of its signature (_fast);
    ``index``: a per-sequence call's index arrays (_fast.signature)."""
    exact = {"torch": "torch.Tensor", "cupy": "cupy.ndarray"}.get(frame.kind)
    if exact is None or f"{type(q).__module__.split('.')[0]}.{type(q).__name__}" != exact:
        return  # foreign DLPack arrays and subclasses take the full path every call
    _fast.register(type(q), frame.kind)
    for a in (seqlens_k if lens is not None and lens[0] == "device" else None, *index):
        if a is not None and type(a) not in _fast._types:
            t = type(a)
            kind = _interop._kind(a)
            if f"{t.__module__.split('.')[0]}.{t.__name__}" == {"torch": "torch.Tensor", "cupy": "cupy.ndarray"}.get(kind):
                _fast.register(t, kind)
    found = _fast.signature(q, k, v, out if out_given else None, seqlens_k, workspace, flags, index)
    if found is None:
        return
    key, _ = found
    qb, kb, vb, outb, lensb = backend
    extent = lambda a: 0 if a is None else _interop.byte_span(a)[1] - _interop.byte_span(a)[0]  # noqa: E731
    host_lens = None
    if lens is not None and lens[0] == "host":
        batch = lse_shape[0]

        def host_lens(values):
            checked = _check_seqlens_k(values, frame, batch, seqlen_k)
            with _interop.running_on(frame):
                return _seq.index_backend("seqlens_k", checked, frame)

    # a plan whose launch adds per-call values (hopper: the tensor maps of this call's k
    # and v) is launched through it; the others' argument buffers take the addresses alone
    _fast.remember(
        key,
        _fast.Entry(
            kind=frame.kind, device=frame.device, launch=plan.launch if plan.extra_args else plan.packed(), return_lse=return_lse,
            out_shape=tuple(q.shape), lse_shape=lse_shape, dtype=q.dtype, aligned_out=key[5],
            extents=(extent(qb), extent(kb), extent(vb), extent(outb), extent(lensb) if lens and lens[0] == "device" else 0),
            ws_bytes=plan.workspace_bytes, host_lens=host_lens,
            capture_message=_plan.workspace_capture_message(plan) if plan.workspace_bytes else "",
        ),
    )  # fmt: skip


def attention_backward(
    dout, q, k, v, out, lse, *, causal=True, softmax_scale=None, seqlens_k=None, dq=None, dk=None, dv=None,
    layout="bshd", window=None, softcap=None, sinks=None, alibi_slopes=None, mask_mod=None, score_mod=None,
):
    """The gradients ``(dq, dk, dv)`` of ``out = attention(q, k, v, ...)`` for the
    upstream gradient ``dout`` (the backward pass, FlashAttention-2 style), and
    with ``sinks`` also the sinks' gradient.

    Parameters
    ----------
    dout, out : like q
        The gradient of the loss with respect to out, and out itself, as the
        forward returned it (same framework, device, shape and dtype as q).
    q, k, v, causal, softmax_scale, seqlens_k, layout
        Exactly as given to the forward :func:`attention` (same rules:
        shapes, dtypes, layouts, any non-negative strides, the bottom-right
        causal mask, seqlens_k).
    lse : float32 (batch, num_q_heads, seqlen_q)
        The forward's ``return_lse=True`` result: natural log of each row's
        softmax denominator, -inf for a row that sees no key (float64 is also
        taken for float64 inputs).
    dq, dk, dv : like q, k, v, optional
        Preallocated results (same framework, device, shape, layout and dtype
        as q, k, v; any non-negative strides; no zero strides; not overlapping
        any input or each other).
    window, softcap, sinks, alibi_slopes, mask_mod
        The forward's modifiers, exactly as given to it (its lse includes the
        sinks). A softcap's gradient takes its slope, ``1 - tanh(x / softcap)**2``;
        ALiBi slopes and the sinks are not modified.
    score_mod
        Refused (ValueError): its derivative is not known here.

    Returns
    -------
    (dq, dk, dv) in the framework and layout of q, k, v; with ``sinks`` also
    ``dsinks``, float32 ``(num_q_heads,)`` on q's device, the gradient of the
    sinks: ``-sum over (b, t) of exp(sinks[h] - lse[b, h, t]) * rowsum(dout * out)``.

    The probabilities are rebuilt from lse, P = exp(scale q k^T - lse), and
    per row delta = rowsum(dout * out); dS = P (dout v^T - delta) and
        dq = scale dS k,   dk = scale dS^T q,   dv = P^T dout,
    dk and dv of a KV head summed over the group_size query heads that read
    it. Rows that see no key get dq = 0; keys that no row sees, and keys past
    ``seqlens_k[b]``, get dk = dv = 0. Arithmetic is float32 (float64 for
    float64 inputs; the float64 paths rebuild lse in float64 rather than trust
    a float32 one). On CUDA, fp16 / bf16 run on the tensor cores
    (kernels/backward.cu), float32 too (split TF32, fp32-accurate), and
    every result is deterministic: two calls give
    bitwise-equal gradients. Inputs are never modified. With modifiers, P is
    rebuilt from the modified scores (window, mask_mod and the causal mask
    masking the same keys as the forward), float32 inputs run the CUDA-core
    kernels.
    """
    if score_mod is not None:
        raise ValueError(
            f"score_mod: expected None, got a {type(score_mod).__name__}: the backward pass takes no score_mod "
            "(it would need the modifier's derivative); the built-in softcap and alibi_slopes have theirs"
        )
    if layout not in LAYOUTS:
        raise ValueError(f"layout: expected one of {LAYOUTS}, got {layout!r}")
    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"causal: expected a bool, got {type(causal).__name__} {causal!r}")
    given = {name: x for name, x in (("dq", dq), ("dk", dk), ("dv", dv)) if x is not None}
    named = {"q": q, "k": k, "v": v, "dout": dout, "out": out, "lse": lse, **given}
    frame = _interop.frame_of(named)
    bhsd = layout == "bhsd"
    dtype = _check_shapes_and_dtypes(q, k, v, bhsd)
    batch, seqlen_q, num_q_heads, head_dim = (q.shape[0], q.shape[2], q.shape[1], q.shape[3]) if bhsd else q.shape
    seqlen_k = k.shape[2 if bhsd else 1]
    for name, x in (("dout", dout), ("out", out)):
        if tuple(x.shape) != tuple(q.shape):
            raise ValueError(f"{name}: expected shape {tuple(q.shape)} (that of q), got {tuple(x.shape)}")
        if _interop.dtype_name(x) != dtype:
            raise TypeError(f"{name}: expected dtype {dtype} (that of q), got {_interop.dtype_name(x)}")
    lse_shape = (batch, num_q_heads, seqlen_q)
    if tuple(lse.shape) != lse_shape:
        raise ValueError(f"lse: expected shape {lse_shape} (batch, num_q_heads, seqlen_q), got {tuple(lse.shape)}")
    lse_dtypes = ("float32", "float64") if dtype == "float64" else ("float32",)
    if _interop.dtype_name(lse) not in lse_dtypes:
        raise TypeError(f"lse: expected dtype {' or '.join(lse_dtypes)} (the forward's return_lse), got {_interop.dtype_name(lse)}")
    softmax_scale = _check_scale(softmax_scale, head_dim)
    lens = _check_seqlens_k(seqlens_k, frame, batch, seqlen_k)
    checked_mods = _check_modifiers(frame, causal, seqlen_q, seqlen_k, batch, num_q_heads, window=window, softcap=softcap,
                                    sinks=sinks, alibi_slopes=alibi_slopes, score_mod=None, mask_mod=mask_mod)  # fmt: skip

    with _interop.running_on(frame):
        inputs = {name: _interop.to_backend(x, frame) for name, x in (("q", q), ("k", k), ("v", v), ("dout", dout), ("out", out), ("lse", lse))}
        for name, a in inputs.items():
            _check_strides(name, a)
        results = []
        for name, like in (("dq", q), ("dk", k), ("dv", v)):
            x = given.get(name)
            if x is None:
                results.append(_interop.empty(tuple(like.shape), like, frame))  # contiguous in the caller's layout
                continue
            xb = _interop.to_backend(x, frame)
            _check_result(name, x, xb, tuple(like.shape), dtype, like_name=name[1:])
            results.append((x, xb))
        _check_disjoint(inputs, {name: xb for name, (_, xb) in zip(("dq", "dk", "dv"), results)})
        (dq, dqb), (dk, dkb), (dv, dvb) = results
        qb, kb, vb, doutb, outb, lseb = inputs.values()
        if bhsd:  # (batch, seqlen, heads, head_dim) views, nothing copied
            qb, kb, vb, doutb, outb, dqb, dkb, dvb = (a.transpose(_BHSD_TO_BSHD) for a in (qb, kb, vb, doutb, outb, dqb, dkb, dvb))
        mods, sinks_b, alibi_b = _modifiers(frame, checked_mods, None, mask_mod)
        dsinks = dsinksb = None
        if sinks_b is not None:
            dsinks, dsinksb = _interop.empty((num_q_heads,), q, frame, float32=True)
        lensb = _seq.index_backend("seqlens_k", lens, frame)
        if seqlen_q == 0 or seqlen_k == 0 or batch == 0:
            # no row sees a key, or no row at all: zero gradients (a row's out is 0, and so is its sink's share)
            for a in (dqb, dkb, dvb, dsinksb):
                if a is not None and a.size:
                    a.fill(0)
        elif not frame.on_gpu:
            attention_backward_cpu(
                doutb, qb, kb, vb, outb, lseb, dqb, dkb, dvb, causal=bool(causal), softmax_scale=softmax_scale, seqlens_k=lensb,
                mods=None if mods is None else _mods.CpuModifiers.of(mods, sinks_b, alibi_b), dsinks=dsinksb,
            )
        else:
            problem = _plan.Problem.of(qb, kb, dtype=dtype, causal=bool(causal), softmax_scale=softmax_scale, mods=mods)
            _plan.launch_backward(problem, doutb, qb, kb, vb, outb, lseb, dqb, dkb, dvb, lensb, dsinks=dsinksb)
    return (dq, dk, dv) if dsinks is None else (dq, dk, dv, dsinks)


def _check_result(name: str, x, xb, shape: tuple, dtype: str, like_name: str) -> None:
    """A preallocated gradient: shape and dtype of its input, usable strides."""
    if tuple(x.shape) != shape:
        raise ValueError(f"{name}: expected shape {shape} (that of {like_name}), got {tuple(x.shape)}")
    if _interop.dtype_name(x) != dtype:
        raise TypeError(f"{name}: expected dtype {dtype} (that of {like_name}), got {_interop.dtype_name(x)}")
    if xb.size == 0:
        return
    _check_strides(name, xb)
    if any(s == 0 and n > 1 for n, s in zip(xb.shape, xb.strides)):
        raise ValueError(f"{name}: expected no zero strides (its elements would overlap), got strides {xb.strides}")


def _check_disjoint(inputs: dict, results: dict) -> None:
    """No result overlaps an input or another result."""
    names = list(results)
    for i, name in enumerate(names):
        lo, hi = _interop.byte_span(results[name])
        if lo == hi:
            continue
        for other, a in [*inputs.items(), *((n, results[n]) for n in names[:i])]:
            o_lo, o_hi = _interop.byte_span(a)
            if lo < o_hi and o_lo < hi:
                raise ValueError(f"{name}: must not overlap the memory of {other}")


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


_HOST_SEQLENS = "None, " + _seq._HOST


def _check_seqlens_k(seqlens_k, frame: _interop.Frame, batch: int, seqlen_k: int):
    """seqlens_k, validated on the host without touching the device.

    Returns None, ("host", int64 NumPy array) with every value checked, or
    ("device", the CUDA array) with its dtype, shape and device checked."""
    if seqlens_k is None:
        return None
    lens = _seq.check_index_array(
        "seqlens_k", seqlens_k, frame, (batch,), "(the batch of q)", _HOST_SEQLENS
    )
    if lens[0] == "host":
        host = lens[1]
        bad = np.flatnonzero((host < 0) | (host > seqlen_k))
        if bad.size:
            i = int(bad[0])
            raise ValueError(f"seqlens_k: expected values in [0, {seqlen_k}] (0 to seqlen_k), got {host[i]} at batch {i}")
    return lens


def _check_mod_array(name: str, a, frame: _interop.Frame, shapes: tuple, expected: str):
    """A modifier's float32 array (sinks, alibi_slopes), checked: None, or
    ("host", float32 NumPy array) or ("device", the CUDA array)."""
    if a is None:
        return None
    kind = "list" if isinstance(a, (list, tuple)) else _interop._kind(a)
    if kind == "unknown":
        raise TypeError(
            f"{name}: expected None or a float32 array (NumPy, CuPy, torch, list), got "
            f"{type(a).__module__}.{type(a).__qualname__}"
        )
    on_cpu = kind in ("list", "numpy") or (kind == "torch" and a.device.type == "cpu")
    if kind == "list":
        a = np.asarray(a, dtype=np.float32)
    dtype = _interop.dtype_name(a)
    if dtype != "float32":
        raise TypeError(f"{name}: expected dtype float32, got {dtype}")
    shape = tuple(a.shape)
    if shape not in shapes:
        want = " or ".join(str(s) for s in shapes)
        raise ValueError(f"{name}: expected shape {want} {expected}, got {shape}")
    if on_cpu:
        host = a.detach().numpy() if kind == "torch" else np.asarray(a)
        return ("host", np.ascontiguousarray(host))
    dev = _interop._device_of(a, kind, name)
    if not frame.on_gpu:
        raise ValueError(f"{name}: expected a host array (NumPy, list, CPU torch tensor) for CPU inputs, got an array on cuda:{dev}")
    if dev != frame.device:
        raise ValueError(f"{name}: expected device cuda:{frame.device} (that of q), got cuda:{dev}")
    return ("device", a)


def _mod_array_backend(name: str, checked, frame: _interop.Frame):
    """The checked modifier array as the backend reads it: a NumPy array (CPU) or a
    contiguous float32 CuPy array on the current device (a host one copied on the call's stream)."""
    b, in_place = _interop.checked_backend(name, checked, frame, np.float32)
    if in_place and not b.flags.c_contiguous:
        raise ValueError(f"{name}: expected a contiguous CUDA array (it is read in place), got strides {b.strides} bytes")
    return b


def _check_workspace(workspace, frame: _interop.Frame):
    """A caller's decode workspace (framework and device already checked) as a
    backend array: float32 and contiguous. Its size, address and overlap are
    checked where the plan says how much of it the call uses."""
    if _interop.dtype_name(workspace) != "float32":
        raise TypeError(f"workspace: expected dtype float32, got {_interop.dtype_name(workspace)}")
    wsb = _interop.to_backend(workspace, frame)
    if not wsb.flags.c_contiguous:
        raise ValueError(f"workspace: expected a contiguous array, got shape {wsb.shape} with strides {wsb.strides} bytes")
    return wsb


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


_ATTENTION_DEFAULTS = {
    "causal": True, "softmax_scale": None, "return_lse": False, "out": None, "kernel": "auto",
    "precision": "highest", "seqlens_k": None, "layout": "bshd", "workspace": None, "window": None,
    "softcap": None, "sinks": None, "alibi_slopes": None, "score_mod": None, "mask_mod": None,
    "block_table": None, "cache_leftpad": None,
}  # fmt: skip
_VARLEN_ARGS = ("cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k")
_VARLEN_KEYWORDS = ("causal", "softmax_scale", "return_lse", "out", "kernel", "precision", "workspace", "window",
                    "softcap", "sinks", "alibi_slopes", "score_mod", "mask_mod")  # fmt: skip


def workspace_size(q, k, v, **kwargs) -> int:
    """Bytes of the float32 workspace that ``attention(q, k, v, **kwargs)`` uses
    (the same arrays and keywords): ``4 * batch * num_q_heads * seqlen_q *
    num_splits * (head_dim + 1)`` when the decode kernel splits the keys into
    num_splits > 1 ranges merged by the combine kernel; ``batch *
    num_kv_heads * ntiles * (8 * block_n * head_dim + 12)`` (the pairs of K
    and V in key tiles of block_n) for a float32 call on fp16 pairs; else 0
    (no split, or a split merged inside its thread-block clusters). num_splits depends on the shape and the
    device (its architecture and SM count; ``_plan.decode_dispatch``) and is
    at most ``_plan.DECODE_MAX_SPLITS`` (128),
    so ``4 * batch * num_q_heads * seqlen_q * 128 * (head_dim + 1)`` bytes
    serve every such call on any device. The call is checked as attention
    checks it; nothing is launched (a new out is allocated to plan with).

    For an ``attention_varlen`` call pass its arguments as keywords:
    ``workspace_size(q, k, v, cu_seqlens_q=..., cu_seqlens_k=...,
    max_seqlen_q=..., max_seqlen_k=..., **kwargs)``; seqlen_q is then
    max_seqlen_q. (``decode_workspace_size`` is the same function: its
    earlier name, from when only split decode calls took a workspace.)"""
    if any(name in kwargs for name in _VARLEN_ARGS):
        missing = [name for name in _VARLEN_ARGS if name not in kwargs]
        if missing:
            raise TypeError(f"workspace_size: missing keyword {missing[0]!r} of attention_varlen")
        unknown = sorted(set(kwargs) - set(_VARLEN_ARGS) - set(_VARLEN_KEYWORDS))
        if unknown:
            raise TypeError(f"workspace_size: unexpected keyword {unknown[0]!r} (it takes attention_varlen's keywords)")
        options = {**{name: _ATTENTION_DEFAULTS[name] for name in _VARLEN_KEYWORDS}, **kwargs}
        varlen = tuple(options.pop(name) for name in _VARLEN_ARGS)
        plan = _attention_seq(q, k, v, **options, layout="bshd", varlen=varlen, plan_only=True)
        return 0 if plan is None else plan.workspace_bytes
    unknown = sorted(set(kwargs) - set(_ATTENTION_DEFAULTS))
    if unknown:
        raise TypeError(f"workspace_size: unexpected keyword {unknown[0]!r} (it takes attention's keywords)")
    options = {**_ATTENTION_DEFAULTS, **kwargs}
    if options["block_table"] is not None or options["cache_leftpad"] is not None:
        plan = _attention_seq(q, k, v, **options, plan_only=True)
        return 0 if plan is None else plan.workspace_bytes
    del options["block_table"], options["cache_leftpad"]
    plan = _attention(q, k, v, **options, flags=None, plan_only=True)
    return 0 if plan is None else plan.workspace_bytes


def workspace(q, k, v, **kwargs):
    """A workspace for ``attention(q, k, v, workspace=..., **kwargs)``: a new
    contiguous float32 array of ``workspace_size(q, k, v, **kwargs)``
    bytes in q's framework and on q's device (a torch tensor for torch inputs,
    else a CuPy array), or None when the call needs none (None is then the
    right ``workspace``). Make it before capturing a CUDA graph and keep it as
    long as the graph: the graph's launches write into it at every replay.
    (``decode_workspace`` is the same function: its earlier name.)"""
    nbytes = workspace_size(q, k, v, **kwargs)
    if nbytes == 0:
        return None
    frame = _interop.frame_of({"q": q})
    if frame.kind == "torch":
        torch = sys.modules["torch"]
        return torch.empty(nbytes // 4, dtype=torch.float32, device=torch.device("cuda", frame.device))
    import cupy

    with cupy.cuda.Device(frame.device):
        return cupy.empty(nbytes // 4, dtype=cupy.float32)


# The earlier names (from when only split decode calls took a workspace).
decode_workspace_size = workspace_size
decode_workspace = workspace


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
    cache when an earlier process compiled it, and loaded on the device.
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
            ready += 1
    return ready
