"""Launch plans (cupy_gqa/_plan.py) and the specialization table, as pure functions."""
import itertools
import math
import re

import numpy as np
import pytest

from cupy_gqa import _compile, _launch, _plan, _specs, _tma
from conftest import dev_tool


@pytest.mark.parametrize("total", [1, 127, 128, 129, 10**6, 2**31 * 128, 10**13])
def test_grid_stride_blocks(total):
    blocks = _plan.grid_stride_blocks(total, 128)
    assert 1 <= blocks <= 2**31 - 1  # gridDim.x limit; no 65535-style cap
    if total <= (2**31 - 1) * 128:
        assert blocks * 128 >= total and (blocks - 1) * 128 < total  # one thread per item
    else:
        assert blocks == 2**31 - 1  # the kernel's grid-stride loop covers the rest


def test_element_strides_are_int64_beyond_2_31():
    # a (2, 2**20 + 1, 8, 128) fp16 tensor has 2**31 + 2048 elements: the batch
    # stride alone is over 2**30 elements and its last element sits beyond 2**31
    shape = (2, 2**20 + 1, 8, 128)
    contiguous = tuple(int(np.prod(shape[i + 1 :])) * 2 for i in range(4))
    strides = _plan.element_strides(contiguous, 2)
    assert all(isinstance(s, np.int64) for s in strides)
    last = sum((n - 1) * s for n, s in zip(shape, strides))
    assert last == 2 * (2**20 + 1) * 8 * 128 - 1 > 2**31
    assert last.dtype == np.int64  # no wrap-around on the way


def test_params_struct_matches_the_kernels():
    # kernels/common.cuh: struct AttnParams, static_assert(sizeof == 176)
    assert _plan.PARAMS_DTYPE.itemsize == 176
    offsets = {name: _plan.PARAMS_DTYPE.fields[name][1] for name in _plan.PARAMS_DTYPE.names}
    assert offsets["q_stride"] == 0 and offsets["o_stride"] == 96 and offsets["total_threads"] == 128
    assert offsets["scale_log2"] == 136 and offsets["batch"] == 144 and offsets["causal"] == 172
    source = (_compile.KERNEL_DIR / "common.cuh").read_text()
    body = source[source.index("struct AttnParams {") : source.index("};", source.index("struct AttnParams {"))]
    body = re.sub(r"//[^\n]*", "", body)  # declarations only
    positions = [re.search(rf"\b{name}\b", body).start() for name in _plan.PARAMS_DTYPE.names]
    assert positions == sorted(positions), "fields must be declared in the same order"


def test_params_values():
    problem = _plan.Problem(3, 5, 7, 8, 2, 64, "float32", True, 0.5)
    layout = tuple(((3, 5, 8, 64), (5 * 8 * 64 * 4, 8 * 64 * 4, 64 * 4, 4), 4) for _ in range(4))
    p = _plan.make_params(problem, layout, 99)[0]
    assert list(p["q_stride"]) == [5 * 8 * 64, 8 * 64, 64, 1]
    assert p["scale_log2"] == pytest.approx(0.5 / np.log(2), rel=1e-15)
    assert (p["batch"], p["seqlen_q"], p["seqlen_k"], p["num_q_heads"], p["num_kv_heads"]) == (3, 5, 7, 8, 2)
    assert (p["group_size"], p["head_dim"], p["causal"], p["total_threads"]) == (4, 64, 1, 99)


@pytest.mark.parametrize("head_dim", range(1, 257))
@pytest.mark.parametrize("vec", [True, False])
def test_every_head_dim_has_a_rowwise_specialization(head_dim, vec):
    for dtype in _specs.DTYPES:
        spec = _specs.rowwise_spec(dtype, head_dim, vec)
        assert spec.head_dim >= head_dim and spec.dtype == dtype and spec in _specs.SPECS
        assert spec.head_dim % spec.team == 0 and spec.team <= 32


def test_spec_names_are_unique():
    names = [s.name for s in _specs.SPECS]
    assert len(names) == len(set(names))


def test_rowwise_plan_passes_64_bit_strides_and_counts():
    problem = _plan.Problem(2, 2**20 + 1, 16, 8, 2, 128, "float16", False, 0.1)
    q_layout = ((2, 2**20 + 1, 8, 128), ((2**20 + 1) * 8 * 128 * 2, 8 * 128 * 2, 128 * 2, 2), 2)
    kv_layout = ((2, 16, 2, 128), (16 * 2 * 128 * 2, 2 * 128 * 2, 128 * 2, 2), 2)
    launch = _plan.plan_rowwise(problem, (q_layout, kv_layout, kv_layout, q_layout), True)
    assert launch.spec.name == "rowwise_attention<__half, 128, 4, true, 16, 16384>"  # 2 x 2 x 16 keys x 128 x 2 bytes
    p = launch.params[0]
    assert p["q_stride"].dtype == np.int64 and p["q_stride"][0] == (2**20 + 1) * 8 * 128
    # team 4 -> 32 rows per block = all 4 heads of a group at 8 positions:
    # ceil((2**20 + 1) / 8) position blocks x batch 2 x 2 KV heads
    blocks = (2**17 + 1) * 2 * 2
    assert _plan.rowwise_blocks(problem, 4) == blocks and p["total_threads"] == blocks * 128
    assert launch.grid == (blocks,)


@pytest.mark.parametrize(
    "group_size, team, blocks",  # batch 3, seqlen_q 8, 2 KV heads
    [
        (1, 1, 6),  # 128 rows per block: 1 head x 128 positions, so 1 block per (batch, kv_head)
        (4, 1, 6),  # 4 heads x 32 positions
        (7, 1, 6),  # 7 heads x 18 positions (2 of 128 threads idle)
        (32, 4, 48),  # 32 rows per block: 32 heads x 1 position, so 8 per (batch, kv_head)
        (48, 4, 96),  # 48 heads need two blocks of 32 heads at each position
        (7, 16, 48),  # 8 rows per block: 7 heads x 1 position
    ],
)
def test_rowwise_blocks_by_hand(group_size, team, blocks):
    problem = _plan.Problem(3, 8, 8, 2 * group_size, 2, 64, "float32", True, 0.1)
    assert _plan.rowwise_blocks(problem, team) == blocks


def test_layout_issues():
    good = ((2, 5, 8, 64), (5 * 8 * 64 * 2, 8 * 64 * 2, 64 * 2, 2), 2)
    assert _plan._layout_issue((good,) * 4) is None
    strided_d = ((2, 5, 8, 64), (5 * 8 * 128 * 2, 8 * 128 * 2, 128 * 2, 4), 2)
    assert "head_dim stride 2" in _plan._layout_issue((good, strided_d, good, good))
    odd_heads = ((2, 5, 8, 60), (5 * 8 * 60 * 2, 8 * 60 * 2, 60 * 2, 2), 2)  # rows of 120 bytes
    assert "multiples of 16 bytes" in _plan._layout_issue((odd_heads, good, good, good))
    one_row = ((1, 1, 1, 64), (6, 6, 6, 2), 2)  # strides of size-1 axes don't matter
    assert _plan._layout_issue((one_row, good, good, one_row)) is None


