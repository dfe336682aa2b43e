"""fused_is.integrations.trl against TRL's own GRPOTrainer (the pinned trl of the bench extra), on the CPU with a
tiny random Qwen2 model and a word-level tokenizer built here (no downloads).

The sampler side is a rollout function that returns completions with sampler logprobs (the learner's
logprobs plus noise: the mismatch a vLLM engine shows). TRL applies its importance-sampling correction only
with use_vllm=True, which would start or reach a vLLM server; the trainers here are built without it and
then switched to it, with a stand-in whose weight sync does nothing (the rollout function is the engine).
"""

import copy
import os
import types

import pytest
import torch

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
if os.environ.get("CI") == "true":  # the README's test command installs trl (the bench extra): no skip in CI
    import trl
else:
    trl = pytest.importorskip("trl", reason="trl is installed by the README's test command (the bench extra)")

from datasets import Dataset  # noqa: E402
from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: E402
from transformers import (PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM, Qwen2MoeConfig,  # noqa: E402
                          Qwen2MoeForCausalLM, Qwen2VLConfig, Qwen2VLForConditionalGeneration)

from fused_is.integrations.trl import FusedGRPOTrainer, config_from_trl  # noqa: E402

V = 96
PROMPTS = 8


def _tokenizer():
    vocab = {f"w{i}": i for i in range(V)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0", pad_token="w1", eos_token="w2")


TOKENIZER = _tokenizer()
DATASET = Dataset.from_dict({"prompt": [" ".join(f"w{(7 * i + 3 * j) % 80 + 3}" for j in range(3 + i % 3))
                                        for i in range(PROMPTS)]})


def _model():
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)
    return Qwen2ForCausalLM(cfg)


def _reward(completions, **kwargs):
    return [float(sum(map(ord, c)) % 7) for c in completions]


def _rollout(prompts, trainer):
    """Completions of 1 to 6 tokens with sampler logprobs = the learner's current logprobs + 0.2 + N(0, 0.3),
    at most 0: the engines' mismatch (the sampler a little more confident). Seeded by the prompt, so two
    trainers see the same batch."""
    prompt_ids = [TOKENIZER(p)["input_ids"] for p in prompts]
    completions, logprobs = [], []
    for i, ids in enumerate(prompt_ids):
        gen = torch.Generator().manual_seed(1000 * sum(ids) + i)
        length = int(torch.randint(1, 7, (1,), generator=gen))
        comp = torch.randint(3, V, (length,), generator=gen)
        with torch.no_grad():
            logits = trainer.model(torch.tensor([ids + comp.tolist()])).logits[0, len(ids) - 1:-1].double()
        lp = torch.log_softmax(logits / trainer.temperature, -1).gather(-1, comp[:, None])[:, 0]
        samp = (lp + 0.2 + 0.3 * torch.randn(length, generator=gen, dtype=torch.float64)).clamp(max=0.0)
        completions.append(comp.tolist())
        logprobs.append(samp.tolist())
    return {"prompt_ids": prompt_ids, "completion_ids": completions, "logprobs": logprobs}


class _NoSync:
    """Stands in for TRL's vLLM generation object: the rollout function is the engine, nothing to sync."""

    def sync_weights(self):
        pass


def _args(tmp_path, **overrides):
    is_mode = overrides.pop("is_mode", None)
    base = dict(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4, max_completion_length=6,
                max_steps=1, learning_rate=0.1, optim="sgd", report_to=[], use_cpu=True, save_strategy="no",
                logging_steps=1, bf16=False, beta=0.0, seed=3, disable_tqdm=True)
    base.update(overrides)
    if is_mode is not None:
        base.update(vllm_importance_sampling_mode=is_mode)
    return trl.GRPOConfig(**base), is_mode


def _moe_model():
    """A tiny random Qwen2-MoE (4 experts, 2 per token, a shared expert) whose config asks for the router's
    load-balancing loss at a weight large enough to show in the gradients."""
    torch.manual_seed(0)
    cfg = Qwen2MoeConfig(vocab_size=V, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                         shared_expert_intermediate_size=16, num_experts=4, num_experts_per_tok=2, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=False, router_aux_loss_coef=0.5, decoder_sparse_step=1, mlp_only_layers=[])
    return Qwen2MoeForCausalLM(cfg)


