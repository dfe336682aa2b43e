"""The front door: the public entry points `policy_loss` and `token_logprobs` (DESIGN.md section 3)."""

from __future__ import annotations

import warnings
from typing import Dict, NamedTuple, Optional, Tuple, Union

import torch

from . import backends, coefficients, distributed, ops, plan
from .autograd import FusedPolicyLoss
from .call import Arguments, prepare, prepare_rows
from .combinations import refused
from .config import LossConfig, resolve_config
from .reference import reference_policy_loss, row_stats
from .validate import (Temperature, check_backend, check_rows, check_validate, checked_values, output_dtype,
                       round_like_head, rounding_dtype)


class _PolicyLossFields(NamedTuple):
    loss: torch.Tensor
    logprobs: torch.Tensor
    entropy: torch.Tensor
    metrics: Dict[str, float]


class PolicyLossOutput(_PolicyLossFields):
    """Result of `policy_loss`: a named 4-tuple (loss, logprobs, entropy, metrics), plus `backend`.

    loss: 0-d tensor, differentiable w.r.t. logits (fp32; fp64 for fp64 logits).
    logprobs: lp_t, shape of tokens, fp32 (fp64 for fp64 logits), detached.
    entropy: H_t, shape of tokens, same dtype, detached.
    metrics: dict of floats (DESIGN.md section 3); metrics that do not apply are absent. Under
        torch.compile, and with validate="async", the values are 0-d tensors instead (a float would break
        the graph, or read the device).
    backend: the backend that ran ("cpu", "cuda", "triton", "torch" or "reference"; what backend="auto"
        picked), an attribute, not a tuple field; None under torch.compile.
    """

    backend = None  # the class default (e.g. after _replace)

    def __new__(cls, loss, logprobs, entropy, metrics, backend: Optional[str] = None):
        out = super().__new__(cls, loss, logprobs, entropy, metrics)
        out.backend = backend
        return out