# D128: BLOCK_M 64, BLOCK_N 16, rows of 132 floats; Q, 2 K and 2 V tiles, + K and V small ones at PRESPLIT 1
@pytest.mark.parametrize("precision, split", [("highest", "true, 1, 84480"), ("tf32", "false, 0, 67584")])
def test_float32_tiled_plan_follows_precision(precision, split):
    """Split TF32 (the scheme of "highest" where fp16 pairs are not chosen) and plain TF32."""
    layout = ((2, 64, 8, 128), (64 * 8 * 128 * 4, 8 * 128 * 4, 128 * 4, 4), 4)
    problem = _plan.Problem(2, 64, 64, 8, 2, 128, "float32", True, 0.1, precision)
    old = _plan.set_f32_highest("tf32x3")
    try:
        launch = _plan.plan_tiled(problem, (layout,) * 4, _specs.ARCHS["sm_90"])
    finally:
        _plan.set_f32_highest(old)
    assert launch.spec.name == f"tiled_tf32_attention<128, 64, 16, 4, true, {split}>"
    assert launch.grid == (-(-64 * 4 // 64) * 2 * 2,)  # packed rows 64 x group 4, 64 per CTA; x batch x kv heads


@pytest.mark.parametrize("head_dim, arch, expected", [
    (128, "sm_90", "tiled_f16x2_attention<128, 128, 32, 8, true, 139280>"),  # pairs: 2 x 128 + 2 x 4 x 32 rows of 136 halves, 16
    (64, "sm_80", "tiled_f16x2_attention<64, 64, 16, 4, true, 36880>"),
    (256, "sm_90", "tiled_tf32_attention<256, 64, 16, 4, true, true, 1, 166400>"),  # not in the pairs' table
    (128, "sm_86", "tiled_tf32_attention<128, 64, 16, 4, true, true, 1, 84480>"),  # the pairs' tile is over 99 KB
])  # fmt: skip
def test_float32_highest_takes_the_chosen_products(head_dim, arch, expected):
    """A call big enough for fp16 pairs (the default from F32_PAIRS_MIN_FLOPS up)
    runs them where their table has the head dim and the tile fits; elsewhere
    split TF32. "tf32" never changes."""
    layout = ((2, 2048, 8, head_dim), (2048 * 8 * head_dim * 4, 8 * head_dim * 4, head_dim * 4, 4), 4)
    from cupy_gqa import _fast

    assert _specs.F32_HIGHEST is None
    problem = _plan.Problem(2, 2048, 2048, 8, 2, head_dim, "float32", True, 0.1, "highest")
    assert _plan.visible_flops(problem) >= _specs.F32_PAIRS_MIN_FLOPS
    plan = _plan.plan_tiled(problem, (layout,) * 4, _specs.ARCHS[arch])
    assert plan.spec.name == expected
    if "f16x2" in expected:  # its pairs of K and V: 2 x 2 (batch, KV head) x ceil(2048 / block_n) tiles
        block_n = plan.spec.block_n
        tiles = 2 * 2 * -(-2048 // block_n)
        assert [s.name for s in plan.prep] == [f"f16x2_v_exponents<{head_dim}, {block_n}>", f"f16x2_kv_pairs<{head_dim}, {block_n}>"]
        assert plan.workspace_bytes == tiles * (4 * block_n * head_dim * 2 + 12)
    else:
        assert plan.workspace_bytes == 0
    tf32 = _plan.Problem(2, 2048, 2048, 8, 2, head_dim, "float32", True, 0.1, "tf32")
    assert _plan.plan_tiled(tf32, (layout,) * 4, _specs.ARCHS[arch]).spec.source == "tiled_tf32.cu"
    # split TF32 chosen: the plans and repeat-call entries made before are forgotten
    _fast.remember(("a repeat call's signature",), object())
    old = _plan.set_f32_highest("tf32x3")
    assert _fast.lookup(("a repeat call's signature",)) is None, "a repeat call would launch the old scheme's plan"
    try:
        assert _plan.plan_tiled(problem, (layout,) * 4, _specs.ARCHS[arch]).spec.source == "tiled_tf32.cu"
    finally:
        assert _plan.set_f32_highest(old) == "tf32x3"
    assert _plan.plan_tiled(problem, (layout,) * 4, _specs.ARCHS[arch]).spec.name == expected
    with pytest.raises(ValueError, match="products: expected one of"):
        _plan.set_f32_highest("fp16")


@pytest.mark.parametrize("shape, causal, pairs", [
    ((2, 80, 80, 8, 2, 32), True, False),  # the demo's call: 6.6 MFLOP
    ((1, 1024, 1024, 8, 2, 64), True, False),  # 1.07 GFLOP
    ((1, 1024, 1024, 16, 2, 64), True, True),  # 2.15 GFLOP
    ((1, 1000, 1000, 8, 8, 128), False, True),  # 4.1 GFLOP, every pair
    ((4, 1024, 1024, 32, 8, 64), True, True),  # F2
    ((2, 4000, 90, 8, 2, 128), True, False),  # only the last 90 rows see keys (4095 pairs a head): 34 MFLOP
])  # fmt: skip
def test_float32_highest_takes_pairs_from_their_minimum_work(shape, causal, pairs):
    """By default "highest" takes fp16 pairs only on calls of F32_PAIRS_MIN_FLOPS
    of visible products or more (their two extra launches cost more than they
    save below); split TF32 takes the others, without a workspace. A scheme set
    by set_f32_highest holds at every size."""
    batch, sq, sk, hq, hkv, d = shape
    problem = _plan.Problem(batch, sq, sk, hq, hkv, d, "float32", causal, 0.1, "highest")
    layouts = tuple(((batch, n, h, d), (n * h * d * 4, h * d * 4, d * 4, 4), 4) for n, h in ((sq, hq), (sk, hkv), (sk, hkv), (sq, hq)))
    rows = np.arange(sq)[:, None]
    seen = np.ones((sq, sk), bool) if not causal else np.arange(sk)[None, :] <= rows + sk - sq
    assert _plan.visible_flops(problem) == 4 * d * int(seen.sum()) * batch * hq
    arch = _specs.ARCHS["sm_90"]
    plan = _plan.plan_tiled(problem, layouts, arch)
    assert (plan.spec.source == "tiled_f16x2.cu") == pairs and (plan.workspace_bytes > 0) == pairs
    old = _plan.set_f32_highest("tf32x3" if pairs else "f16x2")
    try:
        assert (_plan.plan_tiled(problem, layouts, arch).spec.source == "tiled_f16x2.cu") != pairs
    finally:
        _plan.set_f32_highest(old)
    assert _plan.plan_tiled(problem, layouts, arch).spec.name == plan.spec.name


@pytest.mark.parametrize("kind, dtype, head_dim, arch, dq_kernel, dkdv_kernel", [
    # with a producer: two consumer warpgroups of 64 rows or keys, two stages, two mbarriers (16 bytes) a stage
    ("ws", "bfloat16", 128, "sm_90", "bwd_dq_ws<__nv_bfloat16, 128, 64, 2, true, 132128>",
     "bwd_dkdv_ws<__nv_bfloat16, 128, 64, 2, true, 133152>"),
    ("ws", "float16", 64, "sm_90", "bwd_dq_ws<__half, 64, 64, 2, true, 66592>", "bwd_dkdv_ws<__half, 64, 64, 2, true, 67616>"),
    ("mma", "bfloat16", 128, "sm_90", "bwd_dq_mma<", "bwd_dkdv_mma<"),
    ("ws", "bfloat16", 128, "sm_80", "bwd_dq_mma<", "bwd_dkdv_mma<"),  # no wgmma
    ("ws", "bfloat16", 96, "sm_90", "bwd_dq_mma<", "bwd_dkdv_mma<"),  # not in their tables
    ("ws", "bfloat16", 256, "sm_90", "bwd_dq_mma<", "bwd_dkdv_mma<"),
    ("ws", "float32", 128, "sm_90", "bwd_dq_tf32<", "bwd_dkdv_tf32<"),
])  # fmt: skip
def test_backward_on_hopper_kernels_where_chosen(kind, dtype, head_dim, arch, dq_kernel, dkdv_kernel):
    """With "ws" (the calls' own) 16-bit calls on sm_90 at head dims 64 and 128
    take the kernels with a producer warpgroup for both passes (two consumer
    warpgroups: 128 rows or keys per CTA, 384 threads with the producer); every
    other call, and every call with "mma", takes the mma.sync kernels; the
    default comes back after."""
    default = _specs.bwd_mma_specs(dtype, head_dim, True, _specs.ARCHS[arch])
    assert _specs.BWD_SM90 == "ws"
    old = _plan.set_bwd_sm90(kind)
    try:
        dq, dkdv = _specs.bwd_mma_specs(dtype, head_dim, True, _specs.ARCHS[arch])
        assert dq.name.startswith(dq_kernel) and dkdv.name.startswith(dkdv_kernel)
        if "_ws<" in dq_kernel:
            assert dq.block_m == dkdv.block_m == 128 and dq.threads == dkdv.threads == 384
            assert dq.arch == dkdv.arch == "sm_90a" and _specs.is_bwd_ws(dq) and _specs.is_bwd_ws(dkdv)
    finally:
        assert _plan.set_bwd_sm90(old) == kind
    assert _specs.bwd_mma_specs(dtype, head_dim, True, _specs.ARCHS[arch]) == default
    with pytest.raises(ValueError, match="kind: expected one of"):
        _plan.set_bwd_sm90("wgmma")


def test_precision_only_matters_for_float32():
    q = np.zeros((1, 3, 4, 8), np.float16)
    k = np.zeros((1, 5, 2, 8), np.float16)
    assert _plan.Problem.of(q, k, dtype="float16", causal=True, softmax_scale=1.0, precision="tf32").precision == "highest"
    assert _plan.Problem.of(q, k, dtype="float32", causal=True, softmax_scale=1.0, precision="tf32").precision == "tf32"


def test_tiled_refuses_2_31_packed_rows():
    problem = _plan.Problem(1, 2**28, 16, 32, 4, 128, "float16", True, 0.1)  # 2**28 positions x group 8
    layout = ((1, 2**28, 32, 128), (2**28 * 32 * 128 * 2, 32 * 128 * 2, 128 * 2, 2), 2)
    reason = _plan.tiled_unsupported(problem, *(_FakeArray(layout),) * 4)
    assert reason is not None and "seqlen_q * group_size = 2147483648" in reason


class _FakeArray:
    """Just enough of an array for the vector-layout check (shape, strides, itemsize, data.ptr)."""

    def __init__(self, layout):
        self.shape, self.strides, self.itemsize = layout
        self.data = type("Ptr", (), {"ptr": 0})()


class _FakeDeviceArray(_FakeArray):
    device = type("Device", (), {"id": 0})()


@pytest.mark.parametrize("cc", [(9, 0), (8, 0), (8, 9), (7, 5)])
@pytest.mark.parametrize("head_dim", [64, 80, 128, 160, 192, 256])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_auto_prefill_choice(monkeypatch, cc, head_dim, dtype):
    """auto (prefill): hopper only on compute capability 9.0 and fp16 / bf16, where
    tiled does not apply or the table says it is faster; else tiled where the
    architecture has a tile for it (none before 8.0; none for float32 head_dim
    256 in 99 KB of shared memory), else rowwise."""
    monkeypatch.setattr(_plan, "compute_capability", lambda device: cc)
    monkeypatch.setattr(_tma, "available", lambda: True)  # a CUDA driver, as on any GPU machine
    problem = _plan.Problem(2, 500, 500, 32, 8, head_dim, dtype, True, head_dim**-0.5)
    itemsize = np.dtype(np.float32).itemsize if dtype == "float32" else 2
    shape = (2, 500, 32, head_dim)
    strides = tuple(int(np.prod(shape[i + 1 :])) * itemsize for i in range(4))
    arrays = (_FakeDeviceArray((shape, strides, itemsize)),) * 4
    tiled = head_dim in _specs.tiled_head_dims(dtype) and cc >= (8, 0)
    tiled = tiled and not (dtype == "float32" and head_dim == 256 and cc == (8, 9))
    preferred = 500 >= _specs.HOPPER_BULK_QO_AUTO_MIN_KEYS  # group 4: Q and out by bulk copies
    if cc == (9, 0) and dtype == "bfloat16" and (not tiled or preferred):
        expected = "hopper"
    else:
        expected = "tiled" if tiled else "rowwise"
    assert _plan.choose_kernel(problem, *arrays) == expected


@pytest.mark.parametrize("num_q_heads,min_keys", [(32, "HOPPER_BULK_QO_AUTO_MIN_KEYS"), (24, "HOPPER_BULK_QO_AUTO_MIN_KEYS"),
                                                   (104, "HOPPER_AUTO_MIN_KEYS")])
def test_auto_takes_hopper_over_tiled_for_long_keys(monkeypatch, num_q_heads, min_keys):
    """On 9.0, at head dims where both apply (64 and 128), auto takes hopper
    from its threshold of keys on and tiled below: HOPPER_BULK_QO_AUTO_MIN_KEYS
    where hopper moves Q and out by bulk copies (group 4; group 3, 63 rows a
    warpgroup), HOPPER_AUTO_MIN_KEYS where it copies them by its threads (group
    13: 52 rows of whole positions, under HOPPER_MIN_WG_ROWS)."""
    monkeypatch.setattr(_plan, "compute_capability", lambda device: (9, 0))
    monkeypatch.setattr(_tma, "available", lambda: True)
    threshold = getattr(_specs, min_keys)
    for d in (64, 128):
        for seqlen, expected in ((threshold, "hopper"), (threshold - 1, "tiled")):
            problem = _plan.Problem(2, seqlen, seqlen, num_q_heads, 8, d, "bfloat16", True, d**-0.5)
            shape = (2, seqlen, num_q_heads, d)
            strides = tuple(int(np.prod(shape[i + 1 :])) * 2 for i in range(4))
            assert _plan.choose_kernel(problem, *(_FakeDeviceArray((shape, strides, 2)),) * 4) == expected, (d, seqlen)


def test_hopper_refuses_other_architectures(monkeypatch):
    monkeypatch.setattr(_plan, "compute_capability", lambda device: (8, 9))
    problem = _plan.Problem(1, 10, 10, 4, 1, 64, "float16", True, 0.125)
    layout = ((1, 10, 4, 64), (10 * 4 * 64 * 2, 4 * 64 * 2, 64 * 2, 2), 2)
    reason = _plan.hopper_unsupported(problem, *(_FakeDeviceArray(layout),) * 4)
    assert reason == "a device of compute capability 8.9 (it runs on 9.0, Hopper)"


def _stand_in_launches(monkeypatch):
    """The kernel, the driver's launch and the tensor-map encoders as stand-ins
    (no GPU): the launches (arguments, argument buffer) and the encodings (the
    encoder's name and arguments) are recorded; map n is 128 bytes of value n."""
    launched, encoded = [], []

    class _Kernel:
        kernel = type("Function", (), {"ptr": 77})()

    monkeypatch.setattr(_plan, "get_kernel", lambda spec: _Kernel())
    monkeypatch.setattr(_plan, "_current_device", lambda: 0)
    _launch._bound.__dict__[0] = True  # device 0's context counts as bound in this thread

    def encoder(name):
        def encode(ptr, *rest):
            encoded.append((name, ptr, *rest))
            return bytes([len(encoded)]) * 128
        return encode

    monkeypatch.setattr(_tma, "tile_map", encoder("tile"))
    monkeypatch.setattr(_tma, "packed_map", encoder("packed"))
    # persistent hopper launches: 16 SMs, no capture, a ring of counters from 0x5000
    monkeypatch.setattr(_plan, "sm_count", lambda device: 16)
    monkeypatch.setattr(_plan, "_stream_is_capturing", lambda stream: False)
    ring = type("Ring", (), {"ptr": 0x5000})()
    monkeypatch.setattr(_plan, "counter_ring", lambda device: ring)
    monkeypatch.setattr(_plan, "_next_counter", itertools.count())
    return launched, encoded


def test_hopper_launch_passes_tensor_maps(monkeypatch):
    """A hopper launch hands the kernel the parameter struct, then the tensor
    maps of K and V (boxes of the spec's key tile) and of Q and out (boxes of
    whole positions of the KV head's group: a warpgroup's 64 rows), each
    encoded at a new address, the flag that Q and out go by bulk copies, and
    the next tile counter of the device's ring; the grid is one CTA per SM, at
    most one per tile."""
    launched, encoded = _stand_in_launches(monkeypatch)
    problem = _plan.Problem(2, 300, 300, 8, 2, 80, "bfloat16", True, 80**-0.5)
    q_layout = ((2, 300, 8, 80), (300 * 8 * 160, 8 * 160, 160, 2), 2)
    kv_layout = ((2, 300, 2, 80), (300 * 2 * 160, 2 * 160, 160, 2), 2)
    layout = (q_layout, kv_layout, kv_layout, q_layout)
    spec = _specs.HOPPER_WG3["bfloat16", 128, True]  # group 4: three consumer warpgroups, 80-key tiles
    tiles = math.ceil(300 * 4 / spec.block_m) * 2 * 2
    plan = _plan.plan_hopper(problem, layout)
    assert plan.spec == spec and plan.grid == (tiles,) and plan.bulk_qo
    monkeypatch.setattr(_launch, "_driver_launch", lambda *a: launched.append((a, plan.packed().values())))
    plan.launch(99, 1 << 20, 4096, 8192, 2 << 20, 0, 0)
    plan.launch(99, 1 << 20, 4096, 8192, 2 << 20, 0, 0)  # the same addresses: no new encoding
    plan.launch(99, 1 << 20, 4096, 12288, 3 << 20, 0, 0)  # a new V and a new out
    assert encoded == [
        ("tile", 4096, *kv_layout, 80), ("tile", 8192, *kv_layout, 80),
        ("packed", 1 << 20, *q_layout, 4, 16), ("packed", 2 << 20, *q_layout, 4, 16),
        ("tile", 12288, *kv_layout, 80), ("packed", 3 << 20, *q_layout, 4, 16),
    ]  # fmt: skip
    assert tiles > 16
    assert [a[:9] for a, _ in launched] == [(77, 16, 1, 1, spec.threads, 1, 1, spec.smem, 99)] * 3
    args = plan.packed().arg_addresses(0)
    assert len(args) == 13  # q k v out lse seqlens_k, params, k_map v_map q_map o_map, qo_bulk, tile_counter
    for (_, buf), maps in zip(launched, ((1, 2, 3, 4), (1, 2, 3, 4), (1, 5, 3, 6))):
        for arg, m in zip(args[7:11], maps):
            assert buf[arg : arg + 128] == bytes([m]) * 128
        assert buf[args[6] : args[6] + plan.params.nbytes] == plan.params.tobytes()
        assert buf[args[11] : args[11] + 4] == (1).to_bytes(4, "little")
    for i, (_, buf) in enumerate(launched):  # each launch the next counter of the ring
        assert buf[args[12] : args[12] + 8] == (0x5000 + 4 * i).to_bytes(8, "little")
    # a launch being captured into a CUDA graph: one CTA per tile, no counter
    monkeypatch.setattr(_plan, "_stream_is_capturing", lambda stream: True)
    plan.launch(99, 1 << 20, 4096, 8192, 2 << 20, 0, 0)
    (a, buf) = launched[-1]
    assert a[1] == tiles and buf[args[12] : args[12] + 8] == bytes(8)


def test_hopper_launch_at_head_dim_64_encodes_no_map_of_out(monkeypatch):
    """At head dim 64 (48 padded to it) the kernel writes out from its registers
    (kernels/hopper.cu: epilogue): Q still goes by a bulk copy, its map encoded,
    and the slot of out's map stays zero, with nothing encoded for it."""
    launched, encoded = _stand_in_launches(monkeypatch)
    problem = _plan.Problem(2, 300, 300, 8, 2, 48, "bfloat16", True, 48**-0.5)
    q_layout = ((2, 300, 8, 48), (300 * 8 * 96, 8 * 96, 96, 2), 2)
    kv_layout = ((2, 300, 2, 48), (300 * 2 * 96, 2 * 96, 96, 2), 2)
    plan = _plan.plan_hopper(problem, (q_layout, kv_layout, kv_layout, q_layout))
    assert plan.spec.head_dim == 64 and plan.bulk_qo
    monkeypatch.setattr(_launch, "_driver_launch", lambda *a: launched.append((a, plan.packed().values())))
    plan.launch(99, 1 << 20, 4096, 8192, 2 << 20, 0, 0)
    assert [e[:2] for e in encoded] == [("tile", 4096), ("tile", 8192), ("packed", 1 << 20)]
    args = plan.packed().arg_addresses(0)
    (_, buf), = launched
    assert buf[args[9] : args[9] + 128] == bytes([3]) * 128  # q's map, the third encoded
    assert buf[args[10] : args[10] + 128] == bytes(128)  # no map of out


@pytest.mark.parametrize("num_q_heads,num_kv_heads", [(39, 3), (48, 1), (128, 1)])
def test_hopper_launch_keeps_thread_copies_of_q_and_out_for_other_groups(monkeypatch, num_q_heads, num_kv_heads):
    """A group whose whole positions leave a warpgroup's box fewer than 56 of its
    64 rows (13: 52; 48: 48) or none (128): no maps of q and out are encoded,
    their slots stay zero and the flag is 0, so the kernel copies them by its
    threads, 64 rows a warpgroup."""
    launched, encoded = _stand_in_launches(monkeypatch)
    problem = _plan.Problem(1, 40, 40, num_q_heads, num_kv_heads, 64, "float16", False, 0.125)
    q_layout = ((1, 40, num_q_heads, 64), (40 * num_q_heads * 128, num_q_heads * 128, 128, 2), 2)
    kv_layout = ((1, 40, num_kv_heads, 64), (40 * num_kv_heads * 128, num_kv_heads * 128, 128, 2), 2)
    plan = _plan.plan_hopper(problem, (q_layout, kv_layout, kv_layout, q_layout))
    assert not plan.bulk_qo
    monkeypatch.setattr(_launch, "_driver_launch", lambda *a: launched.append((a, plan.packed().values())))
    plan.launch(99, 1 << 20, 4096, 8192, 2 << 20, 0, 0)
    assert [e[0] for e in encoded] == ["tile", "tile"]
    args = plan.packed().arg_addresses(0)
    (_, buf), = launched
    assert buf[args[9] : args[9] + 256] == bytes(256) and buf[args[11] : args[11] + 4] == bytes(4)


@pytest.mark.parametrize("group,wg_rows", [(3, 63), (5, 60), (6, 60), (7, 63), (12, 60), (14, 56), (16, 64)])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_hopper_bulk_copies_of_groups_that_nearly_divide_64(monkeypatch, group, wg_rows, head_dim):
    """A group that leaves a warpgroup at least 56 rows of whole positions takes
    the bulk copies: boxes of group heads by wg_rows / group positions, tiles of
    NWG x wg_rows packed rows (two warpgroups; three at head dim 64), so the
    grid counts those tiles."""
    launched, encoded = _stand_in_launches(monkeypatch)
    seqlen, kv_heads = 333, 2
    problem = _plan.Problem(2, seqlen, seqlen, group * kv_heads, kv_heads, head_dim, "bfloat16", True, 0.1)
    hq = group * kv_heads
    q_layout = ((2, seqlen, hq, head_dim), (seqlen * hq * head_dim * 2, hq * head_dim * 2, head_dim * 2, 2), 2)
    kv_layout = ((2, seqlen, kv_heads, head_dim), (seqlen * kv_heads * head_dim * 2, kv_heads * head_dim * 2, head_dim * 2, 2), 2)
    plan = _plan.plan_hopper(problem, (q_layout, kv_layout, kv_layout, q_layout))
    assert plan.bulk_qo and _plan.hopper_wg_rows(group, True) == wg_rows
    nwg = plan.spec.block_m // 64
    assert plan.grid == (math.ceil(seqlen * group / (nwg * wg_rows)) * 2 * kv_heads,)
    monkeypatch.setattr(_launch, "_driver_launch", lambda *a: launched.append((a, plan.packed().values())))
    plan.launch(99, 1 << 20, 4096, 8192, 2 << 20, 0, 0)
    packed = [e for e in encoded if e[0] == "packed"]
    assert packed and all(e[-2:] == (group, wg_rows // group) for e in packed)
    if wg_rows < 64:  # not at head dim 256 (kernels/hopper.cu: wg_rows_of)
        wide = _plan.Problem(2, seqlen, seqlen, hq, kv_heads, 256, "bfloat16", True, 0.1)
        q256 = ((2, seqlen, hq, 256), (seqlen * hq * 512, hq * 512, 512, 2), 2)
        assert not _plan.hopper_bulk_qo(wide, q256, q256)


def test_hopper_smem_fits_and_head_dims_pad():
    assert [_specs.hopper_head_dim_pad(d) for d in (8, 64, 72, 128, 136, 192, 200, 256)] == [64, 64, 128, 128, 192, 192, 256, 256]
    for spec in _specs.HOPPER.values():
        assert spec.smem <= 227 * 1024, spec.name  # sm_90's largest dynamic shared memory per block
    # two Q tiles where they fit beside the K/V stages (not at head dim 64, whose epilogue frees Q early)
    slots = {d: _specs.hopper_q_slots(d, *tile) for d, tile in _specs.HOPPER_TILES.items()}
    assert slots == {64: 1, 128: 2, 192: 1, 256: 1}


@pytest.mark.parametrize("cc,arch", [((7, 0), "sm_70"), ((7, 2), "sm_70"), ((7, 5), "sm_75"), ((8, 6), "sm_86"),
                                     ((8, 9), "sm_89"), ((9, 0), "sm_90"), ((10, 3), "sm_100"), ((12, 1), "sm_120")])
def test_arch_of_compute_capability(cc, arch):
    assert _specs.arch_of(*cc).name == arch


def test_no_arch_before_volta():
    with pytest.raises(ValueError, match="compute capability 6.1 is older than any architecture"):
        _specs.arch_of(6, 1)


def test_tiled_and_decode_refuse_with_the_reason(monkeypatch):
    """On sm_75 the tensor-core kernels say why; on sm_89 bf16 D128 gets a tile with half the keys."""
    layout = ((1, 10, 4, 128), (10 * 4 * 128 * 2, 4 * 128 * 2, 128 * 2, 2), 2)
    arrays = (_FakeDeviceArray(layout),) * 4
    monkeypatch.setattr(_plan, "compute_capability", lambda device: (7, 5))
    problem = _plan.Problem(1, 10, 10, 4, 1, 128, "bfloat16", True, 0.1)
    expected = "a device of compute capability 7.5 (it needs 8.0 or newer: cp.async and mma.sync)"
    assert _plan.tiled_unsupported(problem, *arrays) == expected
    decode = _plan.Problem(1, 1, 10, 4, 1, 128, "bfloat16", True, 0.1)
    assert _plan.decode_unsupported(decode, *arrays) == expected
    assert _plan.choose_kernel(problem, *arrays) == "rowwise"
    monkeypatch.setattr(_plan, "compute_capability", lambda device: (8, 9))
    assert _plan.tiled_unsupported(problem, *arrays) is None
    spec = _specs.tiled_spec("bfloat16", 128, True, _specs.ARCHS["sm_89"])
    assert spec.smem <= 101376 and ", 128, 128, 32, 4, true," in spec.name


def test_warmup_readies_the_devices_table_for_the_given_calls(monkeypatch):
    """warmup compiles exactly the specializations of the device's table that
    serve the named dtypes and head dims (decode's plans need no occupancy query:
    _specs.decode_ctas_per_sm)."""
    cupy = pytest.importorskip("cupy")
    import cupy_gqa
    from cupy_gqa import _compile

    class _Device:  # no GPU needed: the device context is a no-op
        def __init__(self, device=None):
            self.id = 0 if device is None else device

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    compiled = []
    monkeypatch.setattr(cupy.cuda, "Device", _Device)
    monkeypatch.setattr(_plan, "compute_capability", lambda device: (8, 9))
    monkeypatch.setattr(_compile, "get_kernel", lambda spec: compiled.append(spec))
    n = cupy_gqa.warmup(dtypes=["bfloat16"], head_dims=[128, 80])
    names = {s.name for s in compiled}
    assert n == len(compiled) == len(names)
    assert all(s.dtype == "bfloat16" for s in compiled)
    table = {s.name for s in _specs.specs_for(_specs.ARCHS["sm_89"])}
    assert names <= table  # sm_89's table: no hopper kernel, the 99 KB tiles
    assert {s.family for s in compiled} == {"rowwise", "tiled", "decode", "backward"}
    backward = {s.name.split("<")[0]: s for s in compiled if s.family == "backward" and "_mma<" in s.name}
    assert {s.head_dim for s in compiled if "_mma<" in s.name} == {96, 128}  # 80 pads to 96
    assert set(backward) == {"bwd_dq_mma", "bwd_dkdv_mma"}
    assert {s.head_dim for s in compiled if s.family == "rowwise"} == {128}  # 80 and 128 share the 128 bucket
    assert {s.head_dim for s in compiled if s.family == "tiled"} == {128}  # tiled has no 80
    assert sorted(s.block_m for s in compiled if s.family == "decode") == [0, 16, 32, 64]  # the combine, 3 layouts


@pytest.mark.parametrize("kw,match", [
    ({"dtypes": ["int8"]}, r"dtypes: expected names in \('float32', 'float16', 'bfloat16', 'float64'\), got \['int8'\]"),
    ({"head_dims": [0, 64]}, r"head_dims: expected integers in \[1, 256\], got \[0, 64\]"),
])
def test_warmup_rejects_bad_arguments(kw, match):
    import cupy_gqa

    with pytest.raises(ValueError, match=match):
        cupy_gqa.warmup(**kw)


# --- the backward pass -------------------------------------------------------------


def test_backward_params_struct_matches_the_kernels():
    # kernels/backward.cu: struct BwdParams, static_assert(sizeof == 336)
    dt = _plan.BWD_PARAMS_DTYPE
    assert dt.itemsize == 336
    assert [dt.fields[n][1] for n in dt.names] == [0, 176, 208, 240, 272, 304, 328]
    source = (_compile.KERNEL_DIR / "backward.cu").read_text()
    body = source[source.index("struct BwdParams {") : source.index("};", source.index("struct BwdParams {"))]
    body = re.sub(r"//[^\n]*", "", body)
    positions = [re.search(rf"\b{name}\b", body).start() for name in dt.names]
    assert positions == sorted(positions), "fields must be declared in the same order"


def _bwd_layout(b, sq, sk, hq, hkv, d, itemsize):
    def contiguous(shape):
        return (shape, tuple(int(np.prod(shape[i + 1 :])) * itemsize for i in range(4)), itemsize)

    q, kv = contiguous((b, sq, hq, d)), contiguous((b, sk, hkv, d))
    return (q, kv, kv, q, q, q, kv, kv, (hq * sq * 4, sq * 4, 4))


@pytest.mark.parametrize("arch", ["sm_75", "sm_80", "sm_86", "sm_90", "sm_120"])
@pytest.mark.parametrize("dtype", _specs.DTYPES)
@pytest.mark.parametrize("head_dim", [1, 8, 20, 32, 40, 64, 96, 128, 136, 192, 256])
def test_backward_plan_picks_a_kernel_of_the_table(arch, dtype, head_dim):
    a = _specs.ARCHS[arch]
    problem = _plan.Problem(2, 100, 77, 8, 2, head_dim, dtype, True, 0.125)
    mma = _plan.backward_mma_unsupported(problem, a) is None
    # tensor cores: fp16 / bf16 at every multiple of 8; float32 (split TF32) too, above head dim 128
    # where a dK/dV block of 16 keys fits (not in the 99 KB of sm_86, sm_89, sm_120)
    fits = dtype in ("float16", "bfloat16") or (dtype == "float32" and (head_dim <= 128 or a.smem > 128 * 1024))
    assert mma == (fits and head_dim % 8 == 0 and a.sm80)
    plan = _plan.plan_backward(problem, _bwd_layout(2, 100, 77, 8, 2, head_dim, _specs.ITEMSIZE[dtype]), a, mma, 132)
    table = set(_specs.specs_for(a))
    assert {plan.pre, plan.dq, plan.dkdv} <= table
    assert all(_specs.serves(s, head_dim) for s in (plan.pre, plan.dq, plan.dkdv))
    assert plan.dq.head_dim >= head_dim and plan.dkdv.head_dim >= head_dim
    # on sm_90 the 16-bit calls at head dims 64 and 128 take the Hopper kernels with a producer (_specs.BWD_SM90)
    # (and a driver that encodes tensor maps: else the mma.sync kernels)
    hopper = arch == "sm_90" and dtype in ("float16", "bfloat16") and _specs.bwd_head_dim_pad(head_dim) in (64, 128)
    hopper = hopper and _plan._tma.available()
    kind = "_tf32<" if dtype == "float32" else "_ws<" if hopper else "_mma<"
    assert (kind in plan.dq.name) == mma and (kind in plan.dkdv.name) == mma
    assert all(s.dtype == dtype for s in (plan.pre, plan.dq, plan.dkdv))
    packed = 100 * 4
    assert plan.grids[1] == (-(-packed // plan.dq.block_m) * 4,)  # rows per CTA
    assert plan.grids[2] == (-(-77 // plan.dkdv.block_m) * 4,)  # keys per CTA
    p = plan.params[0]
    assert p["scale"] == 0.125 and p["a"]["group_size"] == 4 and list(p["lse_stride"]) == [800, 100, 1]


@pytest.mark.parametrize("hq, hkv, k_stride, expected", [
    (32, 8, None, ("bwd_dq_ws", "bwd_dkdv_ws", True)),  # group 4: whole positions in 64 rows
    (48, 8, None, ("bwd_dq_ws", "bwd_dkdv_ws", False)),  # group 6: Q and dO by the producer's cp.async
    (64, 1, None, ("bwd_dq_ws", "bwd_dkdv_ws", True)),  # group 64: one position a tile
    (32, 8, -2048, ("bwd_dq_mma", "bwd_dkdv_mma", False)),  # k steps backwards: no bulk copies of K
])  # fmt: skip
def test_backward_with_a_producer_takes_bulk_copies_where_the_copy_engine_can(monkeypatch, hq, hkv, k_stride, expected):
    monkeypatch.setattr(_plan._tma, "available", lambda: True)
    a = _specs.ARCHS["sm_90"]
    problem = _plan.Problem(2, 100, 77, hq, hkv, 128, "bfloat16", True, 0.125)
    layout = list(_bwd_layout(2, 100, 77, hq, hkv, 128, 2))
    if k_stride is not None:
        shape, strides, itemsize = layout[1]
        layout[1] = (shape, (strides[0], k_stride, *strides[2:]), itemsize)
    old = _plan.set_bwd_sm90("ws")
    try:
        plan = _plan.plan_backward(problem, tuple(layout), a, True, 132)
    finally:
        _plan.set_bwd_sm90(old)
    assert (plan.dq.name.split("<")[0], plan.dkdv.name.split("<")[0], plan.bulk_rows) == expected
    assert plan.group == hq // hkv and plan.layouts == (layout[0], layout[1], layout[2], layout[4])


@pytest.mark.parametrize("batch, seqlen, hq, hkv, head_dim, causal, sms, wide", [
    (4, 1024, 32, 8, 64, True, 132, True),    # 256 wide key blocks: the SMs' share of the work is the time
    (2, 1000, 28, 4, 64, True, 132, False),   # 64 wide blocks: the first one, which sees every row, is
    (1, 4096, 32, 4, 64, True, 132, False),   # 128 wide blocks, each as long as two narrow ones' worth
    (1, 4096, 32, 4, 64, True, 16, True),     # ... unless few SMs share them
    (1, 4096, 32, 4, 64, False, 132, True),   # non-causal: every block sees every row; 256 narrow blocks in
    (1, 1024, 8, 2, 64, False, 132, False),   # two waves take longer than 128 wide ones in one, 32 in one don't
    (8, 2048, 32, 8, 64, False, 132, True),
    (2, 2048, 32, 8, 128, True, 132, True),
    (1, 100, 8, 8, 32, True, 132, False),     # no wide kernel at head dim 32
])  # fmt: skip
def test_float32_backward_widens_its_key_blocks_where_the_grid_is_long(batch, seqlen, hq, hkv, head_dim, causal, sms, wide):
    a = _specs.ARCHS["sm_90"]
    problem = _plan.Problem(batch, seqlen, seqlen, hq, hkv, head_dim, "float32", causal, head_dim**-0.5)
    plan = _plan.plan_backward(problem, _bwd_layout(batch, seqlen, seqlen, hq, hkv, head_dim, 4), a, True, sms)
    narrow = _specs.bwd_dkdv_tf32_spec(_specs.bwd_head_dim_pad(head_dim), causal, a)
    assert plan.dkdv == (_specs.bwd_dkdv_tf32_spec(head_dim, causal, a, wide=True) if wide else narrow)
    assert plan.grids[2] == (-(-seqlen // plan.dkdv.block_m) * batch * hkv,)
    assert plan.dkdv in _specs.specs_for(a)
    assert plan.dkdv.block_m == (16 * _specs.BWD_TF32_DKDV_WIDE[head_dim][0] if wide else narrow.block_m)  # keys per CTA
    # the estimate: the heaviest block's tiles, or the SMs' share of them all
    tiles = -(-seqlen * (hq // hkv) // narrow.block_n)
    estimate = _plan.bwd_tf32_dkdv_estimate(problem, narrow, 1.0, a, sms)
    assert estimate >= tiles and (causal or estimate == max(tiles, tiles * batch * hkv * -(-seqlen // narrow.block_m) / sms))


def test_backward_tensor_cores_need_a_positive_scale():
    a = _specs.ARCHS["sm_90"]
    assert _plan.backward_mma_unsupported(_plan.Problem(1, 4, 4, 2, 1, 64, "float16", True, -0.5), a) is not None
    assert _plan.backward_mma_unsupported(_plan.Problem(1, 4, 4, 2, 1, 64, "float16", True, 0.5), a) is None


# --- hopper with per-sequence addressing (kernels/hopper.cu: hopper_attention_seq) --------------


def _seq_problem(flags, max_q, max_k, head_dim=128, causal=True, dtype="bfloat16", batch=16, total_q=0, total_k=0):
    from cupy_gqa import _seq

    seq = _seq.SeqLayout(flags=flags, page_size=32 if flags & _seq.SEQ_PAGED else 0, total_q=total_q, total_k=total_k,
                         cu_seqlens_q=0x1000, cu_seqlens_k=0x2000)  # fmt: skip
    return _plan.Problem(batch, max_q, max_k, 32, 8, head_dim, dtype, causal, head_dim**-0.5, "highest", None, seq)


def _varlen_arrays(total_q, total_k, head_dim=128, itemsize=2):
    """(1, total, heads, head_dim) views of packed q, k, v, out, axis 0 of stride 0 (as the API makes them)."""
    def view(total, heads):
        return _FakeDeviceArray(((1, total, heads, head_dim), (0, heads * head_dim * itemsize, head_dim * itemsize, itemsize), itemsize))
    return view(total_q, 32), view(total_k, 8), view(total_k, 8), view(total_q, 32)


@pytest.mark.parametrize("flags", [1, 2, 4, 6])
def test_hopper_takes_every_per_sequence_addressing(monkeypatch, flags):
    """hopper runs varlen, paged and left-padded calls, and auto takes it for a
    long prefill of each (paged K/V goes by its producer's cp.async, varlen and
    left padding by its bulk copies of one strided array)."""
    monkeypatch.setattr(_plan, "compute_capability", lambda device: (9, 0))
    monkeypatch.setattr(_tma, "available", lambda: True)
    problem = _seq_problem(flags, 4096, 4096, total_q=42052, total_k=42052)
    arrays = _varlen_arrays(42052, 42052)
    assert _plan.hopper_unsupported(problem, *arrays) is None
    assert _plan.choose_kernel(problem, *arrays) == "hopper"


@pytest.mark.parametrize("flags, bulk", [(1, False), (2, True), (4, True), (6, True)])
def test_hopper_bulk_qo_of_per_sequence_calls(flags, bulk):
    """q and out of paged and left-padded calls have the contiguous shape and go
    by bulk copies; a varlen call's sequences end inside the packed rows, so
    they keep the threads' copies. A paged call's K/V tensor maps take boxes of
    gcd(page_size, block_n) rows, none across a page."""
    problem = _seq_problem(flags, 512, 4096, batch=4, total_q=2048)
    q = ((4, 512, 32, 128), (512 * 32 * 256, 32 * 256, 256, 2), 2)
    if flags & 1:  # varlen: (1, total_q, heads, head_dim), axis 0 of stride 0
        q = ((1, 2048, 32, 128), (0, 32 * 256, 256, 2), 2)
    assert _plan.hopper_bulk_qo(problem, q, q) is bulk


def test_hopper_paged_maps_take_boxes_inside_a_page(monkeypatch):
    launched, encoded = _stand_in_launches(monkeypatch)
    problem = _seq_problem(2, 512, 4096, batch=4)  # pages of 32 keys
    q = ((4, 512, 32, 128), (512 * 32 * 256, 32 * 256, 256, 2), 2)
    pool = ((4 * 128, 32, 8, 128), (32 * 8 * 256, 8 * 256, 256, 2), 2)
    plan = _plan.plan_hopper(problem, (q, pool, pool, q))
    monkeypatch.setattr(_launch, "_driver_launch", lambda *a: launched.append(a))
    plan.launch(99, 1 << 20, 4096, 8192, 2 << 20, 0, 0, seq=(0x1000, 0x2000, 0x3000, 0))
    tiles = [e for e in encoded if e[0] == "tile"]
    assert tiles and all(e[-1] == math.gcd(32, plan.spec.block_n) == 32 for e in tiles)


def test_auto_takes_hopper_for_varlen_from_max_seqlen_k(monkeypatch):
    """auto on 9.0 takes hopper for a varlen prefill by the contiguous rule, with
    max_seqlen_k as the keys (HOPPER_AUTO_MIN_KEYS); tiled below it, and hopper
    at any length where tiled has no kernel (head_dim 80)."""
    monkeypatch.setattr(_plan, "compute_capability", lambda device: (9, 0))
    monkeypatch.setattr(_tma, "available", lambda: True)
    for max_k, expected in ((_specs.HOPPER_AUTO_MIN_KEYS, "hopper"), (_specs.HOPPER_AUTO_MIN_KEYS - 1, "tiled")):
        problem = _seq_problem(1, 4096, max_k, total_q=9000, total_k=9000)
        assert _plan.choose_kernel(problem, *_varlen_arrays(9000, 9000)) == expected, max_k
    problem = _seq_problem(1, 300, 300, head_dim=80, total_q=900, total_k=900)
    assert _plan.choose_kernel(problem, *_varlen_arrays(900, 900, head_dim=80)) == "hopper"
    # not on other architectures
    monkeypatch.setattr(_plan, "compute_capability", lambda device: (8, 0))
    problem = _seq_problem(1, 4096, 4096, total_q=9000, total_k=9000)
    assert _plan.choose_kernel(problem, *_varlen_arrays(9000, 9000)) == "tiled"


@pytest.mark.parametrize("group", [1, 2, 3, 4, 7, 16])
@pytest.mark.parametrize("head_dim", [64, 80, 128, 256])
def test_hopper_tile_by_group(group, head_dim):
    """Head dims that pad to 128 take three consumer warpgroups on 80-key tiles
    from group 2 on (a tile's 192 rows then span at most 96 positions), except
    with paged K/V; group 1, and the other head dims, keep their tile.
    ALiBi, score_mod and mask_mod, which need a third warpgroup's registers, run
    two on the same key tile (so a user's twin of a built-in gives its bits); a
    window or a softcap keep three."""
    arch = _specs.ARCHS["sm_90"]
    dpad = _specs.hopper_head_dim_pad(head_dim)
    wg3 = dpad == 128 and group >= 2
    spec = _specs.hopper_spec("bfloat16", head_dim, True, arch, group)
    assert spec == (_specs.HOPPER_WG3 if wg3 else _specs.HOPPER)["bfloat16", dpad, True]
    assert (spec.block_m, spec.block_n) == ((192, 80) if wg3 else _specs.HOPPER_TILES[dpad][:2])
    assert _specs.hopper_spec("bfloat16", head_dim, True, arch, group, paged=True) == _specs.HOPPER["bfloat16", dpad, True]
    alibi = _specs.with_mods(spec, 4)
    assert (alibi.block_m, alibi.block_n) == (min(spec.block_m, 128), spec.block_n)
    assert alibi.threads == alibi.block_m // 64 * 128 + 128 and alibi.smem <= spec.smem
    for flags in (1, 2, 3):  # window, softcap
        assert _specs.with_mods(spec, flags).block_m == spec.block_m


def test_hopper_plan_takes_the_tile_of_its_group():
    """plan_hopper's spec is hopper_spec's for the call's group and paging."""
    for group, block_m in ((1, 128), (2, 192), (3, 192), (8, 192)):
        problem = _plan.Problem(2, 500, 500, 2 * group, 2, 128, "float16", True, 128**-0.5)
        q_layout = ((2, 500, 2 * group, 128), (500 * 2 * group * 256, 2 * group * 256, 256, 2), 2)
        kv_layout = ((2, 500, 2, 128), (500 * 2 * 256, 2 * 256, 256, 2), 2)
        plan = _plan.plan_hopper(problem, (q_layout, kv_layout, kv_layout, q_layout))
        assert plan.spec.block_m == block_m, group
        wg_rows = _plan.hopper_wg_rows(group, plan.bulk_qo)
        assert plan.grid[0] <= math.ceil(500 * group / (block_m // 64 * wg_rows)) * 2 * 2


def test_hopper_varlen_plan_passes_seq_params_and_packed_tensor_maps(monkeypatch):
    """A varlen hopper plan launches hopper_attention_seq<..., 1> on the prefill
    grid of max_seqlen_q, with the SeqParams between the parameter struct and
    the tensor maps, which are encoded for the packed (1, total_k, ...) k and v;
    q and out go by the threads' copies (a sequence ends inside the array)."""
    launched, encoded = _stand_in_launches(monkeypatch)
    problem = _seq_problem(1, 300, 500, batch=3, total_q=700, total_k=1100)
    layout = _plan._layout(*_varlen_arrays(700, 1100))
    plan = _plan.plan_hopper(problem, layout)
    monkeypatch.setattr(_launch, "_driver_launch", lambda *a: launched.append((a, plan.packed().values())))
    base = _specs.HOPPER_WG3["bfloat16", 128, True]  # group 4, K/V not paged: three consumer warpgroups
    assert plan.spec.name == base.name.replace("hopper_attention<", "hopper_attention_seq<")[:-1] + ", 1>"
    assert (plan.spec.threads, plan.spec.smem, plan.spec.block_n) == (base.threads, base.smem, base.block_n)
    assert plan.grid == (math.ceil(300 * 4 / 192) * 3 * 8,)
    assert plan.params[0]["k_stride"][0] == 0 and plan.params[0]["q_stride"][0] == 0  # sequences found by cu_seqlens
    plan.launch(99, 1 << 20, 4096, 8192, 2 << 20, 0, 0)
    assert encoded == [("tile", 4096, *layout[1], 80), ("tile", 8192, *layout[2], 80)]
    assert encoded[0][2] == (1, 1100, 8, 128)
    args = plan.packed().arg_addresses(0)
    assert len(args) == 14  # q k v out lse seqlens_k, params, SeqParams, k_map v_map q_map o_map, qo_bulk, tile_counter
    (_, buf), = launched
    assert buf[args[7] : args[7] + 56] == problem.seq.params()
    assert buf[args[8] : args[8] + 128] == bytes([1]) * 128 and buf[args[9] : args[9] + 128] == bytes([2]) * 128
    assert buf[args[10] : args[10] + 256] == bytes(256) and buf[args[12] : args[12] + 4] == bytes(4)


def test_hopper_timeline_finds_its_marks_in_the_kernel():
    """benchmarks/dev/hopper_timeline.py puts its clock marks at named places of
    kernels/hopper.cu: every place is still there, once, in every table kernel."""
    tool = dev_tool("hopper_timeline")
    for kernel in _specs.HOPPER.values():
        source = tool.traced_source(kernel)
        assert source.count("cg_mark(cg_n") == len(tool.INSERTIONS) - 1, kernel.name


def test_decode_timeline_finds_its_marks_in_the_kernel():
    """benchmarks/dev/decode_timeline.py puts its clock marks (and the SM's id) at named
    places of kernels/decode.cu: every place is still there, once, in the tensor-core
    decode kernels of every row layout."""
    pytest.importorskip("cupy")
    tool = dev_tool("decode_timeline")
    arch = _specs.ARCHS["sm_90"]
    for block_m in _specs.decode_block_ms("bfloat16"):
        kernel = _specs.decode_spec("bfloat16", 128, block_m, arch)
        if kernel is None or not kernel.sm80:
            continue
        source = tool.traced_source(kernel)
        assert source.count("dt_mark(") == len(tool.INSERTIONS) + 1, kernel.name  # (and its definition)
        assert source.count("dt_sm();") == 1, kernel.name


def test_hopper_barrier_protocol_model():
    """benchmarks/dev/hopper_barriers.py, the model of hopper.cu's barriers over a
    persistent CTA's tiles: the protocol as built never deadlocks nor confuses
    phases, and the model does catch a broken one (no wait for q_empty)."""
    model = dev_tool("hopper_barriers")
    # the two epilogues (head dim 64: Q freed after the last Q K^T), one and two Q tiles
    for direct_out, q_slots in ((False, 1), (True, 1), (False, 2)):
        assert model.check(q_empty_wait=True, direct_out=direct_out, q_slots=q_slots) is None
        assert model.check(q_empty_wait=False, direct_out=direct_out, q_slots=q_slots) is not None


def test_dependent_launch_structs_match_cuda_h():
    """cuLaunchKernelEx's configuration as cuda.h lays it out (64-bit): CUlaunchAttribute
    72 bytes, CUlaunchConfig 56 with the stream at 32, the attributes at 40, their count at 48."""
    import ctypes

    from cupy_gqa import _launch

    assert ctypes.sizeof(_launch._LaunchAttribute) == 72
    assert ctypes.sizeof(_launch._LaunchConfig) == 56
    offsets = {name: getattr(_launch._LaunchConfig, name).offset for name in ("stream", "attrs", "num_attrs")}
    assert offsets == {"stream": 32, "attrs": 40, "num_attrs": 48}
    config = _launch.dependent_config(7, 128, 4096)
    assert tuple(config.grid) == (7, 1, 1) and tuple(config.block) == (128, 1, 1) and config.shared_mem == 4096
    assert config.num_attrs == 1 and config.attrs[0].id == 6 and config.attrs[0].value[0] == 1


def test_packed_launch_launches_a_dependent_kernel_through_launch_ex(monkeypatch):
    """A kernel marked dependent goes through cuLaunchKernelEx on the same stream, after
    the kernel before it through cuLaunchKernel, with its own grid."""
    from cupy_gqa import _launch

    plain, dependent = [], []
    monkeypatch.setattr(_launch, "_driver_launch", lambda *a: plain.append(a))
    monkeypatch.setattr(_launch, "_driver_launch_dependent",
                        lambda config, function, stream, argv: dependent.append((tuple(config.grid), function, stream)))
    monkeypatch.setitem(_launch._bound.__dict__, 0, True)
    packed = _launch.PackedLaunch([(11, 5, 128, 0, ("q",)), (22, 3, 256, 0, ("out",), True)], device=0)
    packed(99, 1, 2, 3, 4, 5, 0)
    assert [(a[0], a[1], a[8]) for a in plain] == [(11, 5, 99)]
    assert dependent == [((3, 1, 1), 22, 99)]


def _split_decode_plan():
    """A decode plan whose 3 key ranges go through the workspace and the combine."""
    p = _plan.Problem(1, 1, 32768, 32, 32, 96, "bfloat16", True, 96**-0.5, "highest")
    layout = tuple(((1, 1, 32, 96), (6144, 6144, 192, 2), 2) for _ in range(4))
    return _plan._decode_plan(p, layout, _specs.decode_spec("bfloat16", 96, 16, _specs.ARCHS["sm_90"]), 3)


def _f16x2_plan():
    """A float32 plan on fp16 pairs, whose K and V pairs go in the workspace."""
    p = _plan.Problem(2, 2048, 2048, 8, 2, 64, "float32", True, 0.1, "highest")
    layout = ((2, 2048, 8, 64), (2048 * 8 * 64 * 4, 8 * 64 * 4, 64 * 4, 4), 4)
    return _plan.plan_tiled(p, (layout,) * 4, _specs.ARCHS["sm_80"])


@pytest.mark.parametrize("make", [_split_decode_plan, _f16x2_plan])
def test_the_workspace_is_held_until_the_launch_is_queued(make, monkeypatch):
    """A call's workspace (here from a caller's allocator, as torch's) is alive when
    the plan's launch is queued: dropped before, CuPy's pool could give its memory to
    an array made while the first launch makes its arguments (a user modifier's
    buffers, kept on the device), and the kernels would then write over that array."""
    import types
    import weakref

    plan = make()
    assert plan.workspace_bytes > 0

    class Buffer:  # a device array as the plan sees it: its address
        def __init__(self, ptr):
            self.data = types.SimpleNamespace(ptr=ptr)

    made, seen = [], []

    def allocate(nbytes):
        b = Buffer(0x7000_0000)
        made.append((weakref.ref(b), nbytes))
        return b

    def launch(self, stream, q, k, v, out, lse, seqlens_k, workspace, seq=()):
        seen.append((made[0][0]() is not None, workspace))

    monkeypatch.setattr(_plan, "current_stream_ptr", lambda: 0)
    monkeypatch.setattr(type(plan), "launch", launch)
    q, k, v, out = (Buffer(0x1000_0000 * (i + 1)) for i in range(4))
    plan(q, k, v, out, None, None, allocate)
    assert [n for _, n in made] == [plan.workspace_bytes]
    assert seen == [(True, 0x7000_0000)], "the workspace was dropped before the launch"
