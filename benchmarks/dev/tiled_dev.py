#!/usr/bin/env python3
"""Standalone dev harness for kernels/tiled.cu (tensor-core GQA prefill).

Compiles tiled_attention<...> instantiations with cupy.RawModule (NVRTC),
checks them against a float64 reference and times them next to torch SDPA
(flash and cuDNN backends).

    python benchmarks/dev/tiled_dev.py --check --bench [--out DIR]

Compilation of many instantiations is pre-warmed in parallel (spawned
processes fill CuPy's on-disk kernel cache; the main process then hits it).
"""
import argparse
import json
import math
import os
import sys
import time

import warnings

import numpy as np

warnings.filterwarnings("ignore", category=DeprecationWarning)

HERE = os.path.dirname(os.path.abspath(__file__))

TNAME = {"fp16": "__half", "bf16": "__nv_bfloat16"}

# dtype-independent default table: head_dim -> (BLOCK_M, BLOCK_N, NUM_WARPS, defines)
DEFAULT_TABLE = {
    32: (128, 64, 4, ()),
    64: (128, 64, 4, ()),
    96: (128, 64, 8, ()),
    128: (128, 64, 4, ()),
    256: (64, 32, 4, ()),
}

# variants timed per head dim: (BLOCK_M, BLOCK_N, NUM_WARPS, defines)
BENCH_VARIANTS = {
    128: [(128, 64, 4, ()), (256, 64, 8, ()), (128, 32, 4, ())],
    64: [(128, 64, 4, ()), (128, 128, 4, ()), (128, 32, 4, ()), (128, 64, 8, ()), (256, 64, 8, ()), (64, 64, 4, ())],
}

# name, dtype, causal, B, S, Hq, Hkv, D
BENCH_SHAPES = [
    ("H1", "bf16", True, 4, 4096, 32, 8, 128),
    ("H2", "bf16", True, 1, 16384, 32, 8, 128),
    ("H3", "fp16", True, 16, 512, 32, 8, 128),
    ("H4", "bf16", True, 4, 2048, 32, 8, 64),
    ("N1", "bf16", False, 4, 4096, 32, 8, 128),
]


def smem_bytes(head_dim, block_m, block_n):
    """Dynamic shared memory of tiled_attention (cupy_gqa/_specs.py: tiled_smem)."""
    sys.path.insert(0, os.path.join(HERE, "..", ".."))
    from cupy_gqa._specs import tiled_smem

    return tiled_smem(head_dim, block_m, block_n)


def name_expr(dtype, d, bm, bn, nw, causal):
    return "tiled_attention<%s, %d, %d, %d, %d, %s, %d>" % (
        TNAME[dtype], d, bm, bn, nw, "true" if causal else "false", smem_bytes(d, bm, bn))


_SRC = None
_KERNELS = {}


def _src():
    global _SRC
    if _SRC is None:  # tiled.cu with its local includes inlined, as the package compiles it
        sys.path.insert(0, os.path.join(HERE, "..", ".."))
        from cupy_gqa._compile import source

        _SRC = source("tiled.cu")
    return _SRC


def get_kernel(dtype, d, bm, bn, nw, causal, defines=()):
    import cupy as cp
    key = (dtype, d, bm, bn, nw, causal, tuple(defines))
    if key not in _KERNELS:
        ne = name_expr(dtype, d, bm, bn, nw, causal)
        mod = cp.RawModule(code=_src(), options=("-std=c++17",) + tuple(defines), name_expressions=[ne])
        ker = mod.get_function(ne)
        ker.max_dynamic_shared_size_bytes = smem_bytes(d, bm, bn)
        _KERNELS[key] = ker
    return _KERNELS[key]


def _warm_one(key):
    try:
        import cupy as cp
        dtype, d, bm, bn, nw, causal, defines = key
        ne = name_expr(dtype, d, bm, bn, nw, causal)
        mod = cp.RawModule(code=_src(), options=("-std=c++17",) + tuple(defines), name_expressions=[ne])
        f = mod.get_function(ne)
        return key, "regs=%d local=%dB" % (f.num_regs, f.local_size_bytes)
    except Exception as e:  # reported, then re-raised in the main process
        return key, "FAILED: %r" % (e,)


