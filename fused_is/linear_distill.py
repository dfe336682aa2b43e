"""`fused_is.linear_distill_loss`: distill_loss of the student's logits hidden @ weight.T (+ bias) towards the
teacher's teacher_hidden @ teacher_weight.T (+ teacher_bias), both heads formed chunk by chunk: no [N, V] tensor.

    linear_distill_loss(hidden, weight, teacher_hidden, teacher_weight, ...)
        == distill_loss(hidden @ weight.T + bias, teacher_hidden @ teacher_weight.T + teacher_bias, ...)

A token's loss weight a_t depends on the mask alone (fused_is/distill.py), so one sweep does: per chunk of unmasked
rows, both heads' logits are formed by the GEMM into two reused buffers (linear.py's Head), distill.py's statistics
and gradient sweeps run on them (backend "torch", "triton", "cpu" or "cuda", a DistillCall of the chunk), the
gradient is written over the student's chunk buffer and taken into d hidden, d weight and d bias (linear.py's HeadGrads,
fp32 accumulators). A masked row's D_t is 0 and its gradient 0: no logits are formed for it and its d hidden is
exactly 0. Extra memory: two chunk buffers of chunk_size x V, the sweeps' temporaries (distill.CHUNK_ELEMENTS), the fp32
[V, D] accumulator and d hidden; flat in N.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, Optional, Tuple

import torch

from . import backends, distill
from .linear import (Head, HeadGrads, check_head, check_teacher_head, default_chunk_rows, describe_heads,
                     logits_stand_in, reference_logits, split_rows)
from .validate import output_dtype


def linear_distill_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    teacher_hidden: torch.Tensor,
    teacher_weight: torch.Tensor,
    *,
    bias: Optional[torch.Tensor] = None,
    teacher_bias: Optional[torch.Tensor] = None,
    chunk_size: Optional[int] = None,
    kind: str = "forward_kl",
    beta: float = 0.5,
    temperature: float = 1.0,
    teacher_temperature: Optional[float] = None,
    mask: Optional[torch.Tensor] = None,
    cu_seqlens: Optional[torch.Tensor] = None,
    loss_agg: str = "token-mean",
    top_k: int = 0,
    add_tail: bool = True,
    backend: str = "auto",
) -> Tuple[torch.Tensor, torch.Tensor, Dict[str, float]]:
    """`distill_loss` of the student's logits hidden @ weight.T (+ bias) towards the teacher's, computed chunk by chunk
    from the hidden states and the lm_head weights of both models: neither model's [N, V] logits ever exist.

    Args:
        hidden: the student's final hidden states, [B, T, D] padded or [N, D] packed; bf16, fp16, fp32 or fp64.
        weight: the student's lm_head weight [V, D], hidden's dtype (tied embeddings: autograd adds the gradients).
        teacher_hidden: the teacher's, hidden's leading shape, [.., D_t] (D_t may differ from D); any of those dtypes.
        teacher_weight: the teacher's lm_head [V, D_t] (one vocabulary: the student's V), teacher_hidden's dtype.
        bias, teacher_bias: [V] or None, each in its model's dtype.
            The teacher's tensors are read only and must not require grad (the loss trains the student alone).
        chunk_size: rows per chunk (default max(D, 256), at most N); each model's logits are formed in its own dtype
            (the GEMM accumulates in fp32 and rounds once, as the model's head would).
        kind, beta, temperature, teacher_temperature, mask, cu_seqlens, loss_agg, top_k, add_tail: as for
            `distill_loss`, with hidden's leading shape in place of the logits'.
        backend: "auto" (distill_loss's pick for logits of this dtype and device), "torch", "triton", "cpu",
            "cuda", or "reference" (the oracle: both models' whole [N, V] logits in float64, autograd; outputs
            float64).
    Returns:
        (loss, per_token, metrics) as distill_loss: loss 0-d (fp32; fp64 for an fp64 student), differentiable
        w.r.t. hidden, weight and bias; per_token D_t, hidden.shape[:-1], detached, 0 at masked positions; metrics
        divergence_mean and divergence_max. A masked row's hidden states of either model may hold anything.
    Raises:
        TypeError / ValueError naming the argument before any product is formed (shapes, dtypes, vocabularies or
        devices that differ, a teacher tensor that requires grad, distill_loss's option errors); ValueError naming
        the row whose formed logits hold NaN or +inf or are all -inf, or whose divergence is infinite, found by the
        sweep (nothing is handed to autograd then).
    Under torch.compile this function runs eagerly (a graph break).
    """
    dtype = check_head(hidden, weight, bias, None, chunk_size)
    teacher_dtype = check_teacher_head(hidden, weight, teacher_hidden, teacher_weight, teacher_bias)
    vocab = weight.shape[0]
    want = torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in (hidden, weight, bias))
    options = dict(kind=kind, beta=beta, temperature=temperature, teacher_temperature=teacher_temperature, mask=mask,
                   cu_seqlens=cu_seqlens, loss_agg=loss_agg, top_k=top_k, add_tail=add_tail)
    call = distill.prepare(logits_stand_in(hidden, vocab, dtype), logits_stand_in(teacher_hidden, vocab, teacher_dtype),
                           options, backend, False, want)
    if call.backend == "reference":
        teacher_logits = reference_logits(teacher_hidden, teacher_weight, teacher_bias, call.valid).detach()
        return distill.distill_loss(reference_logits(hidden, weight, bias, call.valid), teacher_logits,
                                    backend="reference", **options)
    chunk_rows = chunk_size or default_chunk_rows(call.num_rows, hidden.shape[-1])
    heads = (Head(hidden, weight, bias, dtype, chunk_rows), Head(teacher_hidden, teacher_weight, teacher_bias,
                                                                 teacher_dtype, chunk_rows))
    loss, per_token, metric_values = LinearDistillLoss.apply(hidden, weight, bias, call, heads)
    metrics = dict(zip(("divergence_mean", "divergence_max"), metric_values.tolist()))  # one host read
    return loss, per_token.reshape(hidden.shape[:-1]), metrics


def sweep(call: distill.DistillCall, heads: Tuple[Head, Head], grads: Optional[HeadGrads]):
    """The one sweep over the chunks of unmasked rows (all rows when none is masked): per chunk both models' logits,
    the statistics, and (grads given) d loss / d logits written over the student's chunk and taken into grads.
    Returns (lse float64 [2, N], D float64 [N]), 0 at the rows not swept (the masked ones)."""
    student, teacher = heads
    n = call.num_rows
    lse = torch.zeros(2, n, dtype=torch.float64, device=call.valid.device)
    divergence = torch.zeros(n, dtype=torch.float64, device=call.valid.device)
    split = split_rows(call.valid, "full")
    for rows in student.chunks(None if split is None else split[0]):
        logits = student.logits(rows)
        valid = call.valid[rows]
        part = dataclasses.replace(call, logits=logits, teacher=teacher.logits(rows), valid=valid,
                                   agg_weight=call.agg_weight[rows])
        stats = distill.statistics_sweep(part)
        lse[:, rows], divergence[rows] = stats.lse, stats.divergence
        if grads is not None:  # over the student's chunk buffer: each row read before it is written
            distill.gradient_sweep(part, stats, part.agg_weight, logits)
            grads.add(rows, logits, valid if isinstance(rows, slice) else None)
    for head in heads:
        head.release()
    return lse, divergence


class LinearDistillLoss(torch.autograd.Function):
    """autograd.Function behind `linear_distill_loss`: the gradients of hidden, weight and bias are made in forward
    (chunk by chunk) and scaled by grad_output in backward, which can run once.

    apply(hidden, weight, bias, call: distill.DistillCall (stand-in logits), heads: (student, teacher) Head)
        -> (loss 0-d, per_token [N], metric values float64 [2])
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, call: distill.DistillCall, heads):
        want = (call.compute_grad and hidden.requires_grad, call.compute_grad and weight.requires_grad,
                call.compute_grad and bias is not None and bias.requires_grad)
        dtypes = (hidden.dtype, weight.dtype, None if bias is None else bias.dtype)
        # gathered=True: d hidden starts at 0, the value of the rows that are not swept (masked)
        grads = HeadGrads(heads[0], dtypes, want, gathered=True) if any(want) else None
        lse, divergence = sweep(call, heads, grads)
        distill.check_pair_rows(None, None, call.valid, lse, divergence, call.divergence.title,
                            describe=lambda row: describe_heads(heads, row))
        per_token = torch.where(call.valid, divergence, 0.0)
        loss = (call.agg_weight * per_token).sum()
        ctx.grads, ctx.hidden_shape = grads, hidden.shape
        metric_values = distill.divergence_metric_values(per_token, call.valid)
        out_dtype = output_dtype(heads[0].dtype)
        per_token = per_token.to(out_dtype)  # the tensor returned is the one marked
        ctx.mark_non_differentiable(per_token, metric_values)
        return loss.to(out_dtype), per_token, metric_values

    @staticmethod
    def backward(ctx, grad_loss, *_unused):
        grads = backends.take_once(ctx, "grads", "linear_distill_loss")
        grad_hidden, grad_weight, grad_bias = grads.finish(grad_loss, ctx.hidden_shape)  # no host read
        return grad_hidden, grad_weight, grad_bias, None, None
