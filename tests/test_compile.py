"""Every specialization compiles with NVRTC for sm_80 and sm_90, without a GPU.

Needs CuPy and the NVRTC library (the cuda12 / cuda13 extra). This is
``python -m cupy_gqa compile --arch ...``, run in CI.
"""
import pytest

pytest.importorskip("cupy")

from cupy_gqa.__main__ import main  # noqa: E402
from cupy_gqa._specs import SPECS  # noqa: E402


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_compile_command_covers_every_specialization(arch, capsys):
    assert main(["compile", "--arch", arch]) == 0
    printed = capsys.readouterr().out
    for spec in SPECS:
        assert spec.name in printed
    assert f"{len(SPECS)}/{len(SPECS)} specializations compiled for {arch}" in printed
    assert "FAILED" not in printed


def test_compile_command_fails_on_a_bad_arch(capsys):
    assert main(["compile", "--arch", "sm_1"]) == 2
    printed = capsys.readouterr()
    assert "FAILED" not in printed.out  # refused once, before any specialization
    assert "--arch: expected one of sm_70," in printed.err


def test_compile_failure_log_is_printed_without_nul_bytes(capsys, monkeypatch):
    # sm_75 has no cp.async: NVRTC fails on a vectorised rowwise specialization, and its log ends in NUL
    from cupy_gqa import __main__ as cli

    spec = next(s for s in SPECS if s.name.startswith("rowwise_attention<float, 32, 1, true"))
    monkeypatch.setattr(cli, "SPECS", (spec,))
    assert main(["compile", "--arch", "sm_75"]) == 1
    out = capsys.readouterr().out
    assert "FAILED" in out and "requires .target sm_80 or higher" in out
    assert "\x00" not in out