def prewarm(keys, procs=16):
    import multiprocessing as mp
    keys = sorted(set(keys))
    t0 = time.time()
    with mp.get_context("spawn").Pool(min(procs, len(keys))) as pool:
        res = pool.map(_warm_one, keys)
    print("compiled %d instantiations in %.1fs" % (len(keys), time.time() - t0))
    for key, info in res:
        print("  %-55s %-24s %s" % (name_expr(*key[:6]), " ".join(key[6]) or "-", info))
    return dict(res)


def launch(q, k, v, causal, cfg, out=None, lse=None, scale=None):
    """q (B,Sq,Hq,D), k/v (B,Sk,Hkv,D) torch tensors (any strides, last dim 1)."""
    import cupy as cp
    import torch
    B, Sq, Hq, D = q.shape
    Sk, Hkv = k.shape[1], k.shape[2]
    bm, bn, nw, defines = cfg
    dtype = "fp16" if q.dtype == torch.float16 else "bf16"
    ker = get_kernel(dtype, D, bm, bn, nw, causal, defines)
    G = Hq // Hkv
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if scale is None:
        scale = 1.0 / math.sqrt(D)
    m_tiles = (Sq * G + bm - 1) // bm
    grid = (m_tiles * B * Hkv,)
    # the kernels' one parameter struct (kernels/common.cuh: AttnParams)
    from cupy_gqa._plan import PARAMS_DTYPE

    params = np.zeros(1, PARAMS_DTYPE)
    for name, t in (("q_stride", q), ("k_stride", k), ("v_stride", v), ("o_stride", out)):
        params[name] = t.stride()
    params["scale_log2"] = scale * math.log2(math.e)
    params["batch"], params["seqlen_q"], params["seqlen_k"] = B, Sq, Sk
    params["num_q_heads"], params["num_kv_heads"], params["group_size"], params["head_dim"] = Hq, Hkv, G, D
    params["causal"] = causal
    args = (
        np.uint64(q.data_ptr()), np.uint64(k.data_ptr()), np.uint64(v.data_ptr()), np.uint64(out.data_ptr()),
        np.uint64(lse.data_ptr() if lse is not None else 0), np.uint64(0), params,  # seqlens_k: none
    )
    if grid[0] > 0:
        with cp.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream):
            ker(grid, (nw * 32,), args, shared_mem=smem_bytes(D, bm, bn))
    return out


# ----------------------------------------------------------------------------
# correctness
# ----------------------------------------------------------------------------
def reference(q, k, v, causal, scale):
    """float64 reference: out (B,Sq,Hq,D) and lse (B,Hq,Sq); bottom-right causal."""
    import torch
    B, Sq, Hq, D = q.shape
    Sk, Hkv = k.shape[1], k.shape[2]
    G = Hq // Hkv
    qd = q.double().permute(0, 2, 1, 3)
    kd = k.double().permute(0, 2, 1, 3).repeat_interleave(G, dim=1)
    vd = v.double().permute(0, 2, 1, 3).repeat_interleave(G, dim=1)
    s = (qd @ kd.transpose(-1, -2)) * scale
    if causal:
        t = torch.arange(Sq, device=q.device)[:, None]
        j = torch.arange(Sk, device=q.device)[None, :]
        s = s.masked_fill(j > t + (Sk - Sq), float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse[..., None])
    p = torch.nan_to_num(p, nan=0.0)
    o = (p @ vd).permute(0, 2, 1, 3)
    return o, lse


def torch_error(q, k, v, causal, scale, ref):
    """Relative error of torch SDPA in the input dtype on the same inputs."""
    import torch
    import torch.nn.functional as F
    Sq, Sk = q.shape[1], k.shape[1]
    mask = None
    if causal:
        t = torch.arange(Sq, device=q.device)[:, None]
        j = torch.arange(Sk, device=q.device)[None, :]
        mask = j <= t + (Sk - Sq)
    try:
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           attn_mask=mask, scale=scale, enable_gqa=True).transpose(1, 2)
    except Exception:
        return float("nan")
    o = torch.nan_to_num(o.double(), nan=0.0)
    if causal:  # rows with no visible key: our convention is 0
        vis = mask.any(dim=1)
        o[:, ~vis] = 0
    return rel_err(o, ref)


