"""The oracle itself: the reference's loss against a scalar, loop-by-loop reading of DESIGN.md section 2
in plain Python floats, its autograd gradient by gradcheck, and hypothesis property tests of the torch
and cpu backends against it over shapes and configurations."""

import dataclasses
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fused_is
from fused_is import LossConfig, backends

from cases import OPTION_CASES, PRESET_NAMES, check_against_reference, config_for, make_inputs, tolerance


def scalar_rejection(samp, old, mask, seqs, criteria):
    """The mask after verl's rollout_rs criteria, one token and one sequence at a time."""
    def stat(kind, t):
        d = min(20.0, max(-20.0, old[t] - samp[t]))
        p = min(1 - 1e-6, max(1e-6, math.exp(samp[t])))
        q = min(1 - 1e-6, max(1e-6, math.exp(old[t])))
        return {"k1": -d, "k2": 0.5 * d * d, "k3": math.exp(d) - 1 - d, "tv": abs(p - q),
                "binary_kl": p * math.log(p / q) + (1 - p) * math.log((1 - p) / (1 - q))}[kind]

    out = list(mask)
    for a, b in seqs:
        live = [t for t in range(a, b) if mask[t]]
        for t in live:
            for name, low, high in criteria:
                kind = name.split("_", 2)[2] if name.startswith("seq_") else name[len("token_"):]
                if name.startswith("token"):
                    x = stat(kind, t)
                elif name.startswith("seq_sum"):
                    x = sum(stat(kind, u) for u in live)
                elif name.startswith("seq_mean"):
                    x = sum(stat(kind, u) for u in live) / len(live)
                else:
                    x = max(stat(kind, u) for u in live)
                passed = x <= high if low is None else math.log(low) <= x <= math.log(high)
                out[t] = out[t] and passed
    return out