def _trainer(cls, args, is_mode, make_model=_model):
    model = make_model()
    path = os.path.join(args.output_dir, "model")  # TRL loads its reference model (beta != 0) from the model's path
    if not os.path.isdir(path):
        model.save_pretrained(path)
    model.config._name_or_path = path
    trainer = cls(model=model, reward_funcs=_reward, args=args, train_dataset=DATASET, processing_class=TOKENIZER,
                  rollout_func=_rollout)
    if is_mode is not None:  # TRL's IS correction, with the rollout function as the engine
        trainer.use_vllm = True
        trainer.vllm_importance_sampling_correction = True
        trainer.vllm_generation = _NoSync()
        trainer._last_loaded_step = -1
    return trainer


# every loss type TRL ships (vespo refused), each IS mode, the KL with and without its bias correction, GSPO,
# the two-sided clip, the off-policy mask, the entropy bonus where it maps
CASES = [
    ("grpo", dict(loss_type="grpo")),
    ("grpo_token_truncate", dict(loss_type="grpo", is_mode="token_truncate")),
    ("bnpo_token_mask_kl", dict(loss_type="bnpo", is_mode="token_mask", vllm_importance_sampling_clip_max=1.5,
                                vllm_importance_sampling_clip_min=0.6, beta=0.05)),
    ("dr_grpo_sequence_truncate", dict(loss_type="dr_grpo", is_mode="sequence_truncate",
                                       vllm_importance_sampling_clip_max=1.2)),
    ("dapo_sequence_mask_bias_kl", dict(loss_type="dapo", is_mode="sequence_mask", vllm_importance_sampling_clip_max=2.0,
                                        beta=0.1, use_bias_correction_kl=True)),
    ("dapo_delta_eps_high", dict(loss_type="dapo", epsilon=0.1, epsilon_high=0.15, delta=1.3,
                                 is_mode="token_truncate")),
    ("bnpo_entropy", dict(loss_type="bnpo", entropy_coef=0.01, is_mode="token_truncate")),
    ("grpo_entropy", dict(loss_type="grpo", entropy_coef=0.05, is_mode="token_truncate")),
    ("dapo_entropy_kl", dict(loss_type="dapo", entropy_coef=0.05, beta=0.05)),
    ("cispo_token_truncate", dict(loss_type="cispo", epsilon_high=1.1, is_mode="token_truncate")),
    ("sapo_kl", dict(loss_type="sapo", beta=0.05, sapo_temperature_pos=1.5, sapo_temperature_neg=2.0)),
    ("gspo_sequence_truncate", dict(loss_type="grpo", importance_sampling_level="sequence", epsilon=3e-4,
                                    epsilon_high=4e-4, is_mode="sequence_truncate")),
    ("luspo", dict(loss_type="luspo", importance_sampling_level="sequence", epsilon=0.01, is_mode="sequence_mask",
                   vllm_importance_sampling_clip_max=5.0)),
    ("luspo_token_kl", dict(loss_type="luspo", is_mode="token_truncate", beta=0.05)),
    ("off_policy_mask", dict(loss_type="grpo", off_policy_mask_threshold=0.1, is_mode="token_truncate")),
    ("vespo", dict(loss_type="vespo")),
    ("vespo_token_mask_kl", dict(loss_type="vespo", is_mode="token_mask", vllm_importance_sampling_clip_max=1.5,
                                 vllm_importance_sampling_clip_min=0.7, vespo_k_pos=1.5, beta=0.05)),
]


def _grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("path", ["hidden", "logits"])
@pytest.mark.parametrize("name,overrides", CASES, ids=[c[0] for c in CASES])
def test_loss_and_gradients_equal_trl(tmp_path, name, overrides, path):
    """On one batch from TRL's own generation step (its old logprobs, IS ratios, advantages and counts),
    FusedGRPOTrainer's loss and parameter gradients equal GRPOTrainer's, from hidden states (fused linear) and
    from logits."""
    _compare_one_batch(tmp_path, overrides, path, _model)


@pytest.mark.parametrize("path", ["hidden", "logits"])
@pytest.mark.parametrize("accumulation", [1, 2])
def test_moe_load_balancing_loss_equals_trl(tmp_path, path, accumulation):
    """A MoE model: TRL adds router_aux_loss_coef x the model's load-balancing loss (over the accumulation
    steps); FusedGRPOTrainer adds the same, from the logits forward or from the hidden-states one."""
    ours = _compare_one_batch(tmp_path, dict(loss_type="dapo", is_mode="token_truncate"), path, _moe_model,
                              accumulation)
    assert ours.aux_loss_enabled and ours._metrics["train"]["aux_loss"][-1] > 0


