"""bench/gpu_suite.sh --dry-run: the whole GPU suite on the CPU (about a minute), so that the one rare run on a
lent GPU machine cannot fail for a reason a CPU run would have caught: install, imports, every step's command
line, the outputs that come back (at most 8 flat files with plain names), the jsonl order (the case the model
predicts first), the clocks file (a stub's samples) and the summary."""

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import shlex

import pytest

import conftest

ROOT = Path(__file__).resolve().parent.parent
SUITE = ROOT / "bench" / "gpu_suite.sh"


def suite_array(name: str) -> list:
    """The words of bench/gpu_suite.sh's NAME=(...) line(s)."""
    match = re.search(rf"^{name}=\(([^)]*)\)", SUITE.read_text(), re.M)
    assert match, f"bench/gpu_suite.sh has no {name}=(...)"
    return shlex.split(match.group(1).replace("\n", " "))
pytestmark = [pytest.mark.slow] + ([pytest.mark.timeout(1800)] if importlib.util.find_spec("pytest_timeout") else [])


@pytest.fixture(scope="module")
def suite_run(tmp_path_factory):
    """(process, output folder) of one `bash bench/gpu_suite.sh --dry-run`, shared by this module's tests."""
    out = tmp_path_factory.mktemp("gpu_suite")
    # a standalone run's environment (not this pytest's, nor its xdist worker's)
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTEST_ADDOPTS", "DRY_RUN", "BUDGET", "SLACK") and not k.startswith("PYTEST_XDIST")}
    env.update(OUT=str(out), PYTHON=sys.executable)
    if conftest.LAUNCHES_PATH:  # the dry run's Triton launches go to the GPU build check too
        env["SUITE_TRITON_LAUNCHES"] = str(Path(conftest.LAUNCHES_PATH).with_name("triton_launches_gpu_suite.jsonl"))
    proc = subprocess.run(["bash", str(ROOT / "bench" / "gpu_suite.sh"), "--dry-run"], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=1700)  # the dry run's budget: 3 x 540 s
    return proc, out


def test_dry_run_passes(suite_run):
    proc, out = suite_run
    log = (out / "suite.log").read_text()
    assert proc.returncode == 0, f"exit {proc.returncode}; end of the log:\n{log[-4000:]}\n{proc.stderr[-2000:]}"
    assert "all steps passed" in log.strip().splitlines()[-1]


def test_outputs_come_back(suite_run):
    import tarfile

    _, out = suite_run
    files = sorted(p.name for p in out.iterdir())
    assert len(files) <= 8, files
    assert all(re.fullmatch(r"[A-Za-z0-9._-]+", name) for name in files), files
    assert all((out / name).is_file() for name in files), files
    assert set(files) == set(suite_array("KEEP")) | {"extra.tar.gz"}, files
    with tarfile.open(out / "extra.tar.gz") as archive:
        packed = set(archive.getnames())
    assert {"bench.csv", "triton_configs.json", "linear.jsonl", "grid/bench.json"} <= packed, packed


def test_the_gpu_run_fits_one_call():
    """One device call of at most 600 s holds the whole suite: the budget leaves room for the kill grace and the
    archive; the headline starts with the case the model predicts, in place, then Liger, then the separate gradient."""
    budget = int(re.search(r"^BUDGET=\$\{BUDGET:-(\d+)\}", SUITE.read_text(), re.M).group(1))
    assert 500 <= budget <= 550, budget
    assert suite_array("HEADLINE_PROVIDERS")[:6] == ["triton_inplace_forward", "cuda_inplace_forward",
                                                     "cuda_cluster_inplace_forward", "liger", "triton", "cuda"]
    assert {"triton_token_logprobs", "cuda_token_logprobs"} <= set(suite_array("HEADLINE_PROVIDERS"))
    assert "compile" not in suite_array("HEADLINE_PROVIDERS") + suite_array("GRID_PROVIDERS")  # its own step, last


def test_install_path_is_logged(suite_run):
    _, out = suite_run
    log = (out / "suite.log").read_text()
    way = re.search(r"fused_is runs from the (installed copy|source tree)", log)
    assert way, log[:2000]
    imported = re.search(r"fused_is imported from (\S+)", log).group(1)
    if way.group(1) == "installed copy":  # the copy in the suite's temporary site folder, not the tree
        assert "/site/fused_is/" in imported and not imported.startswith(str(ROOT)), imported
    assert re.search(r"kernels imported from \S+/triton_kernels/policy_loss\.py", log), log[:2000]
    benchmarks = re.search(r"fused_is.benchmarks imported from (\S+)", log).group(1)  # the install's, not an editable
    assert benchmarks.startswith(imported.rsplit("/", 1)[0] + "/benchmarks/"), (benchmarks, imported)


