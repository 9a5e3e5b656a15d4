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
A causal batch with a padding mask (attention_mask) gets a
:class:`PaddedBatch` instead of the full mask where its padding is left
padding (transformers' batched generation), right padding of a prompt or a
static cache's unwritten tail: cupy_gqa runs it with ``cache_leftpad`` and the
keys cut after the last query (PaddedBatch says how, and which rows differ).
A decode step into a static cache without a padding mask (a serving loop's,
and the step a CUDA graph captures) gets a :class:`CachedKeys`: cupy_gqa runs
it over the whole cache with ``seqlens_k`` made on the device from the cache
position, reading nothing on the host.

cupy_gqa runs a call when:
  - there is no mask, a PaddedBatch (with left padding: no inputs that
    require grad) or a CachedKeys (no inputs that require grad);
  - no dropout is active;
  - it has no position bias.
Inputs that require grad run too: cupy_gqa.attention records its own backward
(cupy_gqa.attention_backward, which takes the modifiers below and gives the
sinks their gradient) with torch autograd. The causal pattern is then
cupy_gqa's bottom-right one, with the model's sliding window
(``window=(sliding_window - 1, 0)``: Mistral, Qwen2, the local layers of
Gemma 2 and gpt-oss), softcap (Gemma 2) and attention sinks (gpt-oss,
float32). A prefill whose keys are a whole preallocated (static) cache is cut
to the prefill's own keys, as transformers' sdpa does.

Any other call (a padding mask with padding inside a sequence, say) falls
back, with a warning the first time for each reason:
  - to transformers' sdpa;
  - to its eager attention when the call has a softcap or sinks, which sdpa
    would silently drop.
A fallback of a sliding-window call that has no mask gets the window's mask.
With ``register(strict=True)`` a call cupy_gqa can't express raises ValueError
instead.
"""
from __future__ import annotations

import warnings

import cupy_gqa
from cupy_gqa import api

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
    None.

    The causal mask of a batch with a 2D padding mask, and a sliding window's
    (the causal mask and ``kv > q - local_size``, checked on the mask function
    itself: :func:`_sliding_window_of`), becomes a :class:`PaddedBatch` where
    cupy_gqa can run it (see there), or None where nothing is padded; not where
    the caller asks for the mask itself (``allow_is_causal_skip=False``: models
    that combine it with other masks, and a static cache's decode steps, whose
    mask transformers builds whole), except a static cache's decode step without
    a padding mask, which gets a :class:`CachedKeys`."""
    from transformers.masking_utils import causal_mask_function, is_tracing, prepare_padding_mask, sdpa_mask

    padding, q_offset = kwargs.get("attention_mask"), kwargs.get("q_offset", 0)
    causal = kwargs.get("mask_function") is causal_mask_function
    # a sliding window's causal mask (cupy_gqa applies the window from the attention call's sliding_window)
    window = None if causal else _sliding_window_of(kwargs.get("mask_function"), local_size)
    if isinstance(padding, PaddedBatch):  # generate's premade mask, passed on by the model's forward
        if causal:
            return padding
        return padding.with_window(window, kwargs) if window is not None else padding.mask(**kwargs)
    if (
        padding is None
        and not args
        and causal
        and not kwargs.get("allow_is_causal_skip", True)
        and kwargs.get("kv_offset", 0) == 0
        and kwargs.get("q_length") == 1
        and isinstance(q_offset, _torch().Tensor)
        and not _traced(q_offset, is_tracing)
        and not getattr(kwargs.get("config"), "alibi", False)  # a model that adds ALiBi to the mask tensor itself
    ):
        # a decode step into a static cache, whose mask transformers asks for whole
        return CachedKeys(q_offset, kwargs)
    if (
        args
        or not (causal or (window is not None and padding is not None))  # chunks, packed sequences, ...
        # the mask itself asked for: models that combine it with others, a static cache's decode steps
        or not kwargs.get("allow_is_causal_skip", True)
        or kwargs.get("kv_offset", 0) != 0
        or is_tracing(padding)
        or (isinstance(q_offset, _torch().Tensor) and is_tracing(q_offset))
    ):
        return sdpa_mask(*args, **kwargs)  # (a sliding window without padding: None, as the docstring says)
    if padding is None:
        # no padding: the keys up to the last query (a static cache's q_offset is a tensor, read here)
        padded = PaddedBatch(None, int(q_offset) + kwargs["q_length"], kwargs)
    else:
        padding = prepare_padding_mask(padding, kwargs["kv_length"], 0)  # (batch, kv_length)
        if isinstance(q_offset, int) and q_offset + kwargs["q_length"] == kwargs["kv_length"] and bool(padding.all()):
            # generate's mask of an unpadded batch over a dynamic cache (every step): one read,
            # as sdpa's mask makes, in place of PaddedBatch.of's dozen small operations
            return None
        padded = PaddedBatch.of(padding, kwargs["q_length"], q_offset, kwargs)
        if padded is None:  # padding inside a sequence, seen by its tokens: the full mask
            return sdpa_mask(*args, local_size=local_size, **kwargs)
    if padded.cache_leftpad is None and padded.num_keys == kwargs["kv_length"]:
        return None  # nothing padded: the causal pattern alone (and the window), which cupy_gqa applies
    return padded if window is None else padded.with_window(window, kwargs)


def _sliding_window_of(mask_function, local_size) -> int | None:
    """``local_size`` when ``mask_function`` is transformers' sliding-window causal
    mask of that size (key kv seen by query q when q - local_size < kv <= q), checked
    on both edges of the band at two queries; None for any other (chunks, a
    bidirectional window, a custom pattern)."""
    if mask_function is None or not local_size:
        return None
    torch = _torch()
    w = int(local_size)
    q = torch.tensor([w, w, w, w, 2 * w + 3, 2 * w + 3, 2 * w + 3, 2 * w + 3])
    kv = q + torch.tensor([0, 1, 1 - w, -w] * 2)
    try:
        seen = mask_function(torch.zeros_like(q), torch.zeros_like(q), q, kv)
        return w if torch.as_tensor(seen).tolist() == [True, False, True, False] * 2 else None
    except Exception:  # a mask function that takes no index tensors: not transformers' window
        return None


def _torch():
    import torch

    return torch


def _traced(tensor, is_tracing) -> bool:
    """transformers' ``is_tracing(tensor)`` without its clause for a CUDA graph
    being captured: a :class:`CachedKeys` step reads nothing on the host, so a
    capture can hold it, where torch.compile, torch.jit and torch.fx can't."""
    torch = _torch()
    if not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()):
        return is_tracing(tensor)
    from torch._subclasses import FakeTensor

    return torch.compiler.is_compiling() or torch.jit.is_tracing() or isinstance(tensor, (torch.fx.Proxy, FakeTensor))


