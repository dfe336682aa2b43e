"""fused_is.integrations.nemo_rl against NeMo-RL's ClippedPGLossFn.

NeMo-RL is not on the package index, so CI cannot install it. Every case runs against `nemo_clipped_pg` below: a
float64 transcription of ClippedPGLossFn's arithmetic (logprobs from the logits by log-softmax, then the loss and
metrics on NeMo-RL's [B, S] micro-batch layout, position 0 unused), with the gradient by autograd. Where
FUSED_IS_NEMO_RL_SRC names a NeMo-RL checkout, the same cases also run against its own
`nemo_rl/algorithms/loss/loss_functions.py` (loaded without NeMo-RL's package imports: its training stack);
elsewhere that comparison is skipped with the reason.
"""

import ast
import dataclasses
import importlib.util
import math
import os
import sys
import types
from pathlib import Path

import pytest
import torch

from fused_is import backends
from fused_is.integrations import nemo_rl
from fused_is.testing import rel_err, tolerance
from fused_is.integrations.nemo_rl import FusedClippedPGLossFn, clipped_pg_loss_from_logits, config_from_nemo_rl

B, S, V = 4, 9, 64
NEMO_SRC = os.environ.get("FUSED_IS_NEMO_RL_SRC")


def _kl(kind, logprobs, reference):
    r = reference - logprobs
    return -r if kind == "k1" else r * r / 2 if kind == "k2" else torch.exp(r) - 1 - r


def _mean(x, mask, count):
    return (x * mask).sum() / (count + 1e-8)


def nemo_clipped_pg(cfg, logits, data, seqs, toks):
    """ClippedPGLossFn's loss and its main metrics in float64, option by option as NeMo-RL computes them."""
    c = dict(nemo_rl.DEFAULTS, **cfg)
    lp = torch.log_softmax(logits[:, :-1].double(), -1).gather(-1, data["input_ids"][:, 1:, None]).squeeze(-1)
    tm, sm = data["token_mask"][:, 1:].double(), data["sample_mask"].double()
    adv, gen = data["advantages"][:, 1:].double(), data["generation_logprobs"][:, 1:].double()
    mask = tm * sm[:, None]
    prev = lp.detach() if c["force_on_policy_ratio"] else data["prev_logprobs"][:, 1:].double()
    seq_mean = lambda x, m: (x * m).sum(-1) / (m.sum(-1) + 1e-8)  # noqa: E731
    penalty = 0.0 if c["use_kl_in_reward"] else c["reference_policy_kl_penalty"]
    token_level = c["token_level_loss"]
    agg = (lambda x: _mean(x, mask, toks)) if token_level else (lambda x: _mean(seq_mean(x, tm), sm, seqs))  # noqa
    kl = torch.zeros((), dtype=torch.float64)
    if penalty:
        ref = data["reference_policy_logprobs"][:, 1:].double()
        r = ref - lp
        w = torch.exp(lp - (gen if c["use_on_policy_kl_approximation"] else lp.detach()))
        w = torch.where(torch.isfinite(w.float()), w, 0.0)  # NeMo-RL's fp32 weight: nan_to_num makes an overflow 0
        if c["kl_input_clamp_value"] is not None:
            rc = r.clamp(-c["kl_input_clamp_value"], c["kl_input_clamp_value"])
            w, r = torch.where(r == rc, w, w.detach()), rc
        k = w * _kl(c["reference_policy_kl_type"], -r, torch.zeros_like(r))
        if c["kl_output_clamp_value"] is not None:
            k = k.clamp(-c["kl_output_clamp_value"], c["kl_output_clamp_value"])
        kl = penalty * agg(k)
    if c["force_on_policy_ratio"]:
        ratios = clamped = torch.exp(lp - lp.detach())
    elif not c["disable_ppo_ratio"]:
        log_ratio = lp - prev
        ratios = (seq_mean(log_ratio, tm).exp()[:, None].expand_as(lp) if c["sequence_level_importance_ratios"]
                  else log_ratio.exp())
        clamped = ratios.clamp(1 - c["ratio_clip_min"], 1 + c["ratio_clip_max"])
    else:
        ratios = clamped = lp
    if c["use_cispo"]:
        loss = -adv * clamped.detach() * lp
    else:
        loss = torch.max(-adv * ratios, -adv * clamped)
    if c["ratio_clip_c"] is not None:
        loss = torch.where(adv < 0, torch.min(loss, -adv * c["ratio_clip_c"]), loss)
    if c["sequence_level_importance_ratios"]:
        weights = torch.exp(((prev - gen) * mask).sum(-1)).detach()[:, None]
    else:
        weights = torch.exp(prev - gen)
    weights = torch.nan_to_num(weights, nan=0.0, posinf=0.0, neginf=0.0)
    kind, cap, floor = (c["truncated_importance_sampling_type"], c["truncated_importance_sampling_ratio"],
                        c["truncated_importance_sampling_ratio_min"])
    if kind == "tis":
        weights = weights.clamp(0.0 if floor is None else floor, cap)
    elif kind == "icepop":
        weights = torch.where((weights >= floor) & (weights <= cap), weights, 0.0)
    elif kind == "seq-mask-tis":
        geo = torch.exp(seq_mean(prev - gen, tm))
        weights = weights * ((geo >= floor) & (geo <= cap)).double()[:, None]
    if not c["use_importance_sampling_correction"]:
        weights = torch.ones_like(lp)
    nll = torch.zeros((), dtype=torch.float64)
    if c["positive_example_nll_weight"] > 0 and "rewards" in data:
        correct = mask * (data["rewards"] > 0).double()[:, None]
        if correct.sum() > 0:
            nll = _mean(-lp, correct, correct.sum())
    total = agg(weights * loss) + kl + c["positive_example_nll_weight"] * nll
    raw = torch.exp(((prev - gen) * mask).sum(-1) if c["sequence_level_importance_ratios"] else prev - gen).detach()
    if c["sequence_level_importance_ratios"]:  # the mean of the sequences' weights (see the module's docs)
        final = raw.clamp(0.0 if floor is None else floor, cap) if kind == "tis" else raw
        importance = float(_mean(final, sm, seqs))
    else:
        importance = float(_mean(weights.detach() if c["use_importance_sampling_correction"] else raw, mask, toks))
    log_m = torch.log(0.5 * torch.exp(prev) + 0.5 * torch.exp(gen))
    js = 0.5 * (torch.exp(prev - log_m) - (prev - log_m) - 1) + 0.5 * (torch.exp(gen - log_m) - (gen - log_m) - 1)
    valid = mask.bool()
    metrics = dict(policy_kl_error=float(_mean(_kl(c["reference_policy_kl_type"], prev, gen), mask, toks)),
                   js_divergence_error=float(_mean(js, mask, toks)), sampling_importance_ratio=importance,
                   probs_ratio_min=float(ratios.detach()[valid].min()),
                   probs_ratio_max=float(ratios.detach()[valid].max()),
                   probs_ratio_clamped_min=float(clamped.detach()[valid].min()),
                   probs_ratio_clamped_max=float(clamped.detach()[valid].max()))
    if kind in ("tis", "icepop"):
        out = ((raw < (0.0 if floor is None else floor)) | (raw > cap)).double()
        metrics["is_oob_ratio"] = float(_mean(out[:, None] if c["sequence_level_importance_ratios"] else out, mask,
                                              toks))
    elif kind == "seq-mask-tis":
        geo = torch.exp(seq_mean(prev - gen, tm))
        metrics["is_oob_ratio"] = float(_mean(1.0 - ((geo >= floor) & (geo <= cap)).double(), sm, seqs))
    metrics.update(positive_nll_loss=float(nll.detach()), probs_ratio=float(_mean(ratios.detach(), mask, toks)),
                   probs_ratio_clamped=float(_mean(clamped.detach(), mask, toks)),
                   kl_penalty=float(kl.detach()) / penalty if penalty else 0.0,
                   approx_entropy=-float(_mean(torch.exp(lp - gen) * lp, mask, toks).detach()),
                   token_mult_prob_error=float(_mean(torch.exp((gen - prev).abs() * mask), mask, toks)),
                   gen_kl_error=float(_mean(_kl(c["reference_policy_kl_type"], gen, prev), mask, toks)))
    return total, metrics