def scalar_loss(logits, tokens, adv, samp, old, ref, mask, seqs, cfg, norm_length):
    """DESIGN.md section 2 with Python floats; seqs is a list of (start, stop) row ranges."""
    n = len(tokens)
    tau = cfg.temperature
    lp, ent = [], []
    for t in range(n):
        u = [z / tau for z in logits[t]]
        mx = max(u)
        lse = mx + math.log(sum(math.exp(x - mx) for x in u))
        p = [math.exp(x - lse) for x in u]
        lp.append(u[tokens[t]] - lse)
        ent.append(lse - sum(pj * x for pj, x in zip(p, u)))
    old = [old[t] if old is not None else lp[t] for t in range(n)]
    seq_of = {t: i for i, (a, b) in enumerate(seqs) for t in range(a, b)}
    gate = [1.0] * n
    if cfg.rejection:  # verl's rollout_rs: rejected tokens leave the mask; OpenRLHF's: their policy term is 0
        kept = scalar_rejection(samp, old, mask, seqs, cfg.rejection)
        if cfg.rejection_counts == "drop":
            mask = kept
        else:
            gate = [1.0 if k else 0.0 for k in kept]
    delta = [old[t] - samp[t] if (samp is not None and mask[t]) else 0.0 for t in range(n)]
    chosen = scalar_cov_selection(lp, adv, samp if cfg.ratio_ref == "sampler" else old, mask, cfg)
    losses = []
    for t in range(n):
        a, b = seqs[seq_of[t]]
        base_of = samp if cfg.ratio_ref == "sampler" else old
        if cfg.ratio_level == "sequence":  # GSPO: the mean log ratio over the sequence's unmasked tokens
            gspo_log_s = sum(lp[u] - base_of[u] for u in range(a, b) if mask[u]) / max(1, sum(mask[a:b]))
            if cfg.sequence_log_ratio_max is not None:  # clamped from above (verl's gspo at 10)
                gspo_log_s = min(gspo_log_s, cfg.sequence_log_ratio_max)
        if cfg.policy == "gmpo":  # the mean of log ratios clipped in the direction of each token's advantage
            def kept(u):
                x = lp[u] - base_of[u]
                if cfg.log_ratio_clamp is not None:
                    x = min(cfg.log_ratio_clamp, max(-cfg.log_ratio_clamp, x))
                return min(x, cfg.clip_high) if adv[u] > 0 else (max(x, -cfg.clip_low) if adv[u] < 0 else 0.0)
            gmpo_r = math.exp(sum(kept(u) for u in range(a, b) if mask[u]) / max(1, sum(mask[a:b])))
        def is_weight_of(u):
            a, b = seqs[seq_of[u]]
            if cfg.is_level == "none":
                return 1.0
            if cfg.is_level == "token":
                log_w = delta[u]
            else:
                log_w = sum(delta[a:b])
                if cfg.is_level == "geometric":
                    log_w /= max(1, sum(mask[a:b]))
            w = math.exp(min(20.0, max(-20.0, log_w)))
            floor = cfg.is_floor or 0.0
            inside = floor <= w <= cfg.is_cap
            return {"truncate": max(min(w, cfg.is_cap), cfg.is_floor or -1.0), "mask": w if inside else 0.0,
                    "reject": 1.0 if inside else 0.0, "raw": w}[cfg.is_mode]

        weight = is_weight_of(t)
        if cfg.policy == "reinforce":
            s = adv[t] * lp[t]
        elif cfg.policy == "vespo":  # the sequence's gamma weight times A lp; the IS weight went into it
            def log_is(u):
                w = is_weight_of(u)
                return math.log(1e-8) if w <= 1e-8 else min(20.0, math.log(w))
            log_w = sum(min(20.0, max(-20.0, lp[u] - old[u])) + (log_is(u) if cfg.is_level != "none" else 0.0)
                        for u in range(a, b) if mask[u])
            log_w = min(20.0, max(math.log(1e-8), log_w))
            k, lam = (cfg.vespo_k_pos, cfg.vespo_lambda_pos) if adv[t] >= 0 else (cfg.vespo_k_neg, cfg.vespo_lambda_neg)
            lam = max(lam, 1e-4)
            s = math.exp(lam + k * log_w - lam * math.exp(log_w)) * adv[t] * lp[t]
            weight = 1.0
        elif cfg.policy == "gmpo":
            s = gmpo_r * adv[t]
        elif cfg.policy == "sapo":
            log_r = lp[t] - base_of[t]
            if cfg.log_ratio_clamp is not None:
                log_r = min(cfg.log_ratio_clamp, max(-cfg.log_ratio_clamp, log_r))
            tau = cfg.sapo_tau_pos if adv[t] > 0 else cfg.sapo_tau_neg
            s = 4.0 / tau / (1.0 + math.exp(-tau * (math.exp(log_r) - 1.0))) * adv[t]
        elif cfg.policy in ("dppo_tv", "dppo_kl") and not mask[t]:
            s = 0.0  # a masked token counts for nothing (its logprobs may hold anything)
        elif cfg.policy in ("dppo_tv", "dppo_kl"):
            base = samp[t] if cfg.ratio_ref == "sampler" else old[t]
            log_r = lp[t] - base
            if cfg.log_ratio_clamp is not None:
                log_r = min(cfg.log_ratio_clamp, max(-cfg.log_ratio_clamp, log_r))
            r = math.exp(log_r) if cfg.ratio_cap is None else min(math.exp(log_r), cfg.ratio_cap)
            p, q = math.exp(lp[t]), math.exp(base)
            if cfg.policy == "dppo_tv":
                inside = p - q <= cfg.clip_high if adv[t] > 0 else p - q >= -cfg.clip_low
            else:
                kl = q * (base - lp[t]) + (1 - q) * math.log((1 - q + 1e-8) / (1 - p + 1e-8))
                inside = (kl <= cfg.clip_high or p <= q) if adv[t] > 0 else (kl <= cfg.clip_low or p >= q)
            s = (r if inside else 0.0) * adv[t] * lp[t]
        elif cfg.policy == "prime_rl" and not mask[t]:
            s = 0.0
        elif cfg.policy == "prime_rl":  # prime-rl: keep r A unless p moved past the bound; + c (log r)^2 below
            base = samp[t] if cfg.ratio_ref == "sampler" else old[t]
            log_r = lp[t] - base
            if cfg.log_ratio_clamp is not None:
                log_r = min(cfg.log_ratio_clamp, max(-cfg.log_ratio_clamp, log_r))
            move = math.exp(lp[t]) - math.exp(base)
            dropped = move > cfg.clip_high if adv[t] > 0 else move < -cfg.clip_low
            s = 0.0 if dropped else math.exp(log_r) * adv[t]
        elif cfg.policy == "kl_cov":  # r A, and at the selected tokens minus coef |log r|
            log_r = lp[t] - (samp[t] if cfg.ratio_ref == "sampler" else old[t])
            s = math.exp(log_r) * adv[t] - (cfg.cov_kl_coef * abs(log_r) if t in chosen else 0.0)
        elif cfg.policy == "cispo":
            base = samp[t] if cfg.ratio_ref == "sampler" else old[t]
            log_r = lp[t] - base
            if cfg.log_ratio_clamp is not None:
                log_r = min(cfg.log_ratio_clamp, max(-cfg.log_ratio_clamp, log_r))
            s = min(max(math.exp(log_r), 1 - cfg.clip_low), 1 + cfg.clip_high) * adv[t] * lp[t]
        else:
            base = samp[t] if cfg.ratio_ref == "sampler" else old[t]
            log_r = gspo_log_s if cfg.ratio_level == "sequence" else lp[t] - base
            if cfg.log_ratio_clamp is not None:
                log_r = min(cfg.log_ratio_clamp, max(-cfg.log_ratio_clamp, log_r))
            r = math.exp(log_r)
            s = min(r * adv[t], min(max(r, 1 - cfg.clip_low), 1 + cfg.clip_high) * adv[t])
            if cfg.dual_clip is not None and adv[t] < 0:
                s = max(s, cfg.dual_clip * adv[t])
            if cfg.policy == "clip_cov" and t in chosen:
                s = 0.0
        kl = 0.0
        if cfg.kl_coef:
            d = lp[t] - ref[t]
            if cfg.kl_input_clamp is not None:
                d = min(cfg.kl_input_clamp, max(-cfg.kl_input_clamp, d))
            kl = {"k1": d, "k2": 0.5 * d * d, "k3": math.exp(-d) + d - 1}[cfg.kl_type.rstrip("+")]
            if cfg.kl_weight == "sampler":
                kl *= math.exp(lp[t] - samp[t])
            if cfg.kl_clamp is not None:
                kl = min(cfg.kl_clamp, max(-cfg.kl_clamp, kl))
            if cfg.kl_weight == "ratio":
                base = samp[t] if (cfg.ratio_ref == "sampler" and cfg.policy != "reinforce") else old[t]
                kl *= math.exp(lp[t] - base)
        if cfg.off_policy_mask is not None:  # TRL: a sequence drifted past delta loses its A < 0 policy terms
            behaviour = samp if samp is not None else old
            drift = sum(behaviour[u] - lp[u] for u in range(a, b) if mask[u]) / max(1, sum(mask[a:b]))
            if adv[t] < 0 and drift > cfg.off_policy_mask:
                s = 0.0
        penalty = 0.0
        if cfg.policy == "prime_rl" and mask[t]:
            penalty = cfg.ratio_penalty_coef * (lp[t] - (samp[t] if cfg.ratio_ref == "sampler" else old[t])) ** 2
        losses.append(-weight * gate[t] * s + cfg.kl_coef * kl + penalty)
    entropy_terms = [-cfg.entropy_coef * ent[t] for t in range(n)]
    if cfg.entropy_agg is None:
        losses = [l_ + e for l_, e in zip(losses, entropy_terms)]
        return scalar_aggregate(losses, mask, seqs, cfg.loss_agg, norm_length)
    return (scalar_aggregate(losses, mask, seqs, cfg.loss_agg, norm_length)
            + scalar_aggregate(entropy_terms, mask, seqs, cfg.entropy_agg, norm_length))


