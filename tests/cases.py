"""One parametrisation of cases shared by every backend's tests; the input generator, tolerances and
error measure live in fused_is/testing.py so `fused-is verify` uses the very same ones."""

from __future__ import annotations

import ast

import torch

import fused_is
from fused_is.testing import (TOLERANCES, Inputs, LinearInputs, compare_to_reference, config_for,  # noqa: F401
                              logprob_scale, loss_scale, make_inputs, make_linear_inputs, rel_err, run, tolerance)

# the seed's presets run through every matrix; the trainer policies' presets (fused_is.config.TRAINER_PRESET_NAMES)
# run as option cases below (their formulas are option cases too), which keeps CI's time in bounds
PRESET_NAMES = sorted(fused_is.config.SEED_PRESET_NAMES)

# (name, preset, overrides): options beyond the presets, each turned on alone
OPTION_CASES = [
    ("dual_clip", "ppo_tis", dict(dual_clip=1.1)),  # binds where the ratio exceeds 1.1 and A < 0
    ("clip_higher", "ppo_tis", dict(clip_low=0.2, clip_high=0.28)),
    # |lp - old| > 0.1 for about half the tokens: inside the clip range too (test_log_ratio_clamp_binds)
    ("log_ratio_clamp", "ppo", dict(log_ratio_clamp=0.1)),
    # CISPO: sg(clip(r)) A lp, with the token IS weight (verl multiplies rollout_is_weights), against the
    # sampler (ratio_ref), and with the log-ratio clamp binding (it bounds the weight, not the gradient)
    ("cispo_tis", "ppo_tis", dict(policy="cispo", clip_low=0.1, clip_high=0.05)),
    ("cispo_sampler", "ppo_is", dict(policy="cispo", clip_low=1.0, clip_high=0.1)),
    ("cispo_log_ratio_clamp", "ppo", dict(policy="cispo", clip_low=1.0, clip_high=1.0, log_ratio_clamp=0.1)),
    # KL variants: k3 value with k2 gradient (verl "k3+"), clamps that bind (|d| ~ 0.3: k3 ~ 0.05), TRL's
    # ratio-weighted KL (use_bias_correction_kl), also under REINFORCE. The names keep the deprecated booleans'
    # spelling (kl_ratio_weighted, kl_score, kl_sampler_weight): tests seed their inputs with len(name)
    ("kl_k3_plus_clamp", "ppo_tis", dict(kl_coef=0.1, kl_type="k3+", kl_clamp=0.03)),
    ("kl_k1_plus", "ppo", dict(kl_coef=0.1, kl_type="k1+")),
    ("kl_k3_clamp", "ppo_tis", dict(kl_coef=0.1, kl_type="k3", kl_clamp=0.03)),
    ("kl_k1_clamp", "reinforce", dict(kl_coef=0.1, kl_type="k1", kl_clamp=0.2)),
    ("kl_ratio_weighted", "ppo_tis", dict(kl_coef=0.1, kl_weight="ratio")),
    ("kl_ratio_weighted_reinforce", "reinforce", dict(kl_coef=0.1, kl_type="k2", kl_weight="ratio")),
    # NeMo-RL's KL: the estimator's value added to its gradient (exp(lp - sg(lp))), none where the clamp binds
    ("kl_score_k3_clamp", "ppo_tis", dict(kl_coef=0.1, kl_type="k3", kl_weight="score", kl_clamp=0.03)),
    ("kl_score_k1_gspo", "ppo", dict(kl_coef=0.1, kl_type="k1", kl_weight="score", ratio_level="sequence")),
    # ... its input clamp binding alone (|lp - ref| > 0.2 for some tokens), and its on-policy approximation: the KL
    # times exp(lp - samp) with its gradient, both clamps binding (NeMo-RL's use_on_policy_kl_approximation)
    ("kl_score_k2_input_clamp", "ppo_tis", dict(kl_coef=0.1, kl_type="k2", kl_weight="score", kl_input_clamp=0.2)),
    ("kl_sampler_weight_clamps", "ppo_tis", dict(kl_coef=0.1, kl_type="k3", kl_weight="sampler",
                                                 kl_input_clamp=0.3, kl_clamp=0.03)),
    ("kl_sampler_weight_k1_gspo", "ppo", dict(kl_coef=0.1, kl_type="k1", kl_weight="sampler",
                                              ratio_level="sequence")),
    # GSPO: the sequence's mean log ratio (|mean| ~ 0.05 here: the 0.02-0.03 clips bind for some sequences)
    ("gspo", "ppo", dict(ratio_level="sequence", clip_low=0.02, clip_high=0.03)),
    ("gspo_tis_dual_kl_entropy", "ppo_tis", dict(ratio_level="sequence", clip_low=0.02, clip_high=0.02,
                                                  dual_clip=1.01, kl_coef=0.1, entropy_coef=0.01)),
    ("gspo_seq_mean_token_mean", "ppo", dict(ratio_level="sequence", loss_agg="seq-mean-token-mean",
                                              log_ratio_clamp=0.04)),
    # SAPO: the soft gate (default temperatures, and steeper ones with the log-ratio clamp binding)
    ("sapo", "ppo", dict(policy="sapo")),
    ("sapo_tis_steep_clamp", "ppo_tis", dict(policy="sapo", sapo_tau_pos=4.0, sapo_tau_neg=6.0, log_ratio_clamp=0.2)),
    # GMPO: token log ratios (~0.15) clipped at 0.1 in the direction of A's sign, averaged per sequence
    ("gmpo", "ppo", dict(policy="gmpo", clip_low=0.1, clip_high=0.1, loss_agg="seq-mean-token-mean")),
    ("gmpo_tis_kl_entropy", "ppo_tis", dict(policy="gmpo", clip_low=0.1, clip_high=0.15, kl_coef=0.1,
                                             entropy_coef=0.01, log_ratio_clamp=0.3)),
    ("temperature", "ppo_tis", dict(temperature=0.7)),
    ("kl_k1", "ppo", dict(kl_coef=0.1, kl_type="k1")),
    ("kl_k2", "ppo", dict(kl_coef=0.1, kl_type="k2")),
    ("kl_k3", "ppo_tis", dict(kl_coef=0.1, kl_type="k3")),
    ("entropy_bonus", "ppo_tis", dict(entropy_coef=0.01)),
    ("entropy_temperature", "reinforce", dict(entropy_coef=0.05, temperature=1.3)),
    ("agg_seq_token_sum", "ppo_tis", dict(loss_agg="seq-mean-token-sum")),
    ("agg_seq_token_mean", "seq_tis", dict(loss_agg="seq-mean-token-mean")),
    ("agg_seq_token_sum_norm", "ppo_tis", dict(loss_agg="seq-mean-token-sum-norm", norm_length=16)),
    ("is_floor_truncate", "ppo_tis", dict(is_floor=0.5)),
    ("is_floor_mask", "token_mis", dict(is_floor=0.5)),
    ("geometric_truncate", "ppo", dict(is_level="geometric", is_mode="truncate", is_cap=1.1, is_floor=0.9)),
    ("reinforce_seq_mis", "reinforce", dict(is_level="sequence", is_mode="mask", is_cap=3.0)),
    ("ppo_sampler_tis", "ppo_is", dict(is_level="token", is_mode="truncate")),
    # two corrections at once: token TIS and verl's rollout_rs (a token band on pi_sampler / pi_old and a
    # sequence bound on the mean k3); rejected tokens leave the mask and every count
    ("rejection_tis_token_k1_seq_mean_k3", "ppo_tis", dict(rejection={"token_k1": (0.6, 1.8),
                                                                      "seq_mean_k3": 0.08})),
    ("rejection_seq_mis_seq_max_k2", "seq_mis", dict(rejection=[("seq_max_k2", 0.3), ("token_k3", 0.2)],
                                                     is_cap=50.0, loss_agg="seq-mean-token-mean")),
    ("rejection_seq_sum_k1_k2", "ppo", dict(rejection={"seq_sum_k1": (0.3, 4.0), "seq_sum_k2": 0.9})),
    # OpenRLHF's gates: the policy term of a rejected token times 0, counts kept; divergences of the sampled
    # token's probability (binary KL, TV), per token and as a sequence mean, with the raw token IS weight
    ("gate_keep_seq_mean_k1_raw", "vanilla_is", dict(rejection={"seq_mean_k1": (0.95, 1.05)},
                                                     rejection_counts="keep")),
    ("gate_keep_token_binary_kl", "vanilla_is", dict(rejection={"token_binary_kl": 0.002}, rejection_counts="keep",
                                                     kl_coef=0.1, kl_type="k2", kl_clamp=10.0)),
    ("gate_drop_seq_mean_tv_seq_agg", "ppo_tis", dict(rejection={"seq_mean_tv": 0.01, "token_tv": 0.03},
                                                      loss_agg="seq-mean-token-mean")),
    # the entropy bonus aggregated on its own (TRL: a token mean whatever the loss type)
    ("entropy_agg_token_mean", "ppo_tis", dict(loss_agg="seq-mean-token-mean", entropy_coef=0.05,
                                               entropy_agg="token-mean", kl_coef=0.1)),
    ("entropy_agg_seq_mean", "reinforce_tis", dict(entropy_coef=0.1, entropy_agg="seq-mean-token-mean")),
    # TRL's VESPO: REINFORCE under a gamma weight of the sequence ratio (with the token IS weight folded in)
    ("vespo", "reinforce", dict(policy="vespo", is_level="none")),
    ("vespo_tis_kl", "reinforce_tis", dict(policy="vespo", vespo_k_pos=1.5, vespo_lambda_neg=2.5, kl_coef=0.1,
                                           is_cap=1.5)),
    # verl's DPPO: a capped ratio weight inside a trust region on the token probabilities (TV or binary KL)
    ("dppo_tv", "ppo", dict(policy="dppo_tv", clip_low=0.003, clip_high=0.002, ratio_cap=1.1, log_ratio_clamp=20.0)),
    ("dppo_kl_tis_kl", "ppo_tis", dict(policy="dppo_kl", clip_low=2e-4, clip_high=1e-4, ratio_cap=1.1, kl_coef=0.1)),
    # verl's KL-Cov and Clip-Cov: a selection of tokens by cov(A, lp) over the batch (Clip-Cov's at random)
    ("kl_cov", "ppo", dict(policy="kl_cov", cov_ratio=0.2, cov_kl_coef=0.5)),
    ("clip_cov_tis_kl", "ppo_tis", dict(policy="clip_cov", cov_ratio=0.3, cov_bounds=(-0.5, 3.0), cov_seed=7,
                                        clip_low=0.05, clip_high=0.08, kl_coef=0.1)),
    # prime-rl's loss with a mask that binds on some tokens (the test inputs' probabilities move by ~1e-3) and a
    # larger penalty, the is weight and KL composed
    ("prime_rl_binds_tis_kl", "prime_rl", dict(clip_low=0.002, clip_high=0.001, ratio_penalty_coef=0.05,
                                               is_level="token", kl_coef=0.1)),
    # the trainer policies' presets as they are (clip_cov's random draw seeded, so both sides draw the same)
    *[(f"preset_{name}", name, dict(cov_seed=3) if name == "clip_cov" else {})
      for name in fused_is.config.TRAINER_PRESET_NAMES],
    # TRL's off-policy sequence mask: the policy term of drifted sequences with A < 0 is dropped
    ("off_policy_mask", "ppo", dict(off_policy_mask=0.05, kl_coef=0.1, kl_type="k3")),
    ("off_policy_mask_tis_seq_agg", "ppo_tis", dict(off_policy_mask=0.0, loss_agg="seq-mean-token-mean")),
    ("gspo_off_policy_mask", "ppo", dict(ratio_level="sequence", clip_low=0.02, clip_high=0.03,
                                         off_policy_mask=0.02)),
]

