"""The policy table carries the math (DESIGN.md section 9): nothing outside it compares a policy by name, every
policy parameter is checked through it, a row that writes only its value gets its derivative by autograd, the
kernels take generic parameters, and a token-local row with a kernel branch runs one sweep."""

from __future__ import annotations

import ast
import dataclasses
import math
from pathlib import Path

import pytest
import torch

import fused_is
from fused_is import LossConfig, coefficients, policies
from fused_is.backends import abi

from cases import count_calls

PACKAGE = Path(fused_is.__file__).resolve().parent
# where a policy's name may be compared: the table itself and the oracle (written out plainly, independently). The
# trainer integrations translate a trainer's own option names and its aggregation quirks per policy (facts of that
# trainer, not of the policy), so they are outside the rule too
ALLOWED = {"policies.py", "reference.py"}
ALLOWED_DIRS = {"integrations", "benchmarks"}


def _policy_name_comparisons(tree: ast.AST):
    """(line, source) of every comparison of a `.policy` / `policy` value with a string (==, !=, in, startswith)."""
    names = set(policies.POLICIES)

    def is_policy(node):
        return (isinstance(node, ast.Attribute) and node.attr == "policy") or (
            isinstance(node, ast.Name) and node.id == "policy")

    def strings(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return {node.value}
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            return set().union(*(strings(e) for e in node.elts)) if node.elts else set()
        return set()

    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            if any(is_policy(s) for s in sides) and any(strings(s) for s in sides):
                yield node.lineno
            elif any(strings(s) & names for s in sides) and any(
                    isinstance(s, ast.Attribute) and s.attr in ("name", "policy") for s in sides):
                yield node.lineno
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr in ("startswith", "endswith") and is_policy(node.func.value)):
            yield node.lineno


def test_no_policy_name_comparison_outside_the_table():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE)
        if relative.name in ALLOWED or set(relative.parts[:-1]) & ALLOWED_DIRS:
            continue
        for line in _policy_name_comparisons(ast.parse(path.read_text())):
            found.append(f"{relative}:{line}")
    assert not found, f"comparisons on a policy's name outside the policy table: {found}"


def test_the_scan_sees_a_comparison():
    """The scan above is not vacuous: it flags each form a name comparison takes."""
    for source in ('cfg.policy == "gmpo"', 'x if call.config.policy in ("clip_cov", "kl_cov") else y',
                   'self.policy.startswith("dppo")', '"vespo" != policy', 'row.name == "sapo"'):
        assert list(_policy_name_comparisons(ast.parse(source))), source
    assert not list(_policy_name_comparisons(ast.parse('cfg.is_level == "token"')))


# a valid value other than the default for each policy parameter (a new parameter must be added here)
SAMPLES = dict(dual_clip=3.0, ratio_cap=2.0, cov_ratio=0.5, cov_bounds=(0.0, 2.0), cov_kl_coef=0.5, cov_seed=3,
               sapo_tau_pos=2.0, sapo_tau_neg=2.0, vespo_k_pos=1.0, vespo_lambda_pos=1.0, vespo_k_neg=1.0,
               vespo_lambda_neg=1.0, ratio_penalty_coef=0.01)


def test_every_parameter_is_checked_through_the_table():
    """Each parameter a row owns is accepted with its policies and refused by name with every other one."""
    assert set(SAMPLES) == set(policies.PARAMETERS)
    for name, value in SAMPLES.items():
        for policy in policies.POLICIES:
            fields = dict(policy=policy, ratio_ref="old", **{name: value})
            if policy in policies.OWNERS[name]:
                assert getattr(LossConfig(**fields), name) == value
            else:
                with pytest.raises(ValueError, match=f"LossConfig.{name} applies to policy="):
                    LossConfig(**fields)


def test_a_bad_parameter_value_names_the_field():
    for name, bad, error in [("sapo_tau_neg", -1.0, ValueError), ("ratio_cap", 0.0, ValueError),
                             ("cov_ratio", 1.5, ValueError), ("cov_bounds", (2.0, 1.0), ValueError),
                             ("cov_bounds", 3.0, TypeError), ("cov_seed", 1.5, TypeError),
                             ("ratio_penalty_coef", -1.0, ValueError), ("dual_clip", 1.0, ValueError),
                             ("vespo_k_pos", "2", TypeError)]:
        owner = policies.OWNERS[name][0]
        with pytest.raises(error, match=name):
            LossConfig(policy=owner, ratio_ref="old", **{name: bad})


