"""NeMo-RL with fused_is: ClippedPGLossFn's loss and metrics from the policy's logits.

NeMo-RL's GRPO and PPO actor loss, `nemo_rl.algorithms.loss.ClippedPGLossFn`, takes the next-token logprobs that
the policy worker forms from the logits (an fp32 log-softmax over the whole vocabulary), then adds its
reference-policy KL. `FusedClippedPGLossFn` is a loss function of the same protocol that takes the logits instead
(NeMo-RL's LOGIT input type) and computes the same loss, gradient and metrics in one fused pass;
`clipped_pg_loss_from_logits` is the function behind it and `config_from_nemo_rl` the mapping of a
`ClippedPGLossConfig` (or the `loss_fn` mapping of a run's YAML): every option that shapes the loss is mapped
exactly or refused with a ValueError naming it. One option has no LossConfig and becomes a term of its own, from
the differentiable logprobs of `fused_is.logprobs` (one more read and write of the logits): VAPO's NLL on correct
samples.

`FusedDistillationLossFn` does the same for NeMo-RL's on-policy distillation loss, `DistillationLossFn` (the KL
over the teacher's top k tokens), without NeMo-RL's fp32 copy of the student's logits.

NeMo-RL is not on the package index (the name there is a placeholder), so this module imports without it: the
config is read as a mapping or an object with ClippedPGLossConfig's attribute names, and NeMo-RL's enums are looked
up only where NeMo-RL is importable.
"""

from __future__ import annotations

import math
from typing import Dict, Mapping, Optional, Tuple

import torch

import fused_is
from fused_is.coefficients import kl_term
from fused_is.config import LOG_WEIGHT_CLAMP, LossConfig

# ClippedPGLossConfig's fields and their defaults (NeMo-RL's pydantic model): an option left out takes these
DEFAULTS = dict(disable_ppo_ratio=False, token_level_loss=True, sequence_level_importance_ratios=False,
                ratio_clip_min=0.2, ratio_clip_max=0.2, ratio_clip_c=None, reference_policy_kl_penalty=0.01,
                reference_policy_kl_type="k3", kl_input_clamp_value=20.0, kl_output_clamp_value=10.0,
                use_kl_in_reward=False, use_importance_sampling_correction=False,
                truncated_importance_sampling_type=None, truncated_importance_sampling_ratio=None,
                truncated_importance_sampling_ratio_min=None, use_on_policy_kl_approximation=False,
                force_on_policy_ratio=False, use_cispo=False, positive_example_nll_weight=0.0)
_KL = ("k1", "k2", "k3")
_TIS = ("tis", "icepop", "seq-mask-tis")


def _get(cfg, name: str, defaults: Mapping = DEFAULTS):
    """The option's value; its default where the config leaves it out (an explicit None stays None)."""
    if isinstance(cfg, Mapping):
        return cfg[name] if name in cfg else defaults[name]
    return getattr(cfg, name, defaults[name])


def _refuse(option: str, value, why: str):
    raise ValueError(f"NeMo-RL loss option {option}={value!r} is not supported by fused_is.integrations.nemo_rl: {why}")


def config_from_nemo_rl(cfg) -> LossConfig:
    """The LossConfig of NeMo-RL's ClippedPGLossConfig; see `_fused_config`. The option that
    `clipped_pg_loss_from_logits` adds as a term of its own (positive_example_nll_weight > 0, VAPO's NLL on correct
    samples) has no LossConfig and is refused here by name."""
    config, composed = _fused_config(cfg)
    for option in composed:
        _refuse(option, _get(cfg, option), "no LossConfig holds it; FusedClippedPGLossFn and "
                "clipped_pg_loss_from_logits add it as a term of its own")
    return config


