"""Every bad input of DESIGN.md section 3 raises ValueError/TypeError naming the argument, before any
kernel runs (the caller's tensors are untouched)."""

import pytest
import torch

import fused_is

from cases import make_inputs

BACKENDS = ["reference", "torch"]


def _call(inputs, backend="torch", **override):
    args = dict(logits=inputs.logits, tokens=inputs.tokens, advantages=inputs.advantages)
    kwargs = inputs.kwargs()
    for key, value in override.items():
        (args if key in args else kwargs)[key] = value
    return fused_is.policy_loss(args.pop("logits"), args.pop("tokens"), args.pop("advantages"), backend=backend,
                                **kwargs)


def padded():
    return make_inputs("padded", batch=2, seq_len=4, vocab=50)


def packed():
    return make_inputs("packed", batch=2, seq_len=4, vocab=50)


CASES = [
    # (id, inputs factory, overrides, exception, argument named in the message)
    ("logits_not_tensor", padded, dict(logits=[[1.0]]), TypeError, "logits"),
    ("logits_int", padded, dict(logits=torch.zeros(2, 4, 50, dtype=torch.int32)), TypeError, "logits"),
    ("logits_1d", padded, dict(logits=torch.zeros(50)), ValueError, "logits"),
    ("logits_4d", padded, dict(logits=torch.zeros(1, 2, 4, 50)), ValueError, "logits"),
    ("tokens_float", padded, dict(tokens=torch.zeros(2, 4)), TypeError, "tokens"),
    ("tokens_shape", padded, dict(tokens=torch.zeros(2, 5, dtype=torch.long)), ValueError, "tokens"),
    ("tokens_too_big", padded, dict(tokens=torch.full((2, 4), 50)), ValueError, "tokens"),
    ("tokens_negative", padded, dict(tokens=torch.full((2, 4), -1)), ValueError, "tokens"),
    ("advantages_shape", padded, dict(advantages=torch.zeros(2, 3)), ValueError, "advantages"),
    ("advantages_int", padded, dict(advantages=torch.zeros(2, 4, dtype=torch.long)), TypeError, "advantages"),
    ("advantages_nan", padded, dict(advantages=torch.full((2, 4), float("nan"))), ValueError, "advantages"),
    ("advantages_per_seq_packed", packed, dict(advantages=torch.zeros(3)), ValueError, "advantages"),
    ("sampler_shape", padded, dict(sampler_logprobs=torch.zeros(8)), ValueError, "sampler_logprobs"),
    ("sampler_nan", padded, dict(sampler_logprobs=torch.full((2, 4), float("nan"))), ValueError, "sampler_logprobs"),
    ("sampler_inf", padded, dict(sampler_logprobs=torch.full((2, 4), -float("inf"))), ValueError, "sampler_logprobs"),
    ("sampler_missing", padded, dict(sampler_logprobs=None), ValueError, "sampler_logprobs"),
    ("old_nan", padded, dict(old_logprobs=torch.full((2, 4), float("nan"))), ValueError, "old_logprobs"),
    ("old_shape", padded, dict(old_logprobs=torch.zeros(2)), ValueError, "old_logprobs"),
    ("ref_missing_with_kl", padded, dict(ref_logprobs=None, config=fused_is.LossConfig(kl_coef=0.1)), ValueError,
     "ref_logprobs"),
    ("mask_shape", padded, dict(mask=torch.ones(2, 5, dtype=torch.bool)), ValueError, "mask"),
    ("mask_values", padded, dict(mask=torch.full((2, 4), 2.0)), ValueError, "mask"),
    ("mask_list", padded, dict(mask=[[1, 1]]), TypeError, "mask"),
    ("cu_seqlens_padded", padded, dict(cu_seqlens=torch.tensor([0, 8])), ValueError, "cu_seqlens"),
    ("cu_seqlens_short", packed, dict(cu_seqlens=torch.tensor([0, 3])), ValueError, "cu_seqlens"),
    ("cu_seqlens_long", packed, dict(cu_seqlens=torch.tensor([0, 4, 100])), ValueError, "cu_seqlens"),
    ("cu_seqlens_decreasing", packed, dict(cu_seqlens=torch.tensor([0, 5, 3, 5])), ValueError, "cu_seqlens"),
    ("cu_seqlens_float", packed, dict(cu_seqlens=torch.tensor([0.0, 5.0])), TypeError, "cu_seqlens"),
    ("cu_seqlens_needed", packed, dict(cu_seqlens=None, config="seq_tis"), ValueError, "cu_seqlens"),
    ("norm_length_needed", packed, dict(config=fused_is.LossConfig(loss_agg="seq-mean-token-sum-norm")), ValueError,
     "norm_length"),
    ("unknown_preset", padded, dict(config="ppo_tiss"), ValueError, "config"),
    ("config_type", padded, dict(config=3), TypeError, "config"),
    ("normalizer_zero", padded, dict(normalizer=0.0), ValueError, "normalizer"),
    ("normalizer_negative", padded, dict(normalizer=-4), ValueError, "normalizer"),
    ("normalizer_type", padded, dict(normalizer="4"), TypeError, "normalizer"),
    ("unknown_backend", padded, dict(backend="jax"), ValueError, "backend"),
    ("inplace_type", padded, dict(inplace=1), TypeError, "inplace"),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case_id,factory,override,exc,arg", CASES, ids=[c[0] for c in CASES])
def test_bad_input_names_argument(backend, case_id, factory, override, exc, arg):
    inputs = factory()
    logits_before = inputs.logits.clone()
    override = dict(override)
    backend = override.pop("backend", backend)
    with pytest.raises(exc, match=arg):
        _call(inputs, backend=backend, **override)
    assert torch.equal(inputs.logits, logits_before)


def test_masked_positions_may_hold_garbage():
    """NaN sampler/old logprobs and out-of-range ids at masked positions are allowed (padding)."""
    inputs = padded()
    inputs.mask[:, -1] = False
    inputs.sampler_logprobs[:, -1] = float("nan")
    inputs.old_logprobs[:, -1] = float("inf")
    inputs.tokens[:, -1] = -100
    out = _call(inputs)
    assert torch.isfinite(out.loss)


def test_tensor_on_other_device_is_named():
    inputs = padded()
    meta = torch.zeros(2, 4, device="meta")
    with pytest.raises(ValueError, match="advantages"):
        _call(inputs, advantages=meta)


def test_inplace_with_reference_is_refused():
    with pytest.raises(ValueError, match="inplace"):
        _call(padded(), backend="reference", inplace=True)


def test_unavailable_backend_is_named():
    from fused_is.backends import unavailable_reason

    for name in ("triton", "cuda", "cpu"):
        if unavailable_reason(name, padded().logits) is not None:
            with pytest.raises(ValueError, match=name):
                _call(padded(), backend=name)


@pytest.mark.parametrize(
    "kwargs,exc,arg",
    [
        (dict(temperature=0.0), ValueError, "temperature"),
        (dict(temperature=float("inf")), ValueError, "temperature"),
        (dict(backend="fast"), ValueError, "backend"),
        (dict(tokens=torch.full((2, 4), 99)), ValueError, "tokens"),
        (dict(tokens=torch.zeros(3, 4, dtype=torch.long)), ValueError, "tokens"),
        (dict(logits=torch.zeros(2, 4, 50, dtype=torch.long)), TypeError, "logits"),
    ],
)
def test_token_logprobs_bad_input(kwargs, exc, arg):
    inputs = padded()
    args = dict(logits=inputs.logits, tokens=inputs.tokens.clamp(min=0))
    args.update(kwargs)
    with pytest.raises(exc, match=arg):
        fused_is.token_logprobs(**args)


def test_advantages_per_sequence_as_b_by_1():
    """TRL's [B, 1] advantages read as one per sequence, as [B] is."""
    inputs = padded()
    per_seq = torch.randn(2)
    a = _call(inputs, advantages=per_seq)
    b = _call(inputs, advantages=per_seq[:, None])
    c = _call(inputs, advantages=per_seq[:, None].expand(2, 4).contiguous())
    assert torch.equal(a.loss, b.loss) and torch.equal(a.loss, c.loss)


@pytest.mark.parametrize("logits,hint", [
    (torch.zeros(2, 4), "looks like a per-token tensor"),  # [B, T] passed as logits
    (torch.zeros(2, 5, 50), r"logits\[:, :-1\]"),  # the model's output with one position more
    (torch.zeros(2, 9, 50), "cover the prompt"),
])
def test_logits_shape_errors_blame_logits_with_a_hint(logits, hint):
    with pytest.raises(ValueError, match=hint):
        _call(padded(), logits=logits)


@pytest.mark.parametrize("name", ["advantages", "sampler_logprobs", "old_logprobs"])
def test_non_finite_input_names_its_position(name):
    inputs = padded()
    bad = getattr(inputs, name).clone()
    bad[1, 2] = float("nan")
    with pytest.raises(ValueError, match=rf"{name} must be finite.*at position \(1, 2\)"):
        _call(inputs, **{name: bad})


def test_logits_without_grad_in_grad_mode_warn_at_the_call():
    inputs = padded()
    with pytest.warns(UserWarning, match="do not require grad"):
        _call(inputs)
    with torch.no_grad():
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("error")
            _call(inputs)  # evaluation under no_grad: nothing to say


def test_output_names_the_backend_that_ran():
    inputs = padded()
    assert _call(inputs, backend="torch").backend == "torch"
    assert _call(inputs, backend="reference").backend == "reference"
    auto = _call(inputs, backend="auto").backend
    assert auto == ("cpu" if fused_is.backends.unavailable_reason("cpu") is None else "torch")
