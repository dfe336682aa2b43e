"""verl's Ulysses sequence parallelism with fused_is's loss, on gloo ranks of this CPU.

Each rank runs verl 0.9.1's real `FSDPEngineWithLMHead.forward_step` with `use_ulysses_sp`: the engine pads the
micro-batch's packed rows to a multiple of the group size, hands each rank its slice, and (verl's own loss) gathers
the log_probs of every slice with `gather_outputs_and_unpad`, whose backward scales the local rows' gradient by
the group size. With `patch_engine` and `engine_ppo_loss`, each rank keeps its slice of the logits and fused_is
reduces every sequence statistic over the group instead (`sequence_group`). The loss, the metrics and every
parameter's gradient on every rank are compared with verl's.

The model is a tiny random Qwen2 without verl's Ulysses attention patch (which needs flash-attention): each rank's
slice attends within itself. Both sides see the same logits, which is all the loss comparison needs.
"""

import functools
import os
import socket
import types
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

if os.environ.get("CI") == "true":  # installed by scripts/dev.sh: no skip in CI
    import verl  # noqa: F401
else:
    pytest.importorskip("verl", reason="verl is installed (--no-deps) by the README's test command")

from transformers import Qwen2Config, Qwen2ForCausalLM  # noqa: E402
from verl.utils import torch_functional as verl_F  # noqa: E402
from verl.utils.ulysses import set_ulysses_sequence_parallel_group  # noqa: E402
from verl.workers.engine.fsdp import transformer_impl  # noqa: E402
from verl.workers.utils.losses import ppo_loss  # noqa: E402

import fused_is.integrations.verl as fused_verl  # noqa: E402
from fused_is import backends  # noqa: E402

V = 96
BACKENDS = [b for b in backends.available_backends() if b != "reference"]

# (name, actor keywords, micro-batch keywords): token and sequence aggregation, a temperature per sample, the
# rollout IS weights, GSPO's sequence ratio and data parallelism, each over the ranks' slices
CASES = [
    ("vanilla_token_mean", dict(), dict()),
    ("seq_mean_token_mean_temperature", dict(loss_agg_mode="seq-mean-token-mean"), dict(temperature=0.7)),
    ("tis_per_sample_temperature", dict(clip_ratio_high=0.28),
     dict(temperature=[0.6, 1.0, 1.3, 0.9], rollout_is=dict(rollout_is="token", rollout_is_threshold=1.5))),
    ("seq_tis_seq_mean_token_sum", dict(loss_agg_mode="seq-mean-token-sum"),
     dict(rollout_is=dict(rollout_is="sequence", rollout_is_threshold=2.0))),
    ("gspo", dict(policy_loss=dict(loss_mode="gspo"), loss_agg_mode="seq-mean-token-mean", clip_ratio_low=3e-4,
                  clip_ratio_high=4e-4), dict()),
    ("cispo_dp2_entropy", dict(policy_loss=dict(loss_mode="cispo"), entropy_coeff=0.01),
     dict(dp_size=2, calculate_entropy=True)),
    ("bypass_reinforce_token_tis", dict(policy_loss=dict(loss_mode="bypass_mode", rollout_correction=dict(
        bypass_mode=True, loss_type="reinforce", rollout_is="token", rollout_is_threshold=1.5))), dict()),
    ("geo_mean_token_sum", dict(policy_loss=dict(loss_mode="geo_mean"), loss_agg_mode="token-sum"), dict(dp_size=2)),
]


def _model():
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)
    return Qwen2ForCausalLM(config).float()


def _make_engine(state, sp_size: int, group, pad_to_length: bool):
    engine = object.__new__(transformer_impl.FSDPEngineWithLMHead)
    engine.module = _model()
    engine.module.load_state_dict(state)
    engine.pad_to_length, engine.pad_to_length_bucket = pad_to_length, 8
    engine.use_ulysses_sp, engine.ulysses_sequence_parallel_size = True, sp_size
    engine.ulysses_parallel_group = group
    engine._autocast_dtype = torch.float32
    # what the engine's __init__ would set for the entropy of calculate_entropy=True (no torch.compile here)
    engine.engine_config = types.SimpleNamespace(entropy_checkpointing=False, entropy_from_logits_with_chunking=False)
    engine.compute_entropy_from_logits = verl_F.entropy_from_logits
    engine.get_data_parallel_group = lambda: None
    return engine