def _fused_config(cfg) -> Tuple[LossConfig, Tuple[str, ...]]:
    """The LossConfig of NeMo-RL's ClippedPGLossConfig (a pydantic object or the YAML's `loss_fn` mapping).

    Mapped: ratio_clip_min / ratio_clip_max (clip_low / clip_high), ratio_clip_c (dual_clip), disable_ppo_ratio
    (REINFORCE), use_cispo, sequence_level_importance_ratios (GSPO), token_level_loss (token-mean, else
    seq-mean-token-mean), reference_policy_kl_penalty / _type with both clamps (kl_coef, kl_type, kl_input_clamp,
    kl_clamp, and kl_weight="score": NeMo-RL's KL carries its score-function gradient),
    use_on_policy_kl_approximation (kl_weight="sampler" instead), use_kl_in_reward (no KL term),
    use_importance_sampling_correction with truncated_importance_sampling_type "tis" (truncate), "icepop" (mask)
    and "seq-mask-tis" (raw token weights, sequences rejected by their geometric mean), force_on_policy_ratio
    (the ratio against the detached current logprobs: `clipped_pg_loss_from_logits` passes no old logprobs, or,
    with "seq-mask-tis", which judges the sequences by them, the logprobs of a first read of the logits).
    Composed (the second return value; its term is `_composed_terms`, from differentiable logprobs: one more read
    and write of the logits): positive_example_nll_weight > 0. Refused by name: every combination NeMo-RL itself
    rejects.
    """
    get = lambda name: _get(cfg, name)  # noqa: E731
    token_level, seq_ratio = bool(get("token_level_loss")), bool(get("sequence_level_importance_ratios"))
    reinforce, cispo, force = bool(get("disable_ppo_ratio")), bool(get("use_cispo")), bool(get("force_on_policy_ratio"))
    if seq_ratio and token_level:
        _refuse("sequence_level_importance_ratios", True, "NeMo-RL requires token_level_loss=False with it")
    if cispo:
        for option, on in (("disable_ppo_ratio", reinforce), ("force_on_policy_ratio", force),
                           ("sequence_level_importance_ratios", seq_ratio), ("ratio_clip_c", get("ratio_clip_c")),
                           ("token_level_loss", not token_level)):
            if on:
                _refuse(option, get(option), "NeMo-RL rejects it with use_cispo=True")
    clip_min, clip_max = float(get("ratio_clip_min")), float(get("ratio_clip_max"))
    for option, value in (("ratio_clip_min", clip_min), ("ratio_clip_max", clip_max)):
        if not (math.isfinite(value) and value >= 0.0):
            _refuse(option, value, "a finite value >= 0")
    if get("reference_policy_kl_type") not in _KL:  # NeMo-RL computes its KL metrics with it, penalty or not
        _refuse("reference_policy_kl_type", get("reference_policy_kl_type"), f"expected one of {_KL}")
    # a lower clip bound 1 - min <= 0 never binds (the ratio is positive): min(., 1) is the same loss
    fields = dict(policy="ppo", ratio_ref="old", clip_low=min(clip_min, 1.0), clip_high=clip_max, is_level="none",
                  is_cap=float("inf"), loss_agg="token-mean" if token_level else "seq-mean-token-mean")
    # force_on_policy_ratio: NeMo-RL's token ratio exp(lp - sg(lp)), PPO whatever disable_ppo_ratio and the sequence
    # ratios say
    if cispo and not force:
        fields["policy"] = "cispo"
    elif reinforce and not force:  # -A lp: no ratio, no clip (a dual clip never binds there: lp <= 0 < c)
        fields["policy"] = "reinforce"
    elif seq_ratio and not force:
        fields["ratio_level"] = "sequence"
    clip_c = get("ratio_clip_c")
    if clip_c is not None:
        if not float(clip_c) > 1.0:
            _refuse("ratio_clip_c", clip_c, "NeMo-RL requires ratio_clip_c > 1")
        if fields["policy"] == "ppo":
            fields["dual_clip"] = float(clip_c)
    _kl_fields(get, fields)
    _is_fields(get, fields, seq_ratio, force)
    nll = float(get("positive_example_nll_weight"))
    if not (math.isfinite(nll) and nll >= 0.0):
        _refuse("positive_example_nll_weight", nll, "a finite weight >= 0")
    return LossConfig(**fields), ("positive_example_nll_weight",) if nll > 0.0 else ()


def _kl_fields(get, fields: dict) -> None:
    """The KL term's fields: NeMo-RL's KL times exp(lp - sg(lp)) (kl_weight="score"), or, under
    use_on_policy_kl_approximation, times exp(lp - generation_logprobs) with its gradient (kl_weight="sampler"), the
    input and output clamps as NeMo-RL's calculate_kl applies them."""
    penalty = 0.0 if get("use_kl_in_reward") else float(get("reference_policy_kl_penalty"))
    if not math.isfinite(penalty):
        _refuse("reference_policy_kl_penalty", penalty, "a finite penalty")
    if penalty == 0.0:
        return
    clamp_in, clamp_out = get("kl_input_clamp_value"), get("kl_output_clamp_value")
    for option, value in (("kl_input_clamp_value", clamp_in), ("kl_output_clamp_value", clamp_out)):
        if value is not None and not float(value) > 0.0:
            _refuse(option, value, "a clamp must be > 0 (or null)")
    weight = "sampler" if get("use_on_policy_kl_approximation") else "score"
    fields.update(kl_weight=weight, kl_coef=penalty, kl_type=get("reference_policy_kl_type"),
                  kl_input_clamp=None if clamp_in is None else float(clamp_in),
                  kl_clamp=None if clamp_out is None else float(clamp_out))


def _is_fields(get, fields: dict, seq_ratio: bool, force: bool):
    kind, cap, floor = (get("truncated_importance_sampling_type"), get("truncated_importance_sampling_ratio"),
                        get("truncated_importance_sampling_ratio_min"))
    if cap is not None and kind is None:
        _refuse("truncated_importance_sampling_ratio", cap, "NeMo-RL rejects a ratio without "
                "truncated_importance_sampling_type")
    if kind is not None:
        if not get("use_importance_sampling_correction"):
            _refuse("truncated_importance_sampling_type", kind, "NeMo-RL requires "
                    "use_importance_sampling_correction=True with it")
        if kind not in _TIS:
            _refuse("truncated_importance_sampling_type", kind, f"expected one of {_TIS}")
        if cap is None or not float(cap) > 0.0:
            _refuse("truncated_importance_sampling_ratio", cap, "NeMo-RL requires a positive ratio")
        if kind != "tis" and floor is None:
            _refuse("truncated_importance_sampling_ratio_min", floor, f"NeMo-RL requires it with {kind!r}")
        if floor is not None and not 0.0 <= float(floor) <= float(cap):
            _refuse("truncated_importance_sampling_ratio_min", floor, "it must be in [0, "
                    "truncated_importance_sampling_ratio]")
    if not get("use_importance_sampling_correction"):
        return
    fields["is_level"], fields["is_mode"] = ("sequence" if seq_ratio else "token"), "raw"
    if kind == "tis":
        fields.update(is_mode="truncate", is_cap=float(cap), is_floor=None if floor is None else float(floor))
    elif kind == "icepop":
        fields.update(is_mode="mask", is_cap=float(cap), is_floor=float(floor))
    elif kind == "seq-mask-tis":  # keep a sequence when floor <= exp(mean(prev - gen)) <= cap, raw token weights
        if seq_ratio:
            _refuse("truncated_importance_sampling_type", kind, "NeMo-RL rejects it with "
                    "sequence_level_importance_ratios=True")
        # fused_is's seq_mean_k1 is mean(gen - prev): kept within [1 / cap, 1 / floor] on the ratio gen / prev (its
        # log ratios clamped to +-20 per token: any high bound above e^20 never binds)
        high = math.exp(LOG_WEIGHT_CLAMP + 1.0) if float(floor) == 0.0 else 1.0 / float(floor)
        fields.update(rejection={"seq_mean_k1": (1.0 / float(cap), high)}, rejection_counts="keep")


