"""AReaL (1.0.4) with fused_is: the PPO actor's loss (`grpo_loss_fn`) from the engine's logits.

AReaL's train engine turns each micro-batch's logits into log-probs and entropies and hands them, with the
micro-batch dict, to `areal.trainer.ppo.actor.grpo_loss_fn` (PPO or SAPO, the decoupled loss of asynchronous RL
with its rejection sampling, M2PO, the log-linear proximal approximation, joint distillation). `grpo_loss_from_logits`
takes the logits instead and computes the same loss in one fused pass; `config_from_areal` reads the actor config
(`PPOActorConfig`): every option that shapes the loss is mapped exactly or refused with a ValueError naming it.

Importing this module checks that AReaL is installed without importing it (its top-level package imports its whole
training stack); `import fused_is` does not import this module.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import numbers
from typing import Dict, Mapping, Optional, Tuple

import torch

import fused_is
from fused_is.coefficients import m2po_keep
from fused_is.config import LOG_WEIGHT_CLAMP, LossConfig

if importlib.util.find_spec("areal") is None:  # the trainer this module maps: fail clearly where it is not installed
    raise ModuleNotFoundError("fused_is.integrations.areal maps AReaL's actor loss: install AReaL (areal==1.0.4)",
                              name="areal")

_PROX_LOGP_METHODS = ("recompute", "loglinear", "metrics")
_LEVELS = ("token", "sequence")
# the options AReaL 1.0.4 removed (replaced by rejection_sampling): refused rather than ignored when a config has one
_REMOVED = ("behave_imp_weight_cap", "behave_imp_weight_mode", "behav_imp_weight_cap")
# a weight bound the +-20 clamp of log w (DESIGN.md section 2) would reach: AReaL does not clamp
_MAX_WEIGHT = math.exp(LOG_WEIGHT_CLAMP)


def _get(cfg, name: str, default=None):
    value = cfg.get(name, default) if isinstance(cfg, Mapping) else getattr(cfg, name, default)
    return default if value is None else value


def _refuse(option: str, value, why: str):
    raise ValueError(f"AReaL actor config {option}={value!r} is not supported by fused_is.integrations.areal: {why}")


def _choice(cfg, option: str, name: str, default: str, choices: tuple) -> str:
    """cfg's `name` (default when unset), refused by its full name `option` + name unless one of `choices`."""
    value = _get(cfg, name, default)
    if value not in choices:
        _refuse(option + name, value, f"expected one of {choices}")
    return value


def _float(cfg, option: str, name: str, default: Optional[float]) -> Optional[float]:
    """cfg's number `name` as a float (default when unset, which may be None), or a TypeError naming it."""
    value = _get(cfg, name, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"AReaL actor config {option}{name} must be a number; got {value!r}")
    return float(value)


