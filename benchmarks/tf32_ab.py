"""The float32 tiled kernel's PRESPLIT modes and compile-time variants side by
side (kernels/tiled_tf32.cu): where the operands are split into TF32 parts (0
per warp in registers, 1 K/V once per CTA, 2 also Q), and the A/B switches at
the top of the kernel. Picks the table in cupy_gqa/_specs.py.

    python benchmarks/tf32_ab.py [--cases F1,F2] [--modes 0,1,2,t] [--variants base,split,...]

Mode "t" is the table's mode for the case's head dim (1 at D128, 2 at D64).

A variant is a name from VARIANTS (extra NVRTC -D options), optionally with
@SHAPE from SHAPES (other BLOCK_M, BLOCK_N, NUM_WARPS[, PRESPLIT] for the case's
head dim; a shape's own PRESPLIT replaces --modes): "all@w8".

Prints, per case, mode and variant, the GPU time (cupyx.profiler.benchmark,
median of 20; inputs larger than L2), the relative error on sampled rows
against float64 and ptxas' registers, all on the same inputs. Variants that
don't fit in shared memory or fail to compile are reported and skipped.
"""
import argparse
import dataclasses
import sys
from pathlib import Path

import cupy
import numpy as np
from cupyx.profiler import benchmark

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cupy_gqa import _compile, _plan, _specs  # noqa: E402

CASES = {"F1": (4, 4096, 32, 8, 128), "F2": (4, 1024, 32, 8, 64), "F1s": (1, 2048, 32, 8, 128)}
MAX_SMEM = 227 * 1024  # H200 opt-in shared memory per CTA

# name -> extra NVRTC options: the switches at the top of kernels/tiled_tf32.cu
VARIANTS = {
    "base": (),
    "split": ("-DTF32_FAST_SPLIT=1",),
    "ex2": ("-DTF32_EX2=1",),
    "lazy": ("-DTF32_RESCALE_THRESHOLD=8",),
    "vt": ("-DTF32_V_LDMATRIX=1",),
    "ldinc": ("-DTF32_LOAD_INC=1",),
    "ex2_lazy": ("-DTF32_EX2=1", "-DTF32_RESCALE_THRESHOLD=8"),
    "split_ex2": ("-DTF32_FAST_SPLIT=1", "-DTF32_EX2=1"),
    "split_ex2_ldinc": ("-DTF32_FAST_SPLIT=1", "-DTF32_EX2=1", "-DTF32_LOAD_INC=1"),
    "split_ex2_vt": ("-DTF32_FAST_SPLIT=1", "-DTF32_EX2=1", "-DTF32_V_LDMATRIX=1"),
    "all": ("-DTF32_FAST_SPLIT=1", "-DTF32_EX2=1", "-DTF32_RESCALE_THRESHOLD=8", "-DTF32_V_LDMATRIX=1",
            "-DTF32_LOAD_INC=1"),
    "all_eager": ("-DTF32_FAST_SPLIT=1", "-DTF32_EX2=1", "-DTF32_V_LDMATRIX=1", "-DTF32_LOAD_INC=1"),
}
# name -> (BLOCK_M, BLOCK_N, NUM_WARPS, PRESPLIT) in place of the table's tile
SHAPES = {
    "w8": (128, 16, 8, 1),  # 8 warps: the per-CTA split and loads shared by twice the rows
    "w8p2": (128, 16, 8, 2),  # ... and Q split once (1 CTA/SM either way)
    "n32": (64, 32, 4, 1),  # BLOCK_N 32 at D128 (spilled before TF32_FAST_SPLIT)
}


def variant_spec(head_dim: int, mode: int, variant: str) -> tuple:
    """(Spec, extra options) of ``variant`` ("name" or "name@shape") at ``mode``."""
    name, _, shape = variant.partition("@")
    options = VARIANTS[name]
    spec = _specs.tiled_f32_spec(head_dim, True, "highest", mode)
    if shape:
        bm, bn, warps, mode = SHAPES[shape]
        spec = dataclasses.replace(
            spec,
            name=f"tiled_tf32_attention<{head_dim}, {bm}, {bn}, {warps}, true, true, {mode}>",
            threads=warps * 32,
            block_m=bm,
            smem=_specs.tiled_f32_smem(head_dim, bm, bn, mode),
        )
    else:
        bm, bn = spec.block_m, _specs.TILED_F32_TILES[head_dim][1]
    if "-DTF32_V_LDMATRIX=1" in options:  # transposed V tiles (kernels/tiled_tf32.cu: sVtb, sVts)
        row, rowt = head_dim + 4, bn + 4
        spec = dataclasses.replace(
            spec, smem=spec.smem - (bn * row * 4 if mode == 1 else 0) + 2 * head_dim * rowt * 4
        )
    return spec, options