def _compare_one_batch(tmp_path, overrides, path, make_model, accumulation=1):
    args, is_mode = _args(tmp_path, **overrides)
    ours, theirs = (_trainer(FusedGRPOTrainer, args, is_mode, make_model),
                    _trainer(trl.GRPOTrainer, args, is_mode, make_model))
    ours.fused_is_path = path
    theirs.model.train()
    ours.model.train()
    batch = [DATASET[i] for i in range(args.per_device_train_batch_size)]
    with torch.no_grad():
        inputs = theirs._generate_and_score_completions(batch)
        # the policy moved since the batch was generated (as after earlier optimizer steps): ratios leave 1, so
        # the clip, the two-sided clip, SAPO's gate, CISPO's cap and the off-policy mask all have work to do
        gen = torch.Generator().manual_seed(5)
        for p in theirs.model.parameters():
            p.add_(0.6 * p.std().nan_to_num() * torch.randn(p.shape, generator=gen))
    ours.model.load_state_dict(theirs.model.state_dict())
    assert (inputs["advantages"] != 0).any()
    if is_mode is not None:
        assert "sampling_per_token_logps" in inputs and "importance_sampling_ratio" in inputs
    results = []
    for trainer in (theirs, ours):
        trainer.current_gradient_accumulation_steps = accumulation  # set by the training loop, not run here
        trainer.model.zero_grad()
        loss = trainer._compute_loss(trainer.model, copy.copy(inputs))
        loss.backward()
        results.append((loss.detach().double(), _grads(trainer.model)))
    (loss_t, grads_t), (loss_f, grads_f) = results
    assert getattr(ours.model, "_fused_is_hidden", False) == (path == "hidden")
    assert torch.isfinite(loss_f)
    assert abs(loss_f - loss_t) <= 2e-6 * max(1.0, abs(float(loss_t))), (float(loss_f), float(loss_t))
    assert grads_t.keys() == grads_f.keys()
    num = sum(float((grads_f[k].double() - grads_t[k].double()).norm() ** 2) for k in grads_t) ** 0.5
    den = sum(float(grads_t[k].double().norm() ** 2) for k in grads_t) ** 0.5
    assert den > 0 and num <= 1e-5 * den, (num, den)
    for key in ("entropy", "fused_is/entropy_mean"):
        assert ours._metrics["train"][key], key
    if "clip_ratio/region_mean" in ours._metrics["train"] and "old_per_token_logps" in inputs:  # else r = 1
        assert ours._metrics["train"]["clip_ratio/region_mean"][-1] > 0  # the clip did bind somewhere
    if args.off_policy_mask_threshold is not None:
        assert ours._metrics["train"]["fused_is/off_policy_masked_frac"][-1] > 0
    return ours


TRAIN_CASES = [CASES[1], CASES[4], CASES[5], CASES[8]]


@pytest.mark.parametrize("name,overrides", TRAIN_CASES, ids=[c[0] for c in TRAIN_CASES])
def test_training_step_reaches_trl_parameters(tmp_path, name, overrides):
    """trainer.train() for one optimizer step (two micro-batches of gradient accumulation) from the same
    model: the parameters equal GRPOTrainer's to 1e-6, and the update itself to 1e-4 (fused linear path)."""
    args, is_mode = _args(tmp_path, gradient_accumulation_steps=2, per_device_train_batch_size=2, **overrides)
    trainers = [_trainer(cls, args, is_mode) for cls in (trl.GRPOTrainer, FusedGRPOTrainer)]
    assert trainers[1].fused_is_path == "hidden"
    start = {k: v.detach().clone() for k, v in trainers[0].model.named_parameters()}
    for trainer in trainers:
        trainer.model.load_state_dict({k: v.clone() for k, v in start.items()}, strict=False)
        trainer.train()
    after_t = dict(trainers[0].model.named_parameters())
    after_f = dict(trainers[1].model.named_parameters())
    upd = lambda after: torch.cat([(after[k].detach() - start[k]).double().reshape(-1) for k in start])  # noqa: E731
    update_t, update_f = upd(after_t), upd(after_f)
    assert float(update_t.norm()) > 0
    assert float((update_f - update_t).norm()) <= 1e-4 * float(update_t.norm())
    params_t = torch.cat([after_t[k].detach().double().reshape(-1) for k in start])
    params_f = torch.cat([after_f[k].detach().double().reshape(-1) for k in start])
    assert float((params_f - params_t).norm()) <= 1e-6 * float(params_t.norm())


