#!/usr/bin/env python3
"""Decode's launch choices measured against the cost model: for each chosen
case (bench_attention's CASES and SHAPE_SWEEP), every rows-per-CTA layout
(block_m) of the tensor-core decode kernel at several split counts, timed,
beside decode_seconds' time for the same launch and decode_dispatch's choice.

    python benchmarks/dev/decode_layouts.py --cases D01,D06,D15,D16 [--splits 1,2,4,8,16,32,64] [--out DIR]

Timing: CuPy events around one launch of a kept plan (decode kernel and
combine) with a kept workspace, decode_dev.py's median of 30, each after a 256 MB
buffer is zeroed (L2 flushed, and the host's head start), as bench_attention's
timer and as a model's decode step finds its layer's K/V; with --warm, around
CALLS back-to-back launches, no flush (K/V that fit stay in L2). Notes:
benchmarks/NOTES_decode.md.
"""
import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import cupy  # noqa: E402

from bench_attention import CASES, SHAPE_SWEEP  # noqa: E402
from decode_dev import median_ms as flushed_ms  # noqa: E402  (one launch after an L2 flush)
from profile_decode import DTYPES as HALF_DTYPES  # noqa: E402
from cupy_gqa import _plan, _specs  # noqa: E402

REPS, CALLS = 15, 20
DTYPES = {**HALF_DTYPES, "fp32": ("float32", np.float32)}


def median_ms(fn) -> float:
    """The median over REPS of the time of CALLS back-to-back launches, per launch
    (the GPU runs behind the host, so launches' host time is hidden): --warm."""
    fn()
    times = []
    for _ in range(REPS):
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        start.record()
        for _ in range(CALLS):
            fn()
        end.record()
        end.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, end) / CALLS)
    return float(np.median(times))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="D01,D06,D15,D16")
    ap.add_argument("--splits", default="1,2,4,8,16,32,64")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--warm", action="store_true", help="back-to-back launches, no L2 flush")
    args = ap.parse_args()
    by_name = {c.name: c for c in (*CASES, *SHAPE_SWEEP)}
    device = cupy.cuda.Device().id
    sms, arch = _plan.sm_count(device), _plan.device_arch(device)
    rows_out, lines = [], []
    say = lambda s: (print(s, flush=True), lines.append(s))  # noqa: E731
    for name in args.cases.split(","):
        c = by_name[name]
        dtype, np_dtype = DTYPES[c.dtype]
        rnd = lambda *s: cupy.random.standard_normal(s, dtype=cupy.float32).astype(np_dtype)  # noqa: E731
        q = rnd(c.batch, c.seqlen_q, c.num_q_heads, c.head_dim)
        k = rnd(c.batch, c.seqlen_k, c.num_kv_heads, c.head_dim)
        v = rnd(c.batch, c.seqlen_k, c.num_kv_heads, c.head_dim)
        out = cupy.empty_like(q)
        problem = _plan.Problem.of(q, k, dtype=dtype, causal=True, softmax_scale=1 / np.sqrt(c.head_dim))
        choice = _plan.decode_dispatch(problem, sms, arch)
        say(f"{name}: B{c.batch} Sq{c.seqlen_q} Sk{c.seqlen_k} Hq{c.num_q_heads} Hkv{c.num_kv_heads} D{c.head_dim} "
            f"{dtype}: model's choice block_m {choice.block_m}, {choice.num_splits} splits ({choice.decode_s * 1e6:.1f} us)")
        most = max(1, min(_plan.DECODE_MAX_SPLITS, c.seqlen_k // _plan.DECODE_MIN_SPLIT_KEYS))
        splits = sorted({*(int(x) for x in args.splits.split(",") if int(x) <= most), choice.num_splits})
        for block_m in _specs.decode_block_ms(dtype):
            spec = _specs.decode_spec(dtype, c.head_dim, block_m, arch)
            if spec is None:
                continue
            cells = []
            for ns in splits:
                launch = _plan._decode_plan(problem, _plan._layout(q, k, v, out), spec, ns)
                ws = cupy.empty(max(1, launch.workspace_bytes // 4), dtype=cupy.float32)
                launch(q, k, v, out, None, None, ws)  # compiles and checks; then the packed launch alone
                packed, stream = launch.packed(), cupy.cuda.get_current_stream().ptr
                addr = [a.data.ptr for a in (q, k, v, out, ws)]
                fn = lambda packed=packed, addr=addr, ns=ns: packed(  # noqa: E731
                    stream, addr[0], addr[1], addr[2], addr[3], 0, 0, addr[4] if ns > 1 else 0)
                ms = median_ms(fn) if args.warm else flushed_ms(fn)
                model = _plan.decode_seconds(problem, spec, ns, sms, arch)
                rows_out.append(dict(case=name, block_m=block_m, splits=ns, us=ms * 1e3, model_us=model * 1e6))
                cells.append(f"{ns}:{ms * 1e3:.1f}/{model * 1e6:.1f}")
            say(f"  block_m {block_m:2d}  splits:measured/model us  " + "  ".join(cells))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "decode_layouts.json").write_text(json.dumps(rows_out, indent=1))
        (args.out / "decode_layouts.txt").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
