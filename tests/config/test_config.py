import json

import pytest

from trl_rollout_corr import RolloutCorrectionConfig as Cfg

FIELDS = ("rollout_is", "rollout_is_threshold", "rollout_is_batch_normalize", "rollout_rs", "rollout_rs_threshold",
          "rollout_rs_threshold_lower", "rollout_token_veto_threshold", "bypass_mode", "use_policy_gradient",
          "rollout_is_threshold_lower", "rollout_is_bound")

PRESETS = {
    "decoupled_token_is": ("token", 2.0, False, None, None, None, None, False, False, None, "truncate"),
    "decoupled_seq_is": ("sequence", 2.0, False, None, None, None, None, False, False, None, "truncate"),
    "decoupled_seq_is_rs": ("sequence", 2.0, False, "sequence", 2.0, 0.5, None, False, False, None, "truncate"),
    "decoupled_geo_rs": (None, 2.0, False, "geometric", 1.001, 0.999, 1e-4, False, False, None, "truncate"),
    "ppo_is_bypass": ("token", 2.0, False, None, None, None, None, True, False, None, "truncate"),
    "pg_is": ("sequence", 2.0, False, None, None, None, None, True, True, None, "truncate"),
    "pg_rs": (None, 2.0, False, "geometric", 1.001, 0.999, 1e-4, True, True, None, "truncate"),
    "disabled": (None, 2.0, False, None, None, None, None, False, False, None, "truncate"),
    "icepop": ("token", 5.0, False, None, None, None, None, False, False, 0.5, "mask"),
    "decoupled_token_band_rs": (None, 2.0, False, "token", 2.0, 0.5, None, False, False, None, "truncate"),
    "m2po": (None, 2.0, False, None, None, None, None, False, False, None, "truncate"),
    "trl_default": ("sequence", 3.0, False, None, None, None, None, False, False, None, "mask"),
    "dppo_tv_bypass": ("token", 1e4, False, None, None, None, None, True, True, None, "truncate"),
    "dppo_kl_bypass": ("token", 1e4, False, None, None, None, None, True, True, None, "truncate"),
    "dppo_tv_prime_rl": ("token", float("inf"), False, None, None, None, None, True, True, None, "truncate"),
    "decoupled_dppo_tv": ("token", 2.0, False, None, None, None, None, False, False, None, "truncate"),
    "decoupled_dppo_kl": ("token", 2.0, False, None, None, None, None, False, False, None, "truncate"),
}


def test_defaults():
    assert tuple(getattr(Cfg(), f) for f in FIELDS) == ("token", 2.0, False, None, None, None, None, False, False,
                                                        None, "truncate")


@pytest.mark.parametrize("name", list(PRESETS))
def test_every_preset_field_value(name):
    for cfg in (getattr(Cfg, name)(), Cfg.from_preset(name)):
        got = tuple(getattr(cfg, f) for f in FIELDS)
        assert got == PRESETS[name]
    assert set(Cfg.PRESETS) == set(PRESETS)


def test_preset_arguments_and_overrides():
    assert Cfg.decoupled_token_is(threshold=3.0).rollout_is_threshold == 3.0
    c = Cfg.decoupled_seq_is_rs(is_threshold=5.0, rs_threshold=4.0)
    assert (c.rollout_is_threshold, c.rollout_rs_threshold, c.rollout_rs_threshold_lower) == (5.0, 4.0, 0.25)
    c = Cfg.pg_rs(rs_threshold=1.01, veto_threshold=1e-6)
    assert (c.rollout_rs_threshold, c.rollout_rs_threshold_lower, c.rollout_token_veto_threshold) == (1.01, 0.99, 1e-6)
    assert Cfg.from_preset("pg_is", rollout_is_batch_normalize=True).rollout_is_batch_normalize
    assert Cfg(rollout_rs="token", rollout_rs_threshold=4.0).rs_threshold_lower == 0.25


@pytest.mark.parametrize("kwargs,field", [
    (dict(use_policy_gradient=True), "use_policy_gradient"),
    (dict(rollout_rs="token"), "rollout_rs_threshold"),
    (dict(rollout_rs="token", rollout_rs_threshold=2.0, rollout_rs_threshold_lower=3.0), "rollout_rs_threshold_lower"),
    (dict(rollout_is_threshold=0.0), "rollout_is_threshold"),
    (dict(rollout_is_threshold=-1.0), "rollout_is_threshold"),
    (dict(rollout_is_threshold=float("nan")), "rollout_is_threshold"),
    (dict(rollout_rs="token", rollout_rs_threshold=0.0), "rollout_rs_threshold"),
    (dict(rollout_rs="token", rollout_rs_threshold=2.0, rollout_rs_threshold_lower=-0.5), "rollout_rs_threshold_lower"),
    (dict(rollout_token_veto_threshold=0.0), "rollout_token_veto_threshold"),
    (dict(rollout_token_veto_threshold=-1e-4), "rollout_token_veto_threshold"),
    (dict(rollout_is="tokens"), "rollout_is"),
    (dict(rollout_is="geometric"), "rollout_rs='geometric'"),
    (dict(rollout_rs="geo", rollout_rs_threshold=1.0), "rollout_rs"),
    (dict(rollout_rs_threshold=2.0), "rollout_rs_threshold"),
    (dict(bypass_mode=True, rollout_is_batch_normalize=True), "rollout_is_batch_normalize=True with bypass_mode"),
])
def test_every_validation_error_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field.replace("(", "\\(")):
        Cfg(**kwargs)


def test_unknown_preset_and_field():
    with pytest.raises(ValueError, match="Unknown rollout correction preset 'nope'.*decoupled_token_is"):
        Cfg.from_preset("nope")
    with pytest.raises(ValueError, match="Unknown RolloutCorrectionConfig field"):
        Cfg.from_dict({"rollout_iss": "token"})


@pytest.mark.parametrize("name", list(PRESETS))
def test_dict_json_yaml_round_trip(name, tmp_path):
    cfg = Cfg.from_preset(name)
    assert Cfg.from_dict(cfg.to_dict()) == cfg
    assert Cfg.from_json_string(cfg.to_json_string()) == cfg
    assert Cfg.from_yaml(cfg.to_yaml()) == cfg
    path = cfg.save_pretrained(tmp_path / "cfg")
    assert json.load(open(path)) == cfg.to_dict()
    assert Cfg.from_pretrained(tmp_path / "cfg") == cfg
    assert Cfg.from_pretrained(path) == cfg


def test_yaml_with_preset_key_and_null():
    cfg = Cfg.from_yaml("preset: decoupled_seq_is_rs\nrollout_rs_threshold: 3.0\nrollout_rs_threshold_lower: null\n")
    assert cfg.rollout_rs == "sequence" and cfg.rollout_rs_threshold == 3.0
    assert cfg.rs_threshold_lower == pytest.approx(1 / 3)
    with pytest.raises(ValueError, match="rollout_rs_threshold"):
        Cfg.from_yaml("rollout_rs: token\n")


def test_from_pretrained_missing_dir_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="rollout_correction_config.json"):
        Cfg.from_pretrained(tmp_path)
