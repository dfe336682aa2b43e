"""fused_is.linear_policy_loss / linear_token_logprobs against the float64 reference of section 2 applied to
logits = hidden.double() @ weight.double().T + bias: loss, logprobs, entropy, metrics and the gradients
of hidden, weight and bias, on fresh random inputs, with chunk boundaries that split sequences; masked rows (which
the gradient sweep leaves out) and the logits_dtype= keyword (head_dtype= its deprecated name) at the end."""

from __future__ import annotations

import dataclasses
import zlib

import pytest
import torch

import fused_is
import fused_is.linear as linear
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


@pytest.mark.parametrize("logits_dtype", [None, torch.float32])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("backend", BACKENDS)
def test_low_precision_inputs_and_fp32_head(backend, dtype, logits_dtype):
    li = make_linear_inputs("padded", dtype=dtype, seed=3)
    check_linear(li, config_for("ppo_tis", dict(kl_coef=0.05, entropy_coef=0.01)), backend, logits_dtype=logits_dtype)


def test_fp32_head_is_closer_than_the_bf16_head():
    """The point of logits_dtype=torch.float32: logprobs exact to fp32 instead of to the bf16 rounding of the logits."""
    li = make_linear_inputs("padded", dtype=torch.bfloat16, seed=5)
    ref, _ = run_linear(li, "ppo_tis", "reference")
    errors = {}
    for head in (None, torch.float32):
        out, _ = run_linear(li, "ppo_tis", "cpu" if "cpu" in BACKENDS else "torch", logits_dtype=head)
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
    """validate="async" reads nothing on the host, so its gradient sweep takes every row, where "full" gathers the
    unmasked rows (finding them is a host read): the same results up to the GEMMs' rounding of other chunks, and
    bitwise the same when no row is masked (both sweep the same chunks)."""
    li = make_linear_inputs("packed", seed=13)
    full, full_grads = run_linear(li, "seq_tis", "torch", with_old=False)
    fast, fast_grads = run_linear(li, "seq_tis", "torch", with_old=False, validate="async")
    assert_close("loss", fast.loss, full.loss, 1e-6)
    assert all(isinstance(v, torch.Tensor) for v in fast.metrics.values())
    for a, b in zip(full_grads, fast_grads):
        assert_close("grad", b, a, 1e-6)
    clean = _with_mask(li, "none")
    full, full_grads = run_linear(clean, "seq_tis", "torch", with_old=False)
    fast, fast_grads = run_linear(clean, "seq_tis", "torch", with_old=False, validate="async")
    assert torch.equal(full.loss, fast.loss)
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
    with pytest.raises(TypeError, match="pass logits_dtype="):
        call(weight=w.bfloat16())
    with pytest.raises(TypeError, match="logits_dtype must be"):
        call(logits_dtype=torch.int32)
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
    # logits_dtype reconciles mixed dtypes: fp32 master weight with bf16 hidden states
    out = call(hidden=h.bfloat16(), logits_dtype=torch.float32, sampler_logprobs=li.inputs.sampler_logprobs,
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
    check_linear(li, config_for("ppo_tis"), "torch", logits_dtype=None)


@pytest.mark.parametrize("backend", BACKENDS)
def test_given_is_weights(backend):
    """The caller's is_weights on the fused linear path, against the reference on the same values."""
    li = make_linear_inputs("packed", seed=11)
    w = torch.rand(li.inputs.tokens.shape, generator=torch.Generator().manual_seed(11), dtype=torch.float64) * 2
    out, _, _, _ = check_linear(li, config_for("ppo", dict(loss_agg="seq-mean-token-mean")), backend, is_weights=w)
    assert "is_weight_mean" in out.metrics


# --- masked rows: the gradient sweep gathers the unmasked rows alone (fused_is/linear.py split_rows) ----------------

def _with_mask(li: LinearInputs, kind: str) -> LinearInputs:
    """li with another mask: "none" (no row masked; the garbage of row 1 made valid), "half" / "most" (50% / 90% at
    random, row 1 among them), "chunk" (rows 5-9 masked: a whole chunk of CHUNK rows), "all", or "prompts" (each
    sequence's first half masked, as a prompt is)."""
    inputs = li.inputs
    flat = inputs.mask.reshape(-1)
    if kind == "none":
        tokens, samp, old = inputs.tokens.clone(), inputs.sampler_logprobs.clone(), inputs.old_logprobs.clone()
        tokens.view(-1)[1], samp.view(-1)[1], old.view(-1)[1] = 0, -1.0, -1.0
        inputs = dataclasses.replace(inputs, tokens=tokens, sampler_logprobs=samp, old_logprobs=old)
        mask = torch.ones_like(flat)
    elif kind in ("half", "most"):
        mask = torch.rand(flat.shape, generator=torch.Generator().manual_seed(5)) >= (0.5 if kind == "half" else 0.9)
    elif kind == "chunk":
        mask = flat.clone()
        mask[5:10] = False
    elif kind == "all":
        mask = torch.zeros_like(flat)
    else:  # prompts: the first half of every sequence (packed: between the cu_seqlens; padded: each row)
        bounds = (inputs.cu_seqlens.tolist() if inputs.cu_seqlens is not None
                  else list(range(0, flat.numel() + 1, inputs.mask.shape[-1])))
        mask = torch.ones_like(flat)
        for start, stop in zip(bounds[:-1], bounds[1:]):
            mask[start:start + (stop - start + 1) // 2] = False
    if kind != "none":
        mask[1] = False  # row 1's garbage (token -100, NaN and inf logprobs) stays masked
    inputs = dataclasses.replace(inputs, mask=mask.reshape(inputs.mask.shape))
    return LinearInputs(li.hidden, li.weight, li.bias, inputs)


def _check_masked_rows(li: LinearInputs, config, backend: str, with_old: bool):
    """check_linear (entropy compared at every row), the logprobs of the masked rows against the reference's too
    (as policy_loss gives them: their logits are still formed), and d hidden exactly 0 at the masked rows."""
    out, grads, ref, _ = check_linear(li, config, backend, with_old=with_old)
    masked = ~li.inputs.mask
    assert_close("logprobs at masked rows", out.logprobs, ref.logprobs, 1e-6, mask=masked, scale=20.0)
    assert_close("entropy at masked rows", out.entropy, ref.entropy, 1e-6, mask=masked, scale=10.0)
    assert torch.count_nonzero(grads[0][masked]) == 0
    return out, grads


@pytest.mark.parametrize("config,with_old", [("ppo_tis", True), ("seq_tis", False)], ids=["one_pass", "two_pass"])
@pytest.mark.parametrize("kind", ["none", "half", "most", "chunk", "all"])
def test_masked_rows_against_reference(kind, config, with_old):
    """0%, 50% and 90% of the rows masked, a whole chunk masked and every row masked, in the one-pass plan (the
    masked rows' statistics from their own chunks) and the two-pass plan (from the stats pass)."""
    li = _with_mask(make_linear_inputs("padded", seed=17), kind)
    if kind == "all":
        out, grads = run_linear(li, config, "cpu")
        assert out.loss.item() == 0.0 and all(torch.count_nonzero(g) == 0 for g in grads)
        ref, _ = run_linear(li, config, "reference")
        assert_close("entropy", out.entropy, ref.entropy, 1e-6, scale=10.0)
        return
    _check_masked_rows(li, config_for(config), "cpu", with_old)


@pytest.mark.parametrize("config,with_old", [
    ("seq_tis", False),
    (config_for("ppo", dict(policy="gmpo", clip_low=0.1, clip_high=0.1, loss_agg="seq-mean-token-mean")), True),
    (config_for("ppo_tis", dict(loss_agg="seq-mean-token-sum", entropy_coef=0.01, kl_coef=0.1)), True),
], ids=["seq_tis", "gmpo", "seq_sum_entropy_kl"])
def test_packed_prompts_masked(config, with_old):
    """Packed sequences of 10, 7, 4 and 1 tokens whose prompts (first halves) are masked, with sequence-level
    coefficients and aggregations: the last sequence holds no unmasked token."""
    li = _with_mask(make_linear_inputs("packed", batch=4, seq_len=10, seed=19), "prompts")
    _check_masked_rows(li, config, "torch", with_old)


@pytest.mark.skipif("triton" not in BACKENDS, reason="triton unavailable")
def test_masked_rows_triton():
    li = _with_mask(make_linear_inputs("packed", seed=23), "half")
    _check_masked_rows(li, config_for("ppo_tis", dict(entropy_coef=0.01)), "triton", True)
    check_linear(li, config_for("seq_tis", dict(entropy_coef=0.01)), "triton", with_old=False, masked_outputs="zero")


def _record_rows(monkeypatch):
    """{"formed": the rows of each chunk whose logits the head GEMM forms, "taken": those of each chunk whose
    gradient goes into d hidden, d weight and d bias (the two other GEMMs)}, recorded from now on."""
    seen = {"formed": [], "taken": []}
    logits, add = linear.Head.logits, linear.HeadGrads.add

    def indices(rows):
        return list(range(rows.start, rows.stop)) if isinstance(rows, slice) else rows.tolist()

    def formed(self, rows):
        seen["formed"].append(indices(rows))
        return logits(self, rows)

    def taken(self, rows, dlogits, valid):
        seen["taken"].append(indices(rows))
        return add(self, rows, dlogits, valid)

    monkeypatch.setattr(linear.Head, "logits", formed)
    monkeypatch.setattr(linear.HeadGrads, "add", taken)
    return seen


@pytest.mark.parametrize("config,with_old", [("ppo_tis", True), ("seq_tis", False)], ids=["one_pass", "two_pass"])
def test_the_gradient_sweep_forms_the_unmasked_rows_alone(config, with_old, monkeypatch):
    """With 90% of the rows masked, the gradient sweep forms and differentiates the unmasked rows alone, each once,
    in chunks of at most chunk_size gathered rows; a masked row's logits are formed once, for its logprob and
    entropy (in the one-pass plan by a statistics sweep of their own, in the two-pass plan by the stats pass)."""
    li = _with_mask(make_linear_inputs("padded", seed=17), "most")
    valid = li.inputs.mask.reshape(-1)
    unmasked, every = valid.nonzero().squeeze(1).tolist(), list(range(valid.numel()))
    assert 0 < len(unmasked) < valid.numel() // 4
    seen = _record_rows(monkeypatch)
    run_linear(li, config, "torch", with_old=with_old)
    assert sorted(sum(seen["taken"], [])) == unmasked
    formed = sorted(sum(seen["formed"], []))
    assert formed == (every if config == "ppo_tis" else sorted(every + unmasked))
    assert all(len(rows) <= CHUNK for rows in seen["formed"])
    # linear_logprobs: forward every row (its outputs), backward the unmasked rows alone
    leaves = [x.clone().requires_grad_() for x in (li.hidden, li.weight, li.bias)]
    seen["formed"].clear()
    lp, entropy = fused_is.linear_logprobs(leaves[0], leaves[1], li.inputs.tokens, bias=leaves[2],
                                           mask=li.inputs.mask, chunk_size=CHUNK, backend="torch")
    assert sorted(sum(seen["formed"], [])) == every
    seen["formed"].clear()
    seen["taken"].clear()
    (lp.sum() - 0.5 * entropy.sum()).backward()
    assert sorted(sum(seen["formed"], [])) == unmasked and sorted(sum(seen["taken"], [])) == unmasked
    assert torch.count_nonzero(leaves[0].grad[~li.inputs.mask]) == 0
    # validate="async" reads nothing on the host: its gradient sweep takes every row
    seen["taken"].clear()
    run_linear(li, config, "torch", with_old=with_old, validate="async")
    assert sorted(sum(seen["taken"], [])) == every


def test_linear_logprobs_masked_rows_against_reference():
    """linear_logprobs with half the rows masked: forward's lp and H at every row as the reference's, backward from
    the unmasked rows alone (d hidden exactly 0 at the masked ones) equal to the reference's gradients."""
    li = _with_mask(make_linear_inputs("packed", seed=29), "half")
    mask = li.inputs.mask
    upstream = torch.randn(2, *mask.shape, generator=torch.Generator().manual_seed(29))

    def run(backend):
        leaves = [x.double().clone().requires_grad_() if backend == "reference" else x.clone().requires_grad_()
                  for x in (li.hidden, li.weight, li.bias)]
        lp, entropy = fused_is.linear_logprobs(leaves[0], leaves[1], li.inputs.tokens, bias=leaves[2], mask=mask,
                                               temperature=0.8, chunk_size=CHUNK, backend=backend)
        ((lp * upstream[0]).sum() + (entropy * upstream[1]).sum()).backward()
        return lp, entropy, [x.grad for x in leaves]

    ref_lp, ref_h, ref_grads = run("reference")
    lp, entropy, grads = run("cpu")
    assert_close("lp", lp, ref_lp, 1e-5, scale=20.0)
    assert_close("entropy", entropy, ref_h, 1e-5, scale=10.0)
    for name, got, want in zip(("hidden", "weight", "bias"), grads, ref_grads):
        assert_close(f"d {name}", got, want, 1e-5)
    assert torch.count_nonzero(grads[0][~mask]) == 0


@pytest.mark.parametrize("config,with_old,passes", [
    ("ppo_tis", True, 1),
    ("seq_tis", False, 2),
    (config_for("ppo", dict(policy="gmpo", clip_low=0.1, clip_high=0.1, loss_agg="seq-mean-token-mean")), True, 2),
    (config_for("ppo_tis", dict(loss_agg="seq-mean-token-sum", entropy_coef=0.01, kl_coef=0.1)), True, 1),
], ids=["one_pass", "two_pass", "gmpo", "seq_sum_entropy_kl"])
def test_masked_outputs_zero_forms_the_unmasked_rows_alone(config, with_old, passes, monkeypatch):
    """masked_outputs="zero" with 90% of the rows masked: no GEMM forms a masked row's logits (the one-pass plan forms
    each unmasked row once, the two-pass plan twice), logprobs and entropy are 0 at the masked rows and the same as
    with "formed" elsewhere, and the loss, the three gradients and the metrics are those of "formed"."""
    li = _with_mask(make_linear_inputs("padded", seed=41), "most")
    valid = li.inputs.mask.reshape(-1)
    unmasked = valid.nonzero().squeeze(1).tolist()
    assert 0 < len(unmasked) < valid.numel() // 4
    formed, formed_grads = run_linear(li, config, "torch", with_old=with_old)
    seen = _record_rows(monkeypatch)
    zero, zero_grads = run_linear(li, config, "torch", with_old=with_old, masked_outputs="zero")
    assert sorted(sum(seen["formed"], [])) == sorted(unmasked * passes)
    assert sorted(sum(seen["taken"], [])) == unmasked
    mask = li.inputs.mask
    for name in ("logprobs", "entropy"):
        got, want = getattr(zero, name), getattr(formed, name)
        assert torch.count_nonzero(got[~mask]) == 0, name
        assert torch.equal(got[mask], want[mask]), name
    torch.testing.assert_close(zero.loss, formed.loss, rtol=1e-12, atol=0)
    for got, want in zip(zero_grads, formed_grads):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    assert zero.metrics.keys() == formed.metrics.keys()
    for key, value in formed.metrics.items():
        assert zero.metrics[key] == pytest.approx(value, rel=1e-9, abs=1e-12), key
    # and against the float64 reference, which zeroes the masked rows' outputs alike
    check_linear(li, config, "cpu", with_old=with_old, masked_outputs="zero")


def test_masked_outputs_zero_logprob_functions(monkeypatch):
    """linear_token_logprobs and linear_logprobs with masked_outputs="zero": the masked rows' logits never formed,
    0 there, the rest equal to "formed"; linear_logprobs' gradients unchanged; validate="async" forms every row and
    writes the 0s all the same; any other value is a ValueError naming the argument."""
    li = _with_mask(make_linear_inputs("packed", seed=43), "half")
    mask = li.inputs.mask
    unmasked = mask.reshape(-1).nonzero().squeeze(1).tolist()
    h, w, b, tokens = li.hidden, li.weight, li.bias, li.inputs.tokens
    upstream = torch.randn(2, *mask.shape, generator=torch.Generator().manual_seed(43))

    def run(masked_outputs):
        leaves = [x.clone().requires_grad_() for x in (h, w, b)]
        lp, entropy = fused_is.linear_logprobs(leaves[0], leaves[1], tokens, bias=leaves[2], mask=mask,
                                               chunk_size=CHUNK, backend="cpu", masked_outputs=masked_outputs)
        ((lp * upstream[0]).sum() + (entropy * upstream[1]).sum()).backward()
        return lp, entropy, [x.grad for x in leaves]

    lp_f, h_f, grads_f = run("formed")
    seen = _record_rows(monkeypatch)
    lp_z, h_z, grads_z = run("zero")
    assert sorted(sum(seen["formed"], [])) == sorted(unmasked * 2)  # forward, then backward
    for got, want in ((lp_z, lp_f), (h_z, h_f)):
        assert torch.count_nonzero(got[~mask]) == 0 and torch.equal(got[mask], want[mask])
    for got, want in zip(grads_z, grads_f):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    for validate in ("full", "async"):
        seen["formed"].clear()
        with torch.no_grad():
            tlp, th = fused_is.linear_token_logprobs(h, w, tokens, bias=b, mask=mask, chunk_size=CHUNK, backend="cpu",
                                                     validate=validate, masked_outputs="zero")
        rows = sorted(sum(seen["formed"], []))
        assert rows == (unmasked if validate == "full" else list(range(mask.numel())))
        assert torch.count_nonzero(tlp[~mask]) + torch.count_nonzero(th[~mask]) == 0
        torch.testing.assert_close(tlp[mask], lp_f[mask].detach(), rtol=1e-6, atol=1e-6)
    for call in (lambda: fused_is.linear_token_logprobs(h, w, tokens, masked_outputs="skip"),
                 lambda: fused_is.linear_logprobs(h, w, tokens, masked_outputs=None),
                 lambda: run_linear(li, "ppo_tis", "cpu", masked_outputs="zeros")):
        with pytest.raises(ValueError, match="masked_outputs"):
            call()


def test_logits_dtype_and_its_deprecated_name():
    """logits_dtype= is the dtype the GEMM forms the logits in; head_dtype=, its old name on the fused-linear
    functions, gives the same result with a DeprecationWarning at the caller's line; both at once is a TypeError."""
    li = make_linear_inputs("padded", dtype=torch.bfloat16, seed=3)
    h, w, b, tokens, mask = li.hidden, li.weight, li.bias, li.inputs.tokens, li.inputs.mask
    calls = {
        "linear_policy_loss": lambda **kw: fused_is.linear_policy_loss(
            h, w, tokens, li.inputs.advantages, bias=b, chunk_size=CHUNK, **li.inputs.kwargs(), **kw)[:3],
        "linear_token_logprobs": lambda **kw: fused_is.linear_token_logprobs(h, w, tokens, bias=b, mask=mask, **kw),
        "linear_logprobs": lambda **kw: fused_is.linear_logprobs(h, w, tokens, bias=b, mask=mask, **kw),
    }
    for name, call in calls.items():
        new = call(logits_dtype=torch.float32)
        with pytest.warns(DeprecationWarning, match=rf"{name}\(head_dtype=\) is deprecated.*logits_dtype=") as caught:
            old = call(head_dtype=torch.float32)
        assert caught[0].filename == __file__, caught[0].filename
        assert new[0].dtype == torch.float32 and all(torch.equal(x, y) for x, y in zip(new, old)), name
        with pytest.raises(TypeError, match=f"{name}: logits_dtype= and head_dtype= are both given"):
            call(logits_dtype=torch.float32, head_dtype=torch.float32)
    with pytest.raises(TypeError, match="logits_dtype must be"):
        fused_is.linear_token_logprobs(h, w, tokens, logits_dtype=torch.int32)
