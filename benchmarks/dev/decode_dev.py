#!/usr/bin/env python3
"""Dev harness for kernels/decode.cu: time D1 / D2 over split counts and kernel
variants, and decode against tiled as seqlen_q grows (for choose_kernel).

    python benchmarks/dev/decode_dev.py [--out DIR] [--variants base,s4] [--splits 1,2] [--no-sweep]

Timing: CuPy events around each call, a 256 MB buffer zeroed before every
repetition (no input stays in L2), median of REPS. GB/s counts K and V bytes.
Variants (VARIANTS) are other template arguments of the bf16 D128 kernel.
Notes and results: benchmarks/NOTES_decode.md.
"""
import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import cupy  # noqa: E402
import ml_dtypes  # noqa: E402

import cupy_gqa  # noqa: E402
from cupy_gqa import _plan, _specs  # noqa: E402

REPS = 30
FLUSH = cupy.empty(256 * 2**20 // 4, dtype=cupy.int32)


def mma_stages(stages: int) -> _specs.Spec:
    """The bf16 D128 tensor-core kernel (16 rows per CTA) with ``stages`` cp.async stages per warp."""
    return _specs.decode_mma_spec("bfloat16", 128, stages)


VARIANTS = {  # name -> the bf16 D128 decode spec it times (the table's spec: "base")
    "base": lambda: _specs.decode_spec("bfloat16", 128, 16, _specs.ARCHS["sm_90"]),
    **{f"s{n}": (lambda n=n: mma_stages(n)) for n in (2, 4, 5, 6)},
    "cuda_core": lambda: _specs.decode_cuda_core_spec("bfloat16", 128, 4),  # decode.cu v2, 4 rows per CTA
}


def median_ms(fn) -> float:
    fn()
    times = []
    for _ in range(REPS):
        FLUSH.fill(0)
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, end))
    return float(np.median(times))


def inputs(batch, seqlen_q, seqlen_k, num_q_heads, num_kv_heads, head_dim, dtype=ml_dtypes.bfloat16):
    rnd = lambda *s: cupy.random.standard_normal(s, dtype=cupy.float32).astype(dtype)  # noqa: E731
    return rnd(batch, seqlen_q, num_q_heads, head_dim), rnd(batch, seqlen_k, num_kv_heads, head_dim), rnd(
        batch, seqlen_k, num_kv_heads, head_dim
    )


def kv_gbs(k, ms) -> float:
    return 2 * k.nbytes / (ms * 1e-3) / 1e9


def variant_launch(q, k, v, out, variant, num_splits):
    problem = _plan.Problem.of(q, k, dtype="bfloat16", causal=True, softmax_scale=1 / np.sqrt(q.shape[3]))
    launch = _plan._decode_plan(problem, _plan._layout(q, k, v, out), VARIANTS[variant](), num_splits)
    return lambda: launch(q, k, v, out, None, None), launch


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--variants", default=",".join(VARIANTS), help="VARIANTS to time, comma-separated")
    ap.add_argument("--splits", default="1,2,3,4,6,8", help="split counts to time each variant at")
    ap.add_argument("--no-sweep", action="store_true", help="skip decode against tiled as the rows grow")
    args = ap.parse_args()
    rows, lines = [], []
    say = lambda s: (print(s, flush=True), lines.append(s))  # noqa: E731

    shapes = {"D1": (16, 1, 8192, 32, 8, 128), "D2": (64, 1, 2048, 32, 8, 128)}
    for name, shape in shapes.items():
        q, k, v = inputs(*shape)
        out = cupy.empty_like(q)
        auto = median_ms(lambda: cupy_gqa.attention(q, k, v, out=out))
        ref = out.astype(cupy.float32)  # checked against float64 by tests/test_gpu_decode.py
        problem = _plan.Problem.of(q, k, dtype="bfloat16", causal=True, softmax_scale=1 / np.sqrt(128))
        chosen = _plan.decode_plan_for(problem, q, k, v, out).num_splits
        floor = 2 * k.nbytes / 4240e9 * 1e3
        say(f"{name}: auto {auto:.4f} ms {kv_gbs(k, auto):.0f} GB/s (splits {chosen}); floor {floor:.4f} ms")
        rows.append(dict(case=name, variant="auto", splits=chosen, ms=auto, gbs=kv_gbs(k, auto)))
        for variant in args.variants.split(","):
            line = []
            for ns in (int(x) for x in args.splits.split(",")):
                fn, launch = variant_launch(q, k, v, out, variant, ns)
                out.fill(float("nan"))
                fn()
                err = float(cupy.linalg.norm(out.astype(cupy.float32) - ref) / cupy.linalg.norm(ref))
                if not err < 1e-2:
                    say(f"  {name} {variant} splits {ns}: WRONG, relative error {err:.2e} against kernel='auto'")
                ms = median_ms(fn)
                rows.append(dict(case=name, variant=variant, splits=ns, ms=ms, gbs=kv_gbs(k, ms)))
                line.append(f"{ns}:{ms:.4f}/{kv_gbs(k, ms):.0f}")
            kern = _plan.get_kernel(launch.spec)
            per_sm = cupy.cuda.driver.occupancyMaxActiveBlocksPerMultiprocessor(
                kern.kernel.ptr, launch.spec.threads, launch.spec.smem)
            say(f"  {name} {variant:<11} regs {kern.num_regs:3d} CTAs/SM {per_sm}  splits:ms/GBs  " + "  ".join(line))

    # decode vs tiled as seqlen_q * group_size grows (D1's cache)
    for seqlen_q, num_q_heads in () if args.no_sweep else ((1, 8), (1, 32), (2, 32), (4, 32), (8, 32), (16, 32), (16, 64)):
        q, k, v = inputs(16, seqlen_q, 8192, num_q_heads, 8, 128)
        res = {}
        for kernel in ("decode", "tiled"):
            res[kernel] = median_ms(lambda: cupy_gqa.attention(q, k, v, kernel=kernel))
        rows.append(dict(case=f"sweep Sq{seqlen_q} Hq{num_q_heads}", **res))
        say(f"  sweep seqlen_q {seqlen_q:2d} group {num_q_heads // 8:2d} rows {seqlen_q * num_q_heads // 8:3d}: "
            f"decode {res['decode']:.4f} ms  tiled {res['tiled']:.4f} ms")

    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "decode_dev.json").write_text(json.dumps(rows, indent=1))
        (args.out / "decode_dev.txt").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
