"""TRL (`trl.GRPOTrainer`, TRL 1.16) with fused_is as its loss.

    from fused_is.integrations.trl import FusedGRPOTrainer
    trainer = FusedGRPOTrainer(model=..., reward_funcs=..., args=GRPOConfig(...), ...)   # as GRPOTrainer

`FusedGRPOTrainer` replaces `GRPOTrainer._compute_loss`: the model's completion logits go to
`fused_is.policy_loss` with the `LossConfig` and normaliser that `config_from_trl` reads off the trainer's
`GRPOConfig`, so the loss and its gradient are TRL's (tests/test_integration_trl.py runs both trainers on
the same batches) without the fp32 [B, T, V] log-softmax and its saved activations. Every GRPOConfig option
that shapes the loss is either mapped exactly or refused with a ValueError naming it.

Importing this module imports TRL; `import fused_is` does not.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import types
from typing import Optional

import torch
from trl import GRPOTrainer

import fused_is
from fused_is.config import LossConfig

# how each loss type divides its sum (the `normalizer=` of policy_loss), and its aggregation
_AGGREGATION = {
    "grpo": ("seq-mean-token-mean", "sequences"),  # mean over the B completions (empty ones too), / GA
    "sapo": ("seq-mean-token-mean", "sequences"),
    "bnpo": ("token-mean", "local_tokens"),  # this micro-batch's tokens, / GA
    "dr_grpo": ("seq-mean-token-sum-norm", "sequences"),  # / (B * max_completion_length), / GA
    "dapo": ("token-mean", "items"),  # / (num_items_in_batch / num_processes x GA / steps_per_generation)
    "cispo": ("token-mean", "items"),
    "luspo": ("seq-mean-token-sum", "sequences"),  # mean over B of each sequence's masked token sum, / GA
    "vespo": ("token-mean", "items"),
}
_IS_MODES = {"token_truncate": ("token", "truncate"), "token_mask": ("token", "mask"),
             "sequence_truncate": ("sequence", "truncate"), "sequence_mask": ("sequence", "mask")}


@dataclasses.dataclass(frozen=True)
class TRLLoss:
    """What `config_from_trl` returns.

    config: the LossConfig of TRL's per-token loss and aggregation.
    normalizer: how TRL divides the loss's sum: "sequences" (B completions x gradient accumulation steps),
        "local_tokens" (this micro-batch's unmasked tokens x gradient accumulation steps) or "items"
        (`num_items_in_batch / num_processes`, the generation batch's token count per process, rescaled in
        training by gradient accumulation steps / steps_per_generation to one accumulation window).
    """

    config: LossConfig
    normalizer: str

    def normalizer_value(self, mask: torch.Tensor, *, training: bool = True, grad_accum_steps: int = 1,
                         steps_per_generation: int = 1, num_items_in_batch=None, num_processes: int = 1):
        """The `normalizer=` for one micro-batch, as TRL 1.16 divides. mask: [B, T] completion mask (0/1);
        grad_accum_steps: TRL's `current_gradient_accumulation_steps`; num_items_in_batch: TRL's input of
        that name (a 0-d tensor). In evaluation (training=False) nothing is accumulated. Returns a float or
        a 0-d tensor (no host read)."""
        accumulated = grad_accum_steps if training else 1
        if self.normalizer == "sequences":
            return float(mask.shape[0] * accumulated)
        if self.normalizer == "local_tokens":
            return mask.sum().clamp(min=1.0).to(torch.float64) * accumulated
        if num_items_in_batch is None:
            raise ValueError("num_items_in_batch is required by this loss type (TRL divides by the generation "
                             "batch's token count)")
        items = torch.as_tensor(num_items_in_batch, dtype=torch.float64, device=mask.device)
        value = items.clamp(min=1.0) / num_processes
        return value * grad_accum_steps / steps_per_generation if training else value

    def entropy_normalizer_value(self, mask: torch.Tensor, *, training: bool = True, grad_accum_steps: int = 1):
        """The `entropy_normalizer=` of TRL's entropy bonus, a token mean over this micro-batch scaled for
        gradient accumulation: unmasked tokens x grad_accum_steps (training), a 0-d tensor."""
        return mask.sum().clamp(min=1.0).to(torch.float64) * (grad_accum_steps if training else 1)


def _refuse(option: str, value, why: str):
    raise ValueError(f"GRPOConfig.{option}={value!r} is not supported by fused_is.integrations.trl: {why}")


def config_from_trl(args, *, importance_sampling: Optional[bool] = None) -> TRLLoss:
    """The fused_is loss of a TRL `GRPOConfig` (TRL 1.16): the LossConfig and the normaliser rule.

    Args:
        args: a `trl.GRPOConfig` (or any object with its fields).
        importance_sampling: whether TRL applies its vLLM importance-sampling correction; default
            `args.use_vllm and args.vllm_importance_sampling_correction`, the condition TRL's loss uses.
    Returns:
        TRLLoss(config, normalizer). Pass `sampling_per_token_logps` as sampler_logprobs,
        `old_per_token_logps` as old_logprobs (None when TRL has none) and `ref_per_token_logps` as ref_logprobs.
    Raises:
        ValueError naming the GRPOConfig option for every option that would change TRL's loss in a way
        fused_is does not reproduce exactly (never a silent approximation).
    """
    loss_type = args.loss_type
    if loss_type not in _AGGREGATION:
        _refuse("loss_type", loss_type, f"expected one of {sorted(_AGGREGATION)}")
    if importance_sampling is None:
        importance_sampling = bool(args.use_vllm and args.vllm_importance_sampling_correction)
    level = args.importance_sampling_level
    if level not in ("token", "sequence"):
        _refuse("importance_sampling_level", level, "expected 'token' or 'sequence'")
    if level == "sequence" and loss_type in ("cispo", "sapo", "vespo"):
        _refuse("importance_sampling_level", level, f"the sequence ratio is built for the clipped surrogate only, "
                f"not for loss_type={loss_type!r}")
    eps_low = float(args.epsilon)
    eps_high = float(args.epsilon_high if args.epsilon_high is not None else args.epsilon)
    fields = dict(temperature=float(args.temperature), ratio_ref="old", is_level="none", is_cap=float("inf"),
                  loss_agg=_AGGREGATION[loss_type][0])
    if loss_type == "cispo":  # TRL: sg(min(r, epsilon_high)) A lp
        if eps_high < 1.0:
            _refuse("epsilon_high", eps_high, "CISPO's cap on the ratio below 1 has no fused_is form "
                    "(fused_is clips CISPO's ratio to [1 - clip_low, 1 + clip_high])")
        fields.update(policy="cispo", clip_low=1.0, clip_high=eps_high - 1.0)
    elif loss_type == "vespo":  # REINFORCE under the gamma weight of the sequence ratio, the IS ratio inside it
        fields.update(policy="vespo", vespo_k_pos=float(args.vespo_k_pos),
                      vespo_lambda_pos=float(args.vespo_lambda_pos),
                      vespo_k_neg=float(args.vespo_k_neg), vespo_lambda_neg=float(args.vespo_lambda_neg))
    elif loss_type == "sapo":
        fields.update(policy="sapo", sapo_tau_pos=float(args.sapo_temperature_pos),
                      sapo_tau_neg=float(args.sapo_temperature_neg))
    else:
        fields.update(policy="ppo", clip_low=eps_low, clip_high=eps_high,
                      ratio_level="sequence" if level == "sequence" else "token")
        if args.delta is not None:
            # TRL caps the unclipped ratio at delta: for A < 0 that bounds the surrogate by delta A (the dual
            # clip); for A > 0 it never binds when delta > 1 + epsilon_high (the clip already chose less)
            if not float(args.delta) > 1.0 + eps_high:
                _refuse("delta", args.delta, f"the two-sided clip equals the dual clip only for delta > 1 + "
                        f"epsilon_high = {1.0 + eps_high}")
            fields["dual_clip"] = float(args.delta)
    if loss_type == "dr_grpo":
        fields["norm_length"] = int(args.max_completion_length)
    if args.beta != 0.0:
        fields.update(kl_coef=float(args.beta), kl_type="k3")
        if args.use_bias_correction_kl:
            if level == "sequence":
                _refuse("use_bias_correction_kl", True, "the KL weighted by the sequence ratio is not built yet")
            fields["kl_weight"] = "ratio"
    if importance_sampling:
        mode = args.vllm_importance_sampling_mode
        if mode not in _IS_MODES:
            _refuse("vllm_importance_sampling_mode", mode, f"expected one of {sorted(_IS_MODES)}")
        is_level, is_mode = _IS_MODES[mode]
        if loss_type == "vespo" and is_level != "token":
            _refuse("vllm_importance_sampling_mode", mode, "TRL's VESPO takes token-level IS ratios only")
        cap, floor = args.vllm_importance_sampling_clip_max, args.vllm_importance_sampling_clip_min
        fields.update(is_level=is_level, is_mode=is_mode, is_cap=float("inf") if cap is None else float(cap),
                      is_floor=None if floor is None else float(floor))
        if is_mode == "truncate" and cap is None and floor is None:
            _refuse("vllm_importance_sampling_clip_max", None, "truncation with neither bound")
    if args.off_policy_mask_threshold is not None:
        fields["off_policy_mask"] = float(args.off_policy_mask_threshold)
    if args.top_entropy_quantile < 1.0:
        _refuse("top_entropy_quantile", args.top_entropy_quantile, "the high-entropy token mask is not built yet")
    if getattr(args, "use_adaptive_entropy", False):
        _refuse("use_adaptive_entropy", True, "TRL changes the entropy coefficient between steps from its own "
                "window statistics; use a fixed entropy_coef")
    entropy_coef = float(getattr(args, "entropy_coef", 0.0) or 0.0)
    if entropy_coef != 0.0:  # TRL: loss - coef * (the micro-batch's token mean of H) / GA, whatever the loss type
        fields.update(entropy_coef=entropy_coef, entropy_agg="token-mean")
    return TRLLoss(LossConfig(**fields), _AGGREGATION[loss_type][1])


def _takes_logits_to_keep(model) -> bool:
    """Whether the (unwrapped) model's forward takes `logits_to_keep` (transformers' causal LMs do)."""
    while hasattr(model, "module"):  # DDP / accelerate wrappers
        model = model.module
    return "logits_to_keep" in inspect.signature(model.forward).parameters


LOGIT_SCALES = ("final_logit_softcapping", "logit_scale", "output_multiplier", "lm_head_multiplier", "logits_scaling")


def add_hidden_forward(model) -> None:
    """Let `model(..., fused_is_hidden=True)` return the backbone's last hidden state [B, L, D] (through any
    wrapper, so DDP's hooks still run); without the flag the forward is the one the model had."""
    text_config = model.config.get_text_config()
    for name in LOGIT_SCALES:
        value = getattr(text_config, name, None)
        if value is not None and value != 1.0:
            raise ValueError(f"FusedGRPOTrainer(fused_is_path='hidden'): the model's config sets {name}={value!r}, "
                             "a transform of the logits after the lm_head that the fused linear path does not apply; "
                             "use fused_is_path='logits'")
    original = model.forward

    @functools.wraps(type(model).forward)
    def forward(self, *args, fused_is_hidden=False, fused_is_aux_loss=False, **kwargs):
        if not fused_is_hidden:
            return original(*args, **kwargs)
        kwargs["use_cache"] = False
        if not fused_is_aux_loss:
            return self.base_model(*args, **kwargs).last_hidden_state
        outputs = self.base_model(*args, output_router_logits=True, **kwargs)
        return outputs.last_hidden_state, _load_balancing_loss(self, outputs.router_logits,
                                                              kwargs.get("attention_mask"))

    model.forward = types.MethodType(forward, model)
    model._fused_is_hidden = True


