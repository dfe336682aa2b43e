"""LossConfig and PRESETS: DESIGN.md section 2's table to the letter, and every bad value named."""

import dataclasses

import pytest

import fused_is
from fused_is import LossConfig

# DESIGN.md section 2 table: preset -> the fields its row sets (everything else keeps the default)
TABLE = {
    "reinforce": dict(policy="reinforce", is_level="none"),
    "reinforce_tis": dict(policy="reinforce", is_level="token", is_mode="truncate", is_cap=2.0),
    "ppo": dict(policy="ppo", ratio_ref="old", is_level="none"),
    "ppo_tis": dict(policy="ppo", ratio_ref="old", is_level="token", is_mode="truncate", is_cap=2.0),
    "ppo_is": dict(policy="ppo", ratio_ref="sampler", is_level="none"),
    "vanilla_is": dict(policy="ppo", ratio_ref="old", is_level="token", is_mode="raw"),
    "seq_is": dict(policy="reinforce", is_level="sequence", is_mode="raw"),
    "seq_tis": dict(policy="ppo", ratio_ref="old", is_level="sequence", is_mode="truncate", is_cap=2.0),
    "token_mis": dict(policy="ppo", ratio_ref="old", is_level="token", is_mode="mask", is_cap=2.0),
    "seq_mis": dict(policy="ppo", ratio_ref="old", is_level="sequence", is_mode="mask", is_cap=2.0),
    "mis_ppo_token": dict(policy="ppo", ratio_ref="sampler", is_level="token", is_mode="reject", is_cap=2.0),
    "mis_ppo_seq": dict(policy="ppo", ratio_ref="sampler", is_level="sequence", is_mode="reject", is_cap=2.0),
    "geo_mis": dict(policy="ppo", ratio_ref="old", is_level="geometric", is_mode="reject", is_cap=1.001,
                    is_floor=0.999),
}


def test_default_is_ppo_tis():
    cfg = LossConfig()
    assert cfg == fused_is.PRESETS["ppo_tis"]
    assert (cfg.policy, cfg.ratio_ref, cfg.clip_low, cfg.clip_high, cfg.dual_clip, cfg.is_level, cfg.is_mode,
            cfg.is_cap, cfg.is_floor, cfg.temperature, cfg.entropy_coef, cfg.kl_coef, cfg.kl_type, cfg.loss_agg,
            cfg.norm_length) == ("ppo", "old", 0.2, 0.2, None, "token", "truncate", 2.0, None, 1.0, 0.0, 0.0,
                                 "k3", "token-mean", None)


# DESIGN.md section 7: one preset per trainer policy, with its source's defaults
TRAINER_TABLE = {
    "gspo": dict(ratio_level="sequence", is_level="none", clip_low=3e-4, clip_high=4e-4,
                 loss_agg="seq-mean-token-mean"),
    "gmpo": dict(policy="gmpo", is_level="none", clip_low=0.4, clip_high=0.4, loss_agg="seq-mean-token-mean"),
    "sapo": dict(policy="sapo", is_level="none", loss_agg="seq-mean-token-mean"),
    "cispo": dict(policy="cispo", is_level="none", clip_low=1.0, clip_high=4.0),
    "dppo_tv": dict(policy="dppo_tv", is_level="none", ratio_cap=3.0, log_ratio_clamp=20.0),
    "dppo_kl": dict(policy="dppo_kl", is_level="none", ratio_cap=3.0, log_ratio_clamp=20.0),
    "clip_cov": dict(policy="clip_cov", is_level="none"),
    "kl_cov": dict(policy="kl_cov", is_level="none"),
    "vespo": dict(policy="vespo", is_level="none"),
    "prime_rl": dict(policy="prime_rl", ratio_ref="sampler", is_level="none", clip_low=0.2, clip_high=0.2,
                     ratio_penalty_coef=1e-3),
}


def test_trainer_presets_match_the_table():
    assert set(fused_is.config.TRAINER_PRESET_NAMES) == set(TRAINER_TABLE)
    for name, fields in TRAINER_TABLE.items():
        assert fused_is.PRESETS[name] == dataclasses.replace(LossConfig(), **fields), name
    cov = fused_is.PRESETS["kl_cov"]  # verl's PolicyLossConfig defaults
    assert (cov.cov_ratio, cov.cov_kl_coef, cov.cov_bounds) == (0.0002, 0.1, (1.0, 5.0))
    # an IS correction composes with them like with the seed's presets
    assert LossConfig.preset("gspo", is_level="sequence", is_mode="mask").is_level == "sequence"


