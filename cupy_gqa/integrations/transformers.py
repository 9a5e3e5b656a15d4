"""cupy_gqa as an attention implementation of Hugging Face transformers (5.x).

    from cupy_gqa.integrations import transformers as cupy_gqa_hf
    cupy_gqa_hf.register()
    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="cupy_gqa")

:func:`register` adds "cupy_gqa" to transformers' attention functions and to
its mask functions. The mask function is transformers' own for sdpa, so a model
builds no mask where the causal pattern alone describes the call, exactly as
for sdpa. (Registering the attention function alone would be silently wrong:
transformers then passes no mask at all, padded batches included.)

cupy_gqa runs a call when:
  - there is no mask;
  - no dropout is active;
  - it has no softcap, learned sinks or position bias.
Inputs that require grad run too: cupy_gqa.attention records its own backward
(cupy_gqa.attention_backward) with torch autograd. The causal pattern is then
cupy_gqa's bottom-right one. A prefill whose keys
are a whole preallocated (static) cache is cut to the prefill's own keys, as
transformers' sdpa does.

Any other call falls back, with a warning the first time for each reason:
  - to transformers' sdpa;
  - to its eager attention for softcap and sinks, which sdpa would silently
    drop.
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
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    if not isinstance(strict, bool):
        raise TypeError(f"strict: expected a bool, got {type(strict).__name__}")
    _strict = strict
    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, sdpa_mask)


def _unsupported(module, query, key, value, attention_mask, dropout, kwargs) -> str | None:
    """Why cupy_gqa can't run this call of transformers' attention, or None."""
    if kwargs.get("softcap") is not None or getattr(module, "sinks", None) is not None:
        return "softcap or attention sinks"
    if attention_mask is not None:
        return "an attention mask (padding, sliding window or a custom pattern)"
    if dropout and module.training:
        return "attention dropout"
    if kwargs.get("position_bias") is not None:
        return "a position bias"
    if kwargs.get("output_attentions"):
        return "output_attentions"
    return None


def _fall_back(reason: str, module, query, key, value, attention_mask, dropout, scaling, kwargs):
    if _strict:
        raise ValueError(f"attn_implementation={NAME!r}: cupy_gqa does not run calls with {reason}")
    eager = reason.startswith("softcap")  # transformers' sdpa would drop softcap and sinks silently
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
        attention_mask = _additive_mask(attention_mask, query, key, kwargs.get("is_causal", getattr(module, "is_causal", True)))
    else:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward as forward
    return forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)


def _additive_mask(attention_mask, query, key, is_causal):
    """The mask as eager attention takes it: 0 where a query sees a key, the dtype's
    lowest value elsewhere; a missing mask is the causal pattern (bottom-right)
    or nothing."""
    import torch

    low = torch.finfo(query.dtype).min
    if attention_mask is None:
        if not is_causal:
            return None
        seqlen_q, seqlen_k = query.shape[2], key.shape[2]
        i = torch.arange(seqlen_q, device=query.device)[:, None]
        j = torch.arange(seqlen_k, device=query.device)[None, :]
        attention_mask = (j <= i + seqlen_k - seqlen_q)[None, None]
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
    out = cupy_gqa.attention(query, key, value, causal=causal, softmax_scale=scaling, layout="bhsd")
    return out.transpose(1, 2), None  # (batch, seqlen_q, heads, head_dim), no copy
