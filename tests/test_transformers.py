"""cupy_gqa as a transformers attention implementation (cupy_gqa/integrations/transformers.py).

On the CPU the calls run the NumPy backend; the GPU tests run the kernels.
Each model is built from a small config with random weights (no download) and
compared with the same weights under attn_implementation="sdpa".
"""
import types
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


def test_static_cache_decode_steps_run_cupy_gqa_while_a_cuda_graph_is_captured(calls, monkeypatch):
    """transformers counts a CUDA graph capture as tracing (its is_tracing); the
    decode step into a static cache still runs cupy_gqa then (CachedKeys reads
    nothing on the host). The capture is simulated: torch reports one in
    progress on every call of the steps, the prefill before them included."""
    ids = torch.randint(0, 101, (2, 13), generator=torch.Generator().manual_seed(4))
    ours = _model("llama", "cupy_gqa")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with torch.no_grad():
        tokens_a, logits_a = _static_decode_steps(ours, ids, 4)
        ours_calls = list(calls)
        monkeypatch.undo()
        tokens_b, logits_b = _static_decode_steps(_model("llama", "sdpa"), ids, 4)
    assert torch.equal(tokens_a, tokens_b)
    assert (logits_a - logits_b).abs().max() < 1e-4
    # the prefill falls back (its keys would be cut on the host), the 4 steps of 2 layers run cupy_gqa
    assert ours_calls == [(2, 4, 1, 16)] * 8


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


def test_attention_output_is_in_the_models_memory_order():
    """The result comes back as transformers' (batch, seqlen, heads, head_dim) in that
    memory order (as sdpa's kernels write theirs), so the model's reshape to
    (batch, seqlen, hidden) is a view, not a copy; with grad, autograd's own result."""
    import cupy_gqa

    module = types.SimpleNamespace(is_causal=True, training=False)
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(2, h, 9, 16, generator=g) for h in (6, 2, 2))
    out, _ = hf.attention_forward(module, q, k, v, None, scaling=0.25)
    assert out.shape == (2, 9, 6, 16) and out.is_contiguous()
    torch.testing.assert_close(out, cupy_gqa.attention(q, k, v, layout="bhsd", softmax_scale=0.25).transpose(1, 2), rtol=0, atol=0)
    q.requires_grad_()
    out, _ = hf.attention_forward(module, q, k, v, None, scaling=0.25)
    assert out.shape == (2, 9, 6, 16) and out.grad_fn is not None


def test_unpadded_generate_reads_its_mask_once_per_step(calls, monkeypatch):
    """generate passes an all-ones mask with every step of a dynamic cache: the
    mask function finds it unpadded with one read (no PaddedBatch), and the
    tokens are sdpa's."""
    from cupy_gqa.integrations import transformers as integration

    ids = torch.randint(0, 101, (2, 11), generator=torch.Generator().manual_seed(3))
    ours, theirs = _model("llama", "cupy_gqa"), _model("llama", "sdpa")
    monkeypatch.setattr(integration.PaddedBatch, "of", classmethod(lambda *a: pytest.fail("PaddedBatch.of called")))
    with torch.no_grad():
        gen_a = ours.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False)
        gen_b = theirs.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False)
    assert torch.equal(gen_a, gen_b)
    assert len(calls) == 2 * 4  # the prefill and 3 steps, 2 layers each, all on cupy_gqa


def test_static_cache_prefill_and_decode_match_sdpa(calls):
    ids = torch.randint(0, 101, (1, 17), generator=torch.Generator().manual_seed(2))
    ours, theirs = _model("llama", "cupy_gqa"), _model("llama", "sdpa")
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # decode steps with a static cache carry a whole mask: they fall back
        gen_a = ours.generate(ids, max_new_tokens=5, do_sample=False, cache_implementation="static")
        gen_b = theirs.generate(ids, max_new_tokens=5, do_sample=False, cache_implementation="static")
    assert torch.equal(gen_a, gen_b)
    assert [shape[2] for shape in calls] == [17, 17]  # the prefill into the empty static cache ran cupy_gqa


