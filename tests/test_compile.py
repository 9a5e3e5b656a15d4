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


def _one_spec_per_source():
    from cupy_gqa._specs import SPECS

    first = {}
    for spec in SPECS:
        if spec.smem:  # the kernels with dynamic shared memory
            first.setdefault(spec.source, spec)
    return list(first.values())


def test_every_dynamic_shared_memory_size_is_the_kernels_smem_bytes():
    for spec in SPECS:
        if spec.smem:
            assert spec.name.endswith(f", {spec.smem}>"), spec.name


@pytest.mark.parametrize("spec", _one_spec_per_source(), ids=lambda s: s.source)
def test_a_wrong_shared_memory_size_does_not_compile(spec):
    """The kernel's layout is the one definition: a table that disagrees with it fails to compile."""
    import dataclasses

    from cupy_gqa._compile import compile_offline

    assert compile_offline(spec, "sm_90").ok
    wrong = dataclasses.replace(spec, name=spec.name[: -len(f"{spec.smem}>")] + f"{spec.smem + 16}>")
    report = compile_offline(wrong, "sm_90")
    assert not report.ok and "SMEM_BYTES is not the size of the shared-memory layout" in report.log
