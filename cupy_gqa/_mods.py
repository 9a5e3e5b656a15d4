"""Score and mask modifiers: their checks, their kernel parameters, and the
user-written ones (:class:`ScoreMod`, :class:`MaskMod`).

The rules themselves are written once per side: ``kernels/common.cuh``
(namespace ``mods``) and ``kernels/softmax.cuh`` (``fold_sink``,
``frag_mods``) for the kernels, ``cpu.py`` for the NumPy backend, and
``tests/reference.py`` is the float64 definition. With ``x = softmax_scale *
q . k`` (natural units), b the batch, h the query head, t the query position,
j the key and ``diag = seqlen_k - seqlen_q`` (the sequence's own length with
seqlens_k):

- ``softcap``: ``x = softcap * tanh(x / softcap)``;
- ``alibi_slopes``: ``x = x - slope[b, h] * |t + diag - j|``;
- ``score_mod``: ``x = score_mod(x, b, h, t, j)``, in this order (with a unit
  u: ``x = u * score_mod(x / u, b, h, t, j)``); then
- ``window=(left, right)``: key j is seen only within ``[t + diag - left,
  t + diag + right]`` (-1: unbounded on that side; causal caps right at 0),
  and ``mask_mod`` may mask more keys;
- ``sinks``: ``exp(sinks[h] - m)`` joins each row's softmax denominator (and
  lse) and adds no value.

A kernel with modifiers is its own instantiation (``*_mods<..., FLAGS>``,
FLAGS a bit set of the modifiers present), which takes a ModParams struct
after the AttnParams; the kernels without modifiers are unchanged.
"""
from __future__ import annotations

import keyword
import math
import numbers
import re
from dataclasses import dataclass

import numpy as np

MOD_WINDOW, MOD_SOFTCAP, MOD_ALIBI, MOD_SINKS, MOD_SCORE, MOD_MASK = 1, 2, 4, 8, 16, 32
# (set by the plan, not by a call's arguments) one exp2 reference for every row: Modifiers.fixed_ref
MOD_FIXED_REF = 64
MOD_SCORE_UNIT = 128  # the score_mod has a unit (ScoreMod.unit)
# (set by _compile.get_kernel) hopper's softmax waits for P V: a score_mod in units whose code
# did not fit the registers beside it
MOD_SERIAL_PV = 256
MAX_BUFFERS = 6  # ModParams::buffers, for score_mod's and mask_mod's together
LOG2E = 1.4426950408889634
# The widest range of the modified scores, in log2 units, that takes one reference for
# every row: with the reference at its middle, each P of a seen key lies in [2^-80, 2^80],
# normal floats whose row sums and products with V stay far from float32's limits.
FIXED_REF_SPAN_LOG2 = 160.0

# kernels/common.cuh: ModParams, field by field.
MOD_PARAMS_DTYPE = np.dtype(
    [
        ("sinks", np.uint64), ("alibi", np.uint64), ("buffers", np.uint64, MAX_BUFFERS),
        ("alibi_batch_stride", np.int64), ("softcap", np.float64), ("window_left", np.int32), ("window_right", np.int32),
        ("fixed_ref", np.float32), ("score_unit", np.float64),
    ],
    align=True,
)  # fmt: skip
assert MOD_PARAMS_DTYPE.itemsize == 104