def test_presets_match_the_table():
    assert set(fused_is.config.SEED_PRESET_NAMES) == set(TABLE)
    assert set(fused_is.PRESETS) == set(TABLE) | set(TRAINER_TABLE)
    for name, fields in TABLE.items():
        assert fused_is.PRESETS[name] == dataclasses.replace(LossConfig(), **fields), name
        assert LossConfig.preset(name) == fused_is.PRESETS[name]


def test_presets_are_read_only_and_frozen():
    with pytest.raises(TypeError):
        fused_is.PRESETS["mine"] = LossConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        LossConfig().is_cap = 3.0


def test_preset_overrides():
    cfg = LossConfig.preset("seq_mis", is_cap=3.0, loss_agg="seq-mean-token-mean")
    assert cfg.is_cap == 3.0 and cfg.loss_agg == "seq-mean-token-mean" and cfg.is_level == "sequence"
    with pytest.raises(ValueError, match="unknown preset"):
        LossConfig.preset("ppo_tiss")
    with pytest.raises(ValueError, match="no field"):
        LossConfig.preset("ppo", is_capp=3.0)
    with pytest.raises(ValueError, match="is_floor"):
        LossConfig.preset("geo_mis", is_cap=0.5)  # floor 0.999 > cap 0.5


@pytest.mark.parametrize(
    "field,value,exc",
    [
        ("policy", "grpo", ValueError),
        ("policy", 1, TypeError),
        ("ratio_ref", "new", ValueError),
        ("is_level", "batch", ValueError),
        ("is_mode", "clip", ValueError),
        ("kl_type", "k4", ValueError),
        ("loss_agg", "sum", ValueError),
        ("clip_low", -0.1, ValueError),
        ("clip_low", 1.5, ValueError),
        ("clip_high", -0.2, ValueError),
        ("clip_high", "0.2", TypeError),
        ("dual_clip", 1.0, ValueError),
        ("dual_clip", 0.5, ValueError),
        ("log_ratio_clamp", 0.0, ValueError),
        ("kl_clamp", 0.0, ValueError),
        ("kl_clamp", float("inf"), ValueError),
        ("kl_weight", "ratio_weighted", ValueError),
        ("kl_weight", True, TypeError),
        ("kl_weight", None, TypeError),
        ("kl_ratio_weighted", 1, TypeError),  # the deprecated booleans stay booleans
        ("kl_score", "yes", TypeError),
        ("kl_sampler_weight", 1, TypeError),
        ("kl_input_clamp", 0.0, ValueError),
        ("kl_input_clamp", float("nan"), ValueError),
        ("kl_type", "k2+", ValueError),
        ("policy", "gspo", ValueError),
        ("ratio_level", "geometric", ValueError),
        ("sapo_tau_pos", 0.0, ValueError),
        ("sapo_tau_neg", float("nan"), ValueError),
        ("log_ratio_clamp", -20.0, ValueError),
        ("log_ratio_clamp", float("nan"), ValueError),
        ("is_cap", 0.0, ValueError),
        ("is_cap", -2.0, ValueError),
        ("is_cap", float("nan"), ValueError),
        ("is_floor", -0.1, ValueError),
        ("is_floor", 2.5, ValueError),
        ("temperature", 0.0, ValueError),
        ("temperature", -1.0, ValueError),
        ("temperature", float("inf"), ValueError),
        ("entropy_coef", float("nan"), ValueError),
        ("kl_coef", True, TypeError),
        ("norm_length", 0, ValueError),
        ("norm_length", 2.5, TypeError),
        ("rejection", {"token_k4": 1.0}, ValueError),
        ("rejection", {"token_k1": 0.5}, ValueError),  # k1: (low, high) ratio bounds, or x >= 1 for [1/x, x]
        ("rejection", {"token_k1": (2.0, 0.5)}, ValueError),
        ("rejection", {"token_k1": (0.0, 2.0)}, ValueError),
        ("rejection", {"seq_mean_k3": 0.0}, ValueError),
        ("rejection", {"seq_max_k2": float("nan")}, ValueError),
        ("rejection", {"seq_max_k1": (0.5, 2.0)}, ValueError),  # verl has no seq_max_k1
        ("rejection", [("token_k2", 1.0), ("token_k2", 2.0)], ValueError),
        ("rejection", "token_k1", TypeError),
        ("off_policy_mask", float("nan"), ValueError),
        ("off_policy_mask", "0.1", TypeError),
    ],
)
def test_bad_values_name_the_field(field, value, exc):
    with pytest.raises(exc, match=field):
        LossConfig(**{field: value})


