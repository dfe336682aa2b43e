"""fused_is.integrations.trl_distill against TRL 1.16's own GKDTrainer, GOLDTrainer and IWOPDTrainer, on the CPU with
tiny random Qwen2 students and teachers and a word-level tokenizer built here (no downloads): each trainer's
compute_loss and its Fused subclass's on the same batch, the loss and the student's parameter gradients, from the
logits (distill_loss) and from the hidden states (linear_distill_loss); each mapped option changes the result; the
options that do not map are refused by name.
"""

import os
import warnings

import pytest
import torch

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
if os.environ.get("CI") == "true":  # the README's test command installs trl (the bench extra): no skip in CI
    import trl  # noqa: F401
else:
    pytest.importorskip("trl", reason="trl is installed by the README's test command (the bench extra)")

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # TRL's import warns about the installed vLLM's version
    from fused_is.integrations.trl_distill import (FusedGKDTrainer, FusedGOLDTrainer,  # noqa: E402
                                                   FusedIWOPDTrainer, distill_kwargs_from_trl)
    from trl.experimental.gkd import GKDConfig, GKDTrainer  # noqa: E402
    from trl.experimental.gold import GOLDConfig, GOLDTrainer  # noqa: E402
    from trl.experimental.iw_opd import IWOPDConfig, IWOPDTrainer  # noqa: E402

from datasets import Dataset  # noqa: E402
from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: E402
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM  # noqa: E402

V = 96
# family -> (config class, TRL's trainer, ours, the config's own settings for these tests)
TRAINERS = {
    "gkd": (GKDConfig, GKDTrainer, FusedGKDTrainer, dict(dataset_kwargs={"skip_prepare_dataset": True})),
    "gold": (GOLDConfig, GOLDTrainer, FusedGOLDTrainer, dict(dataset_kwargs={"skip_prepare_dataset": True})),
    "iw_opd": (IWOPDConfig, IWOPDTrainer, FusedIWOPDTrainer, {}),
}
# the trainers' constructors want a dataset; the tests feed compute_loss a batch of their own
DATASET = Dataset.from_dict({"prompt": ["w3 w4"], "completion": ["w5 w6"]})
# relative tolerances (loss, gradient norm): fp32 models against TRL's own loss; bf16 models against TRL's loss
# computed in float64 from the same bf16 logits (its gradient rounded once to bf16, as fused_is rounds its own), and
# TRL's bf16 loss itself (log-softmax and mixture rounded to bf16) against that reference
TOLERANCES = {torch.float32: (2e-6, 1e-5), torch.bfloat16: (1e-6, 1e-3)}
TRL_BF16_TOLERANCES = (2e-2, 5e-2)


