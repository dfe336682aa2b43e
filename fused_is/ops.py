"""Kernel-level torch.library custom ops: the row primitives with plain typed arguments and registered fakes.

The differentiable logprobs (fused_is/logprobs.py) and `token_logprobs` call these ops in eager mode and under
torch.compile alike, so that torch.compile traces the O(N) torch code around them like any torch code and sees
each kernel launch as one opaque node whose fake gives the output shapes:

- `fused_is::row_stats(logits, ids, valid, temperature, row_temperature, backend, validate) -> [4, N] float64`:
  the stats sweep (row max, log sum, lp, H of each row; one read of the logits), then the value check of the rows
  (`validate.check_rows`: ValueError naming the first unmasked row whose lp or H is not finite), at run time;
- `fused_is::token_stats(...) -> [2, N] float64`: lp and H alone (`token_logprobs`; every backend's stats kernel);
- `fused_is::gradient_from_stats(logits, ids, stats, row_table, ints, floats, temperature, backend, grad!)`: the
  given-statistics gradient sweep, which writes d loss / d logits into `grad` (declared mutated) from the rows'
  statistics and the upstream per-row gradients g and h in the kernel contract's row table (fused_is/backends/abi.py);
- `fused_is::checked(x, flags, messages) -> x`: x once the call's value flags are clear, else the ValueError of
  the first set flag (`messages`: one line per flag). Under torch.compile the argument checks cannot read the
  host while dynamo traces; their flags gate the ids every kernel reads, so they run before any kernel.

policy_loss under torch.compile still runs as one whole-forward op (fused_is/custom_op.py).
"""

from __future__ import annotations

from typing import List, Optional

import torch

from . import backends

Tensor = torch.Tensor


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

    lp, entropy, top, log_total = backends.module(backend).partial_stats(logits, ids,
                                                                         _temperature(temperature, row_temperature))
    check_rows(logits, ids, lp, entropy, valid, validate)
    stats = torch.stack([top, log_total, lp, entropy])
    return torch.where(valid & torch.isfinite(stats), stats, torch.zeros_like(stats))


@row_stats.register_fake
def _(logits, ids, valid, temperature, row_temperature, backend, validate):
    return logits.new_empty((4, ids.numel()), dtype=torch.float64)


@torch.library.custom_op("fused_is::token_stats", mutates_args=())
def token_stats(logits: Tensor, ids: Tensor, valid: Tensor, temperature: float, row_temperature: Optional[Tensor],
                backend: str, validate: str) -> Tensor:
    """[2, N] float64 (lp, H) of softmax(logits / tau) at ids: `row_stats` without the rows' max and log sum (every
    backend's stats kernel, cuda included), the rows checked alike."""
    from .validate import check_rows

    lp, entropy = backends.module(backend).stats(logits, ids, _temperature(temperature, row_temperature))
    check_rows(logits, ids, lp, entropy, valid, validate)
    return torch.stack([lp, entropy])


@token_stats.register_fake
def _(logits, ids, valid, temperature, row_temperature, backend, validate):
    return logits.new_empty((2, ids.numel()), dtype=torch.float64)


@torch.library.custom_op("fused_is::gradient_from_stats", mutates_args=("grad",))
def gradient_from_stats(logits: Tensor, ids: Tensor, stats: Tensor, row_table: Tensor, ints: List[int],
                        floats: List[float], temperature: Optional[float], backend: str, grad: Tensor) -> None:
    """Writes into grad (logits' shape and dtype) d loss / d z = (g (1[j = y] - p) - h p (log p + H)) / tau per row:
    stats float64 [4, N] from `row_stats`, g and h in the row table (float64 [len(abi.ROW_INPUTS), N]); ints and
    floats: the kernel parameters in the order of abi.INT_PARAMS and abi.FLOAT_PARAMS; temperature: the call's
    one temperature, None when the row table's inv_tau differs per row."""
    from .backends import abi

    args = abi.KernelArgs(row_table, dict(zip(abi.INT_PARAMS, ints)), dict(zip(abi.FLOAT_PARAMS, floats)),
                          temperature)
    backends.module(backend).fused_given(logits, ids, stats, args, grad)


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