def scalar_cov_selection(lp, adv, base, mask, cfg):
    """The token indices Clip-Cov / KL-Cov select (verl's reading): cov_t = (A_t - mean A)(lp_t - mean lp)
    over the unmasked tokens, k = max(1, int(n cov_ratio)); kl_cov: the k largest; clip_cov: k drawn by
    torch.randperm (generator seeded with cov_seed) among the unclipped tokens with cov strictly in cov_bounds."""
    if cfg.policy not in ("clip_cov", "kl_cov"):
        return set()
    live = [t for t in range(len(lp)) if mask[t]]
    if not live:
        return set()
    mean_a, mean_lp = sum(adv[t] for t in live) / len(live), sum(lp[t] for t in live) / len(live)
    cov = {t: (adv[t] - mean_a) * (lp[t] - mean_lp) for t in live}
    k = max(1, int(len(live) * cfg.cov_ratio))
    if cfg.policy == "kl_cov":  # Python's sort is stable: equal covariances in token order, the lower index first
        return set(sorted(live, key=lambda t: -cov[t])[:k])

    def clipped(t):
        r = math.exp(lp[t] - base[t])
        return min(max(r, 1 - cfg.clip_low), 1 + cfg.clip_high) * adv[t] < r * adv[t]

    pool = [t for t in live if not clipped(t) and cfg.cov_bounds[0] < cov[t] < cfg.cov_bounds[1]]
    generator = torch.Generator().manual_seed(cfg.cov_seed)
    return {pool[i] for i in torch.randperm(len(pool), generator=generator)[:k].tolist()}


