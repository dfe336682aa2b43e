"""`fused-is bench`: forward+backward of the policy loss for every provider available here.

Providers: the eager reference at the input dtype (upcast, log_softmax, gather, autograd: the way
trainers write it), torch.compile of that reference, our backends (each with inplace=False and True)
and, where installed, Liger-Kernel's logits-path GRPO loss (`liger`: triton_grpo_loss set to ppo_tis, see
LIGER_NOTES; CUDA, or the Triton interpreter on the CPU). For each size and dtype: median time with spread
(CUDA events on GPU, perf_counter on CPU; warm-up excluded), peak memory added over the inputs (CUDA
max_memory_allocated; on CPU the peak RSS of a subprocess per measurement), relative error of loss
and gradient against the float64 reference (on the first rows of the same inputs), and GB/s of one
read plus one write of the logits next to the device copy bandwidth measured in the same run.
The one-read probes (`<backend>_token_logprobs`: fused_is.token_logprobs, no gradient) read the logits once; their
GB/s count that one read.

On GPU, time_* is the full call as a user sees it: CUDA events around forward+backward, so the host's
share (argument checks, launches, the metrics' sync) is included; kernel_time_s is the GPU's busy time
per call (kernel, copy and memset durations summed from the torch profiler), without the host's share, and
host_time_s the difference (the host's exposed share); kernels gives each device kernel's time per call by name,
and fused_kernel_time_s the provider's own kernels' alone (OWN_KERNELS: _fused_kernel, fused_rows_kernel,
cluster_rows_kernel, Liger's _grpo_loss_* ...), the time the static model predicts (bench/gpu/gpu_perf_report.py),
without the small torch ops around them. Every record has host_reads and aten_ops: one call's
host reads of tensor values (a sync each on CUDA) and aten ops, counted at the dispatcher.
The copy bandwidth is a record of its own (kind "bandwidth"), taken before the first measurement of
each size. --jsonl appends every record to a file as soon as it is taken, and SIGTERM or Ctrl-C stops
the run and still writes the summary of what was measured (bench/gpu_suite.sh relies on both).

Results go to bench/results/local/<machine>/ (gitignored) unless --out names a folder: the committed
results (bench/results/cpu, bench/results/h200) are written only that way. The printed table fits 100
columns; bench.json and bench.csv keep every field (aten_ops, copy_frac, host_reads, ...).
--linear, --distill and --comms hand the command line over to fused_is.benchmarks.linear, .distill and .comms.
"""

from __future__ import annotations

import argparse
import csv
import functools
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

import torch

import fused_is

from .common import (DTYPES, ERROR_ROWS, LIGER_PIN, ArgumentParser, Measurements, bar_plot, check_choices,
                     default_out_dir, device_kernel_seconds, environment, fixed_width, fmt_ms, fmt_num, fmt_spread,
                     non_negative_int, package_version, positive_int, progress, time_steps, vocab_size,
                     worker_record, wrote)

CONFIG = "ppo_tis"  # the default preset; token-local, so every backend takes its one-pass path
BACKENDS = ("torch", "cpu", "triton", "cuda")
# every provider name --providers takes (those that cannot run here are skipped with the reason)
# each backend with inplace=False, inplace=True ("_inplace": the gradient written over the logits in backward, one more
# read) and inplace="forward" ("_inplace_forward": written during the one forward sweep, the expert mode)
INPLACE_SUFFIXES = {"": False, "_inplace": True, "_inplace_forward": "forward"}
# "_logprobs": the preset written in plain torch over fused_is.logprobs (a user's own loss on fused logprobs)
CLUSTER_ENV = "FUSED_IS_CUDA_CLUSTER"  # read by the CUDA launcher at each launch (csrc/cuda/policy_loss_cuda.cu)
CLUSTER = "cuda_cluster_inplace_forward"  # backend="cuda", inplace="forward", with CLUSTER_ENV=1 (Hopper)
# "_token_logprobs": the one-read probe, fused_is.token_logprobs without a gradient (the first sweep alone)
PROBE = "_token_logprobs"
PROVIDERS = (("eager", "compile") + tuple(f"{b}{s}" for b in BACKENDS for s in INPLACE_SUFFIXES)
             + tuple(f"{b}_logprobs" for b in BACKENDS if b != "cuda") + tuple(b + PROBE for b in BACKENDS)
             + (CLUSTER, "liger"))
HEADLINE = "triton_inplace_forward"  # one read and one write of the logits: what the static model predicts
# the kernels of each provider family by name (a profiler name starting with one of them): fused_kernel_time_s
OWN_KERNELS = {"triton": ("_fused_kernel", "_row_stats_kernel"),
               "cuda": ("fused_rows_kernel", "given_rows_kernel", "cluster_rows_kernel"),
               "liger": ("_grpo_loss_",)}


