"""`fused-is bench --distill`: forward+backward of on-policy distillation over the full vocabulary.

Every provider computes the same loss, TRL 1.16's generalized JSD (GKD's generalized_jsd_loss, beta = 0.5,
temperature 1) of the student towards the teacher, averaged over the unmasked tokens (TRL's reduction="batchmean"
with labels -100 at the masked ones; about a tenth of the rows masked), and its gradient for the student only.

Logits path (inputs: the student's logits [N, V], a leaf, and the teacher's, both in the bench dtype):
- eager: TRL's own generalized_jsd_loss on the logits upcast to fp32 (a full fp32 log_softmax of both, the mixture,
  F.kl_div), autograd: what a trainer does without fused kernels;
- compile: torch.compile of that same function (its first call, the compilation, is the warm-up);
- fused_<backend>, fused_<backend>_inplace: fused_is.distill_loss(kind="jsd"), inplace=False / True;
- liger_jsd: Liger-Kernel 0.8.5's LigerJSD (its Triton kernel) on the fp32 log-softmax of both (CUDA only: on the
  CPU its kernel runs only under Triton's interpreter, which would time the interpreter).
Linear path (inputs: hidden [N, D], weight [V, D], teacher_hidden [N, D], teacher_weight [V, D]):
- eager_linear: logits = hidden @ weight.T (the teacher's under no_grad), then eager's loss;
- fused_linear_<backend>: fused_is.linear_distill_loss;
- liger_chunked: Liger's chunked-loss LigerFusedLinearJSDLoss (plain torch over chunks of 1024 rows, the hard loss
  weighted 0; torch.compile of its chunk step on CUDA only, as the fused-linear bench's liger);
- liger_fused_linear: Liger's LigerFusedLinearJSD (Triton; CUDA only, as liger_jsd).

Per provider and size: median time over reps (CUDA events on GPU, perf_counter on CPU; warm-up excluded), peak
memory added over the inputs (CUDA max_memory_allocated; on CPU the peak RSS of a fresh subprocess per measurement
unless in_process) also as a multiple of the student's logits ([N, V] in the bench dtype), and the relative error of
the loss and the gradients against fused_is's float64 oracle (distill_reference) on ERROR_ROWS rows. Eager providers
whose fp32 [N, V] buffers would not fit in the memory available are skipped with the estimate. Outputs in args.out:
distill.jsonl, distill.md and distill.png, as the fused-linear bench's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Dict, List, Optional

import torch

from .common import (DTYPES, ERROR_ROWS, LIGER_PIN, TRL_PIN, ArgumentParser, Measurements, bar_plot, choose_providers,
                     default_out_dir, environment, fixed_width, fmt_ms, fmt_num, fmt_spread, non_negative_int,
                     positive_int, time_steps, versions, vocab_size, worker_record, wrote)

BETA = 0.5
MASKED_SHARE = 0.1
LOGIT_STD = 2.0  # logits of std 2 (as the other benches); the teacher's the student's plus noise of std 1
BACKENDS = {"cpu": ("torch", "cpu"), "cuda": ("triton", "cuda", "torch")}
FUSED_BACKENDS = ("torch", "cpu", "triton", "cuda")
LOGITS_PROVIDERS = (("eager", "compile")
                    + tuple(f"fused_{b}{s}" for b in FUSED_BACKENDS for s in ("", "_inplace")) + ("liger_jsd",))
LINEAR_PROVIDERS = ("eager_linear",) + tuple(f"fused_linear_{b}" for b in FUSED_BACKENDS) \
    + ("liger_chunked", "liger_fused_linear")
PROVIDERS = LOGITS_PROVIDERS + LINEAR_PROVIDERS
EAGER = ("eager", "compile", "eager_linear")
# fp32 [N, V] buffers eager's forward and backward hold at their peak (measured at N = 256, V = 151936 on the CPU:
# the upcasts, both log-softmaxes, the stacked mixture terms, the two kl_div outputs and their gradients)
EAGER_BUFFERS = 12
LIGER_CHUNK = 1024
CPU_SIZES = dict(sizes=[256, 1024, 4096], hidden_dim=1024, vocab=151936)
GPU_SIZES = dict(sizes=[1024, 4096, 16384], hidden_dim=4096, vocab=151936)
TARGETS = ("logits path: >= 5x eager in time, <= 1.1x the student's logits in added memory; linear path: >= 1.5x "
           "Liger in time, memory flat in N (issue 38)")


def path_of(provider: str) -> str:
    return "linear" if provider in LINEAR_PROVIDERS else "logits"


# ----------------------------------------------------------------------------------------------------
# providers


def _trl_loss_function():
    """TRL 1.16's GKDTrainer.generalized_jsd_loss (its import warns about other packages' versions)."""
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from trl.experimental.gkd.gkd_trainer import GKDTrainer
    return GKDTrainer.generalized_jsd_loss


def providers_here(device: str) -> Dict[str, Optional[str]]:
    """provider -> None when it can run on `device`, else the reason it cannot."""
    import importlib.util

    from fused_is import backends

    probe = torch.empty(1, 2, device=device)
    out: Dict[str, Optional[str]] = {}
    try:
        _trl_loss_function()
        trl_missing = None
    except Exception as exc:  # ImportError, or TRL's own import failing
        trl_missing = (f"TRL's generalized_jsd_loss does not import ({type(exc).__name__}: {exc}); pip install "
                       f"{TRL_PIN}")
    for name in ("eager", "compile"):
        out[name] = trl_missing
    for name in BACKENDS[device]:
        why = backends.unavailable_reason(name, probe)
        out[f"fused_{name}"] = out[f"fused_{name}_inplace"] = out[f"fused_linear_{name}"] = why
    out["eager_linear"] = trl_missing
    liger = None if importlib.util.find_spec("liger_kernel") else \
        f"liger-kernel is not installed (pip install {LIGER_PIN})"
    triton_liger = liger or (None if device == "cuda" else
                             "Liger's Triton kernel runs on the CPU only under Triton's interpreter, which would time "
                             "the interpreter")
    out["liger_jsd"] = out["liger_fused_linear"] = triton_liger
    out["liger_chunked"] = liger
    return out


def make_problem(provider: str, n: int, hidden_dim: int, vocab: int, dtype: torch.dtype, device: str,
                 seed: int = 0) -> dict:
    """The inputs of one provider's path: logits (student leaf, teacher) or the two heads, and mask / labels."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    mask = torch.rand(n, generator=gen) >= MASKED_SHARE
    labels = torch.where(mask, torch.randint(0, vocab, (n,), generator=gen), -100)
    p = dict(mask=mask.to(device), labels=labels.to(device))
    if path_of(provider) == "logits":  # 1024 rows at a time: no fp32 [N, V] while the inputs are made
        student = torch.empty(n, vocab, dtype=dtype, device=device)
        teacher = torch.empty_like(student)
        for start in range(0, n, 1024):
            rows = torch.randn(min(1024, n - start), vocab, generator=gen) * LOGIT_STD
            student[start:start + 1024] = rows
            teacher[start:start + 1024] = rows.add_(torch.randn(rows.shape, generator=gen))
        p.update(student=student, teacher=teacher)
    else:
        scale = LOGIT_STD / hidden_dim ** 0.5
        hidden = torch.randn(n, hidden_dim, generator=gen)
        weight = torch.randn(vocab, hidden_dim, generator=gen) * scale
        teacher_hidden = hidden + 0.5 * torch.randn(n, hidden_dim, generator=gen)
        teacher_weight = weight + 0.5 * scale * torch.randn(vocab, hidden_dim, generator=gen)
        p.update(hidden=hidden.to(device, dtype), weight=weight.to(device, dtype),
                 teacher_hidden=teacher_hidden.to(device, dtype), teacher_weight=teacher_weight.to(device, dtype))
    return p


