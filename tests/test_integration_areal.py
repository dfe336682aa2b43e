"""fused_is.integrations.areal against AReaL's own actor loss (1.0.4, its wheel installed without dependencies by
scripts/dev.sh): `grpo_loss_fn` with `ppo_actor_loss_fn`, `sapo_loss_fn`, `apply_rejection_sampling`, M2PO and the
log-linear proximal approximation, as installed (tests/cases.py `areal_loss_code`: AReaL's modules import its whole
training stack, so their definitions are compiled from the installed files, unchanged; only its stats tracker is a
stand-in). Each option case compares the loss and its gradient w.r.t. the logits on fresh random micro-batches."""

import importlib.util
import math
import os
import types

import pytest
import torch

# `import areal` imports its training stack, which the suite does not install: look the wheel up instead
if importlib.util.find_spec("areal") is None and os.environ.get("CI") != "true":  # scripts/dev.sh installs it: CI runs
    pytest.skip("areal is installed (--no-deps) by scripts/dev.sh", allow_module_level=True)

from fused_is import backends  # noqa: E402
from fused_is.integrations.areal import config_from_areal, grpo_loss_from_logits  # noqa: E402

from cases import areal_loss_code  # noqa: E402

AREAL = areal_loss_code()
CURRENT = 9  # the version being trained (loglinear)
FAST = [b for b in backends.available_backends() if b not in ("reference", "torch")]


def _actor(rejection=None, **options):
    """AReaL's PPOActorConfig fields that reach grpo_loss_fn (its defaults), with AReaL's own RejectionSamplingConfig
    (its validation runs)."""
    fields = dict(eps_clip=0.2, eps_clip_higher=None, c_clip=None, m2_threshold=None, importance_sampling_level="token",
                  prox_logp_method="recompute", use_sapo_loss=False, sapo_tau_pos=1.0, sapo_tau_neg=1.05,
                  use_decoupled_loss=False, temperature=1.0,
                  rejection_sampling=None if rejection is None else AREAL["RejectionSamplingConfig"](**rejection))
    fields.update(options)
    return types.SimpleNamespace(**fields)


def _batch(seed: int, layout: str, vocab: int = 11, teacher=None):
    """(logits [.., V] float64 with fp32 values, AReaL's micro-batch dict): input_ids, the rolled loss mask (the rows
    that score a response token), behaviour logprobs (masked to 0 as AReaL's compute_advantages does) and proximal
    ones near the current ones, per-token advantages (they vary within a sequence), versions (-1 at prompt rows),
    cu_seqlens when packed; teacher: (rl_loss_weight, distill_loss_weight) adds joint distillation."""
    g = torch.Generator().manual_seed(seed)
    lengths, prompts = [9, 6, 12, 5, 10, 8], [3, 2, 4, 2, 3, 1]
    width = max(lengths)
    if layout == "packed":
        shape, starts = (sum(lengths),), torch.tensor([0] + lengths).cumsum(0)
        position = torch.cat([torch.arange(n) for n in lengths])
        owner = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    else:
        shape = (len(lengths), width)
        position = torch.arange(width).expand(shape)
        owner = torch.arange(len(lengths))[:, None].expand(shape)
    length, prompt = torch.tensor(lengths)[owner], torch.tensor(prompts)[owner]
    logits = (2.0 * torch.randn(*shape, vocab, generator=g)).double()
    input_ids = torch.randint(0, vocab, shape, generator=g)
    loss_mask = (position >= prompt - 1) & (position < length - 1) & (torch.rand(shape, generator=g) < 0.9)
    labels = torch.roll(input_ids, -1, dims=-1)
    lp = torch.log_softmax(logits, -1).gather(-1, labels[..., None])[..., 0]
    noise = lambda s: (s * torch.randn(shape, generator=g)).double()  # noqa: E731
    near = lambda x, s: (x + noise(s)).clamp(max=-1e-3).float().double()  # noqa: E731  (a logprob, fp32 values)
    prox = near(lp, 0.15)
    data = dict(input_ids=input_ids, loss_mask=loss_mask.float(), prox_logp=prox, logprobs=near(prox, 0.3) * loss_mask,
                advantages=noise(1.0),
                versions=torch.where(position < prompt, -1,
                                     torch.randint(CURRENT - 3, CURRENT + 1, shape, generator=g)))
    if layout == "packed":
        data["cu_seqlens"] = starts.int()
    if teacher is not None:
        data.update(teacher_logp=near(lp, 0.3), rl_loss_weight=teacher[0],
                    distill_loss_weight=teacher[1])
    return logits, data


