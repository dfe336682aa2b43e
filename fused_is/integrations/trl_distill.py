"""TRL's distillation trainers (TRL 1.16: `trl.experimental.gkd.GKDTrainer`, `trl.experimental.gold.GOLDTrainer` and
`trl.experimental.iw_opd.IWOPDTrainer`) with `fused_is.distill_loss` as their loss.

    from fused_is.integrations.trl_distill import FusedGKDTrainer
    trainer = FusedGKDTrainer(model=..., teacher_model=..., args=GKDConfig(...), ...)   # as GKDTrainer

Each Fused trainer replaces its class's `compute_loss`: the same forward passes of the student and the teacher, the
same positions and labels, and in place of TRL's `generalized_jsd_loss` the fused loss with the keywords that
`distill_kwargs_from_trl` reads off the trainer, so the loss and its gradient are TRL's (tests/
test_integration_trl_distill.py runs both trainers on the same batches) without TRL's [B, T, V] temporaries. Every
option that shapes the loss is mapped exactly or refused with a ValueError naming it; what the trainers feed the loss
(lmbda's on-policy mixing, seq_kd, sampling) stays TRL's.

Importing this module imports TRL's experimental trainers; `import fused_is` does not.
"""

from __future__ import annotations

import torch
from trl.experimental.gkd import GKDConfig, GKDTrainer
from trl.experimental.gold import GOLDConfig, GOLDTrainer
from trl.experimental.iw_opd import IWOPDConfig, IWOPDTrainer
from trl.experimental.utils import empty_cache

import fused_is

from .trl import LOGIT_SCALES, add_hidden_forward

# (config class, trainer class, the config's name in error texts) of each trainer this module maps
_TRAINERS = {"gkd": (GKDConfig, GKDTrainer, "GKDConfig"), "gold": (GOLDConfig, GOLDTrainer, "GOLDConfig"),
             "iw_opd": (IWOPDConfig, IWOPDTrainer, "IWOPDConfig")}


def _refuse(config: str, option: str, value, why: str):
    raise ValueError(f"{config}.{option}={value!r} is not supported by fused_is.integrations.trl_distill: {why}")


def _family(source) -> str:
    """Which TRL trainer a config or trainer belongs to: "gkd", "gold" or "iw_opd"."""
    for name, classes in _TRAINERS.items():
        if isinstance(source, classes[:2]):
            return name
    raise TypeError("distill_kwargs_from_trl takes a GKDConfig, GOLDConfig or IWOPDConfig of TRL 1.16, or one of "
                    f"their trainers; got {type(source).__name__}")


def distill_kwargs_from_trl(source) -> dict:
    """The `fused_is.distill_loss` keywords of a TRL 1.16 distillation trainer's loss.

    Args:
        source: a `GKDConfig`, `GOLDConfig` or `IWOPDConfig`, or the trainer itself (then its attributes of the same
            names, which its compute_loss reads).
    Returns:
        dict(kind="jsd", beta=, temperature=, top_k=, add_tail=). Pass the labels' `!= -100` mask as mask= and TRL's
        reduction: loss_agg="token-mean" (its batchmean), or, when the training loop passes num_items_in_batch,
        loss_agg="sum" and the loss divided by num_items_in_batch (the Fused trainers do both).
    Raises:
        ValueError naming the option for every option under which TRL's loss is not this distill_loss (never a silent
        approximation); TypeError for a source of another trainer.
    """
    family = _family(source)
    config = _TRAINERS[family][2]
    beta = float(source.beta)
    if family == "gkd":
        # GKD's compute_loss passes no temperature to its loss: the divergence is at temperature 1, whatever
        # GKDConfig.temperature (the sampling temperature) says
        return dict(kind="jsd", beta=beta, temperature=1.0, top_k=0, add_tail=True)
    if family == "gold":
        if source.use_uld_loss:
            _refuse(config, "use_uld_loss", True, "the cross-tokenizer Universal Logit Distillation loss (with its "
                    "uld_* options and teacher_tokenizer_name_or_path) compares the two models' sorted probabilities "
                    "across tokenizers, not one vocabulary's distributions; only GOLD's same-tokenizer JSD is mapped")
        return dict(kind="jsd", beta=beta, temperature=float(source.temperature), top_k=0, add_tail=True)
    if source.distillation_objective != "jsd":
        _refuse(config, "distillation_objective", source.distillation_objective, "IW-OPD's sampled-token objective "
                "is a policy gradient on the completion tokens weighted by the prefix discrepancy, not a divergence "
                "over the vocabulary; use distillation_objective='jsd'")
    if source.use_teacher_server:
        _refuse(config, "use_teacher_server", True, "the teacher server returns per-token top-k logprobs, not the "
                "teacher's logits; use a local teacher_model")
    top_k = int(source.loss_top_k)
    if beta > 0 and top_k == 1 and source.reverse_kl_top_1_mode != "argmax":
        # TRL's mixed top-1 path: the reverse-KL support is the sampled completion token; with "argmax" it is the
        # student's top-1, the support distill_loss selects with top_k=1
        _refuse(config, "reverse_kl_top_1_mode", source.reverse_kl_top_1_mode, "with beta > 0 and loss_top_k=1 the "
                "support holds the sampled completion token, not the student's top token; use "
                "reverse_kl_top_1_mode='argmax' or another loss_top_k")
    return dict(kind="jsd", beta=beta, temperature=float(source.temperature), top_k=max(top_k, 0),
                add_tail=bool(source.loss_add_tail))


