"""validate="async" (issue 13): the same results as validate="full", without reading a tensor value on the host.

On a GPU every host read of a device tensor is a synchronisation (bool(), float(), .item(), .tolist(),
nonzero, boolean indexing, torch.equal). Here they are counted at the dispatcher on the CPU, which sees the
same operations: `HostReads` records every aten op that needs a value on the host. The GPU suite checks the
same with torch.cuda.set_sync_debug_mode("error") (tests/test_gpu.py).
"""

import pytest
import torch

import fused_is
from fused_is import backends
from fused_is.testing import HostReads  # noqa: F401 (tests/test_distributed.py imports it from here too)

from cases import assert_close, config_for, make_inputs, run

BACKENDS = [b for b in backends.available_backends() if b != "reference"]
CONFIGS = [
    ("padded_ppo_tis", "padded", "ppo_tis", {}, True),
    ("packed_seq_tis_two_pass", "packed", "seq_tis", dict(loss_agg="seq-mean-token-mean", entropy_coef=0.01), False),
    ("padded_kl_entropy", "padded", "ppo_tis", dict(kl_coef=0.1, entropy_coef=0.01, dual_clip=3.0), True),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name, layout, preset, overrides, with_old", CONFIGS, ids=[c[0] for c in CONFIGS])
def test_async_matches_full_and_reads_nothing_on_host(backend, name, layout, preset, overrides, with_old):
    inputs = make_inputs(layout, dtype=torch.float32, seed=31)
    cfg = config_for(preset, overrides)
    full, full_grad = run(inputs, cfg, backend, grad_scale=1.7, with_old=with_old)
    with HostReads() as reads:
        out, grad = run(inputs, cfg, backend, grad_scale=1.7, with_old=with_old, validate="async",
                        normalizer=torch.tensor(11.0))
    assert reads.ops == [], f"validate='async' read tensor values on the host: {reads.ops}"
    ref, ref_grad = run(inputs, cfg, backend, grad_scale=1.7, with_old=with_old, normalizer=11.0)
    assert_close("loss", out.loss, ref.loss, 1e-12)
    assert_close("grad", grad, ref_grad, 0.0)
    assert_close("logprobs", out.logprobs, ref.logprobs, 0.0, mask=inputs.mask)
    assert set(out.metrics) == set(full.metrics)
    for key, value in ref.metrics.items():
        assert isinstance(out.metrics[key], torch.Tensor) and out.metrics[key].dim() == 0
        assert float(out.metrics[key]) == pytest.approx(value, rel=1e-12, abs=1e-15), key
    with HostReads() as reads:
        lp, _ = fused_is.token_logprobs(inputs.logits, inputs.tokens, backend=backend, mask=inputs.mask,
                                        validate="async")
    assert reads.ops == []
    assert_close("token_logprobs", lp, full.logprobs, 1e-6, mask=inputs.mask)


def test_full_mode_host_reads_are_counted():
    """The number the README reports: host reads of one policy_loss call + backward in each mode."""
    inputs = make_inputs("padded", dtype=torch.float32, seed=32)
    counts = {}
    for validate in ("full", "async"):
        with HostReads() as reads:
            run(inputs, "ppo_tis", "torch", grad_scale=1.7, validate=validate)
        counts[validate] = len(reads.ops)
    assert counts["async"] == 0
    # README: the value checks in one read, the row flags in one, the metrics in one, grad_output in one
    assert 0 < counts["full"] <= 4, counts


ASYNC_ERRORS = [
    # (id, override, text of the device-side assertion)
    ("tokens_out_of_range", dict(tokens=lambda i: i.tokens.clamp(min=0).fill_(64)), "tokens"),
    ("sampler_nan", dict(sampler_logprobs=lambda i: torch.full_like(i.sampler_logprobs, float("nan"))),
     "sampler_logprobs"),
    ("old_positive", dict(old_logprobs=lambda i: i.old_logprobs.abs() + 0.5), "old_logprobs"),
    ("mask_values", dict(mask=lambda i: torch.full(i.mask.shape, 2.0)), "mask"),
    ("normalizer_zero", dict(normalizer=lambda i: torch.tensor(0.0)), "normalizer"),
]


@pytest.mark.parametrize("case, override, text", ASYNC_ERRORS, ids=[c[0] for c in ASYNC_ERRORS])
def test_async_mode_asserts_on_device(case, override, text):
    """On the CPU a device-side assertion raises at once: RuntimeError naming the argument."""
    inputs = make_inputs("padded", vocab=64, dtype=torch.float32, seed=33)
    kwargs = inputs.kwargs()
    args = dict(tokens=inputs.tokens, advantages=inputs.advantages)
    for key, make in override.items():
        (args if key in args else kwargs)[key] = make(inputs)
    with pytest.raises(RuntimeError, match=text):
        fused_is.policy_loss(inputs.logits, args["tokens"], args["advantages"], backend="torch",
                             validate="async", **kwargs)


@pytest.mark.parametrize("backend", BACKENDS)
def test_async_mode_bad_logits(backend):
    inputs = make_inputs("padded", vocab=64, dtype=torch.float32, seed=34)
    inputs.mask[1, 5] = True
    inputs.logits[1, 5, 3] = float("nan")
    with pytest.raises(RuntimeError, match="logits"):
        run(inputs, "ppo_tis", backend, validate="async")


def test_validate_argument():
    inputs = make_inputs("padded", vocab=64, dtype=torch.float32, seed=35)
    with pytest.raises(ValueError, match="validate"):
        run(inputs, "ppo_tis", "torch", validate="none")
    with pytest.raises(ValueError, match="validate"):
        fused_is.token_logprobs(inputs.logits, inputs.tokens.clamp(min=0), validate=True)


def test_host_work_per_call_is_a_few_ops_per_argument():
    """README "Host work per call": one policy_loss call with its backward dispatches a bounded number of aten
    ops (each a launch on a GPU), and the per-token arguments are checked and converted as one block, so one
    more argument costs a copy and a view, not a dozen ops of its own."""
    if "cpu" not in BACKENDS:
        pytest.skip("the CPU extension is not built (`fused-is build cpu`)")
    inputs = make_inputs("padded", vocab=64, dtype=torch.float32, seed=34)
    counts = {}
    for with_ref in (True, False):
        logits = inputs.logits.detach().requires_grad_(True)
        kwargs = inputs.kwargs(ref_logprobs=inputs.ref_logprobs if with_ref else None)
        with HostReads() as reads:
            out = fused_is.policy_loss(logits, inputs.tokens, inputs.advantages, config="ppo_tis", backend="cpu",
                                       **kwargs)
            out.loss.backward()
        counts[with_ref] = reads.dispatched
        assert logits.grad is not None and torch.isfinite(logits.grad).all()
    assert counts[True] <= 150, counts  # 136 measured (255 before the prologue and epilogue were batched)
    assert counts[True] - counts[False] <= 3, counts
