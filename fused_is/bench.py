"""`fused-is bench`: forward+backward of the policy loss for every provider available here.

Providers: the eager reference at the input dtype (upcast, log_softmax, gather, autograd: the way
trainers write it), torch.compile of that reference, our backends (each with inplace=False and True)
and, where installed, Liger-Kernel's logits-path GRPO loss (`liger`: triton_grpo_loss set to ppo_tis, see
LIGER_NOTES; CUDA, or the Triton interpreter on the CPU). For each size and dtype: median time with spread
(CUDA events on GPU, perf_counter on CPU; warm-up excluded), peak memory added over the inputs (CUDA
max_memory_allocated; on CPU the peak RSS of a subprocess per measurement), relative error of loss
and gradient against the float64 reference (on the first rows of the same inputs), and GB/s of one
read plus one write of the logits next to the device copy bandwidth measured in the same run.

On GPU, time_* is the full call as a user sees it: CUDA events around forward+backward, so the host's
share (argument checks, launches, the metrics' sync) is included; kernel_time_s is the GPU's busy time
per call (kernel, copy and memset durations summed from the torch profiler), without the host's share, and
host_time_s the difference (the host's exposed share). Every record has host_reads and aten_ops: one call's
host reads of tensor values (a sync each on CUDA) and aten ops, counted at the dispatcher.
The copy bandwidth is a record of its own (kind "bandwidth"), taken before the first measurement of
each size. --jsonl appends every record to a file as soon as it is taken, and SIGTERM or Ctrl-C stops
the run and still writes the summary of what was measured (bench/gpu_suite.sh relies on both).
"""

from __future__ import annotations

import argparse
import csv
import datetime
import functools
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Dict, List, Optional

import torch

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
CONFIG = "ppo_tis"  # the default preset; token-local, so every backend takes its one-pass path
ERROR_ROWS = 32  # rows of the float64 error check (the full problem in float64 would dwarf the timing)


# ----------------------------------------------------------------------------------------------------
# providers


def providers_here(device: str, triton_interpreter: bool = False) -> Dict[str, Optional[str]]:
    """provider -> None when it can run on `device`, else the reason it cannot. `triton_interpreter`
    lets Triton run on the CPU under TRITON_INTERPRET=1 (the GPU suite's dry run: plumbing, not timing)."""
    from . import backends

    probe = torch.empty(1, 2, device=device)
    out: Dict[str, Optional[str]] = {"eager": None, "compile": None}
    for name in ("torch", "cpu", "triton", "cuda"):
        reason = backends.unavailable_reason(name, probe)
        if name == "triton" and device == "cpu" and reason is None and not triton_interpreter:
            reason = "Triton on the CPU is the interpreter (a correctness tool, not a kernel to time)"
        out[name] = reason
        out[name + "_inplace"] = reason
    out["liger"] = liger_unavailable_reason(device, triton_interpreter)
    return out


def liger_unavailable_reason(device: str, triton_interpreter: bool = False) -> Optional[str]:
    """None when Liger-Kernel's triton_grpo_loss can run on `device`, else why not. Its kernels are Triton
    kernels launched on the logits' device: CUDA, or the CPU under the interpreter (TRITON_INTERPRET=1, set before
    liger_kernel is imported, and `triton_interpreter`). The device is checked before the import, so that a CPU
    run never imports Liger's kernels compiled for a GPU it does not have."""
    import importlib.util

    if importlib.util.find_spec("liger_kernel") is None:
        return "liger-kernel is not installed (pip install liger-kernel==0.8.5, the bench extra)"
    if device != "cuda":
        if not triton_interpreter:
            return "Liger's GRPO loss is a Triton kernel: on the CPU only under the interpreter (--triton-interpreter)"
        if os.environ.get("TRITON_INTERPRET") != "1":
            return "Liger's GRPO loss on the CPU needs TRITON_INTERPRET=1 (set before liger_kernel is imported)"
    try:
        from liger_kernel.transformers.grpo_loss import triton_grpo_loss  # noqa: F401
    except Exception as exc:  # ImportError, or its Triton kernels failing to load on this machine
        return f"liger-kernel's triton_grpo_loss does not import: {type(exc).__name__}: {exc}"
    return None


