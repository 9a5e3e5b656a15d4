"""Benchmark ring attention (cupy_gqa.distributed.ring_attention) on N GPUs against one GPU.

Usage (from the repository root, one process per GPU):

    torchrun --standalone --nproc_per_node 8 benchmarks/bench_ring.py            # R1 on 8 GPUs
    torchrun --standalone --nproc_per_node 2 benchmarks/bench_ring.py --reps 3   # R1 on 2 GPUs
    torchrun --standalone --nproc_per_node 2 benchmarks/bench_ring.py --smoke --out /tmp/ring
        # a tiny float32 problem on CPU tensors over gloo: checks the script, measures nothing useful

R1 (the default): bfloat16, causal, batch 1, seqlen 131072, 32 query heads, 8 KV heads,
head_dim 128, zigzag shards of 131072 / N tokens.

What is measured
    * one GPU: cupy_gqa.attention on the whole sequence, forward and forward + backward
      (attention_backward), on every rank at once (each GPU alone, no communication).
    * N GPUs: ring_attention on each rank's zigzag shard, forward (under no_grad) and
      forward + backward (torch autograd, out.backward(dout)).
    * Time: CUDA events around each repetition after a barrier and a warm-up, median over
      the repetitions (ring: the largest median over the ranks). speedup = one GPU / N GPUs,
      efficiency = speedup / N.
    * Memory: torch.cuda.max_memory_allocated during forward + backward, minus what was
      allocated before it (the inputs), per GPU, in MiB; the largest over the ranks.
    * rel_err = ||ring out - one-GPU out|| / ||one-GPU out|| over the whole output (each rank
      its shard, summed over the ranks).

Results: benchmarks/results/<gpu>x<N>_ring.json and .md (rank 0 writes them; --out moves them).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
RESULTS = REPO_ROOT / "benchmarks" / "results"
DTYPES = ("bfloat16", "float16", "float32")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="ring attention on N GPUs (torchrun) against one GPU")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seqlen", type=int, default=131072, help="the whole sequence (default 131072)")
    p.add_argument("--heads", type=int, default=32, help="query heads")
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", choices=DTYPES, default="bfloat16")
    p.add_argument("--no-causal", dest="causal", action="store_false")
    p.add_argument("--sharding", choices=("zigzag", "contiguous"), default="zigzag")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--no-backward", dest="backward", action="store_false", help="time the forward only")
    p.add_argument("--no-single", dest="single", action="store_false", help="skip the one-GPU runs")
    p.add_argument("--out", type=Path, default=RESULTS, help="folder of the results files")
    p.add_argument("--smoke", action="store_true", help="CPU tensors over gloo, a tiny float32 problem")
    args = p.parse_args(argv)
    if args.smoke:
        args.seqlen, args.heads, args.kv_heads, args.head_dim, args.dtype = 64, 4, 2, 16, "float32"
        args.reps, args.warmup = 1, 0
    for name in ("batch", "seqlen", "heads", "kv_heads", "head_dim", "reps"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')}: expected >= 1, got {getattr(args, name)}")
    if args.heads % args.kv_heads:
        p.error(f"--heads: expected a multiple of --kv-heads = {args.kv_heads}, got {args.heads}")
    return args


def check_world(args, world: int) -> None:
    """The sequence must split into the shards: world * 2 chunks for zigzag, world for contiguous."""
    parts = 2 * world if args.sharding == "zigzag" else world
    if args.seqlen % parts:
        raise SystemExit(
            f"bench_ring: --seqlen: expected a multiple of {parts} ({args.sharding} shards on {world} ranks), got {args.seqlen}"
        )


def gpu_tag(name: str) -> str:
    sys.path.insert(0, str(REPO_ROOT / "benchmarks"))
    from bench_attention import gpu_tag as tag

    return tag(name)


def to_markdown(result: dict) -> str:
    c = result["config"]
    lines = [
        f"# Ring attention: {result['gpu']} x {result['world_size']}",
        "",
        f"{c['dtype']}, {'causal' if c['causal'] else 'non-causal'}, batch {c['batch']}, seqlen {c['seqlen']}, "
        f"{c['heads']} query heads, {c['kv_heads']} KV heads, head_dim {c['head_dim']}, {c['sharding']} shards "
        f"of {c['seqlen'] // result['world_size']} tokens. {result['date']}.",
        "",
        "| pass | one GPU ms | N GPUs ms | speedup | efficiency |",
        "|---|---|---|---|---|",
    ]
    for row in result["rows"]:
        fmt = lambda x, f: "-" if x is None else format(x, f)  # noqa: E731
        lines.append(
            f"| {row['pass']} | {fmt(row['single_ms'], '.2f')} | {fmt(row['ring_ms'], '.2f')} | "
            f"{fmt(row['speedup'], '.2f')} | {fmt(row['efficiency'], '.2f')} |"
        )
    mem = result["memory"]
    mib = lambda x: "-" if x is None else f"{x} MiB"  # noqa: E731
    lines += [
        "",
        f"Peak memory beyond the inputs, forward + backward: one GPU {mib(mem['single_mib'])}; "
        f"ring, per GPU (largest over the ranks) {mib(mem['ring_mib'])} "
        f"(each rank: {', '.join(mib(x) for x in mem['ring_mib_by_rank'])}).",
        f"rel_err of the ring output against the one-GPU output: {result['rel_err']:.3g}.",
        "",
    ]
    return "\n".join(lines)


def main(argv=None) -> None:
    args = parse_args(argv)
    import torch
    import torch.distributed as dist

    sys.path.insert(0, str(REPO_ROOT))  # benchmark the checkout this script belongs to
    import cupy_gqa
    from cupy_gqa.distributed import ring_attention, zigzag_shard

    if "RANK" not in os.environ:
        raise SystemExit("bench_ring: launch it with torchrun (e.g. torchrun --standalone --nproc_per_node 2 benchmarks/bench_ring.py)")
    if args.smoke:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    else:
        if not torch.cuda.is_available():
            raise SystemExit("bench_ring: no CUDA device (torch.cuda.is_available() is False); --smoke runs on CPU")
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        check_world(args, world)
        result = run(args, torch, dist, cupy_gqa, ring_attention, zigzag_shard, device, rank, world)
        if rank == 0:
            args.out.mkdir(parents=True, exist_ok=True)
            stem = args.out / f"{result['gpu_tag']}x{world}_ring"
            stem.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
            stem.with_suffix(".md").write_text(to_markdown(result))
            print(to_markdown(result))
            print(f"bench_ring: wrote {stem}.json and {stem}.md")
    finally:
        dist.destroy_process_group()


def run(args, torch, dist, cupy_gqa, ring_attention, zigzag_shard, device, rank, world) -> dict:
    cuda = device.type == "cuda"
    dtype = getattr(torch, args.dtype)
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    def timed(fn) -> float:
        """Median ms of fn over args.reps, after args.warmup, each after a barrier."""
        for _ in range(args.warmup):
            fn()
        times = []
        for _ in range(args.reps):
            dist.barrier()
            sync()
            if cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)

    def peak_mib(fn):
        if not cuda:
            return None
        sync()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fn()
        sync()
        return round((torch.cuda.max_memory_allocated() - base) / 2**20, 1)

    # the whole sequence, the same on every rank (a seeded generator on each device)
    gen = torch.Generator(device=device).manual_seed(0)
    shape = lambda h: (args.batch, args.seqlen, h, args.head_dim)  # noqa: E731
    q, k, v, dout = (torch.randn(shape(h), generator=gen, device=device, dtype=dtype) for h in
                     (args.heads, args.kv_heads, args.kv_heads, args.heads))  # fmt: skip
    kw = dict(causal=args.causal)

    single_fwd = single_bwd = single_mem = None
    with torch.no_grad():
        ref = cupy_gqa.attention(q, k, v, **kw)
    if args.single:
        with torch.no_grad():
            single_fwd = timed(lambda: cupy_gqa.attention(q, k, v, **kw))
        if args.backward:
            def single_step():
                out, lse = cupy_gqa.attention(q, k, v, return_lse=True, **kw)
                cupy_gqa.attention_backward(dout, q, k, v, out, lse, **kw)

            single_bwd = timed(single_step)
            single_mem = peak_mib(single_step)

    def take(x):
        if args.sharding == "zigzag":
            return zigzag_shard(x, rank, world).contiguous()
        n = args.seqlen // world
        return x[:, rank * n : (rank + 1) * n].contiguous()

    qs, ks, vs, douts, refs = (take(x) for x in (q, k, v, dout, ref))
    del q, k, v, dout, ref
    if cuda:
        torch.cuda.empty_cache()
    rkw = dict(causal=args.causal, sharding=args.sharding)
    with torch.no_grad():
        out = ring_attention(qs, ks, vs, **rkw)
    err = torch.stack([((out.double() - refs.double()) ** 2).sum(), (refs.double() ** 2).sum()])
    dist.all_reduce(err)
    rel_err = math.sqrt(err[0].item() / err[1].item())
    with torch.no_grad():
        ring_fwd = timed(lambda: ring_attention(qs, ks, vs, **rkw))
    ring_bwd = ring_mem = None
    if args.backward:
        leaves = [x.detach().requires_grad_(True) for x in (qs, ks, vs)]

        def ring_step():
            ring_attention(*leaves, **rkw).backward(douts)
            for x in leaves:
                x.grad = None

        ring_bwd = timed(ring_step)
        ring_mem = peak_mib(ring_step)

    # the largest time and memory over the ranks
    gathered = [None] * world
    dist.all_gather_object(gathered, {"fwd": ring_fwd, "bwd": ring_bwd, "mem": ring_mem})
    ring_fwd = max(g["fwd"] for g in gathered)
    ring_bwd = None if ring_bwd is None else max(g["bwd"] for g in gathered)
    mems = [g["mem"] for g in gathered]

    def row(name, single, ring):
        speedup = single / ring if single and ring else None
        return {"pass": name, "single_ms": single, "ring_ms": ring, "speedup": speedup,
                "efficiency": None if speedup is None else speedup / world}  # fmt: skip

    rows = [row("forward", single_fwd, ring_fwd)]
    if args.backward:
        rows.append(row("forward + backward", single_bwd, ring_bwd))
    gpu = torch.cuda.get_device_name(device) if cuda else "cpu"
    return {
        "gpu": gpu, "gpu_tag": gpu_tag(gpu) if cuda else "cpu", "world_size": world,
        "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__, "cupy_gqa": cupy_gqa.__version__,
        "config": {"batch": args.batch, "seqlen": args.seqlen, "heads": args.heads, "kv_heads": args.kv_heads,
                   "head_dim": args.head_dim, "dtype": args.dtype, "causal": args.causal, "sharding": args.sharding,
                   "reps": args.reps, "warmup": args.warmup, "smoke": args.smoke},
        "rows": rows,
        "memory": {"single_mib": single_mem, "ring_mib": None if None in mems else max(mems), "ring_mib_by_rank": mems},
        "rel_err": rel_err,
    }  # fmt: skip


if __name__ == "__main__":
    main()
