"""`fused_is::policy_loss`: the fused loss as a torch.library custom op, for torch.compile(fullgraph=True).

Under torch.compile, `policy_loss` calls this op instead of the autograd.Function: dynamo sees one opaque
node with a fake (meta) implementation, so the argument checks (which read tensor values) and the kernel
launches run at run time inside the op, and the graph needs no break. The op returns the gradient it made
in forward as a fifth output; the registered backward scales it by grad_output. inplace=True is refused
under compile (a custom op may not return its input's storage).
"""

from __future__ import annotations

import dataclasses
import json
from typing import List, Optional

import torch

from . import backends, coefficients
from .api import output_dtype, prepare_batch
from .plan import loss_forward
from .config import LossConfig

Tensor = torch.Tensor


def config_to_json(cfg: LossConfig) -> str:
    """The config as a JSON string, the form a custom op can take (LossConfig(**json.loads(s)) restores it)."""
    return json.dumps(dataclasses.asdict(cfg))


# Run at trace time: dynamo cannot trace json's C encoder. This attribute is all that
# torch._dynamo.assume_constant_result sets; setting it here keeps `import fused_is` from importing
# torch._dynamo (1.6 s, and it imports triton). tests/test_compile.py fails if dynamo stops honouring it.
config_to_json._dynamo_marked_constant = True


@torch.library.custom_op("fused_is::policy_loss", mutates_args=())
def policy_loss_op(
    logits: Tensor, tokens: Tensor, advantages: Tensor, sampler_logprobs: Optional[Tensor],
    old_logprobs: Optional[Tensor], ref_logprobs: Optional[Tensor], mask: Optional[Tensor],
    cu_seqlens: Optional[Tensor], config_json: str, normalizer: Optional[float], backend: str, compute_grad: bool,
    validate: str,
) -> List[Tensor]:
    """[loss (0-d), lp [N], H [N], metric values [M], grad (logits' shape, or [0] without compute_grad)]."""
    cfg = LossConfig(**json.loads(config_json))
    batch = prepare_batch(logits, tokens, advantages, sampler_logprobs=sampler_logprobs, old_logprobs=old_logprobs,
                          ref_logprobs=ref_logprobs, mask=mask, cu_seqlens=cu_seqlens, config=cfg,
                          normalizer=normalizer, validate=validate)
    name = backends.resolve(backend, logits)  # here, at run time: it looks at files (built extensions)
    with torch.no_grad():
        loss, lp, entropy, values, grad = loss_forward(batch, name, compute_grad, False)
    if grad is None:
        grad = logits.new_empty(0)
    return [loss, lp, entropy, values.to(lp.dtype), grad]


@policy_loss_op.register_fake
def _(logits, tokens, advantages, sampler_logprobs, old_logprobs, ref_logprobs, mask, cu_seqlens, config_json,
      normalizer, backend, compute_grad, validate):
    cfg = LossConfig(**json.loads(config_json))
    out_dtype = output_dtype(logits.dtype)
    n = tokens.numel()
    return [logits.new_empty((), dtype=out_dtype), logits.new_empty(n, dtype=out_dtype),
            logits.new_empty(n, dtype=out_dtype),
            logits.new_empty(len(coefficients.metric_names_for(cfg, sampler_logprobs is not None)), dtype=out_dtype),
            torch.empty_like(logits) if compute_grad else logits.new_empty(0)]


def _setup_context(ctx, inputs, output):
    ctx.mark_non_differentiable(*output[1:])  # lp, H, metrics and the gradient itself carry no gradient
    ctx.save_for_backward(output[4])


def _backward(ctx, grads):
    (grad,) = ctx.saved_tensors
    grad_loss = grads[0]
    return (grad * grad_loss,) + (None,) * 12  # 0-d fp32 grad_loss: one rounding (see FusedPolicyLoss)


policy_loss_op.register_autograd(_backward, setup_context=_setup_context)