def _eager(student, teacher, labels):
    return _trl_loss_function()(student.float(), teacher.float(), labels=labels, beta=BETA)


_compiled = {}


def provider_loss(provider: str, leaves: List[torch.Tensor], p: dict) -> torch.Tensor:
    """The loss of `provider` on the problem p, differentiable w.r.t. leaves (the student's logits, or its hidden
    states and weight); "reference": fused_is's float64 oracle."""
    import fused_is

    if provider == "reference":
        from fused_is.reference import distill_reference

        if len(leaves) == 1:
            logits, teacher = leaves[0], p["teacher"].double()
        else:
            logits = leaves[0] @ leaves[1].t()
            teacher = p["teacher_hidden"].double() @ p["teacher_weight"].double().t()
        return distill_reference(logits, teacher, kind="jsd", beta=BETA, mask=p["mask"])[0]
    if provider == "eager":
        return _eager(leaves[0], p["teacher"], p["labels"])
    if provider == "compile":
        if "eager" not in _compiled:
            _compiled["eager"] = torch.compile(_eager)
        return _compiled["eager"](leaves[0], p["teacher"], p["labels"])
    if provider.startswith("fused_linear_"):
        return fused_is.linear_distill_loss(leaves[0], leaves[1], p["teacher_hidden"], p["teacher_weight"],
                                            kind="jsd", beta=BETA, mask=p["mask"],
                                            backend=provider[len("fused_linear_"):])[0]
    if provider.startswith("fused_"):
        backend = provider[len("fused_"):].replace("_inplace", "")
        return fused_is.distill_loss(leaves[0], p["teacher"], kind="jsd", beta=BETA, mask=p["mask"], backend=backend,
                                     inplace=provider.endswith("_inplace"))[0]
    if provider == "liger_jsd":
        from liger_kernel.transformers.jsd import LigerJSD

        log_p, log_q = torch.log_softmax(leaves[0].float(), -1), torch.log_softmax(p["teacher"].float(), -1)
        return LigerJSD(beta=BETA)(log_p, log_q, p["labels"])
    if provider == "eager_linear":
        with torch.no_grad():
            teacher = p["teacher_hidden"] @ p["teacher_weight"].t()
        return _eager(leaves[0] @ leaves[1].t(), teacher, p["labels"])
    if provider == "liger_chunked":
        from liger_kernel.chunked_loss import LigerFusedLinearJSDLoss

        loss = LigerFusedLinearJSDLoss(weight_hard_loss=0.0, weight_soft_loss=1.0, beta=BETA,
                                       compiled=leaves[0].is_cuda, chunk_size=LIGER_CHUNK)
        return loss(leaves[0], leaves[1], p["teacher_hidden"], p["teacher_weight"], p["labels"])
    if provider == "liger_fused_linear":
        from liger_kernel.transformers.fused_linear_jsd import LigerFusedLinearJSD

        return LigerFusedLinearJSD(jsd_beta=BETA)(leaves[0], leaves[1], p["teacher_hidden"], p["teacher_weight"],
                                                  p["labels"])
    raise ValueError(f"unknown provider {provider!r}")


