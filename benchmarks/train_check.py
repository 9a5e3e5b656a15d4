"""Training check: a small GQA transformer trained with torch's sdpa and with
cupy_gqa (forward and backward), from the same seed, on the same data.

    python benchmarks/train_check.py                       # GPU: the small config, bf16 autocast
    python benchmarks/train_check.py --config tiny --device cpu --steps 5   # smoke run, no GPU

The model is a decoder-only transformer with random initial weights: learned
position embeddings, pre-RMSNorm blocks of causal grouped-query attention
(q, k, v projections, 8 query heads on 2 KV heads) and a SiLU MLP, tied-free
LM head. The data are synthetic: each sequence is a random prefix followed by
its copy, so the loss on the second half falls only once attention learns to
look back. Both runs start from the same weights (seed) and see the same
batches; on the GPU the forward runs under bf16 autocast with fp32 master
weights (AdamW), on the CPU in float32 (the NumPy backend).

Writes <gpu>_train.json and .md (both loss curves, the final losses: mean of
the last 20 steps, command, versions) and <gpu>_train.png (the curves) under
--out (default benchmarks/results).
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import statistics
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO_ROOT / "benchmarks" / "results"
CONFIGS = {
    "small": dict(vocab=512, dim=512, layers=4, heads=8, kv_heads=2, head_dim=64, seqlen=512, batch=16, steps=300, lr=1e-3),
    "tiny": dict(vocab=64, dim=64, layers=2, heads=4, kv_heads=2, head_dim=16, seqlen=32, batch=4, steps=5, lr=1e-3),
}
IMPLS = ("sdpa", "cupy_gqa")
FINAL_WINDOW = 20  # the final loss: mean over the last steps


def attention(torch, impl: str, q, k, v):
    """Causal GQA on (batch, heads, seqlen, head_dim) tensors."""
    if impl == "sdpa":
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    import cupy_gqa

    return cupy_gqa.attention(q, k, v, causal=True, layout="bhsd")


def make_model(torch, cfg: dict, impl: str):
    nn = torch.nn

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            d, hd = cfg["dim"], cfg["head_dim"]
            self.norm1, self.norm2 = nn.RMSNorm(d), nn.RMSNorm(d)
            self.q = nn.Linear(d, cfg["heads"] * hd, bias=False)
            self.kv = nn.Linear(d, 2 * cfg["kv_heads"] * hd, bias=False)
            self.o = nn.Linear(cfg["heads"] * hd, d, bias=False)
            self.up = nn.Linear(d, 4 * d, bias=False)
            self.down = nn.Linear(4 * d, d, bias=False)

        def forward(self, x):
            b, s, _ = x.shape
            hd = cfg["head_dim"]
            h = self.norm1(x)
            q = self.q(h).view(b, s, cfg["heads"], hd).transpose(1, 2)
            k, v = self.kv(h).view(b, s, 2, cfg["kv_heads"], hd).unbind(2)
            y = attention(torch, impl, q, k.transpose(1, 2), v.transpose(1, 2))
            x = x + self.o(y.transpose(1, 2).reshape(b, s, -1))
            return x + self.down(torch.nn.functional.silu(self.up(self.norm2(x))))

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok = nn.Embedding(cfg["vocab"], cfg["dim"])
            self.pos = nn.Embedding(cfg["seqlen"], cfg["dim"])
            self.blocks = nn.ModuleList(Block() for _ in range(cfg["layers"]))
            self.norm = nn.RMSNorm(cfg["dim"])
            self.head = nn.Linear(cfg["dim"], cfg["vocab"], bias=False)

        def forward(self, ids):
            x = self.tok(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))
            for block in self.blocks:
                x = block(x)
            return self.head(self.norm(x))

    return Model()


def batch_of(torch, cfg: dict, step: int, seed: int, device: str):
    """Step's batch: random prefixes of half the sequence, then their copies."""
    gen = torch.Generator().manual_seed(seed * 100003 + step)
    half = cfg["seqlen"] // 2
    prefix = torch.randint(0, cfg["vocab"], (cfg["batch"], half), generator=gen)
    ids = torch.cat([prefix, prefix], dim=1)
    return ids.to(device)


