"""Per-sequence and per-token temperatures (`temperature=` of policy_loss, token_logprobs and the fused-linear
functions; verl's per-sample temperature): every backend against the float64 reference of the logits divided
row by row beforehand, the way a trainer divides them (z / tau_t, differentiated through the division), so the
expected values come from a path that never sees a per-row temperature."""

import dataclasses

import pytest
import torch

import fused_is
from fused_is import backends

from cases import (CHUNK, assert_close, assert_outputs_close, config_for, logprob_scale, loss_scale, make_inputs,
                   make_linear_inputs, tolerance)

BACKENDS = [b for b in backends.available_backends() if b != "reference"]

# one-pass, two-pass (sequence IS with old=None: the stats pass sees the temperatures too), GSPO's given
# coefficients, and the entropy bonus with a KL term (h_t and the 1/tau of the gradient sweep)
CASES = [
    ("ppo_tis", None, True),
    ("seq_tis", None, False),
    ("ppo", dict(ratio_level="sequence", clip_low=0.02, clip_high=0.03), True),
    ("ppo_tis", dict(entropy_coef=0.05, kl_coef=0.1), True),
]


def _temperatures(inputs, per: str, seed: int) -> torch.Tensor:
    """Temperatures in [0.4, 1.6]: one per sequence ([B] padded, [S] packed) or one per token."""
    gen = torch.Generator().manual_seed(seed)
    if per == "token":
        shape = inputs.tokens.shape
    elif inputs.cu_seqlens is None:
        shape = inputs.tokens.shape[:1]
    else:
        shape = (inputs.cu_seqlens.numel() - 1,)
    return (0.4 + 1.2 * torch.rand(shape, generator=gen, dtype=torch.float64)).float()


def _per_row(inputs, tau: torch.Tensor) -> torch.Tensor:
    """tau expanded to the tokens' shape, written out from the layout (not fused_is's expansion)."""
    if tau.shape == inputs.tokens.shape:
        return tau
    if inputs.cu_seqlens is None:
        return tau[:, None].expand(inputs.tokens.shape)
    lengths = inputs.cu_seqlens.diff()
    return torch.repeat_interleave(tau, lengths)


def _divided_reference(inputs, tau, config, with_old=True, grad_scale=1.7):
    """The float64 reference on logits / tau_t (a row each), differentiated through the division."""
    leaf = inputs.logits.detach().double().requires_grad_()
    divided = leaf / _per_row(inputs, tau).double().unsqueeze(-1)
    kwargs = inputs.kwargs(with_old=with_old)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        ref = fused_is.policy_loss(divided, inputs.tokens, inputs.advantages, config=config, backend="reference",
                                   **kwargs)
    (ref.loss * grad_scale).backward()
    scale_inputs = dataclasses.replace(inputs, logits=divided.detach())
    scale = max(abs(ref.loss.item()), loss_scale(scale_inputs, config, with_old=with_old))
    return ref, leaf.grad, scale


def _check(inputs, tau, config, backend, with_old=True, grad_scale=1.7):
    if backend == "reference":  # the oracle on float64 logits: to float64 rounding (fp32 logits: fp32 arithmetic)
        inputs = dataclasses.replace(inputs, logits=inputs.logits.double())
    ref, ref_grad, scale = _divided_reference(inputs, tau, config, with_old, grad_scale)
    leaf = inputs.logits.detach().clone().requires_grad_()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        out = fused_is.policy_loss(leaf, inputs.tokens, inputs.advantages, config=config, backend=backend,
                                   temperature=tau, **inputs.kwargs(with_old=with_old))
    (out.loss * grad_scale).backward()
    assert_outputs_close(out, leaf.grad, ref, ref_grad, inputs.mask, tolerance(inputs.logits.dtype, backend), scale)
    return out


@pytest.mark.parametrize("backend", BACKENDS + ["reference"])
@pytest.mark.parametrize("layout", ["padded", "packed"])
@pytest.mark.parametrize("per", ["sequence", "token"])
@pytest.mark.parametrize("case", range(len(CASES)), ids=["ppo_tis", "seq_tis_two_pass", "gspo", "entropy_kl"])
def test_per_row_temperature_equals_divided_logits(backend, layout, per, case):
    preset, overrides, with_old = CASES[case]
    inputs = make_inputs(layout, dtype=torch.float32, seed=70 + case)
    tau = _temperatures(inputs, per, seed=case)
    _check(inputs, tau, config_for(preset, overrides), backend, with_old=with_old)


