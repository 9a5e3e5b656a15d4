"""Array frameworks in and out: CuPy, PyTorch, NumPy and any CUDA ``__dlpack__`` producer.

Every input is turned into a *backend array* without copying: a ``cupy.ndarray``
(CUDA inputs, through DLPack for torch and others) or a ``numpy.ndarray`` (CPU
inputs). Results are allocated in the caller's framework and viewed the same
way, so the kernels always write straight into the array that is returned.

torch is never imported here: a torch tensor is recognised by its type's
module, and ``sys.modules['torch']`` is used once the caller has passed one.
"""
from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass

import numpy as np

_DLPACK_CUDA = 2  # kDLCUDA in the DLPack device enum


def _kind(x) -> str:
    if isinstance(x, np.ndarray):
        return "numpy"
    module = type(x).__module__
    if module.startswith("cupy"):
        return "cupy"
    if module.startswith("torch"):
        return "torch"
    if hasattr(x, "__dlpack__") and hasattr(x, "__dlpack_device__"):
        return "dlpack"
    return "unknown"


_DTYPE_NAMES: dict = {}  # dtype object (numpy, ml_dtypes or torch) -> name; dtype.name is slow


def dtype_name(x) -> str:
    """The dtype of any supported array as a NumPy-style name ('bfloat16' for bf16)."""
    dt = x.dtype
    name = _DTYPE_NAMES.get(dt)
    if name is None:
        name = str(dt).removeprefix("torch.") if _kind(x) == "torch" else getattr(dt, "name", str(dt))
        _DTYPE_NAMES[dt] = name
    return name


@dataclass(frozen=True)
class Frame:
    """Where a call runs: the framework it came from and the device it is on."""

    kind: str  # "numpy", "cupy", "torch" or "dlpack" (the caller's framework)
    device: int | None  # CUDA device index, None for the CPU

    @property
    def on_gpu(self) -> bool:
        return self.device is not None


def _device_of(x, kind: str, name: str) -> int | None:
    """The CUDA device of argument ``name`` (None: host memory); a TypeError naming
    it for memory the kernels can't read."""
    if kind == "numpy":
        return None
    if kind == "cupy":
        return x.device.id
    if kind == "torch":
        if x.device.type == "cpu":
            return None
        if x.device.type != "cuda":
            raise TypeError(f"{name}: expected a CUDA or CPU torch tensor, got one on device {x.device}")
        return x.device.index
    dev_type, dev_id = x.__dlpack_device__()
    if int(dev_type) != _DLPACK_CUDA:
        raise TypeError(
            f"{name}: expected a CUDA array (DLPack device type {_DLPACK_CUDA}), got DLPack device type {int(dev_type)}; "
            "pass CPU data as a NumPy array"
        )
    return int(dev_id)


def frame_of(arrays: dict) -> Frame:
    """Check that all named arrays share one framework and one device."""
    first_name, first = next(iter(arrays.items()))
    kind = _kind(first)
    if kind == "unknown":
        raise TypeError(
            f"{first_name}: expected a cupy.ndarray, torch.Tensor, numpy.ndarray or CUDA __dlpack__ array, "
            f"got {type(first).__module__}.{type(first).__qualname__}"
        )
    device = _device_of(first, kind, first_name)
    for name, x in arrays.items():
        if _kind(x) != kind:
            raise TypeError(
                f"{name}: expected the same framework as {first_name} ({type(first).__qualname__} from {kind}), "
                f"got {type(x).__module__}.{type(x).__qualname__}"
            )
        dev = _device_of(x, kind, name)
        if dev != device:
            where = lambda d: "cpu" if d is None else f"cuda:{d}"  # noqa: E731
            raise ValueError(f"{name}: expected device {where(device)} (that of {first_name}), got {where(dev)}")
    return Frame(kind, device)


@contextlib.contextmanager
def running_on(frame: Frame):
    """Make the call's device current and, for torch, make torch's current stream CuPy's.

    Inside, CuPy launches and allocations go where the caller's framework expects:
    CuPy's current stream for CuPy and DLPack inputs, torch's current stream of
    that device for torch tensors. No synchronisation happens.
    """
    if not frame.on_gpu:
        yield
        return
    import cupy

    with cupy.cuda.Device(frame.device):
        if frame.kind == "torch":
            torch_stream = sys.modules["torch"].cuda.current_stream(frame.device)
            if hasattr(torch_stream, "__cuda_stream__"):
                stream = cupy.cuda.Stream.from_external(torch_stream)
            else:  # torch without the CUDA stream protocol
                stream = cupy.cuda.ExternalStream(torch_stream.cuda_stream, frame.device)
            with stream:
                yield
        else:
            yield