def _static_decode_steps(model, ids, steps, device="cpu", graph=False):
    """A prompt prefilled into a static cache, then greedy decode steps of one
    token with cache_position as a tensor and no attention_mask (a serving
    loop's, and the one a CUDA graph captures); with graph, the step is
    captured once and replayed, its token and position updated in place."""
    cache = transformers.StaticCache(config=model.config, max_cache_len=ids.shape[1] + steps + 3)
    n = ids.shape[1]
    prefill = lambda: model(ids, past_key_values=cache, cache_position=torch.arange(n, device=device), use_cache=True)  # noqa: E731
    token = prefill().logits[:, -1:].argmax(-1)
    pos = torch.tensor([n], device=device)
    step = lambda: model(token, past_key_values=cache, cache_position=pos, use_cache=True).logits  # noqa: E731
    if graph:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            step()  # warm-up (compiles, plans)
        torch.cuda.current_stream().wait_stream(side)
        # the static cache counts its own length (the query offset, advanced in place by every step):
        # back to the prompt alone, in place, so the graph's addresses stay those of the cache
        cache.reset()
        prefill()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = step()
        step = lambda: g.replay() or out  # noqa: E731
    seen, all_logits = [token], []
    for _ in range(steps):
        step_logits = step()[:, -1].clone()
        all_logits.append(step_logits)
        token.copy_(step_logits.argmax(-1, keepdim=True))
        pos += 1
        seen.append(token.clone())
    return torch.cat(seen, 1), torch.stack(all_logits, 1)


