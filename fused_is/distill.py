"""`fused_is.distill_loss`: on-policy distillation over the full vocabulary (DESIGN.md section 9), a gradient for the
student's logits only.

Two sweeps over the rows of both models, chunk by chunk (one chunk of each upcast at a time, never an [N, V] copy of
either): the statistics sweep gives each row's log-sum-exp of both models, its divergence D_t and what the gradient
needs besides (`RowStats`); O(N) work aggregates the loss; the gradient sweep writes
    d loss / d z_tj = w_t F_tj / tau,   w_t = a_t * grad_output  (a_t: the loss_agg weight of token t)
chunk by chunk into a new buffer in the logits' dtype, or over the logits themselves (inplace=True). F per kind:
    forward KL(q || p):  F = p - q
    reverse KL(p || q):  F = p (log p - log q - D)
    JSD (0 < beta < 1):  F = (1 - beta) p (log p - log m - K),  m = (1 - beta) p + beta q,  K = KL(p || m)
    top-k buckets:       F_j = g_j 1[j in support] - p_j G,  g and G from the buckets' O(K) statistics
backend="torch" is this plan in chunked eager PyTorch; backend="triton" runs both sweeps as kernels
(triton_kernels/distill.py: forward and reverse KL form D_t online in the statistics sweep, JSD reads both rows a second
time for D_t and K_t; top_k has no kernel yet), and backends "cpu" and "cuda" the same kernels in C++ and CUDA
(csrc/cpu/distill_cpu.cpp, csrc/cuda/distill_cuda.cu, launched by fused_is/backends/cpp.py), with the same
float32 statistics; backend="reference" is the oracle of fused_is/reference.py (`distill_reference`, differentiated by
autograd).

vocab_group (tensor-parallel lm_heads: each rank holds both models' logits of one vocabulary shard, the same shards,
in rank order): the statistics sweep runs on the shard, its per-row statistics are all-gathered and merged in rank
order into the whole rows' (the same float64 arithmetic on every rank, so every rank has the same bits), and the
gradient sweep runs over the shard given them (`sharded_statistics`, end of this file). The KLs need nothing more
(two reads of each shard, as in one process); JSD sums its two KLs over the shard given the merged normalisers, one
more read and one more all-gather (on Triton a separate launch, `_distill_jsd_given_kernel`, after the collective:
the rows are read again from memory where one process's second sweep finds them in L2).

Under torch.compile the sweeps are kernel-level custom ops (fused_is/ops.py `distill_stats`, `distill_checked`,
`distill_gradient`, `distill_jsd_given`) that run the functions below at run time; the rest is traced.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Dict, Iterator, NamedTuple, Optional, Tuple

import torch

from . import backends, distributed, divergences
from . import kept as kept_sets
from .backends import abi, torch_chunked
from .call import aggregation_weights
from .combinations import refused
from .config import LOSS_AGGS
from .reference import TAIL_LOG_MASS_MAX, distill_reference
from .validate import (BACKENDS, Checks, Temperature, check_logits, check_teacher_logits, check_temperature,
                       describe_distribution_row, flat_mask, output_dtype, sequence_index, temperature_rows)

# the policy loss's loss_agg names, and "sum" (TRL's reduction="sum": sum_t m_t D_t)
DISTILL_AGGS = LOSS_AGGS + ("sum",)
# the backends distill_loss has; "auto" picks policy_loss's backend for the logits where its distillation kernels can
# run the call (triton, then cuda, on CUDA tensors; cpu on CPU tensors), else "torch"
DISTILL_BACKENDS = ("torch", "triton", "cpu", "cuda", "reference")
# the backends that run both sweeps as kernels, with float32 statistics rows (RowStats.kernel_stats); no top_k
KERNEL_BACKENDS = ("triton", "cpu", "cuda")
# the backends whose sweeps run on a vocabulary shard given the whole rows' statistics (vocab_group); the CUDA kernels
# would take the same path but have not run it yet
SHARDED_BACKENDS = ("torch", "triton", "cpu")
# elements of one upcast chunk buffer (16 MiB of fp32), as backend="torch" of the policy loss; a chunk keeps about
# eight such buffers alive (both models' log-probabilities, their exps, the terms), never [N, V]
CHUNK_ELEMENTS = 1 << 22


@dataclasses.dataclass(frozen=True)
class DistillCall:
    """One distill_loss call, checked: the caller's tensors untouched, per-token vectors flattened to N rows."""

    logits: torch.Tensor  # the student's z, [B, T, V] or [N, V]
    teacher: torch.Tensor  # the teacher's u, same shape, any float dtype, read only
    valid: torch.Tensor  # bool [N]: the tokens that count
    agg_weight: torch.Tensor  # float64 [N]: a_t, loss = sum_t a_t D_t (0 at masked tokens)
    divergence: divergences.Divergence  # the row of the divergence table that runs the call (`divergences.of`)
    beta: float
    temperature: Temperature  # tau, the student's: a float, or float64 [N] per row (policy_loss's term, torch sweeps)
    teacher_temperature: Temperature  # tau_t, as tau
    top_k: int  # 0: the full vocabulary; else 0 < top_k < V
    add_tail: bool
    inplace: bool
    compute_grad: bool
    backend: str = "torch"  # the sweeps' backend: "torch" or one of KERNEL_BACKENDS ("reference": the oracle's route)
    vocab_group: object = None  # a process group: logits and teacher are this rank's vocabulary shard; else None
    vocab_start: object = 0  # with vocab_group, the shard's first column in the whole vocabulary (error texts only)
    # policy_loss's head-precision replay: the student's logits rounded to this dtype before the softmax (torch sweeps)
    rounding: Optional[torch.dtype] = None

    @property
    def num_rows(self) -> int:
        return self.valid.numel()

    @property
    def compute_dtype(self) -> torch.dtype:
        """fp32 for bf16/fp16 logits, float64 for fp32/fp64 ones (the policy loss's torch backend's rule)."""
        return torch_chunked.compute_dtype(self.logits)

    def rows(self, rows, logits: torch.Tensor, teacher: torch.Tensor) -> "DistillCall":
        """The call over the rows `rows` alone (a slice or int64 indices), whose logits and teacher are given: a chunk
        of the fused-linear heads, a block of an in-place gradient."""
        return dataclasses.replace(self, logits=logits, teacher=teacher, valid=self.valid[rows],
                                   agg_weight=None if self.agg_weight is None else self.agg_weight[rows],
                                   temperature=temperature_rows(self.temperature, rows),
                                   teacher_temperature=temperature_rows(self.teacher_temperature, rows))

    @property
    def support_width(self) -> int:
        """K', the support entries of a row (`Divergence.support_width`)."""
        return self.divergence.support_width(self.top_k)


