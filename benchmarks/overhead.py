"""Host overhead of one cupy_gqa.attention call against its kernel time.

    python benchmarks/overhead.py [--shape B,Sq,Sk,Hq,Hkv,D] [--dtype float32] [--profile]

Prints (1) the host time per call with no synchronisation (what Python costs),
(2) the GPU time per call when calls are queued back to back (what the kernel
costs), and (3) with --profile, the functions that dominate the host time.
"""
import argparse
import cProfile
import pstats
import time

import cupy
import numpy as np

import cupy_gqa


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="2,80,80,8,2,32", help="batch,seqlen_q,seqlen_k,num_q_heads,num_kv_heads,head_dim")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--kernel", default="auto")
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--pieces", action="store_true", help="host time of each step of a call")
    args = parser.parse_args()
    batch, seqlen_q, seqlen_k, num_q_heads, num_kv_heads, head_dim = map(int, args.shape.split(","))
    dtype = cupy_gqa.api._interop.np.dtype(args.dtype) if args.dtype != "bfloat16" else __import__("ml_dtypes").bfloat16
    rand = lambda *s: cupy.random.standard_normal(s, dtype=cupy.float32).astype(dtype)  # noqa: E731
    q = rand(batch, seqlen_q, num_q_heads, head_dim)
    k, v = rand(batch, seqlen_k, num_kv_heads, head_dim), rand(batch, seqlen_k, num_kv_heads, head_dim)
    out = cupy.empty_like(q)
    call = lambda: cupy_gqa.attention(q, k, v, out=out, kernel=args.kernel)  # noqa: E731
    for _ in range(10):
        call()
    cupy.cuda.Device().synchronize()

    t0 = time.perf_counter()
    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    start.record()
    for _ in range(args.calls):
        call()
    end.record()
    host_us = (time.perf_counter() - t0) / args.calls * 1e6
    end.synchronize()
    queued_us = cupy.cuda.get_elapsed_time(start, end) / args.calls * 1e3
    # the kernel alone: the cached launch plan, launched back to back
    from cupy_gqa import _plan

    problem = _plan.Problem.of(q, k, dtype=str(q.dtype), causal=True, softmax_scale=1.0 / head_dim**0.5)
    launch = _plan.plan_rowwise(problem, _plan._layout(q, k, v, out), True)
    start.record()
    for _ in range(args.calls):
        launch(q, k, v, out, None)
    end.record()
    end.synchronize()
    raw_us = cupy.cuda.get_elapsed_time(start, end) / args.calls * 1e3
    print(f"shape {args.shape} {args.dtype} kernel={args.kernel}")
    print(f"rowwise kernel alone, back to back:  {raw_us:8.2f} us per launch")
    print(f"host time per call (no sync):        {host_us:8.2f} us")
    print(f"GPU time per call, queued back to back: {queued_us:8.2f} us (>= kernel time; = host time if host-bound)")
    if args.pieces:
        from cupy_gqa import _compile, _interop

        frame = _interop.frame_of({"q": q, "k": k, "v": v})
        steps = {
            "frame_of": lambda: _interop.frame_of({"q": q, "k": k, "v": v, "out": out}),
            "Device(0) enter/exit": lambda: cupy.cuda.Device(0).__enter__().__exit__(None, None, None),
            "get_kernel": lambda: _compile.get_kernel(launch.spec),
            "plan lookup": lambda: _plan.plan_rowwise(problem, _plan._layout(q, k, v, out), True),
            "Problem.of": lambda: _plan.Problem.of(q, k, dtype="float32", causal=True, softmax_scale=0.1),
            "raw launch": lambda: launch(q, k, v, out, None),
            "cupy.empty": lambda: cupy.empty(q.shape, q.dtype),
            "full call": call,
        }
        for name, fn in steps.items():
            fn()
            t0 = time.perf_counter()
            for _ in range(args.calls):
                fn()
            print(f"  {name:<22} {(time.perf_counter() - t0) / args.calls * 1e6:8.2f} us")
        cupy.cuda.Device().synchronize()
    if args.profile:
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(args.calls):
            call()
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(15)


if __name__ == "__main__":
    main()
