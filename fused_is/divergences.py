"""The divergence table (DESIGN.md section 10): one row per divergence of `distill_loss` and of the policy loss's
distillation term, each with its math for the chunked torch sweeps, its kernel code and its needs. Every list of
divergence names (the config's, the kernels' codes, the C++ mirror's check) is derived from it; nothing outside it,
the config's docs and the oracle (fused_is/reference.py) compares a divergence by name.

Per token, with p = softmax(z / tau) the student's and q = softmax(u / tau_t) the teacher's distribution:
    forward_kl  D = KL(q || p) = sum q (log q - log p)         F = p - q
    reverse_kl  D = KL(p || q) = sum p (log p - log q)         F = p (log p - log q - D)
    jsd         D = beta KL(q || m) + (1 - beta) K,  K = KL(p || m),  m = (1 - beta) p + beta q
                                                               F = (1 - beta) p (log p - log m - K)
and d D / d z = F / tau. "jsd" at beta = 0 and 1 is TRL's special case, the forward and reverse KL rows themselves.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Dict, Optional, Tuple

import torch

Tensor = torch.Tensor


def plogr(log_weight: Tensor, log_a: Tensor, log_b: Tensor) -> Tensor:
    """Row sums (float64) of exp(log_weight) (log_a - log_b), a term 0 where the weight is 0 (0 log 0 = 0)."""
    weight = log_weight.exp()
    return torch.where(weight > 0, weight * (log_a - log_b), 0.0).sum(dim=-1, dtype=torch.float64)


def log_mixture(log_p: Tensor, log_q: Tensor, beta: float) -> Tensor:
    """log m = log((1 - beta) p + beta q), -inf where both are 0."""
    return torch.logaddexp(log_p + math.log1p(-beta), log_q + math.log(beta))


def _masked_product(p: Tensor, factor: Tensor) -> Tensor:
    """p * factor, 0 where p is 0 (a -inf log-probability in factor must not make 0 * inf)."""
    return torch.where(p > 0, p * factor, 0.0)


# --- each row's torch math: `value` over a chunk of rows (log p, log q in the compute dtype) -> (D, K or None),
# `gradient` -> F (log_p may be overwritten), `buckets` over top-k buckets (S, T float64) -> (D, e = d D / d S) ------


def _forward_value(log_p, log_q, beta):
    return plogr(log_q, log_q, log_p), None


def _forward_gradient(log_p, log_q, p, divergence, student_kl, beta):
    return p.sub_(log_q.exp_())


def _forward_buckets(s, t, beta):
    return plogr(t, t, s), -t.exp()


def _reverse_value(log_p, log_q, beta):
    return plogr(log_p, log_p, log_q), None


def _reverse_gradient(log_p, log_q, p, divergence, student_kl, beta):
    return _masked_product(p, log_p.sub_(log_q).sub_(divergence.unsqueeze(1)))


def _reverse_buckets(s, t, beta):
    big_p = s.exp()
    return plogr(s, s, t), _masked_product(big_p, s - t + 1)


def _jsd_value(log_p, log_q, beta):
    log_m = log_mixture(log_p, log_q, beta)
    student_kl = plogr(log_p, log_p, log_m)
    return beta * plogr(log_q, log_q, log_m) + (1 - beta) * student_kl, student_kl


def _jsd_gradient(log_p, log_q, p, divergence, student_kl, beta):
    log_m = log_mixture(log_p, log_q, beta)
    return _masked_product(p, log_p.sub_(log_m).sub_(student_kl.unsqueeze(1))).mul_(1 - beta)


def _jsd_buckets(s, t, beta):
    log_m = log_mixture(s, t, beta)
    student = _masked_product(s.exp(), s - log_m)
    return beta * plogr(t, t, log_m) + (1 - beta) * student.sum(dim=-1), (1 - beta) * student


def _weighed_by(first: bool) -> Callable:
    """A KL's merge of a vocabulary shard's parts: sum_r W_r (D_r + ln W_r - ln O_r), W the shares of the model whose
    distribution weighs the KL (the teacher's for KL(q || p): first=False picks the student's)."""
    def merge(share_student: Tensor, share_teacher: Tensor, shard_divergence: Tensor) -> Tensor:
        weigh, other = (share_teacher, share_student) if first else (share_student, share_teacher)
        mass = weigh.exp()
        return torch.where(mass > 0, mass * (shard_divergence + weigh - other), 0.0)
    return merge


@dataclasses.dataclass(frozen=True)
class Divergence:
    """One divergence: its name (the `kind` argument, LossConfig.distill_kind), the kernels' code, its math for the
    torch sweeps and what its plan needs."""

    name: str  # distill_loss's kind and LossConfig.distill_kind; the key of the kernels' codes
    title: str  # in error texts
    # the kernels' DIVERGENCE value (fused_is/backends/abi.py DISTILL_DIVERGENCES, csrc/distill_math.h), or None: no
    # kernel branch, the chunked torch sweeps run it ("auto" and the policy loss's term pick them; a kernel backend
    # asked for by name refuses it)
    code: Optional[int]
    value: Callable  # (log_p, log_q, beta) -> (D, K or None) per row, float64
    gradient: Callable  # (log_p, log_q, p, D, K, beta) -> F per element (before the weight and 1 / tau)
    buckets: Callable  # (S, T, beta) -> (D, e = d D / d S) over the top-k buckets, float64
    # reads the mixture m: K_t kept per row, the mixture's shares passed to the kernels, one more read of the rows
    # (the statistics kernel's second sweep; a vocabulary shard's sums given the merged normalisers)
    mixture: bool
    picks_teacher: bool  # top_k: the support holds the teacher's top k
    picks_student: bool  # top_k: the support holds the student's top k
    shard_merge: Optional[Callable]  # (share_s, share_t, D_r) -> each shard's part of D (no second read), or None

    def grad_scale(self, beta: float) -> float:
        """The factor of F that the kernels apply with 1 / tau: 1 - beta for the mixture's gradient, else 1."""
        return 1.0 - beta if self.mixture else 1.0

    def log2_shares(self, beta: float) -> Tuple[float, float]:
        """(log2(1 - beta), log2(beta)): the mixture's shares as the kernels take them, (0, 0) without a mixture."""
        return (math.log2(1.0 - beta), math.log2(beta)) if self.mixture else (0.0, 0.0)

    def support_width(self, top_k: int) -> int:
        """K', the support entries of a row: top_k per model whose top k is picked (JSD's union: 2 top_k, duplicates
        kept, their g 0)."""
        return top_k * (int(self.picks_teacher) + int(self.picks_student))