# C type of a user buffer's elements, by dtype
_BUFFER_CTYPES = {
    "float32": "float", "float64": "double", "int32": "int", "int64": "long long", "uint8": "unsigned char",
    "bool": "bool",
}  # fmt: skip
# The names a user modifier's code sees (the kernels' arguments of user_score_mod / user_mask_mod).
SCORE_INPUTS = ("score", "b", "h", "q_idx", "kv_idx", "seqlen_q", "seqlen_k")
MASK_INPUTS = SCORE_INPUTS[1:]
_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class _UserMod:
    """The common part of ScoreMod and MaskMod (see there)."""

    kind = ""  # "score_mod" or "mask_mod"
    inputs: tuple = ()

    def __init__(self, cuda: str, numpy=None, buffers=None):
        if not isinstance(cuda, str) or not cuda.strip():
            raise TypeError(f"{self.kind}: expected cuda= a non-empty string of CUDA code, got {type(cuda).__name__}")
        if numpy is not None and not callable(numpy):
            raise TypeError(f"{self.kind}: expected numpy= a function or None, got {type(numpy).__name__}")
        buffers = {} if buffers is None else buffers
        if not isinstance(buffers, dict):
            raise TypeError(f"{self.kind}: expected buffers= a dict of name -> array, got {type(buffers).__name__}")
        if len(buffers) > MAX_BUFFERS:
            raise ValueError(f"{self.kind}: expected at most {MAX_BUFFERS} buffers, got {len(buffers)}")
        from . import _interop

        self.cuda = cuda
        self.numpy = numpy
        self.buffers = {}
        for name, array in buffers.items():
            if not isinstance(name, str) or not _IDENT.match(name) or keyword.iskeyword(name) or name in SCORE_INPUTS or name.endswith("_"):
                raise ValueError(
                    f"{self.kind}: buffer names must be identifiers other than {SCORE_INPUTS} (and not ending in _), got {name!r}"
                )
            if isinstance(array, (list, tuple, numbers.Number)):
                array = np.asarray(array)
            dtype = _interop.dtype_name(array)
            if dtype not in _BUFFER_CTYPES:
                raise TypeError(f"{self.kind}: buffer {name!r}: expected dtype in {tuple(_BUFFER_CTYPES)}, got {dtype}")
            self.buffers[name] = array
        self._device_buffers: dict = {}  # device -> tuple of CuPy arrays (kept alive)
        self.check()

    def __repr__(self):
        return f"cupy_gqa.{type(self).__name__}(cuda={self.cuda!r}, buffers={sorted(self.buffers)})"

    # --- CUDA ------------------------------------------------------------------
    def _signature(self) -> str:
        raise NotImplementedError

    def definition(self, first_buffer: int) -> str:
        """The CUDA definition of user_score_mod / user_mask_mod, its buffers read
        from ModParams::buffers[first_buffer ...], the user's lines numbered from 1
        in the file named after the kind (NVRTC's messages say e.g. ``score_mod(2)``)."""
        lines = [f"#define CUPY_GQA_USER_{self.kind.upper()} 1", self._signature() + " {"]
        for i, (name, array) in enumerate(self.buffers.items()):
            from . import _interop

            ctype = _BUFFER_CTYPES[_interop.dtype_name(array)]
            lines.append(f"    const {ctype}* __restrict__ {name} = static_cast<const {ctype}*>(mod_params_.buffers[{first_buffer + i}]);")
        lines.append(f'#line 1 "{self.kind}"')
        lines.append(self.cuda)
        lines.append("}")
        return "\n".join(lines)

    def check(self) -> None:
        """Compile the code alone with NVRTC (when CuPy is installed): a ValueError
        shows NVRTC's message, with the lines numbered as in ``cuda``."""
        try:
            from cupy.cuda import nvrtc
        except Exception:  # no CuPy: nothing to compile with, and no GPU to run on
            return
        from . import _compile

        program = _compile.user_mods_check_program(self)
        prog = nvrtc.createProgram(program, "check.cu", [], [])
        try:
            try:
                nvrtc.compileProgram(prog, list(_compile.compile_options(None)))
            except nvrtc.NVRTCError:
                raise ValueError(self.compile_message(nvrtc.getProgramLog(prog))) from None
        finally:
            nvrtc.destroyProgram(prog)

    def compile_message(self, log: str) -> str:
        own = [line for line in log.splitlines() if line.startswith(f"{self.kind}(")]
        shown = "\n".join(own or log.strip().splitlines()[-20:])
        return f"{self.kind}: NVRTC could not compile the code (its lines are numbered from 1):\n{shown}"

    def device_buffers(self, device: int) -> tuple:
        """The buffers as CuPy arrays on ``device`` (CUDA arrays in place, host ones copied once)."""
        if not self.buffers:
            return ()
        found = self._device_buffers.get(device)
        if found is None:
            import cupy

            from . import _interop

            arrays = []
            with cupy.cuda.Device(device):
                for name, a in self.buffers.items():
                    kind = _interop._kind(a)
                    on_gpu = kind == "cupy" or (kind == "torch" and a.device.type == "cuda")
                    if on_gpu:
                        dev = _interop._device_of(a, kind, f"{self.kind}: buffer {name!r}")
                        b = _interop.to_backend(a, _interop.Frame(kind, dev))
                        if b.device.id != device:
                            raise ValueError(f"{self.kind}: buffer {name!r} is on cuda:{b.device.id}, the call on cuda:{device}")
                        if not b.flags.c_contiguous:
                            raise ValueError(f"{self.kind}: buffer {name!r}: expected a contiguous array")
                    else:
                        b = cupy.asarray(self.host_buffer(name))
                    arrays.append(b)
            found = self._device_buffers[device] = tuple(arrays)
        return found

    def host_buffer(self, name: str) -> np.ndarray:
        a = self.buffers[name]
        from . import _interop

        kind = _interop._kind(a)
        if kind == "torch":
            return a.detach().cpu().numpy()
        if kind == "cupy":
            return a.get()
        return np.ascontiguousarray(np.asarray(a))

    def numpy_function(self):
        if self.numpy is None:
            raise ValueError(
                f"{self.kind}: has no numpy= function, which the NumPy backend (CPU inputs) runs in place of the CUDA code"
            )
        return self.numpy

    def host_buffers(self) -> dict:
        return {name: self.host_buffer(name) for name in self.buffers}


