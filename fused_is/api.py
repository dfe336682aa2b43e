"""Argument checking and shape normalisation, shared by every backend (DESIGN.md section 3).

`prepare_batch` turns the public arguments (padded [B, T, V] or packed [N, V] + cu_seqlens) into a
`Batch`: per-token float64 vectors of length N, the sequence index of each token and the aggregation
weight a_t of each token, so that every backend sees one flat layout. It raises ValueError/TypeError
naming the argument before anything is computed, and never writes into the caller's tensors.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass
from typing import Optional, Union

import torch

from .config import LossConfig

LOGITS_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
BACKENDS = ("auto", "triton", "cuda", "cpu", "torch", "reference")
# "full": value checks read the tensors on the host (a sync on CUDA) and raise ValueError naming the first bad
# position; "async": the same checks as device-side assertions (torch._assert_async), no host read at all
VALIDATE = ("full", "async")


@dataclass
class Batch:
    """Inputs flattened to N rows. Per-token vectors are float64 (O(N) memory); masked positions hold 0."""

    logits: torch.Tensor  # the caller's logits, [B, T, V] or [N, V], untouched
    token_shape: torch.Size  # shape of tokens, [B, T] or [N]
    tokens: torch.Tensor  # [N] int64; out-of-range ids at masked positions replaced by 0
    advantages: torch.Tensor  # [N] float64
    sampler_logprobs: Optional[torch.Tensor]  # [N] float64 or None
    old_logprobs: Optional[torch.Tensor]
    ref_logprobs: Optional[torch.Tensor]
    mask: torch.Tensor  # [N] float64 in {0, 1}
    seq_index: torch.Tensor  # [N] int64, sequence of each token
    num_seqs: int  # number of sequences (rows of padded input, or len(cu_seqlens) - 1)
    seq_token_count: torch.Tensor  # [num_seqs] float64, unmasked tokens per sequence
    agg_weight: torch.Tensor  # [N] float64, a_t: loss = sum_t a_t * L_t
    config: LossConfig
    normalizer: Optional[Union[float, torch.Tensor]]  # replaces the token / sequence count (0-d tensor: async)
    # divisor of seq-mean-token-sum-norm (resolved: padded T by default; a 0-d tensor with a sequence_group)
    norm_length: Optional[Union[int, torch.Tensor]]
    validate: str = "full"  # VALIDATE
    # vocabulary parallel (fused_is/distributed.py): the process group over whose ranks the vocabulary is split,
    # and where this rank's shard (the logits' last dimension) starts in the global ids that tokens hold
    vocab_group: Optional[object] = None
    vocab_start: int = 0
    # LossConfig.rejection: [N] float64, 1 at the tokens the criteria rejected from the caller's mask (else None)
    rejected: Optional[torch.Tensor] = None
    # rejection_counts="keep": [N] float64 1/0 multiplying the policy term (the mask keeps the rejected tokens)
    rejection_gate: Optional[torch.Tensor] = None
    # the caller's IS weights W_t ([N] float64, masked positions 0), in place of the config's is_level
    is_weights: Optional[torch.Tensor] = None
    # e_t: the entropy term's aggregation weight, loss += sum_t e_t (-entropy_coef H_t) (None: agg_weight)
    entropy_weight: Optional[torch.Tensor] = None
    entropy_normalizer: Optional[Union[float, torch.Tensor]] = None  # replaces entropy_agg's count
    # context parallel (fused_is/distributed.py): the process group over whose ranks each sequence's tokens are
    # split; every per-sequence reduction and every total (the loss, the metrics) is all-reduced over it
    sequence_group: Optional[object] = None
    # Clip-Cov / KL-Cov: [N] float64 1/0, the tokens selected from the current lp (coefficients.cov_selection),
    # formed once per call so that the gradient and the loss see the same (for clip_cov, random) selection
    cov_selected: Optional[torch.Tensor] = None
    # per-row temperatures tau_t ([N] float64, positive and finite) in place of LossConfig.temperature (verl's
    # per-sample temperature); None: the config's one value for every row
    row_temperature: Optional[torch.Tensor] = None
    # bool [N]: mask > 0, the tokens that count (formed once: every masked select and mean reads it)
    valid: Optional[torch.Tensor] = None
    # (W, masked, truncated) of coefficients.full_is_weight when they do not depend on the current lp: formed
    # once per call (the row table and the metrics read them); not copied by `rows`
    is_weight_parts: Optional[tuple] = dataclasses.field(default=None, init=False, repr=False)

    def __post_init__(self):
        if self.valid is None:
            self.valid = self.mask > 0

    @property
    def temperature(self) -> "Temperature":
        """tau of every row: the config's float, or the per-row float64 [N] tensor."""
        return self.config.temperature if self.row_temperature is None else self.row_temperature

    def seq_sum(self, x: torch.Tensor) -> torch.Tensor:
        """[num_seqs] sums of the per-token x over each sequence (over every rank of sequence_group)."""
        return sequence_sum(x, self.seq_index, self.num_seqs, self.sequence_group)

    def total(self, x: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """A batch total (a 0-d sum, max or min) over every rank of sequence_group."""
        return all_reduce(x, self.sequence_group, op)

    @property
    def entropy_weights(self) -> torch.Tensor:
        """e_t, [N] float64: LossConfig.entropy_agg's aggregation weight, or a_t when it is unset."""
        return self.agg_weight if self.entropy_weight is None else self.entropy_weight

    @property
    def num_rows(self) -> int:
        return self.tokens.numel()

    @property
    def vocab(self) -> int:
        return self.logits.shape[-1]

    def rows(self, rows: slice, logits: torch.Tensor) -> "Batch":
        """The rows `rows` as a batch of their own whose logits are `logits` ([rows, V]): the per-token
        vectors sliced, the sequence-level fields (counts, aggregation weights) those of the whole batch.
        For the token-local work of one chunk of rows (fused_is/linear.py); whole-batch reductions
        (sequence sums, the loss, the metrics) still need the whole batch."""
        cut = lambda x: None if x is None else x[rows]  # noqa: E731
        return dataclasses.replace(
            self, logits=logits, token_shape=torch.Size([logits.shape[0]]), tokens=self.tokens[rows],
            advantages=self.advantages[rows], sampler_logprobs=cut(self.sampler_logprobs),
            old_logprobs=cut(self.old_logprobs), ref_logprobs=cut(self.ref_logprobs), is_weights=cut(self.is_weights),
            mask=self.mask[rows],
            seq_index=self.seq_index[rows], agg_weight=self.agg_weight[rows],
            entropy_weight=cut(self.entropy_weight), row_temperature=cut(self.row_temperature),
            valid=self.valid[rows])


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
    import torch.distributed as dist

    out = x.clone()
    dist.all_reduce(out, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}[op],
                    group=group)
    return out


