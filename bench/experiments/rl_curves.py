"""RL curves: GRPO on the sort-8-digits task with a mismatched sampler, one run per preset and seed.

    python bench/experiments/rl_curves.py        # about 5 minutes on 2 cores; writes
                                                 # bench/results/experiments/rl_curves.{csv,png,md}

The sampler generates with int4 weights (bench/experiments/rl_task.py, the largest mismatch of the table);
the learner is trained in fp32 with fused_is.policy_loss and each preset (ppo, ppo_tis, seq_tis, token_mis,
seq_mis, vanilla_is, seq_is, ppo_is); the control samples from the learner's own fp32 weights (on-policy,
preset ppo). GRPO: 16 prompts x 8 samples per step, advantage = (r - group mean) / (group std + 1e-3),
two PPO epochs per batch (old_logprobs from the learner before the first), Adam, gradient clip 1.0.
Logged per step: the sampler's batch accuracy, the mismatch k3 between sampler and learner logprobs of
the sampled tokens, and the gradient norm; every 20 steps the learner's own sampled accuracy on 512 fixed
prompts.
"""

from __future__ import annotations

import argparse
import dataclasses
import multiprocessing as mp
import time
from pathlib import Path

import torch

import fused_is
import rl_task as T

OUT = Path(__file__).resolve().parent.parent / "results" / "experiments"
PRESETS = ("ppo", "ppo_tis", "seq_tis", "token_mis", "seq_mis", "vanilla_is", "seq_is", "ppo_is")
CONTROL = "on-policy (ppo)"
# runs beyond the presets (--presets takes their names): a preset with score centering from the sampler's top-3
CENTERED = {"ppo centered": "ppo", "ppo_tis centered": "ppo_tis", "seq_tis centered": "seq_tis"}
TOP_K = 3


def run_one(job) -> list:
    name, seed, steps, sampler_numerics, out_dir, lr = job
    torch.set_num_threads(1)
    run = T.start_run(Path(out_dir) / "cache", seed, lr)
    cfg, params, opt, gen = run.cfg, run.params, run.opt, run.gen
    preset = "ppo" if name == CONTROL else CENTERED.get(name, name)
    config = dataclasses.replace(fused_is.PRESETS[preset], score_centering="proportional") if name in CENTERED \
        else preset
    numerics = "fp32" if name == CONTROL else sampler_numerics
    rows = []
    group, n_prompts = 8, 16
    for step in range(steps + 1):
        if step % 20 == 0:
            learner_acc = T.learner_accuracy(run)
        else:
            learner_acc = float("nan")
        if step == steps:
            rows.append({"run": name, "seed": seed, "step": step, "learner_accuracy": learner_acc})
            break
        prompts = T.random_prompts(n_prompts, gen).repeat_interleave(group, dim=0)
        sp = T.sampler_params({k: v.detach() for k, v in params.items()}, numerics)
        responses, samp_lp, samp_rows = T.sample(sp, prompts, cfg, numerics, gen)
        extra = {}
        if name in CENTERED:  # what the sampler's logprobs=3 reports
            top = samp_rows.topk(TOP_K, -1)
            extra["sampler_topk"] = (top.indices, top.values)
        r = T.reward(prompts, responses)
        rg = r.view(n_prompts, group)
        adv = ((rg - rg.mean(1, keepdim=True)) / (rg.std(1, keepdim=True) + 1e-3)).reshape(-1)
        with torch.no_grad():
            old_lp, _ = fused_is.token_logprobs(T.learner_logits(params, prompts, responses, cfg), responses)
        mismatch = fused_is.mismatch_report(samp_lp, old_lp)
        grad_norms = []
        for _ in range(2):
            logits = T.learner_logits(params, prompts, responses, cfg)
            out = fused_is.policy_loss(logits, responses, adv, sampler_logprobs=samp_lp, old_logprobs=old_lp,
                                       config=config, **extra)
            opt.zero_grad()
            out.loss.backward()
            grad_norms.append(float(torch.nn.utils.clip_grad_norm_(list(params.values()), 1.0)))
            opt.step()
        rows.append({"run": name, "seed": seed, "step": step, "sampler_accuracy": float(r.mean()),
                     "learner_accuracy": learner_acc, "mismatch_k3": mismatch["k3"], "grad_norm": grad_norms[0]})
    return rows


