"""Kernel-level torch.library custom ops: the row primitives with plain typed arguments and registered fakes.

`policy_loss`, `logprobs` and `token_logprobs` reach their kernels through these ops under torch.compile, which then
traces the O(N) torch code around them (the argument checks, the per-token math, the collectives of the process
groups as functional collectives) like any torch code and sees each launch as one opaque node whose fake gives the
output shapes. `logprobs` and `token_logprobs` call them in eager mode too; eager `policy_loss` calls the backend
primitives directly (`Traced` below is the plan's view of the ops under compile):

- `fused_is::stats(logits, ids, temperature, row_temperature, backend) -> [2, N] float64`: lp and H of each row
  (every backend's stats kernel, cuda included);
- `fused_is::partial_stats(...) -> [4, N] float64`: a vocabulary shard's lp, H, row max and log sum;
- `fused_is::row_stats(logits, ids, valid, temperature, row_temperature, backend, validate) -> [4, N] float64`:
  the whole rows' max, log sum, lp and H, masked rows made finite, the rows checked (`logprobs`' forward);
- `fused_is::fused_rows(logits, ids, row_table, ints, floats, temperature, backend, grad!) -> [2, N]`: the one-pass
  kernel, lp and H, and the gradient written into `grad` (declared mutated) from g and h that the kernel forms
  from the kernel contract's row table and parameters (fused_is/backends/abi.py);
- `fused_is::gradient_from_stats(logits, ids, stats, row_table, ints, floats, temperature, backend, grad!)`: the
  given-statistics gradient sweep, from the rows' statistics and g and h given per row (the upstream gradients of
  `logprobs`, a vocabulary shard's coefficients);
- `fused_is::checked_rows(logits, ids, lp, entropy, valid, validate, shard_start) -> [2, N]`: lp and H once every
  valid row's are finite, else the ValueError naming the row (`validate.check_rows`);
- `fused_is::checked(x, flags, messages) -> x`: x once the argument checks' flags are clear, else the ValueError of
  the first set flag. While dynamo traces, the checks cannot read the host; their flags gate the ids that every
  kernel reads, so they run before any kernel.

`distill_loss` (and policy_loss's distillation term) reach the two sweeps of fused_is/distill.py through these under
torch.compile, every backend of distill_loss alike (its dispatch, `statistics_sweep` and `gradient_sweep`, runs inside
them); eager calls run the sweeps directly. The sweep's description travels as plain typed scalars
(`distill.op_arguments`: divergence, floats [beta, temperature, teacher_temperature], ints [top_k, add_tail], backend):

- `fused_is::distill_stats(logits, teacher, valid, ...) -> (stats [k, N] float64, support int64 [N, K'],
  support_grad float64 [N, K'])`: the statistics sweep (`distill.pack_stats` gives the layout), unchecked;
- `fused_is::distill_checked(logits, teacher, valid, stats, kind, shard_start) -> stats`: a copy once every valid
  row's log-sum-exps and divergence are finite, else the ValueError naming the row and the model;
- `fused_is::distill_gradient(logits, teacher, valid, stats, support, support_grad, weight, ..., grad!)`: the
  gradient sweep, written (or added: ints' third entry, accumulate) into grad;
- `fused_is::distill_jsd_given(logits, teacher, valid, stats, ...) -> [2, N] float64`: a vocabulary shard's parts of
  JSD's two KLs, the whole rows' statistics given (vocab_group).
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch

from . import backends, divergences
from .backends import torch_chunked

Tensor = torch.Tensor


def split_temperature(temperature) -> Tuple[float, Optional[Tensor]]:
    """(float, float64 [N] or None): a call's temperature (a float, or float64 [N] per row) as the ops below take it,
    one float and an optional per-row tensor (1.0 and the tensor, or the float and None)."""
    if isinstance(temperature, Tensor):
        return 1.0, temperature
    return float(temperature), None


def _temperature(temperature: float, row_temperature: Optional[Tensor]):
    """The backends' temperature argument: the per-row float64 [N] when given, else the float."""
    return temperature if row_temperature is None else row_temperature


