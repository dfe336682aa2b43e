"""The policy table: each policy surrogate of LossConfig.policy, its math and its needs, declared once (DESIGN.md
section 9).

A row owns:
- its surrogate on float64 O(N) vectors: `surrogate(lp, ratio, adv, cfg) -> (s, ds/dlp, clipped)` (a `Ratio` holds
  the ratio's base and its clamped log; None for a logprob surrogate); a row that writes only the value
  (`value_only=True`, returning (s, clipped)) gets ds by autograd (fused_is/coefficients.py `surrogate`);
- its extra per-token terms (`penalty`), its weight (`weight`, replacing the IS weight), a batch-level selection
  (`select`, with `adjust`), or a whole-sequence surrogate (`sequence`): what the plan cannot form row by row;
- its parameters (the LossConfig fields only it reads, with their checks: set for another policy, an error naming
  the field), its constraints on the common fields, its metrics;
- its plan needs (`stats_pass`, `sequence_level`, `whole_batch`) and its kernel branch (`kernel`, an enum value of
  the fused kernels, with `kernel_params`: up to 4 floats p0..p3 from the config; None: g is formed here in float64
  after a stats pass and handed to the kernels per row).
fused_is/config.py, coefficients.py, call.py, plan.py and the backends ask the table; nothing outside it (the error
texts and the oracle, fused_is/reference.py, aside) compares a policy by name. docs/architecture.md has the recipe
for adding one. The rows' arguments `call` are a prepared call (fused_is/call.py; not imported here: the table sits
at the bottom of the package's imports).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Callable, Mapping, NamedTuple, Optional, Tuple

import torch

from .constants import LOG_WEIGHT_CLAMP, SAPO_LOG_RATIO_BOUND, VESPO_LOG_FLOOR

Tensor = torch.Tensor


class Ratio(NamedTuple):
    """The ratio r_t = exp(log_ratio) of a ratio surrogate, after LossConfig's clamps: `base` its (detached) base,
    `log_ratio` clamped, `beyond` the tokens where a clamp cut the gradient (None: no clamp configured)."""

    base: Tensor
    log_ratio: Tensor
    ratio: Tensor
    beyond: Optional[Tensor]


@dataclass(frozen=True)
class Parameter:
    """A LossConfig field that belongs to some policies: its kind ("float", "float_or_none", "int_or_none", "pair":
    converted by fused_is/config.py) and its range (`valid` of the converted value, `rule` in the error's words)."""

    kind: str
    valid: Callable[[Any], bool] = lambda value: True
    rule: str = ""


@dataclass(frozen=True)
class Policy:
    """One policy surrogate s_t: its math, parameters, metrics, plan needs and kernel branch."""

    name: str
    # (lp, ratio, adv, cfg) -> (s, ds/dlp, clipped) on float64 [n] vectors; ratio is None for a logprob surrogate.
    # None: the row has a whole-sequence surrogate instead (`sequence`)
    surrogate: Optional[Callable]
    # s_t is a function of r_t = exp(lp_t - base_t) (PPO and its relatives: a ratio base is needed), else of lp_t
    # (REINFORCE, VESPO: s_t = A_t lp_t times a detached weight)
    ratio: bool = True
    # the surrogate returns (s, clipped) only: ds/dlp by autograd on the float64 vectors (not with `kernel`)
    value_only: bool = False
    # the fused kernels' own branch (abi.ENUMS["policy"], KERNEL_POLICIES), and its parameters p0..p3 from a config
    kernel: Optional[str] = None
    kernel_params: Callable[[Any], Tuple[float, ...]] = lambda cfg: ()
    # (lp, base, cfg) -> (value, d value / dlp) of an extra per-token term outside the IS weight, or None when off
    penalty: Optional[Callable] = None
    # (call, lp, is_weight) -> what multiplies s_t instead of the IS weight (which it takes in): VESPO
    weight: Optional[Callable] = None
    # (call, lp, base) -> [N] float64 1/0 tokens selected over the whole batch (cached on the call), and
    # (call, lp, base, s, ds, selected) -> (s, ds) applying it: Clip-Cov, KL-Cov
    select: Optional[Callable] = None
    adjust: Optional[Callable] = None
    # (call, lp, base) -> (s, clipped, through) of a surrogate over the whole sequence: GMPO
    sequence: Optional[Callable] = None
    # metrics beyond the common ones: (name, (call, lp, base) -> per-token values whose masked mean it is)
    metrics: Tuple[Tuple[str, Callable], ...] = ()
    # LossConfig fields that apply to this policy alone (set elsewhere they are an error)
    parameters: Mapping[str, Parameter] = field(default_factory=dict)
    # constraints on the common fields: the ratio_ref values it takes, ratio_level="sequence" (GSPO) and
    # log_ratio_clamp allowed
    ratio_refs: Tuple[str, ...] = ("old", "sampler", "loglinear")
    sequence_ratio: bool = False
    log_ratio_clamp: bool = True
    # a token's s_t depends on its whole sequence (packed input then needs cu_seqlens)
    sequence_level: bool = False
    # a token's coefficients depend on the current lp of other tokens: the stats pass runs first
    stats_pass: bool = False
    # a selection over every token of the batch (not with sequence_group, whose ranks split the tokens)
    whole_batch: bool = False
    source: str = ""  # where it comes from (docs/math.md)

    @property
    def metric_names(self) -> Tuple[str, ...]:
        return tuple(name for name, _ in self.metrics)


# ---- the rows' math -------------------------------------------------------------------------------------------

def _no_clip(lp: Tensor) -> Tensor:
    return torch.zeros_like(lp, dtype=torch.bool)


def reinforce(lp: Tensor, ratio: None, adv: Tensor, cfg) -> Tuple[Tensor, Tensor, Tensor]:
    """s = A lp."""
    return adv * lp, adv, _no_clip(lp)


def ppo(lp: Tensor, r: Ratio, adv: Tensor, cfg) -> Tuple[Tensor, Tensor, Tensor]:
    """s = min(r A, clip(r, 1 - clip_low, 1 + clip_high) A), and max(s, dual_clip A) where A < 0."""
    unclipped = r.ratio * adv
    clipped_value = r.ratio.clamp(1.0 - cfg.clip_low, 1.0 + cfg.clip_high) * adv
    clipped = clipped_value < unclipped  # the min picks the clipped branch: ratio is outside the range
    s = torch.where(clipped, clipped_value, unclipped)
    ds = torch.where(clipped if r.beyond is None else clipped | r.beyond, 0.0, unclipped)  # d(r A)/dlp = r A
    if cfg.dual_clip is not None:
        floor = cfg.dual_clip * adv
        dual = (adv < 0) & (floor > s)
        s = torch.where(dual, floor, s)
        ds = torch.where(dual, torch.zeros_like(ds), ds)
        clipped = clipped | dual
    return s, ds, clipped


def cispo(lp: Tensor, r: Ratio, adv: Tensor, cfg) -> Tuple[Tensor, Tensor, Tensor]:
    """s = sg(clip(r)) A lp: the clipped ratio is a constant weight."""
    kept = r.ratio.clamp(1.0 - cfg.clip_low, 1.0 + cfg.clip_high)
    return kept * adv * lp, kept * adv, kept != r.ratio


def sapo(lp: Tensor, r: Ratio, adv: Tensor, cfg) -> Tuple[Tensor, Tensor, Tensor]:
    """s = sigmoid(tau (r - 1)) 4 / tau A, tau = sapo_tau_pos where A > 0, else sapo_tau_neg:
    ds/dlp = 4 sig (1 - sig) r A."""
    tau = torch.where(adv > 0, torch.full_like(adv, cfg.sapo_tau_pos), torch.full_like(adv, cfg.sapo_tau_neg))
    ratio = torch.exp(r.log_ratio.clamp(max=SAPO_LOG_RATIO_BOUND))  # saturated beyond: no 0 * inf
    sig = torch.sigmoid(tau * (ratio - 1.0))
    ds = 4.0 * sig * (1.0 - sig) * ratio * adv
    if r.beyond is not None:
        ds = torch.where(r.beyond, 0.0, ds)
    return sig * 4.0 / tau * adv, ds, _no_clip(lp)


def trust_region(lp: Tensor, base: Tensor, adv: Tensor, cfg, kind: str) -> Tensor:
    """DPPO's v_t (bool): the token probability's move from p_old = exp(base) to p = exp(lp) stays within
    clip_high (A > 0) or clip_low (A <= 0), by total variation ("tv": dppo_tv, and prime_rl's mask) or binary KL
    ("kl": dppo_kl, as verl)."""
    prob, old_prob = torch.exp(lp), torch.exp(base)
    if kind == "tv":
        return torch.where(adv > 0, prob - old_prob <= cfg.clip_high, prob - old_prob >= -cfg.clip_low)
    kl = old_prob * (base - lp) + (1.0 - old_prob) * torch.log((1.0 - old_prob + 1e-8) / (1.0 - prob + 1e-8))
    return torch.where(adv > 0, (kl <= cfg.clip_high) | (prob <= old_prob), (kl <= cfg.clip_low) | (prob >= old_prob))


def _dppo(kind: str) -> Callable:
    def dppo(lp: Tensor, r: Ratio, adv: Tensor, cfg) -> Tuple[Tensor, Tensor, Tensor]:
        """s = sg(min(r, ratio_cap) v) A lp, v the trust region on probabilities."""
        weight = r.ratio if cfg.ratio_cap is None else r.ratio.clamp(max=cfg.ratio_cap)
        valid = trust_region(lp, r.base, adv, cfg, kind)
        kept = torch.where(valid, weight, torch.zeros_like(weight))
        return kept * adv * lp, kept * adv, ~valid
    return dppo


def prime_rl(lp: Tensor, r: Ratio, adv: Tensor, cfg) -> Tuple[Tensor, Tensor, Tensor]:
    """s = keep r A, keep: p = exp(lp) moved from exp(base) by at most the clip range (total variation)."""
    keep = trust_region(lp, r.base, adv, cfg, "tv")
    kept = torch.where(keep, r.ratio * adv, torch.zeros_like(r.ratio))
    ds = kept if r.beyond is None else torch.where(r.beyond, 0.0, kept)
    return kept, ds, ~keep


def ratio_penalty(lp: Tensor, base: Tensor, cfg) -> Optional[Tuple[Tensor, Tensor]]:
    """prime_rl's c (lp - base)^2 on every unmasked token, kept or not (outside the IS weight)."""
    if cfg.ratio_penalty_coef == 0.0:
        return None
    return cfg.ratio_penalty_coef * (lp - base) ** 2, 2.0 * cfg.ratio_penalty_coef * (lp - base)


def unclipped_ratio(lp: Tensor, r: Ratio, adv: Tensor, cfg) -> Tuple[Tensor, Tensor, Tensor]:
    """s = r A, unclipped (KL-Cov: the KL at the selected tokens comes from `adjust`)."""
    return r.ratio * adv, r.ratio * adv, _no_clip(lp)


def cov_selection(call, lp: Tensor, base: Tensor, largest: bool) -> Tensor:
    """[N] float64 1/0: the tokens Clip-Cov or KL-Cov selects (verl's), formed once per call from the current lp
    (detached, masked rows 0) and kept on the call, so that the gradient and the loss see the same selection.
    cov_t = (A_t - mean A)(lp_t - mean lp), means over the unmasked tokens; k = max(1, int(n cov_ratio)) of the n
    unmasked tokens. kl_cov (largest): the k largest cov_t, exactly equal ones by the lower token index (verl's
    torch.topk orders ties as it happens to). clip_cov: k drawn at random (torch.randperm on the CPU's default
    generator, or one seeded with cov_seed, in token order, as verl) from the unmasked tokens whose PPO surrogate is
    not clipped and whose cov_t is strictly inside cov_bounds. Reads the count on the host."""
    if call.cache.cov_selected is not None:
        return call.cache.cov_selected
    cfg = call.config
    valid = call.valid
    n = int(valid.sum())
    selected = torch.zeros_like(lp)
    if n:
        adv = call.advantages
        cov = (adv - adv[valid].mean()) * (lp - lp[valid].mean())
        k = max(1, int(n * cfg.cov_ratio))
        if largest:  # kl_cov: the k largest cov_t, ties at the k-th value to the lower token index
            cov = torch.where(valid, cov, -math.inf)
            kth = torch.topk(cov, k).values[-1]  # which of the tied ones topk picks is unspecified: only its value
            above = cov > kth
            tied = cov == kth
            chosen = above | (tied & (torch.cumsum(tied, 0) <= k - above.sum()))
        else:  # clip_cov: unclipped PPO tokens strictly inside the bounds (no log-ratio clamp with the Cov policies)
            log_ratio = lp - base
            _, _, clipped = ppo(lp, Ratio(base, log_ratio, torch.exp(log_ratio), None), adv, cfg)
            low, high = cfg.cov_bounds
            candidates = (valid & ~clipped & (cov > low) & (cov < high)).nonzero().squeeze(1)
            generator = None if cfg.cov_seed is None else torch.Generator().manual_seed(cfg.cov_seed)
            chosen = candidates[torch.randperm(len(candidates), generator=generator)[:k].to(candidates.device)]
        selected[chosen] = 1.0
    call.cache.cov_selected = selected
    return selected


def _clip_cov_selection(call, lp: Tensor, base: Tensor) -> Tensor:
    return cov_selection(call, lp, base, largest=False)


def _kl_cov_selection(call, lp: Tensor, base: Tensor) -> Tensor:
    return cov_selection(call, lp, base, largest=True)


def clip_cov_adjust(call, lp, base, s, ds, selected) -> Tuple[Tensor, Tensor]:
    """Clip-Cov: the surrogate zeroed at the selected tokens."""
    return s * (1.0 - selected), ds * (1.0 - selected)


def kl_cov_adjust(call, lp, base, s, ds, selected) -> Tuple[Tensor, Tensor]:
    """KL-Cov: minus cov_kl_coef |lp - base| at the selected tokens (the gradient of |x| is sign(x), 0 at 0)."""
    delta = lp - base
    coef = call.config.cov_kl_coef
    return s - selected * coef * delta.abs(), ds - selected * coef * torch.sign(delta)


def gmpo_terms(call, lp: Tensor, base: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
    """(s_t, clipped_t, through_t) of GMPO: s_t = R_i A_t with log R_i the mean over sequence i's unmasked
    tokens of log r clipped at +clip_high (A > 0) or -clip_low (A < 0); through_t: lp_t reaches log R_i
    (not clipped, not beyond log_ratio_clamp, A != 0)."""
    cfg = call.config
    log_ratio = lp - base
    through = torch.ones_like(lp, dtype=torch.bool)
    if cfg.log_ratio_clamp is not None:
        c = cfg.log_ratio_clamp
        through = (log_ratio >= -c) & (log_ratio <= c)
        log_ratio = log_ratio.clamp(-c, c)
    adv = call.advantages
    kept = torch.where(adv > 0, log_ratio.clamp(max=cfg.clip_high),
                       torch.where(adv < 0, log_ratio.clamp(min=-cfg.clip_low), torch.zeros_like(log_ratio)))
    clipped = (kept != log_ratio) & (adv != 0)
    through = through & ~clipped & (adv != 0)
    seq = call.seq_sum(torch.where(call.valid, kept, 0.0))
    log_r = (seq / call.seq_token_count.clamp(min=1.0))[call.seq_index]
    return torch.exp(log_r) * adv, clipped, through


def vespo_weight(call, lp: Tensor, is_weight: Tensor) -> Tensor:
    """[N] float64: VESPO's gamma weight phi_i of each token's sequence (TRL's get_gamma_weights) from the current
    lp (detached, masked rows 0), old_logprobs (lp when None) and the IS weight W_t, which enters phi in log space
    when there is one (config or the caller's is_weights)."""
    cfg = call.config
    old = call.old_logprobs if call.old_logprobs is not None else lp
    log_ratio = ((lp - old).clamp(-LOG_WEIGHT_CLAMP, LOG_WEIGHT_CLAMP)) * call.mask
    if call.is_weights is not None or cfg.is_level != "none":
        log_is = torch.log(is_weight).clamp(VESPO_LOG_FLOOR, LOG_WEIGHT_CLAMP)
        log_ratio = log_ratio + torch.where(call.valid, log_is, 0.0)
    log_w = call.seq_sum(log_ratio).clamp(VESPO_LOG_FLOOR, LOG_WEIGHT_CLAMP)[call.seq_index]
    nonneg = call.advantages >= 0
    k = torch.where(nonneg, torch.full_like(lp, cfg.vespo_k_pos), torch.full_like(lp, cfg.vespo_k_neg))
    lam = torch.where(nonneg, torch.full_like(lp, cfg.vespo_lambda_pos),
                      torch.full_like(lp, cfg.vespo_lambda_neg)).clamp(min=1e-4)
    phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w))
    return torch.nan_to_num(phi, nan=0.0, posinf=0.0, neginf=0.0) * call.mask


