"""Argument and value checks of every entry point (DESIGN.md section 3), and their error texts.

Type and shape errors are raised at once; value checks (ranges, finiteness) are flags collected by `Checks`
and read on the host together (validate="full") or asserted on the device (validate="async"). The logits'
own values are checked by the kernels' sweep: a -inf logit is legal (probability 0); NaN, +inf, a row of only
-inf or -inf at the sampled token make the row's lp or H non-finite in every backend, and `check_rows` reads
that flag from the O(N) outputs and looks again only at a flagged row.
"""

from __future__ import annotations

import math
import numbers
import warnings
from dataclasses import dataclass
from typing import Optional, Union

import torch

LOGITS_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
BACKENDS = ("auto", "triton", "cuda", "cpu", "torch", "reference")
# "full": value checks read the tensors on the host (a sync on CUDA) and raise ValueError naming the first bad
# position; "async": the same checks as device-side assertions (torch._assert_async), no host read at all
VALIDATE = ("full", "async")


def output_dtype(logits_dtype: torch.dtype) -> torch.dtype:
    """dtype of the loss, logprobs and entropy returned for logits of this dtype: fp64 for fp64, else fp32."""
    return torch.float64 if logits_dtype == torch.float64 else torch.float32



def _is_float_tensor(x) -> bool:
    return isinstance(x, torch.Tensor) and x.dtype.is_floating_point


def rounding_dtype(head_dtype, config_head_dtype: Optional[str], logits_dtype: torch.dtype) -> Optional[torch.dtype]:
    """The dtype that head-precision replay rounds the logits to before the softmax, or None (no rounding).
    head_dtype: the call's argument (None, a torch.dtype or its name: bfloat16, float16, float32);
    config_head_dtype: LossConfig.head_dtype. Logits of that very dtype need no rounding; float32 and float64
    logits can be rounded to a coarser one; finer or other ones cannot (ValueError naming the argument)."""
    from .config import HEAD_DTYPES

    if head_dtype is not None:
        name = str(head_dtype).replace("torch.", "") if isinstance(head_dtype, (torch.dtype, str)) else None
        if name not in HEAD_DTYPES:
            raise TypeError(f"head_dtype must be None, torch.bfloat16, torch.float16 or torch.float32 (or its name); "
                            f"got {head_dtype!r}")
        if config_head_dtype is not None and config_head_dtype != name:
            raise ValueError(f"head_dtype={name!r} and LossConfig.head_dtype={config_head_dtype!r} disagree; give one")
    else:
        name = config_head_dtype
    if name is None:
        return None
    dtype = getattr(torch, name)
    if dtype == logits_dtype:
        return None
    if logits_dtype == torch.float64 or (logits_dtype == torch.float32 and dtype != torch.float32):
        return dtype
    raise ValueError(f"head_dtype={name!r} cannot be replayed on {str(logits_dtype).replace('torch.', '')} logits: "
                     f"they are already rounded, coarser than (or not comparable with) the sampler head's output; form "
                     f"the learner's logits in float32 (an fp32 lm_head, or linear_policy_loss(logits_dtype="
                     f"torch.float32))")


def round_like_head(logits: torch.Tensor, dtype: Optional[torch.dtype]) -> torch.Tensor:
    """logits rounded to `dtype` (round to nearest even) and back, the gradient passed through unchanged (the oracle's
    form of head-precision replay; the fused backends round chunk by chunk, fused_is/plan.py `RoundedRows`)."""
    if dtype is None:
        return logits
    return logits + (logits.detach().to(dtype).to(logits.dtype) - logits.detach())


def check_validate(validate) -> str:
    """The validate argument, "full" or "async" (ValueError naming it otherwise)."""
    if not isinstance(validate, str) or validate not in VALIDATE:
        raise ValueError(f"validate must be one of {VALIDATE}; got {validate!r}")
    return validate


