"""One decode call (D1's shape, bf16) against a float64 reference: exits 0 if it runs
and matches, 1 otherwise. A patch's first check before its timings (decode_ab.sh)."""
import sys
from pathlib import Path

import cupy
import ml_dtypes
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import cupy_gqa  # noqa: E402

rng = np.random.default_rng(0)
b, sk, hq, hkv, d = 4, 4000, 32, 8, 128
q = rng.standard_normal((b, 1, hq, d), dtype=np.float32)
k = rng.standard_normal((b, sk, hkv, d), dtype=np.float32)
v = rng.standard_normal((b, sk, hkv, d), dtype=np.float32)
qd, kd, vd = (cupy.asarray(a.astype(ml_dtypes.bfloat16)) for a in (q, k, v))
try:
    out = cupy_gqa.attention(qd, kd, vd)
    cupy.cuda.Device().synchronize()
except Exception as e:  # noqa: BLE001
    print(f"decode smoke: FAILED ({type(e).__name__}: {e})")
    sys.exit(1)
qf, kf, vf = (np.asarray(a.astype(np.float64)) for a in (q.astype(ml_dtypes.bfloat16), k.astype(ml_dtypes.bfloat16), v.astype(ml_dtypes.bfloat16)))
kf, vf = np.repeat(kf, hq // hkv, axis=2), np.repeat(vf, hq // hkv, axis=2)
s = np.einsum("bqhd,bkhd->bhqk", qf, kf) / np.sqrt(d)
p = np.exp(s - s.max(-1, keepdims=True))
ref = np.einsum("bhqk,bkhd->bqhd", p / p.sum(-1, keepdims=True), vf)
got = cupy.asnumpy(out).astype(np.float64)
err = np.linalg.norm(got - ref) / np.linalg.norm(ref)
print(f"decode smoke: relative error {err:.3e}")
sys.exit(0 if err < 1e-2 else 1)
