"""Host overhead of one cupy_gqa.attention call, and the kernel time alone.

    python benchmarks/overhead.py [--shape B,Sq,Sk,Hq,Hkv,D] [--dtype float32] [--torch]

The full calls after the first of their signature take the repeat-call path
(cupy_gqa/_fast.py). Host time is measured with the GPU idle before each call (a synchronize, then
perf_counter around the call), so a full launch queue can't inflate it. Kernel
time is CUDA events around back-to-back launches of the cached launch plan,
queued behind a spin kernel so that host launch time can't leave gaps.
"""
import argparse
import cProfile
import pstats
import statistics
import time

import cupy
import ml_dtypes
import numpy as np

import cupy_gqa
from cupy_gqa import _compile, _fast, _interop, _plan


FLAGS = (bool, True, type(None), None, bool, False, "auto", "highest", "bshd")


def host_us(fn, calls):
    times = []
    for _ in range(calls):
        cupy.cuda.runtime.deviceSynchronize()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    cupy.cuda.runtime.deviceSynchronize()
    return statistics.median(times) * 1e6


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="2,80,80,8,2,32", help="batch,seqlen_q,seqlen_k,num_q_heads,num_kv_heads,head_dim")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--kernel", default="auto", choices=("auto", *cupy_gqa.KERNELS))
    parser.add_argument("--torch", action="store_true", help="also time torch tensor inputs")
    parser.add_argument("--profile", type=int, default=0, metavar="N", help="cProfile N full calls (cupy, and torch)")
    args = parser.parse_args()
    batch, seqlen_q, seqlen_k, num_q_heads, num_kv_heads, head_dim = map(int, args.shape.split(","))
    dtype = ml_dtypes.bfloat16 if args.dtype == "bfloat16" else np.dtype(args.dtype)
    rand = lambda *s: cupy.random.standard_normal(s, dtype=cupy.float32).astype(dtype)  # noqa: E731
    q = rand(batch, seqlen_q, num_q_heads, head_dim)
    k, v = rand(batch, seqlen_k, num_kv_heads, head_dim), rand(batch, seqlen_k, num_kv_heads, head_dim)
    out = cupy.empty_like(q)
    problem = _plan.Problem.of(q, k, dtype=args.dtype, causal=True, softmax_scale=1.0 / head_dim**0.5)
    family = _plan.choose_kernel(problem, q, k, v, out) if args.kernel == "auto" else args.kernel
    layout = _plan._layout(q, k, v, out)
    vec = head_dim % _plan._specs.vec_width(args.dtype) == 0
    if family == "decode":  # two kernels and a workspace: time its launch function
        name = _plan.decode_plan_for(problem, q, k, v, out).spec.name
        launch = None
        run_plan = lambda: _plan.launch_decode(problem, q, k, v, out, None, None)  # noqa: E731
    else:
        arch = _plan.device_arch(q.device.id)
        launch = _plan.plan_tiled(problem, layout, arch) if family == "tiled" else _plan.plan_rowwise(problem, layout, vec)
        name = launch.spec.name
        run_plan = lambda: launch(q, k, v, out, None)  # noqa: E731
    cupy_gqa.attention(q, k, v, out=out, kernel=family)

    # Kernel time: queue a 50 ms spin kernel first, so that all n launches are
    # enqueued before the GPU reaches the start event (no host gaps inside).
    spin = cupy.RawKernel(
        r"""extern "C" __global__ void spin(long long cycles) {
            long long t0 = clock64(); while (clock64() - t0 < cycles) {} }""",
        "spin",
    )
    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    n = 200
    spin((1,), (1,), (np.int64(100_000_000),))  # ~50 ms at ~2 GHz
    start.record()
    for _ in range(n):
        run_plan()
    end.record()
    end.synchronize()
    print(f"shape {args.shape} {args.dtype}: kernel {name}")
    print(f"  kernel alone (events, back to back)  {cupy.cuda.get_elapsed_time(start, end) / n * 1e3:8.2f} us")
    steps = {
        "full call, cupy, out given": lambda: cupy_gqa.attention(q, k, v, out=out, kernel=family),
        "full call, cupy": lambda: cupy_gqa.attention(q, k, v, kernel=family),
        "raw launch of the plan": run_plan,
        "repeat-call signature (_fast)": lambda: _fast.signature(q, k, v, out, None, None, FLAGS),
        "frame_of": lambda: _interop.frame_of({"q": q, "k": k, "v": v}),
        "cupy.empty": lambda: cupy.empty(q.shape, q.dtype),
    }
    if launch is not None:
        steps["get_kernel"] = lambda: _compile.get_kernel(launch.spec)
    else:  # decode: the packed launch alone (decode and, split, combine), its workspace kept
        plan = _plan.decode_plan_for(problem, q, k, v, out)
        ws = cupy.empty(max(1, plan.workspace_bytes // 4), dtype=cupy.float32)
        packed, stream = plan.packed(), cupy.cuda.get_current_stream().ptr
        addr = [a.data.ptr for a in (q, k, v, out, ws)]
        steps[f"packed launch ({plan.num_splits} splits)"] = lambda: packed(
            stream, addr[0], addr[1], addr[2], addr[3], 0, 0, addr[4] if plan.num_splits > 1 else 0)
        steps["cupy.empty of the workspace"] = lambda: cupy.empty(plan.workspace_bytes // 4, dtype=cupy.float32)
    steps["Problem.of"] = lambda: _plan.Problem.of(q, k, dtype=args.dtype, causal=True, softmax_scale=0.1)
    steps["_layout"] = lambda: _plan._layout(q, k, v, out)
    if args.torch:
        import torch

        tq, tk, tv = (torch.from_dlpack(x) for x in (q, k, v))
        tout = torch.empty_like(tq)
        ts = torch.cuda.current_stream()
        steps.update({
            "full call, torch": lambda: cupy_gqa.attention(tq, tk, tv, kernel=family),
            "full call, torch, out given": lambda: cupy_gqa.attention(tq, tk, tv, out=tout, kernel=family),
            "torch raw stream query": lambda: torch._C._cuda_getCurrentRawStream(0),
            "cupy.from_dlpack(torch)": lambda: cupy.from_dlpack(tq),
            "cupy.from_dlpack(to_dlpack(torch))": lambda: cupy.from_dlpack(torch.utils.dlpack.to_dlpack(tq)),
            "_interop.to_backend(torch)": lambda: _interop.to_backend(tq, _interop.frame_of({"q": tq})),
            "frame_of(torch)": lambda: _interop.frame_of({"q": tq, "k": tk, "v": tv}),
            "Stream.from_external": lambda: cupy.cuda.Stream.from_external(ts),
            "torch.empty": lambda: torch.empty(tq.shape, dtype=tq.dtype, device=tq.device),
        })  # fmt: skip
        if launch is None:
            steps["torch.empty of the workspace"] = lambda: torch.empty(
                plan.workspace_bytes // 4, dtype=torch.float32, device=tq.device)
    for name, step in steps.items():
        step()
        print(f"  {name:<36} {host_us(step, args.calls):8.2f} us host")
    if args.profile:
        calls = {"cupy": steps["full call, cupy"]}
        if args.torch:
            calls["torch"] = steps["full call, torch"]
        for name, call in calls.items():
            profiler = cProfile.Profile()
            profiler.enable()
            for _ in range(args.profile):
                call()
            profiler.disable()
            cupy.cuda.runtime.deviceSynchronize()
            print(f"--- cProfile, {args.profile} full calls, {name}")
            pstats.Stats(profiler).sort_stats("tottime").print_stats(18)


if __name__ == "__main__":
    main()
