"""CPU tests of benchmarks/bench_attention.py: counters, case table, command line, no-GPU exit, output files.

benchmarks/ is not a package, so the script is loaded by path. None of these tests needs
a GPU; the reference test needs torch (CPU is enough) and skips without it.
"""

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH_PATH = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_attention.py"


def _load_bench():
    spec = importlib.util.spec_from_file_location("bench_attention", BENCH_PATH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(module)
    return module


bench = _load_bench()


def _run_script(*args, env_extra=None, prelude="", tmp_path=None):
    """Run the script in a fresh interpreter; prelude runs before it (e.g. to hide modules)."""
    code = (
        "import runpy, sys\n"
        f"{prelude}\n"
        f"sys.argv = [{str(BENCH_PATH)!r}, *{list(args)!r}]\n"
        f"runpy.run_path({str(BENCH_PATH)!r}, run_name='__main__')\n"
    )
    env = dict(os.environ, **(env_extra or {}))
    if tmp_path is not None:
        env["TMPDIR"] = str(tmp_path)
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)


# ---------------------------------------------------------------------------
# counters
# ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    "seqlen_q, seqlen_k, causal, expected",
    [
        (3, 5, True, 12),  # rows see 3, 4, 5 keys
        (5, 3, True, 6),  # rows see 0, 0, 1, 2, 3 keys
        (5, 3, False, 15),
        (3, 5, False, 15),
        (4, 4, True, 10),  # 1 + 2 + 3 + 4
        (6, 2, True, 3),  # 0, 0, 0, 0, 1, 2
        (8, 1, True, 1),  # only the last query sees the one key
        (1, 1, True, 1),
        (1, 8192, True, 8192),  # decode: the new token sees the whole cache
        (80, 80, True, 3240),  # S0: 80 * 81 / 2
        (0, 5, True, 0),
        (5, 0, True, 0),
    ],
)
def test_visible_pairs_hand_counted(seqlen_q, seqlen_k, causal, expected):
    assert bench.visible_pairs(seqlen_q, seqlen_k, causal) == expected


def test_visible_pairs_matches_row_by_row_count():
    for seqlen_q in range(0, 14):
        for seqlen_k in range(0, 14):
            rows = [min(seqlen_k, max(0, i + seqlen_k - seqlen_q + 1)) for i in range(seqlen_q)]
            got = bench.visible_pairs(seqlen_q, seqlen_k, True)
            assert got == sum(rows), f"seqlen_q={seqlen_q} seqlen_k={seqlen_k}: got {got}, rows {rows}"


def _case(**kw):
    fields = dict(name="t", batch=2, seqlen_q=3, seqlen_k=5, num_q_heads=4, num_kv_heads=2, head_dim=8, dtype="bf16")
    fields.update(kw)
    return bench.Case(**fields)


def test_attention_flops_small_cases():
    # 4 * head_dim * pairs * batch * num_q_heads
    assert bench.attention_flops(_case()) == 4 * 8 * 12 * 2 * 4 == 3072
    assert bench.attention_flops(_case(seqlen_q=5, seqlen_k=3)) == 4 * 8 * 6 * 2 * 4
    assert bench.attention_flops(_case(causal=False)) == 4 * 8 * 15 * 2 * 4


def test_attention_flops_table_cases():
    c = bench.CASE_BY_NAME
    s = 4096  # H1: the ANCHORS formula 4 * B * Hq * D * S(S+1)/2
    assert bench.attention_flops(c["h1"]) == 4 * 4 * 32 * 128 * s * (s + 1) // 2
    assert bench.attention_flops(c["n1"]) == 4 * 4 * 32 * 128 * s * s
    assert bench.attention_flops(c["d1"]) == 4 * 16 * 32 * 128 * 8192
    assert bench.attention_flops(c["s0"]) == 4 * 2 * 8 * 32 * 3240


def test_backward_flops_are_2_5_times_the_forward():
    c = bench.CASE_BY_NAME
    s = 4096
    assert bench.attention_flops(c["g1"]) == 10 * 4 * 32 * 128 * s * (s + 1) // 2  # 5 products of 2 flops each
    assert bench.attention_flops(c["g1"]) == int(2.5 * bench.attention_flops(c["h1"]))


def test_kv_bytes():
    # batch * seqlen_k * num_kv_heads * head_dim * itemsize * 2 (K and V)
    assert bench.kv_bytes(_case()) == 2 * 5 * 2 * 8 * 2 * 2 == 640
    assert bench.kv_bytes(_case(dtype="fp32")) == 1280
    assert bench.kv_bytes(bench.CASE_BY_NAME["d1"]) == 16 * 8192 * 8 * 128 * 2 * 2 == 536870912
    assert bench.kv_bytes(bench.CASE_BY_NAME["d2"]) == 64 * 2048 * 8 * 128 * 2 * 2


def test_finish_row_derives_rates_from_ms():
    case = bench.CASE_BY_NAME["d1"]
    row = bench.finish_row(bench.Row("D1", "torch_cudnn", ms=0.131), case)
    assert row.tflops == pytest.approx(bench.attention_flops(case) / 0.131e-3 / 1e12)
    assert row.gbps == pytest.approx(4098.3, rel=1e-3)  # ANCHORS: cuDNN at 0.131 ms is ~4100 GB/s of K/V