def to_backend(x, frame: Frame):
    """A zero-copy view of ``x`` as a cupy.ndarray (GPU) or numpy.ndarray (CPU)."""
    if frame.kind in ("numpy", "cupy"):
        return x
    if frame.kind == "torch" and x.requires_grad:
        x = x.detach()  # the kernels read and write the data; autograd is cupy_gqa._torch's
    if frame.on_gpu:
        import cupy

        if frame.kind == "torch":
            # torch's own exporter: a DLPack capsule without __dlpack__'s stream
            # handshake, which costs tens of microseconds a tensor. None is
            # needed: inside running_on() CuPy's stream is torch's current one.
            return cupy.from_dlpack(sys.modules["torch"].utils.dlpack.to_dlpack(x))
        return cupy.from_dlpack(x)  # inside running_on(): CuPy's current stream
    # a CPU torch tensor; numpy has no bfloat16, so view its bits through ml_dtypes
    if x.dtype == sys.modules["torch"].bfloat16:
        import ml_dtypes

        return x.view(sys.modules["torch"].int16).numpy().view(ml_dtypes.bfloat16)
    return x.numpy()


def cuda_view(a, device: int):
    """A zero-copy cupy.ndarray of a CUDA array the caller passes beside q (an
    index, length or modifier array: torch, CuPy or any DLPack exporter)."""
    import cupy

    if _kind(a) == "torch":
        return to_backend(a, Frame("torch", device))
    return a if isinstance(a, cupy.ndarray) else cupy.from_dlpack(a)


def host_to_device(name: str, a: np.ndarray, dtype):
    """A host array copied to the current device as ``dtype``, on the current
    stream (CuPy stages it in pinned memory); refused while a CUDA graph is being
    captured, where the copy would be captured with this call's values and every
    replay would reuse them."""
    import cupy

    if cupy.cuda.get_current_stream().is_capturing():
        raise ValueError(
            f"{name}: expected a CUDA {np.dtype(dtype).name} array while a CUDA graph is being captured "
            f"(a host array is copied at each call, and the graph would replay this call's values), got a host array"
        )
    return cupy.asarray(a.astype(dtype, copy=False))


def checked_backend(name: str, checked, frame: Frame, dtype):
    """A checked side array, ``None`` or ``(where, array)`` with ``where`` "host" or
    "device", as the backend reads it: ``(array, in_place)``. On the CPU the host
    array; on the GPU a host array copied to the current device as ``dtype``, or a
    zero-copy view of a device one (``in_place``: the caller checks its strides)."""
    if checked is None:
        return None, False
    where, a = checked
    if not frame.on_gpu:
        return a, False
    if where == "host":
        return host_to_device(name, a, dtype), False
    return cuda_view(a, frame.device), True


def empty(shape, dtype_like, frame: Frame, *, float32: bool = False):
    """A new array in the caller's framework: (framework object, backend view)."""
    if frame.kind == "torch":
        torch = sys.modules["torch"]
        dtype = torch.float32 if float32 else dtype_like.dtype
        device = torch.device("cpu") if not frame.on_gpu else torch.device("cuda", frame.device)
        t = torch.empty(shape, dtype=dtype, device=device)
        return t, to_backend(t, frame)
    dtype = np.float32 if float32 else dtype_like.dtype
    if frame.on_gpu:
        import cupy

        a = cupy.empty(shape, dtype=dtype)
    else:
        a = np.empty(shape, dtype=dtype)
    return a, a


def data_ptr(a) -> int:
    """Address of element 0 of a backend array."""
    return a.data.ptr if not isinstance(a, np.ndarray) else a.__array_interface__["data"][0]


def byte_span(a) -> tuple[int, int]:
    """[low, high) byte addresses touched by a backend array with non-negative strides."""
    if a.size == 0:
        return (0, 0)
    low = data_ptr(a)
    high = low + sum((n - 1) * s for n, s in zip(a.shape, a.strides)) + a.itemsize
    return (low, high)
