"""One rank of the ring attention tests (tests/test_distributed.py starts world_size of these).

    python tests/ring_worker.py SUITE RANK WORLD_SIZE INIT_FILE OUT_DIR

Joins a gloo group through ``file://INIT_FILE``, runs the cases of SUITE on CPU
tensors and writes this rank's results to OUT_DIR/rank{RANK}.npz (arrays named
``<case>/<what>``) and OUT_DIR/rank{RANK}.json (errors raised, as text). Every
rank builds the same full random tensors from the case's seed and takes its
shard of them; the test compares the gathered shards with single-process
cupy_gqa on the full tensors.
"""
import json
import os
import sys

import numpy as np
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import cupy_gqa.distributed as cd  # noqa: E402

TORCH_DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def case_list(suite: str, world: int) -> list[dict]:
    """The cases of a suite: name, shapes per rank (local_seqlen), dtype, flags."""
    base = dict(batch=2, local_seqlen=6, heads=4, kv_heads=2, head_dim=8, dtype="float64", scale=None, seed=0)
    if suite == "exact":
        cases = []
        for sharding in ("zigzag", "contiguous"):
            for causal in (True, False):
                cases.append(dict(base, sharding=sharding, causal=causal))
        cases.append(dict(base, sharding="zigzag", causal=True, heads=3, kv_heads=3, seed=1))  # MHA
        cases.append(dict(base, sharding="zigzag", causal=True, heads=4, kv_heads=1, seed=2, scale=0.7))  # MQA, scale
        cases.append(dict(base, sharding="contiguous", causal=True, local_seqlen=5, batch=1, seed=3))  # odd length
        cases.append(dict(base, sharding="zigzag", causal=True, local_seqlen=2, head_dim=4, seed=4))  # chunks of one token
    elif suite == "dtypes":
        cases = [
            dict(base, sharding="zigzag", causal=True, dtype=dt, local_seqlen=8, head_dim=16, seed=5)
            for dt in ("float32", "bfloat16", "float16")
        ]
    else:
        raise SystemExit(f"ring_worker: unknown suite {suite!r}")
    for c in cases:
        c["name"] = "{sharding}-{causal}-{dtype}-h{heads}/{kv_heads}-s{local_seqlen}-seed{seed}".format(
            **{**c, "causal": "causal" if c["causal"] else "full"}
        )
    return cases


def full_inputs(case: dict, world: int):
    """Full (batch, world * local_seqlen, heads, head_dim) float64 q, k, v, dout: random normal, never zeros."""
    rng = np.random.default_rng(case["seed"] + 100 * world)
    seqlen = world * case["local_seqlen"]
    shapes = [(case["batch"], seqlen, h, case["head_dim"]) for h in (case["heads"], case["kv_heads"], case["kv_heads"], case["heads"])]
    return [rng.standard_normal(s) for s in shapes]


def shard(x, rank: int, world: int, sharding: str):
    if sharding == "zigzag":
        return cd.zigzag_shard(x, rank, world)
    n = x.shape[1] // world
    return x[:, rank * n : (rank + 1) * n]


def run_case(case: dict, rank: int, world: int, results: dict) -> None:
    dtype = TORCH_DTYPES[case["dtype"]]
    q, k, v, dout = (torch.from_numpy(shard(x, rank, world, case["sharding"])).to(dtype) for x in full_inputs(case, world))
    originals = [x.clone() for x in (q, k, v, dout)]
    qg, kg, vg = (x.clone().requires_grad_(True) for x in (q, k, v))
    kwargs = dict(causal=case["causal"], softmax_scale=case["scale"], sharding=case["sharding"])
    out, lse = cd.ring_attention(qg, kg, vg, return_lse=True, **kwargs)
    out.backward(dout)
    with torch.no_grad():
        plain = cd.ring_attention(q, k, v, **kwargs)  # without autograd: the same out
    name = case["name"]
    results[f"{name}/out"] = out.detach().double().numpy()
    results[f"{name}/out_nograd"] = plain.double().numpy()
    results[f"{name}/lse"] = lse.numpy()
    results[f"{name}/dq"], results[f"{name}/dk"], results[f"{name}/dv"] = (x.grad.double().numpy() for x in (qg, kg, vg))
    if dtype == torch.float64:  # the merged lse before its float32 rounding
        setup = cd._Setup(dist.group.WORLD, case["causal"], case["scale"] or case["head_dim"] ** -0.5, case["sharding"], q.shape[1])
        _, lse64, _ = cd._forward(q, k, v, setup, keep_block_lse=False)
        results[f"{name}/lse64"] = lse64.numpy()
    for x, before, what in zip((q, k, v, dout), originals, ("q", "k", "v", "dout")):
        if not torch.equal(x, before):
            raise AssertionError(f"{name}: ring_attention modified {what}")


def run_rejects(rank: int, world: int, errors: dict) -> None:
    """Calls every rank must refuse with the same message."""

    def expect(name, make):
        try:
            make()
        except (ValueError, TypeError) as e:
            errors[name] = f"{type(e).__name__}: {e}"
        else:
            errors[name] = "no error"

    rng = np.random.default_rng(7)
    t = lambda *s: torch.from_numpy(rng.standard_normal(s))  # noqa: E731
    local = 6 if rank == 0 else 4  # uneven shards
    expect("uneven", lambda: cd.ring_attention(t(1, local, 2, 4), t(1, local, 2, 4), t(1, local, 2, 4)))
    expect("odd", lambda: cd.ring_attention(t(1, 5, 2, 4), t(1, 5, 2, 4), t(1, 5, 2, 4)))
    heads = 2 if rank == 0 else 4
    expect("heads", lambda: cd.ring_attention(t(1, 4, heads, 4), t(1, 4, 2, 4), t(1, 4, 2, 4)))
    expect("causal", lambda: cd.ring_attention(t(1, 4, 2, 4), t(1, 4, 2, 4), t(1, 4, 2, 4), causal=rank == 0))
    expect("k_length", lambda: cd.ring_attention(t(1, 4, 2, 4), t(1, 6, 2, 4), t(1, 6, 2, 4)))
    expect("sharding", lambda: cd.ring_attention(t(1, 4, 2, 4), t(1, 4, 2, 4), t(1, 4, 2, 4), sharding="striped"))
    # the group still works after the refusals
    x = t(1, 4, 2, 4)
    out = cd.ring_attention(x, x, x)
    errors["after"] = "ok" if out.shape == x.shape and torch.isfinite(out).all() else "bad"


def main():
    suite, rank, world, init_file, out_dir = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        results, errors = {}, {}
        if suite == "rejects":
            run_rejects(rank, world, errors)
        else:
            for case in case_list(suite, world):
                run_case(case, rank, world, results)
        np.savez(os.path.join(out_dir, f"rank{rank}.npz"), **results)
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(errors, f)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
