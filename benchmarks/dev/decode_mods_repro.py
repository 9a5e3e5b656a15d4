"""The decode kernel with every modifier (the GPU modifier tests' "all" cases),
called again and again: each call with CuPy's pool first filled with garbage
(so a partial result that is never written shows), checked against the float64
reference and against the first call bit for bit.

    python3 benchmarks/dev/decode_mods_repro.py [trials] [--sanitize]

--sanitize: one call of each case (for compute-sanitizer)."""
import sys
from pathlib import Path

import cupy
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
import cupy_gqa  # noqa: E402
from conftest import TOLERANCE, random_qkv  # noqa: E402
from reference import reference_attention  # noqa: E402
from test_modifiers import modifier_kwargs  # noqa: E402

WINDOWS = {"all": (45, 0), "all_noncausal": (40, 17)}
SHAPE = (3, 2, 1000, 8, 2, 128)
trials = int(sys.argv[1]) if len(sys.argv) > 1 and sys.argv[1].isdigit() else 50
sanitize = "--sanitize" in sys.argv
rng = np.random.default_rng(0)
bad = 0
for dtype in ("float16", "bfloat16", "float32"):
    for name in ("all", "all_noncausal"):
        q, k, v = random_qkv(*SHAPE, dtype, seed=11)
        kw = modifier_kwargs(name, SHAPE[0], SHAPE[3], WINDOWS)
        causal = kw.pop("causal", True)
        ref, _ = reference_attention(q, k, v, causal=causal, **kw)
        qd, kd, vd = (cupy.asarray(x) for x in (q, k, v))
        plan = None
        first = None
        errs = []
        for t in range(1 if sanitize else trials):
            if not sanitize:  # the pool's free blocks full of garbage
                g = cupy.asarray(rng.standard_normal(1 << 22).astype(np.float32) * 1e3)
                del g
            fresh = modifier_kwargs(name, SHAPE[0], SHAPE[3], WINDOWS)
            fresh.pop("causal", None)
            dkw = {n: (cupy.asarray(x) if isinstance(x, np.ndarray) else x) for n, x in fresh.items()}
            if plan is None:
                options = {**cupy_gqa.api._ATTENTION_DEFAULTS, "causal": causal, "kernel": "decode", **dkw}
                del options["block_table"], options["cache_leftpad"]
                plan = cupy_gqa.api._attention(qd, kd, vd, **options, flags=None, plan_only=True)
            out = cupy.full(q.shape, np.nan, dtype=q.dtype)
            cupy_gqa.attention(qd, kd, vd, causal=causal, out=out, kernel="decode", **dkw)
            o = cupy.asnumpy(out).astype(np.float64)
            err = np.abs(o - ref).max() / max(np.abs(ref).max(), 1e-30)
            errs.append(err)
            if first is None:
                first = o
            elif not np.array_equal(o, first, equal_nan=True):
                d = np.argwhere(o != first)
                print(f"  {dtype} {name} trial {t}: differs from the first call at {len(d)} elements, e.g. {tuple(d[0])}")
            if err > TOLERANCE[dtype]:
                bad += 1
                w = np.unravel_index(np.nanargmax(np.abs(o - ref)), o.shape)
                print(f"  {dtype} {name} trial {t}: error {err:.3e} at {w}: got {o[w]}, want {ref[w]}")
        extra = ""
        if plan is not None:
            extra = f" splits {getattr(plan, 'num_splits', '?')} cluster {getattr(plan, 'cluster', '?')} " \
                    f"kernel {getattr(getattr(plan, 'spec', None), 'name', '?')}"
        print(f"{dtype} {name}: {len(errs)} calls, max error {max(errs):.3e}{extra}", flush=True)
print("bad calls:", bad)
