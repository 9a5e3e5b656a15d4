"""Kernel sources and the compile cache.

Sources are read from ``kernels/`` at runtime. Local ``#include "x.cuh"`` lines
are inlined when a source is read, so the text handed to NVRTC is the whole
program and CuPy's on-disk cache (keyed by source and options) can never serve
a binary built from an older header.

:func:`get_kernel` compiles each specialization once per process and device,
thread-safely; a process that compiled it before finds it in CuPy's on-disk
cache. :func:`compile_offline` drives NVRTC directly for a named architecture,
which needs no GPU (``python -m cupy_gqa compile``).
"""
from __future__ import annotations

import functools
import pathlib
import re
import threading
from dataclasses import dataclass

from . import _specs
from ._specs import Spec

_PACKAGE_DIR = pathlib.Path(__file__).resolve().parent
# Installed wheel: cupy_gqa/kernels/. Source checkout: the top-level kernels/.
KERNEL_DIR = next(
    (d for d in (_PACKAGE_DIR / "kernels", _PACKAGE_DIR.parent / "kernels") if (d / "common.cuh").is_file()),
    _PACKAGE_DIR / "kernels",
)
_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"\s*$', re.MULTILINE)


@functools.cache
def source(filename: str) -> str:
    """The text of ``kernels/<filename>`` with local includes inlined (each once)."""
    seen: set[str] = set()

    def expand(name: str) -> str:
        if name in seen:
            return ""
        seen.add(name)
        text = (KERNEL_DIR / name).read_text()
        return _INCLUDE.sub(lambda m: f"// begin {m.group(1)}\n{expand(m.group(1))}\n// end {m.group(1)}", text)

    return expand(filename)


@functools.cache
def _cuda_include_dirs() -> tuple[str, ...]:
    """CUDA headers (cuda_fp16.h, ...) from the nvidia-cuda-runtime wheel, if installed.

    Without the wheel, CuPy falls back to the system toolkit (CUDA_PATH)."""
    try:
        from cuda import pathfinder

        found = pathfinder.find_nvidia_header_directory("cudart")
    except Exception:  # no pathfinder or no wheel: rely on CuPy's own search
        return ()
    return (str(found),) if found else ()


_USER_MODS_MARKER = "// @user-mods@"


def source_for(spec: Spec) -> str:
    """The program of ``spec``: its kernel file's source, with the code of the
    user modifiers (``spec.user_code``) at common.cuh's marker."""
    text = source(spec.source)
    if not spec.user_code:
        return text
    at = text.index(_USER_MODS_MARKER)
    line = text.count("\n", 0, at) + 2  # the line after the marker, as NVRTC numbers the program
    return f'{text[:at]}{spec.user_code}\n#line {line} "{spec.source}"\n{text[at + len(_USER_MODS_MARKER):]}'


def user_mods_check_program(mod) -> str:
    """A program of common.cuh and one user modifier, with a kernel that calls it:
    what cupy_gqa.ScoreMod / MaskMod compile to check their code."""
    text = source("common.cuh")
    at = text.index(_USER_MODS_MARKER)
    line = text.count("\n", 0, at) + 2
    call = (
        "out[0] = user_score_mod<float>(1.f, 0, 0, 0, 0, 1, 1, mp) + (float)user_score_mod<double>(1.0, 0, 0, 0, 0, 1, 1, mp);"
        if mod.kind == "score_mod"
        else "out[0] = user_mask_mod(0, 0, 0, 0, 1, 1, mp) ? 1.f : 0.f;"
    )
    return (
        f'{text[:at]}{mod.definition(0)}\n#line {line} "common.cuh"\n{text[at + len(_USER_MODS_MARKER):]}\n'
        f'extern "C" __global__ void cupy_gqa_check_user_mod(float* out, const ModParams mp) {{ {call} }}\n'
    )


def compile_options(spec: Spec | None) -> tuple[str, ...]:
    return ("-std=c++17", *(f"-I{d}" for d in _cuda_include_dirs()), *(spec.options if spec is not None else ()))