class _Premade:
    """A mask that the mask function hands on to the attention calls in place of
    transformers' tensor (mask_kwargs: the mask function's arguments)."""

    ndim = 4  # transformers passes a premade mask of 4 dimensions on to the mask function

    def __init__(self, mask_kwargs: dict):
        self._mask_kwargs = mask_kwargs

    @property
    def shape(self):
        k = self._mask_kwargs
        return (k["batch_size"], 1, k["q_length"], k["kv_length"])


class CachedKeys(_Premade):
    """The mask of a decode step into a static (preallocated) cache, as cupy_gqa
    runs it: the query at position q_offset sees the cache's keys
    ``[0, q_offset]``, the keys after them unwritten. transformers asks for this
    mask whole (``allow_is_causal_skip=False`` on the decode steps of a cache
    that torch.compile can take), where cupy_gqa needs only the number of keys:
    ``seqlens_k = q_offset + 1`` for every row of the batch, made on q_offset's
    device. Nothing is read on the host, so the step can be captured in a CUDA
    graph and replayed with the cache position moved on."""

    def __init__(self, q_offset, mask_kwargs: dict):
        super().__init__(mask_kwargs)
        torch = _torch()
        self.seqlens_k = (q_offset.reshape(-1)[:1] + 1).to(torch.int32).expand(mask_kwargs["batch_size"]).contiguous()

    def mask(self, **kwargs):
        """transformers' sdpa mask of the step (for a fallback), with the mask
        function of ``kwargs`` if given."""
        from transformers.masking_utils import sdpa_mask

        return sdpa_mask(**{**self._mask_kwargs, **kwargs})


