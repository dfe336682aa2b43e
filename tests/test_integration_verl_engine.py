"""verl's engine with fused_is's loss: the real `FSDPEngineWithLMHead.forward_step` of verl 0.9.1 on the CPU, with a
tiny random Qwen2 as its module (no FSDP wrapping, no download), patched by `fused_is.integrations.verl.patch_engine`
and given `engine_ppo_loss` as its loss function, against the same engine running verl's own `ppo_loss`: the loss
and every parameter's gradient. The engine builds its packed inputs, calls the model and hands its outputs to the
loss exactly as in training; the only stand-ins are the device helpers (a CPU here) and the data-parallel group.
"""

import functools
import os
import subprocess
import sys
import types
import warnings

import pytest
import torch

if os.environ.get("CI") == "true":  # installed by scripts/dev.sh: no skip in CI
    import verl  # noqa: F401
else:
    pytest.importorskip("verl", reason="verl is installed (--no-deps) by the README's test command")

from tensordict import TensorDict  # noqa: E402
from transformers import Qwen2Config, Qwen2ForCausalLM  # noqa: E402
from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_rejection_mask  # noqa: E402
from verl.utils import torch_functional as verl_F  # noqa: E402
from verl.utils import tensordict_utils as tu  # noqa: E402
from verl.workers.config.actor import ActorConfig, PolicyLossConfig  # noqa: E402
from verl.workers.engine.fsdp import transformer_impl  # noqa: E402
from verl.workers.utils.losses import ppo_loss  # noqa: E402

import fused_is.integrations.verl as fused_verl  # noqa: E402
from fused_is import backends  # noqa: E402

warnings.filterwarnings("ignore", category=UserWarning)
V = 96
BACKENDS = [b for b in backends.available_backends() if b != "reference"]


def _nested(xs):
    return torch.nested.as_nested_tensor(xs, layout=torch.jagged)


@pytest.fixture
def cpu_engine(monkeypatch):
    """(make_engine, model) with verl's device helpers answering "cpu"; make_engine(**attrs) builds an engine object
    of verl's class around a copy of the model, with the attributes forward_step reads."""
    monkeypatch.setattr(transformer_impl, "get_device_id", lambda: "cpu")
    monkeypatch.setattr(transformer_impl, "get_device_name", lambda: "cpu")
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)
    model = Qwen2ForCausalLM(config).float()

    def make_engine(pad_to_length=False, bucket=8):
        engine = object.__new__(transformer_impl.FSDPEngineWithLMHead)
        engine.module = Qwen2ForCausalLM(config).float()
        engine.module.load_state_dict(model.state_dict())
        engine.pad_to_length, engine.pad_to_length_bucket = pad_to_length, bucket
        engine.use_ulysses_sp, engine.ulysses_sequence_parallel_size = False, 1
        engine._autocast_dtype = torch.float32
        # what the engine's __init__ sets for the entropy of calculate_entropy=True (no torch.compile here)
        engine.engine_config = types.SimpleNamespace(entropy_checkpointing=False,
                                                     entropy_from_logits_with_chunking=False)
        engine.compute_entropy_from_logits = verl_F.entropy_from_logits
        engine.get_data_parallel_group = lambda: None
        return engine

    return make_engine


