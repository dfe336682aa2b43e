"""Vocabulary-parallel policy loss on torch.distributed (Megatron-style tensor parallelism of the lm_head).

Each rank of `vocab_group` holds a contiguous slice of the vocabulary, in group-rank order (sizes may
differ), and passes the logits of its slice with the global token ids. Per call:

1. one collective of the shard sizes (where this rank's slice starts, and V);
2. the stats kernel on the shard: per row its max m_r (a raw logit), log s_r = log sum_j exp((z_j - m_r) / tau),
   its entropy H_r and, on the rank that holds the sampled token, lp_r;
3. one all-gather of those packed statistics ([5, N] float64 per rank), and on every rank the same float64
   combination in rank order (`combine_partials`: bitwise the same on every rank, whatever the collective's
   algorithm): M = max_r m_r, a_r = (m_r - M) / tau + log s_r, log S = logsumexp_r a_r,
   w_r = exp(a_r - log S) (the shard's share of the probability), H = sum_r w_r (H_r - log w_r),
   lp = lp_owner + log w_owner;
4. g and h from the whole batch's lp and H (fused_is/coefficients.py, every configuration, sequence-level
   ones included: the combination gives every lp before any gradient);
5. the kernel's gradient sweep alone over the shard, with the whole row's (M, log S, lp, H) given; the target
   column is written only where the shard has the token.
Loss, logprobs, entropy and metrics are therefore identical on every rank; each rank gets the gradient of its
own shard. The CPU, Triton and torch backends implement the shard primitives (`partial_stats`,
`fused_given`); the CUDA kernel does not yet (a ValueError names it).
"""

from __future__ import annotations

from typing import Optional

import torch

from . import coefficients
from .backends import abi

# a shard row whose max is at or below this and whose log sum is not NaN holds only -inf logits (the kernels floor
# -inf at -1e30, or never raise the max above -3e38): it has no probability, and its other statistics are not
# read. A NaN anywhere in the row makes its log sum NaN in every backend (a NaN-only row too, whose max the
# kernels' comparisons skip), so such a row is never taken for empty: the NaN reaches lp and H (the row flag).
EMPTY_SHARD_MAX = -1.0e29


def _dist(name: str = "vocab_group"):
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise ValueError(f"{name} needs an initialised torch.distributed process group (dist.init_process_group)")
    return dist


def shard_range(vocab_local: int, group, device, host: bool = True):
    """(start of this rank's shard in the global vocabulary, global V): one all-gather of the shard sizes.
    host=False (validate="async") keeps both as 0-d int64 tensors on `device` (no host read; a shard of size
    0 is then a device-side assertion instead of the ValueError)."""
    dist = _dist()
    # gloo gathers CPU tensors, NCCL CUDA ones: the size travels on the logits' device
    size = torch.tensor([vocab_local], dtype=torch.int64, device=device)
    sizes = gather_ranks(size, group).reshape(-1)
    rank = dist.get_rank(group)
    if not host or torch.compiler.is_compiling():  # under compile: traced, no host read
        torch._assert_async((sizes > 0).all(),
                            "fused_is: every rank of vocab_group needs a vocabulary shard of size >= 1")
        return sizes[:rank].sum(), sizes.sum()
    sizes = sizes.tolist()
    if min(sizes) < 1:  # raised on every rank (each has the sizes), so no rank is left waiting in a collective
        raise ValueError(f"logits: every rank of vocab_group needs a vocabulary shard of size >= 1; got sizes {sizes}")
    return sum(sizes[:rank]), sum(sizes)


def sum_shard_partials_(tensor: torch.Tensor, group) -> None:
    """The vocabulary shards' partial sums in `tensor` (a shard's part of d hidden) added up over the ranks of
    `group`, in place, eager only. (The reductions of sequence statistics and totals, out of place and traced
    under torch.compile, are fused_is/reductions.py `all_reduce`.)"""
    _dist().all_reduce(tensor, group=group)


def open_shard(x, arg: str, shape: str, vocab_dim: int, group, validate: str):
    """(start, V) of this rank's vocabulary shard of `x` (the logits' last dimension, or the lm_head weight's
    first): the group and x checked, then the size collective, first of all collectives, so that a shard of
    size 0 is an error on every rank (no rank left waiting); validate="async" keeps both on the device."""
    check_group(group)
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{arg} must be a torch.Tensor of shape {shape}; got {type(x).__name__}")
    return shard_range(x.shape[vocab_dim], group, x.device, host=validate != "async")


