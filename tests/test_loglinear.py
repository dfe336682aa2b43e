"""ratio_ref="loglinear": AReaL's proximal-policy approximation, formed in the kernels from the current logprob, on
every backend against the float64 reference, its alpha against AReaL's own function, and its errors."""

import pytest
import torch

import fused_is
from fused_is import backends

from cases import areal_functions, check_against_reference, config_for, make_inputs

BACKENDS = [b for b in backends.available_backends() if b != "reference"]
CURRENT = 7


def _versions(inputs, seed):
    """Per-token versions between 3 and CURRENT (some equal to it: alpha 0) and some prompt tokens (-1)."""
    g = torch.Generator().manual_seed(seed)
    versions = torch.randint(3, CURRENT + 1, inputs.tokens.shape, generator=g)
    versions[torch.rand(inputs.tokens.shape, generator=g) < 0.15] = -1
    return versions


class _Loglinear:
    """Inputs whose kwargs() carry versions and current_version in place of old_logprobs."""

    def __init__(self, inputs, versions):
        self.inputs, self.versions = inputs, versions

    def __getattr__(self, name):
        return getattr(self.inputs, name)

    def kwargs(self, **overrides):
        kw = self.inputs.kwargs(**overrides)
        kw.update(old_logprobs=None, versions=self.versions, current_version=CURRENT)
        return kw


CASES = [("ppo_tis", dict(ratio_ref="loglinear")),  # AReaL's decoupled PPO: the ratio and the behaviour weight
         ("ppo_tis", dict(ratio_ref="loglinear", clip_low=0.05, clip_high=0.08, dual_clip=2.0)),
         ("sapo", dict(ratio_ref="loglinear", is_level="token")),
         ("seq_tis", dict(ratio_ref="loglinear")),  # sequence IS: the stats pass forms the proximal first
         ("reinforce_tis", dict(ratio_ref="loglinear", kl_coef=0.1, kl_weight="ratio"))]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", ["padded", "packed"])
@pytest.mark.parametrize("preset,overrides", CASES,
                         ids=["ppo_tis", "ppo_tis_dual", "sapo_tis", "seq_tis", "reinforce_kl"])
def test_against_the_reference(backend, layout, preset, overrides):
    inputs = make_inputs(layout, dtype=torch.float32, seed=5)
    wrapped = _Loglinear(inputs, _versions(inputs, 1))
    check_against_reference(wrapped, config_for(preset, overrides), backend)


def test_alpha_equals_areals():
    """The per-token alpha of the prepared call is AReaL 1.0.4's compute_prox_logp_approximations' interpolation:
    its loglinear result, from a behaviour logprob and a current one, equals samp + alpha (lp - samp)."""
    (approximations,) = areal_functions("compute_prox_logp_approximations")
    from fused_is.call import Arguments, prepare

    g = torch.Generator().manual_seed(0)
    n = 64
    versions = torch.randint(-2, CURRENT + 1, (n,), generator=g)
    behaviour = torch.randn(n, generator=g, dtype=torch.float64) - 3.0
    current = torch.randn(n, generator=g, dtype=torch.float64) - 3.0
    logits = torch.randn(n, 11, dtype=torch.float64)
    args = Arguments(tokens=torch.zeros(n, dtype=torch.long), advantages=torch.zeros(n), sampler_logprobs=behaviour,
                     config=fused_is.LossConfig(ratio_ref="loglinear"), versions=versions, current_version=CURRENT,
                     backend="torch")
    call = prepare(logits, args)
    scope = {"PROX_APPROX_METHOD_LOGLINEAR": "loglinear", "PROX_APPROX_METHOD_LINEAR": "linear",
             "PROX_APPROX_METHOD_ROLLOUT": "rollout", "PROX_APPROX_METHODS_ALL": ("loglinear",)}
    approximations.__globals__.update(scope)
    theirs = approximations(behaviour, current, versions, CURRENT, method="loglinear")["loglinear"]
    ours = behaviour + call.proximal_alpha * (current - behaviour)
    assert torch.allclose(ours, theirs, rtol=0, atol=1e-6), (ours - theirs).abs().max()  # AReaL: alpha in fp32
    assert (call.proximal_alpha[versions < 0] == 0).all() and (call.proximal_alpha[versions == CURRENT] == 0).all()