def _multimodal_inputs(inputs) -> dict:
    """A vision-language batch's model inputs as TRL passes them to the model for its loss (its whole batch as
    one chunk): the image tensors with pixel_values, the per-token type ids (prompt and completion)."""
    out = {key: inputs[key] for key in ("token_type_ids", "mm_token_type_ids", "image_sizes")
           if inputs.get(key) is not None}
    if inputs.get("pixel_values") is not None:
        out["pixel_values"] = inputs["pixel_values"]
        for key in ("image_grid_thw", "image_position_ids", "spatial_shapes", "pixel_attention_mask"):
            if inputs.get(key) is not None:
                out[key] = inputs[key]
    elif inputs.get("pixel_attention_mask") is not None and inputs.get("spatial_shapes") is None:
        out["pixel_attention_mask"] = inputs["pixel_attention_mask"]
    return out


def _load_balancing_loss(model, router_logits, attention_mask):
    """The MoE load-balancing auxiliary loss the model's own causal-LM forward returns as `aux_loss` (transformers'
    load_balancing_loss_func(router_logits, num_experts, top_k, attention_mask) of the model's module, with the
    model's num_experts and num_experts_per_tok, or its text config's for a vision-language MoE). A model whose
    function takes other arguments (Doge: num_keys) is refused: the logits path takes its aux_loss as is."""
    import inspect
    import sys

    func = getattr(sys.modules[type(model).__module__], "load_balancing_loss_func", None)
    text_config = model.config.get_text_config()
    experts, per_token = (getattr(model, name, getattr(text_config, name, None))
                          for name in ("num_experts", "num_experts_per_tok"))
    standard = func is not None and list(inspect.signature(func).parameters)[1:4] == ["num_experts", "top_k",
                                                                                       "attention_mask"]
    if not standard or experts is None or per_token is None:
        raise ValueError(f"FusedGRPOTrainer(fused_is_path='hidden'): {type(model).__name__} returns its MoE auxiliary "
                         "loss in a way the hidden-states path does not know; use fused_is_path='logits'")
    return func(router_logits, experts, per_token, attention_mask)