def config_from_areal(actor_config, *, prox_logp_given: Optional[bool] = None) -> LossConfig:
    """The LossConfig of AReaL's `grpo_loss_fn` for an actor config (`PPOActorConfig`, or a mapping / namespace with
    its field names).

    Read: eps_clip, eps_clip_higher, c_clip, importance_sampling_level, use_sapo_loss, sapo_tau_pos, sapo_tau_neg,
    use_decoupled_loss, prox_logp_method, m2_threshold, rejection_sampling (level, action, metric, agg, upper,
    lower), temperature, and is_critic / enable_tree_training (refused). Options that shape the advantages (kl_ctl,
    reward_*, adv_norm, discount, gae_lambda, ...) act before the loss and need no mapping.

    The proximal logprob (AReaL's prox_logp, fused_is's old_logprobs) is the PPO ratio's base and the behaviour
    logprob (AReaL's logprobs, fused_is's sampler_logprobs) the rejection's reference; without prox_logp the
    config's ratio_ref is "loglinear" (prox_logp_method="loglinear").

    Args:
        actor_config: AReaL's actor config.
        prox_logp_given: whether the micro-batch carries prox_logp; None: as AReaL's trainer decides (absent only
            with use_decoupled_loss and prox_logp_method="loglinear", which skip the proximal forward pass).
    Returns:
        A LossConfig (the joint-distillation term, which the micro-batch switches on, is added by
        `grpo_loss_from_logits`).
    Raises:
        ValueError naming each option fused_is does not reproduce exactly.
    """
    for name in _REMOVED:
        if _get(actor_config, name) is not None:
            _refuse(name, _get(actor_config, name), "AReaL 1.0.4 removed it; set rejection_sampling instead")
    if _get(actor_config, "is_critic", False):
        _refuse("is_critic", True, "this maps the actor's loss, not the critic's")
    if _get(actor_config, "enable_tree_training", False):
        _refuse("enable_tree_training", True, "the tree-packed logits of shared prefixes are not a layout "
                "grpo_loss_from_logits takes (one row per token of each sequence)")
    method = _choice(actor_config, "", "prox_logp_method", "recompute", _PROX_LOGP_METHODS)
    level = _choice(actor_config, "", "importance_sampling_level", "token", _LEVELS)
    decoupled = bool(_get(actor_config, "use_decoupled_loss", False))
    if prox_logp_given is None:
        prox_logp_given = not (decoupled and method == "loglinear")
    if not prox_logp_given and method != "loglinear":  # AReaL's _resolve_proximal_logp raises here too
        _refuse("prox_logp_method", method, "the micro-batch has no prox_logp, which only 'loglinear' forms")
    loglinear = not prox_logp_given
    fields = dict(ratio_ref="loglinear" if loglinear else "old", is_level="none", is_cap=math.inf,
                  temperature=_float(actor_config, "", "temperature", 1.0))
    m2 = _float(actor_config, "", "m2_threshold", None)
    if m2 is not None:
        if loglinear:
            _refuse("m2_threshold", m2, "with prox_logp_method='loglinear' M2PO ranks by a proximal logprob that "
                    "depends on the current one; fused_is does not form that ranking yet (use 'recompute')")
        fields["m2_threshold"] = m2

    if _get(actor_config, "use_sapo_loss", False):
        if decoupled:
            _refuse("use_sapo_loss", True, "AReaL refuses SAPO with use_decoupled_loss=True (set it to false)")
        if level == "sequence":
            _refuse("importance_sampling_level", level, "with use_sapo_loss: fused_is's SAPO gates the token ratio "
                    "(AReaL's sequence-level SAPO gates the sequence's geometric-mean ratio)")
        tau_pos, tau_neg = (_float(actor_config, "", "sapo_tau_pos", 1.0),
                            _float(actor_config, "", "sapo_tau_neg", 1.05))
        for name, tau in (("sapo_tau_pos", tau_pos), ("sapo_tau_neg", tau_neg)):
            if not tau > 0.0:
                _refuse(name, tau, "SAPO's temperatures must be > 0 (as AReaL checks)")
        # AReaL's SAPO takes the ratio against the behaviour logprobs and no rejection_sampling (ignored, as AReaL
        # ignores it: it warns that rejection_sampling needs use_decoupled_loss, which SAPO refuses)
        fields.update(policy="sapo", ratio_ref="sampler", sapo_tau_pos=tau_pos, sapo_tau_neg=tau_neg)
        return LossConfig(**fields)

    eps_clip = _float(actor_config, "", "eps_clip", 0.2)
    higher = _float(actor_config, "", "eps_clip_higher", eps_clip)
    if not 0.0 <= eps_clip <= 1.0:
        _refuse("eps_clip", eps_clip, "the clip range [1 - eps_clip, 1 + eps_clip_higher] needs 0 <= eps_clip <= 1")
    if higher < 0.0:
        _refuse("eps_clip_higher", higher, "must be >= 0")
    c_clip = _float(actor_config, "", "c_clip", None)
    if c_clip is not None and not c_clip > 1.0:
        _refuse("c_clip", c_clip, "the dual clip needs c_clip > 1 (AReaL asserts it)")
    fields.update(policy="ppo", clip_low=eps_clip, clip_high=higher, ratio_level=level,
                  dual_clip=c_clip)
    rejection = _get(actor_config, "rejection_sampling")
    if rejection is not None:
        fields.update(_rejection_fields(rejection, level, loglinear))
    return LossConfig(**fields)


