"""The command line (cupy_gqa/__main__.py): why no GPU is usable, --version, compile's --arch check.

A stand-in ``cupy`` module plays each driver situation, so these run on any machine.
"""
import sys
import types

import pytest

import cupy_gqa
from cupy_gqa import __main__ as cli
from cupy_gqa._compile import CompileReport
from cupy_gqa._specs import ARCHS, specs_for


class FakeCUDARuntimeError(RuntimeError):
    pass


INSUFFICIENT_DRIVER = "cudaErrorInsufficientDriver: CUDA driver version is insufficient for CUDA runtime version"
NO_DEVICE = "cudaErrorNoDevice: no CUDA-capable device is detected"


def fake_cupy(monkeypatch, *, error=None, count=1, driver=12040, runtime=12090, name=b"NVIDIA H200", cc=(9, 0)):
    """Install a stand-in ``cupy`` whose runtime answers as given."""

    def get_device_count():
        if error is not None:
            raise FakeCUDARuntimeError(error)
        return count

    rt = types.SimpleNamespace(
        getDeviceCount=get_device_count,
        driverGetVersion=lambda: driver,
        runtimeGetVersion=lambda: runtime,
        getDevice=lambda: 0,
        getDeviceProperties=lambda device: {"name": name, "major": cc[0], "minor": cc[1]},
    )
    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(cuda=types.SimpleNamespace(runtime=rt)))


def test_usable_gpu(monkeypatch):
    fake_cupy(monkeypatch)
    assert cli.gpu_status() == ("NVIDIA H200", "")


def test_no_driver(monkeypatch):
    fake_cupy(monkeypatch, error=INSUFFICIENT_DRIVER, driver=0)
    name, reason = cli.gpu_status()
    assert name is None
    assert reason.startswith(INSUFFICIENT_DRIVER)
    assert "No NVIDIA driver was found" in reason and ">= 525" in reason and ">= 580" in reason


def test_driver_older_than_cupys_runtime(monkeypatch):
    fake_cupy(monkeypatch, error=INSUFFICIENT_DRIVER, driver=11080, runtime=12090)
    name, reason = cli.gpu_status()
    assert name is None and reason.startswith(INSUFFICIENT_DRIVER)
    assert "The driver supports CUDA up to 11.8, but CuPy uses the CUDA 12.9 runtime: update the driver" in reason
    assert '".[cuda12]"' in reason and '".[cuda13]"' in reason


def test_no_device(monkeypatch):
    fake_cupy(monkeypatch, error=NO_DEVICE, driver=13000, runtime=12090)
    name, reason = cli.gpu_status()
    assert name is None and reason.startswith(NO_DEVICE) and "CUDA_VISIBLE_DEVICES" in reason
    fake_cupy(monkeypatch, count=0)
    name, reason = cli.gpu_status()
    assert name is None and reason.startswith("no CUDA device found") and "nvidia-smi" in reason


def test_too_old_a_gpu(monkeypatch):
    fake_cupy(monkeypatch, name=b"Tesla P100", cc=(6, 0))
    name, reason = cli.gpu_status()
    assert name is None
    assert reason.startswith("Tesla P100 (cuda:0) has compute capability 6.0; the kernels need 7.0 or newer")


def test_demo_prints_the_reason(monkeypatch, capsys):
    fake_cupy(monkeypatch, error=INSUFFICIENT_DRIVER, driver=0)
    assert cli.main([]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1] == f"no usable GPU: {cli.gpu_status()[1]}"
    assert "no CUDA device found" not in lines[1]
    assert lines[2].startswith("ran the NumPy backend only (")


def test_version(capsys):
    with pytest.raises(SystemExit) as stop:
        cli.main(["--version"])
    assert stop.value.code == 0
    assert capsys.readouterr().out.strip() == f"cupy_gqa {cupy_gqa.__version__}"


@pytest.mark.parametrize("arch", ["sm_1", "sm_91", "sm_90a", "90", "compute_90", "sm_", "SM_90", ""])
def test_compile_refuses_an_unknown_arch_once(arch, monkeypatch, capsys):
    tried = []
    monkeypatch.setattr(cli, "compile_offline", lambda spec, a: tried.append(spec))
    assert cli.main(["compile", "--arch", arch]) == 2
    printed = capsys.readouterr()
    assert printed.out == "" and not tried  # nothing compiled
    [line] = printed.err.splitlines()
    assert line == (
        "python -m cupy_gqa compile: --arch: expected one of sm_70, sm_75, sm_80, sm_86, sm_87, sm_89, "
        f"sm_90, sm_100, sm_120, got {arch!r}"
    )


@pytest.mark.parametrize("arch", [f"sm_{a}" for a in cli.KNOWN_ARCHS])
def test_known_archs_pass_the_format_check(arch):
    issue = cli.arch_issue(arch)
    assert issue is None or "--arch: expected one of" not in issue


def test_compile_refuses_an_arch_nvrtc_lacks(monkeypatch, capsys):
    pytest.importorskip("cupy")
    from cupy.cuda import nvrtc

    if not hasattr(nvrtc, "getSupportedArchs"):
        pytest.skip("this CuPy has no nvrtc.getSupportedArchs")
    monkeypatch.setattr(nvrtc, "getSupportedArchs", lambda: (75, 80, 86, 89, 90))
    assert cli.main(["compile", "--arch", "sm_70"]) == 2
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith("python -m cupy_gqa compile: --arch: NVRTC ") and "does not compile for sm_70" in line
    assert "(it takes sm_75, sm_80, sm_86, sm_89, sm_90)" in line


def test_compile_log_has_no_nul_bytes(monkeypatch, capsys):
    def failing(spec, arch):
        log = "ptxas error   : Feature 'cp.async' requires .target sm_80 or higher\n\x00"
        return CompileReport(spec, arch, False, None, None, None, None, log)

    monkeypatch.setattr(cli, "arch_issue", lambda arch: None)
    monkeypatch.setattr(cli, "compile_offline", failing)
    assert cli.main(["compile", "--arch", "sm_75"]) == 1
    out = capsys.readouterr().out
    specs = specs_for(ARCHS["sm_75"])  # sm_75's table
    assert "\x00" not in out
    assert out.count("FAILED") == len(specs) and out.count("requires .target sm_80") == len(specs)
    assert f"0/{len(specs)} specializations compiled for sm_75" in out
