"""FusedPolicyLoss: the one autograd.Function behind `fused_is.policy_loss`, eager and under torch.compile.

The gradient is made in the forward call and scaled by grad_output in backward: nothing but the [N, V]
gradient buffer (or, with inplace=True, the logits buffer itself) is kept for backward, so the loss costs
no N x V activation memory beyond that one buffer. forward builds the call (fused_is/call.py) and runs the plan
(`plan.run`), eager and under torch.compile alike: there dynamo traces both, and the kernels are the kernel-level
custom ops of fused_is/ops.py (opaque nodes whose checks and launches run at run time).
"""

from __future__ import annotations

import torch

from . import plan
from .backends import DeferredGradient, scale_gradient_, take_once
from .call import FIELDS, Arguments, open_call
from .combinations import refused
from .validate import output_dtype


def check_compilable(args: Arguments) -> None:
    """What torch.compile cannot take, refused by name (called while dynamo traces)."""
    if args.inplace:  # True, "backward" or "forward"
        raise refused("inplace/compile")
    if args.backend == "reference":
        raise refused("reference/compile")
    for name in ("normalizer", "entropy_normalizer"):
        if isinstance(getattr(args, name), torch.Tensor):
            raise TypeError(f"{name} must be a Python number under torch.compile (a tensor would be read on the "
                            f"host inside the graph); pass float({name}) outside the compiled function")


class FusedPolicyLoss(torch.autograd.Function):
    """The fused policy loss as an autograd.Function; `fused_is.policy_loss` is this plus output naming.

    FusedPolicyLoss.apply(logits, tokens, advantages, sampler_logprobs=None, old_logprobs=None,
                          ref_logprobs=None, mask=None, cu_seqlens=None, config="ppo_tis", normalizer=None,
                          backend="auto", inplace=False, validate="full", vocab_group=None, is_weights=None,
                          entropy_normalizer=None, sequence_group=None, compute_grad=True, temperature=None,
                          loss_scale=None, head_dtype=None, kept=None, versions=None, current_version=None,
                          sampler_topk=None, teacher_logits=None)
        -> (loss, logprobs, entropy, metric_values)

    Arguments are positional (autograd.Function.apply takes no keywords): after logits, the fields of
    `fused_is.call.Arguments` in their order, each meaning what it means for `fused_is.policy_loss`;
    compute_grad=False skips the gradient (evaluation; under torch.no_grad autograd does not tell forward, so say so).
        logits: [B, T, V] or [N, V], bf16/fp16/fp32/fp64, the tensor autograd differentiates.
    Returns loss (0-d; fp32, or fp64 for fp64 logits), logprobs and entropy (tokens' shape, same dtype,
    detached) and the metric values ([M] float64, detached) named by
    `fused_is.coefficients.metric_names_for(config, sampler_logprobs is not None, is_weights is not None)`.
    backward can run once: the gradient buffer is scaled in place and handed to autograd.
    """

    @staticmethod
    def forward(ctx, logits, *values):
        # positional values, as apply takes them (under torch.compile dynamo cannot hand a dataclass to apply)
        if len(values) > len(FIELDS):
            raise TypeError(f"FusedPolicyLoss.apply takes at most {len(FIELDS) + 1} arguments; got {len(values) + 1}")
        args = Arguments(*values)
        ctx.num_inputs = 1 + len(values)
        ctx.compiled = torch.compiler.is_compiling()
        if ctx.compiled:
            check_compilable(args)
        call = open_call(logits, args)
        if ctx.compiled and call.teacher is not None and (call.row_temperature is not None
                                                           or call.head_rounding is not None):
            raise refused("term_options/compile")
        if call.backend == "reference":
            raise ValueError("backend='reference' differentiates by autograd, not through FusedPolicyLoss; "
                             "call fused_is.policy_loss(..., backend='reference')")
        # under compile the gradient is a tensor of the graph (never deferred to backward, fp16 included)
        source = plan.logits_rows(logits, call, args.inplace, defer_fp16=not ctx.compiled)
        loss, lp, entropy, metric_values, grad = plan.run(call, source, args.compute_grad)
        dtype = output_dtype(logits.dtype)
        loss, lp, entropy = (loss.to(dtype), lp.to(dtype).reshape(call.token_shape),
                             entropy.to(dtype).reshape(call.token_shape))
        if ctx.compiled:
            ctx.save_for_backward(logits.new_empty(0) if grad is None else grad)
            # lp and entropy are views (the reshape); AOT autograd before torch 2.13 fails on a view marked
            # non-differentiable ("element 1 of tensors does not require grad"): tokens-sized copies
            lp, entropy = lp.clone(), entropy.clone()
        else:
            # an attribute, not save_for_backward: with inplace=True the buffer is the logits, whose version
            # moved, and autograd would refuse it as a saved tensor
            ctx.grad = grad
            ctx.sync_free = args.validate == "async"
        ctx.mark_non_differentiable(lp, entropy, metric_values)
        return loss, lp, entropy, metric_values

    @staticmethod
    def backward(ctx, grad_loss, *_unused):
        none = (None,) * (ctx.num_inputs - 1)
        # grad_loss stays a 0-d fp32 tensor: the product is formed in fp32 and rounded once. Cast to bf16
        # first, a scale such as 1.7 would become 1.703125 (0.2% off) before a second rounding.
        if ctx.compiled:
            (grad,) = ctx.saved_tensors
            return (grad * grad_loss,) + none
        grad = take_once(ctx, "grad", "policy_loss")
        if isinstance(grad, DeferredGradient):  # inplace=True, fp16: the sweeps run now, grad_output folded in
            return (grad.write(grad_loss),) + none
        if ctx.sync_free:  # no host read: a kernel that skips the pass on the device when grad_output is 1
            scale_gradient_(grad, grad_loss)
        elif not torch.equal(grad_loss, torch.ones_like(grad_loss)):  # skip a full pass when grad_output is 1
            grad.mul_(grad_loss)
        return (grad,) + none