class Checks:
    """The value checks of one call, each a bool flag that is True where the check fails.
    validate="full": the flags are collected, then read on the host together by `done()` (one host read, one
    sync on CUDA, for all of them); if any is set, the first one in the order added raises ValueError with its
    detail. validate="async": each flag is a device-side assertion at once (torch._assert_async: RuntimeError
    at once on the CPU, a device-side assert on CUDA), no host read."""

    def __init__(self, validate: str = "full"):
        self.validate = check_validate(validate)
        self._flags = []  # bool [k] tensors, True where a check fails
        self._messages = []  # (what, detail) of each flag, in order

    def fail_if(self, bad: torch.Tensor, what: str, detail=None) -> None:
        """bad: 0-d bool tensor, True when the check fails; what: the message; detail: () -> str, the full
        mode's specifics (called only when this check fails)."""
        if self.validate == "async":
            torch._assert_async(~bad, _async_message(what))
        else:
            self.fail_each(bad.reshape(1), [(what, detail)])

    def fail_each(self, bad: torch.Tensor, messages) -> None:
        """bad: bool [k], one flag per (what, detail) of `messages` (several checks reduced in one op)."""
        if self.validate == "async":
            ok = ~bad
            for i, (what, _) in enumerate(messages):
                torch._assert_async(ok[i], _async_message(what))
        else:
            self._flags.append(bad)
            self._messages.extend(messages)

    def done(self, gate: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
        """Read every collected flag on the host at once (one sync); raise the first failed check's ValueError.
        Returns `gate`: under torch.compile (no host read while dynamo traces) the flags are read at run time by
        the op `fused_is::checked`, which hands back a copy of gate (the ids that every kernel reads) once they are
        clear, and raises the first failed check's ValueError (without its detail) otherwise."""
        flags, messages = self._flags, self._messages
        self._flags, self._messages = [], []
        if not flags:
            return gate
        flags = flags[0] if len(flags) == 1 else torch.cat(flags)
        if torch.compiler.is_compiling():
            if gate is None:
                raise AssertionError("fused_is: value checks under torch.compile need a tensor to gate")
            return torch.ops.fused_is.checked(gate, flags, "\n".join(what for what, _ in messages))
        if not bool(flags.any()):  # the one host read of a passing call
            return gate
        what, detail = messages[_first(flags)]
        raise ValueError(what + (detail() if detail is not None else ""))


def _async_message(what: str) -> str:
    return f"fused_is: {what} (validate='async'; rerun with validate='full' for details)"


def _first(bad: torch.Tensor) -> int:
    return int(bad.nonzero()[0, 0])


def _check_same_device(name: str, x: torch.Tensor, logits: torch.Tensor) -> None:
    if x.device != logits.device:
        raise ValueError(f"{name} is on {x.device} but logits are on {logits.device}; put both on one device")


def check_logits_tokens(logits, tokens, arg: str = "logits") -> None:
    """Type, rank and shape checks shared by policy_loss and token_logprobs: the logits' (`check_logits`), the tokens'
    and the two together."""
    check_logits(logits, arg)
    if not isinstance(tokens, torch.Tensor):
        raise TypeError(f"tokens must be a torch.Tensor of integer ids; got {type(tokens).__name__}")
    if tokens.dtype.is_floating_point or tokens.dtype.is_complex or tokens.dtype == torch.bool:
        raise TypeError(f"tokens must hold integer ids (int32/int64); got {tokens.dtype}")
    if tokens.shape != logits.shape[:-1]:
        if logits.shape == tokens.shape or (logits.dim() == 2 and tokens.dim() == 2):
            # a [B, T] tensor where the [B, T, V] logits belong (the tokens or logprobs passed twice, say)
            raise ValueError(f"{arg} must be [B, T, V] (padded) or [N, V] (packed) with tokens [B, T] or [N]; got "
                             f"{arg} of shape {tuple(logits.shape)} beside tokens of shape {tuple(tokens.shape)}: "
                             f"{arg} looks like a per-token tensor, pass the model's logits there")
        hint = ""
        if logits.dim() == 3 and tokens.dim() == 2 and logits.shape[0] == tokens.shape[0]:
            if logits.shape[1] == tokens.shape[1] + 1:
                hint = (f"; the logits have one position more than the tokens: the last position predicts nothing "
                        f"here, pass {arg}[:, :-1] (a view: no copy)")
            elif logits.shape[1] > tokens.shape[1]:
                hint = (f"; the logits cover the prompt too: pass the response's positions, "
                        f"{arg}[:, -T - 1:-1] with T = tokens.shape[1] = {tokens.shape[1]}")
        raise ValueError(
            f"tokens must have shape {tuple(logits.shape[:-1])} ({arg}.shape[:-1]); got {tuple(tokens.shape)}{hint}"
        )
    _check_same_device("tokens", tokens, logits)


# tau of every row: one float, or a float64 [N] tensor of per-row temperatures (per sequence or per token)
Temperature = Union[float, torch.Tensor]


def call_temperature(temperature, token_shape, like, valid, checks: "Checks") -> Temperature:
    """token_logprobs' temperature: a positive number (as a float), or per-sequence / per-token temperatures as
    `row_temperature` takes them for padded [B] or tokens' shape (as float64 [N])."""
    if isinstance(temperature, torch.Tensor):
        return row_temperature(temperature, token_shape, like, valid, checks)
    return check_temperature(temperature)


def temperature_rows(temperature: Temperature, rows: slice) -> Temperature:
    """The temperature of the rows `rows`: the float itself, or their slice of the per-row float64 [N]."""
    return temperature[rows] if isinstance(temperature, torch.Tensor) else temperature


def check_temperature(temperature) -> float:
    """A positive finite temperature (>= MIN_TEMPERATURE), as a float (token_logprobs and linear_token_logprobs)."""
    from .config import MIN_TEMPERATURE

    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not temperature > 0:
        raise ValueError(f"temperature must be a positive number; got {temperature!r}")
    if temperature < MIN_TEMPERATURE:
        raise ValueError(f"temperature must be >= {MIN_TEMPERATURE:g}; got {temperature!r}")
    if temperature == float("inf"):
        raise ValueError("temperature must be finite")
    return float(temperature)


def row_temperature(temperature, token_shape, logits, valid, checks: "Checks", seq_index=None,
                    num_seqs: Optional[int] = None) -> torch.Tensor:
    """A per-sequence or per-token temperature tensor as float64 [N] per row: tokens' shape, [B] for padded
    input, or [S] for packed input with cu_seqlens (seq_index, num_seqs given); positive and finite at
    unmasked positions (checked); a masked position's unusable value (0, inf, NaN) becomes 1."""
    from .config import MIN_TEMPERATURE

    if not _is_float_tensor(temperature):
        raise TypeError(f"temperature must be a positive number or a floating-point torch.Tensor; got "
                        f"{temperature.dtype if isinstance(temperature, torch.Tensor) else type(temperature).__name__}")
    _check_same_device("temperature", temperature, logits)
    temperature = temperature.detach()  # no gradient flows into the temperatures, on any backend
    padded = len(token_shape) == 2
    if padded and temperature.shape == token_shape[:1]:
        flat = temperature.double()[:, None].expand(token_shape).reshape(-1)
    elif not padded and seq_index is not None and temperature.shape == (num_seqs, 1):  # explicitly per sequence
        flat = temperature.double().reshape(-1)[seq_index]
    elif not padded and seq_index is not None and temperature.shape == (num_seqs,) and temperature.shape != token_shape:
        flat = temperature.double()[seq_index]
    elif temperature.shape == token_shape:
        flat = temperature.reshape(-1).double()
        if not padded and seq_index is not None and num_seqs == token_shape[0] and checks.validate == "full" \
                and bool((seq_index != torch.arange(len(seq_index), device=seq_index.device)).any()):
            # S == N sequences, some of them empty: [N] could be per token or per sequence, and reads per token
            warnings.warn(f"fused_is: temperature of shape [{num_seqs}] is read per token; cu_seqlens has as many "
                          f"sequences, so to mean one per sequence pass it as [{num_seqs}, 1]", UserWarning,
                          stacklevel=4)
    else:
        per_seq = f" or [{token_shape[0]}] per sequence" if padded else (
            f" or [{num_seqs}] per sequence (cu_seqlens), also as [{num_seqs}, 1]" if seq_index is not None else "")
        scalar = " (one temperature for every row: pass a float)" if temperature.dim() == 0 else ""
        raise ValueError(f"temperature must be a number, or a tensor of shape {tuple(token_shape)}{per_seq}; "
                         f"got {tuple(temperature.shape)}{scalar}")
    unusable = ~((flat >= MIN_TEMPERATURE) & (flat < math.inf))  # NaN compares False
    bad = unusable & valid
    checks.fail_if(bad.any(), f"temperature must be positive and finite (>= {MIN_TEMPERATURE:g}) at unmasked positions",
                   lambda: f"; got {float(flat[_first(bad)])!r} at row {_first(bad)}")
    return flat.masked_fill(unusable, 1.0)


def check_token_range(tokens: torch.Tensor, vocab, valid: Optional[torch.Tensor], checks: Checks) -> torch.Tensor:
    """ids must lie in [0, V) where valid (bool [N] or None: everywhere); elsewhere they are replaced by 0.
    vocab: an int, or a 0-d tensor on the device (a vocabulary-parallel V under validate="async": not read on
    the host). Returns int64 [N]."""
    ids = tokens.reshape(-1).long()
    outside = (ids < 0) | (ids >= vocab)
    bad = outside if valid is None else outside & valid
    shown = "V" if isinstance(vocab, torch.Tensor) else f"V={vocab}"
    checks.fail_if(bad.any(), f"tokens must be ids in [0, {shown}) at unmasked positions",
                   lambda: f"; got {int(ids[_first(bad)])} at flat index {_first(bad)}")
    return ids.masked_fill(outside, 0)


# A logprob above 0 is impossible; a little above it is rounding (an engine's bf16 or fp32 log-softmax).
LOGPROB_TOLERANCE = 1e-4


@dataclass(frozen=True)
class PerToken:
    """One float per-token argument of `per_token_inputs`: its name, the caller's value (None: absent),
    whether a padded call may give one value per sequence ([B]), and its range: "any" (finite), "logprob"
    (finite, <= LOGPROB_TOLERANCE: logits or probabilities passed as logprobs are refused) or "nonnegative"."""

    name: str
    value: object
    allow_per_seq: bool = False
    kind: str = "any"


def _flat_per_token(arg: PerToken, token_shape, logits) -> torch.Tensor:
    """The argument checked for type, device and shape, as [N] in its own dtype (a view unless per sequence)."""
    x = arg.value
    if not _is_float_tensor(x):
        raise TypeError(
            f"{arg.name} must be a floating-point torch.Tensor of shape {tuple(token_shape)}; got "
            f"{x.dtype if isinstance(x, torch.Tensor) else type(x).__name__}"
        )
    _check_same_device(arg.name, x, logits)
    per_seq = arg.allow_per_seq and len(token_shape) == 2
    if per_seq and x.shape in (token_shape[:1], (token_shape[0], 1)):  # [B] or TRL's [B, 1]: one per sequence
        return x.reshape(-1, 1).expand(token_shape).reshape(-1)
    if x.shape != token_shape:
        extra = f", or [{token_shape[0]}] or [{token_shape[0]}, 1] per sequence" if per_seq else ""
        raise ValueError(f"{arg.name} must have shape {tuple(token_shape)}{extra}; got {tuple(x.shape)}")
    return x.reshape(-1)


def per_token_inputs(args, token_shape, logits, valid: torch.Tensor, checks: Checks) -> list:
    """The float per-token arguments (`PerToken`s) as float64 [N] each, masked positions zeroed (None passes
    through), in the order given. Every present one goes into one float64 [k, N] block and is checked there at
    once: finite at unmasked positions, and in its kind's range; a few ops for all of them, not a few each.
    With several bad arguments, the first error (validate="full") is the first non-finite one in argument order,
    then the first out of range. The returned vectors are the block's rows (contiguous)."""
    present = [(arg, _flat_per_token(arg, token_shape, logits)) for arg in args if arg.value is not None]
    out = {arg.name: None for arg in args}
    if not present:
        return list(out.values())
    flats = [flat for _, flat in present]
    if len({flat.dtype for flat in flats}) > 1:  # mixed dtypes: each to float64 first (stack cannot promote fp8)
        flats = [flat.double() for flat in flats]
    block = torch.stack(flats).double()  # the .double() is no op when every argument is float64 already
    # x - x is 0 for a finite x and NaN for NaN and +-inf: two ops, where torch.isfinite takes four
    bad = ((block - block) != 0) & valid
    names = [arg.name for arg, _ in present]
    checks.fail_each(bad.any(1), [(f"{name} must be finite at unmasked positions",
                                   _finite_detail(flat, token_shape, valid)) for name, flat in zip(names, flats)])
    block.masked_fill_(~valid, 0.0)
    rows = block.unbind(0)
    for kind, test, what in (("logprob", lambda x: x > LOGPROB_TOLERANCE, "must be logprobs (<= 0)"),
                             ("nonnegative", lambda x: x < 0, "must be >= 0")):
        at = [i for i, (arg, _) in enumerate(present) if arg.kind == kind]
        if not at:
            continue
        # the arguments of one kind are neighbours in the block (prepare_batch's order): one slice, one test
        part = block[at[0]:at[-1] + 1] if at == list(range(at[0], at[-1] + 1)) else block[at]
        checks.fail_each(test(part).any(1), [(f"{names[i]} {what} at unmasked positions",
                                              _range_detail(rows[i], test, kind, token_shape)) for i in at])
    for (arg, _), row in zip(present, rows):
        out[arg.name] = row
    return list(out.values())


def _position(first: int, token_shape):
    """A flat index as the position in the tokens' shape the caller knows: an int, or (b, t)."""
    position = tuple(int(i) for i in torch.unravel_index(torch.tensor(first), tuple(token_shape)))
    return position if len(position) > 1 else position[0]


def _finite_detail(flat: torch.Tensor, token_shape, valid: torch.Tensor):
    """The detail of a failed finiteness check of one per-token argument: the first bad value and its position
    (read on the host, failing path only)."""
    def detail():
        values = flat.double()
        bad = ~torch.isfinite(values) & valid
        first = _first(bad)
        return (f"; got {float(values[first])} at position {_position(first, token_shape)} "
                f"({int(bad.sum())} non-finite at unmasked positions)")

    return detail


def _range_detail(flat: torch.Tensor, test, kind: str, token_shape):
    """The detail of a failed range check of one per-token argument (read on the host, failing path only)."""
    def detail():
        if kind != "logprob":
            return f" (found {float(flat.min()):.6g})"
        above = test(flat)
        first = _first(above)
        position = tuple(int(i) for i in torch.unravel_index(torch.tensor(first), tuple(token_shape)))
        return (f"; got {float(flat[first]):.6g} at position {position if len(position) > 1 else position[0]} "
                f"({int(above.sum())} positions above {LOGPROB_TOLERANCE:g}): were logits or probabilities "
                "passed instead?")

    return detail


def flat_mask(mask, token_shape, logits, checks: Checks) -> torch.Tensor:
    """The mask argument checked and flattened to bool [N]; all True when None."""
    if mask is None:
        return torch.ones(int(torch.Size(token_shape).numel()), dtype=torch.bool, device=logits.device)
    if not isinstance(mask, torch.Tensor) or mask.dtype.is_complex:
        raise TypeError(f"mask must be a bool or 0/1 torch.Tensor of shape {tuple(token_shape)}")
    _check_same_device("mask", mask, logits)
    if mask.shape != token_shape:
        raise ValueError(f"mask must have shape {tuple(token_shape)}; got {tuple(mask.shape)}")
    flat = mask.reshape(-1)
    if flat.dtype != torch.bool:
        checks.fail_if(((flat != 0) & (flat != 1)).any(), "mask must hold only 0 and 1 (or be bool)")
        flat = flat != 0
    return flat


def sequence_index(cu_seqlens, token_shape, logits, padded: bool, checks: Checks):
    """(seq_index [N] int64, num_seqs) from the layout: rows of padded input, or cu_seqlens offsets."""
    device = logits.device
    n = int(torch.Size(token_shape).numel())
    if padded:
        if cu_seqlens is not None:
            raise ValueError("cu_seqlens must be None for padded [B, T, V] logits (rows are sequences)")
        b, t = token_shape
        return torch.arange(n, device=device).div_(max(t, 1), rounding_mode="floor"), b
    if cu_seqlens is None:
        return torch.zeros(n, dtype=torch.long, device=device), 1
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dtype.is_floating_point or cu_seqlens.dtype == torch.bool:
        raise TypeError("cu_seqlens must be an integer torch.Tensor [S + 1] of sequence offsets")
    _check_same_device("cu_seqlens", cu_seqlens, logits)
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens must be 1-D with S + 1 >= 2 offsets; got shape {tuple(cu_seqlens.shape)}")
    offsets = cu_seqlens.long()
    ok = (offsets[0] == 0) & (offsets[-1] == n) & (offsets[1:] >= offsets[:-1]).all()
    def shown():
        return offsets.tolist() if offsets.numel() <= 16 else f"first/last {int(offsets[0])}/{int(offsets[-1])}"

    checks.fail_if(~ok, f"cu_seqlens must start at 0, be non-decreasing and end at N={n} (cover every row)",
                   lambda: f"; got {shown()}")
    num_seqs = offsets.numel() - 1
    # the sequence of row t is the number of sequence ends <= t (no host read: the output size is N)
    ends = offsets[1:].contiguous()
    rows = torch.arange(n, device=device)
    return torch.searchsorted(ends, rows, right=True).clamp_(max=max(0, num_seqs - 1)), num_seqs


def check_normalizer(normalizer, checks: Checks, name: str = "normalizer"):
    """None, a positive float, or (validate="async", a tensor given) a float64 0-d tensor checked on the device."""
    if normalizer is None:
        return None
    if isinstance(normalizer, torch.Tensor):
        if normalizer.numel() != 1 or normalizer.dtype.is_complex or normalizer.dtype == torch.bool:
            raise ValueError(f"{name} must be a positive scalar; got a tensor of shape {tuple(normalizer.shape)}")
        if checks.validate == "async":
            value = normalizer.reshape(()).double()
            checks.fail_if(~((value > 0) & (value < math.inf)), f"{name} must be a positive finite number")
            return value
        normalizer = float(normalizer)
    elif isinstance(normalizer, bool) or not isinstance(normalizer, numbers.Real):
        raise TypeError(f"{name} must be None or a positive number; got {type(normalizer).__name__}")
    normalizer = float(normalizer)
    if not (normalizer > 0.0 and normalizer != float("inf")):
        raise ValueError(f"{name} must be a positive finite number; got {normalizer}")
    return normalizer


def check_loss_scale(value) -> float:
    """The loss_scale argument: None (1.0) or a positive finite number, as a float."""
    if value is None:
        return 1.0
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"loss_scale must be None or a positive number (a Python float, known at the call); got "
                        f"{type(value).__name__}")
    if not (value > 0.0 and value != float("inf")):
        raise ValueError(f"loss_scale must be a positive finite number; got {value!r}")
    return float(value)