@pytest.mark.parametrize("backend", BACKENDS)
def test_bf16_per_sequence(backend):
    inputs = make_inputs("padded", dtype=torch.bfloat16, seed=77)
    _check(inputs, _temperatures(inputs, "sequence", seed=5), config_for("ppo_tis", dict(entropy_coef=0.01)), backend)


@pytest.mark.parametrize("backend", BACKENDS + ["reference"])
def test_temperatures_change_the_result(backend):
    """Not a no-op: different temperatures per sequence give a loss other than any one temperature's."""
    inputs = make_inputs("padded", dtype=torch.float32, seed=78)
    tau = torch.tensor([0.5, 1.0, 1.5])
    varied = fused_is.policy_loss(inputs.logits, inputs.tokens, inputs.advantages, backend=backend, temperature=tau,
                                  **inputs.kwargs())
    for t in tau.tolist():
        one = fused_is.policy_loss(inputs.logits, inputs.tokens, inputs.advantages, backend=backend,
                                   config=config_for("ppo_tis", dict(temperature=t)), **inputs.kwargs())
        assert abs(float(one.loss) - float(varied.loss)) > 1e-4
        rows = tau == t
        torch.testing.assert_close(varied.logprobs[rows], one.logprobs[rows], rtol=0, atol=0)


@pytest.mark.parametrize("backend", BACKENDS + ["reference"])
def test_uniform_tensor_is_the_config_temperature_bit_for_bit(backend):
    """A float64 tensor of one value reaches the kernels as the config's float does: identical bits."""
    inputs = make_inputs("packed", dtype=torch.float32, seed=79)
    cfg = config_for("seq_tis", dict(entropy_coef=0.02))
    outs = []
    for kwargs in (dict(config=dataclasses.replace(cfg, temperature=0.7)),
                   dict(config=cfg, temperature=torch.full((inputs.cu_seqlens.numel() - 1,), 0.7, dtype=torch.float64))):
        leaf = inputs.logits.detach().clone().requires_grad_()
        out = fused_is.policy_loss(leaf, inputs.tokens, inputs.advantages, backend=backend,
                                   **inputs.kwargs(with_old=False), **kwargs)
        out.loss.backward()
        outs.append((out.loss, out.logprobs, out.entropy, leaf.grad))
    for a, b in zip(*outs):
        assert torch.equal(a, b)


@pytest.mark.parametrize("backend", BACKENDS + ["reference"])
@pytest.mark.parametrize("per", ["sequence", "token"])
def test_token_logprobs(backend, per):
    inputs = make_inputs("padded", dtype=torch.bfloat16, seed=80)
    tau = _temperatures(inputs, per, seed=9)
    tokens = inputs.tokens.clamp(min=0)
    lp, ent = fused_is.token_logprobs(inputs.logits, tokens, temperature=tau, backend=backend)
    divided = inputs.logits.double() / _per_row(inputs, tau).double().unsqueeze(-1)
    ref_lp, ref_ent = fused_is.token_logprobs(divided, tokens, backend="reference")
    assert_close("token_logprobs", lp, ref_lp, 1e-6, scale=logprob_scale(ref_lp))
    assert_close("token_entropy", ent, ref_ent, 1e-6, scale=logprob_scale(ref_ent))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_linear_policy_loss(backend, layout):
    """The fused-linear path (chunks of 5 rows splitting sequences) against the reference of its product divided
    row by row: loss and the gradients of hidden, weight and bias."""
    li = make_linear_inputs(layout, dtype=torch.float32, seed=81)
    tau = _temperatures(li.inputs, "sequence", seed=11)
    cfg = config_for("seq_tis", dict(entropy_coef=0.02))
    per_row = _per_row(li.inputs, tau).double().unsqueeze(-1)
    leaves = [x.detach().clone().requires_grad_() for x in (li.hidden, li.weight, li.bias)]
    ref_leaves = [x.detach().double().requires_grad_() for x in (li.hidden, li.weight, li.bias)]
    logits = (ref_leaves[0] @ ref_leaves[1].t() + ref_leaves[2]) / per_row
    ref = fused_is.policy_loss(logits, li.inputs.tokens, li.inputs.advantages, config=cfg, backend="reference",
                               **li.inputs.kwargs(with_old=False))
    ref.loss.backward()
    out = fused_is.linear_policy_loss(leaves[0], leaves[1], li.inputs.tokens, li.inputs.advantages, bias=leaves[2],
                                      config=cfg, backend=backend, chunk_size=CHUNK, temperature=tau,
                                      **li.inputs.kwargs(with_old=False))
    out.loss.backward()
    tol = 1e-5
    assert_close("loss", out.loss, ref.loss, tol, scale=max(1.0, abs(float(ref.loss.detach()))))
    for name, leaf, ref_leaf in zip(("hidden", "weight", "bias"), leaves, ref_leaves):
        assert_close(f"grad_{name}", leaf.grad, ref_leaf.grad, tol)
    lp, ent = fused_is.linear_token_logprobs(li.hidden, li.weight, li.inputs.tokens.clamp(min=0), bias=li.bias,
                                             temperature=tau if layout == "padded" else _per_row(li.inputs, tau),
                                             backend=backend, chunk_size=CHUNK)
    ref_lp, ref_ent = fused_is.token_logprobs(logits.detach(), li.inputs.tokens.clamp(min=0), backend="reference")
    assert_close("linear_token_logprobs", lp, ref_lp, 1e-6, scale=logprob_scale(ref_lp))
    assert_close("linear_token_entropy", ent, ref_ent, 1e-6, scale=logprob_scale(ref_ent))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_vocabulary_shards_in_process(backend, layout, monkeypatch):
    """The vocabulary-parallel path (shard statistics combined with each row's 1/tau, then each shard's gradient
    sweep) with per-token temperatures, the collectives replaced by their result in this process, against the
    single-process run on the whole vocabulary."""
    from test_distributed import check_shards_in_process

    inputs = make_inputs(layout, dtype=torch.float32, seed=87, vocab=300)
    tau = _temperatures(inputs, "token", seed=4)
    check_shards_in_process(inputs, config_for("seq_tis", dict(entropy_coef=0.02)), backend, [120, 180], monkeypatch,
                            with_old=False, temperature=tau)