def shard_partials(logits: torch.Tensor, tokens: torch.Tensor, start, temperature, impl):
    """(shard-local ids, -1 where another shard has the token; this shard's [5, N] float64 partial statistics:
    lp_r, H_r, m_r, log s_r, owned_r) from the shard's stats kernel; no collective. tokens: global ids [N]."""
    local = tokens - start
    owned = (local >= 0) & (local < logits.shape[-1])
    kernel_ids = torch.where(owned, local, torch.zeros_like(local))  # a valid column; lp read only where owned
    lp_r, ent_r, m_r, log_s_r = impl.partial_stats(logits, kernel_ids, temperature)
    ids = torch.where(owned, local, torch.full_like(local, -1))
    return ids, torch.stack([lp_r, ent_r, m_r, log_s_r, owned.double()])


def gather_ranks(tensor: torch.Tensor, group) -> torch.Tensor:
    """[world, *tensor.shape]: every rank's `tensor`, in group-rank order (the one collective of the shard
    combination; the seam the in-process shard tests replace)."""
    dist = _dist()
    world = dist.get_world_size(group)
    if torch.compiler.is_compiling():  # the functional collective, which torch.compile traces into the graph
        from torch.distributed import _functional_collectives as funcol

        return funcol.all_gather_tensor(tensor.contiguous(), 0, group).reshape((world,) + tuple(tensor.shape))
    out = torch.empty((world,) + tuple(tensor.shape), dtype=tensor.dtype, device=tensor.device)
    dist.all_gather(list(out.unbind(0)), tensor.contiguous(), group=group)
    return out


def combine_partials(gathered: torch.Tensor, inv_tau):
    """Whole-row statistics (lp, H, M, log S) float64 [N] from every rank's [5, N] partials (lp_r, H_r, m_r,
    log s_r, owned_r), stacked in rank order ([world, 5, N]): M = max_r m_r, a_r = (m_r - M) / tau + log s_r,
    S = sum_r e^a_r, H = sum_r e^a_r (H_r - a_r) / S + log S, lp = lp_owner + a_owner - log S. The sums run over
    the ranks in rank order on every rank, so every rank gets bitwise the same values whatever the collective's
    algorithm. A shard row holding only -inf adds nothing; NaN stays NaN (the row flag)."""
    lp_r, ent_r, m_r, log_s_r, owned = gathered.unbind(1)
    empty = (m_r <= EMPTY_SHARD_MAX) & ~torch.isnan(log_s_r)
    top = torch.where(empty, torch.full_like(m_r, float("-inf")), m_r).amax(0)
    a = torch.where(empty, torch.full_like(m_r, float("-inf")), (m_r - top) * inv_tau + log_s_r)
    e = torch.exp(a)
    zero = torch.zeros_like(m_r)
    total = e.sum(0)
    log_total = torch.log(total)
    entropy = torch.where(empty, zero, e * (ent_r - a)).sum(0) / total + log_total
    lp = torch.where(owned > 0, lp_r + a, zero).sum(0) - log_total
    return lp, entropy, top, log_total


def reduce_partials(parts: torch.Tensor, inv_tau, group):
    """Whole-row statistics (lp, H, M, log S) float64 [N] from this rank's [5, N] partials: one all-gather of
    O(N) per rank, then `combine_partials` in rank order, whatever the group's size."""
    return combine_partials(gather_ranks(parts, group), inv_tau)


def describe_shard_row(row_values, row_name, start):
    """The diagnosis of a flagged row from this rank's shard, which may not be the one at fault.
    row_values(row): that row's [V_local] logits; row_name(row): how the error names the row."""
    def describe(row: int) -> str:
        values = row_values(row).double()
        for name, bad in (("NaN", torch.isnan(values)), ("+inf", torch.isposinf(values))):
            if bool(bad.any()):
                column = int(bad.nonzero()[0, 0])
                return (f"{row_name(row)} holds {name} at column {column} of this rank's vocabulary shard "
                        f"(global id {int(start) + column})")
        return (f"{row_name(row)} has no finite logprob or entropy across the vocabulary shards: NaN or +inf in "
                "another rank's shard, every logit -inf, or the sampled token's logit -inf")

    return describe


