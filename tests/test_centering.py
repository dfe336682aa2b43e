"""LossConfig.score_centering: the sampler's expected score subtracted (arXiv 2609.20807), on every backend against
the float64 reference; the reference against the centered score written out (DESIGN.md section 9's base form) and
against the calibrated loss as the open implementations write it; the zero-drift case; the linear path; errors."""

import math
from types import SimpleNamespace

import pytest
import torch

import fused_is
from fused_is import LossConfig, backends

from cases import (assert_close, check_against_reference, check_linear, config_for, make_inputs,
                   make_linear_inputs, tolerance)

BACKENDS = [b for b in backends.available_backends() if b != "reference"]
K = 5


def sampler_of(logits: torch.Tensor, tokens: torch.Tensor, k: int = K, seed: int = 0, noise: float = 0.4,
               temperature: float = 1.0):
    """A sampler near the learner: log_softmax of the learner's logits (float64) / tau plus noise. Returns its logprob
    of each token and its top-k (ids with some -1 entries, logprobs float32)."""
    g = torch.Generator().manual_seed(seed)
    z = logits.double() / temperature
    log_q = torch.log_softmax(z + noise * torch.randn(z.shape, generator=g, dtype=torch.float64), -1)
    top = log_q.topk(k, -1)
    ids, values = top.indices.clone(), top.values.float()
    drop = torch.rand(ids.shape[:-1], generator=g) < 0.2  # a position that reports fewer entries
    ids[..., -1] = torch.where(drop, -1, ids[..., -1])
    samp = log_q.gather(-1, tokens.clamp(0, z.shape[-1] - 1).unsqueeze(-1)).squeeze(-1).float()  # masked: -100
    return samp, (ids, values)


class _Centered:
    """Inputs whose kwargs() carry the sampler's top-K and its logprobs (old_logprobs as asked)."""

    def __init__(self, inputs, temperature=1.0, with_old=True, seed=0):
        self.inputs = inputs
        self.samp, self.topk = sampler_of(inputs.logits, inputs.tokens, seed=seed, temperature=temperature)
        self.with_old = with_old

    def __getattr__(self, name):
        return getattr(self.inputs, name)

    def kwargs(self, **overrides):
        kw = self.inputs.kwargs(**overrides)
        kw.update(sampler_logprobs=self.samp, sampler_topk=self.topk)
        if not self.with_old:
            kw["old_logprobs"] = None
        return kw


