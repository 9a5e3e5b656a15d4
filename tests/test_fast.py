"""The repeat-call path (cupy_gqa/_fast.py) and the packed launches (_launch.py), without a GPU.

torch CPU tensors stand in for CUDA ones: registered as torch arrays, they
give signatures as CUDA tensors do (device -1), and an entry made here with
a recording launch and torch's CPU allocator runs a repeat call through
``cupy_gqa.attention`` up to the driver call.
"""
import struct

import numpy as np
import pytest

import cupy_gqa
from cupy_gqa import _fast, _launch, _plan

torch = pytest.importorskip("torch")
pytest.importorskip("cupy")  # _fast.Entry binds CuPy's runtime functions (not called here)

FLAGS = (bool, True, type(None), None, bool, False, "auto", "highest", "bshd")


@pytest.fixture
def fast(monkeypatch):
    """A clean table with torch tensors registered; restored afterwards."""
    monkeypatch.setattr(_fast, "_entries", {})
    monkeypatch.setattr(_fast, "_types", {torch.Tensor: "torch"})
    return _fast


def qkv(batch=2, seqlen_q=1, seqlen_k=64, hq=8, hkv=2, d=64, dtype=torch.float16):
    return (torch.zeros(batch, seqlen_q, hq, d, dtype=dtype), torch.zeros(batch, seqlen_k, hkv, d, dtype=dtype),
            torch.zeros(batch, seqlen_k, hkv, d, dtype=dtype))  # fmt: skip


class Recorder:
    """Stands in for a PackedLaunch: records each launch's stream and addresses."""

    def __init__(self):
        self.calls, self.seq = [], []

    def __call__(self, *args, seq=()):
        self.calls.append(args)
        self.seq.append(seq)


def make_entry(q, k, v, *, return_lse=False, ws_bytes=0, host_lens=None, out=None, lens_ext=0):
    out = torch.empty_like(q) if out is None else out
    ext = lambda t: (sum((n - 1) * s for n, s in zip(t.shape, t.stride())) + 1) * t.element_size()  # noqa: E731
    entry = _fast.Entry(
        kind="torch", device=0, launch=Recorder(), return_lse=return_lse, out_shape=tuple(q.shape),
        lse_shape=(q.shape[0], q.shape[2], q.shape[1]), dtype=q.dtype, aligned_out=True,
        extents=(ext(q), ext(k), ext(v), ext(out), lens_ext), ws_bytes=ws_bytes, host_lens=host_lens,
        capture_message="workspace: expected a caller-owned buffer while a CUDA graph is being captured",
    )  # fmt: skip
    # the CPU in place of device 0: no device switch, stream 7, CPU allocations
    entry.torch_device, entry._get_device, entry._set_device = torch.device("cpu"), lambda: 0, None
    entry._stream = lambda device: 7
    return entry


def remember(q, k, v, entry, *, out=None, seqlens_k=None, workspace=None, flags=FLAGS):
    key, _ = _fast.signature(q, k, v, out, seqlens_k, workspace, flags)
    _fast.remember(key, entry)
    return key


# --- signatures ---------------------------------------------------------------------


def test_numpy_and_unregistered_types_have_no_signature(fast):
    q = np.zeros((1, 1, 2, 8), np.float32)
    assert _fast.signature(q, q, q, None, None, None, FLAGS) is None
    fast._types.clear()
    t = torch.zeros(1, 1, 2, 8)
    assert _fast.signature(t, t, t, None, None, None, FLAGS) is None