def _shifted(data: Mapping, key: str, shape) -> torch.Tensor:
    if key not in data:
        raise ValueError(f"clipped_pg_loss_from_logits: data[{key!r}] is required by this config")
    value = data[key]
    if not isinstance(value, torch.Tensor) or value.dim() != 2 or tuple(value.shape) != tuple(shape):
        raise ValueError(f"clipped_pg_loss_from_logits: data[{key!r}] must be a [B, S] tensor like data['input_ids'] "
                         f"{tuple(shape)}; got {getattr(value, 'shape', type(value).__name__)}")
    return value[:, 1:]


def _checked_ids(where: str, logits, data: Mapping) -> torch.Tensor:
    """data["input_ids"] [B, S], with the logits checked against it: a plain tensor (not a vocabulary-parallel
    DTensor) [B, S', V], S' >= S (a packed sequence's padding)."""
    if not isinstance(logits, torch.Tensor) or type(logits).__name__ == "DTensor":
        raise TypeError(f"{where}: logits must be a plain torch.Tensor [B, S, V] (vocabulary-parallel DTensor logits "
                        f"are not supported); got {type(logits).__name__}")
    input_ids = data["input_ids"] if "input_ids" in data else None
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        raise ValueError(f"{where}: data['input_ids'] must be a [B, S] tensor")
    batch, seq = input_ids.shape
    if logits.dim() != 3 or logits.shape[0] != batch or logits.shape[1] < seq:
        raise ValueError(f"{where}: logits must be [B, S', V] with B = data['input_ids'].shape[0] and S' >= S "
                         f"({(batch, seq)}); got {tuple(logits.shape)}")
    return input_ids


def _check_binary(where: str, **masks: torch.Tensor):
    """NeMo-RL's masks multiply its terms: fused_is takes them as bool, so each must hold 0 and 1 only."""
    for name, m in masks.items():
        if bool(((m != 0) & (m != 1)).any()):
            raise ValueError(f"{where}: data[{name!r}] must hold 0 and 1 only")


def _global(count, local: torch.Tensor, name: str) -> Optional[float]:
    """NeMo-RL's global count as the aggregation's normalizer (None: this micro-batch's own count, as NeMo-RL
    without one; 0: no valid token anywhere, the loss 0 either way)."""
    if count is None:
        return None
    value = float(count)
    if not math.isfinite(value) or value < 0.0:
        raise ValueError(f"NeMo-RL loss: {name} must be a finite count >= 0; got {count!r}")
    if value == 0.0 and bool(local.any()):
        raise ValueError(f"NeMo-RL loss: {name} is 0 but this micro-batch has valid tokens")
    return value or None


