"""fused_is.linear_policy_loss / linear_token_logprobs against the float64 reference of section 2 applied to
logits = hidden.double() @ weight.double().T + bias: loss, logprobs, entropy, metrics and the gradients
of hidden, weight and bias, on fresh random inputs, with chunk boundaries that split sequences."""

from __future__ import annotations

import zlib

import pytest
import torch

import fused_is
from fused_is.linear import default_chunk_rows
from fused_is.testing import LinearInputs, make_linear_inputs

from cases import CHUNK, OPTION_CASES, PRESET_NAMES, assert_close, check_linear, config_for, logprob_scale, run_linear

BACKENDS = [b for b in ("torch", "cpu", "triton") if fused_is.backends.unavailable_reason(b, torch.empty(1, 2)) is None]
missing = [b for b in ("torch", "cpu", "triton") if b not in BACKENDS]
assert not missing or __import__("os").environ.get("CI") != "true", f"backends missing in CI: {missing}"

def test_reference_is_policy_loss_of_the_product():
    """The oracle itself: linear's reference equals policy_loss(reference) on the float64 logits, and its
    gradients are the chain rule through the product (d hidden = dZ W, d W = dZ^T hidden, d b = sum dZ)."""
    li = make_linear_inputs("packed", seed=11)
    config = config_for("ppo_tis", dict(kl_coef=0.1, entropy_coef=0.01))
    ref, (gh, gw, gb) = run_linear(li, config, "reference")
    logits = li.inputs.logits.double().requires_grad_()
    direct = fused_is.policy_loss(logits, li.inputs.tokens, li.inputs.advantages, config=config, backend="reference",
                                  **li.inputs.kwargs())
    (direct.loss * 1.7).backward()
    dz = logits.grad
    assert_close("loss", ref.loss, direct.loss, 1e-12)
    # the leaves are fp32: their gradients are the float64 products rounded once to fp32
    assert_close("grad hidden", gh, dz @ li.weight.double(), 1e-7)
    assert_close("grad weight", gw, dz.t() @ li.hidden.double(), 1e-7)
    assert_close("grad bias", gb, dz.sum(0), 1e-7)


