"""Deterministic parts of the RL experiments (bench/experiments/rl_task.py): task, numerics, decoding."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench" / "experiments"))
import rl_task as T  # noqa: E402

CFG = T.ModelConfig()


@pytest.fixture(scope="module")
def params():
    p = T.init_params(CFG, seed=3)
    return {k: v * 20 if v.dim() == 2 else v for k, v in p.items()}  # larger weights: non-trivial logits


def test_reward_is_exact_match_of_the_sorted_digits():
    prompts = torch.tensor([[3, 1, 2, 0, 9, 9, 5, 4, T.SEP]] * 2)
    good = torch.tensor([[0, 1, 2, 3, 4, 5, 9, 9]])
    bad = torch.tensor([[0, 1, 2, 3, 4, 5, 9, 8]])
    assert T.reward(prompts, torch.cat([good, bad])).tolist() == [1.0, 0.0]


def test_incremental_decoding_matches_the_full_forward(params):
    """The fp32 control: KV-cache decoding and the learner's full forward agree to fp32 rounding."""
    gen = torch.Generator().manual_seed(0)
    prompts = T.random_prompts(32, gen)
    responses, samp_lp, rows = T.sample(params, prompts, CFG, "fp32", gen)
    logits = T.learner_logits(params, prompts, responses, CFG)
    full = torch.log_softmax(logits, -1)
    assert (rows - full).abs().max() < 1e-4
    assert torch.equal(samp_lp, rows.gather(2, responses[..., None]).squeeze(2))


@pytest.mark.parametrize("bits,group,levels", [(8, None, 256), (4, 32, 16)])
def test_integer_weights_have_the_levels_they_claim(params, bits, group, levels):
    w = params["0.fc"]
    q = T._fake_int(w, bits, group)
    x = q.reshape(w.shape[0], -1, group) if group else q.reshape(w.shape[0], 1, -1)
    for block in x.reshape(-1, x.shape[-1])[:20]:
        assert block.unique().numel() <= levels
    assert (q - w).abs().max() <= w.abs().max() / (2 ** (bits - 1) - 1)  # at most one step of rounding
    assert not torch.equal(q, w)


def test_fp8_weights_are_e4m3_numbers_times_a_scale(params):
    w = params["0.qkv"]
    q = T._fake_fp8(w, dim=1)
    scale = (w.abs().amax(dim=1, keepdim=True) / 448.0)
    scaled = q / scale
    assert torch.allclose(scaled.to(torch.float8_e4m3fn).float(), scaled, rtol=1e-6, atol=0)


def test_sampler_numerics_differ_from_the_learner_in_the_expected_order(params):
    """Mismatch (max |p_s - p_l|) is ~0 for fp32 and grows bf16-level < int4-level on the same samples."""
    prompts = T.random_prompts(64, torch.Generator().manual_seed(1))
    errs = {}
    for numerics in ("fp32", "bf16", "bf16_fp32_head", "int8", "int4", "fp8"):
        sp = T.sampler_params(params, numerics)
        assert (sp["head"].dtype == torch.bfloat16) == numerics.startswith("bf16")
        _, _, rows = T.sample(sp, prompts, CFG, numerics, torch.Generator().manual_seed(2))
        responses, _, ref_rows = T.sample(params, prompts, CFG, "fp32", torch.Generator().manual_seed(2))
        errs[numerics] = float((rows.exp() - ref_rows.exp()).abs().max())
    assert errs["fp32"] == 0.0  # the same sampler code and weights: bitwise identical
    assert 0 < errs["int8"] < errs["int4"]
    assert errs["bf16"] > 0 and errs["fp8"] > errs["int8"]
    with pytest.raises(ValueError, match="numerics"):
        T.sampler_params(params, "int2")


def test_the_asynchronous_rl_runs_take_their_options(monkeypatch, tmp_path):
    """staleness.py --async-rl: every run (M2PO, the loglinear proximal without the recompute pass, score centering
    from the sampler's top-K) goes through policy_loss for a few steps from a random checkpoint (no training here)."""
    import staleness as S

    monkeypatch.setattr(T, "load_or_train", lambda *a, **k: (T.init_params(CFG, seed=0), {}))
    for name in S.ASYNC_RUNS:
        rows = S.run_one((name, name, 2, 0, 3, 3e-4, str(tmp_path)))
        steps = [r for r in rows if "loss_seconds" in r]
        assert len(steps) == 3 and all(r["loss_seconds"] > 0 and r["grad_norm"] >= 0 for r in steps), (name, rows)
        assert all(r["mismatch_k3"] >= 0 for r in steps)
