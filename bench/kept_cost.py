"""Cost of kept-set replay on the CPU: policy_loss + backward (ppo_tis, backend="cpu", bf16) over the whole
vocabulary against the same call with kept= (K = 1024 kept tokens per row, the sampled one among them).

    .venv/bin/python bench/kept_cost.py [--n 1024] [--vocab 151936] [--kept 1024] [--reps 5]

Prints the min and median of each; the replayed call reads only the K kept logits of each row (a gather) and
writes the gradient buffer (zeros but for K columns per row).
"""

import argparse
import statistics
import time

import torch

import fused_is


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--kept", type=int, default=1024)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    torch.manual_seed(0)
    n, vocab, k = args.n, args.vocab, args.kept
    logits = torch.randn(n, vocab).to(torch.bfloat16)
    tokens = torch.randint(0, vocab, (n,))
    others = torch.stack([torch.randperm(vocab)[:k] for _ in range(8)]).repeat((n + 7) // 8, 1)[:n]
    others = torch.where(others == tokens[:, None], (others + 1) % vocab, others)  # unique, the token apart
    kept = torch.cat([tokens[:, None], others[:, 1:]], 1)
    adv, samp, old = torch.randn(n), -torch.rand(n), -torch.rand(n)

    def once(**kw) -> float:
        leaf = logits.clone().requires_grad_()
        start = time.perf_counter()
        out = fused_is.policy_loss(leaf, tokens, adv, sampler_logprobs=samp, old_logprobs=old, backend="cpu", **kw)
        out.loss.backward()
        return time.perf_counter() - start

    for name, kw in (("full vocabulary", {}), (f"kept={k}", dict(kept=kept))):
        once(**kw)  # warm-up
        times = [once(**kw) for _ in range(args.reps)]
        print(f"{name:16} min {min(times) * 1e3:7.1f} ms  median {statistics.median(times) * 1e3:7.1f} ms  "
              f"(N={n}, V={vocab}, bf16, {torch.get_num_threads()} threads)")


if __name__ == "__main__":
    main()