def _leaves(provider: str, p: dict, dtype=None) -> List[torch.Tensor]:
    names = ("student",) if path_of(provider) == "logits" else ("hidden", "weight")
    return [p[k].detach().to(dtype or p[k].dtype).clone().requires_grad_() for k in names]


def run_step(provider: str, leaves: List[torch.Tensor], p: dict) -> torch.Tensor:
    """One forward+backward; the gradients land in the leaves' .grad (freed by the caller)."""
    loss = provider_loss(provider, leaves, p)
    loss.backward()
    if any(x.grad is None for x in leaves):
        raise RuntimeError(f"{provider}: backward left a gradient unset")
    return loss


def provider_errors(provider: str, p: dict) -> Dict[str, float]:
    """Relative error of the loss and the gradients against the float64 oracle on the same inputs."""
    from fused_is.testing import rel_err

    leaves, ref_leaves = _leaves(provider, p), _leaves(provider, p, torch.float64)
    loss, ref = run_step(provider, leaves, p), run_step("reference", ref_leaves, p)
    errors = dict(loss=loss.item(), ref_loss=ref.item(), loss_err=rel_err(loss, ref))
    names = ("grad_logits_err",) if len(leaves) == 1 else ("grad_hidden_err", "grad_weight_err")
    errors.update({name: rel_err(x.grad, r.grad) for name, x, r in zip(names, leaves, ref_leaves)})
    return errors


# ----------------------------------------------------------------------------------------------------
# measurement


def eager_bytes(n: int, vocab: int) -> int:
    """About the peak of eager's fp32 [N, V] buffers (EAGER_BUFFERS of them)."""
    return EAGER_BUFFERS * n * vocab * 4


