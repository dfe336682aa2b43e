"""Large shapes on a CUDA GPU (marker `gpu`; skipped with the reason on CPU-only machines)."""

import pytest
import torch

from fused_is import backends

from cases import check_against_reference, config_for, make_inputs

pytestmark = pytest.mark.gpu


def _gpu_backends():
    if not torch.cuda.is_available():
        return ["triton"]  # collected so the skip is visible; conftest skips every gpu test without CUDA
    probe = torch.empty(1, 1, device="cuda")
    return [b for b in ("triton", "cuda", "torch") if backends.unavailable_reason(b, probe) is None]


@pytest.mark.parametrize("backend", _gpu_backends())
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("preset", ["ppo_tis", "seq_mis", "geo_mis", "mis_ppo_seq"])
def test_qwen_vocab_on_gpu(backend, dtype, preset):
    inputs = make_inputs("padded", batch=4, seq_len=64, vocab=151936, dtype=dtype, device="cuda", seed=1)
    check_against_reference(inputs, config_for(preset, dict(entropy_coef=0.01)), backend)
    check_against_reference(inputs, config_for(preset), backend, with_old=False, inplace=True)


@pytest.mark.parametrize("backend", _gpu_backends())
def test_more_than_2_pow_31_elements(backend):
    """N x V > 2**31: row offsets must be int64 (bf16, 14200 x 151936 = 2.16e9 elements, 4.3 GB)."""
    n, vocab = 14200, 151936
    logits = torch.randn(n, vocab, device="cuda", dtype=torch.bfloat16)
    tokens = torch.randint(0, vocab, (n,), device="cuda")
    from fused_is import token_logprobs

    lp, _ = token_logprobs(logits, tokens, backend=backend)
    rows = torch.tensor([0, n // 2, n - 1], device="cuda")
    expected = torch.log_softmax(logits[rows].float(), -1).gather(1, tokens[rows, None]).squeeze(1)
    torch.testing.assert_close(lp[rows], expected, rtol=0, atol=2e-5)