def assert_close(name: str, actual: torch.Tensor, expected: torch.Tensor, tol: float, mask=None, scale=None) -> None:
    """Norm-relative comparison (to `scale` when given) that prints the worst index on failure."""
    actual, expected = actual.detach().double(), expected.detach().double()
    if mask is not None:
        actual, expected = actual[mask], expected[mask]
    assert actual.shape == expected.shape, f"{name}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert torch.isfinite(actual).all(), f"{name}: non-finite values at {(~torch.isfinite(actual)).nonzero()[:5].tolist()}"
    err = rel_err(actual, expected, scale)
    if not err <= tol:
        worst = (actual - expected).abs().argmax()
        idx = list(torch.unravel_index(worst, actual.shape)) if actual.dim() else []
        raise AssertionError(
            f"{name}: relative error {err:.3e} > {tol:.1e}; worst at {[int(i) for i in idx]}: "
            f"{float(actual.reshape(-1)[worst]):.9g} vs {float(expected.reshape(-1)[worst]):.9g}"
        )


def check_against_reference(inputs: Inputs, config, backend: str, *, grad_scale: float = 1.7,
                            inplace=False, with_old=True, tol=None, logits=None):
    """backend at the inputs' dtype vs the float64 reference on the same values: loss, grad, lp, H, metrics.
    logits: differentiate this leaf as it is (see fused_is.testing.run) instead of a copy of inputs.logits."""
    dtype = inputs.logits.dtype
    tol = tol or tolerance(dtype, backend)
    _, (out, grad), (ref, ref_grad), scale = compare_to_reference(inputs, config, backend, grad_scale=grad_scale,
                                                                  inplace=inplace, with_old=with_old, logits=logits)
    assert grad.dtype == dtype and grad.shape == inputs.logits.shape
    assert_outputs_close(out, grad, ref, ref_grad, inputs.mask, tol, scale)
    return out, grad, ref, ref_grad