_kernels = {}


def get_kernel(spec, options):
    """The kernel of ``spec`` compiled with ``options`` added (as benchmarks/decode_dev.py)."""
    key = (spec.name, options)
    if key not in _kernels:
        module = cupy.RawModule(
            code=_compile.source(spec.source),
            options=(*_compile.compile_options(spec), *options),
            name_expressions=[spec.name],
        )
        kern = module.get_function(spec.name)
        if spec.smem > 48 * 1024:
            kern.max_dynamic_shared_size_bytes = spec.smem
        _kernels[key] = kern
    return _kernels[key]


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
    parser.add_argument("--variants", default="base", help=f"comma-separated, of {', '.join(VARIANTS)} [@{', @'.join(SHAPES)}]")
    parser.add_argument("--repeat", type=int, default=20)
    args = parser.parse_args()
    variants = args.variants.split(",")
    for v in variants:
        name, _, shape = v.partition("@")
        if name not in VARIANTS or (shape and shape not in SHAPES):
            parser.error(f"unknown variant {v!r}")
    results = []
    for name in args.cases.split(","):
        batch, seqlen, hq, hkv, d = CASES[name]
        q, k, v = (cupy.random.standard_normal((batch, seqlen, h, d), dtype=cupy.float32) for h in (hq, hkv, hkv))
        out = cupy.empty_like(q)
        problem = _plan.Problem.of(q, k, dtype="float32", causal=True, softmax_scale=1 / np.sqrt(d))
        base = _plan.plan_tiled(problem, _plan._layout(q, k, v, out))
        params = base._params_arg
        rows = np.linspace(0, seqlen - 1, 24).astype(int)
        done = set()
        table_mode = _specs.TILED_F32_TILES[d][3]
        for mode in (table_mode if m == "t" else int(m) for m in args.modes.split(",")):
            for slot, variant in enumerate(variants):  # a variant listed twice is timed twice (drift)
                spec, options = variant_spec(d, mode, variant)
                if (spec.name, options, slot) in done:  # a shape fixes its own mode
                    continue
                done.add((spec.name, options, slot))
                label = f"{name} presplit {spec.name.split(', ')[-1][:-1]} {variant:<16}"
                if spec.smem > MAX_SMEM:
                    print(f"{label}: {spec.smem} bytes of shared memory, over {MAX_SMEM}; skipped", flush=True)
                    continue
                try:
                    kern = get_kernel(spec, options)
                    regs = kern.num_regs
                except Exception as e:  # compile error: report, go on
                    print(f"{label}: does not compile ({type(e).__name__}: {str(e).splitlines()[0][:200]})", flush=True)
                    continue
                grid = (-(-seqlen * (hq // hkv) // spec.block_m) * batch * hkv,)
                per_sm = cupy.cuda.driver.occupancyMaxActiveBlocksPerMultiprocessor(kern.kernel.ptr, spec.threads, spec.smem)

                def run():
                    kern(grid, (spec.threads,), (q, k, v, out, None, None, params), shared_mem=spec.smem)

                out.fill(float("nan"))
                run()
                nan = bool(cupy.isnan(out).any())
                err = sampled_error(q, k, v, out, rows)
                t = benchmark(run, (), n_repeat=args.repeat, n_warmup=3)
                ms = float(np.median(t.gpu_times)) * 1e3
                results.append((name, label, ms))
                print(
                    f"{label} {ms:8.3f} ms  rel_err {err:.2e}  nan {nan}  regs {regs}  "
                    f"smem {spec.smem}  CTAs/SM {per_sm}",
                    flush=True,
                )
    print("\nsummary (ms, and relative to the first row of each case)")
    first = {}
    for name, label, ms in results:
        first.setdefault(name, ms)
        print(f"  {label} {ms:8.3f}  {ms / first[name]:.3f}x")


if __name__ == "__main__":
    main()
