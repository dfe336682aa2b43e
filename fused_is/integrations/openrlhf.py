"""OpenRLHF (0.11.2) with fused_is: the PPO actor's loss from the actor's logits.

OpenRLHF's `PolicyModelActor.training_step` takes the actor's log-probs of the action tokens and adds three
terms: `PolicyLoss` (PPO or GSPO, with the train/rollout mismatch correction `is_correction_*`),
`kl_ctl` x the KL to the reference model (`compute_approx_kl`, aggregated per token), and
-`entropy_coef` x the entropy (aggregated per token). `actor_loss_from_logits` computes the same sum from the
logits of the action positions in one fused pass; `config_from_openrlhf` reads the trainer's arguments
(the hierarchical namespace of `openrlhf.cli.train_ppo_ray`), mapping every option that shapes the loss
exactly or refusing it with a ValueError naming it.

Importing this module imports openrlhf (its top-level package only, which imports nothing heavy);
`import fused_is` does not.
"""

from __future__ import annotations

import math
import warnings
from typing import Dict, Mapping, Optional, Tuple

import openrlhf  # noqa: F401  (the trainer this module maps; fails clearly where it is not installed)
import torch

import fused_is
from fused_is.config import LOG_WEIGHT_CLAMP, LossConfig

_KL = ("k1", "k2", "k3")


def _get(ns, path: str, default=None):
    for name in path.split("."):
        if ns is None:
            return default
        ns = ns.get(name) if isinstance(ns, dict) else getattr(ns, name, None)
    return default if ns is None else ns


def _refuse(option: str, value, why: str):
    raise ValueError(f"OpenRLHF argument --{option}={value!r} is not supported by fused_is.integrations.openrlhf: "
                     f"{why}")


