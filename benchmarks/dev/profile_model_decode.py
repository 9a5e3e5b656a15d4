#!/usr/bin/env python3
"""Where a transformers decode step spends its host time, sdpa against cupy_gqa:
greedy generation under cProfile, after a warm-up generation of the same length.

    python3 benchmarks/dev/profile_model_decode.py [--config full] [--batch 1] [--new-tokens 32]
    python3 benchmarks/dev/profile_model_decode.py --events [--batch 1]       # GPU time of the attention calls
    python3 benchmarks/dev/profile_model_decode.py --ablate [--batch 1]       # mask and attention functions swapped
    python3 benchmarks/dev/profile_model_decode.py --cold [--batch 1]          # a new prompt length, as bench_model's cold
    python3 benchmarks/dev/profile_model_decode.py --config tiny --device cpu   # a smoke run

For each implementation: the wall time per token, the calls per token of the
attention function, and of cupy_gqa's full path (api.attention's planning:
_plan.choose_kernel) against its repeat path (_fast entries found), then the
functions with the most time of their own. With --events, no profiler: the
wall time per token, then again with CUDA events around every attention call
(the stream time between them: the kernels and any gap the host leaves), the
attention calls' share of the step, and the host time spent inside them.
With --ablate, no profiler: the wall time per token for each pairing of the
mask function (transformers' sdpa mask, or cupy_gqa's) with the attention
function (sdpa's, or cupy_gqa's), which says which of the two holds a gap.
The model is bench_model.py's (random
weights, no download). Notes: benchmarks/NOTES_overhead.md.
"""
import argparse
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import bench_model  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", choices=bench_model.CONFIGS, default="full")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--events", action="store_true", help="CUDA events around the attention calls, no profiler")
    ap.add_argument("--ablate", action="store_true", help="each mask function with each attention function")
    ap.add_argument("--cold", action="store_true",
                    help="profile a generation whose prompt is one token shorter than the warm-up's (bench_model's cold)")
    args = ap.parse_args()
    import torch
    import transformers

    from cupy_gqa import _compile
    from cupy_gqa.integrations import transformers as cupy_gqa_hf

    cupy_gqa_hf.register()
    dtype = torch.bfloat16 if args.config == "full" else torch.float32
    gen = dict(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False)
    if args.ablate:
        return ablate(torch, transformers, cupy_gqa_hf, gen, args)
    for impl in bench_model.IMPLS:
        model = bench_model.build(torch, transformers, args.config, impl, args.device, dtype)
        ids = bench_model.prompt(torch, args.batch, args.prompt_len, model.config.vocab_size, args.device, 2)
        if args.events:
            attention_events(torch, model, ids, gen, impl, args)
            del model
            continue
        with torch.no_grad():
            model.generate(ids, **gen)  # warm-up: the same lengths as the profiled run (--cold: one more)
            bench_model.sync(torch, args.device)
            if args.cold:
                ids = bench_model.prompt(torch, args.batch, args.prompt_len - 1, model.config.vocab_size, args.device, 3)
            kernels_before = len(_compile._kernels)
            profiler = cProfile.Profile()
            t0 = time.perf_counter()
            profiler.enable()
            model.generate(ids, **gen)
            bench_model.sync(torch, args.device)
            profiler.disable()
            wall = time.perf_counter() - t0
        stats = pstats.Stats(profiler)
        calls = {f"{Path(f).name}:{name}": n for (f, _, name), (n, *_rest) in stats.stats.items()}  # primitive calls
        per_token = lambda key: sum(n for k, n in calls.items() if k.endswith(key)) / args.new_tokens  # noqa: E731
        print(f"== {impl}: {1e3 * wall / args.new_tokens:.2f} ms per token (under the profiler), batch {args.batch}")
        print(f"   per token: attention_forward {per_token('transformers.py:attention_forward'):.1f}, "
              f"sdpa_attention_forward {per_token('sdpa_attention.py:sdpa_attention_forward'):.1f}, "
              f"cupy_gqa full path (choose_kernel) {per_token('_plan.py:choose_kernel'):.1f}, "
              f"plans made {per_token('_plan.py:plan_tiled') + per_token('_plan.py:plan_decode') + per_token('_plan.py:plan_hopper'):.1f}; "
              f"kernels compiled or loaded in the run: {len(_compile._kernels) - kernels_before}")
        out = io.StringIO()
        pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(args.top)
        print("\n".join(line for line in out.getvalue().splitlines() if line.strip())[-4000:])
        del model


