"""The decode cost model (_plan.decode_dispatch) and the decode kernel table, on the CPU.

decode_dispatch is the one place that picks decode or the prefill kernel, the
rows per CTA and the number of key ranges for a decode-shaped call; these are
its decisions on the shape sweep's classes (benchmarks/bench_attention.py:
SHAPE_SWEEP) on an H200's 132 SMs.
"""
import math

import pytest

from cupy_gqa import _plan, _specs
from conftest import dev_tool

H200 = (132, _specs.ARCHS["sm_90"])


def problem(batch, seqlen_q, seqlen_k, num_q_heads, num_kv_heads, head_dim=128, dtype="bfloat16", causal=True):
    return _plan.Problem(batch, seqlen_q, seqlen_k, num_q_heads, num_kv_heads, head_dim, dtype, causal, head_dim**-0.5)


def choose(p, sms=H200[0], arch=H200[1]):
    return _plan.decode_dispatch(p, sms, arch)


def ctas(p, choice):
    return p.batch * p.num_kv_heads * math.ceil(p.seqlen_q * p.group_size / choice.block_m) * choice.num_splits


def test_table_shapes_keep_one_key_range():
    """D1 and D2 (the benchmark table's decode rows): one CTA per (batch, KV head)
    already fills the GPU, a split would only add the combine."""
    for p in (problem(16, 1, 8192, 32, 8), problem(64, 1, 2048, 32, 8)):
        c = choose(p)
        assert (c.kernel, c.block_m, c.num_splits) == ("decode", 16, 1)


@pytest.mark.parametrize("num_q_heads,head_dim", [(64, 128), (48, 128), (71, 64)])
def test_multi_query_with_many_heads_goes_to_decode_in_small_blocks(num_q_heads, head_dim):
    """MQA (one KV head) with many query heads at seqlen_q 1: decode, not the
    prefill kernel (whose few CTAs leave the GPU idle), in row blocks of
    several key streams (measured at 48 and 71 heads: 16-row blocks 1.6 to
    1.9 times faster than one 64-row block per key range, whose single stream
    takes its tiles one after another; benchmarks/NOTES_decode.md), split to
    fill the SMs."""
    p = problem(8, 1, 8192, num_q_heads, 1, head_dim)
    c = choose(p)
    assert c.kernel == "decode" and c.block_m < 64
    assert ctas(p, c) >= 132 * 0.75
    assert c.decode_s < c.prefill_s / 3


def test_one_long_sequence_fills_the_gpu():
    """B1, 128k keys, 4 KV heads: split into enough key ranges that the CTAs
    cover most of the 132 SMs, within the split cap."""
    p = problem(1, 1, 131072, 28, 4)
    c = choose(p)
    assert c.kernel == "decode" and c.block_m == 16
    assert 0.75 * 132 <= ctas(p, c) <= 2 * 132
    assert c.num_splits <= _plan.DECODE_MAX_SPLITS


def test_one_kv_head_splits_no_shorter_than_a_pass_needs():
    """D06's shape (B1, 32768 keys, 8 query heads on one KV head), timed out of
    L2 on the H200: 64 key ranges 16.8 us, 96 17.0, 121 18.3 (past about 512
    keys a range more CTAs don't shorten the pass; benchmarks/NOTES_decode.md).
    The model's cost per split keeps the pick near 64."""
    c = choose(problem(1, 1, 32768, 8, 1))
    assert (c.kernel, c.block_m) == ("decode", 16) and 48 <= c.num_splits <= 96


def test_picks_against_the_measured_layouts():
    """The model's pick among the layouts measured out of L2 on the H200 (28
    shapes, every block_m at 20 split counts: benchmarks/dev/results/
    h200_decode_layouts_cold_f1ba464.txt) against the fastest of them: at most
    6 % slower at any shape, 1 % in geometric mean (decode_model_fit.py reads
    the file and applies decode_dispatch's tie rule)."""
    from pathlib import Path

    fit = dev_tool("decode_model_fit")
    cases = fit.read(Path(fit.__file__).parent / "results" / "h200_decode_layouts_cold_f1ba464.txt")
    assert len(cases) == 28
    regrets, _ = fit.regrets(cases, H200[1], H200[0])
    worst = max(regrets, key=lambda r: r[1])
    assert worst[1] <= 1.06, worst
    assert math.exp(sum(math.log(r[1]) for r in regrets) / len(regrets)) <= 1.01