def scalar_aggregate(losses, mask, seqs, mode, norm_length):
    """The aggregation `mode` of per-token values, one sequence at a time."""
    live = [(a, b) for a, b in seqs if sum(mask[a:b]) > 0]
    if not live:
        return 0.0
    if mode == "token-mean":
        return sum(l_ for l_, m in zip(losses, mask) if m) / sum(mask)
    per_seq = []
    for a, b in live:
        total = sum(losses[t] for t in range(a, b) if mask[t])
        if mode == "seq-mean-token-mean":
            total /= sum(mask[a:b])
        elif mode == "seq-mean-token-sum-norm":
            total /= norm_length
        per_seq.append(total)
    return sum(per_seq) / len(live)

ALL_CONFIGS = [(p, None) for p in PRESET_NAMES] + [(c[1], c[2]) for c in OPTION_CASES]


@pytest.mark.parametrize("preset,overrides", ALL_CONFIGS, ids=PRESET_NAMES + [c[0] for c in OPTION_CASES])
@pytest.mark.parametrize("with_old", [True, False], ids=["old", "no_old"])
def test_reference_matches_scalar_reading(preset, overrides, with_old):
    cfg = config_for(preset, overrides)
    inputs = make_inputs("packed", batch=3, seq_len=6, vocab=13, dtype=torch.float64, seed=21)
    if cfg.rejection and not with_old:
        with pytest.raises(ValueError, match="old_logprobs is required by LossConfig.rejection"):
            fused_is.policy_loss(inputs.logits, inputs.tokens, inputs.advantages, config=cfg, backend="reference",
                                 **inputs.kwargs(with_old=False))
        return
    out = fused_is.policy_loss(inputs.logits, inputs.tokens, inputs.advantages, config=cfg, backend="reference",
                               **inputs.kwargs(with_old=with_old))
    cu = inputs.cu_seqlens.tolist()
    f = lambda x: None if x is None else x.double().tolist()  # noqa: E731
    mask = inputs.mask.tolist()
    tokens = [t if m else 0 for t, m in zip(inputs.tokens.tolist(), mask)]
    expected = scalar_loss(inputs.logits.tolist(), tokens, f(inputs.advantages), f(inputs.sampler_logprobs),
                           f(inputs.old_logprobs) if with_old else None, f(inputs.ref_logprobs), mask,
                           list(zip(cu[:-1], cu[1:])), cfg, cfg.norm_length)
    assert out.loss.item() == pytest.approx(expected, rel=1e-10, abs=1e-12)