CASES = [  # (id, preset, overrides, old_logprobs given)
    ("ppo_tis", "ppo_tis", dict(score_centering="proportional"), True),
    ("seq_tis_entropy", "seq_tis", dict(score_centering="proportional", entropy_coef=0.02,
                                        loss_agg="seq-mean-token-mean"), True),
    ("reinforce_kl_temperature", "reinforce", dict(score_centering="proportional", kl_coef=0.1, temperature=0.8),
     True),
    ("gspo", "gspo", dict(score_centering="proportional", clip_low=0.02, clip_high=0.03), True),  # g after the stats
    ("gmpo", "gmpo", dict(score_centering="proportional", clip_low=0.1, clip_high=0.1), True),
    ("calibrated_tis", "reinforce_tis", dict(score_centering="calibrated", is_cap=1.2), False),
    ("calibrated_off_policy_mask", "reinforce_tis", dict(score_centering="calibrated", off_policy_mask=0.0), False),
    ("calibrated_mis", "reinforce_tis", dict(score_centering="calibrated", is_mode="mask", is_floor=0.8,
                                             is_cap=1.28), False),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_against_the_reference(backend, case):
    _, preset, overrides, with_old = case
    layout = "padded" if backend == "cpu" else "packed"
    inputs = make_inputs(layout, dtype=torch.float32, seed=3)
    config = config_for(preset, overrides)
    check_against_reference(_Centered(inputs, config.temperature, with_old), config, backend, with_old=with_old)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("inplace", [True, "forward"])
def test_bf16_and_in_place(backend, inplace):
    """bf16 logits, the gradient written over them (in backward, or during the forward call)."""
    inputs = make_inputs("padded", dtype=torch.bfloat16, seed=4)
    config = config_for("ppo_tis", dict(score_centering="proportional"))
    check_against_reference(_Centered(inputs), config, backend, inplace=inplace)


@pytest.mark.parametrize("backend", BACKENDS)
def test_large_c_in_bf16(backend):
    """A learner almost all of whose mass is on the sampler's top-K (tail ~1e-5) against a sampler with 3% outside it:
    c ~ 1e3, and the K + 1 columns still as exact as the rest of a bf16 gradient (their value is formed whole, not
    patched over rounded dense values)."""
    g = torch.Generator().manual_seed(11)
    n, vocab = 16, 64
    logits = torch.randn(n, vocab, generator=g, dtype=torch.float64)
    ids = torch.stack([torch.randperm(vocab, generator=g)[:K] for _ in range(n)])
    logits.scatter_add_(1, ids, torch.full((n, K), 14.0, dtype=torch.float64))  # the top-K hold all but ~1e-5
    tokens = ids[torch.arange(n), torch.randint(0, K, (n,), generator=g)]
    adv = torch.randn(n, generator=g, dtype=torch.float64)
    q = torch.softmax(torch.randn(n, K, generator=g, dtype=torch.float64), -1) * 0.97
    samp = torch.log((q * (ids == tokens.unsqueeze(1))).sum(1))
    config = config_for("ppo_tis", dict(score_centering="proportional"))
    grads, outs = [], []
    for b, dtype in ((backend, torch.bfloat16), ("reference", torch.float64)):
        x = logits.to(torch.bfloat16).to(dtype).requires_grad_()  # the same bf16 values on both sides
        out = fused_is.policy_loss(x, tokens, adv, sampler_logprobs=samp, old_logprobs=samp + 0.1,
                                   sampler_topk=(ids, q.log()), config=config, backend=b)
        out.loss.backward()
        grads.append(x.grad)
        outs.append(out)
    assert outs[1].metrics["centering_c"] > 100, outs[1].metrics
    assert_close("grad", grads[0], grads[1], tolerance(torch.bfloat16, backend)["grad"])


def test_value_without_grad():
    """Under torch.no_grad the loss keeps its centering term, on a fused backend and on the reference."""
    inputs = _Centered(make_inputs("packed", dtype=torch.float32, seed=6))
    config = config_for("ppo_tis", dict(score_centering="proportional"))
    with_grad = fused_is.policy_loss(inputs.logits.double().requires_grad_(), inputs.tokens, inputs.advantages,
                                     config=config, backend="reference", **inputs.kwargs()).loss.detach()
    with torch.no_grad():
        for backend in ("reference", "cpu"):
            logits = inputs.logits.double() if backend == "reference" else inputs.logits
            loss = fused_is.policy_loss(logits, inputs.tokens, inputs.advantages, config=config, backend=backend,
                                        **inputs.kwargs()).loss
            assert abs(float(loss) - float(with_grad)) <= 1e-5 * max(1.0, abs(float(with_grad))), (backend, loss)


def _explicit_gradient(logits, tokens, adv, ids, logq, tau):
    """d/dz of REINFORCE's token-mean loss -mean_t A_t lp_t with each score centered, written out: -A_t (e_y - q~) /
    (tau n), q~ = q on the top-K, (1 - Q) p / (1 - P) outside (DESIGN.md section 9)."""
    p = torch.softmax(logits.double() / tau, -1)
    n, vocab = p.shape
    entry = ids >= 0
    q_tilde = p.clone()
    for t in range(n):
        on = ids[t][entry[t]]
        big_q = logq[t][entry[t]].double().exp().sum()
        big_p = p[t, on].sum()
        q_tilde[t] = p[t] * (1 - big_q) / (1 - big_p)
        q_tilde[t, on] = logq[t][entry[t]].double().exp()
    onehot = torch.nn.functional.one_hot(tokens, vocab).double()
    return -(adv.double().unsqueeze(1) * (onehot - q_tilde)) / (tau * n)


@pytest.mark.parametrize("k", [3, 40])  # 40: the whole vocabulary, q~ = q
def test_reference_is_the_centered_score(k):
    """The reference's gradient (and the torch backend's) is -A (e_y - q~) / tau: the base form of the design, from the
    implementations' loss with its tail folded in."""
    g = torch.Generator().manual_seed(1)
    n, vocab, tau = 9, 40, 0.7
    logits = torch.randn(n, vocab, generator=g, dtype=torch.float64)
    tokens = torch.randint(0, vocab, (n,), generator=g)
    adv = torch.randn(n, generator=g, dtype=torch.float64)
    samp, (ids, logq) = sampler_of(logits, tokens, k=k, seed=2, temperature=tau)
    if k == vocab:
        ids = logits.argsort(-1, descending=True)  # every id, none missing
        logq = torch.log_softmax(logits / tau + 0.4 * torch.randn(n, vocab, generator=g, dtype=torch.float64),
                                 -1).gather(1, ids)  # float64: Q = 1 to rounding
    expected = _explicit_gradient(logits, tokens, adv, ids, logq, tau)
    config = LossConfig(policy="reinforce", is_level="none", temperature=tau, score_centering="proportional")
    for backend in ("reference", "torch"):
        x = logits.clone().requires_grad_()
        fused_is.policy_loss(x, tokens, adv, sampler_topk=(ids, logq), config=config, backend=backend).loss.backward()
        assert_close(f"grad {backend}", x.grad, expected, 1e-10)


def test_calibrated_is_the_truncated_expected_score():
    """calibrated with truncation at C: the loss -A [min(r_y, C) lp_y - sum_S (min(p_j, C q_j) - min(1, C c) p_j)
    log p_j] (each coefficient held constant, c = (1 - Q) / (1 - P)), written out here from the paper's formula:
    value and gradient equal the reference's and the torch backend's (float64)."""
    g = torch.Generator().manual_seed(5)
    n, vocab, cap = 11, 30, 1.3
    logits = torch.randn(n, vocab, generator=g, dtype=torch.float64)
    tokens = torch.randint(0, vocab, (n,), generator=g)
    adv = torch.randn(n, generator=g, dtype=torch.float64)
    samp, (ids, logq) = sampler_of(logits, tokens, seed=6, noise=0.8)
    x = logits.clone().requires_grad_()
    log_p = torch.log_softmax(x, -1)
    p = log_p.detach().exp()
    entry = ids >= 0
    lp_top = torch.where(entry, log_p.gather(1, ids.clamp(min=0)), 0.0)
    q = torch.where(entry, logq.double().exp(), 0.0)
    p_top = torch.where(entry, p.gather(1, ids.clamp(min=0)), 0.0)
    c = (1 - q.sum(1)).clamp(min=1e-6) / (1 - p_top.sum(1)).clamp(min=1e-6)
    lp = log_p.gather(1, tokens.unsqueeze(1)).squeeze(1)
    weight = torch.exp(lp.detach() - samp.double()).clamp(max=cap)
    residual = torch.minimum(p_top, cap * q) - torch.clamp(cap * c, max=1.0).unsqueeze(1) * p_top
    loss = (-adv * (weight * lp - (residual * lp_top).sum(1))).mean()
    loss.backward()
    config = LossConfig(policy="reinforce", is_level="token", is_cap=cap, score_centering="calibrated")
    for backend in ("reference", "torch"):
        y = logits.clone().requires_grad_()
        out = fused_is.policy_loss(y, tokens, adv, sampler_logprobs=samp, sampler_topk=(ids, logq), config=config,
                                   backend=backend)
        out.loss.backward()
        assert_close(f"loss {backend}", out.loss, loss.detach(), 1e-9, scale=float(loss.detach().abs()) + 1)
        assert_close(f"grad {backend}", y.grad, x.grad, 1e-9)


def test_no_drift_when_the_sampler_is_the_learner():
    """A sampler whose top-K are the learner's own probabilities: q~ = p, so the centered gradient is the plain one,
    the drift metric 0, and the value term -g sum_S (q - c p) log p vanishes with c = 1."""
    inputs = make_inputs("packed", dtype=torch.float32, seed=8)
    logits = inputs.logits.double()
    log_p = torch.log_softmax(logits, -1)
    top = log_p.topk(K, -1)
    plain = config_for("ppo_tis", {})
    centered = config_for("ppo_tis", dict(score_centering="proportional"))
    grads, losses = [], []
    for config, extra in ((plain, {}), (centered, dict(sampler_topk=(top.indices, top.values)))):
        x = inputs.logits.clone().requires_grad_()
        out = fused_is.policy_loss(x, inputs.tokens, inputs.advantages, config=config, backend="cpu",
                                   **inputs.kwargs(**extra))
        out.loss.backward()
        grads.append(x.grad)
        losses.append(out.loss)
    assert_close("grad", grads[1], grads[0], 1e-5)
    assert abs(float(losses[1].detach() - losses[0].detach())) <= 1e-5 * max(1.0, abs(float(losses[0])))
    assert out.metrics["centering_drift_l1"] < 1e-5 and abs(out.metrics["centering_c"] - 1) < 1e-4


@pytest.mark.parametrize("backend", ["cpu", "triton"])
def test_linear(backend):
    """linear_policy_loss with score centering: the K columns read from each chunk's logits as the stats pass forms
    them, the patch added to each chunk's gradient before its GEMMs."""
    li = make_linear_inputs("packed", dtype=torch.float32, seed=2)
    centered = SimpleNamespace(hidden=li.hidden, weight=li.weight, bias=li.bias, inputs=_Centered(li.inputs))
    check_linear(centered, config_for("ppo_tis", dict(score_centering="proportional")), backend)


def test_vllm_sampler_topk():
    """fused_is.vllm.sampler_topk: every entry of each position (the sampled token's when it is outside the top-K),
    -1 / -inf padding, padded and packed rows."""
    entry = lambda **d: {int(t[1:]): SimpleNamespace(logprob=v) for t, v in d.items()}  # noqa: E731
    first = SimpleNamespace(token_ids=[4, 7], logprobs=[entry(t4=-0.5, t2=-1.5), entry(t1=-0.2, t3=-2.0, t7=-4.0)])
    second = SimpleNamespace(token_ids=[9], logprobs=[entry(t9=-0.1, t8=-2.5)])
    outputs = [SimpleNamespace(outputs=[first]), SimpleNamespace(outputs=[second])]
    from fused_is import vllm
    ids, logprobs = vllm.sampler_topk(outputs)
    assert ids.tolist() == [[[4, 2, -1], [1, 3, 7]], [[9, 8, -1], [-1, -1, -1]]]
    assert logprobs[0, 1].tolist() == pytest.approx([-0.2, -2.0, -4.0]) and logprobs[0, 0, 2] == -math.inf
    packed_ids, packed = vllm.sampler_topk(outputs, packed=True)
    assert packed_ids.tolist() == [[4, 2, -1], [1, 3, 7], [9, 8, -1]] and packed.shape == (3, 3)


@pytest.mark.parametrize("what,match", [
    ("range", r"ids must lie in \[-1, V="), ("twice", "names a token twice"), ("k", "the same K"),
    ("mass", "sum to at most 1"), ("nan", "<= 0 and not NaN"), ("float_ids", "ids must be an integer"),
    ("shape", r"must have shape"), ("missing", "needs sampler_topk"), ("unread", "read by LossConfig.score_centering"),
    ("calibrated_old", "takes no old_logprobs"), ("calibrated_ppo", "needs the REINFORCE surrogate"), ("kept", "kept= is not supported"),
    ("calibrated_no_sampler", "needs sampler_logprobs"), ("calibrated_loglinear", "loglinear' is not supported"),
])
def test_errors(what, match):
    inputs = make_inputs("packed", dtype=torch.float32, seed=1)
    _, (ids, logq) = sampler_of(inputs.logits, inputs.tokens)
    config = config_for("ppo_tis", dict(score_centering="proportional"))
    extra = {}
    row = int(inputs.mask.reshape(-1).nonzero()[1, 0])  # an unmasked position: masked ones may hold anything
    if what == "range":
        ids[row, 0] = inputs.logits.shape[-1]
    elif what == "twice":
        ids[row, 1] = ids[row, 0]
    elif what == "k":
        logq = logq[:, :-1]
    elif what == "mass":
        logq[row] = math.log(0.5)
    elif what == "nan":
        logq[row, 0] = float("nan")
    elif what == "float_ids":
        ids = ids.float()
    elif what == "shape":
        ids, logq = ids[:-1], logq[:-1]
    elif what == "missing":
        ids = None
    elif what == "unread":
        config = config_for("ppo_tis", {})
    elif what == "calibrated_old":
        config = config_for("reinforce_tis", dict(score_centering="calibrated"))
    elif what == "kept":
        extra = dict(kept=torch.cat([inputs.tokens.unsqueeze(-1), ids], -1)[..., :2].contiguous())
    elif what == "calibrated_no_sampler":
        config = config_for("reinforce", dict(score_centering="calibrated", is_level="token"))
        extra = dict(sampler_logprobs=None, old_logprobs=None)
    if what in ("calibrated_ppo", "calibrated_loglinear"):
        with pytest.raises(ValueError, match=match):
            config_for("ppo_tis" if what == "calibrated_ppo" else "reinforce_tis",
                       dict(score_centering="calibrated", ratio_ref="loglinear" if what != "calibrated_ppo" else "old"))
        return
    with pytest.raises((ValueError, TypeError), match=match):
        fused_is.policy_loss(inputs.logits.clone().requires_grad_(), inputs.tokens, inputs.advantages, config=config,
                             backend="cpu",
                             **inputs.kwargs(sampler_topk=None if ids is None else (ids, logq), **extra))
