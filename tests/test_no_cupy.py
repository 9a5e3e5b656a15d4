"""Without CuPy: ``import cupy_gqa``, the NumPy backend and ``python -m cupy_gqa`` all work.

Each test runs a fresh interpreter in which a meta-path finder refuses every
CuPy module, as in a virtual environment without the cuda12 / cuda13 extra.
"""
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

import cupy_gqa
from conftest import TOLERANCE, assert_close, assert_lse_close, random_qkv
from reference import reference_attention

# the checkout this process imports cupy_gqa from, so that the child imports the same one
PACKAGE_ROOT = str(pathlib.Path(cupy_gqa.__file__).resolve().parent.parent)

BLOCK_CUPY = """
import sys

class NoCuPy:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("cupy", "cupyx", "cupy_backends"):
            raise {error}
        return None

sys.meta_path.insert(0, NoCuPy())
for name in [m for m in sys.modules if m.split(".")[0] in ("cupy", "cupyx", "cupy_backends")]:
    del sys.modules[name]
"""
REFUSED = 'ImportError(f"{name} is blocked for this test")'
MISSING = 'ModuleNotFoundError(f"No module named {name!r}", name=name)'  # what an absent package raises


def run_without_cupy(code, *, error=REFUSED, cwd=None):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [PACKAGE_ROOT, os.environ.get("PYTHONPATH")])))
    program = BLOCK_CUPY.format(error=error) + code
    return subprocess.run(
        [sys.executable, "-c", program], env=env, cwd=cwd, capture_output=True, text=True, timeout=300
    )


def test_the_blocker_blocks():
    proc = run_without_cupy("import cupy")
    assert proc.returncode != 0 and "ImportError: cupy is blocked for this test" in proc.stderr


def test_numpy_backend_without_cupy(tmp_path):
    inputs = {
        "f32": random_qkv(2, 19, 23, 8, 2, 16, "float32", seed=1),
        "bf16": random_qkv(1, 7, 7, 4, 1, 32, "bfloat16", seed=2),
        "f64": random_qkv(2, 5, 3, 6, 3, 8, "float64", seed=3),
    }
    for name, qkv in inputs.items():
        for x, a in zip("qkv", qkv):
            np.save(tmp_path / f"{name}_{x}.npy", a)
    code = f"""
import pathlib, sys
import ml_dtypes, numpy as np
import cupy_gqa

d = pathlib.Path({str(tmp_path)!r})
assert pathlib.Path(cupy_gqa.__file__).resolve().parent.parent == pathlib.Path({PACKAGE_ROOT!r})
for name in {list(inputs)!r}:
    q, k, v = (np.load(d / f"{{name}}_{{x}}.npy") for x in "qkv")
    if name == "bf16":  # np.save keeps bfloat16 as raw 2-byte void
        q, k, v = (x.view(ml_dtypes.bfloat16) for x in (q, k, v))
    out, lse = cupy_gqa.attention(q, k, v, return_lse=True)
    np.save(d / f"{{name}}_out.npy", out.astype(np.float64)), np.save(d / f"{{name}}_lse.npy", lse)
    t = lambda x: np.ascontiguousarray(x.transpose(0, 2, 1, 3))
    np.save(d / f"{{name}}_bhsd.npy", cupy_gqa.attention(t(q), t(k), t(v), layout="bhsd").astype(np.float64))
loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("cupy", "cupyx", "cupy_backends"))
print("cupy modules:", loaded)
"""
    proc = run_without_cupy(code)
    assert proc.returncode == 0, proc.stderr
    assert "cupy modules: []" in proc.stdout
    dtypes = {"f32": "float32", "bf16": "bfloat16", "f64": "float64"}
    for name, (q, k, v) in inputs.items():
        ref, ref_lse = reference_attention(q, k, v)
        assert_close(np.load(tmp_path / f"{name}_out.npy"), ref, TOLERANCE[dtypes[name]], name)
        assert_lse_close(np.load(tmp_path / f"{name}_lse.npy"), ref_lse, 1e-5, name)
        bhsd = np.load(tmp_path / f"{name}_bhsd.npy").transpose(0, 2, 1, 3)
        assert_close(bhsd, ref, TOLERANCE[dtypes[name]], f"{name} bhsd")


@pytest.mark.parametrize(
    "error, says",
    [
        (MISSING, "no usable GPU: CuPy is not installed, so only the NumPy backend runs"),
        (REFUSED, "no usable GPU: CuPy does not import (cupy is blocked for this test)"),
    ],
    ids=["not-installed", "import-fails"],
)
def test_demo_without_cupy_says_why_and_what_to_install(error, says):
    proc = run_without_cupy("from cupy_gqa.__main__ import main; sys.exit(main([]))", error=error)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith(f"cupy_gqa {cupy_gqa.__version__}: causal GQA")
    assert lines[1].startswith(says), proc.stdout
    assert '".[cuda12]"' in lines[1] and '".[cuda13]"' in lines[1] and "nvidia-smi" in lines[1]
    assert lines[2].startswith("ran the NumPy backend only")


def test_version_and_compile_without_cupy():
    proc = run_without_cupy("from cupy_gqa.__main__ import main; sys.exit(main(['--version']))")
    assert proc.returncode == 0 and proc.stdout.strip() == f"cupy_gqa {cupy_gqa.__version__}", proc.stderr
    proc = run_without_cupy("from cupy_gqa.__main__ import main; sys.exit(main(['compile', '--arch', 'sm_80']))")
    assert proc.returncode == 2 and proc.stdout == ""
    [line] = proc.stderr.splitlines()  # one clear line, no traceback
    assert line.startswith("python -m cupy_gqa compile: compiling needs CuPy and NVRTC") and "cuda12" in line