def test_jsonl_has_bandwidth_then_headline(suite_run):
    _, out = suite_run
    records = [json.loads(line) for line in (out / "bench.jsonl").read_text().splitlines()]
    first, second = records[:2]
    assert first["kind"] == "bandwidth" and (first["n"], first["vocab"], first["dtype"]) == (8, 1000, "bf16")
    assert first["gbps"] > 0
    assert second["kind"] == "provider" and second["provider"] == "triton_inplace_forward"  # the predicted case
    assert (second["n"], second["vocab"], second["dtype"], second["seq_len"]) == (8, 1000, "bf16", 4)  # like for like
    # the headline in the GPU run's order (the cuda providers skipped here, liger where installed), cpu stand-ins last
    headline = [r["provider"] for r in records if r["kind"] == "provider" and r["seq_len"] == 4]
    order = suite_array("HEADLINE_PROVIDERS") + ["cpu_inplace_forward", "cpu_token_logprobs"]
    assert headline == [p for p in order if p in headline], headline
    assert {"triton_inplace_forward", "triton", "triton_token_logprobs", "eager", "cpu_inplace_forward",
            "cpu_token_logprobs"} <= set(headline), headline
    probes = [r for r in records if r["kind"] == "provider" and r["provider"].endswith("_token_logprobs")]
    assert probes and all(r["floor_bytes"] == r["logits_bytes"] and r["grad_err"] is None and r["loss_err"] < 1e-3
                          for r in probes), probes  # one read of the logits; logprobs against float64
    measured = [r for r in records if r["kind"] == "provider"]
    assert not [r for r in measured if "error" in r], [r for r in measured if "error" in r]
    assert {"triton", "triton_inplace", "torch", "torch_inplace", "eager"} <= {r["provider"] for r in measured}
    assert all(r["time_median_s"] > 0 and r["copy_gbps"] > 0 for r in measured)
    summary = json.loads((out / "bench.json").read_text())  # the headline's (the grid writes into grid/)
    assert [r["provider"] for r in summary["results"]] == headline
    assert summary["bandwidth"] and summary["environment"]["interrupted"] is None


def test_triton_configs_in_the_suites_order(suite_run):
    """The launch configurations, each with the programs per SM it ran with: the override after '@'."""
    _, out = suite_run
    records = [json.loads(line) for line in (out / "bench.jsonl").read_text().splitlines()]
    configs = [r for r in records if r["kind"] == "triton_config" and r["triton_l2_hints"] is None]
    assert [r["triton_config"] for r in configs] == suite_array("TRITON_CONFIGS")
    assert not [r for r in configs if "error" in r]
    for r in configs:
        override = int(r["triton_config"].partition("@")[2] or 0) or None
        assert r["triton_programs_per_sm"] == override and r["programs_per_sm"] == (override or r["programs_per_sm"])


def test_l2_hints_step_forces_them_off(suite_run):
    """The l2_hints step: the separate-gradient and in-place Triton providers at the configurations' size, the
    kernel's L2 eviction hints forced off (as launched: the record says so), before the configurations."""
    _, out = suite_run
    records = [json.loads(line) for line in (out / "bench.jsonl").read_text().splitlines()]
    forced = [r for r in records if r["kind"] == "triton_config" and r["triton_l2_hints"] is not None]
    assert [(r["provider"], r["triton_config"], r["triton_l2_hints"], r["l2_hints"]) for r in forced] == [
        ("triton", "16384x32-nohints", False, False), ("triton_inplace_forward", "16384x32-nohints", False, False)]
    assert not [r for r in forced if "error" in r]
    configs = [i for i, r in enumerate(records) if r["kind"] == "triton_config"]
    assert configs[:2] == [records.index(r) for r in forced]  # before the configurations step