def test_kl_weights_and_input_clamp_combinations():
    """The score and sampler weights are not taken with a straight-through estimator (its k2 gradient would drop
    their term), nor is the input clamp; the ratio weight not with the sequence ratio (TRL's weight there is the
    sequence ratio, not built); the sampler weight needs the sampler's logprobs. Each message names kl_weight."""
    for fields, match in ((dict(kl_weight="score", kl_type="k3+"), "kl_weight='score'.*kl_type='k3\\+'"),
                          (dict(kl_weight="sampler", kl_type="k1+"), "kl_weight='sampler'.*kl_type='k1\\+'"),
                          (dict(kl_weight="ratio", ratio_level="sequence"), "kl_weight='ratio'.*ratio_level"),
                          (dict(kl_input_clamp=1.0, kl_type="k1+"), "kl_input_clamp")):
        with pytest.raises(ValueError, match=match):
            LossConfig(**fields)
    # what is taken: the ratio weight with a straight-through estimator (it multiplies after the clamp), the score
    # weight with the sequence ratio
    assert LossConfig(kl_weight="ratio", kl_type="k3+").kl_weight == "ratio"
    assert LossConfig(kl_weight="score", ratio_level="sequence").kl_weight == "score"
    config = LossConfig(policy="ppo", is_level="none", kl_coef=0.1, kl_weight="sampler")
    from fused_is.testing import make_inputs

    inputs = make_inputs("packed", seed=3)
    with pytest.raises(ValueError, match="sampler_logprobs is required by LossConfig.kl_weight='sampler'"):
        fused_is.policy_loss(inputs.logits, inputs.tokens, inputs.advantages, ref_logprobs=inputs.ref_logprobs,
                             mask=inputs.mask, cu_seqlens=inputs.cu_seqlens, config=config)


def test_kl_weight_choices_and_the_abi():
    """kl_weight takes KL_WEIGHTS, "none" by default; the kernels' enum has the same names, in the same order."""
    from fused_is.backends.abi import ENUMS

    assert LossConfig().kl_weight == "none"
    assert fused_is.config.KL_WEIGHTS == ("none", "ratio", "score", "sampler")
    assert ENUMS["kl_ratio_weighted"] == {"none": 0, "ratio": 1, "score": 2, "sampler": 3}
    assert tuple(ENUMS["kl_ratio_weighted"]) == fused_is.config.KL_WEIGHTS
    with pytest.raises(ValueError, match="LossConfig.kl_weight must be one of"):
        LossConfig(kl_weight="bias_corrected")


DEPRECATED = [("kl_ratio_weighted", "ratio", {}), ("kl_score", "score", dict(kl_type="k2")),
              ("kl_sampler_weight", "sampler", dict(kl_input_clamp=0.5))]


@pytest.mark.parametrize("old,weight,others", DEPRECATED)
def test_deprecated_kl_booleans_warn_and_map_to_kl_weight(old, weight, others):
    """Each old boolean warns, naming its kl_weight, and builds the config kl_weight builds: equal, the same hash,
    every field the package reads the same (the boolean itself reads False once consumed: the weight lives in
    kl_weight alone). A preset override and dataclasses.replace take the old spelling too."""
    new = LossConfig(kl_coef=0.1, kl_weight=weight, **others)
    with pytest.warns(DeprecationWarning, match=f"LossConfig.{old}=True is deprecated; use kl_weight='{weight}'"):
        built = LossConfig(kl_coef=0.1, **{old: True}, **others)
    assert built == new and hash(built) == hash(new) and repr(built) == repr(new)
    assert dataclasses.asdict(built) == dataclasses.asdict(new)
    assert built.kl_weight == weight and not getattr(built, old)
    with pytest.warns(DeprecationWarning, match=old):
        assert LossConfig.preset("ppo", kl_coef=0.1, **{old: True}, **others).kl_weight == weight
    with pytest.warns(DeprecationWarning, match=old):
        assert dataclasses.replace(LossConfig(), **{old: True}).kl_weight == weight
    with pytest.warns(DeprecationWarning, match=old):  # the old boolean repeating kl_weight is no conflict
        assert LossConfig(kl_weight=weight, **{old: True}) == LossConfig(kl_weight=weight)


