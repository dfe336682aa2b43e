"""Shared numerics harness: random inputs that fire every branch, the float64 comparison and the
per-dtype tolerances. Used by the tests (tests/cases.py) and by `fused-is verify` / `fused-is bench`.

Inputs are fresh random tensors built so that every branch fires: PPO ratios outside the clip range,
IS weights above the cap and below the floor, a sequence with no mismatch (geo_mis keeps it), masked
tokens whose sampler logprobs are NaN and whose ids are out of range (they must not matter).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import fused_is
from fused_is import LossConfig

# max relative error against the float64 reference, by the logits' dtype. The loss and the per-row
# statistics are computed in fp32 (or better) from the given values; the gradient is stored in the
# logits' dtype, so its error is that dtype's rounding.
TOLERANCES = {
    torch.float64: dict(loss=1e-10, grad=1e-10, logprobs=1e-10),
    torch.float32: dict(loss=1e-6, grad=1e-6, logprobs=1e-6),
    torch.float16: dict(loss=1e-5, grad=1e-3, logprobs=1e-6),
    torch.bfloat16: dict(loss=1e-5, grad=8e-3, logprobs=1e-6),
}


# The fused kernels (triton, cuda, cpu) do fp32 arithmetic on fp32 logits; z - max and exp each round at
# 6e-8, so lp carries ~2e-7, and sequence-level IS weights (a sum of lp over the sequence, with
# old_logprobs=None) lift that to a few 1e-6 of the gradient. The torch backend computes fp32 logits
# in float64 and meets the tighter bound above.
FP32_KERNEL_TOLERANCE = dict(loss=1e-5, grad=1e-5, logprobs=1e-6)


def tolerance(dtype: torch.dtype, backend: str) -> dict:
    """Relative-error bounds of `backend` at logits dtype `dtype` against the float64 reference."""
    if dtype == torch.float32 and backend in ("triton", "cuda", "cpu"):
        return FP32_KERNEL_TOLERANCE
    return TOLERANCES[dtype]


def config_for(preset: str, overrides: Optional[dict] = None) -> LossConfig:
    return LossConfig.preset(preset, **(overrides or {}))


@dataclasses.dataclass
class Inputs:
    logits: torch.Tensor  # in the test dtype, leaf without grad
    tokens: torch.Tensor
    advantages: torch.Tensor
    sampler_logprobs: torch.Tensor
    old_logprobs: torch.Tensor
    ref_logprobs: torch.Tensor
    mask: torch.Tensor
    cu_seqlens: Optional[torch.Tensor]

    def kwargs(self, *, with_old: bool = True, **extra):
        out = dict(
            sampler_logprobs=self.sampler_logprobs,
            old_logprobs=self.old_logprobs if with_old else None,
            ref_logprobs=self.ref_logprobs,
            mask=self.mask,
            cu_seqlens=self.cu_seqlens,
        )
        out.update(extra)
        return out


def make_inputs(
    layout: str = "padded",
    *,
    batch: int = 3,
    seq_len: int = 8,
    vocab: int = 1000,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    logit_scale: float = 2.0,
    mismatch: float = 0.5,
    device: str = "cpu",
) -> Inputs:
    """Random inputs; layout "padded" gives [B, T, V], "packed" gives [N, V] with ragged cu_seqlens."""
    gen = torch.Generator().manual_seed(seed)
    shape, lengths = _layout_shape(layout, batch, seq_len)
    logits = (torch.randn(*shape, vocab, generator=gen, dtype=torch.float64) * logit_scale).to(dtype)
    return _inputs_for(logits, layout, lengths, gen, mismatch, device)


def _layout_shape(layout: str, batch: int, seq_len: int):
    if layout == "padded":
        return (batch, seq_len), [seq_len] * batch
    lengths = [max(1, seq_len - 3 * i) for i in range(batch)]  # ragged: 8, 5, 2, ...
    return (sum(lengths),), lengths


def _inputs_for(logits: torch.Tensor, layout: str, lengths, gen: torch.Generator, mismatch: float,
                device: str) -> Inputs:
    """Tokens, logprobs, advantages and mask for these logits ([*shape, V], on the CPU)."""
    shape = logits.shape[:-1]
    vocab = logits.shape[-1]
    n = int(shape.numel())
    exact = logits.double()
    # half the tokens are the argmax (high probability), half uniform (low probability); ids 0 and V-1 appear
    greedy = exact.argmax(-1)
    uniform = torch.randint(0, vocab, shape, generator=gen)
    tokens = torch.where(torch.rand(shape, generator=gen) < 0.5, greedy, uniform)
    flat = tokens.view(-1)
    flat[0], flat[-1] = 0, vocab - 1
    lp = torch.log_softmax(exact, -1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    old = lp + 0.15 * torch.randn(shape, generator=gen, dtype=torch.float64)
    samp = old + mismatch * torch.randn(shape, generator=gen, dtype=torch.float64)
    ref = lp + 0.3 * torch.randn(shape, generator=gen, dtype=torch.float64)
    # logprobs are <= 0 (fused_is refuses larger ones): the noise is folded back below 0
    old, samp, ref = (-x.abs() for x in (old, samp, ref))
    advantages = torch.randn(shape, generator=gen, dtype=torch.float64)
    mask = torch.rand(shape, generator=gen) < 0.85
    cu_seqlens = None
    if layout == "padded":
        samp[0] = old[0]  # a sequence without mismatch: every IS weight is exactly 1
        mask[0, 0] = True
    else:
        cu_seqlens = torch.tensor([0] + lengths).cumsum(0)
        samp[: lengths[0]] = old[: lengths[0]]
        mask[0] = True
    mask.view(-1)[1] = False  # a masked token with garbage that must not leak into the result
    samp.view(-1)[1] = float("nan")
    old.view(-1)[1] = float("inf")
    tokens.view(-1)[1] = -100
    assert n >= 2
    to = dict(device=device)
    return Inputs(
        logits=logits.to(**to),
        tokens=tokens.to(**to),
        advantages=advantages.float().to(**to),
        sampler_logprobs=samp.float().to(**to),
        old_logprobs=old.float().to(**to),
        ref_logprobs=ref.float().to(**to),
        mask=mask.to(**to),
        cu_seqlens=None if cu_seqlens is None else cu_seqlens.to(**to),
    )


@dataclasses.dataclass
class LinearInputs:
    """Inputs of `linear_policy_loss`: `inputs` holds the float64 logits hidden @ weight.T + bias of the
    rounded hidden, weight and bias, and every per-token input built for them as `make_inputs` builds them."""

    hidden: torch.Tensor  # [B, T, D] or [N, D] in the test dtype
    weight: torch.Tensor  # [V, D]
    bias: Optional[torch.Tensor]  # [V] or None
    inputs: Inputs


def make_linear_inputs(layout: str = "padded", *, batch: int = 3, seq_len: int = 8, dim: int = 32,
                       vocab: int = 600, dtype: torch.dtype = torch.float32, bias: bool = True, seed: int = 0,
                       logit_scale: float = 2.0, mismatch: float = 0.5, device: str = "cpu") -> LinearInputs:
    """Random hidden states, lm_head weight and bias whose logits have about `logit_scale` spread, with the
    per-token inputs of `make_inputs` (argmax and uniform tokens, masked garbage, a sequence without mismatch)."""
    gen = torch.Generator().manual_seed(seed)
    shape, lengths = _layout_shape(layout, batch, seq_len)
    hidden = torch.randn(*shape, dim, generator=gen, dtype=torch.float64).to(dtype)
    weight = (torch.randn(vocab, dim, generator=gen, dtype=torch.float64) * logit_scale / dim ** 0.5).to(dtype)
    b = (torch.randn(vocab, generator=gen, dtype=torch.float64) * 0.5).to(dtype) if bias else None
    logits = hidden.double() @ weight.double().t() + (0.0 if b is None else b.double())
    inputs = _inputs_for(logits, layout, lengths, gen, mismatch, device)
    to = dict(device=device)
    return LinearInputs(hidden.to(**to), weight.to(**to), None if b is None else b.to(**to), inputs)


def _copy_keeping_strides(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x copied (autograd-tracked when x requires grad) into new storage with x's strides: clone() and .to()
    of a non-contiguous slice such as logits[:, :-1] of [B, T + 1, V] would return a contiguous tensor."""
    out = torch.empty_strided(x.shape, x.stride(), dtype=dtype, device=x.device)
    return out.copy_(x)


