"""mismatch_report against hand-computed statistics."""

import math

import pytest
import torch

import fused_is


def test_report_values():
    samp = torch.tensor([[-1.0, -2.0, -0.5], [-0.1, -3.0, -1.0]], dtype=torch.float64)
    learn = torch.tensor([[-1.2, -1.5, -0.5], [-0.1, -2.0, -9.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    r = fused_is.mismatch_report(samp, learn, mask=mask)
    s = [-1.0, -2.0, -0.5, -0.1, -3.0]
    lrn = [-1.2, -1.5, -0.5, -0.1, -2.0]
    log_w = [b - a for a, b in zip(s, lrn)]
    w = [math.exp(x) for x in log_w]
    n = 5
    assert r["k1"] == pytest.approx(sum(a - b for a, b in zip(s, lrn)) / n)
    assert r["k3"] == pytest.approx(sum(wi - x - 1 for wi, x in zip(w, log_w)) / n)
    assert r["max_abs_diff"] == pytest.approx(1.0)
    assert r["max_abs_prob_diff"] == pytest.approx(max(abs(math.exp(a) - math.exp(b)) for a, b in zip(s, lrn)))
    assert r["log_ppl_sampler"] == pytest.approx(-sum(s) / n)
    assert r["ppl_ratio"] == pytest.approx(math.exp(-sum(lrn) / n) / math.exp(-sum(s) / n))
    assert r["chi2_token"] == pytest.approx(sum(x * x for x in w) / n - 1)
    seq = [sum(log_w[:3]), sum(log_w[3:])]
    assert r["chi2_seq"] == pytest.approx(sum(math.exp(2 * x) for x in seq) / 2 - 1)
    assert r["ess_token"] == pytest.approx(sum(w) ** 2 / (n * sum(x * x for x in w)))
    assert (r["seq_log_ratio_mean"], r["seq_log_ratio_max"], r["seq_log_ratio_min"]) == pytest.approx(
        (sum(seq) / 2, max(seq), min(seq)))


def test_report_packed_matches_padded_and_identical_is_zero():
    samp = torch.randn(2, 4).double()
    learn = samp + 0.1 * torch.randn(2, 4).double()
    padded = fused_is.mismatch_report(samp, learn)
    packed = fused_is.mismatch_report(samp.reshape(-1), learn.reshape(-1), cu_seqlens=torch.tensor([0, 4, 8]))
    for key in padded:
        assert packed[key] == pytest.approx(padded[key]), key
    same = fused_is.mismatch_report(samp, samp)
    assert same["k1"] == 0 and same["k3"] == 0 and same["chi2_seq"] == pytest.approx(0) and same["ess_token"] == 1


def test_report_bad_input():
    with pytest.raises(ValueError, match="learner_logprobs"):
        fused_is.mismatch_report(torch.zeros(3), torch.zeros(4))
    with pytest.raises(ValueError, match="cu_seqlens"):
        fused_is.mismatch_report(torch.zeros(4), torch.zeros(4), cu_seqlens=torch.tensor([0, 3]))
    with pytest.raises(ValueError, match="finite"):
        fused_is.mismatch_report(torch.tensor([float("nan")]), torch.zeros(1))
