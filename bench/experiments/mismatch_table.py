"""Mismatch table: the same weights under the sampler numerics of the seed, against the fp32 learner.

    python bench/experiments/mismatch_table.py     # writes bench/results/experiments/mismatch.{csv,md,png}

For each sampler numerics (bench/experiments/rl_task.py): sample responses token by token with a KV cache,
then run the learner's full fp32 forward on the same sequences, and report over the sampled tokens
k3 = mean(exp(l - s) - (l - s) - 1) (fused_is.mismatch_report), max |p_sampler - p_learner| over every
vocabulary entry of every position, and mean |logp_sampler - logp_learner| of sampled tokens whose learner
probability is < 0.2 (low) or > 0.8 (high), with their counts.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

import fused_is
import rl_task as T

OUT = Path(__file__).resolve().parent.parent / "results" / "experiments"


def measure(params, cfg, numerics: str, prompts: torch.Tensor, seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    sp = T.sampler_params(params, numerics)
    responses, samp_lp, samp_rows = T.sample(sp, prompts, cfg, numerics, gen)
    with torch.no_grad():
        logits = T.learner_logits(params, prompts, responses, cfg)
    learner_rows = torch.log_softmax(logits, -1)
    learner_lp = learner_rows.gather(2, responses[..., None]).squeeze(2)
    report = fused_is.mismatch_report(samp_lp, learner_lp)
    diff = (samp_lp - learner_lp).abs()
    p_l = learner_lp.exp()
    low, high = p_l < 0.2, p_l > 0.8
    return {
        "numerics": numerics,
        "k3": report["k3"],
        "max_abs_prob_diff": float((samp_rows.exp() - learner_rows.exp()).abs().max()),
        "mean_abs_dlogp_low": float(diff[low].mean()) if low.any() else float("nan"),
        "mean_abs_dlogp_high": float(diff[high].mean()) if high.any() else float("nan"),
        "n_low": int(low.sum()),
        "n_high": int(high.sum()),
        "sampler_accuracy": float(T.reward(prompts, responses).mean()),
    }


def plot(rows, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["numerics"] for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    axes[0].bar(names, [max(r["k3"], 1e-16) for r in rows], color="tab:blue")
    axes[0].set(title="k3 KL (sampled tokens)", yscale="log")
    axes[1].bar(names, [r["max_abs_prob_diff"] for r in rows], color="tab:orange")
    axes[1].set(title="max |p_sampler - p_learner| (all vocab)", yscale="log")
    x = range(len(rows))
    axes[2].bar([i - 0.2 for i in x], [r["mean_abs_dlogp_low"] for r in rows], width=0.4, label="p < 0.2")
    axes[2].bar([i + 0.2 for i in x], [r["mean_abs_dlogp_high"] for r in rows], width=0.4, label="p > 0.8")
    axes[2].set_xticks(list(x), names)
    axes[2].set(title="mean |d logp| of sampled tokens", yscale="log")
    axes[2].legend()
    for ax in axes:
        ax.tick_params(axis="x", rotation=30)
    fig.suptitle("Sampler numerics vs fp32 learner, same weights (sort-8-digits policy)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=4096)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(OUT))
    args = parser.parse_args(argv)
    start = time.time()
    out = Path(args.out)
    cfg = T.ModelConfig()
    params, info = T.load_or_train(out / "cache", cfg, seed=args.seed)
    prompts = T.random_prompts(args.prompts, torch.Generator().manual_seed(args.seed + 1))
    rows = [measure(params, cfg, n, prompts, args.seed + 2) for n in T.NUMERICS]
    T.write_csv(rows, out / "mismatch.csv")
    lines = [f"Sort-8-digits policy (SFT {info['sft_steps']} steps, sampled accuracy {info['sft_accuracy']:.2f}), "
             f"{args.prompts} prompts x 8 tokens, sampler vs fp32 learner:", "",
             "| sampler numerics | k3 | max abs prob diff | mean abs dlogp, p<0.2 (n) | mean abs dlogp, p>0.8 (n) "
             "| sampler accuracy |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['numerics']} | {r['k3']:.2e} | {r['max_abs_prob_diff']:.2e} | "
                     f"{r['mean_abs_dlogp_low']:.2e} ({r['n_low']}) | {r['mean_abs_dlogp_high']:.2e} ({r['n_high']}) | "
                     f"{r['sampler_accuracy']:.3f} |")
    (out / "mismatch.md").write_text("\n".join(lines) + "\n")
    plot(rows, out / "mismatch.png")
    print("\n".join(lines))
    print(f"\nwrote {out / 'mismatch.csv'}, {out / 'mismatch.md'}, {out / 'mismatch.png'} in "
          f"{time.time() - start:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