@torch.library.custom_op("fused_is::row_stats", mutates_args=())
def row_stats(logits: Tensor, ids: Tensor, valid: Tensor, temperature: float, row_temperature: Optional[Tensor],
              backend: str, validate: str) -> Tensor:
    """[4, N] float64 (row max, log sum, lp, H) of softmax(logits / tau) at ids (int64 [N] in [0, V)), masked rows
    (valid False) made finite; ValueError naming the first unmasked row whose lp or H is not finite (validate
    "full"; "async": a device-side assertion). logits: [B, T, V] or [N, V]; row_temperature: float64 [N] per row,
    or None (temperature for every row)."""
    from .validate import check_rows

    lp, entropy, top, log_total = backends.implementation(backend).partial_stats(logits, ids,
                                                                         _temperature(temperature, row_temperature))
    check_rows(logits, ids, lp, entropy, valid, validate)
    stats = torch.stack([top, log_total, lp, entropy])
    return torch.where(valid & torch.isfinite(stats), stats, torch.zeros_like(stats))


@row_stats.register_fake
def _(logits, ids, valid, temperature, row_temperature, backend, validate):
    return logits.new_empty((4, ids.numel()), dtype=torch.float64)


@torch.library.custom_op("fused_is::stats", mutates_args=())
def stats(logits: Tensor, ids: Tensor, temperature: float, row_temperature: Optional[Tensor], backend: str) -> Tensor:
    """[2, N] float64 (lp, H) of softmax(logits / tau) at ids: every backend's stats kernel, cuda included (no
    check: `checked_rows` reads them)."""
    return torch.stack(backends.implementation(backend).stats(logits, ids, _temperature(temperature, row_temperature)))


@stats.register_fake
def _(logits, ids, temperature, row_temperature, backend):
    return logits.new_empty((2, ids.numel()), dtype=torch.float64)


@torch.library.custom_op("fused_is::partial_stats", mutates_args=())
def partial_stats(logits: Tensor, ids: Tensor, temperature: float, row_temperature: Optional[Tensor],
                  backend: str) -> Tensor:
    """[4, N] float64 (lp, H, row max, log sum) of a vocabulary shard's rows (fused_is/distributed.py), unchecked."""
    return torch.stack(backends.implementation(backend).partial_stats(logits, ids, _temperature(temperature,
                                                                                        row_temperature)))


@partial_stats.register_fake
def _(logits, ids, temperature, row_temperature, backend):
    return logits.new_empty((4, ids.numel()), dtype=torch.float64)


@torch.library.custom_op("fused_is::fused_rows", mutates_args=("grad",))
def fused_rows(logits: Tensor, ids: Tensor, row_table: Tensor, ints: List[int], floats: List[float],
               temperature: Optional[float], backend: str, grad: Tensor) -> Tensor:
    """[2, N] float64 (lp, H), and d loss / d logits written into grad in the same sweep: the one-pass kernel, which
    forms each row's g and h itself from the row table and the parameters (as for `gradient_from_stats`)."""
    from .backends import abi

    args = abi.KernelArgs(row_table, dict(zip(abi.INT_PARAMS, ints)), dict(zip(abi.FLOAT_PARAMS, floats)),
                          temperature)
    if backend == "torch":  # it forms g and h in Python (KernelArgs.coefficients); under torch.compile it is traced
        raise ValueError("fused_is::fused_rows runs the cpu, triton and cuda kernels; the torch backend is traced")
    return torch.stack(backends.implementation(backend).fused(logits, ids, args, grad))


@fused_rows.register_fake
def _(logits, ids, row_table, ints, floats, temperature, backend, grad):
    return logits.new_empty((2, ids.numel()), dtype=torch.float64)


@torch.library.custom_op("fused_is::checked_rows", mutates_args=())
def checked_rows(logits: Optional[Tensor], ids: Tensor, lp: Tensor, entropy: Tensor, valid: Tensor, validate: str,
                 shard_start: Optional[Tensor]) -> Tensor:
    """[2, N]: copies of lp and entropy once every valid row's lp and H are finite; else the ValueError of
    `validate.check_rows`, which names the first bad row and reads it in the logits to say why (validate "async": a
    device-side assertion). shard_start: where a vocabulary shard's logits start in the global ids (0-d int64), None
    for whole rows."""
    from .distributed import describe_logits_shard
    from .validate import check_rows

    describe = None if shard_start is None else describe_logits_shard(logits, int(shard_start))
    check_rows(logits, ids, lp, entropy, valid, validate, describe)
    return torch.stack([lp, entropy])