def config_from_openrlhf(args, *, kl_coef: Optional[float] = None, temperature: float = 1.0) -> LossConfig:
    """The LossConfig of OpenRLHF's actor loss for its arguments `args` (after `hierarchize`: args.actor,
    args.algo.advantage, args.algo.kl).

    Read: actor.eps_clip_low_high (or actor.eps_clip), actor.dual_clip, actor.policy_loss_type ("ppo": log
    ratio clamped to +-20; "gspo": the sequence ratio, per-sequence aggregation), actor.loss_agg_mode,
    actor.entropy_coef, algo.advantage.is_correction_level / _mode / _gating / _threshold, algo.kl.use_loss,
    algo.kl.init_coef, algo.kl.estimator (value clamped to +-10, as compute_approx_kl) and
    algo.kl.unbiased_gradient (refused).

    The mismatch correction (PPO only), with w = pi_train / pi_rollout = exp(old - rollout) per token:
    token+ratio+clip (TIS) is is_mode="truncate" with is_floor=low, is_cap=high; token+ratio+mask (IcePop)
    is is_mode="mask"; a sequence gate (ratio: the geometric mean of w, i.e. "seq_mean_k1" with the band
    (1/high, 1/low); binary_kl / tv: their sequence means) or a token divergence gate keeps the raw token w
    (is_mode="raw") and zeroes rejected tokens' policy terms with the counts kept (rejection_counts="keep").
    fused_is clamps log w to +-20 before exp (DESIGN.md section 2); OpenRLHF does not, so bounds beyond
    e^+-20 are refused, and a token with |old - rollout| > 20 is where the two can differ.

    kl_coef: the KL coefficient of this step (OpenRLHF's kl_ctl.value: init_coef, or the adaptive
    controller's current value); None takes algo.kl.init_coef. temperature: the actor's (the logits are
    divided by it, as OpenRLHF's Actor does).
    """
    low_high = _get(args, "actor.eps_clip_low_high")
    if low_high is None:
        eps = float(_get(args, "actor.eps_clip", 0.2))
        low_high = (eps, eps)
    fields = dict(clip_low=float(low_high[0]), clip_high=float(low_high[1]), is_level="none", is_cap=float("inf"),
                  ratio_ref="old", temperature=float(temperature))
    dual = _get(args, "actor.dual_clip")
    kind = _get(args, "actor.policy_loss_type", "ppo")
    agg = _get(args, "actor.loss_agg_mode", "token-mean")
    if agg not in ("token-mean", "seq-mean-token-mean"):
        _refuse("actor.loss_agg_mode", agg, "expected token-mean or seq-mean-token-mean")
    level = _get(args, "algo.advantage.is_correction_level", "off")
    mode = _get(args, "algo.advantage.is_correction_mode", "mask")
    gating = _get(args, "algo.advantage.is_correction_gating", "ratio")
    threshold = list(_get(args, "algo.advantage.is_correction_threshold", (0.5, 5.0)))
    if len(threshold) == 1:  # OpenRLHF: a single value is an upper bound only
        threshold = [0.0, threshold[0]]
    low, high = (float(x) for x in threshold)
    if kind == "ppo":
        fields.update(policy="ppo", log_ratio_clamp=20.0, loss_agg=agg)
        if dual is not None:
            fields["dual_clip"] = float(dual)
    elif kind == "gspo":  # OpenRLHF: the sequence ratio against the rollout when the correction is on
        if dual is not None:
            _refuse("actor.dual_clip", dual, "OpenRLHF's GSPO with a dual clip clips each token's A against the "
                    "sequence ratio; fused_is's dual clip applies to the PPO ratio only (set it with ppo)")
        fields.update(ratio_level="sequence", loss_agg="seq-mean-token-mean",
                      ratio_ref="sampler" if level != "off" else "old")
    else:
        _refuse("actor.policy_loss_type", kind, "expected ppo or gspo")
    if level != "off" and kind == "ppo":
        fields.update(_correction(level, mode, gating, low, high))
    elif level not in ("off", "token", "seq"):
        _refuse("algo.advantage.is_correction_level", level, "expected off, token or seq")

    if _get(args, "algo.kl.use_loss", False):
        if _get(args, "algo.kl.unbiased_gradient", False):
            _refuse("algo.kl.unbiased_gradient", True, "the importance-weighted straight-through KL gradient is not "
                    "reproduced yet")
        estimator = _get(args, "algo.kl.estimator", "k1")
        if estimator not in _KL:
            _refuse("algo.kl.estimator", estimator, f"expected one of {_KL}")
        coef = float(_get(args, "algo.kl.init_coef", 0.01) if kl_coef is None else kl_coef)
        if coef != 0.0:
            why = ("OpenRLHF aggregates the KL loss per token whatever the policy loss's mode; one fused loss gives "
                   "its KL term the policy's aggregation")
            if kind == "gspo":  # GSPO aggregates per sequence whatever actor.loss_agg_mode says
                _refuse("actor.policy_loss_type", kind, "OpenRLHF's GSPO aggregates its policy loss per sequence "
                        f"(whatever actor.loss_agg_mode) with the KL loss (algo.kl.use_loss): {why}")
            if fields["loss_agg"] != "token-mean":
                _refuse("actor.loss_agg_mode", agg, why)
            fields.update(kl_coef=coef, kl_type=estimator, kl_clamp=10.0)
    entropy_coef = _get(args, "actor.entropy_coef")
    if entropy_coef:
        fields["entropy_coef"] = float(entropy_coef)
        if fields["loss_agg"] != "token-mean":  # OpenRLHF: the entropy term per token, whatever loss_agg_mode
            fields["entropy_agg"] = "token-mean"
    return LossConfig(**fields)