def assert_outputs_close(out, grad, ref, ref_grad, valid, tol: dict, scale: float) -> None:
    """A policy_loss output and its gradient against the reference's: loss (relative to `scale`), gradient,
    logprobs at the valid positions, entropy and every metric (tol: a `tolerance` dict)."""
    assert_close("loss", out.loss, ref.loss, tol["loss"], scale=scale)
    assert_close("grad", grad, ref_grad, tol["grad"])
    assert_close("logprobs", out.logprobs, ref.logprobs, tol["logprobs"], mask=valid,
                 scale=logprob_scale(ref.logprobs[valid]))
    assert_close("entropy", out.entropy, ref.entropy, tol["logprobs"], scale=logprob_scale(ref.entropy))
    assert_metrics_close(out.metrics, ref.metrics, tol, valid)


def assert_metrics_close(metrics: dict, ref_metrics: dict, tol: dict, valid) -> None:
    """The same metric names, each value within 10 x tol["loss"] relative (fractions can flip on a tie at the
    dtype's rounding: one token's worth of slack; everything else is a smooth statistic)."""
    assert set(metrics) == set(ref_metrics), (sorted(metrics), sorted(ref_metrics))
    for key, value in ref_metrics.items():
        slack = 1.0 / max(1, int(valid.sum())) + 1e-12 if key.endswith("_frac") else 0.0
        assert abs(metrics[key] - value) <= tol["loss"] * max(1.0, abs(value)) * 10 + slack, (key, metrics[key], value)


