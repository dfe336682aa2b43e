"""M2PO (LossConfig.m2_threshold): the second-moment trust region of asynchronous RL, on every backend against the
float64 reference, its selection against a brute force, its metrics and its errors."""

import itertools

import pytest
import torch

import fused_is
from fused_is import backends
from fused_is.coefficients import m2po_keep

from cases import areal_functions, check_against_reference, config_for, make_inputs

BACKENDS = [b for b in backends.available_backends() if b != "reference"]


def _brute_force_keep(delta2, mask, threshold):
    """The smallest set of tokens to drop, largest delta^2 first (earlier first among equals), whose rest has a mean
    below threshold, by trying every count k in turn: the definition, not its suffix-sum shortcut."""
    ranked = sorted((i for i in range(len(delta2)) if mask[i]), key=lambda i: (-delta2[i], i))
    n = len(ranked)
    for k in range(n):
        rest = ranked[k:]
        if sum(delta2[i] for i in rest) / len(rest) < threshold:
            break
    else:
        k = max(n - 1, 0)
    keep = [1.0 if mask[i] else 0.0 for i in range(len(delta2))]
    for i in ranked[:k]:
        keep[i] = 0.0
    return keep


@pytest.mark.parametrize("seed", range(6))
def test_selection_is_the_definition(seed):
    g = torch.Generator().manual_seed(seed)
    n = 40
    samp = torch.randn(n, generator=g, dtype=torch.float64) * 0.5 - 3.0
    old = samp + torch.randn(n, generator=g, dtype=torch.float64) * torch.rand(n, generator=g, dtype=torch.float64)
    old[5] = samp[5] + (old[7] - samp[7])  # a tie in delta^2: the earlier token leaves first
    mask = (torch.rand(n, generator=g) < 0.8).double()
    delta2 = ((samp - old) ** 2).tolist()
    for threshold in (1e-4, 0.01, 0.05, 0.2, 10.0):
        keep = m2po_keep(samp, old, mask, threshold)
        assert keep.tolist() == _brute_force_keep(delta2, mask.tolist(), threshold), threshold
        assert keep.sum() >= 1  # one token always stays


def test_selection_edge_cases():
    samp = torch.tensor([-1.0, -2.0, -3.0], dtype=torch.float64)
    old = torch.tensor([-1.5, -2.5, -3.5], dtype=torch.float64)  # three equal delta^2 = 0.25
    none = torch.zeros(3, dtype=torch.float64)
    assert m2po_keep(samp, old, none, 0.1).tolist() == [0.0, 0.0, 0.0]  # nothing unmasked: nothing kept
    assert m2po_keep(samp, old, torch.ones(3, dtype=torch.float64), 0.1).tolist() == [0.0, 0.0, 1.0]  # the last stays
    assert m2po_keep(samp, old, torch.ones(3, dtype=torch.float64), 0.3).tolist() == [1.0, 1.0, 1.0]


CASES = [("ppo", dict(m2_threshold=0.05)),
         ("ppo_tis", dict(m2_threshold=0.02, loss_agg="seq-mean-token-mean")),
         ("sapo", dict(m2_threshold=0.05)),
         ("ppo_tis", dict(m2_threshold=0.05, rejection={"token_k1": (0.6, 1.8)}))]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", ["padded", "packed"])
@pytest.mark.parametrize("preset,overrides", CASES, ids=["ppo", "ppo_tis_seq_agg", "sapo", "with_rejection"])
def test_against_the_reference(backend, layout, preset, overrides):
    inputs = make_inputs(layout, dtype=torch.float32, seed=11)
    cfg = config_for(preset, overrides)
    out, _, ref, _ = check_against_reference(inputs, cfg, backend)
    assert 0.0 < ref.metrics["m2po_masked_frac"] < 1.0  # the threshold binds on some tokens, not all
    assert out.metrics["m2po_masked_frac"] == pytest.approx(ref.metrics["m2po_masked_frac"])


