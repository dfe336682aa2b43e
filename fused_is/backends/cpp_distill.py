"""backend="cpu" and backend="cuda" of distill_loss: launchers of the csrc/ extensions' distill_stats and
distill_gradient (csrc/cpu/distill_cpu.cpp, csrc/cuda/distill_cuda.cu), the two sweeps of fused_is/distill.py's plan.

`stats` writes the float32 [len(STATS), N] statistics (the Triton kernels' rows: fused_is/backends/abi.py
DISTILL_STATS), `gradient` d loss / d z into a new buffer or over the logits. Both take the checked call
(fused_is.distill.DistillCall, read by attribute: this module does not import it); the extension is the policy loss's
(fused_is/backends/cpp.py: built by `fused-is build cpu`, or on first use of "cuda").
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from . import abi, cpp

STATS = abi.DISTILL_STATS
# teacher dtypes the kernels read (the Triton backend's: fused_is/backends/triton_distill.py TEACHER_DTYPES)
TEACHER_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


def unavailable_reason(kind: str, logits: Optional[torch.Tensor], teacher: Optional[torch.Tensor] = None
                       ) -> Optional[str]:
    """None when the `kind` ("cpu" or "cuda") distillation kernels can run on these tensors here, else a sentence
    saying why not (the dtype checks first: they need no extension)."""
    if teacher is not None and teacher.dtype not in TEACHER_DTYPES:
        return (f"the {kind} distillation kernels read bf16/fp16/fp32/fp64 teacher logits, not {teacher.dtype} "
                "(backend='torch' reads any float dtype)")
    return cpp.unavailable_reason(kind, logits)


def _scalars(call, grad_scale: float = 0.0, accumulate: bool = False) -> list:
    """The launch's double scalars in abi.DISTILL_SCALARS order: the base-2 units log2(e) / tau and log2(e) / tau_t,
    beta, the gradient's scale, JSD's mixture shares log2(1 - beta), log2(beta) (0 otherwise), accumulate (1 / 0)."""
    jsd = call.divergence == "jsd"
    values = dict(student_scale=math.log2(math.e) / call.temperature,
                  teacher_scale=math.log2(math.e) / call.teacher_temperature, beta=call.beta, grad_scale=grad_scale,
                  log2_student_share=math.log2(1.0 - call.beta) if jsd else 0.0,
                  log2_teacher_share=math.log2(call.beta) if jsd else 0.0, accumulate=float(accumulate))
    return [values[name] for name in abi.DISTILL_SCALARS]


def stats(call) -> torch.Tensor:
    """float32 [len(STATS), N]: per row the student's and the teacher's raw max and log2 sum (log-sum-exp = max / tau
    + log2 sum ln 2), D_t and K_t (JSD; else 0); zeros at masked rows, whose logits are not read."""
    return cpp.extension(call.backend).distill_stats(call.logits, call.teacher, call.valid.contiguous(),
                                                     abi.DISTILL_DIVERGENCES[call.divergence], _scalars(call))


def gradient(call, statistics: torch.Tensor, weight: torch.Tensor, grad: torch.Tensor, accumulate: bool = False
             ) -> None:
    """grad <- weight_t F_t / tau for every row (fused_is/distill.py), rounded once to grad's dtype; statistics: the
    output of `stats`; weight: float64 [N] on the logits' device, 0 at masked rows (zeros written there, their logits
    unread); grad: the logits' shape and dtype, any strides, possibly the logits themselves. accumulate: grad += the
    term instead, rounded once (grad a buffer of its own; masked rows left as they are)."""
    grad_scale = (1.0 - call.beta if call.divergence == "jsd" else 1.0) / call.temperature
    cpp.extension(call.backend).distill_gradient(call.logits, call.teacher, grad, statistics,
                                                 weight.to(torch.float64).contiguous(),
                                                 abi.DISTILL_DIVERGENCES[call.divergence],
                                                 _scalars(call, grad_scale, accumulate))
