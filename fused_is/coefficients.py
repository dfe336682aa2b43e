"""Per-token math of DESIGN.md section 2 on O(N) vectors, shared by every non-reference backend.

Given the learner's logprob lp_t and entropy H_t of each row (from a kernel's stats), this module
forms the importance weight W_t, the surrogate, the KL and entropy terms, and the coefficients
    g_t = d loss / d lp_t,   h_t = d loss / d H_t
that the gradient sweep turns into d loss / d logits. Everything here is float64 and O(N); the
reference (fused_is/reference.py) is written independently, with autograd, and checks this file.
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch

from .config import LOG_WEIGHT_CLAMP, LossConfig, rejection_option_parts
from .constants import LN_FLT_MAX
from .policies import Ratio, policy
from .reductions import sequence_max, sequence_sum

Tensor = torch.Tensor


def clamped_log_ratio(log_ratio: Tensor, cfg: LossConfig) -> Tuple[Tensor, Optional[Tensor]]:
    """(log r clamped, beyond): LossConfig.sequence_log_ratio_max from above (GSPO's sequence ratio), then
    log_ratio_clamp on both sides; beyond marks where a clamp binds strictly (torch.clamp's gradient is 0 there),
    None when no clamp is configured."""
    beyond = None  # no clamp: nothing is beyond it
    if cfg.ratio_level == "sequence" and cfg.sequence_log_ratio_max is not None:  # verl's gspo: max=10
        beyond = log_ratio > cfg.sequence_log_ratio_max  # torch.clamp's gradient is 0 strictly beyond
        log_ratio = log_ratio.clamp(max=cfg.sequence_log_ratio_max)
    if cfg.log_ratio_clamp is not None:  # the clamp's gradient is 0 strictly beyond it
        c = cfg.log_ratio_clamp
        outside = (log_ratio < -c) | (log_ratio > c)
        beyond = outside if beyond is None else beyond | outside
        log_ratio = log_ratio.clamp(-c, c)
    return log_ratio, beyond


def surrogate(lp: Tensor, base: Optional[Tensor], adv: Tensor, cfg: LossConfig,
              log_ratio: Optional[Tensor] = None) -> Tuple[Tensor, Tensor, Tensor]:
    """(s_t, ds_t/dlp_t, clipped_t) of the policy surrogate: its row of the policy table (fused_is/policies.py)
    on the ratio after LossConfig's clamps. log_ratio: the ratio's log when it is not lp - base (GSPO's sequence
    mean, `sequence_log_ratio`); ds is then d s / d log r. A row that writes only the value gets ds by autograd."""
    row = policy(cfg.policy)
    if not row.ratio:
        return _by_autograd(row, lp, None, adv, cfg, lp) if row.value_only else row.surrogate(lp, None, adv, cfg)
    if log_ratio is None:
        log_ratio = lp - base
    if row.value_only:
        return _by_autograd(row, lp, base, adv, cfg, log_ratio)
    log_ratio, beyond = clamped_log_ratio(log_ratio, cfg)
    return row.surrogate(lp, Ratio(base, log_ratio, torch.exp(log_ratio), beyond), adv, cfg)


def _by_autograd(row, lp: Tensor, base: Optional[Tensor], adv: Tensor, cfg: LossConfig,
                 variable: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
    """(s, ds, clipped) of a row that writes only (s, clipped): ds = d s / d variable (the log ratio, or lp for a
    logprob surrogate) by autograd on the float64 vectors; lp follows the variable (lp = lp + (x - x) in value, so
    that s is the row's value exactly). The clamps are applied in the graph, so their cut gradient is autograd's."""
    with torch.enable_grad():
        x = variable.detach().requires_grad_()
        follows = lp.detach() + (x - x.detach())
        if base is None:
            s, clipped = row.surrogate(follows, None, adv, cfg)
        else:
            log_ratio, beyond = clamped_log_ratio(x, cfg)
            s, clipped = row.surrogate(follows, Ratio(base, log_ratio, torch.exp(log_ratio), beyond), adv, cfg)
        (ds,) = torch.autograd.grad(s.sum(), x, allow_unused=True)
    return s.detach(), torch.zeros_like(lp) if ds is None else ds, clipped


def cov_adjusted(call, lp: Tensor, base: Tensor, s: Tensor, ds: Tensor) -> Tuple[Tensor, Tensor]:
    """(s_t, ds_t/dlp_t) after the row's call-level selection (Clip-Cov, KL-Cov: fused_is/policies.py `select`,
    `adjust`; lp unmasked, on every row); unchanged for a row without one."""
    row = policy(call.config.policy)
    if row.adjust is None:
        return s, ds
    return row.adjust(call, lp, base, s, ds, row.select(call, lp, base))


def kl_term(lp: Tensor, ref: Tensor, base: Tensor, cfg: LossConfig, samp: Optional[Tensor] = None
            ) -> Tuple[Tensor, Tensor]:
    """(KL_t, dKL_t/dlp_t) of the KL term: the k1/k2/k3 estimator of KL(learner || ref) at d = lp - ref, d clamped to
    +-kl_input_clamp first (zero gradient where it binds), the value clamped to +-kl_clamp (zero gradient beyond),
    with k2's gradient for "k1+"/"k3+", then by cfg.kl_weight: "ratio", times r = exp(lp - base) with its gradient
    (base: detached); "score", the value added to the gradient (times exp(lp - sg(lp)), before the clamp);
    "sampler", value and gradient times w = exp(lp - samp), w's gradient too (before the clamp; w = 0 where it
    overflows fp32)."""
    d = lp - ref
    inside = None
    if cfg.kl_input_clamp is not None:
        inside = d.abs() <= cfg.kl_input_clamp
        d = d.clamp(-cfg.kl_input_clamp, cfg.kl_input_clamp)
    if cfg.kl_type in ("k1", "k1+"):
        value, grad = d, torch.ones_like(d)
    elif cfg.kl_type == "k2":
        value, grad = 0.5 * d * d, d
    else:
        e = torch.exp(-d)  # k3 = exp(ref - lp) - (ref - lp) - 1
        value, grad = e + d - 1.0, 1.0 - e
    # the score and sampler weights' own gradient, w' = w: the value (none where the input clamp binds)
    weight_grad = value if inside is None else torch.where(inside, value, 0.0)
    if inside is not None:
        grad = torch.where(inside, grad, 0.0)
    if cfg.kl_weight == "score":  # times exp(lp - sg(lp)) before the clamp: d/dlp gains the value
        grad = grad + weight_grad
    if cfg.kl_weight == "sampler":  # times w = exp(lp - samp): d/dlp (v w) = (v' + v) w
        x = lp - samp
        lost = x > LN_FLT_MAX
        w = torch.where(lost, 0.0, torch.exp(torch.where(lost, 0.0, x)))
        value, grad = value * w, (grad + weight_grad) * w
    if cfg.kl_clamp is not None:
        c = cfg.kl_clamp
        grad = torch.where((value < -c) | (value > c), torch.zeros_like(grad), grad)
        value = value.clamp(-c, c)
    if cfg.kl_type.endswith("+"):
        grad = d
    if cfg.kl_weight == "ratio":  # d/dlp (v r) = (v' + v) r
        r = torch.exp(lp - base)
        value, grad = value * r, (grad + value) * r
    return value, grad


def unmasked(call, x: Tensor, rows: slice = slice(None)) -> Tensor:
    """x (float64) with masked rows set to 0: a kernel's lp or H there may be anything (NaN or inf from the
    logits of a padded row), and 0 * nan is nan."""
    return torch.where(call.valid if rows == slice(None) else call.valid[rows], x.double(), 0.0)


def proximal(call, lp: Tensor, rows: slice = slice(None)) -> Tensor:
    """The old logprob where old_logprobs is None, from lp (detached, as the caller prepared it): lp itself, or with
    ratio_ref="loglinear" AReaL's proximal approximation samp + alpha (lp - samp), alpha per token (0: the
    sampler's logprob, at prompt tokens too)."""
    if call.proximal_alpha is None:
        return lp
    samp = call.sampler_logprobs[rows]
    return samp + call.proximal_alpha[rows] * (lp - samp)


