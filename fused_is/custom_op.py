"""`fused_is::policy_loss`: the fused forward as a torch.library custom op, for torch.compile(fullgraph=True).

Under torch.compile, FusedPolicyLoss.forward (fused_is/autograd.py) calls this op: dynamo sees one opaque
node with a fake (meta) implementation, so the argument checks (which read tensor values) and the kernel
launches run at run time inside the op, and the graph needs no break. The op is the same
call building and plan that eager calls run; it returns the gradient it made as a fifth output, which
FusedPolicyLoss saves and scales in backward (the op itself has no autograd formula: the autograd.Function
is the only one). inplace=True is refused under compile (a custom op may not return its input's storage).
"""

from __future__ import annotations

import dataclasses
import json
from typing import List, Optional

import torch

from . import coefficients, plan
from .call import Arguments, open_call
from .config import LossConfig
from .validate import output_dtype

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


# the optional per-token tensors of a call, in the order the op takes them as one list
OPTIONAL_TENSORS = ("sampler_logprobs", "old_logprobs", "ref_logprobs", "mask", "cu_seqlens", "is_weights",
                    "temperature")


@torch.library.custom_op("fused_is::policy_loss", mutates_args=())
def policy_loss_op(
    logits: Tensor, tokens: Tensor, advantages: Tensor, optional: List[Optional[Tensor]], config_json: str,
    normalizer: Optional[float], entropy_normalizer: Optional[float], backend: str, validate: str, compute_grad: bool,
    vocab_group_name: Optional[str], sequence_group_name: Optional[str],
) -> List[Tensor]:
    """[loss (0-d), lp and H (tokens' shape), metric values [M] float64, grad (logits' shape, or [0] without
    compute_grad)]: the call built and the plan run, with the config as JSON, the optional tensors in the order
    of OPTIONAL_TENSORS and the process groups by name (their collectives run here, at run time)."""
    args = Arguments(tokens=tokens, advantages=advantages, **dict(zip(OPTIONAL_TENSORS, optional)),
                     config=LossConfig(**json.loads(config_json)), normalizer=normalizer,
                     entropy_normalizer=entropy_normalizer, backend=backend, validate=validate,
                     vocab_group=_resolve(vocab_group_name), sequence_group=_resolve(sequence_group_name))
    with torch.no_grad():
        call = open_call(logits, args)
        if call.backend == "reference":
            raise ValueError("backend='reference' is eager only; under torch.compile use a fused backend")
        loss, lp, entropy, values, grad = plan.run(call, plan.LogitsRows(logits, defer_fp16=False), compute_grad)
    dtype = output_dtype(logits.dtype)
    return [loss.to(dtype), lp.to(dtype).reshape(tokens.shape), entropy.to(dtype).reshape(tokens.shape), values,
            logits.new_empty(0) if grad is None else grad]


@policy_loss_op.register_fake
def _(logits, tokens, advantages, optional, config_json, normalizer, entropy_normalizer, backend, validate,
      compute_grad, vocab_group_name, sequence_group_name):
    cfg = LossConfig(**json.loads(config_json))
    out_dtype = output_dtype(logits.dtype)
    given = dict(zip(OPTIONAL_TENSORS, optional))
    names = coefficients.metric_names_for(cfg, given["sampler_logprobs"] is not None, given["is_weights"] is not None)
    return [logits.new_empty((), dtype=out_dtype), logits.new_empty(tokens.shape, dtype=out_dtype),
            logits.new_empty(tokens.shape, dtype=out_dtype), logits.new_empty(len(names), dtype=torch.float64),
            torch.empty_like(logits) if compute_grad else logits.new_empty(0)]
