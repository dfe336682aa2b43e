"""A small RL task with a verifiable reward, a tiny transformer policy and the sampler numerics of the seed.

Task: sort 8 digits. Prompt = 8 digits then SEP; the response is 8 digits; reward 1 when the response is
the sorted prompt, else 0. The policy is a 2-layer decoder-only transformer (d = 64, 4 heads), trained
briefly by supervision so that its sampled accuracy leaves room for RL.

Numerics: the learner runs the model in fp32 with a full forward over the sequence. The sampler runs the
same weights token by token with a KV cache, under one of NUMERICS:
    fp32             incremental decoding vs full forward (the control)
    bf16             weights and activations in bf16, bf16 head
    bf16_fp32_head   bf16 body, lm_head in fp32 (what fused_is.vllm does for vLLM)
    int8             per-output-channel symmetric int8 weights (fp32 activations)
    fp8              e4m3 weights (per channel) and activations (per tensor), emulated with torch's float8
    int4             per-output-channel symmetric int4 weights, group size 32
"""

from __future__ import annotations

import csv
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Optional, Tuple

import torch
import torch.nn.functional as F

DIGITS, SEP = 10, 10
VOCAB = 11
N_DIGITS = 8
PROMPT_LEN = N_DIGITS + 1
SEQ_LEN = PROMPT_LEN + N_DIGITS
NUMERICS = ("fp32", "bf16", "bf16_fp32_head", "int8", "fp8", "int4")

Params = Dict[str, torch.Tensor]


@dataclass(frozen=True)
class ModelConfig:
    d: int = 64
    heads: int = 4
    layers: int = 2
    vocab: int = VOCAB
    max_len: int = SEQ_LEN


def init_params(cfg: ModelConfig, seed: int = 0) -> Params:
    gen = torch.Generator().manual_seed(seed)

    def w(*shape, scale=0.02):
        return torch.randn(*shape, generator=gen) * scale

    p = {"tok": w(cfg.vocab, cfg.d), "pos": w(cfg.max_len, cfg.d), "lnf_w": torch.ones(cfg.d),
         "lnf_b": torch.zeros(cfg.d), "head": w(cfg.vocab, cfg.d)}
    for i in range(cfg.layers):
        p.update({f"{i}.ln1_w": torch.ones(cfg.d), f"{i}.ln1_b": torch.zeros(cfg.d),
                  f"{i}.qkv": w(3 * cfg.d, cfg.d), f"{i}.proj": w(cfg.d, cfg.d, scale=0.02 / math.sqrt(2 * cfg.layers)),
                  f"{i}.ln2_w": torch.ones(cfg.d), f"{i}.ln2_b": torch.zeros(cfg.d),
                  f"{i}.fc": w(4 * cfg.d, cfg.d), f"{i}.out": w(cfg.d, 4 * cfg.d, scale=0.02 / math.sqrt(2 * cfg.layers))})
    return p


LINEAR_WEIGHTS = ("qkv", "proj", "fc", "out")


def _fake_fp8(x: torch.Tensor, dim: Optional[int] = None) -> torch.Tensor:
    """Round to float8 e4m3 with a scale (per row along dim, or per tensor) and back to x's dtype."""
    amax = x.abs().amax(dim=dim, keepdim=dim is not None) if dim is not None else x.abs().max()
    scale = (amax / 448.0).clamp(min=1e-12)
    return ((x / scale).to(torch.float8_e4m3fn).to(x.dtype)) * scale


def _fake_int(w: torch.Tensor, bits: int, group: Optional[int] = None) -> torch.Tensor:
    """Symmetric per-output-channel (or per group of `group` inputs) integer quantization, dequantized."""
    qmax = 2 ** (bits - 1) - 1
    shape = w.shape
    x = w.reshape(shape[0], -1, group) if group else w.reshape(shape[0], 1, -1)
    scale = (x.abs().amax(dim=-1, keepdim=True) / qmax).clamp(min=1e-12)
    return (torch.clamp(torch.round(x / scale), -qmax - 1, qmax) * scale).reshape(shape)


