#!/usr/bin/env python3
"""Where a call's error comes from, against torch's kernels: models of the
probabilities' rounding on the same inputs.

    python3 benchmarks/dev/p_rounding.py [--cases D1,D06,D24,P03,H3] [--device cuda]
                                         [--tiles 128,80 --lazy 8,1,0 --variants p16_lazy]

For one call of each case (bench_attention's CASES and SHAPE_SWEEP, its
inputs: make_inputs, seed 0), the relative error ||out - ref|| / ||ref||
against bench_attention's float64 reference of cupy_gqa auto and of torch's
cuDNN and flash backends (on a GPU), and of models of the computation in
float32 on the same inputs, each with one rounding changed:
  p16         P rounded to the input dtype before P V, row sums of the float32
              P (cupy_gqa's rule, and FlashAttention-2's)
  p16_sum16   the same, row sums of the rounded P
  p32         P kept in float32: only the output is rounded
  p16_x2^f    P scaled by 2^f before the rounding (f = 0.25, 0.5, 0.75), the
              scale divided out of the row sums
  p16_tiles   P rounded after each 128-key tile's own running maximum (the
              online softmax's references, without the lazy rescale)
  p16_lazy    the same with cupy_gqa's lazy rescale: the reference is raised
              only when a tile's maximum passes it by more than 2^8 (so P can
              reach 2^8 and the largest P is seldom a power of two)
  p16_lazy_sum16  p16_lazy with row sums of the rounded P
  p16_tiles_sum16  p16_tiles with row sums of the rounded P
  pfp16       P rounded to float16 whatever the input dtype (10 bits, not 7)
The tiled models take each key tile of --tiles (default 128) and the lazy ones each
threshold of --lazy (default 8; 0: exact maxima), labelled "@tile/threshold" where
either is not the default; --variants keeps only the named models.
The model whose error meets torch's says which rounding torch's kernels use
(benchmarks/NOTES.md: errors against torch's). On a GPU each cupy_gqa kernel
that takes the call runs too (rowwise keeps P in fp32: the output's rounding
alone). Without a GPU (--device cpu)
only the models run, on the case's first batch.
"""
import argparse
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import bench_attention as ba  # noqa: E402

TILE = 128
LAZY = 8.0  # the kernels' lazy rescale threshold, log2 units (softmax.cuh: frag_update)


def scores(case, q, k, b, h):
    """float32 scores (group, seqlen_q, seqlen_k) of KV head h of batch b, scaled
    to log2 units, -inf where the bottom-right causal mask hides a key."""
    g = case.group_size
    qb = q[b, :, h * g : (h + 1) * g].float().transpose(0, 1)
    s = (qb @ k[b, :, h].float().T) * (case.head_dim**-0.5 * math.log2(math.e))
    if case.causal:
        i = torch.arange(case.seqlen_q, device=q.device)[:, None] + (case.seqlen_k - case.seqlen_q)
        s = s.masked_fill(torch.arange(case.seqlen_k, device=q.device)[None, :] > i, -math.inf)
    return s


