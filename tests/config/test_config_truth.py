"""Configs that tell the truth: the flat fields show the correction that runs, a later change is honoured or refused
loudly, TRL's own vLLM-IS fields are refused with this package's equivalent, and RolloutCorrectionConfig saves,
loads and pushes like a transformers config (the Hub API stubbed: nothing here reaches the Hub)."""

from __future__ import annotations

import dataclasses
import json
import os
import pickle

import pytest

from trl_rollout_corr import RolloutCorrectionConfig, RolloutCorrGRPOConfig
from trl_rollout_corr.config.correction import CONFIG_NAME
from tests.support.trainer_utils import make_trainer

CORRECTION_FIELDS = [f.name for f in dataclasses.fields(RolloutCorrectionConfig)]


def grpo_args(tmp_path, **kwargs) -> RolloutCorrGRPOConfig:
    return RolloutCorrGRPOConfig(output_dir=str(tmp_path), report_to="none", use_cpu=True,
                                 per_device_train_batch_size=4, num_generations=4, **kwargs)


def flat(args) -> dict:
    return {name: getattr(args, name) for name in CORRECTION_FIELDS}


# ------------------------------------------------------------------ the flat fields hold the resolved values
@pytest.mark.parametrize("preset", RolloutCorrectionConfig.preset_names())
def test_flat_fields_show_the_resolved_preset(tmp_path, preset):
    args = grpo_args(tmp_path, rollout_correction_preset=preset)
    expected = RolloutCorrectionConfig.from_preset(preset).to_dict()
    shown = {k: v for k, v in flat(args).items()}
    for level in ("rollout_is", "rollout_rs"):
        assert shown[level] == (expected[level] if expected[level] is not None else "none")
        shown[level] = expected[level] if shown[level] == "none" else shown[level]
    assert shown == expected
    recorded = args.to_dict()  # what report_to backends and a saved training_args record
    assert {k: recorded[k] for k in CORRECTION_FIELDS} == flat(args)
    assert args.to_sanitized_dict()["rollout_is"] == flat(args)["rollout_is"]


def test_hand_written_case_preset_plus_override(tmp_path):
    args = grpo_args(tmp_path, rollout_correction_preset="decoupled_geo_rs", rollout_rs_threshold=1.01)
    assert (args.rollout_is, args.rollout_rs, args.rollout_rs_threshold, args.rollout_rs_threshold_lower,
            args.rollout_token_veto_threshold, args.bypass_mode) == ("none", "geometric", 1.01, 0.999, 1e-4, False)


@pytest.mark.parametrize("preset", ["decoupled_geo_rs", "pg_is", "icepop", "bypass_ppo_clip_geo_rs"])
def test_saved_args_rebuild_the_same_correction(tmp_path, preset):
    args = grpo_args(tmp_path, rollout_correction_preset=preset, rollout_rs="none")
    own = {k: v for k, v in args.to_dict().items()
           if k in CORRECTION_FIELDS or k in ("rollout_correction_preset", "pi_old_source")}
    rebuilt = grpo_args(tmp_path, **own)  # a YAML recipe written from to_dict()
    assert rebuilt.rollout_correction == args.rollout_correction
    assert args.rollout_correction.rollout_rs is None and args.rollout_rs == "none"
    unpickled = pickle.loads(pickle.dumps(args))  # what Trainer saves as training_args.bin
    assert unpickled.rollout_correction == args.rollout_correction and flat(unpickled) == flat(args)
    unpickled.rollout_is_threshold = 4.0  # still re-resolves after the round trip
    assert unpickled.rollout_correction.rollout_is_threshold == 4.0


