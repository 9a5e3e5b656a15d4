"""cupy_gqa as an attention implementation of Hugging Face transformers (5.x).

    from cupy_gqa.integrations import transformers as cupy_gqa_hf
    cupy_gqa_hf.register()
    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="cupy_gqa")

:func:`register` adds "cupy_gqa" to transformers' attention functions and to
its mask functions. The mask function is transformers' own for sdpa, except
that a sliding window alone does not make a mask (cupy_gqa applies it, from the
``sliding_window`` the model passes): a model builds no mask where the causal
pattern and its sliding window describe the call, as sdpa would for the causal
pattern alone. (Registering the attention function alone would be silently
wrong: transformers then passes no mask at all, padded batches included.)

cupy_gqa runs a call when:
  - there is no mask;
  - no dropout is active;
  - it has no position bias;
  - inputs that require grad (or a torch.compile trace) have no sliding
    window, softcap or sinks: cupy_gqa's backward pass takes no modifiers yet.
Inputs that require grad run too: cupy_gqa.attention records its own backward
(cupy_gqa.attention_backward) with torch autograd. The causal pattern is then
cupy_gqa's bottom-right one, with the model's sliding window
(``window=(sliding_window - 1, 0)``: Mistral, Qwen2, the local layers of
Gemma 2 and gpt-oss), softcap (Gemma 2) and attention sinks (gpt-oss,
float32). A prefill whose keys are a whole preallocated (static) cache is cut
to the prefill's own keys, as transformers' sdpa does.

Any other call falls back, with a warning the first time for each reason:
  - to transformers' sdpa;
  - to its eager attention when the call has a softcap or sinks, which sdpa
    would silently drop.
A fallback of a sliding-window call that has no mask gets the window's mask.
With ``register(strict=True)`` a call cupy_gqa can't express raises ValueError
instead.
"""
from __future__ import annotations

import warnings

NAME = "cupy_gqa"
_strict = False
_warned: set = set()


def register(*, strict: bool = False, name: str = NAME) -> None:
    """Make ``attn_implementation=name`` (default "cupy_gqa") available in transformers."""
    global _strict
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    if not isinstance(strict, bool):
        raise TypeError(f"strict: expected a bool, got {type(strict).__name__}")
    _strict = strict
    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, _mask)


def _mask(*args, local_size=None, **kwargs):
    """transformers' sdpa mask, but a sliding window alone makes none (cupy_gqa
    applies the window): with local_size dropped, a call without padding gets
    None; one with padding still gets the full mask, window included."""
    from transformers.masking_utils import sdpa_mask

    return sdpa_mask(*args, **kwargs)


def _unsupported(module, query, key, value, attention_mask, dropout, kwargs) -> str | None:
    """Why cupy_gqa can't run this call of transformers' attention, or None."""
    if attention_mask is not None:
        return "an attention mask (padding, sliding window or a custom pattern)"
    if dropout and module.training:
        return "attention dropout"
    if kwargs.get("position_bias") is not None:
        return "a position bias"
    modifiers = kwargs.get("sliding_window") or kwargs.get("softcap") is not None or getattr(module, "sinks", None) is not None
    if modifiers:
        from cupy_gqa import api

        if api._torch_op_call(query, key, value):
            return (
                "a sliding window, softcap or attention sinks and inputs that require grad (or torch.compile): "
                "cupy_gqa's backward pass takes no modifiers yet"
            )
    if kwargs.get("output_attentions"):
        return "output_attentions"
    return None


