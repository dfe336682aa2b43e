"""The bench's providers and modes, in the test suite (bench/test_bench.py is pytest-benchmark's timing alone):
the `liger` provider (Liger-Kernel's triton_grpo_loss) against the float64 reference on the CPU under the Triton
interpreter and how providers_here reports it; `--triton-configs`, its syntax and its records."""

import importlib.util
import os

import pytest
import torch

from fused_is.benchmarks import main as bench
from fused_is.testing import rel_err

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

LIGER_DEVICE_INTERPRETER = (DEVICE, DEVICE == "cpu")  # (device, triton_interpreter) where liger can run here
LIGER_TOL = {"fp32": dict(loss=1e-6, grad=1e-5), "bf16": dict(loss=1e-5, grad=1e-2)}


def _fresh_liger_problem(n, vocab, dtype, seed):
    """make_problem's inputs at a seed the bench never uses, with the sampler logprobs moved so that a quarter of
    the IS weights exceed the cap (truncated) and one reaches the -20 clamp of the log weight."""
    p = bench.make_problem(n, vocab, bench.DTYPES[dtype], DEVICE, seed=seed)
    old, samp = p["old_logprobs"].clone(), p["sampler_logprobs"].clone()
    samp[: n // 4] = old[: n // 4] - 1.5  # w = e^1.5 > is_cap = 2
    old[-1], samp[-1] = -30.0, -1.0       # log w = -29, clamped to -20
    p.update(old_logprobs=old, sampler_logprobs=samp)
    return p


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("vocab", [1000, 5000], ids=["V1000", "V5000"])  # 5000: several of Liger's column blocks
def test_liger_matches_float64_reference(dtype, vocab):
    """The liger provider (triton_grpo_loss, B = N sequences of one token, vllm_is_ratio = the truncated IS weight,
    loss_type='bnpo', beta=0) gives the float64 ppo_tis reference's loss and gradient on fresh inputs whose
    advantages take both signs and whose ratios are clipped on both sides and weights truncated."""
    import fused_is

    reason = bench.providers_here(*LIGER_DEVICE_INTERPRETER)["liger"]
    if reason is not None:
        pytest.skip(reason)
    p = _fresh_liger_problem(48, vocab, dtype, seed=20240917 + vocab)
    ref_logits = p["logits"].double().requires_grad_()
    ref = fused_is.policy_loss(ref_logits, p["tokens"], p["advantages"], sampler_logprobs=p["sampler_logprobs"],
                               old_logprobs=p["old_logprobs"], config=bench.CONFIG, backend="reference")
    ref.loss.backward()
    # the inputs exercise every branch the mapping has to get right
    adv, metrics = p["advantages"], ref.metrics
    assert (adv > 0).any() and (adv < 0).any()
    lp = torch.log_softmax(p["logits"].double(), -1).gather(1, p["tokens"][:, None])[:, 0]
    ratio, cfg = torch.exp(lp - p["old_logprobs"].double()), fused_is.LossConfig.preset(bench.CONFIG)
    assert ((ratio > 1 + cfg.clip_high) & (adv > 0)).any() and ((ratio < 1 - cfg.clip_low) & (adv < 0)).any()
    assert 0 < float(metrics["clip_frac"]) < 1 and 0 < float(metrics["is_truncated_frac"]) < 1, metrics

    logits = p["logits"].clone().requires_grad_()
    loss = bench.provider_loss("liger", logits, p)
    loss.backward()
    tol = LIGER_TOL[dtype]
    assert rel_err(loss, ref.loss) < tol["loss"], (loss.item(), ref.loss.item())
    assert logits.grad.shape == logits.shape and logits.grad.dtype == logits.dtype
    assert rel_err(logits.grad, ref_logits.grad) < tol["grad"]
    assert torch.equal(logits.detach(), p["logits"])  # Liger's inplace backward wrote into the provider's own buffer
    errors = bench.provider_errors("liger", p)  # what `fused-is bench` reports for it
    assert errors["loss_err"] < tol["loss"] and errors["grad_err"] < tol["grad"], errors


def test_providers_here_reports_liger(monkeypatch):
    installed = importlib.util.find_spec("liger_kernel") is not None
    here = bench.providers_here(*LIGER_DEVICE_INTERPRETER)["liger"]
    if not installed:
        assert "not installed" in here
        return
    if DEVICE == "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        assert here is None
    # on the CPU only under the interpreter: the flag and TRITON_INTERPRET=1 both
    assert "interpreter" in bench.providers_here("cpu")["liger"]
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert "TRITON_INTERPRET=1" in bench.liger_unavailable_reason("cpu", triton_interpreter=True)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert bench.liger_unavailable_reason("cpu", triton_interpreter=True) is None
    # a broken install says so; a missing one says it is not installed
    monkeypatch.setitem(__import__("sys").modules, "liger_kernel.transformers.grpo_loss", None)
    assert "does not import" in bench.liger_unavailable_reason("cpu", triton_interpreter=True)
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "liger_kernel" else
                        find_spec(name, *a))
    assert "not installed" in bench.providers_here("cpu", triton_interpreter=True)["liger"]


# --triton-configs (issue #18): one measurement per launch configuration of the Triton row kernels


