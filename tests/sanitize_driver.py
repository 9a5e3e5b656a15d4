"""Small calls of every kernel family, to run under compute-sanitizer (tests/sanitize.sh).

Every dtype, causal and non-causal, odd head dims and lengths, strided views,
ragged seqlens_k, lse, the modifiers, variable lengths, paged caches and left
padding; each kernel family through the same list
(``python3 sanitize_driver.py [kernel ...]`` limits the families; "backward" is
attention_backward's kernels). Checks results too, so a
sanitizer run that silently computes garbage still fails.
"""
import sys

import numpy as np

import cupy
import cupy_gqa
from conftest import TOLERANCE, random_qkv, relative_error
from reference import reference_attention, reference_attention_backward, reference_kvcache, reference_varlen
from test_modifiers import modifier_kwargs

CASES = [
    # (batch, seqlen_q, seqlen_k, num_q_heads, num_kv_heads, head_dim)
    (1, 1, 1, 1, 1, 64),
    (2, 37, 53, 8, 2, 64),
    (1, 70, 19, 7, 1, 128),  # more queries than keys: fully masked rows
    (1, 3, 130, 4, 4, 32),
    (2, 65, 65, 4, 1, 96),
    (1, 17, 33, 2, 1, 256),
    (1, 29, 31, 6, 3, 40),  # odd head_dim: rowwise only
    (1, 9, 12, 2, 2, 1),
    (2, 4, 700, 8, 2, 128),  # decode with split keys (the combine kernel; on sm_90 fp16 / bf16 a 2-CTA cluster)
    (1, 1, 2048, 8, 1, 64),  # decode split into 8-CTA clusters (sm_90, fp16 / bf16)
    (3, 16, 300, 16, 1, 256),  # decode's largest rows and head_dim
    (2, 3, 900, 8, 2, 80),  # decode at a padded head_dim (fp16 / bf16: the 128 kernel), split keys
    (2, 70, 300, 8, 2, 192),  # hopper: head_dim padded to a third slab, several K/V tiles per CTA
    (2, 50, 150, 12, 2, 64),  # hopper: group 6, bulk Q in blocks of 60 rows (three warpgroups, idle rows)
    (1, 90, 250, 8, 2, 128),  # hopper: three warpgroups on 80-key tiles (group 4), several K/V tiles per CTA
    (1, 200, 200, 4, 2, 128),  # hopper: three warpgroups at group 2 (96 positions a tile), each to its own rows' keys
]
DTYPES = ["float32", "float16", "bfloat16", "float64"]


BACKWARD_TOLERANCE = {"float32": 1e-5, "float16": 4e-3, "bfloat16": 3e-2, "float64": 1e-10}


def backward(failures: int, runs: int, part: str = "") -> tuple[int, int]:
    """attention_backward (kernels/backward.cu: preprocess, dQ, dK/dV) through the same cases;
    float32 twice, the second time as on a GPU of one SM, where its dK/dV kernel takes the
    wide key blocks (_specs.BWD_TF32_DKDV_WIDE); then with the modifiers. part "cases" or
    "mods": only one of the two."""
    from cupy_gqa import _plan

    if part == "mods":
        return _backward_modifiers(failures, runs)

    sm_count = _plan.sm_count
    try:
        for sms in (None, 1):
            if sms is not None:
                _plan.sm_count = lambda device: sms
            failures, runs = _backward_cases(failures, runs, DTYPES if sms is None else ["float32"])
    finally:
        _plan.sm_count = sm_count
    return (failures, runs) if part == "cases" else _backward_modifiers(failures, runs)


