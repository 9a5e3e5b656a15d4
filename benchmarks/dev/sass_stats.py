"""Compile kernel specializations to cubin with NVRTC and count instructions in
their SASS (needs nvdisasm on PATH or NVDISASM=...): matrix instructions
(HGMMA, HMMA), local-memory traffic (LDL/STL) and totals, and R2UR: a wgmma's
descriptors must be in uniform registers, and where ptxas builds them in vector
registers it moves each one over before its HGMMA (every hopper kernel of the tree,
plain, with modifiers or per-sequence: 25 to 78 a kernel on 2026-12-07; a few hundred
means the key loop's descriptors left the uniform path). For the hopper
family also the exponentials (MUFU.EX2) between the wait for S
(WARPGROUP.DEPBAR.LE gsb0, 0x1) and the wait for P V (0x0) that follows it:
the softmax that overlaps P V. ptxas reorders within a basic block, so this
is the number to check after touching the consumer loop.

    python benchmarks/dev/sass_stats.py hopper [--arch sm_90] [--dump NAME_SUBSTRING] [--mods FLAGS] [--seq ADDR]

(--mods: the specializations' modifier kernels with those MOD_* flags, e.g. 2: softcap;
--seq: their per-sequence kernels with that SEQ_* sum, e.g. 1: varlen.)
"""
import argparse
import collections
import os
import re
import struct
import subprocess
import sys
import tempfile

from cupy.cuda import nvrtc

from cupy_gqa._compile import compile_options, source
from cupy_gqa._specs import SPECS, with_mods, with_seq


def cubin(spec, arch):
    """The specialization's cubin from NVRTC; with PTXAS=path/to/ptxas set, from
    NVRTC's PTX assembled by that ptxas instead (to see another ptxas's code)."""
    target = spec.arch or arch
    prog = nvrtc.createProgram(source(spec.source), spec.source, [], [])
    try:
        nvrtc.addNameExpression(prog, spec.name)
        options = [o for o in compile_options(spec) if not o.startswith("-arch")]
        ptxas = os.environ.get("PTXAS")
        nvrtc.compileProgram(prog, [f"--gpu-architecture={target.replace('sm_', 'compute_') if ptxas else target}", *options])
        if not ptxas:
            return whole_elf(nvrtc.getCUBIN(prog))
        ptx = nvrtc.getPTX(prog).rstrip(b"\0")
    finally:
        nvrtc.destroyProgram(prog)
    with tempfile.TemporaryDirectory() as d:
        with open(f"{d}/k.ptx", "wb") as f:
            f.write(ptx)
        subprocess.run([ptxas, f"-arch={target}", f"{d}/k.ptx", "-o", f"{d}/k.cubin"], check=True)
        with open(f"{d}/k.cubin", "rb") as f:
            return f.read()


def whole_elf(binary):
    """CuPy's getCUBIN drops the cubin's last byte (it takes the buffer for a
    string), which can cut the ELF's last header and make nvdisasm refuse it:
    pad to the end of the program and section header tables."""
    phoff, shoff = struct.unpack_from("<QQ", binary, 0x20)
    phentsize, phnum, shentsize, shnum = struct.unpack_from("<HHHH", binary, 0x36)
    end = max(phoff + phnum * phentsize, shoff + shnum * shentsize)
    return binary + b"\0" * max(0, end - len(binary))


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
    ap.add_argument("--mods", type=int, default=0)
    ap.add_argument("--seq", type=int, default=0)
    args = ap.parse_args()
    for spec in SPECS:
        if spec.family != args.family or (spec.arch and spec.arch.rstrip("a") != args.arch):
            continue
        if args.mods:
            spec = with_mods(spec, args.mods, "")
        if args.seq:
            spec = with_seq(spec, args.seq)
        text = sass(cubin(spec, args.arch))
        ops = collections.Counter(m.group(1).split(".")[0] for m in re.finditer(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)", text, re.M))
        total = sum(ops.values())
        keys = ("HGMMA", "HMMA", "WARPGROUP", "LDL", "STL", "MUFU", "LDGSTS", "BAR", "SHFL", "R2UR")
        line = f"{spec.name:<64} total {total:6d} " + " ".join(f"{k} {ops.get(k, 0)}" for k in keys)
        lines = text.splitlines()
        wait1 = next((i for i, t in enumerate(lines) if "DEPBAR.LE gsb0, 0x1" in t), None)
        if wait1 is not None:
            wait0 = next(i for i in range(wait1, len(lines)) if "DEPBAR.LE gsb0, 0x0" in lines[i])
            line += f" EX2_overlapping_PV {sum('MUFU.EX2' in t for t in lines[wait1:wait0])}"
        print(line)
        if args.dump and args.dump in spec.name:
            sys.stdout.write(text)


if __name__ == "__main__":
    main()
