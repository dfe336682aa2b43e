"""fused_is.integrations.verl against verl's own engine loss (`verl.workers.utils.losses.ppo_loss`, verl 0.9.1
installed without its dependencies by the README's test command), with verl's own TensorDict inputs and its
own rollout-correction weights and rejection masks, on the CPU.

verl's loss takes the engine's log_probs; ours takes the engine's packed logits. Both start from one logits
leaf: verl's side computes log_probs and entropy from it as its engine does (float64), ours runs the fused
kernel on it, and loss and d loss / d logits are compared.
"""

import os
import warnings

import pytest
import torch

if os.environ.get("CI") == "true":  # installed by scripts/dev.sh: no skip in CI
    import verl  # noqa: F401
else:
    pytest.importorskip("verl", reason="verl is installed (--no-deps) by the README's test command")

from tensordict import TensorDict  # noqa: E402
from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_rejection_mask  # noqa: E402
from verl.utils import tensordict_utils as tu  # noqa: E402
from verl.trainer.config.algorithm import RolloutCorrectionConfig  # noqa: E402
from verl.workers.config.actor import ActorConfig, PolicyLossConfig  # noqa: E402
from verl.workers.utils.losses import ppo_loss  # noqa: E402

from fused_is import backends  # noqa: E402
import fused_is.integrations.verl as fused_verl  # noqa: E402
from fused_is.integrations.verl import config_from_verl, ppo_loss_from_logits  # noqa: E402

warnings.filterwarnings("ignore", category=UserWarning)
V = 64
BACKENDS = [b for b in backends.available_backends() if b != "reference"]


def _nested(xs):
    return torch.nested.nested_tensor(xs, layout=torch.jagged)


def _batch(seed, *, per_sequence_advantages=True, rollout_is=None, rollout_rs=None, ref=False):
    """A verl micro-batch: ragged prompts and responses (one response masked out entirely), the old and rollout
    logprobs (rollout = old + mismatch), advantages, verl's own IS weights / rejection mask when asked."""
    gen = torch.Generator().manual_seed(seed)
    b = 5
    plens = torch.randint(1, 5, (b,), generator=gen).tolist()
    rlens = torch.randint(1, 8, (b,), generator=gen).tolist()
    prompts = [torch.randint(0, V, (p,), generator=gen) for p in plens]
    responses = [torch.randint(0, V, (r,), generator=gen) for r in rlens]
    total = sum(plens) + sum(rlens)
    logits = torch.randn(total, V, generator=gen, dtype=torch.float64) * 2
    width = max(rlens)
    pad = lambda xs: torch.stack([torch.nn.functional.pad(x, (0, width - len(x))) for x in xs])  # noqa: E731
    mask = pad([torch.ones(r) for r in rlens])
    mask[1] = 0  # a sequence with no response token left
    old = -torch.rand(b, width, generator=gen, dtype=torch.float64) * 3
    rollout = (old + 0.4 * torch.randn(b, width, generator=gen, dtype=torch.float64)).clamp(max=0)
    if per_sequence_advantages:
        adv = torch.randn(b, 1, generator=gen, dtype=torch.float64).expand(b, width).clone()
    else:
        adv = torch.randn(b, width, generator=gen, dtype=torch.float64)
    fields = {}
    given = float(mask.sum())
    if rollout_is is not None or rollout_rs is not None:
        weights, mask, _ = compute_rollout_correction_and_rejection_mask(
            old_log_prob=old, rollout_log_prob=rollout, response_mask=mask, **(rollout_is or {}),
            **(rollout_rs or {}))
        if weights is not None:
            fields["rollout_is_weights"] = weights.batch["rollout_is_weights"]
    if ref:
        fields["ref_log_prob"] = (old + 0.3 * torch.randn(b, width, generator=gen, dtype=torch.float64)).clamp(max=0)
    cut = lambda x: _nested([x[i, :r] for i, r in enumerate(rlens)])  # noqa: E731
    data = TensorDict({"prompts": _nested(prompts), "responses": _nested(responses), "response_mask": cut(mask),
                       "old_log_probs": cut(old), "advantages": cut(adv),
                       **{k: cut(v) for k, v in fields.items()}}, batch_size=[b])
    return logits, data, given - float(mask.sum())  # the number of tokens verl's rejection took out


