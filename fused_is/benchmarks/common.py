"""What the benchmark drivers share: timing and peak memory of one measurement (in this process or a fresh one),
the measuring loop that keeps what ran on SIGTERM or Ctrl-C, the environment record, tables that fit 100
columns, the bar plot, the default output folder and the argument types. Imports nothing of fused_is.benchmarks.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
ERROR_ROWS = 32  # rows of the float64 error check (the full problem in float64 would dwarf the timing)
# the third-party providers' pins (pyproject's `baselines` extra pins the same; tests/test_bench_cli.py checks)
LIGER_PIN = "liger-kernel==0.8.5"  # `liger` (the logits bench and --linear)
TRL_PIN = "trl==1.16.0"  # `trl_chunked` (--linear)
TRITON_PIN = "triton==3.7.1"  # Triton on the CPU (--triton-interpreter): the test extra's
TABLE_WIDTH = 100  # every table a driver prints fits this many columns (the files keep every field)
# Results of a plain run go here (gitignored); the committed ones (bench/results/cpu, h200) only with --out.
LOCAL_RESULTS = Path("bench/results/local")


def default_out_dir(device: str) -> Path:
    """bench/results/local/<machine> (relative to the working directory): never the committed results."""
    return LOCAL_RESULTS / machine_name(device)


# ----------------------------------------------------------------------------------------------------
# command line


class ArgumentParser(argparse.ArgumentParser):
    """argparse with a one-line error ("prog: error: ... (see --help)", exit 2) instead of the usage block."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    return _int_at_least(text, 1, "a positive integer (1, 2, ...)")


def non_negative_int(text: str) -> int:
    """argparse type: an integer >= 0."""
    return _int_at_least(text, 0, "an integer >= 0")


def vocab_size(text: str) -> int:
    """argparse type: a vocabulary size, an integer >= 2 (one token makes every logprob 0: nothing to check)."""
    return _int_at_least(text, 2, "a vocabulary size, an integer >= 2")


