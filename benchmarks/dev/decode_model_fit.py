#!/usr/bin/env python3
"""The decode cost model against measured layouts, on the CPU.

Reads a results file of benchmarks/dev/decode_layouts.py (every block_m x
split count measured, beside the model's time) and reports, per case, the
layout the model picks among the measured ones and its regret (its measured
time over the best measured time); then the same over a grid of the model's
constants (cupy_gqa/_plan.py: DECODE_*), best first; then decode_dispatch's own
picks (any split count, measured or not) under the current constants.

    python benchmarks/dev/decode_model_fit.py benchmarks/dev/results/h200_decode_layouts_before.txt
"""
import argparse
import itertools
import math
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from cupy_gqa import _plan, _specs  # noqa: E402

CONSTANTS = ("DECODE_CTA_FIXED_S", "DECODE_COMBINE_FIXED_S", "DECODE_COMBINE_ROUND_S", "DECODE_TILE_S", "DECODE_LATENCY_S",
             "DECODE_SPLIT_S")
GRID = ([2e-6, 3e-6, 4e-6], [3e-6, 5e-6], [0.3e-6, 0.6e-6, 1.0e-6], [0.5e-6, 0.6e-6, 0.7e-6], [1.5e-6, 2e-6],
        [0, 20e-9, 40e-9, 60e-9, 80e-9])


def read(path):
    cases = []
    for block in re.split(r"\n(?=D\d+:)", Path(path).read_text()):
        m = re.match(r"(D\d+): B(\d+) Sq(\d+) Sk(\d+) Hq(\d+) Hkv(\d+) D(\d+) (\w+)", block)
        if not m:
            continue
        name, *dims, dtype = m.groups()
        b, sq, sk, hq, hkv, d = map(int, dims)
        measured = {}
        for bm, rest in re.findall(r"block_m\s+(\d+)\s+splits:measured/model us\s+(.*)", block):
            for splits, us, _ in re.findall(r"(\d+):([\d.]+)/([\d.]+)", rest):
                measured[int(bm), int(splits)] = float(us) * 1e-6
        if measured and name not in {c[0] for c in cases}:  # (a case measured twice: its first run)
            cases.append((name, _plan.Problem(b, sq, sk, hq, hkv, d, dtype, True, d**-0.5), measured))
    return cases


def regrets(cases, arch, sms):
    """Per case: (name, regret, block_m, splits) of the model's pick among the measured
    layouts (decode_dispatch's tie rule: the fewest CTAs within DECODE_TIE), and the
    rms log error of the model over every measured layout."""
    out, err, n = [], 0.0, 0
    for name, problem, measured in cases:
        specs = {s.block_m: s for s in _specs.decode_specs(problem.dtype, problem.head_dim, arch)}
        model = {k: _plan.decode_seconds(problem, specs[k[0]], k[1], sms, arch) for k in measured}
        err += sum(math.log(model[k] / measured[k]) ** 2 for k in measured)
        n += len(measured)
        best = min(model.values())
        rows = problem.seqlen_q * problem.group_size
        ctas = lambda k: problem.batch * problem.num_kv_heads * math.ceil(rows / k[0]) * k[1]  # noqa: E731
        pick = min((k for k in model if model[k] <= best * (1 + _plan.DECODE_TIE)), key=lambda k: (ctas(k), k))
        out.append((name, measured[pick] / min(measured.values()), *pick))
    return out, math.sqrt(err / n)


def line(rs):
    return " ".join(f"{name}:{r:.2f}" for name, r, *_ in rs)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results")
    ap.add_argument("--top", type=int, default=6)
    args = ap.parse_args()
    arch, sms = _specs.arch_of(9, 0), 132
    cases = read(args.results)
    current = {c: getattr(_plan, c) for c in CONSTANTS}
    rs, err = regrets(cases, arch, sms)
    print(f"current {tuple(current.values())}: rms log error {err:.3f}; regret {line(rs)}")
    grid = []
    for values in itertools.product(*GRID):
        for c, x in zip(CONSTANTS, values):
            setattr(_plan, c, x)
        rs, err = regrets(cases, arch, sms)
        grid.append((max(r for _, r, *_ in rs), sum(math.log(r) for _, r, *_ in rs), err, values, rs))
    for c, x in current.items():
        setattr(_plan, c, x)
    grid.sort(key=lambda g: (round(g[0], 3), round(g[1], 4), g[2]))
    print(f"grid over {', '.join(CONSTANTS)}, best first:")
    for worst, _, err, values, rs in grid[: args.top]:
        print(f"  {values}: worst regret {worst:.2f}, rms log error {err:.3f}; {line(rs)}")
    print("decode_dispatch's picks (any split count) under the current constants:")
    for name, problem, measured in cases:
        ch = _plan.decode_dispatch(problem, sms, arch)
        m = measured.get((ch.block_m, ch.num_splits))
        got = f"{m * 1e6:.1f} us" if m else "not measured"
        print(f"  {name}: block_m {ch.block_m}, {ch.num_splits} splits ({got}; best measured {min(measured.values()) * 1e6:.1f} us)")


if __name__ == "__main__":
    main()
