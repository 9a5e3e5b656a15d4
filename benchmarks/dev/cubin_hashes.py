#!/usr/bin/env python3
"""Fingerprints of every compiled specialization, to show that a source change
leaves the generated code alone (or by how much it changes it). No GPU needed.

    python benchmarks/dev/cubin_hashes.py --out before.json [--arch sm_80,sm_90] [--jobs 2] [--source tiled.cu]
    python benchmarks/dev/cubin_hashes.py --compare before.json after.json

For every spec in cupy_gqa._specs.SPECS and architecture, NVRTC compiles the
kernel as cupy_gqa/_compile.py's compile_offline does, and the JSON records:
  cubin     sha256 of the cubin (nvrtc getCUBIN): identical means identical code
  ptx       sha256 of the PTX without its header comment, with the kernel's
            mangled name replaced by "KERNEL" and the per-process part of the
            names of internal-linkage globals dropped: identical means the same
            code under another template name (a cubin with such a global, e.g. a
            namespace-scope constexpr variable, differs from run to run)
  regs, spill_stores, spill_loads   from ptxas -v
  sass      (with --ptxas and --cuobjdump, or both on PATH) the PTX assembled by
            that ptxas and listed by cuobjdump -sass: sha256 of the instruction
            text (addresses, encodings and the kernel name dropped), the
            instruction count and the count per opcode. A CUDA 13 cuobjdump
            cannot read the CUDA 12 ELF that NVRTC 12 writes, so this is the
            other toolchain's SASS of the same PTX: a proxy for instruction
            counts, exact for "the same PTX gives the same SASS".
Each architecture fingerprints the specs of its table (_specs.specs_for). Specs
are matched by name, else by their position in SPECS (a renamed kernel); --source
fingerprints only the specs of one kernel file, and --compare then compares
the specs both files have.
"""
from __future__ import annotations

import argparse
import collections
import concurrent.futures
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from cupy_gqa import _compile, _specs  # noqa: E402

_SASS_LINE = re.compile(r"^\s+/\*[0-9a-f]{4,}\*/\s+(.*?)\s*;")
# NVRTC names a namespace-scope variable of internal linkage (a constexpr one,
# say) _ZN<len>_INTERNAL_<...>_<file>_cu_<hash>_<pid><name>: new in every process
_INTERNAL = re.compile(r"_ZN\d+_INTERNAL_\w+?_cu_[0-9a-f]+_\d+")


def _normalize_ptx(ptx: str, lowered: str) -> str:
    body = ptx[ptx.index(".version"):]  # drop the compiler's header comment
    return _INTERNAL.sub("_ZN_INTERNAL_", body.replace(lowered, "KERNEL"))