# ---- the parameters' checks --------------------------------------------------------------------------------------

_ANY_FLOAT = Parameter("float")
_POSITIVE = Parameter("float", lambda v: v > 0.0, "must be > 0")
_NONNEGATIVE = Parameter("float", lambda v: v >= 0.0, "must be >= 0")
_CAP = Parameter("float_or_none", lambda v: v is None or v > 0.0, "must be None or > 0")
_DUAL_CLIP = Parameter("float_or_none", lambda v: v is None or v > 1.0, "must be None or > 1")
_FRACTION = Parameter("float", lambda v: 0.0 < v <= 1.0, "must be in (0, 1]")
_BOUNDS = Parameter("pair", lambda v: v[0] < v[1], "must have low < high")
_SEED = Parameter("int_or_none")

_COV_SOURCE = "verl: the surrogate changed at the tokens of largest covariance of A and lp"
_TABLE = (
    Policy("ppo", ppo, kernel="ppo", sequence_ratio=True, parameters={"dual_clip": _DUAL_CLIP},
           kernel_params=lambda cfg: (cfg.clip_low, cfg.clip_high,
                                      math.inf if cfg.dual_clip is None else cfg.dual_clip),
           source="PPO's clipped ratio (every trainer)"),
    Policy("reinforce", reinforce, ratio=False, kernel="reinforce", source="REINFORCE: A * logprob"),
    Policy("cispo", cispo, kernel="cispo", kernel_params=lambda cfg: (cfg.clip_low, cfg.clip_high),
           source="CISPO (verl, TRL): A * logprob weighted by the detached clipped ratio"),
    Policy("gmpo", None, sequence=gmpo_terms, sequence_level=True, stats_pass=True,
           source="GMPO (verl geo_mean): the geometric mean of sign-clipped token ratios per sequence"),
    Policy("sapo", sapo, kernel="sapo", kernel_params=lambda cfg: (cfg.sapo_tau_pos, cfg.sapo_tau_neg),
           parameters={"sapo_tau_pos": _POSITIVE, "sapo_tau_neg": _POSITIVE},
           source="SAPO (verl, TRL): a soft sigmoid gate on the ratio"),
    Policy("vespo", reinforce, ratio=False, kernel="reinforce", weight=vespo_weight, ratio_refs=("old",),
           sequence_level=True, stats_pass=True,
           parameters=dict.fromkeys(("vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg"), _ANY_FLOAT),
           source="VESPO (TRL): REINFORCE under a detached gamma weight of the sequence ratio"),
    Policy("dppo_tv", _dppo("tv"), stats_pass=True, parameters={"ratio_cap": _CAP},
           source="DPPO (verl): a capped ratio inside a total-variation trust region on probabilities"),
    Policy("dppo_kl", _dppo("kl"), stats_pass=True, parameters={"ratio_cap": _CAP},
           source="DPPO (verl): a capped ratio inside a binary-KL trust region on probabilities"),
    Policy("clip_cov", ppo, select=_clip_cov_selection, adjust=clip_cov_adjust, log_ratio_clamp=False,
           stats_pass=True, whole_batch=True, metrics=(("cov_selected_frac", _clip_cov_selection),),
           parameters={"cov_ratio": _FRACTION, "cov_bounds": _BOUNDS, "cov_seed": _SEED},
           source="Clip-Cov (" + _COV_SOURCE + "): PPO with the surrogate zeroed there"),
    Policy("kl_cov", unclipped_ratio, select=_kl_cov_selection, adjust=kl_cov_adjust, log_ratio_clamp=False,
           stats_pass=True, whole_batch=True, metrics=(("cov_selected_frac", _kl_cov_selection),),
           parameters={"cov_ratio": _FRACTION, "cov_kl_coef": _ANY_FLOAT},
           source="KL-Cov (" + _COV_SOURCE + "): the unclipped ratio with a KL penalty there"),
    Policy("prime_rl", prime_rl, kernel="prime_rl", penalty=ratio_penalty,
           kernel_params=lambda cfg: (cfg.clip_low, cfg.clip_high, cfg.ratio_penalty_coef),
           parameters={"ratio_penalty_coef": _NONNEGATIVE},
           source="prime-rl's default loss: the ratio to the sampler, tokens masked by their probability's move, "
                  "plus a squared log-ratio penalty"),
)