@pytest.mark.parametrize("with_old", [True, False])
@pytest.mark.parametrize("preset", PRESET_NAMES)
@pytest.mark.parametrize("layout", ["padded", "packed"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_presets_fp32(backend, layout, preset, with_old):
    li = make_linear_inputs(layout, seed=zlib.crc32(f"{layout}/{preset}".encode()) % 1000)  # same in every process
    check_linear(li, config_for(preset), backend, with_old=with_old)


@pytest.mark.parametrize("name,preset,overrides", OPTION_CASES, ids=[c[0] for c in OPTION_CASES])
@pytest.mark.parametrize("layout", ["padded", "packed"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_options_fp32(backend, layout, name, preset, overrides):
    li = make_linear_inputs(layout, seed=7)
    with_old = not name.startswith("gspo")  # GSPO and GMPO with old=None: the two-pass plan with lp as base
    check_linear(li, config_for(preset, overrides), backend, with_old=with_old)


@pytest.mark.parametrize("head_dtype", [None, torch.float32])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("backend", BACKENDS)
def test_low_precision_inputs_and_fp32_head(backend, dtype, head_dtype):
    li = make_linear_inputs("padded", dtype=dtype, seed=3)
    check_linear(li, config_for("ppo_tis", dict(kl_coef=0.05, entropy_coef=0.01)), backend, head_dtype=head_dtype)


def test_fp32_head_is_closer_than_the_bf16_head():
    """The point of head_dtype=torch.float32: logprobs exact to fp32 instead of to the bf16 rounding of the logits."""
    li = make_linear_inputs("padded", dtype=torch.bfloat16, seed=5)
    ref, _ = run_linear(li, "ppo_tis", "reference")
    errors = {}
    for head in (None, torch.float32):
        out, _ = run_linear(li, "ppo_tis", "cpu" if "cpu" in BACKENDS else "torch", head_dtype=head)
        errors[head] = float((out.logprobs - ref.logprobs)[li.inputs.mask].abs().max())
    assert errors[torch.float32] < 1e-5 < errors[None], errors


def test_fp64_is_exact_on_the_torch_backend():
    li = make_linear_inputs("packed", dtype=torch.float64, seed=9)
    check_linear(li, config_for("seq_tis"), "torch", with_old=False)
    check_linear(li, config_for("ppo", dict(ratio_level="sequence", kl_coef=0.1)), "torch", with_old=False)


@pytest.mark.parametrize("chunk_size", [1, 3, 8, 24, 1000, None])
def test_chunk_size_does_not_change_the_result(chunk_size):
    """Every chunking gives the same result up to the fp32 rounding of the logits (a GEMM of another shape
    may round differently), sequence-level configs included."""
    li = make_linear_inputs("packed", seed=2)
    for config, with_old in (("ppo_tis", True), ("seq_mis", False), (config_for("ppo", dict(policy="gmpo")), True)):
        base, base_grads = run_linear(li, config, "torch", with_old=with_old, chunk_size=2)
        out, grads = run_linear(li, config, "torch", with_old=with_old, chunk_size=chunk_size)
        assert_close("loss", out.loss, base.loss, 1e-6, scale=max(1.0, abs(base.loss.item())))
        for g, b in zip(grads, base_grads):
            assert_close("grad", g, b, 1e-6)


def test_default_chunk_rows():
    assert default_chunk_rows(100000, 4096) == 4096
    assert default_chunk_rows(100000, 64) == 256
    assert default_chunk_rows(10, 4096) == 10
    assert default_chunk_rows(0, 4096) == 1


@pytest.mark.parametrize("want", [(True, False, False), (False, True, True), (False, False, True), (True, True, False)])
def test_only_the_wanted_gradients(want):
    li = make_linear_inputs("padded", seed=4)
    out, grads = run_linear(li, "ppo_tis", BACKENDS[-1], want=want)
    ref, ref_grads = run_linear(li, "ppo_tis", "reference")
    for w, g, r in zip(want, grads, ref_grads):
        if w:
            assert_close("grad", g, r, 1e-5)
        else:
            assert g is None


def test_without_bias():
    li = make_linear_inputs("packed", bias=False, seed=6)
    check_linear(li, config_for("ppo_tis"), BACKENDS[1] if len(BACKENDS) > 1 else "torch")


@pytest.mark.parametrize("backend", BACKENDS)
def test_tied_embedding_gradients_add_up(backend):
    """The weight is also the input embedding: autograd adds the embedding's gradient to the head's."""
    li = make_linear_inputs("padded", seed=8)
    ids = torch.randint(0, li.weight.shape[0], (5,), generator=torch.Generator().manual_seed(1))

    def total(weight_leaf, which):
        embedded = weight_leaf[ids]  # the embedding lookup of the same parameter
        hidden = li.hidden + 0.1 * embedded.sum(0)  # the hidden states depend on it too
        out = fused_is.linear_policy_loss(hidden, weight_leaf, li.inputs.tokens, li.inputs.advantages, bias=li.bias,
                                          chunk_size=CHUNK, backend=which, **li.inputs.kwargs())
        return out.loss + 0.3 * embedded.pow(2).sum()

    weight = li.weight.detach().clone().requires_grad_()
    total(weight, backend).backward()
    ref_weight = li.weight.detach().clone().requires_grad_()
    total(ref_weight, "reference").backward()
    assert_close("tied grad", weight.grad, ref_weight.grad, 1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_grad_and_linear_token_logprobs(backend):
    li = make_linear_inputs("padded", seed=12)
    with torch.no_grad():
        out = fused_is.linear_policy_loss(li.hidden, li.weight, li.inputs.tokens, li.inputs.advantages, bias=li.bias,
                                          backend=backend, chunk_size=CHUNK, **li.inputs.kwargs())
    ref, _ = run_linear(li, "ppo_tis", "reference")
    assert not out.loss.requires_grad
    assert_close("loss", out.loss, ref.loss, 1e-5, scale=max(1.0, abs(ref.loss.item())))
    tau = 0.7
    lp, entropy = fused_is.linear_token_logprobs(li.hidden, li.weight, li.inputs.tokens, bias=li.bias, temperature=tau,
                                                 chunk_size=CHUNK, mask=li.inputs.mask, backend=backend)
    ref_lp, ref_entropy = fused_is.token_logprobs(li.inputs.logits.double(), li.inputs.tokens, tau, "reference",
                                                  mask=li.inputs.mask)
    valid = li.inputs.mask
    assert lp.shape == li.inputs.tokens.shape and lp.dtype == torch.float32
    assert_close("lp", lp, ref_lp, 1e-6, mask=valid, scale=logprob_scale(ref_lp[valid]))
    assert_close("entropy", entropy[valid], ref_entropy[valid], 1e-6, scale=logprob_scale(ref_entropy))


def test_second_backward_raises_clearly():
    li = make_linear_inputs("padded", seed=1)
    hidden = li.hidden.clone().requires_grad_()
    out = fused_is.linear_policy_loss(hidden, li.weight, li.inputs.tokens, li.inputs.advantages, **li.inputs.kwargs())
    out.loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward ran twice"):
        out.loss.backward()


@pytest.mark.parametrize("kept", [False, True], ids=["full", "kept"])
def test_linear_logprobs_second_backward_adds_the_same_gradient(kept):
    """linear_logprobs keeps its O(N) statistics with the node: a second backward (retain_graph=True) adds the same
    d hidden and d weight again, over the whole vocabulary or a kept set."""
    li = make_linear_inputs("padded", seed=2)
    hidden, weight = li.hidden.clone().requires_grad_(), li.weight.clone().requires_grad_()
    tokens = li.inputs.tokens
    extra = dict(kept=torch.stack([tokens, (tokens + 3) % weight.shape[0]], dim=-1)) if kept else {}
    lp, entropy = fused_is.linear_logprobs(hidden, weight, tokens, bias=li.bias, chunk_size=CHUNK,
                                           mask=li.inputs.mask, backend="torch", **extra)
    (lp.sum() - entropy.sum()).backward(retain_graph=True)
    first_hidden, first_weight = hidden.grad.clone(), weight.grad.clone()
    assert first_hidden.abs().sum() > 0 and first_weight.abs().sum() > 0
    (lp.sum() - entropy.sum()).backward()
    torch.testing.assert_close(hidden.grad, 2 * first_hidden, rtol=1e-6, atol=0)
    torch.testing.assert_close(weight.grad, 2 * first_weight, rtol=1e-6, atol=0)


def test_all_tokens_masked_gives_zero():
    li = make_linear_inputs("padded", seed=1)
    mask = torch.zeros_like(li.inputs.mask)
    out, grads = run_linear(li, "ppo_tis", BACKENDS[-1], mask=mask)
    assert out.loss.item() == 0.0
    for g in grads:
        assert torch.count_nonzero(g) == 0


def test_validate_async_matches_full():
    li = make_linear_inputs("packed", seed=13)
    full, full_grads = run_linear(li, "seq_tis", "torch", with_old=False)
    fast, fast_grads = run_linear(li, "seq_tis", "torch", with_old=False, validate="async")
    assert torch.equal(full.loss, fast.loss)
    assert all(isinstance(v, torch.Tensor) for v in fast.metrics.values())
    for a, b in zip(full_grads, fast_grads):
        assert torch.equal(a, b)


def test_bad_hidden_row_is_named_and_masked_rows_may_hold_anything():
    li = make_linear_inputs("padded", seed=14)
    hidden = li.hidden.clone()
    hidden[2, 3, 0] = float("nan")
    with pytest.raises(ValueError, match=r"NaN at row 19 of hidden @ weight.T \(hidden\[2, 3\]\)"):
        fused_is.linear_policy_loss(hidden, li.weight, li.inputs.tokens, li.inputs.advantages, bias=li.bias,
                                    chunk_size=CHUNK, **li.inputs.kwargs())
    with pytest.raises(ValueError, match=r"hidden\[2, 3\]"):
        fused_is.linear_token_logprobs(hidden, li.weight, li.inputs.tokens, bias=li.bias, mask=li.inputs.mask)
    # the same NaN at a masked row: no error, and the result equals the clean run's
    mask = li.inputs.mask.clone()
    mask[2, 3] = False
    clean, clean_grads = run_linear(li, "ppo_tis", "torch", mask=mask)
    dirty = LinearInputs(hidden, li.weight, li.bias, li.inputs)
    out, grads = run_linear(dirty, "ppo_tis", "torch", mask=mask)
    assert torch.equal(out.loss, clean.loss)
    assert torch.equal(grads[1], clean_grads[1]) and torch.equal(grads[2], clean_grads[2])
    assert torch.isfinite(grads[0]).all()


def test_argument_errors():
    li = make_linear_inputs("padded", seed=1)
    h, w, b = li.hidden, li.weight, li.bias
    tok, adv = li.inputs.tokens, li.inputs.advantages

    def call(**kw):
        args = dict(hidden=h, weight=w, tokens=tok, advantages=adv)
        args.update(kw)
        return fused_is.linear_policy_loss(args.pop("hidden"), args.pop("weight"), args.pop("tokens"),
                                           args.pop("advantages"), **args)

    with pytest.raises(TypeError, match="hidden must be a torch.Tensor"):
        call(hidden=h.tolist())
    with pytest.raises(TypeError, match="hidden must be bf16"):
        call(hidden=h.long())
    with pytest.raises(ValueError, match="hidden must be"):
        call(hidden=h[0, 0])
    with pytest.raises(ValueError, match=r"weight must be the lm_head's \[V, D\]"):
        call(weight=w[:, :-1])
    with pytest.raises(ValueError, match="bias must have shape"):
        call(bias=b[:-1])
    with pytest.raises(TypeError, match="pass head_dtype="):
        call(weight=w.bfloat16())
    with pytest.raises(TypeError, match="head_dtype must be"):
        call(head_dtype=torch.int32)
    with pytest.raises(ValueError, match="chunk_size must be"):
        call(chunk_size=0)
    with pytest.raises(ValueError, match="tokens must have shape"):
        call(tokens=tok[:, :-1])
    with pytest.raises(ValueError, match="backend must be one of"):
        call(backend="nope")
    with pytest.raises(ValueError, match="tokens must be ids in"):
        call(tokens=tok + 10000)
    with pytest.raises(ValueError, match="temperature must be"):
        fused_is.linear_token_logprobs(h, w, tok, temperature=0.0)
    # head_dtype reconciles mixed dtypes: fp32 master weight with bf16 hidden states
    out = call(hidden=h.bfloat16(), head_dtype=torch.float32, sampler_logprobs=li.inputs.sampler_logprobs,
               old_logprobs=li.inputs.old_logprobs, mask=li.inputs.mask)
    assert torch.isfinite(out.loss)


def test_inside_torch_compile_runs_eagerly():
    """Under torch.compile the function is a graph break (torch.compiler.disable) and gives the eager result."""
    li = make_linear_inputs("padded", seed=15)

    def step(hidden, weight):
        out = fused_is.linear_policy_loss(hidden, weight, li.inputs.tokens, li.inputs.advantages, bias=li.bias,
                                          chunk_size=CHUNK, backend="torch", **li.inputs.kwargs())
        return out.loss * 2.0

    grads = []
    for fn in (step, torch.compile(step, backend="eager")):
        hidden, weight = li.hidden.clone().requires_grad_(), li.weight.clone().requires_grad_()
        fn(hidden, weight).backward()
        grads.append((hidden.grad, weight.grad))
    assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][1], grads[1][1])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_weight_gradient_in_vocabulary_blocks(dtype, monkeypatch):
    """The CPU path of d weight (no GEMM that accumulates into fp32): the product goes block by block of the
    vocabulary through a small temporary; blocks of 7 rows (a ragged last block) give the one-block result."""
    import fused_is.linear as linear

    li = make_linear_inputs("packed", dtype=dtype, seed=16)
    one_block, one_grads = run_linear(li, "ppo_tis", "torch")
    monkeypatch.setattr(linear, "PRODUCT_BLOCK_BYTES", 7 * li.weight.shape[1] * li.weight.element_size())
    blocks, block_grads = run_linear(li, "ppo_tis", "torch")
    assert torch.equal(blocks.loss, one_block.loss)
    for a, b in zip(block_grads, one_grads):
        assert_close("grad", a, b, 1e-2)  # the products' bf16/fp16 rounding may differ with the GEMM's shape
    check_linear(li, config_for("ppo_tis"), "torch", head_dtype=None)


@pytest.mark.parametrize("backend", BACKENDS)
def test_given_is_weights(backend):
    """The caller's is_weights on the fused linear path, against the reference on the same values."""
    li = make_linear_inputs("packed", seed=11)
    w = torch.rand(li.inputs.tokens.shape, generator=torch.Generator().manual_seed(11), dtype=torch.float64) * 2
    out, _, _, _ = check_linear(li, config_for("ppo", dict(loss_agg="seq-mean-token-mean")), backend, is_weights=w)
    assert "is_weight_mean" in out.metrics