def describe_logits_shard(logits: torch.Tensor, start):
    """describe_shard_row for a [B, T, V_local] or [N, V_local] logits shard."""
    def row_values(row: int) -> torch.Tensor:
        return logits[row // logits.shape[1], row % logits.shape[1]] if logits.dim() == 3 else logits[row]

    return describe_shard_row(row_values, lambda row: f"row {row} of logits", start)


def kernel_statistics(stats: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """The whole rows' [4, N] statistics as the gradient sweep takes them: rows past the check that are masked
    may hold anything (their g = h = 0), so their statistics are made finite."""
    return torch.where(valid & torch.isfinite(stats), stats, torch.zeros_like(stats))


def given_args(call, lp: torch.Tensor) -> abi.KernelArgs:
    """The kernel arguments with g and h given per row, from every row's lp (all configurations; `abi.pack`
    already gives them for the sequence-ratio ones)."""
    args = abi.pack(call, lp)
    if not call.config.coefficients_given:
        weight = coefficients.policy_weight(call, lp)
        g, h = coefficients.coefficients(call, lp, slice(None), weight)
        args.row_table[abi.ROW_INPUTS.index("g")].copy_(g)
        args.row_table[abi.ROW_INPUTS.index("h")].copy_(h)
        args.ints["coef_source"] = abi.ENUMS["coef_source"]["given"]
    return args


def check_group(group, name: str = "vocab_group") -> Optional[object]:
    """The vocab_group (or sequence_group) argument: None, or a process group of an initialised torch.distributed."""
    if group is None:
        return None
    dist = _dist(name)
    if group is not dist.group.WORLD and not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"{name} must be a torch.distributed ProcessGroup (or dist.group.WORLD); got "
                        f"{type(group).__name__}")
    return group


def global_normalizer(mask, *, config="ppo_tis", cu_seqlens=None, group=None, micro_batches: int = 1,
                      gradients: str = "mean") -> float:
    """The `normalizer=` of `policy_loss` for data-parallel training with gradient accumulation: the token count
    (loss_agg="token-mean") or the count of sequences with an unmasked token (the seq-mean aggregations) of the
    whole optimizer step, across the ranks of `group`, so that the per-rank, per-micro-batch losses add up to
    the loss of the whole step computed in one process.

    Args:
        mask: this rank's mask, bool or 0/1 [B, T] (padded) or [N] (packed, with cu_seqlens [S + 1]); or a list
            of them, one per micro-batch of the step (then with a list of cu_seqlens for packed masks): counted
            exactly.
        config: the preset name or LossConfig whose loss_agg decides what is counted.
        group: the data-parallel process group (None: the default group; no torch.distributed: this process).
        micro_batches: with a single mask, the number of micro-batches of the step, each assumed to count as
            many as this one (TRL's convention); with a list, leave it at 1.
        gradients: "mean" when the ranks' gradients are averaged (DDP and FSDP do): the count divided by the
            group size, so the average of the ranks' gradients is the step's gradient (verl's
            batch_num_tokens / dp_size); "sum" when they are summed.
    Returns:
        A positive float (1.0 when nothing is unmasked anywhere, so that the loss is 0, not 0 / 0). One
        all-reduce of a single number (a host sync).
    """
    from .config import resolve_config

    cfg = resolve_config(config)
    if gradients not in ("mean", "sum"):
        raise ValueError(f"gradients must be 'mean' or 'sum'; got {gradients!r}")
    if isinstance(micro_batches, bool) or not isinstance(micro_batches, int) or micro_batches < 1:
        raise ValueError(f"micro_batches must be a positive int; got {micro_batches!r}")
    masks = list(mask) if isinstance(mask, (list, tuple)) else [mask]
    if len(masks) > 1 and micro_batches != 1:
        raise ValueError("pass either a list of the step's masks or micro_batches, not both")
    offsets = list(cu_seqlens) if isinstance(cu_seqlens, (list, tuple)) else [cu_seqlens] * len(masks)
    if len(offsets) != len(masks):
        raise ValueError(f"cu_seqlens must be one per mask; got {len(offsets)} for {len(masks)} masks")
    count = torch.zeros((), dtype=torch.float64)
    for m, offs in zip(masks, offsets):
        count += _count(m, offs, cfg.loss_agg).cpu()
    count *= micro_batches
    world = 1
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        world = dist.get_world_size(group)
        backend = dist.get_backend(group)
        device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        total = count.to(device)
        dist.all_reduce(total, group=group)
        count = total.cpu()
    value = float(count)
    if value == 0.0:
        return 1.0
    return value / world if gradients == "mean" else value


def _count(mask, cu_seqlens, loss_agg: str) -> torch.Tensor:
    if not isinstance(mask, torch.Tensor) or mask.dtype.is_complex:
        raise TypeError("mask must be a bool or 0/1 torch.Tensor")
    valid = mask != 0
    if loss_agg == "token-mean":
        return valid.sum().double()
    if valid.dim() == 2:
        if cu_seqlens is not None:
            raise ValueError("cu_seqlens must be None for a padded [B, T] mask")
        return valid.any(dim=1).sum().double()
    if cu_seqlens is None:
        raise ValueError(f"cu_seqlens is required to count sequences of a packed mask (loss_agg={loss_agg!r})")
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError("cu_seqlens must be a 1-D tensor of S + 1 >= 2 offsets")
    offsets = cu_seqlens.long().to(valid.device)
    n = valid.numel()
    if int(offsets[0]) != 0 or int(offsets[-1]) != n or bool((offsets[1:] < offsets[:-1]).any()):
        raise ValueError(f"cu_seqlens must start at 0, be non-decreasing and end at N={n} (the mask's length)")
    per_seq = torch.zeros(offsets.numel() - 1, dtype=torch.float64, device=valid.device)
    seq = torch.searchsorted(offsets[1:].contiguous(), torch.arange(n, device=valid.device), right=True)
    per_seq.index_add_(0, seq.clamp_(max=per_seq.numel() - 1), valid.reshape(-1).double())
    return (per_seq > 0).sum().double()


# --- both models' shards: distillation (fused_is/distill.py `sharded_statistics`) -----------------------------------
#
# Each rank holds a shard r of both rows. Per model the shard's normaliser is kept as (top_r, log_sum_r): torch
# backend (0, log sum_{j in r} e^{z_j / tau}), Triton the kernel's (raw max m_r, log2 sum_{j in r} 2^{(z_j - m_r) c})
# with c = log2(e) / tau as the kernels take it. Merged in rank order, with M = max_r top_r and
#     a_r = ((top_r - M) c + log_sum_r) unit   (unit: 1, or ln 2 for the Triton's bits),   A = log sum_r e^{a_r},
# the whole row's log-sum-exp is M / tau + A (torch: A) and ln P_r = a_r - A is the share of the student's
# probability in shard r (ln Q_r the teacher's). The KLs then need no second read: with D_r the KL of the shard's own
# renormalised distributions (what the statistics sweep gives on the shard),
#     KL(q || p) = sum_r Q_r (D_r + ln Q_r - ln P_r),   KL(p || q) = sum_r P_r (D_r + ln P_r - ln Q_r),
# a shard without teacher (student) mass adding 0. JSD's m = (1 - beta) p + beta q needs the whole rows' p and q, so
# each shard sums its part of KL(p || m) and KL(q || m) given the merged normalisers, and those are summed in rank
# order. Every merge runs on the all-gathered [world, ..., N] float64 parts, the same arithmetic on every rank.


def sum_in_rank_order(parts: torch.Tensor) -> torch.Tensor:
    """sum_r parts[r] of [world, ...], added one rank after the other."""
    total = parts[0]
    for part in parts[1:]:
        total = total + part
    return total


def merge_normalisers(top, log_sum, scale: float, unit: float, temperature: float):
    """(the whole rows' log-sum-exp [N]; each shard's log share of the probability [world, N]; the whole rows' top
    and log sum in the shards' units [N]) from every shard's (top, log_sum) [world, N] (above). A shard whose row
    is all -inf adds nothing (log_sum -inf); NaN and +inf stay non-finite (the row check names them)."""
    whole_top = top.amax(0)
    a = ((top - whole_top) * scale + log_sum) * unit
    ceiling = a.amax(0)
    ceiling = torch.where(torch.isfinite(ceiling), ceiling, torch.zeros_like(ceiling))
    log_total = ceiling + torch.log(sum_in_rank_order(torch.exp(a - ceiling)))
    return whole_top / temperature + log_total, a - log_total, whole_top, log_total / unit


def merge_pair_shards(gathered: torch.Tensor, scales, unit: float, temperatures):
    """The whole rows' statistics of both models from every shard's [5, N] parts ([world, 5, N], rows fused_is.distill
    SHARD_PARTS, in rank order): (log-sum-exps float64 [2, N]; each shard's log shares of the student's and of the
    teacher's probability, [world, N] each; the whole rows' tops and log sums in the shards' units [4, N]: the
    kernels' first four statistics rows; the shards' own divergences [world, N])."""
    top_s, log_sum_s, top_t, log_sum_t, shard_divergence = gathered.unbind(1)
    lse_s, share_s, whole_top_s, whole_log_s = merge_normalisers(top_s, log_sum_s, scales[0], unit, temperatures[0])
    lse_t, share_t, whole_top_t, whole_log_t = merge_normalisers(top_t, log_sum_t, scales[1], unit, temperatures[1])
    whole = torch.stack([whole_top_s, whole_log_s, whole_top_t, whole_log_t])
    return torch.stack([lse_s, lse_t]), (share_s, share_t), whole, shard_divergence

