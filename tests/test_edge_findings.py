"""Edge cases found in review (issue 26, items 7 and 8): the reference backend at masked rows holding NaN or +-inf
whatever the temperature, the fused-linear reference at a masked row whose hidden state is NaN, and the
validation of LossConfig.sequence_log_ratio_max (GSPO's clamp of the sequence log ratio, verl's at 10)."""

import dataclasses

import pytest
import torch

import fused_is
from fused_is import LossConfig

from cases import make_inputs, make_linear_inputs

ALL_PRESETS = sorted(fused_is.PRESETS)
BAD_VALUES = {"+inf": float("inf"), "-inf": -float("inf"), "nan": float("nan")}


def _poison_masked_rows(logits: torch.Tensor, mask: torch.Tensor, value: float, dtype) -> torch.Tensor:
    """The logits with every masked row holding `value`: the first masked row wholly, the others in one entry
    each beside the largest finite magnitude of the dtype (a row that overflows once divided by tau < 1)."""
    out = logits.clone().to(dtype)
    rows = (~mask.reshape(-1)).nonzero().squeeze(1).tolist()
    assert len(rows) >= 2, "the case needs two masked rows"
    flat = out.view(-1, out.shape[-1])
    flat[rows[0]] = value
    for i, row in enumerate(rows[1:]):
        flat[row, i % flat.shape[1]] = value
        flat[row, (i + 1) % flat.shape[1]] = torch.finfo(dtype).max
    return out


def _run(logits, inputs, cfg, with_old):
    leaf = logits.clone().requires_grad_()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)  # clip_cov's random subset: the same on every run
        out = fused_is.policy_loss(leaf, inputs.tokens, inputs.advantages, config=cfg, backend="reference",
                                   **inputs.kwargs(with_old=with_old))
    out.loss.backward()
    return out, leaf.grad


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("tau", [0.5, 2.0])
@pytest.mark.parametrize("bad", list(BAD_VALUES))
@pytest.mark.parametrize("preset", ALL_PRESETS)
def test_reference_masked_rows_hold_anything(preset, bad, tau, dtype):
    """backend="reference" with masked rows holding +inf, -inf or NaN (and the dtype's largest value, which
    overflows once divided by tau = 0.5): loss, gradient, logprobs, entropy and metrics are finite, the masked
    rows' gradient is exactly 0, and loss and gradient are those of the same inputs with finite masked rows."""
    cfg = LossConfig.preset(preset, temperature=tau, entropy_coef=0.01, kl_coef=0.1,
                            **(dict(cov_seed=3) if fused_is.PRESETS[preset].policy == "clip_cov" else {}))
    inputs = make_inputs("padded", batch=3, seq_len=6, vocab=17, dtype=torch.float64, seed=11)
    masked = ~inputs.mask
    for with_old in (True, False):
        out, grad = _run(_poison_masked_rows(inputs.logits, inputs.mask, BAD_VALUES[bad], dtype), inputs, cfg,
                         with_old)
        clean, clean_grad = _run(inputs.logits.to(dtype), inputs, cfg, with_old)
        assert torch.isfinite(out.loss), out.loss
        assert bool(torch.isfinite(grad).all()), (~torch.isfinite(grad)).nonzero()[:5].tolist()
        assert bool((grad[masked] == 0).all())
        assert bool(torch.isfinite(out.logprobs).all()) and bool(torch.isfinite(out.entropy).all())
        assert all(torch.isfinite(torch.as_tensor(v)) for v in out.metrics.values()), out.metrics
        assert torch.equal(out.loss, clean.loss) and torch.equal(grad, clean_grad)
        assert out.metrics == clean.metrics


