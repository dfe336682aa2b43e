"""fused_is.logprobs: differentiable fused logprobs and entropies against the float64 reference, for random upstream
gradients of both outputs; a preset written as plain torch over them equals the one-pass preset."""

import dataclasses

import pytest
import torch

import fused_is
from fused_is import backends

from cases import assert_close, make_inputs, tolerance

BACKENDS = [b for b in ("torch", "cpu", "triton") if backends.unavailable_reason(b) is None]


def _reference(inputs, temperature, grad_lp, grad_h):
    logits = inputs.logits.detach().double().requires_grad_()
    lp, entropy = fused_is.logprobs(logits, inputs.tokens, mask=inputs.mask, temperature=temperature,
                                    backend="reference")
    ((lp * grad_lp).sum() + (entropy * grad_h).sum()).backward()
    return lp.detach(), entropy.detach(), logits.grad


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout,per_row_tau,inplace", [
    ("padded", False, False),
    ("packed", True, True),   # per-token temperatures; the gradient over the logits' own buffer
    ("padded", True, True),
])
def test_matches_reference_for_random_upstream_gradients(backend, dtype, layout, per_row_tau, inplace):
    inputs = make_inputs(layout, dtype=dtype, vocab=300, seed=31)
    gen = torch.Generator().manual_seed(32)
    shape = inputs.tokens.shape
    temperature = (0.5 + torch.rand(shape, generator=gen)) if per_row_tau else 0.8
    grad_lp, grad_h = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    valid = inputs.mask.bool()
    logits = inputs.logits.clone()
    logits[~valid] = float("nan")  # masked rows may hold anything: their gradient must be exactly 0
    inputs = dataclasses.replace(inputs, logits=logits)
    ref_lp, ref_h, ref_grad = _reference(inputs, temperature, grad_lp, grad_h)
    leaf = logits.clone().requires_grad_()
    work = leaf * 1 if inplace else leaf  # inplace needs a buffer it may overwrite
    lp, entropy = fused_is.logprobs(work, inputs.tokens, mask=inputs.mask, temperature=temperature,
                                    backend=backend, inplace=inplace)
    assert lp.dtype == entropy.dtype == torch.float32 and lp.shape == shape
    ((lp * grad_lp).sum() + (entropy * grad_h).sum()).backward()
    tol = tolerance(dtype, backend)
    assert_close("logprobs", lp, ref_lp, tol["logprobs"], mask=valid, scale=20.0)
    assert_close("entropy", entropy, ref_h, tol["logprobs"], mask=valid, scale=10.0)
    assert_close("grad", leaf.grad, ref_grad, tol["grad"])
    assert torch.equal(leaf.grad[~valid], torch.zeros_like(leaf.grad[~valid]))
    if inplace:
        assert work.data_ptr() == leaf.grad.data_ptr() or torch.equal(work.detach(), leaf.grad)