def _with_correction(actor: dict) -> dict:
    """The actor keywords with a rollout_correction dict made verl's RolloutCorrectionConfig."""
    policy = dict(actor.get("policy_loss", {}))
    if isinstance(policy.get("rollout_correction"), dict):
        from verl.trainer.config.algorithm import RolloutCorrectionConfig

        policy["rollout_correction"] = RolloutCorrectionConfig(**policy["rollout_correction"])
    return dict(actor, policy_loss=policy) if policy else dict(actor)


def _worker(rank: int, world: int, port: int, backends_to_run):
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        warnings.filterwarnings("ignore", category=UserWarning)
        torch.set_num_threads(1)
        transformer_impl.get_device_id = lambda: "cpu"
        transformer_impl.get_device_name = lambda: "cpu"
        group = dist.group.WORLD
        set_ulysses_sequence_parallel_group(group)
        from test_integration_verl_engine import _actor, _micro_batch, _step

        state = _model().state_dict()
        for name, actor, batch in CASES:
            actor, batch = _with_correction(actor), dict(batch)
            if isinstance(batch.get("temperature"), list):
                batch["temperature"] = torch.tensor(batch["temperature"])
            for backend in backends_to_run:
                for pad_to_length in (False, True):
                    tag = f"rank {rank}/{world} {name} {backend} pad_to_length={pad_to_length}"
                    theirs = _step(_make_engine(state, world, group, pad_to_length), _micro_batch(3, **batch),
                                   functools.partial(ppo_loss, config=_actor(**actor)))
                    engine = fused_verl.patch_engine(_make_engine(state, world, group, pad_to_length))
                    ours = _step(engine, _micro_batch(3, **batch),
                                 functools.partial(fused_verl.engine_ppo_loss, config=_actor(**actor), backend=backend))
                    assert abs(ours[0] - theirs[0]) <= 1e-5 * max(1.0, abs(theirs[0])), (tag, ours[0], theirs[0])
                    assert set(ours[1]) == set(theirs[1]), (tag, set(ours[1]) ^ set(theirs[1]))
                    for key, grad in theirs[1].items():
                        err = float((ours[1][key] - grad).norm())
                        assert err <= 2e-5 * max(float(grad.norm()), 1e-6), (tag, key, err, float(grad.norm()))
                    # a rank's slice may hold only clipped or masked tokens (zero gradient); the group may not
                    moved = torch.tensor([float(any(float(g.norm()) > 0 for g in theirs[1].values()))])
                    dist.all_reduce(moved)
                    assert float(moved) > 0, (tag, "no gradient on any rank")
                    assert "fused_is/entropy_mean" in ours[2]["metrics"], tag
                    assert fused_verl.LOGITS_KEY not in ours[2]["model_output"], tag
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_ulysses_engine_step_equals_verl(world):
    """2 ranks (26 rows: no Ulysses pad) and 3 (sequences cut across three slices, one pad row), each also with
    the engine's static pad (pad_to_length: 32 rows, then the Ulysses pad)."""
    backends_to_run = BACKENDS if world == 2 else BACKENDS[-1:]
    mp.spawn(_worker, args=(world, _free_port(), backends_to_run), nprocs=world, join=True)


def test_ulysses_rows_cut_the_packed_rows():
    """`ulysses_rows`: rank slices of the padded rows, each sequence's segment on each rank, pad rows masked."""
    offsets = torch.tensor([0, 4, 5, 11])  # three sequences, 11 rows; 3 ranks of 4 rows: one pad row
    keywords = dict(tokens=torch.arange(11), advantages=torch.arange(11, dtype=torch.float64),
                    old_logprobs=None, mask=torch.ones(11, dtype=torch.bool), cu_seqlens=offsets)
    cut = [fused_verl.ulysses_rows(keywords, rank, 4, 1) for rank in range(3)]
    assert [c["cu_seqlens"].tolist() for c in cut] == [[0, 4, 4, 4], [0, 0, 1, 4], [0, 0, 0, 4]]
    assert torch.equal(torch.cat([c["tokens"] for c in cut]), torch.cat([torch.arange(11), torch.zeros(1).long()]))
    assert torch.cat([c["mask"] for c in cut]).tolist() == [True] * 11 + [False]
    assert all(c["old_logprobs"] is None for c in cut)
    assert keywords["cu_seqlens"].tolist() == [0, 4, 5, 11]  # the caller's keywords untouched