def clipped_pg_loss_from_logits(cfg, logits: torch.Tensor, data: Mapping, global_valid_seqs=None,
                                global_valid_toks=None, **options) -> Tuple[torch.Tensor, Dict[str, float]]:
    """NeMo-RL's ClippedPGLossFn from the logits: the clipped policy loss with its IS correction, plus the KL to
    the reference policy, aggregated over NeMo-RL's global token or sequence counts.

    Args:
        cfg: NeMo-RL's ClippedPGLossConfig, or a mapping with its names (`config_from_nemo_rl`).
        logits: [B, S', V] (bf16/fp16/fp32) of the micro-batch, as NeMo-RL's policy worker hands them to a loss
            function (already divided by the sampling temperature): row s scores token s + 1; rows S - 1 and later
            are unused (S' > S: a packed sequence's padding). Not a DTensor (refused). Megatron's tensor-parallel
            workers hand each rank its vocabulary shard [B, S', V / TP] as a plain tensor: pass
            vocab_group=the tensor-parallel group then (the shards in rank order), or the loss is the shard's.
        data: NeMo-RL's micro-batch mapping: "input_ids" [B, S] int64; "advantages", "prev_logprobs",
            "generation_logprobs", "token_mask" [B, S] (position s is token s's; position 0 is unused, as in
            NeMo-RL); "sample_mask" [B]; "reference_policy_logprobs" [B, S] with a KL penalty. "prev_logprobs" is
            not read with force_on_policy_ratio.
        global_valid_seqs, global_valid_toks: NeMo-RL's counts over the whole step (every micro-batch and
            data-parallel rank: the denominators of the sequence and token means), numbers or 0-d tensors; None
            takes this micro-batch's own.
        options: passed on to `fused_is.policy_loss`: backend (default "auto"), inplace, validate, vocab_group.
    Returns:
        (loss 0-d, metrics): NeMo-RL's metric names and normalisations ("loss", "probs_ratio",
        "probs_ratio_clamped", their "_min" / "_max", "kl_penalty", "token_mult_prob_error", "gen_kl_error",
        "policy_kl_error", "js_divergence_error", "sampling_importance_ratio", "num_valid_samples",
        "approx_entropy", "positive_nll_loss", and "is_oob_ratio" with a truncation type) as floats: NeMo-RL
        sums them over micro-batches, so each is normalised by the global counts as NeMo-RL's are (fused_is's
        own metrics, means over the micro-batch, are left out for that reason). The loss is differentiable
        w.r.t. logits.
    """
    config, composed = _fused_config(cfg)
    unknown = set(options) - {"backend", "inplace", "validate", "vocab_group"}
    if unknown:
        raise TypeError(f"clipped_pg_loss_from_logits got unexpected keyword(s) {sorted(unknown)}; it passes on "
                        "backend, inplace, validate and vocab_group to fused_is.policy_loss")
    if composed and options.get("inplace"):
        raise ValueError(f"clipped_pg_loss_from_logits: inplace with {', '.join(composed)} (a term of its own that "
                         "reads the logits again) is not supported")
    force = bool(_get(cfg, "force_on_policy_ratio"))
    if "curr_logprobs_unfiltered" in data:
        raise ValueError("clipped_pg_loss_from_logits: data['curr_logprobs_unfiltered'] (top-k / top-p filtered "
                         "training logprobs) is not supported; replay the sampler's truncation with "
                         "fused_is.policy_loss(kept=...) instead")
    input_ids = _checked_ids("clipped_pg_loss_from_logits", logits, data)
    shape = tuple(input_ids.shape)
    token_mask = _shifted(data, "token_mask", shape)
    sample_mask = data["sample_mask"] if "sample_mask" in data else None
    if not isinstance(sample_mask, torch.Tensor) or tuple(sample_mask.shape) != shape[:1]:
        raise ValueError(f"clipped_pg_loss_from_logits: data['sample_mask'] must be a [B] tensor, B = {shape[0]}")
    _check_binary("clipped_pg_loss_from_logits", token_mask=token_mask, sample_mask=sample_mask)
    mask = (token_mask != 0) & (sample_mask != 0).unsqueeze(-1)
    gen = _shifted(data, "generation_logprobs", shape)
    prev = None if force else _shifted(data, "prev_logprobs", shape)
    if force and config.rejection:  # seq-mask-tis judges the sequences by the detached current logprobs: a first
        # read of the logits forms them (the ratio against them is 1 with lp's gradient, as force_on_policy_ratio's)
        with torch.no_grad():
            prev, _ = fused_is.token_logprobs(logits[:, :shape[1] - 1], input_ids[:, 1:],
                                              backend=options.get("backend", "auto"), mask=mask,
                                              vocab_group=options.get("vocab_group"))
    ref = _shifted(data, "reference_policy_logprobs", shape) if config.kl_coef != 0.0 else None
    token_level = config.loss_agg == "token-mean"
    toks, seqs = _global(global_valid_toks, mask, "global_valid_toks"), _global(global_valid_seqs, mask,
                                                                                 "global_valid_seqs")
    normalizer = toks if token_level else seqs
    # the denominators of NeMo-RL's means; its sequence mean counts every sample_mask'ed sequence, one without a
    # valid token too
    totals = (float(mask.sum()) if toks is None else toks, float((sample_mask != 0).sum()) if seqs is None else seqs)
    if normalizer is None and not token_level:
        normalizer = totals[1] or None
    out = fused_is.policy_loss(logits[:, :shape[1] - 1], input_ids[:, 1:], _shifted(data, "advantages", shape),
                               sampler_logprobs=gen, old_logprobs=prev, ref_logprobs=ref, mask=mask, config=config,
                               normalizer=normalizer, **options)
    metrics = _metrics(cfg, config, out, mask, token_mask != 0, sample_mask != 0, gen, prev, ref, totals)
    loss = out.loss
    if composed:
        extra, extra_metrics = _composed_terms(cfg, logits[:, :shape[1] - 1], input_ids[:, 1:], data, mask, options)
        loss = loss + extra
        metrics.update(extra_metrics)
    metrics["loss"] = float(loss.detach())
    return loss, metrics


def _composed_terms(cfg, logits, tokens, data, mask, options):
    """(the term no LossConfig holds, its metric), from the differentiable logprobs of fused_is.logprobs: VAPO's NLL
    on the samples of positive reward (data["rewards"] [B]; none without it)."""
    lp, _ = fused_is.logprobs(logits, tokens, mask=mask, backend=options.get("backend", "auto"),
                              vocab_group=options.get("vocab_group"))
    lp = torch.where(mask, lp.float(), 0.0)
    weight = float(_get(cfg, "positive_example_nll_weight"))
    nll = lp.new_zeros(())
    if "rewards" in data:
        correct = mask & (data["rewards"] > 0).unsqueeze(-1)
        if bool(correct.any()):
            nll = torch.where(correct, -lp, 0.0).sum() / (correct.float().sum() + 1e-8)
    return weight * nll, {"positive_nll_loss": float(nll.detach())}


def _kl(kind: str, log_ratio: torch.Tensor) -> torch.Tensor:
    """NeMo-RL's k1 / k2 / k3 estimator of KL(logprobs || reference) at log_ratio = reference - logprobs."""
    if kind == "k1":
        return -log_ratio
    if kind == "k2":
        return log_ratio * log_ratio / 2
    return torch.exp(log_ratio) - 1.0 - log_ratio