def own_kernels(provider: str, kernels: Dict[str, float]) -> List[str]:
    """The names in `kernels` (device kernel -> seconds, kernel_name's) that are the provider's own (OWN_KERNELS:
    the name without namespaces and template arguments starts with one; a mangled name contains one)."""
    prefixes = OWN_KERNELS.get(provider.partition("_")[0], ())

    def own(name: str) -> bool:
        if name.startswith("_Z"):  # not demangled
            return any(prefix in name for prefix in prefixes)
        return name.split("<")[0].rsplit("::", 1)[-1].startswith(prefixes)

    return [name for name in kernels if own(name)] if prefixes else []


# ----------------------------------------------------------------------------------------------------
# providers


def providers_here(device: str, triton_interpreter: bool = False) -> Dict[str, Optional[str]]:
    """provider -> None when it can run on `device`, else the reason it cannot. `triton_interpreter`
    lets Triton run on the CPU under TRITON_INTERPRET=1 (the GPU suite's dry run: plumbing, not timing)."""
    from fused_is import backends

    probe = torch.empty(1, 2, device=device)
    out: Dict[str, Optional[str]] = {"eager": None, "compile": None}
    for name in ("torch", "cpu", "triton", "cuda"):
        reason = backends.unavailable_reason(name, probe)
        if name == "triton" and device == "cpu" and reason is None and not triton_interpreter:
            reason = "Triton on the CPU is the interpreter (a correctness tool, not a kernel to time)"
        out[name] = reason
        out[name + "_inplace"] = out[name + "_inplace_forward"] = out[name + "_logprobs"] = reason
        out[name + PROBE] = reason
    out.pop("cuda_logprobs")
    out[CLUSTER] = out["cuda"]
    if out["cuda"] is None and torch.cuda.get_device_capability(probe.device)[0] < 9:
        out[CLUSTER] = "the cluster kernel needs thread-block clusters (compute capability 9.0 or later)"
    out["liger"] = liger_unavailable_reason(device, triton_interpreter)
    return out


def liger_unavailable_reason(device: str, triton_interpreter: bool = False) -> Optional[str]:
    """None when Liger-Kernel's triton_grpo_loss can run on `device`, else why not. Its kernels are Triton
    kernels launched on the logits' device: CUDA, or the CPU under the interpreter (TRITON_INTERPRET=1, set before
    liger_kernel is imported, and `triton_interpreter`). The device is checked before the import, so that a CPU
    run never imports Liger's kernels compiled for a GPU it does not have."""
    import importlib.util

    if device != "cuda":
        if not triton_interpreter:
            return "Liger's GRPO loss is a Triton kernel: on the CPU only under the interpreter (--triton-interpreter)"
        if os.environ.get("TRITON_INTERPRET") != "1":
            return "Liger's GRPO loss on the CPU needs TRITON_INTERPRET=1 (set before liger_kernel is imported)"
    if importlib.util.find_spec("liger_kernel") is None:
        return (f"liger-kernel is not installed (pip install {LIGER_PIN}; scripts/dev.sh bench installs it when "
                "liger is a provider of the run)")
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


def _loss_over_logprobs(logits, p, backend: str):
    """ppo_tis (DESIGN.md section 2) in plain torch over fused_is.logprobs: what a user's own loss costs on top of
    the fused logprobs (O(N) torch around one statistics sweep and one gradient sweep)."""
    import fused_is

    lp, _ = fused_is.logprobs(logits, p["tokens"], backend=backend)
    old, samp, adv = p["old_logprobs"].float(), p["sampler_logprobs"].float(), p["advantages"].float()
    ratio = torch.exp(lp - old)
    weight = torch.exp(old - samp).clamp(max=2.0)
    return (-weight * torch.minimum(ratio * adv, ratio.clamp(0.8, 1.2) * adv)).mean()


def _eager_loss(logits, p):
    from fused_is import policy_loss

    return policy_loss(logits, p["tokens"], p["advantages"], sampler_logprobs=p["sampler_logprobs"],
                       old_logprobs=p["old_logprobs"], config=CONFIG, backend="reference").loss


_COMPILED = {}


