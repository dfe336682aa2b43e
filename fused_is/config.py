"""Loss configuration (DESIGN.md sections 2 and 3): `LossConfig`, the seed's estimators as `PRESETS`.

Every field is checked when a config is built; an unknown name or an out-of-range value raises
ValueError (TypeError for a wrong type) naming the field, so a bad config never reaches a kernel.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import types
import warnings
from dataclasses import dataclass
from typing import Mapping, Optional

from . import divergences
from .combinations import refused
from . import policies as policy_table
from .constants import LOG_WEIGHT_CLAMP, MIN_TEMPERATURE, SAPO_LOG_RATIO_BOUND  # noqa: F401 (re-exported)

POLICIES = tuple(policy_table.POLICIES)  # the policy table (fused_is/policies.py) declares each one
RATIO_REFS = ("old", "sampler", "loglinear")
RATIO_LEVELS = ("token", "sequence")
IS_LEVELS = ("none", "token", "sequence", "geometric")
IS_MODES = ("truncate", "mask", "reject", "raw")
KL_TYPES = ("k1", "k2", "k3", "k1+", "k3+")
# LossConfig.kl_weight: what multiplies the KL estimator (its codes 0..3 in this order are the kernels' ABI,
# fused_is/backends/abi.py ENUMS["kl_ratio_weighted"])
KL_WEIGHTS = ("none", "ratio", "score", "sampler")
# the booleans kl_weight replaced (deprecated), each with the kl_weight it stands for
DEPRECATED_KL_WEIGHT_FLAGS = {"kl_ratio_weighted": "ratio", "kl_score": "score", "kl_sampler_weight": "sampler"}
SCORE_CENTERINGS = ("proportional", "calibrated")
DISTILL_KINDS = divergences.KINDS  # the divergence table's rows (fused_is/divergences.py)
LOSS_AGGS = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
# rejection criteria (verl's rollout_rs options, same names and meaning): a divergence between the sampler and the
# learner at theta_old per token, or per sequence (sum, mean or max over its unmasked tokens)
# learner at theta_old per token, or per sequence (sum, mean or max over its unmasked tokens); and OpenRLHF's
# divergences of the sampled token's probability (binary KL, total variation), per token or as a sequence mean
REJECTION_OPTIONS = ("token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2", "seq_sum_k3", "seq_mean_k1",
                     "seq_mean_k2", "seq_mean_k3", "seq_max_k2", "seq_max_k3", "token_binary_kl", "token_tv",
                     "seq_mean_binary_kl", "seq_mean_tv")
REJECTION_LEVELS = ("token", "seq_sum", "seq_mean", "seq_max")
REJECTION_COUNTS = ("drop", "keep")


def rejection_option_parts(name: str):
    """("token" | "seq_sum" | "seq_mean" | "seq_max", statistic) of a rejection option name."""
    for level in REJECTION_LEVELS:
        if name.startswith(level + "_"):
            return level, name[len(level) + 1:]
    raise ValueError(f"not a rejection option: {name!r}")



def _rejection_criteria(value) -> tuple:
    """LossConfig.rejection as a tuple of (option, low, high) triples (low: k1 options only, else None), from
    a mapping {option: bound}, (option, bound) pairs, or the triples themselves (a JSON round trip)."""
    if value is None:
        return ()
    if isinstance(value, Mapping):
        items = list(value.items())
    elif isinstance(value, (list, tuple)):
        items = list(value)
    else:
        raise TypeError(f"LossConfig.rejection must be a mapping {{option: bound}} or a sequence of (option, bound) "
                        f"pairs; got {type(value).__name__}")
    out, seen = [], set()
    for item in items:
        if not isinstance(item, (list, tuple)) or len(item) not in (2, 3):
            raise TypeError(f"LossConfig.rejection entries must be (option, bound) pairs; got {item!r}")
        name = item[0]
        _check_choice("rejection option", name, REJECTION_OPTIONS)
        if name in seen:
            raise ValueError(f"LossConfig.rejection names {name!r} twice")
        seen.add(name)
        bound = tuple(item[1:]) if len(item) == 3 else item[1]
        if name.endswith("k1"):
            if isinstance(bound, numbers.Real) and not isinstance(bound, bool) and bound >= 1.0:
                bound = (1.0 / bound, bound)  # one number x: the band [1/x, x], as verl reads it
            if not isinstance(bound, (list, tuple)) or len(bound) != 2:
                raise ValueError(f"LossConfig.rejection[{name!r}] needs (low, high) bounds on the ratio "
                                 f"pi_sampler / pi_old, or one number x >= 1 for [1/x, x] (verl's k1 "
                                 f"thresholds); got {bound!r}")
            low, high = (_as_float(f"rejection[{name!r}]", b) for b in bound)
            if not 0.0 < low <= high:
                raise ValueError(f"LossConfig.rejection[{name!r}] bounds must satisfy 0 < low <= high; got {bound!r}")
        else:
            if len(item) == 3:
                if item[1] is not None:
                    raise ValueError(f"LossConfig.rejection[{name!r}] takes one upper bound; got {tuple(item[1:])!r}")
                bound = item[2]
            low, high = None, _as_float(f"rejection[{name!r}]", bound)
            if not high > 0.0:
                raise ValueError(f"LossConfig.rejection[{name!r}] must be an upper bound > 0; got {bound!r}")
        out.append((name, low, high))
    return tuple(out)


# LossConfig.head_dtype: the sampler head's output dtypes that head-precision replay rounds the logits to
HEAD_DTYPES = ("bfloat16", "float16", "float32")


def _check_choice(name: str, value, choices) -> None:
    if not isinstance(value, str):
        raise TypeError(f"LossConfig.{name} must be a str, one of {choices}; got {value!r}")
    if value not in choices:
        raise ValueError(f"LossConfig.{name} must be one of {choices}; got {value!r}")


def _convert(kind: str, name: str, value):
    """A policy parameter's value converted by its kind (fused_is/policies.py `Parameter`), or a TypeError / ValueError
    naming it."""
    if kind == "float":
        return _as_float(name, value)
    if kind == "float_or_none":
        return _as_float(name, value, allow_none=True)
    if kind == "int_or_none":
        if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Integral)):
            raise TypeError(f"LossConfig.{name} must be None or an int; got {value!r}")
        return value
    assert kind == "pair", kind
    if not isinstance(value, (tuple, list)) or len(value) != 2:
        raise TypeError(f"LossConfig.{name} must be a pair (low, high); got {value!r}")
    return tuple(_as_float(f"{name}[{i}]", value[i], allow_inf=True) for i in (0, 1))


def _as_float(name: str, value, *, allow_none: bool = False, allow_inf: bool = False):
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"LossConfig.{name} must be a real number; got {value!r}")
    value = float(value)
    if math.isnan(value) or (math.isinf(value) and not allow_inf):
        raise ValueError(f"LossConfig.{name} must be finite; got {value!r}")
    return value


@dataclass(frozen=True)
class LossConfig:
    """The per-token loss of DESIGN.md section 2. `LossConfig()` is the ppo_tis preset.

    Fields:
        policy: "ppo" (clipped ratio surrogate), "reinforce" (A * logprob) or "cispo" (A * logprob weighted by
            the detached clipped ratio, sg(clip(r, 1 - clip_low, 1 + clip_high)) A lp: verl and TRL "cispo")
            or "gmpo" (geometric-mean policy optimisation, verl "geo_mean": every token of sequence i takes
            R_i = exp(mean over its unmasked tokens of log r clipped at +clip_high where A > 0 and at
            -clip_low where A < 0), s_t = R_i A_t, the gradient through every unclipped token's lp)
            or "sapo" (a soft gate instead of the clip, verl and TRL "sapo": s_t = sigmoid(tau (r - 1)) 4 / tau A
            with tau = sapo_tau_pos where A > 0, sapo_tau_neg elsewhere).
            or "vespo" (TRL "vespo": REINFORCE, s_t = A_t lp_t, weighted by the detached gamma weight of the
            sequence, phi_i = exp(lambda + k log w_i - lambda w_i) with log w_i = clamp(sum over its unmasked
            tokens of clamp(lp - old, +-20) + clamp(log W_t, log 1e-8, 20), log 1e-8, 20), where W_t is the IS
            weight (config or is_weights), which enters phi instead of multiplying; k, lambda = vespo_k_pos,
            vespo_lambda_pos where A >= 0, vespo_k_neg, vespo_lambda_neg elsewhere; runs the stats pass).
            or "dppo_tv" / "dppo_kl" (verl's DPPO: REINFORCE, s_t = sg(min(r, ratio_cap) v_t) A_t lp_t, where the
            trust region v_t on the token probabilities p = exp(lp), p_old = exp(base) is, for A > 0,
            p - p_old <= clip_high (TV) or binary KL(p_old || p) <= clip_high or p <= p_old (KL), and for A <= 0,
            p - p_old >= -clip_low (TV) or binary KL <= clip_low or p >= p_old (KL)).
            or "prime_rl" (prime-rl's default loss: s_t = keep_t r_t A_t with the ratio's gradient, r_t = exp(lp_t -
            base_t), base = the sampler's logprobs with ratio_ref="sampler" as in its preset; keep_t = 0 where the
            token probability moved too far from exp(base): p - p_base > clip_high where A > 0, < -clip_low
            elsewhere (prime-rl's dppo_mask_high / dppo_mask_low); plus ratio_penalty_coef (lp_t - base_t)^2 on
            every unmasked token, kept or not (prime-rl's kl_tau); clip_frac is then the masked share).
        ratio_penalty_coef: prime_rl's weight of its squared log-ratio penalty (>= 0; prime-rl's kl_tau, 1e-3).
        ratio_cap: None or c > 0: DPPO's cap on its ratio weight (verl's clip_ratio_c).
            policy "clip_cov" / "kl_cov" (verl's Clip-Cov and KL-Cov): with cov_t = (A_t - mean A)(lp_t - mean lp)
            over the batch's unmasked tokens (lp current, detached), "kl_cov" takes the unclipped s_t = r_t A_t
            and, at the max(1, int(n cov_ratio)) tokens of largest cov_t (exactly equal cov_t: the lower token
            index first, the row order of the flattened [N] tokens; verl's torch.topk leaves the order of ties
            unspecified, so only there can its choice differ), adds -cov_kl_coef |lp_t - base_t| to
            it; "clip_cov" takes the PPO surrogate and zeroes it at a random subset (torch.randperm on the CPU's
            default generator, as verl draws it: seed torch to reproduce verl's choice) of
            max(1, int(n cov_ratio)) of the unclipped tokens with cov_bounds[0] < cov_t < cov_bounds[1].
            Needs the stats pass (the selection is over every token). Metric "cov_selected_frac".
        cov_ratio: fraction of the unmasked tokens the Cov policies select (verl's kl_cov_ratio /
            clip_cov_ratio, 0.0002 by default); cov_bounds: clip_cov's (clip_cov_lb, clip_cov_ub);
            cov_kl_coef: kl_cov's ppo_kl_coef. cov_seed: None (clip_cov draws from torch's default CPU generator,
            as verl) or an int seeding a generator of its own on each call (the same draw every time).
        sapo_tau_pos, sapo_tau_neg: SAPO's gate temperatures (> 0; verl's and TRL's defaults 1.0 and 1.05).
        vespo_k_pos, vespo_lambda_pos, vespo_k_neg, vespo_lambda_neg: VESPO's gamma parameters (TRL's defaults
            2, 3, 3, 2; lambda is floored at 1e-4 as TRL does).
        ratio_ref: PPO ratio denominator: "old" (old_logprobs, or the detached current logprob when
            old_logprobs is None), "sampler" (sampler_logprobs) or "loglinear": AReaL's proximal-policy approximation
            (prox_logp_method="loglinear"), the old logprob formed from the detached current one,
            old_t = samp_t + alpha_t (lp_t - samp_t), alpha_t = clamp((v - 1 - v_t) / (v - v_t), 0, 1) where
            v_t >= 0 and v > v_t, else 0 (v_t: the `versions=` of the policy that sampled token t, v:
            `current_version=`); it stands for old_logprobs (which must be None) in the ratio, the IS weight and
            the metrics, formed in the kernel (no proximal forward pass). Needs sampler_logprobs.
        ratio_level: "token" (r_t = exp(lp_t - base_t)) or "sequence" (GSPO, PPO only: every token of a
            sequence takes s_i = exp(mean over its unmasked tokens of lp - base), clipped as a whole, with the
            gradient through every token's lp; verl gspo, TRL/Liger importance_sampling_level="sequence").
        sequence_log_ratio_max: None or c > 0, ratio_level="sequence" only: GSPO's log s_i is clamped from above
            at c before exp, with zero gradient strictly beyond (torch.clamp's): a sequence whose mean log ratio
            exceeds c takes s_i = e^c and no policy gradient (verl's gspo clamps at 10; OpenRLHF and TRL do not).
        clip_low, clip_high: PPO clip range [1 - clip_low, 1 + clip_high]; 0 <= clip_low <= 1, clip_high >= 0.
        dual_clip: None or c > 1; for A < 0 the surrogate is bounded below by c * A.
        log_ratio_clamp: None or c > 0: the PPO log ratio lp - base is clamped to [-c, c] before exp, with
            zero gradient beyond (verl and OpenRLHF clamp at 20).
        is_level: importance weight level: "none", "token", "sequence" or "geometric".
        is_mode: "truncate" (TIS), "mask" (MIS), "reject" (0/1 weights) or "raw" (plain IS).
        is_cap: upper bound of the IS weight (> 0, may be inf); is_floor: None or 0 <= floor <= cap.
        temperature: tau >= 1e-8 (MIN_TEMPERATURE); logprobs and entropy are those of softmax(logits / tau).
        entropy_coef, kl_coef: weights of the entropy bonus and of the KL to ref_logprobs.
        kl_type: "k1", "k2" or "k3" estimator of KL(learner || ref); "k1+" / "k3+": the value of k1 / k3 with
            the gradient of k2 (verl's straight-through estimators).
        kl_clamp: None or c > 0: the KL estimator's value clamped to [-c, c], zero gradient beyond (k2's for
            "k1+"/"k3+"); verl clamps k3 at 10, OpenRLHF every estimator at 10.
        kl_weight: what multiplies the KL term, one of KL_WEIGHTS:
            "none": the estimator alone.
            "ratio": times the ratio r = exp(lp - base) with its gradient, after kl_clamp (TRL's
            use_bias_correction_kl; base is the PPO ratio's base, old_logprobs for REINFORCE). Not with
            ratio_level="sequence" (TRL weights by the sequence ratio there, not built).
            "score": times exp(lp - sg(lp)), 1 in value: its gradient gains the estimator's value (the
            score-function term of a KL estimated on the learner's own samples; NeMo-RL's reference-policy KL),
            and is 0 where kl_clamp binds. Not with "k1+"/"k3+".
            "sampler": times w = exp(lp - sampler_logprobs) with its gradient, before kl_clamp: the learner's KL
            estimated on the sampler's tokens (NeMo-RL's use_on_policy_kl_approximation); d/dlp gains w times the
            estimator's value; w is 0 where it overflows fp32 (lp - samp > ln FLT_MAX). Needs sampler_logprobs
            (when kl_coef != 0); not with "k1+"/"k3+".
        kl_ratio_weighted, kl_score, kl_sampler_weight: deprecated spellings of kl_weight="ratio", "score" and
            "sampler" (they were three exclusive booleans). True warns (DeprecationWarning) and sets kl_weight;
            two of them, or one with another kl_weight, is a ValueError. They are consumed when the config is
            built and then read False whatever kl_weight says: the weight lives in kl_weight alone, so
            `==`, hashing, dataclasses.replace(cfg, kl_weight=...) and a JSON round trip (dataclasses.asdict)
            see one spelling and never a stale boolean. Read kl_weight.
        kl_input_clamp: None or c > 0: the log ratio lp - ref clamped to [-c, c] before the estimator, whose gradient
            is 0 where it binds, the "score" and "sampler" weights' terms included (NeMo-RL's kl_input_clamp_value).
            Not with "k1+"/"k3+".
        loss_agg: aggregation over tokens and sequences (see DESIGN.md section 2).
        norm_length: divisor of "seq-mean-token-sum-norm"; None means the padded length T.
        head_dtype: None, or the dtype of the sampler's lm_head output ("bfloat16", "float16", "float32"):
            head-precision replay, the learner's logits rounded to it before the softmax, as the sampler's were
            (the gradient passes the rounding unchanged). For float32 or float64 logits; logits already of that
            dtype are left as they are. The `head_dtype=` argument of policy_loss does the same per call.
        rejection: rejection criteria applied before the loss, as verl's rollout_rs (a second correction
            beside any IS weight): {option: bound} (or (option, bound) pairs), every criterion must pass.
            Options (verl's names): "token_k1", "token_k2", "token_k3" per token; "seq_sum_*", "seq_mean_*" of
            those over the sequence's unmasked tokens; "seq_max_k2", "seq_max_k3". With d_t = old_t - samp_t
            clamped to +-20: k1 = -d_t (= log pi_sampler / pi_old, verl's sign), k2 = d_t^2 / 2,
            k3 = exp(d_t) - 1 - d_t. k1 options take (low, high) bounds on the ratio (kept when
            log low <= k1 <= log high; one number x >= 1 is [1/x, x], as in verl), the others an upper bound
            (kept when <= bound). OpenRLHF's gates on the sampled token's probability, p = exp(samp_t) and
            q = exp(old_t) each clamped to [1e-6, 1 - 1e-6]: "token_binary_kl" / "seq_mean_binary_kl"
            (p log(p/q) + (1-p) log((1-p)/(1-q))) and "token_tv" / "seq_mean_tv" (|p - q|), upper bounds.
            Needs sampler_logprobs and old_logprobs. Metric "rejected_frac".
        rejection_counts: "drop" (verl's modified response mask: a rejected token leaves the mask, it counts in
            no term and in no token or sequence count) or "keep" (OpenRLHF's is_correction mask: the policy
            term of a rejected token is multiplied by 0, the KL and entropy terms and every count unchanged).
        entropy_agg: None (the entropy term aggregates as loss_agg) or one of the loss_agg modes for the
            entropy term alone (TRL takes the entropy bonus as a token mean whatever its loss type); its count
            can be replaced by the `entropy_normalizer=` argument as `normalizer=` replaces the loss's.
        off_policy_mask: None or delta: TRL's off-policy sequence mask (off_policy_mask_threshold): the policy
            term of a sequence is dropped (multiplied by 0, the counts unchanged) when A_t < 0 and the mean over
            its unmasked tokens of samp_t - lp_t (current lp, detached; old_logprobs stand in for
            samp when sampler_logprobs is None) exceeds delta. Needs the stats pass. Metric
            "off_policy_masked_frac".
        m2_threshold: None or t > 0: M2PO's second-moment trust region (AReaL's m2_threshold): over the call's
            unmasked tokens, delta_t = samp_t - old_t (behaviour minus proximal logprob), the tokens of largest
            delta^2 leave the mask (and every count) until the mean delta^2 of the rest is below t, at least one
            kept; equal delta^2 leave in token order, the earlier first (the same tokens on every backend). Before
            LossConfig.rejection. Needs sampler_logprobs and old_logprobs; not with a sequence_group. Metrics
            "m2po_masked_frac" and "m2po_m2" (the mean delta^2 before masking).
        score_centering: None, "proportional" or "calibrated": score centering (arXiv 2609.20807; fused_is/
            centering.py): the sampler's expected score, from its top-K logprobs (the `sampler_topk=` argument)
            with the rest of its mass spread like the learner's distribution, subtracted from each token's score,
            which removes the drift toward the sampler of off-policy updates. "proportional": the score
            g_t (e_y - p) becomes g_t (e_y - q~) (q~ the sampler's distribution so completed), any IS weight
            inside g_t. "calibrated": the IS-weighted expectation, as the SkyRL and Miles implementations weigh
            it: each j of the sampler's support weighted by f(p_j / q_j), f the config's IS weight (truncate,
            mask, ...); needs policy="reinforce" with is_level="token", old_logprobs=None (the weight of the
            current policy against the sampler) and kl_coef=0. The loss's value gains the implementations'
            centering term (its gradient is the subtraction). Metrics "centering_sampler_tail",
            "centering_learner_tail" (mass outside the top-K), "centering_c" (their ratio) and
            "centering_drift_l1" (the size of what is subtracted).
        distill_kind: None, "forward_kl", "reverse_kl" or "jsd": on-policy distillation in the same loss
            (`policy_loss(..., teacher_logits=u)`): loss = the policy loss + distill_coef * the same aggregation of
            D_t, the divergence between the teacher's softmax(u / tau) and the student's softmax(z / tau) over the
            full vocabulary, as fused_is.distill_loss defines it (TRL's generalized JSD with distill_beta; beta 0 and
            1 are the two KLs). Metric "distill_mean".
        distill_beta: the generalized JSD's beta (kind "jsd"), in [0, 1].
        distill_coef: the weight of the distillation term (finite).
    """

    policy: str = "ppo"
    ratio_ref: str = "old"
    ratio_level: str = "token"
    clip_low: float = 0.2
    clip_high: float = 0.2
    dual_clip: Optional[float] = None
    ratio_cap: Optional[float] = None
    cov_ratio: float = 0.0002
    cov_bounds: tuple = (1.0, 5.0)
    cov_kl_coef: float = 0.1
    cov_seed: Optional[int] = None
    log_ratio_clamp: Optional[float] = None
    is_level: str = "token"
    is_mode: str = "truncate"
    is_cap: float = 2.0
    is_floor: Optional[float] = None
    temperature: float = 1.0
    entropy_coef: float = 0.0
    kl_coef: float = 0.0
    kl_type: str = "k3"
    kl_clamp: Optional[float] = None
    sapo_tau_pos: float = 1.0
    sapo_tau_neg: float = 1.05
    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0
    kl_weight: str = "none"
    # deprecated (kl_weight above): read False once built, left out of ==, hash and repr
    kl_ratio_weighted: bool = dataclasses.field(default=False, compare=False, repr=False)
    kl_score: bool = dataclasses.field(default=False, compare=False, repr=False)
    kl_sampler_weight: bool = dataclasses.field(default=False, compare=False, repr=False)
    kl_input_clamp: Optional[float] = None
    loss_agg: str = "token-mean"
    norm_length: Optional[int] = None
    rejection: tuple = ()
    rejection_counts: str = "drop"
    off_policy_mask: Optional[float] = None
    m2_threshold: Optional[float] = None
    entropy_agg: Optional[str] = None
    sequence_log_ratio_max: Optional[float] = None
    ratio_penalty_coef: float = 0.0
    head_dtype: Optional[str] = None
    score_centering: Optional[str] = None
    distill_kind: Optional[str] = None
    distill_beta: float = 0.5
    distill_coef: float = 1.0

    def __post_init__(self) -> None:
        _check_choice("kl_weight", self.kl_weight, KL_WEIGHTS)
        self._take_deprecated_kl_flags()  # first: every check below reads kl_weight alone
        _check_choice("policy", self.policy, POLICIES)
        if self.head_dtype is not None:
            _check_choice("head_dtype", self.head_dtype, HEAD_DTYPES)
        _check_choice("ratio_ref", self.ratio_ref, RATIO_REFS)
        _check_choice("ratio_level", self.ratio_level, RATIO_LEVELS)
        row = policy_table.policy(self.policy)
        if self.ratio_level == "sequence" and not row.sequence_ratio:
            takes = [p.name for p in policy_table.POLICIES.values() if p.sequence_ratio]
            raise ValueError(f"LossConfig.ratio_level='sequence' (GSPO) needs policy={' / '.join(map(repr, takes))}; "
                             f"got {self.policy!r}")
        if self.ratio_level == "sequence" and self.kl_weight == "ratio":
            raise refused("kl_ratio/sequence")
        _check_choice("is_level", self.is_level, IS_LEVELS)
        _check_choice("is_mode", self.is_mode, IS_MODES)
        _check_choice("kl_type", self.kl_type, KL_TYPES)
        _check_choice("loss_agg", self.loss_agg, LOSS_AGGS)
        if self.entropy_agg is not None:
            _check_choice("entropy_agg", self.entropy_agg, LOSS_AGGS)
        set_ = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731 (frozen)
        set_("clip_low", _as_float("clip_low", self.clip_low))
        set_("clip_high", _as_float("clip_high", self.clip_high))
        self._check_policy_parameters(set_)
        set_("log_ratio_clamp", _as_float("log_ratio_clamp", self.log_ratio_clamp, allow_none=True))
        if self.log_ratio_clamp is not None and not row.log_ratio_clamp:
            raise ValueError(f"LossConfig.log_ratio_clamp with policy={self.policy!r}: its source does not clamp the "
                             "log ratio (set it to None)")
        if self.ratio_ref not in row.ratio_refs:
            raise ValueError(f"LossConfig.policy={self.policy!r} takes ratio_ref in {row.ratio_refs}; got "
                             f"{self.ratio_ref!r}")
        set_("sequence_log_ratio_max", _as_float("sequence_log_ratio_max", self.sequence_log_ratio_max,
                                                 allow_none=True))
        if self.sequence_log_ratio_max is not None and (self.sequence_log_ratio_max <= 0.0
                                                        or self.ratio_level != "sequence"):
            raise ValueError(f"LossConfig.sequence_log_ratio_max must be None or > 0, and applies to "
                             f"ratio_level='sequence' (GSPO) only; got {self.sequence_log_ratio_max} with "
                             f"ratio_level={self.ratio_level!r}")
        set_("is_cap", _as_float("is_cap", self.is_cap, allow_inf=True))
        set_("is_floor", _as_float("is_floor", self.is_floor, allow_none=True))
        set_("temperature", _as_float("temperature", self.temperature))
        set_("entropy_coef", _as_float("entropy_coef", self.entropy_coef))
        set_("kl_coef", _as_float("kl_coef", self.kl_coef))
        set_("kl_clamp", _as_float("kl_clamp", self.kl_clamp, allow_none=True))
        if self.kl_clamp is not None and self.kl_clamp <= 0.0:
            raise ValueError(f"LossConfig.kl_clamp must be None or > 0; got {self.kl_clamp}")
        if self.kl_weight in ("score", "sampler") and self.kl_type.endswith("+"):
            # both weights add the estimator's value to its gradient before the clamp; a straight-through kl_type
            # replaces that whole gradient by k2's, so the weight's term would be silently dropped
            raise refused("kl_weight/straight_through", weight=self.kl_weight, kl_type=self.kl_type)
        set_("kl_input_clamp", _as_float("kl_input_clamp", self.kl_input_clamp, allow_none=True))
        if self.kl_input_clamp is not None and self.kl_input_clamp <= 0.0:
            raise ValueError(f"LossConfig.kl_input_clamp must be None or > 0; got {self.kl_input_clamp}")
        if self.kl_input_clamp is not None and self.kl_type.endswith("+"):
            raise refused("kl_input_clamp/straight_through", kl_type=self.kl_type)
        if not 0.0 <= self.clip_low <= 1.0:
            raise ValueError(f"LossConfig.clip_low must be in [0, 1]; got {self.clip_low}")
        if self.clip_high < 0.0:
            raise ValueError(f"LossConfig.clip_high must be >= 0; got {self.clip_high}")
        if self.log_ratio_clamp is not None and self.log_ratio_clamp <= 0.0:
            raise ValueError(f"LossConfig.log_ratio_clamp must be None or > 0; got {self.log_ratio_clamp}")
        if self.is_cap <= 0.0:
            raise ValueError(f"LossConfig.is_cap must be > 0; got {self.is_cap}")
        if self.is_floor is not None and not 0.0 <= self.is_floor <= self.is_cap:
            raise ValueError(
                f"LossConfig.is_floor must be None or in [0, is_cap={self.is_cap}]; got {self.is_floor}"
            )
        if not self.temperature >= MIN_TEMPERATURE:
            raise ValueError(f"LossConfig.temperature must be >= {MIN_TEMPERATURE:g}; got {self.temperature}")
        set_("rejection", _rejection_criteria(self.rejection))
        _check_choice("rejection_counts", self.rejection_counts, REJECTION_COUNTS)
        if self.rejection_counts == "keep" and not self.rejection:
            raise ValueError("LossConfig.rejection_counts='keep' needs rejection criteria (LossConfig.rejection)")
        set_("off_policy_mask", _as_float("off_policy_mask", self.off_policy_mask, allow_none=True))
        if self.score_centering is not None:
            _check_choice("score_centering", self.score_centering, SCORE_CENTERINGS)
            row = policy_table.policy(self.policy)
            plain = not row.ratio and row.weight is None and row.penalty is None  # s = A lp, weighed by W alone
            if self.score_centering == "calibrated" and (not plain or self.is_level != "token" or self.kl_coef != 0.0):
                raise ValueError("LossConfig.score_centering='calibrated' weighs the sampler's support by the token "
                                 "IS weight of the current policy: it needs the REINFORCE surrogate (policy="
                                 "'reinforce'), is_level='token' and kl_coef=0 (got policy="
                                 f"{self.policy!r}, is_level={self.is_level!r}, kl_coef={self.kl_coef}); "
                                 "score_centering='proportional' takes any policy")
            if self.score_centering == "calibrated" and self.ratio_ref == "loglinear":
                raise refused("calibrated/loglinear")
        set_("distill_beta", _as_float("distill_beta", self.distill_beta))
        set_("distill_coef", _as_float("distill_coef", self.distill_coef))
        if self.distill_kind is not None:
            _check_choice("distill_kind", self.distill_kind, DISTILL_KINDS)
        elif self.distill_beta != 0.5 or self.distill_coef != 1.0:
            raise ValueError("LossConfig.distill_beta / distill_coef set without distill_kind: set distill_kind to "
                             f"one of {DISTILL_KINDS} (and pass teacher_logits=)")
        if not 0.0 <= self.distill_beta <= 1.0:
            raise ValueError(f"LossConfig.distill_beta must be in [0, 1]; got {self.distill_beta}")
        if not math.isfinite(self.distill_coef):
            raise ValueError(f"LossConfig.distill_coef must be finite; got {self.distill_coef}")
        set_("m2_threshold", _as_float("m2_threshold", self.m2_threshold, allow_none=True))
        if self.m2_threshold is not None and not (0.0 < self.m2_threshold < math.inf):
            raise ValueError(f"LossConfig.m2_threshold must be None or a finite value > 0; got {self.m2_threshold}")
        if self.norm_length is not None:
            if isinstance(self.norm_length, bool) or not isinstance(self.norm_length, numbers.Integral):
                raise TypeError(f"LossConfig.norm_length must be None or an int; got {self.norm_length!r}")
            if self.norm_length <= 0:
                raise ValueError(f"LossConfig.norm_length must be > 0; got {self.norm_length}")
            set_("norm_length", int(self.norm_length))

    def _take_deprecated_kl_flags(self) -> None:
        """kl_weight from the deprecated booleans (DEPRECATED_KL_WEIGHT_FLAGS): a True one warns and sets the
        kl_weight it stands for; two of them, or one with another kl_weight, is a ValueError naming both. Each is
        then reset to False, so that a built config holds the weight in kl_weight alone (`dataclasses.replace`
        passes every field on: a boolean left True would fight a new kl_weight there)."""
        given = []
        for name, weight in DEPRECATED_KL_WEIGHT_FLAGS.items():
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise TypeError(f"LossConfig.{name} (deprecated, use kl_weight={weight!r}) must be a bool; "
                                f"got {value!r}")
            if value:
                given.append(name)
        if len(given) > 1:
            raise ValueError(f"LossConfig.{' and '.join(given)} are set together, but the KL term takes one weight: "
                             f"set kl_weight to one of {KL_WEIGHTS} instead (the booleans are deprecated)")
        if not given:
            return
        name, weight = given[0], DEPRECATED_KL_WEIGHT_FLAGS[given[0]]
        if self.kl_weight not in ("none", weight):
            raise ValueError(f"LossConfig.{name}=True (deprecated: kl_weight={weight!r}) conflicts with "
                             f"kl_weight={self.kl_weight!r}; set kl_weight alone")
        # stacklevel 4: this method, __post_init__, the generated __init__, then the line that built the config
        warnings.warn(f"LossConfig.{name}=True is deprecated; use kl_weight={weight!r}", DeprecationWarning,
                      stacklevel=4)
        object.__setattr__(self, "kl_weight", weight)  # frozen: as the checks below set their converted fields
        object.__setattr__(self, name, False)

    def _check_policy_parameters(self, set_) -> None:
        """Every policy parameter of the table (fused_is/policies.py) converted and checked by its row's spec; one
        that belongs to other policies must keep its default here."""
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        for name, spec in policy_table.PARAMETERS.items():
            value = _convert(spec.kind, name, getattr(self, name))
            set_(name, value)
            if not spec.valid(value):
                raise ValueError(f"LossConfig.{name} {spec.rule}; got {value!r}")
            owners = policy_table.OWNERS[name]
            if self.policy not in owners and value != defaults[name]:
                raise ValueError(f"LossConfig.{name} applies to policy={' / '.join(map(repr, owners))} only; got "
                                 f"policy={self.policy!r}")

    @property
    def needs_sampler_logprobs(self) -> bool:
        """True when the loss reads sampler_logprobs (an IS level, or the PPO ratio against the sampler)."""
        return (self.is_level != "none" or (not self.reinforce_surrogate and self.ratio_ref == "sampler")
                or bool(self.rejection) or self.ratio_ref == "loglinear")

    @property
    def coefficients_given(self) -> bool:
        """True when g_t is formed in float64 after a stats pass and handed to the kernels per row: GSPO and
        GMPO (it depends on the whole sequence), every policy the table gives no kernel branch (DPPO,
        Clip-Cov and KL-Cov, prime_rl: one more read of the logits, no kernel code)."""
        return self.sequence_ratio or policy_table.policy(self.policy).kernel is None

    @property
    def reinforce_surrogate(self) -> bool:
        """True when the surrogate is A * lp (REINFORCE, and VESPO, whose gamma weight multiplies it)."""
        return not policy_table.policy(self.policy).ratio

    @property
    def sequence_ratio(self) -> bool:
        """True when a token's ratio depends on the lp of its whole sequence (GSPO, GMPO): the plan then
        forms g_t from a stats pass and hands it to the kernels (coefficients.given_coefficients)."""
        return self.ratio_level == "sequence" or policy_table.policy(self.policy).sequence is not None

    @property
    def is_floor_value(self) -> float:
        """The effective IS floor: is_floor, or 0 when unset (truncate then has no lower bound)."""
        return 0.0 if self.is_floor is None else self.is_floor

    @classmethod
    def preset(cls, name: str, **overrides) -> "LossConfig":
        """Build the preset `name` (a key of `PRESETS`), then apply `overrides` (field=value)."""
        if not isinstance(name, str) or name not in _PRESETS:
            raise ValueError(f"config: unknown preset {name!r}; expected one of {sorted(_PRESETS)}")
        unknown = set(overrides) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"LossConfig has no field(s) {sorted(unknown)}")
        return dataclasses.replace(_PRESETS[name], **overrides)


# DESIGN.md section 2, "The seed's estimators as presets": each row sets only the fields in the table.
_PRESETS = {
    "reinforce": LossConfig(policy="reinforce", is_level="none"),
    "reinforce_tis": LossConfig(policy="reinforce", is_level="token", is_mode="truncate", is_cap=2.0),
    "ppo": LossConfig(policy="ppo", ratio_ref="old", is_level="none"),
    "ppo_tis": LossConfig(policy="ppo", ratio_ref="old", is_level="token", is_mode="truncate", is_cap=2.0),
    "ppo_is": LossConfig(policy="ppo", ratio_ref="sampler", is_level="none"),
    "vanilla_is": LossConfig(policy="ppo", ratio_ref="old", is_level="token", is_mode="raw"),
    "seq_is": LossConfig(policy="reinforce", is_level="sequence", is_mode="raw"),
    "seq_tis": LossConfig(policy="ppo", ratio_ref="old", is_level="sequence", is_mode="truncate", is_cap=2.0),
    "token_mis": LossConfig(policy="ppo", ratio_ref="old", is_level="token", is_mode="mask", is_cap=2.0),
    "seq_mis": LossConfig(policy="ppo", ratio_ref="old", is_level="sequence", is_mode="mask", is_cap=2.0),
    "mis_ppo_token": LossConfig(
        policy="ppo", ratio_ref="sampler", is_level="token", is_mode="reject", is_cap=2.0
    ),
    "mis_ppo_seq": LossConfig(
        policy="ppo", ratio_ref="sampler", is_level="sequence", is_mode="reject", is_cap=2.0
    ),
    "geo_mis": LossConfig(
        policy="ppo", ratio_ref="old", is_level="geometric", is_mode="reject", is_cap=1.001, is_floor=0.999
    ),
}

#: The seed's 13 estimators (DESIGN.md section 2).
SEED_PRESET_NAMES = tuple(_PRESETS)

# DESIGN.md section 7: each trainer policy as a preset named after it, with its source's defaults; no IS weight
# (compose one with is_level / is_mode overrides, as with the seed's presets).
_PRESETS.update({
    # GSPO paper, verl's GSPO recipe, TRL's docs: the sequence ratio, clip range [1 - 3e-4, 1 + 4e-4]
    "gspo": LossConfig(ratio_level="sequence", is_level="none", clip_low=3e-4, clip_high=4e-4,
                       loss_agg="seq-mean-token-mean"),
    # GMPO paper / verl geo_mean: log ratios clipped at +-0.4, one geometric mean per sequence
    "gmpo": LossConfig(policy="gmpo", is_level="none", clip_low=0.4, clip_high=0.4, loss_agg="seq-mean-token-mean"),
    # SAPO paper, verl and TRL: tau 1.0 (A > 0), 1.05 (else); verl aggregates it per sequence
    "sapo": LossConfig(policy="sapo", is_level="none", loss_agg="seq-mean-token-mean"),
    # CISPO as TRL recommends it (ScaleRL): the ratio weight capped at epsilon_high = 5, no lower bound
    "cispo": LossConfig(policy="cispo", is_level="none", clip_low=1.0, clip_high=4.0),
    # verl's DPPO with its ActorConfig defaults: clip_ratio 0.2 as the trust region, clip_ratio_c = 3 as the cap
    "dppo_tv": LossConfig(policy="dppo_tv", is_level="none", ratio_cap=3.0, log_ratio_clamp=20.0),
    "dppo_kl": LossConfig(policy="dppo_kl", is_level="none", ratio_cap=3.0, log_ratio_clamp=20.0),
    # verl's Clip-Cov and KL-Cov with its PolicyLossConfig defaults
    "clip_cov": LossConfig(policy="clip_cov", is_level="none"),
    "kl_cov": LossConfig(policy="kl_cov", is_level="none"),
    # TRL's VESPO with its defaults (k 2 / 3, lambda 3 / 2)
    "vespo": LossConfig(policy="vespo", is_level="none"),
    # prime-rl's default loss with its defaults: dppo_mask_low = dppo_mask_high = 0.2, kl_tau = 1e-3, the ratio
    # against the inference engine's logprobs, normalised by the step's token count
    "prime_rl": LossConfig(policy="prime_rl", ratio_ref="sampler", is_level="none", clip_low=0.2, clip_high=0.2,
                           ratio_penalty_coef=1e-3),
})
TRAINER_PRESET_NAMES = tuple(name for name in _PRESETS if name not in SEED_PRESET_NAMES)

#: The presets, name -> LossConfig (read-only): the seed's 13 estimators (DESIGN.md section 2) and one per
#: trainer policy (section 7).
PRESETS: Mapping[str, LossConfig] = types.MappingProxyType(_PRESETS)


def resolve_config(config) -> LossConfig:
    """A LossConfig from a preset name or a LossConfig; anything else is a TypeError naming `config`."""
    if isinstance(config, LossConfig):
        return config
    if isinstance(config, str):
        if config not in _PRESETS:
            raise ValueError(f"config: unknown preset {config!r}; expected one of {sorted(_PRESETS)}")
        return _PRESETS[config]
    raise TypeError(f"config must be a preset name (str) or a fused_is.LossConfig; got {type(config).__name__}")