def sampler_params(params: Params, numerics: str) -> Params:
    """The sampler's copy of the learner's weights under `numerics` (no gradient)."""
    if numerics not in NUMERICS:
        raise ValueError(f"numerics must be one of {NUMERICS}; got {numerics!r}")
    out = {k: v.detach().clone() for k, v in params.items()}
    if numerics in ("bf16", "bf16_fp32_head"):
        out = {k: v.to(torch.bfloat16) for k, v in out.items()}
        if numerics == "bf16_fp32_head":
            out["head"] = out["head"]  # the bf16 weight, projected in fp32 (hidden.float() @ W.float().T)
        return out
    for k, v in out.items():
        if k.split(".")[-1] in LINEAR_WEIGHTS or k == "head":
            if numerics == "int8":
                out[k] = _fake_int(v, 8)
            elif numerics == "int4":
                out[k] = _fake_int(v, 4, group=32)
            elif numerics == "fp8":
                out[k] = _fake_fp8(v, dim=1)
    return out


def _layer_norm(x, w, b):
    return F.layer_norm(x, (x.shape[-1],), w.to(x.dtype), b.to(x.dtype), 1e-5)


def forward(params: Params, idx: torch.Tensor, cfg: ModelConfig, numerics: str = "fp32",
            cache: Optional[list] = None, start: int = 0) -> Tuple[torch.Tensor, list]:
    """Logits [B, T, V] (fp32) for tokens idx [B, T] at positions start..start+T-1.

    cache: per-layer (K, V) of the earlier positions for incremental decoding (None: a full forward).
    """
    dtype = torch.bfloat16 if numerics in ("bf16", "bf16_fp32_head") else torch.float32
    act_fp8 = numerics == "fp8"

    def linear(x, w):
        if act_fp8:
            x = _fake_fp8(x)
        return x @ w.to(x.dtype).T

    b, t = idx.shape
    x = (params["tok"][idx] + params["pos"][start:start + t]).to(dtype)
    new_cache = []
    h, hd = cfg.heads, cfg.d // cfg.heads
    for i in range(cfg.layers):
        a = _layer_norm(x, params[f"{i}.ln1_w"], params[f"{i}.ln1_b"])
        q, k, v = linear(a, params[f"{i}.qkv"]).split(cfg.d, dim=-1)
        q, k, v = (z.reshape(b, t, h, hd).transpose(1, 2) for z in (q, k, v))
        if cache is not None and cache[i] is not None:
            k = torch.cat([cache[i][0], k], dim=2)
            v = torch.cat([cache[i][1], v], dim=2)
        new_cache.append((k, v))
        total = k.shape[2]
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(hd)
        causal = torch.ones(t, total, dtype=torch.bool).tril(diagonal=total - t)
        scores = scores.masked_fill(~causal, float("-inf"))
        y = (scores.float().softmax(-1).to(dtype) @ v).transpose(1, 2).reshape(b, t, cfg.d)
        x = x + linear(y, params[f"{i}.proj"])
        a = _layer_norm(x, params[f"{i}.ln2_w"], params[f"{i}.ln2_b"])
        x = x + linear(F.gelu(linear(a, params[f"{i}.fc"])), params[f"{i}.out"])
    x = _layer_norm(x, params["lnf_w"], params["lnf_b"])
    if numerics == "bf16_fp32_head":
        logits = x.float() @ params["head"].float().T
    else:
        logits = linear(x, params["head"]).float()
    return logits, new_cache


def random_prompts(n: int, gen: torch.Generator) -> torch.Tensor:
    digits = torch.randint(0, DIGITS, (n, N_DIGITS), generator=gen)
    return torch.cat([digits, torch.full((n, 1), SEP)], dim=1)


def reward(prompts: torch.Tensor, responses: torch.Tensor) -> torch.Tensor:
    """1.0 where the response is the sorted prompt digits, else 0.0. [B] float."""
    target = prompts[:, :N_DIGITS].sort(dim=1).values
    return (responses == target).all(dim=1).float()