class RowStats(NamedTuple):
    """What the statistics sweep keeps per row (float64, O(N) or O(N K)), all the gradient sweep reads besides the
    two models' rows."""

    lse: torch.Tensor  # [2, N]: log sum_j exp(z_j / tau) and log sum_j exp(u_j / tau_t)
    divergence: torch.Tensor  # [N]: D_t
    student_kl: Optional[torch.Tensor]  # [N]: K_t = KL(p || m), JSD over the full vocabulary; else None
    support: Optional[torch.Tensor]  # int64 [N, K']: top-k support ids (sorted, duplicates in place); else None
    support_grad: Optional[torch.Tensor]  # [N, K']: g_j, d D / d log p_j at the support (0 at duplicates)
    support_total: Optional[torch.Tensor]  # [N]: G = sum of g
    kernel_stats: Optional[torch.Tensor] = None  # KERNEL_BACKENDS: float32 [6, N], the kernels' STATS rows


def distill_loss(
    logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    *,
    kind: str = "forward_kl",
    beta: float = 0.5,
    temperature: float = 1.0,
    teacher_temperature: Optional[float] = None,
    mask: Optional[torch.Tensor] = None,
    cu_seqlens: Optional[torch.Tensor] = None,
    loss_agg: str = "token-mean",
    top_k: int = 0,
    add_tail: bool = True,
    backend: str = "auto",
    inplace: bool = False,
    vocab_group=None,
) -> Tuple[torch.Tensor, torch.Tensor, Dict[str, float]]:
    """Distillation loss of the student's logits towards the teacher's, over the full vocabulary.

    p = softmax(logits / temperature), q = softmax(teacher_logits / tau_t), tau_t = teacher_temperature or
    temperature; per token D_t is KL(q || p) (kind="forward_kl"), KL(p || q) ("reverse_kl") or TRL 1.16's
    generalized JSD ("jsd", GKD's generalized_jsd_loss): beta = 0 is KL(q || p), beta = 1 is KL(p || q), otherwise
    beta KL(q || m) + (1 - beta) KL(p || m) with m = (1 - beta) p + beta q. token-mean with a mask equals TRL's
    reduction="batchmean" with labels -100 at the masked positions, "sum" its reduction="sum".

    Args:
        logits: the student's, [B, T, V] padded or [N, V] packed; bf16, fp16, fp32 or fp64; any strides.
        teacher_logits: the teacher's, the same shape, any floating-point dtype; read only (never copied to fp32
            [N, V], never written); must not require grad.
        kind: "forward_kl", "reverse_kl" or "jsd".
        beta: in [0, 1], read by kind="jsd": the teacher's weight in the mixture m and on KL(q || m).
        temperature: tau > 0 of the student (and of the teacher unless teacher_temperature is given).
        teacher_temperature: tau_t > 0 of the teacher, or None (tau).
        mask: bool or 0/1, logits.shape[:-1], or None (every position counts). Masked positions may hold anything;
            their D_t is 0 and their gradient exactly 0.
        cu_seqlens: packed input only: int [S + 1] sequence offsets (0 = first <= ... <= last = N).
        loss_agg: "token-mean" (sum m D / sum m), "seq-mean-token-mean", "seq-mean-token-sum",
            "seq-mean-token-sum-norm" (padded input: divided by T) as for the policy loss, or "sum" (sum m D).
        top_k: 0 (the full vocabulary), or k: the sums over the support of TRL's IW-OPD generalized_jsd_loss, the
            teacher's top k tokens (forward KL), the student's (reverse KL) or both (JSD), when k < V.
        add_tail: with top_k, one more bucket with each model's probability outside the support (else each model is
            renormalised over the support).
        backend: "auto" (policy_loss's pick for the logits when its kernels can run the call: "triton", then
            "cuda", for CUDA tensors, "cpu" for CPU tensors (built on first use as for policy_loss); else "torch": fp64
            logits, other teacher dtypes, top_k), "torch", "triton", "cpu", "cuda" (the kernels: bf16/fp16/fp32
            logits, bf16/fp16/fp32/fp64 teacher; no top_k yet: refused by name) or "reference" (the float64 oracle,
            autograd).
        inplace: backward writes the gradient over the logits' own buffer (no [N, V] gradient buffer) and hands it
            to autograd; the logits keep their values until then; a write into the logits or the teacher in between
            is a RuntimeError in backward. False: nothing is written into the caller's tensors.
        vocab_group: a torch.distributed process group over which the vocabulary is split (tensor-parallel lm_heads):
            logits and teacher_logits are this rank's shard [..., V_local] of the same columns, the shards
            contiguous and in group-rank order (sizes may differ); every rank passes the same mask and cu_seqlens.
            loss, per_token and metrics are the whole vocabulary's, bit for bit the same on every rank; the gradient
            is this shard's. Backends "auto", "torch", "triton" and "cpu"; not with top_k (refused by name). Besides
            the all-gather of the shard sizes, one all-gather of [5, N] float64 per rank (the KLs) or two ([5, N], then
            [2, N]: JSD). The KLs read each shard as often as one process reads the rows (twice); the JSD reads it
            three times, on backends "torch" and "cpu" once more than one process (its mixture needs the whole
            rows' normalisers, which exist only after the first collective).
    Returns:
        (loss, per_token, metrics): loss 0-d (fp32; fp64 for fp64 logits), differentiable w.r.t. logits;
        per_token D_t, logits.shape[:-1], same dtype, detached, 0 at masked positions; metrics a dict of floats:
        divergence_mean and divergence_max over the unmasked tokens.
    Raises:
        TypeError / ValueError naming the argument before anything is computed: shapes or vocabularies that differ,
        beta outside [0, 1], a teacher that requires grad, unknown names. NaN or +inf logits of either model (or a
        row of only -inf) at an unmasked position: ValueError naming the argument and the row, found by the
        statistics sweep and raised before the gradient sweep runs.
    Under torch.compile(fullgraph=True) the call is traced around the distillation ops of fused_is/ops.py (every
    backend but "reference", vocab_group and top_k included): the checks run at run time (a bad row's ValueError
    names it; a bad mask or cu_seqlens names the check, not its position), metrics are 0-d tensors, the gradient of
    fp16 logits is rounded in forward and scaled by grad_output after; inplace=True and backend="reference" are
    refused there.
    """
    options = dict(kind=kind, beta=beta, temperature=temperature, teacher_temperature=teacher_temperature, mask=mask,
                   cu_seqlens=cu_seqlens, loss_agg=loss_agg, top_k=top_k, add_tail=add_tail)
    compiling = torch.compiler.is_compiling()
    if compiling:
        _check_compilable(backend, inplace)
    call = prepare(logits, teacher_logits, options, backend, inplace, torch.is_grad_enabled() and logits.requires_grad)
    if vocab_group is not None:
        call = open_vocab_shard(call, vocab_group, backend, top_k)
    if call.backend == "reference":
        if inplace:
            raise refused("reference/inplace")
        return _reference(logits, teacher_logits, call.valid, call.divergence.title, dict(
            options, temperature=call.temperature, teacher_temperature=call.teacher_temperature))
    loss, per_token, metric_values = DistillLoss.apply(logits, call)
    names = ("divergence_mean", "divergence_max")
    if compiling:  # 0-d tensors: a float would break the graph
        metrics = dict(zip(names, metric_values.unbind(0)))
    else:
        metrics = dict(zip(names, metric_values.tolist()))  # one host read
    return loss, per_token.reshape(logits.shape[:-1]), metrics


