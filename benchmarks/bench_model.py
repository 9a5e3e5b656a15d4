"""End to end: a Llama-architecture model with attn_implementation "sdpa" against
"cupy_gqa" (cupy_gqa/integrations/transformers.py), same weights, same run.

    python benchmarks/bench_model.py [--out benchmarks/results] [--quick]
    python benchmarks/bench_model.py --config tiny --device cpu   # a smoke run, no GPU

The model is built from a config with random weights (no download):
  - full: hidden 2048, 16 layers, 32 query heads, 8 KV heads, head_dim 64,
    vocab 32000, bf16;
  - tiny: the same shape of model, small, float32.

Both models are built first and take turns in every measure (the order
reversed every other repetition), so that a drift of the host's speed during
the run reaches both alike. For each implementation it measures:
  - prefill: one forward of B4 S2048 (ms, median of the repetitions);
  - decode: greedy generate of 256 new tokens after a 512-token prompt, at
    B1 and at B8 (tokens/s = batch * new tokens / time), eager. It is measured
    twice:
      - warm: lengths seen before, every kernel and plan cached (cuDNN builds
        a plan per new shape);
      - cold: a prompt length not seen before, a new one for each model and
        repetition (511, 510, ...), so that each cold generation pays the
        first-time costs of its shapes itself.
  - graph: one decode step with a static cache captured in a CUDA graph, the
    replay's time (us per step). It is reported as failed, with the error,
    where the capture fails.

Writes <gpu>_model.json and .md (command, GPU, versions, date) under --out.
"""
from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
CONFIGS = {
    "full": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                 num_key_value_heads=8, head_dim=64, vocab_size=32000),
    "tiny": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=8,
                 num_key_value_heads=2, head_dim=16, vocab_size=1000),
}
IMPLS = ("sdpa", "cupy_gqa")


def build(torch, transformers, config_name: str, attn: str, device: str, dtype):
    config = transformers.LlamaConfig(max_position_embeddings=4096, **CONFIGS[config_name])
    torch.manual_seed(0)  # the same weights for every implementation
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn, dtype=dtype)
    return model.to(device).eval()


def sync(torch, device):
    if device != "cpu":
        torch.cuda.synchronize()


def timed(torch, device, fns: dict, reps: int) -> dict:
    """Seconds of each of reps calls of each fn of ``fns`` (name -> fn), after one
    warm-up call of each. The implementations take turns, the order reversed
    every other repetition, so that a drift of the host's or the GPU's speed
    during the run reaches them alike."""
    for fn in fns.values():
        fn()
    times = {name: [] for name in fns}
    names = list(fns)
    for r in range(reps):
        for name in names if r % 2 == 0 else names[::-1]:
            sync(torch, device)
            t0 = time.perf_counter()
            fns[name]()
            sync(torch, device)
            times[name].append(time.perf_counter() - t0)
    return times


def prompt(torch, batch: int, length: int, vocab: int, device: str, seed: int):
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(seed)).to(device)


def measure(torch, models: dict, args, device) -> dict:
    """Every measure of every implementation (name -> model), taking turns."""
    vocab = next(iter(models.values())).config.vocab_size
    res = {name: {} for name in models}

    def record(key, times, scale=None):
        for name, t in times.items():
            res[name][key] = statistics.median(t) * 1e3 if scale is None else scale / statistics.median(t)
        # each measure as it comes, so that a run stopped by a time limit still shows what it had
        print(f"{key}: " + ", ".join(f"{name} {res[name][key]:.3f}" for name in times), flush=True)

    with torch.no_grad():
        ids = prompt(torch, args.prefill_batch, args.prefill_len, vocab, device, 1)
        record("prefill_ms", timed(torch, device, {n: (lambda m=m: m(ids)) for n, m in models.items()}, args.reps))
        for batch in args.decode_batches:
            gen = dict(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False)
            ids = prompt(torch, batch, args.prompt_len, vocab, device, 2)
            fns = {n: (lambda m=m: m.generate(ids, **gen)) for n, m in models.items()}
            record(f"decode_b{batch}_warm_tok_s", timed(torch, device, fns, args.reps), batch * args.new_tokens)
            cold = {name: [] for name in models}
            names = list(models)
            for i in range(args.reps):
                # a prompt length that no run has seen, for each model its own: the first-time costs of a
                # shape that torch's libraries keep per process (cuBLAS's heuristics for the projections'
                # new row counts, cuDNN's plans) fall on every cold generation, not on whichever model
                # ran a length first
                for n, name in enumerate(names if i % 2 == 0 else names[::-1]):
                    length = args.prompt_len - 1 - (i * len(names) + n)
                    ids = prompt(torch, batch, length, vocab, device, 3 + i * len(names) + n)
                    sync(torch, device)
                    t0 = time.perf_counter()
                    models[name].generate(ids, **gen)
                    sync(torch, device)
                    cold[name].append(time.perf_counter() - t0)
            record(f"decode_b{batch}_cold_tok_s", cold, batch * args.new_tokens)
        if device != "cpu":
            replays = {}
            for name, model in models.items():
                made = graph_step(torch, model, args, device)
                if callable(made):
                    replays[name] = made
                else:
                    res[name]["graph_step_error"] = made
            if replays:
                for name, t in timed(torch, device, replays, max(20, args.reps)).items():
                    res[name]["graph_step_us"] = statistics.median(t) * 1e6
    return res