def _compiled_loss(logits, p):
    """torch.compile of the reference's math (section 2 for ppo_tis, written as trainers write it)."""
    if "fn" not in _COMPILED:
        cfg = fused_is.LossConfig.preset(CONFIG)

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
    cfg = fused_is.LossConfig.preset(CONFIG)
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

    from fused_is.config import LOG_WEIGHT_CLAMP

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
    from fused_is import policy_loss

    if provider == "eager":
        return _eager_loss(logits, p)
    if provider == "compile":
        return _compiled_loss(logits, p)
    if provider == "liger":
        return _liger_loss(logits, p)
    if provider == CLUSTER:  # the opt-in Hopper kernel (a row across a thread-block cluster), in place in forward
        previous = os.environ.get(CLUSTER_ENV)
        os.environ[CLUSTER_ENV] = "1"
        try:
            return policy_loss(logits, p["tokens"], p["advantages"], sampler_logprobs=p["sampler_logprobs"],
                               old_logprobs=p["old_logprobs"], config=CONFIG, backend="cuda", inplace="forward").loss
        finally:
            if previous is None:
                os.environ.pop(CLUSTER_ENV)
            else:
                os.environ[CLUSTER_ENV] = previous
    backend, _, suffix = provider.partition("_")
    if suffix == "logprobs":
        return _loss_over_logprobs(logits, p, backend)
    inplace = INPLACE_SUFFIXES["_" + suffix if suffix else ""]
    return policy_loss(logits, p["tokens"], p["advantages"], sampler_logprobs=p["sampler_logprobs"],
                       old_logprobs=p["old_logprobs"], config=CONFIG, backend=backend, inplace=inplace).loss


def run_step(provider: str, logits: torch.Tensor, p: dict) -> None:
    """One forward+backward; the gradient lands in logits.grad (freed by the caller). A probe: one
    fused_is.token_logprobs call, no gradient."""
    if provider.endswith(PROBE):
        with torch.no_grad():
            fused_is.token_logprobs(logits, p["tokens"], backend=provider[:-len(PROBE)])
        return
    provider_loss(provider, logits, p).backward()


def _probe_errors(provider: str, p: dict) -> Dict[str, float]:
    """A probe's logprob error against float64 log_softmax (loss_err; it has no gradient: grad_err None)."""
    from fused_is.testing import rel_err

    with torch.no_grad():
        lp, _ = fused_is.token_logprobs(p["logits"], p["tokens"], backend=provider[:-len(PROBE)])
    ref = torch.log_softmax(p["logits"].double(), -1).gather(-1, p["tokens"].unsqueeze(-1)).squeeze(-1)
    return dict(loss_err=rel_err(lp, ref), grad_err=None)


def provider_errors(provider: str, p: dict) -> Dict[str, float]:
    """Relative error of loss and gradient against the float64 reference on the same (small) inputs."""
    from fused_is.testing import rel_err

    if provider.endswith(PROBE):
        return _probe_errors(provider, p)
    base = provider_leaf(provider, p)
    leaf = base.detach().clone().requires_grad_()
    work = leaf.clone() if "_inplace" in provider else leaf  # never overwrite the leaf under test
    loss = provider_loss(provider, work, p)
    loss.backward()
    ref_logits = p["logits"].double().requires_grad_()
    ref = _eager_loss(ref_logits, p)
    ref.backward()
    grad = leaf.grad[:, :-1] if base is not p["logits"] else leaf.grad  # Liger's buffer: its [B, L, V] part
    return dict(loss_err=rel_err(loss, ref), grad_err=rel_err(grad, ref_logits.grad))


# ----------------------------------------------------------------------------------------------------
# measurement