def test_signature_tells_calls_apart(fast):
    """Everything a plan depends on is in the key: strides, dtype, shape, flags,
    out and workspace given or not, seqlens_k's kind, alignment."""
    q, k, v = qkv()
    base, addrs = _fast.signature(q, k, v, None, None, None, FLAGS)
    assert addrs == (q.data_ptr(), k.data_ptr(), v.data_ptr(), 0, 0, 0, ())
    same, _ = _fast.signature(*qkv(), None, None, None, FLAGS)
    assert same == base  # other tensors, same signature
    variants = {
        "strides": _fast.signature(q, torch.zeros(2, 2, 64, 64, dtype=q.dtype).transpose(1, 2), v, None, None, None, FLAGS),
        "dtype": _fast.signature(*qkv(dtype=torch.bfloat16), None, None, None, FLAGS),
        "shape": _fast.signature(*qkv(seqlen_k=65), None, None, None, FLAGS),
        "causal": _fast.signature(q, k, v, None, None, None, (bool, False, *FLAGS[2:])),
        "causal np.bool_": _fast.signature(q, k, v, None, None, None, (np.bool_, True, *FLAGS[2:])),
        "causal 1": _fast.signature(q, k, v, None, None, None, (int, 1, *FLAGS[2:])),
        "scale": _fast.signature(q, k, v, None, None, None, (*FLAGS[:2], float, 0.5, *FLAGS[4:])),
        "scale True": _fast.signature(q, k, v, None, None, None, (*FLAGS[:2], bool, True, *FLAGS[4:])),
        "scale 1.0": _fast.signature(q, k, v, None, None, None, (*FLAGS[:2], float, 1.0, *FLAGS[4:])),
        "return_lse": _fast.signature(q, k, v, None, None, None, (*FLAGS[:4], bool, True, *FLAGS[6:])),
        "kernel": _fast.signature(q, k, v, None, None, None, (*FLAGS[:6], "decode", *FLAGS[7:])),
        "precision": _fast.signature(q, k, v, None, None, None, (*FLAGS[:7], "tf32", "bshd")),
        "layout": _fast.signature(q, k, v, None, None, None, (*FLAGS[:8], "bhsd")),
        "out": _fast.signature(q, k, v, torch.empty_like(q), None, None, FLAGS),
        "out strides": _fast.signature(q, k, v, torch.empty(2, 8, 1, 64, dtype=q.dtype).transpose(1, 2), None, None, FLAGS),
        "host seqlens_k": _fast.signature(q, k, v, None, [64, 3], None, FLAGS),
        "numpy seqlens_k": _fast.signature(q, k, v, None, np.array([64, 3]), None, FLAGS),
        "workspace": _fast.signature(q, k, v, None, None, torch.empty(100), FLAGS),
        "larger workspace": _fast.signature(q, k, v, None, None, torch.empty(101), FLAGS),
        "requires_grad": _fast.signature(q, k.clone().requires_grad_(), v, None, None, None, FLAGS),
        "misaligned": _fast.signature(torch.zeros(2 * 8 * 64 + 1, dtype=q.dtype)[1:].view(2, 1, 8, 64), k, v, None, None, None, FLAGS),
    }
    keys = {name: found[0] for name, found in variants.items()}
    assert all(key != base for key in keys.values()), [n for n, key in keys.items() if key == base]
    assert len(set(keys.values())) == len(keys)
    assert variants["host seqlens_k"][1][4] is None  # host values: read at each call
    assert keys["host seqlens_k"] == _fast.signature(q, k, v, None, [1, 2], None, FLAGS)[0]  # values are not in the key


def test_unhashable_arguments_take_the_full_path(fast):
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"kernel: expected one of"):
        cupy_gqa.attention(q, k, v, kernel=["auto"])


# --- repeat calls through an entry -------------------------------------------------------


def test_repeat_call_launches_with_this_calls_addresses(fast):
    q, k, v = qkv()
    entry = make_entry(q, k, v, return_lse=True)
    remember(q, k, v, entry, flags=(*FLAGS[:4], bool, True, *FLAGS[6:]))
    q2, k2, v2 = qkv()
    out, lse = cupy_gqa.attention(q2, k2, v2, return_lse=True)
    assert out.shape == q.shape and out.dtype == q.dtype and lse.shape == (2, 8, 1) and lse.dtype == torch.float32
    [(stream, qp, kp, vp, op, lsep, lp, wp)] = entry.launch.calls
    assert (stream, qp, kp, vp, op, lsep, lp, wp) == (7, q2.data_ptr(), k2.data_ptr(), v2.data_ptr(), out.data_ptr(), lse.data_ptr(), 0, 0)


def test_out_overlap_is_checked_on_every_call(fast):
    q, k, v = qkv()
    out = torch.empty_like(q)
    entry = make_entry(q, k, v, out=out)
    remember(q, k, v, entry, out=out)
    assert cupy_gqa.attention(q, k, v, out=out) is out  # the repeat path, no overlap
    assert len(entry.launch.calls) == 1
    buf = torch.zeros(2 * q.numel(), dtype=q.dtype)
    q_in, out_over_q = buf[: q.numel()].view(q.shape), buf[: q.numel()].view(q.shape)  # same signature as before
    with pytest.raises(ValueError, match=r"out: must not overlap the memory of q"):
        cupy_gqa.attention(q_in, k, v, out=out_over_q)
    kbuf = torch.zeros(k.numel() + q.numel(), dtype=q.dtype)
    with pytest.raises(ValueError, match=r"out: must not overlap the memory of v"):
        cupy_gqa.attention(q, k, kbuf[: k.numel()].view(k.shape), out=kbuf[k.numel() - 64 :][: q.numel()].view(q.shape))
    assert len(entry.launch.calls) == 1  # nothing launched after a refusal


