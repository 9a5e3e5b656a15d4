"""cupy_gqa.distributed: ring attention over torch.distributed, on CPU.

Groups of 1, 2 and 4 processes (tests/ring_worker.py) join a gloo group through
a file in a temporary folder and run ring attention on CPU tensors (the NumPy
backend computes each block). The gathered shards must equal single-process
cupy_gqa.attention / attention_backward on the full tensors: 1e-12 for out and
lse and 1e-10 for the gradients in float64, dtype tolerances otherwise. The
block plan is checked exhaustively against the causal mask without processes.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)

import cupy_gqa  # noqa: E402
import cupy_gqa.distributed as cd  # noqa: E402

from reference import reference_attention  # noqa: E402

WORKER = Path(__file__).resolve().parent / "ring_worker.py"
sys.path.insert(0, str(WORKER.parent))
import ring_worker  # noqa: E402

TIMEOUT_S = 240


def run_group(suite: str, world: int, tmp_path) -> tuple[list[dict], list[dict]]:
    """Start world_size workers, wait for them, return each rank's arrays and errors."""
    init_file = tmp_path / "init"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(WORKER.parent.parent), os.environ.get("PYTHONPATH", "")]))
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), suite, str(r), str(world), str(init_file), str(tmp_path)],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
        )  # fmt: skip
        for r in range(world)
    ]
    outputs = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=TIMEOUT_S)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for r, (p, text) in enumerate(zip(procs, outputs)):
        assert p.returncode == 0, f"rank {r} of {world} exited with {p.returncode}:\n{text[-4000:]}"
    arrays, errors = [], []
    for r in range(world):
        with np.load(tmp_path / f"rank{r}.npz") as f:
            arrays.append({k: f[k] for k in f.files})
        errors.append(json.loads((tmp_path / f"rank{r}.json").read_text()))
    return arrays, errors


def gather(arrays: list[dict], key: str, sharding: str, dim: int = 1):
    shards = [a[key] for a in arrays]
    return cd.zigzag_unshard(shards, dim=dim) if sharding == "zigzag" else np.concatenate(shards, axis=dim)


def max_rel(got, ref):
    got, ref = np.asarray(got, dtype=np.float64), np.asarray(ref, dtype=np.float64)
    assert got.shape == ref.shape, (got.shape, ref.shape)
    assert np.isfinite(got).all(), "non-finite values"
    return float(np.abs(got - ref).max() / max(np.abs(ref).max(), 1e-300))


def single_process(case: dict, world: int):
    """out, lse (float32), dq, dk, dv of cupy_gqa on the full tensors in float64, and the float64 lse of the
    definition; the inputs rounded to the case's dtype first, as the ranks see them."""
    dtype = ring_worker.TORCH_DTYPES[case["dtype"]]
    q, k, v, dout = (torch.from_numpy(x).to(dtype).double() for x in ring_worker.full_inputs(case, world))
    qn, kn, vn = (x.numpy() for x in (q, k, v))
    kw = dict(causal=case["causal"], softmax_scale=case["scale"])
    out, lse = cupy_gqa.attention(q, k, v, return_lse=True, **kw)
    dq, dk, dv = cupy_gqa.attention_backward(dout, q, k, v, out, lse, **kw)
    _, lse64 = reference_attention(qn, kn, vn, **kw)
    return {"out": out, "lse": lse, "dq": dq, "dk": dk, "dv": dv, "lse64": lse64}


@pytest.fixture(scope="module")
def exact_runs(tmp_path_factory):
    runs = {}

    def get(world):
        if world not in runs:
            runs[world] = run_group("exact", world, tmp_path_factory.mktemp(f"exact{world}"))[0]
        return runs[world]

    return get


