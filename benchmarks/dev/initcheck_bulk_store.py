#!/usr/bin/env python3
"""Whether compute-sanitizer's initcheck sees the writes of hopper's bulk tensor
stores (out by the copy engine), on a GPU machine:

    python3 benchmarks/dev/initcheck_bulk_store.py hopper   # once, to compile outside the tool
    compute-sanitizer --tool initcheck --print-limit 2 python3 benchmarks/dev/initcheck_bulk_store.py hopper
    compute-sanitizer --tool initcheck --print-limit 2 python3 benchmarks/dev/initcheck_bulk_store.py rowwise

One forward call (the sanitizer driver's case (2, 70, 300, 8, 2, 192), fp16:
group 4, so hopper writes out by bulk copies), then a CuPy kernel that reads
every element of out. If initcheck reports 215040 uninitialized reads
(2 x 70 x 8 x 192) after hopper and none after rowwise (ordinary stores; tiled
has no kernel of head dim 192), the reads it flags in
the sanitizer's backward group are its blind spot for the copy engine's
writes, not memory the kernels leave unwritten (the printed sums agree).
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import cupy  # noqa: E402

import cupy_gqa  # noqa: E402

kernel = sys.argv[1] if len(sys.argv) > 1 else "hopper"
rs = cupy.random.RandomState(0)
q, k, v = (rs.standard_normal(s, dtype=cupy.float32).astype(cupy.float16)
           for s in ((2, 70, 8, 192), (2, 300, 2, 192), (2, 300, 2, 192)))
out = cupy_gqa.attention(q, k, v, kernel=kernel)
print(kernel, float(out.astype(cupy.float32).sum()))