def _check_hidden_path(model, role: str, trainer: str) -> torch.nn.Module:
    """The (unwrapped) model's lm_head, or a ValueError naming why the hidden-states path cannot take this model."""
    head = model.get_output_embeddings()
    text_config = model.config.get_text_config()
    scales = [f"{name}={getattr(text_config, name)!r}" for name in LOGIT_SCALES
              if getattr(text_config, name, None) not in (None, 1.0)]
    why = None
    if type(model).__module__.split(".")[0] == "peft":
        why = "a PEFT model's forward does not end at its backbone"
    elif scales:
        why = f"its config sets {scales[0]}, a transform of the logits after the lm_head"
    elif head is None or type(head.weight).__name__ == "DTensor" or head.weight.numel() == 0:
        why = "its lm_head weight is not a whole local tensor (sharded by FSDP or DeepSpeed ZeRO-3)"
    if why is not None:
        raise ValueError(f"{trainer}(fused_is_path='hidden'): the {role} model cannot be read as hidden states: {why}; "
                         "use fused_is_path='logits'")
    return head


class _FusedDistillation:
    """What the Fused trainers share: refusals at construction, the two models' forward passes (logits or hidden
    states), the fused loss reduced as TRL reduces it, its metrics as "fused_is/<name>".

    `fused_is_path` picks the input: "logits" (default): `fused_is.distill_loss` on both models' logits; "hidden":
    `fused_is.linear_distill_loss` on both backbones' last hidden states and lm_head weights, chunk by chunk, never a
    [B, T, V] tensor of either model (refused by name for models that transform logits after the head, PEFT models
    and sharded heads; a call that must return the outputs, as evaluation's, takes the logits path).
    `fused_is_backend` picks the backend ("auto" by default)."""

    fused_is_backend = "auto"
    fused_is_path = "logits"

    def __init__(self, *args, **kwargs):
        config = kwargs.get("args", args[2] if len(args) > 2 else None)
        if config is not None:
            distill_kwargs_from_trl(config)  # refuse before TRL loads a teacher tokenizer or reaches a server
        super().__init__(*args, **kwargs)
        distill_kwargs_from_trl(self)

    def _fused_distill_loss(self, model, inputs, start: int, forward_kwargs: dict, return_outputs: bool,
                            num_items_in_batch):
        """TRL's loss over the tokens labels[:, start:] (predicted at positions start - 1 .. L - 2), the models'
        forward taking input_ids, attention_mask and forward_kwargs."""
        keywords = distill_kwargs_from_trl(self)
        keywords.update(mask=inputs["labels"][:, start:] != -100, backend=self.fused_is_backend,
                        loss_agg="token-mean" if num_items_in_batch is None else "sum")
        ids = dict(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"])
        path, outputs = "logits" if return_outputs else self.fused_is_path, None
        if self.teacher_model is None:  # IW-OPD without a local teacher, as TRL words it
            raise ValueError("No teacher model or teacher server configured.")
        if path == "hidden":
            student = self.accelerator.unwrap_model(model)
            teacher = self.accelerator.unwrap_model(self.teacher_model)
            head = _check_hidden_path(student, "student", type(self).__name__)
            teacher_head = _check_hidden_path(teacher, "teacher", type(self).__name__)
            if not getattr(student, "_fused_is_hidden", False):
                add_hidden_forward(student)
            hidden = model(**ids, **forward_kwargs, fused_is_hidden=True)  # through the wrappers (DDP's hooks)
            self.teacher_model.eval()
            with torch.no_grad():
                teacher_hidden = teacher.base_model(**ids, **forward_kwargs, use_cache=False).last_hidden_state
            teacher_bias = None if teacher_head.bias is None else teacher_head.bias.detach()
            loss, _, metrics = fused_is.linear_distill_loss(  # the teacher's parameters may require grad: read only
                hidden[:, start - 1:-1], head.weight, teacher_hidden[:, start - 1:-1], teacher_head.weight.detach(),
                bias=head.bias, teacher_bias=teacher_bias, **keywords)
        elif path == "logits":
            outputs = model(**ids, **forward_kwargs)
            self.teacher_model.eval()
            with torch.no_grad():
                teacher_logits = self.teacher_model(**ids, **forward_kwargs).logits
            loss, _, metrics = fused_is.distill_loss(outputs.logits[:, start - 1:-1], teacher_logits[:, start - 1:-1],
                                                     **keywords)
        else:
            raise ValueError(f"{type(self).__name__}.fused_is_path must be 'logits' or 'hidden'; got {path!r}")
        if num_items_in_batch is not None:  # TRL: the masked sum over the global count of label tokens
            if isinstance(num_items_in_batch, torch.Tensor):
                num_items_in_batch = num_items_in_batch.to(loss.device)
            loss = loss / num_items_in_batch
        store = getattr(self, "_metrics", None)
        if store is not None:
            mode = "train" if self.model.training else "eval"
            for key, value in metrics.items():  # this process's micro-batch
                store[mode][f"fused_is/{key}"].append(value)
        empty_cache()
        return (loss, outputs) if return_outputs else loss


class FusedGKDTrainer(_FusedDistillation, GKDTrainer):
    """`trl.experimental.gkd.GKDTrainer` whose loss is `fused_is.distill_loss`: same constructor, same training loop
    (lmbda, seq_kd and generation are TRL's). GKD's loss: kind="jsd" at GKDConfig.beta, temperature 1 (GKD samples at
    GKDConfig.temperature but computes its loss at 1), over the labels != -100 of the shifted sequence."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        return self._fused_distill_loss(model, inputs, 1, {}, return_outputs, num_items_in_batch)


class FusedGOLDTrainer(_FusedDistillation, GOLDTrainer):
    """`trl.experimental.gold.GOLDTrainer` on its same-tokenizer path, whose loss is `fused_is.distill_loss`:
    kind="jsd" at GOLDConfig.beta and GOLDConfig.temperature; the batch's extra model inputs (a vision-language
    model's images) reach both models as TRL passes them. Refused: use_uld_loss (cross-tokenizer distillation)."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        return self._fused_distill_loss(model, inputs, 1, self._get_model_forward_kwargs(inputs), return_outputs,
                                        num_items_in_batch)


class FusedIWOPDTrainer(_FusedDistillation, IWOPDTrainer):
    """`trl.experimental.iw_opd.IWOPDTrainer` with distillation_objective="jsd" and a local teacher, whose loss is
    `fused_is.distill_loss`: kind="jsd" at IWOPDConfig.beta and temperature, top_k=loss_top_k, add_tail=loss_add_tail,
    over the completion positions after the batch's shortest prompt (TRL's slicing). Refused: the sampled-token
    "iw_opd" objective (TRL's default), use_teacher_server, and the mixed top-1 support of the sampled token
    (beta > 0, loss_top_k=1, reverse_kl_top_1_mode="sampled")."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        self._raise_if_local_teacher_tokenizer_mismatch()
        return self._fused_distill_loss(model, inputs, self._compute_prompt_length(inputs), {}, return_outputs,
                                        num_items_in_batch)
