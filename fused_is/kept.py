"""Kept-set replay (DESIGN.md section 8): the learner's distribution renormalised over the sampler's support.

A sampler that truncates (top-k, top-p, min-p) draws from softmax over its kept set S, not over the vocabulary.
With `kept=`, lp_t, H_t and the gradient are those of p = softmax(z / tau) over S_t:

    lp_t = z_y / tau - logsumexp_{j in S} z_j / tau,   H_t = -sum_{j in S} p_j log p_j,
    d z_j = (g_t (1[j = y] - p_j) - h_t p_j (log p_j + H_t)) / tau  for j in S, exactly 0 outside S.

Only the K kept logits of a row are read (a gather), so a replayed call reads K, not V, values per row; the
gradient buffer is zeros but for the K kept columns. The kept set arrives as ids ([..., K], -1 = no entry: vLLM's
SamplingMask padded by `fused_is.vllm.kept_ids`), or as `SamplerParams`, recomputed from the learner's own logits
(which approximates replay: the learner's logits are not the sampler's, so its kept set may differ).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from .combinations import refused

# the widest kept set recomputed from SamplerParams without a top_k (a top-p / min-p set wider than this is refused)
MAX_KEPT = 1024
# rows per block of the kept-set recomputation (each holds a [rows, V] sort)
_ROWS_PER_BLOCK_ELEMENTS = 1 << 22


@dataclass(frozen=True)
class SamplerParams:
    """The sampler's truncation, recomputed on the learner's logits (vLLM's order: temperature, min-p, top-k,
    top-p). top_k: None or an int >= 1; top_p: None or 0 < p <= 1; min_p: None or 0 <= p <= 1 (of the most likely
    token's probability). max_kept: the widest set taken without a top_k (a wider one is a ValueError). A sampled
    token that the learner's logits leave out of its row's set (a token at the set's boundary: the learner's logits
    are not the sampler's) is added to that set: the sampler kept it."""

    top_k: Optional[int] = None
    top_p: Optional[float] = None
    min_p: Optional[float] = None
    max_kept: int = MAX_KEPT

    def __post_init__(self):
        if self.top_k is not None and (isinstance(self.top_k, bool) or not isinstance(self.top_k, int)
                                       or self.top_k < 1):
            raise ValueError(f"SamplerParams.top_k must be None or an int >= 1; got {self.top_k!r}")
        if self.top_p is not None and not (isinstance(self.top_p, (int, float)) and 0.0 < self.top_p <= 1.0):
            raise ValueError(f"SamplerParams.top_p must be None or in (0, 1]; got {self.top_p!r}")
        if self.min_p is not None and not (isinstance(self.min_p, (int, float)) and 0.0 <= self.min_p <= 1.0):
            raise ValueError(f"SamplerParams.min_p must be None or in [0, 1]; got {self.min_p!r}")
        if isinstance(self.max_kept, bool) or not isinstance(self.max_kept, int) or self.max_kept < 1:
            raise ValueError(f"SamplerParams.max_kept must be an int >= 1; got {self.max_kept!r}")


def kept_from_params(logits: torch.Tensor, params: SamplerParams, temperature, valid=None) -> torch.Tensor:
    """[N, K] int64 ids (-1 padded): the support that `params` leave of each row of softmax(logits / tau), as vLLM's
    sampler leaves it (min-p on the probabilities, then top-k keeping every logit tied with the k-th, then top-p),
    computed block by block of rows (no [N, V] temporary). temperature: a float or float64 [N]; valid (bool [N],
    optional): rows that count; a NaN or +inf logit there is a ValueError (no set can be recomputed from it)."""
    rows = logits.reshape(-1, logits.shape[-1]) if logits.dim() == 2 or logits.is_contiguous() else None
    n, vocab = (logits.shape[0] * logits.shape[1] if logits.dim() == 3 else logits.shape[0]), logits.shape[-1]
    cap = min(vocab, max(params.top_k or 0, params.max_kept))
    step = max(1, _ROWS_PER_BLOCK_ELEMENTS // max(1, vocab))
    blocks = []
    for start in range(0, n, step):
        stop = min(n, start + step)
        block = (rows[start:stop] if rows is not None else _row_block(logits, start, stop)).float()
        bad = (torch.isnan(block) | torch.isposinf(block)).any(-1)
        if valid is not None:
            bad &= valid[start:stop]
        if bool(bad.any()):
            row = start + int(bad.nonzero()[0, 0])
            raise ValueError(f"kept=SamplerParams: logits hold NaN or +inf at row {row}; no kept set can be "
                             "recomputed from them")
        tau = temperature[start:stop, None].float() if isinstance(temperature, torch.Tensor) else temperature
        z = block / tau
        if params.min_p:  # vLLM's min-p: p_j < min_p max p is dropped, i.e. z_j < max z + log min_p
            z = z.masked_fill(z < z.amax(-1, keepdim=True) + math.log(params.min_p), -math.inf)
        values, order = z.sort(-1, descending=True)
        survive = torch.isfinite(values)
        if params.top_k is not None and params.top_k < vocab:  # vLLM: below the k-th value is dropped, ties kept
            survive &= values >= values[:, params.top_k - 1:params.top_k]
        if params.top_p is not None and params.top_p < 1.0:  # vLLM: drop the smallest while their mass <= 1 - p
            probs = torch.softmax(values.masked_fill(~survive, -math.inf), -1)
            below_and_self = probs.flip(-1).cumsum(-1).flip(-1)  # the mass of this entry and every smaller one
            dropped = (below_and_self <= 1.0 - params.top_p) & survive
            dropped[:, 0] = False  # at least one
            survive &= ~dropped
        if valid is not None:  # a masked row's set is its token alone (check_kept): its logits may hold anything
            survive &= valid[start:stop, None]
            survive[:, 0] |= ~valid[start:stop]
        count = survive.sum(-1)
        if int(count.max()) > cap:
            row = start + int((count > cap).nonzero()[0, 0])
            hint = "" if params.top_k else "; give top_k, or raise max_kept"
            raise ValueError(f"kept: SamplerParams keep {int(count.max())} tokens of row {row}, more than "
                             f"max_kept={params.max_kept}{hint}")
        width = int(count.max())
        blocks.append(torch.where(survive, order, -1)[:, :max(1, width)])
    width = max((b.shape[1] for b in blocks), default=1)
    out = torch.full((n, width), -1, dtype=torch.long, device=logits.device)
    start = 0
    for block in blocks:
        out[start:start + block.shape[0], :block.shape[1]] = block
        start += block.shape[0]
    return out


def with_sampled_token(kept: torch.Tensor, ids: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """A recomputed kept set [N, K] with each unmasked row's sampled token added where the learner's logits left it
    out (a column of its own, -1 elsewhere; none when every row has it): the sampler kept the token it drew, and the
    learner's set, recomputed from other logits, may miss a token at its boundary."""
    missing = ~((kept == ids.unsqueeze(1)) & (kept >= 0)).any(-1) & valid
    if not bool(missing.any()):
        return kept
    return torch.cat([kept, torch.where(missing, ids, -1).unsqueeze(1)], dim=1)


def _row_block(logits: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """Rows [start, stop) of non-contiguous [B, T, V] logits, as [rows, V] (a copy of those rows only)."""
    t = logits.shape[1]
    return torch.stack([logits[r // t, r % t] for r in range(start, stop)])


def kept_rows(logits, kept, token_shape, ids, valid, temperature, vocab_group, checks) -> torch.Tensor:
    """A `kept=` argument checked, as int64 [N, K] (-1 = none): the caller's ids, or the set SamplerParams leave
    of the learner's own logits at these temperatures (a float, or float64 [N]). checks: the call's
    `fused_is.validate.Checks`, which collects the value checks' flags."""
    if vocab_group is not None:
        raise refused("kept/vocab_group")
    if isinstance(kept, SamplerParams):
        if logits.stride(-1) == 0:  # the fused-linear stand-in has no values to recompute a kept set from
            raise ValueError("kept=SamplerParams(...) needs the logits themselves; pass the kept ids instead")
        if checks.validate == "async":
            raise ValueError("kept=SamplerParams(...) reads the logits on the host to recompute the kept sets; with "
                             "validate='async' pass the kept ids instead")
        kept = with_sampled_token(kept_from_params(logits, kept, temperature, valid), ids, valid)
        kept = kept.reshape(*token_shape, kept.shape[-1])
    return check_kept(kept, token_shape, logits, ids, valid, logits.shape[-1], checks)


def check_kept(kept: torch.Tensor, token_shape, logits: torch.Tensor, ids: torch.Tensor, valid: torch.Tensor,
               vocab: int, checks) -> torch.Tensor:
    """The kept ids as int64 [N, K] (-1 = none) after the checks: shape tokens' + [K], ids in [-1, V), no id twice
    in a row, the sampled token in its row's set (unmasked positions)."""
    if not isinstance(kept, torch.Tensor) or kept.dtype.is_floating_point or kept.dtype == torch.bool:
        got = kept.dtype if isinstance(kept, torch.Tensor) else type(kept).__name__
        raise TypeError(f"kept must be an integer tensor of shape {tuple(token_shape)} + (K,) (-1 = no entry), or "
                        f"fused_is.SamplerParams; got {got}")
    if kept.device != logits.device:
        raise ValueError(f"kept is on {kept.device} but logits are on {logits.device}; put both on one device")
    if kept.dim() != len(token_shape) + 1 or kept.shape[:-1] != token_shape or kept.shape[-1] < 1:
        raise ValueError(f"kept must have shape {tuple(token_shape)} + (K,) with K >= 1; got {tuple(kept.shape)}")
    if kept.shape[-1] > vocab:
        raise ValueError(f"kept names K={kept.shape[-1]} tokens per position, more than the vocabulary V={vocab}")
    flat = kept.reshape(-1, kept.shape[-1]).long()
    entry = flat >= 0
    bad_range = ((flat < -1) | (flat >= vocab)).any(-1) & valid
    ordered = flat.sort(-1).values
    twice = ((ordered[:, 1:] == ordered[:, :-1]) & (ordered[:, 1:] >= 0)).any(-1) & valid
    sampled_in = ((flat == ids.unsqueeze(1)) & entry).any(-1)
    outside = ~sampled_in & valid
    first = lambda bad: int(bad.nonzero()[0, 0])  # noqa: E731
    position = lambda row: tuple(int(i) for i in torch.unravel_index(torch.tensor(row), tuple(token_shape)))  # noqa: E731
    checks.fail_each(torch.stack([bad_range.any(), twice.any(), outside.any()]), [
        (f"kept ids must lie in [-1, V={vocab}) at unmasked positions",
         lambda: f"; see position {position(first(bad_range))}"),
        ("kept names a token twice at an unmasked position", lambda: f" (position {position(first(twice))})"),
        ("kept: the sampled token must lie in the kept set at unmasked positions (a sampler that truncates cannot "
         "draw outside it)", lambda: f"; token {int(ids[first(outside)])} is not kept at position "
                                     f"{position(first(outside))}"),
    ])
    return torch.where(valid.unsqueeze(1), flat, torch.where(torch.arange(flat.shape[1], device=flat.device) == 0,
                                                             ids.unsqueeze(1), -1))


def kept_log_probs(logits: torch.Tensor, kept: torch.Tensor, temperature, valid: torch.Tensor, rounding=None):
    """(log softmax(logits / temperature) renormalised over each row's kept set, float64 [N, K], -inf at -1 entries;
    its log-sum-exp [N]; the K kept logits as read [N, K]): the K kept logits of each row read alone. temperature: a
    float or float64 [N]; rounding: a dtype the kept logits are rounded to first (head-precision replay). A masked row
    (valid False) may hold anything: it is read as zeros."""
    k = kept.shape[1]
    raw = logits.gather(-1, kept.clamp(min=0).reshape(*logits.shape[:-1], k)).reshape(-1, k)
    gathered = torch.where(valid.unsqueeze(1), (raw if rounding is None else raw.to(rounding)).double(), 0.0)
    inv = (1.0 / temperature).unsqueeze(1) if isinstance(temperature, torch.Tensor) else 1.0 / temperature
    z = torch.where(kept >= 0, gathered * inv, -math.inf)
    lse = torch.logsumexp(z, -1)
    return z - lse.unsqueeze(1), lse, raw


def kept_statistics(logits: torch.Tensor, ids: torch.Tensor, kept: torch.Tensor, temperature, valid: torch.Tensor):
    """(lp, H float64 [N], the kept probabilities p [N, K] (0 at -1 entries)) over each row's kept set; reads the
    K kept logits of each row only. temperature: a float or float64 [N]. A masked row (valid False) may hold
    anything: it is read as zeros (its set is its token alone, check_kept: p = 1, a zero gradient, no NaN)."""
    log_p = kept_log_probs(logits, kept, temperature, valid)[0]
    p = torch.exp(log_p)  # 0 at -1 entries and at -inf logits
    entropy = -torch.where(p > 0, p * log_p, 0.0).sum(-1)
    target = (kept == ids.unsqueeze(1)) & (kept >= 0)
    lp = torch.where(target, log_p, 0.0).sum(-1)
    lp = torch.where(target.any(-1), lp, -math.inf)  # the token outside the set: -inf (the row flag)
    return lp, entropy, p


def kept_gradient(ids, kept, p, entropy, g, h, temperature, grad: torch.Tensor, extra=None):
    """d loss / d logits into `grad` (zeroed first): the kept columns only, from the kept probabilities and the
    per-row g = d loss / d lp, h = d loss / d H (float64 [N]); 0 outside every kept set. extra: float64 [N, K] more
    d loss / d logits at the kept columns (a distillation term's), added before the one rounding to grad's dtype."""
    inv = (1.0 / temperature).unsqueeze(1) if isinstance(temperature, torch.Tensor) else 1.0 / temperature
    p = p.double()
    log_p = torch.where(p > 0, torch.log(p), 0.0)
    target = ((kept == ids.unsqueeze(1)) & (kept >= 0)).double()
    dz = (g.unsqueeze(1) * (target - p) - h.unsqueeze(1) * p * (log_p + entropy.unsqueeze(1))) * inv
    if extra is not None:
        dz = dz + extra
    # a -1 entry writes its row's first kept column again, with that column's value (identical writes: one result
    # whatever their order; every row keeps at least one token, check_kept makes sure); ids are unique otherwise.
    # A plain scatter, not scatter_add: on the CPU a bf16 scatter_add converts the whole buffer twice.
    first = (kept >= 0).int().argmax(-1, keepdim=True)
    index = torch.where(kept >= 0, kept, kept.gather(1, first))
    dz = torch.where(kept >= 0, dz, dz.gather(1, first))
    grad.zero_()
    k = kept.shape[1]
    index = index.reshape(*grad.shape[:-1], k)
    values = dz.to(grad.dtype).reshape(*grad.shape[:-1], k)
    bits = SAME_SIZE_INT.get(grad.dtype)
    if bits is not None and grad.stride(-1) == 1:  # the values' bits, moved as integers: the CPU's scatter of a
        grad.view(bits).scatter_(-1, index, values.view(bits))  # bf16 buffer converts all of it to fp32 and back
    else:
        grad.scatter_(-1, index, values)
    return grad


SAME_SIZE_INT = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32,
                  torch.float64: torch.int64}