def available_bytes() -> Optional[int]:
    """MemAvailable of /proc/meminfo, or None where there is none."""
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def measure(provider: str, n: int, hidden_dim: int, vocab: int, dtype: str, device: str, reps: int,
            warmup: int) -> dict:
    """Time, peak memory and error of one provider at one size, in this process."""
    p = make_problem(provider, n, hidden_dim, vocab, DTYPES[dtype], device)
    leaves = _leaves(provider, p)
    elem = leaves[0].element_size()
    record = dict(kind="distill", path=path_of(provider), provider=provider, n=n, hidden_dim=hidden_dim, vocab=vocab,
                  dtype=dtype, device=device, logits_bytes=n * vocab * elem,
                  grads_bytes=sum(x.numel() for x in leaves) * elem)
    if provider == "liger_chunked":
        record["settings"] = dict(compiled=device == "cuda", chunk_size=LIGER_CHUNK, weight_hard_loss=0.0)

    def clear():
        for x in leaves:
            x.grad = None

    times, peak = time_steps(lambda: run_step(provider, leaves, p), clear, device, reps, warmup)
    record.update(time_median_s=statistics.median(times), time_min_s=times[0], time_max_s=times[-1], reps=reps,
                  peak_added_bytes=max(0, peak), peak_added_x_logits=max(0, peak) / record["logits_bytes"])
    del p, leaves
    small = make_problem(provider, min(n, ERROR_ROWS), hidden_dim, vocab, DTYPES[dtype], device, seed=1)
    record.update(provider_errors(provider, small))
    return record


def _one(provider, n, args, device) -> dict:
    failure = dict(kind="distill", path=path_of(provider), provider=provider, n=n, hidden_dim=args.hidden_dim,
                   vocab=args.vocab, dtype=args.dtype, device=device)
    if device == "cpu" and not args.in_process:
        return worker_record("fused_is.benchmarks.distill",
                             [provider, n, args.hidden_dim, args.vocab, args.dtype, args.reps, args.warmup], failure)
    try:
        return measure(provider, n, args.hidden_dim, args.vocab, args.dtype, device, args.reps, args.warmup)
    except Exception as exc:  # one failing provider must not hide the others' numbers
        return dict(failure, error=f"{type(exc).__name__}: {exc}")
    finally:
        if device == "cuda":
            torch.cuda.empty_cache()


# ----------------------------------------------------------------------------------------------------
# reporting

COLUMNS = [("path", "{}"), ("provider", "{}"), ("n", "{}"), ("vocab", "{}"), ("dtype", "{}"),
           ("time_median_s", "{:.4f}"), ("spread", "{}"), ("speedup_vs_eager", "{:.2f}"),
           ("speedup_vs_liger", "{:.2f}"), ("peak_added_mib", "{:.0f}"),
           ("peak_added_x_logits", "{:.2f}"), ("loss_err", "{:.1e}"), ("grad_err", "{:.1e}")]


def _grad_err(r: dict) -> float:
    return max(r.get(k, 0.0) for k in ("grad_logits_err", "grad_hidden_err", "grad_weight_err"))


def add_speedups(records: List[dict]) -> None:
    """speedup_vs_eager (eager, or eager_linear on the linear path) and, on the linear path, speedup_vs_liger
    (liger_fused_linear where measured, else liger_chunked), at the same N."""
    def time_of(provider, n):
        match = [e for e in records if e["provider"] == provider and e["n"] == n and "error" not in e]
        return match[0]["time_median_s"] if match else None

    for r in records:
        if "error" in r:
            continue
        eager = time_of("eager" if r["path"] == "logits" else "eager_linear", r["n"])
        if eager:
            r["speedup_vs_eager"] = eager / r["time_median_s"]
        if r["path"] == "linear":
            liger = time_of("liger_fused_linear", r["n"]) or time_of("liger_chunked", r["n"])
            if liger:
                r["speedup_vs_liger"] = liger / r["time_median_s"]