def rel_err(a, ref):
    n = ref.norm().item()
    d = (a.double() - ref).norm().item()
    return d / n if n > 0 else d


def check_one(dtype, d, cfg, B, Sq, Sk, Hq, Hkv, causal, strided, gen, verbose=False, qscale=1.0):
    import torch
    tdt = torch.float16 if dtype == "fp16" else torch.bfloat16
    dev = "cuda"
    scale = 1.0 / math.sqrt(d)
    if strided:
        # q, k, v as slices of a packed (B, S, Hq + 2 Hkv, D) tensor (Sq == Sk needed)
        S = max(Sq, Sk)
        qkv = torch.randn(B, S, Hq + 2 * Hkv, d, device=dev, generator=gen).to(tdt)
        q = qkv[:, :Sq, :Hq]
        k = qkv[:, :Sk, Hq:Hq + Hkv]
        v = qkv[:, :Sk, Hq + Hkv:]
    else:
        q = (qscale * torch.randn(B, Sq, Hq, d, device=dev, generator=gen)).to(tdt)
        k = torch.randn(B, Sk, Hkv, d, device=dev, generator=gen).to(tdt)
        v = torch.randn(B, Sk, Hkv, d, device=dev, generator=gen).to(tdt)
    # output: a strided view into a NaN-poisoned buffer twice as wide in heads
    out_big = torch.full((B, Sq, 2 * Hq, d), float("nan"), device=dev, dtype=tdt)
    out = out_big[:, :, :Hq]
    lse_big = torch.full((B * Hq * Sq + 64,), float("nan"), device=dev, dtype=torch.float32)
    lse = lse_big[:B * Hq * Sq].view(B, Hq, Sq)
    launch(q, k, v, causal, cfg, out=out, lse=lse, scale=scale)
    torch.cuda.synchronize()
    ref_o, ref_lse = reference(q, k, v, causal, scale)
    problems = []
    if torch.isnan(out).any():
        problems.append("NaN/unwritten output")
    if not torch.isnan(out_big[:, :, Hq:]).all() or not torch.isnan(lse_big[B * Hq * Sq:]).all():
        problems.append("write outside output")
    err = rel_err(torch.nan_to_num(out.double(), nan=1e9), ref_o)
    terr = torch_error(q, k, v, causal, scale, ref_o)
    cap = 2e-3 if dtype == "fp16" else 1.6e-2
    allowed = cap if math.isnan(terr) else min(cap, terr * 1.25 + (1e-4 if dtype == "fp16" else 5e-4))
    if not err <= allowed:
        problems.append("err %.3g > allowed %.3g (torch %.3g)" % (err, allowed, terr))
    # lse: -inf exactly where the reference is -inf, close elsewhere
    fin = torch.isfinite(ref_lse)
    if torch.isnan(lse).any():
        problems.append("NaN/unwritten lse")
    if not torch.equal(torch.isneginf(lse), ~fin):
        problems.append("lse -inf pattern")
    if fin.any():
        lerr = (lse.double()[fin] - ref_lse[fin]).abs() / ref_lse[fin].abs().clamp(min=1.0)
        if lerr.max().item() > 1e-3:
            problems.append("lse err %.3g" % lerr.max().item())
    ok = not problems
    if verbose or not ok:
        print("  %s %s D%d cfg=%s B%d Sq%d Sk%d Hq%d Hkv%d causal=%d strided=%d err=%.3g torch=%.3g %s" % (
            "ok  " if ok else "FAIL", dtype, d, cfg[:3] + (" ".join(cfg[3]) or "-",), B, Sq, Sk, Hq, Hkv,
            causal, strided, err, terr, "; ".join(problems)))
    return ok, err, terr


