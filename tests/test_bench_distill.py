"""`fused-is bench --distill` (fused_is/benchmarks/distill.py) on a tiny problem, in process: every provider that runs
here gives the same loss and gradients as the float64 oracle, the records and the skips are written, the command line
reaches it."""

import argparse
import json

import pytest
import torch

from fused_is.benchmarks import distill as bench_distill

SMALL = dict(n=48, hidden_dim=16, vocab=300)


def _args(tmp_path, providers, sizes=(SMALL["n"],)):
    return argparse.Namespace(sizes=list(sizes), hidden_dim=SMALL["hidden_dim"], vocab=SMALL["vocab"], dtype="fp32",
                              device="cpu", reps=1, warmup=0, out=tmp_path, providers=providers, in_process=True,
                              no_plot=True)


@pytest.mark.parametrize("provider", [p for p, why in bench_distill.providers_here("cpu").items() if why is None])
def test_provider_matches_the_oracle(provider):
    """Each provider that runs here (TRL's eager loss, torch.compile of it, the fused paths, Liger's chunked loss)
    computes the bench's loss: fp32 against the float64 oracle on the same inputs."""
    p = bench_distill.make_problem(provider, SMALL["n"], SMALL["hidden_dim"], SMALL["vocab"], torch.float32, "cpu")
    errors = bench_distill.provider_errors(provider, p)
    assert errors["loss_err"] < 1e-5, errors
    assert all(v < 1e-4 for k, v in errors.items() if k.startswith("grad_")), errors


def test_run_writes_records_and_skips(tmp_path):
    providers = ["eager", "fused_torch_inplace", "fused_linear_torch", "liger_jsd"]
    assert bench_distill.run(_args(tmp_path, providers)) == 0
    lines = [json.loads(line) for line in (tmp_path / "distill.jsonl").read_text().splitlines()]
    env, records = lines[0], lines[1:]
    assert env["kind"] == "environment" and "liger_jsd" in env["providers_skipped"]  # Triton: CUDA only
    assert [(r["path"], r["provider"]) for r in records] == [("logits", "eager"), ("logits", "fused_torch_inplace"),
                                                             ("linear", "fused_linear_torch")]
    for r in records:
        assert "error" not in r and r["time_median_s"] > 0 and r["peak_added_bytes"] >= 0, r
    assert records[1]["speedup_vs_eager"] > 0 and "speedup_vs_eager" not in records[2]  # no eager_linear measured
    assert "| logits | fused_torch_inplace | 48 | 300 | fp32 |" in (tmp_path / "distill.md").read_text()


def test_eager_that_would_not_fit_is_skipped(tmp_path, monkeypatch):
    monkeypatch.setattr(bench_distill, "available_bytes", lambda: bench_distill.eager_bytes(SMALL["n"], 300) - 1)
    assert bench_distill.run(_args(tmp_path, ["eager", "fused_torch"], sizes=(8, SMALL["n"]))) == 0
    lines = [json.loads(line) for line in (tmp_path / "distill.jsonl").read_text().splitlines()]
    assert "GiB available" in lines[0]["providers_skipped"][f"eager N={SMALL['n']}"]
    assert [(r["provider"], r["n"]) for r in lines[1:]] == [("eager", 8), ("fused_torch", 8),
                                                            ("fused_torch", SMALL["n"])]


def test_unknown_provider_is_an_error_listing_the_valid_ones(tmp_path):
    with pytest.raises(SystemExit, match=r"unknown 'nope' \(valid: eager, compile, fused_torch, "):
        bench_distill.run(_args(tmp_path, ["eager", "nope"]))
    assert not (tmp_path / "distill.jsonl").exists()


def test_fused_is_bench_distill_command(tmp_path):
    """`fused-is bench --distill` reaches fused_is.benchmarks.distill with the command line's sizes."""
    from fused_is import cli

    status = cli.main(["bench", "--distill", "--n", "16", "--hidden-dim", "8", "--vocab", "200", "--dtypes", "fp32",
                       "--reps", "1", "--warmup", "0", "--in-process", "--no-plot", "--out", str(tmp_path),
                       "--providers", "fused_torch", "fused_linear_torch"])
    assert status == 0
    records = [json.loads(line) for line in (tmp_path / "distill.jsonl").read_text().splitlines()[1:]]
    assert [(r["provider"], r["n"], r["hidden_dim"], r["vocab"], r["dtype"]) for r in records] == [
        ("fused_torch", 16, 8, 200, "fp32"), ("fused_linear_torch", 16, 8, 200, "fp32")]


def test_requirements_of_a_distill_run():
    """scripts/dev.sh bench installs TRL (the eager baseline) and Liger for --distill only when the run uses them."""
    from fused_is.benchmarks import common, requirements
    from fused_is.benchmarks import main as bench

    def needs(argv):
        args = bench.parser().parse_args(["--distill", "--no-plot"] + argv)
        bench.check_arguments(args)
        return requirements.needed(args, "cpu")

    assert needs([]) == ["tqdm", common.LIGER_PIN, common.TRL_PIN]
    assert needs(["--providers", "fused_torch", "fused_linear_torch"]) == ["tqdm"]
    assert needs(["--providers", "compile", "liger_chunked"]) == ["tqdm", common.LIGER_PIN, common.TRL_PIN]