def test_host_seqlens_k_values_are_checked_on_every_call(fast):
    q, k, v = qkv()
    seen = []

    def host_lens(values):  # the full path's check (api._check_seqlens_k), then a device array
        checked = np.asarray(values)
        if (checked > 64).any():
            raise ValueError("seqlens_k: expected values in [0, 64]")
        seen.append(list(checked))
        return type("Dev", (), {"data": type("P", (), {"ptr": 4096})()})()

    entry = make_entry(q, k, v, host_lens=host_lens)
    remember(q, k, v, entry, seqlens_k=[64, 64])
    cupy_gqa.attention(q, k, v, seqlens_k=[10, 20])
    with pytest.raises(ValueError, match=r"seqlens_k: expected values in \[0, 64\]"):
        cupy_gqa.attention(q, k, v, seqlens_k=[10, 65])
    assert seen == [[10, 20]] and entry.launch.calls[0][6] == 4096


def test_device_seqlens_k_is_read_by_address(fast):
    q, k, v = qkv()
    entry = make_entry(q, k, v, lens_ext=8)
    fast._types[DeviceLens] = "cupy"  # CPU int32 tensors are host arrays: a device-like one
    remember(q, k, v, entry, seqlens_k=DeviceLens(512))
    cupy_gqa.attention(q, k, v, seqlens_k=DeviceLens(1024))
    assert entry.launch.calls[0][6] == 1024


class DeviceLens:
    """A CuPy-like int32 (2,) device array at a given address."""

    dtype, shape, strides = np.dtype(np.int32), (2,), (4,)

    def __init__(self, ptr):
        self.data = type("MemoryPointer", (), {"ptr": ptr, "device_id": 0})()


def test_workspace_overlap_and_alignment_on_every_call(fast):
    q, k, v = qkv()
    entry = make_entry(q, k, v, ws_bytes=256)
    ws = torch.empty(64)
    remember(q, k, v, entry, workspace=ws)
    cupy_gqa.attention(q, k, v, workspace=ws)
    assert entry.launch.calls[-1][7] == ws.data_ptr()
    big = torch.empty(200)
    with pytest.raises(ValueError, match=r"workspace: expected a 16-byte aligned address"):
        cupy_gqa.attention(q, k, v, workspace=big[1:65])
    qbuf = torch.zeros(q.numel() + 512, dtype=q.dtype)
    q_in = qbuf[: q.numel()].view(q.shape)
    over = qbuf.view(torch.float32)[: 64]  # same dtype, shape and strides as ws, inside q
    with pytest.raises(ValueError, match=r"workspace: must not overlap the memory of q"):
        cupy_gqa.attention(q_in, k, v, workspace=over)
    assert len(entry.launch.calls) == 1


def test_torch_workspace_comes_from_torch_when_not_given(fast):
    q, k, v = qkv()
    entry = make_entry(q, k, v, ws_bytes=1024)
    remember(q, k, v, entry)
    cupy_gqa.attention(q, k, v)
    assert entry.launch.calls[0][7] != 0


def test_cpu_calls_make_no_entries(monkeypatch):
    monkeypatch.setattr(_fast, "_entries", {})
    monkeypatch.setattr(_fast, "_types", {torch.Tensor: "torch"})
    q, k, v = qkv(d=8, dtype=torch.float32)
    ref = cupy_gqa.attention(q.numpy(), k.numpy(), v.numpy())
    for _ in range(2):
        out = cupy_gqa.attention(q, k, v)
        np.testing.assert_array_equal(out.numpy(), ref)
    assert _fast._entries == {}


def test_table_is_bounded(fast, monkeypatch):
    monkeypatch.setattr(_fast, "MAX_ENTRIES", 3)
    for i in range(7):
        _fast.remember(i, object())
        assert len(_fast._entries) <= 3


# --- packed launches ----------------------------------------------------------------------