def log_is_weight(call, lp: Optional[Tensor]) -> Tensor:
    """log w_t, clamped to +-20, for all N tokens. lp (detached) stands in for old_logprobs when None."""
    cfg = call.config
    old = call.old_logprobs if call.old_logprobs is not None else proximal(call, unmasked(call, lp))
    delta = (old - call.sampler_logprobs) * call.mask
    if cfg.is_level == "token":
        log_w = delta
    else:
        seq_sum = call.seq_sum(delta)
        if cfg.is_level == "geometric":
            seq_sum = seq_sum / call.seq_token_count.clamp(min=1.0)
        log_w = seq_sum[call.seq_index]
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


def full_is_weight(call, lp: Optional[Tensor]) -> Tuple[Tensor, Tensor, Tensor]:
    """(W, masked, truncated) for all N tokens; lp is needed only when old_logprobs is None. With the caller's
    is_weights, W is theirs and masked marks its zeros (truncation is theirs to know). When they do not depend
    on lp (old_logprobs or is_weights given, or no IS), they are formed once per call and kept on the call:
    the kernel's row table and the metrics read the same vectors."""
    if call.cache.is_weight_parts is not None:
        return call.cache.is_weight_parts
    if call.is_weights is not None:
        weight = call.is_weights
        parts = weight, (weight == 0) & call.valid, torch.zeros_like(weight, dtype=torch.bool)
    elif call.config.is_level == "none":
        ones = torch.ones(call.num_rows, dtype=torch.float64, device=call.mask.device)
        none = torch.zeros_like(ones, dtype=torch.bool)
        parts = ones, none, none
    else:
        parts = is_weight(log_is_weight(call, lp), call.config)
        if call.old_logprobs is None:  # formed from this lp: not kept
            return parts
    call.cache.is_weight_parts = parts
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


