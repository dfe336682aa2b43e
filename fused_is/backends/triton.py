"""backend="triton": launchers of triton_kernels/policy_loss.py (installed as fused_is.triton_kernels).

Token-local configurations (every preset except sequence/geometric IS with old_logprobs=None) run one
kernel, `_fused_kernel`: per row, the online-softmax sweep, g and h in registers, and the gradient sweep
over the same row while it is still in L2: one read from HBM and one write of the logits.
The two-pass plan (sequence/geometric IS with old_logprobs=None) runs the statistics kernel, reduces the
IS weights per sequence in float64 (fused_is/coefficients.py, O(N)), then the gradient kernel.
"""

from __future__ import annotations

import os
from typing import Optional

import torch

from .. import coefficients
from ..api import Batch
from . import gradient_buffer

# One program per row, BLOCK = 4096 lanes: V = 151936 takes 38 iterations per sweep. With NUM_WARPS = 8
# (256 threads) each thread holds 16 lanes of each of the three fp32 accumulators (48 registers), and the
# loads of one iteration are 8 KiB (bf16) per program, 16 bytes per thread: one vector load each, enough
# bytes in flight per SM for HBM with a few programs resident. 132 SMs x ~2 programs x 300 KB rows stay
# inside H100/H200's 50 MB L2, so the second sweep re-reads from L2. A heuristic, not an autotune (the
# interpreter cannot autotune); bench/gpu_suite.sh measures it against the copy bandwidth.
BLOCK = 4096
NUM_WARPS = 8


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
                                1.0 / temperature, BLOCK=_block(logits.shape[-1]), num_warps=NUM_WARPS)
    return (row_max, log_sum), lp, entropy


def stats(logits: torch.Tensor, tokens: torch.Tensor, temperature: float):
    """(lp [N], H [N]) float64 for flat token ids [N]."""
    _, lp, entropy = _stats(logits, tokens, temperature)
    return lp.double(), entropy.double()


def _fused(batch: Batch, grad: torch.Tensor):
    """One launch of _fused_kernel: lp and H (fp32 [N]) and the gradient written into grad."""
    from ..triton_kernels.policy_loss import _fused_kernel

    logits = batch.logits
    n = batch.num_rows
    lp = torch.empty(n, dtype=torch.float32, device=logits.device)
    entropy = torch.empty_like(lp)
    if n:
        table, ints, floats = coefficients.kernel_inputs(batch)
        policy, base_src, weight_src, is_mode, kl_type, has_dual, has_floor = ints
        clip_low, clip_high, dual_clip, is_cap, is_floor, kl_coef, entropy_coef, inv_tau = floats
        _fused_kernel[(n,)](logits, *_layout(logits), grad, *_layout(grad), batch.tokens, table, lp, entropy,
                            n, logits.shape[-1], inv_tau, clip_low, clip_high, dual_clip, is_cap, is_floor,
                            kl_coef, entropy_coef,
                            POLICY=policy, BASE_SRC=base_src, WEIGHT_SRC=weight_src, IS_MODE=is_mode,
                            KL_TYPE=kl_type, HAS_DUAL=has_dual, HAS_FLOOR=has_floor, HAS_KL=kl_coef != 0.0,
                            BLOCK=_block(logits.shape[-1]), num_warps=NUM_WARPS)
    return lp, entropy


def forward(batch: Batch, compute_grad: bool, inplace: bool):
    logits = batch.logits
    tau = batch.config.temperature
    if compute_grad and not coefficients.needs_stats_pass(batch):
        grad = gradient_buffer(logits, inplace)
        lp32, ent32 = _fused(batch, grad)
        if inplace:  # the kernel wrote through a raw pointer: tell autograd the logits changed
            torch.autograd.graph.increment_version(logits)
        return lp32.double(), ent32.double(), grad
    (row_max, log_sum), lp32, ent32 = _stats(logits, batch.tokens, tau)
    lp, entropy = lp32.double(), ent32.double()
    if not compute_grad:
        return lp, entropy, None
    from ..triton_kernels.policy_loss import _grad_kernel

    # two-pass plan: the sequence's IS weight needs every lp of the sequence
    weight = coefficients.full_is_weight(batch, lp)[0]
    g, h = coefficients.coefficients(batch, lp, slice(None), weight)
    grad = gradient_buffer(logits, inplace)
    n = batch.num_rows
    if n:
        _grad_kernel[(n,)](logits, *_layout(logits), grad, *_layout(grad), batch.tokens, row_max, log_sum, ent32,
                           g.float().contiguous(), h.float().contiguous(), logits.shape[-1], 1.0 / tau,
                           BLOCK=_block(logits.shape[-1]), num_warps=NUM_WARPS)
    if inplace:
        torch.autograd.graph.increment_version(logits)
    return lp, entropy, grad
