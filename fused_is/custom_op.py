"""`fused_is::policy_loss`: the fused forward as a torch.library custom op, for torch.compile(fullgraph=True).

Under torch.compile, FusedPolicyLoss.forward (fused_is/autograd.py) calls this op: dynamo sees one opaque
node with a fake (meta) implementation, so the argument checks (which read tensor values) and the kernel
launches run at run time inside the op, and the graph needs no break. The op is the same
`plan.policy_forward` that eager calls run; it returns the gradient it made as a fifth output, which
FusedPolicyLoss saves and scales in backward (the op itself has no autograd formula: the autograd.Function
is the only one). inplace=True is refused under compile (a custom op may not return its input's storage).
"""

from __future__ import annotations

import dataclasses
import json
from typing import List, Optional

import torch

from . import coefficients
from .api import output_dtype
from .config import LossConfig
from .plan import policy_forward

Tensor = torch.Tensor


def config_to_json(cfg: LossConfig) -> str:
    """The config as a JSON string, the form a custom op can take (LossConfig(**json.loads(s)) restores it)."""
    return json.dumps(dataclasses.asdict(cfg))


# Run at trace time: dynamo cannot trace json's C encoder. This attribute is all that
# torch._dynamo.assume_constant_result sets; setting it here keeps `import fused_is` from importing
# torch._dynamo (1.6 s, and it imports triton). tests/test_compile.py fails if dynamo stops honouring it.
config_to_json._dynamo_marked_constant = True


def _resolve(name: Optional[str]):
    """The process group of a name (None: none)."""
    if name is None:
        return None
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(name)


@torch.library.custom_op("fused_is::policy_loss", mutates_args=())
def policy_loss_op(
    logits: Tensor, tokens: Tensor, advantages: Tensor, sampler_logprobs: Optional[Tensor],
    old_logprobs: Optional[Tensor], ref_logprobs: Optional[Tensor], mask: Optional[Tensor],
    cu_seqlens: Optional[Tensor], config_json: str, normalizer: Optional[float], backend: str, compute_grad: bool,
    validate: str, is_weights: Optional[Tensor], entropy_normalizer: Optional[float], temperature: Optional[Tensor],
    vocab_group_name: Optional[str], sequence_group_name: Optional[str],
) -> List[Tensor]:
    """[loss (0-d), lp and H (tokens' shape), metric values [M] float64, grad (logits' shape, or [0] without
    compute_grad)]: `plan.policy_forward` with the config as JSON and the process groups by name (their
    collectives run here, at run time)."""
    vocab_group, sequence_group = _resolve(vocab_group_name), _resolve(sequence_group_name)
    with torch.no_grad():
        loss, lp, entropy, values, grad = policy_forward(
            logits, tokens, advantages, sampler_logprobs, old_logprobs, ref_logprobs, mask, cu_seqlens,
            LossConfig(**json.loads(config_json)), normalizer, backend, False, validate, vocab_group, compute_grad,
            is_weights, entropy_normalizer, sequence_group, temperature)
    return [loss, lp, entropy, values, logits.new_empty(0) if grad is None else grad]


@policy_loss_op.register_fake
def _(logits, tokens, advantages, sampler_logprobs, old_logprobs, ref_logprobs, mask, cu_seqlens, config_json,
      normalizer, backend, compute_grad, validate, is_weights, entropy_normalizer, temperature, vocab_group_name,
      sequence_group_name):
    cfg = LossConfig(**json.loads(config_json))
    out_dtype = output_dtype(logits.dtype)
    names = coefficients.metric_names_for(cfg, sampler_logprobs is not None, is_weights is not None)
    return [logits.new_empty((), dtype=out_dtype), logits.new_empty(tokens.shape, dtype=out_dtype),
            logits.new_empty(tokens.shape, dtype=out_dtype), logits.new_empty(len(names), dtype=torch.float64),
            torch.empty_like(logits) if compute_grad else logits.new_empty(0)]
