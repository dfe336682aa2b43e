"""The plan of DESIGN.md section 4, decided once for every backend.

- stats only (no gradient wanted): `stats` gives lp and H.
- one pass (token-local configurations): `fused` forms g and h per row itself and writes the gradient.
- two passes (sequence/geometric IS with old_logprobs=None, where W needs every lp of the sequence):
  `stats`, the per-sequence reduction of the IS weights in float64 (fused_is/backends/abi.py `pack`),
  then `fused` with W given per row.
Each backend offers the two primitives `stats(logits, tokens, temperature) -> (lp, H)` and
`fused(batch, args, grad) -> (lp, H)` (float64 [N] each; `args` is the kernel contract's KernelArgs,
`grad` the buffer the gradient goes into), registered in fused_is/backends/__init__.py.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from . import backends, coefficients
from .api import Batch, output_dtype
from .backends import abi
from .checks import check_rows


def needs_stats_pass(batch: Batch) -> bool:
    """True when a row's coefficients depend on the current logprobs of its whole sequence (the two-pass
    plan): W_t of sequence/geometric IS with old_logprobs=None, or the sequence ratios of GSPO and GMPO."""
    cfg = batch.config
    return cfg.sequence_ratio or (cfg.is_level in ("sequence", "geometric") and batch.old_logprobs is None)


def forward(batch: Batch, backend: str, compute_grad: bool,
            inplace: bool) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """(lp [N], H [N] float64, grad in the logits' dtype and shape or None) of a prepared batch."""
    if batch.vocab_group is not None:  # the logits are one vocabulary shard: statistics combined across ranks
        from . import distributed

        return distributed.forward(batch, backend, compute_grad, inplace)
    impl = backends.module(backend)
    logits = batch.logits
    valid = batch.mask > 0
    if not compute_grad:
        lp, entropy = impl.stats(logits, batch.tokens, batch.config.temperature)
        check_rows(logits, batch.tokens, lp, entropy, valid, batch.validate)
        return lp, entropy, None
    stats_lp = None
    if needs_stats_pass(batch):
        stats_lp, stats_entropy = impl.stats(logits, batch.tokens, batch.config.temperature)
        # before any gradient is written
        check_rows(logits, batch.tokens, stats_lp, stats_entropy, valid, batch.validate)
    args = abi.pack(batch, stats_lp)
    grad = backends.gradient_buffer(logits, inplace)
    lp, entropy = impl.fused(batch, args, grad)
    if inplace:  # the kernels wrote through a raw pointer: tell autograd the logits changed
        torch.autograd.graph.increment_version(logits)
    check_rows(logits, batch.tokens, lp, entropy, valid, batch.validate)
    return lp, entropy, grad


def loss_forward(batch: Batch, backend: str, compute_grad: bool, inplace: bool):
    """One fused forward: (loss, lp [N], H [N], metric values [M], grad or None).

    loss, lp and H are in `output_dtype(logits.dtype)`; the metric values follow
    `coefficients.metric_names(batch)`. Shared by FusedPolicyLoss and the custom op (fused_is/custom_op.py).
    """
    lp, entropy, grad = forward(batch, backend, compute_grad, inplace)
    loss, metrics = coefficients.loss_and_metrics(batch, lp, entropy)
    dtype = output_dtype(batch.logits.dtype)
    values = torch.stack(list(metrics.values()))  # never empty: entropy_mean is always there
    return loss.to(dtype), lp.to(dtype), entropy.to(dtype), values, grad