def _verl_loss(config, logits, data):
    """verl's engine path: log_probs and entropy of each packed row for the next token, then ppo_loss."""
    prompts, responses = data["prompts"], data["responses"]
    ids = torch.cat([torch.cat([p, r]) for p, r in zip(prompts.unbind(), responses.unbind())])
    offsets = torch.cat([torch.zeros(1, dtype=torch.long),
                         (prompts.offsets().diff() + responses.offsets().diff()).cumsum(0)])
    logp = torch.log_softmax(logits, -1)
    lp = logp.gather(-1, torch.roll(ids, -1)[:, None])[:, 0]
    entropy = -(logp.exp() * logp).sum(-1)
    nested = lambda x: torch.nested.nested_tensor_from_jagged(x, offsets)  # noqa: E731
    return ppo_loss(config, {"log_probs": nested(lp), "entropy": nested(entropy)}, data)


def _bypass(**kw):
    return RolloutCorrectionConfig(bypass_mode=True, **kw)


def _actor(**kw):
    loss_mode = kw.pop("loss_mode", "vanilla")
    return ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size=2,
                       policy_loss=PolicyLossConfig(loss_mode=loss_mode, **kw.pop("clip_cov", {})), **kw)


CASES = [
    ("vanilla_token_mean", dict(), dict()),
    ("vanilla_tis", dict(), dict(rollout_is=dict(rollout_is="token", rollout_is_threshold=1.5))),
    ("vanilla_seq_tis_seq_mean_token_mean", dict(loss_agg_mode="seq-mean-token-mean"),
     dict(rollout_is=dict(rollout_is="sequence", rollout_is_threshold=2.0))),
    ("vanilla_rejection_seq_token_sum", dict(loss_agg_mode="seq-mean-token-sum"),
     dict(rollout_rs=dict(rollout_rs="token_k1,seq_mean_k3", rollout_rs_threshold="0.6_1.8,0.1"))),
    ("vanilla_tis_and_rejection_norm", dict(loss_agg_mode="seq-mean-token-sum-norm", clip_ratio_high=0.28),
     dict(rollout_is=dict(rollout_is="token", rollout_is_threshold=2.0),
          rollout_rs=dict(rollout_rs="seq_max_k2", rollout_rs_threshold="0.27"))),
    ("vanilla_token_sum_kl_entropy", dict(loss_agg_mode="token-sum", use_kl_loss=True, kl_loss_coef=0.1,
                                          entropy_coeff=0.01), dict(ref=True)),
    ("vanilla_kl_k3_plus_scale", dict(loss_agg_mode="seq-mean-token-sum-norm", loss_scale_factor=16, use_kl_loss=True,
                                      kl_loss_coef=0.2, kl_loss_type="k3+"), dict(ref=True)),
    ("vanilla_kl_k1_mse", dict(use_kl_loss=True, kl_loss_type="mse", kl_loss_coef=0.1), dict(ref=True)),
    ("cispo_tis", dict(loss_mode="cispo", clip_ratio_low=0.3, clip_ratio_high=0.1),
     dict(rollout_is=dict(rollout_is="token", rollout_is_threshold=2.0))),
    ("gspo_seq_mean_token_mean", dict(loss_mode="gspo", loss_agg_mode="seq-mean-token-mean", clip_ratio_low=3e-4,
                                      clip_ratio_high=4e-4), dict()),
    ("sapo", dict(loss_mode="sapo", loss_agg_mode="seq-mean-token-mean", tau_pos=1.2, tau_neg=1.6,
                  entropy_coeff=0.01), dict()),
    ("dppo_tv_tis", dict(loss_mode="dppo_tv", clip_ratio_low=0.01, clip_ratio_high=0.005, clip_ratio_c=1.5),
     dict(rollout_is=dict(rollout_is="token", rollout_is_threshold=2.0))),
    ("dppo_kl_seq_mean", dict(loss_mode="dppo_kl", loss_agg_mode="seq-mean-token-mean", clip_ratio_low=0.002,
                              clip_ratio_high=0.001), dict()),
    # Clip-Cov's random subset: both sides draw from torch's default CPU generator, seeded alike by the test
    ("clip_cov_tis", dict(loss_mode="clip_cov", clip_cov=dict(clip_cov_ratio=0.2, clip_cov_lb=-0.5, clip_cov_ub=3.0)),
     dict(rollout_is=dict(rollout_is="token", rollout_is_threshold=2.0))),
    ("kl_cov_seq_mean_token_mean", dict(loss_mode="kl_cov", loss_agg_mode="seq-mean-token-mean",
                                        clip_cov=dict(kl_cov_ratio=0.05, ppo_kl_coef=0.5)), dict()),
    # GMPO: averaged over the B sequences whatever loss_agg_mode; the entropy term by loss_agg_mode; the rollout
    # IS weights as each sequence's geometric mean
    ("geo_mean", dict(loss_mode="geo_mean", clip_ratio_low=0.1, clip_ratio_high=0.15), dict()),
    ("geo_mean_tis_entropy", dict(loss_mode="geo_mean", clip_ratio_low=0.1, clip_ratio_high=0.15, entropy_coeff=0.01),
     dict(rollout_is=dict(rollout_is="token", rollout_is_threshold=1.5))),
    # GPG: REINFORCE (-A lp), times the rollout IS weights; DRO: REINFORCE plus beta/2 (lp - old)^2
    ("gpg_tis", dict(loss_mode="gpg"), dict(rollout_is=dict(rollout_is="token", rollout_is_threshold=1.5))),
    ("gpg_seq_mean_token_sum_entropy", dict(loss_mode="gpg", loss_agg_mode="seq-mean-token-sum", entropy_coeff=0.01),
     dict()),
    ("dro", dict(loss_mode="dro", clip_cov=dict(dro_beta=0.5)), dict()),
    ("dro_seq_mean_token_mean", dict(loss_mode="dro", clip_cov=dict(dro_beta=2.0), loss_agg_mode="seq-mean-token-mean"),
     dict()),
    # bypass mode (old_log_probs are the rollout's): PPO-clip against them (the data's IS weights ignored), or
    # REINFORCE with verl's own IS weight of the current policy over the rollout
    ("bypass_ppo_clip", dict(loss_mode="bypass_mode", clip_cov=dict(rollout_correction=_bypass())),
     dict(rollout_is=dict(rollout_is="token", rollout_is_threshold=1.5))),
    ("bypass_reinforce_token_tis", dict(loss_mode="bypass_mode", clip_cov=dict(rollout_correction=_bypass(
        loss_type="reinforce", rollout_is="token", rollout_is_threshold=1.5))), dict()),
    ("bypass_reinforce_seq_tis_seq_mean", dict(loss_mode="bypass_mode", loss_agg_mode="seq-mean-token-mean",
                                               clip_cov=dict(rollout_correction=_bypass(loss_type="reinforce"))), dict()),
    ("bypass_reinforce_token_icepop_entropy", dict(loss_mode="bypass_mode", entropy_coeff=0.01, clip_cov=dict(
        rollout_correction=_bypass(loss_type="reinforce", rollout_is="token", rollout_is_threshold="0.01_0.2"))),
     dict()),
    ("bypass_reinforce_no_is", dict(loss_mode="bypass_mode", clip_cov=dict(rollout_correction=_bypass(
        loss_type="reinforce", rollout_is=None))), dict()),
]


