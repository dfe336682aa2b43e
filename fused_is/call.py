"""The call object: a call's arguments checked once and flattened into an immutable `Call`.

`prepare` turns the public arguments (padded [B, T, V] or packed [N, V] + cu_seqlens) into a `Call`: per-token
float64 vectors of length N, the sequence index and the aggregation weight a_t of each token, the layout, the
process groups and the backend, so that every layer below sees one flat layout and takes one object. It raises
ValueError/TypeError naming the argument before anything is computed, and never writes into the caller's
tensors. Per-call caches (values formed once and read by several layers) live in the call's `CallCache`.
"""

from __future__ import annotations

import dataclasses
import numbers
from dataclasses import dataclass
from typing import Optional, Union

import torch

from . import backends, centering, distributed
from . import kept as kept_sets
from .coefficients import m2po_keep, rejection_keep
from .combinations import refused
from .config import DISTILL_KINDS, LossConfig, resolve_config
from .policies import policy
from .reductions import all_reduce, sequence_sum
from .validate import (Checks, PerToken, Temperature, call_temperature, check_backend, check_inplace,
                       check_logits_tokens, check_loss_scale, check_normalizer, check_teacher_logits, check_token_range,
                       check_validate, flat_mask, per_token_inputs, rounding_dtype, row_temperature, sequence_index)


class CallCache:
    """Values formed once per call and read by several layers (the call itself is immutable)."""

    def __init__(self):
        # (W, masked, truncated) of coefficients.full_is_weight when they do not depend on the current lp (the
        # row table and the metrics read them)
        self.is_weight_parts: Optional[tuple] = None
        # Clip-Cov / KL-Cov: [N] float64 1/0, the tokens selected from the current lp (coefficients.cov_selection),
        # so that the gradient and the loss see the same (for clip_cov, random) selection
        self.cov_selected: Optional[torch.Tensor] = None
        # LossConfig.score_centering: the per-row quantities of fused_is/centering.py, from the stats pass
        self.centering = None
        # LossConfig.distill_kind: D_t float64 [N] of the distillation term (0 at masked rows), from its stats sweep
        self.distill = None


