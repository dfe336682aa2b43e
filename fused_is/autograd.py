"""FusedPolicyLoss: the gradient is made in the forward call and scaled by grad_output in backward.

Nothing but the [N, V] gradient buffer (or, with inplace=True, the logits buffer itself) is kept for
backward, so the loss costs no N x V activation memory beyond that one buffer.
"""

from __future__ import annotations

import torch

from .api import Batch
from .backends import scale_gradient_
from .plan import loss_forward


class FusedPolicyLoss(torch.autograd.Function):
    """autograd.Function behind `fused_is.policy_loss`.

    apply(logits, batch, backend, inplace, compute_grad) -> (loss, lp, H, metric_values)
        logits: [B, T, V] or [N, V], bf16/fp16/fp32/fp64, the tensor autograd differentiates.
        batch: `fused_is.api.prepare_batch(...)` of the same logits (checked, flattened inputs).
        backend: a concrete backend name ("torch", "triton", "cuda", "cpu").
        inplace: write the gradient into logits (their autograd version counter moves).
        compute_grad: make the gradient in forward (False for evaluation without autograd).
    Returns loss (0-d; fp32, or fp64 for fp64 logits), lp [N] and H [N] (same dtype, detached) and the
    metric values in the order of `coefficients.metric_names(batch)`. backward can run once: the
    gradient buffer is scaled in place and handed to autograd.
    """

    @staticmethod
    def forward(ctx, logits: torch.Tensor, batch: Batch, backend: str, inplace: bool, compute_grad: bool):
        loss, lp, entropy, values, grad = loss_forward(batch, backend, compute_grad, inplace)
        ctx.grad = grad
        ctx.sync_free = batch.validate == "async"
        ctx.mark_non_differentiable(lp, entropy, values)
        return loss, lp, entropy, values

    @staticmethod
    def backward(ctx, grad_loss, *_unused):
        grad = ctx.grad
        if grad is None:
            raise RuntimeError(
                "FusedPolicyLoss.backward ran twice or without a gradient: the gradient buffer is handed to "
                "autograd on the first backward (retain_graph=True cannot reuse it); call policy_loss again"
            )
        ctx.grad = None
        # grad_loss stays a 0-d fp32 tensor: the product is formed in fp32 and rounded once. Cast to bf16
        # first, a scale such as 1.7 would become 1.703125 (0.2% off) before a second rounding.
        if ctx.sync_free:  # no host read: a kernel that skips the pass on the device when grad_output is 1
            scale_gradient_(grad, grad_loss)
        elif not torch.equal(grad_loss, torch.ones_like(grad_loss)):  # skip a full pass when grad_output is 1
            grad.mul_(grad_loss)
        return grad, None, None, None, None
