"""`mismatch_report`: how far the sampler's token logprobs are from the learner's (DESIGN.md section 3)."""

from __future__ import annotations

from typing import Dict, Optional

import torch


def _flatten(name: str, x, shape=None) -> torch.Tensor:
    if not isinstance(x, torch.Tensor) or not x.dtype.is_floating_point:
        raise TypeError(f"{name} must be a floating-point torch.Tensor")
    if shape is not None and x.shape != shape:
        raise ValueError(f"{name} must have shape {tuple(shape)}; got {tuple(x.shape)}")
    return x.reshape(-1).double()


def mismatch_report(
    sampler_logprobs: torch.Tensor,
    learner_logprobs: torch.Tensor,
    mask: Optional[torch.Tensor] = None,
    cu_seqlens: Optional[torch.Tensor] = None,
) -> Dict[str, float]:
    """Token- and sequence-level mismatch statistics between sampler and learner logprobs.

    Args:
        sampler_logprobs, learner_logprobs: float, [B, T] (rows are sequences) or [N] (one sequence,
            or the sequences of cu_seqlens). Both are logprobs of the same sampled tokens.
        mask: bool or 0/1 of the same shape; default all tokens.
        cu_seqlens: int [S + 1] offsets for 1-D input.
    Returns:
        dict of floats, with log w = learner - sampler (the IS log weight) over unmasked tokens:
        k1 = mean(sampler - learner) and k3 = mean(w - log w - 1) (estimates of KL(sampler || learner)),
        max_abs_diff = max |sampler - learner| (logprobs), max_abs_prob_diff = max |p_s - p_l|,
        log_ppl_{sampler,learner} = -mean logprob, ppl_ratio = ppl_learner / ppl_sampler,
        chi2_token = mean(w^2) - 1, chi2_seq = mean over sequences of W_seq^2 - 1 (W_seq = prod w),
        ess_token = (sum w)^2 / (n sum w^2) in (0, 1], seq_log_ratio_{mean,max,min} of log W_seq,
        num_tokens, num_seqs. An empty selection gives zeros.
    """
    samp = _flatten("sampler_logprobs", sampler_logprobs)
    learn = _flatten("learner_logprobs", learner_logprobs, sampler_logprobs.shape)
    shape = sampler_logprobs.shape
    if mask is None:
        valid = torch.ones_like(samp, dtype=torch.bool)
    else:
        if not isinstance(mask, torch.Tensor) or mask.shape != shape:
            raise ValueError(f"mask must be a tensor of shape {tuple(shape)}")
        valid = mask.reshape(-1) != 0
    if sampler_logprobs.dim() == 2:
        if cu_seqlens is not None:
            raise ValueError("cu_seqlens must be None for [B, T] input (rows are sequences)")
        num_seqs = shape[0]
        seq_index = torch.arange(num_seqs, device=samp.device).repeat_interleave(shape[1])
    elif sampler_logprobs.dim() == 1:
        if cu_seqlens is None:
            num_seqs, seq_index = 1, torch.zeros_like(samp, dtype=torch.long)
        else:
            offsets = cu_seqlens.long()
            if offsets.dim() != 1 or int(offsets[0]) != 0 or int(offsets[-1]) != samp.numel() or bool(
                (offsets[1:] < offsets[:-1]).any()
            ):
                raise ValueError(f"cu_seqlens must run from 0 to N={samp.numel()}, non-decreasing")
            num_seqs = offsets.numel() - 1
            seq_index = torch.arange(num_seqs, device=samp.device).repeat_interleave(offsets[1:] - offsets[:-1])
    else:
        raise ValueError(f"sampler_logprobs must be [B, T] or [N]; got shape {tuple(shape)}")
    if not bool(torch.isfinite(samp[valid]).all() and torch.isfinite(learn[valid]).all()):
        raise ValueError("sampler_logprobs and learner_logprobs must be finite at unmasked positions")

    s, l_ = samp[valid], learn[valid]
    n = s.numel()
    if n == 0:
        keys = ("k1", "k3", "max_abs_diff", "max_abs_prob_diff", "log_ppl_sampler", "log_ppl_learner", "ppl_ratio",
                "chi2_token", "chi2_seq", "ess_token", "seq_log_ratio_mean", "seq_log_ratio_max", "seq_log_ratio_min")
        return {**{k: 0.0 for k in keys}, "num_tokens": 0.0, "num_seqs": 0.0}
    log_w = l_ - s
    w = torch.exp(log_w)
    seq_log_w = torch.zeros(num_seqs, dtype=torch.float64, device=samp.device).index_add(
        0, seq_index[valid], log_w
    )
    seq_count = torch.zeros(num_seqs, dtype=torch.float64, device=samp.device).index_add(
        0, seq_index[valid], torch.ones_like(log_w)
    )
    seq_log_w = seq_log_w[seq_count > 0]
    return {
        "k1": float((s - l_).mean()),
        "k3": float((w - log_w - 1.0).mean()),
        "max_abs_diff": float((s - l_).abs().max()),
        "max_abs_prob_diff": float((s.exp() - l_.exp()).abs().max()),
        "log_ppl_sampler": float(-s.mean()),
        "log_ppl_learner": float(-l_.mean()),
        "ppl_ratio": float(torch.exp(s.mean() - l_.mean())),
        "chi2_token": float((w * w).mean() - 1.0),
        "chi2_seq": float(torch.exp(2.0 * seq_log_w).mean() - 1.0),
        "ess_token": float(w.sum() ** 2 / (n * (w * w).sum())),
        "seq_log_ratio_mean": float(seq_log_w.mean()),
        "seq_log_ratio_max": float(seq_log_w.max()),
        "seq_log_ratio_min": float(seq_log_w.min()),
        "num_tokens": float(n),
        "num_seqs": float(seq_log_w.numel()),
    }
