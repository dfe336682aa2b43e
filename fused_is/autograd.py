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
from .backends import scale_gradient_
from .call import Arguments, open_call
from .validate import output_dtype


def check_compilable(backend, inplace, normalizer, entropy_normalizer=None) -> None:
    """What torch.compile cannot take, refused by name (called while dynamo traces)."""
    if inplace:
        raise ValueError(f"inplace=True is not supported under torch.compile, nor inplace={inplace!r} (the gradient "
                         "would be written over a graph input); use inplace=False")
    if backend == "reference":
        raise ValueError("backend='reference' is eager only; under torch.compile use a fused backend")
    for name, value in (("normalizer", normalizer), ("entropy_normalizer", entropy_normalizer)):
        if isinstance(value, torch.Tensor):
            raise TypeError(f"{name} must be a Python number under torch.compile (a tensor would be read on the "
                            f"host inside the graph); pass float({name}) outside the compiled function")


class FusedPolicyLoss(torch.autograd.Function):
    """The fused policy loss as an autograd.Function; `fused_is.policy_loss` is this plus output naming.

    FusedPolicyLoss.apply(logits, tokens, advantages, sampler_logprobs=None, old_logprobs=None,
                          ref_logprobs=None, mask=None, cu_seqlens=None, config="ppo_tis", normalizer=None,
                          backend="auto", inplace=False, validate="full", vocab_group=None, is_weights=None,
                          entropy_normalizer=None, sequence_group=None, compute_grad=True, temperature=None,
                          loss_scale=None, head_dtype=None)
        -> (loss, logprobs, entropy, metric_values)

    Arguments are positional (autograd.Function.apply takes no keywords) and mean what they mean for
    `fused_is.policy_loss`; compute_grad=False skips the gradient (evaluation; under torch.no_grad
    autograd does not tell forward, so say so).
        logits: [B, T, V] or [N, V], bf16/fp16/fp32/fp64, the tensor autograd differentiates.
    Returns loss (0-d; fp32, or fp64 for fp64 logits), logprobs and entropy (tokens' shape, same dtype,
    detached) and the metric values ([M] float64, detached) named by
    `fused_is.coefficients.metric_names_for(config, sampler_logprobs is not None, is_weights is not None)`.
    backward can run once: the gradient buffer is scaled in place and handed to autograd.
    """

    @staticmethod
    def forward(ctx, logits, *arguments):
        # (Arguments, inplace, compute_grad) from fused_is.policy_loss eager, or the documented positional list
        # (fused_is.policy_loss under torch.compile, whose dynamo cannot hand a dataclass to apply)
        ctx.num_inputs = 1 + len(arguments)
        ctx.compiled = torch.compiler.is_compiling()
        if isinstance(arguments[0], Arguments):
            args, inplace, compute_grad = arguments
        else:
            given = _positional(arguments)
            inplace, compute_grad = given.pop("inplace"), given.pop("compute_grad")
            args = Arguments(**given)
        if ctx.compiled:
            check_compilable(args.backend, inplace, args.normalizer, args.entropy_normalizer)
        call = open_call(logits, args)
        if call.backend == "reference":
            raise ValueError("backend='reference' differentiates by autograd, not through FusedPolicyLoss; "
                             "call fused_is.policy_loss(..., backend='reference')")
        # under compile the gradient is a tensor of the graph (never deferred to backward, fp16 included)
        source = plan.logits_rows(logits, call, inplace, defer_fp16=not ctx.compiled)
        loss, lp, entropy, values, grad = plan.run(call, source, compute_grad)
        dtype = output_dtype(logits.dtype)
        loss, lp, entropy = (loss.to(dtype), lp.to(dtype).reshape(call.token_shape),
                             entropy.to(dtype).reshape(call.token_shape))
        if ctx.compiled:
            ctx.save_for_backward(logits.new_empty(0) if grad is None else grad)
        else:
            # an attribute, not save_for_backward: with inplace=True the buffer is the logits, whose version
            # moved, and autograd would refuse it as a saved tensor
            ctx.grad = grad
            ctx.sync_free = args.validate == "async"
        ctx.mark_non_differentiable(lp, entropy, values)
        return loss, lp, entropy, values

    @staticmethod
    def backward(ctx, grad_loss, *_unused):
        none = (None,) * (ctx.num_inputs - 1)
        # grad_loss stays a 0-d fp32 tensor: the product is formed in fp32 and rounded once. Cast to bf16
        # first, a scale such as 1.7 would become 1.703125 (0.2% off) before a second rounding.
        if ctx.compiled:
            (grad,) = ctx.saved_tensors
            return (grad * grad_loss,) + none
        grad = ctx.grad
        if grad is None:
            raise RuntimeError(
                "FusedPolicyLoss.backward ran twice or without a gradient: the gradient buffer is handed to "
                "autograd on the first backward (retain_graph=True cannot reuse it); call policy_loss again"
            )
        ctx.grad = None
        if isinstance(grad, plan.DeferredGradient):  # inplace=True: the sweep runs now, grad_output folded in
            return (grad.write(grad_loss),) + none
        if ctx.sync_free:  # no host read: a kernel that skips the pass on the device when grad_output is 1
            scale_gradient_(grad, grad_loss)
        elif not torch.equal(grad_loss, torch.ones_like(grad_loss)):  # skip a full pass when grad_output is 1
            grad.mul_(grad_loss)
        return (grad,) + none


# FusedPolicyLoss.apply's documented positional order (after logits); the Arguments fields and two more
POSITIONAL = ("tokens", "advantages", "sampler_logprobs", "old_logprobs", "ref_logprobs", "mask", "cu_seqlens",
              "config", "normalizer", "backend", "inplace", "validate", "vocab_group", "is_weights",
              "entropy_normalizer", "sequence_group", "compute_grad", "temperature", "loss_scale", "head_dtype")
_POSITIONAL_DEFAULTS = dict(zip(POSITIONAL, (None,) * 7 + ("ppo_tis", None, "auto", False, "full") + (None,) * 4
                                + (True, None, None, None)))


def _positional(values) -> dict:
    """FusedPolicyLoss.apply's positional arguments by name, the defaults filled in."""
    if len(values) > len(POSITIONAL):
        raise TypeError(f"FusedPolicyLoss.apply takes at most {len(POSITIONAL) + 1} arguments; got {len(values) + 1}")
    given = dict(_POSITIONAL_DEFAULTS)
    given.update(zip(POSITIONAL, values))
    return given