class ScoreMod(_UserMod):
    """A user-written score modifier: CUDA code compiled into the kernels, and its NumPy twin.

    ``cuda``: the body of a device function that returns the new score, over
    ``score`` (the scaled score softmax_scale * q . k, after softcap and ALiBi;
    ``float``, ``double`` for float64 inputs: write ``tanh``, ``exp``, ... so
    that both work; ``fast_tanh(float)``, the hardware tanh that the built-in
    softcap uses for fp16 and bf16 inputs, is there too), ``b``, ``h`` (query head), ``q_idx``, ``kv_idx``,
    ``seqlen_q``, ``seqlen_k`` (the sequence's valid keys) and each buffer by
    its name (a ``const float*`` for float32, ``const int*`` for int32, ...).
    ``numpy``: the same function in NumPy, called with those names as keywords
    (``score`` an array; ``h``, ``q_idx``, ``kv_idx`` integer arrays that
    broadcast against it; buffers as NumPy arrays); the NumPy backend runs it.
    ``buffers``: name -> array (NumPy, CuPy or torch; float32, float64, int32,
    int64, uint8 or bool), at most 6 for score_mod and mask_mod together.
    Read in place when on the GPU, else copied to each device once.

    ``bounds``: ``(low, high)``, finite, or None: the range of the new scores.
    The scores are clamped to it (a NaN stays NaN), on every backend; with
    bf16 inputs on Hopper a range of at most 110 natural units (a softcap up
    to 55) lets the kernel take one reference for every row's exponentials
    instead of its running maxima, as the built-in softcap does (faster, and
    the same bits as the built-in for the same function).

    ``unit``: a number u > 0, or None. With a unit the function reads and
    returns scores counted in units of u: ``score`` is softmax_scale * q . k / u
    and the new score is u times the result (``bounds`` in units of u too). Where
    it is the one score modifier, the tensor-core prefill kernels (tiled, hopper)
    then scale the raw product to units and apply u inside their exponential, one
    multiply a score where natural units take three: the built-in softcap is this
    rule with ``fast_tanh`` and u = softcap, and its spelling below gives the
    built-in's very bits on every kernel.

    Example, softcap 30::

        ScoreMod(cuda="return tanh(score);", numpy=lambda score, **_: np.tanh(score),
                 unit=30.0, bounds=(-1, 1))

    (``fast_tanh(score)`` for fp16 and bf16 inputs, as the built-in computes
    it there; ``cap * tanh(score / cap)`` without a unit is the same function,
    three multiplies a score, and rounds differently.)

    The code is compiled (NVRTC) once per kernel it runs in and cached by its
    text; code NVRTC rejects raises ValueError here, with NVRTC's message
    numbered by the lines of ``cuda``."""

    kind = "score_mod"
    inputs = SCORE_INPUTS
    _ARGS = "A score, int b, int h, int q_idx, int kv_idx, int seqlen_q, int seqlen_k, const ModParams& mod_params_"

    def __init__(self, cuda: str, numpy=None, buffers=None, bounds=None, unit=None):
        self.bounds = check_bounds(bounds)
        self.unit = check_unit(unit)
        super().__init__(cuda, numpy, buffers)

    def __repr__(self):
        bounds = "" if self.bounds is None else f", bounds={self.bounds}"
        unit = "" if self.unit is None else f", unit={self.unit}"
        return f"cupy_gqa.ScoreMod(cuda={self.cuda!r}, buffers={sorted(self.buffers)}{bounds}{unit})"

    def natural_bounds(self) -> tuple | None:
        """The range of the new scores in natural units (bounds times the unit)."""
        if self.bounds is None or self.unit is None:
            return self.bounds
        return self.bounds[0] * self.unit, self.bounds[1] * self.unit

    def _signature(self) -> str:
        name = "user_score_mod" if self.bounds is None else "user_score_mod_unbounded"
        return f"template <typename A>\n__device__ __forceinline__ A {name}({self._ARGS})"

    def definition(self, first_buffer: int) -> str:
        text = super().definition(first_buffer)
        if self.bounds is None:
            return text
        low, high = (float.hex(x) for x in self.bounds)  # exact in the code's double literals
        return (
            f"{text}\ntemplate <typename A>\n__device__ __forceinline__ A user_score_mod({self._ARGS}) {{\n"
            "    const A x = user_score_mod_unbounded<A>(score, b, h, q_idx, kv_idx, seqlen_q, seqlen_k, mod_params_);\n"
            f"    return x < (A)({low}) ? (A)({low}) : x > (A)({high}) ? (A)({high}) : x;  // (NaN: NaN)\n}}"
        )

    def numpy_function(self):
        """The NumPy function of natural-unit scores that the NumPy backend runs: the
        user's, clamped to the bounds, in units of the unit where there is one."""
        fn = super().numpy_function()
        if self.bounds is not None:
            low, high = self.bounds
            fn = (lambda f: lambda **kw: np.clip(f(**kw), low, high))(fn)
        if self.unit is None:
            return fn
        unit = self.unit

        def in_units(score, **kw):
            dtype = np.asarray(score).dtype
            u = dtype.type(unit)  # in the scores' precision, as the kernels
            return u * np.asarray(fn(score=score / u, **kw), dtype=dtype)

        return in_units