@dataclass(frozen=True)
class Call:
    """One call, validated: the inputs flattened to N rows, the derived weights, the layout and the groups.
    Immutable; built once by `prepare` at the front door and read by every layer below. Per-token vectors are
    float64 (O(N) memory); masked positions hold 0. Per-call caches live in `cache` (a CallCache)."""

    logits: torch.Tensor  # the caller's logits, [B, T, V] or [N, V], untouched
    token_shape: torch.Size  # shape of tokens, [B, T] or [N]
    tokens: torch.Tensor  # [N] int64; out-of-range ids at masked positions replaced by 0
    advantages: torch.Tensor  # [N] float64
    sampler_logprobs: Optional[torch.Tensor]  # [N] float64 or None
    old_logprobs: Optional[torch.Tensor]
    ref_logprobs: Optional[torch.Tensor]
    mask: torch.Tensor  # [N] float64 in {0, 1}
    seq_index: torch.Tensor  # [N] int64, sequence of each token
    num_seqs: int  # number of sequences (rows of padded input, or len(cu_seqlens) - 1)
    seq_token_count: torch.Tensor  # [num_seqs] float64, unmasked tokens per sequence
    agg_weight: torch.Tensor  # [N] float64, a_t: loss = sum_t a_t * L_t
    config: LossConfig
    normalizer: Optional[Union[float, torch.Tensor]]  # replaces the token / sequence count (0-d tensor: async)
    # divisor of seq-mean-token-sum-norm (resolved: padded T by default; a 0-d tensor with a sequence_group)
    norm_length: Optional[Union[int, torch.Tensor]]
    validate: str = "full"  # VALIDATE
    # vocabulary parallel (fused_is/distributed.py): the process group over whose ranks the vocabulary is split,
    # and where this rank's shard (the logits' last dimension) starts in the global ids that tokens hold
    vocab_group: Optional[object] = None
    vocab_start: int = 0
    # LossConfig.rejection: [N] float64, 1 at the tokens the criteria rejected from the caller's mask (else None)
    rejected: Optional[torch.Tensor] = None
    # ratio_ref="loglinear": [N] float64 alpha_t of AReaL's proximal approximation old = samp + alpha (lp - samp)
    proximal_alpha: Optional[torch.Tensor] = None
    # LossConfig.m2_threshold: [N] float64 1/0, the caller's mask M2PO ranked, and the tokens it dropped (else None)
    m2po_ranked: Optional[torch.Tensor] = None
    m2po_dropped: Optional[torch.Tensor] = None
    # rejection_counts="keep": [N] float64 1/0 multiplying the policy term (the mask keeps the rejected tokens)
    rejection_gate: Optional[torch.Tensor] = None
    # the caller's IS weights W_t ([N] float64, masked positions 0), in place of the config's is_level
    is_weights: Optional[torch.Tensor] = None
    # e_t: the entropy term's aggregation weight, loss += sum_t e_t (-entropy_coef H_t) (None: agg_weight)
    entropy_weight: Optional[torch.Tensor] = None
    entropy_normalizer: Optional[Union[float, torch.Tensor]] = None  # replaces entropy_agg's count
    # context parallel (fused_is/distributed.py): the process group over whose ranks each sequence's tokens are
    # split; every per-sequence reduction and every total (the loss, the metrics) is all-reduced over it
    sequence_group: Optional[object] = None
    # per-row temperatures tau_t ([N] float64, positive and finite) in place of LossConfig.temperature (verl's
    # per-sample temperature); None: the config's one value for every row
    row_temperature: Optional[torch.Tensor] = None
    # bool [N]: mask > 0, the tokens that count (formed once: every masked select and mean reads it)
    valid: Optional[torch.Tensor] = None
    # the concrete backend that runs the call ("cpu", "cuda", "triton", "torch"; "reference" for the oracle)
    backend: str = "torch"
    # the sampler's kept set per row (int64 [N, K], -1 = no entry): lp, H and the gradient over it (fused_is/kept.py)
    kept: Optional[torch.Tensor] = None
    # the caller's constant factor of the loss (1 / accumulation steps, a loss scaler's scale), already in agg_weight
    # and entropy_weight: the kernels write the scaled gradient in their one sweep
    loss_scale: float = 1.0
    # head-precision replay: the dtype the logits are rounded to before the softmax (None: not rounded)
    head_rounding: Optional[torch.dtype] = None
    # LossConfig.score_centering: the sampler_topk argument checked, ids and logprobs per row (centering.SamplerTopK)
    centering_topk: Optional[object] = None
    # LossConfig.distill_kind: the teacher's logits, the student's shape, read only (None: no distillation term)
    teacher: Optional[torch.Tensor] = None
    cache: "CallCache" = dataclasses.field(default_factory=lambda: CallCache(), repr=False, compare=False)

    def __post_init__(self):
        if self.valid is None:
            object.__setattr__(self, "valid", self.mask > 0)

    @property
    def temperature(self) -> "Temperature":
        """tau of every row: the config's float, or the per-row float64 [N] tensor."""
        return self.config.temperature if self.row_temperature is None else self.row_temperature

    def seq_sum(self, x: torch.Tensor) -> torch.Tensor:
        """[num_seqs] sums of the per-token x over each sequence (over every rank of sequence_group)."""
        return sequence_sum(x, self.seq_index, self.num_seqs, self.sequence_group)

    def total(self, x: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """A batch total (a 0-d sum, max or min) over every rank of sequence_group."""
        return all_reduce(x, self.sequence_group, op)

    @property
    def entropy_weights(self) -> torch.Tensor:
        """e_t, [N] float64: LossConfig.entropy_agg's aggregation weight, or a_t when it is unset."""
        return self.agg_weight if self.entropy_weight is None else self.entropy_weight

    @property
    def num_rows(self) -> int:
        """N, the flattened token rows."""
        return self.tokens.numel()

    @property
    def vocab(self) -> int:
        """This call's vocabulary size V (a shard's with vocab_group)."""
        return self.logits.shape[-1]

    def rows(self, rows, logits: torch.Tensor) -> "Call":
        """The rows `rows` (a slice, or int64 indices) as a call of their own whose logits are `logits` ([rows, V]):
        the per-token vectors cut to them, the sequence-level fields (counts, aggregation weights) those of the whole
        batch.
        For the token-local work of one chunk of rows (fused_is/linear.py); whole-batch reductions
        (sequence sums, the loss, the metrics) still need the whole batch."""
        cut = lambda x: None if x is None else x[rows]  # noqa: E731
        return dataclasses.replace(
            self, logits=logits, token_shape=torch.Size([logits.shape[0]]), tokens=self.tokens[rows],
            advantages=self.advantages[rows], sampler_logprobs=cut(self.sampler_logprobs),
            old_logprobs=cut(self.old_logprobs), ref_logprobs=cut(self.ref_logprobs), is_weights=cut(self.is_weights),
            mask=self.mask[rows],
            seq_index=self.seq_index[rows], agg_weight=self.agg_weight[rows],
            entropy_weight=cut(self.entropy_weight), row_temperature=cut(self.row_temperature),
            valid=self.valid[rows], kept=cut(self.kept), proximal_alpha=cut(self.proximal_alpha),
            centering_topk=None if self.centering_topk is None else self.centering_topk.rows(rows), cache=CallCache())



def aggregation_weights(mask, seq_index, num_seqs, seq_count, loss_agg: str, normalizer, norm_length,
                         token_count=None):
    """a_t of DESIGN.md section 2 "Aggregation" for the mode loss_agg: loss = sum_t a_t * L_t; a_t = 0 on masked
    tokens. No host read: the count stays a tensor (an empty batch divides its zeros by 1).
    token_count: the unmasked tokens of the whole batch when it is not mask.sum() (context parallel)."""
    if loss_agg == "token-mean":
        count = mask.sum() if token_count is None else token_count
        per_token = mask
    else:
        count = (seq_count > 0).sum()
        if loss_agg == "seq-mean-token-sum":
            per_token = mask
        elif loss_agg == "seq-mean-token-mean":
            per_token = mask / seq_count.clamp(min=1.0)[seq_index]
        else:  # seq-mean-token-sum-norm
            per_token = mask / norm_length  # an int, or a 0-d tensor (context parallel: no host read)
    if normalizer is not None:  # positive (checked): a float, or a float64 0-d tensor under validate="async"
        return per_token / normalizer
    # an empty batch (count 0) has per_token 0 everywhere: 0 / 1, loss 0, gradient 0 (DESIGN.md section 2)
    return per_token / count.clamp(min=1)


def _checked(default, check):
    """An `Arguments` field whose value `check` refuses by name when the record is made (`Arguments.__post_init__`)."""
    return dataclasses.field(default=default, metadata={"check": check})


@dataclass(frozen=True)
class Arguments:
    """The arguments of one `policy_loss` call as the caller gave them (DESIGN.md section 3 names each): the one
    declaration of the argument list. Its fields, in order, are `FusedPolicyLoss.apply`'s positional arguments after
    the logits (`values`; policy_loss's signature order, compute_grad between sequence_group and temperature, kept
    last); `of` takes them by name from a public signature's parameters; the fields declared `_checked` are checked
    when a record is made (any entry point, eager or traced). `prepare` turns the rest into a `Call`."""

    tokens: object
    advantages: object
    sampler_logprobs: object = None
    old_logprobs: object = None
    ref_logprobs: object = None
    mask: object = None
    cu_seqlens: object = None
    config: object = "ppo_tis"
    normalizer: object = None
    backend: str = _checked("auto", check_backend)
    inplace: object = _checked(False, check_inplace)  # False, True (= "backward") or "forward"
    validate: str = _checked("full", check_validate)
    vocab_group: object = None
    is_weights: object = None
    entropy_normalizer: object = None
    sequence_group: object = None
    compute_grad: bool = True  # False: no gradient (evaluation; under torch.no_grad autograd does not tell forward)
    temperature: object = None
    loss_scale: object = None  # a constant factor of the loss (and its gradient), applied through a_t
    head_dtype: object = None  # the sampler head's output dtype: the logits rounded to it (head-precision replay)
    kept: object = None  # the sampler's kept set: [..., K] ids (-1 = none) or fused_is.SamplerParams
    versions: object = None  # ratio_ref="loglinear": the policy version that sampled each token (int, < 0: prompt)
    current_version: object = None  # ratio_ref="loglinear": the version being trained (an int)
    sampler_topk: object = None  # LossConfig.score_centering: (ids [..., K], logprobs [..., K]) of the sampler's top-K
    teacher_logits: object = None  # LossConfig.distill_kind: the teacher's logits, the logits' shape

    def __post_init__(self):
        for name, check in _FIELD_CHECKS:
            check(getattr(self, name))

    @classmethod
    def of(cls, parameters, **values) -> "Arguments":
        """The record of a public function's parameters (a mapping, e.g. its `locals()` on entry): each field taken
        from `parameters` by name where it is there, else from `values`, else its default."""
        taken = {name: parameters[name] for name in FIELDS if name in parameters}
        taken.update(values)
        return cls(**taken)

    def values(self) -> tuple:
        """The fields in their order: `FusedPolicyLoss.apply`'s positional arguments after the logits."""
        return tuple(getattr(self, name) for name in FIELDS)


FIELDS = tuple(f.name for f in dataclasses.fields(Arguments))  # Arguments' field names, in order
_FIELD_CHECKS = tuple((f.name, f.metadata["check"]) for f in dataclasses.fields(Arguments) if "check" in f.metadata)


def prepare(logits, args: Arguments, shard=None) -> Call:
    """Check every argument of `policy_loss` and flatten it to a `Call` (no kernel runs here): the layout and the
    per-token inputs (`_layout_and_inputs`), what the config requires of them (`_config_requirements`), the
    aggregation weights (`_weights`).
    logits: the call's logits, or a stand-in of their shape, dtype and device (fused linear: never read).
    shard: with args.vocab_group, (start, V) of this rank's vocabulary shard (`distributed.open_shard`, the
    first collective of the call): token ids are global, in [0, V).
    validate="async" checks values with device-side assertions and reads nothing on the host.
    sequence_group: context parallel: this rank holds a slice of the positions of every sequence (padded input:
    rows; packed input: cu_seqlens segments, one per sequence, the same S on every rank); counts and sequence
    reductions are taken over the group.
    temperature: None (LossConfig.temperature), or per-row temperatures as `row_temperature` takes them."""
    start, vocab = (0, None) if shard is None else shard
    cfg = resolve_config(args.config)
    inputs, valid = _layout_and_inputs(logits, args, cfg, vocab)
    norm_length = _config_requirements(logits, args, cfg, inputs)
    weights = _weights(args, cfg, inputs, valid, norm_length, logits.dtype)
    return Call(logits=logits, config=cfg, norm_length=norm_length, validate=args.validate,
                sequence_group=args.sequence_group, vocab_group=args.vocab_group, vocab_start=start,
                backend=backends.resolve(args.backend, logits, sharded=args.vocab_group is not None),
                **inputs, **weights)


def _layout_and_inputs(logits, args: Arguments, cfg: LossConfig, vocab):
    """(the `Call` fields of the layout and the per-token inputs, valid: bool [N] the caller's unmasked tokens): every
    type, shape and value check of the caller's tensors, the values' in one host read (validate="full"; none with
    "async"). vocab: a vocabulary shard's global V, or None."""
    sequence_group = args.sequence_group
    if sequence_group is not None:  # context parallel: sequence reductions over the group
        distributed.check_group(sequence_group, "sequence_group")
        # with vocab_group too (a 2-D grid: tensor parallel x context parallel), the row statistics are reduced
        # over vocab_group and the sequence-level quantities over sequence_group, independently
        if args.vocab_group is not None and args.vocab_group is sequence_group:
            raise ValueError("vocab_group and sequence_group are the same group: on a grid each rank's vocab_group "
                             "holds the shards of its positions, its sequence_group the slices of its shard")
    checks = Checks(args.validate)
    tokens, cu_seqlens, temperature = args.tokens, args.cu_seqlens, args.temperature
    check_logits_tokens(logits, tokens)
    padded = logits.dim() == 3
    token_shape = tokens.shape
    if not isinstance(args.advantages, torch.Tensor):
        raise TypeError(f"advantages must be a floating-point torch.Tensor of shape {tuple(token_shape)}")
    valid = flat_mask(args.mask, token_shape, logits, checks)
    seq_index, num_seqs = sequence_index(cu_seqlens, token_shape, logits, padded, checks)
    ids = check_token_range(tokens, logits.shape[-1] if vocab is None else vocab, valid, checks)
    adv, samp, old, ref, weights = per_token_inputs(
        [PerToken("advantages", args.advantages, allow_per_seq=True),
         PerToken("sampler_logprobs", args.sampler_logprobs, kind="logprob"),
         PerToken("old_logprobs", args.old_logprobs, kind="logprob"),
         PerToken("ref_logprobs", args.ref_logprobs, kind="logprob"),
         PerToken("is_weights", args.is_weights, allow_per_seq=True, kind="nonnegative")],
        token_shape, logits, valid, checks)
    row_tau = None
    if temperature is not None:
        if not isinstance(temperature, torch.Tensor):
            raise TypeError(f"temperature= takes per-sequence or per-token temperatures as a tensor; got "
                            f"{type(temperature).__name__} (one temperature for every row is LossConfig.temperature)")
        if cfg.temperature != 1.0:
            raise ValueError(f"temperature= (per row) replaces LossConfig.temperature, which is also set "
                             f"({cfg.temperature}); leave the config's at 1.0")
        row_tau = row_temperature(temperature, token_shape, logits, valid, checks,
                                  None if padded or cu_seqlens is None else seq_index, num_seqs)
    kept = None
    if args.kept is not None:
        kept = kept_sets.kept_rows(logits, args.kept, token_shape, ids, valid,
                                   cfg.temperature if row_tau is None else row_tau, args.vocab_group, checks)
    normalizer = check_normalizer(args.normalizer, checks)
    entropy_normalizer = check_normalizer(args.entropy_normalizer, checks, "entropy_normalizer")
    alpha = _proximal_alpha(args, cfg, token_shape, valid, checks)
    topk = _sampler_topk(args, cfg, logits, token_shape, valid, checks, samp, old, weights, kept)
    teacher = _teacher(args, cfg, logits, kept)
    # one host read for every value check above (none with validate="async"); under torch.compile the ids come back
    # from the op that reads the flags at run time (fused_is/ops.py `checked`)
    ids = checks.done(gate=ids)
    return dict(token_shape=token_shape, tokens=ids, seq_index=seq_index, num_seqs=num_seqs, advantages=adv,
                sampler_logprobs=samp, old_logprobs=old, ref_logprobs=ref, is_weights=weights, row_temperature=row_tau,
                kept=kept, normalizer=normalizer, entropy_normalizer=entropy_normalizer, proximal_alpha=alpha,
                centering_topk=topk, teacher=teacher), valid


def _teacher(args: Arguments, cfg: LossConfig, logits, kept):
    """The teacher's logits of LossConfig.distill_kind, checked (fused_is.validate.check_teacher_logits), or None; what
    the combined term cannot be taken with yet refused by name."""
    teacher = args.teacher_logits
    linear = logits.stride(-1) == 0  # linear_policy_loss: stand-ins of the logits and of the teacher's
    given = "teacher_hidden= and teacher_weight=" if linear else "teacher_logits="
    if cfg.distill_kind is None:
        if teacher is not None:
            raise ValueError(f"{given} {'are' if linear else 'is'} read by LossConfig.distill_kind only; set "
                             f"distill_kind to one of {DISTILL_KINDS} (or call fused_is."
                             f"{'linear_' if linear else ''}distill_loss for the distillation alone)")
        return None
    if teacher is None:
        raise ValueError(f"LossConfig.distill_kind={cfg.distill_kind!r} needs {given}: the teacher's "
                         f"{'head' if linear else 'logits'} of the same positions")
    check_teacher_logits(teacher, logits)
    for key, given in (("term/linear_vocab_group", linear and args.vocab_group is not None),
                       ("term/linear_kept", linear and kept is not None)):
        if given:
            raise refused(key)
    return teacher


def _sampler_topk(args: Arguments, cfg: LossConfig, logits, token_shape, valid, checks: Checks, samp, old, weights,
                  kept):
    """The sampler's top-K of LossConfig.score_centering, checked (fused_is/centering.py), or None; what the centering
    cannot be combined with refused by name."""
    if cfg.score_centering is None:
        if args.sampler_topk is not None:
            raise ValueError("sampler_topk= is read by LossConfig.score_centering only; set score_centering="
                             "'proportional' or 'calibrated' (or leave sampler_topk out)")
        return None
    if args.sampler_topk is None:
        raise ValueError(f"LossConfig.score_centering={cfg.score_centering!r} needs sampler_topk=(ids, logprobs): the "
                         "sampler's top-K token ids and logprobs per position (vLLM's logprobs=K)")
    if args.vocab_group is not None:
        raise refused("centering/vocab_group")
    if kept is not None:
        raise refused("centering/kept")
    if cfg.score_centering == "calibrated":
        for name, value, why in (("sampler_logprobs", samp is None, "needs"), ("old_logprobs", old is not None,
                                                                               "takes no"),
                                 ("is_weights", weights is not None, "takes no")):
            if value:
                raise ValueError(f"LossConfig.score_centering='calibrated' {why} {name}: it weighs the sampler's "
                                 "support by the IS weight of the current policy against the sampler, "
                                 "f(p / q), as it weighs the sampled token")
    return centering.check_sampler_topk(args.sampler_topk, token_shape, logits, logits.shape[-1], valid, checks)


def _proximal_alpha(args: Arguments, cfg: LossConfig, token_shape, valid, checks: Checks):
    """alpha_t of ratio_ref="loglinear" (float64 [N]; None for other ratio_refs, which take no versions):
    clamp((v - 1 - v_t) / (v - v_t), 0, 1) where v_t >= 0 and v > v_t, else 0 (AReaL's loglinear proximal)."""
    versions, current = args.versions, args.current_version
    if cfg.ratio_ref != "loglinear":
        for name, value in (("versions", versions), ("current_version", current)):
            if value is not None:
                raise ValueError(f"{name}= is read by LossConfig.ratio_ref='loglinear' only (the config's ratio_ref is "
                                 f"{cfg.ratio_ref!r})")
        return None
    if args.old_logprobs is not None:
        raise ValueError("ratio_ref='loglinear' forms old_logprobs from the current logprobs and the versions: pass "
                         "old_logprobs=None (with old_logprobs from a proximal forward pass, use ratio_ref='old')")
    if not isinstance(versions, torch.Tensor) or versions.dtype.is_floating_point or versions.dtype == torch.bool:
        raise TypeError(f"versions must be an integer torch.Tensor of shape {tuple(token_shape)} (ratio_ref="
                        f"'loglinear'); got {versions if not isinstance(versions, torch.Tensor) else versions.dtype}")
    if versions.shape != token_shape:
        raise ValueError(f"versions must have the tokens' shape {tuple(token_shape)}; got {tuple(versions.shape)}")
    if isinstance(current, bool) or not isinstance(current, numbers.Integral) or current < 0:
        raise TypeError(f"current_version must be an int >= 0 (ratio_ref='loglinear'); got {current!r}")
    v = versions.reshape(-1).to(device=valid.device, dtype=torch.float64)
    above = valid & (v > current)
    checks.fail_if(above.any(), f"versions must be <= current_version={current} at unmasked positions",
                   lambda: f"; got {int(v[above][0])}")
    gap = current - v
    alpha = torch.where((gap > 0) & (v >= 0), (gap - 1.0) / gap.clamp(min=1.0), 0.0).clamp(0.0, 1.0)
    return torch.where(valid, alpha, 0.0)


def _config_requirements(logits, args: Arguments, cfg: LossConfig, inputs: dict):
    """What the config requires of the inputs (the arguments it needs, packed input's sequence boundaries, the
    policies a sequence_group cannot split), refused by name; returns the resolved norm_length of
    seq-mean-token-sum-norm (padded T by default; a 0-d tensor with a sequence_group)."""
    padded, cu_seqlens, sequence_group = logits.dim() == 3, args.cu_seqlens, args.sequence_group
    if cfg.needs_sampler_logprobs and inputs["sampler_logprobs"] is None:
        raise ValueError(
            f"sampler_logprobs is required by this config (policy={cfg.policy!r}, ratio_ref={cfg.ratio_ref!r}, "
            f"is_level={cfg.is_level!r}); pass the sampler's logprobs of the sampled tokens"
        )
    if inputs["entropy_normalizer"] is not None and cfg.entropy_agg is None:
        raise ValueError("entropy_normalizer replaces the count of LossConfig.entropy_agg's aggregation; set "
                         "entropy_agg (normalizer= already covers an entropy term aggregated as the loss)")
    if inputs["is_weights"] is not None and cfg.is_level != "none":
        raise ValueError(f"is_weights (the trainer's own IS weights) replace the config's importance weight; the "
                         f"config also asks for one (is_level={cfg.is_level!r}): use is_level='none' with is_weights")
    if cfg.kl_coef != 0.0 and inputs["ref_logprobs"] is None:
        raise ValueError("ref_logprobs is required when kl_coef != 0")
    if cfg.kl_coef != 0.0 and cfg.kl_weight == "sampler" and inputs["sampler_logprobs"] is None:
        raise ValueError("sampler_logprobs is required by LossConfig.kl_weight='sampler' (the KL's weight "
                         "exp(lp - sampler_logprobs))")
    needs_sequences = (cfg.is_level in ("sequence", "geometric") or cfg.loss_agg != "token-mean"
                       or cfg.sequence_ratio or cfg.entropy_agg not in (None, "token-mean")
                       or policy(cfg.policy).sequence_level or cfg.off_policy_mask is not None
                       or any(c[0].startswith("seq_") for c in cfg.rejection))
    if needs_sequences and not padded and cu_seqlens is None:
        raise ValueError(
            f"cu_seqlens is required for packed [N, V] input with is_level={cfg.is_level!r}, "
            f"ratio_level={cfg.ratio_level!r} and loss_agg={cfg.loss_agg!r} (they need sequence boundaries; so do "
            f"policy='vespo', off_policy_mask, entropy_agg other than token-mean and the seq_* rejection criteria)"
        )
    if sequence_group is not None and policy(cfg.policy).whole_batch:
        raise refused("whole_batch/sequence_group", policy=cfg.policy)
    if sequence_group is not None and not padded and cu_seqlens is None:
        raise ValueError("sequence_group (context parallel) with packed [N_local, V] logits needs cu_seqlens: this "
                         "rank's segment of each of the same S sequences, in the same order on every rank (empty "
                         "segments where it holds none of a sequence); or padded [B, T_local, V] logits")
    norm_length = cfg.norm_length
    if "seq-mean-token-sum-norm" in (cfg.loss_agg, cfg.entropy_agg) and norm_length is None:
        if not padded:
            raise ValueError("norm_length (LossConfig field) is required for loss_agg='seq-mean-token-sum-norm' "
                             "(or entropy_agg) with packed input")
        norm_length = inputs["token_shape"][1]
        if sequence_group is not None:  # the padded length of the whole sequences: the ranks' slices together
            norm_length = all_reduce(torch.tensor(float(norm_length), dtype=torch.float64, device=logits.device),
                                     sequence_group)
    return norm_length


def _weights(args: Arguments, cfg: LossConfig, inputs: dict, valid, norm_length, logits_dtype) -> dict:
    """The `Call` fields of the aggregation: the mask after LossConfig.rejection (the call's valid tokens are those it
    keeps), the sequences' counts, a_t and e_t (times the loss scale), the head-precision rounding and the loss
    scale."""
    seq_index, num_seqs, sequence_group = inputs["seq_index"], inputs["num_seqs"], args.sequence_group
    mask_f = valid.double()
    rejected = rejection_gate = m2po_ranked = m2po_dropped = None
    if cfg.m2_threshold is not None:  # M2PO first (AReaL: on the loss mask, before the loss and its rejection)
        if cfg.ratio_ref == "loglinear":
            raise refused("m2po/loglinear")
        for name in ("sampler_logprobs", "old_logprobs"):
            if inputs[name] is None:
                raise ValueError(f"{name} is required by LossConfig.m2_threshold (M2PO ranks the tokens by (behaviour "
                                 f"- proximal logprob)^2: sampler_logprobs - old_logprobs)")
        if sequence_group is not None:
            raise refused("m2po/sequence_group")
        keep = m2po_keep(inputs["sampler_logprobs"], inputs["old_logprobs"], mask_f, cfg.m2_threshold)
        m2po_ranked, m2po_dropped = mask_f, mask_f * (1.0 - keep)
        mask_f = mask_f * keep
    if cfg.rejection:  # a second correction: tokens leave the mask (and every count) before anything else
        if inputs["old_logprobs"] is None:
            raise ValueError("old_logprobs is required by LossConfig.rejection (its criteria compare the sampler "
                             "with the learner at theta_old, as verl's rollout_rs does); for a first step pass "
                             "fused_is.token_logprobs of the current logits")
        keep = rejection_keep(inputs["sampler_logprobs"], inputs["old_logprobs"], mask_f, seq_index, num_seqs,
                              cfg.rejection, group=sequence_group)
        rejected = mask_f * (1.0 - keep)
        if cfg.rejection_counts == "drop":
            mask_f = mask_f * keep
        else:  # "keep" (OpenRLHF): the policy term times 0, the counts unchanged
            rejection_gate = keep
    seq_count = sequence_sum(mask_f, seq_index, num_seqs, sequence_group)  # the whole sequences' counts
    token_count = None if sequence_group is None else seq_count.sum()
    agg = aggregation_weights(mask_f, seq_index, num_seqs, seq_count, cfg.loss_agg, inputs["normalizer"],
                               norm_length, token_count)
    entropy_weight = None
    if cfg.entropy_agg is not None:
        entropy_weight = aggregation_weights(mask_f, seq_index, num_seqs, seq_count, cfg.entropy_agg,
                                              inputs["entropy_normalizer"], norm_length, token_count)
    head_rounding = rounding_dtype(args.head_dtype, cfg.head_dtype, logits_dtype)
    loss_scale = check_loss_scale(args.loss_scale)
    if loss_scale != 1.0:  # loss = sum_t a_t L_t: every a_t (and e_t) times the scale, the kernels unchanged
        agg = agg * loss_scale
        entropy_weight = None if entropy_weight is None else entropy_weight * loss_scale
    return dict(mask=mask_f, rejected=rejected, rejection_gate=rejection_gate, m2po_ranked=m2po_ranked,
                m2po_dropped=m2po_dropped, seq_token_count=seq_count,
                agg_weight=agg, entropy_weight=entropy_weight, head_rounding=head_rounding, loss_scale=loss_scale)


def open_call(logits, args: Arguments) -> Call:
    """`prepare` for the logits of policy_loss: with a vocab_group, this rank's shard opened first (the size
    collective, before anything can fail on one rank only)."""
    if args.vocab_group is None:
        return prepare(logits, args)
    check_validate(args.validate)
    shard = distributed.open_shard(logits, "logits", "[B, T, V] or [N, V]", -1, args.vocab_group, args.validate)
    check_logits_tokens(logits, args.tokens)
    return prepare(logits, args, shard)


def prepare_batch(logits, tokens, advantages, **keywords) -> Call:
    """`prepare(logits, Arguments(tokens, advantages, **keywords))`: a call from policy_loss's keywords (tests
    and tools that look at a call's vectors)."""
    return prepare(logits, Arguments(tokens=tokens, advantages=advantages, **keywords))


def prepare_rows(logits, tokens, mask, temperature, validate: str, vocab=None, kept=None, vocab_group=None,
                 arg: str = "logits"):
    """The checks of the row-level entry points (token_logprobs, logprobs and their fused-linear twins), in one
    host read: (ids int64 [N], valid bool [N], the temperature (a float or float64 [N]), the kept ids [N, K] or
    None). logits: the logits or their stand-in; vocab: the global V of a vocabulary shard (default: the last
    dimension's); arg: how errors name the logits."""
    check_logits_tokens(logits, tokens, arg=arg)
    checks = Checks(validate)
    valid = flat_mask(mask, tokens.shape, logits, checks)
    tau = call_temperature(temperature, tokens.shape, logits, valid, checks)
    ids = check_token_range(tokens, logits.shape[-1] if vocab is None else vocab, valid, checks)
    kept_ids = None if kept is None else kept_sets.kept_rows(logits, kept, tokens.shape, ids, valid, tau,
                                                                      vocab_group, checks)
    ids = checks.done(gate=ids)  # under torch.compile the ids come back once the flags are clear (fused_is/ops.py)
    return ids, valid, tau, kept_ids