@pytest.mark.parametrize("world", [1, 2, 4])
def test_ring_matches_single_process_float64(world, exact_runs):
    arrays = exact_runs(world)
    failures = []
    for case in ring_worker.case_list("exact", world):
        name, sharding = case["name"], case["sharding"]
        ref = single_process(case, world)
        limits = {"out": 1e-12, "out_nograd": 1e-12, "lse": 1e-12, "lse64": 1e-12, "dq": 1e-10, "dk": 1e-10, "dv": 1e-10}
        for what, limit in limits.items():
            dim = 2 if what.startswith("lse") else 1
            got = gather(arrays, f"{name}/{what}", sharding, dim)
            expected = ref["out" if what == "out_nograd" else what]
            err = max_rel(got, expected.numpy() if hasattr(expected, "numpy") else expected)
            if not err <= limit:
                failures.append(f"{name} {what}: max error {err:.3g} > {limit:g}")
        # the comparison can fail: the wrong mask, or shards put back in the wrong order, are far off
        other = single_process(dict(case, causal=not case["causal"]), world)["out"].numpy()
        assert max_rel(gather(arrays, f"{name}/out", sharding), other) > 1e-3, name
        if world > 1 and case["causal"] and case["local_seqlen"] % 2 == 0:
            wrong = "contiguous" if sharding == "zigzag" else "zigzag"
            assert max_rel(gather(arrays, f"{name}/out", wrong), ref["out"].numpy()) > 1e-3, name
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("world", [2, 4])
def test_ring_low_precision(world, tmp_path):
    """float32 (its own backward formula: dout scaled by each block's weight), bfloat16 and float16 (the
    merged lse), against float64 single-process results, at each dtype's accuracy."""
    arrays, _ = run_group("dtypes", world, tmp_path)
    tolerance = {"float32": 2e-6, "bfloat16": 1e-2, "float16": 2e-3}
    failures = []
    for case in ring_worker.case_list("dtypes", world):
        ref = single_process(case, world)
        for what in ("out", "dq", "dk", "dv"):
            err = max_rel(gather(arrays, f"{case['name']}/{what}", case["sharding"]), ref[what].numpy())
            if not err <= tolerance[case["dtype"]]:
                failures.append(f"{case['name']} {what}: max error {err:.3g} > {tolerance[case['dtype']]:g}")
        lse_err = np.abs(gather(arrays, f"{case['name']}/lse", case["sharding"], 2) - ref["lse64"]).max()
        if not lse_err <= 2e-6 * max(1.0, np.abs(ref["lse64"]).max()):
            failures.append(f"{case['name']} lse: max error {lse_err:.3g}")
    assert not failures, "\n".join(failures)


def test_ring_rejects_mismatched_ranks(tmp_path):
    _, errors = run_group("rejects", 2, tmp_path)
    assert errors[0] == errors[1], "every rank raises the same error"
    e = errors[0]
    assert e["uneven"] == (
        "ValueError: q: expected local_seqlen 6 on every rank (that of rank 0), got 4 on rank 1; "
        "ring attention takes shards of equal length (zigzag_shard makes them)"
    )
    assert e["odd"].startswith("ValueError: q: expected an even local_seqlen for sharding='zigzag'") and "got 5" in e["odd"]
    assert e["heads"] == "ValueError: q: expected shape (1, 4, 2, 4) on every rank (that of rank 0), got (1, 4, 4, 4) on rank 1"
    assert e["causal"] == "ValueError: causal: expected True on every rank (that of rank 0), got False on rank 1"
    assert e["k_length"].startswith("ValueError: k: expected local_seqlen 4 (that of q") and e["k_length"].endswith("got 6")
    assert e["sharding"] == "ValueError: sharding: expected one of ('zigzag', 'contiguous'), got 'striped'"
    assert e["after"] == "ok"


# --- without processes ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("sharding", ["zigzag", "contiguous"])
@pytest.mark.parametrize("world", [1, 2, 3, 4, 5])
def test_block_plan_covers_the_causal_mask_once(world, sharding):
    """Over all ranks and steps, the blocks computed cover each visible (query, key) pair of the
    whole sequence exactly once and no masked pair; a causal block is square and on the diagonal."""
    local = 6
    seqlen = world * local
    positions = np.arange(seqlen)[None, :]
    pos = [ring_worker.shard(positions, r, world, sharding)[0] for r in range(world)]  # global position of each local token
    seen = np.zeros((seqlen, seqlen), dtype=int)
    for rank in range(world):
        for step in range(world):
            block = cd._block(rank, world, step, True, sharding, local)
            if block is None:
                continue
            rows, keys, causal = block
            qp, kp = pos[rank][rows], pos[(rank - step) % world][keys]
            visible = qp[:, None] >= kp[None, :]
            if causal:
                assert np.array_equal(qp, kp) and (np.diff(qp) > 0).all(), f"rank {rank} step {step}: not a diagonal block"
                # the local causal mask (lower triangle in local order) is the global one
                assert (np.tril(np.ones((len(qp), len(kp)), dtype=bool)) == visible).all()
                seen[np.ix_(qp, kp)] += visible
            else:
                assert visible.all(), f"rank {rank} step {step}: a non-causal block has masked pairs"
                seen[np.ix_(qp, kp)] += 1
    assert (seen == np.tril(np.ones((seqlen, seqlen), dtype=int))).all()