class MaskMod(_UserMod):
    """A user-written mask: a key is seen only where it returns true (on top of
    causal, seqlens_k and window). ``cuda``: the body of a device function that
    returns a bool over ``b``, ``h``, ``q_idx``, ``kv_idx``, ``seqlen_q``,
    ``seqlen_k`` and the buffers; ``numpy``: its NumPy twin, returning a bool
    array (see :class:`ScoreMod`).

    Example, a sliding window of 256 keys (bottom-right aligned)::

        MaskMod(cuda="return kv_idx > q_idx + seqlen_k - seqlen_q - 256;",
                numpy=lambda q_idx, kv_idx, seqlen_q, seqlen_k, **_: kv_idx > q_idx + seqlen_k - seqlen_q - 256)
    """

    kind = "mask_mod"
    inputs = MASK_INPUTS

    def _signature(self) -> str:
        return (
            "__device__ __forceinline__ bool user_mask_mod(int b, int h, int q_idx, int kv_idx, int seqlen_q, "
            "int seqlen_k, const ModParams& mod_params_)"
        )


@dataclass(frozen=True)
class Modifiers:
    """The modifiers of one call, checked: what the plans and kernels depend on.

    window_left / window_right: -1 unbounded (window_right -1 when causal: the
    causal end bounds it); softcap 0: none; alibi: 0 none, 1 slopes
    (num_q_heads,), 2 (batch, num_q_heads); sinks_ptr / alibi_ptr: the device
    addresses of the call's arrays (0 on the CPU)."""

    window: bool = False
    window_left: int = -1
    window_right: int = -1
    softcap: float = 0.0
    sinks: bool = False
    alibi: int = 0
    score_mod: ScoreMod | None = None
    mask_mod: MaskMod | None = None
    sinks_ptr: int = 0
    alibi_ptr: int = 0

    @property
    def flags(self) -> int:
        return (
            (MOD_WINDOW if self.window else 0) | (MOD_SOFTCAP if self.softcap else 0) | (MOD_ALIBI if self.alibi else 0)
            | (MOD_SINKS if self.sinks else 0) | (MOD_SCORE if self.score_mod else 0) | (MOD_MASK if self.mask_mod else 0)
            | (MOD_SCORE_UNIT if self.score_mod is not None and self.score_mod.unit is not None else 0)
        )  # fmt: skip

    def score_bounds(self) -> tuple | None:
        """The range of the modified scores (natural units), where known: a score_mod's
        bounds (it comes last), else a softcap's (-softcap, softcap) without ALiBi."""
        if self.score_mod is not None:
            return self.score_mod.natural_bounds()
        if self.softcap and not self.alibi:
            return -self.softcap, self.softcap
        return None

    def fixed_ref(self) -> float | None:
        """The one exp2 reference (log2 units, float32) that a kernel may take for every
        row in place of the running maxima (MOD_FIXED_REF): the middle of the scores'
        range, where the range is at most FIXED_REF_SPAN_LOG2 wide; else None."""
        bounds = self.score_bounds()
        if bounds is None or (bounds[1] - bounds[0]) * LOG2E > FIXED_REF_SPAN_LOG2:
            return None
        return float(np.float32(0.5 * (bounds[0] + bounds[1]) * LOG2E))

    @property
    def per_call(self) -> bool:
        """Whether the call passes arrays (sinks, ALiBi slopes) whose addresses the plan holds."""
        return self.sinks or bool(self.alibi)

    def user_code(self) -> str:
        """The CUDA code of the user modifiers ('' without them)."""
        parts = []
        if self.score_mod is not None:
            parts.append(self.score_mod.definition(0))
        if self.mask_mod is not None:
            parts.append(self.mask_mod.definition(len(self.score_mod.buffers) if self.score_mod else 0))
        return "\n".join(parts)

    def params(self, device: int, num_q_heads: int) -> bytes:
        """The ModParams struct for a launch on ``device``."""
        mp = np.zeros(1, MOD_PARAMS_DTYPE)
        mp["sinks"] = self.sinks_ptr
        mp["alibi"] = self.alibi_ptr
        mp["alibi_batch_stride"] = num_q_heads if self.alibi == 2 else 0
        mp["softcap"] = self.softcap
        mp["window_left"] = self.window_left
        mp["window_right"] = self.window_right
        mp["fixed_ref"] = self.fixed_ref() or 0.0
        mp["score_unit"] = 0.0 if self.score_mod is None or self.score_mod.unit is None else self.score_mod.unit
        ptrs = []
        for mod in (self.score_mod, self.mask_mod):
            if mod is not None:
                ptrs += [a.data.ptr for a in mod.device_buffers(device)]
        mp["buffers"][0, : len(ptrs)] = ptrs
        return mp.tobytes()