def test_clocks_and_summary(suite_run):
    """clocks.csv: a sample every 0.2 s tagged with the step (a stub's zeros on the CPU); summary.md: which case the
    model predicts, the headline providers in order, the probe, the clocks per step and the configurations."""
    import csv

    _, out = suite_run
    with (out / "clocks.csv").open() as f:
        samples = list(csv.DictReader(f))
    assert samples and {s["source"] for s in samples} == {"stub"}
    assert {"headline", "triton_configs", "gpu_tests"} <= {s["step"] for s in samples}
    text = (out / "summary.md").read_text()
    assert "predicts the headline case" in text and "all steps passed" in text
    assert "| triton_inplace_forward | in place |" in text and "| triton | separate gradient |" in text
    assert "- triton: one read (`token_logprobs`" in text
    assert "| headline |" in text and "| 8192x16@2 | 2 |" in text
    hints = text.split("## Triton L2 eviction hints")[1]
    assert "| triton | separate buffer |" in hints and "| triton_inplace_forward | in place |" in hints


def test_gpu_tests_and_verify_ran(suite_run):
    _, out = suite_run
    tests = (out / "gpu_tests.txt").read_text()
    passed = re.search(r"(\d+) passed", tests)
    assert passed and int(passed.group(1)) > 0, tests[-2000:]
    assert not re.search(r"\d+ (failed|error)", tests), tests[-2000:]
    assert "all passed" in (out / "verify.txt").read_text()


def test_linear_bench_ran(suite_run):
    """The fused-linear step measured every provider it was given; its files travel in extra.tar.gz."""
    import tarfile

    _, out = suite_run
    with tarfile.open(out / "extra.tar.gz") as archive:
        lines = archive.extractfile("linear.jsonl").read().decode().splitlines()
    records = [json.loads(line) for line in lines[1:]]
    assert {(r["provider"], r["n"]) for r in records} == {
        (p, n) for p in ("eager", "fused_linear_torch", "fused_linear_cpu", "fused_logits_cpu") for n in (16, 32)}, records
    assert not [r for r in records if "error" in r]
    # fused_linear against the three GEMMs plus the fused loss on materialised logits (the fused-linear GPU target)
    assert all(r["x_gemms_plus_loss"] > 0 for r in records if r["provider"] == "fused_linear_cpu"), records
    # long context: packed sequences (--seq-len), masked rows, its own folder
    with tarfile.open(out / "extra.tar.gz") as archive:
        lines = archive.extractfile("linear_long/linear.jsonl").read().decode().splitlines()
    records = [json.loads(line) for line in lines[1:]]
    assert {(r["provider"], r["n"], r["masked"], r["seq_len"]) for r in records} == {
        (p, n, m, 64) for p in ("fused_linear_torch", "fused_linear_cpu") for n in (64, 128) for m in (0.0, 0.75)}
    assert not [r for r in records if "error" in r]
    assert all(0 < r["time_x_unmasked"] for r in records), records


def test_a_rerun_of_some_steps_keeps_the_earlier_files(tmp_path):
    """STEPS=verify: install, environment and verify run, the other selectable steps are logged as not selected,
    and what an earlier run left in the output folder stays (appended to, not removed); a bad name is refused."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTEST_ADDOPTS", "DRY_RUN", "BUDGET")}
    env.update(OUT=str(tmp_path), PYTHON=sys.executable, STEPS="verify")
    (tmp_path / "gpu_tests.txt").write_text("the earlier run's gpu tests\n")
    (tmp_path / "suite.log").write_text("the earlier run's log\n")
    proc = subprocess.run(["bash", str(ROOT / "bench" / "gpu_suite.sh"), "--dry-run"], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    log = (tmp_path / "suite.log").read_text()
    assert proc.returncode == 0, log[-3000:] + proc.stderr[-2000:]
    assert log.startswith("the earlier run's log\n") and "all steps passed" in log.strip().splitlines()[-1]
    for name in ("headline", "l2_hints", "triton_configs", "gpu_tests", "linear", "linear_long", "grid"):
        assert f"{name}: not selected (STEPS=verify)" in log, name
    assert "environment (timeout" in log and "all passed" in (tmp_path / "verify.txt").read_text()
    assert (tmp_path / "gpu_tests.txt").read_text() == "the earlier run's gpu tests\n"
    env["STEPS"] = "verify,tests"
    bad = subprocess.run(["bash", str(ROOT / "bench" / "gpu_suite.sh"), "--dry-run"], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "unknown step 'tests'" in bad.stderr