def _areal_loss(actor, logits, data):
    """grpo_loss_fn as AReaL's PPOActor calls it, on log-probs and entropies as its engine computes them (here in
    fp64)."""
    logp = torch.log_softmax(logits / actor.temperature, -1)
    lp = logp.gather(-1, torch.roll(data["input_ids"], -1, dims=-1)[..., None])[..., 0]
    entropy = -(logp.exp() * logp).sum(-1)
    keys = ("eps_clip", "eps_clip_higher", "c_clip", "rejection_sampling", "m2_threshold", "importance_sampling_level",
            "prox_logp_method", "use_sapo_loss", "sapo_tau_pos", "sapo_tau_neg", "use_decoupled_loss")
    return AREAL["grpo_loss_fn"](lp, entropy, dict(data), current_version=CURRENT,
                                 **{key: getattr(actor, key) for key in keys})


DECOUPLED = dict(use_decoupled_loss=True)
LOGLINEAR = dict(use_decoupled_loss=True, prox_logp_method="loglinear")
GSPO = dict(importance_sampling_level="sequence", eps_clip=0.05)
# (name, actor options, rejection_sampling, teacher, the fused_is metric that must bind: 0 < value < 1)
CASES = [
    ("ppo", {}, None, None, "clip_frac"),
    ("clip_higher_dual_clip", dict(eps_clip=0.1, eps_clip_higher=0.15, c_clip=1.1), None, None, "clip_frac"),
    ("temperature", dict(temperature=0.7), None, None, "clip_frac"),
    ("token_ratio_mask", DECOUPLED, dict(upper=1.3, lower=0.8), None, "is_masked_frac"),
    ("token_ratio_clamp", DECOUPLED, dict(action="clamp", upper=1.25, lower=0.85), None, "is_truncated_frac"),
    ("seq_ratio_mask_mean", DECOUPLED, dict(level="sequence", upper=1.08, lower=0.95), None, "is_masked_frac"),
    ("seq_ratio_mask_sum", DECOUPLED, dict(level="sequence", agg="sum", upper=1.5, lower=0.6), None, "rejected_frac"),
    ("token_kl_k1", DECOUPLED, dict(metric="kl_k1", upper=0.3, lower=-0.2), None, "rejected_frac"),
    ("seq_kl_k1_mean", DECOUPLED, dict(level="sequence", metric="kl_k1", upper=0.06, lower=-0.06), None,
     "rejected_frac"),
    ("seq_kl_k1_sum", DECOUPLED, dict(level="sequence", metric="kl_k1", agg="sum", upper=1.0, lower=-0.8), None,
     "rejected_frac"),
    ("token_kl_k2", DECOUPLED, dict(metric="kl_k2", upper=0.05), None, "rejected_frac"),
    ("seq_kl_k2_mean", DECOUPLED, dict(level="sequence", metric="kl_k2", upper=0.045), None, "rejected_frac"),
    ("seq_kl_k2_max", DECOUPLED, dict(level="sequence", metric="kl_k2", agg="max", upper=0.1), None, "rejected_frac"),
    ("metrics_method", dict(DECOUPLED, prox_logp_method="metrics"), dict(upper=1.3, lower=0.8), None,
     "is_masked_frac"),
    ("gspo", dict(GSPO, c_clip=1.05), None, None, "clip_frac"),
    ("gspo_seq_ratio_clamp", dict(GSPO, **DECOUPLED), dict(level="sequence", action="clamp", upper=1.03, lower=0.97),
     None, "is_truncated_frac"),
    ("gspo_seq_kl_k2_sum", dict(GSPO, **DECOUPLED), dict(level="sequence", metric="kl_k2", agg="sum", upper=0.35),
     None, "rejected_frac"),
    ("m2po_token_ratio_mask", dict(DECOUPLED, m2_threshold=0.05), dict(upper=1.3), None, "m2po_masked_frac"),
    ("m2po_gspo", dict(GSPO, m2_threshold=0.05), None, None, "m2po_masked_frac"),
    ("sapo", dict(use_sapo_loss=True), None, None, None),
    ("sapo_steep_m2po", dict(use_sapo_loss=True, sapo_tau_pos=4.0, sapo_tau_neg=6.0, m2_threshold=0.05), None, None,
     "m2po_masked_frac"),
    ("loglinear_token_ratio_mask", LOGLINEAR, dict(upper=1.1, lower=0.9), None, "is_masked_frac"),
    ("loglinear_seq_ratio_clamp", LOGLINEAR, dict(level="sequence", action="clamp", upper=1.02, lower=0.98), None,
     "is_truncated_frac"),
    ("loglinear_gspo_seq_ratio_mask", dict(LOGLINEAR, **GSPO), dict(level="sequence", upper=1.03, lower=0.97), None,
     "is_masked_frac"),
    ("loglinear_sapo", dict(prox_logp_method="loglinear", use_sapo_loss=True), None, None, None),
    ("distillation", {}, None, (1.0, 0.1), "clip_frac"),
    ("distillation_weighted_m2po", dict(DECOUPLED, m2_threshold=0.05), dict(upper=1.3, lower=0.8), (0.7, 0.2),
     "m2po_masked_frac"),
]
PADDED = {"seq_ratio_mask_mean", "gspo", "gspo_seq_kl_k2_sum", "m2po_gspo", "loglinear_token_ratio_mask",
          "distillation_weighted_m2po"}