def policy_loss(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    advantages: torch.Tensor,
    *,
    sampler_logprobs: torch.Tensor = None,
    old_logprobs: torch.Tensor = None,
    ref_logprobs: torch.Tensor = None,
    mask: torch.Tensor = None,
    cu_seqlens: torch.Tensor = None,
    config: Union[str, LossConfig] = "ppo_tis",
    normalizer=None,
    backend: str = "auto",
    inplace: Union[bool, str] = False,
    validate: str = "full",
    vocab_group=None,
    is_weights: torch.Tensor = None,
    entropy_normalizer=None,
    sequence_group=None,
    temperature: Optional[torch.Tensor] = None,
    kept=None,
    loss_scale: Optional[float] = None,
    head_dtype=None,
    versions: Optional[torch.Tensor] = None,
    current_version: Optional[int] = None,
    sampler_topk=None,
    teacher_logits: Optional[torch.Tensor] = None,
) -> PolicyLossOutput:
    """RL policy loss with importance-sampling correction, fused over the vocabulary.

    Args:
        logits: [B, T, V] padded or [N, V] packed learner logits; bf16, fp16, fp32 or fp64; any strides.
        tokens: [B, T] or [N] integer ids in [0, V) (ids at masked positions may be out of range).
        advantages: float, shape of tokens, or [B] per sequence for padded input.
        sampler_logprobs, old_logprobs, ref_logprobs: float, shape of tokens, finite where unmasked.
        mask: bool or 0/1, shape of tokens; default all ones.
        cu_seqlens: packed input only: int [S + 1] offsets, 0 = first <= ... <= last = N.
        config: preset name (see `fused_is.PRESETS`) or `fused_is.LossConfig`.
        normalizer: positive number (or 0-d tensor) replacing the token or sequence count of the aggregation.
        backend: "auto", "triton", "cuda", "cpu", "torch" or "reference".
        inplace: write the gradient into the logits' own buffer instead of a new [N, V] one (no extra N x V
            memory). True (or "backward"): the logits keep their values until backward, which writes the gradient
            over them (scaled by grad_output) and hands that buffer to autograd: a later use of the logits in the
            forward (another loss term, a metric) reads the right values; one more read of the logits than
            inplace=False (a statistics sweep in forward, the gradient sweep in backward); modifying the logits
            in place before backward is a RuntimeError in backward. Every backend but "reference".
            "forward" (expert mode): the gradient overwrites the logits during this call, in the same single sweep
            (the fastest: one read, one write); from then on the logits' buffer holds the gradient, so the
            caller must not read the logits after the call: autograd refuses a later backward through a node
            that saved them (their version moved), but a plain read gets the gradient's values, silently.
        validate: "full" (default): value checks read the inputs on the host (a CUDA sync each) and raise
            ValueError naming the first bad position. "async": the same checks as device-side assertions,
            no host read in forward or backward (production loops, CUDA graphs); metrics are 0-d tensors.
            backend="reference" (the oracle) still reads values on the host.
        vocab_group: a torch.distributed process group over which the vocabulary is split (tensor-parallel
            lm_head): logits are this rank's contiguous shard [..., V_local] (shards in group-rank order, sizes
            may differ), tokens are global ids. Loss, logprobs, entropy and metrics are identical on every
            rank; the gradient is this shard's. Backends "cpu", "triton" and "torch" (fused_is/distributed.py).
        is_weights: float, shape of tokens or [B] per sequence (padded input): the importance weights W_t the
            trainer computed itself (verl's rollout_is_weights, TRL's importance_sampling_ratio), multiplying
            the policy term in place of the config's (is_level must be "none"); no gradient; finite and >= 0
            where unmasked. Metrics is_weight_mean/max/min and is_masked_frac (its zeros) describe them.
        entropy_normalizer: positive number (or 0-d tensor) replacing the count of LossConfig.entropy_agg's
            aggregation of the entropy term (the `normalizer` of that term), e.g. TRL's local token count x
            gradient accumulation steps.
        sequence_group: a torch.distributed process group over which the positions of every sequence are split
            (context parallel): padded [B, T_local, V] logits, every rank the same B sequences, rank r holding
            the r-th slice of their positions; or packed [N_local, V] logits with this rank's cu_seqlens [S + 1]:
            one segment per sequence of the same S sequences in the same order on every rank (a segment may be
            empty where the rank holds none of that sequence). Sequence-level quantities (IS weights, GSPO/GMPO
            ratios, counts, the rejection and off-policy statistics, the aggregation) and the loss and metrics are
            reduced over
            the group, so the loss and metrics are those of the whole sequences on every rank and the gradient
            is this slice's. With vocab_group as well (tensor x context parallel: this rank holds a vocabulary shard
            of a slice of positions; each row's statistics are reduced over vocab_group, every sequence quantity
            over sequence_group). Not with backend="reference". Under torch.compile the collectives of both groups
            are traced as functional collectives.
        temperature: per-sequence or per-token temperatures tau_t, each row's logits divided by its own (verl's
            per-sample temperature): a floating-point tensor, [B] per sequence (padded), [S] per sequence (packed,
            with cu_seqlens) or the shape of tokens; positive and finite where unmasked; no gradient. None (default):
            every row takes LossConfig.temperature, which must be left at 1.0 when this is given.
        kept: the sampler's kept set after top-k / top-p / min-p, to replay its truncated distribution: lp, H and
            the gradient are those of softmax(z / tau) over each position's kept tokens (exactly 0 gradient outside
            them). An integer tensor of shape tokens' + (K,), -1 = no entry (vLLM's SamplingMask through
            `fused_is.vllm.kept_ids`), or `fused_is.SamplerParams(top_k, top_p, min_p)`, recomputed from these
            logits (an approximation of replay: the learner's logits are not the sampler's). The sampled token
            must be kept at unmasked positions. Not with vocab_group or under torch.compile.
        loss_scale: a positive number the loss is multiplied by (1 / gradient-accumulation steps, a loss scaler's
            scale): out.loss is the scaled loss and backward gives its gradient, which the kernels write scaled in
            their one sweep (`(out.loss * s).backward()` costs one more pass over the [N, V] gradient). Metrics are
            not scaled.
        head_dtype: head-precision replay: None, or the dtype of the sampler's lm_head output (torch.bfloat16,
            torch.float16 or torch.float32, or its name; LossConfig.head_dtype does the same): fp32 / fp64 logits are
            rounded to it (to nearest even) before the softmax, as the sampler's head rounded its own, and the
            gradient passes the rounding unchanged. Logits already of that dtype are left as they are; coarser ones
            (bf16 logits beside an fp32 head) are a ValueError. The fused backends round block by block (about 110
            rows of V = 151936 at a time: one more read and write of the logits, no [N, V] copy). Not with
            inplace=True (inplace='forward' works).
        versions, current_version: LossConfig.ratio_ref="loglinear" only (asynchronous RL, AReaL's
            prox_logp_method="loglinear"): versions, integer, shape of tokens, the policy version that sampled each
            token (< 0 at prompt tokens), at most current_version (an int, the version being trained). The old
            logprob is formed from the current one, samp + alpha (lp - samp) with alpha = (v - 1 - v_t) / (v - v_t)
            clamped to [0, 1] (0 at prompt tokens and where v_t = v): old_logprobs must be None.
        sampler_topk: LossConfig.score_centering only: (ids, logprobs), each of shape tokens.shape + (K,): the
            sampler's top-K token ids (integer, in [0, V); -1 = no entry) and their logprobs (float, <= 0; of the
            distribution sampler_logprobs come from: vLLM's SamplingParams(logprobs=K), see
            fused_is.vllm.sampler_topk). No id twice in a row; their probabilities sum to at most 1. The K columns
            are gathered in the stats pass; the gradient is written by the sweep given the statistics (inplace=True
            included), plus those K + 1 columns. Not with kept=, vocab_group or under torch.compile.
        teacher_logits: LossConfig.distill_kind only: the teacher's logits, the logits' shape, any float dtype, read
            only (a tensor that requires grad is refused): the distillation term's divergence between the teacher's
            and the student's softmax at the call's temperature, aggregated with the policy loss. backend="triton"
            with a one-pass plan and a forward or reverse KL (JSD at beta 0 or 1), the gradient formed in forward, one
            temperature and no head_dtype replay, kept set or score centering:
            one kernel, the policy's sweeps reading both rows (inplace='forward' too); otherwise its statistics and
            gradient are the sweeps of fused_is.distill_loss on the backend, the gradient added to the policy's
            (in place, inplace=True and fp16 included: block by block, through one buffer of at most 16M elements).
            With vocab_group, the teacher's shard of the same columns (merged over the group as distill_loss does);
            with sequence_group, this rank's positions of the teacher. With kept=, both models renormalised over
            each row's kept set (the K kept columns of each read); with per-row temperature=, each row's divides both
            models; with head_dtype replay, the student's logits rounded as for the policy (the teacher's as given);
            with score centering, the policy's score centered and the term's gradient added as it is (docs/
            distillation.md). Under torch.compile the term's sweeps are the distillation ops of fused_is/ops.py (not
            with per-row temperatures or head_dtype replay).
    Returns:
        PolicyLossOutput(loss, logprobs, entropy, metrics).
    Raises:
        TypeError / ValueError naming the argument, before any kernel runs; bad logit values (NaN, +inf,
        a row of -inf, -inf at a sampled token, at unmasked positions) are found by the kernels' sweep
        and raised after it (with inplace='forward', after the gradient was written into logits).
        validate="async": RuntimeError from a device-side assertion instead of the value errors.
    Under torch.compile(fullgraph=True) the call is traced around the kernel-level ops of fused_is/ops.py; the value
    checks run at run time (a bad argument's ValueError names the check but not its position); inplace=True, kept=,
    sampler_topk=, a tensor normalizer and backend="reference" are refused there.
    """
    # the signature's parameters by name, spelled out: dynamo before torch 2.13 cannot trace locals() (a graph break,
    # an error under fullgraph); tests/test_architecture.py checks it against the signature
    parameters = dict(
        logits=logits, tokens=tokens, advantages=advantages, sampler_logprobs=sampler_logprobs,
        old_logprobs=old_logprobs, ref_logprobs=ref_logprobs, mask=mask, cu_seqlens=cu_seqlens, config=config,
        normalizer=normalizer, backend=backend, inplace=inplace, validate=validate, vocab_group=vocab_group,
        is_weights=is_weights, entropy_normalizer=entropy_normalizer, sequence_group=sequence_group,
        temperature=temperature, kept=kept, loss_scale=loss_scale, head_dtype=head_dtype, versions=versions,
        current_version=current_version, sampler_topk=sampler_topk, teacher_logits=teacher_logits)
    compute_grad = torch.is_grad_enabled() and isinstance(logits, torch.Tensor) and logits.requires_grad
    args = Arguments.of(parameters, compute_grad=compute_grad)  # checks backend, inplace and validate
    if backend == "reference" and sequence_group is not None:
        raise refused("reference/sequence_group")
    if backend == "reference" and vocab_group is None:  # the oracle: float64 autograd, eager only
        return reference_loss(logits, args)
    name = None
    if torch.compiler.is_compiling():  # dynamo traces FusedPolicyLoss.forward around the kernel-level ops
        for key, value in (("kept/compile", kept), ("centering/compile", sampler_topk)):
            if value is not None:
                raise refused(key)
    elif isinstance(logits, torch.Tensor):  # the name the call resolves to again (cached), for the output
        name = backends.resolve(backend, logits, sharded=vocab_group is not None)
    loss, lp, entropy, values = FusedPolicyLoss.apply(logits, *args.values())
    names = coefficients.metric_names_for(resolve_config(config), sampler_logprobs is not None, is_weights is not None)
    if validate == "full" and not torch.compiler.is_compiling():
        metrics = dict(zip(names, values.tolist()))  # one host read for all of them
    else:  # 0-d tensors: a float would break the graph, or read the device
        metrics = dict(zip(names, values.unbind(0)))
    if torch.is_grad_enabled() and not compute_grad and name is not None:  # said at the call, not at backward
        warnings.warn("fused_is.policy_loss: grad mode is on but the logits do not require grad, so the loss has no "
                      "gradient (loss.backward() would fail): call it under torch.no_grad() to only evaluate, or "
                      "check that the logits come from parameters that require grad", UserWarning, stacklevel=2)
    return PolicyLossOutput(loss=loss, logprobs=lp, entropy=entropy, metrics=metrics, backend=name)


