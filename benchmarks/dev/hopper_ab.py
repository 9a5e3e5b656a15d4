#!/usr/bin/env python3
"""This tree's hopper kernel against another checkout's, in one process.

    python3 benchmarks/dev/hopper_ab.py DIR [--cases H3,H1] [--rounds 3] [--reps 30] [--softcap 30] [--alibi]
                                        [--window 1024]
    python3 benchmarks/dev/hopper_ab.py . [--cases N1]     # a control: this tree against itself

DIR holds a copy of `cupy_gqa/` and `kernels/` (a patched tree, say). Its
package is imported a second time under the name `cupy_gqa_b` (the package's
imports of itself are relative, and its kernels are read from DIR/kernels), so
both versions, and torch's cuDNN backend, are timed in turn in the same
process, the order rotated every round: the drift of clocks and of the host
from one process to the next (a few per cent on the H200 machine, enough to
hide a kernel step) reaches all three alike. Each keeps its best median
(bench_attention's Timer: CUDA events, L2 flushed before each rep). The two
versions' outputs are compared bit for bit (where they differ, the largest
difference relative to A's largest output is printed). DIR "." times this tree against a
second import of itself: the same kernels, so B/A is the bias of the setup
(N1 read about 5 to 10 % slower as B on 2026-12-04, whatever B was).
"""
import argparse
import importlib.util
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import bench_attention as ba  # noqa: E402
from hopper_persistent_ab import SHAPES, case_inputs, cudnn_call  # noqa: E402


def load_copy(directory: str, name: str = "cupy_gqa_b"):
    """The package of DIR/cupy_gqa imported as ``name``."""
    pkg = os.path.join(os.path.abspath(directory), "cupy_gqa")
    spec = importlib.util.spec_from_file_location(name, os.path.join(pkg, "__init__.py"),
                                                  submodule_search_locations=[pkg])
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dir")
    ap.add_argument("--cases", default="H3,H1,H2,N1,H4")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--softcap", type=float, default=0.0, help="both versions with this softcap (cuDNN: none)")
    ap.add_argument("--alibi", action="store_true", help="both versions with ALiBi slopes 2^-(h+1) (cuDNN: none)")
    ap.add_argument("--window", type=int, default=-1,
                    help="both versions with window=(WINDOW, 0) (W1's band; cuDNN: without it)")
    args = ap.parse_args()
    mods = {"softcap": args.softcap} if args.softcap else {}
    if args.window >= 0:
        mods["window"] = (args.window, 0)
    torch, cupy, cupy_gqa = ba.load_gpu_stack()
    other = load_copy(args.dir)
    assert other.attention is not cupy_gqa.attention
    timer = ba.Timer(torch, fast_reps=args.reps, slow_reps=max(5, args.reps // 3))
    want = args.cases.split(",")
    label = os.path.basename(os.path.normpath(args.dir))
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  cudnn {torch.backends.cudnn.version()}  "
          f"B = {label}, {args.rounds} rounds" + (f", A and B with {mods}" if mods else "")
          + (", A and B with ALiBi" if args.alibi else "") + (" (cuDNN without)" if mods or args.alibi else ""))
    print(f"{'case':10} {'A (here)':>9} {'B':>9} {'cudnn':>9} {'B/A':>7} {'A/cudnn':>8} {'B/cudnn':>8} equal")
    for name, b, s, hq, hkv, d, dt, causal in SHAPES:
        if name not in want:
            continue
        q, k, v = case_inputs(torch, b, s, hq, hkv, d, dt)
        out_a, out_b = torch.empty_like(q), torch.empty_like(q)
        kw = dict(mods)
        if args.alibi:
            kw["alibi_slopes"] = 2.0 ** -torch.arange(1, hq + 1, device=q.device, dtype=torch.float32)
        fns = [lambda: cupy_gqa.attention(q, k, v, causal=causal, out=out_a, kernel="hopper", **kw),
               lambda: other.attention(q, k, v, causal=causal, out=out_b, kernel="hopper", **kw),
               cudnn_call(torch, q, k, v, causal)]
        for side, f in zip("AB", fns[:2]):  # (each side's first call reported: a kernel that hangs is named)
            f()
            torch.cuda.synchronize()
            print(f"-- {name}: {side}'s first call done", flush=True)
        equal = torch.equal(out_a.view(torch.int16), out_b.view(torch.int16))
        if not equal:
            rel = ((out_b.float() - out_a.float()).abs().max() / out_a.float().abs().max()).item()
            equal = f"{rel:.2e}"
        best = [float("inf")] * 3
        for r in range(args.rounds):
            order = [(i + r) % 3 for i in range(3)]
            for i in order:
                best[i] = min(best[i], timer(fns[i]).ms)
        ta, tb, tc = best
        print(f"{name:10} {ta:9.4f} {tb:9.4f} {tc:9.4f} {tb / ta:7.3f} {ta / tc:8.3f} {tb / tc:8.3f} {equal}", flush=True)


if __name__ == "__main__":
    main()