def make_problem(n: int, vocab: int, dtype: torch.dtype, device: str, seed: int = 0, seq_len: int = 0) -> dict:
    """The inputs of one measurement; logits are filled row block by row block so that building them never holds
    more than the logits themselves (the CPU memory baseline stays honest).
    seq_len 0: packed [N, V] logits and per-token inputs. seq_len L > 0 (N a multiple of L): the layout a trainer
    has, B = N / L sequences: the model's [B, L + 1, V] output ("buffer", whose last position scores nothing),
    logits its [B, L, V] view (no copy), tokens and logprobs [B, L] and one advantage per sequence [B]."""
    gen = torch.Generator(device=device).manual_seed(seed)
    if seq_len:
        if n % seq_len:
            raise ValueError(f"--seq-len {seq_len} must divide N={n}")
        buffer = torch.empty(n // seq_len, seq_len + 1, vocab, dtype=dtype, device=device)
        rows, shape = buffer.view(-1, vocab), (n // seq_len, seq_len)
    else:
        buffer = rows = torch.empty(n, vocab, dtype=dtype, device=device)
        shape = (n,)
    step = max(1, (1 << 22) // vocab)
    for start in range(0, rows.shape[0], step):
        block = torch.randn(min(step, rows.shape[0] - start), vocab, generator=gen, device=device) * 2.0
        rows[start:start + step] = block.to(dtype)
        del block
    tokens = torch.randint(0, vocab, shape, generator=gen, device=device)
    old = -torch.rand(shape, generator=gen, device=device) * 8.0
    samp = -(old + 0.3 * torch.randn(shape, generator=gen, device=device)).abs()  # logprobs are <= 0
    adv = torch.randn(shape[:1], generator=gen, device=device)
    logits = buffer[:, :-1] if seq_len else buffer
    return dict(logits=logits, buffer=buffer, seq_len=seq_len, tokens=tokens, advantages=adv, sampler_logprobs=samp,
                old_logprobs=old)


def provider_leaf(provider: str, p: dict) -> torch.Tensor:
    """The tensor a provider differentiates: Liger takes the model's [B, L + 1, V] output itself in the sequence
    layout; every other provider the logits ([N, V], or the [B, L, V] view)."""
    return p["buffer"] if provider == "liger" and p["seq_len"] else p["logits"]


def _eager_loss(logits, p):
    from . import policy_loss

    return policy_loss(logits, p["tokens"], p["advantages"], sampler_logprobs=p["sampler_logprobs"],
                       old_logprobs=p["old_logprobs"], config=CONFIG, backend="reference").loss


_COMPILED = {}


def _compiled_loss(logits, p):
    """torch.compile of the reference's math (section 2 for ppo_tis, written as trainers write it)."""
    if "fn" not in _COMPILED:
        cfg = __import__("fused_is").LossConfig.preset(CONFIG)

        def loss_fn(logits, tokens, adv, samp, old):
            logp = torch.log_softmax(logits.float(), dim=-1)
            lp = logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
            adv = adv.reshape(adv.shape + (1,) * (lp.dim() - adv.dim()))  # one per sequence: over its tokens
            ratio = torch.exp(lp - old)
            surrogate = torch.minimum(ratio * adv, torch.clamp(ratio, 1 - cfg.clip_low, 1 + cfg.clip_high) * adv)
            weight = torch.exp(torch.clamp(old - samp, -20, 20)).clamp(max=cfg.is_cap)
            return (-weight * surrogate).mean()

        _COMPILED["fn"] = torch.compile(loss_fn)
    return _COMPILED["fn"](logits, p["tokens"], p["advantages"], p["sampler_logprobs"], p["old_logprobs"])


# Liger-Kernel's logits-path GRPO loss set to ppo_tis (liger_settings() fills in the preset's numbers).
LIGER_NOTES = (
    "liger_kernel.transformers.grpo_loss.triton_grpo_loss (liger-kernel 0.8.5). Liger takes logits [B, L + 1, V] (the "
    "last row of each sequence is dropped) and one advantage per sequence. With --seq-len L (seq_len in the record) "
    "the problem is that layout: Liger differentiates the [B, L + 1, V] buffer itself and every other provider its "
    "[B, L, V] view, no copy anywhere. Without it (seq_len 0) the problem's advantages are per token, "
    "so every token is a sequence of its own: B = N, L = 1, the [N, V] logits copied into an [N, 2, V] buffer with "
    "one zero row per token, inside the timed call (that copy, the zero rows' memset in Liger's backward and the "
    "gradient's copy out of the buffer are in liger's time and memory; a trainer feeding Liger per-sequence "
    "advantages and its [B, L + 1, V] model output pays none of them). inplace=True writes the gradient into that "
    "buffer (ours), never into the caller's logits. Exact ppo_tis: old_logp = old_logprobs (the PPO ratio's base), "
    "eps_low/eps_high = clip_low/clip_high, vllm_is_ratio = min(exp(clamp(old - sampler, -20, 20)), is_cap) formed "
    "per token in torch inside the timed call (Liger multiplies the clipped surrogate and its gradient by it, as "
    "the TIS weight does), beta = 0 (no KL, ref_logp None), temperature = 1, delta None, completion_mask None (all "
    "ones), loss_type='bnpo' (sum over tokens / their count: the token mean, whatever B and L)")


@functools.lru_cache(maxsize=None)
def _liger_config():
    """The preset, checked to be what the liger provider writes out."""
    cfg = __import__("fused_is").LossConfig.preset(CONFIG)
    expected = dict(policy="ppo", ratio_ref="old", ratio_level="token", dual_clip=None, log_ratio_clamp=None,
                    is_level="token", is_mode="truncate", is_floor=None, entropy_coef=0.0, kl_coef=0.0,
                    loss_agg="token-mean", rejection=(), off_policy_mask=None)
    wrong = {k: getattr(cfg, k) for k, v in expected.items() if getattr(cfg, k) != v}
    if wrong:
        raise RuntimeError(f"the liger provider writes {CONFIG} out as {expected}; the preset now has {wrong}")
    return cfg


def liger_settings() -> dict:
    """The keyword arguments of triton_grpo_loss that write ppo_tis out, besides the tensors (vllm_is_ratio, the
    truncated IS weight, is formed from the preset's is_cap in _liger_loss)."""
    cfg = _liger_config()
    return dict(temperature=cfg.temperature, beta=0.0, eps_low=cfg.clip_low, eps_high=cfg.clip_high, inplace=True,
                loss_type="bnpo", importance_sampling_level="token", reduce=True, delta=None,
                use_bias_correction_kl=False)


def _liger_loss(logits, p):
    """Liger-Kernel's triton_grpo_loss on the packed problem, as LIGER_NOTES says."""
    from liger_kernel.transformers.grpo_loss import triton_grpo_loss

    from .config import LOG_WEIGHT_CLAMP

    if p["seq_len"]:  # logits is the [B, L + 1, V] buffer: Liger's own layout
        staged, shape = logits, p["tokens"].shape
    else:
        staged = torch.nn.functional.pad(logits.unsqueeze(1), (0, 0, 0, 1))  # [N, 2, V]: row 1 is Liger's dropped row
        shape = (logits.shape[0], 1)
    log_w = torch.clamp(p["old_logprobs"] - p["sampler_logprobs"], -LOG_WEIGHT_CLAMP, LOG_WEIGHT_CLAMP)
    weight = torch.exp(log_w).clamp(max=_liger_config().is_cap)
    loss, _metrics = triton_grpo_loss(staged, p["old_logprobs"].reshape(shape).contiguous(), None,
                                      p["tokens"].reshape(shape).contiguous(), p["advantages"].contiguous(), None,
                                      vllm_is_ratio=weight.reshape(shape).contiguous(), **liger_settings())
    return loss


def provider_loss(provider: str, logits: torch.Tensor, p: dict) -> torch.Tensor:
    """The loss of one provider, differentiable w.r.t. logits (inplace providers overwrite logits)."""
    from . import policy_loss

    if provider == "eager":
        return _eager_loss(logits, p)
    if provider == "compile":
        return _compiled_loss(logits, p)
    if provider == "liger":
        return _liger_loss(logits, p)
    backend, _, inplace = provider.partition("_")
    return policy_loss(logits, p["tokens"], p["advantages"], sampler_logprobs=p["sampler_logprobs"],
                       old_logprobs=p["old_logprobs"], config=CONFIG, backend=backend, inplace=bool(inplace)).loss


def run_step(provider: str, logits: torch.Tensor, p: dict) -> None:
    """One forward+backward; the gradient lands in logits.grad (freed by the caller)."""
    provider_loss(provider, logits, p).backward()


def provider_errors(provider: str, p: dict) -> Dict[str, float]:
    """Relative error of loss and gradient against the float64 reference on the same (small) inputs."""
    from .testing import rel_err

    base = provider_leaf(provider, p)
    leaf = base.detach().clone().requires_grad_()
    work = leaf.clone() if provider.endswith("_inplace") else leaf  # never overwrite the leaf under test
    loss = provider_loss(provider, work, p)
    loss.backward()
    ref_logits = p["logits"].double().requires_grad_()
    ref = _eager_loss(ref_logits, p)
    ref.backward()
    grad = leaf.grad[:, :-1] if base is not p["logits"] else leaf.grad  # Liger's buffer: its [B, L, V] part
    return dict(loss_err=rel_err(loss, ref), grad_err=rel_err(grad, ref_logits.grad))


# ----------------------------------------------------------------------------------------------------
# measurement


def _rss_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def _reset_peak_rss() -> None:
    with open("/proc/self/clear_refs", "w") as f:  # "5" resets VmHWM to the current RSS (Linux >= 4.0)
        f.write("5")


def device_busy_seconds(step, calls: int) -> float:
    """GPU busy time per call of `step`: kernel, copy and memset durations summed from the torch profiler's
    device events (one stream, so nothing overlaps), i.e. the call without the host's share."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            step()
        torch.cuda.synchronize()
    busy_us = sum(e.time_range.elapsed_us() for e in prof.events() if e.device_type == DeviceType.CUDA)
    if busy_us <= 0:
        raise RuntimeError("the profiler recorded no device activity")
    return busy_us / calls / 1e6


def time_steps(run, clear, device: str, reps: int, warmup: int):
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


def measure(provider: str, n: int, vocab: int, dtype: str, device: str, reps: int, warmup: int,
            seq_len: int = 0) -> dict:
    """Time, peak memory and error of one provider at one size (and layout: make_problem's seq_len), in this
    process."""
    p = make_problem(n, vocab, DTYPES[dtype], device, seq_len=seq_len)
    logits = provider_leaf(provider, p).requires_grad_()
    record = dict(kind="provider", provider=provider, n=n, vocab=vocab, dtype=dtype, device=device, seq_len=seq_len,
                  logits_bytes=p["logits"].numel() * p["logits"].element_size())

    def clear():
        logits.grad = None

    def step():
        run_step(provider, logits, p)
        clear()

    times, peak = time_steps(lambda: run_step(provider, logits, p), clear, device, reps, warmup)
    if device == "cuda":
        try:
            kernel = device_busy_seconds(step, min(reps, 3))
            record.update(kernel_time_s=kernel, kernel_gbps=2 * record["logits_bytes"] / kernel / 1e9)
        except Exception as exc:  # the full-call time above stands on its own
            record["kernel_time_error"] = f"{type(exc).__name__}: {exc}"
    record.update(
        time_median_s=statistics.median(times), time_min_s=times[0], time_max_s=times[-1], reps=reps,
        peak_added_bytes=max(0, peak), peak_added_x_logits=max(0, peak) / record["logits_bytes"],
        gbps=2 * record["logits_bytes"] / statistics.median(times) / 1e9,
    )
    if "kernel_time_s" in record:  # the host's exposed share of the call: checks, small ops, syncs, launches
        record["host_time_s"] = max(0.0, record["time_median_s"] - record["kernel_time_s"])
    record.update(host_work(step))
    del p, logits
    err_len = min(seq_len, ERROR_ROWS)
    err_n = err_len * max(1, ERROR_ROWS // err_len) if seq_len else min(n, ERROR_ROWS)
    record.update(provider_errors(provider, make_problem(err_n, vocab, DTYPES[dtype], device, seed=1,
                                                         seq_len=err_len)))
    return record


def host_work(step) -> dict:
    """What one call of `step` asks of the host, counted at the dispatcher (fused_is.testing.HostReads):
    host_reads (aten ops that read a tensor value on the host, Tensor.tolist included: a sync each on CUDA) and
    aten_ops (every op run, forward and backward: the small tensor ops whose launches the host pays for)."""
    from .testing import HostReads

    try:
        with HostReads() as reads:
            step()
    except Exception as exc:  # e.g. a compiled graph that will not run under a dispatch mode
        return dict(host_count_error=f"{type(exc).__name__}: {exc}"[:200])
    return dict(host_reads=len(reads.ops), aten_ops=reads.dispatched)


def _with_copy_fractions(record: dict, bandwidth: dict) -> dict:
    """record with the copy bandwidth measured at its size (`bandwidth`: a copy_bandwidth record) and its GB/s
    (end to end, and kernel-only where measured) as fractions of it."""
    record["copy_gbps"] = bandwidth["gbps"]
    for key in ("gbps", "kernel_gbps"):
        if key in record:
            record[key.replace("gbps", "copy_frac")] = record[key] / record["copy_gbps"]
    return record


def copy_bandwidth(n: int, vocab: int, dtype: str, device: str, reps: int = 5) -> dict:
    """Record of dst.copy_(src) for a logits-sized tensor: GB/s of bytes read + bytes written (CUDA events
    around the copy alone on GPU, so it compares with kernel_gbps; perf_counter on CPU)."""
    src = torch.empty(n, vocab, dtype=DTYPES[dtype], device=device).fill_(1.0)
    dst = torch.empty_like(src)
    times = []
    for i in range(reps + 1):  # the first copy is a warm-up
        if device == "cuda":
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src)
            stop.record()
            torch.cuda.synchronize()
            elapsed = start.elapsed_time(stop) / 1e3
        else:
            t0 = time.perf_counter()
            dst.copy_(src)
            elapsed = time.perf_counter() - t0
        if i:
            times.append(elapsed)
    moved = 2 * src.numel() * src.element_size()
    return dict(kind="bandwidth", n=n, vocab=vocab, dtype=dtype, device=device, bytes_moved=moved,
                time_median_s=statistics.median(times), reps=reps, gbps=moved / statistics.median(times) / 1e9)


def measure_in_subprocess(provider, n, vocab, dtype, reps, warmup, seq_len: int = 0) -> dict:
    """CPU memory is only measurable per process: each provider and size runs in a fresh interpreter."""
    return worker_record("fused_is.bench", [provider, n, vocab, dtype, reps, warmup, seq_len],
                         dict(kind="provider", provider=provider, n=n, vocab=vocab, dtype=dtype, seq_len=seq_len))


def worker_record(module: str, args: list, failure: dict) -> dict:
    """The record `python -m <module> _worker <args>` prints last, measured in a fresh interpreter; on failure,
    `failure` with the error's last line."""
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
# reporting


def machine_name(device: str) -> str:
    if device == "cuda":
        name = torch.cuda.get_device_name().lower()
        for known in ("h200", "h100", "a100", "l40", "4090"):
            if known in name:
                return known
        return "".join(c if c.isalnum() else "-" for c in name)
    return "cpu"


def _version(dist: str) -> Optional[str]:
    import importlib.metadata

    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def environment(device: str) -> dict:
    def git_rev():
        try:
            return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                  cwd=Path(__file__).resolve().parent.parent).stdout.strip() or None
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
        env["gpu"] = torch.cuda.get_device_name()
        env["cuda"] = torch.version.cuda
    return env


COLUMNS = [("provider", "{}"), ("n", "{}"), ("vocab", "{}"), ("dtype", "{}"), ("seq_len", "{}"), ("time_median_s", "{:.4f}"),
           ("spread", "{}"), ("kernel_time_s", "{:.4f}"), ("peak_added_x_logits", "{:.2f}"), ("gbps", "{:.1f}"),
           ("copy_frac", "{:.2f}"), ("kernel_copy_frac", "{:.2f}"), ("host_time_s", "{:.4f}"),
           ("host_reads", "{}"), ("aten_ops", "{}"), ("speedup_vs_eager", "{:.2f}"), ("loss_err", "{:.1e}"),
           ("grad_err", "{:.1e}")]


def format_table(records: List[dict]) -> str:
    # the kernel-only and host-time columns exist on GPU only: left out where no record has them
    columns = [(name, fmt) for name, fmt in COLUMNS
               if not name.startswith(("kernel_", "host_time")) or any(r.get(name) is not None for r in records)]
    if not any(r.get("seq_len") for r in records):  # the packed layout: no column for it
        columns = [c for c in columns if c[0] != "seq_len"]
    rows = [[name for name, _ in columns]]
    for r in records:
        if "error" in r:
            rows.append([r["provider"], str(r["n"]), str(r["vocab"]), r["dtype"], "failed: " + r["error"][:60]]
                        + [""] * (len(columns) - 5))
            continue
        r = dict(r, spread=f"{r['time_min_s']:.4f}-{r['time_max_s']:.4f}")
        rows.append([fmt.format(r[name]) if r.get(name) is not None else "-" for name, fmt in columns])
    widths = [max(len(row[i]) for row in rows) for i in range(len(columns))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)) for row in rows)


def write_outputs(records: List[dict], env: dict, out_dir: Path, plot: bool, bandwidth: List[dict] = ()) -> List[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / "bench.json", out_dir / "bench.csv"]
    paths[0].write_text(json.dumps(dict(environment=env, config=CONFIG, bandwidth=list(bandwidth), results=records),
                                   indent=2))
    keys = sorted({k for r in records for k in r})
    with paths[1].open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=keys + [f"env_{k}" for k in env])
        writer.writeheader()
        for r in records:
            writer.writerow({**r, **{f"env_{k}": v for k, v in env.items()}})
    if plot:
        try:
            paths.append(_plot(records, env, out_dir / "bench.png"))
        except ImportError as exc:
            print(f"(no plot: {exc})")
    return paths


