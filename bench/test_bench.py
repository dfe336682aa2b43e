"""pytest-benchmark suite: `pytest bench/ --benchmark-only` (kept out of the default test run).

The same providers as `fused-is bench`, at small sizes, forward+backward of the ppo_tis loss. The checks of the
bench's providers and modes (the liger provider against the float64 reference, --triton-configs) are in
tests/test_bench_providers.py, which the test suite runs.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():  # Liger's Triton kernels on the CPU: the interpreter, set before their import
    os.environ.setdefault("TRITON_INTERPRET", "1")

from fused_is.benchmarks import main as bench  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PROVIDERS = [p for p, reason in bench.providers_here(DEVICE).items() if reason is None and p != "compile"]
SIZES = [(256, 32000), (64, 151936)] if DEVICE == "cpu" else [(4096, 32000), (4096, 151936)]


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("n,vocab", SIZES, ids=[f"{n}x{v}" for n, v in SIZES])
@pytest.mark.parametrize("provider", PROVIDERS)
def test_forward_backward(benchmark, provider, n, vocab, dtype):
    problem = bench.make_problem(n, vocab, bench.DTYPES[dtype], DEVICE)
    logits = problem["logits"].requires_grad_()

    def step():
        bench.run_step(provider, logits, problem)
        logits.grad = None
        if DEVICE == "cuda":
            torch.cuda.synchronize()

    benchmark.group = f"{n}x{vocab} {dtype}"
    benchmark.pedantic(step, rounds=5, warmup_rounds=1)
