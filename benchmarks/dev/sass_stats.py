"""Compile kernel specializations to cubin with NVRTC and count instructions in
their SASS (needs nvdisasm on PATH or NVDISASM=...): matrix instructions
(HGMMA, HMMA), local-memory traffic (LDL/STL) and totals.

    python benchmarks/dev/sass_stats.py hopper [--arch sm_90] [--dump NAME_SUBSTRING]
"""
import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile

from cupy.cuda import nvrtc

from cupy_gqa._compile import compile_options, source
from cupy_gqa._specs import SPECS


def cubin(spec, arch):
    prog = nvrtc.createProgram(source(spec.source), spec.source, [], [])
    try:
        nvrtc.addNameExpression(prog, spec.name)
        target = [] if spec.arch else [f"--gpu-architecture={arch}"]
        nvrtc.compileProgram(prog, [*target, *compile_options(spec)])
        return nvrtc.getCUBIN(prog)
    finally:
        nvrtc.destroyProgram(prog)


def sass(binary):
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(binary)
        f.flush()
        return subprocess.run([os.environ.get("NVDISASM", "nvdisasm"), "-c", f.name], capture_output=True, text=True, check=True).stdout


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("family")
    ap.add_argument("--arch", default="sm_90")
    ap.add_argument("--dump", default=None)
    args = ap.parse_args()
    for spec in SPECS:
        if spec.family != args.family or (spec.arch and spec.arch.rstrip("a") != args.arch):
            continue
        text = sass(cubin(spec, args.arch))
        ops = collections.Counter(m.group(1).split(".")[0] for m in re.finditer(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)", text, re.M))
        total = sum(ops.values())
        keys = ("HGMMA", "HMMA", "WARPGROUP", "LDL", "STL", "MUFU", "LDGSTS", "BAR", "SHFL")
        print(f"{spec.name:<64} total {total:6d} " + " ".join(f"{k} {ops.get(k, 0)}" for k in keys))
        if args.dump and args.dump in spec.name:
            sys.stdout.write(text)


if __name__ == "__main__":
    main()
