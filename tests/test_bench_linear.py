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
    # every available provider measured once (fused_skip_* only where some rows are masked), every unavailable one
    # listed with its reason
    assert sorted(r["provider"] for r in records) == sorted(p for p, why in available.items()
                                                            if why is None and not p.startswith("fused_skip_"))
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


@pytest.mark.parametrize("masked", [0.0, 0.75])
@pytest.mark.parametrize("provider", ["liger", "trl_chunked", "eager", "fused_linear_torch", "fused_skip_torch"])
def test_provider_matches_fused_is(provider, masked):
    """Liger (vllm_is_ratio = the truncated IS weight, loss_type='dapo', beta=0, the mask as attention_mask), TRL's
    chunked logprobs of the unmasked rows plus the eager ppo_tis loss, eager and linear_policy_loss give fused_is's
    loss and gradients on the same inputs and the same masked rows (N=512 in sequences of 256, D=32, V=1000,
    fp32); a masked row's d hidden is 0."""
    reason = bench_linear.linear_providers_here("cpu")[provider]
    if reason is not None:
        assert os.environ.get("CI") != "true", f"the baselines extra installs {provider} in CI: {reason}"
        pytest.skip(reason)
    p = bench_linear.make_linear_problem(512, 32, 1000, torch.float32, "cpu", seed=3, masked=masked)
    assert int(p["mask"].sum()) == 512 - round(masked * 256) * 2
    results = {}
    for name in (provider, "fused_logits_torch"):
        hidden = p["hidden"].clone().requires_grad_()
        weight = p["weight"].clone().requires_grad_()
        loss = bench_linear.run_step(name, hidden, weight, p)
        results[name] = (loss.detach(), hidden.grad, weight.grad)
    (loss, gh, gw), (ref, ref_gh, ref_gw) = results[provider], results["fused_logits_torch"]
    assert rel_err(loss, ref) < 1e-5
    assert rel_err(gh, ref_gh) < 1e-5 and rel_err(gw, ref_gw) < 1e-5
    # a masked row gives nothing; an unmasked one does unless its PPO ratio is clipped
    assert (gh[~p["mask"]] == 0).all() and (gh[p["mask"]] != 0).any(dim=1).float().mean() > 0.5


def test_agentic_mask_is_spans_of_turns():
    """Each sequence is turns of TURN_TOKENS tokens, each a masked span (prompt, tool output) then the reply; the share
    is exact when it is a whole number of tokens per turn; no masked rows at 0; short sequences are one turn."""
    turn = bench_linear.TURN_TOKENS
    mask = bench_linear.agentic_mask(8 * turn, 4 * turn, 0.75)
    assert mask.sum() == 8 * turn // 4
    for start in range(0, 8 * turn, turn):  # every turn: 3/4 masked, then 1/4 unmasked
        assert not mask[start:start + 3 * turn // 4].any() and mask[start + 3 * turn // 4:start + turn].all()
    assert bench_linear.agentic_mask(100, 50, 0.0).all()
    short = bench_linear.agentic_mask(64, 32, 0.5)
    assert short.view(2, 32)[:, :16].logical_not().all() and short.view(2, 32)[:, 16:].all()
    with pytest.raises(ValueError, match=r"in \[0, 1\); got 1.0"):
        bench_linear.agentic_mask(64, 32, 1.0)


def test_masked_shares_and_vocabularies_are_dimensions(tmp_path):
    """--masked and several --vocab: one record per (V, N, share, provider), each with its share, the unmasked row
    count and time_x_unmasked against the same provider's at 0% masked; --seq-len sets the packed sequences."""
    args = _args(tmp_path, providers=["fused_linear_torch", "eager"])
    args.vocab, args.masked, args.seq_len = [300, 512], [0.0, 0.5], 32
    assert bench_linear.run_linear(args) == 0
    lines = [json.loads(line) for line in (tmp_path / "linear.jsonl").read_text().splitlines()]
    assert lines[0]["masked"] == [0.0, 0.5]
    records = lines[1:]
    assert [(r["vocab"], r["masked"], r["provider"]) for r in records] == [
        (v, m, p) for v in (300, 512) for m in (0.0, 0.5) for p in ("fused_linear_torch", "eager")]
    for r in records:
        assert r["seq_len"] == 32 and r["unmasked_rows"] == (64 if r["masked"] == 0 else 32)
        assert r["loss_err"] < 1e-5 and r["grad_hidden_err"] < 2e-5, r
    table = (tmp_path / "linear.md").read_text()
    assert "| fused_linear_torch | 64 | 32 | 512 | fp32 | 0.50 | 32 |" in table
    assert "| eager | 64 | 32 | 300 | fp32 | 0.00 | 32 | " in table and "| 1.00 |" in table


def test_masked_plot(tmp_path):
    pytest.importorskip("matplotlib")
    records = [dict(provider=p, n=64, hidden_dim=32, vocab=512, dtype="fp32", masked=m, seq_len=32,
                    time_median_s=t * (1 - m / 2), time_x_unmasked=1 - m / 2)
               for p, t in (("fused_linear_cpu", 1.0), ("liger", 3.0)) for m in (0.0, 0.5, 0.9)]
    path = bench_linear.masked_plot(records, "test", tmp_path / "linear_masked.png")
    assert path.stat().st_size > 10_000


@pytest.mark.parametrize("masked, error", [("1", "in [0, 1)"), ("-0.1", "in [0, 1)"), ("half", "expected a share")])
def test_masked_argument_is_checked(masked, error, capsys):
    from fused_is import cli

    with pytest.raises(SystemExit):
        cli.main(["bench", "--linear", "--masked", "0", masked])
    assert error in capsys.readouterr().err


def test_masked_without_linear_is_an_error():
    from fused_is import cli

    with pytest.raises(SystemExit, match="--masked is a dimension of --linear only"):
        cli.main(["bench", "--masked", "0.5", "--n", "16"])


def test_fused_is_bench_linear_command(tmp_path):
    """`fused-is bench --linear` reaches fused_is.benchmarks.linear with the command line's sizes."""
    from fused_is import cli

    status = cli.main(["bench", "--linear", "--n", "64", "--hidden-dim", "32", "--vocab", "512", "--dtypes", "fp32",
                       "--reps", "1", "--in-process", "--no-plot", "--out", str(tmp_path), "--masked", "0", "75%",
                       "--seq-len", "64", "--providers", "eager", "fused_linear_torch"])
    assert status == 0
    records = [json.loads(line) for line in (tmp_path / "linear.jsonl").read_text().splitlines()[1:]]
    assert [(r["provider"], r["n"], r["hidden_dim"], r["vocab"], r["dtype"], r["masked"], r["seq_len"])
            for r in records] == [(p, 64, 32, 512, "fp32", m, 64) for m in (0.0, 0.75)
                                  for p in ("eager", "fused_linear_torch")]