def _sass(ptx: str, arch: str, lowered: str, ptxas: str, cuobjdump: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        src, cubin = os.path.join(tmp, "k.ptx"), os.path.join(tmp, "k.cubin")
        Path(src).write_text(ptx)
        subprocess.run([ptxas, f"-arch={arch}", src, "-o", cubin], check=True, capture_output=True)
        listing = subprocess.run([cuobjdump, "-sass", cubin], check=True, capture_output=True, text=True).stdout
    instructions = [m.group(1).replace(lowered, "KERNEL") for m in map(_SASS_LINE.match, listing.splitlines()) if m]
    opcodes = collections.Counter()
    for ins in instructions:
        words = ins.split()
        op = words[1] if words[0].startswith("@") and len(words) > 1 else words[0]  # skip a predicate
        opcodes[op.split(".")[0]] += 1
    return {
        "sha256": hashlib.sha256("\n".join(instructions).encode()).hexdigest(),
        "count": len(instructions),
        "opcodes": dict(sorted(opcodes.items())),
    }


def fingerprint(index: int, arch: str, ptxas: str | None, cuobjdump: str | None) -> dict:
    from cupy.cuda import nvrtc

    spec = _specs.SPECS[index]
    prog = nvrtc.createProgram(_compile.source(spec.source), spec.source, [], [])
    try:
        nvrtc.addNameExpression(prog, spec.name)
        nvrtc.compileProgram(prog, [f"--gpu-architecture={arch}", "-Xptxas", "-v", *_compile.compile_options(spec)])
        log = nvrtc.getProgramLog(prog)
        cubin = nvrtc.getCUBIN(prog)
        ptx = nvrtc.getPTX(prog)
        ptx = ptx.decode() if isinstance(ptx, bytes) else ptx
        lowered = nvrtc.getLoweredName(prog, spec.name)
    finally:
        nvrtc.destroyProgram(prog)
    ptx = ptx.rstrip("\0")
    entry = {
        "index": index,
        "name": spec.name,
        "cubin": hashlib.sha256(cubin).hexdigest(),
        "ptx": hashlib.sha256(_normalize_ptx(ptx, lowered).encode()).hexdigest(),
        "regs": _compile._ptxas_number(log, r"Used (\d+) registers"),
        "spill_stores": _compile._ptxas_number(log, r"(\d+) bytes spill stores"),
        "spill_loads": _compile._ptxas_number(log, r"(\d+) bytes spill loads"),
    }
    if ptxas and cuobjdump:
        entry["sass"] = _sass(ptx, arch, lowered, ptxas, cuobjdump)
    return entry


def collect(archs: list[str], jobs: int, ptxas: str | None, cuobjdump: str | None, source: str | None) -> dict:
    result = {}
    with concurrent.futures.ProcessPoolExecutor(jobs) as pool:
        for arch in archs:
            # the specs of the architecture's table (a kernel for newer GPUs alone may not exist for older ones)
            table = {s.name for s in _specs.specs_for(_specs.ARCHS[arch])} if arch in _specs.ARCHS else None
            indices = [i for i, spec in enumerate(_specs.SPECS)
                       if source in (None, spec.source) and (table is None or spec.name in table)]
            futures = [pool.submit(fingerprint, i, arch, ptxas, cuobjdump) for i in indices]
            result[arch] = [f.result() for f in futures]
            print(f"{arch}: {len(futures)} specs", file=sys.stderr, flush=True)
    return result


def compare(before: dict, after: dict) -> int:
    """Print, per arch, which specs changed and how; 0 if every cubin is identical."""
    differ = 0
    for arch in before:
        # by name where both have it, else by position in SPECS (a renamed kernel)
        names_a = {e["name"] for e in before[arch]}
        names_b = {e["name"] for e in after.get(arch, [])}
        key = lambda i, e: e["name"] if e["name"] in names_a and e["name"] in names_b else e.get("index", i)  # noqa: E731
        a_by = {key(i, e): e for i, e in enumerate(before[arch])}
        b_by = {key(i, e): e for i, e in enumerate(after.get(arch, []))}
        common = sorted(a_by.keys() & b_by.keys(), key=str)
        same_cubin = same_ptx = same_sass = 0
        lines = []
        for a, b in ((a_by[i], b_by[i]) for i in common):
            ptx_same = a["ptx"] == b["ptx"]
            sass_a, sass_b = a.get("sass"), b.get("sass")
            sass_same = sass_a is not None and sass_b is not None and sass_a["sha256"] == sass_b["sha256"]
            if a["cubin"] == b["cubin"]:
                same_cubin += 1
                continue
            differ += 1
            same_ptx += ptx_same
            same_sass += sass_same
            what = "PTX same but for the name" if ptx_same else "PTX differs"
            if sass_a is not None and sass_b is not None:
                what += f"; SASS {'same' if sass_same else 'differs'}: {sass_a['count']} -> {sass_b['count']} instructions"
            rename = a["name"] if a["name"] == b["name"] else f"{a['name']} -> {b['name']}"
            spills = f"spills {a['spill_stores']}/{a['spill_loads']} -> {b['spill_stores']}/{b['spill_loads']} bytes"
            lines.append(f"  {rename}: cubin differs; {what}; regs {a['regs']} -> {b['regs']}; {spills}")
        n = len(common)
        print(f"{arch}: {same_cubin}/{n} cubins identical; of the rest, {same_ptx} with the same PTX but for the "
              f"name, {same_sass} with the same SASS")
        print("\n".join(lines))
    return 1 if differ else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, help="write the fingerprints here (JSON)")
    ap.add_argument("--arch", default="sm_80,sm_90")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--ptxas", default=shutil.which("ptxas"), help="ptxas for the SASS listing (default: PATH)")
    ap.add_argument("--cuobjdump", default=shutil.which("cuobjdump"), help="cuobjdump (default: PATH)")
    ap.add_argument("--source", help="only the specs of this kernel file, e.g. tiled.cu")
    ap.add_argument("--compare", nargs=2, type=Path, metavar=("BEFORE", "AFTER"))
    args = ap.parse_args()
    if args.compare:
        before, after = (json.loads(p.read_text()) for p in args.compare)
        return compare(before, after)
    if not args.out:
        ap.error("--out or --compare")
    data = collect(args.arch.split(","), args.jobs, args.ptxas, args.cuobjdump, args.source)
    args.out.write_text(json.dumps(data, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
