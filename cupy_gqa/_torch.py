"""torch autograd and torch.compile for cupy_gqa.attention.

Two custom ops (``torch.library.custom_op``), each with a fake (meta)
implementation, so that ``torch.compile(fullgraph=True)`` traces through them
without a graph break:

    torch.ops.cupy_gqa.attention(q, k, v, causal, softmax_scale, seqlens_k, kernel, precision, layout,
                                 window_left, window_right, softcap, sinks, alibi_slopes) -> (out, lse)
    torch.ops.cupy_gqa.attention_backward(dout, q, k, v, out, lse, causal, softmax_scale, seqlens_k, layout,
                                          window_left, window_right, softcap, sinks, alibi_slopes)
        -> (dq, dk, dv, dsinks)

The first has the second as its autograd formula: the forward saves q, k, v,
out and lse (nothing quadratic), and the backward rebuilds the probabilities
from lse (cupy_gqa.attention_backward). lse is not differentiable. Both run on
CUDA tensors (the kernels, on torch's current stream) and on CPU tensors (the
NumPy backend).

The built-in modifiers go through both ops: the window as two integers (-1 -1:
none), the softcap as a float (0: none), sinks and alibi_slopes as optional
tensors; the sinks get their gradient (dsinks: an empty tensor without sinks),
the ALiBi slopes none. A score_mod (no derivative) and a mask_mod (a Python
object the ops' schema cannot carry) are refused on calls that reach the ops
(api._torch_op_modifiers).

This module imports torch; cupy_gqa imports it only once a torch tensor needs
it (api.attention's routing), so torch stays optional.
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from . import api


@torch.library.custom_op("cupy_gqa::attention", mutates_args=())
def attention_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    softmax_scale: Optional[float],
    seqlens_k: Optional[torch.Tensor],
    kernel: str,
    precision: str,
    layout: str,
    window_left: int = -1,
    window_right: int = -1,
    softcap: float = 0.0,
    sinks: Optional[torch.Tensor] = None,
    alibi_slopes: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    return api._attention(
        q, k, v, causal=causal, softmax_scale=softmax_scale, return_lse=True, out=None, kernel=kernel, precision=precision,
        seqlens_k=seqlens_k, layout=layout, workspace=None, flags=None, **_modifiers(window_left, window_right, softcap,
                                                                                     sinks, alibi_slopes),
    )


def _modifiers(window_left, window_right, softcap, sinks, alibi_slopes) -> dict:
    """The ops' modifier arguments as api.attention and attention_backward take them."""
    window = None if (window_left, window_right) == (-1, -1) else (window_left, window_right)
    return {"window": window, "softcap": softcap or None, "sinks": sinks, "alibi_slopes": alibi_slopes}


def _lse_shape(q: torch.Tensor, layout: str) -> tuple:
    batch, seqlen_q, num_q_heads = (q.shape[0], q.shape[2], q.shape[1]) if layout == "bhsd" else q.shape[:3]
    return (batch, num_q_heads, seqlen_q)


@attention_op.register_fake
def _attention_fake(q, k, v, causal, softmax_scale, seqlens_k, kernel, precision, layout, window_left=-1,
                    window_right=-1, softcap=0.0, sinks=None, alibi_slopes=None):  # fmt: skip
    # as the real op: out new and contiguous in q's layout, lse float32 (batch, num_q_heads, seqlen_q)
    return q.new_empty(q.shape), q.new_empty(_lse_shape(q, layout), dtype=torch.float32)


@torch.library.custom_op("cupy_gqa::attention_backward", mutates_args=())
def attention_backward_op(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    causal: bool,
    softmax_scale: Optional[float],
    seqlens_k: Optional[torch.Tensor],
    layout: str,
    window_left: int = -1,
    window_right: int = -1,
    softcap: float = 0.0,
    sinks: Optional[torch.Tensor] = None,
    alibi_slopes: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    grads = api.attention_backward(
        dout, q, k, v, out, lse, causal=causal, softmax_scale=softmax_scale, seqlens_k=seqlens_k, layout=layout,
        **_modifiers(window_left, window_right, softcap, sinks, alibi_slopes),
    )
    return grads if sinks is not None else (*grads, q.new_empty((0,), dtype=torch.float32))


@attention_backward_op.register_fake
def _attention_backward_fake(dout, q, k, v, out, lse, causal, softmax_scale, seqlens_k, layout, window_left=-1,
                             window_right=-1, softcap=0.0, sinks=None, alibi_slopes=None):  # fmt: skip
    dsinks = q.new_empty((0,) if sinks is None else tuple(sinks.shape), dtype=torch.float32)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), dsinks