def test_packed_launch_writes_addresses_and_fixed_values(monkeypatch):
    launched = []
    monkeypatch.setattr(_launch, "_driver_launch", lambda *args: launched.append((args, packed.values())))
    _launch._bound.__dict__[5] = True  # device 5's context counts as bound in this thread
    params = _plan.make_params(_plan.Problem(2, 1, 64, 8, 2, 64, "float16", True, 0.125), ((((2, 1, 8, 64), (1024, 1024, 128, 2), 2),) * 4))
    ns = np.int32(3).tobytes()
    packed = _launch.PackedLaunch(
        [
            (111, 40, 128, 5000, ("q", "k", "v", "out", "lse", "seqlens_k", params.tobytes(), "part_o", "part_lse", ns)),
            (222, 3, 128, 0, ("out", "lse", "seqlens_k", params.tobytes(), "part_o", "part_lse", ns)),
        ],
        device=5, part_lse_offset=4096,
    )  # fmt: skip
    packed(99, 1 << 40, 2 << 40, 3 << 40, 4 << 40, 0, 5 << 40, 6 << 40)
    assert [a[:9] for a, _ in launched] == [(111, 40, 1, 1, 128, 1, 1, 5000, 99), (222, 3, 1, 1, 128, 1, 1, 0, 99)]
    buf = launched[0][1]
    slots = struct.unpack_from("<8Q", buf)
    assert slots == (1 << 40, 2 << 40, 3 << 40, 4 << 40, 0, 5 << 40, 6 << 40, (6 << 40) + 4096)
    offsets = packed.arg_addresses(0)
    assert offsets[:6] == [0, 8, 16, 24, 32, 40] and offsets[7:9] == [48, 56]
    assert buf[offsets[6] : offsets[6] + params.nbytes] == params.tobytes()
    assert buf[offsets[9] : offsets[9] + 4] == ns
    combine = packed.arg_addresses(1)
    assert combine == [24, 32, 40, offsets[6], 48, 56, offsets[9]]  # shares the slots and the values
    packed(99, 1, 2, 3, 4, 5, 6)  # no workspace: null partial pointers
    assert struct.unpack_from("<8Q", launched[-1][1])[6:] == (0, 0)


def test_every_forward_plan_tells_the_repeat_path_how_to_launch():
    """The repeat-call entry keeps a plan's packed launch, or the plan's own
    launch where it adds per-call values (extra_args): every forward plan class
    (not only those a CPU test builds) answers both questions."""
    classes, todo = [], [_plan._PackedPerDevice]
    while todo:
        cls = todo.pop()
        classes.append(cls)
        todo.extend(cls.__subclasses__())
    assert {"Launch", "HopperLaunch", "DecodeLaunch"} <= {c.__name__ for c in classes}
    for cls in classes:
        assert isinstance(cls.extra_args, tuple), cls.__name__
        assert callable(cls.packed), cls.__name__
        if cls.extra_args:
            assert callable(getattr(cls, "launch", None)), cls.__name__


# --- per-sequence calls (block_table, cache_leftpad, attention_varlen) ------------------

SEQ_FLAGS = ("seq", bool, True, type(None), None, bool, False, "auto", "highest", "bshd")


class DeviceIndex(torch.Tensor):
    """A CPU tensor that says it lives on device 0: the signature treats it as a
    CUDA index array (read in place, by address)."""

    def get_device(self):
        return 0


def device_index(values):
    return torch.tensor(values, dtype=torch.int32).as_subclass(DeviceIndex)


def test_seq_signature_tells_index_arrays_apart(fast):
    fast._types[DeviceIndex] = "torch"
    q, k, v = qkv(batch=2, seqlen_k=16)
    table, lens = device_index([[0, 1], [2, 3]]), device_index([20, 7])
    index = (None, None, table, None)
    base, addrs = _fast.signature(q, k, v, None, lens, None, SEQ_FLAGS, index)
    assert addrs[6] == (0, 0, table.data_ptr(), 0) and addrs[4] == lens.data_ptr()
    same, _ = _fast.signature(q, k, v, None, device_index([1, 2]), None, SEQ_FLAGS,
                              (None, None, device_index([[5, 6], [7, 8]]), None))  # fmt: skip
    assert same == base  # other arrays, other values: the same signature
    variants = {
        "wider table": (None, None, device_index([[0, 1, 2], [3, 4, 5]]), None),
        "int64 table": (None, None, torch.tensor([[0, 1], [2, 3]]).as_subclass(DeviceIndex), None),
        "strided table": (None, None, device_index([[0, 9, 1, 9], [2, 9, 3, 9]])[:, ::2], None),
        "leftpad": (None, None, table, device_index([0, 1])),
    }
    for name, other in variants.items():
        assert _fast.signature(q, k, v, None, lens, None, SEQ_FLAGS, other)[0] != base, name
    assert _fast.signature(q, k, v, None, lens, None, SEQ_FLAGS, ())[0] != base  # a contiguous call
    for host in (np.array([[0, 1], [2, 3]], np.int32), [[0, 1], [2, 3]], torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)):
        assert _fast.signature(q, k, v, None, lens, None, SEQ_FLAGS, (None, None, host, None)) is None  # host: full path