def test_deprecated_kl_booleans_conflicts():
    """Two old booleans, or one with another kl_weight, is a ValueError naming both; the refusals of a weight
    apply to its old spelling too."""
    names = [old for old, _, _ in DEPRECATED]
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            with pytest.raises(ValueError, match=f"{a} and {b} are set together"):
                LossConfig(**{a: True, b: True})
        for other in fused_is.config.KL_WEIGHTS:
            if other not in ("none", dict(zip(names, ("ratio", "score", "sampler")))[a]):
                with pytest.raises(ValueError, match=f"LossConfig.{a}=True .* conflicts with kl_weight='{other}'"):
                    LossConfig(kl_weight=other, **{a: True})
    with pytest.raises(ValueError, match="kl_ratio_weighted and kl_score and kl_sampler_weight"):
        LossConfig(kl_ratio_weighted=True, kl_score=True, kl_sampler_weight=True)
    with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match="kl_weight='score'.*kl_type='k3\\+'"):
        LossConfig(kl_score=True, kl_type="k3+")
    with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match="kl_weight='ratio'.*ratio_level"):
        LossConfig(kl_ratio_weighted=True, ratio_level="sequence")


def test_a_built_config_holds_one_spelling():
    """After a deprecated boolean is consumed, dataclasses.replace and a JSON round trip carry kl_weight alone: a
    new kl_weight replaces the old weight (no stale boolean to conflict with it), and nothing warns again."""
    import json
    import warnings

    with pytest.warns(DeprecationWarning):
        old = LossConfig(kl_coef=0.1, kl_score=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        assert dataclasses.replace(old, kl_weight="ratio").kl_weight == "ratio"
        assert dataclasses.replace(old, kl_weight="none").kl_weight == "none"
        assert dataclasses.replace(old, kl_clamp=1.0).kl_weight == "score"
        assert LossConfig(**json.loads(json.dumps(dataclasses.asdict(old)))) == old


def test_presets_and_package_configs_do_not_warn():
    """The presets and the package's own configs spell kl_weight: building them raises no DeprecationWarning."""
    import warnings

    from fused_is.integrations.nemo_rl import config_from_nemo_rl

    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        for name in fused_is.PRESETS:
            LossConfig.preset(name)
        assert config_from_nemo_rl(dict(use_on_policy_kl_approximation=True)).kl_weight == "sampler"
        assert config_from_nemo_rl({}).kl_weight == "score"


@pytest.mark.parametrize("policy", ["cispo", "sapo", "gmpo", "reinforce"])
def test_dual_clip_is_ppo_only(policy):
    """The trainers define the dual clip for the PPO surrogate only: elsewhere it would be silently ignored."""
    with pytest.raises(ValueError, match="dual_clip"):
        LossConfig(policy=policy, dual_clip=3.0)


def test_inf_cap_and_int_values_are_accepted():
    cfg = LossConfig(is_cap=float("inf"), clip_low=0, temperature=2, norm_length=512)
    assert cfg.is_cap == float("inf") and isinstance(cfg.temperature, float) and cfg.norm_length == 512


def test_rejection_forms_and_json_round_trip():
    """A mapping, pairs and the stored triples give one config; its JSON form (dataclasses.asdict) restores it."""
    import json

    a = LossConfig(rejection={"token_k1": (0.5, 2), "seq_mean_k3": 0.01}, off_policy_mask=0.1)
    b = LossConfig(rejection=[("token_k1", [0.5, 2.0]), ("seq_mean_k3", 0.01)], off_policy_mask=0.1)
    assert a == b and a.rejection == (("token_k1", 0.5, 2.0), ("seq_mean_k3", None, 0.01))
    assert LossConfig(**json.loads(json.dumps(dataclasses.asdict(a)))) == a
    assert hash(a) == hash(b)
    assert LossConfig(rejection=None).rejection == ()
    assert LossConfig(rejection={"seq_sum_k1": 4}).rejection == (("seq_sum_k1", 0.25, 4.0),)  # verl's "4"