def measure(provider: str, n: int, vocab: int, dtype: str, device: str, reps: int, warmup: int,
            seq_len: int = 0) -> dict:
    """Time, peak memory and error of one provider at one size (and layout: make_problem's seq_len), in this
    process."""
    p = make_problem(n, vocab, DTYPES[dtype], device, seq_len=seq_len)
    probe = provider.endswith(PROBE)
    logits = provider_leaf(provider, p).requires_grad_(not probe)
    record = dict(kind="provider", provider=provider, n=n, vocab=vocab, dtype=dtype, device=device, seq_len=seq_len,
                  logits_bytes=p["logits"].numel() * p["logits"].element_size())
    # the floor's bytes: one read and one write of the logits; a probe's one read
    record["floor_bytes"] = record["logits_bytes"] * (1 if probe else 2)

    def clear():
        logits.grad = None

    def step():
        run_step(provider, logits, p)
        clear()

    times, peak = time_steps(lambda: run_step(provider, logits, p), clear, device, reps, warmup)
    if device == "cuda":
        try:
            kernel, kernels = device_kernel_seconds(step, min(reps, 3))
            record.update(kernel_time_s=kernel, kernel_gbps=record["floor_bytes"] / kernel / 1e9, kernels=kernels)
            own = own_kernels(provider, kernels)
            if own:  # the provider's own kernels by name, without the torch ops around them
                fused = sum(kernels[name] for name in own)
                record.update(fused_kernels=own, fused_kernel_time_s=fused,
                              fused_kernel_gbps=record["floor_bytes"] / fused / 1e9)
        except Exception as exc:  # the full-call time above stands on its own
            record["kernel_time_error"] = f"{type(exc).__name__}: {exc}"
    record.update(
        time_median_s=statistics.median(times), time_min_s=times[0], time_max_s=times[-1], reps=reps,
        peak_added_bytes=max(0, peak), peak_added_x_logits=max(0, peak) / record["logits_bytes"],
        gbps=record["floor_bytes"] / statistics.median(times) / 1e9,
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
    from fused_is.testing import HostReads

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
    for key in ("gbps", "kernel_gbps", "fused_kernel_gbps"):
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
    return worker_record("fused_is.benchmarks.main", [provider, n, vocab, dtype, reps, warmup, seq_len],
                         dict(kind="provider", provider=provider, n=n, vocab=vocab, dtype=dtype, seq_len=seq_len))


# ----------------------------------------------------------------------------------------------------
# reporting


def _size_heading(r: dict) -> str:
    return (f"N={r['n']} V={r['vocab']} {r['dtype']}" + (f" L={r['seq_len']}" if r.get("seq_len") else "")
            + (f" (copy {fmt_num(r['copy_gbps'])} GB/s)" if r.get("copy_gbps") else ""))


def format_table(records: List[dict]) -> str:
    """The measurements, one block per size (its copy bandwidth in the heading), in at most 100 columns: median
    and min-max time, on GPU the kernel time (kernel_ms), peak memory added over the logits, GB/s of one read and
    one write of the logits (a probe's: one read), the speedup over eager and the errors against float64.
    Everything else (aten_ops, host_reads, copy_frac, kernels, ...) is in bench.json and bench.csv."""
    kernel = any(r.get("kernel_time_s") is not None for r in records)
    header = (["provider", "ms", "min-max ms"] + (["kernel ms"] if kernel else [])
              + ["mem/logits", "GB/s", "x eager", "loss err", "grad err"])
    rows: list = []
    sizes: Dict[tuple, List[dict]] = {}
    for r in records:
        sizes.setdefault((r["n"], r["vocab"], r["dtype"], r.get("seq_len") or 0), []).append(r)
    for recs in sizes.values():
        rows.append(_size_heading(next((r for r in recs if "copy_gbps" in r), recs[0])))
        for r in recs:
            if "error" in r:
                rows.append([r["provider"], "failed: " + r["error"]])
                continue
            cells = [r["provider"], fmt_ms(r["time_median_s"]), fmt_spread(r)]
            if kernel:
                cells.append(kernel_ms(r))
            cells += [fmt_num(r["peak_added_x_logits"]), fmt_num(r["gbps"]),
                      f"{r['speedup_vs_eager']:.2f}" if r.get("speedup_vs_eager") is not None else "-",
                      _err(r["loss_err"]), _err(r["grad_err"])]
            rows.append(cells)
    return "\n".join(fixed_width(header, rows))


# printed under the tables on a GPU (two lines of at most 100 columns)
KERNEL_MS_NOTE = ("kernel ms: the provider's own kernels by name (fused_kernel_time_s: _fused_kernel,\n"
                  "fused_rows_kernel, cluster_rows_kernel, Liger's _grpo_loss_*), else all (kernel_time_s)")


def kernel_ms(r: dict) -> str:
    """The table's kernel time: the provider's own kernels (fused_kernel_time_s), else the GPU busy time."""
    value = r.get("fused_kernel_time_s", r.get("kernel_time_s"))
    return fmt_ms(value) if value is not None else "-"


def _err(value) -> str:
    return f"{value:.1e}" if value is not None else "-"


def plot_title(env: dict, what: str) -> str:
    return f"fused_is {what} ({CONFIG}) on {env.get('gpu', env['machine'])}, torch {env['torch']}"


def write_outputs(records: List[dict], env: dict, out_dir: Path, plot: bool, bandwidth: List[dict] = ()) -> List[Path]:
    """bench.json (environment, bandwidth, every record), bench.csv (one row per record, the environment in env_*
    columns) and bench.png (bar_plot) in out_dir."""
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
            paths.append(bar_plot(records, plot_title(env, "policy loss"), out_dir / "bench.png",
                                  group=lambda r: (r["n"], r["vocab"], r["dtype"], r.get("seq_len") or 0),
                                  group_label=lambda g: f"{g[0]}x{g[1]}\n{g[2]}" + (f" L={g[3]}" if g[3] else "")))
        except ImportError as exc:
            print(f"(no plot: {exc})")
    return paths


# ----------------------------------------------------------------------------------------------------
# command line


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", default=None,
                        help="small sizes, few repetitions (the default on CPU; under two minutes)")
    parser.add_argument("--full", dest="quick", action="store_false", help="the full grid (default on GPU)")
    parser.add_argument("--n", type=positive_int, nargs="+", help="token counts N")
    parser.add_argument("--vocab", type=vocab_size, nargs="+", help="vocabulary sizes V (default 32000 151936; "
                        "--linear: default 32000 on CPU, 151936 on GPU; --comms: V_local)")
    parser.add_argument("--dtypes", nargs="+", default=["bf16", "fp32"], choices=sorted(DTYPES))
    parser.add_argument("--providers", nargs="+", help="subset of providers, measured in this order at each size "
                        f"(default: all available; compile always goes last): {', '.join(PROVIDERS)}; --linear: "
                        "those of fused_is.benchmarks.linear")
    parser.add_argument("--reps", type=positive_int, help="timed repetitions per measurement")
    parser.add_argument("--warmup", type=non_negative_int, default=1)
    parser.add_argument("--seq-len", type=non_negative_int, default=0, metavar="L",
                        help="the trainer's layout: N / L sequences of L tokens, the model's [B, L + 1, V] output with "
                        "one advantage per sequence (Liger's own layout: no copy for any provider); default 0, packed "
                        "[N, V] with per-token advantages; --linear: tokens per packed sequence (cu_seqlens), default "
                        "gcd(N, 256)")
    parser.add_argument("--out", type=Path, help="output folder (default bench/results/local/<machine>, gitignored; "
                        "the committed results are written only by naming their folder here)")
    parser.add_argument("--no-plot", action="store_true")
    parser.add_argument("--jsonl", type=Path, help="append one JSON line per record (bandwidth, measurement) to "
                        "this file as soon as it is taken")
    parser.add_argument("--in-process", action="store_true",
                        help="on CPU, measure in this process (fast; peak memory then less exact) instead of one "
                        "subprocess per measurement")
    parser.add_argument("--linear", action="store_true",
                        help="the fused-linear benchmark (fused_is/benchmarks/linear.py): hidden states and the "
                        "lm_head weight against eager, Liger's fused linear GRPO loss and TRL's chunked lm-head")
    parser.add_argument("--distill", action="store_true",
                        help="the distillation benchmark (fused_is/benchmarks/distill.py): generalized JSD from logits "
                        "and from hidden states against TRL's eager loss, torch.compile of it and Liger's JSD")
    parser.add_argument("--comms", action="store_true", help="bytes and collectives per distributed call on gloo "
                        "(fused_is/benchmarks/comms.py; --n one N, --vocab V_local, --world the group sizes)")
    parser.add_argument("--world", type=positive_int, nargs="+", help="--comms: process-group sizes (default 2 4)")
    parser.add_argument("--hidden-dim", type=positive_int,
                        help="--linear, --distill: the hidden size D (default 1024 on CPU, 4096 on GPU)")
    from .linear import add_masked_arguments

    add_masked_arguments(parser, seq_len=False)  # --seq-len above: with --linear, the packed sequences' length
    parser.add_argument("--triton-interpreter", action="store_true",
                        help="allow Triton on the CPU under TRITON_INTERPRET=1 (plumbing checks; the time means "
                        "nothing)")
    parser.add_argument("--triton-configs", nargs="+", metavar="BLOCKxWARPS",
                        help="time the Triton providers (default triton_inplace_forward) once per launch "
                        "configuration of the row kernels, e.g. 8192x16 4096x8@4 16384x32-nohints (BLOCK cap x "
                        "num_warps, after '@' _fused_kernel's programs per SM, after '-' its L2 eviction hints forced "
                        "off or on: nohints, hints; set through $FUSED_IS_TRITON_BLOCK, $FUSED_IS_TRITON_WARPS, "
                        "$FUSED_IS_TRITON_PROGRAMS_PER_SM and $FUSED_IS_TRITON_L2_HINTS); records of kind "
                        "triton_config")