def test_repeat_paged_call_launches_with_this_calls_index_addresses(fast):
    fast._types[DeviceIndex] = "torch"
    q, k, v = qkv(batch=2, seqlen_k=16)
    table, lens = device_index([[0, 1], [2, 3]]), device_index([20, 7])
    entry = make_entry(q, k, v, lens_ext=8)
    key, _ = _fast.signature(q, k, v, None, lens, None, SEQ_FLAGS, (None, None, table, None))
    _fast.remember(key, entry)
    table2, lens2 = device_index([[3, 2], [1, 0]]), device_index([1, 32])
    out = cupy_gqa.attention(q, k, v, block_table=table2, seqlens_k=lens2)
    assert out.shape == q.shape
    [(stream, qp, kp, vp, op, lsep, lp, wp)] = entry.launch.calls
    assert (stream, qp, kp, vp, op, lp) == (7, q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), lens2.data_ptr())
    assert entry.launch.seq == [(0, 0, table2.data_ptr(), 0)]
    # a host table takes the full path, which checks its values (k holds 2 pages)
    with pytest.raises(ValueError, match=r"block_table: expected page indices in \[0, 2\) \(num_pages\), got 5 at \[1, 1\]"):
        cupy_gqa.attention(q, k, v, block_table=[[0, 1], [1, 5]], seqlens_k=lens2)
    assert len(entry.launch.calls) == 1


def test_repeat_varlen_call_launches_with_this_calls_offsets(fast):
    fast._types[DeviceIndex] = "torch"
    q = torch.zeros(10, 8, 64, dtype=torch.float16)
    k = v = torch.zeros(12, 2, 64, dtype=torch.float16)
    flags = ("varlen", int, 6, int, 8, bool, True, type(None), None, bool, False, "auto", "highest")
    cu_q, cu_k = device_index([0, 4, 10]), device_index([0, 4, 12])
    entry = make_entry(q[None], k[None], v[None])
    entry.out_shape = tuple(q.shape)
    key, _ = _fast.signature(q, k, v, None, None, None, flags, (cu_q, cu_k, None, None))
    _fast.remember(key, entry)
    cu_q2, cu_k2 = device_index([0, 5, 10]), device_index([0, 5, 12])
    out = cupy_gqa.attention_varlen(q, k, v, cu_q2, cu_k2, 6, 8)
    assert out.shape == q.shape
    assert entry.launch.seq == [(cu_q2.data_ptr(), cu_k2.data_ptr(), 0, 0)]
    with pytest.raises(TypeError, match=r"expected a CUDA array"):  # another max_seqlen_k: the full path, which
        cupy_gqa.attention_varlen(q, k, v, cu_q2, cu_k2, 6, 9)  # looks at the stand-in's device
    assert len(entry.launch.calls) == 1


def test_packed_launch_seq_params_take_each_launchs_index_addresses(monkeypatch):
    """The SeqParams argument keeps the plan's fixed fields; its four addresses
    are the launch's when it gives them, else the plan's own (a full-path call
    of the plan after repeat calls with other arrays)."""
    from cupy_gqa import _seq

    launched = []
    monkeypatch.setattr(_launch, "_driver_launch", lambda *args: launched.append(packed.values()))
    _launch._bound.__dict__[5] = True
    seq = _seq.SeqLayout(flags=2, page_size=32, block_table_stride=9, block_table=0xAB00, cu_seqlens_q=0, leftpad=0xCD00)
    params = seq.params()
    packed = _launch.PackedLaunch([(111, 4, 128, 0, ("q", "k", "v", "out", "lse", "seqlens_k", b"x" * 8, _launch.SEQ))],
                                  device=5, seq_params=params)  # fmt: skip
    offset = packed.arg_addresses(0)[7]
    packed(1, 2, 3, 4, 5, 6, 7)
    assert launched[-1][offset : offset + 56] == params
    packed(1, 2, 3, 4, 5, 6, 7, seq=(0x10, 0x20, 0x30, 0x40))
    got = np.frombuffer(launched[-1][offset : offset + 56], _seq.SEQ_PARAMS_DTYPE)[0]
    assert (got["cu_seqlens_q"], got["cu_seqlens_k"], got["block_table"], got["leftpad"]) == (0x10, 0x20, 0x30, 0x40)
    assert (got["block_table_stride"], got["page_size"]) == (9, 32)
    packed(1, 2, 3, 4, 5, 6, 7)  # the plan's own addresses again
    assert launched[-1][offset : offset + 56] == params
