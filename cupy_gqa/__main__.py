"""Command line: ``python -m cupy_gqa`` (demo) and ``python -m cupy_gqa compile --arch sm_90``."""
from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from . import __version__, attention
from ._compile import compile_offline
from ._specs import SPECS


def _gpu_name() -> str | None:
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() == 0:
            return None
        return cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["name"].decode()
    except Exception:  # no cupy, no driver, no device
        return None


def demo() -> int:
    """The seed's shape: batch 2, seqlen 80, 8 query heads, 2 KV heads, head_dim 32, fp32, causal."""
    rng = np.random.default_rng(0)
    shape_q, shape_kv = (2, 80, 8, 32), (2, 80, 2, 32)
    q, k, v = (rng.standard_normal(s).astype(np.float32) for s in (shape_q, shape_kv, shape_kv))
    print(f"cupy_gqa {__version__}: causal GQA, q {shape_q}, k/v {shape_kv}, float32")
    t0 = time.perf_counter()
    expected = attention(q, k, v)
    cpu_ms = (time.perf_counter() - t0) * 1e3
    name = _gpu_name()
    if name is None:
        print(f"no CUDA device found: ran the NumPy backend only ({cpu_ms:.2f} ms)")
        return 0

    import cupy
    from cupyx.profiler import benchmark

    qd, kd, vd = (cupy.asarray(x) for x in (q, k, v))
    out = attention(qd, kd, vd)  # compiles (or loads from CuPy's disk cache) once
    err = float(np.linalg.norm(cupy.asnumpy(out) - expected) / np.linalg.norm(expected))
    timing = benchmark(attention, (qd, kd, vd), n_repeat=200, n_warmup=10)
    gpu_ms = float(np.median(timing.gpu_times)) * 1e3
    print(f"device: {name}")
    print(f"relative error vs the NumPy backend: {err:.2e}")
    print(f"median time: {gpu_ms:.4f} ms on the GPU (NumPy backend: {cpu_ms:.2f} ms)")
    return 0 if err < 1e-5 else 1


def compile_all(arch: str) -> int:
    """Compile every specialization in the table for ``arch`` with NVRTC; no GPU needed."""
    failures = 0
    # a spec built for one target (sm_90a) belongs to that architecture's table only
    specs = [s for s in SPECS if s.arch is None or s.arch.rstrip("a") == arch]
    print(f"{'kernel':<60} {'regs':>5} {'spill st':>9} {'spill ld':>9} {'stack':>6}")
    for spec in specs:
        report = compile_offline(spec, arch)
        if not report.ok:
            failures += 1
            print(f"{spec.name:<60} FAILED\n{report.log}")
            continue
        numbers = (report.registers, report.spill_stores, report.spill_loads, report.stack_frame)
        regs, st, ld, stack = ("?" if n is None else n for n in numbers)  # "?": ptxas printed no such line
        print(f"{spec.name:<60} {regs:>5} {st:>9} {ld:>9} {stack:>6}")
    print(f"{len(specs) - failures}/{len(specs)} specializations compiled for {arch}")
    return 1 if failures else 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cupy_gqa", description=__doc__)
    sub = parser.add_subparsers(dest="command")
    sub.add_parser("demo", help="run the seed shape and check it (the default)")
    comp = sub.add_parser("compile", help="compile every kernel specialization with NVRTC (no GPU needed)")
    comp.add_argument("--arch", default="sm_90", help="target architecture, e.g. sm_80, sm_90 (default: sm_90)")
    args = parser.parse_args(argv)
    if args.command == "compile":
        return compile_all(args.arch)
    return demo()


if __name__ == "__main__":
    sys.exit(main())