def format_table(records: List[dict]) -> str:
    """Markdown table of the measurements (a failed one shows its error)."""
    names = [name for name, _ in COLUMNS]
    rows = ["| " + " | ".join(names) + " |", "|" + "---|" * len(names)]
    for r in records:
        if "error" in r:
            cells = [r["path"], r["provider"], str(r["n"]), str(r["vocab"]), r["dtype"],
                     "failed: " + r["error"][:100].replace("|", "/")] + [""] * (len(names) - 6)
        else:
            r = dict(r, spread=f"{r['time_min_s']:.4f}-{r['time_max_s']:.4f}",
                     peak_added_mib=r["peak_added_bytes"] / 2**20, grad_err=_grad_err(r))
            cells = [fmt.format(r[name]) if r.get(name) is not None else "-" for name, fmt in COLUMNS]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def format_console(records: List[dict]) -> str:
    """The table printed at the end of a run (at most 100 columns), one block per path and N."""
    header = ["provider", "ms", "min-max ms", "x eager", "x liger", "MiB added", "mem/logits", "max err"]
    rows: list = []
    blocks: Dict[tuple, List[dict]] = {}
    for r in records:
        blocks.setdefault((r["path"], r["n"], r["vocab"], r["dtype"]), []).append(r)
    for (path, n, v, dtype), recs in blocks.items():
        rows.append(f"{path} N={n} V={v} {dtype}")
        for r in recs:
            if "error" in r:
                rows.append([r["provider"], "failed: " + r["error"]])
                continue
            opt = lambda key: f"{r[key]:.2f}" if r.get(key) is not None else "-"  # noqa: E731
            rows.append([r["provider"], fmt_ms(r["time_median_s"]), fmt_spread(r), opt("speedup_vs_eager"),
                         opt("speedup_vs_liger"), f"{r['peak_added_bytes'] / 2**20:.0f}",
                         fmt_num(r["peak_added_x_logits"]), f"{max(r['loss_err'], _grad_err(r)):.1e}"])
    return "\n".join(fixed_width(header, rows))