def m2po_keep(samp: Tensor, old: Tensor, mask: Tensor, threshold: float) -> Tensor:
    """[N] float64 1/0: the tokens M2PO keeps (LossConfig.m2_threshold, AReaL's m2_threshold). samp, old, mask:
    float64 [N] (mask 0/1). Over the unmasked tokens, by delta^2 = (samp - old)^2 from the largest (equal values in
    token order, the earlier first: a stable sort), the first k leave, k the first count whose rest has a mean
    delta^2 below threshold; k = n - 1 when none has (one token always stays). No host read."""
    valid = mask > 0
    m2 = (samp - old).square()
    n = valid.sum()
    # the unmasked tokens first, largest delta^2 first; masked ones after them (their key -inf), in token order
    order = torch.sort(torch.where(valid, m2, -math.inf), descending=True, stable=True).indices
    ranked = torch.where(valid[order], m2[order], 0.0)
    position = torch.arange(len(m2), device=m2.device)
    rest = ranked.flip(0).cumsum(0).flip(0) / (n - position).clamp(min=1)  # mean delta^2 of ranks i.. n-1
    below = (rest < threshold) & (position < n)
    leave = torch.where(below.any(), torch.argmax(below.to(torch.int8)), (n - 1).clamp(min=0))
    keep = torch.zeros_like(m2)
    keep[order] = ((position >= leave) & (position < n)).double()
    return keep


def off_policy_keep(call, lp: Tensor) -> Tensor:
    """[N] float64 1/0 of TRL's off-policy sequence mask (LossConfig.off_policy_mask = delta): 0 where A_t < 0
    and the sequence's mean of samp - lp (lp current and detached, unmasked tokens) exceeds delta."""
    lp = unmasked(call, lp)
    samp = call.sampler_logprobs if call.sampler_logprobs is not None else call.old_logprobs
    samp = lp if samp is None else samp  # neither given: no divergence, every sequence kept (as TRL)
    diff = (samp - lp) * call.mask
    mean = (call.seq_sum(diff) / call.seq_token_count.clamp(min=1.0))[call.seq_index]
    return ((call.advantages >= 0) | (mean <= call.config.off_policy_mask)).double()


def policy_weight(call, lp: Optional[Tensor], is_weight: Optional[Tensor] = None,
                  keep: Optional[Tensor] = None) -> Tensor:
    """What multiplies the policy term s_t: the IS weight W_t (VESPO: its gamma weight, into which W_t went),
    times the rejection gate (rejection_counts="keep") and TRL's off-policy mask when configured. is_weight,
    keep: `full_is_weight`'s W and `off_policy_keep`'s mask when the caller has formed them already (each is
    formed here otherwise)."""
    if is_weight is None:
        is_weight = full_is_weight(call, lp)[0]
    row = policy(call.config.policy)
    weight = is_weight if row.weight is None else row.weight(call, unmasked(call, lp), is_weight)
    if call.rejection_gate is not None:  # rejection_counts="keep": rejected tokens' policy terms times 0
        weight = weight * call.rejection_gate
    if call.config.off_policy_mask is not None:
        weight = weight * (off_policy_keep(call, lp) if keep is None else keep)
    return weight


