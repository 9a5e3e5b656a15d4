"""cupy_gqa as a transformers attention implementation (cupy_gqa/integrations/transformers.py).

On the CPU the calls run the NumPy backend; the GPU tests run the kernels.
Each model is built from a small config with random weights (no download) and
compared with the same weights under attn_implementation="sdpa".
"""
import warnings

import numpy as np
import pytest

from conftest import gpu_available

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from cupy_gqa.integrations import transformers as hf  # noqa: E402

CONFIGS = {
    "llama": ("LlamaConfig", {}),
    "qwen2": ("Qwen2Config", {}),
    "mistral": ("MistralConfig", {"sliding_window": None}),
}


def _model(arch, attn, device="cpu", dtype=torch.float32):
    cls_name, extra = CONFIGS[arch]
    config = getattr(transformers, cls_name)(
        vocab_size=101, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=256, **extra,
    )
    torch.manual_seed(0)  # drawn in float32 and rounded, so every dtype's model has the same weights
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn, dtype=torch.float32)
    return model.to(device=device, dtype=dtype).eval()


@pytest.fixture(autouse=True)
def _registered():
    hf.register()
    hf._warned.clear()
    yield
    hf.register()  # strict off again


@pytest.fixture
def calls(monkeypatch):
    """The calls that reach cupy_gqa.attention (not a fallback)."""
    import cupy_gqa

    seen, attention = [], cupy_gqa.attention
    monkeypatch.setattr(cupy_gqa, "attention", lambda *a, **kw: seen.append(a[0].shape) or attention(*a, **kw))
    return seen


@pytest.mark.parametrize("arch", list(CONFIGS))
def test_logits_and_greedy_tokens_match_sdpa(arch, calls):
    ids = torch.randint(0, 101, (2, 23), generator=torch.Generator().manual_seed(1))
    ours, theirs = _model(arch, "cupy_gqa"), _model(arch, "sdpa")
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback on an unpadded batch
        a, b = ours(ids).logits, theirs(ids).logits
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=0, atol=2e-5)
        gen_a = ours.generate(ids, max_new_tokens=6, do_sample=False)
        gen_b = theirs.generate(ids, max_new_tokens=6, do_sample=False)
    assert torch.equal(gen_a, gen_b)
    # every layer (2) of every forward ran cupy_gqa: the forward, generate's prefill and its
    # 5 decode steps (the 6th token comes from the 5th step's logits)
    assert {shape[2] for shape in calls} == {23, 1} and len(calls) == 2 * (1 + 1 + 5)


def test_static_cache_prefill_and_decode_match_sdpa(calls):
    ids = torch.randint(0, 101, (1, 17), generator=torch.Generator().manual_seed(2))
    ours, theirs = _model("llama", "cupy_gqa"), _model("llama", "sdpa")
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # decode steps with a static cache carry a mask: they fall back
        gen_a = ours.generate(ids, max_new_tokens=5, do_sample=False, cache_implementation="static")
        gen_b = theirs.generate(ids, max_new_tokens=5, do_sample=False, cache_implementation="static")
    assert torch.equal(gen_a, gen_b)
    assert [shape[2] for shape in calls][:2] == [17, 17]  # the prefill into the empty static cache ran cupy_gqa


def test_padded_batch_falls_back_once_with_a_warning_and_strict_raises():
    ids = torch.randint(1, 101, (2, 12), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0  # left padding
    ours, theirs = _model("llama", "cupy_gqa"), _model("llama", "sdpa")
    with torch.no_grad():
        with pytest.warns(UserWarning, match="cupy_gqa: calls with an attention mask .* run transformers' sdpa"):
            a = ours(ids, attention_mask=mask).logits
        b = theirs(ids, attention_mask=mask).logits
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=0, atol=2e-5)
        hf.register(strict=True)
        with pytest.raises(ValueError, match="cupy_gqa does not run calls with an attention mask"):
            ours(ids, attention_mask=mask)


def test_training_with_grad_runs_cupy_gqa_and_matches_sdpa_gradients(calls):
    """Inputs that require grad run cupy_gqa (no fallback, no warning), and its
    backward gives sdpa's gradients."""
    ids = torch.randint(0, 101, (2, 9), generator=torch.Generator().manual_seed(4))
    ours, theirs = _model("llama", "cupy_gqa").train(), _model("llama", "sdpa").train()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback
        loss_a = ours(ids, labels=ids).loss
    loss_b = theirs(ids, labels=ids).loss
    assert len(calls) == 2  # both layers ran cupy_gqa
    loss_a.backward()
    loss_b.backward()
    np.testing.assert_allclose(loss_a.item(), loss_b.item(), rtol=1e-5)
    for (name, pa), pb in zip(ours.named_parameters(), theirs.parameters()):
        assert pa.grad is not None, name
        np.testing.assert_allclose(pa.grad.numpy(), pb.grad.numpy(), rtol=1e-3, atol=1e-5, err_msg=name)


def test_register_checks_its_argument():
    with pytest.raises(TypeError, match="strict: expected a bool, got str"):
        hf.register(strict="yes")


@pytest.mark.gpu
@pytest.mark.skipif(not gpu_available(), reason="no CUDA device")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gpu_logits_match_sdpa(dtype):
    dt = getattr(torch, dtype)
    ids = torch.randint(0, 101, (2, 40), generator=torch.Generator().manual_seed(5)).cuda()
    ours, theirs = _model("llama", "cupy_gqa", "cuda", dt), _model("llama", "sdpa", "cuda", dt)
    with torch.no_grad():
        a, b = ours(ids).logits.float(), theirs(ids).logits.float()
        ref = _model("llama", "eager", "cuda", torch.float64)(ids).logits
    err_ours = float((a.double() - ref).norm() / ref.norm())
    err_theirs = float((b.double() - ref).norm() / ref.norm())
    assert err_theirs < (1e-5 if dt == torch.float32 else 2e-2), err_theirs  # the same model in every dtype
    assert err_ours <= 1.5 * err_theirs + 1e-6, (err_ours, err_theirs)