def _rejection_fields(rs, ratio_level: str, loglinear: bool) -> dict:
    """The LossConfig fields of AReaL's rejection_sampling (PPO): a filter on w = pi_prox / pi_behave = exp(old - samp)
    or a KL estimator of log w, per token or per sequence, that masks (the policy term times 0, every count kept:
    AReaL keeps the count of the mask before rejection) or clamps the weight; w multiplies the PPO term."""
    option = "rejection_sampling."
    level = _choice(rs, option, "level", "token", _LEVELS)
    action = _choice(rs, option, "action", "mask", ("mask", "clamp"))
    metric = _choice(rs, option, "metric", "ratio", ("ratio", "kl_k1", "kl_k2", "kl_k3"))
    agg = _choice(rs, option, "agg", "mean", ("sum", "mean", "max"))
    upper, lower = _float(rs, option, "upper", 5.0), _float(rs, option, "lower", None)
    if level == "token":
        agg = "mean"  # AReaL ignores agg at token level
    if action == "clamp":
        if metric != "ratio":
            _refuse(option + "metric", metric, "action='clamp' clamps the ratio (AReaL refuses other metrics too)")
        lower = 0.0 if lower is None else lower  # AReaL's default for clamp
    if ratio_level == "sequence" and level == "token" and action == "mask":
        _refuse(option + "action", action, "with level='token' under importance_sampling_level='sequence' (GSPO): "
                "AReaL's sequence ratio and advantage then average over the tokens it keeps while its count keeps "
                "the rejected ones; fused_is has one mask for both")
    if metric == "ratio":
        if upper > _MAX_WEIGHT or (lower is not None and 0.0 < lower < 1.0 / _MAX_WEIGHT):
            _refuse(option + "upper" if upper > _MAX_WEIGHT else option + "lower", upper if upper > _MAX_WEIGHT
                    else lower, "fused_is clamps log w to +-20 before exp: bounds beyond e^+-20 would differ from "
                    "AReaL's unclamped ratio")
        if level == "token" or agg == "mean":  # the token weight, or the sequence's geometric mean, masked or clamped
            return dict(is_level="token" if level == "token" else "geometric",
                        is_mode="truncate" if action == "clamp" else "mask", is_cap=upper, is_floor=lower)
        if action == "clamp" or agg == "max":
            _refuse(option + "agg", agg, f"with level='sequence', metric='ratio' and action={action!r}: AReaL "
                    "decides by exp(sum or max of log w) and weights by the geometric mean; fused_is maps agg='mean' "
                    "for both, and agg='sum' with action='mask'")
        if lower is None:
            _refuse(option + "lower", lower, "agg='sum' with metric='ratio' needs a lower bound here (fused_is's "
                    "sequence-sum criterion takes two finite bounds): set one, as small as you like (> 0)")
        bounds = (1.0 / upper, 1.0 / lower)  # fused_is's k1 = log(pi_behave / pi_prox) = -log w, bounded in the ratio
        if not 0.0 < bounds[0] <= bounds[1] < math.inf:
            _refuse(option + "lower", lower, "the bounds must satisfy 0 < lower <= upper < inf")
        return _gate("seq_sum_k1", bounds, "geometric", loglinear, metric)
    if metric == "kl_k3":
        _refuse(option + "metric", metric, "AReaL's k3 is exp(-log w) - 1 + log w (the KL of the behaviour from the "
                "proximal policy), fused_is's token_k3 criterion exp(log w) - 1 - log w (verl's sign); only k1 and k2 "
                "are the same")
    name = "token" if level == "token" else f"seq_{agg}"
    if metric == "kl_k1":  # k1 = log w in [lower, upper]; fused_is's k1 = -log w in [log low, log high]
        if name == "seq_max":
            _refuse(option + "agg", agg, "fused_is has no per-sequence max of k1 (k2 only)")
        if name != "seq_sum" and max(abs(upper), abs(lower or 0.0)) >= LOG_WEIGHT_CLAMP:
            _refuse(option + "upper", upper, "fused_is clamps log w to +-20: k1 bounds at or beyond +-20 would "
                    "differ from AReaL's unclamped ones")
        if lower is None and name == "seq_sum":
            _refuse(option + "lower", lower, "metric='kl_k1' with agg='sum' needs a lower bound here (fused_is's "
                    "sequence-sum criterion takes two finite bounds)")
        # without a lower bound, any clamped log w passes: -log w <= 20 < 21
        bounds = (math.exp(-upper), math.exp(-lower) if lower is not None else math.exp(LOG_WEIGHT_CLAMP + 1.0))
        if not 0.0 < bounds[0] <= bounds[1] < math.inf:
            _refuse(option + "upper", upper, "k1 bounds beyond about +-700 are not representable as ratio bounds")
        return _gate(f"{name}_k1", bounds, "token", loglinear, metric)
    if lower is not None and lower > 0.0:  # k2 >= 0: a lower bound <= 0 never binds
        _refuse(option + "lower", lower, "fused_is's k2 criterion takes an upper bound only")
    if name != "seq_sum" and upper >= 0.5 * LOG_WEIGHT_CLAMP ** 2:
        _refuse(option + "upper", upper, "fused_is clamps log w to +-20: a k2 bound at or beyond 200 would let "
                "through tokens AReaL rejects")
    return _gate(f"{name}_k2", upper, "token", loglinear, metric)