def attention_events(torch, model, ids, gen, impl, args):
    """Wall time per token of a greedy generation, then the stream time of its
    attention calls (CUDA events around each) against the whole step's."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    with torch.no_grad():
        model.generate(ids, **gen)  # warm-up: the same lengths as the timed runs
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        model.generate(ids, **gen)
        torch.cuda.synchronize()
        plain = (time.perf_counter() - t0) / args.new_tokens
        inner, marks = ALL_ATTENTION_FUNCTIONS[impl], []

        def timed(*a, **kw):
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            t = time.perf_counter()
            result = inner(*a, **kw)
            t = time.perf_counter() - t
            stop.record()
            marks.append((start, stop, a[1].shape, t))
            return result

        ALL_ATTENTION_FUNCTIONS[impl] = timed
        try:
            first, last = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            first.record()
            t0 = time.perf_counter()
            model.generate(ids, **gen)
            last.record()
            torch.cuda.synchronize()
            wrapped = (time.perf_counter() - t0) / args.new_tokens
        finally:
            del ALL_ATTENTION_FUNCTIONS[impl]
    decode = [(s.elapsed_time(e), shape) for s, e, shape, _ in marks if shape[2] == 1]
    host = sorted(t for *_, shape, t in marks if shape[2] == 1)
    total = first.elapsed_time(last)
    per_call = sorted(ms for ms, _ in decode)
    print(f"== {impl}: {1e3 * plain:.2f} ms per token ({1e3 * wrapped:.2f} with the events), batch {args.batch}")
    print(f"   attention calls {len(marks)} ({len(decode)} of one query); one-query calls' stream time: median "
          f"{1e3 * per_call[len(per_call) // 2]:.1f} us, mean {1e3 * sum(per_call) / len(per_call):.1f} us, "
          f"{sum(per_call) / total:.1%} of the generation's {total:.1f} ms; host time inside a call: median "
          f"{1e6 * host[len(host) // 2]:.1f} us, mean {1e6 * sum(host) / len(host):.1f} us")


def ablate(torch, transformers, cupy_gqa_hf, gen, args):
    """Wall time per token of a greedy generation for each (mask, attention) pairing."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    masks = {"sdpa": sdpa_mask, "cupy_gqa": cupy_gqa_hf._mask}
    forwards = {"sdpa": sdpa_attention_forward, "cupy_gqa": cupy_gqa_hf.attention_forward}
    dtype = torch.bfloat16 if args.config == "full" else torch.float32
    for rounds in range(2):
        for mask_name, mask in masks.items():
            for fwd_name, forward in forwards.items():
                name = f"ablate_{mask_name}_mask_{fwd_name}_attention"
                AttentionInterface.register(name, forward)
                AttentionMaskInterface.register(name, mask)
                model = bench_model.build(torch, transformers, args.config, name, args.device, dtype)
                ids = bench_model.prompt(torch, args.batch, args.prompt_len, model.config.vocab_size, args.device, 2)
                with torch.no_grad():
                    model.generate(ids, **gen)  # warm-up: the same lengths
                    bench_model.sync(torch, args.device)
                    t0 = time.perf_counter()
                    model.generate(ids, **gen)
                    bench_model.sync(torch, args.device)
                    wall = (time.perf_counter() - t0) / args.new_tokens
                print(f"round {rounds}: mask {mask_name:8s} attention {fwd_name:8s} {1e3 * wall:.2f} ms per token, "
                      f"batch {args.batch}", flush=True)
                del model


if __name__ == "__main__":
    main()
