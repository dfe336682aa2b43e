"""Fused linear: the policy loss from the hidden states and the lm_head weight, never [N, V] logits at once.

    linear_policy_loss(hidden, weight, tokens, advantages, ...) == policy_loss(hidden @ weight.T + bias, ...)

Rows go in chunks. Per chunk: logits = hidden_chunk @ W^T (+ b) in logits_dtype (the GEMM accumulates in
fp32 and rounds once, as the model's own head would), the backend's fused kernel turns that buffer in place
into d loss / d logits, then grad_hidden[chunk] = dlogits @ W and grad_W += dlogits^T @ hidden_chunk into
an fp32 accumulator (grad_b += the column sums). One chunk buffer is reused, so the extra memory is
O(chunk x V + V x D), flat in N.

A masked row's gradient is 0: the gradient sweep takes the unmasked rows alone, gathered chunk by chunk
(`split_rows`), so its head GEMM and the d hidden and d weight GEMMs scale with the unmasked rows; d hidden is 0 at
the masked ones. Their logprob and entropy are still outputs: formed once, by the statistics kernel.

The plan is fused_is/plan.py's: token-local configurations take one sweep over the chunks; those whose
coefficients need every logprob of a sequence (sequence or geometric IS with old_logprobs=None, GSPO,
GMPO) take a stats sweep first, the per-sequence reduction, then the gradient sweep, which recomputes each
chunk's logits (one more GEMM per chunk, still no [N, V]).
"""

from __future__ import annotations

import dataclasses
import functools
import numbers
import os
import sys
import warnings
from typing import Optional, Tuple, Union

import torch

from . import backends, coefficients, distill, distributed, plan
from . import kept as kept_sets
from .api import PolicyLossOutput, reference_loss, token_logprobs
from .backends import abi
from .call import Arguments, prepare, prepare_rows
from .validate import (LOGITS_DTYPES, Temperature, check_backend, check_rows, check_validate, describe_values,
                       output_dtype, temperature_rows)

# The chunk's logits take as much memory as the weight (D rows of V), at least MIN_CHUNK_ROWS rows: each chunk
# adds its d weight into the fp32 accumulator, and where the GEMM cannot accumulate into fp32 itself (the CPU)
# that is one pass over the fp32 [V, D] per chunk (cache-hot, block by block, but still 8 bytes per element:
# about a third of the d weight GEMM of 1024 rows at V = 151936, D = 1024 here), so chunks must not be short.
# Peak extra memory: the logits chunk and the accumulator (2 + 4 bytes per weight element in bf16), then the
# accumulator and the returned d weight (4 + 2) at the end; flat in N.
MIN_CHUNK_ROWS = 256
# rows of the weight per block of the d weight product on the CPU path: a [block, D] temporary of about 8 MiB
PRODUCT_BLOCK_BYTES = 8 << 20


# what the fused-linear functions return at masked rows: "formed" (their logprob and entropy, the logits formed once
# for them) or "zero" (0 for both, and nothing formed for those rows: every GEMM scales with the unmasked rows)
MASKED_OUTPUTS = ("formed", "zero")


def check_masked_outputs(masked_outputs) -> bool:
    """Whether masked rows are skipped (masked_outputs="zero"); ValueError naming the argument otherwise."""
    if not isinstance(masked_outputs, str) or masked_outputs not in MASKED_OUTPUTS:
        raise ValueError(f"masked_outputs must be 'formed' (the masked rows' logprob and entropy, their logits formed "
                         f"once) or 'zero' (0 there, their logits never formed); got {masked_outputs!r}")
    return masked_outputs == "zero"


def zero_masked(valid: torch.Tensor, *outputs: torch.Tensor) -> Tuple[torch.Tensor, ...]:
    """The outputs (each [N] or shaped like valid) with 0 at the masked rows: masked_outputs="zero"."""
    return tuple(torch.where(valid.reshape(x.shape), x, torch.zeros((), dtype=x.dtype, device=x.device))
                 for x in outputs)


def default_chunk_rows(num_rows: int, dim: int) -> int:
    """Rows per chunk when chunk_size is None: max(D, MIN_CHUNK_ROWS), at most N (and at least 1)."""
    return max(1, min(num_rows, max(dim, MIN_CHUNK_ROWS)))


# a chunk's rows: a range of every row (slice), or int64 indices of rows gathered from anywhere (`split_rows`)
Rows = Union[slice, torch.Tensor]


def row_count(rows: Rows) -> int:
    """The number of rows of a chunk."""
    return rows.stop - rows.start if isinstance(rows, slice) else rows.numel()


def split_rows(valid: torch.Tensor, validate: str) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
    """(unmasked, masked): int64 row indices, each ascending, of the rows whose gradient a sweep forms and of those
    whose gradient is 0 (valid False); or None when every row counts, or under validate="async", which reads nothing
    on the host: the sweeps then take every row, masked ones included (their gradient is 0 all the same). Counting
    them is one host read (a sync on CUDA); every rank of a vocab_group holds the same mask, so the same rows in the
    same order."""
    if validate == "async" or valid.numel() == 0:
        return None
    count = int(valid.sum())  # the one host read
    if count == valid.numel():
        return None
    order = torch.sort((~valid).to(torch.uint8), stable=True).indices  # unmasked rows first, each part ascending
    return order[:count], order[count:]


def logits_dtype_argument(logits_dtype, head_dtype, function: str):
    """logits_dtype, or the deprecated head_dtype= of the fused-linear functions (its old name, the same meaning)
    with a DeprecationWarning; both is a TypeError."""
    if head_dtype is None:
        return logits_dtype
    if logits_dtype is not None:
        raise TypeError(f"{function}: logits_dtype= and head_dtype= are both given; head_dtype= is the deprecated "
                        "old name of logits_dtype=: pass logits_dtype= alone")
    warnings.warn(f"{function}(head_dtype=) is deprecated: the dtype the GEMM forms the logits in is logits_dtype= "
                  "(policy_loss's head_dtype= is head-precision replay, LossConfig.head_dtype here)",
                  DeprecationWarning, stacklevel=_caller_level())
    return head_dtype