def train(torch, cfg: dict, impl: str, *, device: str, steps: int, seed: int, log) -> dict:
    torch.manual_seed(seed)  # the same initial weights for both implementations
    model = make_model(torch, cfg, impl).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], weight_decay=0.0)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device == "cuda" else None
    losses = []
    started = time.perf_counter()
    for step in range(steps):
        ids = batch_of(torch, cfg, step, seed, device)
        if autocast is not None:
            with autocast:
                logits = model(ids[:, :-1])
        else:
            logits = model(ids[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, cfg["vocab"]), ids[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(float(loss))
        if step % max(1, steps // 10) == 0 or step == steps - 1:
            log(f"  {impl:8} step {step:4d} loss {losses[-1]:.4f}")
    if device == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    window = losses[-min(FINAL_WINDOW, len(losses)) :]
    return {"losses": losses, "final_loss": statistics.fmean(window), "seconds": seconds}


def gpu_name(torch, device: str) -> str:
    return torch.cuda.get_device_name() if device == "cuda" else "cpu"


def tag_of(name: str) -> str:
    if name == "cpu":
        return "cpu"
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_attention import gpu_tag

    return gpu_tag(name)


def render_markdown(doc: dict) -> str:
    lines = [f"# Training check on {doc['gpu']}", ""]
    lines += [f"- {key}: `{doc[key]}`" for key in ("date", "command", "torch", "config", "steps", "seed", "precision")]
    lines += ["", "| impl | final loss (mean of the last steps) | first loss | seconds |", "|---|---|---|---|"]
    for impl in IMPLS:
        r = doc["results"][impl]
        lines.append(f"| {impl} | {r['final_loss']:.4f} | {r['losses'][0]:.4f} | {r['seconds']:.1f} |")
    lines += ["", f"final loss difference (cupy_gqa - sdpa): {doc['final_loss_difference']:+.4f} "
              f"({doc['final_loss_relative_difference']:+.2%})"]
    if doc.get("plot"):
        lines += ["", f"![loss curves]({doc['plot']})"]
    return "\n".join(lines) + "\n"


def plot(doc: dict, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(7, 4))
    for impl in IMPLS:
        losses = doc["results"][impl]["losses"]
        ax.plot(range(len(losses)), losses, label=f"{impl} (final {doc['results'][impl]['final_loss']:.3f})", lw=1)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title(f"GQA transformer, {doc['config']} config, {doc['precision']}, {doc['gpu']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="train_check", description=__doc__.splitlines()[0])
    p.add_argument("--config", choices=sorted(CONFIGS), default="small")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--steps", type=int, default=None, help="training steps (default: the config's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--no-plot", action="store_true")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("train_check: no CUDA device (torch.cuda.is_available() is False); use --device cpu", file=sys.stderr)
        return 2
    sys.path.insert(0, str(REPO_ROOT))  # the checkout this script belongs to
    cfg = CONFIGS[args.config]
    steps = args.steps or cfg["steps"]
    started = time.perf_counter()

    def log(msg):
        print(f"[{time.perf_counter() - started:6.1f}s] {msg}", flush=True)

    results = {impl: train(torch, cfg, impl, device=args.device, steps=steps, seed=args.seed, log=log) for impl in IMPLS}
    name = gpu_name(torch, args.device)
    tag = tag_of(name)
    diff = results["cupy_gqa"]["final_loss"] - results["sdpa"]["final_loss"]
    doc = {
        "gpu": name,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
        "torch": torch.__version__,
        "config": args.config,
        "model": cfg,
        "steps": steps,
        "seed": args.seed,
        "precision": "bf16 autocast, fp32 master weights (AdamW)" if args.device == "cuda" else "float32",
        "results": results,
        "final_loss_difference": diff,
        "final_loss_relative_difference": diff / results["sdpa"]["final_loss"] if results["sdpa"]["final_loss"] else math.nan,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    png = args.out / f"{tag}_train.png"
    if not args.no_plot and plot(doc, png):
        doc["plot"] = png.name
    (args.out / f"{tag}_train.json").write_text(json.dumps(doc, indent=2) + "\n")
    (args.out / f"{tag}_train.md").write_text(render_markdown(doc))
    for impl in IMPLS:
        log(f"{impl}: final loss {results[impl]['final_loss']:.4f} ({results[impl]['seconds']:.1f} s)")
    log(f"wrote {args.out / (tag + '_train.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