@pytest.mark.parametrize("overrides,option", [
    (dict(loss_type="vespo", is_mode="sequence_truncate"), "vllm_importance_sampling_mode"),
    (dict(top_entropy_quantile=0.5), "top_entropy_quantile"),
    (dict(loss_type="cispo", importance_sampling_level="sequence"), "importance_sampling_level"),
    (dict(loss_type="grpo", importance_sampling_level="sequence", beta=0.1, use_bias_correction_kl=True),
     "use_bias_correction_kl"),
    (dict(loss_type="grpo", delta=1.1, epsilon=0.2), "delta"),
    (dict(loss_type="cispo", epsilon_high=0.5), "epsilon_high"),
    (dict(use_adaptive_entropy=True), "use_adaptive_entropy"),
])
def test_unsupported_options_are_refused_by_name(tmp_path, overrides, option):
    args, _ = _args(tmp_path, **overrides)
    with pytest.raises(ValueError, match=f"GRPOConfig.{option}="):
        config_from_trl(args, importance_sampling=True)
    if option != "vllm_importance_sampling_mode":  # (IS modes matter with vLLM only, which this trainer lacks)
        with pytest.raises(ValueError, match=f"GRPOConfig.{option}="):
            _trainer(FusedGRPOTrainer, args, None)


def test_mapping_of_the_defaults(tmp_path):
    """TRL's defaults (dapo, token level, eps 0.2, IS only with vLLM) as fused_is reads them."""
    args, _ = _args(tmp_path)
    spec = config_from_trl(args)
    cfg = spec.config
    assert (cfg.policy, cfg.loss_agg, cfg.is_level, cfg.clip_low, cfg.clip_high, spec.normalizer) == (
        "ppo", "token-mean", "none", 0.2, 0.2, "items")
    on = config_from_trl(args, importance_sampling=True).config
    assert (on.is_level, on.is_mode, on.is_cap, on.is_floor) == ("sequence", "mask", 3.0, None)  # TRL's default mode


def test_unscorable_sampler_tokens(tmp_path):
    """A token vLLM could not score has a NaN sampler logprob; TRL counts it as no divergence (its IS ratio is
    computed at generation). FusedGRPOTrainer takes TRL's ratio and the same loss, and refuses the off-policy
    mask there (it would need the current lp at that token)."""
    args, is_mode = _args(tmp_path, loss_type="grpo", is_mode="token_truncate")
    ours, theirs = _trainer(FusedGRPOTrainer, args, is_mode), _trainer(trl.GRPOTrainer, args, is_mode)
    batch = [DATASET[i] for i in range(args.per_device_train_batch_size)]
    with torch.no_grad():
        inputs = theirs._generate_and_score_completions(batch)
    first = inputs["completion_mask"].nonzero()[0].tolist()
    inputs["sampling_per_token_logps"][first[0], first[1]] = float("nan")
    losses = []
    for trainer in (theirs, ours):
        trainer.current_gradient_accumulation_steps = 1
        losses.append(float(trainer._compute_loss(trainer.model, copy.copy(inputs))))
    assert abs(losses[1] - losses[0]) <= 2e-6 * max(1.0, abs(losses[0])), losses
    ours.args.off_policy_mask_threshold = 0.1
    with pytest.raises(ValueError, match="could not score"):
        ours._compute_loss(ours.model, copy.copy(inputs))


def _vision_model():
    """A tiny random Qwen2-VL: a one-block vision tower (2x2 patches, 2x2 merge: an image of 4x4 patches is 4
    tokens), the text model as _model's; its image token ids at the top of the vocabulary."""
    torch.manual_seed(0)
    cfg = Qwen2VLConfig(
        text_config=dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False,
                         rope_scaling={"type": "mrope", "mrope_section": [1, 1, 2]}),
        vision_config=dict(depth=1, embed_dim=16, num_heads=2, hidden_size=32, mlp_ratio=2, patch_size=2,
                           spatial_merge_size=2, temporal_patch_size=2, in_channels=3),
        image_token_id=V - 1, video_token_id=V - 2, vision_start_token_id=V - 3, tie_word_embeddings=False)
    return Qwen2VLForConditionalGeneration(cfg)


