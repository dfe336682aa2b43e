"""The README's Python examples run as written."""

import re
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def test_readme_python_blocks_run():
    """Every ```python block runs as written. (```py blocks need a model download and a vLLM engine; the
    same calls run in tests/test_vllm.py on a tiny local model; the distributed layouts' ```py blocks run in 2 gloo
    processes in tests/test_readme_layouts.py; the verl engine hook's needs a verl worker, and
    tests/test_integration_verl_engine.py makes its calls on verl's engine.)"""
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert blocks, "README has no python example"
    for block in blocks:
        exec(compile(block, str(README), "exec"), {"__name__": "readme"})


def test_readme_commands_exist():
    text = README.read_text()
    assert "bash scripts/dev.sh test" in text and "bash scripts/dev.sh bench" in text
    ci = (README.parent / ".ci" / "run").read_text()
    assert "bash scripts/dev.sh test" in ci