def _ppo_tis_in_torch(lp, entropy, inputs):
    """The ppo_tis preset written plainly over fused logprobs (DESIGN.md section 2): token mean of -W min(r A,
    clip(r) A), W = min(exp(old - samp), 2)."""
    valid = inputs.mask.bool()
    old, samp, adv = inputs.old_logprobs.float(), inputs.sampler_logprobs.float(), inputs.advantages.float()
    ratio = torch.exp(lp - old)
    weight = torch.exp(old - samp).clamp(max=2.0)
    surrogate = torch.minimum(ratio * adv, ratio.clamp(0.8, 1.2) * adv)
    per_token = torch.where(valid, -weight * surrogate, 0.0)
    return per_token.sum() / valid.sum().clamp(min=1)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_a_preset_in_plain_torch_over_logprobs_equals_the_fused_preset(backend, layout):
    """Loss and gradient of ppo_tis written by hand over fused_is.logprobs equal policy_loss(config="ppo_tis") to
    float tolerance: the two paths compute the same function."""
    inputs = make_inputs(layout, dtype=torch.float32, vocab=200, seed=33)
    leaf = inputs.logits.clone().requires_grad_()
    lp, entropy = fused_is.logprobs(leaf, inputs.tokens, mask=inputs.mask, backend=backend)
    loss = _ppo_tis_in_torch(lp, entropy, inputs)
    (1.7 * loss).backward()
    fused_leaf = inputs.logits.clone().requires_grad_()
    out = fused_is.policy_loss(fused_leaf, inputs.tokens, inputs.advantages, config="ppo_tis", backend=backend,
                               **inputs.kwargs())
    (1.7 * out.loss).backward()
    torch.testing.assert_close(loss, out.loss, rtol=1e-5, atol=1e-6)
    assert_close("grad", leaf.grad, fused_leaf.grad, 1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_vocabulary_shards_in_process(backend, monkeypatch):
    """vocab_group: each shard's outputs are the whole rows' and its gradient the shard of the whole one (the
    all-gather replaced by the shards' recorded partials, in rank order)."""
    from fused_is import distributed

    inputs = make_inputs("padded", dtype=torch.float32, vocab=120, seed=34)
    sizes = (50, 70)
    gen = torch.Generator().manual_seed(35)
    grad_lp, grad_h = torch.randn(inputs.tokens.shape, generator=gen), torch.randn(inputs.tokens.shape, generator=gen)
    parts, state = {}, dict(rank=0, collect=True)
    real = distributed.shard_partials

    def partials(*args):
        ids, packed = real(*args)
        if state["collect"]:
            parts[state["rank"]] = packed.clone()
        return ids, packed

    monkeypatch.setattr(distributed, "shard_partials", partials)
    monkeypatch.setattr(distributed, "gather_ranks", lambda t, group: t.unsqueeze(0) if state["collect"]
                        else torch.stack([parts[r] for r in range(len(sizes))]))
    monkeypatch.setattr(distributed, "check_group", lambda group: group)
    monkeypatch.setattr(distributed, "shard_range",
                        lambda v, group, device, host=True: (sum(sizes[:state["rank"]]), sum(sizes)))
    shards = list(inputs.logits.split(sizes, dim=-1))
    for r, shard in enumerate(shards):
        state["rank"] = r
        with torch.no_grad():
            fused_is.logprobs(shard, inputs.tokens, mask=inputs.mask, backend=backend, vocab_group="group")
    state["collect"] = False
    full = inputs.logits.clone().requires_grad_()
    lp, entropy = fused_is.logprobs(full, inputs.tokens, mask=inputs.mask, backend=backend)
    ((lp * grad_lp).sum() + (entropy * grad_h).sum()).backward()
    valid = inputs.mask.bool()
    for r, shard in enumerate(shards):
        state["rank"] = r
        leaf = shard.clone().requires_grad_()
        lp_r, entropy_r = fused_is.logprobs(leaf, inputs.tokens, mask=inputs.mask, backend=backend,
                                            vocab_group="group")
        ((lp_r * grad_lp).sum() + (entropy_r * grad_h).sum()).backward()
        assert_close("logprobs", lp_r, lp, 1e-6, mask=valid, scale=20.0)
        assert_close("entropy", entropy_r, entropy, 1e-6, mask=valid, scale=10.0)
        assert_close("grad", leaf.grad, full.grad.split(sizes, dim=-1)[r], 1e-5, scale=full.grad.abs().max())


def test_refusals_name_the_argument():
    inputs = make_inputs("padded", vocab=50, seed=36)
    with pytest.raises(ValueError, match="backend='cuda'"):
        fused_is.logprobs(inputs.logits, inputs.tokens, mask=inputs.mask, backend="cuda")  # no GPU, or no sweep
    with pytest.raises(TypeError, match="inplace"):
        fused_is.logprobs(inputs.logits, inputs.tokens, mask=inputs.mask, inplace="yes")
    with pytest.raises(ValueError, match="tokens"):
        fused_is.logprobs(inputs.logits, inputs.tokens.abs() + 1000)
    with pytest.raises(ValueError, match="inplace"):
        fused_is.logprobs(inputs.logits.double(), inputs.tokens, mask=inputs.mask, backend="reference", inplace=True)


def test_inplace_logits_modified_before_backward_is_an_error():
    inputs = make_inputs("padded", dtype=torch.float32, vocab=50, seed=37)
    logits = inputs.logits.clone().requires_grad_() * 1.0
    lp, _ = fused_is.logprobs(logits, inputs.tokens, mask=inputs.mask, backend="torch", inplace=True)
    logits.detach().add_(1.0)  # a write autograd does not see, but the version counter does
    torch.autograd.graph.increment_version(logits)
    with pytest.raises(RuntimeError, match="modified in place between the call and backward"):
        lp.sum().backward()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("with_bias,chunk", [(False, 5), (True, 64)])
def test_linear_logprobs_match_reference(backend, with_bias, chunk):
    """linear_logprobs: lp, H and the gradients of hidden, weight and bias for random upstream gradients of both
    outputs, against the float64 reference of the materialised logits (chunks smaller than N: several GEMMs)."""
    torch.manual_seed(38)
    n, dim, vocab = 23, 16, 150
    hidden, weight = torch.randn(n, dim), torch.randn(vocab, dim) * 0.3
    bias = torch.randn(vocab) * 0.1 if with_bias else None
    tokens = torch.randint(0, vocab, (n,))
    mask = torch.rand(n) > 0.2
    grad_lp, grad_h = torch.randn(n), torch.randn(n)
    hidden_poisoned = hidden.clone()
    hidden_poisoned[~mask] = float("nan")  # masked rows may hold anything

    def run(dtype, backend_name):
        leaves = [x.to(dtype).requires_grad_() if x is not None else None for x in (hidden_poisoned, weight, bias)]
        lp, entropy = fused_is.linear_logprobs(leaves[0], leaves[1], tokens, bias=leaves[2], mask=mask,
                                               temperature=0.9, backend=backend_name, chunk_size=chunk)
        ((lp * grad_lp).sum() + (entropy * grad_h).sum()).backward()
        return lp, entropy, [x.grad for x in leaves if x is not None]

    ref_lp, ref_h, ref_grads = run(torch.float64, "reference")
    lp, entropy, grads = run(torch.float32, backend)
    assert_close("logprobs", lp, ref_lp, 1e-5, mask=mask, scale=20.0)
    assert_close("entropy", entropy, ref_h, 1e-5, mask=mask, scale=10.0)
    for name, got, want in zip(("hidden", "weight", "bias"), grads, ref_grads):
        assert_close(f"d {name}", got, want, 1e-5)
    assert torch.equal(grads[0][~mask], torch.zeros_like(grads[0][~mask]))
