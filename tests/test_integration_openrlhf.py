"""fused_is.integrations.openrlhf against OpenRLHF's own loss code (0.11.2, installed without its dependencies by
the README's test command): `openrlhf.models.loss.PolicyLoss` and `aggregate_loss`, and
`openrlhf.models.utils.compute_approx_kl`, composed as `PolicyModelActor.training_step` composes them.

OpenRLHF's package `openrlhf.models` imports its model classes (transformers, deepspeed, flash_attn) on import,
and `openrlhf.models.utils` imports deepspeed at the top for functions the loss never calls. The two modules are
loaded from the installed files without the package's __init__, with an empty stand-in for deepspeed present
only while `utils.py` is imported: the code under comparison is OpenRLHF's, unchanged.
"""

import importlib
import math
import os
import sys
import types
from pathlib import Path

import pytest
import torch

if os.environ.get("CI") == "true":  # installed by scripts/dev.sh: no skip in CI
    import openrlhf
else:
    openrlhf = pytest.importorskip("openrlhf", reason="openrlhf is installed (--no-deps) by the README's test command")

from fused_is import backends  # noqa: E402
from fused_is.integrations.openrlhf import actor_loss_from_logits, config_from_openrlhf  # noqa: E402

BACKENDS = [b for b in backends.available_backends() if b != "reference"]


def _openrlhf_modules():
    """(openrlhf.models.loss, openrlhf.models.utils), OpenRLHF's files as installed."""
    if "openrlhf.models.loss" not in sys.modules:
        models = types.ModuleType("openrlhf.models")
        models.__path__ = [str(Path(openrlhf.__file__).parent / "models")]
        sys.modules.setdefault("openrlhf.models", models)
        stand_in = "deepspeed" not in sys.modules and importlib.util.find_spec("deepspeed") is None
        if stand_in:
            sys.modules["deepspeed"] = types.ModuleType("deepspeed")
        try:
            importlib.import_module("openrlhf.models.utils")
            importlib.import_module("openrlhf.models.loss")
        finally:
            if stand_in:
                del sys.modules["deepspeed"]
    return sys.modules["openrlhf.models.loss"], sys.modules["openrlhf.models.utils"]


def _args(*, clip=(0.2, 0.28), dual_clip=None, kind="ppo", agg="token-mean", entropy_coef=None, level="off",
          mode="mask", gating="ratio", threshold=(0.5, 5.0), kl=None, unbiased=False):
    """OpenRLHF's hierarchized arguments (the attributes PolicyModelActor reads), after the CLI's own fix-up
    (a single threshold becomes [0.0, HIGH])."""
    ns = types.SimpleNamespace
    threshold = [0.0, *threshold] if len(threshold) == 1 else list(threshold)
    return ns(actor=ns(eps_clip_low_high=clip, eps_clip=0.2, dual_clip=dual_clip, policy_loss_type=kind,
                       loss_agg_mode=agg, entropy_coef=entropy_coef),
              algo=ns(advantage=ns(is_correction_level=level, is_correction_mode=mode, is_correction_gating=gating,
                                   is_correction_threshold=list(threshold)),
                      kl=ns(use_loss=kl is not None, init_coef=0.0 if kl is None else kl[1],
                            estimator="k1" if kl is None else kl[0], unbiased_gradient=unbiased)))


def _batch(seed: int, vocab: int = 12):
    """[B, A, V] float64 logits (peaked, so that token probabilities are moderate and the divergence gates bind),
    action ids, old / rollout / reference logprobs near the current ones, advantages and a ragged action mask."""
    gen = torch.Generator().manual_seed(seed)
    b, a = 5, 7
    logits = 2.5 * torch.randn(b, a, vocab, generator=gen, dtype=torch.float64)
    ids = torch.randint(0, vocab, (b, a), generator=gen)
    lp = torch.log_softmax(logits, -1).gather(-1, ids[..., None])[..., 0]
    noise = lambda s: s * torch.randn(b, a, generator=gen, dtype=torch.float64)  # noqa: E731
    old = (lp + noise(0.15)).clamp(max=-1e-3)
    rollout = (old + noise(0.3)).clamp(max=-1e-3)
    ref = (lp + noise(0.3)).clamp(max=-1e-3)
    adv = torch.randn(b, a, generator=gen, dtype=torch.float64)
    lengths = torch.tensor([7, 5, 3, 6, 1])
    mask = torch.arange(a)[None, :] < lengths[:, None]
    return logits, ids, old, rollout, ref, adv, mask