def _caller_level() -> int:
    """The stacklevel with which warnings.warn, called by the function that calls this one, names the first frame
    outside this package and torch._dynamo: the user's line (fused_is.<name> is wrapped by torch.compiler.disable)."""
    package = os.path.dirname(os.path.abspath(__file__)) + os.sep
    dynamo = os.sep + os.path.join("torch", "_dynamo") + os.sep
    level, frame = 1, sys._getframe(2)  # the frame that called warnings.warn's caller
    while frame is not None and (frame.f_code.co_filename.startswith(package) or dynamo in frame.f_code.co_filename):
        level, frame = level + 1, frame.f_back
    return level + 1


def _check_float(name: str, x, shape: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of shape {shape}; got {type(x).__name__}")
    if x.dtype not in LOGITS_DTYPES:
        raise TypeError(f"{name} must be bf16, fp16, fp32 or fp64; got {x.dtype}")


def check_head(hidden, weight, bias, logits_dtype, chunk_size, prefix: str = "") -> torch.dtype:
    """Type, shape and device checks of the linear head's arguments; returns the dtype of the logits. prefix: what
    the errors put before hidden, weight and bias ("teacher_": the teacher's head of linear_distill_loss)."""
    h, w, b = (prefix + name for name in ("hidden", "weight", "bias"))
    _check_float(h, hidden, "[B, T, D] or [N, D]")
    if hidden.dim() not in (2, 3):
        raise ValueError(f"{h} must be [B, T, D] (padded) or [N, D] (packed); got shape {tuple(hidden.shape)}")
    _check_float(w, weight, "[V, D]")
    if weight.dim() != 2 or weight.shape[0] < 1 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"{w} must be the lm_head's [V, D] with D = {h}.shape[-1] = {hidden.shape[-1]} and "
                         f"V >= 1; got shape {tuple(weight.shape)}")
    if weight.device != hidden.device:
        raise ValueError(f"{w} is on {weight.device} but {h} is on {hidden.device}; put both on one device")
    if bias is not None:
        _check_float(b, bias, "[V]")
        if bias.shape != weight.shape[:1]:
            raise ValueError(f"{b} must have shape [V] = [{weight.shape[0]}]; got {tuple(bias.shape)}")
        if bias.device != hidden.device:
            raise ValueError(f"{b} is on {bias.device} but {h} is on {hidden.device}; put both on one device")
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, numbers.Integral)
                                   or chunk_size < 1):
        raise ValueError(f"chunk_size must be None or a positive int (rows per chunk); got {chunk_size!r}")
    if logits_dtype is None:
        if hidden.dtype != weight.dtype:
            raise TypeError(f"{h} is {hidden.dtype} but {w} is {weight.dtype}: pass logits_dtype= to say in "
                            "which dtype the logits are formed (e.g. torch.float32, the fp32 lm_head)")
        return hidden.dtype
    if logits_dtype not in LOGITS_DTYPES:
        raise TypeError(f"logits_dtype must be None, torch.bfloat16, torch.float16, torch.float32 or torch.float64; "
                        f"got {logits_dtype!r}")
    return logits_dtype


def check_teacher_head(hidden, weight, teacher_hidden, teacher_weight, teacher_bias) -> torch.dtype:
    """The teacher's head of a fused-linear distillation (linear_distill_loss, linear_policy_loss's teacher_hidden=):
    check_head's checks with the errors naming teacher_*, one row per student position, the student's vocabulary and
    device, nothing that requires grad. Returns the dtype of the teacher's logits (teacher_hidden's)."""
    teacher_dtype = check_head(teacher_hidden, teacher_weight, teacher_bias, None, None, prefix="teacher_")
    if teacher_hidden.shape[:-1] != hidden.shape[:-1]:
        raise ValueError(f"teacher_hidden must have hidden's leading shape {tuple(hidden.shape[:-1])} (one teacher row "
                         f"per student position); got shape {tuple(teacher_hidden.shape)}")
    if teacher_weight.shape[0] != weight.shape[0]:
        raise ValueError(f"teacher_weight has a vocabulary of {teacher_weight.shape[0]} rows but weight of "
                         f"{weight.shape[0]}: distillation over the full vocabulary needs one vocabulary for both "
                         "models; slice the padded vocabulary of the larger head to the tokenizer's size")
    if teacher_hidden.device != hidden.device:
        raise ValueError(f"teacher_hidden is on {teacher_hidden.device} but hidden is on {hidden.device}; put both "
                         "on one device")
    for name, x in (("teacher_hidden", teacher_hidden), ("teacher_weight", teacher_weight),
                    ("teacher_bias", teacher_bias)):
        if x is not None and x.requires_grad:
            raise ValueError(f"{name} requires grad: the distillation loss trains the student alone and never writes a "
                             f"gradient for the teacher; pass {name}.detach() (or run the teacher under "
                             "torch.no_grad())")
    return teacher_dtype


def logits_stand_in(hidden: torch.Tensor, vocab: int, dtype: torch.dtype) -> torch.Tensor:
    """A [.., V] tensor of the logits' shape, dtype and device that owns one element (stride 0): what the
    argument checks and the backend choice look at. Its values are never read."""
    return torch.zeros((), dtype=dtype, device=hidden.device).expand(*hidden.shape[:-1], vocab)


@functools.lru_cache(maxsize=None)
def _fp32_accumulating_gemm(device_type: str) -> bool:
    """Whether acc += a @ b with bf16/fp16 a, b and an fp32 acc runs as one GEMM on this device type
    (aten::addmm.dtype_out writing into its own input: cuBLAS on CUDA; not on the CPU), checked once per
    process on a small case against the exact result (that first check reads the device: one host sync)."""
    try:
        a = torch.arange(6, dtype=torch.float32, device=device_type).reshape(2, 3).to(torch.bfloat16)
        acc = torch.ones(2, 2, dtype=torch.float32, device=device_type)
        torch.ops.aten.addmm.dtype_out(acc, a, a.t(), torch.float32, out=acc)
        return bool(torch.equal(acc.cpu(), torch.tensor([[6.0, 15.0], [15.0, 51.0]])))
    except (TypeError, RuntimeError, NotImplementedError):
        return False


