"""Asynchronous rollouts: GRPO on the sort task with a sampler that runs a policy several updates old.

    python bench/experiments/staleness.py     # about 15 minutes on 2 cores; writes
                                              # bench/results/experiments/staleness.{csv,png,md}

Asynchronous RL (rollout workers that keep generating while the learner trains) samples each batch from
the weights of `staleness` updates ago, and reports that policy's logprobs as the sampler's. The learner
recomputes old_logprobs with its current weights (the proximal policy) before its two PPO epochs, as the
synchronous runs in rl_curves.py do. An uncorrected loss (ppo, reinforce) treats the stale samples as its
own; a correction preset weights or masks each token or sequence by the learner-to-sampler ratio
(pi_old / mu), the decoupled form of PPO that asynchronous trainers use.

Everything else is rl_curves.py's protocol: the supervised checkpoint of rl_task.py (sampled accuracy 0.35),
16 prompts x 8 samples per step, advantage (r - group mean) / (group std + 1e-3), Adam 3e-4, gradient clip
1.0, fp32 numerics on both sides (the only mismatch is the staleness). The controls sample from the current
weights (staleness 0), one for ppo and one for reinforce. Logged per step: the sampler's batch reward, the mismatch
k3 between the sampler's and the learner's logprobs of the sampled tokens, the gradient norm before clipping and the
learner's mean token entropy; every 20 steps the learner's own sampled accuracy on 512 fixed prompts.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import multiprocessing as mp
import time
from pathlib import Path

import torch

import fused_is
import rl_task as T

OUT = Path(__file__).resolve().parent.parent / "results" / "experiments"
PRESETS = ("ppo", "reinforce", "ppo_tis", "reinforce_tis", "seq_tis", "token_mis", "seq_mis")
UNCORRECTED = ("ppo", "reinforce")
CONTROLS = {"on-policy (ppo)": "ppo", "on-policy (reinforce)": "reinforce"}  # run name -> preset, staleness 0
KEYS = ("run", "staleness", "seed", "step", "sampler_reward", "learner_accuracy", "mismatch_k3", "grad_norm",
        "entropy", "loss_seconds")
TOP_K = 3  # the sampler's top-K logprobs score centering reads (of the task's 11 tokens)
# --async-rl: the asynchronous-RL corrections, run name -> (preset, LossConfig overrides, proximal logprob: "recompute"
# (a no-grad forward of the current weights before the epochs) or "loglinear" (formed in the kernels), top-K or 0)
ASYNC_RUNS = {
    "ppo": ("ppo", {}, "recompute", 0),
    "ppo_tis": ("ppo_tis", {}, "recompute", 0),
    "seq_tis": ("seq_tis", {}, "recompute", 0),
    "m2po": ("ppo", dict(m2_threshold=0.04), "recompute", 0),  # M2PO's second-moment trust region, its reports' 0.04
    "ppo_tis loglinear": ("ppo_tis", dict(ratio_ref="loglinear"), "loglinear", 0),
    "ppo centered": ("ppo", dict(score_centering="proportional"), "recompute", TOP_K),
    "seq_tis centered": ("seq_tis", dict(score_centering="proportional"), "recompute", TOP_K),
}
ASYNC_STALENESS = (8, 16, 32)


def run_one(job) -> list:
    """One run: job = (run name, preset, staleness, seed, steps, lr, cache_dir). Rows of KEYS, one per step."""
    name, preset, staleness, seed, steps, lr, cache_dir = job
    base, overrides, proximal, top_k = ASYNC_RUNS.get(name, (preset, {}, "recompute", 0))
    config = dataclasses.replace(fused_is.PRESETS[base], **overrides)
    torch.set_num_threads(1)
    run = T.start_run(Path(cache_dir), seed, lr)
    cfg, params, opt, gen = run.cfg, run.params, run.opt, run.gen
    history = collections.deque([run.params0], maxlen=staleness + 1)  # history[0]: the sampler's weights
    rows = []
    group, n_prompts = 8, 16
    for step in range(steps + 1):
        row = {"run": name, "staleness": staleness, "seed": seed, "step": step}
        if step % 20 == 0:
            row["learner_accuracy"] = T.learner_accuracy(run)
        if step == steps:
            rows.append(row)
            break
        prompts = T.random_prompts(n_prompts, gen).repeat_interleave(group, dim=0)
        responses, samp_lp, samp_rows = T.sample(history[0], prompts, cfg, "fp32", gen)
        r = T.reward(prompts, responses)
        rg = r.view(n_prompts, group)
        adv = ((rg - rg.mean(1, keepdim=True)) / (rg.std(1, keepdim=True) + 1e-3)).reshape(-1)
        extra = {}
        if top_k:  # what vLLM's logprobs=K reports: the sampler's K most likely tokens per position
            top = samp_rows.topk(top_k, -1)
            extra["sampler_topk"] = (top.indices, top.values)
        started = time.perf_counter()
        with torch.no_grad():  # the proximal policy's logprobs: a forward pass, unless formed from the current ones
            old_lp, _ = fused_is.token_logprobs(T.learner_logits(params, prompts, responses, cfg), responses)
        recompute_seconds = time.perf_counter() - started
        if proximal == "loglinear":  # the sampler's version (updates done) against the version being trained
            extra.update(old_logprobs=None, current_version=step + 1,
                         versions=torch.full_like(responses, max(0, step - staleness)))
        else:
            extra["old_logprobs"] = old_lp
        grad_norms, entropy = [], None
        started = time.perf_counter()
        for _ in range(2):
            logits = T.learner_logits(params, prompts, responses, cfg)
            out = fused_is.policy_loss(logits, responses, adv, sampler_logprobs=samp_lp, config=config, **extra)
            entropy = out.metrics["entropy_mean"] if entropy is None else entropy
            opt.zero_grad()
            out.loss.backward()
            grad_norms.append(float(torch.nn.utils.clip_grad_norm_(list(params.values()), 1.0)))
            opt.step()
        loss_seconds = time.perf_counter() - started + (recompute_seconds if proximal == "recompute" else 0.0)
        history.append({k: v.detach().clone() for k, v in params.items()})
        row.update(sampler_reward=float(r.mean()), mismatch_k3=fused_is.mismatch_report(samp_lp, old_lp)["k3"],
                   grad_norm=grad_norms[0], entropy=entropy, loss_seconds=loss_seconds)
        rows.append(row)
    return rows


def jobs(stalenesses, presets, seeds, steps, lr, cache_dir, controls=tuple(CONTROLS)) -> list:
    """The controls named (staleness 0) and every (preset, staleness) pair, for each seed."""
    out = [(name, CONTROLS[name], 0, s, steps, lr, str(cache_dir)) for name in controls for s in range(seeds)]
    out += [(p, p, k, s, steps, lr, str(cache_dir)) for k in stalenesses for p in presets for s in range(seeds)]
    return out


def run(job_list, workers: int) -> list:
    """Every job's rows, sorted, run in `workers` processes."""
    with mp.get_context("fork").Pool(workers) as pool:
        rows = [row for result in pool.imap_unordered(run_one, job_list) for row in result]
    rows.sort(key=lambda r: (r["staleness"], r["run"], r["seed"], r["step"]))
    return rows