@torch.no_grad()
def _metrics(cfg, config: LossConfig, out, mask, token_mask, sample_mask, gen, prev, ref, totals) -> Dict[str, float]:
    """NeMo-RL's metrics of ClippedPGLossFn, from the fused call's logprobs (float64, O(N) vectors); totals: the
    token and sequence counts of NeMo-RL's means."""
    m, tm = mask.double(), token_mask.double()
    toks, seqs = totals
    token_mean = lambda x: float((torch.where(mask, x, 0.0)).sum()) / (toks + 1e-8)  # noqa: E731
    seq_mean = lambda x: float(torch.where(sample_mask, x, 0.0).sum()) / (seqs + 1e-8)  # noqa: E731
    per_seq = lambda x: torch.where(token_mask, x, 0.0).sum(-1) / (tm.sum(-1) + 1e-8)  # noqa: E731
    lp = out.logprobs.detach().double()
    gen = gen.double()
    prev = lp if prev is None else prev.double()
    kind = _get(cfg, "reference_policy_kl_type")
    if bool(_get(cfg, "force_on_policy_ratio")):
        ratios = clamped = torch.ones_like(lp)
    elif config.policy == "reinforce":  # NeMo-RL reports lp itself as the "ratio" there
        ratios = clamped = lp
    else:
        log_ratio = lp - prev
        ratios = (per_seq(log_ratio).exp().unsqueeze(-1).expand_as(lp) if config.ratio_level == "sequence"
                  else log_ratio.exp())
        clamped = ratios.clamp(1.0 - config.clip_low, 1.0 + config.clip_high)
    metrics = dict(probs_ratio=token_mean(ratios), probs_ratio_clamped=token_mean(clamped))
    for name, x in (("probs_ratio", ratios), ("probs_ratio_clamped", clamped)):
        chosen = x[mask]
        metrics[f"{name}_min"] = float(chosen.min()) if chosen.numel() else float("inf")
        metrics[f"{name}_max"] = float(chosen.max()) if chosen.numel() else float("-inf")
    if ref is not None:  # the loss's KL value, as NeMo-RL's calculate_kl: input clamp, estimator, weight, output clamp
        kl = kl_term(lp, ref.double(), lp, config, gen)[0]
        metrics["kl_penalty"] = token_mean(kl) if config.loss_agg == "token-mean" else seq_mean(per_seq(kl))
    else:
        metrics["kl_penalty"] = 0.0
    log_m = torch.logaddexp(prev, gen) - math.log(2.0)
    bregman = lambda a: torch.exp(a - log_m) - (a - log_m) - 1.0  # noqa: E731
    metrics.update(token_mult_prob_error=token_mean(torch.exp((gen - prev).abs() * m)),
                   gen_kl_error=token_mean(_kl(kind, prev - gen)), policy_kl_error=token_mean(_kl(kind, gen - prev)),
                   js_divergence_error=token_mean(0.5 * bregman(prev) + 0.5 * bregman(gen)))
    weights, oob = _is_weights(cfg, config, prev, gen, mask, token_mask, per_seq)
    seq_level = bool(_get(cfg, "sequence_level_importance_ratios"))
    metrics["sampling_importance_ratio"] = seq_mean(weights) if seq_level else token_mean(weights)
    if oob is not None:  # a sequence's (seq-mask-tis: over the sequences; else over the tokens, a sequence weight's
        # verdict on each of its tokens)
        metrics["is_oob_ratio"] = (seq_mean(oob) if _get(cfg, "truncated_importance_sampling_type") == "seq-mask-tis"
                                   else token_mean(oob.unsqueeze(-1) if seq_level else oob))
    metrics.update(num_valid_samples=float(sample_mask.sum()), approx_entropy=-token_mean(torch.exp(lp - gen) * lp),
                   positive_nll_loss=0.0)
    return metrics


def _is_weights(cfg, config, prev, gen, mask, token_mask, per_seq):
    """NeMo-RL's actor importance weights as its metric reads them (per sequence [B] at the sequence level, else
    per token), and the out-of-bounds indicator of its truncation type (None without one)."""
    if bool(_get(cfg, "sequence_level_importance_ratios")):
        log_w = torch.where(mask, prev - gen, 0.0).sum(-1)
    else:
        log_w = prev - gen
    # in fp32 as NeMo-RL's, whose overflowing weights nan_to_num makes 0
    weights = torch.nan_to_num(torch.exp(log_w.float()), nan=0.0, posinf=0.0, neginf=0.0).double()
    kind = _get(cfg, "truncated_importance_sampling_type")
    if kind is None:
        return weights, None
    cap = float(_get(cfg, "truncated_importance_sampling_ratio"))
    floor = float(_get(cfg, "truncated_importance_sampling_ratio_min") or 0.0)
    if kind == "seq-mask-tis":
        geo = torch.exp(per_seq(torch.nan_to_num(prev - gen, nan=0.0, posinf=0.0, neginf=0.0)))
        kept = (geo >= floor) & (geo <= cap)
        return weights * kept.double().unsqueeze(-1), (~kept).double()
    inside = (weights >= floor) & (weights <= cap)
    if kind == "tis":
        return weights.clamp(floor, cap), (~inside).double()
    return torch.where(inside, weights, 0.0), (~inside).double()


def metric_normalizations(cfg) -> dict:
    """{metric: the global count that divides it}: NeMo-RL's MetricNormalizer (TOKENS, SEQUENCES or NONE) where
    NeMo-RL is importable, else its value ("tokens", "sequences", "none")."""
    try:
        from nemo_rl.algorithms.loss.interfaces import MetricNormalizer
        tokens, sequences, none = MetricNormalizer.TOKENS, MetricNormalizer.SEQUENCES, MetricNormalizer.NONE
    except ImportError:
        tokens, sequences, none = "tokens", "sequences", "none"
    loss = tokens if _get(cfg, "token_level_loss") else sequences
    out = dict(loss=loss, kl_penalty=loss, sampling_importance_ratio=(
        sequences if _get(cfg, "sequence_level_importance_ratios") else tokens))
    out.update(dict.fromkeys(("probs_ratio", "probs_ratio_clamped", "token_mult_prob_error", "gen_kl_error",
                              "policy_kl_error", "js_divergence_error", "approx_entropy"), tokens))
    out.update(dict.fromkeys(("num_valid_samples", "positive_nll_loss", "probs_ratio_min", "probs_ratio_max",
                              "probs_ratio_clamped_min", "probs_ratio_clamped_max"), none))
    kind = _get(cfg, "truncated_importance_sampling_type")
    if kind is not None:
        out["is_oob_ratio"] = sequences if kind == "seq-mask-tis" else tokens
    return out


