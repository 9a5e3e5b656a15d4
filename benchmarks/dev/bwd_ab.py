#!/usr/bin/env python3
"""The 16-bit backward on mma.sync (bwd_dq_mma, bwd_dkdv_mma) against wgmma
(bwd_dq_wgmma, bwd_dkdv_wgmma, sm_90), side by side in one process
(kernels/backward.cu; cupy_gqa._plan.set_bwd_wgmma).

    python3 benchmarks/dev/bwd_ab.py [--cases G1,G2,G2s] [--rounds 3] [--tiles 64x64x2,64x64,128x64]

Per case: the GPU time of cupy_gqa.attention_backward with each pair of
kernels (cupyx.profiler.benchmark, median of 10, the two timed in turn for
--rounds rounds, best of the rounds), how far each one's dk and dv are from
float64 on sampled keys, and how far the wgmma gradients are from the mma.sync
ones (relative error, Frobenius). --tiles: the wgmma kernels' tiles to try, each
"BNxBM[xNWG]": BLOCK_N keys per K/V tile of the dQ kernel, BLOCK_M packed rows per
Q/dO tile of the dK/dV kernel, NWG warpgroups per CTA of both (default 1)
(_specs.BWD_DQ_WGMMA_TILES, BWD_DKDV_WGMMA_TILES; the first is the tables'); a
tile that spills at a head dim (the dK/dV kernel's 128 rows at head dim 128) is
skipped there.
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


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default="G1,G2,G2s")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tiles", default="64x64x2")
    args = parser.parse_args()
    tiles = [tuple(int(x) for x in (t + "x1").split("x")[:3]) for t in args.tiles.split(",")]
    print(f"{cupy.cuda.runtime.getDeviceProperties(0)['name'].decode()}  cupy {cupy.__version__}")
    for name in args.cases.split(","):
        batch, n, hq, hkv, d = CASES[name]
        rng = np.random.default_rng(0)
        q, k, v, dout = (
            cupy.asarray(rng.standard_normal((batch, n, h, d), dtype=np.float32).astype(ml_dtypes.bfloat16))
            for h in (hq, hkv, hkv, hq)
        )
        out, lse = cupy_gqa.attention(q, k, v, return_lse=True)
        configs = [None] + [t for t in tiles if not (d == 128 and t[1] == 128)]  # None: mma.sync
        table = (_specs.BWD_DQ_WGMMA_TILES[d], _specs.BWD_DKDV_WGMMA_TILES[d])

        def use(config):
            if config is not None:
                _specs.BWD_DQ_WGMMA_TILES[d] = (config[0], config[2])
                _specs.BWD_DKDV_WGMMA_TILES[d] = (config[1], config[2])
                _specs.bwd_dq_wgmma_spec.cache_clear()
                _specs.bwd_dkdv_wgmma_spec.cache_clear()
            _plan.set_bwd_wgmma(config is not None)  # (and forgets the plans)

        def run():
            return cupy_gqa.attention_backward(dout, q, k, v, out, lse)

        def launched(config):  # the dQ and dK/dV kernels a call under ``config`` launches
            use(config)
            names, get = [], _plan.get_kernel
            _plan.get_kernel = lambda spec: names.append(spec.name) or get(spec)
            try:
                run()
            finally:
                _plan.get_kernel = get
            return " + ".join(n.split("<")[0] for n in names[1:])

        print(f"{name}: mma.sync config launches {launched(None)}; wgmma config {launched(configs[1])}", flush=True)

        grads, times = {}, {c: math.inf for c in configs}
        for _ in range(args.rounds):
            for config in configs:
                use(config)
                grads[config] = run()
                t = benchmark(run, (), n_repeat=10, n_warmup=2)
                times[config] = min(times[config], float(np.median(t.gpu_times)) * 1e3)
        _specs.BWD_DQ_WGMMA_TILES[d], _specs.BWD_DKDV_WGMMA_TILES[d] = table  # the tables' tiles again
        _specs.bwd_dq_wgmma_spec.cache_clear()
        _specs.bwd_dkdv_wgmma_spec.cache_clear()
        _plan.set_bwd_wgmma(False)
        for config in configs[2:]:
            print(f"{name} wgmma tiles {'x'.join(map(str, config))}: {times[config]:.3f} ms "
                  f"({times[config] / times[None]:.3f}x mma)")
        times = {False: times[None], True: times[configs[1]]}
        grads = {False: grads[None], True: grads[configs[1]]}
        keys = np.linspace(0, n - 1, 16).astype(int)
        ref_dk, ref_dv = reference_dk_dv(q, k, v, dout, keys, 0)
        err = {}
        for on in (False, True):
            dk, dv = (cupy.asnumpy(x[0, keys, 0]).astype(np.float64) for x in grads[on][1:])
            err[on] = (rel(dk, ref_dk), rel(dv, ref_dv))
        mma_g, wg_g = ([cupy.asnumpy(x).astype(np.float64) for x in grads[on]] for on in (False, True))
        print(
            f"{name}: mma {times[False]:.3f} ms, wgmma {'x'.join(map(str, configs[1]))} {times[True]:.3f} ms "
            f"({times[True] / times[False]:.3f}x); "
            f"sampled dk/dv error vs float64: mma {err[False][0]:.2e}/{err[False][1]:.2e}, "
            f"wgmma {err[True][0]:.2e}/{err[True][1]:.2e}; wgmma vs mma dq/dk/dv "
            + "/".join(f"{rel(w, m):.2e}" for w, m in zip(wg_g, mma_g)),
            flush=True,
        )


if __name__ == "__main__":
    main()