def test_batch_32_with_4000_keys():
    """256 (batch, KV head) pairs fill 132 SMs at 2 CTAs each: no split; the keys
    (not a multiple of 64) end in a masked tile, which the model doesn't charge."""
    p = problem(32, 1, 4000, 32, 8)
    c = choose(p)
    assert (c.kernel, c.block_m, c.num_splits) == ("decode", 16, 1)
    assert c.decode_s == pytest.approx(2 * 32 * 4000 * 8 * 128 * 2 / _plan.DECODE_HBM_BYTES_PER_S, rel=0.05)


@pytest.mark.parametrize("batch,num_q_heads,num_kv_heads", [(16, 8, 1), (8, 28, 4), (16, 12, 2)])
def test_few_kv_heads_split_to_fill_the_gpu(batch, num_q_heads, num_kv_heads):
    """One TP rank (8 query heads, 1 KV head) and odd groups (7, 6): too few
    (batch, KV head) pairs for 132 SMs, so the keys are split, one 16-row block
    for the group's rows."""
    p = problem(batch, 1, 8192, num_q_heads, num_kv_heads)
    c = choose(p)
    assert c.kernel == "decode" and c.block_m == 16 and c.num_splits > 1
    assert ctas(p, c) >= 0.75 * 132


@pytest.mark.parametrize("seqlen_q", range(1, 9))
def test_speculative_decoding_stays_in_decode(seqlen_q):
    """seqlen_q 2 .. 8 (speculative decoding) with group 8: 8 to 64 rows, decode
    (the model's row blocks: one stream per 64-row CTA is never its choice)."""
    p = problem(8, seqlen_q, 4096, 32, 4)
    c = choose(p)
    assert c.kernel == "decode" and c.decode_s < c.prefill_s
    assert c.block_m < 64


def test_many_rows_against_few_keys_go_to_prefill():
    """Rows enough to make the tensor cores the limit and a short cache: the
    prefill kernel (block_m 128, its own pipelines) wins."""
    p = problem(64, 16, 512, 64, 8)
    c = choose(p)
    assert c.kernel == "prefill" and c.prefill_s < c.decode_s


def test_float32_takes_the_cuda_core_kernel_and_its_blocks():
    p = problem(4, 1, 4096, 32, 8, 64, "float32")
    c = choose(p)
    assert c.kernel == "decode" and c.block_m == 4
    c = choose(problem(1, 1, 16384, 28, 4, 128, "float32"))
    assert c.kernel == "decode" and c.block_m in _specs.DECODE_ROWS and c.num_splits > 1


def test_the_choice_depends_on_the_shape_alone():
    """Same shape, same plan (cached); fewer SMs, more time (the per-SM streaming limit)."""
    p = problem(1, 1, 65536, 32, 8)
    assert choose(p) is choose(p)
    assert choose(p, sms=8).decode_s > 2 * choose(p).decode_s