def prepare(logits: torch.Tensor, teacher_logits: torch.Tensor, options: dict, backend: str, inplace: bool,
            compute_grad: bool) -> DistillCall:
    """Every check of a distill_loss call (TypeError / ValueError naming the argument), then the call: backend
    "reference" (the oracle's route, left to the caller), "torch" or a kernel backend. options: distill_loss's kind,
    beta, temperature, teacher_temperature, mask, cu_seqlens, loss_agg, top_k and add_tail. logits and teacher_logits
    may be stand-ins of the right shape, dtype and device whose values are never read (linear_distill_loss)."""
    kind, beta, loss_agg, top_k, add_tail = (options[k] for k in ("kind", "beta", "loss_agg", "top_k", "add_tail"))
    name = _check_options(kind, beta, loss_agg, top_k, add_tail, backend, inplace)
    check_logits(logits, "logits")
    check_teacher_logits(teacher_logits, logits)
    tau = check_temperature(options["temperature"])
    teacher_temperature = options["teacher_temperature"]
    tau_t = tau if teacher_temperature is None else _teacher_temperature(teacher_temperature)
    token_shape = logits.shape[:-1]
    padded = logits.dim() == 3
    if loss_agg == "seq-mean-token-sum-norm" and not padded:
        raise ValueError("loss_agg='seq-mean-token-sum-norm' divides by the padded length T, which packed input has "
                         "not (distill_loss takes no norm_length yet); use padded logits or another loss_agg")
    checks = Checks("full")
    valid = flat_mask(options["mask"], token_shape, logits, checks)
    seq_index, num_seqs = sequence_index(options["cu_seqlens"], token_shape, logits, padded, checks)
    # under torch.compile the flags are read at run time (fused_is::checked) and gate the mask, which every sweep reads
    valid = checks.done(gate=valid)
    divergence = divergences.of(kind, beta)
    if name != "reference":
        name = _backend(name, logits, teacher_logits, top_k if top_k < logits.shape[-1] else 0, divergence)
    return DistillCall(
        logits=logits, teacher=teacher_logits, valid=valid,
        agg_weight=_agg_weight(valid, seq_index, num_seqs, loss_agg, token_shape), divergence=divergence,
        beta=float(beta), temperature=tau, teacher_temperature=tau_t,
        top_k=top_k if top_k < logits.shape[-1] else 0, add_tail=add_tail, inplace=inplace,
        compute_grad=compute_grad, backend=name)


def _check_options(kind, beta, loss_agg, top_k, add_tail, backend, inplace) -> str:
    """The scalar options, each refused by name; returns the backend asked for ("auto" or one of
    DISTILL_BACKENDS)."""
    if not isinstance(kind, str) or kind not in divergences.KINDS:
        raise ValueError(f"kind must be one of {divergences.KINDS}; got {kind!r}")
    if isinstance(beta, bool) or not isinstance(beta, (int, float)):
        raise TypeError(f"beta must be a number in [0, 1]; got {type(beta).__name__}")
    if not 0.0 <= beta <= 1.0:  # NaN fails too
        raise ValueError(f"beta must be in [0, 1] (0: forward KL, 1: reverse KL, TRL's convention); got {beta!r}")
    if not isinstance(loss_agg, str) or loss_agg not in DISTILL_AGGS:
        raise ValueError(f"loss_agg must be one of {DISTILL_AGGS}; got {loss_agg!r}")
    if isinstance(top_k, bool) or not isinstance(top_k, int):
        raise TypeError(f"top_k must be an int >= 0 (0: the full vocabulary); got {type(top_k).__name__}")
    if top_k < 0:
        raise ValueError(f"top_k must be >= 0 (0: the full vocabulary); got {top_k}")
    if not isinstance(add_tail, bool):
        raise TypeError(f"add_tail must be a bool; got {add_tail!r}")
    if not isinstance(inplace, bool):
        raise TypeError(f"inplace must be a bool; got {inplace!r}")
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}; got {backend!r}")
    if backend != "auto" and backend not in DISTILL_BACKENDS:
        raise ValueError(f"backend={backend!r} is not available for distill_loss yet: it has {DISTILL_BACKENDS} "
                         "('auto' picks a kernel backend where one can run the call, else 'torch')")
    return backend


def _backend(name: str, logits: torch.Tensor, teacher: torch.Tensor, top_k: int,
             divergence: divergences.Divergence) -> str:
    """The sweeps' backend for "auto", "torch" or a kernel backend on these tensors (top_k: 0 or below V); ValueError
    naming why a kernel backend cannot run them."""
    if name == "auto":  # policy_loss's pick where its distillation kernels read both models: triton, cuda, cpu
        return "torch" if top_k or divergence.code is None else backends.resolve("auto", logits, teacher=teacher)
    if name in KERNEL_BACKENDS:
        backends.resolve(name, logits, teacher=teacher)  # ValueError: why it cannot run here
        if divergence.code is None:
            raise refused("kernel_less/kernels", kind=divergence.name, backend=name)
        if top_k:
            raise refused("top_k/kernels", top_k=top_k, backend=name)
    return name


def _teacher_temperature(value) -> float:
    """check_temperature's checks, its errors naming teacher_temperature."""
    try:
        return check_temperature(value)
    except ValueError as error:  # its messages begin with "temperature ..."
        raise ValueError(f"teacher_{error}") from None


def _agg_weight(valid, seq_index, num_seqs: int, loss_agg: str, token_shape) -> torch.Tensor:
    """a_t of the policy loss's aggregation (fused_is/call.py), or 1 at unmasked tokens for "sum"; float64 [N]."""
    mask = valid.double()
    if loss_agg == "sum":
        return mask
    seq_count = torch.zeros(num_seqs, dtype=torch.float64, device=mask.device).index_add_(0, seq_index, mask)
    norm_length = token_shape[1] if len(token_shape) == 2 else None
    return aggregation_weights(mask, seq_index, num_seqs, seq_count, loss_agg, None, norm_length)