def check_arguments(args: argparse.Namespace) -> None:
    """What argparse cannot check: the provider names of the mode, --seq-len against every --n. SystemExit with
    one line (the valid values listed) before anything is measured."""
    if args.linear:
        from . import linear

        check_choices("--providers (--linear)", args.providers, linear.LINEAR_PROVIDERS)
    elif args.distill:
        from . import distill

        check_choices("--providers (--distill)", args.providers, distill.PROVIDERS)
    elif args.comms:
        if args.providers:
            raise SystemExit("fused-is bench: --comms takes no --providers (it counts fused_is's own collectives)")
    else:
        check_choices("--providers", args.providers, PROVIDERS)
    if getattr(args, "masked", None) and not args.linear:
        raise SystemExit("fused-is bench: --masked is a dimension of --linear only (the logits bench takes no mask)")
    if args.seq_len and args.n and any(n % args.seq_len for n in args.n):
        raise SystemExit(f"fused-is bench: --seq-len {args.seq_len} must divide every --n (got --n "
                         f"{' '.join(map(str, args.n))}; valid: the divisors of each N)")


def nothing_to_measure(skipped: Dict[str, str]) -> SystemExit:
    """The error of a run whose every chosen provider is unavailable (never exit 0 with empty results)."""
    return SystemExit("fused-is bench: nothing to measure here: "
                      + "; ".join(f"{p}: {why}" for p, why in skipped.items()))


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
    """`fused-is bench` with parsed arguments (add_arguments); 0 when every measurement succeeded."""
    check_arguments(args)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.linear:
        from . import linear

        return linear.run_from_bench(args, device)
    if args.distill:
        from . import distill

        return distill.run_from_bench(args, device)
    if args.comms:
        from . import comms

        return comms.run_from_bench(args)
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
    skipped = {p: available[p] for p in chosen if available[p] is not None}
    for p, why in skipped.items():
        print(f"skip {p}: {why}")
    runnable = [p for p in chosen if p not in skipped]
    if not runnable:
        raise nothing_to_measure(skipped)
    env = environment(device)
    out_dir = args.out or default_out_dir(device)
    grid = [(p, n, v, d) for d in args.dtypes for v in args.vocab for n in sizes_n for p in runnable]
    # torch.compile compiles each new shape on first use (tens of seconds): last, so a timeout costs only its numbers
    grid.sort(key=lambda case: case[0] == "compile")
    bandwidth = {}
    cases = progress(grid, "bench")
    with Measurements(args.jsonl, len(grid)) as m:
        for provider, n, vocab, dtype in cases:
            if (n, vocab, dtype) not in bandwidth:
                bandwidth[(n, vocab, dtype)] = copy_bandwidth(n, vocab, dtype, device)
                m.emit(bandwidth[(n, vocab, dtype)])
            if hasattr(cases, "set_postfix_str"):
                cases.set_postfix_str(f"{provider} {n}x{vocab} {dtype}")
            m.add(_with_copy_fractions(_one(provider, n, vocab, dtype, device, reps, args),
                                       bandwidth[(n, vocab, dtype)]))
    records, interrupted = m.records, m.interrupted
    for r in records:
        eager = [e for e in records if e["provider"] == "eager" and (e["n"], e["vocab"], e["dtype"]) ==
                 (r["n"], r["vocab"], r["dtype"]) and "error" not in e]
        if eager and "error" not in r and not r["provider"].endswith(PROBE):
            r["speedup_vs_eager"] = eager[0]["time_median_s"] / r["time_median_s"]
    print(f"\nfused_is bench on {env.get('gpu', env['machine'])} ({device}), torch {env['torch']}, config {CONFIG}")
    print(format_table(records))
    if device == "cuda":
        print(KERNEL_MS_NOTE)
    timing = ("CUDA events around the full call (host share included); kernel_time_s: GPU busy time per call "
              "(torch profiler); fused_kernel_time_s: the provider's own kernels by name; kernels: each kernel's "
              "time per call"
              if device == "cuda" else "perf_counter around the full call")
    paths = write_outputs(records, {**env, "reps": reps, "quick": quick, "timing": timing, "interrupted": interrupted,
                                    "providers_skipped": {k: v for k, v in available.items() if v is not None},
                                    **({"liger_settings": dict(liger_settings(), is_cap=_liger_config().is_cap),
                                        "liger_notes": LIGER_NOTES, "liger_kernel": package_version("liger-kernel")}
                                       if any(case[0] == "liger" for case in grid) else {})},
                          out_dir, not args.no_plot, bandwidth.values())
    print(wrote(paths))
    return 1 if interrupted or any("error" in r for r in records) else 0