def test_static_cache_decode_steps_without_a_mask_run_cupy_gqa_and_match_sdpa(calls):
    """A static cache's decode steps, called as a serving loop calls them (no
    attention_mask, cache_position a tensor): transformers asks for the whole
    mask there, and cupy_gqa runs them with seqlens_k = position + 1 made on
    the device (CachedKeys) over the whole preallocated cache."""
    ids = torch.randint(0, 101, (2, 13), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        tokens_a, logits_a = _static_decode_steps(_model("llama", "cupy_gqa"), ids, 6)
        ours = list(calls)
        tokens_b, logits_b = _static_decode_steps(_model("llama", "sdpa"), ids, 6)
    assert torch.equal(tokens_a, tokens_b)
    assert (logits_a - logits_b).abs().max() < 1e-4
    # the prefill (cut to its 13 keys), then 6 steps, 2 layers each, over the whole cache
    assert ours == [(2, 4, 13, 16)] * 2 + [(2, 4, 1, 16)] * 12


def test_cached_keys_mask_is_transformers_mask():
    """CachedKeys' fallback mask is transformers' own, and its seqlens_k sees
    the keys up to the query's position."""
    from transformers.masking_utils import causal_mask_function, sdpa_mask

    kwargs = dict(batch_size=3, q_length=1, kv_length=20, q_offset=torch.tensor(7), kv_offset=0,
                  mask_function=causal_mask_function, attention_mask=None, allow_is_causal_skip=False)  # fmt: skip
    cached = hf._mask(**kwargs)
    assert isinstance(cached, hf.CachedKeys)
    assert cached.seqlens_k.tolist() == [8, 8, 8] and cached.seqlens_k.dtype == torch.int32
    full = sdpa_mask(**kwargs)
    assert torch.equal(cached.mask(), full) and full[0, 0, 0].tolist() == [j <= 7 for j in range(20)]
    # not for more than one query, nor for a model that adds ALiBi to the mask tensor itself (Falcon)
    assert not isinstance(hf._mask(**{**kwargs, "q_length": 2}), hf.CachedKeys)
    alibi = type("Config", (), {"alibi": True})()
    assert torch.equal(hf._mask(**{**kwargs, "config": alibi}), full)


@pytest.fixture
def leftpads(monkeypatch):
    """(q shape, k shape, cache_leftpad as a list or None) of each call that reaches cupy_gqa.attention."""
    import cupy_gqa

    seen, attention = [], cupy_gqa.attention

    def spy(*a, **kw):
        pad = kw.get("cache_leftpad")
        seen.append((tuple(a[0].shape), tuple(a[1].shape), None if pad is None else pad.tolist()))
        return attention(*a, **kw)

    monkeypatch.setattr(cupy_gqa, "attention", spy)
    return seen


def _left_padded_batch(seed):
    """Three prompts of 12 positions: unpadded, 4 of left padding, 11 (one real token)."""
    ids = torch.randint(1, 101, (3, 12), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    mask[2, :11] = 0
    return ids, mask


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_left_padded_batch_and_batched_generate_run_cupy_gqa_and_match_eager(arch, leftpads):
    """A left-padded batch runs cupy_gqa with cache_leftpad (no fallback): the logits of
    its real tokens are eager attention's, and batched generation gives eager's tokens."""
    ids, mask = _left_padded_batch(11)
    ours, theirs = _model(arch, "cupy_gqa"), _model(arch, "eager")
    real = mask.bool().numpy()
    with torch.no_grad():
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no fallback
            a = ours(ids, attention_mask=mask).logits
        b = theirs(ids, attention_mask=mask).logits
        assert leftpads == [((3, 4, 12, 16), (3, 2, 12, 16), [0, 4, 11])] * 2  # both layers, on cupy_gqa
        np.testing.assert_allclose(a.numpy()[real], b.numpy()[real], rtol=0, atol=2e-5)
        # the padding changes the padded rows' logits: attending to the padding would show
        unpadded = theirs(ids[1:2, 4:]).logits
        np.testing.assert_allclose(b.numpy()[1, 4:], unpadded.numpy()[0], rtol=0, atol=2e-5)
        leftpads.clear()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            gen_a = ours.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
        gen_b = theirs.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(gen_a, gen_b)
    # the prefill and 5 decode steps, every layer on cupy_gqa, with the prompt's left padding
    assert [(q[2], k[2], pad) for q, k, pad in leftpads] == [
        (12 if step == 0 else 1, 12 + step, [0, 4, 11]) for step in range(6) for _ in range(2)
    ]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_left_padded_static_cache_prefill_runs_cupy_gqa_and_generate_matches_eager(arch, leftpads):
    """With a static cache the prefill's keys are cut to the prompt (a view) and its left
    padding is cache_leftpad: the prefill runs cupy_gqa (the decode steps, whose whole mask
    transformers asks for, fall back) and generation gives eager's tokens."""
    ids, mask = _left_padded_batch(12)
    ours, theirs = _model(arch, "cupy_gqa"), _model(arch, "eager")
    with torch.no_grad():
        with pytest.warns(UserWarning, match="a static cache's decode step"):
            gen_a = ours.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0,
                                  cache_implementation="static")  # fmt: skip
        gen_b = theirs.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0,
                                cache_implementation="static")  # fmt: skip
    assert torch.equal(gen_a, gen_b)
    assert leftpads == [((3, 4, 12, 16), (3, 2, 12, 16), [0, 4, 11])] * 2


def test_right_padded_prompt_runs_cupy_gqa_and_matches_eager_on_its_real_tokens(leftpads):
    """A right-padded prompt (training batches): no real token sees a later key, so the causal
    pattern alone gives eager's logits on the real tokens, and no cache_leftpad is needed."""
    ids = torch.randint(1, 101, (3, 12), generator=torch.Generator().manual_seed(13))
    mask = torch.ones_like(ids)
    mask[1, 7:] = 0
    mask[2, 1:] = 0
    ours, theirs = _model("llama", "cupy_gqa"), _model("llama", "eager")
    with torch.no_grad():
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            a = ours(ids, attention_mask=mask).logits
        b = theirs(ids, attention_mask=mask).logits
    assert leftpads == [((3, 4, 12, 16), (3, 2, 12, 16), None)] * 2
    real = mask.bool().numpy()
    np.testing.assert_allclose(a.numpy()[real], b.numpy()[real], rtol=0, atol=2e-5)


