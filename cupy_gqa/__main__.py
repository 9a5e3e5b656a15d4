"""Command line: ``python -m cupy_gqa`` (demo), ``python -m cupy_gqa compile --arch sm_90`` and ``--version``."""
from __future__ import annotations

import argparse
import re
import sys
import time

import numpy as np

from . import __version__, attention
from ._compile import compile_offline
from ._specs import ARCHS, seq_check_specs, seq_mods_check_specs, specs_for

# The oldest compute capability with a kernel table (_specs.ARCHS): sm_70 and
# sm_75 run rowwise and float32 decode; the tensor-core kernels need 8.0.
MIN_COMPUTE_CAPABILITY = (7, 0)
# Architectures that ``compile --arch`` takes: sm_XX for these XX.
KNOWN_ARCHS = tuple(int(name[3:]) for name in ARCHS)
# The driver each extra needs, as in the README's requirements.
_INSTALL_HINT = (
    'install the extra that matches the NVIDIA driver: pip install -e ".[cuda12]" (driver >= 525) '
    'or ".[cuda13]" (driver >= 580); the "CUDA Version" that nvidia-smi prints is the highest the driver supports'
)

_CHECK_VISIBLE = "check that nvidia-smi lists a GPU and that CUDA_VISIBLE_DEVICES does not hide it"


def _cuda_version(v: int) -> str:
    return f"{v // 1000}.{v % 1000 // 10}"


def gpu_status() -> tuple[str | None, str]:
    """(name of the current CUDA device, "") when the GPU kernels can run, else (None, why not and what to do)."""
    try:
        import cupy
    except ModuleNotFoundError as e:
        if e.name != "cupy":
            return None, f"CuPy is installed but does not import ({e}); reinstall it: {_INSTALL_HINT}"
        return None, f"CuPy is not installed, so only the NumPy backend runs; for the GPU, {_INSTALL_HINT}"
    except ImportError as e:
        return None, f"CuPy does not import ({e}); {_INSTALL_HINT}"

    runtime = cupy.cuda.runtime
    try:
        count = runtime.getDeviceCount()
    except Exception as e:  # CUDARuntimeError: no driver, a driver too old for CuPy's runtime, no device
        return None, f"{e}. {_driver_advice(runtime)}"
    if count == 0:
        return None, f"no CUDA device found; {_CHECK_VISIBLE}"
    try:
        device = runtime.getDevice()
        props = runtime.getDeviceProperties(device)
    except Exception as e:
        return None, f"{e}. {_driver_advice(runtime)}"
    name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
    cc = (int(props["major"]), int(props["minor"]))
    if cc < MIN_COMPUTE_CAPABILITY:
        need = ".".join(map(str, MIN_COMPUTE_CAPABILITY))
        return None, (
            f"{name} (cuda:{device}) has compute capability {cc[0]}.{cc[1]}; the kernels need {need} or newer "
            "(Volta and later), so only the NumPy backend runs"
        )
    return name, ""


def _driver_advice(runtime) -> str:
    """What to do about a CUDA error at the first driver call, from the driver's and the runtime's versions."""
    try:
        driver, needed = runtime.driverGetVersion(), runtime.runtimeGetVersion()
    except Exception:
        return "Check the NVIDIA driver with nvidia-smi."
    if driver == 0:
        return (
            "No NVIDIA driver was found: on a machine with an NVIDIA GPU, install the driver "
            "(>= 525 for the cuda12 extra, >= 580 for cuda13); without a GPU only the NumPy backend runs."
        )
    if driver < needed:
        return (
            f"The driver supports CUDA up to {_cuda_version(driver)}, but CuPy uses the CUDA {_cuda_version(needed)} "
            f"runtime: update the driver, or {_INSTALL_HINT}."
        )
    return f"The driver supports CUDA up to {_cuda_version(driver)}; {_CHECK_VISIBLE}."