# ---------------------------------------------------------------------------
# the case table
# ---------------------------------------------------------------------------
# name: (batch, seqlen_q, seqlen_k, num_q_heads, num_kv_heads, head_dim, dtype, causal, kind), from the spec
EXPECTED_CASES = {
    "S0": (2, 80, 80, 8, 2, 32, "fp32", True, "prefill"),
    "S0h": (2, 80, 80, 8, 2, 32, "bf16", True, "prefill"),
    "F1": (4, 4096, 4096, 32, 8, 128, "fp32", True, "prefill"),
    "F2": (4, 1024, 1024, 32, 8, 64, "fp32", True, "prefill"),
    "H1": (4, 4096, 4096, 32, 8, 128, "bf16", True, "prefill"),
    "H2": (1, 16384, 16384, 32, 8, 128, "bf16", True, "prefill"),
    "H3": (16, 512, 512, 32, 8, 128, "fp16", True, "prefill"),
    "H4": (4, 2048, 2048, 32, 8, 64, "bf16", True, "prefill"),
    "N1": (4, 4096, 4096, 32, 8, 128, "bf16", False, "prefill"),
    "H5": (4, 2048, 2048, 32, 8, 80, "bf16", True, "prefill"),
    "H6": (4, 2048, 2048, 32, 8, 192, "bf16", True, "prefill"),
    "H7": (4, 2048, 2048, 32, 8, 256, "bf16", True, "prefill"),
    "G1": (4, 4096, 4096, 32, 8, 128, "bf16", True, "backward"),
    "G2": (4, 2048, 2048, 32, 8, 64, "bf16", True, "backward"),
    "G3": (4, 1024, 1024, 32, 8, 64, "fp32", True, "backward"),
    "D1": (16, 1, 8192, 32, 8, 128, "bf16", True, "decode"),
    "D2": (64, 1, 2048, 32, 8, 128, "bf16", True, "decode"),
    "M1": (1, 32768, 32768, 32, 8, 128, "fp32", True, "memory"),
    "L1": (2, 80, 80, 8, 2, 32, "bf16", True, "call"),
    "L2": (1, 1, 4096, 32, 8, 128, "bf16", True, "call"),
    "L3": (8, 1, 1024, 32, 8, 128, "bf16", True, "call"),
    "P1": (16, 1, 8192, 32, 8, 128, "bf16", True, "paged"),
    "P2": (16, 1, 8192, 32, 8, 128, "bf16", True, "paged"),
    "P3": (16, 1, 8192, 32, 8, 128, "bf16", True, "paged"),
    "P4": (4, 2048, 8192, 32, 8, 128, "bf16", True, "paged"),
    "P5": (4, 2048, 8192, 32, 8, 128, "bf16", True, "paged"),
    "V1": (16, 4096, 4096, 32, 8, 128, "bf16", True, "varlen"),
}


def test_case_table_matches_spec():
    assert [c.name for c in bench.CASES] == list(EXPECTED_CASES)
    for c in bench.CASES:
        got = (c.batch, c.seqlen_q, c.seqlen_k, c.num_q_heads, c.num_kv_heads, c.head_dim, c.dtype, c.causal, c.kind)
        assert got == EXPECTED_CASES[c.name], f"{c.name}: got {got}, expected {EXPECTED_CASES[c.name]}"


def test_parse_cases_selects_subset_in_order():
    assert [c.name for c in bench.parse_cases("S0,H1")] == ["S0", "H1"]
    assert [c.name for c in bench.parse_cases(" m1 , s0h,M1")] == ["M1", "S0h"]


@pytest.mark.parametrize("text", ["S0,X9", "H9", ",", "S0h2"])
def test_parse_cases_rejects_unknown(text):
    with pytest.raises(Exception) as info:
        bench.parse_cases(text)
    assert "case" in str(info.value)