def output_dtype(logits_dtype: torch.dtype) -> torch.dtype:
    """dtype of the loss, logprobs and entropy returned for logits of this dtype: fp64 for fp64, else fp32."""
    return torch.float64 if logits_dtype == torch.float64 else torch.float32


def _is_float_tensor(x) -> bool:
    return isinstance(x, torch.Tensor) and x.dtype.is_floating_point


def check_validate(validate) -> str:
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

    def done(self) -> None:
        flags, messages = self._flags, self._messages
        self._flags, self._messages = [], []
        if not flags:
            return
        flags = flags[0] if len(flags) == 1 else torch.cat(flags)
        if not bool(flags.any()):  # the one host read of a passing call
            return
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
    """Type, rank and shape checks shared by policy_loss and token_logprobs."""
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"{arg} must be a torch.Tensor of shape [B, T, V] or [N, V]; got {type(logits).__name__}")
    if logits.dtype not in LOGITS_DTYPES:
        raise TypeError(f"{arg} must be bf16, fp16, fp32 or fp64; got {logits.dtype}")
    if logits.dim() not in (2, 3):
        raise ValueError(f"{arg} must be [B, T, V] (padded) or [N, V] (packed); got shape {tuple(logits.shape)}")
    if logits.shape[-1] < 1:
        raise ValueError(f"{arg} must have a vocabulary dimension V >= 1; got shape {tuple(logits.shape)}")
    if not isinstance(tokens, torch.Tensor):
        raise TypeError(f"tokens must be a torch.Tensor of integer ids; got {type(tokens).__name__}")
    if tokens.dtype.is_floating_point or tokens.dtype.is_complex or tokens.dtype == torch.bool:
        raise TypeError(f"tokens must hold integer ids (int32/int64); got {tokens.dtype}")
    if tokens.shape != logits.shape[:-1]:
        raise ValueError(
            f"tokens must have shape {tuple(logits.shape[:-1])} (logits.shape[:-1]); got {tuple(tokens.shape)}"
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
    elif not padded and seq_index is not None and temperature.shape == (num_seqs,) and temperature.shape != token_shape:
        flat = temperature.double()[seq_index]
    elif temperature.shape == token_shape:
        flat = temperature.reshape(-1).double()
    else:
        per_seq = f" or [{token_shape[0]}] per sequence" if padded else (
            f" or [{num_seqs}] per sequence (cu_seqlens)" if seq_index is not None else "")
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
    if per_seq and x.shape == token_shape[:1]:
        return x[:, None].expand(token_shape).reshape(-1)
    if x.shape != token_shape:
        extra = f" or [{token_shape[0]}] per sequence" if per_seq else ""
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
    checks.fail_each(bad.any(1), [(f"{name} must be finite at unmasked positions", lambda: " (found NaN or inf)")
                                  for name in names])
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


def _sequence_index(cu_seqlens, token_shape, logits, padded: bool, checks: Checks):
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


def _check_normalizer(normalizer, checks: Checks, name: str = "normalizer"):
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


def _aggregation_weights(mask, seq_index, num_seqs, seq_count, loss_agg: str, normalizer, norm_length,
                         token_count=None):
    """a_t of DESIGN.md section 2 "Aggregation" for the mode loss_agg: loss = sum_t a_t * L_t; a_t = 0 on masked
    tokens. No host read: the count stays a tensor (an empty batch divides its zeros by 1).
    token_count: the unmasked tokens of the whole batch when it is not mask.sum() (context parallel)."""
    if loss_agg == "token-mean":
        count = mask.sum() if token_count is None else token_count
        per_token = mask
    else:
        count = (seq_count > 0).sum()
        if loss_agg == "seq-mean-token-sum":
            per_token = mask
        elif loss_agg == "seq-mean-token-mean":
            per_token = mask / seq_count.clamp(min=1.0)[seq_index]
        else:  # seq-mean-token-sum-norm
            per_token = mask / norm_length  # an int, or a 0-d tensor (context parallel: no host read)
    if normalizer is not None:  # positive (checked): a float, or a float64 0-d tensor under validate="async"
        return per_token / normalizer
    # an empty batch (count 0) has per_token 0 everywhere: 0 / 1, loss 0, gradient 0 (DESIGN.md section 2)
    return per_token / count.clamp(min=1)


def prepare_batch(
    logits,
    tokens,
    advantages,
    *,
    sampler_logprobs=None,
    old_logprobs=None,
    ref_logprobs=None,
    mask=None,
    cu_seqlens=None,
    config,
    normalizer=None,
    validate: str = "full",
    vocab=None,
    is_weights=None,
    entropy_normalizer=None,
    sequence_group=None,
    temperature=None,
) -> Batch:
    """Check every argument of `policy_loss` and flatten it to a `Batch` (no kernel runs here).
    validate="async" checks values with device-side assertions and reads nothing on the host.
    vocab: the range of the token ids when it is not logits.shape[-1] (a vocabulary shard: global ids); an int,
    or a 0-d device tensor under validate="async".
    sequence_group: context parallel: this rank holds a slice of the positions of every sequence (padded input:
    rows; packed input: cu_seqlens segments, one per sequence, the same S on every rank); counts and sequence
    reductions are taken over the group.
    temperature: None (LossConfig.temperature), or per-row temperatures as `row_temperature` takes them."""
    from .config import resolve_config

    checks = Checks(validate)
    cfg = resolve_config(config)
    check_logits_tokens(logits, tokens)
    padded = logits.dim() == 3
    token_shape = tokens.shape
    if not isinstance(advantages, torch.Tensor):
        raise TypeError(f"advantages must be a floating-point torch.Tensor of shape {tuple(token_shape)}")
    valid = flat_mask(mask, token_shape, logits, checks)
    seq_index, num_seqs = _sequence_index(cu_seqlens, token_shape, logits, padded, checks)
    ids = check_token_range(tokens, logits.shape[-1] if vocab is None else vocab, valid, checks)
    adv, samp, old, ref, weights = per_token_inputs(
        [PerToken("advantages", advantages, allow_per_seq=True),
         PerToken("sampler_logprobs", sampler_logprobs, kind="logprob"),
         PerToken("old_logprobs", old_logprobs, kind="logprob"), PerToken("ref_logprobs", ref_logprobs, kind="logprob"),
         PerToken("is_weights", is_weights, allow_per_seq=True, kind="nonnegative")],
        token_shape, logits, valid, checks)
    row_tau = None
    if temperature is not None:
        if not isinstance(temperature, torch.Tensor):
            raise TypeError(f"temperature= takes per-sequence or per-token temperatures as a tensor; got "
                            f"{type(temperature).__name__} (one temperature for every row is LossConfig.temperature)")
        if cfg.temperature != 1.0:
            raise ValueError(f"temperature= (per row) replaces LossConfig.temperature, which is also set "
                             f"({cfg.temperature}); leave the config's at 1.0")
        row_tau = row_temperature(temperature, token_shape, logits, valid, checks,
                                  None if padded or cu_seqlens is None else seq_index, num_seqs)
    normalizer = _check_normalizer(normalizer, checks)
    entropy_normalizer = _check_normalizer(entropy_normalizer, checks, "entropy_normalizer")
    checks.done()  # one host read for every value check above (none with validate="async")

    if cfg.needs_sampler_logprobs and samp is None:
        raise ValueError(
            f"sampler_logprobs is required by this config (policy={cfg.policy!r}, ratio_ref={cfg.ratio_ref!r}, "
            f"is_level={cfg.is_level!r}); pass the sampler's logprobs of the sampled tokens"
        )
    if entropy_normalizer is not None and cfg.entropy_agg is None:
        raise ValueError("entropy_normalizer replaces the count of LossConfig.entropy_agg's aggregation; set "
                         "entropy_agg (normalizer= already covers an entropy term aggregated as the loss)")
    if weights is not None and cfg.is_level != "none":
        raise ValueError(f"is_weights (the trainer's own IS weights) replace the config's importance weight; the "
                         f"config also asks for one (is_level={cfg.is_level!r}): use is_level='none' with is_weights")
    if cfg.kl_coef != 0.0 and ref is None:
        raise ValueError("ref_logprobs is required when kl_coef != 0")
    needs_sequences = (cfg.is_level in ("sequence", "geometric") or cfg.loss_agg != "token-mean"
                       or cfg.sequence_ratio or cfg.entropy_agg not in (None, "token-mean") or cfg.policy == "vespo"
                       or cfg.off_policy_mask is not None or any(c[0].startswith("seq_") for c in cfg.rejection))
    if needs_sequences and not padded and cu_seqlens is None:
        raise ValueError(
            f"cu_seqlens is required for packed [N, V] input with is_level={cfg.is_level!r}, "
            f"ratio_level={cfg.ratio_level!r} and loss_agg={cfg.loss_agg!r} (they need sequence boundaries; so do "
            f"policy='vespo', off_policy_mask, entropy_agg other than token-mean and the seq_* rejection criteria)"
        )
    if sequence_group is not None and cfg.policy in ("clip_cov", "kl_cov"):
        raise ValueError(f"LossConfig.policy={cfg.policy!r} with sequence_group (context parallel) is not supported: "
                         "its token selection is over the whole batch's tokens, which the ranks split")
    if sequence_group is not None and not padded and cu_seqlens is None:
        raise ValueError("sequence_group (context parallel) with packed [N_local, V] logits needs cu_seqlens: this "
                         "rank's segment of each of the same S sequences, in the same order on every rank (empty "
                         "segments where it holds none of a sequence); or padded [B, T_local, V] logits")
    norm_length = cfg.norm_length
    if "seq-mean-token-sum-norm" in (cfg.loss_agg, cfg.entropy_agg) and norm_length is None:
        if not padded:
            raise ValueError("norm_length (LossConfig field) is required for loss_agg='seq-mean-token-sum-norm' "
                             "(or entropy_agg) with packed input")
        norm_length = token_shape[1]
        if sequence_group is not None:  # the padded length of the whole sequences: the ranks' slices together
            norm_length = all_reduce(torch.tensor(float(norm_length), dtype=torch.float64, device=logits.device),
                                     sequence_group)

    mask_f = valid.double()
    rejected = rejection_gate = None
    if cfg.rejection:  # a second correction: tokens leave the mask (and every count) before anything else
        if old is None:
            raise ValueError("old_logprobs is required by LossConfig.rejection (its criteria compare the sampler "
                             "with the learner at theta_old, as verl's rollout_rs does); for a first step pass "
                             "fused_is.token_logprobs of the current logits")
        from .coefficients import rejection_keep

        keep = rejection_keep(samp, old, mask_f, seq_index, num_seqs, cfg.rejection, group=sequence_group)
        rejected = mask_f * (1.0 - keep)
        if cfg.rejection_counts == "drop":
            mask_f = mask_f * keep
        else:  # "keep" (OpenRLHF): the policy term times 0, the counts unchanged
            rejection_gate = keep
    seq_count = sequence_sum(mask_f, seq_index, num_seqs, sequence_group)  # the whole sequences' counts
    token_count = None if sequence_group is None else seq_count.sum()
    agg = _aggregation_weights(mask_f, seq_index, num_seqs, seq_count, cfg.loss_agg, normalizer, norm_length,
                               token_count)
    entropy_weight = None
    if cfg.entropy_agg is not None:
        entropy_weight = _aggregation_weights(mask_f, seq_index, num_seqs, seq_count, cfg.entropy_agg,
                                              entropy_normalizer, norm_length, token_count)
    return Batch(
        logits=logits,
        token_shape=token_shape,
        tokens=ids,
        advantages=adv,
        sampler_logprobs=samp,
        old_logprobs=old,
        ref_logprobs=ref,
        mask=mask_f,
        seq_index=seq_index,
        num_seqs=num_seqs,
        seq_token_count=seq_count,
        agg_weight=agg,
        config=cfg,
        normalizer=normalizer,
        norm_length=norm_length,
        validate=validate,
        rejected=rejected,
        rejection_gate=rejection_gate,
        is_weights=weights,
        entropy_weight=entropy_weight,
        entropy_normalizer=entropy_normalizer,
        sequence_group=sequence_group,
        row_temperature=row_tau,
    )


def check_backend(backend) -> str:
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}; got {backend!r}")
    return backend
