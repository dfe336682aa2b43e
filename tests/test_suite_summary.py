"""bench/gpu/suite_summary.py and bench/gpu/clocks.py on the records a GPU run writes (made up here, in the shape the
bench writes them): the model's predicted ms beside the measured kernel time by name, the probe's split, the clocks
per step. The dry run (tests/test_gpu_suite.py) runs both on the CPU, where no kernel time or clock exists."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

GPU_TOOLS = Path(__file__).resolve().parent.parent / "bench" / "gpu"
sys.path.insert(0, str(GPU_TOOLS))

import suite_summary  # noqa: E402

SIZE = dict(n=16384, vocab=151936, dtype="bf16", seq_len=1024, logits_bytes=16384 * 151936 * 2)


def _provider(name, full_ms, busy_ms, own=None):
    record = dict(kind="provider", provider=name, time_median_s=full_ms / 1e3, time_min_s=full_ms / 1e3,
                  time_max_s=full_ms / 1e3, kernel_time_s=busy_ms / 1e3, loss_err=1e-7, grad_err=1e-3,
                  kernels={}, **SIZE)
    if own:
        record["kernels"] = {k: v / 1e3 for k, v in own.items()}
        record["kernels"]["at::native::vectorized_elementwise_kernel<4>"] = 0.01e-3
        record.update(fused_kernels=list(own), fused_kernel_time_s=sum(own.values()) / 1e3,
                      fused_kernel_gbps=2 * SIZE["logits_bytes"] / (sum(own.values()) / 1e3) / 1e9,
                      fused_kernel_copy_frac=0.8)
    return record


@pytest.fixture
def run_dir(tmp_path):
    records = [dict(kind="bandwidth", n=16384, vocab=151936, dtype="bf16", gbps=4300.0),
               _provider("triton_inplace_forward", 3.2, 3.05, {"_fused_kernel": 3.0}),
               _provider("cuda_inplace_forward", 3.0, 2.85, {"fused_rows_kernel<__nv_bfloat16, true>": 2.8}),
               _provider("liger", 4.0, 3.9, {"_grpo_loss_fwd_kernel": 1.3, "_grpo_loss_bwd_kernel": 2.5}),
               _provider("triton", 3.6, 3.5, {"_fused_kernel": 3.3}),
               dict(_provider("triton_token_logprobs", 1.4, 1.3, {"_row_stats_kernel": 1.25}), grad_err=None),
               dict(kind="provider", provider="cuda", error="RuntimeError: boom", **SIZE)]
    (tmp_path / "bench.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records) + '{"cut by a kill')
    prediction = dict(headline=dict(rows=16384, vocab=151936, inplace=True),
                      providers=[dict(provider="cuda", predicted_ms=2.65),
                                 dict(provider="triton", predicted_ms=2.69, predicted_ms_low=2.5,
                                      predicted_ms_high=2.9),
                                 dict(provider="liger", predicted_ms=3.55)])
    (tmp_path / "inplace.json").write_text(json.dumps(prediction))
    separate = dict(prediction, providers=[dict(provider="triton", predicted_ms=3.3, predicted_ms_low=3.0,
                                                predicted_ms_high=3.6)])
    (tmp_path / "separate.json").write_text(json.dumps(separate))
    (tmp_path / "clocks.csv").write_text(
        "t_s,step,sm_mhz,mem_mhz,power_w,temp_c,reasons,source\n"
        "0.0,-,345,3201,80.5,30,0x1,nvml\n"
        "0.2,headline,1980,3201,600.1,55,0x0,nvml\n"
        "0.4,headline,1755,3201,690.0,60,0x4,nvml\n")
    return tmp_path


def test_predicted_beside_measured(run_dir):
    text = suite_summary.summary(run_dir, run_dir / "inplace.json", run_dir / "separate.json", note="done in 1s")
    rows = {line.split(" | ")[0].lstrip("| "): line for line in text.splitlines() if line.startswith("| ")}
    # the provider's own kernel by name against the model's ms (3.0 / 2.69), not the full call
    assert rows["triton_inplace_forward"].startswith(
        "| triton_inplace_forward | in place | 2.690 (2.50-2.90) | 3.000 | 1.12 (above the range) |")
    assert rows["cuda_inplace_forward"].startswith("| cuda_inplace_forward | in place | 2.650 | 2.800 | 1.06 |")
    assert "| liger | in place | 3.550 | 3.800 | 1.07 |" in rows["liger"]
    assert "| triton | separate gradient | 3.300 (3.00-3.60) | 3.300 | 1.00 (in the range) |" in rows["triton"]
    assert "failed: RuntimeError: boom" in rows["cuda"]
    assert "_grpo_loss_fwd_kernel 1.300, _grpo_loss_bwd_kernel 2.500" in rows["liger"]
    assert "predicts the headline case" in text and "done in 1s" in text
    # the probe: one read 1.25 ms of the fused kernel's 3.0
    assert "one read (`token_logprobs`, _row_stats_kernel) 1.250 ms" in text and "1.750 ms (58% of it)" in text
    # clocks per step
    assert "| headline | 2 | 1755 / 1868 / 1980 | 3201 / 3201 / 3201 | 645 (690) | 60 | 0x4 |" in text
    assert "| - | 1 | 345 / 345 / 345 |" in text


def test_no_prediction_and_other_sizes(run_dir):
    text = suite_summary.summary(run_dir)
    assert "Prediction: none in this run" in text and "| triton_inplace_forward | in place | - | 3.000 | - |" in text
    small = json.dumps(dict(headline=dict(rows=8, vocab=1000), providers=[]))
    (run_dir / "small.json").write_text(small)
    assert "prediction is for N = 8, V = 1000: not this size" in suite_summary.summary(run_dir, run_dir / "small.json")


def test_the_machine_predicted_against_the_one_measured(run_dir):
    """The summary names the machine each prediction models and says so where the run's GPU is another one (the
    device tool may lend an H100 where the prediction is the H200's)."""
    h100 = dict(key="h100", name="H100 SXM 80GB", hbm_copy=3.0e12, l2_bytes=50 * 2**20)
    report = json.loads((run_dir / "inplace.json").read_text())
    (run_dir / "inplace.json").write_text(json.dumps(dict(report, gpu=h100)))
    for device, warned in (("NVIDIA H100 80GB HBM3", False), ("NVIDIA H200", True)):
        (run_dir / "bench.json").write_text(json.dumps(dict(environment=dict(gpu=device))))
        text = suite_summary.summary(run_dir, run_dir / "inplace.json")
        assert "The in place prediction models the H100 SXM 80GB (copy 3.0 TB/s, L2 50 MiB)." in text
        assert ("not the H100 the in place prediction models" in text) == warned, text


