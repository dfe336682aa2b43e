"""Which kernels a fused backend launches: one pass for token-local configs, the two-pass plan otherwise."""

import pytest
import torch

import fused_is
from fused_is import backends

from cases import make_inputs

AVAILABLE = [b for b in ("triton", "cpu") if backends.unavailable_reason(b, torch.empty(1, 1)) is None]


def _count_calls(monkeypatch, module, names):
    calls = {n: 0 for n in names}
    for n in names:
        original = getattr(module, n)

        def wrapper(*args, _n=n, _f=original, **kwargs):
            calls[_n] += 1
            return _f(*args, **kwargs)

        monkeypatch.setattr(module, n, wrapper)
    return calls


@pytest.mark.parametrize("preset,with_old,two_pass", [
    ("ppo_tis", False, False), ("seq_tis", True, False), ("seq_tis", False, True), ("geo_mis", False, True),
    ("mis_ppo_token", False, False), ("mis_ppo_seq", False, True)])
def test_triton_plan(monkeypatch, preset, with_old, two_pass):
    if "triton" not in AVAILABLE:
        pytest.skip(backends.unavailable_reason("triton", torch.empty(1, 1)))
    from fused_is.backends import triton as tb

    calls = _count_calls(monkeypatch, tb, ["_fused", "_stats"])
    inputs = make_inputs("padded", dtype=torch.float32, seed=1, vocab=300)
    kwargs = inputs.kwargs(with_old=with_old)
    x = inputs.logits.clone().requires_grad_()
    fused_is.policy_loss(x, inputs.tokens, inputs.advantages, config=preset, backend="triton", **kwargs).loss.backward()
    assert calls == ({"_fused": 0, "_stats": 1} if two_pass else {"_fused": 1, "_stats": 0})


@pytest.mark.parametrize("preset,with_old,launches", [("ppo_tis", False, 1), ("seq_mis", True, 1),
                                                      ("seq_mis", False, 2)])
def test_cpu_plan(monkeypatch, preset, with_old, launches):
    if "cpu" not in AVAILABLE:
        pytest.fail(backends.unavailable_reason("cpu", torch.empty(1, 1)))
    from fused_is.backends import cpp

    calls = _count_calls(monkeypatch, cpp, ["_run"])
    inputs = make_inputs("padded", dtype=torch.bfloat16, seed=2, vocab=300)
    x = inputs.logits.clone().requires_grad_()
    fused_is.policy_loss(x, inputs.tokens, inputs.advantages, config=preset, backend="cpu",
                         **inputs.kwargs(with_old=with_old)).loss.backward()
    assert calls["_run"] == launches