class _LogitLossFunction:
    """NeMo-RL's loss function protocol for a loss that takes the logits: its input and loss types, as NeMo-RL's
    enums where NeMo-RL is importable (else their values as strings). `token_level` picks the loss type."""

    token_level = True

    @property
    def input_type(self):
        """NeMo-RL's LossInputType.LOGIT ("logit" without NeMo-RL)."""
        try:
            from nemo_rl.algorithms.loss.interfaces import LossInputType
        except ImportError:
            return "logit"
        return LossInputType.LOGIT

    @property
    def loss_type(self):
        """NeMo-RL's LossType: TOKEN_LEVEL, or SEQUENCE_LEVEL for a sequence-level loss ("token_level" /
        "sequence_level" without NeMo-RL)."""
        try:
            from nemo_rl.algorithms.loss.interfaces import LossType
        except ImportError:
            return "token_level" if self.token_level else "sequence_level"
        return LossType.TOKEN_LEVEL if self.token_level else LossType.SEQUENCE_LEVEL


class FusedClippedPGLossFn(_LogitLossFunction):
    """A NeMo-RL loss function (the LossFunction protocol) in place of ClippedPGLossFn: it takes the logits
    (input type LOGIT) and returns ClippedPGLossFn's (loss, metrics) (`clipped_pg_loss_from_logits`).

        loss_fn = FusedClippedPGLossFn(master_config["loss_fn"],
                                       generation_config=master_config["policy"]["generation"])

    Args:
        cfg: ClippedPGLossConfig or the `loss_fn` mapping; checked here (`config_from_nemo_rl`).
        generation_config: the policy's generation config (its "top_k" and "top_p" are read), or None. NeMo-RL
            filters the training logprobs by the sampler's top-k / top-p only on its logprob input, so a
            filtering sampler is refused here by name (replay its truncation with fused_is.policy_loss(kept=...)).
            Without it, the caller vouches that the sampler does not filter.
        options: backend, inplace, validate, vocab_group for fused_is.policy_loss.

    `metric_normalizations` says which global count divides each metric, as ClippedPGLossFn's does (NeMo-RL's
    split-step trainers rescale by it).
    """

    def __init__(self, cfg, *, generation_config: Optional[Mapping] = None, **options):
        if generation_config is not None:
            top_k, top_p = generation_config.get("top_k"), generation_config.get("top_p")
            if top_k is not None and top_k > 0:
                raise ValueError(f"NeMo-RL generation option top_k={top_k!r} is not supported by "
                                 "fused_is.integrations.nemo_rl: its training logprobs are filtered to the top k")
            if top_p is not None and top_p != 1.0:
                raise ValueError(f"NeMo-RL generation option top_p={top_p!r} is not supported by "
                                 "fused_is.integrations.nemo_rl: its training logprobs are filtered to the top p")
        self.cfg = cfg
        self.config, self.composed = _fused_config(cfg)
        self.options = options
        self.token_level = self.config.loss_agg == "token-mean"
        self.metric_normalizations = metric_normalizations(cfg)

    def __call__(self, logits: torch.Tensor, data: Mapping, global_valid_seqs=None,
                 global_valid_toks=None) -> Tuple[torch.Tensor, Dict[str, float]]:
        """(loss, metrics) of the micro-batch: see clipped_pg_loss_from_logits for the shapes."""
        return clipped_pg_loss_from_logits(self.cfg, logits, data, global_valid_seqs, global_valid_toks,
                                           **self.options)


# ---------------------------------------------------------------------------------------------------------------
# On-policy distillation: DistillationLossFn

DISTILLATION_DEFAULTS = dict(kl_type="mixed", mixed_kl_weight=0.5, zero_outside_topk=False)
_LOG_INFINITESIMAL = -100.0  # NeMo-RL's stand-in for log 0 outside the teacher's top k


def _distillation_options(cfg) -> Tuple[str, float, bool]:
    get = lambda name: _get(cfg, name, DISTILLATION_DEFAULTS)  # noqa: E731
    kind, weight, zero = get("kl_type"), float(get("mixed_kl_weight")), bool(get("zero_outside_topk"))
    if kind not in ("forward", "reverse", "mixed"):
        _refuse("kl_type", kind, "expected 'forward', 'reverse' or 'mixed'")
    if not 0.0 <= weight <= 1.0:
        _refuse("mixed_kl_weight", weight, "NeMo-RL requires it in [0, 1]")
    return kind, weight, zero


