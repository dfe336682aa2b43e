"""policy_loss(..., teacher_logits=u) with LossConfig.distill_kind: the policy loss and on-policy distillation in one
aggregation, on every backend against the float64 reference; the reference against the policy loss plus
distill_loss (checked against TRL in test_distill.py); its errors."""

import dataclasses

import pytest
import torch

import fused_is
from fused_is import backends

from cases import assert_close, check_against_reference, config_for, make_inputs

BACKENDS = [b for b in backends.available_backends() if b != "reference"]
KINDS = [("forward_kl", 0.5), ("reverse_kl", 0.5), ("jsd", 0.3)]


class _Taught:
    """Inputs whose kwargs() carry a teacher: the student's logits moved by noise, in bf16 (any float dtype)."""

    def __init__(self, inputs, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.inputs = inputs
        self.teacher = (inputs.logits.double() + torch.randn(inputs.logits.shape, generator=g,
                                                            dtype=torch.float64)).to(torch.bfloat16)

    def __getattr__(self, name):
        return getattr(self.inputs, name)

    def kwargs(self, **overrides):
        return dict(self.inputs.kwargs(**overrides), teacher_logits=self.teacher)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind,beta", KINDS, ids=[k for k, _ in KINDS])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_against_the_reference(backend, kind, beta, dtype):
    inputs = make_inputs("packed" if kind == "jsd" else "padded", dtype=dtype, seed=2)
    config = config_for("ppo_tis", dict(distill_kind=kind, distill_beta=beta, distill_coef=0.5,
                                        loss_agg="seq-mean-token-mean" if kind == "reverse_kl" else "token-mean"))
    check_against_reference(_Taught(inputs), config, backend)


@pytest.mark.parametrize("kind,beta", KINDS + [("jsd", 0.0), ("jsd", 1.0)], ids=["fwd", "rev", "jsd", "b0", "b1"])
def test_reference_is_the_policy_loss_plus_distill_loss(kind, beta):
    """With a token-mean aggregation the combined loss is policy_loss + coef * distill_loss over the same mask: value
    and gradient (float64, the two oracles)."""
    inputs = make_inputs("padded", dtype=torch.float32, seed=4)
    taught = _Taught(inputs)
    plain = config_for("ppo_tis", {})
    combined = dataclasses.replace(plain, distill_kind=kind, distill_beta=beta, distill_coef=0.3)
    x = inputs.logits.double().requires_grad_()
    out = fused_is.policy_loss(x, inputs.tokens, inputs.advantages, config=combined, backend="reference",
                               **taught.kwargs())
    out.loss.backward()
    y = inputs.logits.double().requires_grad_()
    policy = fused_is.policy_loss(y, inputs.tokens, inputs.advantages, config=plain, backend="reference",
                                  **inputs.kwargs()).loss
    distill, per_token, _ = fused_is.distill_loss(y, taught.teacher, kind=kind, beta=beta, mask=inputs.mask,
                                                  backend="reference")
    (policy + 0.3 * distill).backward()
    assert_close("loss", out.loss, policy + 0.3 * distill, 1e-12, scale=1.0)
    assert_close("grad", x.grad, y.grad, 1e-10)
    mean = per_token.reshape(-1)[inputs.mask.reshape(-1)].mean()
    assert abs(out.metrics["distill_mean"] - float(mean)) < 1e-10


@pytest.mark.parametrize("what,match", [
    ("unread", "read by LossConfig.distill_kind"), ("missing", "needs teacher_logits"),
    ("inplace", "with inplace is not supported"), ("grad", "requires grad"), ("shape", "vocabulary"),
    ("nan", "teacher_logits"), ("beta", r"distill_beta must be in \[0, 1\]"), ("orphan", "without distill_kind"),
])
def test_errors(what, match):
    inputs = make_inputs("packed", dtype=torch.float32, seed=1)
    teacher = inputs.logits.clone()
    config = config_for("ppo_tis", dict(distill_kind="forward_kl"))
    extra = {}
    if what == "unread":
        config = config_for("ppo_tis", {})
    elif what == "missing":
        teacher = None
    elif what == "inplace":
        extra = dict(inplace="forward")
    elif what == "grad":
        teacher.requires_grad_()
    elif what == "shape":
        teacher = teacher[:, :-1]
    elif what == "nan":
        teacher[int(inputs.mask.nonzero()[0, 0]), 3] = float("nan")
    elif what in ("beta", "orphan"):
        with pytest.raises(ValueError, match=match):
            config_for("ppo_tis", dict(distill_kind="jsd", distill_beta=1.5) if what == "beta" else
                       dict(distill_coef=0.5))
        return
    logits = inputs.logits.clone().requires_grad_()
    before = logits.detach().clone()
    with pytest.raises((ValueError, TypeError), match=match):
        fused_is.policy_loss(logits, inputs.tokens, inputs.advantages, config=config, backend="cpu",
                             **inputs.kwargs(teacher_logits=teacher, **extra))
    assert torch.equal(logits.detach(), before)  # nothing written before the error