def _backward_modifiers(failures: int, runs: int) -> tuple[int, int]:
    """attention_backward with modifiers (the *_mods kernels and bwd_dsinks): every built-in with
    a mask_mod, causal and not (the mma.sync or CUDA-core pair), and a window, softcap and sinks
    alone (on sm_90 the pair with a producer warpgroup), through BWD_MOD_CASES."""
    rng = np.random.default_rng(9)
    for case in BWD_MOD_CASES:
        for dtype in DTYPES:
            for name in ("all", "all_noncausal", "window"):
                kw = modifier_kwargs(name, case[0], case[3], MOD_WINDOWS)
                kw.pop("score_mod", None)  # (no derivative: the backward takes none)
                if name == "window":
                    kw.update(softcap=2.0, sinks=rng.standard_normal(case[3]).astype(np.float32))
                causal = kw.pop("causal", True)
                q, k, v = random_qkv(*case, dtype, seed=runs)
                dout = random_qkv(case[0], case[1], 1, case[3], 1, case[5], dtype, seed=runs + 1)[0]
                dev = {n: cupy.asarray(x) if isinstance(x, np.ndarray) else x for n, x in kw.items()}
                qd, kd, vd, dd = (cupy.asarray(x) for x in (q, k, v, dout))
                out = cupy.full(q.shape, np.nan, dtype=q.dtype)
                _, lse = cupy_gqa.attention(qd, kd, vd, causal=causal, out=out, return_lse=True, **dev)
                grads = [cupy.full(x.shape, np.nan, dtype=x.dtype) for x in (q, k, v)]
                res = cupy_gqa.attention_backward(dd, qd, kd, vd, out, lse, causal=causal, dq=grads[0], dk=grads[1],
                                                  dv=grads[2], **dev)  # fmt: skip
                runs += 1
                want = reference_attention_backward(dout, q, k, v, causal=causal, **kw)
                for what, g, w in zip(("dq", "dk", "dv", "dsinks"), res, want):
                    err = relative_error(cupy.asnumpy(g), w)
                    if not err <= max(BACKWARD_TOLERANCE[dtype], 1e-5 if what == "dsinks" else 0):
                        failures += 1
                        print(f"FAIL backward {name} {what} {case} {dtype}: error {err:.2e}")
    return failures, runs


