"""Per-sequence and batch reductions over O(N) vectors, over the ranks of a process group when one is given
(context parallel). The one place fused_is all-reduces a sequence statistic."""

from __future__ import annotations

import torch


def sequence_sum(x: torch.Tensor, seq_index: torch.Tensor, num_seqs: int, group=None) -> torch.Tensor:
    """[num_seqs] sums of the per-token x over each sequence, over every rank of `group` (context parallel)."""
    out = torch.zeros(num_seqs, dtype=x.dtype, device=x.device).index_add_(0, seq_index, x)
    return all_reduce(out, group, "sum")


def sequence_max(x: torch.Tensor, seq_index: torch.Tensor, num_seqs: int, group=None) -> torch.Tensor:
    """[num_seqs] max of the per-token x (>= 0; masked tokens 0) over each sequence, 0 for an empty one, over
    every rank of `group`."""
    out = torch.zeros(num_seqs, dtype=x.dtype, device=x.device).scatter_reduce_(0, seq_index, x, "amax")
    return all_reduce(out, group, "max")


def all_reduce(x: torch.Tensor, group, op: str = "sum") -> torch.Tensor:
    """x reduced over the ranks of `group` (a new tensor), or x itself when group is None."""
    if group is None:
        return x
    if torch.compiler.is_compiling():  # the functional collective, which torch.compile traces into the graph
        from torch.distributed import _functional_collectives as funcol

        return funcol.all_reduce(x, op, group)
    import torch.distributed as dist

    out = x.clone()
    dist.all_reduce(out, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}[op],
                    group=group)
    return out