def run(inputs: Inputs, config, backend: str, *, dtype=None, grad_scale: float = 1.0, inplace=False, logits=None,
        **kwargs):
    """(output, grad) of policy_loss on a fresh copy of the logits (cast to dtype when given) that keeps
    their strides, so a padded slice or a transposed vocabulary reaches the kernels as one.

    logits: a leaf holding inputs.logits' values to differentiate as it is instead (a view into a bigger or
    misaligned buffer: its storage offset is part of the layout under test); with inplace=True the
    gradient lands in it."""
    if logits is not None:
        leaf = work = logits.requires_grad_()
    else:
        leaf = _copy_keeping_strides(inputs.logits.detach(), dtype or inputs.logits.dtype).requires_grad_()
        # inplace needs a non-leaf buffer it may overwrite
        work = _copy_keeping_strides(leaf, leaf.dtype) if inplace else leaf
    out = fused_is.policy_loss(work, inputs.tokens, inputs.advantages, config=config, backend=backend,
                               inplace=inplace, **inputs.kwargs(**kwargs))
    (out.loss * grad_scale).backward()
    return out, leaf.grad


def loss_scale(inputs: Inputs, config, **kwargs) -> float:
    """The float64 reference's aggregation of |L_t| + |dL_t/dlp_t * lp_t|: what a loss error is relative to."""
    from fused_is.call import prepare_batch
    from fused_is.reference import reference_policy_loss_terms

    call = prepare_batch(inputs.logits.double().requires_grad_(), inputs.tokens, inputs.advantages, config=config,
                          **inputs.kwargs(**kwargs))
    return float(reference_policy_loss_terms(call)[-1])