def run_checks(head_dims):
    import torch
    gen = torch.Generator(device="cuda")
    gen.manual_seed(1234)
    lengths = [(1, 1), (113, 203), (1023, 1024), (64, 1), (7, 1000), (257, 57)]
    groups = [(2, 2), (8, 2), (7, 1), (8, 1)]
    n = fails = 0
    worst = {}
    for dtype in ("fp16", "bf16"):
        for d in head_dims:
            cfg = DEFAULT_TABLE[d]
            for causal in (True, False):
                for (Sq, Sk) in lengths:
                    for (Hq, Hkv) in groups:
                        B = 1 if Sq * Sk > 200000 else 2
                        ok, err, terr = check_one(dtype, d, cfg, B, Sq, Sk, Hq, Hkv, causal, False, gen)
                        n += 1
                        fails += not ok
                        w = worst.get((dtype, d), (0, 0))
                        worst[(dtype, d)] = (max(w[0], err), max(w[1], terr if not math.isnan(terr) else 0))
                # strided packed qkv input
                ok, _, _ = check_one(dtype, d, cfg, 2, 300, 300, 8, 2, causal, True, gen, verbose=True)
                n += 1
                fails += not ok
    # large scores: the running max keeps growing across KV tiles (exercises rescaling)
    for dtype in ("fp16", "bf16"):
        for d in head_dims:
            for causal in (True, False):
                for qs in (4.0, 12.0):
                    ok, _, _ = check_one(dtype, d, DEFAULT_TABLE[d], 1, 1023, 1024, 8, 2, causal, False, gen,
                                         verbose=True, qscale=qs)
                    n += 1
                    fails += not ok
    # every bench variant on a few shapes
    for d, variants in BENCH_VARIANTS.items():
        if d not in head_dims:
            continue
        for cfg in variants:
            for dtype in ("fp16", "bf16"):
                for causal in (True, False):
                    for (Sq, Sk, Hq, Hkv) in [(1023, 1024, 8, 2), (257, 57, 7, 1), (113, 203, 8, 1)]:
                        ok, _, _ = check_one(dtype, d, cfg, 1, Sq, Sk, Hq, Hkv, causal, False, gen)
                        n += 1
                        fails += not ok
    print("checks: %d run, %d failed" % (n, fails))
    for (dtype, d), (e, t) in sorted(worst.items()):
        print("  worst rel err %s D%-3d ours %.3g  torch %.3g" % (dtype, d, e, t))
    return fails


# ----------------------------------------------------------------------------
# timing
# ----------------------------------------------------------------------------
def time_fn(fn, warmup=5, reps=25):
    """Median over `reps` event pairs; each pair brackets `inner` back-to-back
    launches (inner chosen so a pair covers >= ~2 ms), so Python launch overhead
    (cupy argument marshalling, torch dispatch) is hidden behind GPU work and
    the number is GPU time per call."""
    import torch
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    a = torch.cuda.Event(enable_timing=True)
    b = torch.cuda.Event(enable_timing=True)
    a.record(); fn(); b.record(); b.synchronize()
    est = max(a.elapsed_time(b), 1e-3)
    inner = max(1, min(50, int(2.0 / est)))
    ts = []
    for _ in range(reps):
        a.record()
        for _ in range(inner):
            fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) / inner)
    return float(np.median(ts))


def flops(B, S, Hq, D, causal):
    pairs = S * (S + 1) // 2 if causal else S * S
    return 4.0 * D * pairs * B * Hq