def test_dropped_tokens_leave_the_loss_and_the_counts():
    """M2PO is the caller's mask with the dropped tokens removed: the same loss and gradient as a call with that
    mask."""
    inputs = make_inputs("packed", dtype=torch.float32, seed=2)
    kw = inputs.kwargs()
    cfg = config_for("ppo", dict(m2_threshold=0.01))
    x = inputs.logits.clone().requires_grad_()
    out = fused_is.policy_loss(x, inputs.tokens, inputs.advantages, config=cfg, backend="torch", **kw)
    out.loss.backward()
    mask = kw.pop("mask", None)
    mask = torch.ones_like(inputs.tokens, dtype=torch.bool) if mask is None else mask.bool()
    keep = m2po_keep(inputs.sampler_logprobs.double().reshape(-1), inputs.old_logprobs.double().reshape(-1),
                     mask.double().reshape(-1), 0.01).bool().reshape(mask.shape)
    assert 0 < int(keep.sum()) < int(mask.sum())
    y = inputs.logits.clone().requires_grad_()
    plain = fused_is.policy_loss(y, inputs.tokens, inputs.advantages, config=config_for("ppo"), backend="torch",
                                 mask=keep, **kw)
    plain.loss.backward()
    assert torch.allclose(out.loss, plain.loss, rtol=1e-6) and torch.allclose(x.grad, y.grad, rtol=1e-5, atol=1e-9)
    delta2 = (inputs.sampler_logprobs - inputs.old_logprobs).double()[mask] ** 2
    assert out.metrics["m2po_m2"] == pytest.approx(float(delta2.mean()), rel=1e-6)
    assert out.metrics["m2po_masked_frac"] == pytest.approx(1 - int(keep.sum()) / int(mask.sum()))


@pytest.mark.parametrize("missing,value", list(itertools.product(["sampler_logprobs", "old_logprobs"], [None])))
def test_needs_the_behaviour_and_the_proximal_logprobs(missing, value):
    inputs = make_inputs("packed", dtype=torch.float32, seed=1)
    kw = inputs.kwargs()
    kw[missing] = value
    with pytest.raises(ValueError, match=f"{missing} is required by LossConfig.m2_threshold"):
        fused_is.policy_loss(inputs.logits, inputs.tokens, inputs.advantages, config=config_for("ppo", dict(
            m2_threshold=0.1)), backend="torch", **kw)


@pytest.mark.parametrize("bad,error", [(0.0, ValueError), (-1.0, ValueError), (float("inf"), ValueError),
                                       (float("nan"), ValueError), ("0.1", TypeError), (True, TypeError)])
def test_bad_threshold_names_the_field(bad, error):
    with pytest.raises(error, match="m2_threshold"):
        fused_is.LossConfig(m2_threshold=bad)


@pytest.mark.parametrize("seed", range(8))
def test_equal_to_areal(seed):
    """AReaL's _apply_m2po_masking (behaviour logprob, proximal logprob, loss mask, threshold) keeps the tokens
    m2po_keep keeps, on [batch, seq_len] masks, wherever its unstable sort cannot decide a tie (no ties here)."""
    (apply_m2po,) = areal_functions("_apply_m2po_masking", "_get_m2po_loss_mask")[:1]
    g = torch.Generator().manual_seed(seed)
    shape = (4, 33)
    behaviour = torch.randn(shape, generator=g) * 0.5 - 3.0
    proximal = behaviour + torch.randn(shape, generator=g) * torch.rand(shape, generator=g) * 0.7
    loss_mask = torch.rand(shape, generator=g) < 0.7
    for threshold in (1e-3, 0.02, 0.08, 0.3, 5.0):
        theirs = apply_m2po(behaviour, proximal, loss_mask, threshold)
        ours = m2po_keep(behaviour.double().reshape(-1), proximal.double().reshape(-1), loss_mask.double().reshape(-1),
                         threshold)
        assert torch.equal(theirs.reshape(-1), ours.bool()), threshold
