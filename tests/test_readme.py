"""The README and docs/ as a user reads them: their Python examples run as written, their commands exist,
their links stay inside the repository, and the README stays a README.

Convention: a ```python block runs here, in a fresh namespace. A ```py block is shown but not run here: it needs
what a test machine lacks (a vLLM model download, a verl worker) or several processes; the same calls run in
tests/test_vllm.py and tests/test_integration_verl_engine.py, and the distributed layouts' ```py blocks of
docs/distributed.md run in 2 gloo processes in tests/test_readme_layouts.py.
"""

import os
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
DOCS = REPO / "docs"
README_MAX_LINES = 250
# the trainers' packages: installed by `bash scripts/dev.sh setup`, so their examples run in CI; elsewhere skipped
OPTIONAL_MODULES = ("trl", "openrlhf", "verl", "areal")

_PYTHON_BLOCK = re.compile(r"^```python\n(.*?)^```", flags=re.S | re.M)
_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def _pages():
    return [README] + sorted(DOCS.glob("*.md"))


def _python_blocks():
    """(page, index, source) of every ```python block of the README and docs/."""
    return [(page, i, block) for page in _pages()
            for i, block in enumerate(_PYTHON_BLOCK.findall(page.read_text()))]


def _run(page: Path, block: str, namespace=None) -> None:
    try:
        exec(compile(block, str(page), "exec"), {"__name__": "readme"} if namespace is None else namespace)
    except ModuleNotFoundError as err:
        if (err.name or "").split(".")[0] in OPTIONAL_MODULES and os.environ.get("CI") != "true":
            pytest.skip(f"{err.name} is not installed (bash scripts/dev.sh setup installs it)")
        raise


def test_readme_python_blocks_run():
    """Every ```python block of the README runs as written, in order, as a reader runs them: the quickstart first,
    the blocks after it continuing from it."""
    blocks = _PYTHON_BLOCK.findall(README.read_text())
    assert blocks, "README has no python example"
    namespace = {"__name__": "readme"}
    for block in blocks:
        _run(README, block, namespace)


_DOCS_BLOCKS = [b for b in _python_blocks() if b[0] != README]


@pytest.mark.parametrize("page, index, block", _DOCS_BLOCKS, ids=[f"{p.name}-{i}" for p, i, _ in _DOCS_BLOCKS])
def test_docs_python_blocks_run(page, index, block):
    """Every ```python block of docs/*.md runs as written."""
    _run(page, block)


def test_readme_commands_exist():
    text = README.read_text()
    assert "bash scripts/dev.sh test" in text and "bash scripts/dev.sh bench" in text
    ci = (README.parent / ".ci" / "run").read_text()
    assert "bash scripts/dev.sh test" in ci
    dev = (REPO / "scripts" / "dev.sh").read_text()
    bench = dev[dev.index("\n  bench)"):].split(";;")[0]  # the README's "runs `fused-is bench`"
    assert "setup_bench" in bench and 'exec "$VENV/bin/fused-is" bench "$@"' in bench, bench


def test_readme_is_short_and_names_every_preset():
    import fused_is

    text = README.read_text()
    assert len(text.splitlines()) <= README_MAX_LINES, len(text.splitlines())
    rows = {m.group(1) for m in re.finditer(r"^\| `([a-z_]+)`", text, flags=re.M)}
    rows |= {m.group(1) for m in re.finditer(r"^\| `[a-z_]+`, `([a-z_]+)`", text, flags=re.M)}
    missing = sorted(set(fused_is.PRESETS) - rows)
    assert not missing, f"presets missing from the README's table: {missing}"


def _slug(heading: str) -> str:
    """GitHub's anchor of a Markdown heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
    return text.replace(" ", "-")


def _anchors(page: Path) -> set:
    return {_slug(m.group(1)) for m in re.finditer(r"^#+ (.*)$", page.read_text(), flags=re.M)}


@pytest.mark.parametrize("page", _pages(), ids=lambda p: p.name)
def test_links_stay_in_the_repository(page):
    """Every link resolves to a file (and heading) of this repository; the README links only to docs/ pages (and
    shows images from bench/results/)."""
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)  # code blocks hold no links
    for target in _LINK.findall(text):
        assert "://" not in target and not target.startswith(("/", "mailto:")), f"{page.name}: {target}"
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        assert resolved.is_relative_to(REPO), f"{page.name}: {target} leaves the repository"
        if page == README:
            assert not path or path.startswith("docs/") or path.startswith("bench/results/"), target
        assert resolved.exists(), f"{page.name}: {target} does not exist"
        if anchor and resolved.suffix == ".md":
            assert anchor in _anchors(resolved), f"{page.name}: no heading #{anchor} in {path or page.name}"


@pytest.mark.parametrize("page", _pages(), ids=lambda p: p.name)
def test_no_development_history(page):
    """The README and docs describe the package as it is; its history is in git log."""
    text = page.read_text().lower()
    for phrase in ("this session", "issue #", "the seed's", "round of work", "before this change"):
        assert phrase not in text, f"{page.name} says {phrase!r}"
