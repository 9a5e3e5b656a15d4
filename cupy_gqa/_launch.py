"""Kernel launches through the CUDA driver, with the arguments packed once.

A launch plan (``_plan``) fixes everything about its kernels' arguments except
the array addresses: the parameter struct, the number of key ranges, grid,
block and shared memory. :class:`PackedLaunch` writes those values once into
one host buffer, with an argument-pointer array per kernel pointing into it;
a launch then writes the nine address slots (q, k, v, out, lse, seqlens_k, the
two halves of the decode workspace and the hopper kernel's tile counter) with
one ``struct.pack_into`` and calls ``cuLaunchKernel`` for each kernel. The driver copies the argument
values when it enqueues the launch, so the buffer can be rewritten as soon as
the call returns; a lock keeps two threads from writing it at once.

CuPy's ``RawKernel.__call__`` does the same work at every launch: it wraps
each argument (an ndarray becomes a CArray with its shape and strides, a
scalar a CScalar, a NumPy struct a CNumpyArray) and looks the kernel up by
device. Nothing here allocates device memory, synchronises or compiles, so a
launch can be captured into a CUDA graph.
"""
from __future__ import annotations

import ctypes
import struct
import threading

import numpy as np

# The address slots, in the order they are packed.
SLOTS = ("q", "k", "v", "out", "lse", "seqlens_k", "part_o", "part_lse", "counter")
_ADDRESSES = struct.Struct(f"<{len(SLOTS)}Q")
# Values of BLOB_BYTES written at each launch after the addresses: the hopper
# kernel's tensor maps of K, V, Q and out (_tma.py), which hold the arrays' addresses.
BLOBS = ("k_map", "v_map", "q_map", "o_map")
BLOB_BYTES = 128
# The per-sequence kernels' SeqParams argument (kernels/common.cuh, _seq.SEQ_PARAMS_DTYPE),
# passed by value from its own place in the buffer: its four index-array addresses
# (cu_seqlens_q, cu_seqlens_k, block_table, leftpad) lead it and are written at each
# launch (the launch's, else the plan's own); the rest is the plan's.
SEQ = "seq"
SEQ_BYTES = 56
_SEQ_ADDRESSES = struct.Struct("<4Q")
_SEQ_OFFSET = _ADDRESSES.size + len(BLOBS) * BLOB_BYTES

# cupy.cuda.driver.launchKernel, bound at the first PackedLaunch: cuLaunchKernel(function,
# grid x, y, z, block x, y, z, shared memory, stream, argument pointers, extra)
_driver_launch = None


# A kernel launched as a programmatic dependent of the one before it on its stream
# (sm_90: its CTAs may start while the first kernel's run; it waits for that
# kernel's results with griddepcontrol.wait): cuLaunchKernelEx, which CuPy does not
# wrap, through ctypes, with its configuration (cuda.h: CUlaunchConfig,
# CUlaunchAttribute) built once per kernel and only the stream written per launch.
class _LaunchAttribute(ctypes.Structure):
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int * 16)]


class _LaunchConfig(ctypes.Structure):
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("shared_mem", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(_LaunchAttribute)), ("num_attrs", ctypes.c_uint)]


PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION


def dependent_config(grid_x: int, threads: int, smem: int) -> _LaunchConfig:
    """The cuLaunchKernelEx configuration of a programmatic dependent launch (stream 0 until set)."""
    attr = _LaunchAttribute(id=PROGRAMMATIC_STREAM_SERIALIZATION)
    attr.value[0] = 1  # programmaticStreamSerializationAllowed
    config = _LaunchConfig(grid=(grid_x, 1, 1), block=(threads, 1, 1), shared_mem=smem, num_attrs=1)
    config.attrs = ctypes.pointer(attr)
    config._attr = attr  # kept alive with the configuration
    return config


_cu_launch_kernel_ex = None


def _launch_dependent(config: _LaunchConfig, function: int, stream: int, argv: int) -> None:
    """cuLaunchKernelEx(config on ``stream``, function, argument pointers); raises CuPy's driver error."""
    global _cu_launch_kernel_ex
    if _cu_launch_kernel_ex is None:
        fn = ctypes.CDLL("libcuda.so.1").cuLaunchKernelEx  # the driver CuPy runs on
        fn.argtypes = (ctypes.POINTER(_LaunchConfig), ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p)
        fn.restype = ctypes.c_int
        _cu_launch_kernel_ex = fn
    config.stream = stream
    status = _cu_launch_kernel_ex(ctypes.byref(config), function, argv, None)
    if status:
        from cupy_backends.cuda.api.driver import CUDADriverError

        raise CUDADriverError(status)


# what launches a programmatic dependent (tests replace it as they do _driver_launch)
_driver_launch_dependent = _launch_dependent


_bound = threading.local()  # attributes: the devices whose context this thread has bound


def _bind_context(device: int) -> None:
    """Bind ``device``'s primary context to this thread, once per thread: the
    driver launches in the thread's current context, which a thread that has
    used no runtime call yet lacks (cudaSetDevice binds it; it is no stream
    operation, so it is legal during a capture too)."""
    from cupy.cuda import runtime

    runtime.setDevice(device)
    _bound.__dict__[device] = True


