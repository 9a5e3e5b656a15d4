"""One decode call of the sanitizer driver's largest case (3, 16, 300, 16, 1, 256)
for every dtype and cache-length variant, to run alone under racecheck with the
full report: compute-sanitizer --tool racecheck --print-limit 0 python3 race_repro.py [seqlen_k]
(default 300: 19 key tiles of 16, one more for one key stream than for the other)."""
import sys
from pathlib import Path

import cupy
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
import cupy_gqa  # noqa: E402
from conftest import random_qkv  # noqa: E402

seqlen_k = int(sys.argv[1]) if len(sys.argv) > 1 else 300
for dtype in ("float16", "bfloat16"):
    for lens in (None, [0, seqlen_k // 2, seqlen_k]):
        for causal in (True, False):
            q, k, v = random_qkv(3, 16, seqlen_k, 16, 1, 256, dtype, seed=1)
            qd, kd, vd = (cupy.asarray(x) for x in (q, k, v))
            cupy_gqa.attention(qd, kd, vd, causal=causal, kernel="decode", seqlens_k=lens)
            cupy.cuda.Device().synchronize()
            print(dtype, lens, causal, "ok", flush=True)