def graph_step(torch, model, args, device):
    """One decode step of batch 1 with a static cache, captured in a CUDA graph:
    the graph's replay, or the error of a capture that failed."""
    from transformers import StaticCache

    try:
        cache = StaticCache(config=model.config, max_cache_len=args.prompt_len + 64)
        ids = prompt(torch, 1, args.prompt_len, model.config.vocab_size, device, 4)
        pos = torch.arange(args.prompt_len, device=device)
        model(ids, past_key_values=cache, cache_position=pos, use_cache=True)  # prefill into the cache
        token = ids[:, -1:].clone()
        step_pos = torch.tensor([args.prompt_len], device=device)

        def step():
            return model(token, past_key_values=cache, cache_position=step_pos, use_cache=True).logits

        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                step()  # warm-up outside the capture: compiles, plans, allocator pools
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        graph.keep = (cache, token, step_pos)  # what the replay reads and writes
        return graph.replay
    except Exception as e:  # reported, not hidden: the capture of this implementation failed
        return f"{type(e).__name__}: {e}"[:300]


def environment(torch, transformers) -> dict:
    import cupy_gqa

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_attention import tree_commit  # the table's helper; imports no GPU stack

    return {
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(getattr(sys, "orig_argv", [sys.executable, *sys.argv])),
        "git_commit": tree_commit(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cudnn": torch.backends.cudnn.version() if torch.cuda.is_available() else None,
        "cupy_gqa": cupy_gqa.__version__,
    }


def render(env: dict, results: dict, args) -> str:
    lines = [f"# End to end, {args.config} Llama config, {env['gpu']}", ""]
    lines += [f"- {k}: `{v}`" for k, v in env.items()]
    lines += ["", f"Prefill B{args.prefill_batch} S{args.prefill_len}; greedy decode of {args.new_tokens} tokens after a "
              f"{args.prompt_len}-token prompt (warm: lengths seen before; cold: a new prompt length each time); "
              "one static-cache decode step replayed from a CUDA graph.", ""]
    keys = sorted({k for r in results.values() for k in r})
    lines += ["| measure | " + " | ".join(IMPLS) + " | cupy_gqa / sdpa |", "|---|" + "---|" * (len(IMPLS) + 1)]
    for k in keys:
        vals = [results[i].get(k) for i in IMPLS]
        ratio = ""
        if all(isinstance(v, float) for v in vals):
            ratio = f"{vals[1] / vals[0]:.3f}"
        lines.append(f"| {k} | " + " | ".join("—" if v is None else (f"{v:.3f}" if isinstance(v, float) else str(v)) for v in vals)
                     + f" | {ratio} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", choices=CONFIGS, default="full")
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", type=Path, default=REPO_ROOT / "benchmarks" / "results")
    p.add_argument("--quick", action="store_true", help="1 repetition, 32 new tokens")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--prefill-batch", type=int, default=4)
    p.add_argument("--prefill-len", type=int, default=2048)
    p.add_argument("--decode-batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8])
    args = p.parse_args(argv)
    if args.quick:
        args.reps, args.new_tokens = 1, 32

    import torch
    import transformers

    from cupy_gqa.integrations import transformers as cupy_gqa_hf

    cupy_gqa_hf.register()
    dtype = torch.bfloat16 if args.config == "full" else torch.float32
    models = {attn: build(torch, transformers, args.config, attn, args.device, dtype) for attn in IMPLS}
    results = measure(torch, models, args, args.device)
    for attn in IMPLS:
        print(attn, json.dumps(results[attn]), flush=True)
    del models
    env = environment(torch, transformers)
    from bench_attention import gpu_tag

    tag = "cpu" if args.device == "cpu" else gpu_tag(env["gpu"])  # a CPU run on a GPU machine is still "cpu"
    args.out.mkdir(parents=True, exist_ok=True)
    doc = {**env, "config": args.config, "results": results}
    (args.out / f"{tag}_model.json").write_text(json.dumps(doc, indent=2) + "\n")
    (args.out / f"{tag}_model.md").write_text(render(env, results, args))
    print(render(env, results, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