# ------------------------------------------------------------------ a change after construction
def test_a_changed_field_is_honoured(tmp_path):
    args = grpo_args(tmp_path, rollout_correction_preset="decoupled_token_is")
    args.rollout_is_threshold = 3.0
    assert args.rollout_correction.rollout_is_threshold == 3.0 and args.correction_plan() is not None
    args.rollout_correction_preset = "pg_is"  # the new preset, the user's own threshold kept
    assert (args.rollout_correction.rollout_is, args.rollout_correction.bypass_mode,
            args.rollout_correction.use_policy_gradient, args.rollout_correction.rollout_is_threshold) == \
        ("sequence", True, True, 3.0)
    assert (args.rollout_is, args.bypass_mode, args.use_policy_gradient) == ("sequence", True, True)
    args.rollout_is_threshold = None  # back to the preset's value
    assert args.rollout_correction.rollout_is_threshold == 2.0 and args.rollout_is_threshold == 2.0
    args.rollout_rs = "token"  # alone it is invalid: the next resolution (here a read; at the latest the trainer's
    with pytest.raises(ValueError, match=r"needs rollout_rs_threshold.*args\.rollout_rs changed"):  # construction)
        args.rollout_correction  # noqa: B018
    args.update_rollout_correction(rollout_rs="token", rollout_rs_threshold=5.0)  # two coupled fields together
    assert (args.rollout_correction.rollout_rs, args.rollout_correction.rollout_rs_threshold) == ("token", 5.0)
    assert (args.rollout_rs, args.rollout_rs_threshold, args.rollout_rs_threshold_lower) == ("token", 5.0, None)
    with pytest.raises(ValueError, match="got \\['learning_rate'\\]"):
        args.update_rollout_correction(learning_rate=1.0)


@pytest.mark.parametrize("change, message", [
    (dict(rollout_rs="token"), "rollout_rs_threshold"),  # RS without its bound
    (dict(rollout_is="geometric"), "rollout_rs='geometric'"),
    (dict(loss_type="vespo"), "vespo"),  # decoupled sequence IS cannot feed VESPO
    (dict(vllm_sync_interval=0), "vllm_sync_interval"),
    (dict(pi_old_source="cache"), "pi_old_source"),
    (dict(rollout_correction_preset="no_such_preset"), "no_such_preset"),
])
def test_an_invalid_change_raises_and_leaves_the_config_as_it_was(tmp_path, change, message):
    args = grpo_args(tmp_path, rollout_correction_preset="decoupled_seq_is")
    before, before_dict = args.rollout_correction, dict(args.__dict__)
    with pytest.raises(ValueError, match=message):
        args.update_rollout_correction(**change)  # resolved at once
    assert args.rollout_correction == before and args.__dict__ == before_dict
    (name, value), = change.items()
    setattr(args, name, value)  # a plain assignment is resolved later, and never silently dropped:
    for resolve in (lambda: args.rollout_correction, args.correction_plan):
        with pytest.raises(ValueError, match=message):
            resolve()


def build_trainer(args):
    from datasets import Dataset

    from trl_rollout_corr import RolloutCorrGRPOTrainer
    from trl_rollout_corr.testing.toy_task import build_model, build_tokenizer, reverse_prompts, reverse_reward

    return RolloutCorrGRPOTrainer(model=build_model(hidden_size=32), reward_funcs=reverse_reward, args=args,
                                  train_dataset=Dataset.from_dict({"prompt": reverse_prompts(8, n_digits=4)}),
                                  processing_class=build_tokenizer())


def test_a_field_assigned_after_the_config_takes_effect_at_trainer_construction(tmp_path):
    """``args = RolloutCorrGRPOConfig(...); args.rollout_is_threshold = 5.0; RolloutCorrGRPOTrainer(args=args)``: the
    trainer runs TRL's default correction (sequence mask) with C = 5, and the flat fields show it."""
    args = grpo_args(tmp_path, max_completion_length=8, max_steps=1)
    args.rollout_is_threshold = 5.0  # nothing reads args.rollout_correction before the trainer
    args.pi_old_source = "forward"
    trainer = build_trainer(args)
    expected = RolloutCorrectionConfig(rollout_is="sequence", rollout_is_bound="mask", rollout_is_threshold=5.0)
    assert trainer.rollout_correction == expected and args.rollout_correction == expected
    assert (args.rollout_is, args.rollout_is_bound, args.rollout_is_threshold) == ("sequence", "mask", 5.0)
    assert trainer.correction_plan.pi_old == "forward"  # the plan was made from the assigned pi_old_source
    with pytest.raises(AttributeError, match="rollout_is_threshold changed after RolloutCorrGRPOTrainer was built"):
        args.rollout_is_threshold = 2.0


def test_an_invalid_assignment_raises_at_trainer_construction_naming_the_field(tmp_path):
    """Checked before TRL's trainer is built (the model named here does not exist: TRL would fail on it)."""
    from trl_rollout_corr import RolloutCorrGRPOTrainer

    args = grpo_args(tmp_path)
    args.rollout_rs = "token"  # rejection without its bound
    with pytest.raises(ValueError, match=r"rollout_rs='token' needs rollout_rs_threshold.*args\.rollout_rs changed"):
        RolloutCorrGRPOTrainer(model=str(tmp_path / "no_such_model"), reward_funcs=lambda **kw: [0.0], args=args)