@pytest.mark.parametrize("backend", BACKENDS + ["reference"])
def test_masked_rows_may_hold_any_temperature(backend):
    """A masked position's unusable temperature (0, inf, NaN) is never an error and changes nothing at the unmasked
    ones: loss, gradient and logprobs there equal those of a run with ordinary temperatures at the masked rows."""
    inputs = make_inputs("padded", dtype=torch.float64 if backend == "reference" else torch.float32, seed=82)
    tau = _temperatures(inputs, "token", seed=3)
    bad = tau.clone()
    masked = ~inputs.mask
    bad[masked] = torch.tensor([0.0, float("inf"), float("nan")]).repeat(int(masked.sum()))[: int(masked.sum())]
    outs = []
    for t in (tau, bad):
        leaf = inputs.logits.clone().requires_grad_()
        out = fused_is.policy_loss(leaf, inputs.tokens, inputs.advantages, backend=backend, temperature=t,
                                   **inputs.kwargs())
        out.loss.backward()
        outs.append((out, leaf.grad))
    (a, grad_a), (b, grad_b) = outs
    assert torch.equal(a.loss, b.loss)
    assert torch.equal(a.logprobs[inputs.mask], b.logprobs[inputs.mask])
    assert torch.equal(grad_a[inputs.mask], grad_b[inputs.mask]) and not grad_b[masked].any()


