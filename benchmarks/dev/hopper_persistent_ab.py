#!/usr/bin/env python3
"""Persistent hopper CTAs (one per SM, tiles from the stream's counter) against
one CTA per tile, beside torch's cuDNN, on the table's prefill rows and other
real-model shapes; the two hopper modes must agree bit for bit.

Times: bench_attention's Timer (CUDA events, L2 flushed before each rep,
median), the three implementations in turn, twice, the better median of each.

    python3 benchmarks/dev/hopper_persistent_ab.py [--reps 30] [--cases H1,H3]
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import bench_attention as ba  # noqa: E402

# (name, batch, seqlen, num_q_heads, num_kv_heads, head_dim, dtype, causal)
SHAPES = [
    ("H1", 4, 4096, 32, 8, 128, "bfloat16", True),
    ("H2", 1, 16384, 32, 8, 128, "bfloat16", True),
    ("H3", 16, 512, 32, 8, 128, "float16", True),
    ("H4", 4, 2048, 32, 8, 64, "bfloat16", True),
    ("N1", 4, 4096, 32, 8, 128, "bfloat16", False),
    ("H5", 4, 2048, 32, 8, 80, "bfloat16", True),
    ("H6", 4, 2048, 32, 8, 192, "bfloat16", True),
    ("H7", 4, 2048, 32, 8, 256, "bfloat16", True),
    ("g8_S8k", 2, 8192, 64, 8, 128, "bfloat16", True),      # group 8 (Llama-70B class)
    ("g7_S2k", 4, 2048, 28, 4, 128, "bfloat16", True),      # group 7 (the sweep's P05 at S2k)
    ("mha_S1k", 8, 1024, 16, 16, 128, "bfloat16", True),    # group 1
    ("g4_S1k", 8, 1024, 32, 8, 128, "bfloat16", True),
    ("g4_S256", 32, 256, 32, 8, 128, "bfloat16", True),
    ("d64_S1k", 16, 1024, 16, 4, 64, "float16", True),
    ("mha_S4k", 4, 4096, 32, 32, 128, "bfloat16", True),    # the sweep's P17: 128 KV heads' K/V, 256 MB
    ("mha_d96_S2k", 4, 2048, 32, 32, 96, "bfloat16", True),  # P10
    ("mha_d192_S2k", 4, 2048, 16, 16, 192, "bfloat16", True),  # P13
    ("g6_S1k", 16, 1024, 12, 2, 128, "bfloat16", True),     # the sweep's P16: group 6
    ("H1_S8k", 4, 8192, 32, 8, 128, "bfloat16", True),     # W1's shape (with hopper_ab.py --window 1024: W1)
    ("g2_S2k", 4, 2048, 32, 16, 128, "bfloat16", True),    # group 2
    ("g3_S2k", 4, 2048, 24, 8, 128, "bfloat16", True),     # group 3
    ("g2_S512", 16, 512, 32, 16, 128, "float16", True),    # H3 at group 2
    ("mha_S512", 16, 512, 32, 32, 128, "float16", True),   # H3 at group 1
]


def case_inputs(torch, batch, seqlen, num_q_heads, num_kv_heads, head_dim, dtype):
    """q, k, v of a SHAPES row (bshd, random normal, seed 0) on the GPU."""
    dt = getattr(torch, dtype)
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(batch, seqlen, num_q_heads, head_dim, device="cuda", dtype=dt, generator=g)
    k = torch.randn(batch, seqlen, num_kv_heads, head_dim, device="cuda", dtype=dt, generator=g)
    v = torch.randn(batch, seqlen, num_kv_heads, head_dim, device="cuda", dtype=dt, generator=g)
    return q, k, v


def cudnn_call(torch, q, k, v, causal):
    """A call of torch's cuDNN attention on the same (bshd) inputs."""
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))

    def cudnn():
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.CUDNN_ATTENTION):
            torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, enable_gqa=True)

    return cudnn


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--cases", default="")
    args = ap.parse_args()
    torch, cupy, cupy_gqa = ba.load_gpu_stack()
    from cupy_gqa import _plan

    timer = ba.Timer(torch, fast_reps=args.reps, slow_reps=max(5, args.reps // 3))
    want = set(args.cases.split(",")) if args.cases else None
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  cudnn {torch.backends.cudnn.version()}")
    print(f"{'case':10} {'persistent':>11} {'per-tile':>9} {'cudnn':>9} {'pers/cudnn':>10} {'tile/cudnn':>10} {'pers/tile':>9} equal")
    for name, b, s, hq, hkv, d, dt, causal in SHAPES:
        if want and name not in want:
            continue
        q, k, v = case_inputs(torch, b, s, hq, hkv, d, dt)
        out_p, out_t = torch.empty_like(q), torch.empty_like(q)

        def run(persistent, out):
            _plan.HOPPER_PERSISTENT = persistent
            cupy_gqa.attention(q, k, v, causal=causal, out=out, kernel="hopper")

        cudnn = cudnn_call(torch, q, k, v, causal)

        run(True, out_p)
        run(False, out_t)
        torch.cuda.synchronize()
        equal = torch.equal(out_p.view(torch.int16), out_t.view(torch.int16))
        # two rounds, in turn: the first call timed in a process runs at higher
        # clocks on long cases, so each takes the better of its two medians
        fns = (lambda: run(True, out_p), lambda: run(False, out_t), cudnn)
        best = [min(x) for x in zip(*([timer(f).ms for f in fns] for _ in range(2)))]
        tp, tt, tc = best
        print(f"{name:10} {tp:11.4f} {tt:9.4f} {tc:9.4f} {tp / tc:10.3f} {tt / tc:10.3f} {tp / tt:9.3f} {equal}", flush=True)
    _plan.HOPPER_PERSISTENT = True


if __name__ == "__main__":
    main()
