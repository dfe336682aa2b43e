"""The plan runner of DESIGN.md sections 4 and 8: one function for every layout, decided once per call.

A call's rows come from a row source: the caller's logits (`LogitsRows`), or the fused-linear head's chunks that
the GEMM forms (fused_is/linear.py `HeadRows`). Their statistics are combined locally, or, with a vocab_group,
from every rank's partial statistics of its vocabulary shard (fused_is/distributed.py, reduced in a fixed order,
so the result does not depend on the collective's algorithm). Context-parallel sums are the call's own
reductions (`Call.seq_sum`, `Call.total`). The plan:

- stats only (no gradient wanted): `stats` gives lp and H;
- one pass (token-local configurations, one rank): `fused` forms g and h per row itself and writes the gradient;
- two passes (a row's coefficients need the current lp of its whole sequence: `needs_stats_pass`): `stats`, the
  per-sequence reduction in float64 (fused_is/backends/abi.py `pack`), then `fused` with W or g given per row;
- a vocabulary shard: the shard's partial statistics, their combination, every row's g and h, then the gradient
  sweep alone (`fused_given`) with the whole rows' statistics given;
- a distillation term (LossConfig.distill_kind, teacher_logits=): its statistics sweep over both rows, the policy's
  plan, then its gradient sweep adding to the policy's gradient (fused_is/distill.py); or, where
  `fused_distill_term` says so (Triton, one pass, forward or reverse KL), one kernel for all of it
  (fused_is/backends/triton.py `policy_fused`).
`decide` chooses the steps (a plain record, `Steps`) before `run` takes them. Each backend offers `stats`,
`partial_stats`, `fused` and `fused_given` (fused_is/backends/__init__.py), each of which launches its kernel
itself: policy_loss -> FusedPolicyLoss.forward -> run -> a primitive.
"""

from __future__ import annotations

import dataclasses
from typing import Iterator, Optional, Protocol, Tuple

import torch

from . import backends, centering, coefficients, distill, distributed, divergences, ops
from . import kept as kept_sets
from .backends import abi
from .backends.torch_chunked import row_chunks
from .policies import policy
from .validate import check_rows, checked_values, describe_distribution_row


def needs_stats_pass(call) -> bool:
    """True when a row's coefficients depend on the current logprobs of its whole sequence (the two-pass
    plan): W_t of sequence/geometric IS with old_logprobs=None, the sequence ratios of GSPO and GMPO, TRL's
    off-policy mask (a sequence's mean of samp - lp, current lp), a policy the table marks (fused_is/policies.py:
    VESPO's gamma weight, or g given per row)."""
    cfg = call.config
    return (cfg.coefficients_given or (cfg.is_level in ("sequence", "geometric") and call.old_logprobs is None)
            or cfg.off_policy_mask is not None or policy(cfg.policy).stats_pass)


class RowSource(Protocol):
    """What the plan reads of a row source (`LogitsRows`, `RoundedRows`, fused_is/linear.py `HeadRows`): declared,
    so that the plan asks a source its properties and never its type."""

    logits: Optional[torch.Tensor]  # the caller's logits (value checks' diagnosis; in place), or None: formed rows
    inplace: bool  # the gradient goes over the logits' own buffer
    deferred: bool  # the gradient is written when backward runs
    whole: bool  # the caller's logits as they are, one block (the one-kernel term, the kept sets' deferred gradient)
    forms_term: bool  # the source forms the distillation term's rows beside the policy's (the fused-linear head)

    def blocks(self) -> Iterator[Tuple[Optional[slice], torch.Tensor]]: ...
    def gradient_blocks(self) -> Iterator[Tuple[Optional[slice], torch.Tensor, torch.Tensor]]: ...
    def skipped_blocks(self) -> Iterator[Tuple[Optional[slice], torch.Tensor]]: ...
    def take(self, rows, grad) -> None: ...
    def gradient(self): ...
    def describe(self, shard_start=None): ...
    def close(self) -> None: ...