@checked_rows.register_fake
def _(logits, ids, lp, entropy, valid, validate, shard_start):
    return lp.new_empty((2,) + tuple(lp.shape))


@torch.library.custom_op("fused_is::gradient_from_stats", mutates_args=("grad",))
def gradient_from_stats(logits: Tensor, ids: Tensor, stats: Tensor, row_table: Tensor, ints: List[int],
                        floats: List[float], temperature: Optional[float], backend: str, grad: Tensor) -> None:
    """Writes into grad (logits' shape and dtype; in eager mode it may be the logits themselves, inplace=True)
    d loss / d z = (g (1[j = y] - p) - h p (log p + H)) / tau per row. stats: float64 [4, N] from `row_stats`;
    g and h: in the row table (float64 [len(abi.ROW_INPUTS), N]); ints and floats: the kernel parameters in the
    order of abi.INT_PARAMS and abi.FLOAT_PARAMS; temperature: the call's one temperature, None when the row
    table's inv_tau differs per row."""
    from .backends import abi

    args = abi.KernelArgs(row_table, dict(zip(abi.INT_PARAMS, ints)), dict(zip(abi.FLOAT_PARAMS, floats)),
                          temperature)
    backends.implementation(backend).fused_given(logits, ids, stats, args, grad)


@gradient_from_stats.register_fake
def _(logits, ids, stats, row_table, ints, floats, temperature, backend, grad):
    return None


@torch.library.custom_op("fused_is::checked", mutates_args=())
def checked(x: Tensor, flags: Tensor, messages: str) -> Tensor:
    """A copy of x when no flag (bool [k]) is set; else ValueError with line i of messages for the first set flag i."""
    if bool(flags.any()):
        first = int(flags.nonzero()[0, 0])
        raise ValueError(messages.split("\n")[first] + " (under torch.compile; call eagerly for the position)")
    return x.clone()


@checked.register_fake
def _(x, flags, messages):
    return torch.empty_like(x)


@torch.library.custom_op("fused_is::distill_stats", mutates_args=())
def distill_stats(logits: Tensor, teacher: Tensor, valid: Tensor, divergence: str, floats: List[float],
                  ints: List[int], backend: str) -> Tuple[Tensor, Tensor, Tensor]:
    """(stats float64 [k, N], support int64 [N, K'], support_grad float64 [N, K']): the distillation statistics sweep
    of fused_is/distill.py on `backend` (`statistics_sweep`), packed by `distill.pack_stats` (K' = 0 without top_k);
    unchecked (`distill_checked` reads them). divergence, floats, ints, backend: `distill.op_arguments`."""
    from . import distill

    call = distill.sweep_call(logits, teacher, valid, divergence, floats, ints, backend)
    return distill.pack_stats(call, distill.statistics_sweep(call))


@distill_stats.register_fake
def _(logits, teacher, valid, divergence, floats, ints, backend):
    from . import distill

    n, width = valid.numel(), divergences.DIVERGENCES[divergence].support_width(ints[0])
    return (logits.new_empty((distill.packed_rows(backend), n), dtype=torch.float64),
            logits.new_empty((n, width), dtype=torch.int64), logits.new_empty((n, width), dtype=torch.float64))


@torch.library.custom_op("fused_is::distill_checked", mutates_args=())
def distill_checked(logits: Tensor, teacher: Tensor, valid: Tensor, stats: Tensor, kind: str,
                    shard_start: Optional[Tensor]) -> Tensor:
    """A copy of stats (`distill_stats`' layout) once every valid row's two log-sum-exps (rows 0 and 1) and divergence
    (row 2) are finite; else the ValueError of `distill.check_pair_rows`, which names the first bad row and reads it in
    both models to say which holds what. kind: the divergence's name in that message; shard_start: where a vocabulary
    shard starts in the whole vocabulary (0-d int64), None for whole rows."""
    from . import distill

    describe = None
    if shard_start is not None:
        describe = distill.describe_pair_shard_row(logits, teacher, int(shard_start), stats[:2])
    distill.check_pair_rows(logits, teacher, valid, stats[:2], stats[2], kind, describe)
    return stats.clone()