FORWARD_KL = Divergence("forward_kl", "forward KL", 0, _forward_value, _forward_gradient, _forward_buckets,
                        mixture=False, picks_teacher=True, picks_student=False, shard_merge=_weighed_by(True))
REVERSE_KL = Divergence("reverse_kl", "reverse KL", 1, _reverse_value, _reverse_gradient, _reverse_buckets,
                        mixture=False, picks_teacher=False, picks_student=True, shard_merge=_weighed_by(False))
JSD = Divergence("jsd", "generalized JSD", 2, _jsd_value, _jsd_gradient, _jsd_buckets,
                 mixture=True, picks_teacher=True, picks_student=True, shard_merge=None)

DIVERGENCES: Dict[str, Divergence] = {row.name: row for row in (FORWARD_KL, REVERSE_KL, JSD)}
KINDS = tuple(DIVERGENCES)  # distill_loss's kind, LossConfig.distill_kind
CODES = {name: row.code for name, row in DIVERGENCES.items() if row.code is not None}  # the kernels' DIVERGENCE
# the mixture's end points: beta = 0 weighs KL(q || m) by 0 and m = p, beta = 1 gives m = q (TRL's special cases are
# the KLs themselves, not those limits)
_ENDS = {0.0: FORWARD_KL, 1.0: REVERSE_KL}


def of(kind: str, beta: float) -> Divergence:
    """The row that runs `kind` at this beta (a mixture at beta 0 or 1 is the forward or reverse KL row)."""
    row = DIVERGENCES[kind]
    return _ENDS.get(float(beta), row) if row.mixture else row