def _small(cls_name, **extra):
    return getattr(transformers, cls_name)(
        vocab_size=101, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=256, **extra,
    )


def _logits_and_tokens(config, attn, ids):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn).eval()
    with torch.no_grad():
        return model(ids).logits, model.generate(ids, max_new_tokens=4, do_sample=False)


MODIFIER_MODELS = {
    # sliding window shorter than the prompt: the window is what makes these differ from plain causal
    "mistral_sliding_window": ("MistralConfig", {"sliding_window": 6}),
    "qwen2_sliding_window": ("Qwen2Config", {"use_sliding_window": True, "sliding_window": 5, "max_window_layers": 0}),
    # softcap, and alternating sliding (layer 0) and global (layer 1) attention
    "gemma2_softcap_alternating": ("Gemma2Config", {"attn_logit_softcapping": 5.0, "sliding_window": 7}),
    # attention sinks, sliding and full layers
    "gpt_oss_sinks": ("GptOssConfig", {"sliding_window": 6, "num_local_experts": 4, "num_experts_per_tok": 2}),
}


@pytest.mark.parametrize("name", list(MODIFIER_MODELS))
def test_modifier_models_run_cupy_gqa_and_match_eager(name, calls):
    """Sliding windows (Mistral, Qwen2, Gemma 2's alternating layers), softcap (Gemma 2) and sinks
    (gpt-oss) run cupy_gqa's built-in modifiers, with no fallback, and match the model's eager attention."""
    cls_name, extra = MODIFIER_MODELS[name]
    config = _small(cls_name, **extra)
    if name == "gpt_oss_sinks":
        torch.manual_seed(1)
    ids = torch.randint(0, 101, (2, 19), generator=torch.Generator().manual_seed(6))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback
        ours, gen_ours = _logits_and_tokens(config, "cupy_gqa", ids)
    theirs, gen_theirs = _logits_and_tokens(config, "eager", ids)
    np.testing.assert_allclose(ours.numpy(), theirs.numpy(), rtol=0, atol=2e-5)
    assert torch.equal(gen_ours, gen_theirs)
    assert calls and {shape[2] for shape in calls} == {19, 1}  # prefill and decode steps ran cupy_gqa


@pytest.mark.parametrize("name", ["mistral_sliding_window", "gemma2_softcap_alternating"])
def test_training_with_modifiers_falls_back_and_matches_eager_gradients(name, calls):
    """cupy_gqa's backward takes no modifiers yet: with inputs that require grad, calls with a sliding
    window or softcap fall back (sdpa with the window's mask, or eager for softcap) with a warning,
    and the gradients are the model's eager ones (Gemma 2 caps every layer: none runs cupy_gqa)."""
    cls_name, extra = MODIFIER_MODELS[name]
    ids = torch.randint(0, 101, (2, 13), generator=torch.Generator().manual_seed(8))
    models = {}
    for attn in ("cupy_gqa", "eager"):
        torch.manual_seed(0)  # a config each: from_config records the implementation in it
        models[attn] = transformers.AutoModelForCausalLM.from_config(_small(cls_name, **extra), attn_implementation=attn).train()
    with pytest.warns(UserWarning, match="backward pass takes no modifiers yet"):
        loss_a = models["cupy_gqa"](ids, labels=ids).loss
    loss_b = models["eager"](ids, labels=ids).loss
    assert calls == []
    loss_a.backward()
    loss_b.backward()
    np.testing.assert_allclose(loss_a.item(), loss_b.item(), rtol=1e-5)
    for (pname, pa), pb in zip(models["cupy_gqa"].named_parameters(), models["eager"].parameters()):
        if pb.grad is None:
            assert pa.grad is None, pname
            continue
        np.testing.assert_allclose(pa.grad.numpy(), pb.grad.numpy(), rtol=1e-3, atol=1e-5, err_msg=pname)
    hf.register(strict=True)
    with pytest.raises(ValueError, match="cupy_gqa does not run calls with a sliding window, softcap or attention sinks"):
        models["cupy_gqa"](ids, labels=ids)


def test_sliding_window_with_padding_falls_back_to_sdpa_with_the_window():
    config = _small("MistralConfig", sliding_window=4)
    ids = torch.randint(1, 101, (2, 12), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    logits = {}
    for attn in ("cupy_gqa", "eager"):
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn).eval()
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            logits[attn] = model(ids, attention_mask=mask).logits
    real = mask.bool().numpy()  # padded positions' rows are arbitrary
    np.testing.assert_allclose(logits["cupy_gqa"].numpy()[real], logits["eager"].numpy()[real], rtol=0, atol=2e-5)


def test_softcap_with_padding_falls_back_to_eager_not_sdpa():
    """Gemma 2 caps its logits: with a padding mask the fallback is the model's eager attention (sdpa would drop the cap)."""
    config = _small("Gemma2Config", attn_logit_softcapping=5.0, sliding_window=4096)
    ids = torch.randint(1, 101, (2, 19), generator=torch.Generator().manual_seed(6))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    logits = {}
    for attn in ("cupy_gqa", "eager"):
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn).eval()
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            logits[attn] = model(ids, attention_mask=mask).logits
    np.testing.assert_allclose(logits["cupy_gqa"].numpy(), logits["eager"].numpy(), rtol=0, atol=1e-6)