def model(case, q, k, v, variant, batches, tile=TILE, lazy=LAZY):
    """The output of one rounding model (see the module's doc) in the input dtype; the
    tiled ones on key tiles of ``tile``, the lazy ones with threshold ``lazy``."""
    dt, g = q.dtype, case.group_size
    out = torch.empty((len(batches), case.seqlen_q, case.num_q_heads, case.head_dim), dtype=dt, device=q.device)
    for bi, b in enumerate(batches):
        for h in range(case.num_kv_heads):
            s, vh = scores(case, q, k, b, h), v[b, :, h].float()
            if variant in ("p16_tiles", "p16_lazy", "p16_lazy_sum16", "p16_tiles_sum16"):
                o = torch.zeros(s.shape[:2] + (case.head_dim,), device=q.device)
                m = torch.full(s.shape[:2] + (1,), -math.inf, device=q.device)
                l = torch.zeros(s.shape[:2] + (1,), device=q.device)
                for n0 in range(0, case.seqlen_k, tile):
                    st = s[..., n0 : n0 + tile]
                    m_new = torch.maximum(m, st.amax(-1, keepdim=True))
                    if variant.startswith("p16_lazy"):  # raised only where the tile's max passes it by more than LAZY
                        m_new = torch.where(m_new > m + lazy, m_new, m)
                    ref = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
                    alpha = torch.exp2(m - ref)
                    p = torch.exp2(st - ref)
                    pr = p.to(dt).float()
                    o = o * alpha + pr @ vh[n0 : n0 + tile]
                    l = l * alpha + (pr if variant.endswith("_sum16") else p).sum(-1, keepdim=True)
                    m = m_new
                o = o / l
            else:
                m = s.amax(-1, keepdim=True)
                p = torch.exp2(s - torch.where(torch.isinf(m), torch.zeros_like(m), m))
                scale = 1.0
                if variant.startswith("p16_x2^"):
                    scale = 2.0 ** float(variant.split("^")[1])
                pr = (p if variant == "p32" else p.half().float() if variant == "pfp16"
                      else (p * scale).to(dt).float())
                l = (pr if variant == "p16_sum16" else p * scale).sum(-1, keepdim=True)
                o = (pr @ vh) / l
            out[bi, :, h * g : (h + 1) * g] = o.nan_to_num(0.0).transpose(0, 1).to(dt)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default="D1,D06,D24,P03,H3")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tiles", default=str(TILE), help="key tiles of the tiled models (comma-separated)")
    ap.add_argument("--lazy", default=str(LAZY), help="thresholds of the lazy models, log2 units (0: exact maxima)")
    ap.add_argument("--variants", default="", help="only these models (comma-separated)")
    args = ap.parse_args()
    tiles = [int(t) for t in args.tiles.split(",")]
    thresholds = [float(x) for x in args.lazy.split(",")]
    ba.DEVICE = args.device
    by_name = {c.name: c for c in (*ba.CASES, *ba.SHAPE_SWEEP)}
    variants = ["p16", "p16_sum16", "p32", "p16_x2^0.25", "p16_x2^0.5", "p16_x2^0.75", "p16_tiles", "p16_lazy", "p16_lazy_sum16", "p16_tiles_sum16", "pfp16"]
    print(f"{args.device}  torch {torch.__version__}; relative error against float64, one call per case")
    print(f"{'case':5s} {'impl':24s} rel_err")
    for name in args.cases.split(","):
        case = by_name[name]
        q, k, v = ba.make_inputs(torch, case)
        batches = range(case.batch) if args.device != "cpu" else range(1)
        index = (slice(batches.start, batches.stop),)
        ref = ba.reference(torch, case, q, k, v, index)
        impls = []
        if args.device != "cpu":
            import cupy_gqa

            impls.append(("cupy_gqa", lambda: cupy_gqa.attention(q, k, v, causal=case.causal)))
            for kernel in ("rowwise", "tiled", "hopper", "decode"):  # each kernel that takes the call
                try:
                    cupy_gqa.attention(q[:1], k[:1], v[:1], causal=case.causal, kernel=kernel)
                except ValueError:
                    continue
                impls.append((f"cupy_gqa[{kernel}]", lambda kernel=kernel: cupy_gqa.attention(
                    q, k, v, causal=case.causal, kernel=kernel)))
            found, _ = ba.torch_impls(torch, case, q, k, v)
            impls += [(n, fn) for n, fn in found if n in ("torch_cudnn", "torch_flash")]
        for x in variants:
            if args.variants and x not in args.variants.split(","):
                continue
            tiled = x in ("p16_tiles", "p16_lazy", "p16_lazy_sum16", "p16_tiles_sum16")
            for t in tiles if tiled else [TILE]:
                for tau in thresholds if x.startswith("p16_lazy") else [LAZY]:
                    label = x + (f"@{t}/{tau:g}" if (t, tau) != (TILE, LAZY) else "")
                    impls.append((f"model {label}", lambda x=x, t=t, tau=tau: model(case, q, k, v, x, batches, t, tau)))
        for impl, fn in impls:
            out = fn()
            if out.shape[0] != len(batches):
                out = out[index]
            print(f"{name:5s} {impl:24s} {float((out.double() - ref).norm() / ref.norm()):.4e}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