class Head:
    """hidden @ weight.T (+ bias) in `dtype`, chunk by chunk, and the gradients of its inputs."""

    def __init__(self, hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], dtype: torch.dtype,
                 chunk_rows: Optional[int], round_to: Optional[torch.dtype] = None):
        self.round_to = round_to  # LossConfig.head_dtype coarser than dtype: each chunk's logits rounded to it
        self.shape = hidden.shape
        self.hidden = hidden.detach().reshape(-1, hidden.shape[-1])  # [N, D]; a copy only if strides demand it
        self.weight = weight.detach().to(dtype)  # no copy when it already is
        self.bias = None if bias is None else bias.detach().to(dtype)
        self.dtype = dtype
        self.num_rows, self.dim = self.hidden.shape
        self.vocab = weight.shape[0]
        self.chunk_rows = chunk_rows or default_chunk_rows(self.num_rows, self.dim)
        self._buffer = None
        self._gathered = None  # (rows, their hidden states): the last gathered chunk, read by two GEMMs

    def chunks(self, rows: Optional[torch.Tensor] = None):
        """The chunks of every row in order (slices), or of the rows `rows` (int64 indices; each chunk a
        [chunk_rows] piece of them, whose hidden states are gathered: one chunk's copy, never [N, D])."""
        if rows is None:
            for start in range(0, self.num_rows, self.chunk_rows):
                yield slice(start, min(start + self.chunk_rows, self.num_rows))
            return
        for start in range(0, rows.numel(), self.chunk_rows):
            yield rows[start:start + self.chunk_rows]

    def hidden_rows(self, rows: Rows) -> torch.Tensor:
        if isinstance(rows, slice):
            return self.hidden[rows].to(self.dtype)
        if self._gathered is None or self._gathered[0] is not rows:
            self._gathered = (rows, self.hidden.index_select(0, rows).to(self.dtype))
        return self._gathered[1]

    def buffer(self, rows: Rows) -> torch.Tensor:
        """The [rows, V] chunk buffer (one, reused by every chunk; contiguous), its contents undefined."""
        if self._buffer is None:
            self._buffer = torch.empty(self.chunk_rows, self.vocab, dtype=self.dtype, device=self.hidden.device)
        return self._buffer[:row_count(rows)]

    def logits(self, rows: Rows) -> torch.Tensor:
        """[rows, V] logits of these rows, in one buffer reused by every chunk (contiguous)."""
        out = self.buffer(rows)
        if self.bias is None:
            torch.mm(self.hidden_rows(rows), self.weight.t(), out=out)
        else:  # the bias inside the GEMM: one rounding to the head dtype, as nn.Linear's addmm
            torch.addmm(self.bias, self.hidden_rows(rows), self.weight.t(), out=out)
        if self.round_to is not None:  # head-precision replay: rounded as the sampler's head output was
            out.copy_(out.to(self.round_to))
        return out

    def row_logits(self, row: int) -> torch.Tensor:
        """[V] logits of one row, freshly computed (for the diagnosis of a bad row)."""
        h = self.hidden_rows(slice(row, row + 1))
        z = (h @ self.weight.t() if self.bias is None else torch.addmm(self.bias, h, self.weight.t()))[0]
        return z if self.round_to is None else z.to(self.round_to).to(z.dtype)

    def row_name(self, row: int) -> str:
        if len(self.shape) == 3:
            t = self.shape[1]
            return f"row {row} of hidden @ weight.T (hidden[{row // t}, {row % t}])"
        return f"row {row} of hidden @ weight.T (hidden[{row}])"

    def release(self) -> None:
        self._buffer = self._gathered = None


def describe_heads(heads, row: int) -> Optional[str]:
    """Why row `row`'s formed logits of either model have no softmax (NaN, +inf, every entry -inf), or None."""
    for head, name in zip(heads, ("hidden @ weight.T", "teacher_hidden @ teacher_weight.T")):
        values = head.row_logits(row).double()
        arg = name.split(" ")[0]
        where = (f"row {row} of {name} ({arg}[{row // head.shape[1]}, {row % head.shape[1]}])" if len(head.shape) == 3
                 else f"row {row} of {name} ({arg}[{row}])")
        for bad, what in ((torch.isnan(values), "NaN"), (torch.isposinf(values), "+inf")):
            if bool(bad.any()):
                return f"the logits hold {what} at {where}, column {int(bad.nonzero()[0, 0])}"
        if bool(torch.isneginf(values).all()):
            return f"every logit at {where} is -inf (no token has probability > 0)"
    return None