def _ratio_base(call, lp: Tensor, rows: slice) -> Optional[Tensor]:
    """The ratio's base (detached): the sampler's or old logprobs, or lp itself when old_logprobs is None;
    None for REINFORCE unless the KL term is ratio-weighted (then old, as TRL's)."""
    cfg = call.config
    if cfg.reinforce_surrogate and cfg.kl_weight != "ratio":
        return None
    if cfg.ratio_ref == "sampler" and not cfg.reinforce_surrogate:
        return call.sampler_logprobs[rows]
    return call.old_logprobs[rows] if call.old_logprobs is not None else proximal(call, lp.detach(), rows)


def sequence_log_ratio(call, lp: Tensor, base: Tensor) -> Tensor:
    """GSPO's log s_i = mean over the sequence's unmasked tokens of lp - base, for each of its N tokens (unclamped:
    `surrogate` applies LossConfig.sequence_log_ratio_max to it, with the gradient's cut beyond)."""
    delta = torch.where(call.valid, lp - base, 0.0)
    return (call.seq_sum(delta) / call.seq_token_count.clamp(min=1.0))[call.seq_index]


def given_coefficients(call, lp: Tensor) -> Tuple[Tensor, Tensor]:
    """(g_t, h_t) for all N tokens when they are handed to the kernels (LossConfig.coefficients_given), from
    lp of a stats pass: DPPO's token-local ones, or those depending on the lp of other tokens (GSPO, GMPO).
    d log s_i / d lp_t = m_t / n_i (through_t for GMPO), so

    GSPO: L_t' = -W_t' min(s_i A_t', clip(s_i) A_t'): g_t = (m_t / n_i) sum_t' a_t' (-W_t' ds_t'), ds = d s / d log s;
    GMPO: L_t' = -W_t' R_i A_t': g_t = (m_t / n_i) through_t sum_t' a_t' (-W_t' R_i A_t');
    plus t's own KL term in both."""
    cfg = call.config
    lp = unmasked(call, lp)
    if not cfg.sequence_ratio:  # token-local (DPPO): the one-pass formulas, on every row at once
        return coefficients(call, lp, slice(None), policy_weight(call, lp))
    base = _ratio_base(call, lp, slice(None))
    weight = policy_weight(call, lp)
    row = policy(cfg.policy)
    if row.sequence is not None:  # a surrogate over the whole sequence (GMPO): R_i A_t, d s / d log R_i = s
        ds, _, through = row.sequence(call, lp, base)
    else:
        _, ds, _ = surrogate(lp, base, call.advantages, cfg, log_ratio=sequence_log_ratio(call, lp, base))
        through = call.valid
    per_seq = call.seq_sum(call.agg_weight * (-weight * ds))
    g = (per_seq / call.seq_token_count.clamp(min=1.0))[call.seq_index] * call.mask * through
    if cfg.kl_coef != 0.0:
        g = g + call.agg_weight * cfg.kl_coef * kl_term(lp, call.ref_logprobs, base, cfg, call.sampler_logprobs)[1]
    return g, call.entropy_weights * (-cfg.entropy_coef)


def chunk_is_weight(call, lp: Tensor, rows: slice, full_weight: Optional[Tensor]) -> Tensor:
    """W_t for rows: sliced from a precomputed full vector, or token-local from this chunk's lp."""
    if full_weight is not None:
        return full_weight[rows]
    cfg = call.config
    if cfg.is_level == "none":
        return torch.ones_like(lp)
    old = call.old_logprobs[rows] if call.old_logprobs is not None else proximal(call, unmasked(call, lp, rows), rows)
    log_w = ((old - call.sampler_logprobs[rows]) * call.mask[rows]).clamp(-LOG_WEIGHT_CLAMP, LOG_WEIGHT_CLAMP)
    return is_weight(log_w, cfg)[0]


def precomputed_is_weight(call, lp: Optional[Tensor] = None) -> Optional[Tensor]:
    """The full W vector when it can (or must) be known before the gradient sweep, else None.

    Token level with old_logprobs=None is token-local and is formed per chunk instead; sequence and
    geometric levels with old_logprobs=None need `lp` from a stats pass first.
    """
    cfg = call.config
    # a sequence's current lp decides it (the off-policy mask, a row's own weight): the plan ran the stats pass
    if cfg.off_policy_mask is not None or policy(cfg.policy).weight is not None:
        if lp is None:
            raise RuntimeError("the off-policy mask and VESPO's weight need the stats pass first")
        return policy_weight(call, lp)
    if call.rejection_gate is not None:  # W times the gate (rejection needs old_logprobs: W is known)
        return policy_weight(call, lp)
    if call.is_weights is not None:
        return call.is_weights
    if cfg.is_level == "none":
        return None
    if call.old_logprobs is None and cfg.is_level == "token":
        return None
    if call.old_logprobs is None and lp is None:
        raise RuntimeError("sequence-level IS weights with old_logprobs=None need the stats pass first")
    return full_is_weight(call, lp)[0]