def distillation_loss_from_logits(cfg, logits: torch.Tensor, data: Mapping, global_valid_seqs=None,
                                  global_valid_toks=None, **options) -> Tuple[torch.Tensor, Dict[str, float]]:
    """NeMo-RL's DistillationLossFn from the student's logits: the forward, reverse or mixed KL between the
    teacher's and the student's distributions over the teacher's top k tokens of each position, as NeMo-RL forms
    them, without its fp32 copy of the student's [B, S, V] logits.

    With zero_outside_topk=False (NeMo-RL's default) both distributions are renormalised over the k tokens, so only
    the k student logits are read (gathered in their own dtype). With zero_outside_topk=True the student's
    logprobs are those of the whole vocabulary: the kernels' statistics sweep gives each row's normaliser and
    entropy (NeMo-RL's correction term for the mass outside the top k), and the gradient is formed block by block
    of rows in fp32 and rounded once.

    Args:
        cfg: NeMo-RL's DistillationLossConfig, or a mapping with its names (kl_type, mixed_kl_weight,
            zero_outside_topk).
        logits: [B, S', V] student logits (bf16/fp16/fp32), S' >= S, as NeMo-RL's worker hands them to a loss
            function (already divided by the temperature); row s scores token s + 1.
        data: "input_ids" [B, S]; "teacher_topk_logits" [B, S, k] (float) and "teacher_topk_indices" [B, S, k]
            (int64 in [0, V)); "token_mask" [B, S] and "sample_mask" [B] (without both, every position counts).
        global_valid_seqs: unused (the loss is a token mean), accepted as NeMo-RL passes it.
        global_valid_toks: NeMo-RL's global token count (the mean's denominator), or None for this micro-batch's.
        options: backend, validate for the statistics sweep (zero_outside_topk=True); vocab_group: Megatron's
            tensor-parallel group when logits are this rank's vocabulary shard [B, S', V_local] (the shards
            contiguous in rank order; the teacher's ids global): the k logits are gathered from their shards (one
            all-gather of [B, S, k] values), the statistics are the whole rows' (fused_is.token_logprobs with the
            group); the loss is the same on every rank, the gradient this shard's.
    Returns:
        (loss 0-d, {"loss", "num_valid_samples"}), differentiable w.r.t. logits.
    """
    kind, weight, zero_outside = _distillation_options(cfg)
    unknown = set(options) - {"backend", "validate", "vocab_group"}
    if unknown:
        raise TypeError(f"distillation_loss_from_logits got unexpected keyword(s) {sorted(unknown)}; it passes on "
                        "backend and validate to the statistics sweep and takes vocab_group")
    group = options.get("vocab_group")
    batch, seq = _checked_ids("distillation_loss_from_logits", logits, data).shape
    indices, teacher = data.get("teacher_topk_indices"), data.get("teacher_topk_logits")
    for name, x in (("teacher_topk_indices", indices), ("teacher_topk_logits", teacher)):
        if not isinstance(x, torch.Tensor) or x.dim() != 3 or tuple(x.shape[:2]) != (batch, seq) or x.shape[-1] < 1:
            raise ValueError(f"distillation_loss_from_logits: data[{name!r}] must be [B, S, k] with [B, S] = "
                             f"{(batch, seq)} and k >= 1; got {getattr(x, 'shape', type(x).__name__)}")
    if indices.shape != teacher.shape or indices.dtype not in (torch.int32, torch.int64):
        raise ValueError("distillation_loss_from_logits: data['teacher_topk_indices'] must be integer ids shaped like "
                         "data['teacher_topk_logits']")
    start, vocab = (0, logits.shape[-1]) if group is None else fused_is.distributed.open_shard(
        logits, "logits", "[B, S', V_local]", -1, group, "full")
    idx = indices[:, :seq - 1].long()
    if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= vocab):
        raise ValueError(f"distillation_loss_from_logits: data['teacher_topk_indices'] must be in [0, {vocab})")
    if "token_mask" in data and "sample_mask" in data:
        token_mask, sample_mask = data["token_mask"], data["sample_mask"]
        if (not isinstance(token_mask, torch.Tensor) or token_mask.dim() != 2 or token_mask.shape[0] != batch
                or token_mask.shape[1] < seq or not isinstance(sample_mask, torch.Tensor)
                or tuple(sample_mask.shape) != (batch,)):
            raise ValueError(f"distillation_loss_from_logits: data['token_mask'] must be [B, S] and "
                             f"data['sample_mask'] [B], [B, S] = {(batch, seq)}")
        _check_binary("distillation_loss_from_logits", token_mask=token_mask, sample_mask=sample_mask)
        mask = (token_mask[:, 1:seq] != 0) & (sample_mask != 0).unsqueeze(-1)
        count = _global(global_valid_toks, mask, "global_valid_toks")
        denominator = (float(mask.sum()) if count is None else count) + 1e-8
    else:  # NeMo-RL then takes the plain mean over every position
        mask = torch.ones(batch, seq - 1, dtype=torch.bool, device=logits.device)
        denominator = float(mask.numel())
    rows = logits[:, :seq - 1]
    shard = None if group is None else (group, start)
    if zero_outside:  # the whole vocabulary's logprobs of the k tokens, and the entropy
        student, entropy = _TopkLogprobs.apply(logits, idx, mask, options.get("backend", "auto"),
                                               options.get("validate", "full"), shard)
    elif shard is None:
        student = torch.log_softmax(rows.gather(-1, idx).float(), -1)  # the k logits in their dtype, then fp32
    else:
        student = torch.log_softmax(_ShardGather.apply(rows, idx, shard).float(), -1)
    teacher_lp = torch.log_softmax(teacher[:, :seq - 1].to(student.dtype), -1)
    p, q = student.exp(), teacher_lp.exp()
    forward = (q * (teacher_lp - student)).sum(-1)
    reverse = (p * (student - teacher_lp)).sum(-1)
    per_token = forward if kind == "forward" else reverse if kind == "reverse" else \
        weight * forward + (1.0 - weight) * reverse
    if zero_outside and kind != "forward":  # the student's mass outside the top k against the teacher's log 0
        rest = -entropy.float() - (p * student).sum(-1) - _LOG_INFINITESIMAL * (1.0 - p.sum(-1))
        per_token = per_token + (rest if kind == "reverse" else (1.0 - weight) * rest)
    loss = torch.where(mask, per_token, 0.0).sum() / denominator
    return loss, {"loss": float(loss.detach()), "num_valid_samples": batch}


