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