def write_outputs(records: List[dict], env: dict, out_dir: Path, plot: bool = True) -> List[Path]:
    """distill.jsonl (the environment line, then every record), distill.md and distill.png."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / "distill.jsonl", out_dir / "distill.md"]
    with paths[0].open("w") as f:
        for r in [dict(kind="environment", **env)] + records:
            f.write(json.dumps(r) + "\n")
    skipped = "\n".join(f"- {k}: {v}" for k, v in env.get("providers_skipped", {}).items()) or "- none"
    paths[1].write_text(
        f"# fused_is distillation (generalized JSD, beta {BETA}) on {env.get('gpu', env['machine'])}\n\n"
        f"torch {env['torch']}, {env['device']}, {env.get('threads')} threads, git {env.get('git')}, {env['date']}; "
        f"timing: {env['timing']}; reps {env['reps']}, warm-up {env['warmup']}; D = {env['hidden_dim']} (linear path)"
        f"{'; INTERRUPTED: ' + env['interrupted'] if env.get('interrupted') else ''}\n\n"
        f"{format_table(records)}\n\n"
        "peak_added: memory over the inputs, the returned gradients included; x_logits: over the student's [N, V] "
        f"logits in the bench dtype; errors: max-abs relative to the float64 oracle on {ERROR_ROWS} rows.\n"
        f"Targets: {TARGETS}.\n\n- versions: {json.dumps(env.get('versions'))}\n\n## Skipped\n\n{skipped}\n")
    if plot:
        try:
            title = (f"fused_is distillation (JSD beta {BETA}), V={env['vocab']} {env['dtype']}, on "
                     f"{env.get('gpu', env['machine'])}, torch {env['torch']}")
            paths.append(bar_plot(records, title, out_dir / "distill.png", group=lambda r: (r["path"], r["n"]),
                                  group_label=lambda g: f"{g[0]}\nN={g[1]}"))
        except ImportError as exc:
            print(f"(no plot: {exc})")
    return paths


def run(args: argparse.Namespace) -> int:
    """The --distill benchmark. args: sizes, hidden_dim, vocab, dtype, device, reps, warmup, out, providers,
    in_process (no_plot optional). Returns 1 if a measurement failed or the run was interrupted, else 0; an unknown
    provider, or none that can run here, is a SystemExit before anything is measured."""
    device = args.device
    off_device = f"the distillation bench times the backends {', '.join(BACKENDS[device])} on {device}"
    chosen, skipped = choose_providers("--providers (--distill)", args.providers, PROVIDERS, providers_here(device),
                                       off_device)
    grid, memory = [], available_bytes() if device == "cpu" else None
    for n in args.sizes:
        for p in chosen:
            if p in skipped:
                continue
            if p in EAGER and memory is not None and eager_bytes(n, args.vocab) > memory:
                skipped[f"{p} N={n}"] = (f"about {eager_bytes(n, args.vocab) / 2**30:.1f} GiB of fp32 [N, V] buffers, "
                                         f"{memory / 2**30:.1f} GiB available")
                continue
            grid.append((p, n))
    for p, why in skipped.items():
        print(f"skip {p}: {why}")
    if not grid:
        raise SystemExit("fused-is bench --distill: nothing to measure here: "
                         + "; ".join(f"{p}: {why}" for p, why in skipped.items()))
    env = environment(device)
    env.update(reps=args.reps, warmup=args.warmup, hidden_dim=args.hidden_dim, vocab=args.vocab, dtype=args.dtype,
               timing=("CUDA events" if device == "cuda" else "perf_counter") + " around forward+backward",
               versions=versions(("liger-kernel", "trl", "triton")), targets=TARGETS,
               memory=("max_memory_allocated minus the baseline" if device == "cuda" else
                       "peak RSS minus the baseline" + (" (in process)" if args.in_process else
                                                       ", one subprocess per measurement")),
               providers_skipped=skipped)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    with Measurements(out_dir / "distill.jsonl", len(grid), mode="w") as m:
        m.emit(dict(kind="environment", **env))
        for i, (provider, n) in enumerate(grid):
            t0 = time.perf_counter()
            record = m.add(_one(provider, n, args, device))
            status = record.get("error") or f"{record['time_median_s']:.4f} s"
            print(f"[{i + 1}/{len(grid)}] {provider} N={n}: {status} ({time.perf_counter() - t0:.0f} s)",
                  file=sys.stderr)
    records, env["interrupted"] = m.records, m.interrupted
    add_speedups(records)
    print(f"\nfused_is distillation bench on {env.get('gpu', env['machine'])} ({device}), torch {env['torch']}")
    print(format_console(records))
    print(wrote(write_outputs(records, env, out_dir, plot=not getattr(args, "no_plot", False))))
    return 1 if m.interrupted or any("error" in r for r in records) else 0


def run_from_bench(args: argparse.Namespace, device: str) -> int:
    """`fused-is bench --distill`: the command line's --n, --vocab (one), --hidden-dim, --dtypes (the first, when
    given; else bf16), --reps, --warmup, --out, --providers, --in-process and --no-plot, this device's defaults for
    what it leaves out."""
    default = CPU_SIZES if device == "cpu" else GPU_SIZES
    if args.vocab and len(args.vocab) != 1:
        raise SystemExit("fused-is bench --distill takes one --vocab")
    dtype = args.dtypes[0] if args.dtypes != ["bf16", "fp32"] else "bf16"
    return run(argparse.Namespace(
        sizes=args.n or default["sizes"], hidden_dim=args.hidden_dim or default["hidden_dim"],
        vocab=args.vocab[0] if args.vocab else default["vocab"], dtype=dtype, device=device,
        reps=args.reps or (2 if device == "cpu" else 10), warmup=args.warmup, out=args.out or default_out_dir(device),
        providers=args.providers, in_process=args.in_process, no_plot=args.no_plot))


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "_worker":  # one measurement in a fresh process (CPU memory)
        provider, n, hidden_dim, vocab, dtype, reps, warmup = argv[1:8]
        torch.manual_seed(0)
        print(json.dumps(measure(provider, int(n), int(hidden_dim), int(vocab), dtype, "cpu", int(reps),
                                 int(warmup))))
        return 0
    parser = ArgumentParser(prog="python -m fused_is.benchmarks.distill", description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=positive_int, nargs="+", help="token counts N")
    parser.add_argument("--hidden-dim", type=positive_int, help="the linear path's D (default 1024 on CPU, 4096 "
                        "on GPU)")
    parser.add_argument("--vocab", type=vocab_size, nargs=1, help="V (default 151936)")
    parser.add_argument("--dtypes", nargs=1, default=["bf16", "fp32"], choices=sorted(DTYPES), help="default bf16")
    parser.add_argument("--providers", nargs="+", help=f"subset of {', '.join(PROVIDERS)}")
    parser.add_argument("--reps", type=positive_int)
    parser.add_argument("--warmup", type=non_negative_int, default=1)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--no-plot", action="store_true")
    parser.add_argument("--in-process", action="store_true")
    return run_from_bench(parser.parse_args(argv), "cuda" if torch.cuda.is_available() else "cpu")


if __name__ == "__main__":
    sys.exit(main())