def test_block_plan_zigzag_balanced():
    world, local = 4, 8
    work = []
    for rank in range(world):
        pairs = 0
        for step in range(world):
            block = cd._block(rank, world, step, True, "zigzag", local)
            if block is not None:
                rows, keys, _ = block
                pairs += len(range(local)[rows]) * len(range(local)[keys])
        work.append(pairs)
    assert len(set(work)) == 1, work


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_zigzag_shard_round_trip(world):
    rng = np.random.default_rng(world)
    x = rng.standard_normal((2, 4 * world, 3, 5))
    before = x.copy()
    shards = [cd.zigzag_shard(x, r, world) for r in range(world)]
    np.testing.assert_array_equal(cd.zigzag_unshard(shards), x)
    np.testing.assert_array_equal(x, before)
    c = x.shape[1] // (2 * world)
    np.testing.assert_array_equal(shards[0][:, :c], x[:, :c])
    np.testing.assert_array_equal(shards[0][:, c:], x[:, -c:])
    t = torch.from_numpy(x)
    lse = t.transpose(1, 2)  # (2, 3, seqlen, 5): the sequence on axis 2
    ts = [cd.zigzag_shard(lse, r, world, dim=2) for r in range(world)]
    assert isinstance(ts[0], torch.Tensor)
    assert torch.equal(cd.zigzag_unshard(ts, dim=2), lse)


def test_zigzag_shard_rejects():
    x = np.ones((1, 10, 2, 4))
    with pytest.raises(ValueError, match=r"x: expected a seqlen \(axis 1\) divisible by 2 \* world_size = 4 for zigzag sharding, got 10"):
        cd.zigzag_shard(np.ones((1, 10, 2, 4)), 0, 2)
    with pytest.raises(ValueError, match=r"rank: expected 0 <= rank < world_size = 2, got 2"):
        cd.zigzag_shard(x, 2, 2)
    with pytest.raises(TypeError, match=r"world_size: expected an int, got float"):
        cd.zigzag_shard(x, 0, 2.0)
    with pytest.raises(ValueError, match=r"dim: expected an axis of x \(ndim 4\), got 4"):
        cd.zigzag_shard(x, 0, 1, dim=4)
    with pytest.raises(ValueError, match=r"shards\[1\]: expected length 4 on axis 1 \(that of shards\[0\]\), got 6"):
        cd.zigzag_unshard([np.ones((1, 4)), np.ones((1, 6))])
    with pytest.raises(TypeError, match=r"shards: expected a non-empty list"):
        cd.zigzag_unshard([])


def test_ring_attention_argument_checks():
    x = torch.ones(1, 4, 2, 4, dtype=torch.float64)
    with pytest.raises(TypeError, match=r"q: expected a torch tensor, got ndarray"):
        cd.ring_attention(x.numpy(), x, x)
    with pytest.raises(TypeError, match=r"causal: expected a bool, got int 1"):
        cd.ring_attention(x, x, x, causal=1)
    with pytest.raises(ValueError, match=r"sharding: expected one of \('zigzag', 'contiguous'\), got 'x'"):
        cd.ring_attention(x, x, x, sharding="x")
    if not torch.distributed.is_initialized():
        with pytest.raises(RuntimeError, match=r"torch.distributed is not initialized"):
            cd.ring_attention(x, x, x)


def test_merge_handles_rows_without_keys():
    """-inf on both sides stays out 0, lse -inf (no NaN); one side -inf takes the other exactly."""
    out = torch.zeros(1, 3, 1, 2, dtype=torch.float64)
    lse = torch.full((1, 1, 3), -np.inf, dtype=torch.float64)
    block_out = torch.tensor([[[[1.0, 2.0]], [[0.0, 0.0]], [[3.0, -1.0]]]], dtype=torch.float64)
    block_lse = torch.tensor([[[0.5, -np.inf, 2.0]]], dtype=torch.float64)
    cd._merge(out, lse, block_out, block_lse)
    assert torch.equal(out, block_out) and torch.equal(lse, block_lse)
    cd._merge(out, lse, torch.full_like(block_out, 7.0), torch.tensor([[[-np.inf, -np.inf, 2.0]]], dtype=torch.float64))
    assert out[0, 0].tolist() == [[1.0, 2.0]] and out[0, 1].tolist() == [[0.0, 0.0]]
    assert lse[0, 0, 1] == -np.inf and lse[0, 0, 0] == 0.5
    np.testing.assert_allclose(out[0, 2, 0].numpy(), [5.0, 3.0], rtol=1e-15)  # equal weights
    np.testing.assert_allclose(lse[0, 0, 2].item(), 2.0 + np.log(2.0), rtol=1e-15)


def test_readme_shows_the_real_signature():
    import inspect
    import re

    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    shown = re.search(r"`cupy_gqa\.distributed\.ring_attention\((q, k, v, \*, .*?)\)`", readme).group(1)
    assert shown == str(inspect.signature(cd.ring_attention))[1:-1].replace("'", '"')