def _plot(records, env, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in records if "error" not in r]
    sizes = sorted({(r["n"], r["vocab"], r["dtype"]) for r in ok})
    providers = sorted({r["provider"] for r in ok}, key=lambda p: (p != "eager", p))
    fig, axes = plt.subplots(1, 2, figsize=(max(8, 2.2 * len(sizes) + 4), 4.5))
    width = 0.8 / max(1, len(providers))
    for i, prov in enumerate(providers):
        for ax, key, scale in ((axes[0], "time_median_s", 1e3), (axes[1], "peak_added_x_logits", 1)):
            xs, ys = [], []
            for j, size in enumerate(sizes):
                match = [r for r in ok if r["provider"] == prov and (r["n"], r["vocab"], r["dtype"]) == size]
                if match:
                    xs.append(j + i * width)
                    ys.append(match[0][key] * scale)
            ax.bar(xs, ys, width, label=prov)
    labels = [f"{n}x{v}\n{d}" for n, v, d in sizes]
    for ax, title in ((axes[0], "forward+backward time (ms, median)"), (axes[1], "peak memory added / logits size")):
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(sizes))])
        ax.set_xticklabels(labels, fontsize=8)
        ax.set_title(title, fontsize=10)
    axes[0].set_yscale("log")
    axes[1].legend(fontsize=8)
    fig.suptitle(f"fused_is policy loss ({CONFIG}) on {env.get('gpu', env['machine'])}, torch {env['torch']}",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ----------------------------------------------------------------------------------------------------
# command line


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", default=None,
                        help="small sizes, few repetitions (the default on CPU; under two minutes)")
    parser.add_argument("--full", dest="quick", action="store_false", help="the full grid (default on GPU)")
    parser.add_argument("--n", type=int, nargs="+", help="token counts N")
    parser.add_argument("--vocab", type=int, nargs="+", help="vocabulary sizes V (default 32000 151936; --linear: "
                        "one, default 32000 on CPU, 151936 on GPU)")
    parser.add_argument("--dtypes", nargs="+", default=["bf16", "fp32"], choices=sorted(DTYPES))
    parser.add_argument("--providers", nargs="+", help="subset of providers, measured in this order at each size "
                        "(default: all available; compile always goes last)")
    parser.add_argument("--reps", type=int, help="timed repetitions per measurement")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--seq-len", type=int, default=0, metavar="L",
                        help="the trainer's layout: N / L sequences of L tokens, the model's [B, L + 1, V] output with "
                        "one advantage per sequence (Liger's own layout: no copy for any provider); default 0, packed "
                        "[N, V] with per-token advantages")
    parser.add_argument("--out", type=Path, help="output folder (default bench/results/<machine>)")
    parser.add_argument("--no-plot", action="store_true")
    parser.add_argument("--jsonl", type=Path, help="append one JSON line per record (bandwidth, measurement) to "
                        "this file as soon as it is taken")
    parser.add_argument("--in-process", action="store_true",
                        help="on CPU, measure in this process (fast; peak memory then less exact) instead of one "
                        "subprocess per measurement")
    parser.add_argument("--linear", action="store_true",
                        help="the fused-linear benchmark (fused_is/bench_linear.py): hidden states and the lm_head weight "
                        "against eager, Liger's fused linear GRPO loss and TRL's chunked lm-head")
    parser.add_argument("--comms", action="store_true", help="bytes and collectives per distributed call on gloo "
                        "(fused_is/bench_comms.py; --n one N, --vocab V_local, --world the group sizes)")
    parser.add_argument("--world", type=int, nargs="+", help="--comms: process-group sizes (default 2 4)")
    parser.add_argument("--hidden-dim", type=int, help="--linear: the hidden size D (default 1024 on CPU, 4096 on GPU)")
    parser.add_argument("--triton-interpreter", action="store_true",
                        help="allow Triton on the CPU under TRITON_INTERPRET=1 (plumbing checks; the time means nothing)")
    parser.add_argument("--triton-configs", nargs="+", metavar="BLOCKxWARPS",
                        help="time the Triton providers (default triton_inplace) once per launch configuration of "
                        "the row kernels, e.g. 4096x8 2048x4 (BLOCK cap x num_warps, set through "
                        "$FUSED_IS_TRITON_BLOCK and $FUSED_IS_TRITON_WARPS); records of kind triton_config")