def test_a_change_after_the_trainer_is_built_is_refused(tmp_path):
    trainer, _ = make_trainer(tmp_path, preset="decoupled_token_is", max_steps=1)
    args = trainer.args
    for name, value in [("rollout_is_threshold", 3.0), ("rollout_correction_preset", "pg_is"),
                        ("bypass_mode", True), ("vllm_sync_interval", 2)]:
        with pytest.raises(AttributeError, match=f"{name} changed after RolloutCorrGRPOTrainer was built"):
            setattr(args, name, value)
    with pytest.raises(AttributeError, match="rollout_rs changed after"):
        args.update_rollout_correction(rollout_rs="token", rollout_rs_threshold=2.0)
    assert trainer.rollout_correction == args.rollout_correction and args.rollout_is_threshold == 2.0
    args.rollout_is_threshold = 2.0  # the same value: no change, no error
    args.require_rollout_logprobs = True  # read live by the trainer: allowed
    args.logging_steps = 5  # TRL's fields stay TRL's business


def test_the_trainer_holds_a_frozen_copy_and_a_plan_input_is_not_changed_behind_it(tmp_path):
    """The freeze cannot be bypassed: the trainer's correction is its own frozen copy (a change to it, or to the
    args' nested config, does not reach the loss unchecked), and a TRL field the plan was made from raises."""
    trainer, _ = make_trainer(tmp_path, preset="decoupled_token_is", max_steps=1)
    args, held = trainer.args, trainer.rollout_correction
    assert held == args.rollout_correction and held is not args.rollout_correction
    with pytest.raises(AttributeError, match=r"rollout_is_threshold: this RolloutCorrectionConfig belongs to "
                                             r"RolloutCorrGRPOTrainer and is frozen"):
        held.rollout_is_threshold = 5.0
    with pytest.raises(AttributeError, match=r"belongs to RolloutCorrGRPOConfig and is frozen.*args\.rollout_is_"):
        args.rollout_correction.rollout_is_threshold = 5.0  # around the flat fields' checks: refused too
    assert held.rollout_is_threshold == 2.0 and trainer.rollout_correction is held
    plan = trainer.correction_plan
    for name, value in [("num_iterations", 2), ("gradient_accumulation_steps", 4), ("steps_per_generation", 2),
                        ("loss_type", "grpo"), ("pi_old_source", "forward")]:
        with pytest.raises(AttributeError, match=f"{name} changed after RolloutCorrGRPOTrainer was built.*planned"):
            setattr(args, name, value)
    assert trainer.correction_plan == plan and args.num_iterations == 1
    args.num_iterations = 1  # the same value: no change, no error
    copy = pickle.loads(pickle.dumps(held))  # a frozen copy stays frozen, and equal, through pickling
    assert copy == held
    with pytest.raises(AttributeError, match="frozen"):
        copy.bypass_mode = True


# ------------------------------------------------------------------ TRL's own vLLM IS fields
@pytest.mark.parametrize("name, value, field, expected", [
    ("vllm_importance_sampling_mode", "token_truncate", "rollout_is", "token"),
    ("vllm_importance_sampling_mode", "sequence_mask", "rollout_is_bound", "mask"),
    ("vllm_importance_sampling_clip_max", 2.5, "rollout_is_threshold", 2.5),
    ("vllm_importance_sampling_clip_min", 0.5, "rollout_is_threshold_lower", 0.5),
    ("vllm_importance_sampling_cap", 2.5, "rollout_is_threshold", 2.5),
])
def test_trl_importance_sampling_fields_are_translated_and_saved_as_what_runs(tmp_path, name, value, field, expected):
    args = grpo_args(tmp_path, **{name: value})
    assert getattr(args, field) == expected and getattr(args.rollout_correction, field) == expected
    assert args.to_dict()[field] == expected and args.to_dict()[name] in (None, False)  # TRL's own stays off
    with pytest.raises(ValueError, match=f"{name}=.*after construction.*update_rollout_correction"):
        setattr(args, name, value)
    assert getattr(args, name) in (None, False)


