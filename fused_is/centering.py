"""Score centering (LossConfig.score_centering; DESIGN.md section 9): the sampler's expected score subtracted.

Off-policy, the policy gradient sum_t g_t d lp_t carries a drift term E_q[A] E_q[d log p] that pulls the learner
toward the sampler q. Centering replaces each token's score d lp_t = (e_y - p) / tau by (e_y - q~) / tau, where
q~ is the sampler's distribution as far as the caller knows it: its top-K probabilities on the set S it reported
(`sampler_topk=(ids, logprobs)`, what vLLM returns with logprobs=K), and outside S the remaining mass 1 - Q_S
spread like the learner's own distribution (the proportional tail):

    q~_j = q_j (j in S),   q~_j = c p_j (j not in S),   c = max(1 - Q_S, e) / max(1 - P_S, e),   e = 1e-6,

Q_S = sum_S q, P_S = sum_S p (the floor e, as the open implementations have it: 1 - P_S formed from fp32 logprobs
means nothing below it). Per token, with G_t the loss's d/d lp_t before any IS weight and m_j the expected weight:

    "proportional" (DESIGN.md's base form): m_j = q~_j, G_t = g_t (the IS weight W_t inside it): the score
        g_t (e_y - p) becomes g_t (e_y - q~);
    "calibrated" (the IS-weighted expectation of the SkyRL and Miles implementations): m_j = q_j f(p_j / q_j) on S
        and c f(1 / c) p_j outside, f the config's IS weight of a ratio (truncate: min(r, is_cap); mask: r inside
        [is_floor, is_cap], else 0; ...): what W_t = f(p_y / q_y) weighs the sampled score by, in expectation under
        the sampler; the score W_t G_t (e_y - p) becomes W_t G_t (e_y - p) - G_t sum_j m_j (e_j - p).

Both subtract G_t sum_j m_j (e_j - p) from the gradient, and add its value counterpart
-G_t sum_{j in S} (m_j - alpha p_j) log p_j to the loss (alpha = m_j / p_j outside S; the tail folded into the
sum by E_p[d log p] = 0, the implementations' convention). The entropy term is not a score: not centered. The
sweep writes the dense part as the plain gradient with g replaced by g + G (alpha - M), M = sum_j m_j, plus a
patch of the K + 1 columns S and y: -G (alpha - M) at y and -G (m_j - alpha p_j) at j in S (divided by tau).
P_S comes from the K gathered logits and lp: log p_j = (z_j - z_y) / tau + lp, so no extra sweep over V.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from . import coefficients
from .constants import LOG_WEIGHT_CLAMP
from .kept import SAME_SIZE_INT

# Q_S above 1 by more than this is an error (the logprobs are not a distribution's); below it, rounding (a sampler's
# fp32 logprobs of a nearly complete top-K add up to 1 + a few ulps) and Q_S is taken as at most 1
TOPK_MASS_SLACK = 1e-4
# the floor of both tail masses in c
TAIL_FLOOR = 1e-6


@dataclass(frozen=True)
class SamplerTopK:
    """A call's sampler top-K, checked: ids int64 [N, K] (-1 = no entry), logq float64 [N, K] (0 at -1 entries and
    masked rows: read as no mass)."""

    ids: torch.Tensor
    logq: torch.Tensor

    def rows(self, rows) -> "SamplerTopK":
        return SamplerTopK(self.ids[rows], self.logq[rows])

    def columns(self, tokens: torch.Tensor) -> torch.Tensor:
        """int64 [N, K + 1]: the K ids (-1 entries pointing at the sampled token y) and y: every column the patch
        and the gather touch, all in range."""
        return torch.cat([torch.where(self.ids >= 0, self.ids, tokens.unsqueeze(1)), tokens.unsqueeze(1)], dim=1)


def check_sampler_topk(sampler_topk, token_shape, logits: torch.Tensor, vocab: int, valid: torch.Tensor,
                       checks) -> SamplerTopK:
    """`sampler_topk=(ids, logprobs)` checked: ids integer [*tokens.shape, K] in [-1, V) (-1: no entry), no id twice in
    an unmasked row; logprobs floating [*tokens.shape, K], <= 0 and not NaN at the entries (-inf: probability 0), their
    probabilities summing to at most 1 per unmasked row. Masked rows may hold anything."""
    if not isinstance(sampler_topk, (tuple, list)) or len(sampler_topk) != 2:
        raise TypeError("sampler_topk must be a pair (ids, logprobs) of tensors of shape tokens.shape + (K,): the "
                        f"sampler's top-K token ids and their logprobs; got {type(sampler_topk).__name__}")
    ids, logprobs = sampler_topk
    if not isinstance(ids, torch.Tensor) or ids.dtype.is_floating_point or ids.dtype == torch.bool:
        got = ids.dtype if isinstance(ids, torch.Tensor) else type(ids).__name__
        raise TypeError(f"sampler_topk ids must be an integer tensor (-1 = no entry); got {got}")
    if not isinstance(logprobs, torch.Tensor) or not logprobs.dtype.is_floating_point:
        got = logprobs.dtype if isinstance(logprobs, torch.Tensor) else type(logprobs).__name__
        raise TypeError(f"sampler_topk logprobs must be a floating-point tensor; got {got}")
    for name, x in (("ids", ids), ("logprobs", logprobs)):
        if x.device != logits.device:
            raise ValueError(f"sampler_topk {name} is on {x.device} but logits are on {logits.device}")
        if x.dim() != len(token_shape) + 1 or x.shape[:-1] != token_shape or x.shape[-1] < 1:
            raise ValueError(f"sampler_topk {name} must have shape {tuple(token_shape)} + (K,) with K >= 1; got "
                             f"{tuple(x.shape)}")
    if ids.shape != logprobs.shape:
        raise ValueError(f"sampler_topk ids and logprobs must have the same K; got {ids.shape[-1]} ids and "
                         f"{logprobs.shape[-1]} logprobs per token")
    if ids.shape[-1] > vocab:
        raise ValueError(f"sampler_topk names K={ids.shape[-1]} tokens per position, more than the vocabulary "
                         f"V={vocab}")
    k = ids.shape[-1]
    flat = ids.reshape(-1, k).long()
    logq = logprobs.reshape(-1, k).double()
    entry = (flat >= 0) & valid.unsqueeze(1)
    logq = torch.where(entry, logq, -torch.inf)
    bad_range = ((flat < -1) | (flat >= vocab)).any(-1) & valid
    ordered = flat.sort(-1).values
    twice = ((ordered[:, 1:] == ordered[:, :-1]) & (ordered[:, 1:] >= 0)).any(-1) & valid
    bad_value = (torch.isnan(logq) | (logq > 0)).any(-1)
    mass = torch.exp(torch.where(torch.isnan(logq), -torch.inf, logq)).sum(-1)
    above = mass > 1.0 + TOPK_MASS_SLACK
    first = lambda bad: int(bad.nonzero()[0, 0])  # noqa: E731
    position = lambda row: tuple(int(i) for i in torch.unravel_index(torch.tensor(row), tuple(token_shape)))  # noqa: E731
    checks.fail_each(torch.stack([bad_range.any(), twice.any(), bad_value.any(), above.any()]), [
        (f"sampler_topk ids must lie in [-1, V={vocab}) at unmasked positions (-1: no entry)",
         lambda: f"; see position {position(first(bad_range))}"),
        ("sampler_topk names a token twice at an unmasked position", lambda: f" (position {position(first(twice))})"),
        ("sampler_topk logprobs must be <= 0 and not NaN at their entries (unmasked positions)",
         lambda: f"; see position {position(first(bad_value))}"),
        (f"sampler_topk probabilities must sum to at most 1 at each unmasked position (slack {TOPK_MASS_SLACK})",
         lambda: f"; they sum to {float(mass[first(above)]):.6g} at position {position(first(above))}"),
    ])
    ids = torch.where(entry, flat, -1)
    return SamplerTopK(ids, torch.where(entry, logq, 0.0))


@dataclass
class Centering:
    """Per-row quantities of a centered call (float64, masked rows 0): log p_S and p_S, q_S [N, K] (0 at -1
    entries), the tail masses 1 - Q_S and 1 - P_S [N] and c [N] (1 at masked rows)."""

    log_p_topk: torch.Tensor
    p_topk: torch.Tensor
    q_topk: torch.Tensor
    sampler_tail: torch.Tensor
    learner_tail: torch.Tensor
    c: torch.Tensor
    # (G [N], m [N, K], alpha [N], M [N]) of `expected_weights`, formed once
    weights: Optional[tuple] = None

    def value_term(self, call, lp: torch.Tensor) -> torch.Tensor:
        """[N] float64: each token's share of the loss's centering term, -G sum_S (m_j - alpha p_j) log p_j."""
        g, m, alpha, _ = expected_weights(call, lp)
        return -g * ((m - alpha.unsqueeze(1) * self.p_topk) * self.log_p_topk).sum(-1)

    def metric_values(self) -> dict:
        """Per-token values whose masked means are the centering metrics: the sampler's and the learner's mass outside
        S, c, and sum_j |m_j - M p_j| (the size of the expected score subtracted, in units of 1 / tau; with M = 1 the
        L1 distance between the expected weights and p). After `expected_weights`."""
        _, m, alpha, total = self.weights
        drift = (m - total.unsqueeze(1) * self.p_topk).abs().sum(-1) + (alpha - total).abs() * self.learner_tail
        return {"centering_sampler_tail": self.sampler_tail, "centering_learner_tail": self.learner_tail,
                "centering_c": self.c, "centering_drift_l1": drift}


def centering_rows(topk: SamplerTopK, gathered: torch.Tensor, lp: torch.Tensor, temperature,
                   valid: torch.Tensor) -> Centering:
    """The per-row quantities from the gathered logits ([N, K + 1] of `topk.columns`: the K ids', then z_y), lp [N]
    float64 and the rows' temperature (a float or float64 [N])."""
    inv = (1.0 / temperature) if not isinstance(temperature, torch.Tensor) else (1.0 / temperature).unsqueeze(1)
    entry = (topk.ids >= 0) & valid.unsqueeze(1)
    log_p = torch.where(entry, (gathered[:, :-1] - gathered[:, -1:]) * inv + torch.where(valid, lp, 0.0).unsqueeze(1),
                        -torch.inf)
    p_topk = torch.exp(log_p)
    q_topk = torch.exp(torch.where(entry, topk.logq, -torch.inf))
    zero = torch.zeros_like(lp)
    sampler_tail = torch.where(valid, (1.0 - q_topk.sum(-1)).clamp(min=0.0), zero)
    learner_tail = torch.where(valid, (1.0 - p_topk.sum(-1)).clamp(min=0.0), zero)
    c = torch.where(valid, sampler_tail.clamp(min=TAIL_FLOOR) / learner_tail.clamp(min=TAIL_FLOOR), 1.0)
    return Centering(torch.where(entry, log_p, 0.0), p_topk, q_topk, sampler_tail, learner_tail, c)


def expected_weights(call, lp: torch.Tensor):
    """(G [N], m [N, K], alpha [N], M [N]) float64 of the call's centering (module docstring), formed once per call:
    G the loss's d/d lp without the IS weight (calibrated) or with it (proportional), m the expected weights on S,
    alpha the tail's per-probability weight, M = sum_S m + alpha (1 - P_S)."""
    state = call.cache.centering
    if state.weights is not None:
        return state.weights
    cfg = call.config
    if cfg.score_centering == "calibrated":  # f of the config's IS weight, on S and on the tail's ratio 1 / c
        # the policy's gates (TRL's off-policy mask) but not the IS weight
        gates = coefficients.policy_weight(call, lp, torch.ones_like(lp))
        g = coefficients.coefficients(call, lp, slice(None), gates)[0]
        has_q = state.q_topk > 0
        log_ratio = torch.where(has_q, state.log_p_topk - torch.log(torch.where(has_q, state.q_topk, 1.0)), 0.0)
        f_topk = coefficients.is_weight(log_ratio.clamp(-LOG_WEIGHT_CLAMP, LOG_WEIGHT_CLAMP), cfg)[0]
        m = torch.where(has_q, state.q_topk * f_topk, 0.0)
        alpha = state.c * coefficients.is_weight(-torch.log(state.c), cfg)[0]
    else:  # the sweep's own g: formed after the stats pass (GSPO, GMPO, ...), or token-local
        g = (coefficients.given_coefficients(call, lp) if cfg.coefficients_given else
             coefficients.coefficients(call, lp, slice(None), coefficients.policy_weight(call, lp)))[0]
        m, alpha = state.q_topk, state.c
    g = torch.where(call.valid, g, 0.0)
    total = m.sum(-1) + alpha * state.learner_tail
    state.weights = g, m, alpha, total
    return state.weights


class CenteringPatch:
    """The K + 1 columns of the centered gradient (module docstring), written over the sweep's: the sweep writes every
    column with g replaced by `dense_g` = g + G (alpha - M); the columns S and y then get their exact value, formed in
    float64 and rounded once, -G (m_j - alpha p_j) / tau and -G (alpha - M) / tau added to that dense part (a patch
    added to the rounded dense values would cancel against them: c can be large where the learner's tail is small)."""

    def __init__(self, call, lp: torch.Tensor, entropy: torch.Tensor, g: torch.Tensor, h: torch.Tensor):
        state = call.cache.centering
        big_g, m, alpha, total = expected_weights(call, lp)
        inv = 1.0 / call.temperature
        inv = inv.unsqueeze(1) if isinstance(inv, torch.Tensor) else inv
        self.columns = call.centering_topk.columns(call.tokens)
        lp, entropy = torch.where(call.valid, lp, 0.0), torch.where(call.valid, entropy, 0.0)  # masked: anything
        at_y = self.columns == self.columns[:, -1:]  # the sampled token's own column, a -1 entry, or y in S
        p = torch.where(at_y, lp.exp().unsqueeze(1), torch.cat([state.p_topk, state.p_topk[:, :1]], dim=1))
        log_p = torch.where(at_y, lp.unsqueeze(1), torch.cat([state.log_p_topk, state.log_p_topk[:, :1]], dim=1))
        self.dense_g = g + big_g * (alpha - total)
        # the sweep's value at each column: (g' (1[j = y] - p_j) - h p_j (log p_j + H)) / tau
        self.unit_g = (at_y.double() - p) * inv  # times g'
        self.unit_h = -torch.where(p > 0, p * (log_p + entropy.unsqueeze(1)), 0.0) * inv  # times h
        patch = torch.cat([-(m - alpha.unsqueeze(1) * state.p_topk), -(alpha - total).unsqueeze(1)], dim=1) * inv
        self.unit_big_g = torch.where(at_y, torch.where(at_y, patch, 0.0).sum(-1, keepdim=True), patch)  # times G
        self.big_g, self.h = big_g, h.clone()

    def apply(self, rows, grad: torch.Tensor, scale=None) -> None:
        """Write the exact value of the K + 1 columns of `rows` (a slice, int64 indices or None: all) into grad
        ([rows, V], or the [B, T, V] of all rows), in grad's dtype, times `scale` (a 0-d tensor: the deferred sweep's
        grad_output) if given. A plain scatter: every entry naming the same column carries the same value."""
        cut = (lambda x: x) if rows is None else (lambda x: x[rows])  # noqa: E731
        columns = cut(self.columns)
        values = (cut(self.dense_g).unsqueeze(1) * cut(self.unit_g) + cut(self.h).unsqueeze(1) * cut(self.unit_h)
                  + cut(self.big_g).unsqueeze(1) * cut(self.unit_big_g))
        if scale is not None:
            values = values * scale.to(torch.float64)
        index = columns.reshape(*grad.shape[:-1], columns.shape[1])
        values = values.to(grad.dtype).reshape(index.shape)
        bits = SAME_SIZE_INT.get(grad.dtype)
        if bits is not None and grad.stride(-1) == 1:  # as integers: the CPU's scatter of a bf16 buffer converts it all
            grad.view(bits).scatter_(-1, index, values.view(bits))
        else:
            grad.scatter_(-1, index, values)