def _setup_context(ctx, inputs, output):
    q, k, v, causal, softmax_scale, seqlens_k, _kernel, _precision, layout, window_left, window_right, softcap, sinks, \
        alibi_slopes = inputs  # (every argument, the defaults too)
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, seqlens_k, sinks, alibi_slopes)
    ctx.causal, ctx.softmax_scale, ctx.layout = causal, softmax_scale, layout
    ctx.window, ctx.softcap = (window_left, window_right), softcap
    ctx.mark_non_differentiable(lse)


def _backward(ctx, dout, _dlse):
    q, k, v, out, lse, seqlens_k, sinks, alibi_slopes = ctx.saved_tensors
    if dout is None:
        dout = torch.zeros_like(out)
    dq, dk, dv, dsinks = attention_backward_op(dout, q, k, v, out, lse, ctx.causal, ctx.softmax_scale, seqlens_k,
                                               ctx.layout, *ctx.window, ctx.softcap, sinks, alibi_slopes)  # fmt: skip
    # (causal, softmax_scale, seqlens_k, kernel, precision, layout, the window's two sides, softcap: no gradient;
    # the ALiBi slopes: none either, they are not parameters of the attention)
    return dq, dk, dv, None, None, None, None, None, None, None, None, None, None if sinks is None else dsinks, None


attention_op.register_autograd(_backward, setup_context=_setup_context)


def _seqlens_tensor(seqlens_k, q, k, layout):
    """seqlens_k as the op takes it: None or a tensor (host values on the CPU, as int64)."""
    if seqlens_k is None or isinstance(seqlens_k, torch.Tensor):
        return seqlens_k
    if isinstance(seqlens_k, (list, tuple)) and all(isinstance(n, int) and not isinstance(n, bool) for n in seqlens_k):
        return torch.tensor(list(seqlens_k), dtype=torch.int64)
    if isinstance(seqlens_k, (list, tuple, np.ndarray)):
        host = np.asarray(seqlens_k)
        if host.dtype.kind in "iu":
            return torch.from_numpy(host.astype(np.int64))
    # anything else is refused by the API's own check, which names what is wrong
    if len(q.shape) == 4 and len(k.shape) == 4:
        api._check_seqlens_k(seqlens_k, api._interop.Frame("numpy", None), q.shape[0], k.shape[2 if layout == "bhsd" else 1])
    raise TypeError(
        f"seqlens_k: expected None, a list, tuple, NumPy integer array or torch tensor, got {type(seqlens_k).__name__}"
    )


def _mod_tensor(name: str, a):
    """A modifier's array (sinks, alibi_slopes) as the ops take it: a tensor (lists and
    NumPy arrays as CPU tensors of their own dtype; the op's checks name what is wrong)."""
    if a is None or isinstance(a, torch.Tensor):
        return a
    if isinstance(a, (list, tuple, np.ndarray)):
        return torch.as_tensor(np.asarray(a, dtype=np.float32) if isinstance(a, (list, tuple)) else a)
    raise TypeError(f"{name}: expected None or a float32 array (NumPy, CuPy, torch, list), got {type(a).__name__}")


def attention(q, k, v, *, causal, softmax_scale, return_lse, kernel, precision, seqlens_k, layout, window=None,
              softcap=None, sinks=None, alibi_slopes=None):  # fmt: skip
    """api.attention for torch tensors that need autograd (or under torch.compile)."""
    for name, flag in (("causal", causal), ("return_lse", return_lse)):
        if not isinstance(flag, (bool, np.bool_)):
            raise TypeError(f"{name}: expected a bool, got {type(flag).__name__} {flag!r}")
    if softmax_scale is not None:
        softmax_scale = api._check_scale(softmax_scale, 1)  # a finite real number (None: 1 / sqrt(head_dim), in the op)
    win = None
    if window is not None:  # its types and values (the lengths only bound it; the op checks it again with them)
        win = api._mods.check_window(window, bool(causal), 2**62, 2**62)
    left, right = win if win is not None else (-1, -1)
    out, lse = attention_op(
        q, k, v, bool(causal), softmax_scale, _seqlens_tensor(seqlens_k, q, k, layout), kernel, precision, layout,
        left, right, api._mods.check_softcap(softcap), _mod_tensor("sinks", sinks),
        _mod_tensor("alibi_slopes", alibi_slopes),
    )  # fmt: skip
    return (out, lse) if return_lse else out