@pytest.mark.parametrize("preset", ["ppo_tis", "seq_mis", "geo_mis", "reinforce", "mis_ppo_seq"])
def test_reference_gradcheck(preset):
    inputs = make_inputs("padded", batch=2, seq_len=3, vocab=5, dtype=torch.float64, seed=4, logit_scale=0.5)
    cfg = config_for(preset, dict(entropy_coef=0.03, kl_coef=0.05, dual_clip=2.5 if preset != "reinforce" else None,
                                  temperature=0.8))

    def loss(logits):
        return fused_is.policy_loss(logits, inputs.tokens, inputs.advantages, config=cfg, backend="reference",
                                    **inputs.kwargs()).loss

    assert torch.autograd.gradcheck(loss, (inputs.logits.clone().requires_grad_(),), eps=1e-6, atol=1e-7)


@pytest.mark.parametrize("backend", [b for b in ("torch", "cpu") if backends.unavailable_reason(b) is None])
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    layout=st.sampled_from(["padded", "packed"]),
    batch=st.integers(1, 4),
    seq_len=st.integers(1, 9),
    vocab=st.integers(1, 300),
    preset=st.sampled_from(PRESET_NAMES),
    dual_clip=st.one_of(st.none(), st.floats(1.01, 3.0)),
    clip_high=st.floats(0.0, 0.5),
    temperature=st.floats(0.3, 2.0),
    entropy_coef=st.sampled_from([0.0, 0.01]),
    kl=st.sampled_from([None, "k1", "k2", "k3"]),
    loss_agg=st.sampled_from(["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]),
    with_old=st.booleans(),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    seed=st.integers(0, 10_000),
)
def test_backend_property(backend, layout, batch, seq_len, vocab, preset, dual_clip, clip_high, temperature,
                          entropy_coef, kl, loss_agg, with_old, dtype, seed):
    if fused_is.PRESETS[preset].policy != "ppo":
        dual_clip = None  # the dual clip is PPO's (LossConfig refuses it elsewhere)
    cfg = LossConfig.preset(
        preset, dual_clip=dual_clip, clip_high=clip_high, temperature=temperature, entropy_coef=entropy_coef,
        kl_coef=0.1 if kl else 0.0, kl_type=kl or "k3", loss_agg=loss_agg,
        norm_length=seq_len + 2 if loss_agg.endswith("norm") else None,
    )
    if layout == "packed" or batch * seq_len < 2:
        layout = "packed"
        seq_len = max(seq_len, 2)
    inputs = make_inputs(layout, batch=batch, seq_len=seq_len, vocab=vocab, dtype=dtype, seed=seed)
    tol = dict(tolerance(dtype, backend))
    # Tiny random cases can put lp within 1e-3 of ref_logprobs, so the k2 coefficient kl_coef * (lp - ref)
    # amplifies fp32's ~5e-8 logprob rounding (exp of fp32 terms) to a few 1e-6 of the gradient.
    tol["grad"] = max(tol["grad"], 1e-5)
    check_against_reference(inputs, cfg, backend, with_old=with_old, tol=tol)


# --- GSPO's clamp of the sequence log ratio (LossConfig.sequence_log_ratio_max, verl's gspo at 10) -------------

def gspo_beyond_inputs(layout: str, dtype=torch.float32, seed=5):
    """make_inputs with old_logprobs 25 lower on the second sequence: its mean log ratio lp - old is about +25,
    beyond verl's clamp at 10; the others keep |mean| ~ 0.05 (the 0.02 clamp binds on some of them)."""
    inputs = make_inputs(layout, batch=4, seq_len=7, vocab=50, dtype=dtype, seed=seed)
    rows = slice(int(inputs.cu_seqlens[1]), int(inputs.cu_seqlens[2])) if layout == "packed" else 1
    inputs.old_logprobs[rows] -= 25.0
    return inputs


GSPO_CLAMP_CASES = [
    ("gspo_max10", "ppo", dict(ratio_level="sequence", clip_low=0.02, clip_high=0.03, sequence_log_ratio_max=10.0)),
    ("gspo_max_binds_tis_dual_kl_entropy", "ppo_tis", dict(ratio_level="sequence", clip_low=0.5, clip_high=0.5,
                                                            dual_clip=1.01, kl_coef=0.1, entropy_coef=0.01,
                                                            sequence_log_ratio_max=0.02)),
    ("gspo_max_and_log_ratio_clamp_seq_mean", "ppo", dict(ratio_level="sequence", clip_low=0.5, clip_high=0.5,
                                                          loss_agg="seq-mean-token-mean", log_ratio_clamp=0.04,
                                                          sequence_log_ratio_max=0.01)),
]


def sequence_means(inputs, cfg):
    """Each sequence's mean of lp - base over its unmasked tokens (float64 reference lp)."""
    out = fused_is.policy_loss(inputs.logits.double(), inputs.tokens, inputs.advantages, config=cfg,
                               backend="reference", **inputs.kwargs())
    lp, m = out.logprobs.reshape(-1), inputs.mask.reshape(-1)
    base = (inputs.sampler_logprobs if cfg.ratio_ref == "sampler" else inputs.old_logprobs).reshape(-1).double()
    cu = inputs.cu_seqlens.tolist() if inputs.cu_seqlens is not None else \
        list(range(0, lp.numel() + 1, inputs.tokens.shape[-1]))
    return [float(((lp - base)[a:b][m[a:b]]).mean()) for a, b in zip(cu[:-1], cu[1:]) if m[a:b].any()]


@pytest.mark.parametrize("preset,overrides", [c[1:] for c in GSPO_CLAMP_CASES], ids=[c[0] for c in GSPO_CLAMP_CASES])
def test_gspo_sequence_log_ratio_max_matches_scalar_reading(preset, overrides):
    """The reference with the clamp binding on some sequences (and not on others) against the scalar reading."""
    cfg = config_for(preset, overrides)
    inputs = gspo_beyond_inputs("packed", torch.float64)
    means = sequence_means(inputs, cfg)
    assert any(x > cfg.sequence_log_ratio_max for x in means) and any(x < cfg.sequence_log_ratio_max for x in means)
    out = fused_is.policy_loss(inputs.logits, inputs.tokens, inputs.advantages, config=cfg, backend="reference",
                               **inputs.kwargs())
    cu = inputs.cu_seqlens.tolist()
    f = lambda x: x.double().tolist()  # noqa: E731
    mask = inputs.mask.tolist()
    tokens = [t if m else 0 for t, m in zip(inputs.tokens.tolist(), mask)]
    expected = scalar_loss(inputs.logits.tolist(), tokens, f(inputs.advantages), f(inputs.sampler_logprobs),
                           f(inputs.old_logprobs), f(inputs.ref_logprobs), mask, list(zip(cu[:-1], cu[1:])), cfg,
                           cfg.norm_length)
    assert out.loss.item() == pytest.approx(expected, rel=1e-10, abs=1e-12)


def test_gspo_sequence_log_ratio_max_gradient():
    """Away from the kink, the reference's gradient is autograd's of the clamped loss (gradcheck, the clip range
    wide enough not to bind), and the rows of a sequence beyond the clamp get exactly zero policy gradient
    (torch.clamp's); on the +25 inputs the clamp changes the loss by orders of magnitude."""
    inputs = make_inputs("padded", batch=2, seq_len=3, vocab=5, dtype=torch.float64, seed=4, logit_scale=0.5)
    inputs.old_logprobs[1] -= 1.0  # sequence 1's mean log ratio about +1, beyond 0.5; sequence 0's near 0
    cfg = config_for("ppo", dict(ratio_level="sequence", clip_low=0.9, clip_high=5.0, sequence_log_ratio_max=0.5,
                                 kl_coef=0.05, entropy_coef=0.03))

    def loss(logits, cfg=cfg):
        return fused_is.policy_loss(logits, inputs.tokens, inputs.advantages, config=cfg, backend="reference",
                                    **inputs.kwargs()).loss

    assert [x > 0.6 for x in sequence_means(inputs, cfg)] == [False, True]
    logits = inputs.logits.clone().requires_grad_()
    assert torch.autograd.gradcheck(loss, (logits,), eps=1e-6, atol=1e-7)
    policy_only = dataclasses.replace(cfg, kl_coef=0.0, entropy_coef=0.0)
    loss(logits, policy_only).backward()
    assert bool((logits.grad[1] == 0).all()) and bool((logits.grad[0] != 0).any())

    far = gspo_beyond_inputs("padded", torch.float64)
    cfg = config_for("ppo", dict(ratio_level="sequence", clip_low=0.02, clip_high=0.03, sequence_log_ratio_max=10.0))
    clamped, unclamped = (fused_is.policy_loss(far.logits, far.tokens, far.advantages, config=c, backend="reference",
                                               **far.kwargs()).loss.item()
                          for c in (cfg, dataclasses.replace(cfg, sequence_log_ratio_max=None)))
    assert abs(unclamped) > 100 * abs(clamped)  # e^25 against e^10


@pytest.mark.parametrize("backend", [b for b in ("torch", "cpu") if backends.unavailable_reason(b) is None])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("layout", ["padded", "packed"])
@pytest.mark.parametrize("with_old", [True, False], ids=["old", "no_old"])
@pytest.mark.parametrize("preset,overrides", [c[1:] for c in GSPO_CLAMP_CASES], ids=[c[0] for c in GSPO_CLAMP_CASES])
def test_gspo_sequence_log_ratio_max_backends(preset, overrides, with_old, layout, dtype, backend):
    """The cpu and torch backends against the float64 reference with the clamp binding: loss, gradient, metrics."""
    check_against_reference(gspo_beyond_inputs(layout, dtype), config_for(preset, overrides), backend,
                            with_old=with_old)


# --- KL-Cov's selection on exactly tied covariances ------------------------------------------------------

def tied_cov_inputs(dtype=torch.float32, layout="packed"):
    """Inputs whose cov_t take few distinct values, each many times exactly: every row is one of three logits
    rows (with the same token), the advantages one of three values, so (A_t, lp_t) repeat bitwise; old_logprobs
    differ per row (the selected rows' |lp - old| terms, and so loss and gradient, show which rows were taken).
    The last row is masked."""
    gen = torch.Generator().manual_seed(17)
    vocab, n = 11, 24
    patterns = torch.randn(3, vocab, generator=gen, dtype=torch.float64) * 2
    kind = torch.tensor([t % 3 for t in range(n)])
    logits = patterns[kind].to(dtype)
    tokens = torch.full((n,), 4)
    lp = torch.log_softmax(logits.double(), -1)[:, 4]
    adv = torch.tensor([(-1.0, 0.5, 2.0)[(t // 3) % 3] for t in range(n)])
    old = (lp - 0.05 * (1 + torch.arange(n) % 5)).clamp(max=0.0)
    mask = torch.ones(n, dtype=torch.bool)
    mask[-1] = False
    cu = torch.tensor([0, 8, 16, 24])
    inputs = make_inputs("packed", batch=3, seq_len=8, vocab=vocab, dtype=dtype, seed=1)
    inputs.logits, inputs.tokens, inputs.advantages = logits, tokens, adv.float()
    inputs.old_logprobs, inputs.sampler_logprobs, inputs.ref_logprobs = old.float(), old.float(), lp.float()
    inputs.mask, inputs.cu_seqlens = mask, cu
    if layout == "padded":
        for name in ("logits", "tokens", "advantages", "old_logprobs", "sampler_logprobs", "ref_logprobs", "mask"):
            x = getattr(inputs, name)
            setattr(inputs, name, x.reshape(3, 8, *x.shape[1:]))
        inputs.cu_seqlens = None
    return inputs


def tied_cov_config(k):
    """kl_cov selecting k of the 23 unmasked tokens."""
    return config_for("kl_cov", dict(cov_ratio=(k + 0.5) / 23, cov_kl_coef=0.5))


def expected_tie_selection(inputs, k):
    """The rule (LossConfig docstring): the k largest cov_t, equal ones by the lower token index."""
    lp = torch.log_softmax(inputs.logits.double().reshape(-1, inputs.logits.shape[-1]), -1)[:, 4].tolist()
    adv, mask = inputs.advantages.reshape(-1).double().tolist(), inputs.mask.reshape(-1).tolist()
    cfg = tied_cov_config(k)
    return scalar_cov_selection(lp, adv, inputs.old_logprobs.reshape(-1).double().tolist(), mask, cfg), lp, adv, mask


@pytest.mark.parametrize("k", [1, 3, 4, 7, 9])
def test_kl_cov_ties_by_lower_token_index(k):
    """With the k-th largest covariance tied beyond k, the reference takes the tied tokens of lowest index (its
    loss equals the scalar reading's, whose stable sort is the rule), and the boundary really is a tie."""
    inputs = tied_cov_inputs(torch.float64)
    chosen, lp, adv, mask = expected_tie_selection(inputs, k)
    live = [t for t in range(len(lp)) if mask[t]]
    mean_a, mean_lp = sum(adv[t] for t in live) / len(live), sum(lp[t] for t in live) / len(live)
    cov = {t: (adv[t] - mean_a) * (lp[t] - mean_lp) for t in live}
    kth = min(cov[t] for t in chosen)
    tied = sorted(t for t in live if cov[t] == kth)
    assert len(chosen) == k and any(t not in chosen for t in tied), "the case must put a tie across the k-th place"
    assert [t for t in tied if t in chosen] == tied[:len([t for t in tied if t in chosen])]  # the lowest indices
    cfg = tied_cov_config(k)
    out = fused_is.policy_loss(inputs.logits, inputs.tokens, inputs.advantages, config=cfg, backend="reference",
                               **inputs.kwargs())
    cu = inputs.cu_seqlens.tolist()
    f = lambda x: x.double().tolist()  # noqa: E731
    expected = scalar_loss(inputs.logits.tolist(), inputs.tokens.tolist(), f(inputs.advantages),
                           f(inputs.sampler_logprobs), f(inputs.old_logprobs), f(inputs.ref_logprobs), mask,
                           list(zip(cu[:-1], cu[1:])), cfg, None)
    assert out.loss.item() == pytest.approx(expected, rel=1e-10, abs=1e-12)
    assert out.metrics["cov_selected_frac"] == pytest.approx(k / 23)


@pytest.mark.parametrize("backend", [b for b in ("torch", "cpu") if backends.unavailable_reason(b) is None])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("layout", ["packed", "padded"])
@pytest.mark.parametrize("k", [1, 3, 4, 7, 9])
def test_kl_cov_ties_backends(k, layout, dtype, backend):
    """The kernels' coefficients (coefficients.cov_selection) take the same tied tokens as the reference: loss,
    gradient (a selected row's gradient differs from an unselected twin's) and metrics."""
    check_against_reference(tied_cov_inputs(dtype, layout), tied_cov_config(k), backend)