def coefficients(call, lp: Tensor, rows: slice, weight: Tensor) -> Tuple[Tensor, Tensor]:
    """(g_t, h_t) = (d loss/d lp_t, d loss/d H_t) for rows, float64; lp is this chunk's detached logprob."""
    cfg = call.config
    lp = unmasked(call, lp, rows)
    agg = call.agg_weight[rows]
    base = _ratio_base(call, lp, rows)
    row = policy(cfg.policy)
    s, ds, _ = surrogate(lp, base, call.advantages[rows], cfg)
    if row.adjust is not None:  # a selection over every token: given, on all rows at once
        assert rows == slice(None)
        _, ds = cov_adjusted(call, lp, base, s, ds)
    g = -weight * ds
    penalty = None if row.penalty is None else row.penalty(lp, base, cfg)
    if penalty is not None:  # an extra term on every token, outside the weight (prime_rl's)
        g = g + penalty[1]
    if cfg.kl_coef != 0.0:
        samp = None if call.sampler_logprobs is None else call.sampler_logprobs[rows]
        g = g + cfg.kl_coef * kl_term(lp, call.ref_logprobs[rows], base, cfg, samp)[1]
    return agg * g, call.entropy_weights[rows] * (-cfg.entropy_coef)


class ChunkCoefficients:
    """g_t and h_t of a call's rows from their detached lp, for a backend that forms them in Python (the torch
    backend) rather than from the row table and the kernel parameters; it travels in KernelArgs.coefficients.
    temperature: the call's (a float, or float64 [N] per row); entropy: whether h_t can be nonzero, decided by
    the config, not by reading h on the host."""

    def __init__(self, call):
        self.call = call
        self.temperature = call.temperature
        self.entropy = call.config.entropy_coef != 0.0

    def __call__(self, lp: Tensor, rows: slice, full_weight: Optional[Tensor]) -> Tuple[Tensor, Tensor]:
        """(g, h) float64 [rows] of this chunk's lp (float64 [rows]); full_weight: W of every row when the plan
        precomputed it (the row table's weight row), else None."""
        weight = chunk_is_weight(self.call, lp, rows, full_weight)
        return coefficients(self.call, lp, rows, weight)


def metric_names(call) -> Tuple[str, ...]:
    """Names of the metrics `loss_and_metrics` returns for this call, in order."""
    return metric_names_for(call.config, call.sampler_logprobs is not None, call.is_weights is not None)


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
    if cfg.m2_threshold is not None:
        names += ("m2po_masked_frac", "m2po_m2")
    names += policy(cfg.policy).metric_names
    names += CENTERING_METRICS if cfg.score_centering is not None else ()
    return names + (("distill_mean",) if cfg.distill_kind is not None else ())


# LossConfig.score_centering's metrics (fused_is/centering.py `Centering.metric_values`), masked means
CENTERING_METRICS = ("centering_sampler_tail", "centering_learner_tail", "centering_c", "centering_drift_l1")