def _openrlhf_loss(args, logits, ids, old, rollout, ref, adv, mask, info, kl_coef):
    """PolicyModelActor.training_step's loss, from float64 logits, with OpenRLHF's own functions."""
    loss_mod, utils = _openrlhf_modules()
    logp = torch.log_softmax(logits, -1)
    lp = logp.gather(-1, ids[..., None])[..., 0]
    entropy = -(logp.exp() * logp).sum(-1)
    adv_args = args.algo.advantage
    policy = loss_mod.PolicyLoss(clip_eps_low=args.actor.eps_clip_low_high[0],
                                 clip_eps_high=args.actor.eps_clip_low_high[1], dual_clip=args.actor.dual_clip,
                                 token_level_loss=args.actor.loss_agg_mode == "token-mean",
                                 policy_loss_type=args.actor.policy_loss_type,
                                 is_correction_level=adv_args.is_correction_level,
                                 is_correction_mode=adv_args.is_correction_mode,
                                 is_correction_gating=adv_args.is_correction_gating,
                                 is_correction_threshold=adv_args.is_correction_threshold)
    fmask = mask.double()
    loss, clip_ratio, ppo_kl, vllm_kl, filtered = policy(lp, old, adv, action_mask=fmask, rollout_log_probs=rollout,
                                                         **info)
    if args.algo.kl.use_loss:
        kl = utils.compute_approx_kl(lp, ref, log_probs_old=old, kl_estimator=args.algo.kl.estimator,
                                     unbiased_gradient=args.algo.kl.unbiased_gradient)
        loss = loss + loss_mod.aggregate_loss(kl, fmask, **info) * kl_coef
    if args.actor.entropy_coef is not None:
        loss = loss - loss_mod.aggregate_loss(entropy, fmask, **info) * args.actor.entropy_coef
    return loss, dict(ppo_clip_ratio=clip_ratio, ppo_kl=ppo_kl, vllm_kl=vllm_kl, is_filter_ratio=filtered)