@pytest.mark.parametrize("tau", [0.5, 2.0])
@pytest.mark.parametrize("bad", list(BAD_VALUES))
def test_reference_token_logprobs_masked_rows_hold_anything(bad, tau):
    """token_logprobs(backend="reference") is finite at masked rows of NaN / +-inf, and unchanged elsewhere."""
    inputs = make_inputs("packed", batch=3, seq_len=6, vocab=17, dtype=torch.float64, seed=12)
    logits = _poison_masked_rows(inputs.logits, inputs.mask, BAD_VALUES[bad], torch.float64)
    lp, ent = fused_is.token_logprobs(logits, inputs.tokens, temperature=tau, backend="reference", mask=inputs.mask)
    clean_lp, clean_ent = fused_is.token_logprobs(inputs.logits, inputs.tokens, temperature=tau, backend="reference",
                                                  mask=inputs.mask)
    assert bool(torch.isfinite(lp).all()) and bool(torch.isfinite(ent).all())
    assert torch.equal(lp[inputs.mask], clean_lp[inputs.mask]) and torch.equal(ent[inputs.mask], clean_ent[inputs.mask])


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_linear_kernels_masked_hidden_nan(backend):
    """The fused-linear kernels already give finite gradients with a NaN hidden state at a masked row (the
    reference does not yet: test_linear_reference_masked_hidden_nan)."""
    if fused_is.backends.unavailable_reason(backend) is not None:
        pytest.skip(fused_is.backends.unavailable_reason(backend))
    _check_linear_masked_nan(backend)


def test_linear_reference_masked_hidden_nan():
    """linear_policy_loss(backend="reference") with a NaN (or inf) hidden state at a masked row: the weight's
    gradient is 0 * NaN = NaN there (fused_is/linear.py `reference_logits` multiplies the masked row's hidden
    state into the weight's gradient); hidden's and bias's gradients and the loss are finite already."""
    _check_linear_masked_nan("reference")


def _check_linear_masked_nan(backend):
    for value in (float("nan"), float("inf")):
        li = make_linear_inputs("padded", dtype=torch.float32, seed=3)
        mask = li.inputs.mask
        assert not mask[0, 1]  # make_inputs masks token 1
        hidden = li.hidden.clone()
        hidden[0, 1] = value
        leaves = [x.clone().requires_grad_() for x in (hidden, li.weight, li.bias)]
        out = fused_is.linear_policy_loss(leaves[0], leaves[1], li.inputs.tokens, li.inputs.advantages, bias=leaves[2],
                                          config="ppo_tis", backend=backend, **li.inputs.kwargs())
        out.loss.backward()
        assert torch.isfinite(out.loss)
        assert bool((leaves[0].grad[0, 1] == 0).all())
        for name, leaf in zip(("hidden", "weight", "bias"), leaves):
            assert bool(torch.isfinite(leaf.grad).all()), (name, value)


# --- LossConfig.sequence_log_ratio_max (tests/test_config.py's checks for the new field) -------------------

@pytest.mark.parametrize("overrides,exc", [
    (dict(ratio_level="sequence", sequence_log_ratio_max=0.0), ValueError),
    (dict(ratio_level="sequence", sequence_log_ratio_max=-10.0), ValueError),
    (dict(ratio_level="sequence", sequence_log_ratio_max=float("nan")), ValueError),
    (dict(ratio_level="sequence", sequence_log_ratio_max=float("inf")), ValueError),
    (dict(ratio_level="sequence", sequence_log_ratio_max="10"), TypeError),
    (dict(sequence_log_ratio_max=10.0), ValueError),  # token-level ratio: nothing to clamp
])
def test_sequence_log_ratio_max_bad_values_name_the_field(overrides, exc):
    with pytest.raises(exc, match="sequence_log_ratio_max"):
        LossConfig(**overrides)


def test_sequence_log_ratio_max_defaults_and_round_trip():
    """None by default (every preset as before); a float (ints accepted) on GSPO; its JSON form
    (dataclasses.asdict) restores it; verl's gspo maps to 10 (tests/test_integration_verl.py), OpenRLHF's and TRL's
    gspo to None."""
    import json

    assert LossConfig().sequence_log_ratio_max is None
    assert all(cfg.sequence_log_ratio_max is None for cfg in fused_is.PRESETS.values())
    cfg = LossConfig.preset("gspo", sequence_log_ratio_max=10)
    assert cfg.sequence_log_ratio_max == 10.0 and isinstance(cfg.sequence_log_ratio_max, float)
    assert LossConfig(**json.loads(json.dumps(dataclasses.asdict(cfg)))) == cfg
    assert dataclasses.replace(cfg, sequence_log_ratio_max=None) == fused_is.PRESETS["gspo"]