def make_batch(seed, dtype=torch.float32, mismatch=0.3):
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(B, S, V, generator=gen, dtype=torch.float64) * 2).to(dtype)
    ids = torch.randint(0, V, (B, S), generator=gen)
    lp = torch.log_softmax(logits.double(), -1)[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)
    pad = lambda x: torch.cat([torch.zeros(B, 1, dtype=x.dtype), x], 1)  # noqa: E731  (position 0 unused)
    noise = lambda: mismatch * torch.randn(B, S - 1, generator=gen, dtype=torch.float64)  # noqa: E731
    token_mask = (torch.rand(B, S, generator=gen) > 0.2).float()
    token_mask[:, :3] = 0  # a prompt
    token_mask[0, 3:] = 1
    token_mask[3] = 0  # a sample without a valid token: NeMo-RL's sequence means count it
    data = dict(input_ids=ids, advantages=torch.randn(B, S, generator=gen).float(), token_mask=token_mask,
                sample_mask=torch.tensor([1.0, 1.0, 0.0, 1.0]), prev_logprobs=pad(lp + noise()).float(),
                generation_logprobs=pad(lp + noise()).float(), reference_policy_logprobs=pad(lp + noise()).float(),
                rewards=torch.tensor([1.0, 0.0, 1.0, 1.0]))
    return logits, data


