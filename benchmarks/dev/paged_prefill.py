#!/usr/bin/env python3
"""Prefill against a paged KV cache: the hopper kernel on pages, the mma.sync
kernel (tiled) on the same pages, and hopper on the same keys stored
contiguously, timed in one process.

    python3 benchmarks/dev/paged_prefill.py [--cases C1,C2,C3] [--pages 16,64,256] [--other DIR] [--probes]

A case is a batch of sequences whose last seqlen_q keys are new queries
(chunked prefill: seqlen_q < seqlen_k; a whole prompt: equal), bf16, causal
(bottom-right). The cache is a pool of pages of page_size keys in shuffled order
(a serving system's), its block table one row per sequence; the contiguous
layout is the same keys gathered into (batch, seqlen_k, heads, head_dim).
bench_attention's Timer (CUDA events, L2 flushed before each rep, the
implementations in turn over its rounds). TFLOP/s on visible pairs. hopper on
pages reads the same key tiles in the same order as hopper on the contiguous
keys, so its output must equal that one's bit for bit ("equal"); tiled's
relative difference from it is printed beside. --other DIR adds hopper on pages
by the package of DIR (a copy of `cupy_gqa/` and `kernels/`, imported beside
this one as in hopper_ab.py) to the same rounds: "other" is its time.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import bench_attention as ba  # noqa: E402

# name: (batch, seqlen_q, seqlen_k, num_q_heads, num_kv_heads, head_dim)
CASES = {
    "C1": (4, 2048, 8192, 32, 8, 128),   # chunked prefill: 2048 new tokens on a 6144-token cache
    "C2": (4, 4096, 4096, 32, 8, 128),   # whole prompts (H1's shape)
    "C3": (4, 1024, 4096, 32, 8, 64),    # head dim 64 (three consumer warpgroups)
    "C4": (8, 512, 3000, 28, 4, 128),    # group 7, lengths that end inside a page and a tile
}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--pages", default="16,64,256")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--other", default=None)
    ap.add_argument("--probes", action="store_true",
                    help="also time the producer's cp.async path (left padding of 0) and pages in the pool's order")
    args = ap.parse_args()
    torch, cupy, cupy_gqa = ba.load_gpu_stack()
    other = None
    if args.other:
        from hopper_ab import load_copy

        other = load_copy(args.other)
    timer = ba.Timer(torch, fast_reps=args.reps, slow_reps=max(5, args.reps // 3))
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  cupy {cupy.__version__}")
    print(f"{'case':5} {'page':>5} {'hopper pages':>13} {'tiled pages':>12} {'hopper contig':>14} "
          f"{'pages/contig':>13} {'tiled/hopper':>13} {'TFLOP/s':>8} equal  tiled rel diff")
    for name in args.cases.split(","):
        batch, sq, sk, hq, hkv, d = CASES[name]
        g = torch.Generator(device="cuda").manual_seed(0)
        q = torch.randn(batch, sq, hq, d, device="cuda", dtype=torch.bfloat16, generator=g)
        flops = 4 * d * ba.visible_pairs(sq, sk, True) * batch * hq
        for page in (int(p) for p in args.pages.split(",")):
            max_pages = -(-sk // page)
            pool_k = torch.randn(batch * max_pages + 3, page, hkv, d, device="cuda", dtype=torch.bfloat16, generator=g)
            pool_v = torch.randn_like(pool_k)
            table = torch.randperm(len(pool_k), device="cuda", generator=g)[: batch * max_pages]
            table = table.reshape(batch, max_pages).to(torch.int32)
            lens = torch.full((batch,), sk, dtype=torch.int32, device="cuda")
            # the same keys, contiguous: sequence b's key j is row j % page of page table[b, j // page]
            k = pool_k[table.long()].reshape(batch, max_pages * page, hkv, d)[:, :sk].contiguous()
            v = pool_v[table.long()].reshape(batch, max_pages * page, hkv, d)[:, :sk].contiguous()
            paged = {"block_table": table, "seqlens_k": lens}
            outs = {n: torch.empty_like(q) for n in ("hp", "tp", "hc")}
            fns = {
                "hp": lambda: cupy_gqa.attention(q, pool_k, pool_v, kernel="hopper", out=outs["hp"], **paged),
                "tp": lambda: cupy_gqa.attention(q, pool_k, pool_v, kernel="tiled", out=outs["tp"], **paged),
                "hc": lambda: cupy_gqa.attention(q, k, v, kernel="hopper", out=outs["hc"]),
            }
            if other is not None:
                outs["ob"] = torch.empty_like(q)
                fns["ob"] = lambda: other.attention(q, pool_k, pool_v, kernel="hopper", out=outs["ob"], **paged)
            if args.probes:
                # the same call by the producer's cp.async (left padding of 0 keys takes that path), and
                # by bulk copies from pages in the pool's order (sequence b's on pages b * max_pages ..)
                zeros = torch.zeros(batch, dtype=torch.int32, device="cuda")
                in_order = torch.arange(batch * max_pages, device="cuda", dtype=torch.int32).reshape(batch, max_pages)
                outs["th"], outs["io"] = torch.empty_like(q), torch.empty_like(q)
                fns["th"] = lambda: cupy_gqa.attention(q, pool_k, pool_v, kernel="hopper", out=outs["th"],
                                                       cache_leftpad=zeros, **paged)
                fns["io"] = lambda: cupy_gqa.attention(q, pool_k, pool_v, kernel="hopper", out=outs["io"],
                                                       block_table=in_order, seqlens_k=lens)
            t = timer.many(fns)
            if args.probes:
                print(f"      threads' copies (page {page}): {t['th'].ms:.4f} ms, {t['th'].ms / t['hp'].ms:.3f} of hopper "
                      f"on pages; equal {torch.equal(outs['th'], outs['hp'])}; pages in order: {t['io'].ms:.4f} ms, "
                      f"{t['io'].ms / t['hp'].ms:.3f}")
            equal = torch.equal(outs["hp"], outs["hc"])
            if other is not None:
                print(f"      other (page {page}): {t['ob'].ms:.4f} ms, {t['ob'].ms / t['hp'].ms:.3f} of hopper on pages "
                      f"here; equal {torch.equal(outs['ob'], outs['hp'])}")
            diff = ((outs["tp"].float() - outs["hc"].float()).norm() / outs["hc"].float().norm()).item()
            hp, tp, hc = (t[n].ms for n in ("hp", "tp", "hc"))
            print(f"{name:5} {page:5d} {hp:10.4f} ms {tp:9.4f} ms {hc:11.4f} ms {hp / hc:13.3f} {tp / hp:13.3f} "
                  f"{flops / hp / 1e9:8.1f} {str(equal):5}  {diff:.1e}", flush=True)
            del pool_k, pool_v, k, v


if __name__ == "__main__":
    main()