def check_window(window, causal: bool, seqlen_q: int, seqlen_k: int):
    """(left, right) of a valid window, -1 for an unbounded side (and right -1
    when causal, whose end bounds it), or None for no window."""
    if window is None:
        return None
    if not isinstance(window, (tuple, list)) or len(window) != 2:
        raise TypeError(f"window: expected None or a pair (left, right) of integers >= -1, got {window!r}")
    for side, x in zip(("left", "right"), window):
        if isinstance(x, (bool, np.bool_)) or not isinstance(x, numbers.Integral):
            raise TypeError(f"window: expected integers (left, right), got {type(x).__name__} {x!r} for {side}")
        if x < -1:
            raise ValueError(f"window: expected left and right >= -1 (-1: unbounded), got {side}={int(x)}")
    left, right = (int(x) for x in window)
    reach = seqlen_q + seqlen_k  # a side past every key is unbounded
    left = -1 if left >= reach else left
    right = -1 if causal or right >= reach else right
    if left == -1 and right == -1:
        return None
    return left, right


def check_softcap(softcap):
    if softcap is None:
        return 0.0
    if isinstance(softcap, (bool, np.bool_)) or not isinstance(softcap, numbers.Real):
        raise TypeError(f"softcap: expected a real number > 0 or None, got {type(softcap).__name__}")
    if not (math.isfinite(softcap) and softcap > 0):
        raise ValueError(f"softcap: expected a finite number > 0 (None: no softcap), got {softcap}")
    return float(softcap)