def test_kernel_contract_has_no_policy_names():
    """The kernels take p0..p3 from the row, never a policy's own parameter; each kernel row fills at most four."""
    own = set(policies.PARAMETERS) | {"clip_low", "clip_high", "entropy_coef"}
    assert not own & set(abi.FLOAT_PARAMS) and not {"has_dual_clip"} & set(abi.INT_PARAMS)
    for name, row in policies.POLICIES.items():
        cfg = fused_is.PRESETS.get(name) or LossConfig(policy=name)
        params = policies.kernel_params(cfg)
        assert len(params) == policies.KERNEL_PARAMS and all(isinstance(p, float) for p in params)
        assert (row.kernel is None) or row.kernel in policies.KERNEL_POLICIES
        assert not (row.kernel and row.value_only), name


def _vectors(n=4000, seed=0):
    g = torch.Generator().manual_seed(seed)
    lp = -torch.rand(n, generator=g, dtype=torch.float64) * 4.0
    base = lp + torch.randn(n, generator=g, dtype=torch.float64) * 0.5
    adv = torch.randn(n, generator=g, dtype=torch.float64)
    adv[::7] = 0.0
    return lp, base, adv


def _value_only(fn, weight: bool):
    """The explicit row `fn` as a value-only row; weight: its ratio is a detached weight (sg(.) in its formula), as
    a value-only row writes it."""
    def value(lp, ratio, adv, cfg):
        if weight:
            ratio = ratio._replace(ratio=ratio.ratio.detach())
        s, _, clipped = fn(lp, ratio, adv, cfg)
        return s, clipped
    return value


@pytest.mark.parametrize("name, weight, overrides", [
    ("ppo", False, dict(dual_clip=2.0, log_ratio_clamp=0.6)),
    ("ppo", False, dict(clip_low=0.1, clip_high=0.3)),
    ("sapo", False, dict(log_ratio_clamp=0.5)),
    ("cispo", True, dict(clip_low=0.3, clip_high=0.1)),
    ("prime_rl", False, dict(ratio_penalty_coef=0.1, log_ratio_clamp=0.7)),
    ("dppo_kl", True, dict(ratio_cap=1.5)),
    ("reinforce", False, {}),
])
def test_a_value_only_row_gets_its_derivative_by_autograd(name, weight, overrides, monkeypatch):
    """A row written as the value alone (value_only=True) gives the explicit rows' s, ds and clipped flags: its
    derivative by autograd through the clamps, on float64 vectors."""
    cfg = LossConfig(policy=name, ratio_ref="old", is_level="none", **overrides)
    lp, base, adv = _vectors()
    base = None if not policies.policy(name).ratio else base
    explicit = coefficients.surrogate(lp, base, adv, cfg)
    row = policies.policy(name)
    monkeypatch.setattr(coefficients, "policy",
                        lambda _: dataclasses.replace(row, surrogate=_value_only(row.surrogate, weight),
                                                              value_only=True))
    derived = coefficients.surrogate(lp, base, adv, cfg)
    torch.testing.assert_close(derived[0], explicit[0], rtol=0, atol=0)
    torch.testing.assert_close(derived[1], explicit[1], rtol=1e-12, atol=1e-12)
    assert torch.equal(derived[2], explicit[2])
    assert derived[1].abs().sum() > 0  # not vacuous: some tokens carry a gradient


@pytest.mark.parametrize("backend", ["cpu", "torch", "triton"])
@pytest.mark.parametrize("preset, sweeps", [("prime_rl", 1), ("ppo_tis", 1), ("dppo_tv", 2)])
def test_a_kernel_row_runs_one_sweep(backend, preset, sweeps, monkeypatch):
    """prime_rl has a kernel branch: one read of the logits (the fused sweep alone), as PPO; DPPO (no branch) runs
    the stats pass first. The loss and gradient equal the float64 reference's."""
    g = torch.Generator().manual_seed(5)
    n, v = 24, 97
    logits = torch.randn(n, v, generator=g)
    tokens = torch.randint(0, v, (n,), generator=g)
    adv = torch.randn(n, generator=g)
    old = torch.log_softmax(logits + 0.3 * torch.randn(n, v, generator=g), -1).gather(1, tokens[:, None])[:, 0]
    samp = old + 0.2 * torch.randn(n, generator=g)
    inputs = dict(sampler_logprobs=samp, old_logprobs=old, config=preset)
    from fused_is import backends

    counts = count_calls(monkeypatch, backends.implementation(backend), ["stats", "fused"])
    x = logits.clone().requires_grad_()
    out = fused_is.policy_loss(x, tokens, adv, backend=backend, **inputs)
    out.loss.backward()
    assert counts["stats"] + counts["fused"] == sweeps and counts["fused"] == 1, counts
    ref_x = logits.double().requires_grad_()
    ref = fused_is.policy_loss(ref_x, tokens, adv.double(), backend="reference",
                               **{k: (v.double() if torch.is_tensor(v) else v) for k, v in inputs.items()})
    ref.loss.backward()
    torch.testing.assert_close(out.loss.double(), ref.loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(x.grad.double(), ref_x.grad, rtol=1e-4, atol=1e-6)
    assert math.isfinite(out.metrics["clip_frac"])