class LogitsRows:
    """The caller's logits [B, T, V] or [N, V] as one block of rows; the gradient goes into a buffer of their
    dtype and shape, or (inplace) into the logits themselves: inplace=True ("backward") writes it there when
    backward runs (`DeferredGradient`), inplace="forward" during the forward call."""

    whole, forms_term = True, False

    def __init__(self, logits: torch.Tensor, inplace=False, defer_fp16: bool = True):
        self.logits = logits
        self.inplace = bool(inplace)
        self.inplace_in_backward = inplace is True or inplace == "backward"
        # fp16 without inplace: the gradient too is written in backward, into a new buffer, with grad_output
        # folded in before it is rounded to fp16 (a GradScaler's 65536 would otherwise scale values already
        # flushed to 0, and a scale below 1 could not bring back an inf)
        # (not under torch.compile, whose graph hands the gradient to backward as a tensor: defer_fp16=False)
        self.deferred = self.inplace_in_backward or (defer_fp16 and not inplace and logits.dtype == torch.float16)
        self.grad = None

    def blocks(self) -> Iterator[Tuple[Optional[slice], torch.Tensor]]:
        """(rows, their logits) covering every row; rows None: all of them (no slicing)."""
        yield None, self.logits

    def gradient_blocks(self) -> Iterator[Tuple[Optional[slice], torch.Tensor, torch.Tensor]]:
        """(rows, their logits, where their gradient goes)."""
        self.grad = backends.gradient_buffer(self.logits, self.inplace)
        yield None, self.logits, self.grad
        if self.inplace:  # the kernels wrote through a raw pointer: tell autograd the logits changed
            torch.autograd.graph.increment_version(self.logits)

    def skipped_blocks(self) -> Iterator[Tuple[Optional[slice], torch.Tensor]]:
        """(rows, their logits) of the rows gradient_blocks leaves out: none (a fused-linear head leaves out its
        masked rows)."""
        return iter(())

    def take(self, rows, grad) -> None:
        """A block's gradient is written: nothing more to do with it (it is the buffer)."""

    def gradient(self):
        return self.grad

    def describe(self, shard_start=None):
        """The diagnosis of a flagged row: None (check_rows reads the logits), or a shard's."""
        return None if shard_start is None else distributed.describe_logits_shard(self.logits, shard_start)

    def close(self) -> None:
        pass