def _int_at_least(text: str, low: int, what: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
    if value < low:
        raise argparse.ArgumentTypeError(f"expected {what}, got {value}")
    return value


def check_choices(option: str, given: Optional[Sequence[str]], valid: Sequence[str]) -> None:
    """SystemExit (one line, exit 1) naming the unknown values of `option` and listing the valid ones."""
    unknown = [g for g in given or () if g not in valid]
    if unknown:
        raise SystemExit(f"fused-is bench: {option}: unknown {', '.join(map(repr, unknown))} "
                         f"(valid: {', '.join(valid)})")


def choose_providers(option: str, requested: Optional[Sequence[str]], valid: Sequence[str],
                     available: Dict[str, Optional[str]], off_device: str,
                     default: Optional[Callable[[str], bool]] = None) -> Tuple[List[str], Dict[str, str]]:
    """(chosen, skipped) of a bench's --providers: the requested ones (each checked against `valid`: SystemExit
    naming an unknown one), or every provider of `available` (those `default` keeps, when given); skipped maps each
    chosen provider that cannot run here to its reason (available's, or off_device for one of another device)."""
    check_choices(option, requested, valid)
    chosen = list(requested) if requested else [p for p in available if default is None or default(p)]
    skipped = {p: available.get(p, off_device) for p in chosen if available.get(p, off_device) is not None}
    return chosen, skipped


# ----------------------------------------------------------------------------------------------------
# one measurement


def _rss_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def _reset_peak_rss() -> None:
    with open("/proc/self/clear_refs", "w") as f:  # "5" resets VmHWM to the current RSS (Linux >= 4.0)
        f.write("5")


def kernel_name(name: str) -> str:
    """A profiler event's kernel name without its return type, anonymous namespaces and parameter list:
    "void ns::(anonymous namespace)::fused_rows_kernel<__nv_bfloat16, true>(__nv_bfloat16 const*, ...)" ->
    "ns::fused_rows_kernel<__nv_bfloat16, true>" (at most 160 characters)."""
    name = name.strip().replace("(anonymous namespace)::", "")
    if name.startswith("void "):
        name = name[5:]
    depth = 0
    for i, c in enumerate(name):
        depth += (c == "<") - (c == ">")
        if c == "(" and depth == 0 and i and name[i - 1] != " ":  # "Memset (Device)" keeps its words
            name = name[:i]
            break
    return name[:160]


def device_kernel_seconds(step: Callable[[], object], calls: int) -> Tuple[float, Dict[str, float]]:
    """(GPU busy time per call of `step`, {kernel: its time per call}): kernel, copy and memset durations from the
    torch profiler's device events (one stream, so nothing overlaps), i.e. the call without the host's share, in
    total and by name (kernel_name), longest first."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            step()
        torch.cuda.synchronize()
    by_name: Dict[str, float] = {}
    for e in prof.events():
        if e.device_type == DeviceType.CUDA:
            name = kernel_name(e.name)
            by_name[name] = by_name.get(name, 0.0) + e.time_range.elapsed_us()
    busy_us = sum(by_name.values())
    if busy_us <= 0:
        raise RuntimeError("the profiler recorded no device activity")
    return busy_us / calls / 1e6, {k: v / calls / 1e6 for k, v in sorted(by_name.items(), key=lambda kv: -kv[1])}


def time_steps(run: Callable[[], object], clear: Callable[[], None], device: str, reps: int, warmup: int):
    """(sorted times in seconds, peak bytes added) of `reps` calls of run() (one forward+backward), after
    `warmup` untimed ones; clear() frees the gradients after each, outside the timed span. CUDA: events around
    run() and max_memory_allocated over the baseline; CPU: perf_counter and the peak RSS over the baseline
    (exact in a fresh process: `worker_record`)."""
    for _ in range(warmup):
        run()
        clear()
    times = []
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        for _ in range(reps):
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run()
            stop.record()
            clear()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(stop) / 1e3)
        peak = torch.cuda.max_memory_allocated() - base
    else:
        base = _rss_bytes("VmRSS")
        _reset_peak_rss()
        for _ in range(reps):
            t0 = time.perf_counter()
            run()
            times.append(time.perf_counter() - t0)
            clear()
        peak = _rss_bytes("VmHWM") - base
    return sorted(times), peak


def worker_record(module: str, args: list, failure: dict) -> dict:
    """The record `python -m <module> _worker <args>` prints last, measured in a fresh interpreter (CPU peak
    memory is only measurable per process); on failure, `failure` with the error's last line."""
    cmd = [sys.executable, "-m", module, "_worker", *(str(a) for a in args)]
    # A fixed mmap threshold makes glibc return every large block to the OS on free, so the peak RSS
    # tracks live tensors rather than heap high-water marks left by earlier, unrelated allocations.
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        lines = (proc.stderr.strip() or proc.stdout.strip()).splitlines()
        return dict(failure, error=lines[-1] if lines else "failed")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ----------------------------------------------------------------------------------------------------
# the measuring loop


class Interrupted(BaseException):
    """SIGTERM (a timeout) or Ctrl-C during the measurements: stop, then report what was measured."""


def _raise_interrupted(signum, frame):
    raise Interrupted(f"signal {signum}")


class Measurements:
    """The measuring loop shared by the drivers: `add` keeps a record and appends it to the JSON-lines file at once
    (`emit` writes one without keeping it), so a timeout keeps what ran; SIGTERM (in the main thread) and Ctrl-C
    end the `with` block early, `interrupted` says why, and the caller reports the records it has.

        with Measurements(path, len(grid)) as m:
            for case in grid:
                m.add(measure(case))
    """

    def __init__(self, jsonl: Optional[Path], total: int, mode: str = "a"):
        self.records: List[dict] = []
        self.interrupted: Optional[str] = None
        self.total = total
        self._stream = jsonl.open(mode) if jsonl else None
        self._previous = None
        self._in_main = threading.current_thread() is threading.main_thread()

    def emit(self, record: dict) -> None:
        if self._stream:
            self._stream.write(json.dumps(record) + "\n")
            self._stream.flush()

    def add(self, record: dict) -> dict:
        self.records.append(record)
        self.emit(record)
        return record

    def __enter__(self) -> "Measurements":
        if self._in_main:
            self._previous = signal.signal(signal.SIGTERM, _raise_interrupted)
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if self._in_main:
            signal.signal(signal.SIGTERM, self._previous)
        if self._stream:
            self._stream.close()
        if exc_type is not None and issubclass(exc_type, (KeyboardInterrupt, Interrupted)):
            self.interrupted = str(exc) or exc_type.__name__
            print(f"\ninterrupted ({self.interrupted}) after {len(self.records)} of {self.total} measurements; "
                  "reporting those")
            return True
        return False


def progress(items: list, desc: str):
    """tqdm over `items` on stderr where installed (the bench extra), else the list itself."""
    try:
        from tqdm import tqdm
    except ImportError:
        return items
    return tqdm(items, desc=desc, unit="case", file=sys.stderr)


# ----------------------------------------------------------------------------------------------------
# environment


def machine_name(device: str) -> str:
    if device == "cuda":
        name = torch.cuda.get_device_name().lower()
        for known in ("h200", "h100", "a100", "l40", "4090"):
            if known in name:
                return known
        return "".join(c if c.isalnum() else "-" for c in name)
    return "cpu"


def package_version(dist: str) -> Optional[str]:
    """The installed version of distribution `dist`, or None."""
    import importlib.metadata

    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def environment(device: str) -> dict:
    """Machine, versions and git revision of a run (STYLE.md: every result file carries them)."""

    def git_rev():
        try:
            return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                  cwd=Path(__file__).resolve().parents[2]).stdout.strip() or None
        except OSError:
            return None

    env = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               machine=machine_name(device), device=device, python=platform.python_version(),
               torch=torch.__version__, platform=platform.platform(), cpu_count=os.cpu_count(), git=git_rev(),
               threads=torch.get_num_threads())
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    if device == "cuda":
        from fused_is.backends import triton as launcher

        env["gpu"] = torch.cuda.get_device_name()
        env["cuda"] = torch.version.cuda
        env["capability"] = ".".join(map(str, torch.cuda.get_device_capability()))
        try:  # the Triton fused kernel's L2 eviction hints as it launches here ($FUSED_IS_TRITON_L2_HINTS included)
            env["triton_l2_hints"] = launcher.l2_hints_on(torch.device(device))
        except ValueError as exc:  # a bad $FUSED_IS_TRITON_L2_HINTS: the launch says so, with the same message
            env["triton_l2_hints"] = str(exc)
    return env