def _run_linear(args: argparse.Namespace, device: str) -> int:
    from . import bench_linear

    default = bench_linear.default_linear_sizes(device)
    if args.vocab and len(args.vocab) != 1:
        raise SystemExit("--linear takes one --vocab")
    # one dtype per run (its outputs are linear.jsonl/.md/.png): the first of --dtypes when given, else bf16
    dtype = args.dtypes[0] if args.dtypes != ["bf16", "fp32"] else "bf16"
    return bench_linear.run_linear(argparse.Namespace(
        sizes=args.n or default["sizes"], hidden_dim=args.hidden_dim or default["hidden_dim"],
        vocab=args.vocab[0] if args.vocab else default["vocab"], dtype=dtype, device=device,
        reps=args.reps or (3 if device == "cpu" else 10), warmup=args.warmup,
        out=args.out or Path("bench/results") / environment(device)["machine"], providers=args.providers,
        in_process=args.in_process, no_plot=args.no_plot))


class Interrupted(BaseException):
    """SIGTERM (a timeout) or Ctrl-C during the measurements: stop, then report what was measured."""


def _raise_interrupted(signum, frame):
    raise Interrupted(f"signal {signum}")


class Measurements:
    """The measuring loop shared by fused-is bench, its launch-config sweep and --linear: `add` keeps a record and
    appends it to the JSON-lines file at once (`emit` writes one without keeping it), so a timeout keeps what ran;
    SIGTERM (in the main thread) and Ctrl-C end the `with` block early, `interrupted` says why, and the caller
    reports the records it has.

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


def _one(provider, n, vocab, dtype, device, reps, args) -> dict:
    seq_len = getattr(args, "seq_len", None) or 0
    if device == "cpu" and not args.in_process:
        return measure_in_subprocess(provider, n, vocab, dtype, reps, args.warmup, seq_len)
    try:
        return measure(provider, n, vocab, dtype, device, reps, args.warmup, seq_len)
    except Exception as exc:  # one failing provider must not hide the others' numbers
        return dict(kind="provider", provider=provider, n=n, vocab=vocab, dtype=dtype, seq_len=seq_len,
                    error=f"{type(exc).__name__}: {exc}")
    finally:
        if device == "cuda":
            torch.cuda.empty_cache()


def run(args: argparse.Namespace) -> int:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.linear:
        return _run_linear(args, device)
    if args.comms:
        from . import bench_comms

        return bench_comms.run_from_bench(args)
    if args.triton_configs:
        return run_triton_configs(args, device)
    args.vocab = args.vocab or [32000, 151936]
    quick = args.quick if args.quick is not None else device == "cpu"
    sizes_n = args.n or ([256] if quick and device == "cpu" else [1024] if device == "cpu" else
                         [1024, 4096] if quick else [1024, 4096, 16384])
    reps = args.reps or (3 if quick else 10)
    available = providers_here(device, triton_interpreter=args.triton_interpreter)
    if quick and device == "cpu":
        available["compile"] = "skipped in --quick on CPU (inductor's C++ compile takes minutes); run --full"
    chosen = args.providers or list(available)
    env = environment(device)
    out_dir = args.out or Path("bench/results") / env["machine"]
    grid = [(p, n, v, d) for d in args.dtypes for v in args.vocab for n in sizes_n for p in chosen
            if available.get(p, "unknown provider") is None]
    # torch.compile compiles each new shape on first use (tens of seconds): last, so a timeout costs only its numbers
    grid.sort(key=lambda case: case[0] == "compile")
    for p in chosen:
        if available.get(p, "unknown provider") is not None:
            print(f"skip {p}: {available.get(p, 'unknown provider')}")
    bandwidth = {}
    try:
        from tqdm import tqdm

        progress = tqdm(grid, desc="bench", unit="case", file=sys.stderr)
    except ImportError:
        progress = grid
    with Measurements(args.jsonl, len(grid)) as m:
        for provider, n, vocab, dtype in progress:
            if (n, vocab, dtype) not in bandwidth:
                bandwidth[(n, vocab, dtype)] = copy_bandwidth(n, vocab, dtype, device)
                m.emit(bandwidth[(n, vocab, dtype)])
            if hasattr(progress, "set_postfix_str"):
                progress.set_postfix_str(f"{provider} {n}x{vocab} {dtype}")
            m.add(_with_copy_fractions(_one(provider, n, vocab, dtype, device, reps, args),
                                       bandwidth[(n, vocab, dtype)]))
    records, interrupted = m.records, m.interrupted
    for r in records:
        eager = [e for e in records if e["provider"] == "eager" and (e["n"], e["vocab"], e["dtype"]) ==
                 (r["n"], r["vocab"], r["dtype"]) and "error" not in e]
        if eager and "error" not in r:
            r["speedup_vs_eager"] = eager[0]["time_median_s"] / r["time_median_s"]
    copies = ", ".join(f"{n}x{v} {d}: {b['gbps']:.1f} GB/s" for (n, v, d), b in bandwidth.items())
    print(f"\nfused_is bench on {env.get('gpu', env['machine'])} ({device}), torch {env['torch']}, config {CONFIG}; "
          f"copy bandwidth {copies}")
    print(format_table(records))
    timing = ("CUDA events around the full call (host share included); kernel_time_s: GPU busy time per call "
              "(torch profiler)" if device == "cuda" else "perf_counter around the full call")
    paths = write_outputs(records, {**env, "reps": reps, "quick": quick, "timing": timing, "interrupted": interrupted,
                                    "providers_skipped": {k: v for k, v in available.items() if v is not None},
                                    **({"liger_settings": dict(liger_settings(), is_cap=_liger_config().is_cap),
                                        "liger_notes": LIGER_NOTES, "liger_kernel": _version("liger-kernel")}
                                       if any(case[0] == "liger" for case in grid) else {})},
                          out_dir, not args.no_plot, bandwidth.values())
    print("wrote " + ", ".join(str(p) for p in paths))
    return 1 if interrupted or any("error" in r for r in records) else 0


# ----------------------------------------------------------------------------------------------------
# Triton launch configurations (issue #18): which (BLOCK, num_warps) of the row kernels is fastest


def parse_triton_config(text: str) -> tuple:
    """'4096x8' -> (4096, 8), validated as the launcher validates $FUSED_IS_TRITON_BLOCK and _WARPS."""
    from .backends import triton as launcher

    block, sep, warps = (part.strip() for part in text.lower().partition("x"))
    if not (block and sep and warps):
        raise SystemExit(f"--triton-configs {text!r}: expected BLOCKxWARPS, e.g. 4096x8")
    with triton_config_env(block, warps):
        try:
            return launcher.block_override(), launcher.num_warps()
        except ValueError as exc:
            raise SystemExit(f"--triton-configs {text}: {exc}") from None


class triton_config_env:
    """Sets $FUSED_IS_TRITON_BLOCK and $FUSED_IS_TRITON_WARPS for the block (the launcher reads them at each
    launch; a subprocess inherits them) and restores what was there before."""

    def __init__(self, block, warps):
        from .backends import triton as launcher

        self.values = {launcher.BLOCK_ENV: str(block), launcher.WARPS_ENV: str(warps)}

    def __enter__(self):
        self.saved = {k: os.environ.get(k) for k in self.values}
        os.environ.update(self.values)
        return self

    def __exit__(self, *exc):
        for k, v in self.saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        return False


CONFIG_COLUMNS = [("triton_config", "{}"), ("block_launched", "{}"), ("provider", "{}"), ("n", "{}"), ("vocab", "{}"),
                  ("dtype", "{}"), ("time_median_s", "{:.5f}"), ("spread", "{}"), ("kernel_time_s", "{:.5f}"),
                  ("gbps", "{:.1f}"), ("copy_frac", "{:.3f}"), ("kernel_copy_frac", "{:.3f}"),
                  ("speedup_vs_default", "{:.3f}"), ("registers", "{}"), ("spills", "{}"), ("grad_err", "{:.1e}")]


def format_config_table(records: List[dict]) -> str:
    columns = [(name, fmt) for name, fmt in CONFIG_COLUMNS
               if name in ("triton_config", "provider") or any(r.get(name) is not None for r in records)]
    rows = [[name for name, _ in columns]]
    for r in records:
        if "error" in r:
            rows.append([r["triton_config"], "-", r["provider"], "failed: " + r["error"][:80]])
            continue
        r = dict(r, spread=f"{r['time_min_s']:.5f}-{r['time_max_s']:.5f}")
        rows.append([fmt.format(r[name]) if r.get(name) is not None else "-" for name, fmt in columns])
    widths = [max(len(row[i]) for row in rows if i < len(row)) for i in range(len(columns))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)) for row in rows)


def _config_record(provider, n, vocab, dtype, device, reps, args, block, warps) -> dict:
    """One measurement (the same `_one` as the main grid) under one launch configuration, tagged with it."""
    import triton

    from .backends import triton as launcher

    launcher.LAST_LAUNCH.clear()
    with triton_config_env(block, warps):
        record = _one(provider, n, vocab, dtype, device, reps, args)
    launched = launcher.LAST_LAUNCH.get("_fused_kernel", {})  # in this process only (GPU: the compiled kernel's)
    return dict(record, kind="triton_config", triton_config=f"{block}x{warps}", triton_block=block, triton_warps=warps,
                block_launched=min(block, triton.next_power_of_2(vocab)), registers=launched.get("registers"),
                spills=launched.get("spills"))


def run_triton_configs(args: argparse.Namespace, device: str) -> int:
    """--triton-configs: each provider (triton_inplace unless --providers) at each size, once per launch
    configuration; records of kind "triton_config" appended to --jsonl as they are taken (a copy bandwidth record
    of kind "bandwidth" first per size), a table, and <out>/triton_configs.json."""
    from .backends import triton as launcher

    configs = [parse_triton_config(c) for c in args.triton_configs]
    providers = args.providers or ["triton_inplace"]
    if set(providers) - {"triton", "triton_inplace"}:
        raise SystemExit(f"--triton-configs times the Triton providers (triton, triton_inplace), not "
                         f"{sorted(set(providers) - {'triton', 'triton_inplace'})}")
    reason = providers_here(device, triton_interpreter=args.triton_interpreter)["triton"]
    if reason is not None:
        print(f"skip --triton-configs: {reason}")
        return 1
    sizes_n = args.n or ([16384] if device == "cuda" else [64])
    vocabs = args.vocab or ([151936] if device == "cuda" else [9000])
    dtypes = args.dtypes if args.dtypes != ["bf16", "fp32"] else ["bf16"]  # argparse's default: the headline's
    reps = args.reps or (10 if device == "cuda" else 3)
    env = environment(device)
    out_dir = args.out or Path("bench/results") / env["machine"]
    grid = [(n, v, d, c, p) for d in dtypes for v in vocabs for n in sizes_n for c in configs for p in providers]
    bandwidth = {}
    with Measurements(args.jsonl, len(grid)) as m:
        for n, vocab, dtype, (block, warps), provider in grid:
            if (n, vocab, dtype) not in bandwidth:
                bandwidth[(n, vocab, dtype)] = copy_bandwidth(n, vocab, dtype, device)
                m.emit(bandwidth[(n, vocab, dtype)])
            record = m.add(_with_copy_fractions(
                _config_record(provider, n, vocab, dtype, device, reps, args, block, warps), bandwidth[(n, vocab, dtype)]))
            print(f"{record['triton_config']} {provider} {n}x{vocab} {dtype}: "
                  + (f"failed: {record['error']}" if "error" in record else
                     f"{record['time_median_s'] * 1e3:.3f} ms, {record['gbps']:.1f} GB/s"), flush=True)
    records, interrupted = m.records, m.interrupted
    for r in records:  # against the launcher's default configuration at the same size, where it was measured
        same = ("provider", "n", "vocab", "dtype")
        default = [d for d in records if (d["triton_block"], d["triton_warps"]) == (launcher.BLOCK, launcher.NUM_WARPS)
                   and all(d[k] == r[k] for k in same) and "error" not in d]
        if default and "error" not in r:
            r["speedup_vs_default"] = default[0]["time_median_s"] / r["time_median_s"]
    copies = ", ".join(f"{n}x{v} {d}: {b['gbps']:.1f} GB/s" for (n, v, d), b in bandwidth.items())
    print(f"\nTriton launch configurations (BLOCK x num_warps; default {launcher.BLOCK}x{launcher.NUM_WARPS}) on "
          f"{env.get('gpu', env['machine'])} ({device}), config {CONFIG}; copy bandwidth {copies}")
    print(format_config_table(records))
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "triton_configs.json"
    path.write_text(json.dumps(dict(environment={**env, "reps": reps, "interrupted": interrupted}, config=CONFIG,
                                    bandwidth=list(bandwidth.values()), results=records), indent=2))
    print(f"wrote {path}")
    return 1 if interrupted or any("error" in r for r in records) else 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "_worker":  # one measurement in a fresh process (CPU memory)
        provider, n, vocab, dtype, reps, warmup = argv[1:7]
        seq_len = int(argv[7]) if len(argv) > 7 else 0
        torch.manual_seed(0)
        print(json.dumps(measure(provider, int(n), int(vocab), dtype, "cpu", int(reps), int(warmup), seq_len)))
        return 0
    parser = argparse.ArgumentParser(prog="python -m fused_is.bench", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