def _fall_back(reason: str, module, query, key, value, attention_mask, dropout, scaling, kwargs):
    if _strict:
        raise ValueError(f"attn_implementation={NAME!r}: cupy_gqa does not run calls with {reason}")
    # transformers' sdpa would drop softcap and sinks silently
    eager = kwargs.get("softcap") is not None or getattr(module, "sinks", None) is not None
    is_causal = kwargs.get("is_causal", getattr(module, "is_causal", True))
    sliding_window = kwargs.get("sliding_window")
    if reason not in _warned:
        _warned.add(reason)
        warnings.warn(
            f"cupy_gqa: calls with {reason} run transformers' {'eager' if eager else 'sdpa'} attention instead",
            stacklevel=3,
        )
    if eager:
        import importlib

        # the model's own eager attention (it applies softcap or sinks); it adds the mask to the
        # scores, so the mask sdpa's rules built (bool, or None for plain causal) becomes additive
        modeling = importlib.import_module(type(module).__module__)
        forward = getattr(modeling, "eager_attention_forward")
        attention_mask = _additive_mask(attention_mask, query, key, is_causal, sliding_window)
    else:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward as forward

        if attention_mask is None and sliding_window:  # our mask function made none: the window's, as sdpa takes it
            attention_mask = _bool_mask(query, key, is_causal, sliding_window)
    return forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)


def _bool_mask(query, key, is_causal, sliding_window):
    """The causal pattern (bottom-right) with a sliding window of ``sliding_window``
    keys (key j seen when j > i + seqlen_k - seqlen_q - sliding_window), as a bool
    (1, 1, seqlen_q, seqlen_k) mask; None where nothing is masked."""
    import torch

    if not is_causal and not sliding_window:
        return None
    seqlen_q, seqlen_k = query.shape[2], key.shape[2]
    i = torch.arange(seqlen_q, device=query.device)[:, None] + (seqlen_k - seqlen_q)
    j = torch.arange(seqlen_k, device=query.device)[None, :]
    seen = torch.ones((seqlen_q, seqlen_k), dtype=torch.bool, device=query.device)
    if is_causal:
        seen &= j <= i
    if sliding_window:
        seen &= j > i - sliding_window
    return seen[None, None]


def _additive_mask(attention_mask, query, key, is_causal, sliding_window=None):
    """The mask as eager attention takes it: 0 where a query sees a key, the dtype's
    lowest value elsewhere; a missing mask is the causal pattern (bottom-right,
    with the sliding window) or nothing."""
    import torch

    low = torch.finfo(query.dtype).min
    if attention_mask is None:
        attention_mask = _bool_mask(query, key, is_causal, sliding_window)
        if attention_mask is None:
            return None
    if attention_mask.dtype == torch.bool:
        zero = torch.zeros((), dtype=query.dtype, device=query.device)
        return torch.where(attention_mask, zero, torch.full((), low, dtype=query.dtype, device=query.device))
    return attention_mask


def attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """transformers' attention-function signature: query (batch, heads, seqlen_q,
    head_dim), key and value (batch, kv_heads, seqlen_k, head_dim); returns
    (out (batch, seqlen_q, heads, head_dim), None)."""
    import cupy_gqa

    reason = _unsupported(module, query, key, value, attention_mask, dropout, kwargs)
    if reason is not None:
        return _fall_back(reason, module, query, key, value, attention_mask, dropout, scaling, kwargs)
    is_causal = kwargs.get("is_causal")
    causal = bool(getattr(module, "is_causal", True) if is_causal is None else is_causal)
    seqlen_q, seqlen_k = query.shape[2], key.shape[2]
    if causal and 1 < seqlen_q < seqlen_k:
        # no mask, more keys than queries: a prefill into an empty static cache, whose
        # keys past the prefill are unwritten (transformers' sdpa cuts them the same way)
        key, value = key[:, :, :seqlen_q], value[:, :, :seqlen_q]
    sliding_window = kwargs.get("sliding_window")
    sinks = getattr(module, "sinks", None)
    out = cupy_gqa.attention(
        query, key, value, causal=causal, softmax_scale=scaling, layout="bhsd",
        window=(int(sliding_window) - 1, 0 if causal else int(sliding_window) - 1) if sliding_window else None,
        softcap=kwargs.get("softcap"), sinks=None if sinks is None else sinks.detach().float(),
    )  # fmt: skip
    return out.transpose(1, 2), None  # (batch, seqlen_q, heads, head_dim), no copy