@torch.no_grad()
def sample(params: Params, prompts: torch.Tensor, cfg: ModelConfig, numerics: str, gen: torch.Generator,
           temperature: float = 1.0) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sampler: token-by-token with a KV cache. Returns (responses [B, 8], sampled-token logprobs [B, 8],
    full logprob rows [B, 8, V]), logprobs in fp32 of softmax(logits / temperature)."""
    logits, cache = forward(params, prompts, cfg, numerics)
    last = logits[:, -1]
    tokens, lps, rows = [], [], []
    for step in range(N_DIGITS):
        logp = torch.log_softmax(last.float() / temperature, dim=-1)
        tok = torch.multinomial(logp.exp(), 1, generator=gen).squeeze(1)
        tokens.append(tok)
        lps.append(logp.gather(1, tok[:, None]).squeeze(1))
        rows.append(logp)
        if step + 1 < N_DIGITS:
            logits, cache = forward(params, tok[:, None], cfg, numerics, cache=cache, start=PROMPT_LEN + step)
            last = logits[:, -1]
    return torch.stack(tokens, 1), torch.stack(lps, 1), torch.stack(rows, 1)


def learner_logits(params: Params, prompts: torch.Tensor, responses: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """[B, 8, V] fp32 logits of the response positions from one full forward (differentiable)."""
    seq = torch.cat([prompts, responses], dim=1)
    logits, _ = forward(params, seq[:, :-1], cfg, "fp32")
    return logits[:, PROMPT_LEN - 1:]


def supervised(cfg: ModelConfig, seed: int = 0, target_accuracy: float = 0.35, max_steps: int = 3000,
               batch: int = 128, lr: float = 2e-3, log=print) -> Tuple[Params, dict]:
    """Train by supervision until the sampled (temperature 1) exact-match accuracy reaches target_accuracy."""
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    params = {k: v.requires_grad_() for k, v in init_params(cfg, seed).items()}
    opt = torch.optim.Adam(params.values(), lr=lr)
    start = time.time()
    acc = 0.0
    for step in range(1, max_steps + 1):
        prompts = random_prompts(batch, gen)
        target = prompts[:, :N_DIGITS].sort(dim=1).values
        logits = learner_logits(params, prompts, target, cfg)
        loss = F.cross_entropy(logits.reshape(-1, cfg.vocab), target.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 10 == 0:
            eval_prompts = random_prompts(512, gen)
            responses, _, _ = sample(params, eval_prompts, cfg, "fp32", gen)
            acc = float(reward(eval_prompts, responses).mean())
            log(f"  sft step {step}: loss {loss.item():.3f}, sampled accuracy {acc:.3f}")
            if acc >= target_accuracy:
                break
    info = {"sft_steps": step, "sft_accuracy": acc, "sft_seconds": time.time() - start}
    return {k: v.detach() for k, v in params.items()}, info


def load_or_train(cache_dir: Path, cfg: ModelConfig = ModelConfig(), seed: int = 0, log=print) -> Tuple[Params, dict]:
    """The supervised checkpoint, cached in cache_dir (rebuilt deterministically when absent)."""
    path = Path(cache_dir) / f"sft_seed{seed}_d{cfg.d}_l{cfg.layers}.pt"
    if path.exists():
        blob = torch.load(path)
        return blob["params"], blob["info"]
    params, info = supervised(cfg, seed, log=log)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"params": params, "info": info}, path)
    return params, info


@dataclass
class Run:
    """The state of one GRPO run of the experiments: the model config, the supervised start, the trained weights and
    their Adam, the run's sampling generator, and the fixed evaluation prompts with their own generator."""
    cfg: ModelConfig
    params0: Params
    params: Params
    opt: torch.optim.Optimizer
    gen: torch.Generator
    eval_gen: torch.Generator
    eval_prompts: torch.Tensor


def start_run(cache_dir: Path, seed: int, lr: float) -> Run:
    """A run from the cached supervised checkpoint (seed 0) with Adam(lr), sampling seeded by 1000 + seed and 512
    evaluation prompts (seed 99, sampled with seed 7), the same for every run."""
    cfg = ModelConfig()
    params0, _ = load_or_train(Path(cache_dir), cfg, seed=0)
    params = {k: v.clone().requires_grad_() for k, v in params0.items()}
    opt = torch.optim.Adam(params.values(), lr=lr)
    return Run(cfg, params0, params, opt, torch.Generator().manual_seed(1000 + seed), torch.Generator().manual_seed(7),
               random_prompts(512, torch.Generator().manual_seed(99)))


def learner_accuracy(run: Run) -> float:
    """The learner's own sampled (fp32, temperature 1) exact-match accuracy on the run's evaluation prompts."""
    responses, _, _ = sample({k: v.detach() for k, v in run.params.items()}, run.eval_prompts, run.cfg, "fp32",
                             run.eval_gen)
    return float(reward(run.eval_prompts, responses).mean())


def add_run_arguments(parser, presets, out: Path) -> None:
    """The command-line options the RL experiments share: --steps, --seeds, --presets, --lr, --workers, --out."""
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--presets", nargs="+", default=list(presets))
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--out", default=str(out))


def write_csv(rows, path: Path, fieldnames=None) -> None:
    """rows (dicts) as CSV at path, creating its folder; columns from the first row unless given."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fieldnames or list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