@distill_checked.register_fake
def _(logits, teacher, valid, stats, kind, shard_start):
    return torch.empty_like(stats)


@torch.library.custom_op("fused_is::distill_gradient", mutates_args=("grad",))
def distill_gradient(logits: Tensor, teacher: Tensor, valid: Tensor, stats: Tensor, support: Tensor,
                     support_grad: Tensor, weight: Tensor, divergence: str, floats: List[float], ints: List[int],
                     backend: str, grad: Tensor) -> None:
    """Writes into grad (the logits' shape and dtype) weight_t F_t / tau of every row, or adds it (a third entry of
    ints, accumulate, set: the torch sweep of policy_loss's distillation term): the gradient sweep of
    fused_is/distill.py (`gradient_sweep`), given the statistics of `distill_stats` (checked) and weight float64 [N]."""
    from . import distill

    call = distill.sweep_call(logits, teacher, valid, divergence, floats, ints[:2], backend)
    distill.gradient_sweep(call, distill.unpack_stats(call, stats, support, support_grad), weight, grad,
                           accumulate=bool(ints[2]))


@distill_gradient.register_fake
def _(logits, teacher, valid, stats, support, support_grad, weight, divergence, floats, ints, backend, grad):
    return None


@torch.library.custom_op("fused_is::distill_jsd_given", mutates_args=())
def distill_jsd_given(logits: Tensor, teacher: Tensor, valid: Tensor, stats: Tensor, divergence: str,
                      floats: List[float], ints: List[int], backend: str) -> Tensor:
    """float64 [2, N]: a vocabulary shard's parts of KL(p || m) and KL(q || m), p, q and m the whole rows' given by
    stats (`distill_stats`' layout, the merged values): `distill.jsd_shard_sums`."""
    from . import distill

    call = distill.sweep_call(logits, teacher, valid, divergence, floats, ints, backend)
    empty = stats.new_empty((valid.numel(), 0), dtype=torch.int64)
    return distill.jsd_shard_sums(call, distill.unpack_stats(call, stats, empty, empty.double()))


@distill_jsd_given.register_fake
def _(logits, teacher, valid, stats, divergence, floats, ints, backend):
    return logits.new_empty((2, valid.numel()), dtype=torch.float64)


class Traced:
    """The plan's primitives (fused_is/plan.py) under torch.compile: the kernel-level ops above for the cpu, triton and
    cuda kernels, or the torch backend's own chunked torch code, which dynamo traces like the rest."""

    def __init__(self, name: str):
        self.name = name

    def stats(self, logits: Tensor, tokens: Tensor, temperature):
        if self.name == "torch":
            return torch_chunked.stats(logits, tokens, temperature)
        tau, row_tau = split_temperature(temperature)
        return torch.ops.fused_is.stats(logits, tokens, tau, row_tau, self.name).unbind(0)

    def partial_stats(self, logits: Tensor, tokens: Tensor, temperature):
        if self.name == "torch":
            return torch_chunked.partial_stats(logits, tokens, temperature)
        tau, row_tau = split_temperature(temperature)
        return torch.ops.fused_is.partial_stats(logits, tokens, tau, row_tau, self.name).unbind(0)

    def fused_given(self, logits: Tensor, tokens: Tensor, stats: Tensor, args, grad: Tensor) -> None:
        if self.name == "torch":
            return torch_chunked.fused_given(logits, tokens, stats, args, grad)
        torch.ops.fused_is.gradient_from_stats(logits, tokens, stats, args.row_table, args.int_list(),
                                               args.float_list(), args.temperature, self.name, grad)

    def fused(self, logits: Tensor, tokens: Tensor, args, grad: Tensor):
        if self.name == "torch":
            return torch_chunked.fused(logits, tokens, args, grad)
        return torch.ops.fused_is.fused_rows(logits, tokens, args.row_table, args.int_list(), args.float_list(),
                                             args.temperature, self.name, grad).unbind(0)
