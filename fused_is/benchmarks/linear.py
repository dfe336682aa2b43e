"""`fused-is bench --linear`: forward+backward of the policy loss from hidden states and the lm_head weight.

Every provider computes the same loss (the ppo_tis preset, DESIGN.md section 2: PPO clip 0.2/0.2 on
r = exp(lp - old), times the truncated IS weight min(exp(old - sampler), is_cap = 2), token mean over the unmasked
tokens) on the same inputs (hidden [N, D], weight [V, D], tokens, per-sequence advantages broadcast to tokens, old and
sampler logprobs, the loss mask), and its gradient w.r.t. hidden and weight. --masked sets the share of masked rows:
contiguous spans, as the prompt and tool-output turns of a packed agentic sequence have them (agentic_mask), the same
rows for every provider:

- eager: logits = hidden @ weight.T in the input dtype, fp32 log_softmax, gather, the loss in eager torch,
  autograd (what trainers do without fused kernels);
- fused_linear_<backend>: fused_is.linear_policy_loss (logits chunk by chunk, never [N, V]);
- fused_skip_<backend>: the same with masked_outputs="zero" (no logits formed for a masked row; logprob and entropy
  0 there);
- fused_logits_<backend>: logits = hidden @ weight.T, then fused_is.policy_loss(..., inplace=True);
- liger: Liger-Kernel's LigerFusedLinearGRPOLoss, token level, loss_type="dapo" (token mean), beta=0, the
  truncated IS weight passed as vllm_is_ratio, the mask as its attention_mask (LIGER_SETTINGS; torch.compile of its
  loss math on GPU only);
- trl_chunked: TRL's ChunkedLogProbFunction (the chunked lm-head logprob path behind add_fused_lm_head) on the
  unmasked rows alone (hidden[mask], as add_fused_lm_head compacts them on Triton devices), the logprobs scattered
  back, then the loss from those logprobs in eager torch (TRL_SETTINGS).

Per provider and size: median time over reps (CUDA events on GPU, perf_counter on CPU; warm-up excluded), peak
memory added over the inputs (CUDA max_memory_allocated; on CPU the peak RSS of a fresh subprocess per
measurement unless in_process), and the relative error of the loss, grad_hidden and grad_weight against the
float64 reference (fused_is's backend="reference" on float64 logits) on a small problem with the same D and V.
Outputs in args.out (default bench/results/local/<machine>, gitignored): linear.jsonl (one record per line, written
as taken; the first line is the environment), linear.md (markdown table of every field, settings, skipped
providers) and linear.png when matplotlib is there; the printed table fits 100 columns.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

import torch

from fused_is.config import LOG_WEIGHT_CLAMP, LossConfig

from .common import (DTYPES, ERROR_ROWS, LIGER_PIN, TRL_PIN, ArgumentParser, Measurements, bar_plot, choose_providers,
                     default_out_dir, environment, fixed_width, fmt_ms, fmt_num, fmt_spread, non_negative_int,
                     positive_int, time_steps, versions, vocab_size, worker_record, wrote)

CONFIG = "ppo_tis"
# tokens per sequence (Liger takes [B, T] and one advantage per sequence); gcd(N, SEQ_LEN) when N is not a multiple;
# --seq-len sets it (long packed sequences: cu_seqlens of N / L sequences)
SEQ_LEN = 256
# a turn of a packed agentic sequence: a masked span (prompt, tool output) then an unmasked one (the model's reply)
TURN_TOKENS = 256
LOGIT_STD = 2.0  # hidden ~ N(0, 1), weight ~ N(0, (2 / sqrt(D))^2): logits of std 2, as in benchmarks.main
FUSED_BACKENDS = {"cpu": ("cpu", "torch"), "cuda": ("triton", "cuda")}
# every provider name --providers takes with --linear (those that cannot run here are skipped with the reason)
LINEAR_PROVIDERS = (("eager",) + tuple(f"fused_{kind}_{b}" for kind in ("linear", "skip", "logits")
                                      for b in ("cpu", "torch", "triton", "cuda")) + ("liger", "trl_chunked"))
# Liger-Kernel's GRPO loss set to ppo_tis. chunk_size is in sequences: about 2048 tokens per chunk, Liger's own row
# tile (512, 2048 or 4096 tokens timed alike on the CPU). compiled (torch.compile of its loss math) on GPU only: on
# the CPU it works but inductor's C++ build costs ~13 s per shape in every measurement subprocess.
LIGER_SETTINGS = dict(beta=0.0, use_ref_model=False, epsilon_low=0.2, epsilon_high=0.2, loss_type="dapo",
                      importance_sampling_level="token", temperature=1.0, delta=None, use_bias_correction_kl=False)
LIGER_NOTES = ("advantages are per sequence ([B]); vllm_is_ratio = min(exp(clamp(old - sampler, -20, 20)), 2) "
               "precomputed per token inside the timed step (fused_is forms it in the kernel); loss_type='dapo' "
               "divides by the token count (= fused_is token-mean, one process); no log-ratio clamp in either")
TRL_CHUNK_SIZE = 32768  # trl.trainer.utils._CHUNKED_LOGPROB_CHUNK_SIZE (vocabulary tile)
TRL_SETTINGS = dict(chunk_size=TRL_CHUNK_SIZE, outputs=("log_probs", "entropy"), temperature=1.0, compact=True,
                    notes="trl.kernels.ChunkedLogProbFunction as GRPOTrainer's add_fused_lm_head calls it (log_probs "
                          "and entropy) on the unmasked rows alone (hidden[mask], the compaction add_fused_lm_head "
                          "does on Triton devices; on others it scores every row), scattered back to [N]; the "
                          "ppo_tis loss on the [N] logprobs in eager torch")
CPU_SIZES = dict(sizes=[1024, 4096], hidden_dim=1024, vocab=32000)
GPU_SIZES = dict(sizes=[1024, 4096, 16384], hidden_dim=4096, vocab=151936)


def default_linear_sizes(device: str) -> dict:
    """dict(sizes=[N...], hidden_dim=D, vocab=V) for `device`. GPU: N 1k/4k/16k, D 4096, V 151936 (Qwen-sized head).
    CPU (2 cores in mind): N 1k/4k, D 1024, V 32000: the Qwen vocabulary would cost 10-40 s per step per provider
    there (6 N D V flops at ~150 GFLOP/s fp32), which the full grid (7 providers, warm-up and reps) cannot afford."""
    chosen = GPU_SIZES if device == "cuda" else CPU_SIZES
    return dict(chosen, sizes=list(chosen["sizes"]))


def _config() -> LossConfig:
    """The preset, checked to be what the eager formula, Liger and TRL below write out."""
    cfg = LossConfig.preset(CONFIG)
    expected = dict(policy="ppo", ratio_ref="old", ratio_level="token", dual_clip=None, log_ratio_clamp=None,
                    is_level="token", is_mode="truncate", is_floor=None, temperature=1.0, entropy_coef=0.0,
                    kl_coef=0.0, loss_agg="token-mean")
    wrong = {k: getattr(cfg, k) for k, v in expected.items() if getattr(cfg, k) != v}
    if wrong:
        raise RuntimeError(f"fused_is.benchmarks.linear writes {CONFIG} out as {expected}; the preset now has {wrong}")
    return cfg


def seq_len_for(n: int, seq_len: int = 0) -> int:
    """Tokens per sequence at N: seq_len (which must divide N) when given, else gcd(N, SEQ_LEN)."""
    if seq_len:
        if n % seq_len:
            raise ValueError(f"--seq-len {seq_len} must divide N={n}")
        return seq_len
    return math.gcd(n, SEQ_LEN)


def agentic_mask(n: int, seq_len: int, masked: float, device="cpu") -> torch.Tensor:
    """bool [N], True = a token of the loss: each sequence of seq_len tokens is turns of min(TURN_TOKENS, seq_len)
    tokens, each turn a masked span of round(masked * turn) tokens (the prompt or a tool's output) followed by the
    unmasked rest (the model's reply). Contiguous spans, as a packed multi-turn rollout has them, not random rows;
    the share of masked rows is `masked` up to the rounding of one turn."""
    if not 0 <= masked < 1:
        raise ValueError(f"the share of masked rows must be in [0, 1); got {masked}")
    turn = min(TURN_TOKENS, seq_len)
    position = torch.arange(n, device=device) % seq_len % turn
    return position >= round(masked * turn)


def liger_settings(device: str) -> dict:
    """Constructor arguments of LigerFusedLinearGRPOLoss (chunk_size set per problem in _liger_loss)."""
    cfg = _config()
    return dict(LIGER_SETTINGS, epsilon_low=cfg.clip_low, epsilon_high=cfg.clip_high, compiled=device == "cuda")


# ----------------------------------------------------------------------------------------------------
# providers


def linear_providers_here(device: str) -> Dict[str, Optional[str]]:
    """provider -> None when it can run on `device`, else the reason it cannot."""
    import importlib.util
    import inspect

    import fused_is
    from fused_is import backends

    probe = torch.empty(1, 2, device=device)
    out: Dict[str, Optional[str]] = {"eager": None}
    linear_missing = None if hasattr(fused_is, "linear_policy_loss") else \
        "fused_is.linear_policy_loss is not in this version of fused_is"
    for name in FUSED_BACKENDS[device]:
        out[f"fused_linear_{name}"] = linear_missing or backends.unavailable_reason(name, probe)
    for name in FUSED_BACKENDS[device]:
        skip_missing = None if "masked_outputs" in inspect.signature(fused_is.linear_policy_loss).parameters else \
            "this version of fused_is.linear_policy_loss has no masked_outputs="
        out[f"fused_skip_{name}"] = linear_missing or skip_missing or backends.unavailable_reason(name, probe)
    for name in FUSED_BACKENDS[device]:
        out[f"fused_logits_{name}"] = backends.unavailable_reason(name, probe)
    if importlib.util.find_spec("liger_kernel") is None:
        out["liger"] = (f"liger-kernel is not installed (pip install {LIGER_PIN}; scripts/dev.sh bench installs it "
                        "when liger is a provider of the run)")
    else:
        try:
            from liger_kernel.chunked_loss.grpo_loss import LigerFusedLinearGRPOLoss  # noqa: F401

            out["liger"] = None
        except Exception as exc:  # ImportError, or a Triton-only import failing on this machine
            out["liger"] = f"liger-kernel's LigerFusedLinearGRPOLoss does not import: {type(exc).__name__}: {exc}"
    if importlib.util.find_spec("trl") is None:
        out["trl_chunked"] = (f"trl is not installed (pip install {TRL_PIN}; scripts/dev.sh bench installs it when "
                              "--providers names trl_chunked)")
    else:
        try:
            from trl.kernels import ChunkedLogProbFunction  # noqa: F401
            import trl.trainer.utils  # noqa: F401  (its backward imports this module: accelerate, datasets, pandas)

            out["trl_chunked"] = None
        except Exception as exc:
            out["trl_chunked"] = (f"TRL's chunked lm-head logprobs (trl.kernels.ChunkedLogProbFunction) do not "
                                  f"import: {type(exc).__name__}: {exc}")
    return out


def make_linear_problem(n: int, hidden_dim: int, vocab: int, dtype: torch.dtype, device: str, seed: int = 0,
                        masked: float = 0.0, seq_len: int = 0) -> dict:
    """hidden [N, D], weight [V, D] (built block by block, so the CPU memory baseline holds no fp32 copy), tokens
    sampled from the model's own softmax (RL samples from the policy), old = lp + noise, sampler = old + noise (both
    folded to <= 0), advantages one per sequence of seq_len_for(N, seq_len) tokens, broadcast to tokens, cu_seqlens of
    those sequences, and mask = agentic_mask(N, that length, masked)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    hidden = torch.randn(n, hidden_dim, generator=gen, device=device).to(dtype)
    weight = torch.empty(vocab, hidden_dim, dtype=dtype, device=device)
    step = max(1, (1 << 22) // hidden_dim)
    for start in range(0, vocab, step):
        block = torch.randn(min(step, vocab - start), hidden_dim, generator=gen, device=device)
        weight[start:start + step] = (block * (LOGIT_STD / math.sqrt(hidden_dim))).to(dtype)
        del block
    tokens = torch.empty(n, dtype=torch.long, device=device)
    lp = torch.empty(n, device=device)
    rows = max(1, (1 << 24) // vocab)
    with torch.no_grad():
        for start in range(0, n, rows):
            logits = (hidden[start:start + rows] @ weight.T).float()
            gumbel = -torch.log(-torch.log(torch.rand(logits.shape, generator=gen, device=device).clamp_(1e-20, 1)))
            tok = (logits + gumbel).argmax(-1)
            del gumbel
            tokens[start:start + rows] = tok
            lp[start:start + rows] = torch.log_softmax(logits, -1).gather(1, tok[:, None]).squeeze(1)
            del logits
    old = -(lp + 0.15 * torch.randn(n, generator=gen, device=device)).abs()
    samp = -(old + 0.5 * torch.randn(n, generator=gen, device=device)).abs()
    seq_len = seq_len_for(n, seq_len)
    seq_adv = torch.randn(n // seq_len, generator=gen, device=device)
    cu_seqlens = torch.arange(0, n + 1, seq_len, device=device)
    return dict(hidden=hidden, weight=weight, tokens=tokens, advantages=seq_adv.repeat_interleave(seq_len),
                seq_advantages=seq_adv, seq_len=seq_len, cu_seqlens=cu_seqlens, sampler_logprobs=samp,
                old_logprobs=old, mask=agentic_mask(n, seq_len, masked, device), masked=masked)


def ppo_tis_from_logprobs(lp: torch.Tensor, p: dict) -> torch.Tensor:
    """The ppo_tis loss (DESIGN.md section 2) from learner logprobs [N] (fp32, with grad), written as trainers do:
    the mean over the unmasked tokens (p["mask"])."""
    cfg = _config()
    adv, old, samp = p["advantages"], p["old_logprobs"], p["sampler_logprobs"]
    ratio = torch.exp(lp - old)
    surrogate = torch.minimum(ratio * adv, torch.clamp(ratio, 1 - cfg.clip_low, 1 + cfg.clip_high) * adv)
    weight = torch.exp(torch.clamp(old - samp, -LOG_WEIGHT_CLAMP, LOG_WEIGHT_CLAMP)).clamp(max=cfg.is_cap)
    mask = p["mask"]
    return torch.where(mask, -weight * surrogate, 0.0).sum() / mask.sum().clamp(min=1)


def _eager_loss(hidden, weight, p):
    logits = hidden @ weight.T
    lp = torch.log_softmax(logits.float(), dim=-1).gather(1, p["tokens"].unsqueeze(1)).squeeze(1)
    return ppo_tis_from_logprobs(lp, p)


def _reference_loss(hidden, weight, p):
    """float64 oracle: fused_is's reference backend (section 2 written independently) on hidden @ weight.T."""
    from fused_is import policy_loss

    return policy_loss(hidden @ weight.T, p["tokens"], p["advantages"], sampler_logprobs=p["sampler_logprobs"],
                       old_logprobs=p["old_logprobs"], mask=p["mask"], cu_seqlens=p["cu_seqlens"], config=CONFIG,
                       backend="reference").loss


_LIGER: Dict[tuple, object] = {}


def _liger_loss(hidden, weight, p):
    from liger_kernel.chunked_loss.grpo_loss import LigerFusedLinearGRPOLoss

    n, d = hidden.shape
    t = p["seq_len"]
    b = n // t
    chunk = max(1, 2048 // t)
    key = (hidden.device.type, chunk)
    if key not in _LIGER:  # one module (one torch.compile cache) per device and chunk size
        _LIGER[key] = LigerFusedLinearGRPOLoss(chunk_size=chunk, **liger_settings(hidden.device.type))
    cfg = _config()
    is_ratio = torch.exp(torch.clamp(p["old_logprobs"] - p["sampler_logprobs"], -LOG_WEIGHT_CLAMP,
                                     LOG_WEIGHT_CLAMP)).clamp(max=cfg.is_cap)
    mask = p["mask"].view(b, t).long()  # its attention_mask: the loss's tokens (dapo divides by their count)
    loss, _metrics = _LIGER[key](hidden.view(b, t, d), weight, p["tokens"].view(b, t), mask, p["seq_advantages"],
                                 old_per_token_logps=p["old_logprobs"].view(b, t), vllm_is_ratio=is_ratio.view(b, t))
    return loss


def _trl_loss(hidden, weight, p):
    from trl.kernels import ChunkedLogProbFunction

    mask = p["mask"]  # the unmasked rows alone, as add_fused_lm_head compacts them (hidden_states[mask])
    lp, _entropy, *_ = ChunkedLogProbFunction.apply(hidden[mask], weight, None, p["tokens"][mask],
                                                    TRL_SETTINGS["temperature"], TRL_SETTINGS["chunk_size"], None, 1.0,
                                                    TRL_SETTINGS["outputs"])
    return ppo_tis_from_logprobs(lp.new_zeros(mask.shape).masked_scatter(mask, lp), p)


def provider_loss(provider: str, hidden: torch.Tensor, weight: torch.Tensor, p: dict) -> torch.Tensor:
    """The loss of one provider, differentiable w.r.t. hidden and weight."""
    import fused_is

    kwargs = dict(sampler_logprobs=p["sampler_logprobs"], old_logprobs=p["old_logprobs"], mask=p["mask"],
                  cu_seqlens=p["cu_seqlens"], config=CONFIG)
    if provider == "eager":
        return _eager_loss(hidden, weight, p)
    if provider == "reference":
        return _reference_loss(hidden, weight, p)
    if provider == "liger":
        return _liger_loss(hidden, weight, p)
    if provider == "trl_chunked":
        return _trl_loss(hidden, weight, p)
    if provider.startswith("fused_linear_"):
        return fused_is.linear_policy_loss(hidden, weight, p["tokens"], p["advantages"],
                                           backend=provider[len("fused_linear_"):], **kwargs).loss
    if provider.startswith("fused_skip_"):
        return fused_is.linear_policy_loss(hidden, weight, p["tokens"], p["advantages"], masked_outputs="zero",
                                           backend=provider[len("fused_skip_"):], **kwargs).loss
    if provider.startswith("fused_logits_"):
        return fused_is.policy_loss(hidden @ weight.T, p["tokens"], p["advantages"],
                                    backend=provider[len("fused_logits_"):], inplace=True, **kwargs).loss
    raise ValueError(f"unknown provider {provider!r}")


def run_step(provider: str, hidden: torch.Tensor, weight: torch.Tensor, p: dict) -> torch.Tensor:
    """One forward+backward; the gradients land in hidden.grad and weight.grad (freed by the caller)."""
    loss = provider_loss(provider, hidden, weight, p)
    loss.backward()
    if hidden.grad is None or weight.grad is None:
        raise RuntimeError(f"{provider}: backward left hidden.grad or weight.grad unset")
    return loss


def provider_errors(provider: str, p: dict) -> Dict[str, float]:
    """Relative error of loss, grad_hidden and grad_weight against the float64 reference on the same inputs."""
    from fused_is.testing import rel_err

    hidden, weight = p["hidden"].detach().clone().requires_grad_(), p["weight"].detach().clone().requires_grad_()
    loss = run_step(provider, hidden, weight, p)
    ref_hidden = p["hidden"].detach().double().requires_grad_()
    ref_weight = p["weight"].detach().double().requires_grad_()
    ref = run_step("reference", ref_hidden, ref_weight, p)
    return dict(loss=loss.item(), ref_loss=ref.item(), loss_err=rel_err(loss, ref),
                grad_hidden_err=rel_err(hidden.grad, ref_hidden.grad),
                grad_weight_err=rel_err(weight.grad, ref_weight.grad))


# ----------------------------------------------------------------------------------------------------
# measurement


def measure_linear(provider: str, n: int, hidden_dim: int, vocab: int, dtype: str, device: str, reps: int,
                   warmup: int, masked: float = 0.0, seq_len: int = 0) -> dict:
    """Time, peak memory and error of one provider at one size, share of masked rows and sequence length (0: the
    default, seq_len_for), in this process."""
    p = make_linear_problem(n, hidden_dim, vocab, DTYPES[dtype], device, masked=masked, seq_len=seq_len)
    hidden, weight = p["hidden"].requires_grad_(), p["weight"].requires_grad_()
    elem = hidden.element_size()
    record = dict(kind="linear", provider=provider, n=n, hidden_dim=hidden_dim, vocab=vocab, dtype=dtype,
                  device=device, seq_len=p["seq_len"], masked=masked, unmasked_rows=int(p["mask"].sum()),
                  logits_bytes=n * vocab * elem, weight_bytes=weight.numel() * elem,
                  grads_bytes=(hidden.numel() + weight.numel()) * elem)
    if provider == "liger":
        record["settings"] = dict(liger_settings(device), chunk_size=max(1, 2048 // p["seq_len"]))
    elif provider == "trl_chunked":
        record["settings"] = dict(TRL_SETTINGS, outputs=list(TRL_SETTINGS["outputs"]))

    def clear():
        hidden.grad = weight.grad = None

    times, peak = time_steps(lambda: run_step(provider, hidden, weight, p), clear, device, reps, warmup)
    median = statistics.median(times)
    record.update(time_median_s=median, time_min_s=times[0], time_max_s=times[-1], reps=reps,
                  peak_added_bytes=max(0, peak), peak_added_x_logits=max(0, peak) / record["logits_bytes"],
                  tflops=6 * n * hidden_dim * vocab / median / 1e12)
    del p, hidden, weight
    small = make_linear_problem(min(n, ERROR_ROWS), hidden_dim, vocab, DTYPES[dtype], device, seed=1, masked=masked)
    record.update(provider_errors(provider, small))
    return record


def measure_linear_in_subprocess(provider, n, hidden_dim, vocab, dtype, reps, warmup, masked=0.0,
                                 seq_len=0) -> dict:
    """One measurement in a fresh interpreter (CPU peak RSS is per process), as benchmarks.main's."""
    return worker_record("fused_is.benchmarks.linear",
                         [provider, n, hidden_dim, vocab, dtype, reps, warmup, masked, seq_len],
                         dict(kind="linear", provider=provider, n=n, hidden_dim=hidden_dim, vocab=vocab,
                              dtype=dtype, device="cpu", masked=masked))


def _one(provider, n, vocab, masked, args, device) -> dict:
    seq_len = getattr(args, "seq_len", 0) or 0
    if device == "cpu" and not args.in_process:
        return measure_linear_in_subprocess(provider, n, args.hidden_dim, vocab, args.dtype, args.reps,
                                            args.warmup, masked, seq_len)
    try:
        return measure_linear(provider, n, args.hidden_dim, vocab, args.dtype, device, args.reps, args.warmup,
                              masked, seq_len)
    except Exception as exc:  # one failing provider must not hide the others' numbers
        return dict(kind="linear", provider=provider, n=n, hidden_dim=args.hidden_dim, vocab=vocab,
                    dtype=args.dtype, device=device, masked=masked, error=f"{type(exc).__name__}: {exc}")
    finally:
        if device == "cuda":
            torch.cuda.empty_cache()


# ----------------------------------------------------------------------------------------------------
# reporting

LINEAR_COLUMNS = [("provider", "{}"), ("n", "{}"), ("hidden_dim", "{}"), ("vocab", "{}"), ("dtype", "{}"),
                  ("masked", "{:.2f}"), ("seq_len", "{}"),
                  ("time_median_s", "{:.4f}"), ("spread", "{}"), ("time_x_unmasked", "{:.2f}"), ("tflops", "{:.2f}"),
                  ("speedup_vs_eager", "{:.2f}"),
                  ("x_gemms_plus_loss", "{:.2f}"),
                  ("peak_added_mib", "{:.0f}"), ("peak_added_x_logits", "{:.2f}"), ("loss_err", "{:.1e}"),
                  ("grad_hidden_err", "{:.1e}"), ("grad_weight_err", "{:.1e}")]


def format_linear_table(records: List[dict]) -> str:
    """Markdown table of the measurements (a failed one shows its error)."""
    names = [name for name, _ in LINEAR_COLUMNS]
    rows = ["| " + " | ".join(names) + " |", "|" + "---|" * len(names)]
    for r in records:
        if "error" in r:
            cells = [r["provider"], str(r["n"]), str(r["hidden_dim"]), str(r["vocab"]), r["dtype"],
                     f"{r.get('masked', 0.0):.2f}", "-", "failed: " + r["error"][:100].replace("|", "/")]
            cells += [""] * (len(names) - len(cells))
        else:
            r = dict(r, spread=f"{r['time_min_s']:.4f}-{r['time_max_s']:.4f}",
                     peak_added_mib=r["peak_added_bytes"] / 2**20)
            cells = [fmt.format(r[name]) if r.get(name) is not None else "-" for name, fmt in LINEAR_COLUMNS]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def _case(r: dict) -> tuple:
    """The problem a record measured: (N, D, V, dtype, share of masked rows, tokens per sequence)."""
    return r["n"], r["hidden_dim"], r["vocab"], r["dtype"], r.get("masked", 0.0), r.get("seq_len")


def _add_speedups(records: List[dict]) -> None:
    """speedup_vs_eager; for fused_linear_<backend>, x_gemms_plus_loss: its time over fused_logits_<backend>'s on the
    same problem (the three lm-head GEMMs plus the fused loss on materialised logits: the fused-linear issue's GPU
    target is <= 1.10); and time_x_unmasked: the time over the same provider's with no masked rows at the same size
    (time in proportion to the unmasked rows would make it 1 - masked)."""
    ok = [r for r in records if "error" not in r]
    for r in ok:
        eager = [e for e in ok if e["provider"] == "eager" and _case(e) == _case(r)]
        if eager:
            r["speedup_vs_eager"] = eager[0]["time_median_s"] / r["time_median_s"]
        if r["provider"].startswith("fused_linear_"):
            twin = r["provider"].replace("fused_linear_", "fused_logits_")
            base = [e for e in ok if e["provider"] == twin and _case(e) == _case(r)]
            if base:
                r["x_gemms_plus_loss"] = r["time_median_s"] / base[0]["time_median_s"]
        unmasked = [e for e in ok if e["provider"] == r["provider"] and e.get("masked", 0.0) == 0.0
                    and _case(e)[:4] + _case(e)[5:] == _case(r)[:4] + _case(r)[5:]]
        if unmasked:
            r["time_x_unmasked"] = r["time_median_s"] / unmasked[0]["time_median_s"]


def format_linear_console(records: List[dict]) -> str:
    """The table printed at the end of a run, in at most 100 columns: one block per N; err is the largest of the
    loss, grad_hidden and grad_weight errors (each is in linear.md and linear.jsonl)."""
    header = ["provider", "ms", "min-max ms", "x 0% masked", "x eager", "x logits", "mem/logits", "max err"]
    rows: list = []
    sizes: Dict[tuple, List[dict]] = {}
    for r in records:
        sizes.setdefault(_case(r), []).append(r)
    for (n, d, v, dtype, masked, seq_len), recs in sizes.items():
        rows.append(f"N={n} D={d} V={v} {dtype}, {masked:.0%} masked" + (f", L={seq_len}" if seq_len else ""))
        for r in recs:
            if "error" in r:
                rows.append([r["provider"], "failed: " + r["error"]])
                continue
            opt = lambda key: f"{r[key]:.2f}" if r.get(key) is not None else "-"  # noqa: E731
            err = max(r["loss_err"], r["grad_hidden_err"], r["grad_weight_err"])
            rows.append([r["provider"], fmt_ms(r["time_median_s"]), fmt_spread(r), opt("time_x_unmasked"),
                         opt("speedup_vs_eager"), opt("x_gemms_plus_loss"), fmt_num(r["peak_added_x_logits"]),
                         f"{err:.1e}"])
    return "\n".join(fixed_width(header, rows))


def write_linear_outputs(records: List[dict], env: dict, out_dir: Path, plot: bool = True) -> List[Path]:
    """linear.jsonl (rewritten whole: environment line, then every record), linear.md and linear.png."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / "linear.jsonl", out_dir / "linear.md"]
    with paths[0].open("w") as f:
        f.write(json.dumps(dict(kind="environment", **env)) + "\n")
        for r in records:
            f.write(json.dumps(r) + "\n")
    skipped = "\n".join(f"- {k}: {v}" for k, v in env.get("providers_skipped", {}).items()) or "- none"
    paths[1].write_text(
        f"# fused_is linear policy loss ({CONFIG}) on {env.get('gpu', env['machine'])}\n\n"
        f"torch {env['torch']}, {env['device']}, {env.get('threads')} threads, git {env.get('git')}, {env['date']}; "
        f"timing: {env['timing']}; reps {env['reps']}, warm-up {env['warmup']}"
        f"{'; INTERRUPTED: ' + env['interrupted'] if env.get('interrupted') else ''}\n\n"
        f"{format_linear_table(records)}\n\n"
        "tflops: 6 N D V (the three lm-head GEMMs of every row) per median time; masked: the share of masked rows "
        f"(spans of turns of {TURN_TOKENS} tokens: agentic_mask); time_x_unmasked: the time over the same provider's "
        "at 0% masked (1 - masked if time fell in proportion to the unmasked rows); peak_added: memory over the "
        "inputs, the grads of hidden and weight included (grads_bytes in linear.jsonl); errors: max-abs relative to "
        f"the float64 reference on {ERROR_ROWS} rows.\n\n"
        f"## Settings\n\n- liger: {json.dumps(env.get('liger_settings'))}; {LIGER_NOTES}\n"
        f"- trl_chunked: {json.dumps(env.get('trl_settings'))}\n- versions: {json.dumps(env.get('versions'))}\n\n"
        f"## Skipped providers\n\n{skipped}\n")
    if plot:
        try:
            title = (f"fused_is linear policy loss ({CONFIG}) on {env.get('gpu', env['machine'])}, "
                     f"torch {env['torch']}")
            paths.append(bar_plot(records, title, out_dir / "linear.png", group=_case,
                                  group_label=lambda g: f"N={g[0]} D={g[1]}\nV={g[2]} {g[3]}"
                                  + (f"\n{g[4]:.0%} masked" if g[4] else "")))
            if len({r.get("masked", 0.0) for r in records if "error" not in r}) > 1:
                paths.append(masked_plot(records, title, out_dir / "linear_masked.png"))
        except ImportError as exc:
            print(f"(no plot: {exc})")
    return paths


def masked_plot(records: List[dict], title: str, path: Path) -> Path:
    """linear_masked.png: per problem (N, D, V, dtype, L) one panel of forward+backward time against the share of
    masked rows, a line per provider, beside one of the time over the provider's own at 0% masked with the line of
    time in proportion to the unmasked rows (1 - masked)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in records if "error" not in r]
    problems = sorted({_case(r)[:4] + _case(r)[5:] for r in ok}, key=str)
    fig, axes = plt.subplots(len(problems), 2, figsize=(11, 4 * len(problems)), squeeze=False)
    for row, problem in zip(axes, problems):
        here = [r for r in ok if _case(r)[:4] + _case(r)[5:] == problem]
        shares = sorted({r.get("masked", 0.0) for r in here})
        for provider in sorted({r["provider"] for r in here}):
            mine = sorted((r for r in here if r["provider"] == provider), key=lambda r: r.get("masked", 0.0))
            xs = [100 * r.get("masked", 0.0) for r in mine]
            row[0].plot(xs, [r["time_median_s"] for r in mine], marker="o", label=provider)
            relative = [(x, r["time_x_unmasked"]) for x, r in zip(xs, mine) if r.get("time_x_unmasked") is not None]
            if relative:
                row[1].plot(*zip(*relative), marker="o", label=provider)
        row[1].plot([100 * m for m in shares], [1 - m for m in shares], "k--", linewidth=1,
                    label="in proportion to unmasked rows")
        n, d, v, dtype, seq_len = problem
        for ax, ylabel in zip(row, ("forward+backward time (s, median)", "time / time at 0% masked")):
            ax.set_title(f"N={n} D={d} V={v} {dtype}, sequences of {seq_len}", fontsize=9)
            ax.set_xlabel("masked rows (%)")
            ax.set_ylabel(ylabel, fontsize=8)
            ax.set_ylim(bottom=0)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def run_linear(args: argparse.Namespace) -> int:
    """The --linear benchmark. args: sizes, hidden_dim, vocab (one int or a list), dtype, device, reps, warmup, out,
    providers, in_process (no_plot, masked: shares of masked rows, seq_len: tokens per sequence, optional). Returns 1
    if a measurement failed or the run was interrupted, else 0; an unknown provider, or none that can run here, is a
    SystemExit before anything is measured."""
    device = args.device
    vocabs = args.vocab if isinstance(args.vocab, (list, tuple)) else [args.vocab]
    shares = list(getattr(args, "masked", None) or [0.0])
    seq_len = getattr(args, "seq_len", 0) or 0
    for m in shares:
        if not 0 <= m < 1:
            raise SystemExit(f"fused-is bench --linear: --masked takes shares of masked rows in [0, 1); got {m}")
    if seq_len and any(n % seq_len for n in args.sizes):
        raise SystemExit(f"fused-is bench --linear: --seq-len {seq_len} must divide every --n")
    off_device = (f"the fused-linear bench times the backends {', '.join(FUSED_BACKENDS[device])} on {device} "
                  f"(this one on {'cpu' if device == 'cuda' else 'cuda'})")
    # by default fused_skip_* only where some rows are masked (with none it is fused_linear_*)
    chosen, skipped = choose_providers("--providers (--linear)", args.providers, LINEAR_PROVIDERS,
                                       linear_providers_here(device), off_device,
                                       lambda p: any(shares) or not p.startswith("fused_skip_"))
    for p, why in skipped.items():
        print(f"skip {p}: {why}")
    grid = [(p, n, v, m) for v in vocabs for n in args.sizes for m in shares for p in chosen if p not in skipped]
    if not grid:
        raise SystemExit("fused-is bench --linear: nothing to measure here: "
                         + "; ".join(f"{p}: {why}" for p, why in skipped.items()))
    env = environment(device)
    timing = "CUDA events around forward+backward" if device == "cuda" else "perf_counter around forward+backward"
    env.update(reps=args.reps, warmup=args.warmup, timing=timing, config=CONFIG, masked=shares,
               turn_tokens=TURN_TOKENS, seq_len=seq_len or f"gcd(N, {SEQ_LEN})",
               versions=versions(("liger-kernel", "trl", "triton")),
               liger_settings=liger_settings(device), liger_notes=LIGER_NOTES,
               trl_settings=dict(TRL_SETTINGS, outputs=list(TRL_SETTINGS["outputs"])),
               memory=("max_memory_allocated minus the baseline" if device == "cuda" else
                       "peak RSS minus the baseline" + (" (in process)" if args.in_process else
                                                       ", one subprocess per measurement")),
               providers_skipped=skipped)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    # every record as it is taken (a timeout keeps them); the environment first
    with Measurements(out_dir / "linear.jsonl", len(grid), mode="w") as m:
        m.emit(dict(kind="environment", **env))
        for i, (provider, n, vocab, masked) in enumerate(grid):
            t0 = time.perf_counter()
            record = m.add(_one(provider, n, vocab, masked, args, device))
            status = record.get("error") or f"{record['time_median_s']:.4f} s"
            print(f"[{i + 1}/{len(grid)}] {provider} N={n} V={vocab} {masked:.0%} masked: {status} "
                  f"({time.perf_counter() - t0:.0f} s)", file=sys.stderr)
    records, interrupted = m.records, m.interrupted
    env["interrupted"] = interrupted
    _add_speedups(records)
    print(f"\nfused_is linear bench on {env.get('gpu', env['machine'])} ({device}), torch {env['torch']}, "
          f"config {CONFIG}")
    print(format_linear_console(records))
    paths = write_linear_outputs(records, env, out_dir, plot=not getattr(args, "no_plot", False))
    print(wrote(paths))
    return 1 if interrupted or any("error" in r for r in records) else 0


def run_from_bench(args: argparse.Namespace, device: str) -> int:
    """`fused-is bench --linear`: the command line's --n, --vocab (one or more), --hidden-dim, --dtypes (the first,
    when given; else bf16), --masked, --seq-len, --reps, --warmup, --out, --providers, --in-process and --no-plot,
    this device's defaults (default_linear_sizes) for what it leaves out."""
    default = default_linear_sizes(device)
    # one dtype per run (its outputs are linear.jsonl/.md/.png): the first of --dtypes when given, else bf16
    dtype = args.dtypes[0] if args.dtypes != ["bf16", "fp32"] else "bf16"
    return run_linear(argparse.Namespace(
        sizes=args.n or default["sizes"], hidden_dim=args.hidden_dim or default["hidden_dim"],
        vocab=list(args.vocab) if args.vocab else [default["vocab"]], dtype=dtype, device=device,
        masked=getattr(args, "masked", None) or [0.0], seq_len=getattr(args, "seq_len", 0) or 0,
        reps=args.reps or (3 if device == "cpu" else 10), warmup=args.warmup,
        out=args.out or default_out_dir(device), providers=args.providers,
        in_process=args.in_process, no_plot=args.no_plot))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`python -m fused_is.benchmarks.linear`'s arguments: those of `fused-is bench --linear`, same names."""
    parser.add_argument("--n", type=positive_int, nargs="+", help="token counts N")
    parser.add_argument("--hidden-dim", type=positive_int, help="the hidden size D (default 1024 on CPU, 4096 on GPU)")
    parser.add_argument("--vocab", type=vocab_size, nargs="+", help="vocabulary sizes V (default 32000 on CPU, "
                        "151936 on GPU)")
    add_masked_arguments(parser)
    parser.add_argument("--dtypes", nargs=1, default=["bf16", "fp32"], choices=sorted(DTYPES),
                        help="the dtype (default bf16)")
    parser.add_argument("--providers", nargs="+", help=f"subset of {', '.join(LINEAR_PROVIDERS)}")
    parser.add_argument("--reps", type=positive_int, help="timed repetitions per measurement")
    parser.add_argument("--warmup", type=non_negative_int, default=1)
    parser.add_argument("--out", type=Path, help="output folder (default bench/results/local/<machine>)")
    parser.add_argument("--no-plot", action="store_true")
    parser.add_argument("--in-process", action="store_true", help="on CPU, measure in this process (fast; peak "
                        "memory then less exact) instead of one subprocess per measurement")


def share(text: str) -> float:
    """A share of masked rows: a fraction in [0, 1) (0.75) or a percentage (75%)."""
    try:
        value = float(text[:-1]) / 100 if text.endswith("%") else float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a share of masked rows in [0, 1) or a percentage; got {text!r}")
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"the share of masked rows must be in [0, 1) (0% to under 100%); got {text}")
    return value


def add_masked_arguments(parser: argparse.ArgumentParser, seq_len: bool = True) -> None:
    """--masked (and --seq-len), the fused-linear bench's dimensions beyond the size."""
    parser.add_argument("--masked", type=share, nargs="+", metavar="SHARE",
                        help="--linear: shares of masked rows, each a fraction or a percentage (e.g. 0 0.5 0.75 0.9): "
                        f"spans of turns of {TURN_TOKENS} tokens as prompt and tool output make them in a packed "
                        "agentic sequence, the same rows for every provider (default 0)")
    if seq_len:
        parser.add_argument("--seq-len", type=non_negative_int, default=0, metavar="L",
                            help=f"tokens per packed sequence (cu_seqlens; one advantage each); must divide every "
                            f"--n (default: gcd(N, {SEQ_LEN}))")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "_worker":  # one measurement in a fresh process (CPU memory)
        provider, n, hidden_dim, vocab, dtype, reps, warmup, masked, seq_len = argv[1:10]
        torch.manual_seed(0)
        print(json.dumps(measure_linear(provider, int(n), int(hidden_dim), int(vocab), dtype, "cpu", int(reps),
                                        int(warmup), float(masked), int(seq_len))))
        return 0
    parser = ArgumentParser(prog="python -m fused_is.benchmarks.linear", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run_from_bench(parser.parse_args(argv), "cuda" if torch.cuda.is_available() else "cpu")


if __name__ == "__main__":
    sys.exit(main())