def _compare(name, options, rejection, teacher, binds, layout, backend):
    actor = _actor(rejection, **options)
    logits, data = _batch(len(name) + 7 * (layout == "padded"), layout, teacher=teacher)
    if actor.prox_logp_method == "loglinear":
        del data["prox_logp"]  # AReaL's trainer skips the proximal forward pass
    theirs = logits.clone().requires_grad_()
    loss_t = _areal_loss(actor, theirs, data)
    loss_t.backward()
    ours = logits.float().requires_grad_()
    loss_f, metrics = grpo_loss_from_logits(actor, ours, data, current_version=CURRENT, backend=backend)
    loss_f.backward()
    loss_f, loss_t = loss_f.detach(), loss_t.detach()
    assert abs(float(loss_f) - float(loss_t)) <= 2e-6 * max(1.0, abs(float(loss_t))), (float(loss_f), float(loss_t))
    err = float((ours.grad.double() - theirs.grad).norm())
    assert float(theirs.grad.norm()) > 0 and err <= 2e-5 * float(theirs.grad.norm()), err
    if binds is not None:  # the option acts on some tokens and not all, so a mapping error would show
        assert 0.0 < metrics[f"fused_is/{binds}"] < 1.0, (binds, metrics)


RUNS = [(*case, "packed") for case in CASES] + [(*case, "padded") for case in CASES if case[0] in PADDED]


@pytest.mark.parametrize("name,options,rejection,teacher,binds,layout", RUNS, ids=[f"{r[0]}-{r[-1]}" for r in RUNS])
def test_loss_and_gradient_equal_areals(name, options, rejection, teacher, binds, layout):
    """grpo_loss_from_logits (fp32 logits, the torch backend) equals AReaL's grpo_loss_fn in fp64: the loss and
    d loss / d logits, for every mapped option (the padded layout on the sequence-level and M2PO options)."""
    _compare(name, options, rejection, teacher, binds, layout, "torch")


# the fused kernels on a token-local case with a rejection gate, a sequence-ratio case with M2PO (the stats pass and
# the given coefficients) and the in-kernel loglinear proximal; the interpreted Triton on the last two only (CI time)
FUSED = [(name, backend) for backend in FAST
         for name in ("seq_ratio_mask_sum", "m2po_gspo", "loglinear_token_ratio_mask")
         if backend != "triton" or name != "seq_ratio_mask_sum"]


@pytest.mark.parametrize("name,backend", FUSED, ids=[f"{n}-{b}" for n, b in FUSED])
def test_fused_backends_equal_areals(name, backend):
    """The fused kernels (fp32) against AReaL's grpo_loss_fn (fp64), as above."""
    case = next(c for c in CASES if c[0] == name)
    _compare(*case, "packed", backend)


def test_mapping():
    """The LossConfig of a few actor configs, field by field."""
    cfg = config_from_areal(_actor(eps_clip=0.1, eps_clip_higher=0.3, c_clip=2.0, temperature=0.8))
    assert (cfg.policy, cfg.clip_low, cfg.clip_high, cfg.dual_clip, cfg.is_level, cfg.log_ratio_clamp,
            cfg.temperature, cfg.ratio_ref) == ("ppo", 0.1, 0.3, 2.0, "none", None, 0.8, "old")
    cfg = config_from_areal(_actor(dict(level="sequence", upper=2.0, lower=0.5), **LOGLINEAR, m2_threshold=None))
    assert (cfg.ratio_ref, cfg.is_level, cfg.is_mode, cfg.is_cap, cfg.is_floor) == ("loglinear", "geometric", "mask",
                                                                                       2.0, 0.5)
    cfg = config_from_areal(_actor(dict(metric="kl_k1", upper=0.3), **DECOUPLED))
    assert cfg.is_mode == "raw" and cfg.rejection_counts == "keep" and cfg.rejection[0][0] == "token_k1"
    assert math.isclose(cfg.rejection[0][1], math.exp(-0.3))
    cfg = config_from_areal(_actor(dict(upper=1.5), use_sapo_loss=True, sapo_tau_pos=2.0))
    assert (cfg.policy, cfg.ratio_ref, cfg.sapo_tau_pos, cfg.is_level) == ("sapo", "sampler", 2.0, "none")


