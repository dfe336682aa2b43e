"""backend="reference": DESIGN.md section 2 written out in eager PyTorch, gradients by autograd.

This is the oracle of the tests and benchmarks, and also "the way trainers write it today": upcast,
log_softmax, gather, autograd. It computes in float64 when given float64 logits and in float32
otherwise. It shares nothing with fused_is/coefficients.py but the flattened inputs (the `Call`), so a
mistake in one is caught by the other.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Dict, Tuple

import torch

from .config import SAPO_LOG_RATIO_BOUND
from .constants import LN_FLT_MAX
from .validate import output_dtype

if TYPE_CHECKING:  # the flattened inputs' type only
    from .call import Call as Batch

Tensor = torch.Tensor


def _seq_sum(x: Tensor, batch: Batch) -> Tensor:
    return torch.zeros(batch.num_seqs, dtype=x.dtype, device=x.device).index_add(0, batch.seq_index, x)


def row_stats(logits: Tensor, tokens: Tensor, valid: Tensor, temperature, dtype: torch.dtype, kept=None):
    """(lp [N], H [N]) of softmax(logits / temperature) in `dtype`, differentiable, for [B, T, V] or [N, V]
    logits, flat token ids [N], valid (bool [N]) and temperature a float or a tensor [N] (row t divided by
    its own tau_t). A masked row may hold anything (NaN, +-inf, huge values): its lp and H are those of a
    stand-in, the row detached with NaN read as 0 and every value clamped to +-finfo.max min(1, tau) / 2 (finite
    after the division by tau, and so are the differences log_softmax forms), and no gradient reaches the
    logits from it (the where's backward selects; it does not multiply 0 by a NaN). A -inf logit at an
    unmasked row has p = 0 and adds 0 to H: p log p is taken as 0 there (not 0 * -inf), with a zero gradient.
    kept (int64 [N, K], -1 = none): the softmax over each row's kept set only, every other logit read as -inf."""
    z = logits.reshape(-1, logits.shape[-1]).to(dtype)
    if isinstance(temperature, Tensor):
        temperature = temperature.to(dtype).unsqueeze(1)
    half = torch.finfo(dtype).max / 2
    bound = half * temperature.clamp(max=1.0) if isinstance(temperature, Tensor) else half * min(1.0, temperature)
    stand_in = torch.clamp(torch.nan_to_num(z.detach(), nan=0.0), -bound, bound)
    z = torch.where(valid.unsqueeze(1), z, stand_in) / temperature
    if kept is not None:  # the sampler's support: everything else has probability 0
        count = torch.zeros(z.shape, dtype=torch.int32, device=z.device)
        count.scatter_add_(1, kept.clamp(min=0), (kept >= 0).int())  # a -1 entry adds 0 at column 0
        z = torch.where(count > 0, z, torch.full_like(z, -math.inf))
    logp = torch.log_softmax(z, dim=-1)
    lp = logp.gather(1, tokens.unsqueeze(1)).squeeze(1)
    finite_logp = torch.where(torch.isfinite(logp), logp, torch.zeros_like(logp))
    return lp, -(logp.exp() * finite_logp).sum(dim=-1)


def reference_policy_loss(batch: Batch) -> Tuple[Tensor, Tensor, Tensor, Dict[str, Tensor]]:
    """(loss, lp [N], H [N], metrics) with the loss differentiable w.r.t. batch.logits by autograd."""
    loss, lp, entropy, metrics, _ = reference_policy_loss_terms(batch)
    return loss, lp, entropy, metrics


def reference_policy_loss_terms(batch: Batch):
    """As `reference_policy_loss`, plus the loss's scale: the same aggregation of |L_t| (detached).

    The scale is what a loss error should be measured against: the loss is a signed sum whose terms
    can cancel, and a kernel's rounding is relative to the terms, not to their sum.
    """
    cfg = batch.config
    logits = batch.logits
    if cfg.score_centering is not None and not (torch.is_grad_enabled() and logits.requires_grad):
        # the centering term's value needs the loss's d/d lp: formed on a leaf of the same values, then detached
        with torch.enable_grad():
            terms = reference_policy_loss_terms(dataclasses.replace(batch, logits=logits.detach().requires_grad_()))
        return tuple({k: v.detach() for k, v in x.items()} if isinstance(x, dict) else x.detach() for x in terms)
    dtype = output_dtype(logits.dtype)
    as_dtype = lambda x: None if x is None else x.to(dtype)  # noqa: E731

    m = as_dtype(batch.mask)
    rejected = gate = m2po_dropped = None
    if cfg.m2_threshold is not None:  # M2PO, written out again from the caller's mask, before the rejection
        ranked = as_dtype(batch.m2po_ranked)
        m2po_dropped = ranked - ranked * _m2po_keep(batch, dtype)
        m = ranked - m2po_dropped  # the mask the rejection sees, and (without one) the call's
    if cfg.rejection:  # written out again from the caller's mask: prepare_batch's own reduction is not trusted
        if cfg.m2_threshold is not None:
            given_mask = m
        else:
            given_mask = m + as_dtype(batch.rejected) if cfg.rejection_counts == "drop" else m
        kept = _rejection_keep(batch, given_mask, dtype)
        rejected = given_mask - given_mask * kept
        if cfg.rejection_counts == "drop":  # verl: rejected tokens leave the mask and every count
            m = given_mask * kept
        else:  # OpenRLHF: their policy terms times 0, nothing else changes
            gate = kept
    valid = m > 0

    row_lp, entropy = row_stats(logits, batch.tokens, valid, batch.temperature, dtype, batch.kept)  # learner lp, H
    # the loss reads lp at unmasked rows only: 0 elsewhere, so that no masked term (a ratio or k3 of an
    # extreme lp) overflows and turns its zero gradient into 0 * inf = nan
    lp = torch.where(valid, row_lp, torch.zeros_like(row_lp))
    adv = as_dtype(batch.advantages)
    samp = as_dtype(batch.sampler_logprobs)
    old = as_dtype(batch.old_logprobs) if batch.old_logprobs is not None else lp.detach()
    if batch.proximal_alpha is not None:  # ratio_ref="loglinear": AReaL's proximal, between the sampler and lp
        alpha = as_dtype(batch.proximal_alpha)
        old = samp + alpha * (lp.detach() - samp)

    # importance weight W (no gradient)
    if batch.is_weights is not None:  # the caller's own
        weight = as_dtype(batch.is_weights)
        masked, truncated = valid & (weight == 0), torch.zeros_like(valid)
    elif cfg.is_level == "none":
        weight = torch.ones_like(lp)
        masked = truncated = torch.zeros_like(valid)
    else:
        delta = torch.where(valid, old - samp, torch.zeros_like(old))
        if cfg.is_level == "token":
            log_w = delta
        elif cfg.is_level == "sequence":
            log_w = _seq_sum(delta, batch)[batch.seq_index]
        else:  # geometric mean over the unmasked tokens of the sequence
            log_w = (_seq_sum(delta, batch) / _seq_sum(m, batch).clamp(min=1))[batch.seq_index]
        w = torch.exp(torch.clamp(log_w, -20.0, 20.0))
        floor = 0.0 if cfg.is_floor is None else cfg.is_floor
        kept = (w >= floor) & (w <= cfg.is_cap)
        masked = truncated = torch.zeros_like(valid)
        if cfg.is_mode == "truncate":
            weight = torch.minimum(w, torch.full_like(w, cfg.is_cap))
            if cfg.is_floor is not None:
                weight = torch.maximum(weight, torch.full_like(w, cfg.is_floor))
            truncated = weight != w
        elif cfg.is_mode == "mask":
            weight = torch.where(kept, w, torch.zeros_like(w))
            masked = ~kept
        elif cfg.is_mode == "reject":
            weight = kept.to(dtype)
            masked = ~kept
        else:
            weight = w
        weight = weight.detach()

    # policy surrogate
    base = old
    applied = weight  # what multiplies the surrogate
    if cfg.policy == "reinforce":
        surrogate = adv * lp
    elif cfg.policy == "vespo":  # REINFORCE under the sequence's gamma weight, into which W went
        surrogate = adv * lp
        floor = math.log(1e-8)
        log_w = torch.where(valid, torch.clamp(lp.detach() - old, -20.0, 20.0), torch.zeros_like(lp))
        if batch.is_weights is not None or cfg.is_level != "none":
            log_w = log_w + torch.where(valid, torch.clamp(torch.log(weight), floor, 20.0), torch.zeros_like(lp))
        log_w = torch.clamp(_seq_sum(log_w, batch), floor, 20.0)[batch.seq_index]
        k = torch.where(adv >= 0, torch.full_like(adv, cfg.vespo_k_pos), torch.full_like(adv, cfg.vespo_k_neg))
        lam = torch.where(adv >= 0, torch.full_like(adv, cfg.vespo_lambda_pos),
                          torch.full_like(adv, cfg.vespo_lambda_neg))
        lam = torch.clamp(lam, min=1e-4)
        applied = torch.nan_to_num(torch.exp(lam + k * log_w - lam * torch.exp(log_w)), nan=0.0, posinf=0.0,
                                   neginf=0.0).detach()
    elif cfg.policy == "gmpo":  # the geometric mean of sign-clipped token ratios, one per sequence
        base = samp if cfg.ratio_ref == "sampler" else old
        log_ratio = lp - base
        if cfg.log_ratio_clamp is not None:
            log_ratio = torch.clamp(log_ratio, -cfg.log_ratio_clamp, cfg.log_ratio_clamp)
        sign = torch.sign(adv)
        bounded = torch.clamp(log_ratio, -cfg.clip_low, cfg.clip_high)
        kept = sign * torch.minimum(sign * log_ratio, sign * bounded)
        seq_mean = _seq_sum(torch.where(valid, kept, torch.zeros_like(kept)), batch) / _seq_sum(m, batch).clamp(min=1)
        surrogate = torch.exp(seq_mean)[batch.seq_index] * adv
        clipped = (kept.detach() != log_ratio.detach()) & (adv != 0)
    elif cfg.policy == "sapo":  # a soft gate on the ratio instead of the clip
        base = samp if cfg.ratio_ref == "sampler" else old
        log_ratio = lp - base
        if cfg.log_ratio_clamp is not None:
            log_ratio = torch.clamp(log_ratio, -cfg.log_ratio_clamp, cfg.log_ratio_clamp)
        tau = torch.where(adv > 0, torch.full_like(adv, cfg.sapo_tau_pos), torch.full_like(adv, cfg.sapo_tau_neg))
        ratio = torch.exp(torch.clamp(log_ratio, max=SAPO_LOG_RATIO_BOUND))  # the gate is saturated beyond
        surrogate = torch.sigmoid(tau * (ratio - 1)) * 4 / tau * adv
        clipped = torch.zeros_like(valid)
    elif cfg.policy in ("dppo_tv", "dppo_kl"):  # REINFORCE under a capped ratio inside a probability trust region
        base = samp if cfg.ratio_ref == "sampler" else old
        log_ratio = lp.detach() - base
        if cfg.log_ratio_clamp is not None:
            log_ratio = torch.clamp(log_ratio, -cfg.log_ratio_clamp, cfg.log_ratio_clamp)
        ratio = torch.exp(log_ratio)
        if cfg.ratio_cap is not None:
            ratio = torch.clamp(ratio, max=cfg.ratio_cap)
        p, p_old = torch.exp(lp.detach()), torch.exp(base)
        if cfg.policy == "dppo_tv":
            inside = torch.where(adv > 0, p - p_old <= cfg.clip_high, p - p_old >= -cfg.clip_low)
        else:
            binary_kl = p_old * torch.log(p_old / p) + (1 - p_old) * torch.log((1 - p_old + 1e-8) / (1 - p + 1e-8))
            inside = torch.where(adv > 0, (binary_kl <= cfg.clip_high) | (p <= p_old),
                                 (binary_kl <= cfg.clip_low) | (p >= p_old))
        surrogate = (ratio * inside).detach() * adv * lp
        clipped = ~inside
    elif cfg.policy == "prime_rl":  # prime-rl: the ratio to the sampler, masked where the probability moved too far
        base = samp if cfg.ratio_ref == "sampler" else old
        log_ratio = lp - base
        if cfg.log_ratio_clamp is not None:
            log_ratio = torch.clamp(log_ratio, -cfg.log_ratio_clamp, cfg.log_ratio_clamp)
        move = torch.exp(lp.detach()) - torch.exp(base)
        dropped = torch.where(adv > 0, move > cfg.clip_high, move < -cfg.clip_low)
        surrogate = torch.where(dropped, torch.zeros_like(lp), torch.exp(log_ratio) * adv)
        clipped = dropped
        penalty = cfg.ratio_penalty_coef * (lp - base) ** 2  # on every token, masked by probability or not
    elif cfg.policy in ("clip_cov", "kl_cov"):  # verl's Clip-Cov / KL-Cov: a selection by cov(A, lp) over the batch
        base = samp if cfg.ratio_ref == "sampler" else old
        log_ratio = lp - base
        ratio = torch.exp(log_ratio)
        ppo = torch.minimum(ratio * adv, torch.clamp(ratio, 1 - cfg.clip_low, 1 + cfg.clip_high) * adv)
        lp_d = lp.detach()
        centred_adv = torch.where(valid, adv - adv[valid].mean(), torch.zeros_like(adv)) if valid.any() else adv
        cov = centred_adv * (lp_d - (lp_d[valid].mean() if valid.any() else 0.0))
        count = int(valid.sum())
        chosen = torch.zeros_like(valid)
        if count:
            k = max(1, int(count * cfg.cov_ratio))
            if cfg.policy == "kl_cov":  # the k largest cov, equal ones in token order (a stable sort)
                order = torch.argsort(torch.where(valid, cov, torch.full_like(cov, -float("inf"))), descending=True,
                                      stable=True)
                chosen[order[:k]] = True
            else:
                inside = valid & (ppo == ratio * adv) & (cov > cfg.cov_bounds[0]) & (cov < cfg.cov_bounds[1])
                # ties (ppo == r A at the clip's edge) count as unclipped, as verl's strict pg_losses2 > pg_losses1
                pool = torch.arange(len(cov), device=cov.device)[inside]
                gen = None if cfg.cov_seed is None else torch.Generator().manual_seed(cfg.cov_seed)
                chosen[pool[torch.randperm(len(pool), generator=gen)[:k].to(pool.device)]] = True
        if cfg.policy == "kl_cov":
            surrogate = ratio * adv - torch.where(chosen, cfg.cov_kl_coef * torch.abs(log_ratio), torch.zeros_like(lp))
            clipped = torch.zeros_like(valid)
        else:
            surrogate = torch.where(chosen, torch.zeros_like(ppo), ppo)
            clipped = ppo != ratio * adv
        cov_chosen = chosen
    elif cfg.policy == "cispo":  # REINFORCE weighted by the clipped ratio, held constant
        base = samp if cfg.ratio_ref == "sampler" else old
        log_ratio = lp - base
        if cfg.log_ratio_clamp is not None:
            log_ratio = torch.clamp(log_ratio, -cfg.log_ratio_clamp, cfg.log_ratio_clamp)
        ratio = torch.exp(log_ratio).detach()
        kept = torch.clamp(ratio, 1 - cfg.clip_low, 1 + cfg.clip_high)
        surrogate = kept * adv * lp
        clipped = kept != ratio
    else:
        base = samp if cfg.ratio_ref == "sampler" else old
        log_ratio = lp - base
        if cfg.ratio_level == "sequence":  # GSPO: the mean log ratio of the sequence, for each of its tokens
            seq_mean = _seq_sum(torch.where(valid, log_ratio, torch.zeros_like(log_ratio)), batch)
            log_ratio = (seq_mean / _seq_sum(m, batch).clamp(min=1))[batch.seq_index]
            if cfg.sequence_log_ratio_max is not None:  # verl's gspo: clamp(max=10), no gradient beyond
                log_ratio = torch.clamp(log_ratio, max=cfg.sequence_log_ratio_max)
        if cfg.log_ratio_clamp is not None:
            log_ratio = torch.clamp(log_ratio, -cfg.log_ratio_clamp, cfg.log_ratio_clamp)
        ratio = torch.exp(log_ratio)
        surrogate = torch.minimum(ratio * adv, torch.clamp(ratio, 1 - cfg.clip_low, 1 + cfg.clip_high) * adv)
        clipped = torch.clamp(ratio, 1 - cfg.clip_low, 1 + cfg.clip_high) * adv < ratio * adv
        if cfg.dual_clip is not None:
            dual = (adv < 0) & (cfg.dual_clip * adv > surrogate)
            surrogate = torch.where(adv < 0, torch.maximum(surrogate, cfg.dual_clip * adv), surrogate)
            clipped = clipped | dual

    off_policy_kept = None
    if cfg.off_policy_mask is not None:  # TRL: drop the policy term of off-policy sequences with A < 0
        behaviour = samp if samp is not None else old
        drift = torch.where(valid, behaviour - lp.detach(), torch.zeros_like(lp))
        seq_drift = _seq_sum(drift, batch) / _seq_sum(m, batch).clamp(min=1)
        off_policy_kept = ((adv >= 0) | (seq_drift[batch.seq_index] <= cfg.off_policy_mask)).to(dtype)
        surrogate = surrogate * off_policy_kept
    if gate is not None:
        applied = applied * gate
    per_token = -applied * surrogate
    if cfg.policy == "prime_rl":
        per_token = per_token + penalty
    if cfg.kl_coef != 0.0:
        ref = as_dtype(batch.ref_logprobs)
        kl_d = lp - ref
        kl_inside = torch.ones_like(valid)
        if cfg.kl_input_clamp is not None:  # the estimator's input clamped; no gradient of it, nor of a weight, beyond
            kl_inside = kl_d.abs() <= cfg.kl_input_clamp
            kl_d = torch.clamp(kl_d, -cfg.kl_input_clamp, cfg.kl_input_clamp)
        if cfg.kl_type in ("k1", "k1+"):
            kl = kl_d
        elif cfg.kl_type == "k2":
            kl = 0.5 * kl_d ** 2
        else:
            kl = torch.exp(-kl_d) + kl_d - 1
        if cfg.kl_weight == "score":  # the score-function term: times exp(lp - sg(lp)), 1 in value, before the clamp
            kl_weight = torch.exp(lp - lp.detach())
            kl = kl * torch.where(kl_inside, kl_weight, kl_weight.detach())
        if cfg.kl_weight == "sampler":  # times exp(lp - samp) with its gradient, before the clamp; 0 past fp32's exp
            kl_x = lp - as_dtype(batch.sampler_logprobs)
            kl_lost = kl_x.detach() > LN_FLT_MAX
            kl_weight = torch.where(kl_lost, 0.0, torch.exp(torch.where(kl_lost, 0.0, kl_x)))
            kl = kl * torch.where(kl_inside, kl_weight, kl_weight.detach())
        if cfg.kl_clamp is not None:
            kl = torch.clamp(kl, -cfg.kl_clamp, cfg.kl_clamp)
        if cfg.kl_type.endswith("+"):  # straight through: this value, the gradient of k2
            k2 = 0.5 * (lp - ref) ** 2
            kl = k2 - k2.detach() + kl.detach()
        if cfg.kl_weight == "ratio":  # times the ratio with its gradient, after the clamp (TRL)
            kl = kl * torch.exp(lp - base.detach())
        per_token = per_token + cfg.kl_coef * kl
    per_token = torch.where(valid, per_token, torch.zeros_like(per_token))
    if cfg.distill_kind is not None:  # on-policy distillation in the same aggregation
        per_token = per_token + cfg.distill_coef * _divergence(batch, logits, valid, dtype)

    # aggregation
    seq_tokens = _seq_sum(m, batch)
    num_seqs = (seq_tokens > 0).sum().to(dtype)

    def aggregate(x, mode, normalizer):
        """x (0 at masked tokens) aggregated by the loss_agg mode `mode` over the batch."""
        if mode == "token-mean":
            total, count = x.sum(), m.sum()
        elif mode == "seq-mean-token-sum":
            total, count = x.sum(), num_seqs
        elif mode == "seq-mean-token-mean":
            total, count = (_seq_sum(x, batch) / seq_tokens.clamp(min=1)).sum(), num_seqs
        else:
            total, count = x.sum() / batch.norm_length, num_seqs
        if normalizer is not None:
            count = torch.as_tensor(normalizer, dtype=dtype, device=x.device)
        return total / count if count > 0 else total  # empty batch: total is 0 with zero gradient

    entropy_term = torch.where(valid, -cfg.entropy_coef * entropy, torch.zeros_like(entropy))
    if cfg.entropy_agg is None:  # the entropy term is one more per-token term
        per_token = per_token + entropy_term
    loss = aggregate(per_token, cfg.loss_agg, batch.normalizer)
    # first-order condition of the loss: |L_t| plus the change a relative rounding of lp_t would cause
    dl_dlp = torch.autograd.grad(per_token.sum(), lp, retain_graph=True)[0] if lp.requires_grad else 0.0
    scale = aggregate(per_token.detach().abs() + (dl_dlp * lp.detach()).abs(), cfg.loss_agg, batch.normalizer)
    if cfg.entropy_agg is not None:  # aggregated on its own (TRL's token-mean entropy bonus)
        loss = loss + aggregate(entropy_term, cfg.entropy_agg, batch.entropy_normalizer)
        scale = scale + aggregate(entropy_term.detach().abs(), cfg.entropy_agg, batch.entropy_normalizer)
    loss, scale = loss * batch.loss_scale, scale * batch.loss_scale  # the caller's constant factor
    n = m.sum()
    mean = lambda x: (torch.where(valid, x.to(dtype), torch.zeros_like(m)).sum() / n) if n > 0 else m.new_zeros(())  # noqa: E731
    centering_metrics = {}
    if cfg.score_centering is not None:  # the expected score under the sampler, subtracted (arXiv 2609.20807)
        if cfg.score_centering == "calibrated":  # the loss's d/d lp as if the IS weight were 1
            unweighted = -(gate if gate is not None else 1.0) * surrogate
            unweighted = torch.where(valid, unweighted, torch.zeros_like(unweighted))
            g_loss = aggregate(unweighted, cfg.loss_agg, batch.normalizer) * batch.loss_scale
        else:
            g_loss = loss
        g = torch.autograd.grad(g_loss, lp, retain_graph=True)[0] if lp.requires_grad else torch.zeros_like(lp)
        term, centering_metrics = _centering_term(batch, logits, valid, dtype, g.detach(), mean)
        loss, scale = loss + term, scale + term.detach().abs()

    # metrics: means over unmasked tokens
    metrics = {"entropy_mean": mean(entropy.detach())}
    if cfg.policy not in ("reinforce", "vespo"):
        metrics["clip_frac"] = mean(clipped.detach())
        metrics["ppo_kl"] = mean((base - lp).detach())
    if samp is not None:
        old_d = old.detach()
        metrics["mismatch_k1"] = mean(samp - old_d)
        metrics["mismatch_k3"] = mean(torch.exp(old_d - samp) - (old_d - samp) - 1)
    if samp is not None or batch.is_weights is not None:
        metrics["is_weight_mean"] = mean(weight)
        metrics["is_weight_max"] = weight[valid].max() if n > 0 else m.new_zeros(())
        metrics["is_weight_min"] = weight[valid].min() if n > 0 else m.new_zeros(())
        metrics["is_masked_frac"] = mean(masked)
    if samp is not None and batch.is_weights is None:
        metrics["is_truncated_frac"] = mean(truncated)
    if rejected is not None:
        given = m.sum() + (rejected.sum() if gate is None else 0.0)
        metrics["rejected_frac"] = rejected.sum() / given if given > 0 else m.new_zeros(())
    if off_policy_kept is not None:
        metrics["off_policy_masked_frac"] = mean(1 - off_policy_kept)
    if m2po_dropped is not None:  # over the tokens M2PO ranked (the caller's unmasked ones)
        ranked = as_dtype(batch.m2po_ranked)
        count = ranked.sum()
        delta = (batch.sampler_logprobs - batch.old_logprobs).to(dtype)
        metrics["m2po_masked_frac"] = m2po_dropped.sum() / count if count > 0 else m.new_zeros(())
        metrics["m2po_m2"] = (ranked * delta * delta).sum() / count if count > 0 else m.new_zeros(())
    if cfg.policy in ("clip_cov", "kl_cov"):
        metrics["cov_selected_frac"] = mean(cov_chosen)
    metrics.update(centering_metrics)
    if cfg.distill_kind is not None:
        metrics["distill_mean"] = mean(_divergence(batch, logits, valid, dtype).detach())
    return loss, row_lp.detach(), entropy.detach(), metrics, scale


def _divergence(batch: Batch, logits: Tensor, valid: Tensor, dtype: torch.dtype) -> Tensor:
    """[N] D_t of LossConfig.distill_kind (0 at masked rows), differentiable w.r.t. the student's logits: the
    teacher's softmax(u / tau) against the student's softmax(z / tau) over the whole vocabulary, or with kept= over
    each row's kept set (both renormalised there; tau: each row's temperature), forward KL(q || p), reverse
    KL(p || q), or TRL's generalized JSD (beta 0 and 1 the two KLs). 0 log 0 = 0."""
    cfg = batch.config
    vocab = logits.shape[-1]
    keep = valid.unsqueeze(1)
    tau = batch.temperature  # the config's, or the rows' own (both models at each row's temperature)
    tau = tau.to(dtype).unsqueeze(1) if isinstance(tau, Tensor) else tau
    z = torch.where(keep, logits.reshape(-1, vocab).to(dtype), 0.0) / tau
    u = torch.where(keep, batch.teacher.detach().reshape(-1, vocab).to(dtype), 0.0) / tau
    if batch.kept is not None:  # the sampler's support: every other column has probability 0 in both models
        count = torch.zeros(z.shape, dtype=torch.int32, device=z.device)
        outside = count.scatter_add_(1, batch.kept.clamp(min=0), (batch.kept >= 0).int()) == 0
        z, u = z.masked_fill(outside, -math.inf), u.masked_fill(outside, -math.inf)
    log_p, log_q = torch.log_softmax(z, -1), torch.log_softmax(u, -1)

    def kl(log_a, log_b):  # sum a (log a - log b), 0 where a = 0 (and no NaN gradient there)
        return _weighted_log_ratio(log_a, log_a, log_b).sum(-1)

    beta = cfg.distill_beta
    if cfg.distill_kind == "forward_kl" or (cfg.distill_kind == "jsd" and beta == 0):
        d = kl(log_q, log_p)
    elif cfg.distill_kind == "reverse_kl" or beta == 1:
        d = kl(log_p, log_q)
    else:  # log m, with inputs 0 where both are -inf (outside a kept set) so that logaddexp's gradient stays finite
        either = (log_p > -math.inf) | (log_q > -math.inf)
        log_m = torch.logaddexp(torch.where(either, log_p, 0.0) + math.log1p(-beta),
                                torch.where(either, log_q, 0.0) + math.log(beta))
        log_m = torch.where(either, log_m, -math.inf)
        d = beta * kl(log_q, log_m) + (1 - beta) * kl(log_p, log_m)
    return torch.where(valid, d, torch.zeros_like(d))


def _centering_term(batch: Batch, logits: Tensor, valid: Tensor, dtype: torch.dtype, g: Tensor, mean):
    """(the centering term of the loss, its metrics): -sum_t g_t sum_{j in S} (m_j - alpha p_j) log p_j with m_j and
    alpha detached (arXiv 2609.20807's centered loss with the proportional tail, as the SkyRL and Miles
    implementations write it), over the whole softmax; g [N] the loss's d/d lp (detached)."""
    cfg = batch.config
    tau = batch.temperature
    z = logits.reshape(-1, logits.shape[-1]).to(dtype)
    z = torch.where(valid.unsqueeze(1), z, torch.zeros_like(z))
    z = z / (tau.to(dtype).unsqueeze(1) if isinstance(tau, Tensor) else tau)
    log_p_all = torch.log_softmax(z, dim=-1)
    ids, logq = batch.centering_topk.ids, batch.centering_topk.logq.to(dtype)
    entry = (ids >= 0) & valid.unsqueeze(1)
    log_p = torch.where(entry, log_p_all.gather(1, ids.clamp(min=0)), torch.zeros_like(logq))
    p = torch.where(entry, torch.exp(log_p.detach()), torch.zeros_like(logq))
    q = torch.where(entry, torch.exp(logq), torch.zeros_like(logq))
    sampler_tail = torch.clamp(1 - q.sum(1), min=0.0)
    learner_tail = torch.clamp(1 - p.sum(1), min=0.0)
    c = torch.clamp(sampler_tail, min=1e-6) / torch.clamp(learner_tail, min=1e-6)
    if cfg.score_centering == "calibrated":
        def f(ratio):  # the config's IS weight of a ratio (section 2), written out again
            if cfg.is_mode == "truncate":
                w = torch.clamp(ratio, max=cfg.is_cap)
                return w if cfg.is_floor is None else torch.clamp(w, min=cfg.is_floor)
            inside = (ratio >= (0.0 if cfg.is_floor is None else cfg.is_floor)) & (ratio <= cfg.is_cap)
            if cfg.is_mode == "mask":
                return torch.where(inside, ratio, torch.zeros_like(ratio))
            return inside.to(ratio.dtype) if cfg.is_mode == "reject" else ratio

        ratio = torch.exp(torch.clamp(log_p.detach() - torch.where(q > 0, logq, torch.zeros_like(logq)), -20.0, 20.0))
        m = torch.where(q > 0, q * f(ratio), torch.zeros_like(q))
        alpha = c * f(torch.exp(torch.clamp(-torch.log(c), -20.0, 20.0)))
    else:
        m, alpha = q, c
    residual = (m - alpha.unsqueeze(1) * p).detach()
    term = -(torch.where(valid, g, torch.zeros_like(g)) * (residual * log_p).sum(1)).sum()
    total = m.sum(1) + alpha * learner_tail
    drift = (m - total.unsqueeze(1) * p).abs().sum(1) + (alpha - total).abs() * learner_tail
    return term, {"centering_sampler_tail": mean(sampler_tail), "centering_learner_tail": mean(learner_tail),
                  "centering_c": mean(c), "centering_drift_l1": mean(drift)}


def _m2po_keep(batch: Batch, dtype: torch.dtype) -> Tensor:
    """M2PO (LossConfig.m2_threshold) over the tokens of batch.m2po_ranked: 1 where a token stays. The ranked tokens
    in order of (samp - old)^2, largest first, the earlier first among equals; the first k leave, k the smallest
    with the mean of the rest below the threshold (n - 1 if there is none)."""
    delta2 = ((batch.sampler_logprobs - batch.old_logprobs) ** 2).tolist()
    ranked = [i for i, x in enumerate(batch.m2po_ranked.tolist()) if x > 0]
    order = sorted(ranked, key=lambda i: (-delta2[i], i))
    n = len(order)
    rest_sum = [0.0] * (n + 1)  # rest_sum[i]: the sum of delta^2 over order[i:]
    for i in reversed(range(n)):
        rest_sum[i] = rest_sum[i + 1] + delta2[order[i]]
    leave = next((i for i in range(n) if rest_sum[i] / (n - i) < batch.config.m2_threshold), max(n - 1, 0))
    keep = torch.ones(len(delta2), dtype=dtype, device=batch.mask.device)
    keep[torch.tensor(order[:leave], dtype=torch.long)] = 0.0
    return keep


def _rejection_keep(batch: Batch, given_mask: Tensor, dtype: torch.dtype) -> Tensor:
    """LossConfig.rejection (verl's rollout_rs) per criterion, over the caller's mask: 1 where all pass."""
    valid = given_mask > 0
    log_ratio = torch.clamp(batch.old_logprobs.to(dtype) - batch.sampler_logprobs.to(dtype), -20.0, 20.0)
    token_stat = {"k1": -log_ratio, "k2": log_ratio ** 2 / 2, "k3": torch.exp(log_ratio) - 1 - log_ratio}
    # OpenRLHF's divergences of the sampled token's probability under the sampler (p) and the learner (q)
    p = torch.clamp(torch.exp(batch.sampler_logprobs.to(dtype)), 1e-6, 1 - 1e-6)
    q = torch.clamp(torch.exp(batch.old_logprobs.to(dtype)), 1e-6, 1 - 1e-6)
    token_stat["binary_kl"] = p * (torch.log(p) - torch.log(q)) + (1 - p) * (torch.log(1 - p) - torch.log(1 - q))
    token_stat["tv"] = torch.abs(p - q)
    keep = torch.ones_like(given_mask)
    for option, low, high in batch.config.rejection:
        stat = option.split("_", 2)[-1] if option.startswith("seq_") else option[len("token_"):]
        value = torch.where(valid, token_stat[stat], torch.zeros_like(log_ratio))
        if option.startswith("seq_sum"):
            value = _seq_sum(value, batch)[batch.seq_index]
        elif option.startswith("seq_mean"):
            value = (_seq_sum(value, batch) / _seq_sum(given_mask, batch).clamp(min=1))[batch.seq_index]
        elif option.startswith("seq_max"):
            masked = torch.where(valid, value, torch.full_like(value, -float("inf")))
            top = torch.full((batch.num_seqs,), -float("inf"), dtype=dtype, device=value.device)
            top = top.scatter_reduce(0, batch.seq_index, masked, "amax")
            value = torch.where(torch.isinf(top), torch.zeros_like(top), top)[batch.seq_index]
        if low is None:
            passed = value <= high
        else:
            passed = (value >= math.log(low)) & (value <= math.log(high))
        keep = keep * passed.to(dtype)
    return keep


# --- distillation (DESIGN.md section 9) -------------------------------------------------------------------------

# TRL's bound on a support's log mass before its tail bucket log(1 - mass) (IW-OPD's _add_tail_bucket): a support
# that holds (nearly) all the mass leaves a tail of 1e-7, not log 0, and no gradient through it
TAIL_LOG_MASS_MAX = -1e-7


def distill_reference(logits: Tensor, teacher_logits: Tensor, *, kind: str = "forward_kl", beta: float = 0.5,
                      temperature: float = 1.0, teacher_temperature=None, mask=None, cu_seqlens=None,
                      loss_agg: str = "token-mean", top_k: int = 0, add_tail: bool = True):
    """`fused_is.distill_loss` written out, the oracle: (loss, per_token, metrics), loss differentiable w.r.t. logits
    by autograd, the teacher detached. Takes its arguments as distill_loss does, checked already (no checks here).

    Args:
        logits: student logits z, [B, T, V] padded or [N, V] packed, any float dtype.
        teacher_logits: teacher logits u of the same shape, any float dtype.
        kind, beta, temperature, teacher_temperature, mask, cu_seqlens, loss_agg, top_k, add_tail: as distill_loss.
    Returns:
        loss: 0-d, float64 for float64 logits and float32 otherwise (the dtype it computes in).
        per_token: D_t in that dtype, shaped like logits.shape[:-1], 0 at masked positions, detached.
        metrics: {"divergence_mean": mean of D_t over unmasked tokens, "divergence_max": their max}, 0-d tensors.
    p = softmax(z / tau), q = softmax(u / tau_t), tau_t = teacher_temperature or tau. Per token:
    forward KL(q || p) = sum q (log q - log p); reverse KL(p || q) = sum p (log p - log q); "jsd" as TRL 1.16's
    generalized_jsd_loss: beta = 0 is forward KL, beta = 1 reverse KL, otherwise with m = (1 - beta) p + beta q,
    beta KL(q || m) + (1 - beta) KL(p || m). 0 log 0 = 0 (a -inf logit is probability 0). 0 < top_k < V: the sums
    run over the support (the teacher's top-k for forward KL, the student's for reverse KL, their union for JSD) and,
    with add_tail, one more bucket holding each model's mass outside it; without, each model renormalised over it.
    """
    dtype = output_dtype(logits.dtype)
    vocab = logits.shape[-1]
    token_shape = logits.shape[:-1]
    valid = torch.ones(token_shape.numel(), dtype=torch.bool, device=logits.device) if mask is None \
        else mask.reshape(-1) != 0
    # a masked row may hold anything: zeros stand in for it, and where's backward gives it no gradient
    z = torch.where(valid.unsqueeze(1), logits.reshape(-1, vocab).to(dtype), 0.0)
    u = torch.where(valid.unsqueeze(1), teacher_logits.detach().reshape(-1, vocab).to(dtype), 0.0)
    z = z / temperature
    u = u / (temperature if teacher_temperature is None else teacher_temperature)
    log_p, log_q = torch.log_softmax(z, dim=-1), torch.log_softmax(u, dim=-1)
    if kind == "jsd" and beta in (0, 1):  # TRL's special cases: the KLs themselves, not the limits (which are 0)
        kind = "forward_kl" if beta == 0 else "reverse_kl"
    if 0 < top_k < vocab:  # TRL applies top_k only below the vocabulary size
        log_p, log_q = _top_k_buckets(z, u, log_p, log_q, kind, top_k, add_tail)
    if kind == "forward_kl":
        terms = _weighted_log_ratio(log_q, log_q, log_p)
    elif kind == "reverse_kl":
        terms = _weighted_log_ratio(log_p, log_p, log_q)
    else:
        # log m = log((1 - beta) p + beta q); where both are 0 (a bucket of neither), inputs 0 keep the gradient
        # of logaddexp finite (it is multiplied by 0 there)
        either = (log_p > -math.inf) | (log_q > -math.inf)
        log_m = torch.logaddexp(torch.where(either, log_p, 0.0) + math.log1p(-beta),
                                torch.where(either, log_q, 0.0) + math.log(beta))
        log_m = torch.where(either, log_m, -math.inf)
        terms = (beta * _weighted_log_ratio(log_q, log_q, log_m)
                 + (1 - beta) * _weighted_log_ratio(log_p, log_p, log_m))
    per_token = torch.where(valid, terms.sum(dim=-1), 0.0)

    # aggregation, with the policy loss's loss_agg names (DESIGN.md section 2), and "sum"
    m = valid.to(dtype)
    if len(token_shape) == 2:  # padded: the rows are the sequences
        seq_index = torch.arange(m.numel(), device=m.device) // token_shape[1]
        num_seqs = token_shape[0]
    elif cu_seqlens is None:  # packed without offsets: one sequence
        seq_index, num_seqs = torch.zeros_like(valid, dtype=torch.long), 1
    else:
        lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long().to(m.device)
        num_seqs = lengths.numel()
        seq_index = torch.repeat_interleave(torch.arange(num_seqs, device=m.device), lengths)
    seq_tokens = torch.zeros(num_seqs, dtype=dtype, device=m.device).index_add(0, seq_index, m)
    live_seqs = (seq_tokens > 0).sum().to(dtype)  # sequences with at least one unmasked token
    if loss_agg == "sum":
        total, count = per_token.sum(), None
    elif loss_agg == "token-mean":
        total, count = per_token.sum(), m.sum()
    elif loss_agg == "seq-mean-token-sum":
        total, count = per_token.sum(), live_seqs
    elif loss_agg == "seq-mean-token-mean":
        seq_totals = torch.zeros(num_seqs, dtype=dtype, device=m.device).index_add(0, seq_index, per_token)
        total, count = (seq_totals / seq_tokens.clamp(min=1)).sum(), live_seqs
    else:  # seq-mean-token-sum-norm: padded input, normalised by the padded length T
        total, count = per_token.sum() / token_shape[1], live_seqs
    loss = total if count is None or count == 0 else total / count  # an empty batch: 0, zero gradient

    n = m.sum()
    detached = per_token.detach()
    metrics = {"divergence_mean": detached.sum() / n if n > 0 else m.new_zeros(()),
               "divergence_max": detached[valid].max() if n > 0 else m.new_zeros(())}
    return loss, detached.reshape(token_shape), metrics


def _weighted_log_ratio(log_weight: Tensor, log_a: Tensor, log_b: Tensor) -> Tensor:
    """exp(log_weight) * (log_a - log_b) elementwise, 0 where the weight is 0 (0 log 0 = 0), without a NaN gradient
    there (the logs read as 0 where the weight is 0). Where the weight is > 0 and log_b is -inf it is +inf: a
    divergence that is infinite."""
    weight = torch.exp(log_weight)
    has = weight > 0
    ratio = torch.where(has, log_a, 0.0) - torch.where(has, log_b, 0.0)
    return torch.where(has, weight * ratio, 0.0)


def _top_k_buckets(z: Tensor, u: Tensor, log_p: Tensor, log_q: Tensor, kind: str, top_k: int, add_tail: bool):
    """Both models' log-probabilities over TRL's top-k buckets (IW-OPD's generalized_jsd_loss), as [N, V] or (tail)
    [N, V + 1] tensors with -inf outside the support. The support of a row: the teacher's top_k tokens (forward KL),
    the student's (reverse KL), or the union of both (JSD), of the scaled logits z, u. add_tail: each model's
    full-softmax log-probabilities on the support, not renormalised, plus a last bucket log(1 - their mass) (the
    log mass bounded by TAIL_LOG_MASS_MAX); else the log-probabilities renormalised over the support."""
    picks = []
    if kind != "reverse_kl":
        picks.append(u.topk(top_k, dim=-1).indices)
    if kind != "forward_kl":
        picks.append(z.topk(top_k, dim=-1).indices)
    support = torch.zeros(z.shape, dtype=torch.bool, device=z.device).scatter_(1, torch.cat(picks, dim=1), True)
    log_p = torch.where(support, log_p, -math.inf)
    log_q = torch.where(support, log_q, -math.inf)
    if not add_tail:
        return (log_p - torch.logsumexp(log_p, dim=-1, keepdim=True),
                log_q - torch.logsumexp(log_q, dim=-1, keepdim=True))

    def with_tail(x):
        log_mass = torch.logsumexp(x, dim=-1, keepdim=True).clamp(max=TAIL_LOG_MASS_MAX)
        return torch.cat([x, torch.log(-torch.expm1(log_mass))], dim=-1)

    return with_tail(log_p), with_tail(log_q)