def _with_global(data, dp_size, agg):
    """verl's global batch info for one of dp_size ranks: the whole batch's tokens or sequences (here: this
    micro-batch's times dp_size, as if every rank held as many)."""
    mask = data.select("response_mask").to_padded_tensor()["response_mask"]
    tokens = float(mask.sum()) * dp_size
    seqs = float((mask.sum(-1) > 0).sum()) * dp_size
    tu.assign_non_tensor(data, dp_size=dp_size, batch_num_tokens=tokens if agg == "token-mean" else None,
                         global_batch_size=seqs if agg.startswith("seq") else None)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dp_size", [1, 2])
@pytest.mark.parametrize("name,actor,batch", CASES, ids=[c[0] for c in CASES])
def test_loss_and_gradient_equal_verl(name, actor, batch, dp_size, backend):
    """Loss and d loss / d logits equal verl's ppo_loss on the same micro-batch (fp32 kernels vs verl in fp64)."""
    logits, data, rejected = _batch(len(name) + dp_size, **batch)
    config = _actor(**actor)
    agg = config.loss_agg_mode
    if dp_size == 1:
        tu.assign_non_tensor(data, dp_size=1, batch_num_tokens=None, global_batch_size=None)
    else:
        _with_global(data, dp_size, agg)
    theirs = logits.clone().requires_grad_()
    torch.manual_seed(5)  # Clip-Cov draws its random subset from the default generator, on both sides
    loss_t, _ = _verl_loss(config, theirs, data)
    loss_t.backward()
    ours = logits.detach().float().requires_grad_()
    torch.manual_seed(5)
    loss_f, metrics = ppo_loss_from_logits(_actor(**actor), ours, data, backend=backend)
    loss_f.backward()
    scale = max(1.0, abs(float(loss_t)))
    assert abs(float(loss_f) - float(loss_t)) <= 2e-6 * scale, (float(loss_f), float(loss_t))
    err = float((ours.grad.double() - theirs.grad).norm())
    assert float(theirs.grad.norm()) > 0 and err <= 2e-5 * float(theirs.grad.norm()), err
    if batch.get("rollout_rs"):  # verl's rejection took some tokens out, not all
        assert 0 < rejected < rejected + float(data["response_mask"].values().sum())
    assert "fused_is/entropy_mean" in metrics
    if "cov" in name:  # the selection took some tokens
        assert metrics["fused_is/cov_selected_frac"] > 0


