"""Host time of a repeat call's Python side, on a machine without a GPU.

    python benchmarks/dev/fastpath_cpu.py [--calls N] [--profile N]

torch CPU tensors stand in for CUDA ones: they are registered as torch arrays,
so that ``cupy_gqa.attention`` builds their signature, finds an entry made
here (a decode plan with a workspace, and a prefill plan) and runs the repeat
path up to the driver: the allocations are torch's CPU ones, the launch is a
PackedLaunch whose ``cuLaunchKernel`` is a no-op, the stream and device
queries are constants. What is left out is what the GPU machine adds: the
driver's launch, torch's CUDA allocator and the stream query
(benchmarks/overhead.py measures the whole call there).
"""
import argparse
import cProfile
import pstats
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import cupy_gqa  # noqa: E402
from cupy_gqa import _fast, _launch, _plan  # noqa: E402


def per_call_us(fn, calls, repeats=7):
    best = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best.append((time.perf_counter() - t0) / calls)
    return statistics.median(best) * 1e6


def entry_for(q, k, v, plan, *, out=None, return_lse=False, workspace=None, seqlens_k=None, flags):
    packed = _launch.PackedLaunch(
        [(1, plan.grid[0], plan.spec.threads, plan.spec.smem, ("q", "k", "v", "out", "lse", "seqlens_k", plan.params.tobytes()))],
        device=0,
    )
    ext = lambda t: (sum((n - 1) * s for n, s in zip(t.shape, t.stride())) + 1) * t.element_size()  # noqa: E731
    entry = _fast.Entry(
        kind="torch", device=0, launch=packed, return_lse=return_lse, out_shape=tuple(q.shape),
        lse_shape=(q.shape[0], q.shape[2], q.shape[1]), dtype=q.dtype, aligned_out=True,
        extents=(ext(q), ext(k), ext(v), ext(q), 0), ws_bytes=0, host_lens=None,
    )  # fmt: skip
    entry.torch_device, entry._get_device = torch.device("cpu"), lambda: 0
    entry._stream = lambda device: 0
    key, _ = _fast.signature(q, k, v, out, seqlens_k, workspace, flags)
    _fast.remember(key, entry)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--profile", type=int, default=0, metavar="N")
    args = parser.parse_args()
    _launch._driver_launch = lambda *a: None  # cuLaunchKernel: nothing
    _launch._bound.__dict__[0] = True
    _fast.register(torch.Tensor, "torch")

    q = torch.zeros(16, 1, 32, 128, dtype=torch.bfloat16)
    k = torch.zeros(16, 4096, 8, 128, dtype=torch.bfloat16)
    v = torch.zeros(16, 4096, 8, 128, dtype=torch.bfloat16)
    out = torch.empty_like(q)
    problem = _plan.Problem.of(q, k, dtype="bfloat16", causal=True, softmax_scale=128**-0.5)
    layout = tuple((tuple(t.shape), tuple(s * t.element_size() for s in t.stride()), t.element_size()) for t in (q, k, v, out))
    plan = _plan.plan_tiled(problem, layout, _plan._specs.ARCHS["sm_90"])  # any plan: its launch is mocked
    flags = (bool, True, type(None), None, bool, False, "auto", "highest", "bshd")
    entry_for(q, k, v, plan, flags=flags)
    entry_for(q, k, v, plan, out=out, flags=flags)

    steps = {
        "attention(q, k, v), repeat path": lambda: cupy_gqa.attention(q, k, v),
        "attention(q, k, v, out=out), repeat path": lambda: cupy_gqa.attention(q, k, v, out=out),
        "  _fast.signature": lambda: _fast.signature(q, k, v, None, None, None, flags),
        "  PackedLaunch call (launch a no-op)": lambda: entry_packed(0, 1, 2, 3, 4, 0, 0),
        "  torch.empty (CPU) of out": lambda: torch.empty((16, 1, 32, 128), dtype=torch.bfloat16, device=torch.device("cpu")),
        "  three data_ptr()": lambda: (q.data_ptr(), k.data_ptr(), v.data_ptr()),
        "  q.stride()": lambda: q.stride(),
    }
    global entry_packed
    entry_packed = next(iter(_fast._entries.values())).launch
    print(f"torch {torch.__version__}, numpy {np.__version__}, Python {sys.version.split()[0]}")
    for name, fn in steps.items():
        fn()
        print(f"{name:<46} {per_call_us(fn, args.calls):7.2f} us")
    if args.profile:
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(args.profile):
            cupy_gqa.attention(q, k, v)
        profiler.disable()
        pstats.Stats(profiler).sort_stats("tottime").print_stats(12)


entry_packed = None

if __name__ == "__main__":
    main()