def demo() -> int:
    """A small call on the GPU, checked against the NumPy backend: batch 2, seqlen 80,
    8 query heads, 2 KV heads, head_dim 32, fp32, causal."""
    rng = np.random.default_rng(0)
    shape_q, shape_kv = (2, 80, 8, 32), (2, 80, 2, 32)
    q, k, v = (rng.standard_normal(s).astype(np.float32) for s in (shape_q, shape_kv, shape_kv))
    print(f"cupy_gqa {__version__}: causal GQA, q {shape_q}, k/v {shape_kv}, float32")
    t0 = time.perf_counter()
    expected = attention(q, k, v)
    cpu_ms = (time.perf_counter() - t0) * 1e3
    name, reason = gpu_status()
    if name is None:
        print(f"no usable GPU: {reason}")
        print(f"ran the NumPy backend only ({cpu_ms:.2f} ms)")
        return 0

    import cupy
    from cupyx.profiler import benchmark

    qd, kd, vd = (cupy.asarray(x) for x in (q, k, v))
    out = attention(qd, kd, vd)  # compiles (or loads from CuPy's disk cache) once
    err = float(np.linalg.norm(cupy.asnumpy(out) - expected) / np.linalg.norm(expected))
    timing = benchmark(attention, (qd, kd, vd), n_repeat=200, n_warmup=10)
    gpu_ms = float(np.median(timing.gpu_times)) * 1e3
    print(f"device: {name}")
    print(f"relative error vs the NumPy backend: {err:.2e}")
    print(f"median time: {gpu_ms:.4f} ms on the GPU (NumPy backend: {cpu_ms:.2f} ms)")
    return 0 if err < 1e-5 else 1


def arch_issue(arch: str) -> str | None:
    """Why ``compile --arch`` can't take ``arch``, or None."""
    m = re.fullmatch(r"sm_(\d+)", arch)
    if m is None or int(m.group(1)) not in KNOWN_ARCHS:
        known = ", ".join(f"sm_{a}" for a in KNOWN_ARCHS)
        return f"--arch: expected one of {known}, got {arch!r}"
    try:
        from cupy.cuda import nvrtc
    except ImportError as e:
        return f"compiling needs CuPy and NVRTC, which do not import ({e}); {_INSTALL_HINT}"
    supported = getattr(nvrtc, "getSupportedArchs", None)
    if supported is not None:
        archs = tuple(supported())
        if int(m.group(1)) not in archs:
            version = ".".join(map(str, nvrtc.getVersion()))
            takes = ", ".join(f"sm_{a}" for a in archs)
            return f"--arch: NVRTC {version} does not compile for {arch} (it takes {takes})"
    return None


def compile_all(arch: str, seq: bool = False) -> int:
    """Compile every specialization of ``arch``'s table with NVRTC (``seq``: their
    per-sequence instantiations instead, _specs.seq_check_specs, then those with the
    built-in modifiers, _specs.seq_mods_check_specs); no GPU needed."""
    issue = arch_issue(arch)
    if issue is not None:
        print(f"python -m cupy_gqa compile: {issue}", file=sys.stderr)
        return 2
    failures = 0
    # the architecture's own table
    specs = (*seq_check_specs(ARCHS[arch]), *seq_mods_check_specs(ARCHS[arch])) if seq else specs_for(ARCHS[arch])
    print(f"{'kernel':<60} {'regs':>5} {'spill st':>9} {'spill ld':>9} {'stack':>6}")
    for spec in specs:
        report = compile_offline(spec, arch)
        if not report.ok:
            failures += 1
            log = report.log.replace("\0", "").rstrip()  # NVRTC's log ends in a NUL byte
            print(f"{spec.name:<60} FAILED\n{log}")
            continue
        numbers = (report.registers, report.spill_stores, report.spill_loads, report.stack_frame)
        regs, st, ld, stack = ("?" if n is None else n for n in numbers)  # "?": ptxas printed no such line
        print(f"{spec.name:<60} {regs:>5} {st:>9} {ld:>9} {stack:>6}")
    print(f"{len(specs) - failures}/{len(specs)} specializations compiled for {arch}")
    return 1 if failures else 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cupy_gqa", description=__doc__)
    parser.add_argument("--version", action="version", version=f"cupy_gqa {__version__}")
    sub = parser.add_subparsers(dest="command")
    sub.add_parser("demo", help="run a small call on the GPU and check it against the NumPy backend (the default)")
    comp = sub.add_parser("compile", help="compile every kernel specialization with NVRTC (no GPU needed)")
    known = ", ".join(map(str, KNOWN_ARCHS))
    comp.add_argument("--arch", default="sm_90", help=f"target architecture, sm_XX with XX in {known} (default: sm_90)")
    comp.add_argument("--seq", action="store_true",
                      help="compile the per-sequence instantiations (varlen, paged, left padding) of the table instead, "
                           "without and with the built-in modifiers")
    args = parser.parse_args(argv)
    if args.command == "compile":
        return compile_all(args.arch, args.seq)
    return demo()


if __name__ == "__main__":
    sys.exit(main())