class HeadGrads:
    """d loss / d hidden (in hidden's dtype, row block by row block), and d loss / d weight and bias summed over
    the chunks in fp32 (float64 for an fp64 head), handed out in their parameters' dtypes by `finish`."""

    def __init__(self, head: Head, dtypes: Tuple[torch.dtype, torch.dtype, Optional[torch.dtype]],
                 want: Tuple[bool, bool, bool], sharded: bool = False, gathered: bool = False):
        device = head.hidden.device
        acc = torch.float64 if head.dtype == torch.float64 else torch.float32
        self.head = head
        self.dtypes = dtypes
        # a vocabulary shard's d hidden is a partial sum over the shards (summed by an all-reduce): kept in the
        # accumulator precision so that the shards' roundings do not add up
        hidden_dtype = acc if sharded else dtypes[0]
        # gathered: the chunks hold the unmasked rows alone, and the masked rows' d hidden is this 0
        new = torch.zeros if gathered else torch.empty
        self.hidden = new(head.num_rows, head.dim, dtype=hidden_dtype, device=device) if want[0] else None
        self.weight = torch.zeros(head.vocab, head.dim, dtype=acc, device=device) if want[1] else None
        self.bias = torch.zeros(head.vocab, dtype=acc, device=device) if want[2] else None
        self._product = None  # a [block, D] temporary of the CPU path (no [V, D] one)

    def add(self, rows: Rows, dlogits: torch.Tensor, valid: Optional[torch.Tensor]) -> None:
        """Take the chunk's d loss / d logits [rows, V] (in the head dtype) into the three gradients.
        rows: a slice, with valid: bool [rows]: a masked row's dlogits are 0, and its hidden state, which may hold
        anything (NaN at padding), is replaced by 0 in d weight (0 * NaN would be NaN); or gathered unmasked rows
        (int64 indices, valid None)."""
        head = self.head
        if self.hidden is not None:
            if not isinstance(rows, slice):
                self.hidden.index_copy_(0, rows, (dlogits @ head.weight).to(self.hidden.dtype))
            elif self.hidden.dtype == head.dtype:
                torch.mm(dlogits, head.weight, out=self.hidden[rows])
            else:
                self.hidden[rows] = dlogits @ head.weight
        if self.weight is not None:
            h = head.hidden_rows(rows)
            if valid is not None:
                h = torch.where(valid.unsqueeze(1), h, torch.zeros((), dtype=h.dtype, device=h.device))
            if dlogits.dtype == self.weight.dtype:
                self.weight.addmm_(dlogits.t(), h)
            elif _fp32_accumulating_gemm(dlogits.device.type):
                torch.ops.aten.addmm.dtype_out(self.weight, dlogits.t(), h, self.weight.dtype, out=self.weight)
            else:  # block by block of the vocabulary: the product rounded once to the head dtype, added in fp32
                vocab, dim = self.weight.shape
                block = max(1, min(vocab, PRODUCT_BLOCK_BYTES // (dim * dlogits.element_size())))
                if self._product is None:
                    self._product = torch.empty(block, dim, dtype=dlogits.dtype, device=dlogits.device)
                for start in range(0, vocab, block):
                    stop = min(start + block, vocab)
                    product = torch.mm(dlogits[:, start:stop].t(), h, out=self._product[:stop - start])
                    self.weight[start:stop].add_(product)
        if self.bias is not None:
            self.bias.add_(dlogits.sum(0, dtype=self.bias.dtype))

    def finish(self, scale: torch.Tensor, hidden_shape):
        """(d hidden, d weight, d bias) times scale (a 0-d tensor, read on the device), in the parameters'
        dtypes; None where not wanted. Scaled in the accumulators' precision, rounded once."""
        self._product = None
        grad_hidden = None if self.hidden is None else self.hidden.mul_(scale).to(self.dtypes[0]).view(hidden_shape)
        grad_weight = grad_bias = None
        if self.weight is not None:
            grad_weight = self.weight.mul_(scale)
            self.weight = None
            grad_weight = grad_weight.to(self.dtypes[1])  # the accumulator itself when the dtypes agree
        if self.bias is not None:
            grad_bias = self.bias.mul_(scale).to(self.dtypes[2])
        self.hidden = self.bias = None
        return grad_hidden, grad_weight, grad_bias


class HeadRows:
    """The head's logits, chunk by chunk, as a row source of the plan (fused_is/plan.py): each chunk formed by the
    GEMM into one reused buffer, its gradient written over it in place and taken into the three gradients.
    split: `split_rows` of the call (None: every row): the gradient sweep gathers the unmasked rows alone; the
    statistics sweeps take every row (lp and H are outputs at masked rows too), or, skip_masked (masked_outputs=
    "zero"), the unmasked rows alone as well: a masked row's logits are never formed (the plan's statistics there
    are left 0)."""

    # a fused_is.plan.RowSource: rows formed here (no caller's logits), their gradient taken chunk by chunk
    logits, inplace, deferred, whole = None, False, False, False

    def __init__(self, head: Head, tokens: torch.Tensor, valid: torch.Tensor, want=(False, False, False),
                 dtypes=None, vocab_group=None, split=None, skip_masked: bool = False, teacher=None):
        self.head, self.tokens, self.valid = head, tokens, valid
        self.want, self.dtypes, self.vocab_group = want, dtypes, vocab_group
        self.split = split
        self.skip_masked = skip_masked and split is not None
        self.grads = None
        self.teacher = None
        if teacher is not None:
            self._open_teacher(*teacher)

    def blocks(self):
        for rows in self.head.chunks(self.split[0] if self.skip_masked else None):
            logits = self.head.logits(rows)
            yield rows, logits
            if self.teacher is not None and not any(self.want):  # no gradient sweep: the term's statistics here
                self._distill_statistics(rows, logits)

    def gradient_blocks(self, form: bool = True):
        """(rows, their logits, where their gradient goes: over the logits, in place), the unmasked rows' alone when
        the call has masked ones; form=False: the chunk buffer without its logits (no GEMM), for a gradient that
        overwrites every entry without reading them (kept sets)."""
        self.grads = HeadGrads(self.head, self.dtypes, self.want, sharded=self.vocab_group is not None,
                            gathered=self.split is not None)
        for rows in self.head.chunks(None if self.split is None else self.split[0]):
            logits = self.head.logits(rows) if form else self.head.buffer(rows)
            if self.teacher is None:
                yield rows, logits, logits
            else:  # the policy's gradient into a second buffer: the distillation term reads the logits after it
                self._formed = (rows, logits)
                yield rows, logits, self._grad_buffer[:row_count(rows)]

    def skipped_blocks(self):
        """(rows, their logits) of the rows gradient_blocks leaves out (the masked ones): the one-pass plan's
        statistics of them (none when they are skipped: masked_outputs="zero")."""
        if self.split is not None and not self.skip_masked:
            for rows in self.head.chunks(self.split[1]):
                yield rows, self.head.logits(rows)

    def take(self, rows: Rows, dlogits: torch.Tensor) -> None:
        if self.teacher is not None:  # the distillation term's gradient added to the policy's (one rounding)
            formed_rows, logits = self._formed
            assert formed_rows is rows, "HeadRows.take: not the chunk gradient_blocks yielded last"
            part, stats = self._distill_statistics(rows, logits)
            distill.gradient_sweep(part, stats, part.agg_weight, dlogits, accumulate=True)
        self.grads.add(rows, dlogits, self.valid[rows] if isinstance(rows, slice) else None)

    @property
    def forms_term(self) -> bool:
        """Whether the chunks carry the distillation term's rows (teacher_hidden=)."""
        return self.teacher is not None

    # --- the distillation term (LossConfig.distill_kind with teacher_hidden=), chunk by chunk --------------------

    def _open_teacher(self, head: Head, term) -> None:
        """head: the teacher's Head (its chunks as the student's); term: distill.policy_term_call of the call."""
        self.teacher = (head, term)
        device = self.valid.device
        self.teacher_lse = torch.zeros(2, self.valid.numel(), dtype=torch.float64, device=device)
        self.teacher_divergence = torch.zeros(self.valid.numel(), dtype=torch.float64, device=device)
        self._formed = None
        self._grad_buffer = torch.empty(self.head.chunk_rows, self.head.vocab, dtype=self.head.dtype,
                                        device=device) if any(self.want) else None

    def _distill_statistics(self, rows: Rows, logits: torch.Tensor):
        """The term's DistillCall of the chunk (the student's formed logits, the teacher's formed by its GEMM) and its
        row statistics, recorded for `distill_divergence`. A token's term is its own row's: nothing across rows."""
        head, term = self.teacher
        part = term.rows(rows, logits, head.logits(rows))
        stats = distill.statistics_sweep(part)
        self.teacher_lse[:, rows], self.teacher_divergence[rows] = stats.lse, stats.divergence
        return part, stats

    def distill_divergence(self) -> torch.Tensor:
        """D_t float64 [N], 0 at masked rows, after the sweeps; ValueError naming the first unmasked row whose formed
        logits (of either model) hold NaN or +inf or are all -inf, or whose divergence is infinite."""
        head, term = self.teacher
        distill.check_pair_rows(None, None, self.valid, self.teacher_lse, self.teacher_divergence,
                            term.divergence.title,
                            describe=lambda row: describe_heads((self.head, head), row))
        return torch.where(self.valid, self.teacher_divergence, 0.0)

    def gradient(self):
        """The HeadGrads; a vocabulary shard's d hidden, a partial sum over the shards, all-reduced once."""
        if self.vocab_group is not None and self.grads.hidden is not None:
            distributed.sum_shard_partials_(self.grads.hidden, self.vocab_group)
        return self.grads

    def describe(self, shard_start=None):
        head = self.head
        if shard_start is not None:
            return distributed.describe_shard_row(head.row_logits, head.row_name, shard_start)
        return lambda row: describe_values(head.row_logits(row), head.row_name(row), int(self.tokens[row]))

    def close(self) -> None:
        self.head.release()
        if self.teacher is not None:
            self.teacher[0].release()
            self._grad_buffer = self._formed = None


class LinearPolicyLoss(torch.autograd.Function):
    """autograd.Function behind `linear_policy_loss`: the gradients of hidden, weight and bias are made in
    forward (chunk by chunk) and scaled by grad_output in backward, which can run once.

    apply(hidden, weight, bias, call, head, compute_grad, skip_masked, teacher) -> (loss, lp [N], H [N], metric values)
    skip_masked (masked_outputs="zero"): the masked rows' logits are never formed, their lp and H are 0.
    teacher: None, or (the teacher's Head, the distillation term's DistillCall): LossConfig.distill_kind's term
    formed chunk by chunk beside the policy's (HeadRows)
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, call, head: Head, compute_grad: bool, skip_masked: bool = False,
                teacher=None):
        want = (compute_grad and hidden.requires_grad, compute_grad and weight.requires_grad,
                compute_grad and bias is not None and bias.requires_grad)
        dtypes = (hidden.dtype, weight.dtype, None if bias is None else bias.dtype)
        split = split_rows(call.valid, call.validate) if any(want) or skip_masked else None
        source = HeadRows(head, call.tokens, call.valid, want, dtypes, call.vocab_group, split, skip_masked, teacher)
        loss, lp, entropy, values, grads = plan.run(call, source, any(want))
        if skip_masked:
            lp, entropy = zero_masked(call.valid, lp, entropy)
        dtype = output_dtype(head.dtype)
        ctx.grads = grads
        ctx.hidden_shape = hidden.shape
        lp, entropy = lp.to(dtype), entropy.to(dtype)
        ctx.mark_non_differentiable(lp, entropy, values)
        return loss.to(dtype), lp, entropy, values

    @staticmethod
    def backward(ctx, grad_loss, *_unused):
        grads = backends.take_once(ctx, "grads", "linear_policy_loss")
        grad_hidden, grad_weight, grad_bias = grads.finish(grad_loss, ctx.hidden_shape)  # no host read
        return grad_hidden, grad_weight, grad_bias, None, None, None, None, None


def linear_policy_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    tokens: torch.Tensor,
    advantages: torch.Tensor,
    *,
    bias: Optional[torch.Tensor] = None,
    logits_dtype: Optional[torch.dtype] = None,
    chunk_size: Optional[int] = None,
    sampler_logprobs: torch.Tensor = None,
    old_logprobs: torch.Tensor = None,
    ref_logprobs: torch.Tensor = None,
    mask: torch.Tensor = None,
    cu_seqlens: torch.Tensor = None,
    config="ppo_tis",
    normalizer=None,
    backend: str = "auto",
    validate: str = "full",
    is_weights: torch.Tensor = None,
    entropy_normalizer=None,
    vocab_group=None,
    temperature: Optional[torch.Tensor] = None,
    loss_scale: Optional[float] = None,
    kept: Optional[torch.Tensor] = None,
    head_dtype: Optional[torch.dtype] = None,
    versions: Optional[torch.Tensor] = None,
    current_version: Optional[int] = None,
    sampler_topk=None,
    masked_outputs: str = "formed",
    teacher_hidden: Optional[torch.Tensor] = None,
    teacher_weight: Optional[torch.Tensor] = None,
    teacher_bias: Optional[torch.Tensor] = None,
) -> PolicyLossOutput:
    """`policy_loss` of the logits hidden @ weight.T (+ bias), computed chunk by chunk: no [N, V] tensor.

    Args:
        hidden: [B, T, D] padded or [N, D] packed final hidden states; bf16, fp16, fp32 or fp64.
        weight: [V, D] lm_head weight (may be tied to the input embedding: autograd adds the gradients).
        tokens, advantages, sampler_logprobs, old_logprobs, ref_logprobs, mask, cu_seqlens, config,
            normalizer, validate, is_weights, entropy_normalizer, temperature, loss_scale, versions,
            current_version, sampler_topk: as for `policy_loss`, with hidden's leading shape in place of the
            logits' (score centering's K columns read from each chunk's logits as the stats pass forms them).
        kept: the sampler's kept set as ids, [..., K] int (-1 = no entry), as for `policy_loss`: lp, H and the
            gradients over it; each chunk's logits are still formed whole by the GEMM, and its K kept logits per row
            read from them (not with vocab_group; `SamplerParams` need the logits themselves: pass the ids).
        bias: [V] or None.
        logits_dtype: the dtype the GEMM forms the logits in (hidden and weight cast to it, the fp32 accumulation
            rounded to it once, as a head of that dtype does; nothing is rounded afterwards). None = hidden's dtype
            (weight must have the same); torch.float32 casts both to fp32 for the product (the fp32 lm_head, the
            learner-side twin of `fused_is.vllm`'s sampler head); torch.float64 too. Head-precision replay of a
            coarser sampler head (policy_loss's head_dtype=) is LossConfig.head_dtype here: each chunk's logits
            rounded further to it.
        head_dtype: the deprecated old name of logits_dtype (a DeprecationWarning; both given is a TypeError).
        chunk_size: rows per chunk (default max(D, 256)); the extra memory is about chunk_size x V logits in
            logits_dtype plus an fp32 [V, D] gradient accumulator, whatever N is (plus a copy of weight in
            logits_dtype when it has another dtype, e.g. the fp32 head of a bf16 weight).
        backend: "auto", "triton", "cuda", "cpu", "torch" or "reference" (the oracle: the whole [N, V]
            logits in float64, differentiated by autograd; outputs float64).
        vocab_group: a torch.distributed process group over which the lm_head is split by vocabulary rows
            (Megatron's vocab-parallel output layer): weight (and bias) are this rank's contiguous shard
            [V_local, D] (shards in group-rank order, sizes may differ), hidden is the same on every rank and
            tokens are global ids. One all-gather of the shards' row statistics for every chunk; then the gradient
            sweep forms each chunk's logits again; d hidden (summed over the shards by one all-reduce), loss,
            logprobs, entropy and metrics are identical on every rank, d weight and d bias are the shard's.
            Backends "cpu", "triton" and "torch".
        masked_outputs: "formed" (default) or "zero": what logprobs and entropy hold at the masked rows (mask, and
            the tokens LossConfig.rejection drops). "formed": the values policy_loss gives there, their logits formed
            once for the statistics alone. "zero": 0 there, and no GEMM forms a masked row's logits at all (with
            validate="full"; "async", which cannot count them on the host, forms every row and writes the 0s), so
            every product scales with the unmasked rows. The loss, its gradients and the metrics are the same
            either way.
        teacher_hidden, teacher_weight, teacher_bias: LossConfig.distill_kind only: the teacher's final hidden states
            (hidden's leading shape, [.., D_t], D_t may differ), its lm_head [V, D_t] (the student's vocabulary) and
            bias [V] or None, in one dtype, read only (nothing that requires grad). Each chunk of unmasked rows forms
            the teacher's logits too (a second chunk buffer, and one more for the policy's gradient), the
            distillation term's statistics and gradient of that chunk beside the policy's; the loss adds
            distill_coef times the same aggregation of D_t, and the metrics distill_mean, as policy_loss with
            teacher_logits=. Not with vocab_group, kept, score centering, per-row temperatures or head-precision
            replay (refused by name).
    Returns:
        PolicyLossOutput(loss, logprobs, entropy, metrics): loss 0-d, differentiable w.r.t. hidden, weight
        and bias; loss, logprobs and entropy fp32 (fp64 for an fp64 head). Masked rows (mask, and the tokens
        LossConfig.rejection drops) have logprobs and entropy as masked_outputs says and d hidden exactly 0; the
        gradient sweep leaves them out (validate="full": finding them is one host read; "async" sweeps every
        row).
    Raises:
        TypeError / ValueError naming the argument before any product is formed; ValueError naming the row
        (of hidden) whose logits hold NaN or +inf, are all -inf, or give the sampled token -inf.
    Note: `inplace` has no meaning here (the chunk buffers are always overwritten in place). Under
    torch.compile this function runs eagerly (a graph break).
    """
    parameters = dict(locals())  # the signature's parameters by name (nothing else is bound yet)
    # head_dtype here is logits_dtype's deprecated name (check_head), not a rounding of formed logits: the call's
    # replay of a coarser head is LossConfig.head_dtype's alone
    args = Arguments.of(parameters, head_dtype=None)  # checks backend and validate
    logits_dtype = logits_dtype_argument(logits_dtype, head_dtype, "linear_policy_loss")
    skip_masked = check_masked_outputs(masked_outputs)
    shard = None
    if vocab_group is not None:
        shard = distributed.open_shard(weight, "weight", "[V_local, D]", 0, vocab_group, validate)
    dtype = check_head(hidden, weight, bias, logits_dtype, chunk_size)
    stand_in = logits_stand_in(hidden, weight.shape[0], dtype)
    teacher_dtype = None
    if teacher_hidden is not None or teacher_weight is not None or teacher_bias is not None:
        if teacher_hidden is None or teacher_weight is None:
            raise ValueError("teacher_hidden= and teacher_weight= go together (the teacher's hidden states and its "
                             "lm_head weight; teacher_bias= is optional)")
        teacher_dtype = check_teacher_head(hidden, weight, teacher_hidden, teacher_weight, teacher_bias)
        args = dataclasses.replace(args, teacher_logits=logits_stand_in(teacher_hidden, weight.shape[0], teacher_dtype))
    call = prepare(stand_in, args, shard)  # every argument error first
    if call.backend == "reference":
        if teacher_dtype is not None:
            args = dataclasses.replace(args, teacher_logits=reference_logits(teacher_hidden, teacher_weight,
                                                                              teacher_bias, call.valid).detach())
        out = reference_loss(reference_logits(hidden, weight, bias, call.valid), args)
        if skip_masked:
            lp, entropy = zero_masked(call.valid, out.logprobs, out.entropy)
            out = PolicyLossOutput(out.loss, lp, entropy, out.metrics, backend=out.backend)
        return out
    compute_grad = torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in (hidden, weight, bias))
    head = Head(hidden, weight, bias, dtype, chunk_size, call.head_rounding)
    teacher = None
    if teacher_dtype is not None:
        teacher = (Head(teacher_hidden, teacher_weight, teacher_bias, teacher_dtype, head.chunk_rows),
                   distill.policy_term_call(call, formed=True))
    loss, lp, entropy, values = LinearPolicyLoss.apply(hidden, weight, bias, call, head, compute_grad, skip_masked,
                                                       teacher)
    names, values = coefficients.metric_names(call), list(values.unbind(0))
    if validate == "full":
        values = torch.stack(values).tolist() if values else []  # one host read for all of them
    return PolicyLossOutput(loss=loss, logprobs=lp.reshape(call.token_shape),
                            entropy=entropy.reshape(call.token_shape), metrics=dict(zip(names, values)),
                            backend=call.backend)


def reference_logits(hidden, weight, bias, valid=None) -> torch.Tensor:
    """The oracle's logits: hidden @ weight.T (+ bias) in float64, differentiable. valid (bool [N], optional): a
    masked row's hidden state may hold anything; its non-finite entries are read as 0 (detached), so that the
    row's zero logit gradient adds 0 to the weight's gradient, not 0 * NaN."""
    h = hidden.double()
    if valid is not None:
        rows = valid.reshape(h.shape[:-1]).unsqueeze(-1)
        h = torch.where(rows, h, torch.nan_to_num(h.detach(), nan=0.0, posinf=0.0, neginf=0.0))
    logits = h @ weight.double().t()
    return logits if bias is None else logits + bias.double()


def linear_token_logprobs(
    hidden: torch.Tensor, weight: torch.Tensor, tokens: torch.Tensor, *, bias: Optional[torch.Tensor] = None,
    temperature: Temperature = 1.0, logits_dtype: Optional[torch.dtype] = None, chunk_size: Optional[int] = None,
    mask: torch.Tensor = None, backend: str = "auto", validate: str = "full", vocab_group=None,
    kept: Optional[torch.Tensor] = None, head_dtype: Optional[torch.dtype] = None, masked_outputs: str = "formed",
) -> Tuple[torch.Tensor, torch.Tensor]:
    """No-grad logprobs and entropies of softmax((hidden @ weight.T + bias) / temperature), chunk by chunk,
    for the old/ref logprob passes of a fused-linear trainer.

    Args:
        hidden: [B, T, D] or [N, D]; weight: [V, D]; bias: [V] or None; bf16, fp16, fp32 or fp64.
        tokens: [B, T] or [N] integer ids in [0, V) (ids at masked positions may be out of range).
        temperature: a positive number, or per-row temperatures as for `token_logprobs`.
        logits_dtype, chunk_size, vocab_group: as for `linear_policy_loss` (with vocab_group, weight and bias are
            this rank's vocabulary shard and the results those of the whole head, on every rank).
        mask, backend, validate: as for `token_logprobs`.
        masked_outputs: "formed" (default: every row's logits formed, the outputs at masked rows those of
            token_logprobs on hidden @ weight.T) or "zero" (0 at masked rows, whose logits are never formed with
            validate="full": the GEMMs scale with the unmasked rows), as for `linear_policy_loss`.
        kept: the sampler's kept set as ids, as for `linear_policy_loss`: the logprobs and entropy over it.
        head_dtype: the deprecated old name of logits_dtype (a DeprecationWarning; both given is a TypeError).
    Returns:
        (logprobs, entropy), each shaped like tokens, fp32 (fp64 for an fp64 head).
    """
    check_backend(backend)
    check_validate(validate)
    logits_dtype = logits_dtype_argument(logits_dtype, head_dtype, "linear_token_logprobs")
    skip_masked = check_masked_outputs(masked_outputs)
    start, vocab, shard = 0, None, None
    if vocab_group is not None:
        start, vocab = distributed.open_shard(weight, "weight", "[V_local, D]", 0, vocab_group, validate)
        shard = (vocab_group, start)
        backends.resolve(backend, weight, sharded=True)  # "reference" and "cuda" are refused on every rank alike
    dtype = check_head(hidden, weight, bias, logits_dtype, chunk_size)
    stand_in = logits_stand_in(hidden, weight.shape[0], dtype)
    given_temperature = temperature
    ids, valid, temperature, kept_ids = prepare_rows(stand_in, tokens, mask, temperature, validate, vocab, kept,
                                                     vocab_group, arg="hidden @ weight.T")
    out_dtype = output_dtype(dtype)
    if backend == "reference":
        with torch.no_grad():
            lp, entropy = token_logprobs(reference_logits(hidden, weight, bias), tokens, given_temperature,
                                         "reference", mask=mask, validate=validate, kept=kept)
        return zero_masked(valid, lp, entropy) if skip_masked else (lp, entropy)
    name = backends.resolve(backend, stand_in, sharded=vocab_group is not None)
    split = split_rows(valid, validate) if skip_masked else None
    source = HeadRows(Head(hidden, weight, bias, dtype, chunk_size), ids, valid, split=split, skip_masked=skip_masked)
    with torch.no_grad():
        if kept_ids is not None:
            lp, entropy, _ = plan.kept_row_statistics(source, ids, kept_ids, temperature, valid)
        else:
            lp, entropy, _ = plan.row_statistics(source, ids, temperature, backends.implementation(name), shard)
    source.close()
    check_rows(None, ids, lp, entropy, valid, validate, source.describe(None if shard is None else start))
    if skip_masked:
        lp, entropy = zero_masked(valid, lp, entropy)
    return lp.to(out_dtype).reshape(tokens.shape), entropy.to(out_dtype).reshape(tokens.shape)


class LinearLogprobs(torch.autograd.Function):
    """autograd.Function behind `linear_logprobs`: forward is the statistics sweep over the chunks (O(N) kept);
    backward forms each chunk's logits again, writes d logits over them from the upstream gradients of lp and H
    (the kernels' given-statistics sweep) and takes them into d hidden, d weight and d bias. With a kept set
    (int64 [N, K]), forward reads each chunk's K kept logits per row (fused_is/kept.py) and keeps their probabilities;
    backward writes the K kept columns into each chunk's buffer (zeros elsewhere, no GEMM to form the logits again).
    Backward's chunks hold the unmasked rows alone when some are masked (`split_rows`; their gradient is 0).

    apply(hidden, weight, bias, head, ids, valid, temperature, name, shard, kept, skip_masked) -> (lp [N], H [N])
    skip_masked (masked_outputs="zero"): forward forms the unmasked rows alone, lp and H are 0 at the masked ones.
    hidden, weight and bias are saved for backward (autograd refuses it if they change in between), whose Head
    forms the chunks' logits again from them; the O(N) (or O(N K)) statistics stay with the node, so backward may run
    again with retain_graph=True.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, head: Head, ids, valid, temperature, name: str, shard, kept=None,
                skip_masked: bool = False):
        ctx.save_for_backward(hidden, weight, bias)
        ctx.head_args = (head.dtype, head.chunk_rows)
        split = split_rows(valid, "full") if any(ctx.needs_input_grad[:3]) or skip_masked else None
        ctx.unmasked = None if split is None else split[0]
        source = HeadRows(head, ids, valid, split=split, skip_masked=skip_masked)
        if kept is None:
            impl = backends.implementation(name)
            lp, entropy, (rows, whole_rows) = plan.row_statistics(source, ids, temperature, impl, shard,
                                                                  whole_rows=True)
            kept_state = (impl, rows, distributed.kernel_statistics(whole_rows, valid).contiguous())
        else:  # the kept ids, their probabilities and the entropy (the sweep's statistics)
            lp, entropy, probs = plan.kept_row_statistics(source, ids, kept, temperature, valid)
            kept_state = (kept, probs, entropy)
        source.close()
        check_rows(None, ids, lp, entropy, valid, "full", source.describe(None if shard is None else shard[1]))
        if skip_masked:
            lp, entropy = zero_masked(valid, lp, entropy)
        ctx.state = (kept_state, ids, valid, temperature, shard,
                     (hidden.dtype, weight.dtype, None if bias is None else bias.dtype), hidden.shape)
        dtype = output_dtype(head.dtype)
        return lp.to(dtype), entropy.to(dtype)

    @staticmethod
    def backward(ctx, grad_lp, grad_entropy):
        kept_state, ids, valid, temperature, shard, dtypes, hidden_shape = ctx.state
        hidden, weight, bias = ctx.saved_tensors
        head = Head(hidden, weight, bias, *ctx.head_args)
        want = tuple(ctx.needs_input_grad[:3])
        args = abi.upstream_args(temperature, valid, grad_lp, grad_entropy)
        grads = HeadGrads(head, dtypes, want, sharded=shard is not None, gathered=ctx.unmasked is not None)
        for rows in head.chunks(ctx.unmasked):
            if isinstance(kept_state[0], torch.Tensor):  # a kept set: its K columns per row, from g and h
                kept, probs, entropy = kept_state
                table = args.row_table[:, rows]
                logits = kept_sets.kept_gradient(ids[rows], kept[rows], probs[rows], entropy[rows],
                                                 table[abi.ROW_INPUTS.index("g")], table[abi.ROW_INPUTS.index("h")],
                                                 temperature_rows(temperature, rows), head.buffer(rows))
            else:
                impl, local_ids, stats = kept_state
                logits = head.logits(rows)
                impl.fused_given(logits, local_ids[rows], stats[:, rows].contiguous(), args.rows(rows), logits)
            grads.add(rows, logits, valid[rows] if isinstance(rows, slice) else None)
        head.release()
        if shard is not None and grads.hidden is not None:  # a partial sum over the vocabulary shards
            distributed.sum_shard_partials_(grads.hidden, shard[0])
        one = torch.ones((), dtype=torch.float32, device=head.hidden.device)
        grad_hidden, grad_weight, grad_bias = grads.finish(one, hidden_shape)
        return grad_hidden, grad_weight, grad_bias, None, None, None, None, None, None, None, None


def linear_logprobs(
    hidden: torch.Tensor, weight: torch.Tensor, tokens: torch.Tensor, *, bias: Optional[torch.Tensor] = None,
    temperature: Temperature = 1.0, logits_dtype: Optional[torch.dtype] = None, chunk_size: Optional[int] = None,
    mask: torch.Tensor = None, backend: str = "auto", vocab_group=None, kept: Optional[torch.Tensor] = None,
    head_dtype: Optional[torch.dtype] = None, masked_outputs: str = "formed",
) -> Tuple[torch.Tensor, torch.Tensor]:
    """`fused_is.logprobs` of the logits hidden @ weight.T (+ bias), chunk by chunk: logprobs and entropies
    differentiable w.r.t. hidden, weight and bias, for a loss of your own, never [N, V] logits at once.

    Forward is one statistics sweep over the chunks (each chunk's logits formed by the GEMM, O(N) kept); backward
    forms each chunk's logits again, writes d logits over them from the upstream gradients of both outputs in one
    sweep, and takes them into d hidden, d weight and d bias (three GEMMs per chunk, as linear_policy_loss). Forward
    takes every row; backward the unmasked rows alone, gathered chunk by chunk (a masked row's gradient is 0: its
    d hidden is exactly 0 and it adds nothing to d weight and d bias).

    Args:
        hidden, weight, tokens, bias, temperature, logits_dtype, chunk_size, mask, vocab_group: as for
            `linear_token_logprobs`.
        backend: "auto", "triton", "cuda", "cpu", "torch" or "reference" (the whole [N, V] logits in float64,
            autograd).
        kept: the sampler's kept set as ids, as for `linear_policy_loss`: lp, H and the gradients over it (backward
            writes each chunk's K kept columns, no GEMM to form its logits again).
        head_dtype: the deprecated old name of logits_dtype (a DeprecationWarning; both given is a TypeError).
        masked_outputs: "formed" (default) or "zero": 0 at the masked rows, whose logits forward then never forms
            (as for `linear_policy_loss`); their gradient is 0 either way.
    Returns:
        (logprobs, entropy), each shaped like tokens, fp32 (fp64 for an fp64 head), differentiable.
    Under torch.compile this function runs eagerly (a graph break).
    """
    check_backend(backend)
    logits_dtype = logits_dtype_argument(logits_dtype, head_dtype, "linear_logprobs")
    skip_masked = check_masked_outputs(masked_outputs)
    shard = None
    if vocab_group is not None:
        start, vocab = distributed.open_shard(weight, "weight", "[V_local, D]", 0, vocab_group, "full")
        shard = (vocab_group, start)
        backends.resolve(backend, weight, sharded=True)  # "reference" and "cuda" are refused on every rank alike
    dtype = check_head(hidden, weight, bias, logits_dtype, chunk_size)
    stand_in = logits_stand_in(hidden, weight.shape[0], dtype)
    ids, valid, tau, kept_ids = prepare_rows(stand_in, tokens, mask, temperature, "full",
                                             None if shard is None else vocab, kept, vocab_group,
                                             arg="hidden @ weight.T")
    if backend == "reference":
        from .logprobs import logprobs

        lp, entropy = logprobs(reference_logits(hidden, weight, bias, valid), tokens, temperature=temperature,
                               mask=mask, backend="reference", kept=kept)
        return zero_masked(valid, lp, entropy) if skip_masked else (lp, entropy)
    name = backends.resolve(backend, stand_in, sharded=shard is not None)
    head = Head(hidden, weight, bias, dtype, chunk_size)
    lp, entropy = LinearLogprobs.apply(hidden, weight, bias, head, ids, valid, tau, name, shard, kept_ids,
                                       skip_masked)
    return lp.reshape(tokens.shape), entropy.reshape(tokens.shape)