def _gate(criterion: str, bound, is_level: str, loglinear: bool, metric: str) -> dict:
    """A rejection criterion with the policy term of rejected tokens times 0 (counts kept), the raw weight w."""
    if loglinear:
        _refuse("rejection_sampling.metric", metric, "with prox_logp_method='loglinear' fused_is's rejection "
                "criteria need the proximal logprobs (prox_logp); the ratio's token and geometric-mean filters are "
                "mapped (metric='ratio' with agg='mean')")
    return dict(is_level=is_level, is_mode="raw", is_cap=math.inf, rejection={criterion: bound},
                rejection_counts="keep")


def _tensor(input_data: Mapping, key: str, required: bool = True) -> Optional[torch.Tensor]:
    value = input_data.get(key)
    if value is None and not required:
        return None
    if not isinstance(value, torch.Tensor):
        raise (ValueError if value is None else TypeError)(
            f"input_data[{key!r}] must be a torch.Tensor (AReaL's micro-batch entry); got "
            f"{'nothing' if value is None else type(value).__name__}")
    return value


def _number(input_data: Mapping, key: str, default: float) -> float:
    value = input_data.get(key, default)
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise TypeError(f"input_data[{key!r}] must be a finite number (AReaL sets one per trajectory); got {value!r}")
    return float(value)


def _sequence_mean(values: torch.Tensor, mask: torch.Tensor, cu_seqlens: Optional[torch.Tensor]) -> torch.Tensor:
    """values averaged over each sequence's tokens where mask, for each token (float64): rows of [B, T], or the
    segments of cu_seqlens in [N]; a sequence without one such token gets 0 (its terms are masked anyway)."""
    x, m = values.double() * mask.double(), mask.double()
    if x.dim() == 2:
        return (x.sum(-1, keepdim=True) / m.sum(-1, keepdim=True).clamp(min=1.0)).expand_as(x)
    lengths = cu_seqlens.diff().long()
    seq = torch.repeat_interleave(torch.arange(len(lengths), device=x.device), lengths.to(x.device))
    sums = torch.zeros(len(lengths), dtype=x.dtype, device=x.device).index_add_(0, seq, x)
    counts = torch.zeros(len(lengths), dtype=x.dtype, device=x.device).index_add_(0, seq, m)
    return (sums / counts.clamp(min=1.0))[seq]