def test_split_count_respects_the_bounds():
    for p in (problem(1, 1, 300, 8, 1), problem(1, 1, 1, 8, 1), problem(2, 3, 255, 8, 8)):
        c = choose(p)
        assert 1 <= c.num_splits <= max(1, p.seqlen_k // _plan.DECODE_MIN_SPLIT_KEYS)


def test_decode_seconds_counts_row_blocks_as_l2_passes():
    """Each row block past the first reads the key range again, from L2: with
    enough splits that no key stream's tiles set the time (16), 16-row blocks
    for 64 rows cost more than one 64-row block; with few (2), the 64-row
    block's one stream of tiles costs more."""
    arch = H200[1]
    p = problem(64, 1, 8192, 64, 1)
    t = {(bm, ns): _plan.decode_seconds(p, _specs.decode_spec("bfloat16", 128, bm, arch), ns, 132, arch)
         for bm in (16, 64) for ns in (2, 16)}
    assert t[64, 16] < t[16, 16]
    assert t[16, 2] < t[64, 2]


# --- the kernel table ---------------------------------------------------------


@pytest.mark.parametrize("arch", ["sm_80", "sm_86", "sm_90"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_tensor_core_layouts_fit_and_keep_their_tiles_in_flight(arch, dtype):
    a = _specs.ARCHS[arch]
    for head_dim in _specs.DECODE_HEAD_DIMS:
        specs = _specs.decode_specs(dtype, head_dim, a)
        assert all(s.smem <= a.smem for s in specs)
        for s in specs:
            assert s.name.startswith(f"decode_mma_attention<{_specs.CTYPES[dtype]}, {head_dim}, {s.block_m // 16}, ")
            assert _specs.decode_ctas_per_sm(s, a) >= 1
        if arch == "sm_90":  # the table's stages: as many tiles in flight per CTA in every layout
            assert [s.block_m for s in specs] == [16, 32, 64]
            inflight = {_plan.decode_bytes_in_flight(s) for s in specs}
            assert len(inflight) == 1


def test_occupancy_estimates():
    a = _specs.ARCHS["sm_90"]
    assert _specs.decode_ctas_per_sm(_specs.decode_spec("bfloat16", 128, 16, a), a) == 2
    assert _specs.decode_ctas_per_sm(_specs.decode_spec("bfloat16", 256, 16, a), a) == 1
    assert _specs.decode_ctas_per_sm(_specs.decode_spec("float32", 128, 4, a), a) == 3
    assert _specs.decode_ctas_per_sm(_specs.decode_spec("float32", 128, 8, a), a) == 2


def test_decode_spec_rejects_other_block_sizes():
    a = _specs.ARCHS["sm_90"]
    assert _specs.decode_spec("bfloat16", 128, 8, a) is None
    assert _specs.decode_spec("float32", 128, 16, a) is None
    assert _specs.decode_specs("float64", 128, a) == ()
    assert _specs.decode_specs("bfloat16", 128, _specs.ARCHS["sm_75"]) == ()


def test_cluster_kernels_in_the_tables_with_clusters():
    """Every tensor-core decode layout has its cluster kernels (2, 4, 8 splits)
    on the architectures with clusters, and none elsewhere."""
    for arch in _specs.ARCHS.values():
        names = {s.name for s in _specs.specs_for(arch)}
        for dtype in _specs.DECODE_MMA_DTYPES:
            for head_dim in _specs.DECODE_HEAD_DIMS:
                for spec in _specs.decode_specs(dtype, head_dim, arch):
                    for n in _specs.DECODE_CLUSTERS:
                        c = _specs.decode_cluster_spec(spec, n)
                        assert (c.name in names) == arch.clusters, (arch.name, c.name)
                        assert c.smem == spec.smem and c.block_m == spec.block_m and c.name.endswith(f", {n}, {spec.smem}>")


def test_cluster_rule():
    """decode_cluster: fp16 / bf16 split into 2, 4 or 8 ranges, no modifiers,
    contiguous K/V, on sm_90; else the workspace and the combine."""
    p = problem(1, 1, 4096, 32, 8)
    spec = _specs.decode_spec("bfloat16", 128, 16, H200[1])
    for n in (2, 4, 8):
        assert _plan.decode_cluster(p, spec, n, H200[1])
    for n in (1, 3, 16):
        assert not _plan.decode_cluster(p, spec, n, H200[1])
    a100 = _specs.ARCHS["sm_80"]
    assert not _plan.decode_cluster(p, _specs.decode_spec("bfloat16", 128, 16, a100), 4, a100)
    p32 = problem(1, 1, 4096, 32, 8, dtype="float32")
    assert not _plan.decode_cluster(p32, _specs.decode_spec("float32", 128, 4, H200[1]), 4, H200[1])
    from dataclasses import replace
    assert not _plan.decode_cluster(replace(p, mods=object()), spec, 4, H200[1])
    assert not _plan.decode_cluster(replace(p, seq=object()), spec, 4, H200[1])


def test_cluster_split_costs_no_combine():
    """The model times a cluster split without the combine's launch and partials."""
    p = problem(1, 1, 4096, 32, 8)
    spec = _specs.decode_spec("bfloat16", 128, 16, H200[1])
    a100 = _specs.ARCHS["sm_80"]
    t_cluster = _plan.decode_seconds(p, spec, 8, 132, H200[1])
    t_combine = _plan.decode_seconds(p, spec, 8, 132, a100)  # the same kernel on an architecture without clusters
    assert t_cluster < t_combine - _plan.DECODE_COMBINE_FIXED_S + 2 * _plan.DECODE_CLUSTER_MERGE_S



def test_padded_head_dims_run_the_next_kernel():
    """float16 / bfloat16 take every multiple of 8 up to 256 on the kernel of the
    next table head dim (columns past head_dim padded inside it); float32 only the
    table's; the workspace's rows are the call's head_dim long."""
    arch = H200[1]
    for head_dim, padded in ((8, 64), (40, 64), (72, 128), (96, 128), (136, 256), (248, 256), (256, 256)):
        assert _specs.decode_head_dim("bfloat16", head_dim) == padded
        assert [s.head_dim for s in _specs.decode_specs("float16", head_dim, arch)] == [padded] * 3
        assert _specs.decode_head_dim("float32", head_dim) == (head_dim if head_dim in _specs.DECODE_HEAD_DIMS else None)
    for head_dim in (0, 4, 100, 264):
        assert _specs.decode_head_dim("bfloat16", head_dim) is None
        assert _specs.decode_specs("bfloat16", head_dim, arch) == ()
    p = problem(1, 1, 32768, 32, 32, head_dim=96)
    shape = (1, 1, 32, 96)
    layout = tuple((shape, (6144, 6144, 192, 2), 2) for _ in range(4))  # contiguous q, k, v, out (k, v: as q's rows)
    spec = _specs.decode_spec("bfloat16", 96, 16, arch)
    plan = _plan._decode_plan(p, layout, spec, 3)
    assert plan.workspace_bytes == 4 * 32 * 3 * (96 + 1) and plan.part_lse_offset == 4 * 32 * 3 * 96


def test_padded_head_dim_is_modelled_as_its_kernel():
    """A padded call streams as many keys at a time as its kernel (its bytes are
    fewer): the model times it no faster than the kernel's own head dim."""
    arch = H200[1]
    for hd, padded in ((96, 128), (192, 256)):
        a, b = problem(8, 1, 4096, 32, 32, head_dim=hd), problem(8, 1, 4096, 32, 32, head_dim=padded)
        for ns in (1, 4):
            sa = _specs.decode_spec("bfloat16", hd, 16, arch)
            assert _plan.decode_seconds(a, sa, ns, *H200) >= 0.99 * _plan.decode_seconds(b, sa, ns, *H200) * hd / padded
    assert choose(problem(8, 1, 4096, 32, 32, head_dim=96)).kernel == "decode"  # Phi-3-mini's decode step


def _choice_one_at_a_time(p, sms, arch):
    """decode_dispatch's rule, literally: every kernel at every split count timed alone
    (decode_seconds), the ties' fewest CTAs (then the smaller block, fewer splits), and
    a split in clusters near the best in place of one through the combine."""
    specs = _specs.decode_specs(p.dtype, p.head_dim, arch)
    most = max(1, min(_plan.DECODE_MAX_SPLITS, p.seqlen_k // _plan.DECODE_MIN_SPLIT_KEYS))
    timed = []
    for spec in specs:
        base = p.batch * p.num_kv_heads * math.ceil(p.seqlen_q * p.group_size / spec.block_m)
        for splits in range(1, most + 1):
            if base * splits <= _plan.MAX_GRID_X:
                t = _plan.decode_seconds(p, spec, splits, sms, arch)
                timed.append((base * splits, spec.block_m, splits, t, _plan.decode_cluster(p, spec, splits, arch)))
    best = min(x[3] for x in timed)
    _, block_m, splits, t, clustered = min(x for x in timed if x[3] <= best * (1 + _plan.DECODE_TIE))
    near = [x for x in timed if x[4] and x[3] <= best + _plan.DECODE_CLUSTER_MARGIN_S]
    if splits > 1 and not clustered and near:
        _, block_m, splits, t, _ = min(near, key=lambda x: (x[3], x[0], x[1]))
    return block_m, splits, t


@pytest.mark.parametrize("seed", range(4))
def test_dispatch_times_every_split_at_once_as_one_at_a_time(seed):
    """decode_dispatch times the whole table at once (decode_times) and picks from it as the
    rule says, one choice at a time (the same floats: same operations, same order), on random
    shapes, architectures and SM counts."""
    import random

    rng = random.Random(seed)
    for _ in range(60):
        hkv, g = rng.choice([1, 2, 8]), rng.choice([1, 3, 4, 8, 32])
        dtype = rng.choice(["bfloat16", "float16", "float32"])
        p = problem(rng.choice([1, 2, 16, 64]), rng.choice([1, 2, 5, 16]), rng.choice([1, 300, 2048, 5000, 40000, 131072]),
                    hkv * g, hkv, rng.choice([64, 80, 128, 256]), dtype)
        sms, arch = rng.choice([H200, (108, _specs.ARCHS["sm_80"])])
        c = choose(p, sms, arch)
        if c.decode_s == float("inf"):
            continue
        assert (c.block_m, c.num_splits, c.decode_s) == _choice_one_at_a_time(p, sms, arch), p