def rel_err(actual: torch.Tensor, expected: torch.Tensor, scale: float = None) -> float:
    """max |actual - expected| / (scale or max |expected|) (norm-relative; 0/0 counts as 0)."""
    actual, expected = actual.detach().double(), expected.detach().double()
    diff = (actual - expected).abs().max() if expected.numel() else torch.tensor(0.0)
    if scale is None:
        scale = expected.abs().max() if expected.numel() else torch.tensor(0.0)
    if float(scale) == 0.0:
        return float(diff)
    return float(diff / scale)


def logprob_scale(x: torch.Tensor) -> float:
    """The scale logprob and entropy errors are measured against: max(max |x|, 1)."""
    return max(float(x.detach().abs().max()) if x.numel() else 0.0, 1.0)


def compare_to_reference(inputs: Inputs, config, backend: str, *, grad_scale: float = 1.7, inplace: bool = False,
                         with_old: bool = True, logits=None):
    """Run `backend` at the inputs' dtype and the float64 reference on the same values.

    Returns (errors, (out, grad), (ref, ref_grad), scale); errors maps loss / grad / logprobs / entropy
    to the relative error (loss relative to `scale`, the larger of |loss| and `loss_scale`; the gradient
    relative to its largest element; logprobs (over unmasked tokens) and entropies relative to the larger
    of their largest magnitude and 1: an error of e in a logprob is a relative error of e in the
    probability, so below |lp| = 1 it is measured absolutely, not against a tiny lp).
    """
    # the same random draw on both sides (Clip-Cov draws from torch's default generator), the caller's RNG untouched
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        out, grad = run(inputs, config, backend, grad_scale=grad_scale, inplace=inplace, with_old=with_old,
                        logits=logits)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        ref, ref_grad = run(inputs, config, "reference", dtype=torch.float64, grad_scale=grad_scale,
                            with_old=with_old)
    scale = max(abs(ref.loss.item()), loss_scale(inputs, config, with_old=with_old))
    valid = inputs.mask
    errors = dict(
        loss=rel_err(out.loss, ref.loss, scale),
        grad=rel_err(grad, ref_grad),
        logprobs=rel_err(out.logprobs[valid], ref.logprobs[valid], logprob_scale(ref.logprobs[valid])),
        entropy=rel_err(out.entropy, ref.entropy, logprob_scale(ref.entropy)),
    )
    return errors, (out, grad), (ref, ref_grad), scale


# aten ops whose result, or whose output's size, needs a value read on the host (a synchronisation on CUDA)
_HOST_READS = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.nonzero.default,
               torch.ops.aten.masked_select.default, torch.ops.aten.equal.default, torch.ops.aten.is_nonzero.default,
               torch.ops.aten.unique_consecutive.default, torch.ops.aten._unique2.default,
               torch.ops.aten.repeat_interleave.Tensor}


class HostReads(TorchDispatchMode):
    """Within the block: `ops`, the aten ops that read a tensor value on the host (on CUDA each is a sync: .item(),
    bool(), nonzero, boolean indexing, torch.equal, ...) and Tensor.tolist calls; `dispatched`, the number of aten
    ops run (the host's per-call work of small tensor ops). Counted at the dispatcher, so the CPU sees the same
    operations a GPU would."""

    def __init__(self):
        super().__init__()
        self.ops = []
        self.dispatched = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.dispatched += 1
        aten = torch.ops.aten
        if func in _HOST_READS and not (func is aten.repeat_interleave.Tensor and kwargs.get("output_size")):
            self.ops.append(str(func))
        if func is aten.index.Tensor and any(i is not None and i.dtype == torch.bool for i in args[1]):
            self.ops.append("aten.index.Tensor (boolean mask)")
        return func(*args, **kwargs)

    def __enter__(self):
        out = super().__enter__()  # first: if it fails, tolist is left as it was
        self._tolist = torch.Tensor.tolist
        ops = self.ops

        def tolist(t):
            ops.append("Tensor.tolist")
            return self._tolist(t)

        torch.Tensor.tolist = tolist
        return out

    def __exit__(self, *exc):
        torch.Tensor.tolist = self._tolist
        return super().__exit__(*exc)
