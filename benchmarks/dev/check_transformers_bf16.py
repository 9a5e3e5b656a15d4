"""Where a bf16 transformers model on cupy_gqa departs from float64 eager: each
attention call's inputs (shapes, strides, dtype), cupy_gqa's output on them
against torch's SDPA on the same tensors, per kernel family.

    python benchmarks/dev/check_transformers_bf16.py
"""
import sys

import torch
import transformers

sys.path.insert(0, "tests")
import cupy_gqa  # noqa: E402
import cupy_gqa.integrations.transformers as hf  # noqa: E402
from test_transformers import _model  # noqa: E402

hf.register()
DEV = "cuda" if torch.cuda.is_available() else "cpu"
ids = torch.randint(0, 101, (2, 40), generator=torch.Generator().manual_seed(5)).to(DEV)
ref = _model("llama", "eager", DEV, torch.float64)(ids).logits
attention = cupy_gqa.attention
for forced in (None, "rowwise", "hopper", "tiled"):
    seen = []

    def spy(q, k, v, **kw):
        if forced:
            kw["kernel"] = forced
        out = attention(q, k, v, **kw)
        torch.cuda.synchronize() if DEV == "cuda" else None
        want = torch.nn.functional.scaled_dot_product_attention(
            q.float(), k.float(), v.float(), is_causal=kw.get("causal", True), scale=kw.get("softmax_scale"), enable_gqa=True)
        got = out.float() if kw.get("layout") == "bhsd" else out.float().transpose(1, 2)
        err = float((got - want).norm() / want.norm())
        seen.append((tuple(q.shape), q.stride(), k.stride(), v.stride(), tuple(out.shape), out.stride(), q.dtype, err))
        return out

    cupy_gqa.attention = spy
    try:
        with torch.no_grad():
            a = _model("llama", "cupy_gqa", DEV, torch.bfloat16)(ids).logits.double()
        print(forced, "logits err", float((a - ref).norm() / ref.norm()))
    except Exception as e:
        print(forced, "failed:", type(e).__name__, str(e)[:200])
    finally:
        cupy_gqa.attention = attention
    for s in seen:
        print("  ", s)
b = _model("llama", "sdpa", DEV, torch.bfloat16)(ids).logits.double()
print("sdpa logits err", float((b - ref).norm() / ref.norm()))
print(transformers.__version__, torch.__version__)
