"""backend="triton": launchers of triton_kernels/policy_loss.py (installed as fused_is.triton_kernels).

This version runs the statistics kernel, forms the per-row coefficients g, h and the IS weights in
float64 with fused_is/coefficients.py (O(N)), then runs the gradient kernel: two reads and one write
of the logits. The single-pass variant (g and h in registers, the second sweep from cache) is the
open part of the Triton issue.
"""

from __future__ import annotations

import os
from typing import Optional

import torch

from .. import coefficients
from ..api import Batch
from . import gradient_buffer

# 4096 lanes: V = 151936 takes 38 iterations per row; each program keeps three fp32 accumulators of
# BLOCK lanes (48 KiB of registers across 8 warps on a GPU). Chosen, not autotuned: the interpreter
# cannot autotune, and per-row work this large is bandwidth-bound at any block >= 1024.
BLOCK = 4096


def unavailable_reason(logits: Optional[torch.Tensor]) -> Optional[str]:
    try:
        import triton  # noqa: F401
    except ImportError:
        return "triton is not installed"
    if logits is not None and not logits.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        return "Triton kernels need CUDA tensors (or TRITON_INTERPRET=1 for the CPU interpreter)"
    if logits is not None and logits.dtype == torch.float64:
        return "the Triton kernels take bf16/fp16/fp32 logits (fp64: backend='torch' or 'reference')"
    return None


def _layout(x: torch.Tensor):
    """(rows_per_seq, stride_seq, stride_row, stride_col) of [B, T, V] or [N, V] logits."""
    if x.dim() == 2:
        return max(1, x.shape[0]), 0, x.stride(0), x.stride(1)
    return max(1, x.shape[1]), x.stride(0), x.stride(1), x.stride(2)


def _block(vocab: int) -> int:
    import triton

    return min(BLOCK, triton.next_power_of_2(vocab))


def _stats(logits: torch.Tensor, tokens: torch.Tensor, temperature: float):
    from ..triton_kernels.policy_loss import _row_stats_kernel

    n = tokens.numel()
    row_max, log_sum, lp, entropy = (torch.empty(n, dtype=torch.float32, device=logits.device) for _ in range(4))
    if n:
        _row_stats_kernel[(n,)](logits, *_layout(logits), tokens, row_max, log_sum, lp, entropy, logits.shape[-1],
                                1.0 / temperature, BLOCK=_block(logits.shape[-1]))
    return (row_max, log_sum), lp, entropy


def stats(logits: torch.Tensor, tokens: torch.Tensor, temperature: float):
    """(lp [N], H [N]) float64 for flat token ids [N]."""
    _, lp, entropy = _stats(logits, tokens, temperature)
    return lp.double(), entropy.double()


def forward(batch: Batch, compute_grad: bool, inplace: bool):
    logits = batch.logits
    tau = batch.config.temperature
    (row_max, log_sum), lp32, ent32 = _stats(logits, batch.tokens, tau)
    lp, entropy = lp32.double(), ent32.double()
    if not compute_grad:
        return lp, entropy, None
    from ..triton_kernels.policy_loss import _grad_kernel

    weight = coefficients.full_is_weight(batch, lp)[0]
    g, h = coefficients.coefficients(batch, lp, slice(None), weight)
    grad = gradient_buffer(logits, inplace)
    n = batch.num_rows
    if n:
        _grad_kernel[(n,)](logits, *_layout(logits), grad, *_layout(grad), batch.tokens, row_max, log_sum, ent32,
                           g.float().contiguous(), h.float().contiguous(), logits.shape[-1], 1.0 / tau,
                           BLOCK=_block(logits.shape[-1]))
    if inplace:  # the kernel wrote through a raw pointer: tell autograd the logits changed
        torch.autograd.graph.increment_version(logits)
    return lp, entropy, grad