_lock = threading.Lock()
_kernels: dict = {}


def _compile_module(spec: Spec):
    import cupy

    module = cupy.RawModule(code=source_for(spec), options=compile_options(spec), name_expressions=[spec.name])
    try:
        return module.get_function(spec.name)  # compiles (or loads from disk) here
    except cupy.cuda.compiler.CompileException as e:
        if not spec.user_code:
            raise
        raise ValueError(f"score_mod / mask_mod: NVRTC could not compile the kernel with them:\n{e}") from None


def _serial_pv_fallback(spec: Spec) -> bool:
    """Whether ``spec`` runs a user's score_mod in units on hopper's softmax beside P V
    (kernels/hopper.cu: OVERLAP_PV), where it has a variant that waits for P V instead, for
    code that needs more registers than that leaves (it then spills: local memory)."""
    from ._mods import MOD_SCORE_UNIT, MOD_SERIAL_PV

    return spec.family == "hopper" and bool(spec.user_code) and bool(spec.mods & MOD_SCORE_UNIT) and not spec.mods & MOD_SERIAL_PV


def get_kernel(spec: Spec):
    """The ``cupy.RawKernel`` for ``spec`` on the current device, compiled once."""
    import cupy

    key = (spec.name, spec.options, spec.user_code, cupy.cuda.Device().id)
    kernel = _kernels.get(key)
    if kernel is None:
        with _lock:
            kernel = _kernels.get(key)
            if kernel is None:
                kernel = _compile_module(spec)
                if _serial_pv_fallback(spec) and kernel.local_size_bytes > 0:
                    # a score_mod in units whose code spills beside P V: the kernel that waits
                    # for P V, where it needs less local memory
                    serial = _compile_module(_specs.with_serial_pv(spec))
                    if serial.local_size_bytes < kernel.local_size_bytes:
                        kernel = serial
                if spec.smem > 48 * 1024:
                    kernel.max_dynamic_shared_size_bytes = spec.smem
                _kernels[key] = kernel
    return kernel


# --- offline compile, no GPU needed -----------------------------------------------


@dataclass
class CompileReport:
    spec: Spec
    arch: str
    ok: bool
    registers: int | None
    spill_stores: int | None
    spill_loads: int | None
    stack_frame: int | None
    log: str

    @property
    def message(self) -> str:
        """NVRTC's log, or, where it holds no ptxas report to read the counts from, that."""
        if "ptxas" in self.log:
            return self.log
        return f"{self.spec.name}: NVRTC's log holds no ptxas report (ok={self.ok}, log {self.log!r})"


def _ptxas_number(log: str, pattern: str) -> int | None:
    m = re.search(pattern, log)
    return int(m.group(1)) if m else None


def compile_offline(spec: Spec, arch: str) -> CompileReport:
    """Compile ``spec`` for ``arch`` (e.g. ``sm_90``) with NVRTC and read ptxas' report.

    A spec built for one target (``spec.arch``, e.g. sm_90a) compiles for that target."""
    from cupy.cuda import nvrtc

    prog = nvrtc.createProgram(source_for(spec), spec.source, [], [])
    try:
        nvrtc.addNameExpression(prog, spec.name)
        # a spec built for one target names it in its own options (-arch=sm_90a)
        target = [] if spec.arch else [f"--gpu-architecture={arch}"]
        options = [*target, "-Xptxas", "-v", *compile_options(spec)]
        try:
            nvrtc.compileProgram(prog, options)
            ok = True
        except nvrtc.NVRTCError:
            ok = False
        log = nvrtc.getProgramLog(prog)
    finally:
        nvrtc.destroyProgram(prog)
    return CompileReport(
        spec=spec,
        arch=arch,
        ok=ok,
        registers=_ptxas_number(log, r"Used (\d+) registers"),
        spill_stores=_ptxas_number(log, r"(\d+) bytes spill stores"),
        spill_loads=_ptxas_number(log, r"(\d+) bytes spill loads"),
        stack_frame=_ptxas_number(log, r"(\d+) bytes stack frame"),
        log=log,
    )
