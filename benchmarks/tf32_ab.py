"""The float32 tiled kernel's PRESPLIT modes side by side (kernels/tiled_tf32.cu):
where the operands are split into TF32 parts (0 per warp in registers, 1 K/V
once per CTA, 2 also Q). Picks the table in cupy_gqa/_specs.py.

    python benchmarks/tf32_ab.py [--cases F1,F2] [--modes 0,1,2]

Prints, per case and mode, the GPU time (cupyx.profiler.benchmark, median of
20; inputs larger than L2) and the relative error on sampled rows against
float64, all modes on the same inputs. Modes that don't fit in shared memory
are reported and skipped.
"""
import argparse

import cupy
import numpy as np
from cupyx.profiler import benchmark

from cupy_gqa import _compile, _plan, _specs

CASES = {"F1": (4, 4096, 32, 8, 128), "F2": (4, 1024, 32, 8, 64), "F1s": (1, 2048, 32, 8, 128)}
MAX_SMEM = 227 * 1024  # H200 opt-in shared memory per CTA


def sampled_error(q, k, v, out, rows):
    """Relative error of out[0, rows, 0:group] against float64 (causal, seqlen_q == seqlen_k)."""
    qh, kh, vh, oh = (cupy.asnumpy(x[0]).astype(np.float64) for x in (q, k, v, out))
    group = q.shape[2] // k.shape[2]
    num, den = 0.0, 0.0
    for t in rows:
        for h in range(group):
            s = kh[: t + 1, 0] @ qh[t, h] / np.sqrt(q.shape[3])
            p = np.exp(s - s.max())
            ref = (p / p.sum()) @ vh[: t + 1, 0]
            num += np.sum((oh[t, h] - ref) ** 2)
            den += np.sum(ref**2)
    return float(np.sqrt(num / den))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default="F1,F2")
    parser.add_argument("--modes", default="0,1,2")
    args = parser.parse_args()
    for name in args.cases.split(","):
        batch, seqlen, hq, hkv, d = CASES[name]
        q, k, v = (cupy.random.standard_normal((batch, seqlen, h, d), dtype=cupy.float32) for h in (hq, hkv, hkv))
        out = cupy.empty_like(q)
        problem = _plan.Problem.of(q, k, dtype="float32", causal=True, softmax_scale=1 / np.sqrt(d))
        base = _plan.plan_tiled(problem, _plan._layout(q, k, v, out))
        rows = np.linspace(0, seqlen - 1, 24).astype(int)
        for mode in map(int, args.modes.split(",")):
            spec = _specs.tiled_f32_spec(d, True, "highest", mode)
            if spec.smem > MAX_SMEM:
                print(f"{name} presplit {mode}: {spec.smem} bytes of shared memory, over {MAX_SMEM}; skipped")
                continue
            launch = _plan.Launch(spec, base.grid, base.params)
            kern = _compile.get_kernel(spec)
            per_sm = cupy.cuda.driver.occupancyMaxActiveBlocksPerMultiprocessor(kern.kernel.ptr, spec.threads, spec.smem)
            out.fill(float("nan"))
            launch(q, k, v, out, None)
            err = sampled_error(q, k, v, out, rows)
            def run():
                launch(q, k, v, out, None)

            t = benchmark(run, (), n_repeat=20, n_warmup=3)
            ms = float(np.median(t.gpu_times)) * 1e3
            print(
                f"{name} presplit {mode}  {ms:8.3f} ms  rel_err {err:.2e}  nan {bool(cupy.isnan(out).any())}  "
                f"regs {kern.num_regs}  smem {spec.smem}  CTAs/SM {per_sm}",
                flush=True,
            )


if __name__ == "__main__":
    main()
