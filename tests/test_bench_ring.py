"""CPU tests of benchmarks/bench_ring.py: the command line, and a smoke run under torchrun on a gloo group.

The script measures ring attention on several GPUs; here only --smoke runs (CPU tensors, a tiny
problem), which goes through the same code and writes the same results files.
"""
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH_PATH = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_ring.py"


def _load():
    spec = importlib.util.spec_from_file_location("bench_ring", BENCH_PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


bench = _load()


def test_defaults_are_r1():
    a = bench.parse_args([])
    assert (a.batch, a.seqlen, a.heads, a.kv_heads, a.head_dim, a.dtype, a.causal, a.sharding) == (
        1, 131072, 32, 8, 128, "bfloat16", True, "zigzag"
    )
    assert a.out == bench.RESULTS and a.backward and a.single


def test_smoke_is_tiny():
    a = bench.parse_args(["--smoke"])
    assert (a.seqlen, a.heads, a.kv_heads, a.head_dim, a.dtype, a.reps) == (64, 4, 2, 16, "float32", 1)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--heads", "6", "--kv-heads", "4"], "--heads: expected a multiple of --kv-heads = 4, got 6"),
        (["--reps", "0"], "--reps: expected >= 1, got 0"),
        (["--dtype", "int8"], "invalid choice"),
    ],
)
def test_bad_arguments(argv, message, capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(argv)
    assert message in capsys.readouterr().err


def test_sequence_must_split_into_shards():
    with pytest.raises(SystemExit, match=r"--seqlen: expected a multiple of 16 \(zigzag shards on 8 ranks\), got 131064"):
        bench.check_world(bench.parse_args(["--seqlen", "131064"]), 8)
    bench.check_world(bench.parse_args(["--seqlen", "131064", "--sharding", "contiguous"]), 8)


def test_without_torchrun_says_how(tmp_path):
    pytest.importorskip("torch")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    r = subprocess.run([sys.executable, str(BENCH_PATH), "--smoke", "--out", str(tmp_path)], env=env,
                       capture_output=True, text=True, timeout=120)  # fmt: skip
    assert r.returncode != 0 and "launch it with torchrun" in r.stderr


def test_smoke_run_under_torchrun(tmp_path):
    torch = pytest.importorskip("torch")
    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    r = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(BENCH_PATH),
         "--smoke", "--out", str(tmp_path)],
        env=env, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    result = json.loads((tmp_path / "cpux2_ring.json").read_text())
    assert result["world_size"] == 2 and result["config"]["smoke"]
    assert [row["pass"] for row in result["rows"]] == ["forward", "forward + backward"]
    assert all(row["ring_ms"] > 0 and row["single_ms"] > 0 for row in result["rows"])
    assert result["rel_err"] < 1e-5
    md = (tmp_path / "cpux2_ring.md").read_text()
    assert md.startswith("# Ring attention: cpu x 2") and "| forward + backward |" in md