def test_padding_inside_a_sequence_falls_back_once_with_a_warning_and_strict_raises(leftpads):
    """Padding that a real token would see (here: between real tokens) is no cache_leftpad: the
    call falls back to sdpa with the full mask, and strict raises."""
    ids = torch.randint(1, 101, (2, 12), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    mask[1, 5:7] = 0  # a hole
    ours, theirs = _model("llama", "cupy_gqa"), _model("llama", "eager")
    with torch.no_grad():
        with pytest.warns(UserWarning, match="calls with an attention mask .padding inside a sequence.* sdpa"):
            a = ours(ids, attention_mask=mask).logits
        b = theirs(ids, attention_mask=mask).logits
        assert leftpads == []
        real = mask.bool().numpy()
        np.testing.assert_allclose(a.numpy()[real], b.numpy()[real], rtol=0, atol=2e-5)
        hf.register(strict=True)
        with pytest.raises(ValueError, match="cupy_gqa does not run calls with an attention mask"):
            ours(ids, attention_mask=mask)


def test_left_padding_with_grad_falls_back_and_matches_sdpa_gradients(leftpads):
    """cache_leftpad has no backward pass: a left-padded batch whose inputs need grad falls back
    to sdpa with the full mask, and gives its gradients."""
    ids, mask = _left_padded_batch(14)
    labels = ids.masked_fill(mask == 0, -100)
    ours, theirs = _model("llama", "cupy_gqa").train(), _model("llama", "sdpa").train()
    with pytest.warns(UserWarning, match="left padding and inputs that require grad"):
        loss_a = ours(ids, attention_mask=mask, labels=labels).loss
    loss_b = theirs(ids, attention_mask=mask, labels=labels).loss
    assert leftpads == []
    loss_a.backward()
    loss_b.backward()
    np.testing.assert_allclose(loss_a.item(), loss_b.item(), rtol=1e-5)
    for (name, pa), pb in zip(ours.named_parameters(), theirs.parameters()):
        np.testing.assert_allclose(pa.grad.numpy(), pb.grad.numpy(), rtol=1e-3, atol=1e-5, err_msg=name)


def _visible(padding, q_offset, q_length):
    """transformers' rule, by brute force: visible[b, t, j] = j <= q_offset + t and padding[b, j]."""
    kv = padding.shape[1]
    pos = q_offset + np.arange(q_length)
    return (np.arange(kv)[None, None, :] <= pos[None, :, None]) & padding[:, None, :]


@pytest.mark.parametrize("seed", range(6))
def test_padded_batch_is_transformers_mask_on_every_real_token(seed):
    """PaddedBatch.of against the brute-force mask on random padding (left, right, a static tail,
    holes, rows of padding only): where it returns a PaddedBatch, every query whose own token is
    real sees exactly cache_leftpad[b] <= j <= its position, j < num_keys; it returns None exactly
    when some real token would see padding after its row's first real key."""
    rng = np.random.default_rng(seed)

    def cases():
        # decode steps whose own tokens are padding, with a hole before them (expressible), or one real (not)
        yield np.array([[1, 0, 1, 0, 0]], dtype=bool), 3, 2
        yield np.array([[1, 0, 1, 0, 1]], dtype=bool), 3, 2
        for _ in range(40):
            batch, kv = int(rng.integers(1, 4)), int(rng.integers(1, 12))
            q_length = int(rng.integers(1, kv + 1))
            padding = np.zeros((batch, kv), dtype=bool)
            for b in range(batch):
                lo, hi = sorted(int(x) for x in rng.integers(0, kv + 1, 2))
                padding[b, lo:hi] = True
                if rng.random() < 0.3:
                    padding[b, rng.integers(0, kv)] ^= True  # a hole, or an extra key
            yield padding, int(rng.integers(0, kv - q_length + 1)), q_length

    for padding, q_offset, q_length in cases():
        batch, kv = padding.shape
        torch_offset = torch.tensor([q_offset]) if rng.random() < 0.5 else q_offset  # (a static cache's: a tensor)
        padded = hf.PaddedBatch.of(torch.from_numpy(padding), q_length, torch_offset, {})
        vis = _visible(padding, q_offset, q_length)
        pos = q_offset + np.arange(q_length)
        real = padding[:, pos]  # (batch, q_length): the query's own token is real
        j = np.arange(kv)
        first = np.array([np.argmax(r[: q_offset + q_length]) if r[: q_offset + q_length].any() else q_offset + q_length
                          for r in padding])  # fmt: skip
        ours = (j[None, None, :] >= first[:, None, None]) & (j[None, None, :] <= pos[None, :, None])
        expressible = bool(np.all((ours == vis)[real]))
        assert (padded is not None) == expressible, (padding, q_offset, q_length)
        if padded is not None:
            assert padded.num_keys == q_offset + q_length
            pads = np.zeros(batch, dtype=int) if padded.cache_leftpad is None else padded.cache_leftpad.numpy()
            assert padded.cache_leftpad is None or padded.cache_leftpad.dtype == torch.int32
            np.testing.assert_array_equal(pads, first)


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


@pytest.mark.gpu
@pytest.mark.skipif(not gpu_available(), reason="no CUDA device")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gpu_static_cache_decode_step_in_a_cuda_graph(dtype, calls):
    """The static-cache decode step captured in a CUDA graph runs cupy_gqa
    (seqlens_k made on the device from the cache position), and its replays,
    with the position moved on, match the same steps run eagerly and sdpa's
    (float32: the same tokens, logits within 1e-4; bfloat16: the first step's
    logits within bfloat16's error, later steps may take other tokens)."""
    dt = getattr(torch, dtype)
    ids = torch.randint(0, 101, (2, 29), generator=torch.Generator().manual_seed(6)).cuda()
    ours = _model("llama", "cupy_gqa", "cuda", dt)
    with torch.no_grad():
        tokens_g, logits_g = _static_decode_steps(ours, ids, 8, "cuda", graph=True)
        # the warm-up step and the captured one ran cupy_gqa (2 layers each), not a fallback
        assert calls.count((2, 4, 1, 16)) == 4, calls
        tokens_e, logits_e = _static_decode_steps(ours, ids, 8, "cuda")
        tokens_s, logits_s = _static_decode_steps(_model("llama", "sdpa", "cuda", dt), ids, 8, "cuda")
    if dt == torch.float32:
        assert torch.equal(tokens_g, tokens_e) and torch.equal(tokens_e, tokens_s)
        assert (logits_g - logits_e).abs().max() < 1e-4 and (logits_e - logits_s).abs().max() < 1e-4
    else:
        first = [x[:, 0].float() for x in (logits_g, logits_e, logits_s)]
        scale = first[2].abs().max()
        assert (first[0] - first[1]).abs().max() <= 0.05 * scale and (first[1] - first[2]).abs().max() <= 0.05 * scale


@pytest.mark.gpu
@pytest.mark.skipif(not gpu_available(), reason="no CUDA device")
def test_gpu_left_padded_batch_matches_eager_float64(leftpads):
    """A left-padded bfloat16 batch on the kernels (cache_leftpad read on the device): the real
    tokens' logits are as close to float64 eager attention as sdpa's, and generation runs cupy_gqa."""
    ids, mask = _left_padded_batch(15)
    ids, mask = ids.cuda(), mask.cuda()
    ours, theirs = _model("llama", "cupy_gqa", "cuda", torch.bfloat16), _model("llama", "sdpa", "cuda", torch.bfloat16)
    real = mask.bool()
    with torch.no_grad():
        a = ours(ids, attention_mask=mask).logits.double()[real]
        b = theirs(ids, attention_mask=mask).logits.double()[real]
        # float64 eager attention turns a left-padded batch into NaN (its softmax runs in float32, where
        # the float64 mask value is -inf, so the padding's rows are NaN and then their keys): the
        # reference is each prompt alone, its real tokens at the positions they have in the batch
        m64 = _model("llama", "eager", "cuda", torch.float64)
        pos = torch.arange(ids.shape[1], device=ids.device)
        ref = torch.cat([m64(ids[i : i + 1, real[i]], position_ids=pos[real[i]][None]).logits[0] for i in range(len(ids))])
        assert leftpads and all(pad == [0, 4, 11] for _, _, pad in leftpads)
        ours.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert len(leftpads) == 2 * (1 + 3)
    err_ours = float((a - ref).norm() / ref.norm())
    err_theirs = float((b - ref).norm() / ref.norm())
    assert err_theirs < 2e-2, err_theirs  # the reference is the same model
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


@pytest.mark.parametrize("name", list(MODIFIER_MODELS))
def test_training_with_modifiers_runs_cupy_gqa_and_matches_eager_gradients(name, calls):
    """With inputs that require grad, sliding windows, softcap and sinks run cupy_gqa and its
    backward (no fallback, strict), and every parameter's gradient is the model's eager one: the
    sinks' (gpt-oss learns them) included."""
    cls_name, extra = MODIFIER_MODELS[name]
    ids = torch.randint(0, 101, (2, 13), generator=torch.Generator().manual_seed(8))
    models = {}
    for attn in ("cupy_gqa", "eager"):
        torch.manual_seed(0)  # a config each: from_config records the implementation in it
        models[attn] = transformers.AutoModelForCausalLM.from_config(_small(cls_name, **extra), attn_implementation=attn).train()
    hf.register(strict=True)
    try:
        loss_a = models["cupy_gqa"](ids, labels=ids).loss
    finally:
        hf.register()
    loss_b = models["eager"](ids, labels=ids).loss
    assert calls and all(shape[2] == 13 for shape in calls)  # every layer ran cupy_gqa
    loss_a.backward()
    loss_b.backward()
    np.testing.assert_allclose(loss_a.item(), loss_b.item(), rtol=1e-5)
    checked = 0
    for (pname, pa), pb in zip(models["cupy_gqa"].named_parameters(), models["eager"].parameters()):
        if pb.grad is None:
            assert pa.grad is None, pname
            continue
        np.testing.assert_allclose(pa.grad.numpy(), pb.grad.numpy(), rtol=1e-3, atol=1e-5, err_msg=pname)
        checked += "sinks" in pname
    assert checked == (2 if name == "gpt_oss_sinks" else 0)  # both layers' sinks got their gradient


@pytest.mark.parametrize("name", list(MODIFIER_MODELS))
def test_sliding_window_models_with_left_padding_run_on_cupy_gqa(name, calls):
    """A left-padded batch of a sliding-window model (Mistral, Qwen2, Gemma 2's alternating layers,
    gpt-oss with sinks) runs every layer on cupy_gqa, the window's with cache_leftpad too (strict: no
    fallback), as the model's eager attention computes them; greedy generation from it as eager's."""
    cls_name, extra = MODIFIER_MODELS[name]
    config = _small(cls_name, **extra)
    ids = torch.randint(1, 101, (2, 12), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    out = {}
    hf.register(strict=True)
    for attn in ("cupy_gqa", "eager"):
        torch.manual_seed(1)
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn).eval()
        with torch.no_grad():
            logits = model(ids, attention_mask=mask).logits
            gen = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
        out[attn] = logits, gen
    assert calls and len(calls) >= 2 * config.num_hidden_layers  # the prefills' layers and the decode steps
    real = mask.bool().numpy()  # padded positions' rows are arbitrary
    np.testing.assert_allclose(out["cupy_gqa"][0].numpy()[real], out["eager"][0].numpy()[real], rtol=0, atol=2e-5)
    assert torch.equal(out["cupy_gqa"][1], out["eager"][1])


def test_a_sliding_mask_the_call_does_not_match_falls_back():
    """A windowed PaddedBatch whose attention call passes another sliding_window (or none) is not run
    with either window: it falls back to transformers' mask."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 4, 6, 8) for _ in range(3))
    batch = hf.PaddedBatch(torch.tensor([1], dtype=torch.int32), 6, {"batch_size": 1, "q_length": 6, "kv_length": 6}, window=3)
    module = types.SimpleNamespace(is_causal=True)
    assert "sliding_window" in hf._unsupported(module, q, k, v, batch, 0.0, {"sliding_window": 4})
    assert "sliding_window" in hf._unsupported(module, q, k, v, batch, 0.0, {})
    assert hf._unsupported(module, q, k, v, batch, 0.0, {"sliding_window": 3}) is None


def test_sliding_window_of_reads_the_mask_function():
    """Only transformers' sliding-window causal mask of local_size is taken as one."""
    from transformers import masking_utils as mu

    assert hf._sliding_window_of(mu.sliding_window_causal_mask_function(5), 5) == 5
    assert hf._sliding_window_of(mu.sliding_window_causal_mask_function(5), 6) is None
    assert hf._sliding_window_of(mu.causal_mask_function, 5) is None
    if hasattr(mu, "sliding_window_bidirectional_mask_function"):
        assert hf._sliding_window_of(mu.sliding_window_bidirectional_mask_function(5), 5) is None
    assert hf._sliding_window_of(mu.chunked_causal_mask_function(5, torch.zeros(1, dtype=torch.long)), 5) is None
    assert hf._sliding_window_of(lambda *a: True, 5) is None


def test_softcap_with_left_padding_runs_on_cupy_gqa():
    """Gemma 2 caps its logits: on a left-padded batch its global layers run on cupy_gqa with the softcap
    and cache_leftpad (strict: no fallback), as the model's eager attention computes them."""
    config = _small("Gemma2Config", attn_logit_softcapping=5.0, sliding_window=4096,
                    layer_types=["full_attention", "full_attention"])
    ids = torch.randint(1, 101, (2, 19), generator=torch.Generator().manual_seed(6))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    logits = {}
    hf.register(strict=True)
    for attn in ("cupy_gqa", "eager"):
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn).eval()
        with torch.no_grad():
            logits[attn] = model(ids, attention_mask=mask).logits
    real = mask.bool().numpy()  # padded positions' rows are arbitrary
    np.testing.assert_allclose(logits["cupy_gqa"].numpy()[real], logits["eager"].numpy()[real], rtol=0, atol=2e-5)


def test_sinks_are_found_wherever_a_module_keeps_them():
    """The attention call reads a module's sinks without nn.Module's __getattr__ (a
    parameter, a buffer, a plain attribute, a property, or an object that is no Module),
    and finds none on a module without them."""
    sinks = torch.randn(4)
    as_parameter, as_buffer, as_attribute, plain = (torch.nn.Module() for _ in range(4))
    as_parameter.sinks = torch.nn.Parameter(sinks.clone())
    as_buffer.register_buffer("sinks", sinks.clone())
    as_attribute.__dict__["sinks"] = sinks
    class WithProperty(torch.nn.Module):
        @property
        def sinks(self):
            return sinks

    for module in (as_parameter, as_buffer, as_attribute, WithProperty(), types.SimpleNamespace(sinks=sinks)):
        assert torch.equal(hf._sinks(module), sinks)
    assert hf._sinks(plain) is None and hf._sinks(types.SimpleNamespace()) is None