# --- fused linear (tests/test_linear.py, tests/test_gpu.py) ------------------------------------------

CHUNK = 5  # rows per chunk: splits the padded sequences of 8 rows and the packed ones of 8, 5, 2


def run_linear(li: LinearInputs, config, backend: str, *, grad_scale: float = 1.7, with_old: bool = True,
               logits_dtype=None, chunk_size=CHUNK, want=(True, True, True), **extra):
    """(output, (grad hidden, grad weight, grad bias)) of linear_policy_loss on fresh leaves."""
    leaves = [None if x is None else x.detach().clone().requires_grad_(w)
              for x, w in zip((li.hidden, li.weight, li.bias), want)]
    hidden, weight, bias = leaves
    out = fused_is.linear_policy_loss(hidden, weight, li.inputs.tokens, li.inputs.advantages, bias=bias,
                                      logits_dtype=logits_dtype, chunk_size=chunk_size, config=config, backend=backend,
                                      **li.inputs.kwargs(with_old=with_old, **extra))
    if out.loss.requires_grad:
        (out.loss * grad_scale).backward()
    return out, tuple(None if x is None else x.grad for x in leaves)


def linear_tolerance(dtype: torch.dtype, backend: str, logits_dtype=None) -> dict:
    """Bounds against the float64 reference. fp32: the kernels' fp32 bounds, and the gradients of hidden and
    weight are fp32 GEMMs over V and N terms (a few 1e-6). A bf16/fp16 head rounds every logit to its dtype
    first (as the model's own head does): lp moves by up to ulp(|z|) ~ 2^-8 |z| (bf16), so loss and logprobs
    are bounded by that rounding, not by the kernel; an fp32 head (logits_dtype) removes it, and what is left
    is the rounding of the stored gradients to the input dtype."""
    head = logits_dtype or dtype
    if head == torch.float64:
        return dict(loss=1e-10, grad=1e-10, logprobs=1e-10)
    if head == torch.float32:
        fp32 = dict(loss=1e-5, grad=1e-5, logprobs=1e-6)
        if dtype in (torch.bfloat16, torch.float16):  # gradients stored in the input dtype
            fp32["grad"] = tolerance(dtype, backend)["grad"]
        return fp32
    # the head's rounding: 2^-8 (bf16) or 2^-11 (fp16) relative on logits of magnitude up to ~8
    rounding = 2.0 ** -8 if head == torch.bfloat16 else 2.0 ** -11
    return dict(loss=4 * rounding, grad=8 * rounding, logprobs=16 * rounding)