def check_backend(backend) -> str:
    """The backend argument, one of BACKENDS (ValueError naming it otherwise)."""
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}; got {backend!r}")
    return backend


def check_inplace(inplace):
    """policy_loss's inplace argument: False, True (= "backward") or "forward" (TypeError naming it otherwise)."""
    if not isinstance(inplace, bool) and inplace not in ("forward", "backward"):
        raise TypeError(f"inplace must be False, True (= 'backward') or 'forward'; got {inplace!r}")
    return inplace


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


def checked_values(logits: Optional[torch.Tensor], tokens: torch.Tensor, lp: torch.Tensor, entropy: torch.Tensor,
                   valid: torch.Tensor, validate: str = "full", describe=None, shard_start=None):
    """`check_rows`, then (lp, entropy): under torch.compile the op `fused_is::checked_rows` (fused_is/ops.py) checks
    at run time and hands back copies of both, which everything after it reads (so the check stays in the graph
    whichever of them is used); shard_start (a 0-d tensor there): the vocabulary shard's start, for the diagnosis of
    a flagged row."""
    if torch.compiler.is_compiling():
        return torch.ops.fused_is.checked_rows(logits, tokens, lp, entropy, valid, validate, shard_start).unbind(0)
    check_rows(logits, tokens, lp, entropy, valid, validate, describe)
    return lp, entropy