def test_gspo_with_per_token_advantages_is_refused():
    logits, data, _ = _batch(3, per_sequence_advantages=False)
    tu.assign_non_tensor(data, dp_size=1, batch_num_tokens=None, global_batch_size=None)
    with pytest.raises(ValueError, match="advantages that vary within a sequence"):
        ppo_loss_from_logits(_actor(loss_mode="gspo"), logits.float(), data)


@pytest.mark.parametrize("actor,option", [
    (dict(loss_mode="bypass_mode", clip_cov=dict(rollout_correction=_bypass(rollout_rs="token_k2",
                                                                             rollout_rs_threshold=0.5))),
     "policy_loss.rollout_correction.rollout_rs"),
    (dict(loss_mode="bypass_mode", clip_cov=dict(rollout_correction=_bypass(loss_type="reinforce",
                                                                             rollout_is_batch_normalize=True))),
     "policy_loss.rollout_correction.rollout_is_batch_normalize"),
    (dict(loss_mode="dro"), "policy_loss.dro_beta"),
    (dict(loss_mode="dro", clip_cov=dict(dro_beta=0.1), use_kl_loss=True), "use_kl_loss"),
    (dict(loss_mode="geo_mean", use_kl_loss=True), "use_kl_loss"),
    (dict(use_kl_loss=True, kl_loss_type="abs"), "kl_loss_type"),
    (dict(loss_mode="sapo", loss_agg_mode="token-mean", entropy_coeff=0.01), "loss_agg_mode"),
])
def test_unsupported_options_are_refused_by_name(actor, option):
    with pytest.raises(ValueError, match=f"verl actor config {option}="):
        config_from_verl(_actor(**actor))


def test_mapping_of_vanilla():
    """verl's vanilla loss always applies the dual clip (clip_ratio_c = 3) and clamps the log ratio at 20."""
    cfg = config_from_verl(_actor(clip_ratio=0.2, clip_ratio_high=0.28))
    assert (cfg.policy, cfg.dual_clip, cfg.log_ratio_clamp, cfg.clip_low, cfg.clip_high) == ("ppo", 3.0, 20.0, 0.2, 0.28)