# ----------------------------------------------------------------------------------------------------
# tables


def fmt_ms(seconds: float) -> str:
    """Milliseconds in at most 6 characters: 0.0123, 0.123, 1.23, 12.3, 123, 12345."""
    ms = seconds * 1e3
    if ms >= 100:
        return f"{ms:.0f}"
    if ms >= 10:
        return f"{ms:.1f}"
    if ms >= 1:
        return f"{ms:.2f}"
    return f"{ms:.3f}" if ms >= 0.01 else f"{ms:.4f}"


def fmt_spread(record: dict) -> str:
    """min-max of the timed repetitions, in ms."""
    return f"{fmt_ms(record['time_min_s'])}-{fmt_ms(record['time_max_s'])}"


def fmt_num(x: float) -> str:
    """A non-negative number in at most 6 characters, 3 significant digits down to 0.001."""
    if x >= 100:
        return f"{x:.0f}"
    if x >= 10:
        return f"{x:.1f}"
    return f"{x:.2f}" if x >= 1 else f"{x:.3f}"


def fixed_width(header: List[str], rows: list, width: int = TABLE_WIDTH) -> List[str]:
    """Left-justified columns two spaces apart (one where two would pass `width`). A row is a list of cells; one
    of fewer cells than the header (a failure: its first cells, then the message) runs on, and a string (a
    heading) stands alone, both cut at `width`."""
    full = [row for row in rows if not isinstance(row, str) and len(row) == len(header)]
    widths = [max(len(row[i]) for row in [header] + full) for i in range(len(header))]
    sep = "  " if sum(widths) + 2 * (len(widths) - 1) <= width else " "
    lines = []
    for row in [header] + rows:
        if isinstance(row, str):
            lines.append(row[:width])
        elif len(row) == len(header):
            lines.append(sep.join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
        else:
            lead = sep.join(cell.ljust(w) for cell, w in zip(row[:-1], widths))
            lines.append((lead + sep + row[-1])[:width].rstrip())
    return lines


def wrote(paths: Sequence[Path]) -> str:
    """"wrote <folder>/: a, b, c" (one folder) or the paths, for the last line of a run."""
    folders = {Path(p).parent for p in paths}
    if len(folders) == 1:
        return f"wrote {folders.pop()}/: " + ", ".join(Path(p).name for p in paths)
    return "wrote " + ", ".join(str(p) for p in paths)


# ----------------------------------------------------------------------------------------------------
# the plot


def bar_figure(records: List[dict], title: str, group: Callable[[dict], tuple] = None,
               group_label: Callable[[tuple], str] = None):
    """A matplotlib figure of two panels of bars, one bar per provider in each group of records (a size):
    forward+backward median time (ms, log scale) with min-max spread bars, and peak memory added over the logits'
    size; each panel with its legend and the value on every bar. Records with an error are left out."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    group = group or (lambda r: (r["n"], r["vocab"], r["dtype"]))
    group_label = group_label or (lambda g: f"{g[0]}x{g[1]}\n{g[2]}")
    ok = [r for r in records if "error" not in r]
    groups = sorted({group(r) for r in ok})
    providers = sorted({r["provider"] for r in ok}, key=lambda p: (p != "eager", p))
    fig, axes = plt.subplots(1, 2, figsize=(max(9, 1.2 * len(groups) * max(1, len(providers)) / 2 + 5), 5))
    width = 0.8 / max(1, len(providers))
    panels = ((axes[0], "forward+backward time (ms, median; bars: min-max)", "time_median_s", 1e3, "{:.3g}"),
              (axes[1], "peak memory added / logits size", "peak_added_x_logits", 1.0, "{:.2f}"))
    for ax, panel_title, key, scale, fmt in panels:
        for i, prov in enumerate(providers):
            xs, ys, low, high = [], [], [], []
            for j, g in enumerate(groups):
                match = [r for r in ok if r["provider"] == prov and group(r) == g]
                if match:
                    r = match[0]
                    xs.append(j + i * width)
                    ys.append(r[key] * scale)
                    if key == "time_median_s":
                        low.append(max(0.0, (r["time_median_s"] - r.get("time_min_s", r[key])) * scale))
                        high.append(max(0.0, (r.get("time_max_s", r[key]) - r["time_median_s"]) * scale))
            if not xs:
                continue
            yerr = [low, high] if key == "time_median_s" else None
            ax.bar(xs, ys, width, label=prov, yerr=yerr, capsize=2 if yerr else 0,
                   error_kw=dict(elinewidth=0.8, ecolor="black"))
            tops = [y + h for y, h in zip(ys, high)] if yerr else ys
            for x, y, top in zip(xs, ys, tops):  # the value above its bar and spread bar
                ax.annotate(fmt.format(y), (x, top), xytext=(0, 2), textcoords="offset points", ha="center",
                            va="bottom", rotation=90, fontsize=6)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(groups))])
        ax.set_xticklabels([group_label(g) for g in groups], fontsize=8)
        ax.set_title(panel_title, fontsize=10)
        ax.margins(y=0.25)
        if providers:
            ax.legend(fontsize=7, loc="best")
    axes[0].set_yscale("log")
    axes[1].set_ylim(bottom=0)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig


def bar_plot(records: List[dict], title: str, path: Path, **kwargs) -> Path:
    """bar_figure saved as a PNG at `path`."""
    import matplotlib.pyplot as plt

    fig = bar_figure(records, title, **kwargs)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def versions(names: Sequence[str]) -> Dict[str, Optional[str]]:
    return {name: package_version(name) for name in names}
