"""`fused-is bench --linear` (fused_is/benchmarks/linear.py) on a tiny problem, in process."""

import argparse
import json
import os

import pytest
import torch

from fused_is.benchmarks import linear as bench_linear
from fused_is.testing import rel_err

FP32_TOL = dict(loss_err=1e-5, grad_hidden_err=2e-5, grad_weight_err=2e-5)


def _args(tmp_path, providers=None):
    return argparse.Namespace(sizes=[64], hidden_dim=32, vocab=512, dtype="fp32", device="cpu", reps=1, warmup=1,
                              out=tmp_path, providers=providers, in_process=True, no_plot=True)


def test_run_linear_tiny(tmp_path):
    available = bench_linear.linear_providers_here("cpu")
    assert available["eager"] is None
    assert bench_linear.run_linear(_args(tmp_path)) == 0
    lines = [json.loads(line) for line in (tmp_path / "linear.jsonl").read_text().splitlines()]
    assert lines[0]["kind"] == "environment"
    records = lines[1:]
    # every available provider measured once, every unavailable one listed with its reason
    assert sorted(r["provider"] for r in records) == sorted(p for p, why in available.items() if why is None)
    assert set(lines[0]["providers_skipped"]) == {p for p, why in available.items() if why is not None}
    for r in records:
        assert "error" not in r, r
        assert r["time_median_s"] > 0 and r["peak_added_bytes"] >= 0
        for key, tol in FP32_TOL.items():
            assert r[key] <= tol, (r["provider"], key, r[key])
    table = (tmp_path / "linear.md").read_text()
    assert "| eager | 64 | 32 | 512 | fp32 |" in table


def test_unknown_provider_is_an_error_listing_the_valid_ones(tmp_path):
    with pytest.raises(SystemExit, match=r"unknown 'nope' \(valid: eager, fused_linear_cpu, .*trl_chunked\)"):
        bench_linear.run_linear(_args(tmp_path, providers=["eager", "nope"]))
    assert not (tmp_path / "linear.jsonl").exists()  # nothing measured, nothing written


def test_provider_of_the_other_device_is_skipped_with_the_reason(tmp_path):
    assert bench_linear.run_linear(_args(tmp_path, providers=["eager", "fused_linear_triton"])) == 0
    env = json.loads((tmp_path / "linear.jsonl").read_text().splitlines()[0])
    assert list(env["providers_skipped"]) == ["fused_linear_triton"]
    assert "on cpu" in env["providers_skipped"]["fused_linear_triton"]


def test_nothing_to_measure_is_an_error(tmp_path):
    with pytest.raises(SystemExit, match="nothing to measure here: fused_linear_cuda: "):
        bench_linear.run_linear(_args(tmp_path, providers=["fused_linear_cuda"]))


def test_problem_fires_clip_and_truncation():
    import fused_is

    p = bench_linear.make_linear_problem(256, 32, 1000, torch.float32, "cpu")
    out = fused_is.policy_loss(p["hidden"] @ p["weight"].T, p["tokens"], p["advantages"], backend="torch",
                               sampler_logprobs=p["sampler_logprobs"], old_logprobs=p["old_logprobs"])
    assert 0 < out.metrics["clip_frac"] < 0.5 and 0 < out.metrics["is_truncated_frac"] < 0.5


@pytest.mark.parametrize("provider", ["liger", "trl_chunked"])
def test_third_party_matches_fused_is(provider):
    """Liger (vllm_is_ratio = the truncated IS weight, loss_type='dapo', beta=0) and TRL's chunked logprobs plus the
    eager ppo_tis loss give fused_is's loss and gradients on the same inputs (N=64, D=32, V=1000, fp32)."""
    reason = bench_linear.linear_providers_here("cpu")[provider]
    if reason is not None:
        assert os.environ.get("CI") != "true", f"the baselines extra installs {provider} in CI: {reason}"
        pytest.skip(reason)
    p = bench_linear.make_linear_problem(64, 32, 1000, torch.float32, "cpu", seed=3)
    results = {}
    for name in (provider, "fused_logits_torch"):
        hidden = p["hidden"].clone().requires_grad_()
        weight = p["weight"].clone().requires_grad_()
        loss = bench_linear.run_step(name, hidden, weight, p)
        results[name] = (loss.detach(), hidden.grad, weight.grad)
    (loss, gh, gw), (ref, ref_gh, ref_gw) = results[provider], results["fused_logits_torch"]
    assert rel_err(loss, ref) < 1e-5
    assert rel_err(gh, ref_gh) < 1e-5 and rel_err(gw, ref_gw) < 1e-5


def test_fused_is_bench_linear_command(tmp_path):
    """`fused-is bench --linear` reaches fused_is.benchmarks.linear with the command line's sizes."""
    from fused_is import cli

    status = cli.main(["bench", "--linear", "--n", "64", "--hidden-dim", "32", "--vocab", "512", "--dtypes", "fp32",
                       "--reps", "1", "--in-process", "--no-plot", "--out", str(tmp_path),
                       "--providers", "eager", "fused_linear_torch"])
    assert status == 0
    records = [json.loads(line) for line in (tmp_path / "linear.jsonl").read_text().splitlines()[1:]]
    assert [(r["provider"], r["n"], r["hidden_dim"], r["vocab"], r["dtype"]) for r in records] == [
        ("eager", 64, 32, 512, "fp32"), ("fused_linear_torch", 64, 32, 512, "fp32")]
