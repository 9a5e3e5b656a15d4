"""The float32 tiled kernels side by side: split TF32's PRESPLIT modes and tile
shapes (kernels/tiled_tf32.cu: where the operands are split into TF32 parts, 0
per warp in registers, 1 K/V once per CTA, 2 also Q; other BLOCK_M, BLOCK_N,
NUM_WARPS), and fp16 pairs (kernels/tiled_f16x2.cu) at its tiles. Picks the
tables in cupy_gqa/_specs.py, and which scheme precision="highest" takes.

    python benchmarks/dev/tf32_ab.py [--cases F1,F2] [--modes 0,1,2,t,f16x2] [--shapes table,w8,...]

Mode "t" is the table's mode for the case's head dim (1 at D128, 2 at D64);
mode "f16x2" is the fp16 pairs of precision "highest" (the scheme the calls take)
(kernels/tiled_f16x2.cu): its table's tile for shape "table", else the shape
of PAIR_SHAPES of that name (shapes it lacks are skipped).
A shape is "table" (the table's tile for the case's head dim) or a name from
SHAPES (BLOCK_M, BLOCK_N, NUM_WARPS, PRESPLIT; its own PRESPLIT replaces --modes).

Prints, per case, mode and shape, the GPU time (cupyx.profiler.benchmark,
median of 20; inputs larger than L2), the relative error on sampled rows
against float64 and ptxas' registers, all on the same inputs. Shapes that
don't fit in shared memory or fail to compile are reported and skipped.
"""
import argparse
import dataclasses
import sys
from pathlib import Path

import cupy
import numpy as np
from cupyx.profiler import benchmark

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from cupy_gqa import _compile, _plan, _specs  # noqa: E402

CASES = {"F1": (4, 4096, 32, 8, 128), "F2": (4, 1024, 32, 8, 64), "F1s": (1, 2048, 32, 8, 128)}
MAX_SMEM = 227 * 1024  # H200 opt-in shared memory per CTA

# name -> (BLOCK_M, BLOCK_N, NUM_WARPS, PRESPLIT) in place of the table's tile
SHAPES = {
    "w8": (128, 16, 8, 1),  # 8 warps: the per-CTA split and loads shared by twice the rows
    "w8p2": (128, 16, 8, 2),  # ... and Q split once (1 CTA/SM either way)
    "n32": (64, 32, 4, 1),  # BLOCK_N 32 at D128 (spilled before the integer TF32 split)
}


# name -> (BLOCK_M, BLOCK_N, NUM_WARPS) of the fp16-pair kernel in place of its table's
PAIR_SHAPES = {
    "w8": (128, 32, 8),  # 8 warps: each K/V tile's loads shared by twice the rows (1 CTA/SM at D128)
    "n64": (64, 64, 4),  # twice the keys per barrier (1 CTA/SM at D128)
    "n16": (64, 16, 4),  # half (3 CTAs/SM at D128)
}


def shape_spec(head_dim: int, mode, shape: str) -> _specs.Spec | None:
    """The causal "highest" kernel at ``head_dim`` with PRESPLIT ``mode`` and ``shape``
    (mode "f16x2": the fp16-pair kernel, of its table or of PAIR_SHAPES)."""
    if mode == "f16x2":
        table = _specs.tiled_f16x2_spec(head_dim, True, _specs.ARCHS["sm_90"])
        if shape == "table" or table is None:
            return table
        if shape not in PAIR_SHAPES:
            return None
        bm, bn, warps = PAIR_SHAPES[shape]
        smem = _specs.tiled_f16x2_smem(head_dim, bm, bn)
        return dataclasses.replace(
            table, name=f"tiled_f16x2_attention<{head_dim}, {bm}, {bn}, {warps}, true, {smem}>", threads=warps * 32,
            block_m=bm, block_n=bn, smem=smem,
        )
    bm, bn, warps, _ = _specs.TILED_F32_TILES[head_dim]
    if shape != "table":
        bm, bn, warps, mode = SHAPES[shape]
    smem = _specs.tiled_f32_smem(head_dim, bm, bn, mode)
    return dataclasses.replace(
        _specs.tiled_f32_spec(head_dim, True, "highest", _specs.ARCHS["sm_90"], "tf32x3"),
        name=f"tiled_tf32_attention<{head_dim}, {bm}, {bn}, {warps}, true, true, {mode}, {smem}>",
        threads=warps * 32,
        block_m=bm,
        smem=smem,
    )


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
    parser.add_argument("--shapes", default="table", help=f"comma-separated, of table, {', '.join({**SHAPES, **PAIR_SHAPES})}")
    parser.add_argument("--repeat", type=int, default=20)
    args = parser.parse_args()
    shapes = args.shapes.split(",")
    for shape in shapes:
        if shape != "table" and shape not in SHAPES and shape not in PAIR_SHAPES:
            parser.error(f"unknown shape {shape!r}")
    results = []
    for name in args.cases.split(","):
        batch, seqlen, hq, hkv, d = CASES[name]
        q, k, v = (cupy.random.standard_normal((batch, seqlen, h, d), dtype=cupy.float32) for h in (hq, hkv, hkv))
        out = cupy.empty_like(q)
        problem = _plan.Problem.of(q, k, dtype="float32", causal=True, softmax_scale=1 / np.sqrt(d))
        base = _plan.plan_tiled(problem, _plan._layout(q, k, v, out), _plan.device_arch(q.device.id))
        params = base.params  # passed by value
        rows = np.linspace(0, seqlen - 1, 24).astype(int)
        done = set()
        table_mode = _specs.TILED_F32_TILES[d][3]
        for mode in (table_mode if m == "t" else m if m == "f16x2" else int(m) for m in args.modes.split(",")):
            for slot, shape in enumerate(shapes):  # a shape listed twice is timed twice (drift)
                if shape != "table" and shape not in (PAIR_SHAPES if mode == "f16x2" else SHAPES):
                    continue  # a shape of the other scheme only ("table" is both's)
                spec = shape_spec(d, mode, shape)
                if spec is None:
                    print(f"{name} {mode}: no such kernel at head dim {d}", flush=True)
                    continue
                if (spec.name, slot) in done:  # a shape fixes its own mode (and f16x2 its own tile)
                    continue
                done.add((spec.name, slot))
                split = "f16x2" if mode == "f16x2" else f"presplit {spec.name.split(', ')[-2]}"
                label = f"{name} {split} {shape:<6}"
                if spec.smem > MAX_SMEM:
                    print(f"{label}: {spec.smem} bytes of shared memory, over {MAX_SMEM}; skipped", flush=True)
                    continue
                try:
                    kern = _compile.get_kernel(spec)
                    regs = kern.num_regs
                except Exception as e:  # compile error: report, go on
                    print(f"{label}: does not compile ({type(e).__name__}: {str(e).splitlines()[0][:200]})", flush=True)
                    continue
                grid = (-(-seqlen * (hq // hkv) // spec.block_m) * batch * hkv,)
                per_sm = cupy.cuda.driver.occupancyMaxActiveBlocksPerMultiprocessor(kern.kernel.ptr, spec.threads, spec.smem)

                if mode == "f16x2":  # its two kernels that make the pairs, then it (a workspace from CuPy's pool)
                    plan = _plan.F16x2Launch.of(_plan.Launch(spec, grid, params, problem), spec)

                    def run():
                        plan(q, k, v, out, None, None)
                else:

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
