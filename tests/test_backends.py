"""Every backend that runs here against the float64 reference (DESIGN.md sections 2 and 4).

The same cases run for each backend; a new backend joins by appearing in BACKENDS.
"""

import math

import pytest
import torch

import fused_is
from fused_is import backends
from fused_is.backends import torch_chunked

from cases import (OPTION_CASES, PRESET_NAMES, Inputs, assert_close, check_against_reference, config_for,
                   loss_scale, make_inputs, rel_err, run, tolerance)

# backends under test on this machine's CPU (the reference is the oracle, not a subject)
BACKENDS = [b for b in backends.available_backends() if b != "reference"]
# inplace=True writes the gradient in backward from kept row statistics (every backend's given-statistics sweep)
INPLACE_BACKENDS = BACKENDS


@pytest.fixture(params=[None, 7], ids=["chunk_auto", "chunk_7_rows"])
def chunking(request, monkeypatch):
    """Run the chunked torch backend with its default chunk and with 7-row chunks (many chunks, ragged tail)."""
    if request.param is not None:
        monkeypatch.setattr(torch_chunked, "CHUNK_ELEMENTS", request.param * 1000)
    return request.param


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", ["padded", "packed"])
@pytest.mark.parametrize("preset", PRESET_NAMES)
@pytest.mark.parametrize("with_old", [True, False], ids=["old", "no_old"])
def test_presets_fp32(backend, layout, preset, with_old):
    inputs = make_inputs(layout, dtype=torch.float32, seed=PRESET_NAMES.index(preset) + 100 * len(layout))
    check_against_reference(inputs, config_for(preset), backend, with_old=with_old)


@pytest.mark.parametrize("layout", ["padded", "packed"])
@pytest.mark.parametrize("preset", PRESET_NAMES)
def test_torch_backend_chunking(layout, preset, chunking):
    """The chunked torch backend with its default chunk and with 7-row chunks (many chunks, ragged tail)."""
    inputs = make_inputs(layout, dtype=torch.bfloat16, seed=PRESET_NAMES.index(preset))
    check_against_reference(inputs, config_for(preset), "torch")
    check_against_reference(inputs, config_for(preset), "torch", with_old=False)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", ["padded", "packed"])
@pytest.mark.parametrize("name,preset,overrides", OPTION_CASES, ids=[c[0] for c in OPTION_CASES])
def test_options_fp32(backend, layout, name, preset, overrides):
    inputs = make_inputs(layout, dtype=torch.float32, seed=len(name))
    cfg = config_for(preset, overrides)
    check_against_reference(inputs, cfg, backend)
    if cfg.rejection:  # its criteria compare the sampler with old_logprobs: refused without them
        with pytest.raises(ValueError, match="old_logprobs is required by LossConfig.rejection"):
            check_against_reference(inputs, cfg, backend, with_old=False)
    else:
        check_against_reference(inputs, cfg, backend, with_old=False)


# (backend, dtype) pairs each backend takes: the fused kernels take bf16/fp16/fp32 logits
DTYPE_CASES = [(b, d) for b in BACKENDS for d in (torch.bfloat16, torch.float16, torch.float32, torch.float64)
               if backends.unavailable_reason(b, torch.empty(1, 1, dtype=d)) is None]


