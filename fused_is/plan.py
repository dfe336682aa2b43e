"""The plan of DESIGN.md section 4, decided once for every backend.

- stats only (no gradient wanted): `stats` gives lp and H.
- one pass (token-local configurations): `fused` forms g and h per row itself and writes the gradient.
- two passes (sequence/geometric IS with old_logprobs=None, where W needs every lp of the sequence):
  `stats`, the per-sequence reduction of the IS weights in float64 (fused_is/backends/abi.py `pack`),
  then `fused` with W given per row.
Each backend offers the two primitives `stats(logits, tokens, temperature) -> (lp, H)` and
`fused(batch, args, grad) -> (lp, H)` (float64 [N] each; `args` is the kernel contract's KernelArgs,
`grad` the buffer the gradient goes into), registered in fused_is/backends/__init__.py.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from . import backends, coefficients
from .api import Batch, check_logits_tokens, check_validate, output_dtype, prepare_batch
from .backends import abi
from .checks import check_rows


def needs_stats_pass(batch: Batch) -> bool:
    """True when a row's coefficients depend on the current logprobs of its whole sequence (the two-pass
    plan): W_t of sequence/geometric IS with old_logprobs=None, the sequence ratios of GSPO and GMPO, TRL's
    off-policy mask (a sequence's mean of samp - lp, current lp), or VESPO's gamma weight."""
    cfg = batch.config
    return (cfg.coefficients_given or (cfg.is_level in ("sequence", "geometric") and batch.old_logprobs is None)
            or cfg.off_policy_mask is not None or cfg.policy == "vespo")


def forward(batch: Batch, backend: str, compute_grad: bool,
            inplace: bool) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """(lp [N], H [N] float64, grad in the logits' dtype and shape or None) of a prepared batch."""
    if batch.vocab_group is not None:  # the logits are one vocabulary shard: statistics combined across ranks
        from . import distributed

        return distributed.forward(batch, backend, compute_grad, inplace)
    impl = backends.module(backend)
    logits = batch.logits
    valid = batch.valid
    if not compute_grad:
        lp, entropy = impl.stats(logits, batch.tokens, batch.temperature)
        check_rows(logits, batch.tokens, lp, entropy, valid, batch.validate)
        return lp, entropy, None
    stats_lp = None
    if needs_stats_pass(batch):
        stats_lp, stats_entropy = impl.stats(logits, batch.tokens, batch.temperature)
        # before any gradient is written
        check_rows(logits, batch.tokens, stats_lp, stats_entropy, valid, batch.validate)
    args = abi.pack(batch, stats_lp)
    grad = backends.gradient_buffer(logits, inplace)
    lp, entropy = impl.fused(batch, args, grad)
    if inplace:  # the kernels wrote through a raw pointer: tell autograd the logits changed
        torch.autograd.graph.increment_version(logits)
    check_rows(logits, batch.tokens, lp, entropy, valid, batch.validate)
    return lp, entropy, grad


def loss_forward(batch: Batch, backend: str, compute_grad: bool, inplace: bool):
    """One fused forward of a prepared batch: (loss, lp [N], H [N], metric values [M] float64, grad or None).

    loss, lp and H are in `output_dtype(logits.dtype)`; the metric values follow
    `coefficients.metric_names(batch)`.
    """
    lp, entropy, grad = forward(batch, backend, compute_grad, inplace)
    loss, values = coefficients.loss_and_metrics(batch, lp, entropy)
    dtype = output_dtype(batch.logits.dtype)
    return loss.to(dtype), lp.to(dtype), entropy.to(dtype), values, grad


def policy_forward(logits, tokens, advantages, sampler_logprobs, old_logprobs, ref_logprobs, mask, cu_seqlens,
                   config, normalizer, backend: str, inplace: bool, validate: str, vocab_group, compute_grad: bool,
                   is_weights=None, entropy_normalizer=None, sequence_group=None, temperature=None):
    """The one forward of `policy_loss` (eager: FusedPolicyLoss; compiled: inside the custom op).

    Checks every argument (ValueError/TypeError naming it, before any kernel), picks the backend, runs the
    plan. Returns (loss 0-d, lp and H in the tokens' shape, metric values [M] float64 in the order of
    `coefficients.metric_names_for(config, sampler_logprobs is not None, is_weights is not None)`, grad in the
    logits' dtype and shape, or None without compute_grad).
    """
    keywords = dict(sampler_logprobs=sampler_logprobs, old_logprobs=old_logprobs, ref_logprobs=ref_logprobs,
                    mask=mask, cu_seqlens=cu_seqlens, config=config, normalizer=normalizer, validate=validate,
                    is_weights=is_weights, entropy_normalizer=entropy_normalizer, temperature=temperature)
    if sequence_group is not None:  # context parallel (fused_is/distributed.py): sequence reductions over the group
        from . import distributed

        # with vocab_group too (a 2-D grid: tensor parallel x context parallel), the row statistics are reduced
        # over vocab_group and the sequence-level quantities over sequence_group, independently
        distributed.check_group(sequence_group, "sequence_group")
        if vocab_group is not None and vocab_group is sequence_group:
            raise ValueError("vocab_group and sequence_group are the same group: on a grid each rank's vocab_group "
                             "holds the shards of its positions, its sequence_group the slices of its shard")
        keywords["sequence_group"] = sequence_group
    if vocab_group is None:
        batch = prepare_batch(logits, tokens, advantages, **keywords)
        name = backends.resolve(backend, logits)
        if name == "reference":
            raise ValueError("backend='reference' differentiates by autograd, not through FusedPolicyLoss; "
                             "call fused_is.policy_loss(..., backend='reference')")
    else:  # this rank's vocabulary shard (fused_is/distributed.py)
        from . import distributed

        check_validate(validate)
        start, vocab = distributed.open_shard(logits, "logits", "[B, T, V] or [N, V]", -1, vocab_group, validate)
        check_logits_tokens(logits, tokens)
        name = distributed.resolve_backend(backend, logits)
        batch = prepare_batch(logits, tokens, advantages, vocab=vocab, **keywords)
        batch.vocab_group, batch.vocab_start = vocab_group, start
    loss, lp, entropy, values, grad = loss_forward(batch, name, compute_grad, inplace)
    return loss, lp.reshape(batch.token_shape), entropy.reshape(batch.token_shape), values, grad
