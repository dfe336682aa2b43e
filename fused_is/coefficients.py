"""Per-token math of DESIGN.md section 2 on O(N) vectors, shared by every non-reference backend.

Given the learner's logprob lp_t and entropy H_t of each row (from a kernel's stats), this module
forms the importance weight W_t, the surrogate, the KL and entropy terms, and the coefficients
    g_t = d loss / d lp_t,   h_t = d loss / d H_t
that the gradient sweep turns into d loss / d logits. Everything here is float64 and O(N); the
reference (fused_is/reference.py) is written independently, with autograd, and checks this file.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Optional, Tuple

import torch

from .config import LOG_WEIGHT_CLAMP, SAPO_LOG_RATIO_BOUND, LossConfig, rejection_option_parts
from .reductions import sequence_max, sequence_sum

if TYPE_CHECKING:  # the call object's type only: call.py imports this module
    from .call import Call

Tensor = torch.Tensor


def surrogate(lp: Tensor, base: Optional[Tensor], adv: Tensor, cfg: LossConfig,
              log_ratio: Optional[Tensor] = None) -> Tuple[Tensor, Tensor, Tensor]:
    """(s_t, ds_t/dlp_t, clipped_t) of the policy surrogate (DESIGN.md section 2, "Policy surrogate").
    log_ratio: the ratio's log when it is not lp - base (GSPO's sequence mean, `sequence_log_ratio`); ds is then
    d s / d log r, and LossConfig.sequence_log_ratio_max clamps it from above first (zero gradient beyond)."""
    if cfg.reinforce_surrogate:
        return adv * lp, adv, torch.zeros_like(lp, dtype=torch.bool)
    if log_ratio is None:
        log_ratio = lp - base
    beyond = None  # no clamp: nothing is beyond it
    if cfg.ratio_level == "sequence" and cfg.sequence_log_ratio_max is not None:  # verl's gspo: max=10
        beyond = log_ratio > cfg.sequence_log_ratio_max  # torch.clamp's gradient is 0 strictly beyond
        log_ratio = log_ratio.clamp(max=cfg.sequence_log_ratio_max)
    if cfg.log_ratio_clamp is not None:  # the clamp's gradient is 0 strictly beyond it
        c = cfg.log_ratio_clamp
        outside = (log_ratio < -c) | (log_ratio > c)
        beyond = outside if beyond is None else beyond | outside
        log_ratio = log_ratio.clamp(-c, c)
    ratio = torch.exp(log_ratio)
    if cfg.policy == "sapo":  # s = sigmoid(tau (r - 1)) 4 / tau A: ds/dlp = 4 sig (1 - sig) r A
        tau = torch.where(adv > 0, torch.full_like(adv, cfg.sapo_tau_pos), torch.full_like(adv, cfg.sapo_tau_neg))
        ratio = torch.exp(log_ratio.clamp(max=SAPO_LOG_RATIO_BOUND))  # saturated beyond: no 0 * inf
        sig = torch.sigmoid(tau * (ratio - 1.0))
        ds = 4.0 * sig * (1.0 - sig) * ratio * adv
        if beyond is not None:
            ds = torch.where(beyond, 0.0, ds)
        return sig * 4.0 / tau * adv, ds, torch.zeros_like(lp, dtype=torch.bool)
    if cfg.policy in ("dppo_tv", "dppo_kl"):  # s = sg(min(r, cap) v) A lp, v the trust region on probabilities
        weight = ratio if cfg.ratio_cap is None else ratio.clamp(max=cfg.ratio_cap)
        valid = dppo_trust_region(lp, base, adv, cfg)
        kept = torch.where(valid, weight, torch.zeros_like(weight))
        return kept * adv * lp, kept * adv, ~valid
    if cfg.policy == "prime_rl":  # s = keep r A, keep: p = exp(lp) moved from exp(base) by at most the clip range
        keep = dppo_trust_region(lp, base, adv, cfg)
        kept = torch.where(keep, ratio * adv, torch.zeros_like(ratio))
        ds = kept if beyond is None else torch.where(beyond, 0.0, kept)
        return kept, ds, ~keep
    if cfg.policy == "kl_cov":  # r A, unclipped (the KL at the selected tokens: cov_adjusted)
        return ratio * adv, ratio * adv, torch.zeros_like(lp, dtype=torch.bool)
    if cfg.policy == "cispo":  # s = sg(clip(r)) A lp: the clipped ratio is a constant weight
        kept = ratio.clamp(1.0 - cfg.clip_low, 1.0 + cfg.clip_high)
        return kept * adv * lp, kept * adv, kept != ratio
    unclipped = ratio * adv
    clipped_value = ratio.clamp(1.0 - cfg.clip_low, 1.0 + cfg.clip_high) * adv
    clipped = clipped_value < unclipped  # the min picks the clipped branch: ratio is outside the range
    s = torch.where(clipped, clipped_value, unclipped)
    ds = torch.where(clipped if beyond is None else clipped | beyond, 0.0, unclipped)  # d(r A)/dlp = r A
    if cfg.dual_clip is not None:
        floor = cfg.dual_clip * adv
        dual = (adv < 0) & (floor > s)
        s = torch.where(dual, floor, s)
        ds = torch.where(dual, torch.zeros_like(ds), ds)
        clipped = clipped | dual
    return s, ds, clipped


def dppo_trust_region(lp: Tensor, base: Tensor, adv: Tensor, cfg: LossConfig) -> Tensor:
    """DPPO's v_t (bool): the token probability's move from p_old = exp(base) to p = exp(lp) stays within
    clip_high (A > 0) or clip_low (A <= 0), by total variation (dppo_tv, and prime_rl's mask) or binary KL
    (dppo_kl, as verl)."""
    prob, old_prob = torch.exp(lp), torch.exp(base)
    if cfg.policy != "dppo_kl":  # dppo_tv, and prime_rl's mask of the same form
        return torch.where(adv > 0, prob - old_prob <= cfg.clip_high, prob - old_prob >= -cfg.clip_low)
    kl = old_prob * (base - lp) + (1.0 - old_prob) * torch.log((1.0 - old_prob + 1e-8) / (1.0 - prob + 1e-8))
    return torch.where(adv > 0, (kl <= cfg.clip_high) | (prob <= old_prob), (kl <= cfg.clip_low) | (prob >= old_prob))


def cov_selection(batch: Call, lp: Tensor) -> Tensor:
    """[N] float64 1/0: the tokens Clip-Cov or KL-Cov selects (LossConfig.policy "clip_cov" / "kl_cov", verl's),
    formed once per call from the current lp (detached) and kept on the batch, so that the gradient and the loss
    see the same selection. cov_t = (A_t - mean A)(lp_t - mean lp), means over the unmasked tokens; k =
    max(1, int(n cov_ratio)) of the n unmasked tokens. kl_cov: the k largest cov_t, exactly equal ones by the lower
    token index (verl's torch.topk orders ties as it happens to). clip_cov: k drawn at random
    (torch.randperm on the CPU's default generator, in token order, as verl) from the unmasked tokens whose PPO
    surrogate is not clipped and whose cov_t is strictly inside cov_bounds. Reads the count on the host."""
    if batch.cache.cov_selected is not None:
        return batch.cache.cov_selected
    cfg = batch.config
    lp = unmasked(batch, lp)
    valid = batch.valid
    n = int(valid.sum())
    selected = torch.zeros_like(lp)
    if n:
        adv = batch.advantages
        cov = (adv - adv[valid].mean()) * (lp - lp[valid].mean())
        k = max(1, int(n * cfg.cov_ratio))
        if cfg.policy == "kl_cov":  # the k largest cov_t, ties at the k-th value to the lower token index
            cov = torch.where(valid, cov, -math.inf)
            kth = torch.topk(cov, k).values[-1]  # which of the tied ones topk picks is unspecified: only its value
            above = cov > kth
            tied = cov == kth
            chosen = above | (tied & (torch.cumsum(tied, 0) <= k - above.sum()))
        else:
            _, _, clipped = surrogate(lp, _ratio_base(batch, lp, slice(None)), adv, cfg)
            low, high = cfg.cov_bounds
            candidates = (valid & ~clipped & (cov > low) & (cov < high)).nonzero().squeeze(1)
            generator = None if cfg.cov_seed is None else torch.Generator().manual_seed(cfg.cov_seed)
            chosen = candidates[torch.randperm(len(candidates), generator=generator)[:k].to(candidates.device)]
        selected[chosen] = 1.0
    batch.cache.cov_selected = selected
    return selected


def cov_adjusted(batch: Call, lp: Tensor, base: Tensor, s: Tensor, ds: Tensor) -> Tuple[Tensor, Tensor]:
    """(s_t, ds_t/dlp_t) of Clip-Cov (the surrogate zeroed at the selected tokens) or KL-Cov (minus
    cov_kl_coef |lp_t - base_t| there; the gradient of |x| is sign(x), 0 at 0); unchanged otherwise."""
    cfg = batch.config
    if cfg.policy not in ("clip_cov", "kl_cov"):
        return s, ds
    selected = cov_selection(batch, lp)
    if cfg.policy == "clip_cov":
        return s * (1.0 - selected), ds * (1.0 - selected)
    delta = lp - base
    return s - selected * cfg.cov_kl_coef * delta.abs(), ds - selected * cfg.cov_kl_coef * torch.sign(delta)


def kl_term(lp: Tensor, ref: Tensor, base: Tensor, cfg: LossConfig) -> Tuple[Tensor, Tensor]:
    """(KL_t, dKL_t/dlp_t) of the KL term: the k1/k2/k3 estimator of KL(learner || ref), clamped to
    +-kl_clamp (zero gradient beyond), with k2's gradient for "k1+"/"k3+", and times r = exp(lp - base)
    with its gradient when kl_ratio_weighted (base: detached)."""
    d = lp - ref
    if cfg.kl_type in ("k1", "k1+"):
        value, grad = d, torch.ones_like(d)
    elif cfg.kl_type == "k2":
        value, grad = 0.5 * d * d, d
    else:
        e = torch.exp(-d)  # k3 = exp(ref - lp) - (ref - lp) - 1
        value, grad = e + d - 1.0, 1.0 - e
    if cfg.kl_clamp is not None:
        c = cfg.kl_clamp
        grad = torch.where((value < -c) | (value > c), torch.zeros_like(grad), grad)
        value = value.clamp(-c, c)
    if cfg.kl_type.endswith("+"):
        grad = d
    if cfg.kl_ratio_weighted:  # d/dlp (v r) = (v' + v) r
        r = torch.exp(lp - base)
        value, grad = value * r, (grad + value) * r
    return value, grad


def unmasked(batch: Call, x: Tensor, rows: slice = slice(None)) -> Tensor:
    """x (float64) with masked rows set to 0: a kernel's lp or H there may be anything (NaN or inf from the
    logits of a padded row), and 0 * nan is nan."""
    return torch.where(batch.valid if rows == slice(None) else batch.valid[rows], x.double(), 0.0)


def log_is_weight(batch: Call, lp: Optional[Tensor]) -> Tensor:
    """log w_t, clamped to +-20, for all N tokens. lp (detached) stands in for old_logprobs when None."""
    cfg = batch.config
    old = batch.old_logprobs if batch.old_logprobs is not None else unmasked(batch, lp)
    delta = (old - batch.sampler_logprobs) * batch.mask
    if cfg.is_level == "token":
        log_w = delta
    else:
        seq_sum = batch.seq_sum(delta)
        if cfg.is_level == "geometric":
            seq_sum = seq_sum / batch.seq_token_count.clamp(min=1.0)
        log_w = seq_sum[batch.seq_index]
    return log_w.clamp(-LOG_WEIGHT_CLAMP, LOG_WEIGHT_CLAMP)


def is_weight(log_w: Tensor, cfg: LossConfig) -> Tuple[Tensor, Tensor, Tensor]:
    """(W_t, masked_t, truncated_t) from log w_t for is_mode truncate / mask / reject / raw."""
    w = torch.exp(log_w)
    floor = cfg.is_floor_value
    inside = (w >= floor) & (w <= cfg.is_cap)
    none = torch.zeros_like(w, dtype=torch.bool)
    if cfg.is_mode == "truncate":
        weight = w.clamp(max=cfg.is_cap)
        if cfg.is_floor is not None:
            weight = weight.clamp(min=cfg.is_floor)
        return weight, none, ~inside
    if cfg.is_mode == "mask":
        return torch.where(inside, w, torch.zeros_like(w)), ~inside, none
    if cfg.is_mode == "reject":
        return inside.to(w.dtype), ~inside, none
    return w, none, none  # raw


def full_is_weight(batch: Call, lp: Optional[Tensor]) -> Tuple[Tensor, Tensor, Tensor]:
    """(W, masked, truncated) for all N tokens; lp is needed only when old_logprobs is None. With the caller's
    is_weights, W is theirs and masked marks its zeros (truncation is theirs to know). When they do not depend
    on lp (old_logprobs or is_weights given, or no IS), they are formed once per call and kept on the batch:
    the kernel's row table and the metrics read the same vectors."""
    if batch.cache.is_weight_parts is not None:
        return batch.cache.is_weight_parts
    if batch.is_weights is not None:
        weight = batch.is_weights
        parts = weight, (weight == 0) & batch.valid, torch.zeros_like(weight, dtype=torch.bool)
    elif batch.config.is_level == "none":
        ones = torch.ones(batch.num_rows, dtype=torch.float64, device=batch.mask.device)
        none = torch.zeros_like(ones, dtype=torch.bool)
        parts = ones, none, none
    else:
        parts = is_weight(log_is_weight(batch, lp), batch.config)
        if batch.old_logprobs is None:  # formed from this lp: not kept
            return parts
    batch.cache.is_weight_parts = parts
    return parts


def rejection_keep(samp: Tensor, old: Tensor, mask: Tensor, seq_index: Tensor, num_seqs: int,
                   criteria: tuple, group=None) -> Tensor:
    """[N] float64 1/0: the tokens every rejection criterion keeps (LossConfig.rejection, verl's rollout_rs).
    samp, old, mask: float64 [N] (mask 0/1); a sequence statistic is over the sequence's unmasked tokens (on
    every rank of `group`, context parallel)."""
    d = ((old - samp) * mask).clamp(-LOG_WEIGHT_CLAMP, LOG_WEIGHT_CLAMP)
    stats = {"k1": -d, "k2": 0.5 * d * d, "k3": torch.expm1(d) - d}
    if any(name.endswith(("binary_kl", "tv")) for name, _, _ in criteria):  # OpenRLHF: the sampled token's p, q
        p = torch.exp(samp).clamp(1e-6, 1.0 - 1e-6)
        q = torch.exp(old).clamp(1e-6, 1.0 - 1e-6)
        stats["binary_kl"] = p * torch.log(p / q) + (1.0 - p) * torch.log((1.0 - p) / (1.0 - q))
        stats["tv"] = (p - q).abs()
    count = sequence_sum(mask, seq_index, num_seqs, group)
    keep = torch.ones_like(d, dtype=torch.bool)
    for name, low, high in criteria:
        level, stat = rejection_option_parts(name)
        x = stats[stat] * mask
        if level == "seq_sum" or level == "seq_mean":
            seq = sequence_sum(x, seq_index, num_seqs, group)
            if level == "seq_mean":
                seq = seq / count.clamp(min=1.0)
            x = seq[seq_index]
        elif level == "seq_max":  # the statistics are >= 0, so masked tokens (0) never raise the max
            x = sequence_max(x, seq_index, num_seqs, group)[seq_index]
        if low is None:
            keep &= x <= high
        else:
            keep &= (x >= math.log(low)) & (x <= math.log(high))
    return keep.double()


def off_policy_keep(batch: Call, lp: Tensor) -> Tensor:
    """[N] float64 1/0 of TRL's off-policy sequence mask (LossConfig.off_policy_mask = delta): 0 where A_t < 0
    and the sequence's mean of samp - lp (lp current and detached, unmasked tokens) exceeds delta."""
    lp = unmasked(batch, lp)
    samp = batch.sampler_logprobs if batch.sampler_logprobs is not None else batch.old_logprobs
    samp = lp if samp is None else samp  # neither given: no divergence, every sequence kept (as TRL)
    diff = (samp - lp) * batch.mask
    mean = (batch.seq_sum(diff) / batch.seq_token_count.clamp(min=1.0))[batch.seq_index]
    return ((batch.advantages >= 0) | (mean <= batch.config.off_policy_mask)).double()


VESPO_LOG_FLOOR = math.log(1e-8)  # TRL's floor of VESPO's log weights


def vespo_weight(batch: Call, lp: Tensor, is_weight: Optional[Tensor] = None) -> Tensor:
    """[N] float64: VESPO's gamma weight phi_i of each token's sequence (LossConfig.policy="vespo", TRL's
    get_gamma_weights) from the current lp (detached), old_logprobs (lp when None) and the IS weight
    (`full_is_weight`'s W, formed here unless the caller has it)."""
    cfg = batch.config
    lp = unmasked(batch, lp)
    old = batch.old_logprobs if batch.old_logprobs is not None else lp
    log_ratio = ((lp - old).clamp(-LOG_WEIGHT_CLAMP, LOG_WEIGHT_CLAMP)) * batch.mask
    if batch.is_weights is not None or cfg.is_level != "none":  # the IS weight enters phi in log space
        is_w = full_is_weight(batch, lp)[0] if is_weight is None else is_weight
        log_is = torch.log(is_w).clamp(VESPO_LOG_FLOOR, LOG_WEIGHT_CLAMP)
        log_ratio = log_ratio + torch.where(batch.valid, log_is, 0.0)
    log_w = batch.seq_sum(log_ratio).clamp(VESPO_LOG_FLOOR, LOG_WEIGHT_CLAMP)[batch.seq_index]
    nonneg = batch.advantages >= 0
    k = torch.where(nonneg, torch.full_like(lp, cfg.vespo_k_pos), torch.full_like(lp, cfg.vespo_k_neg))
    lam = torch.where(nonneg, torch.full_like(lp, cfg.vespo_lambda_pos),
                      torch.full_like(lp, cfg.vespo_lambda_neg)).clamp(min=1e-4)
    phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w))
    return torch.nan_to_num(phi, nan=0.0, posinf=0.0, neginf=0.0) * batch.mask


def policy_weight(batch: Call, lp: Optional[Tensor], is_weight: Optional[Tensor] = None,
                  keep: Optional[Tensor] = None) -> Tensor:
    """What multiplies the policy term s_t: the IS weight W_t (VESPO: its gamma weight, into which W_t went),
    times the rejection gate (rejection_counts="keep") and TRL's off-policy mask when configured. is_weight,
    keep: `full_is_weight`'s W and `off_policy_keep`'s mask when the caller has formed them already (each is
    formed here otherwise)."""
    if is_weight is None:
        is_weight = full_is_weight(batch, lp)[0]
    weight = vespo_weight(batch, lp, is_weight) if batch.config.policy == "vespo" else is_weight
    if batch.rejection_gate is not None:  # rejection_counts="keep": rejected tokens' policy terms times 0
        weight = weight * batch.rejection_gate
    if batch.config.off_policy_mask is not None:
        weight = weight * (off_policy_keep(batch, lp) if keep is None else keep)
    return weight


def _ratio_base(batch: Call, lp: Tensor, rows: slice) -> Optional[Tensor]:
    """The ratio's base (detached): the sampler's or old logprobs, or lp itself when old_logprobs is None;
    None for REINFORCE unless the KL term is ratio-weighted (then old, as TRL's)."""
    cfg = batch.config
    if cfg.reinforce_surrogate and not cfg.kl_ratio_weighted:
        return None
    if cfg.ratio_ref == "sampler" and not cfg.reinforce_surrogate:
        return batch.sampler_logprobs[rows]
    return batch.old_logprobs[rows] if batch.old_logprobs is not None else lp.detach()


def sequence_log_ratio(batch: Call, lp: Tensor, base: Tensor) -> Tensor:
    """GSPO's log s_i = mean over the sequence's unmasked tokens of lp - base, for each of its N tokens (unclamped:
    `surrogate` applies LossConfig.sequence_log_ratio_max to it, with the gradient's cut beyond)."""
    delta = torch.where(batch.valid, lp - base, 0.0)
    return (batch.seq_sum(delta) / batch.seq_token_count.clamp(min=1.0))[batch.seq_index]


def gmpo_terms(batch: Call, lp: Tensor, base: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
    """(s_t, clipped_t, through_t) of GMPO: s_t = R_i A_t with log R_i the mean over sequence i's unmasked
    tokens of log r clipped at +clip_high (A > 0) or -clip_low (A < 0); through_t: lp_t reaches log R_i
    (not clipped, not beyond log_ratio_clamp, A != 0)."""
    cfg = batch.config
    log_ratio = lp - base
    through = torch.ones_like(lp, dtype=torch.bool)
    if cfg.log_ratio_clamp is not None:
        c = cfg.log_ratio_clamp
        through = (log_ratio >= -c) & (log_ratio <= c)
        log_ratio = log_ratio.clamp(-c, c)
    adv = batch.advantages
    kept = torch.where(adv > 0, log_ratio.clamp(max=cfg.clip_high),
                       torch.where(adv < 0, log_ratio.clamp(min=-cfg.clip_low), torch.zeros_like(log_ratio)))
    clipped = (kept != log_ratio) & (adv != 0)
    through = through & ~clipped & (adv != 0)
    seq = batch.seq_sum(torch.where(batch.valid, kept, 0.0))
    log_r = (seq / batch.seq_token_count.clamp(min=1.0))[batch.seq_index]
    return torch.exp(log_r) * adv, clipped, through


def given_coefficients(batch: Call, lp: Tensor) -> Tuple[Tensor, Tensor]:
    """(g_t, h_t) for all N tokens when they are handed to the kernels (LossConfig.coefficients_given), from
    lp of a stats pass: DPPO's token-local ones, or those depending on the lp of other tokens (GSPO, GMPO).
    d log s_i / d lp_t = m_t / n_i (through_t for GMPO), so

    GSPO: L_t' = -W_t' min(s_i A_t', clip(s_i) A_t'): g_t = (m_t / n_i) sum_t' a_t' (-W_t' ds_t'), ds = d s / d log s;
    GMPO: L_t' = -W_t' R_i A_t': g_t = (m_t / n_i) through_t sum_t' a_t' (-W_t' R_i A_t');
    plus t's own KL term in both."""
    cfg = batch.config
    lp = unmasked(batch, lp)
    if not cfg.sequence_ratio:  # token-local (DPPO): the one-pass formulas, on every row at once
        return coefficients(batch, lp, slice(None), policy_weight(batch, lp))
    base = _ratio_base(batch, lp, slice(None))
    weight = policy_weight(batch, lp)
    if cfg.policy == "gmpo":
        ds, _, through = gmpo_terms(batch, lp, base)
    else:
        _, ds, _ = surrogate(lp, base, batch.advantages, cfg, log_ratio=sequence_log_ratio(batch, lp, base))
        through = batch.valid
    per_seq = batch.seq_sum(batch.agg_weight * (-weight * ds))
    g = (per_seq / batch.seq_token_count.clamp(min=1.0))[batch.seq_index] * batch.mask * through
    if cfg.kl_coef != 0.0:
        g = g + batch.agg_weight * cfg.kl_coef * kl_term(lp, batch.ref_logprobs, base, cfg)[1]
    return g, batch.entropy_weights * (-cfg.entropy_coef)


def chunk_is_weight(batch: Call, lp: Tensor, rows: slice, full_weight: Optional[Tensor]) -> Tensor:
    """W_t for rows: sliced from a precomputed full vector, or token-local from this chunk's lp."""
    if full_weight is not None:
        return full_weight[rows]
    cfg = batch.config
    if cfg.is_level == "none":
        return torch.ones_like(lp)
    old = batch.old_logprobs[rows] if batch.old_logprobs is not None else unmasked(batch, lp, rows)
    log_w = ((old - batch.sampler_logprobs[rows]) * batch.mask[rows]).clamp(-LOG_WEIGHT_CLAMP, LOG_WEIGHT_CLAMP)
    return is_weight(log_w, cfg)[0]


def precomputed_is_weight(batch: Call, lp: Optional[Tensor] = None) -> Optional[Tensor]:
    """The full W vector when it can (or must) be known before the gradient sweep, else None.

    Token level with old_logprobs=None is token-local and is formed per chunk instead; sequence and
    geometric levels with old_logprobs=None need `lp` from a stats pass first.
    """
    cfg = batch.config
    if cfg.off_policy_mask is not None or cfg.policy == "vespo":  # a sequence's current lp decides it: the
        if lp is None:  # plan ran the stats pass
            raise RuntimeError("the off-policy mask and VESPO's weight need the stats pass first")
        return policy_weight(batch, lp)
    if batch.rejection_gate is not None:  # W times the gate (rejection needs old_logprobs: W is known)
        return policy_weight(batch, lp)
    if batch.is_weights is not None:
        return batch.is_weights
    if cfg.is_level == "none":
        return None
    if batch.old_logprobs is None and cfg.is_level == "token":
        return None
    if batch.old_logprobs is None and lp is None:
        raise RuntimeError("sequence-level IS weights with old_logprobs=None need the stats pass first")
    return full_is_weight(batch, lp)[0]


def coefficients(batch: Call, lp: Tensor, rows: slice, weight: Tensor) -> Tuple[Tensor, Tensor]:
    """(g_t, h_t) = (d loss/d lp_t, d loss/d H_t) for rows, float64; lp is this chunk's detached logprob."""
    cfg = batch.config
    lp = unmasked(batch, lp, rows)
    agg = batch.agg_weight[rows]
    base = _ratio_base(batch, lp, rows)
    s, ds, _ = surrogate(lp, base, batch.advantages[rows], cfg)
    if cfg.policy in ("clip_cov", "kl_cov"):  # a selection over every token: given, on all rows at once
        assert rows == slice(None)
        _, ds = cov_adjusted(batch, lp, base, s, ds)
    g = -weight * ds
    if cfg.ratio_penalty_coef != 0.0:  # prime_rl: + c (lp - base)^2 on every token
        g = g + 2.0 * cfg.ratio_penalty_coef * (lp - base)
    if cfg.kl_coef != 0.0:
        g = g + cfg.kl_coef * kl_term(lp, batch.ref_logprobs[rows], base, cfg)[1]
    return agg * g, batch.entropy_weights[rows] * (-cfg.entropy_coef)


def metric_names(batch: Call) -> Tuple[str, ...]:
    """Names of the metrics `loss_and_metrics` returns for this batch, in order."""
    return metric_names_for(batch.config, batch.sampler_logprobs is not None, batch.is_weights is not None)


def metric_names_for(cfg: LossConfig, has_sampler: bool, given_weights: bool = False) -> Tuple[str, ...]:
    """Metric names for a config, with or without sampler logprobs and the caller's is_weights (no tensor
    needed: torch.compile uses it)."""
    names = ("entropy_mean",)
    if not cfg.reinforce_surrogate:
        names += ("clip_frac", "ppo_kl")
    if has_sampler:
        names += ("mismatch_k1", "mismatch_k3")
    if has_sampler or given_weights:
        names += ("is_weight_mean", "is_weight_max", "is_weight_min", "is_masked_frac")
    if has_sampler and not given_weights:
        names += ("is_truncated_frac",)
    if cfg.rejection:
        names += ("rejected_frac",)
    if cfg.off_policy_mask is not None:
        names += ("off_policy_masked_frac",)
    if cfg.policy in ("clip_cov", "kl_cov"):
        names += ("cov_selected_frac",)
    return names


def loss_and_metrics(batch: Call, lp: Tensor, entropy: Tensor) -> Tuple[Tensor, Tensor]:
    """The scalar loss (float64) and the metric values of DESIGN.md section 3 (float64 [M], in the order of
    `metric_names(batch)`) from all N logprobs and entropies. With a sequence_group, the totals over its ranks,
    reduced together in two collectives: the same on each rank. No host read.

    Every mean metric is a masked mean: its per-token values go into one [k, N] block whose product with the
    mask gives all k sums in one op (a handful of ops for the epilogue's reductions, whatever k)."""
    cfg = batch.config
    lp = unmasked(batch, lp)
    entropy = unmasked(batch, entropy)
    rows = slice(None)
    mask = batch.mask
    valid = batch.valid
    weight, masked, truncated = full_is_weight(batch, lp)
    keep = off_policy_keep(batch, lp) if cfg.off_policy_mask is not None else None
    applied = policy_weight(batch, lp, weight, keep)  # what multiplies s_t (W, VESPO's phi, the off-policy mask)
    base = _ratio_base(batch, lp, rows)
    if cfg.policy == "gmpo":
        s, clipped, _ = gmpo_terms(batch, lp, base)
    else:
        log_ratio = sequence_log_ratio(batch, lp, base) if cfg.ratio_level == "sequence" else None
        s, ds, clipped = surrogate(lp, base, batch.advantages, cfg, log_ratio=log_ratio)
        s, _ = cov_adjusted(batch, lp, base, s, ds)
    per_token = -applied * s
    if cfg.ratio_penalty_coef != 0.0:
        per_token = per_token + cfg.ratio_penalty_coef * (lp - base) ** 2
    if cfg.kl_coef != 0.0:
        per_token = per_token + cfg.kl_coef * kl_term(lp, batch.ref_logprobs, base, cfg)[0]

    # this rank's part of every batch total, then one reduction of them all: [count, loss, the means' sums...]
    # (masked positions: a_t = e_t = 0 and mask 0; the mean's values are finite there (inputs zero-filled, lp and H
    # unmasked), so they add 0; the loss's per-token value is selected, as W s may not be)
    loss = torch.dot(batch.agg_weight, torch.where(valid, per_token, 0.0))
    if cfg.entropy_coef != 0.0:
        loss = loss - cfg.entropy_coef * torch.dot(batch.entropy_weights, entropy)
    means = {"entropy_mean": entropy}  # metric name -> per-token values whose masked mean it is, in order
    if not cfg.reinforce_surrogate:
        means.update(clip_frac=clipped, ppo_kl=base - lp)
    samp = batch.sampler_logprobs
    given = batch.is_weights is not None
    if samp is not None:
        old = batch.old_logprobs if batch.old_logprobs is not None else lp
        diff = old - samp
        means.update(mismatch_k1=-diff, mismatch_k3=torch.exp(diff) - diff - 1.0)
    if samp is not None or given:
        means.update(is_weight_mean=weight, is_masked_frac=masked)
    if samp is not None and not given:
        means["is_truncated_frac"] = truncated
    if keep is not None:
        means["off_policy_masked_frac"] = 1.0 - keep
    if cfg.policy in ("clip_cov", "kl_cov"):
        means["cov_selected_frac"] = cov_selection(batch, lp)
    totals = [mask.sum().reshape(1), loss.reshape(1), torch.mv(torch.stack(list(means.values())), mask)]
    if cfg.rejection:  # over the caller's unmasked tokens, rejected ones included
        totals.append(batch.rejected.sum().reshape(1))
    totals = batch.total(torch.cat(totals))
    count, loss = totals[0], totals[1]
    metrics = dict(zip(means, (totals[2:2 + len(means)] / count.clamp(min=1.0)).unbind(0)))
    if samp is not None or given:  # max and min over the unmasked tokens (0 when there are none)
        extremes = torch.where(valid, torch.stack([weight, -weight]), -math.inf)  # max of -W: minus the min
        extremes = batch.total(extremes.amax(1) if len(weight) else extremes.new_full((2,), -math.inf), "max")
        top, negated_bottom = torch.where(count > 0, extremes, 0.0).unbind(0)
        metrics.update(is_weight_max=top, is_weight_min=0.0 - negated_bottom)  # 0 - 0 is +0 when no token counts
    if cfg.rejection:
        rejected = totals[-1]
        counted = count + rejected if cfg.rejection_counts == "drop" else count  # "keep": still in the mask
        metrics["rejected_frac"] = rejected / counted.clamp(min=1.0)
    return loss, torch.stack([metrics[name] for name in metric_names(batch)])  # in the documented order
