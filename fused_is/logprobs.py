"""`fused_is.logprobs`: differentiable fused logprobs and entropies, for a loss of the caller's own.

Forward is the statistics sweep (one read of the logits): lp_t, H_t and each row's max and log sum, kept (O(N)).
Backward takes any upstream gradients g_t = d loss / d lp_t and h_t = d loss / d H_t and writes
    d loss / d z_tj = ( g_t (1[j = y_t] - p_tj) - h_t p_tj (log p_tj + H_t) ) / tau_t
in one sweep over the logits (DESIGN.md section 8), into a new buffer or, with inplace=True, over the logits
themselves: no [N, V] fp32 buffer, ever. It is the kernels' given-statistics gradient sweep (`fused_given`, the
one of vocabulary shards and of policy_loss(inplace=True)) with g and h from autograd.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from . import backends, distributed, ops, plan
from . import kept as kept_sets
from .backends import abi
from .call import prepare_rows
from .combinations import refused
from .reference import row_stats
from .validate import check_backend, check_rows, check_validate, output_dtype, round_like_head, rounding_dtype


def _in_place_state(ctx):
    """(the logits' buffer, the saved rows) of an inplace=True call, released by the first backward: a second one, or
    a write into the logits between the call and backward, is a RuntimeError."""
    saved, logits = backends.take_once(ctx, "state", "fused_is.logprobs"), ctx.logits
    ctx.logits = None
    if backends.version_of(logits) != ctx.version:
        raise RuntimeError("fused_is.logprobs(inplace=True): the logits were modified in place between the call and "
                           "backward; their buffer no longer holds the logits whose gradient backward writes there "
                           "(pass inplace=False, or clone them)")
    return logits, saved


class FusedLogprobs(torch.autograd.Function):
    """apply(logits, ids [N] int64, valid bool [N], temperature (float or float64 [N]), backend name, shard
    ((group, start) or None), inplace) -> (lp [N], H [N]) in the output dtype, both differentiable.

    Without a shard, forward and backward are the kernel-level ops `fused_is::row_stats` and
    `fused_is::gradient_from_stats` (fused_is/ops.py) and O(N) torch code: the same Python in eager mode and under
    torch.compile, which traces it (fullgraph). Without inplace, the logits and the O(N) statistics are saved tensors,
    so backward may run again with retain_graph=True."""

    @staticmethod
    def forward(ctx, logits, ids, valid, temperature, name: str, shard, inplace: bool, rounding=None):
        tau, row_tau = ops.split_temperature(temperature)
        if shard is None and rounding is None:
            stats = torch.ops.fused_is.row_stats(logits, ids, valid, tau, row_tau, name, "full")
        else:  # a vocabulary shard, or the logits rounded block by block (eager only): the blocks' statistics
            source = plan.LogitsRows(logits) if rounding is None else plan.RoundedRows(logits, rounding)
            impl = backends.implementation(name)
            lp, entropy, (ids, whole_rows) = plan.row_statistics(source, ids, temperature, impl, shard, whole_rows=True)
            check_rows(logits, ids, lp, entropy, valid, "full", source.describe(None if shard is None else shard[1]))
            stats = distributed.kernel_statistics(whole_rows, valid)
        ctx.name, ctx.tau, ctx.inplace, ctx.rounding = name, tau, inplace, rounding
        ctx.per_row = row_tau is not None
        saved = (ids, stats, valid) + ((row_tau,) if row_tau is not None else ())
        if inplace:  # an attribute: the buffer is overwritten in backward, so it cannot be a saved tensor
            ctx.logits, ctx.version, ctx.state = logits, logits._version, saved
        else:  # autograd refuses backward if the caller modifies them in between
            ctx.save_for_backward(logits, *saved)
        dtype = output_dtype(logits.dtype)
        return stats[2].to(dtype, copy=True), stats[3].to(dtype, copy=True)  # two tensors, not views of one

    @staticmethod
    def backward(ctx, grad_lp, grad_entropy):
        if ctx.inplace:
            logits, saved = _in_place_state(ctx)
        else:
            logits, *saved = ctx.saved_tensors
        ids, stats, valid = saved[:3]
        temperature = saved[3] if ctx.per_row else ctx.tau
        args = abi.upstream_args(temperature, valid, grad_lp, grad_entropy)
        # the given-statistics sweep through the kernel-level ops (fused_is/ops.py): the same code in eager mode and
        # under torch.compile, whose backward graph traces it; over the rounded logits block by block, each block's
        # gradient copied out (head-precision replay), else one block
        if ctx.rounding is not None:
            source = plan.RoundedRows(logits, ctx.rounding, ctx.inplace and "forward")
        else:
            source = plan.LogitsRows(logits, ctx.inplace, defer_fp16=False)
        plan.given_sweep(ops.Traced(ctx.name), source, ids, stats, args)
        source.close()
        return source.gradient(), None, None, None, None, None, None, None


class KeptLogprobs(torch.autograd.Function):
    """FusedLogprobs over each row's kept set (fused_is/kept.py): apply(logits, ids, kept [N, K], temperature,
    valid, inplace) -> (lp [N], H [N]); the K kept logits of a row read, its K columns of the gradient written.
    Without inplace, what backward reads (O(N K)) is saved tensors, so backward may run again with retain_graph=True."""

    @staticmethod
    def forward(ctx, logits, ids, kept, temperature, valid, inplace: bool):
        lp, entropy, probs = kept_sets.kept_statistics(logits, ids, kept, temperature, valid)
        check_rows(logits, ids, lp, entropy, valid, "full")
        ctx.inplace, ctx.per_row = inplace, isinstance(temperature, torch.Tensor)
        ctx.tau = None if ctx.per_row else temperature
        saved = (ids, kept, probs, entropy) + ((temperature,) if ctx.per_row else ())
        # backward needs the logits' buffer only to write into it (inplace); else their shape, dtype and device
        ctx.meta = (logits.shape, logits.dtype, logits.device)
        if inplace:  # an attribute: the buffer is overwritten in backward, so it cannot be a saved tensor
            ctx.logits, ctx.version, ctx.state = logits, logits._version, saved
        else:
            ctx.save_for_backward(*saved)
        dtype = output_dtype(logits.dtype)
        return lp.to(dtype), entropy.to(dtype)

    @staticmethod
    def backward(ctx, grad_lp, grad_entropy):
        if ctx.inplace:
            logits, saved = _in_place_state(ctx)
        else:
            logits, saved = None, ctx.saved_tensors
        ids, kept, probs, entropy = saved[:4]
        temperature = saved[4] if ctx.per_row else ctx.tau
        zero = torch.zeros_like(entropy)
        g = zero if grad_lp is None else grad_lp.reshape(-1).double()
        h = zero if grad_entropy is None else grad_entropy.reshape(-1).double()
        shape, dtype, device = ctx.meta
        grad = logits.detach() if ctx.inplace else torch.empty(shape, dtype=dtype, device=device)
        kept_sets.kept_gradient(ids, kept, probs, entropy, g, h, temperature, grad)
        if ctx.inplace:
            torch.autograd.graph.increment_version(logits)
        return grad, None, None, None, None, None


def _check_compilable(inplace, vocab_group, kept, backend, head_dtype) -> None:
    """What fused_is.logprobs cannot do under torch.compile, refused by name while dynamo traces."""
    for key, given in (("inplace/compile", inplace is True), ("vocab_group/compile(logprobs)", vocab_group is not None),
                       ("kept/compile", kept is not None), ("reference/compile", backend == "reference"),
                       ("head_dtype/compile(logprobs)", head_dtype is not None)):
        if given:
            raise refused(key)


def logprobs(
    logits: torch.Tensor, tokens: torch.Tensor, *, temperature=1.0, mask: Optional[torch.Tensor] = None,
    backend: str = "auto", inplace: bool = False, vocab_group=None, validate: str = "full", kept=None,
    head_dtype=None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Logprobs and entropies of softmax(logits / temperature), differentiable w.r.t. logits, for any loss.

    The fused counterpart of `log_softmax(logits / tau).gather(tokens)` and of the entropy, without their [N, V]
    fp32 temporaries: forward reads the logits once and keeps O(N) numbers; backward writes d logits in one sweep
    from the upstream gradients of both outputs (either may be unused).

    Args:
        logits: [B, T, V] or [N, V]; bf16, fp16, fp32 or fp64; any strides. -inf entries have probability 0.
        tokens: [B, T] or [N] integer ids in [0, V) (ids at masked positions may be out of range).
        temperature: a positive number, or per-row temperatures as a floating-point tensor ([B] per sequence for
            padded input, or the shape of tokens).
        mask: bool or 0/1, shape of tokens, or None. Masked positions may hold anything; their outputs are
            unspecified and their gradient is exactly 0.
        backend: "auto", "triton", "cuda", "cpu", "torch" or "reference" (float64 autograd, the oracle).
        inplace: backward writes d logits over the logits' own buffer (no [N, V] gradient buffer) and hands it to
            autograd; until backward the logits keep their values. A write into them in between is a RuntimeError.
        vocab_group: logits are this rank's vocabulary shard and tokens global ids; the outputs are those of the
            whole vocabulary on every rank, the gradient this shard's (the upstream gradients must be the same on
            every rank, as they are when every rank computes the same loss from these outputs).
        validate: "full": bad values raise ValueError naming the position (one host read).
        kept: the sampler's kept set, as for `policy_loss`: lp, H and the gradient over it (0 outside it); only the
            K kept logits of each row are read (any backend: a gather).
        head_dtype: head-precision replay, as for `policy_loss`: the logits rounded to the sampler head's dtype
            before the softmax, the gradient passed through the rounding unchanged (eager only).
    Returns:
        (logprobs, entropy), each shaped like tokens, fp32 (fp64 for fp64 logits), differentiable.
    Under torch.compile(fullgraph=True) the function is traced: the kernels are the ops of fused_is/ops.py and the
    value checks run in them at run time (a bad value is still a ValueError, without its position); inplace,
    vocab_group, kept and backend="reference" are eager only there.
    """
    if torch.compiler.is_compiling():
        _check_compilable(inplace, vocab_group, kept, backend, head_dtype)
    check_backend(backend)
    check_validate(validate)
    if validate != "full":
        raise ValueError("fused_is.logprobs takes validate='full' only for now (its checks read values on the host)")
    if not isinstance(inplace, bool):
        raise TypeError(f"inplace must be a bool; got {inplace!r}")
    start, vocab, shard = 0, None, None
    if vocab_group is not None:
        start, vocab = distributed.open_shard(logits, "logits", "[B, T, V] or [N, V]", -1, vocab_group, validate)
        shard = (vocab_group, start)
    ids, valid, tau, kept_ids = prepare_rows(logits, tokens, mask, temperature, validate, vocab, kept, vocab_group)
    rounding = rounding_dtype(head_dtype, None, logits.dtype)
    name = backends.resolve(backend, logits, sharded=vocab_group is not None)
    if name == "reference":
        if inplace:
            raise refused("reference/inplace")
        # the oracle of the policy loss, in float64, differentiated by autograd
        lp, entropy = (x.to(output_dtype(logits.dtype)) for x in row_stats(round_like_head(logits, rounding), ids,
                                                                           valid, tau, torch.float64, kept_ids))
    elif kept_ids is not None and rounding is not None:
        raise refused("kept/head_dtype(logprobs)")
    elif kept_ids is not None:
        lp, entropy = KeptLogprobs.apply(logits, ids, kept_ids, tau, valid, inplace)
    else:
        lp, entropy = FusedLogprobs.apply(logits, ids, valid, tau, name, shard, inplace, rounding)
    return lp.reshape(tokens.shape), entropy.reshape(tokens.shape)

