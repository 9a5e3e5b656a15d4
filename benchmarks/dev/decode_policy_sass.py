"""The memory descriptors of one decode kernel's K/V copies (LDGSTS) as this
machine's NVRTC builds it, and the instructions that set them: a copy whose
descriptor register nothing writes traps at run time (NOTES_decode.md, the L2
policy). Needs nvdisasm (NVDISASM=...); --cubin PATH also keeps the cubin.

    python benchmarks/dev/decode_policy_sass.py [--spec NAME] [--cubin PATH]
"""
import argparse
import collections
import re
import sys

from cupy.cuda import nvrtc

sys.path.insert(0, __file__.rsplit("/", 1)[0])
import sass_stats  # noqa: E402

from cupy_gqa._specs import SPECS  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--spec", default="decode_mma_attention<__nv_bfloat16, 128, 1, 3, 102656>")
ap.add_argument("--cubin", default=None)
args = ap.parse_args()
spec = next(s for s in SPECS if s.name == args.spec)
binary = sass_stats.cubin(spec, "sm_90")
if args.cubin:
    open(args.cubin, "wb").write(binary)
lines = sass_stats.sass(binary).splitlines()
DEST = re.compile(r"\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?[A-Z0-9_.]+\s+(UR\d+)\b")  # an instruction's first operand
print(f"{spec.name}: NVRTC {nvrtc.getVersion()}")
descs = collections.Counter(m for t in lines if "LDGSTS" in t for m in re.findall(r"desc\[(UR\d+)\]", t))
for reg, n in sorted(descs.items()):
    pair = {reg, f"UR{int(reg[2:]) + 1}"}
    writes = [t.strip() for t in lines if (m := DEST.match(t)) and m.group(1) in pair]
    print(f"{n} copies read desc[{reg}]; instructions writing {'/'.join(sorted(pair))}: {len(writes)}")
    for t in writes:
        print("   ", t)
