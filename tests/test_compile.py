"""torch.compile(fullgraph=True) of loss functions that call fused_is.policy_loss, logprobs and token_logprobs:
traced around the kernel-level ops of fused_is/ops.py.

On this CPU the ops run the kernels that exist here (cpu, torch, triton under the interpreter); on a GPU
the gpu-marked tests compile the same functions with backend="triton" and "cuda" on CUDA tensors.
"""

import pytest
import torch

import fused_is
from fused_is import backends

from cases import make_inputs

CPU_BACKENDS = [b for b in ("cpu", "torch", "triton") if backends.unavailable_reason(b, torch.empty(1, 1)) is None]


def _loss_fn(backend, config):
    def fn(logits, tokens, adv, samp, old, mask):
        out = fused_is.policy_loss(logits, tokens, adv, sampler_logprobs=samp, old_logprobs=old, mask=mask,
                                   config=config, backend=backend)
        return out.loss * 2.0 + 0.0 * out.logprobs.sum(), out.metrics["entropy_mean"]
    return fn


def _check(backend, config, compile_backend, device="cpu", dtype=torch.float32):
    inputs = make_inputs("padded", dtype=dtype, seed=21, vocab=1000, device=device)
    args = (inputs.tokens, inputs.advantages, inputs.sampler_logprobs, inputs.old_logprobs, inputs.mask)
    fn = _loss_fn(backend, config)
    compiled = torch.compile(fn, fullgraph=True, backend=compile_backend)
    results = []
    for f in (fn, compiled):
        x = inputs.logits.detach().clone().requires_grad_()
        loss, ent = f(x, *args)
        loss.backward()
        results.append((loss.detach(), float(ent.detach() if torch.is_tensor(ent) else ent), x.grad))
    (loss_e, ent_e, grad_e), (loss_c, ent_c, grad_c) = results
    torch.testing.assert_close(loss_c, loss_e, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(grad_c.float(), grad_e.float(), rtol=1e-5, atol=1e-7)
    assert abs(ent_c - ent_e) <= 1e-6 * max(1.0, abs(ent_e))


# a config with tuple fields (rejection criteria) and the stats pass (off-policy mask) through the op's JSON
SECOND_CORRECTIONS = fused_is.LossConfig.preset("ppo_tis", rejection={"token_k1": (0.6, 1.8), "seq_max_k3": 0.5},
                                                off_policy_mask=0.05)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("config", ["ppo_tis", "seq_mis", SECOND_CORRECTIONS], ids=["ppo_tis", "seq_mis", "reject"])
def test_fullgraph_aot_eager(backend, config):
    torch._dynamo.reset()
    _check(backend, config, "aot_eager")


@pytest.mark.parametrize("backend", [b for b in CPU_BACKENDS if b != "triton"])
def test_fullgraph_fp16_logits(backend):
    """fp16 logits (whose eager gradient is written in backward) under compile: the op hands back its gradient."""
    torch._dynamo.reset()
    inputs = make_inputs("padded", dtype=torch.float16, seed=22, vocab=300)
    args = (inputs.tokens, inputs.advantages, inputs.sampler_logprobs, inputs.old_logprobs, inputs.mask)
    fn = _loss_fn(backend, "ppo_tis")
    grads = []
    for f in (fn, torch.compile(fn, fullgraph=True, backend="aot_eager")):
        x = inputs.logits.detach().clone().requires_grad_()
        f(x, *args)[0].backward()
        grads.append(x.grad.float())
    torch.testing.assert_close(grads[1], grads[0], rtol=2e-3, atol=1e-4)


def test_fullgraph_inductor_cpu():
    """The default compiler (inductor) around the op, on the CPU kernel when built."""
    torch._dynamo.reset()
    _check(CPU_BACKENDS[0], "ppo_tis", "inductor")


def test_compile_refuses_inplace_and_reference():
    torch._dynamo.reset()
    inputs = make_inputs("padded", dtype=torch.float32, seed=22, vocab=100)

    def fn(logits, backend, inplace):
        return fused_is.policy_loss(logits, inputs.tokens, inputs.advantages, config="ppo", backend=backend,
                                    inplace=inplace).loss

    x = inputs.logits.clone().requires_grad_()
    with pytest.raises(Exception, match="inplace=True with torch.compile is not supported"):
        torch.compile(lambda t: fn(t, "torch", True), fullgraph=True, backend="aot_eager")(x)
    torch._dynamo.reset()
    with pytest.raises(Exception, match="backend='reference' with torch.compile is not supported"):
        torch.compile(lambda t: fn(t, "reference", False), fullgraph=True, backend="aot_eager")(x)


def test_op_validates_at_run_time():
    """Value checks (token range) still run inside the op: a bad id raises, not a silent result."""
    torch._dynamo.reset()
    inputs = make_inputs("padded", dtype=torch.float32, seed=23, vocab=100)
    bad = inputs.tokens.clone()
    bad[0, 0] = 100

    @torch.compile(fullgraph=True, backend="aot_eager")
    def fn(logits, tokens):
        return fused_is.policy_loss(logits, tokens, inputs.advantages, config="ppo", backend="torch").loss

    with pytest.raises(Exception, match="tokens must be ids in"):
        fn(inputs.logits.clone().requires_grad_(), bad)


@pytest.mark.gpu
@pytest.mark.cuda_only  # the CPU backends' compile tests above are this test's dry run
@pytest.mark.parametrize("backend", ["triton", "cuda"])
def test_fullgraph_on_gpu(backend):
    probe = torch.empty(1, 1, device="cuda")
    reason = backends.unavailable_reason(backend, probe)
    if reason is not None:
        pytest.skip(reason)
    torch._dynamo.reset()
    _check(backend, "ppo_tis", "inductor", device="cuda", dtype=torch.bfloat16)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_given_is_weights_under_compile(backend):
    """The caller's is_weights reach the op (an optional tensor argument) and give the eager result."""
    torch._dynamo.reset()
    inputs = make_inputs("padded", dtype=torch.float32, seed=24, vocab=300)
    w = torch.rand(inputs.tokens.shape, generator=torch.Generator().manual_seed(4)) * 2

    def fn(logits):
        out = fused_is.policy_loss(logits, inputs.tokens, inputs.advantages, old_logprobs=inputs.old_logprobs,
                                   mask=inputs.mask, config="ppo", backend=backend, is_weights=w)
        return out.loss, out.metrics["is_weight_mean"]

    results = []
    for f in (fn, torch.compile(fn, fullgraph=True, backend="aot_eager")):
        x = inputs.logits.detach().clone().requires_grad_()
        loss, mean_w = f(x)
        loss.backward()
        results.append((loss.detach(), float(mean_w), x.grad))
    (loss_e, w_e, grad_e), (loss_c, w_c, grad_c) = results
    torch.testing.assert_close(loss_c, loss_e, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(grad_c, grad_e, rtol=1e-5, atol=1e-7)
    assert abs(w_c - w_e) <= 1e-12


def _own_loss(backend, temperature):
    """A loss of the caller's own over fused logprobs (a clipped ratio, an entropy bonus, a squared log ratio)."""
    def fn(logits, tokens, old, adv, mask):
        lp, entropy = fused_is.logprobs(logits, tokens, mask=mask, temperature=temperature, backend=backend)
        ratio = torch.exp(lp - old)
        surrogate = -torch.minimum(ratio * adv, ratio.clamp(0.8, 1.2) * adv) + 0.1 * (lp - old) ** 2 - 0.01 * entropy
        return torch.where(mask > 0, surrogate, 0.0).sum() / mask.sum(), lp
    return fn


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("per_row", [False, True], ids=["tau", "tau_per_row"])
def test_logprobs_fullgraph(backend, per_row):
    """fused_is.logprobs traced by torch.compile(fullgraph=True) around the kernel-level ops (fused_is/ops.py): loss,
    logprobs and gradient equal the eager call's."""
    torch._dynamo.reset()
    inputs = make_inputs("padded", dtype=torch.float32, seed=25, vocab=500)
    temperature = (torch.rand(inputs.tokens.shape[0], generator=torch.Generator().manual_seed(5)) + 0.5
                   if per_row else 0.7)
    mask = inputs.mask.float()
    fn = _own_loss(backend, temperature)
    results = []
    for f in (fn, torch.compile(fn, fullgraph=True, backend="aot_eager")):
        x = inputs.logits.detach().clone().requires_grad_()
        loss, lp = f(x, inputs.tokens, inputs.old_logprobs.float(), inputs.advantages.float(), mask)
        loss.backward()
        results.append((loss.detach(), lp.detach(), x.grad))
    (loss_e, lp_e, grad_e), (loss_c, lp_c, grad_c) = results
    torch.testing.assert_close(loss_c, loss_e, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(lp_c[inputs.mask], lp_e[inputs.mask], rtol=0, atol=0)
    torch.testing.assert_close(grad_c, grad_e, rtol=1e-5, atol=1e-8)
    assert grad_c.abs().sum() > 0 and (grad_c[~inputs.mask] == 0).all()


def test_logprobs_inductor_and_run_time_checks():
    """The default compiler (inductor) around logprobs; the checks still run at run time: an id out of range and a
    NaN logit are ValueErrors, not silent results; what cannot be traced is refused by name."""
    torch._dynamo.reset()
    inputs = make_inputs("packed", dtype=torch.float32, seed=26, vocab=200)
    compiled = torch.compile(_own_loss(CPU_BACKENDS[0], 1.0), fullgraph=True)
    mask = inputs.mask.float()
    rest = (inputs.old_logprobs.float(), inputs.advantages.float(), mask)
    x = inputs.logits.detach().clone().requires_grad_()
    compiled(x, inputs.tokens, *rest)[0].backward()
    expected = inputs.logits.detach().clone().requires_grad_()
    _own_loss(CPU_BACKENDS[0], 1.0)(expected, inputs.tokens, *rest)[0].backward()
    torch.testing.assert_close(x.grad, expected.grad, rtol=1e-5, atol=1e-8)
    bad = inputs.tokens.clone()
    bad[inputs.mask.nonzero()[0, 0]] = 200
    with pytest.raises(ValueError, match=r"tokens must be ids in \[0, V=200\)"):
        compiled(inputs.logits.clone().requires_grad_(), bad, *rest)
    nan = inputs.logits.clone()
    row = int(inputs.mask.nonzero()[1, 0])
    nan[row, 3] = float("nan")
    with pytest.raises(ValueError, match=f"logits hold NaN at row {row}, column 3"):
        compiled(nan.requires_grad_(), inputs.tokens, *rest)
    for keyword, value in (("inplace", True), ("backend", "reference"), ("kept", inputs.tokens[:, None])):
        torch._dynamo.reset()
        with pytest.raises(Exception, match="with torch.compile.* is not supported"):
            torch.compile(lambda z: fused_is.logprobs(z, inputs.tokens, **{keyword: value})[0].sum(),
                          fullgraph=True, backend="aot_eager")(inputs.logits.clone().requires_grad_())


@pytest.mark.parametrize("validate", ["full", "async"])
def test_token_logprobs_fullgraph(validate):
    """token_logprobs under torch.compile(fullgraph=True): the eager values, per-row temperatures, checks at run
    time (a ValueError with validate='full', the device-side assertion's RuntimeError with 'async')."""
    torch._dynamo.reset()
    inputs = make_inputs("padded", dtype=torch.bfloat16, seed=27, vocab=300)
    tau = torch.rand(inputs.tokens.shape[0], generator=torch.Generator().manual_seed(6)) + 0.5

    def fn(logits, tokens):
        return fused_is.token_logprobs(logits, tokens, tau, CPU_BACKENDS[0], mask=inputs.mask, validate=validate)

    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    for got, want in zip(compiled(inputs.logits, inputs.tokens), fn(inputs.logits, inputs.tokens)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    bad = inputs.tokens.clone()
    bad[inputs.mask] = -1
    with pytest.raises(ValueError if validate == "full" else RuntimeError, match="tokens must be ids in"):
        compiled(inputs.logits, bad)


@pytest.mark.gpu
def test_logprobs_fullgraph_on_gpu(gpu_device):
    """A loss of one's own over logprobs, compiled with inductor on the GPU (aot_eager in the suite's CPU dry run)."""
    probe = torch.empty(1, 1, device=gpu_device)
    reason = backends.unavailable_reason("triton", probe)
    if reason is not None:
        pytest.skip(reason)
    torch._dynamo.reset()
    inputs = make_inputs("padded", dtype=torch.bfloat16, seed=28, vocab=1000, device=gpu_device)
    fn = _own_loss("triton", 1.0)
    mask = inputs.mask.float()
    grads = []
    for f in (fn, torch.compile(fn, fullgraph=True, backend="inductor" if gpu_device == "cuda" else "aot_eager")):
        x = inputs.logits.detach().clone().requires_grad_()
        f(x, inputs.tokens, inputs.old_logprobs.float(), inputs.advantages.float(), mask)[0].backward()
        grads.append(x.grad.float())
    torch.testing.assert_close(grads[1], grads[0], rtol=2e-2, atol=1e-5)


def test_logits_check_holds_whichever_output_is_used():
    """The logits' value check (fused_is::checked_rows) gates lp and H alike: a compiled function that uses only
    the entropy still raises on a NaN logit (neither dynamo nor inductor may drop the check)."""
    inputs = make_inputs("padded", dtype=torch.float32, seed=29, vocab=120)
    nan = inputs.logits.clone()
    row = inputs.mask.reshape(-1).nonzero()[0, 0]
    nan.reshape(-1, 120)[row, 5] = float("nan")
    functions = {
        "token_logprobs": lambda z: fused_is.token_logprobs(z, inputs.tokens, 1.0, CPU_BACKENDS[0],
                                                           mask=inputs.mask)[1],
        "policy_loss": lambda z: fused_is.policy_loss(z, inputs.tokens, inputs.advantages, config="ppo",
                                                      mask=inputs.mask, old_logprobs=inputs.old_logprobs,
                                                      backend=CPU_BACKENDS[0]).entropy,
    }
    for name, fn in functions.items():
        for compiler in ("aot_eager", "inductor"):
            torch._dynamo.reset()
            compiled = torch.compile(fn, fullgraph=True, backend=compiler)
            compiled(inputs.logits)  # clean logits pass
            with pytest.raises(ValueError, match="logits hold NaN"):
                compiled(nan)