def run_bench(shapes, variants_for):
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel, SDPBackend
    rows = []
    for (name, dtype, causal, B, S, Hq, Hkv, D) in shapes:
        tdt = torch.float16 if dtype == "fp16" else torch.bfloat16
        q = torch.randn(B, S, Hq, D, device="cuda", dtype=tdt)
        k = torch.randn(B, S, Hkv, D, device="cuda", dtype=tdt)
        v = torch.randn(B, S, Hkv, D, device="cuda", dtype=tdt)
        fl = flops(B, S, Hq, D, causal)
        res = {}
        qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        for label, be in (("torch_flash", SDPBackend.FLASH_ATTENTION), ("torch_cudnn", SDPBackend.CUDNN_ATTENTION)):
            try:
                with sdpa_kernel(be):
                    fn = lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, enable_gqa=True)
                    ref_o = fn()
                    res[label] = time_fn(fn)
            except Exception as e:
                print("  %s %s failed with enable_gqa (%s); trying expanded KV" % (name, label, str(e).split("\n")[0][:120]))
                try:
                    G = Hq // Hkv
                    ke, ve = kt.repeat_interleave(G, 1), vt.repeat_interleave(G, 1)
                    with sdpa_kernel(be):
                        fn = lambda: F.scaled_dot_product_attention(qt, ke, ve, is_causal=causal)
                        res[label + "(expKV)"] = time_fn(fn)
                except Exception as e2:
                    print("  %s %s failed: %s" % (name, label, str(e2).split("\n")[0][:120]))
        out = torch.empty_like(q)
        for cfg in variants_for(D):
            label = "tiled %d/%d/%d%s" % (cfg[0], cfg[1], cfg[2], ("+" + ",".join(x.split("=")[0][8:] for x in cfg[3])) if cfg[3] else "")
            fn = lambda: launch(q, k, v, causal, cfg, out=out)
            res[label] = time_fn(fn)
            # sanity: agrees with torch flash output
            if "torch_flash" in res:
                with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                    ref_o = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, enable_gqa=True).transpose(1, 2)
                e = rel_err(out.float(), ref_o.double())
                if e > 2e-2:
                    print("  WARNING %s %s differs from torch_flash: rel %.3g" % (name, label, e))
        if "torch_flash" in res:  # second flash timing: run-to-run noise
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                res["torch_flash (again)"] = time_fn(
                    lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, enable_gqa=True))
        base = res.get("torch_flash")
        for label, ms in res.items():
            rows.append((name, label, ms, fl / ms / 1e9, (ms / base) if base else float("nan")))
        del q, k, v, out
        torch.cuda.empty_cache()
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--bench", action="store_true")
    ap.add_argument("--head-dims", default="32,64,96,128,256")
    ap.add_argument("--shapes", default="H1,H2,H3,H4,N1")
    ap.add_argument("--default-only", action="store_true", help="bench only the default table config")
    ap.add_argument("--out", default=os.environ.get("OUT", ""))
    args = ap.parse_args()
    head_dims = [int(x) for x in args.head_dims.split(",")]
    shapes = [s for s in BENCH_SHAPES if s[0] in args.shapes.split(",")]

    def variants_for(D):
        if args.default_only or D not in BENCH_VARIANTS:
            return [DEFAULT_TABLE[D]]
        return BENCH_VARIANTS[D]

    keys = []
    if args.check:
        for dtype in ("fp16", "bf16"):
            for d in head_dims:
                for causal in (True, False):
                    keys.append((dtype, d) + DEFAULT_TABLE[d][:3] + (causal, DEFAULT_TABLE[d][3]))
                    if d in BENCH_VARIANTS and not args.default_only:
                        for cfg in BENCH_VARIANTS[d]:
                            keys.append((dtype, d) + cfg[:3] + (causal, cfg[3]))
    if args.bench:
        for s in shapes:
            for cfg in variants_for(s[7]):
                keys.append((s[1], s[7]) + cfg[:3] + (s[2], cfg[3]))
    info = prewarm(keys) if keys else {}
    if any("FAILED" in v for v in info.values()):
        print("compile failures; stopping")
        sys.exit(1)

    import torch
    print("device:", torch.cuda.get_device_name(), "torch", torch.__version__)
    fails = 0
    if args.check:
        fails = run_checks(head_dims)
    rows = []
    if args.bench:
        rows = run_bench(shapes, variants_for)
        print("\n%-4s %-28s %9s %9s %8s" % ("case", "impl", "ms", "TFLOP/s", "/flash"))
        for r in rows:
            print("%-4s %-28s %9.3f %9.1f %8.3f" % r)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "tiled_dev.json"), "w") as f:
            json.dump({"rows": rows, "check_fails": fails, "compile": {name_expr(*k[:6]) + " " + " ".join(k[6]): v for k, v in info.items()}}, f, indent=1)
    if fails:
        print("CHECK FAILURES: %d" % fails)
        sys.exit(2)


if __name__ == "__main__":
    main()