HIDDEN_CASES = [CASES[1], CASES[4], CASES[5], CASES[9]]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("per_sample", [False, True], ids=["temperature", "per_sample_temperature"])
@pytest.mark.parametrize("name,actor,batch", HIDDEN_CASES, ids=[c[0] for c in HIDDEN_CASES])
def test_hidden_path_equals_verl(name, actor, batch, per_sample, backend):
    """ppo_loss_from_hidden (fused linear, chunks of 4 rows) against verl's ppo_loss on the logits
    hidden @ weight.T / temperature: loss and the gradients of hidden and weight. per_sample: one temperature per
    sequence, [B], spread over each sequence's packed rows as verl's FSDP engine spreads micro_batch["temperature"]
    (expand_as_nested over the input ids)."""
    logits, data, _ = _batch(len(name) + 7, **batch)
    tu.assign_non_tensor(data, dp_size=1, batch_num_tokens=None, global_batch_size=None)
    gen = torch.Generator().manual_seed(len(name))
    dim, temperature = 16, 0.7
    if per_sample:
        prompt_lens, response_lens, _ = fused_verl._lengths(data)
        temperature = 0.5 + torch.rand(prompt_lens.numel(), generator=gen, dtype=torch.float64)
        rows_tau = torch.repeat_interleave(temperature, prompt_lens + response_lens)[:, None]
    else:
        rows_tau = temperature
    hidden = torch.randn(logits.shape[0], dim, generator=gen, dtype=torch.float64)
    weight = torch.randn(V, dim, generator=gen, dtype=torch.float64) * 0.5
    h_t, w_t = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss_t, _ = _verl_loss(_actor(**actor), h_t @ w_t.t() / rows_tau, data)
    loss_t.backward()
    h_f, w_f = hidden.float().requires_grad_(), weight.float().requires_grad_()
    loss_f, _ = fused_verl.ppo_loss_from_hidden(_actor(**actor), h_f, w_f, data, temperature=temperature,
                                                chunk_size=4, backend=backend)
    loss_f.backward()
    assert abs(float(loss_f) - float(loss_t)) <= 2e-6 * max(1.0, abs(float(loss_t))), (float(loss_f), float(loss_t))
    for what, ours, theirs in (("hidden", h_f.grad, h_t.grad), ("weight", w_f.grad, w_t.grad)):
        err = float((ours.double() - theirs).norm())
        assert float(theirs.norm()) > 0 and err <= 2e-5 * float(theirs.norm()), (what, err)