# ----------------------------------------------------------------------------------------------------
# Triton launch configurations (issue #18): which (BLOCK, num_warps) of the row kernels is fastest


HINT_FLAGS = {"hints": True, "nohints": False}  # a config's '-' suffix: _fused_kernel's L2 eviction hints on / off


def parse_triton_config(text: str) -> tuple:
    """'4096x8' -> (4096, 8, None, None), '4096x8@4' -> (4096, 8, 4, None) (4 programs of _fused_kernel per SM),
    '16384x32-nohints' -> (16384, 32, None, False) (its L2 eviction hints off; '-hints': on; no suffix: the
    launcher's rule), validated as the launcher validates $FUSED_IS_TRITON_BLOCK, _WARPS and _PROGRAMS_PER_SM."""
    from fused_is.backends import triton as launcher

    config, dash, flag = (part.strip() for part in text.lower().partition("-"))
    shape, at, programs = (part.strip() for part in config.partition("@"))
    block, sep, warps = (part.strip() for part in shape.partition("x"))
    if not (block and sep and warps) or (at and not programs) or (dash and flag not in HINT_FLAGS):
        raise SystemExit(f"--triton-configs {text!r}: expected BLOCKxWARPS[@PROGRAMS_PER_SM][-hints|-nohints], e.g. "
                         "4096x8, 4096x8@4 or 16384x32-nohints")
    with triton_config_env(block, warps, programs or None):
        try:
            warps = launcher.num_warps()
            return launcher.block_override(), warps, launcher.programs_override(warps), HINT_FLAGS.get(flag)
        except ValueError as exc:
            raise SystemExit(f"--triton-configs {text}: {exc}") from None


