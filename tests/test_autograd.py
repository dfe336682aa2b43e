"""fused_is.FusedPolicyLoss called directly with tensors (the one autograd.Function, eager and compiled)."""

import pytest
import torch

import fused_is
from fused_is import backends
from fused_is.coefficients import metric_names_for

from cases import assert_close, config_for, loss_scale, make_inputs, tolerance

BACKENDS = [b for b in backends.available_backends() if b != "reference"]
GRAD_SCALE = 1.7


def _apply(inputs, logits, config, backend, compute_grad=True, **extra):
    """FusedPolicyLoss.apply with every argument positional, in the documented order."""
    kw = inputs.kwargs(**extra)
    return fused_is.FusedPolicyLoss.apply(
        logits, inputs.tokens, inputs.advantages, kw["sampler_logprobs"], kw["old_logprobs"], kw["ref_logprobs"],
        kw["mask"], kw["cu_seqlens"], config, None, backend, False, "full", None, None, None, None, compute_grad)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout,preset,overrides,with_old", [
    ("padded", "ppo_tis", None, True),
    ("packed", "seq_mis", None, False),  # two passes: W needs the sequence's current lp
    ("packed", "ppo", dict(ratio_level="sequence", clip_low=0.02, clip_high=0.03), True),  # GSPO
])
def test_apply_with_tensors_matches_reference(backend, layout, preset, overrides, with_old):
    """Loss, gradient, logprobs (tokens' shape), entropy and the metric values against the float64 oracle."""
    inputs = make_inputs(layout, dtype=torch.float32, seed=61)
    cfg = config_for(preset, overrides)
    logits = inputs.logits.detach().clone().requires_grad_()
    loss, lp, entropy, values = _apply(inputs, logits, cfg, backend, with_old=with_old)
    (loss * GRAD_SCALE).backward()
    ref_logits = inputs.logits.detach().double().requires_grad_()
    ref = fused_is.policy_loss(ref_logits, inputs.tokens, inputs.advantages, config=cfg, backend="reference",
                               **inputs.kwargs(with_old=with_old))
    (ref.loss * GRAD_SCALE).backward()
    tol = tolerance(torch.float32, backend)
    scale = max(abs(ref.loss.item()), loss_scale(inputs, cfg, with_old=with_old))
    assert_close("loss", loss, ref.loss, tol["loss"], scale=scale)
    assert_close("grad", logits.grad, ref_logits.grad, tol["grad"])
    assert lp.shape == inputs.tokens.shape and entropy.shape == inputs.tokens.shape
    assert_close("logprobs", lp, ref.logprobs, tol["logprobs"], mask=inputs.mask.bool(), scale=20.0)
    assert_close("entropy", entropy, ref.entropy, tol["logprobs"], scale=10.0)
    names = metric_names_for(cfg, inputs.sampler_logprobs is not None)
    assert list(names) == list(ref.metrics) and values.shape == (len(names),)
    for name, value in zip(names, values.tolist()):
        assert abs(value - ref.metrics[name]) <= 1e-4 * max(1.0, abs(ref.metrics[name])) + 1e-3, name
    assert not lp.requires_grad and not values.requires_grad


@pytest.mark.parametrize("backend", BACKENDS)
def test_apply_without_gradient(backend):
    """compute_grad=False makes no gradient (evaluation): values equal the gradient run's, backward refuses."""
    inputs = make_inputs("padded", dtype=torch.float32, seed=62)
    logits = inputs.logits.detach().clone().requires_grad_()
    with_grad = _apply(inputs, logits, "ppo_tis", backend)
    without = _apply(inputs, logits, "ppo_tis", backend, compute_grad=False)
    for a, b in zip(with_grad, without):
        assert torch.equal(a.detach(), b.detach())
    with pytest.raises(RuntimeError, match="without a gradient"):
        without[0].backward()


def test_apply_refuses_reference():
    inputs = make_inputs("padded", dtype=torch.float64, seed=63)
    with pytest.raises(ValueError, match="backend='reference' differentiates by autograd"):
        _apply(inputs, inputs.logits.clone().requires_grad_(), "ppo_tis", "reference")


@pytest.mark.parametrize("backend", BACKENDS)
def test_apply_under_compile(backend):
    """The same autograd.Function traced by dynamo (fullgraph): its forward's call and plan are traced around the
    kernel-level ops."""
    torch._dynamo.reset()
    inputs = make_inputs("padded", dtype=torch.float32, seed=64)

    def fn(logits):
        loss, lp, _, values = _apply(inputs, logits, "ppo_tis", backend)
        return loss * GRAD_SCALE, lp, values

    results = []
    for f in (fn, torch.compile(fn, fullgraph=True, backend="aot_eager")):
        x = inputs.logits.detach().clone().requires_grad_()
        loss, lp, values = f(x)
        loss.backward()
        results.append((loss.detach(), lp, values, x.grad))
    for name, eager, compiled in zip(("loss", "lp", "values", "grad"), *results):
        torch.testing.assert_close(compiled, eager, rtol=1e-6, atol=1e-7, msg=name)


def test_documented_positional_form_is_the_declaration():
    """The docstring's apply(...) names, in order, the logits and the fields of fused_is.call.Arguments (the one
    declaration the positional values are read by); more values than fields are a TypeError naming apply."""
    import re

    from fused_is.call import FIELDS

    form = re.search(r"FusedPolicyLoss\.apply\((.*?)\)\s*->", fused_is.FusedPolicyLoss.__doc__, re.S).group(1)
    assert [p.split("=")[0].strip() for p in form.split(",")] == ["logits", *FIELDS]
    inputs = make_inputs("padded", dtype=torch.float32, seed=65)
    with pytest.raises(TypeError, match="FusedPolicyLoss.apply takes at most"):
        fused_is.FusedPolicyLoss.apply(inputs.logits, *([None] * (len(FIELDS) + 1)))


def test_apply_takes_kept_after_head_dtype():
    """kept, the field added after head_dtype, keeps its place (versions and current_version come after it): the same
    result as policy_loss."""
    inputs = make_inputs("padded", dtype=torch.float32, seed=66)
    kept = torch.stack([inputs.tokens, (inputs.tokens + 1) % inputs.logits.shape[-1]], dim=-1)
    logits = inputs.logits.detach().clone().requires_grad_()
    loss, lp, _, _ = fused_is.FusedPolicyLoss.apply(logits, inputs.tokens, inputs.advantages, None, None, None,
                                                    inputs.mask, None, "ppo", None, "auto", False, "full", None, None,
                                                    None, None, True, None, None, None, kept)
    want = fused_is.policy_loss(inputs.logits, inputs.tokens, inputs.advantages, mask=inputs.mask, config="ppo",
                                kept=kept)
    assert torch.equal(loss.detach(), want.loss) and torch.equal(lp, want.logprobs)
