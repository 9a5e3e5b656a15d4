#!/usr/bin/env python3
"""The backward's tensor-core kernels side by side in one process: for 16-bit
cases on sm_90, mma.sync (bwd_dq_mma, bwd_dkdv_mma) and wgmma with a producer
warpgroup (bwd_dq_ws, bwd_dkdv_ws) at chosen tiles (kernels/backward.cu;
cupy_gqa._plan.set_bwd_sm90); for float32 cases, split TF32 (bwd_dq_tf32,
bwd_dkdv_tf32) at chosen tiles.

    python3 benchmarks/dev/bwd_ab.py [--cases G1,G2,G2s] [--rounds 3]
        [--configs mma,ws:64x64x2,ws:64x64x3]
    python3 benchmarks/dev/bwd_ab.py --cases G3,G3s,G3d \
        --configs tf32:64x32x4x1x1/4x32x1,tf32:128x16x8x1x1/8x32x1

Per case: the GPU time of cupy_gqa.attention_backward under each configuration
(cupyx.profiler.benchmark, median of 10, the configurations timed in turn for
--rounds rounds, best of the rounds), the kernels each one launches, how far its
dk and dv are from float64 on sampled keys, and how far its gradients are from
the first configuration's (relative error, Frobenius). A configuration is "mma"
or "ws:BNxBMxSTAGES": BLOCK_N keys per K/V tile of the dQ kernel, BLOCK_M packed
rows per Q/dO tile of the dK/dV kernel, STAGES stages of the producer's rings
(_specs.BWD_DQ_WS_TILES, BWD_DKDV_WS_TILES), or "tf32:DQ/DKDV" with DQ =
BMxBNxSLABSxDSPLITxPRESPLIT and DKDV = KWxBMxDSPLIT (_specs.BWD_TF32_DQ_TILES,
BWD_TF32_DKDV_TILES; the kernels lower them where they do not fit). A case runs
the configurations of its dtype's kinds.
"""
import argparse
import math
import sys
from pathlib import Path

import ml_dtypes
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import cupy  # noqa: E402
from cupyx.profiler import benchmark  # noqa: E402

import cupy_gqa  # noqa: E402
from cupy_gqa import _plan, _specs  # noqa: E402

# name: (batch, seqlen, num_q_heads, num_kv_heads, head_dim, dtype), causal
CASES = {
    "G1": (4, 4096, 32, 8, 128, "bfloat16"),
    "G2": (4, 2048, 32, 8, 64, "bfloat16"),
    "G2s": (2, 1000, 28, 4, 128, "bfloat16"),  # a length that is not a multiple of the tiles, group 7
    "G3": (4, 1024, 32, 8, 64, "float32"),
    "G3s": (2, 1000, 28, 4, 64, "float32"),
    "G3d": (2, 2048, 32, 8, 128, "float32"),
    "G3l": (1, 4096, 32, 4, 64, "float32"),
}
KINDS = {"bfloat16": ("mma", "ws"), "float32": ("tf32",)}


def reference_dk_dv(q, k, v, dout, keys, kvh):
    """float64 dk, dv of KV head kvh of batch 0 at the given keys (causal, seqlen_q == seqlen_k)."""
    qh, kh, vh, dh = (cupy.asnumpy(x[0]).astype(np.float64) for x in (q, k, v, dout))
    n, group, d = qh.shape[0], qh.shape[1] // kh.shape[1], qh.shape[2]
    scale = 1 / math.sqrt(d)
    dk = np.zeros((len(keys), d))
    dv = np.zeros((len(keys), d))
    for g in range(group):
        h = kvh * group + g
        s = qh[:, h] @ kh[:, kvh].T * scale
        s = np.where(np.arange(n)[None, :] > np.arange(n)[:, None], -np.inf, s)
        p = np.exp(s - s.max(1, keepdims=True))
        p /= p.sum(1, keepdims=True)
        dp = dh[:, h] @ vh[:, kvh].T
        ds = p * (dp - (dp * p).sum(1, keepdims=True))
        dk += (ds.T @ qh[:, h])[keys] * scale
        dv += (p.T @ dh[:, h])[keys]
    return dk, dv