def _micro_batch(seed, *, temperature=1.0, rollout_is=None, dp_size=1, calculate_entropy=False):
    """A verl micro-batch as the actor's training step hands it to the engine: jagged input_ids and position_ids of
    prompt + response, the loss fields (response-shaped, jagged) and the non-tensor settings."""
    gen = torch.Generator().manual_seed(seed)
    plens, rlens = [3, 2, 4, 1], [5, 3, 2, 6]
    prompts = [torch.randint(0, V, (p,), generator=gen) for p in plens]
    responses = [torch.randint(0, V, (r,), generator=gen) for r in rlens]
    old = [-torch.rand(r, generator=gen) * 4 - 2 for r in rlens]  # far from the model's lp: clips bind
    rollout = [(o + 0.4 * torch.randn(r, generator=gen)).clamp(max=0) for o, r in zip(old, rlens)]
    adv = [torch.full((r,), float(torch.randn(1, generator=gen))) for r in rlens]
    mask = [torch.ones(r) for r in rlens]
    mask[1][1] = 0
    fields = {}
    if rollout_is is not None:
        width = max(rlens)
        pad = lambda xs: torch.stack([torch.nn.functional.pad(x, (0, width - len(x))) for x in xs])  # noqa: E731
        weights, _, _ = compute_rollout_correction_and_rejection_mask(
            old_log_prob=pad(old), rollout_log_prob=pad(rollout), response_mask=pad(mask), **rollout_is)
        fields["rollout_is_weights"] = _nested([w[:r] for w, r in zip(weights.batch["rollout_is_weights"], rlens)])
    data = TensorDict({"input_ids": _nested([torch.cat([p, r]) for p, r in zip(prompts, responses)]),
                       "position_ids": _nested([torch.arange(p + r) for p, r in zip(plens, rlens)]),
                       "prompts": _nested(prompts), "responses": _nested(responses), "response_mask": _nested(mask),
                       "old_log_probs": _nested(old), "advantages": _nested(adv), **fields}, batch_size=[len(plens)])
    tokens = sum(float(m.sum()) for m in mask)
    tu.assign_non_tensor(data, dp_size=dp_size, batch_num_tokens=tokens * dp_size if dp_size > 1 else None,
                         global_batch_size=len(plens) * dp_size if dp_size > 1 else None, use_remove_padding=True,
                         calculate_entropy=calculate_entropy)  # verl's trainer: True whenever entropy_coeff != 0
    if isinstance(temperature, torch.Tensor):  # verl's per-sample temperature: a [B] tensor field
        data["temperature"] = temperature
    else:
        tu.assign_non_tensor(data, temperature=temperature)
    return data


def _step(engine, data, loss_function):
    loss, output = engine.forward_step(data, loss_function=loss_function, forward_only=False)
    loss.backward()
    grads = {name: p.grad.clone() for name, p in engine.module.named_parameters() if p.grad is not None}
    return float(loss.detach()), grads, output


ENGINE_CASES = [
    ("vanilla_token_mean", dict(), dict()),
    ("vanilla_seq_mean_token_mean_temperature", dict(loss_agg_mode="seq-mean-token-mean"), dict(temperature=0.7)),
    ("vanilla_tis_per_sample_temperature", dict(clip_ratio_high=0.28),
     dict(temperature=torch.tensor([0.6, 1.0, 1.3, 0.9]), rollout_is=dict(rollout_is="token", rollout_is_threshold=1.5))),
    ("cispo_dp2", dict(policy_loss=dict(loss_mode="cispo")), dict(dp_size=2)),
    ("vanilla_entropy", dict(entropy_coeff=0.01), dict(calculate_entropy=True)),
]


def _actor(**kw):
    policy = kw.pop("policy_loss", {})
    return ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size=2, policy_loss=PolicyLossConfig(**policy),
                       **kw)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name,actor,batch", ENGINE_CASES, ids=[c[0] for c in ENGINE_CASES])
def test_engine_step_equals_verl(cpu_engine, name, actor, batch, backend):
    """One forward_step + backward of verl's engine: fused_is's loss (patched engine, logits handed over, gradient
    written in place) against verl's ppo_loss (the engine's own log_probs): the loss and every parameter gradient."""
    theirs = _step(cpu_engine(), _micro_batch(3, **batch), functools.partial(ppo_loss, config=_actor(**actor)))
    engine = fused_verl.patch_engine(cpu_engine())
    ours = _step(engine, _micro_batch(3, **batch),
                 functools.partial(fused_verl.engine_ppo_loss, config=_actor(**actor), backend=backend))
    assert abs(ours[0] - theirs[0]) <= 1e-5 * max(1.0, abs(theirs[0])), (ours[0], theirs[0])
    assert set(ours[1]) == set(theirs[1])
    for key, grad in theirs[1].items():
        err = float((ours[1][key] - grad).norm())
        assert err <= 2e-5 * max(float(grad.norm()), 1e-6), (key, err, float(grad.norm()))
    assert any(float(g.norm()) > 0 for g in theirs[1].values())
    assert fused_verl.LOGITS_KEY not in ours[2]["model_output"]  # the logits are not held past the loss