def check_linear(li: LinearInputs, config, backend: str, *, with_old=True, logits_dtype=None, tol=None, **kwargs):
    """linear_policy_loss on `backend` vs backend="reference" (float64 logits, autograd) on the same values."""
    dtype = li.hidden.dtype
    tol = tol or linear_tolerance(dtype, backend, logits_dtype)
    out, grads = run_linear(li, config, backend, with_old=with_old, logits_dtype=logits_dtype, **kwargs)
    ref, ref_grads = run_linear(li, config, "reference", with_old=with_old, **kwargs)
    valid = li.inputs.mask
    scale = max(abs(ref.loss.item()), loss_scale(li.inputs, config, with_old=with_old))
    assert out.loss.dtype == (torch.float64 if (logits_dtype or dtype) == torch.float64 else torch.float32)
    assert_close("loss", out.loss, ref.loss, tol["loss"], scale=scale)
    for name, g, r, x in zip(("hidden", "weight", "bias"), grads, ref_grads, (li.hidden, li.weight, li.bias)):
        if x is None:
            assert g is None
            continue
        assert g.dtype == x.dtype and g.shape == x.shape, (name, g.dtype, g.shape)
        assert_close(f"grad {name}", g, r, tol["grad"])
    assert_close("logprobs", out.logprobs, ref.logprobs, tol["logprobs"], mask=valid,
                 scale=logprob_scale(ref.logprobs[valid]))
    assert_close("entropy", out.entropy, ref.entropy, tol["logprobs"], scale=logprob_scale(ref.entropy))
    assert_metrics_close(out.metrics, ref.metrics, tol, valid)
    return out, grads, ref, ref_grads