class RoundedRows(LogitsRows):
    """The caller's logits rounded to the sampler head's dtype before the softmax (head-precision replay,
    LossConfig.head_dtype), block by block: each block of rows (at most ROUNDED_BLOCK_ELEMENTS; across sequences of
    padded logits that flatten to [N, V], else within one) rounded (to nearest even) into one reused buffer of the
    logits' dtype, which the kernels read; its gradient is written over the buffer and copied into the gradient
    buffer (inplace="forward": into the logits, whose rows the block has read). The rounding's gradient is the
    identity. inplace=True (the sweep in backward) is refused by the front door."""

    whole = False  # blocks of rounded copies

    def __init__(self, logits: torch.Tensor, head_dtype: torch.dtype, inplace=False):
        super().__init__(logits, inplace, defer_fp16=False)
        self.head_dtype = head_dtype
        self.deferred = False
        self.step = max(1, ROUNDED_BLOCK_ELEMENTS // max(1, logits.shape[-1]))  # rows per block
        self._buffer = self._target = None

    def _block(self, logits: torch.Tensor, form: bool = True) -> torch.Tensor:
        """The buffer of a block of rows, holding their logits rounded to the head dtype (form) or anything."""
        if self._buffer is None:
            size = min(self.step, self.logits.shape[:-1].numel())
            self._buffer = torch.empty(size, self.logits.shape[-1], dtype=self.logits.dtype, device=self.logits.device)
        out = self._buffer[:logits.shape[0]]
        if form:
            out.copy_(logits.to(self.head_dtype))
        return out

    def blocks(self):
        for rows, logits in row_chunks(self.step, self.logits):
            yield rows, self._block(logits)

    def gradient_blocks(self, form: bool = True):
        self.grad = backends.gradient_buffer(self.logits, self.inplace)
        for rows, logits, self._target in row_chunks(self.step, self.logits, self.grad):
            block = self._block(logits, form)
            yield rows, block, block  # the gradient over the rounded block, in place
        if self.inplace:
            torch.autograd.graph.increment_version(self.logits)

    def take(self, rows, grad) -> None:
        self._target.copy_(grad)

    def close(self) -> None:
        self._buffer = None


# elements of RoundedRows' block buffer: 16M (64 MiB of fp32 logits), about 110 rows at V = 151936; also the block
# buffer of a gradient written by several sweeps over the logits (backends.DeferredGradient)
ROUNDED_BLOCK_ELEMENTS = 1 << 24


def logits_rows(logits: torch.Tensor, call, inplace=False, defer_fp16: bool = True) -> LogitsRows:
    """The row source of a policy_loss call's logits: their blocks rounded to the sampler head's dtype when the call
    replays its precision (`RoundedRows`), else the logits as one block (`LogitsRows`)."""
    if call.head_rounding is None:
        return LogitsRows(logits, inplace, defer_fp16)
    if inplace is True or inplace == "backward":
        raise ValueError("inplace=True writes the gradient in backward, which head-precision replay (head_dtype) "
                         "has no sweep for; use inplace='forward' or inplace=False")
    return RoundedRows(logits, call.head_rounding, inplace)


def _rows(x, rows):
    """x's part for the block `rows` (a slice, int64 indices or None: all of it): a per-row tensor's rows, a float as
    it is."""
    return x if rows is None or not isinstance(x, torch.Tensor) else x[rows]


def _assemble(parts, num_rows: int, device, base=None):
    """(lp, H) float64 [N] from the blocks' (rows, (lp, H)) (rows: a slice, int64 indices or None: every row); a
    single whole block's own tensors, not copied. base: (lp, H) [N] of the rows no block holds (copied)."""
    if len(parts) == 1 and parts[0][0] is None:
        return parts[0][1][0], parts[0][1][1]
    if base is not None:
        lp, entropy = base[0].clone(), base[1].clone()
    else:  # zeros: rows no block holds (a fused-linear head's skipped masked rows) read 0
        lp = torch.zeros(num_rows, dtype=torch.float64, device=device)
        entropy = torch.zeros_like(lp)
    for rows, (lp_rows, entropy_rows) in parts:
        lp[rows], entropy[rows] = lp_rows, entropy_rows
    return lp, entropy


def _gather(gathered, rows, logits: torch.Tensor, columns: torch.Tensor) -> None:
    """gathered[rows] = the logits of `columns` ([N, C] int64, in range) of the block's rows (float64)."""
    cut = slice(None) if rows is None else rows
    index = columns[cut]
    gathered[cut] = logits.gather(-1, index.reshape(*logits.shape[:-1], index.shape[1])).reshape(index.shape).double()


def row_statistics(source, tokens: torch.Tensor, temperature, impl, shard=None, whole_rows: bool = False,
                   gather=None):
    """(lp [N], H [N] float64, shard_rows) of every row of `source`: the stats kernel on each block, or, with
    shard = (group, start), the shard's partial statistics combined over the group; shard_rows is then
    (shard-local ids, the whole rows' [4, N] max, log S, lp, H), else None. whole_rows (one process, no shard):
    shard_rows too, from the partial statistics of the whole vocabulary (for a later sweep given them: a deferred
    gradient, logprobs' backward). gather: None, or (columns int64 [N, C], out float64 [N, C]): out gets those
    columns' logits, read from each block as it passes (score centering's K + 1 columns). No value check here."""
    if shard is None and not whole_rows:
        parts = []
        for rows, logits in source.blocks():  # a loop, not a comprehension: one frame less above the launch
            parts.append((rows, impl.stats(logits, _rows(tokens, rows), _rows(temperature, rows))))
            if gather is not None:
                _gather(gather[1], rows, logits, gather[0])
        return _assemble(parts, tokens.numel(), tokens.device) + (None,)
    group, start = (None, 0) if shard is None else shard  # whole_rows: this process holds every id, from 0
    # zeros: rows no block holds (skipped masked rows) combine to finite values, which the caller replaces by 0
    partials = torch.zeros(5, tokens.numel(), dtype=torch.float64, device=tokens.device)
    ids = torch.zeros_like(tokens)
    for rows, logits in source.blocks():
        if gather is not None:
            _gather(gather[1], rows, logits, gather[0])
        rows = slice(None) if rows is None else rows
        ids[rows], partials[:, rows] = distributed.shard_partials(logits, tokens[rows], start, _rows(temperature, rows),
                                                                  impl)
    if group is None:  # one process keeping its whole rows' statistics (whole_rows): nothing to combine
        lp, entropy, top, log_total = distributed.combine_partials(partials.unsqueeze(0), 1.0 / temperature)
    else:
        lp, entropy, top, log_total = distributed.reduce_partials(partials, 1.0 / temperature, group)
    return lp, entropy, (ids, torch.stack([top, log_total, lp, entropy]))


def fused_distill_term(call, source, compute_grad: bool) -> Optional[divergences.Divergence]:
    """The divergence (a row of fused_is/divergences.py without a mixture, with a kernel code) of a distillation term
    that runs in one kernel with the policy loss (`_fused_distill_kernel`: one sweep over both rows for the statistics,
    one for the gradient), or None: the composed plan of `run`. Fused: the caller's logits on backend="triton" (not
    under torch.compile, whose graph holds the kernel-level ops of the composed plan), a gradient wanted in forward,
    the one-pass plan (no stats pass, no vocab_group, no kept set, no score centering, no per-row temperature, no
    head-precision replay, no deferred gradient), and forward or reverse KL (JSD at beta 0 or 1 is one of them; any
    other beta composes), a teacher dtype the kernels read."""
    cfg = call.config
    if (call.teacher is None or call.backend != "triton" or not compute_grad or torch.compiler.is_compiling()
            or not source.whole or source.deferred
            or call.vocab_group is not None or call.kept is not None or call.centering_topk is not None
            or call.row_temperature is not None or needs_stats_pass(call)):
        return None
    divergence = divergences.of(cfg.distill_kind, cfg.distill_beta)
    if (divergence.mixture or divergence.code is None
            or backends.unavailable_reason("triton", call.logits, call.teacher) is not None):
        return None
    return divergence


@dataclasses.dataclass(frozen=True)
class Steps:
    """What `run` does for a call, decided before anything runs: a plain record (a test prints it)."""

    kept: bool  # the kept-set plan: each row's K kept logits gathered, no sweep over V (`_run_kept`)
    fused_term: Optional[str]  # the divergence of a term that runs in one kernel with the policy (`policy_fused`)
    # the distillation term: "" none; "composed": its statistics first, its gradient added after the policy's sweep;
    # "blocks": its gradient written with the policy's block by block (over the logits, or in backward); "head": the
    # fused-linear head forms it chunk by chunk beside the policy's
    term: str
    # "": none; "pass": the statistics sweep before the gradient sweep (or alone, no gradient wanted); "whole_rows":
    # the whole rows' statistics (a vocabulary shard's combined) for a gradient sweep given them
    statistics: str
    # "": none wanted; "fused": g and h formed per row in the sweep; "given": the sweep given the whole rows'
    # statistics; "deferred": that sweep (and the term's) written when backward runs
    gradient: str
    centering: bool  # score centering's K + 1 columns gathered in the statistics sweep, patched after


def decide(call, source, compute_grad: bool) -> Steps:
    """The steps of a prepared call over `source` (`Steps`)."""
    fused = fused_distill_term(call, source, compute_grad)
    if call.kept is not None or fused is not None:
        return Steps(call.kept is not None, fused and fused.name, "", "", "fused" if compute_grad else "", False)
    term = "head" if source.forms_term else "composed" if call.teacher is not None else ""
    deferred = compute_grad and source.deferred
    if term == "composed" and compute_grad and (deferred or source.inplace):
        term = "blocks"
    centering = call.centering_topk is not None
    # the gradient sweep given the whole rows' statistics (O(N), formed first): a vocabulary shard's, combined over
    # the group, or, deferred to backward (or the term's blocks), this process's own whole rows'
    given = call.vocab_group is not None or deferred or term == "blocks" or (centering and compute_grad)
    statistics = "whole_rows" if given else "pass" if not compute_grad or needs_stats_pass(call) else ""
    gradient = "" if not compute_grad else "deferred" if deferred else "given" if given else "fused"
    return Steps(False, None, term, statistics, gradient, centering)


def run(call, source, compute_grad: bool):
    """(loss 0-d, lp [N], H [N] float64, metric values [M] float64, the source's gradient or None) of a
    prepared call whose rows come from `source`, by its `decide`d steps. Value errors of the logits (NaN, +inf, a row
    of -inf, -inf at a sampled token) are raised after the sweep that finds them, before any gradient is written when
    the plan has a stats pass."""
    steps = decide(call, source, compute_grad)
    if steps.kept:
        return _run_kept(call, source, compute_grad)
    if steps.fused_term is not None:  # the policy loss and its distillation term in one kernel (one launch, from here)
        divergence = divergences.DIVERGENCES[steps.fused_term]
        for _, _, grad in source.gradient_blocks():  # one block: the caller's logits
            outputs = backends.implementation("triton").policy_fused(
                call.logits, call.teacher, call.tokens, call.valid, abi.pack(call), divergence.code,
                distill.term_weight(call), grad)
        return _fused_term_result(call, source, divergence, *outputs)
    distill_term = None
    # LossConfig.distill_kind: its statistics first (its errors before any write); a fused-linear head forms the
    # teacher's logits chunk by chunk instead, the term's statistics and gradient beside the policy's (HeadRows)
    if steps.term in ("composed", "blocks"):
        term = distill.policy_term_call(call)
        distill_term = (term, distill.statistics_sweep(term, check=True))  # checked: errors before any write
        call.cache.distill = torch.where(call.valid, distill_term[1].divergence, 0.0)
    # under torch.compile the kernel-level ops (fused_is/ops.py), around which dynamo traces this function
    impl = ops.Traced(call.backend) if torch.compiler.is_compiling() else backends.implementation(call.backend)
    shard = None if call.vocab_group is None else (call.vocab_group, call.vocab_start)
    describe = source.describe(None if shard is None else call.vocab_start)
    topk = call.centering_topk
    given_statistics = steps.statistics == "whole_rows"
    stats_lp = shard_rows = None
    if steps.statistics:
        gather = None if topk is None else (topk.columns(call.tokens), torch.zeros(
            topk.ids.shape[0], topk.ids.shape[1] + 1, dtype=torch.float64, device=call.tokens.device))
        if not given_statistics and gather is None:  # the stats kernel launched from here (one frame up)
            parts = []
            for rows, logits in source.blocks():
                parts.append((rows, impl.stats(logits, _rows(call.tokens, rows), _rows(call.temperature, rows))))
            lp, entropy = _assemble(parts, call.num_rows, call.tokens.device)
        else:
            lp, entropy, shard_rows = row_statistics(source, call.tokens, call.temperature, impl, shard,
                                                     whole_rows=given_statistics, gather=gather)
        lp, entropy = checked_values(source.logits, call.tokens, lp, entropy, call.valid,
                                     call.validate, describe, None if shard is None else call.vocab_start)
        stats_lp = lp
        if topk is not None:
            call.cache.centering = centering.centering_rows(topk, gather[1], lp, call.temperature, call.valid)
    if steps.gradient == "fused":
        args = abi.pack(call, stats_lp)
        parts = []
        for rows, logits, grad in source.gradient_blocks():
            part = call if rows is None else call.rows(rows, logits)
            part_args = args if rows is None else args.rows(rows, part)
            parts.append((rows, impl.fused(logits, part.tokens, part_args, grad)))
            source.take(rows, grad)
        # the rows the sweep left out (zero gradient): their lp and H from the stats pass, or, in one pass, here
        base = None if stats_lp is None else (lp, entropy)
        if stats_lp is None:
            for rows, logits in source.skipped_blocks():
                parts.append((rows, impl.stats(logits, _rows(call.tokens, rows), _rows(call.temperature, rows))))
        lp, entropy = _assemble(parts, call.num_rows, call.tokens.device, base)
        lp, entropy = checked_values(source.logits, call.tokens, lp, entropy, call.valid,
                                     call.validate, describe)
    elif steps.gradient:  # the gradient sweep alone, the whole rows' statistics given
        ids, whole_rows = shard_rows
        args = distributed.given_args(call, lp)
        given = distributed.kernel_statistics(whole_rows, call.valid)
        patch = None if topk is None else _centered(call, args, lp, entropy)
        if steps.term == "blocks" or steps.gradient == "deferred":  # in backward, or with the term's over the logits
            sweeps, reads, teacher = [policy_sweep(impl, ids, given, args, patch)], [("logits", source.logits)], None
            if steps.term == "blocks":  # head-precision replay: the policy's blocks rounded (the term rounds its own)
                term, term_stats = distill_term
                sweeps = [policy_sweep(impl, ids, given, args, patch, term.rounding), term_sweep(term, term_stats)]
                reads.append(("teacher_logits", term.teacher))
                teacher = term.teacher
            writer = backends.DeferredGradient(source.logits, source.inplace, sweeps, reads, "policy_loss", teacher,
                                               ROUNDED_BLOCK_ELEMENTS)
            source.grad = writer if steps.gradient == "deferred" else writer.write()
        else:
            given_sweep(impl, source, ids, given, args, patch)
    source.close()
    if steps.term == "head":
        call.cache.distill = source.distill_divergence()
    loss, values = coefficients.loss_and_metrics(call, lp, entropy)
    if compute_grad and steps.term == "composed":  # the term's gradient added to the policy's
        term, stats = distill_term
        distill.gradient_sweep(term, stats, term.agg_weight, source.gradient(), accumulate=True)
    return loss, lp, entropy, values, source.gradient() if compute_grad else None


def _fused_term_result(call, source, divergence, lp, entropy, term, teacher_lse):
    """run()'s outputs from `policy_fused`'s (lp, H, D_t, the teacher's log-sum-exp; the gradient is written), checked
    as the one-pass plan checks the student (after the sweep: with inplace='forward' the gradient is in the logits
    by then, as on the one-pass plan): the student's rows first (`checked_values`), then the teacher's, whose
    ValueError names teacher_logits and the row (its log-sum-exp or D_t not finite: NaN or +inf in the teacher's row,
    a row of -inf, or an infinite KL), as distill_loss's checks."""
    lp, entropy = checked_values(source.logits, call.tokens, lp, entropy, call.valid, call.validate, source.describe())
    distill.check_pair_rows(None, call.teacher, call.valid, teacher_lse.unsqueeze(0), term,
                        divergence.title,
                        lambda row: describe_distribution_row(call.teacher, "teacher_logits", row))
    call.cache.distill = torch.where(call.valid, term, 0.0)
    source.close()
    loss, values = coefficients.loss_and_metrics(call, lp, entropy)
    return loss, lp, entropy, values, source.gradient()


def _centered(call, args: abi.KernelArgs, lp: torch.Tensor, entropy: torch.Tensor) -> "centering.CenteringPatch":
    """Score centering's share of the gradient (fused_is/centering.py): the row table's g replaced by the dense part's
    (in place), and the exact values of the K + 1 columns."""
    g = args.row_table[abi.ROW_INPUTS.index("g")]
    patch = centering.CenteringPatch(call, lp, entropy, g, args.row_table[abi.ROW_INPUTS.index("h")])
    g.copy_(patch.dense_g)
    return patch


def given_sweep(impl, source, ids: torch.Tensor, stats: torch.Tensor, args: abi.KernelArgs, patch=None,
                scale=None) -> None:
    """The gradient sweep alone over every block of `source` (`LogitsRows`, `RoundedRows`), each row's whole
    statistics given (stats float64 [4, N]: max, log sum, lp, H; ids: its token ids, shard-local for a vocabulary
    shard) and its g and h in args: a vocabulary shard's sweep, the deferred gradient of policy_loss(inplace=True)
    and fused_is.logprobs' backward (the fused-linear chunks of linear_logprobs run it on each head chunk).
    patch: score centering's sparse columns (`centering.CenteringPatch`), added to each block's gradient, times
    scale (a 0-d tensor) if given."""
    for rows, logits, grad in source.gradient_blocks():
        cut = slice(None) if rows is None else rows
        impl.fused_given(logits, ids[cut], stats[:, cut].contiguous(), args if rows is None else args.rows(rows), grad)
        if patch is not None:
            patch.apply(rows, grad, scale)
        source.take(rows, grad)


def policy_sweep(impl, ids: torch.Tensor, stats: torch.Tensor, args: abi.KernelArgs, patch=None, rounding=None):
    """The policy's gradient sweep given the whole rows' statistics (float64 [4, N]) and g, h in args, as a sweep of
    backends.DeferredGradient: grad_output folded into the rows' g and h (the gradient is linear in them: no pass
    over [N, V] to scale it); score centering's columns (`patch`) written after each block; rounding: the block
    rounded to the head's dtype first (head-precision replay), the gradient written over the rounded copy."""
    stats = stats.contiguous()

    def fold(scale):
        if scale is not None:
            table = args.row_table
            for name in ("g", "h"):
                table[abi.ROW_INPUTS.index(name)].mul_(scale.to(table.dtype))

        def run(rows, logits, teacher, out):
            cut = slice(None) if rows is None else rows
            if rounding is not None:
                logits = out.copy_(logits.to(rounding))
            impl.fused_given(logits, ids[cut], stats[:, cut].contiguous(), args if rows is None else args.rows(rows),
                             out)
            if patch is not None:
                patch.apply(rows, out, scale)
        return run
    return fold


def term_sweep(term, term_stats):
    """The distillation term's gradient sweep (fused_is/distill.py `gradient_sweep`, added into the buffer and rounded
    once) as a sweep of backends.DeferredGradient: grad_output folded into its row weights."""
    def fold(scale):
        weight = term.agg_weight if scale is None else term.agg_weight * scale.to(torch.float64)

        def run(rows, logits, teacher, out):
            if rows is None:
                distill.gradient_sweep(term, term_stats, weight, out, accumulate=True)
            else:
                distill.gradient_sweep(term.rows(rows, logits, teacher), _stats_rows(term_stats, rows), weight[rows],
                                       out, accumulate=True)
        return run
    return fold


def _stats_rows(stats: "distill.RowStats", rows: slice) -> "distill.RowStats":
    """The distillation statistics of the rows `rows` alone ([k, N] rows' columns made contiguous, [N, ..] rows)."""
    return distill.RowStats(*(None if x is None else x[:, rows].contiguous() if name in ("lse", "kernel_stats")
                              else x[rows] for name, x in zip(distill.RowStats._fields, stats)))


def kept_row_statistics(source, tokens, kept, temperature, valid):
    """(lp, H float64 [N], the kept probabilities [N, K]) of every row of `source` over its kept set (fused_is/kept.py),
    block by block: the K kept logits of each row gathered from the block (a fused-linear chunk, formed by the GEMM,
    or the caller's logits) and renormalised in torch."""
    parts = []
    for rows, logits in source.blocks():
        parts.append((rows, kept_sets.kept_statistics(logits, _rows(tokens, rows), _rows(kept, rows),
                                                      _rows(temperature, rows), _rows(valid, rows))))
    if len(parts) == 1 and parts[0][0] is None:
        return parts[0][1]
    lp, entropy = _assemble([(rows, (lp, h)) for rows, (lp, h, _) in parts], tokens.numel(), tokens.device)
    probs = torch.zeros(kept.shape, dtype=torch.float64, device=tokens.device)
    for rows, (_, _, p) in parts:
        probs[rows] = p
    return lp, entropy, probs


def _run_kept(call, source, compute_grad: bool):
    """run() of a call with the sampler's kept set (fused_is/kept.py): the K kept logits of each row gathered and
    renormalised in torch (every backend alike: O(N K) work, no sweep over V). The gradient, zeros outside the kept
    sets, is written in backward over the caller's logits (`kept_sweep`), or, for the fused-linear chunks, in
    forward into each chunk's buffer and taken into the head's gradients."""
    lp, entropy, probs = kept_row_statistics(source, call.tokens, call.kept, call.temperature, call.valid)
    check_rows(source.logits, call.tokens, lp, entropy, call.valid, call.validate, source.describe())
    term_grad = None  # a distillation term over the kept sets too: its D_t, and its gradient at the kept columns
    if call.teacher is not None:
        call.cache.distill, term_grad = distill.kept_term(distill.policy_term_call(call), call.kept)
    gradient = None
    if compute_grad:
        args = distributed.given_args(call, lp)
        table = args.row_table
        g, h = table[abi.ROW_INPUTS.index("g")], table[abi.ROW_INPUTS.index("h")]
        if source.whole:
            gradient = backends.DeferredGradient(  # only the kept probabilities are read again (and, in place, the
                source.logits, source.inplace, [kept_sweep(call, probs, entropy, g, h, term_grad)],  # logits' buffer)
                [("logits", source.logits)] if source.inplace else [], "policy_loss")
        else:
            for rows, _, grad in source.gradient_blocks(form=False):
                kept_sets.kept_gradient(call.tokens[rows], call.kept[rows], probs[rows], entropy[rows], g[rows],
                                        h[rows], _rows(call.temperature, rows), grad, _rows(term_grad, rows))
                source.take(rows, grad)
            gradient = source.gradient()
    source.close()
    loss, values = coefficients.loss_and_metrics(call, lp, entropy)
    return loss, lp, entropy, values, gradient


def kept_sweep(call, probs, entropy, g, h, term_grad=None):
    """A kept-set call's gradient (fused_is/kept.py `kept_gradient`: zeros but for the kept columns, from the kept
    probabilities; a distillation term's columns added) as a sweep of backends.DeferredGradient."""
    def fold(scale):
        s = scale.to(torch.float64)

        def run(rows, logits, teacher, out):
            term = None if term_grad is None else term_grad * s
            kept_sets.kept_gradient(call.tokens, call.kept, probs, entropy, g * s, h * s, call.temperature, out, term)
        return run
    return fold