def test_parse_triton_config():
    assert bench.parse_triton_config("8192x16") == (8192, 16, None, None)
    assert bench.parse_triton_config(" 128X1 ") == (128, 1, None, None)
    assert bench.parse_triton_config("4096x8@4") == (4096, 8, 4, None)  # 4 programs of _fused_kernel per SM
    assert bench.parse_triton_config("16384x32-nohints") == (16384, 32, None, False)  # its L2 eviction hints off
    assert bench.parse_triton_config("4096x8@2-hints") == (4096, 8, 2, True)
    assert bench.config_label(4096, 8, 2, True) == "4096x8@2-hints"
    assert bench.config_label(16384, 32, None, False) == "16384x32-nohints"
    for text, named in (("4096", "BLOCKxWARPS"), ("x8", "BLOCKxWARPS"), ("100x8", "FUSED_IS_TRITON_BLOCK"),
                        ("32768x8", "FUSED_IS_TRITON_BLOCK"), ("4096x3", "FUSED_IS_TRITON_WARPS"),
                        ("4096x64", "FUSED_IS_TRITON_WARPS"), ("4096x8@", "BLOCKxWARPS\\[@PROGRAMS_PER_SM"),
                        ("4096x8@0", "FUSED_IS_TRITON_PROGRAMS_PER_SM"), ("4096x8-", "-hints|-nohints"),
                        ("4096x8-off", "-hints|-nohints"),
                        ("16384x32@4", "FUSED_IS_TRITON_PROGRAMS_PER_SM")):  # 16 registers a thread
        with pytest.raises(SystemExit, match=named):
            bench.parse_triton_config(text)
    assert not {"FUSED_IS_TRITON_BLOCK", "FUSED_IS_TRITON_WARPS", "FUSED_IS_TRITON_PROGRAMS_PER_SM",
                "FUSED_IS_TRITON_L2_HINTS"} & set(os.environ)


def test_triton_configs_mode(tmp_path, monkeypatch, capsys):
    """Each configuration sets the launcher's variables for its measurement (and only for it), records of kind
    triton_config follow the copy bandwidth in --jsonl, and the table and triton_configs.json report them."""
    import json

    from fused_is.backends import triton as launcher

    if bench.providers_here(DEVICE, triton_interpreter=True)["triton"] is not None:
        pytest.skip(bench.providers_here(DEVICE, triton_interpreter=True)["triton"])
    monkeypatch.delenv(launcher.BLOCK_ENV, raising=False)
    monkeypatch.delenv(launcher.WARPS_ENV, raising=False)
    monkeypatch.delenv(launcher.PROGRAMS_ENV, raising=False)
    monkeypatch.delenv(launcher.HINTS_ENV, raising=False)
    jsonl = tmp_path / "bench.jsonl"
    rc = bench.main(["--triton-configs", "16384x32", "128x2", "128x2@2", "16384x32-hints", "--n", "4",
                     "--vocab", "300", "--dtypes", "bf16", "--reps", "1", "--warmup", "0", "--jsonl", str(jsonl),
                     "--out", str(tmp_path), "--in-process"] + (["--triton-interpreter"] if DEVICE == "cpu" else []))
    assert rc == 0
    records = [json.loads(line) for line in jsonl.read_text().splitlines()]
    assert records[0]["kind"] == "bandwidth" and (records[0]["n"], records[0]["vocab"]) == (4, 300)
    measured = records[1:]
    assert [(r["kind"], r["provider"], r["triton_config"], r["block_launched"], r["triton_warps"]) for r in measured] \
        == [("triton_config", "triton_inplace_forward", "16384x32", 512, 32),
            ("triton_config", "triton_inplace_forward", "128x2", 128, 2),
            ("triton_config", "triton_inplace_forward", "128x2@2", 128, 2),
            ("triton_config", "triton_inplace_forward", "16384x32-hints", 512, 32)]
    assert [r["triton_programs_per_sm"] for r in measured] == [None, None, 2, None]
    # the hints: the launcher's rule (off the GPU: off) unless forced, as each measurement launched
    rule = launcher.l2_hints_on(torch.device(DEVICE))
    assert [(r["triton_l2_hints"], r["l2_hints"]) for r in measured] == [(None, rule)] * 3 + [(True, True)]
    assert measured[2]["programs_per_sm"] == 2 and measured[2]["maxnreg"] == launcher.fused_registers(2, 2)
    for r in measured:
        assert "error" not in r and r["time_median_s"] > 0 and r["copy_frac"] > 0, r
        assert r["loss_err"] < 1e-4 and r["grad_err"] < 2e-2, r  # bf16 against float64, under this configuration
    assert not {launcher.BLOCK_ENV, launcher.WARPS_ENV, launcher.PROGRAMS_ENV, launcher.HINTS_ENV} & set(os.environ)
    summary = json.loads((tmp_path / "triton_configs.json").read_text())
    assert [r["speedup_vs_default"] for r in summary["results"]][0] == 1.0
    assert summary["environment"]["interrupted"] is None
    out = capsys.readouterr().out
    assert "x dflt" in out and "P/SM" in out and "16384x32" in out and "128x2@2" in out and "N=4 V=300 bf16" in out
    table = [line for line in out.splitlines() if not line.startswith("wrote ")]  # a path is as long as it is
    assert max(len(line) for line in table) <= 100, out  # copy_frac and the rest: triton_configs.json
    with pytest.raises(SystemExit, match="Triton providers"):
        bench.main(["--triton-configs", "4096x8", "--providers", "cuda"])
