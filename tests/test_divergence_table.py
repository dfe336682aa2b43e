"""The divergence table carries the distillation's math (DESIGN.md section 10): its names are declared once, in
fused_is/divergences.py, and nothing outside it, the oracle and the trainer integrations compares a divergence by
name; every list of names (the config's, the kernels' codes) is derived from it; each row's torch math is the
oracle's."""

from __future__ import annotations

import ast
import math
from pathlib import Path

import pytest
import torch

import fused_is
from fused_is import config, divergences, reference
from fused_is.backends import abi

PACKAGE = Path(fused_is.__file__).resolve().parent
SOURCES = [PACKAGE] + [p for p in [PACKAGE.parent / "triton_kernels"] if p.is_dir()]
# where a divergence's name may appear as a value: the table, the oracle (written out plainly, independently), and
# the trainer integrations and benchmark drivers, which pass a trainer's own objective to distill_loss's `kind`
ALLOWED = {"divergences.py", "reference.py"}
ALLOWED_DIRS = {"integrations", "benchmarks"}
NAMES = set(divergences.KINDS)


def _name_uses(tree: ast.AST):
    """Line of every divergence name used as a value to compare or to declare: in a comparison, a dict, tuple, list
    or set display, a subscript, or an assignment. A keyword argument or a parameter's default (kind="jsd") is a
    caller's choice, not a declaration, and is not flagged."""
    def named(node):
        return isinstance(node, ast.Constant) and node.value in NAMES

    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            for side in (node.left, *node.comparators):
                if named(side) or (isinstance(side, (ast.Tuple, ast.List, ast.Set)) and any(map(named, side.elts))):
                    yield node.lineno
        elif isinstance(node, ast.Dict):
            if any(named(k) for k in node.keys if k is not None) or any(map(named, node.values)):
                yield node.lineno
        elif isinstance(node, (ast.Tuple, ast.List, ast.Set)) and any(map(named, node.elts)):
            yield node.lineno
        elif isinstance(node, ast.Subscript) and named(node.slice):
            yield node.lineno
        elif isinstance(node, (ast.Assign, ast.AnnAssign)) and named(node.value):
            yield node.lineno


def test_no_divergence_name_outside_the_table():
    found = []
    for root in SOURCES:
        for path in sorted(root.rglob("*.py")):
            relative = path.relative_to(root)
            if relative.name in ALLOWED or set(relative.parts[:-1]) & ALLOWED_DIRS:
                continue
            found += [f"{root.name}/{relative}:{line}" for line in _name_uses(ast.parse(path.read_text()))]
    assert not found, f"a divergence named outside fused_is/divergences.py: {sorted(set(found))}"


def test_the_scan_sees_a_name():
    """The scan above is not vacuous: it flags each form a name comparison or declaration takes."""
    for source in ('call.divergence == "jsd"', 'x if kind in ("forward_kl", "jsd") else y', '{"reverse_kl": 1}',
                   'KINDS = ("forward_kl", "reverse_kl", "jsd")', 'CODES["jsd"]', 'name = "reverse_kl"',
                   '"jsd" != kind'):
        assert list(_name_uses(ast.parse(source))), source
    for source in ('distill_loss(x, y, kind="jsd")', 'def f(kind="forward_kl"): pass', 'inplace == "forward"'):
        assert not list(_name_uses(ast.parse(source))), source


def test_every_list_of_names_is_the_tables():
    assert config.DISTILL_KINDS == divergences.KINDS
    assert abi.DISTILL_DIVERGENCES == divergences.CODES
    assert sorted(divergences.CODES.values()) == list(range(len(divergences.KINDS)))
    for kind in divergences.KINDS:
        assert divergences.DIVERGENCES[kind].name == kind


@pytest.mark.parametrize("beta,expected", [(0.0, "forward_kl"), (1.0, "reverse_kl"), (0.3, "jsd"), (0, "forward_kl")])
def test_the_mixture_at_its_end_points_is_a_kl(beta, expected):
    assert divergences.of("jsd", beta).name == expected
    assert divergences.of("forward_kl", beta).name == "forward_kl"


def _rows(seed, n=5, v=37):
    g = torch.Generator().manual_seed(seed)
    z, u = torch.randn(n, v, generator=g, dtype=torch.float64) * 2, torch.randn(n, v, generator=g, dtype=torch.float64)
    z[0, 3] = -math.inf  # probability 0 under the student alone: 0 log 0 terms (KL(q || p) is infinite there)
    return z, u


@pytest.mark.parametrize("kind,beta", [("forward_kl", 0.5), ("reverse_kl", 0.5), ("jsd", 0.3), ("jsd", 0.8)])
def test_each_row_is_the_oracle(kind, beta):
    """A row's value and F (d D / d z at tau = 1) equal the oracle's D and its autograd gradient, in float64."""
    z, u = _rows(7)
    if kind == "forward_kl":
        z[0, 3] = 0.0  # KL(q || p) is infinite where p = 0 < q
    row = divergences.of(kind, beta)
    log_p, log_q = torch.log_softmax(z, -1), torch.log_softmax(u, -1)
    value, student_kl = row.value(log_p, log_q, beta)
    leaf = z.clone().requires_grad_()
    loss, per_token, _ = reference.distill_reference(leaf, u, kind=kind, beta=beta, loss_agg="sum")
    loss.backward()
    torch.testing.assert_close(value, per_token, rtol=1e-12, atol=1e-12)
    grad = row.gradient(log_p.clone(), log_q.clone(), log_p.exp(), value, student_kl, beta)
    torch.testing.assert_close(grad, leaf.grad, rtol=1e-10, atol=1e-12)


def test_a_new_divergence_is_one_row(monkeypatch):
    """A row without a kernel code runs on the torch sweeps from the table alone: distill_loss takes its name, "auto"
    picks the torch sweeps, top_k uses its bucket math, and a kernel backend asked for by name refuses it. The row
    here is the forward KL's math under another name, so its results are the forward KL's bit for bit."""
    row = divergences.dataclasses.replace(divergences.FORWARD_KL, name="forward_kl_again", title="forward KL again",
                                          code=None)
    monkeypatch.setitem(divergences.DIVERGENCES, row.name, row)
    monkeypatch.setattr(divergences, "KINDS", divergences.KINDS + (row.name,))
    g = torch.Generator().manual_seed(3)
    z, u = torch.randn(2, 6, 29, generator=g), torch.randn(2, 6, 29, generator=g)
    mask = torch.rand(2, 6, generator=g) > 0.3
    for top_k in (0, 5):
        outputs = []
        for kind, backend in ((row.name, "auto"), ("forward_kl", "torch")):
            leaf = z.clone().requires_grad_()
            loss, per_token, _ = fused_is.distill_loss(leaf, u, kind=kind, mask=mask, top_k=top_k, backend=backend)
            loss.backward()
            outputs.append((loss, per_token, leaf.grad))
        for ours, forward in zip(*outputs):
            assert torch.equal(ours, forward)
    with pytest.raises(ValueError, match="kind='forward_kl_again' with backend='cpu' is not supported"):
        fused_is.distill_loss(z, u, kind=row.name, backend="cpu")