def _correction(level: str, mode: str, gating: str, low: float, high: float) -> dict:
    """The LossConfig fields of OpenRLHF's is_correction_* (PPO only)."""
    bound = math.exp(LOG_WEIGHT_CLAMP)
    if level not in ("token", "seq"):
        _refuse("algo.advantage.is_correction_level", level, "expected off, token or seq")
    if mode not in ("mask", "clip"):
        _refuse("algo.advantage.is_correction_mode", mode, "expected mask or clip")
    if gating not in ("ratio", "binary_kl", "tv"):
        _refuse("algo.advantage.is_correction_gating", gating, "expected ratio, binary_kl or tv")
    if mode == "clip" and (level == "seq" or gating != "ratio"):
        _refuse("algo.advantage.is_correction_mode", mode, "OpenRLHF clips the token ratio only")
    if gating == "ratio":
        if high > bound or 0.0 < low < 1.0 / bound:
            _refuse("algo.advantage.is_correction_threshold", (low, high), "fused_is clamps log w to +-20 before "
                    "exp: bounds beyond e^+-20 would differ from OpenRLHF's unclamped ratio")
        if level == "token":  # TIS (clip) and IcePop (mask) on w
            return dict(is_level="token", is_mode="truncate" if mode == "clip" else "mask", is_cap=high,
                        is_floor=low if (mode == "mask" or low > 0.0) else None)
        if low <= 0.0:
            _refuse("algo.advantage.is_correction_threshold", (low, high), "the sequence ratio gate needs LOW > 0 "
                    "(its band on pi_rollout / pi_train is (1/HIGH, 1/LOW))")
        gate = {"seq_mean_k1": (1.0 / high, 1.0 / low)}  # exp(mean log w) in [low, high]: k1 = -log w
    else:
        if low > 0.0:
            _refuse("algo.advantage.is_correction_threshold", (low, high), "a divergence gate takes an upper bound")
        gate = {f"{'token' if level == 'token' else 'seq_mean'}_{gating}": high}
    return dict(is_level="token", is_mode="raw", rejection=gate, rejection_counts="keep")


# actor_loss_from_logits' keywords before loss_batch_info replaced them: each is that mapping's entry of its name
_COUNT_KEYWORDS = ("batch_num_tokens", "dp_size", "global_batch_size")


def _counts(loss_batch_info: Optional[Mapping], options: dict) -> dict:
    """loss_batch_info as a dict, with the deprecated keywords batch_num_tokens, dp_size and global_batch_size among
    `options` taken into it as its entries of their names (a DeprecationWarning; a count given both ways is a
    TypeError)."""
    counts = dict(loss_batch_info or {})
    old = {name: options[name] for name in _COUNT_KEYWORDS if name in options}
    if old:
        warnings.warn(f"actor_loss_from_logits: the keyword(s) {', '.join(old)} are deprecated; pass them as "
                      f"loss_batch_info={{{', '.join(repr(name) + ': ...' for name in old)}}} (OpenRLHF's mapping)",
                      DeprecationWarning, stacklevel=3)
        both = sorted(set(old) & set(counts))
        if both:
            raise TypeError(f"actor_loss_from_logits got {both} both as keywords and in loss_batch_info; give them "
                            "in loss_batch_info only")
        counts.update(old)
    return counts


def _options(options: dict) -> dict:
    """actor_loss_from_logits' pass-through keywords, checked by name (the deprecated counts taken out)."""
    options = {name: value for name, value in options.items() if name not in _COUNT_KEYWORDS}
    unknown = set(options) - {"backend", "inplace", "validate"}
    if unknown:
        raise TypeError(f"actor_loss_from_logits got unexpected keyword(s) {sorted(unknown)}; it passes on backend, "
                        "inplace and validate to fused_is.policy_loss")
    return options