def test_cli_unknown_case_exits_nonzero_with_clear_message(capsys):
    with pytest.raises(SystemExit) as info:
        bench.main(["--cases", "S0,X9"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "unknown case 'X9'" in err and "S0h" in err  # names the bad case and lists the known ones


def test_cli_default_is_all_cases():
    args = bench.build_parser().parse_args([])
    assert [c.name for c in args.cases] == list(EXPECTED_CASES)
    args = bench.build_parser().parse_args(["--cases", "D2,F1", "--quick", "--out", "/tmp/x", "--no-plot"])
    assert [c.name for c in args.cases] == ["D2", "F1"] and args.quick and args.no_plot and str(args.out) == "/tmp/x"


def test_cli_list_prints_only_selected_cases(capsys):
    assert bench.main(["--list", "--cases", "H1,D2"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert [line.split()[0] for line in lines] == ["H1", "D2"]
    assert "Sk2048" in lines[1]


@pytest.mark.parametrize(
    "name, tag",
    [("NVIDIA H200", "h200"), ("NVIDIA H100 80GB HBM3", "h100"), ("NVIDIA A100-SXM4-80GB", "a100"),
     ("NVIDIA GeForce RTX 4090", "rtx4090")],
)
def test_gpu_tag(name, tag):
    assert bench.gpu_tag(name) == tag


# ---------------------------------------------------------------------------
# without a GPU
# ---------------------------------------------------------------------------
def test_import_needs_neither_torch_nor_cupy():
    code = (
        "import sys, importlib.util\n"
        "sys.modules['torch'] = None; sys.modules['cupy'] = None  # any import of them now raises\n"
        f"spec = importlib.util.spec_from_file_location('b', {str(BENCH_PATH)!r})\n"
        "m = importlib.util.module_from_spec(spec); sys.modules['b'] = m; spec.loader.exec_module(m)\n"
        "print(m.visible_pairs(3, 5, True))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "12"


def test_help_works_without_gpu():
    proc = _run_script("--help", env_extra={"CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 0, proc.stderr
    assert "--cases" in proc.stdout and "M1" in proc.stdout


def test_no_cuda_device_exits_nonzero_with_message(tmp_path):
    proc = _run_script("--cases", "S0", "--out", str(tmp_path / "out"),
                       env_extra={"CUDA_VISIBLE_DEVICES": ""}, tmp_path=tmp_path)
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("bench_attention: no CUDA device found"), proc.stderr
    assert not (tmp_path / "out").exists()  # nothing written
    assert not list(tmp_path.glob("bench_attention_cupy_cache_*"))  # the cold-compile cache dir is removed


def test_missing_torch_and_cupy_exits_nonzero_with_message(tmp_path):
    proc = _run_script("--cases", "S0", prelude="sys.modules['torch'] = None; sys.modules['cupy'] = None",
                       tmp_path=tmp_path)
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("bench_attention: no CUDA device found") and "torch is not importable" in last


# ---------------------------------------------------------------------------
# rows, tables, results files
# ---------------------------------------------------------------------------
def _fake_rows():
    rows = [
        bench.Row("H1", "cupy_gqa[auto]", ms=2.0, reps=20, rel_err=1e-3, ref_scope="full", compile_s=1.5),
        bench.Row("H1", "torch_flash", ms=1.0, reps=20, rel_err=2e-3, ref_scope="full"),
        bench.Row("H1", "torch_cudnn", ms=4.0, reps=20, rel_err=2e-3, ref_scope="full"),
        bench.Row("D1", "cupy_gqa[auto]", ms=0.5, reps=20, rel_err=1e-3, ref_scope="full"),
        bench.Row("D1", "torch_flash", ms=0.25, reps=20, rel_err=1e-3, ref_scope="full"),
        bench.Row("M1", "cupy_gqa[auto]", rel_err=3e-7, ref_scope="b0 h0-3", peak_extra_mib=16.0),
    ]
    for r in rows:
        bench.finish_row(r, bench.CASE_BY_NAME[r.case.lower()])
    bench.add_ratios(rows)
    return rows


def test_add_ratios_per_case():
    rows = _fake_rows()
    assert rows[0].vs == {"torch_flash": 2.0, "torch_cudnn": 0.5}
    assert rows[3].vs == {"torch_flash": 2.0}
    assert rows[1].vs == {}  # anchors get no ratio
    assert rows[0].to_json()["vs_torch_cudnn"] == 0.5


ENV = {"gpu": "NVIDIA H200", "date": "2026-01-01T00:00:00+00:00", "command": "python benchmarks/bench_attention.py --quick"}


def test_tables_and_markdown():
    rows = _fake_rows()
    headers, cells = bench.table(rows)
    assert headers[:3] == ["case", "impl", "ms"] and "vs_torch_flash" in headers
    assert len(cells) == 5  # M1 is a memory row, not a timed one
    h1 = cells[0]
    assert h1[:4] == ["H1", "cupy_gqa[auto]", "2.0000", "20"]
    assert h1[headers.index("vs_torch_flash")] == "2.00"
    md = bench.render_markdown(ENV, rows, [{"case": "H1", "impl": "torch_math", "reason": "too big"}], [], None)
    assert "NVIDIA H200" in md and "--quick" in md
    assert "| H1 | cupy_gqa[auto] | 2.0000 | 20 |" in md
    assert "| M1 | cupy_gqa[auto] | 16.0 |" in md
    assert "- H1 torch_math: too big" in md
    text = bench.format_text(headers, cells)
    assert len(text.splitlines()) == 6


def test_method_text_states_the_constants_in_force():
    method = bench.METHOD
    assert method.startswith("* Time: CUDA events")
    assert f"SLOW_CALL_MS = {bench.SLOW_CALL_MS:g} ms" in method
    assert f"FAST_REPS = {bench.FAST_REPS} repetitions (--quick: {bench.QUICK_FAST_REPS})" in method
    assert f"SLOW_REPS = {bench.SLOW_REPS} (--quick: {bench.QUICK_SLOW_REPS})" in method
    assert f"REF_FULL_MAX_SCORES = {bench.REF_FULL_MAX_SCORES:.0e}".replace("e+", "e") in method


def _fake_sweep():
    return [
        {"seqlen": n, "batch": 16384 // n, "impl": impl, "ms": 1.0, "reps": 20, "tflops": tf}
        for n in (512, 4096, 16384)
        for impl, tf in (("cupy_gqa[auto]", 100.0 + n / 100), ("torch_flash", 300.0), ("torch_cudnn", 500.0))
    ]


def test_write_results_json_and_markdown(tmp_path):
    written = bench.write_results(tmp_path, "h200", ENV, _fake_rows(), [], _fake_sweep(), plot=False)
    assert sorted(p.name for p in written) == ["h200.json", "h200.md"]
    doc = json.loads((tmp_path / "h200.json").read_text())
    assert doc["gpu"] == "NVIDIA H200" and doc["command"] == ENV["command"]
    assert doc["rows"][0]["impl"] == "cupy_gqa[auto]" and doc["rows"][0]["vs_torch_flash"] == 2.0
    assert len(doc["sweep"]) == 9 and "CUDA events" in doc["method"]
    md = (tmp_path / "h200.md").read_text()
    assert "| 16384 | 1 | 263.8 | 300.0 | 500.0 |" in md


def test_plot_sweep_writes_png(tmp_path):
    pytest.importorskip("matplotlib")
    written = bench.write_results(tmp_path, "h200", ENV, _fake_rows(), [], _fake_sweep(), plot=True)
    png = tmp_path / "h200_prefill.png"
    assert png in written
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "![prefill sweep](h200_prefill.png)" in (tmp_path / "h200.md").read_text()


# ---------------------------------------------------------------------------
# the float64 reference (torch on CPU)
# ---------------------------------------------------------------------------
def _literal_attention(q, k, v, causal):
    """numpy float64, straight from the definition: kv_head = q_head // group_size, bottom-right mask."""
    import numpy as np

    batch, seqlen_q, num_q_heads, head_dim = q.shape
    seqlen_k, num_kv_heads = k.shape[1], k.shape[2]
    group_size = num_q_heads // num_kv_heads
    out = np.zeros(q.shape)
    for b in range(batch):
        for h in range(num_q_heads):
            for i in range(seqlen_q):
                n = min(seqlen_k, i + seqlen_k - seqlen_q + 1) if causal else seqlen_k
                if n <= 0:
                    continue
                s = k[b, :n, h // group_size] @ q[b, i, h] / np.sqrt(head_dim)
                p = np.exp(s - s.max())
                out[b, i, h] = p @ v[b, :n, h // group_size] / p.sum()
    return out


@pytest.mark.parametrize("seqlen_q, seqlen_k", [(5, 9), (9, 5), (7, 7), (1, 6)])
@pytest.mark.parametrize("causal", [True, False])
def test_reference_and_naive_loop_follow_definition(seqlen_q, seqlen_k, causal, monkeypatch):
    torch = pytest.importorskip("torch")
    case = bench.Case("t", 2, seqlen_q, seqlen_k, 6, 2, 8, "fp32", causal)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, seqlen_q, 6, 8, generator=gen)
    k = torch.randn(2, seqlen_k, 2, 8, generator=gen)
    v = torch.randn(2, seqlen_k, 2, 8, generator=gen)
    expected = _literal_attention(q.double().numpy(), k.double().numpy(), v.double().numpy(), causal)

    monkeypatch.setattr(bench, "REF_BLOCK_SCORES", 3 * seqlen_k)  # force several row chunks
    got = bench.reference(torch, case, q, k, v, (slice(None),))
    assert abs(got.numpy() - expected).max() < 1e-12

    sub = bench.reference(torch, case, q, k, v, (slice(0, 1), slice(None), slice(0, 3)))  # b0, kv head 0
    assert abs(sub.numpy() - expected[0:1, :, 0:3]).max() < 1e-12

    loop = bench.naive_loop(torch, q, k, v, causal=causal)
    assert abs(loop.double().numpy() - expected).max() < 1e-5


# ---------------------------------------------------------------------------
# The shape sweep (--sweep)
def test_shape_sweep_spans_the_shapes_of_open_models():
    cases = bench.SHAPE_SWEEP
    decode = [c for c in cases if c.kind == "decode"]
    prefill = [c for c in cases if c.kind == "prefill"]
    assert len(cases) >= 48 and len(decode) + len(prefill) == len(cases)
    assert abs(len(decode) - len(prefill)) <= 4  # about half each
    assert len({c.name for c in cases}) == len(cases)
    groups = {c.group_size for c in cases}
    assert 1 in groups and groups & {2, 3} and any(g >= 32 for g in groups) and 16 in groups
    assert any(4 <= g <= 8 and g % 2 for g in groups)  # an odd group between 4 and 8
    assert any(c.num_q_heads & (c.num_q_heads - 1) for c in cases)  # head counts that are not powers of two
    assert {64, 80, 96, 128, 192, 256} <= {c.head_dim for c in cases}
    assert min(c.batch for c in cases) == 1 and max(c.batch for c in cases) >= 64
    keys = [c.seqlen_k for c in cases]
    assert min(keys) <= 1024 and max(keys) >= 128 * 1024 and any(s % 64 for s in keys)
    assert {"bf16", "fp16", "fp32"} <= {c.dtype for c in cases}
    assert all(c.seqlen_q == 1 or 2 <= c.seqlen_q <= 8 for c in decode) and any(c.seqlen_q > 1 for c in decode)
    assert all(c.causal for c in cases)


def test_sweep_anchors_and_summary():
    fp32 = bench.SWEEP_BY_NAME["d25"]
    assert bench.best_torch_anchors(fp32) == ("torch_efficient_expanded",)
    assert bench.best_torch_anchors(bench.SWEEP_BY_NAME["p01"]) == ("torch_cudnn", "torch_flash")
    rows = [
        {"case": "P01", "kind": "prefill", "vs_best": 0.5},
        {"case": "P02", "kind": "prefill", "vs_best": 2.0},
        {"case": "P02", "kind": "prefill"},  # an anchor's own row has no vs_best
        {"case": "D01", "kind": "decode", "vs_best": 1.1},
    ]
    summary = bench.sweep_summary(rows)
    assert summary["prefill"] == {"points": 2, "geomean": pytest.approx(1.0), "worst": 2.0, "worst_case": "P02"}
    assert summary["decode"]["points"] == 1 and summary["decode"]["worst_case"] == "D01"


def test_sweep_markdown_has_every_row_and_the_summary():
    env = {k: k.upper() for k in ("gpu", "date", "command", "git_commit", "torch", "cudnn", "cupy", "driver")}
    rows = [
        {"case": "D01", "kind": "decode", "shape": "B1", "impl": "cupy_gqa[auto]", "ms": 0.1, "rel_err": 2e-3,
         "vs_best": 0.97, "note": "auto runs decode"},
        {"case": "D01", "kind": "decode", "shape": "B1", "impl": "torch_cudnn", "ms": 0.103, "rel_err": 2e-3},
    ]
    text = bench.render_sweep_markdown(env, rows, bench.sweep_summary(rows), None)
    assert "decode: 1 points, geometric mean 0.970, worst 0.970 (D01)" in text
    assert "| D01 | decode | B1 | cupy_gqa[auto] | 0.1000 | 2.0e-03 | 0.970 | auto runs decode |" in text
    assert "| D01 | decode | B1 | torch_cudnn | 0.1030 | 2.0e-03 |  |  |" in text


def test_sweep_list_needs_no_gpu():
    out = subprocess.run([sys.executable, str(BENCH_PATH), "--sweep", "--list"], capture_output=True, text=True, check=True).stdout
    assert len(out.splitlines()) == len(bench.SHAPE_SWEEP) and out.startswith("D01 ")


def test_bench_model_smoke_run_on_the_cpu(tmp_path):
    """benchmarks/bench_model.py end to end with the tiny config on the CPU (the NumPy backend)."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    script = BENCH_PATH.parent / "bench_model.py"
    subprocess.run(
        [sys.executable, str(script), "--config", "tiny", "--device", "cpu", "--reps", "1", "--new-tokens", "4",
         "--prompt-len", "24", "--prefill-len", "32", "--prefill-batch", "2", "--decode-batches", "1,2", "--out", str(tmp_path)],
        check=True, capture_output=True, text=True, timeout=600,
    )
    doc = json.loads((tmp_path / "cpu_model.json").read_text())
    for impl in ("sdpa", "cupy_gqa"):
        r = doc["results"][impl]
        assert r["prefill_ms"] > 0 and r["decode_b2_warm_tok_s"] > 0 and r["decode_b1_cold_tok_s"] > 0
    assert "| prefill_ms |" in (tmp_path / "cpu_model.md").read_text()


def test_hopper_ab_imports_a_second_copy_that_computes_on_its_own(tmp_path):
    """benchmarks/dev/hopper_ab.py's second package: a copy of cupy_gqa imported under
    another name, its modules its own (a patched tree's kernels are what it compiles),
    and its results those of the same algorithm (NumPy backend here)."""
    import shutil

    import numpy as np

    root = BENCH_PATH.parent.parent
    shutil.copytree(root / "cupy_gqa", tmp_path / "cupy_gqa", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(root / "kernels", tmp_path / "kernels")
    sys.path.insert(0, str(BENCH_PATH.parent / "dev"))
    sys.path.insert(0, str(BENCH_PATH.parent))
    try:
        hopper_ab = importlib.import_module("hopper_ab")
        other = hopper_ab.load_copy(str(tmp_path), name="cupy_gqa_copy_under_test")
    finally:
        sys.path.remove(str(BENCH_PATH.parent / "dev"))
        sys.path.remove(str(BENCH_PATH.parent))
    try:
        import cupy_gqa

        assert other.attention is not cupy_gqa.attention
        assert other.api.__name__ == "cupy_gqa_copy_under_test.api"
        assert Path(other._compile.KERNEL_DIR) == tmp_path / "kernels"
        rng = np.random.default_rng(3)
        q = rng.standard_normal((2, 5, 4, 8))
        k, v = rng.standard_normal((2, 7, 2, 8)), rng.standard_normal((2, 7, 2, 8))
        np.testing.assert_array_equal(other.attention(q, k, v), cupy_gqa.attention(q, k, v))
    finally:
        for name in [m for m in sys.modules if m == "cupy_gqa_copy_under_test" or m.startswith("cupy_gqa_copy_under_test.")]:
            del sys.modules[name]


def test_modifier_cases_and_their_flop_basis():
    """W1 (window 1024 on bf16 causal S8192) counts visible pairs; W2 is H1 with softcap 30."""
    import numpy as np

    cases = {mc.name: mc for mc in bench.MOD_CASES}
    w1, w2 = cases["W1"], cases["W2"]
    assert (w1.case.batch, w1.case.seqlen_q, w1.case.num_q_heads, w1.case.num_kv_heads, w1.case.head_dim, w1.case.dtype) == (
        4, 8192, 32, 8, 128, "bf16")
    assert dict(w1.mods) == {"window": (1024, 0)} and w1.baseline == "causal_scaled"
    h1 = bench.CASE_BY_NAME["h1"]
    assert (w2.case.batch, w2.case.seqlen_q, w2.case.head_dim, w2.case.causal) == (h1.batch, h1.seqlen_q, h1.head_dim, True)
    assert dict(w2.mods) == {"softcap": 30.0} and w2.baseline == "plain"
    # W3: W2's softcap as a user's score_mod in units of the cap
    import dataclasses

    import cupy_gqa

    w3 = cases["W3"]
    assert w3.case == dataclasses.replace(w2.case, name="W3") and w3.baseline == "plain"
    mod = dict(w3.mods)["score_mod"](cupy_gqa)
    assert (mod.unit, mod.bounds, mod.cuda) == (30.0, (-1.0, 1.0), "return fast_tanh(score);")
    # visible pairs of a causal window: query i sees min(i, 1024) + 1 keys
    n = 8192
    assert bench.window_visible_pairs(n, n, (1024, 0)) == sum(min(i, 1024) + 1 for i in range(n))
    assert bench.modifier_flops(w1) == 4 * 128 * sum(min(i, 1024) + 1 for i in range(n)) * 4 * 32
    assert bench.modifier_flops(w2) == bench.attention_flops(w2.case)
    # brute force on small shapes, bottom-right, both sides and unbounded ones
    for sq, sk, window, causal in [(5, 9, (2, 0), True), (7, 4, (1, 2), False), (6, 6, (-1, 1), False), (3, 8, (2, -1), False)]:
        i = np.arange(sq)[:, None] + sk - sq
        j = np.arange(sk)[None, :]
        seen = np.ones((sq, sk), bool)
        if window[0] >= 0:
            seen &= j >= i - window[0]
        if causal:
            seen &= j <= i
        elif window[1] >= 0:
            seen &= j <= i + window[1]
        assert bench.window_visible_pairs(sq, sk, window, causal) == int(seen.sum())
    # the full causal pairs agree with the table's own count
    assert bench.window_visible_pairs(100, 100, (-1, 0)) == bench.visible_pairs(100, 100, True)


def test_list_shows_the_modifier_cases(capsys):
    assert bench.main(["--list", "--modifiers"]) == 0
    out = capsys.readouterr().out
    assert "W1   B4 S8192 Hq32 Hkv8 D128 bf16 causal prefill {'window': (1024, 0)}" in out
    assert "W2   B4 S4096 Hq32 Hkv8 D128 bf16 causal prefill {'softcap': 30.0}" in out
    assert "W3   B4 S4096 Hq32 Hkv8 D128 bf16 causal prefill {'score_mod': 'softcap_score_mod(cupy_gqa)'}" in out


@pytest.mark.parametrize("seqlen_q, seqlen_k", [(5, 9), (9, 5), (7, 7)])
@pytest.mark.parametrize("causal", [True, False])
def test_reference_backward_follows_definition(seqlen_q, seqlen_k, causal):
    """bench's float64 gradients (autograd through the definition) against tests/reference.py's,
    on the whole output and on the KV-head-0 subset that large cases use."""
    torch = pytest.importorskip("torch")
    import numpy as np

    from reference import reference_attention_backward

    case = bench.Case("T", 2, seqlen_q, seqlen_k, 6, 2, 8, "fp32", causal, "backward")
    g = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(s, generator=g) for s in ((2, seqlen_q, 6, 8), (2, seqlen_k, 2, 8), (2, seqlen_k, 2, 8), (2, seqlen_q, 6, 8)))
    want = reference_attention_backward(*(x.numpy() for x in (dout, q, k, v)), causal=causal)
    got = bench.reference_backward(torch, case, q, k, v, dout, (slice(None),))
    for a, b in zip(got, want):
        np.testing.assert_allclose(a.numpy(), b, atol=1e-12)
    sub = bench.reference_backward(torch, case, q, k, v, dout, (slice(0, 1), slice(None), slice(0, 3)))
    np.testing.assert_allclose(sub[0].numpy(), want[0][:1, :, :3], atol=1e-12)
    np.testing.assert_allclose(sub[1].numpy(), want[1][:1, :, :1], atol=1e-12)


def test_backward_case_rows_print_time_and_memory():
    row = bench.finish_row(bench.Row("G1", "cupy_gqa[auto]", ms=2.0, reps=20, rel_err=1e-3, peak_extra_mib=4.0), bench.CASE_BY_NAME["g1"])
    line = bench._progress(row)
    assert "2.0000 ms" in line and "peak extra 4.0 MiB" in line
    assert bench.memory_table([row])[1] == [["G1", "cupy_gqa[auto]", "4.0", "1.0e-03", "—"]]


def test_train_check_smoke_run_on_the_cpu(tmp_path):
    """benchmarks/train_check.py with the tiny config on the CPU (float32, the NumPy backend):
    both runs start from the same weights and data, so their first losses agree."""
    pytest.importorskip("torch")
    script = BENCH_PATH.parent / "train_check.py"
    subprocess.run(
        [sys.executable, str(script), "--config", "tiny", "--device", "cpu", "--steps", "4", "--out", str(tmp_path)],
        check=True, capture_output=True, text=True, timeout=600,
    )
    doc = json.loads((tmp_path / "cpu_train.json").read_text())
    sdpa, ours = doc["results"]["sdpa"], doc["results"]["cupy_gqa"]
    assert len(sdpa["losses"]) == len(ours["losses"]) == 4
    assert all(math.isfinite(x) for x in sdpa["losses"] + ours["losses"])
    assert abs(sdpa["losses"][0] - ours["losses"][0]) < 1e-5  # same forward
    assert abs(sdpa["losses"][-1] - ours["losses"][-1]) < 1e-3  # and the same gradients, step after step
    assert doc["precision"] == "float32" and "| cupy_gqa |" in (tmp_path / "cpu_train.md").read_text()


# ---------------------------------------------------------------------------
# Per-call cases (kind "call": L1-L3)
# ---------------------------------------------------------------------------
def test_call_cases_select_alone_and_list(capsys):
    assert [c.name for c in bench.parse_cases("L1,L2,L3")] == ["L1", "L2", "L3"]
    assert {c.kind for c in bench.parse_cases("l1,l2,l3")} == {"call"}
    args = bench.build_parser().parse_args(["--cases", "L1,L2,L3"])
    assert [c.name for c in args.cases] == ["L1", "L2", "L3"]
    assert {"L1", "L2", "L3"} <= {c.name for c in bench.build_parser().parse_args([]).cases}  # in the default run
    assert bench.main(["--list", "--cases", "L1,L2,L3"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert [line.split()[0] for line in lines] == ["L1", "L2", "L3"]
    assert lines[0].endswith("bf16 causal per-call (prefill)") and "B2 S80 Hq8 Hkv2 D32" in lines[0]
    assert "B1 Sq1 Sk4096 Hq32 Hkv8 D128" in lines[1] and lines[1].endswith("per-call (decode)")
    assert "B8 Sq1 Sk1024 Hq32 Hkv8 D128" in lines[2]


def test_call_cases_in_the_full_list_and_help():
    out = subprocess.run([sys.executable, str(BENCH_PATH), "--list"], capture_output=True, text=True, check=True).stdout
    names = [line.split()[0] for line in out.splitlines()]
    assert names[-9:] == ["L1", "L2", "L3", "P1", "P2", "P3", "P4", "P5", "V1"]
    proc = _run_script("--help", env_extra={"CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 0 and "L3   B8 Sq1 Sk1024" in proc.stdout


class _FakeClock:
    """A clock that advances by `step` seconds at each call of fn, and not otherwise."""

    def __init__(self, step):
        self.t, self.step, self.calls = 0.0, step, 0

    def __call__(self):
        return self.t

    def fn(self):
        self.calls += 1
        self.t += self.step


def test_per_call_ms_times_the_loop_after_warmup():
    clock, syncs = _FakeClock(0.5e-3), []
    ms = bench.per_call_ms(clock.fn, lambda: syncs.append(clock.calls), 40, warmup=7, clock=clock)
    assert ms == pytest.approx(0.5)  # warm-up calls fall outside the timed loop
    assert clock.calls == 47
    assert syncs == [7, 47]  # a synchronize after the warm-up, and one closing the loop


def test_host_time_us_is_the_median_of_single_calls_each_after_a_sync():
    steps = iter([1e-6, 9e-6, 3e-6, 100e-6, 4e-6])
    t = [0.0]
    events = []

    def fn():
        events.append("call")
        t[0] += next(steps)

    us = bench.host_time_us(fn, lambda: events.append("sync"), 5, clock=lambda: t[0])
    assert us == pytest.approx(4.0)  # median of 1, 9, 3, 100, 4
    assert events == ["sync", "call"] * 5 + ["sync"]  # the GPU idle before every call


def test_measure_call_fills_a_row_on_the_cpu():
    """measure_call end to end with CPU tensors and a stand-in for torch.cuda: rel_err,
    calls, ms per call, host_us, compile_s, rates."""
    torch = pytest.importorskip("torch")
    from types import SimpleNamespace

    case = bench.Case("T", 2, 5, 9, 6, 2, 8, "fp32", True, "call")
    gen = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(2, 5, 6, 8, generator=gen), torch.randn(2, 9, 2, 8, generator=gen), torch.randn(2, 9, 2, 8, generator=gen)
    ref = bench.reference(torch, case, q, k, v, (slice(None),))
    calls = []

    def fn():
        calls.append(1)
        return bench.naive_loop(torch, q, k, v, causal=True)

    fake = SimpleNamespace(cuda=SimpleNamespace(synchronize=lambda: None))
    timer = SimpleNamespace(calls=30, host_calls=11)
    row = bench.measure_call(fake, timer, case, "cupy_gqa[auto]", fn, lambda o: o, ref, "full", (slice(None),))
    assert row.rel_err < 1e-5 and row.ref_scope == "full"
    assert row.reps == 30 and len(calls) == 1 + bench.CALL_WARMUP + 30 + 11
    assert row.ms > 0 and row.host_us > 0 and row.compile_s is not None
    assert row.tflops == pytest.approx(bench.attention_flops(case) / (row.ms * 1e-3) / 1e12)
    assert row.note == "per call, back to back"
    anchor = bench.measure_call(fake, timer, case, "torch_auto", fn, lambda o: o, ref, "full", (slice(None),))
    assert anchor.compile_s is None and anchor.host_us > 0


def _fake_call_rows():
    rows = [
        bench.Row("L2", "cupy_gqa[auto]", ms=0.020, reps=2000, rel_err=2e-3, ref_scope="full", compile_s=0.5, host_us=9.5,
                  note="per call, back to back; auto runs decode"),
        bench.Row("L2", "cupy_gqa[auto,cupy]", ms=0.016, reps=2000, rel_err=2e-3, ref_scope="full", compile_s=0.0, host_us=7.3),
        bench.Row("L2", "torch_auto", ms=0.025, reps=2000, rel_err=2e-3, ref_scope="full", host_us=20.0),
        bench.Row("L1", "cupy_gqa[auto]", ms=0.012, reps=2000, rel_err=2e-3, ref_scope="full", host_us=8.0),
        bench.Row("L1", "torch_auto", ms=0.010, reps=2000, rel_err=2e-3, ref_scope="full", host_us=15.0),
    ]
    for r in rows:
        bench.finish_row(r, bench.CASE_BY_NAME[r.case.lower()])
    return rows


def test_call_rows_ratios_to_torch_auto():
    rows = _fake_rows() + _fake_call_rows()
    bench.add_ratios(rows)
    by = {(r.case, r.impl): r for r in rows}
    assert by[("L2", "cupy_gqa[auto]")].vs == {"torch_auto": pytest.approx(0.8)}
    assert by[("L2", "cupy_gqa[auto,cupy]")].vs == {"torch_auto": pytest.approx(0.64)}
    assert by[("L1", "cupy_gqa[auto]")].vs == {"torch_auto": pytest.approx(1.2)}
    assert by[("L2", "torch_auto")].vs == {}
    assert by[("H1", "cupy_gqa[auto]")].vs == {"torch_flash": 2.0, "torch_cudnn": 0.5}  # other cases' ratios unchanged
    d = by[("L2", "cupy_gqa[auto,cupy]")].to_json()
    assert d["host_us"] == 7.3 and d["vs_torch_auto"] == pytest.approx(0.64) and d["reps"] == 2000


def test_call_table_and_main_table_split():
    rows = _fake_rows() + _fake_call_rows()
    bench.add_ratios(rows)
    headers, cells = bench.table(rows)
    assert [c[0] for c in cells] == ["H1", "H1", "H1", "D1", "D1"]  # no per-call row in the main table
    assert "vs_torch_auto" not in headers
    headers, cells = bench.call_table(rows)
    assert headers[:5] == ["case", "impl", "ms_per_call", "calls", "host_us"] and "vs_torch_auto" in headers
    assert [(c[0], c[1]) for c in cells] == [("L2", "cupy_gqa[auto]"), ("L2", "cupy_gqa[auto,cupy]"), ("L2", "torch_auto"),
                                             ("L1", "cupy_gqa[auto]"), ("L1", "torch_auto")]
    col = headers.index
    assert cells[1][col("ms_per_call")] == "0.0160" and cells[1][col("calls")] == "2000"
    assert cells[1][col("host_us")] == "7.3"
    assert cells[0][col("vs_torch_auto")] == "0.80" and cells[2][col("vs_torch_auto")] == ""
    assert cells[3][col("vs_torch_auto")] == "1.20"
    assert bench.call_table(_fake_rows()) == (headers, [])
    assert len(bench.format_text(headers, cells).splitlines()) == 6


def test_call_rows_in_results_json_and_markdown(tmp_path):
    rows = _fake_rows() + _fake_call_rows()
    bench.add_ratios(rows)
    bench.write_results(tmp_path, "h200", ENV, rows, [], [], plot=False)
    doc = json.loads((tmp_path / "h200.json").read_text())
    by = {(r["case"], r["impl"]): r for r in doc["rows"]}
    assert by[("L2", "cupy_gqa[auto]")]["host_us"] == 9.5 and by[("L2", "cupy_gqa[auto]")]["vs_torch_auto"] == pytest.approx(0.8)
    assert by[("L2", "torch_auto")]["host_us"] == 20.0
    assert by[("H1", "torch_flash")]["host_us"] is None
    md = (tmp_path / "h200.md").read_text()
    assert "## Per call (L1-L3)" in md
    assert "| L2 | cupy_gqa[auto] | 0.0200 | 2000 | 9.5 | 2.0e-03 | 0.50 | — | 0.80 | per call, back to back; auto runs decode |" in md
    assert "| L2 | torch_auto | 0.0250 | 2000 | 20.0 | 2.0e-03 | — | — |  |  |" in md
    assert "| H1 | cupy_gqa[auto] | 2.0000 | 20 |" in md  # the main table as before
    assert md.index("## Time") < md.index("## Per call")
    assert "## Per call" not in bench.render_markdown(ENV, _fake_rows(), [], [], None)


def test_readme_table_leaves_out_the_call_rows():
    spec = importlib.util.spec_from_file_location("readme_table", BENCH_PATH.parent / "readme_table.py")
    readme_table = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(readme_table)
    rows = _fake_rows() + _fake_call_rows()
    bench.add_ratios(rows)
    doc = {**ENV, "git_commit": "0123456789", "torch": "2", "cupy": "14", "driver": "580", "rows": [r.to_json() for r in rows]}
    text = readme_table.table(doc)
    assert "| H1 |" in text and "| L1 |" not in text and "| L2 |" not in text


def test_readme_table_puts_paged_cases_against_their_contiguous_call():
    """P cases (an auto row and a contiguous row each) leave the main table for one line of
    ratios; a run of a changed tree names its changed files beside the commit."""
    spec = importlib.util.spec_from_file_location("readme_table", BENCH_PATH.parent / "readme_table.py")
    readme_table = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(readme_table)
    rows = _fake_rows()
    bench.add_ratios(rows)
    paged = [
        {"case": "P4", "impl": "cupy_gqa[auto]", "ms": 1.5, "tflops": 500.0, "rel_err": 0.0, "note": ""},
        {"case": "P4", "impl": "cupy_gqa[contiguous]", "ms": 1.2, "tflops": 600.0, "rel_err": 0.0, "note": ""},
    ]
    doc = {**ENV, "git_commit": "0123456789abcdef (and 2 tracked files changed since)", "torch": "2", "cupy": "14",
           "driver": "580", "rows": [r.to_json() for r in rows] + paged}
    text = readme_table.table(doc)
    assert "| P4 |" not in text and "| H1 |" in text
    assert "on contiguous keys in the same run: P4 1.250." in text
    assert "commit 0123456 with 2 tracked files changed," in text


def test_method_text_states_the_call_constants():
    method = bench.METHOD
    assert f"CALLS = {bench.CALLS} calls back to back (--quick: {bench.QUICK_CALLS})" in method
    assert f"CALL_WARMUP = {bench.CALL_WARMUP}" in method
    assert f"HOST_CALLS = {bench.HOST_CALLS} calls" in method and f"(--quick: {bench.QUICK_HOST_CALLS})" in method
    assert "cupy_gqa[auto,cupy]" in method and "torch_auto" in method


def test_seq_cases_list_and_lengths(capsys):
    """P1-P3 (paged decode, pages of 16 / 64 / 256), P4, P5 (paged chunked prefill,
    pages of 16 / 256) and V1 (varlen prefill) are listed; V1's lengths are fixed
    by the seed and within [128, 4096]."""
    assert bench.main(["--cases", "P1,P2,P3,P4,P5,V1", "--list"]) == 0
    out = capsys.readouterr().out
    for name, kind, page in (("P1", "decode", 16), ("P2", "decode", 64), ("P3", "decode", 256), ("P4", "prefill", 16),
                             ("P5", "prefill", 256)):  # fmt: skip
        line = next(line for line in out.splitlines() if line.startswith(name))
        assert f"paged {kind}, pages of {page} shuffled" in line
    assert "varlen 16 sequences of 128 to 4096 tokens" in out
    lengths = bench.varlen_lengths(bench.CASE_BY_NAME["v1"])
    assert lengths == bench.varlen_lengths(bench.CASE_BY_NAME["v1"]) and len(lengths) == 16
    assert all(128 <= n <= 4096 for n in lengths) and len(set(lengths)) > 1


# ---------------------------------------------------------------------------
# timing in rounds
# ---------------------------------------------------------------------------
class _FakeCuda:
    """torch.cuda as the Timer uses it, on a clock that only the timed calls move:
    each call of an implementation takes its fixed time plus the GPU's "heat",
    which every call raises, so an implementation timed late in a sequential
    order would read slower."""

    def __init__(self):
        self.now, self.heat = 0.0, 0.0

    def Event(self, enable_timing=True):  # noqa: N802 (torch's name)
        cuda = self

        class _Event:
            def record(self):
                self.t = cuda.now

            def elapsed_time(self, end):
                return end.t - self.t

        return _Event()

    def synchronize(self):
        pass

    def empty_cache(self):
        pass


class _FakeTorch:
    int32 = "int32"

    def __init__(self):
        self.cuda = _FakeCuda()

    def empty(self, n, dtype=None, device=None):
        return type("Buf", (), {"zero_": lambda self: None})()


def test_timer_many_times_implementations_in_turn():
    """Timer.many: every implementation warmed up, reps rounded up to whole
    rounds, the order reversed every other round; two implementations of equal
    cost read equal although the GPU heats up as the calls go on (timed one
    after the other, the second would read slower)."""
    torch = _FakeTorch()
    calls = []

    def impl(name, ms):
        def fn():
            calls.append(name)
            torch.cuda.now += ms + torch.cuda.heat
            torch.cuda.heat += 0.001

        return fn

    timer = bench.Timer(torch, fast_reps=20, slow_reps=3)
    fns = {"a": impl("a", 1.0), "b": impl("b", 1.0), "slow": impl("slow", 60.0)}
    sequential = {name: timer(fn).ms for name, fn in fns.items()}
    assert sequential["b"] > sequential["a"]  # the heat the test models
    calls.clear()
    timings = timer.many(fns)
    assert {n: t.reps for n, t in timings.items()} == {"a": 20, "b": 20, "slow": 4}
    timed = calls[2 * 3 + 1:]  # after the warm-up calls (a: 3, b: 3, slow: 1)
    per_round = 5 + 5 + 1
    rounds = [timed[i : i + per_round] for i in range(0, len(timed), per_round)]
    assert len(rounds) == bench.TIMING_ROUNDS
    assert rounds[0] == ["a"] * 5 + ["b"] * 5 + ["slow"] and rounds[1] == ["slow"] + ["b"] * 5 + ["a"] * 5
    assert abs(timings["a"].ms - timings["b"].ms) < abs(sequential["a"] - sequential["b"])


def test_measure_all_leaves_out_what_fails():
    """measure_all: an implementation whose first call raises is reported to
    on_error and has no row; the others are timed together and keep their order."""
    torch = _FakeTorch()
    torch.cuda.max_memory_allocated = lambda: 0
    case = bench.CASES[0]
    out = type("Out", (), {})()

    def ok(ms):
        def fn():
            torch.cuda.now += ms
            return out
        return fn

    def broken():
        raise RuntimeError("no kernel for this call")

    errors = []
    orig_rel_err, orig_first = bench.rel_err, bench._first_call
    bench.rel_err = lambda o, ref, index: 0.0
    bench._first_call = lambda torch_, fn: (fn(), 0.5)
    try:
        rows = bench.measure_all(torch, bench.Timer(torch, fast_reps=4, slow_reps=1), case,
                                 [("cupy_gqa[auto]", ok(2.0)), ("broken", broken), ("torch_cudnn", ok(3.0))],
                                 None, "full", (), lambda name, e: errors.append((name, str(e))))  # fmt: skip
    finally:
        bench.rel_err, bench._first_call = orig_rel_err, orig_first
    assert errors == [("broken", "no kernel for this call")]
    assert [r.impl for r in rows] == ["cupy_gqa[auto]", "torch_cudnn"]
    assert [r.ms for r in rows] == [2.0, 3.0] and all(r.reps == 4 for r in rows)
    assert rows[0].compile_s == pytest.approx(0.5 - 2.0e-3)


def test_seed_kernel_clears_only_a_stale_build_lock(tmp_path, monkeypatch):
    """The seed's extension is built in a folder of its own; a lock that a killed build left
    there (older than SEED_LOCK_STALE_S) is removed before the build, a fresh one (a build
    running beside this one) is left for torch to wait on."""
    cpp_extension = pytest.importorskip("torch.utils.cpp_extension")
    built = []

    class Module:
        def seed_design(self, *arrays):
            return arrays

    monkeypatch.setattr(cpp_extension, "load_inline", lambda **kw: built.append(kw) or Module())
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    lock = tmp_path / "cupy_gqa_bench" / "seed_design" / "lock"
    lock.parent.mkdir(parents=True)
    lock.write_text("")
    old = os.stat(lock).st_mtime - bench.SEED_LOCK_STALE_S - 1
    os.utime(lock, (old, old))
    bench.seed_kernel(None, None, None, None)
    assert not lock.exists()
    assert built[-1]["build_directory"] == str(lock.parent)
    lock.write_text("")
    bench.seed_kernel(None, None, None, None)
    assert lock.exists()
