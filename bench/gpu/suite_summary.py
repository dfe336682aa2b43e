"""The GPU suite's answer on one page: summary.md in the suite's output folder (bench/gpu_suite.sh writes it after
the headline and again at the end), from what the run wrote there: bench.jsonl (the measurements), clocks.csv
(bench/gpu/clocks.py) and the static model's prediction (bench/gpu/gpu_perf_report.py's JSON, in place and with
--separate-gradient), when there is one.

- Which case the model predicts, and for each headline provider the predicted ms beside the measured ones: the
  provider's own kernels by name from the profiler (the time the model predicts), the GPU's busy time and the full
  call (CUDA events).
- The one-read probe (fused_is.token_logprobs: one sweep) beside the fused kernel (two sweeps and the gradient's
  write): how the time splits between the first sweep and the rest.
- The clocks per suite step (SM and memory MHz, power, temperature, clock event reasons).
- The Triton launch configurations (BLOCK x warps @ programs per SM) against the default.
- The Triton kernel's L2 eviction hints: the headline's triton providers (hints on, the launcher's rule on sm_90)
  against the same providers with them forced off (configuration 16384x32-nohints).

    python bench/gpu/suite_summary.py OUT [--prediction JSON] [--prediction-separate JSON] [--note TEXT]

Reads no torch: a second or less.
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import sys
from pathlib import Path

# measured provider -> (the model's case, the prediction's provider): the model predicts the in-place case (the
# gradient written over the logits in the one forward sweep: one read and one write), and with --separate-gradient
# the inplace=False one; Liger's two kernels write the gradient over its own input
PREDICTED = {"triton_inplace_forward": ("in place", "triton"), "cuda_inplace_forward": ("in place", "cuda"),
             "liger": ("in place", "liger"), "triton": ("separate gradient", "triton"),
             "cuda": ("separate gradient", "cuda")}
PROBE = "_token_logprobs"
MODEL_CASE = ("The static model (bench/gpu/gpu_perf_report.py) predicts the headline case: N = 16384 rows, "
              "V = 151936, bf16, ppo_tis forward and backward with the gradient written over the logits in the one "
              "forward sweep (`triton_inplace_forward`: one `_fused_kernel` launch; `cuda_inplace_forward`: one "
              "`fused_rows_kernel` launch; one read and one write of the logits, the second sweep from L2), and "
              "Liger-Kernel's two kernels (`liger`); with --separate-gradient the inplace=False providers "
              "(`triton`, `cuda`). It models the kernels alone: compare its ms with \"kernel ms\" (the provider's "
              "own kernels by name in the profiler), not with the full call. The cluster kernel "
              "(`cuda_cluster_inplace_forward`) is not modelled.")


def read_jsonl(path: Path) -> list:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:  # a line cut by a kill
            continue
    return out


def read_prediction(path) -> dict:
    """{provider: its row of the prediction's ranking} plus "_headline" (rows, vocab, inplace), or {}."""
    if not path or not Path(path).exists():
        return {}
    try:
        report = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    out = {row["provider"]: row for row in report.get("providers", [])}
    out["_headline"] = report.get("headline", {})
    out["_gpu"] = report.get("gpu", {})
    return out


def machine_lines(predictions: dict, device) -> list:
    """The machine each prediction models, and a warning where it is not the GPU the suite ran on."""
    lines = []
    for case, pred in predictions.items():
        gpu = pred.get("_gpu") or {}
        if not gpu:
            continue
        lines.append(f"The {case} prediction models the {gpu.get('name')} (copy "
                     f"{gpu.get('hbm_copy', 0) / 1e12:.1f} TB/s, L2 {gpu.get('l2_bytes', 0) / 2**20:.0f} MiB).")
        key = gpu.get("key", "")
        if device and key and key.lower() not in str(device).lower():
            lines.append(f"**This run's GPU is {device}, not the {key.upper()} the {case} prediction models: its "
                         "predicted ms do not apply.**")
    return lines


def _ms(seconds) -> str:
    return f"{seconds * 1e3:.3f}" if isinstance(seconds, (int, float)) else "-"


def predicted_ms(row: dict) -> str:
    """The prediction's ms, with its range where the report gives one."""
    low = row.get("predicted_ms_low", row.get("low_ms"))
    high = row.get("predicted_ms_high", row.get("high_ms"))
    text = f"{row['predicted_ms']:.3f}" if isinstance(row.get("predicted_ms"), (int, float)) else "-"
    if isinstance(low, (int, float)) and isinstance(high, (int, float)):
        text += f" ({low:.2f}-{high:.2f})"
    return text


def headline_records(records: list) -> list:
    """The provider records of the headline step: the size and layout of the first provider record."""
    providers = [r for r in records if r.get("kind") == "provider"]
    if not providers:
        return []
    key = lambda r: (r["n"], r["vocab"], r["dtype"], r.get("seq_len") or 0)  # noqa: E731
    first = key(providers[0])
    out, seen = [], set()
    for r in providers:
        if key(r) == first and r["provider"] not in seen:  # the headline's, not a later step's repeat
            seen.add(r["provider"])
            out.append(r)
    return out


def headline_section(records: list, predictions: dict) -> list:
    rows = headline_records(records)
    if not rows:
        return ["No headline measurement in bench.jsonl."]
    r0 = rows[0]
    bandwidth = next((b for b in records if b.get("kind") == "bandwidth" and
                      (b["n"], b["vocab"], b["dtype"]) == (r0["n"], r0["vocab"], r0["dtype"])), None)
    lines = [f"Measured: N = {r0['n']}, V = {r0['vocab']}, {r0['dtype']}" + (f", sequences of L = {r0['seq_len']}"
                                                                                  if r0.get("seq_len") else "")
             + (f"; device copy {bandwidth['gbps']:.0f} GB/s (1 read + 1 write)" if bandwidth else "") + "."]
    for case, pred in predictions.items():
        head = pred.get("_headline", {})
        if head and (head.get("rows"), head.get("vocab")) != (r0["n"], r0["vocab"]):
            lines.append(f"The {case} prediction is for N = {head.get('rows')}, V = {head.get('vocab')}: not this "
                         "size (compare at the headline size only).")
    lines += ["", "| provider | model's case | predicted ms, central (low-high) | kernel ms (own, by name) | "
              "measured / central (against the range) | busy ms (all kernels) | full call ms (min-max) | "
              "GB/s of kernel (% of copy) | own kernels |",
              "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        name = r["provider"]
        if "error" in r:
            lines.append(f"| {name} | failed: {r['error'][:200]} |||||||| ")
            continue
        case, model = PREDICTED.get(name, ("-", None))
        pred_row = predictions.get(case, {}).get(model)
        own = r.get("fused_kernel_time_s")
        ratio = (f"{own * 1e3 / pred_row['predicted_ms']:.2f}" if own and pred_row
                 and isinstance(pred_row.get("predicted_ms"), (int, float)) else "-")
        if ratio != "-" and isinstance(pred_row.get("predicted_ms_low"), (int, float)):
            ms = own * 1e3
            ratio += (" (below the range)" if ms < pred_row["predicted_ms_low"] else
                      " (above the range)" if ms > pred_row["predicted_ms_high"] else " (in the range)")
        gbps = r.get("fused_kernel_gbps", r.get("kernel_gbps"))
        frac = r.get("fused_kernel_copy_frac", r.get("kernel_copy_frac"))
        lines.append(
            f"| {name} | {case} | {predicted_ms(pred_row) if pred_row else '-'} | "
            f"{_ms(own)} | {ratio} | {_ms(r.get('kernel_time_s'))} | {_ms(r['time_median_s'])} "
            f"({_ms(r['time_min_s'])}-{_ms(r['time_max_s'])}) | "
            + (f"{gbps:.0f} ({100 * frac:.0f}%)" if gbps and frac else "-") + " | "
            + ", ".join(f"{k} {_ms(r['kernels'][k])}" for k in r.get("fused_kernels", [])) + " |")
    return lines


def probe_section(records: list) -> list:
    rows = {r["provider"]: r for r in headline_records(records) if "error" not in r}
    lines = []
    for backend in ("triton", "cuda"):
        probe, fused = rows.get(backend + PROBE), rows.get(backend + "_inplace_forward")
        if not probe:
            continue
        one = probe.get("fused_kernel_time_s", probe.get("kernel_time_s", probe["time_median_s"]))
        text = (f"- {backend}: one read (`token_logprobs`, {', '.join(probe.get('fused_kernels', [])) or 'the call'})"
                f" {one * 1e3:.3f} ms")
        if fused:
            two = fused.get("fused_kernel_time_s", fused.get("kernel_time_s", fused["time_median_s"]))
            text += (f"; the fused kernel (sweep 1, sweep 2 and the gradient's write) {two * 1e3:.3f} ms; the rest "
                     f"beyond one read {(two - one) * 1e3:.3f} ms ({100 * (two - one) / two:.0f}% of it)")
        lines.append(text + ".")
    if not lines:
        return ["No one-read probe was measured."]
    return ["The probe reads the logits once (the statistics sweep alone, no gradient): the fused kernel's time "
            "beyond it is the second sweep (from L2 if the rows stayed there) and the gradient's write.", ""] + lines


def clocks_section(path: Path) -> list:
    if not path.exists():
        return ["No clocks.csv."]
    with path.open() as f:
        rows = list(csv.DictReader(f))
    if not rows:
        return ["clocks.csv has no sample."]
    if rows[0].get("source", "").startswith("none"):
        return [f"No clock source: {rows[0]['source']}"]
    steps: dict = {}
    for row in rows:
        steps.setdefault(row.get("step") or "-", []).append(row)
    lines = [f"{len(rows)} samples ({rows[0].get('source')}), per step of the suite:", "",
             "| step | samples | SM MHz min / median / max | memory MHz min / median / max | power W median (max) | "
             "temperature C max | clock event reasons |", "|---|---|---|---|---|---|---|"]

    def numbers(key, samples):
        out = []
        for s in samples:
            try:
                out.append(float(s.get(key) or "nan"))
            except ValueError:
                continue
        return [x for x in out if x == x]

    def spread(values):
        return (f"{min(values):.0f} / {statistics.median(values):.0f} / {max(values):.0f}" if values else "-")

    for step, samples in steps.items():
        sm, mem, power, temp = (numbers(k, samples) for k in ("sm_mhz", "mem_mhz", "power_w", "temp_c"))
        reasons = sorted({s.get("reasons") for s in samples if s.get("reasons") not in (None, "", "0x0")})
        lines.append(f"| {step} | {len(samples)} | {spread(sm)} | {spread(mem)} | "
                     + (f"{statistics.median(power):.0f} ({max(power):.0f})" if power else "-") + " | "
                     + (f"{max(temp):.0f}" if temp else "-") + f" | {', '.join(reasons) or '-'} |")
    return lines


def configs_section(records: list) -> list:
    configs = [r for r in records if r.get("kind") == "triton_config" and r.get("triton_l2_hints") is None]
    if not configs:
        return ["No Triton launch configuration was measured."]
    lines = ["| config (BLOCK x warps @ programs per SM) | programs / SM | maxnreg | kernel ms (_fused_kernel) | "
             "full call ms | x default | grad err |", "|---|---|---|---|---|---|---|"]
    default = next((r for r in configs if r.get("triton_programs_per_sm") is None and "error" not in r
                    and r.get("triton_config") == "16384x32"), None)
    for r in configs:
        if "error" in r:
            lines.append(f"| {r['triton_config']} | failed: {r['error'][:200]} ||||||")
            continue
        own = r.get("fused_kernel_time_s")
        base = default.get("fused_kernel_time_s") if default else None
        ratio = base / own if own and base else (default["time_median_s"] / r["time_median_s"] if default else None)
        err = f"{r['grad_err']:.1e}" if r.get("grad_err") is not None else "-"
        lines.append(f"| {r['triton_config']} | {r.get('programs_per_sm', '-')} | {r.get('maxnreg', '-')} | "
                     f"{_ms(own)} | {_ms(r['time_median_s'])} | " + (f"{ratio:.3f}" if ratio else "-") + f" | {err} |")
    return lines


def hints_section(records: list, launched=None) -> list:
    """Each headline Triton provider (as launched: `launched`, the run's environment's triton_l2_hints) beside its
    run with the hints forced off or on (a triton_config record with triton_l2_hints set, at the same size): kernel
    ms and their ratio."""
    headline = {r["provider"]: r for r in headline_records(records) if "error" not in r}
    forced = [r for r in records if r.get("kind") == "triton_config" and r.get("triton_l2_hints") is not None]
    state = {True: "on", False: "off"}.get(launched, "?")
    if not forced:
        return ["The L2 eviction hints were not compared in this run."]
    lines = ["| provider | gradient | kernel ms, as launched (hints) | kernel ms, hints forced | forced / launched | "
             "full call ms, launched / forced |", "|---|---|---|---|---|---|"]
    for r in forced:
        base = headline.get(r["provider"])
        same = base is not None and (base["n"], base["vocab"], base["dtype"]) == (r["n"], r["vocab"], r["dtype"])
        if "error" in r or not same:
            why = f"failed: {r['error'][:200]}" if "error" in r else "no headline record at this size"
            lines.append(f"| {r['provider']} | {why} |||||")
            continue
        own, forced_own = base.get("fused_kernel_time_s"), r.get("fused_kernel_time_s")
        lines.append(f"| {r['provider']} | {'in place' if 'inplace' in r['provider'] else 'separate buffer'} | "
                     f"{_ms(own)} ({state}) | {_ms(forced_own)} ({'on' if r['triton_l2_hints'] else 'off'}) | "
                     + (f"{forced_own / own:.3f}" if own and forced_own else "-")
                     + f" | {_ms(base['time_median_s'])} / {_ms(r['time_median_s'])} |")
    return lines


def summary(out_dir: Path, prediction=None, prediction_separate=None, note: str = "") -> str:
    records = read_jsonl(out_dir / "bench.jsonl")
    predictions = {case: pred for case, pred in (("in place", read_prediction(prediction)),
                                                  ("separate gradient", read_prediction(prediction_separate))) if pred}
    env = {}
    if (out_dir / "bench.json").exists():
        try:
            env = json.loads((out_dir / "bench.json").read_text()).get("environment", {})
        except (OSError, json.JSONDecodeError):
            env = {}
    lines = ["# GPU suite summary", ""]
    if env:
        lines += [f"{env.get('gpu', env.get('machine'))}, torch {env.get('torch')}, triton {env.get('triton')}, "
                  f"git {env.get('git')}, {env.get('date')}.", ""]
    if note:
        lines += [note, ""]
    lines += [MODEL_CASE, ""]
    sources = [f"{case}: {Path(path)}" for case, path in (("in place", prediction),
                                                          ("separate gradient", prediction_separate))
               if path and Path(path).exists()]
    lines += ["Prediction: " + ("; ".join(sources) if sources else "none in this run (the predicted ms columns are "
                                "empty; scripts/dev.sh test writes build/gpu_perf_report.json)"), ""]
    machines = machine_lines(predictions, env.get("gpu"))
    lines += [" ".join(machines), ""] if machines else []
    lines += ["## Headline: predicted against measured", ""] + headline_section(records, predictions)
    lines += ["", "## One read against the fused kernel", ""] + probe_section(records)
    lines += ["", "## Clocks", ""] + clocks_section(out_dir / "clocks.csv")
    lines += ["", "## Triton launch configurations", ""] + configs_section(records)
    lines += ["", "## Triton L2 eviction hints", ""] + hints_section(records, env.get("triton_l2_hints"))
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path, help="the suite's output folder")
    parser.add_argument("--prediction", type=Path, help="gpu_perf_report.json of the in-place case")
    parser.add_argument("--prediction-separate", type=Path, help="gpu_perf_report.json of --separate-gradient")
    parser.add_argument("--note", default="", help="a line for the top (the suite's state)")
    args = parser.parse_args(argv)
    text = summary(args.out_dir, args.prediction, args.prediction_separate, args.note)
    (args.out_dir / "summary.md").write_text(text)
    print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
