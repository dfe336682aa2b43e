"""Exact bias and variance of the seed's gradient estimators on an enumerable tabular policy.

A tabular autoregressive policy over a tiny vocabulary: the logits of token t depend on (t, previous
token), theta has shape [L, K + 1, K] (row K + 1 is "no previous token"). The sampler runs the same
table perturbed by `mismatch * Z` (Z fixed standard normal): a controlled training-inference mismatch.
Every sequence of length L can be enumerated (K ** L of them), so each estimator's expected gradient
and its variance under the sampler are exact sums, not Monte Carlo:

    true gradient   g* = sum_y pi_l(y) R(y) grad log pi_l(y)
    estimator       g(y) for y ~ pi_s, from fused_is.policy_loss with the estimator's preset
    bias            || E_s[g] - g* || / || g* ||
    variance        E_s || g - E_s[g] ||^2 / || g* ||^2   (trace of the covariance, relative)

The per-sequence gradient g(y) is the gradient of fused_is.policy_loss (backend "torch", float64
logits) with the learner at theta = theta_old (old_logprobs = learner logprobs), advantages R(y),
summed over tokens ("seq-mean-token-sum" with normalizer 1), chained from the logits rows to theta.

    python bench/experiments/estimator_panel.py            # writes bench/results/experiments/panel.{csv,png}
"""

from __future__ import annotations

import argparse
import itertools
import time
from pathlib import Path
from typing import Dict, List, Sequence

import torch

import fused_is
from rl_task import write_csv

# estimator name -> preset (is_cap 2 for the truncated / masked ones, as in the presets)
ESTIMATORS = {
    "no correction": "reinforce",
    "token IS": "vanilla_is",
    "sequence IS": "seq_is",
    "token TIS": "ppo_tis",
    "sequence TIS": "seq_tis",
    "token MIS": "token_mis",
    "sequence MIS": "seq_mis",
    "PPO-IS": "ppo_is",
}


def enumerate_sequences(vocab: int, length: int) -> torch.Tensor:
    """All vocab ** length sequences as int64 [S, length]."""
    return torch.tensor(list(itertools.product(range(vocab), repeat=length)), dtype=torch.long)


MAX_LENGTH = 16