def _tokenizer():
    tok = Tokenizer(models.WordLevel(vocab={f"w{i}": i for i in range(V)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0", pad_token="w1", eos_token="w2")


TOKENIZER = _tokenizer()


@pytest.fixture(scope="module")
def teacher_path(tmp_path_factory):
    """IW-OPD checks the teacher's tokenizer against the student's, loading it from the teacher's _name_or_path."""
    path = tmp_path_factory.mktemp("teacher")
    TOKENIZER.save_pretrained(path)
    return str(path)


def _model(seed: int, dtype: torch.dtype):
    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False,
                      initializer_range=0.3)  # logits of a few units: distributions far from uniform
    return Qwen2ForCausalLM(cfg).to(dtype)


def _batch():
    """Four right-padded sequences, prompts of 2 to 5 tokens (labels -100) and completions of 1 to 6; the prompts as
    GKD's collator adds them, left-padded (the losses do not read them)."""
    gen = torch.Generator().manual_seed(7)
    prompt_lengths, completion_lengths = [2, 5, 3, 4], [6, 1, 4, 3]
    width = max(p + c for p, c in zip(prompt_lengths, completion_lengths)) + 1
    ids = torch.ones(4, width, dtype=torch.long)
    labels = torch.full_like(ids, -100)
    attention = torch.zeros_like(ids)
    prompts = torch.ones(4, max(prompt_lengths), dtype=torch.long)
    prompt_mask = torch.zeros_like(prompts)
    for i, (p, c) in enumerate(zip(prompt_lengths, completion_lengths)):
        tokens = torch.randint(3, V, (p + c,), generator=gen)
        ids[i, :p + c], attention[i, :p + c], labels[i, p:p + c] = tokens, 1, tokens[p:]
        prompts[i, -p:], prompt_mask[i, -p:] = tokens[:p], 1
    return dict(input_ids=ids, attention_mask=attention, labels=labels, prompts=prompts,
                prompt_attention_mask=prompt_mask)


BATCH = _batch()


def _args(family, tmp_path, **overrides):
    config, _, _, own = TRAINERS[family]
    return config(output_dir=str(tmp_path), report_to=[], use_cpu=True, save_strategy="no", disable_tqdm=True,
                  bf16=False, per_device_train_batch_size=4, **own, **overrides)


def _trainer(cls, args, teacher_path, dtype=torch.float32, **kwargs):
    student, teacher = _model(0, dtype), _model(1, dtype)  # another random model: the divergence is far from 0
    teacher.config._name_or_path = teacher_path
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # GKD's and IW-OPD's advice on other trainers and settings
        return cls(model=student, teacher_model=teacher, args=args, train_dataset=DATASET, processing_class=TOKENIZER,
                   **kwargs)


def _run(trainer, num_items=None):
    """compute_loss on BATCH and its backward: (loss float64, the student's parameter gradients)."""
    trainer.model.train()
    trainer.model.zero_grad()
    loss = trainer.compute_loss(trainer.model, dict(BATCH), num_items_in_batch=num_items)
    loss.backward()
    grads = {n: p.grad.detach().double() for n, p in trainer.model.named_parameters() if p.grad is not None}
    return loss.detach().double(), grads


def _errors(result, reference):
    """(relative error of the loss, relative error of the student's whole gradient) of a _run against another."""
    (loss, grads), (loss_ref, grads_ref) = result, reference
    assert grads.keys() == grads_ref.keys() and torch.isfinite(loss)
    num = sum(float((grads[k] - grads_ref[k]).norm() ** 2) for k in grads_ref) ** 0.5
    den = sum(float(grads_ref[k].norm() ** 2) for k in grads_ref) ** 0.5
    assert den > 0 and float(loss_ref) > 1e-2  # the distributions are far apart: the comparison has work to do
    return abs(float(loss - loss_ref)) / abs(float(loss_ref)), num / den


def _upcast_loss(trainer):
    """TRL's trainer with its own generalized_jsd_loss computed in float64 from the models' logits."""
    loss_fn = type(trainer).generalized_jsd_loss
    trainer.generalized_jsd_loss = lambda student_logits, teacher_logits, **kw: loss_fn(
        student_logits.double(), teacher_logits.double(), **kw)
    return trainer


def _compare(family, tmp_path, teacher_path, overrides, *, num_items=None, path="logits", dtype=torch.float32):
    """Ours against TRL's trainer on BATCH (TOLERANCES); returns (our trainer, our loss)."""
    args = _args(family, tmp_path, **overrides)
    _, trl_cls, fused_cls, _ = TRAINERS[family]
    theirs, ours = _trainer(trl_cls, args, teacher_path, dtype), _trainer(fused_cls, args, teacher_path, dtype)
    ours.fused_is_path = path
    result = _run(ours, num_items)
    if dtype == torch.float32:
        reference = _run(theirs, num_items)
    else:
        reference = _run(_upcast_loss(_trainer(trl_cls, args, teacher_path, dtype)), num_items)
        trl_errors = _errors(_run(theirs, num_items), reference)
        assert all(e <= tol for e, tol in zip(trl_errors, TRL_BF16_TOLERANCES)), trl_errors
    errors = _errors(result, reference)
    assert all(e <= tol for e, tol in zip(errors, TOLERANCES[dtype])), errors
    assert getattr(ours.model, "_fused_is_hidden", False) == (path == "hidden")
    assert ours._metrics["train"]["fused_is/divergence_mean"]
    return ours, float(result[0])


JSD = dict(distillation_objective="jsd")  # IW-OPD's default objective is the sampled-token one, refused
ITEMS = torch.tensor(11)  # num_items_in_batch as the training loop passes it: the label tokens of the whole step
CASES = [
    ("gkd_jsd", "gkd", dict(beta=0.5), None),
    ("gkd_forward_kl_items", "gkd", dict(beta=0.0), ITEMS),
    ("gkd_reverse_kl", "gkd", dict(beta=1.0), None),
    ("gold_jsd_temperature", "gold", dict(beta=0.3, temperature=0.7), None),
    ("gold_reverse_kl_items", "gold", dict(beta=1.0, temperature=1.3), ITEMS),
    ("iw_opd_full_vocabulary", "iw_opd", dict(JSD, beta=0.5, loss_top_k=0, temperature=0.8), None),
    ("iw_opd_top5_tail_items", "iw_opd", dict(JSD, beta=0.0, loss_top_k=5), ITEMS),
    ("iw_opd_top5_renormalised", "iw_opd", dict(JSD, beta=0.5, loss_top_k=5, loss_add_tail=False), None),
    ("iw_opd_top1_argmax", "iw_opd", dict(JSD, beta=0.5, loss_top_k=1, reverse_kl_top_1_mode="argmax"), None),
    ("iw_opd_reverse_top1", "iw_opd", dict(JSD, beta=1.0, loss_top_k=1, reverse_kl_top_1_mode="argmax",
                                           temperature=1.5), None),
]


@pytest.mark.parametrize("path", ["logits", "hidden"])
@pytest.mark.parametrize("name,family,overrides,num_items", CASES, ids=[c[0] for c in CASES])
def test_loss_and_gradients_equal_trl(tmp_path, teacher_path, name, family, overrides, num_items, path):
    """fp32: loss and student gradients equal TRL's, with TRL's batchmean and with num_items_in_batch (the
    gradient-accumulation count the training loop passes), from the logits and from the hidden states."""
    _compare(family, tmp_path, teacher_path, overrides, num_items=num_items, path=path)


@pytest.mark.parametrize("path", ["logits", "hidden"])
@pytest.mark.parametrize("family,overrides", [("gkd", dict(beta=0.5)), ("gold", dict(beta=0.5, temperature=0.9)),
                                              ("iw_opd", dict(JSD, beta=0.5, loss_top_k=5))])
def test_bf16_models_equal_trl(tmp_path, teacher_path, family, overrides, path):
    """bf16 student and teacher: the fused loss and gradients equal TRL's loss computed in float64 from the same bf16
    logits (TRL's own bf16 loss is 1e-3 to 1e-2 away from it)."""
    _compare(family, tmp_path, teacher_path, overrides, path=path, dtype=torch.bfloat16)


# family -> (base settings, [(option, value) changed one at a time]); every option moves the loss, except
# GKDConfig.temperature: GKD samples at it but computes its loss at temperature 1 (TRL and fused_is alike)
OPTIONS = {
    "gkd": (dict(beta=0.5, temperature=0.9), [("beta", 0.0), ("beta", 1.0), ("temperature", 0.5)]),
    "gold": (dict(beta=0.5, temperature=0.9), [("beta", 0.1), ("temperature", 1.4)]),
    "iw_opd": (dict(JSD, beta=0.5, temperature=0.9, loss_top_k=4),
               [("beta", 0.0), ("temperature", 1.4), ("loss_top_k", 0), ("loss_add_tail", False)]),
}


@pytest.mark.parametrize("family", list(OPTIONS))
def test_each_mapped_option_acts(tmp_path, teacher_path, family):
    base, changes = OPTIONS[family]
    _, reference = _compare(family, tmp_path, teacher_path, base)
    for option, value in changes:
        _, loss = _compare(family, tmp_path, teacher_path, dict(base, **{option: value}))
        inert = (family, option) == ("gkd", "temperature")
        assert (abs(loss - reference) <= 1e-12) if inert else (abs(loss - reference) > 1e-4), (option, loss, reference)
    _, per_item = _compare(family, tmp_path, teacher_path, base, num_items=ITEMS)  # the reduction acts too
    assert abs(per_item - reference) > 1e-4


REFUSED = [
    ("gold", dict(use_uld_loss=True, teacher_tokenizer_name_or_path="another/tokenizer"), "use_uld_loss"),
    ("iw_opd", {}, "distillation_objective"),  # TRL's default: the sampled-token IW-OPD objective
    ("iw_opd", dict(JSD, use_teacher_server=True, teacher_model_server_url="http://127.0.0.1:9"), "use_teacher_server"),
    ("iw_opd", dict(JSD, beta=0.5, loss_top_k=1), "reverse_kl_top_1_mode"),
]


@pytest.mark.parametrize("family,overrides,option", REFUSED, ids=[r[2] for r in REFUSED])
def test_unsupported_options_are_refused_by_name(tmp_path, teacher_path, family, overrides, option):
    """Refused by the mapping, and by the Fused trainer before TRL's constructor runs (no tokenizer fetched for ULD,
    no teacher server reached)."""
    args = _args(family, tmp_path, **overrides)
    match = f"{type(args).__name__}.{option}="
    with pytest.raises(ValueError, match=match):
        distill_kwargs_from_trl(args)
    with pytest.raises(ValueError, match=match):
        _trainer(TRAINERS[family][2], args, teacher_path)


def test_mapping_of_each_trainer(tmp_path):
    """The keywords as read: GKD's loss at temperature 1, GOLD's at its temperature, IW-OPD's top-k and tail; other
    objects are a TypeError."""
    assert distill_kwargs_from_trl(_args("gkd", tmp_path, beta=0.2, temperature=0.7)) == dict(
        kind="jsd", beta=0.2, temperature=1.0, top_k=0, add_tail=True)
    assert distill_kwargs_from_trl(_args("gold", tmp_path, beta=0.2, temperature=0.7))["temperature"] == 0.7
    iw_opd = _args("iw_opd", tmp_path, **JSD, beta=0.0, loss_top_k=3, loss_add_tail=False)
    assert distill_kwargs_from_trl(iw_opd) == dict(kind="jsd", beta=0.0, temperature=1.0, top_k=3, add_tail=False)
    with pytest.raises(TypeError, match="GKDConfig"):
        distill_kwargs_from_trl(object())


def test_evaluation_returns_the_outputs_and_hidden_path_refusals(tmp_path, teacher_path):
    """return_outputs=True (evaluation) takes the logits path and returns the student's outputs, as TRL's; the hidden
    path refuses by name a model that transforms its logits after the head."""
    trainer = _trainer(FusedGKDTrainer, _args("gkd", tmp_path), teacher_path)
    trainer.fused_is_path = "hidden"
    with torch.no_grad():
        loss, outputs = trainer.compute_loss(trainer.model, dict(BATCH), return_outputs=True)
    assert outputs.logits.shape == (*BATCH["input_ids"].shape, V) and float(loss) > 0
    trainer.teacher_model.config.final_logit_softcapping = 30.0
    with pytest.raises(ValueError, match="teacher model cannot be read as hidden states.*final_logit_softcapping"):
        trainer.compute_loss(trainer.model, dict(BATCH))
    trainer.fused_is_path = "logit"
    with pytest.raises(ValueError, match="fused_is_path must be"):
        trainer.compute_loss(trainer.model, dict(BATCH))


def test_peft_student_on_the_logits_path(tmp_path, teacher_path):
    """A LoRA student (TRL wraps it from peft_config): the logits path equals GKDTrainer's; the hidden path refuses it
    by name (a PEFT model's forward does not end at its backbone)."""
    peft = pytest.importorskip("peft")
    args = _args("gkd", tmp_path, beta=0.5)
    lora = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)  # B != 0: A learns
    theirs, ours = (_trainer(cls, args, teacher_path, peft_config=peft.LoraConfig(**lora))
                    for cls in (GKDTrainer, FusedGKDTrainer))
    ours.model.load_state_dict(theirs.model.state_dict())  # the same random adapters
    errors = _errors(_run(ours), _run(theirs))
    assert all(e <= tol for e, tol in zip(errors, TOLERANCES[torch.float32])), errors
    ours.fused_is_path = "hidden"
    with pytest.raises(ValueError, match="student model cannot be read as hidden states: a PEFT model"):
        ours.compute_loss(ours.model, dict(BATCH))