@pytest.mark.parametrize("path", ["hidden", "logits"])
def test_vision_language_model_equals_trl(tmp_path, path):
    """A vision-language batch (one image per prompt: pixel_values, image_grid_thw, mm_token_type_ids, as TRL's
    generation step leaves them): loss and parameter gradients equal GRPOTrainer's, and the images reach the
    model (without them the loss differs)."""
    args, is_mode = _args(tmp_path, loss_type="grpo")
    ours, theirs = (_trainer(FusedGRPOTrainer, args, is_mode, _vision_model),
                    _trainer(trl.GRPOTrainer, args, is_mode, _vision_model))
    ours.fused_is_path = path
    gen = torch.Generator().manual_seed(11)
    b, image_tokens = 4, 4
    prompt = torch.tensor([[5 + i, 6, V - 3] + [V - 1] * image_tokens + [7 + i] for i in range(b)])
    lengths = [3, 6, 1, 4]
    completion = torch.randint(3, V - 3, (b, max(lengths)), generator=gen)
    completion_mask = (torch.arange(max(lengths))[None, :] < torch.tensor(lengths)[:, None]).long()
    ids = torch.cat([prompt, completion], 1)
    inputs = dict(prompt_ids=prompt, prompt_mask=torch.ones_like(prompt), completion_ids=completion,
                  completion_mask=completion_mask, advantages=torch.randn(b, generator=gen),
                  pixel_values=torch.randn(b * 16, 3 * 2 * 2 * 2, generator=gen),
                  image_grid_thw=torch.tensor([[1, 4, 4]] * b), num_images=[1] * b,
                  mm_token_type_ids=(ids == V - 1).long())
    with torch.no_grad():  # old logprobs from TRL's own forward, then the policy moves (ratios leave 1)
        old, _, _ = theirs._get_per_token_logps_and_entropies(
            theirs.model, ids, torch.ones_like(ids), completion.size(1), pixel_values=inputs["pixel_values"],
            image_grid_thw=inputs["image_grid_thw"], num_images=inputs["num_images"],
            mm_token_type_ids=inputs["mm_token_type_ids"])
        inputs["old_per_token_logps"] = old
        for p in theirs.model.parameters():
            p.add_(0.3 * p.std().nan_to_num() * torch.randn(p.shape, generator=gen))
    ours.model.load_state_dict(theirs.model.state_dict())
    results = []
    for trainer in (theirs, ours):
        trainer.model.train()
        trainer.current_gradient_accumulation_steps = 1
        trainer.model.zero_grad()
        loss = trainer._compute_loss(trainer.model, copy.copy(inputs))
        loss.backward()
        results.append((loss.detach().double(), _grads(trainer.model)))
    (loss_t, grads_t), (loss_f, grads_f) = results
    assert abs(loss_f - loss_t) <= 2e-6 * max(1.0, abs(float(loss_t))), (float(loss_f), float(loss_t))
    assert grads_t.keys() == grads_f.keys() and any("visual" in k for k in grads_t)
    num = sum(float((grads_f[k].double() - grads_t[k].double()).norm() ** 2) for k in grads_t) ** 0.5
    den = sum(float(grads_t[k].double().norm() ** 2) for k in grads_t) ** 0.5
    assert den > 0 and num <= 1e-5 * den, (num, den)
    blank = dict(inputs, pixel_values=torch.zeros_like(inputs["pixel_values"]))
    with torch.no_grad():
        assert abs(float(ours._compute_loss(ours.model, blank)) - float(loss_f)) > 1e-6  # the images count


def test_moe_with_another_load_balancing_signature_is_refused_on_the_hidden_path():
    """Doge's load_balancing_loss_func takes num_keys too: the hidden path refuses it by name rather than
    calling it wrongly (the logits path takes the model's own aux_loss)."""
    from transformers import DogeConfig, DogeForCausalLM

    import fused_is.integrations.trl as fused_trl

    model = DogeForCausalLM(DogeConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                       num_attention_heads=4, num_key_value_heads=2, is_moe=True, num_experts=16,
                                       num_experts_per_tok=2, max_position_embeddings=64))
    with pytest.raises(ValueError, match="use fused_is_path='logits'"):
        fused_trl._load_balancing_loss(model, None, None)


def load_balancing_loss_func(gate_logits, num_experts=None, top_k=2, attention_mask=None):
    """transformers' signature (this module stands in for a model's module below)."""
    return num_experts, top_k


class _TextConfigMoe:
    """A vision-language MoE as transformers 5 builds some (Qwen3-VL-MoE): the expert counts on its text config,
    none on the model."""

    class config:  # noqa: N801
        @staticmethod
        def get_text_config():
            return types.SimpleNamespace(num_experts=8, num_experts_per_tok=3)


def test_moe_expert_counts_from_the_text_config():
    import fused_is.integrations.trl as fused_trl

    assert fused_trl._load_balancing_loss(_TextConfigMoe(), None, None) == (8, 3)