class PackedLaunch:
    """One or more kernels launched back to back with pre-packed arguments.

    ``kernels``: (function handle, grid_x, threads, shared_mem, args[, dependent])
    for each kernel, in launch order, where each arg is a slot name (an address
    written at each launch) or ``bytes`` (a value fixed for the plan, passed by
    value); ``dependent``: launched as a programmatic dependent of the kernel
    before it (sm_90; the kernel waits with griddepcontrol.wait).
    ``device``: the CUDA device whose context holds the functions.
    ``keep``: objects that own the function handles (their modules stay loaded).
    ``part_lse_offset``: bytes from the workspace's start to its second slot
    (the decode kernels' partial lse). ``seq_params``: the SeqParams value of an
    argument named ``SEQ`` (a per-sequence kernel's), its addresses the plan's.
    """

    def __init__(self, kernels, device: int, keep=(), part_lse_offset: int = 0, seq_params: bytes = b""):
        global _driver_launch
        if _driver_launch is None:
            from cupy.cuda import driver

            _driver_launch = driver.launchKernel
        offsets: dict[bytes, int] = {}
        size = _SEQ_OFFSET + SEQ_BYTES
        assert len(seq_params) in (0, SEQ_BYTES), len(seq_params)
        for kernel in kernels:
            for arg in kernel[4]:
                if isinstance(arg, bytes) and arg not in offsets:
                    offsets[arg] = size
                    size += -(-len(arg) // 8) * 8  # every value 8-byte aligned
        self._buffer = np.zeros(size // 8, np.uint64)
        raw = self._buffer.view(np.uint8)
        for value, offset in offsets.items():
            raw[offset : offset + len(value)] = np.frombuffer(value, np.uint8)
        if seq_params:
            raw[_SEQ_OFFSET : _SEQ_OFFSET + SEQ_BYTES] = np.frombuffer(seq_params, np.uint8)
        self._seq = _SEQ_ADDRESSES.unpack_from(seq_params) if seq_params else ()  # the plan's own addresses
        base = self._buffer.ctypes.data
        self._argvs = []  # kept alive: the driver reads them at each launch
        self._calls = []
        for function, grid_x, threads, smem, args, *dependent in kernels:
            argv = np.array([base + (self._slot_offset(a) if isinstance(a, str) else offsets[a]) for a in args], np.uint64)
            self._argvs.append(argv)
            config = dependent_config(int(grid_x), int(threads), int(smem)) if dependent and dependent[0] else None
            self._calls.append((int(function), int(grid_x), int(threads), int(smem), argv.ctypes.data, config))
        self.device = device
        self._keep = tuple(keep)
        self._part_lse_offset = part_lse_offset
        self._lock = threading.Lock()
        self._bytes = memoryview(self._buffer).cast("B")

    @staticmethod
    def _slot_offset(name: str) -> int:
        if name in BLOBS:
            return _ADDRESSES.size + BLOBS.index(name) * BLOB_BYTES
        if name == SEQ:
            return _SEQ_OFFSET
        return SLOTS.index(name) * 8

    def __call__(self, stream: int, q: int, k: int, v: int, out: int, lse: int, seqlens_k: int, workspace: int = 0,
                 blobs: tuple = (), seq: tuple = (), counter: int = 0, grid_x: int = 0) -> None:
        """Launch every kernel on ``stream`` (a cudaStream_t) with these addresses
        (0 for a null pointer), ``blobs`` (BLOBS' values, in order), ``seq``
        (SeqParams' four index-array addresses; none: the plan's own) and
        ``counter``; ``grid_x``: the grid of a one-kernel launch, if not the
        packed one. The current device must be ``device``."""
        if self.device not in _bound.__dict__:
            _bind_context(self.device)
        part_lse = workspace + self._part_lse_offset if workspace else 0
        with self._lock:
            _ADDRESSES.pack_into(self._buffer, 0, q, k, v, out, lse, seqlens_k, workspace, part_lse, counter)
            for i, blob in enumerate(blobs):
                start = _ADDRESSES.size + i * BLOB_BYTES
                self._bytes[start : start + BLOB_BYTES] = blob
            if self._seq:
                _SEQ_ADDRESSES.pack_into(self._buffer, _SEQ_OFFSET, *(seq or self._seq))
            for function, grid, threads, smem, argv, config in self._calls:
                if config is None:
                    _driver_launch(function, grid_x or grid, 1, 1, threads, 1, 1, smem, stream, argv, 0)
                else:
                    _driver_launch_dependent(config, function, stream, argv)

    def values(self) -> bytes:
        """The argument buffer as it stands (tests)."""
        return self._buffer.tobytes()

    def arg_addresses(self, kernel: int = 0) -> list[int]:
        """Offsets into the buffer of kernel ``kernel``'s arguments (tests)."""
        base = self._buffer.ctypes.data
        return [int(a) - base for a in self._argvs[kernel]]