CASES = {
    "defaults": {},
    "is_dual_clip_asymmetric": dict(use_importance_sampling_correction=True, ratio_clip_c=1.1, ratio_clip_max=0.28,
                                    reference_policy_kl_penalty=0.0),
    "kl_input_clamp_moot": dict(reference_policy_kl_type="k1", reference_policy_kl_penalty=0.3,
                                kl_input_clamp_value=0.5, kl_output_clamp_value=0.4, ratio_clip_min=1.5),
    "tis_floor_k1": dict(use_importance_sampling_correction=True, truncated_importance_sampling_type="tis",
                         truncated_importance_sampling_ratio=1.5, truncated_importance_sampling_ratio_min=0.8,
                         reference_policy_kl_type="k1", reference_policy_kl_penalty=0.1),
    "icepop_seq_loss": dict(use_importance_sampling_correction=True, truncated_importance_sampling_type="icepop",
                            truncated_importance_sampling_ratio=1.6, truncated_importance_sampling_ratio_min=0.7,
                            token_level_loss=False),
    "seq_mask_tis": dict(use_importance_sampling_correction=True, truncated_importance_sampling_type="seq-mask-tis",
                         truncated_importance_sampling_ratio=1.1, truncated_importance_sampling_ratio_min=0.95,
                         reference_policy_kl_type="k2", reference_policy_kl_penalty=0.05),
    "gspo_tis": dict(sequence_level_importance_ratios=True, token_level_loss=False, ratio_clip_min=0.03,
                     ratio_clip_max=0.04, use_importance_sampling_correction=True,
                     truncated_importance_sampling_type="tis", truncated_importance_sampling_ratio=1.2),
    "reinforce_is": dict(disable_ppo_ratio=True, use_importance_sampling_correction=True,
                         truncated_importance_sampling_type="tis", truncated_importance_sampling_ratio=1.1),
    "force_on_policy_tis_kl_clamps": dict(force_on_policy_ratio=True, use_importance_sampling_correction=True,
                                          truncated_importance_sampling_type="tis",
                                          truncated_importance_sampling_ratio=1.2, reference_policy_kl_penalty=0.5,
                                          kl_output_clamp_value=0.02, kl_input_clamp_value=None),
    "cispo_icepop_no_clamps": dict(use_cispo=True, ratio_clip_min=1.0, ratio_clip_max=0.1,
                                   use_importance_sampling_correction=True,
                                   truncated_importance_sampling_type="icepop", truncated_importance_sampling_ratio=5.0,
                                   truncated_importance_sampling_ratio_min=0.5, kl_input_clamp_value=None,
                                   kl_output_clamp_value=None),
    "kl_in_reward": dict(use_kl_in_reward=True, ratio_clip_c=1.5),
    # the input clamp binding alone (no output clamp): the estimator's value at the bound, no gradient there
    "kl_input_clamp_alone": dict(reference_policy_kl_type="k2", reference_policy_kl_penalty=0.3,
                                 kl_input_clamp_value=0.3, kl_output_clamp_value=None),
    # NeMo-RL's on-policy KL approximation (kl_weight="sampler"; both clamps binding, each alone somewhere: the weight
    # exp(lp - gen) moves the KL across the output clamp), and VAPO's NLL on correct samples (composed)
    "on_policy_kl_approximation": dict(use_on_policy_kl_approximation=True, reference_policy_kl_penalty=0.2,
                                       reference_policy_kl_type="k1", kl_input_clamp_value=0.4,
                                       kl_output_clamp_value=0.3, use_importance_sampling_correction=True,
                                       truncated_importance_sampling_type="tis",
                                       truncated_importance_sampling_ratio=2.0),
    "vapo_nll_seq_loss": dict(positive_example_nll_weight=0.5, token_level_loss=False,
                              use_on_policy_kl_approximation=True),
    # ProRL v2's: the ratio forced to 1, sequences masked by the geometric mean of the current over the sampler's
    "force_on_policy_seq_mask_tis": dict(force_on_policy_ratio=True, use_importance_sampling_correction=True,
                                         truncated_importance_sampling_type="seq-mask-tis",
                                         truncated_importance_sampling_ratio=1.1,
                                         truncated_importance_sampling_ratio_min=0.95, reference_policy_kl_penalty=0.0),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("global_counts", [False, True], ids=["local", "global"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_loss_gradient_and_metrics(name, global_counts, dtype):
    cfg = CASES[name]
    logits, data = make_batch(sorted(CASES).index(name), dtype)
    tol = tolerance(dtype, "cpu")
    mask = data["token_mask"][:, 1:] * data["sample_mask"][:, None]
    # global counts: as if other micro-batches held as many tokens and sequences again
    toks, seqs = (2 * mask.sum(), 2 * data["sample_mask"].sum()) if global_counts else (mask.sum(),
                                                                                      data["sample_mask"].sum())
    ref_logits = logits.double().requires_grad_()
    expected, expected_metrics = nemo_clipped_pg(cfg, ref_logits, data, float(seqs), float(toks))
    expected.backward()
    x = logits.clone().requires_grad_()
    counts = (seqs, toks) if global_counts else (None, None)
    loss, metrics = FusedClippedPGLossFn(cfg)(logits=x, data=data, global_valid_seqs=counts[0],
                                              global_valid_toks=counts[1])
    loss.backward()
    scale = max(1.0, abs(float(expected)))
    assert abs(float(loss) - float(expected)) <= tol["loss"] * scale, (float(loss), float(expected))
    assert x.grad.dtype == dtype and rel_err(x.grad, ref_logits.grad) <= tol["grad"]
    assert x.grad[:, -1].abs().max() == 0  # the last position scores no token
    for key, value in expected_metrics.items():
        assert metrics[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
    assert metrics["loss"] == pytest.approx(float(loss)) and metrics["num_valid_samples"] == 3.0


@pytest.mark.parametrize("backend", [b for b in backends.available_backends() if b != "reference"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_every_backend(name, backend):
    """Each case's loss and gradient on every backend here (the kernels form the KL's score term in their pass)."""
    cfg = CASES[name]
    logits, data = make_batch(sorted(CASES).index(name))
    ref_logits = logits.double().requires_grad_()
    expected, _ = nemo_clipped_pg(cfg, ref_logits, data, 6.0, 40.0)
    expected.backward()
    x = logits.clone().requires_grad_()
    loss, _ = clipped_pg_loss_from_logits(cfg, x, data, 6.0, 40.0, backend=backend)
    loss.backward()
    tol = tolerance(torch.float32, backend)
    assert abs(float(loss) - float(expected)) <= tol["loss"] * max(1.0, abs(float(expected)))
    assert rel_err(x.grad, ref_logits.grad) <= tol["grad"]


def test_padded_packed_sequence_logits():
    """NeMo-RL's sequence packing hands a sequence's logits with its padding (longer than its input_ids): the rows
    past the sequence are not read and get no gradient."""
    logits, data = make_batch(2)
    longer = torch.cat([logits, torch.full((B, 3, V), float("nan"))], 1).requires_grad_()
    exact = logits.clone().requires_grad_()
    for x in (longer, exact):
        loss, _ = clipped_pg_loss_from_logits(CASES["tis_floor_k1"], x, data, 6.0, 40.0)
        loss.backward()
    torch.testing.assert_close(longer.grad[:, :S], exact.grad, rtol=0, atol=0)
    assert longer.grad[:, S - 1:].abs().max() == 0


def test_composed_terms_refuse_inplace_and_stay_out_of_the_config():
    """The option without a LossConfig (VAPO's NLL): config_from_nemo_rl names it; the loss function composes it,
    not with inplace (its logprobs read the logits again). The on-policy KL approximation is a LossConfig field
    (kl_weight="sampler"), in the kernels' pass: in place too, the same loss and gradient."""
    cfg = dict(positive_example_nll_weight=0.5)
    with pytest.raises(ValueError, match="NeMo-RL loss option positive_example_nll_weight=.*as a term of its own"):
        config_from_nemo_rl(cfg)
    assert FusedClippedPGLossFn(cfg).composed == ("positive_example_nll_weight",)
    logits, data = make_batch(0)
    with pytest.raises(ValueError, match="inplace with"):
        clipped_pg_loss_from_logits(cfg, logits.clone().requires_grad_() * 1, data, inplace=True)
    cfg = CASES["on_policy_kl_approximation"]
    config = config_from_nemo_rl(cfg)
    assert config.kl_weight == "sampler" and (config.kl_input_clamp, config.kl_clamp) == (0.4, 0.3)
    assert FusedClippedPGLossFn(cfg).composed == ()
    grads = []
    for inplace in (False, True):
        leaf = logits.clone().requires_grad_()
        loss, _ = clipped_pg_loss_from_logits(cfg, leaf * 1 if inplace else leaf, data, 3.0, 20.0, inplace=inplace)
        loss.backward()
        grads.append(leaf.grad)
    assert grads[0].abs().max() > 0 and rel_err(grads[1], grads[0]) <= 1e-6


def test_composed_terms_edges():
    """VAPO without rewards or without a correct sample adds nothing; the on-policy KL's weight overflowing in fp32
    is 0, as NeMo-RL's nan_to_num makes it; validate="async" works beside the composed terms."""
    logits, data = make_batch(5)
    cfg = dict(positive_example_nll_weight=0.7, reference_policy_kl_penalty=0.0)
    base = float(clipped_pg_loss_from_logits(dict(reference_policy_kl_penalty=0.0), logits, data)[0])
    for batch in ({k: v for k, v in data.items() if k != "rewards"}, dict(data, rewards=torch.zeros(B))):
        loss, metrics = clipped_pg_loss_from_logits(cfg, logits, batch)
        assert float(loss) == pytest.approx(base, rel=1e-6) and metrics["positive_nll_loss"] == 0.0
    gen = data["generation_logprobs"].clone()
    gen[1, 4] = -120.0  # exp(lp + 120) overflows fp32
    data = dict(data, generation_logprobs=gen)
    cfg = dict(use_on_policy_kl_approximation=True, reference_policy_kl_penalty=0.5, kl_input_clamp_value=None,
               kl_output_clamp_value=None)
    ref_logits = logits.double().requires_grad_()
    expected, expected_metrics = nemo_clipped_pg(cfg, ref_logits, data, 3.0, 20.0)
    expected.backward()
    x = logits.clone().requires_grad_()
    loss, metrics = clipped_pg_loss_from_logits(cfg, x, data, 3.0, 20.0, validate="async")
    loss.backward()
    assert abs(float(loss) - float(expected)) <= 1e-5 * max(1.0, abs(float(expected)))
    assert rel_err(x.grad, ref_logits.grad) <= 1e-5


def test_metric_normalizations():
    """The global count dividing each metric, as ClippedPGLossFn advertises it to NeMo-RL's split-step trainers."""
    fn = FusedClippedPGLossFn(dict(token_level_loss=False, sequence_level_importance_ratios=True,
                                   use_importance_sampling_correction=True, truncated_importance_sampling_type="tis",
                                   truncated_importance_sampling_ratio=2.0))
    value = lambda name: str(getattr(fn.metric_normalizations[name], "value", fn.metric_normalizations[name]))  # noqa
    assert [value(n) for n in ("loss", "kl_penalty", "sampling_importance_ratio", "is_oob_ratio", "probs_ratio",
                               "num_valid_samples", "probs_ratio_max")] == ["sequences"] * 3 + ["tokens"] * 2 + \
        ["none"] * 2
    logits, data = make_batch(0)
    _, metrics = fn(logits=logits, data=data, global_valid_seqs=3.0, global_valid_toks=20.0)
    assert set(metrics) == set(fn.metric_normalizations)


def test_the_kl_carries_its_score_term():
    """NeMo-RL's KL gradient gains the estimator's value (its weight exp(lp - sg(lp))): without it the gradient
    differs, so the comparison above can tell."""
    logits, data = make_batch(0)
    cfg = dict(reference_policy_kl_penalty=1.0, ratio_clip_min=0.0, ratio_clip_max=0.0)
    assert config_from_nemo_rl(cfg).kl_weight == "score"
    grads = []
    for weight in ("score", "none"):
        x = logits.clone().requires_grad_()
        config = dataclasses.replace(config_from_nemo_rl(cfg), kl_weight=weight)
        import fused_is
        mask = (data["token_mask"][:, 1:] * data["sample_mask"][:, None]).bool()
        out = fused_is.policy_loss(x[:, :-1], data["input_ids"][:, 1:], data["advantages"][:, 1:], config=config,
                                   sampler_logprobs=data["generation_logprobs"][:, 1:],
                                   old_logprobs=data["prev_logprobs"][:, 1:],
                                   ref_logprobs=data["reference_policy_logprobs"][:, 1:], mask=mask)
        out.loss.backward()
        grads.append(x.grad)
    assert (grads[0] - grads[1]).abs().max() > 1e-3 * grads[0].abs().max()


def test_mapping():
    cfg = config_from_nemo_rl({})
    assert (cfg.policy, cfg.clip_low, cfg.clip_high, cfg.is_level, cfg.loss_agg) == ("ppo", 0.2, 0.2, "none",
                                                                                       "token-mean")
    assert (cfg.kl_coef, cfg.kl_type, cfg.kl_weight, cfg.kl_clamp) == (0.01, "k3", "score", 10.0)
    assert not cfg.coefficients_given  # the KL's score term is formed in the kernels' one pass
    seq = config_from_nemo_rl(CASES["seq_mask_tis"])
    assert (seq.is_level, seq.is_mode, seq.rejection_counts) == ("token", "raw", "keep")
    (option, low, high), = seq.rejection
    assert option == "seq_mean_k1" and low == pytest.approx(1 / 1.1) and high == pytest.approx(1 / 0.95)
    assert config_from_nemo_rl(CASES["gspo_tis"]).ratio_level == "sequence"
    assert config_from_nemo_rl(dict(use_kl_in_reward=True)).kl_coef == 0.0
    # an object with ClippedPGLossConfig's attributes, as the pydantic model is
    obj = types.SimpleNamespace(**dict(nemo_rl.DEFAULTS, ratio_clip_c=3.0))
    assert config_from_nemo_rl(obj).dual_clip == 3.0
    fn = FusedClippedPGLossFn(dict(token_level_loss=False))
    assert fn.input_type in ("logit",) or getattr(fn.input_type, "value", None) == "logit"
    assert str(getattr(fn.loss_type, "value", fn.loss_type)) == "sequence_level"


@pytest.mark.parametrize("cfg,option", [
    (dict(positive_example_nll_weight=-0.1), "positive_example_nll_weight"),
    (dict(reference_policy_kl_type="k4"), "reference_policy_kl_type"),
    (dict(reference_policy_kl_type="k4", reference_policy_kl_penalty=0.0), "reference_policy_kl_type"),
    (dict(kl_input_clamp_value=-5.0), "kl_input_clamp_value"),
    (dict(kl_output_clamp_value=0.0), "kl_output_clamp_value"),
    (dict(ratio_clip_max=-0.1), "ratio_clip_max"),
    (dict(ratio_clip_min=float("inf")), "ratio_clip_min"),
    (dict(sequence_level_importance_ratios=True), "sequence_level_importance_ratios"),
    (dict(use_cispo=True, ratio_clip_c=3.0), "ratio_clip_c"),
    (dict(ratio_clip_c=0.9), "ratio_clip_c"),
    (dict(truncated_importance_sampling_ratio=2.0), "truncated_importance_sampling_ratio"),
    (dict(truncated_importance_sampling_type="tis", truncated_importance_sampling_ratio=2.0),
     "truncated_importance_sampling_type"),
    (dict(use_importance_sampling_correction=True, truncated_importance_sampling_type="icepop",
          truncated_importance_sampling_ratio=2.0), "truncated_importance_sampling_ratio_min"),
])
def test_refused_by_name(cfg, option):
    with pytest.raises(ValueError, match=f"NeMo-RL loss option {option}="):
        config_from_nemo_rl(cfg)


def test_a_filtering_sampler_is_refused():
    """NeMo-RL filters its training logprobs by the sampler's top-k / top-p on its logprob input only."""
    assert FusedClippedPGLossFn({}, generation_config=dict(top_k=None, top_p=1.0, temperature=0.7)).config
    for option, value in (("top_k", 50), ("top_p", 0.9)):
        with pytest.raises(ValueError, match=f"generation option {option}={value}"):
            FusedClippedPGLossFn({}, generation_config={**dict(top_k=None, top_p=1.0), option: value})


def test_bad_inputs_are_named():
    logits, data = make_batch(1)
    with pytest.raises(ValueError, match="data\\['token_mask'\\] must hold 0 and 1"):
        clipped_pg_loss_from_logits({}, logits, dict(data, token_mask=data["token_mask"] * 0.5))
    with pytest.raises(ValueError, match="curr_logprobs_unfiltered"):
        clipped_pg_loss_from_logits({}, logits, dict(data, curr_logprobs_unfiltered=data["prev_logprobs"]))
    with pytest.raises(ValueError, match="logits must be \\[B, S', V\\]"):
        clipped_pg_loss_from_logits({}, logits[:, 1:], data)
    with pytest.raises(ValueError, match="reference_policy_logprobs"):
        clipped_pg_loss_from_logits({}, logits, {k: v for k, v in data.items() if k != "reference_policy_logprobs"})
    with pytest.raises(TypeError, match="unexpected keyword"):
        clipped_pg_loss_from_logits({}, logits, data, backend_name="cpu")
    before = {k: v.clone() for k, v in data.items()}
    clipped_pg_loss_from_logits({}, logits, data)
    assert all(torch.equal(before[k], data[k]) for k in data)  # nothing written into the caller's tensors


# ---------------------------------------------------------------------------------------------------------------
# NeMo-RL's own code, from a checkout


def _nemo_loss_module(src: Path):
    """nemo_rl/algorithms/loss/loss_functions.py of the checkout, its imports that are not the loss's (the training
    stack: transformers, ray, megatron) replaced by empty stand-ins, and calculate_kl / masked_mean taken from the
    checkout's nemo_rl/algorithms/utils.py by name (that module imports the stack at its top)."""
    def module(name, **attrs):
        mod = types.ModuleType(name)
        mod.__dict__.update(attrs)
        sys.modules[name] = mod
        return mod

    saved = {k: v for k, v in sys.modules.items() if k == "nemo_rl" or k.startswith("nemo_rl.")}
    try:
        for name in ("nemo_rl", "nemo_rl.algorithms", "nemo_rl.algorithms.loss", "nemo_rl.algorithms.x_token",
                     "nemo_rl.distributed", "nemo_rl.models", "nemo_rl.models.dtensor"):
            module(name).__path__ = []

        class BatchedDataDict(dict):
            def __class_getitem__(cls, item):
                return cls

        module("nemo_rl.distributed.batched_data_dict", BatchedDataDict=BatchedDataDict)
        module("nemo_rl.distributed.model_utils", **dict.fromkeys(
            ["DistributedCrossEntropy", "cp_shift_next", "group_all_reduce_sum", "vocab_parallel_full_log_softmax",
             "vocab_parallel_gather_columns", "vocab_parallel_log_softmax"]))
        module("nemo_rl.models.dtensor.parallelize", to_local_if_dtensor=lambda x: x)
        module("nemo_rl.algorithms.x_token.loss_utils", **dict.fromkeys(
            ["LocalizedAlignment", "build_exact_token_map", "ce_label_mask", "chunk_average_log_probs",
             "get_sparse_projection_matrix", "next_token_accuracy", "project_student_to_teacher_vocab",
             "select_teacher_topk_indices", "slice_sparse_projection_cols", "student_next_token_ce",
             "valid_chunk_mask"]))
        tree = ast.parse((src / "nemo_rl/algorithms/utils.py").read_text())
        wanted = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in ("calculate_kl", "masked_mean")]
        utils = module("nemo_rl.algorithms.utils")
        exec("import torch\nfrom typing import Optional\n", utils.__dict__)
        exec(compile(ast.Module(body=wanted, type_ignores=[]), "nemo_rl/algorithms/utils.py", "exec"), utils.__dict__)
        for name in ("interfaces", "loss_functions"):
            spec = importlib.util.spec_from_file_location(f"nemo_rl.algorithms.loss.{name}",
                                                          src / f"nemo_rl/algorithms/loss/{name}.py")
            mod = importlib.util.module_from_spec(spec)
            sys.modules[spec.name] = mod
            spec.loader.exec_module(mod)
        # the worker's top-k logprobs of distillation (its branch without tensor or context parallelism reads torch
        # alone), by name from nemo_rl/distributed/model_utils.py
        tree = ast.parse((src / "nemo_rl/distributed/model_utils.py").read_text())
        topk = [n for n in tree.body if isinstance(n, ast.FunctionDef)
                and n.name == "get_distillation_topk_logprobs_from_logits"]
        scope = {}
        exec("import torch\nimport torch.distributed.tensor\nfrom typing import Optional\n", scope)
        exec(compile(ast.Module(body=topk, type_ignores=[]), "nemo_rl/distributed/model_utils.py", "exec"), scope)
        mod.get_distillation_topk_logprobs_from_logits = scope["get_distillation_topk_logprobs_from_logits"]
        return mod
    finally:
        for k in [k for k in sys.modules if k == "nemo_rl" or k.startswith("nemo_rl.")]:
            del sys.modules[k]
        sys.modules.update(saved)


@pytest.mark.skipif(not NEMO_SRC, reason="NeMo-RL is not on the package index: set FUSED_IS_NEMO_RL_SRC to a "
                    "checkout of it to compare with its own ClippedPGLossFn")
def test_side_by_side_with_nemo_rl():
    """Every case against NeMo-RL's own ClippedPGLossFn: loss, gradient and every metric it returns."""
    pytest.importorskip("pydantic", reason="NeMo-RL's ClippedPGLossConfig is a pydantic model")
    loss_functions = _nemo_loss_module(Path(NEMO_SRC))
    for name in sorted(CASES):
        for global_counts in (True, False):
            _side_by_side(loss_functions, name, global_counts)


def _side_by_side(loss_functions, name, global_counts):
    cfg = CASES[name]
    logits, data = make_batch(sorted(CASES).index(name))
    mask = data["token_mask"][:, 1:] * data["sample_mask"][:, None]
    toks, seqs = (2 * mask.sum(), 2 * data["sample_mask"].sum()) if global_counts else (None, None)
    theirs_logits = logits.double().requires_grad_()
    lp = torch.log_softmax(theirs_logits[:, :-1], -1).gather(-1, data["input_ids"][:, 1:, None]).squeeze(-1)
    theirs = loss_functions.ClippedPGLossFn(loss_functions.ClippedPGLossConfig(**cfg))
    double = {k: v.double() if v.is_floating_point() else v for k, v in data.items()}
    expected, expected_metrics = theirs(lp, double, None if seqs is None else seqs.double(),
                                        None if toks is None else toks.double())
    expected.backward()
    x = logits.clone().requires_grad_()
    loss, metrics = FusedClippedPGLossFn(cfg)(logits=x, data=data, global_valid_seqs=seqs, global_valid_toks=toks)
    loss.backward()
    assert abs(float(loss) - float(expected)) <= 2e-6 * max(1.0, abs(float(expected))), (name, float(loss),
                                                                                        float(expected))
    torch.testing.assert_close(x.grad.double(), theirs_logits.grad, rtol=1e-5,
                               atol=1e-6 * float(theirs_logits.grad.abs().max()), msg=name)
    skip = {"sampling_importance_ratio"} if cfg.get("sequence_level_importance_ratios") else set()
    for key, value in expected_metrics.items():
        if key not in skip:
            assert metrics[key] == pytest.approx(value, rel=1e-5, abs=1e-6), (name, key)


# ---------------------------------------------------------------------------------------------------------------
# DistillationLossFn

K = 5


def make_distillation_batch(seed, dtype=torch.float32):
    logits, data = make_batch(seed, dtype)
    gen = torch.Generator().manual_seed(seed + 1000)
    teacher_full = logits.double() + 1.5 * torch.randn(B, S, V, generator=gen, dtype=torch.float64)
    top = teacher_full.topk(K, dim=-1)
    return logits, dict(input_ids=data["input_ids"], token_mask=data["token_mask"], sample_mask=data["sample_mask"],
                        teacher_topk_logits=top.values.float(), teacher_topk_indices=top.indices)


def nemo_distillation(cfg, logits, data, toks):
    """DistillationLossFn's loss in float64, with the student's and teacher's top-k logprobs formed as NeMo-RL's
    worker forms them (the whole-vocabulary log-softmax gathered with zero_outside_topk, else the log-softmax of
    the k gathered logits)."""
    c = dict(nemo_rl.DISTILLATION_DEFAULTS, **cfg)
    idx = data["teacher_topk_indices"]
    full = torch.log_softmax(logits.double(), -1)
    student = full.gather(-1, idx) if c["zero_outside_topk"] else torch.log_softmax(logits.double().gather(-1, idx), -1)
    teacher = torch.log_softmax(data["teacher_topk_logits"].double(), -1)
    h_all = torch.where(full.exp() > 0, full.exp() * full, 0.0).sum(-1)  # 0 log 0 = 0 at a -inf logit
    student, teacher, h_all = student[:, :-1], teacher[:, :-1], h_all[:, :-1]
    p, q = student.exp(), teacher.exp()
    fwd, rev = (q * (teacher - student)).sum(-1), (p * (student - teacher)).sum(-1)
    w = c["mixed_kl_weight"]
    per_token = {"forward": fwd, "reverse": rev, "mixed": w * fwd + (1 - w) * rev}[c["kl_type"]]
    if c["zero_outside_topk"] and c["kl_type"] != "forward":
        rest = h_all - (p * student).sum(-1) + 100.0 * (1 - p.sum(-1))
        per_token = per_token + (rest if c["kl_type"] == "reverse" else (1 - w) * rest)
    mask = data["token_mask"][:, 1:].double() * data["sample_mask"].double()[:, None]
    return (per_token * mask).sum() / (toks + 1e-8)


DISTILL_CASES = [dict(kl_type=kind, zero_outside_topk=zero, mixed_kl_weight=0.3)
                 for kind in ("forward", "reverse", "mixed") for zero in (False, True)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("backend", [b for b in backends.available_backends() if b != "reference"])
@pytest.mark.parametrize("cfg", DISTILL_CASES, ids=[f"{c['kl_type']}-{'zero' if c['zero_outside_topk'] else 'renorm'}"
                                                    for c in DISTILL_CASES])
def test_distillation_loss_and_gradient(cfg, backend, dtype):
    from fused_is.integrations.nemo_rl import FusedDistillationLossFn

    logits, data = make_distillation_batch(DISTILL_CASES.index(cfg), dtype)
    ref_logits = logits.double().requires_grad_()
    expected = nemo_distillation(cfg, ref_logits, data, 40.0)
    expected.backward()
    x = logits.clone().requires_grad_()
    loss, metrics = FusedDistillationLossFn(cfg, backend=backend)(logits=x, data=data, global_valid_seqs=6.0,
                                                                  global_valid_toks=40.0)
    loss.backward()
    tol = tolerance(dtype, backend)
    assert abs(float(loss) - float(expected)) <= max(tol["loss"], 2e-6) * max(1.0, abs(float(expected)))
    assert x.grad.dtype == dtype and rel_err(x.grad, ref_logits.grad) <= tol["grad"]
    assert metrics == {"loss": pytest.approx(float(loss)), "num_valid_samples": B}
    assert x.grad[:, -1].abs().max() == 0


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("kind,weight", [("mixed", 0.0), ("mixed", 1.0), ("reverse", 0.5), ("forward", 0.5)])
def test_distillation_hard_rows(kind, weight, dtype):
    """-inf student logits (a padded vocabulary), a masked prompt row of huge logits, one teacher token (k = 1) in
    one row and a repeated id in another: the gradient stays finite and equal to the float64 reference's."""
    from fused_is.integrations.nemo_rl import FusedDistillationLossFn

    logits, data = make_distillation_batch(7, dtype)
    logits = logits.clone()
    logits[..., V - 4:] = float("-inf")
    logits[1, 1] = 90.0 + logits[1, 1].float().clamp(-10, 10).to(dtype)  # a prompt row (masked)
    idx = data["teacher_topk_indices"].clamp(max=V - 5)
    idx[0, 4] = idx[0, 4, :1]  # one token repeated k times: k = 1 in effect
    idx[2, 5, 1] = idx[2, 5, 0]
    data = dict(data, teacher_topk_indices=idx)
    cfg = dict(kl_type=kind, mixed_kl_weight=weight, zero_outside_topk=True)
    ref_logits = logits.double().requires_grad_()
    expected = nemo_distillation(cfg, ref_logits, data, 40.0)
    expected.backward()
    x = logits.clone().requires_grad_()
    loss, _ = FusedDistillationLossFn(cfg)(logits=x, data=data, global_valid_toks=40.0)
    loss.backward()
    assert torch.isfinite(x.grad).all() and torch.isfinite(loss)
    assert abs(float(loss) - float(expected)) <= 1e-5 * max(1.0, abs(float(expected)))
    valid = torch.isfinite(ref_logits.grad)
    assert bool(valid[:, :-1].any())
    assert rel_err(x.grad[valid], ref_logits.grad[valid]) <= tolerance(dtype, "cpu")["grad"]


def test_distillation_inputs_and_options():
    from fused_is.integrations.nemo_rl import FusedDistillationLossFn, distillation_loss_from_logits

    logits, data = make_distillation_batch(0)
    fn = FusedDistillationLossFn({})
    assert (fn.kl_type, fn.mixed_kl_weight, fn.zero_outside_topk) == ("mixed", 0.5, False)
    local = float(fn(logits=logits, data=data)[0])  # the micro-batch's own count
    count = float((data["token_mask"][:, 1:] * data["sample_mask"][:, None]).sum())
    assert local == pytest.approx(float(nemo_distillation({}, logits, data, count)), rel=1e-6)
    no_mask = {k: v for k, v in data.items() if k not in ("token_mask", "sample_mask")}  # NeMo-RL: the plain mean
    expected = nemo_distillation({}, logits, dict(no_mask, token_mask=torch.ones(B, S), sample_mask=torch.ones(B)),
                                 B * (S - 1) - 1e-8)
    assert float(fn(logits=logits, data=no_mask)[0]) == pytest.approx(float(expected), rel=1e-6)
    # the backward's row blocks: three rows a block gives the same gradient as one block
    cfg = dict(kl_type="reverse", zero_outside_topk=True)
    grads = []
    for rows in (1 << 22, 3 * V):
        x = logits.clone().requires_grad_()
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(nemo_rl._TopkLogprobs, "ROW_ELEMENTS", rows)
            FusedDistillationLossFn(cfg)(logits=x, data=data)[0].backward()
        grads.append(x.grad)
    assert torch.equal(grads[0], grads[1])
    for cfg, option in ((dict(kl_type="jsd"), "kl_type"), (dict(mixed_kl_weight=1.5), "mixed_kl_weight")):
        with pytest.raises(ValueError, match=f"NeMo-RL loss option {option}="):
            FusedDistillationLossFn(cfg)
    bad = dict(data, teacher_topk_indices=data["teacher_topk_indices"] + V)
    with pytest.raises(ValueError, match="teacher_topk_indices'\\] must be in"):
        distillation_loss_from_logits({}, logits, bad)
    with pytest.raises(ValueError, match="teacher_topk_logits'\\] must be \\[B, S, k\\]"):
        distillation_loss_from_logits({}, logits, dict(data, teacher_topk_logits=data["teacher_topk_logits"][:, 1:]))
    with pytest.raises(TypeError, match="unexpected keyword"):
        distillation_loss_from_logits({}, logits, data, inplace=True)
    with pytest.raises(ValueError, match="vocab_group needs an initialised torch.distributed"):
        distillation_loss_from_logits({}, logits, data, vocab_group=object())


@pytest.mark.skipif(not NEMO_SRC, reason="NeMo-RL is not on the package index: set FUSED_IS_NEMO_RL_SRC to a "
                    "checkout of it to compare with its own DistillationLossFn")
def test_distillation_side_by_side_with_nemo_rl():
    """Every distillation case against NeMo-RL's own DistillationLossFn, its top-k logprobs from NeMo-RL's own
    get_distillation_topk_logprobs_from_logits: loss and gradient."""
    from fused_is.integrations.nemo_rl import FusedDistillationLossFn

    pytest.importorskip("pydantic", reason="NeMo-RL's DistillationLossConfig is a pydantic model")
    loss_functions = _nemo_loss_module(Path(NEMO_SRC))
    for cfg in DISTILL_CASES:
        logits, data = make_distillation_batch(DISTILL_CASES.index(cfg))
        theirs_logits = logits.double().requires_grad_()
        # NeMo-RL's worker casts the student's logits to fp32: the comparison is at fp32's precision
        student, teacher, h_all = loss_functions.get_distillation_topk_logprobs_from_logits(
            theirs_logits * 1.0, data["teacher_topk_logits"].double(), data["teacher_topk_indices"],
            cfg["zero_outside_topk"], cfg["zero_outside_topk"] and cfg["kl_type"] != "forward")
        theirs = loss_functions.DistillationLossFn(loss_functions.DistillationLossConfig(**cfg))
        double = {k: v.double() if v.is_floating_point() else v for k, v in data.items()}
        expected, _ = theirs(student, teacher, h_all, double, torch.tensor(6.0), torch.tensor(40.0))
        expected.backward()
        x = logits.clone().requires_grad_()
        loss, _ = FusedDistillationLossFn(cfg)(logits=x, data=data, global_valid_seqs=6.0, global_valid_toks=40.0)
        loss.backward()
        assert abs(float(loss) - float(expected)) <= 2e-6 * max(1.0, abs(float(expected))), (cfg, float(loss))
        assert rel_err(x.grad, theirs_logits.grad) <= 1e-5, cfg