def _reference(logits, teacher_logits, valid, divergence: str, options: dict):
    """backend="reference": the oracle in float64, differentiated by autograd, its values checked as the sweep's."""
    out_dtype = output_dtype(logits.dtype)
    loss, per_token, metrics = distill_reference(logits.double(), teacher_logits, **options)
    lse = [torch.logsumexp(x.detach().reshape(-1, x.shape[-1]).double(), dim=-1) for x in (logits, teacher_logits)]
    check_pair_rows(logits, teacher_logits, valid, torch.stack(lse), per_token.reshape(-1), divergence)
    values = torch.stack(list(metrics.values())).tolist()
    return loss.to(out_dtype), per_token.to(out_dtype), dict(zip(metrics, values))


# --- the two sweeps ------------------------------------------------------------------------------------------------


def _chunks(call: DistillCall, *tensors: torch.Tensor) -> Iterator[Tuple]:
    """`torch_chunked.row_chunks` of the tensors (the logits' shape), CHUNK_ELEMENTS of the compute dtype's fp32 budget
    a chunk."""
    step = max(1, CHUNK_ELEMENTS // (call.logits.shape[-1] * call.compute_dtype.itemsize // 4 or 1))
    return torch_chunked.row_chunks(step, *tensors)


def _log_softmax(chunk: torch.Tensor, valid: torch.Tensor, temperature: Temperature, dtype: torch.dtype,
                 lse: Optional[torch.Tensor] = None, rounding=None) -> Tuple[torch.Tensor, torch.Tensor]:
    """(log softmax(chunk / temperature) in `dtype`, its row log-sum-exp float64 [rows]) of one chunk, computed in a
    new buffer (the caller's rows are never written); masked rows read as zeros. temperature: a float, or the rows'
    float64 [rows]. lse: the rows' log-sum-exp from the statistics sweep (the gradient sweep reuses it). rounding:
    a dtype the chunk is rounded to first (head-precision replay; its gradient is the identity)."""
    if rounding is not None:
        chunk = chunk.to(rounding)
    x = chunk.to(dtype, copy=True).masked_fill_(~valid.unsqueeze(1), 0.0)
    if isinstance(temperature, torch.Tensor):
        x.div_(temperature.to(dtype).unsqueeze(1))
    elif temperature != 1.0:
        x.div_(temperature)
    row_lse = torch.logsumexp(x, dim=-1) if lse is None else lse.to(dtype)
    return x.sub_(row_lse.unsqueeze(1)), row_lse.double()


def statistics_sweep(call: DistillCall, check: bool = False) -> RowStats:
    """Every row's statistics (`RowStats`): the kernels' sweep, or the torch sweep one chunk of both models at a time
    (one read of each). check: the call's statistics, checked: with a vocab_group the whole rows' (merged from the
    shards), and a ValueError naming the first unmasked row whose statistics are not finite (on every rank alike);
    unchecked (the default), the rows as given (a shard's own, a chunk of the fused-linear heads)."""
    if check and call.vocab_group is not None:
        stats = sharded_statistics(call)
        return _checked(call, stats, describe_pair_shard_row(call.logits, call.teacher, call.vocab_start, stats.lse))
    if torch.compiler.is_compiling():  # the kernel-level op (fused_is/ops.py), which runs this function
        stats = unpack_stats(call, *torch.ops.fused_is.distill_stats(call.logits, call.teacher, call.valid,
                                                                      *op_arguments(call)))
    elif call.backend in KERNEL_BACKENDS:  # launched from here: policy_loss -> FusedPolicyLoss -> run -> this
        stats = _kernel_row_stats(call, backends.implementation(call.backend).pair_stats(
            call.logits, call.teacher, call.valid, abi.pair_args(call)))
    else:
        stats = _torch_statistics(call)
    return _checked(call, stats) if check else stats


def _torch_statistics(call: DistillCall) -> RowStats:
    """statistics_sweep of backend="torch": one chunk of both models at a time, upcast to the compute dtype."""
    n, device, dtype = call.num_rows, call.valid.device, call.compute_dtype
    lse = torch.empty(2, n, dtype=torch.float64, device=device)
    divergence = torch.empty(n, dtype=torch.float64, device=device)
    student_kl = torch.empty_like(divergence) if call.divergence.mixture and not call.top_k else None
    support = support_grad = support_total = None
    if call.top_k:
        support = torch.empty(n, call.support_width, dtype=torch.long, device=device)
        support_grad = torch.empty(n, call.support_width, dtype=torch.float64, device=device)
        support_total = torch.empty_like(divergence)
    for rows, z, u in _chunks(call, call.logits, call.teacher):
        valid = call.valid[rows]
        log_p, lse[0, rows] = _log_softmax(z, valid, temperature_rows(call.temperature, rows), dtype,
                                           rounding=call.rounding)
        log_q, lse[1, rows] = _log_softmax(u, valid, temperature_rows(call.teacher_temperature, rows), dtype)
        if call.top_k:
            support[rows], support_grad[rows], support_total[rows], divergence[rows] = _support_statistics(
                call, log_p, log_q)
        else:
            divergence[rows], chunk_kl = call.divergence.value(log_p, log_q, call.beta)
            if student_kl is not None:
                student_kl[rows] = chunk_kl
    return RowStats(lse, divergence, student_kl, support, support_grad, support_total)


def _kernel_row_stats(call: DistillCall, rows: torch.Tensor) -> RowStats:
    """RowStats of a kernel backend's statistics rows (`Backend.pair_stats`): its float32 rows kept for the gradient
    kernel, the log-sum-exps (max / tau + log2 sum ln 2), D_t and K_t in float64 for the checks and the aggregation."""
    row = {name: rows[i].double() for i, name in enumerate(abi.DISTILL_STATS)}
    lse = torch.stack([row["student_max"] / call.temperature + row["student_log2_sum"] * math.log(2),
                       row["teacher_max"] / call.teacher_temperature + row["teacher_log2_sum"] * math.log(2)])
    student_kl = row["student_kl"] if call.divergence.mixture else None
    return RowStats(lse, row["divergence"], student_kl, None, None, None, kernel_stats=rows)


def _support_statistics(call: DistillCall, log_p: torch.Tensor, log_q: torch.Tensor):
    """(support ids [rows, K'], g [rows, K'], G [rows], D [rows]) of one chunk over TRL's top-k buckets.

    The buckets: the support's full-softmax log-probabilities s (student), t (teacher) and, with add_tail, a tail
    bucket log(1 - sum exp s) (log mass bounded by TAIL_LOG_MASS_MAX: then it has no gradient); without it, s and t
    renormalised over the support. With S, T the buckets' log-probabilities, P = exp S, Q = exp T:
        e = dD/dS  = -Q (forward),  P (S - T + 1) (reverse),  (1 - beta) P (S - log M) (JSD, M = (1-beta) P + beta Q)
        g = dD/ds  = e - P e_tail / P_tail (tail),  e - P sum(e) (renormalised),
    and d D / d z_j = (g_j 1[j in support] - p_j G) / tau with G = sum g."""
    k = call.top_k
    picks = []
    if call.divergence.picks_teacher:  # the teacher's top-k: forward KL and JSD
        picks.append(log_q.topk(k, dim=-1).indices)
    if call.divergence.picks_student:  # the student's: reverse KL and JSD
        picks.append(log_p.topk(k, dim=-1).indices)
    support = torch.cat(picks, dim=1).sort(dim=-1).values
    repeat = torch.zeros_like(support, dtype=torch.bool)
    repeat[:, 1:] = support[:, 1:] == support[:, :-1]  # the union is a set: a repeated id counts once
    s = log_p.gather(1, support).double().masked_fill_(repeat, -math.inf)
    t = log_q.gather(1, support).double().masked_fill_(repeat, -math.inf)
    if call.add_tail:
        log_mass = torch.logsumexp(s, dim=-1, keepdim=True)
        bounded = log_mass > TAIL_LOG_MASS_MAX  # the tail is the constant 1 - exp(TAIL_LOG_MASS_MAX) there
        buckets_s = torch.cat([s, torch.log(-torch.expm1(log_mass.clamp(max=TAIL_LOG_MASS_MAX)))], dim=1)
        buckets_t = torch.cat([t, torch.log(-torch.expm1(torch.logsumexp(t, dim=-1, keepdim=True)
                                                          .clamp(max=TAIL_LOG_MASS_MAX)))], dim=1)
    else:
        buckets_s = s - torch.logsumexp(s, dim=-1, keepdim=True)
        buckets_t = t - torch.logsumexp(t, dim=-1, keepdim=True)
    big_p = buckets_s.exp()
    divergence, e = call.divergence.buckets(buckets_s, buckets_t, call.beta)
    if call.add_tail:  # the tail depends on every s_k: d tail / d s_k = -P_k / P_tail
        tail_ratio = torch.where(bounded.squeeze(1), 0.0, e[:, -1] / big_p[:, -1])
        g = e[:, :-1] - big_p[:, :-1] * tail_ratio.unsqueeze(1)
    else:  # the renormalisation: d S_l / d s_k = 1[l = k] - P_k
        g = e - big_p * e.sum(dim=-1, keepdim=True)
    g = g.masked_fill_(repeat, 0.0)
    return support, g, g.sum(dim=-1), divergence


def check_pair_rows(logits, teacher, valid, lse, divergence, kind: str, describe=None) -> None:
    """ValueError naming the first unmasked row whose statistics are not finite: NaN, +inf or only -inf in either
    model's row (named), or else an infinite divergence (one model gives probability 0 where the other does not).
    describe: row -> the sentence naming what is wrong with either model's logits at that row, or None (default:
    describe_distribution_row of logits and teacher, which may then be None: linear_distill_loss forms its rows)."""
    bad = valid & ~(torch.isfinite(lse).all(dim=0) & torch.isfinite(divergence))
    if not bool(bad.any()):  # the one host read of a passing call
        return
    row, count = int(bad.nonzero()[0, 0]), int(bad.sum())
    more = f" ({count} unmasked rows are affected)" if count > 1 else ""
    if describe is None:
        def describe(row):
            pairs = ((logits, "logits"), (teacher, "teacher_logits"))
            return next((why for x, arg in pairs if (why := describe_distribution_row(x, arg, row)) is not None), None)
    why = describe(row)
    if why is not None:
        raise ValueError(f"{why}, an unmasked position{more}; -inf logits are fine elsewhere, NaN and +inf are "
                         "not (mask the position if it is padding)")
    raise ValueError(f"the distillation's {kind} is infinite at row {row}{more}: one model gives probability 0 (a "
                     "-inf logit) to a token the other gives probability > 0")


def gradient_sweep(call: DistillCall, stats: RowStats, weight: torch.Tensor, out: torch.Tensor,
                   accumulate: bool = False) -> None:
    """out <- weight_t F_t / tau for every row (module docstring), chunk by chunk in the compute dtype, rounded once to
    out's dtype; weight: float64 [N] (a_t times grad_output), 0 at masked rows. out may be the logits' own buffer:
    each chunk is read before its rows are written. accumulate: out += instead (policy_loss's distillation term adds
    its gradient to the policy's)."""
    if torch.compiler.is_compiling():  # the kernel-level op (fused_is/ops.py), which runs this function
        packed, support, support_grad = pack_stats(call, stats)
        divergence, floats, ints, backend = op_arguments(call)
        torch.ops.fused_is.distill_gradient(call.logits, call.teacher, call.valid, packed, support, support_grad,
                                            weight, divergence, floats, ints + [int(accumulate)], backend, out)
        return None
    if call.backend in KERNEL_BACKENDS:
        return backends.implementation(call.backend).pair_gradient(call.logits, call.teacher, stats.kernel_stats,
                                                                   weight, abi.pair_args(call, accumulate), out)
    dtype = call.compute_dtype
    for rows, z, u, grad in _chunks(call, call.logits, call.teacher, out):
        valid = call.valid[rows]
        tau = temperature_rows(call.temperature, rows)
        log_p, _ = _log_softmax(z, valid, tau, dtype, stats.lse[0, rows], call.rounding)
        if call.top_k:
            chunk = log_p.exp_().mul_(stats.support_total[rows].to(dtype).unsqueeze(1).neg())
            chunk.scatter_add_(1, stats.support[rows], stats.support_grad[rows].to(dtype))
        else:
            log_q, _ = _log_softmax(u, valid, temperature_rows(call.teacher_temperature, rows), dtype,
                                    stats.lse[1, rows])
            student_kl = None if stats.student_kl is None else stats.student_kl[rows].to(dtype)
            chunk = call.divergence.gradient(log_p, log_q, log_p.exp(), stats.divergence[rows].to(dtype), student_kl,
                                             call.beta)
        scale = weight[rows] / tau
        chunk = torch.where(valid.unsqueeze(1), chunk * scale.to(dtype).unsqueeze(1), 0.0)
        if accumulate:
            grad.copy_(grad.to(dtype).add_(chunk))  # one rounding of the sum to out's dtype
        else:
            grad.copy_(chunk)


def divergence_metric_values(per_token: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """float64 [2]: the mean and the max of D_t over the unmasked tokens (0 and 0 when there is none)."""
    count = valid.sum()
    top = torch.where(valid, per_token, -math.inf).max() if valid.numel() else per_token.new_zeros(())
    return torch.stack([per_token.sum() / count.clamp(min=1), torch.where(count > 0, top, 0.0)])


# --- torch.compile: the sweeps as kernel-level ops (fused_is/ops.py) ------------------------------------------------
#
# While dynamo traces, statistics_sweep, gradient_sweep and jsd_shard_sums call the ops fused_is::distill_stats,
# distill_gradient and distill_jsd_given, which run them (eager) at run time on the same DistillCall rebuilt from the
# op's tensors and scalars; statistics_sweep(check=True) checks through fused_is::distill_checked. The O(N) work
# around them (the aggregation, the metrics, a vocabulary shard's merge and its collectives) is traced like any torch
# code.


def _check_compilable(backend: str, inplace) -> None:
    """What distill_loss cannot do under torch.compile, refused by name while dynamo traces."""
    if inplace is True:
        raise refused("inplace/compile")
    if backend == "reference":
        raise refused("reference/compile")


def op_arguments(call: DistillCall) -> tuple:
    """The call's sweep as the distillation ops take it, plain typed scalars: (divergence, [beta, temperature,
    teacher_temperature], [top_k, add_tail], backend)."""
    return (call.divergence.name, [call.beta, call.temperature, call.teacher_temperature],
            [call.top_k, int(call.add_tail)], call.backend)


def sweep_call(logits, teacher, valid, divergence: str, floats, ints, backend: str) -> DistillCall:
    """The DistillCall of an op's tensors and `op_arguments`: all the two sweeps read (no aggregation weights, one
    process: an op on a vocabulary shard sees the shard's columns only)."""
    beta, temperature, teacher_temperature = floats
    top_k, add_tail = ints
    return DistillCall(logits=logits, teacher=teacher, valid=valid, agg_weight=None,
                       divergence=divergences.DIVERGENCES[divergence], beta=beta,
                       temperature=temperature, teacher_temperature=teacher_temperature, top_k=top_k,
                       add_tail=bool(add_tail), inplace=False, compute_grad=True, backend=backend)


def packed_rows(backend: str) -> int:
    """The rows of `pack_stats`' float64 block for this backend: 4, and the kernels' statistics rows."""
    return 4 + (len(abi.DISTILL_STATS) if backend in KERNEL_BACKENDS else 0)


def pack_stats(call: DistillCall, stats: RowStats) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """RowStats as the ops pass them: (float64 [packed_rows, N]: the two log-sum-exps, D_t, then K_t (JSD over the full
    vocabulary), G (top_k) or 0, then a kernel backend's float32 statistics rows (exact in float64); support int64
    [N, K'] and support_grad float64 [N, K'], K' = 0 without top_k)."""
    fourth = stats.student_kl if stats.student_kl is not None else stats.support_total
    rows = [stats.lse, stats.divergence.unsqueeze(0),
            (torch.zeros_like(stats.divergence) if fourth is None else fourth).unsqueeze(0)]
    if call.backend in KERNEL_BACKENDS:
        rows.append(stats.kernel_stats.double())
    support, support_grad = stats.support, stats.support_grad
    if support is None:
        support = torch.empty(call.num_rows, 0, dtype=torch.int64, device=stats.lse.device)
        support_grad = torch.empty(call.num_rows, 0, dtype=torch.float64, device=stats.lse.device)
    return torch.cat(rows), support, support_grad


def unpack_stats(call: DistillCall, packed: torch.Tensor, support: torch.Tensor,
                 support_grad: torch.Tensor) -> RowStats:
    """The RowStats of `pack_stats`' tensors."""
    fourth = packed[3]
    return RowStats(packed[:2], packed[2], fourth if call.divergence.mixture and not call.top_k else None,
                    support if call.top_k else None, support_grad if call.top_k else None,
                    fourth if call.top_k else None,
                    kernel_stats=packed[4:].float() if call.backend in KERNEL_BACKENDS else None)


# --- autograd ------------------------------------------------------------------------------------------------------


def deferred_sweep(call: DistillCall, stats: RowStats):
    """distill_loss's gradient sweep as a sweep of backends.DeferredGradient: grad_output folded into the row
    weights, the gradient written (not added) over every row at once."""
    def fold(scale):
        def run(rows, logits, teacher, out):
            gradient_sweep(call, stats, call.agg_weight * scale.to(torch.float64), out)
        return run
    return fold


class DistillLoss(torch.autograd.Function):
    """apply(logits, call: DistillCall) -> (loss 0-d, per_token [N], metric values [2] float64), loss differentiable.

    forward runs the statistics sweep, checks the rows, aggregates, and (inplace=False, not fp16) the gradient sweep
    into a new buffer that backward scales by grad_output; with inplace=True (or fp16 logits) the gradient sweep runs
    in backward, grad_output folded into the row weights. backward can run once (the buffer is handed to autograd).
    Under torch.compile the sweeps are the kernel-level ops of fused_is/ops.py and the gradient, a tensor of the graph,
    is always formed in forward (fp16 included; inplace is refused)."""

    @staticmethod
    def forward(ctx, logits, call: DistillCall):
        stats = statistics_sweep(call, check=True)
        per_token = torch.where(call.valid, stats.divergence, 0.0)
        loss = (call.agg_weight * per_token).sum()
        ctx.grad = None
        ctx.compiled = torch.compiler.is_compiling()
        if ctx.compiled:
            grad = logits.new_empty(0)
            if call.compute_grad:
                grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
                gradient_sweep(call, stats, call.agg_weight, grad)
            ctx.save_for_backward(grad)
        elif call.compute_grad and (call.inplace or logits.dtype == torch.float16):
            ctx.grad = backends.DeferredGradient(call.logits, call.inplace, [deferred_sweep(call, stats)],
                                                 [("logits", call.logits), ("teacher_logits", call.teacher)],
                                                 "distill_loss")
        elif call.compute_grad:
            ctx.grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
            gradient_sweep(call, stats, call.agg_weight, ctx.grad)
        metric_values = divergence_metric_values(per_token, call.valid)
        dtype = output_dtype(logits.dtype)
        per_token = per_token.to(dtype)  # the tensor returned is the one marked (a copy made after would require grad)
        ctx.mark_non_differentiable(per_token, metric_values)
        return loss.to(dtype), per_token, metric_values

    @staticmethod
    def backward(ctx, grad_loss, *_unused):
        if ctx.compiled:
            (grad,) = ctx.saved_tensors
            return grad * grad_loss, None
        grad = backends.take_once(ctx, "grad", "distill_loss")
        if isinstance(grad, backends.DeferredGradient):  # inplace=True, fp16: the sweep runs now
            return grad.write(grad_loss), None
        if not torch.equal(grad_loss, torch.ones_like(grad_loss)):  # skip a pass over [N, V] when grad_output is 1
            grad.mul_(grad_loss)
        return grad, None


def policy_term_call(call, formed: bool = False) -> DistillCall:
    """The DistillCall of a policy_loss call's distillation term (LossConfig.distill_kind) over the call's rows: the
    call's valid tokens and aggregation weights a_t times distill_coef, the call's temperature for both models (the
    config's, or the per-row temperature=: then on the torch sweeps), the student's logits rounded as the policy's
    (head-precision replay: on the torch sweeps), the full vocabulary (kept sets: `kept_term`), the policy's backend
    where its distillation kernels can run the term (else the chunked torch sweeps); with a vocab_group, on the
    call's vocabulary shard of both models. Its logits and teacher are the call's (stand-ins on the fused-linear path,
    whose chunks replace them). formed: the fused-linear head forms the student's chunks rounded already."""
    cfg = call.config
    divergence = divergences.of(cfg.distill_kind, cfg.distill_beta)
    rounding = None if formed else call.head_rounding
    return DistillCall(logits=call.logits, teacher=call.teacher, valid=call.valid, agg_weight=term_weight(call),
                       divergence=divergence, beta=float(cfg.distill_beta), temperature=call.temperature,
                       teacher_temperature=call.temperature, top_k=0, add_tail=True, inplace=False, compute_grad=True,
                       backend=_term_backend(call, divergence, rounding), vocab_group=call.vocab_group,
                       vocab_start=call.vocab_start, rounding=rounding)


def term_weight(call) -> torch.Tensor:
    """float64 [N]: the weight of each token's D_t in a policy_loss call's loss, its aggregation weight a_t times
    LossConfig.distill_coef."""
    return call.agg_weight * call.config.distill_coef


def _term_backend(call, divergence: divergences.Divergence, rounding) -> str:
    """The sweeps' backend of policy_loss's distillation term: the policy's own where it is a kernel backend that can
    run the term's tensors with one temperature and the logits as they are, the divergence has a kernel code and (with
    a vocab_group) the kernels have the sharded plan; else "torch"."""
    name = call.backend
    if (name not in KERNEL_BACKENDS or divergence.code is None or call.row_temperature is not None
            or rounding is not None  # the kernels: one temperature, the logits as they are
            or (call.vocab_group is not None and name not in SHARDED_BACKENDS)):
        return "torch"
    return name if backends.unavailable_reason(name, call.logits, call.teacher) is None else "torch"


def kept_term(call: DistillCall, kept: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """policy_loss's distillation term with the sampler's kept sets (kept=): both models renormalised over each row's
    kept set, as the policy's softmax is, from the K kept logits of each (O(N K), no sweep over V). Returns (D_t
    float64 [N], 0 at masked rows; its gradient times the term's weight at the kept columns, float64 [N, K], 0 at -1
    entries and masked rows), checked: a ValueError naming the first bad unmasked row. With S, T the renormalised
    log-probabilities and e = d D / d S (the row's `buckets`), d D / d z_j = (e_j - P_j sum e) / tau on the set."""
    s, lse_s, raw_s = kept_sets.kept_log_probs(call.logits.detach(), kept, call.temperature, call.valid,
                                               call.rounding)
    t, lse_t, raw_t = kept_sets.kept_log_probs(call.teacher.detach(), kept, call.teacher_temperature, call.valid)
    divergence, e = call.divergence.buckets(s, t, call.beta)

    def describe(row: int) -> Optional[str]:  # the kept columns alone: the rest of either row is never read
        for raw, arg in ((raw_s, "logits"), (raw_t, "teacher_logits")):
            for bad, what in ((torch.isnan, "NaN"), (torch.isposinf, "+inf")):
                hit = bad(raw[row].double()) & (kept[row] >= 0)
                if bool(hit.any()):
                    return f"{arg} hold {what} at row {row}, column {int(kept[row][hit][0])} (in its kept set)"
        return None

    check_pair_rows(call.logits, call.teacher, call.valid, torch.stack([lse_s, lse_t]), divergence,
                    call.divergence.title, describe)
    tau = call.temperature.unsqueeze(1) if isinstance(call.temperature, torch.Tensor) else call.temperature
    grad = (e - s.exp() * e.sum(-1, keepdim=True)) / tau * call.agg_weight.unsqueeze(1)
    valid = call.valid.unsqueeze(1) & (kept >= 0)
    return torch.where(call.valid, divergence, 0.0), torch.where(valid, grad, 0.0)


def _checked(call: DistillCall, stats: RowStats, describe=None) -> RowStats:
    """stats once every unmasked row's statistics are finite, else the ValueError naming the first bad row (under
    torch.compile checked at run time by fused_is::distill_checked, whose copy is read after). describe: as for
    `check_pair_rows` (a vocabulary shard's own diagnosis)."""
    if torch.compiler.is_compiling():
        packed, support, support_grad = pack_stats(call, stats)
        shard_start = None if call.vocab_group is None else torch.as_tensor(call.vocab_start, dtype=torch.int64)
        packed = torch.ops.fused_is.distill_checked(call.logits, call.teacher, call.valid, packed,
                                                    call.divergence.title, shard_start)
        return unpack_stats(call, packed, support, support_grad)
    check_pair_rows(call.logits, call.teacher, call.valid, stats.lse, stats.divergence, call.divergence.title,
                    describe)
    return stats


# --- vocabulary parallel (vocab_group): the shard's sweeps here, their merge in fused_is/distributed.py ------------

SHARD_PARTS = ("student_top", "student_log_sum", "teacher_top", "teacher_log_sum", "divergence")


def open_vocab_shard(call: DistillCall, group, backend: str, top_k: int) -> DistillCall:
    """The checked call on this rank's vocabulary shard of both models: what the shards cannot run refused by name
    (the same on every rank, before any collective), then the collective of the shard sizes (a shard of size 0 is a
    ValueError on every rank). top_k: the argument as given (the call keeps 0 for a top_k of at least V_local)."""
    sharded = f"'auto', {', '.join(map(repr, SHARDED_BACKENDS))}"
    if call.backend == "reference":
        raise refused("reference/vocab_group", backends=sharded)
    if top_k:
        raise refused("top_k/vocab_group", top_k=top_k)
    name = call.backend
    if name not in SHARDED_BACKENDS:
        if backend != "auto":
            raise refused("cuda/vocab_group", backends=sharded)  # the one kernel backend without the sharded plan
        usable = (call.logits.is_cuda and call.divergence.code is not None
                  and backends.unavailable_reason("triton", call.logits, call.teacher) is None)
        name = "triton" if usable else "torch"
    start, _ = distributed.open_shard(call.logits, "logits", "[B, T, V] or [N, V]", -1, group, "full")
    return dataclasses.replace(call, backend=name, vocab_group=group, vocab_start=start)


def sharded_statistics(call: DistillCall) -> RowStats:
    """The whole rows' `RowStats` from this rank's vocabulary shard (call.vocab_group), the same on every rank: the
    statistics sweep on the shard (one read), one all-gather of its [5, N] float64 parts (SHARD_PARTS), the merge in
    rank order (fused_is/distributed.py `merge_pair_shards`, the divergence's own `shard_merge`); a mixture: then
    its sums over the shard given the merged normalisers (one more read) and one all-gather of [2, N]. Unchecked
    (`statistics_sweep(check=True)` checks)."""
    parts, scales, unit = _shard_parts(call)
    gathered = distributed.gather_ranks(parts, call.vocab_group)  # [world, 5, N], in group-rank order
    lse, shares, whole, shard_divergence = distributed.merge_pair_shards(
        gathered, scales, unit, (call.temperature, call.teacher_temperature))
    kernel = None
    if call.backend in KERNEL_BACKENDS:  # the gradient kernel's statistics: the whole rows' maxes and log2 sums
        kernel = torch.zeros(len(abi.DISTILL_STATS), call.num_rows, dtype=torch.float64, device=lse.device)
        kernel[:4] = whole
    student_kl = None
    if call.divergence.mixture:
        given = RowStats(lse, torch.zeros_like(lse[0]), None, None, None, None,
                         kernel_stats=None if kernel is None else kernel.float())
        sums = jsd_shard_sums(call, given)
        gathered = distributed.gather_ranks(sums, call.vocab_group)  # [world, 2, N]
        student_kl, teacher_kl = distributed.sum_in_rank_order(gathered).unbind(0)
        divergence = call.beta * teacher_kl + (1 - call.beta) * student_kl
    else:  # KL(q || p): the teacher's shares weigh; KL(p || q): the student's
        divergence = distributed.sum_in_rank_order(call.divergence.shard_merge(*shares, shard_divergence))
    if kernel is not None:
        kernel[4] = divergence
        if student_kl is not None:
            kernel[5] = student_kl
        kernel = kernel.float()
    return RowStats(lse, divergence, student_kl, None, None, None, kernel_stats=kernel)


def _shard_parts(call: DistillCall) -> Tuple[torch.Tensor, Tuple[float, float], float]:
    """(this shard's float64 [5, N] parts, rows SHARD_PARTS; the scales c of student and teacher; the unit of the
    log sums) from the statistics sweep on the shard; JSD runs it as forward KL (one sweep: the normalisers; its
    divergence row is not read)."""
    # the mixture's shard statistics are its normalisers alone: the forward KL's sweep (one read) gives them
    local = statistics_sweep(dataclasses.replace(call, divergence=divergences.FORWARD_KL) if call.divergence.mixture
                             else call)
    if call.backend in KERNEL_BACKENDS:
        rows = dict(zip(abi.DISTILL_STATS, local.kernel_stats.double()))  # the kernels' rows
        # log2(e) / tau rounded to fp32 as the kernels take it, so the merge and the kernels share the units
        scales = tuple(float(torch.tensor(math.log2(math.e) / tau, dtype=torch.float32))
                       for tau in (call.temperature, call.teacher_temperature))
        parts = [rows["student_max"], rows["student_log2_sum"], rows["teacher_max"], rows["teacher_log2_sum"],
                 rows["divergence"]]
        return torch.stack(parts), scales, math.log(2)
    zero = torch.zeros_like(local.divergence)
    return torch.stack([zero, local.lse[0], zero, local.lse[1], local.divergence]), (0.0, 0.0), 1.0


def jsd_shard_sums(call: DistillCall, given: RowStats) -> torch.Tensor:
    """float64 [2, N]: this shard's parts of KL(p || m) and KL(q || m) given the whole rows' statistics (their
    log-sum-exps; Triton: the kernel's rows of the whole rows' maxes and log2 sums); under torch.compile through the
    op fused_is::distill_jsd_given, which runs this function."""
    if torch.compiler.is_compiling():
        packed, _, _ = pack_stats(call, given)
        return torch.ops.fused_is.distill_jsd_given(call.logits, call.teacher, call.valid, packed, *op_arguments(call))
    if call.backend == "triton":
        return backends.implementation("triton").pair_jsd_given(call.logits, call.teacher, call.valid,
                                                                given.kernel_stats, abi.pair_args(call)).double()
    return _jsd_shard_sums(call, given.lse)


def _jsd_shard_sums(call: DistillCall, lse: torch.Tensor) -> torch.Tensor:
    """float64 [2, N]: this shard's parts of KL(p || m) and KL(q || m), p, q and m the whole rows' (lse: their
    log-sum-exps [2, N]), chunk by chunk as the statistics sweep."""
    sums = torch.zeros(2, call.num_rows, dtype=torch.float64, device=call.valid.device)
    dtype = call.compute_dtype
    for rows, z, u in _chunks(call, call.logits, call.teacher):
        valid = call.valid[rows]
        log_p, _ = _log_softmax(z, valid, temperature_rows(call.temperature, rows), dtype, lse[0, rows],
                                call.rounding)
        log_q, _ = _log_softmax(u, valid, temperature_rows(call.teacher_temperature, rows), dtype, lse[1, rows])
        log_m = divergences.log_mixture(log_p, log_q, call.beta)
        sums[0, rows] = divergences.plogr(log_p, log_p, log_m)
        sums[1, rows] = divergences.plogr(log_q, log_q, log_m)
    return sums


def describe_pair_shard_row(logits: torch.Tensor, teacher: torch.Tensor, vocab_start, lse: torch.Tensor):
    """The diagnosis of a flagged row from this rank's shards of both models (the shard starting at column
    vocab_start of the whole vocabulary), which may not hold the bad values: row -> a sentence, or None (the
    divergence is infinite: `check_pair_rows` says so)."""
    def describe(row: int) -> Optional[str]:
        for x, arg in ((logits, "logits"), (teacher, "teacher_logits")):
            values = (x[row // x.shape[1], row % x.shape[1]] if x.dim() == 3 else x[row]).detach().double()
            where = f"row {row} ({arg}[{row // x.shape[1]}, {row % x.shape[1]}])" if x.dim() == 3 else f"row {row}"
            for bad, what in ((torch.isnan(values), "NaN"), (torch.isposinf(values), "+inf")):
                if bool(bad.any()):
                    column = int(bad.nonzero()[0, 0])
                    return (f"{arg} hold {what} at {where}, column {column} of this rank's vocabulary shard (global "
                            f"id {int(vocab_start) + column})")
        if not bool(torch.isfinite(lse[:, row]).all()):
            return (f"row {row} of logits or teacher_logits has no finite log-sum-exp across the vocabulary shards: "
                    "NaN or +inf in another rank's shard, or every entry -inf")
        return None

    return describe
