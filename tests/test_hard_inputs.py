"""The inputs real trainers send (issue 13): -inf logits, NaN and +inf, impossible logprobs, N x V > 2**31.

-inf logits (padded vocabulary, banned or top-k/top-p filtered tokens) must be exact in every backend: the
oracle is the float64 reference on the same logits with -inf replaced by -1e4, where exp underflows to an
exact 0, so no -inf code path is involved on the oracle's side. NaN, +inf, a row of -inf and a sampled
token with logit -inf are errors naming the row at unmasked positions, and nothing at masked ones.
"""

import pytest
import torch

import fused_is
from fused_is import backends

from cases import Inputs, assert_close, config_for, logprob_scale, make_inputs, run, tolerance

BACKENDS = backends.available_backends()  # the reference too: it is a user-facing backend
KERNELS = [b for b in BACKENDS if b != "reference"]
NEG_INF = float("-inf")


def _with_neg_inf(pattern: str, dtype, seed: int, fill=NEG_INF):
    """Inputs whose logits hold -inf: the last 8 columns of every row ("padded_vocab": a vocabulary padded
    beyond the tokenizer), or all but 12 random columns of each row ("top_k"). Sampled tokens avoid them."""
    inputs = make_inputs("padded", vocab=64, dtype=dtype, seed=seed)
    logits = inputs.logits
    gen = torch.Generator().manual_seed(seed)
    if pattern == "padded_vocab":
        banned = torch.zeros(logits.shape, dtype=torch.bool)
        banned[..., -8:] = True
    else:
        keep = torch.rand(logits.shape, generator=gen).argsort(-1) < 12
        banned = ~keep
    tokens = inputs.tokens.clone()
    allowed = (~banned).double()
    resample = torch.multinomial(allowed.reshape(-1, logits.shape[-1]), 1, generator=gen).reshape(tokens.shape)
    hit = banned.gather(-1, tokens.clamp(min=0).unsqueeze(-1)).squeeze(-1) | (tokens < 0)
    tokens = torch.where(hit & inputs.mask, resample, tokens)
    inputs.tokens = tokens
    inputs.logits = logits.masked_fill(banned, fill)
    # sampler/old/ref logprobs near the new lp (fresh values, <= 0)
    lp = torch.log_softmax(inputs.logits.double(), -1).gather(-1, tokens.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    lp = torch.where(torch.isfinite(lp), lp, torch.full_like(lp, -5.0))
    noise = lambda s: s * torch.randn(lp.shape, generator=gen, dtype=torch.float64)  # noqa: E731
    inputs.old_logprobs = (-(lp + noise(0.15)).abs()).float()
    inputs.sampler_logprobs = (-(inputs.old_logprobs.double() + noise(0.5)).abs()).float()
    inputs.ref_logprobs = (-(lp + noise(0.3)).abs()).float()
    return inputs, banned


def _oracle(inputs):
    """The same inputs with -inf (or a dtype's most negative value) replaced by -1e4 in float64
    (exp(-1e4 - max) is an exact 0 there)."""
    finite = inputs.logits.double()
    finite = finite.masked_fill(torch.isneginf(finite) | (finite <= torch.finfo(inputs.logits.dtype).min), -1.0e4)
    return type(inputs)(**{**inputs.__dict__, "logits": finite})


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("pattern", ["padded_vocab", "top_k"])
@pytest.mark.parametrize("preset, overrides, with_old", [
    ("ppo_tis", dict(entropy_coef=0.01, kl_coef=0.05, kl_type="k3"), True),  # h != 0: the h p log p term
    ("seq_tis", dict(entropy_coef=0.02), False),  # the two-pass plan (stats pass, then fused)
    ("reinforce_tis", {}, False),
], ids=["ppo_entropy_kl", "seq_two_pass", "reinforce"])
def test_neg_inf_logits_are_exact(backend, dtype, pattern, preset, overrides, with_old):
    inputs, banned = _with_neg_inf(pattern, dtype, seed=7 + len(pattern))
    cfg = config_for(preset, overrides)
    out, grad = run(inputs, cfg, backend, grad_scale=1.7, with_old=with_old)
    ref, ref_grad = run(_oracle(inputs), cfg, "reference", grad_scale=1.7, with_old=with_old)
    tol = tolerance(dtype, backend)
    assert torch.isfinite(out.loss) and torch.isfinite(out.entropy).all()
    assert_close("loss", out.loss, ref.loss, tol["loss"], scale=max(1.0, abs(ref.loss.item())))
    assert_close("grad", grad, ref_grad, tol["grad"])
    assert_close("logprobs", out.logprobs, ref.logprobs, tol["logprobs"], mask=inputs.mask,
                 scale=logprob_scale(ref.logprobs[inputs.mask]))
    assert_close("entropy", out.entropy, ref.entropy, tol["logprobs"], scale=logprob_scale(ref.entropy))
    assert (grad[banned] == 0).all(), "a -inf logit must get exactly 0 gradient"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("pattern", ["padded_vocab", "top_k"])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_most_negative_finite_logits_are_exact(backend, dtype, pattern, temperature):
    """torch.finfo(dtype).min as a masking value: (z - max) log2(e) / tau overflows fp32 to -inf there, which
    must still give p = 0 exactly, not 0 * -inf = NaN in the online softmax."""
    inputs, banned = _with_neg_inf(pattern, dtype, seed=3 + len(pattern), fill=torch.finfo(dtype).min)
    cfg = config_for("ppo_tis", dict(entropy_coef=0.01, temperature=temperature))
    out, grad = run(inputs, cfg, backend, grad_scale=1.7)
    ref, ref_grad = run(_oracle(inputs), cfg, "reference", grad_scale=1.7)
    tol = tolerance(dtype, backend)
    assert torch.isfinite(out.loss) and torch.isfinite(out.entropy).all()
    assert_close("loss", out.loss, ref.loss, tol["loss"], scale=max(1.0, abs(ref.loss.item())))
    assert_close("grad", grad, ref_grad, tol["grad"])
    assert_close("entropy", out.entropy, ref.entropy, tol["logprobs"], scale=logprob_scale(ref.entropy))
    assert (grad[banned] == 0).all(), "a logit of finfo.min must get exactly 0 gradient"


@pytest.mark.parametrize("backend", BACKENDS)
def test_token_logprobs_neg_inf(backend):
    inputs, banned = _with_neg_inf("top_k", torch.float32, seed=3)
    tokens = inputs.tokens.clamp(min=0)
    valid = inputs.mask
    lp, ent = fused_is.token_logprobs(inputs.logits, tokens, backend=backend, mask=valid)
    exact = torch.log_softmax(_oracle(inputs).logits, -1)
    ref_lp = exact.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    ref_ent = -(exact.exp() * exact).sum(-1)
    assert_close("lp", lp, ref_lp, 1e-6, mask=valid, scale=logprob_scale(ref_lp[valid]))
    assert_close("entropy", ent, ref_ent, 1e-6, scale=logprob_scale(ref_ent))
    # without the mask, a masked position whose token is banned is an error naming it
    bad = (banned.gather(-1, tokens.unsqueeze(-1)).squeeze(-1) & ~valid).nonzero()
    if len(bad):
        b, t = (int(i) for i in bad[0])
        with pytest.raises(ValueError, match=rf"token {int(tokens[b, t])} has logit -inf at row {b * 8 + t}"):
            fused_is.token_logprobs(inputs.logits, tokens, backend=backend)


@pytest.mark.parametrize("backend", KERNELS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_neg_inf_columns_at_the_smallest_temperature(backend, dtype):
    """tau = 1e-8 (MIN_TEMPERATURE) with the last 16 of 64 columns -inf (whole 16-byte vectors of them): the online
    state of columns that saw only -inf is rescaled to exact zeros, lp and H stay finite and exact (H about 0: the
    softmax is one-hot at this temperature)."""
    inputs, _ = _with_neg_inf("padded_vocab", dtype, seed=11)
    inputs.logits[..., -16:] = NEG_INF
    tokens = inputs.logits.argmax(-1)  # the one token with probability about 1
    lp, ent = fused_is.token_logprobs(inputs.logits, tokens, 1e-8, backend, mask=inputs.mask)
    exact = torch.log_softmax(_oracle(inputs).logits / 1e-8, -1)
    ref_lp = exact.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    ref_ent = -(exact.exp() * torch.where(exact.exp() > 0, exact, 0.0)).sum(-1)
    valid = inputs.mask
    assert torch.isfinite(lp[valid]).all() and torch.isfinite(ent[valid]).all(), (lp, ent)
    assert_close("lp", lp, ref_lp, 1e-6, mask=valid, scale=1.0)
    assert_close("entropy", ent, ref_ent, 1e-6, mask=valid, scale=1.0)


def _spoil(logits, row, kind, token):
    """Row `row` of [B, T, V] logits given a bad value of `kind`; returns the message expected."""
    b, t = divmod(row, logits.shape[1])
    x = logits[b, t]
    if kind == "nan":
        x[5] = float("nan")
        return "NaN"
    if kind == "posinf":
        x[9] = float("inf")
        return r"\+inf"
    if kind == "all_neg_inf":
        x.fill_(NEG_INF)
        return "every logit"
    x[token] = NEG_INF
    return f"sampled token {token} has logit -inf"


KINDS = ["nan", "posinf", "all_neg_inf", "target_neg_inf"]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("preset, with_old", [("ppo_tis", True), ("seq_tis", False)], ids=["one_pass", "two_pass"])
def test_bad_logits_at_unmasked_rows_raise(backend, kind, preset, with_old):
    inputs = make_inputs("padded", vocab=64, dtype=torch.float32, seed=21)
    row = 13  # logits[1, 5], unmasked
    inputs.mask.view(-1)[row] = True
    what = _spoil(inputs.logits, row, kind, int(inputs.tokens.view(-1)[row]))
    with pytest.raises(ValueError, match=rf"logits: .*{what}.*row {row} \(logits\[1, 5\]\)"):
        run(inputs, config_for(preset), backend, with_old=with_old)
    with pytest.raises(ValueError, match=rf"row {row}"):
        fused_is.token_logprobs(inputs.logits, inputs.tokens.clamp(min=0), backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("preset, with_old", [("ppo_tis", True), ("seq_tis", False)], ids=["one_pass", "two_pass"])
def test_bad_logits_at_masked_rows_are_ignored(backend, kind, preset, with_old):
    """A masked row may hold anything: the result is that of the same row with ordinary logits, and its
    gradient is exactly 0."""
    inputs = make_inputs("padded", vocab=64, dtype=torch.float32, seed=22)
    row = 10
    inputs.mask.view(-1)[row] = False
    clean = type(inputs)(**{**inputs.__dict__, "logits": inputs.logits.clone()})
    _spoil(inputs.logits, row, kind, int(inputs.tokens.view(-1)[row].clamp(min=0)))
    cfg = config_for(preset, dict(entropy_coef=0.01))
    out, grad = run(inputs, cfg, backend, with_old=with_old)
    ref, ref_grad = run(clean, cfg, backend, with_old=with_old)
    assert torch.isfinite(out.loss) and torch.isfinite(grad).all()
    assert (grad.view(-1, 64)[row] == 0).all()
    assert out.loss.item() == pytest.approx(ref.loss.item(), rel=1e-6, abs=1e-7)
    assert_close("grad", grad, ref_grad, 1e-6)
    for key, value in ref.metrics.items():
        assert out.metrics[key] == pytest.approx(value, rel=1e-6, abs=1e-7), key


@pytest.mark.parametrize("arg", ["sampler_logprobs", "old_logprobs", "ref_logprobs"])
def test_positive_logprobs_are_refused(arg):
    inputs = make_inputs("padded", vocab=64, dtype=torch.float32, seed=23)
    cfg = config_for("ppo_tis", dict(kl_coef=0.1))
    values = getattr(inputs, arg).clone()
    values[2, 3] = 0.75  # e.g. a probability passed as a logprob
    inputs.mask[2, 3] = True
    setattr(inputs, arg, values)
    with pytest.raises(ValueError, match=rf"{arg} must be logprobs \(<= 0\).*0\.75 at position \(2, 3\)"):
        run(inputs, cfg, "torch")
    # rounding noise just above 0 is accepted; anything at a masked position too
    values[2, 3] = 5e-5
    run(inputs, cfg, "torch")
    values[2, 3] = 3.0
    inputs.mask[2, 3] = False
    run(inputs, cfg, "torch")


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["cpu"])  # torch: tests/test_long_context.py, every row live, supersedes it
def test_beyond_2_pow_31_elements(backend, monkeypatch):
    """N x V > 2**31 elements on the CPU kernel (bf16, 14208 x 151936, 4.3 GB, in place), masked rows around the
    live ones: row offsets are int64. Rows on both sides of element 2**31 are checked against the float64
    reference; the rest of the batch is zeros (cheap to make) and masked. token_logprobs too."""
    if backend not in BACKENDS:
        pytest.skip("the CPU extension is not built here (`fused-is build cpu`)")
    from fused_is.backends import torch_chunked

    monkeypatch.setattr(torch_chunked, "CHUNK_ELEMENTS", 1 << 25)  # 128 MiB chunks: fewer, larger torch ops
    n, vocab = 14208, 151936
    logits = torch.zeros(n, vocab, dtype=torch.bfloat16)
    rows = torch.tensor([0, 1, 2**31 // vocab, 2**31 // vocab + 1, n - 2, n - 1])
    assert int(rows[2]) * vocab < 2**31 < int(rows[3]) * vocab
    gen = torch.Generator().manual_seed(0)
    logits[rows] = (2 * torch.randn(len(rows), vocab, generator=gen)).to(torch.bfloat16)
    tokens = torch.zeros(n, dtype=torch.long)
    tokens[rows] = torch.tensor([0, vocab - 1, 7, vocab - 2, 12345, vocab - 1])
    mask = torch.zeros(n, dtype=torch.bool)
    mask[rows] = True

    exact = torch.log_softmax(logits[rows].double(), -1)
    ref_lp, ref_ent = exact.gather(1, tokens[rows, None]).squeeze(1), -(exact.exp() * exact).sum(-1)
    lp = torch.full((n,), -5.0)
    lp[rows] = ref_lp.float()
    if backend == "cpu":  # the torch backend's stats are the fused pass's first half (73 s for both here)
        lp_cpu, ent = fused_is.token_logprobs(logits, tokens, backend=backend)
        assert_close("token_logprobs", lp_cpu[rows], ref_lp, 1e-6, scale=logprob_scale(ref_lp))
        assert_close("token_entropy", ent[rows], ref_ent, 1e-6, scale=logprob_scale(ref_ent))

    old = -(lp + 0.15 * torch.randn(n, generator=gen)).abs()
    samp = -(old + 0.5 * torch.randn(n, generator=gen)).abs()
    adv = torch.randn(n, generator=gen)
    cfg = config_for("ppo_tis", dict(entropy_coef=0.01))
    saved = logits[rows].clone()
    logits.requires_grad_()
    out = fused_is.policy_loss(logits, tokens, adv, sampler_logprobs=samp, old_logprobs=old, mask=mask,
                               config=cfg, backend=backend, inplace=True)
    out.loss.backward()
    assert logits.grad.data_ptr() == logits.data_ptr()
    grad = logits.detach()
    few = Inputs(logits=saved, tokens=tokens[rows], advantages=adv[rows],
                 sampler_logprobs=samp[rows], old_logprobs=old[rows], ref_logprobs=None,
                 mask=torch.ones(len(rows), dtype=torch.bool), cu_seqlens=None)
    ref, ref_grad = run(few, cfg, "reference", dtype=torch.float64)
    tol = tolerance(torch.bfloat16, backend)
    assert_close("grad rows", grad[rows], ref_grad, tol["grad"])
    assert_close("loss", out.loss, ref.loss, tol["loss"], scale=max(1.0, abs(ref.loss.item())))
    assert_close("logprobs rows", out.logprobs[rows], ref_lp, 1e-6, scale=logprob_scale(ref_lp))
    assert_close("entropy rows", out.entropy[rows], ref_ent, 1e-6, scale=logprob_scale(ref_ent))
    assert (grad[rows[3] + 1] == 0).all() and (grad[n - 3] == 0).all()  # masked rows: exact zeros
