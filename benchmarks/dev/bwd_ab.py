#!/usr/bin/env python3
"""The 16-bit backward's kernels on sm_90 side by side in one process: mma.sync
(bwd_dq_mma, bwd_dkdv_mma) and wgmma with a producer warpgroup (bwd_dq_ws,
bwd_dkdv_ws) at chosen tiles (kernels/backward.cu; cupy_gqa._plan.set_bwd_sm90).

    python3 benchmarks/dev/bwd_ab.py [--cases G1,G2,G2s] [--rounds 3]
        [--configs mma,ws:64x64x2,ws:64x64x3]

Per case: the GPU time of cupy_gqa.attention_backward under each configuration
(cupyx.profiler.benchmark, median of 10, the configurations timed in turn for
--rounds rounds, best of the rounds), the kernels each one launches, how far its
dk and dv are from float64 on sampled keys, and how far its gradients are from
the first configuration's (relative error, Frobenius). A configuration is "mma"
or "ws:BNxBMxSTAGES": BLOCK_N keys per K/V tile of the dQ kernel, BLOCK_M packed
rows per Q/dO tile of the dK/dV kernel, STAGES stages of the producer's rings
(_specs.BWD_DQ_WS_TILES, BWD_DKDV_WS_TILES).
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

# name: (batch, seqlen, num_q_heads, num_kv_heads, head_dim), bf16, causal
CASES = {
    "G1": (4, 4096, 32, 8, 128),
    "G2": (4, 2048, 32, 8, 64),
    "G2s": (2, 1000, 28, 4, 128),  # a length that is not a multiple of the tiles, group 7
}


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
    """("mma", None) or ("ws", (BN, BM, STAGES))."""
    kind, _, tiles = config.partition(":")
    if kind not in _specs.BWD_SM90_KINDS or (kind == "mma") != (not tiles):
        raise SystemExit(f"--configs: {config!r} is not mma or ws:BNxBMxSTAGES")
    return kind, tuple(int(x) for x in tiles.split("x")) if tiles else None


def use(config, d):
    """Make the calls take ``config`` at padded head dim d (and forget the plans)."""
    kind, tiles = config
    if kind == "ws":
        _specs.BWD_DQ_WS_TILES[d] = (tiles[0], tiles[2])
        _specs.BWD_DKDV_WS_TILES[d] = (tiles[1], tiles[2])
    _specs.bwd_ws_spec.cache_clear()
    _plan.set_bwd_sm90(kind)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default="G1,G2,G2s")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--configs", default="mma,ws:64x64x2,ws:64x64x3")
    args = parser.parse_args()
    all_configs = [parse(c) for c in args.configs.split(",")]
    print(f"{cupy.cuda.runtime.getDeviceProperties(0)['name'].decode()}  cupy {cupy.__version__}")
    tables = [dict(t) for t in (_specs.BWD_DQ_WS_TILES, _specs.BWD_DKDV_WS_TILES)]
    default_kind = _specs.BWD_SM90
    for name in args.cases.split(","):
        batch, n, hq, hkv, d = CASES[name]
        rng = np.random.default_rng(0)
        q, k, v, dout = (
            cupy.asarray(rng.standard_normal((batch, n, h, d), dtype=np.float32).astype(ml_dtypes.bfloat16))
            for h in (hq, hkv, hkv, hq)
        )
        out, lse = cupy_gqa.attention(q, k, v, return_lse=True)
        configs = all_configs

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
            return " + ".join(n.split("<")[0] for n in names[1:])

        label = {c: c[0] + (":" + "x".join(map(str, c[1])) if c[1] else "") for c in configs}
        for c in configs:
            print(f"{name} {label[c]} launches {launched(c)}", flush=True)
        grads, times = {}, {c: math.inf for c in configs}
        for _ in range(args.rounds):
            for config in configs:
                use(config, d)
                grads[config] = run()
                t = benchmark(run, (), n_repeat=10, n_warmup=2)
                times[config] = min(times[config], float(np.median(t.gpu_times)) * 1e3)
        for table, kept in zip((_specs.BWD_DQ_WS_TILES, _specs.BWD_DKDV_WS_TILES), tables):
            table.clear()
            table.update(kept)  # the tables' tiles again
        _plan.set_bwd_sm90(default_kind)  # the calls' own again
        keys = np.linspace(0, n - 1, 16).astype(int)
        ref_dk, ref_dv = reference_dk_dv(q, k, v, dout, keys, 0)
        first = [cupy.asnumpy(x).astype(np.float64) for x in grads[configs[0]]]
        for c in configs:
            dk, dv = (cupy.asnumpy(x[0, keys, 0]).astype(np.float64) for x in grads[c][1:])
            mine = [cupy.asnumpy(x).astype(np.float64) for x in grads[c]]
            print(
                f"{name} {label[c]:16s} {times[c]:.3f} ms ({times[c] / times[configs[0]]:.3f}x {label[configs[0]]}); "
                f"sampled dk/dv error vs float64 {rel(dk, ref_dk):.2e}/{rel(dv, ref_dv):.2e}; "
                f"dq/dk/dv vs {label[configs[0]]} " + "/".join(f"{rel(a, b):.2e}" for a, b in zip(mine, first)),
                flush=True,
            )


if __name__ == "__main__":
    main()