def loss_and_metrics(call, lp: Tensor, entropy: Tensor) -> Tuple[Tensor, Tensor]:
    """The scalar loss (float64) and the metric values of DESIGN.md section 3 (float64 [M], in the order of
    `metric_names(call)`) from all N logprobs and entropies. With a sequence_group, the totals over its ranks,
    reduced together in two collectives: the same on each rank. No host read.

    Every mean metric is a masked mean: its per-token values go into one [k, N] block whose product with the
    mask gives all k sums in one op (a handful of ops for the epilogue's reductions, whatever k)."""
    cfg = call.config
    lp = unmasked(call, lp)
    entropy = unmasked(call, entropy)
    rows = slice(None)
    mask = call.mask
    valid = call.valid
    weight, masked, truncated = full_is_weight(call, lp)
    keep = off_policy_keep(call, lp) if cfg.off_policy_mask is not None else None
    applied = policy_weight(call, lp, weight, keep)  # what multiplies s_t (W, VESPO's phi, the off-policy mask)
    base = _ratio_base(call, lp, rows)
    row = policy(cfg.policy)
    if row.sequence is not None:
        s, clipped, _ = row.sequence(call, lp, base)
    else:
        log_ratio = sequence_log_ratio(call, lp, base) if cfg.ratio_level == "sequence" else None
        s, ds, clipped = surrogate(lp, base, call.advantages, cfg, log_ratio=log_ratio)
        s, _ = cov_adjusted(call, lp, base, s, ds)
    per_token = -applied * s
    penalty = None if row.penalty is None else row.penalty(lp, base, cfg)
    if penalty is not None:
        per_token = per_token + penalty[0]
    if cfg.kl_coef != 0.0:
        per_token = per_token + cfg.kl_coef * kl_term(lp, call.ref_logprobs, base, cfg, call.sampler_logprobs)[0]

    # this rank's part of every call total, then one reduction of them all: [count, loss, the means' sums...]
    # (masked positions: a_t = e_t = 0 and mask 0; the mean's values are finite there (inputs zero-filled, lp and H
    # unmasked), so they add 0; the loss's per-token value is selected, as W s may not be)
    loss = torch.dot(call.agg_weight, torch.where(valid, per_token, 0.0))
    if cfg.entropy_coef != 0.0:
        loss = loss - cfg.entropy_coef * torch.dot(call.entropy_weights, entropy)
    if cfg.distill_kind is not None:  # the distillation term, aggregated as the policy's (D_t from its sweep)
        loss = loss + cfg.distill_coef * torch.dot(call.agg_weight, call.cache.distill)
    if cfg.score_centering is not None:  # the centering term's value (its gradient is the sweep's patch)
        loss = loss + torch.where(valid, call.cache.centering.value_term(call, lp), 0.0).sum()
    means = {"entropy_mean": entropy}  # metric name -> per-token values whose masked mean it is, in order
    if not cfg.reinforce_surrogate:
        means.update(clip_frac=clipped, ppo_kl=base - lp)
    samp = call.sampler_logprobs
    given = call.is_weights is not None
    if samp is not None:
        old = call.old_logprobs if call.old_logprobs is not None else proximal(call, lp)
        diff = old - samp
        means.update(mismatch_k1=-diff, mismatch_k3=torch.exp(diff) - diff - 1.0)
    if samp is not None or given:
        means.update(is_weight_mean=weight, is_masked_frac=masked)
    if samp is not None and not given:
        means["is_truncated_frac"] = truncated
    if keep is not None:
        means["off_policy_masked_frac"] = 1.0 - keep
    if cfg.score_centering is not None:
        means.update(call.cache.centering.metric_values())
    if cfg.distill_kind is not None:
        means["distill_mean"] = call.cache.distill
    for name, values in row.metrics:  # the row's own metrics
        means[name] = values(call, lp, base)
    totals = [mask.sum().reshape(1), loss.reshape(1), torch.mv(torch.stack(list(means.values())), mask)]
    if cfg.rejection:  # over the caller's unmasked tokens, rejected ones included
        totals.append(call.rejected.sum().reshape(1))
    if cfg.m2_threshold is not None:  # M2PO's dropped tokens, and delta^2 over the tokens it ranked
        ranked = call.m2po_ranked
        m2 = (call.sampler_logprobs - call.old_logprobs).square()
        totals.append(torch.stack([call.m2po_dropped.sum(), ranked.sum(), torch.dot(ranked, m2)]))
    totals = call.total(torch.cat(totals))
    count, loss = totals[0], totals[1]
    metrics = dict(zip(means, (totals[2:2 + len(means)] / count.clamp(min=1.0)).unbind(0)))
    if samp is not None or given:  # max and min over the unmasked tokens (0 when there are none)
        extremes = torch.where(valid, torch.stack([weight, -weight]), -math.inf)  # max of -W: minus the min
        extremes = call.total(extremes.amax(1) if len(weight) else extremes.new_full((2,), -math.inf), "max")
        top, negated_bottom = torch.where(count > 0, extremes, 0.0).unbind(0)
        metrics.update(is_weight_max=top, is_weight_min=0.0 - negated_bottom)  # 0 - 0 is +0 when no token counts
    if cfg.rejection:
        rejected = totals[-1 - 3 * (cfg.m2_threshold is not None)]
        counted = count + rejected if cfg.rejection_counts == "drop" else count  # "keep": still in the mask
        metrics["rejected_frac"] = rejected / counted.clamp(min=1.0)
    if cfg.m2_threshold is not None:
        dropped, ranked_count, m2_sum = totals[-3:]
        ranked_count = ranked_count.clamp(min=1.0)
        metrics.update(m2po_masked_frac=dropped / ranked_count, m2po_m2=m2_sum / ranked_count)
    return loss, torch.stack([metrics[name] for name in metric_names(call)])  # in the documented order
