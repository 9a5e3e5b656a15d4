#!/usr/bin/env python3
"""The SASS instructions with the most warp-stall samples, from Nsight Compute's
source page in CSV:

    ncu --clock-control none --profile-from-start off -k regex:hopper --launch-count 1 \\
        --section SourceCounters --section WarpStateStats --page source --print-source sass --csv \\
        python3 benchmarks/dev/profile_prefill.py --cases H2 --kernels hopper > src.csv
    python3 benchmarks/dev/ncu_top_sass.py src.csv [N]

Prints the total of the samples, then the N (default 30) instructions with the
most, as a share of the total, with their addresses and SASS.
"""
import csv
import sys


def top(path: str, n: int) -> list[str]:
    rows = list(csv.reader(open(path, errors="ignore")))
    head_at = next(i for i, r in enumerate(rows) if "Address" in r and "Source" in r)
    head = rows[head_at]
    i_addr, i_src = head.index("Address"), head.index("Source")
    i_samples = next(i for i, h in enumerate(head) if h.startswith("Warp Stall Sampling (All"))
    items = []
    for r in rows[head_at + 1 :]:
        try:
            items.append((float(r[i_samples].replace(",", "")), r[i_addr], r[i_src].strip()))
        except (IndexError, ValueError):
            continue
    total = sum(s for s, _, _ in items) or 1.0
    items.sort(reverse=True)
    return [f"total samples {total:.0f}"] + [f"{100 * s / total:6.2f}% {a} {src[:90]}" for s, a, src in items[:n]]


if __name__ == "__main__":
    print("\n".join(top(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 30)))
