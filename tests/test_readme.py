"""The README's two set-up commands are the ones CI runs, and its examples match the API."""
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent


def setup_commands():
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Set up") : readme.index("## Usage")]
    return re.findall(r"```\n(.+?)\n```", section)


def test_two_setup_commands_demo_then_tests():
    demo, tests = setup_commands()
    assert demo.startswith("pip install -e ") and demo.endswith("python -m cupy_gqa")
    assert tests.startswith("pip install -e ") and "test" in tests and tests.endswith("python -m pytest")


def test_ci_runs_the_readme_test_command():
    _, tests = setup_commands()
    install, run = (part.strip() for part in tests.split("&&"))
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert install in ci, f"{install!r} is not a line of .ci/run"
    assert any(line.startswith(run) for line in ci), f"no line of .ci/run starts with {run!r}"


def test_semantics_signature_is_the_real_one():
    import inspect

    import cupy_gqa

    readme = (ROOT / "README.md").read_text()
    shown = re.search(r"`attention\((q, k, v, \*, .*?)\)`", readme).group(1)
    assert shown == str(inspect.signature(cupy_gqa.attention))[1:-1].replace("'", '"')


def test_usage_keywords_exist():
    import inspect

    import cupy_gqa

    readme = (ROOT / "README.md").read_text()
    usage = readme[readme.index("## Usage") : readme.index("## Semantics")]
    used = set(re.findall(r"(\w+)=", usage)) - {"dtype", "device"}  # cupy / torch keywords in the example
    public = set(inspect.signature(cupy_gqa.attention).parameters) | set(inspect.signature(cupy_gqa.warmup).parameters)
    from cupy_gqa.integrations import transformers as hf  # imports transformers only when registering

    public |= set(inspect.signature(hf.register).parameters) | {"attn_implementation"}  # and from_pretrained's
    assert used <= public, used - public


def test_modifier_example_runs_and_the_softcap_by_hand_is_the_builtin():
    """The README's modifier example, run on the NumPy backend (32 query heads, as its buffer):
    ``capped`` gives softcap=30's very bits, ``out`` the float64 reference's values."""
    import numpy as np

    import cupy_gqa
    from conftest import assert_close, random_qkv
    from reference import reference_attention

    readme = (ROOT / "README.md").read_text()
    code = re.search(r"```python\n(bias = cupy_gqa\.ScoreMod\(.*?)```", readme, re.S).group(1)
    q, k, v = random_qkv(1, 300, 300, 32, 8, 16, "float32", seed=21)
    env = {"cupy_gqa": cupy_gqa, "np": np, "q": q, "k": k, "v": v}
    exec(code, env)
    np.testing.assert_array_equal(env["capped"], cupy_gqa.attention(q, k, v, softcap=30.0))
    ref, _ = reference_attention(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64),
                                 score_mod=env["bias"], mask_mod=env["band"])
    assert_close(env["out"], ref, 2e-5, "the README's score_mod and mask_mod")