class PaddedBatch(_Premade):
    """The attention mask of a causal batch with padding, as cupy_gqa runs it.

    transformers' mask for a batch with a 2D padding mask lets query position t
    of row b see key j when j <= t (keys and queries numbered by position) and
    the padding mask is 1 at j. cupy_gqa expresses that with ``cache_leftpad``
    (each row's first unpadded key) and the call's keys cut to positions
    ``[0, num_keys)`` (num_keys: one past the last query's position; a static
    cache's unwritten keys are past it): query t then sees keys
    ``cache_leftpad[b] <= j <= t``. That is transformers' mask for every query
    whose own token is not padding, provided its row has no padding between its
    first unpadded key and the query: left padding (transformers' layout for
    batched generation), right padding of a prompt (its padding follows every
    real token), a static cache. A padded row with padding inside (a
    right-padded prompt that then generates) makes :func:`_mask` build the full
    mask, and the calls fall back to sdpa; so do a static cache's decode steps
    with a padding mask (transformers asks for their whole mask; without one
    they run as :class:`CachedKeys`).

    The rows of padding tokens are not transformers': each sees the keys from
    its row's first unpadded one to itself (none for left padding: zeros),
    where transformers lets it see the unpadded keys. Those rows are padding:
    no real token attends to them (the causal pattern), and they give no loss
    and, with left padding, no generated token. (A right-padded prompt that
    generates takes its first token from a padding row, which transformers
    warns about: that token is not transformers' either, and the steps after
    it have padding inside the sequence, which falls back.)

    Deciding this reads the padding mask's summary on the host: one transfer of
    three integers per forward (the mask function runs once per forward, not
    per layer; without a padding mask, only a static cache's query offset),
    where transformers' own sdpa mask reads the padding mask on the host too
    (``_ignore_causal_mask_sdpa``). cache_leftpad stays on the device, where
    the kernels read it in place.
    """

    def __init__(self, cache_leftpad, num_keys: int, mask_kwargs: dict, window: int | None = None):
        super().__init__(mask_kwargs)
        self.cache_leftpad = cache_leftpad  # (batch,) int32 on the mask's device, or None: no left padding
        self.num_keys = num_keys
        self.window = window  # a sliding-window layer's window (the attention call must pass the same), or None
        self._full = None

    def with_window(self, window: int, mask_kwargs: dict) -> "PaddedBatch":
        """The same batch for a sliding-window layer (its mask's arguments, for a fallback)."""
        return PaddedBatch(self.cache_leftpad, self.num_keys, mask_kwargs, window)

    def mask(self, **kwargs):
        """transformers' sdpa mask of the batch (for a fallback), with the mask
        function of ``kwargs`` if given, else the causal one."""
        from transformers.masking_utils import sdpa_mask

        if kwargs:
            return sdpa_mask(**{**kwargs, "attention_mask": self._mask_kwargs.get("attention_mask")})
        if self._full is None:
            self._full = sdpa_mask(**{**self._mask_kwargs, "allow_is_causal_skip": False})
        return self._full

    @classmethod
    def of(cls, padding_mask, q_length: int, q_offset, mask_kwargs: dict):
        """The PaddedBatch of a causal call with queries at positions
        ``q_offset + [0, q_length)`` and the (batch, kv_length) bool padding
        mask, or None when a row has padding where a real token sees it."""
        torch = _torch()
        device = padding_mask.device
        j = torch.arange(padding_mask.shape[-1], device=device)
        end = torch.as_tensor(q_offset, device=device).reshape(()) + q_length  # one past the last query
        seen = padding_mask & (j < end)  # unpadded keys, up to the last query
        first = torch.where(seen.any(-1), seen.to(torch.int32).argmax(-1), end).to(torch.int32)
        # the last real query's position (-1: none), and whether the row's unpadded keys up to it are one run
        last_real = torch.where(seen & (j >= end - q_length), j, -1).amax(-1)
        ones = (seen & (j <= last_real[:, None])).sum(-1)
        holes = ones != (last_real + 1 - first).clamp(min=0)
        # one transfer: whether any row has a hole or left padding, and num_keys
        summary = torch.stack([holes.any().to(torch.int64), (first > 0).any().to(torch.int64), end.to(torch.int64)])
        any_hole, any_left, num_keys = summary.tolist()
        if any_hole:
            return None
        return cls(first if any_left else None, int(num_keys), mask_kwargs)