#: policy name -> Policy, in LossConfig.policy's order of choices
POLICIES: Mapping[str, Policy] = MappingProxyType({p.name: p for p in _TABLE})
#: the kernel branches of the fused kernels, in the order of their enum values (fused_is/backends/abi.py,
#: csrc/fused_is_math.h `Policy`)
KERNEL_POLICIES = ("reinforce", "ppo", "cispo", "sapo", "prime_rl")
#: every policy parameter (a LossConfig field some rows own) -> its check, and the rows that own it
PARAMETERS: Mapping[str, Parameter] = MappingProxyType({n: s for p in _TABLE for n, s in p.parameters.items()})
OWNERS: Mapping[str, Tuple[str, ...]] = MappingProxyType(
    {n: tuple(p.name for p in _TABLE if n in p.parameters) for n in PARAMETERS})
#: the most generic float parameters a kernel branch takes (p0..p3)
KERNEL_PARAMS = 4

assert all(p.kernel in KERNEL_POLICIES for p in _TABLE if p.kernel is not None)
assert all(len({id(p.parameters[n]) for p in _TABLE if n in p.parameters}) == 1 for n in PARAMETERS)


def policy(name: str) -> Policy:
    """The table entry of LossConfig.policy `name` (names are checked by LossConfig first)."""
    return POLICIES[name]


def kernel_params(cfg) -> Tuple[float, float, float, float]:
    """p0..p3 of a config's kernel branch (0.0 where its row takes fewer)."""
    params = tuple(float(v) for v in policy(cfg.policy).kernel_params(cfg))
    assert len(params) <= KERNEL_PARAMS, cfg.policy
    return params + (0.0,) * (KERNEL_PARAMS - len(params))
