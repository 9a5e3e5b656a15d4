"""The README's results table, from a results file of bench_attention.py.

    python benchmarks/readme_table.py [benchmarks/results/h200.json] [--write README.md]

Prints the markdown table; with --write, replaces the table between the
README's `<!-- results:begin -->` and `<!-- results:end -->` markers. Every
number comes from the results file (one run, one GPU); nothing is typed in.
"""
import argparse
import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ANCHORS = ("torch_flash", "torch_cudnn", "torch_efficient_expanded")
BEGIN, END = "<!-- results:begin -->", "<!-- results:end -->"


def table(results: dict) -> str:
    # the per-call cases' rows (host_us set: L1-L3) are per-call wall times, not kernel times
    varlen = {r["case"]: r for r in results["rows"] if r["impl"] == "torch_varlen"}  # V1: its own anchor, below
    # the paged cases (P1-P5): each against the same call on contiguous keys, below
    paged = {r["case"]: r for r in results["rows"] if r["impl"] == "cupy_gqa[contiguous]"}
    rows = [r for r in results["rows"] if r["impl"] == "cupy_gqa[auto]" and r.get("host_us") is None
            and r["case"] not in varlen and r["case"] not in paged]
    # a run of a tree with changes not yet committed says so (bench_attention.py: git_commit)
    changed = re.search(r"\(and (\d+) tracked files? changed since\)", results["git_commit"])
    commit = results["git_commit"][:7] + (f" with {changed.group(1)} tracked files changed" if changed else "")
    lines = [
        f"{results['gpu']}, {results['date'][:10]}, commit {commit}, "
        f"torch {results['torch']}, CuPy {results['cupy']}, driver {results['driver']}.",
        "",
        "| case | cupy_gqa auto | kernel | rel. error | " + " | ".join(f"vs {a}" for a in ANCHORS) + " |",
        "|---|---|---|---|" + "---|" * len(ANCHORS),
    ]
    for r in rows:
        kernel = re.search(r"auto runs (\w+)", r.get("note", ""))
        kernel = kernel.group(1) if kernel else "?"
        if r.get("peak_extra_mib") is not None and r.get("ms") is None:
            what = f"{r['peak_extra_mib']:.1f} MiB beyond inputs and outputs"
        elif r.get("peak_extra_mib") is not None:  # a backward case with its peak memory
            what = f"{r['ms']:.4f} ms, {r['tflops']:.1f} TFLOP/s, {r['peak_extra_mib']:.1f} MiB extra"
        elif r["case"].startswith("D"):
            what = f"{r['ms']:.4f} ms, {r['gbps']:.0f} GB/s"
        else:
            what = f"{r['ms']:.4f} ms, {r['tflops']:.1f} TFLOP/s"
        ratios = []
        for a in ANCHORS:
            x = r.get(f"vs_{a}")
            ratios.append("—" if x is None else f"**{x:.3f}**" if x <= 1.0 else f"{x:.3f}")
        lines.append(f"| {r['case']} | {what} | {kernel} | {r['rel_err']:.1e} | " + " | ".join(ratios) + " |")
    by = {(r["case"], r["impl"]): r for r in results["rows"]}
    for case, torch_row in varlen.items():
        ours = by.get((case, "cupy_gqa[auto]"))
        if ours and ours.get("ms") and torch_row.get("ms"):
            lines += [
                "",
                f"{case} (variable lengths, `attention_varlen`): cupy_gqa {ours['ms']:.4f} ms, "
                f"{ours['tflops']:.1f} TFLOP/s, rel. error {ours['rel_err']:.1e}; torch's `varlen_attn` "
                f"{torch_row['ms']:.4f} ms in the same run (ratio **{ours['ms'] / torch_row['ms']:.3f}**).",
            ]
    pages = [
        f"{case} {ours['ms'] / base['ms']:.3f}"
        for case, base in paged.items()
        if (ours := by.get((case, "cupy_gqa[auto]"))) and ours.get("ms") and base.get("ms")
    ]
    if pages:
        lines += [
            "",
            "Paged caches (pages shuffled in the pool), time against the same call on contiguous keys "
            "in the same run: " + ", ".join(pages) + ".",
        ]
    rowwise, seed = by.get(("S0", "cupy_gqa[rowwise]")), by.get(("S0", "seed_kernel"))
    if rowwise and seed:
        lines += [
            "",
            f"The seed's design at S0: `rowwise` {rowwise['ms']:.4f} ms, the seed kernel (built as a torch "
            f"extension) {seed['ms']:.4f} ms in the same run.",
        ]
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", nargs="?", default=str(ROOT / "benchmarks/results/h200.json"))
    parser.add_argument("--write", metavar="README", help="replace the table between the markers in this file")
    args = parser.parse_args()
    text = table(json.loads(Path(args.results).read_text()))
    if args.write:
        path = Path(args.write)
        readme = path.read_text()
        start, end = readme.index(BEGIN) + len(BEGIN), readme.index(END)
        path.write_text(readme[:start] + "\n" + text + "\n" + readme[end:])
    print(text)


if __name__ == "__main__":
    main()