def test_argument_errors():
    inputs = make_inputs("padded", dtype=torch.float32, seed=83)
    call = lambda **kw: fused_is.policy_loss(inputs.logits, inputs.tokens, inputs.advantages,  # noqa: E731
                                             **inputs.kwargs(), **kw)
    with pytest.raises(TypeError, match="temperature= takes per-sequence or per-token temperatures"):
        call(temperature=0.7)
    with pytest.raises(TypeError, match="temperature must be a positive number or a floating-point"):
        call(temperature=torch.ones(3, dtype=torch.long))
    with pytest.raises(ValueError, match="replaces LossConfig.temperature"):
        call(temperature=torch.ones(3), config=config_for("ppo_tis", dict(temperature=0.7)))
    with pytest.raises(ValueError, match=r"temperature must be a number, or a tensor of shape \(3, 8\) or \[3\]"):
        call(temperature=torch.ones(4))
    tau = torch.ones(3)
    tau[1] = 0.0
    with pytest.raises(ValueError, match=r"temperature must be positive and finite \(>= 1e-08\) at unmasked"):
        call(temperature=tau)
    tau[1] = 1e-40  # positive, but 1 / tau overflows fp32 (and -1e30 / tau the kernels' stand-in for -inf)
    with pytest.raises(ValueError, match="temperature must be positive and finite"):
        call(temperature=tau)
    tau[1] = float("inf")
    with pytest.raises(ValueError, match="temperature must be positive and finite"):
        call(temperature=tau)
    with pytest.raises(RuntimeError, match="temperature must be positive and finite"):
        call(temperature=tau, validate="async")
    packed = make_inputs("packed", dtype=torch.float32, seed=84)
    with pytest.raises(ValueError, match=r"or \[3\] per sequence \(cu_seqlens\)"):
        fused_is.policy_loss(packed.logits, packed.tokens, packed.advantages, **packed.kwargs(),
                             temperature=torch.ones(4))
    with pytest.raises(ValueError, match="temperature must be positive and finite"):
        fused_is.token_logprobs(inputs.logits, inputs.tokens.clamp(min=0), temperature=-torch.ones(3))
    with pytest.raises(ValueError, match="temperature must be a positive number"):
        fused_is.token_logprobs(inputs.logits, inputs.tokens.clamp(min=0), temperature=0.0)
    with pytest.raises(ValueError, match="temperature must be >= 1e-08"):
        fused_is.token_logprobs(inputs.logits, inputs.tokens.clamp(min=0), temperature=1e-40)
    with pytest.raises(ValueError, match="LossConfig.temperature must be >= 1e-08"):
        config_for("ppo_tis", dict(temperature=1e-40))
    with pytest.raises(ValueError, match="one temperature for every row: pass a float"):
        fused_is.token_logprobs(inputs.logits, inputs.tokens.clamp(min=0), temperature=torch.tensor(0.7))


@pytest.mark.parametrize("backend", BACKENDS + ["reference"])
def test_no_gradient_reaches_the_temperatures(backend):
    inputs = make_inputs("padded", dtype=torch.float64 if backend == "reference" else torch.float32, seed=86)
    tau = torch.tensor([0.6, 1.0, 1.4], requires_grad=True)
    leaf = inputs.logits.clone().requires_grad_()
    fused_is.policy_loss(leaf, inputs.tokens, inputs.advantages, backend=backend, temperature=tau,
                         **inputs.kwargs()).loss.backward()
    assert leaf.grad is not None and tau.grad is None


@pytest.mark.parametrize("backend", [b for b in ("cpu", "torch", "triton") if b in BACKENDS])
def test_under_torch_compile(backend):
    """The temperatures are traced with the call (per-row tensors into the kernel-level ops) and give the eager
    result."""
    torch._dynamo.reset()
    inputs = make_inputs("padded", dtype=torch.float32, seed=85, vocab=300)
    tau = _temperatures(inputs, "sequence", seed=2)

    def fn(logits):
        return fused_is.policy_loss(logits, inputs.tokens, inputs.advantages, backend=backend, temperature=tau,
                                    **inputs.kwargs()).loss

    results = []
    for f in (fn, torch.compile(fn, fullgraph=True, backend="aot_eager")):
        x = inputs.logits.detach().clone().requires_grad_()
        loss = f(x)
        loss.backward()
        results.append((loss.detach(), x.grad))
    torch.testing.assert_close(results[1][0], results[0][0], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(results[1][1], results[0][1], rtol=1e-5, atol=1e-7)


def test_per_sequence_temperature_when_sequences_number_the_tokens():
    """Packed input with as many sequences as tokens (some empty): [N] reads per token, with a warning that says
    how to mean per sequence ([S, 1]); [S, 1] reads per sequence; both equal an explicit per-token expansion."""
    torch.manual_seed(3)
    logits, tokens, adv = torch.randn(4, 12), torch.randint(0, 12, (4,)), torch.ones(4)
    cu = torch.tensor([0, 2, 4, 4, 4])  # S = 4 = N, two sequences empty
    tau = torch.tensor([0.5, 1.0, 2.0, 3.0])
    with torch.no_grad():
        with pytest.warns(UserWarning, match=r"read per token.*pass it as \[4, 1\]"):
            per_token = fused_is.policy_loss(logits, tokens, adv, cu_seqlens=cu, temperature=tau, config="ppo")
        per_seq = fused_is.policy_loss(logits, tokens, adv, cu_seqlens=cu, temperature=tau[:, None], config="ppo")
        expanded = fused_is.policy_loss(logits, tokens, adv, temperature=torch.tensor([0.5, 0.5, 1.0, 1.0]),
                                        config="ppo")
    ref = torch.log_softmax(logits / tau[:, None], -1).gather(1, tokens[:, None])[:, 0]
    torch.testing.assert_close(per_token.logprobs, ref)
    torch.testing.assert_close(per_seq.logprobs, expanded.logprobs)