def final_accuracy(rows) -> dict:
    """{(run, staleness): [final learner accuracy per seed]}."""
    last = max(r["step"] for r in rows)
    out = collections.defaultdict(list)
    for r in rows:
        if r["step"] == last:
            out[(r["run"], r["staleness"])].append(r["learner_accuracy"])
    return dict(out)


def summarize(rows) -> list:
    """One dict per (run, staleness): final accuracy mean / min / max over seeds and means of the step logs
    over the last quarter of the steps (k3, gradient norm, entropy, sampler reward)."""
    last = max(r["step"] for r in rows)
    finals = final_accuracy(rows)
    out = []
    for (name, k), acc in sorted(finals.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        tail = [r for r in rows if r["run"] == name and r["staleness"] == k and "grad_norm" in r
                and r["step"] >= 3 * last // 4]

        def mean(key):
            return sum(r[key] for r in tail) / len(tail)

        out.append({"run": name, "staleness": k, "final_mean": sum(acc) / len(acc), "final_min": min(acc),
                    "final_max": max(acc), "k3": mean("mismatch_k3"), "grad_norm": mean("grad_norm"),
                    "entropy": mean("entropy"), "sampler_reward": mean("sampler_reward"),
                    "loss_seconds": mean("loss_seconds") if all("loss_seconds" in r for r in tail) else None})
    return out


def plot(rows, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    stalenesses = sorted({r["staleness"] for r in rows} - {0})
    fig, axes = plt.subplots(2, len(stalenesses), figsize=(6 * len(stalenesses), 9), squeeze=False)
    for col, k in enumerate(stalenesses):
        names = sorted({r["run"] for r in rows if r["staleness"] == k})
        for name in list(CONTROLS) + names:
            sel = [r for r in rows if r["run"] == name and r["staleness"] == (0 if name in CONTROLS else k)]
            if not sel:
                continue
            style = dict(color="black", linewidth=2.5, linestyle="-" if CONTROLS.get(name) == "ppo" else ":") \
                if name in CONTROLS else (dict(linestyle="--", linewidth=2) if name in UNCORRECTED else {})
            for row_i, key, every in ((0, "learner_accuracy", 20), (1, "mismatch_k3", 10)):
                xs = sorted({r["step"] for r in sel if key in r and r["step"] % every == 0})
                if key == "mismatch_k3":  # a 10-step mean per seed, then the band over seeds
                    xs = [x for x in xs if x + every <= max(r["step"] for r in sel)]
                    per_seed = collections.defaultdict(list)
                    for r in sel:
                        if key in r:
                            per_seed[(r["seed"], r["step"] // every * every)].append(r[key])
                    vals = {x: [sum(v) / len(v) for (s, xx), v in per_seed.items() if xx == x] for x in xs}
                else:
                    vals = {x: [r[key] for r in sel if r["step"] == x and key in r] for x in xs}
                if key == "mismatch_k3" and name in CONTROLS:
                    continue  # exactly 0 up to rounding: off the log axis
                mean = [sum(vals[x]) / len(vals[x]) for x in xs]
                line, = axes[row_i][col].plot(xs, mean, label=name, **style)
                axes[row_i][col].fill_between(xs, [min(vals[x]) for x in xs], [max(vals[x]) for x in xs],
                                              alpha=0.12, color=line.get_color())
        axes[0][col].set(title=f"learner accuracy, rollouts {k} updates stale", xlabel="step",
                         ylabel="exact match (512 prompts)")
        axes[1][col].set(title=f"mismatch k3 (stale sampler vs learner), staleness {k}", xlabel="step",
                         yscale="log")
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def table(summary, args) -> str:
    lines = [f"GRPO on the sort task, rollouts from the policy of `staleness` updates ago, {args.steps} steps, "
             f"{args.seeds} seeds, lr {args.lr}. Learner accuracy (512 prompts) at the end: mean and min-max over "
             "seeds (start 0.350); mean over the last quarter of the steps of the mismatch k3, the gradient norm "
             "before clipping, the learner's token entropy, the stale sampler's batch reward and the seconds per step "
             "of the learner's loss work (the proximal logprob pass, when there is one, and two epochs of forward, "
             "loss and backward; 2 worker processes sharing 2 cores).", "",
             "| staleness | run | final mean | final min-max | k3 | grad norm | entropy | sampler reward | loss s/step |",
             "|---|---|---|---|---|---|---|---|---|"]
    for s in summary:
        seconds = "-" if s.get("loss_seconds") is None else f"{s['loss_seconds']:.4f}"
        lines.append(f"| {s['staleness']} | {s['run']} | {s['final_mean']:.3f} | {s['final_min']:.3f}-"
                     f"{s['final_max']:.3f} | {s['k3']:.2e} | {s['grad_norm']:.2f} | {s['entropy']:.3f} | "
                     f"{s['sampler_reward']:.3f} | {seconds} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    T.add_run_arguments(parser, PRESETS, OUT)
    parser.add_argument("--staleness", type=int, nargs="+", default=None,
                        help="updates stale (default 2 4 8; with --async-rl 8 16 32)")
    parser.add_argument("--async-rl", action="store_true",
                        help="the asynchronous-RL corrections (M2PO, the loglinear proximal, score centering) beside "
                             f"ppo, ppo_tis and seq_tis: runs {', '.join(ASYNC_RUNS)}; writes staleness_async.*")
    args = parser.parse_args(argv)
    if args.async_rl:
        args.staleness = args.staleness or list(ASYNC_STALENESS)
        if args.presets == list(PRESETS):  # the option's own runs unless named
            args.presets = list(ASYNC_RUNS)
    args.staleness = args.staleness or [2, 4, 8]
    start = time.time()
    out = Path(args.out)
    stem = "staleness_async" if args.async_rl else "staleness"
    T.load_or_train(out / "cache", T.ModelConfig(), seed=0)  # once, before the workers read it
    rows = run(jobs(args.staleness, args.presets, args.seeds, args.steps, args.lr, out / "cache"), args.workers)
    T.write_csv(rows, out / f"{stem}.csv", fieldnames=list(KEYS))
    plot(rows, out / f"{stem}.png")
    text = table(summarize(rows), args)
    (out / f"{stem}.md").write_text(text)
    print(text)
    print(f"wrote {out / stem}.csv, .png, .md in {time.time() - start:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