def grpo_loss_from_logits(actor_config, logits: torch.Tensor, input_data: Mapping, *,
                          current_version: Optional[int] = None, backend: str = "auto", inplace: bool = False,
                          validate: str = "full") -> Tuple[torch.Tensor, Dict[str, float]]:
    """AReaL's `grpo_loss_fn(logprobs, entropy, input_data, **actor options)` from the engine's logits instead of
    its log-probs.

    Args:
        actor_config: AReaL's actor config (mapped by `config_from_areal`).
        logits: the engine's logits of the micro-batch, not divided by the temperature (fused_is divides by
            actor_config.temperature, in fp32 as AReaL does): [N, V] packed, one row per token (AReaL's packed
            micro-batch, padding removed), or [B, T, V] padded; bf16, fp16 or fp32. Row t scores input_ids[t + 1]
            (AReaL's labels: input_ids rolled by -1 along the last dimension).
        input_data: the micro-batch dict grpo_loss_fn takes, every tensor shaped like "input_ids" (int64/int32,
            [N] or [B, T]) but cu_seqlens: "loss_mask" (bool or 0/1 float), "logprobs" (the behaviour policy's, float),
            "advantages" (float), "prox_logp" (the proximal policy's, float; absent with prox_logp_method="loglinear",
            which then reads "versions", int, the version that sampled each token, < 0 at prompt rows),
            "teacher_logp" (float) with "rl_loss_weight" and "distill_loss_weight" (numbers) for joint distillation;
            "cu_seqlens" (int [S + 1], the sequences' offsets) for packed input at sequence level.
        current_version: the version being trained (AReaL's engine.get_version()), read with prox_logp_method
            "loglinear" when prox_logp is absent.
        backend, inplace, validate: passed on to `fused_is.policy_loss` (inplace: the gradient overwrites logits).
    Returns:
        (loss, metrics): the loss grpo_loss_fn returns (0-d, differentiable w.r.t. logits; AReaL's engine scales it by
        its micro-batch weight as it scales grpo_loss_fn's), and fused_is's metrics as "fused_is/<name>" (floats).
    """
    if not isinstance(input_data, Mapping):
        raise TypeError(f"input_data must be AReaL's micro-batch dict; got {type(input_data).__name__}")
    input_ids = _tensor(input_data, "input_ids")
    if not isinstance(logits, torch.Tensor) or input_ids.dim() not in (1, 2) or logits.dim() != input_ids.dim() + 1 \
            or tuple(logits.shape[:-1]) != tuple(input_ids.shape):
        raise ValueError(f"logits must be [*input_ids.shape, V] ([N, V] packed or [B, T, V] padded) with input_data"
                         f"['input_ids'] of shape {tuple(input_ids.shape)}; got "
                         f"{tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__}")
    for key in ("loss_mask", "logprobs", "advantages", "prox_logp", "versions", "teacher_logp"):
        value = _tensor(input_data, key, required=key in ("loss_mask", "logprobs", "advantages"))
        if value is not None and tuple(value.shape) != tuple(input_ids.shape):
            raise ValueError(f"input_data[{key!r}] must have input_ids' shape {tuple(input_ids.shape)}; got "
                             f"{tuple(value.shape)}")
    prox = input_data.get("prox_logp")
    cfg = config_from_areal(actor_config, prox_logp_given=prox is not None)
    behaviour, mask = input_data["logprobs"], input_data["loss_mask"].bool()
    cu_seqlens = input_data.get("cu_seqlens") if input_ids.dim() == 1 else None
    keywords = dict(sampler_logprobs=behaviour, old_logprobs=prox, mask=mask, cu_seqlens=cu_seqlens)
    if cfg.ratio_ref == "loglinear":
        if input_data.get("versions") is None:
            raise ValueError("input_data['versions'] is required with prox_logp_method='loglinear' and no prox_logp "
                             "(AReaL forms the proximal logprob from the versions)")
        if isinstance(current_version, bool) or not isinstance(current_version, numbers.Integral):
            raise TypeError(f"current_version must be an int (AReaL's engine.get_version()) with prox_logp_method="
                            f"'loglinear' and no prox_logp; got {current_version!r}")
        keywords.update(versions=input_data["versions"], current_version=int(current_version))
    advantages = input_data["advantages"]
    if cfg.ratio_level == "sequence":  # AReaL's GSPO: each token takes its sequence's mean advantage
        if input_ids.dim() == 1 and (cu_seqlens is None or int(cu_seqlens[-1]) != input_ids.shape[0]):
            raise ValueError(f"input_data['cu_seqlens'] ([S + 1] offsets ending at {input_ids.shape[0]}) is required "
                             "for packed input with importance_sampling_level='sequence'")
        kept = mask
        if cfg.m2_threshold is not None:  # over the tokens M2PO keeps, as AReaL's mask then is
            kept = m2po_keep(behaviour.double().reshape(-1), prox.double().reshape(-1),
                             mask.double().reshape(-1), cfg.m2_threshold).reshape(mask.shape).bool()
        advantages = _sequence_mean(advantages, kept, cu_seqlens)
    rl_weight = 1.0
    if input_data.get("teacher_logp") is not None:  # joint distillation: + distill_w x the token-mean of lp - teacher
        rl_weight = _number(input_data, "rl_loss_weight", 1.0)
        distill_weight = _number(input_data, "distill_loss_weight", 0.005)
        if rl_weight == 0.0:
            raise ValueError("input_data['rl_loss_weight']=0 (AReaL's pure distillation, an importance-weighted "
                             "reverse-KL reward) is not supported by fused_is.integrations.areal; any other weight is")
        cfg = dataclasses.replace(cfg, kl_coef=distill_weight / rl_weight, kl_type="k1")
        keywords["ref_logprobs"] = input_data["teacher_logp"]
    tokens = torch.roll(input_ids, shifts=-1, dims=-1)
    out = fused_is.policy_loss(logits, tokens, advantages, config=cfg, backend=backend, inplace=inplace,
                               validate=validate, **keywords)
    loss = out.loss if rl_weight == 1.0 else out.loss * rl_weight
    return loss, {f"fused_is/{name}": value for name, value in out.metrics.items()}
