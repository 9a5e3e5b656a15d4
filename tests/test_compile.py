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
    assert main(["compile", "--arch", "sm_1"]) != 0