def actor_loss_from_logits(args, logits: torch.Tensor, action_ids: torch.Tensor, old_action_log_probs: torch.Tensor,
                           advantages: torch.Tensor, action_mask: torch.Tensor, *,
                           rollout_log_probs: Optional[torch.Tensor] = None,
                           base_action_log_probs: Optional[torch.Tensor] = None, kl_coef: Optional[float] = None,
                           temperature: float = 1.0, loss_batch_info: Optional[Mapping] = None,
                           **options) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """OpenRLHF's actor loss: PolicyLoss + kl_coef x the KL loss - entropy_coef x the entropy loss, from logits.

    Args:
        args: OpenRLHF's arguments (`config_from_openrlhf`).
        logits: [B, A, V] (bf16/fp16/fp32) of the action positions: row t scores action token t (OpenRLHF's
            Actor: output.logits[:, :-1] at the last A positions), not yet divided by the temperature.
        action_ids: [B, A] int64, the action tokens. old_action_log_probs, advantages: [B, A] (advantages may
            also be [B]); action_mask: [B, A] bool/0-1.
        rollout_log_probs: [B, A], the sampler's (needed by the mismatch correction and GSPO's ratio then).
        base_action_log_probs: [B, A], the reference model's (needed with the KL loss).
        kl_coef: this step's KL coefficient (kl_ctl.value); None: algo.kl.init_coef.
        loss_batch_info: OpenRLHF's loss_batch_info of the micro-batch (the mapping its training_step gets: the
            step's global counts "batch_num_tokens" and "global_batch_size" and the data-parallel size "dp_size"),
            or None (the micro-batch's own counts). Deprecated: the same counts as keywords batch_num_tokens,
            dp_size and global_batch_size (a DeprecationWarning; each is taken as loss_batch_info's entry).
        options: passed on to `fused_is.policy_loss`: backend (default "auto"), inplace, validate.
    Returns:
        (loss 0-d, info): info has OpenRLHF's names where they exist: "ppo_clip_ratio", "ppo_kl", "vllm_kl" and
        "is_filter_ratio" (with the correction: the rejected or clipped fraction of tokens; OpenRLHF counts
        sequences for its sequence gates), "ppo_clip_ratio" (fused_is's clip_frac: with a dual clip it also
        counts the tokens the dual clip binds, OpenRLHF's only the ratio clip),
        plus fused_is's metrics as "fused_is/<name>". Differentiable w.r.t. logits.
    """
    cfg = config_from_openrlhf(args, kl_coef=kl_coef, temperature=temperature)
    counts = _counts(loss_batch_info, options)
    dp_size, batch_num_tokens = counts.get("dp_size", 1), counts.get("batch_num_tokens")
    global_batch_size = counts.get("global_batch_size")
    normalizer = entropy_normalizer = None
    if cfg.loss_agg == "token-mean" and batch_num_tokens is not None:
        normalizer = float(batch_num_tokens) / dp_size
    if cfg.loss_agg != "token-mean" and global_batch_size is not None:
        normalizer = float(global_batch_size) / dp_size
    if cfg.entropy_agg is not None and batch_num_tokens is not None:
        entropy_normalizer = float(batch_num_tokens) / dp_size
    out = fused_is.policy_loss(logits, action_ids, advantages, sampler_logprobs=rollout_log_probs,
                               old_logprobs=old_action_log_probs, ref_logprobs=base_action_log_probs,
                               mask=action_mask.bool(), config=cfg, normalizer=normalizer,
                               entropy_normalizer=entropy_normalizer, **_options(options))
    info = {"ppo_clip_ratio": out.metrics.get("clip_frac"), "ppo_kl": out.metrics.get("ppo_kl")}
    if cfg.ratio_ref == "sampler":  # OpenRLHF's ppo_kl is against old whatever the ratio's base: mean(old - lp)
        info["ppo_kl"] = out.metrics["ppo_kl"] - out.metrics["mismatch_k1"]
    if "mismatch_k1" in out.metrics and cfg.is_level != "none":
        info["vllm_kl"] = out.metrics["mismatch_k1"]
        info["is_filter_ratio"] = out.metrics.get("rejected_frac", out.metrics.get("is_masked_frac"))
        if cfg.is_mode == "truncate":
            info["is_filter_ratio"] = out.metrics["is_truncated_frac"]
    info = {k: v for k, v in info.items() if v is not None}
    info.update({f"fused_is/{name}": value for name, value in out.metrics.items()})
    return out.loss, info
