"""The tensor-map geometry of the hopper kernel's bulk copies (cupy_gqa/_tma.py),
on the CPU: what the driver's encoder is given for each layout."""
import pytest

from cupy_gqa import _tma


def test_geometry_of_a_bshd_array():
    # (batch 2, seqlen 300, heads 4, head_dim 80) bf16, contiguous
    shape, strides = (2, 300, 4, 80), (300 * 4 * 80 * 2, 4 * 80 * 2, 80 * 2, 2)
    dims, byte_strides, box = _tma.map_geometry(shape, strides, 2, 96)
    assert dims == (80, 300, 4, 2)  # innermost first: head_dim, keys, heads, batch
    assert byte_strides == (4 * 80 * 2, 80 * 2, 300 * 4 * 80 * 2)
    assert box == (64, 96, 1, 1)  # 64 columns = 128 bytes, one swizzle row


def test_geometry_of_a_bhsd_view_and_unit_extents():
    # a (batch, heads, seqlen, head_dim) array seen as bshd: seq stride < head stride
    shape, strides = (1, 50, 8, 128), (8 * 50 * 256, 256, 50 * 256, 2)
    dims, byte_strides, _ = _tma.map_geometry(shape, strides, 2, 128)
    assert dims == (128, 50, 8, 1) and byte_strides == (256, 50 * 256, 16)  # batch 1: never stepped


@pytest.mark.parametrize(
    "shape,strides,ok",
    [
        ((2, 10, 4, 64), (10 * 4 * 128, 4 * 128, 128, 2), True),
        ((2, 10, 4, 64), (10 * 4 * 128, 4 * 128, 0, 2), False),  # heads broadcast: stride 0
        ((1, 10, 1, 64), (0, 128, 0, 2), True),  # stride 0 on extents of 1 is never stepped
        ((2, 10, 4, 64), (2**40, 4 * 128, 128, 2), False),
    ],
)
def test_geometry_issue(shape, strides, ok):
    issue = _tma.geometry_issue(shape, strides)
    assert (issue is None) == ok
    if not ok:
        assert str(strides) in issue and "2**40" in issue


def test_packed_geometry_boxes_whole_positions_of_a_group():
    # q (batch 3, seqlen 70, heads 16, head_dim 96) bf16 seen as (head_dim, heads, seqlen, batch):
    # a box of group 4 heads by 32 positions is 128 packed rows, t * 4 + g in box order
    shape, strides = (3, 70, 16, 96), (70 * 16 * 192, 16 * 192, 192, 2)
    dims, byte_strides, box = _tma.packed_geometry(shape, strides, 2, 4, 32)
    assert dims == (96, 16, 70, 3)
    assert byte_strides == (192, 16 * 192, 70 * 16 * 192)
    assert box == (64, 4, 32, 1)
    # a bhsd view, one head per group (MHA): positions are the rows
    shape, strides = (1, 50, 8, 128), (8 * 50 * 256, 256, 50 * 256, 2)
    dims, byte_strides, box = _tma.packed_geometry(shape, strides, 2, 1, 64)
    assert dims == (128, 8, 50, 1) and byte_strides == (50 * 256, 256, 16) and box == (64, 1, 64, 1)


def test_map_encoder_builds_the_drivers_arguments_once(monkeypatch):
    """MapEncoder hands the driver the geometry's dims, byte strides and box,
    the call's address, and a 64-byte aligned map buffer (the driver's rule);
    each call returns that map's bytes, and a failure names the array."""
    import ctypes

    calls = []
    proto = ctypes.CFUNCTYPE(
        ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p, ctypes.POINTER(ctypes.c_uint64),
        ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_uint32), ctypes.POINTER(ctypes.c_uint32),
        ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int,
    )  # fmt: skip

    def encode(out, dtype, rank, ptr, dims, strides, box, element_strides, *enums):
        calls.append((out % 64, dtype, rank, ptr, tuple(dims[:4]), tuple(strides[:3]), tuple(box[:4]), enums))
        ctypes.memmove(out, (ptr or 0).to_bytes(8, "little") * 16, 128)  # a map that names its address
        return 0 if ptr != 0xBAD0 else 1

    fn = proto(encode)
    monkeypatch.setattr(_tma, "_encoder", lambda: fn)
    shape, strides = (2, 300, 4, 80), (300 * 4 * 80 * 2, 4 * 80 * 2, 80 * 2, 2)
    encoder = _tma.MapEncoder(shape, strides, _tma.map_geometry(shape, strides, 2, 96))
    first, second = encoder(0x10000), encoder(0x20000)
    assert first == (0x10000).to_bytes(8, "little") * 16 and second == (0x20000).to_bytes(8, "little") * 16
    dims, byte_strides, box = _tma.map_geometry(shape, strides, 2, 96)
    assert calls[0] == (0, 1, 4, 0x10000, dims, byte_strides, box, (0, 3, 3, 0)) and calls[1][3] == 0x20000
    with pytest.raises(RuntimeError, match=r"CUresult 1 for an array at 0xbad0 of shape \(2, 300, 4, 80\)"):
        encoder(0xBAD0)