def test_command_line_writes_summary_md(run_dir):
    proc = subprocess.run([sys.executable, str(GPU_TOOLS / "suite_summary.py"), str(run_dir), "--prediction",
                           str(run_dir / "inplace.json"), "--prediction-separate", str(run_dir / "missing.json")],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert (run_dir / "summary.md").read_text() == proc.stdout


def test_clocks_stub_and_no_source(tmp_path):
    """--stub writes tagged rows until SIGTERM; without a GPU and without --stub one row says why there are none."""
    step = tmp_path / "step"
    step.write_text("headline\n")
    out = tmp_path / "clocks.csv"
    proc = subprocess.Popen([sys.executable, str(GPU_TOOLS / "clocks.py"), "--out", str(out), "--step-file",
                             str(step), "--interval", "0.05", "--stub"])
    try:
        for _ in range(200):
            if out.exists() and out.read_text().count("\n") >= 3:
                break
            subprocess.run(["sleep", "0.05"])
    finally:
        proc.terminate()
        assert proc.wait(timeout=30) == 0
    lines = out.read_text().splitlines()
    assert lines[0] == "t_s,step,sm_mhz,mem_mhz,power_w,temp_c,reasons,source"
    assert len(lines) >= 3 and all(line.endswith(",stub") and ",headline," in line for line in lines[1:])
    assert suite_summary.clocks_section(out)[0].startswith(f"{len(lines) - 1} samples (stub)")


def test_l2_hints_beside_the_headline():
    """The l2_hints step's records (the hints forced off) beside the headline's as launched (on, from the run's
    environment): kernel ms and their ratio; configurations with forced hints stay out of the configurations'
    table; no forced record, no comparison."""
    headline = [_provider("triton_inplace_forward", 3.2, 3.05, {"_fused_kernel": 3.0}),
                _provider("triton", 3.6, 3.5, {"_fused_kernel": 3.0})]
    off = dict(_provider("triton", 4.0, 3.9, {"_fused_kernel": 3.6}), kind="triton_config",
               triton_config="16384x32-nohints", triton_l2_hints=False, l2_hints=False, programs_per_sm=1)
    other = dict(off, vocab=32000)  # not the headline's size: not compared
    lines = suite_summary.hints_section(headline + [off, other], launched=True)
    assert "| triton | separate buffer | 3.000 (on) | 3.600 (off) | 1.200 | 3.600 / 4.000 |" in lines
    assert "| triton | no headline record at this size |||||" in lines
    assert suite_summary.configs_section(headline + [off]) == ["No Triton launch configuration was measured."]
    assert suite_summary.hints_section(headline, launched=True) == [
        "The L2 eviction hints were not compared in this run."]
