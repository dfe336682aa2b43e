"""Head-precision replay (head_dtype= / LossConfig.head_dtype): the learner's fp32 logits rounded to the sampler
head's dtype before the softmax, block by block, the gradient passed through the rounding. Against the same call on
logits rounded beforehand (bitwise: the kernels are batch invariant) and the float64 reference; refusals by name."""

import dataclasses

import pytest
import torch

import fused_is
from fused_is import backends, plan

from cases import assert_close, make_inputs

BACKENDS = [b for b in ("torch", "cpu", "triton") if backends.unavailable_reason(b, torch.empty(1, 1)) is None]


@pytest.fixture
def small_blocks(monkeypatch):
    """Blocks of 3 rows (V = 200): a call is several blocks, padded ones cut at sequence ends."""
    monkeypatch.setattr(plan, "ROUNDED_BLOCK_ELEMENTS", 600)


def _rounded(x: torch.Tensor, dtype=torch.bfloat16) -> torch.Tensor:
    return x.to(dtype).to(x.dtype)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout,preset,with_old", [("padded", "ppo_tis", True), ("packed", "seq_mis", False),
                                                    ("padded", "gspo", True)])
@pytest.mark.parametrize("inplace", [False, "forward"])
def test_policy_loss_equals_the_call_on_rounded_logits(small_blocks, backend, layout, preset, with_old, inplace):
    inputs = make_inputs(layout, dtype=torch.float32, vocab=200, seed=61)
    cfg = fused_is.LossConfig.preset(preset, entropy_coef=0.03)
    kwargs = inputs.kwargs(with_old=with_old)
    results = []
    for logits, head in ((inputs.logits, torch.bfloat16), (_rounded(inputs.logits), None)):
        leaf = logits.clone().requires_grad_()
        work = leaf * 1 if inplace else leaf
        out = fused_is.policy_loss(work, inputs.tokens, inputs.advantages, config=cfg, backend=backend,
                                   inplace=inplace, head_dtype=head, **kwargs)
        (1.3 * out.loss).backward()
        results.append((out, leaf.grad))
    (out, grad), (want, want_grad) = results
    assert torch.equal(out.loss, want.loss) and torch.equal(out.logprobs, want.logprobs)
    assert torch.equal(out.entropy, want.entropy) and torch.equal(grad, want_grad)
    assert out.metrics == want.metrics
    with torch.no_grad():
        plain = fused_is.policy_loss(inputs.logits, inputs.tokens, inputs.advantages, config=cfg, backend=backend,
                                     **kwargs)
    assert not torch.equal(plain.logprobs, out.logprobs)  # the rounding changes what the kernels read
    ref_logits = inputs.logits.double().requires_grad_()  # the oracle rounds too (fp64 -> bf16, the same values)
    ref = fused_is.policy_loss(ref_logits, inputs.tokens, inputs.advantages, config=cfg, backend="reference",
                               head_dtype="bfloat16", **kwargs)
    (1.3 * ref.loss).backward()
    valid = inputs.mask.bool()
    assert_close("loss", out.loss, ref.loss, 1e-5, scale=max(1.0, abs(ref.loss.item())))
    assert_close("logprobs", out.logprobs, ref.logprobs, 1e-5, mask=valid, scale=20.0)
    assert_close("grad", grad, ref_logits.grad, 1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_config_field_token_logprobs_and_logprobs(small_blocks, backend):
    """LossConfig.head_dtype is the per-call argument; token_logprobs and logprobs (values and the gradient of a
    random upstream) equal their calls on rounded logits, per-row temperatures included."""
    inputs = make_inputs("padded", dtype=torch.float32, vocab=200, seed=62)
    cfg = fused_is.LossConfig.preset("ppo_tis", head_dtype="bfloat16")
    with torch.no_grad():
        by_config = fused_is.policy_loss(inputs.logits, inputs.tokens, inputs.advantages, config=cfg,
                                         backend=backend, **inputs.kwargs())
        by_call = fused_is.policy_loss(inputs.logits, inputs.tokens, inputs.advantages, config="ppo_tis",
                                       backend=backend, head_dtype=torch.bfloat16, **inputs.kwargs())
    assert torch.equal(by_config.loss, by_call.loss)
    tau = torch.rand(inputs.tokens.shape[0], generator=torch.Generator().manual_seed(3)) + 0.5
    gen = torch.Generator().manual_seed(4)
    upstream = torch.randn(inputs.tokens.shape, generator=gen), torch.randn(inputs.tokens.shape, generator=gen)
    got = []
    for logits, head in ((inputs.logits, "bfloat16"), (_rounded(inputs.logits), None)):
        values = fused_is.token_logprobs(logits, inputs.tokens, tau, backend, mask=inputs.mask, head_dtype=head)
        leaf = logits.clone().requires_grad_()
        lp, entropy = fused_is.logprobs(leaf, inputs.tokens, temperature=tau, mask=inputs.mask, backend=backend,
                                        head_dtype=head)
        torch.where(inputs.mask, lp * upstream[0] + entropy * upstream[1], 0.0).sum().backward()
        got.append(values + (lp, entropy, leaf.grad))
    for name, a, b in zip(("token lp", "token H", "lp", "H", "grad"), *got):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("backend", BACKENDS)
def test_linear_policy_loss_rounds_its_chunks(backend):
    """linear_policy_loss with an fp32 head and LossConfig.head_dtype="bfloat16": each chunk's logits rounded as
    the sampler's bf16 head output, equal to policy_loss over the rounded fp32 logits."""
    gen = torch.Generator().manual_seed(63)
    hidden, weight = torch.randn(11, 16, generator=gen), torch.randn(90, 16, generator=gen)
    tokens, adv = torch.randint(0, 90, (11,), generator=gen), torch.randn(11, generator=gen)
    cfg = fused_is.LossConfig.preset("ppo", head_dtype="bfloat16")
    old = torch.randn(11, generator=gen) * 0.1 - 3.0
    leaves = [x.clone().requires_grad_() for x in (hidden, weight)]
    out = fused_is.linear_policy_loss(*leaves, tokens, adv, old_logprobs=old, config=cfg, backend=backend,
                                      chunk_size=4)
    out.loss.backward()
    logits = _rounded(hidden @ weight.t()).requires_grad_()
    want = fused_is.policy_loss(logits, tokens, adv, old_logprobs=old, config="ppo", backend=backend)
    want.loss.backward()
    assert_close("loss", out.loss, want.loss, 1e-6)
    assert_close("logprobs", out.logprobs, want.logprobs, 1e-6, scale=20.0)
    assert_close("d hidden", leaves[0].grad, logits.grad @ weight, 1e-5)


def test_refusals():
    inputs = make_inputs("padded", dtype=torch.bfloat16, vocab=50, seed=64)
    call = dict(tokens=inputs.tokens, advantages=inputs.advantages, mask=inputs.mask, backend="torch", config="ppo")
    with pytest.raises(ValueError, match="head_dtype='float32' cannot be replayed on bfloat16 logits"):
        fused_is.policy_loss(inputs.logits, head_dtype=torch.float32, **call)
    with pytest.raises(ValueError, match="head_dtype='float16' cannot be replayed on bfloat16 logits"):
        fused_is.token_logprobs(inputs.logits, inputs.tokens, mask=inputs.mask, head_dtype="float16")
    with pytest.raises(TypeError, match="head_dtype must be None, torch.bfloat16"):
        fused_is.policy_loss(inputs.logits.float(), head_dtype=torch.int8, **call)
    with pytest.raises(ValueError, match="LossConfig.head_dtype must be one of"):
        fused_is.LossConfig(head_dtype="fp8")
    with pytest.raises(ValueError, match="disagree"):
        fused_is.policy_loss(inputs.logits.float(), head_dtype="bfloat16",
                             **dict(call, config=fused_is.LossConfig.preset("ppo", head_dtype="float16")))
    with pytest.raises(ValueError, match="inplace=True writes the gradient in backward"):
        fused_is.policy_loss(inputs.logits.float().requires_grad_() * 1, head_dtype="bfloat16", inplace=True, **call)
    # logits of the head's own dtype: nothing to round, the plain call
    with torch.no_grad():
        same = fused_is.policy_loss(inputs.logits, head_dtype=torch.bfloat16, **call)
        plain = fused_is.policy_loss(inputs.logits, **call)
    assert torch.equal(same.loss, plain.loss)