@pytest.mark.parametrize("backend", BACKENDS)
def test_logits_path_divides_by_per_sample_temperature(backend):
    """ppo_loss_from_logits(raw logits, temperature=[B]) against verl's ppo_loss on the logits divided by each
    sequence's temperature over its packed rows: the division happens inside the kernels."""
    name, actor, batch = CASES[1]
    logits, data, _ = _batch(5, **batch)
    tu.assign_non_tensor(data, dp_size=1, batch_num_tokens=None, global_batch_size=None)
    prompt_lens, response_lens, _ = fused_verl._lengths(data)
    temperature = 0.5 + torch.rand(prompt_lens.numel(), generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    rows_tau = torch.repeat_interleave(temperature, prompt_lens + response_lens)[:, None]
    theirs = logits.detach().clone().requires_grad_()
    loss_t, _ = _verl_loss(_actor(**actor), theirs / rows_tau, data)
    loss_t.backward()
    ours = logits.detach().float().requires_grad_()
    loss_f, _ = ppo_loss_from_logits(_actor(**actor), ours, data, temperature=temperature, backend=backend)
    loss_f.backward()
    assert abs(float(loss_f.detach()) - float(loss_t.detach())) <= 2e-6 * max(1.0, abs(float(loss_t.detach())))
    err = float((ours.grad.double() - theirs.grad).norm())
    assert float(theirs.grad.norm()) > 0 and err <= 2e-5 * float(theirs.grad.norm()), err
    with pytest.raises(ValueError, match="per-sample temperature"):
        ppo_loss_from_logits(_actor(**actor), ours, data, temperature=temperature[:-1])


def test_dro_with_rollout_weights_is_refused():
    """verl multiplies DRO's whole per-token loss (its quadratic penalty too) by the rollout IS weights."""
    logits, data, _ = _batch(12, rollout_is=dict(rollout_is="token", rollout_is_threshold=1.5))
    tu.assign_non_tensor(data, dp_size=1, batch_num_tokens=None, global_batch_size=None)
    with pytest.raises(ValueError, match="loss_mode='dro' with rollout_is_weights"):
        ppo_loss_from_logits(_actor(loss_mode="dro", clip_cov=dict(dro_beta=0.5)), logits.float(), data)


def test_gspo_with_per_token_rollout_weights_is_refused():
    """verl's straight-through GSPO and fused_is's sequence gradient differ when W varies within a sequence."""
    logits, data, _ = _batch(4, rollout_is=dict(rollout_is="token", rollout_is_threshold=1.5))
    tu.assign_non_tensor(data, dp_size=1, batch_num_tokens=None, global_batch_size=None)
    with pytest.raises(ValueError, match="rollout_is_weights that vary within a sequence"):
        ppo_loss_from_logits(_actor(loss_mode="gspo"), logits.float(), data)


def _gspo_beyond_batch(seed):
    """A micro-batch whose sequences 0 and 2 have a mean log ratio log_prob - old_log_prob far above verl's clamp
    at 10 (old_log_probs 20 lower), with A < 0 on sequence 0 (the unclipped branch: without the clamp its gradient
    would be e^15 A) and A > 0 on sequence 2 (the clipped branch), beside ordinary sequences 3 and 4 (1 is empty; A > 0 and
    r < 1: unclipped, with a gradient)."""
    logits, data, _ = _batch(seed)
    shift = [-20.0, 0.0, -20.0, 0.0, 0.0]
    adv = [-0.7, 0.3, 1.1, 0.4, 0.9]
    data["old_log_probs"] = _nested([x + s for x, s in zip(data["old_log_probs"].unbind(), shift)])
    data["advantages"] = _nested([torch.full_like(x, a) for x, a in zip(data["advantages"].unbind(), adv)])
    tu.assign_non_tensor(data, dp_size=1, batch_num_tokens=None, global_batch_size=None)
    return logits, data


def _response_rows(data, b):
    """The packed logits rows that score sequence b's response tokens."""
    prompt_lens, response_lens, _ = fused_verl._lengths(data)
    start = int((prompt_lens + response_lens)[:b].sum()) + int(prompt_lens[b]) - 1
    return slice(start, start + int(response_lens[b]))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("agg", ["seq-mean-token-mean", "token-mean"])
def test_gspo_sequence_log_ratio_clamp_equals_verl(agg, backend):
    """verl's gspo clamps each token's log sequence ratio at 10 from above (torch.clamp, zero gradient beyond):
    config_from_verl maps it to sequence_log_ratio_max=10, and loss and gradient equal verl's on a micro-batch
    where two sequences lie beyond it (their rows get exactly zero gradient on both sides)."""
    actor = dict(loss_mode="gspo", loss_agg_mode=agg, clip_ratio_low=3e-4, clip_ratio_high=4e-4)
    assert config_from_verl(_actor(**actor)).sequence_log_ratio_max == 10.0
    logits, data = _gspo_beyond_batch(31)
    theirs = logits.clone().requires_grad_()
    loss_t, _ = _verl_loss(_actor(**actor), theirs, data)
    loss_t.backward()
    ours = logits.detach().float().requires_grad_()
    loss_f, _ = ppo_loss_from_logits(_actor(**actor), ours, data, backend=backend)
    loss_f.backward()
    # the case is what it claims: sequences 0 and 2 beyond 10 (mean log ratio), no verl gradient at their rows,
    # sequence 0's loss term -A e^10 dominating, sequences 3 and 4 with a gradient
    lp = torch.log_softmax(logits, -1)
    for b, beyond in ((0, True), (2, True), (3, False), (4, False)):
        rows = _response_rows(data, b)
        ids = data["responses"].unbind()[b]
        mean = float((lp[rows].gather(-1, ids[:, None])[:, 0] - data["old_log_probs"].unbind()[b]).mean())
        assert (mean > 10.5) == beyond and (mean < 9.5) != beyond, (b, mean)
        assert bool((theirs.grad[rows] == 0).all()) == beyond, b
        if beyond:
            assert bool((ours.grad[rows] == 0).all()), b
    assert float(loss_t) > 1000.0
    scale = max(1.0, abs(float(loss_t)))
    assert abs(float(loss_f) - float(loss_t)) <= 2e-6 * scale, (float(loss_f), float(loss_t))
    err = float((ours.grad.double() - theirs.grad).norm())
    assert float(theirs.grad.norm()) > 0 and err <= 2e-5 * float(theirs.grad.norm()), err


def test_gspo_without_the_clamp_differs_from_verl(monkeypatch):
    """The silent difference the mapping removes: on the same micro-batch, GSPO mapped without the clamp
    (sequence_log_ratio_max=None) has a large gradient at sequence 0's rows (e^15 |A|) where verl's is 0."""
    import dataclasses

    actor = dict(loss_mode="gspo", loss_agg_mode="seq-mean-token-mean", clip_ratio_low=3e-4, clip_ratio_high=4e-4)
    unclamped = lambda config: dataclasses.replace(config_from_verl(config), sequence_log_ratio_max=None)  # noqa: E731
    monkeypatch.setattr(fused_verl, "config_from_verl", unclamped)
    logits, data = _gspo_beyond_batch(31)
    ours = logits.detach().float().requires_grad_()
    loss_f, _ = ppo_loss_from_logits(_actor(**actor), ours, data, backend="torch")
    loss_f.backward()
    assert float(ours.grad[_response_rows(data, 0)].abs().max()) > 1.0