def count_calls(monkeypatch, module, names):
    """{name: 0} counting each call of module.<name> from now on (a backend's stats and fused: each one read of the
    logits)."""
    calls = {n: 0 for n in names}
    for n in names:
        original = getattr(module, n)

        def wrapper(*args, _n=n, _f=original, **kwargs):
            calls[_n] += 1
            return _f(*args, **kwargs)

        monkeypatch.setattr(module, n, wrapper)
    return calls


def _areal_nodes(path: str, names=None, kinds=(ast.FunctionDef,)):
    """The top-level definitions (of `kinds`; those named `names`, or all; assignments of constants only) of AReaL's
    installed file `path` (relative to the package), as an ast.Module, and the file's path."""
    import importlib.metadata
    import importlib.util

    assert importlib.metadata.version("areal") == "1.0.4", "the suite compares with AReaL 1.0.4 (scripts/dev.sh)"
    path = importlib.util.find_spec("areal").submodule_search_locations[0] + "/" + path
    tree = ast.parse(open(path).read())
    picked = [node for node in tree.body if isinstance(node, kinds) and (names is None or node.name in names)
              and (not isinstance(node, ast.Assign) or isinstance(node.value, ast.Constant))]
    if names is not None:
        assert sorted(node.name for node in picked) == sorted(names), f"AReaL's {names} moved"
    return ast.Module(body=picked, type_ignores=[]), path


def areal_functions(*names):
    """AReaL 1.0.4's own functions `names`, read from its installed areal/trainer/ppo/actor.py (the module itself
    imports AReaL's whole training stack, which the suite does not install: scripts/dev.sh installs the wheel
    alone), compiled as they are with torch in scope."""
    module, path = _areal_nodes("trainer/ppo/actor.py", names)
    scope = {"torch": torch}
    exec(compile(module, path, "exec"), scope)
    return [scope[name] for name in names]


class _NoStats:
    """A stand-in for AReaL's stats_tracker and logger: every call records nothing (they only log) and returns a
    context manager doing nothing (stats_tracker.scope)."""

    def __getattr__(self, name):
        return lambda *args, **kwargs: self

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def areal_loss_code() -> dict:
    """AReaL 1.0.4's actor loss as installed: every function of areal/trainer/ppo/actor.py (grpo_loss_fn and its
    helpers) and of areal/utils/functional/functional.py (ppo_actor_loss_fn, sapo_loss_fn, apply_rejection_sampling,
    ...), KLEstimator (areal/utils/data.py) and RejectionSamplingConfig (areal/api/cli_args.py), compiled unchanged
    into one namespace, which is returned. Their modules import AReaL's training stack (hydra, transformers, ...), so
    the definitions are read from the files; areal/utils/constants.py and areal/trainer/ppo/stats.py import nothing
    of AReaL and are loaded whole; only stats_tracker and the logger (logging, no effect on the loss) are stand-ins."""
    import dataclasses
    import functools
    import importlib.util
    import typing

    import numpy

    scope = {"torch": torch, "dist": torch.distributed, "np": numpy, "functools": functools, "Any": typing.Any,
             "dataclass": dataclasses.dataclass, "field": dataclasses.field, "stats_tracker": _NoStats(),
             "logger": _NoStats()}
    root = importlib.util.find_spec("areal").submodule_search_locations[0]
    for name in ("utils/constants.py", "trainer/ppo/stats.py"):
        spec = importlib.util.spec_from_file_location(f"_areal_{name.replace('/', '_')[:-3]}", f"{root}/{name}")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        scope.update({k: v for k, v in vars(module).items() if not k.startswith("__")})
    for path, names, kinds in (("api/cli_args.py", ["RejectionSamplingConfig"], (ast.ClassDef,)),
                               ("utils/data.py", ["KLEstimator"], (ast.ClassDef,)),
                               ("utils/functional/functional.py", None, (ast.FunctionDef, ast.ClassDef)),
                               ("trainer/ppo/actor.py", None, (ast.FunctionDef, ast.Assign))):
        module, file = _areal_nodes(path, names, kinds)
        exec(compile(module, file, "exec"), scope)
    return scope