class FusedGRPOTrainer(GRPOTrainer):
    """`trl.GRPOTrainer` whose loss is `fused_is.policy_loss`: same constructor, same training loop,
    same logged metrics (entropy, kl, clip ratios) plus fused_is's own under "fused_is/<name>".

    The loss is computed from the model's completion logits [B, T, V] in one fused pass (fp32 log-softmax
    inside the kernel, no fp32 copy of the logits, nothing of size B x T x V saved but the gradient).
    `fused_is_path` picks the input: "hidden" (default): `fused_is.linear_policy_loss` on the backbone's
    hidden states and the lm_head weight, chunk by chunk, never a [B, T, V] tensor (as TRL's own fused lm
    head; GRPOConfig.cast_lm_head_to_fp32 gives the fp32 head); "logits": `fused_is.policy_loss` on the
    model's logits (for models that transform logits after the lm_head, e.g. soft-capping).
    `fused_is_backend` picks the backend ("auto" by default). A MoE model's load-balancing loss is added as
    TRL adds it (router_aux_loss_coef x aux_loss, over the gradient accumulation steps in training). A
    vision-language model's image inputs go to its forward as TRL passes them (both paths). Refused at
    construction: any option `config_from_trl` refuses.
    """

    fused_is_backend = "auto"
    fused_is_path = "hidden"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.fused_is_loss()  # refuse unsupported options now, not at the first step

    def fused_is_loss(self) -> TRLLoss:
        """The mapping for the trainer as it stands (its importance-sampling switch included)."""
        return config_from_trl(self.args, importance_sampling=bool(
            self.use_vllm and self.vllm_importance_sampling_correction))

    def _compute_loss(self, model, inputs):
        spec = self.fused_is_loss()
        prompt_ids, prompt_mask = inputs["prompt_ids"], inputs["prompt_mask"]
        completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
        input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
        attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
        keep = completion_ids.size(1)
        mask = completion_mask if "tool_mask" not in inputs else completion_mask * inputs["tool_mask"]
        mode = "train" if self.model.training else "eval"
        normalizer = spec.normalizer_value(
            mask, training=mode == "train", grad_accum_steps=self.current_gradient_accumulation_steps,
            steps_per_generation=self.args.steps_per_generation, num_items_in_batch=inputs.get("num_items_in_batch"),
            num_processes=self.accelerator.num_processes)
        config, weights = spec.config, None
        if config.is_level != "none" and inputs.get("importance_sampling_ratio") is not None:
            # TRL's own ratios, as its loss multiplies them in: [B, T], or [B, 1] in its sequence modes
            weights = inputs["importance_sampling_ratio"]
            weights = weights[:, 0] if weights.shape[-1] == 1 and completion_ids.shape[-1] != 1 else weights
            config = dataclasses.replace(config, is_level="none")
        entropy_normalizer = None
        if config.entropy_agg is not None:
            entropy_normalizer = spec.entropy_normalizer_value(
                mask, training=mode == "train", grad_accum_steps=self.current_gradient_accumulation_steps)
        sampler = inputs.get("sampling_per_token_logps")
        if sampler is not None and bool(torch.isnan(sampler).any()):
            # TRL marks tokens vLLM could not score with NaN and counts them as no divergence (its IS ratio and its
            # off-policy drift take 0 there). With TRL's own IS ratio as is_weights the sampler logprobs feed the
            # metrics only: such tokens take the old logprob (no divergence); the off-policy drift would need the
            # current lp there, so that combination is refused rather than approximated.
            if config.off_policy_mask is not None:
                raise ValueError("GRPOConfig.off_policy_mask_threshold with sampler logprobs vLLM could not score "
                                 "(NaN) is not supported by FusedGRPOTrainer yet")
            old = inputs.get("old_per_token_logps")
            sampler = None if old is None else torch.where(torch.isnan(sampler), old, sampler)
        keywords = dict(sampler_logprobs=sampler,
                        old_logprobs=inputs.get("old_per_token_logps"),
                        ref_logprobs=inputs.get("ref_per_token_logps") if self.beta != 0.0 else None,
                        mask=mask, config=config, normalizer=normalizer, backend=self.fused_is_backend,
                        is_weights=weights, entropy_normalizer=entropy_normalizer)
        model_inputs = {"input_ids": input_ids, "attention_mask": attention_mask, "use_cache": False,
                        **_multimodal_inputs(inputs)}
        if self.fused_is_path == "hidden":
            unwrapped = self.accelerator.unwrap_model(model)
            if not getattr(unwrapped, "_fused_is_hidden", False):
                add_hidden_forward(unwrapped)
            head = unwrapped.get_output_embeddings()
            if type(head.weight).__name__ == "DTensor":
                raise ValueError("FusedGRPOTrainer(fused_is_path='hidden'): the lm_head weight is sharded (FSDP2 "
                                 "DTensor); the vocabulary-parallel linear path is not built yet, use "
                                 "fused_is_path='logits'")
            hidden = model(**model_inputs, fused_is_hidden=True, fused_is_aux_loss=self.aux_loss_enabled)
            if self.aux_loss_enabled:
                hidden, aux_loss = hidden
            hidden = hidden[:, -keep - 1:-1, :]  # [B, T, D]
            out = fused_is.linear_policy_loss(
                hidden, head.weight, completion_ids, inputs["advantages"], bias=head.bias,
                logits_dtype=torch.float32 if getattr(self.args, "cast_lm_head_to_fp32", False) else None, **keywords)
        elif self.fused_is_path == "logits":
            if _takes_logits_to_keep(model):
                model_inputs["logits_to_keep"] = keep + 1
            if self.aux_loss_enabled:  # MoE: the model returns its load-balancing loss with the logits
                model_inputs["output_router_logits"] = True
            outputs = model(**model_inputs)
            aux_loss = outputs.aux_loss if self.aux_loss_enabled else None
            logits = outputs.logits[:, :-1, :][:, -keep:, :]  # [B, T, V]; temperature in the config
            out = fused_is.policy_loss(logits, completion_ids, inputs["advantages"], **keywords)
        else:
            raise ValueError(f"FusedGRPOTrainer.fused_is_path must be 'hidden' or 'logits'; got {self.fused_is_path!r}")
        self._log_fused_metrics(mode, out, inputs, mask, spec.config)
        loss = out.loss
        if self.aux_loss_enabled:  # as TRL: the policy loss is already scaled for gradient accumulation; so is this
            steps = self.current_gradient_accumulation_steps if mode == "train" else 1.0
            loss = loss + self.router_aux_loss_coef * aux_loss / steps
            self._metrics[mode]["aux_loss"].append(self.accelerator.gather_for_metrics(aux_loss).mean().item())
        return loss

    def _sequence_mean(self, x: torch.Tensor) -> float:
        """The mean of one value per sequence ([B, 1]) over the processes, as TRL's global_masked_mean."""
        totals = self.accelerator.reduce(torch.stack([x.sum(), x.new_tensor(float(x.shape[0]))]), reduction="sum")
        return (totals[0] / totals[1].clamp(min=1.0)).item()

    def _log_fused_metrics(self, mode, out, inputs, mask, cfg: LossConfig):
        """TRL's own metric names (global masked means over the processes), and fused_is's metrics."""
        mask = mask.to(out.entropy.dtype)

        def global_masked_mean(x):
            totals = self.accelerator.reduce(torch.stack([(x * mask).sum(), mask.sum()]), reduction="sum")
            return (totals[0] / totals[1].clamp(min=1.0)).item()

        lp = out.logprobs
        self._metrics[mode]["entropy"].append(global_masked_mean(out.entropy))
        if self.beta != 0.0:
            d = inputs["ref_per_token_logps"].to(lp.dtype) - lp
            self._metrics[mode]["kl"].append(global_masked_mean(torch.exp(d) - d - 1.0))
        if cfg.policy == "ppo":
            old = inputs.get("old_per_token_logps")
            log_ratio = lp - (lp if old is None else old.to(lp.dtype))
            adv = inputs["advantages"].to(lp.dtype)
            adv = adv.unsqueeze(1) if adv.dim() == 1 else adv
            if cfg.ratio_level == "sequence":  # one ratio per sequence, averaged over the sequences, as TRL does
                log_ratio = ((log_ratio * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1.0))
                adv = adv[:, :1]
                mean = self._sequence_mean
            else:
                mean = global_masked_mean
            ratio = torch.exp(log_ratio)
            low = ((ratio < 1 - cfg.clip_low) & (adv < 0)).to(mask.dtype)
            high = ((ratio > 1 + cfg.clip_high) & (adv > 0)).to(mask.dtype)
            self._metrics[mode]["clip_ratio/low_mean"].append(mean(low))
            self._metrics[mode]["clip_ratio/high_mean"].append(mean(high))
            self._metrics[mode]["clip_ratio/region_mean"].append(mean(torch.maximum(low, high)))
        for name, value in out.metrics.items():
            self._metrics[mode][f"fused_is/{name}"].append(float(value))