CASES = [
    ("ppo_token_mean", dict(), dict()),
    ("ppo_dual_clip_kl_k3_entropy", dict(dual_clip=3.0, kl=("k3", 0.1), entropy_coef=0.01), dict()),
    ("ppo_kl_k1", dict(kl=("k1", 0.2)), dict()),
    ("ppo_kl_k2_seq_agg_off", dict(kl=("k2", 0.05)), dict()),
    ("tis_token_clip", dict(level="token", mode="clip", threshold=(0.8, 1.25)), dict()),
    ("icepop_token_mask", dict(level="token", mode="mask", threshold=(0.8, 1.25)), dict()),
    ("seq_mask_tis", dict(level="seq", mode="mask", threshold=(0.9, 1.1)), dict()),
    ("token_binary_kl_gate", dict(level="token", gating="binary_kl", threshold=(0.002,)), dict()),
    ("seq_tv_gate_entropy", dict(level="seq", gating="tv", threshold=(0.02,), entropy_coef=0.02), dict()),
    ("seq_mean_icepop_entropy", dict(agg="seq-mean-token-mean", level="token", threshold=(0.8, 1.25),
                                     entropy_coef=0.01), dict()),
    ("gspo", dict(kind="gspo", clip=(3e-3, 4e-3)), dict()),
    ("gspo_against_rollout", dict(kind="gspo", clip=(0.01, 0.02), level="token"), dict()),
    ("dp2_global_tokens_tis_kl", dict(level="token", mode="clip", threshold=(0.8, 1.25), kl=("k3", 0.1),
                                      entropy_coef=0.01), dict(dp_size=2, batch_num_tokens=44.0)),
    ("dp2_global_seqs_seq_agg", dict(agg="seq-mean-token-mean", level="seq", threshold=(0.9, 1.1)),
     dict(dp_size=2, global_batch_size=12.0)),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name,arg,info", CASES, ids=[c[0] for c in CASES])
def test_actor_loss_equals_openrlhf(name, arg, info, backend):
    """Loss and d loss / d logits equal OpenRLHF's PolicyLoss + KL + entropy (fp32 kernels vs OpenRLHF in fp64)."""
    args = _args(**arg)
    logits, ids, old, rollout, ref, adv, mask = _batch(len(name))
    kl_coef = args.algo.kl.init_coef
    full_info = dict(dp_size=info.get("dp_size", 1), batch_num_tokens=info.get("batch_num_tokens"),
                     global_batch_size=info.get("global_batch_size"))
    theirs = logits.clone().requires_grad_()
    loss_t, info_t = _openrlhf_loss(args, theirs, ids, old, rollout, ref, adv, mask, full_info, kl_coef)
    loss_t.backward()
    ours = logits.float().requires_grad_()
    loss_f, info_f = actor_loss_from_logits(args, ours, ids, old.float(), adv.float(), mask,
                                            rollout_log_probs=rollout.float(), base_action_log_probs=ref.float(),
                                            backend=backend, loss_batch_info=full_info)
    loss_f.backward()
    scale = max(1.0, abs(float(loss_t)))
    assert abs(float(loss_f) - float(loss_t)) <= 2e-6 * scale, (float(loss_f), float(loss_t))
    err = float((ours.grad.double() - theirs.grad).norm())
    assert float(theirs.grad.norm()) > 0 and err <= 2e-5 * float(theirs.grad.norm()), err
    assert abs(float(info_f["ppo_kl"]) - float(info_t["ppo_kl"])) <= 1e-5
    if info_t["vllm_kl"] is not None:
        assert abs(float(info_f["vllm_kl"]) - float(info_t["vllm_kl"])) <= 1e-5
        filtered = float(info_t["is_filter_ratio"])
        assert 0.0 < filtered < 1.0, f"the correction's gate must bind on some tokens and not all: {filtered}"
        if args.algo.advantage.is_correction_level == "token":  # OpenRLHF counts sequences at sequence level
            assert abs(float(info_f["is_filter_ratio"]) - filtered) <= 1e-6


@pytest.mark.parametrize("arg,option", [
    (dict(kl=("k3", 0.1), unbiased=True), "algo.kl.unbiased_gradient"),
    (dict(kl=("k3", 0.1), agg="seq-mean-token-mean"), "actor.loss_agg_mode"),
    (dict(level="token", threshold=(0.5, 1e9)), "algo.advantage.is_correction_threshold"),
    (dict(level="seq", threshold=(0.0, 2.0)), "algo.advantage.is_correction_threshold"),
    (dict(level="token", gating="tv", threshold=(0.1, 0.2)), "algo.advantage.is_correction_threshold"),
    (dict(level="seq", mode="clip"), "algo.advantage.is_correction_mode"),
    (dict(kind="gspo", dual_clip=3.0), "actor.dual_clip"),
    (dict(kind="cispo"), "actor.policy_loss_type"),
])
def test_unsupported_options_are_refused_by_name(arg, option):
    with pytest.raises(ValueError, match=f"OpenRLHF argument --{option}="):
        config_from_openrlhf(_args(**arg))


def test_mapping_of_the_corrections():
    """TIS / IcePop map to the IS weight; the sequence and divergence gates keep the raw weight and the counts."""
    tis = config_from_openrlhf(_args(level="token", mode="clip", threshold=(0.5, 2.0)))
    assert (tis.is_level, tis.is_mode, tis.is_floor, tis.is_cap, tis.log_ratio_clamp) == ("token", "truncate", 0.5,
                                                                                         2.0, 20.0)
    seq = config_from_openrlhf(_args(level="seq", threshold=(0.5, 2.0)))
    assert seq.is_mode == "raw" and seq.rejection_counts == "keep"
    assert seq.rejection == (("seq_mean_k1", 0.5, 2.0),)
    assert math.isclose(seq.rejection[0][2], 1 / 0.5)


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_gspo_with_kl_loss_is_refused_naming_policy_loss_type(agg):
    """GSPO with the KL loss is refused by the option that makes the aggregations differ: OpenRLHF's GSPO sums its
    policy loss per sequence whatever actor.loss_agg_mode says (left at its default here, or set), while the KL
    loss follows loss_agg_mode: the message names actor.policy_loss_type, not a loss_agg_mode the user never set."""
    loss_mod, _ = _openrlhf_modules()
    assert loss_mod.PolicyLoss(policy_loss_type="gspo", token_level_loss=True).token_level_loss is False
    with pytest.raises(ValueError, match="--actor.policy_loss_type='gspo'") as caught:
        config_from_openrlhf(_args(kind="gspo", agg=agg, kl=("k3", 0.1)))
    message = str(caught.value)
    assert message.startswith("OpenRLHF argument --actor.policy_loss_type='gspo' is not supported")
    assert "--actor.loss_agg_mode=" not in message and "per sequence" in message
    # a zero KL coefficient adds no KL term: GSPO is then mapped (as without the KL loss)
    assert config_from_openrlhf(_args(kind="gspo", agg=agg, kl=("k3", 0.0))).ratio_level == "sequence"
    # PPO with the KL loss and a per-sequence loss_agg_mode: named by loss_agg_mode, with the value the user set
    with pytest.raises(ValueError, match="--actor.loss_agg_mode='seq-mean-token-mean' is not supported"):
        config_from_openrlhf(_args(agg="seq-mean-token-mean", kl=("k3", 0.1)))



@pytest.mark.parametrize("name,arg,counts", [c for c in CASES if c[2]], ids=[c[0] for c in CASES if c[2]])
def test_deprecated_count_keywords_map_onto_loss_batch_info(name, arg, counts):
    """batch_num_tokens, dp_size and global_batch_size, the keywords loss_batch_info replaced, still work: a
    DeprecationWarning, and bitwise the loss and gradient of the same counts passed as loss_batch_info (dp_size
    defaults to 1, as it did); a count given both ways is a TypeError."""
    args = _args(**arg)
    logits, ids, old, rollout, ref, adv, mask = _batch(len(name))

    def run(**keywords):
        leaf = logits.float().requires_grad_()
        loss, _ = actor_loss_from_logits(args, leaf, ids, old.float(), adv.float(), mask,
                                         rollout_log_probs=rollout.float(), base_action_log_probs=ref.float(),
                                         backend="torch", **keywords)
        loss.backward()
        return loss.detach(), leaf.grad

    want = run(loss_batch_info=counts)
    with pytest.warns(DeprecationWarning, match="loss_batch_info"):
        got = run(**counts)
    assert torch.equal(want[0], got[0]) and torch.equal(want[1], got[1])
    without_dp = {k: v for k, v in counts.items() if k != "dp_size"}
    with pytest.warns(DeprecationWarning):
        got = run(**without_dp)
    want = run(loss_batch_info=dict(without_dp, dp_size=1))
    assert torch.equal(want[0], got[0]) and torch.equal(want[1], got[1])
    with pytest.raises(TypeError, match="both as keywords and in loss_batch_info"), pytest.warns(DeprecationWarning):
        run(loss_batch_info=counts, dp_size=counts["dp_size"])