@pytest.mark.parametrize("rejection,options,option", [
    (dict(metric="kl_k3", upper=0.5), DECOUPLED, "rejection_sampling.metric"),
    (dict(level="sequence", agg="max", upper=2.0), DECOUPLED, "rejection_sampling.agg"),
    (dict(level="sequence", agg="sum", action="clamp", upper=2.0), DECOUPLED, "rejection_sampling.agg"),
    (dict(level="sequence", agg="sum", upper=2.0), DECOUPLED, "rejection_sampling.lower"),
    (dict(level="sequence", metric="kl_k1", agg="max", upper=0.2), DECOUPLED, "rejection_sampling.agg"),
    (dict(level="sequence", metric="kl_k1", agg="sum", upper=0.2), DECOUPLED, "rejection_sampling.lower"),
    (dict(metric="kl_k2", upper=0.2, lower=0.1), DECOUPLED, "rejection_sampling.lower"),
    (dict(metric="kl_k2", upper=250.0), DECOUPLED, "rejection_sampling.upper"),
    (dict(metric="kl_k1", upper=25.0), DECOUPLED, "rejection_sampling.upper"),
    (dict(upper=1e9), DECOUPLED, "rejection_sampling.upper"),
    (dict(upper=2.0), dict(DECOUPLED, importance_sampling_level="sequence"), "rejection_sampling.action"),
    (dict(metric="kl_k1", upper=0.2), LOGLINEAR, "rejection_sampling.metric"),
    (None, dict(LOGLINEAR, m2_threshold=0.1), "m2_threshold"),
    (None, dict(use_sapo_loss=True, use_decoupled_loss=True), "use_sapo_loss"),
    (None, dict(use_sapo_loss=True, importance_sampling_level="sequence"), "importance_sampling_level"),
    (None, dict(use_sapo_loss=True, sapo_tau_neg=0.0), "sapo_tau_neg"),
    (None, dict(eps_clip=1.5), "eps_clip"),
    (None, dict(c_clip=1.0), "c_clip"),
    (None, dict(importance_sampling_level="geometric"), "importance_sampling_level"),
    (None, dict(prox_logp_method="linear"), "prox_logp_method"),
    (None, dict(behave_imp_weight_cap=5.0), "behave_imp_weight_cap"),
    (None, dict(enable_tree_training=True), "enable_tree_training"),
    (None, dict(is_critic=True), "is_critic"),
])
def test_unsupported_options_are_refused_by_name(rejection, options, option):
    with pytest.raises(ValueError, match=f"AReaL actor config {option}="):
        config_from_areal(_actor(rejection, **options))


@pytest.mark.parametrize("change,error,match", [
    (dict(prox_logp=None), ValueError, "prox_logp_method='recompute'"),  # AReaL raises as well
    (dict(rl_loss_weight=0.0, distill_loss_weight=0.1, teacher_logp="lp"), ValueError, "rl_loss_weight"),
    (dict(rl_loss_weight="x", teacher_logp="lp"), TypeError, "rl_loss_weight"),
    (dict(advantages=None), ValueError, "advantages"),
    (dict(logprobs="short"), ValueError, "logprobs"),
    (dict(input_ids="short"), ValueError, "logits must be"),
    (dict(cu_seqlens=None, gspo=True), ValueError, "cu_seqlens"),
    (dict(current_version=None, loglinear=True), TypeError, "current_version"),
    (dict(versions=None, loglinear=True), ValueError, "versions"),
])
def test_bad_micro_batch_names_the_entry(change, error, match):
    """Every problem of the micro-batch is a ValueError / TypeError naming the entry, before any kernel runs."""
    logits, data = _batch(3, "packed")
    change = dict(change)
    options = dict(GSPO) if change.pop("gspo", False) else {}
    current = change.pop("current_version", CURRENT)
    if change.pop("loglinear", False):
        options.update(LOGLINEAR)
        del data["prox_logp"]
    for key, value in change.items():
        data[key] = {"lp": data["logprobs"], "short": data["logprobs"][:-1] if key != "input_ids"
                     else data["input_ids"][:-1]}.get(value, value) if isinstance(value, str) and value != "x" \
            else value
    with pytest.raises(error, match=match):
        grpo_loss_from_logits(_actor(**options), logits.float(), data, current_version=current, backend="torch")


def test_plain_mapping_config_is_checked_by_name():
    """A config given as a plain mapping (AReaL's own validation has not run) is checked here, by full name."""
    with pytest.raises(ValueError, match="AReaL actor config rejection_sampling.metric='tv'"):
        config_from_areal(dict(use_decoupled_loss=True, rejection_sampling=dict(metric="tv")))
    with pytest.raises(TypeError, match="AReaL actor config rejection_sampling.upper must be a number"):
        config_from_areal(dict(rejection_sampling=dict(upper="2")))
    cfg = config_from_areal(dict(rejection_sampling=dict(action="clamp", upper=2.0)))  # AReaL's clamp floor: 0
    assert (cfg.is_mode, cfg.is_cap, cfg.is_floor) == ("truncate", 2.0, 0.0)
