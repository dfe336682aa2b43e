"""Memory and time of policy_loss with a distillation term (LossConfig.distill_kind, teacher_logits=) written over
the logits: inplace=False (a new [N, V] gradient buffer), inplace=True (block by block over the logits in backward)
and inplace="forward" (the same in the forward call). ppo_tis with a JSD term (beta 0.5, coef 0.1), bf16 logits of
both models, forward + backward.

    .venv/bin/python bench/term_in_place.py [--n 1024] [--vocab 151936] [--backend cpu] [--kind jsd] [--reps 3]

Each mode runs in a fresh process of its own, one step of warm-up, then `fused_is.benchmarks.common.time_steps`: the
median time and the peak memory a step added over the inputs (the CPU's resident size, CUDA's max_memory_allocated
with --device cuda), in MiB and as a multiple of the student's logits.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys

import torch

import fused_is
from fused_is.benchmarks.common import time_steps

MODES = {"False": False, "True": True, "forward": "forward"}


def child(args) -> dict:
    torch.manual_seed(0)
    n, vocab, device = args.n, args.vocab, args.device
    logits = torch.empty(n, vocab, dtype=torch.bfloat16, device=device)
    teacher = torch.empty_like(logits)
    for start in range(0, n, 64):  # made in row blocks: no fp32 [N, V] temporary before the peak is reset
        block = torch.randn(min(64, n - start), vocab, device=device) * 2.0
        logits[start:start + 64] = block.to(torch.bfloat16)
        teacher[start:start + 64] = (block + torch.randn_like(block)).to(torch.bfloat16)
    tokens = torch.randint(0, vocab, (n,), device=device)
    adv, samp = torch.randn(n, device=device), -torch.rand(n, device=device)
    config = fused_is.LossConfig(policy="ppo", is_level="token", is_mode="truncate", distill_kind=args.kind,
                                 distill_beta=0.5, distill_coef=0.1)
    inplace = MODES[args.mode]
    state = {}

    def prepare():  # the next step's logits, outside the measured span: in place needs a non-leaf buffer
        state.clear()
        leaf = logits.clone().requires_grad_()
        state.update(leaf=leaf, work=leaf.clone() if inplace else leaf)

    def step():
        out = fused_is.policy_loss(state["work"], tokens, adv, sampler_logprobs=samp, config=config,
                                   backend=args.backend, inplace=inplace, teacher_logits=teacher)
        out.loss.backward()

    prepare()
    times, peak = time_steps(step, prepare, device, args.reps, warmup=1)
    return dict(mode=args.mode, seconds=statistics.median(times), added_mib=peak / 2**20,
                logits_mib=logits.numel() * logits.element_size() / 2**20)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--backend", default="cpu")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--kind", default="jsd", choices=["forward_kl", "reverse_kl", "jsd"])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--mode", choices=list(MODES), help="run one mode in this process (the parent's child)")
    args = parser.parse_args()
    if args.mode is not None:
        print(json.dumps(child(args)))
        return
    print(f"policy_loss + {args.kind} term, N = {args.n}, V = {args.vocab}, bf16, backend={args.backend}")
    print(f"{'inplace':>10} {'time':>9} {'added':>10} {'x logits':>9}")
    # large blocks returned to the OS on free, so that the peak RSS tracks live tensors (as worker_record's runs)
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072")
    for mode in MODES:
        argv = [sys.executable, __file__, "--mode", mode] + [f"--{k}={v}" for k, v in vars(args).items()
                                                             if k != "mode"]
        run = subprocess.run(argv, check=True, capture_output=True, text=True, env=env)
        record = json.loads(run.stdout.splitlines()[-1])
        print(f"{mode:>10} {record['seconds']:8.3f}s {record['added_mib']:7.0f} MiB "
              f"{record['added_mib'] / record['logits_mib']:8.2f}x")


if __name__ == "__main__":
    main()