def test_trl_importance_sampling_fields_from_the_command_line(tmp_path):
    from trl import TrlParser

    parser = TrlParser((RolloutCorrGRPOConfig,))
    (args,) = parser.parse_args_and_config(["--output_dir", str(tmp_path), "--use_cpu", "--report_to", "none"])
    # no preset: TRL 1.16's own default, sequence_mask with C=3
    assert args.rollout_correction == RolloutCorrectionConfig(rollout_is="sequence", rollout_is_bound="mask",
                                                              rollout_is_threshold=3.0)
    assert args.vllm_importance_sampling_mode is None and args.vllm_importance_sampling_correction is False
    (args,) = parser.parse_args_and_config(["--output_dir", str(tmp_path), "--use_cpu", "--report_to", "none",
                                            "--vllm_importance_sampling_mode", "token_mask",
                                            "--vllm_importance_sampling_clip_min", "0.5"])
    assert (args.rollout_is, args.rollout_is_bound, args.rollout_is_threshold, args.rollout_is_threshold_lower) == (
        "token", "mask", 3.0, 0.5)


# ------------------------------------------------------------------ save / load / push like a transformers config
def test_save_pretrained_writes_only_the_config_and_loads_back(tmp_path):
    config = RolloutCorrectionConfig.from_preset("decoupled_geo_rs", rs_threshold=1.002)
    path = config.save_pretrained(tmp_path / "cfg")
    assert os.listdir(tmp_path / "cfg") == [CONFIG_NAME] and path.endswith(CONFIG_NAME)
    assert json.loads(open(path).read())["rollout_rs_threshold_lower"] == 0.998
    for source in (tmp_path / "cfg", path):
        assert RolloutCorrectionConfig.from_pretrained(source) == config


class FakeHubApi:
    """Stands in for huggingface_hub.HfApi: records the repo and the files of each upload."""

    uploads: list = []

    def __init__(self, token=None):
        self.token = token

    def create_repo(self, repo_id, private=None, exist_ok=False, **kwargs):
        from types import SimpleNamespace

        return SimpleNamespace(repo_id=repo_id)

    def upload_folder(self, repo_id, folder_path, commit_message=None, revision=None, **kwargs):
        files = {name: open(os.path.join(folder_path, name)).read() for name in os.listdir(folder_path)}
        FakeHubApi.uploads.append(dict(repo_id=repo_id, files=files, commit_message=commit_message,
                                       revision=revision, token=self.token))
        return f"https://huggingface.co/{repo_id}/commit/0"


def test_push_to_hub_uploads_the_config_and_from_pretrained_reads_it_back(tmp_path, monkeypatch):
    import huggingface_hub
    import huggingface_hub.hub_mixin

    FakeHubApi.uploads = []
    monkeypatch.setattr(huggingface_hub.hub_mixin, "HfApi", FakeHubApi)
    config = RolloutCorrectionConfig.from_preset("icepop", lower=0.4, upper=2.5)
    url = config.push_to_hub("me/rc-icepop", token="hf_x", branch="exp")
    assert url == "https://huggingface.co/me/rc-icepop/commit/0"
    (upload,) = FakeHubApi.uploads
    assert set(upload["files"]) == {CONFIG_NAME} and upload["token"] == "hf_x" and upload["revision"] == "exp"
    assert upload["commit_message"] == "Upload rollout correction config"
    hub_file = tmp_path / "hub" / CONFIG_NAME
    hub_file.parent.mkdir()
    hub_file.write_text(upload["files"][CONFIG_NAME])
    requested = {}

    def fake_download(repo_id, filename, **kwargs):
        requested.update(repo_id=repo_id, filename=filename, **kwargs)
        return str(hub_file)

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", fake_download)
    assert RolloutCorrectionConfig.from_pretrained("me/rc-icepop", revision="exp") == config
    assert requested == dict(repo_id="me/rc-icepop", filename=CONFIG_NAME, revision="exp")
    # a recipe naming the Hub repo resolves it the same way
    args = grpo_args(tmp_path, rollout_correction_config="me/rc-icepop")
    assert args.rollout_correction == config and args.rollout_is_threshold_lower == 0.4

    FakeHubApi.uploads = []
    config.save_pretrained(tmp_path / "rc-local", push_to_hub=True, push_to_hub_kwargs=dict(private=True))
    assert FakeHubApi.uploads[0]["repo_id"] == "rc-local"