def config_label(block: int, warps: int, programs: Optional[int], hints: Optional[bool] = None) -> str:
    return (f"{block}x{warps}" + (f"@{programs}" if programs else "")
            + ("" if hints is None else "-hints" if hints else "-nohints"))


class triton_config_env:
    """Sets $FUSED_IS_TRITON_BLOCK, $FUSED_IS_TRITON_WARPS, $FUSED_IS_TRITON_PROGRAMS_PER_SM (empty, i.e. the L2
    rule, when programs is None) and $FUSED_IS_TRITON_L2_HINTS (empty, the launcher's rule, when hints is None) for
    the block (the launcher reads them at each launch; a subprocess inherits them) and restores what was there
    before."""

    def __init__(self, block, warps, programs=None, hints=None):
        from fused_is.backends import triton as launcher

        self.values = {launcher.BLOCK_ENV: str(block), launcher.WARPS_ENV: str(warps),
                       launcher.PROGRAMS_ENV: str(programs or ""),
                       launcher.HINTS_ENV: "" if hints is None else str(int(hints))}

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


def format_config_table(records: List[dict]) -> str:
    """One block per size, one row per (configuration, provider), in at most 100 columns: P/SM is _fused_kernel's
    programs per SM (the override after '@', else the L2 rule's); block_launched, copy_frac and the rest are in
    triton_configs.json."""
    kernel = any(r.get("kernel_time_s") is not None for r in records)
    header = (["config", "provider", "P/SM", "ms", "min-max ms"] + (["kernel ms"] if kernel else [])
              + ["GB/s", "x dflt", "regs", "spills", "grad err"])
    rows: list = []
    sizes: Dict[tuple, List[dict]] = {}
    for r in records:
        sizes.setdefault((r["n"], r["vocab"], r["dtype"]), []).append(r)
    for recs in sizes.values():
        rows.append(_size_heading(next((r for r in recs if "copy_gbps" in r), recs[0])))
        for r in recs:
            if "error" in r:
                rows.append([r["triton_config"], r["provider"], "failed: " + r["error"]])
                continue
            opt = lambda key, fmt: fmt.format(r[key]) if r.get(key) is not None else "-"  # noqa: E731
            cells = [r["triton_config"], r["provider"], opt("programs_per_sm", "{}"), fmt_ms(r["time_median_s"]),
                     fmt_spread(r)]
            if kernel:
                cells.append(kernel_ms(r))
            cells += [fmt_num(r["gbps"]), opt("speedup_vs_default", "{:.3f}"), opt("registers", "{}"),
                      opt("spills", "{}"), _err(r["grad_err"])]
            rows.append(cells)
    return "\n".join(fixed_width(header, rows))


def _config_record(provider, n, vocab, dtype, device, reps, args, block, warps, programs=None, hints=None) -> dict:
    """One measurement (the same `_one` as the main grid) under one launch configuration, tagged with it and with
    _fused_kernel's programs per SM, register cap (maxnreg) and L2 eviction hints as the launcher takes them."""
    import triton

    from fused_is.backends import triton as launcher

    launcher.LAST_LAUNCH.clear()
    with triton_config_env(block, warps, programs, hints):
        record = _one(provider, n, vocab, dtype, device, reps, args)
        l2_hints = launcher.l2_hints_on(torch.device(device))
    launched = launcher.LAST_LAUNCH.get("_fused_kernel", {})  # in this process only (GPU: the compiled kernel's)
    dev = torch.device(device)
    per_sm = programs or launcher.programs_per_sm(launcher.l2_cache_bytes(dev), launcher.multiprocessor_count(dev),
                                                  vocab * DTYPES[dtype].itemsize, warps)
    return dict(record, kind="triton_config", triton_config=config_label(block, warps, programs, hints),
                triton_block=block, triton_warps=warps, triton_programs_per_sm=programs, triton_l2_hints=hints,
                l2_hints=l2_hints, programs_per_sm=per_sm,
                maxnreg=launcher.fused_registers(warps, per_sm),
                block_launched=min(block, triton.next_power_of_2(vocab)), registers=launched.get("registers"),
                spills=launched.get("spills"))


