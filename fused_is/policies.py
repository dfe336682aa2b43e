"""The policy table: each policy surrogate of LossConfig.policy declared once (DESIGN.md sections 2, 7 and 8).

Validation (fused_is/config.py, fused_is/call.py), the plan (fused_is/plan.py), the kernel contract
(fused_is/backends/abi.py) and the metrics (fused_is/coefficients.py) read what a policy needs from here, not
from lists of names of their own. The math of each policy lives in fused_is/coefficients.py (and independently
in fused_is/reference.py); docs/architecture.md has the recipe for adding one.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Mapping, Optional, Tuple


@dataclass(frozen=True)
class Policy:
    """What the rest of the package needs to know about one policy surrogate s_t."""

    name: str
    # "ratio": s_t is a function of the ratio r_t = exp(lp_t - base_t) (PPO and its relatives: a ratio base is
    # needed); "logprob": s_t = A_t lp_t times a detached weight (REINFORCE, VESPO)
    surrogate: str
    # the fused kernels' own branch (abi.ENUMS["policy"]), or None: g_t = d loss / d lp_t is formed in float64
    # from a stats pass and handed to the kernels per row (one more read of the logits, no kernel code)
    kernel: Optional[str]
    # a token's s_t depends on its whole sequence (packed input then needs cu_seqlens)
    sequence_level: bool = False
    # a token's coefficients depend on the current lp of other tokens: the stats pass runs first
    stats_pass: bool = False
    # a selection over every token of the batch (not with sequence_group, whose ranks split the tokens)
    whole_batch: bool = False
    # metrics of this policy beyond the common ones (DESIGN.md section 3)
    metrics: Tuple[str, ...] = ()
    # LossConfig fields that apply to this policy alone (set elsewhere they are an error)
    parameters: Tuple[str, ...] = ()
    source: str = ""  # where it comes from, for the docs


_TABLE = (
    Policy("ppo", "ratio", "ppo", source="PPO's clipped ratio (every trainer)"),
    Policy("reinforce", "logprob", "reinforce", source="REINFORCE: A * logprob"),
    Policy("cispo", "ratio", "cispo", source="CISPO (verl, TRL): A * logprob weighted by the detached clipped ratio"),
    Policy("gmpo", "ratio", None, sequence_level=True, stats_pass=True,
           source="GMPO (verl geo_mean): the geometric mean of sign-clipped token ratios per sequence"),
    Policy("sapo", "ratio", "sapo", parameters=("sapo_tau_pos", "sapo_tau_neg"),
           source="SAPO (verl, TRL): a soft sigmoid gate on the ratio"),
    Policy("vespo", "logprob", "reinforce", sequence_level=True, stats_pass=True,
           parameters=("vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg"),
           source="VESPO (TRL): REINFORCE under a detached gamma weight of the sequence ratio"),
    Policy("dppo_tv", "ratio", None, stats_pass=True, parameters=("ratio_cap",),
           source="DPPO (verl): a capped ratio inside a total-variation trust region on probabilities"),
    Policy("dppo_kl", "ratio", None, stats_pass=True, parameters=("ratio_cap",),
           source="DPPO (verl): a capped ratio inside a binary-KL trust region on probabilities"),
    Policy("clip_cov", "ratio", None, stats_pass=True, whole_batch=True, metrics=("cov_selected_frac",),
           parameters=("cov_ratio", "cov_bounds", "cov_kl_coef", "cov_seed"),
           source="Clip-Cov (verl): PPO with the surrogate zeroed at high-covariance tokens"),
    Policy("kl_cov", "ratio", None, stats_pass=True, whole_batch=True, metrics=("cov_selected_frac",),
           parameters=("cov_ratio", "cov_bounds", "cov_kl_coef", "cov_seed"),
           source="KL-Cov (verl): the unclipped ratio with a KL penalty at high-covariance tokens"),
    Policy("prime_rl", "ratio", None, stats_pass=True, parameters=("ratio_penalty_coef",),
           source="prime-rl's default loss: the ratio to the sampler, tokens masked by their probability's move, "
                  "plus a squared log-ratio penalty"),
)

#: policy name -> Policy, in LossConfig.policy's order of choices
POLICIES: Mapping[str, Policy] = MappingProxyType({p.name: p for p in _TABLE})
#: the kernel branches of the fused kernels, in the order of their enum values (fused_is/backends/abi.py)
KERNEL_POLICIES = ("reinforce", "ppo", "cispo", "sapo")


def policy(name: str) -> Policy:
    """The table entry of LossConfig.policy `name` (names are checked by LossConfig first)."""
    return POLICIES[name]