def _backward_cases(failures: int, runs: int, dtypes) -> tuple[int, int]:
    for case in CASES:
        for dtype in dtypes:
            for causal in (True, False):
                variant = ("contiguous", "strided", "seqlens_k")[(CASES.index(case) + dtypes.index(dtype) + causal + runs) % 3]
                q, k, v = random_qkv(*case, dtype, seed=runs)
                dout = random_qkv(case[0], case[1], 1, case[3], 1, case[5], dtype, seed=runs + 1)[0]
                lens = None
                if variant == "strided":
                    qd, kd, vd, dd = (cupy.asarray(np.ascontiguousarray(x.transpose(0, 2, 1, 3))).transpose(0, 2, 1, 3) for x in (q, k, v, dout))
                else:
                    qd, kd, vd, dd = (cupy.asarray(x) for x in (q, k, v, dout))
                if variant == "seqlens_k":
                    lens = [(case[2] * (i + 1)) // (case[0] + 1) for i in range(case[0])]
                    lens[0], lens[-1] = 0, case[2]
                # out filled first: initcheck does not see the copy engine's writes (hopper's bulk
                # stores), so an out they alone wrote reads as uninitialized in bwd_preprocess
                out = cupy.full(q.shape, np.nan, dtype=q.dtype)
                _, lse = cupy_gqa.attention(qd, kd, vd, causal=causal, out=out, return_lse=True, seqlens_k=lens)
                grads = [cupy.full(x.shape, np.nan, dtype=x.dtype) for x in (q, k, v)]
                cupy_gqa.attention_backward(dd, qd, kd, vd, out, lse, causal=causal, seqlens_k=lens, dq=grads[0], dk=grads[1], dv=grads[2])
                runs += 1
                want = reference_attention_backward(dout, q, k, v, causal=causal, seqlens_k=lens)
                for name, g, w in zip(("dq", "dk", "dv"), grads, want):
                    err = relative_error(cupy.asnumpy(g), np.nan_to_num(w))
                    if not err <= BACKWARD_TOLERANCE[dtype]:
                        failures += 1
                        print(f"FAIL backward {name} {case} {dtype} causal={causal} {variant}: error {err:.2e}")
    return failures, runs


MOD_CASES = [(2, 37, 53, 8, 2, 64), (2, 4, 700, 8, 2, 128), (2, 70, 300, 8, 2, 192)]
# the backward's: a window that leaves key tiles out on either side, at the producer pair's head dims
BWD_MOD_CASES = [(2, 37, 53, 8, 2, 64), (1, 70, 150, 4, 2, 128)]
MOD_WINDOWS = {"window": (9, 0), "all": (11, 0), "all_noncausal": (6, 4)}


def modifiers(kernel, failures: int, runs: int) -> tuple[int, int]:
    """The family's modifier kernels (window; softcap, sinks, ALiBi, score_mod, mask_mod and a
    window together, causal and not; the softcap alone and score_mods in units, which hopper
    runs on their own path) through a prefill, a split decode and a padded head_dim."""
    for case in MOD_CASES:
        for dtype in DTYPES:
            for name in (*MOD_WINDOWS, "softcap", "score_mod_unit", "score_mod_unit_softcap"):
                q, k, v = random_qkv(*case, dtype, seed=runs)
                kw = modifier_kwargs(name, case[0], case[3], MOD_WINDOWS)
                out = cupy.full(q.shape, np.nan, dtype=q.dtype)
                try:
                    cupy_gqa.attention(*(cupy.asarray(x) for x in (q, k, v)), out=out, return_lse=True, kernel=kernel, **kw)
                except ValueError as e:
                    if "does not support" in str(e):
                        continue
                    raise
                runs += 1
                ref = reference_attention(q, k, v, **kw)[0]
                err = relative_error(cupy.asnumpy(out), ref)
                if not err <= TOLERANCE[dtype]:
                    failures += 1
                    print(f"FAIL {kernel} {name} {case} {dtype}: error {err:.2e}")
    return failures, runs


def per_sequence(kernel, failures: int, runs: int) -> tuple[int, int]:
    """The family's per-sequence kernels (*_seq, and *_seq_mods with all six
    modifiers): packed variable lengths, a paged cache in shuffled pages of 16 and
    32 keys, left padding; prefill and decode."""
    rng = np.random.default_rng(5)
    for dtype in ("float16", "bfloat16", "float32"):
        for seqlen_q, head_dim in ((1, 128), (3, 64), (70, 64)):
            calls = []
            lens_q = [seqlen_q, 0, seqlen_q, 1]
            lens_k = [seqlen_q + 90, 5, seqlen_q, 300]
            cu_q = np.concatenate([[0], np.cumsum(lens_q)]).astype(np.int32)
            cu_k = np.concatenate([[0], np.cumsum(lens_k)]).astype(np.int32)
            q = rng.standard_normal((int(cu_q[-1]), 4, head_dim)).astype(dtype)
            k, v = (rng.standard_normal((int(cu_k[-1]), 2, head_dim)).astype(dtype) for _ in range(2))
            # every call plain and with all six modifiers (the *_seq_mods kernels)
            mods = modifier_kwargs("all", 4, 4, {"all": (40, 0)}, seed=runs)
            calls.append(("varlen", (q, k, v), {"cu_seqlens_q": cu_q, "cu_seqlens_k": cu_k, "max_seqlen_q": max(lens_q),
                                                "max_seqlen_k": max(lens_k)}, reference_varlen(q, k, v, cu_q, cu_k)[0]))  # fmt: skip
            calls.append(("varlen mods", (q, k, v), {**calls[-1][2], **mods}, reference_varlen(q, k, v, cu_q, cu_k, **mods)[0]))
            for page in (16, 32):
                max_pages = 320 // page
                pool = lambda: rng.standard_normal((4 * max_pages + 3, page, 2, head_dim)).astype(dtype)  # noqa: E731
                kc, vc = pool(), pool()
                table = rng.permutation(len(kc))[: 4 * max_pages].reshape(4, max_pages).astype(np.int32)
                seqlens = np.array([0, page + 1, 200, 320], dtype=np.int32)
                leftpad = np.array([0, 3, 17, 100], dtype=np.int32) if page == 32 else None
                qb = rng.standard_normal((4, seqlen_q, 4, head_dim)).astype(dtype)
                ref = reference_kvcache(qb, kc, vc, seqlens_k=seqlens, block_table=table, cache_leftpad=leftpad)[0]
                calls.append((f"paged {page}", (qb, kc, vc), {"block_table": table, "seqlens_k": seqlens, "cache_leftpad": leftpad}, ref))
                ref = reference_kvcache(qb, kc, vc, seqlens_k=seqlens, block_table=table, cache_leftpad=leftpad, **mods)[0]
                calls.append((f"paged {page} mods", (qb, kc, vc), {**calls[-1][2], **mods}, ref))
            for name, arrays, kw, ref in calls:
                dev = [cupy.asarray(x) for x in arrays]
                # (index arrays and lengths on the device; the modifiers' arrays as given)
                kwd = {n: (cupy.asarray(x) if isinstance(x, np.ndarray) and x.dtype == np.int32 else x)
                       for n, x in kw.items() if x is not None}  # fmt: skip
                for call in ("first", "repeat"):  # the full path, then the signature's entry (new index arrays)
                    out = cupy.full(arrays[0].shape, np.nan, dtype=arrays[0].dtype)
                    kwc = {n: (x.copy() if isinstance(x, cupy.ndarray) else x) for n, x in kwd.items()}
                    try:
                        if name.startswith("varlen"):
                            cupy_gqa.attention_varlen(*dev, kwc.pop("cu_seqlens_q"), kwc.pop("cu_seqlens_k"),
                                                      kwc.pop("max_seqlen_q"), kwc.pop("max_seqlen_k"), out=out,
                                                      kernel=kernel, **kwc)  # fmt: skip
                        else:
                            cupy_gqa.attention(*dev, out=out, kernel=kernel, **kwc)
                    except ValueError as e:
                        if "does not support" in str(e):
                            break
                        raise
                    runs += 1
                    err = relative_error(cupy.asnumpy(out), ref)
                    if not err <= TOLERANCE[dtype]:
                        failures += 1
                        print(f"FAIL {kernel} {name} ({call} call) seqlen_q={seqlen_q} D{head_dim} {dtype}: error {err:.2e}")
    return failures, runs


def main(kernels) -> int:
    failures = runs = 0
    # hopper's persistent CTAs: two per call, so that each walks several tiles
    # (the rings, the turns and each warpgroup's Q rows running on across them)
    from cupy_gqa import _plan

    _plan.HopperLaunch.ctas = lambda self, device: min(2, self.grid[0])
    for name in kernels:
        kernel, _, part = name.partition(":")
        if part not in ("", "seq", "mods") and name != "backward:cases":
            raise SystemExit(
                f"sanitize_driver: unknown part {part!r} of {name!r} (family, family:seq, family:mods, backward:cases)"
            )
        if kernel == "backward":
            if part == "seq":
                raise SystemExit("sanitize_driver: backward has no per-sequence part (backward:cases, backward:mods)")
            failures, runs = backward(failures, runs, part)
            continue
        if part == "seq":
            failures, runs = per_sequence(kernel, failures, runs)
            continue
        if part == "mods":
            failures, runs = modifiers(kernel, failures, runs)
            continue
        failures, runs = modifiers(kernel, failures, runs)
        failures, runs = per_sequence(kernel, failures, runs)
        for case in CASES:
            for dtype in DTYPES:
                for causal in (True, False):
                    # one layout per call, in turn, so the four tools' runs stay short
                    variants = ("contiguous", "strided", "seqlens_k")
                    for variant in (variants[(CASES.index(case) + DTYPES.index(dtype) + causal) % 3],):
                        q, k, v = random_qkv(*case, dtype, seed=runs)
                        lens = None
                        if variant == "strided":  # (batch, heads, seq, dim) storage seen through a transpose
                            qd, kd, vd = (cupy.asarray(np.ascontiguousarray(x.transpose(0, 2, 1, 3))).transpose(0, 2, 1, 3) for x in (q, k, v))
                        else:
                            qd, kd, vd = (cupy.asarray(x) for x in (q, k, v))
                        if variant == "seqlens_k":  # ragged cache lengths, 0 and full included
                            lens = [(case[2] * (i + 1)) // (case[0] + 1) for i in range(case[0])]
                            lens[0], lens[-1] = 0, case[2]
                        out = cupy.full(q.shape, np.nan, dtype=q.dtype)
                        try:
                            _, lse = cupy_gqa.attention(
                                qd, kd, vd, causal=causal, out=out, return_lse=True, kernel=kernel, seqlens_k=lens
                            )
                        except ValueError as e:
                            if "does not support" in str(e):
                                continue
                            raise
                        runs += 1
                        ref = reference_attention(q, k, v, causal=causal, seqlens_k=lens)[0]
                        err = relative_error(cupy.asnumpy(out), ref)
                        if not err <= TOLERANCE[dtype]:
                            failures += 1
                            print(f"FAIL {kernel} {case} {dtype} causal={causal} {variant}: error {err:.2e}")
    cupy.cuda.Device().synchronize()
    print(f"sanitize_driver: {runs} calls, {failures} wrong results")
    return 1 if failures or runs == 0 else 0


if __name__ == "__main__":
    # sanitize_driver.py [kernel ...]: only these kernel families (default: all, and "backward":
    # attention_backward's kernels); "family:seq", "family:mods": only that family's per-sequence
    # calls, or its modifier calls; "backward:cases", "backward:mods": the backward without or with modifiers
    sys.exit(main(sys.argv[1:] or (*cupy_gqa.KERNELS, "backward")))
