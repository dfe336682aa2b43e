"""The plan (fused_is/plan.py), decided once for every backend: one `fused` launch for token-local configs,
`stats` then `fused` for sequence/geometric IS with old_logprobs=None, `stats` alone without a gradient."""

import pytest
import torch

import fused_is
from fused_is import backends

from cases import count_calls, make_inputs

AVAILABLE = [b for b in ("triton", "cpu", "torch") if backends.unavailable_reason(b, torch.empty(1, 1)) is None]


def test_cpu_backend_is_built_here():
    """CI builds the CPU extension (scripts/dev.sh setup); its plan is tested below."""
    assert "cpu" in AVAILABLE, backends.unavailable_reason("cpu", torch.empty(1, 1))


@pytest.mark.parametrize("backend", AVAILABLE)
@pytest.mark.parametrize("preset,with_old,two_pass", [
    ("ppo_tis", False, False), ("seq_tis", True, False), ("seq_tis", False, True), ("geo_mis", False, True),
    ("mis_ppo_token", False, False), ("mis_ppo_seq", False, True), ("seq_mis", True, False)])
def test_plan(monkeypatch, backend, preset, with_old, two_pass):
    calls = count_calls(monkeypatch, backends.implementation(backend), ["stats", "fused"])
    inputs = make_inputs("padded", dtype=torch.float32, seed=1, vocab=300)
    x = inputs.logits.clone().requires_grad_()
    fused_is.policy_loss(x, inputs.tokens, inputs.advantages, config=preset, backend=backend,
                         **inputs.kwargs(with_old=with_old)).loss.backward()
    assert calls == {"stats": int(two_pass), "fused": 1}


@pytest.mark.parametrize("backend", AVAILABLE)
def test_no_gradient_is_stats_only(monkeypatch, backend):
    calls = count_calls(monkeypatch, backends.implementation(backend), ["stats", "fused"])
    inputs = make_inputs("packed", dtype=torch.float32, seed=2, vocab=300)
    with torch.no_grad():
        fused_is.policy_loss(inputs.logits, inputs.tokens, inputs.advantages, config="seq_mis", backend=backend,
                             **inputs.kwargs(with_old=False))
    fused_is.token_logprobs(inputs.logits, inputs.tokens.clamp(min=0), backend=backend)
    assert calls == {"stats": 2, "fused": 0}