class TabularTask:
    """theta [L, K + 1, K], sampler perturbation Z and reward R(y) = sum_t r[t, y_t].

    All three are the first L positions of one table drawn for MAX_LENGTH positions, so a longer task
    extends a shorter one with the same seed: comparisons across lengths change only the length.
    """

    def __init__(self, vocab: int, length: int, seed: int = 0):
        if not 1 <= length <= MAX_LENGTH:
            raise ValueError(f"length must be in [1, {MAX_LENGTH}]; got {length}")
        gen = torch.Generator().manual_seed(seed)
        self.vocab, self.length = vocab, length
        shape = (MAX_LENGTH, vocab + 1, vocab)
        self.theta = (1.5 * torch.randn(shape, generator=gen, dtype=torch.float64))[:length].contiguous()
        self.noise = torch.randn(shape, generator=gen, dtype=torch.float64)[:length].contiguous()
        per_token_reward = torch.randn(MAX_LENGTH, vocab, generator=gen, dtype=torch.float64)[:length]
        self.seqs = enumerate_sequences(vocab, length)
        self.reward = per_token_reward.gather(1, self.seqs.T).sum(0)
        prev = torch.cat([torch.full((self.seqs.shape[0], 1), vocab), self.seqs[:, :-1]], dim=1)
        self.rows = torch.arange(length)[None, :] * (vocab + 1) + prev  # index into theta.view(-1, K)

    def logits(self, theta: torch.Tensor) -> torch.Tensor:
        """[S, L, K] logits of every sequence's positions."""
        return theta.reshape(-1, self.vocab)[self.rows]

    def token_logprobs(self, theta: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(self.logits(theta), -1).gather(2, self.seqs[..., None]).squeeze(2)


def panel_for(task: TabularTask, mismatch: float, estimators: Dict[str, str] = ESTIMATORS) -> Dict[str, Dict[str, float]]:
    """{estimator: {bias, variance}} (both relative to ||g*||) at one mismatch level."""
    theta = task.theta
    sampler_theta = theta + mismatch * task.noise
    lp_l = task.token_logprobs(theta)
    lp_s = task.token_logprobs(sampler_theta)
    p_l = lp_l.sum(1).exp()
    p_s = lp_s.sum(1).exp()
    # true on-policy gradient: sum_y pi_l(y) R(y) grad log pi_l(y)
    th = theta.clone().requires_grad_()
    objective = (p_l * task.reward * task.token_logprobs(th).sum(1)).sum()
    (g_true,) = torch.autograd.grad(objective, th)
    g_true = g_true.reshape(-1)
    scale = float(g_true.norm())
    out = {}
    n_seq, length = task.seqs.shape
    for name, preset in estimators.items():
        logits = task.logits(theta).detach().clone().requires_grad_()
        cfg = fused_is.LossConfig.preset(preset, loss_agg="seq-mean-token-sum")
        res = fused_is.policy_loss(logits, task.seqs, task.reward[:, None].expand(n_seq, length).contiguous(),
                                   sampler_logprobs=lp_s, old_logprobs=lp_l, config=cfg, normalizer=1.0,
                                   backend="torch")
        res.loss.backward()
        # per-sequence gradient w.r.t. theta: each logits row belongs to one sequence
        per_row = -logits.grad.reshape(n_seq, length, task.vocab)
        per_seq = torch.zeros(n_seq, theta.numel() // task.vocab, task.vocab, dtype=torch.float64)
        per_seq.scatter_add_(1, task.rows[..., None].expand(-1, -1, task.vocab), per_row)
        per_seq = per_seq.reshape(n_seq, -1)
        mean = (p_s[:, None] * per_seq).sum(0)
        var = float((p_s * ((per_seq - mean) ** 2).sum(1)).sum())
        out[name] = {"bias": float((mean - g_true).norm()) / scale, "variance": var / scale ** 2}
    return out


def run(vocab: int, lengths: Sequence[int], mismatches: Sequence[float], seed: int = 0) -> List[dict]:
    rows = []
    for length in lengths:
        task = TabularTask(vocab, length, seed)
        for mismatch in mismatches:
            for name, stats in panel_for(task, mismatch).items():
                rows.append({"length": length, "mismatch": mismatch, "estimator": name, **stats})
    return rows


def plot(rows: List[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths = sorted({r["length"] for r in rows})
    mismatches = sorted({r["mismatch"] for r in rows})
    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    fixed_len, fixed_mis = max(lengths), max(mismatches)
    base = {(r["length"], r["mismatch"]): r["variance"] for r in rows if r["estimator"] == "no correction"}
    for name in ESTIMATORS:
        by_mis = [r for r in rows if r["estimator"] == name and r["length"] == fixed_len]
        by_len = [r for r in rows if r["estimator"] == name and r["mismatch"] == fixed_mis]
        axes[0, 0].plot([r["mismatch"] for r in by_mis], [r["bias"] for r in by_mis], marker="o", label=name)
        axes[0, 1].plot([r["mismatch"] for r in by_mis], [r["variance"] for r in by_mis], marker="o", label=name)
        axes[1, 0].plot([r["length"] for r in by_len], [r["bias"] for r in by_len], marker="o", label=name)
        axes[1, 1].plot([r["length"] for r in by_len], [r["variance"] / base[r["length"], r["mismatch"]] for r in by_len],
                        marker="o", label=name)
    axes[0, 0].set(title=f"bias vs mismatch (L={fixed_len})", xlabel="mismatch scale", ylabel="||E g - g*|| / ||g*||")
    axes[0, 1].set(title=f"variance vs mismatch (L={fixed_len})", xlabel="mismatch scale", ylabel="tr Cov / ||g*||^2",
                   yscale="log")
    axes[1, 0].set(title=f"bias vs length (mismatch={fixed_mis})", xlabel="sequence length", ylabel="relative bias")
    axes[1, 1].set(title=f"variance / uncorrected variance vs length (mismatch={fixed_mis})",
                   xlabel="sequence length", ylabel="variance ratio", yscale="log")
    axes[0, 0].legend(fontsize=8)
    fig.suptitle("Exact bias / variance of IS estimators (tabular policy, enumerated sequences)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", type=int, default=2)
    parser.add_argument("--lengths", type=int, nargs="+", default=[2, 4, 6, 8, 10])
    parser.add_argument("--mismatches", type=float, nargs="+", default=[0.0, 0.1, 0.25, 0.5, 1.0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent.parent / "results" / "experiments"))
    args = parser.parse_args(argv)
    start = time.time()
    rows = run(args.vocab, args.lengths, args.mismatches, args.seed)
    out = Path(args.out)
    write_csv(rows, out / "panel.csv")
    plot(rows, out / "panel.png")
    fixed = max(args.lengths)
    print(f"exact estimator panel, vocab {args.vocab}, length {fixed}: relative bias / variance")
    print(f"{'estimator':14}" + "".join(f"  mis={m:<5g} bias    var     " for m in args.mismatches))
    for name in ESTIMATORS:
        cells = [r for r in rows if r["estimator"] == name and r["length"] == fixed]
        print(f"{name:14}" + "".join(f"  {r['bias']:9.2e} {r['variance']:9.2e}      " for r in cells))
    print(f"wrote {out / 'panel.csv'}, {out / 'panel.png'} in {time.time() - start:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