def _sinks(module):
    """The module's attention sinks (gpt-oss: a parameter), or None; read without
    nn.Module's __getattr__, whose miss raises and catches an AttributeError on
    every call of a model without sinks."""
    parameters = getattr(module, "_parameters", None)
    if parameters is None:  # (not an nn.Module)
        return getattr(module, "sinks", None)
    sinks = parameters.get("sinks")
    if sinks is None:
        sinks = module.__dict__.get("sinks")
        if sinks is None:
            sinks = module._buffers.get("sinks")
            if sinks is None and hasattr(type(module), "sinks"):  # a class attribute or a property
                sinks = getattr(module, "sinks", None)
    return sinks


def _unsupported(module, query, key, value, attention_mask, dropout, kwargs) -> str | None:
    """Why cupy_gqa can't run this call of transformers' attention, or None."""
    if isinstance(attention_mask, CachedKeys):
        if api._torch_op_call(query, key, value):
            return "a static cache's decode step with inputs that require grad (or torch.compile)"
    elif isinstance(attention_mask, PaddedBatch):
        if attention_mask.cache_leftpad is not None:
            if api._torch_op_call(query, key, value):
                return "left padding and inputs that require grad (or torch.compile): cache_leftpad has no backward"
        if not kwargs.get("is_causal", getattr(module, "is_causal", True)):
            return "an attention mask (padding) on a non-causal call"
        if attention_mask.window != (kwargs.get("sliding_window") or None):  # the mask's window is the call's
            return "a sliding-window mask whose window the attention call does not pass as sliding_window"
    elif attention_mask is not None:
        return (
            "an attention mask (padding inside a sequence, a static cache's decode step, sliding window or a custom "
            "pattern)"
        )
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
    # transformers' sdpa would drop softcap and sinks silently
    eager = kwargs.get("softcap") is not None or _sinks(module) is not None
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
    reason = _unsupported(module, query, key, value, attention_mask, dropout, kwargs)
    if reason is not None:
        if isinstance(attention_mask, _Premade):
            attention_mask = attention_mask.mask()
        return _fall_back(reason, module, query, key, value, attention_mask, dropout, scaling, kwargs)
    is_causal = kwargs.get("is_causal")
    causal = bool(getattr(module, "is_causal", True) if is_causal is None else is_causal)
    seqlen_q, seqlen_k = query.shape[2], key.shape[2]
    cache_leftpad = seqlens_k = None
    if isinstance(attention_mask, CachedKeys):
        seqlens_k = attention_mask.seqlens_k  # the keys written so far, on the device
    elif isinstance(attention_mask, PaddedBatch):
        # padding (PaddedBatch): each row's keys from its first unpadded one, up to the last query
        cache_leftpad = attention_mask.cache_leftpad
        if attention_mask.num_keys < seqlen_k:
            key, value = key[:, :, : attention_mask.num_keys], value[:, :, : attention_mask.num_keys]
    elif causal and 1 < seqlen_q < seqlen_k:
        # no mask, more keys than queries: a prefill into an empty static cache, whose
        # keys past the prefill are unwritten (transformers' sdpa cuts them the same way)
        key, value = key[:, :, :seqlen_q], value[:, :, :seqlen_q]
    sliding_window = kwargs.get("sliding_window")
    sinks = _sinks(module)
    result = out = None
    if not api._torch_op_call(query, key, value, sinks):  # (autograd makes its own result)
        # the result in (batch, seqlen_q, heads, head_dim) memory, as sdpa's kernels write theirs: the
        # model's reshape of it to (batch, seqlen_q, hidden) is then a view, not a copy
        # (new_empty: query's dtype and device, cheaper on the host than torch.empty's keywords)
        batch, heads, seqlen_q, head_dim = query.shape
        result = query.new_empty((batch, seqlen_q, heads, head_dim))
        out = result.transpose(1, 2)
    out = cupy_gqa.attention(
        query, key, value, causal=causal, softmax_scale=scaling, layout="bhsd",
        window=(int(sliding_window) - 1, 0 if causal else int(sliding_window) - 1) if sliding_window else None,
        softcap=kwargs.get("softcap"), sinks=None if sinks is None else sinks.float(),  # (its gradient flows back)
        cache_leftpad=cache_leftpad, seqlens_k=seqlens_k, out=out,
    )  # fmt: skip
    # (batch, seqlen_q, heads, head_dim), no copy: the result written through out, or autograd's
    return (out.transpose(1, 2) if result is None else result), None