@pytest.mark.parametrize("temperature", [1.0, 0.7, "per_sample"])
def test_static_pad_rows_are_dropped(cpu_engine, temperature):
    """pad_to_length: the engine pads the packed sequence to a bucket; the pad rows (and their temperatures) never
    reach the loss."""
    cfg = _actor()
    tau = torch.tensor([0.6, 1.0, 1.3, 0.9]) if temperature == "per_sample" else temperature
    theirs = _step(cpu_engine(pad_to_length=True), _micro_batch(4, temperature=tau),
                   functools.partial(ppo_loss, config=cfg))
    engine = fused_verl.patch_engine(cpu_engine(pad_to_length=True))
    ours = _step(engine, _micro_batch(4, temperature=tau),
                 functools.partial(fused_verl.engine_ppo_loss, config=cfg, backend="torch"))
    assert abs(ours[0] - theirs[0]) <= 1e-5 * max(1.0, abs(theirs[0]))
    for key, grad in theirs[1].items():
        assert float((ours[1][key] - grad).norm()) <= 2e-5 * max(float(grad.norm()), 1e-6), key


def test_unpatched_engine_falls_back_to_verls_loss(cpu_engine):
    """An engine the hook does not patch hands over log_probs: engine_ppo_loss runs verl's own ppo_loss on them
    (with a warning), so the plugin never breaks another engine's training step."""
    cfg = _actor()
    theirs = _step(cpu_engine(), _micro_batch(7), functools.partial(ppo_loss, config=cfg))
    fused_verl._FELL_BACK.clear()
    with pytest.warns(UserWarning, match="verl's own ppo_loss runs on them"):
        ours = _step(cpu_engine(), _micro_batch(7), functools.partial(fused_verl.engine_ppo_loss, config=cfg))
    assert ours[0] == theirs[0]


def test_other_losses_and_log_prob_passes_run_as_before(cpu_engine):
    """The patched engine computes log_probs as before for any other loss function and for forward-only passes."""
    cfg = _actor()
    theirs = _step(cpu_engine(), _micro_batch(5), functools.partial(ppo_loss, config=cfg))
    engine = fused_verl.patch_engine(fused_verl.patch_engine(cpu_engine()))  # twice: harmless
    ours = _step(engine, _micro_batch(5), functools.partial(ppo_loss, config=cfg))
    assert ours[0] == theirs[0]
    with torch.no_grad():
        _, output = engine.forward_step(_micro_batch(5), loss_function=None, forward_only=True)
    assert "log_probs" in output["model_output"]


def test_refusals(cpu_engine):
    cfg = _actor()
    loss = functools.partial(fused_verl.engine_ppo_loss, config=cfg)
    data = _micro_batch(6)
    tu.assign_non_tensor(data, calculate_sum_pi_squared=True)
    with pytest.raises(ValueError, match="calculate_sum_pi_squared=True is not supported"):
        fused_verl.patch_engine(cpu_engine()).forward_step(data, loss_function=loss, forward_only=False)
    engine = fused_verl.patch_engine(cpu_engine())
    engine.use_ulysses_sp = True
    engine.module.config.vision_config = {}  # a vision-language model: its Ulysses inputs are sliced elsewhere
    with pytest.raises(ValueError, match="Ulysses sequence parallelism with a vision-language model"):
        fused_verl.engine_logits(engine, None, {}, _micro_batch(6))
    engine = fused_verl.patch_engine(cpu_engine())
    with pytest.raises(ValueError, match="calculate_entropy=False"):  # verl would drop the entropy term
        fused_verl.engine_ppo_loss(_actor(entropy_coeff=0.01), {fused_verl.LOGITS_KEY: None}, _micro_batch(6))
    with pytest.raises(ValueError, match="needs the packed logits in model_output"):
        fused_verl.engine_ppo_loss(cfg, {"entropy": None}, _micro_batch(6))
    for key in ("use_fused_kernels", "distillation_only"):
        data = _micro_batch(6)
        tu.assign_non_tensor(data, **{key: True})
        with pytest.raises(ValueError, match=f"{key}=True is not supported"):
            fused_verl.engine_logits(engine, None, {}, data)
    data = _micro_batch(6)
    tu.assign_non_tensor(data, use_remove_padding=False)
    with pytest.raises(ValueError, match="use_remove_padding=False is not supported"):
        fused_verl.engine_logits(cpu_engine(), None, {}, data)


@pytest.mark.slow
def test_external_lib_plugin():
    """`external_lib=fused_is.integrations.verl_plugin`: importing it in a fresh process patches the engine class
    and rebinds the actor worker's ppo_loss to engine_ppo_loss."""
    code = ("import fused_is.integrations.verl_plugin, verl.workers.engine_workers as w, "
            "fused_is.integrations.verl as f\n"
            "from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead as E\n"
            "assert w.ppo_loss is f.engine_ppo_loss\n"
            "assert E.prepare_model_outputs.fused_is_patched\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
