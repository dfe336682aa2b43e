"""Errors about the logits' values, found by the kernels' own sweep instead of an extra pass.

A -inf logit is legal (padded vocabulary, banned or filtered tokens): it has probability 0 and adds 0 to
the entropy and the gradient. Everything else that is not finite makes the row's lp or H non-finite in
every backend, because the kernels let NaN and +inf reach the row's sums (csrc/fused_is_math.h,
triton_kernels/policy_loss.py): a NaN or +inf logit, a row whose logits are all -inf, a sampled token
whose logit is -inf. So the row flag is `not isfinite(lp) or not isfinite(H)`, read from the O(N) outputs
after the kernel, and only a flagged row is looked at again, to say which of these it is.
"""

from __future__ import annotations

from typing import Optional

import torch


def _row_name(logits: torch.Tensor, row: int) -> str:
    if logits.dim() == 3:
        t = logits.shape[1]
        return f"row {row} (logits[{row // t}, {row % t}])"
    return f"row {row}"


def describe_bad_row(logits: torch.Tensor, tokens: torch.Tensor, row: int) -> str:
    """Why row `row` (of the N flattened rows) has a non-finite logprob or entropy: one row read on the host."""
    # indexed, not reshaped: a padded slice such as logits[:, :-1] cannot be viewed as [N, V] (a full copy)
    values = (logits[row // logits.shape[1], row % logits.shape[1]] if logits.dim() == 3 else logits[row])
    return describe_values(values, _row_name(logits, row), int(tokens.reshape(-1)[row]))


def describe_values(values: torch.Tensor, where: str, token: int) -> str:
    """Why a row of logits `values` [V] with sampled token `token` gives a non-finite logprob or entropy;
    `where` names the row in the message."""
    values = values.detach().double()
    nan = torch.isnan(values)
    if bool(nan.any()):
        return f"logits hold NaN at {where}, column {int(nan.nonzero()[0, 0])}"
    posinf = torch.isposinf(values)
    if bool(posinf.any()):
        return f"logits hold +inf at {where}, column {int(posinf.nonzero()[0, 0])}"
    if bool(torch.isneginf(values).all()):
        return f"every logit of {where} is -inf (no token has probability > 0)"
    if values[token] == float("-inf"):
        return (f"the sampled token {token} has logit -inf at {where}: its logprob would be -inf "
                "(a token the sampler could not have drawn; mask the position if it is padding)")
    return f"the logprob or entropy of {where} overflows (logits too large for the temperature?)"


def check_rows(logits: Optional[torch.Tensor], tokens: torch.Tensor, lp: torch.Tensor, entropy: torch.Tensor,
               valid: Optional[torch.Tensor] = None, validate: str = "full", describe=None) -> None:
    """ValueError naming the first row (among `valid` ones: bool [N], None for all) whose lp or H is not
    finite; with validate="async" a device-side assertion instead (no host read).
    logits [B, T, V] or [N, V]; tokens [N] int64; lp, entropy [N] float. describe: (row) -> str, the
    diagnosis of a flagged row where there are no logits to read (fused_is/linear.py; logits None)."""
    # lp <= 0 <= H, so lp + H is finite exactly when both are; x - x is NaN exactly when x is not finite
    total = lp + entropy
    bad = (total - total) != 0
    if valid is not None:
        bad &= valid
    if validate == "async":
        torch._assert_async(~bad.any(), "fused_is: logits hold NaN or +inf, a row of only -inf, or -inf at a sampled "
                                        "token, at an unmasked position (validate='async'; rerun with "
                                        "validate='full' for the row)")
        return
    if bad.numel() and bool(bad.any()):
        row = int(bad.nonzero()[0, 0])
        count = int(bad.sum())
        more = f" ({count} rows are affected)" if count > 1 else ""
        masked = " at an unmasked position" if valid is not None else ""
        why = describe(row) if describe is not None else describe_bad_row(logits, tokens, row)
        raise ValueError(f"logits: {why}{masked}{more}; "
                         "-inf logits are fine elsewhere, NaN and +inf are not")