def rel(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def parse(config):
    """("mma", None), ("ws", (BN, BM, STAGES)) or ("tf32", ((BM, BN, SLABS, DSPLIT, PRESPLIT), (KW, BM, DSPLIT)))."""
    kind, _, tiles = config.partition(":")
    try:
        if kind == "mma" and not tiles:
            return kind, None
        if kind == "ws":
            ws = tuple(int(x) for x in tiles.split("x"))
            if len(ws) == 3:
                return kind, ws
        if kind == "tf32":
            dq, dkdv = (tuple(int(x) for x in part.split("x")) for part in tiles.split("/"))
            if len(dq) == 5 and len(dkdv) == 3:
                return kind, (dq, dkdv)
    except ValueError:
        pass
    raise SystemExit(f"--configs: {config!r} is not mma, ws:BNxBMxSTAGES or tf32:BMxBNxSLABSxDSPLITxPRESPLIT/KWxBMxDSPLIT")


TABLES = (_specs.BWD_DQ_WS_TILES, _specs.BWD_DKDV_WS_TILES, _specs.BWD_TF32_DQ_TILES, _specs.BWD_TF32_DKDV_TILES)


def use(config, d):
    """Make the calls take ``config`` at padded head dim d (and forget the plans)."""
    kind, tiles = config
    if kind == "ws":
        _specs.BWD_DQ_WS_TILES[d] = (tiles[0], tiles[2])
        _specs.BWD_DKDV_WS_TILES[d] = (tiles[1], tiles[2])
    if kind == "tf32":
        _specs.BWD_TF32_DQ_TILES[d], _specs.BWD_TF32_DKDV_TILES[d] = tiles
    for spec in (_specs.bwd_ws_spec, _specs.bwd_dq_tf32_spec, _specs.bwd_dkdv_tf32_spec):
        spec.cache_clear()
    _plan.set_bwd_sm90(kind if kind in _specs.BWD_SM90_KINDS else _specs.BWD_SM90)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default="G1,G2,G2s")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--configs", default="mma,ws:64x64x2,ws:64x64x3")
    args = parser.parse_args()
    all_configs = [parse(c) for c in args.configs.split(",")]
    print(f"{cupy.cuda.runtime.getDeviceProperties(0)['name'].decode()}  cupy {cupy.__version__}")
    tables = [dict(t) for t in TABLES]
    default_kind = _specs.BWD_SM90
    for name in args.cases.split(","):
        batch, n, hq, hkv, d, dtype = CASES[name]
        rng = np.random.default_rng(0)
        host_dtype = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float32
        q, k, v, dout = (
            cupy.asarray(rng.standard_normal((batch, n, h, d), dtype=np.float32).astype(host_dtype))
            for h in (hq, hkv, hkv, hq)
        )
        out, lse = cupy_gqa.attention(q, k, v, return_lse=True)
        configs = [c for c in all_configs if c[0] in KINDS[dtype]]
        if not configs:
            continue

        def run():
            return cupy_gqa.attention_backward(dout, q, k, v, out, lse)

        def launched(config):  # the dQ and dK/dV kernels a call under ``config`` launches
            use(config, d)
            names, get = [], _plan.get_kernel
            _plan.get_kernel = lambda spec: names.append(spec.name) or get(spec)
            try:
                run()
            finally:
                _plan.get_kernel = get
            return " + ".join(n for n in names[1:])

        label = {c: c[0] + (":" + "/".join("x".join(map(str, t)) for t in c[1]) if c[0] == "tf32" else ":" + "x".join(map(str, c[1])) if c[1] else "") for c in configs}
        for c in configs:
            print(f"{name} {label[c]} launches {launched(c)}", flush=True)
        grads, times = {}, {c: math.inf for c in configs}
        for _ in range(args.rounds):
            for config in configs:
                use(config, d)
                grads[config] = run()
                t = benchmark(run, (), n_repeat=10, n_warmup=2)
                times[config] = min(times[config], float(np.median(t.gpu_times)) * 1e3)
        for table, kept in zip(TABLES, tables):
            table.clear()
            table.update(kept)  # the tables' tiles again
        use(("mma", None), d)
        _plan.set_bwd_sm90(default_kind)  # the calls' own again
        keys = np.linspace(0, n - 1, 16).astype(int)
        ref_dk, ref_dv = reference_dk_dv(q, k, v, dout, keys, 0)
        first = [cupy.asnumpy(x).astype(np.float64) for x in grads[configs[0]]]
        for c in configs:
            dk, dv = (cupy.asnumpy(x[0, keys, 0]).astype(np.float64) for x in grads[c][1:])
            mine = [cupy.asnumpy(x).astype(np.float64) for x in grads[c]]
            print(
                f"{name} {label[c]:24s} {times[c]:.3f} ms ({times[c] / times[configs[0]]:.3f}x {label[configs[0]]}); "
                f"sampled dk/dv error vs float64 {rel(dk, ref_dk):.2e}/{rel(dv, ref_dv):.2e}; "
                f"dq/dk/dv vs {label[configs[0]]} " + "/".join(f"{rel(a, b):.2e}" for a, b in zip(mine, first)),
                flush=True,
            )


if __name__ == "__main__":
    main()
