"""verl (0.9.1) with fused_is: the engine's PPO actor loss from the engine's own packed logits.

verl's engine computes log_probs (and entropy) from the packed, padding-free logits of each micro-batch and
hands them with a TensorDict to `verl.workers.utils.losses.ppo_loss`. `ppo_loss_from_logits` takes those
logits instead, in the same layout and with the same TensorDict, and computes the same loss in one fused
pass (no fp32 [tokens, V] log-softmax, the gradient written by the kernel). `config_from_verl` reads the
actor config: every option that shapes the loss is mapped exactly or refused by name.

verl computes its rollout-correction IS weights and rejection mask in the trainer, before the loss: they
arrive in the TensorDict (`rollout_is_weights`, and the modified `response_mask`) and are used as they are
(`is_weights=`, `mask=`), so every rollout_is / rollout_rs option is reproduced without a mapping.

The engine hook: `patch_engine()` makes verl's FSDP LM-head engine hand each micro-batch's packed logits (and its
per-row temperatures, undivided) to `engine_ppo_loss` instead of computing log_probs, and `engine_ppo_loss` is
a drop-in for `ppo_loss` in `worker.set_loss_fn(partial(..., config=actor_config))`. Both are done inside verl's
workers by `actor_rollout_ref.model.external_lib=fused_is.integrations.verl_plugin`. With Ulysses sequence
parallelism each rank keeps its slice of the logits and fused_is reduces over the sequence-parallel group.

Importing this module imports verl; `import fused_is` does not.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from typing import Dict, Tuple

import torch
import verl  # noqa: F401  (the trainer this module maps; fails clearly where it is not installed)

import fused_is
from fused_is.config import LossConfig

_AGG = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
_KL = {"kl": "k1", "k1": "k1", "mse": "k2", "k2": "k2", "low_var_kl": "k3", "k3": "k3"}
_SUPPORTED_MODES = ("vanilla", "gspo", "cispo", "sapo", "dppo_tv", "dppo_kl", "clip_cov", "kl_cov", "geo_mean", "gpg",
                    "dro", "bypass_mode")


def _get(cfg, name, default=None):
    return cfg.get(name, default) if hasattr(cfg, "get") else getattr(cfg, name, default)


def _refuse(option: str, value, why: str):
    raise ValueError(f"verl actor config {option}={value!r} is not supported by fused_is.integrations.verl: {why}")


def config_from_verl(actor_config) -> LossConfig:
    """The LossConfig of a verl `ActorConfig` (actor_rollout_ref.actor): policy_loss.loss_mode, the clip
    ratios, clip_ratio_c, loss_agg_mode, loss_scale_factor, entropy_coeff, use_kl_loss / kl_loss_coef /
    kl_loss_type, tau_pos / tau_neg.

    The aggregation's global counts (dp_size, batch_num_tokens, global_batch_size) are per micro-batch data
    and become `normalizer=` in `ppo_loss_from_logits`; "token-sum" is mapped there too.
    Raises ValueError naming each option fused_is does not reproduce exactly.
    """
    mode = _loss_mode(actor_config)
    if mode not in _SUPPORTED_MODES:
        _refuse("policy_loss.loss_mode", mode, f"expected one of {_SUPPORTED_MODES}")
    agg = _get(actor_config, "loss_agg_mode", "token-mean")
    if agg not in _AGG:
        _refuse("loss_agg_mode", agg, f"expected one of {_AGG}")
    clip = float(_get(actor_config, "clip_ratio", 0.2))
    low, high = _get(actor_config, "clip_ratio_low"), _get(actor_config, "clip_ratio_high")
    fields = dict(ratio_ref="old", is_level="none", is_cap=float("inf"), clip_low=float(clip if low is None else low),
                  clip_high=float(clip if high is None else high),
                  loss_agg="token-mean" if agg == "token-sum" else agg,
                  entropy_coef=float(_get(actor_config, "entropy_coeff", 0.0) or 0.0))
    if agg == "seq-mean-token-sum-norm" and _get(actor_config, "loss_scale_factor") is not None:
        fields["norm_length"] = int(_get(actor_config, "loss_scale_factor"))
    if mode == "bypass_mode":  # old_log_probs are the rollout's: PPO-clip against them, or REINFORCE with IS weights
        mode = _bypass_fields(_get(_get(actor_config, "policy_loss", {}), "rollout_correction"), fields)
    if mode == "vanilla":  # verl: the log ratio clamped to +-20, and the dual clip always on
        fields.update(policy="ppo", log_ratio_clamp=20.0, dual_clip=float(_get(actor_config, "clip_ratio_c", 3.0)))
    elif mode == "gspo":  # the sequence ratio (the same gradient as verl's when A is one per sequence: checked),
        # its log clamped from above at 10 as verl's (a sequence beyond has no gradient there)
        fields.update(policy="ppo", ratio_level="sequence", sequence_log_ratio_max=10.0)
    elif mode == "cispo":  # sg(clip(r, 1 - low, 1 + high)) A lp, log r clamped to +-20
        fields.update(policy="cispo", log_ratio_clamp=20.0)
    elif mode in ("dppo_tv", "dppo_kl"):  # the clip ratios bound the probability move; clip_ratio_c caps the ratio
        fields.update(policy=mode, log_ratio_clamp=20.0, ratio_cap=float(_get(actor_config, "clip_ratio_c", 20.0)))
    elif mode in ("clip_cov", "kl_cov"):  # no log-ratio clamp, no dual clip; the selection over the micro-batch
        loss_cfg = _get(actor_config, "policy_loss", {})
        get = lambda name, default: float(default if _get(loss_cfg, name) is None else _get(loss_cfg, name))  # noqa: E731
        if mode == "clip_cov":  # the random subset from torch's default CPU generator, as verl draws it
            fields.update(policy="clip_cov", cov_ratio=get("clip_cov_ratio", 0.0002),
                          cov_bounds=(get("clip_cov_lb", 1.0), get("clip_cov_ub", 5.0)))
        else:
            fields.update(policy="kl_cov", cov_ratio=get("kl_cov_ratio", 0.0002), cov_kl_coef=get("ppo_kl_coef", 1.0))
    elif mode == "geo_mean":  # GMPO: -A_i R_i averaged over the micro-batch's B sequences, whatever loss_agg_mode
        if _get(actor_config, "use_kl_loss", False):
            _refuse("use_kl_loss", True, "verl's geo_mean averages its policy term over the sequences and the KL "
                    "term by loss_agg_mode; one fused loss gives its KL term the policy's aggregation")
        if fields["entropy_coef"] != 0.0:  # the entropy term keeps loss_agg_mode (entropy_agg)
            if agg not in ("token-mean", "seq-mean-token-mean"):
                _refuse("loss_agg_mode", agg, "with geo_mean and an entropy term: token-mean or seq-mean-token-mean")
            fields["entropy_agg"] = agg
        fields.update(policy="gmpo", loss_agg="seq-mean-token-mean")
    elif mode == "gpg":  # -A lp (times the rollout IS weights when given): REINFORCE
        fields.update(policy="reinforce")
    elif mode == "dro":  # -(A lp - beta/2 (lp - old)^2): REINFORCE plus a k2 term towards the old logprobs
        beta = _get(_get(actor_config, "policy_loss", {}), "dro_beta")
        if beta is None or not float(beta) > 0:
            _refuse("policy_loss.dro_beta", beta, "DRO needs a positive dro_beta (as verl)")
        if _get(actor_config, "use_kl_loss", False):
            _refuse("use_kl_loss", True, "with dro: fused_is's one KL term is DRO's penalty towards the old logprobs")
        fields.update(policy="reinforce", kl_coef=float(beta), kl_type="k2")
    elif mode == "sapo":  # verl aggregates SAPO's policy term as seq-mean-token-mean whatever loss_agg_mode says
        uses_agg = fields["entropy_coef"] != 0.0 or _get(actor_config, "use_kl_loss", False)
        if agg != "seq-mean-token-mean" and uses_agg:
            _refuse("loss_agg_mode", agg, "verl's SAPO aggregates its policy term per sequence and the entropy and "
                    "KL terms by loss_agg_mode; one fused loss has one aggregation (use seq-mean-token-mean)")
        fields.update(policy="sapo", log_ratio_clamp=20.0, loss_agg="seq-mean-token-mean",
                      sapo_tau_pos=float(_get(actor_config, "tau_pos", 1.0)),
                      sapo_tau_neg=float(_get(actor_config, "tau_neg", 1.05)))
    if _get(actor_config, "use_kl_loss", False):
        kind = _get(actor_config, "kl_loss_type", "low_var_kl")
        plus = kind.endswith("+") and kind[:-1] not in ("mse", "k2")
        base = kind[:-1] if kind.endswith("+") else kind
        if base not in _KL:
            _refuse("kl_loss_type", kind, f"expected one of {sorted(_KL)} (optionally with '+')")
        fields.update(kl_coef=float(_get(actor_config, "kl_loss_coef", 0.001)),
                      kl_type=_KL[base] + ("+" if plus else ""))
        if _KL[base] == "k3":  # verl: low_var_kl clamped to [-10, 10]
            fields["kl_clamp"] = 10.0
    return LossConfig(**fields)


def _lengths(data) -> Tuple[torch.Tensor, torch.Tensor, int]:
    """(prompt lengths [B], response lengths [B], max response length) of the engine's layout, as
    verl.workers.utils.padding.no_padding_2_padding reads them."""
    prompts, responses = data["prompts"], data["responses"]
    if prompts.is_nested:
        prompt_lens, response_lens = prompts.offsets().diff(), responses.offsets().diff()
        width = int(response_lens.max()) if len(response_lens) else 0
    else:
        attention = data["attention_mask"]
        prompt_lens = attention[:, : prompts.shape[1]].sum(dim=1)
        response_lens = attention[:, prompts.shape[1]:].sum(dim=1)
        width = responses.shape[1]
    return prompt_lens.long(), response_lens.long(), width


def ppo_loss_from_logits(config, logits: torch.Tensor, data, dp_group=None, *, temperature=None,
                         backend: str = "auto", inplace: bool = False,
                         sequence_parallel=None) -> Tuple[torch.Tensor, Dict[str, object]]:
    """verl's `ppo_loss(config, model_output, data)` from the engine's logits instead of its log_probs.

    Args:
        config: verl ActorConfig (mapped by `config_from_verl`).
        logits: [total_nnz, V] (or a jagged nested tensor of them): the engine's packed, padding-free logits of
            every sequence of the micro-batch, prompt and response, in data's order, divided by the rollout
            temperature as the engine does (or not, when `temperature` is given); row i scores token i + 1 of its
            sequence.
        data: the micro-batch TensorDict verl's ppo_loss takes: prompts and responses (jagged nested, or
            padded with attention_mask), response_mask, old_log_probs, advantages, optional rollout_is_weights
            and ref_log_prob (response-shaped), and the non-tensor dp_size, batch_num_tokens, global_batch_size.
        dp_group: unused (verl's signature).
        temperature: None (the logits are already divided), or the rollout temperature fused_is divides the raw
            logits by inside its kernels (no [total_nnz, V] division): a number, or verl's per-sample temperature
            (micro_batch["temperature"]), a tensor [B] of one per sequence, or [total_nnz] of one per packed row
            (the engine's temperature_rmpad).
        backend: fused_is backend.
        inplace: write the gradient into `logits` (policy_loss's inplace: no second [total_nnz, V] buffer); for
            logits nothing else will read, such as the engine's output handed over by `patch_engine`.
        sequence_parallel: None, or (group, pad_rows) for verl's Ulysses sequence parallelism: `logits` are then
            this rank's [L, V] slice of the micro-batch's packed rows, padded at the end by pad_rows rows to
            L x (group size) and split in rank order (verl's ulysses_pad_and_slice_inputs); a per-row
            `temperature` is this rank's [L] slice too. Every sequence statistic and total is reduced over the
            group (fused_is's sequence_group), so each rank gets the whole micro-batch's loss and metrics, as
            verl's gathered log_probs give it, and the gradient of its own rows, scaled by the group size as
            verl's gather scales it (FSDP averages the gradient over the data- and sequence-parallel ranks).
    Returns:
        (loss, metrics): the loss verl's ppo_loss returns (differentiable w.r.t. logits) and a dict of floats:
        "actor/pg_loss" (the whole fused loss: policy, entropy and KL terms together), "actor/pg_clipfrac" and
        "actor/ppo_kl" (PPO-type losses), and fused_is's own metrics as "fused_is/<name>".
    """
    values = logits.values() if logits.is_nested else logits
    if sequence_parallel is not None:
        return _ulysses_loss(config, values, data, sequence_parallel, temperature, backend, inplace)
    cfg, keywords = _loss_inputs(config, data, values.shape[:1], values.dim() == 2, values.device, "logits")
    cfg = _with_temperature(cfg, keywords, temperature)
    out = fused_is.policy_loss(values, config=cfg, backend=backend, inplace=inplace, **keywords)
    return out.loss, _metrics(out)


_PER_ROW = ("tokens", "advantages", "sampler_logprobs", "old_logprobs", "ref_logprobs", "mask", "is_weights")


def _ulysses_loss(config, values, data, sequence_parallel, temperature, backend, inplace):
    """ppo_loss_from_logits on this rank's slice of verl's Ulysses layout (see its sequence_parallel)."""
    import torch.distributed as dist

    group, pad = sequence_parallel
    pad = int(pad)
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    if values.dim() != 2 or pad < 0 or pad > values.shape[0] * size:
        raise ValueError(f"logits must be this rank's [L, V] slice of the padded packed rows with 0 <= pad_rows <= "
                         f"L x {size}; got shape {tuple(values.shape)} and pad_rows={pad}")
    local = values.shape[0]
    cfg, keywords = _loss_inputs(config, data, (local * size - pad,), True, values.device, "logits (all ranks' rows)")
    # verl's gather scales the local rows' gradient by the group size. Here the kernel writes it so scaled (the
    # denominators over `size`: the loss is `size` times verl's), and the value is divided back below, its
    # gradient passed on unchanged: no second pass over the [L, V] gradient.
    for key, agg in (("normalizer", cfg.loss_agg), ("entropy_normalizer", cfg.entropy_agg)):
        if agg is not None or key == "normalizer":
            given = keywords.get(key)
            keywords[key] = (_denominator(agg, keywords) if given is None else float(given)) / size
    keywords = ulysses_rows(keywords, rank, local, pad)
    cfg = _with_temperature(cfg, keywords, temperature)
    out = fused_is.policy_loss(values, config=cfg, backend=backend, inplace=inplace, sequence_group=group, **keywords)
    loss = _ValueTimes.apply(out.loss, 1.0 / size)
    return loss, _metrics(out, loss)


def _denominator(agg: str, keywords) -> float:
    """The count policy_loss divides by for aggregation `agg` without a normalizer, over the whole micro-batch's
    packed rows: unmasked tokens (token-mean), or sequences with an unmasked token; 1 when it is 0 (the loss is
    0 then)."""
    mask = keywords["mask"]
    if agg == "token-mean":
        count = float(mask.sum())
    else:  # a sequence's unmasked tokens: the difference of the mask's running count at its two offsets
        running = torch.cat([mask.new_zeros(1, dtype=torch.long), mask.long().cumsum(0)])[keywords["cu_seqlens"]]
        count = float((running.diff() > 0).sum())
    return count if count > 0 else 1.0


def ulysses_rows(keywords: Dict[str, object], rank: int, local: int, pad: int) -> Dict[str, object]:
    """The policy_loss keywords of the whole micro-batch's packed rows (`_loss_inputs`) cut to rank `rank`'s
    `local` rows of verl's Ulysses layout: the rows padded at the end by `pad` masked rows (in the last
    sequence's segment), then split in rank order; cu_seqlens becomes this rank's segment of each sequence
    (empty where it holds none of it), as fused_is's sequence_group takes it."""
    begin, end = rank * local, (rank + 1) * local
    out = dict(keywords)
    for key in _PER_ROW:
        x = keywords.get(key)
        if x is not None:
            x = torch.cat([x, x.new_zeros(pad)]) if pad else x  # tokens 0, values 0, mask False
            out[key] = x[begin:end]
    offsets = keywords["cu_seqlens"].clone()
    offsets[-1] += pad
    out["cu_seqlens"] = (offsets - begin).clamp(0, local)
    return out


class _ValueTimes(torch.autograd.Function):
    """x times `factor` forward; the gradient passed back unchanged (the kernel wrote the gradient of x / factor)."""

    @staticmethod
    def forward(ctx, x, factor: float):
        return x * factor

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def ppo_loss_from_hidden(config, hidden: torch.Tensor, weight: torch.Tensor, data, dp_group=None, *,
                         bias=None, head_dtype=None, temperature=1.0, chunk_size=None,
                         backend: str = "auto") -> Tuple[torch.Tensor, Dict[str, object]]:
    """`ppo_loss_from_logits` from the engine's last hidden states and the lm_head weight (the fused-linear
    path: logits = hidden @ weight.T (+ bias) chunk by chunk, never [total_nnz, V]), as verl's
    use_fused_kernels path computes its log_probs from hidden states.

    Args:
        hidden: [total_nnz, D] (or jagged nested) packed hidden states of the micro-batch, in data's order.
        weight: [V, D] lm_head weight; bias: [V] or None; chunk_size: as for linear_policy_loss.
        head_dtype: the dtype the GEMM forms the logits in: linear_policy_loss's logits_dtype.
        temperature: the rollout temperature the engine divides the logits by: a number, or verl's per-sample
            temperature (micro_batch["temperature"]), a tensor [B] of one per sequence.
        config, data, dp_group, backend: as for `ppo_loss_from_logits`.
    Returns:
        (loss, metrics) as `ppo_loss_from_logits`; the loss is differentiable w.r.t. hidden, weight and bias.
    """
    values = hidden.values() if hidden.is_nested else hidden
    cfg, keywords = _loss_inputs(config, data, values.shape[:1], values.dim() == 2, values.device, "hidden")
    cfg = _with_temperature(cfg, keywords, temperature)
    out = fused_is.linear_policy_loss(values, weight, bias=bias, logits_dtype=head_dtype, chunk_size=chunk_size,
                                      config=cfg, backend=backend, **keywords)
    return out.loss, _metrics(out)


def _with_temperature(cfg, keywords, temperature):
    """The config with one temperature, or the keywords with verl's per-sample temperatures ([B], one per
    sequence: fused_is spreads them over each sequence's packed rows through cu_seqlens; or [total_nnz], one per
    packed row)."""
    if temperature is None:
        return cfg
    if isinstance(temperature, torch.Tensor) and temperature.numel() != 1:
        sequences, rows = keywords["cu_seqlens"].numel() - 1, int(keywords["tokens"].numel())
        if temperature.dim() != 1 or temperature.numel() not in (sequences, rows):
            raise ValueError(f"temperature must be a number, verl's per-sample temperature [{sequences}] (one per "
                             f"sequence of the micro-batch) or one per packed row [{rows}]; got shape "
                             f"{tuple(temperature.shape)}")
        keywords["temperature"] = temperature.to(keywords["cu_seqlens"].device)
        return cfg
    return dataclasses.replace(cfg, temperature=float(temperature))


# the keys under which a patched engine hands the packed logits and their temperatures to engine_ppo_loss
LOGITS_KEY, TEMPERATURE_KEY = "fused_is/logits", "fused_is/temperature"
SEQUENCE_PARALLEL_KEY = "fused_is/sequence_parallel"  # Ulysses: (the engine's sequence-parallel group, pad rows)


def engine_ppo_loss(config, model_output, data, dp_group=None, *, backend: str = "auto",
                    inplace="forward") -> Tuple[torch.Tensor, Dict[str, object]]:
    """verl's engine loss `ppo_loss(config, model_output, data, dp_group)` computed by fused_is from the packed
    logits that an engine patched by `patch_engine` hands over in model_output (it never computed log_probs):
    `worker.set_loss_fn(functools.partial(engine_ppo_loss, config=actor_config))`.

    Args:
        config: verl ActorConfig (mapped by `config_from_verl`); data, dp_group: as verl passes them.
        model_output: the patched engine's {LOGITS_KEY: [total_nnz, V] raw logits, TEMPERATURE_KEY: None or
            [total_nnz] per-row temperatures}; both are taken out of it (the engine keeps model_output after the
            loss: the logits are not held past this call).
        backend: fused_is backend; inplace: policy_loss's: "forward" (default: the gradient written into the
            engine's logits in the loss's one sweep, nothing else reads them), True (in backward) or False.
    Returns:
        (loss, metrics) as `ppo_loss_from_logits`.
    """
    if LOGITS_KEY not in model_output:
        if "log_probs" in model_output:  # an engine the hook does not patch (Megatron, ...): verl's own loss, exactly
            from verl.workers.utils.losses import ppo_loss

            if not _FELL_BACK:
                warnings.warn("engine_ppo_loss: this verl engine computed log_probs (fused_is patches the FSDP LM-head "
                              "engine only); verl's own ppo_loss runs on them, not fused_is", stacklevel=2)
                _FELL_BACK.append(True)
            return ppo_loss(config, model_output, data, dp_group)
        raise ValueError(f"engine_ppo_loss needs the packed logits in model_output (it has {sorted(model_output)}): "
                         "patch the engine with fused_is.integrations.verl.patch_engine() (or "
                         "external_lib=fused_is.integrations.verl_plugin); only verl's FSDP LM-head engine is patched")
    logits = model_output.pop(LOGITS_KEY)
    temperature = model_output.pop(TEMPERATURE_KEY, None)
    if _get(config, "entropy_coeff", 0.0) and not _non_tensor(data, "calculate_entropy", False):
        raise ValueError("verl entropy_coeff != 0 with the micro-batch's calculate_entropy=False: verl's engine then "
                         "computes no entropy and its ppo_loss drops the entropy term; set calculate_entropy=True "
                         "(verl's trainer does whenever entropy_coeff != 0)")
    return ppo_loss_from_logits(config, logits, data, dp_group, temperature=temperature, backend=backend,
                                inplace=inplace, sequence_parallel=model_output.pop(SEQUENCE_PARALLEL_KEY, None))


engine_ppo_loss.fused_is_wants_logits = True
_FELL_BACK: list = []  # warned once per process


def _wants_logits(loss_function) -> bool:
    while isinstance(loss_function, functools.partial):
        loss_function = loss_function.func
    return getattr(loss_function, "fused_is_wants_logits", False)


def engine_logits(engine, output, output_args, micro_batch) -> Dict[str, object]:
    """The model_output a patched engine hands to `engine_ppo_loss`: the micro-batch's packed logits [total_nnz, V]
    as the model returned them (not divided by the temperature: the kernels divide), without the engine's static
    pad rows, and the per-row temperatures (the engine's temperature_rmpad; None when verl's scalar temperature is 1).
    A caller asking forward_step for return_model_output gets no log_probs back for such a step. With Ulysses
    sequence parallelism: this rank's slice of the padded rows (pad rows kept: the loss masks them) and
    SEQUENCE_PARALLEL_KEY, (the engine's sequence-parallel group, pad rows). Only the layout the loss can take
    is accepted; each other engine option is refused by name."""
    from verl.utils import tensordict_utils as tu

    def flag(key, default=False):
        return tu.get_non_tensor_data(data=micro_batch, key=key, default=default)

    for key, why in (("use_fused_kernels", "the fused kernels compute log_probs without logits; use "
                                           "ppo_loss_from_hidden for the hidden-states path"),
                     ("calculate_sum_pi_squared", "it needs the engine's own log-softmax"),
                     ("distillation_use_topk", "distillation needs the engine's logits processor"),
                     ("distillation_only", "distillation needs the engine's logits processor")):
        if flag(key):
            raise ValueError(f"verl engine option {key}=True is not supported with engine_ppo_loss: {why}")
    if not flag("use_remove_padding", True):
        raise ValueError("verl engine option use_remove_padding=False is not supported with engine_ppo_loss: it "
                         "takes the packed (remove-padding) logits")
    ulysses = getattr(engine, "use_ulysses_sp", False)
    if ulysses and hasattr(getattr(engine.module, "module", engine.module).config, "vision_config"):
        raise ValueError("verl Ulysses sequence parallelism with a vision-language model is not supported with "
                         "engine_ppo_loss (its inputs are sliced after the embedding; only text models are mapped)")
    logits = output.logits.squeeze(0)
    if type(logits).__name__ == "DTensor":
        raise ValueError("verl tensor-parallel logits (a DTensor sharded over the vocabulary) are not supported with "
                         "engine_ppo_loss yet (fused_is's vocab_group layout, not wired to the engine)")
    pad = int(output_args.get("pad_size", 0) or 0)
    if pad and not ulysses:  # with Ulysses the pad rows sit on the last ranks' slices: the loss masks them
        logits = logits[:-pad]
    temperature = None
    if not output_args.get("temperature_is_one", False):
        temperature = output_args["temperature_rmpad"][: logits.shape[0]]
    out = {LOGITS_KEY: logits, TEMPERATURE_KEY: temperature}
    if ulysses:
        out[SEQUENCE_PARALLEL_KEY] = (engine.ulysses_parallel_group, pad)
    return out


def patch_engine(target=None):
    """Make verl's FSDP LM-head engine hand the packed logits to a loss function that wants them
    (`engine_ppo_loss`, or a functools.partial of it): its `prepare_model_outputs` returns `engine_logits`
    for such a loss and runs as before for every other (log-prob passes, other losses).

    Args:
        target: an engine instance, or an engine class (default: verl's FSDPEngineWithLMHead, every engine of it).
    Returns:
        target. Patching twice is harmless.
    """
    if target is None:
        from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead as target
    original = target.prepare_model_outputs
    if getattr(original, "fused_is_patched", False):
        return target
    if isinstance(target, type):
        def prepare_model_outputs(self, output, output_args, micro_batch, logits_processor_func):
            if _wants_logits(logits_processor_func):
                return engine_logits(self, output, output_args, micro_batch)
            return original(self, output, output_args, micro_batch, logits_processor_func)
    else:
        def prepare_model_outputs(output, output_args, micro_batch, logits_processor_func):
            if _wants_logits(logits_processor_func):
                return engine_logits(target, output, output_args, micro_batch)
            return original(output, output_args, micro_batch, logits_processor_func)
    prepare_model_outputs.fused_is_patched = True
    target.prepare_model_outputs = prepare_model_outputs
    return target


def _metrics(out, loss=None) -> Dict[str, object]:
    metrics: Dict[str, object] = {"actor/pg_loss": float((out.loss if loss is None else loss).detach())}
    if "clip_frac" in out.metrics:
        metrics["actor/pg_clipfrac"] = out.metrics["clip_frac"]
        metrics["actor/ppo_kl"] = out.metrics["ppo_kl"]
    for name, value in out.metrics.items():
        metrics[f"fused_is/{name}"] = value
    return metrics


def _loss_inputs(config, data, rows_shape, two_dim: bool, device, what: str):
    """(LossConfig, the keyword arguments of policy_loss for the packed rows): tokens, advantages, the
    logprobs, mask, cu_seqlens, is_weights and normalizer, each response token placed at the packed row
    that scores it (the row before it in its sequence); prompt rows and last rows masked."""
    cfg = config_from_verl(config)
    prompt_lens, response_lens, width = _lengths(data)
    seq_lens = prompt_lens + response_lens
    offsets = torch.cat([seq_lens.new_zeros(1), seq_lens.cumsum(0)])
    total = int(offsets[-1])
    if not two_dim or rows_shape[0] != total:
        raise ValueError(f"{what} must be the micro-batch's packed rows [{total}, ...] (prompt + response tokens of "
                         f"every sequence); got {tuple(rows_shape)} rows")
    if bool((prompt_lens == 0).any()):
        raise ValueError("every sequence needs a prompt token (its last prompt row scores the first response token)")
    fields = ["response_mask", "old_log_probs", "advantages"] + [k for k in ("rollout_is_weights", "ref_log_prob")
                                                                   if k in data.keys()]
    padded = data.select(*fields).to_padded_tensor() if hasattr(data, "select") else data
    # row of response token j of sequence b: the row before it in the packed sequence
    j = torch.arange(width, device=device)
    live = j[None, :] < response_lens.to(device)[:, None]
    rows = (offsets[:-1].to(device) + prompt_lens.to(device) - 1)[:, None] + j[None, :]
    rows, take = rows[live], live

    def scatter(x, fill=0.0, dtype=torch.float64):
        out = torch.full((total,), fill, dtype=dtype, device=device)
        out[rows] = x.to(device)[:, :width][take].to(dtype)
        return out

    responses = data["responses"]
    response_ids = (responses.to_padded_tensor(0) if responses.is_nested else responses)
    if cfg.ratio_level == "sequence":
        _check_one_value_per_sequence(padded["advantages"], padded["response_mask"], "advantages")
        if "rollout_is_weights" in fields:
            _check_one_value_per_sequence(padded["rollout_is_weights"], padded["response_mask"], "rollout_is_weights")
    keywords = dict(tokens=scatter(response_ids, 0, torch.long), advantages=scatter(padded["advantages"]),
                    old_logprobs=scatter(padded["old_log_probs"]),
                    ref_logprobs=_kl_target(cfg, config, padded, fields, scatter),
                    mask=scatter(padded["response_mask"], 0.0) > 0, cu_seqlens=offsets.to(device),
                    is_weights=scatter(padded["rollout_is_weights"]) if "rollout_is_weights" in fields else None)

    dp_size = int(_non_tensor(data, "dp_size", 1) or 1)
    batch_num_tokens = _non_tensor(data, "batch_num_tokens", None)
    global_batch_size = _non_tensor(data, "global_batch_size", None)
    agg = "seq-mean-token-mean" if cfg.policy == "sapo" else _get(config, "loss_agg_mode", "token-mean")
    normalizer = None
    if agg == "token-sum":
        normalizer = 1.0 / dp_size
    elif agg == "token-mean":
        if batch_num_tokens is None and dp_size > 1:
            raise ValueError("(global) batch_num_tokens is required when dp_size > 1 (as in verl's agg_loss)")
        normalizer = None if batch_num_tokens is None else float(batch_num_tokens) / dp_size
    else:
        if global_batch_size is None and dp_size > 1:
            raise ValueError("global_batch_size is required when dp_size > 1 (as in verl's agg_loss)")
        normalizer = None if global_batch_size is None else float(global_batch_size) / dp_size
        if agg == "seq-mean-token-sum-norm" and cfg.norm_length is None:
            cfg = dataclasses.replace(cfg, norm_length=int(width))  # verl: the padded response length
    keywords["normalizer"] = normalizer
    # verl's bypass mode ignores the data's rollout_is_weights and forms its own from the current lp
    if _loss_mode(config) == "bypass_mode":
        keywords["is_weights"] = None
        if cfg.is_level != "none":  # W from lp over the rollout's logprobs (old_log_probs in bypass mode)
            keywords["sampler_logprobs"], keywords["old_logprobs"] = keywords["old_logprobs"], None
    if cfg.policy == "gmpo":  # verl's geo_mean: torch.mean over the B sequences (empty ones too), no global count
        keywords["normalizer"] = float(len(response_lens))
        if cfg.entropy_agg is not None:
            keywords["entropy_normalizer"] = normalizer
        if keywords["is_weights"] is not None:  # verl: each sequence's geometric mean of its rollout IS weights
            m = padded["response_mask"].double()
            log_w = (torch.log(padded["rollout_is_weights"].double() + 1e-10) * m).sum(-1) / (m.sum(-1) + 1e-8)
            keywords["is_weights"] = scatter(torch.exp(log_w)[:, None].expand_as(m))
    return cfg, keywords


def _bypass_fields(correction, fields) -> str:
    """verl's bypass mode (policy_loss.rollout_correction, old_log_prob = the rollout's): loss_type "ppo_clip" is
    the vanilla loss against the rollout logprobs (returns "vanilla"); "reinforce" is -W A lp with W the truncated
    (TIS) or interval-masked (IcePop) IS weight of the current policy over the rollout, token or sequence level,
    log ratio clamped to +-20, as fused_is forms it from the detached lp with old_logprobs=None (fields updated,
    returns "reinforce")."""
    if correction is None:
        _refuse("policy_loss.loss_mode", "bypass_mode", "it needs policy_loss.rollout_correction (as verl)")
    option = "policy_loss.rollout_correction."
    if _get(correction, "rollout_rs") is not None:
        _refuse(option + "rollout_rs", _get(correction, "rollout_rs"), "bypass mode rejects by the current policy's "
                "ratio to the rollout; fused_is's rejection compares the old and the sampler's logprobs")
    if _get(correction, "rollout_is_batch_normalize", False):
        _refuse(option + "rollout_is_batch_normalize", True, "the weights' batch normalisation is not mapped")
    loss_type = _get(correction, "loss_type", "ppo_clip")
    if loss_type == "ppo_clip":  # the IS ratio is the PPO ratio itself: no weight (verl computes it for metrics)
        return "vanilla"
    if loss_type != "reinforce":
        _refuse(option + "loss_type", loss_type, "expected ppo_clip or reinforce")
    fields.update(policy="reinforce")
    level, threshold = _get(correction, "rollout_is"), _get(correction, "rollout_is_threshold", 2.0)
    if level is None or threshold is None:
        return "reinforce"
    if level not in ("token", "sequence"):
        _refuse(option + "rollout_is", level, "expected token or sequence")
    from verl.trainer.ppo.rollout_corr_helper import _parse_rollout_is_threshold

    upper, lower = _parse_rollout_is_threshold(threshold)
    fields.update(is_level=level, is_cap=upper, is_mode="truncate" if lower is None else "mask", is_floor=lower)
    return "reinforce"


def _loss_mode(config) -> str:
    """verl's policy_loss.loss_mode of an actor config."""
    return _get(_get(config, "policy_loss", {}), "loss_mode", "vanilla")


def _kl_target(cfg, config, padded, fields, scatter):
    """ref_logprobs of the KL term: the reference model's, or (verl's dro) the old logprobs of DRO's penalty."""
    if cfg.kl_coef == 0.0:
        return None
    if _loss_mode(config) == "dro":
        if "rollout_is_weights" in fields:  # verl multiplies DRO's whole per-token loss, penalty included, by them
            raise ValueError("verl policy_loss.loss_mode='dro' with rollout_is_weights is not supported by "
                             "fused_is.integrations.verl: verl weights DRO's quadratic penalty too; fused_is weights "
                             "the policy term only")
        return scatter(padded["old_log_probs"])
    return scatter(padded["ref_log_prob"])


def _non_tensor(data, key, default):
    try:
        value = data[key]
    except KeyError:
        return default
    if hasattr(value, "tolist") and not isinstance(value, torch.Tensor):
        value = value.tolist()
    if isinstance(value, torch.Tensor):
        value = value.item() if value.numel() == 1 else value
    return value


def _check_one_value_per_sequence(values: torch.Tensor, mask: torch.Tensor, name: str) -> None:
    """verl's GSPO gives each token the sequence ratio with a per-token gradient; fused_is's GSPO spreads the
    sequence's gradient over its tokens. The two agree when the advantage and the rollout IS weight are one
    value per sequence (GRPO, RLOO, sequence-level IS)."""
    live = mask > 0
    big = torch.finfo(values.dtype).max
    top = torch.where(live, values, torch.full_like(values, -big)).amax(-1)
    bottom = torch.where(live, values, torch.full_like(values, big)).amin(-1)
    if bool(((top - bottom) > 0).any()):
        raise ValueError(f"policy_loss.loss_mode='gspo' with {name} that vary within a sequence: verl's token "
                         "gradient differs from GSPO's sequence gradient there; fused_is maps gspo only for one "
                         f"value of {name} per sequence")
