"""The refused combinations are declared once (fused_is/combinations.py): every refusal in the package raises an entry
of the table by its key, every entry is raised somewhere, no other "X with Y is not supported" text is written
elsewhere, and docs/compatibility.md shows the table as it is."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import fused_is
from fused_is import combinations

PACKAGE = Path(fused_is.__file__).resolve().parent
DOCS = PACKAGE.parent / "docs"
# the trainer integrations refuse trainer options (their own names), and the benchmark drivers are not the library
OUTSIDE = {"integrations", "benchmarks"}


def _core_trees():
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE)
        if not set(relative.parts[:-1]) & OUTSIDE and relative.name != "combinations.py":
            yield relative, ast.parse(path.read_text())


def _is_refused(node) -> bool:
    return isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) == "refused"


def _refused_keys(tree) -> list:
    """(line, key) of every refused(...) call: its string literal, or each literal a `for key, ... in ((literal, ...),
    ...)` loop around it binds to the name it passes; key None for anything else."""
    looped = {}  # id of a refused() call -> the keys its loop binds
    for loop in ast.walk(tree):
        if isinstance(loop, ast.For) and isinstance(loop.target, ast.Tuple) and isinstance(loop.iter, ast.Tuple):
            name = loop.target.elts[0]
            keys = [e.elts[0].value for e in loop.iter.elts if isinstance(e, ast.Tuple)
                    and isinstance(e.elts[0], ast.Constant)]
            for call in ast.walk(loop):
                if _is_refused(call) and call.args and isinstance(call.args[0], ast.Name) \
                        and isinstance(name, ast.Name) and call.args[0].id == name.id:
                    looped[id(call)] = keys
    out = []
    for node in ast.walk(tree):
        if _is_refused(node):
            first = node.args[0] if node.args else None
            if isinstance(first, ast.Constant) and isinstance(first.value, str):
                out.append((node.lineno, first.value))
            else:
                out += [(node.lineno, key) for key in looped.get(id(node), [None])]
    return out


def test_every_refusal_is_a_declared_entry_and_every_entry_is_raised():
    raised, unknown = set(), []
    for relative, tree in _core_trees():
        for line, key in _refused_keys(tree):
            if key not in combinations.REFUSALS:
                unknown.append(f"{relative}:{line} {key!r}")
            raised.add(key)
    assert not unknown, f"refused() with a key that is not a literal of REFUSALS: {unknown}"
    assert set(combinations.REFUSALS) == raised, f"declared but never raised: {set(combinations.REFUSALS) - raised}"


def test_no_combination_refusal_written_elsewhere():
    """A ValueError text of the form "... with ... is not supported" belongs in the table."""
    found = []
    for relative, tree in _core_trees():
        for node in ast.walk(tree):
            if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call):
                text = " ".join(c.value for c in ast.walk(node.exc)
                                if isinstance(c, ast.Constant) and isinstance(c.value, str))
                if " with " in text and "not supported" in text:
                    found.append(f"{relative}:{node.lineno}")
    assert not found, f"combination refusals outside fused_is/combinations.py: {found}"


def test_the_scan_sees_a_refusal():
    tree = ast.parse('raise refused("kept/vocab_group")\nraise combinations.refused(key)\n'
                     'for key, given in (("a/b", x), ("c/d", y)):\n    raise refused(key)\n'
                     'raise ValueError("a with b is not supported yet")')
    assert sorted(_refused_keys(tree)) == [(1, "kept/vocab_group"), (2, None), (4, "a/b"), (4, "c/d")]


def test_the_docs_show_the_table():
    assert combinations.render() in (DOCS / "compatibility.md").read_text()


@pytest.mark.parametrize("key", sorted(combinations.REFUSALS))
def test_each_text_names_both_options(key):
    refusal = combinations.REFUSALS[key]
    values = dict(top_k=5, backend="cpu", kind="x", policy="clip_cov", weight="score", kl_type="k3+",
                  backends="'torch'")
    text = str(combinations.refused(key, **values))
    first, second = (s.format(**values) for s in (refusal.first, refusal.second))
    assert text.startswith(f"{first} with {second} is not supported") and "{" not in text, text