def test_one_sweep_for_a_token_level_config(monkeypatch):
    """The proximal is formed in the kernel from lp: the token-local configuration reads the logits once."""
    from cases import count_calls

    inputs = make_inputs("packed", dtype=torch.float32, seed=2)
    wrapped = _Loglinear(inputs, _versions(inputs, 2))
    calls = count_calls(monkeypatch, backends.implementation("cpu"), ["stats", "fused"])
    out = fused_is.policy_loss(inputs.logits.clone().requires_grad_(), inputs.tokens, inputs.advantages,
                               config=config_for("ppo_tis", dict(ratio_ref="loglinear")), backend="cpu",
                               **wrapped.kwargs())
    out.loss.backward()
    assert calls == {"stats": 0, "fused": 1}


def _call(inputs, **kw):
    base = _Loglinear(inputs, _versions(inputs, 3)).kwargs()
    base.update(kw)
    config = base.pop("config", config_for("ppo_tis", dict(ratio_ref="loglinear")))
    return fused_is.policy_loss(inputs.logits, inputs.tokens, inputs.advantages, config=config, backend="torch", **base)


@pytest.mark.parametrize("kw,error,match", [
    (dict(old_logprobs="given"), ValueError, "pass old_logprobs=None"),
    (dict(versions=None), TypeError, "versions must be an integer"),
    (dict(versions="float"), TypeError, "versions must be an integer"),
    (dict(versions="short"), ValueError, "versions must have the tokens' shape"),
    (dict(versions="future"), ValueError, "versions must be <= current_version"),
    (dict(current_version=None), TypeError, "current_version must be an int"),
    (dict(current_version=-1), TypeError, "current_version must be an int"),
    (dict(config="ppo_tis"), ValueError, "versions= is read by LossConfig.ratio_ref='loglinear' only"),
    (dict(config=fused_is.LossConfig(ratio_ref="loglinear", m2_threshold=0.1)), ValueError, "not supported yet"),
])
def test_bad_input_names_the_argument(kw, error, match):
    inputs = make_inputs("packed", dtype=torch.float32, seed=4)
    replace = {"given": inputs.old_logprobs, "float": inputs.tokens.float(), "short": inputs.tokens[:-1],
               "future": torch.full_like(inputs.tokens, CURRENT + 1)}
    kw = {k: replace.get(v, v) if isinstance(v, str) and k != "config" else v for k, v in kw.items()}
    with pytest.raises(error, match=match):
        _call(inputs, **kw)


def test_linear_policy_loss_takes_the_versions():
    """linear_policy_loss forms the same proximal: equal to policy_loss of hidden @ weight.T (float64 reference)."""
    g = torch.Generator().manual_seed(8)
    n, d, v = 24, 16, 97
    hidden = torch.randn(n, d, generator=g, dtype=torch.float32)
    weight = torch.randn(v, d, generator=g, dtype=torch.float32) * 0.3
    tokens = torch.randint(0, v, (n,), generator=g)
    adv = torch.randn(n, generator=g)
    samp = torch.log_softmax(hidden.double() @ weight.double().T, -1).gather(1, tokens[:, None])[:, 0].float()
    samp = samp + 0.2 * torch.randn(n, generator=g)
    versions = torch.randint(-1, CURRENT + 1, (n,), generator=g)
    cfg = fused_is.LossConfig(policy="ppo", ratio_ref="loglinear", is_level="token", clip_low=0.05, clip_high=0.05)
    kw = dict(sampler_logprobs=samp, config=cfg, versions=versions, current_version=CURRENT)
    h = hidden.clone().requires_grad_()
    out = fused_is.linear_policy_loss(h, weight, tokens, adv, backend="cpu", **kw)
    out.loss.backward()
    h64 = hidden.double().requires_grad_()
    ref = fused_is.policy_loss(h64 @ weight.double().T, tokens, adv, backend="reference", **kw)
    ref.loss.backward()
    assert torch.allclose(out.loss.double(), ref.loss, rtol=1e-5, atol=1e-7)
    assert torch.allclose(h.grad.double(), h64.grad, rtol=1e-4, atol=1e-6)