def run_triton_configs(args: argparse.Namespace, device: str) -> int:
    """--triton-configs: each provider (triton_inplace_forward unless --providers) at each size, once per launch
    configuration; records of kind "triton_config" appended to --jsonl as they are taken (a copy bandwidth record
    of kind "bandwidth" first per size), a table, and <out>/triton_configs.json."""
    from fused_is.backends import triton as launcher

    configs = [parse_triton_config(c) for c in args.triton_configs]
    providers = args.providers or [HEADLINE]
    tritons = {"triton" + suffix for suffix in INPLACE_SUFFIXES}
    if set(providers) - tritons:
        raise SystemExit(f"--triton-configs times the Triton providers ({', '.join(sorted(tritons))}), not "
                         f"{sorted(set(providers) - tritons)}")
    reason = providers_here(device, triton_interpreter=args.triton_interpreter)["triton"]
    if reason is not None:
        raise nothing_to_measure({"triton": reason})
    sizes_n = args.n or ([16384] if device == "cuda" else [64])
    vocabs = args.vocab or ([151936] if device == "cuda" else [9000])
    dtypes = args.dtypes if args.dtypes != ["bf16", "fp32"] else ["bf16"]  # argparse's default: the headline's
    reps = args.reps or (10 if device == "cuda" else 3)
    env = environment(device)
    out_dir = args.out or default_out_dir(device)
    grid = [(n, v, d, c, p) for d in dtypes for v in vocabs for n in sizes_n for c in configs for p in providers]
    bandwidth = {}
    with Measurements(args.jsonl, len(grid)) as m:
        for n, vocab, dtype, (block, warps, programs, hints), provider in grid:
            if (n, vocab, dtype) not in bandwidth:
                bandwidth[(n, vocab, dtype)] = copy_bandwidth(n, vocab, dtype, device)
                m.emit(bandwidth[(n, vocab, dtype)])
            record = m.add(_with_copy_fractions(_config_record(provider, n, vocab, dtype, device, reps, args, block,
                                                               warps, programs, hints), bandwidth[(n, vocab, dtype)]))
            print(f"{record['triton_config']} {provider} {n}x{vocab} {dtype}: "
                  + (f"failed: {record['error']}" if "error" in record else
                     f"{record['time_median_s'] * 1e3:.3f} ms, {record['gbps']:.1f} GB/s"), flush=True)
    records, interrupted = m.records, m.interrupted
    for r in records:  # against the launcher's default configuration at the same size, where it was measured
        same = ("provider", "n", "vocab", "dtype")
        default = [d for d in records if (d["triton_block"], d["triton_warps"], d["triton_programs_per_sm"],
                                          d["triton_l2_hints"]) == (launcher.BLOCK, launcher.NUM_WARPS, None, None)
                   and all(d[k] == r[k] for k in same) and "error" not in d]
        if default and "error" not in r:
            r["speedup_vs_default"] = default[0]["time_median_s"] / r["time_median_s"]
    print(f"\nTriton configs (BLOCKxWARPS[@programs/SM], default {launcher.BLOCK}x{launcher.NUM_WARPS}), {CONFIG}, "
          f"on {env.get('gpu', env['machine'])} ({device})")
    print(format_config_table(records))
    if device == "cuda":
        print(KERNEL_MS_NOTE)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "triton_configs.json"
    path.write_text(json.dumps(dict(environment={**env, "reps": reps, "interrupted": interrupted}, config=CONFIG,
                                    bandwidth=list(bandwidth.values()), results=records), indent=2))
    print(f"wrote {path}")
    return 1 if interrupted or any("error" in r for r in records) else 0


def parser(prog: str = "python -m fused_is.benchmarks.main") -> ArgumentParser:
    """The command line of `fused-is bench` (fused_is/cli.py adds the same arguments to its subcommand)."""
    out = ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    add_arguments(out)
    return out


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "_worker":  # one measurement in a fresh process (CPU memory)
        provider, n, vocab, dtype, reps, warmup = argv[1:7]
        seq_len = int(argv[7]) if len(argv) > 7 else 0
        torch.manual_seed(0)
        print(json.dumps(measure(provider, int(n), int(vocab), dtype, "cpu", int(reps), int(warmup), seq_len)))
        return 0
    return run(parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