def check_logits(logits, arg: str = "logits") -> None:
    """A model's logits: a bf16/fp16/fp32/fp64 torch.Tensor of shape [B, T, V] (padded) or [N, V] (packed), V >= 1
    (TypeError / ValueError naming `arg`)."""
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"{arg} must be a torch.Tensor of shape [B, T, V] or [N, V]; got {type(logits).__name__}")
    if logits.dtype not in LOGITS_DTYPES:
        raise TypeError(f"{arg} must be bf16, fp16, fp32 or fp64; got {logits.dtype}")
    if logits.dim() not in (2, 3):
        raise ValueError(f"{arg} must be [B, T, V] (padded) or [N, V] (packed); got shape {tuple(logits.shape)}")
    if logits.shape[-1] < 1:
        raise ValueError(f"{arg} must have a vocabulary dimension V >= 1; got shape {tuple(logits.shape)}")


def check_teacher_logits(teacher_logits, logits: torch.Tensor) -> None:
    """distill_loss's teacher_logits beside the (checked) student logits: a floating-point torch.Tensor of the logits'
    shape (one vocabulary: the same tokenizer) on their device, read only: one that requires grad is refused, the
    distillation loss trains the student alone. TypeError / ValueError naming teacher_logits."""
    if not isinstance(teacher_logits, torch.Tensor):
        raise TypeError(f"teacher_logits must be a torch.Tensor of the logits' shape {tuple(logits.shape)}; got "
                        f"{type(teacher_logits).__name__}")
    if not teacher_logits.dtype.is_floating_point:
        raise TypeError(f"teacher_logits must be floating-point (any float dtype); got {teacher_logits.dtype}")
    if teacher_logits.shape[-1:] != logits.shape[-1:]:
        raise ValueError(f"teacher_logits have a vocabulary of {teacher_logits.shape[-1]} but logits of "
                         f"{logits.shape[-1]} (shapes {tuple(teacher_logits.shape)} and {tuple(logits.shape)}): "
                         "distillation over the full vocabulary needs one vocabulary for both models; slice the "
                         "padded vocabulary of the larger head to the tokenizer's size")
    if teacher_logits.shape != logits.shape:
        raise ValueError(f"teacher_logits must have the logits' shape {tuple(logits.shape)} (one row per student "
                         f"position); got {tuple(teacher_logits.shape)}")
    _check_same_device("teacher_logits", teacher_logits, logits)
    if teacher_logits.requires_grad:
        raise ValueError("teacher_logits requires grad: the distillation loss differentiates the student's logits only "
                         "and never writes a gradient for the teacher; pass teacher_logits.detach() (or compute them "
                         "under torch.no_grad())")


def describe_distribution_row(x: torch.Tensor, arg: str, row: int) -> Optional[str]:
    """Why row `row` (of the N flattened rows) of the [B, T, V] or [N, V] logits `x`, named `arg`, has no softmax
    (NaN, +inf, or every entry -inf), or None when it has one. One row read on the host."""
    values = (x[row // x.shape[1], row % x.shape[1]] if x.dim() == 3 else x[row]).detach().double()
    where = f"row {row} ({arg}[{row // x.shape[1]}, {row % x.shape[1]}])" if x.dim() == 3 else f"row {row}"
    for bad, what in ((torch.isnan(values), "NaN"), (torch.isposinf(values), "+inf")):
        if bool(bad.any()):
            return f"{arg} hold {what} at {where}, column {int(bad.nonzero()[0, 0])}"
    if bool(torch.isneginf(values).all()):
        return f"every entry of {arg} at {where} is -inf (no token has probability > 0)"
    return None