def reference_loss(logits, args: Arguments) -> PolicyLossOutput:
    """policy_loss of backend="reference": the float64 oracle, differentiated by autograd (eager only)."""
    if torch.compiler.is_compiling():
        raise refused("reference/compile")
    if args.inplace:
        raise refused("reference/inplace")
    validate = args.validate
    if isinstance(logits, torch.Tensor) and logits.dtype.is_floating_point:  # else prepare names the error
        logits = round_like_head(logits, rounding_dtype(args.head_dtype, resolve_config(args.config).head_dtype,
                                                        logits.dtype))
    call = prepare(logits, args)
    loss, lp, entropy, metric_tensors = reference_policy_loss(call)
    check_rows(logits, call.tokens, lp, entropy, call.valid, validate)
    values = list(metric_tensors.values())
    if validate == "full":
        values = torch.stack(values).tolist() if values else []  # one host read for all of them
    out_dtype = output_dtype(logits.dtype)
    return PolicyLossOutput(loss=loss, logprobs=lp.to(out_dtype).reshape(call.token_shape),
                            entropy=entropy.to(out_dtype).reshape(call.token_shape),
                            metrics=dict(zip(metric_tensors, values)), backend="reference")


def token_logprobs(
    logits: torch.Tensor, tokens: torch.Tensor, temperature: Temperature = 1.0, backend: str = "auto", *,
    mask: torch.Tensor = None, validate: str = "full", vocab_group=None, kept=None, head_dtype=None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """No-grad logprobs and entropies of softmax(logits / temperature), for old/ref logprob passes.

    Args:
        logits: [B, T, V] or [N, V]; bf16, fp16, fp32 or fp64; any strides. -inf entries have probability 0.
        tokens: [B, T] or [N] integer ids in [0, V) (ids at masked positions may be out of range).
        temperature: a positive number (>= 1e-8), or per-row temperatures as a floating-point tensor: [B] per
            sequence for padded input, or the shape of tokens (per token; packed input takes only this shape).
        mask: bool or 0/1, shape of tokens, or None (every position counts). At masked positions the
            logits may hold anything and the outputs are unspecified.
        validate: "full" or "async" (device-side assertions, no host read), as for `policy_loss`.
        vocab_group: logits are this rank's vocabulary shard and tokens global ids, as for `policy_loss`;
            the results are those of the whole vocabulary, identical on every rank.
        kept: the sampler's kept set, as for `policy_loss`: the logprobs and entropy over it.
        head_dtype: head-precision replay, as for `policy_loss`: the logits rounded to the sampler head's dtype.
    Returns:
        (logprobs, entropy), each shaped like tokens, fp32 (fp64 for fp64 logits). Never materialises
        the [N, V] logits in fp32 (except backend="reference").
    Raises:
        ValueError naming the first position whose logits hold NaN or +inf, are all -inf, or give the
        token logit -inf (its logprob would be -inf), unless masked.
    Under torch.compile(fullgraph=True) the function is traced around the kernel-level op of fused_is/ops.py, whose
    checks run at run time (an argument's bad value is still a ValueError, without its position); vocab_group, kept
    and backend="reference" are eager only there.
    """
    check_backend(backend)
    check_validate(validate)
    if torch.compiler.is_compiling():
        for key, given in (("vocab_group/compile(logprobs)", vocab_group is not None),
                           ("kept/compile", kept is not None), ("reference/compile", backend == "reference")):
            if given:
                raise refused(key)
    start, vocab, shard = 0, None, None
    if vocab_group is not None:
        start, vocab = distributed.open_shard(logits, "logits", "[B, T, V] or [N, V]", -1, vocab_group, validate)
        shard = (vocab_group, start)
    ids, valid, temperature, kept_ids = prepare_rows(logits, tokens, mask, temperature, validate, vocab, kept,
                                                     vocab_group)
    out_dtype = output_dtype(logits.dtype)
    rounding = rounding_dtype(head_dtype, None, logits.dtype)
    name = backends.resolve(backend, logits, sharded=vocab_group is not None)
    with torch.no_grad():
        if name == "reference" or kept_ids is not None or shard is not None or rounding is not None:
            source = plan.LogitsRows(logits) if rounding is None else plan.RoundedRows(logits, rounding)
            if name == "reference":
                lp, entropy = row_stats(round_like_head(logits, rounding), ids, valid, temperature, out_dtype,
                                        kept_ids)
            elif kept_ids is not None:
                lp, entropy, _ = plan.kept_row_statistics(source, ids, kept_ids, temperature, valid)
            else:
                impl = ops.Traced(name) if torch.compiler.is_compiling() else backends.implementation(name)
                lp, entropy, _ = plan.row_statistics(source, ids, temperature, impl, shard)
            source.close()
            describe = source.describe(None if shard is None else start)
            lp, entropy = checked_values(logits, ids, lp, entropy, valid, validate, describe)
        else:  # the kernel-level op (fused_is/ops.py), eager and under torch.compile alike
            tau, row_tau = ops.split_temperature(temperature)
            lp, entropy = torch.ops.fused_is.stats(logits, ids, tau, row_tau, name).unbind(0)
            lp, entropy = checked_values(logits, ids, lp, entropy, valid, validate)
    return lp.to(out_dtype).reshape(tokens.shape), entropy.to(out_dtype).reshape(tokens.shape)