def check_unit(unit):
    """ScoreMod's unit as a float > 0, or None."""
    if unit is None:
        return None
    if isinstance(unit, (bool, np.bool_)) or not isinstance(unit, numbers.Real):
        raise TypeError(f"score_mod: expected unit= a real number > 0 or None, got {type(unit).__name__} {unit!r}")
    if not (math.isfinite(unit) and unit > 0):
        raise ValueError(f"score_mod: expected unit= a finite number > 0 (None: natural units), got {unit}")
    return float(unit)


def check_bounds(bounds):
    """ScoreMod's bounds as a pair of floats (low <= high), or None."""
    if bounds is None:
        return None
    if not isinstance(bounds, (tuple, list)) or len(bounds) != 2:
        raise TypeError(f"score_mod: expected bounds= None or a pair (low, high) of real numbers, got {bounds!r}")
    for side, x in zip(("low", "high"), bounds):
        if isinstance(x, (bool, np.bool_)) or not isinstance(x, numbers.Real):
            raise TypeError(f"score_mod: expected bounds= real numbers (low, high), got {type(x).__name__} {x!r} for {side}")
    low, high = (float(x) for x in bounds)
    if not (math.isfinite(low) and math.isfinite(high) and low <= high):
        raise ValueError(f"score_mod: expected bounds= finite numbers with low <= high, got ({low}, {high})")
    return low, high


def check_user_mod(name: str, mod, cls):
    if mod is not None and not isinstance(mod, cls):
        raise TypeError(f"{name}: expected a cupy_gqa.{cls.__name__} or None, got {type(mod).__name__}")
    return mod


@dataclass(frozen=True, eq=False)
class CpuModifiers:
    """The modifiers as the NumPy backend takes them (cpu.attention_cpu)."""

    window_left: int = -1
    window_right: int = -1  # -1 when causal (the causal end bounds it)
    softcap: float = 0.0
    sinks: np.ndarray | None = None  # (num_q_heads,) float32
    alibi: np.ndarray | None = None  # (num_q_heads,) or (batch, num_q_heads) float32
    score_fn: object = None
    score_buffers: dict | None = None
    mask_fn: object = None
    mask_buffers: dict | None = None
    batch_offset: int = 0  # the batch index of the call's batch 0 (a per-sequence call's sequence, run alone)

    @classmethod
    def of(cls, mods: Modifiers, sinks, alibi) -> "CpuModifiers":
        s, m = mods.score_mod, mods.mask_mod
        return cls(
            window_left=mods.window_left if mods.window else -1, window_right=mods.window_right if mods.window else -1,
            softcap=mods.softcap, sinks=sinks, alibi=alibi,
            score_fn=s.numpy_function() if s else None, score_buffers=s.host_buffers() if s else None,
            mask_fn=m.numpy_function() if m else None, mask_buffers=m.host_buffers() if m else None,
        )  # fmt: skip

    def slopes(self, b: int) -> np.ndarray:
        return self.alibi if self.alibi.ndim == 1 else self.alibi[self.batch_offset + b]