def _gather_shard(rows: torch.Tensor, idx: torch.Tensor, shard) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(the logits of rows [B, T, V_local] at the global ids idx [B, T, k], gathered over the shards, in rows'
    dtype: the same on every rank; the shard-local ids, 0 where another shard has the id; where this one does).
    shard: (group, this shard's first id). One all-gather of [B, T, k] values, summed in rank order: each value
    comes from its one shard, the others add exact zeros."""
    group, start = shard
    local = idx - start
    owned = (local >= 0) & (local < rows.shape[-1])
    local = torch.where(owned, local, 0)
    values = torch.where(owned, rows.gather(-1, local), torch.zeros((), dtype=rows.dtype, device=rows.device))
    return fused_is.distributed.gather_ranks(values, group).sum(0, dtype=rows.dtype), local, owned


class _ShardGather(torch.autograd.Function):
    """rows [B, T, V_local] (this rank's vocabulary shard) at the global ids idx [B, T, k]: the values of every
    shard (`_gather_shard`), differentiable w.r.t. this shard's columns (the loss is the same on every rank; each
    takes the gradient of its own columns, as fused_is's vocab_group)."""

    @staticmethod
    def forward(ctx, rows, idx, shard):
        with torch.no_grad():
            values, local, owned = _gather_shard(rows, idx, shard)
        ctx.save_for_backward(local, owned)
        ctx.shape = rows.shape
        return values

    @staticmethod
    def backward(ctx, grad):
        local, owned = ctx.saved_tensors
        out = torch.zeros(ctx.shape, dtype=grad.dtype, device=grad.device)
        return out.scatter_add_(-1, local, torch.where(owned, grad, 0.0)), None, None


class _TopkLogprobs(torch.autograd.Function):
    """(log p_k [B, T, k] fp32 at the ids, entropy H [B, T] fp32) of softmax(logits[:, :T]) over the whole
    vocabulary, differentiable w.r.t. the [B, S', V] logits (S' >= T; rows T and later get a zero gradient).
    Forward: the kernels' statistics sweep (fused_is.token_logprobs: lse from the first id's logprob) and the k
    gathered logits. Backward: d z = scatter_k(g_k) - (sum_k g_k) p - h p (log p + H) on the valid rows (masked rows
    0 whatever they hold; p = 0 takes no entropy term), each block of rows of one sequence formed in fp32 and
    rounded once into the logits' dtype: no [B, T, V] fp32 tensor, no copy of the logits, no two roundings of
    terms that cancel. shard: None, or (vocab_group, this shard's first id) for a vocabulary shard of the logits:
    the whole rows' statistics and the k logits gathered from their shards; the gradient of this shard's columns."""

    ROW_ELEMENTS = 1 << 22  # fp32 elements of one backward block

    @staticmethod
    def forward(ctx, logits, idx, mask, backend, validate, shard=None):
        rows = logits[:, :idx.shape[1]]
        with torch.no_grad():
            lp0, entropy = fused_is.token_logprobs(rows, idx[..., 0], backend=backend, mask=mask, validate=validate,
                                                   vocab_group=None if shard is None else shard[0])
            if shard is None:
                gathered, local, owned = rows.gather(-1, idx), idx, None
            else:  # the k logits from their shards; the gradient's scatter takes this shard's ids alone
                gathered, local, owned = _gather_shard(rows, idx, shard)
            gathered = gathered.float()
            lse = torch.where(mask, gathered[..., 0] - lp0.float(), 0.0)
            entropy = torch.where(mask, entropy.float(), 0.0)
        ctx.save_for_backward(logits, local, mask, lse, entropy, owned)
        ctx.set_materialize_grads(False)
        return torch.where(mask.unsqueeze(-1), gathered - lse.unsqueeze(-1), 0.0), entropy

    @staticmethod
    def backward(ctx, grad_lp, grad_entropy):
        logits, idx, mask, lse, entropy, owned = ctx.saved_tensors
        out = torch.zeros_like(logits)
        if grad_lp is None and grad_entropy is None:
            return out, None, None, None, None, None
        g = (torch.zeros(idx.shape, device=logits.device) if grad_lp is None else
             torch.where(mask.unsqueeze(-1), grad_lp.float(), 0.0))
        # d lp_j / d z_i = 1[i = j] - p_i: the p term of every id, the one-hot of this shard's ids alone
        scattered = g if owned is None else torch.where(owned, g, 0.0)
        h = None if grad_entropy is None else torch.where(mask, grad_entropy.float(), 0.0)
        step = max(1, _TopkLogprobs.ROW_ELEMENTS // max(1, logits.shape[-1]))
        for b in range(idx.shape[0]):
            for start in range(0, idx.shape[1], step):
                block = slice(start, min(start + step, idx.shape[1]))
                valid = mask[b, block]
                if not bool(valid.any()):
                    continue
                log_p = logits[b, block].float() - lse[b, block, None]
                p = log_p.exp()
                coef = g[b, block].sum(-1, keepdim=True)
                grad = -p * coef
                if h is not None:  # dH/dz = -p (log p + H), 0 where p = 0 (a -inf logit)
                    grad = grad - torch.where(p > 0, p * (log_p + entropy[b, block, None]), 0.0) * h[b, block, None]
                grad.scatter_add_(1, idx[b, block], scattered[b, block])
                out[b, block] = torch.where(valid[:, None], grad, 0.0).to(out.dtype)
        return out, None, None, None, None, None


class FusedDistillationLossFn(_LogitLossFunction):
    """A NeMo-RL loss function in place of DistillationLossFn: it takes the student's logits (input type LOGIT)
    and the teacher's top-k logits from the micro-batch, and returns its (loss, metrics)
    (`distillation_loss_from_logits`).

        loss_fn = FusedDistillationLossFn(master_config["loss_fn"])   # where the trainer builds DistillationLossFn

    Args:
        cfg: DistillationLossConfig or the `loss_fn` mapping (kl_type, mixed_kl_weight, zero_outside_topk).
        options: backend, validate for the statistics sweep; vocab_group: Megatron's tensor-parallel group, whose
            ranks hold the logits' vocabulary shards (NeMo-RL hands a LOGIT loss function the shard alone).
    """

    def __init__(self, cfg, **options):
        self.cfg = cfg
        self.kl_type, self.mixed_kl_weight, self.zero_outside_topk = _distillation_options(cfg)
        self.options = options

    def __call__(self, logits: torch.Tensor, data: Mapping, global_valid_seqs=None,
                 global_valid_toks=None) -> Tuple[torch.Tensor, Dict[str, float]]:
        """(loss, metrics) of the micro-batch: see distillation_loss_from_logits for the shapes."""
        return distillation_loss_from_logits(self.cfg, logits, data, global_valid_seqs, global_valid_toks,
                                             **self.options)