def summarize(rows, steps):
    """{run: (final learner accuracy mean, min, max over seeds; mean k3; mean grad norm)}."""
    out = {}
    for name in sorted({r["run"] for r in rows}, key=lambda n: (n != CONTROL, n)):
        final = [r["learner_accuracy"] for r in rows if r["run"] == name and r["step"] == steps]
        k3 = [r["mismatch_k3"] for r in rows if r["run"] == name and "mismatch_k3" in r]
        gn = [r["grad_norm"] for r in rows if r["run"] == name and "grad_norm" in r]
        start = [r["learner_accuracy"] for r in rows if r["run"] == name and r["step"] == 0]
        out[name] = {"start": sum(start) / len(start), "final_mean": sum(final) / len(final), "final_min": min(final),
                     "final_max": max(final), "k3": sum(k3) / len(k3), "grad_norm": sum(gn) / len(gn)}
    return out


def plot(rows, steps, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(17, 5))
    names = sorted({r["run"] for r in rows}, key=lambda n: (n != CONTROL, n))
    for name in names:
        style = dict(color="black", linewidth=2.5) if name == CONTROL else {}
        for ax, key, every in ((axes[0], "learner_accuracy", 20), (axes[1], "mismatch_k3", 1),
                               (axes[2], "grad_norm", 1)):
            xs = sorted({r["step"] for r in rows if r["run"] == name and key in r and r["step"] % every == 0})
            mean, lo, hi = [], [], []
            for x in xs:
                vals = [r[key] for r in rows if r["run"] == name and r["step"] == x and key in r]
                vals = [v for v in vals if v == v]
                mean.append(sum(vals) / len(vals))
                lo.append(min(vals))
                hi.append(max(vals))
            if every == 1 and len(xs) > 20:  # smooth the per-step series over 10 steps for legibility
                k = 10
                mean = [sum(mean[max(0, i - k + 1): i + 1]) / len(mean[max(0, i - k + 1): i + 1]) for i in range(len(mean))]
                ax.plot(xs, mean, label=name, **style)
            else:
                line, = ax.plot(xs, mean, label=name, marker="o", markersize=3, **style)
                ax.fill_between(xs, lo, hi, alpha=0.12, color=line.get_color())
    axes[0].set(title="learner accuracy (512 prompts, mean and min-max of seeds)", xlabel="step", ylabel="exact match")
    axes[1].set(title="mismatch k3 (sampler vs learner, 10-step mean)", xlabel="step", yscale="log")
    axes[2].set(title="gradient norm before clipping (10-step mean)", xlabel="step", yscale="log")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    T.add_run_arguments(parser, PRESETS, OUT)
    parser.add_argument("--sampler", default="int4", choices=T.NUMERICS)
    args = parser.parse_args(argv)
    start = time.time()
    out = Path(args.out)
    T.load_or_train(out / "cache", T.ModelConfig(), seed=0)  # once, before the workers read it
    jobs = [(name, seed, args.steps, args.sampler, str(out), args.lr)
            for name in [CONTROL] + list(args.presets) for seed in range(args.seeds)]
    with mp.get_context("fork").Pool(args.workers) as pool:
        rows = [row for result in pool.imap_unordered(run_one, jobs) for row in result]
    out.mkdir(parents=True, exist_ok=True)
    keys = ["run", "seed", "step", "sampler_accuracy", "learner_accuracy", "mismatch_k3", "grad_norm"]
    rows.sort(key=lambda r: (r["run"], r["seed"], r["step"]))
    T.write_csv(rows, out / "rl_curves.csv", fieldnames=keys)
    plot(rows, args.steps, out / "rl_curves.png")
    summary = summarize(rows, args.steps)
    lines = [f"GRPO, sampler {args.sampler} weights, {args.steps} steps, {args.seeds} seeds, lr {args.lr}: learner "
             "accuracy (512 prompts) at step 0 and at the end (mean, min-max over seeds), mean k3 and grad norm:", "",
             "| run | start | final mean | final min-max | mean k3 | mean grad norm |", "|---|---|---|---|---|---|"]
    for name, s in summary.items():
        lines.append(f"| {name} | {s['start']:.3f} | {s['final_mean']:.3f} | {s['final_min']:.3f}-{s['final_max']:.3f} | "
                     f"{s['k3']:.2e} | {s['grad_norm']:.3f} |")
    (out / "rl_curves.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"\nwrote {out / 'rl_curves.csv'}, {out / 'rl_curves.png'}, {out / 'rl_curves.md'} in "
          f"{time.time() - start:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