@pytest.mark.parametrize("backend,dtype", DTYPE_CASES, ids=[f"{b}-{d}" for b, d in DTYPE_CASES])
@pytest.mark.parametrize("preset", ["ppo_tis", "seq_mis", "reinforce"])
def test_dtypes(backend, dtype, preset):
    inputs = make_inputs("padded", dtype=dtype, seed=3)
    check_against_reference(inputs, config_for(preset), backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_error_is_a_small_multiple_of_eager_torch(backend, dtype):
    """Three-way comparison: our error against float64 is at most a small multiple of eager torch's at the same dtype."""
    inputs = make_inputs("padded", dtype=dtype, seed=5, vocab=4099)
    cfg = config_for("ppo_tis", dict(entropy_coef=0.01))
    out, grad = run(inputs, cfg, backend)
    eager, eager_grad = run(inputs, cfg, "reference")  # eager torch at the input dtype (upcast to fp32)
    ref, ref_grad = run(inputs, cfg, "reference", dtype=torch.float64)
    eps = 2.0 ** -23  # fp32's unit roundoff: below a few of it, either may be lucky
    assert rel_err(out.loss, ref.loss) <= 4 * max(rel_err(eager.loss, ref.loss), eps)
    assert rel_err(grad, ref_grad) <= 4 * max(rel_err(eager_grad, ref_grad), eps)


@pytest.mark.parametrize("backend", BACKENDS)
def test_grad_output_scale_and_inplace(backend):
    inputs = make_inputs("padded", dtype=torch.float32, seed=11)
    cfg = config_for("ppo_tis", dict(entropy_coef=0.02))
    for scale in (1.0, -0.37, 0.0):
        check_against_reference(inputs, cfg, backend, grad_scale=scale)
        check_against_reference(inputs, cfg, backend, grad_scale=scale, inplace=True)


@pytest.mark.parametrize("backend", INPLACE_BACKENDS)
@pytest.mark.parametrize("inplace", [True, "forward"])
def test_inplace_writes_gradient_into_logits_and_bumps_version(backend, inplace):
    """inplace=True leaves the logits as they are until backward writes the gradient over them; "forward" writes
    it during the call. Both end with the gradient in the logits' buffer, handed to autograd, version moved."""
    inputs = make_inputs("packed", dtype=torch.float32, seed=2)
    leaf = inputs.logits.clone().requires_grad_()
    logits = leaf * 1.0
    before, values = logits._version, logits.detach().clone()
    out = fused_is.policy_loss(logits, inputs.tokens, inputs.advantages, backend=backend, inplace=inplace,
                               **inputs.kwargs())
    if inplace is True:
        assert logits._version == before and torch.equal(logits.detach(), values)
    else:
        assert logits._version > before
    out.loss.backward()
    assert logits._version > before
    ref, ref_grad = run(inputs, "ppo_tis", "reference", dtype=torch.float64)
    tol = tolerance(torch.float32, backend)["grad"]
    assert_close("inplace buffer", logits.detach(), ref_grad, tol)
    assert_close("leaf grad", leaf.grad, ref_grad, tol)


@pytest.mark.parametrize("backend", INPLACE_BACKENDS)
@pytest.mark.parametrize("preset,with_old", [("ppo_tis", True), ("seq_mis", False), ("gspo", True)])
def test_inplace_logits_read_after_the_call_are_the_logits(backend, preset, with_old):
    """A second loss term on the same logits after an inplace=True call (cross-entropy, as an SFT term beside
    the RL loss) gets the logits' values and the right gradient: the same loss and lm_head gradient as
    inplace=False, with grad_output != 1 folded into the sweep."""
    inputs = make_inputs("padded", dtype=torch.float32, seed=5)
    torch.manual_seed(5)
    hidden = torch.randn(*inputs.tokens.shape, 16)
    vocab = inputs.logits.shape[-1]

    def loss_and_grad(inplace):
        torch.manual_seed(6)
        head = torch.nn.Linear(16, vocab)
        torch.nn.init.normal_(head.weight)
        logits = head(hidden)
        out = fused_is.policy_loss(logits, inputs.tokens, inputs.advantages, config=preset, backend=backend,
                                   inplace=inplace, **inputs.kwargs(with_old=with_old))
        ce = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), inputs.tokens.reshape(-1))
        total = 0.7 * out.loss + ce
        total.backward()
        return ce.detach(), total.detach(), head.weight.grad

    ce, total, grad = loss_and_grad(False)
    ce_inplace, total_inplace, grad_inplace = loss_and_grad(True)
    assert torch.equal(ce, ce_inplace)
    torch.testing.assert_close(total_inplace, total, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grad_inplace, grad, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", INPLACE_BACKENDS)
def test_inplace_logits_modified_before_backward_is_an_error(backend):
    """Two inplace=True calls on one logits tensor: the first backward writes its gradient over the logits, so
    the second cannot find them: a RuntimeError naming the cause, never a gradient of other values."""
    inputs = make_inputs("padded", dtype=torch.float32, seed=7)
    logits = inputs.logits.clone().requires_grad_() * 1.0
    first = fused_is.policy_loss(logits, inputs.tokens, inputs.advantages, backend=backend, inplace=True,
                                 **inputs.kwargs())
    second = fused_is.policy_loss(logits, inputs.tokens, inputs.advantages, backend=backend, inplace=True,
                                  **inputs.kwargs())
    with pytest.raises(RuntimeError, match="modified in place between the call and backward"):
        (first.loss + second.loss).backward()


@pytest.mark.parametrize("backend", BACKENDS)
def test_inplace_then_reusing_saved_logits_raises(backend):
    """A caller whose graph saved the logits gets autograd's error, not silent garbage."""
    inputs = make_inputs("padded", dtype=torch.float32, seed=2)
    leaf = inputs.logits.clone().requires_grad_()
    logits = leaf * 1.0
    other = (logits * logits).sum()  # MulBackward saves logits
    out = fused_is.policy_loss(logits, inputs.tokens, inputs.advantages, backend=backend, inplace=True,
                               **inputs.kwargs())
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        (out.loss + other).backward()


@pytest.mark.parametrize("backend", BACKENDS)
def test_nothing_written_without_inplace(backend):
    inputs = make_inputs("padded", dtype=torch.bfloat16, seed=4)
    tensors = [inputs.logits, inputs.tokens, inputs.advantages, inputs.sampler_logprobs, inputs.old_logprobs,
               inputs.mask]
    logits = inputs.logits.clone().requires_grad_()
    copies = [t.clone() for t in tensors]
    versions = [t._version for t in tensors]
    before = logits.detach().clone()
    out = fused_is.policy_loss(logits, inputs.tokens, inputs.advantages, backend=backend, **inputs.kwargs())
    out.loss.backward()
    assert torch.equal(logits.detach(), before) and logits._version == 0
    for t, c, v in zip(tensors, copies, versions):
        assert torch.equal(t, c) or (t.dtype.is_floating_point and torch.equal(t.isnan(), c.isnan()))
        assert t._version == v


@pytest.mark.parametrize("backend", BACKENDS)
def test_second_backward_raises_clearly(backend):
    inputs = make_inputs("padded", dtype=torch.float32, seed=6)
    logits = inputs.logits.clone().requires_grad_()
    out = fused_is.policy_loss(logits, inputs.tokens, inputs.advantages, backend=backend, **inputs.kwargs())
    out.loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward ran twice"):
        out.loss.backward()


@pytest.mark.parametrize("backend", BACKENDS)
def test_non_contiguous_logits(backend):
    """logits[:, :-1] of a [B, T+1, V] buffer (cannot be viewed as [N, V]) and a vocab-strided transpose."""
    inputs = make_inputs("padded", dtype=torch.float32, seed=8)
    b, t, v = inputs.logits.shape
    big = torch.randn(b, t + 1, v)
    big[:, :-1] = inputs.logits
    sliced = big[:, :-1]
    assert not sliced.is_contiguous()
    transposed = inputs.logits.transpose(-1, -2).contiguous().transpose(-1, -2)
    for logits in (sliced, transposed):
        case = make_inputs("padded", dtype=torch.float32, seed=8)
        case.logits = logits
        check_against_reference(case, config_for("ppo_tis", dict(entropy_coef=0.01)), backend)
        out, grad = run(case, "ppo_tis", backend, inplace=True)
        assert grad.shape == logits.shape


@pytest.mark.parametrize("backend", BACKENDS)
def test_advantages_per_sequence(backend):
    # [B] advantages broadcast over the tokens equal the expanded [B, T] ones. The loss is a signed mean that can
    # nearly cancel, so its error is measured against the terms' magnitudes (loss_scale), as everywhere else.
    inputs = make_inputs("padded", dtype=torch.float32, seed=9)
    per_seq = torch.randn(inputs.tokens.shape[0], generator=torch.Generator().manual_seed(9))
    out = fused_is.policy_loss(inputs.logits, inputs.tokens, per_seq, backend=backend, **inputs.kwargs())
    inputs.advantages = per_seq[:, None].expand_as(inputs.tokens)
    expanded = fused_is.policy_loss(inputs.logits.double(), inputs.tokens, inputs.advantages,
                                    backend="reference", **inputs.kwargs())
    scale = max(abs(expanded.loss.item()), loss_scale(inputs, "ppo_tis"))
    assert_close("loss", out.loss, expanded.loss, tolerance(torch.float32, backend)["loss"], scale=scale)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("preset", PRESET_NAMES)
def test_all_tokens_masked(backend, preset):
    inputs = make_inputs("padded", dtype=torch.float32, seed=1)
    inputs.mask = torch.zeros_like(inputs.mask)
    out, grad = run(inputs, preset, backend)
    assert out.loss.item() == 0.0 and torch.all(grad == 0)
    assert all(v == v for v in out.metrics.values())  # no NaN


@pytest.mark.parametrize("backend", BACKENDS)
def test_single_token(backend):
    inputs = make_inputs("packed", batch=1, seq_len=2, dtype=torch.float32, seed=3)
    inputs.mask = torch.tensor([True, False])
    for preset in ("ppo_tis", "seq_tis", "geo_mis", "seq_is"):
        check_against_reference(inputs, preset, backend)
        check_against_reference(inputs, preset, backend, with_old=False)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("vocab", [1, 7, 4099])
def test_vocab_sizes(backend, vocab):
    inputs = make_inputs("padded", dtype=torch.float32, vocab=vocab, seed=vocab)
    check_against_reference(inputs, config_for("ppo_tis", dict(entropy_coef=0.01)), backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_extreme_logits_and_shift_invariance(backend):
    inputs = make_inputs("padded", dtype=torch.float32, seed=12)
    cfg = config_for("ppo_tis", dict(entropy_coef=0.01))
    huge = make_inputs("padded", dtype=torch.float32, seed=12)
    huge.logits = (inputs.logits.sign() * 1e4).float()
    out, grad, _, _ = check_against_reference(huge, cfg, backend)
    assert torch.isfinite(grad).all()
    shifted = make_inputs("padded", dtype=torch.float32, seed=12)
    shifted.logits = inputs.logits + 100.0
    out_s, grad_s = run(shifted, cfg, backend)
    out_0, grad_0 = run(inputs, cfg, backend)
    # logits + 100 is exactly representable only up to fp32 rounding of the inputs (ulp(100) = 7.6e-6)
    assert_close("shifted loss", out_s.loss, out_0.loss, 1e-4)
    assert_close("shifted grad", grad_s, grad_0, 1e-4)


@pytest.mark.parametrize("backend", BACKENDS)
def test_log_ratios_beyond_clamp(backend):
    """|log w| > 20 (clamped to exp(+-20)) and PPO log ratios beyond +-20 stay finite and exact."""
    inputs = make_inputs("padded", dtype=torch.float32, seed=13)
    up = torch.rand(inputs.old_logprobs.shape, generator=torch.Generator().manual_seed(13)) > 0.5
    # log w = old - samp is +25 where up and -25 elsewhere; the PPO ratio exp(lp - old) reaches e^25 there
    old = inputs.old_logprobs
    inputs.sampler_logprobs = torch.where(up, old - 25.0, old)
    inputs.old_logprobs = torch.where(up, old, old - 25.0)
    for preset in ("vanilla_is", "seq_is", "ppo_is", "seq_tis"):
        # Triton forms the ratio in fp32: exp(25 + e) carries ulp(25) = 2e-6 of relative error
        check_against_reference(inputs, preset, backend, tol=tolerance(torch.float32, backend))


def test_log_ratio_clamp_binds():
    """The clamp case of OPTION_CASES changes the gradient (it zeroes tokens the PPO clip leaves alone), and a
    clamp at 20, as verl and OpenRLHF set it, zeroes the gradient of log ratios beyond 20 with A < 0 that the
    clip alone passes through (r A with r = e^25)."""
    inputs = make_inputs("padded", dtype=torch.float32, seed=len("log_ratio_clamp"))
    _, grad = run(inputs, config_for("ppo", dict(log_ratio_clamp=0.1)), "reference", dtype=torch.float64)
    _, plain = run(inputs, config_for("ppo"), "reference", dtype=torch.float64)
    assert rel_err(grad, plain) > 0.05
    inputs.old_logprobs = inputs.old_logprobs - 25.0  # lp - old = 25 + noise: r A is huge for A < 0
    inputs.advantages = -inputs.advantages.abs()
    out, grad = run(inputs, config_for("ppo", dict(log_ratio_clamp=20.0)), "reference", dtype=torch.float64)
    assert (grad[inputs.mask] == 0).all() and torch.isfinite(out.loss)
    for backend in BACKENDS:
        check_against_reference(inputs, config_for("ppo", dict(log_ratio_clamp=20.0)), backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_kl_sampler_weight_identities(backend):
    """LossConfig.kl_weight="sampler" with sampler_logprobs equal to the current logprobs is "score" (w = 1 in value,
    w' = w), value and gradient, with an input clamp too; the option cases' clamps bind for some tokens, not all."""
    inputs = make_inputs("padded", dtype=torch.float32, seed=43)
    ref_run = run(inputs, "reinforce", "reference", dtype=torch.float64)[0]
    inputs.sampler_logprobs = ref_run.logprobs.float()  # the current logprobs (no IS weight in "ppo")
    tol = tolerance(torch.float32, backend)
    for clamp in (None, 0.2):
        score, sampler = (run(inputs, config_for("ppo", dict(kl_coef=0.3, kl_type="k2", kl_input_clamp=clamp,
                                                             kl_weight=weight)), backend)
                          for weight in ("score", "sampler"))
        assert_close("loss", sampler[0].loss, score[0].loss, tol["loss"])
        assert_close("grad", sampler[1], score[1], tol["grad"])
    for name, preset, overrides in OPTION_CASES:
        if "kl_input_clamp" not in overrides:
            continue
        inputs = make_inputs("padded", dtype=torch.float64, seed=len(name))  # test_options_fp32's
        valid = inputs.mask
        lp = run(inputs, "reinforce", "reference")[0].logprobs
        d = (lp - inputs.ref_logprobs)[valid]
        binds = d.abs() > overrides["kl_input_clamp"]
        assert 0 < int(binds.sum()) < len(d), name
        if overrides.get("kl_weight") == "sampler":  # the output clamp binds on w k3(d) for some tokens too
            d = d.clamp(-overrides["kl_input_clamp"], overrides["kl_input_clamp"])
            kl = (torch.exp(-d) + d - 1) * torch.exp(lp - inputs.sampler_logprobs)[valid]
            assert 0 < int((kl > overrides["kl_clamp"]).sum()) < len(d), name


@pytest.mark.parametrize("backend", BACKENDS)
def test_straight_through_kl_and_cispo_identities(backend):
    """Identities that pin the semantics independently of the reference: "k3+" has the value of k3 and the
    gradient of k2 (clamped or not), "k1+" likewise; CISPO's loss and gradient are REINFORCE's with the
    advantage scaled by clip(r) computed here in float64."""
    inputs = make_inputs("padded", dtype=torch.float32, seed=41)
    tol = tolerance(torch.float32, backend)
    runs = {kl: run(inputs, config_for("ppo_tis", dict(kl_coef=0.1, kl_type=kl)), backend) for kl in
            ("k1", "k2", "k3", "k1+", "k3+")}
    clamped = run(inputs, config_for("ppo_tis", dict(kl_coef=0.1, kl_type="k3+", kl_clamp=0.01)), backend)
    for plus, own in (("k1+", "k1"), ("k3+", "k3")):
        assert_close(f"{plus} loss", runs[plus][0].loss, runs[own][0].loss, tol["loss"])
        assert_close(f"{plus} grad", runs[plus][1], runs["k2"][1], tol["grad"])
    assert_close("k3+ clamped grad", clamped[1], runs["k2"][1], tol["grad"])
    assert abs(clamped[0].loss.item() - runs["k3"][0].loss.item()) > 1e-4  # the clamp bound the value

    cfg = config_for("ppo_tis", dict(policy="cispo", clip_low=0.1, clip_high=0.05))
    ratio = torch.exp(run(inputs, "reinforce", "reference", dtype=torch.float64)[0].logprobs
                      - inputs.old_logprobs.double())
    kept = ratio.clamp(1 - cfg.clip_low, 1 + cfg.clip_high)
    assert ((kept != ratio) & inputs.mask).any() and ((kept == ratio) & inputs.mask).any()  # the clip binds
    out, grad = run(inputs, cfg, backend)
    reweighted = Inputs(**{**inputs.__dict__, "advantages": (inputs.advantages.double() * kept).float()})
    ref, ref_grad = run(reweighted, config_for("reinforce_tis"), backend)
    assert_close("cispo loss", out.loss, ref.loss, 1e-5)
    assert_close("cispo grad", grad, ref_grad, 1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("with_old", [True, False], ids=["old", "no_old"])
def test_gspo_matches_verl_formulation(backend, with_old):
    """GSPO as verl writes it (core_algos.compute_policy_loss_gspo: per token log s_it = lp - sg(lp) +
    sg(log s_i), loss max(-A s_it, -A clip(s_it)), seq-mean-token-mean), differentiated by autograd here in
    float64, against fused_is's ratio_level="sequence" (whose reference differentiates through the mean,
    as TRL writes it). The two have the same gradient when the advantage is one per sequence (GRPO, the
    GSPO paper); with advantages that vary within a sequence verl's stop-gradient form is not the gradient
    of its own loss value, and fused_is follows the exact gradient (TRL's)."""
    inputs = make_inputs("packed", batch=4, seq_len=9, dtype=torch.float32, seed=43)
    seq = torch.repeat_interleave(torch.arange(4), inputs.cu_seqlens.diff())
    inputs.advantages = torch.randn(4, generator=torch.Generator().manual_seed(43))[seq]
    cfg = config_for("ppo", dict(ratio_level="sequence", clip_low=0.01, clip_high=0.02,
                                 loss_agg="seq-mean-token-mean"))
    out, grad = run(inputs, cfg, backend, with_old=with_old)

    logits = inputs.logits.double().requires_grad_()
    lp = torch.log_softmax(logits, -1).gather(1, inputs.tokens.clamp(min=0)[:, None]).squeeze(1)
    old = inputs.old_logprobs.double() if with_old else lp.detach()
    mask, adv = inputs.mask.double(), inputs.advantages.double()
    per_token = []
    clipped_any = False
    for a, b in zip(inputs.cu_seqlens[:-1].tolist(), inputs.cu_seqlens[1:].tolist()):
        m = mask[a:b]
        log_s = torch.where(m > 0, lp[a:b] - old[a:b], 0.0).sum() / m.sum().clamp(min=1)
        log_s_t = lp[a:b] - lp[a:b].detach() + log_s.detach()
        s_t = torch.exp(log_s_t)
        losses = torch.maximum(-adv[a:b] * s_t, -adv[a:b] * s_t.clamp(1 - cfg.clip_low, 1 + cfg.clip_high))
        clipped_any |= bool((s_t.detach() - s_t.detach().clamp(1 - cfg.clip_low, 1 + cfg.clip_high)).abs().max() > 0)
        if m.sum() > 0:
            per_token.append((losses * m).sum() / m.sum())
    loss = torch.stack(per_token).mean()
    loss.backward()
    assert clipped_any or not with_old  # with old logprobs, some sequence's ratio is clipped
    assert_close("loss", out.loss, loss, 1e-6, scale=1.0)
    assert_close("grad", grad, logits.grad, tolerance(torch.float32, backend)["grad"])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("with_old", [True, False], ids=["old", "no_old"])
def test_gmpo_matches_verl_geo_mean(backend, with_old):
    """GMPO as verl writes it (core_algos.compute_policy_loss_geo_mean: sign-wise clamp of the token log
    ratio, exp of its masked mean, times the sequence's mean advantage, torch.mean over sequences),
    differentiated by autograd in float64, against policy="gmpo" with loss_agg="seq-mean-token-mean" (equal
    when the advantage is one per sequence). verl's torch.mean counts a sequence with no unmasked token
    (the last one here); fused_is's sequence means do not, so normalizer= the number of sequences maps it."""
    inputs = make_inputs("packed", batch=4, seq_len=9, dtype=torch.float32, seed=44)
    seq = torch.repeat_interleave(torch.arange(4), inputs.cu_seqlens.diff())
    inputs.advantages = torch.randn(4, generator=torch.Generator().manual_seed(44))[seq]
    cfg = config_for("ppo", dict(policy="gmpo", clip_low=0.08, clip_high=0.1, loss_agg="seq-mean-token-mean"))
    assert not inputs.mask[18:].any()  # an empty sequence
    out, grad = run(inputs, cfg, backend, with_old=with_old, normalizer=4.0)

    logits = inputs.logits.double().requires_grad_()
    lp = torch.log_softmax(logits, -1).gather(1, inputs.tokens.clamp(min=0)[:, None]).squeeze(1)
    old = inputs.old_logprobs.double() if with_old else lp.detach()
    mask, adv = inputs.mask.double(), inputs.advantages.double()
    losses, clipped = [], 0
    for a, b in zip(inputs.cu_seqlens[:-1].tolist(), inputs.cu_seqlens[1:].tolist()):
        m = mask[a:b]
        nkl = torch.where(m > 0, lp[a:b] - old[a:b], 0.0)
        sgn = torch.sign(adv[a:b])
        nkl_clamp = torch.clamp(nkl, -cfg.clip_low, cfg.clip_high)
        nkl_min = sgn * torch.min(sgn * nkl, sgn * nkl_clamp)
        ratio = torch.exp((nkl_min * m).sum() / (m.sum() + 1e-8))
        losses.append(-(adv[a:b] * m).sum() / (m.sum() + 1e-8) * ratio)
        clipped += int(((nkl != nkl_min) & (m > 0)).sum())
    loss = torch.stack(losses).mean()
    loss.backward()
    assert clipped > 0 or not with_old  # with old logprobs the clip binds somewhere
    assert_close("loss", out.loss, loss, 1e-6, scale=1.0)
    assert_close("grad", grad, logits.grad, tolerance(torch.float32, backend)["grad"])


@pytest.mark.parametrize("backend", BACKENDS)
def test_sapo_saturated_gate_is_finite(backend):
    """A log ratio of 100 saturates SAPO's gate: gradient 0 there, not 0 * inf = nan (fp32 exp overflows
    at 88; the kernels form the ratio from min(log r, 80))."""
    inputs = make_inputs("padded", dtype=torch.float32, seed=45)
    inputs.sampler_logprobs[2, 3] = inputs.sampler_logprobs[2, 3] - 100.0
    inputs.mask[2, 3] = True
    inputs.advantages[2, 3] = 1.0
    out, grad, _, _ = check_against_reference(inputs, config_for("ppo_is", dict(policy="sapo")), backend)
    assert torch.isfinite(grad).all() and torch.isfinite(out.loss)


@pytest.mark.parametrize("backend", BACKENDS)
def test_normalizer(backend):
    inputs = make_inputs("packed", dtype=torch.float32, seed=14)
    for agg in ("token-mean", "seq-mean-token-mean"):
        cfg = config_for("ppo_tis", dict(loss_agg=agg))
        out, grad = run(inputs, cfg, backend, normalizer=123.0)
        ref, ref_grad = run(inputs, cfg, "reference", dtype=torch.float64, normalizer=123.0)
        plain, _ = run(inputs, cfg, "reference", dtype=torch.float64)
        tol = tolerance(torch.float32, backend)
        assert_close("loss", out.loss, ref.loss, tol["loss"])
        assert_close("grad", grad, ref_grad, tol["grad"])
        assert abs(ref.loss.item() - plain.loss.item()) > 1e-6  # the normalizer did change the loss


@pytest.mark.parametrize("backend", BACKENDS)
def test_geometric_single_unmasked_token_in_sequence(backend):
    inputs = make_inputs("padded", dtype=torch.float32, seed=15)
    inputs.mask[1] = False
    inputs.mask[1, 3] = True
    inputs.old_logprobs[1, 3] = inputs.sampler_logprobs[1, 3]  # geometric mean of one token: w = 1, kept
    out, _, ref, _ = check_against_reference(inputs, "geo_mis", backend)
    check_against_reference(inputs, "geo_mis", backend, with_old=False)


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_grad_and_token_logprobs(backend):
    inputs = make_inputs("padded", dtype=torch.bfloat16, seed=16)
    logits = inputs.logits.clone().requires_grad_()
    with torch.no_grad():
        out = fused_is.policy_loss(logits, inputs.tokens, inputs.advantages, backend=backend, **inputs.kwargs())
    assert not out.loss.requires_grad
    tokens = inputs.tokens.clamp(min=0)
    for tau in (1.0, 0.6):
        lp, ent = fused_is.token_logprobs(inputs.logits, tokens, temperature=tau, backend=backend)
        ref_lp, ref_ent = fused_is.token_logprobs(inputs.logits.double(), tokens, temperature=tau, backend="reference")
        assert lp.dtype == torch.float32 and lp.shape == tokens.shape
        assert_close("token_logprobs", lp, ref_lp, 1e-6)
        assert_close("token_entropy", ent, ref_ent, 1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_grad_output_scale_is_applied_in_fp32(backend):
    """backward scales the bf16 gradient by grad_output in fp32 with one rounding: rounding the scale to
    bf16 first (1.7 -> 1.703125) put 0.2% on every element, and the hypothesis test over bf16 found a
    gradient 2 ulps off the float64 reference from it."""
    inputs = make_inputs("padded", dtype=torch.bfloat16, seed=31)
    grads = []
    for scale in (1.0, 1.7):
        x = inputs.logits.clone().requires_grad_()
        out = fused_is.policy_loss(x, inputs.tokens, inputs.advantages, config="ppo_tis", backend=backend,
                                   **inputs.kwargs())
        (out.loss * scale).backward()
        grads.append(x.grad)
    assert torch.equal(grads[1], (grads[0].float() * 1.7).to(torch.bfloat16))


SECOND_CORRECTIONS = [c for c in OPTION_CASES if "rejection" in c[0] or "off_policy" in c[0]]


@pytest.mark.parametrize("name,preset,overrides", SECOND_CORRECTIONS, ids=[c[0] for c in SECOND_CORRECTIONS])
@pytest.mark.parametrize("layout,seed", [("padded", 7), ("packed", 21)])
def test_second_corrections_act(layout, seed, name, preset, overrides):
    """On these inputs every rejection / off-policy case drops a share strictly between 0 and 1 and moves the
    loss: the option cases above cannot pass as no-ops."""
    inputs = make_inputs(layout, dtype=torch.float64, seed=seed)
    cfg = config_for(preset, overrides)
    plain = config_for(preset, {k: v for k, v in overrides.items() if k not in ("rejection", "off_policy_mask")})
    out, _ = run(inputs, cfg, "reference")
    without, _ = run(inputs, plain, "reference")
    key = "rejected_frac" if cfg.rejection else "off_policy_masked_frac"
    assert 0.0 < out.metrics[key] < 1.0, out.metrics
    assert abs(out.loss.item() - without.loss.item()) > 1e-6


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_rejection_is_the_modified_mask(backend, layout):
    """verl's semantics: rejection equals passing the mask with the rejected tokens removed (out of every term
    and every count), here for a token band on pi_sampler / pi_old with sequence aggregation."""
    inputs = make_inputs(layout, dtype=torch.float32, seed=71)
    low, high = 0.6, 1.8
    cfg = config_for("ppo_tis", dict(rejection={"token_k1": (low, high)}, loss_agg="seq-mean-token-mean"))
    k1 = (inputs.sampler_logprobs - inputs.old_logprobs).double()
    keep = (k1 >= math.log(low)) & (k1 <= math.log(high))
    assert 0 < int((inputs.mask & ~keep).sum()) < int(inputs.mask.sum())
    out, grad = run(inputs, cfg, backend)
    inputs.mask = inputs.mask & keep
    modified, modified_grad = run(inputs, config_for("ppo_tis", dict(loss_agg="seq-mean-token-mean")), backend)
    assert torch.equal(out.loss, modified.loss) and torch.equal(grad, modified_grad)


@pytest.mark.parametrize("backend", BACKENDS + ["reference"])
@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_given_is_weights_equal_the_configs_own(backend, layout):
    """is_weights (the trainer's own W: verl's rollout_is_weights, TRL's importance_sampling_ratio) with
    is_level="none" give the loss and gradient of the config that forms the same W itself; the metrics
    describe the given weights."""
    inputs = make_inputs(layout, dtype=torch.float64 if backend == "reference" else torch.float32, seed=81)
    cfg = config_for("ppo_tis", dict(is_cap=1.3, is_floor=0.8, loss_agg="seq-mean-token-mean"))
    w = torch.exp((inputs.old_logprobs - inputs.sampler_logprobs).double()).clamp(0.8, 1.3)
    w = torch.where(inputs.mask, w, torch.full_like(w, float("nan")))  # masked positions may hold anything
    assert 0 < int(((w == 1.3) | (w == 0.8)).sum()) < int(inputs.mask.sum())
    own, own_grad = run(inputs, cfg, backend)
    given, given_grad = run(inputs, config_for("ppo", dict(loss_agg="seq-mean-token-mean")), backend, is_weights=w)
    tol = tolerance(inputs.logits.dtype, backend)
    assert_close("loss", given.loss, own.loss, tol["loss"], scale=max(1.0, abs(own.loss.item())))
    assert_close("grad", given_grad, own_grad, tol["grad"])
    for key in ("is_weight_mean", "is_weight_max", "is_weight_min", "is_masked_frac"):
        assert abs(given.metrics[key] - own.metrics[key]) <= 1e-6, key
    assert "is_truncated_frac" not in given.metrics and "is_truncated_frac" in own.metrics


@pytest.mark.parametrize("backend", BACKENDS)
def test_given_is_weights_per_sequence(backend):
    """[B] weights (one per sequence: TRL's sequence modes) equal the expanded [B, T] ones."""
    inputs = make_inputs("padded", dtype=torch.float32, seed=82)
    w = torch.tensor([0.5, 1.0, 2.0])
    a, grad_a = run(inputs, "ppo", backend, is_weights=w)
    b, grad_b = run(inputs, "ppo", backend, is_weights=w[:, None].expand_as(inputs.tokens))
    assert torch.equal(a.loss, b.loss) and torch.equal(grad_a, grad_b)
    c, _ = run(inputs, "ppo", backend)
    assert abs(a.loss.item() - c.loss.item()) > 1e-6


@pytest.mark.parametrize("bad,match,exc", [
    ("is_level", "use is_level='none' with is_weights", ValueError),
    (-0.5, "is_weights must be >= 0", ValueError),
    (float("nan"), "is_weights must be finite", ValueError),
    ("shape", "is_weights must have shape", ValueError),
    ("int", "is_weights must be a floating-point", TypeError),
])
def test_given_is_weights_errors(bad, match, exc):
    inputs = make_inputs("padded", dtype=torch.float32, seed=83)
    w = torch.ones(inputs.tokens.shape)
    cfg = "ppo"
    if bad == "is_level":
        cfg = "ppo_tis"
    elif bad == "shape":
        w = torch.ones(5)
    elif bad == "int":
        w = torch.ones(inputs.tokens.shape, dtype=torch.int64)
    else:
        w[0, 2] = bad  # unmasked position
        assert inputs.mask[0, 2]
    logits = inputs.logits.clone().requires_grad_()
    with pytest.raises(exc, match=match):
        fused_is.policy_loss(logits, inputs.tokens, inputs.advantages, config=cfg, is_weights=w,
                             **inputs.kwargs())
    assert logits.grad is None


@pytest.mark.parametrize("backend", BACKENDS)
def test_entropy_agg_and_its_normalizer(backend):
    """entropy_agg equal to loss_agg changes nothing; a token-mean entropy term under a per-sequence loss is
    -c sum_t m_t H_t / entropy_normalizer on top of the loss without it, and moves the gradient."""
    inputs = make_inputs("packed", dtype=torch.float32, seed=91)
    base = dict(loss_agg="seq-mean-token-mean", entropy_coef=0.05)
    same, same_grad = run(inputs, config_for("ppo_tis", base), backend)
    again, again_grad = run(inputs, config_for("ppo_tis", dict(base, entropy_agg="seq-mean-token-mean")), backend)
    assert torch.allclose(again.loss, same.loss, rtol=1e-6, atol=0) and torch.equal(again_grad, same_grad)
    cfg = config_for("ppo_tis", dict(base, entropy_agg="token-mean"))
    out, grad = run(inputs, cfg, backend, entropy_normalizer=7.0)
    plain, plain_grad = run(inputs, config_for("ppo_tis", dict(base, entropy_coef=0.0)), backend)
    mask = inputs.mask.double()
    expected = plain.loss.double() - 0.05 * (out.entropy.double() * mask).sum() / 7.0
    assert abs(out.loss.double() - expected) <= 1e-6 * max(1.0, abs(float(expected)))
    assert not torch.allclose(grad, same_grad)
    ref, ref_grad = run(inputs, cfg, "reference", dtype=torch.float64, entropy_normalizer=7.0)
    tol = tolerance(torch.float32, backend)
    assert_close("loss", out.loss, ref.loss, tol["loss"], scale=max(1.0, abs(ref.loss.item())))
    assert_close("grad", grad, ref_grad, tol["grad"])


def test_entropy_normalizer_errors():
    inputs = make_inputs("padded", dtype=torch.float32, seed=92)
    with pytest.raises(ValueError, match="entropy_normalizer replaces the count of LossConfig.entropy_agg"):
        run(inputs, config_for("ppo_tis", dict(entropy_coef=0.1)), "torch", entropy_normalizer=3.0)
    with pytest.raises(ValueError, match="entropy_normalizer must be a positive finite number"):
        run(inputs, config_for("ppo_tis", dict(entropy_coef=0.1, entropy_agg="token-mean")), "torch",
            entropy_normalizer=0.0)


@pytest.mark.parametrize("overrides", [dict(policy="vespo", is_level="none"), dict(off_policy_mask=0.1),
                                       dict(rejection={"seq_mean_k3": 0.1}),
                                       dict(entropy_coef=0.1, entropy_agg="seq-mean-token-mean")],
                         ids=["vespo", "off_policy_mask", "seq_rejection", "entropy_agg"])
def test_sequence_options_need_cu_seqlens_for_packed_input(overrides):
    """Packed input without cu_seqlens would be one sequence: every sequence-level option refuses it."""
    inputs = make_inputs("packed", dtype=torch.float32, seed=93)
    with pytest.raises(ValueError, match="cu_seqlens is required"):
        run(inputs, config_for("ppo_tis", overrides), "torch", cu_seqlens=None)


@pytest.mark.parametrize("backend", INPLACE_BACKENDS)
@pytest.mark.parametrize("normalizer,scale", [
    (3e5, 65536.0),   # tiny gradients that fp16 flushes to 0 before a GradScaler-sized scale: recovered by it
    (3e-5, 1 / 64),   # gradients past fp16's 65504 whose scaled values fit: finite
])
@pytest.mark.parametrize("inplace", [False, True])
def test_fp16_gradient_is_scaled_before_it_is_rounded(backend, normalizer, scale, inplace):
    """fp16 logits: grad_output (a GradScaler's scale, 1 / accumulation steps) multiplies the gradient before its
    one rounding to fp16, so the scaled gradient equals the float64 one, scaled, to fp16's precision."""
    inputs = make_inputs("padded", dtype=torch.float16, vocab=200, seed=8)
    leaf = inputs.logits.clone().requires_grad_()
    work = leaf * 1 if inplace else leaf
    out = fused_is.policy_loss(work, inputs.tokens, inputs.advantages, normalizer=normalizer, backend=backend,
                               inplace=inplace, **inputs.kwargs())
    (out.loss * scale).backward()
    ref_logits = inputs.logits.double().requires_grad_()
    ref = fused_is.policy_loss(ref_logits, inputs.tokens, inputs.advantages, normalizer=normalizer,
                               backend="reference", **inputs.kwargs())
    (ref.loss * scale).backward()
    expected = ref_logits.grad
    assert 0.1 < expected.abs().max() < 6e4, "the scaled gradient must fit fp16, well"
    assert torch.isfinite(leaf.grad).all()
    assert_close("scaled fp16 grad", leaf.grad, expected, 4e-3)


@pytest.mark.parametrize("backend", BACKENDS + ["reference"])
@pytest.mark.parametrize("preset", ["ppo_tis", "seq_mis", "gspo"])
def test_loss_scale_is_the_scaled_loss(backend, preset):
    """loss_scale=s: out.loss is s times the loss and backward its gradient (the kernels write it scaled), equal to
    scaling the output by s; the metrics are the unscaled ones."""
    inputs = make_inputs("packed", dtype=torch.float64 if backend == "reference" else torch.float32, seed=9)
    results = []
    for scale in (None, 0.37):
        leaf = inputs.logits.clone().requires_grad_()
        out = fused_is.policy_loss(leaf, inputs.tokens, inputs.advantages, config=preset, backend=backend,
                                   loss_scale=scale, **inputs.kwargs(with_old=False))
        (out.loss if scale else 0.37 * out.loss).backward()
        results.append((out, leaf.grad))
    (plain, plain_grad), (scaled, scaled_grad) = results
    torch.testing.assert_close(scaled.loss, 0.37 * plain.loss, rtol=1e-6, atol=1e-9)
    assert_close("grad", scaled_grad, plain_grad, 1e-6)
    assert scaled.metrics == plain.metrics


@pytest.mark.parametrize("value,exc", [(0.0, ValueError), (-1.0, ValueError), (float("inf"), ValueError),
                                       ("2", TypeError), (torch.tensor(2.0), TypeError)])
def test_bad_loss_scale_is_refused(value, exc):
    inputs = make_inputs("padded", dtype=torch.float32, seed=10)
    with pytest.raises(exc, match="loss_scale"):
        fused_is.policy_loss(inputs.logits, inputs.tokens, inputs.advantages, loss_scale=value, **inputs.kwargs())


@pytest.mark.skipif(backends.unavailable_reason("triton", torch.empty(1, 1)) is not None,
                    reason="needs the Triton kernels (TRITON_INTERPRET=1 on the CPU)")
def test_triton_scale_kernel_covers_every_element():
    """The backward's grad_output scale (validate="async"): a grid of a few programs per SM striding over the buffer
    scales every element exactly once (sizes around the block, more blocks than programs), and a factor of 1 leaves
    the buffer untouched."""
    from fused_is.backends import triton as triton_backend

    block = triton_backend.SCALE_BLOCK
    for n in (1, block - 1, block, block + 1, 7 * block + 5):
        grad = torch.randn(n, generator=torch.Generator().manual_seed(n))
        expected = grad * torch.tensor(1.7)
        triton_backend.scale_(grad, torch.tensor(1.7))
        assert torch.equal(grad, expected), n
        same = grad.clone()
        triton_backend.scale_(grad, torch.tensor(1.0))
        assert torch.equal(grad, same), n


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b != "torch"])
def test_kernels_never_read_a_stray_token_column(backend):
    """The front door replaces ids outside [0, V) before any kernel runs; a direct caller of a kernel (the custom ops,
    the backend objects) who passes one gets lp = NaN at that row, never a logit of another row or past the
    buffer, and no gradient column written for it; the other rows are unchanged."""
    from fused_is.backends import abi

    logits = torch.randn(5, 67, generator=torch.Generator().manual_seed(3))
    ids = torch.tensor([1, 67, -3, 66, 1000])
    impl = backends.implementation(backend)
    lp, entropy = impl.stats(logits, ids, 1.0)
    expected = torch.log_softmax(logits.double(), -1)
    assert torch.isnan(lp[[1, 2, 4]]).all()
    assert_close("lp", lp[[0, 3]], expected[[0, 3], [1, 66]], 1e-5)
    assert torch.isfinite(entropy).all()
    # the one-pass kernel: a g of 0 everywhere (stats_only's inert rows) writes exact zeros, stray rows included
    grad = torch.full_like(logits, 7.0)
    lp2, _ = impl.fused(logits, ids, abi.stats_only(5, 1.0, logits.device), grad)
    assert torch.isnan(lp2[[1, 2, 4]]).all() and torch.equal(lp2[[0, 3]], lp[[0, 3]])
    assert torch.equal(grad, torch.zeros_like(grad))
